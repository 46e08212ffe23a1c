"""A pipeline group: one context, its slots, and the decode thread that runs them.

The thread runs the batching core (`BatchCore`) in a loop: each iteration takes newly assigned
tasks (while placements keep coming for its free slots, it waits for them: `_gather`), runs one
step (every generating slot's next token plus prompt chunks up to n_batch, decoded and sampled at
once) and publishes the step's events in one hand-off to the event loop. The task
thread never touches the context: it hands tasks over through `submit` and hears of freed slots
through `on_free`; other threads act on a slot through `when_idle` and read the KV cache's use
from `kv_use`, which the thread publishes after each step.

A step that fails fails the requests of the group (`fault` says why, for /health; the next step
that succeeds clears it). When the cause is a lost device (an rpc server that went away or stopped
answering), the group calls `on_fault`, answers new requests with 503 at once until the device is
back, and leaves the rest to the server's PeerReconnector, which calls `abandon` and clears
`fault` with the group stopped.
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

from ..obs import trace
from ..obs.metrics import Metrics
from ..obs.step_probe import StepProbe
from ..obs.steps import StepLog
from ..runtime.context import Context
from ..tokenizer import Tokenizer
from ..util.threads import Thread
from .core import BatchCore
from .prompt_cache import PromptCache
from .speculative import Drafter
from .slot import Slot
from .task import CompletionTask, EventSink, FinalEvent

log = logging.getLogger(__name__)

T = TypeVar("T")
# how often the decode thread looks again at a command waiting for a slot the router still holds
COMMAND_POLL_S = 0.02
# Before a step, while this group has free slots, the decode thread waits for more placements
# until none came for GATHER_S (GATHER_MAX_S at most): the router places a request's prompts, and
# fills the slots the last step freed, one at a time on its own thread, and a step begun at the
# first placement would leave the rest for later steps of a few sequences each (an embedding
# request of many inputs ran in 6 or 7 steps where 4 hold it).
GATHER_S = 0.0005
GATHER_MAX_S = 0.005


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


class PipelineGroup:
    def __init__(self, index: int, ctx: Context, slots: list[Slot], tokenizer: Tokenizer, metrics: Metrics,
                 on_free: Callable[[Slot], None], n_threads: int = 1, backend_sampling: bool = False,
                 context_shift: bool = False, pooling: str = "none", drafter: Optional[Drafter] = None):
        self.index = index
        self.ctx = ctx
        self.slots = slots
        self.metrics = metrics
        self.sink = EventSink()
        self.probe = StepProbe(index)  # what the steps measured, for the trace, the profile and the live view
        self.core = BatchCore(ctx, slots, tokenizer, metrics, self.sink, on_free, self.probe, n_threads,
                              backend_sampling, context_shift, pooling, name=str(index), drafter=drafter)
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
        self.fault: Optional[str] = None
        self.on_fault: Callable[[], None] = lambda: None  # a step failed because a device was lost
        self.thread = Thread(target=self._run, name=f"decode-{index}", daemon=True)
        self.freed = 0  # slots the last step freed (on_free)

    # --- set up by the server --------------------------------------------------------------------
    @property
    def prompt_cache(self) -> Optional[PromptCache]:
        """--cache-ram: prompts that slots give up, shared by every group."""
        return self.core.cache.cache

    @prompt_cache.setter
    def prompt_cache(self, cache: Optional[PromptCache]) -> None:
        self.core.cache.cache = cache

    @property
    def cache_idle_slots(self) -> bool:
        """--cache-idle-slots: idle slots are saved to the prompt cache when a request starts."""
        return self.core.cache.idle_slots

    @cache_idle_slots.setter
    def cache_idle_slots(self, on: bool) -> None:
        self.core.cache.idle_slots = on

    @property
    def on_free(self) -> Callable[[Slot], None]:
        """Told (on the decode thread) of each slot whose request ended: the router's."""
        return self.core.post.on_free

    @on_free.setter
    def on_free(self, on_free: Callable[[Slot], None]) -> None:
        def freed(slot: Slot) -> None:
            self.freed += 1  # the router may fill it before the next step (_gather)
            on_free(slot)
        self.core.post.on_free = freed

    @property
    def step_log(self) -> StepLog:
        """Every step's time and size: the live pipeline view."""
        return self.probe.steps

    def warm_up(self, token: int) -> None:
        """Before the thread starts: one step of `token` alone, decoded as the group's steps are
        (sampled on the device when the group samples there), then forgotten (llama-server's
        warm-up run)."""
        self.core.warm_up(token)

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
        """Whether a slot of this group is generating (Scheduler.generating)."""
        return self.core.scheduler.generating()

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
                lock_wait = time.perf_counter() - t_want
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
            self.probe.sending()
            self.sink.flush()
            self.probe.end(lock_wait)
        for slot in self.slots:  # shutting down: whatever still runs ends as cancelled
            if slot.busy:
                self.core.finish(slot, None)
        with self._wake:
            commands, self._commands = list(self._commands), deque()
        for c in commands:
            if c.future.set_running_or_notify_cancel():
                c.future.set_exception(RuntimeError("the server is shutting down"))
        self.sink.flush()
        self.core.close()

    def _iteration(self) -> None:
        """New tasks start, then one step runs (when a slot has work)."""
        self.probe.begin()
        self._gather()
        while True:
            with self._wake:
                if not self._inbox:
                    break
                placements = self._inbox.popleft()
            self.core.place(placements)
        if self.core.step() and self.fault is not None and not self.ctx.lost_devices():
            self.fault = None  # a step went through: the device is fine again

    def _gather(self) -> None:
        """Waits while placements keep coming for this group's free slots (GATHER_S)."""
        self.freed, freed = 0, self.freed
        end = time.perf_counter() + GATHER_MAX_S
        with self._wake:
            if not self._inbox and not freed:
                return
            while self._running and time.perf_counter() < end:
                placed = sum(len(p) for p in self._inbox)
                if placed >= sum(1 for s in self.slots if not s.busy):
                    return
                if not self._wake.wait(GATHER_S) or sum(len(p) for p in self._inbox) == placed:
                    return

    # --- slot files (POST /slots/{id}?action=save|restore: run by when_idle on the decode thread) ---
    def read_slot(self, slot: Slot) -> tuple[list[int], list[tuple[np.ndarray, np.ndarray]]]:
        return self.core.read_slot(slot)

    def write_slot(self, slot: Slot, tokens: list[int], rows: list[tuple[np.ndarray, np.ndarray]]) -> bool:
        return self.core.write_slot(slot, tokens, rows)

    def _finish(self, slot: Slot, final: Optional[FinalEvent]) -> None:
        self.core.finish(slot, final)

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
        self.core.fail_all(message)


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
        group.core.scheduler.neighbours = [g.core.scheduler for g in groups if g is not group]
        group.core.scheduler.shared_prompt_chunk = chunk
