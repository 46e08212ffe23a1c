"""Faults between a server and its rpc servers: a peer killed mid-step, a peer that stops answering
(half-open), a peer restarted with its weight cache, a slow or lossy link (tests/fault_proxy.py).
The affected requests fail with a clear error within a bounded time, /health reports the fault,
the server reconnects when the peer is back and serves the same greedy text again, nothing leaks,
and shutdown stays bounded whatever state the peer is in."""
from __future__ import annotations

import os
import signal
import socket
import threading
import time

import numpy as np
import psutil
import pytest

from pyllama.backend.cpu import CPUBackend
from pyllama.backend.rpc import RPCBackend
from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
from pyllama.rpc import connection as rpc_connection
from pyllama.obs import rpc_stats as stats
from pyllama.rpc.connection import Connection, RPCError
from pyllama.rpc.protocol import HEADER, HELLO_REP, U32, Cmd
from fault_proxy import FaultProxy, wait_for
from greedy import greedy_decode
from server_util import RPCServerProcess, ServerProcess

PROMPT = "The little cat sat on the"
SPM_VOCAB = os.path.join(os.path.dirname(__file__), "data", "vocab", "ggml-vocab-llama-spm.gguf")


@pytest.fixture(scope="module")
def cached_model(model_factory) -> str:
    """The tiny model with a 32000-token vocabulary: its 8 MiB embedding goes through the peer's
    weight cache (SET_TENSOR_HASH), as a real model's weights do."""
    return model_factory("tiny", vocab=SPM_VOCAB)


# --- a peer of our own that answers HELLO and then nothing -----------------------------------------
class SilentPeer:
    """Accepts one connection, answers its HELLO, then never answers again; with read=False it
    does not even read (the client's send buffer fills). The socket stays open: a half-open peer."""

    def __init__(self, read: bool, answer_hello: bool = True):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.read = read
        self.answer_hello = answer_hello
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.listener.settimeout(0.05)
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.conns.append(conn)
            conn.settimeout(0.05)
            if self.answer_hello:
                head = b""
                while len(head) < HEADER.size + 4 and not self._stop.is_set():
                    try:
                        head += conn.recv(HEADER.size + 4 - len(head))
                    except socket.timeout:
                        continue
                conn.sendall(HEADER.pack(0, HELLO_REP.size) + HELLO_REP.pack(1, 0, 0, 0, 0, 7))
            if self.read:
                threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    def _drain(self, conn: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                if not conn.recv(65536):
                    return
            except socket.timeout:
                continue
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        for c in self.conns:
            c.close()
        self.listener.close()


def _call_in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []

    def run():
        t0 = time.monotonic()
        try:
            fn()
            out.append(("ok", time.monotonic() - t0))
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion
            out.append((exc, time.monotonic() - t0))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_rpc_timeout_flag_and_variables(monkeypatch, env_settings):
    """--rpc-timeout (or PYLLAMA_ARG_RPC_TIMEOUT) wins over PYLLAMA_RPC_TIMEOUT, which wins over 120 s."""
    from pyllama.util.errors import PyllamaError
    from pyllama.server.__main__ import build_parser, check_args

    assert build_parser().parse_args(["--rpc-timeout", "2.5"]).rpc_timeout == 2.5
    monkeypatch.setenv("PYLLAMA_ARG_RPC_TIMEOUT", "7")
    assert build_parser().parse_args([]).rpc_timeout == 7.0
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(PyllamaError, match="--rpc-timeout"):
            check_args(build_parser().parse_args(["--rpc-timeout", bad]))
    try:
        env_settings(PYLLAMA_RPC_TIMEOUT=None)
        assert rpc_connection.configured_timeout() == 120
        env_settings(PYLLAMA_RPC_TIMEOUT="3")
        assert rpc_connection.configured_timeout() == 3
        rpc_connection.set_timeout(2.5)
        assert rpc_connection.configured_timeout() == 2.5
        rpc_connection.set_timeout(None)
        with pytest.raises(PyllamaError, match="PYLLAMA_RPC_TIMEOUT='soon': expected a positive number"):
            env_settings(PYLLAMA_RPC_TIMEOUT="soon")
    finally:
        rpc_connection.set_timeout(None)


def test_send_to_a_peer_that_stops_reading_times_out():
    peer = SilentPeer(read=False)
    try:
        conn = Connection(peer.endpoint, timeout=1.0)
        t0 = time.monotonic()
        with pytest.raises(RPCError, match=peer.endpoint):
            conn.send(Cmd.SET_TENSOR, [bytes(64 << 20)])  # far more than the socket buffers hold
        assert time.monotonic() - t0 < 5
        assert conn.broken and "send" in conn.broken
    finally:
        peer.close()


def test_every_waiter_wakes_when_the_reply_never_comes():
    """The thread whose turn it is times out; the one queued behind it wakes with the same error."""
    peer = SilentPeer(read=True)
    try:
        conn = Connection(peer.endpoint, timeout=1.0)
        first, got1 = _call_in_thread(lambda: conn.call(Cmd.SYNCHRONIZE, U32.pack(0)))
        time.sleep(0.1)
        second, got2 = _call_in_thread(lambda: conn.call(Cmd.DEVICE_COUNT))
        first.join(5)
        second.join(5)
        for got in (got1, got2):
            assert got and isinstance(got[0][0], RPCError) and got[0][1] < 4, got
            assert peer.endpoint in str(got[0][0])
    finally:
        peer.close()


def test_close_wakes_a_thread_blocked_on_a_reply():
    """Closing a connection (as shutdown does) must not leave a thread waiting for its timeout."""
    peer = SilentPeer(read=True)
    try:
        conn = Connection(peer.endpoint, timeout=30.0)
        waiter, got = _call_in_thread(lambda: conn.call(Cmd.SYNCHRONIZE, U32.pack(0)))
        time.sleep(0.3)
        conn.close()
        waiter.join(3)
        assert got and isinstance(got[0][0], RPCError) and got[0][1] < 3, got
    finally:
        peer.close()


def test_a_stalled_handshake_does_not_hold_the_connection_registry(monkeypatch, env_settings):
    """Opening a connection to a peer that accepts but never answers must not block every other
    user of the process-wide registry (close_all at shutdown, connections to other peers)."""
    env_settings(PYLLAMA_RPC_TIMEOUT="2")
    peer = SilentPeer(read=True, answer_hello=False)
    try:
        opener, got = _call_in_thread(lambda: rpc_connection.get_connection(peer.endpoint))
        time.sleep(0.3)
        t0 = time.monotonic()
        rpc_connection.close_all()
        assert time.monotonic() - t0 < 1.0
        opener.join(10)
        assert got and isinstance(got[0][0], RPCError)
    finally:
        peer.close()
        rpc_connection.close_all()


# --- the engine re-creates what it had on a restarted peer ------------------------------------------
def wait_cached(cache: str) -> None:
    """Until the peer's weight cache holds a file (it is written in the background after the upload)."""
    assert wait_for(lambda: os.path.isdir(cache) and any(not f.startswith(".") for f in os.listdir(cache)), 20)


def test_engine_restores_a_restarted_peer_through_its_weight_cache(cached_model, tmp_path):
    cache = str(tmp_path / "cache")
    peer = RPCServerProcess("--cache", cache)
    port = peer.port
    engine = None
    try:
        backend = RPCBackend(rpc_connection.get_connection(peer.endpoint), 0, "RPC0")
        engine = Engine(cached_model, n_threads=1, backends=[backend, CPUBackend(1)], tensor_split=[1, 1])
        prompt = engine.tokenizer.encode(PROMPT)
        contexts = [engine.new_context(256, 1), engine.new_context(256, 1)]
        want = [greedy_decode(ctx, prompt, 8) for ctx in contexts]
        assert want[0] == want[1]
        assert engine.lost_devices() == {}
        wait_cached(cache)
        peer.stop(signal.SIGKILL)
        contexts[0].clear()
        with pytest.raises(RPCError):
            greedy_decode(contexts[0], prompt, 2)
        lost = engine.lost_devices()
        assert list(lost) == ["RPC0"] and f"127.0.0.1:{port}" in lost["RPC0"]
        with pytest.raises(RPCError):
            engine.reach_lost_devices()  # nobody listens yet
        peer = RPCServerProcess("--cache", cache, "--port", str(port))
        engine.reach_lost_devices()
        stats.reset()  # the counts are kept whether or not they are printed
        assert engine.restore_lost_devices() == ["RPC0"]
        counts, _ = stats.snapshot()
        assert engine.lost_devices() == {}
        # the embedding came back from the peer's cache, not over the wire again
        assert counts.get("SET_TENSOR_HASH", (0,))[0] >= 1
        assert counts.get("SET_TENSOR", (0, 0))[1] < 4 << 20, counts
        # every context's KV cache was lost with the peer: the sequences start again, same text
        assert all(ctx.kv.n_tokens_cached() == 0 for ctx in contexts)
        for ctx in contexts:
            assert greedy_decode(ctx, prompt, 8) == want[0]
    finally:
        if engine is not None:
            engine.close()
        rpc_connection.close_all()
        peer.stop()


class _FailingAlloc(CPUBackend):
    """A device whose allocations fail on demand, as they do on a peer that was just lost."""
    fail = False

    def alloc_buffer(self, size: int, usage: str = "compute"):
        if self.fail:
            raise RPCError("RPC peer 127.0.0.1:9 is gone (test)")
        return super().alloc_buffer(size, usage)


def test_a_failed_compute_buffer_growth_leaves_no_plan_on_the_freed_buffer(tiny_model):
    """Growing a compute buffer frees the old one first; if the new allocation fails (the peer
    went away), no plan may keep running on the freed buffer once the device is usable again."""
    backend = _FailingAlloc(1)
    engine = Engine(tiny_model, n_threads=1, backends=[backend])
    ctx = engine.new_context(256, 1)
    batch = Batch.for_sequence(engine.tokenizer.encode(PROMPT), 0, 0)
    want = ctx.decode(batch).logits.copy()
    old = ctx.sched.buffers[0]
    backend.fail = True
    with pytest.raises(RPCError):
        ctx.sched._ensure_buffers([old.size * 2])  # what planning a larger graph does
    backend.fail = False
    ctx.clear()
    np.testing.assert_array_equal(ctx.decode(batch).logits, want)
    assert ctx.sched.buffers[0] is not old
    engine.close()


def test_reconnecting_fails_what_ran_and_forgets_cached_prompts(tiny_model):
    """With every group stopped, the reconnect fails the requests still running (their KV cache is
    gone: never resumed on an empty one), makes every slot forget its cached prompt (a new request
    must not reuse a prefix whose KV was lost), restores, and clears the fault."""
    import queue

    from pyllama.batching.sampling import SamplingParams
    from pyllama.batching.group import PipelineGroup
    from pyllama.obs.metrics import Metrics
    from pyllama.server.reconnect import PeerReconnector
    from pyllama.batching.slot import Slot, SlotState
    from pyllama.batching.task import CompletionTask, ErrorEvent, FinalEvent

    class NowLoop:  # delivers events at once, on the calling thread
        def call_soon_threadsafe(self, fn, *args):
            fn(*args)

    class PeerBack:  # an engine whose lost peer answers again
        restored = 0

        def lost_devices(self):
            return {"RPC0": "RPC peer 127.0.0.1:9 is gone (test)"}

        def reach_lost_devices(self):
            pass

        def restore_lost_devices(self):
            self.restored += 1
            return ["RPC0"]

    engine = Engine(tiny_model, n_threads=1)
    ctx = engine.new_context(512, 2)
    slots = [Slot(i, 0, i, ctx.seq_cap, engine.tokenizer) for i in range(2)]
    group = PipelineGroup(0, ctx, slots, engine.tokenizer, Metrics(), on_free=lambda s: None)
    events: queue.SimpleQueue = queue.SimpleQueue()
    prompt = engine.tokenizer.encode(PROMPT)
    greedy = SamplingParams(temperature=0)
    done = CompletionTask(prompt=prompt, params=greedy, n_predict=1, queue=events, loop=NowLoop())
    running = CompletionTask(prompt=prompt[:3], params=greedy, n_predict=50, queue=events, loop=NowLoop())
    group.submit([(slots[0], done), (slots[1], running)])
    for _ in range(3):
        group._iteration()
        group.sink.flush()
    assert slots[0].state is SlotState.IDLE and slots[0].cache_tokens  # finished, prompt kept for reuse
    assert slots[1].state is SlotState.GENERATING
    group.fault = "RPC peer 127.0.0.1:9 is gone (test)"
    fake = PeerBack()
    PeerReconnector(fake, [group])._reconnect(fake.lost_devices())  # type: ignore[arg-type]
    got = []
    while not events.empty():
        got.append(events.get())
    assert isinstance(got[-1][1], ErrorEvent) and "127.0.0.1:9" in got[-1][1].message
    assert any(isinstance(ev, FinalEvent) for _, ev in got)  # the finished request was not touched
    assert all(s.state is SlotState.IDLE and s.cache_tokens == [] for s in slots)
    assert group.fault is None and fake.restored == 1
    assert not group.lock.locked()
    engine.close()


# --- the server -----------------------------------------------------------------------------------------
class Leaks:
    """Threads and open files of the server process, against a baseline taken when it was warm."""

    def __init__(self, srv: ServerProcess):
        self.proc = psutil.Process(srv.proc.pid)
        self.threads = self.proc.num_threads()
        self.fds = self.proc.num_fds()

    def check(self) -> None:
        # a few executor threads and sockets may come and go; a leak per fault grows past this
        assert wait_for(lambda: self.proc.num_threads() <= self.threads + 3 and self.proc.num_fds() <= self.fds + 8,
                        5), (self.proc.num_threads(), self.threads, self.proc.num_fds(), self.fds)
        assert self.proc.children(recursive=True) == []


def greedy_text(srv: ServerProcess, n: int = 16) -> str:
    status, res = srv.post("/completion", {"prompt": PROMPT, "n_predict": n, "temperature": 0}, timeout=60)
    assert status == 200, res
    return res["content"]


def start_streams(srv: ServerProcess, n: int, n_predict: int = 1500) -> list[tuple[threading.Thread, list]]:
    """n long streaming requests; each thread collects its events (or the exception it met)."""
    out = []
    for i in range(n):
        events: list = []

        def run(events=events, i=i):
            try:
                events.extend(srv.stream("/completion", {"prompt": f"{PROMPT} {i}", "n_predict": n_predict,
                                                         "ignore_eos": True}, timeout=60))
            except Exception as exc:  # noqa: BLE001 - kept for the assertion
                events.append(exc)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        out.append((t, events))
    return out


def wait_generating(srv: ServerProcess, n: int) -> None:
    """Until n slots are busy (the requests are mid-generation)."""
    def busy():
        status, slots = srv.request("GET", "/slots")
        return status == 200 and sum(1 for s in slots if s["is_processing"]) >= n
    assert wait_for(busy, 20), "the requests did not start"
    time.sleep(0.2)


def assert_streams_failed(streams, within: float) -> None:
    t0 = time.monotonic()
    for t, _ in streams:
        t.join(max(0.0, within - (time.monotonic() - t0)))
    assert all(not t.is_alive() for t, _ in streams), "a request hangs"
    for _, events in streams:
        assert events and isinstance(events[-1], dict) and "error" in events[-1], events[-2:]
        assert events[-1]["error"]["message"]


def stop(srv: ServerProcess, timeout: float = 30) -> int:
    """Stops the server once (a second stop would read its closed pipes)."""
    if not hasattr(srv, "stderr_text"):
        srv.stop(timeout=timeout)
    return srv.proc.returncode


def health(srv: ServerProcess) -> tuple[int, dict]:
    return srv.request("GET", "/health", timeout=10)


def assert_fault_reported(srv: ServerProcess, endpoint: str) -> dict:
    status, body = health(srv)
    assert status == 500 and body["status"] == "error" and endpoint in body["error"], body
    assert any(endpoint in why for why in body["lost_devices"].values()), body
    # new requests fail at once while the peer is away
    t0 = time.monotonic()
    status, res = srv.post("/completion", {"prompt": PROMPT, "n_predict": 4}, timeout=30)
    assert status == 503 and endpoint in res["error"]["message"] and time.monotonic() - t0 < 5, res
    return body


def assert_recovers(srv: ServerProcess, want: str, within: float = 20) -> None:
    assert wait_for(lambda: health(srv)[0] == 200, within), health(srv)
    assert greedy_text(srv) == want


@pytest.mark.parametrize("groups", [1, 2])
def test_peer_killed_mid_step_then_restarted(cached_model, tmp_path, groups):
    cache = str(tmp_path / "cache")
    peer = RPCServerProcess("--cache", cache)
    port = peer.port
    srv = ServerProcess(cached_model, "--rpc", peer.endpoint, "--device", "RPC0,CPU", "-np", "2",
                        "--pipeline-groups", str(groups), "-c", "4096").wait_ready()
    try:
        want = greedy_text(srv)
        leaks = Leaks(srv)
        wait_cached(cache)
        streams = start_streams(srv, 2)
        wait_generating(srv, 2)
        peer.stop(signal.SIGKILL)
        assert_streams_failed(streams, within=10)
        assert_fault_reported(srv, peer.endpoint)
        peer = RPCServerProcess("--cache", cache, "--port", str(port))
        assert_recovers(srv, want)
        leaks.check()
        # and once more, killed while idle: /health notices without a request
        peer.stop(signal.SIGKILL)
        assert wait_for(lambda: health(srv)[0] == 500, 10), health(srv)
        peer = RPCServerProcess("--cache", cache, "--port", str(port))
        assert_recovers(srv, want)
        leaks.check()
        peer.stop(signal.SIGKILL)  # a server whose peer is dead still stops promptly
        t0 = time.monotonic()
        assert stop(srv, timeout=20) == 0 and time.monotonic() - t0 < 10
    finally:
        stop(srv)
        peer.stop()


def test_half_open_peer_fails_within_the_rpc_timeout_then_recovers(tiny_model):
    peer = RPCServerProcess()
    srv = ServerProcess(tiny_model, "--rpc", peer.endpoint, "--device", "RPC0,CPU", "-np", "2",
                        "--pipeline-groups", "2", "-c", "4096", "--rpc-timeout", "2").wait_ready()
    try:
        want = greedy_text(srv)
        leaks = Leaks(srv)
        streams = start_streams(srv, 2)
        wait_generating(srv, 2)
        peer.proc.send_signal(signal.SIGSTOP)
        try:
            assert_streams_failed(streams, within=2 + 6)
            assert_fault_reported(srv, peer.endpoint)
        finally:
            peer.proc.send_signal(signal.SIGCONT)
        assert_recovers(srv, want)
        leaks.check()
    finally:
        stop(srv)
        peer.stop()


def test_shutdown_with_a_stalled_peer_is_bounded(tiny_model):
    """The default RPC timeout (120 s) is in force: shutdown must not wait for it."""
    peer = RPCServerProcess()
    srv = ServerProcess(tiny_model, "--rpc", peer.endpoint, "--device", "RPC0,CPU", "-np", "2",
                        "--pipeline-groups", "2", "-c", "4096").wait_ready()
    try:
        streams = start_streams(srv, 2)
        wait_generating(srv, 2)
        peer.proc.send_signal(signal.SIGSTOP)
        time.sleep(0.3)
        t0 = time.monotonic()
        code = stop(srv, timeout=30)
        took = time.monotonic() - t0
        assert code == 0 and took < 15, (code, took, srv.stderr_text[-2000:])
        for t, _ in streams:  # the clients were answered or disconnected, none hangs
            t.join(5)
            assert not t.is_alive()
    finally:
        stop(srv)
        peer.proc.send_signal(signal.SIGCONT)
        peer.stop()


def test_slow_and_lossy_link(tiny_model):
    peer = RPCServerProcess()
    proxy = FaultProxy(peer.endpoint)
    srv = ServerProcess(tiny_model, "--rpc", proxy.endpoint, "--device", "RPC0,CPU", "-np", "2",
                        "--pipeline-groups", "2", "-c", "4096", "--rpc-timeout", "2").wait_ready()
    try:
        want = greedy_text(srv)
        leaks = Leaks(srv)
        # slow: every chunk each way waits 2 ms; the output does not change
        proxy.delay = 0.002
        assert greedy_text(srv) == want
        proxy.delay = 0.0
        # stalled beyond the timeout: the requests fail; forwarding resumes, the server reconnects
        streams = start_streams(srv, 2)
        wait_generating(srv, 2)
        proxy.stall()
        try:
            assert_streams_failed(streams, within=2 + 6)
            assert_fault_reported(srv, proxy.endpoint)
        finally:
            proxy.resume()
        assert_recovers(srv, want)
        leaks.check()
        # a reply cut in the middle of its frame
        streams = start_streams(srv, 2)
        wait_generating(srv, 2)
        proxy.cut_mid_frame()
        assert_streams_failed(streams, within=6)
        assert proxy.n_cut == 1
        assert_recovers(srv, want)
        leaks.check()
        # the link dropped while idle: noticed without a request, connected again
        before = proxy.n_accepted
        proxy.drop()
        assert wait_for(lambda: proxy.n_accepted > before, 10)
        assert_recovers(srv, want)
        leaks.check()
        # live through the proxy: the session and one lane per group; every failed one was closed
        assert wait_for(lambda: proxy.n_open == 1 + 2, 5), proxy.n_open
    finally:
        stop(srv)
        proxy.close()
        peer.stop()


def test_generate_takes_rpc_timeout(tiny_model):
    """`generate --rpc-timeout` bounds the wait on a peer that accepts and never answers."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    peer = SilentPeer(read=True, answer_hello=False)
    try:
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pyllama.generate", "-m", tiny_model, "-p", "hi", "-n", "2",
                               "--rpc", peer.endpoint, "--device", "RPC0,CPU", "--rpc-timeout", "1"],
                              capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert proc.returncode == 1, proc.stderr
        assert time.monotonic() - t0 < 20
        assert peer.endpoint in proc.stderr and proc.stderr.count("\n") <= 2, proc.stderr
    finally:
        peer.close()
