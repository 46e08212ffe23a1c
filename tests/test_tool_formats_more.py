"""The formats of tool_formats_more.py (Functionary v3.2 / v3.1, Command R7B, Granite, Magistral,
Seed-OSS, Apertus, Nemotron v2): recognition from the template, model output written after each
family's published examples read whole, streamed character by character and in random pieces,
through the response path as the openai client reads it, the grammars of required calls, and a
real server whose required and named calls follow those grammars."""
from __future__ import annotations

import json
import random

import llguidance as llg
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from pyllama.server.chat import ChatTemplate
from pyllama.server.tool_calls import ToolCallStream, call_grammar, detect_family, parse, parse_tool_request
from test_tool_calls import ARGS, TOOL, _anonymous, _calls, _merge, _reparsed_deltas, _stream, scripted_reply
from tool_templates import FAMILY_TEMPLATES
from tool_templates_more import MORE_TEMPLATES

R7B_CALL = ('<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}'
            ',\n    {"tool_call_id": "1", "tool_name": "now", "parameters": {}}\n]<|END_ACTION|>')
SEED_CALL = ('<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
             '<parameter=days>3</parameter>\n<parameter=hourly>true</parameter>\n</function>\n</seed:tool_call>')
WEATHER = ("get_weather", {"city": "Paris"})

# (family, model text after its thinking, expected content, expected [(name, arguments as data)])
CASES = [
    ("functionary-v3.2", 'all\nLet me check.\n>>>get_weather\n{"city": "Paris"}', "Let me check.", [WEATHER]),
    ("functionary-v3.2", 'get_weather\n{"city": "Paris"}\n>>>now\n{}', None, [WEATHER, ("now", {})]),
    ("functionary-v3.2", "all\nIt is sunny in Paris.", "It is sunny in Paris.", []),
    ("functionary-v3.2", "no recipient at all", "no recipient at all", []),
    ("functionary-v3.2", "get_weather\n{oops}", "get_weather\n{oops}", []),
    ("functionary-v3.1", 'Sure.<function=get_weather>{"city": "Paris"}</function>', "Sure.", [WEATHER]),
    ("functionary-v3.1", '<function=get_weather>{"city": "Paris"}</function>\n<function=now>{}</function>', None,
     [WEATHER, ("now", {})]),
    ("functionary-v3.1", "a <function=f>not json</function>", "a <function=f>not json</function>", []),
    ("command-r7b", R7B_CALL, None, [WEATHER, ("now", {})]),
    ("command-r7b", "<|START_RESPONSE|>It is sunny in Paris.<|END_RESPONSE|>", "It is sunny in Paris.", []),
    ("command-r7b", '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "f", "parameters": 3}]<|END_ACTION|>',
     '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "f", "parameters": 3}]<|END_ACTION|>', []),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "now", "arguments": {}}]', None, [WEATHER, ("now", {})]),
    # llama-server leaves Granite's response markers in the content (its parser has no reading
    # for content that is wrapped only after a thinking)
    ("granite", "<response>It is sunny.</response>", "<response>It is sunny.</response>", []),
    ("granite", 'Sure. <response>x</response><|tool_call|>[{"name": "now", "arguments": {}}]',
     "Sure. <response>x</response>", [("now", {})]),
    ("granite", "Plain <|tool_call|> words", "Plain <|tool_call|> words", []),
    ("magistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}', None,
     [WEATHER, ("now", {})]),
    ("magistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "Sure.", [WEATHER]),
    ("seed-oss", SEED_CALL, None, [("get_weather", {"city": "Paris", "days": 3, "hourly": True})]),
    ("seed-oss", "I will look.\n<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n"
                 "</function>\n<function=now>\n</function>\n</seed:tool_call>", "I will look.", [WEATHER, ("now", {})]),
    ("seed-oss", "<seed:tool_call>\n<oops>\n</seed:tool_call>", "<seed:tool_call>\n<oops>\n</seed:tool_call>", []),
    ("apertus", '<|tools_prefix|>[{"get_weather": {"city": "Paris"}}, {"now": {}}]<|tools_suffix|>', None,
     [WEATHER, ("now", {})]),
    ("apertus", '<|tools_prefix|>[{"get_weather": {"city": "Paris"}, "x": {}}]<|tools_suffix|>',
     '<|tools_prefix|>[{"get_weather": {"city": "Paris"}, "x": {}}]<|tools_suffix|>', []),
    ("nemotron-v2", '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>', None, [WEATHER]),
    ("nemotron-v2", 'Checking. <TOOLCALL>[{"name": "now", "arguments": {}}]</TOOLCALL>', "Checking.", [("now", {})]),
    ("nemotron-v2", "Hello there.", "Hello there.", []),
]


@pytest.mark.parametrize("family, text, content, calls", CASES)
def test_parse_whole_and_streamed(family, text, content, calls):
    snap = parse(family, text)
    assert [(c.name, json.loads(c.arguments)) for c in snap.calls] == calls
    _, s = _stream(family, [text])
    got_content, got_calls = s.message()
    assert got_content == content
    assert _calls(got_calls) == calls
    rng = random.Random(len(text))
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 7)))
    for pieces in ([c for c in text], [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]):
        deltas, s = _stream(family, pieces)
        m_content, m_calls = s.message()
        assert m_content == content and _calls(m_calls) == calls
        d_content, d_calls = _merge(deltas)
        assert d_content == (content or "")
        # the argument fragments add up to exactly the final arguments (a call that went wrong
        # after it began was announced, and its text then came as content)
        assert [(c["name"], c["arguments"]) for c in d_calls][:len(m_calls) if calls else 0] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in m_calls]


@pytest.mark.parametrize("family, text", [
    ("functionary-v3.2", 'all\nSure.\n>>>write\n{"text": "' + "abcdefgh" * 8 + '"}'),
    ("functionary-v3.1", '<function=write>{"text": "' + "abcdefgh" * 8 + '"}</function>'),
    ("command-r7b", '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "write", "parameters": {"text": "'
                    + "abcdefgh" * 8 + '"}}]<|END_ACTION|>'),
    ("granite", '<|tool_call|>[{"name": "write", "arguments": {"text": "' + "abcdefgh" * 8 + '"}}]'),
    ("magistral", '[TOOL_CALLS]write[ARGS]{"text": "' + "abcdefgh" * 8 + '"}'),
    ("apertus", '<|tools_prefix|>[{"write": {"text": "' + "abcdefgh" * 8 + '"}}]<|tools_suffix|>'),
    ("nemotron-v2", '<TOOLCALL>[{"name": "write", "arguments": {"text": "' + "abcdefgh" * 8 + '"}}]</TOOLCALL>'),
    ("seed-oss", "<seed:tool_call>\n<function=write>\n"
     + "".join(f"<parameter=p{i}>{i}</parameter>\n" for i in range(12)) + "</function>\n</seed:tool_call>"),
])
def test_arguments_stream_before_the_call_ends(family, text):
    deltas, _ = _stream(family, list(text))
    fragments = [tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []) if "id" not in tc]
    assert len(fragments) > 10  # the arguments grew while the model wrote them
    head = next(d for d in deltas if "tool_calls" in d)["tool_calls"][0]
    assert head["function"] == {"name": "write", "arguments": ""}


LONG_REPLIES = [
    ("functionary-v3.2", "all\n" + "Let me look. " * 40 + f"\n>>>write\n{ARGS}\n>>>now\n{{}}"),
    ("functionary-v3.1", "Let me look. " * 40 + f"<function=write>{ARGS}</function><function=now>{{}}</function> done"),
    ("command-r7b", "<|START_RESPONSE|>" + "Let me look. " * 40 + "<|END_RESPONSE|>"
                    f'<|START_ACTION|>[{{"tool_call_id": "0", "tool_name": "write", "parameters": {ARGS}}}]'
                    "<|END_ACTION|>"),
    ("granite", f'<|tool_call|>[{{"name": "write", "arguments": {ARGS}}}, {{"name": "now", "arguments": {{}}}}]'),
    ("magistral", "Sure. " * 30 + f"[TOOL_CALLS]write[ARGS]{ARGS}[TOOL_CALLS]now[ARGS]{{}}"),
    ("seed-oss", "Sure. " * 30 + "<seed:tool_call>\n<function=write>\n"
     + "".join(f"<parameter=p{i}>line {i} <b>\n</parameter>\n" for i in range(60)) + "</function>\n</seed:tool_call>"),
    ("apertus", f'<|tools_prefix|>[{{"write": {ARGS}}}, {{"now": {{}}}}]<|tools_suffix|>'),
    ("nemotron-v2", "Sure. " * 30 + f'<TOOLCALL>[{{"name": "write", "arguments": {ARGS}}}]</TOOLCALL>'),
]


@pytest.mark.parametrize("family, text", LONG_REPLIES, ids=[f for f, _ in LONG_REPLIES])
def test_long_reply_streams_as_a_whole_reread(family, text):
    """The stream's incremental reading (its memo) gives the deltas of a whole re-read at every
    piece, character by character and in pieces of 1 to 24 characters."""
    assert len(text) > 1500
    deltas, s = _stream(family, list(text))
    assert _anonymous(deltas) == _reparsed_deltas(family, list(text))
    whole = parse(family, text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in s.message()[1]] == \
        [(c.name, c.arguments) for c in whole.calls] and whole.calls
    rng = random.Random(len(text))
    cuts, at = [], 0
    while at < len(text):
        cuts.append(text[at:at + rng.randint(1, 24)])
        at += len(cuts[-1])
    assert _anonymous(_stream(family, cuts)[0]) == _reparsed_deltas(family, cuts)


@pytest.mark.parametrize("family, text", [
    ("functionary-v3.2", "all\nHello >>"),
    ("functionary-v3.1", "Hello <funct"),
    ("command-r7b", "Hello <|START_AC"),
    ("command-r7b", "<|START_RESPONSE|>Hello <|END_RES"),
    ("granite", "Hello <|tool_"),
    ("magistral", "Hello [TOOL_C"),
    ("seed-oss", "Hello <seed:tool"),
    ("apertus", "Hello <|tools_pre"),
    ("nemotron-v2", "Hello <TOOLC"),
])
def test_partial_markers_are_held_back(family, text):
    assert parse(family, text, final=False).content == "Hello"


def test_no_parallel_calls_keeps_the_first():
    _, s = _stream("nemotron-v2", ['<TOOLCALL>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]'
                                   '</TOOLCALL>'], parallel=False)
    assert _calls(s.message()[1]) == [("a", {})]


def test_command_r7b_keeps_the_model_ids():
    _, s = _stream("command-r7b", [R7B_CALL])
    assert [c["id"] for c in s.message()[1]] == ["0", "1"]  # the model's own ids, which its results cite


SEED_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}


@pytest.mark.parametrize("stream", [False, True])
def test_seed_oss_values_follow_the_schema(stream):
    # a string parameter stays text even when it reads as JSON (llama-server types each value by
    # its schema); the others are JSON
    text = ("<seed:tool_call>\n<function=get_weather>\n<parameter=city>42</parameter>\n"
            "<parameter=days>3</parameter>\n</function>\n</seed:tool_call>")
    if stream:
        s = ToolCallStream("seed-oss", tools=[SEED_TOOL])
        for c in text:
            s.feed(c)
        s.finish()
        calls = _calls(s.message()[1])
    else:
        calls = [(c.name, json.loads(c.arguments)) for c in parse("seed-oss", text, tools=[SEED_TOOL]).calls]
    assert calls == [("get_weather", {"city": "42", "days": 3})]
    # without a schema to go by, a value that reads as JSON is that value
    assert json.loads(parse("seed-oss", text).calls[0].arguments) == {"city": 42, "days": 3}


def test_seed_oss_string_values_keep_their_whitespace():
    # the format has no newlines around a value: a string's text is the string, every character
    # of it (a file's last newline included), as llama-server reads it
    text = ("<seed:tool_call>\n<function=get_weather>\n<parameter=city>\n  New\nYork\n</parameter>\n"
            "<parameter=days> 3\n</parameter>\n</function>\n</seed:tool_call>")
    calls = [(c.name, json.loads(c.arguments)) for c in parse("seed-oss", text, tools=[SEED_TOOL]).calls]
    assert calls == [("get_weather", {"city": "\n  New\nYork\n", "days": 3})]


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_kept_in_the_content_starts_where_the_prompt_opened_it(stream):
    # Nemotron v2's prompt opens the thinking; left in the content, the thinking is shown whole,
    # its opening tag as the prompt wrote it, as llama-server shows it
    text = 'Need the weather.\n</think>\n<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'
    for body in ({"reasoning_format": "none"}, {"reasoning_format": "none", "tools": [TOOL]}):
        msg = scripted_reply(MORE_TEMPLATES["nemotron-v2"], body, list(text), stream).choices[0].message
        assert msg.model_extra.get("reasoning_content") is None
        if "tools" in body:
            assert msg.content == "<think>\nNeed the weather.\n</think>" and _calls(
                [c.model_dump() for c in msg.tool_calls]) == [WEATHER]
        else:
            assert msg.content == "<think>\n" + text
    msg = scripted_reply(MORE_TEMPLATES["nemotron-v2"], {}, list(text), stream).choices[0].message
    # Nemotron Nano v2 thinks in <think>\n...</think>: the newline before </think> stays in the reasoning
    assert msg.model_extra.get("reasoning_content") == "Need the weather.\n"


def test_magistral_ids_are_nine_characters():
    _, s = _stream("magistral", ['[TOOL_CALLS]now[ARGS]{}'])
    cid = s.message()[1][0]["id"]
    assert len(cid) == 9 and cid.isalnum()


def _read_with_tools(family: str, text: str, tools: list[dict]) -> list[tuple]:
    """(content, calls) of the reply read whole, streamed by character and in random pieces, with
    the request's tools."""
    rng = random.Random(len(text))
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 7)))
    readings = []
    for pieces in ([text], list(text), [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]):
        s = ToolCallStream(family, True, tools)
        deltas = [d for p in pieces for d in s.feed(p)] + s.finish()
        content, calls = s.message()
        d_content, d_calls = _merge(deltas)
        assert d_content == (content or "") and [c["name"] for c in d_calls] == [c["function"]["name"] for c in calls]
        readings.append((content, _calls(calls)))
    return readings


# llama-server's Magistral parser: the text up to the first [TOOL_CALLS] is the content, then come
# calls of the request's tools, each right after the one before; whatever follows them is dropped
@pytest.mark.parametrize("text, content, calls", [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}\nDone.', None, [WEATHER]),
    ("Let me check.[TOOL_CALLS]get_time[ARGS]{}", "Let me check.", []),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', None, [WEATHER]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"} and [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None,
     [WEATHER]),
    ("Hi [TOOL_CALLS] not a call", "Hi", []),
    ('Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "Sure.",
     [WEATHER, WEATHER]),
])
def test_magistral_reads_listed_calls_up_to_the_first_other_text(text, content, calls):
    for reading in _read_with_tools("magistral", text, [TOOL]):
        assert reading == (content, calls)


@pytest.mark.parametrize("family", sorted(MORE_TEMPLATES))
def test_detect_family_from_template(family):
    assert detect_family(MORE_TEMPLATES[family]) == family
    assert ChatTemplate(MORE_TEMPLATES[family]).family == family


def test_detection_leaves_the_other_families_alone():
    for family, src in FAMILY_TEMPLATES.items():
        assert detect_family(src) == family
    # Mistral templates with [CALL_ID] and no [THINK] stay mistral; Cohere2's <|START_TEXT|> is not R7B
    assert detect_family("[SYSTEM_PROMPT][TOOL_CALLS][CALL_ID][ARGS]") == "mistral"
    assert detect_family("<|START_TEXT|><|START_ACTION|>") != "command-r7b"
    assert detect_family("[SYSTEM_PROMPT]x[/SYSTEM_PROMPT][TOOL_CALLS]f[ARGS]") == "magistral"
    assert detect_family("<tool_call><function=f><parameter=p>") != "functionary-v3.1"  # Qwen3-Coder's XML


# --- grammars: every sentence of a required call's grammar is read back as that call ------------

SAMPLES = {
    "functionary-v3.2": 'get_weather\n{"city": "Paris"}',
    "functionary-v3.1": '<function=get_weather>{"city": "Paris"}</function>',
    "command-r7b": '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", '
                   '"parameters": {"city": "Paris"}}]<|END_ACTION|>',
    "granite": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "magistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    "seed-oss": "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n"
                "</seed:tool_call>",
    "apertus": '<|tools_prefix|>[{"get_weather": {"city": "Paris"}}]<|tools_suffix|>',
    "nemotron-v2": '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>',
}
CITY_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}


def _accepts(grammar: str, text: str) -> bool:
    tok = llg.LLTokenizer("byte")
    m = llg.LLMatcher(tok, llg.LLMatcher.grammar_from_lark(grammar))
    return m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting() and not m.get_error()


@pytest.mark.parametrize("family", sorted(MORE_TEMPLATES))
@pytest.mark.parametrize("named", [False, True])
def test_call_grammar_accepts_a_call_that_parses(family, named):
    body = {"tools": [CITY_TOOL, {"type": "function", "function": {"name": "now"}}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}} if named else "required"}
    spec = parse_tool_request(body)
    grammar = call_grammar(family, spec)
    err, msgs = llg.LLMatcher.validate_grammar_with_warnings(llg.LLMatcher.grammar_from_lark(grammar))
    assert not err, msgs
    assert _accepts(grammar, SAMPLES[family]), grammar
    assert not _accepts(grammar, SAMPLES[family].replace("get_weather", "get_weathex"))
    assert [(c.name, json.loads(c.arguments)) for c in parse(family, SAMPLES[family]).calls] == [WEATHER]
    closed = call_grammar(family, spec, close_thinking=True)
    assert not llg.LLMatcher.validate_grammar_with_warnings(llg.LLMatcher.grammar_from_lark(closed))[0]


def test_parallel_grammars_take_two_calls():
    spec = parse_tool_request({"tools": [CITY_TOOL, {"type": "function", "function": {"name": "now"}}],
                               "tool_choice": "required"})
    two = {
        "functionary-v3.2": 'get_weather\n{"city": "Paris"}\n>>>now\n{}',
        "functionary-v3.1": '<function=get_weather>{"city": "Paris"}</function><function=now>{}</function>',
        "magistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}',
        "nemotron-v2": '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                       '{"name": "now", "arguments": {}}]</TOOLCALL>',
    }
    for family, text in two.items():
        assert _accepts(call_grammar(family, spec), text), family
        assert len(parse(family, text).calls) == 2


# --- the response path: reasoning, content and calls as the openai client reads them -------------

FULL_OUTPUT = {  # (model text, expected content, expected reasoning)
    "functionary-v3.2": ('all\nChecking.\n>>>get_weather\n{"city": "Paris"}', "Checking.", None),
    "functionary-v3.1": ('<function=get_weather>{"city": "Paris"}</function>', None, None),
    "command-r7b": ("<|START_THINKING|>The user wants the weather in Paris.<|END_THINKING|>"
                    '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", '
                    '"parameters": {"city": "Paris"}}]<|END_ACTION|>', None, "The user wants the weather in Paris."),
    "granite": ('<think>Weather lookup.</think><|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                None, "Weather lookup."),
    "magistral": ('[THINK]Weather lookup.[/THINK]Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
                  "Checking.", "Weather lookup."),
    "seed-oss": ("<seed:think>Weather lookup.</seed:think>\n<seed:tool_call>\n<function=get_weather>\n"
                 "<parameter=city>Paris</parameter>\n</function>\n</seed:tool_call>", None, "Weather lookup."),
    "apertus": ('<|inner_prefix|>Weather lookup.<|inner_suffix|><|tools_prefix|>[{"get_weather": {"city": "Paris"}}]'
                "<|tools_suffix|>", None, "Weather lookup."),
    # its prompt opened the thinking (in <think>\n...</think>: the newline before </think> is reasoning)
    "nemotron-v2": ('Weather lookup.\n</think>\n\n<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
                    "</TOOLCALL>", None, "Weather lookup.\n"),
}


def _reasoning(message) -> str | None:
    return (message.model_extra or {}).get("reasoning_content") or getattr(message, "reasoning_content", None)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("family", sorted(MORE_TEMPLATES))
def test_openai_client_reads_tool_calls(family, stream):
    text, content, reasoning = FULL_OUTPUT[family]
    rng = random.Random(family)
    pieces, at = [], 0
    while at < len(text):
        pieces.append(text[at:at + rng.randint(1, 6)])
        at += len(pieces[-1])
    out = scripted_reply(MORE_TEMPLATES[family], {"tools": [TOOL]}, pieces, stream)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [WEATHER]
    assert calls[0].type == "function" and calls[0].id
    assert (choice.message.content or None) == content
    assert _reasoning(choice.message) == reasoning


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("family, text, content", [
    ("functionary-v3.2", "all\nIt is sunny.", "It is sunny."),
    ("command-r7b", "<|START_THINKING|>Easy.<|END_THINKING|><|START_RESPONSE|>It is sunny.<|END_RESPONSE|>",
     "It is sunny."),
])
def test_replies_without_tools_lose_their_markers(family, text, content, stream):
    for body in ({}, {"tools": [TOOL], "tool_choice": "none"}):
        out = scripted_reply(MORE_TEMPLATES[family], body, list(text), stream)
        assert out.choices[0].message.content == content and not out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_granite_keeps_its_response_markers(stream):
    """As llama-server reads a Granite 3.3 reply: the thinking is taken out, the response markers
    stay in the content, with tools or without."""
    text = "<think>Easy.</think><response>It is sunny.</response>"
    for body in ({}, {"tools": [TOOL]}, {"tools": [TOOL], "tool_choice": "none"}):
        out = scripted_reply(MORE_TEMPLATES["granite"], body, list(text), stream)
        assert out.choices[0].message.content == "<response>It is sunny.</response>"
        assert _reasoning(out.choices[0].message) == "Easy."


@pytest.mark.parametrize("family", sorted(MORE_TEMPLATES))
def test_round_trip_renders_call_and_result(family):
    t = ChatTemplate(MORE_TEMPLATES[family], bos_token="<s>", eos_token="</s>")
    first = scripted_reply(MORE_TEMPLATES[family], {"tools": [TOOL]}, [FULL_OUTPUT[family][0]], False)
    call = first.choices[0].message.tool_calls[0]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    prompt = t.render_request({"messages": messages, "tools": [TOOL]})
    assert "18 C and sunny" in prompt and "get_weather" in prompt
    assert prompt.count("Paris") >= 2


# --- a real server: required and named calls constrained to the format, and a round trip --------

SERVER_FAMILIES = sorted(MORE_TEMPLATES)


@pytest.fixture(scope="module", params=SERVER_FAMILIES)
def family_server(request, tiny_model, tmp_path_factory):
    from server_util import LONG_CONTEXT, ServerProcess  # noqa: PLC0415
    path = tmp_path_factory.mktemp("tpl") / "template.jinja"
    path.write_text(MORE_TEMPLATES[request.param])
    server = ServerProcess(tiny_model, "--chat-template-file", str(path), "-c", "2048", "-np", "2", *LONG_CONTEXT)
    try:
        server.wait_ready()
        yield request.param, server
    finally:
        server.stop()


def test_server_required_named_and_round_trip(family_server):
    import openai
    family, server = family_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    common = dict(model="m", messages=messages, tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
                  max_tokens=300, temperature=0.8, seed=3)
    out = client.chat.completions.create(**common)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == WEATHER
    state_ = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(**common, stream=True):
        state_.handle_chunk(chunk)
    streamed = state_.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    s_call = streamed.message.tool_calls[0]
    assert (s_call.function.name, json.loads(s_call.function.arguments)) == WEATHER
    named = client.chat.completions.create(**{**common, "tool_choice": {"type": "function",
                                                                         "function": {"name": "get_weather"}}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"
    # auto: the tiny model writes no call of its own; its reply comes back as text
    auto = client.chat.completions.create(**{**common, "tool_choice": "auto", "max_tokens": 8})
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    again = client.chat.completions.create(model="m", messages=follow, tools=[TOOL], tool_choice="none", max_tokens=4)
    assert again.choices[0].finish_reason in ("stop", "length")
    status, doc = server.post("/apply-template", {"messages": follow, "tools": [TOOL]})
    assert status == 200 and "18 C and sunny" in doc["prompt"]
