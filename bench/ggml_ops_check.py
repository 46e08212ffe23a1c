"""pyllama's ggml graph builder against llama.cpp's own rpc-server (needs --peers).

    python bench/ggml_ops_check.py --peers DIR [--rope norm|neox] [--tokens 3]

Builds, with pyllama.backend.ggml.graph.GraphBuilder, one transformer layer the way llama.cpp's
model builders call ggml (embedding rows, RMS norm times its weight, the q/k/v products, RoPE on
positions, the K and V rows written into an F16 cache with SET_ROWS, attention over the cache's
views with a mask, both as MUL_MAT + SOFT_MAX + MUL_MAT and as FLASH_ATTN_EXT, SwiGLU on a fused
gate|up product, the residual adds, the output product and ARGMAX), sends it to `ggml-rpc-server`
and compares every result it reads back with a float64 numpy reference of the same layer (the
cache rounded to F16 as the peer stores it). Prints the largest relative difference per result;
exits 1 when any is above its tolerance.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from peers import Peers  # noqa: E402
from pipeline_cells import GgmlRpcPeer  # noqa: E402
from pyllama.backend.ggml import graph as G  # noqa: E402
from pyllama.backend.ggml.connection import GGMLConnection  # noqa: E402


def rope_ref(x: np.ndarray, pos: np.ndarray, base: float, neox: bool) -> np.ndarray:
    """x [n, H, hd] rotated by position: pairs (2i, 2i+1) (norm) or (i, i + hd/2) (neox)."""
    n, h, hd = x.shape
    inv = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = pos[:, None].astype(np.float64) * inv[None, :]          # [n, hd/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.astype(np.float64).copy()
    if neox:
        a, b = x[..., : hd // 2], x[..., hd // 2:]
        out[..., : hd // 2] = a * cos - b * sin
        out[..., hd // 2:] = a * sin + b * cos
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default=os.environ.get("PYLLAMA_PEERS"))
    ap.add_argument("--rope", choices=("norm", "neox"), default="norm")
    ap.add_argument("--tokens", type=int, default=3)
    a = ap.parse_args()
    peers = Peers.find(a.peers) if a.peers else None
    if peers is None or not os.path.isfile(peers.path("ggml-rpc-server")):
        raise SystemExit("--peers DIR with bin/ggml-rpc-server is needed")
    d, H, Hkv, hd, ff, vocab, cells, n = 64, 4, 2, 16, 48, 32, 8, a.tokens
    eps, base, neox = 1e-5, 10000.0, a.rope == "neox"
    rng = np.random.default_rng(0)
    w = {k: (rng.standard_normal(s) * 0.3).astype(np.float32) for k, s in {
        "embd": (vocab, d), "norm": (d,), "q": (H * hd, d), "k": (Hkv * hd, d), "v": (Hkv * hd, d),
        "o": (d, H * hd), "gu": (2 * ff, d), "down": (d, ff), "out": (vocab, d)}.items()}
    ids = rng.integers(0, vocab, n).astype(np.int32)
    pos = np.arange(2, 2 + n, dtype=np.int32)            # cells 0, 1 hold earlier tokens
    kv_idx = pos.astype(np.int64)
    k_old = (rng.standard_normal((2, Hkv * hd)) * 0.5).astype(np.float16)
    v_old = (rng.standard_normal((2, Hkv * hd)) * 0.5).astype(np.float16)
    n_kv = 2 + n
    mask = np.full((64, n_kv), -np.inf, np.float32)      # [rows padded, n_kv]: causal over the cells
    for i in range(n):
        mask[i, : 3 + i] = 0.0
    mask16 = mask.astype(np.float16)

    peer = GgmlRpcPeer(peers, 1)
    bad = []
    try:
        conn = GGMLConnection(peer.endpoint)
        align = conn.alignment(0)
        ptr, size = conn.alloc_buffer(0, 8 << 20)
        base_addr = conn.buffer_base(ptr)
        used = [0]
        g = G.GraphBuilder()

        def put(arr: np.ndarray, gtype: int, ne: list[int], name: str) -> G.GT:
            t = g.leaf(gtype, ne, ptr, base_addr + used[0], name)
            used[0] += (t.nbytes + align - 1) // align * align
            conn.set_tensor(_rec(t), 0, np.ascontiguousarray(arr).tobytes())
            return t

        t_embd = put(w["embd"], G.F32, [d, vocab], "token_embd")
        t_ids = put(ids, G.I32, [n], "ids")
        t_norm = put(w["norm"], G.F32, [d], "norm")
        t_wq, t_wk, t_wv = (put(w[k], G.F32, [d, w[k].shape[0]], k) for k in ("q", "k", "v"))
        t_wo = put(w["o"], G.F32, [H * hd, d], "o")
        t_gu = put(w["gu"], G.F32, [d, 2 * ff], "gate_up")
        t_down = put(w["down"], G.F32, [ff, d], "down")
        t_out = put(w["out"], G.F32, [d, vocab], "output")
        t_pos = put(pos, G.I32, [n], "pos")
        t_idx = put(kv_idx, G.I64, [n], "kv_idx")
        cache_k = np.zeros((cells, Hkv * hd), np.float16)
        cache_v = np.zeros((cells, Hkv * hd), np.float16)
        cache_k[:2], cache_v[:2] = k_old, v_old
        t_kc = put(cache_k, G.F16, [Hkv * hd, cells], "cache_k")
        t_vc = put(cache_v, G.F16, [Hkv * hd, cells], "cache_v")
        t_mask = put(mask, G.F32, [n_kv, 64], "mask")
        t_mask16 = put(mask16, G.F16, [n_kv, 64], "mask16")
        scratch_at = used[0]

        mode = G.ROPE_NEOX if neox else G.ROPE_NORM
        x = g.get_rows(t_embd, t_ids, "inp")
        xn = g.mul(g.rms_norm(x, eps), t_norm, "attn_norm")
        q = g.rope_ext(g.reshape(g.mul_mat(t_wq, xn), [hd, H, n]), t_pos, None, hd, mode, 4096, base, 1.0, 0.0,
                       1.0, 32.0, 1.0, "q")
        k = g.rope_ext(g.reshape(g.mul_mat(t_wk, xn), [hd, Hkv, n]), t_pos, None, hd, mode, 4096, base, 1.0, 0.0,
                       1.0, 32.0, 1.0, "k")
        v = g.mul_mat(t_wv, xn, "v")
        k_set = g.set_rows(t_kc, g.reshape(k, [Hkv * hd, n]), t_idx, "k_set")
        v_set = g.set_rows(t_vc, v, t_idx, "v_set")
        f16 = 2
        K = g.view(k_set, [hd, Hkv, n_kv], [f16 * hd, f16 * Hkv * hd], 0, "K")
        V = g.view(v_set, [hd, Hkv, n_kv], [f16 * hd, f16 * Hkv * hd], 0, "V")
        qp = g.permute(q, 0, 2, 1, 3)
        kp = g.permute(K, 0, 2, 1, 3)
        scale = 1.0 / np.sqrt(hd)
        kq = g.soft_max_ext(g.mul_mat(kp, qp), g.view(t_mask, [n_kv, n], [4 * n_kv], 0), scale, 0.0, "kq")
        vt = g.cont(g.permute(V, 1, 2, 0, 3), "v_t")
        kqv = g.mul_mat(vt, kq, "kqv")
        attn = g.reshape(g.cont(g.permute(kqv, 0, 2, 1, 3)), [H * hd, n], "attn")
        fa = g.flash_attn_ext(qp, kp, g.permute(V, 0, 2, 1, 3), g.view(t_mask16, [n_kv, 64], [2 * n_kv], 0),
                              scale, 0.0, 0.0, True, "fa")
        fa2 = g.reshape(fa, [H * hd, n], "fa_flat")
        h = g.add(g.mul_mat(t_wo, attn), x, "h")
        ffn = g.mul_mat(t_down, g.glu_split(g.mul_mat(t_gu, g.mul(g.rms_norm(h, eps), t_norm)), G.GLU_SWIGLU), "ffn")
        out = g.add(ffn, h, "l_out")
        logits = g.mul_mat(t_out, out, "logits")
        top = g.argmax(logits, "top")
        for t in (q, k, kq, attn, fa2, out, logits, top):
            g.output(t)
        nodes, recs, used_scratch = g.finish(ptr, base_addr + scratch_at, size - scratch_at, align)
        conn.graph_compute(0, nodes, recs)

        def read(t: G.GT, dtype, shape) -> np.ndarray:
            return np.frombuffer(conn.get_tensor(_rec(t), 0, t.nbytes), dtype=dtype).reshape(shape)

        # numpy reference (float64; the cache rounded to F16)
        x_r = w["embd"][ids].astype(np.float64)
        def rms(v_):
            return v_ / np.sqrt((v_ ** 2).mean(-1, keepdims=True) + eps) * w["norm"]
        xn_r = rms(x_r)
        q_r = rope_ref((xn_r @ w["q"].T).reshape(n, H, hd), pos, base, neox)
        k_r = rope_ref((xn_r @ w["k"].T).reshape(n, Hkv, hd), pos, base, neox)
        v_r = xn_r @ w["v"].T
        ck = cache_k.astype(np.float64).copy()
        cv = cache_v.astype(np.float64).copy()
        ck[2:2 + n] = k_r.reshape(n, -1).astype(np.float16)
        cv[2:2 + n] = v_r.astype(np.float16)
        Kc, Vc = ck[:n_kv].reshape(n_kv, Hkv, hd), cv[:n_kv].reshape(n_kv, Hkv, hd)
        att = np.zeros((n, H, hd))
        probs = np.zeros((H, n, n_kv))
        for hh in range(H):
            kvh = hh // (H // Hkv)
            s = q_r[:, hh, :] @ Kc[:, kvh, :].T * scale + mask[:n]
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            probs[hh] = p
            att[:, hh, :] = p @ Vc[:, kvh, :]
        att = att.reshape(n, H * hd)
        h_r = att @ w["o"].T + x_r
        gu = rms(h_r) @ w["gu"].T
        gate, up = gu[:, :ff], gu[:, ff:]
        ffn_r = (gate / (1 + np.exp(-gate)) * up) @ w["down"].T
        out_r = ffn_r + h_r
        logits_r = out_r @ w["out"].T

        def cmp(name, got, ref, tol):
            err = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-9))
            ok = err <= tol
            print(f"{'ok  ' if ok else 'FAIL'} {name}: max |diff| / max |ref| = {err:.2e} (tolerance {tol:g})")
            if not ok:
                bad.append(name)

        cmp(f"RoPE ({a.rope}) on q", read(q, np.float32, (n, H, hd)), q_r, 1e-5)
        cmp(f"RoPE ({a.rope}) on k", read(k, np.float32, (n, Hkv, hd)), k_r, 1e-5)
        cmp("SET_ROWS into the F16 cache", np.frombuffer(conn.get_tensor(_rec(t_kc), 0, t_kc.nbytes), np.float16)
            .reshape(cells, -1)[:n_kv].astype(np.float64), ck[:n_kv], 1e-3)
        cmp("softmax(K Q * scale + mask)", read(kq, np.float32, (H, n, n_kv)), probs, 2e-3)
        cmp("attention (MUL_MAT, SOFT_MAX, MUL_MAT)", read(attn, np.float32, (n, H * hd)), att, 3e-3)
        cmp("attention (FLASH_ATTN_EXT)", read(fa2, np.float32, (n, H * hd)), att, 3e-3)
        cmp("layer output (SwiGLU FFN, residuals)", read(out, np.float32, (n, d)), out_r, 3e-3)
        cmp("logits", read(logits, np.float32, (n, vocab)), logits_r, 3e-3)
        top_got = read(top, np.int32, (n,))
        ok = np.array_equal(top_got, logits_r.argmax(-1))
        print(f"{'ok  ' if ok else 'FAIL'} ARGMAX: {top_got.tolist()} (reference {logits_r.argmax(-1).tolist()})")
        if not ok:
            bad.append("argmax")
        print(f"{len(nodes)} nodes, {len(recs)} tensors, {used_scratch} scratch bytes")
        conn.close()
    finally:
        peer.stop()
    print(f"{len(bad)} check(s) failed" if bad else "every check passed")
    return 1 if bad else 0


def _rec(t: G.GT):
    from pyllama.backend.ggml import protocol as P  # noqa: PLC0415
    return P.tensor_record(t.id, t.type, t.ne, buffer=t.buffer, data=t.data, nb=t.nb, name=t.name)


if __name__ == "__main__":
    sys.exit(main())
