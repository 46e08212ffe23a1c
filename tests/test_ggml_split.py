"""A model split over a ggml peer end to end: `--rpc` at the test peer (tests/ggml_fake_peer.py,
its graphs run by tests/ggml_numpy.py), layers lowered to ggml's ops, greedy tokens equal to the
unsplit run's. bench/ggml_split_check.py runs the same against llama.cpp's rpc-server and
llama-server's own split."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from ggml_fake_peer import FakeGGMLPeer
from pyllama.backend.ggml.lower import attention_mask

PROMPT = "Hello world, the split"


def _generate(model: str, *extra: str, prompt: str = PROMPT, n: int = 10) -> list[int]:
    r = subprocess.run([sys.executable, "-m", "pyllama.generate", "-m", model, "-p", prompt, "-n", str(n), "--temp", "0",
                        "--tokens", "-t", "1", *extra], capture_output=True, text=True, timeout=240,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    return [int(x) for x in r.stdout.split()]


@pytest.mark.parametrize("arch,wtype", [("llama", "f32"), ("llama", "q8_0"), ("qwen2", "f16"), ("qwen3", "q4_0"),
                                        ("gemma2", "f32")])
def test_greedy_tokens_over_a_ggml_peer_equal_the_unsplit_run(model_factory, arch, wtype):
    model = model_factory("tiny", arch=arch, wtype=wtype)
    want = _generate(model)
    peer = FakeGGMLPeer(compute=True)
    try:
        got = _generate(model, "--rpc", peer.endpoint, "-dev", "RPC0,CPU", "-ts", "1,1")
        assert peer.graphs, "no graph reached the peer"
        assert peer.recomputes, "a decode step's repeated graph was sent again instead of re-run"
    finally:
        peer.stop()
    assert got == want


def test_the_whole_model_on_the_peer(model_factory):
    model = model_factory("tiny", arch="llama", wtype="f32")
    want = _generate(model)
    peer = FakeGGMLPeer(compute=True)
    try:
        got = _generate(model, "--rpc", peer.endpoint, "-dev", "CPU,RPC0", "-ts", "0,1")
    finally:
        peer.stop()
    assert got == want


def test_decoding_past_a_step_of_attended_cells(model_factory):
    # 247 prompt tokens, then 16 more: the attended cells grow past 256 mid-decode, so the kept
    # lowering of the decode graph no longer fits and the graph is lowered again over 512 cells
    model = model_factory("tiny", arch="llama", wtype="f32")
    prompt = " ".join(["hello world"] * 41)
    want = _generate(model, "-c", "512", prompt=prompt, n=16)
    peer = FakeGGMLPeer(compute=True)
    try:
        got = _generate(model, "--rpc", peer.endpoint, "-dev", "RPC0,CPU", "-ts", "1,1", "-c", "512",
                        prompt=prompt, n=16)
        n_kv = {int(t["ne"][0]) for _, _, recs in peer.graphs for t in recs if bytes(t["name"]).startswith(b"kq_mask")}
    finally:
        peer.stop()
    assert got == want
    assert n_kv == {256, 512}, n_kv     # masks [n_kv, rows]: both sizes were sent


def test_attention_mask_rows_follow_the_cell_lists():
    cells = np.array([0, 1, 2, 5, 6], np.int32)      # two sequences: cells 0-2 and 5-6
    ranges = np.array([[0, 3], [3, 1], [3, 2]], np.int32)
    m = attention_mask(cells, ranges, 0, 8, 3)
    assert m.shape == (64, 8) and m.dtype == np.float16
    assert np.isneginf(m[3:]).all()                  # padding rows
    assert (m[0] == 0).tolist() == [True, True, True, False, False, False, False, False]
    assert (m[1] == 0).tolist() == [False] * 5 + [True, False, False]
    assert (m[2] == 0).tolist() == [False] * 5 + [True, True, False]
    w = attention_mask(cells, ranges, 2, 8, 3, np.float32)   # a window of 2: the last two cells
    assert (w[0] == 0).tolist() == [False, True, True] + [False] * 5 and w.dtype == np.float32
    with pytest.raises(ValueError):
        attention_mask(cells, np.array([[4, 3]], np.int32), 0, 8, 1)
