"""Continuous batching over one context's slots, one step at a time.

Tasks are placed on slots; each step is then planned (`Scheduler`: which decode rows and prompt
chunks, so that their KV cells are free), computed and sampled (`Runner`) and turned into the
requests' events (`Postprocessor`). Whoever calls `place` and `step` owns the slots and the
context: a pipeline group's decode thread in the server, the main thread in `generate`.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import numpy as np

from ..obs.metrics import Metrics
from ..obs.step_probe import StepProbe
from ..runtime.context import Context, DecodeOutput
from ..tokenizer import Tokenizer
from .postprocess import Postprocessor
from .prompt_cache import GroupPromptCache
from .runner import Runner, wants_raw_probs
from .scheduler import EXACT_ROWS, FEEDING, Scheduler
from .slot import Slot, SlotState, common_prefix
from .speculative import Drafter, SpecControl, verify
from .task import CompletionTask, ErrorEvent, EventOut, FinalEvent, ProgressEvent

log = logging.getLogger(__name__)


class BatchCore:
    def __init__(self, ctx: Context, slots: list[Slot], tokenizer: Tokenizer, metrics: Metrics, sink: EventOut,
                 on_free: Callable[[Slot], None], probe: StepProbe, n_threads: int = 1,
                 backend_sampling: bool = False, context_shift: bool = False, pooling: str = "none",
                 name: str = "0", drafter: Optional[Drafter] = None):
        self.ctx = ctx
        self.slots = slots
        self.metrics = metrics
        self.sink = sink
        self.probe = probe
        for slot in slots:
            slot.context_shift = context_shift
        self._arrivals = 0  # requests placed so far: their order is their priority
        self.cache = GroupPromptCache(ctx)
        self.post = Postprocessor(ctx, slots, tokenizer, metrics, sink, on_free)
        self.scheduler = Scheduler(ctx, slots, tokenizer, metrics, self.cache, self.post.finish)
        self.runner = Runner(ctx, len(slots), probe, n_threads, backend_sampling, pooling, name)
        self.drafter = drafter  # speculative decoding: proposes the generating slots' drafts
        self.spec = SpecControl()

    def warm_up(self, token: int) -> None:
        """One step of `token` on the first slot's sequence, then forgotten (Runner.warm_up)."""
        self.runner.warm_up(self.slots[0].seq, token)

    def place(self, placements: list[tuple[Slot, CompletionTask]]) -> None:
        """Starts a request on its slot (n > 1 choices: one placement each, the first computing
        the shared prompt). A request that cannot start gets its error and its slot back."""
        try:
            self._place(placements)
        except Exception as exc:  # noqa: BLE001 - one request's start, never the others
            log.exception("starting a request failed")
            for slot, task in placements:
                if slot.task is not task:  # not started: nothing else would answer it or free its slot
                    self.sink.put(task, ErrorEvent(f"starting the request failed: {exc}", 500, "server_error"))
                    self.post.on_free(slot)

    def _place(self, placements: list[tuple[Slot, CompletionTask]]) -> None:
        lost = self.ctx.lost_devices()
        if lost:  # nothing can run until the device is back: say so at once
            message = "; ".join(lost.values()) + "; reconnecting"
            for slot, task in placements:
                self.sink.put(task, ErrorEvent(message, 503, "unavailable_error"))
                self.post.on_free(slot)
            return
        parent: Optional[Slot] = None
        self._arrivals += 1
        for slot, task in placements:
            same_lora = self._set_lora(slot, task)
            if parent is None:
                n_keep = 0
                if task.cache_prompt and same_lora:  # (a cache computed with other adapters is not reused)
                    n_keep = min(common_prefix(slot.cache_tokens, task.prompt), len(task.prompt) - 1)
                n_keep = self.cache.start(slot, task, n_keep)
                n_keep = self.ctx.seq_rm(slot.seq, n_keep)
                slot.start(task, n_keep, priority=self._arrivals)
                parent = slot
                if task.return_progress:  # as llama-server: one event before any of the prompt is computed
                    self.sink.put(task, ProgressEvent(len(task.prompt), n_keep, n_keep, 0.0))
            else:
                self.ctx.seq_rm(slot.seq, 0)
                self.cache.start_child(slot)
                slot.start(task, 0, parent=parent, priority=self._arrivals)
        self.cache.save_idle(self.slots)
        # the first token's mask is computed while the prompt is
        self.runner.request_masks([slot for slot, _ in placements if slot.constraint is not None])

    def _set_lora(self, slot: Slot, task: CompletionTask) -> bool:
        """The task's LoRA scales on its slot's sequence; whether its cache was computed with them."""
        n = self.ctx.lora_scales.shape[1]
        if not n:
            return True
        scales = tuple(task.lora) if len(task.lora) == n else (0.0,) * n
        same = scales == slot.lora
        self.ctx.set_lora(slot.seq, scales)
        slot.lora = scales
        return same

    def step(self) -> bool:
        """One step: plan, build, decode, sample, events. False when no slot had work (no step)."""
        if self.cache.held:
            self.cache.release_held(wait=False)
        for slot in self.slots:
            if slot.busy and slot.task is not None and slot.task.cancelled.is_set():
                self.post.finish(slot, None)
        t0 = time.perf_counter()
        generating = [slot for slot in self.slots if slot.state is SlotState.GENERATING]
        if self.drafter is not None:
            for slot in self.slots:
                slot.draft = []
            # a step verifies at most EXACT_ROWS rows: with more than half of them decode rows, most
            # sequences would have no room for a draft they paid for; nor while a prompt waits (its
            # chunk takes the step's rows before any draft)
            n = len(generating)
            feeding = any(slot.state in FEEDING for slot in self.slots)
            if 0 < 2 * n <= EXACT_ROWS and not feeding and self.spec.step_drafts(n):
                wanted = [slot for slot in generating if self.spec.slot_wants(slot)]
                self.drafter.draft(wanted, lambda slots: self.spec.affordable(slots, n, self.drafter))
        decoded = sum(slot.n_decoded for slot in generating)
        plan = self.scheduler.plan()
        batch, rows = self.runner.build(plan)
        if batch is None:
            return False
        drafted = any(slot.draft for slot in plan.decode)
        self.probe.built(len(batch), len(rows), len(plan.decode))
        out = self.runner.decode(batch, rows)
        self.metrics.on_decode(sum(1 for s in self.slots if s.busy))
        self.post.advance(out)
        if rows:
            if out.embd is not None:
                self.post.after_embeddings(rows)
            elif any(slot.draft for slot in plan.decode):
                self._emit_speculative(out, rows, plan.decode)
            else:
                constrained = self.post.emit(rows, self.runner.sample(out, rows))
                self.runner.request_masks(constrained)
        self.metrics.on_tokens(max(slot.n_past for slot in self.slots))
        self.probe.post_done(rows)
        # a step holding a prompt is no measure of drafting (a draft model catching up with a slot is:
        # that is what its drafts cost)
        if self.drafter is not None and generating and not plan.chunks:
            self.spec.step_done(len(generating), drafted, sum(slot.n_decoded for slot in generating) - decoded,
                                time.perf_counter() - t0)
        return True

    def _emit_speculative(self, out: DecodeOutput, rows: list[Slot], decode: list[Slot]) -> None:
        """A step with drafts: the other rows are sampled together as usual, then each drafted
        slot's rows in turn (speculative.verify), and the cells of the draft tokens it did not
        accept are freed."""
        plain = [i for i, slot in enumerate(rows) if not slot.draft]
        if plain:
            part = DecodeOutput(np.ascontiguousarray(out.logits[plain]), out.rows[plain])
            constrained = self.post.emit([rows[i] for i in plain], self.runner.sample(part, [rows[i] for i in plain]))
            self.runner.request_masks(constrained)
        first = {}
        for i, slot in enumerate(rows):
            first.setdefault(slot.id, i)
        for slot in decode:
            if not slot.draft:
                continue
            i, n = first[slot.id], 1 + len(slot.draft)
            accepted = verify(slot, out.logits[i:i + n], self.runner.sampler, self.post.emit_token,
                              wants_raw_probs(slot))
            self.metrics.on_draft(n - 1, accepted)
            self.spec.verified(slot, n - 1, accepted)
            if self.drafter is not None:
                self.drafter.accepted(slot, n - 1, accepted)
            n_kept = self.ctx.seq_rm(slot.seq, slot.n_past)
            del slot.cache_tokens[n_kept:]

    def finish(self, slot: Slot, final: Optional[FinalEvent]) -> None:
        """Ends the slot's request (with `final`, or None: cancelled) and frees the slot."""
        self.post.finish(slot, final)

    def fail_all(self, message: str) -> None:
        self.post.fail_all(message)

    # --- slot files (POST /slots/{id}?action=save|restore: run between steps) ---------------------
    def read_slot(self, slot: Slot) -> tuple[list[int], list[tuple[np.ndarray, np.ndarray]]]:
        """The slot's cached tokens that have KV rows, and those rows."""
        n = self.ctx.kv.seq_len(slot.seq)
        return list(slot.cache_tokens[:n]), self.ctx.read_seq(slot.seq, n)

    def write_slot(self, slot: Slot, tokens: list[int], rows: list[tuple[np.ndarray, np.ndarray]]) -> bool:
        """The slot's cache becomes `tokens` with their rows, other idle slots' caches dropped for
        the room as a new prompt would drop them (its own cache among them); False when even that
        leaves too few cells."""
        while not self.cache.fits(slot, len(tokens)):
            if not self.scheduler.evict_idle():
                return False
        if self.cache.cache is not None and slot.cache_tokens:
            self.cache.save(slot, 0)
        slot.cache_tokens = []
        self.ctx.write_seq(slot.seq, rows, len(tokens))  # raises with the sequence empty
        slot.cache_tokens = list(tokens)
        return True

    def close(self) -> None:
        self.runner.close()
        if self.drafter is not None:
            self.drafter.close()
