"""Which tokens a step computes: the policy of continuous batching over one context's slots.

Cells of the KV pool are handed out before each step, never by catching a failed one: requests go
first in order of arrival; a prompt waits (its slot stays queued) until its whole prompt fits; a
sequence that cannot grow takes the cells of the most recently started one, which is preempted:
its cells are freed and its prompt plus the tokens generated so far are recomputed later, after
which it generates on where it stopped (same sampler state, no text repeated or lost). A sequence
at its own context limit is context-shifted (`--context-shift`, by recomputation as well) or ends
with `truncated`.
"""
from __future__ import annotations

import logging
from typing import Callable, NamedTuple, Optional

from .._fast import gemm
from ..obs.metrics import Metrics
from ..runtime.context import Context
from ..tokenizer import Tokenizer
from .prompt_cache import GroupPromptCache
from .slot import Slot, SlotState
from .task import FinalEvent

log = logging.getLogger(__name__)

FEEDING = (SlotState.PROMPT, SlotState.RECOMPUTE)

# Rows up to which a step computes each row exactly as a one-row decode would (the CPU backend's
# streaming kernel sums in a fixed order whatever the row count; BLAS, above, does not). Tokens
# that were generated are recomputed in steps at most this large, so that their K/V, and so the
# text that follows, are bit for bit those of the decode steps that first computed them.
EXACT_ROWS = gemm.small_rows_max()


class StepPlan(NamedTuple):
    """One step: the slots that decode their next token, then (slot, n) prompt or recomputation
    chunks; every slot's `n_pending` says how many of its tokens the step computes."""
    decode: list[Slot]
    chunks: list[tuple[Slot, int]]


class Scheduler:
    def __init__(self, ctx: Context, slots: list[Slot], tokenizer: Tokenizer, metrics: Metrics,
                 cache: GroupPromptCache, end: Callable[[Slot, Optional[FinalEvent]], None]):
        self.ctx = ctx
        self.kv = ctx.kv
        self.slots = slots
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.cache = cache
        self.end = end  # ends a request (a context limit without --context-shift)
        # The schedulers of groups whose steps go through the same stages as this one's (set by
        # the server for a split). While one of them generates, this group's steps feed at most
        # `shared_prompt_chunk` prompt tokens (0: no limit): see `plan`.
        self.neighbours: list[Scheduler] = []
        self.shared_prompt_chunk = 0
        self._reserved = 0  # blocks this step's rows take, out of the pool's free ones
        self._decode_need = {}

    def generating(self) -> bool:
        """Whether a slot of this group is generating (read by the other groups' threads: a
        state that changes under the reader only moves one step's prompt limit)."""
        return any(s.state is SlotState.GENERATING for s in self.slots)

    def plan(self) -> StepPlan:
        """Chooses this step's decode rows and prompt chunks so that their cells are free.

        Slots go in order of arrival. A generating slot that needs a block takes it from the idle
        slots' cached prompts first, then from the most recently started request holding cells
        (possibly itself), which is preempted. A prompt or recomputation that has not started waits
        until all of it fits (later arrivals wait behind it); once started, it takes what is free,
        preempting only requests newer than itself. Sets `n_pending` of every slot."""
        kv = self.kv
        for slot in self.slots:
            slot.n_pending = 0
        for slot in self.slots:  # a sequence at its context limit shifts (or ends) first
            if slot.state is SlotState.GENERATING and slot.n_past >= slot.n_ctx:
                self._shift(slot)
        order = sorted((s for s in self.slots if s.state in FEEDING or s.state is SlotState.GENERATING),
                       key=lambda s: (s.priority, s.id))
        self._reserved = 0
        self._decode_need = {}
        decode: list[Slot] = []
        for slot in order:
            if slot.state is not SlotState.GENERATING:
                continue
            need = kv.blocks_to_grow(slot.seq, slot.n_past + 1)
            while need > self._free() and self._evict_for(slot, order, self_ok=True):
                pass
            if slot.state is SlotState.GENERATING and need <= self._free():
                self._reserved += need
                self._decode_need[slot.id] = need
                decode.append(slot)
                slot.n_pending = 1
        budget = self.ctx.n_batch - len(decode)
        if decode:
            # generations are running: one micro-batch per step keeps their pace, the prompt chunk
            # filling what the decode rows leave of it (in a split every micro-batch is one more
            # trip through each stage); with a micro-batch of decode rows already, one of prompt
            ub = self.ctx.n_ubatch
            budget = min(budget, ub - len(decode) if len(decode) < ub else ub)
        if self.shared_prompt_chunk and any(s.generating() for s in self.neighbours):
            # The other groups' steps queue behind this one at every stage of the split: a prompt
            # micro-batch of 512 tokens holds a stage as long as some twenty decode steps, and
            # their generation waits. Short chunks interleave with their steps instead, which the
            # kernels do at the same cost per token (the trips through the stages are what grows,
            # and the other groups' steps fill the stages meanwhile).
            budget = min(budget, self.shared_prompt_chunk)
        n_rows = len(decode)
        # With as many decode rows as EXACT_ROWS the step runs on BLAS anyway (and the running
        # sequences' own tokens with it): there is no exactness left to keep, only speed.
        exact_ok = n_rows < EXACT_ROWS
        chunks: list[tuple[Slot, int]] = []
        blocked = False  # an older waiting prompt does not fit: newer ones wait behind it
        for slot in order:
            if slot.state not in FEEDING or budget <= 0:
                continue
            feed = slot.feed
            start = slot.n_past
            if not slot.admitted:
                if blocked:
                    continue
                # all of it, plus the position of the token that follows a recomputation
                total = len(feed) + (slot.state is SlotState.RECOMPUTE)
                need_all = kv.blocks_to_grow(slot.seq, min(total, kv.seq_cap))
                while need_all > self._free() and (self.evict_idle() or self._evict_waiting(slot, order)):
                    pass
                if need_all > self._free():
                    blocked = True
                    continue
                slot.admitted = True
            n = min(budget, len(feed) - start)
            exact = exact_ok and slot.state is SlotState.RECOMPUTE and start >= slot.exact_from
            if exact:  # decoded tokens: in steps small enough to compute them as decode steps did
                n = min(n, EXACT_ROWS - n_rows)
            elif slot.state is SlotState.RECOMPUTE and start < slot.exact_from:
                n = min(n, slot.exact_from - start)  # the prompt part, as a prompt
            if n <= 0:
                continue
            # a model whose tokens see their whole sequence computes a prompt in one piece: one
            # that does not fit what is left of this step waits for the next
            whole = not self.ctx.hparams.causal
            if whole and n < len(feed) - start:
                continue
            need = kv.blocks_to_grow(slot.seq, start + n)
            while need > self._free() and self._evict_for(slot, order, self_ok=False):
                pass
            if need > self._free():
                n = kv.room(slot.seq, self._free()) - start
                if n <= 0 or whole:
                    continue
                need = kv.blocks_to_grow(slot.seq, start + n)
            self._reserved += need
            chunks.append((slot, n))
            slot.n_pending = n
            budget -= n
            n_rows += n
            if exact:
                budget = min(budget, EXACT_ROWS - n_rows)
        # a decode row may have been given up to a prompt older than its slot
        decode = [s for s in decode if s.state is SlotState.GENERATING and s.id in self._decode_need]
        self._fit_drafts(decode, EXACT_ROWS - n_rows)
        return StepPlan(decode, chunks)

    def _fit_drafts(self, decode: list[Slot], rows_left: int) -> None:
        """Trims the decode slots' drafts to the rows the step has left within EXACT_ROWS (a
        drafted row must compute what a one-row decode would: beyond, none is verified) and to the
        free blocks; prompts went first. Drafts never evict anything."""
        in_step = {slot.id for slot in decode}
        for slot in self.slots:
            if slot.draft and slot.id not in in_step:
                slot.draft = []
        for slot in decode:
            if not slot.draft:
                continue
            k = min(len(slot.draft), max(0, rows_left))
            extra = 0
            while k > 0:
                extra = self.kv.blocks_to_grow(slot.seq, slot.n_past + 1 + k) - self._decode_need[slot.id]
                if extra <= self._free():
                    break
                k -= 1
            slot.draft = slot.draft[:k]
            if k:
                self._reserved += extra
                self._decode_need[slot.id] += extra
                slot.n_pending = 1 + k
                rows_left -= k

    def _free(self) -> int:
        return self.kv.n_free_blocks - self._reserved

    def evict_idle(self) -> bool:
        """Drops the cached prompt of the least recently used idle slot holding cells; first gives
        back blocks whose copy to the host cache has finished, last waits for one under way."""
        if self.cache.release_held(wait=False):
            return True
        idle = [s for s in self.slots if s.state is SlotState.IDLE and self.kv.seq_len(s.seq)]
        if not idle:
            return bool(self.cache.held) and self.cache.release_held(wait=True)
        slot = min(idle, key=lambda s: s.last_used)
        if self.cache.cache is not None:
            self.cache.save(slot, 0)
        self.ctx.seq_rm(slot.seq, 0)
        slot.cache_tokens = []
        return True

    def _evict_waiting(self, slot: Slot, order: list[Slot]) -> bool:
        """Drops the cached prompt prefix of the newest request that arrived after `slot` and has
        not started yet: waiting prompts must not hold the cells that older ones need to start."""
        key = (slot.priority, slot.id)
        for victim in reversed(order):
            if (victim.priority, victim.id) <= key:
                break
            if victim.state is SlotState.PROMPT and not victim.admitted and self.kv.seq_len(victim.seq):
                self.ctx.seq_rm(victim.seq, 0)
                victim.cache_tokens = []
                victim.i_prompt = victim.n_cached = 0
                return True
        return False

    def _evict_for(self, slot: Slot, order: list[Slot], self_ok: bool) -> bool:
        """Frees cells for `slot`: an idle slot's cache, else the newest request holding cells that
        arrived after `slot` (or `slot` itself when self_ok and there is none). False: nothing left."""
        if self.evict_idle():
            return True
        kv = self.kv
        key = (slot.priority, slot.id)
        scheduled = {s.id for s in self.slots if s.n_pending and s.state in FEEDING}
        for victim in reversed(order):
            if (victim.priority, victim.id) < key or (victim is slot and not self_ok):
                break
            if victim.id in scheduled or not kv.seq_len(victim.seq):
                continue
            self._preempt(victim)
            return True
        return False

    def _preempt(self, slot: Slot) -> None:
        """Frees a request's cells; what it had computed is recomputed once cells are free again."""
        if slot.id in self._decode_need:  # its decode row of this step goes too
            self._reserved -= self._decode_need.pop(slot.id)
            slot.n_pending = 0
        if slot.state is SlotState.GENERATING:
            slot.recompute = list(slot.cache_tokens)
            slot.exact_from = slot.n_prompt_path
            slot.state = SlotState.RECOMPUTE
        elif slot.state is SlotState.PROMPT:
            slot.i_prompt = slot.n_cached = 0
            slot.embd_parts = []  # an embedding prompt starts over: its rows come again
        self.ctx.seq_rm(slot.seq, 0)
        slot.cache_tokens = []
        slot.admitted = False
        slot.n_preempted += 1
        self.metrics.on_preempt()
        log.info("slot %d: preempted (KV cache full): %d tokens to recompute", slot.id,
                 len(slot.feed) if slot.state in FEEDING else 0)

    def _shift(self, slot: Slot) -> None:
        """A generating slot whose next token has no position left: with --context-shift keeps the
        first n_keep tokens, drops the request's n_discard of the rest (0: half) and recomputes what
        follows the kept ones at their new positions (as llama-server does, but by recomputation
        instead of rotating K);
        else, or when nothing can be dropped, the request ends."""
        task = slot.task
        assert task is not None
        n_past = slot.n_past
        n_keep = len(slot.prompt) if task.n_keep < 0 else task.n_keep
        n_keep = max(0, min(n_keep + int(self.tokenizer.add_bos), slot.n_ctx - 4))
        n_left = n_past - n_keep
        n_discard = max(0, min(task.n_discard or n_left // 2, n_left - 1))
        if not slot.context_shift or n_discard <= 0:
            self.end(slot, slot.end_at_limit())
            return
        tokens = slot.cache_tokens[:n_keep] + slot.cache_tokens[n_keep + n_discard:]
        kept = self.ctx.seq_rm(slot.seq, n_keep)  # (less when a shared block holds position n_keep)
        slot.cache_tokens = tokens[:kept]
        slot.recompute = tokens
        slot.exact_from = slot.n_prompt_path = len(tokens)  # no earlier K/V to match: as a prompt
        slot.state = SlotState.RECOMPUTE
        slot.admitted = True  # it keeps its place; it needs fewer cells than it held
        slot.truncated = True
        slot.n_shifted += 1
        self.metrics.on_context_shift()
        log.info("slot %d: context shift: n_keep = %d, n_left = %d, n_discard = %d", slot.id, n_keep, n_left,
                 n_discard)
