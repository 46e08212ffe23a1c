"""A uniform importance matrix for llama-quantize, so that it makes the types it refuses without one.

    python bench/flat_imatrix.py MODEL.gguf OUT.dat

llama-quantize makes IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ1_S and IQ1_M only with an importance
matrix (`--imatrix`). The random-weight test models have no calibration text that would give one a
meaning, so this writes llama.cpp's legacy imatrix format with every column of every matrix equally
important (1.0): the files come out as llama-quantize quantizes with flat importance, which is
what the kernel benchmarks need (bench/bench_decode.py --model on the result).
"""
from __future__ import annotations

import struct
import sys

import numpy as np
from gguf import GGUFReader


def write_flat_imatrix(model: str, out: str) -> int:
    """Writes the file; returns the number of entries (one per matrix)."""
    entries = []
    for t in GGUFReader(model).tensors:
        shape = [int(d) for d in t.shape]            # ggml's ne order: ne[0] is the row length
        if len(shape) < 2 or not t.name.endswith(".weight"):
            continue
        n_expert = shape[2] if len(shape) == 3 else 1
        entries.append((t.name, np.ones(shape[0] * n_expert, np.float32)))
    with open(out, "wb") as fh:
        fh.write(struct.pack("<i", len(entries)))
        for name, sums in entries:
            raw = name.encode()
            fh.write(struct.pack("<i", len(raw)) + raw + struct.pack("<ii", 1, sums.size))
            fh.write(sums.tobytes())
        fh.write(struct.pack("<i", 1))               # chunks seen, then an empty dataset name
        fh.write(struct.pack("<i", 0))
    return len(entries)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.splitlines()[2].strip())
    print(f"{write_flat_imatrix(sys.argv[1], sys.argv[2])} entries written to {sys.argv[2]}")
