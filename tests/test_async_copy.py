"""Asynchronous split copies: the per-connection staging arena, and greedy output unchanged with the
copies on or off, with one or two groups sharing the peer, the output layer local or remote."""
from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from pyllama.backend.cpu import CPUBackend
from pyllama.backend.rpc import RPCBackend
from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
from pyllama.rpc.connection import Connection
from pyllama.rpc.staging import ALIGN, StagingArena, arena_size
from pyllama.util.errors import PyllamaError
from server_util import ServerProcess


# --- the arena ----------------------------------------------------------------------------------

def test_regions_in_order_and_a_wrap_waits_for_every_region():
    arena = StagingArena(4 * ALIGN)
    a = arena.reserve(ALIGN)
    b = arena.reserve(2 * ALIGN - 8)  # rounded up to the alignment
    assert (a.start, b.start) == (0, ALIGN) and len(b.view) == 2 * ALIGN - 8
    # this thread holds regions: a wrap would wait for itself, so it is refused, not waited for
    assert arena.reserve(2 * ALIGN) is None
    got = []

    def other():  # another group's thread waits until every region is released
        r = arena.reserve(2 * ALIGN)
        got.append(r.start)
        r.release()

    t = threading.Thread(target=other)
    t.start()
    time.sleep(0.1)
    assert not got, "a wrap did not wait for the outstanding regions"
    a.release()
    time.sleep(0.05)
    assert not got, "a wrap went ahead while a region was still reserved"
    b.release()
    t.join(5)
    # the ring went back to its start twice: for the waiter, and after the waiter's release
    assert got == [0] and arena.wraps == 2 and arena.outstanding == 0
    assert arena.reserve(5 * ALIGN) is None  # can never fit
    b.release()  # releasing twice is harmless
    assert arena.outstanding == 0


def test_the_ring_starts_over_when_no_region_is_reserved():
    """One group's step reserves a region and releases it before the next step: every region then
    starts at the arena's start, so a server touches only the first pages of its arena instead of
    walking all of it (memory touched for the first time costs a page fault on the decode path)."""
    arena = StagingArena(64 * ALIGN)
    starts = []
    for _ in range(10):
        r = arena.reserve(3 * ALIGN)
        starts.append(r.start)
        r.release()
    assert starts == [0] * 10
    # while a region is reserved the next one comes after it, and the ring goes on from there
    a = arena.reserve(ALIGN)
    b = arena.reserve(ALIGN)
    a.release()
    c = arena.reserve(ALIGN)
    assert (a.start, b.start, c.start) == (0, ALIGN, 2 * ALIGN)
    b.release()
    c.release()
    assert arena.reserve(ALIGN).start == 0


def test_close_wakes_waiters():
    arena = StagingArena(2 * ALIGN)
    held = arena.reserve(2 * ALIGN)
    errors = []

    def waiter():
        try:
            arena.reserve(ALIGN)
        except RuntimeError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    arena.close()
    t.join(5)
    assert not t.is_alive() and errors and "closed" in errors[0]
    held.release()


def test_live_regions_never_overlap_under_contention():
    arena = StagingArena(16 * ALIGN)
    owner = np.full(16 * ALIGN, -1, dtype=np.int64)
    lock = threading.Lock()
    failures = []

    def worker(k: int) -> None:
        rng = random.Random(k)
        for _ in range(300):
            r = arena.reserve(rng.randint(1, 6 * ALIGN))
            if r is None:
                failures.append("None without holding a region")
                return
            span = slice(r.start, r.start + len(r.view))
            with lock:
                if (owner[span] != -1).any():
                    failures.append("overlap")
                owner[span] = k
            r.view[:] = k
            time.sleep(rng.random() * 1e-4)
            if (r.view != k).any():
                failures.append("bytes changed under a live region")
            with lock:
                owner[span] = -1
            r.release()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures[:3]
    assert arena.outstanding == 0 and arena.wraps > 10


def test_size_from_the_environment(env_settings):
    env_settings(PYLLAMA_RPC_STAGING_BYTES="4096")
    assert arena_size() == 4096
    for bad in ("lots", str(ALIGN - 1)):
        with pytest.raises(PyllamaError, match=f"PYLLAMA_RPC_STAGING_BYTES='{bad}': expected an integer"):
            env_settings(PYLLAMA_RPC_STAGING_BYTES=bad)


# --- two groups on one connection --------------------------------------------------------------

def greedy(ctx, prompt: list[int], n: int, seq: int = 0) -> list[int]:
    out = ctx.decode(Batch.for_sequence(prompt, 0, seq))
    toks = []
    for i in range(n):
        t = int(out.logits[-1].argmax())
        toks.append(t)
        out = ctx.decode(Batch.for_sequence([t], len(prompt) + i, seq))
    return toks


@pytest.mark.parametrize("order", ["RPC0,CPU", "CPU,RPC0"])
def test_two_contexts_share_a_tiny_arena(tiny_model, rpc_peer, order, monkeypatch, env_settings):
    """Two decode threads (two groups) on one connection whose arena holds about two hidden
    states: it wraps constantly, and every sequence still equals its single-threaded run."""
    hidden = 64 * 4 * 8  # tiny model: n_embd 64, f32, the longest prompt below
    env_settings(PYLLAMA_RPC_STAGING_BYTES=str(2 * hidden + ALIGN))
    conn = Connection(rpc_peer.endpoint)
    try:
        rpc = RPCBackend(conn)
        backends = [rpc, CPUBackend(1)] if order == "RPC0,CPU" else [CPUBackend(1), rpc]
        engine = Engine(tiny_model, n_threads=1, backends=backends, tensor_split=[1, 1])
        prompts = [[1 + (7 * k + j) % 300 for j in range(3 + k % 6)] for k in range(8)]
        alone = [greedy(engine.new_context(256, 1), p, 12) for p in prompts]
        results: dict[int, list[int]] = {}
        errors = []

        def group(g: int) -> None:
            try:
                ctx = engine.new_context(256, 1)
                for k in range(g, len(prompts), 2):
                    ctx.clear()
                    results[k] = greedy(ctx, prompts[k], 12)
            except Exception as exc:  # noqa: BLE001
                errors.append(repr(exc))

        threads = [threading.Thread(target=group, args=(g,)) for g in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert [results[k] for k in range(len(prompts))] == alone
        if order == "RPC0,CPU":  # the hidden state comes back from the peer through the arena
            assert conn.arena.wraps > 5
        assert conn._arena is None or conn.arena.outstanding == 0
        engine.close()
    finally:
        conn.close()


# --- the server ---------------------------------------------------------------------------------

def completions(srv: ServerProcess) -> list[str]:
    out = []
    for prompt in ["The little cat sat on the", "Once upon a time", "1 2 3 4", "hello"]:
        status, doc = srv.post("/completion", {"prompt": prompt, "n_predict": 16, "temperature": 0,
                                               "ignore_eos": True, "cache_prompt": False})
        assert status == 200, doc
        out.append(doc["content"])
    return out


@pytest.mark.parametrize("order", ["RPC0,CPU", "CPU,RPC0"])
@pytest.mark.parametrize("groups", [1, 2])
def test_server_output_identical_with_async_copy_off(tiny_model, rpc_peer, order, groups):
    args = ["--rpc", rpc_peer.endpoint, "--device", order, "-np", "2", "-c", "512", "--pipeline-groups", str(groups)]
    runs = []
    for env in ({"PYLLAMA_RPC_NO_ASYNC_COPY": "1"}, {"PYLLAMA_RPC_NO_ASYNC_COPY": "0"}):
        srv = ServerProcess(tiny_model, *args, env=env).wait_ready()
        try:
            runs.append(completions(srv))
        finally:
            srv.stop()
    assert runs[0] == runs[1]
