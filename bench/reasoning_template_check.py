"""Reasoning against llama.cpp's llama-server: which templates have a reply's thinking read out.

    python bench/reasoning_template_check.py --peers DIR [--model PATH] [--templates chatml,qwen3,...]
                                             [--template-file PATH ...]

llama-server reads a reply's ``<think>`` into ``reasoning_content`` only under a template whose
chat format thinks; under any other the tags stay in ``content``. For each template (the test
templates of tests/tool_templates*.py and tests/tool_format_templates.py, and plain ChatML) the
peers' ``llama-server --jinja`` is started on a test model (made with pyllama.models.make unless
--model names one), and the same reply is read by both servers:

- llama-server's reply is put in as a prefilled assistant message (which it reads as the start
  of its reply), the one token it then generates forced to be the end of generation. It continues
  a prefill after a thinking that it closes itself, so the reply's thinking goes in as the
  message's reasoning_content; where the template shows no thinking it drops that, and the whole
  reply goes in as the content instead.
- pyllama reads the text as the model would write it (after the thinking its prompt opens, where
  it opens one) through its chat endpoint's response path, whole and streamed, with the template's
  own decision (ChatTemplate.thinking).

Where the prompt opens the thinking, llama-server continues a prefill from the template's own
start tag (without what the prompt put after it), so with reasoning_format none the tag's
whitespace can differ from the model's text: a limit of the prefill, not of either reader.

Printed per template: whether pyllama finds thinking in it, then per reply and reasoning_format:
agree (content and reasoning the same, whitespace included), whitespace (they differ in whitespace
only) or differ, with both readings, or refused when llama-server answers with an error; then a
summary table.
"""
from __future__ import annotations

import argparse
from string import ascii_letters
import json
import os
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import Peers  # noqa: E402
from tool_format_check import eos_id, post, start_template_server, stop_template_server  # noqa: E402
from pyllama.server.chat import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError  # noqa: E402
from pyllama.server.reasoning import prompt_opens_thinking  # noqa: E402
from test_tool_calls import scripted_reply  # noqa: E402
from tool_format_templates import QWEN35, TEMPLATES as FORMAT_TEMPLATES  # noqa: E402
from tool_templates import FAMILY_TEMPLATES, QWEN3  # noqa: E402
from tool_templates_more import MORE_TEMPLATES  # noqa: E402

# a template whose prompt opens <think> but that shows no thinking (llama-server: content only)
OPENS_ONLY = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}")

TEMPLATES = {"chatml": CHATML_TEMPLATE, "opens-only": OPENS_ONLY, "qwen3": QWEN3, "qwen35": QWEN35,
             **FAMILY_TEMPLATES, **{k: v for k, v in MORE_TEMPLATES.items() if not k.startswith("functionary")},
             **{k: v for k, v in FORMAT_TEMPLATES.items() if k != "harmony"}}

THOUGHT, ANSWER = "Step 1.\nStep 2.", "Paris is sunny."
USER = [{"role": "user", "content": "Weather in Paris?"}]


def tags(name: str) -> tuple[str, str]:
    t = ChatTemplate(TEMPLATES[name]).thinking
    return (t.start, t.end) if t is not None else ("<think>", "</think>")


# the answer as a template's model writes it (Command R7B wraps its answer in response markers)
ANSWERS = {"command-r7b": f"<|START_RESPONSE|>{ANSWER}<|END_RESPONSE|>"}


def replies(name: str) -> list[tuple[str, str, tuple[str, str]]]:
    """(label, the model's text, (its thinking, the rest) as written) of each reply: a thinking
    then an answer, in the template's tags (<think> where it has none), written after the tag
    where the prompt opens it; and an answer without thinking (where the prompt opens the thinking,
    one that closes it at once); and a thinking cut off before its end tag (a reply that ran out of
    tokens while thinking)."""
    start, end = tags(name)
    answer = ANSWERS.get(name, ANSWER)
    prompt = ChatTemplate(TEMPLATES[name]).render_request({"messages": USER})
    opened = prompt.rstrip().endswith(start) or prompt_opens_thinking(prompt)
    thought, rest = f"\n{THOUGHT}\n", f"\n\n{answer}"
    if opened:  # the prompt's tag is followed by a newline already
        thought = thought.lstrip("\n")
        return [("thinking", thought + end + rest, (thought, rest)), ("plain", end + rest, ("", rest)),
                ("unclosed", thought.rstrip(), (thought.rstrip(), ""))]
    return [("thinking", start + thought + end + rest, (thought, rest)), ("plain", answer, ("", answer)),
            ("unclosed", start + thought.rstrip(), (thought.rstrip(), ""))]


def prefill_for(port: int, eos: int, text: str, split: tuple[str, str]) -> dict:
    """The prefilled assistant message that has llama-server read `text` as its reply: it goes on
    from a thinking it opens and closes itself in the template's own tags (whose whitespace it
    keeps), so the thinking goes in as reasoning_content, with or without the whitespace around
    it, or (where the template shows no thinking, which it then drops) the whole text as content.
    The one whose reading with reasoning_format none (the text as llama-server parses it) is the
    text, else the first that keeps the thinking."""
    thought, rest = split
    tries = [{"role": "assistant", "content": rest, "reasoning_content": thought},
             {"role": "assistant", "content": rest.strip(), "reasoning_content": thought.strip()},
             {"role": "assistant", "content": text}]
    body = {"reasoning_format": "none", "n_predict": 1, "logit_bias": [[eos, 1000]], "temperature": 0}
    kept = None
    for prefill in tries:
        status, doc = post(port, {**body, "messages": USER + [prefill]})
        if status != 200:
            continue
        content = doc["choices"][0]["message"].get("content") or ""
        if content == text or (content.endswith(text) and content[:-len(text)].strip() and
                               not content[:-len(text)].strip(ascii_letters + " ")):
            return prefill
        if kept is None and (not thought.strip() or thought.strip().split("\n")[0] in content):
            kept = prefill
    return kept or tries[-1]


def llama_read(port: int, prefill: dict, eos: int, fmt: str, stream: bool) -> tuple[int, object]:
    """llama-server's reading of the reply put in as `prefill`."""
    body = {"messages": USER + [prefill], "reasoning_format": fmt, "n_predict": 1, "logit_bias": [[eos, 1000]],
            "temperature": 0}
    return (post_stream if stream else post)(port, body)


def post_stream(port: int, body: dict) -> tuple[int, object]:
    """A streamed chat completion's content and reasoning_content deltas, added up (as a
    non-streamed answer's document)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    content = reasoning = ""
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices") or []:
                    delta = choice.get("delta") or {}
                    content += delta.get("content") or ""
                    reasoning += delta.get("reasoning_content") or ""
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    return 200, {"choices": [{"message": {"content": content, "reasoning_content": reasoning}}]}


def pyllama_read(name: str, text: str, fmt: str, stream: bool) -> dict:
    out = scripted_reply(TEMPLATES[name], {}, [text[i:i + 3] for i in range(0, len(text), 3)], stream,
                         reasoning_format=fmt)
    msg = out.choices[0].message
    return {"content": msg.content or "", "reasoning": (msg.model_extra or {}).get("reasoning_content") or ""}


def check(peers: Peers, model: str, name: str, workdir: str) -> list[tuple[str, str]]:
    tpl = os.path.join(workdir, f"{name}.jinja")
    Path(tpl).write_text(TEMPLATES[name])
    thinks = ChatTemplate(TEMPLATES[name]).thinking
    print(f"{name}: pyllama finds {'thinking ' + repr((thinks.start, thinks.end)) if thinks else 'no thinking'}")
    try:
        ChatTemplate(TEMPLATES[name]).render_request({"messages": USER})
    except ChatTemplateError as exc:
        print(f"  pyllama cannot render it: {exc}")
        return [("(render)", "refused")]
    proc, port, log = start_template_server(peers, model, tpl, os.path.join(workdir, f"{name}.log"), "-c", "2048")
    if proc is None:
        return [("(server)", "refused")]
    rows: list[tuple[str, str]] = []
    try:
        eos = eos_id(model)
        for label, text, split in replies(name):
            prefill = prefill_for(port, eos, text, split)
            for fmt in ("auto", "none", "deepseek-legacy"):
                if fmt != "auto" and label == "plain":
                    continue
                for stream in (False, True):
                    tag = f"{label} ({fmt}, {'streamed' if stream else 'whole'})"
                    status, doc = llama_read(port, prefill, eos, fmt, stream)
                    ours = pyllama_read(name, text, fmt, stream)
                    if status != 200:
                        print(f"  {tag}: llama-server refused ({status}): {str(doc)[:200]}")
                        print(f"    pyllama reads {ours!r}")
                        rows.append((tag, "refused"))
                        continue
                    msg = doc["choices"][0]["message"]
                    theirs = {"content": msg.get("content") or "", "reasoning": msg.get("reasoning_content") or ""}
                    # compared exactly, whitespace included; a difference in whitespace only is told apart
                    loose = {k: "".join(v.split()) for k, v in ours.items()} == \
                        {k: "".join(v.split()) for k, v in theirs.items()}
                    verdict = "agree" if ours == theirs else "whitespace" if loose else "differ"
                    print(f"  {tag}: {verdict}  {theirs!r}")
                    if ours != theirs:
                        print(f"    pyllama {ours!r}")
                    rows.append((tag, verdict))
    finally:
        stop_template_server(proc, log)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", required=True, help="folder with llama.cpp's bin/ (llama-server)")
    ap.add_argument("--model", help="GGUF model (default: a tiny test model made here)")
    ap.add_argument("--templates", default=",".join(TEMPLATES), help="comma-separated templates to check")
    ap.add_argument("--template-file", action="append", default=[], metavar="PATH",
                    help="a Jinja template file to check too (named by its file name; repeatable)")
    args = ap.parse_args()
    names = args.templates.split(",") if args.templates else []
    for path in args.template_file:
        name = Path(path).stem
        TEMPLATES[name] = Path(path).read_text()
        names.append(name)
    peers = Peers.find(args.peers)
    if peers is None or not os.path.isfile(peers.path("llama-server")):
        print(f"no llama-server under {args.peers}/bin", file=sys.stderr)
        return 2
    workdir = tempfile.mkdtemp(prefix="reasoning-template-check-")
    model: Optional[str] = args.model
    if model is None:
        from pyllama.models.make import make_model
        model = make_model("tiny", os.path.join(workdir, "tiny.gguf"))
    results = {}
    try:
        for name in names:
            if name not in TEMPLATES:
                print(f"unknown template {name!r} (known: {', '.join(TEMPLATES)})", file=sys.stderr)
                return 2
            results[name] = check(peers, model, name, workdir)
    finally:
        peers.close()
    print("\nsummary")
    for name, rows in results.items():
        n = {k: sum(1 for _, v in rows if v == k) for k in ("agree", "whitespace", "differ", "refused")}
        bad = [f"{t} [{v}]" for t, v in rows if v != "agree"]
        print(f"  {name:<17} agree {n['agree']}  whitespace {n['whitespace']}  differ {n['differ']}  "
              f"refused {n['refused']}  {'; '.join(bad)}")
    return 0 if all(v == "agree" for rows in results.values() for _, v in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
