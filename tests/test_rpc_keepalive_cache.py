"""TCP keepalive on RPC sockets, and the weight cache's temporary files.

A half-open peer (its machine gone without a FIN or RST) cannot be made on loopback: the kernel
answers for both ends. So the keepalive tests check what makes the kernel notice one: the socket
options on both ends, timed from the RPC timeout."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from pyllama.rpc.connection import Connection
from pyllama.rpc.keepalive import enable_keepalive, keepalive_params
from pyllama.rpc_server.cache import TMP_PREFIX, TensorCache, remove_stale_temporaries
from pyllama.rpc_server.server import ServerThread

linux_only = pytest.mark.skipif(not hasattr(socket, "TCP_KEEPIDLE"), reason="Linux keepalive options")


def test_keepalive_timings_follow_the_timeout():
    for timeout in (1.0, 5.0, 30.0, 120.0, 600.0):
        idle, interval, count = keepalive_params(timeout)
        assert idle >= 1 and interval >= 1 and count >= 1
        # a dead idle peer is declared dead after idle + count * interval: about the timeout
        assert timeout * 0.5 <= idle + count * interval <= max(timeout, 1 + 3 * 1) + 1, (timeout, idle, interval)


@linux_only
def test_client_socket_has_keepalive_from_the_rpc_timeout():
    with ServerThread() as st:
        conn = Connection(f"127.0.0.1:{st.port}", timeout=30.0)
        try:
            s = conn.sock
            idle, interval, count = keepalive_params(30.0)
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == idle
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == interval
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == count
            if hasattr(socket, "TCP_USER_TIMEOUT"):
                assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 30000
        finally:
            conn.close()


@linux_only
def test_server_side_sockets_have_keepalive():
    accepted = []
    with ServerThread() as st:
        conn = Connection(f"127.0.0.1:{st.port}", timeout=30.0)
        try:
            def sockets():
                for c in st.server._conns:
                    sock = c.transport.get_extra_info("socket")
                    accepted.append((sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                                     sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)))
            st.call(sockets)
        finally:
            conn.close()
    assert accepted and all(on == 1 for on, _ in accepted), accepted
    assert all(idle == keepalive_params(120.0)[0] for _, idle in accepted), accepted


def test_enable_keepalive_reports_what_it_set():
    with socket.socket() as s:
        done = enable_keepalive(s, 10.0, user_timeout=False)
        assert done["SO_KEEPALIVE"] == 1 and "TCP_USER_TIMEOUT" not in done
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1


# --- the cache's temporary files ----------------------------------------------------------------

def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_opening_the_cache_removes_temporaries_of_dead_writers(tmp_path):
    dead = tmp_path / f"{TMP_PREFIX}{_dead_pid()}-abc123"
    legacy = tmp_path / f"{TMP_PREFIX}k2j3h4"               # the old name, without a pid
    alive = tmp_path / f"{TMP_PREFIX}{os.getppid()}-zzz"    # a running process may still write it
    kept = tmp_path / ("ab" * 32)                           # a finished cache file
    for p in (dead, legacy, alive, kept):
        p.write_bytes(b"x" * 10)
    TensorCache(str(tmp_path))
    assert not dead.exists() and not legacy.exists()
    assert alive.exists() and kept.exists()
    assert remove_stale_temporaries(str(tmp_path)) == 0


def test_a_failed_write_removes_its_own_temporary(tmp_path, monkeypatch):
    cache = TensorCache(str(tmp_path))

    def broken(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError):
        cache._store(memoryview(b"y" * 100))
    assert [n for n in os.listdir(tmp_path) if n.startswith(TMP_PREFIX)] == []


def test_a_server_killed_during_a_cache_write_leaves_nothing_after_a_restart(tmp_path):
    """The case: a peer killed right after an upload leaves a `.tmp-*` file; the next
    start removes it. The kill is made certain by a writer that never finishes (a cache
    directory whose writes block is not portable), so the file is planted as the killed
    process's own."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        planted = tmp_path / f"{TMP_PREFIX}{victim.pid}-partial"
        planted.write_bytes(b"z" * 1000)
        TensorCache(str(tmp_path))
        assert planted.exists(), "removed a file whose writer still runs"
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    proc = subprocess.Popen([sys.executable, "-m", "pyllama.rpc_server", "--port", "0", "-t", "1", "--cache",
                             str(tmp_path)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 60
        lines = []
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "listening on" in line:
                break
        assert any("listening on" in ln for ln in lines), lines
        assert not planted.exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
