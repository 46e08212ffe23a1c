"""python -m pyllama.server: the HTTP server (llama-server's API and the OpenAI-compatible API).

The event loop binds the port at once (/health answers 503 while the model loads), the model
loads and is checked on a worker thread, then the task thread, one decode thread per group and the
PeerReconnector (which brings lost rpc servers back) start; only then is `listening on` logged.
Normal events log at INFO, problems at WARNING or ERROR; -v adds DEBUG. SIGINT and SIGTERM shut
down gracefully: in-flight requests finish or are cancelled, every socket closes; a peer that
stopped answering does not hold the shutdown up. A second SIGINT or SIGTERM exits at once (130
for a second Ctrl+C).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from typing import Optional, Sequence

from .. import trace
from ..cache_types import CACHE_TYPES, DEFAULT_CACHE_TYPE, cache_type_name
from ..cli import Parser, install_stop_signals, run_main, setup_logging
from ..devices import add_device_args, make_backends, parse_split
from ..engine import Engine
from ..errors import PyllamaError
from .api import Api, ServerState
from .chat import ChatTemplate
from .group import PipelineGroup
from .http import HTTPServer, install_uvloop
from .reconnect import PeerReconnector
from .router import Router
from .slot import Slot

log = logging.getLogger("pyllama.server")


def build_parser() -> Parser:
    p = Parser(prog="python -m pyllama.server",
               description="Serve a GGUF model over HTTP with llama-server's API and the OpenAI-compatible API.")
    p.add_argument("-m", "--model", help="GGUF model file (default: the built-in test model)")
    p.add_argument("-a", "--alias", help="model name reported by the API (default: the file name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (0 = any free port)")
    p.add_argument("-c", "--ctx-size", type=int, default=0, help="total context size, 0 = the model's")
    p.add_argument("-np", "--parallel", type=int, default=1, help="number of slots (sequences decoded together)")
    p.add_argument("-b", "--batch-size", type=int, default=2048, help="tokens per decode step at most")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, help="micro-batch size")
    p.add_argument("-t", "--threads", type=int, default=0, help="compute threads, 0 = all cores")
    p.add_argument("--pipeline-groups", type=int, default=1,
                   help="N contexts of the model, each with its own batch and decode thread, so N batches are in "
                        "flight over a layer split; must divide --parallel")
    p.add_argument("-ctk", "--cache-type-k", default=DEFAULT_CACHE_TYPE, choices=list(CACHE_TYPES),
                   help="KV cache type for K: f32, f16, bf16 or q8_0")
    p.add_argument("-ctv", "--cache-type-v", default=DEFAULT_CACHE_TYPE, choices=list(CACHE_TYPES),
                   help="KV cache type for V: f32, f16, bf16 or q8_0")
    p.add_argument("--kv-unified", action="store_true",
                   help="one KV pool for all slots (a request may use the whole context) instead of C/P per slot")
    p.add_argument("--context-shift", action=argparse.BooleanOptionalAction, default=False,
                   help="when a request reaches its slot's context: keep its first --keep tokens, drop half of the "
                        "rest and go on (default: off, as llama-server: the request ends with truncated: true)")
    p.add_argument("--keep", type=int, default=0,
                   help="prompt tokens a context shift keeps, -1 = the whole prompt (a request's n_keep overrides it)")
    p.add_argument("--backend-sampling", action=argparse.BooleanOptionalAction, default=None,
                   help="run every request's sampler chain on the device that holds the output layer (local or an rpc "
                        "server that supports it): only token ids come back instead of the logits; default: on when "
                        "the output layer is on an rpc server that supports it, off when it is local")
    p.add_argument("-n", "--n-predict", type=int, default=-1, help="default tokens to generate per request, -1 = until done")
    p.add_argument("--slot-prompt-similarity", type=float, default=0.5,
                   help="reuse a slot whose cached prompt covers more than this share of the new prompt")
    p.add_argument("--chat-template", help="Jinja2 chat template overriding the model's (or 'chatml')")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds an idle keep-alive connection stays open")
    p.add_argument("--max-body", type=int, default=16 << 20, help="largest accepted request body in bytes")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a client has to send a request's headers (for the first request, counted from "
                        "connecting); a slower client is disconnected")
    p.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a client has to send a request's body once the headers are in; a slower one gets 408")
    p.add_argument("--max-header-bytes", type=int, default=64 << 10,
                   help="largest request line plus headers in bytes; a larger request gets 431")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="open client connections at most; one more gets 503 and is closed")
    p.add_argument("--max-pipelined", type=int, default=8,
                   help="requests read ahead on one connection while an earlier one is answered; at the limit the "
                        "server stops reading from that connection until it catches up")
    p.add_argument("--metrics", action="store_true", help="accepted for llama-server compatibility; /metrics is always on")
    p.add_argument("--trace", metavar="PATH",
                   help="write a trace of every decode step, RPC command and device span (JSON lines; also $PYLLAMA_TRACE)")
    p.add_argument("-v", "--verbose", action="store_true", help="log more")
    add_device_args(p)
    return p.finish()


def check_args(args) -> None:
    if args.parallel < 1:
        raise PyllamaError(f"--parallel {args.parallel}: must be at least 1")
    if args.pipeline_groups < 1:
        raise PyllamaError(f"--pipeline-groups {args.pipeline_groups}: must be at least 1")
    if args.parallel % args.pipeline_groups:
        raise PyllamaError(f"--pipeline-groups {args.pipeline_groups} does not divide --parallel {args.parallel}")
    if args.ctx_size and not args.kv_unified and args.ctx_size % args.pipeline_groups:
        raise PyllamaError(f"--ctx-size {args.ctx_size} is not divisible by --pipeline-groups {args.pipeline_groups} "
                           "(split KV gives each group an equal share; or use --kv-unified)")
    if args.ctx_size < 0:
        raise PyllamaError(f"--ctx-size {args.ctx_size}: must be at least 0")
    if args.keep < -1:
        raise PyllamaError(f"--keep {args.keep}: must be -1 (the whole prompt) or at least 0")
    if args.n_predict < -1:
        raise PyllamaError(f"--n-predict {args.n_predict}: must be -1 (unlimited) or at least 0")
    if args.batch_size < 1 or args.ubatch_size < 1:
        raise PyllamaError("--batch-size and --ubatch-size must be at least 1")
    if not 0.0 <= args.slot_prompt_similarity <= 1.0:
        raise PyllamaError("--slot-prompt-similarity must lie between 0 and 1")
    if not 0 <= args.port <= 65535:
        raise PyllamaError(f"--port {args.port}: not a port number")
    for flag, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)):
        if not value > 0:
            raise PyllamaError(f"{flag} {value}: must be more than 0 seconds")
    if args.max_body < 1:
        raise PyllamaError(f"--max-body {args.max_body}: must be at least 1")
    if args.max_header_bytes < 1024:
        raise PyllamaError(f"--max-header-bytes {args.max_header_bytes}: must be at least 1024")
    if args.max_connections < 1 or args.max_pipelined < 1:
        raise PyllamaError("--max-connections and --max-pipelined must be at least 1")
    if args.rpc_timeout is not None and not 0 < args.rpc_timeout < float("inf"):
        raise PyllamaError(f"--rpc-timeout {args.rpc_timeout}: must be a positive number of seconds")


def load(state: ServerState) -> None:
    """Loads the model and starts the threads (runs on a worker thread)."""
    args = state.args
    path = args.model
    if not path:
        from ..models.default import default_model_path  # noqa: PLC0415
        path = default_model_path()
    backends = make_backends(args.device, args.rpc, args.split_mode, args.threads, args.rpc_token_file,
                             args.rpc_timeout)
    engine = Engine(path, n_threads=args.threads, backends=backends,
                    tensor_split=parse_split(args.tensor_split, len(backends)), load=False)
    hp = engine.model.hparams
    n_groups = args.pipeline_groups
    n_ctx = args.ctx_size or hp.n_ctx_train
    if not args.kv_unified and n_ctx % n_groups:
        raise PyllamaError(f"the context of {n_ctx} is not divisible by --pipeline-groups {n_groups} (set -c)")
    # split KV: each group gets C/N cells for its P/N sequences (per-request context unchanged);
    # unified KV: every group gets the whole C (N times the memory)
    ctx_group = n_ctx if args.kv_unified else n_ctx // n_groups
    seq_group = args.parallel // n_groups
    if not args.kv_unified and ctx_group < seq_group:
        raise PyllamaError(f"--ctx-size {n_ctx} is smaller than --parallel {args.parallel}")
    type_k, type_v = CACHE_TYPES[args.cache_type_k], CACHE_TYPES[args.cache_type_v]
    need = engine.check_memory(n_groups, ctx_group, seq_group, args.batch_size, args.ubatch_size, args.kv_unified,
                               type_k, type_v)
    engine.load()
    state.groups = []
    for g in range(n_groups):
        ctx = engine.new_context(ctx_group, seq_group, args.batch_size, args.ubatch_size, args.kv_unified,
                                 type_k, type_v)
        wanted = args.backend_sampling
        if wanted is None:  # the logits would cross the network: sampling there saves n_vocab floats per row
            wanted = ctx.output_backend().remote
        backend_sampling = wanted and ctx.can_sample_on_device()
        if args.backend_sampling and not backend_sampling and g == 0:
            log.warning("--backend-sampling: the device of the output layer does not run the sampler (an rpc server "
                        "without the capability); sampling on this host")
        slots = [Slot(g * seq_group + i, g, i, ctx.seq_cap, engine.tokenizer) for i in range(seq_group)]
        state.groups.append(PipelineGroup(g, ctx, slots, engine.tokenizer, state.metrics, on_free=lambda s: None,
                                          n_threads=1, backend_sampling=backend_sampling,
                                          context_shift=args.context_shift))

    state.slots_per_group = seq_group
    state.n_ctx_slot = ctx.seq_cap
    tmpl = args.chat_template
    source = None if tmpl in (None, "chatml") else tmpl
    if tmpl is None:
        source = engine.model.file.get("tokenizer.chat_template")
    tok = engine.tokenizer
    state.chat = ChatTemplate(source, bos_token=tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
                              eos_token=tok.token_text(tok.eos_id) if tok.eos_id is not None else "")
    state.model_path = path
    state.model_alias = args.alias or os.path.basename(path)
    router = Router(state.groups, args.slot_prompt_similarity)
    reconnector = PeerReconnector(engine, state.groups) if any(b.remote for b in engine.backends) else None
    for group in state.groups:
        group.start()
    router.start()
    if reconnector is not None:
        reconnector.start()
    state.reconnector = reconnector
    kv = {}
    for group in state.groups:
        for name, size in group.ctx.kv_bytes.items():
            kv[name] = kv.get(name, 0) + size
    kv_desc = {f"{name} (K {cache_type_name(tk)}, V {cache_type_name(tv)})": kv[name]
               for name, (tk, tv) in ctx.kv_types.items()}
    log.info("model %s loaded: %d slots in %d pipeline group(s); at most %d positions per request (%s KV); "
             "KV cache %s; weights %s; needed in all %s; layers: %s",
             state.model_alias, args.parallel, n_groups, ctx.seq_cap, "unified" if args.kv_unified else "split",
             _mib(kv_desc), _mib(engine.weights.bytes_per_backend), _mib(need), engine.placement.describe())
    state.router = router
    state.engine = engine


def _mib(per_device: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in per_device.items())


async def serve(args) -> int:
    state = ServerState(args)
    api = Api(state)
    server = HTTPServer(api.routes(), max_body=args.max_body, max_header_bytes=args.max_header_bytes,
                        keepalive_timeout=args.timeout, header_timeout=args.header_timeout,
                        body_timeout=args.body_timeout, max_connections=args.max_connections,
                        max_pipelined=args.max_pipelined)
    try:
        port = await server.start(args.host, args.port)
    except OSError as exc:
        raise PyllamaError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s: the server has no authentication; anyone who reaches it can use it", args.host)
    try:
        traced = trace.start(args.trace, "server", endpoint=f"{args.host}:{port}")
    except OSError as exc:
        await server.shutdown(grace=0)
        raise PyllamaError(f"--trace: {exc.strerror or exc}") from None
    if traced:
        log.info("tracing to %s", traced)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    install_stop_signals(loop, stop.set)
    loader = loop.run_in_executor(None, load, state)
    code = 0
    try:
        stopper = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({loader, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if loader in done:
            exc = loader.exception()
            if exc is not None:
                state.load_error = str(exc)
                if isinstance(exc, PyllamaError):
                    print(f"error: {exc}", file=sys.stderr)
                else:
                    log.error("loading failed", exc_info=exc)
                    print(f"error: loading failed: {exc}", file=sys.stderr)
                code = 1
            else:
                log.info("listening on http://%s:%d", args.host, port)  # loaded and checked: serving
                await stopper
        else:
            await asyncio.wait({loader})  # loading cannot be interrupted half-way; let it finish
    finally:
        log.info("shutting down")
        await server.shutdown(grace=5.0)
        if state.router is not None:
            state.router.stop()
        if state.reconnector is not None:
            state.reconnector.stop()
        for g in state.groups:
            g.request_stop()
        deadline = time.monotonic() + 2.0
        for g in state.groups:  # a running step normally ends in milliseconds
            g.stop(timeout=max(0.0, deadline - time.monotonic()))
        if state.engine is not None:
            # the peers free everything with the connection; closing it also ends at once a step
            # (or a buffer release) that would wait on a peer that stopped answering
            state.engine.disconnect()
        for g in state.groups:
            g.stop()
        if state.engine is not None:
            state.engine.close()
        trace.close()
    return code


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose, logging.INFO)
    check_args(args)
    install_uvloop()
    return asyncio.run(serve(args))


if __name__ == "__main__":
    run_main(main)
