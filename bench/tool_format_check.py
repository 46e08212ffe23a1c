"""Tool-call formats against llama.cpp's llama-server: the same reply read by both.

    python bench/tool_format_check.py --peers DIR [--model PATH] [--families qwen3_coder,glm45,...]

For each tool-call family pyllama has (those of tool_calls.py, tool_formats and
tool_formats_more.py), the peers' `llama-server --jinja` is started on a test model (made with
pyllama.models.make unless --model names one) with a template in the shape of that family's
published one (tests/tool_templates.py, tool_templates_more.py and tool_format_templates.py), and
two kinds of reply are read by both servers' parsers:

- known replies: llama-server cannot take a grammar together with tools, so the reply is put in
  as a prefilled assistant message (which llama-server reads as the start of its reply) and the
  one token it then generates is forced to be the end of generation. llama-server continues a
  prefill after a thinking it closes itself, so a reply's thinking goes in as the message's
  reasoning_content (put back between the thinking markers it found in the template; where it
  found none it drops it, and the whole reply goes in as content instead); gpt-oss's prefill is
  the message's reasoning, which it continues in the analysis channel, and Functionary v3.2's is
  continued after a recipient "all" of its own, so a reply that starts with a call cannot be put
  in (shown as "n/a"). Each family has a plain answer, one call, parallel calls, thinking then a
  call, text then a call and text after a call, and some replies of its own.
- a required call: llama-server generates under its own call grammar (tool_choice "required");
  its raw text (`__verbose`) is read by pyllama as well.

pyllama reads the same text through its chat reply reader (the one its server uses), with the
thinking left open when its rendering of the same conversation ends in an opened think tag. Printed
per reply: agree, or differ with both readings (content and reasoning compared without surrounding
whitespace, arguments as JSON values; the exact argument strings are reported apart), or refused
when llama-server answers with an error; then a table per family: agree when every reply agrees,
else differ when one does, else refused.

Most of llama-server's formats are derived from the template's text, not recognised by name, so its
reading depends on how the template shows calls and thinking: the templates follow the published
ones in what they render.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import Peers  # noqa: E402
from pyllama.server.api import ChatOutputSpec, ChatReply  # noqa: E402
from pyllama.server.tool_calls import detect_family, parse_tool_request  # noqa: E402
from pyllama.server.chat import ChatTemplate  # noqa: E402
from pyllama.server.reasoning import reasoning_tags, thinking_opener  # noqa: E402
from tool_format_templates import TEMPLATES as FORMAT_TEMPLATES  # noqa: E402
from tool_templates import FAMILY_TEMPLATES  # noqa: E402
from tool_templates_more import MORE_TEMPLATES  # noqa: E402

TEMPLATES = {**FAMILY_TEMPLATES, **MORE_TEMPLATES, **FORMAT_TEMPLATES}

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
# a required call is fully fixed by the grammar when its only parameter is a constant number
FIXED = {"type": "function", "function": {"name": "get_weather", "description": "weather of a city", "parameters": {
    "type": "object", "properties": {"days": {"type": "integer", "enum": [3]}}, "required": ["days"],
    "additionalProperties": False}}}

KIMI = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
        "<|tool_calls_section_end|>")

_A = "<|channel|>analysis<|message|>The user wants the weather. Use get_weather.<|end|>"
# gpt-oss's prefill goes into the final channel unless the message has only reasoning, which
# continues the analysis: a known reply that starts there is put in as that reasoning
_H_PREFILL = "<|channel|>analysis<|message|>"

# (what the reply shows, the reply): for each family a plain answer, one call, parallel calls,
# thinking then a call, and text then a call, as its models write them
_CITY = '{"city": "Paris"}'
_TWO = ('{"city": "Paris"}', '{"city": "Oslo", "days": 2}')
_THOUGHT = "The user wants the weather. Use get_weather."
_DS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")


def _ds_call(args: str) -> str:
    return f"{_DS[1]}function{_DS[2]}get_weather\n```json\n{args}\n```{_DS[3]}"


def _hermes_call(args: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'


def _named(key: str, args: str, extra: str = "") -> str:
    return f'{{"name": "get_weather", "{key}": {args}{extra}}}'


KNOWN: dict[str, list[tuple[str, str]]] = {
    "hermes": [
        ("plain", "It is sunny in Paris."),
        ("one call", _hermes_call(_CITY)),
        ("parallel", _hermes_call(_TWO[0]) + "\n" + _hermes_call(_TWO[1])),
        ("think, call", f"<think>\n{_THOUGHT}\n</think>\n\n" + _hermes_call(_CITY)),
        ("text, call", "Let me check.\n" + _hermes_call(_CITY)),
        ("call, text", _hermes_call(_CITY) + "\nDone."),
        # no newline after <tool_call>: no call to either server (the newline is part of the
        # opening marker its templates write)
        ("parallel, no newlines", _hermes_call(_TWO[0]).replace("\n", "") + _hermes_call(_TWO[1]).replace("\n", "")),
        ("unlisted tool", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    ],
    "llama3": [
        ("plain", "It is sunny in Paris."),
        ("one call", _named("parameters", _CITY)),
        ("parallel", _named("parameters", _TWO[0]) + "; " + _named("parameters", _TWO[1])),
        ("think, call", f"<think>\n{_THOUGHT}\n</think>\n\n" + _named("parameters", _CITY)),
        ("text, call", "Let me check.<|python_tag|>" + _named("parameters", _CITY)),
        ("call, text", _named("parameters", _CITY) + "\nDone."),
        ("text, bare call", "Let me check. " + _named("parameters", _CITY)),
    ],
    "mistral": [
        ("plain", "It is sunny in Paris."),
        ("one call", "[TOOL_CALLS][" + _named("arguments", _CITY, ', "id": "abc123XYZ"') + "]"),
        ("parallel", "[TOOL_CALLS][" + _named("arguments", _TWO[0], ', "id": "abc123XYZ"') + ", "
         + _named("arguments", _TWO[1], ', "id": "def456UVW"') + "]"),
        ("think, call", f"<think>\n{_THOUGHT}\n</think>\n\n[TOOL_CALLS]["
         + _named("arguments", _CITY, ', "id": "abc123XYZ"') + "]"),
        ("text, call", "Let me check.[TOOL_CALLS][" + _named("arguments", _CITY, ', "id": "abc123XYZ"') + "]"),
        ("call, text", "[TOOL_CALLS][" + _named("arguments", _CITY, ', "id": "abc123XYZ"') + "] Done."),
        ("call without id", "[TOOL_CALLS][" + _named("arguments", _CITY) + "]"),
    ],
    # the generation prompt opens the thinking
    "deepseek": [
        ("plain", f"{_THOUGHT}\n</think>\n\nIt is sunny in Paris."),
        ("one call", f"{_THOUGHT}\n</think>\n\n{_DS[0]}{_ds_call(_CITY)}{_DS[4]}"),
        ("parallel", f"{_THOUGHT}\n</think>\n\n{_DS[0]}{_ds_call(_TWO[0])}\n{_ds_call(_TWO[1])}{_DS[4]}"),
        ("think, call", f"{_THOUGHT}</think>{_DS[0]}{_ds_call(_CITY)}{_DS[4]}"),
        ("text, call", f"{_THOUGHT}\n</think>\n\nLet me check.{_DS[0]}{_ds_call(_CITY)}{_DS[4]}"),
    ],
    # llama-server has no generic format: a template that shows no calls gets its content-only
    # parser, so these JSON replies stay text there (and a required call is refused), while
    # pyllama reads them as its own generic format, which its required-call grammar writes
    "generic": [
        ("plain", '{"response": "It is sunny in Paris."}'),
        ("one call", '{"tool_call": ' + _named("arguments", _CITY) + "}"),
        ("parallel", '{"tool_calls": [' + _named("arguments", _TWO[0]) + ", " + _named("arguments", _TWO[1]) + "]}"),
        ("think, call", f"<think>\n{_THOUGHT}\n</think>\n\n" + '{"tool_calls": [' + _named("arguments", _CITY) + "]}"),
        ("bare text", "It is sunny in Paris."),
    ],
    # llama-server's Functionary v3.2 parser reads content up to a ">>>" but never the ">>>"
    # itself, so it reads a call only at the very start of a reply: text then a call stays
    # content there (and so would a second call), which pyllama reads as the format intends
    "functionary-v3.2": [
        ("plain", "all\nIt is sunny in Paris."),
        ("one call", "get_weather\n" + _CITY),
        ("parallel", f"get_weather\n{_TWO[0]}\n>>>get_weather\n{_TWO[1]}"),
        ("think, call", f"all\n<think>{_THOUGHT}</think>\n>>>get_weather\n{_CITY}"),
        ("text, call", f"all\nLet me check.\n>>>get_weather\n{_CITY}"),
    ],
    "functionary-v3.1": [
        ("plain", "It is sunny in Paris."),
        ("one call", f"<function=get_weather>{_CITY}</function>"),
        ("parallel", f"<function=get_weather>{_TWO[0]}</function>\n<function=get_weather>{_TWO[1]}</function>"),
        ("think, call", f"<think>\n{_THOUGHT}\n</think>\n\n<function=get_weather>{_CITY}</function>"),
        ("text, call", f"Let me check.<function=get_weather>{_CITY}</function>"),
        ("call, text", f"<function=get_weather>{_CITY}</function>\nDone."),
        ("unlisted tool", "<function=get_time>{}</function>"),
    ],
    "command-r7b": [
        ("plain", "<|START_RESPONSE|>It is sunny in Paris.<|END_RESPONSE|>"),
        ("one call", '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": '
         + _CITY + "}\n]<|END_ACTION|>"),
        ("parallel", '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": '
         + _TWO[0] + '},\n    {"tool_call_id": "1", "tool_name": "get_weather", "parameters": ' + _TWO[1]
         + "}\n]<|END_ACTION|>"),
        ("think, call", f"<|START_THINKING|>{_THOUGHT}<|END_THINKING|>"
         '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": '
         + _CITY + "}\n]<|END_ACTION|>"),
        ("think, text", f"<|START_THINKING|>{_THOUGHT}<|END_THINKING|>"
         "<|START_RESPONSE|>It is sunny in Paris.<|END_RESPONSE|>"),
        ("text, call", "Let me check.<|START_ACTION|>[\n    {\"tool_call_id\": \"0\", \"tool_name\": \"get_weather\", "
         "\"parameters\": " + _CITY + "}\n]<|END_ACTION|>"),
    ],
    "granite": [
        ("plain", "It is sunny in Paris."),
        ("one call", "<|tool_call|>[" + _named("arguments", _CITY) + "]"),
        ("parallel", "<|tool_call|>[" + _named("arguments", _TWO[0]) + ", " + _named("arguments", _TWO[1]) + "]"),
        ("think, call", f"<think>{_THOUGHT}</think><|tool_call|>[" + _named("arguments", _CITY) + "]"),
        ("think, text", f"<think>{_THOUGHT}</think><response>It is sunny in Paris.</response>"),
        ("text, call", "Let me check.<|tool_call|>[" + _named("arguments", _CITY) + "]"),
        ("call, text", "<|tool_call|>[" + _named("arguments", _CITY) + "]\nDone."),
        ("unlisted tool", '<|tool_call|>[{"name": "get_time", "arguments": {}}]'),
    ],
    "magistral": [
        ("plain", "It is sunny in Paris."),
        ("one call", "[TOOL_CALLS]get_weather[ARGS]" + _CITY),
        ("parallel", f"[TOOL_CALLS]get_weather[ARGS]{_TWO[0]}[TOOL_CALLS]get_weather[ARGS]{_TWO[1]}"),
        ("think, call", f"[THINK]{_THOUGHT}[/THINK][TOOL_CALLS]get_weather[ARGS]{_CITY}"),
        ("text, call", f"Let me check.[TOOL_CALLS]get_weather[ARGS]{_CITY}"),
        ("call, text", f"[TOOL_CALLS]get_weather[ARGS]{_CITY}\nDone."),
        ("unlisted tool", "[TOOL_CALLS]get_time[ARGS]{}"),
    ],
    "seed-oss": [
        ("plain", "It is sunny in Paris."),
        ("one call", "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n"
         "</seed:tool_call>"),
        ("parallel", "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n"
         "</seed:tool_call><seed:tool_call>\n<function=get_weather>\n<parameter=city>Oslo</parameter>\n"
         "<parameter=days>2</parameter>\n</function>\n</seed:tool_call>"),
        ("think, call", f"<seed:think>{_THOUGHT}</seed:think><seed:tool_call>\n<function=get_weather>\n"
         "<parameter=city>Paris</parameter>\n</function>\n</seed:tool_call>"),
        ("text, call", "Let me check.\n<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n"
         "</function>\n</seed:tool_call>"),
        ("call, text", "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n"
         "</seed:tool_call>\nDone."),
        # a string parameter whose text reads as a number, one that spans lines, a typed one
        ("typed values", "<seed:tool_call>\n<function=get_weather>\n<parameter=city>42</parameter>\n"
         "<parameter=days>3</parameter>\n</function>\n</seed:tool_call>"),
        ("multi-line value", "<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork\n</parameter>\n"
         "</function>\n</seed:tool_call>"),
    ],
    "apertus": [
        ("plain", "It is sunny in Paris."),
        ("one call", '<|tools_prefix|>[{"get_weather": ' + _CITY + "}]<|tools_suffix|>"),
        ("parallel", '<|tools_prefix|>[{"get_weather": ' + _TWO[0] + '}, {"get_weather": ' + _TWO[1]
         + "}]<|tools_suffix|>"),
        ("think, call", f'<|inner_prefix|>{_THOUGHT}<|inner_suffix|><|tools_prefix|>[{{"get_weather": {_CITY}}}]'
         "<|tools_suffix|>"),
        ("text, call", 'Let me check.<|tools_prefix|>[{"get_weather": ' + _CITY + "}]<|tools_suffix|>"),
        ("call, text", '<|tools_prefix|>[{"get_weather": ' + _CITY + "}]<|tools_suffix|>Done."),
        ("unlisted tool", '<|tools_prefix|>[{"get_time": {}}]<|tools_suffix|>'),
    ],
    # the generation prompt opens the thinking
    "nemotron-v2": [
        ("plain", f"{_THOUGHT}\n</think>\nIt is sunny in Paris."),
        ("one call", f"{_THOUGHT}\n</think>\n<TOOLCALL>[" + _named("arguments", _CITY) + "]</TOOLCALL>"),
        ("parallel", f"{_THOUGHT}\n</think>\n<TOOLCALL>[" + _named("arguments", _TWO[0]) + ", "
         + _named("arguments", _TWO[1]) + "]</TOOLCALL>"),
        ("think, call", f"{_THOUGHT}</think><TOOLCALL>[" + _named("arguments", _CITY) + "]</TOOLCALL>"),
        ("text, call", f"{_THOUGHT}\n</think>\nLet me check. <TOOLCALL>[" + _named("arguments", _CITY)
         + "]</TOOLCALL>"),
        ("call, text", f"{_THOUGHT}\n</think>\n<TOOLCALL>[" + _named("arguments", _CITY) + "]</TOOLCALL>\nDone."),
        ("unlisted tool", f"{_THOUGHT}\n</think>\n<TOOLCALL>[{{\"name\": \"get_time\", \"arguments\": {{}}}}]</TOOLCALL>"),
    ],
    "qwen3_coder": [
        ("one call", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
         "</tool_call>"),
        ("text, call", "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew \"York\"\n"
         "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
        ("no opening tag", "<function=get_weather>\n<parameter=city>\n42\n</parameter>\n</function>\n</tool_call>"),
        ("text, parallel", "Two.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nline 1\nline <2>\n"
         "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=days>\n7\n"
         "</parameter>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"),
        ("call, text", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
         "</tool_call>\nDone."),
        ("think, call", f"<think>\n{_THOUGHT}\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
         "Paris\n</parameter>\n</function>\n</tool_call>"),
        ("plain", "No call."),
    ],
    "glm45": [
        ("one call", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"),
        ("text, call", "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
         "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"),
        ("parallel", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>a\nb</arg_value>\n</tool_call>\n"
         "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>"),
        ("call, text", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>\n"
         "Done."),
        ("think, call", f"<think>{_THOUGHT}</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
         "<arg_value>Paris</arg_value>\n</tool_call>"),
        ("plain", "No call."),
    ],
    "kimi_k2": [
        ("one call", f'{KIMI[0]}{KIMI[1]}functions.get_weather:0{KIMI[2]}{{"city": "Paris"}}{KIMI[3]}{KIMI[4]}'),
        ("text, parallel", f'Checking.{KIMI[0]}{KIMI[1]}functions.get_weather:0{KIMI[2]}{{"city": "Paris"}}{KIMI[3]}'
         f'{KIMI[1]}functions.get_weather:1{KIMI[2]}{{"city": "Oslo", "days": 2}}{KIMI[3]}{KIMI[4]}'),
        ("call, text", f'{KIMI[0]}{KIMI[1]}functions.get_weather:0{KIMI[2]}{{"city": "Paris"}}{KIMI[3]}{KIMI[4]}'
         "Done."),
        ("think, call", f'<think>{_THOUGHT}</think>{KIMI[0]}{KIMI[1]}functions.get_weather:0{KIMI[2]}'
         f'{{"city": "Paris"}}{KIMI[3]}{KIMI[4]}'),
        ("plain", "No call."),
    ],
    "harmony": [
        ("think, call", _A + '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
         '<|message|>{"city":"Paris"}'),
        ("think, call (recipient first)", _A + '<|start|>assistant to=functions.get_weather<|channel|>commentary json'
         '<|message|>{"city": "Paris"}'),
        ("think, text, call", _A + "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
         '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
         '{"city":"Paris","days":2}'),
        ("think, plain", _A + "<|start|>assistant<|channel|>final<|message|>It is sunny."),
    ],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, body: dict) -> tuple[int, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def eos_id(model: str) -> int:
    from gguf import GGUFReader
    f = GGUFReader(model).fields["tokenizer.ggml.eos_token_id"]
    return int(f.parts[f.data[0]][0])


def reading(content: Optional[str], reasoning: Optional[str], calls: list[dict]) -> dict:
    def args(a: str) -> Any:
        try:
            return json.loads(a)
        except ValueError:
            return a
    return {"content": (content or "").strip(), "raw_content": content or "", "reasoning": (reasoning or "").strip(),
            "calls": [(c["function"]["name"], args(c["function"]["arguments"])) for c in calls],
            "raw_args": [c["function"]["arguments"] for c in calls],
            "ids": [c.get("id") for c in calls]}


def pyllama_reading(family: str, text: str, tools: list[dict], reasoning_format: str = "auto",
                    opener: str = "") -> dict:
    thinks = ChatTemplate(TEMPLATES[family]).thinking is not None  # as the server decides it
    spec = ChatOutputSpec(family=family, tools=parse_tool_request({"tools": tools}), reasoning_format=reasoning_format,
                          forced_open=bool(opener) and thinks, opener=opener if thinks else "", thinks=thinks)
    reply = ChatReply(spec)
    reply.feed(text)
    reply.finish()
    msg = reply.message()
    return reading(msg.get("content"), msg.get("reasoning_content"), msg.get("tool_calls", []))


# llama-server continues a Functionary v3.2 prefill after a recipient "all" of its own
_V32_PREFIX = "all\n"


def prefills(family: str, text: str, opened: str) -> list[tuple[dict, str]]:
    """The assistant messages that have llama-server read `text` as its reply, each with the
    thinking it holds ("" when none), the one to try first first.

    A prefilled message continues the content after a thinking that llama-server closes itself
    (when the template shows one), so the thinking goes in as reasoning_content, and the whole
    reply as content after it for a template where llama-server finds no thinking."""
    if family == "harmony":
        # the prefill goes into the final channel unless the message has only reasoning, which
        # continues the analysis
        return [({"role": "assistant", "content": "", "reasoning_content": text[len(_H_PREFILL):]}, "")]
    if family == "functionary-v3.2":
        if not text.startswith(_V32_PREFIX):
            return []
        return [({"role": "assistant", "content": text[len(_V32_PREFIX):]}, "")]
    start, end = reasoning_tags(family)
    whole = ({"role": "assistant", "content": text}, "")
    if opened and end in text:
        thought, rest = text.split(end, 1)
    elif text.startswith(start) and end in text:
        thought, rest = text[len(start):].split(end, 1)
    else:
        return [whole]
    # as written, so that llama-server's text is the model's to the character
    return [({"role": "assistant", "content": rest, "reasoning_content": thought}, thought.strip()), whole]


def opens_thinking(family: str, messages: list[dict], tools: list[dict]) -> str:
    """How pyllama's rendering of the conversation before the reply opens a thinking it leaves
    open ("" when none; as its server decides it for a prefilled reply)."""
    prompt, _ = ChatTemplate(TEMPLATES[family]).render_with_prefill({"messages": messages, "tools": tools})
    return thinking_opener(prompt, family)


def llama_reading(doc: dict) -> dict:
    msg = doc["choices"][0]["message"]
    return reading(msg.get("content"), msg.get("reasoning_content"), msg.get("tool_calls") or [])


FIELDS = ("content", "reasoning", "calls")


def compare(label: str, theirs: dict, ours: dict) -> list[str]:
    """The fields read differently (printed with both readings)."""
    diff = [k for k in FIELDS if theirs[k] != ours[k]]
    print(f"  {label}: {'differ' if diff else 'agree'}")
    for k in diff:
        print(f"    {k}: llama-server {theirs[k]!r}\n    {' ' * len(k)}  pyllama      {ours[k]!r}")
    if not diff and theirs["raw_content"] != ours["raw_content"]:
        print(f"    content as sent: llama-server {theirs['raw_content']!r}, pyllama {ours['raw_content']!r}")
    if theirs["raw_args"] != ours["raw_args"]:
        print(f"    argument strings: llama-server {theirs['raw_args']!r}, pyllama {ours['raw_args']!r}")
    return diff


def start_template_server(peers: Peers, model: str, tpl: str, log_path: str,
                          *args: str) -> tuple[Optional[subprocess.Popen], int, IO]:
    """llama-server --jinja with the template file `tpl` (and `args`), its output in log_path, once
    it answers /health: (its process, its port, its log); the process is None when it did not
    start (said on stdout, its log closed)."""
    port = free_port()
    log = open(log_path, "w")
    proc = peers.popen("llama-server", "-m", model, "--jinja", "--chat-template-file", tpl, "--port", str(port),
                       "-np", "1", *args, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return proc, port, log
        except (urllib.error.URLError, ConnectionError, OSError):
            if time.time() > deadline or proc.poll() is not None:
                print("  llama-server did not start (see", log.name + ")")
                stop_template_server(proc, log)
                return None, port, log
            time.sleep(0.3)


def stop_template_server(proc: subprocess.Popen, log: IO) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


def check_family(peers: Peers, model: str, family: str, workdir: str) -> list[tuple[str, str, list[str]]]:
    """(reply, "agree" / "differ" / "refused", the fields that differ) per reply of the family."""
    tpl = os.path.join(workdir, f"{family}.jinja")
    with open(tpl, "w") as fh:
        fh.write(TEMPLATES[family])
    print(f"{family} (pyllama detects {detect_family(TEMPLATES[family])})")
    proc, port, log = start_template_server(peers, model, tpl, os.path.join(workdir, f"{family}.log"),
                                            "-c", "4096", "--override-kv", "llama.context_length=int:131072")
    if proc is None:
        return [("(server)", "refused", [])]
    results: list[tuple[str, str, list[str]]] = []
    try:
        user = [{"role": "user", "content": "Weather in Paris?"}]
        eos = eos_id(model)
        opened = opens_thinking(family, user, [WEATHER])
        # the replies with thinking also without separating it (gpt-oss's: all of them, as its
        # reasoning is read by the call format itself)
        cases = [(c, "auto") for c in KNOWN[family]]
        cases += [(c, "none") for c in KNOWN[family] if family == "harmony" or c[0].startswith("think")
                  or (opened and family != "functionary-v3.2")]
        for (label, text), fmt in cases:
            label += f" (reasoning_format {fmt})" if fmt != "auto" else ""
            ours = pyllama_reading(family, text, [WEATHER], fmt, opened)
            tries = prefills(family, text, opened)
            if not tries:
                print(f"  {label}: cannot be put in as a prefill (llama-server continues after {_V32_PREFIX!r})")
                results.append((label, "n/a", []))
                continue
            for k, (prefill, thought) in enumerate(tries):
                status, doc = post(port, {"messages": user + [prefill], "reasoning_format": fmt,
                                          # llama-server's default follows the template's probed
                                          # capabilities; pyllama's is true
                                          "tools": [WEATHER], "parallel_tool_calls": True,
                                          "n_predict": 1, "logit_bias": [[eos, 1000]],
                                          "temperature": 0})
                # a thinking that llama-server dropped (no reasoning markers found in the
                # template) is put in again as plain content, as the model would have written it
                msg = doc["choices"][0]["message"] if status == 200 else {}
                if thought and k + 1 < len(tries) and status == 200 and \
                        thought not in (msg.get("reasoning_content") or "") + (msg.get("content") or ""):
                    continue
                break
            if len(tries) > 1 and prefill is tries[-1][0]:
                label += "*"
            if status != 200:
                print(f"  {label}: llama-server refused ({status}): {str(doc)[:300]}")
                print(f"    pyllama reads content {ours['content']!r}, reasoning {ours['reasoning']!r}, "
                      f"calls {ours['calls']!r}")
                results.append((label, "refused", []))
                continue
            diff = compare(label, llama_reading(doc), ours)
            results.append((label, "differ" if diff else "agree", diff))
        status, doc = post(port, {"messages": user, "tools": [FIXED], "tool_choice": "required",
                                  "parallel_tool_calls": False, "max_tokens": 200, "seed": 1, "verbose": True})
        if status != 200:
            print(f"  required call: llama-server refused ({status}): {str(doc)[:300]}")
            results.append(("required call", "refused", []))
        else:
            raw = (doc.get("__verbose") or {}).get("content")
            if raw is None:
                print("  required call: llama-server gave no raw text (__verbose)")
                results.append(("required call", "differ", ["raw text"]))
            else:
                print(f"  required call, as generated: {raw!r}")
                diff = compare("required call", llama_reading(doc), pyllama_reading(family, raw, [FIXED],
                                                                                      opener=opened))
                results.append(("required call", "differ" if diff else "agree", diff))
    finally:
        stop_template_server(proc, log)
    return results


def summary(results: dict[str, list[tuple[str, str, list[str]]]]) -> None:
    """One row per family: how many replies agree, differ (naming them and their fields), were
    refused or could not be put in."""
    print("\nsummary")
    head = (f"{'family':<17} {'verdict':<8} {'agree':>5} {'differ':>6} {'refused':>7} {'n/a':>3}  "
            "replies that differ [fields] / refused / n/a")
    print(head)
    print("-" * len(head))
    for family, rows in results.items():
        n = {k: sum(1 for _, v, _ in rows if v == k) for k in ("agree", "differ", "refused", "n/a")}
        verdict = "differ" if n["differ"] else "refused" if n["refused"] else "agree"
        notes = [f"{label} [{', '.join(fields)}]" for label, v, fields in rows if v == "differ"]
        notes += [f"{label} (refused)" for label, v, _ in rows if v == "refused"]
        notes += [f"{label} (n/a)" for label, v, _ in rows if v == "n/a"]
        print(f"{family:<17} {verdict:<8} {n['agree']:>5} {n['differ']:>6} {n['refused']:>7} {n['n/a']:>3}  "
              + "; ".join(notes))
    print("* the whole reply put in as content: llama-server finds no thinking in the template")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", required=True, help="folder with llama.cpp's bin/ (llama-server)")
    ap.add_argument("--model", help="GGUF model (default: a tiny test model made here)")
    ap.add_argument("--families", default=",".join(TEMPLATES), help="comma-separated families to check")
    args = ap.parse_args()
    peers = Peers.find(args.peers)
    if peers is None or not os.path.isfile(peers.path("llama-server")):
        print(f"no llama-server under {args.peers}/bin", file=sys.stderr)
        return 2
    workdir = tempfile.mkdtemp(prefix="tool-format-check-")
    model = args.model
    if model is None:
        from pyllama.models.make import make_model
        model = make_model("tiny", os.path.join(workdir, "tiny.gguf"))
    results = {}
    try:
        for family in args.families.split(","):
            if family not in TEMPLATES:
                print(f"unknown family {family!r} (known: {', '.join(TEMPLATES)})", file=sys.stderr)
                return 2
            results[family] = check_family(peers, model, family, workdir)
    finally:
        peers.close()
    summary(results)
    return 0 if all(v in ("agree", "n/a") for rows in results.values() for _, v, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
