"""Drafts from a small model of the target's vocabulary (llama-server's `-md`): each group keeps a
context of the draft model with a sequence per slot. Before a step, every drafting slot's draft
sequence is brought up to the slot's tokens (the common prefix kept, the rest computed in one
batch for all slots), then the draft model decodes greedily, one batched step per draft token,
stopping a slot's draft where its most probable token is less likely than --spec-draft-p-min.
The target verifies the draft (speculative.verify), so the draft decides only how many tokens a
step yields, never which."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from ..runtime.context import Batch, Context
from ..tokenizer import Tokenizer
from ..util.errors import PyllamaError
from .slot import Slot, common_prefix
from .speculative import Drafter, draft_limit

if TYPE_CHECKING:
    from ..runtime.engine import Engine

log = logging.getLogger(__name__)

# llama.cpp's bound on the difference of two vocabularies' sizes that still count as one
VOCAB_SIZE_SLACK = 128
# and the first token ids it skips when comparing their texts (control tokens vary)
VOCAB_CHECK_FROM = 5


def check_vocabularies(target: Tokenizer, draft: Tokenizer, draft_path: str) -> None:
    """Refuses (one line) a draft whose tokens do not mean the target's: a different vocabulary
    type, BOS/EOS, size (by more than llama.cpp's slack) or any token's text (llama.cpp's check;
    pyllama does not translate between vocabularies)."""
    def fail(why: str) -> None:
        raise PyllamaError(f"--model-draft {draft_path}: {why}; the draft must share the target's vocabulary "
                           "(pyllama does not translate between vocabularies)")
    if type(target) is not type(draft):
        fail(f"its vocabulary is of another kind ({type(draft).__name__}, the target's {type(target).__name__})")
    if abs(target.n_vocab - draft.n_vocab) > VOCAB_SIZE_SLACK:
        fail(f"its vocabulary has {draft.n_vocab} tokens, the target's {target.n_vocab}")
    if (target.bos_id, target.eos_id, target.add_bos) != (draft.bos_id, draft.eos_id, draft.add_bos):
        fail(f"its BOS/EOS tokens differ (BOS {draft.bos_id}, EOS {draft.eos_id}; the target's "
             f"{target.bos_id}, {target.eos_id})")
    for i in range(VOCAB_CHECK_FROM, min(target.n_vocab, draft.n_vocab)):
        if target.token_text(i) != draft.token_text(i):
            fail(f"token {i} is {draft.token_text(i)!r}, the target's {target.token_text(i)!r}")


class ModelDrafter(Drafter):
    def __init__(self, ctx: Context, n_max: int = 3, n_min: int = 0, p_min: float = 0.0):
        self.ctx = ctx
        self.n_max = n_max
        self.n_min = n_min
        self.p_min = p_min
        self.n_vocab = ctx.hparams.n_vocab
        self.cached: list[list[int]] = [[] for _ in range(ctx.kv.n_seq_max)]  # each draft sequence's tokens

    def draft(self, slots: list[Slot], afford: Optional[Callable[[list[Slot]], list[Slot]]] = None) -> None:
        if afford is not None:
            slots = afford(slots)
        wanted: list[tuple[Slot, int, int]] = []
        for slot in slots:
            limit, fewest = draft_limit(slot, self.n_max, self.n_min)
            if limit:
                wanted.append((slot, limit, fewest))
        if not wanted:
            return
        try:
            drafts = self._run(wanted)
        except Exception as exc:  # noqa: BLE001 - a failed draft costs its speed-up, never a request
            log.warning("the draft model failed (%s): this step verifies no draft", exc)
            for slot, _, _ in wanted:
                self._forget(slot.seq)
            return
        for (slot, _, fewest), draft in zip(wanted, drafts):
            slot.draft = draft if len(draft) >= fewest else []

    def _run(self, wanted: list[tuple[Slot, int, int]]) -> list[list[int]]:
        # bring each draft sequence to the slot's tokens plus its sampled one: one batch for all
        parts: list[Batch] = []
        for slot, _, _ in wanted:
            target = slot.cache_tokens + [slot.next_token]
            cached = self.cached[slot.seq]
            keep = self.ctx.seq_rm(slot.seq, min(common_prefix(cached, target), len(target) - 1))
            del cached[keep:]
            parts.append(Batch.for_sequence(target[keep:], keep, slot.seq))
            cached.extend(target[keep:])
        batch = Batch.concat(parts)
        t0 = time.perf_counter()
        out = self.ctx.decode(batch)
        if len(batch) >= 4 * len(parts) + 16:  # mostly catching up: a measure of its cost per token
            per = (time.perf_counter() - t0) / len(batch)
            old = self.catch_up_s_per_token
            self.catch_up_s_per_token = per if not old else 0.7 * old + 0.3 * per
        drafts: list[list[int]] = [[] for _ in wanted]
        going = list(range(len(wanted)))
        logits = out.logits
        for step in range(max(limit for _, limit, _ in wanted)):
            nxt = self._choose(logits)
            still: list[int] = []
            for row, i in enumerate(going):
                token = nxt[row]
                if token < 0:
                    continue  # less likely than --spec-draft-p-min: the draft ends before it
                drafts[i].append(int(token))
                if len(drafts[i]) < wanted[i][1]:
                    still.append(i)
            going = still
            if not going:
                break
            # the next draft token of each slot still drafting: one row each
            seqs = [wanted[i][0].seq for i in going]
            toks = [drafts[i][-1] for i in going]
            pos = [len(self.cached[s]) for s in seqs]
            out = self.ctx.decode(Batch(np.asarray(toks), np.asarray(pos), np.asarray(seqs),
                                        np.ones(len(going), dtype=bool)))
            for s, t in zip(seqs, toks):
                self.cached[s].append(t)
            logits = out.logits
        return drafts

    def behind(self, slot: Slot) -> int:
        return len(slot.cache_tokens) + 1 - common_prefix(self.cached[slot.seq], slot.cache_tokens)

    def _choose(self, logits: np.ndarray) -> np.ndarray:
        """Each row's most probable token (greedy, as llama.cpp drafts), or -1 where its probability
        is under p_min."""
        best = logits.argmax(axis=1)
        if self.p_min <= 0:
            return best
        top = logits[np.arange(len(best)), best][:, None]
        prob = 1.0 / np.exp(logits - top).sum(axis=1)
        return np.where(prob >= self.p_min, best, -1)

    def _forget(self, seq: int) -> None:
        self.ctx.seq_rm(seq, 0)
        self.cached[seq] = []

    def close(self) -> None:
        self.cached = [[] for _ in self.cached]


def open_draft_model(path: str, target_tokenizer: Tokenizer, n_threads: int) -> "Engine":
    """The draft model's engine on the local CPU, its vocabulary checked against the target's."""
    from ..runtime.engine import Engine  # noqa: PLC0415 - the server imports batching before runtime's engine

    engine = Engine(path, n_threads=n_threads, load=False)
    check_vocabularies(target_tokenizer, engine.tokenizer, path)
    engine.load()
    return engine
