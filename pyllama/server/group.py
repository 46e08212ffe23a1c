"""A pipeline group: one context, its slots, and the decode thread that runs them.

The loop is continuous batching: each iteration takes newly assigned tasks, builds one batch of
every generating slot's next token plus prompt chunks up to n_batch, decodes it, samples every
output row in one kernel call, and publishes the step's events in one hand-off to the event loop.
The task thread never touches the context: it hands tasks over through `submit` and hears of
freed slots through `on_free`.

A step that fails fails the requests of the group (`fault` says why, for /health). When the cause
is a lost device (an rpc server that went away or stopped answering), the group calls `on_fault`,
answers new requests with 503 at once until the device is back, and leaves the rest to the
server's PeerReconnector, which calls `abandon` and clears `fault` with the group stopped.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Optional

import numpy as np

from ..context import Batch, Context, DecodeOutput
from ..sampling import BatchSampler
from ..tokenizer import Tokenizer
from .. import trace
from . import pipe_prof
from .metrics import Metrics
from .slot import Slot, SlotState, common_prefix, token_probs
from .task import CompletionTask, ErrorEvent, EventSink, FinalEvent

log = logging.getLogger(__name__)

MAX_PROBS = 20


class PipelineGroup:
    def __init__(self, index: int, ctx: Context, slots: list[Slot], tokenizer: Tokenizer, metrics: Metrics,
                 on_free: Callable[[Slot], None], n_threads: int = 1, backend_sampling: bool = False):
        self.index = index
        self.ctx = ctx
        self.slots = slots
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.on_free = on_free
        # `lock` is held by the decode thread for a whole iteration (context and slots); the
        # inbox has its own lock so the task thread never waits behind a running step.
        self.lock = threading.Lock()
        self._wake = threading.Condition(threading.Lock())
        self._inbox: deque[list[tuple[Slot, CompletionTask]]] = deque()
        self._running = True
        self.sampler = BatchSampler(ctx.hparams.n_vocab, max(len(slots), 1), MAX_PROBS, n_threads=n_threads)
        # sampling where the logits are: only ids come back (the caller checked the device can)
        self.backend_sampling = backend_sampling
        self.sink = EventSink()
        self.fault: Optional[str] = None
        self.on_fault: Callable[[], None] = lambda: None  # a step failed because a device was lost
        self.prof = pipe_prof.profile_for(index) if pipe_prof.enabled else None
        self._tr_iter = 0   # trace time the current iteration began (0: not traced)
        self._n_rows = self._n_prompt = self._n_decode = 0
        self.thread = threading.Thread(target=self._run, name=f"decode-{index}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def request_stop(self) -> None:
        """Asks the decode thread to finish: a running step completes, then whatever still runs
        is cancelled."""
        with self._wake:
            self._running = False
            self._wake.notify()

    def stop(self, timeout: float = 30) -> bool:
        """request_stop, then waits up to `timeout`; True once the thread has ended."""
        self.request_stop()
        if self.thread.is_alive():
            self.thread.join(timeout=timeout)
        return not self.thread.is_alive()

    def submit(self, placements: list[tuple[Slot, CompletionTask]]) -> None:
        """Hands tasks to this group (from the task thread); n > 1 choices come as one list."""
        with self._wake:
            self._inbox.append(placements)
            self._wake.notify()

    def n_busy(self) -> int:
        return sum(1 for s in self.slots if s.busy)

    # ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        trace.set_group(self.index)
        while True:
            with self._wake:
                # slots change only on this thread, so reading `busy` here races with nothing
                while self._running and not self._inbox and not any(s.busy for s in self.slots):
                    self._wake.wait()
                if not self._running:
                    break
            t_want = time.perf_counter()
            with self.lock:
                t_got = time.perf_counter()
                try:
                    self._iteration()
                except Exception as exc:  # a failed step fails its requests, never the thread
                    lost = self.ctx.lost_devices()
                    if lost:  # the connection has said why (and logged it): no traceback
                        self._fail_all("; ".join(lost.values()))
                        self.on_fault()
                    else:
                        log.exception("decode step failed in group %d", self.index)
                        self._fail_all(f"decode failed: {exc}")
            t_send = time.perf_counter()
            tr_send = trace.now() if trace.enabled else 0
            self.sink.flush()
            if tr_send:
                t_end = trace.now()
                trace.event("server", "result_send", tr_send, t_end, grp=self.index, n_slots=self._n_rows)
                if self._tr_iter:
                    trace.event("server", "iteration", self._tr_iter, t_end, grp=self.index, n_slots=self._n_rows,
                                n_prompt=self._n_prompt, n_decode=self._n_decode)
            if self.prof is not None:
                self.prof.add(lock_wait=t_got - t_want, result_send=time.perf_counter() - t_send)
        for slot in self.slots:  # shutting down: whatever still runs ends as cancelled
            if slot.busy:
                self._finish(slot, None)
        self.sink.flush()

    def _iteration(self) -> None:
        self._t_iter = time.perf_counter()
        self._tr_iter = trace.now() if trace.enabled else 0
        self._n_rows = self._n_prompt = self._n_decode = 0
        while True:
            with self._wake:
                if not self._inbox:
                    break
                placements = self._inbox.popleft()
            self._place(placements)
        for slot in self.slots:
            if slot.busy and slot.task is not None and slot.task.cancelled.is_set():
                self._finish(slot, None)
        batch, rows = self._build_batch()
        if batch is None:
            self._tr_iter = 0  # nothing was submitted: not a step
            return
        t_pre = time.perf_counter()
        traced = self._tr_iter != 0
        if traced:
            t = trace.now()
            self._n_rows = len(rows)
            self._n_decode = sum(1 for s in self.slots if s.state is SlotState.GENERATING)
            self._n_prompt = len(batch) - self._n_decode
            trace.event("server", "batch_build", self._tr_iter, t, grp=self.index, n_slots=self._n_rows)
        # a logit bias is applied to host logits: a step with one takes the logits back
        if self.backend_sampling and rows and not any(slot.sampler.logit_bias is not None for slot in rows):
            packed = self.sampler.pack([slot.sampler for slot in rows])
            out = self.ctx.decode(batch, packed, self.sampler.device_spec())
        else:
            out = self.ctx.decode(batch)
        t_dec = time.perf_counter()
        if traced:
            s0, s1, s2 = self.ctx.last_spans
            trace.event("server", "submit", s0, s1, grp=self.index, n_slots=self._n_rows)
            trace.event("server", "synchronize", s1, s2, grp=self.index, n_slots=self._n_rows)
            t_post = trace.now()
        self.metrics.on_decode(sum(1 for s in self.slots if s.busy))
        self._after_decode(out, rows)
        if traced:
            trace.event("server", "post_decode", t_post, trace.now(), grp=self.index, n_slots=self._n_rows)
        if self.prof is not None:
            self.prof.add(steps=1, pre_decode=t_pre - self._t_iter, submit=self.ctx.last_submit_s,
                          synchronize=self.ctx.last_sync_s, post_decode=time.perf_counter() - t_dec)

    def _place(self, placements: list[tuple[Slot, CompletionTask]]) -> None:
        lost = self.ctx.lost_devices()
        if lost:  # nothing can run until the device is back: say so at once
            message = "; ".join(lost.values()) + "; reconnecting"
            for slot, task in placements:
                self.sink.put(task, ErrorEvent(message, 503, "unavailable_error"))
                self.on_free(slot)
            return
        parent: Optional[Slot] = None
        for slot, task in placements:
            if parent is None:
                n_keep = 0
                if task.cache_prompt:
                    n_keep = min(common_prefix(slot.cache_tokens, task.prompt), len(task.prompt) - 1)
                n_keep = self.ctx.seq_rm(slot.seq, n_keep)
                slot.start(task, n_keep)
                parent = slot
            else:
                self.ctx.seq_rm(slot.seq, 0)
                slot.start(task, 0, parent=parent)

    def _build_batch(self) -> tuple[Optional[Batch], list[Slot]]:
        """Next tokens of generating slots first, then prompt chunks within n_batch."""
        tokens: list[int] = []
        pos: list[int] = []
        seqs: list[int] = []
        want: list[bool] = []
        rows: list[Slot] = []
        for slot in self.slots:
            slot.n_pending = 0
            if slot.state is SlotState.GENERATING:
                tokens.append(slot.next_token)
                pos.append(slot.n_past)
                seqs.append(slot.seq)
                want.append(True)
                rows.append(slot)
        budget = self.ctx.n_batch - len(tokens)
        if tokens:  # generations are running: one micro-batch of prompt per step keeps their pace
            budget = min(budget, self.ctx.n_ubatch)
        for slot in self.slots:
            if slot.state is not SlotState.PROMPT or budget <= 0:
                continue
            chunk = slot.prompt[slot.i_prompt:slot.i_prompt + budget]
            start = slot.n_past
            tokens.extend(chunk)
            pos.extend(range(start, start + len(chunk)))
            seqs.extend([slot.seq] * len(chunk))
            slot.n_pending = len(chunk)
            last = slot.i_prompt + len(chunk) == len(slot.prompt)
            want.extend([False] * (len(chunk) - 1) + [last])
            if last:
                rows.append(slot)
            budget -= len(chunk)
        if not tokens:
            return None, []
        # rows must follow batch order: decode rows come first, prompt rows in slot order after
        return Batch(np.asarray(tokens), np.asarray(pos), np.asarray(seqs), np.asarray(want)), rows

    def _release_children(self, parent: Slot) -> None:
        """Choices waiting on `parent` start: sharing its prompt's whole cache blocks when the
        prompt is complete, else (the parent went away early) computing the prompt themselves."""
        for slot in self.slots:
            if slot.state is not SlotState.WAIT_PARENT or slot.parent is not parent:
                continue
            n = 0
            if parent.i_prompt == len(parent.prompt):
                n = self.ctx.seq_share(parent.seq, slot.seq, len(slot.prompt) - 1)
            slot.i_prompt = slot.n_cached = n
            slot.cache_tokens = slot.prompt[:n]
            slot.parent = None
            slot.state = SlotState.PROMPT

    def _after_decode(self, out: DecodeOutput, rows: list[Slot]) -> None:
        # the batch's tokens are now in the cache
        for slot in self.slots:
            if slot.state is SlotState.GENERATING:
                slot.cache_tokens.append(slot.next_token)
            elif slot.state is SlotState.PROMPT and slot.n_pending:
                slot.cache_tokens.extend(slot.prompt[slot.i_prompt:slot.i_prompt + slot.n_pending])
                slot.i_prompt += slot.n_pending
        if not rows:
            return
        t0 = time.perf_counter()
        tr0 = trace.now() if trace.enabled else 0
        if out.sampled is not None:
            res = self.sampler.unpack(out.sampled)
        else:
            res = self.sampler.sample(out.logits, [slot.sampler for slot in rows])
        t_sampling = time.perf_counter() - t0
        if tr0:
            trace.event("server", "sampling", tr0, trace.now(), grp=self.index, n_slots=len(rows))
        ids, probs, top_ids, top_probs = res.ids.tolist(), res.probs, res.top_ids, res.top_probs
        for i, slot in enumerate(rows):
            task = slot.task
            assert task is not None
            if slot.state is SlotState.PROMPT:
                slot.state = SlotState.GENERATING
                self.metrics.on_prompt(len(slot.prompt) - slot.n_cached, time.perf_counter() - slot.t_start)
                self._release_children(slot)
            p = None
            if task.n_probs > 0:
                p = token_probs(self.tokenizer, ids[i], float(probs[i]), top_ids[i], top_probs[i], task.n_probs)
            event, final = slot.accept(ids[i], p)
            if event is not None:
                self.sink.put(task, event)
            if final is not None:
                self._finish(slot, final)
        if self.prof is not None:
            self.prof.add(tokens=len(rows), sampling=t_sampling,
                          detokenize=sum(s.t_detok for s in rows), stop_strings=sum(s.t_stop for s in rows))
            for s in rows:
                s.t_detok = s.t_stop = 0.0

    def _finish(self, slot: Slot, final: Optional[FinalEvent]) -> None:
        task = slot.task
        if task is not None and final is not None:
            self.sink.put(task, final)
            self.metrics.on_prediction(final.n_predicted, final.predicted_ms / 1e3)
        # keep the cache consistent with what the slot remembers (a cancelled prompt may be partial)
        n = self.ctx.seq_rm(slot.seq, slot.n_past)
        del slot.cache_tokens[n:]
        slot.release()
        self._release_children(slot)
        self.on_free(slot)

    def abandon(self, reason: str) -> None:
        """After a lost device (called with `lock` held, from another thread): the requests still
        running fail, since part of their KV cache went with the device, and every slot forgets
        its cached prompt. Their events are delivered at once."""
        self._fail_all(reason)
        for slot in self.slots:
            slot.cache_tokens = []
        self.sink.flush()

    def _fail_all(self, message: str) -> None:
        self.fault = message
        for slot in self.slots:
            if slot.busy:
                if slot.task is not None:
                    self.sink.put(slot.task, ErrorEvent(message))
                slot.cache_tokens = []
                self.ctx.seq_rm(slot.seq, 0)
                slot.release()
                self.on_free(slot)
