"""The task thread: turns requests into slot assignments and keeps the queue of deferred ones.

It owns the view of which slots are taken, so it never waits on a decode thread: a group hears of
its new tasks through `PipelineGroup.submit`, and the router hears of freed slots through
`on_free`. Slot choice: the requested `id_slot`; else the free slot whose cached tokens share the
longest prefix with the prompt (when that covers more than `--slot-prompt-similarity` of it); else
the least recently used free slot. A request with n > 1 goes to one group with enough free slots
for every choice. What cannot be placed now waits, in order, and is never dropped.
"""
from __future__ import annotations

import logging
import queue
from collections import deque
from typing import Optional

from .group import PipelineGroup
from .slot import Slot, common_prefix
from .task import CompletionTask
from ..threads import Thread

log = logging.getLogger(__name__)


class Router:
    def __init__(self, groups: list[PipelineGroup], similarity: float):
        self.groups = groups
        self.slots: list[Slot] = [s for g in groups for s in g.slots]
        self.similarity = similarity
        self._commands: "queue.SimpleQueue[tuple[str, object]]" = queue.SimpleQueue()
        self._taken: set[int] = set()
        self._deferred: deque[list[CompletionTask]] = deque()
        self.n_deferred = 0
        self.n_processing = 0
        self.thread = Thread(target=self._run, name="tasks", daemon=True)
        for g in groups:
            g.on_free = self.on_free

    def start(self) -> None:
        self.thread.start()

    @property
    def taken(self) -> set[int]:
        """Ids of the slots handed a task (busy, or about to be): read by /slots from the event loop."""
        return self._taken

    def stop(self) -> None:
        self._commands.put(("stop", None))
        self.thread.join(timeout=10)
        for tasks in self._deferred:
            for t in tasks:
                t.cancel()

    # --- called from other threads -------------------------------------------------------------
    def submit(self, tasks: list[CompletionTask]) -> None:
        self._commands.put(("new", tasks))

    def on_free(self, slot: Slot) -> None:
        self._commands.put(("free", slot))

    # --- the task thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            kind, arg = self._commands.get()
            if kind == "stop":
                return
            if kind == "new":
                tasks: list[CompletionTask] = arg  # type: ignore[assignment]
                if not self._place(tasks):
                    self._deferred.append(tasks)
            elif kind == "free":
                self._taken.discard(arg.id)  # type: ignore[union-attr]
                self._retry_deferred()
            self.n_deferred = len(self._deferred)
            self.n_processing = len(self._taken)

    def _retry_deferred(self) -> None:
        waiting = len(self._deferred)
        for _ in range(waiting):
            tasks = self._deferred.popleft()
            if not self._place(tasks):
                self._deferred.append(tasks)

    def _free_in(self, group: PipelineGroup) -> list[Slot]:
        return [s for s in group.slots if s.id not in self._taken]

    def _place(self, tasks: list[CompletionTask]) -> bool:
        first = tasks[0]
        if all(t.cancelled.is_set() for t in tasks):
            return True  # the client went away while it waited
        n = len(tasks)
        chosen: Optional[Slot] = None
        if first.id_slot >= 0:
            slot = self.slots[first.id_slot]
            if slot.id in self._taken or len(self._free_in(self.groups[slot.group])) < n:
                return False
            chosen = slot
        else:
            candidates = [s for g in self.groups if len(self._free_in(g)) >= n for s in self._free_in(g)]
            if not candidates:
                return False
            best, best_len = None, 0
            for s in candidates:
                lcp = common_prefix(s.cache_tokens, first.prompt)
                if lcp > best_len:
                    best, best_len = s, lcp
            if best is not None and best_len > self.similarity * len(first.prompt):
                chosen = best
            else:
                chosen = min(candidates, key=lambda s: s.last_used)
        group = self.groups[chosen.group]
        others = sorted((s for s in self._free_in(group) if s is not chosen), key=lambda s: s.last_used)[:n - 1]
        placements = list(zip([chosen] + others, tasks))
        for slot, _ in placements:
            self._taken.add(slot.id)
        group.submit(placements)
        return True
