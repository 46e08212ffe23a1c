"""Reasoning on /v1/chat/completions (pyllama.server.reasoning): thinking split from the content
for --reasoning-format / reasoning_format deepseek, auto, deepseek-legacy and none, whole and
streamed; prompts that open the think tag; chat_template_kwargs (enable_thinking) reaching the
template; and a real server whose output a grammar fixes."""
from __future__ import annotations

import random

import pytest

from pyllama.server.chat import ChatTemplate
from pyllama.server.template_thinking import Thinking
from pyllama.server.reasoning import ReasoningStream, check_format, prompt_opens_thinking, split_reasoning
from server_util import ServerProcess
from test_tool_calls import scripted_reply
from tool_templates import DEEPSEEK, GENERIC, HERMES, LLAMA3, QWEN3

# (reply, prompt opened <think>, format) -> (reasoning, content)
CASES = [
    # the tags without whitespace of their own (R1's): the whitespace around them stays
    ("<think>\nStep 1.\nStep 2.\n</think>\n\nParis.", False, "deepseek", ("\nStep 1.\nStep 2.\n", "\n\nParis.")),
    ("<think>\nStep 1.\n</think>\n\nParis.", False, "auto", ("\nStep 1.\n", "\n\nParis.")),
    ("<think>\nStep 1.\n</think>\n\nParis.", False, "none", (None, "<think>\nStep 1.\n</think>\n\nParis.")),
    ("<think>\nStep 1.\n</think>\n\nParis.", False, "deepseek-legacy",
     ("\nStep 1.\n", "<think>\nStep 1.\n</think>\n\nParis.")),
    ("Step 1.\n</think>\n\nParis.", True, "deepseek", ("Step 1.\n", "\n\nParis.")),
    ("Step 1.\n</think>\n\nParis.", True, "none", (None, "Step 1.\n</think>\n\nParis.")),
    ("<think>unfinished thought ", False, "deepseek", ("unfinished thought ", "")),
    # whitespace before the start tag: the thinking is not read (llama-server's optional fails)
    ("  <think>unfinished thought", False, "deepseek", (None, "  <think>unfinished thought")),
    # a reasoning of whitespace only is dropped
    ("<think>\n \n</think>Paris.", False, "deepseek", (None, "Paris.")),
    ("Paris. <think>not at the start</think>", False, "deepseek", (None, "Paris. <think>not at the start</think>")),
    ("<thin", False, "deepseek", (None, "<thin")),
    ("<think></think>Paris.", False, "deepseek", (None, "Paris.")),
]


@pytest.mark.parametrize("text, opened, fmt, expected", CASES)
def test_split_whole_and_streamed(text, opened, fmt, expected):
    assert split_reasoning(text, fmt, opened) == expected
    s = ReasoningStream(fmt, opened)
    r = c = ""
    for ch in text:
        a, b = s.feed(ch)
        r, c = r + a, c + b
    a, b = s.finish()
    assert ((r + a) or None, c + b) == expected


def test_format_checks_and_open_prompts():
    assert check_format(None, "none") == "none" and check_format("deepseek", "none") == "deepseek"
    with pytest.raises(ValueError, match="'reasoning_format'"):
        check_format("r1", "auto")
    assert prompt_opens_thinking("<｜Assistant｜><think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fmt", ["deepseek", "auto", "none"])
def test_response_path(stream, fmt):
    text = "<think>\nThe user asks about Paris.\n</think>\n\nIt is sunny."
    out = scripted_reply(QWEN3, {}, [text[i:i + 4] for i in range(0, len(text), 4)], stream, reasoning_format=fmt)
    msg = out.choices[0].message
    reasoning = (msg.model_extra or {}).get("reasoning_content")
    if fmt == "none":
        assert msg.content == text and reasoning is None
    else:
        # Qwen3's tags are <think>\n and \n</think>\n\n: the newline before </think> stays in the
        # reasoning (llama-server reads up to the bare tag), those after it are the tag's own
        assert msg.content == "It is sunny." and reasoning == "The user asks about Paris.\n"
    # the request field overrides the server's format
    out = scripted_reply(QWEN3, {"reasoning_format": "none"}, [text], stream, reasoning_format=fmt)
    assert out.choices[0].message.content == text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fmt", ["deepseek", "auto", "deepseek-legacy"])
@pytest.mark.parametrize("template", [HERMES, LLAMA3, GENERIC, None], ids=["hermes", "llama3", "generic", "chatml"])
def test_content_only_templates_keep_the_thinking_in_the_content(template, fmt, stream):
    # a template that shows no thinking (llama-server's content-only formats): whatever the format,
    # the <think> the model writes is content, whole and streamed
    text = "<think>\nThe user asks about Paris.\n</think>\n\nIt is sunny."
    out = scripted_reply(template, {}, [text[i:i + 4] for i in range(0, len(text), 4)], stream, reasoning_format=fmt)
    msg = out.choices[0].message
    assert msg.content == text and (msg.model_extra or {}).get("reasoning_content") is None


def test_which_templates_think():
    assert ChatTemplate(QWEN3).thinking == Thinking("<think>", "</think>", "<think>\n", "\n</think>\n\n")
    assert ChatTemplate(DEEPSEEK).thinking == Thinking("<think>", "</think>", "<think>", "</think>")  # drops </think>'s text: patched
    for template in (HERMES, LLAMA3, GENERIC, None):
        assert ChatTemplate(template).thinking is None
    assert ChatTemplate(None, builtin="chatml").thinking is None  # a built-in layout (no --jinja)


CHATML_TURNS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("source, expected", [
    # llama-server's own parsers decide by family
    (CHATML_TURNS + "{# <|channel|> #}", ("<|channel|>analysis<|message|>", "<|end|>")),
    (CHATML_TURNS + "{# <|tool_calls_section_begin|> <|tool_call_begin|> #}", ("<think>", "</think>")),
    (CHATML_TURNS + "{# <tool_call> <function= <parameter= #}", None),  # Qwen3-Coder without <think>
    (CHATML_TURNS + "{# <tool_call> <function= <parameter= <think> #}", ("<think>", "</think>")),
    (CHATML_TURNS + "{# >>>all >>>${recipient} #}", None),  # Functionary v3.2
    (CHATML_TURNS + "{# [SYSTEM_PROMPT] [TOOL_CALLS] [ARGS] #}", ("[THINK]", "[/THINK]")),
    # the analysis: an earlier reply's reasoning shown between tags of the template's own
    (CHATML_TURNS.replace("{{ m.content }}", "{% if m.reasoning_content %}<thought>{{ m.reasoning_content }}"
                                             "</thought>{% endif %}{{ m.content }}"), ("<thought>", "</thought>")),
    # a generation prompt that opens the thinking unless enable_thinking is false, where it closes it
    (CHATML_TURNS.replace("<|im_start|>assistant\n{% endif %}",
                          "<|im_start|>assistant\n{% if enable_thinking %}<think>{% else %}<think></think>{% endif %}"
                          "{% endif %}"), ("<think>", "</think>")),
    # one that only opens it (no end to read the thinking up to): content only
    (CHATML_TURNS.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}"),
     None),
    # an old Qwen / DeepSeek distill template that cuts the thinking out of the history
    (CHATML_TURNS.replace("{{ m.content }}", "{{ m.content.split('</think>')[-1] }}"), ("<think>", "</think>")),
    # a template that fails to render the probes is content only
    ("{{ raise_exception('no') }}", None),
])
def test_thinking_as_llama_server_finds_it(source, expected):
    found = ChatTemplate(source).thinking
    assert (found.start, found.end) == expected if expected else found is None


@pytest.mark.parametrize("stream", [False, True])
def test_opened_by_the_prompt_with_a_tool_call(stream):
    text = "Need the weather.</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    tool = {"type": "function", "function": {"name": "now"}}
    out = scripted_reply(DEEPSEEK, {"tools": [tool]}, list(text), stream)
    msg = out.choices[0].message
    # the prompt's newline after <think> is read with the reply (llama-server prepends the generation prompt)
    assert msg.model_extra.get("reasoning_content") == "\nNeed the weather."
    assert msg.tool_calls[0].function.name == "now" and not msg.content


def test_enable_thinking_reaches_the_template():
    t = ChatTemplate(QWEN3)
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert t.render_request(body).endswith("<|im_start|>assistant\n")
    off = t.render_request({**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and not prompt_opens_thinking(off)
    server_off = ChatTemplate(QWEN3, kwargs={"enable_thinking": False})  # --chat-template-kwargs
    assert server_off.render_request(body) == off
    assert server_off.render_request({**body, "chat_template_kwargs": {"enable_thinking": True}}).endswith(
        "assistant\n")


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "qwen3.jinja"
    path.write_text(QWEN3)  # a template that thinks: the reply's thinking is read out of it
    s = ServerProcess(tiny_model, "-c", "1024", "--reasoning-format", "none", "--chat-template-file", str(path),
                      "--chat-template-kwargs", '{"enable_thinking": false}')
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


GRAMMAR = 'root ::= "<think>Plan: say hi.</think>" "\\n\\nHello there"'


def test_server_reasoning_formats(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "grammar": GRAMMAR, "max_tokens": 64}
    status, doc = server.post("/v1/chat/completions", body)
    assert status == 200, doc
    msg = doc["choices"][0]["message"]
    assert msg["content"] == "<think>Plan: say hi.</think>\n\nHello there" and "reasoning_content" not in msg
    status, doc = server.post("/v1/chat/completions", {**body, "reasoning_format": "deepseek"})
    msg = doc["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Plan: say hi.", "Hello there")
    events = server.stream("/v1/chat/completions", {**body, "reasoning_format": "deepseek", "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events if isinstance(e, dict) and e.get("choices")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Plan: say hi."
    assert "".join(d.get("content") or "" for d in deltas) == "Hello there"
    status, doc = server.post("/v1/chat/completions", {**body, "reasoning_format": "maybe"})
    assert status == 400 and "'reasoning_format'" in doc["error"]["message"]


def test_server_chat_template_kwargs(server):
    msgs = {"messages": [{"role": "user", "content": "hi"}]}
    status, doc = server.post("/apply-template", msgs)  # --chat-template-kwargs
    assert status == 200 and doc["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    status, doc = server.post("/apply-template", {**msgs, "chat_template_kwargs": {"enable_thinking": True}})
    assert status == 200 and doc["prompt"].endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("stream", [False, True])
def test_a_template_of_its_own_tags_is_read_in_them(stream):
    # the analysis finds <thought>...</thought> in the template: the reply's thinking is read in those
    source = CHATML_TURNS.replace("{{ m.content }}", "{% if m.reasoning_content %}<thought>{{ m.reasoning_content }}"
                                                     "</thought>{% endif %}{{ m.content }}")
    text = "<thought>\nPlan.\n</thought>\n\nHello."
    msg = scripted_reply(source, {}, [text[i:i + 3] for i in range(0, len(text), 3)], stream).choices[0].message
    # the template puts no whitespace around its tags: the reply's stays in both parts
    assert ((msg.model_extra or {}).get("reasoning_content"), msg.content) == ("\nPlan.\n", "\n\nHello.")
    text = "<think>\nPlan.\n</think>\n\nHello."  # another tag is text there
    msg = scripted_reply(source, {}, [text], stream).choices[0].message
    assert ((msg.model_extra or {}).get("reasoning_content"), msg.content) == (None, text)


# the whitespace llama-server keeps (common/chat-auto-parser-generator.cpp, analyze_reasoning::build_parser:
# optional(optspace(start) + reasoning(until(trim(end))) + optspace(end)); chat-peg-parser.cpp drops a
# reasoning of whitespace only): (reply, (start, end) as the template renders them, forced open, opener,
# tools) -> (reasoning, content)
QWEN3_TAGS = ("<think>\n", "\n</think>\n\n")
WHITESPACE_CASES = [
    # Qwen3's tags: their own newlines are taken where the reply has them, the rest stays
    ("<think>\nStep 1.\n</think>\n\nParis.", QWEN3_TAGS, False, "", False, ("Step 1.\n", "Paris.")),
    ("<think>\n\nStep 1.\n\n</think>\n\n\nParis.", QWEN3_TAGS, False, "", False, ("\nStep 1.\n\n", "\nParis.")),
    ("<think>Step 1.</think>Paris.", QWEN3_TAGS, False, "", False, ("Step 1.", "Paris.")),
    ("<think>Step 1.</think> \nParis.", QWEN3_TAGS, False, "", False, ("Step 1.", " \nParis.")),
    # R1's: no whitespace of their own, the reply's all kept
    ("<think>\nStep 1.\n</think>\n\nParis.", ("<think>", "</think>"), False, "", False,
     ("\nStep 1.\n", "\n\nParis.")),
    # a reasoning of whitespace only is dropped
    ("<think>\n \t\n</think>\n\nParis.", QWEN3_TAGS, False, "", False, (None, "Paris.")),
    ("<think> \n", ("<think>", "</think>"), False, "", False, (None, "")),
    # whitespace or text before the start tag: no thinking is read, the reply is content
    (" <think>x</think>y", ("<think>", "</think>"), False, "", False, (None, " <think>x</think>y")),
    ("Hi <think>x</think>y", ("<think>", "</think>"), False, "", False, (None, "Hi <think>x</think>y")),
    # ... except with tools, where llama-server's parser allows whitespace before it
    (" \n<think>x</think>y", ("<think>", "</think>"), False, "", True, ("x", "y")),
    # the prompt opened the thinking: read with the reply, as llama-server prepends the generation prompt
    ("Step 1.\n</think>\n\nParis.", QWEN3_TAGS, True, "<think>\n", False, ("Step 1.\n", "Paris.")),
    ("Step 1.\n</think>\n\nParis.", ("<think>", "</think>"), True, "<think>\n", False,
     ("\nStep 1.\n", "\n\nParis.")),
    ("\nStep 1.</think>Paris.", QWEN3_TAGS, True, "<think>", False, ("Step 1.", "Paris.")),
    # a reply that opens the thinking the prompt opened: its tag is reasoning text
    ("<think>\nStep 1.\n</think>\n\nParis.", QWEN3_TAGS, True, "<think>\n", False,
     ("<think>\nStep 1.\n", "Paris.")),
    # an unclosed thinking is all reasoning, as written
    ("<think>\nStep 1.\n", QWEN3_TAGS, False, "", False, ("Step 1.\n", "")),
]


@pytest.mark.parametrize("text, tags, opened, opener, tools, expected", WHITESPACE_CASES)
def test_whitespace_kept_as_llama_server_keeps_it(text, tags, opened, opener, tools, expected):
    def read(pieces: list[str]) -> tuple[object, str, list[tuple[str, str]]]:
        s = ReasoningStream("deepseek", opened, (), *tags, opener=opener, skip_space=tools)
        out = [s.feed(p) for p in pieces] + [s.finish()]
        return (s.reasoning or None), s.content, out
    whole = read([text])
    assert whole[:2] == expected
    rng = random.Random(text)
    for _ in range(30):
        pieces, at = [], 0
        while at < len(text):
            pieces.append(text[at:at + rng.randint(1, 5)])
            at += len(pieces[-1])
        reasoning, content, out = read(pieces)
        # the deltas add up to the whole reply's parts
        assert ("".join(r for r, _ in out) or None, "".join(c for _, c in out)) == (reasoning, content) == expected


def test_streamed_reasoning_is_held_back_no_longer_than_needed():
    s = ReasoningStream("deepseek", False, (), *QWEN3_TAGS)
    assert s.feed("<think>\n") == ("", "")
    assert s.feed("  ") == ("", "")  # whitespace only so far: it may be dropped
    assert s.feed("Step\n") == ("  Step\n", "")  # sent as it comes, whitespace before the end included
    assert s.feed("</thi") == ("", "")  # maybe the end tag
    assert s.feed("nk>\n") == ("", "")  # the end's own newlines may follow
    assert s.feed("x") == ("", "x")
    assert s.finish() == ("", "")
    assert (s.reasoning, s.content) == ("  Step\n", "x")


@pytest.mark.parametrize("stream", [False, True])
def test_a_family_parser_takes_out_the_whitespace_it_takes_out(stream):
    # Magistral's parser reads [THINK] reasoning [/THINK] << content: the reasoning as written, the
    # content from its first non-space (llama-server's common/chat.cpp, as its replies show)
    s = ReasoningStream("deepseek", False, (), "[THINK]", "[/THINK]", lstrip_content=True)
    text = "[THINK]\nStep 1.\n[/THINK]\n\nParis."
    for piece in ([text] if not stream else list(text)):
        s.feed(piece)
    s.finish()
    assert (s.reasoning, s.content) == ("\nStep 1.\n", "Paris.")
    # Qwen3-Coder's: "<think>" + space() + reasoning, then the content after a space()
    s = ReasoningStream("deepseek", True, ("<tool_call>",), lstrip_reasoning=True, lstrip_content=True)
    for piece in (["\nStep 1.\n</think>\n\nParis."] if not stream else list("\nStep 1.\n</think>\n\nParis.")):
        s.feed(piece)
    s.finish()
    assert (s.reasoning, s.content) == ("Step 1.\n", "Paris.")
