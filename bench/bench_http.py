"""Requests/s of the HTTP front end (pyllama.server.http) for trivial handlers, over keep-alive.

    python bench/bench_http.py [-c CLIENTS] [-d SECONDS] [--pipeline K] [--json OUT]

Starts the server in-process on 127.0.0.1 (uvloop loop on its own thread) and drives it from N
client threads, each with one keep-alive connection sending K requests back to back before
reading the K answers (K=1: plain request/response). Two handlers are measured side by side in
one run: GET /health returning a small JSON object, and POST /echo parsing a small JSON body and
sending it back.

Client threads share the GIL with the server thread, so the requests/s figure is a floor that
depends on the client; the server loop thread's own CPU time per request is reported beside it
and gives the front end's capacity on one core (1e6 / us_per_req).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import uvloop  # noqa: E402

from pyllama.server.http import HTTPServer, Request, Response, json_response  # noqa: E402


async def health(req: Request) -> Response:
    return json_response({"status": "ok"})


async def echo(req: Request) -> Response:
    return json_response(req.json())


ECHO_BODY = json.dumps({"prompt": "Hello, world", "n_predict": 16, "temperature": 0.0}).encode()
REQUESTS = {
    "GET /health": b"GET /health HTTP/1.1\r\nHost: bench\r\n\r\n",
    "POST /echo": b"POST /echo HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%b" % (len(ECHO_BODY), ECHO_BODY),
}


def client(port: int, request: bytes, pipeline: int, stop: threading.Event, counts: list, idx: int) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    batch = request * pipeline
    buf = b""
    n = 0
    try:
        while not stop.is_set():
            s.sendall(batch)
            got = 0
            while got < pipeline:
                end = buf.find(b"\r\n\r\n")
                if end >= 0:
                    head = buf[:end]
                    i = head.find(b"Content-Length: ")
                    length = int(buf[i + 16:buf.find(b"\r\n", i)])
                    total = end + 4 + length
                    if len(buf) >= total:
                        if not head.startswith(b"HTTP/1.1 200"):
                            raise RuntimeError(head.decode(errors="replace"))
                        buf = buf[total:]
                        got += 1
                        continue
                data = s.recv(65536)
                if not data:
                    raise RuntimeError("server closed the connection")
                buf += data
            n += pipeline
            counts[idx] = n
    finally:
        s.close()


def loop_cpu(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def run_one(port: int, loop_thread: threading.Thread, request: bytes, clients: int, pipeline: int,
            seconds: float) -> dict:
    stop = threading.Event()
    counts = [0] * clients
    threads = [threading.Thread(target=client, args=(port, request, pipeline, stop, counts, i), daemon=True)
               for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # warm-up: connections open, caches hot
    base = sum(counts)
    cpu0 = loop_cpu(loop_thread)
    t0 = time.perf_counter()
    time.sleep(seconds)
    total = sum(counts) - base
    cpu = loop_cpu(loop_thread) - cpu0
    elapsed = time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join(10)
    return {"requests": total, "seconds": round(elapsed, 3), "req_per_s": round(total / elapsed),
            "server_cpu_us_per_req": round(cpu / max(total, 1) * 1e6, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-c", "--clients", type=int, default=4, help="client threads, one connection each")
    ap.add_argument("-d", "--duration", type=float, default=3.0, help="seconds per measurement")
    ap.add_argument("--pipeline", type=int, default=1, help="requests in flight per connection")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    loop = uvloop.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, name="http-loop", daemon=True)
    loop_thread.start()
    server = HTTPServer({("GET", "/health"): health, ("POST", "/echo"): echo}, max_connections=4096)
    port = asyncio.run_coroutine_threadsafe(server.start("127.0.0.1", 0), loop).result()

    results = {}
    try:
        for name, request in REQUESTS.items():
            r = run_one(port, loop_thread, request, args.clients, args.pipeline, args.duration)
            results[name] = r
            print(f"{name:12s} clients={args.clients} pipeline={args.pipeline}: {r['req_per_s']:>8d} req/s "
                  f"(server loop {r['server_cpu_us_per_req']:.1f} us CPU/req -> "
                  f"~{1e6 / max(r['server_cpu_us_per_req'], 0.1):,.0f} req/s per core)", flush=True)
    finally:
        asyncio.run_coroutine_threadsafe(server.shutdown(1.0), loop).result(15)
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(5)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"clients": args.clients, "pipeline": args.pipeline, "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
