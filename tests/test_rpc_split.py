"""Layer split over rpc servers: byte-identical greedy output, capability fallback both ways,
one read per decode step, and a peer killed mid-generation."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from pyllama.backend.rpc import RPCBackend
from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
from pyllama.obs import rpc_stats as stats
from pyllama.rpc.connection import Connection
from pyllama.rpc.protocol import Cap
from pyllama.util.settings import RpcSettings
from server_util import LONG_CONTEXT, RPCServerProcess, ServerProcess

PROMPT = "The little cat sat on the"


@pytest.fixture(scope="module")
def peers():
    a, b = RPCServerProcess(), RPCServerProcess()
    yield a, b
    assert a.stop() == 0 and b.stop() == 0


def generate(model: str, *args: str, env: dict | None = None) -> list[int]:
    proc = subprocess.run([sys.executable, "-m", "pyllama.generate", "-m", model, "-p", PROMPT, "-n", "24",
                           "--temp", "0", "--ignore-eos", "--tokens", "-t", "1", *args],
                          capture_output=True, text=True, timeout=180, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return [int(x) for x in proc.stdout.split()]


def test_greedy_output_identical_over_every_split(model_factory, peers):
    model = model_factory("tiny", arch="qwen3")
    a, b = peers
    local = generate(model)
    rpc = ["--rpc", f"{a.endpoint},{b.endpoint}"]
    assert generate(model, *rpc, "--device", "RPC0,CPU") == local
    assert generate(model, *rpc, "--device", "CPU,RPC0") == local
    assert generate(model, *rpc, "--device", "RPC0,RPC1") == local
    assert generate(model, *rpc, "--device", "RPC1", "-sm", "none") == local
    assert generate(model, *rpc, "--device", "RPC0,CPU", "-ts", "1,3") == local


@pytest.mark.parametrize("client_batched,server_caps", [(False, None), (True, "0")])
def test_batched_read_capability_both_ways(tiny_model, client_batched, server_caps):
    """A client that never sends GET_TENSORS against a server that has it, and a client that has it
    against a server that does not advertise it: same output, and the command only when advertised."""
    env = {"PYLLAMA_RPC_SERVER_CAPS": server_caps} if server_caps is not None else {}
    peer = RPCServerProcess(env=env)
    try:
        conn = Connection(peer.endpoint)
        assert conn.has(Cap.GET_TENSORS) == (server_caps is None)
        backend = RPCBackend(conn, 0, "RPC0", settings=RpcSettings(batched_get=client_batched))
        assert backend.batched_get == (client_batched and server_caps is None)
        engine = Engine(tiny_model, n_threads=1, backends=[backend], tensor_split=[1])
        ctx = engine.new_context(256, 2)
        remote = ctx.decode(Batch.for_sequence(engine.tokenizer.encode(PROMPT), 0, 0)).logits.copy()
        local_engine = Engine(tiny_model, n_threads=1)
        local = local_engine.new_context(256, 2).decode(Batch.for_sequence(engine.tokenizer.encode(PROMPT), 0, 0)).logits
        np.testing.assert_array_equal(remote, local)
        engine.close()
        conn.close()
    finally:
        assert peer.stop() == 0


@pytest.mark.parametrize("order", ["RPC0", "CPU,RPC0", "RPC0,CPU"])
def test_one_read_round_trip_per_decode_step(tiny_model, peers, order):
    """Whatever the batch size, a generation step reads back once: the logits when the output layer
    is remote, the hidden state when the output layer is local and the first layers are remote."""
    from pyllama.backend.cpu import CPUBackend
    a, _ = peers
    conn = Connection(a.endpoint)
    backends = [CPUBackend(1) if d == "CPU" else RPCBackend(conn, 0, d) for d in order.split(",")]
    engine = Engine(tiny_model, n_threads=1, backends=backends, tensor_split=[1] * len(backends))
    for n_seq in (1, 8, 32):
        ctx = engine.new_context(64 * n_seq, n_seq)
        prompts = [engine.tokenizer.encode(f"{PROMPT} {i}") for i in range(n_seq)]
        ctx.decode(Batch.concat([Batch.for_sequence(p, 0, s) for s, p in enumerate(prompts)]))
        stats.reset()
        pos = [len(p) for p in prompts]
        for step in range(5):
            ctx.decode(Batch(np.full(n_seq, 300 + step), pos, range(n_seq), np.ones(n_seq, bool)))
            pos = [p + 1 for p in pos]
        counts, steps = stats.snapshot()
        assert steps == 5
        reads = counts.get("GET_TENSORS", (0,))[0] + counts.get("GET_TENSOR", (0,))[0]
        assert reads == 5, (n_seq, counts)
        ctx.free()
    engine.close()
    conn.close()


def test_peer_killed_mid_generation(tiny_model):
    peer = RPCServerProcess()
    srv = ServerProcess(tiny_model, "--rpc", peer.endpoint, "--device", "RPC0,CPU", "-np", "2", "-c", "4096",
                        *LONG_CONTEXT).wait_ready()
    try:
        events: list = []
        t = threading.Thread(target=lambda: events.extend(
            srv.stream("/completion", {"prompt": PROMPT, "n_predict": 1500, "ignore_eos": True}, timeout=30)))
        t.start()
        time.sleep(0.5)
        peer.stop(signal.SIGKILL)
        t0 = time.monotonic()
        t.join(30)
        assert not t.is_alive() and time.monotonic() - t0 < 10
        assert events and "error" in events[-1], events[-1:]
        status, health = srv.request("GET", "/health")
        assert status == 500 and "RPC" in json.dumps(health)
        status, res = srv.post("/completion", {"prompt": PROMPT, "n_predict": 4})
        assert status >= 500 and "error" in res  # a clean error, not a hang
    finally:
        assert srv.stop() == 0
        peer.stop()


def test_split_check_script_passes():
    proc = subprocess.run([sys.executable, "bench/split_check.py", "--prompts", "3", "--n-predict", "8"],
                          capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compared 3 completions" in proc.stdout


def test_weight_cache_spares_the_upload_after_a_restart(tmp_path, model_factory):
    model = model_factory("small")  # weights of >= 1 MiB go through the cache
    cache = tmp_path / "cache"
    sent = []
    for _ in range(2):
        peer = RPCServerProcess("--cache", str(cache))
        try:
            conn = Connection(peer.endpoint)
            assert conn.has(Cap.SET_TENSOR_HASH)
            stats.reset()  # the counts are kept whether or not they are printed
            engine = Engine(model, n_threads=1, backends=[RPCBackend(conn, 0, "RPC0")], tensor_split=[1])
            counts, _ = stats.snapshot()
            logits = engine.new_context(64, 1).decode(Batch.for_sequence([256, 300, 301], 0, 0)).logits.copy()
            sent.append((counts.get("SET_TENSOR", (0, 0, 0))[1], counts.get("SET_TENSOR_HASH", (0,))[0], logits))
            engine.close()
            conn.close()
        finally:
            peer.stop()
    (first_bytes, first_hashes, first_logits), (second_bytes, second_hashes, second_logits) = sent
    assert first_hashes > 0 and second_hashes == first_hashes
    # only tensors under the 1 MiB hashing threshold travel again (about 13 of 61 MB here)
    assert first_bytes > 40 << 20 and second_bytes < first_bytes / 4
    np.testing.assert_array_equal(first_logits, second_logits)


def test_rpc_stats_printed_by_the_program(tiny_model, peers):
    a, _ = peers
    proc = subprocess.run([sys.executable, "-m", "pyllama.generate", "-m", tiny_model, "-p", PROMPT, "-n", "40",
                           "--temp", "0", "--ignore-eos", "--rpc", a.endpoint, "--device", "RPC0,CPU", "-t", "1"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYLLAMA_RPC_STATS": "1", "PYLLAMA_RPC_STATS_MS": "100"})
    assert proc.returncode == 0, proc.stderr
    assert "rpc stats:" in proc.stderr and "GET_TENSOR" in proc.stderr and "per decode step" in proc.stderr
