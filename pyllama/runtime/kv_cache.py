"""Host-side bookkeeping of a paged KV cache: which cells each sequence's positions occupy.

The cache is a pool of fixed-size blocks of cells (as in vLLM's PagedAttention); a sequence owns
a block table, and position p of sequence s lives in cell table[p // B] * B + p % B. The same cell
numbering holds on every device, each of which stores the K and V rows of its own layers. Both
policies of llama.cpp are caps on one pool: split KV gives each of P sequences C/P positions,
unified KV lets any sequence use up to all C cells.
"""
from __future__ import annotations

import numpy as np

from ..util.errors import ContextLimitError


class KVCache:
    def __init__(self, n_ctx: int, n_seq_max: int, unified: bool, block_size: int = 16):
        if n_ctx <= 0 or n_seq_max <= 0:
            raise ValueError("context size and sequence count must be positive")
        if not unified and n_ctx < n_seq_max:
            raise ValueError(f"context {n_ctx} is smaller than the {n_seq_max} sequences it is split over")
        self.n_seq_max = n_seq_max
        self.unified = unified
        self.block_size = block_size
        self.seq_cap = n_ctx if unified else n_ctx // n_seq_max
        blocks_per_seq = -(-self.seq_cap // block_size)
        # split KV reserves every sequence's worst case so no sequence can starve another
        self.n_blocks = -(-n_ctx // block_size) if unified else n_seq_max * blocks_per_seq
        self.n_cells = self.n_blocks * block_size
        self._free = list(range(self.n_blocks - 1, -1, -1))
        self._refs = np.zeros(self.n_blocks, dtype=np.int32)  # sequences whose table holds each block
        self._tables: list[list[int]] = [[] for _ in range(n_seq_max)]
        self._cells = np.zeros((n_seq_max, blocks_per_seq * block_size), dtype=np.int32)
        self.lengths = np.zeros(n_seq_max, dtype=np.int64)
        self._arange = np.arange(block_size, dtype=np.int32)

    # ------------------------------------------------------------------------------------------
    def seq_len(self, seq: int) -> int:
        return int(self.lengths[seq])

    @property
    def used_cells(self) -> int:
        return (self.n_blocks - len(self._free)) * self.block_size

    def n_tokens_cached(self) -> int:
        return int(self.lengths.sum())

    @property
    def n_free_blocks(self) -> int:
        return len(self._free)

    def blocks_to_grow(self, seq: int, length: int) -> int:
        """Blocks `prepare` would take from the pool for `seq` to hold `length` positions."""
        return max(0, -(-length // self.block_size) - len(self._tables[seq]))

    def room(self, seq: int, extra_blocks: int) -> int:
        """Positions `seq` can hold with `extra_blocks` more blocks (within its cap)."""
        return min(self.seq_cap, (len(self._tables[seq]) + max(0, extra_blocks)) * self.block_size)

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq_max:
            raise ValueError(f"sequence id {seq} outside [0, {self.n_seq_max})")

    def prepare(self, seq_ids: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Cells for a micro-batch's tokens, allocating blocks; all-or-nothing on failure."""
        if seq_ids.size == 0:
            return np.zeros(0, dtype=np.int32)
        if seq_ids.min() < 0 or seq_ids.max() >= self.n_seq_max:
            raise ValueError(f"sequence ids must lie in [0, {self.n_seq_max})")
        if pos.min() < 0:
            raise ValueError("positions must be non-negative")
        cells = self._prepare_decode(seq_ids, pos)
        if cells is not None:
            return cells
        B = self.block_size
        plan: list[tuple[int, int, int]] = []  # (seq, new length, blocks to add)
        need_total = 0
        for s in np.unique(seq_ids).tolist():
            ps = pos[seq_ids == s]
            top = int(ps.max()) + 1
            if top > self.seq_cap:
                raise ContextLimitError(
                    f"position {top - 1} of sequence {s} exceeds the per-sequence context of {self.seq_cap}")
            cur = int(self.lengths[s])
            old = ps[ps < cur]
            if old.size and (self._refs[np.asarray(self._tables[s])[old // B]] > 1).any():
                raise ValueError(f"sequence {s}: positions shared with another sequence cannot be rewritten")
            new = np.unique(ps[ps >= cur])
            if new.size and (new[0] != cur or new[-1] != cur + new.size - 1):
                raise ValueError(f"sequence {s}: positions must continue from {cur} without gaps")
            length = max(cur, top)
            add = -(-length // B) - len(self._tables[s])
            plan.append((s, length, max(add, 0)))
            need_total += max(add, 0)
        if need_total > len(self._free):
            raise ContextLimitError(
                f"KV cache is full: {need_total} more blocks of {B} cells needed, {len(self._free)} free")
        for s, length, add in plan:
            table = self._tables[s]
            for _ in range(add):
                block = self._free.pop()
                self._refs[block] = 1
                self._cells[s, len(table) * B:(len(table) + 1) * B] = block * B + self._arange
                table.append(block)
            self.lengths[s] = length
        return self._cells[seq_ids, pos]

    def _prepare_decode(self, seq_ids: np.ndarray, pos: np.ndarray) -> "np.ndarray | None":
        """prepare() for the common decode step, vectorized: every sequence once, each token the
        next position of its sequence. None when the batch is anything else, or would fail (the
        general path then decides, and says why)."""
        if len(seq_ids) < 2 or not np.array_equal(pos, self.lengths[seq_ids]):
            return None
        if np.bincount(seq_ids, minlength=self.n_seq_max).max() != 1 or int(pos.max()) >= self.seq_cap:
            return None
        B = self.block_size
        at_edge = pos % B == 0  # only a token starting a block may need one
        grow = [s for s, p in zip(seq_ids[at_edge].tolist(), pos[at_edge].tolist()) if p // B >= len(self._tables[s])]
        if len(grow) > len(self._free):
            return None
        for s in grow:
            table = self._tables[s]
            block = self._free.pop()
            self._refs[block] = 1
            self._cells[s, len(table) * B:(len(table) + 1) * B] = block * B + self._arange
            table.append(block)
        self.lengths[seq_ids] = pos + 1
        return self._cells[seq_ids, pos]

    def attention_lists(self, seq_ids: np.ndarray, pos: np.ndarray, causal: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(cells, ranges): token t attends cells[ranges[t,0] : ranges[t,0] + ranges[t,1]]: the cells of
        its sequence up to its own, or (not causal) all of them."""
        uniq, inverse = np.unique(seq_ids, return_inverse=True)
        lens = self.lengths[uniq]
        starts = np.zeros(len(uniq), dtype=np.int64)
        np.cumsum(lens[:-1], out=starts[1:])
        cells = np.concatenate([self._cells[s, :int(n)] for s, n in zip(uniq.tolist(), lens.tolist())])
        ranges = np.empty((len(seq_ids), 2), dtype=np.int32)
        ranges[:, 0] = starts[inverse]
        ranges[:, 1] = pos + 1 if causal else lens[inverse]
        return cells, ranges

    def cell_runs(self, seq: int, n: int) -> list[tuple[int, int, int]]:
        """Positions 0..n-1 of `seq` as runs of consecutive cells: (first position, first cell, length)."""
        self._check_seq(seq)
        if not 0 <= n <= self.lengths[seq]:
            raise ValueError(f"sequence {seq} holds {int(self.lengths[seq])} positions, not {n}")
        cells = self._cells[seq, :n]
        starts = np.concatenate(([0], np.flatnonzero(np.diff(cells) != 1) + 1)) if n else np.zeros(0, np.int64)
        ends = np.append(starts[1:], n)
        return [(int(a), int(cells[a]), int(b - a)) for a, b in zip(starts.tolist(), ends.tolist())]

    def blocks_freed_by_rm(self, seq: int) -> int:
        """Blocks seq_rm(seq, 0) would give back to the pool (those no other sequence shares)."""
        self._check_seq(seq)
        table = self._tables[seq]
        return int((self._refs[np.asarray(table, dtype=np.int64)] == 1).sum()) if table else 0

    def seq_rm(self, seq: int, p0: int = 0) -> int:
        """Forgets positions p0.. of a sequence (p0 = 0 clears it); returns the length kept.

        A block shared with another sequence is never written again, so when p0 falls inside
        a shared block the whole block goes and the kept length is rounded down to its start.
        """
        self._check_seq(seq)
        p0 = max(0, min(p0, int(self.lengths[seq])))
        table = self._tables[seq]
        keep = -(-p0 // self.block_size)
        if p0 % self.block_size and self._refs[table[p0 // self.block_size]] > 1:
            keep = p0 // self.block_size
            p0 = keep * self.block_size
        while len(table) > keep:
            self._release(table.pop())
        self.lengths[seq] = p0
        return p0

    def seq_share(self, src: int, dst: int, n_pos: int) -> int:
        """Makes dst (emptied first) begin with src's first n_pos positions without copying data:
        the whole blocks among them are shared. Returns how many positions dst now holds (a
        multiple of the block size); the caller computes the rest itself."""
        self._check_seq(src)
        self._check_seq(dst)
        self.seq_rm(dst, 0)
        n_blocks = min(max(0, n_pos), int(self.lengths[src])) // self.block_size
        B = self.block_size
        for i, block in enumerate(self._tables[src][:n_blocks]):
            self._refs[block] += 1
            self._tables[dst].append(block)
            self._cells[dst, i * B:(i + 1) * B] = self._cells[src, i * B:(i + 1) * B]
        self.lengths[dst] = n_blocks * B
        return n_blocks * B

    def hold(self, seq: int, n: int) -> tuple[list[int], list[tuple[int, int, int]]]:
        """Keeps the blocks of positions 0..n-1 of `seq` out of the pool, their cells unchanged,
        until `release`: whatever becomes of the sequence, a reader elsewhere may copy the cells.
        Returns the blocks and the positions' `cell_runs`."""
        runs = self.cell_runs(seq, n)
        blocks = list(self._tables[seq][:-(-n // self.block_size)])
        for block in blocks:
            self._refs[block] += 1  # the sequence's own blocks count as shared now: never written again
        return blocks, runs

    def release(self, blocks: list[int]) -> None:
        """Gives back blocks that `hold` kept."""
        for block in blocks:
            self._release(block)

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)

    def clear(self) -> None:
        for s in range(self.n_seq_max):
            self.seq_rm(s, 0)
