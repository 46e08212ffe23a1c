"""Checks shared by the tests of each format of pyllama.server.tool_formats: a known reply read
whole, streamed character by character and in random pieces (the deltas must add up to the
whole reading), through the response path as the openai client reads it, and against a real
server whose output a grammar fixes."""
from __future__ import annotations

import json
import random
from typing import Any, Optional

import llguidance as llg
import pytest

from pyllama.server.chat import ChatTemplate
from pyllama.server.tool_calls import ToolCallStream, call_grammar, detect_family, parse, parse_tool_request
from test_tool_calls import scripted_reply
from tool_format_templates import TEMPLATES

# enum: a constrained random model can only write Paris
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris"]}},
                                                        "required": ["city"], "additionalProperties": False}}}
# typed parameters: text, a number, a list, an object, a flag
TYPED = {"type": "function", "function": {"name": "search", "description": "search files", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"},
                                     "paths": {"type": "array", "items": {"type": "string"}},
                                     "opts": {"type": "object"}, "exact": {"type": "boolean"},
                                     "note": {"type": ["string", "null"]}},
    "required": ["query"]}}}
TOOLS = [TOOL, TYPED]


def read_stream(family: str, pieces: list[str], tools: Optional[list[dict]] = TOOLS, reasoning_format: str = "auto",
                read_calls: bool = True) -> tuple[str, str, list[tuple[str, str, str]], ToolCallStream]:
    """(content, reasoning, [(id, name, arguments)], stream) added up from the deltas."""
    s = ToolCallStream(family, True, tools, reasoning_format, read_calls)
    deltas: list[dict] = []
    for p in pieces:
        deltas += s.feed(p)
    deltas += s.finish()
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls: list[list[str]] = []
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(calls):
                calls.append([tc["id"], tc["function"]["name"], ""])
            calls[tc["index"]][2] += tc["function"]["arguments"]
    return content, reasoning, [tuple(c) for c in calls], s


def random_pieces(text: str, seed: int) -> list[str]:
    rnd = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        k = rnd.randint(1, 9)
        out.append(text[i:i + k])
        i += k
    return out


def check_reply(family: str, text: str, content: str, calls: list[tuple[str, Any]], reasoning: str = "",
                tools: Optional[list[dict]] = TOOLS, reasoning_format: str = "auto") -> None:
    """A reply read whole and streamed (by character and in random pieces) gives `content`,
    `calls` [(name, arguments as data)] and `reasoning`; streamed arguments equal the whole ones."""
    snap = parse(family, text, tools=tools, reasoning_format=reasoning_format)
    assert snap.content == content
    assert [(c.name, json.loads(c.arguments)) for c in snap.calls] == calls
    assert snap.reasoning == reasoning
    for pieces in (list(text), random_pieces(text, 1), random_pieces(text, 2), [text]):
        got_content, got_reasoning, got_calls, stream = read_stream(family, pieces, tools, reasoning_format)
        final = stream.snapshot
        assert got_content == final.content == content, pieces
        assert got_reasoning == reasoning
        assert [a for _, _, a in got_calls] == [c.arguments for c in final.calls] == [c.arguments for c in snap.calls]
        assert [n for _, n, _ in got_calls] == [n for n, _ in calls]


def check_family_detected(family: str) -> None:
    assert detect_family(TEMPLATES[family]) == family


def check_grammar(family: str, expected_output: str, tools: Optional[list[dict]] = None) -> None:
    """The required-call grammar is valid, accepts the expected output, and what it accepts parses."""
    for body in ({"tools": tools or [TOOL], "tool_choice": "required", "parallel_tool_calls": False},
                 {"tools": tools or [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}):
        spec = parse_tool_request(body)
        grammar = call_grammar(family, spec)
        err, msgs = llg.LLMatcher.validate_grammar_with_warnings(llg.LLMatcher.grammar_from_lark(grammar))
        assert not err, (msgs, grammar)
        assert accepts(grammar, expected_output), grammar
    snap = parse(family, expected_output, tools=tools or [TOOL])
    assert [c.name for c in snap.calls] == ["get_weather"]


def accepts(grammar: str, text: str) -> bool:
    """Whether a Lark grammar accepts exactly text, fed byte by byte (a vocabulary of 256 byte
    tokens and an end token)."""
    from pyllama.batching.constraint import _Vocab
    vocab = _Vocab([bytes([i]) for i in range(256)] + [b"\xff</s>"], [256], [256], None)
    m = llg.LLMatcher(llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=257, eos_token=256),
                      llg.LLMatcher.grammar_from_lark(grammar), log_level=0)
    for b in text.encode():
        if not m.consume_token(b):
            return False
    return m.is_accepting()


def scripted(family: str, body: dict, text: str, stream: bool, reasoning_format: str = "auto"):
    """The reply an openai client reads when the model of `family` writes text (in 3-character tokens)."""
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    return scripted_reply(TEMPLATES[family], body, pieces, stream, reasoning_format=reasoning_format)


def reasoning_of(msg: Any) -> Optional[str]:
    return (msg.model_extra or {}).get("reasoning_content")


def check_round_trip_prompt(family: str, call: dict, marker: str) -> str:
    """The call and a tool result rendered back through the family's template."""
    t = ChatTemplate(TEMPLATES[family], bos_token="<s>", eos_token="</s>")
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "18 C and sunny"}]
    prompt = t.render_request({"messages": messages, "tools": [TOOL]})
    assert "18 C and sunny" in prompt and marker in prompt, prompt
    return prompt


# --- a real server on the tiny model with the family's template

def gbnf_literal(text: str) -> str:
    return "root ::= " + json.dumps(text)  # JSON string escapes are GBNF's for these characters


def server_checks(server: Any, family: str, auto_output: str, round_trip_marker: str) -> None:
    """Required, named and auto calls read by the openai client (whole and streamed), and a round
    trip with a tool result."""
    import openai
    from openai.lib.streaming.chat import ChatCompletionStreamState
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    common = dict(model="m", messages=messages, tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
                  max_tokens=300, temperature=0.8, seed=3)
    out = client.chat.completions.create(**common)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(**common, stream=True):
        state.handle_chunk(chunk)
    s_choice = state.get_final_completion().choices[0]
    assert s_choice.finish_reason == "tool_calls"
    s_call = s_choice.message.tool_calls[0]
    assert (s_call.function.name, json.loads(s_call.function.arguments)) == ("get_weather", {"city": "Paris"})
    named = client.chat.completions.create(**{**common, "tool_choice": {"type": "function",
                                                                         "function": {"name": "get_weather"}}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"
    # auto: the model decides; here a grammar makes it write the family's call
    for stream in (False, True):
        kw = dict(model="m", messages=messages, tools=[TOOL], max_tokens=300,
                  extra_body={"grammar": gbnf_literal(auto_output)})
        if stream:
            st = ChatCompletionStreamState()
            for chunk in client.chat.completions.create(**kw, stream=True):
                st.handle_chunk(chunk)
            auto = st.get_final_completion()
        else:
            auto = client.chat.completions.create(**kw)
        a = auto.choices[0]
        assert a.finish_reason == "tool_calls", a
        assert [(c.function.name, json.loads(c.function.arguments)) for c in a.message.tool_calls] == \
            [("get_weather", {"city": "Paris"})]
    # round trip: the call and its result go back through the template
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    again = client.chat.completions.create(model="m", messages=follow, tools=[TOOL], max_tokens=8,
                                           extra_body={"grammar": gbnf_literal("It is 18 C.")})
    assert again.choices[0].message.content == "It is 18 C." and not again.choices[0].message.tool_calls
    status, doc = server.post("/apply-template", {"messages": follow, "tools": [TOOL]})
    assert status == 200 and "18 C and sunny" in doc["prompt"] and round_trip_marker in doc["prompt"], doc


def family_server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory, family: str):
    from server_util import LONG_CONTEXT, ServerProcess
    path = tmp_path_factory.mktemp("tpl") / f"{family}.jinja"
    path.write_text(TEMPLATES[family])
    server = ServerProcess(tiny_model, "--chat-template-file", str(path), "-c", "2048", "-np", "2", *LONG_CONTEXT)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
