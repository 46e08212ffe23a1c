"""Sampler chains: per-sequence parameters and state, and the batched CPU sampler.

The chain is llama.cpp's (its common sampler): logit bias, then `samplers` in order -- by default
penalties -> dry -> top_n_sigma -> top_k -> typ_p -> top_p -> min_p -> xtc -> temperature (with
dynamic temperature when dynatemp_range > 0) -- then dist; with mirostat 1 or 2 the chain is
temperature -> mirostat instead (llama.cpp ignores `samplers` and the penalties there too). Every
row of a decode step is sampled in one Cython kernel call (`pyllama._fast.sampling.sample_rows`).
A row whose active samplers are only penalties, top_k, top_p, min_p and temperature, in that order
(llama-server's defaults), takes the kernel's bucketed fast path; any other row (typical-p, XTC,
DRY, top-n-sigma, dynamic temperature, mirostat, min_keep, another order) takes its general path,
which follows llama.cpp's samplers one by one on an explicit candidate list. The Python side only
packs per-row parameters: its work per step is O(rows + DRY history), never O(n_vocab), because it
runs on a group's decode thread under that group's lock.

`pack_rows` is separate from `BatchSampler.sample` because backend sampling
(`--backend-sampling`) ships exactly the same packed tensors to the device that holds the output
layer, so both paths must agree on the layout:

- fparams  float32 [n, 8]: temperature, top_p, min_p, repeat_penalty, frequency_penalty,
  presence_penalty, draw (uniform in [0, 1)), unused (0)
- iparams  int32   [n, 4]: top_k, n_probs, n_penalty_tokens, flags (1: the chosen token's
  probability is not wanted when n_probs is 0, so a greedy row skips the softmax; host only, 0 on the device)
- penalty_tokens int32 [n, L]: the row's recent tokens, the first n_penalty_tokens valid (order
  does not matter: penalties only count occurrences)

Rows of the general chain also pass (host only, see `SequenceSampler.device_ok`):

- xparams  float32 [n, 16]: typical_p, top_n_sigma, xtc_probability, xtc_threshold, xtc draw,
  dry_multiplier, dry_base, mirostat_tau, mirostat_eta, mirostat mu (the kernel writes the
  updated mu back), dynatemp_range, dynatemp_exponent, unused (0) x 4
- xiparams int32   [n, 24]: general chain (1; 0 = the fast path), min_keep, mirostat,
  dry_allowed_length, chain length, chain codes (SAMPLER_CODES) x 16, unused (0) x 3
- per row, the DRY history (int32, oldest first) and the DRY breaker table (`dry_breaker_table`)

The device samplers (CUDA, RPC, the CPU backend's SAMPLE op) take only the packed layout above, so
general-chain rows always sample on the host.
"""
from __future__ import annotations

import math
import random
import struct
import weakref
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from pyllama._fast import sampling as _fast_sampling

# candidates per row the sampling kernel keeps (probabilities after the sampler chain)
MAX_POST_SAMPLING_PROBS = 20

# Module-level so that tests can count kernel calls; always looked up at call time.
_sample_rows = _fast_sampling.sample_rows

# llama.cpp's LLAMA_DEFAULT_SEED: "pick a random seed".
RANDOM_SEED = 0xFFFFFFFF
# Penalty tokens kept per sequence (the packed tensor's width); repeat_last_n = -1 ("the whole
# context" in llama.cpp) and larger values are capped here.
DEFAULT_WINDOW = 256

N_FPARAMS = 8
N_IPARAMS = 4
N_XPARAMS = 16
N_XIPARAMS = 24
MAX_CHAIN = 16
# DRY history kept per sequence (dry_penalty_last_n = -1, "the context" in llama-server, and
# larger values are capped here); the kernel's repeat search is linear in it.
DRY_WINDOW = 8192

# llama.cpp's sampler names (canonical, then the alternatives its --samplers accepts) and letters,
# with the kernel's chain codes.
SAMPLER_CODES = {"penalties": 0, "dry": 1, "top_n_sigma": 2, "top_k": 3, "typ_p": 4, "top_p": 5,
                 "min_p": 6, "xtc": 7, "temperature": 8}
SAMPLER_ALIASES = {"top-k": "top_k", "top-p": "top_p", "top-n-sigma": "top_n_sigma", "nucleus": "top_p",
                   "typical-p": "typ_p", "typical": "typ_p", "typ-p": "typ_p", "typ": "typ_p",
                   "min-p": "min_p", "temp": "temperature"}
SAMPLER_LETTERS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p",
                   "p": "top_p", "m": "min_p", "x": "xtc", "t": "temperature"}
# llama.cpp samplers pyllama does not run (a request naming one is refused, never ignored).
UNSUPPORTED_SAMPLERS = {"infill": "infill", "adaptive_p": "adaptive_p", "adaptive-p": "adaptive_p",
                        "i": "infill", "a": "adaptive_p"}
DEFAULT_SAMPLERS: tuple[str, ...] = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p",
                                     "xtc", "temperature")
DEFAULT_DRY_BREAKERS: tuple[str, ...] = ("\n", ":", "\"", "*")
# llama.cpp's limits on DRY breakers: characters kept per breaker, tokens kept per breaker tail.
DRY_MAX_CHARS = 40
DRY_MAX_TAIL = 20


def parse_samplers(value: "str | Sequence[str]", *, letters: Optional[bool] = None) -> tuple[str, ...]:
    """A sampler chain as llama-server takes it: a list of names (llama.cpp's names or their
    alternatives, e.g. "top_k" or "top-k") or a string of letters ("edskypmxt"). letters=None:
    a str is letters, a list is names; letters=False: a str is one name per ';'-separated part
    (--samplers). Raises ValueError naming the first unknown or unsupported sampler."""
    if isinstance(value, str):
        items = list(value) if letters is not False else [x for x in value.split(";") if x]
        by_letter = letters is not False
    else:
        items, by_letter = list(value), False
    out = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"sampler names must be strings, got {item!r}")
        if item in UNSUPPORTED_SAMPLERS:
            raise ValueError(f"the {UNSUPPORTED_SAMPLERS[item]!r} sampler is not supported")
        name = SAMPLER_LETTERS.get(item) if by_letter else SAMPLER_ALIASES.get(item, item)
        if name not in SAMPLER_CODES:
            raise ValueError(f"unknown sampler {item!r}")
        out.append(name)
    if len(out) > MAX_CHAIN:
        raise ValueError(f"the sampler chain holds {len(out)} samplers; at most {MAX_CHAIN} are allowed")
    return tuple(out)


def dry_breaker_table(tokenizer, breakers: Sequence[str]) -> np.ndarray:
    """The token sequences that start each DRY sequence breaker, as llama.cpp builds them: every
    token whose text contains a breaker is a one-token breaker; a token whose text ends with the
    start of a breaker is a head whose tail is the tokenization of the rest (at most 20 tokens).
    Encoded for the kernel as [n, (head, offset) x n, tails] with heads ascending, a tail being
    [length, tokens...] at its offset. O(n_vocab) per breaker: cache it (`cached_breaker_table`)."""
    from pyllama.tokenizer.base import TT_CONTROL  # noqa: PLC0415 (the tokenizer imports numpy-heavy modules)
    entries: dict[int, list[tuple[int, ...]]] = {}
    texts = []
    for i in range(tokenizer.n_vocab):
        b = tokenizer.token_bytes(i)
        if not b and tokenizer.token_type(i) == TT_CONTROL:
            b = tokenizer.token_text(i).encode("utf-8")  # llama.cpp renders special tokens here
        texts.append(b)
    for brk in breakers:
        sb = brk.encode("utf-8")[:DRY_MAX_CHARS]
        if not sb:
            continue  # llama.cpp skips empty breakers
        for tid, word in enumerate(texts):
            if sb in word:
                tails = entries.setdefault(tid, [])
                if () not in tails:
                    tails.append(())
                continue
            pos = word.find(sb[:1])
            while pos != -1:
                n = min(len(sb), len(word) - pos)
                if word[pos:pos + n] == sb[:n]:
                    rest = sb[n:].decode("utf-8", errors="replace")
                    tail = tuple(tokenizer.encode(rest, add_special=False)[:DRY_MAX_TAIL])
                    tails = entries.setdefault(tid, [])
                    if tail not in tails:
                        tails.append(tail)
                pos = word.find(sb[:1], pos + 1)
    heads = sorted(entries)
    flat = [(h, t) for h in heads for t in entries[h]]
    n = len(flat)
    table = [n] + [0] * (2 * n)
    for k, (h, t) in enumerate(flat):
        table[1 + 2 * k] = h
        table[2 + 2 * k] = len(table)
        table.append(len(t))
        table.extend(t)
    return np.asarray(table, dtype=np.int32)


_BREAKER_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
BREAKER_CACHE_SIZE = 16


def cached_breaker_table(tokenizer, breakers: Sequence[str]) -> np.ndarray:
    """dry_breaker_table, computed once per tokenizer and breaker list (the last
    BREAKER_CACHE_SIZE lists: clients choose them freely, and each costs a pass over the vocabulary)."""
    per_tok = _BREAKER_CACHE.setdefault(tokenizer, {})
    key = tuple(breakers)
    table = per_tok.pop(key, None)
    if table is None:
        table = dry_breaker_table(tokenizer, key)
        table.setflags(write=False)
    per_tok[key] = table  # (dicts keep insertion order: the first key is the least recently used)
    while len(per_tok) > BREAKER_CACHE_SIZE:
        del per_tok[next(iter(per_tok))]
    return table
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_INT32_MAX = 2**31 - 1
# Native byte order: the packed bytes are reinterpreted by numpy as float32 / int32.
_F6 = struct.Struct("=6f")
_F2 = struct.Struct("=2f")
_I4 = struct.Struct("=4i")
_X16 = struct.Struct("=16f")
_XI24 = struct.Struct("=24i")


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
    typical_p: float = 1.0  # 1.0: off
    min_keep: int = 0  # candidates top_p, min_p, typical_p and xtc always leave
    top_n_sigma: float = -1.0  # <= 0: off
    xtc_probability: float = 0.0  # 0: off
    xtc_threshold: float = 0.1  # > 0.5: off
    dry_multiplier: float = 0.0  # 0: off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64  # as llama-server; -1: the context (capped at DRY_WINDOW), 0: off
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_DRY_BREAKERS
    # The breakers as token sequences (dry_breaker_table), made with the model's tokenizer; None
    # while DRY has no tokenizer to work with, in which case no token breaks a repeat.
    dry_breaker_table: Optional[np.ndarray] = None
    mirostat: int = 0  # 0: off, 1: mirostat, 2: mirostat 2.0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    dynatemp_range: float = 0.0  # 0: off
    dynatemp_exponent: float = 1.0
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS

    @property
    def dry_active(self) -> bool:
        """Whether DRY can change a logit (llama.cpp's condition)."""
        return self.dry_multiplier != 0.0 and self.dry_base >= 1.0 and self.dry_penalty_last_n != 0

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
        real("typical_p")  # >= 1 means off, as llama.cpp
        min_keep = integer("min_keep")
        if not 0 <= min_keep <= _INT32_MAX:
            raise ValueError(f"min_keep must be >= 0, got {min_keep}")
        real("top_n_sigma")  # <= 0 means off
        xp = real("xtc_probability")
        if not 0.0 <= xp <= 1.0:
            raise ValueError(f"xtc_probability must be in [0, 1], got {xp}")
        real("xtc_threshold")  # > 0.5 means off
        real("dry_multiplier")
        real("dry_base")  # < 1 means off
        dal = integer("dry_allowed_length")
        if not 0 <= dal <= _INT32_MAX:
            raise ValueError(f"dry_allowed_length must be >= 0, got {dal}")
        dl = integer("dry_penalty_last_n")
        if not -1 <= dl <= _INT32_MAX:
            raise ValueError(f"dry_penalty_last_n must be >= -1 (-1: the whole context), got {dl}")
        brk = self.dry_sequence_breakers
        if isinstance(brk, str) or not isinstance(brk, (tuple, list)) or not all(isinstance(b, str) for b in brk):
            raise ValueError("dry_sequence_breakers must be a list of strings")
        if self.dry_breaker_table is not None and (not isinstance(self.dry_breaker_table, np.ndarray)
                                                   or self.dry_breaker_table.dtype != np.int32
                                                   or self.dry_breaker_table.ndim != 1):
            raise ValueError("dry_breaker_table must be a 1-D int32 array (see dry_breaker_table)")
        m = integer("mirostat")
        if m not in (0, 1, 2):
            raise ValueError(f"mirostat must be 0, 1 or 2, got {m}")
        real("mirostat_tau")
        real("mirostat_eta")
        dr = real("dynatemp_range")
        if dr < 0.0:
            raise ValueError(f"dynatemp_range must be >= 0, got {dr}")
        real("dynatemp_exponent")
        chain = self.samplers
        if isinstance(chain, str) or not isinstance(chain, (tuple, list)):
            raise ValueError("samplers must be a list of sampler names")
        for name in chain:
            if name not in SAMPLER_CODES:
                raise ValueError(f"samplers: unknown sampler {name!r}")
        if len(chain) > MAX_CHAIN:
            raise ValueError(f"samplers holds {len(chain)} samplers; at most {MAX_CHAIN} are allowed")


def _needs_general_chain(p: SamplingParams, penalized: bool) -> bool:
    """Whether a row needs the kernel's general chain: anything but penalties, top_k, top_p, min_p and
    temperature, active in that order (the samplers that are off do not count)."""
    if p.mirostat:
        return True
    active = []
    for name in p.samplers:
        if name == "penalties":
            on = penalized
        elif name == "top_k":
            on = p.top_k > 0
        elif name == "top_p":
            on = p.top_p < 1.0
        elif name == "min_p":
            on = p.min_p > 0.0
        elif name == "temperature":
            if p.dynatemp_range > 0.0:
                return True
            on = True
        elif name == "dry":
            on = p.dry_active
        elif name == "top_n_sigma":
            on = p.top_n_sigma > 0.0
        elif name == "typ_p":
            on = p.typical_p < 1.0
        elif name == "xtc":
            on = p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5
        else:
            on = True
        if on:
            active.append(name)
    fast = [n for n, on in (("penalties", penalized), ("top_k", p.top_k > 0), ("top_p", p.top_p < 1.0),
                            ("min_p", p.min_p > 0.0), ("temperature", True)) if on]
    if active != fast:
        return True
    # min_keep changes what top_p and min_p keep
    return p.min_keep > 0 and (p.top_p < 1.0 or p.min_p > 0.0)


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

        context = list(context_tokens)
        if self.window > 0:
            ctx = context[-self.window:]
            n = len(ctx)
            if n:
                self._ring[:n] = ctx
                self._count = n
                self._pos = n % self.window

        # The general chain (see the module docstring): which rows need it, and their constant inputs.
        self.general: bool = _needs_general_chain(params, self._penalized)
        chain = [] if params.mirostat else [SAMPLER_CODES[n] for n in params.samplers]
        self._xi_packed = _XI24.pack(1, int(params.min_keep), int(params.mirostat), int(params.dry_allowed_length),
                                     len(chain), *chain, *([0] * (N_XIPARAMS - 5 - len(chain))))
        self._x_const = (params.typical_p, params.top_n_sigma, params.xtc_probability, params.xtc_threshold,
                         params.dry_multiplier, params.dry_base, params.mirostat_tau, params.mirostat_eta,
                         params.dynatemp_range, params.dynatemp_exponent)
        # mirostat's running surprise target, updated by every sampled step (llama.cpp: mu starts at 2 tau)
        self.mu: float = float(np.float32(2.0 * params.mirostat_tau))
        # XTC's own draw, taken each step only when XTC can act, so other rows' streams are unchanged.
        self._xtc_draws = (self.general and not params.mirostat and "xtc" in params.samplers
                           and params.xtc_probability > 0.0 and params.xtc_threshold <= 0.5)
        # DRY history, oldest first, in a buffer twice the window so that appending is amortized O(1)
        # and the window is always one contiguous slice.
        dry_on = self.general and not params.mirostat and "dry" in params.samplers and params.dry_active
        last_n = params.dry_penalty_last_n
        self.dry_window: int = 0 if not dry_on else (DRY_WINDOW if last_n < 0 else min(last_n, DRY_WINDOW))
        self._dry_buf = np.zeros(2 * self.dry_window, dtype=np.int32)
        self._dry_len = 0
        self.dry_breakers: Optional[np.ndarray] = params.dry_breaker_table if self.dry_window else None
        if self.dry_window:
            ctx = context[-self.dry_window:]
            self._dry_buf[:len(ctx)] = ctx
            self._dry_len = len(ctx)

    @property
    def device_ok(self) -> bool:
        """Whether the device samplers (CUDA, RPC, the CPU backend's SAMPLE op) can sample this row:
        they run only the default chain, so rows of the general chain sample on the host."""
        return not self.general

    def dry_tokens(self) -> Optional[np.ndarray]:
        """The DRY history, oldest first (a view, valid until the next accept), or None when DRY is off."""
        if not self.dry_window:
            return None
        return self._dry_buf[max(0, self._dry_len - self.dry_window):self._dry_len]

    def accept(self, token: int) -> None:
        """Adds a token (prompt or generated) to the penalty window and the DRY history."""
        if self.dry_window:
            if self._dry_len == len(self._dry_buf):
                w = self.dry_window
                self._dry_buf[:w] = self._dry_buf[w:]
                self._dry_len = w
            self._dry_buf[self._dry_len] = token
            self._dry_len += 1
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
    probs: np.ndarray  # float32 [n]: probability of the chosen token (NaN for a greedy row without n_probs)
    top_ids: np.ndarray  # int32 [n, max_probs]: each row's n_probs most probable, then -1
    top_probs: np.ndarray  # float32 [n, max_probs], descending, then 0


def pack_rows(samplers: Sequence[SequenceSampler], fparams: np.ndarray, iparams: np.ndarray,
              penalty_tokens: np.ndarray, flags: int = 0) -> int:
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
        ibytes.append(_I4.pack(s._top_k, s._n_probs, n_pen, flags))
    fparams[:n] = np.frombuffer(b"".join(fbytes), dtype=np.float32).reshape(n, N_FPARAMS)
    iparams[:n] = np.frombuffer(b"".join(ibytes), dtype=np.int32).reshape(n, N_IPARAMS)
    return n


def pack_general_rows(samplers: Sequence[SequenceSampler], xparams: np.ndarray, xiparams: np.ndarray
                      ) -> tuple[bool, list, list]:
    """Packs the general-chain inputs of rows [0, len(samplers)) (zeros for fast-path rows) after
    pack_rows; takes each XTC row's second draw. Returns (any general row, DRY histories, DRY
    breaker tables), the lists holding None for rows without DRY."""
    n = len(samplers)
    if not any(s.general for s in samplers):
        return False, [], []
    xb: list[bytes] = []
    xib: list[bytes] = []
    hist: list = []
    brk: list = []
    zero_x = bytes(4 * N_XPARAMS)
    zero_xi = bytes(4 * N_XIPARAMS)
    for s in samplers:
        if not s.general:
            xb.append(zero_x)
            xib.append(zero_xi)
            hist.append(None)
            brk.append(None)
            continue
        c = s._x_const
        xtc_draw = s.next_draw() if s._xtc_draws else 1.0
        xb.append(_X16.pack(c[0], c[1], c[2], c[3], xtc_draw, c[4], c[5], c[6], c[7], s.mu, c[8], c[9],
                            0.0, 0.0, 0.0, 0.0))
        xib.append(s._xi_packed)
        hist.append(s.dry_tokens())
        brk.append(s.dry_breakers)
    xparams[:n] = np.frombuffer(b"".join(xb), dtype=np.float32).reshape(n, N_XPARAMS)
    xiparams[:n] = np.frombuffer(b"".join(xib), dtype=np.int32).reshape(n, N_XIPARAMS)
    return True, hist, brk


class BatchSampler:
    """Samples the logits of one decode step; every array is preallocated.

    Not thread-safe: one instance per decode thread (pipeline group).
    """

    def __init__(self, n_vocab: int, max_rows: int, max_probs: int = 20,
                 window: int = DEFAULT_WINDOW, n_threads: int = 0, chosen_prob: bool = True) -> None:
        """chosen_prob=False: the caller reads `probs` only for rows with n_probs > 0 (the others
        may be NaN), which spares greedy rows the softmax over the vocabulary."""
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
        self._flags = 0 if chosen_prob else 1
        self.fparams = np.zeros((max_rows, N_FPARAMS), dtype=np.float32)
        self.iparams = np.zeros((max_rows, N_IPARAMS), dtype=np.int32)
        self.penalty_tokens = np.zeros((max_rows, window), dtype=np.int32)
        self.out_ids = np.zeros(max_rows, dtype=np.int32)
        self.out_prob = np.zeros(max_rows, dtype=np.float32)
        self.out_top_ids = np.full((max_rows, max_probs), -1, dtype=np.int32)
        self.out_top_probs = np.zeros((max_rows, max_probs), dtype=np.float32)
        self.xparams = np.zeros((max_rows, N_XPARAMS), dtype=np.float32)
        self.xiparams = np.zeros((max_rows, N_XIPARAMS), dtype=np.int32)
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
        pack_rows(samplers, self.fparams, self.iparams, self.penalty_tokens, self._flags)
        general, hist, brk = pack_general_rows(samplers, self.xparams, self.xiparams)
        if general:
            _sample_rows(logits, self.fparams[:n], self.iparams[:n], self.penalty_tokens[:n],
                         self.out_ids[:n], self.out_prob[:n], self.out_top_ids[:n],
                         self.out_top_probs[:n], self.n_threads, self.xparams[:n], self.xiparams[:n],
                         hist, brk)
            for i, s in enumerate(samplers):
                if s.params.mirostat:
                    s.mu = float(self.xparams[i, 9])  # the kernel's mirostat update
        else:
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
            if not s.device_ok:
                raise ValueError("a row of the general sampler chain cannot sample on the device (device_ok)")
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
