"""A small HTTP/1.1 server on uvloop + httptools: the front end of pyllama.server.

The event loop thread owns every socket and never computes. Handlers are coroutines that await
results produced by other threads; each runs as its own asyncio Task, so a client that goes away
cancels it (its ``finally`` blocks run) and closes the iterator of a streamed response.

One connection = one ``_Connection`` protocol with its own httptools parser. Requests are parsed
ahead and queued, then answered strictly in order, one handler at a time per connection
(pipelining); at most `max_pipelined` wait (or `max_body` bytes of their bodies), beyond which the
connection's input is held unparsed and reading pauses. Timeouts are enforced by one periodic sweep
over all connections instead of a timer per request: a request then costs a float store, not a
TimerHandle. A new connection must send its first request's headers within `header_timeout`, a
later request within `header_timeout` of its first byte, and a body within `body_timeout` of its
headers (else 408).

No client can stall another: the API key (and, on a keyless loopback server, the Host name) is
checked from the headers before any body byte is read, and a refused connection closes; the body
bytes held across all connections are bounded (`max_buffered`, else 503); a JSON body's values are
counted before it is parsed; and at `max_connections` the longest idle keep-alive connection is
closed to admit a new one.
"""
from __future__ import annotations

import asyncio
import collections
import hmac
import http
import ipaddress
import logging
import math
import re
from email.utils import formatdate
from types import SimpleNamespace
from typing import Any, AsyncIterator, Awaitable, Callable, Collection, Optional, Sequence, Union
from urllib.parse import parse_qsl, unquote

import httptools
import ujson

from ..util.cli import is_loopback_address
from ..util.errors import HTTPError  # noqa: F401 - the handlers raise it through this module

__all__ = [
    "HTTPError", "Request", "Response", "StreamResponse", "Handler", "HTTPServer",
    "json_response", "error_response", "sse_event", "SSE_DONE", "MAX_JSON_DEPTH",
    "MAX_JSON_ITEMS",
]

log = logging.getLogger(__name__)

MAX_JSON_DEPTH = 64
# What parsing one body may build, in values: each string, comma and colon outside strings counts
# one and each array or object four (a dict or list costs 56 to 64 bytes, a short string about 50,
# a number about 30), so that one body's parse stays near 100 MB at most whatever its shape.
# 800k token ids (a /detokenize of a long text) count 800k.
MAX_JSON_ITEMS = 1 << 21
SSE_DONE = b"data: [DONE]\n\n"
_SSE_PING = b":\n\n"  # an SSE comment: clients skip it

# Input is parsed this many bytes at a time so that a burst of pipelined requests stops being
# parsed once enough of them wait (httptools cannot pause in the middle of a buffer).
_FEED_SLICE = 4096
# The body phase of a request may read this much more than its body on the wire (chunk sizes,
# extensions, trailers), beyond twice the body limit; without a bound an endless chunk extension
# would be read until the body timeout.
_FRAMING_ALLOWANCE = 64 << 10
# Each chunk costs a Python callback (about 2 us): a body may come in at most max_body / 64 chunks
# (and 1024 in any case), so that 1-byte chunks cannot buy seconds of event loop time per request.
_MIN_AVG_CHUNK = 64
_MIN_MAX_CHUNKS = 1024
# After an error that ends a connection, keep reading (and discarding) this long so that the
# client's unread upload does not turn our close into a RST that destroys the error response.
_LINGER_S = 2.0
# what shutdown takes beyond its grace: cancelled handlers (2 s), then lingering closes (1 s)
_SHUTDOWN_SLACK_S = 5.0


class Request:
    __slots__ = ("method", "path", "query", "headers", "body", "peer")

    def __init__(self, method: str, path: str, query: Optional[dict[str, str]] = None,
                 headers: Optional[dict[str, str]] = None, body: bytes = b"", peer: str = "") -> None:
        self.method = method
        self.path = path
        self.query = query if query is not None else {}
        self.headers = headers if headers is not None else {}
        self.body = body
        self.peer = peer

    def json(self) -> Any:
        """The body parsed as JSON; HTTPError(400) on invalid UTF-8, bad JSON or deep nesting."""
        body = self.body
        if not body.isascii():
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise HTTPError(400, f"Invalid UTF-8 in request body at byte {exc.start}") from None
        # Counting brackets runs at C speed; only bodies with many of them pay for the real scan.
        n_open = body.count(b"[") + body.count(b"{")
        # an upper bound at C speed; only a body above it pays for the count outside strings
        if (4 * n_open + body.count(b",") + body.count(b":") + body.count(b'"') > MAX_JSON_ITEMS
                and _json_items_over(body, MAX_JSON_ITEMS)):
            raise HTTPError(413, f"Request body holds too many JSON values: more than {MAX_JSON_ITEMS} (each "
                                 "string, comma and colon counts one, each array or object four)")
        if n_open > MAX_JSON_DEPTH and _json_too_deep(body, MAX_JSON_DEPTH):
            raise HTTPError(400, f"Invalid JSON: nesting deeper than {MAX_JSON_DEPTH} levels")
        try:
            return ujson.loads(body)
        except (ValueError, OverflowError, TypeError) as exc:
            raise HTTPError(400, f"Invalid JSON: {exc}") from None

    def __repr__(self) -> str:
        return f"<Request {self.method} {self.path} from {self.peer}>"


# A string token always matches at a quote (unterminated strings run to the end), so the scan is
# linear: a failed string match retried at every later quote would be quadratic.
_JSON_SCAN = re.compile(rb'"[^"\\]*(?:\\[\s\S][^"\\]*)*"?|([\[{])|([\]}])')


def _json_too_deep(body: bytes, limit: int) -> bool:
    depth = 0
    for m in _JSON_SCAN.finditer(body):
        g = m.lastindex
        if g == 1:
            depth += 1
            if depth > limit:
                return True
        elif g == 2:
            depth -= 1
    return False


# a run of anything but strings, then a string (to its end, or the body's when unterminated)
_JSON_RUNS = re.compile(rb'[^"]*("[^"\\]*(?:\\[\s\S][^"\\]*)*"?)?')


def _json_items_over(body: bytes, limit: int) -> bool:
    """Whether the values of a JSON body, counted as MAX_JSON_ITEMS says, pass `limit`. One step
    per string: the run before it is counted in place (no copy), and the scan stops at the limit,
    so that a body of many small strings costs at most about limit / 2 steps."""
    # every string is a value: past the limit on strings alone (an escaped quote may not end one)
    if (body.count(b'"') - body.count(b'\\"')) // 2 > limit:
        return True
    n = 0
    count = body.count
    weight = _JSON_WEIGHT
    for m in _JSON_RUNS.finditer(body):
        a = m.start()
        b = m.start(1)
        if b < 0:
            b = m.end()
        else:
            n += 1
        if b - a == 1:  # the usual run between two strings: one separator
            n += weight[body[a]]
        elif b > a:
            n += 4 * (count(b"[", a, b) + count(b"{", a, b)) + count(b",", a, b) + count(b":", a, b)
        if n > limit:
            return True
    return False


_JSON_WEIGHT = [0] * 256
for _c, _w in ((b",", 1), (b":", 1), (b"[", 4), (b"{", 4)):
    _JSON_WEIGHT[_c[0]] = _w


class Response:
    __slots__ = ("status", "body", "content_type", "headers")

    def __init__(self, status: int = 200, body: Union[bytes, str] = b"",
                 content_type: str = "application/json; charset=utf-8",
                 headers: Optional[list[tuple[str, str]]] = None) -> None:
        self.status = status
        self.body = body.encode("utf-8") if isinstance(body, str) else body
        self.content_type = content_type
        self.headers = headers

    def __repr__(self) -> str:
        return f"<Response {self.status} {len(self.body)} bytes>"


class StreamResponse:
    """A body produced piece by piece (SSE): sent chunked, each chunk flushed as it comes."""

    __slots__ = ("chunks", "content_type", "headers", "status", "ping_interval")

    def __init__(self, chunks: AsyncIterator[bytes], content_type: str = "text/event-stream",
                 headers: Optional[list[tuple[str, str]]] = None, status: int = 200,
                 ping_interval: Optional[float] = None) -> None:
        """`ping_interval`: seconds of silence before an SSE comment is sent (<= 0: never), for
        this stream; None: the server's --sse-ping-interval."""
        self.chunks = chunks
        self.content_type = content_type
        self.headers = headers
        self.status = status
        self.ping_interval = ping_interval


Handler = Callable[[Request], Awaitable[Union[Response, StreamResponse]]]


def json_bytes(obj: Any) -> bytes:
    """obj as UTF-8 JSON. A float JSON cannot hold (an infinity, NaN) is written as null, as
    llama-server's encoder writes it: "-Infinity" would make strict parsers (browsers, Go, serde)
    reject the whole response."""
    try:
        text = ujson.dumps(obj, ensure_ascii=False, escape_forward_slashes=False, allow_nan=False)
    except OverflowError:  # rare: walk the object only then
        text = ujson.dumps(_finite(obj), ensure_ascii=False, escape_forward_slashes=False, allow_nan=False)
    return text.encode("utf-8")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(status, json_bytes(obj))


def error_response(status: int, message: str, type: str = "invalid_request_error",
                   extra: Optional[dict] = None) -> Response:
    return json_response({"error": {"code": status, "message": message, "type": type, **(extra or {})}}, status)


def sse_event(obj: Any) -> bytes:
    return b"data: " + json_bytes(obj) + b"\n\n"


def sse_named_event(name: str, obj: Any) -> bytes:
    """An event with its name (`event:` line), as Anthropic's and OpenAI's Responses streams send them."""
    return b"event: " + name.encode() + b"\ndata: " + json_bytes(obj) + b"\n\n"


# ---------------------------------------------------------------------------------------------
# response serialization

_STATUS_LINES: dict[int, bytes] = {
    s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode("latin-1")) for s in http.HTTPStatus
}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d Unknown\r\n" % status
    return line


def _extra_headers(headers: list[tuple[str, str]]) -> bytes:
    text = "".join(f"{k}: {v}\r\n" for k, v in headers)
    # A handler echoing client input into a header must not be able to split the response.
    if text.count("\n") != len(headers) or text.count("\r") != len(headers):
        raise ValueError("response header contains a line break")
    return text.encode("latin-1")


# llama-server's answer to a missing or wrong API key
INVALID_API_KEY = (401, "Invalid API Key", "authentication_error")
# answered without an API key: probes and the static page
PUBLIC_PATHS = frozenset(("/health", "/v1/health", "/"))
# http(s)://localhost, 127.0.0.1 or [::1], any port: the origins a browser page served by this
# machine has; the only ones allowed cross-origin unless more are configured
_LOCAL_ORIGIN = re.compile(r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?")


def api_key_valid(req: Request, keys: Sequence[str]) -> bool:
    """Whether `Authorization: Bearer <key>` or `X-Api-Key: <key>` names one of `keys`. Every key
    is compared in constant time, and all of them always, so timing tells nothing of a key."""
    return _key_in_headers(req.headers, keys)


def _key_in_headers(headers: dict[str, str], keys: Sequence[str]) -> bool:
    given = []
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        given.append(auth[7:].strip())
    xkey = headers.get("x-api-key")
    if xkey is not None:
        given.append(xkey.strip())
    ok = False
    for g in given:
        gb = g.encode("latin-1", "replace")  # the header's bytes as sent (headers are decoded as latin-1)
        for k in keys:
            ok |= hmac.compare_digest(gb, k.encode("utf-8"))
    return ok


def loopback_host_name(value: str, bound: str = "") -> bool:
    """Whether a Host header names this machine by a loopback name (localhost, 127.x.x.x,
    [::1], any port) or by the address the server is bound to. A page on a rebound DNS name
    sends that name, which is never one of these."""
    v = value.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        if end < 0 or v[end + 1:] and not (v[end + 1] == ":" and v[end + 2:].isdigit()):
            return False
        name = v[:end + 1]
    else:
        name, sep, port = v.rpartition(":")
        if not sep:
            name = v
        elif not port.isdigit():
            return False
    name = name.rstrip(".")
    if name in ("localhost", "[::1]") or bound and name in (bound, f"[{bound}]"):
        return True
    try:
        return ipaddress.IPv4Address(name).is_loopback
    except ValueError:
        return False


def origin_allowed(origin: str, allowed: Sequence[str]) -> bool:
    """A browser Origin against the configured list: '*' allows all, an empty list only local pages."""
    if not origin:
        return False
    if _LOCAL_ORIGIN.fullmatch(origin):
        return True
    return any(a == "*" or a.rstrip("/") == origin for a in allowed)


_CONN_CLOSE = b"Connection: close\r\n"
_CONN_KEEP = b"Connection: keep-alive\r\n"
# events reach the client as they are written, not when a proxy (nginx) has filled its buffer
# chunks a stream writes without waiting before it lets the event loop run (see _write_stream)
_YIELD_EVERY = 16
_NO_PROXY_BUFFERING = b"X-Accel-Buffering: no\r\n"
_NO_BODY_STATUS = frozenset((204, 304))
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _Reject(Exception):
    """Raised inside parser callbacks to stop parsing and answer with an error, then close."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", extra: bytes = b"") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.extra = extra  # more header lines of the answer (CORS)


class _WriteStalled(Exception):
    pass


_BAD_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")


def _split_target(url: bytes) -> tuple[str, dict[str, str]]:
    """Request target -> (decoded path, query dict); HTTPError(400) on bad encoding."""
    if b"#" in url:  # clients should not send fragments; ignore one if they do
        url = url.partition(b"#")[0]
    if url[:1] != b"/":
        if url == b"*":
            return "*", {}
        try:  # absolute-form, as sent to proxies
            parsed = httptools.parse_url(url)
        except httptools.HttpParserInvalidURLError:
            raise HTTPError(400, "Invalid request target") from None
        raw_path = parsed.path or b"/"
        raw_query = parsed.query or b""
    else:
        raw_path, _, raw_query = url.partition(b"?")
    try:
        path = raw_path.decode("utf-8")
        if "%" in path:
            if _BAD_PERCENT.search(path):
                raise HTTPError(400, "Invalid percent-encoding in the path")
            path = unquote(path, errors="strict")
    except UnicodeDecodeError:
        raise HTTPError(400, "Invalid UTF-8 in the path") from None
    if not raw_query:
        return path, {}
    try:
        qs = raw_query.decode("utf-8")
        if "%" in qs and _BAD_PERCENT.search(qs):
            raise HTTPError(400, "Invalid percent-encoding in the query string")
        return path, dict(parse_qsl(qs, keep_blank_values=True, errors="strict", max_num_fields=1000))
    except UnicodeDecodeError:
        raise HTTPError(400, "Invalid UTF-8 in the query string") from None
    except ValueError as exc:  # too many fields
        raise HTTPError(400, f"Invalid query string: {exc}") from None


# ---------------------------------------------------------------------------------------------
# the connection protocol

class _Connection(asyncio.Protocol):
    __slots__ = (
        "_srv", "_loop", "_parser", "_transport", "_peer", "_queue", "_task", "_closed", "_discard",
        "_url", "_headers", "_body", "_body_size", "_hdr_bytes", "_hdr_raw", "_body_raw", "_in_headers",
        "_in_body", "_deadline", "_write_paused", "_drain_waiter", "_read_paused", "_reject",
        "_counted", "_n_requests", "_queued_bytes", "_held", "_feeding", "_n_chunks", "_ping_handle", "_ping_interval",
        "_last_chunk", "_running_bytes", "_buffered",
    )

    def __init__(self, srv: "HTTPServer") -> None:
        self._srv = srv
        self._loop = srv._loop
        self._parser = httptools.HttpRequestParser(self)
        self._transport: Optional[asyncio.Transport] = None
        self._peer = ""
        # (Request, keep_alive, http10) or (None, rendered error response, keep_alive)
        self._queue: collections.deque = collections.deque()
        self._task: Optional[asyncio.Task] = None
        self._closed = False
        self._discard = False  # a final error is decided: input is read and thrown away
        self._url = b""
        self._headers: dict[str, str] = {}
        # bytes while one piece has come, a bytearray after that: a body sent in many tiny chunks
        # must not cost a Python object per chunk
        self._body: Union[bytes, bytearray] = b""
        self._body_size = 0
        self._hdr_bytes = 0
        self._hdr_raw = 0
        self._body_raw = 0  # bytes on the wire while in the body, framing included
        self._n_chunks = 0
        self._in_headers = False
        self._in_body = False
        # Sweep closes the connection when no handler runs and loop.time() passed this (0 = never).
        self._deadline = 0.0
        self._write_paused = False
        self._drain_waiter: Optional[asyncio.Future] = None
        self._ping_handle: Optional[asyncio.TimerHandle] = None  # an event stream's idle ping (_ping)
        self._last_chunk = 0.0
        self._ping_interval = 0.0  # the current stream's (its own, else the server's)
        self._read_paused = False
        self._reject: Optional[_Reject] = None
        self._counted = False
        self._n_requests = 0  # requests begun on this connection
        self._queued_bytes = 0  # body bytes of the requests in _queue
        self._running_bytes = 0  # body bytes of the request its handler has
        self._buffered = 0  # what this connection counts in the server's buffered body bytes (_account)
        # input not yet parsed because enough requests wait; reading is paused while it is held
        self._held: Optional[Union[bytes, memoryview]] = None
        self._feeding = False

    # --- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        srv = self._srv
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self._peer = f"{peer[0]}:{peer[1]}"
        elif peer:
            self._peer = str(peer)
        if not srv._closing and len(srv._conns) >= srv._max_connections and srv._idle:
            # An idle keep-alive connection owes nothing and may be closed at any time (a client
            # reconnects): the one idle the longest gives way, so that idle sockets cannot lock
            # new clients out for a whole --timeout.
            victim = next(iter(srv._idle))
            log.debug("closing idle connection from %s to admit %s (--max-connections %d)",
                      victim._peer, self._peer, srv._max_connections)
            victim._close()
        if srv._closing or len(srv._conns) >= srv._max_connections:
            if len(srv._rejected) >= srv._max_connections:  # a flood: no courtesy answer
                self._closed = self._discard = True
                transport.abort()
                return
            srv._rejected.add(self)
            if not srv._closing:
                srv._n_refused += 1
                now = self._loop.time()
                if now - srv._refused_logged > 10.0:  # one line per 10 s, not one per connection
                    srv._refused_logged = now
                    log.warning("refused %d connection(s) with 503: %d open (limit %d)",
                                srv._n_refused, len(srv._conns), srv._max_connections)
                    srv._n_refused = 0
            self._end_with(srv._render_error(503, "Too many connections, try again later",
                                             "unavailable_error", False))
            return
        srv._conns.add(self)
        self._counted = True
        # The first request's headers are due within the header timeout of connecting: an idle
        # new connection must not hold one of --max-connections for a whole keep-alive timeout.
        self._deadline = self._loop.time() + srv._header_timeout

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._closed = True
        srv = self._srv
        self._uncount()
        srv._rejected.discard(self)
        self._queue.clear()
        self._queued_bytes = 0
        self._in_body = False
        self._account()  # (a running handler's body counts until it ends)
        self._held = None
        if self._task is not None:
            # The handler's finally blocks run (generation gets cancelled); a stream's iterator
            # is closed by _write_stream.
            self._task.cancel()
        w = self._drain_waiter
        if w is not None and not w.done():
            w.set_exception(ConnectionResetError("client went away"))
        self._drain_waiter = None

    def eof_received(self) -> Optional[bool]:
        # A FIN from an HTTP client means it is gone (no HTTP client half-closes to wait for an
        # answer); treating it as a disconnect cancels generation without waiting for a write
        # to fail. Returning None lets the transport close itself.
        return None

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        w = self._drain_waiter
        if w is not None and not w.done():
            w.set_result(None)
        self._drain_waiter = None
        if self._task is None and self._queue and not self._closed:
            self._dispatch()

    def data_received(self, data: bytes) -> None:
        if self._discard:
            return
        if self._held is not None:  # arrived after reading paused: keep it behind what is held
            self._held = bytes(self._held) + data
            return
        self._feed(data)

    def _feed(self, data: Union[bytes, memoryview]) -> None:
        """Parse `data` a slice at a time; once enough requests wait, hold the rest unparsed and
        pause reading until the queue drains (see _dispatch)."""
        self._feeding = True
        try:
            while data and not self._discard:
                if self._queue and self._backlogged():
                    self._held = data
                    if not self._read_paused:
                        self._read_paused = True
                        self._transport.pause_reading()
                    return
                if len(data) <= _FEED_SLICE:  # the usual packet: parsed as it is
                    used = self._feed_slice(data)
                else:
                    if not isinstance(data, memoryview):
                        data = memoryview(data)  # slices without copies
                    used = self._feed_slice(data[:_FEED_SLICE])
                data = data[used:]
        finally:
            self._feeding = False

    def _feed_slice(self, piece: Union[bytes, memoryview]) -> int:
        """Feed one slice to the parser; returns how many of its bytes were consumed."""
        was_in_headers = self._in_headers
        was_in_body = self._in_body
        try:
            self._parser.feed_data(piece)
        except httptools.HttpParserUpgrade as exc:
            # No upgrades are supported: the request was queued as an ordinary one; what follows
            # it is parsed as the next request (by the caller's loop: no recursion per request).
            off = exc.args[0] if exc.args and isinstance(exc.args[0], int) else len(piece)
            return off if 0 < off <= len(piece) else len(piece)
        except httptools.HttpParserError as exc:
            rej = self._reject
            self._reject = None
            if rej is None:
                rej = _Reject(400, f"Malformed HTTP request: {exc}")
                log.debug("malformed request from %s: %s", self._peer, exc)
            self._fail(rej)
            return len(piece)
        srv = self._srv
        if self._in_headers and was_in_headers:
            # httptools buffers an unfinished header line without calling us; count raw bytes so
            # one endless header cannot grow memory without bound. A slice that starts and ends
            # inside the headers is all header bytes, so this never overcounts.
            self._hdr_raw += len(piece)
            if self._hdr_raw > srv._max_header_bytes:
                self._fail(_Reject(431, "Request header fields too large"))
        elif self._in_body and was_in_body:
            self._body_raw += len(piece)
            if self._body_raw > srv._max_body_wire:
                self._fail(_Reject(413, f"Request body too large: over {srv._max_body_wire} bytes of chunked "
                                        f"framing for a limit of {srv._max_body} bytes"))
        return len(piece)

    def _backlogged(self) -> bool:
        q = self._queue
        return bool(q) and (len(q) >= self._srv._max_pipelined or self._queued_bytes >= self._srv._max_body)

    def _resume_input(self) -> None:
        """Parse the input held back, then read again unless the queue filled up once more."""
        held, self._held = self._held, None
        if held is not None:
            self._feed(held)
        if self._held is None and self._read_paused and not self._closed:
            self._read_paused = False
            self._transport.resume_reading()

    # --- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._srv._idle.pop(self, None)
        self._in_headers = True
        self._url = b""
        self._headers = {}
        self._body = b""
        self._body_size = 0
        self._hdr_bytes = 0
        self._hdr_raw = 0
        self._body_raw = 0
        self._n_chunks = 0
        if self._n_requests:  # the first request's deadline runs from connecting
            self._deadline = self._loop.time() + self._srv._header_timeout
        self._n_requests += 1

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._hdr_bytes += len(url)
        if self._hdr_bytes > self._srv._max_header_bytes:
            self._raise(_Reject(431, "Request header fields too large"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._hdr_bytes += len(name) + len(value) + 4
        if self._hdr_bytes > self._srv._max_header_bytes:
            self._raise(_Reject(431, "Request header fields too large"))
        key = name.decode("latin-1").lower()
        headers = self._headers
        if key in headers:
            headers[key] += ", " + value.decode("latin-1")
        else:
            headers[key] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._in_body = True
        srv = self._srv
        version = self._parser.get_http_version()
        if version not in ("1.1", "1.0"):
            # llhttp accepts 0.9 and 2.0 request lines; neither can be answered in HTTP/1.1 terms.
            self._raise(_Reject(400, f"HTTP version {version} is not supported: use HTTP/1.1 or HTTP/1.0"))
        keys = srv._access.api_keys
        if keys and srv._needs_key(self._parser.get_method(), self._url) and not _key_in_headers(self._headers, keys):
            # Decided from the headers: a client without a key gets no 100 Continue, none of its
            # body is buffered, and the connection ends, so that it holds neither memory nor one
            # of --max-connections.
            self._raise(_Reject(*INVALID_API_KEY, extra=srv._cors(SimpleNamespace(headers=self._headers))))
        host = self._headers.get("host")
        if srv._check_host and host is not None and not keys and not loopback_host_name(host, srv._bound_host):
            # DNS rebinding: a web page whose name was made to resolve to 127.0.0.1 would reach a
            # keyless server on loopback as a same-origin page, and read its answers.
            self._raise(_Reject(421, f"Host {host[:100]!r} is not a name of this server: without an API key a "
                                     "server on a loopback address answers only the names localhost, 127.x.x.x and "
                                     "[::1] (start it with --allow-any-host to answer any)"))
        cl = self._headers.get("content-length")
        if cl is not None:
            try:
                n = int(cl)
            except ValueError:
                self._raise(_Reject(400, "Invalid Content-Length"))
            if n > srv._max_body:
                self._raise(_Reject(413, f"Request body too large: {n} bytes, the limit is {srv._max_body}"))
            if n > srv._max_buffered - srv._buffered:
                self._raise(srv._buffers_full())
        if self._parser.should_upgrade() and (cl not in (None, "0") or "transfer-encoding" in self._headers):
            # llhttp hands what follows an upgrade request's headers back as the next request, so
            # its body would be parsed as a request that a proxy in front never saw.
            self._raise(_Reject(400, "Upgrade is not supported, and a request asking for one must not have a body"))
        self._deadline = self._loop.time() + srv._body_timeout
        expect = self._headers.get("expect")
        if expect is not None and expect.lower() == "100-continue" and self._task is None and not self._queue:
            # Only when nothing is in flight: interim responses must not overtake earlier answers.
            self._transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        srv = self._srv
        n = len(body)
        self._body_size += n
        if self._body_size > srv._max_body:
            self._raise(_Reject(413, f"Request body too large: the limit is {srv._max_body} bytes"))
        if srv._buffered + n > srv._max_buffered:
            self._raise(srv._buffers_full())
        self._buffered += n  # as _account() would count it, without the call
        srv._buffered += n
        if not self._body:
            self._body = body
        else:
            if not isinstance(self._body, bytearray):
                self._body = bytearray(self._body)
            self._body += body

    def on_chunk_header(self) -> None:
        self._n_chunks += 1
        if self._n_chunks > self._srv._max_chunks:
            self._raise(_Reject(413, f"Request body in too many chunks: at most {self._srv._max_chunks} are accepted"))

    def on_message_complete(self) -> None:
        self._in_body = False
        if self._closed:  # more pipelined requests after one that closes the connection
            return
        p = self._parser
        body = self._body
        if isinstance(body, bytearray):
            body = bytes(body)
        self._body = b""
        keep_alive = p.should_keep_alive()
        http10 = p.get_http_version() == "1.0"
        try:
            path, query = _split_target(self._url)
        except HTTPError as exc:
            self._queue.append((None, self._srv._render_error(exc.status, exc.message, exc.type, keep_alive),
                                keep_alive))
        else:
            self._queue.append((Request(p.get_method().decode("ascii"), path, query, self._headers, body,
                                        self._peer), keep_alive, http10))
            self._queued_bytes += len(body)
        self._account()
        self._headers = {}
        if self._task is None:
            self._dispatch()

    # --- request processing -----------------------------------------------------------------

    def _raise(self, rej: _Reject) -> None:
        # httptools reports a callback exception as a generic parser error; keep the real one.
        self._reject = rej
        raise rej

    def _dispatch(self) -> None:
        """Start the next queued request; answers that need no handler are written right away."""
        srv = self._srv
        queue = self._queue
        while self._task is None and queue and not self._closed and not self._write_paused:
            item = queue.popleft()
            req = item[0]
            if req is None:  # an error decided while parsing
                if item[2] and not srv._closing:
                    self._transport.write(item[1])
                    continue
                self._end_with(item[1])
                return
            self._queued_bytes -= len(req.body)
            self._account()
            keep_alive = item[1] and not srv._closing
            handler, head_only, resp = srv._resolve(req)
            extra = srv._cors(req)
            if handler is None:
                keep_alive = keep_alive and resp.status != 401
                self._write_response(resp, keep_alive, item[2], head_only, extra)
                if not keep_alive:
                    self._close()
                    return
                continue
            self._running_bytes = len(req.body)
            self._account()
            self._task = self._loop.create_task(self._run(handler, req, keep_alive, item[2], head_only, extra))
            return
        if self._closed:
            return
        if (self._held is not None or self._read_paused) and not self._feeding and not self._backlogged():
            self._resume_input()
            if self._closed:
                return
        if self._task is None:
            if srv._closing and not queue:
                self._close()
            elif not queue and not self._in_headers and not self._in_body:
                self._deadline = self._loop.time() + srv._keepalive_timeout
                srv._idle.pop(self, None)  # (re)entered last: the order is that of idleness
                srv._idle[self] = None
            elif queue:  # waiting for the client to read what we wrote
                self._deadline = self._loop.time() + srv._keepalive_timeout

    async def _run(self, handler: Handler, req: Request, keep_alive: bool, http10: bool, head_only: bool,
                   extra: bytes = b"") -> None:
        try:
            try:
                resp = await handler(req)
            except HTTPError as exc:
                resp = error_response(exc.status, exc.message, exc.type, exc.extra)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("handler for %s %s failed", req.method, req.path)
                resp = error_response(500, str(exc) or type(exc).__name__, "server_error")
            if self._closed:
                if isinstance(resp, StreamResponse):
                    await _aclose(resp.chunks)
                return
            keep_alive = keep_alive and not self._srv._closing
            if isinstance(resp, StreamResponse):
                keep_alive = await self._write_stream(resp, keep_alive, http10, head_only, extra)
            elif isinstance(resp, Response):
                try:
                    self._write_response(resp, keep_alive, http10, head_only, extra)
                except ValueError as exc:
                    log.error("bad response from handler for %s %s: %s", req.method, req.path, exc)
                    self._write_response(error_response(500, str(exc), "server_error"), keep_alive, http10, head_only,
                                         extra)
            else:
                log.error("handler for %s %s returned %r, not a Response", req.method, req.path, type(resp))
                self._write_response(error_response(500, "handler returned no response", "server_error"),
                                     keep_alive, http10, head_only, extra)
        except asyncio.CancelledError:
            if not self._closed:  # cancelled by shutdown, not by the client: nothing more to say
                keep_alive = False
        except _WriteStalled:
            log.info("closing connection from %s: the client stopped reading", self._peer)
            keep_alive = False
            self._abort()
        except ConnectionError:
            keep_alive = False
        except Exception:  # a bug of ours or a response that cannot be serialized
            log.exception("answering %s %s failed", req.method, req.path)
            keep_alive = False
            self._abort()
        finally:
            self._task = None
            self._running_bytes = 0
            self._account()
        if self._closed:
            return
        if not keep_alive:
            self._close()
        else:
            self._dispatch()

    def _write_response(self, resp: Response, keep_alive: bool, http10: bool, head_only: bool,
                        extra: bytes = b"") -> None:
        status = resp.status
        body = resp.body
        parts = [_status_line(status), self._srv._prefix, extra]
        if status in _NO_BODY_STATUS:
            body = b""
        else:
            parts.append(b"Content-Type: %b\r\nContent-Length: %d\r\n"
                         % (resp.content_type.encode("latin-1"), len(body)))
        if not keep_alive:
            parts.append(_CONN_CLOSE)
        elif http10:
            parts.append(_CONN_KEEP)
        if resp.headers:
            parts.append(_extra_headers(resp.headers))
        parts.append(b"\r\n")
        if head_only or not body:
            self._transport.write(b"".join(parts))
        elif len(body) < 65536:
            parts.append(body)
            self._transport.write(b"".join(parts))
        else:  # large bodies go out without another copy
            self._transport.writelines((b"".join(parts), body))

    async def _write_stream(self, resp: StreamResponse, keep_alive: bool, http10: bool, head_only: bool,
                            extra: bytes = b"") -> bool:
        """Write a chunked response; returns whether the connection may serve another request."""
        chunks = resp.chunks
        chunked = not http10
        if not chunked:
            keep_alive = False  # an HTTP/1.0 body without a length ends when the connection does
        t = self._transport
        try:
            parts = [_status_line(resp.status), self._srv._prefix, extra,
                     b"Content-Type: %b\r\n" % resp.content_type.encode("latin-1")]
            if chunked:
                parts.append(b"Transfer-Encoding: chunked\r\n")
            if resp.content_type.startswith("text/event-stream"):
                parts.append(_NO_PROXY_BUFFERING)
            if not keep_alive:
                parts.append(_CONN_CLOSE)
            if resp.headers:
                parts.append(_extra_headers(resp.headers))
            parts.append(b"\r\n")
            t.write(b"".join(parts))
            if head_only:
                return keep_alive
            interval = self._srv._sse_ping if resp.ping_interval is None else resp.ping_interval
            if interval > 0 and resp.content_type.startswith("text/event-stream"):
                self._last_chunk = self._loop.time()
                self._ping_interval = interval
                self._ping_handle = self._loop.call_later(interval, self._ping, chunked)
            try:
                unpaused = 0
                async for chunk in chunks:
                    if not chunk:
                        continue  # an empty chunk would end the chunked body
                    if isinstance(chunk, str):
                        chunk = chunk.encode("utf-8")
                    # a failed write closes the transport at once, but connection_lost (which sets
                    # _closed) only runs when the loop gets control
                    if self._closed or t.is_closing():
                        return False
                    t.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
                    self._last_chunk = self._loop.time()
                    if self._write_paused:
                        unpaused = 0
                        await self._drain()
                    else:
                        unpaused += 1
                        if unpaused % _YIELD_EVERY == 0:
                            # a producer that never awaits would otherwise hold the loop: no other
                            # connection served, no disconnect seen
                            await asyncio.sleep(0)
            except asyncio.CancelledError:
                if self._srv._closing and not self._closed and resp.content_type.startswith("text/event-stream"):
                    # cut by shutdown: say so, and end the body properly, so that a client can tell
                    # this from a crash
                    ev = sse_event({"error": {"code": 503, "message": "the server is shutting down",
                                              "type": "unavailable_error"}})
                    t.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(ev), ev) if chunked else ev)
                raise
            except (_WriteStalled, ConnectionError):
                raise
            except Exception:
                # The status line is gone already: the only honest signal left is to cut the
                # body short, which a chunked reader sees as an incomplete response.
                log.exception("stream for %s failed mid-response", self._peer)
                return False
            if chunked and not self._closed:
                t.write(b"0\r\n\r\n")
            return keep_alive
        finally:
            if self._ping_handle is not None:
                self._ping_handle.cancel()
                self._ping_handle = None
            await _aclose(chunks)

    def _ping(self, chunked: bool) -> None:
        """An SSE comment when the stream has been idle for the interval (a long prompt, a slow
        first token), as llama-server sends them, so that proxies and clients do not time it out.
        Runs between the stream's writes, which are whole chunks, on the event loop."""
        self._ping_handle = None
        if self._closed:
            return
        now, interval = self._loop.time(), self._ping_interval
        if now - self._last_chunk >= interval * 0.999 and not self._write_paused:
            self._transport.write(b"3\r\n:\n\n\r\n" if chunked else _SSE_PING)
            self._last_chunk = now
        self._ping_handle = self._loop.call_later(max(0.0, self._last_chunk + interval - now), self._ping, chunked)

    async def _drain(self) -> None:
        if self._closed:
            raise ConnectionResetError("client went away")
        fut = self._loop.create_future()
        self._drain_waiter = fut
        handle = self._loop.call_later(self._srv._keepalive_timeout, _stall, fut)
        try:
            await fut
        finally:
            handle.cancel()

    # --- closing ------------------------------------------------------------------------------

    def _fail(self, rej: _Reject) -> None:
        """Stop parsing; answer `rej` after the answers already owed, then close."""
        self._discard = True
        self._in_headers = self._in_body = False
        self._body = b""
        self._account()
        self._held = None
        if self._read_paused:  # reading must go on to drain the upload while we linger
            self._read_paused = False
            self._transport.resume_reading()
        self._queue.append((None, self._srv._render_error(rej.status, rej.message, rej.type, False, rej.extra), False))
        if self._task is None:
            self._dispatch()

    def _account(self) -> None:
        """Bring the server's count of buffered body bytes up to date with this connection's: the
        body being received, those of the queued requests, and the one its handler has."""
        now = (self._body_size if self._in_body else 0) + self._queued_bytes + self._running_bytes
        if now != self._buffered:
            self._srv._buffered += now - self._buffered
            self._buffered = now

    def _uncount(self) -> None:
        """A connection that serves no more requests leaves --max-connections' count and the idle
        list (one still closing is kept among the rejected ones, which the sweep aborts)."""
        srv = self._srv
        srv._idle.pop(self, None)
        if self._counted:
            self._counted = False
            srv._conns.discard(self)

    def _end_with(self, data: bytes) -> None:
        """Write a final answer, half-close, and linger reading until the client closes too."""
        t = self._transport
        self._discard = True
        self._closed = True
        self._uncount()
        self._srv._rejected.add(self)
        self._queue.clear()
        self._queued_bytes = 0
        self._in_body = False
        self._body = b""
        self._account()
        t.write(data)
        try:
            t.write_eof()
        except (NotImplementedError, RuntimeError):
            t.close()
            return
        self._deadline = self._loop.time() + _LINGER_S

    def _close(self) -> None:
        """Close after what is buffered is sent; the sweep aborts it if that takes too long."""
        if not self._closed and self._transport is not None:
            self._discard = True
            self._closed = True
            self._uncount()
            self._srv._rejected.add(self)  # swept (aborted) if the close does not complete in time
            self._deadline = self._loop.time() + self._srv._keepalive_timeout
            self._transport.close()

    def _abort(self) -> None:
        self._discard = True
        self._closed = True
        if self._transport is not None:
            self._transport.abort()


def _stall(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(_WriteStalled())


async def _aclose(chunks: Any) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:
        log.exception("closing a response stream failed")


# ---------------------------------------------------------------------------------------------
# the server

class HTTPServer:
    def __init__(self, routes: dict[tuple[str, str], Handler], *, max_body: int = 16 << 20,
                 max_header_bytes: int = 64 << 10, keepalive_timeout: float = 60.0,
                 header_timeout: float = 10.0, body_timeout: float = 60.0, max_connections: int = 1024,
                 max_pipelined: int = 8, cors_origins: Optional[Sequence[str]] = ("*",),
                 api_keys: Sequence[str] = (), public_paths: Collection[str] = PUBLIC_PATHS,
                 access: Any = None, sse_ping_interval: float = 30.0, api_prefix: str = "",
                 allow_any_host: bool = True, max_buffered: int = 0) -> None:
        """`cors_origins`: browser origins answered with Access-Control-Allow-Origin (local pages
        always; '*' any), None for no CORS headers at all. `api_keys`: when any, every path but
        `public_paths` (and CORS preflights) needs one. `access`: an object whose `api_keys` and
        `cors_origins` attributes are read at each request instead (the server's settings).
        `sse_ping_interval`: an event stream idle this many seconds gets an SSE comment (<= 0: never).
        `api_prefix` ("/a/b" or ""): every route is served under it, and only there.
        `max_buffered`: the request body bytes held at once across all connections, bodies being
        received, queued and handled (0: 4 times `max_body`, at least 64 MiB); a body beyond it is
        a 503.
        `allow_any_host`: False refuses (421) requests whose Host is not a loopback name while the
        server listens on a loopback address and has no API key (DNS rebinding)."""
        self._paths: dict[str, dict[str, Handler]] = {}
        for (method, path), handler in routes.items():
            self._paths.setdefault(path, {})[method.upper()] = handler
        self._allow: dict[str, str] = {}
        for path, methods in self._paths.items():
            names = set(methods) | {"OPTIONS"}
            if "GET" in names:
                names.add("HEAD")
            self._allow[path] = ", ".join(sorted(names))
        self._max_body = max_body
        self._max_buffered = max_buffered or max(4 * max_body, 64 << 20)
        self._buffered = 0
        self._max_body_wire = 2 * max_body + _FRAMING_ALLOWANCE
        self._max_chunks = max(_MIN_MAX_CHUNKS, max_body // _MIN_AVG_CHUNK)
        self._max_header_bytes = max_header_bytes
        self._keepalive_timeout = keepalive_timeout
        self._sse_ping = sse_ping_interval
        self._api_prefix = api_prefix
        self._header_timeout = header_timeout
        self._body_timeout = body_timeout
        self._max_connections = max_connections
        self._max_pipelined = max_pipelined
        self._access = access if access is not None else SimpleNamespace(api_keys=list(api_keys),
                                                                         cors_origins=cors_origins)
        self._public = frozenset(public_paths)
        self._allow_any_host = allow_any_host
        self._check_host = False  # set by start(): the address must be a loopback one
        self._bound_host = ""
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._server: Optional[asyncio.AbstractServer] = None
        self._conns: set[_Connection] = set()
        # connections that serve no more requests but are still closing (refused, answered for
        # the last time, lingering): not counted against max_connections; the sweep aborts them
        self._rejected: set[_Connection] = set()
        # idle keep-alive connections, the longest idle first (a dict keeps insertion order)
        self._idle: dict[_Connection, None] = {}
        self._closing = False
        self._stopped: Optional[asyncio.Event] = None
        self._n_refused = 0
        self._refused_logged = 0.0
        self._sweep_handle: Optional[asyncio.TimerHandle] = None
        self._date = ""
        self._prefix = b""
        self._update_date()

    @property
    def n_connections(self) -> int:
        return len(self._conns)

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Listen on host:port (0 = any free port); returns the port bound. reuse_port: SO_REUSEPORT,
        so that other servers that set it too may listen on the same port (the kernel spreads the
        connections over them)."""
        self._loop = asyncio.get_running_loop()
        self._check_host = not self._allow_any_host and is_loopback_address(host)
        self._bound_host = host.strip("[]").lower()
        self._server = await self._loop.create_server(
            lambda: _Connection(self), host, port, reuse_address=True, reuse_port=reuse_port or None,
            backlog=max(128, min(self._max_connections, 4096)))
        bound = self._server.sockets[0].getsockname()[1]
        interval = min(self._header_timeout, self._body_timeout, self._keepalive_timeout) / 4.0
        self._sweep_interval = min(1.0, max(0.02, interval))
        self._sweep_handle = self._loop.call_later(self._sweep_interval, self._sweep)
        log.debug("HTTP socket bound to %s:%d", host, bound)  # the program says "listening on" once it serves
        return bound

    async def shutdown(self, grace: float = 10.0) -> None:
        """Stop accepting, close idle connections, let running handlers finish for up to `grace`
        seconds, cancel the rest, close every socket."""
        if self._closing:
            if self._stopped is not None:  # a second caller waits for the first one's work (itself bounded)
                try:
                    await asyncio.wait_for(self._stopped.wait(), grace + _SHUTDOWN_SLACK_S)
                except asyncio.TimeoutError:
                    log.warning("shutdown: still closing connections after %.1f s", grace + _SHUTDOWN_SLACK_S)
            return
        self._closing = True
        self._stopped = asyncio.Event()
        try:
            await self._shutdown(grace)
        finally:
            self._stopped.set()

    async def _shutdown(self, grace: float) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):
            if c._task is None:
                c._close()
        for c in list(self._rejected):
            c._abort()
        tasks = [c._task for c in self._conns if c._task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace)
            if pending:
                log.warning("shutdown: cancelling %d request(s) still running after %.1f s", len(pending), grace)
                for t in pending:
                    t.cancel()
                await asyncio.wait(pending, timeout=2.0)
        for c in list(self._conns):
            c._close()
        # close() flushes what is buffered; a client that does not read gets a short while.
        for _ in range(50):
            if not self._conns:
                break
            await asyncio.sleep(0.02)
        for c in list(self._conns) + list(self._rejected):
            c._abort()
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()
            self._sweep_handle = None
        await asyncio.sleep(0)  # let the listening socket's close complete
        log.info("HTTP server stopped")

    # --- internals --------------------------------------------------------------------------

    def _update_date(self) -> None:
        date = formatdate(usegmt=True)
        if date == self._date:
            return
        self._date = date
        self._prefix = b"Server: pyllama\r\nDate: " + date.encode("ascii") + b"\r\n"

    def _cors(self, req: Request) -> bytes:
        """The CORS headers of the answer to `req`: its Origin reflected when allowed (a client
        that sends none gets '*' only where every origin is allowed)."""
        allowed = self._access.cors_origins
        if allowed is None:
            return b""
        origin = req.headers.get("origin", "")
        if origin and origin_allowed(origin, allowed) and "\r" not in origin and "\n" not in origin:
            credentials = b"Access-Control-Allow-Credentials: true\r\n" \
                if getattr(self._access, "cors_credentials", True) else b""
            return (b"Access-Control-Allow-Origin: " + origin.encode("latin-1", "replace") + b"\r\n"
                    + credentials + b"Vary: Origin\r\n")
        if "*" in allowed:
            return b"Access-Control-Allow-Origin: *\r\nVary: Origin\r\n"
        return b"Vary: Origin\r\n" if origin else b""

    def _sweep(self) -> None:
        now = self._loop.time()
        self._update_date()
        for group in (self._conns, self._rejected):
            expired = [c for c in group if c._task is None and 0.0 < c._deadline < now]
            for c in expired:
                if c._in_headers:
                    log.debug("closing connection from %s: headers not complete within %.1f s",
                              c._peer, self._header_timeout)
                if c._discard:
                    c._abort()
                elif c._in_body and not c._read_paused:
                    # The request is known by now: say why it ends (reading is paused only while
                    # answers are owed, and then the wait is ours, not the client's).
                    c._fail(_Reject(408, f"Request body not received within {self._body_timeout:g} s"))
                else:
                    c._close()
        self._sweep_handle = self._loop.call_later(self._sweep_interval, self._sweep)

    def _render_error(self, status: int, message: str, type: str, keep_alive: bool, extra: bytes = b"") -> bytes:
        body = ujson.dumps({"error": {"code": status, "message": message, "type": type}},
                           ensure_ascii=False, escape_forward_slashes=False).encode("utf-8")
        return b"".join((_status_line(status), self._prefix, extra,
                         b"Content-Type: application/json; charset=utf-8\r\nContent-Length: %d\r\n" % len(body),
                         b"" if keep_alive else _CONN_CLOSE, b"\r\n", body))

    def _buffers_full(self) -> _Reject:
        # A 503 rather than pausing the connection: the bodies that fill the buffers may come at a
        # client's pace for a whole --body-timeout, and a paused upload would wait on them unseen.
        return _Reject(503, f"The server holds {self._buffered} bytes of request bodies, its limit is "
                            f"{self._max_buffered} (--max-body-buffered): try again later", "unavailable_error")

    def _needs_key(self, method: bytes, url: bytes) -> bool:
        """Whether a request for `url` must carry an API key (when keys are set), as _resolve
        decides it, from the request line alone."""
        if method == b"OPTIONS":
            return False
        try:
            path, _ = _split_target(url)
        except HTTPError:
            return True  # answered 400 to those with a key, 401 to the others
        prefix = self._api_prefix
        if prefix:
            if not path.startswith(prefix + "/"):
                return False  # the prefix's redirect, or a 404
            path = path[len(prefix):]
        return path not in self._public

    def _resolve(self, req: Request) -> tuple[Optional[Handler], bool, Optional[Response]]:
        """(handler, head_only, None), or (None, head_only, response) when no handler is needed."""
        prefix = self._api_prefix
        if prefix:  # the routes answer under the prefix, which is taken off the path they see
            if req.path == prefix and req.method in ("GET", "HEAD"):
                # the pages' files are relative to the page: the prefix's page is its '/'
                return None, req.method == "HEAD", Response(308, b"", headers=[("Location", prefix + "/")])
            if not req.path.startswith(prefix + "/"):
                return None, req.method == "HEAD", error_response(404, "File Not Found", "not_found_error")
            req.path = req.path[len(prefix):]
        keys = self._access.api_keys
        if keys and req.method != "OPTIONS" and req.path not in self._public and not api_key_valid(req, keys):
            # (a browser's preflight carries no credentials: it is answered, the request itself is not)
            return None, req.method == "HEAD", error_response(*INVALID_API_KEY)
        path = req.path
        methods = self._paths.get(path)
        if methods is None:
            head, sep, _ = path.rpartition("/")
            path = head + "/*"
            methods = self._paths.get(path) if sep and head else None
        if methods is None:
            return None, req.method == "HEAD", error_response(404, "File Not Found", "not_found_error")
        handler = methods.get(req.method)
        if handler is not None:
            return handler, False, None
        if req.method == "HEAD" and "GET" in methods:
            return methods["GET"], True, None
        allow = self._allow[path]
        if req.method == "OPTIONS":  # a CORS preflight, answered 200 as llama-server does
            headers = [("Allow", allow)]
            if self._access.cors_origins is not None:
                methods, allowed_headers = (getattr(self._access, f, None) for f in ("cors_methods", "cors_headers"))
                headers.append(("Access-Control-Allow-Methods", ", ".join(methods) if methods else allow))
                # reflected by default: a '*' does not cover Authorization, which API key clients send
                headers.append(("Access-Control-Allow-Headers", ", ".join(allowed_headers) if allowed_headers
                                else req.headers.get("access-control-request-headers") or "*"))
                headers.append(("Access-Control-Max-Age", "86400"))
            return None, False, Response(200, headers=headers, content_type="text/plain; charset=utf-8")
        resp = error_response(405, f"Method {req.method} is not allowed on {req.path}", "invalid_request_error")
        resp.headers = [("Allow", allow)]
        return None, req.method == "HEAD", resp
