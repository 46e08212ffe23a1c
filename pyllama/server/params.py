"""Request bodies to task parameters, checked field by field: a wrong type or an out-of-range value
is a 400 naming the field, never an exception from deep inside the engine."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from ..util.errors import PyllamaError
from ..batching.sampling import MAX_POST_SAMPLING_PROBS, SamplingParams, cached_breaker_table, parse_samplers
from ..tokenizer import Tokenizer
from ..batching.constraint import ConstraintSpec, json_schema_spec
from ..batching.lazy_grammar import TRIGGER_KINDS, Trigger
from .http import HTTPError

# Candidates per token: llama-server's default probabilities (the raw logits' softmax, computed on
# the host from the logits row) take any count, bounded here so that one request cannot make every
# token's entry a slice of the vocabulary; probabilities after the sampler chain come from the
# sampling kernel, which keeps at most MAX_POST_SAMPLING_PROBS per row.
MAX_N_PROBS = 1024
# Integer fields are int32 in llama-server; JSON integers are unbounded here, and a value past
# int32 is never meaningful (n_predict 1e18 would only run until the slot is full).
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
# Every generated token is matched against every stop string on the decode thread, which all slots
# of a group share: 100000 stop strings cost about 0.1 s per token for everyone.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256


def _bad(name: str, what: str) -> HTTPError:
    return HTTPError(400, f"'{name}' must be {what}")


def get_int(body: dict, name: str, default: Optional[int], lo: Optional[int] = None, hi: Optional[int] = None) -> Optional[int]:
    """An integer field (a float with an integral value is accepted), within [lo, hi] (int32 by default)."""
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise _bad(name, "an integer")
    v = int(v)
    lo = INT32_MIN if lo is None else lo
    hi = INT32_MAX if hi is None else hi
    if not lo <= v <= hi:
        raise _bad(name, f"between {lo} and {hi}")
    return v


def get_float(body: dict, name: str, default: float) -> float:
    """A finite number field; an integer literal beyond the float range is refused, not an OverflowError."""
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(name, "a number")
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise _bad(name, "a finite number")
    return f


def get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, "true or false")
    return v


def get_stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        stops = [v]
    elif isinstance(v, list) and all(isinstance(s, str) for s in v):
        stops = list(v)
    else:
        raise _bad("stop", "a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise HTTPError(400, f"'stop' holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise HTTPError(400, f"'stop' strings must be at most {MAX_STOP_CHARS} characters long")
    return stops


def get_breakers(body: dict, default: tuple[str, ...]) -> tuple[str, ...]:
    """llama-server's `dry_sequence_breakers`: a non-empty list of strings."""
    v = body.get("dry_sequence_breakers")
    if v is None:
        return tuple(default)
    if not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
        raise _bad("dry_sequence_breakers", "a non-empty list of strings")
    if len(v) > MAX_STOP_STRINGS:
        raise HTTPError(400, f"'dry_sequence_breakers' holds {len(v)} strings; at most {MAX_STOP_STRINGS} are allowed")
    return tuple(v)


def get_samplers(body: dict, default: tuple[str, ...]) -> tuple[str, ...]:
    """llama-server's `samplers`: a list of sampler names or a string of their letters (\"edskypmxt\").
    An unknown or unsupported sampler is a 400 (llama-server skips it with a warning)."""
    v = body.get("samplers")
    if v is None:
        return tuple(default)
    if not isinstance(v, (str, list)):
        raise _bad("samplers", "a list of sampler names or a string of sampler letters")
    try:
        return parse_samplers(v)
    except ValueError as exc:
        raise HTTPError(400, f"'samplers': {exc}") from None


def parse_logit_bias(body: dict, n_vocab: Optional[int], tokenizer: Optional[Tokenizer] = None) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """llama-server's `logit_bias`: `[[token, bias], ...]` or OpenAI's `{"token": bias, ...}`, where
    a token is an id or a string (every token of its encoding gets the bias) and a bias is a number
    or `false` (never produce the token). Biases of a repeated token add up. Returns (ids, biases)
    sorted by id, or None."""
    v = body.get("logit_bias")
    if v is None:
        return None
    if isinstance(v, dict):
        pairs = list(v.items())
    elif isinstance(v, list):
        pairs = []
        for e in v:
            if not isinstance(e, list) or len(e) != 2:
                raise _bad("logit_bias", "a list of [token, bias] pairs")
            pairs.append((e[0], e[1]))
    else:
        raise _bad("logit_bias", "an object or an array")
    if n_vocab is not None and len(pairs) > n_vocab:
        raise HTTPError(400, f"'logit_bias' has {len(pairs)} entries but the vocabulary has {n_vocab} tokens")
    ids: list[int] = []
    biases: list[float] = []
    for tok, bias in pairs:
        if bias is False:
            b = -math.inf
        elif isinstance(bias, (int, float)) and not isinstance(bias, bool) and abs(bias) <= 1e30:
            b = float(bias)  # (NaN fails the comparison; a huge int is compared before any conversion)
        else:
            raise HTTPError(400, f"'logit_bias' value {bias!r} for {tok!r} must be a finite number or false")
        if isinstance(tok, str) and isinstance(v, dict) and tok.isascii() and tok.lstrip("-").isdigit() \
                and len(tok) <= 12:
            tok = int(tok)  # OpenAI's keys are token ids written as strings
        if isinstance(tok, int) and not isinstance(tok, bool):
            if tok < 0 or (n_vocab is not None and tok >= n_vocab):
                raise HTTPError(400, f"'logit_bias' names token {tok} outside the vocabulary of {n_vocab}")
            toks = [tok]
        elif isinstance(tok, str) and tokenizer is not None:
            toks = tokenizer.encode(tok, add_special=False)
        else:
            raise HTTPError(400, f"'logit_bias' key {tok!r} must be a token id or a string")
        ids.extend(toks)
        biases.extend([b] * len(toks))
    if not ids:
        return None
    uniq, inverse = np.unique(np.asarray(ids, dtype=np.int64), return_inverse=True)
    summed = np.zeros(len(uniq), dtype=np.float64)
    np.add.at(summed, inverse, np.asarray(biases, dtype=np.float64))
    return uniq.astype(np.int32), summed.astype(np.float32)


def tokenize_prompt(tok: Tokenizer, prompt: Any, name: str = "prompt") -> list[int]:
    """llama-server's prompt forms: text, token ids, or a list mixing text pieces and ids."""
    if isinstance(prompt, str):
        return tok.encode(prompt, add_special=True, parse_special=True)
    if isinstance(prompt, list) and prompt:
        if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return tokenize_prompt(tok, prompt[0], name)
        out: list[int] = []
        for i, piece in enumerate(prompt):
            if isinstance(piece, str):
                out.extend(tok.encode(piece, add_special=(i == 0), parse_special=True))
            elif isinstance(piece, int) and not isinstance(piece, bool):
                if not 0 <= piece < tok.n_vocab:
                    raise HTTPError(400, f"'{name}' holds token id {piece} outside the vocabulary of {tok.n_vocab}")
                out.append(piece)
            else:
                raise _bad(name, "a string, a list of token ids, or a list mixing strings and token ids")
        return out
    if isinstance(prompt, list):
        raise HTTPError(400, f"'{name}' is empty")
    raise _bad(name, "a string or a list of token ids")


def split_prompts(prompt: Any) -> list[Any]:
    """llama-server's prompt forms, one or several: text, token ids, or text and ids mixed are one
    prompt; a list of such prompts is several (each gets its own result)."""
    if isinstance(prompt, str) or not isinstance(prompt, list) or not prompt:
        return [prompt]
    if all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        return [prompt]
    if any(isinstance(x, str) for x in prompt) and any(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        return [prompt]  # mixed text and ids
    return list(prompt)


@dataclass
class CompletionParams:
    sampling: SamplingParams
    n_predict: int = -1
    stream: bool = False
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    n_probs: int = 0
    cache_prompt: bool = True
    id_slot: int = -1
    n: int = 1
    include_usage: bool = False
    n_keep: int = 0         # prompt tokens a context shift keeps, -1: all of them
    return_tokens: bool = False       # the generated token ids in the final result
    response_fields: list[str] = field(default_factory=list)  # only these fields ("a/b" nested) of the result
    timings_per_token: bool = False
    return_progress: bool = False     # streamed prompt_progress chunks
    post_sampling_probs: bool = False  # n_probs as probabilities after the sampler chain
    constraint: Optional[ConstraintSpec] = None  # grammar / JSON schema the output must follow
    triggers: tuple = ()    # grammar_lazy: the constraint applies from the first of these (lazy_grammar.Trigger)
    thinking_budget: int = -1  # chat: >= 0, tokens the reply may spend thinking (reasoning.ThinkingBudget)
    thinking_end: list[int] = field(default_factory=list)
    thinking_open: bool = False
    spec_n_max: int = -1    # speculative.n_max: draft tokens per step at most (-1: the server's)
    spec_n_min: int = 0     # speculative.n_min: a shorter draft is not verified
    n_indent: int = 0       # > 0: a generated line indented less than this ends the generation
    t_max_predict_ms: int = -1  # > 0: generation ends at the first newline after this long
    n_discard: int = 0      # tokens a context shift drops after n_keep (0: half of the rest)
    verbose: Optional[bool] = None  # the result's __verbose (None: the server's -v)
    sse_ping_interval: Optional[int] = None  # seconds between pings of a silent stream (None: the server's)
    backend_sampling: Optional[bool] = None  # asked for, checked against what the server does (None: any)
    lora: Optional[list] = None  # the request's 'lora' entries as given (checked against the adapters by parse_lora)


# llama-server's request fields that pyllama does not honour (tools/server/server-schema.cpp's
# completion schema, server-common.cpp's OpenAI parsers): each is a 400 naming it, unless its value
# is the one that asks for nothing (`None` is always that: JSON null reads as an absent field).
# name -> (the values that ask for nothing, why the others are refused)
_INTERNAL = "is set by llama-server's own chat endpoints; pyllama derives it from the model's chat template"
_SPECULATIVE = "only speculative.n_max and speculative.n_min can be set per request"
UNHONOURED_FIELDS: dict[str, tuple[Any, str]] = {
    "t_max_prompt_ms": (lambda v: _number(v) and v <= 0, "a time limit on prompt processing is not supported "
                                                         "(llama-server does not implement it either)"),
    "grammar_type": (lambda v: False, _INTERNAL),
    "chat_format": (lambda v: False, _INTERNAL),
    "chat_parser": (lambda v: False, _INTERNAL),
    "generation_prompt": (lambda v: False, _INTERNAL),
    "message_delimiters": (lambda v: False, _INTERNAL),
    "parse_tool_calls": (lambda v: False, _INTERNAL + " (tool calls are read when the request gives 'tools')"),
    "reasoning_budget_start_tag": (lambda v: False, _INTERNAL),
    "reasoning_budget_end_tags": (lambda v: False, _INTERNAL),
    "reasoning_budget_end_tag": (lambda v: False, _INTERNAL),
    "reasoning_control": (lambda v: v is False, "ending the reasoning at run time "
                                                 "(/v1/chat/completions/control) is not supported"),
    "n_cache_reuse": (lambda v: v == 0, "reusing cached chunks by shifting them (--cache-reuse) is not supported; "
                                        "a cached prompt prefix is reused"),
    "adaptive_target": (lambda v: _number(v) and v < 0, "the adaptive-p sampler is not supported"),
    "adaptive_decay": (lambda v: v == 0.9, "the adaptive-p sampler is not supported"),
    **{f"speculative.{name}": (lambda v: False, _SPECULATIVE)
       for name in ("p_min", "type", "ngram_size_n", "ngram_size_m", "ngram_min_hits")},
    "echo": (lambda v: v is False, "echoing the prompt is not supported"),
    "best_of": (lambda v: v == 1, "best_of is not supported (use n for several completions)"),
    "suffix": (lambda v: False, "a suffix is not supported here (use /infill for fill-in-the-middle)"),
}

# Fields that only a chat request (/v1/chat/completions, /v1/messages, /v1/responses) reads: on
# /completion, /v1/completions and /infill, a 400 naming them.
CHAT_ONLY_FIELDS = ("messages", "tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt",
                    "continue_final_message", "chat_template_kwargs", "reasoning_format", "reasoning_effort",
                    "thinking_budget_tokens", "reasoning_budget_tokens", "reasoning_budget_message")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_unhonoured(body: dict) -> None:
    """A 400 naming the first llama-server field of the body that pyllama does not honour."""
    for name, (asks_nothing, why) in UNHONOURED_FIELDS.items():
        v = body.get(name)
        if v is not None and not asks_nothing(v):
            raise HTTPError(400, f"'{name}' is not supported: {why}")


def check_not_chat(body: dict, endpoint: str) -> None:
    """A 400 naming a chat-only field given to a text completion endpoint."""
    for name in CHAT_ONLY_FIELDS:
        if body.get(name) is not None:
            raise HTTPError(400, f"'{name}' applies to chat requests (/v1/chat/completions, /v1/messages, "
                                 f"/v1/responses), not to {endpoint}")


def get_fields(body: dict) -> list[str]:
    v = body.get("response_fields")
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _bad("response_fields", "a list of strings")
    return v


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request gets for the fields it leaves out: the server's --temp, --top-k, ...,
    --ignore-eos, --cache-prompt, and --reverse-prompt's stop strings (used when a request gives no
    stop string, as llama-server's)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ignore_eos: bool = False
    cache_prompt: bool = True
    stop: tuple[str, ...] = ()


# set once at start-up by the server (set_generation_defaults)
_GENERATION_DEFAULTS = GenerationDefaults()


def set_generation_defaults(sampling: Optional[SamplingParams] = None, ignore_eos: bool = False,
                            cache_prompt: bool = True, stop: Sequence[str] = ()) -> None:
    """The defaults parse_completion uses for the fields a request omits (None: llama-server's)."""
    global _GENERATION_DEFAULTS
    _GENERATION_DEFAULTS = GenerationDefaults(sampling or SamplingParams(), bool(ignore_eos), bool(cache_prompt),
                                              tuple(stop))


def check_generation_defaults(n_vocab: int) -> None:
    """Refuses (PyllamaError) defaults the loaded model cannot take: a --logit-bias token beyond
    its vocabulary would fail every request that gives no logit_bias of its own."""
    bias = _GENERATION_DEFAULTS.sampling.logit_bias
    if bias is not None and len(bias[0]) and int(bias[0][-1]) >= n_vocab:
        raise PyllamaError(f"--logit-bias: token {int(bias[0][-1])} is outside the vocabulary of {n_vocab} tokens")


def parse_completion(body: Any, default_n_predict: int, n_slots: int, oai: bool = False,
                     n_vocab: Optional[int] = None, tokenizer: Optional[Tokenizer] = None,
                     default_n_keep: int = 0) -> CompletionParams:
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    check_unhonoured(body)
    n_predict = default_n_predict
    for name in ("n_predict", "max_tokens", "max_completion_tokens"):
        if body.get(name) is not None:
            n_predict = get_int(body, name, default_n_predict, lo=-1)  # type: ignore[assignment]
    post_sampling = get_bool(body, "post_sampling_probs", False)
    hi = MAX_POST_SAMPLING_PROBS if post_sampling else MAX_N_PROBS
    # llama-server reads `logprobs` as n_probs's other name when n_probs is absent
    n_probs = get_int(body, "n_probs" if oai or body.get("n_probs") is not None else "logprobs", 0, lo=0, hi=hi) or 0
    if body.get("top_logprobs") is not None and body.get("logprobs") is not True:
        raise HTTPError(400, "'top_logprobs' requires 'logprobs' to be set to true")
    if oai:  # OpenAI's forms: completions take an int, chat takes a bool plus top_logprobs
        lp = body.get("logprobs")
        if isinstance(lp, bool):  # without top_logprobs, llama-server's 20 alternatives per token
            n_probs = get_int(body, "top_logprobs", 20, lo=0, hi=hi) if lp else 0  # type: ignore[assignment]
        elif lp is not None:
            n_probs = get_int(body, "logprobs", 0, lo=0, hi=hi)  # type: ignore[assignment]
    given = _GENERATION_DEFAULTS
    defaults = given.sampling
    sampling = SamplingParams(
        temperature=get_float(body, "temperature", defaults.temperature),
        top_k=get_int(body, "top_k", defaults.top_k),  # type: ignore[arg-type]
        top_p=get_float(body, "top_p", defaults.top_p),
        min_p=get_float(body, "min_p", defaults.min_p),
        repeat_penalty=get_float(body, "repeat_penalty", defaults.repeat_penalty),
        repeat_last_n=get_int(body, "repeat_last_n", defaults.repeat_last_n),  # type: ignore[arg-type]
        frequency_penalty=get_float(body, "frequency_penalty", defaults.frequency_penalty),
        presence_penalty=get_float(body, "presence_penalty", defaults.presence_penalty),
        seed=get_int(body, "seed", defaults.seed, lo=-1, hi=0xFFFFFFFF),  # type: ignore[arg-type]
        # the kernel's share: the default probabilities are computed from the logits row instead
        n_probs=min(n_probs, MAX_POST_SAMPLING_PROBS),
        # a request's logit_bias replaces --logit-bias's (llama-server's)
        logit_bias=parse_logit_bias(body, n_vocab, tokenizer) if "logit_bias" in body else defaults.logit_bias,
        typical_p=get_float(body, "typical_p", defaults.typical_p),
        min_keep=get_int(body, "min_keep", defaults.min_keep, lo=0),  # type: ignore[arg-type]
        top_n_sigma=get_float(body, "top_n_sigma", defaults.top_n_sigma),
        xtc_probability=get_float(body, "xtc_probability", defaults.xtc_probability),
        xtc_threshold=get_float(body, "xtc_threshold", defaults.xtc_threshold),
        dry_multiplier=get_float(body, "dry_multiplier", defaults.dry_multiplier),
        dry_base=get_float(body, "dry_base", defaults.dry_base),
        dry_allowed_length=get_int(body, "dry_allowed_length", defaults.dry_allowed_length, lo=0),  # type: ignore[arg-type]
        dry_penalty_last_n=get_int(body, "dry_penalty_last_n", defaults.dry_penalty_last_n, lo=-1),  # type: ignore[arg-type]
        dry_sequence_breakers=get_breakers(body, defaults.dry_sequence_breakers),
        mirostat=get_int(body, "mirostat", defaults.mirostat, lo=0, hi=2),  # type: ignore[arg-type]
        mirostat_tau=get_float(body, "mirostat_tau", defaults.mirostat_tau),
        mirostat_eta=get_float(body, "mirostat_eta", defaults.mirostat_eta),
        dynatemp_range=get_float(body, "dynatemp_range", defaults.dynatemp_range),
        dynatemp_exponent=get_float(body, "dynatemp_exponent", defaults.dynatemp_exponent),
        samplers=get_samplers(body, defaults.samplers),
    )
    try:
        sampling.validate()
    except ValueError as exc:
        raise HTTPError(400, str(exc)) from None
    if tokenizer is not None and sampling.dry_active and "dry" in sampling.samplers and not sampling.mirostat:
        # the breakers as token sequences: one pass over the vocabulary per breaker list, then cached
        sampling.dry_breaker_table = cached_breaker_table(tokenizer, sampling.dry_sequence_breakers)
    n = get_int(body, "n_cmpl" if body.get("n_cmpl") is not None else "n", 1, lo=1)  # llama-server: n_cmpl
    assert n is not None
    if n > n_slots:
        raise HTTPError(400, f"'n' (or 'n_cmpl') is {n} but the server has {n_slots} slots per group")
    opts = body.get("stream_options")
    include_usage = isinstance(opts, dict) and opts.get("include_usage") is True
    return CompletionParams(
        sampling=sampling, n_predict=n_predict, stream=get_bool(body, "stream", False),
        stop=get_stop(body) or list(given.stop),
        ignore_eos=get_bool(body, "ignore_eos", given.ignore_eos), n_probs=n_probs,
        cache_prompt=get_bool(body, "cache_prompt", given.cache_prompt), id_slot=get_int(body, "id_slot", -1, lo=-1),  # type: ignore[arg-type]
        n=n, include_usage=include_usage, n_keep=get_int(body, "n_keep", default_n_keep, lo=-1),  # type: ignore[arg-type]
        return_tokens=get_bool(body, "return_tokens", False), response_fields=get_fields(body),
        timings_per_token=get_bool(body, "timings_per_token", False),
        return_progress=get_bool(body, "return_progress", False),
        post_sampling_probs=post_sampling,
        constraint=(constraint := parse_constraint(body)),
        triggers=parse_triggers(body, tokenizer, n_vocab) if constraint is not None else (),
        spec_n_max=get_int(body, "speculative.n_max", -1, lo=-1),  # type: ignore[arg-type]
        spec_n_min=get_int(body, "speculative.n_min", 0, lo=0),  # type: ignore[arg-type]
        n_indent=get_int(body, "n_indent", 0, lo=0),  # type: ignore[arg-type]
        t_max_predict_ms=get_int(body, "t_max_predict_ms", -1, lo=-1, hi=2**63 - 1),  # type: ignore[arg-type]
        n_discard=get_int(body, "n_discard", 0, lo=0),  # type: ignore[arg-type]
        verbose=body.get("verbose") if body.get("verbose") is None else get_bool(body, "verbose", False),
        sse_ping_interval=get_int(body, "sse_ping_interval", None, lo=-1),
        backend_sampling=body.get("backend_sampling") if body.get("backend_sampling") is None
        else get_bool(body, "backend_sampling", False),
        lora=_lora_field(body))


def _lora_field(body: dict) -> Optional[list]:
    v = body.get("lora")
    if v is not None and not isinstance(v, list):
        raise _bad("lora", 'an array of {"id": ..., "scale": ...} objects')
    return v or None


def parse_lora(entries: list, n_adapters: int) -> dict[int, float]:
    """A list of {"id", "scale"} (a request's 'lora', POST /lora-adapters' body) as id -> scale;
    a 400 for an entry that is not such an object or names no loaded adapter."""
    out: dict[int, float] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            raise _bad("lora", 'an array of {"id": ..., "scale": ...} objects')
        i, scale = entry.get("id"), entry.get("scale", 0.0)
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n_adapters:
            loaded = f"ids 0 to {n_adapters - 1}" if n_adapters else "none (start the server with --lora)"
            raise HTTPError(400, f"invalid adapter id {i!r}: the LoRA adapters loaded are {loaded}")
        if not _number(scale) or not math.isfinite(scale):
            raise HTTPError(400, f"the scale of LoRA adapter {i} must be a finite number, not {scale!r}")
        out[i] = float(scale)
    return out


def parse_triggers(body: dict, tokenizer: Optional[Tokenizer], n_vocab: Optional[int]) -> tuple[Trigger, ...]:
    """`grammar_lazy` and `grammar_triggers` as llama-server reads them: each trigger an object with
    "type" (0 token, 1 word, 2 pattern, 3 pattern_full), "value" and, for a token, "token". A word
    that is one token of the vocabulary must be listed in `preserved_tokens` and then triggers as
    that token. A lazy grammar needs a trigger; without `grammar_lazy` the triggers have no use."""
    lazy = get_bool(body, "grammar_lazy", False)
    raw = body.get("grammar_triggers")
    if raw is not None and not isinstance(raw, list):
        raise _bad("grammar_triggers", 'a list of {"type": 0-3, "value": ...} objects')
    preserved = body.get("preserved_tokens") or []
    if not isinstance(preserved, list) or not all(isinstance(t, str) for t in preserved):
        raise _bad("preserved_tokens", "a list of strings")
    triggers: list[Trigger] = []
    for i, item in enumerate(raw or []):
        where = f"grammar_triggers[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("value"), str) \
                or type(item.get("type")) is not int or not 0 <= item["type"] < len(TRIGGER_KINDS):
            raise _bad(where, 'an object {"type": 0 (token), 1 (word), 2 (pattern) or 3 (pattern_full), "value": text}')
        kind, value = TRIGGER_KINDS[item["type"]], item["value"]
        if kind == "token":
            token = item.get("token")
            if type(token) is not int or not 0 <= token < (n_vocab or 2**31):
                raise _bad(f"{where}.token", "a token id of the vocabulary")
            triggers.append(Trigger("token", value, token))
            continue
        if kind in ("pattern", "pattern_full"):
            try:
                re.compile(value)
            except re.error as exc:
                raise HTTPError(400, f"'{where}.value' is not a valid regular expression: {exc}") from None
        if kind == "word" and tokenizer is not None:
            ids = tokenizer.encode(value, add_special=False, parse_special=True)
            if len(ids) == 1:
                if value not in preserved:
                    raise HTTPError(400, f"Grammar trigger word should be marked as preserved token: {value}")
                triggers.append(Trigger("token", value, ids[0]))
                continue
        triggers.append(Trigger(kind, value))
    if lazy and not triggers:
        raise HTTPError(400, "'grammar_lazy' needs 'grammar_triggers': no triggers set for lazy grammar")
    return tuple(triggers) if lazy else ()


# The server's default constraint (its --grammar / --json-schema), for requests that set none;
# set once at start-up by the server (set_default_constraint).
_DEFAULT_CONSTRAINT: Optional[ConstraintSpec] = None


def set_default_constraint(spec: Optional[ConstraintSpec]) -> None:
    global _DEFAULT_CONSTRAINT
    _DEFAULT_CONSTRAINT = spec


def parse_constraint(body: dict) -> Optional[ConstraintSpec]:
    """The output constraint a request asks for, as llama-server reads it: `grammar` (GBNF),
    `json_schema` (a schema object), or `response_format` (OpenAI's: text, json_object with an
    optional `schema`, json_schema with `json_schema.schema`). At most one of them; none: the
    server's --grammar / --json-schema default. Only the form is checked here; the grammar or
    schema itself is compiled (and refused with a 400) by constraint.compile_constraint."""
    specs: list[ConstraintSpec] = []
    grammar = body.get("grammar")
    if grammar is not None:
        if not isinstance(grammar, str):
            raise _bad("grammar", "a string (a GBNF grammar)")
        if grammar.strip():  # llama-server: an empty grammar is none
            specs.append(ConstraintSpec("gbnf", grammar, "grammar"))
    schema = body.get("json_schema")
    if schema is not None:
        specs.append(json_schema_spec(schema, "json_schema"))
    rf = body.get("response_format")
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            specs.append(spec)
    if len(specs) > 1:
        names = " and ".join(f"'{s.source}'" for s in specs)
        raise HTTPError(400, f"{names} cannot be used together: give one grammar or schema")
    return specs[0] if specs else _DEFAULT_CONSTRAINT


def _response_format(rf: Any) -> Optional[ConstraintSpec]:
    if not isinstance(rf, dict):
        raise _bad("response_format", 'an object such as {"type": "json_object"}')
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        # llama-server's extension: a schema given with json_object constrains to it
        if rf.get("schema") is not None:
            return json_schema_spec(rf["schema"], "response_format.schema")
        return ConstraintSpec("json_object", "", "response_format")
    if kind == "json_schema":
        wrapper = rf.get("json_schema")
        if wrapper is not None:
            if not isinstance(wrapper, dict):
                raise _bad("response_format.json_schema", 'an object holding the "schema"')
            if wrapper.get("schema") is not None:
                return json_schema_spec(wrapper["schema"], "response_format.json_schema.schema")
        if rf.get("schema") is not None:  # the form llama-server's README shows
            return json_schema_spec(rf["schema"], "response_format.schema")
        return json_schema_spec({}, "response_format.json_schema")  # no schema: any JSON value
    if kind is None:
        raise HTTPError(400, "'response_format.type' is required: \"text\", \"json_object\" or \"json_schema\"")
    raise HTTPError(400, f"'response_format.type' must be \"text\", \"json_object\" or \"json_schema\", "
                         f"not {kind!r}")
