"""How the programs behave as processes: which environment variables they read, their log lines
and levels, and the stop signals (the first graceful, a second one at once)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from pyllama.util.cli import Parser
from server_util import LONG_CONTEXT, RPCServerProcess, ServerProcess, free_port

LEVEL = re.compile(r"^\S+ \S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


# --- environment variables ----------------------------------------------------------------------

def test_server_flags_read_pyllama_then_llama_variables(monkeypatch):
    def parse(*argv):
        p = Parser(prog="x")
        p.add_argument("--ctx-size", type=int, default=0)
        return p.parse_args(list(argv)).ctx_size

    monkeypatch.delenv("PYLLAMA_ARG_CTX_SIZE", raising=False)
    monkeypatch.setenv("LLAMA_ARG_CTX_SIZE", "64")
    assert parse() == 64
    monkeypatch.setenv("PYLLAMA_ARG_CTX_SIZE", "128")
    assert parse() == 128            # ours wins over llama-server's
    assert parse("--ctx-size", "256") == 256  # the command line wins over both


def test_rpc_server_ignores_the_servers_variables():
    """PYLLAMA_ARG_DEVICE=RPC0,CPU (and the like) are exported for the server; an rpc server
    started in the same shell must not read them, and starts as if they were not there."""
    env = {"PYLLAMA_ARG_DEVICE": "RPC0,CPU", "LLAMA_ARG_DEVICE": "RPC0,CPU", "PYLLAMA_ARG_PORT": "1",
           "LLAMA_ARG_PORT": "1", "PYLLAMA_ARG_THREADS": "-3", "PYLLAMA_ARG_HOST": "0.0.0.0"}
    peer = RPCServerProcess(env=env)
    try:
        assert peer.port not in (0, 1)
        assert any(line.startswith("listening on 127.0.0.1:") for line in peer.log), peer.log
    finally:
        assert peer.stop() == 0
    # its own prefix does reach it
    bad = subprocess.run([sys.executable, "-m", "pyllama.rpc_server", "--port", "0"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, **env, "PYLLAMA_RPC_SERVER_ARG_DEVICE": "CUDA7"})
    assert bad.returncode == 1 and "CUDA7" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    help_text = subprocess.run([sys.executable, "-m", "pyllama.rpc_server", "--help"], capture_output=True,
                               text=True, timeout=60).stdout
    assert "PYLLAMA_RPC_SERVER_ARG_DEVICE" in help_text and "PYLLAMA_ARG_" not in help_text


# --- log lines ----------------------------------------------------------------------------------

def _levels(text: str) -> list[tuple[str, str]]:
    out = []
    for line in text.splitlines():
        m = LEVEL.match(line)
        if m:
            out.append((m.group(1), line))
    return out


def test_server_logs_normal_events_at_info_and_listens_after_loading(tiny_model):
    srv = ServerProcess(tiny_model, "-np", "2", "-c", "256").wait_ready()
    status, _ = srv.post("/completion", {"prompt": "hello", "n_predict": 2})
    assert status == 200
    assert srv.stop() == 0
    lines = _levels(srv.stderr_text)
    assert lines, srv.stderr_text
    problems = [ln for lvl, ln in lines if lvl not in ("INFO",)]
    assert not problems, problems  # a normal start, request and stop: nothing at WARNING, no DEBUG without -v
    text = [ln for _, ln in lines]
    listening = [i for i, ln in enumerate(text) if "listening on" in ln]
    loaded = [i for i, ln in enumerate(text) if "loaded" in ln and "model" in ln]
    assert len(listening) == 1 and loaded, text
    assert loaded[-1] < listening[0], text         # listening only once the model is loaded and checked
    assert any("shutting down" in ln for ln in text[listening[0]:]), text


def test_server_verbose_adds_debug(tiny_model):
    srv = ServerProcess(tiny_model, "-np", "1", "-c", "128", "-v").wait_ready()
    assert srv.stop() == 0
    assert any(lvl == "DEBUG" for lvl, _ in _levels(srv.stderr_text)), srv.stderr_text[-2000:]


def test_server_that_cannot_load_never_says_listening(tmp_path):
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF but not really")
    proc = subprocess.run([sys.executable, "-m", "pyllama.server", "-m", str(bad), "--port", str(free_port()),
                           "-t", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "listening on" not in proc.stderr and "error:" in proc.stderr


# --- signals ------------------------------------------------------------------------------------

def _stream_in_flight(srv: ServerProcess) -> threading.Thread:
    def run() -> None:
        try:
            srv.stream("/completion", {"prompt": "Once upon a time", "n_predict": 100000, "ignore_eos": True},
                       timeout=120)
        except Exception:  # noqa: BLE001 - the server goes away under it: that is the point
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status, slots = srv.request("GET", "/slots")
        if status == 200 and any(s["is_processing"] for s in slots):
            return t
        time.sleep(0.05)
    raise AssertionError("the stream did not start")


@pytest.fixture()
def long_server(tiny_model):
    srv = ServerProcess(tiny_model, "-np", "1", "-c", "100000", *LONG_CONTEXT).wait_ready()
    yield srv
    if srv.proc.poll() is None:
        srv.proc.kill()
    srv.proc.wait()


def test_a_second_ctrl_c_exits_at_once(long_server):
    srv = long_server
    _stream_in_flight(srv)
    srv.proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    assert srv.proc.poll() is None, "the first Ctrl+C did not wait for the stream in flight"
    srv.proc.send_signal(signal.SIGINT)
    code = srv.proc.wait(20)
    srv._collect()
    assert code == 130, (code, srv.stderr_text[-2000:])
    assert "second SIGINT" in srv.stderr_text


def test_one_ctrl_c_stays_graceful(long_server):
    srv = long_server
    _stream_in_flight(srv)
    srv.proc.send_signal(signal.SIGINT)
    code = srv.proc.wait(60)
    srv._collect()
    assert code == 0, srv.stderr_text[-2000:]
    assert "second" not in srv.stderr_text
