"""One-shot generation from the command line, on the same engine as the server.

    python -m pyllama.generate -m MODEL -p PROMPT -n N [--temp T] [--seed S] [-t THREADS] [--tokens]

Prints the completion (not the prompt) as it is generated; with --tokens, the generated token ids
on one line instead. Without -m it runs the built-in default model.
"""
from __future__ import annotations

import signal
import sys
import time
from typing import Iterator, Optional, Sequence

from .obs import trace
from .runtime.cache_types import CACHE_TYPES, DEFAULT_CACHE_TYPE
from .util.cli import Parser, Toggle, run_main, setup_logging
from .runtime.context import Context, check_prompt_fits
from .runtime.placement.devices import add_device_args, list_devices, open_devices
from .runtime.engine import Engine
from .util.errors import PyllamaError
from .util.settings import load as load_settings
from .models.gguf_file import kv_override_arg
from .models.hparams import add_rope_args, model_overrides
from .models.lora import add_lora_args, lora_adapters
from .batching.core import BatchCore
from .batching.sampling import SamplingParams
from .batching.slot import Slot
from .batching.task import CompletionTask, ErrorEvent, EventList, TokenEvent
from .obs.metrics import Metrics
from .obs.step_probe import StepProbe
from .tokenizer import IncrementalDetokenizer, Tokenizer


def build_parser() -> Parser:
    p = Parser(prog="python -m pyllama.generate", description="Generate text from a prompt with a GGUF model.")
    p.add_argument("-m", "--model", llama_env="LLAMA_ARG_MODEL",
                   help="GGUF model file (default: the built-in test model)")
    p.add_argument("-p", "--prompt", default="", help="prompt text")
    p.add_argument("-f", "--file", help="read the prompt from this file")
    p.add_argument("-n", "--n-predict", "--predict", dest="n_predict", llama_env="LLAMA_ARG_N_PREDICT", type=int,
                   default=-1, help="tokens to generate, -1 = until end of text or full context")
    p.add_argument("-c", "--ctx-size", type=int, default=0, help="context size, 0 = the model's (at most 4096)")
    p.add_argument("-b", "--batch-size", llama_env="LLAMA_ARG_BATCH",
                   type=int, default=2048, help="logical batch size for the prompt")
    p.add_argument("-ub", "--ubatch-size", llama_env="LLAMA_ARG_UBATCH", type=int, default=512, help="micro-batch size")
    p.add_argument("-t", "--threads", type=int, default=0, help="compute threads, 0 = all cores")
    p.add_argument("-ctk", "--cache-type-k", default=DEFAULT_CACHE_TYPE, choices=list(CACHE_TYPES),
                   help="KV cache type for K: f32, f16, bf16 or q8_0")
    p.add_argument("-ctv", "--cache-type-v", default=DEFAULT_CACHE_TYPE, choices=list(CACHE_TYPES),
                   help="KV cache type for V: f32, f16, bf16 or q8_0")
    p.add_argument("-s", "--seed", type=int, default=-1, help="RNG seed, -1 = random")
    p.add_argument("--temp", "--temperature", dest="temp", type=float, default=0.8, help="temperature, <= 0 = greedy")
    p.add_argument("--top-k", llama_env="LLAMA_ARG_TOP_K", type=int, default=40, help="top-k sampling, <= 0 = off")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p sampling, 1.0 = off")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p sampling, 0.0 = off")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="repeat penalty, 1.0 = off")
    p.add_argument("--repeat-last-n", type=int, default=64, help="tokens the penalties look back at, -1 = context")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="presence penalty")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="frequency penalty")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-text tokens")
    p.add_argument("--mmap", "--no-mmap", dest="mmap", action=Toggle, negatives=("--no-mmap",), default=True,
                   help="use CPU weights in place in the file's memory map; --no-mmap copies them into memory")
    p.add_argument("--repack", "--no-repack", "-nr", dest="repack", action=Toggle, negatives=("--no-repack", "-nr"),
                   default=True, help="lay the CPU's Q4_0, Q8_0, Q4_K, Q5_K and Q6_K weights out in groups of 8 rows (faster products)")
    p.add_argument("--override-kv", dest="override_kv", action="extend", type=kv_override_arg, default=[],
                   metavar="KEY=TYPE:VALUE,...",
                   help="override model metadata (types int, float, bool, str; comma-separated or repeated)")
    add_rope_args(p)
    add_lora_args(p)
    p.add_argument("--check-tensors", action="store_true",
                   help="check every tensor's data for values that are not finite before loading (reads the file)")
    p.add_argument("--tokens", action="store_true", help="print the generated token ids, one line, instead of text")
    p.add_argument("--trace", metavar="PATH", help="write a trace of every decode step (JSON lines; also $PYLLAMA_TRACE)")
    p.add_argument("-v", "--verbose", action="store_true", help="log loading and timings to stderr")
    add_device_args(p)
    return p.finish()


def generate_tokens(ctx: Context, tokenizer: Tokenizer, prompt: Sequence[int], n_predict: int,
                    params: SamplingParams, ignore_eos: bool = False, seq: int = 0,
                    lora: Sequence[float] = ()) -> Iterator[int]:
    """Decodes the prompt, then yields sampled tokens until n_predict, end of text or a full
    context: one request on one slot of the batching core the server runs, stepped here (with
    `lora`, each LoRA adapter's scale)."""
    check_prompt_fits(len(prompt), ctx.seq_cap)
    slot = Slot(0, 0, seq, ctx.seq_cap, tokenizer)
    events = EventList()
    core = BatchCore(ctx, [slot], tokenizer, Metrics(), events, on_free=lambda s: None, probe=StepProbe(0))
    task = CompletionTask(prompt=list(prompt), params=params, n_predict=n_predict, ignore_eos=ignore_eos,
                          cache_prompt=False, lora=tuple(lora))
    try:
        core.place([(slot, task)])
        while True:
            stepped = core.step()
            for _, event in events.take():
                if isinstance(event, ErrorEvent):
                    raise PyllamaError(event.message)
                if isinstance(event, TokenEvent):
                    yield event.token
            if not slot.busy or not stepped:
                return
    finally:
        if slot.busy:  # the caller stopped early: the request ends as cancelled
            core.finish(slot, None)
        core.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    load_settings()  # the environment, read once: a bad value stops here
    if args.list_devices:
        print(list_devices(args))
        return 0
    if args.n_predict < -1:
        raise PyllamaError(f"-n {args.n_predict}: must be -1 (unlimited) or at least 0")
    if args.ctx_size < 0:
        raise PyllamaError(f"-c {args.ctx_size}: must be at least 0")
    params = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            seed=args.seed)
    try:
        params.validate()
    except ValueError as exc:
        raise PyllamaError(str(exc)) from None
    prompt_text = args.prompt
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as fh:
                prompt_text = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise PyllamaError(f"{args.file}: cannot read the prompt ({exc})") from None
    model_path = args.model
    if not model_path:
        from .models.default import default_model_path  # noqa: PLC0415
        model_path = default_model_path()
    try:
        traced = trace.start(args.trace, "generate")
    except OSError as exc:
        raise PyllamaError(f"--trace: {exc.strerror or exc}") from None
    if traced:  # SIGTERM ends through the normal exit path, which writes the trace out
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        return _run(args, params, prompt_text, model_path)
    finally:
        trace.close()


def _run(args, params: SamplingParams, prompt_text: str, model_path: str) -> int:
    t0 = time.perf_counter()
    backends, proportions = open_devices(args, model_path)
    engine = Engine(model_path, n_threads=args.threads, backends=backends, tensor_split=proportions,
                    map_weights=args.mmap, kv_overrides=model_overrides(args), repack=args.repack,
                    check_tensors=args.check_tensors, lora=[path for path, _ in lora_adapters(args)])
    hp = engine.model.hparams
    n_ctx = args.ctx_size or min(hp.n_ctx_train, 4096)
    ctx = engine.new_context(n_ctx, 1, args.batch_size, args.ubatch_size,
                             type_k=CACHE_TYPES[args.cache_type_k], type_v=CACHE_TYPES[args.cache_type_v])
    t_load = time.perf_counter() - t0
    prompt = engine.tokenizer.encode(prompt_text, add_special=True, parse_special=True)
    if not prompt:
        raise PyllamaError("the prompt is empty and the model adds no BOS token")
    check_prompt_fits(len(prompt), ctx.seq_cap)
    detok = IncrementalDetokenizer(engine.tokenizer)
    generated: list[int] = []
    t1 = time.perf_counter()
    lora = tuple(scale for _, scale in lora_adapters(args))
    for token in generate_tokens(ctx, engine.tokenizer, prompt, args.n_predict, params, args.ignore_eos, lora=lora):
        generated.append(token)
        if not args.tokens:
            sys.stdout.write(detok.feed(token))
            sys.stdout.flush()
    if args.tokens:
        print(" ".join(map(str, generated)))
    else:
        sys.stdout.write(detok.flush() + "\n")
    dt = time.perf_counter() - t1
    if args.verbose:
        print(f"load {t_load:.2f} s, prompt {len(prompt)} tokens, generated {len(generated)} tokens in {dt:.2f} s "
              f"({len(generated) / dt if dt > 0 else 0:.1f} tok/s incl. prompt)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_main(main)
