"""What travels between the HTTP handlers and the decode threads: tasks in, events out.

A handler makes a CompletionTask per completion and awaits its events on an asyncio queue; the
decode thread produces the events and hands each step's batch of them to the event loop in one
call (`EventSink.flush`), so a step costs one cross-thread wake-up however many slots it served.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from .sampling import SamplingParams

_task_ids = itertools.count(1)


@dataclass
class CompletionTask:
    prompt: list[int]
    params: SamplingParams
    n_predict: int = -1
    n_keep: int = 0                         # prompt tokens a context shift keeps (-1: the whole prompt)
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    n_probs: int = 0
    post_sampling_probs: bool = False       # n_probs after the sampler chain, not the model's softmax
    timings_per_token: bool = False         # every token event carries the timings so far
    return_progress: bool = False           # prompt processing reports its progress
    cache_prompt: bool = True
    embedding: bool = False                 # the prompt's pooled hidden state is the result: no sampling
    matcher: Any = None                     # constrained output: a fresh llguidance matcher (constraint.py)
    triggers: tuple = ()                    # lazy_grammar.Trigger: the matcher applies from the first one on
    thinking_budget: int = -1               # >= 0: the reply's thinking ends after this many tokens
    thinking_end: list[int] = field(default_factory=list)  # the tokens that end it (reasoning.budget_end_text)
    thinking_open: bool = False             # the prompt opened the thinking
    id_slot: int = -1
    spec_n_max: int = -1                    # speculative.n_max: at most this many draft tokens a step (-1: no cap)
    spec_n_min: int = 0                     # speculative.n_min: a shorter draft is not verified
    n_indent: int = 0                       # > 0: a generated line indented less than this ends the generation
    t_max_predict_ms: int = -1              # > 0: the first newline after this long generating ends it
    n_discard: int = 0                      # tokens a context shift drops after n_keep (0: half of the rest)
    settings: dict = field(default_factory=dict)  # the request's generation_settings, which /slots shows
    lora: tuple = ()                        # each loaded LoRA adapter's scale for this request
    index: int = 0                          # choice index within a request with n > 1
    siblings: list["CompletionTask"] = field(default_factory=list)  # the other choices, to be placed together
    id: int = field(default_factory=lambda: next(_task_ids))
    cancelled: threading.Event = field(default_factory=threading.Event)
    queue: Optional[asyncio.Queue] = None   # (index, event) for the handler, filled on the event loop
    loop: Optional[asyncio.AbstractEventLoop] = None

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class TokenEvent:
    """Text that became final with this token (may be empty while a stop string is undecided)."""

    text: str
    token: int
    probs: Optional[dict[str, Any]] = None
    id_slot: int = -1
    timings: Optional[tuple[int, float, int, float]] = None  # (prompt_n, prompt_ms, predicted_n, predicted_ms)


@dataclass
class ProgressEvent:
    """Prompt processing went on by a batch (requests with return_progress)."""

    total: int                 # prompt tokens
    cache: int                 # of them, reused from the cache
    processed: int             # of them, in the cache now
    time_ms: float


@dataclass
class FinalEvent:
    stop_type: str             # "eos", "limit", "word", "none"
    stopping_word: str
    n_prompt: int              # tokens of the prompt
    n_evaluated: int           # prompt tokens actually computed (the rest came from the cache)
    n_predicted: int
    prompt_ms: float
    predicted_ms: float
    id_slot: int
    text_tail: str = ""        # text held back by stop-string matching and released at the end
    truncated: bool = False    # the context ran out: the request was cut there or context-shifted
    n_cache: int = 0           # positions of the sequence in the KV cache at the end (at most n_ctx)
    n_preempted: int = 0       # times its cells were freed for an older request and recomputed
    n_shifted: int = 0         # context shifts
    draft_n: int = 0           # speculative decoding: tokens drafted, and of those accepted
    draft_n_accepted: int = 0


@dataclass
class EmbeddingEvent:
    """The end of an embedding task: the hidden states its pooling read (rows, n_embd), unpooled."""

    hidden: Any
    n_prompt: int
    id_slot: int


@dataclass
class ErrorEvent:
    message: str
    status: int = 500
    type: str = "server_error"


class EventOut(Protocol):
    """Where the batching core puts a step's events, and flushes them once the step is done."""

    def put(self, task: CompletionTask, event: object) -> None: ...

    def flush(self) -> None: ...


class EventList:
    """Events kept in order as (task, event), for a caller that steps the core itself (generate)."""

    def __init__(self) -> None:
        self.events: list[tuple[CompletionTask, object]] = []

    def put(self, task: CompletionTask, event: object) -> None:
        self.events.append((task, event))

    def flush(self) -> None:
        pass

    def take(self) -> list[tuple[CompletionTask, object]]:
        out, self.events = self.events, []
        return out


class EventSink:
    """Collects a step's events per task and delivers them to the event loop in one call. Its
    owner is the group's decode thread; another thread holding the group's lock may put and flush
    too (failing requests after a lost peer), hence the lock."""

    def __init__(self) -> None:
        self._pending: list[tuple[CompletionTask, object]] = []
        self._lock = threading.Lock()

    def put(self, task: CompletionTask, event: object) -> None:
        if task.queue is not None:
            with self._lock:
                self._pending.append((task, event))

    def flush(self) -> None:
        if not self._pending:
            return
        with self._lock:
            batch, self._pending = self._pending, []
        by_loop: dict[int, tuple[asyncio.AbstractEventLoop, list]] = {}
        for task, event in batch:
            by_loop.setdefault(id(task.loop), (task.loop, []))[1].append((task.queue, (task.index, event)))
        for loop, items in by_loop.values():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass


def _deliver(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)
