"""gpt-oss's harmony replies (pyllama.server.tool_formats): the analysis channel is the
reasoning, commentary to=functions.NAME a call, final and other commentary the content; whole,
streamed, constrained and from a real server."""
from __future__ import annotations

import pytest

from pyllama.server.tool_calls import parse
from tool_format_util import (TOOLS, check_family_detected, check_grammar, check_reply, check_round_trip_prompt,
                              family_server, read_stream, reasoning_of, scripted, server_checks)

A = "<|channel|>analysis<|message|>The user asks for the weather in Paris. Use get_weather.<|end|>"
THOUGHT = "The user asks for the weather in Paris. Use get_weather."
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
# what a required call's grammar makes the model write
FORCED = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'

CASES = [
    (A + CALL, "", [("get_weather", {"city": "Paris"})], THOUGHT),
    (A + CALL + "<|call|>", "", [("get_weather", {"city": "Paris"})], THOUGHT),
    # the recipient in the role part of the header
    (A + '<|start|>assistant to=functions.search<|channel|>commentary json<|message|>{"query": "a b", "limit": 3}',
     "", [("search", {"query": "a b", "limit": 3})], THOUGHT),
    # a preamble on the commentary channel before the call is content
    (A + "<|start|>assistant<|channel|>commentary<|message|>Let me check that.<|end|>" + CALL,
     "Let me check that.", [("get_weather", {"city": "Paris"})], THOUGHT),
    (A + "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.", "It is sunny in Paris.", [], THOUGHT),
    ("<|channel|>final<|message|>Hello!<|return|>", "Hello!", [], ""),
    (FORCED, "", [("get_weather", {"city": "Paris"})], ""),
    # not harmony at all: text
    ("Plain words.", "Plain words.", [], ""),
]


def test_detected():
    check_family_detected("harmony")


@pytest.mark.parametrize("text, content, calls, reasoning", CASES)
def test_whole_and_streamed(text, content, calls, reasoning):
    check_reply("harmony", text, content, calls, reasoning)


def test_reasoning_format_none_keeps_the_analysis_in_the_content():
    text = A + "<|start|>assistant<|channel|>final<|message|>Sunny."
    snap = parse("harmony", text, tools=TOOLS, reasoning_format="none")
    assert snap.reasoning == "" and snap.content == A + "Sunny."


def test_calls_to_unknown_functions_and_builtins():
    snap = parse("harmony", A + CALL.replace("get_weather", "get_time"), tools=TOOLS)
    assert not snap.calls and "get_time" in snap.content
    # a built-in tool's call (browser, python) is dropped, as llama-server drops it
    snap = parse("harmony", A + '<|start|>assistant<|channel|>analysis to=browser.search<|message|>{"q": 1}',
                 tools=TOOLS)
    assert not snap.calls and snap.content == "" and snap.reasoning == THOUGHT


def test_markers_are_held_back_while_streaming():
    content, reasoning, _, s = read_stream("harmony", ["<|channel|>final<|message|>Hi<|e"], tools=TOOLS)
    assert content == "Hi<|e"  # at the end, the unfinished marker is text
    from pyllama.server.tool_calls import ToolCallStream
    s = ToolCallStream("harmony", True, TOOLS)
    assert s.feed("<|channel|>analysis<|message|>Hmm<|") == [{"reasoning_content": "Hmm"}]
    assert s.feed("end|><|start|>assistant<|channel|>final<|message|>Yes") == [{"content": "Yes"}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("with_tools", [False, True])
def test_openai_client_reads_reasoning_and_content(stream, with_tools):
    text = A + "<|start|>assistant<|channel|>final<|message|>It is sunny."
    out = scripted("harmony", {"tools": TOOLS} if with_tools else {}, text, stream)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "stop"
    assert msg.content == "It is sunny." and reasoning_of(msg) == THOUGHT and not msg.tool_calls


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_reads_calls(stream):
    out = scripted("harmony", {"tools": TOOLS}, A + CALL, stream)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert reasoning_of(choice.message) == THOUGHT
    c = choice.message.tool_calls[0]
    assert (c.function.name, c.function.arguments) == ("get_weather", '{"city":"Paris"}') and c.id


def test_call_grammar():
    check_grammar("harmony", FORCED)


def test_round_trip_renders_call_and_result():
    out = scripted("harmony", {"tools": TOOLS}, A + CALL, False)
    prompt = check_round_trip_prompt("harmony", out.choices[0].message.tool_calls[0].model_dump(),
                                     "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
                                     '<|message|>{"city": "Paris"}<|call|>')
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18 C and sunny"' in prompt


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    yield from family_server(tiny_model, tmp_path_factory, "harmony")


def test_server_required_named_auto_and_round_trip(server):
    server_checks(server, "harmony", A + CALL, "to=functions.get_weather")
