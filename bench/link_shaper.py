"""A TCP relay that gives a connection a one-way delay and a bandwidth cap, for benches.

    python bench/link_shaper.py --target HOST:PORT [--delay-ms 2] [--rate 1gbit] [--listen 127.0.0.1]
        [--port 0]
    python bench/link_shaper.py --overhead N [--size 64] [--delay-ms 0] [--rate none]

The first form listens on a free port (or --port), prints `listening on HOST:PORT` and relays every
connection it accepts to the target until it is interrupted (SIGINT or SIGTERM). A bench puts one
between a server and each rpc server (`--link` of bench/pipeline_cells.py) where `tc netem` is not
available: tc tbf caps a rate (bench/pipeline_cells.py --netns) but cannot delay.

Each connection accepted gets one connection to the target, and each direction is relayed on its
own: bytes received at time t leave at t + delay (one-way), in order, after a serializer of
`rate` bits/s (None: no cap), the way a link of that rate and propagation delay carries them. Every
socket has TCP_NODELAY. A direction holds at most its queue limit (at least 4 MiB, twice the
link's bandwidth-delay product with a rate) before it stops reading, so TCP's flow control reaches
the sender. A peer that closes its side (or dies) closes the other: the end of the stream is
delivered after the data before it, and an error on either socket closes both. The TCP handshake
itself is not delayed.

Each direction is one thread. At delay 0 without a rate it writes what it reads. Otherwise it
waits in select() for bytes to read or for the time the oldest queued bytes are due, keeps a
deque of (due time, bytes), and sends what is due. A timed wait ends late (tens of microseconds,
more on a virtual machine): the thread learns by how much from its own waits, wakes that much
early (at most 200 us) and yields until the due time, so that bytes never leave early and
seldom late.

The second form measures what the relay costs: it starts an echo server and a relay to it (each
in a process of its own), then times round trips of --size bytes straight to the echo server and
through the relay, in alternating blocks, and prints the medians, the difference and the relay's
CPU time per message it relayed (Linux, from /proc at clock-tick resolution).

Importable: LinkShaper (in this process), LinkShaperProcess (the CLI in a process of its own, so
that a bench's load threads do not share its interpreter lock), parse_rate, format_rate, parse_link.
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import select
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

RECV_BYTES = 256 * 1024
MIN_QUEUE_BYTES = 4 << 20
UNCAPPED_QUEUE_BYTES = 64 << 20   # a delay without a rate cap: what a direction may hold
MAX_WAKE_EARLY = 200e-6   # the most a direction wakes before a due time (and then yields until it)
LISTENING = "listening on "

_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?")


def parse_rate(text: str) -> Optional[float]:
    """A rate as tc writes it, in bits/s: '10gbit' -> 1e10, '500mbit' -> 5e8, '1mbps' (bytes/s)
    -> 8e6, a bare number is bits/s; 'none' (or '') -> None, no cap."""
    t = text.strip().lower()
    if t in ("", "none", "unlimited"):
        return None
    m = _RATE.fullmatch(t)
    if not m:
        raise ValueError(f"rate '{text}': expected e.g. 10gbit, 500mbit, none")
    value = float(m.group(1)) * _UNITS[m.group(2)] * (8 if m.group(3) == "bps" else 1)
    if value <= 0:
        raise ValueError(f"rate '{text}': must be positive (none: no cap)")
    return value


def format_rate(bits: Optional[float]) -> str:
    """1e9 -> '1gbit', 5e8 -> '500mbit', None -> 'none' (parse_rate's inverse for such values)."""
    if bits is None:
        return "none"
    for unit in ("t", "g", "m", "k"):
        if bits >= _UNITS[unit]:
            return f"{bits / _UNITS[unit]:g}{unit}bit"
    return f"{bits:g}bit"


def parse_link(text: str) -> tuple[float, Optional[float]]:
    """'DELAY_MS/RATE' -> (delay_ms, rate_bit_s): '2/1gbit' -> (2.0, 1e9), '0/none' -> (0.0, None);
    a bare delay ('2') has no rate cap."""
    delay, _, rate = text.strip().partition("/")
    try:
        d = float(delay)
    except ValueError:
        raise ValueError(f"link '{text}': expected DELAY_MS/RATE, e.g. 2/1gbit or 0.5/none") from None
    if not d >= 0 or d == float("inf"):
        raise ValueError(f"link '{text}': the delay must be a finite number of ms, at least 0")
    return d, parse_rate(rate)


def link_name(delay_ms: float, rate_bit_s: Optional[float]) -> str:
    """(2.0, 1e9) -> '2ms/1gbit'; (0.5, None) -> '0.5ms/none'."""
    return f"{delay_ms:g}ms/{format_rate(rate_bit_s)}"


_PR_SET_TIMERSLACK = 29


def _fine_timers() -> None:
    """The calling thread's timed waits end within a nanosecond of their time instead of Linux's
    default 50 us slack (threads it starts later inherit this); nothing elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes  # noqa: PLC0415

        ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _nodelay(s: socket.socket) -> None:
    try:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass


def _shutdown(s: socket.socket, how: int) -> None:
    try:
        s.shutdown(how)
    except OSError:
        pass


class _Connection:
    """One accepted connection and its connection to the target: a thread per direction; the last
    of them to end closes both sockets."""

    def __init__(self, shaper: "LinkShaper", client: socket.socket, target: socket.socket) -> None:
        self.shaper = shaper
        self.client, self.target = client, target
        self._lock = threading.Lock()
        self._aborted = False
        self.shaped = not (shaper.delay_s == 0 and shaper.rate is None)
        # a shaped direction waits in select() on its socket and on this pipe, which abort() writes
        self._wake_r, self._wake_w = os.pipe() if self.shaped else (-1, -1)
        self.threads: list[threading.Thread] = []
        tag = f"link-{shaper.port}-{client.fileno()}"
        for src, dst, way in ((client, target, "up"), (target, client, "down")):
            run = _Direction(self, src, dst).run if self.shaped else functools.partial(self._copy, src, dst)
            self.threads.append(threading.Thread(target=run, name=f"{tag}-{way}", daemon=True))
        self._live = len(self.threads)

    def start(self) -> None:
        for t in self.threads:
            t.start()

    @property
    def aborted(self) -> bool:
        return self._aborted

    def abort(self) -> None:
        """Ends both directions now (queued bytes are dropped): both sockets shut down, which wakes
        a thread blocked on them, and the wake pipe written, which wakes one waiting for a due time."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"x")
                except OSError:
                    pass
        _shutdown(self.client, socket.SHUT_RDWR)
        _shutdown(self.target, socket.SHUT_RDWR)

    def thread_done(self) -> None:
        with self._lock:
            self._live -= 1
            last = self._live == 0
            if last and self._wake_w >= 0:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1
        if last:
            self.client.close()
            self.target.close()
            self.shaper._forget(self)

    def _copy(self, src: socket.socket, dst: socket.socket) -> None:
        """No delay, no cap: what is read is written at once."""
        try:
            while True:
                try:
                    data = src.recv(RECV_BYTES)
                except OSError:
                    self.abort()
                    return
                if not data:
                    _shutdown(dst, socket.SHUT_WR)
                    return
                try:
                    dst.sendall(data)
                except OSError:
                    self.abort()
                    return
        finally:
            self.thread_done()


class _Direction:
    """One direction of a shaped connection, on one thread: it waits in select() for bytes to read
    or for the time the oldest queued bytes are due, whichever comes first. What it reads is
    stamped with the time it is due at the far end (after the serializer, plus the delay) and
    queued; what is due is sent."""

    def __init__(self, conn: _Connection, src: socket.socket, dst: socket.socket) -> None:
        self.conn, self.src, self.dst = conn, src, dst
        self.delay = conn.shaper.delay_s
        self.rate_bytes = None if conn.shaper.rate is None else conn.shaper.rate / 8.0
        self.queue: collections.deque = collections.deque()   # (due, bytes), None: the end of the stream
        self.queued = 0
        self.limit = conn.shaper.queue_limit
        # at a low rate, read in pieces of about a millisecond of the link's time (at least 16 KiB)
        # so that the first bytes of a large write are not held back until its last ones serialize
        self.chunk = RECV_BYTES if self.rate_bytes is None else \
            int(min(RECV_BYTES, max(16 * 1024, self.rate_bytes * 1e-3)))
        self.serial_end = 0.0   # when the serializer has sent what it holds
        # how late a timed wait ends, learned from the ones that ran out: the thread wakes that much
        # before a due time and yields the rest, so that bytes leave neither early nor late
        self.wake_early = 50e-6

    def run(self) -> None:
        _fine_timers()
        src, wake = self.src.fileno(), self.conn._wake_r
        at_end = False   # the source's end of stream has been read
        try:
            while not self.conn.aborted:
                reading = not at_end and self.queued < self.limit
                timeout = None
                if self.queue:
                    t0 = time.monotonic()
                    timeout = max(0.0, self.queue[0][0] - t0 - self.wake_early)
                elif not reading:
                    return   # the end of the stream was delivered
                if timeout != 0.0:
                    ready, _, _ = select.select([src, wake] if reading else [wake], [], [], timeout)
                    if self.conn.aborted:
                        return
                    if not ready and timeout is not None:   # ran out: learn how late such a wait ends
                        late = min(2 * MAX_WAKE_EARLY, time.monotonic() - t0 - timeout)
                        self.wake_early = min(MAX_WAKE_EARLY, max(0.0, 0.9 * self.wake_early + 0.1 * late))
                    if src in ready:
                        at_end = not self._read()
                        if self.conn.aborted:
                            return
                if self.queue and not self._send_due():
                    return
        except (OSError, ValueError):   # ValueError: a descriptor past select()'s limit
            self.conn.abort()
        finally:
            self.conn.thread_done()

    def _read(self) -> bool:
        """Reads what is there and queues it; False at the end of the stream (queued as None)."""
        try:
            data = self.src.recv(self.chunk)
        except OSError:
            self.conn.abort()
            return False
        now = time.monotonic()
        if self.rate_bytes is not None:
            self.serial_end = max(now, self.serial_end) + len(data) / self.rate_bytes
            due = self.serial_end + self.delay
        else:
            due = now + self.delay
        self.queue.append((due, data or None))
        self.queued += len(data)
        return bool(data)

    def _send_due(self) -> bool:
        """Sends what is due (yielding until the oldest is, when it is within the wake-up margin);
        False once the end of the stream has been passed on."""
        due = self.queue[0][0]
        if due - time.monotonic() > self.wake_early:
            return True
        while time.monotonic() < due:   # the last stretch
            time.sleep(0)
        now = time.monotonic()
        batch: list[bytes] = []
        end = False
        while self.queue and self.queue[0][0] <= now:
            data = self.queue.popleft()[1]
            if data is None:
                end = True
                break
            batch.append(data)
            self.queued -= len(data)
        if batch:
            self.dst.sendall(batch[0] if len(batch) == 1 else b"".join(batch))
        if end:
            self.dst.shutdown(socket.SHUT_WR)
            return False
        return True


class LinkShaper:
    """Listens on listen_host (a free port, `.port`, `.endpoint`) and relays every connection to
    target_host:target_port with `delay_ms` one way and at most `rate_bit_s` (None: no cap) in
    each direction. `close()` (or leaving a `with` block) stops accepting and ends every
    connection and thread."""

    def __init__(self, target_host: str, target_port: int, delay_ms: float = 0.0,
                 rate_bit_s: Optional[float] = None, listen_host: str = "127.0.0.1", listen_port: int = 0,
                 connect_timeout: float = 10.0) -> None:
        if not delay_ms >= 0:
            raise ValueError(f"delay_ms {delay_ms}: must be at least 0")
        if rate_bit_s is not None and not rate_bit_s > 0:
            raise ValueError(f"rate_bit_s {rate_bit_s}: must be positive (None: no cap)")
        self.target = (target_host, int(target_port))
        self.delay_s = float(delay_ms) / 1e3
        self.rate = None if rate_bit_s is None else float(rate_bit_s)
        self.queue_limit = UNCAPPED_QUEUE_BYTES if self.rate is None else \
            max(MIN_QUEUE_BYTES, int(2 * self.rate / 8 * self.delay_s))
        self.connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._conns: set[_Connection] = set()
        self._closed = False
        self._listener = socket.create_server((listen_host, listen_port), backlog=128)
        self.host = listen_host
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"[{listen_host}]:{self.port}" if ":" in listen_host else f"{listen_host}:{self.port}"
        self._acceptor = threading.Thread(target=self._accept, name=f"link-{self.port}-accept", daemon=True)
        self._acceptor.start()

    def __enter__(self) -> "LinkShaper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def connections(self) -> int:
        """Connections being relayed now."""
        with self._lock:
            return len(self._conns)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # the listener was shut down by close()
            try:
                target = socket.create_connection(self.target, timeout=self.connect_timeout)
                target.settimeout(None)
            except OSError:
                client.close()
                continue
            _nodelay(client)
            _nodelay(target)
            conn = _Connection(self, client, target)
            with self._lock:
                if self._closed:
                    client.close()
                    target.close()
                    return
                self._conns.add(conn)
            conn.start()

    def _forget(self, conn: _Connection) -> None:
        with self._lock:
            self._conns.discard(conn)

    def close(self, timeout: float = 10.0) -> None:
        """Stops accepting, ends every connection (queued bytes are dropped) and waits for every
        thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        _shutdown(self._listener, socket.SHUT_RDWR)   # wakes accept()
        self._listener.close()
        self._acceptor.join(timeout)
        for c in conns:
            c.abort()
        deadline = time.monotonic() + timeout
        for c in conns:
            for t in c.threads:
                t.join(max(0.0, deadline - time.monotonic()))


class LinkShaperProcess:
    """This file's CLI in a process of its own (`python bench/link_shaper.py --target ...`), so that
    its threads do not share an interpreter lock with the bench's; `.endpoint`, `.pid`, `stop()`.
    `wrap` goes before the command (e.g. `chrt -f 41`: it execs the relay, so `.pid` is the relay's)."""

    def __init__(self, target: str, delay_ms: float = 0.0, rate_bit_s: Optional[float] = None,
                 listen_host: str = "127.0.0.1", timeout: float = 30.0, wrap: Sequence[str] = ()) -> None:
        cmd = [*wrap, sys.executable, __file__, "--target", target, "--delay-ms", repr(float(delay_ms)),
               "--rate", "none" if rate_bit_s is None else f"{rate_bit_s:.0f}bit", "--listen", listen_host]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.pid = self.proc.pid
        self.target, self.delay_ms, self.rate_bit_s = target, delay_ms, rate_bit_s
        got: list[str] = []

        def first_line() -> None:
            got.append(self.proc.stdout.readline())

        reader = threading.Thread(target=first_line, daemon=True)
        reader.start()
        reader.join(timeout)
        line = got[0].strip() if got else ""
        if not line.startswith(LISTENING):
            self.stop()
            rest = self.proc.stdout.read() if self.proc.stdout else ""
            raise RuntimeError(f"link_shaper did not start: {line} {rest}".strip())
        self.endpoint = line[len(LISTENING):].split()[0]
        self._drain = threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True)
        self._drain.start()

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


# --- the overhead measurement -----------------------------------------------------------------

def _echo_server(host: str = "127.0.0.1") -> None:
    """Echoes every connection (a thread each) until interrupted; prints its endpoint first."""
    srv = socket.create_server((host, 0))

    def serve(c: socket.socket) -> None:
        _nodelay(c)
        with c:
            while True:
                try:
                    data = c.recv(RECV_BYTES)
                    if not data:
                        return
                    c.sendall(data)
                except OSError:
                    return

    print(f"{LISTENING}{host}:{srv.getsockname()[1]}", flush=True)
    while True:
        c, _ = srv.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()


def _round_trips(endpoint: str, n: int, size: int) -> list[float]:
    host, _, port = endpoint.rpartition(":")
    payload = b"x" * size
    with socket.create_connection((host.strip("[]"), int(port))) as s:
        _nodelay(s)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            s.sendall(payload)
            got = 0
            while got < size:
                chunk = s.recv(RECV_BYTES)
                if not chunk:
                    raise RuntimeError("the echo server closed the connection")
                got += len(chunk)
            out.append(time.perf_counter() - t0)
        return out


def _cpu_s(pid: int) -> Optional[float]:
    """User + system CPU seconds of a process, its ended threads included (Linux; else None)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def measure_overhead(n: int, size: int = 64, delay_ms: float = 0.0, rate_bit_s: Optional[float] = None,
                     blocks: int = 10) -> dict:
    """Round trips of `size` bytes to an echo server, straight and through a relay (each in its own
    process), `n` of each in `blocks` alternating blocks; medians and p90 in microseconds, and the
    relay's CPU time per message it relayed (None where it cannot be read)."""
    echo = subprocess.Popen([sys.executable, __file__, "--echo"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, text=True)
    relay = None
    try:
        echo_ep = echo.stdout.readline().strip()[len(LISTENING):]
        relay = LinkShaperProcess(echo_ep, delay_ms, rate_bit_s)
        direct: list[float] = []
        shaped: list[float] = []
        per = max(1, n // blocks)
        _round_trips(echo_ep, 50, size)          # warm both paths
        _round_trips(relay.endpoint, 50, size)
        relay_cpu = 0.0
        for _ in range(blocks):
            direct += _round_trips(echo_ep, per, size)
            c0 = _cpu_s(relay.pid)
            shaped += _round_trips(relay.endpoint, per, size)
            c1 = _cpu_s(relay.pid)
            relay_cpu = None if c0 is None or c1 is None or relay_cpu is None else relay_cpu + c1 - c0
    finally:
        if relay is not None:
            relay.stop()
        echo.send_signal(signal.SIGTERM)
        echo.wait(10)

    def q(xs: list[float], p: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1e6

    return {"round_trips": len(direct), "size": size, "delay_ms": delay_ms, "rate": format_rate(rate_bit_s),
            "direct_us": {"median": q(direct, 0.5), "p90": q(direct, 0.9), "mean": statistics.fmean(direct) * 1e6},
            "relay_us": {"median": q(shaped, 0.5), "p90": q(shaped, 0.9), "mean": statistics.fmean(shaped) * 1e6},
            "added_us_median": q(shaped, 0.5) - q(direct, 0.5),
            "relay_cpu_us_per_message": None if relay_cpu is None else relay_cpu / (2 * len(shaped)) * 1e6}


# --- the CLI ----------------------------------------------------------------------------------

def _split_target(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"--target '{text}': expected HOST:PORT")
    return host.strip("[]"), int(port)


def _stop(signum, frame) -> None:
    raise SystemExit(0)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="link_shaper.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", metavar="HOST:PORT", help="where every accepted connection is relayed to")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay of each direction, ms")
    ap.add_argument("--rate", default="none", help="cap of each direction, tc units (10gbit, 500mbit, ...); none: no cap")
    ap.add_argument("--listen", default="127.0.0.1", help="address to listen on")
    ap.add_argument("--port", type=int, default=0, help="port to listen on (0: a free one)")
    ap.add_argument("--overhead", type=int, metavar="N",
                    help="measure: N round trips straight to an echo server and N through a relay")
    ap.add_argument("--size", type=int, default=64, help="--overhead: bytes per message")
    ap.add_argument("--echo", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _stop)
    if a.echo:
        try:
            _echo_server(a.listen)
        except SystemExit:
            return 0
    try:
        rate = parse_rate(a.rate)
        if not a.delay_ms >= 0:
            raise ValueError("--delay-ms must be at least 0")
        if a.overhead is not None:
            if a.overhead < 1 or a.size < 1:
                raise ValueError("--overhead and --size must be at least 1")
            r = measure_overhead(a.overhead, a.size, a.delay_ms, rate)
            d, s = r["direct_us"], r["relay_us"]
            print(f"{r['round_trips']} round trips of {r['size']} bytes each way, link {link_name(a.delay_ms, rate)}: "
                  f"direct median {d['median']:.1f} us (p90 {d['p90']:.1f}), through the relay median "
                  f"{s['median']:.1f} us (p90 {s['p90']:.1f}): +{r['added_us_median']:.1f} us per round trip"
                  + ("" if r["relay_cpu_us_per_message"] is None else
                     f"; the relay's CPU time {r['relay_cpu_us_per_message']:.1f} us per message"))
            return 0
        if not a.target:
            raise ValueError("--target HOST:PORT is required")
        host, port = _split_target(a.target)
    except ValueError as e:
        print(f"link_shaper: {e}", file=sys.stderr)
        return 2
    shaper = LinkShaper(host, port, a.delay_ms, rate, a.listen, a.port)
    try:
        print(f"{LISTENING}{shaper.endpoint} -> {a.target}, {link_name(a.delay_ms, rate)} each way", flush=True)
        while True:
            signal.pause()
    except SystemExit:
        pass
    finally:
        shaper.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
