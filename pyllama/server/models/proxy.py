"""A request passed on to a model's server process and its answer passed back: a body with a length
is read whole, any other (an event stream, chunked) is relayed chunk by chunk as it arrives."""
from __future__ import annotations

import asyncio
from typing import Callable, Optional, Union
from urllib.parse import urlencode

import httptools

from ..http import HTTPError, Request, Response, StreamResponse

# headers of one hop, or that the router's HTTP layer writes itself (CORS, length, framing)
_HOP_REQUEST = frozenset(("host", "connection", "keep-alive", "content-length", "transfer-encoding", "te",
                          "trailer", "upgrade", "expect", "proxy-authorization", "proxy-connection"))
_HOP_RESPONSE = frozenset(("connection", "keep-alive", "content-length", "transfer-encoding", "content-type",
                           "date", "server", "vary", "x-accel-buffering", "trailer", "upgrade"))
_READ = 1 << 16


class _Reply:
    """httptools callbacks: the child's status, headers and body pieces."""

    def __init__(self) -> None:
        self.headers: list[tuple[str, str]] = []
        self.pieces: list[bytes] = []
        self.headers_done = False
        self.complete = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.pieces.append(bytes(body))

    def on_message_complete(self) -> None:
        self.complete = True


def target_of(req: Request) -> str:
    """The path and query the child is asked for (the query as the router parsed it)."""
    return req.path + ("?" + urlencode(req.query) if req.query else "")


async def forward(req: Request, port: int, timeout: float, on_done: Callable[[], None],
                  host: str = "127.0.0.1") -> Union[Response, StreamResponse]:
    """Sends `req` to the server on host:port and returns its answer. `on_done` is called once the
    exchange is over (the body sent on, the client gone, or a failure). HTTPError(500) when the child
    cannot be reached or answers nothing readable."""
    done = [False]

    def finish() -> None:
        if not done[0]:
            done[0] = True
            on_done()

    writer: Optional[asyncio.StreamWriter] = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10.0)
        head = [f"{'GET' if req.method == 'HEAD' else req.method} {target_of(req)} HTTP/1.1",
                f"Host: {host}:{port}", "Connection: close", f"Content-Length: {len(req.body)}"]
        head += [f"{k}: {v}" for k, v in req.headers.items() if k not in _HOP_REQUEST]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + req.body)
        reply = _Reply()
        parser = httptools.HttpResponseParser(reply)
        while not reply.headers_done:
            data = await asyncio.wait_for(reader.read(_READ), timeout)
            if not data:
                raise ConnectionError("the connection closed before an answer")
            parser.feed_data(data)
        status = parser.get_status_code()
        headers = dict(reply.headers)
        ctype = headers.get("content-type", "application/json; charset=utf-8")
        passed = [(k, v) for k, v in reply.headers if k not in _HOP_RESPONSE and not k.startswith("access-control-")]
        streamed = "content-length" not in headers or ctype.startswith("text/event-stream")
        if not streamed:
            while not reply.complete:
                data = await asyncio.wait_for(reader.read(_READ), timeout)
                if not data:
                    raise ConnectionError("the connection closed in the middle of the answer")
                parser.feed_data(data)
            writer.close()
            finish()
            return Response(status, b"".join(reply.pieces), content_type=ctype, headers=passed or None)
    except (OSError, asyncio.TimeoutError, httptools.HttpParserError) as exc:
        if writer is not None:
            writer.close()
        finish()
        why = "no answer in time" if isinstance(exc, asyncio.TimeoutError) else (str(exc) or type(exc).__name__)
        raise HTTPError(500, f"the model's server did not answer: {why}", "server_error") from None
    except BaseException:
        if writer is not None:
            writer.close()
        finish()
        raise

    return StreamResponse(_Relay(reader, writer, parser, reply, timeout, finish), content_type=ctype,
                          headers=passed or None, status=status, ping_interval=0)


class _Relay:
    """The child's body as it arrives. Closing it (the client went away, or the body was never
    wanted: HEAD) closes the child's connection, and the child cancels the generation as it would
    for its own client; an iterator that was never started is closed as well."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, parser, reply: _Reply,
                 timeout: float, finish: Callable[[], None]) -> None:
        self._reader, self._writer, self._parser, self._reply = reader, writer, parser, reply
        self._timeout, self._finish = timeout, finish
        self._closed = False

    def __aiter__(self) -> "_Relay":
        return self

    async def __anext__(self) -> bytes:
        reply = self._reply
        try:
            while not self._closed:
                if reply.pieces:
                    pieces, reply.pieces = reply.pieces, []
                    return b"".join(pieces)
                if reply.complete:
                    break
                data = await asyncio.wait_for(self._reader.read(_READ), self._timeout)
                if not data:
                    break
                self._parser.feed_data(data)
        except BaseException:
            await self.aclose()
            raise
        await self.aclose()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._writer.close()
            self._finish()
