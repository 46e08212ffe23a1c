"""pyllama.server.http: the HTTP/1.1 front end, driven over loopback with raw sockets and http.client.

Each test starts its own server on 127.0.0.1 port 0 in a uvloop event loop on a background thread
and shuts it down before returning.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time

import pytest
import uvloop

from pyllama.server.http import (MAX_JSON_ITEMS, SSE_DONE, HTTPError, HTTPServer, Request, Response, StreamResponse,
                                 error_response, json_response, sse_event)
from pyllama.util.loop import install_uvloop


# ---------------------------------------------------------------------------------------------
# harness

class ServerThread:
    def __init__(self, routes, **kw) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="http-test-loop", daemon=True)
        self.thread.start()
        self.server = HTTPServer(routes, **kw)
        self.port = self.call(self.server.start("127.0.0.1", 0))
        self.stopped = False

    def call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def n_connections(self) -> int:
        async def get():
            return self.server.n_connections
        return self.call(get())

    def stop(self, grace: float = 2.0) -> None:
        if self.stopped:
            return
        self.stopped = True
        try:
            self.call(self.server.shutdown(grace), timeout=grace + 10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            self.loop.close()

    def connect(self, timeout: float = 5.0) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        return s

    def http(self, timeout: float = 5.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)


@pytest.fixture
def serve():
    started: list[ServerThread] = []

    def start(routes=None, **kw) -> ServerThread:
        st = ServerThread(ROUTES if routes is None else routes, **kw)
        started.append(st)
        return st

    yield start
    for st in started:
        st.stop()


def read_response(f) -> tuple[int, dict[str, str], bytes]:
    """One response from a buffered socket file (Content-Length or chunked)."""
    line = f.readline()
    if not line:
        raise EOFError("connection closed")
    status = int(line.split(b" ", 2)[1])
    headers: dict[str, str] = {}
    while True:
        h = f.readline()
        if h in (b"\r\n", b""):
            break
        k, v = h.decode("latin-1").split(":", 1)
        headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        body = f.read(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b"".join(c for _, c in iter_chunks(f))
    else:
        body = b""
    return status, headers, body


def iter_chunks(f):
    """(arrival time, data) of each chunk of a chunked body, up to the terminating chunk."""
    while True:
        size = int(f.readline().split(b";")[0], 16)
        if size == 0:
            f.readline()
            return
        data = f.read(size)
        assert f.read(2) == b"\r\n"
        yield time.monotonic(), data


def recv_until_closed(s: socket.socket, limit: float = 5.0) -> bytes:
    s.settimeout(limit)
    buf = b""
    while True:
        try:
            d = s.recv(65536)
        except ConnectionResetError:
            return buf
        if not d:
            return buf
        buf += d


def error_body(status: int, message_part: str = "", type_: str | None = None, body: bytes = b"") -> None:
    obj = json.loads(body)
    assert list(obj) == ["error"]
    assert list(obj["error"]) == ["code", "message", "type"]
    assert obj["error"]["code"] == status
    assert message_part in obj["error"]["message"]
    if type_ is not None:
        assert obj["error"]["type"] == type_


# ---------------------------------------------------------------------------------------------
# handlers

EVENTS: dict[str, threading.Event] = {}
STATE: dict[str, object] = {}


def event(name: str) -> threading.Event:
    return EVENTS.setdefault(name, threading.Event())


@pytest.fixture(autouse=True)
def _reset_state():
    EVENTS.clear()
    STATE.clear()
    yield


async def h_hello(req: Request) -> Response:
    return json_response({"hello": "world", "method": req.method})


async def h_echo(req: Request) -> Response:
    return json_response(req.json())


async def h_query(req: Request) -> Response:
    return json_response({"path": req.path, "query": req.query, "peer_ok": req.peer.startswith("127.0.0.1:")})


async def h_delay(req: Request) -> Response:
    await asyncio.sleep(float(req.query.get("s", "0.1")))
    return json_response({"id": req.query.get("id")})


async def h_boom(req: Request) -> Response:
    raise RuntimeError("kaboom")


async def h_forbidden(req: Request) -> Response:
    raise HTTPError(403, "not for you", "permission_error")


async def h_stream(req: Request) -> StreamResponse:
    async def gen():
        for i in range(3):
            yield sse_event({"i": i})
            await asyncio.sleep(0.25)
        yield SSE_DONE
    return StreamResponse(gen())


class Ticker:
    """An async iterator that records aclose(), beside the generator-style finally."""

    def __init__(self) -> None:
        self.i = 0

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            event("ticker_cancelled").set()
            raise
        self.i += 1
        return sse_event({"tick": self.i})

    async def aclose(self) -> None:
        event("ticker_aclosed").set()


async def h_ticker(req: Request) -> StreamResponse:
    return StreamResponse(Ticker())


async def h_forever(req: Request) -> StreamResponse:
    async def gen():
        try:
            while True:
                yield b"data: {}\n\n"
                await asyncio.sleep(0.05)
        finally:
            event("forever_finally").set()
    return StreamResponse(gen())


async def h_hang(req: Request) -> Response:
    event("hang_started").set()
    try:
        await asyncio.sleep(60)
    finally:
        event("hang_finally").set()
    return json_response({})


async def h_flood(req: Request) -> StreamResponse:
    STATE["produced"] = 0
    blob = b"x" * 65536

    async def gen():
        try:
            while True:
                STATE["produced"] = STATE["produced"] + 1
                yield blob
        finally:
            event("flood_finally").set()
    return StreamResponse(gen(), content_type="application/octet-stream")


async def h_slow(req: Request) -> Response:
    event("slow_started").set()
    try:
        await asyncio.sleep(float(req.query.get("s", "0.5")))
    finally:
        event("slow_finally").set()
    return json_response({"done": True})


async def h_bad_header(req: Request) -> Response:
    return Response(200, b"{}", headers=[("X-Echo", req.query.get("v", ""))])


async def h_broken_stream(req: Request) -> StreamResponse:
    async def gen():
        yield b"data: 1\n\n"
        raise RuntimeError("generation failed")
    return StreamResponse(gen())


ROUTES = {
    ("GET", "/badheader"): h_bad_header,
    ("GET", "/broken"): h_broken_stream,
    ("GET", "/hello"): h_hello,
    ("POST", "/hello"): h_hello,
    ("POST", "/echo"): h_echo,
    ("GET", "/query"): h_query,
    ("GET", "/delay"): h_delay,
    ("GET", "/boom"): h_boom,
    ("GET", "/forbidden"): h_forbidden,
    ("GET", "/stream"): h_stream,
    ("GET", "/ticker"): h_ticker,
    ("GET", "/forever"): h_forever,
    ("GET", "/hang"): h_hang,
    ("GET", "/flood"): h_flood,
    ("GET", "/slow"): h_slow,
}


# ---------------------------------------------------------------------------------------------
# pieces

def test_helpers_and_error_shape():
    assert sse_event({"a": "é/b"}) == 'data: {"a":"é/b"}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"
    r = error_response(404, "File Not Found", "not_found_error")
    assert r.status == 404
    assert r.body == b'{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}'
    assert Response(body="é").body == "é".encode()
    assert json_response([1, "/"]).body == b'[1,"/"]'


def test_request_json_limits():
    ok = b"[" * 64 + b"]" * 64
    assert Request("POST", "/", body=ok).json() is not None
    with pytest.raises(HTTPError) as ei:
        Request("POST", "/", body=b"[" * 65 + b"]" * 65).json()
    assert ei.value.status == 400 and "nesting" in ei.value.message
    # brackets inside strings are not nesting
    deep_text = json.dumps({"s": "[" * 1000 + "\\\"{" * 100}).encode()
    assert Request("POST", "/", body=deep_text).json()["s"].startswith("[[[")
    for bad in (b"{", b"", b"[1,]", b'{"a":1', b"\xff\xfe", b'"\xc3"'):
        with pytest.raises(HTTPError) as ei:
            Request("POST", "/", body=bad).json()
        assert ei.value.status == 400
    # unterminated strings with many escaped quotes must not make the scan quadratic
    t0 = time.monotonic()
    with pytest.raises(HTTPError):
        Request("POST", "/", body=b"[" * 100 + b'"' + b'\\"' * 2_000_000).json()
    assert time.monotonic() - t0 < 2.0


def test_request_json_bounds_what_parsing_allocates():
    """A body of many small containers ([{},{},...]: 16 MiB took 437 MB to parse) is refused by
    counting its values before parsing; values inside strings are not counted."""
    limit = MAX_JSON_ITEMS
    for bomb in (b"[" + b"{}," * (limit // 4) + b"{}]", b"[" + b"[]," * (limit // 4) + b"[]]",
                 b"[" + b"1," * limit + b"1]", b'{"a": [' + b'"x",' * limit + b'"x"]}'):
        with pytest.raises(HTTPError) as ei:
            Request("POST", "/", body=bomb).json()
        assert ei.value.status == 413 and str(limit) in ei.value.message, ei.value.message
    # what real requests carry: token ids by the hundred thousand, long texts full of commas
    ids = json.dumps({"tokens": list(range(1, 500)) * 1600}).encode()
    assert len(Request("POST", "/", body=ids).json()["tokens"]) == 798400
    text = json.dumps({"prompt": "a, b: c, [d], {e}, " * 200000}).encode()
    assert Request("POST", "/", body=text).json()["prompt"].startswith("a, b: c")
    many = json.dumps({"prompt": ["x,y"] * (limit // 3)}).encode()
    assert len(Request("POST", "/", body=many).json()["prompt"]) == limit // 3


def test_install_uvloop():
    old = asyncio.get_event_loop_policy()
    try:
        install_uvloop()
        assert isinstance(asyncio.get_event_loop_policy(), uvloop.EventLoopPolicy)
    finally:
        asyncio.set_event_loop_policy(old)


# ---------------------------------------------------------------------------------------------
# routing

def test_routing(serve):
    st = serve()
    c = st.http()
    c.request("GET", "/hello")
    r = c.getresponse()
    body = r.read()
    assert r.status == 200 and json.loads(body) == {"hello": "world", "method": "GET"}
    assert r.getheader("Server") == "pyllama"
    assert r.getheader("Access-Control-Allow-Origin") == "*"
    assert r.getheader("Content-Length") == str(len(body))
    assert r.getheader("Content-Type") == "application/json; charset=utf-8"

    c.request("GET", "/nowhere")
    r = c.getresponse()
    body = r.read()
    assert r.status == 404
    assert json.loads(body) == {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}
    assert r.getheader("Access-Control-Allow-Origin") == "*"

    c.request("DELETE", "/echo")
    r = c.getresponse()
    body = r.read()
    assert r.status == 405
    assert "POST" in r.getheader("Allow")
    error_body(405, body=body)

    c.request("OPTIONS", "/echo", headers={"Origin": "http://x", "Access-Control-Request-Method": "POST",
                                          "Access-Control-Request-Headers": "authorization, content-type"})
    r = c.getresponse()
    assert r.read() == b""
    assert r.status == 200  # llama-server answers a preflight 200
    assert r.getheader("Access-Control-Allow-Origin") == "http://x"  # allowed ('*'): the origin reflected
    assert "POST" in r.getheader("Access-Control-Allow-Methods")
    assert r.getheader("Access-Control-Allow-Headers") == "authorization, content-type"

    c.request("OPTIONS", "/nowhere")
    r = c.getresponse()
    r.read()
    assert r.status == 404

    c.request("HEAD", "/hello")
    r = c.getresponse()
    assert r.status == 200 and r.read() == b""
    assert int(r.getheader("Content-Length")) > 0

    c.request("GET", "/forbidden")
    r = c.getresponse()
    body = r.read()
    assert r.status == 403
    assert json.loads(body) == {"error": {"code": 403, "message": "not for you", "type": "permission_error"}}
    c.close()


def test_no_cors(serve):
    st = serve(cors_origins=None)
    c = st.http()
    c.request("GET", "/hello")
    r = c.getresponse()
    r.read()
    assert r.status == 200 and r.getheader("Access-Control-Allow-Origin") is None
    c.request("OPTIONS", "/hello")
    r = c.getresponse()
    r.read()
    assert r.status == 200 and r.getheader("Access-Control-Allow-Methods") is None
    assert "GET" in r.getheader("Allow")
    c.close()


def test_query_and_path(serve):
    st = serve()
    c = st.http()
    c.request("GET", "/query?a=1&b=%C3%A9t%C3%A9&c=x+y&empty=")
    r = c.getresponse()
    obj = json.loads(r.read())
    assert r.status == 200
    assert obj == {"path": "/query", "query": {"a": "1", "b": "été", "c": "x y", "empty": ""}, "peer_ok": True}
    c.request("GET", "/q%75ery")
    r = c.getresponse()
    assert r.status == 200 and json.loads(r.read())["path"] == "/query"
    for bad in ("/query?a=%zz", "/query?a=%4", "/query?a=%ff"):
        c.request("GET", bad)
        r = c.getresponse()
        body = r.read()
        assert r.status == 400, bad
        error_body(400, type_="invalid_request_error", body=body)
    c.request("GET", "/hello")  # the connection survives a bad query
    r = c.getresponse()
    assert r.status == 200 and r.read()
    c.close()


# ---------------------------------------------------------------------------------------------
# bodies and limits

def test_json_round_trip(serve):
    st = serve()
    c = st.http()
    obj = {"text": "héllo 世界 🚀 / \"q\"", "n": [1, 2.5, {"a": None, "b": True}], "url": "http://x/y"}
    c.request("POST", "/echo", body=json.dumps(obj, ensure_ascii=False).encode(),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    body = r.read()
    assert r.status == 200
    assert json.loads(body) == obj
    assert "世界".encode() in body and b"http://x/y" in body  # no \u escapes, no escaped slashes
    c.close()


def test_malformed_json(serve):
    st = serve()
    c = st.http()
    c.request("POST", "/echo", body=b'{"a": 1,')
    r = c.getresponse()
    body = r.read()
    assert r.status == 400
    error_body(400, "Invalid JSON", "invalid_request_error", body)
    c.request("POST", "/echo", body=b'{"a": "\xff"}')
    r = c.getresponse()
    body = r.read()
    assert r.status == 400
    error_body(400, "UTF-8", "invalid_request_error", body)
    c.close()


def test_nesting_bomb(serve):
    st = serve()
    c = st.http(timeout=5)
    t0 = time.monotonic()
    c.request("POST", "/echo", body=b"[" * 100_000)
    r = c.getresponse()
    body = r.read()
    assert time.monotonic() - t0 < 1.0
    assert r.status == 400
    error_body(400, "nesting", "invalid_request_error", body)
    c.request("POST", "/echo", body=b"[" * 100_000 + b"]" * 100_000)
    r = c.getresponse()
    r.read()
    assert r.status == 400
    c.request("GET", "/hello")
    r = c.getresponse()
    assert r.status == 200 and r.read()
    c.close()


def test_oversized_body(serve):
    st = serve(max_body=1024)
    s = st.connect()
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n" + b"[" * 4096)
    f = s.makefile("rb")
    status, headers, body = read_response(f)
    assert status == 413
    assert headers["connection"] == "close"
    error_body(413, "too large", "invalid_request_error", body)
    assert recv_until_closed(s) == b""
    s.close()

    # chunked: the limit is enforced while the body arrives
    s = st.connect()
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    for _ in range(3):
        s.sendall(b"200\r\n" + b"1" * 512 + b"\r\n")
    status, headers, body = read_response(s.makefile("rb"))
    assert status == 413
    s.close()

    # a body under the limit still works, on a new connection
    c = st.http()
    c.request("POST", "/echo", body=b"[" + b"1," * 200 + b"1]")
    r = c.getresponse()
    assert r.status == 200 and len(json.loads(r.read())) == 201
    c.close()


def test_huge_headers(serve):
    st = serve()
    s = st.connect()
    s.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
    status, headers, body = read_response(s.makefile("rb"))
    assert status == 431
    error_body(431, body=body)
    s.close()
    # many headers, each small
    s = st.connect()
    s.sendall(b"GET /hello HTTP/1.1\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(1000)) + b"\r\n")
    status, headers, body = read_response(s.makefile("rb"))
    assert status == 431
    s.close()
    # a header that never ends is cut off without waiting for its end
    s = st.connect()
    s.sendall(b"GET /hello HTTP/1.1\r\nX-Big: ")
    for _ in range(20):
        try:
            s.sendall(b"b" * 8192)
        except (BrokenPipeError, ConnectionResetError):
            break
        time.sleep(0.005)
    status, headers, body = read_response(s.makefile("rb"))
    assert status == 431
    s.close()


def test_large_headers_in_small_packets(serve):
    st = serve()
    s = st.connect()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    req = b"GET /hello HTTP/1.1\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 90) for i in range(400)) + b"\r\n"
    assert 32 << 10 < len(req) < 60 << 10
    for i in range(0, len(req), 500):
        s.sendall(req[i:i + 500])
        time.sleep(0.0005)
    status, _, _ = read_response(s.makefile("rb"))
    assert status == 200
    s.close()


def test_expect_continue_and_upgrade(serve):
    st = serve()
    s = st.connect()
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n")
    f = s.makefile("rb")
    assert f.readline() == b"HTTP/1.1 100 Continue\r\n"
    assert f.readline() == b"\r\n"
    s.sendall(b"[1]")
    status, _, body = read_response(f)
    assert status == 200 and body == b"[1]"
    # an Upgrade request is answered as an ordinary one, and what follows it still parses
    s.sendall(b"GET /hello HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
              b"GET /query?n=2 HTTP/1.1\r\nHost: x\r\n\r\n")
    status, _, _ = read_response(f)
    assert status == 200
    status, _, body = read_response(f)
    assert status == 200 and json.loads(body)["query"] == {"n": "2"}
    s.close()


def test_response_header_injection_refused(serve):
    st = serve()
    c = st.http()
    c.request("GET", "/badheader?v=ok")
    r = c.getresponse()
    r.read()
    assert r.status == 200 and r.getheader("X-Echo") == "ok"
    c.request("GET", "/badheader?v=a%0D%0ASet-Cookie:%20x=1")
    r = c.getresponse()
    body = r.read()
    assert r.status == 500 and r.getheader("Set-Cookie") is None
    error_body(500, "line break", "server_error", body)
    c.close()


def test_malformed_http(serve):
    st = serve()
    s = st.connect()
    s.sendall(b"GARBAGE\r\n\r\n")
    status, headers, body = read_response(s.makefile("rb"))
    assert status == 400
    error_body(400, "Malformed", body=body)
    assert recv_until_closed(s) == b""
    s.close()


# ---------------------------------------------------------------------------------------------
# connection handling

def test_keep_alive(serve):
    st = serve()
    c = st.http()
    for i in range(3):
        c.request("GET", f"/query?i={i}")
        r = c.getresponse()
        assert r.status == 200
        assert json.loads(r.read())["query"] == {"i": str(i)}
        assert r.getheader("Connection") is None
        if i == 0:
            sock = c.sock
        assert c.sock is sock  # http.client reopens only when the server closed
    assert st.n_connections() == 1
    c.close()


def test_pipelining(serve):
    st = serve()
    s = st.connect()
    # the first is the slowest: answers must still come back in request order
    s.sendall(b"GET /delay?id=1&s=0.2 HTTP/1.1\r\nHost: x\r\n\r\n"
              b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\n\r\n{\"id\":2}"
              b"GET /delay?id=3&s=0 HTTP/1.1\r\nHost: x\r\n\r\n")
    f = s.makefile("rb")
    ids = []
    for _ in range(3):
        status, headers, body = read_response(f)
        assert status == 200
        ids.append(json.loads(body)["id"])
    assert ids == ["1", 2, "3"]
    s.close()


def test_connection_close(serve):
    st = serve()
    s = st.connect()
    s.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
              b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
    data = recv_until_closed(s)
    assert data.count(b"HTTP/1.1 200") == 1
    assert b"Connection: close\r\n" in data
    s.close()


def test_http10(serve):
    st = serve()
    s = st.connect()
    s.sendall(b"GET /hello HTTP/1.0\r\n\r\n")
    data = recv_until_closed(s)
    assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"}")
    s.close()
    s = st.connect()
    s.sendall(b"GET /hello HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    f = s.makefile("rb")
    status, headers, _ = read_response(f)
    assert status == 200 and headers["connection"] == "keep-alive"
    s.sendall(b"GET /hello HTTP/1.0\r\n\r\n")
    status, headers, _ = read_response(f)
    assert status == 200 and headers["connection"] == "close"
    s.close()


def test_idle_keepalive_timeout(serve):
    st = serve(keepalive_timeout=0.3)
    s = st.connect()
    s.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
    t0 = time.monotonic()
    data = recv_until_closed(s, limit=5)
    assert data.startswith(b"HTTP/1.1 200")
    assert 0.25 < time.monotonic() - t0 < 2.0
    s.close()


def test_slowloris(serve):
    st = serve(header_timeout=0.4)
    s = st.connect()
    t0 = time.monotonic()
    s.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n")
    time.sleep(0.1)
    s.sendall(b"X-A: 1\r\n")  # trickling bytes does not extend the deadline
    time.sleep(0.1)
    s.sendall(b"X-B: 2\r\n")
    assert recv_until_closed(s, limit=5) == b""
    assert 0.35 < time.monotonic() - t0 < 2.0
    s.close()
    assert st.n_connections() == 0 or _wait(lambda: st.n_connections() == 0)


def _wait(cond, timeout: float = 2.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_max_connections(serve):
    """At the limit with every connection busy (none idle to close), one more gets 503."""
    st = serve(max_connections=2)
    busy = []
    for i in range(2):
        s = st.connect()
        s.sendall(b"GET /delay?s=1.5&id=%d HTTP/1.1\r\nHost: x\r\n\r\n" % i)
        busy.append(s)
    assert _wait(lambda: st.n_connections() == 2)
    s = st.connect()
    s.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, body = read_response(s.makefile("rb"))
    assert status == 503
    error_body(503, type_="unavailable_error", body=body)
    s.close()
    for i, b in enumerate(busy):  # the busy ones were not touched: each gets its answer
        status, _, body = read_response(b.makefile("rb"))
        assert status == 200 and json.loads(body) == {"id": str(i)}
    busy.pop().close()
    assert _wait(lambda: st.n_connections() == 1)
    c = st.http()
    c.request("GET", "/hello")
    r = c.getresponse()
    assert r.status == 200 and r.read()
    c.close()
    for b in busy:
        b.close()


def test_idle_keepalive_connections_give_way_at_the_limit(serve):
    """Idle keep-alive connections must not lock new clients out: at the limit the one idle the
    longest is closed to admit the new connection."""
    st = serve(max_connections=3)
    idle = []
    for _ in range(3):
        s = st.connect()
        s.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(s.makefile("rb"))[0] == 200
        idle.append(s)
        time.sleep(0.02)  # an order of idleness
    for _ in range(2):  # each newcomer is served, and the oldest idle connection closed for it
        s = st.connect()
        s.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(s.makefile("rb"))[0] == 200
        idle.append(s)
    for s in idle[:2]:
        s.settimeout(5)
        assert s.recv(100) == b""  # closed, with nothing written on it
    for s in idle[2:]:  # the others still serve
        s.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(s.makefile("rb"))[0] == 200
    assert st.n_connections() == 3
    for s in idle:
        s.close()


def test_buffered_body_bytes_return_to_zero(serve):
    """The server-wide count of buffered body bytes (--max-body-buffered) comes back to 0 after
    every way a body can end: answered, pipelined, refused, cut off mid-body, handler running."""
    st = serve(max_body=4096, max_buffered=8192)

    async def buffered() -> int:
        return st.server._buffered

    body = b'{"a": "' + b"x" * 1000 + b'"}'
    post = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
    s = st.connect()
    s.sendall(post * 3 + b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
              + b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 9999\r\n\r\n")  # over max_body: 413
    data = recv_until_closed(s, 5.0)
    assert data.count(b"HTTP/1.1 200 ") == 3 and b"HTTP/1.1 404 " in data and b"HTTP/1.1 413 " in data
    s.close()
    s = st.connect()  # cut off half-way through a body
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3000\r\n\r\n" + b"x" * 1500)
    assert _wait(lambda: st.call(buffered()) == 1500)
    s.close()
    s = st.connect()  # a body whose handler runs when its client goes
    s.sendall(b"GET /hang HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"y" * 100)
    assert event("hang_started").wait(5)
    assert st.call(buffered()) == 100
    s.close()
    assert event("hang_finally").wait(5)
    assert _wait(lambda: st.call(buffered()) == 0)
    # two bodies of 4000 bytes fit 8192; a third one, declared, is a 503 from its headers
    held = [st.connect() for _ in range(2)]
    for h in held:
        h.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4001\r\n\r\n" + b" " * 4000)
    assert _wait(lambda: st.call(buffered()) == 8000)
    s = st.connect()
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\nExpect: 100-continue\r\n\r\n")
    data = recv_until_closed(s, 5.0)
    assert data.startswith(b"HTTP/1.1 503 ") and b"100 Continue" not in data, data[:200]
    s.close()
    for h in held:
        h.close()
    assert _wait(lambda: st.call(buffered()) == 0)


def test_unauthorised_request_is_answered_from_its_headers_and_closed(serve):
    """The key is checked before any body byte is read (no 100 Continue, no body buffered), and a
    401 ends the connection, so that keyless clients hold neither memory nor connections."""
    st = serve(api_keys=["sesame"])
    s = st.connect()
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\nExpect: 100-continue\r\n\r\n"
              + b"[" * 1000)
    data = recv_until_closed(s, 5.0)
    s.close()
    assert data.startswith(b"HTTP/1.1 401 "), data[:200]
    assert b"100 Continue" not in data
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"Connection: close" in head
    error_body(401, "Invalid API Key", "authentication_error", body)
    for auth in (b"", b"Authorization: Bearer wrong\r\n"):
        s = st.connect()
        s.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n")
        data = recv_until_closed(s, 5.0)
        s.close()
        assert data.startswith(b"HTTP/1.1 401 ") and b"Connection: close" in data, data[:200]
    # with the key: answered, and the connection stays open for the next request
    s = st.connect()
    body = b'{"a": 1}'
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Api-Key: sesame\r\nContent-Length: %d\r\n\r\n%b"
              % (len(body), body))
    f = s.makefile("rb")
    status, headers, got = read_response(f)
    assert status == 200 and json.loads(got) == {"a": 1}
    s.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\nX-Api-Key: sesame\r\n\r\n")
    assert read_response(f)[0] == 200
    s.close()


def test_handler_exception(serve):
    st = serve()
    c = st.http()
    c.request("GET", "/boom")
    r = c.getresponse()
    body = r.read()
    assert r.status == 500
    assert json.loads(body) == {"error": {"code": 500, "message": "kaboom", "type": "server_error"}}
    sock = c.sock
    c.request("GET", "/hello")
    r = c.getresponse()
    assert r.status == 200 and r.read()
    assert c.sock is sock
    c.close()


# ---------------------------------------------------------------------------------------------
# streaming

def test_streaming_chunks_arrive_one_by_one(serve):
    st = serve()
    s = st.connect()
    s.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    f = s.makefile("rb")
    line = f.readline()
    assert line.startswith(b"HTTP/1.1 200")
    headers = {}
    while (h := f.readline()) != b"\r\n":
        k, v = h.decode().split(":", 1)
        headers[k.lower()] = v.strip()
    assert headers["transfer-encoding"] == "chunked"
    assert headers["content-type"] == "text/event-stream"
    assert "content-length" not in headers
    chunks = list(iter_chunks(f))
    assert [c for _, c in chunks] == [sse_event({"i": i}) for i in range(3)] + [SSE_DONE]
    times = [t for t, _ in chunks]
    # 0.25 s between yields: each chunk was flushed when produced, not at the end
    assert times[-1] - times[0] > 0.5
    assert all(b - a > 0.15 for a, b in zip(times, times[1:]))
    # the connection serves another request after the stream
    s.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
    status, _, body = read_response(f)
    assert status == 200
    s.close()


def test_stream_client_disconnect(serve):
    st = serve()
    s = st.connect()
    s.sendall(b"GET /forever HTTP/1.1\r\nHost: x\r\n\r\n")
    f = s.makefile("rb")
    assert f.readline().startswith(b"HTTP/1.1 200")
    while f.readline() != b"\r\n":
        pass
    next(iter_chunks(f))
    f.close()
    s.close()
    assert event("forever_finally").wait(1.0)

    # an iterator object (not a generator): cancelled in __anext__ and aclose()d
    s = st.connect()
    s.sendall(b"GET /ticker HTTP/1.1\r\nHost: x\r\n\r\n")
    f = s.makefile("rb")
    assert f.readline().startswith(b"HTTP/1.1 200")
    while f.readline() != b"\r\n":
        pass
    next(iter_chunks(f))
    f.close()
    s.close()
    assert event("ticker_aclosed").wait(1.0)
    assert event("ticker_cancelled").wait(1.0)
    assert _wait(lambda: st.n_connections() == 0)


def test_stream_failing_midway(serve):
    st = serve()
    s = st.connect()
    s.sendall(b"GET /broken HTTP/1.1\r\nHost: x\r\n\r\n")
    data = recv_until_closed(s)
    assert data.startswith(b"HTTP/1.1 200")
    assert data.endswith(b"data: 1\n\n\r\n")  # cut short: no terminating chunk
    s.close()
    c = st.http()
    c.request("GET", "/hello")
    r = c.getresponse()
    assert r.status == 200 and r.read()
    c.close()


def test_handler_cancelled_on_disconnect(serve):
    st = serve()
    s = st.connect()
    s.sendall(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n")
    assert event("hang_started").wait(2.0)
    s.close()
    assert event("hang_finally").wait(10.0)


def test_stream_backpressure(serve):
    st = serve()
    s = st.connect()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    s.sendall(b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.8)  # not reading: the producer must stop once the buffers are full
    n1 = STATE["produced"]
    time.sleep(0.4)
    n2 = STATE["produced"]
    assert n1 == n2, (n1, n2)
    assert n2 * 65536 < 64 << 20
    # reading resumes the producer
    got = 0
    s.settimeout(5)
    while got < (n2 + 20) * 65536:
        got += len(s.recv(1 << 20))
    assert STATE["produced"] > n2
    s.close()
    assert event("flood_finally").wait(10.0)  # the loop may be slow to run on a loaded machine


# ---------------------------------------------------------------------------------------------
# shutdown

def test_graceful_shutdown(serve):
    st = serve()
    result = {}

    def client():
        c = st.http(timeout=10)
        c.request("GET", "/slow?s=0.5")
        r = c.getresponse()
        result["status"] = r.status
        result["body"] = r.read()
        result["connection"] = r.getheader("Connection")
        c.close()

    idle = st.http()
    idle.request("GET", "/hello")
    r = idle.getresponse()
    assert r.status == 200 and r.read()

    t = threading.Thread(target=client)
    t.start()
    assert event("slow_started").wait(2.0)
    t0 = time.monotonic()
    st.stop(grace=5.0)
    elapsed = time.monotonic() - t0
    t.join(5)
    assert result["status"] == 200 and json.loads(result["body"]) == {"done": True}
    assert result["connection"] == "close"
    assert elapsed < 3.0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", st.port), timeout=2)
    # the idle keep-alive connection was closed
    idle.sock.settimeout(2)
    assert idle.sock.recv(1) == b""
    idle.close()


def test_shutdown_grace_expires(serve):
    st = serve()
    s = st.connect()
    s.sendall(b"GET /slow?s=30 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert event("slow_started").wait(2.0)
    t0 = time.monotonic()
    st.stop(grace=0.3)
    assert time.monotonic() - t0 < 3.0
    assert event("slow_finally").is_set()
    assert recv_until_closed(s, limit=2) == b""
    s.close()


def test_a_stream_cut_by_shutdown_ends_with_an_error_event(serve):
    """A client must be able to tell a shutdown from a crash: the cut stream says why and ends
    as a complete chunked body."""
    st = serve()
    s = st.connect()
    s.sendall(b"GET /forever HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.2)
    st.stop(grace=0.2)
    raw = recv_until_closed(s, limit=3)
    s.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head
    assert body.endswith(b"0\r\n\r\n"), body[-80:]
    chunks, rest = [], body
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        chunks.append(rest[:n])
        rest = rest[n + 2:]
        if n == 0:
            break
    last = json.loads(chunks[-2].decode().removeprefix("data: "))
    assert last["error"]["code"] == 503 and "shutting down" in last["error"]["message"]


def test_json_never_holds_what_strict_parsers_refuse():
    from pyllama.server.http import json_bytes, sse_event
    obj = {"a": float("-inf"), "b": [1.5, float("nan"), {"c": float("inf")}], "d": (2, "x")}
    assert json_bytes(obj) == b'{"a":null,"b":[1.5,null,{"c":null}],"d":[2,"x"]}'
    assert sse_event({"p": float("nan")}) == b'data: {"p":null}\n\n'
    assert json_bytes({"t": "\u00e9/"}) == '{"t":"\u00e9/"}'.encode()  # UTF-8, slashes unescaped


def test_event_stream_pings_while_idle(serve):
    """As llama-server's --sse-ping-interval: an event stream that has sent nothing for the
    interval gets an SSE comment (":"), which clients skip and proxies see as traffic."""
    st = serve(sse_ping_interval=0.1)
    s = st.connect()
    s.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    f = s.makefile("rb")
    while f.readline() != b"\r\n":
        pass
    chunks = [c for _, c in iter_chunks(f)]
    pings = [c for c in chunks if c == b":\n\n"]
    assert [c for c in chunks if c != b":\n\n"] == [sse_event({"i": i}) for i in range(3)] + [SSE_DONE]
    assert 2 <= len(pings) <= 8  # the 0.25 s gaps between events, at 0.1 s
    s.close()
    # -1 (or 0): none
    quiet = serve(sse_ping_interval=-1)
    s = quiet.connect()
    s.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    f = s.makefile("rb")
    while f.readline() != b"\r\n":
        pass
    assert b":\n\n" not in [c for _, c in iter_chunks(f)]
    s.close()


def test_event_stream_ping_interval_of_its_own(serve):
    """A stream's own interval (a request's sse_ping_interval) replaces the server's."""
    async def slow():
        await asyncio.sleep(1.3)
        yield b"data: {}\n\n"

    async def handler(req):
        every = req.query.get("every")
        return StreamResponse(slow(), ping_interval=float(every) if every is not None else None)

    st = serve({("GET", "/s"): handler}, sse_ping_interval=30.0)

    def body(query: str) -> bytes:
        conn = st.http(timeout=10)
        conn.request("GET", "/s" + query)
        return conn.getresponse().read()
    assert body("?every=0.5").startswith(b":\n\n:\n\n")
    assert body("") == body("?every=-1") == b"data: {}\n\n"


def test_api_prefix(serve):
    """As llama-server's --api-prefix: every path is served under the prefix, and only there; the
    prefix alone redirects to its '/' (pages resolve their files against it)."""
    st = serve(api_prefix="/llama", api_keys=["k"], public_paths={"/hello"})
    s = st.connect()
    f = s.makefile("rb")
    for path, status in (("/llama/hello", 200), ("/hello", 404), ("/llamahello", 404)):
        s.sendall(b"GET %b HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode())
        got, _, _ = read_response(f)
        assert got == status, path
    s.sendall(b"GET /llama HTTP/1.1\r\nHost: x\r\n\r\n")
    got, headers, _ = read_response(f)
    assert got == 308 and headers["location"] == "/llama/"
    s.sendall(b"GET /llama/query?a=1 HTTP/1.1\r\nHost: x\r\n\r\n")  # not public: the key is still asked for
    got, _, _ = read_response(f)
    assert got == 401
    s.close()


def test_reuse_port_lets_servers_share_a_port():
    """--reuse-port: a second server that sets SO_REUSEPORT too listens on the same port and both
    answer; without it the second is refused the port."""
    async def hello(req: Request) -> Response:
        return json_response({"ok": True})

    loop = uvloop.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(10)

    servers = [HTTPServer({("GET", "/hello"): hello}) for _ in range(3)]
    try:
        port = call(servers[0].start("127.0.0.1", 0, reuse_port=True))
        assert call(servers[1].start("127.0.0.1", port, reuse_port=True)) == port
        with pytest.raises(OSError):
            call(servers[2].start("127.0.0.1", port))
        for _ in range(4):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/hello")
            assert conn.getresponse().status == 200
            conn.close()
    finally:
        for s in servers[:2]:
            call(s.shutdown(1.0))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
