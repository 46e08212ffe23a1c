"""Qwen3-Coder's XML tool calls (pyllama.server.tool_formats): a template with <function=...> and
<parameter=...> is read in that format (not as Hermes JSON), parameter values are typed by the
tool's schema, and the calls come back whole, streamed, constrained and from a real server."""
from __future__ import annotations

import pytest

from pyllama.server.tool_calls import detect_family, parse
from test_tool_calls import scripted_reply
from tool_format_templates import QWEN3_CODER, QWEN35
from tool_format_util import (TOOLS, check_family_detected, check_grammar, check_reply, check_round_trip_prompt,
                              family_server, reasoning_of, scripted, server_checks)
from tool_templates import HERMES


def call(name: str, params: list[tuple[str, str]]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


WEATHER = call("get_weather", [("city", "Paris")])

CASES = [
    (WEATHER, "", [("get_weather", {"city": "Paris"})]),
    ("I'll search first.\n\n" + call("search", [("query", 'foo("x") < 3 && y'), ("limit", "5"),
                                                ("paths", '["src", "tests"]'), ("exact", "false")])
     + "\n" + WEATHER,
     "I'll search first.",
     [("search", {"query": 'foo("x") < 3 && y', "limit": 5, "paths": ["src", "tests"], "exact": False}),
      ("get_weather", {"city": "Paris"})]),
    # a multi-line value keeps its own newlines; only the markup's are dropped
    (call("search", [("query", "def f():\n    return 1\n"), ("opts", '{"case": true}')]), "",
     [("search", {"query": "def f():\n    return 1\n", "opts": {"case": True}})]),
    # a parameter whose schema allows a string is text even when it looks like JSON
    (call("search", [("query", "42"), ("note", "null")]), "", [("search", {"query": "42", "note": "null"})]),
    # Qwen3-Coder sometimes leaves out the opening <tool_call>
    ("<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", "",
     [("get_weather", {"city": "Paris"})]),
    ("No call here.", "No call here.", []),
    # llama-server reads the calls to the end of the reply: what follows them is dropped
    (WEATHER + "\nDone.", "", [("get_weather", {"city": "Paris"})]),
]

NOT_CALLS = [
    call("get_time", [("zone", "UTC")]),                                   # not a listed function
    call("get_weather", [("town", "Paris")]),                              # not a parameter of it
    call("search", [("query", "x"), ("limit", "five")]),                   # not an integer
    call("search", [("limit", "5")]),                                       # the required query missing
    call("search", [("limit", "5"), ("query", "x")]),                      # required after optional
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',  # Hermes JSON
]


def test_qwen3_coder_template_is_not_read_as_hermes():
    """The defect: a Qwen3-Coder template holds <tool_call> too, and its calls came back as text."""
    check_family_detected("qwen3_coder")
    assert detect_family(HERMES) == "hermes"
    out = scripted("qwen3_coder", {"tools": TOOLS}, "Checking.\n" + WEATHER, False)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Checking." and msg.tool_calls[0].function.name == "get_weather"
    assert msg.tool_calls[0].function.arguments == '{"city":"Paris"}'  # llama-server's compact JSON


@pytest.mark.parametrize("text, content, calls", CASES)
def test_whole_and_streamed(text, content, calls):
    check_reply("qwen3_coder", text, content, calls)


@pytest.mark.parametrize("text", NOT_CALLS)
def test_malformed_calls_stay_content(text):
    snap = parse("qwen3_coder", "Well. " + text, tools=TOOLS)
    assert snap.content == "Well. " + text and not snap.calls


def test_long_value_streams_as_it_is_written():
    """A file written into a parameter: escapes, markup lookalikes, and a stream that keeps its
    reading between pieces give the same arguments as the whole reply."""
    text = "".join(f'line {i}: "q" \\ tab\t <p>\n</paragraph>\n' for i in range(300))
    check_reply("qwen3_coder", call("search", [("query", text), ("limit", "7")]), "",
                [("search", {"query": text, "limit": 7})])


def test_a_bad_call_after_a_good_one_is_dropped():
    """Read whole (a stream has announced the second call by the time it goes wrong)."""
    snap = parse("qwen3_coder", "Two.\n" + WEATHER + "\n" + call("search", [("limit", "5"), ("query", "x")]),
                 tools=TOOLS)
    assert snap.content == "Two." and [c.name for c in snap.calls] == ["get_weather"]


def test_partial_markers_are_held_back():
    from tool_format_util import read_stream
    content, _, calls, s = read_stream("qwen3_coder", ["Hi.\n", "<tool_", "call>\n<func"])
    assert content == "Hi.\n<tool_call>\n<func" and not calls  # at the end, the unfinished call is text
    s2 = __import__("pyllama.server.tool_calls", fromlist=["ToolCallStream"]).ToolCallStream(
        "qwen3_coder", True, TOOLS)
    assert s2.feed("Hi.\n<tool_") == [{"content": "Hi."}]
    assert s2.feed("call>\n<function=get_weather>\n<parameter=city>\nPar") == [
        {"tool_calls": [{"index": 0, "id": s2._ids[0], "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":"Par'}}]}]
    assert s2.feed("is\n</para") == [{"tool_calls": [{"index": 0, "function": {"arguments": "is"}}]}]


def qwen35(body: dict, text: str, stream: bool):
    """The reply read under a Qwen3.5-style template, whose prompt opens the thinking."""
    return scripted_reply(QWEN35, body, [text[i:i + 3] for i in range(0, len(text), 3)], stream)


def test_thinking_before_the_call():
    """Qwen3.5-style templates (with <think>) put the thinking before the calls."""
    out = qwen35({"tools": TOOLS}, "Paris, then.\n</think>\n\n" + WEATHER, True)
    msg = out.choices[0].message
    # llama-server's Qwen3-Coder parser drops the whitespace after <think>, not before the end
    assert reasoning_of(msg) == "Paris, then.\n" and msg.tool_calls[0].function.name == "get_weather"


@pytest.mark.parametrize("stream", [False, True])
def test_no_thinking_without_think_in_the_template(stream):
    """Qwen3-Coder's own template has no <think>: llama-server reads no thinking under it."""
    text = "<think>\nParis, then.\n</think>\n\nIt is sunny."
    msg = scripted("qwen3_coder", {"tools": TOOLS}, text, stream).choices[0].message
    assert reasoning_of(msg) is None and msg.content == text


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_ends_an_unclosed_thinking(stream):
    """Qwen3.5 may start a call straight from its thinking: <tool_call> ends it, as in llama-server."""
    out = qwen35({"tools": TOOLS}, "Paris, then.\n" + WEATHER, stream)
    msg = out.choices[0].message
    assert reasoning_of(msg) == "Paris, then.\n" and not msg.content
    assert [c.function.name for c in msg.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_reads_calls(stream):
    text = CASES[1][0]
    out = scripted("qwen3_coder", {"tools": TOOLS}, text, stream)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I'll search first."
    assert [c.function.name for c in choice.message.tool_calls] == ["search", "get_weather"]
    assert all(c.id and c.type == "function" for c in choice.message.tool_calls)


def test_call_grammar():
    check_grammar("qwen3_coder", WEATHER)


def test_round_trip_renders_call_and_result():
    out = scripted("qwen3_coder", {"tools": TOOLS}, WEATHER, False)
    prompt = check_round_trip_prompt("qwen3_coder", out.choices[0].message.tool_calls[0].model_dump(),
                                     "<function=get_weather>\n<parameter=city>\nParis\n</parameter>")
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in prompt


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    yield from family_server(tiny_model, tmp_path_factory, "qwen3_coder")


def test_server_required_named_auto_and_round_trip(server):
    server_checks(server, "qwen3_coder", WEATHER, "<parameter=city>")
