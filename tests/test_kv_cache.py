"""Paged KV cache bookkeeping: split and unified caps, all-or-nothing allocation, removal."""
from __future__ import annotations

import numpy as np
import pytest

from pyllama.util.errors import ContextLimitError
from pyllama.runtime.kv_cache import KVCache


def put(kv: KVCache, seq: int, start: int, n: int) -> np.ndarray:
    return kv.prepare(np.full(n, seq, np.int32), np.arange(start, start + n, dtype=np.int32))


def test_split_kv_gives_each_sequence_its_share():
    kv = KVCache(n_ctx=128, n_seq_max=4, unified=False, block_size=16)
    assert kv.seq_cap == 32
    for s in range(4):
        put(kv, s, 0, 32)  # every sequence can reach its cap even when all are full
    with pytest.raises(ContextLimitError, match="per-sequence context of 32"):
        put(kv, 0, 32, 1)


def test_unified_kv_lets_one_sequence_use_everything():
    kv = KVCache(n_ctx=128, n_seq_max=4, unified=True, block_size=16)
    assert kv.seq_cap == 128
    cells = put(kv, 2, 0, 128)
    assert sorted(cells.tolist()) == list(range(128))
    with pytest.raises(ContextLimitError, match="KV cache is full"):
        put(kv, 0, 0, 1)


def test_failed_prepare_allocates_nothing():
    kv = KVCache(n_ctx=64, n_seq_max=2, unified=True, block_size=16)
    put(kv, 0, 0, 40)
    free_before = kv.n_blocks - kv.used_cells // 16
    with pytest.raises(ContextLimitError):
        kv.prepare(np.array([1] * 30, np.int32), np.arange(30, dtype=np.int32))
    assert kv.n_blocks - kv.used_cells // 16 == free_before
    assert kv.seq_len(1) == 0


def test_positions_must_be_contiguous():
    kv = KVCache(n_ctx=64, n_seq_max=1, unified=False)
    put(kv, 0, 0, 4)
    with pytest.raises(ValueError, match="without gaps"):
        put(kv, 0, 6, 1)
    put(kv, 0, 2, 3)  # rewriting cached positions and extending by one is fine
    assert kv.seq_len(0) == 5


def test_attention_lists_cover_each_prefix():
    kv = KVCache(n_ctx=64, n_seq_max=2, unified=True, block_size=4)
    put(kv, 0, 0, 6)
    seqs = np.array([1, 1, 0], np.int32)
    pos = np.array([0, 1, 6], np.int32)
    idx = kv.prepare(seqs, pos)
    cells, ranges = kv.attention_lists(seqs, pos)
    for t in range(3):
        listed = cells[ranges[t, 0]:ranges[t, 0] + ranges[t, 1]]
        assert len(listed) == pos[t] + 1
        assert listed[-1] == idx[t]


def test_removal_frees_blocks():
    kv = KVCache(n_ctx=64, n_seq_max=2, unified=True, block_size=16)
    put(kv, 0, 0, 40)
    kv.seq_rm(0, 20)
    assert kv.seq_len(0) == 20 and kv.used_cells == 32
    kv.seq_rm(0)
    assert kv.used_cells == 0
    with pytest.raises(ValueError):
        kv.seq_rm(5)


def test_shared_prefix_blocks_are_counted_once_and_never_rewritten():
    kv = KVCache(n_ctx=128, n_seq_max=3, unified=True, block_size=16)
    put(kv, 0, 0, 40)
    assert kv.seq_share(0, 1, 39) == 32  # whole blocks only
    assert kv.used_cells == 48
    cells0, _ = kv.attention_lists(np.array([0], np.int32), np.array([31], np.int32))
    cells1, _ = kv.attention_lists(np.array([1], np.int32), np.array([31], np.int32))
    assert cells0.tolist()[:32] == cells1.tolist()[:32]
    new = put(kv, 1, 32, 8)  # the child's own continuation goes to a fresh block
    assert not set(new.tolist()) & set(kv.prepare(np.array([0], np.int32), np.array([39], np.int32)).tolist())
    with pytest.raises(ValueError, match="shared"):
        put(kv, 1, 5, 1)
    assert kv.seq_rm(1, 20) == 16  # truncating inside a shared block drops the whole block
    kv.seq_rm(0)
    assert kv.used_cells == 16  # the block still referenced by sequence 1 stays
    kv.seq_rm(1)
    assert kv.used_cells == 0


def test_decode_steps_take_the_same_cells_as_the_general_path():
    """A decode step (each sequence once, at its next position) has a vectorized path; it must
    leave the cache exactly as the general path does, across block edges, shared prefixes,
    removals and a full pool."""
    rng = np.random.default_rng(4)
    for unified in (False, True):
        fast, slow = KVCache(512, 8, unified, block_size=4), KVCache(512, 8, unified, block_size=4)
        slow._prepare_decode = lambda *a: None  # the general path only
        for c in (fast, slow):
            c.prepare(np.zeros(6, np.int32), np.arange(6))
            c.seq_share(0, 1, 6)
        for step in range(60):
            seqs = np.sort(rng.choice(8, size=int(rng.integers(2, 8)), replace=False)).astype(np.int32)
            if step % 17 == 5:
                for c in (fast, slow):
                    c.seq_rm(int(seqs[0]), int(c.lengths[seqs[0]]) // 2)
            pos = fast.lengths[seqs].copy()
            assert np.array_equal(fast.prepare(seqs, pos), slow.prepare(seqs, pos))
            assert np.array_equal(fast.lengths, slow.lengths) and fast._tables == slow._tables
            assert np.array_equal(fast._refs, slow._refs) and fast._free == slow._free
            for s in seqs.tolist():
                assert np.array_equal(fast.attention_lists(np.array([s]), np.array([fast.lengths[s] - 1]))[0],
                                      slow.attention_lists(np.array([s]), np.array([slow.lengths[s] - 1]))[0])
    small = KVCache(16, 2, True, block_size=4)
    small.prepare(np.array([0, 0, 0, 0]), np.arange(4))
    small.prepare(np.array([1, 1, 1, 1]), np.arange(4))
    small.prepare(np.array([0, 1]), np.array([4, 4]))
    small.prepare(np.array([0, 1] * 3), np.array([5, 5, 6, 6, 7, 7]))
    with pytest.raises(ContextLimitError, match="full"):  # both need a block, none is free
        small.prepare(np.array([0, 1]), np.array([8, 8]))
