"""An independent float64 reference of ggml's quantized dot products, written from ggml's
published block formats (ggml-common.h / ggml-quants.c) with numpy, not from pyllama's kernels.

- Activations are quantized as ggml's x86 CPU backend does: quantize_row_q8_0 and quantize_row_q8_1
  of ggml-cpu/arch/x86/quants.c (float32 arithmetic, id = 127 / amax, round half to even; the
  reference C code's 1 / d and roundf differ from them at halves), quantize_row_q8_K_ref
  (nearest_int = half to even, iscale = -127/max of the first largest |x|), F16 and BF16 by
  round-to-nearest-even.
- Weights are decoded into their integer quants, sub-block scales and minimums, from the byte
  layouts; `dequantized_dot` ties that decoding to gguf.quants.dequantize.
- `block_sums` gives the integer sums per (sub-)block in the layout of qmatmul.int_block_sums;
  `dot` gives ggml's formula evaluated exactly (float64 over exact integers and f16/f32 scales),
  with `abs_scale` the sum of |terms| that bounds float rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

QK_K = 256
ACT_TYPE = {T.F32: T.F32, T.F16: T.F16, T.BF16: T.BF16, T.Q4_0: T.Q8_0, T.Q5_0: T.Q8_0, T.Q8_0: T.Q8_0,
            T.Q4_1: T.Q8_1, T.Q5_1: T.Q8_1, T.Q2_K: T.Q8_K, T.Q3_K: T.Q8_K, T.Q4_K: T.Q8_K,
            T.Q5_K: T.Q8_K, T.Q6_K: T.Q8_K, T.IQ4_NL: T.Q8_0, T.IQ4_XS: T.Q8_K, T.MXFP4: T.Q8_0}
BLOCK_BYTES = {T.Q4_0: 18, T.Q4_1: 20, T.Q5_0: 22, T.Q5_1: 24, T.Q8_0: 34, T.Q8_1: 36, T.Q2_K: 84,
               T.Q3_K: 110, T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210, T.Q8_K: 292, T.IQ4_NL: 18, T.IQ4_XS: 136,
               T.MXFP4: 17}
BLOCK_ELEMS = {t: (QK_K if t in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_K, T.IQ4_XS) else 32) for t in BLOCK_BYTES}
# Byte offsets of every f16 scale field of a weight block (random test blocks make them finite).
F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
              T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
              T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.MXFP4: ()}
# The 4-bit lookup types' values (ggml-common.h's kvalues_iq4nl, and kvalues_mxfp4: E2M1 doubled)
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int64)
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int64)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """MXFP4's E8M0 exponent byte -> 2^(e - 128) (half the OCP scale: the values are doubled)."""
    return np.ldexp(1.0, np.asarray(e, np.int64) - 128)


def f16(b: np.ndarray) -> np.ndarray:
    """Little-endian f16 bytes [..., 2] -> float64."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float64)


# ---- activation quantizers -------------------------------------------------------------------

def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """float32 [k] -> Q8_0 bytes [k/32, 34] as x86 ggml's quantize_row_q8_0."""
    b = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(b).max(axis=1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    qs = np.rint((b * inv[:, None]).astype(np.float32)).astype(np.int8)  # half to even
    return np.concatenate([d.astype(np.float16)[:, None].view(np.uint8), qs.view(np.uint8)], axis=1)


def quantize_q8_1(x: np.ndarray) -> np.ndarray:
    """float32 [k] -> Q8_1 bytes [k/32, 36]: d f16, s = f16(sum(qs) * d), qs."""
    q8 = quantize_q8_0(x)
    d = (np.abs(x.astype(np.float32).reshape(-1, 32)).max(axis=1) / np.float32(127)).astype(np.float32)  # float, not f16
    qs = q8[:, 2:].view(np.int8)
    s = (qs.astype(np.int32).sum(axis=1).astype(np.float32) * d).astype(np.float32)
    return np.concatenate([q8[:, :2], s.astype(np.float16)[:, None].view(np.uint8), q8[:, 2:]], axis=1)


def quantize_q8_K(x: np.ndarray) -> np.ndarray:
    """float32 [k] -> Q8_K bytes [k/256, 292] as quantize_row_q8_K_ref: d f32, qs, bsums i16[16]."""
    b = x.astype(np.float32).reshape(-1, QK_K)
    out = np.zeros((b.shape[0], 292), dtype=np.uint8)
    for i, blk in enumerate(b):
        a = np.abs(blk)
        if a.max() == 0:
            continue
        mx = blk[int(np.argmax(a))]                  # the first element of largest |x|
        iscale = np.float32(-127) / mx
        v = np.rint((iscale * blk).astype(np.float32))   # nearest_int: ties to even
        qs = np.minimum(v, 127).astype(np.int8)
        bsums = qs.astype(np.int16).reshape(16, 16).sum(axis=1).astype(np.int16)
        out[i, :4] = np.array([np.float32(1) / iscale], dtype=np.float32).view(np.uint8)
        out[i, 4:260] = qs.view(np.uint8)
        out[i, 260:] = bsums.view(np.uint8)
    return out


def quantize_activation(x: np.ndarray, act: T) -> np.ndarray:
    """One float32 row -> the bytes of its `act` quantization (one row)."""
    x = np.asarray(x, dtype=np.float32)
    if act == T.F32:
        return x.view(np.uint8).copy()
    if act == T.F16:
        return x.astype(np.float16).view(np.uint8)
    if act == T.BF16:
        return np.asarray(quants.quantize(x, T.BF16)).view(np.uint8).reshape(-1)
    fn = {T.Q8_0: quantize_q8_0, T.Q8_1: quantize_q8_1, T.Q8_K: quantize_q8_K}[act]
    return fn(x).reshape(-1)


@dataclass
class Activation:
    """A quantized activation row, decoded: q[k] ints, d per block, s per block (Q8_1)."""
    q: np.ndarray
    d: np.ndarray
    s: np.ndarray | None = None


def decode_activation(xq: np.ndarray, act: T, k: int) -> Activation:
    if act in (T.F32, T.F16, T.BF16):
        raw = np.ascontiguousarray(xq)
        vals = (raw.view(np.float32) if act == T.F32 else
                raw.view(np.float16).astype(np.float64) if act == T.F16 else
                (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32))
        return Activation(q=np.asarray(vals, dtype=np.float64), d=np.ones(1))
    b = np.ascontiguousarray(xq).reshape(-1, BLOCK_BYTES[act])
    if act == T.Q8_0:
        return Activation(q=b[:, 2:].view(np.int8).astype(np.int64).reshape(-1), d=f16(b[:, 0:2]))
    if act == T.Q8_1:
        return Activation(q=b[:, 4:].view(np.int8).astype(np.int64).reshape(-1), d=f16(b[:, 0:2]), s=f16(b[:, 2:4]))
    return Activation(q=b[:, 4:260].view(np.int8).astype(np.int64).reshape(-1),
                      d=b[:, :4].copy().view(np.float32)[:, 0].astype(np.float64))


# ---- weight decoding ------------------------------------------------------------------------

@dataclass
class Weight:
    """A weight row decoded: q[k] the integers of the integer dot, sub the sub-block length,
    sc[k/sub] integer sub-block scales, m[k/sub] integer sub-block minimums (K-quants with a
    min), d / dmin per block (f16), fmin per block (Q4_1/Q5_1's f16 minimum)."""
    q: np.ndarray
    sub: int
    sc: np.ndarray
    d: np.ndarray
    m: np.ndarray | None = None
    dmin: np.ndarray | None = None
    fmin: np.ndarray | None = None


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes of Q4_K/Q5_K scales -> (8 scales, 8 mins) of 6 bits (get_scale_min_k4)."""
    s = s.astype(np.int64)
    sc, m = np.zeros(8, np.int64), np.zeros(8, np.int64)
    for j in range(8):
        if j < 4:
            sc[j], m[j] = s[j] & 63, s[j + 4] & 63
        else:
            sc[j] = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4)
            m[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4)
    return sc, m


def decode_weight(w: np.ndarray, qtype: T, k: int) -> Weight:
    b = np.ascontiguousarray(w).reshape(-1, BLOCK_BYTES[qtype]).astype(np.int64)
    nb = b.shape[0]
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        off = {T.Q4_0: 2, T.Q4_1: 4, T.Q5_0: 6, T.Q5_1: 8}[qtype]
        qs = b[:, off:off + 16]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=1)          # element j: low nibble, j+16: high
        if qtype in (T.Q5_0, T.Q5_1):
            hoff = 2 if qtype == T.Q5_0 else 4
            qh = (b[:, hoff] | (b[:, hoff + 1] << 8) | (b[:, hoff + 2] << 16) | (b[:, hoff + 3] << 24))
            q = q | (((qh[:, None] >> np.arange(32)) & 1) << 4)
        if qtype == T.Q4_0:
            q = q - 8
        if qtype == T.Q5_0:
            q = q - 16
        wb = np.ascontiguousarray(w).reshape(nb, -1)
        fmin = f16(wb[:, 2:4]) if qtype in (T.Q4_1, T.Q5_1) else None
        return Weight(q=q.reshape(-1), sub=32, sc=np.ones(nb, np.int64), d=f16(wb[:, 0:2]), fmin=fmin)
    wb = np.ascontiguousarray(w).reshape(nb, -1)
    if qtype in (T.IQ4_NL, T.MXFP4):    # d f16 | qs[16], or e (E8M0) | qs[16]
        off = 2 if qtype == T.IQ4_NL else 1
        qs = b[:, off:off + 16]
        kv = KVALUES_IQ4NL if qtype == T.IQ4_NL else KVALUES_MXFP4
        q = kv[np.concatenate([qs & 0xF, qs >> 4], axis=1)]
        d = f16(wb[:, 0:2]) if qtype == T.IQ4_NL else e8m0_half(b[:, 0])
        return Weight(q=q.reshape(-1), sub=32, sc=np.ones(nb, np.int64), d=d)
    if qtype == T.IQ4_XS:      # d | scales_h u16 | scales_l[4] | qs[128]: sub-block ib is qs[16ib:][:16]
        ib = np.arange(8)
        sh = b[:, 2] | (b[:, 3] << 8)
        lo = (b[:, 4 + ib // 2] >> (4 * (ib % 2))) & 0xF
        hi = (sh[:, None] >> (2 * ib)) & 3
        qs = b[:, 8:].reshape(nb, 8, 16)
        q = KVALUES_IQ4NL[np.concatenate([qs & 0xF, qs >> 4], axis=2)]
        return Weight(q=q.reshape(-1), sub=32, sc=((lo | (hi << 4)) - 32).reshape(-1), d=f16(wb[:, 0:2]))
    if qtype == T.Q8_0:
        return Weight(q=wb[:, 2:].view(np.int8).astype(np.int64).reshape(-1), sub=32,
                      sc=np.ones(nb, np.int64), d=f16(wb[:, 0:2]))
    e = np.arange(QK_K)
    h, s, l = e // 128, (e // 32) % 4, e % 32
    if qtype == T.Q2_K:        # scales[16] | qs[64] | d | dmin
        q = (b[:, 16 + 32 * h + l] >> (2 * s)) & 3
        return Weight(q=q.reshape(-1), sub=16, sc=(b[:, :16] & 0xF).reshape(-1), d=f16(wb[:, 80:82]),
                      m=(b[:, :16] >> 4).reshape(-1), dmin=f16(wb[:, 82:84]))
    if qtype == T.Q3_K:        # hmask[32] | qs[64] | scales[12] | d
        q = ((b[:, 32 + 32 * h + l] >> (2 * s)) & 3) - np.where((b[:, l] >> (e // 32)) & 1, 0, 4)
        i = np.arange(16)
        lo = (b[:, 96 + i % 8] >> (4 * (i // 8))) & 0xF
        hi = (b[:, 104 + i % 4] >> (2 * (i // 4))) & 3
        return Weight(q=q.reshape(-1), sub=16, sc=((lo | (hi << 4)) - 32).reshape(-1), d=f16(wb[:, 108:110]))
    if qtype in (T.Q4_K, T.Q5_K):   # d | dmin | scales[12] | (qh[32]) | qs[128]
        qoff = 48 if qtype == T.Q5_K else 16
        g = e // 32
        q = (b[:, qoff + 32 * (g // 2) + l] >> (4 * (g % 2))) & 0xF
        if qtype == T.Q5_K:
            q = q | (((b[:, 16 + l] >> g) & 1) << 4)
        scm = [_k4_scales(b[i, 4:16]) for i in range(nb)]
        return Weight(q=q.reshape(-1), sub=32, sc=np.concatenate([a for a, _ in scm]), d=f16(wb[:, 0:2]),
                      m=np.concatenate([m for _, m in scm]), dmin=f16(wb[:, 2:4]))
    if qtype == T.Q6_K:        # ql[128] | qh[64] | scales i8[16] | d
        lo = (b[:, 64 * h + 32 * (s & 1) + l] >> (4 * (s >> 1))) & 0xF
        hi = (b[:, 128 + 32 * h + l] >> (2 * s)) & 3
        return Weight(q=((lo | (hi << 4)) - 32).reshape(-1), sub=16,
                      sc=wb[:, 192:208].view(np.int8).astype(np.int64).reshape(-1), d=f16(wb[:, 208:210]))
    raise ValueError(f"no integer decoding for {qtype.name}")


# ---- integer sums and the exact dot ----------------------------------------------------------

def block_sums(w: np.ndarray, xq: np.ndarray, qtype: T, k: int) -> np.ndarray:
    """int64 [n_blocks, ints] in qmatmul.int_block_sums' layout (see ggml_quants.h)."""
    wd = decode_weight(w, qtype, k)
    xa = decode_activation(xq, ACT_TYPE[qtype], k)
    prod = wd.q * xa.q
    raw = prod.reshape(-1, wd.sub).sum(axis=1)                # per sub-block
    if BLOCK_ELEMS[qtype] == 32:
        return raw.reshape(-1, 1)
    nsub = QK_K // wd.sub
    raw = raw.reshape(-1, nsub)
    isum = (raw * wd.sc.reshape(-1, nsub)).sum(axis=1)
    cols = [raw, isum[:, None]]
    if wd.m is not None:
        q8sub = xa.q.reshape(-1, nsub, wd.sub).sum(axis=2)
        cols.append((q8sub * wd.m.reshape(-1, nsub)).sum(axis=1)[:, None])
    return np.concatenate(cols, axis=1)


def dot(w: np.ndarray, xq: np.ndarray, qtype: T, k: int) -> tuple[float, float]:
    """(ggml's dot of one weight row with one quantized activation row, evaluated exactly in
    float64, S = the sum of |terms| of that sum at element granularity)."""
    act = ACT_TYPE[qtype]
    xa = decode_activation(xq, act, k)
    if qtype in (T.F32, T.F16, T.BF16):
        wv = decode_activation(w, qtype, k).q
        p = wv * xa.q
        return float(p.sum()), float(np.abs(p).sum())
    wd = decode_weight(w, qtype, k)
    sums = block_sums(w, xq, qtype, k).astype(np.float64)
    # ggml's Q6_K multiplies the unsigned q + 32 and takes 32 * scale * (the group's q8 sum) back in
    # the same int32 lane before converting: its float terms are bounded by those magnitudes
    q6 = qtype == T.Q6_K
    absprod = np.abs((wd.q + 32 if q6 else wd.q) * xa.q).reshape(-1, wd.sub).sum(axis=1)
    if BLOCK_ELEMS[qtype] == 32:
        val = (wd.d * xa.d * sums[:, 0]).sum()
        S = (np.abs(wd.d * xa.d) * absprod).sum()
        if wd.fmin is not None:
            val += (wd.fmin * xa.s).sum()
            S += np.abs(wd.fmin * xa.s).sum()
        return float(val), float(S)
    nsub = QK_K // wd.sub
    isum = sums[:, nsub]
    val = (wd.d * xa.d * isum).sum()
    S = (np.abs(wd.d * xa.d) * (np.abs(wd.sc.reshape(-1, nsub)) * absprod.reshape(-1, nsub)).sum(axis=1)).sum()
    if q6:
        absq8 = np.abs(xa.q.reshape(-1, nsub, wd.sub).sum(axis=2))
        S += (np.abs(wd.d * xa.d) * (np.abs(wd.sc.reshape(-1, nsub)) * 32 * absq8).sum(axis=1)).sum()
    if wd.m is not None:
        summs = sums[:, nsub + 1]
        val -= (wd.dmin * xa.d * summs).sum()
        absq8 = np.abs(xa.q).reshape(-1, nsub, wd.sub).sum(axis=2)
        S += (np.abs(wd.dmin * xa.d) * (wd.m.reshape(-1, nsub) * absq8).sum(axis=1)).sum()
    return float(val), float(S)


def dequantized_dot(w: np.ndarray, xq: np.ndarray, qtype: T, k: int) -> float:
    """The same dot from gguf.quants.dequantize'd weights and the decoded activations (the
    Q4_1/Q5_1 minimum taken as ggml takes it: times the activation block's stored s)."""
    act = ACT_TYPE[qtype]
    xa = decode_activation(xq, act, k)
    if qtype in (T.F32, T.F16, T.BF16):
        return float((decode_activation(w, qtype, k).q * xa.q).sum())
    wf = np.asarray(quants.dequantize(np.ascontiguousarray(w).reshape(1, -1), qtype), dtype=np.float64).reshape(-1)
    xd = xa.q.astype(np.float64) * np.repeat(xa.d, BLOCK_ELEMS[act])
    if qtype in (T.Q4_1, T.Q5_1):
        wd = decode_weight(w, qtype, k)
        wf = wf - np.repeat(wd.fmin, 32)
        return float((wf * xd).sum() + (wd.fmin * xa.s).sum())
    return float((wf * xd).sum())


def tolerance(k: int, S: float) -> float:
    """The bound stated in ggml_quants.h: (k + 16) * 2^-24 * S."""
    return (k + 16) * 2.0 ** -24 * S


def random_weights(qtype: T, m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [m, row_bytes] of valid random blocks: random bytes with finite f16 scales (some
    negative, some zero); float types from random normals."""
    if qtype in (T.F32, T.F16, T.BF16):
        x = (rng.standard_normal((m, k)) * 0.5).astype(np.float32)
        if qtype == T.F32:
            return x.view(np.uint8)
        if qtype == T.F16:
            return x.astype(np.float16).view(np.uint8)
        return np.asarray(quants.quantize(x, T.BF16)).view(np.uint8).reshape(m, -1)
    nb, size = k // BLOCK_ELEMS[qtype], BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, (m, nb, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scales = rng.uniform(-0.05, 0.05, (m, nb)).astype(np.float16)
        scales[rng.random((m, nb)) < 0.05] = 0
        raw[:, :, off:off + 2] = scales.view(np.uint8).reshape(m, nb, 2)
    if qtype == T.MXFP4:       # block scales 2^-20 .. 2^-3, and the E8M0 extremes now and then
        raw[:, :, 0] = rng.integers(108, 126, (m, nb))
        raw[:, :, 0][rng.random((m, nb)) < 0.02] = 0
        raw[:, :, 0][rng.random((m, nb)) < 0.02] = 1
    return raw.reshape(m, -1)
