"""The HTTP server of a program's command line: one for the model server and the router."""
from __future__ import annotations

import logging
from typing import Any

from ..util.errors import PyllamaError
from .http import HTTPServer

log = logging.getLogger("pyllama.server")


async def listen(routes: dict, args: Any, access: Any, public_paths: Any) -> tuple[HTTPServer, int]:
    """An HTTPServer with the command line's limits, listening on --host / --port: (it, its port).
    A port that cannot be bound is one PyllamaError; an address other than loopback without an
    API key is a warning."""
    server = HTTPServer(routes, max_body=args.max_body, max_header_bytes=args.max_header_bytes,
                        keepalive_timeout=args.timeout, header_timeout=args.header_timeout,
                        body_timeout=args.body_timeout, max_connections=args.max_connections,
                        max_pipelined=args.max_pipelined, access=access, public_paths=public_paths,
                        sse_ping_interval=args.sse_ping_interval, api_prefix=args.api_prefix,
                        allow_any_host=args.allow_any_host, max_buffered=args.max_body_buffered)
    try:
        port = await server.start(args.host, args.port, reuse_port=args.reuse_port)
    except OSError as exc:
        raise PyllamaError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_keys:
        log.warning("listening on %s: the server has no authentication; anyone who reaches it can use it", args.host)
    return server, port
