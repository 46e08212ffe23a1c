"""GLM 4.5's tool calls (pyllama.server.tool_formats): <tool_call>NAME then <arg_key>/<arg_value>
pairs, values typed by the tool's schema, with its <think> reasoning; whole, streamed,
constrained and from a real server."""
from __future__ import annotations

import pytest

from pyllama.server.tool_calls import parse
from tool_format_util import (TOOLS, check_family_detected, check_grammar, check_reply, check_round_trip_prompt,
                              family_server, reasoning_of, scripted, server_checks)


def call(name: str, params: list[tuple[str, str]]) -> str:
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in params)
    return f"<tool_call>{name}\n{body}</tool_call>"


WEATHER = call("get_weather", [("city", "Paris")])

CASES = [
    (WEATHER, "", [("get_weather", {"city": "Paris"})]),
    ("Let me look that up.\n" + call("search", [("query", "a < b\nand c"), ("limit", "5"), ("paths", '["src"]'),
                                                ("exact", "true")]) + "\n" + WEATHER,
     "Let me look that up.",
     [("search", {"query": "a < b\nand c", "limit": 5, "paths": ["src"], "exact": True}),
      ("get_weather", {"city": "Paris"})]),
    # GLM's template writes pairs without newlines between them too
    ("<tool_call>search<arg_key>query</arg_key><arg_value>x</arg_value><arg_key>opts</arg_key>"
     '<arg_value>{"deep": [1, 2]}</arg_value></tool_call>', "", [("search", {"query": "x", "opts": {"deep": [1, 2]}})]),
    ("Nothing to call.", "Nothing to call.", []),
]

NOT_CALLS = [
    call("get_time", [("zone", "UTC")]),
    call("get_weather", [("town", "Paris")]),
    call("search", [("query", "x"), ("limit", "many")]),
    call("search", [("limit", "5"), ("query", "x")]),  # the required query after an optional one
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
]


def test_detected():
    check_family_detected("glm45")


@pytest.mark.parametrize("text, content, calls", CASES)
def test_whole_and_streamed(text, content, calls):
    check_reply("glm45", text, content, calls)


@pytest.mark.parametrize("text", NOT_CALLS)
def test_malformed_calls_stay_content(text):
    snap = parse("glm45", "So. " + text, tools=TOOLS)
    assert snap.content == "So. " + text and not snap.calls


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_reads_reasoning_content_and_calls(stream):
    text = "\n<think>The user wants Paris's weather.</think>\nI'll check.\n" + WEATHER
    out = scripted("glm45", {"tools": TOOLS}, text, stream)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert reasoning_of(choice.message) == "The user wants Paris's weather."
    # GLM 4.5's </think> has no whitespace of its own: the content keeps the reply's newline after it
    # (its trailing newline goes with the call, as the tool call stream reads it)
    assert choice.message.content == "\nI'll check."
    call_ = choice.message.tool_calls[0]
    assert call_.function.name == "get_weather" and call_.function.arguments == '{"city":"Paris"}' and call_.id


def test_call_grammar():
    check_grammar("glm45", WEATHER)


def test_round_trip_renders_call_and_result():
    out = scripted("glm45", {"tools": TOOLS}, WEATHER, False)
    prompt = check_round_trip_prompt("glm45", out.choices[0].message.tool_calls[0].model_dump(),
                                     "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>")
    assert "<|observation|>\n<tool_response>\n18 C and sunny\n</tool_response>" in prompt


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    yield from family_server(tiny_model, tmp_path_factory, "glm45")


def test_server_required_named_auto_and_round_trip(server):
    server_checks(server, "glm45", WEATHER, "<arg_key>city</arg_key>")
