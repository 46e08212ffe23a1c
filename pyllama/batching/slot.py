"""A slot: one sequence of a group's context, and the request it is serving.

State is carried here plainly (like a scheduler's Sequence): the tokens in the KV cache, where the
prompt stands, the sampler, the detokenizer and the stop-string matcher. The group's decode thread
is the only one that mutates a slot while it serves; the task thread only reads the fields it
needs to choose a slot, and /slots reads a snapshot.
"""
from __future__ import annotations

import enum
import math
import time
from typing import Optional

import numpy as np

from .sampling import SequenceSampler
from ..tokenizer import IncrementalDetokenizer, Tokenizer
from .constraint import Constraint
from .lazy_grammar import LazyStart
from .thinking import ThinkingBudget
from .task import CompletionTask, FinalEvent, TokenEvent


class SlotState(enum.Enum):
    IDLE = "idle"
    WAIT_PARENT = "wait_parent"  # a choice of an n > 1 request, waiting for the shared prompt
    PROMPT = "prompt"
    RECOMPUTE = "recompute"      # preempted or context-shifted: its tokens re-enter the cache, then it generates on
    GENERATING = "generating"


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n]) != np.asarray(b[:n])
    return int(x.argmax()) if x.any() else n


class StopMatcher:
    """Finds stop strings in generated text and holds back text that may start one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.max_len = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, start: int) -> tuple[int, str]:
        """(index, word) of the earliest full stop string at or after `start`, or (-1, "")."""
        best, word = -1, ""
        for s in self.stops:
            i = text.find(s, max(0, start - len(s) + 1))
            if i >= 0 and (best < 0 or i < best):
                best, word = i, s
        return best, word

    def held(self, text: str) -> int:
        """How many trailing characters could still become a stop string."""
        for n in range(min(self.max_len - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0


class Slot:
    def __init__(self, slot_id: int, group: int, seq: int, n_ctx: int, tokenizer: Tokenizer,
                 special: bool = False):
        self.id = slot_id
        self.special = special          # control tokens appear in the text and probabilities (--special)
        self.group = group
        self.seq = seq                  # sequence id inside the group's context
        self.n_ctx = n_ctx              # positions this slot may hold
        self.tokenizer = tokenizer
        self.state = SlotState.IDLE
        self.task: Optional[CompletionTask] = None
        self.cache_tokens: list[int] = []  # tokens whose K/V are in the cache, in order
        self.lora: tuple = ()           # the LoRA scales those K/V were computed with
        self.last_used = 0.0
        self.parent: Optional["Slot"] = None
        self.context_shift = False      # at the context limit: shift (True) or end the request (False)
        self._reset_request()

    def _reset_request(self) -> None:
        self.prompt: list[int] = []
        self.i_prompt = 0
        self.n_pending = 0              # prompt tokens in the batch being decoded
        self.n_cached = 0
        self.n_decoded = 0
        self.next_token = -1            # sampled, not yet in the cache
        self.sampler: Optional[SequenceSampler] = None
        self.detok: Optional[IncrementalDetokenizer] = None
        self.stopper = StopMatcher([])
        # the grammar or schema the output follows: the group feeds it each sampled token exactly
        # once, as the token is accepted, never the tokens a recomputation puts back in the cache
        self.constraint: Optional[Constraint] = None
        self.lazy: Optional[LazyStart] = None  # a lazy grammar's triggers, until one fires (then: constraint)
        self._lazy_matcher = None
        self.thinking: Optional[ThinkingBudget] = None  # the reply's thinking held to a budget of tokens
        self.text = ""
        self.n_sent = 0                 # characters of self.text already sent
        self.i_indent = 0               # n_indent: characters of self.text already looked at
        self.line_start = -1            # n_indent: where the line whose indentation is being read starts
        self.t_start = self.t_prompt_done = self.t_last = 0.0
        self.t_detok = self.t_stop = 0.0  # accumulated for PYLLAMA_PIPE_PROF
        # scheduling under a full KV pool (see group.py)
        self.priority = 0               # order of arrival: lower is older and goes first
        self.admitted = False           # its prompt (or recomputation) has been given cells
        self.recompute: list[int] = []  # RECOMPUTE: the tokens the cache must hold again
        self.exact_from = 0             # RECOMPUTE positions from here were decoded: recomputed in small steps
        self.n_prompt_path = 0          # leading cache positions that were computed as a prompt
        self.truncated = False
        self.n_preempted = 0
        self.n_shifted = 0
        self.embd_parts: list[np.ndarray] = []  # embedding tasks: the hidden rows computed so far
        self.embd_span = (0, 0)         # embedding tasks: its output rows in the step being decoded
        # speculative decoding: the tokens the next step computes after next_token, and the totals
        self.draft: list[int] = []
        self.n_draft_total = 0
        self.n_draft_accepted = 0
        self.spec_pause = 0             # steps left without drafts (SpecControl)
        self.spec_window_drafted = self.spec_window_accepted = 0

    # --- life cycle (decode thread) --------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.state is not SlotState.IDLE

    def start(self, task: CompletionTask, n_keep: int, parent: Optional["Slot"] = None, priority: int = 0) -> None:
        """Takes a task; the first n_keep prompt tokens are already in the cache."""
        self._reset_request()
        self.priority = priority
        self.task = task
        self.prompt = task.prompt
        self.i_prompt = self.n_cached = n_keep
        self.cache_tokens = task.prompt[:n_keep]
        self.sampler = SequenceSampler(task.params, task.prompt)
        self.detok = IncrementalDetokenizer(self.tokenizer, special=self.special)
        self.stopper = StopMatcher(task.stop)
        if task.matcher is not None and task.triggers:
            self.lazy, self._lazy_matcher = LazyStart(self.tokenizer, task.triggers), task.matcher
        elif task.matcher is not None:
            self.constraint = Constraint(task.matcher, self.tokenizer.n_vocab)
        elif task.thinking_budget >= 0:  # (a grammar decides a constrained reply's every token)
            self.thinking = ThinkingBudget(task.thinking_budget, task.thinking_end, task.thinking_open)
        self.parent = parent
        self.state = SlotState.WAIT_PARENT if parent is not None else SlotState.PROMPT
        self.t_start = time.perf_counter()

    def release(self) -> None:
        self.state = SlotState.IDLE
        self.task = None
        self.constraint = None
        self.lazy = self._lazy_matcher = None
        self.parent = None
        self.last_used = time.monotonic()

    @property
    def n_past(self) -> int:
        return len(self.cache_tokens)

    @property
    def feed(self) -> list[int]:
        """PROMPT / RECOMPUTE: every token the cache must hold before the next sampled one; the
        next to compute is feed[n_past]."""
        return self.recompute if self.state is SlotState.RECOMPUTE else self.prompt

    # --- generation (decode thread) --------------------------------------------------------------
    def accept(self, token: int, probs: Optional[dict]) -> tuple[Optional[TokenEvent], Optional[FinalEvent]]:
        """Records a sampled token; returns the event to send and, when the request ends, its end."""
        task = self.task
        assert task is not None and self.sampler is not None and self.detok is not None
        now = time.perf_counter()
        if self.n_decoded == 0:
            self.t_prompt_done = now
        self.t_last = now
        self.sampler.accept(token)
        eog = self.tokenizer.is_eog(token) and not task.ignore_eos
        if eog:
            return None, self._final("eos")
        self.n_decoded += 1
        self.next_token = token
        t0 = time.perf_counter()
        piece = self.detok.feed(token)
        self.text += piece
        if self.thinking is not None:
            self.thinking.observe(piece)
        if self.lazy is not None:
            self._watch_triggers(token)
        t1 = time.perf_counter()
        stop_type, word = "", ""
        if self.stopper.stops:
            i, word = self.stopper.find(self.text, self.n_sent)
            if i >= 0:
                self.text = self.text[:i]
                stop_type = "word"
        self.t_detok += t1 - t0
        self.t_stop += time.perf_counter() - t1
        cut = False
        if not stop_type and task.n_indent > 0:
            at = self._under_indented(task.n_indent)
            if at >= 0:  # as llama-server: the line's indentation stays, the rest of the text goes
                self.text, stop_type, cut = self.text[:at], "limit", True
        if not stop_type and task.t_max_predict_ms > 0 and (now - self.t_prompt_done) * 1e3 > task.t_max_predict_ms:
            # llama-server's rule for code completion: out of time, end at a line's end (a newline
            # in the text this token releases)
            hold = self.stopper.held(self.text) if self.stopper.stops else 0
            if "\n" in self.text[self.n_sent:len(self.text) - hold]:
                stop_type = "limit"
        if not stop_type and task.n_predict >= 0 and self.n_decoded >= task.n_predict:
            stop_type = "limit"
        if not stop_type and self.n_past >= self.n_ctx and not self.context_shift:
            stop_type = "limit"  # the token cannot be stored to continue: the slot's context is full
            self.truncated = True
        if not stop_type and self.constraint is not None and self.constraint.done and not self.constraint.failed:
            stop_type = "eos"  # the grammar allows nothing more but the end: the model's EOS is all that could follow
        if stop_type:
            if stop_type != "word" and not cut:
                self.text += self.detok.flush()
            event = TokenEvent(self._take_text(hold=0), token, probs, self.id)
            return event, self._final(stop_type, word)
        hold = self.stopper.held(self.text) if self.stopper.stops else 0
        event = TokenEvent(self._take_text(hold), token, probs, self.id)
        if task.timings_per_token:
            event.timings = self.timings()
        return event, None

    def _watch_triggers(self, token: int) -> None:
        """A lazy grammar: once a trigger fires, its matcher takes the text from the trigger on and
        constrains every later token (a matcher that refuses that text fails the request)."""
        assert self.lazy is not None
        start = self.lazy.feed(token)
        if start is None:
            return
        self.constraint = Constraint(self._lazy_matcher, self.tokenizer.n_vocab)
        self.lazy = self._lazy_matcher = None
        if not self.constraint.matcher.consume_tokens(start):
            self.constraint.failed = (self.constraint.error or "the grammar does not accept the text its trigger "
                                      "started") + f" (from {self.tokenizer.decode(start)!r})"

    def _under_indented(self, n_indent: int) -> int:
        """Where the first line after a newline that is indented by fewer than n_indent spaces or
        tabs shows its first other character (a newline included, as llama-server counts it), or
        -1. The text before the first newline continues the prompt's line and is never checked."""
        text = self.text
        for i in range(min(self.i_indent, len(text)), len(text)):
            c = text[i]
            if self.line_start >= 0:
                if c in " \t":
                    continue
                if i - self.line_start < n_indent:
                    return i
                self.line_start = -1
            if c == "\n":
                self.line_start = i + 1
        self.i_indent = len(text)
        return -1

    def draft_room(self) -> int:
        """Draft tokens the slot can verify: its context keeps room for the sampled token and one
        more, and a draft beyond the tokens it may still generate is wasted (as llama-server)."""
        task = self.task
        room = self.n_ctx - self.n_past - 2
        if task is not None and task.n_predict >= 0:
            room = min(room, task.n_predict - self.n_decoded - 1)
        return room

    def timings(self) -> tuple[int, float, int, float]:
        """(prompt tokens computed, prompt ms, tokens generated, generation ms) so far."""
        t_prompt = self.t_prompt_done or self.t_last
        return (len(self.prompt) - self.n_cached, (t_prompt - self.t_start) * 1e3, self.n_decoded,
                (self.t_last - t_prompt) * 1e3)

    def end_at_limit(self) -> FinalEvent:
        """Ends the request at the context limit (a context shift could free nothing)."""
        self.truncated = True
        return self._final("limit", flush=True)

    def end_without_tokens(self) -> FinalEvent:
        """Ends a request for no tokens (n_predict 0) once its prompt is in the cache."""
        self.t_prompt_done = self.t_last = time.perf_counter()
        return self._final("limit")

    def _take_text(self, hold: int) -> str:
        end = max(self.n_sent, len(self.text) - hold)
        out = self.text[self.n_sent:end]
        self.n_sent = end
        return out

    def _final(self, stop_type: str, word: str = "", flush: bool = False) -> FinalEvent:
        flush = flush or stop_type == "eos"
        tail = self._take_text(0) if flush else ""
        if flush:
            tail += self.detok.flush() if self.detok else ""
        t_prompt = self.t_prompt_done or self.t_last
        return FinalEvent(
            stop_type=stop_type, stopping_word=word, n_prompt=len(self.prompt),
            n_evaluated=len(self.prompt) - self.n_cached, n_predicted=self.n_decoded,
            prompt_ms=(t_prompt - self.t_start) * 1e3, predicted_ms=(self.t_last - t_prompt) * 1e3,
            id_slot=self.id, text_tail=tail, truncated=self.truncated, n_cache=min(self.n_past, self.n_ctx),
            n_preempted=self.n_preempted, n_shifted=self.n_shifted, draft_n=self.n_draft_total,
            draft_n_accepted=self.n_draft_accepted)

    def snapshot(self) -> dict:
        task = self.task
        return {
            "id": self.id,
            "group": self.group,
            "id_task": task.id if task else -1,
            "n_ctx": self.n_ctx,
            "is_processing": self.busy,
            "state": self.state.value,
            "n_past": self.n_past,
            "n_prompt_tokens": len(self.prompt) if task else 0,
            "n_decoded": self.n_decoded if task else 0,
            "n_preempted": self.n_preempted if task else 0,
            "n_context_shifts": self.n_shifted if task else 0,
            # as llama-server's: the request's settings (the seed drawn for it) and where generation stands
            "params": {**task.settings, "n_predict": task.n_predict, "temperature": task.params.temperature,
                       "seed": self.sampler.seed if self.sampler else task.params.seed} if task else {},
            "next_token": [{"has_next_token": self.busy, "has_new_line": "\n" in self.text,
                            "n_remain": task.n_predict - self.n_decoded if task and task.n_predict >= 0 else -1,
                            "n_decoded": self.n_decoded if task else 0}],
        }


def token_probs(tokenizer: Tokenizer, token: int, prob: float, top_ids: np.ndarray, top_probs: np.ndarray,
                n_probs: int, post_sampling: bool = False, special: bool = False) -> dict:
    """llama-server's completion_probabilities entry for one generated token, from probabilities:
    `prob` / `top_probs` when post_sampling (the sampler chain's), else `logprob` / `top_logprobs`."""
    def entry(t: int, p: float) -> dict:
        piece = tokenizer.token_bytes(t, special)
        out = {"id": t, "token": piece.decode("utf-8", errors="replace"), "bytes": list(piece)}
        if post_sampling:
            out["prob"] = p
        else:
            out["logprob"] = math.log(p) if p > 0 else -1e30  # JSON has no -inf
        return out
    out = entry(token, prob)
    out["top_probs" if post_sampling else "top_logprobs"] = [
        entry(int(t), float(p)) for t, p in zip(top_ids[:n_probs], top_probs[:n_probs]) if t >= 0]
    return out


def presampling_probs(tokenizer: Tokenizer, logits: np.ndarray, token: int, n_probs: int,
                      special: bool = False) -> dict:
    """llama-server's default completion_probabilities entry: log-probabilities of the model's own
    softmax over the raw logits (before penalties, bias, top-k/p, temperature), the n_probs most
    probable first (lower id first on ties)."""
    row = logits.astype(np.float64, copy=False)
    m = float(row.max())
    lse = m + math.log(float(np.exp(row - m).sum()))
    n = min(n_probs, row.shape[0])
    top = np.argpartition(-row, n - 1)[:n] if n > 0 else np.empty(0, dtype=np.int64)
    top = top[np.lexsort((top, -row[top]))]

    def entry(t: int) -> dict:
        piece = tokenizer.token_bytes(t, special)
        return {"id": t, "token": piece.decode("utf-8", errors="replace"), "bytes": list(piece),
                "logprob": float(row[t]) - lse}
    out = entry(token)
    out["top_logprobs"] = [entry(int(t)) for t in top]
    return out
