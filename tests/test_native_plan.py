"""The CPU backend binds a graph's kernels as NativeSteps and runs stretches of them in one call
without the GIL (`_fast/plan.pyx`): the results must be those of the same nodes run one by one as
Python callables, per-step data out of range must give the op's own error, and the steps must
really run without the GIL."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pyllama._fast import gemm, ops, ops_extra, qmatmul
from pyllama._fast.plan import NativeRun, NativeStep
from pyllama.backend.cpu import CPUBackend
from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
from pyllama.util.settings import CpuSettings


def _decode_logits(path: str, native: bool, one_run: bool = False) -> list[np.ndarray]:
    """A prompt, then 3 steps of 4 sequences: every step's logits."""
    engine = Engine(path, n_threads=2, backends=[CPUBackend(2, settings=CpuSettings(native=native))])
    try:
        ctx = engine.new_context(256, 4)
        outs = [ctx.decode(Batch.for_sequence(list(range(5, 25)), 0, 0)).logits.copy()]
        for s in range(1, 4):
            outs.append(ctx.decode(Batch.for_sequence([7 + s, 9], 0, s)).logits.copy())
        for step in range(3):
            toks = [11 + step + s for s in range(4)]
            pos = [20 + step] + [2 + step] * 3
            b = Batch(np.array(toks), np.array(pos), np.arange(4), np.ones(4, bool))
            outs.append(ctx.decode(b).logits.copy())
        if native:
            plans = [p for p in engine.backends[0]._plans.values()]
            assert plans and any(isinstance(step, NativeRun) for p in plans for step in p)
            if one_run:  # every node had a C form: one run per graph
                assert all(len(p) == 1 and isinstance(p[0], NativeRun) for p in plans)
        else:  # the backend's settings say Python callables: no node ran natively
            plans = [p for p in engine.backends[0]._plans.values()]
            assert plans and not any(isinstance(step, (NativeRun, NativeStep)) for p in plans for step in p)
        return outs
    finally:
        engine.close()


@pytest.mark.parametrize("preset,wtype", [("tiny", "f32"), ("tiny", "q4_0"), ("tiny256", "q4_k_m"),
                                          ("small", "q5_k_m")])
def test_native_runs_give_the_python_steps_results(model_factory, preset, wtype):
    path = model_factory(preset, wtype=wtype)
    native = _decode_logits(path, True)
    python = _decode_logits(path, False)
    assert len(native) == len(python)
    for a, b in zip(native, python):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("arch,wtype", [("mixtral", "f32"), ("qwen2moe", "q8_0"), ("qwen3moe", "q4_0")])
def test_moe_graphs_run_natively_with_the_python_steps_results(model_factory, arch, wtype):
    """MOE_FFN (router product and experts) binds too: a MoE graph is one run."""
    path = model_factory("tiny", arch=arch, wtype=wtype)
    native = _decode_logits(path, True, one_run=True)
    python = _decode_logits(path, False)
    for a, b in zip(native, python):
        np.testing.assert_array_equal(a, b)


def test_a_decode_graph_is_one_native_run_and_its_sampling(model_factory):
    """Every node of a dense model's graph but SAMPLE has a C form: the bound plan is one run
    (plus the sampling step when the graph samples)."""
    engine = Engine(model_factory("tiny256", wtype="q4_k_m"), n_threads=1,
                    backends=[CPUBackend(1, settings=CpuSettings(native=True))])
    try:
        ctx = engine.new_context(64, 1)
        ctx.decode(Batch.for_sequence([5, 6, 7], 0, 0))
        cpu = engine.backends[0]
        (plan,) = cpu._plans.values()
        assert len(plan) == 1 and isinstance(plan[0], NativeRun)
        # per layer at least the norms, products, attention, GLU and residual adds
        assert len(plan[0]) >= 8 * engine.model.hparams.n_layer
    finally:
        engine.close()


def _attention_args(n=2, L=5, H=4, Hkv=2, hd=32):
    rng = np.random.default_rng(3)
    n_cells = n * (L + 1)
    kc = rng.standard_normal((n_cells, Hkv * hd)).astype(np.float32)
    vc = rng.standard_normal((n_cells, Hkv * hd)).astype(np.float32)
    qkv = rng.standard_normal((n, (H + 2 * Hkv) * hd)).astype(np.float32)
    pos = np.full(n, L, np.int32)
    kv_idx = (np.arange(n, dtype=np.int32) * (L + 1) + L).astype(np.int32)
    cells = np.arange(n_cells, dtype=np.int32)
    ranges = np.stack([np.arange(n) * (L + 1), np.full(n, L + 1)], 1).astype(np.int32)
    e = np.zeros(0, np.float32)
    out = np.zeros((n, H * hd), np.float32)
    return (qkv, kc, vc, pos, kv_idx, cells, ranges, e, e, out, H, Hkv, hd, hd, 2, 10000.0, 1.0, 1e-5, 0.125, 2)


def _run(binder, python_fn, *args):
    step = binder(lambda: python_fn(*args), *args)
    assert isinstance(step, NativeStep)
    return NativeRun([step])


def test_attention_data_out_of_range_raises_the_ops_own_error():
    args = _attention_args()
    run = _run(ops.bind_attention, ops.attention, *args)
    run()  # in range: computes
    out = args[9].copy()
    args[9][:] = 0
    ops.attention(*args)
    np.testing.assert_array_equal(args[9], out)
    args[4][1] = 10_000  # a KV cell outside the cache, written after binding (per-step data)
    with pytest.raises(ValueError, match="cell 10000 outside the cache of 12"):
        run()
    args[4][1] = 11
    args[6][0, 1] = 99  # a token's list running past the listed cells
    with pytest.raises(ValueError, match=r"token 0 attends to cells \[0, 99\) outside the list of 12"):
        run()
    args[6][0, 1] = 6
    args[5][3] = -1  # a listed cell outside the cache
    with pytest.raises(ValueError, match="listed cell -1 outside the cache"):
        run()


def test_get_rows_ids_out_of_range_raise_the_ops_own_error():
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    ids = np.array([1, 3], np.int32)
    out = np.zeros((2, 3), np.float32)
    step = ops_extra.bind_get_rows_f32(lambda: np.take(table, ids, axis=0, out=out, mode="raise"), table, ids, out)
    run = NativeRun([step])
    run()
    np.testing.assert_array_equal(out, table[[1, 3]])
    ids[1] = 4
    with pytest.raises(IndexError):
        run()

    w = np.zeros((4, qmatmul.row_bytes(8, 32)), np.uint8)  # Q8_0 rows of 32
    outq = np.zeros((2, 32), np.float32)
    ids_q = np.array([0, 2], np.int32)
    runq = _run(qmatmul.bind_get_rows_q, qmatmul.get_rows_q, w, 8, ids_q, outq, 1)
    runq()
    ids_q[0] = -1
    with pytest.raises(ValueError, match="id -1 at position 0 is outside 0..3"):
        runq()


def test_a_step_after_a_refused_one_still_runs():
    """The run goes on after the step it handed to Python (which computed it)."""
    a = np.ones((2, 4), np.float32)
    b = np.full((2, 4), 2, np.float32)
    out1 = np.zeros_like(a)
    out2 = np.zeros_like(a)
    calls = []

    def checked():
        calls.append(1)
        np.add(a, b, out=out1)
    table = np.arange(8, dtype=np.float32).reshape(2, 4)
    ids = np.array([5, 0], np.int32)  # out of range: its run hands it to `checked`
    take = ops_extra.bind_get_rows_f32(checked, table, ids, out1)
    add = ops_extra.bind_add(lambda: np.add(a, b, out=out2), a, b, out2)
    NativeRun([take, add])()
    assert calls == [1]
    np.testing.assert_array_equal(out1, a + b)
    np.testing.assert_array_equal(out2, a + b)


def test_binders_decline_what_their_kernels_do_not_take():
    a = np.ones((2, 4), np.float32)
    assert ops_extra.bind_add(lambda: None, a, np.ones(4, np.float32), a) is None  # broadcasting
    assert ops_extra.bind_add(lambda: None, a.astype(np.float64), a, a) is None
    e = np.zeros((0, 4), np.float32)
    assert ops.bind_rms_norm(lambda: None, e, np.ones(4, np.float32), e, 1e-5) is None
    with pytest.raises(ValueError, match="rms_norm: shapes"):
        ops.bind_rms_norm(lambda: None, a, np.ones(3, np.float32), a, 1e-5)
    w = np.zeros((8, 4), np.float32)
    with pytest.raises(ValueError, match="mul_mat_t: x has 4 columns, w has 3"):
        gemm.bind_mul_mat_t(lambda: None, a, np.zeros((8, 3), np.float32), np.zeros((2, 8), np.float32))
    assert gemm.bind_mul_mat_t(lambda: None, a, w, np.zeros((2, 8), np.float32)) is not None


def test_products_share_the_runs_scratch_and_match_their_functions():
    """Two quantized products and a float one in one run (one scratch for all): the results of
    each function called alone."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    w8 = qmatmul.quantize_rows(rng.standard_normal((16, 256)).astype(np.float32), 8)  # Q8_0 rows
    wf = rng.standard_normal((12, 256)).astype(np.float32)
    outs = [np.zeros((5, 16), np.float32), np.zeros((5, 12), np.float32), np.zeros((5, 16), np.float32)]
    steps = [qmatmul.bind_mul_mat_q(None, x, w8, 8, outs[0], None, 2),
             gemm.bind_mul_mat_t(None, x, wf, outs[1], None, 2)]
    if 8 in qmatmul.x8_types():
        packed = qmatmul.repack_x8(w8, 8, 256)
        steps.append(qmatmul.bind_mul_mat_q_x8_parts(None, x, [packed], [8], outs[2], None, 2))
    NativeRun(steps)()
    want = np.zeros((5, 16), np.float32)
    qmatmul.mul_mat_q(x, w8, 8, want, None, 2)
    np.testing.assert_array_equal(outs[0], want)
    want_f = np.zeros((5, 12), np.float32)
    gemm.mul_mat_t(x, wf, want_f, None, 2)
    np.testing.assert_array_equal(outs[1], want_f)
    if len(steps) == 3:
        want_x8 = np.zeros((5, 16), np.float32)
        qmatmul.mul_mat_q_x8(x, packed, 8, want_x8, None, 2)
        np.testing.assert_array_equal(outs[2], want_x8)


def test_a_run_releases_the_gil_while_it_computes():
    """A Python thread counts while a long run computes: were the GIL held through the run, it
    could not count at all until the run returned."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 2048)).astype(np.float32)
    w = rng.standard_normal((2048, 2048)).astype(np.float32)
    out = np.zeros((32, 2048), np.float32)
    run = NativeRun([gemm.bind_mul_mat_t(None, x, w, out, None, 1)] * 20)
    box = [0]
    stop = threading.Event()

    def count():
        while not stop.is_set():
            box[0] += 1
    th = threading.Thread(target=count)
    th.start()
    try:
        time.sleep(0.01)
        before = box[0]
        run()
        during = box[0] - before
    finally:
        stop.set()
        th.join()
    assert during > 1000
