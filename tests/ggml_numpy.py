"""A float64 numpy reading of the ggml ops pyllama's lowering emits, over the test peer's buffers
(tests/ggml_fake_peer.py), so the suite runs lowered graphs end to end without llama.cpp. It is a
reading of ggml, not ggml: bench/ggml_ops_check.py and bench/ggml_split_check.py compare the
lowering with llama.cpp's own rpc-server.

Tensors are strided views of the buffers' bytes (ggml's ne/nb, reversed into numpy's order);
quantized weights are dequantized with the gguf package when a product or a row lookup reads them.
"""
from __future__ import annotations

import struct

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from pyllama.backend.ggml.protocol import GOp
from reference_forward import rope

_NP = {0: np.float32, 1: np.float16, 26: np.int32, 27: np.int64}


class _Mem:
    def __init__(self, buffers: dict[int, tuple[int, bytearray]]):
        self.buffers = buffers

    def locate(self, addr: int) -> tuple[bytearray, int]:
        for base, mem in self.buffers.values():
            if base <= addr < base + len(mem):
                return mem, addr - base
        raise ValueError(f"address {addr:#x} is in no buffer")

    def view(self, r) -> np.ndarray:
        """The tensor as a writable strided array [ne3, ne2, ne1, ne0] (non-quantized types)."""
        t = int(r["type"])
        if t not in _NP:
            raise ValueError(f"type {t} has no element view")
        mem, off = self.locate(int(r["data"]))
        ne = [int(x) for x in r["ne"]][::-1]
        nb = [int(x) for x in r["nb"]][::-1]
        return np.ndarray(ne, dtype=_NP[t], buffer=mem, offset=off, strides=nb)

    def values(self, r) -> np.ndarray:
        """float64 values [ne3, ne2, ne1, ne0], dequantized for block types (rows at any strides)."""
        t = int(r["type"])
        if t in _NP:
            return self.view(r).astype(np.float64)
        return dequantize(self._rows(r), T(t)).astype(np.float64).reshape([int(x) for x in r["ne"]][::-1])

    def _rows(self, r) -> np.ndarray:
        """The raw bytes of every row of a block-type tensor, [rows, row bytes] in row order."""
        mem, off = self.locate(int(r["data"]))
        ne = [int(x) for x in r["ne"]]
        nb = [int(x) for x in r["nb"]]
        block, size = GGML_QUANT_SIZES[T(int(r["type"]))]
        i3, i2, i1 = np.meshgrid(np.arange(ne[3]), np.arange(ne[2]), np.arange(ne[1]), indexing="ij")
        starts = (off + i1 * nb[1] + i2 * nb[2] + i3 * nb[3]).reshape(-1)
        return np.frombuffer(mem, np.uint8)[starts[:, None] + np.arange(ne[0] // block * size)[None, :]]

    def write_rows(self, r, rows: np.ndarray, idx: np.ndarray) -> None:
        """Rows idx of a 2-D block-type tensor set to `rows` (float), quantized as ggml stores them."""
        mem, off = self.locate(int(r["data"]))
        raw = quantize(rows.astype(np.float32), T(int(r["type"])))
        nb1 = int(r["nb"][1])
        at = off + idx.astype(np.int64)[:, None] * nb1 + np.arange(raw.shape[1])[None, :]
        np.frombuffer(mem, np.uint8)[at.reshape(-1)] = raw.reshape(-1)


def _params(r, fmt: str) -> tuple:
    return struct.unpack_from(fmt, r["op_params"].tobytes())


def _rope(x: np.ndarray, pos: np.ndarray, freqs, r) -> np.ndarray:
    """ggml's ROPE (its parameters in r's op_params) on x [1, n, H, hd]."""
    p = _params(r, "<5i6f")
    n_dims, mode, base, fscale, attn_factor = p[1], p[2], p[5], p[6], p[8]
    inv = base ** (-np.arange(0, n_dims, 2, dtype=np.float64) / n_dims) * fscale
    if freqs is not None:
        inv = inv / freqs.reshape(-1)[: n_dims // 2]
    return rope(x[0], base, n_dims, bool(mode & 2), inv, attn_factor, pos.reshape(-1))[None]


def _repeat(b: np.ndarray, shape) -> np.ndarray:
    return np.tile(b, [s // bs for s, bs in zip(shape, b.shape)])


def run_graph(buffers, nodes, tensors) -> None:
    mem = _Mem(buffers)
    by_id = {int(r["id"]): r for r in tensors}
    for nid in nodes:
        r = by_id[int(nid)]
        op = GOp(int(r["op"]))
        src = [by_id[int(i)] if int(i) else None for i in r["src"]]
        if op in (GOp.NONE, GOp.VIEW, GOp.RESHAPE, GOp.PERMUTE, GOp.TRANSPOSE):
            continue
        dst = mem.view(r) if int(r["type"]) in _NP else None
        if op == GOp.GET_ROWS:     # row b[i12, i11, i10] of a's matrix (i12, i11)
            table = mem.values(src[0])
            ids = mem.view(src[1])[0]
            j2, j1 = np.meshgrid(np.arange(ids.shape[0]), np.arange(ids.shape[1]), indexing="ij")
            out = table[j2[..., None] % table.shape[0], j1[..., None] % table.shape[1], ids]
        elif op == GOp.RMS_NORM:
            x = mem.values(src[0])
            (eps,) = _params(r, "<f")
            out = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
        elif op in (GOp.ADD, GOp.MUL, GOp.DIV):
            a, b = mem.values(src[0]), mem.values(src[1])
            b = _repeat(b, a.shape)
            out = a + b if op == GOp.ADD else a * b if op == GOp.MUL else a / b
        elif op == GOp.ADD_ID:                      # a[t, k] + b[ids[t, k]] (each chosen expert's bias)
            a, b = mem.values(src[0]), mem.values(src[1])[0, 0]      # [1, n, K, m], [E, m]
            ids = mem.view(src[2])[0, 0]                             # [n, K]
            out = a + b[ids][None]
        elif op == GOp.MUL_MAT_ID:                  # b's row (t, k % rows) against matrix ids[t, k]
            w, b = mem.values(src[0])[0], mem.values(src[1])[0]      # [E, m, k], [n, rows, k]
            ids = mem.view(src[2])[0, 0]                             # [n, K]
            n, K = ids.shape
            rows = b[np.arange(n)[:, None], np.arange(K)[None, :] % b.shape[1]]   # [n, K, k]
            out = np.einsum("tkc,tkmc->tkm", rows, w[ids])[None]
        elif op == GOp.ARGSORT:
            (order,) = _params(r, "<i")
            x = mem.values(src[0])
            out = np.argsort(-x if order == 1 else x, axis=-1, kind="stable")
        elif op == GOp.SUM_ROWS:
            out = mem.values(src[0]).sum(-1, keepdims=True)
        elif op == GOp.CLAMP:
            lo, hi = _params(r, "<ff")
            out = np.clip(mem.values(src[0]), lo, hi)
        elif op == GOp.SCALE:
            s, bias = _params(r, "<ff")
            out = mem.values(src[0]) * s + bias
        elif op == GOp.MUL_MAT:
            a, b = mem.values(src[0]), mem.values(src[1])       # [A3, A2, m, k], [B3, B2, n, k]
            r2, r3 = b.shape[1] // a.shape[1], b.shape[0] // a.shape[0]
            a = np.repeat(np.repeat(a, r2, axis=1), r3, axis=0)
            out = b @ np.swapaxes(a, -1, -2)                    # [B3, B2, n, m]
        elif op == GOp.GLU:
            glu, swapped = _params(r, "<ii")
            a = mem.values(src[0])
            h = a.shape[-1] // 2
            if src[1] is not None:                  # two tensors: act(a) * b
                x, g = a, mem.values(src[1])
            else:
                x, g = (a[..., h:], a[..., :h]) if swapped else (a[..., :h], a[..., h:])
            if glu == 3:                            # swiglu_oai: alpha and limit in op_params 2, 3
                alpha, limit = _params(r, "<iiff")[2:]
                x = np.minimum(x, limit)
                act, g = x / (1 + np.exp(-alpha * x)), np.clip(g, -limit, limit) + 1
            elif glu == 2:
                act = x / (1 + np.exp(-x))
            elif glu == 1:
                act = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
            else:
                raise ValueError(f"GLU op {glu}")
            out = act * g
        elif op == GOp.ROPE:
            freqs = mem.values(src[2]) if src[2] is not None else None
            out = _rope(mem.values(src[0]), mem.view(src[1]), freqs, r)
        elif op == GOp.SET_ROWS:
            vals = mem.values(src[0])                   # [1, B2, rows, ne0]
            if vals.shape[1] > 1:                       # rows of b[i2] into a[i2] at c[i2] (DeepSeek's groups)
                idx = mem.view(src[1])[0, 0]            # [B2, rows]
                for i2 in range(vals.shape[1]):
                    dst[0, i2, idx[i2]] = vals[0, i2].astype(dst.dtype)
                continue
            rows = vals[0, 0]
            idx = mem.view(src[1]).reshape(-1)
            if dst is None:       # a BF16 or Q8_0 cache
                mem.write_rows(r, rows, idx)
            else:
                dst[0, 0, idx] = rows.astype(dst.dtype)
            continue
        elif op == GOp.FILL:
            (c,) = _params(r, "<f")
            out = np.full(dst.shape, c)
        elif op in (GOp.CONT, GOp.CPY, GOp.DUP):
            vals = mem.values(src[0])
            out = vals.reshape(dst.shape) if op != GOp.CPY else vals
        elif op == GOp.CONCAT:
            (dim,) = _params(r, "<i")
            out = np.concatenate([mem.values(src[0]), mem.values(src[1])], axis=3 - dim)
        elif op == GOp.SOFT_MAX:
            scale, max_bias = _params(r, "<ff")
            x = mem.values(src[0]) * scale
            if src[1] is not None:
                m = mem.values(src[1])[:, :, : x.shape[2], :]
                x = x + m
            sink = mem.values(src[2]).reshape(1, -1, 1, 1) if src[2] is not None else None  # per head (ne2)
            top = x.max(-1, keepdims=True) if sink is None else np.maximum(x.max(-1, keepdims=True), sink)
            e = np.exp(x - top)
            out = e / (e.sum(-1, keepdims=True) + (0 if sink is None else np.exp(sink - top)))
        elif op == GOp.FLASH_ATTN_EXT:
            scale, max_bias, softcap = _params(r, "<fff")
            q, k, v = (mem.values(s) for s in src[:3])          # [1, H, n, D], [1, Hkv, n_kv, D]
            H, Hkv = q.shape[1], k.shape[1]
            k = np.repeat(k, H // Hkv, axis=1)
            v = np.repeat(v, H // Hkv, axis=1)
            s = q @ np.swapaxes(k, -1, -2) * scale                # [1, H, n, n_kv]
            if softcap:
                s = softcap * np.tanh(s / softcap)
            if src[3] is not None:
                s = s + mem.values(src[3])[:, :, : s.shape[2], :]
            sink = mem.values(src[4]).reshape(1, -1, 1, 1) if src[4] is not None else None  # per head
            top = s.max(-1, keepdims=True) if sink is None else np.maximum(s.max(-1, keepdims=True), sink)
            p = np.exp(s - top)
            p /= p.sum(-1, keepdims=True) + (0 if sink is None else np.exp(sink - top))
            out = np.swapaxes(p @ v, 1, 2)                      # [1, n, H, D]
        elif op == GOp.UNARY:
            (u,) = _params(r, "<i")
            if u not in (4, 7, 10):
                raise ValueError(f"unary op {u}")
            x = mem.values(src[0])
            out = np.tanh(x) if u == 4 else 1 / (1 + np.exp(-x)) if u == 7 else x / (1 + np.exp(-x))
        elif op == GOp.ARGMAX:
            out = mem.values(src[0]).argmax(-1).reshape(dst.shape)
        else:
            raise ValueError(f"op {op.name} is not read here")
        if dst is None:           # a block-type result (a CPY into BF16 or Q8_0): quantized row by row
            vals = np.asarray(out).reshape(-1, int(r["ne"][0]))
            mem.write_rows(r, vals, np.arange(vals.shape[0]))
            continue
        dst[...] = np.asarray(out).reshape(dst.shape).astype(dst.dtype)
