"""--pipeline-groups N: output identical at N = 1, 2, 4 (local and split over two rpc servers), a
concurrent stress run with cancellations and n > 1, and the start-up refusals."""
from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import threading
import time

import pytest

from server_util import RPCServerProcess, ServerProcess

PROMPTS = ["The little cat sat on the", "Once upon a time", "In a hole in the ground", "1, 2, 3,"]


def greedy_outputs(srv: ServerProcess) -> list:
    out = []
    for p in PROMPTS:
        status, res = srv.post("/completion", {"prompt": p, "n_predict": 12, "temperature": 0, "ignore_eos": True,
                                               "cache_prompt": False, "return_tokens": True})
        assert status == 200, res
        out.append(res["tokens"])
    return out


@pytest.fixture(scope="module")
def peers():
    a, b = RPCServerProcess(), RPCServerProcess()
    yield a, b
    a.stop()
    b.stop()


@pytest.mark.parametrize("split", [False, True])
def test_greedy_identical_across_group_counts(tiny_model, peers, split):
    extra = ["--rpc", f"{peers[0].endpoint},{peers[1].endpoint}", "--device", "RPC0,RPC1"] if split else []
    results = {}
    for n in (1, 2, 4):
        srv = ServerProcess(tiny_model, "--metrics", "-np", "4", "-c", "1024", "--pipeline-groups", str(n), *extra).wait_ready()
        try:
            results[n] = greedy_outputs(srv)
            _, slots = srv.request("GET", "/slots")
            assert sorted({s["group"] for s in slots}) == list(range(n))
        finally:
            assert srv.stop() == 0
    assert results[1] == results[2] == results[4]


def test_stress_two_groups(tiny_model):
    srv = ServerProcess(tiny_model, "--metrics", "-np", "4", "-c", "2048", "--pipeline-groups", "2").wait_ready()
    errors: list[str] = []
    done = {"ok": 0, "cancelled": 0}
    stop_polling = threading.Event()

    def poll() -> None:
        while not stop_polling.is_set():
            for path in ("/slots", "/metrics"):
                status, _ = srv.request("GET", path)
                if status != 200:
                    errors.append(f"{path}: {status}")
            time.sleep(0.02)

    def streamer(i: int) -> None:
        rng = random.Random(i)
        try:
            if rng.random() < 0.3:  # cancel mid-stream
                s = socket.create_connection(("127.0.0.1", srv.port))
                body = json.dumps({"prompt": PROMPTS[i % 4], "n_predict": 400, "stream": True,
                                   "ignore_eos": True}).encode()
                s.sendall(b"POST /completion HTTP/1.1\r\nHost: localhost\r\nContent-Length: " + str(len(body)).encode()
                          + b"\r\n\r\n" + body)
                got = b""
                while got.count(b"data: ") < 3:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    got += chunk
                s.close()
                done["cancelled"] += 1
            elif rng.random() < 0.3:
                status, res = srv.post("/v1/completions", {"prompt": PROMPTS[i % 4], "max_tokens": 8, "n": 2,
                                                           "ignore_eos": True})
                assert status == 200 and len(res["choices"]) == 2, res
                assert res["usage"]["completion_tokens"] == 16
                done["ok"] += 1
            else:
                n = rng.randint(4, 20)
                events = srv.stream("/completion", {"prompt": PROMPTS[i % 4], "n_predict": n, "ignore_eos": True})
                assert events[-1]["stop"] and events[-1]["tokens_predicted"] == n
                done["ok"] += 1
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(f"{i}: {exc!r}")

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        threads = [threading.Thread(target=streamer, args=(i,)) for i in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a request hung"
        # a slot goes idle on its decode thread, the router's count on the task thread a moment
        # later: both must settle, within a deadline
        deadline = time.monotonic() + 10
        while True:
            _, slots = srv.request("GET", "/slots")
            _, text = srv.request("GET", "/metrics")
            metrics = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
            settled = (not any(s["is_processing"] for s in slots)
                       and float(metrics["llamacpp:requests_processing"]) == 0)
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert not any(s["is_processing"] for s in slots), slots  # no slot leaked
        assert float(metrics["llamacpp:requests_processing"]) == 0
        assert float(metrics["llamacpp:requests_deferred"]) == 0
    finally:
        stop_polling.set()
        poller.join()
        assert srv.stop() == 0
    assert not errors, errors[:5]
    assert done["ok"] + done["cancelled"] == 40


def refusal(model: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyllama.server", "-m", model, "--port", "0", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args,needle", [
    (["-np", "3", "--pipeline-groups", "2"], "does not divide --parallel 3"),
    (["-np", "4", "--pipeline-groups", "4", "-c", "1026"], "not divisible by --pipeline-groups 4"),
    (["--pipeline-chunk", "-1"], "--pipeline-chunk -1"),
])
def test_refused_configurations(tiny_model, args, needle):
    proc = refusal(tiny_model, *args)
    assert proc.returncode == 1 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len([ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]) == 1


def test_refused_when_a_peer_lacks_memory(model_factory):
    model = model_factory("small")
    peer = RPCServerProcess("--mem", "40")
    try:
        proc = refusal(model, "--rpc", peer.endpoint, "--device", "RPC0,CPU", "-ts", "1,1", "-np", "4",
                       "--pipeline-groups", "2",
                       "-c", "2048")
        assert proc.returncode == 1, proc.stderr
        line = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert len(line) == 1 and "not enough memory on RPC0" in line[0] and "short by" in line[0], proc.stderr
    finally:
        peer.stop()


def test_pipe_prof_reports_each_group(tiny_model):
    srv = ServerProcess(tiny_model, "-np", "2", "--pipeline-groups", "2", "-c", "1024",
                        env={"PYLLAMA_PIPE_PROF": "1", "PYLLAMA_PIPE_PROF_MS": "200"}).wait_ready()
    try:
        threads = [threading.Thread(target=srv.post, args=("/completion", {"prompt": p, "n_predict": 40,
                                                                           "ignore_eos": True, "stop": ["zz"]}))
                   for p in PROMPTS[:2]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        time.sleep(0.5)
    finally:
        assert srv.stop() == 0
    log = srv.stderr_text
    for g in (0, 1):
        lines = [ln for ln in log.splitlines() if ln.startswith(f"pipe prof group {g}:")]
        busy = [ln for ln in lines if " 0 steps" not in ln]
        assert busy, log[-2000:]
        for name in ("lock_wait", "pre_decode", "submit", "synchronize", "post_decode", "sampling", "detokenize",
                     "stop_strings", "result_send"):
            assert name in busy[0]
