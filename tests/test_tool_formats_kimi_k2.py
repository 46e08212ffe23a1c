"""Kimi K2's tool calls (pyllama.server.tool_formats): a call section of
functions.NAME:IDX calls with JSON arguments, the model's ids kept; whole, streamed,
constrained and from a real server."""
from __future__ import annotations

import pytest

from pyllama.server.tool_calls import parse
from pyllama.server.tool_formats.kimi_k2 import (KIMI_ARGS_BEGIN, KIMI_CALL_BEGIN, KIMI_CALL_END,
                                                 KIMI_SECTION_BEGIN, KIMI_SECTION_END)
from tool_format_util import (TOOLS, check_family_detected, check_grammar, check_reply, check_round_trip_prompt,
                              family_server, read_stream, reasoning_of, scripted, server_checks)


def call(name: str, idx: int, args: str) -> str:
    return f"{KIMI_CALL_BEGIN}functions.{name}:{idx}{KIMI_ARGS_BEGIN}{args}{KIMI_CALL_END}"


def section(*calls: str) -> str:
    return KIMI_SECTION_BEGIN + "".join(calls) + KIMI_SECTION_END


WEATHER = section(call("get_weather", 0, '{"city": "Paris"}'))

CASES = [
    (WEATHER, "", [("get_weather", {"city": "Paris"})]),
    ("I'll run both.", "I'll run both.", []),
    ("I'll run both." + section(call("search", 0, '{"query": "}{", "limit": 2}'),
                                call("get_weather", 1, '{"city": "Paris"}')),
     "I'll run both.", [("search", {"query": "}{", "limit": 2}), ("get_weather", {"city": "Paris"})]),
    # the section markers may be missing (llama-server reads the calls alone)
    (call("get_weather", 3, '{"city": "Paris"}'), "", [("get_weather", {"city": "Paris"})]),
]

NOT_CALLS = [
    section(call("get_time", 0, "{}")),
    section(f'{KIMI_CALL_BEGIN}get_weather:0{KIMI_ARGS_BEGIN}{{"city": "Paris"}}{KIMI_CALL_END}'),
    section(call("get_weather", 0, '{"city": Paris}')),
]


def test_detected():
    check_family_detected("kimi_k2")


@pytest.mark.parametrize("text, content, calls", CASES)
def test_whole_and_streamed(text, content, calls):
    check_reply("kimi_k2", text, content, calls)


def test_ids_are_the_models():
    text = CASES[2][0]
    assert [c.id for c in parse("kimi_k2", text, tools=TOOLS).calls] == ["functions.search:0",
                                                                        "functions.get_weather:1"]
    _, _, calls, _ = read_stream("kimi_k2", list(text))
    assert [c[0] for c in calls] == ["functions.search:0", "functions.get_weather:1"]


@pytest.mark.parametrize("text", NOT_CALLS)
def test_malformed_calls_stay_content(text):
    snap = parse("kimi_k2", "Ok. " + text, tools=TOOLS)
    assert snap.content == "Ok. " + text and not snap.calls


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_reads_reasoning_and_calls(stream):
    """Kimi K2 Thinking writes its thinking in <think> tags before the calls."""
    out = scripted("kimi_k2", {"tools": TOOLS}, "<think>Weather: use the tool.</think>Checking." + WEATHER, stream)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert reasoning_of(choice.message) == "Weather: use the tool."
    c = choice.message.tool_calls[0]
    assert (c.id, c.function.name, c.function.arguments) == ("functions.get_weather:0", "get_weather",
                                                             '{"city": "Paris"}')


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_section_ends_an_unclosed_thinking(stream):
    """Kimi K2 Thinking may call straight from its thinking, as llama-server reads it."""
    out = scripted("kimi_k2", {"tools": TOOLS}, "<think>Use the tool." + WEATHER, stream)
    msg = out.choices[0].message
    assert reasoning_of(msg) == "Use the tool." and not msg.content
    assert [c.id for c in msg.tool_calls] == ["functions.get_weather:0"]


def test_reasoning_stream_other_ends():
    from pyllama.server.reasoning import ReasoningStream
    text = "<think>a <|tool_call_b" + "x" + KIMI_CALL_BEGIN + "rest"
    for pieces in (list(text), [text]):
        s = ReasoningStream("deepseek", False, (KIMI_SECTION_BEGIN, KIMI_CALL_BEGIN))
        r = c = ""
        for p in pieces:
            a, b = s.feed(p)
            r, c = r + a, c + b
        a, b = s.finish()
        assert (r + a, c + b) == ("a <|tool_call_bx", KIMI_CALL_BEGIN + "rest")


def test_call_grammar():
    check_grammar("kimi_k2", WEATHER)


def test_round_trip_renders_call_and_result():
    out = scripted("kimi_k2", {"tools": TOOLS}, WEATHER, False)
    prompt = check_round_trip_prompt("kimi_k2", out.choices[0].message.tool_calls[0].model_dump(),
                                     KIMI_CALL_BEGIN + "functions.get_weather:0" + KIMI_ARGS_BEGIN)
    assert "## Return of functions.get_weather:0\n18 C and sunny" in prompt


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    yield from family_server(tiny_model, tmp_path_factory, "kimi_k2")


def test_server_required_named_auto_and_round_trip(server):
    server_checks(server, "kimi_k2", WEATHER, KIMI_SECTION_BEGIN)
