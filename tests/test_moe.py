"""Mixture-of-Experts models (qwen2moe, qwen3moe, Mixtral-style llama): greedy tokens against the
float64 reference written from the published model definitions, identical tokens over every split
and over pipeline groups, the MOE_FFN kernel (only the chosen experts are read, tokens grouped by
expert give what each token alone gives), and refusals at load by devices that cannot run it."""
from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants

from pyllama._fast import moe, qmatmul
from pyllama.backend.cpu import CPUBackend
from pyllama.runtime.engine import Engine
from pyllama.util.errors import PyllamaError
from pyllama.models.gguf_file import GGUFFile
from pyllama.models.quantize import quantize
from pyllama.rpc.protocol import Cap
from pyllama.ir.tensor import DType, Graph, Op, Tensor, check_node, node
from engine_util import greedy, placed
from reference_forward import reference_logits
from server_util import RPCServerProcess, assert_same_tokens_in_two_groups, generated_tokens, run_generate

PROMPT = "The little cat sat on the"
# (preset, --arch, --type): every MoE layout in F32, then quantized experts: Q8_0 and Q4_0 (tiny),
# and the small Q4_K_M mix (gate/up experts Q5_0 on their 288-wide rows, down experts Q4_K or Q6_K)
MODELS = [("tiny", "qwen3moe", "f32"), ("tiny", "qwen2moe", "f32"), ("tiny", "mixtral", "f32"),
          ("tiny", "qwen2moe", "q8_0"), ("tiny", "mixtral", "q4_0"), ("small", "qwen3moe", "q4_k_m")]


@pytest.mark.parametrize("preset,arch,wtype", MODELS)
def test_greedy_tokens_match_the_reference(model_factory, preset, arch, wtype):
    path = model_factory(preset, arch=arch, wtype=wtype)
    engine = Engine(path, n_threads=2)
    try:
        hp = engine.model.hparams
        assert hp.is_moe and hp.n_expert_used < hp.n_expert
        assert hp.arch == ("llama" if arch == "mixtral" else arch)
        assert hp.expert_weights_norm == (arch != "qwen2moe")  # llama.cpp's default per architecture
        assert (hp.n_ff_shexp > 0) == (arch == "qwen2moe")
        # the expert tensors stay 3-D in their file type, read in place from the file's memory map
        files = engine.model.file.tensors
        for kind in ("gate", "up", "down"):
            t = engine.weights[f"blk.0.ffn_{kind}_exps"]
            info = files[f"blk.0.ffn_{kind}_exps.weight"]
            assert (t.dtype, t.shape) == (info.qtype, info.shape) and len(t.shape) == 3
            assert t.buffer.mapped
        if wtype != "f32":
            assert files["blk.0.ffn_gate_exps.weight"].qtype != QT.F32
        prompt = engine.tokenizer.encode(PROMPT)
        tokens = greedy(engine, prompt, 12)
    finally:
        engine.close()
    ref = reference_logits(path, prompt + tokens)[len(prompt) - 1:-1]
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 1e-2 * np.abs(ref).max()
    assert clear.sum() >= len(tokens) // 2, "too few steps with a clear margin to compare"
    for i in np.flatnonzero(clear):
        assert tokens[i] == int(ref[i].argmax()), f"step {i}: {tokens[i]} vs the reference's {int(ref[i].argmax())}"


# --- the kernel ------------------------------------------------------------------------------------
def _experts(rng, qtype: QT, n_exp: int, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(file bytes [n_exp, bytes per expert], dequantized float64 [n_exp, rows, cols])."""
    w = (rng.standard_normal((n_exp * rows, cols)) / np.sqrt(cols)).astype(np.float32)
    raw = w.view(np.uint8) if qtype == QT.F32 else quantize(w, qtype)
    deq = w if qtype == QT.F32 else quants.dequantize(raw, qtype)
    return np.ascontiguousarray(raw).reshape(n_exp, -1), np.asarray(deq, np.float64).reshape(n_exp, rows, cols)


def _poison(raw: np.ndarray, qtype: QT, experts) -> np.ndarray:
    """A copy with every byte of the given experts set so that any product reading them is NaN
    (F32: NaN elements; block types: every block's scale bytes read as an F16 NaN)."""
    out = raw.copy()
    for x in experts:
        if qtype == QT.F32:
            out[x].view(np.float32)[:] = np.nan
        else:
            out[x].view(np.uint16)[:] = 0x7E00  # F16 NaN in every 2-byte slot: scales included
    return out


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q8_0, QT.Q4_K])
def test_only_the_chosen_experts_are_read(qtype):
    rng = np.random.default_rng(7)
    n, e, f, n_exp, k = 6, 256, 256, 16, 2
    x = rng.standard_normal((n, e)).astype(np.float32)
    logits = (3 * rng.standard_normal((n, n_exp))).astype(np.float32)
    g, gd = _experts(rng, qtype, n_exp, f, e)
    u, ud = _experts(rng, qtype, n_exp, f, e)
    d, dd = _experts(rng, qtype, n_exp, e, f)
    ids, wts = moe.route(logits, k, True, 1.0)
    chosen = set(ids.ravel().tolist())
    assert len(chosen) < n_exp
    out = np.zeros((n, e), np.float32)
    used = moe.moe_ffn(x, logits, g, int(qtype), u, int(qtype), d, int(qtype), out, k, True, 1.0, None, None, 2)
    assert used == len(chosen)
    unchosen = [i for i in range(n_exp) if i not in chosen]
    poisoned = np.zeros((n, e), np.float32)
    moe.moe_ffn(x, logits, _poison(g, qtype, unchosen), int(qtype), _poison(u, qtype, unchosen), int(qtype),
                _poison(d, qtype, unchosen), int(qtype), poisoned, k, True, 1.0, None, None, 2)
    np.testing.assert_array_equal(poisoned, out)  # bit-identical: the NaN rows were never read
    # the same poison in one chosen expert does change token 0's output (the poisoning is seen)
    bad = np.zeros((n, e), np.float32)
    moe.moe_ffn(x, logits, _poison(g, qtype, [int(ids[0, 0])]), int(qtype), u, int(qtype), d, int(qtype), bad, k,
                True, 1.0, None, None, 1)
    assert not np.array_equal(bad[0], out[0], equal_nan=True)
    # against float64 products of the dequantized experts (the activations are quantized for the
    # block types, hence the tolerance)
    ref = np.zeros((n, e))
    for t in range(n):
        for x_id, wt in zip(ids[t], wts[t]):
            h = gd[x_id] @ x[t]
            ref[t] += wt * (dd[x_id] @ (h / (1 + np.exp(-h)) * (ud[x_id] @ x[t])))
    tol = 1e-5 if qtype == QT.F32 else 5e-2
    assert np.abs(out - ref).max() <= tol * np.abs(ref).max()


def test_grouping_by_expert_gives_each_token_its_own_result():
    """Tokens batched (grouped by expert, several rows per product) give exactly what each token
    gives alone, at every thread count."""
    rng = np.random.default_rng(3)
    n, e, f, n_exp, k = 9, 256, 256, 8, 3
    for qtype in (QT.F32, QT.Q4_0, QT.Q6_K):
        x = rng.standard_normal((n, e)).astype(np.float32)
        logits = rng.standard_normal((n, n_exp)).astype(np.float32)
        g, _ = _experts(rng, qtype, n_exp, f, e)
        u, _ = _experts(rng, qtype, n_exp, f, e)
        d, _ = _experts(rng, qtype, n_exp, e, f)
        batched = np.zeros((n, e), np.float32)
        moe.moe_ffn(x, logits, g, int(qtype), u, int(qtype), d, int(qtype), batched, k, True, 1.0, None, None, 2)
        for t in range(n):
            alone = np.zeros((1, e), np.float32)
            moe.moe_ffn(x[t:t + 1], logits[t:t + 1], g, int(qtype), u, int(qtype), d, int(qtype), alone, k, True, 1.0,
                        None, None, 1)
            np.testing.assert_array_equal(alone[0], batched[t])


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K])
def test_repacked_experts_compute_what_the_file_layout_does(qtype):
    """Experts repacked in groups of 8 rows (the CPU's layout for the products, qmatmul.repack_x8 of
    every expert's rows): within float rounding of the file layout's result, gate/up and down each
    either way; a token alone gives bit for bit what it gives in the batch, at any thread count;
    the unchosen experts' bytes are never read."""
    if int(qtype) not in qmatmul.x8_types():
        pytest.skip("this build has no repacked kernels")
    rng = np.random.default_rng(11)
    n, e, f, n_exp, k = 11, 256, 512, 16, 2
    x = rng.standard_normal((n, e)).astype(np.float32)
    logits = (3 * rng.standard_normal((n, n_exp))).astype(np.float32)
    logits[:, 0] += 10  # every token picks expert 0: more rows than one kernel call takes
    g, _ = _experts(rng, qtype, n_exp, f, e)
    u, _ = _experts(rng, qtype, n_exp, f, e)
    d, _ = _experts(rng, qtype, n_exp, e, f)

    def pack(raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
        return qmatmul.repack_x8(raw.reshape(n_exp * rows, -1), int(qtype), cols).reshape(n_exp, -1)

    pg, pu, pd = pack(g, f, e), pack(u, f, e), pack(d, e, f)

    def run(xs, ls, x8_gu: bool, x8_d: bool, nt: int, gate=None, up=None, down=None) -> np.ndarray:
        out = np.zeros((xs.shape[0], e), np.float32)
        moe.moe_ffn(xs, ls, gate if gate is not None else (pg if x8_gu else g), int(qtype),
                    up if up is not None else (pu if x8_gu else u), int(qtype),
                    down if down is not None else (pd if x8_d else d), int(qtype), out, k, True, 1.0, None, None, nt,
                    x8_gate_up=x8_gu, x8_down=x8_d)
        return out

    ref = run(x, logits, False, False, 1)
    ids, _ = moe.route(logits, k, True, 1.0)
    unchosen = [i for i in range(n_exp) if i not in set(ids.ravel().tolist())]
    assert unchosen
    for x8_gu, x8_d in ((True, False), (False, True), (True, True)):
        out = run(x, logits, x8_gu, x8_d, 2)
        # the products' float sums go in another order; after gate / up that may move a hidden value
        # across a rounding edge of its 8-bit quantization for down, one step of its block's scale
        tol = 1e-2 if x8_gu else 1e-5
        assert np.abs(out - ref).max() <= tol * np.abs(ref).max()
        np.testing.assert_array_equal(run(x, logits, x8_gu, x8_d, 1), out)
        for t in range(n):
            np.testing.assert_array_equal(run(x[t:t + 1], logits[t:t + 1], x8_gu, x8_d, 1)[0], out[t])
    poisoned = run(x, logits, True, True, 2, gate=_poison_rows(pg, unchosen), up=_poison_rows(pu, unchosen),
                   down=_poison_rows(pd, unchosen))
    np.testing.assert_array_equal(poisoned, run(x, logits, True, True, 2))
    assert np.isnan(run(x, logits, True, True, 2, down=_poison_rows(pd, [int(ids[0, 0])]))[0]).any()


def _poison_rows(packed: np.ndarray, experts) -> np.ndarray:
    """A copy whose given experts' repacked bytes all read as F16 NaNs (scales included)."""
    out = packed.copy()
    for x in experts:
        out[x].view(np.uint16)[:] = 0x7E00
    return out


def _ggml_router_weights(logits: np.ndarray, ids: np.ndarray, gating: int, norm: bool, scale: float) -> np.ndarray:
    """The chosen experts' weights in ggml's float steps (build_moe_ffn on the CPU): sigmoid as
    1 / (1 + expf(-x)) in float, or soft_max (ggml's vector exp in blocks of 16, expf for the rest,
    the sum in double, times (float)(1 / sum)); the chosen ones' sum in double, rounded, clamped,
    each divided by it in float; times scale in float."""
    from test_attention_ggml import _libm, ggml_exp, reduce16
    f32 = np.float32
    out = np.zeros(ids.shape, f32)
    for t, row in enumerate(logits):
        if gating == 2:
            p = np.array([f32(f32(1) / f32(f32(1) + _libm.expf(f32(-v)))) for v in row], f32)
        else:
            mx = row.max()
            n16 = len(row) // 16 * 16
            e = np.empty_like(row)
            total = 0.0
            for b in range(0, n16, 16):
                e[b:b + 16] = ggml_exp(row[b:b + 16] - mx)
                total += float(reduce16(e[b:b + 16]))
            for i in range(n16, len(row)):
                e[i] = _libm.expf(f32(row[i] - mx))
                total += float(e[i])
            p = e * f32(1.0 / total)
        w = p[ids[t]]
        if norm:
            s = f32(sum(float(v) for v in w))
            w = (w / max(s, f32(6.103515625e-5))).astype(f32)
        if scale not in (0.0, 1.0):
            w = (w * f32(scale)).astype(f32)
        out[t] = w
    return out


@pytest.mark.parametrize("gating,n_exp", [(1, 8), (1, 60), (2, 64)], ids=["softmax-8", "softmax-60", "sigmoid-64"])
def test_router_weights_are_ggml_float_steps(gating, n_exp):
    """Each token's weights bit for bit as llama.cpp's graph computes them: on a model with
    quantized experts a last-bit difference can change how the next layer's activations round."""
    rng = np.random.default_rng(n_exp)
    logits = (3 * rng.standard_normal((5, n_exp))).astype(np.float32)
    for norm, scale in ((True, 1.0), (True, 2.5), (False, 1.0)):
        ids, wts = moe.route(logits, 4, norm, scale, gating)
        np.testing.assert_array_equal(wts, _ggml_router_weights(logits, ids, gating, norm, scale))


@pytest.mark.parametrize("f", [256, 96])
def test_expert_ffn_is_the_dense_ops_bit_for_bit(f):
    """Each token's output is exactly what the dense ops give for its chosen experts: gate and up
    (Q8_0) by mul_mat_q, SWIGLU by ops.swiglu (ggml's swiglu, its vector exp: the experts' scalar
    expf gave other last bits in about half the values, which a quantized down product's rounding
    of its input can turn into a whole quantization step), down (F32 here, so that every hidden bit
    shows) by mul_mat_q, then ggml's mixture (each output times its weight, added in order)."""
    from pyllama._fast import ops
    rng = np.random.default_rng(f)
    n, e, n_exp, k = 24, 256, 8, 4
    x = rng.standard_normal((n, e)).astype(np.float32)
    logits = (3 * rng.standard_normal((n, n_exp))).astype(np.float32)
    g, _ = _experts(rng, QT.Q8_0, n_exp, f, e)
    u, _ = _experts(rng, QT.Q8_0, n_exp, f, e)
    d, _ = _experts(rng, QT.F32, n_exp, e, f)  # F32: the hidden values reach the output unrounded
    out = np.zeros((n, e), np.float32)
    moe.moe_ffn(x, logits, g, int(QT.Q8_0), u, int(QT.Q8_0), d, int(QT.F32), out, k, True, 1.0, None, None, 1)
    ids, wts = moe.route(logits, k, True, 1.0)
    t8 = int(QT.Q8_0)
    for t in range(n):
        want = None
        for j in range(k):
            xe = int(ids[t, j])
            gu = np.zeros((1, 2 * f), np.float32)
            qmatmul.mul_mat_q(x[t:t + 1], g[xe].reshape(f, -1), t8, gu[:, :f])
            qmatmul.mul_mat_q(x[t:t + 1], u[xe].reshape(f, -1), t8, gu[:, f:])
            h = np.zeros((1, f), np.float32)
            ops.swiglu(gu, h)
            y = np.zeros((1, e), np.float32)
            qmatmul.mul_mat_q(h, d[xe].reshape(e, -1), int(QT.F32), y)
            term = (y[0] * wts[t, j]).astype(np.float32)
            want = term if want is None else (want + term).astype(np.float32)
        np.testing.assert_array_equal(out[t], want, err_msg=f"token {t}")


def test_routing_and_the_shared_expert():
    rng = np.random.default_rng(5)
    n, e, n_exp, k = 4, 64, 6, 2
    logits = rng.standard_normal((n, n_exp)).astype(np.float32)
    p = np.exp(logits.astype(np.float64) - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    for norm, scale in ((True, 1.0), (False, 1.0), (True, 2.5)):
        ids, wts = moe.route(logits, k, norm, scale)
        want = np.argsort(-p, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(ids, want)
        w = np.take_along_axis(p, want, 1)
        if norm:
            w = w / w.sum(1, keepdims=True)
        np.testing.assert_allclose(wts, w * scale, rtol=1e-5)
    ids, _ = moe.route(np.zeros((1, n_exp), np.float32), 3)  # ties: the lower ids first
    assert ids.tolist() == [[0, 1, 2]]
    ids, _ = moe.route(np.full((1, n_exp), np.nan, np.float32), 3)  # NaN logits still give valid ids
    assert ids.tolist() == [[0, 1, 2]]
    # the shared expert's output is added, times sigmoid(x . gate)
    x = rng.standard_normal((n, e)).astype(np.float32)
    g, _ = _experts(rng, QT.F32, n_exp, 32, e)
    u, _ = _experts(rng, QT.F32, n_exp, 32, e)
    d, _ = _experts(rng, QT.F32, n_exp, e, 32)
    shexp = rng.standard_normal((n, e)).astype(np.float32)
    sgate = rng.standard_normal(e).astype(np.float32) / 8
    outs = []
    for extra in ((None, None), (shexp, None), (shexp, sgate)):
        o = np.zeros((n, e), np.float32)
        moe.moe_ffn(x, logits, g, 0, u, 0, d, 0, o, k, True, 1.0, extra[0], extra[1], 1)
        outs.append(o)
    np.testing.assert_allclose(outs[1], outs[0] + shexp, rtol=1e-5, atol=1e-6)
    sig = 1 / (1 + np.exp(-(x.astype(np.float64) @ sgate)))
    np.testing.assert_allclose(outs[2], outs[0] + sig[:, None] * shexp, rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_refused():
    x = np.zeros((2, 64), np.float32)
    logits = np.zeros((2, 4), np.float32)
    w = np.zeros((4, 32 * 64 * 4), np.uint8)
    dn = np.zeros((4, 64 * 32 * 4), np.uint8)
    out = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match="n_expert_used"):
        moe.moe_ffn(x, logits, w, 0, w, 0, dn, 0, out, 5)
    with pytest.raises(ValueError, match="experts"):
        moe.moe_ffn(x, logits, w[:3], 0, w, 0, dn, 0, out, 2)
    with pytest.raises(ValueError, match="down_exps"):
        moe.moe_ffn(x, logits, w, 0, w, 0, np.ascontiguousarray(dn[:, :-4]), 0, out, 2)
    with pytest.raises(ValueError, match="unsupported type"):
        moe.moe_ffn(x, logits, w, 99, w, 0, dn, 0, out, 2)
    # the op table: what the rpc server checks every node against
    F32 = DType.F32
    assert check_node(Op.MOE_FFN, F32, [F32] * 5, (2, 1, 1.0), {F32}) is None
    assert check_node(Op.MOE_FFN, F32, [F32, F32, DType.Q4_K, DType.Q4_K, DType.Q6_K], (2, 1, 1.0),
                      {F32, DType.Q4_K, DType.Q6_K}) is None
    assert "sources" in check_node(Op.MOE_FFN, F32, [F32] * 4, (2, 1, 1.0), {F32})
    assert "Q4_K" in check_node(Op.MOE_FFN, F32, [F32, F32, DType.Q4_K, F32, F32], (2, 1, 1.0), {F32})


def test_the_cpu_backend_runs_the_node():
    """MOE_FFN as a graph node: the router product, then the kernel, on 3-D expert tensors."""
    rng = np.random.default_rng(11)
    b = CPUBackend(1)
    n, e, f, n_exp, k = 3, 64, 32, 4, 2

    x = rng.standard_normal((n, e)).astype(np.float32)
    router = rng.standard_normal((n_exp, e)).astype(np.float32)
    g, u = (rng.standard_normal((n_exp, f, e)).astype(np.float32) for _ in range(2))
    d = rng.standard_normal((n_exp, e, f)).astype(np.float32)
    out = placed(b, DType.F32, (n, e))
    srcs = [placed(b, DType.F32, a.shape, a) for a in (x, router, g, u, d)]
    b.graph_compute(Graph([node(Op.MOE_FFN, out, *srcs, params=(k, 1, 1.0))]))
    want = np.zeros((n, e), np.float32)
    moe.moe_ffn(x, x @ router.T, g.reshape(n_exp, -1).view(np.uint8), 0, u.reshape(n_exp, -1).view(np.uint8), 0,
                d.reshape(n_exp, -1).view(np.uint8), 0, want, k)
    np.testing.assert_allclose(b.get_tensor(out), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="MOE_FFN"):  # a non-integer expert count
        b.graph_compute(Graph([node(Op.MOE_FFN, out, *srcs, params=(1.5, 1, 1.0))]))


def test_the_cpu_backend_multiplies_repackable_experts_in_groups_of_8():
    """Q8_0 experts through the node: the backend repacks them (one copy each) and its result is
    the kernel's on the repacked experts, bit for bit; with repacking off, the file layout's."""
    if int(QT.Q8_0) not in qmatmul.x8_types():
        pytest.skip("this build has no repacked kernels")
    rng = np.random.default_rng(12)
    n, e, f, n_exp, k = 5, 64, 32, 4, 2
    # quarters and 0/1 weights: the router's logits are exact whatever the order of the sums
    x = (rng.integers(-8, 9, (n, e)) / 4).astype(np.float32)
    router = rng.integers(0, 2, (n_exp, e)).astype(np.float32)
    g, _ = _experts(rng, QT.Q8_0, n_exp, f, e)
    u, _ = _experts(rng, QT.Q8_0, n_exp, f, e)
    d, _ = _experts(rng, QT.Q8_0, n_exp, e, f)
    logits = x @ router.T
    got = {}
    for repack in (True, False):
        b = CPUBackend(1)
        b.layout.repack = repack
        out = placed(b, DType.F32, (n, e))
        srcs = [placed(b, DType.F32, x.shape, x), placed(b, DType.F32, router.shape, router)]
        srcs += [placed(b, DType.Q8_0, (n_exp, rows, cols), raw) for raw, rows, cols in ((g, f, e), (u, f, e), (d, e, f))]
        b.graph_compute(Graph([node(Op.MOE_FFN, out, *srcs, params=(k, 1, 1.0))]))
        got[repack] = b.get_tensor(out).copy()
        assert b.layout.packed_weights() == (3 if repack else 0)
    pack = [qmatmul.repack_x8(raw.reshape(n_exp * rows, -1), int(QT.Q8_0), cols).reshape(n_exp, -1)
            for raw, rows, cols in ((g, f, e), (u, f, e), (d, e, f))]
    for repacked, (gg, uu, dd) in ((True, pack), (False, (g, u, d))):
        want = np.zeros((n, e), np.float32)
        moe.moe_ffn(x, logits, gg, int(QT.Q8_0), uu, int(QT.Q8_0), dd, int(QT.Q8_0), want, k, True, 1.0, None, None,
                    1, x8_gate_up=repacked, x8_down=repacked)
        np.testing.assert_array_equal(got[repacked], want)


def test_experts_read_in_place_stay_so_when_memory_is_short(monkeypatch, caplog):
    """Experts read in place from a model file are not all in memory until repacked (a token never
    pages in the experts it does not choose): with too little free memory the backend keeps their
    file layout, says so once, and computes what the file layout gives."""
    from pyllama.backend.cpu import memory
    if int(QT.Q8_0) not in qmatmul.x8_types():
        pytest.skip("this build has no repacked kernels")
    monkeypatch.setattr(memory, "available_memory", lambda: 1 << 20)
    rng = np.random.default_rng(13)
    n, e, f, n_exp, k = 4, 64, 32, 4, 2
    x = (rng.integers(-8, 9, (n, e)) / 4).astype(np.float32)
    router = rng.integers(0, 2, (n_exp, e)).astype(np.float32)
    experts = [_experts(rng, QT.Q8_0, n_exp, rows, cols)[0] for rows, cols in ((f, e), (f, e), (e, f))]
    b = CPUBackend(1)
    file = b.layout.map_host(np.concatenate([raw.reshape(-1) for raw in experts]))  # as a model file's map
    srcs, off = [placed(b, DType.F32, x.shape, x), placed(b, DType.F32, router.shape, router)], 0
    for raw, (rows, cols) in zip(experts, ((f, e), (f, e), (e, f))):
        srcs.append(Tensor(DType.Q8_0, (n_exp, rows, cols), "exps", file, off))
        off += raw.nbytes
    out = placed(b, DType.F32, (n, e))
    with caplog.at_level("WARNING"):
        b.graph_compute(Graph([node(Op.MOE_FFN, out, *srcs, params=(k, 1, 1.0))]))
    assert b.layout.packed_weights() == 0
    assert sum("not enough free memory to repack" in r.getMessage() for r in caplog.records) == 1
    want = np.zeros((n, e), np.float32)
    moe.moe_ffn(x, x @ router.T, *[a for raw in experts for a in (raw, int(QT.Q8_0))], want, k, True, 1.0, None, None, 1)
    np.testing.assert_array_equal(b.get_tensor(out), want)


# --- splits and refusals -----------------------------------------------------------------------------
@pytest.mark.parametrize("arch,wtype", [("qwen3moe", "f32"), ("qwen2moe", "q8_0"), ("mixtral", "f32")])
def test_tokens_identical_over_splits_and_groups(model_factory, rpc_peer, arch, wtype):
    model = model_factory("tiny", arch=arch, wtype=wtype)
    local = generated_tokens(model, PROMPT, 12)
    assert generated_tokens(model, PROMPT, 12, "--rpc", rpc_peer.endpoint, "--device", "RPC0,CPU") == local
    assert_same_tokens_in_two_groups(model, PROMPT, 12, local)


def test_a_server_without_the_op_is_refused_at_load(model_factory):
    """An rpc server that does not advertise MOE_FFN (an older build) gets no MoE layer: the load
    stops with one line naming the server; a dense model still runs on it."""
    model = model_factory("tiny", arch="qwen3moe")
    old = RPCServerProcess(env={"PYLLAMA_RPC_SERVER_CAPS": str(0xFFFF & ~int(Cap.MOE_FFN))})
    try:
        proc = run_generate(model, PROMPT, 12, "--rpc", old.endpoint, "--device", "RPC0,CPU")
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr
        assert "Mixture-of-Experts" in lines[0] and old.endpoint in lines[0], lines[0]
        dense = model_factory("tiny", arch="qwen3")
        assert generated_tokens(dense, PROMPT, 12, "--rpc", old.endpoint, "--device", "RPC0,CPU")
    finally:
        assert old.stop() == 0


def test_a_device_without_the_op_is_refused_at_load(model_factory):
    """A device that cannot run MOE_FFN (the CUDA backend: no kernel for it) is refused when the
    weights are placed, naming the device and its layers, before anything is allocated."""
    from pyllama.backend import cuda
    assert Op.MOE_FFN not in cuda.OP_KERNELS

    class NoMoE(CPUBackend):
        def supports(self, op: int) -> bool:
            return op != Op.MOE_FFN

    model = model_factory("tiny", arch="mixtral")
    with pytest.raises(PyllamaError, match=r"Mixture-of-Experts.*GPU0.*layers 0-1"):
        Engine(model, n_threads=1, backends=[NoMoE(1, name="GPU0")], tensor_split=[1])


def test_make_writes_llama_cpp_keys(model_factory):
    gf = GGUFFile(model_factory("tiny", arch="mixtral"))
    assert gf.get("general.architecture") == "llama"
    assert (gf.get("llama.expert_count"), gf.get("llama.expert_used_count")) == (6, 2)
    assert gf.tensors["blk.0.ffn_gate_exps.weight"].shape == (6, gf.get("llama.feed_forward_length"), 64)
    gf = GGUFFile(model_factory("tiny", arch="qwen2moe", wtype="q8_0"))
    assert gf.get("qwen2moe.expert_shared_feed_forward_length") == 128
    assert gf.tensors["blk.0.ffn_gate_inp.weight"].qtype == QT.F32  # the router is never quantized
    assert gf.tensors["blk.0.ffn_down_exps.weight"].qtype == QT.Q8_0
    assert os.path.getsize(model_factory("tiny", arch="qwen3moe")) > 0


def _split_experts(src: str, dst: str) -> None:
    """The Mixtral file `src` rewritten as converters before 3-D expert tensors wrote it: each
    expert's gate, up and down matrices as tensors of their own (blk.N.ffn_gate.E.weight ...)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter  # noqa: PLC0415
    r = GGUFReader(src)
    w = GGUFWriter(dst, r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub)
    for t in r.tensors:
        data = np.asarray(t.data)
        if "_exps." in t.name:
            base = t.name.replace("_exps.weight", "")
            for x in range(data.shape[0]):
                w.add_tensor(f"{base}.{x}.weight", np.ascontiguousarray(data[x]), raw_dtype=t.tensor_type)
        else:
            w.add_tensor(t.name, np.ascontiguousarray(data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("wtype", ["f32", "q8_0"])
def test_experts_stored_one_tensor_each_load_as_the_3d_tensors(model_factory, tmp_path, wtype):
    """Older Mixtral files hold each expert's matrix alone: the loader stacks them, and the model
    computes what the same weights as 3-D tensors compute."""
    src = model_factory("tiny", arch="mixtral", wtype=wtype)
    dst = str(tmp_path / "split.gguf")
    _split_experts(src, dst)
    split = GGUFFile(dst).tensors
    assert "blk.0.ffn_gate.0.weight" in split and "blk.0.ffn_gate_exps.weight" not in split
    want = generated_tokens(src, "Once upon a time", 8)
    assert generated_tokens(dst, "Once upon a time", 8) == want
    assert generated_tokens(dst, "Once upon a time", 8, "--no-repack") == want
