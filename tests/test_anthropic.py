"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): the request's conversion
to a chat body, the reply's blocks as the `anthropic` package reads them (whole and streamed),
and a real server driven by that client."""
from __future__ import annotations

import asyncio
import json

import anthropic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from pyllama.server import anthropic as am
from pyllama.server.http import HTTPError, StreamResponse
from scripted_api import HERMES_CALL_PIECES, N_EVALUATED, N_PROMPT, scripted
from tool_templates import FAMILY_TEMPLATES

WEATHER = {"name": "get_weather", "description": "weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"],
                            "additionalProperties": False}}


# --- the request -----------------------------------------------------------------------------

def test_conversation_becomes_the_chat_body():
    body = {"model": "m", "max_tokens": 20, "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            "stop_sequences": ["END"], "temperature": 0.2, "top_k": 5, "top_p": 0.9, "metadata": {"user_id": "u"},
            "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "A tool knows.", "signature": "x"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
                    {"type": "text", "text": "And tomorrow?"}]}]}
    chat = am.chat_body(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "reasoning_content": "A tool knows.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]}]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "weather of a city", "parameters": WEATHER["input_schema"]}}]
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ("required", False)
    assert (chat["max_tokens"], chat["stop"], chat["temperature"], chat["top_k"], chat["top_p"]) == (20, ["END"], 0.2, 5, 0.9)
    assert "metadata" not in chat


def test_request_forms():
    one = [{"role": "user", "content": "x"}]
    assert am.chat_body({"messages": one})["max_tokens"] == am.DEFAULT_MAX_TOKENS  # llama-server lets it out too
    assert "max_tokens" not in am.chat_body({"messages": one}, count_tokens=True)
    named = am.chat_body({"messages": one, "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert "parallel_tool_calls" not in named
    assert am.chat_body({"messages": one, "tool_choice": {"type": "none"}})["tool_choice"] == "none"
    off = am.chat_body({"messages": one, "thinking": {"type": "disabled"}})
    assert off["chat_template_kwargs"] == {"enable_thinking": False}
    on = am.chat_body({"messages": one, "thinking": {"type": "enabled", "budget_tokens": 1024},
                       "chat_template_kwargs": {"enable_thinking": False, "x": 1}})
    assert on["chat_template_kwargs"] == {"enable_thinking": False, "x": 1}  # given explicitly: kept
    assert on["thinking_budget_tokens"] == 1024
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for key, value in (("output_config", {"format": {"type": "json_schema", "schema": schema}}),
                       ("output_format", {"type": "json_schema", "schema": schema})):
        assert am.chat_body({"messages": one, key: value})["response_format"] == \
            {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    result = am.chat_body({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "plain"},
        {"type": "tool_result", "tool_use_id": "u"}]}]})
    assert result["messages"] == [{"role": "tool", "tool_call_id": "t", "content": "plain"},
                                  {"role": "tool", "tool_call_id": "u", "content": ""}]


@pytest.mark.parametrize("body, match", [
    ([1], "must be a JSON object"),
    ({}, "'messages' is required"),
    ({"messages": []}, "'messages' is required"),
    ({"messages": [{"role": "system", "content": "x"}]}, r"messages\[0\]\.role"),
    ({"messages": [{"role": "user", "content": 3}]}, r"messages\[0\]\.content must be"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "unsupported content block type 'video'"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "a text block needs 'text'"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": []}]}]},
     "'input' \\(an object\\)"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "needs 'tool_use_id'"),
    ({"messages": [{"role": "user", "content": "x"}], "system": [{"type": "image"}]}, r"'system'\[0\] must be a text"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": {}}, "'tools' must be a list"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"description": "d"}]}, r"tools\[0\]"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "'tool_choice' must be"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}}, "needs 'name'"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "sometimes"}}, "'thinking' must be"),
    ({"messages": [{"role": "user", "content": "x"}], "output_config": {"format": {"type": "json_object"}}},
     "'output_config.format' must be"),
    ({"messages": [{"role": "user", "content": "x"}], "output_config": 1}, "'output_config' must be an object"),
])
def test_request_errors_are_400(body, match):
    with pytest.raises(HTTPError, match=match) as info:
        am.chat_body(body)
    assert info.value.status == 400


# --- the reply: known model text through the real response path ---------------------------------

_EVENTS = TypeAdapter(RawMessageStreamEvent)


def scripted_message(template: str, body: dict, pieces: list[str], stream: bool, stop_type: str = "eos",
                     stopping_word: str = "") -> Message:
    """What the anthropic package reads for `body` when the model writes `pieces` (streamed: its
    own accumulator over the events, each event's name checked against its type)."""
    chat = am.chat_body({"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 64,
                         **body, "stream": stream})
    api, p, spec, task = scripted(template, chat, pieces, stop_type, stopping_word)

    task.return_progress = stream  # as the handler sets it for a stream

    async def run():
        resp = await api._message_response([[task]], spec, p)
        if not stream:
            return Message.model_validate(json.loads(resp.body))
        assert isinstance(resp, StreamResponse)
        snapshot, bufs = None, {}
        async for raw in resp.chunks:
            name_line, data_line = raw.decode().strip().split("\n")
            ev = _EVENTS.validate_python(json.loads(data_line[len("data: "):]))
            assert name_line == f"event: {ev.type}"
            if snapshot is None:  # message_start, sent once placed: the cache's share of the prompt is known
                assert ev.type == "message_start"
                assert (ev.message.usage.input_tokens, ev.message.usage.cache_read_input_tokens) == \
                    (N_EVALUATED, N_PROMPT - N_EVALUATED)
            snapshot = accumulate_event(event=ev, current_snapshot=snapshot, json_bufs=bufs)
        return snapshot
    return asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_blocks(stream):
    msg = scripted_message(FAMILY_TEMPLATES["hermes"], {"tools": [WEATHER]}, HERMES_CALL_PIECES, stream)
    assert msg.stop_reason == "tool_use" and msg.stop_sequence is None
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    assert msg.content[0].text == "Checking."
    use = msg.content[1]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"}) and use.id
    assert (msg.usage.input_tokens, msg.usage.cache_read_input_tokens, msg.usage.output_tokens) == \
        (4, 6, len(HERMES_CALL_PIECES))


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_then_text(stream):
    deepseek = FAMILY_TEMPLATES["deepseek"]  # its prompt opens the thinking
    msg = scripted_message(deepseek, {}, ["Warm", "?\n</think>", "\n\nSunny", "."], stream)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    # the whitespace around R1's tags is kept, the prompt's newline after <think> included (llama-server)
    assert (msg.content[0].thinking, msg.content[1].text) == ("\nWarm?\n", "\n\nSunny.")
    assert msg.stop_reason == "end_turn"


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_under_a_content_only_template_is_text(stream):
    # Hermes' template shows no thinking: a <think> the model writes is text
    pieces = ["<think>Warm", "?</think>", "\n\nSunny", "."]
    msg = scripted_message(FAMILY_TEMPLATES["hermes"], {}, pieces, stream)
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "".join(pieces)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_reasons(stream):
    chatml = FAMILY_TEMPLATES["hermes"]
    cut = scripted_message(chatml, {}, ["a", "b"], stream, stop_type="limit")
    assert (cut.stop_reason, cut.content[0].text) == ("max_tokens", "ab")
    word = scripted_message(chatml, {"stop_sequences": ["END"]}, ["a", "b"], stream, stop_type="word",
                            stopping_word="END")
    assert (word.stop_reason, word.stop_sequence) == ("stop_sequence", "END")
    nothing = scripted_message(chatml, {}, [], stream)
    assert nothing.content == [] and nothing.stop_reason == "end_turn"


def test_malformed_call_arguments_are_kept_as_text():
    assert am.content_blocks({"content": None, "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "[1]"}}]}) == \
        [{"type": "tool_use", "id": "c", "name": "f", "input": {"arguments": "[1]"}}]


# --- a real server, driven by the anthropic client --------------------------------------------

def test_server_with_the_anthropic_client(seeded_hermes_server):
    client = anthropic.Anthropic(base_url=seeded_hermes_server.url, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    common = dict(model="m", max_tokens=300, messages=messages, tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    out = client.messages.create(**common)
    assert out.stop_reason == "tool_use", out
    use = [b for b in out.content if b.type == "tool_use"][0]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    assert out.usage.input_tokens + (out.usage.cache_read_input_tokens or 0) == \
        client.messages.count_tokens(model="m", messages=messages, tools=[WEATHER]).input_tokens
    with client.messages.stream(**common) as stream:
        streamed = stream.get_final_message()
    s_use = [b for b in streamed.content if b.type == "tool_use"][0]
    assert streamed.stop_reason == "tool_use" and (s_use.name, s_use.input) == ("get_weather", {"city": "Paris"})
    # round trip: the call and its result go back through the template
    follow = messages + [{"role": "assistant", "content": [b.model_dump() for b in out.content]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                       "content": "18 C and sunny"}]}]
    again = client.messages.create(model="m", max_tokens=3, messages=follow, tools=[WEATHER])
    assert again.stop_reason in ("end_turn", "max_tokens") and again.usage.output_tokens <= 3
    # the same as the chat body the conversation converts to
    status, doc = seeded_hermes_server.post("/apply-template",
                                            am.chat_body({"messages": follow, "tools": [WEATHER]}))
    assert status == 200 and "18 C and sunny" in doc["prompt"]


def test_server_structured_output(seeded_hermes_server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}}, "required": ["n"],
              "additionalProperties": False}
    client = anthropic.Anthropic(base_url=seeded_hermes_server.url, api_key="none", max_retries=0)
    out = client.messages.create(model="m", max_tokens=60, messages=[{"role": "user", "content": "A number?"}],
                                 extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert out.stop_reason == "end_turn", out
    value = json.loads(out.content[0].text)
    assert isinstance(value, dict) and set(value) == {"n"} and isinstance(value["n"], int) and value["n"] <= 99


def test_server_errors(seeded_hermes_server):
    client = anthropic.Anthropic(base_url=seeded_hermes_server.url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="unsupported content block type 'video'"):
        client.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [{"type": "video"}]}])
    with pytest.raises(anthropic.BadRequestError, match="does not support images"):
        client.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    status, doc = seeded_hermes_server.post("/v1/messages/count_tokens", {"messages": "hi"})
    assert status == 400 and "'messages' is required" in doc["error"]["message"]


def test_server_stream_starts_with_the_cache_share(seeded_hermes_server):
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": "The same question, twice."}]}
    seeded_hermes_server.post("/v1/messages", body)
    events = seeded_hermes_server.stream("/v1/messages", body)
    start = events[0]
    assert start["type"] == "message_start"
    usage = start["message"]["usage"]
    assert usage["cache_read_input_tokens"] > 0 and usage["input_tokens"] >= 1
    done = [e for e in events if e["type"] == "message_delta"][0]["usage"]
    assert (done["cache_read_input_tokens"], done["input_tokens"]) == \
        (usage["cache_read_input_tokens"], usage["input_tokens"])
