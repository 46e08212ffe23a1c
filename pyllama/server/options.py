"""The server's command line: llama-server's flags with their spellings, short forms and defaults,
each also read from PYLLAMA_ARG_<NAME> or LLAMA_ARG_<NAME> (pyllama's wins); pyllama's own flags
(pipeline groups, tracing, HTTP limits); and the llama-server flags pyllama refuses, each with its
reason (docs/server.md, "Flags", lists each as same, differs or not supported).

`parse_args` reads and checks a command line without loading anything (`resolve` fills in the
values that depend on others, `check_args` refuses what cannot run); `settings` and
`apply_settings` give the values ServerState holds; the other functions turn flags into what the
server starts with: the sampler defaults, the default grammar or schema, the chat template's
variables, the log level, the accepted-but-inert flags' log lines and --mlock."""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from .. import __version__
from ..models.lora import add_lora_args, lora_adapters  # noqa: F401 - lora_adapters: the server reads it here
from ..util import priority
from ..runtime.cache_types import CACHE_TYPES, DEFAULT_CACHE_TYPE
from ..util.affinity import cpu_set
from ..util.cli import Parser, Toggle, parse_bool
from ..runtime.placement.devices import add_device_args
from ..util.errors import PyllamaError
from ..models.gguf_file import kv_override_arg
from ..models.hparams import add_rope_args
from ..batching.sampling import SamplingParams, parse_samplers
from ..batching.speculative import NGRAM_TYPES, SPEC_TYPES, NgramMapSizes, SpecConfig
from ..runtime.placement.chunk import QUANT_PIPELINE_CHUNK
from .params import parse_logit_bias

if TYPE_CHECKING:
    import numpy as np

    from ..batching.constraint import ConstraintSpec

log = logging.getLogger("pyllama.server")

PROG = "python -m pyllama.server"
# llama-server's -np -1: 4 slots sharing one unified KV cache
AUTO_PARALLEL = 4
REASONING_FORMATS = ("auto", "none", "deepseek", "deepseek-legacy")
POOLING_TYPES = ("none", "mean", "cls", "last", "rank")

# llama-server flags pyllama does not have, and why: each is refused in one line (a server that
# silently ignored --lora or --mmproj would answer with another model than the one asked for)
_DRAFT = "not supported for the draft model (it runs on the local CPU; see -md)"
_SPEC = ("pyllama drafts with a draft model (-md) or n-grams (--spec-type ngram-simple or ngram-mod); this flag of "
         "another draft type or setting is not supported")
_MM = "multimodal projectors are not supported (text models only)"
_DL = "pyllama does not download models; pass a local GGUF file with -m"
_SAMPLER = "this sampler is not supported (adaptive-p is not in pyllama's sampler set)"
_FIT = "fitting to device memory is not supported (pyllama checks memory and refuses what does not fit)"
UNSUPPORTED: dict[str, str] = {
    **{f: "control vectors are not supported" for f in ("--control-vector", "--control-vector-scaled",
                                                        "--control-vector-layer-range")},
    "--spec-replace": "pyllama does not translate between vocabularies: the draft model must share the target's",
    **{f: _DRAFT for f in ("--draft-p-split", "-hfd", "-hfrd", "--hf-repo-draft", "-otd",
                           "--override-tensor-draft", "-cmoed", "--cpu-moe-draft", "-ncmoed", "--n-cpu-moe-draft",
                           "--mtp", "--dflash", "--eagle3", "-Cd", "--cpu-mask-draft", "-Crd", "--cpu-range-draft",
                           "--cpu-strict-draft", "--prio-draft", "--poll-draft", "-Cbd", "--cpu-mask-batch-draft",
                           "--cpu-strict-batch-draft", "--prio-batch-draft", "--poll-batch-draft",
                           "--no-spec-draft-backend-sampling")},
    **{f: _MM for f in ("-mm", "--mmproj", "-mmu", "--mmproj-url", "--no-mmproj", "--mmproj-auto",
                        "--no-mmproj-auto", "--mmproj-offload", "--no-mmproj-offload", "--image-min-tokens",
                        "--image-max-tokens", "--media-path", "--mtmd-batch-max-tokens")},
    **{f: _DL for f in ("-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-hft", "--hf-token", "-mu",
                        "--model-url", "-dr", "--docker-repo", "-cl", "--cache-list")},
    **{f: _SAMPLER for f in ("--adaptive-target", "--adaptive-decay")},
    **{f: "self-extend (group attention) is not supported" for f in ("-gan", "--grp-attn-n", "-gaw",
                                                                      "--grp-attn-w")},
    **{f: "tensor placement overrides are not supported (layers go to devices with -ngl, -dev, -ts)"
       for f in ("-ot", "--override-tensor")},
    **{f: "TLS is not supported; put a reverse proxy in front for HTTPS" for f in ("--ssl-key-file",
                                                                                    "--ssl-cert-file")},
    **{f: "agent tools and MCP are not supported" for f in ("--tools", "--mcp-servers-config", "--mcp-servers-json",
                                                            "-ag", "--agent", "-no-ag", "--no-agent", "--ui-mcp-proxy",
                                                            "--webui-mcp-proxy", "--no-ui-mcp-proxy",
                                                            "--no-webui-mcp-proxy")},
    **{f: "keeping earlier turns' reasoning in the prompt is not supported (the template's default is used)"
       for f in ("--reasoning-preserve", "--no-reasoning-preserve")},
    **{f: _FIT for f in ("-fitt", "--fit-target", "-fitc", "--fit-ctx", "-fitp", "--fit-print")},
    **{f: "this loading or memory option is not supported" for f in (
        "-lm", "--load-mode", "-dio", "--direct-io", "-ndio", "--no-direct-io", "--no-host")},
    **{f: "not supported" for f in ("-sys", "--system-prompt", "--system-prompt-file",
                                    "-sysf",
                                    "--log-prompts-dir",
                                    "--attention",
                                    "--server-base", "--completion-bash")},
}
# llama-server's presets (--fim-qwen-7b-default, --gpt-oss-20b-default, ...) fetch a model by name
UNSUPPORTED_PREFIXES = {"--spec-": _SPEC, "--fim-qwen-": _DL, "--gpt-oss-": _DL, "--vision-gemma-": _DL,
                        "--embd-gemma-": _DL}
# llama-server variables of unsupported flags: set in a container, they must not pass unnoticed
UNSUPPORTED_ENV = {"LLAMA_ARG_HF_REPO": "--hf-repo", "LLAMA_ARG_HF_FILE": "--hf-file",
                   "LLAMA_ARG_MODEL_URL": "--model-url", "LLAMA_ARG_DOCKER_REPO": "--docker-repo",
                   "LLAMA_ARG_MMPROJ": "--mmproj", "LLAMA_ARG_MMPROJ_URL": "--mmproj-url",
                   "LLAMA_ARG_OVERRIDE_TENSOR": "--override-tensor",
                   "LLAMA_ARG_SSL_KEY_FILE": "--ssl-key-file",
                   "LLAMA_ARG_SSL_CERT_FILE": "--ssl-cert-file"}


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least `minimum`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: '{text}'") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


def spec_types(text: str) -> tuple[str, ...]:
    """--spec-type: a comma-separated list, as llama-server takes it; `none` alone or dropped."""
    kinds = [k.strip() for k in text.split(",") if k.strip()] or ["none"]
    for kind in kinds:
        if kind not in SPEC_TYPES + ("draft-simple",):
            raise argparse.ArgumentTypeError(f"'{kind}': not a type pyllama drafts with (types: "
                                             f"{', '.join(SPEC_TYPES)}, draft-simple with -md)")
    return tuple(dict.fromkeys(k for k in kinds if k != "none"))


def _flash_attn(text: str) -> str:
    t = text.strip().lower()
    if t == "auto":
        return "auto"
    try:
        return "on" if parse_bool(t) else "off"
    except ValueError:
        raise argparse.ArgumentTypeError(f"unknown value for --flash-attn: '{text}' (on, off or auto)") from None


def _comma_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _sampler_names(text: str) -> tuple[str, ...]:
    try:
        return parse_samplers(text, letters=False)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _sampler_letters(text: str) -> tuple[str, ...]:
    try:
        return parse_samplers(text, letters=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _json_object(expected: str) -> Callable[[str], dict]:
    """An argparse type: a JSON object, else one error saying what was expected."""
    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"must be {expected}")
        return value
    return parse


_kwargs_json = _json_object("a JSON object, e.g. '{\"enable_thinking\": false}'")
_ui_json = _json_object("a JSON object of settings")


class _Version(argparse.Action):
    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="show version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"version: pyllama {__version__}", file=sys.stderr)
        parser.exit(0)


class _Usage(argparse.Action):
    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="show usage and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        parser.print_usage()
        parser.exit(0)


# the variables of the flags a router keeps: a model server that read them would route, or want a key
_ROUTER_ENV = ("MODELS_DIR", "MODELS_PRESET", "MODELS_MAX", "MODELS_AUTOLOAD", "NO_MODELS_AUTOLOAD",
               "SLEEP_IDLE_SECONDS", "MODELS_MEMORY", "API_KEY", "API_KEY_FILE", "API_PREFIX", "HOST", "PORT",
               "MODEL", "ALIAS")


def model_server_environment() -> dict[str, str]:
    """The environment a router gives its model servers: its own, less the variables of the flags
    the router keeps (as llama-server's router does)."""
    return {k: v for k, v in os.environ.items()
            if not any(k in (p + n, p + "NO_" + n) for p in ("LLAMA_ARG_", "PYLLAMA_ARG_") for n in _ROUTER_ENV)
            and k != "LLAMA_API_KEY"}


def build_parser() -> Parser:
    unsupported = sorted({f for f in UNSUPPORTED if f.startswith("--")})
    p = Parser(prog=PROG,
               description="Serve a GGUF model over HTTP with llama-server's API and the OpenAI-compatible API. "
                           "Flags follow llama-server's names, short forms, defaults and LLAMA_ARG_* variables.",
               epilog="llama-server flags that are refused as not supported: " + ", ".join(unsupported) +
                      ", " + ", ".join(f"{pre}*" for pre in UNSUPPORTED_PREFIXES) + ".")
    a = p.add_argument
    # --- model and slots
    a("-m", "--model", llama_env="LLAMA_ARG_MODEL", help="GGUF model file (default: the built-in test model)")
    a("-a", "--alias", type=_comma_list, llama_env="LLAMA_ARG_ALIAS",
      help="model names reported by the API, comma-separated; the first is the main one (default: the file name)")
    a("--tags", type=_comma_list, llama_env="LLAMA_ARG_TAGS", help="model tags, comma-separated (informational)")
    a("-c", "--ctx-size", type=int, default=0, llama_env="LLAMA_ARG_CTX_SIZE",
      help="total context size, 0 = the model's")
    a("-n", "--n-predict", "--predict", dest="n_predict", type=int, default=-1, llama_env="LLAMA_ARG_N_PREDICT",
      help="default tokens to generate per request, -1 = until done")
    a("-np", "--parallel", type=int, default=-1, llama_env="LLAMA_ARG_N_PARALLEL",
      help=f"number of slots (sequences decoded together), -1 = auto: {AUTO_PARALLEL} slots sharing one unified "
           "KV cache, as llama-server")
    a("-b", "--batch-size", type=int, default=2048, llama_env="LLAMA_ARG_BATCH", help="tokens per decode step at most")
    a("-ub", "--ubatch-size", type=int, default=512, llama_env="LLAMA_ARG_UBATCH", help="micro-batch size")
    a("-t", "--threads", type=int, default=0, llama_env="LLAMA_ARG_THREADS", help="compute threads, 0 = all cores")
    a("-tb", "--threads-batch", type=int, default=None, llama_env=None,
      help="accepted; pyllama computes prompts and generation with the same --threads")
    a("-C", "--cpu-mask", default=None, metavar="M", llama_env=None,
      help="CPU affinity mask, hexadecimal: the process runs on those CPUs (with --cpu-range: on either's)")
    a("-Cr", "--cpu-range", default=None, metavar="LO-HI", llama_env=None, help="CPU affinity as ranges, e.g. 0-3")
    a("--cpu-strict", type=int, choices=[0, 1], default=0, llama_env=None,
      help="0 (accepted); 1, one CPU per compute thread, is not supported")
    a("--poll", type=int, default=None, metavar="0..100", llama_env=None,
      help="accepted; pyllama's kernel helpers spin 0.2 ms for work before they sleep")
    a("-Cb", "--cpu-mask-batch", default=None, metavar="M", llama_env=None,
      help="accepted; prompts run on the threads (and CPUs) of generation")
    a("-Crb", "--cpu-range-batch", default=None, metavar="LO-HI", llama_env=None, help="as --cpu-mask-batch")
    a("--cpu-strict-batch", type=int, choices=[0, 1], default=None, llama_env=None, help="as --cpu-mask-batch")
    a("--poll-batch", type=int, default=None, metavar="0..100", llama_env=None, help="as --cpu-mask-batch")
    a("-kvo", "--kv-offload", "-nkvo", "--no-kv-offload", dest="kv_offload", action=Toggle,
      negatives=("-nkvo", "--no-kv-offload"), default=True, llama_env="LLAMA_ARG_KV_OFFLOAD",
      help="a layer's KV cache lives on the layer's device (on); --no-kv-offload, the cache of every layer in this "
           "host's memory, holds when every layer is local and is refused otherwise")
    a("--op-offload", "--no-op-offload", dest="op_offload", action=Toggle, negatives=("--no-op-offload",),
      default=None, llama_env=None,
      help="accepted; pyllama computes each op on the device that holds its weights (no host op is offloaded)")
    a("--numa", choices=["distribute", "isolate", "numactl"], default=None, llama_env="LLAMA_ARG_NUMA",
      help="accepted; pyllama places no memory or threads by NUMA node (a warning on a machine that has "
           "more than one)")
    a("-cmoe", "--cpu-moe", action="store_true", llama_env="LLAMA_ARG_CPU_MOE",
      help="keep every Mixture-of-Experts layer's experts on the CPU: pyllama places whole layers, so this "
           "holds when those layers are on the CPU, and a split that gives them to another device is refused")
    a("-ncmoe", "--n-cpu-moe", type=int, default=0, metavar="N", llama_env="LLAMA_ARG_N_CPU_MOE",
      help="the same for the first N layers")
    a("--prio", type=int, default=0, llama_env=None,
      help="priority of the server's threads (not the BLAS library's workers): " + priority.LEVELS_HELP
           + "; under SCHED_FIFO compute runs until it blocks, not time-sliced")
    a("--prio-batch", type=int, default=None, llama_env=None,
      help="accepted; pyllama's threads serve prompts and generation alike and take --prio")
    a("--pipeline-groups", type=int, default=1,
      help="N contexts of the model, each with its own batch and decode thread, so N batches are in "
           "flight over a layer split; must divide --parallel")
    a("--pipeline-chunk", type=int, default=None,
      help="with --pipeline-groups over a split: while another group generates, a group's step feeds at most N "
           "prompt tokens, so its prompts do not hold the stages that the other groups' steps wait for "
           f"(0 = no limit: prompts go in micro-batches of -ub; default {QUANT_PIPELINE_CHUNK} for a quantized "
           "model on CPU devices (local or rpc), whose products cost as much per token in small batches, else 0)")
    a("-ctk", "--cache-type-k", default=DEFAULT_CACHE_TYPE, choices=list(CACHE_TYPES),
      llama_env="LLAMA_ARG_CACHE_TYPE_K", help="KV cache type for K: f32, f16, bf16 or q8_0")
    a("-ctv", "--cache-type-v", default=DEFAULT_CACHE_TYPE, choices=list(CACHE_TYPES),
      llama_env="LLAMA_ARG_CACHE_TYPE_V", help="KV cache type for V: f32, f16, bf16 or q8_0")
    a("-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified", action=Toggle, negatives=("-no-kvu", "--no-kv-unified"),
      default=None, llama_env="LLAMA_ARG_KV_UNIFIED",
      help="one KV pool for all slots (a request may use the whole context) instead of C/P per slot "
           "(default: on with -np auto, else off)")
    a("--context-shift", "--no-context-shift", action=Toggle, negatives=("--no-context-shift",), default=False,
      llama_env="LLAMA_ARG_CONTEXT_SHIFT",
      help="when a request reaches its slot's context: keep its first --keep tokens, drop half of the "
           "rest and go on (otherwise the request ends with truncated: true)")
    a("--keep", type=int, default=0,
      help="prompt tokens a context shift keeps, -1 = the whole prompt (a request's n_keep overrides it)")
    a("-cb", "--cont-batching", "-nocb", "--no-cont-batching", action=Toggle, negatives=("-nocb", "--no-cont-batching"),
      default=True, llama_env="LLAMA_ARG_CONT_BATCHING",
      help="continuous batching; pyllama always batches continuously, --no-cont-batching is accepted and logged")
    a("-fa", "--flash-attn", type=_flash_attn, nargs="?", const="on", default="auto", metavar="on|off|auto",
      llama_env="LLAMA_ARG_FLASH_ATTN",
      help="accepted and logged: pyllama's attention is always one fused kernel")
    a("--warmup", "--no-warmup", dest="warmup", action=Toggle, negatives=("--no-warmup",), default=True,
      llama_env=None,
      help="decode one token per pipeline group before serving (then forget it), so that the first request "
           "does not pay for loading the weights' pages and the compute buffers")
    a("-fit", "--fit", dest="fit", choices=["on", "off"], default=None, llama_env="LLAMA_ARG_FIT",
      help="llama-server's fitting of unset options to device memory: 'off' is what pyllama does (it checks "
           "memory and refuses what does not fit); 'on' is refused")
    a("-cram", "--cache-ram", type=int, default=8192, metavar="MiB", llama_env="LLAMA_ARG_CACHE_RAM",
      help="prompt cache in host memory: the KV rows of prompts that slots give up (those whose request repeated "
           "or continued an earlier prompt, or shared its system prompt), loaded again by a request that continues "
           "one (-1: no limit, 0: off)")
    a("--cache-idle-slots", "--no-cache-idle-slots", dest="cache_idle_slots", action=Toggle,
      negatives=("--no-cache-idle-slots",), default=True, llama_env="LLAMA_ARG_CACHE_IDLE_SLOTS",
      help="when a request starts, save the prompts of its group's idle slots to the prompt cache too (needs "
           "--cache-ram)")
    a("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints", dest="ctx_checkpoints", type=int, default=None,
      metavar="N", llama_env="LLAMA_ARG_CTX_CHECKPOINTS",
      help="accepted: pyllama keeps sliding-window layers' whole KV cache, so any cached prefix is reused without "
           "checkpoints")
    a("-cms", "--checkpoint-min-step", type=int, default=None, metavar="N",
      llama_env="LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT", help="accepted, as --ctx-checkpoints")
    a("--swa-full", action="store_true", llama_env="LLAMA_ARG_SWA_FULL",
      help="accepted; the KV cache always keeps every position of sliding-window layers (a full-size cache)")
    a("--check-tensors", action="store_true", llama_env=None,
      help="check every tensor's data for values that are not finite (NaN, infinity) before loading; it reads "
           "the whole file")
    a("--mlock", action="store_true", llama_env="LLAMA_ARG_MLOCK",
      help="keep the process's memory (the model included) in RAM: mlockall; a failure is logged")
    a("--mmap", "--no-mmap", dest="mmap", action=Toggle, negatives=("--no-mmap",), default=True,
      llama_env="LLAMA_ARG_MMAP",
      help="use CPU weights in place in the file's memory map; --no-mmap copies them into memory")
    a("--repack", "--no-repack", "-nr", dest="repack", action=Toggle, negatives=("--no-repack", "-nr"),
      default=True, llama_env="LLAMA_ARG_REPACK",
      help="lay the CPU's Q4_0, Q8_0, Q4_K, Q5_K and Q6_K weights out in groups of 8 rows for faster products (the file's "
           "pages of those weights then leave memory); --no-repack computes on the file's layout")
    a("--override-kv", dest="override_kv", action="extend", type=kv_override_arg, default=[],
      metavar="KEY=TYPE:VALUE,...",
      help="override model metadata (types int, float, bool, str; comma-separated or repeated), "
           "e.g. tokenizer.ggml.pre=str:qwen2")
    add_rope_args(p)
    a("-dt", "--defrag-thold", type=float, default=None, llama_env="LLAMA_ARG_DEFRAG_THOLD",
      help="deprecated in llama-server and ignored, as there")
    a("--backend-sampling", "--no-backend-sampling", "-bs", action=Toggle, negatives=("--no-backend-sampling",),
      default=None, llama_env="LLAMA_ARG_BACKEND_SAMPLING",
      help="run every request's sampler chain on the device that holds the output layer (local or an rpc "
           "server that supports it): only token ids come back instead of the logits; default: on when "
           "the output layer is on an rpc server that supports it, off when it is local")
    a("--spec-type", type=spec_types, default=(), llama_env="LLAMA_ARG_SPEC_TYPE",
      help="speculative decoding, a comma-separated list of: none; draft-simple (a draft model, -md, which "
           "implies it); ngram-simple (a sequence drafts the tokens that followed the last earlier occurrence of its "
           "last n tokens); ngram-map-k (the same from a map of its n-grams, cut to what the key's last draft had "
           "accepted); ngram-map-k4v (the most frequent of up to 4 m-grams that followed the key); ngram-mod (a table "
           "of the n-grams seen gives the token that followed each, followed from the last n tokens); ngram-cache "
           "(counts of what followed each 1- to 4-gram, with -lcs/-lcd). Each sequence takes the draft of the "
           "first type, in that order, that has one; a step verifies it after the sampled token and keeps the "
           "tokens its sampler agrees with")
    a("--spec-default", action="store_true", llama_env=None,
      help="ngram-mod with n-match 24, n-min 48, n-max 64, as llama-server's default speculative configuration")
    a("--spec-ngram-simple-size-n", type=int_at_least(1), default=12, llama_env=None,
      help="ngram-simple: the n-gram looked up in the sequence's tokens")
    a("--spec-ngram-simple-size-m", type=int_at_least(1), default=48, llama_env=None,
      help="ngram-simple: at most this many tokens that followed it are drafted")
    a("--spec-ngram-simple-min-hits", type=int_at_least(1), default=1, llama_env=None,
      help="accepted; ngram-simple drafts on the first hit (as llama-server's, which reads it for nothing)")
    for name in ("map-k", "map-k4v"):
        a(f"--spec-ngram-{name}-size-n", type=int_at_least(1), default=12, llama_env=None,
          help=f"ngram-{name}: the n-gram (key) looked up in the sequence's tokens")
        a(f"--spec-ngram-{name}-size-m", type=int_at_least(1), default=48, llama_env=None,
          help=f"ngram-{name}: the m-gram drafted after it")
        a(f"--spec-ngram-{name}-min-hits", type=int_at_least(1), default=1, llama_env=None,
          help=f"ngram-{name}: the key's occurrences before it drafts" +
               (" (llama-server's ngram-map-k reads it for nothing, as here)" if name == "map-k" else ""))
    a("--spec-ngram-mod-n-match", type=int_at_least(1), default=24, llama_env=None,
      help="ngram-mod: the n-gram whose hash looks up the token that followed it")
    a("--spec-ngram-mod-n-min", type=int_at_least(0), default=48, llama_env=None,
      help="ngram-mod: a shorter draft is dropped")
    a("--spec-ngram-mod-n-max", type=int_at_least(1), default=64, llama_env=None,
      help="ngram-mod: at most this many tokens drafted")
    a("-lcs", "--lookup-cache-static", dest="lookup_cache_static", default=None, metavar="FNAME", llama_env=None,
      help="ngram-cache: a static lookup cache (bigrams of a corpus, llama.cpp's file layout; written by "
           "python -m pyllama.batching.lookup_cache --static)")
    a("-lcd", "--lookup-cache-dynamic", dest="lookup_cache_dynamic", default=None, metavar="FNAME", llama_env=None,
      help="ngram-cache: a dynamic lookup cache (1- to 4-grams of earlier generations), read, not updated")
    a("--spec-draft-n-max", "--draft-max", "--draft-n", "--draft", dest="spec_draft_n_max", type=int_at_least(0),
      default=None, llama_env="LLAMA_ARG_SPEC_DRAFT_N_MAX",
      help="tokens the draft model drafts per step (default 3); with n-gram drafts, a cap (default none)")
    a("--spec-draft-n-min", "--draft-min", "--draft-n-min", dest="spec_draft_n_min", type=int_at_least(0), default=0,
      llama_env="LLAMA_ARG_SPEC_DRAFT_N_MIN", help="a shorter draft is not verified")
    add_lora_args(p)
    a("-md", "--model-draft", "--spec-draft-model", dest="model_draft", default=None, metavar="FNAME",
      llama_env="LLAMA_ARG_SPEC_DRAFT_MODEL",
      help="draft model for speculative decoding: a small model of the same vocabulary, run on the local CPU; it "
           "drafts --spec-draft-n-max tokens greedily for every generating sequence, which the next step verifies")
    a("-cd", "--ctx-size-draft", dest="ctx_size_draft", type=int_at_least(0), default=0, llama_env=None,
      help="the draft model's context per group (0: the target's)")
    a("--spec-draft-p-min", "--draft-p-min", dest="spec_draft_p_min", type=float, default=0.0,
      llama_env="LLAMA_ARG_SPEC_DRAFT_P_MIN",
      help="the draft ends before a token the draft model gives less than this probability (default 0: never)")
    a("-devd", "--device-draft", "--spec-draft-device", dest="device_draft", default=None, llama_env=None,
      help="the draft model's device: only the local CPU (CPU, or none: no offload, as llama-server's)")
    a("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", "--spec-draft-ngl", dest="n_gpu_layers_draft",
      default=None, llama_env="LLAMA_ARG_N_GPU_LAYERS_DRAFT",
      help="draft layers on a GPU: the draft model runs on the local CPU, so any value keeps it there")
    a("-td", "--threads-draft", "--spec-draft-threads", dest="threads_draft", type=int, default=None, llama_env=None,
      help="the draft model's compute threads (default: -t)")
    a("-tbd", "--threads-batch-draft", "--spec-draft-threads-batch", dest="threads_batch_draft", type=int,
      default=None, llama_env=None, help="as -td")
    a("-ctkd", "--cache-type-k-draft", "--spec-draft-type-k", dest="cache_type_k_draft", default=None,
      choices=list(CACHE_TYPES), llama_env="LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K",
      help="the draft model's K cache type (default: -ctk)")
    a("-ctvd", "--cache-type-v-draft", "--spec-draft-type-v", dest="cache_type_v_draft", default=None,
      choices=list(CACHE_TYPES), llama_env="LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V",
      help="the draft model's V cache type (default: -ctv)")
    a("--embedding", "--embeddings", dest="embedding", action="store_true", llama_env="LLAMA_ARG_EMBEDDINGS",
      help="serve the embedding endpoints")
    a("--pooling", choices=list(POOLING_TYPES), default=None, llama_env="LLAMA_ARG_POOLING",
      help="pooling of embeddings: none, mean, cls, last or rank (a reranker's head; default: the model's, "
           "else none)")
    a("--rerank", "--reranking", dest="rerank", action="store_true", llama_env="LLAMA_ARG_RERANKING",
      help="serve /rerank (and the embedding endpoints) with rank pooling: needs a model with a reranker's head")
    a("--embd-normalize", type=int, default=2, llama_env=None,
      help="normalisation of embeddings when a request gives no embd_normalize: -1 none, 0 max absolute "
           "scaled to int16, 1 taxicab, 2 Euclidean, > 2 p-norm")
    # --- sampling defaults (a request's own fields override them)
    d = SamplingParams()
    a("--temp", "--temperature", dest="temp", type=float, default=d.temperature, help="temperature, <= 0 = greedy")
    a("--top-k", type=int, default=d.top_k, llama_env="LLAMA_ARG_TOP_K", help="top-k sampling, 0 = off")
    a("--top-p", type=float, default=d.top_p, help="top-p sampling, 1.0 = off")
    a("--min-p", type=float, default=d.min_p, help="min-p sampling, 0.0 = off")
    a("--repeat-penalty", type=float, default=d.repeat_penalty, help="repeat penalty, 1.0 = off")
    a("--repeat-last-n", type=int, default=d.repeat_last_n,
      help="tokens the penalties look back at, 0 = off, -1 = the context")
    a("--presence-penalty", type=float, default=d.presence_penalty, help="presence penalty, 0.0 = off")
    a("--frequency-penalty", type=float, default=d.frequency_penalty, help="frequency penalty, 0.0 = off")
    a("-s", "--seed", type=int, default=-1, help="RNG seed, -1 = random")
    a("--samplers", type=_sampler_names, default=None,
      help="the sampler chain, names separated by ';' (default: " + ";".join(d.samplers) + ")")
    a("--sampling-seq", "--sampler-seq", dest="sampling_seq", type=_sampler_letters, default=None,
      help="the sampler chain as letters (default: edskypmxt; e penalties, d dry, s top_n_sigma, k top_k, "
           "y typ_p, p top_p, m min_p, x xtc, t temperature)")
    a("--typical", "--typical-p", dest="typical", type=float, default=d.typical_p,
      help="locally typical sampling, 1.0 = off")
    a("--min-keep", type=int, default=d.min_keep, help="candidates each sampler must leave, 0 = no minimum")
    a("--top-nsigma", "--top-n-sigma", dest="top_nsigma", type=float, default=d.top_n_sigma,
      help="top-n-sigma sampling, -1 = off")
    a("--xtc-probability", type=float, default=d.xtc_probability, help="XTC probability, 0.0 = off")
    a("--xtc-threshold", type=float, default=d.xtc_threshold, help="XTC threshold, above 0.5 = off")
    a("--dry-multiplier", type=float, default=d.dry_multiplier, help="DRY multiplier, 0.0 = off")
    a("--dry-base", type=float, default=d.dry_base, help="DRY base")
    a("--dry-allowed-length", type=int, default=d.dry_allowed_length, help="DRY allowed repeat length")
    a("--dry-penalty-last-n", type=int, default=d.dry_penalty_last_n,
      help="tokens DRY looks back at, 0 = off, -1 = the context")
    a("--dry-sequence-breaker", dest="dry_sequence_breaker", action="append", default=None,
      help="a DRY sequence breaker; the first one replaces the defaults ('\\n', ':', '\"', '*'); 'none' for none")
    a("--mirostat", type=int, default=d.mirostat, help="mirostat sampling: 0 = off, 1 = mirostat, 2 = mirostat 2.0")
    a("--mirostat-lr", type=float, default=d.mirostat_eta, help="mirostat learning rate (eta)")
    a("--mirostat-ent", type=float, default=d.mirostat_tau, help="mirostat target entropy (tau)")
    a("--dynatemp-range", type=float, default=d.dynatemp_range, help="dynamic temperature range, 0.0 = off")
    a("--dynatemp-exp", type=float, default=d.dynatemp_exponent, help="dynamic temperature exponent")
    a("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")
    a("-l", "--logit-bias", dest="logit_bias", action="append", type=_logit_bias_arg, default=None,
      metavar="TOKEN_ID(+/-)BIAS", llama_env=None,
      help="the logit bias of a request that gives none (repeatable; biases of one token add up), "
           "e.g. 15043+1 or 15043-inf (never that token)")
    a("-r", "--reverse-prompt", dest="reverse_prompt", action="append", default=None, metavar="PROMPT", llama_env=None,
      help="stop generating at PROMPT when a request gives no stop strings (repeatable)")
    a("-sp", "--special", action="store_true", llama_env=None,
      help="render special (control) tokens in generated text and token probabilities")
    a("-e", "--escape", "--no-escape", dest="escape", action=Toggle, negatives=("--no-escape",), default=True,
      llama_env=None,
      help="process escape sequences (\\n, \\r, \\t, \\', \\\", \\\\, \\xHH) in --reverse-prompt and "
           "--dry-sequence-breaker")
    # --- constrained output: the default for requests that give no grammar, schema or response_format
    a("--grammar", default=None, metavar="GRAMMAR", help="GBNF grammar every output follows by default")
    a("--grammar-file", default=None, metavar="PATH", help="read --grammar from a file")
    a("-j", "--json-schema", default=None, metavar="SCHEMA",
      help="JSON schema every output follows by default (e.g. '{}' for any JSON value)")
    a("-jf", "--json-schema-file", default=None, metavar="PATH", help="read --json-schema from a file")
    # --- router mode (several models, each in its own server process): docs/server.md, "Router mode"
    a("--models-dir", default=None, metavar="PATH", llama_env="LLAMA_ARG_MODELS_DIR",
      help="router mode: serve the GGUF models of this folder (each *.gguf, and each subfolder holding one)")
    a("--models-preset", default=None, metavar="PATH", llama_env="LLAMA_ARG_MODELS_PRESET",
      help="router mode: an INI file of models and their options ([*] for every model)")
    a("--models-max", type=int_at_least(0), default=4, metavar="N", llama_env="LLAMA_ARG_MODELS_MAX",
      help="router mode: models loaded at once at most, 0 = unlimited; loading one more unloads the least "
           "recently used idle one")
    a("--models-autoload", "--no-models-autoload", dest="models_autoload", action=Toggle,
      negatives=("--no-models-autoload",), default=True, llama_env="LLAMA_ARG_MODELS_AUTOLOAD",
      help="router mode: load a model on its first request (a request may say ?autoload=false)")
    a("--sleep-idle-seconds", type=int_at_least(-1), default=-1, metavar="SECONDS",
      llama_env="LLAMA_ARG_SLEEP_IDLE_SECONDS",
      help="router mode: stop a model's server after this many seconds without requests (status sleeping; its "
           "next request loads it again), -1 = never")
    a("--models-memory", type=int_at_least(0), default=0, metavar="MiB", llama_env=None,
      help="router mode (pyllama's own): the memory the loaded models may take together, by their estimate "
           "(file size, KV cache, process); a load beyond it is refused; 0 = the memory available at start")
    # --- HTTP
    a("--host", default="127.0.0.1", llama_env="LLAMA_ARG_HOST", help="address to listen on")
    a("--port", type=int, default=8080, llama_env="LLAMA_ARG_PORT", help="port to listen on (0 = any free port)")
    a("--reuse-port", action="store_true", llama_env=None,
      help="listen with SO_REUSEPORT: several servers started with it share the port, the kernel spreading "
           "the connections over them")
    a("--offline", action="store_true", llama_env="LLAMA_OFFLINE",
      help="accepted: pyllama never downloads anything (models are local files)")
    a("--path", default=None, llama_env="LLAMA_ARG_STATIC_PATH", help="serve static files from this folder")
    a("--webui", "--ui", "--no-webui", "--no-ui", dest="webui", action=Toggle, negatives=("--no-webui", "--no-ui"),
      default=True, llama_env="LLAMA_ARG_UI", help="serve the page at /")
    a("--api-key", type=_comma_list, default=None, llama_env="LLAMA_API_KEY",
      help="API keys, comma-separated: every endpoint but /health wants one (Authorization: Bearer or X-Api-Key)")
    a("--api-key-file", default=None, llama_env="LLAMA_ARG_API_KEY_FILE", metavar="PATH",
      help="a file of API keys, one per line; lines starting with # are comments")
    a("--allow-any-host", action="store_true", llama_env=None,
      help="answer requests whatever their Host header; without it a server on a loopback address and "
           "without --api-key answers only the names localhost, 127.x.x.x and [::1] (421 otherwise), so that a "
           "web page on a rebound DNS name cannot use it")
    a("--ui-config", "--webui-config", dest="ui_config", type=_ui_json, default=None, metavar="JSON",
      llama_env="LLAMA_ARG_UI_CONFIG",
      help="default settings for a web page, as a JSON object: /props gives them as ui_settings (llama-server's "
           "page reads them; pyllama's own page does not)")
    a("--ui-config-file", "--webui-config-file", dest="ui_config_file", default=None, metavar="PATH",
      llama_env="LLAMA_ARG_UI_CONFIG_FILE", help="the same, from a JSON file")
    a("--cors-origins", type=_comma_list, default=None, llama_env="LLAMA_ARG_CORS_ORIGINS",
      help="origins allowed cross-origin, comma-separated, * for any (default: localhost origins only)")
    a("--cors-methods", type=_comma_list, default=None, llama_env="LLAMA_ARG_CORS_METHODS",
      help="the methods a CORS preflight allows, comma-separated (default: those of the path it asks about)")
    a("--cors-headers", type=_comma_list, default=None, llama_env="LLAMA_ARG_CORS_HEADERS",
      help="the request headers a CORS preflight allows, comma-separated, * for any (default: those it asks for)")
    a("--cors-credentials", "--no-cors-credentials", dest="cors_credentials", action=Toggle,
      negatives=("--no-cors-credentials",), default=True, llama_env="LLAMA_ARG_CORS_CREDENTIALS",
      help="allow credentials (cookies, Authorization) on the allowed origins' requests")
    a("-to", "--timeout", type=float, default=600.0, llama_env="LLAMA_ARG_TIMEOUT",
      help="server read/write timeout in seconds: how long a connection may wait on the client between requests")
    a("--api-prefix", default="", metavar="PREFIX", llama_env="LLAMA_ARG_API_PREFIX",
      help="serve every endpoint and page under this path (e.g. /llama), without the trailing slash")
    a("--sse-ping-interval", type=float, default=30.0, metavar="N", llama_env="LLAMA_ARG_SSE_PING_INTERVAL",
      help="seconds an event stream may send nothing before it gets an SSE comment as a ping "
           "(a long prompt, a slow first token); -1 disables")
    a("--threads-http", type=int, default=-1, llama_env="LLAMA_ARG_THREADS_HTTP",
      help="accepted; pyllama answers HTTP on one event loop (large bodies are parsed on worker threads)")
    a("--metrics", action="store_true", llama_env="LLAMA_ARG_ENDPOINT_METRICS",
      help="serve Prometheus metrics at /metrics (off: 501)")
    a("--slots", "--no-slots", dest="slots", action=Toggle, negatives=("--no-slots",), default=True,
      llama_env="LLAMA_ARG_ENDPOINT_SLOTS", help="serve the slots monitoring endpoint /slots (off: 501)")
    a("--props", action="store_true", llama_env="LLAMA_ARG_ENDPOINT_PROPS",
      help="allow changing global properties with POST /props")
    a("--slot-save-path", default=None, metavar="PATH", help="folder for /slots/{id}?action=save|restore files")
    a("-sps", "--slot-prompt-similarity", type=float, default=0.1,
      help="reuse a slot whose cached prompt covers more than this share of the new prompt, 0.0 = off")
    a("--cache-prompt", "--no-cache-prompt", dest="cache_prompt", action=Toggle, negatives=("--no-cache-prompt",),
      default=True, llama_env="LLAMA_ARG_CACHE_PROMPT",
      help="reuse a slot's cached prompt prefix when a request does not set cache_prompt")
    a("--cache-reuse", type=int, default=0, llama_env="LLAMA_ARG_CACHE_REUSE",
      help="accepted; pyllama reuses the cached prefix of a prompt, not chunks found by shifting the cache")
    a("--max-body", type=int, default=16 << 20, help="largest accepted request body in bytes")
    a("--max-body-buffered", type=int, default=0, metavar="BYTES", llama_env=None,
      help="request body bytes held at once across all connections (bodies arriving, queued and being handled); "
           "a body beyond it gets 503 at once (default 0: 4 times --max-body, at least 64 MiB)")
    a("--header-timeout", type=float, default=10.0,
      help="seconds a client has to send a request's headers (for the first request, counted from "
           "connecting); a slower client is disconnected")
    a("--body-timeout", type=float, default=60.0,
      help="seconds a client has to send a request's body once the headers are in; a slower one gets 408")
    a("--max-header-bytes", type=int, default=64 << 10,
      help="largest request line plus headers in bytes; a larger request gets 431")
    a("--max-prompts", type=int, default=2048, metavar="N", llama_env=None,
      help="completions one request may ask for at most: its prompts (a list of prompts, or of embedding inputs) "
           "times its choices (n, n_cmpl); more is a 400")
    a("--max-connections", type=int, default=1024,
      help="open client connections at most; at the limit the longest idle keep-alive connection is closed "
           "for a new one, and with none idle the new one gets 503 and is closed")
    a("--max-pipelined", type=int, default=8,
      help="requests read ahead on one connection while an earlier one is answered; at the limit the "
           "server stops reading from that connection until it catches up")
    # --- chat templates
    a("--spm-infill", action="store_true", llama_env=None,
      help="/infill prompts in suffix-prefix-middle order instead of prefix-suffix-middle (some models want it)")
    a("--jinja", "--no-jinja", dest="jinja", action=Toggle, negatives=("--no-jinja",), default=True,
      llama_env="LLAMA_ARG_JINJA",
      help="render the model's Jinja chat template; --no-jinja uses the built-in format it resembles")
    a("--chat-template", default=None, metavar="JINJA_TEMPLATE", llama_env="LLAMA_ARG_CHAT_TEMPLATE",
      help="a built-in template name (chatml, llama3, mistral-v7, gemma, ...) or Jinja template text, "
           "overriding the model's")
    a("--chat-template-file", default=None, metavar="PATH", llama_env="LLAMA_ARG_CHAT_TEMPLATE_FILE",
      help="read the Jinja chat template from this file")
    a("--chat-template-kwargs", type=_kwargs_json, default=None, metavar="JSON",
      llama_env="LLAMA_ARG_CHAT_TEMPLATE_KWARGS",
      help="a JSON object of extra template variables, e.g. '{\"enable_thinking\": false}'; a request's "
           "chat_template_kwargs override them")
    a("--prefill-assistant", "--no-prefill-assistant", dest="prefill_assistant", action=Toggle,
      negatives=("--no-prefill-assistant",), default=True, llama_env="LLAMA_ARG_PREFILL_ASSISTANT",
      help="continue a final assistant message instead of starting a new one")
    a("--reasoning-format", choices=list(REASONING_FORMATS), default="auto", llama_env="LLAMA_ARG_THINK",
      help="where the model's thinking (<think>...</think>) goes under a template that thinks: 'deepseek', "
           "'auto' and 'deepseek-legacy' put it in reasoning_content, 'none' leaves it in the content (under "
           "any other template it is content); a request's reasoning_format overrides it")
    a("--skip-chat-parsing", "--no-skip-chat-parsing", dest="skip_chat_parsing", action=Toggle,
      negatives=("--no-skip-chat-parsing",), default=False, llama_env="LLAMA_ARG_SKIP_CHAT_PARSING",
      help="read no tool calls and no reasoning out of chat replies: everything stays in the content")
    a("-rea", "--reasoning", choices=("on", "off", "auto"), default="auto", llama_env="LLAMA_ARG_REASONING",
      help="thinking in chat replies: the template gets enable_thinking true where it thinks ('on', "
           "'auto'), false where it does not or with 'off' (--chat-template-kwargs and a request's "
           "chat_template_kwargs override it)")
    a("--reasoning-budget", type=int, default=-1, metavar="N", llama_env="LLAMA_ARG_THINK_BUDGET",
      help="tokens a chat reply may spend thinking, after which its end tag is put in: -1 unrestricted, "
           "0 ends it at once; a request's thinking_budget_tokens overrides it")
    a("--reasoning-budget-message", default="", metavar="MESSAGE", llama_env="LLAMA_ARG_THINK_BUDGET_MESSAGE",
      help="text put in before the end tag when the reasoning budget is spent")
    # --- logging and the rest
    a("--log-disable", action="store_true", help="log nothing")
    a("--log-file", default=None, metavar="PATH", llama_env="LLAMA_ARG_LOG_FILE", help="also log to this file")
    a("-lv", "--verbosity", "--log-verbosity", dest="log_verbosity", type=int, default=3,
      llama_env="LLAMA_ARG_LOG_VERBOSITY",
      help="log threshold: 1 errors, 2 warnings, 3 info, 4 and more debug")
    a("--log-colors", default=None, help="accepted; pyllama's log has no colors")
    a("--log-prefix", "--no-log-prefix", dest="log_prefix", action=Toggle, negatives=("--no-log-prefix",),
      default=None, help="accepted; pyllama's log lines always carry a prefix")
    a("--log-timestamps", "--no-log-timestamps", dest="log_timestamps", action=Toggle,
      negatives=("--no-log-timestamps",), default=None, help="accepted; pyllama's log lines always carry a time")
    a("--perf", "--no-perf", dest="perf", action=Toggle, negatives=("--no-perf",), default=None,
      llama_env="LLAMA_ARG_PERF", help="accepted; pyllama always reports timings with each response")
    a("--trace", metavar="PATH",
      help="write a trace of every decode step, RPC command and device span (JSON lines; also $PYLLAMA_TRACE)")
    a("-v", "--verbose", "--log-verbose", dest="verbose", action="store_true",
      help="log everything, and add __verbose to completion responses")
    a("--version", action=_Version)
    a("--usage", action=_Usage)
    add_device_args(p)
    return p.finish()


# the --spec-* flags pyllama has (the others fall under UNSUPPORTED_PREFIXES)
SPEC_FLAGS = frozenset(("--spec-type", "--spec-default", "--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m",
                        "--spec-ngram-simple-min-hits", "--spec-ngram-map-k-size-n", "--spec-ngram-map-k-size-m",
                        "--spec-ngram-map-k-min-hits", "--spec-ngram-map-k4v-size-n", "--spec-ngram-map-k4v-size-m",
                        "--spec-ngram-map-k4v-min-hits", "--spec-ngram-mod-n-match", "--spec-ngram-mod-n-min", "--spec-ngram-mod-n-max",
                        "--spec-draft-n-max", "--spec-draft-n-min", "--spec-draft-model", "--spec-draft-p-min",
                        "--spec-draft-device", "--spec-draft-ngl", "--spec-draft-threads", "--spec-draft-threads-batch",
                        "--spec-draft-type-k", "--spec-draft-type-v"))


def _refuse_unsupported(argv: Sequence[str]) -> None:
    for arg in argv:
        if arg == "--":
            break
        name = arg.split("=", 1)[0]
        why = UNSUPPORTED.get(name)
        if why is None and name not in SPEC_FLAGS:
            why = next((w for pre, w in UNSUPPORTED_PREFIXES.items() if name.startswith(pre)), None)
        if why is not None:
            raise PyllamaError(f"{name}: llama-server flag not supported by pyllama: {why}")
    for var, flag in UNSUPPORTED_ENV.items():
        if os.environ.get(var):
            raise PyllamaError(f"{var} ({flag}): llama-server flag not supported by pyllama: {UNSUPPORTED[flag]}")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Reads and checks a command line (and the variables); a bad one raises PyllamaError (one
    line), --help and --version exit. Nothing is loaded."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _refuse_unsupported(argv)
    args = build_parser().parse_args(argv)
    resolve(args)
    check_args(args)
    return args


def resolve(args: argparse.Namespace) -> None:
    """Fills in the values that depend on others: -np auto, -kvu's default, the API keys."""
    n_groups = max(args.pipeline_groups, 1)
    if args.parallel == -1:
        # llama-server's auto: 4 slots on one unified KV cache (rounded up to a multiple of the groups)
        args.parallel = -(-AUTO_PARALLEL // n_groups) * n_groups
        if args.kv_unified is None:
            args.kv_unified = True
    if args.kv_unified is None:
        args.kv_unified = False
    if getattr(args, "rerank", False):  # as llama-server: reranking is embeddings with rank pooling
        args.embedding, args.pooling = True, "rank"
    # An option that names no key (`--api-key "$UNSET"`, a file of comments) is refused: read as
    # "no keys" it would start a server that anyone may use, the opposite of what was asked.
    keys = list(args.api_key or [])
    if args.api_key is not None and not keys:
        raise PyllamaError("--api-key (or LLAMA_API_KEY) names no key: it is empty or only commas and blanks; "
                           "give a key, or leave the option out to serve without one")
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as fh:
                from_file = [ln.strip() for ln in fh if ln.strip() and not ln.lstrip().startswith("#")]
        except OSError as exc:
            raise PyllamaError(f"--api-key-file {args.api_key_file}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise PyllamaError(f"--api-key-file {args.api_key_file}: not UTF-8 text ({exc.reason})") from None
        if not from_file:
            raise PyllamaError(f"--api-key-file {args.api_key_file} holds no key, only comments and blank lines")
        keys += from_file
    args.api_keys = keys
    if args.chat_template_file:
        try:
            with open(args.chat_template_file, encoding="utf-8") as fh:
                args.chat_template = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise PyllamaError(f"--chat-template-file {args.chat_template_file}: cannot read it ({exc})") from None
    if args.ui_config_file:
        try:
            with open(args.ui_config_file, encoding="utf-8") as fh:
                args.ui_config = _ui_json(fh.read())
        except (OSError, UnicodeDecodeError, argparse.ArgumentTypeError) as exc:
            raise PyllamaError(f"--ui-config-file {args.ui_config_file}: {getattr(exc, 'strerror', None) or exc}") \
                from None


def template_kwargs(args) -> Optional[dict]:
    """The chat template's extra variables: --chat-template-kwargs (--reasoning's enable_thinking
    is the template's own default, ChatTemplate.render_with_prefill)."""
    return dict(args.chat_template_kwargs) if args.chat_template_kwargs else None


def default_constraint(args) -> Optional["ConstraintSpec"]:
    """The constraint of --grammar / --grammar-file / --json-schema / --json-schema-file, or None.
    Raises PyllamaError for an unreadable file, two of them at once, or an invalid grammar or
    schema (its syntax is checked here, before the model loads)."""
    from ..batching.constraint import ConstraintSpec, check_spec, json_schema_spec  # noqa: PLC0415
    from .http import HTTPError  # noqa: PLC0415
    given = [(flag, value) for flag, value in (("--grammar", args.grammar), ("--grammar-file", args.grammar_file),
                                               ("--json-schema", args.json_schema),
                                               ("--json-schema-file", args.json_schema_file)) if value is not None]
    if not given:
        return None
    if len(given) > 1:
        raise PyllamaError(f"{given[0][0]} and {given[1][0]} cannot be used together: give one grammar or schema")
    flag, value = given[0]
    if flag.endswith("-file"):
        try:
            with open(value, encoding="utf-8") as fh:
                value = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise PyllamaError(f"{flag} {value}: cannot read it ({exc})") from None
    try:
        if flag.startswith("--grammar"):
            spec = ConstraintSpec("gbnf", value, flag)
        else:
            try:
                schema = json.loads(value)
            except ValueError as exc:
                raise PyllamaError(f"{flag}: not JSON ({exc})") from None
            spec = json_schema_spec(schema, flag)
        check_spec(spec)
    except HTTPError as exc:
        raise PyllamaError(exc.message.replace(f"'{flag}'", flag, 1)) from None
    return spec


def spec_kinds(args) -> tuple[str, ...]:
    """The speculative types asked for: --spec-type's, with ngram-mod for --spec-default and
    draft-simple wherever a draft model is given."""
    kinds = list(args.spec_type)
    if getattr(args, "spec_default", False) and "ngram-mod" not in kinds:
        kinds.append("ngram-mod")
    if args.model_draft and "draft-simple" not in kinds:
        kinds.append("draft-simple")
    return tuple(kinds)


def spec_config(args) -> SpecConfig:
    """The server's n-gram drafts from its flags (in llama-server's order of asking; the draft model,
    if any, is asked after them)."""
    kinds = spec_kinds(args)
    if getattr(args, "spec_default", False):
        match, lo, hi = 24, 48, 64
    else:
        match, lo, hi = args.spec_ngram_mod_n_match, args.spec_ngram_mod_n_min, args.spec_ngram_mod_n_max
    return SpecConfig(kinds=tuple(k for k in NGRAM_TYPES if k in kinds),
                      ngram_n=args.spec_ngram_simple_size_n, ngram_m=args.spec_ngram_simple_size_m,
                      map_k=NgramMapSizes(args.spec_ngram_map_k_size_n, args.spec_ngram_map_k_size_m,
                                          args.spec_ngram_map_k_min_hits),
                      map_k4v=NgramMapSizes(args.spec_ngram_map_k4v_size_n, args.spec_ngram_map_k4v_size_m,
                                            args.spec_ngram_map_k4v_min_hits),
                      mod_n_match=match, mod_n_min=lo, mod_n_max=hi,
                      lookup_static=args.lookup_cache_static or "", lookup_dynamic=args.lookup_cache_dynamic or "",
                      n_max=-1 if args.spec_draft_n_max is None else args.spec_draft_n_max, n_min=args.spec_draft_n_min)


def check_spec_args(args) -> None:
    """The draft model's flags against the others: a local draft; draft-simple needs a model; the
    lookup caches are read by ngram-cache only."""
    kinds = spec_kinds(args)
    if args.model_draft:
        if args.device_draft not in (None, "none", "CPU", "cpu"):
            raise PyllamaError(f"-devd {args.device_draft}: the draft model runs on the local CPU (CPU or none)")
        if not 0.0 <= args.spec_draft_p_min <= 1.0:
            raise PyllamaError(f"--spec-draft-p-min {args.spec_draft_p_min}: must be 0..1")
        for flag, value in (("-td", args.threads_draft), ("-tbd", args.threads_batch_draft)):
            if value is not None and value < 0:
                raise PyllamaError(f"{flag} {value}: must be 0 (all cores) or more")
    elif "draft-simple" in kinds:
        raise PyllamaError("--spec-type draft-simple needs a draft model (-md FILE)")
    if (args.lookup_cache_static or args.lookup_cache_dynamic) and "ngram-cache" not in kinds:
        raise PyllamaError("-lcs/-lcd: the lookup caches are read by --spec-type ngram-cache only")
    for flag, path in (("-lcs", args.lookup_cache_static), ("-lcd", args.lookup_cache_dynamic)):
        if path and not os.path.isfile(path):
            raise PyllamaError(f"{flag} {path}: no such file")


def router_mode(args) -> bool:
    """Whether the server is the router of several models: --models-dir or --models-preset without -m
    (as llama-server, which routes when it is given no model)."""
    return bool((getattr(args, "models_dir", None) or getattr(args, "models_preset", None))
                and not getattr(args, "model", None))


def check_args(args) -> None:
    if not hasattr(args, "api_keys"):  # straight from build_parser().parse_args()
        resolve(args)
    if getattr(args, "sleep_idle_seconds", -1) >= 0 and not router_mode(args):
        # one model's server does not free its model while it waits; only the router stops idle models
        raise PyllamaError(f"--sleep-idle-seconds {args.sleep_idle_seconds}: supported in router mode only "
                           "(--models-dir or --models-preset, without -m)")
    check_spec_args(args)
    if args.parallel < 1:
        raise PyllamaError(f"--parallel {args.parallel}: must be -1 (auto) or at least 1")
    if args.cpu_strict or args.cpu_strict_batch:
        raise PyllamaError("--cpu-strict 1: one CPU per compute thread is not supported (-C/-Cr restrict the process)")
    for flag, value in (("--poll", args.poll), ("--poll-batch", args.poll_batch)):
        if value is not None and not 0 <= value <= 100:
            raise PyllamaError(f"{flag} {value}: must be 0..100")
    args.cpus = cpu_set(args.cpu_mask, args.cpu_range)
    cpu_set(args.cpu_mask_batch, args.cpu_range_batch, "-Cb/-Crb")  # checked, then only logged
    for flag, level in (("--prio", args.prio), ("--prio-batch", args.prio_batch)):
        why = None if level is None else priority.check_level(level, flag)
        if why is not None:
            raise PyllamaError(why)
    if args.cache_ram < -1:
        raise PyllamaError(f"--cache-ram {args.cache_ram}: a size in MiB, -1 (no limit) or 0 (off)")
    if args.fit == "on":
        raise PyllamaError(f"--fit on: llama-server flag not supported by pyllama: {_FIT}")
    if args.embd_normalize < -1:
        raise PyllamaError(f"--embd-normalize {args.embd_normalize}: must be -1 (none), 0 (max absolute), "
                           "1 (taxicab), 2 (Euclidean) or more (p-norm)")
    if args.pipeline_chunk is not None and args.pipeline_chunk < 0:
        raise PyllamaError(f"--pipeline-chunk {args.pipeline_chunk}: must be 0 (no limit) or more")
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
    if args.api_prefix and (not args.api_prefix.startswith("/") or args.api_prefix.endswith("/")
                            or any(c in args.api_prefix for c in "?#% ")):
        raise PyllamaError(f"--api-prefix {args.api_prefix}: must start with '/' and not end with one "
                           "(e.g. /llama), without '?', '#', '%' or spaces")
    if args.reasoning_budget < -1:
        raise PyllamaError(f"--reasoning-budget {args.reasoning_budget}: must be -1 (unrestricted) or at least 0")
    if args.batch_size < 1 or args.ubatch_size < 1:
        raise PyllamaError("--batch-size and --ubatch-size must be at least 1")
    if not 0.0 <= args.slot_prompt_similarity <= 1.0:
        raise PyllamaError("--slot-prompt-similarity must lie between 0 and 1")
    if not 0 <= args.port <= 65535:
        raise PyllamaError(f"--port {args.port}: not a port number")
    if not args.timeout > 0:
        raise PyllamaError(f"--timeout {args.timeout}: must be more than 0 seconds")
    for flag, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)):
        if not value > 0:
            raise PyllamaError(f"{flag} {value}: must be more than 0 seconds")
    if args.max_body < 1:
        raise PyllamaError(f"--max-body {args.max_body}: must be at least 1")
    if args.max_header_bytes < 1024:
        raise PyllamaError(f"--max-header-bytes {args.max_header_bytes}: must be at least 1024")
    if args.max_body_buffered and args.max_body_buffered < args.max_body:
        raise PyllamaError(f"--max-body-buffered {args.max_body_buffered}: must be 0 (the default) or at least "
                           f"--max-body ({args.max_body})")
    if args.max_prompts < 1:
        raise PyllamaError(f"--max-prompts {args.max_prompts}: must be at least 1")
    if args.max_connections < 1 or args.max_pipelined < 1:
        raise PyllamaError("--max-connections and --max-pipelined must be at least 1")
    if args.rpc_timeout is not None and not 0 < args.rpc_timeout < float("inf"):
        raise PyllamaError(f"--rpc-timeout {args.rpc_timeout}: must be a positive number of seconds")
    if args.cache_reuse < 0:
        raise PyllamaError(f"--cache-reuse {args.cache_reuse}: must be at least 0")
    if args.split_mode in ("row", "tensor"):
        raise PyllamaError(f"--split-mode {args.split_mode} is not supported (pyllama splits by layers: layer or none)")
    if args.repeat_last_n < -1:
        raise PyllamaError(f"--repeat-last-n {args.repeat_last_n}: must be -1 (the context) or at least 0")
    if not 0 <= args.seed <= 0xFFFFFFFF and args.seed != -1:
        raise PyllamaError(f"--seed {args.seed}: must be -1 (random) or between 0 and 4294967295")
    try:
        sampling_defaults(args).validate()
    except ValueError as exc:
        raise PyllamaError(str(exc)) from None
    if args.chat_template is not None:
        from .chat import ChatTemplateError, template_from_option  # noqa: PLC0415
        try:  # a name or Jinja text is checked here, before the model loads
            template_from_option(args.chat_template, None, jinja=args.jinja)
        except ChatTemplateError as exc:
            flag = "--chat-template-file" if args.chat_template_file else "--chat-template"
            raise PyllamaError(f"{flag}: {exc}") from None
    default_constraint(args)
    if args.slot_save_path is not None and not os.path.isdir(args.slot_save_path):
        raise PyllamaError(f"--slot-save-path {args.slot_save_path}: not a folder")
    if args.path is not None and not os.path.isdir(args.path):
        raise PyllamaError(f"--path {args.path}: not a folder")


def sampling_defaults(args) -> SamplingParams:
    """The sampler settings a request gets for the fields it leaves out."""
    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          seed=args.seed if args.seed != -1 else SamplingParams().seed,
                          typical_p=args.typical, min_keep=args.min_keep, top_n_sigma=args.top_nsigma,
                          xtc_probability=args.xtc_probability, xtc_threshold=args.xtc_threshold,
                          dry_multiplier=args.dry_multiplier, dry_base=args.dry_base,
                          dry_allowed_length=args.dry_allowed_length, dry_penalty_last_n=args.dry_penalty_last_n,
                          dry_sequence_breakers=_dry_breakers(args.dry_sequence_breaker, args.escape),
                          mirostat=args.mirostat, mirostat_tau=args.mirostat_ent, mirostat_eta=args.mirostat_lr,
                          dynatemp_range=args.dynatemp_range, dynatemp_exponent=args.dynatemp_exp,
                          # --sampling-seq wins over --samplers when both are given (llama.cpp applies them in
                          # command-line order; the later one wins there)
                          samplers=args.sampling_seq or args.samplers or SamplingParams().samplers,
                          logit_bias=default_logit_bias(args))


def _logit_bias_arg(text: str) -> tuple[int, float]:
    """--logit-bias TOKEN_ID(+|-)BIAS, as llama.cpp reads it: 15043+1, 15043-0.5, 15043-inf."""
    head = text.strip()
    digits = len(head) - len(head.lstrip("0123456789"))
    sign, value = head[digits:digits + 1], head[digits + 1:].strip()
    try:
        bias = float(value) * (-1.0 if sign == "-" else 1.0)
    except ValueError:
        bias = math.nan
    if not digits or sign not in "+-" or not sign or math.isnan(bias) or bias == math.inf:
        raise argparse.ArgumentTypeError(f"'{text}': expected TOKEN_ID(+/-)BIAS, e.g. 15043+1 or 15043-inf "
                                         "(a bias is a number, or -inf to never produce the token)")
    return int(head[:digits]), bias


def default_logit_bias(args) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """--logit-bias's (ids, biases) sorted by id, biases of one token added up; None without it."""
    pairs = [[tok, False if bias == -math.inf else bias] for tok, bias in (getattr(args, "logit_bias", None) or ())]
    return parse_logit_bias({"logit_bias": pairs}, None) if pairs else None


def _dry_breakers(values: Optional[list[str]], escape: bool = True) -> tuple[str, ...]:
    """--dry-sequence-breaker: the first replaces the defaults; "none" alone means no breakers."""
    if values is None:
        return SamplingParams().dry_sequence_breakers
    if values == ["none"]:
        return ()
    return tuple(process_escapes(v) if escape else v for v in values if v != "none")


def default_stop(args) -> tuple[str, ...]:
    """The stop strings of a request that gives none: --reverse-prompt's, escapes processed (-e)."""
    return tuple(process_escapes(v) if args.escape else v for v in args.reverse_prompt or () if v)


_ESCAPES = {"n": b"\n", "r": b"\r", "t": b"\t", "'": b"'", '"': b'"', "\\": b"\\"}
_HEX = frozenset("0123456789abcdefABCDEF")


def process_escapes(text: str) -> str:
    """llama.cpp's escape processing of command-line strings: \\n \\r \\t \\' \\" \\\\ and \\xHH (a
    byte; bytes that do not form UTF-8 become U+FFFD); any other backslash stays as written."""
    out = bytearray()
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n:
            e = text[i + 1]
            if e in _ESCAPES:
                out += _ESCAPES[e]
                i += 2
                continue
            if e == "x" and i + 3 < n and text[i + 2] in _HEX and text[i + 3] in _HEX:
                out.append(int(text[i + 2:i + 4], 16))
                i += 4
                continue
        out += c.encode("utf-8")
        i += 1
    return out.decode("utf-8", errors="replace")


def settings(args) -> SimpleNamespace:
    """The fields of ServerState (server/api.py) that the command line sets, by name."""
    return SimpleNamespace(api_keys=list(args.api_keys), cors_origins=list(args.cors_origins or []),
                          cors_methods=list(args.cors_methods or []), cors_headers=list(args.cors_headers or []),
                          cors_credentials=bool(args.cors_credentials), ui_settings=dict(args.ui_config or {}),
                          slots_enabled=bool(args.slots), props_writable=bool(args.props),
                          slot_save_path=args.slot_save_path, metrics_enabled=bool(args.metrics),
                          verbose=bool(args.verbose), aliases=list(args.alias or []),
                          embd_normalize=int(args.embd_normalize))


def apply_settings(state: Any, args) -> None:
    """Sets the command line's values on a ServerState."""
    for name, value in vars(settings(args)).items():
        setattr(state, name, value)


def log_level(args) -> int:
    """The pyllama loggers' level: --log-disable, -v, else -lv (llama.cpp's 1 error .. 5 debug)."""
    if args.log_disable:
        return logging.CRITICAL + 10
    if args.verbose:
        return logging.DEBUG
    v = args.log_verbosity
    if v > 3:
        return logging.DEBUG
    return {2: logging.WARNING, 3: logging.INFO}.get(v, logging.ERROR)


def log_accepted(args) -> None:
    """One line for each llama-server flag that is accepted but changes nothing here."""
    if args.flash_attn != "auto":
        log.info("-fa %s: attention is always one fused kernel in pyllama", args.flash_attn)
    if not args.cont_batching:
        log.warning("--no-cont-batching: pyllama always batches continuously")
    if args.threads_batch is not None and args.threads_batch != args.threads:
        log.info("-tb %d: pyllama uses --threads (%d) for prompts and generation alike", args.threads_batch,
                 args.threads)
    if args.prio_batch is not None and args.prio_batch != args.prio:
        log.info("--prio-batch %d: pyllama's threads serve prompts and generation alike and take --prio (%d)",
                 args.prio_batch, args.prio)
    if args.op_offload is not None:
        log.info("--op-offload/--no-op-offload: pyllama computes each op on the device that holds its weights")
    if args.poll is not None or args.poll_batch is not None:
        log.info("--poll: pyllama's kernel helpers spin 0.2 ms for work before they sleep, whatever the level")
    if args.cpu_mask_batch or args.cpu_range_batch:
        log.info("-Cb/-Crb: prompts run on the threads of generation, on the CPUs of -C/-Cr")
    if args.numa is not None:
        nodes = [n for n in os.listdir("/sys/devices/system/node") if n.startswith("node")] \
            if os.path.isdir("/sys/devices/system/node") else []
        (log.warning if len(nodes) > 1 else log.info)(
            "--numa %s: pyllama places no memory or threads by NUMA node (this machine has %d)", args.numa,
            max(len(nodes), 1))
    if args.threads_http != -1:
        log.info("--threads-http %d: pyllama answers HTTP on one event loop", args.threads_http)
    if args.cache_reuse:
        log.info("--cache-reuse %d: pyllama reuses cached prompt prefixes only", args.cache_reuse)
    if args.defrag_thold is not None:
        log.warning("--defrag-thold is deprecated and no longer necessary to specify")
    if args.perf is not None:
        log.debug("--perf/--no-perf: pyllama always reports timings with each response")
    if args.log_colors is not None or args.log_prefix is not None or args.log_timestamps is not None:
        log.debug("--log-colors/--log-prefix/--log-timestamps: pyllama's log format is fixed")


def lock_memory() -> None:
    """--mlock: mlockall(MCL_CURRENT | MCL_FUTURE); a failure (RLIMIT_MEMLOCK) is a warning, as in
    llama.cpp."""
    import ctypes  # noqa: PLC0415
    import ctypes.util  # noqa: PLC0415
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.mlockall(1 | 2) != 0:
            err = ctypes.get_errno()
            log.warning("--mlock: mlockall failed (%s); raise the limit with ulimit -l", os.strerror(err))
        else:
            log.info("--mlock: the process's memory is locked in RAM")
    except (OSError, AttributeError) as exc:
        log.warning("--mlock: not available here (%s)", exc)
