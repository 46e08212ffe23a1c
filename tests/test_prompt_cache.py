"""The prompt cache in host memory (`--cache-ram`): a sequence's KV rows read out of the context
and written back (`Context.read_seq` / `write_seq`) continue exactly as the computed sequence; the
server keeps the prompts its slots give up and starts a returning prompt from them."""
from __future__ import annotations

import time

import numpy as np
import pytest

from pyllama.backend.cpu import CPUBackend
from pyllama.backend.rpc import RPCBackend
from pyllama.backend.base import DType
from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
from pyllama.util.errors import ContextLimitError
from pyllama.rpc.connection import Connection
from pyllama.batching.prompt_cache import PromptCache
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


def test_a_prompt_that_repeats_or_continues_an_earlier_one_came_back():
    cache = PromptCache(-1)
    first = HEAD + [3, 4]
    assert not cache.sight(first)  # a first appearance
    assert not cache.sight(HEAD + [9] * 30)  # the same head (a system prompt) is not a return
    assert cache.sight(first)  # repeated
    assert cache.sight(first + [5, 6, 7])  # continued: a conversation's next turn
    assert not cache.sight(HEAD + [3])  # shorter than the earlier prompt: not the whole of it
    assert not cache.sight([2] * 10) and not cache.sight([2] * 10)  # too short to be remembered


def test_a_prompt_sharing_a_system_prompt_with_an_earlier_one_is_part_of_a_conversation():
    from pyllama.batching.prompt_cache import SYSTEM_PREFIX

    cache = PromptCache(-1)
    system = [1] + list(range(500, 500 + SYSTEM_PREFIX - 1))
    assert not cache.sight(system + [3, 4, 5])
    assert cache.sight(system + [7, 8])  # another conversation after the same system prompt
    assert not cache.sight(system[:SYSTEM_PREFIX - 1] + [9] * 10)  # one token short of it


def test_sightings_are_bounded_oldest_first():
    cache = PromptCache(-1, sightings=2)
    a, b, c = ([t] * 20 for t in (1, 2, 3))
    for p in (a, b, c):  # two later prompts push a out
        cache.sight(p)
    assert not cache.sight(a) and cache.sight(c)


def test_a_reserved_entry_covers_its_prompt_and_waits_for_its_rows():
    cache = PromptCache(-1)
    tokens = HEAD + [3, 4]
    entry = cache.reserve(tokens, 1)
    assert entry is not None and cache.covers(tokens) and cache.nbytes == 0
    found, n = cache.best(tokens + [5])
    assert found is entry and n == len(tokens)
    assert entry.wait(0.01) is None  # not copied yet
    assert cache.fill(entry, _rows(18))
    assert entry.wait(10) is not None and cache.nbytes == sum(k.nbytes + v.nbytes for k, v in _rows(18))
    other = cache.reserve(HEAD + [8], 1)
    cache.fail(other)
    assert not cache.covers(HEAD + [8]) and other.wait(10) is None and len(cache) == 1


def test_metrics_families_give_bytes_and_limit():
    from pyllama.obs.metrics import render_families

    cache = PromptCache(4 << 20)
    cache.save(HEAD + [3], _rows(17))
    text = render_families(cache.families())
    assert f"llamacpp:prompt_cache_bytes {cache.nbytes}\n" in text and cache.nbytes > 0
    assert "llamacpp:prompt_cache_limit_bytes 4194304\n" in text
    assert "# TYPE llamacpp:prompt_cache_bytes gauge" in text
    assert "llamacpp:prompt_cache_limit_bytes +Inf" in render_families(PromptCache(-1).families())


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


def _metrics(server: ServerProcess, saves: int = 0, wait_s: float = 10.0) -> dict[str, float]:
    """The prompt cache's figures, once `saves` copies have ended (or after wait_s): a copy runs
    on the cache's own thread and may end after the request whose slot it copied."""
    deadline = time.monotonic() + wait_s
    while True:
        m = _metrics_now(server)
        if m.get("llamacpp:prompt_cache_saves_total", 0) >= saves or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def _metrics_now(server: ServerProcess) -> dict[str, float]:
    status, text = server.request("GET", "/metrics")
    assert status == 200
    text = text if isinstance(text, str) else text.decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("llamacpp:prompt_cache_")}


@pytest.mark.parametrize("cache_ram", ["8", "0"])
def test_a_returning_prompt_starts_from_the_host_cache(tiny_model, cache_ram):
    server = ServerProcess(tiny_model, "-np", "1", "-c", "512", "--cache-ram", cache_ram, "--metrics").wait_ready()
    try:
        first = _complete(server, A)
        _complete(server, B)  # the only slot gives A up: a first appearance, it is let go
        m = _metrics(server)
        assert m["llamacpp:prompt_cache_saves_total"] == 0 and m["llamacpp:prompt_cache_bytes"] == 0
        _complete(server, A)  # A comes back (computed again)
        _complete(server, B)  # gives A up: now kept
        again = _complete(server, A)
        assert again["content"] == first["content"] and again["tokens_predicted"] == first["tokens_predicted"]
        if cache_ram == "0":
            assert again["timings"]["cache_n"] == 0 and again["timings"]["prompt_n"] == len(A)
            assert _metrics(server) == {"llamacpp:prompt_cache_bytes": 0, "llamacpp:prompt_cache_limit_bytes": 0,
                                        "llamacpp:prompt_cache_entries": 0, "llamacpp:prompt_cache_saves_total": 0,
                                        "llamacpp:prompt_cache_saved_bytes_total": 0,
                                        "llamacpp:prompt_cache_not_admitted_total": 0}
        else:
            assert again["timings"]["cache_n"] == len(A) - 1 and again["timings"]["prompt_n"] == 1
            m = _metrics(server, saves=2)
            # A and B were each let go once, then copied once each (B when A came back the last time)
            assert m["llamacpp:prompt_cache_not_admitted_total"] == 2 and m["llamacpp:prompt_cache_saves_total"] == 2
            assert 0 < m["llamacpp:prompt_cache_bytes"] == m["llamacpp:prompt_cache_saved_bytes_total"]
            assert m["llamacpp:prompt_cache_limit_bytes"] == 8 << 20 and m["llamacpp:prompt_cache_entries"] == 2
        no_cache = _complete(server, B, cache_prompt=False)
        assert no_cache["timings"]["cache_n"] == 0
    finally:
        assert server.stop() == 0


def test_a_prompt_saved_by_one_group_loads_in_another(tiny_model):
    server = ServerProcess(tiny_model, "-np", "2", "-c", "512", "--pipeline-groups", "2").wait_ready()
    try:
        first = _complete(server, A, id_slot=0)
        _complete(server, A, id_slot=0)  # A came back: it is kept when dropped
        _complete(server, B, id_slot=0)
        again = _complete(server, A, id_slot=1)  # slot 1 is group 1's
        assert again["timings"]["cache_n"] == len(A) - 1 and again["content"] == first["content"]
    finally:
        assert server.stop() == 0


def _saved_lines(server, expected: int, wait_s: float = 10.0) -> list[str]:
    """The log's "saved to the host cache" lines, once `expected` of them are there (or after
    wait_s): a copy runs on the cache's own thread and may end after the request that caused it."""
    deadline = time.monotonic() + wait_s
    while True:
        saved = [line for line in server.log_tail(200).splitlines() if "saved to the host cache" in line]
        if len(saved) >= expected or time.monotonic() > deadline:
            return saved
        time.sleep(0.05)


@pytest.mark.parametrize("flag", ["--cache-idle-slots", "--no-cache-idle-slots"])
def test_idle_slots_are_saved_when_a_request_starts(tiny_model, flag):
    server = ServerProcess(tiny_model, "-np", "2", "-c", "512", flag, "--metrics").wait_ready()
    try:
        _complete(server, A, id_slot=0)
        _complete(server, A, id_slot=0)  # A came back
        _complete(server, B, id_slot=1)  # slot 0 is idle when this starts
        saved = _saved_lines(server, 1 if flag == "--cache-idle-slots" else 0)
        assert (len(saved) == 1 and "slot 0:" in saved[0]) if flag == "--cache-idle-slots" else not saved
        # slot 1 (B, a first appearance) is idle when this starts: it is not dropped, so not counted as let go
        _complete(server, list(range(300, 380)), id_slot=0)
        assert _metrics(server)["llamacpp:prompt_cache_not_admitted_total"] == 0
    finally:
        assert server.stop() == 0



def test_a_multi_turn_conversation_keeps_its_turns_while_one_off_prompts_are_not_copied(tiny_model):
    """One slot, a conversation interleaved with one-off prompts: a one-off prompt's rows are let go
    when the next request takes the slot (no copy), and so are the conversation's first turn's; its
    later turns, each continuing the one before, are copied and start from the cache."""
    server = ServerProcess(tiny_model, "-np", "1", "-c", "512", "--metrics").wait_ready()
    try:
        history = list(A[:30])
        one_offs = [list(range(200 + 40 * i, 230 + 40 * i)) for i in range(4)]
        cached = []
        for turn, other in enumerate(one_offs):
            reply = _complete(server, history, return_tokens=True)
            cached.append(reply["timings"]["cache_n"])
            history += reply["tokens"] + list(range(300 + 10 * turn, 310 + 10 * turn))
            _complete(server, other)
        m = _metrics(server, saves=3)
        assert cached[:2] == [0, 0] and all(c > 30 for c in cached[2:])  # turns 2 and 3 start from the cache
        # turns 1..3, each when a one-off prompt took the slot, each replacing the turn before it
        assert m["llamacpp:prompt_cache_saves_total"] == 3 and m["llamacpp:prompt_cache_entries"] == 1
        assert m["llamacpp:prompt_cache_not_admitted_total"] == 4  # turn 0 and the one-off prompts (but the last)
    finally:
        assert server.stop() == 0


def test_rows_are_copied_off_the_decode_thread(tiny_model, monkeypatch):
    """The copy of a dropped prompt's rows runs on the cache's copier thread, never the group's
    decode thread; the blocks it reads stay out of the pool until it is done, then go back."""
    import threading
    import time

    from pyllama.batching.sampling import SamplingParams
    from pyllama.batching.group import PipelineGroup
    from pyllama.obs.metrics import Metrics
    from pyllama.batching.slot import Slot
    from pyllama.batching.task import CompletionTask

    engine = Engine(tiny_model, n_threads=1)
    ctx = engine.new_context(512, 1)
    slots = [Slot(0, 0, 0, ctx.seq_cap, engine.tokenizer)]
    freed: list = []
    group = PipelineGroup(0, ctx, slots, engine.tokenizer, Metrics(), on_free=freed.append)
    group.prompt_cache = cache = PromptCache(-1)
    readers: list[str] = []
    gate = threading.Event()
    real = ctx.read_cells

    def read_cells(runs, n):
        readers.append(threading.current_thread().name)
        gate.wait(60)  # a slow copy: the decode thread must not wait for it
        return real(runs, n)

    monkeypatch.setattr(ctx, "read_cells", read_cells)

    def run(prompt: list[int]) -> None:
        n = len(freed)
        group.submit([(slots[0], CompletionTask(prompt=prompt, params=SamplingParams(temperature=0.0), n_predict=2))])
        deadline = time.monotonic() + 60
        while len(freed) == n and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(freed) == n + 1

    group.start()
    try:
        for prompt in (A, B, A, B):  # first appearances: nothing read; then A is dropped after it came back
            run(prompt)
        kv = ctx.kv

        def blocks(n: int) -> int:
            return -(-n // kv.block_size)

        # the copy is still blocked, yet every request has been served; A's blocks are out of the pool
        entry, _ = cache.best(A)
        assert readers == ["prompt-cache-copy"] and len(cache) == 1 and cache.nbytes == 0
        assert entry is not None and entry.tokens[:len(A)] == A
        assert kv.n_free_blocks + blocks(kv.seq_len(0)) + blocks(len(entry.tokens)) == kv.n_blocks
        gate.set()
        assert entry.wait(10) is not None and cache.nbytes > 0
        run(B + [7] * 10)  # continues the slot's prompt (nothing dropped); its step gives A's blocks back
        assert readers == ["prompt-cache-copy"]
        assert kv.n_free_blocks + blocks(kv.seq_len(0)) == kv.n_blocks
    finally:
        gate.set()
        group.stop()
