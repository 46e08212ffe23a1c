"""python -m pyllama.models.make_lora: a deterministic random LoRA adapter for a GGUF model, in the
layout llama.cpp's converter writes (general.type "adapter", adapter.type "lora",
adapter.lora.alpha; `<tensor>.lora_a` [r, k] and `<tensor>.lora_b` [m, r] per adapted matrix), so
that llama.cpp's `--lora` and pyllama's read the same file.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import numpy as np
from gguf import GGMLQuantizationType

from .gguf_file import GGUFFile
from .make import gguf_file_writer, written_or_reported

# the matrices PEFT adapters usually target, by their GGUF names within a block
DEFAULT_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
TYPES = {"f32": (np.float32, GGMLQuantizationType.F32), "f16": (np.float16, GGMLQuantizationType.F16)}


def make_lora(base: str, out: str, rank: int = 8, alpha: float = 16.0, targets: Sequence[str] = DEFAULT_TARGETS,
              seed: int = 0, wtype: str = "f32", gain: float = 1.0, task_name: str = "",
              prompt_prefix: str = "") -> str:
    """Writes an adapter for the model file `base` to `out` and returns `out`. Each target names a
    block matrix (attn_q, ffn_up, ...) adapted in every block, or `output`. The product's size
    relative to the weights grows with `gain` (the adapter's effect on the outputs)."""
    if rank < 1:
        raise ValueError(f"rank must be at least 1, not {rank}")
    if wtype not in TYPES:
        raise ValueError(f"type must be one of {', '.join(TYPES)}, not {wtype!r}")
    f = GGUFFile(base)
    arch = f.get("general.architecture")
    if not arch:
        raise ValueError(f"{base}: no general.architecture")
    names = []
    for target in targets:
        found = sorted((n for n in f.tensors if n == f"{target}.weight"
                        or (n.startswith("blk.") and n.split(".", 2)[2] == f"{target}.weight")),
                       key=_tensor_order)
        if not found:
            raise ValueError(f"{base}: no tensor {target}.weight (in any block)")
        names.extend(found)
    rng = np.random.default_rng(seed)
    dtype, qtype = TYPES[wtype]
    with gguf_file_writer(out, arch) as writer:
        writer.add_string("general.type", "adapter")
        writer.add_string("adapter.type", "lora")
        writer.add_float32("adapter.lora.alpha", float(alpha))
        if task_name:
            writer.add_string("adapter.lora.task_name", task_name)
        if prompt_prefix:
            writer.add_string("adapter.lora.prompt_prefix", prompt_prefix)
        for name in names:
            m, k = f.tensors[name].shape
            a = rng.standard_normal((rank, k)).astype(np.float32) / np.float32(np.sqrt(k))
            b = rng.standard_normal((m, rank)).astype(np.float32) * np.float32(gain / np.sqrt(rank))
            writer.add_tensor(f"{name}.lora_a", a.astype(dtype), raw_dtype=qtype)
            writer.add_tensor(f"{name}.lora_b", b.astype(dtype), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    return out


def _tensor_order(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return (int(parts[1]), name) if parts[0] == "blk" else (1 << 30, name)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pyllama.models.make_lora",
                                 description="Write a deterministic random LoRA adapter for a GGUF model.")
    ap.add_argument("--base", required=True, help="the model the adapter is for")
    ap.add_argument("--out", required=True, help="output GGUF path")
    ap.add_argument("--rank", type=int, default=8, help="rank r of every pair (default 8)")
    ap.add_argument("--alpha", type=float, default=16.0, help="adapter.lora.alpha; the scale is alpha / r (default 16)")
    ap.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                    help=f"comma-separated matrices adapted in every block, or output (default {','.join(DEFAULT_TARGETS)})")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--type", dest="wtype", default="f32", choices=list(TYPES), help="tensor type (default f32)")
    ap.add_argument("--gain", type=float, default=1.0, help="size of lora_b's values (default 1)")
    ap.add_argument("--task-name", default="", help="adapter.lora.task_name")
    ap.add_argument("--prompt-prefix", default="", help="adapter.lora.prompt_prefix")
    args = ap.parse_args(argv)
    path = written_or_reported(ap.prog, args.out, lambda: make_lora(
        args.base, args.out, args.rank, args.alpha, [t for t in args.targets.split(",") if t], args.seed, args.wtype,
        args.gain, args.task_name, args.prompt_prefix))
    if path is None:
        return 1
    print(f"wrote {path}: rank {args.rank}, alpha {args.alpha:g}, {os.path.getsize(path) / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
