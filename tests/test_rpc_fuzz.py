"""Fuzzing the RPC server's frame parser and every command handler, briefly and deterministically.

bench/fuzz_rpc.py holds the generators (hypothesis strategies), the runners and the properties
checked after every case (no crash, well-formed replies or a logged close, no hang, nothing left
allocated, guard buffers of another connection untouched, no unexpected exception, bounded RSS);
`python bench/fuzz_rpc.py --minutes N` runs the same fuzzers for longer. Inputs that once broke the
server are kept in tests/data/rpc_fuzz/ and replayed here, first against a child-process server
(so that a crash fails the test instead of ending the run), then against an in-process one.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "rpc_fuzz")

_spec = importlib.util.spec_from_file_location("fuzz_rpc", os.path.join(ROOT, "bench", "fuzz_rpc.py"))
F = importlib.util.module_from_spec(_spec)
sys.modules["fuzz_rpc"] = F  # dataclasses look their module up by name
_spec.loader.exec_module(F)

# examples per fuzzer: a fixed number (derandomized), so that every machine runs the same cases
# (a wall-clock cap let a slower run skip the input that crashed a faster one); together about
# half a minute on two cores
EXAMPLES = {"raw": 250, "token-raw": 150, "split": 250, "token-split": 100, "session": 400, "token-session": 150,
            "graph": 350}
REGRESSIONS = sorted(glob.glob(os.path.join(DATA, "*.bin")))


def replay_chunkings(path: str) -> list[list[int]]:
    """Whole, uneven pieces, and byte by byte where that stays cheap."""
    small = os.path.getsize(path) <= 16384
    return [[], [7, 64, 3, 300, 65536]] + ([[1]] if small else [[4093, 1, 9]])


@pytest.fixture(scope="module")
def targets():
    """In-process servers: plain and with a token (both with a weight cache and a memory cap)."""
    made = {False: F.ThreadTarget(None), True: F.ThreadTarget(F.TOKEN)}
    yield made
    for t in made.values():
        t.stop()


@pytest.fixture(scope="module")
def runners(targets):
    made = {}
    for token, t in targets.items():
        made[(token, "socket")] = F.Runner(t)
        made[(token, "split")] = F.SplitRunner(t)
    for r in made.values():
        if isinstance(r, F.Runner):
            r.start_rss()
    yield made
    for r in made.values():
        if isinstance(r, F.Runner):
            r.close()


# the fuzzed graphs compute on inf, NaN and huge floats on purpose
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_fuzz(runners, name):
    strategy, token, kind = F.FUZZERS[name]
    runner = runners[(token, kind)]
    before = sum(runner.stats.cases.values())
    t0 = time.monotonic()
    try:
        F.run_batch(strategy(), runner.run, EXAMPLES[name])
    finally:
        path = runner.save_last_failure()
        if path:
            print(f"failing input kept at {path}")
    ran = sum(runner.stats.cases.values()) - before
    print(f"{name}: {ran} cases in {time.monotonic() - t0:.1f} s")
    assert ran, "no case ran"
    if isinstance(runner, F.Runner):
        runner.check_rss()


@pytest.fixture(scope="module")
def child_targets():
    made: dict = {}

    def get(token: bool) -> F.ProcessTarget:
        if token not in made:
            made[token] = F.ProcessTarget(F.TOKEN if token else None)
        return made[token]
    yield get
    for t in made.values():
        t.stop()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.skipif(not REGRESSIONS, reason="no kept inputs")
@pytest.mark.parametrize("path", REGRESSIONS, ids=[os.path.basename(p)[:-4] for p in REGRESSIONS])
def test_kept_input_replays_cleanly(child_targets, targets, path):
    token = os.path.basename(path).startswith("token")
    child = F.Runner(child_targets(token))
    inproc = F.Runner(targets[token])
    chunkings = replay_chunkings(path)
    try:
        for chunks in chunkings:
            child.run(F.case_from_file(path, chunks))
        for chunks in chunkings:
            inproc.run(F.case_from_file(path, chunks))
        if F.is_raw_kind(path):  # streams from a connection's first byte also go to the parser itself
            split = F.SplitRunner(targets[token])
            for chunks in chunkings[1:]:
                split.run(F.case_from_file(path, chunks))
    finally:
        child.close()
        inproc.close()


def test_frame_model_agrees_with_the_spec_on_handshakes():
    """The reference model the fuzzers judge replies by, on the spec's own examples."""
    hello = F.hello_frame()
    m = F.FrameModel(token=False, max_frame=F.MAX_FRAME)
    exps = m.run(hello + F.frame(F.Cmd.DEVICE_COUNT) + F.frame(F.Cmd.SET_TENSOR, b"x") + F.frame(F.Cmd.HELLO, b"\1\0\0\0"))
    assert [e.cmd for e in exps] == [0, 1, 0] and exps[2].must_fail and exps[2].earlier_ok and m.closed is None
    m = F.FrameModel(token=False, max_frame=F.MAX_FRAME)
    assert m.run(F.frame(F.Cmd.DEVICE_COUNT)) == [] and m.closed == "first frame not a HELLO"
    m = F.FrameModel(token=False, max_frame=F.MAX_FRAME)
    assert m.run(F.P.HEADER.pack(0, 65)) == [] and m.closed
    m = F.FrameModel(token=True, max_frame=F.MAX_FRAME)
    exps = m.run(hello + F.P.HEADER.pack(F.Cmd.GET_TENSOR, 120))  # refused from the header alone
    assert len(exps) == 2 and exps[1].status_one and m.closed == "not authenticated"
    m = F.FrameModel(token=True, max_frame=F.MAX_FRAME, proof_ok=lambda body: body == b"p" * 32)
    exps = m.run(hello + F.frame(F.Cmd.AUTH, b"\1" + b"c" * 32) + F.frame(F.Cmd.AUTH, b"\2" + b"p" * 32)
                 + F.frame(F.Cmd.AUTH, b"\1" + b"c" * 32))
    assert [e.must_fail for e in exps] == [False, False, False, True] and m.closed is None
    m = F.FrameModel(token=False, max_frame=F.MAX_FRAME)
    assert m.run(hello + F.P.HEADER.pack(F.Cmd.SET_TENSOR, F.MAX_FRAME + 1)) and m.closed == "frame limit"


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_stopped_target_leaves_no_files(kind):
    """A target's weight cache and token file are its own: stopping it removes them."""
    t = (F.ThreadTarget if kind == "thread" else F.ProcessTarget)(F.TOKEN)
    paths = [p for p in (t.cache_dir, t.token_file) if p]
    assert paths and all(os.path.exists(p) for p in paths)
    t.stop()
    assert [p for p in paths if os.path.exists(p)] == []
