"""Sampler chains: per-sequence parameters and state, and the batched CPU sampler.

The chain is llama.cpp's default order (penalties -> top_k -> top_p -> min_p -> temperature ->
dist, greedy when temperature <= 0) and runs in one Cython kernel call per decode step
(`pyllama._fast.sampling.sample_rows`). The Python side only packs per-row parameters: its work
per step is O(rows), never O(n_vocab), because it runs on a group's decode thread under that
group's lock.

`pack_rows` is separate from `BatchSampler.sample` because backend sampling
(`--backend-sampling`) ships exactly the same packed tensors to the device that holds the output
layer, so both paths must agree on the layout:

- fparams  float32 [n, 8]: temperature, top_p, min_p, repeat_penalty, frequency_penalty,
  presence_penalty, draw (uniform in [0, 1)), unused (0)
- iparams  int32   [n, 4]: top_k, n_probs, n_penalty_tokens, unused (0)
- penalty_tokens int32 [n, L]: the row's recent tokens, the first n_penalty_tokens valid (order
  does not matter: penalties only count occurrences)
"""
from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from pyllama._fast import sampling as _fast_sampling

# Module-level so that tests can count kernel calls; always looked up at call time.
_sample_rows = _fast_sampling.sample_rows

# llama.cpp's LLAMA_DEFAULT_SEED: "pick a random seed".
RANDOM_SEED = 0xFFFFFFFF
# Penalty tokens kept per sequence (the packed tensor's width); repeat_last_n = -1 ("the whole
# context" in llama.cpp) and larger values are capped here.
DEFAULT_WINDOW = 256

N_FPARAMS = 8
N_IPARAMS = 4
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_INT32_MAX = 2**31 - 1
# Native byte order: the packed bytes are reinterpreted by numpy as float32 / int32.
_F6 = struct.Struct("=6f")
_F2 = struct.Struct("=2f")
_I4 = struct.Struct("=4i")


@dataclass
class SamplingParams:
    """Per-request sampling parameters, with llama-server's names and defaults."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int = -1  # -1 (or 0xFFFFFFFF): a random seed, as llama.cpp
    n_probs: int = 0
    # (token ids int32, biases float32), ids strictly increasing; a bias of -inf bans the token. Added to the
    # row's logits before the chain, as llama.cpp's logit-bias sampler, which comes first.
    logit_bias: Optional[tuple[np.ndarray, np.ndarray]] = None

    def validate(self) -> None:
        """Raises ValueError naming the first out-of-range field."""

        def real(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise ValueError(f"{name} must be a number, got {v!r}")
            if not math.isfinite(v) or abs(v) > _FLOAT32_MAX:
                # (the kernel takes its parameters as float32)
                raise ValueError(f"{name} must be a finite float32 value, got {v!r}")
            return float(v)

        def integer(name: str) -> int:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"{name} must be an integer, got {v!r}")
            return int(v)

        real("temperature")  # any finite value; <= 0 means greedy
        integer("top_k")  # <= 0 means the whole vocabulary, as llama.cpp
        top_p = real("top_p")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        min_p = real("min_p")
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        rp = real("repeat_penalty")
        if rp <= 0.0:
            # The kernel divides positive logits by it.
            raise ValueError(f"repeat_penalty must be > 0, got {rp}")
        last_n = integer("repeat_last_n")
        if last_n < -1:
            raise ValueError(f"repeat_last_n must be >= -1 (-1: the whole context), got {last_n}")
        real("frequency_penalty")
        real("presence_penalty")
        seed = integer("seed")
        if not -1 <= seed <= 0xFFFFFFFF:
            raise ValueError(f"seed must be -1 or in [0, 4294967295], got {seed}")
        n_probs = integer("n_probs")
        if n_probs < 0:
            raise ValueError(f"n_probs must be >= 0, got {n_probs}")
        if self.logit_bias is not None:
            ids, bias = self.logit_bias
            if ids.dtype != np.int32 or bias.dtype != np.float32 or ids.shape != bias.shape or ids.ndim != 1:
                raise ValueError("logit_bias must be (int32 ids, float32 biases) of one length")
            if len(ids) and (ids[0] < 0 or not np.all(np.diff(ids) > 0)):
                raise ValueError("logit_bias ids must be non-negative and strictly increasing")
            if np.isnan(bias).any() or np.isposinf(bias).any():
                raise ValueError("logit_bias values must be finite or -inf")


def _random_seed() -> int:
    # Never 0xFFFFFFFF itself: a client that sends the reported seed back must get the same run,
    # not another random one.
    return random.SystemRandom().randrange(0, RANDOM_SEED)


class SequenceSampler:
    """One sequence's sampling state: its parameters, penalty window and seeded RNG."""

    def __init__(self, params: SamplingParams, context_tokens: Iterable[int] = (), *,
                 max_window: int = DEFAULT_WINDOW) -> None:
        params.validate()
        if max_window < 0:
            raise ValueError(f"max_window must be >= 0, got {max_window}")
        self.params = params
        self.logit_bias = params.logit_bias if params.logit_bias is not None and len(params.logit_bias[0]) else None
        self.seed: int = _random_seed() if params.seed in (-1, RANDOM_SEED) else int(params.seed)
        self._rng = random.Random(self.seed)

        last_n = params.repeat_last_n
        # -1: the whole context, which is as much as we keep.
        self.window: int = max_window if last_n < 0 else min(last_n, max_window)
        self._ring = np.zeros(self.window, dtype=np.int32)
        self._pos = 0  # next slot to write
        self._count = 0  # valid slots (they are [0, count) until the ring first wraps)

        # The constant part of this sequence's packed rows, as float32 bytes built once: packing
        # bytes and converting once per step is several times cheaper than numpy converting
        # nested Python sequences.
        self._fpacked = _F6.pack(params.temperature, params.top_p, params.min_p,
                                 params.repeat_penalty, params.frequency_penalty,
                                 params.presence_penalty)
        # Packed as int32: top_k <= 0 and top_k >= n_vocab both mean "all", so clamping is exact.
        self._top_k = min(max(int(params.top_k), 0), _INT32_MAX)
        self._n_probs = min(int(params.n_probs), _INT32_MAX)
        # Penalties that cannot change a logit are not worth shipping tokens for.
        self._penalized = self.window > 0 and (params.repeat_penalty != 1.0
                                               or params.frequency_penalty != 0.0
                                               or params.presence_penalty != 0.0)

        if self.window > 0:
            ctx = list(context_tokens)[-self.window:]
            n = len(ctx)
            if n:
                self._ring[:n] = ctx
                self._count = n
                self._pos = n % self.window

    def accept(self, token: int) -> None:
        """Adds a token (prompt or generated) to the penalty window."""
        if self.window == 0:
            return
        self._ring[self._pos] = token
        self._pos += 1
        if self._pos == self.window:
            self._pos = 0
        if self._count < self.window:
            self._count += 1

    def next_draw(self) -> float:
        """The next uniform draw in [0, 1) from this sequence's own seeded RNG."""
        return self._rng.random()

    def penalty_tokens(self) -> np.ndarray:
        """The tokens of the penalty window, oldest first (a copy; for inspection and tests)."""
        if self._count < self.window:
            return self._ring[:self._count].copy()
        return np.concatenate([self._ring[self._pos:], self._ring[:self._pos]])

    def _pack_penalties(self, dst: np.ndarray, row: int) -> int:
        """Writes the window into dst[row] (penalty_tokens); returns how many tokens."""
        if not self._penalized:
            return 0
        c = self._count
        width = dst.shape[1]
        if c <= width:
            # Order is irrelevant to counting, so the ring's valid slots go as they are.
            dst[row, :c] = self._ring[:c]
            return c
        # The packed window is narrower than ours: keep the most recent `width` tokens.
        tail = min(self._pos, width)
        dst[row, :tail] = self._ring[self._pos - tail:self._pos]
        rest = width - tail
        if rest:
            dst[row, tail:width] = self._ring[self.window - rest:]
        return width


@dataclass
class SampleResult:
    """Views of a BatchSampler's output arrays for the rows of one call; overwritten by the next."""

    ids: np.ndarray  # int32 [n]
    probs: np.ndarray  # float32 [n]: probability of the chosen token
    top_ids: np.ndarray  # int32 [n, max_probs]: each row's n_probs most probable, then -1
    top_probs: np.ndarray  # float32 [n, max_probs], descending, then 0


def pack_rows(samplers: Sequence[SequenceSampler], fparams: np.ndarray, iparams: np.ndarray,
              penalty_tokens: np.ndarray) -> int:
    """Packs rows [0, len(samplers)) of the sampler inputs; takes one draw per row.

    The arrays are the preallocated float32 [>= n, 8], int32 [>= n, 4] and int32 [>= n, L]
    tensors (see the module docstring). Returns the number of rows packed. O(rows * window),
    independent of n_vocab.
    """
    n = len(samplers)
    if n > fparams.shape[0] or n > iparams.shape[0] or n > penalty_tokens.shape[0]:
        raise ValueError(f"{n} rows do not fit the packed arrays ({fparams.shape[0]}, "
                         f"{iparams.shape[0]}, {penalty_tokens.shape[0]} rows)")
    if n == 0:
        return 0
    fbytes: list[bytes] = []
    ibytes: list[bytes] = []
    for i, s in enumerate(samplers):
        n_pen = s._pack_penalties(penalty_tokens, i)
        # A draw is taken for every row, greedy included, so a seeded sequence's stream does not
        # depend on its parameters or on the other rows.
        fbytes.append(s._fpacked)
        fbytes.append(_F2.pack(s.next_draw(), 0.0))
        ibytes.append(_I4.pack(s._top_k, s._n_probs, n_pen, 0))
    fparams[:n] = np.frombuffer(b"".join(fbytes), dtype=np.float32).reshape(n, N_FPARAMS)
    iparams[:n] = np.frombuffer(b"".join(ibytes), dtype=np.int32).reshape(n, N_IPARAMS)
    return n


class BatchSampler:
    """Samples the logits of one decode step; every array is preallocated.

    Not thread-safe: one instance per decode thread (pipeline group).
    """

    def __init__(self, n_vocab: int, max_rows: int, max_probs: int = 20,
                 window: int = DEFAULT_WINDOW, n_threads: int = 0) -> None:
        if n_vocab < 1:
            raise ValueError(f"n_vocab must be >= 1, got {n_vocab}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if max_probs < 0:
            raise ValueError(f"max_probs must be >= 0, got {max_probs}")
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        if n_threads < 0:
            raise ValueError(f"n_threads must be >= 0 (0: OpenMP default), got {n_threads}")
        self.n_vocab = n_vocab
        self.max_rows = max_rows
        self.max_probs = max_probs
        self.window = window
        self.n_threads = n_threads
        self.fparams = np.zeros((max_rows, N_FPARAMS), dtype=np.float32)
        self.iparams = np.zeros((max_rows, N_IPARAMS), dtype=np.int32)
        self.penalty_tokens = np.zeros((max_rows, window), dtype=np.int32)
        self.out_ids = np.zeros(max_rows, dtype=np.int32)
        self.out_prob = np.zeros(max_rows, dtype=np.float32)
        self.out_top_ids = np.full((max_rows, max_probs), -1, dtype=np.int32)
        self.out_top_probs = np.zeros((max_rows, max_probs), dtype=np.float32)
        self._packed: "np.ndarray | None" = None  # SAMPLE inputs, made on first pack()

    def sample(self, logits: np.ndarray, samplers: list[SequenceSampler]) -> SampleResult:
        """Samples row i of logits [n, n_vocab] with samplers[i]; does not call accept()."""
        n = len(samplers)
        # Refuse rather than convert: a copy here would be O(n_vocab) work on the decode thread.
        if not isinstance(logits, np.ndarray) or logits.dtype != np.float32 \
                or logits.ndim != 2 or not logits.flags.c_contiguous:
            raise ValueError("logits must be a C-contiguous 2-D float32 numpy array")
        if logits.shape != (n, self.n_vocab):
            raise ValueError(f"logits shape {logits.shape} does not match "
                             f"({n} samplers, n_vocab {self.n_vocab})")
        if n > self.max_rows:
            raise ValueError(f"{n} rows exceed max_rows={self.max_rows}")
        for s in samplers:
            if s._n_probs > self.max_probs:
                raise ValueError(f"n_probs={s._n_probs} exceeds this sampler's "
                                 f"max_probs={self.max_probs}")
        for i, s in enumerate(samplers):
            if s.logit_bias is not None:
                ids, bias = s.logit_bias
                if ids[-1] >= self.n_vocab:
                    raise ValueError(f"logit_bias names token {int(ids[-1])} beyond n_vocab {self.n_vocab}")
                logits[i, ids] += bias
        pack_rows(samplers, self.fparams, self.iparams, self.penalty_tokens)
        _sample_rows(logits, self.fparams[:n], self.iparams[:n], self.penalty_tokens[:n],
                     self.out_ids[:n], self.out_prob[:n], self.out_top_ids[:n],
                     self.out_top_probs[:n], self.n_threads)
        return SampleResult(self.out_ids[:n], self.out_prob[:n], self.out_top_ids[:n],
                            self.out_top_probs[:n])

    # --- backend sampling: the same chain on the device that holds the logits ----------------
    def device_spec(self) -> tuple[int, int]:
        """(n_probs, window) of the SAMPLE op this sampler's packed rows fit."""
        return self.max_probs, self.window

    def pack(self, samplers: list[SequenceSampler]) -> np.ndarray:
        """The rows' sampler inputs as one int32 tensor [n, 12 + window] (SAMPLE's input layout:
        fparams as float32 bits, iparams, penalty tokens). Takes each row's draw, exactly as
        sample() does, so a seeded sequence draws the same stream on either path."""
        n = len(samplers)
        if n > self.max_rows:
            raise ValueError(f"{n} rows exceed max_rows={self.max_rows}")
        for s in samplers:
            if s._n_probs > self.max_probs:
                raise ValueError(f"n_probs={s._n_probs} exceeds this sampler's max_probs={self.max_probs}")
        if self._packed is None:
            self._packed = np.zeros((self.max_rows, N_FPARAMS + N_IPARAMS + self.window), dtype=np.int32)
        pack_rows(samplers, self.fparams, self.iparams, self.penalty_tokens)
        out = self._packed[:n]
        out[:, :N_FPARAMS] = self.fparams[:n].view(np.int32)
        out[:, N_FPARAMS:N_FPARAMS + N_IPARAMS] = self.iparams[:n]
        out[:, N_FPARAMS + N_IPARAMS:] = self.penalty_tokens[:n]
        return out

    def unpack(self, sampled: np.ndarray) -> SampleResult:
        """A SampleResult from SAMPLE's packed output [n, 2 + 2 max_probs]."""
        n, N = sampled.shape[0], self.max_probs
        if sampled.shape[1] != 2 + 2 * N or n > self.max_rows:
            raise ValueError(f"sampled rows {sampled.shape} do not match max_probs={N}")
        self.out_ids[:n] = sampled[:, 0]
        self.out_prob[:n] = sampled[:, 1].view(np.float32)
        self.out_top_ids[:n] = sampled[:, 2:2 + N]
        self.out_top_probs[:n] = sampled[:, 2 + N:].view(np.float32)
        return SampleResult(self.out_ids[:n], self.out_prob[:n], self.out_top_ids[:n],
                            self.out_top_probs[:n])
