"""Round-trip latency of `python -m pyllama.rpc_server` on loopback.

Starts the server as a subprocess on a free port, then times N calls of each command over one raw
socket: DEVICE_COUNT (answered on the event loop), SYNCHRONIZE (goes through the device's executor
thread) and a 4 KiB GET_TENSOR. Prints median / p90 / p99 in microseconds.

    python bench/rpc_latency.py [-n 1000] [--server-arg=...] [--server-cpus 1] [--client-cpus 0]

On a small VM the numbers are bimodal: a wake-up across cores costs far more than one on the same
core, so pin both ends (same core, then different cores) to see each case.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

from pyllama.rpc import protocol as P
from pyllama.rpc.protocol import Cmd


def cpus(spec: str | None) -> set[int] | None:
    return {int(c) for c in spec.split(",")} if spec else None


def start_server(extra: list[str], pin: set[int] | None = None) -> tuple[subprocess.Popen, int]:
    pre = (lambda: os.sched_setaffinity(0, pin)) if pin else None
    proc = subprocess.Popen([sys.executable, "-m", "pyllama.rpc_server", "--host", "127.0.0.1", "--port", "0",
                             "-t", "1", *extra], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            preexec_fn=pre)
    assert proc.stderr is not None
    while True:
        line = proc.stderr.readline()
        if not line:
            raise SystemExit(f"rpc_server exited with {proc.wait()}")
        if line.startswith("listening on"):
            return proc, int(line.rsplit(":", 1)[1])


class Raw:
    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.head = bytearray(P.HEADER.size)
        self.call(Cmd.HELLO, P.HELLO_REQ.pack(*P.VERSION, 0))

    def call(self, cmd: int, payload: bytes = b"") -> bytes:
        self.sock.sendall(P.HEADER.pack(int(cmd), len(payload)) + payload)
        view = memoryview(self.head)
        got = 0
        while got < len(view):
            got += self.sock.recv_into(view[got:])
        status, size = P.HEADER.unpack(self.head)
        data = bytearray(size)
        view, got = memoryview(data), 0
        while got < size:
            got += self.sock.recv_into(view[got:])
        if status != P.STATUS_OK:
            raise RuntimeError(f"{Cmd(cmd).name}: {bytes(data).decode(errors='replace')}")
        return bytes(data)


def timed(conn: Raw, cmd: int, payload: bytes, n: int) -> list[float]:
    for _ in range(min(100, n)):  # warm-up
        conn.call(cmd, payload)
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        conn.call(cmd, payload)
        out.append((time.perf_counter_ns() - t0) / 1000)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=1000, help="calls per command")
    ap.add_argument("--server-arg", action="append", default=[], help="extra argument for the server")
    ap.add_argument("--server-cpus", help="pin the server to these CPUs (e.g. 1 or 0,1)")
    ap.add_argument("--client-cpus", help="pin this client to these CPUs")
    args = ap.parse_args()
    proc, port = start_server(args.server_arg, cpus(args.server_cpus))
    if args.client_cpus:
        os.sched_setaffinity(0, cpus(args.client_cpus))
    try:
        conn = Raw(port)
        bid = P.ALLOC_REP.unpack(conn.call(Cmd.ALLOC_BUFFER, P.ALLOC_REQ.pack(0, 0, 4096)))[0]
        rec = np.zeros(1, P.TENSOR)
        rec["buffer"], rec["dtype"], rec["n_dims"] = bid, 0, 1
        rec["shape"][0, 0] = 1024
        get = rec.tobytes() + P.REGION.pack(0, 4096)
        rows = [("DEVICE_COUNT", Cmd.DEVICE_COUNT, b""), ("SYNCHRONIZE", Cmd.SYNCHRONIZE, P.U32.pack(0)),
                ("GET_TENSOR 4 KiB", Cmd.GET_TENSOR, get)]
        print(f"{'command':<18} {'median us':>10} {'p90 us':>8} {'p99 us':>8}   ({args.n} calls, loopback)")
        for name, cmd, payload in rows:
            ts = sorted(timed(conn, cmd, payload, args.n))
            print(f"{name:<18} {statistics.median(ts):>10.1f} {ts[int(0.9 * len(ts))]:>8.1f} "
                  f"{ts[min(len(ts) - 1, int(0.99 * len(ts)))]:>8.1f}")
        conn.sock.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
