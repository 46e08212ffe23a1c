"""Blocks moved between the devices of a split while sequences are under way (Engine.move_layers):
the weights and every context's KV cache go with them, so generation goes on exactly as if the
split had been the new one all along; a move that cannot be made changes nothing."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pyllama.backend.cpu import CPUBackend
from pyllama.backend.rpc import RPCBackend
from pyllama.runtime.placement.balance import layer_bytes
from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
from pyllama.rpc.connection import Connection, RPCError
from server_util import RPCServerProcess

PROMPTS = [[1, 5, 9, 13, 2, 7], [1, 8, 3], [1, 4, 4, 4, 11, 6, 2, 9, 3]]


def _engine(model: str, peer: RPCServerProcess, split: list[int]) -> Engine:
    backends = [RPCBackend(Connection(peer.endpoint), 0, "RPC0"), CPUBackend(1)]
    return Engine(model, n_threads=1, backends=backends, tensor_split=split)


def _greedy(engine: Engine, n: int, move_at: int = -1, to: list[int] | None = None, ctxs: int = 2,
            move=None) -> list[list[int]]:
    """Greedy continuations of PROMPTS in `ctxs` contexts (the sequences spread over them),
    the blocks moved to `to` (or `move()` called) after `move_at` steps."""
    contexts = [engine.new_context(128, len(PROMPTS)) for _ in range(ctxs)]
    home = [contexts[i % ctxs] for i in range(len(PROMPTS))]
    last = []
    for i, p in enumerate(PROMPTS):
        out = home[i].decode(Batch.for_sequence(p, 0, i))
        last.append(int(out.logits[0].argmax()))
    outs = [[t] for t in last]
    for step in range(n):
        if step == move_at:
            move() if move else engine.move_layers(to)
        for i, p in enumerate(PROMPTS):
            out = home[i].decode(Batch([outs[i][-1]], [len(p) + step], [i], [True]))
            outs[i].append(int(out.logits[0].argmax()))
    for c in contexts:
        c.free()
    return outs


@pytest.fixture(scope="module")
def peer():
    p = RPCServerProcess("--mem", "4096")  # free memory then counts this server's buffers exactly
    yield p
    assert p.stop() == 0


@pytest.mark.parametrize("start,to", [([2, 4], [4, 2]), ([4, 2], [2, 4]), ([3, 3], [5, 1])])
def test_generation_goes_on_unchanged_after_a_move(model_factory, peer, start, to):
    model = model_factory("small", wtype="q8_0")
    expected = _greedy(Engine(model, n_threads=1), 8)
    engine = _engine(model, peer, start)
    assert engine.counts() == start
    assert _greedy(engine, 8, move_at=3, to=to) == expected
    assert engine.counts() == to
    assert engine.placement.layer_backend == [0] * to[0] + [1] * to[1]
    # every weight of a block now lives on its block's device, and the logits agree with a fresh
    # engine of that split bit for bit
    for lname, (_, layer) in engine.model.logical_weights().items():
        if 0 <= layer < engine.model.hparams.n_layer:
            tensors = engine.weights[lname] if isinstance(engine.weights[lname], tuple) else (engine.weights[lname],)
            assert all(t.buffer.backend is engine.backends[engine.placement.layer_backend[layer]] for t in tensors)
    fresh = _engine(model, peer, to)
    ca, cb = engine.new_context(128, 1), fresh.new_context(128, 1)
    a = ca.decode(Batch.for_sequence(PROMPTS[2], 0, 0)).logits
    b = cb.decode(Batch.for_sequence(PROMPTS[2], 0, 0)).logits
    np.testing.assert_array_equal(a, b)
    ca.free()
    cb.free()
    assert engine.weights.bytes_per_backend == fresh.weights.bytes_per_backend
    engine.close()
    fresh.close()


def test_moving_back_frees_what_the_peer_held(model_factory, peer):
    model = model_factory("small", wtype="q8_0")
    engine = _engine(model, peer, [3, 3])
    ctx = engine.new_context(128, 2)
    conn = engine.backends[0].conn
    before = engine.backends[0].device_info().free
    engine.move_layers([5, 1])
    assert engine.backends[0].device_info().free < before
    engine.move_layers([1, 5])
    engine.move_layers([3, 3])
    assert engine.backends[0].device_info().free == before
    assert engine.counts() == [3, 3]
    ctx.free()
    engine.close()
    conn.close()


def test_a_move_that_does_not_fit_changes_nothing(model_factory, peer):
    """The peer has room for its block, the context's KV cache and compute buffer, and one block
    and a half more: the second of four blocks to move fails there; what the attempt allocated is
    freed, the split stays, and the sequence goes on as before."""
    model = model_factory("small", wtype="f32")
    expected = _greedy(Engine(model, n_threads=1), 4, ctxs=1)
    engine = _engine(model, peer, [1, 5])
    ctx = engine.new_context(128, len(PROMPTS))
    room = (engine.weights.bytes_per_backend["RPC0"] + ctx.device_bytes()["RPC0"]
            + 3 * layer_bytes(engine.model, engine.backends[0]) // 2)
    ctx.free()
    engine.close()
    tight = RPCServerProcess("--mem", str(-(-room // 2**20)))
    try:
        engine = _engine(model, tight, [1, 5])

        def refused() -> None:
            free = engine.backends[0].device_info().free
            with pytest.raises(RPCError, match="memory cap"):
                engine.move_layers([5, 1])
            assert engine.counts() == [1, 5]
            assert engine.backends[0].device_info().free == free  # what the attempt allocated is freed

        assert _greedy(engine, 4, move_at=2, ctxs=1, move=refused) == expected
        engine.move_layers([2, 4])  # what fits still moves
        assert engine.counts() == [2, 4]
        engine.close()
    finally:
        assert tight.stop() == 0


def test_a_split_that_is_not_one_is_refused(tiny_model, peer):
    engine = _engine(tiny_model, peer, [1, 1])
    for bad in ([2, 0], [1, 2], [1, 1, 0]):
        with pytest.raises(ValueError):
            engine.move_layers(bad)
    assert engine.move_layers([1, 1]) == []
    engine.close()


def test_a_server_moves_its_blocks_under_load_and_the_requests_go_on(model_factory, peer):
    """The server's own split (no -ts) moved twice while four requests generate in two groups:
    each reply is the one the same request gets with no move."""
    from test_llama_server_api import InProcessServer  # noqa: PLC0415
    from pyllama.server.__main__ import move_blocks  # noqa: PLC0415

    model = model_factory("small", wtype="q8_0")
    srv = InProcessServer(model, "--rpc", peer.endpoint, "--device", "RPC0,CPU", "-np", "4", "-c", "2048",
                          "--pipeline-groups", "2")
    try:
        state = srv.state
        assert state.split_chosen
        start = state.engine.counts()
        prompts = ["Once upon a time", "The capital of France", "1, 2, 3, 4,", "def main():"]

        def run_all(during=None) -> list[str]:
            out: list = [None] * len(prompts)

            def one(i: int) -> None:
                status, doc = srv.post("/completion", {"prompt": prompts[i], "n_predict": 160, "temperature": 0,
                                                       "ignore_eos": True, "cache_prompt": False})
                assert status == 200, doc
                out[i] = doc["content"]
            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            if during:
                during()
            for t in threads:
                t.join(120)
            return out

        expected = run_all()

        def move_while_generating() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                status, slots = srv.get("/slots")
                if sum(1 for s in slots if s.get("is_processing") and s["next_token"][0]["n_decoded"] > 8) == 4:
                    break
                time.sleep(0.01)
            else:
                pytest.fail("the requests did not start generating")
            move_blocks(state, [5, 1])
            assert state.engine.counts() == [5, 1]
            move_blocks(state, [2, 4])
            status, slots = srv.get("/slots")
            assert sum(1 for s in slots if s.get("is_processing")) == 4  # moved in the middle of them

        assert run_all(move_while_generating) == expected
        assert start != [5, 1] and state.engine.counts() == [2, 4]
    finally:
        srv.close()


@pytest.mark.parametrize("given", [False, True])
def test_the_split_check_may_move_only_the_servers_own_split(model_factory, peer, given):
    """The server's check of its split gets a move only when no -ts chose the split, and that move
    re-splits the engine with the groups stopped."""
    from test_llama_server_api import InProcessServer  # noqa: PLC0415
    from pyllama.server.__main__ import start_split_check  # noqa: PLC0415

    model = model_factory("small", wtype="q8_0")
    srv = InProcessServer(model, "--rpc", peer.endpoint, "--device", "RPC0,CPU", "-np", "4", "-c", "2048",
                          "--pipeline-groups", "2", *(["-ts", "3,3"] if given else []))
    check = start_split_check(srv.state, srv.api, 3600.0)
    try:
        assert check is not None and check.counts == srv.state.engine.counts()
        assert all(c is None or c >= n for c, n in zip(check.caps, check.counts))
        if given:
            assert check.move is None
        else:
            check.move([5, 1])
            assert srv.state.engine.counts() == [5, 1]
            status, doc = srv.post("/completion", {"prompt": "hello", "n_predict": 4, "temperature": 0})
            assert status == 200 and doc["tokens_predicted"] == 4
    finally:
        check.stop()
        srv.close()
