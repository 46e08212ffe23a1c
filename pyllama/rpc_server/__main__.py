"""python -m pyllama.rpc_server: serve this machine's device to pyllama servers over TCP.

Prints `listening on HOST:PORT` on stderr once bound (`--port 0` picks a free port). SIGINT and
SIGTERM stop it cleanly: no new connections, every connection closed and its buffers freed, the
executor threads ended, exit status 0; a second one exits at once (status 128 + the signal).

Its flags read PYLLAMA_RPC_SERVER_ARG_<NAME>, not the server's PYLLAMA_ARG_<NAME> or
LLAMA_ARG_<NAME>: those are exported for `pyllama.server` (PYLLAMA_ARG_DEVICE=RPC0,CPU, a port)
and must not change how an rpc server on the same machine starts.
"""
from __future__ import annotations

import asyncio
import logging
import sys
from typing import Optional, Sequence

from ..obs import trace
from ..backend.base import Backend
from ..backend.cpu import CPUBackend, set_compute_threads
from ..util.cli import Parser, install_stop_signals, is_loopback_address, run_main, setup_logging
from ..util.errors import PyllamaError
from ..util.settings import load as load_settings
from ..util.priority import LEVELS_HELP, apply_priority, check_level
from ..rpc.auth import read_token
from ..rpc.protocol import DEFAULT_MAX_FRAME
from ..util.loop import install_uvloop
from .server import DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_MAX_CONNECTIONS, RPCServer

log = logging.getLogger("pyllama.rpc_server")

ENV_PREFIX = "PYLLAMA_RPC_SERVER_ARG_"
DEVICES = ("CPU", "CUDA<i>")


def build_parser() -> Parser:
    p = Parser(prog="python -m pyllama.rpc_server", env_prefixes=(ENV_PREFIX,),
               description="Expose this machine's device to pyllama servers over TCP (docs/rpc-protocol.md). "
                           "Without --auth-token-file (or $PYLLAMA_RPC_TOKEN) there is no authentication: anyone "
                           "who can connect can allocate memory and run graphs on it. It binds 127.0.0.1 by "
                           "default; bind other addresses only with a token or on a trusted network.")
    p.add_argument("-H", "--host", default="127.0.0.1",
                   help="address to listen on (without a token anyone who reaches it may use it)")
    p.add_argument("-p", "--port", type=int, default=50052, help="port to listen on (0 = any free port)")
    p.add_argument("-d", "--device", default="CPU", help=f"device to expose ({', '.join(DEVICES)}, e.g. CUDA0)")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU compute threads, 0 = all cores")
    p.add_argument("--prio", type=int, default=0,
                   help=f"priority of this server's threads, as the server's --prio: {LEVELS_HELP}")
    p.add_argument("-nr", "--no-repack", dest="no_repack", action="store_true",
                   help="keep Q4_0, Q8_0, Q4_K, Q5_K and Q6_K weights in the file's layout only: the CPU otherwise also holds them "
                        "repacked in groups of 8 rows (faster products, twice the memory for those weights)")
    p.add_argument("-m", "--mem", type=int, default=0, metavar="MiB",
                   help="memory clients may make the device hold, in MiB: buffers, replies being sent, a running "
                        "graph's kernel scratch, repacked weight copies (0 = what the host has)")
    p.add_argument("--cache", metavar="DIR",
                   help="directory of the tensor cache (enables SET_TENSOR_HASH: weights are not re-sent after a restart)")
    p.add_argument("--max-frame", type=int, default=DEFAULT_MAX_FRAME, metavar="BYTES",
                   help="largest request payload accepted; also caps a GET_TENSORS reply")
    p.add_argument("--auth-token-file", metavar="PATH",
                   help="require clients to prove this token (first line of the file, at least 16 bytes; also "
                        "$PYLLAMA_RPC_TOKEN) before any command; the token never crosses the wire")
    p.add_argument("--handshake-timeout", type=float, default=DEFAULT_HANDSHAKE_TIMEOUT, metavar="SECONDS",
                   help="close a connection that has not sent HELLO (and, with a token, proven it) within this time")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help="connections open at once, authenticated or not (one more is told so and closed)")
    p.add_argument("--trace", metavar="PATH",
                   help="write a trace of every command served here (JSON lines; also $PYLLAMA_TRACE)")
    p.add_argument("-v", "--verbose", action="store_true", help="log every allocation and cache write too")
    return p.finish()


def check_args(args) -> None:
    if not 0 <= args.port <= 65535:
        raise PyllamaError(f"--port {args.port}: not a port number")
    dev = args.device.strip().upper()
    if dev != "CPU" and not (dev.startswith("CUDA") and dev[4:].isdigit()):
        raise PyllamaError(f"--device {args.device}: this server exposes {', '.join(DEVICES)} only")
    if args.threads < 0:
        raise PyllamaError(f"--threads {args.threads}: must be at least 0")
    why = check_level(args.prio)
    if why is not None:
        raise PyllamaError(why)
    if args.mem < 0:
        raise PyllamaError(f"--mem {args.mem}: must be at least 0")
    if args.max_frame < 1024:
        raise PyllamaError(f"--max-frame {args.max_frame}: must be at least 1024")
    if not 0 < args.handshake_timeout <= 3600:
        raise PyllamaError(f"--handshake-timeout {args.handshake_timeout}: must be more than 0 and at most 3600 s")
    if args.max_connections < 1:
        raise PyllamaError(f"--max-connections {args.max_connections}: must be at least 1")


def exposure_warning(host: str, token: Optional[bytes]) -> Optional[str]:
    """The start-up warning for a server reachable beyond this host without a token."""
    if token is not None or is_loopback_address(host):
        return None
    return (f"listening on {host} without --auth-token-file: the RPC server has no authentication; anyone who "
            "reaches this port can allocate memory and run graphs on it")


def open_device(name: str, threads: int) -> Backend:
    """The backend to serve: the CPU, or CUDA<i> (a PyllamaError saying why when it cannot run here)."""
    name = name.strip().upper()
    if name == "CPU":
        return CPUBackend(threads)
    from ..backend.cuda import open_backend  # noqa: PLC0415 - PyCUDA only when a GPU is served
    return open_backend(name)


async def serve(args) -> int:
    token = read_token(args.auth_token_file, "--auth-token-file")
    backend = open_device(args.device, args.threads)
    if isinstance(backend, CPUBackend):
        backend.layout.repack = backend.layout.repack and not args.no_repack
    try:
        set_compute_threads(args.threads)  # BLAS threads too: idle ones spin and steal the cores
        server = RPCServer(args.host, args.port, backend_factory=lambda: backend,
                           mem_limit=args.mem << 20 if args.mem else None, cache_dir=args.cache,
                           max_frame=args.max_frame, token=token, handshake_timeout=args.handshake_timeout,
                           max_connections=args.max_connections)
    except OSError as exc:
        raise PyllamaError(f"--cache {args.cache}: {exc.strerror or exc}") from None
    try:
        port = await server.start()
    except OSError as exc:
        raise PyllamaError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    warning = exposure_warning(args.host, token)
    if warning:
        log.warning("%s", warning)
    try:
        traced = trace.start(args.trace, "rpc-server", endpoint=f"{args.host}:{port}",
                             trace_uid=f"{server.server_id:016x}")
    except OSError as exc:
        await server.stop()
        raise PyllamaError(f"--trace: {exc.strerror or exc}") from None
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    install_stop_signals(loop, stop.set)  # before the line below: whoever read it may signal at once
    print(f"listening on {args.host}:{port}", file=sys.stderr, flush=True)  # the first line, for scripts
    log.info("serving %s (capabilities 0x%x, server id %016x)", ", ".join(d.name for d in server.devices),
             server.capabilities, server.server_id)
    if traced:
        log.info("tracing to %s", traced)
    if isinstance(backend, CPUBackend):
        log.info("quantized weights repacked in groups of 8 rows: %s",
                 "yes, memory allowing" if backend.layout.repack else "no (--no-repack)")
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        await server.stop()
        trace.close()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose, logging.INFO)
    check_args(args)
    load_settings()  # the environment, read once: a bad value stops here
    apply_priority(args.prio)  # before any thread starts: the executor threads inherit it
    install_uvloop()
    return asyncio.run(serve(args))


if __name__ == "__main__":
    run_main(main)
