"""The kernels' worker pool (ggml_quants.h pq_pool_run) shared by concurrent callers: each caller
publishes its job in a slot of its own, the pool's helpers take items of every published job, and
a caller waits only for its own items. Kernels run from several threads at once give exactly the
results of the same calls made one at a time; every item of every job runs exactly once, on its
caller or on a helper, never on another caller; a forked child starts a pool of its own."""
import os
import threading
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import quant_reference as ref

qmatmul = pytest.importorskip("pyllama._fast.qmatmul", reason="Cython extensions not built (python setup.py build_ext --inplace)")
from pyllama._fast import gemm, ops  # noqa: E402

K = 768


def _workloads(rng):
    """(name, call(out), expected shape) for pooled kernels of a few sizes: products split into
    several tiles, a batch quantized in parallel, F32 decode products, RMS norm over many rows."""
    calls = []
    for qtype, m in ((T.Q4_K, 700), (T.Q8_0, 300)):
        w = ref.random_weights(qtype, m, K, rng)
        for n in (1, 9, 40):
            x = rng.standard_normal((n, K)).astype(np.float32)
            calls.append((f"{qtype.name} n={n}", (n, m),
                          lambda o, x=x, w=w, t=int(qtype): qmatmul.mul_mat_q(x, w, t, o, n_threads=2)))
    wf = rng.standard_normal((1000, K)).astype(np.float32)
    for n in (1, 4):
        x = rng.standard_normal((n, K)).astype(np.float32)
        calls.append((f"F32 n={n}", (n, 1000), lambda o, x=x: gemm.mul_mat_t(x, wf, o, None, 2)))
    xn = rng.standard_normal((64, 4096)).astype(np.float32)
    g = rng.standard_normal(4096).astype(np.float32)
    calls.append(("rms_norm", xn.shape, lambda o: ops.rms_norm(xn, g, o, 1e-5, 2)))
    return calls


def test_concurrent_callers_get_the_results_of_calls_made_one_at_a_time():
    rng = np.random.default_rng(5)
    calls = _workloads(rng)
    want = []
    for _, shape, call in calls:
        o = np.full(shape, np.nan, np.float32)
        call(o)
        want.append(o)
    failures, counts = [], []
    start = threading.Barrier(4)
    stop_at = time.monotonic() + 1.5

    def worker(seed):
        order = np.random.default_rng(seed)
        outs = [np.empty(shape, np.float32) for _, shape, _ in calls]
        start.wait()
        done = 0
        while time.monotonic() < stop_at:
            for i in order.permutation(len(calls)):
                outs[i].fill(np.nan)
                calls[i][2](outs[i])
                if not np.array_equal(outs[i], want[i]):
                    failures.append(calls[i][0])
                done += 1
        counts.append(done)
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert len(counts) == 4 and min(counts) > 0


def _helpers():
    """OS thread ids of this process's pool helpers."""
    out = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "kernel-pool":
                    out.add(int(tid))
        except OSError:
            pass
    return out


def _trace(n_items, busy_ns=0):
    """One traced job on the pool (n_threads=2): (who, runs, when) of its items."""
    who, runs, when = np.zeros(n_items, np.int32), np.zeros(n_items, np.int32), np.zeros(n_items, np.int64)
    qmatmul._pool_trace(2, who, runs, when, busy_ns)
    return who, runs, when


def _trace_round(n_callers, n_items, busy_ns):
    """n_callers threads each run one traced job at once: [(caller tid, who, runs, when)]."""
    start = threading.Barrier(n_callers)
    results = [None] * n_callers

    def caller(c):
        start.wait()
        results[c] = (threading.get_native_id(),) + _trace(n_items, busy_ns)
    threads = [threading.Thread(target=caller, args=(c,)) for c in range(n_callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_two_concurrent_callers_share_the_helpers():
    """Two callers at once, items of 20 us: every item runs once, on its caller or a helper, and
    while both jobs are live helpers take items of both (tried for a few rounds: the two Python
    threads may not overlap, or the OS may not run a helper while they do)."""
    _trace(8)  # the helper exists
    shared = False
    deadline = time.monotonic() + 5
    while not shared and time.monotonic() < deadline:
        results = _trace_round(2, 200, 20000)
        helpers = _helpers()
        assert helpers
        for tid, who, runs, _ in results:
            np.testing.assert_array_equal(runs, 1)
            ran_on = set(who.tolist())
            assert ran_on <= helpers | {tid}, (ran_on, helpers, tid)
        # the time both jobs were live, and whether a helper started an item of each within it
        lo = max(when.min() for _, _, _, when in results)
        hi = min(when.max() for _, _, _, when in results)
        shared = lo < hi and all(
            any(w in helpers and lo <= t <= hi for w, t in zip(who.tolist(), when.tolist()))
            for _, who, _, when in results)
    assert shared


def test_more_callers_than_slots_run_every_item_once():
    """12 callers for 8 slots: those without a slot run their items alone, the others share the
    helpers; each item still runs exactly once, never on another caller."""
    for _ in range(5):
        results = _trace_round(12, 64, 5000)
        helpers = _helpers()
        for tid, who, runs, _ in results:
            np.testing.assert_array_equal(runs, 1)
            assert set(who.tolist()) <= helpers | {tid}


def test_a_forked_child_starts_its_own_pool():
    _trace(8)
    assert _helpers()
    rng = np.random.default_rng(9)
    w = ref.random_weights(T.Q4_K, 700, K, rng)
    x = rng.standard_normal((9, K)).astype(np.float32)
    want = np.empty((9, 700), np.float32)
    qmatmul.mul_mat_q(x, w, int(T.Q4_K), want, n_threads=1)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ok = True
            for _ in range(50):
                o = np.full_like(want, np.nan)
                qmatmul.mul_mat_q(x, w, int(T.Q4_K), o, n_threads=2)
                ok &= bool(np.array_equal(o, want))
                ok &= bool((_trace(100, 2000)[1] == 1).all())
            code = 0 if ok and _helpers() else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's pool did not finish")
        time.sleep(0.01)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
