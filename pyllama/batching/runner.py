"""From a step plan to samples: the batch the plan computes, the decode (sampled on the device
when every row allows it, hidden states for embeddings, else logits), and sampling with grammar
masks applied."""
from __future__ import annotations

import time
from typing import NamedTuple, Optional

import numpy as np

from ..obs.step_probe import StepProbe
from ..runtime.context import Batch, Context, DecodeOutput
from .constraint import Constraint, MaskWorker, apply_masks
from .pooling import rows_wanted
from .sampling import MAX_POST_SAMPLING_PROBS, BatchSampler, SamplingParams, SequenceSampler
from .scheduler import StepPlan
from .slot import Slot, SlotState


class Samples(NamedTuple):
    """A step's sampled rows, in batch order (decode rows first, then prompts that ended)."""
    ids: list[int]
    probs: np.ndarray          # of each chosen token, where the sampler reports it
    top_ids: np.ndarray        # the candidates after the sampler chain (n_probs requests)
    top_probs: np.ndarray
    raw: Optional[dict[int, np.ndarray]]  # row -> its logits before sampling, for llama-server's default probabilities


def wants_raw_probs(slot: Slot) -> bool:
    """Whether the slot's request asks for llama-server's default probabilities (the softmax of
    the raw logits), which only the host logits give."""
    task = slot.task
    return task is not None and task.n_probs > 0 and not task.post_sampling_probs


class Runner:
    def __init__(self, ctx: Context, n_slots: int, probe: StepProbe, n_threads: int = 1,
                 backend_sampling: bool = False, pooling: str = "none", name: str = "0"):
        self.ctx = ctx
        self.probe = probe
        self.pooling = pooling  # of embedding tasks: which hidden rows their prompts return
        self.name = name
        # a chosen token's probability is read only for requests with n_probs (token_probs)
        self.sampler = BatchSampler(ctx.hparams.n_vocab, max(n_slots, 1), MAX_POST_SAMPLING_PROBS,
                                    n_threads=n_threads, chosen_prob=False)
        # sampling where the logits are: only ids come back (the caller checked the device can)
        self.backend_sampling = backend_sampling
        self._masks: Optional[MaskWorker] = None  # made for the first constrained request

    def warm_up(self, seq: int, token: int) -> None:
        """One step of `token` alone on sequence `seq`, decoded as steps are (sampled on the device
        when steps sample there), then forgotten: the weights' pages, the compute buffers and each
        device's first use are paid for before the first request is (llama-server's warm-up run)."""
        batch = Batch.for_sequence([token], 0, seq)
        try:
            if self.backend_sampling:
                greedy = SequenceSampler(SamplingParams(temperature=0.0))
                self.ctx.decode(batch, self.sampler.pack([greedy]), self.sampler.device_spec())
            else:
                self.ctx.decode(batch)
        finally:
            self.ctx.seq_rm(seq, 0)

    def build(self, plan: StepPlan) -> tuple[Optional[Batch], list[Slot]]:
        """The plan's tokens as one batch (decode rows first, then the chunks), and the slot of
        each output row, in batch order."""
        tokens: list[int] = []
        pos: list[int] = []
        seqs: list[int] = []
        want: list[bool] = []
        rows: list[Slot] = []
        for slot in plan.decode:  # its sampled token, then any draft: a row each
            n = 1 + len(slot.draft)
            tokens.append(slot.next_token)
            tokens.extend(slot.draft)
            pos.extend(range(slot.n_past, slot.n_past + n))
            seqs.extend([slot.seq] * n)
            want.extend([True] * n)
            rows.extend([slot] * n)
        for slot, n in plan.chunks:
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
        return Batch(np.asarray(tokens), np.asarray(pos), np.asarray(seqs), np.asarray(want)), rows

    def decode(self, batch: Batch, rows: list[Slot]) -> DecodeOutput:
        # a logit bias and a grammar's token mask are applied to host logits, and pre-sampling
        # probabilities are the host logits' softmax: a step with any of them takes the logits back;
        # so does a row using a sampler the device samplers lack (SequenceSampler.device_ok)
        if any(slot.task is not None and slot.task.embedding for slot in rows):
            out = self.ctx.decode(batch, embeddings=True)  # hidden states instead of logits
        elif self.backend_sampling and rows and not any(slot.sampler.logit_bias is not None
                                                        or slot.draft  # rows sampled in turn: speculative.verify
                                                        or wants_raw_probs(slot)
                                                        or slot.constraint is not None
                                                        or not slot.sampler.device_ok for slot in rows):
            packed = self.sampler.pack([slot.sampler for slot in rows])
            out = self.ctx.decode(batch, packed, self.sampler.device_spec())
        else:
            out = self.ctx.decode(batch)
        self.probe.decoded(self.ctx)
        return out

    def sample(self, out: DecodeOutput, rows: list[Slot]) -> Samples:
        """The rows' tokens: as the device sampled them, or sampled here from the logits after the
        grammar masks are applied. (Drafted slots' rows are not among them: speculative.verify.)"""
        self.probe.sampling()
        raw = None  # the rows wanting pre-sampling probabilities, copied before sampling biases them
        if out.sampled is None and any(wants_raw_probs(slot) for slot in rows):
            raw = {i: out.logits[i].copy() for i, slot in enumerate(rows) if wants_raw_probs(slot)}
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
        self.probe.sampled(t_mask_wait, t_mask_apply)
        return Samples(res.ids.tolist(), res.probs, res.top_ids, res.top_probs, raw)

    def request_masks(self, slots: list[Slot]) -> None:
        """Queues the next token masks of constrained slots on the mask worker (computed while the
        next step is built and decoded)."""
        if not slots:
            return
        if self._masks is None:
            self._masks = MaskWorker(f"masks-{self.name}")
        self._masks.request_mask([s.constraint for s in slots if s.constraint is not None])

    def close(self) -> None:
        if self._masks is not None:
            self._masks.close()
