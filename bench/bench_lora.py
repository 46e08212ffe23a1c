"""LoRA adapters side by side: pyllama's greedy tokens against llama-server's `--lora` on the same
model and adapter files, and what the adapters cost each of them.

    python bench/bench_lora.py [--peers DIR] [--preset small] [--type q8_0] [--rank 16] [--tokens 48]
                               [--prompts 4] [-t 2] [--json OUT]

A model (`--preset`, `--type`, llama's SPM vocabulary) and two adapters are made with
pyllama.models.make and make_lora under bench/out/models: A adapts every block matrix (rank
`--rank`, F16 as llama.cpp's converter writes them by default), B the attention q and v and the
output matrix (F32). Both servers load both (`--lora A --lora B`), one slot each per prompt, with
F32 KV caches and flash attention off (the arithmetic pyllama shares with ggml, as bench/compare_logits.py), and
llama-server with --no-repack (the Q8_0 arithmetic pyllama shares with it). With quantized
weights, every activation is rounded to the weight's dot-product type, and an ulp of difference in
an adapter's product (whose summation order differs from ggml's) can flip such a rounding: on
random-weight models that grows into visible logit differences, so the figures that show the
adapters' arithmetic are those of an F32 model (`--type f32`).

Printed per setting (the request's `lora`: none, A at 1.0, A at 0.5, B alone, A and B together):
for each prompt whether pyllama's greedy tokens equal llama-server's, at which step they first
differ and pyllama's top-2 logprob margin there. Then two requests with different adapters sent
at once (one batch in pyllama; llama-server batches only requests with the same adapters together)
against the same two sent at once with one adapter: whether each got its own adapter's tokens.
Then the decode rate of `--prompts` concurrent requests without and with adapter A, per server,
and the ratio. Without --peers only pyllama's figures are printed. Exits 1 when pyllama's tokens
differ from llama-server's at a clear margin (`--tie`) at any setting.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from peers import Peers  # noqa: E402
from pipeline_cells import LlamaServer  # noqa: E402
from server_util import ServerProcess  # noqa: E402
from slot_restore import post  # noqa: E402

VOCAB = os.path.join(os.path.dirname(HERE), "tests", "data", "vocab", "ggml-vocab-llama-spm.gguf")
SETTINGS: dict[str, Optional[list]] = {
    "default (A 1.0, B 1.0)": None,
    "none": [{"id": 0, "scale": 0.0}],  # (an empty list asks for the defaults, as in llama-server)
    "A 1.0": [{"id": 0, "scale": 1.0}],
    "A 0.5": [{"id": 0, "scale": 0.5}],
    "B 1.0": [{"id": 1, "scale": 1.0}],
    "A 0.5 + B 0.75": [{"id": 0, "scale": 0.5}, {"id": 1, "scale": 0.75}],
}


def make_files(preset: str, wtype: str, rank: int, a_type: str) -> tuple[str, str, str]:
    from pyllama.models.make import make_model  # noqa: PLC0415
    from pyllama.models.make_lora import make_lora  # noqa: PLC0415
    folder = os.path.join(HERE, "out", "models")
    os.makedirs(folder, exist_ok=True)
    model = os.path.join(folder, f"lora-base-{preset}-{wtype}.gguf")
    if not os.path.exists(model):
        make_model(preset, model, vocab=VOCAB, wtype=wtype, seed=11, tied=False)  # (B adapts output.weight)
    a = make_lora(model, os.path.join(folder, f"lora-A-{preset}-{wtype}-r{rank}-{a_type}.gguf"), rank=rank,
                  alpha=2.0 * rank, seed=1, wtype=a_type, gain=0.25)
    b = make_lora(model, os.path.join(folder, f"lora-B-{preset}-{wtype}.gguf"), rank=4, alpha=0.0,
                  targets=["attn_q", "attn_v", "output"], seed=2, wtype="f32", gain=0.5)
    return model, a, b


def prompts(n: int) -> list[list[int]]:
    return [[1] + [(97 * i + 31 * j) % 30000 + 500 for j in range(12 + 5 * i)] for i in range(n)]


def greedy(url: str, prompt: list[int], n: int, lora: Optional[list], margins: Optional[list] = None) -> list[int]:
    """The greedy tokens; with `margins`, each step's top-1 minus top-2 logprob appended to it."""
    body: dict[str, Any] = {"prompt": prompt, "n_predict": n, "top_k": 1, "ignore_eos": True, "return_tokens": True,
                            "cache_prompt": False}
    if margins is not None:
        body["n_probs"] = 2
    if lora is not None:
        body["lora"] = lora
    doc = post(url, "/completion", body)
    if margins is not None:
        for step in doc.get("completion_probabilities", []):
            top = sorted((c["logprob"] for c in step["top_logprobs"]), reverse=True)
            margins.append(top[0] - top[1] if len(top) > 1 else float("inf"))
    return doc["tokens"]


def greedy_or_none(url: str, prompt: list[int], n: int, lora: Optional[list],
                   margins: Optional[list] = None) -> Optional[list[int]]:
    """greedy, or None where the server fails the request (llama-server answers some outputs of
    random-weight models with HTTP 500 "does not match the expected Content-only format")."""
    try:
        return greedy(url, prompt, n, lora, margins)
    except RuntimeError as exc:
        print(f"    ({url}: {str(exc)[:120]})")
        return None


def together(url: str, jobs: list[tuple[list[int], Optional[list]]], n: int) -> tuple[list[list[int]], float]:
    """The jobs' greedy tokens sent at once, and the generated tokens per second overall."""
    out: list[Any] = [None] * len(jobs)

    def run(i: int) -> None:
        try:
            out[i] = greedy(url, jobs[i][0], n, jobs[i][1])
        except Exception as exc:  # noqa: BLE001 - reported with the figures
            out[i] = exc
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    return out, sum(len(o) for o in out if isinstance(o, list)) / dt


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", help="llama.cpp's folder (bin/llama-server)")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--type", dest="wtype", default="q8_0")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--adapter-type", default="f16", choices=["f16", "f32"],
                    help="adapter A's tensor type (default f16, as llama.cpp's converter writes)")
    ap.add_argument("--tie", type=float, default=1e-2,
                    help="a first difference where pyllama's top two logprobs are closer than this (nats) is a near "
                         "tie, not a disagreement (default 0.01)")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    model, a, b = make_files(args.preset, args.wtype, args.rank, args.adapter_type)
    # F32 caches and no flash attention: the arithmetic pyllama's kernels share with ggml's
    # (compare_logits.py); llama-server's default flash attention rounds differently
    common = ["-c", str(1024 * args.prompts), "-np", str(args.prompts), "-t", str(args.threads), "--lora", a,
              "--lora", b, "-ctk", "f32", "-ctv", "f32", "-fa", "off"]
    peers = Peers.find(args.peers)
    servers: dict[str, Any] = {}
    ps = ServerProcess(model, *common, "--cache-ram", "0")
    try:
        ps.wait_ready(300)
        servers["pyllama"] = ps.url
        if peers is not None:
            servers["llama-server"] = LlamaServer(peers, model, [*common, "--no-warmup", "--cache-ram", "0",
                                                                 "--no-repack"], 300)
        urls = {name: (srv if isinstance(srv, str) else srv.url) for name, srv in servers.items()}
        ps_ = prompts(args.prompts)
        report: dict[str, Any] = {"model": os.path.basename(model), "adapters": [os.path.basename(a), os.path.basename(b)],
                                  "settings": {}}
        ok = True
        print(f"model {os.path.basename(model)}, adapters A {os.path.basename(a)} ({args.adapter_type}, rank {args.rank}), "
              f"B {os.path.basename(b)} (f32, rank 4); {args.tokens} greedy tokens per prompt")
        alone: dict[str, list[list[int]]] = {}
        for label, lora in SETTINGS.items():
            margins: list[list[float]] = [[] for _ in ps_]
            toks = {name: [greedy_or_none(url, p, args.tokens, lora, margins[i] if name == "pyllama" else None)
                           for i, p in enumerate(ps_)] for name, url in urls.items()}
            alone[label] = toks["pyllama"]
            line = f"  {label:24s}"
            if "llama-server" in toks:
                rows = [(x, y, mg) for x, y, mg in zip(toks["pyllama"], toks["llama-server"], margins)
                        if x is not None and y is not None]
                diffs = [first_difference(x, y) for x, y, _ in rows]
                # a difference where pyllama's top two were within --tie nats is a near tie (the
                # kernels' rounding decides it), not a disagreement
                at = [mg[d] if 0 <= d < len(mg) else None for d, (_, _, mg) in zip(diffs, rows)]
                clear = [d for d, m in zip(diffs, at) if d >= 0 and (m is None or m >= args.tie)]
                same = sum(d == -1 for d in diffs)
                ok &= not clear
                line += f" equal to llama-server: {same}/{len(diffs)} prompts" + (
                    "" if same == len(diffs) else
                    f"; first differences at steps {diffs}, pyllama's top-2 margin there "
                    f"{[None if m is None else round(m, 5) for m in at]} nats: "
                    f"{len(clear)} at a clear margin (>= {args.tie})") + (
                    f" ({len(ps_) - len(rows)} failed by a server)" if len(rows) < len(ps_) else "")
                report["settings"][label] = {"equal": same, "prompts": len(diffs), "first_difference": diffs,
                                             "margin_at_difference": at, "clear_differences": len(clear),
                                             "failed": len(ps_) - len(rows)}
            print(line)
        # two requests at once with other adapters, against the same two with one adapter each
        # time: the batches have the same shape, so a request that got its mate's adapter (or
        # none) would differ
        p0, p1 = ps_[0], ps_[1 % len(ps_)]
        for name, url in urls.items():
            try:
                mixed, _ = together(url, [(p0, SETTINGS["A 1.0"]), (p1, SETTINGS["B 1.0"])], args.tokens)
                both_a, _ = together(url, [(p0, SETTINGS["A 1.0"]), (p1, SETTINGS["A 1.0"])], args.tokens)
                both_b, _ = together(url, [(p0, SETTINGS["B 1.0"]), (p1, SETTINGS["B 1.0"])], args.tokens)
            except RuntimeError as exc:
                print(f"  {name}: mixed adapters at once: not compared ({str(exc)[:100]})")
                continue
            own = mixed[0] == both_a[0] and mixed[1] == both_b[1]
            print(f"  {name}: two requests with other adapters at once each get their own adapter's tokens: {own}")
            report[f"{name}_mixed_batch_ok"] = own
        print("decode rate, tokens/s of all prompts at once (best of 3 legs, interleaved):")
        rates: dict[tuple[str, str], list[float]] = {}
        for _ in range(3):
            for name, url in urls.items():
                for label in ("none", "A 1.0"):
                    _, rate = together(url, [(p, SETTINGS[label]) for p in ps_], args.tokens)
                    rates.setdefault((name, label), []).append(rate)
        for name in urls:
            off, on = max(rates[(name, "none")]), max(rates[(name, "A 1.0")])
            print(f"  {name:12s} no adapter {off:7.1f}  adapter A {on:7.1f}  with / without {on / off:.2f}x")
            report[f"{name}_rate"] = {"none": rates[(name, "none")], "A": rates[(name, "A 1.0")]}
        if "llama-server" in urls:
            for label in ("none", "A 1.0"):
                r = max(rates[("pyllama", label)]) / max(rates[("llama-server", label)])
                print(f"  pyllama / llama-server, {label}: {r:.2f}x")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(report, fh, indent=1)
        return 0 if ok else 1
    finally:
        ps.stop()
        for srv in servers.values():
            if not isinstance(srv, str):
                srv.stop()


if __name__ == "__main__":
    sys.exit(main())
