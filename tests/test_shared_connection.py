"""One RPC connection shared by two contexts (two pipeline groups): a decode step that fails in a
later micro-batch must not leave a reply uncollected on the connection, which would stall every
other user of it; and the connection itself never waits forever for a turn that nobody takes."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from pyllama.backend.cpu import CPUBackend
from pyllama.backend.rpc import RPCBackend
from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
from pyllama.util.errors import ContextLimitError
from pyllama.rpc.connection import Connection, RPCError
from pyllama.rpc.protocol import U32, Cmd
from pyllama.rpc_server.server import ServerThread

RPC_TIMEOUT = 5.0
WITHIN = RPC_TIMEOUT + 5.0  # what "finishes within the RPC timeout" allows a loaded machine


def run_in_thread(fn) -> tuple[threading.Thread, list]:
    box: list = []

    def run() -> None:
        try:
            box.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001
            box.append(("error", exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


@pytest.fixture()
def shared(tiny_model):
    """An in-process rpc server holding the output layer, and an engine over CPU + that peer."""
    with ServerThread() as st:
        conn = Connection(f"127.0.0.1:{st.port}", timeout=RPC_TIMEOUT)
        engine = Engine(tiny_model, n_threads=1, backends=[CPUBackend(1), RPCBackend(conn, 0, "RPC0")],
                        tensor_split=[1, 1])
        assert engine.placement.backends[engine.placement.backend_of_layer(engine.model.hparams.n_layer)].name == "RPC0"
        try:
            yield engine, conn
        finally:
            conn.close()  # wakes a thread left waiting by a failure of this test
            engine.close()


def test_a_micro_batch_that_fails_leaves_no_reply_behind(shared):
    engine, conn = shared
    prompt = [1 + (5 * j) % 200 for j in range(6)]
    want = engine.new_context(64, 1).decode(Batch.for_sequence(prompt, 0)).logits.copy()

    # group A: a unified pool of 32 cells (two blocks of 16) that another sequence half fills; its
    # step of 24 tokens, every one asking for logits, is two micro-batches of 16 and 8: the first
    # runs and queues its logits read on the shared connection, the second finds the pool full
    ctx_a = engine.new_context(32, 2, n_ubatch=16, kv_unified=True)
    ctx_a.decode(Batch.for_sequence([3] * 10, 0, seq=1))
    ctx_b = engine.new_context(64, 1)
    step = Batch.for_sequence([7 + j for j in range(24)], 0, seq=0, all_logits=True)
    ta, got_a = run_in_thread(lambda: ctx_a.decode(step))
    ta.join(WITHIN)
    assert not ta.is_alive(), "the failing step itself hung"
    assert got_a and got_a[0][0] == "error", got_a
    assert isinstance(got_a[0][1], ContextLimitError) and "KV cache is full" in str(got_a[0][1])

    # group B, on another thread, shares the connection: it is served normally, at once
    tb, got_b = run_in_thread(lambda: ctx_b.decode(Batch.for_sequence(prompt, 0)).logits.copy())
    tb.join(WITHIN)
    assert not tb.is_alive(), "the other group hangs on the shared connection"
    assert got_b[0][0] == "ok", got_b
    np.testing.assert_array_equal(got_b[0][1], want)
    assert not conn.broken

    # and group A recovers: its pool is as before the failed step (all-or-nothing per micro-batch
    # leaves the first one's cells, which the caller removes), and it decodes again
    ctx_a.seq_rm(0)
    out = ctx_a.decode(Batch.for_sequence(prompt, 0, seq=0))
    np.testing.assert_array_equal(out.logits, want)


def test_a_turn_nobody_takes_breaks_the_connection_within_the_timeout(shared, monkeypatch):
    """The connection's own guard: a ticket whose owner never collects it (a bug) fails the
    connection after the RPC timeout instead of stalling every later reply forever."""
    _, conn = shared
    conn.timeout = 1.0
    lost = conn.send(Cmd.SYNCHRONIZE, [U32.pack(0)])  # taken, never received
    t, box = run_in_thread(lambda: conn.call(Cmd.SYNCHRONIZE, U32.pack(0)))
    t.join(WITHIN)
    assert not t.is_alive(), "a waiter behind an uncollected reply hangs"
    assert box[0][0] == "error" and isinstance(box[0][1], RPCError), box
    assert "never collected" in str(box[0][1]) and conn.broken
    assert lost is not None


def test_a_cancelled_ticket_is_skipped(shared):
    """cancel(ticket): its reply is read and dropped by whoever comes next; the others are served."""
    _, conn = shared
    a = conn.send(Cmd.SYNCHRONIZE, [U32.pack(0)])
    b = conn.send(Cmd.SYNCHRONIZE, [U32.pack(0)])
    conn.cancel(a)
    t, box = run_in_thread(lambda: conn.receive(b, Cmd.SYNCHRONIZE))
    t.join(WITHIN)
    assert not t.is_alive() and box[0][0] == "ok", box
    assert conn.call(Cmd.SYNCHRONIZE, U32.pack(0)) == b"" and not conn.broken
