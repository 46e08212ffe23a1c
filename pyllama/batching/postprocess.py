"""What a step's results do to its slots: the tokens fed are in the cache now, prompts report
progress, embeddings collect their rows, and each sampled token becomes its request's events
(probabilities, grammar, thinking budget, stop conditions); a request that ends frees its slot."""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import numpy as np

from ..obs.metrics import Metrics
from ..runtime.context import Context, DecodeOutput
from ..tokenizer import Tokenizer
from .runner import Samples
from .slot import Slot, SlotState, presampling_probs, token_probs
from .task import EmbeddingEvent, ErrorEvent, EventOut, FinalEvent, ProgressEvent

log = logging.getLogger(__name__)


class Postprocessor:
    def __init__(self, ctx: Context, slots: list[Slot], tokenizer: Tokenizer, metrics: Metrics, sink: EventOut,
                 on_free: Callable[[Slot], None]):
        self.ctx = ctx
        self.slots = slots
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.sink = sink
        self.on_free = on_free

    def advance(self, out: DecodeOutput) -> None:
        """The step's tokens are in the cache now: each slot moves on by the tokens it fed."""
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

    def emit(self, rows: list[Slot], samples: Samples) -> list[Slot]:
        """Each sampled row's token becomes its request's events (a prompt that ended starts
        generating, or ends when it wants no token); returns the constrained slots that go on,
        whose next masks are wanted."""
        ids, probs, top_ids, top_probs, raw = samples
        constrained: list[Slot] = []
        for i, slot in enumerate(rows):
            if self.emit_token(slot, ids[i], float(probs[i]), top_ids[i], top_probs[i],
                               raw[i] if raw is not None and i in raw else None) and slot.constraint is not None:
                constrained.append(slot)
        return constrained

    def emit_token(self, slot: Slot, sampled: int, prob: float, top_ids: np.ndarray, top_probs: np.ndarray,
                   raw: Optional[np.ndarray]) -> bool:
        """One sampled token of `slot` becomes its request's events (`raw`: the row's logits before
        sampling, for llama-server's default probabilities); whether the request goes on."""
        task = slot.task
        assert task is not None
        if slot.state is SlotState.PROMPT:
            slot.state = SlotState.GENERATING
            slot.n_prompt_path = len(slot.prompt)
            self.metrics.on_prompt(len(slot.prompt) - slot.n_cached, time.perf_counter() - slot.t_start)
            self.release_children(slot)
            if task.n_predict == 0:  # the prompt is cached; no token is wanted
                self.finish(slot, slot.end_without_tokens())
                return False
        token = sampled
        if slot.thinking is not None:  # a spent thinking budget puts its end in place of the sample
            token = slot.thinking.replace(sampled)
        p = None
        if task.n_probs > 0 and token == sampled:  # a token put in was not sampled: it has no probabilities
            p = presampling_probs(self.tokenizer, raw, token, task.n_probs, slot.special) if raw is not None else \
                token_probs(self.tokenizer, token, prob, top_ids, top_probs, task.n_probs, post_sampling=True,
                            special=slot.special)
        if slot.constraint is not None and not slot.constraint.consume(token):
            # only a token the mask allowed can be sampled: this is the grammar engine failing
            why = slot.constraint.error or f"token {token} refused"
            self.sink.put(task, ErrorEvent(f"constrained decoding failed: {why}"))
            self.finish(slot, None)
            return False
        event, final = slot.accept(token, p)
        if final is None and slot.constraint is not None and slot.constraint.failed:  # a lazy grammar's start
            if event is not None:
                self.sink.put(task, event)
            self.sink.put(task, ErrorEvent(f"constrained decoding failed: {slot.constraint.failed}"))
            self.finish(slot, None)
            return False
        if event is not None:
            self.sink.put(task, event)
        if final is not None:
            self.finish(slot, final)
            return False
        return True

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
        self.finish(slot, None)

    def after_embeddings(self, rows: list[Slot]) -> None:
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
                self.release_children(slot)
                self.finish(slot, slot.end_without_tokens())
            else:
                self.sink.put(task, ErrorEvent("a completion cannot share a step with embeddings"))
                self.finish(slot, None)

    def finish(self, slot: Slot, final: Optional[FinalEvent]) -> None:
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
        self.release_children(slot)
        self.on_free(slot)

    def release_children(self, parent: Slot) -> None:
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

    def fail_all(self, message: str) -> None:
        """Every running request ends with the error `message`; their slots forget their cache."""
        for slot in self.slots:
            if slot.busy:
                if slot.task is not None:
                    self.sink.put(slot.task, ErrorEvent(message))
                slot.cache_tokens = []
                self.ctx.seq_rm(slot.seq, 0)
                slot.release()
                self.on_free(slot)
