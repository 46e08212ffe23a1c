"""The full sampler set (typical-p, XTC, DRY, mirostat 1 and 2, dynamic temperature, top-n-sigma,
min_keep, any chain order) against an independent reference written from llama.cpp's sampler
definitions, on fixed logits: same kept candidates, same probabilities, same pick; then the
request fields, the command line and backend sampling's host fallback."""
from __future__ import annotations

import json
import math
from collections import Counter
from typing import Optional

import numpy as np
import pytest

from pyllama.batching.sampling import (DEFAULT_SAMPLERS, BatchSampler, SamplingParams, SequenceSampler, dry_breaker_table,
                              parse_samplers)
from server_util import RPCServerProcess, ServerProcess

V = 64


# --- the reference: llama.cpp's samplers, one by one, in plain numpy -------------------------------
class Ref:
    """A candidate list (ids, logits) with llama.cpp's `sorted` flag; ties sort by lower id."""

    def __init__(self, logits: np.ndarray):
        self.ids = np.arange(len(logits))
        self.lg = logits.astype(np.float64).copy()
        self.sorted = False

    def sort(self) -> None:
        if not self.sorted:
            o = np.lexsort((self.ids, -self.lg))
            self.ids, self.lg = self.ids[o], self.lg[o]
            self.sorted = True

    def probs(self) -> np.ndarray:
        e = np.exp(self.lg - self.lg.max())
        return e / e.sum()

    def keep(self, idx) -> None:
        self.ids, self.lg = self.ids[idx], self.lg[idx]


def ref_penalties(c: Ref, window: list[int], rp: float, fq: float, pr: float) -> None:
    counts = Counter(window)
    for i, t in enumerate(c.ids):
        n = counts.get(int(t), 0)
        if n:
            v = c.lg[i] * rp if c.lg[i] <= 0 else c.lg[i] / rp
            c.lg[i] = v - (n * fq + pr)
    c.sorted = False


def ref_dry(c: Ref, hist: list[int], mult: float, base: float, allowed: int, breakers: list[tuple[int, ...]]) -> None:
    """DRY by brute force (no Z-algorithm): for every earlier position, how long a suffix of the
    history ends there too; the token that followed would extend that repeat."""
    N = len(hist)
    if mult == 0 or base < 1 or N <= allowed:
        return
    rep_limit = N
    for i in range(N):  # i tokens back from the end
        best = -1
        for b in breakers:
            tail = b[1:]
            if b[0] == hist[N - 1 - i] and len(tail) <= i and len(tail) > best \
                    and all(tail[o] == hist[N - 1 - (i - o - 1)] for o in range(len(tail))):
                best = len(tail)
        if best >= 0:
            rep_limit = i - best
            break
    if rep_limit < allowed:
        return
    maxrep: dict[int, int] = {}
    for j in range(N - 1):
        n = 0
        while n <= j and hist[N - 1 - n] == hist[j - n]:
            n += 1
        n = min(n, rep_limit)
        if n >= allowed:
            t = hist[j + 1]
            maxrep[t] = max(maxrep.get(t, -1), n)
    single = {b[0] for b in breakers if len(b) == 1}
    max_exp = int(88.7228391 / math.log(base)) if base > 1.000001 else 0
    for i, t in enumerate(c.ids):
        if int(t) in maxrep and int(t) not in single:
            e = maxrep[int(t)] - allowed
            if max_exp > 0:
                e = min(e, max_exp)
            c.lg[i] -= mult * base ** e
    c.sorted = False


def ref_top_n_sigma(c: Ref, n: float) -> None:
    if n <= 0 or len(c.ids) <= 1:
        return
    valid = c.lg[c.lg != -np.inf]
    mx, mean = valid.max(), valid.mean()
    sd = math.sqrt(((valid - mean) ** 2).mean())
    c.lg[c.lg < mx - n * sd] = -np.inf
    c.sort()


def ref_top_k(c: Ref, k: int) -> None:
    if k <= 0:
        return
    c.sort()
    c.keep(slice(0, min(k, len(c.ids))))


def ref_typical(c: Ref, p: float, min_keep: int) -> None:
    if p >= 1:
        return
    c.sort()
    pr = c.probs()
    nz = pr > 0
    ent = -(pr[nz] * np.log(pr[nz])).sum()
    with np.errstate(divide="ignore"):
        score = np.abs(-np.log(pr) - ent)
    order = np.argsort(score, kind="stable")
    cum, last = 0.0, len(order)
    for i, j in enumerate(order):
        cum += pr[j]
        if cum > p and (min_keep == 0 or i >= min_keep - 1):
            last = i + 1
            break
    c.keep(order[:last])
    c.sorted = False


def ref_top_p(c: Ref, p: float, min_keep: int) -> None:
    if p >= 1:
        return
    c.sort()
    cum = np.cumsum(c.probs())
    last = len(cum)
    for i in range(len(cum)):
        if cum[i] >= p and i + 1 >= min_keep:
            last = i + 1
            break
    c.keep(slice(0, last))


def ref_min_p(c: Ref, p: float, min_keep: int) -> None:
    if p <= 0:
        return
    thr = c.lg.max() + math.log(p)
    keep = np.nonzero(c.lg >= thr)[0]
    if not c.sorted and len(keep) and len(keep) >= min_keep:
        c.keep(keep)
        return
    c.sort()
    i = 1
    while i < len(c.ids) and not (c.lg[i] < thr and i >= min_keep):
        i += 1
    c.keep(slice(0, i))


def ref_xtc(c: Ref, prob: float, thr: float, chance: float, min_keep: int) -> None:
    if prob <= 0 or thr > 0.5 or len(c.ids) < 2 or chance > prob:
        return
    c.sort()
    pr = c.probs()
    pos = 0
    for i in range(len(pr)):
        if pr[i] >= thr:
            pos = i
        else:
            break
    if len(pr) - pos >= min_keep and pos > 0:
        c.keep(slice(pos, None))


def ref_temp(c: Ref, t: float) -> None:
    if t <= 0:
        m = int(np.argmax(c.lg))  # the first maximum in list order
        keep = c.lg[m]
        c.lg[:] = -np.inf
        c.lg[m] = keep
    else:
        c.lg = c.lg / t


def ref_temperature(c: Ref, t: float, rng: float, exp: float) -> None:
    if rng > 0:
        if len(c.ids) <= 1:
            return
        c.sort()
        pr = c.probs()
        nz = pr > 0
        ent = -(pr[nz] * np.log(pr[nz])).sum()
        lo, hi = max(0.0, t - rng), t + rng
        ref_temp(c, lo + (hi - lo) * (ent / math.log(len(c.ids))) ** exp)
    else:
        ref_temp(c, t)


def ref_pick(c: Ref, draw: float) -> tuple[int, np.ndarray]:
    c.sort()
    pr = c.probs()
    cum = np.cumsum(pr)
    over = np.nonzero(cum > draw)[0]
    return (int(over[0]) if len(over) else int(np.nonzero(pr > 0)[0][-1])), pr


def reference(logits: np.ndarray, p: SamplingParams, window: list[int], hist: list[int],
              breakers: list[tuple[int, ...]], draw: float, xtc_draw: float = 1.0, mu: Optional[float] = None):
    """(kept ids, their probabilities, picked id, mu after the step), as llama.cpp's common sampler."""
    c = Ref(logits)
    if p.mirostat:
        ref_temp(c, p.temperature)
        c.sort()
        pr = c.probs()
        if p.mirostat == 1:
            tb = tt = 0.0
            for i in range(min(99, len(pr) - 1)):
                ti = math.log((i + 2) / (i + 1))
                tb += ti * math.log(pr[i] / pr[i + 1])
                tt += ti * ti
            s_hat = tb / tt
            eps = s_hat - 1
            k = ((eps * 2 ** mu) / (1 - V ** -eps)) ** (1 / s_hat)
            c.keep(slice(0, max(int(k), 1)))
        else:
            n = 0
            while n < len(pr) and not (-math.log2(pr[n]) > mu):
                n += 1
            c.keep(slice(0, max(n, 1)))
        i, pr = ref_pick(c, draw)
        mu = mu - p.mirostat_eta * (-math.log2(pr[i]) - p.mirostat_tau)
        return c.ids, pr, int(c.ids[i]), mu
    for name in p.samplers:
        if name == "penalties":
            ref_penalties(c, window, p.repeat_penalty, p.frequency_penalty, p.presence_penalty)
        elif name == "dry":
            ref_dry(c, hist, p.dry_multiplier, p.dry_base, p.dry_allowed_length, breakers)
        elif name == "top_n_sigma":
            ref_top_n_sigma(c, p.top_n_sigma)
        elif name == "top_k":
            ref_top_k(c, p.top_k)
        elif name == "typ_p":
            ref_typical(c, p.typical_p, p.min_keep)
        elif name == "top_p":
            ref_top_p(c, p.top_p, p.min_keep)
        elif name == "min_p":
            ref_min_p(c, p.min_p, p.min_keep)
        elif name == "xtc":
            ref_xtc(c, p.xtc_probability, p.xtc_threshold, xtc_draw, p.min_keep)
        elif name == "temperature":
            ref_temperature(c, p.temperature, p.dynatemp_range, p.dynatemp_exponent)
    i, pr = ref_pick(c, draw)
    return c.ids, pr, int(c.ids[i]), mu


# --- the kernel, with fixed draws --------------------------------------------------------------------
def breaker_table(breakers: list[tuple[int, ...]]) -> np.ndarray:
    """The kernel's breaker table for token sequences given directly (as llama.cpp's tests do)."""
    flat = sorted(breakers, key=lambda b: b[0])
    table = [len(flat)] + [0] * (2 * len(flat))
    for k, b in enumerate(flat):
        table[1 + 2 * k], table[2 + 2 * k] = b[0], len(table)
        table += [len(b) - 1, *b[1:]]
    return np.asarray(table, np.int32)


def kernel(logits: np.ndarray, p: SamplingParams, context: list[int], draws: list[float],
           sampler: Optional[SequenceSampler] = None):
    s = sampler or SequenceSampler(p, context)
    it = iter(draws)
    s.next_draw = lambda: next(it)  # type: ignore[method-assign]
    bs = BatchSampler(V, 1, V)
    mu_before = s.mu
    r = bs.sample(logits[None].copy(), [s])
    n = int((r.top_ids[0] >= 0).sum())
    return r.top_ids[0, :n].copy(), r.top_probs[0, :n].copy(), int(r.ids[0]), float(r.probs[0]), mu_before, s


def logits_for(seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=V) * 2.5).astype(np.float32)


CONTEXT = [3, 7, 7, 1, 9, 3, 4, 5, 3, 7, 1, 9, 3, 4]


def check(p: SamplingParams, seed: int = 0, draw: float = 0.37, xtc_draw: float = 0.2,
          context: list[int] = CONTEXT, breakers: list[tuple[int, ...]] = ()) -> tuple[np.ndarray, np.ndarray]:
    p.n_probs = V
    if breakers:
        p.dry_breaker_table = breaker_table(list(breakers))
    lg = logits_for(seed)
    draws = [draw, xtc_draw]
    ids, probs, pick, prob, mu0, s = kernel(lg, p, context, draws)
    window = context[-p.repeat_last_n:] if p.repeat_last_n > 0 else []
    hist = context[-p.dry_penalty_last_n:] if p.dry_penalty_last_n > 0 else list(context)
    rids, rprobs, rpick, rmu = reference(lg, p, window, hist, list(breakers), draw, xtc_draw, mu0)
    assert ids.tolist() == rids.tolist()
    np.testing.assert_allclose(probs, rprobs, rtol=2e-5, atol=1e-7)
    assert pick == rpick
    assert prob == pytest.approx(rprobs[rids.tolist().index(rpick)], rel=2e-5)
    if p.mirostat:
        assert s.mu == pytest.approx(rmu, rel=1e-5, abs=1e-5)
    return ids, probs


ALONE = [
    ("penalties", dict(repeat_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)),
    ("dry", dict(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=1)),
    ("top_n_sigma", dict(top_n_sigma=1.0)),
    ("top_k", dict(top_k=9)),
    ("typ_p", dict(typical_p=0.5)),
    ("typ_p", dict(typical_p=0.3, min_keep=6)),
    ("top_p", dict(top_p=0.6)),
    ("top_p", dict(top_p=0.2, min_keep=5)),
    ("min_p", dict(min_p=0.1)),
    ("min_p", dict(min_p=0.5, min_keep=4)),
    ("xtc", dict(xtc_probability=0.5, xtc_threshold=0.05)),
    ("temperature", dict(temperature=0.7)),
    ("temperature", dict(temperature=0.0)),
    ("temperature", dict(temperature=1.0, dynatemp_range=0.6, dynatemp_exponent=1.5)),
]


@pytest.mark.parametrize("name,kw", ALONE, ids=[f"{n}-{i}" for i, (n, _) in enumerate(ALONE)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_sampler_alone_matches_the_reference(name, kw, seed):
    p = SamplingParams(samplers=(name,), seed=1, **kw)
    assert SequenceSampler(p).general or name in ("top_k", "top_p", "min_p", "temperature", "penalties")
    ids, probs = check(p, seed=seed)
    assert probs.sum() == pytest.approx(1.0, abs=1e-5)


def test_each_sampler_changes_something():
    """The fixed logits are chosen so that every sampler of ALONE acts (the reference is not vacuous)."""
    base = SamplingParams(samplers=(), n_probs=V)
    full, _ = check(base)
    for name, kw in ALONE:
        p = SamplingParams(samplers=(name,), **kw)
        ids, probs = check(p)
        _, bprobs = check(SamplingParams(samplers=()))
        assert len(ids) < len(full) or not np.allclose(np.sort(probs), np.sort(bprobs), atol=1e-4), (name, kw)


ALL_ON = dict(repeat_penalty=1.3, frequency_penalty=0.1, presence_penalty=0.1, dry_multiplier=0.5,
              dry_allowed_length=1, top_n_sigma=2.5, top_k=30, typical_p=0.9, top_p=0.9, min_p=0.02,
              xtc_probability=0.5, xtc_threshold=0.08, temperature=0.9, dynatemp_range=0.3, min_keep=2)


@pytest.mark.parametrize("seed", range(4))
def test_default_chain_with_every_sampler_on(seed):
    p = SamplingParams(seed=1, **ALL_ON)
    assert p.samplers == DEFAULT_SAMPLERS
    check(p, seed=seed, breakers=[(9,), (4, 5)])


@pytest.mark.parametrize("order", ["tkpm", "mxtypkesd", "ttk", "pyk"])
@pytest.mark.parametrize("seed", range(3))
def test_reordered_chains(order, seed):
    p = SamplingParams(seed=1, samplers=parse_samplers(order), **ALL_ON)
    check(p, seed=seed, draw=0.81)


def test_reorder_changes_the_distribution():
    kw = dict(temperature=0.4, min_p=0.2, top_k=0, top_p=1.0)
    last, _ = check(SamplingParams(samplers=("min_p", "temperature"), **kw))
    first, _ = check(SamplingParams(samplers=("temperature", "min_p"), **kw))
    assert len(first) < len(last)


@pytest.mark.parametrize("seed", range(6))
def test_general_path_equals_the_fast_path_on_the_default_chain(seed):
    """min_keep=1 changes nothing in llama.cpp's top_p / min_p but sends the row down the general path."""
    rng = np.random.default_rng(seed)
    kw = dict(temperature=float(rng.uniform(0.3, 1.5)), top_k=int(rng.integers(0, 50)), top_p=float(rng.uniform(0.5, 1)),
              min_p=float(rng.uniform(0, 0.2)), repeat_penalty=1.2, n_probs=V)
    fast = SequenceSampler(SamplingParams(**kw), CONTEXT)
    gen = SequenceSampler(SamplingParams(min_keep=1, **kw), CONTEXT)
    assert not fast.general and gen.general
    lg = logits_for(seed)
    for draw in (0.0, 0.3, 0.77, 0.999):
        a = kernel(lg, fast.params, CONTEXT, [draw], fast)
        b = kernel(lg, gen.params, CONTEXT, [draw], gen)
        assert a[0].tolist() == b[0].tolist() and a[2] == b[2]
        np.testing.assert_allclose(a[1], b[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_mu_follows_the_reference_over_steps(version):
    p = SamplingParams(mirostat=version, mirostat_tau=3.0, mirostat_eta=0.2, temperature=0.9, n_probs=V,
                       repeat_penalty=1.5)  # (ignored with mirostat, as in llama.cpp)
    s = SequenceSampler(p, CONTEXT)
    assert s.mu == pytest.approx(6.0) and not s.device_ok
    mus = []
    for step in range(6):
        lg = logits_for(10 + step)
        draw = (0.13 + 0.29 * step) % 1
        ids, probs, pick, _, mu0, _ = kernel(lg, p, CONTEXT, [draw], s)
        rids, rprobs, rpick, rmu = reference(lg, p, [], [], [], draw, mu=mu0)
        assert ids.tolist() == rids.tolist() and pick == rpick
        np.testing.assert_allclose(probs, rprobs, rtol=2e-5, atol=1e-7)
        assert s.mu == pytest.approx(rmu, rel=1e-5, abs=1e-5)
        mus.append(s.mu)
        s.accept(pick)
    assert len(set(mus)) > 1  # mu moves


def test_dry_penalizes_the_continuation_of_a_repeat_and_breakers_stop_it():
    # history ... 1 2 3 4 | 1 2 3 : the next 4 would extend a repeat of length 3
    hist = [8, 1, 2, 3, 4, 5, 1, 2, 3]
    p = SamplingParams(samplers=("dry",), dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=2)
    lg = np.zeros(V, np.float32)

    def run(breakers):
        q = SamplingParams(**{**p.__dict__, "dry_breaker_table": breaker_table(breakers) if breakers else None})
        q.n_probs = V
        ids, probs, *_ = kernel(lg, q, hist, [0.5])
        return dict(zip(ids.tolist(), probs.tolist()))

    free = run([])
    assert free[4] < free[6]  # penalized: 1.0 * 2^(3-2) = 2 logits down
    assert free[4] / free[6] == pytest.approx(math.exp(-2.0), rel=1e-4)
    blocked = run([(5,)])  # 5 (a breaker) sits between the two copies: the repeat is only "1 2 3" after it
    assert blocked[4] / blocked[6] == pytest.approx(math.exp(-2.0), rel=1e-4)
    blocked = run([(2,)])  # a breaker inside the repeated part: the reachable repeat is "3", under the allowed 2
    assert blocked[4] == pytest.approx(blocked[6])
    multi = run([(2, 3)])  # the two-token breaker "2 3" ends the history: nothing repeats after it
    assert multi[4] == pytest.approx(multi[6])
    single = run([(4,)])  # a one-token breaker is never penalized itself
    assert single[4] == pytest.approx(single[6])
    for breakers in ([], [(5,)], [(2,)], [(2, 3)], [(4,)], [(3, 9)]):
        check(SamplingParams(**{**p.__dict__, "dry_breaker_table": None}), context=hist, breakers=breakers)


def test_dry_history_window_and_accept():
    p = SamplingParams(samplers=("dry",), dry_multiplier=1.0, dry_penalty_last_n=5)
    s = SequenceSampler(p, list(range(20)))
    assert s.dry_tokens().tolist() == [15, 16, 17, 18, 19]
    for t in range(100, 117):
        s.accept(t)
    assert s.dry_tokens().tolist() == [112, 113, 114, 115, 116]
    assert SequenceSampler(SamplingParams()).dry_tokens() is None


class ToyTokenizer:
    """A tiny vocabulary with greedy longest-match encoding."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces
        self.n_vocab = len(pieces)

    def token_bytes(self, i: int) -> bytes:
        return self.pieces[i].encode()

    def token_type(self, i: int) -> int:
        return 1

    def token_text(self, i: int) -> str:
        return self.pieces[i]

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        out = []
        while text:
            best = max((i for i, p in enumerate(self.pieces) if p and text.startswith(p)), key=lambda i: len(self.pieces[i]))
            out.append(best)
            text = text[len(self.pieces[best]):]
        return out


def test_breaker_table_from_token_texts():
    tok = ToyTokenizer(["a", "b", "c", "x\n", ":", "ab", "q a", "zz", "b:c", "\n"])
    table = dry_breaker_table(tok, ["\n", "abc"])

    n = table[0]
    entries = {}
    for k in range(n):
        off = table[2 + 2 * k]
        entries.setdefault(int(table[1 + 2 * k]), []).append(tuple(table[off + 1:off + 1 + table[off]].tolist()))
    # tokens holding "\n": one-token breakers; "a", "ab", "q a", "b:c"? : heads of "abc" with the rest as a tail
    assert entries[3] == [()] and entries[9] == [()]
    assert entries[0] == [(1, 2)]  # "a" + tokenize("bc")
    assert entries[5] == [(2,)]  # "ab" + tokenize("c")
    assert entries[6] == [(1, 2)]  # "q a" ends with "a"
    assert 8 not in entries and 4 not in entries and 7 not in entries  # "b:c" does not end a prefix of "abc"


def test_seeded_runs_are_reproducible_and_differ_by_seed():
    def run(seed):
        out = []
        bs = BatchSampler(V, 3, 5)
        ss = [SequenceSampler(SamplingParams(seed=seed, n_probs=5, **ALL_ON), CONTEXT),
              SequenceSampler(SamplingParams(seed=seed + 1, mirostat=2), CONTEXT),
              SequenceSampler(SamplingParams(seed=seed + 2, xtc_probability=1.0, xtc_threshold=0.01), CONTEXT)]
        for step in range(12):
            lg = np.stack([logits_for(100 + step + 7 * i) for i in range(3)])
            r = bs.sample(lg, ss)
            out.append(r.ids.tolist())
            for s, t in zip(ss, r.ids.tolist()):
                s.accept(t)
        return out
    assert run(5) == run(5)
    assert run(5) != run(6)


def test_validation_names_the_field():
    bad = [dict(xtc_probability=1.5), dict(mirostat=3), dict(min_keep=-1), dict(dry_allowed_length=-1),
           dict(dry_penalty_last_n=-2), dict(dynatemp_range=-0.1), dict(typical_p=float("nan")),
           dict(samplers=("top_k", "bogus")), dict(dry_sequence_breakers="\n")]
    for kw in bad:
        with pytest.raises(ValueError, match=next(iter(kw)).split("_sequence")[0]):
            SamplingParams(**kw).validate()
    assert parse_samplers("edskypmxt") == DEFAULT_SAMPLERS
    assert parse_samplers(["top-k", "temp", "typical"]) == ("top_k", "temperature", "typ_p")
    assert parse_samplers("top_k;min_p", letters=False) == ("top_k", "min_p")
    for bad_chain in ("kq", ["top_k", "infill"], "a", ["nope"]):
        with pytest.raises(ValueError):
            parse_samplers(bad_chain)


def test_device_pack_refuses_general_rows():
    bs = BatchSampler(V, 2, 4)
    with pytest.raises(ValueError, match="device"):
        bs.pack([SequenceSampler(SamplingParams()), SequenceSampler(SamplingParams(typical_p=0.5))])
    bs.pack([SequenceSampler(SamplingParams())])


def test_command_line_sets_the_chain():
    from pyllama.server.options import parse_args, sampling_defaults
    a = parse_args("-m M --samplers top_k;temperature;min_p --typical 0.7 --min-keep 3 --top-nsigma 1.5 "
                   "--xtc-probability 0.4 --xtc-threshold 0.2 --dry-multiplier 0.8 --dry-base 2 "
                   "--dry-allowed-length 3 --dry-penalty-last-n 64 --dry-sequence-breaker ab "
                   "--dry-sequence-breaker cd --mirostat 2 --mirostat-lr 0.3 --mirostat-ent 4 "
                   "--dynatemp-range 0.5 --dynatemp-exp 2".split())
    s = sampling_defaults(a)
    assert s.samplers == ("top_k", "temperature", "min_p")
    assert (s.typical_p, s.min_keep, s.top_n_sigma, s.xtc_probability, s.xtc_threshold) == (0.7, 3, 1.5, 0.4, 0.2)
    assert (s.dry_multiplier, s.dry_base, s.dry_allowed_length, s.dry_penalty_last_n) == (0.8, 2.0, 3, 64)
    assert s.dry_sequence_breakers == ("ab", "cd")
    assert (s.mirostat, s.mirostat_eta, s.mirostat_tau, s.dynatemp_range, s.dynatemp_exponent) == (2, 0.3, 4.0, 0.5, 2.0)
    assert sampling_defaults(parse_args("-m M --sampling-seq kt".split())).samplers == ("top_k", "temperature")
    assert sampling_defaults(parse_args("-m M --dry-sequence-breaker none".split())).dry_sequence_breakers == ()
    assert sampling_defaults(parse_args("-m M".split())) == SamplingParams()
    # llama-server's defaults (its --help): DRY, when turned on, looks back 64 tokens
    assert SamplingParams().dry_penalty_last_n == 64


# --- HTTP -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model):
    srv = ServerProcess(tiny_model, "-np", "2", "-c", "512").wait_ready()
    yield srv
    assert srv.stop() == 0


BASE = {"prompt": "Once upon a time", "n_predict": 6, "ignore_eos": True, "cache_prompt": False, "seed": 42}


def test_fields_are_accepted_and_seeded_runs_repeat(server):
    body = {**BASE, "typical_p": 0.9, "min_keep": 2, "top_n_sigma": 2.0, "xtc_probability": 0.5,
            "xtc_threshold": 0.05, "dry_multiplier": 0.8, "dry_base": 1.5, "dry_allowed_length": 1,
            "dry_penalty_last_n": 32, "dry_sequence_breakers": ["\n", "."], "dynatemp_range": 0.5,
            "dynatemp_exponent": 1.2, "samplers": ["penalties", "dry", "top_k", "typ_p", "xtc", "temperature"],
            "return_tokens": True}
    status, a = server.post("/completion", body)
    assert status == 200, a
    status, b = server.post("/completion", body)
    assert status == 200 and a["tokens"] == b["tokens"]
    gs = a["generation_settings"]
    assert gs["samplers"] == body["samplers"] and gs["typical_p"] == 0.9 and gs["dry_sequence_breakers"] == ["\n", "."]
    assert (gs["xtc_probability"], gs["min_keep"], gs["dynatemp_range"]) == (0.5, 2, 0.5)
    for m in (1, 2):
        status, doc = server.post("/completion", {**BASE, "mirostat": m, "mirostat_tau": 4.0, "mirostat_eta": 0.2})
        assert status == 200, doc
    status, doc = server.post("/completion", {**BASE, "samplers": "kyt"})
    assert status == 200, doc


@pytest.mark.parametrize("field,value", [
    ("typical_p", "x"), ("min_keep", -1), ("xtc_probability", 2), ("mirostat", 3), ("mirostat_tau", "a"),
    ("dry_allowed_length", 1.5), ("dry_penalty_last_n", -5), ("dry_sequence_breakers", []),
    ("dry_sequence_breakers", "\n"), ("dynatemp_range", -1), ("samplers", ["top_k", "bogus"]),
    ("samplers", "kq"), ("samplers", 5), ("samplers", ["infill"]), ("top_n_sigma", "big"),
])
def test_bad_values_are_400_naming_the_field(server, field, value):
    status, doc = server.post("/completion", {**BASE, field: value})
    assert status == 400, doc
    assert field in json.dumps(doc)


def test_samplers_order_changes_the_probabilities(server):
    def top(samplers):
        body = {**BASE, "n_predict": 1, "temperature": 0.3, "min_p": 0.5, "top_k": 0, "top_p": 1.0, "n_probs": 20,
                "post_sampling_probs": True, "samplers": samplers}
        status, doc = server.post("/completion", body)
        assert status == 200, doc
        return [(c["id"], c["prob"]) for c in doc["completion_probabilities"][0]["top_probs"] if c["prob"] > 0]
    last = top(["min_p", "temperature"])
    first = top(["temperature", "min_p"])
    assert len(first) < len(last), (first, last)
    assert top("mt") == last


# --- backend sampling: rows of the general chain sample on the host -------------------------------------------
def test_general_rows_sample_on_the_host_under_backend_sampling(tiny_model, tmp_path):
    peer = RPCServerProcess()
    try:
        # --no-warmup: every read in the trace is then the request's own (the warm-up samples on the peer)
        common = ["--rpc", peer.endpoint, "--device", "CPU,RPC0", "-np", "2", "-c", "512", "--no-warmup"]
        body = {**BASE, "n_predict": 8, "temperature": 0.9, "typical_p": 0.7, "return_tokens": True, "n_probs": 3,
                "post_sampling_probs": True}
        got, reads = {}, {}
        for flag in ("--backend-sampling", "--no-backend-sampling"):
            trace_path = tmp_path / f"{flag}.jsonl"
            srv = ServerProcess(tiny_model, *common, flag, "--trace", str(trace_path)).wait_ready()
            try:
                status, doc = srv.post("/completion", body)
                assert status == 200, doc
                got[flag] = (doc["tokens"], doc["completion_probabilities"])
            finally:
                srv.stop()
            events = [json.loads(x) for x in trace_path.read_text().splitlines()[1:]]
            reads[flag] = [e["subj"] for e in events if e["c"] == "rpc.client" and e["n"].startswith("GET_TENSOR")]
        # the logits came back (the row sampled here), and the result is the host's
        assert any("result_output" in r for r in reads["--backend-sampling"])
        assert not any("result_sampled" in r for r in reads["--backend-sampling"])
        assert got["--backend-sampling"] == got["--no-backend-sampling"]
    finally:
        assert peer.stop() == 0


def test_breaker_tables_are_cached_within_a_bound(monkeypatch):
    from pyllama.batching import sampling as smod

    calls = []

    def fake_table(tok, key):
        calls.append(key)
        return np.asarray([0], dtype=np.int32)

    class Tok:
        pass

    tok = Tok()
    monkeypatch.setattr(smod, "dry_breaker_table", fake_table)
    monkeypatch.setattr(smod, "BREAKER_CACHE_SIZE", 3)
    for i in range(5):
        smod.cached_breaker_table(tok, [str(i)])
    smod.cached_breaker_table(tok, ["4"])          # cached
    smod.cached_breaker_table(tok, ["0"])          # evicted: computed again
    assert calls == [("0",), ("1",), ("2",), ("3",), ("4",), ("0",)]
    assert len(smod._BREAKER_CACHE[tok]) == 3
