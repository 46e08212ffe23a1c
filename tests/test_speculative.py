"""Speculative decoding with n-gram drafts: llama-server's ngram-simple lookup, the verification that
keeps what the sampler agrees with, and output identical with and without drafts (greedy, with
probabilities, and seeded), locally, over an rpc split and with two pipeline groups."""
from __future__ import annotations

import re
import threading

import numpy as np
import pytest

from pyllama.batching.ngram_drafts import NgramModTable, ngram_simple_draft
from pyllama.batching.speculative import SpecConfig, SpecControl
from server_util import RPCServerProcess, ServerProcess

# code with repeated lines: the n-gram lookup finds what followed earlier, and random-weight models
# repeat themselves too
PROMPT = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
          "def mul(a, b):\n    return a * b\n") * 3
SPEC = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8"]
SPEC_MOD = ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "4", "--spec-ngram-mod-n-min", "2",
            "--spec-ngram-mod-n-max", "12"]


def reference_draft(tokens: list[int], sampled: int, n: int, m: int) -> list[int]:
    """llama.cpp's common_ngram_simple_draft, loop for loop."""
    cur = len(tokens)
    if cur <= n + m + 1:
        return []
    pattern = tokens[cur - n + 1:] + [sampled]
    match = 0
    for j in range(cur - n - 1, 0, -1):
        if tokens[j:j + n] == pattern:
            match = j
            break
    if match == 0:
        return []
    copy = min(m, cur - (match + n))
    if copy < n:
        return []
    return tokens[match + n:match + n + copy]


@pytest.mark.unit
def test_ngram_simple_draft_matches_llama_cpp_loop():
    rng = np.random.default_rng(0)
    found = 0
    for trial in range(400):
        vocab = int(rng.integers(2, 6))
        tokens = rng.integers(0, vocab, int(rng.integers(0, 60))).tolist()
        sampled = int(rng.integers(0, vocab))
        n, m = int(rng.integers(1, 5)), int(rng.integers(1, 10))
        want = reference_draft(tokens, sampled, n, m)
        got = ngram_simple_draft(np.asarray(tokens, dtype=np.int32), sampled, n, m)
        assert got == want, (tokens, sampled, n, m)
        found += bool(want)
    assert found > 100  # the cases exercise drafts, not only refusals


@pytest.mark.unit
def test_ngram_simple_draft_edges():
    h = np.asarray([7, 1, 2, 3, 4, 5, 6, 1, 2], dtype=np.int32)
    # pattern (2, 3): found at position 2, followed by 4 5 6 1 2 -> m = 3 of them
    assert ngram_simple_draft(h, 3, 2, 3) == [4, 5, 6]
    assert ngram_simple_draft(h, 9, 2, 3) == []          # no earlier occurrence
    assert ngram_simple_draft(h[:5], 3, 2, 3) == []      # too short a history for n + m + 1
    with pytest.raises(ValueError):
        SpecConfig(kinds=("draft-simple",)).validate()


class ReferenceMod:
    """llama.cpp's common_ngram_mod and ngram-mod's draft_one, loop for loop (size as given)."""

    def __init__(self, n: int, size: int):
        self.n, self.entries = n, [-1] * size

    def idx(self, tokens: list[int]) -> int:
        res = 0
        for i in range(self.n):
            res = (res * 6364136223846793005 + tokens[i]) % 2**64
        return res % len(self.entries)

    def add(self, tokens: list[int]) -> None:
        self.entries[self.idx(tokens)] = tokens[self.n]

    def draft(self, key: list[int], n_max: int) -> list[int]:
        result = list(key)
        for i in range(n_max):
            token = self.entries[self.idx(result[i:])]
            if token == -1:
                break
            result.append(token)
        return result[self.n:]


@pytest.mark.unit
def test_ngram_mod_table_matches_llama_cpp_loop():
    rng = np.random.default_rng(1)
    for trial in range(60):
        n, size = int(rng.integers(1, 6)), int(rng.integers(5, 200))
        tokens = rng.integers(0, int(rng.integers(2, 40)), int(rng.integers(n + 1, 120))).astype(np.int32)
        ref, table = ReferenceMod(n, size), NgramModTable(n, size)
        stop = len(tokens) - n
        cut = int(rng.integers(0, stop + 1))
        for i in range(stop):
            ref.add(tokens.tolist()[i:])
        table.add_all(tokens, 0, cut)  # in two chunks, as the drafter adds them
        table.add_all(tokens, cut, stop)
        assert table.entries.tolist() == ref.entries
        assert table.used == sum(e != -1 for e in ref.entries)
        key = tokens[-n:].tolist()
        assert table.draft(key, 16) == ref.draft(key, 16)


def run_control(drafted_rate: float, plain_rate: float, steps: int = 2000, n_generating: int = 1) -> list[bool]:
    """SpecControl's choices over steps whose rates (tokens/s) are given per mode."""
    control, choices = SpecControl(), []
    for _ in range(steps):
        d = control.step_drafts(n_generating)
        choices.append(d)
        tokens = 3 if d else 1
        control.step_done(n_generating, d, tokens, tokens / (drafted_rate if d else plain_rate))
    return choices


@pytest.mark.unit
def test_spec_control_drafts_only_where_drafted_steps_are_faster():
    faster = run_control(75.0, 40.0)
    assert sum(faster) > 0.99 * len(faster)  # measured both, then probes that back off
    slower = run_control(30.0, 40.0)
    assert sum(slower) < 0.02 * len(slower) and sum(slower[-500:]) >= 1  # still probed now and then
    # each count of generating sequences is judged on its own
    control = SpecControl()
    for _ in range(100):
        for n, rates in ((1, (75.0, 40.0)), (8, (30.0, 40.0))):
            d = control.step_drafts(n)
            control.step_done(n, d, 1, 1 / rates[0 if d else 1])
    assert control.rate(1, True) > control.rate(1, False) and control.rate(8, True) < control.rate(8, False)


@pytest.mark.unit
def test_catching_up_only_while_the_tokens_left_repay_it():
    from pyllama.batching.sampling import SamplingParams
    from pyllama.batching.slot import Slot
    from pyllama.batching.speculative import Drafter
    from pyllama.batching.task import CompletionTask

    class Behind(Drafter):
        catch_up_s_per_token = 0.01
        lag: dict = {}

        def behind(self, slot):
            return self.lag[slot.id]

    slots = []
    for i in range(3):
        slot = Slot(i, 0, i, 4096, tokenizer=None)
        slot.task = CompletionTask(prompt=[1, 2, 3], params=SamplingParams(), n_predict=200)
        slots.append(slot)
    drafter, control = Behind(), SpecControl()
    drafter.lag = {0: 0, 1: 300, 2: 400}
    # nothing measured: at most EXPLORE_TOKENS caught up in a step, the nearest first
    assert control.affordable(slots, 1, drafter) == slots[:2]
    for _ in range(20):  # drafted steps: 60 tokens/s, plain ones 40: 1/120 s saved per token
        for d in (True, False):
            control.step_done(1, d, 3 if d else 1, 0.05 if d else 0.025)
    drafter.lag = {0: 0, 1: 100, 2: 300}   # 200 tokens left save ~1.7 s: 1 s of catching up pays, 3 s not
    assert control.affordable(slots, 1, drafter) == slots[:2]
    slots[1].n_decoded = 150                # 50 left save ~0.4 s
    assert control.affordable(slots, 1, drafter) == slots[:1]
    drafter.lag = {0: 0, 1: 0, 2: 0}
    assert control.affordable(slots, 1, drafter) == slots


@pytest.mark.unit
def test_a_sequence_whose_drafts_are_rejected_pauses():
    from pyllama.batching.slot import Slot
    slot = Slot(0, 0, 0, 512, tokenizer=None)
    control = SpecControl()
    for _ in range(SpecControl.SEQ_JUDGE // 4):
        control.verified(slot, 4, 0)
    assert not control.slot_wants(slot)  # paused ...
    for _ in range(SpecControl.SEQ_PAUSE - 1):
        assert not control.slot_wants(slot)
    assert control.slot_wants(slot)       # ... for SEQ_PAUSE steps
    for _ in range(SpecControl.SEQ_JUDGE // 4):
        control.verified(slot, 4, 2)      # half accepted: no pause
    assert control.slot_wants(slot)


def completions(srv: ServerProcess, n_predict: int = 120) -> tuple:
    status, greedy = srv.post("/completion", {"prompt": PROMPT, "n_predict": n_predict, "temperature": 0,
                                              "ignore_eos": True, "n_probs": 2})
    assert status == 200, greedy
    status, seeded = srv.post("/completion", {"prompt": PROMPT, "n_predict": n_predict, "temperature": 0.8,
                                              "seed": 5, "ignore_eos": True, "cache_prompt": False})
    assert status == 200, seeded
    probs = [(p["id"], p["logprob"], [(t["id"], t["logprob"]) for t in p["top_logprobs"]])
             for p in greedy["completion_probabilities"]]
    return (greedy["content"], probs, seeded["content"]), greedy["timings"]


def spec_counters(srv: ServerProcess) -> dict[str, int]:
    status, text = srv.request("GET", "/metrics")
    assert status == 200
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r"^llamacpp:(spec_decode_\w+) (\d+)$", text, re.M)}


def run_both(model: str, *extra: str, spec: tuple = tuple(SPEC)) -> dict:
    results = {}
    for name, flags in (("plain", []), ("spec", list(spec))):
        srv = ServerProcess(model, "-c", "2048", "-np", "2", "--metrics", *flags, *extra).wait_ready()
        try:
            results[name], timings = completions(srv)
            counters = spec_counters(srv)
        finally:
            assert srv.stop() == 0
        if name == "plain":
            assert "draft_n" not in timings
            assert counters == {"spec_decode_num_draft_tokens_total": 0, "spec_decode_num_accepted_tokens_total": 0,
                                "spec_decode_num_drafts_total": 0}
        else:
            # drafts were verified and some kept: the comparison below covers accepted tokens
            assert timings["draft_n"] > 0 and 0 < timings["draft_n_accepted"] <= timings["draft_n"], timings
            assert counters["spec_decode_num_draft_tokens_total"] >= timings["draft_n"]
            assert counters["spec_decode_num_accepted_tokens_total"] >= timings["draft_n_accepted"]
            assert counters["spec_decode_num_drafts_total"] > 0
    assert results["spec"][0] == results["plain"][0], "greedy text differs with drafts"
    assert results["spec"][1] == results["plain"][1], "greedy probabilities differ with drafts"
    assert results["spec"][2] == results["plain"][2], "seeded text differs with drafts"
    return timings


SPEC_KINDS = {
    "ngram-simple": SPEC,
    "ngram-mod": SPEC_MOD,
    "ngram-map-k": ["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "3", "--spec-ngram-map-k-size-m", "8"],
    "ngram-map-k4v": ["--spec-type", "ngram-map-k4v", "--spec-ngram-map-k4v-size-n", "2",
                      "--spec-ngram-map-k4v-size-m", "4", "--spec-ngram-map-k4v-min-hits", "2"],
    "ngram-cache": ["--spec-type", "ngram-cache"],
    # several types: each sequence takes the first that drafts
    "ngram-map-k4v,ngram-mod": ["--spec-type", "ngram-map-k4v,ngram-mod", "--spec-ngram-map-k4v-size-n", "2",
                                "--spec-ngram-map-k4v-size-m", "4", *SPEC_MOD[2:]],
}


@pytest.mark.parametrize("kind", list(SPEC_KINDS))
def test_output_identical_with_ngram_drafts(tiny_model, kind):
    run_both(tiny_model, spec=tuple(SPEC_KINDS[kind]))


def test_output_identical_with_lookup_caches(tiny_model, tmp_path):
    """ngram-cache with a static and a dynamic cache written by the lookup_cache command from text."""
    import subprocess
    import sys
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(PROMPT * 2)
    for flag, extra in (("static", ["--static"]), ("dynamic", [])):
        proc = subprocess.run([sys.executable, "-m", "pyllama.batching.lookup_cache", "-m", tiny_model, "-f",
                               str(corpus), "-o", str(tmp_path / f"{flag}.bin"), *extra],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "n-grams" in proc.stdout, proc.stderr
    run_both(tiny_model, spec=("--spec-type", "ngram-cache", "-lcs", str(tmp_path / "static.bin"),
                               "-lcd", str(tmp_path / "dynamic.bin")))


def test_a_bad_lookup_cache_is_refused_in_one_line(tiny_model, tmp_path):
    import subprocess
    import sys
    bad = tmp_path / "bad.bin"
    bad.write_bytes(np.array([5, -1, -1, -1, 1, 7], dtype="<i4").tobytes())  # cut inside its pair
    proc = subprocess.run([sys.executable, "-m", "pyllama.server", "-m", tiny_model, "--port", "0", "--spec-type",
                           "ngram-cache", "-lcs", str(bad)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert any("bad.bin" in ln and "byte 0" in ln for ln in proc.stderr.splitlines()), proc.stderr[-2000:]


@pytest.mark.parametrize("order,groups", [("CPU,RPC0", 2), ("RPC0,CPU", 1)])
def test_output_identical_with_ngram_drafts_over_a_split(tiny_model, order, groups):
    peer = RPCServerProcess()
    try:
        run_both(tiny_model, "--rpc", peer.endpoint, "--device", order, "--pipeline-groups", str(groups))
    finally:
        assert peer.stop() == 0


@pytest.mark.parametrize("draft_type", ["q8_0", "same"])
def test_output_identical_with_a_draft_model(tiny_model, model_factory, draft_type):
    """-md: the tiny model's Q8_0 (mostly agrees with it) or the model itself (always agrees)."""
    draft = tiny_model if draft_type == "same" else model_factory("tiny", wtype="q8_0")
    timings = run_both(tiny_model, spec=("-md", draft, "--spec-draft-n-max", "4"))
    if draft_type == "same":  # every greedy draft token is the target's own choice
        assert timings["draft_n_accepted"] == timings["draft_n"], timings


def test_ngram_drafts_before_a_draft_model(tiny_model, model_factory):
    """-md with --spec-type: the n-gram drafts are asked first, the draft model for the rest."""
    run_both(tiny_model, spec=("-md", model_factory("tiny", wtype="q8_0"), "--spec-draft-n-max", "4", *SPEC))


def test_draft_model_over_a_split_with_two_groups(tiny_model, model_factory):
    peer = RPCServerProcess()
    try:
        run_both(tiny_model, "--rpc", peer.endpoint, "--device", "RPC0,CPU", "--pipeline-groups", "2",
                 spec=("-md", model_factory("tiny", wtype="q8_0"), "--draft-max", "5", "--draft-p-min", "0.05"))
    finally:
        assert peer.stop() == 0


def test_draft_model_of_another_vocabulary_is_refused(tiny_model, model_factory):
    import subprocess
    import sys
    other = model_factory("small")  # another vocabulary (32000 tokens)
    proc = subprocess.run([sys.executable, "-m", "pyllama.server", "-m", tiny_model, "-md", other, "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if "--model-draft" in ln]
    assert lines and "vocabulary" in lines[-1], proc.stderr[-2000:]


def test_concurrent_drafting_requests_match_their_plain_runs(tiny_model):
    """Requests drafting side by side (and next to one that does not draft) get what each gets
    alone without drafts: the drafts of a step stay within the exact kernels' rows."""
    bodies = [{"prompt": PROMPT, "n_predict": 60, "temperature": 0, "ignore_eos": True},
              {"prompt": PROMPT[:80] + PROMPT, "n_predict": 60, "temperature": 0, "ignore_eos": True},
              {"prompt": "Once upon a time", "n_predict": 60, "temperature": 0, "ignore_eos": True,
               "speculative.n_max": 0}]
    plain = ServerProcess(tiny_model, "-c", "2048", "-np", "3").wait_ready()
    try:
        alone = [plain.post("/completion", b)[1]["content"] for b in bodies]
    finally:
        assert plain.stop() == 0
    srv = ServerProcess(tiny_model, "-c", "2048", "-np", "3", *SPEC).wait_ready()
    try:
        results: list = [None] * len(bodies)

        def run(i: int) -> None:
            results[i] = srv.post("/completion", {**bodies[i], "cache_prompt": False}, timeout=120)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        for i, (status, res) in enumerate(results):
            assert status == 200, res
            assert res["content"] == alone[i], i
        assert results[0][1]["timings"]["draft_n"] > 0
        assert "draft_n" not in results[2][1]["timings"]  # speculative.n_max 0: this request never drafts
    finally:
        assert srv.stop() == 0


def test_request_fields_checked(tiny_model):
    srv = ServerProcess(tiny_model, "-c", "1024", "-np", "1", *SPEC).wait_ready()
    try:
        for bad in ({"speculative.n_max": -2}, {"speculative.n_max": "3"}, {"speculative.n_min": -1}):
            status, res = srv.post("/completion", {"prompt": "hi", "n_predict": 2, **bad})
            assert status == 400 and "speculative" in res["error"]["message"], res
        # a minimum longer than any draft it can get: nothing is drafted, the output is unchanged
        status, res = srv.post("/completion", {"prompt": PROMPT, "n_predict": 30, "temperature": 0,
                                               "ignore_eos": True, "speculative.n_min": 9})
        assert status == 200 and "draft_n" not in res["timings"], res["timings"]
        assert res["generation_settings"]["speculative.types"] == "ngram-simple"
        status, props = srv.request("GET", "/props")
        assert status == 200 and props["default_generation_settings"]["speculative"] is True
        status, slots = srv.request("GET", "/slots")
        assert status == 200 and all(s["speculative"] is True for s in slots)
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("argv,fragment", [
    (["--spec-type", "draft-simple"], "needs a draft model"),
    (["-m", "x.gguf", "-md", "d.gguf", "-devd", "RPC0"], "runs on the local CPU"),
    (["-m", "x.gguf", "-md", "d.gguf", "--spec-draft-p-min", "1.5"], "must be 0..1"),
    (["-otd", "x=CPU"], "not supported for the draft model"),
    (["--spec-replace", "a", "b"], "does not translate between vocabularies"),
    (["--spec-type", "ngram-bogus"], "not a type pyllama drafts with"),
    (["--spec-type", "draft-eagle3"], "not a type pyllama drafts with"),
    (["-m", "x.gguf", "--spec-type", "ngram-mod", "-lcs", "f.bin"], "read by --spec-type ngram-cache only"),
    (["-m", "x.gguf", "--spec-type", "ngram-cache", "-lcd", "/nonexistent/f.bin"], "no such file"),
    (["--spec-ngram-map-k4v-min-hits", "0"], "at least 1"),
    (["--spec-ngram-simple-size-n", "0"], "at least 1"),
    (["--spec-draft-n-max", "-1"], "at least 0"),
])
def test_flags_refused_in_one_line(argv, fragment):
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "pyllama.server", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert fragment in proc.stderr, proc.stderr
