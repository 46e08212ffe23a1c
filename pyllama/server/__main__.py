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

import asyncio
import logging
import os
import sys
import time
from typing import Optional, Sequence

from ..obs import trace
from ..util.settings import load as load_settings
from ..runtime.placement.balance import memory_caps, output_blocks
from ..runtime.cache_types import CACHE_TYPES, cache_type_name
from ..util.cli import install_stop_signals, run_main, setup_logging
from ..runtime.placement.devices import check_cpu_moe, check_kv_offload, list_devices, open_devices
from ..runtime.engine import Engine
from ..rpc.connection import configured_timeout
from ..util.errors import PyllamaError
from ..models.hparams import model_overrides
from ..util.affinity import apply_affinity
from ..util.priority import apply_priority
from .api import Api, ServerState
from .chat import ChatTemplateError, template_from_option
from .embedding import check_rank_pooling, model_pooling
from ..models.rank_head import RankHead
from ..batching.group import PipelineGroup, groups_stopped, share_stages
from ..runtime.placement.chunk import pipeline_chunk
from .listen import listen
from ..util.loop import install_uvloop
from .options import (apply_settings, build_parser, check_args, default_constraint, lock_memory,  # noqa: F401
                      default_stop, log_accepted, log_level, lora_adapters, parse_args, resolve, router_mode,
                      sampling_defaults,
                      spec_config, spec_kinds, template_kwargs)
from ..batching.scheduler import EXACT_ROWS
from ..batching.draft_model import ModelDrafter, open_draft_model
from ..batching.ngram_drafts import NgramDrafter, spec_summary
from ..batching.speculative import ChainDrafter, Drafter, SpecConfig
from .params import check_generation_defaults, set_default_constraint, set_generation_defaults
from ..batching.prompt_cache import PromptCache
from .reconnect import PeerReconnector
from .router import Router
from ..batching.slot import Slot
from .split_check import SplitCheck, check_interval

log = logging.getLogger("pyllama.server")


def make_drafter(args, spec: SpecConfig, draft_engine, n_ctx: int, n_seq: int, n_vocab: int) -> "Drafter | None":
    """A group's drafter: n-gram drafts (--spec-type), the draft model's own context (-md), both (the
    n-grams asked first), or none."""
    ngrams = NgramDrafter(spec, n_vocab) if spec.enabled else None
    if draft_engine is None:
        return ngrams
    type_k = CACHE_TYPES[args.cache_type_k_draft or args.cache_type_k]
    type_v = CACHE_TYPES[args.cache_type_v_draft or args.cache_type_v]
    ctx = draft_engine.new_context(args.ctx_size_draft or n_ctx, n_seq, args.batch_size, args.ubatch_size,
                                   args.kv_unified, type_k, type_v)
    model = ModelDrafter(ctx, 3 if args.spec_draft_n_max is None else args.spec_draft_n_max, args.spec_draft_n_min,
                         args.spec_draft_p_min)
    return model if ngrams is None else ChainDrafter(ngrams, model)


def load(state: ServerState) -> None:
    """Loads the model and starts the threads (runs on a worker thread)."""
    args = state.args
    if not hasattr(args, "api_keys"):  # a namespace straight from build_parser().parse_args()
        resolve(args)
    path = args.model
    if not path:
        from ..models.default import default_model_path  # noqa: PLC0415
        path = default_model_path()
    backends, proportions = open_devices(args, path)
    state.split_chosen = proportions is None
    engine = Engine(path, n_threads=args.threads, backends=backends, tensor_split=proportions, load=False,
                    map_weights=args.mmap, kv_overrides=model_overrides(args),
                    repack=getattr(args, "repack", True), check_tensors=getattr(args, "check_tensors", False),
                    lora=[path for path, _ in lora_adapters(args)])
    state.lora_paths = [path for path, _ in lora_adapters(args)]
    state.lora_scales = [scale for _, scale in lora_adapters(args)]
    hp = engine.model.hparams
    if hp.encoder and not args.embedding:
        raise PyllamaError(f"{engine.model.name}: a {hp.arch} model computes embeddings only; start the server with "
                           "--embedding (or --rerank)")
    state.rank_head = RankHead.of(engine.model)
    state.pooling = model_pooling(engine.model.file, args.pooling, state.rank_head is not None)
    if args.embedding:
        check_rank_pooling(state.pooling, engine.model.name, state.rank_head is not None)
    check_generation_defaults(hp.n_vocab)
    names = [b.name for b in engine.backends]
    check_cpu_moe(names, engine.placement.layer_backend, hp.is_moe, hp.n_layer if args.cpu_moe else args.n_cpu_moe)
    check_kv_offload(names, engine.placement.layer_backend, getattr(args, "kv_offload", True))
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
    if args.embedding:
        log.info("embeddings: pooling %s", state.pooling)
    state.groups = []
    n_ctx_slot = 0
    spec = spec_config(args)
    state.spec_type = ",".join(spec_kinds(args)) or "none"
    draft_engine = None
    if spec.enabled:
        log.info("speculative decoding: %s, verified in steps of at most %d rows%s", spec_summary(spec), EXACT_ROWS,
                 f", at most {spec.n_max} tokens a draft" if spec.n_max >= 0 else "")
    if args.model_draft:
        draft_engine = open_draft_model(args.model_draft, engine.tokenizer, args.threads_draft or args.threads)
        state.draft_engine = draft_engine
        n_draft = 3 if args.spec_draft_n_max is None else args.spec_draft_n_max
        log.info("speculative decoding: draft model %s on the local CPU%s, %d tokens a step (p_min %.2f), verified "
                 "in steps of at most %d rows", args.model_draft, " after the n-gram drafts" if spec.enabled else "",
                 n_draft, args.spec_draft_p_min, EXACT_ROWS)
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
        n_ctx_slot = n_ctx_slot or slot_context(ctx.seq_cap, hp.n_ctx_train)  # the same in every group
        slots = [Slot(g * seq_group + i, g, i, n_ctx_slot, engine.tokenizer, special=args.special)
                 for i in range(seq_group)]
        state.groups.append(PipelineGroup(g, ctx, slots, engine.tokenizer, state.metrics, on_free=lambda s: None,
                                          n_threads=1, backend_sampling=backend_sampling,
                                          context_shift=args.context_shift, pooling=state.pooling,
                                          drafter=make_drafter(args, spec, draft_engine, ctx_group, seq_group,
                                                               hp.n_vocab)))

    if args.warmup:
        warm_up(state.groups, engine.tokenizer)
    if args.cache_ram and state.lora_paths:
        log.info("prompt cache in host memory: off with LoRA adapters (its entries do not record the adapters "
                 "they were computed with)")
    elif args.cache_ram:
        prompt_cache = PromptCache(-1 if args.cache_ram < 0 else args.cache_ram << 20)
        for group in state.groups:
            group.prompt_cache, group.cache_idle_slots = prompt_cache, args.cache_idle_slots
        log.info("prompt cache in host memory: up to %s, 0 bytes used (/metrics: llamacpp:prompt_cache_bytes); a "
                 "slot's prompt is copied there when it is dropped if its request repeated or continued an earlier "
                 "prompt", "no size limit" if args.cache_ram < 0 else f"{args.cache_ram} MiB ({args.cache_ram << 20} bytes)")
    else:
        log.info("prompt cache in host memory: off (--cache-ram 0)")
    if ctx.placement.n_stages > 1:  # the groups take turns at each stage of the split
        share_stages(state.groups, pipeline_chunk(args.pipeline_chunk, engine.model, ctx.placement.backends))
    state.slots_per_group = seq_group
    state.n_ctx_slot = n_ctx_slot
    tok = engine.tokenizer
    try:
        state.chat = template_from_option(
            args.chat_template, engine.model.file.get("tokenizer.chat_template"), jinja=args.jinja,
            bos_token=tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
            eos_token=tok.token_text(tok.eos_id) if tok.eos_id is not None else "",
            kwargs=template_kwargs(args), prefill_assistant=args.prefill_assistant, reasoning=args.reasoning)
    except ChatTemplateError as exc:
        raise PyllamaError(f"--chat-template: {exc}") from None
    state.model_path = path
    state.model_alias = args.alias[0] if args.alias else os.path.basename(path)
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
             state.model_alias, args.parallel, n_groups, state.n_ctx_slot, "unified" if args.kv_unified else "split",
             _mib(kv_desc), _mib(engine.weights.bytes_per_backend), _mib(need), engine.placement.describe())
    state.router = router
    state.engine = engine


def slot_context(seq_cap: int, n_ctx_train: int) -> int:
    """The positions a slot may hold: its share of the KV cache, but never more than the model
    was trained on (llama-server caps it the same way: past that, RoPE positions the model never
    saw make its output degrade)."""
    if 0 < n_ctx_train < seq_cap:
        log.warning("the slot context (%d) exceeds the training context of the model (%d): capping it",
                    seq_cap, n_ctx_train)
        return n_ctx_train
    return seq_cap


def warm_up(groups: list[PipelineGroup], tokenizer) -> None:
    """One decode step per group (--warmup), before any request: a decode thread that meets a
    fresh page of the weights or of a compute buffer mid-request waits for the page fault."""
    t0 = time.perf_counter()
    token = tokenizer.bos_id if tokenizer.bos_id is not None else 0
    for group in groups:
        group.warm_up(token)
    log.info("warm-up: one decode step in each of %d pipeline group(s) took %.0f ms (--no-warmup skips it)",
             len(groups), (time.perf_counter() - t0) * 1e3)


def _mib(per_device: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in per_device.items())


def move_blocks(state: ServerState, counts: list[int]) -> None:
    """Re-splits the blocks as `counts` with every group stopped between steps (Engine.move_layers:
    the requests under way go on where they were once the groups resume)."""
    with groups_stopped(state.groups, configured_timeout()):
        lost = state.engine.lost_devices()
        if lost:
            raise PyllamaError("; ".join(lost.values()))
        state.engine.move_layers(counts)


def start_split_check(state: ServerState, api: Api, interval_s: float) -> Optional[SplitCheck]:
    """With pipeline groups over a split, the check of the split against the load (split_check);
    it moves the blocks by its advice when the split was the server's own choice (no -ts, -ngl)."""
    engine = state.engine
    placement = engine.placement
    if interval_s <= 0 or len(state.groups) < 2 or placement.n_stages < 2:
        return None
    names = [b.name for b in placement.backends]

    def caps(counts) -> list[Optional[int]]:
        # what each device holds plus what its free memory would take: no advice beyond that
        room = memory_caps(engine.model, placement.backends)
        return [None if more is None else n + more for n, more in zip(counts, room)]

    stats = api.pipeline()  # made here, on the event loop as the API makes it, never twice
    check = SplitCheck(lambda: stats.snapshot(1.0), [g.step_log for g in state.groups], names, engine.counts(),
                       output_blocks(engine.model), interval_s, caps,
                       (lambda counts: move_blocks(state, counts)) if state.split_chosen else None)
    check.start()
    return check


async def serve(args) -> int:
    try:
        check_s = check_interval()
    except ValueError as exc:
        raise PyllamaError(str(exc)) from None
    state = ServerState(args)
    apply_settings(state, args)
    set_generation_defaults(sampling_defaults(args), args.ignore_eos, args.cache_prompt, default_stop(args))
    set_default_constraint(default_constraint(args))
    state.metrics_enabled = bool(getattr(args, "metrics", False))
    api = Api(state)
    server, port = await listen(api.routes(), args, state, api.public_paths())
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
    check: Optional[SplitCheck] = None
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
                log.info("listening on http://%s:%d%s", args.host, port, args.api_prefix)  # loaded and checked: serving
                check = start_split_check(state, api, check_s)
                await stopper
        else:
            await asyncio.wait({loader})  # loading cannot be interrupted half-way; let it finish
    finally:
        log.info("shutting down")
        if check is not None:
            check.stop()
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
        if state.draft_engine is not None:
            state.draft_engine.close()
        trace.close()
    return code


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose, log_level(args))
    load_settings()  # the environment, read once: a bad value stops here
    if args.list_devices:
        print(list_devices(args))
        return 0
    if args.log_file:
        try:
            handler = logging.FileHandler(args.log_file)
        except OSError as exc:
            raise PyllamaError(f"--log-file {args.log_file}: {exc.strerror or exc}") from None
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger().addHandler(handler)
    if router_mode(args):  # several models, each in its own server process: the router only routes
        from .models.front import run_router  # noqa: PLC0415
        return run_router(args, list(sys.argv[1:] if argv is None else argv))
    log_accepted(args)
    if args.mlock:
        lock_memory()
    # before any thread starts: the event loop, task, decode and kernel helper threads inherit them
    apply_affinity(args.cpus)
    apply_priority(args.prio)
    install_uvloop()
    return asyncio.run(serve(args))


if __name__ == "__main__":
    run_main(main)
