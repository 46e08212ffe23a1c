"""The prompt cache in host memory (`--cache-ram`): a sequence's KV rows read out of the context
and written back (`Context.read_seq` / `write_seq`) continue exactly as the computed sequence; the
server keeps the prompts its slots give up and starts a returning prompt from them."""
from __future__ import annotations

import numpy as np
import pytest

from pyllama.backend.cpu import CPUBackend
from pyllama.backend.rpc import RPCBackend
from pyllama.backend.base import DType
from pyllama.context import Batch
from pyllama.engine import Engine
from pyllama.errors import ContextLimitError
from pyllama.rpc.connection import Connection
from pyllama.server.prompt_cache import PromptCache
from server_util import RPCServerProcess, ServerProcess

PROMPT = [1] + [(7 * i) % 200 + 3 for i in range(44)]  # 45 tokens: three KV blocks, the last partly used


def _rows(n_tokens: int, width: int = 8, layers: int = 2) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.full((n_tokens, width), il, np.uint8), np.full((n_tokens, width), il + 1, np.uint8))
            for il in range(layers)]


# --- the cache's bookkeeping ---------------------------------------------------------------------
HEAD = list(range(1, 17))  # entries share at least their first 16 tokens with the prompts they serve


def test_best_entry_is_the_longest_common_prefix():
    cache = PromptCache(-1)
    assert cache.save(HEAD + [3, 4], _rows(18))
    assert cache.save(HEAD + [9, 9, 9], _rows(19))
    entry, n = cache.best(HEAD + [9, 9, 7])
    assert entry is not None and entry.tokens == HEAD + [9, 9, 9] and n == 18
    assert cache.best([5] + HEAD) == (None, 0)
    assert cache.best(HEAD[:15] + [0, 9, 9]) == (None, 0)  # fewer than 16 in common: not worth loading
    assert not cache.save(HEAD[:15], _rows(15))  # nor keeping


def test_a_longer_prompt_replaces_its_prefixes_and_covers_them():
    cache = PromptCache(-1)
    cache.save(HEAD + [3], _rows(17))
    cache.save(HEAD + [3, 4, 5], _rows(19))
    assert len(cache) == 1 and cache.nbytes == sum(k.nbytes + v.nbytes for k, v in _rows(19))
    assert cache.covers(HEAD + [3]) and cache.covers(HEAD + [3, 4, 5])
    assert not cache.covers(HEAD + [3, 4, 5, 6]) and not cache.covers(HEAD + [4])


def test_least_recently_used_entries_go_first_past_the_limit():
    one = sum(k.nbytes + v.nbytes for k, v in _rows(20))
    cache = PromptCache(2 * one)
    a, b, c = ([t] * 20 for t in (1, 2, 3))
    cache.save(a, _rows(20))
    cache.save(b, _rows(20))
    cache.best(a)  # the older entry was used since: the other goes
    cache.save(c, _rows(20))
    assert cache.covers(a) and cache.covers(c) and not cache.covers(b)
    assert cache.nbytes == 2 * one
    assert not cache.save([4] * 60, _rows(60)) and len(cache) == 2  # larger than the whole limit


# --- a sequence's rows out of the context and back -----------------------------------------------
def _continue(ctx, seq: int, token: int, pos: int) -> np.ndarray:
    return ctx.decode(Batch([token], [pos], [seq], [True])).logits[0].copy()


def _round_trip(engine: Engine, type_k: DType = DType.F16, type_v: DType = DType.F16, n: int = len(PROMPT)):
    """Logits of the next token after PROMPT[:n] computed in sequence 0, and after the same rows
    written into sequence 2 (whose blocks lie elsewhere in the pool, behind sequence 1's)."""
    ctx = engine.new_context(256, 4, type_k=type_k, type_v=type_v)
    try:
        ctx.decode(Batch.for_sequence([1, 2, 3] * 7, 0, 1))  # sequence 1 takes the first blocks
        ctx.decode(Batch.for_sequence(PROMPT, 0, 0))
        rows = ctx.read_seq(0, len(PROMPT))
        assert len(rows) == engine.model.hparams.n_layer and rows[0][0].shape[0] == len(PROMPT)
        ctx.write_seq(2, rows, n)
        assert ctx.kv.seq_len(2) == n
        ctx.seq_rm(0, n)
        return _continue(ctx, 0, 17, n), _continue(ctx, 2, 17, n)
    finally:
        ctx.free()


@pytest.mark.parametrize("types", [(DType.F16, DType.F16), (DType.Q8_0, DType.Q8_0), (DType.F32, DType.F16)])
def test_rows_written_back_continue_bit_for_bit(tiny_model, types):
    computed, restored = _round_trip(Engine(tiny_model, n_threads=1), *types)
    assert np.array_equal(computed, restored)


def test_a_prefix_of_the_rows_continues_as_that_prefix(tiny_model):
    computed, restored = _round_trip(Engine(tiny_model, n_threads=1), n=20)
    assert np.array_equal(computed, restored)


def test_rows_that_do_not_fit_leave_the_sequence_empty(tiny_model):
    engine = Engine(tiny_model, n_threads=1)
    ctx = engine.new_context(64, 1, n_batch=64)
    other = engine.new_context(256, 1)
    try:
        other.decode(Batch.for_sequence(PROMPT + PROMPT, 0, 0))
        rows = other.read_seq(0, 90)
        with pytest.raises(ContextLimitError):
            ctx.write_seq(0, rows, 90)
        assert ctx.kv.seq_len(0) == 0 and ctx.kv.n_free_blocks == ctx.kv.n_blocks
        with pytest.raises(ValueError):
            ctx.write_seq(0, rows[:1], 10)  # rows of another model
    finally:
        ctx.free()
        other.free()


def test_rows_of_a_split_over_an_rpc_peer(model_factory):
    model = model_factory("small", wtype="q8_0")
    peer = RPCServerProcess()
    try:
        engine = Engine(model, n_threads=1, tensor_split=[3, 3],
                        backends=[RPCBackend(Connection(peer.endpoint), 0, "RPC0"), CPUBackend(1)])
        computed, restored = _round_trip(engine)
        assert np.array_equal(computed, restored)
        expected, _ = _round_trip(Engine(model, n_threads=1))
        assert np.array_equal(computed, expected)
    finally:
        assert peer.stop() == 0


# --- the server ----------------------------------------------------------------------------------
A = list(range(10, 90))
B = list(range(100, 180))


def _complete(server: ServerProcess, prompt: list[int], **extra) -> dict:
    status, body = server.request("POST", "/completion", {"prompt": prompt, "n_predict": 6, "temperature": 0,
                                                          **extra})
    assert status == 200, body
    return body


@pytest.mark.parametrize("cache_ram", ["8", "0"])
def test_a_returning_prompt_starts_from_the_host_cache(tiny_model, cache_ram):
    server = ServerProcess(tiny_model, "-np", "1", "-c", "512", "--cache-ram", cache_ram).wait_ready()
    try:
        first = _complete(server, A)
        _complete(server, B)  # the only slot gives A up
        again = _complete(server, A)
        assert again["content"] == first["content"] and again["tokens_predicted"] == first["tokens_predicted"]
        if cache_ram == "0":
            assert again["timings"]["cache_n"] == 0 and again["timings"]["prompt_n"] == len(A)
        else:
            assert again["timings"]["cache_n"] == len(A) - 1 and again["timings"]["prompt_n"] == 1
        no_cache = _complete(server, B, cache_prompt=False)
        assert no_cache["timings"]["cache_n"] == 0
    finally:
        assert server.stop() == 0


def test_a_prompt_saved_by_one_group_loads_in_another(tiny_model):
    server = ServerProcess(tiny_model, "-np", "2", "-c", "512", "--pipeline-groups", "2").wait_ready()
    try:
        first = _complete(server, A, id_slot=0)
        _complete(server, B, id_slot=0)
        again = _complete(server, A, id_slot=1)  # slot 1 is group 1's
        assert again["timings"]["cache_n"] == len(A) - 1 and again["content"] == first["content"]
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("flag", ["--cache-idle-slots", "--no-cache-idle-slots"])
def test_idle_slots_are_saved_when_a_request_starts(tiny_model, flag):
    server = ServerProcess(tiny_model, "-np", "2", "-c", "512", flag).wait_ready()
    try:
        _complete(server, A, id_slot=0)
        _complete(server, B, id_slot=1)  # slot 0 is idle when this starts
        saved = [line for line in server.log_tail(200).splitlines() if "saved to the host cache" in line]
        assert (len(saved) == 1 and "slot 0:" in saved[0]) if flag == "--cache-idle-slots" else not saved
    finally:
        assert server.stop() == 0

