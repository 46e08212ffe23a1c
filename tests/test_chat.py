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
    ([{"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]}],
     r"tool_calls\[0\]: 'function' must be an object"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"type": "code", "function": {"name": "f"}}]}],
     r"tool_calls\[0\]: 'type' must be \"function\""),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": ""}}]}],
     r"tool_calls\[0\]\.function: 'name' must be a non-empty string"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}],
     r"'arguments' must be a JSON string or an object"),
])
def test_validate_messages_errors(messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        validate_messages(messages)


# --- llama-server's built-in templates, requests, prefill -------------------------------------

from pyllama.server.chat import BUILTIN, template_from_option  # noqa: E402
from pyllama.server.chat_builtin import detect  # noqa: E402

S = "You are a helpful assistant"
CONVERSATION = [{"role": "system", "content": S}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi there"}, {"role": "user", "content": "Who are you"}]
_DS_EOS = "<｜end▁of▁sentence｜>"
# The published layout of each built-in name (llama.cpp's src/llama-chat.cpp and the model cards it
# cites) for the conversation above, with the generation prompt.
PUBLISHED = {
    "chatml": f"<|im_start|>system\n{S}<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
              "Hi there<|im_end|>\n<|im_start|>user\nWho are you<|im_end|>\n<|im_start|>assistant\n",
    "llama2": f"[INST] {S}\nHello [/INST]Hi there</s>[INST] Who are you [/INST]",
    "llama2-sys": f"[INST] <<SYS>>\n{S}\n<</SYS>>\n\nHello [/INST]Hi there</s>[INST] Who are you [/INST]",
    "llama2-sys-bos": f"[INST] <<SYS>>\n{S}\n<</SYS>>\n\nHello [/INST]Hi there</s><s>[INST] Who are you [/INST]",
    "llama2-sys-strip": f"[INST] <<SYS>>\n{S}\n<</SYS>>\n\nHello [/INST]Hi there</s>[INST] Who are you [/INST]",
    "mistral-v1": f" [INST] {S}\n\nHello [/INST] Hi there</s> [INST] Who are you [/INST]",
    "mistral-v3": f"[INST] {S}\n\nHello[/INST] Hi there</s>[INST] Who are you[/INST]",
    "mistral-v3-tekken": f"[INST]{S}\n\nHello[/INST]Hi there</s>[INST]Who are you[/INST]",
    "mistral-v7": f"[SYSTEM_PROMPT] {S}[/SYSTEM_PROMPT][INST] Hello[/INST] Hi there</s>[INST] Who are you[/INST]",
    "mistral-v7-tekken": f"[SYSTEM_PROMPT]{S}[/SYSTEM_PROMPT][INST]Hello[/INST]Hi there</s>[INST]Who are you[/INST]",
    "phi3": f"<|system|>\n{S}<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\nHi there<|end|>\n<|user|>\n"
            "Who are you<|end|>\n<|assistant|>\n",
    "phi4": f"<|im_start|>system<|im_sep|>{S}<|im_end|><|im_start|>user<|im_sep|>Hello<|im_end|>"
            "<|im_start|>assistant<|im_sep|>Hi there<|im_end|><|im_start|>user<|im_sep|>Who are you<|im_end|>"
            "<|im_start|>assistant<|im_sep|>",
    "falcon3": f"<|system|>\n{S}\n<|user|>\nHello\n<|assistant|>\nHi there\n<|user|>\nWho are you\n<|assistant|>\n",
    "zephyr": f"<|system|>\n{S}<|endoftext|>\n<|user|>\nHello<|endoftext|>\n<|assistant|>\nHi there<|endoftext|>\n"
              "<|user|>\nWho are you<|endoftext|>\n<|assistant|>\n",
    "monarch": f"system\n{S}</s>\n<s>user\nHello</s>\n<s>assistant\nHi there</s>\n<s>user\nWho are you</s>\n"
               "<s>assistant\n",
    "gemma": f"<start_of_turn>user\n{S}\n\nHello<end_of_turn>\n<start_of_turn>model\nHi there<end_of_turn>\n"
             "<start_of_turn>user\nWho are you<end_of_turn>\n<start_of_turn>model\n",
    "orion": f"Human: {S}\n\nHello\n\nAssistant: </s>Hi there</s>Human: Who are you\n\nAssistant: </s>",
    "openchat": f"{S}<|end_of_turn|>GPT4 Correct User: Hello<|end_of_turn|>GPT4 Correct Assistant: Hi there"
                "<|end_of_turn|>GPT4 Correct User: Who are you<|end_of_turn|>GPT4 Correct Assistant:",
    "vicuna": f"{S}\n\nUSER: Hello\nASSISTANT: Hi there</s>\nUSER: Who are you\nASSISTANT:",
    "vicuna-orca": f"SYSTEM: {S}\nUSER: Hello\nASSISTANT: Hi there</s>\nUSER: Who are you\nASSISTANT:",
    "deepseek": f"{S}### Instruction:\nHello\n### Response:\nHi there\n<|EOT|>\n### Instruction:\nWho are you\n"
                "### Response:\n",
    "deepseek2": f"{S}\n\nUser: Hello\n\nAssistant: Hi there{_DS_EOS}User: Who are you\n\nAssistant:",
    "deepseek3": f"{S}\n\n<｜User｜>Hello<｜Assistant｜>Hi there{_DS_EOS}<｜User｜>Who are you<｜Assistant｜>",
    "command-r": f"<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>{S}<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|>"
                 "<|USER_TOKEN|>Hello<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hi there"
                 "<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Who are you<|END_OF_TURN_TOKEN|>"
                 "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "llama3": f"<|start_header_id|>system<|end_header_id|>\n\n{S}<|eot_id|><|start_header_id|>user<|end_header_id|>"
              "\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nWho are you<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "chatglm3": f"[gMASK]sop<|system|>\n {S}<|user|>\n Hello<|assistant|>\n Hi there<|user|>\n Who are you<|assistant|>",
    "chatglm4": f"[gMASK]<sop><|system|>\n{S}<|user|>\nHello<|assistant|>\nHi there<|user|>\nWho are you<|assistant|>\n",
    "glmedge": f"<|system|>\n{S}<|user|>\nHello<|assistant|>\nHi there<|user|>\nWho are you<|assistant|>",
    "minicpm": f"{S}<用户>Hello<AI>Hi there<用户>Who are you<AI>",
    "exaone3": f"[|system|]{S}[|endofturn|]\n[|user|]Hello\n[|assistant|]Hi there[|endofturn|]\n[|user|]Who are you\n"
               "[|assistant|]",
    "exaone4": f"[|system|]{S}[|endofturn|]\n[|user|]Hello\n[|assistant|]Hi there[|endofturn|]\n[|user|]Who are you\n"
               "[|assistant|]",
    "rwkv-world": f"System: {S}\n\nUser: Hello\n\nAssistant: Hi there\n\nUser: Who are you\n\nAssistant:",
    "granite": f"<|start_of_role|>system<|end_of_role|>{S}<|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Hello"
               "<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>Hi there<|end_of_text|>\n"
               "<|start_of_role|>user<|end_of_role|>Who are you<|end_of_text|>\n"
               "<|start_of_role|>assistant<|end_of_role|>\n",
    "gigachat": f"<s>{S}<|message_sep|>user<|role_sep|>Hello<|message_sep|>available functions<|role_sep|>[]"
                "<|message_sep|>assistant<|role_sep|>Hi there<|message_sep|>user<|role_sep|>Who are you"
                "<|message_sep|>available functions<|role_sep|>[]<|message_sep|>assistant<|role_sep|>",
    "megrez": f"<|role_start|>system<|role_end|>{S}<|turn_end|><|role_start|>user<|role_end|>Hello<|turn_end|>"
              "<|role_start|>assistant<|role_end|>Hi there<|turn_end|><|role_start|>user<|role_end|>Who are you"
              "<|turn_end|><|role_start|>assistant<|role_end|>",
    "yandex": "<s> Пользователь: Hello\n\n Ассистент: Hi there\n\n Пользователь: Who are you\n\n Ассистент:[SEP]",
    "bailing": f"<role>SYSTEM</role>{S}<role>HUMAN</role>Hello<role>ASSISTANT</role>Hi there<role>HUMAN</role>"
               "Who are you<role>ASSISTANT</role>",
    "llama4": f"<|header_start|>system<|header_end|>\n\n{S}<|eot|><|header_start|>user<|header_end|>\n\nHello<|eot|>"
              "<|header_start|>assistant<|header_end|>\n\nHi there<|eot|><|header_start|>user<|header_end|>\n\n"
              "Who are you<|eot|><|header_start|>assistant<|header_end|>\n\n",
    "smolvlm": f"<|im_start|>{S}\n\nUser: Hello<end_of_utterance>\nAssistant: Hi there<end_of_utterance>\n"
               "User: Who are you<end_of_utterance>\nAssistant:",
    "hunyuan-moe": f"<|startoftext|>{S}<|extra_4|><|startoftext|>Hello<|extra_0|>Hi there<|eos|>"
                   "<|startoftext|>Who are you<|extra_0|>",
}


def test_every_builtin_name_has_a_published_layout():
    assert set(PUBLISHED) == set(BUILTIN)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_builtin_template_renders_published_layout(name):
    tmpl = template_from_option(name, None)
    assert tmpl.builtin == name and tmpl.source == name
    assert tmpl.render(validate_messages(CONVERSATION), add_generation_prompt=True) == PUBLISHED[name]


@pytest.mark.parametrize("name, expected", [
    ("llama3", "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant"
               "<|end_header_id|>\n\nI am<|eot_id|>"),
    ("mistral-v3", "[INST] Hi[/INST] I am</s>"),
    ("mistral-v1", " [INST] Hi [/INST]   I am  </s>"),
    ("llama2-sys-strip", "[INST] Hi [/INST]I am</s>"),
])
def test_builtin_templates_trim_as_published(name, expected):
    msgs = validate_messages([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  I am  "}])
    assert template_from_option(name, None).render(msgs, add_generation_prompt=False) == expected


def test_template_option_that_is_not_jinja_is_an_error():
    with pytest.raises(ChatTemplateError, match="neither a built-in template name"):
        template_from_option("llama-three", None)
    with pytest.raises(ChatTemplateError, match="not supported by pyllama"):
        template_from_option("gpt-oss", None)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        template_from_option("{% for m in messages %}", None)


def test_template_option_jinja_text_and_model_template():
    t = template_from_option("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}", None)
    assert t.render(validate_messages([{"role": "user", "content": "x"}])) == "<user>x"
    model = "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}{% endfor %}"
    assert template_from_option(None, model).source == model
    assert template_from_option(None, None).is_fallback
    # --no-jinja: the built-in layout the model's template resembles, as llama-server guesses it
    legacy = template_from_option(None, model, jinja=False)
    assert legacy.builtin == "llama3"
    assert template_from_option(None, "{{ weird }}", jinja=False).builtin == "chatml"


@pytest.mark.parametrize("snippet, name", [
    ("{{ '<|im_start|>' + m.role }}", "chatml"), ("<|im_start|>x<|im_sep|>", "phi4"),
    ("[INST] {{ x }} [SYSTEM_PROMPT]", "mistral-v7"), ("<<SYS>> [INST]", "llama2-sys"),
    ("<start_of_turn>", "gemma"), ("<|start_header_id|> <|end_header_id|>", "llama3"),
    ("<|header_start|><|header_end|>", "llama4"), ("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>", "command-r"),
    ("<|start_of_role|>", "granite"), ("nothing known", ""),
])
def test_detect_builtin_layout(snippet, name):
    assert detect(snippet) == name


def _req(tmpl, messages, **body):
    return tmpl.render_request({"messages": messages, **body})


def test_final_assistant_message_is_continued():
    t = template_from_option("chatml", None)
    msgs = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    expected = "<|im_start|>user\nCount<|im_end|>\n<|im_start|>assistant\n1, 2,"
    assert _req(t, msgs) == expected
    assert _req(t, msgs, continue_final_message=True, add_generation_prompt=False) == expected
    # the prefill is the default; with --no-prefill-assistant the message is closed instead
    closed = template_from_option("chatml", None, prefill_assistant=False)
    assert _req(closed, msgs) == expected + "<|im_end|>\n<|im_start|>assistant\n"


def test_continuation_refusals_as_llama_server():
    t = template_from_option("chatml", None)
    msgs = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    with pytest.raises(ChatTemplateError) as e:
        _req(t, msgs, continue_final_message=True)  # add_generation_prompt defaults to true
    assert str(e.value) == "Cannot set both add_generation_prompt and continue_final_message to true."
    with pytest.raises(ChatTemplateError) as e:
        _req(t, msgs + [{"role": "assistant", "content": "3"}])
    assert str(e.value) == "Cannot have 2 or more assistant messages at the end of the list."
    tool_msg = {"role": "assistant", "content": None,
                "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    with pytest.raises(ChatTemplateError) as e:
        _req(t, msgs[:1] + [tool_msg], continue_final_message=True, add_generation_prompt=False)
    assert str(e.value) == "Cannot continue an assistant message that contains tool calls."
    with pytest.raises(ChatTemplateError, match="add_generation_prompt"):
        _req(t, msgs[:1], add_generation_prompt="yes")


def test_add_generation_prompt_false_is_honoured():
    t = template_from_option("chatml", None)
    assert _req(t, [{"role": "user", "content": "Hi"}], add_generation_prompt=False) == \
        "<|im_start|>user\nHi<|im_end|>\n"


def test_chat_template_kwargs_reach_the_template():
    src = "{{ greeting }}|{{ level }}|{% for m in messages %}{{ m.content }}{% endfor %}"
    t = template_from_option(src, None, kwargs={"greeting": "server", "level": 1})
    msgs = [{"role": "user", "content": "x"}]
    assert _req(t, msgs) == "server|1|x"
    assert _req(t, msgs, chat_template_kwargs={"greeting": "request"}) == "request|1|x"
    # the request cannot replace the conversation itself
    assert _req(t, msgs, chat_template_kwargs={"messages": []}) == "server|1|x"
    with pytest.raises(ChatTemplateError, match="chat_template_kwargs"):
        _req(t, msgs, chat_template_kwargs=["x"])


# llama-server's /props chat_template_caps, learnt by rendering probes
_CAPS_TEMPLATE = (
    "{% if tools %}[tools:{% for t in tools %}{{ t.function.name }} {% endfor %}]{% endif %}"
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}"
    "{% if m.reasoning_content %}(thought {{ m.reasoning_content }}){% endif %}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def test_template_caps_in_llama_servers_names():
    rich = ChatTemplate(_CAPS_TEMPLATE)
    assert rich.llama_caps() == {
        "supports_object_arguments": True, "supports_parallel_tool_calls": True, "supports_preserve_reasoning": True,
        "supports_string_content": True, "supports_system_role": True, "supports_tool_calls": True,
        "supports_tools": True, "supports_typed_content": True}
    plain = template_from_option("chatml", None)
    assert plain.llama_caps() == {
        "supports_object_arguments": False, "supports_parallel_tool_calls": False,
        "supports_preserve_reasoning": False, "supports_string_content": True, "supports_system_role": True,
        "supports_tool_calls": False, "supports_tools": False, "supports_typed_content": False}
    # a template that drops system messages and shows only the first call of a message
    narrow = ChatTemplate(_CAPS_TEMPLATE.replace("{% for m in messages %}", "{% for m in messages if m.role != 'system' %}")
                          .replace("m.tool_calls or []", "(m.tool_calls or [])[:1]"))
    caps = narrow.llama_caps()
    assert caps["supports_system_role"] is False and caps["supports_parallel_tool_calls"] is False
    assert caps["supports_tool_calls"] is True


def test_reasoning_effort_reaches_a_template_that_reads_it():
    msgs = [{"role": "user", "content": "Hi"}]
    tpl = ChatTemplate("{{ reasoning_effort | default('unset') }}|{{ enable_thinking | default('unset') }}|"
                       "{% for m in messages %}{{ m.content }}{% endfor %}")
    # (enable_thinking: false, as llama-server gives it to a template that does not think)
    assert tpl.render_request({"messages": msgs}) == "unset|False|Hi"
    assert tpl.render_request({"messages": msgs, "reasoning_effort": "high"}) == "high|False|Hi"
    assert tpl.render_request({"messages": msgs, "reasoning_effort": "none"}) == "unset|False|Hi"
    # chat_template_kwargs wins, as the variable is the template's own
    assert tpl.render_request({"messages": msgs, "reasoning_effort": "high",
                               "chat_template_kwargs": {"reasoning_effort": "low"}}) == "low|False|Hi"
    with pytest.raises(ChatTemplateError, match="'reasoning_effort' must be a string"):
        tpl.render_request({"messages": msgs, "reasoning_effort": 3})
    plain = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="'reasoning_effort' 'high' is not supported"):
        plain.render_request({"messages": msgs, "reasoning_effort": "high"})


def test_tools_are_undefined_without_tools():
    """As llama.cpp renders a template: `tools` is defined only when the request gives tools, so a
    template that tests `tools is defined` (Phi-4-mini's) renders a request without them."""
    src = ("{% if tools is defined %}TOOLS {{ tools | length }};{% endif %}"
           "{% for m in messages %}{{ m.content }}{% endfor %}")
    t = ChatTemplate(src)
    msgs = [{"role": "user", "content": "hi"}]
    assert t.render(msgs, add_generation_prompt=False) == "hi"
    assert t.render(msgs, add_generation_prompt=False, tools=[]) == "hi"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    assert t.render(msgs, add_generation_prompt=False, tools=[tool]) == "TOOLS 1;hi"
