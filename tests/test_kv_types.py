"""KV cache types (-ctk / -ctv: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl; f16 by default).

The stored bytes are checked bit for bit against conversions written here in numpy from ggml's
definitions (np.float16 for f16, ggml's fp32 -> bf16 rounding, ggml's x86 quantize_row_q8_0, the
gguf package's reference quantizers for q4_0 .. q5_1, quantize_row_iq4_nl_ref for iq4_nl), the
ATTENTION op against a float64 attention over those stored values, and whole runs of the tiny
model for identical greedy tokens local, split over an rpc server and in two pipeline groups.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import quants

from pyllama.backend.cpu import CPUBackend
from pyllama.runtime.cache_types import CACHE_TYPES
from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
from pyllama.util.errors import PyllamaError
from pyllama.ir.tensor import DType, Graph, Op, Tensor, node
from server_util import ServerProcess

F32, F16, BF16, Q8_0, I32 = DType.F32, DType.F16, DType.BF16, DType.Q8_0, DType.I32
Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL = DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q5_1, DType.IQ4_NL
BLOCK_TYPES = [Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL]  # beside Q8_0: 32 values a block
TYPES = [F32, F16, BF16, Q8_0] + BLOCK_TYPES
QK8_0 = 32
IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


# --- reference conversions, from ggml's definitions ----------------------------------------------
def ref_store(dtype: DType, x: np.ndarray) -> np.ndarray:
    """float32 rows [n, w] -> their cache rows as bytes, uint8 [n, row bytes]."""
    x = np.ascontiguousarray(x, np.float32)
    n, w = x.shape
    if dtype == F32:
        return x.view(np.uint8).copy()
    if dtype == F16:  # IEEE round to nearest even (finite values; NaN payloads differ by library)
        with np.errstate(over="ignore"):  # beyond 65520: inf, as intended
            return x.astype(np.float16).view(np.uint8).reshape(n, -1)
    if dtype == BF16:  # ggml_compute_fp32_to_bf16: NaN forced quiet, else round to nearest even
        u = x.view(np.uint32).astype(np.uint64)
        bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
        bits = np.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 64, bits)
        return bits.astype(np.uint16).view(np.uint8).reshape(n, -1)
    assert w % QK8_0 == 0
    if dtype == IQ4_NL:
        return ref_store_iq4_nl(x)
    if dtype != Q8_0:
        with np.errstate(over="ignore", invalid="ignore"):  # scales beyond f16's range: inf, as ggml
            return quants.quantize(x, dtype)
    # ggml's x86 quantize_row_q8_0 (its CPU backend's from_float): per block of 32, d = amax / 127,
    # id = 127 / amax (0 when amax is 0), q = x * id rounded half to even, d stored as fp16
    b = x.reshape(n, w // QK8_0, QK8_0)
    amax = np.max(np.abs(b), axis=-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint((b * inv[..., None]).astype(np.float32)).astype(np.int8)
    out = np.empty((n, w // QK8_0, 34), np.uint8)
    out[..., :2] = d.astype(np.float16)[..., None].view(np.uint8)
    out[..., 2:] = q.view(np.uint8)
    return out.reshape(n, -1)


def nearest_iq4nl_level(al: np.float32) -> int:
    """The index of the IQ4_NL value nearest `al`; halfway: the upper one (ggml's best_index_int8)."""
    if al <= IQ4NL_VALUES[0]:
        return 0
    if al >= IQ4NL_VALUES[-1]:
        return 15
    mu = int(np.searchsorted(IQ4NL_VALUES, al, side="right"))  # values[mu - 1] <= al < values[mu]
    return mu - 1 if al - IQ4NL_VALUES[mu - 1] < IQ4NL_VALUES[mu] - al else mu


def ref_store_iq4_nl(x: np.ndarray) -> np.ndarray:
    """quantize_row_iq4_nl_ref: per block of 32, levels nearest x / (max / -127) (max: the value of
    largest magnitude; ties to the upper level), then d = sum w q x / sum w q^2 with w = x^2, stored
    as fp16; a block below 1e-15 stores d = 0 (and, here, level 0: ggml leaves its scratch)."""
    n, w = x.shape
    out = np.zeros((n, w // QK8_0, 18), np.uint8)
    for r in range(n):
        for ib in range(w // QK8_0):
            xb = x[r, ib * QK8_0:(ib + 1) * QK8_0]
            L = np.zeros(QK8_0, np.uint8)
            d = np.float32(0)
            j = int(np.argmax(np.abs(xb)))  # the first of equal magnitudes, as ggml's strict >
            if abs(xb[j]) >= np.float32(1e-15):
                inv = np.float32(1) / (xb[j] / np.float32(-127))
                sumqx = sumq2 = np.float32(0)
                for i in range(QK8_0):
                    al = np.float32(inv * xb[i])
                    L[i] = nearest_iq4nl_level(al)
                    q, wt = IQ4NL_VALUES[L[i]], np.float32(xb[i] * xb[i])
                    sumqx = np.float32(sumqx + np.float32(np.float32(wt * q) * xb[i]))
                    sumq2 = np.float32(sumq2 + np.float32(np.float32(wt * q) * q))
                d = np.float32(sumqx / sumq2) if sumq2 > 0 else np.float32(0)
            out[r, ib, :2] = np.array([d], np.float16).view(np.uint8)
            out[r, ib, 2:] = L[:16] | (L[16:] << 4)
    return out.reshape(n, -1)


def ref_load(dtype: DType, rows: np.ndarray, w: int) -> np.ndarray:
    """Cache rows (bytes) -> their values as float64 [n, w]."""
    rows = np.ascontiguousarray(rows).view(np.uint8)
    n = rows.shape[0]
    if dtype == F32:
        return rows.view(np.float32).astype(np.float64)
    if dtype == F16:
        return rows.view(np.float16).astype(np.float64)
    if dtype == BF16:
        return (rows.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype != Q8_0:  # the block types' values as ggml dequantizes them (float32 products)
        with np.errstate(over="ignore", invalid="ignore"):
            return quants.dequantize(rows, dtype).astype(np.float64).reshape(n, w)
    blocks = rows.reshape(n, w // QK8_0, 34)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)  # [n, nb, 1]
    q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
    return (d * q).astype(np.float64).reshape(n, w)  # d * q in float32, as ggml dequantizes


def row_bytes(dtype: DType, w: int) -> int:
    return {F32: 4 * w, F16: 2 * w, BF16: 2 * w, Q8_0: w // QK8_0 * 34, Q4_0: w // QK8_0 * 18, Q4_1: w // QK8_0 * 20,
            Q5_0: w // QK8_0 * 22, Q5_1: w // QK8_0 * 24, IQ4_NL: w // QK8_0 * 18}[dtype]


def edge_values(rng: np.random.Generator, n: int, w: int) -> np.ndarray:
    """Rows mixing ordinary values, exact rounding ties, subnormals, overflow and zero blocks."""
    x = rng.standard_normal((n, w)).astype(np.float32) * np.float32(3)
    special = np.array([0.0, -0.0, 1.0, 1 + 2 ** -11, 1 + 3 * 2 ** -11, 1 + 2 ** -8, 1 + 3 * 2 ** -8,
                        65504.0, 65519.0, 65520.0, 1e6, -1e6, 6e-5, 2 ** -24, 2 ** -25, 3 * 2 ** -26,
                        1e-8, 1e-40, -1e-41, np.inf, -np.inf, 3.4e38], np.float32)
    x[0, :len(special)] = special
    x[1, :QK8_0] = 0.0  # a zero block (d = 0)
    x[2, :QK8_0] = np.arange(QK8_0, dtype=np.float32) - 15.5  # x * id lands on halves
    x[3, :QK8_0] = np.float32(127.0) * (np.arange(QK8_0, dtype=np.float32) / 31)
    return x


@pytest.mark.parametrize("dtype", TYPES, ids=lambda t: t.name)
def test_store_and_load_match_the_reference_bit_for_bit(dtype):
    from pyllama._fast import ops
    rng = np.random.default_rng(1)
    n, w = 8, 96
    x = edge_values(rng, n, w)
    if dtype in (Q8_0, *BLOCK_TYPES):  # a block with inf or a huge value has no meaningful scale in ggml either
        x = np.where(np.isfinite(x) & (np.abs(x) < 1e30), x, np.float32(7.0))
    rows = np.zeros((n, row_bytes(dtype, w)), np.uint8)
    ops.kv_store(int(dtype), x, rows)
    np.testing.assert_array_equal(rows, ref_store(dtype, x))
    back = np.zeros((n, w), np.float32)
    ops.kv_load_rows(int(dtype), rows, back)
    np.testing.assert_array_equal(back.astype(np.float64), ref_load(dtype, rows, w))


def test_f16_store_matches_the_reference_on_every_tie_and_random_bit_patterns():
    """Rows are converted 8 values at a time where the CPU has F16C: every rounding tie between
    two halves (normal and subnormal), float32 subnormals, and random bit patterns with NaNs
    among them (a group holding a NaN takes the scalar path) store what the reference stores."""
    from pyllama._fast import ops
    halves = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    ties = ((halves[:-1] + halves[1:]) / 2).astype(np.float32)  # exact in float32
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2 ** 32, 1 << 18, dtype=np.uint64).astype(np.uint32)
    bits[::97] = 0x7FC00000 | bits[::97] & 0x803FFFFF  # NaNs, quiet and with payloads, in some groups
    x = np.concatenate([ties, -ties, np.nextafter(ties, np.float32(0)), np.nextafter(ties, np.float32(1e9)),
                        bits.view(np.float32), np.float32(1e-40) * np.arange(64, dtype=np.float32)])
    x = x[: len(x) // 64 * 64].reshape(-1, 64)
    rows = np.zeros((x.shape[0], 128), np.uint8)
    ops.kv_store(int(F16), x, rows)
    got = rows.view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], ref_store(F16, np.where(nan, 0, x)).view(np.uint16)[~nan])
    np.testing.assert_array_equal(got[nan], (x.view(np.uint32)[nan] >> 16 & 0x8000 | 0x7E00).astype(np.uint16))


@pytest.mark.parametrize("dtype", [F16, BF16], ids=lambda t: t.name)
def test_nan_stays_a_quiet_nan(dtype):
    from pyllama._fast import ops
    x = np.full((1, 32), np.nan, np.float32)
    x.view(np.uint32)[0, 1] = 0x7F800001  # a signalling NaN with a payload in the dropped bits
    rows = np.zeros((1, 64), np.uint8)
    ops.kv_store(int(dtype), x, rows)
    back = np.zeros((1, 32), np.float32)
    ops.kv_load_rows(int(dtype), rows, back)
    assert np.isnan(back).all()
    if dtype == BF16:
        np.testing.assert_array_equal(rows, ref_store(BF16, x))


@pytest.mark.parametrize("dtype", [Q8_0] + BLOCK_TYPES, ids=lambda t: t.name)
def test_block_type_rows_must_be_whole_blocks(dtype):
    from pyllama._fast import ops
    assert ops.kv_row_nbytes(int(dtype), 48) == 0 and ops.kv_row_nbytes(int(dtype), 64) == row_bytes(dtype, 64)
    with pytest.raises(ValueError, match=dtype.name):
        ops.kv_store(int(dtype), np.zeros((1, 48), np.float32), np.zeros((1, 51), np.uint8))


@pytest.mark.parametrize("dtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_block_types_store_random_rows_as_the_reference(dtype):
    """Many random blocks of every scale (and halves that land on rounding ties) byte for byte."""
    from pyllama._fast import ops
    rng = np.random.default_rng(int(dtype))
    n = 64 if dtype == IQ4_NL else 512  # the IQ4_NL reference is a Python loop
    x = (rng.standard_normal((n, 64)) * np.exp(rng.uniform(-8, 8, (n, 1)))).astype(np.float32)
    x[::3, ::4] = np.round(x[::3, ::4] * 2) / 2
    rows = np.zeros((n, row_bytes(dtype, 64)), np.uint8)
    ops.kv_store(int(dtype), x, rows)
    np.testing.assert_array_equal(rows, ref_store(dtype, x))


# --- the ATTENTION op -------------------------------------------------------------------------------
def run_attention(backend: CPUBackend, k_type: DType, v_type: DType, inputs: dict, params: tuple):
    """One ATTENTION node on the CPU backend; returns (output, K cache bytes, V cache bytes) after."""
    n, width = inputs["qkv"].shape[0], inputs["width"]
    cells = inputs["kc"].shape[0]
    srcs = [(F32, inputs["qkv"], inputs["qkv"].shape), (k_type, inputs["kc"], (cells, width)),
            (v_type, inputs["vc"], (cells, width)), (I32, inputs["pos"], None), (I32, inputs["kv_idx"], None),
            (I32, inputs["cells"], None), (I32, inputs["ranges"], None)]
    if "q_norm" in inputs:
        srcs += [(F32, inputs["q_norm"], None), (F32, inputs["k_norm"], None)]
    tensors = []
    for i, (dtype, data, shape) in enumerate(srcs):
        t = Tensor(dtype, shape or data.shape, f"in{i}")
        t.buffer = backend.alloc_buffer(max(t.nbytes, 1))
        backend.set_tensor(t, data)
        tensors.append(t)
    out = Tensor(F32, (n, params[0] * params[2]), "out")
    out.buffer = backend.alloc_buffer(out.nbytes)
    backend.graph_compute(Graph([node(Op.ATTENTION, out, *tensors, params=params)]))
    got = backend.get_tensor(out)
    kb, vb = (backend.bytes_of(t).reshape(cells, -1).copy() for t in tensors[1:3])
    return got, kb, vb


def attention_inputs(rng: np.random.Generator, k_type: DType, v_type: DType, H: int, Hkv: int, hd: int,
                     qk_norm: bool) -> dict:
    """Five tokens of two sequences over a cache of 40 cells whose old cells hold values stored
    through the reference conversions; tokens see earlier cells and each other causally."""
    n, cells, width = 5, 40, Hkv * hd
    old = rng.standard_normal((cells, width)).astype(np.float32)
    inputs = {
        "qkv": rng.standard_normal((n, (H + 2 * Hkv) * hd)).astype(np.float32),
        "kc": ref_store(k_type, old), "vc": ref_store(v_type, old[::-1].copy()),
        "pos": np.array([7, 8, 9, 0, 1], np.int32), "kv_idx": np.array([10, 11, 12, 30, 31], np.int32),
        "cells": np.array([3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 30, 31], np.int32),
        "ranges": np.array([[0, 8], [0, 9], [0, 10], [10, 1], [10, 2]], np.int32), "width": width,
    }
    if qk_norm:
        inputs["q_norm"] = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
        inputs["k_norm"] = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
    return inputs


def rope64(x: np.ndarray, pos: np.ndarray, n_rot: int, mode: int, base: float) -> np.ndarray:
    """x [n, heads, hd] float64 rotated at `pos` (mode 0: pairs (2i, 2i+1); 2: (i, i + n_rot/2))."""
    theta = pos[:, None, None].astype(np.float64) * base ** (-2.0 * np.arange(n_rot // 2) / n_rot)
    c, s = np.cos(theta), np.sin(theta)
    out = x.copy()
    if mode == 0:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2], out[..., 1:n_rot:2] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., :n_rot // 2], x[..., n_rot // 2:n_rot]
        out[..., :n_rot // 2], out[..., n_rot // 2:n_rot] = a * c - b * s, a * s + b * c
    return out


def rotation_sizes(hd: int, k_type: DType, v_type: DType) -> tuple[int, int]:
    """llama.cpp's KV cache rotations: a quantized K cache by the largest power of two from 64
    dividing the head, a quantized V cache by 64, where the head is a multiple of 64."""
    def quantized(t: DType) -> bool:
        return t not in (F32, F16, BF16)
    rot_k = 64 if quantized(k_type) and hd % 64 == 0 else 0
    while rot_k and hd % (2 * rot_k) == 0:
        rot_k *= 2
    return rot_k, (64 if quantized(v_type) and hd % 64 == 0 else 0)


def fwht32(x: np.ndarray, size: int) -> np.ndarray:
    """Each run of `size` values of the rows of x (float32) rotated as ggml's fast Walsh-Hadamard
    transform rotates them: scaled by 1 / sqrt(size) first, then butterflies u + v, u - v."""
    y = (np.asarray(x, np.float32).reshape(-1, size) * (np.float32(1) / np.sqrt(np.float32(size)))).astype(np.float32)
    ln = 1
    while ln < size:
        z = y.reshape(-1, size // (2 * ln), 2, ln)
        u, v = z[:, :, 0].copy(), z[:, :, 1].copy()
        z[:, :, 0], z[:, :, 1] = u + v, u - v
        ln *= 2
    return y.reshape(np.shape(x))


def hadamard64(size: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < size:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(size)


def test_fwht32_is_the_orthonormal_hadamard_product():
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    for size in (64, 128, 256):
        want = (x.astype(np.float64).reshape(-1, size) @ hadamard64(size)).reshape(x.shape)
        np.testing.assert_allclose(fwht32(x, size), want, rtol=1e-5, atol=1e-5)


def norm64(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("k_type,v_type", [(t, t) for t in TYPES] + [(Q8_0, F16), (F32, BF16)],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("hd,mode,qk_norm", [(16, 0, False), (64, 2, True)])
# query heads per kv head: the kernel takes cells 4 at a time for up to 4 heads at once
@pytest.mark.parametrize("H,Hkv", [(4, 2), (4, 4), (6, 2), (12, 2)], ids=lambda v: str(v))
def test_attention_matches_float64_reference(k_type, v_type, hd, mode, qk_norm, H, Hkv):
    rng = np.random.default_rng(hd + int(k_type) + 10 * H + Hkv)
    eps, base = 1e-6, 10000.0
    n_rot = hd if mode == 2 else hd // 2
    params = (H, Hkv, hd, n_rot, mode, base, 1.0, eps, 1.0 / np.sqrt(hd))
    inputs = attention_inputs(rng, k_type, v_type, H, Hkv, hd, qk_norm)
    backend = CPUBackend(1)
    # the F32 run gives the kernel's own f32 k (after norm and RoPE) and v, which the typed run
    # must store exactly as the reference converts them
    f32_inputs = dict(inputs, kc=ref_load(k_type, inputs["kc"], Hkv * hd).astype(np.float32),
                      vc=ref_load(v_type, inputs["vc"], Hkv * hd).astype(np.float32))
    _, k32, v32 = run_attention(backend, F32, F32, f32_inputs, params)
    got, kb, vb = run_attention(backend, k_type, v_type, inputs, params)
    # a quantized cache stores the written rows Hadamard-rotated, as llama.cpp's KV cache does
    rot_k, rot_v = rotation_sizes(hd, k_type, v_type)
    k32, v32 = k32.view(np.float32).copy(), v32.view(np.float32).copy()
    written = inputs["kv_idx"]
    if rot_k:
        k32[written] = fwht32(k32[written], rot_k)
    if rot_v:
        v32[written] = fwht32(v32[written], rot_v)
    np.testing.assert_array_equal(kb, ref_store(k_type, k32))
    np.testing.assert_array_equal(vb, ref_store(v_type, v32))

    # float64 attention over the stored values
    qkv = inputs["qkv"].astype(np.float64)
    n, pos = qkv.shape[0], inputs["pos"]
    q = qkv[:, :H * hd].reshape(n, H, hd)
    k_new = qkv[:, H * hd:(H + Hkv) * hd].reshape(n, Hkv, hd)
    if qk_norm:
        q, k_new = norm64(q, inputs["q_norm"], eps), norm64(k_new, inputs["k_norm"], eps)
    q, k_new = rope64(q, pos, n_rot, mode, base), rope64(k_new, pos, n_rot, mode, base)
    if rot_k:  # q.k is unchanged by the rotation, but the cache holds k rotated: q turns with it
        q = (q.reshape(-1, rot_k) @ hadamard64(rot_k)).reshape(q.shape)
        k_new = (k_new.reshape(-1, rot_k) @ hadamard64(rot_k)).reshape(k_new.shape)
    # the kernel's f32 rotation agrees with float64 before any rounding into the cache type
    np.testing.assert_allclose(k32[inputs["kv_idx"]].reshape(n, Hkv, hd), k_new, rtol=1e-5, atol=1e-5)
    K, V = ref_load(k_type, kb, Hkv * hd), ref_load(v_type, vb, Hkv * hd)
    want = np.zeros((n, H, hd))
    for t in range(n):
        r0, r1 = inputs["ranges"][t]
        listed = inputs["cells"][r0:r0 + r1]
        for h in range(H):
            g = h // (H // Hkv)
            scores = K[listed, g * hd:(g + 1) * hd] @ q[t, h] * params[8]
            p = np.exp(scores - scores.max())
            want[t, h] = (p / p.sum()) @ V[listed, g * hd:(g + 1) * hd]
    if rot_v:  # the output turned back
        want = (want.reshape(-1, rot_v) @ hadamard64(rot_v)).reshape(want.shape)
    np.testing.assert_allclose(got.reshape(n, H, hd), want, rtol=1e-5, atol=2e-6)


def test_attention_refuses_a_type_it_cannot_read():
    from pyllama._fast import ops
    f = np.zeros((1, 4 * 16), np.float32)
    cache = np.zeros((4, 2 * 16 * 2), np.uint8)
    i1 = np.zeros(1, np.int32)
    with pytest.raises(ValueError, match="cannot hold"):
        ops.attention(f, cache, cache.copy(), i1, i1, i1, np.array([[0, 1]], np.int32), np.zeros(0, np.float32),
                      np.zeros(0, np.float32), np.zeros((1, 32), np.float32), 2, 1, 16, 16, 0, 1e4, 1.0, 1e-5, 0.25,
                      1, int(DType.Q4_K), int(F16))


# --- contexts: bytes, memory check, refusals -----------------------------------------------------------
@pytest.mark.parametrize("dtype", TYPES, ids=lambda t: t.name)
def test_kv_bytes_and_memory_check_follow_the_type(tiny_model, dtype):
    engine = Engine(tiny_model, n_threads=1)
    try:
        hp = engine.model.hparams
        ctx = engine.new_context(256, 2, type_k=dtype, type_v=dtype)
        cells = ctx.kv.n_cells
        k_bytes = cells * row_bytes(dtype, hp.n_embd_kv)
        per_layer = -(-k_bytes // 64) * 64 + k_bytes  # V starts on a 64-byte boundary
        assert ctx.kv_bytes == {"CPU": hp.n_layer * per_layer}
        assert ctx.kv_types == {"CPU": (dtype, dtype)}
        assert {k.dtype for k, _ in ctx.kv_tensors} == {v.dtype for _, v in ctx.kv_tensors} == {dtype}
        need = engine.check_memory(1, 256, 2, 2048, 512, False, dtype, dtype)
        need_f32 = engine.check_memory(1, 256, 2, 2048, 512, False, F32, F32)
        f32_kv = hp.n_layer * 2 * cells * hp.n_embd_kv * 4
        assert need_f32["CPU"] - need["CPU"] == f32_kv - ctx.kv_bytes["CPU"]
    finally:
        engine.close()


def test_default_cache_type_is_f16(tiny_model):
    engine = Engine(tiny_model, n_threads=1)
    try:
        assert engine.new_context(64).kv_types == {"CPU": (F16, F16)}
    finally:
        engine.close()


def test_q8_0_needs_rows_of_whole_blocks(model_factory, monkeypatch, tmp_path):
    """A q8_0 cache on a model whose K/V rows are not a multiple of 32: one clear error."""
    from pyllama.models import make
    monkeypatch.setitem(make.PRESETS, "odd", make.Preset(48, 1, 4, 2, 96, 512, 256, False))  # K/V rows of 24
    path = make.make_model("odd", str(tmp_path / "odd.gguf"))
    engine = Engine(path, n_threads=1)
    try:
        with pytest.raises(PyllamaError, match=r"-ctv q8_0: .*blocks of 32.* 24 elements") as err:
            engine.new_context(64, type_k=F16, type_v=Q8_0)
        assert "\n" not in str(err.value)
        engine.new_context(64, type_k=BF16, type_v=F16)  # the element types fit any width
    finally:
        engine.close()


def test_a_device_without_the_type_keeps_f32_and_says_so(tiny_model, caplog, monkeypatch):
    """A device whose attention reads only F32 caches (the CUDA backend) keeps its layers' caches
    in F32, logged once per device and types; the other devices keep the asked type."""
    import pyllama.runtime.context
    monkeypatch.setattr(pyllama.runtime.context, "_KV_FALLBACK_LOGGED", set())

    class F32Only(CPUBackend):
        kv_types = frozenset({F32})

    engine = Engine(tiny_model, n_threads=1, backends=[CPUBackend(1, "CPU"), F32Only(1, "GPU0")],
                    tensor_split=[1, 1])
    try:
        with caplog.at_level(logging.WARNING, logger="pyllama.runtime.context"):
            ctx = engine.new_context(64, type_k=Q8_0, type_v=F16)
            engine.new_context(64, type_k=Q8_0, type_v=F16)
        assert ctx.kv_types == {"CPU": (Q8_0, F16), "GPU0": (F32, F32)}
        lines = [r.getMessage() for r in caplog.records if "GPU0" in r.getMessage()]
        assert lines == ["GPU0 cannot hold a KV cache of K q8_0, V f16: its layers keep it as K f32, V f32"]
        out = ctx.decode(Batch.for_sequence([1, 2, 3], 0, 0))
        assert np.isfinite(out.logits).all()
    finally:
        engine.close()


def test_cuda_device_keeps_f32_caches(tiny_model, monkeypatch, tmp_path):
    """On the fake CUDA device of tests/fake_cuda.py: the default f16 cache stays on the CPU's
    layers, the CUDA device's layers keep F32 (its kernels read nothing else), and it runs."""
    import fake_cuda
    from pyllama.runtime.placement.devices import make_backends
    fake_cuda.install(monkeypatch, tmp_path / "kernels")
    # an even split: by free memory, the fake device's 64 GiB can take every layer of the tiny model
    engine = Engine(tiny_model, n_threads=1, backends=make_backends("CUDA0,CPU", None, "layer", 1), tensor_split=[1, 1])
    try:
        ctx = engine.new_context(64)
        assert ctx.kv_types == {"CUDA0": (F32, F32), "CPU": (F16, F16)}
        out = ctx.decode(Batch.for_sequence(engine.tokenizer.encode(PROMPT), 0, 0))
        assert np.isfinite(out.logits).all()
    finally:
        engine.close()


# --- whole runs ----------------------------------------------------------------------------------
PROMPT = "The little cat sat on the"


def generate(model: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyllama.generate", "-m", model, "-p", PROMPT, "-n", "16",
                           "--temp", "0", "--ignore-eos", "--tokens", "-t", "1", *args],
                          capture_output=True, text=True, timeout=180, env={**os.environ, **(env or {})})


def tokens_of(proc: subprocess.CompletedProcess) -> list[int]:
    assert proc.returncode == 0, proc.stderr
    return [int(x) for x in proc.stdout.split()]


@pytest.mark.parametrize("name", list(CACHE_TYPES))
def test_greedy_identical_local_split_and_traced(tiny_model, rpc_peer, tmp_path, name):
    local = tokens_of(generate(tiny_model, "-ctk", name, "-ctv", name))
    assert len(local) == 16
    split = generate(tiny_model, "-ctk", name, "-ctv", name, "--rpc", rpc_peer.endpoint, "--device", "RPC0,CPU",
                     "--trace", str(tmp_path / "trace.jsonl"))
    assert tokens_of(split) == local
    # the same through the environment variables
    assert tokens_of(generate(tiny_model, env={"PYLLAMA_ARG_CACHE_TYPE_K": name,
                                               "PYLLAMA_ARG_CACHE_TYPE_V": name})) == local


def test_greedy_identical_in_two_pipeline_groups(tiny_model):
    def run(name: str, groups: int) -> list:
        srv = ServerProcess(tiny_model, "-np", "2", "-c", "512", "--pipeline-groups", str(groups),
                            "-ctk", name, "-ctv", name, "-t", "1").wait_ready()
        try:
            out = []
            for p in ("The little cat sat on the", "Once upon a time"):
                status, res = srv.post("/completion", {"prompt": p, "n_predict": 12, "temperature": 0,
                                                       "ignore_eos": True, "cache_prompt": False,
                                                       "return_tokens": True})
                assert status == 200, res
                out.append(res["tokens"])
            return out
        finally:
            assert srv.stop() == 0

    for name in CACHE_TYPES:
        assert run(name, 1) == run(name, 2), name


def test_the_cache_type_changes_the_logits_but_not_much(tiny_model):
    """Each type is really used: the logits differ from the F32 cache's, by its rounding only."""
    engine = Engine(tiny_model, n_threads=1)
    try:
        tokens = engine.tokenizer.encode(PROMPT)
        logits = {}
        for dtype in TYPES:
            ctx = engine.new_context(64, type_k=dtype, type_v=dtype)
            logits[dtype] = ctx.decode(Batch.for_sequence(tokens, 0, 0, all_logits=True)).logits.copy()
        scale = np.abs(logits[F32]).max()
        for dtype, bound in ((F16, 2e-3), (BF16, 2e-2), (Q8_0, 2e-2), (Q5_0, 0.05), (Q5_1, 0.05), (Q4_0, 0.1),
                             (Q4_1, 0.1), (IQ4_NL, 0.1)):
            err = np.abs(logits[dtype] - logits[F32]).max() / scale
            assert 0 < err < bound, (dtype.name, err)
    finally:
        engine.close()


# --- flags -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("program", ["pyllama.generate", "pyllama.server.__main__"])
def test_flags_parse(program):
    import importlib
    parser = importlib.import_module(program).build_parser()
    assert (parser.parse_args([]).cache_type_k, parser.parse_args([]).cache_type_v) == ("f16", "f16")
    for name in CACHE_TYPES:
        args = parser.parse_args(["-ctk", name, "--cache-type-v", name])
        assert (args.cache_type_k, args.cache_type_v) == (name, name)
        args = parser.parse_args(["--cache-type-k", name, "-ctv", name])
        assert (args.cache_type_k, args.cache_type_v) == (name, name)


@pytest.mark.parametrize("program", ["pyllama.generate", "pyllama.server"])
@pytest.mark.parametrize("args,env", [(["-ctk", "q4_k"], {}), (["-ctv", "F17"], {}),
                                      ([], {"PYLLAMA_ARG_CACHE_TYPE_V": "int8"})])
def test_a_bad_cache_type_is_one_line_and_exit_1(tiny_model, program, args, env):
    proc = subprocess.run([sys.executable, "-m", program, "-m", tiny_model, *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **env})
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and ("cache-type" in lines[0] or "CACHE_TYPE" in lines[0]), proc.stderr
