"""A step of several micro-batches over a layer split goes through the stages as a wavefront:
micro-batch u + 1 is issued to a stage that computes asynchronously (a peer) before micro-batch u
runs on the next stage, so both devices work at once on a long prompt. The results do not change."""
from __future__ import annotations

import numpy as np
import pytest

from pyllama.backend.cpu import CPUBackend
from pyllama.backend.rpc import RPCBackend
from pyllama.runtime.context import Batch, Context
from pyllama.runtime.engine import Engine
from pyllama.models.model import Model
from pyllama.rpc.connection import Connection
from pyllama.runtime.sched import Scheduler
from pyllama.models.weights import Placement, load_weights, split_layers

PROMPT = [256, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # 3 micro-batches of 4, 4 and 3 tokens


class _Logged(CPUBackend):
    """A host device that logs its graphs; `compute_async` / `in_order` as a test sets them."""

    def __init__(self, name: str, log: list[str], compute_async: bool = False, in_order: bool = True):
        super().__init__(1, name)
        self.log = log
        self.compute_async = compute_async
        self.in_order = in_order

    def graph_compute(self, graph, reads=()):
        self.log.append(self.name)
        super().graph_compute(graph, reads)


def _context(path: str, backends: list, n_ubatch: int = 4) -> Context:
    model = Model(path)
    placement = Placement(backends, split_layers(model.hparams.n_layer, [1] * len(backends)))
    return Context(model, load_weights(model, placement), placement, 64, 1, 64, n_ubatch)


def _prompt_logits(ctx: Context) -> np.ndarray:
    return ctx.decode(Batch.for_sequence(PROMPT, 0, 0, all_logits=True)).logits.copy()


def test_a_peer_stage_takes_the_next_micro_batch_before_the_local_stage_runs(tiny_model):
    log: list[str] = []
    ctx = _context(tiny_model, [_Logged("A", log, compute_async=True), _Logged("B", log)])
    got = _prompt_logits(ctx)
    # round 0: A(u0); round 1: A(u1) issued, then B(u0); round 2: A(u2), B(u1); round 3: B(u2)
    assert log == ["A", "A", "B", "A", "B", "B"]
    one = _prompt_logits(_context(tiny_model, [CPUBackend(1)]))
    np.testing.assert_allclose(got, one, rtol=0, atol=1e-5)


def test_the_wavefront_gives_the_sequential_results_exactly(tiny_model, monkeypatch):
    wave = _prompt_logits(_context(tiny_model, [_Logged("A", [], compute_async=True), _Logged("B", [])]))
    monkeypatch.setattr(Scheduler, "_wavefront_ok", staticmethod(lambda jobs: False))
    log: list[str] = []
    ctx = _context(tiny_model, [_Logged("A", log, compute_async=True), _Logged("B", log)])
    seq = _prompt_logits(ctx)
    assert log == ["A", "B"] * 3
    np.testing.assert_array_equal(wave, seq)
    # the KV cache the micro-batches wrote is the same: the next token's logits agree too
    nxt = Batch.for_sequence([42], len(PROMPT), 0)
    np.testing.assert_array_equal(ctx.decode(nxt).logits, _wave_next(tiny_model, nxt))


def _wave_next(path: str, nxt: Batch) -> np.ndarray:
    ctx = _context(path, [_Logged("A", [], compute_async=True), _Logged("B", [])])
    _prompt_logits(ctx)
    return ctx.decode(nxt).logits


@pytest.mark.parametrize("why", ["out of order", "one micro-batch", "one device"])
def test_no_wavefront_where_it_does_not_apply(tiny_model, why):
    log: list[str] = []
    if why == "out of order":  # a device that may run a later write before an earlier graph
        ctx = _context(tiny_model, [_Logged("A", log, compute_async=True, in_order=False), _Logged("B", log)])
        _prompt_logits(ctx)
        assert log == ["A", "B"] * 3
    elif why == "one micro-batch":
        ctx = _context(tiny_model, [_Logged("A", log, compute_async=True), _Logged("B", log)], n_ubatch=64)
        _prompt_logits(ctx)
        assert log == ["A", "B"]
    else:
        ctx = _context(tiny_model, [_Logged("A", log, compute_async=True)])
        _prompt_logits(ctx)
        assert log == ["A"] * 3


@pytest.mark.parametrize("order", ["RPC0,CPU", "CPU,RPC0"])
def test_a_long_prompt_over_a_real_split(tiny_model, rpc_peer, order):
    """Over an rpc peer the micro-batches overlap (the peer's graphs are sent ahead of the local
    stage) and the prompt's logits and the tokens generated after it equal one device's."""
    log: list[str] = []
    conn = Connection(rpc_peer.endpoint)
    try:
        rpc = RPCBackend(conn)
        cpu = _Logged("CPU", log)
        engine = Engine(tiny_model, n_threads=1, backends=[rpc, cpu] if order == "RPC0,CPU" else [cpu, rpc],
                        tensor_split=[1, 1])
        ctx = engine.new_context(64, 1, n_batch=64, n_ubatch=4)
        stream = ctx.sched.streams[engine.backends.index(rpc)]  # the context's lane to the peer
        real = stream.graph_compute

        def logged(graph, reads=()):
            log.append("RPC0")
            real(graph, reads)
        stream.graph_compute = logged  # type: ignore[method-assign]
        got = ctx.decode(Batch.for_sequence(PROMPT, 0, 0, all_logits=True)).logits.copy()
        if order == "RPC0,CPU":
            assert log == ["RPC0", "RPC0", "CPU", "RPC0", "CPU", "CPU"]
        else:  # a peer last: its stage of u is issued before the local stage of u + 1 runs, as
            # it was one micro-batch after the other
            assert log == ["CPU", "RPC0", "CPU", "RPC0", "CPU", "RPC0"]
        toks = [int(got[-1].argmax())]
        for i in range(6):
            toks.append(int(ctx.decode(Batch.for_sequence([toks[-1]], len(PROMPT) + i, 0)).logits[-1].argmax()))
        engine.close()
    finally:
        conn.close()
    alone = Engine(tiny_model, n_threads=1)
    ctx1 = alone.new_context(64, 1, n_batch=64, n_ubatch=64)
    want = ctx1.decode(Batch.for_sequence(PROMPT, 0, 0, all_logits=True)).logits.copy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    want_toks = [int(want[-1].argmax())]
    for i in range(6):
        want_toks.append(int(ctx1.decode(Batch.for_sequence([want_toks[-1]], len(PROMPT) + i, 0)).logits[-1].argmax()))
    alone.close()
    assert toks == want_toks


def test_the_bench_turns_the_wavefront_off_only_inside_its_one_by_one_arm(tiny_model):
    import importlib.util
    import os
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "split_prompt.py")
    spec = importlib.util.spec_from_file_location("split_prompt", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    log: list[str] = []
    ctx = _context(tiny_model, [_Logged("A", log, compute_async=True), _Logged("B", log)])
    with bench.one_by_one():
        _prompt_logits(ctx)
    assert log == ["A", "B"] * 3
    log.clear()
    ctx.seq_rm(0, 0)
    _prompt_logits(ctx)
    assert log == ["A", "A", "B", "A", "B", "B"]


def test_a_peer_lost_in_the_middle_of_the_wave_is_one_error_and_keeps_no_staging(tiny_model, rpc_peer):
    """The connection breaks when the second micro-batch is issued to the peer (the first one's
    hand-over is then in the arena): the decode raises the connection's error, and no staging
    region stays reserved."""
    from pyllama.rpc.connection import RPCError
    conn = Connection(rpc_peer.endpoint)
    try:
        rpc = RPCBackend(conn)
        engine = Engine(tiny_model, n_threads=1, backends=[rpc, CPUBackend(1)], tensor_split=[1, 1])
        ctx = engine.new_context(64, 1, n_batch=64, n_ubatch=4)
        stream = ctx.sched.streams[0]  # the context's lane to the peer
        real = stream.graph_compute
        calls = []

        def breaking(graph, reads=()):
            calls.append(1)
            if len(calls) == 2:
                conn.close()  # the session, and its lanes with it
            real(graph, reads)
        stream.graph_compute = breaking  # type: ignore[method-assign]
        with pytest.raises(RPCError):
            ctx.decode(Batch.for_sequence(PROMPT, 0, 0, all_logits=True))
        assert len(calls) == 2
        assert conn._arena is None or conn.arena.outstanding == 0
    finally:
        conn.close()


def _drop_compute_buffers(ctx: Context) -> None:
    sched = ctx.sched
    for i, buf in enumerate(sched.buffers):
        if buf is not None:
            sched.backends[i].free_buffer(buf)
        sched.buffers[i] = None
    sched.generation += 1  # every plan placed in them is stale


def test_a_later_micro_batch_that_grows_a_buffer_replaces_the_earlier_plans(tiny_model, rpc_peer):
    """All micro-batches are placed before the first runs. When placing a later one grows a
    compute buffer, the buffer the earlier ones were placed in is freed (on the peer here), so
    they are placed again: the output layer on the peer, the compute buffers dropped, and the
    last micro-batch (the row that wants logits) needing more there than those before it."""
    conn = Connection(rpc_peer.endpoint)
    try:
        engine = Engine(tiny_model, n_threads=1, backends=[CPUBackend(1), RPCBackend(conn)], tensor_split=[1, 1])
        ctx = engine.new_context(64, 1, n_batch=64, n_ubatch=4)
        sched = ctx.sched
        prompt = PROMPT + [15]  # micro-batches (4 tokens, 0 outputs) twice, then (4, 1)
        assert ctx._plan(4, 0).peaks[1] < ctx._plan(4, 1).peaks[1]
        _drop_compute_buffers(ctx)  # as if nothing had sized them for the worst case
        before = sched.generation
        got = ctx.decode(Batch.for_sequence(prompt, 0, 0)).logits[-1].copy()
        assert sched.generation > before + 1  # the (4, 1) plan grew the peer's buffer after (4, 0)'s
        engine.close()
    finally:
        conn.close()
    alone = Engine(tiny_model, n_threads=1)
    want = alone.new_context(64, 1, n_batch=64, n_ubatch=64).decode(Batch.for_sequence(prompt, 0, 0)).logits[-1]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    alone.close()
