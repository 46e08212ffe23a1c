"""Sampling: the Cython kernel against a numpy reference of llama.cpp's default chain, and the
Python side (params validation, per-sequence state, batch packing)."""
from __future__ import annotations

import tracemalloc
import zlib

import numpy as np
import pytest

from pyllama.batching import sampling
from pyllama._fast.sampling import sample_rows
from pyllama.batching.sampling import BatchSampler, SamplingParams, SequenceSampler, pack_rows

ONE_MINUS = float(np.nextafter(np.float32(1.0), np.float32(0.0)))  # largest float32 draw < 1


# ----------------------------------------------------------------------------- helpers

def run_kernel(logits, temp=0.8, top_k=40, top_p=0.95, min_p=0.05, draws=0.5, rp=1.0, fp=0.0,
               pp=0.0, penalty=None, n_probs=0, width=None, n_threads=0):
    """Calls the kernel directly; per-row values may be scalars or sequences."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    n = logits.shape[0]
    fpar = np.zeros((n, 8), np.float32)
    ipar = np.zeros((n, 4), np.int32)
    for col, v in enumerate((temp, top_p, min_p, rp, fp, pp, draws)):
        fpar[:, col] = v
    ipar[:, 0] = top_k
    ipar[:, 1] = n_probs
    penalty = [] if penalty is None else penalty
    rows = penalty if (len(penalty) and isinstance(penalty[0], (list, tuple, np.ndarray))) \
        else [penalty] * n
    L = max([len(r) for r in rows] + [1])
    pen = np.zeros((n, L), np.int32)
    for i, r in enumerate(rows):
        pen[i, :len(r)] = r
        ipar[i, 2] = len(r)
    N = width if width is not None else int(np.max(ipar[:, 1], initial=0))
    ids = np.full(n, -7, np.int32)
    prob = np.full(n, -7.0, np.float32)
    tids = np.full((n, N), -7, np.int32)
    tprobs = np.full((n, N), -7.0, np.float32)
    sample_rows(logits, fpar, ipar, pen, ids, prob, tids, tprobs, n_threads)
    return ids, prob, tids, tprobs, fpar


def ref_penalize(logits, tokens, rp, fp, pp):
    out = np.array(logits, dtype=np.float64)
    ids, counts = np.unique(np.asarray(tokens, dtype=np.int64), return_counts=True)
    for t, c in zip(ids, counts):
        v = out[t]
        if rp != 1.0:
            v = v / rp if v > 0 else v * rp
        out[t] = v - (c * fp + pp)
    return out


def ref_greedy(logits):
    l = np.asarray(logits, np.float64)
    i = int(np.argmax(l))  # first occurrence: lowest id
    p = np.exp(l - l.max())
    p /= p.sum()
    order = np.lexsort((np.arange(len(l)), -l))
    return i, p[i], order, p[order]


def ref_chain(logits, temp, top_k, top_p, min_p, draw):
    """llama.cpp's default chain in float64. Returns (id, prob, kept ids, kept probs, ambiguous):
    ambiguous when the draw lies within rounding of a cumulative boundary."""
    return ref_variants(logits, temp, top_k, top_p, min_p, draw)[0]


def ref_variants(logits, temp, top_k, top_p, min_p, draw, tol=1e-6):
    """Like ref_chain, first the exact outcome, then the outcomes of the other top_p / min_p cuts
    that a rounding-sized change could produce (the kernel may legitimately match any)."""
    # the kernel gets its parameters as float32
    temp, top_p, min_p = (float(np.float32(x)) for x in (temp, top_p, min_p))
    l = np.asarray(logits, np.float64)
    n = len(l)
    order = np.lexsort((np.arange(n), -l))  # logit descending, ties by lower id
    ls = l[order]
    keep = top_k if 0 < top_k < n else n
    ls = ls[:keep]
    cuts = [len(ls)]
    if top_p < 1.0:
        p = np.exp(ls - ls[0])
        p /= p.sum()
        cum = np.cumsum(p)
        hit = np.nonzero(cum >= top_p)[0]
        k = int(hit[0]) + 1 if len(hit) else len(ls)
        cuts = [k] + [c for c in range(max(1, k - 3), min(len(ls), k + 3) + 1)
                      if c != k and abs(cum[c - 1] - top_p) < tol]
    if min_p > 0.0:
        rel = np.exp(ls - ls[0])
        k = max(1, int(np.sum(rel >= min_p)))
        near = np.nonzero(np.abs(ls - (ls[0] + np.log(min_p))) < 1e-5)[0]
        mcuts = [k] + [int(c) + d for c in near for d in (0, 1) if int(c) + d != k and c + d > 0]
        cuts = [min(c, m) for c in cuts for m in mcuts]
    out = []
    for k in dict.fromkeys(cuts):
        lk = ls[:k]
        w = np.exp((lk - lk[0]) / temp)
        probs = w / w.sum()
        cum = np.cumsum(probs)
        hit = np.nonzero(cum > draw)[0]
        j = int(hit[0]) if len(hit) else len(lk) - 1
        amb = bool(np.any(np.abs(cum[max(j - 1, 0):j + 1] - draw) < tol))
        out.append((int(order[j]), float(probs[j]), order[:k], probs, amb))
    return out


def make_logits(rng, n_rows, n_vocab, kind):
    if kind == "flat":
        x = rng.standard_normal((n_rows, n_vocab))
    elif kind == "wide":
        x = rng.standard_normal((n_rows, n_vocab)) * 3.0
    else:  # "peaked": an LLM-like row, a few tokens far above the bulk
        x = rng.standard_normal((n_rows, n_vocab)) * 2.0
        for r in range(n_rows):
            top = rng.choice(n_vocab, 8, replace=False)
            x[r, top] += rng.uniform(6.0, 14.0, 8)
    return x.astype(np.float32)


# ----------------------------------------------------------------------------- greedy

def test_greedy_is_argmax_lowest_id_on_ties():
    rng = np.random.default_rng(1)
    logits = make_logits(rng, 6, 5000, "wide")
    logits[1, [17, 4000, 4999]] = 50.0  # tie: lowest id wins
    logits[2, :] = 3.0  # all equal
    logits[3, [4998, 4999]] = 80.0
    ids, prob, *_ = run_kernel(logits, temp=0.0, draws=0.3)
    expect = [ref_greedy(r)[0] for r in logits]
    assert list(ids) == expect
    assert ids[1] == 17 and ids[2] == 0 and ids[3] == 4998
    for r in range(6):
        assert prob[r] == pytest.approx(ref_greedy(logits[r])[1], abs=1e-5)


def test_greedy_ignores_draws_and_reports_full_softmax():
    rng = np.random.default_rng(2)
    logits = make_logits(rng, 4, 32000, "peaked")
    outs = [run_kernel(logits, temp=t, draws=d, n_probs=5)
            for t, d in ((0.0, 0.0), (0.0, 0.5), (-1.0, ONE_MINUS))]
    for o in outs[1:]:
        for a, b in zip(outs[0][:4], o[:4]):
            np.testing.assert_array_equal(a, b)
    ids, prob, tids, tprobs, _ = outs[0]
    for r in range(4):
        i, p, order, psorted = ref_greedy(logits[r])
        assert ids[r] == i
        assert prob[r] == pytest.approx(p, abs=1e-5)
        np.testing.assert_array_equal(tids[r], order[:5])
        np.testing.assert_allclose(tprobs[r], psorted[:5], atol=1e-5)


@pytest.mark.parametrize("rp,fp,pp", [(1.3, 0.0, 0.0), (1.0, 0.6, 0.0), (1.0, 0.0, 1.5),
                                      (1.1, 0.2, 0.3), (0.8, -0.1, 0.0)])
def test_penalties_change_argmax_as_reference(rp, fp, pp):
    rng = np.random.default_rng(3)
    n_vocab = 1000
    rows, windows = [], []
    for _ in range(40):
        row = rng.standard_normal(n_vocab).astype(np.float32)
        # the top tokens, some negative, repeated a few times in the window
        top = rng.choice(n_vocab, 3, replace=False)
        row[top] = rng.uniform(2.0, 3.0, 3).astype(np.float32)
        row[rng.choice(n_vocab, 20)] *= -1
        window = list(np.repeat(top, rng.integers(1, 4, 3))) + list(rng.choice(n_vocab, 10))
        rows.append(row)
        windows.append(window)
    logits = np.stack(rows)
    ids, prob, *_ = run_kernel(logits, temp=0.0, rp=rp, fp=fp, pp=pp, penalty=windows)
    changed = 0
    for r in range(len(rows)):
        pen = ref_penalize(logits[r], windows[r], rp, fp, pp)
        best = np.sort(pen)[::-1]
        if best[0] - best[1] < 1e-4:
            continue  # a tie within float rounding: either answer is right
        assert ids[r] == int(np.argmax(pen)), r
        assert prob[r] == pytest.approx(ref_greedy(pen)[1], abs=1e-5)
        changed += int(np.argmax(pen)) != int(np.argmax(logits[r]))
    assert changed > 0  # the penalties did move the argmax


def test_penalty_on_negative_logit_multiplies():
    logits = np.array([[-1.0, -1.2, -5.0, -3.0]], np.float32)
    ids, *_ = run_kernel(logits, temp=0.0, rp=1.5, penalty=[0])
    assert ids[0] == 1  # -1.0 * 1.5 = -1.5 < -1.2
    ids, *_ = run_kernel(logits, temp=0.0, rp=1.5, penalty=[0, 7, -1, 1 << 20])  # foreign ids
    assert ids[0] == 1


# ----------------------------------------------------------------------------- chain

def test_top_k_1_is_argmax():
    rng = np.random.default_rng(4)
    logits = make_logits(rng, 16, 32000, "flat")
    for d in (0.0, 0.37, 0.9, ONE_MINUS):
        ids, prob, *_ = run_kernel(logits, temp=1.5, top_k=1, top_p=0.5, min_p=0.0, draws=d)
        assert list(ids) == [int(np.argmax(r)) for r in logits]
        np.testing.assert_array_equal(prob, 1.0)


PARAMS = [  # temperature, top_k, top_p, min_p
    (0.8, 40, 0.95, 0.05),   # llama-server defaults
    (1.0, 0, 0.9, 0.0),      # whole vocabulary, top_p cut
    (1.5, 0, 1.0, 0.0),      # no truncation at all
    (0.7, 100, 0.5, 0.0),
    (1.0, 0, 1.0, 0.1),      # min_p alone
    (0.5, 1000, 0.99, 0.02),
    (2.0, 5, 1.0, 0.0),
    (1.0, 0, 0.95, 0.05),
    (0.3, 0, 0.999, 0.0),
]


@pytest.mark.parametrize("kind", ["flat", "wide", "peaked"])
@pytest.mark.parametrize("temp,top_k,top_p,min_p", PARAMS)
def test_chain_matches_reference(kind, temp, top_k, top_p, min_p):
    rng = np.random.default_rng(zlib.crc32(repr((kind, temp, top_k, top_p, min_p)).encode()))
    n_vocab = 32000 if kind == "peaked" else 4000
    logits = make_logits(rng, 6, n_vocab, kind)
    draws = [0.0, ONE_MINUS] + list(rng.random(10))
    checked = 0
    for d in draws:
        ids, prob, tids, tprobs, fpar = run_kernel(logits, temp, top_k, top_p, min_p, draws=d,
                                                   n_probs=8)
        for r in range(logits.shape[0]):
            variants = ref_variants(logits[r], temp, top_k, top_p, min_p, float(fpar[r, 6]))
            assert any(ids[r] in set(v[2].tolist()) for v in variants), (r, d)
            exact = [v for v in variants if not v[4]]
            if not exact:
                continue  # the draw sits on a boundary in every variant
            checked += 1
            match = [v for v in exact if v[0] == ids[r]]
            assert match, (r, d, ids[r], [v[0] for v in exact])
            ref_id, ref_p, kept, kprobs, _ = match[0]
            assert prob[r] == pytest.approx(ref_p, abs=1e-5)
            m = min(8, len(kept))
            np.testing.assert_array_equal(tids[r, :m], kept[:m])
            np.testing.assert_allclose(tprobs[r, :m], kprobs[:m], atol=1e-5)
            assert np.all(tids[r, m:] == -1) and np.all(tprobs[r, m:] == 0)
    # draws next to 1 land among the tail's tiny probabilities: often within rounding of a
    # boundary, so only the interior draws count towards the coverage check
    assert checked >= 0.8 * (len(draws) - 1) * logits.shape[0]


@pytest.mark.parametrize("top_k", [1, 7, 40, 300, 512, 513, 3000])
def test_top_k_adversarial_rows(top_k):
    """Rows built against the kernel's shortcuts: ties across the top_k boundary, peaks exactly
    where a strided sample looks, a constant row, one finite token."""
    n_vocab = 32000
    stride = n_vocab // 1024
    rows = np.full((5, n_vocab), -1.0, np.float32)
    rows[0, ::stride] = 5.0  # every sampled position is a peak
    rows[1, 1::stride] = 5.0  # peaks right next to them
    rows[1, ::stride] = -3.0
    rows[2] = np.repeat(np.arange(8, dtype=np.float32), n_vocab // 8)[::-1]  # wide ties
    rows[4] = -np.inf
    rows[4, 12345] = -50.0
    for d in (0.0, 0.3, 0.77, ONE_MINUS):
        ids, prob, tids, tprobs, fpar = run_kernel(rows, 1.0, top_k, 0.9, 0.0, draws=d,
                                                   n_probs=5)
        for r in range(rows.shape[0]):
            variants = ref_variants(rows[r], 1.0, top_k, 0.9, 0.0, float(fpar[r, 6]))
            exact = [v for v in variants if not v[4]]
            if not exact:
                continue
            match = [v for v in exact if v[0] == ids[r]]
            assert match, (r, d, ids[r], [v[0] for v in exact])
            assert prob[r] == pytest.approx(match[0][1], abs=1e-5)
            m = min(5, len(match[0][2]))
            np.testing.assert_array_equal(tids[r, :m], match[0][2][:m])


def test_draw_extremes_pick_kept_candidates():
    rng = np.random.default_rng(5)
    logits = make_logits(rng, 8, 32000, "wide")
    for temp, k, p, mp in PARAMS:
        lo = run_kernel(logits, temp, k, p, mp, draws=0.0)[0]
        hi = run_kernel(logits, temp, k, p, mp, draws=ONE_MINUS)[0]
        for r in range(8):
            _, _, kept, probs, _ = ref_chain(logits[r], temp, k, p, mp, 0.0)
            assert lo[r] == kept[0]
            assert hi[r] in set(kept.tolist())
    # draws outside [0, 1) still give a candidate, never an out-of-range id
    for d in (-0.5, 1.0, 7.0, float("nan")):
        ids = run_kernel(logits, 1.0, 0, 0.9, 0.0, draws=d)[0]
        assert np.all((ids >= 0) & (ids < 32000))


def test_extreme_temperatures():
    rng = np.random.default_rng(6)
    logits = make_logits(rng, 4, 5000, "peaked")
    # a tiny temperature underflows every weight but the max: still the max, prob 1
    ids, prob, *_ = run_kernel(logits, temp=1e-6, top_k=0, top_p=1.0, min_p=0.0, draws=ONE_MINUS)
    assert list(ids) == [int(np.argmax(r)) for r in logits]
    np.testing.assert_allclose(prob, 1.0)
    for k in (0, 40):  # both top_k paths; a denormal temperature too
        ids, prob, *_ = run_kernel(logits, temp=1e-45, top_k=k, top_p=0.9, min_p=0.0,
                                   draws=ONE_MINUS)
        assert list(ids) == [int(np.argmax(r)) for r in logits]
        np.testing.assert_allclose(prob, 1.0)
    ids, prob, *_ = run_kernel(logits, temp=1e6, top_k=0, top_p=1.0, min_p=0.0, draws=0.5)
    np.testing.assert_allclose(prob, 1.0 / 5000, rtol=1e-3)


def test_non_finite_logits():
    logits = np.full((4, 100), -np.inf, np.float32)
    logits[1, 7] = 0.0
    logits[2, :] = np.nan
    logits[2, 50] = 1.0
    logits[3, 10] = np.inf
    logits[3, 20] = 5.0
    for temp in (0.0, 1.0):
        for d in (0.0, 0.5, ONE_MINUS):
            ids, prob, *_ = run_kernel(logits, temp=temp, top_k=0, top_p=1.0, min_p=0.0,
                                       draws=d)
            assert 0 <= ids[0] < 100  # all -inf: uniform
            assert ids[1] == 7 and prob[1] == 1.0
            assert ids[2] == 50 and prob[2] == 1.0  # NaN never wins
            assert ids[3] == 10 and prob[3] == 1.0
            assert np.all(np.isfinite(prob))


# ----------------------------------------------------------------------------- n_probs

def test_n_probs_descending_and_contains_chosen():
    rng = np.random.default_rng(7)
    logits = make_logits(rng, 8, 32000, "peaked")
    logits[:4] = make_logits(rng, 4, 32000, "flat")
    n_probs = 10
    seen_in_top = 0
    for d in rng.random(20):
        ids, prob, tids, tprobs, _ = run_kernel(logits, 1.0, 0, 0.95, 0.0, draws=d,
                                                n_probs=n_probs, width=12)
        for r in range(8):
            valid = tids[r] >= 0
            n_valid = int(valid.sum())
            assert np.all(valid[:n_valid]) and np.all(tids[r, n_valid:] == -1)
            assert np.all(tprobs[r, n_valid:] == 0) and n_valid <= n_probs
            p = tprobs[r, :n_valid]
            assert np.all(np.diff(p) <= 0)
            assert p.sum() <= 1.0 + 1e-5
            assert len(set(tids[r, :n_valid].tolist())) == n_valid
            if n_valid and prob[r] >= p[-1] + 1e-6:  # chosen id is among the top n
                seen_in_top += 1
                assert ids[r] in tids[r, :n_valid]
                assert tprobs[r, list(tids[r]).index(ids[r])] == pytest.approx(prob[r])
    assert seen_in_top > 0
    # fewer candidates than n_probs: padded
    ids, prob, tids, tprobs, _ = run_kernel(logits, 1.0, 3, 1.0, 0.0, n_probs=10)
    assert np.all(tids[:, 3:] == -1) and np.all(tprobs[:, 3:] == 0)
    np.testing.assert_allclose(tprobs[:, :3].sum(axis=1), 1.0, rtol=1e-5)


# ----------------------------------------------------------------------------- rows, threads

def test_many_rows_equal_each_row_alone():
    rng = np.random.default_rng(8)
    n_vocab = 32000
    logits = np.concatenate([make_logits(rng, 4, n_vocab, k) for k in ("flat", "wide", "peaked")])
    n = logits.shape[0]
    temps = rng.choice([0.0, 0.7, 1.0, 1.3], n)
    ks = rng.choice([0, 1, 40, 500], n)
    ps = rng.choice([1.0, 0.9, 0.5], n)
    mps = rng.choice([0.0, 0.05], n)
    rps = rng.choice([1.0, 1.2], n)
    draws = rng.random(n)
    pens = [list(rng.integers(0, n_vocab, rng.integers(0, 30))) for _ in range(n)]
    batch = [run_kernel(logits, temps, ks, ps, mps, draws, rps, 0.1, 0.2, pens, n_probs=4,
                        n_threads=nt) for nt in (0, 1, 3)]
    for other in batch[1:]:
        for a, b in zip(batch[0][:4], other[:4]):
            np.testing.assert_array_equal(a, b)
    ids, prob, tids, tprobs, _ = batch[0]
    for r in range(n):
        one = run_kernel(logits[r:r + 1], temps[r], ks[r], ps[r], mps[r], draws[r], rps[r], 0.1,
                         0.2, [pens[r]], n_probs=4)
        assert one[0][0] == ids[r]
        assert one[1][0] == prob[r]
        np.testing.assert_array_equal(one[2][0], tids[r])
        np.testing.assert_array_equal(one[3][0], tprobs[r])


# ----------------------------------------------------------------------------- kernel validation

def _arrays(n=2, V=10, L=4, N=3):
    return dict(logits=np.zeros((n, V), np.float32), fparams=np.zeros((n, 8), np.float32),
                iparams=np.zeros((n, 4), np.int32), penalty_tokens=np.zeros((n, L), np.int32),
                out_ids=np.zeros(n, np.int32), out_prob=np.zeros(n, np.float32),
                out_top_ids=np.zeros((n, N), np.int32),
                out_top_probs=np.zeros((n, N), np.float32))


def test_kernel_validation():
    sample_rows(**_arrays())
    bad = [
        ("fparams", np.zeros((3, 8), np.float32)),
        ("fparams", np.zeros((2, 7), np.float32)),
        ("iparams", np.zeros((2, 3), np.int32)),
        ("penalty_tokens", np.zeros((1, 4), np.int32)),
        ("out_ids", np.zeros(3, np.int32)),
        ("out_prob", np.zeros(1, np.float32)),
        ("out_top_ids", np.zeros((2, 4), np.int32)),
        ("out_top_probs", np.zeros((3, 3), np.float32)),
        ("logits", np.zeros((2, 0), np.float32)),
    ]
    for name, arr in bad:
        a = _arrays()
        a[name] = arr
        with pytest.raises(ValueError):
            sample_rows(**a)
    for col, v in ((1, 4), (1, -1), (2, 5), (2, -1)):  # n_probs > N, n_penalty_tokens > L
        a = _arrays()
        a["iparams"][1, col] = v
        with pytest.raises(ValueError):
            sample_rows(**a)
    a = _arrays()
    with pytest.raises((ValueError, TypeError)):
        sample_rows(**{**a, "logits": np.zeros((2, 10), np.float64)})
    with pytest.raises(ValueError):
        sample_rows(**{**a, "logits": np.zeros((2, 20), np.float32)[:, ::2]})
    # zero rows and zero-width windows / top arrays are fine
    sample_rows(**_arrays(n=0))
    sample_rows(**_arrays(L=0, N=0))


# ----------------------------------------------------------------------------- SamplingParams

@pytest.mark.parametrize("field,value", [
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("min_p", -0.1), ("min_p", 1.5),
    ("repeat_penalty", 0.0), ("repeat_penalty", -1.0), ("repeat_last_n", -2), ("n_probs", -1),
    ("seed", -2), ("seed", 1 << 32), ("temperature", float("nan")), ("top_p", float("nan")),
    ("frequency_penalty", float("inf")), ("top_k", 1.5), ("top_k", "40"), ("temperature", None),
    ("n_probs", True), ("temperature", 1e39),
])
def test_params_validation(field, value):
    p = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        p.validate()
    with pytest.raises(ValueError):
        SequenceSampler(p)


def test_params_valid_values():
    for kw in ({}, {"temperature": 0.0}, {"temperature": -1.0}, {"top_k": 0}, {"top_k": -1},
               {"top_p": 1.0}, {"min_p": 0.0}, {"repeat_last_n": -1}, {"repeat_last_n": 0},
               {"seed": 0}, {"seed": 0xFFFFFFFF}, {"n_probs": 5}, {"frequency_penalty": -0.5},
               {"top_k": 10**12}, {"top_k": np.int64(5)}, {"top_p": np.float32(0.5)}):
        SamplingParams(**kw).validate()
        SequenceSampler(SamplingParams(**kw))  # packable as int32 / float32


# ----------------------------------------------------------------------------- SequenceSampler

def test_seeded_draws_reproducible_and_distinct():
    a = SequenceSampler(SamplingParams(seed=1234))
    b = SequenceSampler(SamplingParams(seed=1234))
    c = SequenceSampler(SamplingParams(seed=1235))
    da = [a.next_draw() for _ in range(50)]
    assert da == [b.next_draw() for _ in range(50)]
    assert da != [c.next_draw() for _ in range(50)]
    assert all(0.0 <= d < 1.0 for d in da)
    assert a.seed == 1234


def test_random_seed():
    seeds = {SequenceSampler(SamplingParams(seed=s)).seed for s in (-1, -1, -1, 0xFFFFFFFF)}
    assert len(seeds) >= 3
    for s in seeds:
        assert 0 <= s < 0xFFFFFFFF
    # the reported seed reproduces the run
    r = SequenceSampler(SamplingParams(seed=-1))
    again = SequenceSampler(SamplingParams(seed=r.seed))
    assert [r.next_draw() for _ in range(5)] == [again.next_draw() for _ in range(5)]


def test_penalty_window():
    s = SequenceSampler(SamplingParams(repeat_last_n=4), context_tokens=[1, 2, 3, 4, 5, 6])
    assert list(s.penalty_tokens()) == [3, 4, 5, 6]
    s.accept(7)
    assert list(s.penalty_tokens()) == [4, 5, 6, 7]
    s = SequenceSampler(SamplingParams(repeat_last_n=3))
    assert list(s.penalty_tokens()) == []
    s.accept(9)
    assert list(s.penalty_tokens()) == [9]
    s = SequenceSampler(SamplingParams(repeat_last_n=0), [1, 2])
    s.accept(3)
    assert s.window == 0 and list(s.penalty_tokens()) == []
    s = SequenceSampler(SamplingParams(repeat_last_n=-1), range(1000), max_window=100)
    assert s.window == 100 and list(s.penalty_tokens()) == list(range(900, 1000))
    s = SequenceSampler(SamplingParams(repeat_last_n=5000), max_window=100)
    assert s.window == 100


def test_pack_rows_layout():
    p1 = SamplingParams(temperature=0.7, top_k=12, top_p=0.9, min_p=0.1, repeat_penalty=1.1,
                        repeat_last_n=8, frequency_penalty=0.2, presence_penalty=0.3, seed=5,
                        n_probs=3)
    s1 = SequenceSampler(p1, context_tokens=range(20))
    s2 = SequenceSampler(SamplingParams(seed=6))  # no penalties: no tokens shipped
    f = np.zeros((4, 8), np.float32)
    i = np.zeros((4, 4), np.int32)
    t = np.zeros((4, 6), np.int32)
    assert pack_rows([s1, s2], f, i, t) == 2
    d1 = SequenceSampler(p1).next_draw()
    np.testing.assert_allclose(f[0], [0.7, 0.9, 0.1, 1.1, 0.2, 0.3, d1, 0.0], rtol=1e-6)
    assert list(i[0]) == [12, 3, 6, 0]
    assert sorted(t[0, :6]) == list(range(14, 20))  # window 8 > width 6: the most recent 6
    assert list(i[1]) == [40, 0, 0, 0]
    with pytest.raises(ValueError):
        pack_rows([s1] * 5, f, i, t)
    # top_k beyond int32 means "all", as does top_k <= 0
    big = SequenceSampler(SamplingParams(top_k=10**12))
    neg = SequenceSampler(SamplingParams(top_k=-3))
    pack_rows([big, neg], f, i, t)
    assert i[0, 0] == 2**31 - 1 and i[1, 0] == 0


# ----------------------------------------------------------------------------- BatchSampler

def test_batch_sampler_matches_kernel_with_penalties():
    rng = np.random.default_rng(9)
    n_vocab = 3000
    bs = BatchSampler(n_vocab, max_rows=8, max_probs=4, window=64)
    params = [SamplingParams(temperature=0.0, repeat_penalty=1.5, seed=1, n_probs=2),
              SamplingParams(seed=2, frequency_penalty=0.5, presence_penalty=0.5, n_probs=4),
              SamplingParams(seed=3, top_k=0, top_p=0.8)]
    ctx = [list(rng.integers(0, n_vocab, 30)) for _ in params]
    samplers = [SequenceSampler(p, c) for p, c in zip(params, ctx)]
    twins = [SequenceSampler(p, c) for p, c in zip(params, ctx)]
    logits = make_logits(rng, 3, n_vocab, "wide")
    res = bs.sample(logits, samplers)
    assert res.ids.shape == (3,) and res.top_ids.shape == (3, 4)
    for r, (p, tw) in enumerate(zip(params, twins)):
        window = list(tw.penalty_tokens())
        pen = ref_penalize(logits[r], window, p.repeat_penalty, p.frequency_penalty,
                           p.presence_penalty)
        draw = float(np.float32(tw.next_draw()))
        if p.temperature <= 0:
            assert res.ids[r] == ref_greedy(pen)[0]
        else:
            ref_id, ref_p, *_ = ref_chain(pen, p.temperature, p.top_k, p.top_p, p.min_p, draw)
            assert res.ids[r] == ref_id
            assert res.probs[r] == pytest.approx(ref_p, abs=1e-5)
        assert np.all(res.top_ids[r, p.n_probs:] == -1)
    # sample() does not accept: the windows are unchanged
    for s, tw in zip(samplers, twins):
        assert list(s.penalty_tokens()) == list(tw.penalty_tokens())


def test_batch_sampler_seeded_runs_repeat():
    rng = np.random.default_rng(10)
    logits = make_logits(rng, 5, 2000, "flat")

    def run():
        bs = BatchSampler(2000, max_rows=5)
        ss = [SequenceSampler(SamplingParams(seed=100 + i, top_k=0, top_p=1.0, min_p=0.0))
              for i in range(5)]
        out = []
        for _ in range(10):
            res = bs.sample(logits, ss)
            out.append(res.ids.copy())
            for s, t in zip(ss, res.ids):
                s.accept(int(t))
        return np.stack(out)

    a, b = run(), run()
    np.testing.assert_array_equal(a, b)
    assert len(np.unique(a)) > 5  # the draws do vary


def test_batch_sampler_validation():
    bs = BatchSampler(100, max_rows=2, max_probs=2)
    s = SequenceSampler(SamplingParams())
    ok = np.zeros((1, 100), np.float32)
    bs.sample(ok, [s])
    for bad in (np.zeros((1, 100), np.float64), np.zeros((1, 99), np.float32),
                np.zeros((2, 100), np.float32), np.zeros((1, 200), np.float32)[:, ::2],
                np.zeros(100, np.float32)):
        with pytest.raises(ValueError):
            bs.sample(bad, [s])
    with pytest.raises(ValueError):
        bs.sample(np.zeros((3, 100), np.float32), [s, s, s])
    with pytest.raises(ValueError):
        bs.sample(ok, [SequenceSampler(SamplingParams(n_probs=3))])
    for kw in ({"n_vocab": 0}, {"max_rows": 0}, {"max_probs": -1}, {"window": -1},
               {"n_threads": -1}):
        with pytest.raises(ValueError):
            BatchSampler(**{"n_vocab": 10, "max_rows": 1, **kw})
    res = bs.sample(np.zeros((0, 100), np.float32), [])
    assert res.ids.shape == (0,)


def test_sample_is_one_kernel_call_without_vocab_sized_python_work(monkeypatch):
    calls = []
    real = sampling._sample_rows

    def counting(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(sampling, "_sample_rows", counting)
    n_vocab = 200_000
    bs = BatchSampler(n_vocab, max_rows=16)
    rng = np.random.default_rng(11)
    logits = rng.standard_normal((16, n_vocab)).astype(np.float32)
    ss = [SequenceSampler(SamplingParams(seed=i, repeat_penalty=1.1), range(100))
          for i in range(16)]
    bs.sample(logits, ss)  # warm up (lazy imports, caches)
    calls.clear()
    tracemalloc.start()
    try:
        bs.sample(logits, ss)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(calls) == 1
    # the logits go to the kernel as they are (no copy) and the outputs are the preallocated
    # arrays; no Python-side allocation anywhere near one row of the vocabulary (800 KB)
    assert calls[0][0] is logits
    assert np.shares_memory(calls[0][4], bs.out_ids)
    assert peak < 64 * 1024


def test_logit_bias_is_added_before_the_chain():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, 50)).astype(np.float32)
    top = int(np.argmax(logits[0]))
    ids = np.array(sorted({top, 7}), dtype=np.int32)
    bias = np.array([-np.inf if i == top else 0.0 for i in ids], dtype=np.float32)
    greedy = SamplingParams(temperature=0)
    rows = [SequenceSampler(SamplingParams(temperature=0, logit_bias=(ids, bias))),
            SequenceSampler(SamplingParams(temperature=0, logit_bias=(np.array([7], np.int32),
                                                                      np.array([100.0], np.float32)))),
            SequenceSampler(greedy)]
    bs = BatchSampler(50, 3)
    expect_third = int(np.argmax(logits[2]))
    res = bs.sample(logits.copy(), rows)
    second = np.argsort(logits[0])[-2]
    assert int(res.ids[0]) == second  # the banned argmax is skipped
    assert int(res.ids[1]) == 7
    assert int(res.ids[2]) == expect_third  # an unbiased row is untouched


@pytest.mark.parametrize("bad", [
    (np.array([3, 3], np.int32), np.array([1, 1], np.float32)),
    (np.array([4, 3], np.int32), np.array([1, 1], np.float32)),
    (np.array([-1], np.int32), np.array([1], np.float32)),
    (np.array([1], np.int64), np.array([1], np.float32)),
    (np.array([1], np.int32), np.array([np.nan], np.float32)),
    (np.array([1], np.int32), np.array([np.inf], np.float32)),
])
def test_logit_bias_is_validated(bad):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bad).validate()


def test_logit_bias_beyond_the_vocabulary_is_refused():
    s = SequenceSampler(SamplingParams(temperature=0, logit_bias=(np.array([60], np.int32),
                                                                  np.array([1.0], np.float32))))
    with pytest.raises(ValueError, match="n_vocab"):
        BatchSampler(50, 1).sample(np.zeros((1, 50), np.float32), [s])


def test_batch_sampler_without_chosen_prob_skips_only_unwanted_softmax():
    """chosen_prob=False (the server's sampler): a greedy row without n_probs gets its argmax and a
    NaN probability (nobody reads it); rows with n_probs, and sampled rows, are unchanged."""
    rng = np.random.default_rng(12)
    n_vocab = 4000
    logits = make_logits(rng, 4, n_vocab, "peaked")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, n_probs=3),
              SamplingParams(temperature=0.0, repeat_penalty=1.3), SamplingParams(seed=5, top_k=20)]
    ctx = [list(rng.integers(0, n_vocab, 10)) for _ in params]
    full = BatchSampler(n_vocab, max_rows=4, max_probs=3).sample(
        logits.copy(), [SequenceSampler(p, c) for p, c in zip(params, ctx)])
    lean = BatchSampler(n_vocab, max_rows=4, max_probs=3, chosen_prob=False).sample(
        logits.copy(), [SequenceSampler(p, c) for p, c in zip(params, ctx)])
    assert lean.ids.tolist() == full.ids.tolist()
    assert np.isnan(lean.probs[0]) and np.isnan(lean.probs[2])  # greedy, no n_probs (with penalties too)
    assert lean.probs[1] == full.probs[1] and lean.probs[3] == full.probs[3]
    assert lean.top_ids[1].tolist() == full.top_ids[1].tolist()
    assert np.array_equal(lean.top_probs[1], full.top_probs[1])
    assert not np.isnan(full.probs).any()
