"""A pipeline group: one context, its slots, and the decode thread that runs them.

The loop is continuous batching: each iteration takes newly assigned tasks, builds one batch of
every generating slot's next token plus prompt chunks up to n_batch, decodes it, samples every
output row in one kernel call, and publishes the step's events in one hand-off to the event loop.
The task thread never touches the context: it hands tasks over through `submit` and hears of
freed slots through `on_free`.

Cells of the KV pool are handed out before each step, never by catching a failed one (see
`_schedule`): requests go first in order of arrival; a prompt waits (its slot stays queued) until
its whole prompt fits; a sequence that cannot grow takes the cells of the most recently started
one, which is preempted: its cells are freed and its prompt plus the tokens generated so far are
recomputed later, after which it generates on where it stopped (same sampler state, no text
repeated or lost). A sequence at its own context limit is context-shifted (`--context-shift`, by
recomputation as well) or ends with `truncated`.

A step that fails fails the requests of the group (`fault` says why, for /health; the next step
that succeeds clears it). When the cause is a lost device (an rpc server that went away or stopped answering), the group calls `on_fault`,
answers new requests with 503 at once until the device is back, and leaves the rest to the
server's PeerReconnector, which calls `abandon` and clears `fault` with the group stopped.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple, Optional, TypeVar

import numpy as np

from ..runtime.context import Batch, Context, DecodeOutput
from .sampling import MAX_POST_SAMPLING_PROBS, BatchSampler, SamplingParams, SequenceSampler
from ..tokenizer import Tokenizer
from ..obs import trace
from .._fast import gemm
from ..obs import pipe_prof
from .constraint import Constraint, MaskWorker, apply_masks
from ..obs.metrics import Metrics
from ..obs.steps import StepLog
from ..obs.busy import now_us
from .pooling import rows_wanted
from .prompt_cache import COPY_WAIT_S, MIN_TOKENS, PromptCache
from .slot import Slot, SlotState, common_prefix, presampling_probs, token_probs
from .task import CompletionTask, EmbeddingEvent, ErrorEvent, EventSink, FinalEvent, ProgressEvent
from ..util.threads import Thread

log = logging.getLogger(__name__)

T = TypeVar("T")
# how often the decode thread looks again at a command waiting for a slot the router still holds
COMMAND_POLL_S = 0.02


class _Command(NamedTuple):
    slot: Optional[Slot]                           # None: runs between steps whatever the slots do
    work: Callable[[], Any]
    idle: Optional[Callable[[Slot], bool]]
    future: Future


def _settle(c: _Command) -> None:
    """Runs a command's work into its future (unless the waiter gave up)."""
    if not c.future.set_running_or_notify_cancel():
        return
    try:
        c.future.set_result(c.work())
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting request
        c.future.set_exception(exc)


class KVUse(NamedTuple):
    """A group's KV cache use, published by its decode thread after every step (for /metrics)."""
    used_cells: int
    n_cells: int
    tokens_cached: int

_FEEDING = (SlotState.PROMPT, SlotState.RECOMPUTE)

# Rows up to which a step computes each row exactly as a one-row decode would (the CPU backend's
# streaming kernel sums in a fixed order whatever the row count; BLAS, above, does not). Tokens
# that were generated are recomputed in steps at most this large, so that their K/V, and so the
# text that follows, are bit for bit those of the decode steps that first computed them.
EXACT_ROWS = gemm.small_rows_max()


class PipelineGroup:
    def __init__(self, index: int, ctx: Context, slots: list[Slot], tokenizer: Tokenizer, metrics: Metrics,
                 on_free: Callable[[Slot], None], n_threads: int = 1, backend_sampling: bool = False,
                 context_shift: bool = False, pooling: str = "none"):
        self.index = index
        # Groups whose steps go through the same stages as this one's (set by the server for a
        # split). While one of them generates, this group's steps feed at most
        # `shared_prompt_chunk` prompt tokens (0: no limit), see `_schedule`.
        self.neighbours: list[PipelineGroup] = []
        self.shared_prompt_chunk = 0
        # --cache-ram: prompts that slots give up, shared by every group (set by the server)
        self.prompt_cache: Optional[PromptCache] = None
        self.cache_idle_slots = False  # --cache-idle-slots: idle slots saved there when a request starts
        # KV blocks kept out of the pool while the cache's copier reads them: (blocks, copied)
        self._held: deque[tuple[list[int], threading.Event]] = deque()
        self._came_back: set[int] = set()  # slots whose request repeated or continued an earlier prompt
        self.pooling = pooling  # of embedding tasks: which hidden rows their prompts return
        self.context_shift = context_shift
        for slot in slots:
            slot.context_shift = context_shift
        self._arrivals = 0  # requests placed so far: their order is their priority
        self.ctx = ctx
        self.slots = slots
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.on_free = on_free
        # The decode thread alone touches the context and the slots. `lock` is held by it for a
        # whole iteration, so that groups_stopped (moving layers, a peer's reconnection) finds
        # every group between steps; the inbox has its own lock so the task thread never waits
        # behind a running step. Other threads act on a slot through `when_idle` (commands the
        # decode thread runs between steps) and read the KV cache's use from `kv_use`.
        self.lock = threading.Lock()
        self._wake = threading.Condition(threading.Lock())
        self._inbox: deque[list[tuple[Slot, CompletionTask]]] = deque()
        self._commands: deque[_Command] = deque()
        self.kv_use = KVUse(ctx.kv.used_cells, ctx.kv.n_cells, ctx.kv.n_tokens_cached())
        self._running = True
        # a chosen token's probability is read only for requests with n_probs (token_probs)
        self.sampler = BatchSampler(ctx.hparams.n_vocab, max(len(slots), 1), MAX_POST_SAMPLING_PROBS,
                                    n_threads=n_threads, chosen_prob=False)
        # sampling where the logits are: only ids come back (the caller checked the device can)
        self.backend_sampling = backend_sampling
        self.sink = EventSink()
        self.fault: Optional[str] = None
        self.on_fault: Callable[[], None] = lambda: None  # a step failed because a device was lost
        self.prof = pipe_prof.profile_for(index) if pipe_prof.enabled else None
        self._masks: Optional[MaskWorker] = None  # made for the first constrained request
        self._tr_iter = 0   # trace time the current iteration began (0: not traced)
        self._n_rows = self._n_prompt = self._n_decode = 0
        self.step_log = StepLog()  # every step's time and size: the live pipeline view
        self._step = (0, 0, 0)     # (start_us, tokens, sampled rows) of the step being run, start 0: none
        self.thread = Thread(target=self._run, name=f"decode-{index}", daemon=True)

    def warm_up(self, token: int) -> None:
        """Before the thread starts: one step of `token` alone on the first slot's sequence, decoded
        as the group's steps are (sampled on the device when the group samples there), then
        forgotten. The weights' pages, the compute buffers and each device's first use are paid for
        before the first request is (llama-server's warm-up run)."""
        seq = self.slots[0].seq
        batch = Batch.for_sequence([token], 0, seq)
        try:
            if self.backend_sampling:
                greedy = SequenceSampler(SamplingParams(temperature=0.0))
                self.ctx.decode(batch, self.sampler.pack([greedy]), self.sampler.device_spec())
            else:
                self.ctx.decode(batch)
        finally:
            self.ctx.seq_rm(seq, 0)

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

    def when_idle(self, slot: Slot, work: Callable[[], T], idle: Callable[[Slot], bool]) -> "Future[T]":
        """work() on the decode thread, between steps, once idle(slot) holds (a slot action waits
        for a busy slot, as llama-server's do); its result or exception comes in the future."""
        return self._queue(_Command(slot, work, idle, Future()))

    def call(self, work: Callable[[], T]) -> "Future[T]":
        """work() on the decode thread at the end of the running step (or at once when idle): how
        other threads read the slots (GET /slots) without racing the thread that changes them."""
        return self._queue(_Command(None, work, None, Future()))

    def _queue(self, c: "_Command") -> Future:
        with self._wake:
            if self._running and self.thread.is_alive():
                self._commands.append(c)
                self._wake.notify()
                return c.future
        _settle(c)  # the thread has ended (or never started): nobody else touches the slots
        return c.future

    def _ready(self, c: "_Command") -> bool:
        return c.slot is None or (c.idle(c.slot) and not self._placing(c.slot))

    def _run_commands(self) -> None:
        """Runs the queued commands that are ready (between steps, under `lock`)."""
        with self._wake:
            ready = [c for c in self._commands if self._ready(c)]
            for c in ready:
                self._commands.remove(c)
        for c in ready:
            _settle(c)

    def _placing(self, slot: Slot) -> bool:
        """Whether a placement for the slot waits in the inbox (called with _wake held)."""
        return any(s is slot for placements in self._inbox for s, _ in placements)

    def _publish(self) -> None:
        kv = self.ctx.kv
        self.kv_use = KVUse(kv.used_cells, kv.n_cells, kv.n_tokens_cached())

    def n_busy(self) -> int:
        return sum(1 for s in self.slots if s.busy)

    def generating(self) -> bool:
        """Whether a slot of this group is generating (read by the other groups' threads: a
        state that changes under the reader only moves one step's prompt limit)."""
        return any(s.state is SlotState.GENERATING for s in self.slots)

    # ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        trace.set_group(self.index)
        while True:
            with self._wake:
                # slots change only on this thread, so reading `busy` here races with nothing; a
                # command waiting for a slot the router still holds is looked at again shortly
                # (the router frees slots without telling the group)
                while self._running and not self._inbox and not any(s.busy for s in self.slots):
                    if self._commands:
                        if self._wake.wait(COMMAND_POLL_S) or any(self._ready(c) for c in self._commands):
                            break
                    else:
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
                if self._commands:
                    self._run_commands()
                self._publish()
            t_send = time.perf_counter()
            tr_send = trace.now() if trace.enabled else 0
            self.sink.flush()
            if self._step[0]:
                self.step_log.add(self._step[0], now_us(), self._step[1], self._step[2])
                self._step = (0, 0, 0)
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
        with self._wake:
            commands, self._commands = list(self._commands), deque()
        for c in commands:
            if c.future.set_running_or_notify_cancel():
                c.future.set_exception(RuntimeError("the server is shutting down"))
        self.sink.flush()
        if self._masks is not None:
            self._masks.close()

    def _iteration(self) -> None:
        self._t_iter = time.perf_counter()
        if self._held:
            self._release_held(wait=False)
        t_iter_us = now_us()
        self._tr_iter = trace.now() if trace.enabled else 0
        self._n_rows = self._n_prompt = self._n_decode = 0
        while True:
            with self._wake:
                if not self._inbox:
                    break
                placements = self._inbox.popleft()
            try:
                self._place(placements)
            except Exception as exc:  # noqa: BLE001 - one request's start, never the group
                log.exception("starting a request failed in group %d", self.index)
                for slot, task in placements:
                    if slot.task is not task:  # not started: nothing else would answer it or free its slot
                        self.sink.put(task, ErrorEvent(f"starting the request failed: {exc}", 500, "server_error"))
                        self.on_free(slot)
        for slot in self.slots:
            if slot.busy and slot.task is not None and slot.task.cancelled.is_set():
                self._finish(slot, None)
        batch, rows = self._build_batch()
        if batch is None:
            self._tr_iter = 0  # nothing was submitted: not a step
            return
        self._step = (t_iter_us, len(batch), len(rows))
        t_pre = time.perf_counter()
        traced = self._tr_iter != 0
        if traced:
            t = trace.now()
            self._n_rows = len(rows)
            self._n_decode = sum(1 for s in self.slots if s.state is SlotState.GENERATING)
            self._n_prompt = len(batch) - self._n_decode
            trace.event("server", "batch_build", self._tr_iter, t, grp=self.index, n_slots=self._n_rows)
        # a logit bias and a grammar's token mask are applied to host logits, and pre-sampling
        # probabilities are the host logits' softmax: a step with any of them takes the logits back;
        # so does a row using a sampler the device samplers lack (SequenceSampler.device_ok)
        if any(slot.task is not None and slot.task.embedding for slot in rows):
            out = self.ctx.decode(batch, embeddings=True)  # hidden states instead of logits
        elif self.backend_sampling and rows and not any(slot.sampler.logit_bias is not None
                                                        or _wants_raw_probs(slot)
                                                        or slot.constraint is not None
                                                        or not slot.sampler.device_ok for slot in rows):
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
        if self.fault is not None and not self.ctx.lost_devices():
            self.fault = None  # a step went through: the device is fine again
        self.metrics.on_decode(sum(1 for s in self.slots if s.busy))
        self._after_decode(out, rows)
        self.metrics.on_tokens(max(slot.n_past for slot in self.slots))
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
        self._arrivals += 1
        for slot, task in placements:
            if parent is None:
                n_keep = 0
                if task.cache_prompt:
                    n_keep = min(common_prefix(slot.cache_tokens, task.prompt), len(task.prompt) - 1)
                if self.prompt_cache is not None and not task.embedding:
                    came_back = self.prompt_cache.sight(task.prompt)
                    self._save_prompt(slot, n_keep)
                    (self._came_back.add if came_back else self._came_back.discard)(slot.id)
                    if task.cache_prompt:
                        n_keep = self._load_prompt(slot, task.prompt, n_keep)
                n_keep = self.ctx.seq_rm(slot.seq, n_keep)
                slot.start(task, n_keep, priority=self._arrivals)
                parent = slot
                if task.return_progress:  # as llama-server: one event before any of the prompt is computed
                    self.sink.put(task, ProgressEvent(len(task.prompt), n_keep, n_keep, 0.0))
            else:
                self.ctx.seq_rm(slot.seq, 0)
                self._came_back.discard(slot.id)
                slot.start(task, 0, parent=parent, priority=self._arrivals)
        if self.prompt_cache is not None and self.cache_idle_slots:
            for idle in self.slots:  # (an idle slot whose request did not come back is let go when dropped)
                if idle.state is SlotState.IDLE and idle.id in self._came_back:
                    self._save_prompt(idle, 0)
        # the first token's mask is computed while the prompt is
        self._request_masks([slot for slot, _ in placements if slot.constraint is not None])

    def _request_masks(self, slots: list[Slot]) -> None:
        """Queues the next token masks of constrained slots on the mask worker."""
        if not slots:
            return
        if self._masks is None:
            self._masks = MaskWorker(f"masks-{self.index}")
        self._masks.request_mask([s.constraint for s in slots if s.constraint is not None])

    def _build_batch(self) -> tuple[Optional[Batch], list[Slot]]:
        """Next tokens of generating slots first, then prompt (and recomputation) chunks within n_batch."""
        decode, chunks = self._schedule()
        tokens: list[int] = []
        pos: list[int] = []
        seqs: list[int] = []
        want: list[bool] = []
        rows: list[Slot] = []
        for slot in decode:
            tokens.append(slot.next_token)
            pos.append(slot.n_past)
            seqs.append(slot.seq)
            want.append(True)
            rows.append(slot)
        for slot, n in chunks:
            start = slot.n_past
            tokens.extend(slot.feed[start:start + n])
            pos.extend(range(start, start + n))
            seqs.extend([slot.seq] * n)
            if slot.task is not None and slot.task.embedding:  # the rows its pooling reads
                wanted = rows_wanted(self.pooling, start, n, len(slot.prompt))
                k = int(wanted.sum())
                want.extend(wanted.tolist())
                slot.embd_span = (len(rows), len(rows) + k)
                rows.extend([slot] * k)
                continue
            # a recomputation samples nothing: the token that follows it was sampled already
            last = slot.state is SlotState.PROMPT and start + n == len(slot.prompt)
            want.extend([False] * (n - 1) + [last])
            if last:
                rows.append(slot)
        if not tokens:
            return None, []
        # rows must follow batch order: decode rows come first, prompt rows after
        return Batch(np.asarray(tokens), np.asarray(pos), np.asarray(seqs), np.asarray(want)), rows

    # --- scheduling under a full KV pool -----------------------------------------------------------
    def _schedule(self) -> tuple[list[Slot], list[tuple[Slot, int]]]:
        """Chooses this step's decode rows and prompt chunks so that their cells are free.

        Slots go in order of arrival. A generating slot that needs a block takes it from the idle
        slots' cached prompts first, then from the most recently started request holding cells
        (possibly itself), which is preempted. A prompt or recomputation that has not started waits
        until all of it fits (later arrivals wait behind it); once started, it takes what is free,
        preempting only requests newer than itself. Sets `n_pending` of every slot."""
        kv = self.ctx.kv
        for slot in self.slots:
            slot.n_pending = 0
        for slot in self.slots:  # a sequence at its context limit shifts (or ends) first
            if slot.state is SlotState.GENERATING and slot.n_past >= slot.n_ctx:
                self._shift(slot)
        order = sorted((s for s in self.slots if s.state in _FEEDING or s.state is SlotState.GENERATING),
                       key=lambda s: (s.priority, s.id))
        self._reserved = 0
        self._decode_need: dict[int, int] = {}  # slot id -> blocks its decode row takes
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
        if self.shared_prompt_chunk and any(g.generating() for g in self.neighbours):
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
            if slot.state not in _FEEDING or budget <= 0:
                continue
            feed = slot.feed
            start = slot.n_past
            if not slot.admitted:
                if blocked:
                    continue
                # all of it, plus the position of the token that follows a recomputation
                total = len(feed) + (slot.state is SlotState.RECOMPUTE)
                need_all = kv.blocks_to_grow(slot.seq, min(total, kv.seq_cap))
                while need_all > self._free() and (self._evict_idle() or self._evict_waiting(slot, order)):
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
            need = kv.blocks_to_grow(slot.seq, start + n)
            while need > self._free() and self._evict_for(slot, order, self_ok=False):
                pass
            if need > self._free():
                n = kv.room(slot.seq, self._free()) - start
                if n <= 0:
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
        return decode, chunks

    def _free(self) -> int:
        return self.ctx.kv.n_free_blocks - self._reserved

    def _evict_idle(self) -> bool:
        """Drops the cached prompt of the least recently used idle slot holding cells; first gives
        back blocks whose copy to the host cache has finished, last waits for one under way."""
        if self._release_held(wait=False):
            return True
        idle = [s for s in self.slots if s.state is SlotState.IDLE and self.ctx.kv.seq_len(s.seq)]
        if not idle:
            return bool(self._held) and self._release_held(wait=True)
        slot = min(idle, key=lambda s: s.last_used)
        if self.prompt_cache is not None:
            self._save_prompt(slot, 0)
        self.ctx.seq_rm(slot.seq, 0)
        slot.cache_tokens = []
        return True

    def _save_prompt(self, slot: Slot, n_keep: int) -> None:
        """The slot's cached prompt into the host cache when more than a block of it is about to
        be dropped (all but its first n_keep tokens), no entry holds it already and its request
        came back (see PromptCache.sight). Its blocks are held and copied by the cache's copier
        thread: the decode thread goes on at once."""
        cache = self.prompt_cache
        assert cache is not None
        # (the last token a request sampled has no KV rows yet)
        tokens = slot.cache_tokens[:self.ctx.kv.seq_len(slot.seq)]
        if len(tokens) - n_keep < MIN_TOKENS or cache.covers(tokens):
            return
        if slot.id not in self._came_back:  # a first appearance: it will most likely not come back
            cache.not_admitted()
            return
        entry = cache.reserve(tokens, self._rows_nbytes(len(tokens)))
        if entry is None:
            return
        blocks, runs = self.ctx.kv.hold(slot.seq, len(tokens))
        copied = threading.Event()
        self._held.append((blocks, copied))
        ctx, n, slot_id = self.ctx, len(tokens), slot.id

        def copy() -> None:
            t0 = time.perf_counter()
            try:
                rows = ctx.read_cells(runs, n)
            except Exception as exc:  # noqa: BLE001 - the prompt is only computed again later
                log.warning("slot %d: saving its prompt to the host cache failed: %s", slot_id, exc)
                cache.fail(entry)
                return
            finally:
                copied.set()  # the decode thread gives the blocks back (_release_held)
            if cache.fill(entry, rows):
                log.info("slot %d: %d prompt tokens saved to the host cache (%.1f ms; %d entries, %.1f MiB)",
                         slot_id, n, (time.perf_counter() - t0) * 1e3, len(cache), cache.nbytes / 2**20)

        cache.copier.submit(copy)

    def _rows_nbytes(self, n: int) -> int:
        """Bytes of n positions' K and V rows over all layers (what read_seq returns)."""
        return n * sum(layer[1] + layer[3] for layer in self.ctx.kv_layout())

    def _release_held(self, wait: bool) -> bool:
        """Gives back the blocks of finished copies (with wait, waits for the oldest copy first
        when none has finished); whether any went back. Decode thread only (the KV bookkeeping)."""
        held = self._held
        if wait and held and not any(done.is_set() for _, done in held):
            held[0][1].wait(COPY_WAIT_S)
        kept: deque[tuple[list[int], threading.Event]] = deque()
        released = False
        while held:
            blocks, done = held.popleft()
            if done.is_set():
                self.ctx.kv.release(blocks)
                released = True
            else:
                kept.append((blocks, done))
        self._held = kept
        return released

    def _load_prompt(self, slot: Slot, prompt: list[int], n_keep: int) -> int:
        """Starts the slot from the host cache's entry that shares the longest prefix with `prompt`
        when it shares more (by a block at least) than the slot's own cache and the KV pool has
        the room; returns the prompt tokens now cached."""
        cache = self.prompt_cache
        assert cache is not None
        entry, n = cache.best(prompt)
        n = min(n, len(prompt) - 1)
        if entry is None or n - n_keep < MIN_TOKENS:
            return n_keep
        n = min(n, self.ctx.kv.seq_cap)
        if not self._fits(slot, n):
            return n_keep
        t0 = time.perf_counter()
        rows = entry.wait(COPY_WAIT_S)  # a copy still under way is waited for: it is this request's prefix
        if rows is None:
            return n_keep
        try:
            self.ctx.write_seq(slot.seq, rows, n)
        except Exception as exc:  # noqa: BLE001 - the sequence is empty again: computed from the start
            log.warning("slot %d: loading a prompt from the host cache failed: %s", slot.id, exc)
            slot.cache_tokens = []
            return 0
        slot.cache_tokens = list(prompt[:n])
        log.info("slot %d: %d prompt tokens loaded from the host cache (%.1f ms)", slot.id, n,
                 (time.perf_counter() - t0) * 1e3)
        return n

    def _fits(self, slot: Slot, n: int) -> bool:
        """Whether `slot`'s sequence, emptied, could take n positions from the free blocks now
        (between steps nothing is reserved: _free() would count the last step's reservations)."""
        kv = self.ctx.kv
        self._release_held(wait=False)
        while -(-n // kv.block_size) > kv.n_free_blocks + kv.blocks_freed_by_rm(slot.seq):
            if not self._held:
                return False
            self._release_held(wait=True)
        return True

    # --- slot files (POST /slots/{id}?action=save|restore: run by when_idle on the decode thread) ---
    def read_slot(self, slot: Slot) -> tuple[list[int], list[tuple[np.ndarray, np.ndarray]]]:
        """The slot's cached tokens that have KV rows, and those rows."""
        n = self.ctx.kv.seq_len(slot.seq)
        return list(slot.cache_tokens[:n]), self.ctx.read_seq(slot.seq, n)

    def write_slot(self, slot: Slot, tokens: list[int], rows: list[tuple[np.ndarray, np.ndarray]]) -> bool:
        """The slot's cache becomes `tokens` with their rows, other idle slots' caches dropped for
        the room as a new prompt would drop them (its own cache among them); False when even that
        leaves too few cells."""
        while not self._fits(slot, len(tokens)):
            if not self._evict_idle():
                return False
        if self.prompt_cache is not None and slot.cache_tokens:
            self._save_prompt(slot, 0)
        slot.cache_tokens = []
        self.ctx.write_seq(slot.seq, rows, len(tokens))  # raises with the sequence empty
        slot.cache_tokens = list(tokens)
        return True

    def _evict_waiting(self, slot: Slot, order: list[Slot]) -> bool:
        """Drops the cached prompt prefix of the newest request that arrived after `slot` and has
        not started yet: waiting prompts must not hold the cells that older ones need to start."""
        key = (slot.priority, slot.id)
        for victim in reversed(order):
            if (victim.priority, victim.id) <= key:
                break
            if victim.state is SlotState.PROMPT and not victim.admitted and self.ctx.kv.seq_len(victim.seq):
                self.ctx.seq_rm(victim.seq, 0)
                victim.cache_tokens = []
                victim.i_prompt = victim.n_cached = 0
                return True
        return False

    def _evict_for(self, slot: Slot, order: list[Slot], self_ok: bool) -> bool:
        """Frees cells for `slot`: an idle slot's cache, else the newest request holding cells that
        arrived after `slot` (or `slot` itself when self_ok and there is none). False: nothing left."""
        if self._evict_idle():
            return True
        kv = self.ctx.kv
        key = (slot.priority, slot.id)
        scheduled = {s.id for s in self.slots if s.n_pending and s.state in _FEEDING}
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
                 len(slot.feed) if slot.state in _FEEDING else 0)

    def _shift(self, slot: Slot) -> None:
        """A generating slot whose next token has no position left: with --context-shift keeps the
        first n_keep tokens, drops half of the rest and recomputes what follows the kept ones at
        their new positions (as llama-server does, but by recomputation instead of rotating K);
        else, or when nothing can be dropped, the request ends."""
        task = slot.task
        assert task is not None
        n_past = slot.n_past
        n_keep = len(slot.prompt) if task.n_keep < 0 else task.n_keep
        n_keep = max(0, min(n_keep + int(self.tokenizer.add_bos), slot.n_ctx - 4))
        n_left = n_past - n_keep
        n_discard = max(0, min(n_left // 2, n_left - 1))
        if not slot.context_shift or n_discard <= 0:
            self._finish(slot, slot.end_at_limit())
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
            if not slot.n_pending:
                continue
            if slot.state is SlotState.GENERATING:
                slot.cache_tokens.append(slot.next_token)
            elif slot.state is SlotState.PROMPT:
                slot.cache_tokens.extend(slot.prompt[slot.i_prompt:slot.i_prompt + slot.n_pending])
                slot.i_prompt += slot.n_pending
                if slot.task is not None and slot.task.return_progress:
                    self.sink.put(slot.task, ProgressEvent(len(slot.prompt), slot.n_cached, slot.i_prompt,
                                                           (time.perf_counter() - slot.t_start) * 1e3))
                if slot.task is not None and slot.task.embedding:
                    self._embedding_step(slot, out)
            elif slot.state is SlotState.RECOMPUTE:
                n = slot.n_past
                slot.cache_tokens.extend(slot.recompute[n:n + slot.n_pending])
                if slot.n_past == len(slot.recompute):  # back where it was: its next token is pending
                    slot.recompute = []
                    slot.state = SlotState.GENERATING
        if not rows:
            return
        if out.embd is not None:
            self._after_embedding_step(rows)
            return
        t0 = time.perf_counter()
        tr0 = trace.now() if trace.enabled else 0
        raw = None  # the rows wanting pre-sampling probabilities, copied before sampling biases them
        if out.sampled is None and any(_wants_raw_probs(slot) for slot in rows):
            raw = {i: out.logits[i].copy() for i, slot in enumerate(rows) if _wants_raw_probs(slot)}
        t_mask_wait = t_mask_apply = 0.0
        if out.sampled is not None:
            res = self.sampler.unpack(out.sampled)
        else:
            masked = [i for i, slot in enumerate(rows) if slot.constraint is not None]
            if masked:
                constraints: list[Constraint] = [rows[i].constraint for i in masked]  # type: ignore[misc]
                t_mask_wait = sum(c.take_mask() for c in constraints)
                t1 = time.perf_counter()
                apply_masks(out.logits, masked, constraints)
                t_mask_apply = time.perf_counter() - t1
            res = self.sampler.sample(out.logits, [slot.sampler for slot in rows])
        t_sampling = time.perf_counter() - t0
        if tr0:
            trace.event("server", "sampling", tr0, trace.now(), grp=self.index, n_slots=len(rows))
        ids, probs, top_ids, top_probs = res.ids.tolist(), res.probs, res.top_ids, res.top_probs
        constrained: list[Slot] = []
        for i, slot in enumerate(rows):
            task = slot.task
            assert task is not None
            if slot.state is SlotState.PROMPT:
                slot.state = SlotState.GENERATING
                slot.n_prompt_path = len(slot.prompt)
                self.metrics.on_prompt(len(slot.prompt) - slot.n_cached, time.perf_counter() - slot.t_start)
                self._release_children(slot)
                if task.n_predict == 0:  # the prompt is cached; no token is wanted
                    self._finish(slot, slot.end_without_tokens())
                    continue
            sampled = ids[i]
            if slot.thinking is not None:  # a spent thinking budget puts its end in place of the sample
                ids[i] = slot.thinking.replace(sampled)
            p = None
            if task.n_probs > 0 and ids[i] == sampled:  # a token put in was not sampled: it has no probabilities
                p = presampling_probs(self.tokenizer, raw[i], ids[i], task.n_probs, slot.special) \
                    if raw is not None and i in raw else \
                    token_probs(self.tokenizer, ids[i], float(probs[i]), top_ids[i], top_probs[i], task.n_probs,
                                post_sampling=True, special=slot.special)
            if slot.constraint is not None and not slot.constraint.consume(ids[i]):
                # only a token the mask allowed can be sampled: this is the grammar engine failing
                why = slot.constraint.error or f"token {ids[i]} refused"
                self.sink.put(task, ErrorEvent(f"constrained decoding failed: {why}"))
                self._finish(slot, None)
                continue
            event, final = slot.accept(ids[i], p)
            if event is not None:
                self.sink.put(task, event)
            if final is not None:
                self._finish(slot, final)
            elif slot.constraint is not None:
                constrained.append(slot)
        # the next masks are computed while the next step is built and decoded
        self._request_masks(constrained)
        if self.prof is not None:
            self.prof.add(tokens=len(rows), sampling=t_sampling - t_mask_wait - t_mask_apply,
                          detokenize=sum(s.t_detok for s in rows), stop_strings=sum(s.t_stop for s in rows),
                          mask_wait=t_mask_wait, mask_apply=t_mask_apply)
            for s in rows:
                s.t_detok = s.t_stop = 0.0

    def _embedding_step(self, slot: Slot, out: DecodeOutput) -> None:
        """Keeps the hidden rows an embedding task's prompt chunk returned; once the whole prompt
        is computed the task ends with them (pooled and normalized by the handler)."""
        a, b = slot.embd_span
        if b > a:
            slot.embd_parts.append(out.embd[a:b].copy())  # out.embd is reused by the next decode
        if slot.i_prompt < len(slot.prompt):
            return
        task = slot.task
        assert task is not None
        hidden = np.concatenate(slot.embd_parts) if slot.embd_parts else np.zeros((0, self.ctx.hparams.n_embd),
                                                                                  dtype=np.float32)
        slot.embd_parts = []
        self.metrics.on_prompt(len(slot.prompt) - slot.n_cached, time.perf_counter() - slot.t_start)
        self.sink.put(task, EmbeddingEvent(hidden, len(slot.prompt), slot.id))
        self._finish(slot, None)

    def _after_embedding_step(self, rows: list[Slot]) -> None:
        """The other output rows of a step that returned hidden states. A server in embedding mode
        runs no completion (as llama-server), so only a prompt that wants no token (a slot
        restore) can share such a step; anything else fails rather than sample from nothing."""
        for slot in dict.fromkeys(rows):
            task = slot.task
            if task is None or task.embedding:
                continue
            if slot.state is SlotState.PROMPT and task.n_predict == 0:
                slot.state = SlotState.GENERATING
                slot.n_prompt_path = len(slot.prompt)
                self.metrics.on_prompt(len(slot.prompt) - slot.n_cached, time.perf_counter() - slot.t_start)
                self._release_children(slot)
                self._finish(slot, slot.end_without_tokens())
            else:
                self.sink.put(task, ErrorEvent("a completion cannot share a step with embeddings"))
                self._finish(slot, None)

    def _finish(self, slot: Slot, final: Optional[FinalEvent]) -> None:
        task = slot.task
        if task is not None and final is not None:
            self.sink.put(task, final)
            self.metrics.on_prediction(final.n_predicted, final.predicted_ms / 1e3)
            if log.isEnabledFor(logging.INFO):
                gen_s = final.predicted_ms / 1e3
                log.info("slot %d: task %d done (%s): prompt %d tokens (%d evaluated) in %.1f ms, %d tokens "
                         "generated in %.1f ms (%.1f tokens/s)%s", slot.id, task.id, final.stop_type,
                         final.n_prompt, final.n_evaluated, final.prompt_ms, final.n_predicted, final.predicted_ms,
                         final.n_predicted / gen_s if gen_s > 0 else 0.0,
                         (f", preempted {final.n_preempted}x" if final.n_preempted else "")
                         + (f", context shifts {final.n_shifted}" if final.n_shifted else ""))
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


def _wants_raw_probs(slot: Slot) -> bool:
    """Whether the slot's request asks for llama-server's default probabilities (the softmax of
    the raw logits), which only the host logits give."""
    task = slot.task
    return task is not None and task.n_probs > 0 and not task.post_sampling_probs


@contextmanager
def groups_stopped(groups: list[PipelineGroup], timeout: float) -> Iterator[None]:
    """Every group stopped between steps for the duration: their locks, taken in order, each waited
    for at most `timeout` seconds (TimeoutError naming the group that did not finish its step)."""
    locks = []
    try:
        for g in groups:
            if not g.lock.acquire(timeout=timeout):
                raise TimeoutError(f"pipeline group {g.index} did not finish its step within {timeout:g} s")
            locks.append(g.lock)
        yield
    finally:
        for lock in reversed(locks):
            lock.release()


def share_stages(groups: list[PipelineGroup], chunk: int) -> None:
    """Tells groups whose steps go through the same stages of a split about each other: while one
    generates, the others' steps feed at most `chunk` prompt tokens (0: no limit)."""
    if len(groups) < 2 or chunk <= 0:
        return
    log.info("pipeline groups: while another group generates, a step feeds at most %d prompt tokens", chunk)
    for group in groups:
        group.neighbours = [g for g in groups if g is not group]
        group.shared_prompt_chunk = chunk
