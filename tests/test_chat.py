"""Chat templates (pyllama.server.chat): HF-compatible rendering, the ChatML fallback, message checks."""
from __future__ import annotations

import copy
import json
import logging
from datetime import datetime

import pytest

from pyllama.server.chat import (
    CHATML_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    validate_messages,
)

# Templates in the shape of the well-known Hugging Face ones (tokenizer_config.json chat_template).

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

QWEN2_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)

# Qwen2.5-style tools block (multi-line, relies on trim_blocks / lstrip_blocks and `-` control).
QWEN25_TOOLS_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'system' and loop.first and tools) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

USER_HI = [{"role": "user", "content": "hi"}]


def test_fallback_chatml_exact():
    t = ChatTemplate(None)
    assert t.is_fallback
    assert t.source == CHATML_TEMPLATE
    out = t.render(validate_messages(USER_HI), add_generation_prompt=True)
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    out = t.render(validate_messages(USER_HI), add_generation_prompt=False)
    assert out == "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize("source", ["", "   \n"])
def test_empty_source_is_fallback(source):
    assert ChatTemplate(source).is_fallback


def test_fallback_multi_turn():
    msgs = validate_messages([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
    ])
    assert ChatTemplate(None).render(msgs) == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n"
        "<|im_start|>user\nbye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_llama3_template():
    t = ChatTemplate(LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                     name="llama3")
    assert not t.is_fallback
    assert t.source == LLAMA3_TEMPLATE
    msgs = validate_messages([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  Hello!\n"},
    ])
    assert t.render(msgs) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert t.render(msgs, add_generation_prompt=False).endswith("Hello!<|eot_id|>")


def test_qwen2_template_default_system():
    t = ChatTemplate(QWEN2_TEMPLATE, eos_token="<|im_end|>")
    assert t.render(validate_messages(USER_HI)) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    own = validate_messages([{"role": "system", "content": "Sys."}, *USER_HI])
    assert t.render(own) == (
        "<|im_start|>system\nSys.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_mistral_template_and_raise_exception():
    t = ChatTemplate(MISTRAL_TEMPLATE, bos_token="<s>", eos_token="</s>")
    msgs = validate_messages([
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ])
    assert t.render(msgs) == "<s>[INST] a [/INST]b</s>[INST] c [/INST]"
    bad = validate_messages([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        t.render(bad)
    with pytest.raises(ChatTemplateError, match="Only user and assistant roles"):
        t.render(validate_messages([{"role": "user", "content": "a"},
                                    {"role": "tool", "content": "x"}]))


def test_tools_and_tojson_like_hf():
    tool = {"type": "function",
            "function": {"name": "météo", "description": "Wetter für <Orte> & 東京",
                         "parameters": {"type": "object", "properties": {}}}}
    t = ChatTemplate(QWEN25_TOOLS_TEMPLATE)
    out = t.render(validate_messages(USER_HI), tools=[tool])
    expected_tool = json.dumps(tool, ensure_ascii=False)
    assert out == (
        "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n<tools>\n"
        + expected_tool + "\n</tools><|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    # without tools the block disappears (tools is defined but None, as in HF)
    assert t.render(validate_messages(USER_HI)) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_tojson_non_ascii_no_html_escape_and_indent():
    t = ChatTemplate("{{ messages[0].content | tojson }}")
    out = t.render(validate_messages([{"role": "user", "content": "héllo 日本 <b>&'"}]))
    assert out == '"héllo 日本 <b>&\'"'
    t = ChatTemplate("{{ x | tojson(indent=2) }}|{{ x | tojson }}|{{ x | tojson(2) }}"
                     "|{{ x | tojson(sort_keys=true, separators=[',', ':']) }}")
    x = {"b": "ü", "a": [1, None, True]}
    assert t.render(validate_messages(USER_HI), x=x) == "|".join([
        json.dumps(x, ensure_ascii=False, indent=2),
        json.dumps(x, ensure_ascii=False),
        json.dumps(x, ensure_ascii=False, indent=2),
        json.dumps(x, ensure_ascii=False, sort_keys=True, separators=(",", ":")),
    ])


def test_globals_kwargs_and_extensions():
    t = ChatTemplate("{{ strftime_now('%Y') }}")
    assert t.render(validate_messages(USER_HI)) == str(datetime.now().year)
    t = ChatTemplate("{{ bos_token }}{{ eos_token }}{{ enable_thinking }}")
    assert t.render(validate_messages(USER_HI), enable_thinking=False) == "False"
    assert ChatTemplate("{{ bos_token }}", bos_token="<s>").render(
        validate_messages(USER_HI), bos_token="<b>") == "<b>"
    # loopcontrols (break/continue) and HF's {% generation %} tag
    t = ChatTemplate("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                     "{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}")
    assert t.render(validate_messages([*USER_HI, {"role": "assistant", "content": "x"}])) == "[hi]"
    # keep_trailing_newline
    assert ChatTemplate("{{ messages[0].content }}\n").render(validate_messages(USER_HI)) == "hi\n"


def test_bad_template_falls_back_with_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="pyllama.server.chat"):
        t = ChatTemplate("{% for m in messages %}{{ m.content }", name="broken-model")
    assert t.is_fallback
    assert t.source == CHATML_TEMPLATE
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "broken-model" in warnings[0].getMessage()
    assert "ChatML" in warnings[0].getMessage()
    assert t.render(validate_messages(USER_HI)) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # an unknown filter is a compile-time error in Jinja2, also a fallback
    assert ChatTemplate("{{ messages | no_such_filter }}").is_fallback


@pytest.mark.parametrize("source", [
    "{{ ''.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages['__class__'] }}",
    "{{ raise_exception.__globals__ }}",
    "{{ messages.append({'role': 'x'}) }}",          # immutable sandbox
    "{% set d = {} %}{{ d.update({'a': 1}) }}",
])
def test_sandbox_blocks_escapes(source):
    t = ChatTemplate(source)
    assert not t.is_fallback
    with pytest.raises(ChatTemplateError, match="unsafe"):
        t.render(validate_messages(USER_HI))


def test_render_errors_become_chat_template_errors():
    for source in ["{{ messages[0].content + 1 }}", "{{ undefined_thing() }}",
                   "{{ messages | tojson(no_such_kw=1) }}", "{{ x | tojson }}"]:
        t = ChatTemplate(source)
        with pytest.raises(ChatTemplateError):
            t.render(validate_messages(USER_HI), x=object())
    assert issubclass(ChatTemplateError, ValueError)


def test_validate_messages_ok_and_copies():
    raw = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
         "name": "bob"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "1", "type": "function",
                         "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
        {"role": "assistant"},
    ]
    before = copy.deepcopy(raw)
    out = validate_messages(raw)
    assert raw == before
    assert [m["content"] for m in out] == ["s", "a\nb", "", "42", ""]
    assert out[1]["name"] == "bob"
    assert out[2]["tool_calls"] == raw[2]["tool_calls"]
    assert out[3]["tool_call_id"] == "1"
    assert validate_messages([{"role": "user", "content": []}])[0]["content"] == ""


@pytest.mark.parametrize("messages, match", [
    (None, "'messages' must be an array"),
    ({"role": "user", "content": "x"}, "'messages' must be an array"),
    ("hi", "'messages' must be an array"),
    ([], "at least one message"),
    (["hi"], r"messages\[0\]: a message must be an object"),
    ([{"content": "x"}], r"messages\[0\]: missing 'role'"),
    ([{"role": "", "content": "x"}], "'role' must be a non-empty string"),
    ([{"role": 3, "content": "x"}], "'role' must be a non-empty string"),
    ([{"role": "user", "content": "x"}, {"role": "user"}], r"messages\[1\]: 'content' is required"),
    ([{"role": "user", "content": None}], "'content' is required"),
    ([{"role": "user", "content": 5}], "'content' must be a string or an array"),
    ([{"role": "user", "content": {"type": "text"}}], "'content' must be a string or an array"),
    ([{"role": "user", "content": ["x"]}], r"content\[0\]: a content part must be an object"),
    ([{"role": "user", "content": [{"text": "x"}]}], "'type' must be a string"),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "'text' must be a string"),
    ([{"role": "user", "content": [{"type": "text", "text": "look"},
                                   {"type": "image_url", "image_url": {"url": "data:,"}}]}],
     r"messages\[0\]\.content\[1\]: this model does not support images"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
     "does not support audio"),
    ([{"role": "user", "content": [{"type": "video"}]}], "unsupported content part type 'video'"),
    ([{"role": "assistant", "content": "", "tool_calls": {"id": 1}}], "'tool_calls' must be an array"),
])
def test_validate_messages_errors(messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        validate_messages(messages)
