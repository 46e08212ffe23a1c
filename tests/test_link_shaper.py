"""bench/link_shaper.py: the relay's bytes, its delay and rate (lower bounds only), how closing
propagates, and that close() leaves no thread behind."""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest

import link_shaper as ls

TIMEOUT = 30.0


class _Server:
    """A loopback TCP server running `handler(sock)` on a thread per connection; close() ends it."""

    def __init__(self, handler) -> None:
        self.handler = handler
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self.accepted = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.listener.accept()
            except OSError:
                return
            c.settimeout(TIMEOUT)
            self.conns.append(c)
            self.accepted.set()
            t = threading.Thread(target=self._serve, args=(c,), daemon=True)
            self.threads.append(t)
            t.start()

    def _serve(self, c: socket.socket) -> None:
        try:
            self.handler(c)
        except OSError:
            pass
        finally:
            c.close()

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        self._acceptor.join(TIMEOUT)
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self.threads:
            t.join(TIMEOUT)


def _echo(c: socket.socket) -> None:
    while True:
        data = c.recv(1 << 16)
        if not data:
            return
        c.sendall(data)


@pytest.fixture
def echo():
    srv = _Server(_echo)
    yield srv
    srv.close()


def _connect(shaper: ls.LinkShaper) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", shaper.port), timeout=TIMEOUT)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = s.recv(min(1 << 16, n - got))
        if not chunk:
            raise AssertionError(f"connection closed after {got} of {n} bytes")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _relay_threads(shaper: ls.LinkShaper) -> list[threading.Thread]:
    """The threads that relay the shaper's connections (its accepting thread aside)."""
    return [t for t in threading.enumerate() if t.name.startswith(f"link-{shaper.port}-")
            and t.name != f"link-{shaper.port}-accept" and t.is_alive()]


def test_parse_rate_link_and_names():
    assert ls.parse_rate("10gbit") == 1e10 and ls.parse_rate("1gbit") == 1e9
    assert ls.parse_rate("500mbit") == 5e8 and ls.parse_rate("8Mbit") == 8e6
    assert ls.parse_rate("1mbps") == 8e6 and ls.parse_rate("1000") == 1000.0
    assert ls.parse_rate("none") is None and ls.parse_rate("") is None
    for bad in ("fast", "0gbit", "1 gigabit", "-1mbit"):
        with pytest.raises(ValueError):
            ls.parse_rate(bad)
    assert ls.parse_link("2/1gbit") == (2.0, 1e9)
    assert ls.parse_link("0.5/10gbit") == (0.5, 1e10)
    assert ls.parse_link("0/none") == (0.0, None) and ls.parse_link("3") == (3.0, None)
    for bad in ("x/1gbit", "-1/1gbit", "2/fast", "nan/none"):
        with pytest.raises(ValueError):
            ls.parse_link(bad)
    assert ls.format_rate(1e9) == "1gbit" and ls.format_rate(5e8) == "500mbit" and ls.format_rate(None) == "none"
    assert ls.format_rate(1.5e10) == "15gbit" and ls.format_rate(2.5e6) == "2.5mbit"
    assert ls.link_name(2, 1e9) == "2ms/1gbit" and ls.link_name(0.5, None) == "0.5ms/none"
    assert ls.parse_rate(ls.format_rate(2.5e6)) == 2.5e6


@pytest.mark.parametrize("delay_ms,rate", [(0.0, None), (1.0, None), (0.5, 1e9)])
def test_bytes_arrive_intact_and_in_order_on_concurrent_connections(echo, delay_ms, rate):
    size, n_conn = 3 << 20, 4
    payloads = [os.urandom(size) for _ in range(n_conn)]
    results: list = [None] * n_conn

    def one(i: int) -> None:
        with _connect(shaper) as s:
            # write in odd-sized pieces on one thread while reading on another: both directions at once
            def send() -> None:
                data, pos = payloads[i], 0
                while pos < len(data):
                    step = 1 + (pos * 7919) % 70000
                    s.sendall(data[pos:pos + step])
                    pos += step
            sender = threading.Thread(target=send)
            sender.start()
            results[i] = _recv_exactly(s, size)
            sender.join(TIMEOUT)

    with ls.LinkShaper("127.0.0.1", echo.port, delay_ms, rate) as shaper:
        workers = [threading.Thread(target=one, args=(i,)) for i in range(n_conn)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(2 * TIMEOUT)
        assert not any(w.is_alive() for w in workers)
    for got, want in zip(results, payloads):
        assert got is not None and len(got) == len(want) and got == want


def test_a_delay_holds_each_direction_back(echo):
    with ls.LinkShaper("127.0.0.1", echo.port, delay_ms=20) as shaper, _connect(shaper) as s:
        for _ in range(3):
            t0 = time.monotonic()
            s.sendall(b"ping")
            assert _recv_exactly(s, 4) == b"ping"
            assert time.monotonic() - t0 >= 0.040   # 20 ms there, 20 ms back: a floor, no ceiling


def test_a_rate_cap_paces_a_transfer():
    size = 1_000_000
    got = []

    def sink(c: socket.socket) -> None:   # counts what arrives, acknowledges once it has it all
        n = 0
        while n < size:
            chunk = c.recv(1 << 16)
            if not chunk:
                return
            n += len(chunk)
        got.append(n)
        c.sendall(b"k")

    srv = _Server(sink)
    try:
        with ls.LinkShaper("127.0.0.1", srv.port, rate_bit_s=8e6) as shaper, _connect(shaper) as s:
            t0 = time.monotonic()
            s.sendall(os.urandom(size))
            assert s.recv(1) == b"k"
            elapsed = time.monotonic() - t0
        assert got == [size]
        assert elapsed >= 0.9   # 8 Mbit at 8 Mbit/s: a floor, no ceiling
    finally:
        srv.close()


@pytest.mark.parametrize("delay_ms", [0.0, 5.0])
def test_the_target_closing_closes_the_client(delay_ms):
    def hang_up(c: socket.socket) -> None:
        c.recv(16)
        c.sendall(b"bye")
        # returning closes the socket, as a server that dies does

    srv = _Server(hang_up)
    try:
        with ls.LinkShaper("127.0.0.1", srv.port, delay_ms) as shaper, _connect(shaper) as s:
            s.sendall(b"hello")
            assert _recv_exactly(s, 3) == b"bye"          # the data before the end arrives first
            assert s.recv(16) == b""                       # then the end of the stream
            s.close()
            deadline = time.monotonic() + TIMEOUT
            while (shaper.connections or _relay_threads(shaper)) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert shaper.connections == 0 and not _relay_threads(shaper)
    finally:
        srv.close()


def test_the_client_closing_closes_the_target():
    ended = threading.Event()

    def wait_for_end(c: socket.socket) -> None:
        if c.recv(16) == b"":
            ended.set()

    srv = _Server(wait_for_end)
    try:
        with ls.LinkShaper("127.0.0.1", srv.port, delay_ms=2) as shaper:
            s = _connect(shaper)
            assert srv.accepted.wait(TIMEOUT)
            s.close()
            assert ended.wait(TIMEOUT)
    finally:
        srv.close()


def test_no_target_closes_the_client_connection():
    port = socket.create_server(("127.0.0.1", 0))
    dead = port.getsockname()[1]
    port.close()
    with ls.LinkShaper("127.0.0.1", dead) as shaper, _connect(shaper) as s:
        try:
            assert s.recv(16) == b""
        except ConnectionResetError:
            pass


def test_close_ends_every_connection_and_thread(echo):
    shaper = ls.LinkShaper("127.0.0.1", echo.port, delay_ms=5, rate_bit_s=1e8)
    direct = ls.LinkShaper("127.0.0.1", echo.port)
    clients = [_connect(sh) for sh in (shaper, shaper, direct, direct)]
    try:
        for c in clients:
            c.sendall(b"x" * 100_000)                      # bytes in flight or queued
        deadline = time.monotonic() + TIMEOUT
        while (shaper.connections < 2 or direct.connections < 2) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert shaper.connections == 2 and direct.connections == 2 and _relay_threads(shaper)
        shaper.close()
        direct.close()
        assert not _relay_threads(shaper) and not _relay_threads(direct)
        assert not [t for t in threading.enumerate() if t.name in (f"link-{shaper.port}-accept",
                                                                   f"link-{direct.port}-accept")]
        for c in clients:   # the relay's end went away: the client reads to the end of the stream
            while True:
                try:
                    if not c.recv(1 << 16):
                        break
                except ConnectionResetError:
                    break
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", shaper.port), timeout=2).close()
        shaper.close()   # twice: nothing more to do
    finally:
        for c in clients:
            c.close()


def test_the_cli_in_a_process_of_its_own(echo):
    proc = ls.LinkShaperProcess(f"127.0.0.1:{echo.port}", delay_ms=1, rate_bit_s=1e9)
    try:
        host, _, port = proc.endpoint.rpartition(":")
        assert host == "127.0.0.1"
        with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
            s.sendall(b"through another process")
            assert _recv_exactly(s, 23) == b"through another process"
    finally:
        assert proc.stop() == 0


def test_the_overhead_measurement_runs():
    r = ls.measure_overhead(40, size=32, blocks=2)
    assert r["round_trips"] == 40 and r["size"] == 32 and r["rate"] == "none"
    assert r["direct_us"]["median"] > 0 and r["relay_us"]["median"] > 0
    assert r["relay_cpu_us_per_message"] is None or r["relay_cpu_us_per_message"] >= 0
