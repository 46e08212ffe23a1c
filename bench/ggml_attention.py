"""pyllama's attention over F32 caches and its RoPE against ggml's own CPU graph, bit for bit (needs --peers).

    python bench/ggml_attention.py --peers DIR [--cells 1,13,40,200] [--head-dim 64] [--rows 1,2,5]

llama.cpp's non-flash attention graph is built through ctypes on its own libraries (ggml-base
and the CPU variant this machine loads, as bench/ggml_kernels.py): KQ = mul_mat(K, permuted Q),
soft_max_ext(KQ, causal mask, scale) over a KV view padded to 256 cells, KQV = mul_mat(V^T, KQ),
for a step of `rows` tokens that write the last cells; and rope_ext (normal and NeoX) of one
vector per position. pyllama's `ops.attention` computes the same step (no RoPE, F32 caches).
Printed per case: outputs that are not bit-identical (llama.cpp takes llamafile's tinyBLAS for
KQV in a step of several rows and ggml_vec_dot_f32 in a step of one row; pyllama follows it).
Exits 1 when any output differs.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from ggml_kernels import Ggml, cpu_variant  # noqa: E402
from peers import Peers  # noqa: E402
from pyllama._fast import ops  # noqa: E402

F32, I32 = 0, 26
P = ctypes.c_void_p


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class Graph:
    """A ggml context with typed wrappers for the few ops used here."""

    def __init__(self, peers: Peers, cpu: ctypes.CDLL):
        base = [n for n in os.listdir(peers.bin) if n.startswith("libggml-base.so.") and n.count(".") >= 4]
        self.b = ctypes.CDLL(os.path.join(peers.bin, base[0]), mode=ctypes.RTLD_GLOBAL)
        self.cpu = cpu
        b = self.b
        b.ggml_init.restype = P
        b.ggml_init.argtypes = [_InitParams]
        for name, args in (("ggml_new_tensor_1d", [P, ctypes.c_int, ctypes.c_int64]),
                           ("ggml_new_tensor_2d", [P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
                           ("ggml_new_tensor_3d", [P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]),
                           ("ggml_permute", [P, P, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]),
                           ("ggml_mul_mat", [P, P, P]),
                           ("ggml_soft_max_ext", [P, P, P, ctypes.c_float, ctypes.c_float]),
                           ("ggml_rope_ext", [P, P, P, P, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                                              ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_float,
                                              ctypes.c_float]),
                           ("ggml_new_graph", [P]), ("ggml_get_data", [P])):
            getattr(b, name).restype = P
            getattr(b, name).argtypes = args
        b.ggml_build_forward_expand.argtypes = [P, P]
        b.ggml_free.argtypes = [P]
        cpu.ggml_graph_compute_with_ctx.argtypes = [P, P, ctypes.c_int]
        self.ctx = b.ggml_init(_InitParams(256 << 20, None, False))

    def tensor(self, arr: np.ndarray, typ: int = F32) -> int:
        """A new tensor holding arr (numpy's axes reversed: ggml's ne0 is the last axis)."""
        shape = arr.shape[::-1]
        t = getattr(self.b, f"ggml_new_tensor_{len(shape)}d")(self.ctx, typ, *shape)
        ctypes.memmove(self.b.ggml_get_data(t), np.ascontiguousarray(arr).ctypes.data, arr.nbytes)
        return t

    def compute(self, t: int, shape: tuple, n_threads: int) -> np.ndarray:
        g = self.b.ggml_new_graph(self.ctx)
        self.b.ggml_build_forward_expand(g, t)
        self.cpu.ggml_graph_compute_with_ctx(self.ctx, g, n_threads)
        out = np.empty(shape, np.float32)
        ctypes.memmove(out.ctypes.data, self.b.ggml_get_data(t), out.nbytes)
        return out

    def close(self) -> None:
        self.b.ggml_free(self.ctx)


def ggml_attention(gr: Graph, q, K, V, n_cells: int, rows: int, scale: float, n_threads: int) -> np.ndarray:
    """llama.cpp's graph for a step of `rows` tokens; q [rows, H, hd], K [n_cells, Hkv, hd], V
    [n_cells, Hkv, hv] (the step's tokens in the last cells). Returns [rows, H, hv]."""
    rows_, H, hd = q.shape
    Hkv, hv = K.shape[1], V.shape[2]
    n_kv = -(-n_cells // 256) * 256
    Kp = np.zeros((Hkv, n_kv, hd), np.float32)
    Kp[:, :n_cells] = K.transpose(1, 0, 2)
    Vt = np.zeros((Hkv, hv, n_kv), np.float32)   # v_trans: each dimension's cells in a row
    Vt[:, :, :n_cells] = V.transpose(1, 2, 0)
    mask = np.full((rows, n_kv), -np.inf, np.float32)
    for t in range(rows):
        mask[t, :n_cells - rows + t + 1] = 0
    kt = gr.tensor(Kp)
    qt = gr.b.ggml_permute(gr.ctx, gr.tensor(q), 0, 2, 1, 3)   # [hd, rows, H], not contiguous
    kq = gr.b.ggml_mul_mat(gr.ctx, kt, qt)
    kq = gr.b.ggml_soft_max_ext(gr.ctx, kq, gr.tensor(mask), scale, 0.0)
    kqv = gr.b.ggml_mul_mat(gr.ctx, gr.tensor(Vt), kq)        # [hv, rows, H]
    return gr.compute(kqv, (H, rows, hv), n_threads).transpose(1, 0, 2)


def pyllama_attention(q, K, V, n_cells: int, rows: int, scale: float) -> np.ndarray:
    _, H, hd = q.shape
    Hkv = K.shape[1]
    qkv = np.concatenate([q.reshape(rows, -1), K[n_cells - rows:].reshape(rows, -1),
                          V[n_cells - rows:].reshape(rows, -1)], axis=1).astype(np.float32)
    kc = K.reshape(n_cells, -1).copy()
    vc = V.reshape(n_cells, -1).copy()
    idx = np.arange(n_cells - rows, n_cells, dtype=np.int32)
    cells = np.arange(n_cells, dtype=np.int32)
    ranges = np.array([[0, n_cells - rows + t + 1] for t in range(rows)], np.int32)
    out = np.zeros((rows, H * hd), np.float32)
    empty = np.zeros(0, np.float32)
    ops.attention(qkv, kc, vc, idx, idx, cells, ranges, empty, empty, out, H, Hkv, hd, 0, 0, 10000.0, 1.0, 1e-6,
                  scale, 1)
    return out.reshape(rows, H, hd)


def rope_case(gr: Graph, mode: int, hd: int, positions: np.ndarray, base: float, freq_scale: float) -> int:
    """Elements of rotated vectors (one per position, random) that differ from ggml's rope_ext."""
    rng = np.random.default_rng(mode)
    n = len(positions)
    x = rng.standard_normal((n, 1, hd)).astype(np.float32)
    r = gr.b.ggml_rope_ext(gr.ctx, gr.tensor(x), gr.tensor(positions.astype(np.int32), I32), None, hd, mode, 0,
                           base, freq_scale, 0.0, 1.0, 0.0, 0.0)
    want = gr.compute(r, (n, 1, hd), 1).reshape(n, hd)
    qkv = np.concatenate([np.zeros((n, hd), np.float32), x.reshape(n, hd), np.zeros((n, hd), np.float32)], axis=1)
    kc = np.zeros((n, hd), np.float32)
    vc = np.zeros((n, hd), np.float32)
    idx = np.arange(n, dtype=np.int32)
    ranges = np.stack([idx, np.ones(n, np.int32)], axis=1).astype(np.int32)
    out = np.zeros((n, hd), np.float32)
    empty = np.zeros(0, np.float32)
    ops.attention(qkv, kc, vc, positions.astype(np.int32), idx, idx, ranges, empty, empty, out, 1, 1, hd, hd, mode,
                  base, freq_scale, 1e-6, 1.0, 1)
    return int((kc.view(np.uint32) != want.view(np.uint32)).sum())


def mla_case(gr: Graph, n_cells: int, rows: int, H: int, lora: int, rope: int, n_threads: int,
             rng: np.random.Generator) -> tuple[int, int, float]:
    """DeepSeek's latent attention core (llama.cpp's MLA path without flash attention): one KV head
    whose rows are lora + rope values, the values the rows' first lora; ggml's KQ, soft_max_ext and
    KQV (V made contiguous from the transposed view) against ops.mla_attend. (differing, total, max |diff|)."""
    width = lora + rope
    q = (2 * rng.standard_normal((rows, H, width))).astype(np.float32)
    K = rng.standard_normal((n_cells, 1, width)).astype(np.float32)
    scale = float(np.float32(1 / np.sqrt(192)))
    want = ggml_attention(gr, q, K, K[:, :, :lora].copy(), n_cells, rows, scale, n_threads)  # [rows, H, lora]
    cells = np.arange(n_cells, dtype=np.int32)
    ranges = np.array([[0, n_cells - rows + t + 1] for t in range(rows)], np.int32)
    got = np.zeros((rows, H * lora), np.float32)
    if not ops.mla_attend(q.reshape(rows, -1), K.reshape(n_cells, width).copy(), cells, ranges, H, width, lora,
                          scale, got):
        raise SystemExit("ops.mla_attend took no ggml steps for these widths")
    got = got.reshape(rows, H, lora)
    return int((got.view(np.uint32) != want.view(np.uint32)).sum()), got.size, float(np.abs(got - want).max())


def rope_yarn_case(gr: Graph, n_dims: int, positions: np.ndarray, base: float, freq_scale: float, ext: float,
                   attn_factor: float, n_ctx_orig: int) -> int:
    """Elements of rotated rows [n, 3 heads, n_dims] that differ from ggml's rope_ext in the normal
    mode with these YaRN parameters (beta_fast 32, beta_slow 1), against ops.rope_rows."""
    rng = np.random.default_rng(7)
    n = len(positions)
    x = rng.standard_normal((n, 3, n_dims)).astype(np.float32)
    gr.b.ggml_rope_ext.argtypes = [P, P, P, P, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                                   ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_float]
    r = gr.b.ggml_rope_ext(gr.ctx, gr.tensor(x), gr.tensor(positions.astype(np.int32), I32), None, n_dims, 0,
                           n_ctx_orig, base, freq_scale, ext, attn_factor, 32.0, 1.0)
    want = gr.compute(r, x.shape, 1)
    got = x.copy()
    ops.rope_rows(got, positions.astype(np.int32), base, freq_scale, ext, attn_factor, 32.0, 1.0, n_ctx_orig)
    return int((got.view(np.uint32) != want.view(np.uint32)).sum())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", required=True, help="llama.cpp's folder (bin/libggml-*.so)")
    ap.add_argument("--variant", help="libggml-cpu variant (default: the one this CPU loads)")
    ap.add_argument("--cells", default="1,13,16,17,40,200")
    ap.add_argument("--rows", default="1,2,5")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--heads", default="4,2", help="query heads, kv heads")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mla", default="12,256,32",
                    help="latent attention too: query heads, latent width, rope width ('' for none)")
    args = ap.parse_args()
    if not ops.GGML_F32_ATTENTION:
        print("ggml_attention: this build keeps the general attention kernel (not an AVX-512 build)", file=sys.stderr)
        return 2
    peers = Peers.find(args.peers)
    if peers is None:
        print(f"ggml_attention: no llama.cpp programs under {args.peers}/bin", file=sys.stderr)
        return 2
    gr = Graph(peers, Ggml(peers, args.variant or cpu_variant()).lib)
    H, Hkv = (int(v) for v in args.heads.split(","))
    hd = args.head_dim
    bad = False
    rng = np.random.default_rng(1)
    try:
        for n_cells in (int(v) for v in args.cells.split(",")):
            for rows in (int(v) for v in args.rows.split(",")):
                if rows > n_cells:
                    continue
                q = (2 * rng.standard_normal((rows, H, hd))).astype(np.float32)
                K = rng.standard_normal((n_cells, Hkv, hd)).astype(np.float32)
                V = rng.standard_normal((n_cells, Hkv, hd)).astype(np.float32)
                scale = float(np.float32(1 / np.sqrt(hd)))
                want = ggml_attention(gr, q, K, V, n_cells, rows, scale, args.threads)
                got = pyllama_attention(q, K, V, n_cells, rows, scale)
                differ = int((got.view(np.uint32) != want.view(np.uint32)).sum())
                bad |= differ > 0
                print(f"attention cells {n_cells:4d} rows {rows}: outputs differing {differ} of {got.size}"
                      f"  max |diff| {np.abs(got - want).max():.2e}", flush=True)
        if args.mla:
            mh, lora, rope = (int(v) for v in args.mla.split(","))
            for n_cells in (int(v) for v in args.cells.split(",")):
                for rows in (int(v) for v in args.rows.split(",")):
                    if rows <= n_cells:
                        d, total, worst = mla_case(gr, n_cells, rows, mh, lora, rope, args.threads, rng)
                        bad |= d > 0
                        print(f"latent attention cells {n_cells:4d} rows {rows}: outputs differing {d} of {total}"
                              f"  max |diff| {worst:.2e}", flush=True)
            for freq_scale, ext, attn_factor, n_orig in ((1.0, 0.0, 1.0, 0), (0.025, 1.0, 0.71, 4096),
                                                         (0.25, 1.0, 1.0, 4096)):
                d = rope_yarn_case(gr, rope, np.array([0, 1, 5, 100, 4095, 70000]), 10000.0, freq_scale, ext,
                                   attn_factor, n_orig)
                bad |= d > 0
                print(f"rope_rows freq_scale {freq_scale} ext_factor {ext} attn_factor {attn_factor}: "
                      f"elements differing {d}", flush=True)
        for mode, name in ((0, "normal"), (2, "neox")):
            for freq_scale in (1.0, 0.25):
                d = rope_case(gr, mode, hd, np.array([0, 1, 5, 100, 4095, 70000]), 10000.0, freq_scale)
                bad |= d > 0
                print(f"rope {name} freq_scale {freq_scale}: elements differing {d}", flush=True)
    finally:
        gr.close()
        peers.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
