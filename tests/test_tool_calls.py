"""Tool calls on /v1/chat/completions: the parsers of each template family (whole and streamed),
the request fields, the response path (non-streamed and streamed, read back with the official
openai client's own models and stream accumulator), rendering of calls and tool results, and a
real server whose required calls are constrained to each family's format."""
from __future__ import annotations

import asyncio
import json
import random
import types

import llguidance as llg
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pyllama.server.api import Api, ServerState
from pyllama.server.chat import ChatTemplate, ChatTemplateError, template_from_option
from pyllama.server.http import HTTPError, Request, StreamResponse
from pyllama.server.tool_calls import (ToolCallStream, ToolChoiceError, call_grammar, detect_family, parse,
                                       parse_tool_request)
from scripted_api import scripted
from tool_templates import FAMILY_TEMPLATES

DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def ds_r1(name: str, args: str) -> str:
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{args}\n```{DS_CALL_END}"


# (family, model text, expected content, expected [(name, arguments as data)])
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris"})]),
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": "}"}]}}</tool_call>\n'
               '<tool_call>\n{"name": "b", "arguments": {}}</tool_call>',
     "Let me look.", [("a", {"x": [1, {"y": "}"}]}), ("b", {})]),
    ("hermes", 'no call here, just <tool text', "no call here, just <tool text", []),
    ("hermes", 'x <tool_call>{"name": f, "arguments": {}}</tool_call>',
     'x <tool_call>{"name": f, "arguments": {}}</tool_call>', []),
    ("hermes", 'x <tool_call>[1, 2]</tool_call>', 'x <tool_call>[1, 2]</tool_call>', []),
    ("hermes", '<tool_call>\n{"arguments": {}}</tool_call>', '<tool_call>\n{"arguments": {}}</tool_call>', []),
    # a call opens with <tool_call> and a newline, as the family's templates write it and
    # llama-server's parser (derived from them) takes it
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {}}</tool_call>', []),
    ("hermes", 'Hi <tool_call> {"name": "f", "arguments": {}}</tool_call>',
     'Hi <tool_call> {"name": "f", "arguments": {}}</tool_call>', []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><tool_call>\n{"name": "g", "arguments": {}}'
               '\n</tool_call>', None, [("f", {}), ("g", {})]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    ("llama3", '{"type": "function", "name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', None,
     [("f", {"a": 1}), ("g", {})]),
    # <|python_tag|> is text to llama-server's reading of Llama 3 templates (whose calls are bare
    # objects): a call after it is read as after any text, and built-in tool calls or code are not calls
    ("llama3", 'Let me check.<|python_tag|>{"name": "f", "parameters": {}}', "Let me check.<|python_tag|>",
     [("f", {})]),
    ("llama3", '<|python_tag|>{"name": "f", "parameters": {}}', "<|python_tag|>", [("f", {})]),
    ("llama3", '<|python_tag|>brave_search.call(query="weather in Paris")',
     '<|python_tag|>brave_search.call(query="weather in Paris")', []),
    ("llama3", '<|python_tag|>print(6 * 7)', '<|python_tag|>print(6 * 7)', []),
    ("llama3", 'Done.<|python_tag|>', 'Done.<|python_tag|>', []),
    ("llama3", '{"answer": 42}', '{"answer": 42}', []),
    # a call after text, when the calls end the reply (llama-server reads the text up to the
    # first object as content, and the calls from there)
    ("llama3", 'Hello {"name": "f", "parameters": {}}', "Hello", [("f", {})]),
    ("llama3", 'Two: {"name": "f", "parameters": {"a": 1}}; {"type": "function", "name": "g", "parameters": {}}',
     "Two:", [("f", {"a": 1}), ("g", {})]),
    ("llama3", 'Write {"name": "f", "parameters": {}} to call f.', 'Write {"name": "f", "parameters": {}} to call f.',
     []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}, '
                '{"name": "now", "arguments": {}}]', None, [("get_weather", {"city": "Paris"}), ("now", {})]),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "Sure.", [("get_weather", {"city": "Paris"})]),
    ("mistral", '[TOOL_CALLS] not json', '[TOOL_CALLS] not json', []),
    ("deepseek", "I will check." + DS_BEGIN + ds_r1("get_weather", '{"city": "Paris"}') + "\n"
                 + ds_r1("now", "{}") + DS_END, "I will check.", [("get_weather", {"city": "Paris"}), ("now", {})]),
    ("deepseek", DS_BEGIN + f'{DS_CALL}get_weather{DS_SEP}{{"city": "Paris"}}{DS_CALL_END}' + DS_END, None,
     [("get_weather", {"city": "Paris"})]),
    ("deepseek", DS_BEGIN + "garbage", DS_BEGIN + "garbage", []),
    ("generic", '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}', None,
     [("get_weather", {"city": "Paris"})]),
    ("generic", '{"tool_call": {"name": "now", "arguments": {}}}', None, [("now", {})]),
    ("generic", '{"response": "It is sunny."}', "It is sunny.", []),
    ("generic", 'plain words', "plain words", []),
]


def _calls(message_calls: list[dict]) -> list[tuple[str, object]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message_calls]


def _stream(family: str, pieces: list[str], parallel: bool = True) -> tuple[list[dict], ToolCallStream]:
    s = ToolCallStream(family, parallel)
    deltas: list[dict] = []
    for p in pieces:
        deltas += s.feed(p)
    deltas += s.finish()
    return deltas, s


def _merge(deltas: list[dict]) -> tuple[str, list[dict]]:
    """Deltas added up as an OpenAI client adds them (content concatenated, calls by index)."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
            if "id" in tc:
                assert c["id"] is None, "a call is announced once"
                c["id"], c["name"] = tc["id"], tc["function"]["name"]
            c["arguments"] += tc["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("family, text, content, calls", CASES)
def test_parse_whole_and_streamed(family, text, content, calls):
    snap = parse(family, text)
    assert [(c.name, json.loads(c.arguments)) for c in snap.calls] == calls
    _, s = _stream(family, [text])
    got_content, got_calls = s.message()
    assert got_content == content
    assert _calls(got_calls) == calls
    # character by character, and in random pieces: the same message, and deltas that add up to it
    rng = random.Random(len(text))
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 7)))
    for pieces in ([c for c in text], [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]):
        deltas, s = _stream(family, pieces)
        m_content, m_calls = s.message()
        assert m_content == content and _calls(m_calls) == calls
        d_content, d_calls = _merge(deltas)
        assert d_content == (content or "")
        assert [(c["name"], json.loads(c["arguments"])) for c in d_calls] == calls
        assert [c["id"] for c in d_calls] == [c["id"] for c in m_calls]


def _long_args(n: int) -> str:
    """Arguments JSON of about n characters: long strings with escapes, numbers, literals, nesting."""
    items = []
    for i in range(n // 60 + 1):
        items.append(f'{{"k{i}": "line {i} \\"quoted\\" \\\\ \\u00e9 {{not}} [json] {"x" * (i % 7)}", '
                     f'"v": [{i}, -{i}.5e-3, true, false, null]}}')
    return '{"text": "' + "abc " * (n // 20) + '", "items": [' + ", ".join(items) + "]}"


ARGS = _long_args(1200)
LONG_REPLIES = [
    ("hermes", "Let me look. " * 40 + f'<tool_call>\n{{"name": "write", "arguments": {ARGS}}}\n</tool_call>\n'
               '<tool_call>\n{"name": "b", "arguments": {}}</tool_call> and then some words.'),
    ("hermes", "x " * 30 + f'<tool_call>\n{{"name": "f", "arguments": {ARGS[:-1]}, oops}}}}</tool_call> tail'),
    ("llama3", f'{{"name": "f", "parameters": {ARGS}}}; {{"name": "g", "parameters": {{}}}}'),
    ("llama3", "Here: " * 20 + f'<|python_tag|>{{"name": "f", "parameters": {ARGS}}}'),
    ("mistral", f'[TOOL_CALLS][{{"name": "f", "arguments": {ARGS}, "id": "abcDEF123"}}, '
                '{"name": "now", "arguments": {}}]'),
    ("mistral", "Sure. " * 30 + f"[TOOL_CALLS]get_weather[ARGS]{ARGS}"),
    ("deepseek", "I will check. " * 30 + DS_BEGIN + ds_r1("f", ARGS) + "\n" + ds_r1("now", "{}") + DS_END),
    ("deepseek", DS_BEGIN + f"{DS_CALL}f{DS_SEP}{ARGS}{DS_CALL_END}" + DS_END + " done"),
    ("generic", f'{{"tool_calls": [{{"name": "f", "arguments": {ARGS}}}, {{"name": "g", "arguments": {{}}}}]}}'),
    ("generic", '{"response": "' + "sunny and warm, " * 100 + '"}'),
    ("generic", "plain words " * 150),
]


def _reparsed_deltas(family: str, pieces: list[str]) -> list[dict]:
    """The deltas of a stream that parses the whole reply so far again at every piece (the
    reference for the stream's own incremental reading): new content once it extends what was
    sent, a call announced once, then its arguments' growth."""
    text, sent, ids, args, out = "", "", [], [], []

    def update(snap, final: bool) -> None:
        nonlocal sent
        new = snap.content[len(sent):] if snap.content.startswith(sent) else ""
        if new and not (final and snap.calls and not (sent + new).strip()):
            out.append({"content": new})
            sent += new
        for idx, call in enumerate(snap.calls):
            if idx >= len(ids):
                ids.append(call.id or f"<{idx}>")
                args.append("")
                out.append({"tool_calls": [{"index": idx, "id": ids[idx], "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            if len(call.arguments) > len(args[idx]) and call.arguments.startswith(args[idx]):
                out.append({"tool_calls": [{"index": idx, "function": {"arguments": call.arguments[len(args[idx]):]}}]})
                args[idx] = call.arguments
    for p in pieces:
        text += p
        update(parse(family, text, final=False), False)
    update(parse(family, text, final=True), True)
    return out


def _anonymous(deltas: list[dict]) -> list[dict]:
    """Deltas with generated call ids replaced by the call's index (the model's own ids kept)."""
    out = json.loads(json.dumps(deltas))
    for d in out:
        for tc in d.get("tool_calls", []):
            if "id" in tc and tc["id"].startswith("call_") or "id" in tc and len(tc["id"]) == 9 \
                    and tc["id"] != "abcDEF123":
                tc["id"] = f"<{tc['index']}>"
    return out


@pytest.mark.parametrize("family, text", LONG_REPLIES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(LONG_REPLIES)])
def test_long_reply_character_by_character(family, text):
    """A long reply streamed one character at a time gives the deltas of a whole re-read at every
    character, and they add up to the whole reply's parse."""
    assert len(text) > 1500
    pieces = list(text)
    deltas, s = _stream(family, pieces)
    assert _anonymous(deltas) == _reparsed_deltas(family, pieces)
    whole = parse(family, text)
    content, calls = s.message()
    assert (content or "") == whole.content or (content is None and not whole.content.strip())
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [(c.name, c.arguments) for c in whole.calls]
    d_content, d_calls = _merge(deltas)
    assert d_content == (content or "")
    assert [(c["name"], c["arguments"]) for c in d_calls][:len(calls)] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    # pieces of 1 to 24 characters, as tokens come: the same deltas as the whole re-read's
    rng = random.Random(len(text))
    cuts, at = [], 0
    while at < len(text):
        cuts.append(text[at:at + rng.randint(1, 24)])
        at += len(cuts[-1])
    assert _anonymous(_stream(family, cuts)[0]) == _reparsed_deltas(family, cuts)


def test_arguments_stream_in_fragments_before_the_call_ends():
    text = '<tool_call>\n{"name": "write", "arguments": {"text": "' + "abcdefgh" * 8 + '"}}</tool_call>'
    deltas, _ = _stream("hermes", list(text))
    fragments = [tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []) if "id" not in tc]
    assert len(fragments) > 10  # the arguments grew while the model wrote them
    head = next(d for d in deltas if "tool_calls" in d)["tool_calls"][0]
    assert head["id"].startswith("call_") and head["function"] == {"name": "write", "arguments": ""}


def test_arguments_that_go_wrong_after_they_began():
    """A call is announced once its name is known and its arguments have begun; arguments that
    turn out malformed later leave the whole reply as content in the final message (the
    non-streamed one); a stream has already sent the call's start (as llama-server's stream does)
    and then sends the text as content, so that nothing the model wrote is lost."""
    text = 'x <tool_call>\n{"name": "f", "arguments": {oops}}</tool_call>'
    deltas, s = _stream("hermes", list(text))
    assert s.message() == (text, [])
    content, calls = _merge(deltas)
    assert [c["name"] for c in calls] == ["f"] and calls[0]["arguments"] == "{"
    assert content == text


def test_no_parallel_calls_keeps_the_first():
    text = '<tool_call>\n{"name": "a", "arguments": {}}</tool_call><tool_call>\n{"name": "b", "arguments": {}}</tool_call>'
    _, s = _stream("hermes", list(text), parallel=False)
    assert _calls(s.message()[1]) == [("a", {})]


def test_mistral_ids_are_nine_characters_and_kept_from_the_model():
    _, s = _stream("mistral", ['[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}, '
                               '"id": "Zz9Zz9Zz9"}]'])
    ids = [c["id"] for c in s.message()[1]]
    assert len(ids[0]) == 9 and ids[0].isalnum() and ids[1] == "Zz9Zz9Zz9"


@pytest.mark.parametrize("family", sorted(FAMILY_TEMPLATES))
def test_detect_family_from_template(family):
    assert detect_family(FAMILY_TEMPLATES[family]) == family
    assert ChatTemplate(FAMILY_TEMPLATES[family]).family == family


def test_fallback_and_builtin_families():
    assert ChatTemplate(None).family == "generic"  # the ChatML fallback
    assert template_from_option("llama3", None).family is None
    with pytest.raises(ChatTemplateError, match="requires --jinja"):
        template_from_option("chatml", None).render_request({"messages": [{"role": "user", "content": "x"}],
                                                            "tools": [TOOL]})


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris"]}},
                                                        "required": ["city"], "additionalProperties": False}}}


@pytest.mark.parametrize("body, match", [
    ({"tools": {}}, "'tools' must be an array"),
    ({"tools": [1]}, r"'tools\[0\]' must be an object"),
    ({"tools": [{"type": "code"}]}, r"'tools\[0\].type' must be \"function\""),
    ({"tools": [{"type": "function"}]}, r"'tools\[0\].function' must be an object"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, r"function.name' must be a non-empty"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "JSON schema object"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "'tool_choice' must be"),
    ({"tools": [TOOL], "tool_choice": 3}, "'tool_choice' must be a string or an object"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in 'tools'"),
    ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "'tool_choice' as an object"),
    ({"tool_choice": "required"}, "no 'tools'"),
    ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "'parallel_tool_calls' must be true or false"),
])
def test_tool_request_errors(body, match):
    with pytest.raises(ToolChoiceError, match=match):
        parse_tool_request(body)


def test_tool_request_forms():
    spec = parse_tool_request({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                               "parallel_tool_calls": False})
    assert spec.named and spec.required and spec.choice == "get_weather" and not spec.parallel
    assert not parse_tool_request({"tools": [TOOL], "tool_choice": "none"}).parse_calls
    assert parse_tool_request({"tools": [TOOL]}).parse_calls and not parse_tool_request({}).parse_calls


@pytest.mark.parametrize("family", sorted(FAMILY_TEMPLATES))
@pytest.mark.parametrize("close_thinking", [False, True])
def test_call_grammar_is_valid_lark(family, close_thinking):
    spec = parse_tool_request({"tools": [TOOL, {"type": "function", "function": {"name": "now"}}],
                               "tool_choice": "required"})
    grammar = call_grammar(family, spec, close_thinking=close_thinking)
    err, msgs = llg.LLMatcher.validate_grammar_with_warnings(llg.LLMatcher.grammar_from_lark(grammar))
    assert not err, msgs
    assert ("</think>" in grammar) == close_thinking


# --- the response path: known model text through Api._oai / _oai_stream ------------------------

def scripted_reply(template: str, body: dict, pieces: list[str], stream: bool, reasoning_format: str = "auto",
                   stop_type: str = "eos", skip_chat_parsing: bool = False) -> ChatCompletion:
    """What an OpenAI client gets for `body` when the model writes `pieces`: the chat completion
    as parsed by the openai package's own models (streamed: its own stream accumulator)."""
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], **body, "stream": stream}
    api, p, spec, task = scripted(template, body, pieces, stop_type, reasoning_format=reasoning_format,
                                  skip_chat_parsing=skip_chat_parsing)

    async def run():
        resp = await api._oai([[task]], p, len(task.prompt), chat=True, chat_spec=spec)
        if not stream:
            return ChatCompletion.model_validate(json.loads(resp.body))
        assert isinstance(resp, StreamResponse)
        state_ = ChatCompletionStreamState()
        async for raw in resp.chunks:
            data = raw.decode()[len("data: "):].strip()
            if data != "[DONE]":
                state_.handle_chunk(ChatCompletionChunk.model_validate(json.loads(data)))
        return state_.get_final_completion()
    return asyncio.run(run())


FAMILY_OUTPUT = {
    "hermes": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]',
    "deepseek": 'Warm?\n</think>\n\nChecking.' + DS_BEGIN + ds_r1("get_weather", '{"city": "Paris"}') + DS_END,
    "generic": '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILY_TEMPLATES))
def test_openai_client_reads_tool_calls(family, stream):
    text = FAMILY_OUTPUT[family]
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    out = scripted_reply(FAMILY_TEMPLATES[family], {"tools": [TOOL]}, pieces, stream)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].type == "function" and calls[0].id
    # R1's </think> has no whitespace of its own: what follows it stays in the content (llama-server)
    expected_content = {"hermes": "Checking.", "deepseek": "\n\nChecking."}.get(family)
    assert (choice.message.content or None) == expected_content
    if family == "deepseek":  # its prompt opened the thinking
        # with the prompt's newline after <think> (llama-server reads the generation prompt with the reply)
        assert choice.message.model_extra.get("reasoning_content") == "\nWarm?\n" or \
            getattr(choice.message, "reasoning_content", None) == "\nWarm?\n"


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_none_and_no_tools_leave_text_alone(stream):
    text = FAMILY_OUTPUT["hermes"]
    for body in ({"tools": [TOOL], "tool_choice": "none"}, {}):
        out = scripted_reply(FAMILY_TEMPLATES["hermes"], body, [text], stream)
        assert out.choices[0].message.content == text and not out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_skip_chat_parsing_leaves_everything_in_the_content(stream):
    """--skip-chat-parsing (llama-server's): no tool calls and no reasoning are read out of the reply."""
    for family in ("hermes", "deepseek"):
        text = FAMILY_OUTPUT[family]
        out = scripted_reply(FAMILY_TEMPLATES[family], {"tools": [TOOL], "reasoning_format": "deepseek"}, [text],
                             stream, skip_chat_parsing=True)
        msg = out.choices[0].message
        assert msg.content == text and not msg.tool_calls and out.choices[0].finish_reason == "stop"
        assert not (msg.model_extra or {}).get("reasoning_content")


def test_cut_short_is_length_and_malformed_is_content():
    text = FAMILY_OUTPUT["hermes"]
    out = scripted_reply(FAMILY_TEMPLATES["hermes"], {"tools": [TOOL]}, [text[:-20]], False, stop_type="limit")
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content == text[:-20] and not out.choices[0].message.tool_calls


def test_request_field_errors_are_400():
    state = ServerState(args=types.SimpleNamespace(reasoning_format="auto"), chat=ChatTemplate(FAMILY_TEMPLATES["hermes"]))
    api = Api(state)
    for body, field in (({"tools": 5}, "'tools'"), ({"tool_choice": "required"}, "'tool_choice'"),
                        ({"reasoning_format": "loud"}, "'reasoning_format'")):
        with pytest.raises(HTTPError) as e:
            api._chat_output_spec(body)
        assert e.value.status == 400 and field in str(e.value)


# --- rendering: a round trip with a tool result, through each family's template ----------------

@pytest.mark.parametrize("family", sorted(FAMILY_TEMPLATES))
def test_round_trip_renders_call_and_result(family):
    t = ChatTemplate(FAMILY_TEMPLATES[family], bos_token="<s>", eos_token="</s>")
    first = scripted_reply(FAMILY_TEMPLATES[family], {"tools": [TOOL]}, [FAMILY_OUTPUT[family]], False)
    call = first.choices[0].message.tool_calls[0]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    prompt = t.render_request({"messages": messages, "tools": [TOOL]})
    assert "18 C and sunny" in prompt and "get_weather" in prompt
    assert prompt.count("Paris") >= 2  # the question and the call's arguments
    marker = {"hermes": "<tool_call>", "llama3": '"parameters": {"city": "Paris"}', "mistral": "[TOOL_CALLS]",
              "deepseek": DS_BEGIN, "generic": '"tool_calls"'}[family]
    assert marker in prompt
    if family == "mistral":
        assert f'"id": "{call.id}"' in prompt and f'"call_id": "{call.id}"' in prompt
    if family == "generic":  # the template knows no tools: they are described in a system turn
        assert prompt.startswith("<start_of_turn>system\nYou can call these tools")


def test_bad_arguments_in_history_is_400_text():
    t = ChatTemplate(FAMILY_TEMPLATES["hermes"])
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{nope"}}]},
                {"role": "tool", "tool_call_id": "1", "content": "r"}]
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]\.tool_calls\[0\]\.function: 'arguments' is not valid JSON"):
        t.render_request({"messages": messages})


# --- a real server: required calls constrained to each family's format, read by the openai client

from server_util import LONG_CONTEXT, ServerProcess  # noqa: E402


@pytest.fixture(scope="module", params=sorted(FAMILY_TEMPLATES))
def family_server(request, tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / f"{request.param}.jinja"
    path.write_text(FAMILY_TEMPLATES[request.param])
    server = ServerProcess(tiny_model, "--chat-template-file", str(path), "-c", "2048", "-np", "2", *LONG_CONTEXT)
    try:
        server.wait_ready()
        yield request.param, server
    finally:
        server.stop()


def test_server_required_call_openai_client(family_server):
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
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    # streamed: deltas with index, id and name, then argument fragments, as the client assembles them
    state_ = ChatCompletionStreamState()
    n_chunks = 0
    for chunk in client.chat.completions.create(**common, stream=True):
        state_.handle_chunk(chunk)
        n_chunks += 1
    streamed = state_.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    s_call = streamed.message.tool_calls[0]
    assert (s_call.function.name, json.loads(s_call.function.arguments)) == ("get_weather", {"city": "Paris"})
    # a named function is required the same way
    named = client.chat.completions.create(**{**common, "tool_choice": {"type": "function",
                                                                         "function": {"name": "get_weather"}}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"
    # round trip: the call and its result go back through the template
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    again = client.chat.completions.create(model="m", messages=follow, tools=[TOOL], tool_choice="none",
                                           max_tokens=4)
    assert again.choices[0].finish_reason in ("stop", "length")
    status, doc = server.post("/apply-template", {"messages": follow, "tools": [TOOL]})
    assert status == 200 and "18 C and sunny" in doc["prompt"]


def test_server_tool_errors_are_400(family_server):
    _, server = family_server
    base = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for body, field in (({"tools": [TOOL], "tool_choice": "maybe"}, "'tool_choice'"),
                        ({"tools": [{"type": "function", "function": {}}]}, "'tools[0].function.name'"),
                        ({"tools": [TOOL], "tool_choice": "required", "grammar": "root ::= \"a\""}, "'grammar'")):
        status, doc = server.post("/v1/chat/completions", {**base, **body})
        assert status == 400 and field in doc["error"]["message"], doc


def test_chat_replies_are_read_off_the_event_loop():
    """Stream pieces and whole replies are parsed on the replies' thread, in order, not on the loop."""
    import asyncio
    import threading
    from pyllama.server.api import Api, ChatOutputSpec, Choice

    seen: list[tuple[str, str]] = []

    class Reply:
        def feed(self, text):
            seen.append((threading.current_thread().name, text))
            return [{"content": text}] if text else []

        def finish(self):
            seen.append((threading.current_thread().name, "<end>"))
            return []

    api = Api(types.SimpleNamespace(args=types.SimpleNamespace(webui=False)))

    async def run():
        loop_thread = threading.current_thread().name
        reply = Reply()
        out = [await api._read(reply, t) for t in ("a", "", "b")]
        out.append(await api._read(reply, "c", finish=True))
        c = Choice(0)
        c.text = ["hello"]
        whole = await api._whole_reply(c, ChatOutputSpec())
        return loop_thread, out, whole

    loop_thread, out, whole = asyncio.run(run())
    assert out == [[{"content": "a"}], [], [{"content": "b"}], [{"content": "c"}]]
    assert [t for _, t in seen] == ["a", "b", "c", "<end>"]           # in order; empty text skips the hop
    assert all(name.startswith("chat-replies") and name != loop_thread for name, _ in seen)
    assert whole.message()["content"] == "hello"
