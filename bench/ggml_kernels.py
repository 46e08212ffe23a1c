"""pyllama's quantized products against ggml's own CPU kernels, bit for bit (needs --peers).

    python bench/ggml_kernels.py --peers DIR [--types q4_0,q6_k,...] [--rows 1,3,9] [--k 768,2048]

llama.cpp's CPU library (`bin/libggml-cpu-VARIANT.so`, the variant this machine would load:
zen4 / icelake / haswell / x64, or --variant) exports `ggml_get_type_traits_cpu`, whose
`from_float` and `vec_dot` are the activation quantizer and the dot product its matrix products
run. For each weight type, random weights and activations are multiplied by both: ggml's
from_float + vec_dot per (row, column), pyllama's mul_mat_q (file layout) and, where the type is
repacked, mul_mat_q_x8. F16 and BF16 weights are also multiplied by ggml's own mul_mat in a graph
(what llama.cpp runs: vec_dot for one activation row, llamafile's tinyBLAS for several). Printed per
type: activation bytes that differ, and outputs that are not bit-identical for each layout (0
everywhere is the goal). Then the KV cache types (--kv-types): the bytes ggml's `from_float`
writes for rows of k or v (what its CPU backend stores into a cache of the type) against
pyllama's cache store, rows whose bytes differ. Exits 1 when any differs.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as T

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench_qmatmul import random_weights  # noqa: E402
from peers import Peers  # noqa: E402
from pyllama._fast import ops, qmatmul  # noqa: E402

TYPES = "f16,bf16,q4_0,q4_1,q5_0,q5_1,q8_0,q2_k,q3_k,q4_k,q5_k,q6_k"
# also accepted by --types: iq4_nl, iq4_xs, mxfp4, the grid IQ types and tq1_0, tq2_0
IQ_GRID_TYPES = "iq2_xxs,iq2_xs,iq2_s,iq3_xxs,iq3_s,iq1_s,iq1_m"
KV_TYPES = "f16,bf16,q8_0,q4_0,q4_1,q5_0,q5_1,iq4_nl"
_FF = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_VD = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                       ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class _Traits(ctypes.Structure):
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


def cpu_variant() -> str:
    flags = open("/proc/cpuinfo").read()
    if "avx512_bf16" in flags and "avx512_vnni" in flags:
        return "zen4"
    if "avx512_vnni" in flags and "avx512vbmi" in flags:
        return "icelake"
    return "haswell" if "avx2" in flags else "x64"


class Ggml:
    def __init__(self, peers: Peers, variant: str):
        base = [n for n in os.listdir(peers.bin) if n.startswith("libggml-base.so.") and n.count(".") >= 4]
        if base:
            ctypes.CDLL(os.path.join(peers.bin, base[0]), mode=ctypes.RTLD_GLOBAL)
        self.lib = ctypes.CDLL(os.path.join(peers.bin, f"libggml-cpu-{variant}.so"))
        self.lib.ggml_cpu_init()
        self.lib.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_Traits)

    def traits(self, qtype: int) -> _Traits:
        return self.lib.ggml_get_type_traits_cpu(qtype).contents

    def quantize(self, vec_type: int, x: np.ndarray) -> np.ndarray:
        out = np.zeros((x.shape[0], qmatmul.row_bytes(vec_type, x.shape[1])), np.uint8)
        f = _FF(self.traits(vec_type).from_float)
        for i in range(x.shape[0]):
            f(x[i].ctypes.data, out[i].ctypes.data, x.shape[1])
        return out

    def matmul(self, qtype: int, x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        tr = self.traits(qtype)
        xq = self.quantize(tr.vec_dot_type, x)
        vd = _VD(tr.vec_dot)
        out = np.zeros((x.shape[0], w.shape[0]), np.float32)
        s = ctypes.c_float()
        for i in range(x.shape[0]):
            for j in range(w.shape[0]):
                vd(x.shape[1], ctypes.byref(s), 0, w[j].ctypes.data, 0, xq[i].ctypes.data, 0, 1)
                out[i, j] = s.value
        return out, xq


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", required=True, help="llama.cpp's folder (bin/libggml-cpu-*.so)")
    ap.add_argument("--variant", help="libggml-cpu variant (default: the one this CPU loads)")
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--rows", default="1,3,9")
    ap.add_argument("--k", default="768,2048")
    ap.add_argument("--m", type=int, default=16, help="weight rows (a multiple of 8)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kv-types", default=KV_TYPES, help="KV cache types whose stored rows are compared")
    args = ap.parse_args()
    peers = Peers.find(args.peers)
    if peers is None:
        print(f"ggml_kernels: no llama.cpp programs under {args.peers}/bin", file=sys.stderr)
        return 2
    ggml = Ggml(peers, args.variant or cpu_variant())
    from ggml_attention import Graph  # noqa: E402 (it imports this module)
    graph = Graph(peers, ggml.lib)
    rng = np.random.default_rng(args.seed)
    bad = False
    for name in [t for t in args.types.split(",") if t]:
        qtype = int(T[name.upper()])
        cells = []
        for k in (int(v) for v in args.k.split(",")):
            w = random_weights(T(qtype), args.m, k, rng)
            for n in (int(v) for v in args.rows.split(",")):
                x = (rng.standard_normal((n, k)) * rng.uniform(0.05, 5)).astype(np.float32)
                x[:, ::7] = np.round(x[:, ::7] * 4) / 4   # values whose scaled products land on halves
                ref, xq = ggml.matmul(qtype, x, w)
                if qtype in (T.F16, T.BF16):  # the graph's product: tinyBLAS for several rows
                    wt = graph.tensor(w.view(np.uint16).reshape(args.m, k), qtype)
                    ref = graph.compute(graph.b.ggml_mul_mat(graph.ctx, wt, graph.tensor(x)), ref.shape, 2)
                ours_xq = qmatmul.quantize_rows(x, qmatmul.vec_dot_type(qtype))
                out = np.zeros_like(ref)
                qmatmul.mul_mat_q(x, w, qtype, out)
                cell = {"xq": int((ours_xq != xq).sum()), "layout": int((out.view(np.uint32) != ref.view(np.uint32)).sum())}
                if qtype in qmatmul.x8_types():
                    o8 = np.zeros_like(ref)
                    qmatmul.mul_mat_q_x8(x, qmatmul.repack_x8(w, qtype, k), qtype, o8)
                    cell["x8"] = int((o8.view(np.uint32) != ref.view(np.uint32)).sum())
                cells.append(cell)
        total = {key: sum(c.get(key, 0) for c in cells) for key in ("xq", "layout", "x8")}
        bad |= any(total.values())
        x8 = f" repacked {total['x8']}" if qtype in qmatmul.x8_types() else ""
        print(f"{name:6s} activation bytes differing {total['xq']}  outputs differing: file layout {total['layout']}{x8}"
              f"  (of {sum(int(n) for n in args.rows.split(',')) * args.m * len(args.k.split(','))})", flush=True)
    for name in [t for t in args.kv_types.split(",") if t]:
        qtype = int(T[name.upper()])
        differing = rows = 0
        for scale in (0.01, 1.0, 30.0):
            x = (rng.standard_normal((64, 256)) * scale).astype(np.float32)
            x[:8, :32] = 0.0  # an all-zero block
            x[8:16, ::5] = np.round(x[8:16, ::5] * 2) / 2
            ours = np.zeros((x.shape[0], ops.kv_row_nbytes(qtype, x.shape[1])), np.uint8)
            ops.kv_store(qtype, x, ours)
            ref = ggml.quantize(qtype, x)
            same_values = np.zeros_like(x), np.zeros_like(x)
            ops.kv_load_rows(qtype, ours, same_values[0])
            ops.kv_load_rows(qtype, ref, same_values[1])
            # an all-zero IQ4_NL block keeps whatever levels ggml's scratch held: its value (0) counts
            diff = np.any(ours != ref, axis=1) & np.any(same_values[0] != same_values[1], axis=1)
            differing += int(diff.sum())
            rows += x.shape[0]
        bad |= differing > 0
        print(f"KV cache {name:6s} stored rows differing {differing} (of {rows})", flush=True)
    graph.close()
    peers.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
