"""A model split over a ggml peer end to end: `--rpc` at the test peer (tests/ggml_fake_peer.py,
its graphs run by tests/ggml_numpy.py), layers lowered to ggml's ops, greedy tokens equal to the
unsplit run's. bench/ggml_split_check.py runs the same against llama.cpp's rpc-server and
llama-server's own split."""
from __future__ import annotations

import contextlib
import subprocess
import sys

import numpy as np
import pytest

from ggml_fake_peer import FakeGGMLPeer
from greedy import greedy_decode
from pyllama.backend.ggml.lower import attention_plan, group_mask
from pyllama.backend.ggml.protocol import GOp
from pyllama.ir.tensor import DType

PROMPT = "Hello world, the split"


def _generate(model: str, *extra: str, prompt: str = PROMPT, n: int = 10) -> list[int]:
    r = subprocess.run([sys.executable, "-m", "pyllama.generate", "-m", model, "-p", prompt, "-n", str(n),
                        "--temp", "0", "--tokens", "-t", "1", *extra], capture_output=True, text=True, timeout=240,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    return [int(x) for x in r.stdout.split()]


@pytest.mark.parametrize("arch,wtype", [("llama", "f32"), ("llama", "q8_0"), ("qwen2", "f16"), ("qwen3", "q4_0"),
                                        ("gemma2", "f32"), ("gemma3", "f32"), ("phi3", "q8_0"),
                                        ("qwen2moe", "f32"), ("qwen3moe", "q8_0"), ("mixtral", "f32"),
                                        ("llama", "iq4_nl"), ("qwen3moe", "mxfp4"), ("glm4moe", "f32"),
                                        ("glm4", "f32"), ("gpt-oss", "f32"), ("deepseek2", "f32"), ("deepseek2", "q8_0")])
def test_greedy_tokens_over_a_ggml_peer_equal_the_unsplit_run(model_factory, arch, wtype):
    # Mixture-of-Experts layers are lowered as llama.cpp builds them (ARGSORT top-k, MUL_MAT_ID,
    # the weights' sum and scale), qwen2moe's sigmoid-gated shared expert included
    model = model_factory("tiny", arch=arch, wtype=wtype)
    want = _generate(model)
    peer = FakeGGMLPeer(compute=True)
    try:
        # glm4moe's first layer is dense: its MoE layer goes to the peer too
        got = _generate(model, "--rpc", peer.endpoint, "-dev", "RPC0,CPU",
                        "-ts", "3,1" if arch in ("glm4moe", "deepseek2") else "1,1")
        assert peer.graphs, "no graph reached the peer"
        assert peer.recomputes, "a decode step's repeated graph was sent again instead of re-run"
        ops = {int(t["op"]) for _, _, recs in peer.graphs for t in recs}
    finally:
        peer.stop()
    assert got == want
    if arch in ("qwen2moe", "qwen3moe", "mixtral", "glm4moe", "gpt-oss", "deepseek2"):
        assert {int(GOp.MUL_MAT_ID), int(GOp.ARGSORT)} <= ops
    if arch == "gpt-oss":   # the experts' biases as llama.cpp adds them, and the clamped SwiGLU
        assert {int(GOp.ADD_ID), int(GOp.GLU)} <= ops
    if arch == "glm4moe":   # sigmoid routing: a UNARY op, and the expert bias added for the choice
        assert {int(GOp.UNARY), int(GOp.ADD)} <= ops
    if arch == "qwen2moe":   # the shared expert's gate as llama.cpp builds it, silu(z) / z: a sigmoid op
        assert int(GOp.DIV) in ops   # rounds differently, which flips near-tied experts downstream


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
    # 247 prompt tokens, then 16 more: the sequence's cells grow past 256 mid-decode, so the kept
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
    assert n_kv == {256, 512}, n_kv     # masks [cells, tokens, 1, sequences]: both sizes were sent


def test_a_decode_step_attends_each_sequence_over_its_own_cells():
    cells = np.array([0, 1, 2, 5, 6, 9], np.int32)     # sequences in the lists: cells 0-2, 5-6, 9
    ranges = np.array([[3, 2], [0, 3], [5, 1]], np.int32)   # one token each, batch order 1, 0, 2
    layout, groups = attention_plan(cells, ranges, 3)
    assert layout.groups == ((1, 3, 256),) and layout.in_order
    (grp,) = groups
    assert grp.tokens.tolist() == [0, 1, 2]
    gather = grp.gather.reshape(3, 256)
    assert gather[0, :2].tolist() == [5, 6] and gather[1, :3].tolist() == [0, 1, 2] and gather[2, 0] == 9
    assert not gather[0, 2:].any() and not gather[2, 1:].any()   # padding reads cell 0, masked
    m = group_mask(grp, 256, 0)
    assert m.shape == (3, 1, 1, 256) and m.dtype == np.float16
    assert [int((row == 0).sum()) for row in m[:, 0, 0]] == [2, 3, 1]
    assert (m[1, 0, 0, :3] == 0).all() and np.isneginf(m[1, 0, 0, 3:]).all()
    w = group_mask(grp, 256, 2, np.float32)             # a window of 2: the last two cells
    assert (w[1, 0, 0, :4] == 0).tolist() == [False, True, True, False] and w.dtype == np.float32


def test_a_prompt_among_decodes_is_its_own_group_and_the_rows_go_back_in_order():
    cells = np.array([4, 5, 6, 7, 0, 1], np.int32)      # sequence A: cells 4-7 (a 2-token prompt ends
    ranges = np.array([[4, 1], [0, 3], [0, 4], [5, 1]], np.int32)   # at 7), B: 0, C: 1
    layout, groups = attention_plan(cells, ranges, 4)
    assert layout.groups == ((1, 2, 256), (2, 1, 256)) and not layout.in_order
    decodes, prompt = groups
    assert decodes.tokens.tolist() == [0, 3] and prompt.tokens.tolist() == [1, 2]
    assert prompt.lengths.tolist() == [[3, 4]] and prompt.gather[:4].tolist() == [4, 5, 6, 7]
    m = group_mask(prompt, 256, 0)                       # causal within the prompt
    assert [int((m[0, 0, j] == 0).sum()) for j in range(2)] == [3, 4]
    with pytest.raises(ValueError):
        attention_plan(cells, np.array([[4, 3]], np.int32), 1)


def test_the_engine_restores_a_ggml_peer_that_died(model_factory):
    from pyllama.backend.cpu import CPUBackend
    from pyllama.backend.ggml.backend import GGMLBackend, ggml_connection
    from pyllama.rpc.connection import RPCError
    from pyllama.runtime.engine import Engine
    model = model_factory("tiny", arch="llama", wtype="q8_0")
    peer = FakeGGMLPeer(compute=True)
    port = int(peer.endpoint.rsplit(":", 1)[1])
    engine = None
    try:
        engine = Engine(model, n_threads=1, backends=[GGMLBackend(ggml_connection(peer.endpoint), 0, "RPC0"),
                                                      CPUBackend(1)], tensor_split=[1, 1])
        prompt = engine.tokenizer.encode(PROMPT)
        ctx = engine.new_context(256, 1)
        want = greedy_decode(ctx, prompt, 6)
        peer.stop()                                    # the peer dies
        ctx.clear()
        with pytest.raises(RPCError):
            greedy_decode(ctx, prompt, 2)
        lost = engine.lost_devices()
        assert list(lost) == ["RPC0"] and peer.endpoint in lost["RPC0"]
        with pytest.raises(RPCError):
            engine.reach_lost_devices()                # nobody listens yet
        peer = FakeGGMLPeer(compute=True, port=port)
        engine.reach_lost_devices()
        assert engine.restore_lost_devices() == ["RPC0"] and engine.lost_devices() == {}
        assert ctx.kv.n_tokens_cached() == 0           # the sequence starts again, same tokens
        assert greedy_decode(ctx, prompt, 6) == want
    finally:
        if engine is not None:
            engine.close()
        peer.stop()


def test_two_ggml_peers_in_one_split(model_factory):
    model = model_factory("tiny", arch="qwen2", wtype="q8_0")
    want = _generate(model)
    peers = [FakeGGMLPeer(compute=True), FakeGGMLPeer(compute=True)]
    try:
        got = _generate(model, "--rpc", ",".join(p.endpoint for p in peers), "-dev", "RPC0,RPC1,CPU", "-ts", "1,1,0")
        assert all(p.graphs for p in peers)
    finally:
        for p in peers:
            p.stop()
    assert got == want


@contextlib.contextmanager
def _server_over(peer: FakeGGMLPeer, model: str, *args: str):
    """pyllama's server with `--rpc` at the test peer (stopped, then the peer, on the way out)."""
    from server_util import ServerProcess
    srv = None
    try:
        srv = ServerProcess(model, "--rpc", peer.endpoint, "-t", "1", *args).wait_ready()
        yield srv
    finally:
        if srv is not None:
            assert srv.stop() == 0
        peer.stop()


def test_two_pipeline_groups_share_one_ggml_peer(model_factory):
    import threading
    model = model_factory("tiny", arch="llama", wtype="f32")
    want = _generate(model, "--ignore-eos", n=12)
    peer = FakeGGMLPeer(compute=True)
    with _server_over(peer, model, "-dev", "RPC0,CPU", "-ts", "1,1", "-np", "2", "-c", "512",
                      "--pipeline-groups", "2") as srv:
        results: list = [None, None]

        def ask(i: int) -> None:
            results[i] = srv.post("/completion", {"prompt": PROMPT, "n_predict": 12, "temperature": 0,
                                                  "ignore_eos": True, "cache_prompt": False, "return_tokens": True})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for status, res in results:
            assert status == 200, res
            assert res["tokens"] == want


def test_a_layer_the_lowering_lacks_is_refused_at_load_naming_the_peer(model_factory, monkeypatch):
    from pyllama.backend.cpu import CPUBackend
    from pyllama.backend.ggml import backend as ggml_backend
    from pyllama.ir.tensor import Op
    from pyllama.runtime.engine import Engine
    from pyllama.util.errors import PyllamaError
    model = model_factory("tiny", arch="qwen2moe")
    monkeypatch.setattr(ggml_backend, "LOWERED_OPS", ggml_backend.LOWERED_OPS - {Op.MOE_FFN})
    peer = FakeGGMLPeer(compute=True)
    backends = [ggml_backend.GGMLBackend(ggml_backend.ggml_connection(peer.endpoint), 0, "RPC0"), CPUBackend(1)]
    try:
        with pytest.raises(PyllamaError) as err:
            Engine(model, n_threads=1, backends=backends, tensor_split=[1, 1])
    finally:
        for b in backends:
            b.close()
        peer.stop()
    said = str(err.value)
    assert "(MOE_FFN) of layer 0 cannot run on RPC0 (a llama.cpp rpc-server at" in said, said
    assert "update that server" not in said and "\n" not in said


def _mixed_steps():
    from pyllama.runtime.context import Batch
    # prompts of two lengths, then decodes interleaved with a prompt, then decodes out of order
    return [Batch.concat([Batch.for_sequence([5, 6, 7, 8, 9], 0, 0, True), Batch.for_sequence([11, 12, 13], 0, 1, True)]),
            Batch.concat([Batch.for_sequence([21], 5, 0), Batch.for_sequence([31, 32, 33, 34], 0, 2, True),
                          Batch.for_sequence([22], 3, 1)]),
            Batch.concat([Batch.for_sequence([23], 4, 1), Batch.for_sequence([24], 6, 0), Batch.for_sequence([35], 4, 2)])]


def _logits(model: str, cache: DType, peer=None) -> list[np.ndarray]:
    """The logits of _mixed_steps, unsplit on the CPU or split RPC0 (the peer), CPU."""
    from pyllama.backend.cpu import CPUBackend
    from pyllama.backend.ggml.backend import GGMLBackend, ggml_connection
    from pyllama.runtime.engine import Engine
    backends = [CPUBackend(1)] if peer is None else [GGMLBackend(ggml_connection(peer.endpoint), 0, "RPC0"),
                                                     CPUBackend(1)]
    engine = Engine(model, n_threads=1, backends=backends, tensor_split=None if peer is None else [1, 1])
    try:
        ctx = engine.new_context(256, 3, type_k=cache, type_v=cache)
        assert set(ctx.kv_types.values()) == {(cache, cache)}, ctx.kv_types   # no device fell back
        return [ctx.decode(b).logits.copy() for b in _mixed_steps()]
    finally:
        engine.close()


@pytest.mark.parametrize("cache,atol", [(DType.F16, 2e-3), (DType.F32, 2e-3), (DType.BF16, 2e-3)])
def test_a_batch_mixing_prompts_and_decodes_matches_the_unsplit_logits(model_factory, cache, atol):
    # prompts of two lengths and decodes in one batch, the decodes interleaved with a prompt: the
    # lowering gathers the rows into groups (flash attention on an F16 or BF16 cache, its rows
    # gathered bit for bit; MUL_MAT + SOFT_MAX on an F32 one) and puts the results back in the
    # batch's order
    model = model_factory("tiny", arch="llama", wtype="f32")
    want = _logits(model, cache)
    peer = FakeGGMLPeer(compute=True)
    try:
        got = _logits(model, cache, peer)
        layouts = {tuple(int(x) for x in t["ne"]) for _, _, recs in peer.graphs for t in recs
                   if bytes(t["name"]).startswith(b"kq_mask")}
    finally:
        peer.stop()
    for w, g in zip(want, got):
        assert w.shape == g.shape
        np.testing.assert_allclose(g, w, atol=atol, rtol=0)
    assert {(256, 1, 1, 2), (256, 4, 1, 1), (256, 5, 1, 1), (256, 3, 1, 1), (256, 1, 1, 3)} <= layouts, layouts


def test_a_q8_0_cache_on_the_peer_is_hadamard_rotated_as_llama_cpp_rotates_it(model_factory):
    # llama.cpp rotates q, k and v by a Hadamard matrix before a quantized cache stores them (heads
    # of 64) and the output back; pyllama's CPU does not, so the two quantize different values.
    # Both are measured against an F32 cache: the rotated one is no further off than the CPU's
    # (a rotation left undone, or applied to one side only, is far off)
    model = model_factory("tiny256", arch="llama", wtype="f32")   # heads of 64: whole Q8_0 blocks
    exact = _logits(model, DType.F32)
    cpu_q8 = _logits(model, DType.Q8_0)
    peer = FakeGGMLPeer(compute=True)
    try:
        peer_q8 = _logits(model, DType.Q8_0, peer)
        hinted = [t for _, _, recs in peer.graphs for t in recs
                  if int(t["op"]) == int(GOp.MUL_MAT) and int(t["op_params"][1]) == 1]
    finally:
        peer.stop()
    err_cpu = max(float(np.abs(c - e).max()) for c, e in zip(cpu_q8, exact))
    err_peer = max(float(np.abs(p - e).max()) for p, e in zip(peer_q8, exact))
    assert 0 < err_peer < 1.5 * err_cpu, (err_peer, err_cpu)
    assert hinted, "no Hadamard product (MUL_MAT with ggml's Hadamard hint) reached the peer"


def test_greedy_rows_are_sampled_on_the_peer_and_the_others_here(model_factory):
    # the output layer on the peer: greedy requests end the graph at ARGMAX and read back ids;
    # a request with a temperature (top_k 1: the same tokens) and one asking for probabilities
    # take the logits back and the host's sampler chain
    model = model_factory("tiny", arch="llama", wtype="f32")
    want = _generate(model, "--ignore-eos", n=8)
    peer = FakeGGMLPeer(compute=True)
    with _server_over(peer, model, "-dev", "CPU,RPC0", "-ts", "1,1", "-np", "1", "-c", "256") as srv:
        ask = {"prompt": PROMPT, "n_predict": 8, "ignore_eos": True, "cache_prompt": False, "return_tokens": True}

        def argmax_graphs() -> int:
            return sum(any(int(t["op"]) == int(GOp.ARGMAX) for t in recs) for _, _, recs in peer.graphs)

        status, res = srv.post("/completion", {**ask, "temperature": 0})
        assert status == 200 and res["tokens"] == want
        greedy_graphs = argmax_graphs()
        assert greedy_graphs >= 1
        status, res = srv.post("/completion", {**ask, "temperature": 0.8, "top_k": 1, "seed": 3})
        assert status == 200 and res["tokens"] == want
        status, res = srv.post("/completion", {**ask, "temperature": 0, "n_probs": 2})
        assert status == 200 and res["tokens"] == want
        assert len(res["completion_probabilities"][0]["top_logprobs"]) == 2
        assert argmax_graphs() == greedy_graphs        # neither request's graphs ended at ARGMAX


def test_each_device_of_a_ggml_peer_is_an_rpc_device_in_llama_cpp_order(model_factory):
    # a llama.cpp rpc-server with two devices, then a pyllama rpc server: RPC0 and RPC1 are the
    # first one's devices 0 and 1, RPC2 the second server's one device
    from server_util import RPCServerProcess
    model = model_factory("tiny", arch="llama", wtype="q8_0")
    want = _generate(model)
    peer = FakeGGMLPeer(devices=((3 << 30, 4 << 30), (1 << 30, 2 << 30)), compute=True)
    ours = RPCServerProcess()
    try:
        rpc = f"{peer.endpoint},{ours.endpoint}"
        got = _generate(model, "--rpc", rpc, "-dev", "RPC0,RPC1", "-ts", "1,1")    # a layer on each
        devices = sorted({int(dev) for dev, _, _ in peer.graphs})
        peer.graphs.clear()
        got_ours = _generate(model, "--rpc", rpc, "-dev", "RPC2,RPC1", "-ts", "1,1")
        devices_after = sorted({int(dev) for dev, _, _ in peer.graphs})
        listed = subprocess.run([sys.executable, "-m", "pyllama.server", "--list-devices", "--rpc",
                                 f"{peer.endpoint},{ours.endpoint}"], capture_output=True, text=True, timeout=120,
                                stdin=subprocess.DEVNULL)
    finally:
        peer.stop()
        assert ours.stop() == 0
    assert got == want and got_ours == want
    assert devices == [0, 1], devices          # both of the peer's devices computed their layers
    assert devices_after == [1], devices_after  # RPC2 is the pyllama server's
    assert listed.returncode == 0, listed.stderr[-2000:]
    lines = [ln.strip() for ln in listed.stdout.splitlines()]
    assert [ln.split(":")[0] for ln in lines[1:]] == ["RPC0", "RPC1", "RPC2"], lines
    assert "(4096 MiB, 3072 MiB free)" in lines[1] and "(2048 MiB, 1024 MiB free)" in lines[2]


def test_a_device_beyond_the_peers_devices_is_refused_in_one_line(model_factory):
    model = model_factory("tiny", arch="llama", wtype="f32")
    peer = FakeGGMLPeer(compute=True)
    try:
        r = subprocess.run([sys.executable, "-m", "pyllama.generate", "-m", model, "-p", "x", "-n", "1", "--rpc",
                            peer.endpoint, "-dev", "RPC1,CPU"], capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL)
    finally:
        peer.stop()
    assert r.returncode != 0
    assert "--device RPC1: the --rpc servers have 1 device" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_weights_a_peer_kept_are_not_sent_again(model_factory, monkeypatch):
    # rpc-server -c keeps each long write under its FNV-1a hash; a later load offers the hash first
    # (SET_TENSOR_HASH) and sends the bytes only when the peer lacks them, as llama.cpp's client does
    from pyllama.backend.cpu import CPUBackend
    from pyllama.backend.ggml import backend as ggml_backend
    from pyllama.backend.ggml.protocol import GCmd
    from pyllama.runtime.engine import Engine
    model = model_factory("tiny", arch="llama", wtype="f32")
    monkeypatch.setattr(ggml_backend, "HASH_MIN_BYTES", 16 << 10)   # the tiny model's matrices are small
    peer = FakeGGMLPeer(compute=True)
    peer.keep_cache, peer.hash_min = True, 16 << 10
    runs = []
    try:
        for _ in range(2):
            before = len(peer.commands)
            engine = Engine(model, n_threads=1, backends=[ggml_backend.GGMLBackend(
                ggml_backend.ggml_connection(peer.endpoint), 0, "RPC0"), CPUBackend(1)], tensor_split=[1, 1])
            try:
                ctx = engine.new_context(256, 1)
                tokens = greedy_decode(ctx, engine.tokenizer.encode(PROMPT), 6)
            finally:
                engine.close()
            sent = peer.commands[before:]
            runs.append((tokens, sent.count(GCmd.SET_TENSOR_HASH), sent.count(GCmd.SET_TENSOR)))
    finally:
        peer.stop()
    (first, asked1, sets1), (second, asked2, sets2) = runs
    assert peer.cache and asked1 == asked2 == len(peer.cache)      # every long write offered its hash
    assert sets2 == sets1 - len(peer.cache)                        # ... and the second load sent none of them
    assert second == first


def test_metrics_and_pipeline_stats_over_a_ggml_peer(model_factory):
    # llama.cpp's rpc-server reports no busy time and counts no traffic of its own: /metrics and the
    # pipeline figures say so for that device instead of failing
    model = model_factory("tiny", arch="llama", wtype="f32")
    peer = FakeGGMLPeer(compute=True)
    with _server_over(peer, model, "-dev", "CPU,RPC0", "-ts", "1,1", "-np", "1", "-c", "256", "--metrics") as srv:
        status, res = srv.post("/completion", {"prompt": PROMPT, "n_predict": 4})
        assert status == 200, res
        status, text = srv.request("GET", "/metrics")
        assert status == 200, text
        assert "llamacpp:tokens_predicted_total 4" in text
        status, stats = srv.request("GET", "/pipeline/stats")
        assert status == 200, stats
        rpc = [d for d in stats["devices"] if d["name"] == "RPC0"]
        assert rpc and not rpc[0]["measured"] and "busy time" in rpc[0]["note"], stats["devices"]
        assert [link["endpoint"] for link in stats["rpc"]] == [peer.endpoint]
        assert stats["rpc"][0]["round_trips_total"] > 0 and stats["rpc"][0]["bytes_out_total"] > 0
