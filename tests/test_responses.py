"""OpenAI's Responses API (/v1/responses): the request's conversion to a chat body, the reply's
output items as the `openai` package reads them (whole, and streamed through its own event
models and accumulator), and a real server driven by its client."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pyllama.server import responses as rs
from pyllama.server.http import HTTPError, StreamResponse
from scripted_api import HERMES_CALL_PIECES, scripted
from tool_templates import FAMILY_TEMPLATES

WEATHER = {"type": "function", "name": "get_weather", "description": "weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"],
                          "additionalProperties": False}}


# --- the request -----------------------------------------------------------------------------

def test_conversation_becomes_the_chat_body():
    body = {"model": "m", "instructions": "Be brief.", "max_output_tokens": 20, "temperature": 0.2, "top_p": 0.9,
            "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "store": False,
            "reasoning": {"effort": "low"}, "metadata": {"k": "v"},
            "input": [
                {"role": "developer", "content": "Use tools."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "A tool knows."}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
                {"role": "user", "content": "And tomorrow?"}]}
    chat = rs.chat_body(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "reasoning_content": "A tool knows.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "user", "content": "And tomorrow?"}]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "weather of a city", "parameters": WEATHER["parameters"]}}]
    assert (chat["tool_choice"], chat["parallel_tool_calls"], chat["max_tokens"]) == ("required", False, 20)
    assert (chat["temperature"], chat["top_p"]) == (0.2, 0.9)
    assert not {"reasoning", "metadata", "store", "instructions", "input"} & set(chat)
    assert chat["reasoning_effort"] == "low"
    # llama-server's own fields pass through to the chat path, which honours or refuses each
    passed = rs.chat_body({"input": "hi", "top_k": 5, "seed": 3, "lora": [{"id": 0, "scale": 1}]})
    assert (passed["top_k"], passed["seed"], passed["lora"]) == (5, 3, [{"id": 0, "scale": 1}])


def test_request_forms():
    assert rs.chat_body({"input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]
    # hosted tools are left out (as llama-server leaves them): the function tools remain
    mixed = rs.chat_body({"input": "hi", "tools": [{"type": "web_search"}, WEATHER, {"type": "custom", "name": "p"}]})
    assert [t["function"]["name"] for t in mixed["tools"]] == ["get_weather"]
    assert "tools" not in rs.chat_body({"input": "hi", "tools": [{"type": "web_search"}]})
    named = rs.chat_body({"input": "hi", "tool_choice": {"type": "function", "name": "get_weather"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = rs.chat_body({"input": "hi", "text": {"format": {"type": "json_schema", "name": "a", "schema": schema}}})
    assert fmt["response_format"] == {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    assert rs.chat_body({"input": "hi", "text": {"format": {"type": "json_object"}}})["response_format"] == \
        {"type": "json_object"}
    assert "response_format" not in rs.chat_body({"input": "hi", "text": {"format": {"type": "text"}}})
    # two calls of one turn go to one assistant message, each output after it
    two = rs.chat_body({"input": [
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "a", "output": [{"type": "input_text", "text": "1"}]},
        {"type": "function_call_output", "call_id": "b", "output": "2"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]})["messages"]
    assert [m["role"] for m in two] == ["user", "assistant", "tool", "tool", "assistant"]
    assert [c["id"] for c in two[1]["tool_calls"]] == ["a", "b"]
    assert two[2]["content"] == [{"type": "text", "text": "1"}]


@pytest.mark.parametrize("body, match", [
    ([1], "must be a JSON object"),
    ({}, "'input' is required"),
    ({"input": []}, "'input' is required"),
    ({"input": 3}, "'input' is required"),
    ({"input": "x", "previous_response_id": "resp_1"}, "not stored"),
    ({"input": "x", "instructions": 1}, "'instructions' must be a string"),
    ({"input": [{"role": "tool", "content": "x"}]}, r"input\[0\]\.role"),
    ({"input": [{"role": "user"}]}, r"input\[0\] needs 'content'"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "unsupported content part"),
    ({"input": [{"type": "web_search_call"}]}, "unsupported item type 'web_search_call'"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "needs 'name', 'call_id'"),
    ({"input": [{"type": "function_call_output", "call_id": "a"}]}, "needs 'call_id' and 'output'"),
    ({"input": "x", "tools": [{"name": "f"}]}, r"tools\[0\] must be an object with a 'type'"),
    ({"input": "x", "tools": [{"type": "function"}]}, r"tools\[0\] needs a 'name'"),
    ({"input": "x", "tool_choice": "sometimes"}, "'tool_choice' must be"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "'text.format' must be"),
])
def test_request_errors_are_400(body, match):
    with pytest.raises(HTTPError, match=match) as info:
        rs.chat_body(body)
    assert info.value.status == 400


# --- the reply: known model text through the real response path ---------------------------------

_EVENTS = TypeAdapter(ResponseStreamEvent)


def scripted_response(template: str, body: dict, pieces: list[str], stream: bool, stop_type: str = "eos") -> Response:
    """What the openai package reads for `body` when the model writes `pieces` (streamed: every
    event validated by its own models, numbered in order, and accumulated by its stream state)."""
    body = {"input": "Weather in Paris?", "max_output_tokens": 64, **body, "stream": stream}
    api, p, spec, task = scripted(template, rs.chat_body(body), pieces, stop_type)

    async def run():
        resp = await api._response_response(body, [[task]], spec, p)
        if not stream:
            return Response.model_validate(json.loads(resp.body))
        assert isinstance(resp, StreamResponse)
        acc = ResponseStreamState(input_tools=body.get("tools", []), text_format=openai.omit)
        final, seq = None, 0
        async for raw in resp.chunks:
            name_line, data_line = raw.decode().strip().split("\n")
            ev = _EVENTS.validate_python(json.loads(data_line[len("data: "):]))
            assert name_line == f"event: {ev.type}" and ev.sequence_number == seq
            seq += 1
            acc.handle_event(ev)  # finds each delta's item and part by its indices, as a client does
            if ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
        assert final is not None
        return final
    return asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_items(stream):
    out = scripted_response(FAMILY_TEMPLATES["hermes"], {"tools": [WEATHER]}, HERMES_CALL_PIECES, stream)
    assert out.status == "completed" and out.incomplete_details is None
    assert [o.type for o in out.output] == ["message", "function_call"]
    assert out.output_text == "Checking."
    call = out.output[1]
    assert (call.name, json.loads(call.arguments), call.status) == ("get_weather", {"city": "Paris"}, "completed")
    assert call.call_id and call.id and call.id != call.call_id
    assert (out.usage.input_tokens, out.usage.input_tokens_details.cached_tokens, out.usage.output_tokens) == \
        (10, 6, len(HERMES_CALL_PIECES))


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_then_text(stream):
    out = scripted_response(FAMILY_TEMPLATES["deepseek"], {}, ["Warm", "?\n</think>", "\n\nSunny", "."], stream)
    assert [o.type for o in out.output] == ["reasoning", "message"]
    # the whitespace around R1's tags is kept, the prompt's newline after <think> included (llama-server)
    assert out.output[0].content[0].text == "\nWarm?\n" and out.output_text == "\n\nSunny."


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_under_a_content_only_template_is_text(stream):
    # Hermes' template shows no thinking: a <think> the model writes is the message's text
    pieces = ["<think>Warm", "?</think>", "\n\nSunny", "."]
    out = scripted_response(FAMILY_TEMPLATES["hermes"], {}, pieces, stream)
    assert [o.type for o in out.output] == ["message"] and out.output_text == "".join(pieces)


@pytest.mark.parametrize("stream", [False, True])
def test_cut_short_is_incomplete(stream):
    out = scripted_response(FAMILY_TEMPLATES["hermes"], {}, ["a", "b"], stream, stop_type="limit")
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output_text == "ab"
    empty = scripted_response(FAMILY_TEMPLATES["hermes"], {}, [], stream)
    assert empty.status == "completed" and empty.output == []


# --- a real server, driven by the openai client -----------------------------------------------

def test_server_with_the_openai_client(seeded_hermes_server):
    client = openai.OpenAI(base_url=seeded_hermes_server.url + "/v1", api_key="none", max_retries=0)
    common = dict(model="m", input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=300, temperature=0.8)
    out = client.responses.create(**common)
    calls = [o for o in out.output if o.type == "function_call"]
    assert out.status == "completed" and calls, out
    assert (calls[0].name, json.loads(calls[0].arguments)) == ("get_weather", {"city": "Paris"})
    with client.responses.stream(**common) as stream:
        streamed = stream.get_final_response()
    s_calls = [o for o in streamed.output if o.type == "function_call"]
    assert (s_calls[0].name, json.loads(s_calls[0].arguments)) == ("get_weather", {"city": "Paris"})
    # round trip: the call and its output go back as input items
    follow = [{"role": "user", "content": "Weather in Paris?"}, calls[0].model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C and sunny"}]
    again = client.responses.create(model="m", input=follow, tools=[WEATHER], max_output_tokens=3)
    assert again.status in ("completed", "incomplete") and again.usage.output_tokens <= 3
    status, doc = seeded_hermes_server.post("/apply-template",
                                            rs.chat_body({"input": follow, "tools": [WEATHER]}))
    assert status == 200 and "18 C and sunny" in doc["prompt"]


def test_server_structured_output_and_errors(seeded_hermes_server):
    client = openai.OpenAI(base_url=seeded_hermes_server.url + "/v1", api_key="none", max_retries=0)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}}, "required": ["n"],
              "additionalProperties": False}
    out = client.responses.create(model="m", input="A number?", max_output_tokens=60,
                                  text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    assert out.status == "completed", out
    value = json.loads(out.output_text)
    assert set(value) == {"n"} and isinstance(value["n"], int) and value["n"] <= 99
    with pytest.raises(openai.BadRequestError, match="not stored"):
        client.responses.create(model="m", input="x", previous_response_id="resp_1")
    hosted = client.responses.create(model="m", input="x", tools=[{"type": "web_search"}], max_output_tokens=2)
    assert hosted.status in ("completed", "incomplete")  # the hosted tool is left out, as llama-server does
