"""Tool-call formats against llama.cpp's llama-server: the same reply read by both.

    python bench/tool_format_check.py --peers DIR [--model PATH] [--families qwen3_coder,glm45,...]

For each family of pyllama/server/tool_formats (Qwen3-Coder, GLM 4.5, Kimi K2, gpt-oss), the
peers' `llama-server --jinja` is started on a test model (made with pyllama.models.make unless
--model names one) with that family's template (tests/tool_format_templates.py), and two kinds of
reply are read by both servers' parsers:

- known replies: llama-server cannot take a grammar together with tools, so the reply is put in
  as a prefilled assistant message (which llama-server reads as the start of its reply) and the
  one token it then generates is forced to be the end of generation (for gpt-oss the prefill is
  the message's reasoning, which llama-server continues in the analysis channel).
- a required call: llama-server generates under its own call grammar (tool_choice "required");
  its raw text (`__verbose`) is read by pyllama as well.

pyllama reads the same text through its chat reply reader (the one its server uses). Printed per
reply: agree, or differ with both readings (content and reasoning compared without surrounding
whitespace, arguments as JSON values; the exact argument strings are reported apart).
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
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import Peers  # noqa: E402
from pyllama.server.api import ChatOutputSpec, ChatReply  # noqa: E402
from pyllama.server.tool_calls import detect_family, parse_tool_request  # noqa: E402
from tool_format_templates import TEMPLATES  # noqa: E402

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

KNOWN: dict[str, list[str]] = {
    "qwen3_coder": [
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew \"York\"\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "<function=get_weather>\n<parameter=city>\n42\n</parameter>\n</function>\n</tool_call>",
        "Two.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nline 1\nline <2>\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=days>\n7\n</parameter>\n<parameter=city>\n"
        "Oslo\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
        "Done.",
        "No call.",
    ],
    "glm45": [
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
        "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>a\nb</arg_value>\n</tool_call>\n"
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>\nDone.",
        "No call.",
    ],
    "kimi_k2": [
        f'{KIMI[0]}{KIMI[1]}functions.get_weather:0{KIMI[2]}{{"city": "Paris"}}{KIMI[3]}{KIMI[4]}',
        f'Checking.{KIMI[0]}{KIMI[1]}functions.get_weather:0{KIMI[2]}{{"city": "Paris"}}{KIMI[3]}'
        f'{KIMI[1]}functions.get_weather:1{KIMI[2]}{{"city": "Oslo", "days": 2}}{KIMI[3]}{KIMI[4]}',
        f'{KIMI[0]}{KIMI[1]}functions.get_weather:0{KIMI[2]}{{"city": "Paris"}}{KIMI[3]}{KIMI[4]}Done.',
        "No call.",
    ],
    "harmony": [
        _A + '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city":"Paris"}',
        _A + '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}',
        _A + "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant"
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris","days":2}',
        _A + "<|start|>assistant<|channel|>final<|message|>It is sunny.",
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


def pyllama_reading(family: str, text: str, tools: list[dict], reasoning_format: str = "auto") -> dict:
    spec = ChatOutputSpec(family=family, tools=parse_tool_request({"tools": tools}), reasoning_format=reasoning_format)
    reply = ChatReply(spec)
    reply.feed(text)
    reply.finish()
    msg = reply.message()
    return reading(msg.get("content"), msg.get("reasoning_content"), msg.get("tool_calls", []))


def llama_reading(doc: dict) -> dict:
    msg = doc["choices"][0]["message"]
    return reading(msg.get("content"), msg.get("reasoning_content"), msg.get("tool_calls") or [])


def compare(label: str, theirs: dict, ours: dict) -> bool:
    same = all(theirs[k] == ours[k] for k in ("content", "reasoning", "calls"))
    print(f"  {label}: {'agree' if same else 'differ'}")
    if not same:
        for k in ("content", "reasoning", "calls"):
            if theirs[k] != ours[k]:
                print(f"    {k}: llama-server {theirs[k]!r}\n    {' ' * len(k)}  pyllama      {ours[k]!r}")
    if same and theirs["raw_content"] != ours["raw_content"]:
        print(f"    content as sent: llama-server {theirs['raw_content']!r}, pyllama {ours['raw_content']!r}")
    if theirs["raw_args"] != ours["raw_args"]:
        print(f"    argument strings: llama-server {theirs['raw_args']!r}, pyllama {ours['raw_args']!r}")
    return same


def check_family(peers: Peers, model: str, family: str, workdir: str) -> tuple[int, int]:
    tpl = os.path.join(workdir, f"{family}.jinja")
    with open(tpl, "w") as fh:
        fh.write(TEMPLATES[family])
    print(f"{family} (pyllama detects {detect_family(TEMPLATES[family])})")
    port = free_port()
    log = open(os.path.join(workdir, f"{family}.log"), "w")
    proc = peers.popen("llama-server", "-m", model, "--jinja", "--chat-template-file", tpl, "--port", str(port),
                       "-c", "4096", "--override-kv", "llama.context_length=int:131072", "-np", "1",
                       stdout=log, stderr=subprocess.STDOUT)
    agree = total = refused = 0
    try:
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.time() > deadline or proc.poll() is not None:
                    print("  llama-server did not start (see", log.name + ")")
                    return 0, 1, 0
                time.sleep(0.3)
        user = [{"role": "user", "content": "Weather in Paris?"}]
        eos = eos_id(model)
        # gpt-oss's reasoning is read by the call format itself: also without separating it
        formats = ("auto", "none") if family == "harmony" else ("auto",)
        for k, (text, fmt) in enumerate((t, f) for f in formats for t in KNOWN[family]):
            prefill = {"role": "assistant", "content": text}
            if family == "harmony":
                prefill = {"role": "assistant", "content": "", "reasoning_content": text[len(_H_PREFILL):]}
            status, doc = post(port, {"messages": user + [prefill], "reasoning_format": fmt,
                                      # llama-server's default follows the template's probed
                                      # capabilities; pyllama's is true
                                      "tools": [WEATHER], "parallel_tool_calls": True,
                                      "n_predict": 1, "logit_bias": [[eos, 1000]],
                                      "temperature": 0})
            if status != 200:
                print(f"  known reply {k}: llama-server refused ({status}): {str(doc)[:300]}")
                ours = pyllama_reading(family, text, [WEATHER], fmt)
                print(f"    pyllama reads content {ours['content']!r}, calls {ours['calls']!r}")
                refused += 1
                continue
            total += 1
            agree += compare(f"known reply {k}" + (f" (reasoning_format {fmt})" if fmt != "auto" else ""),
                             llama_reading(doc), pyllama_reading(family, text, [WEATHER], fmt))
        status, doc = post(port, {"messages": user, "tools": [FIXED], "tool_choice": "required",
                                  "parallel_tool_calls": False, "max_tokens": 200, "seed": 1, "verbose": True})
        if status != 200:
            print(f"  required call: llama-server refused ({status}): {str(doc)[:300]}")
            refused += 1
        else:
            raw = (doc.get("__verbose") or {}).get("content")
            total += 1
            if raw is None:
                print("  required call: llama-server gave no raw text (__verbose)")
            else:
                print(f"  required call, as generated: {raw!r}")
                agree += compare("required call", llama_reading(doc), pyllama_reading(family, raw, [FIXED]))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    return agree, total, refused


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
    print("\nsummary")
    for family, (agree, total, refused) in results.items():
        print(f"  {family}: {'agree' if agree == total else 'differ'} ({agree}/{total} replies read alike"
              + (f"; {refused} that llama-server refused to read" if refused else "") + ")")
    return 0 if all(a == t for a, t, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
