"""LoRA adapters side by side: pyllama's greedy tokens against llama-server's `--lora` on the same
model and adapter files, and what the adapters cost each of them.

    python bench/bench_lora.py [--peers DIR] [--preset small] [--type q8_0] [--rank 16] [--tokens 48]
                               [--prompts 4] [-t 2] [--json OUT]

A model (`--preset`, `--type`, llama's SPM vocabulary) and two adapters are made with
pyllama.models.make and make_lora under bench/out/models: A adapts every block matrix (rank
`--rank`, F16 as llama.cpp's converter writes them by default), B the attention q and v and the
output matrix (F32). Both servers load both (`--lora A --lora B`), one slot each per prompt.

Printed per setting (the request's `lora`: none, A at 1.0, A at 0.5, B alone, A and B together):
for each prompt whether pyllama's greedy tokens equal llama-server's, and at which step they first
differ. Then two requests with different adapters sent at once (one batch in pyllama; llama-server
batches only requests with the same adapters together) and whether each got what it gets alone.
Then the decode rate of `--prompts` concurrent requests without and with adapter A, per server,
and the ratio. Without --peers only pyllama's figures are printed. Exits 1 when pyllama's tokens
differ from llama-server's at any setting.
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


def make_files(preset: str, wtype: str, rank: int) -> tuple[str, str, str]:
    from pyllama.models.make import make_model  # noqa: PLC0415
    from pyllama.models.make_lora import make_lora  # noqa: PLC0415
    folder = os.path.join(HERE, "out", "models")
    os.makedirs(folder, exist_ok=True)
    model = os.path.join(folder, f"lora-base-{preset}-{wtype}.gguf")
    if not os.path.exists(model):
        make_model(preset, model, vocab=VOCAB, wtype=wtype, seed=11)
    a = make_lora(model, os.path.join(folder, f"lora-A-{preset}-{wtype}-r{rank}.gguf"), rank=rank, alpha=2.0 * rank,
                  seed=1, wtype="f16", gain=0.25)
    b = make_lora(model, os.path.join(folder, f"lora-B-{preset}-{wtype}.gguf"), rank=4, alpha=0.0,
                  targets=["attn_q", "attn_v", "output"], seed=2, wtype="f32", gain=0.5)
    return model, a, b


def prompts(n: int) -> list[list[int]]:
    return [[1] + [(97 * i + 31 * j) % 30000 + 500 for j in range(12 + 5 * i)] for i in range(n)]


def greedy(url: str, prompt: list[int], n: int, lora: Optional[list]) -> list[int]:
    body: dict[str, Any] = {"prompt": prompt, "n_predict": n, "top_k": 1, "ignore_eos": True, "return_tokens": True,
                            "cache_prompt": False}
    if lora is not None:
        body["lora"] = lora
    return post(url, "/completion", body)["tokens"]


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
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    model, a, b = make_files(args.preset, args.wtype, args.rank)
    common = ["-c", str(1024 * args.prompts), "-np", str(args.prompts), "-t", str(args.threads), "--lora", a,
              "--lora", b]
    peers = Peers.find(args.peers)
    servers: dict[str, Any] = {}
    ps = ServerProcess(model, *common, "--cache-ram", "0")
    try:
        ps.wait_ready(300)
        servers["pyllama"] = ps.url
        if peers is not None:
            servers["llama-server"] = LlamaServer(peers, model, [*common, "--no-warmup", "--cache-ram", "0"], 300)
        urls = {name: (srv if isinstance(srv, str) else srv.url) for name, srv in servers.items()}
        ps_ = prompts(args.prompts)
        report: dict[str, Any] = {"model": os.path.basename(model), "adapters": [os.path.basename(a), os.path.basename(b)],
                                  "settings": {}}
        ok = True
        print(f"model {os.path.basename(model)}, adapters A {os.path.basename(a)} (f16, rank {args.rank}), "
              f"B {os.path.basename(b)} (f32, rank 4); {args.tokens} greedy tokens per prompt")
        alone: dict[str, list[list[int]]] = {}
        for label, lora in SETTINGS.items():
            toks = {name: [greedy(url, p, args.tokens, lora) for p in ps_] for name, url in urls.items()}
            alone[label] = toks["pyllama"]
            line = f"  {label:24s}"
            if "llama-server" in toks:
                diffs = [first_difference(x, y) for x, y in zip(toks["pyllama"], toks["llama-server"])]
                same = sum(d == -1 for d in diffs)
                ok &= same == len(diffs)
                line += f" equal to llama-server: {same}/{len(diffs)} prompts" + (
                    "" if same == len(diffs) else f" (first differences at steps {diffs})")
                report["settings"][label] = {"equal": same, "prompts": len(diffs), "first_difference": diffs}
            print(line)
        for name, url in urls.items():
            jobs = [(ps_[0], SETTINGS["A 1.0"]), (ps_[1 % len(ps_)], SETTINGS["B 1.0"])]
            got, _ = together(url, jobs, args.tokens)
            want = [alone["A 1.0"][0], alone["B 1.0"][1 % len(ps_)]] if name == "pyllama" else \
                [greedy(url, ps_[0], args.tokens, SETTINGS["A 1.0"]), greedy(url, ps_[1 % len(ps_)], args.tokens,
                                                                            SETTINGS["B 1.0"])]
            print(f"  {name}: two requests with other adapters at once each get their own tokens: {got == want}")
            report[f"{name}_mixed_batch_ok"] = got == want
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
