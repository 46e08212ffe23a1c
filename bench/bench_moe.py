"""Decode speed of a Mixture-of-Experts model against a dense model with the same active parameters.

    python bench/bench_moe.py [--preset small] [--types q8_0,q4_k_m] [--batches 1,32] [--steps 32]
        [--threads 1] [--legs 2]

The pair, made by pyllama.models.make (cached under bench/out/models): `qwen3moe` at the preset
(small: 32 experts of 256 rows, 3 used per token) and the dense `qwen3` at the same preset (an FFN
of 768 rows = 3 x 256), same width, layers, attention and vocabulary, so a decode step multiplies
by the same number of weights in both but for the MoE router (n_embd x n_expert per layer). Each
cell (model, type, batch) is B sequences decoding one token each per step, greedy, after a 32-token
prompt each; legs alternate the two models so both see the same machine state. Prints decode
tokens/s of both, MoE / dense, and the parameters (total and active per token).

The MoE kernel reads only the chosen experts, grouped across the batch: at batch 1 a step reads
3 experts' rows per layer (as the dense model reads its FFN); at batch 32 the tokens choose most of
the 32 experts, so the MoE step reads several times the dense step's weights.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from pyllama.runtime.context import Batch  # noqa: E402
from pyllama.runtime.engine import Engine  # noqa: E402
from pyllama.models.make import make_model  # noqa: E402


def model_path(preset: str, arch: str, wtype: str) -> str:
    out = os.path.join(HERE, "out", "models")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{preset}-{arch}-{wtype}.gguf")
    if not os.path.exists(path):
        make_model(preset, path, wtype=wtype, arch=arch)
    return path


def active_params(engine: Engine) -> tuple[float, float]:
    """(total, active per token) parameters in millions; the embedding row counts as one row."""
    hp = engine.model.hparams
    total = engine.model.n_params()
    if not hp.is_moe:
        return total / 1e6, (total - (hp.n_vocab - 1) * hp.n_embd * (0 if engine.model.tied_output else 1)) / 1e6
    per_expert = 3 * hp.n_embd * hp.n_ff_exp
    inactive = hp.n_layer * (hp.n_expert - hp.n_expert_used) * per_expert
    return total / 1e6, (total - inactive - (hp.n_vocab - 1) * hp.n_embd * (0 if engine.model.tied_output else 1)) / 1e6


def decode_speed(engine: Engine, batch: int, steps: int) -> float:
    """Decode tokens/s of `batch` sequences, one token each per step (greedy by argmax)."""
    hp = engine.model.hparams
    ctx = engine.new_context((32 + steps + 8) * batch, batch, n_batch=max(32 * batch, 64))
    rng = np.random.default_rng(0)
    seqs = list(range(batch))
    prompts = [rng.integers(300, hp.n_vocab, 32).tolist() for _ in seqs]
    out = ctx.decode(Batch.concat([Batch.for_sequence(p, 0, s) for p, s in zip(prompts, seqs)]))
    pos = np.full(batch, 32, dtype=np.int32)
    ids = out.logits.argmax(axis=1).astype(np.int32)
    out = ctx.decode(Batch(ids, pos, seqs, np.ones(batch, bool)))  # warm-up step
    pos += 1
    t0 = time.perf_counter()
    for _ in range(steps):
        ids = out.logits.argmax(axis=1).astype(np.int32)
        out = ctx.decode(Batch(ids, pos, seqs, np.ones(batch, bool)))
        pos += 1
    return batch * steps / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--types", default="q8_0,q4_k_m")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--legs", type=int, default=2)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"preset {args.preset}, {args.threads} thread(s), {args.steps} steps, {args.legs} legs; decode tok/s "
          "(mean of the legs, range in brackets)")
    print("| type | model | params M (active) | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in batches) + " |")
    for wtype in args.types.split(","):
        paths = {arch: model_path(args.preset, arch, wtype) for arch in ("qwen3moe", "qwen3")}
        engines = {arch: Engine(p, n_threads=args.threads) for arch, p in paths.items()}
        try:
            speeds: dict[tuple[str, int], list[float]] = {}
            for _ in range(args.legs):
                for b in batches:
                    for arch, engine in engines.items():
                        speeds.setdefault((arch, b), []).append(decode_speed(engine, b, args.steps))
            for arch, engine in engines.items():
                total, active = active_params(engine)
                cells = [f"{np.mean(speeds[arch, b]):.1f} [{min(speeds[arch, b]):.1f}-{max(speeds[arch, b]):.1f}]"
                         for b in batches]
                print(f"| {wtype} | {arch} | {total:.1f} ({active:.1f}) | " + " | ".join(cells) + " |")
            ratios = [np.mean(speeds["qwen3", b]) / np.mean(speeds["qwen3moe", b]) for b in batches]
            print(f"| {wtype} | dense / MoE tok/s (target at batch 1: <= 1.5x) | | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
        finally:
            for engine in engines.values():
                engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
