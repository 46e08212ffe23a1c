"""The task thread: turns requests into slot assignments and keeps the queue of deferred ones.

It owns the view of which slots are taken, so it never waits on a decode thread: a group hears of
its new tasks through `PipelineGroup.submit`, and the router hears of freed slots through
`on_free`. Slot choice: the requested `id_slot`; else the free slot whose cached tokens share the
longest prefix with the prompt (when that covers more than `--slot-prompt-similarity` of it); else
the least recently used free slot. A request with n > 1 goes to one group with enough free slots
for every choice. What cannot be placed now waits and is never dropped.

Waiting is fair between requests: a request's prompts (each with its choices, placed together)
wait in a queue of their own, and a freed slot goes to the waiting request that was served least
recently, one prompt at a time, so that one request with many prompts cannot hold every other
client until all of its prompts are done.
"""
from __future__ import annotations

import logging
import queue
from collections import deque
from typing import Optional

from ..batching.group import PipelineGroup
from ..batching.slot import Slot, common_prefix
from ..batching.task import CompletionTask
from ..util.threads import Thread

log = logging.getLogger(__name__)


class _Waiting(deque):
    """The task lists of a waiting request's prompts, and whether it has been given a slot yet."""

    served = False


class Router:
    def __init__(self, groups: list[PipelineGroup], similarity: float):
        self.groups = groups
        self.slots: list[Slot] = [s for g in groups for s in g.slots]
        self.similarity = similarity
        self._commands: "queue.SimpleQueue[tuple[str, object]]" = queue.SimpleQueue()
        self._taken: set[int] = set()
        # one queue per waiting request, of its prompts' task lists; the least recently served first
        # (those never served first, in order of arrival)
        self._deferred: deque[_Waiting] = deque()
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
        for waiting in self._deferred:
            for tasks in waiting:
                for t in tasks:
                    t.cancel()

    # --- called from other threads -------------------------------------------------------------
    def submit(self, tasks: list[CompletionTask]) -> None:
        """One prompt's tasks (its choices, placed together)."""
        self.submit_request([tasks])

    def submit_request(self, task_lists: list[list[CompletionTask]]) -> None:
        """A request's prompts, each a list of tasks placed together: they take turns with the
        prompts of other waiting requests."""
        self._commands.put(("new", task_lists))

    def on_free(self, slot: Slot) -> None:
        self._commands.put(("free", slot))

    # --- the task thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            kind, arg = self._commands.get()
            if kind == "stop":
                return
            if kind == "new":
                # Free slots are ones that the waiting requests cannot use (they were offered
                # them when they were freed): the new request takes what fits, and waits for the rest.
                lists = _Waiting(arg)  # type: ignore[arg-type]
                while lists and self._place(lists[0]):
                    lists.popleft()
                    lists.served = True
                if lists:
                    self._wait(lists)
            elif kind == "free":
                self._taken.discard(arg.id)  # type: ignore[union-attr]
                self._retry_deferred()
            self.n_deferred = sum(len(w) for w in self._deferred)
            self.n_processing = len(self._taken)

    def _wait(self, lists: _Waiting) -> None:
        """Queue a request: one never served goes behind the others never served, ahead of those
        served already (its first prompt takes the next slot that no older newcomer takes)."""
        if lists.served:
            self._deferred.append(lists)
            return
        i = 0
        for w in self._deferred:
            if w.served:
                break
            i += 1
        self._deferred.insert(i, lists)

    def _retry_deferred(self) -> None:
        """Rounds over the waiting requests, each offered its next prompt in turn, until a round
        places nothing; a request that got one moves behind those that did not."""
        placed = True
        while placed and self._deferred:
            placed = False
            unserved: deque[_Waiting] = deque()
            served: list[_Waiting] = []
            for waiting in self._deferred:
                if self._place(waiting[0]):
                    placed = True
                    waiting.served = True
                    waiting.popleft()
                    while waiting and all(t.cancelled.is_set() for t in waiting[0]):
                        waiting.popleft()  # the client went away: its other prompts go too
                    if waiting:
                        served.append(waiting)
                else:
                    unserved.append(waiting)
            unserved.extend(served)
            self._deferred = unserved

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
