"""HTTP endpoints: llama-server's API and the OpenAI-compatible one, over the slots and groups.

A completion handler validates the body, makes one task per choice, hands them to the router and
turns the events that come back into llama-server or OpenAI JSON, streamed as Server-Sent Events
or gathered. If the client goes away the handler is cancelled and its `finally` cancels the tasks,
which frees their slots at the next decode step.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import secrets
import string
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, TypeVar

from .. import __version__
from ..models.gguf_file import file_type_name
from ..batching.sampling import SamplingParams
from ..tokenizer.base import TT_BYTE, TT_NORMAL, TT_USER_DEFINED
from .chat import ChatTemplate, ChatTemplateError
from ..batching.constraint import ConstraintSpec, compile_constraint
from ..batching.lazy_grammar import Trigger
from .http import (PUBLIC_PATHS, SSE_DONE, HTTPError, Request, Response, StreamResponse, error_response,
                   json_response, sse_event, sse_named_event)
from ..obs.metrics import Metrics, pipeline_families, render_families
from ..batching.prompt_cache import cache_families
from .pipeline_stats import DEFAULT_WINDOW_S, MAX_WINDOW_S, PipelineStats
from .static import WebUI
from .params import (CompletionParams, check_not_chat, get_int, parse_completion, parse_lora, split_prompts,
                     tokenize_prompt)
from .reasoning import (REASONING_TAGS, TAG_SPACE, ReasoningStream, budget_end_text, check_format,
                        prompt_opens_thinking,
                        reasoning_tags, thinking_opener)
from .tool_calls import (CALL_TRIGGERS, ToolCallStream, ToolChoiceError, ToolSpec, call_grammar, parse_tool_request,
                         reads_reasoning, thinking_ends)
from .tool_formats_more import reads_content
from . import anthropic
from . import slot_file
from . import responses as resp
from . import embedding as embd
from ..batching.task import CompletionTask, EmbeddingEvent, ErrorEvent, FinalEvent, ProgressEvent, TokenEvent


@dataclass
class ServerState:
    """Everything the handlers read. `engine` is None until the model has loaded."""

    args: Any
    metrics: Metrics = field(default_factory=Metrics)
    engine: Any = None
    groups: list = field(default_factory=list)
    router: Any = None
    reconnector: Any = None
    chat: Optional[ChatTemplate] = None
    model_alias: str = ""
    model_path: str = ""
    n_ctx_slot: int = 0
    slots_per_group: int = 0
    load_error: Optional[str] = None
    created: int = field(default_factory=lambda: int(time.time()))
    # Set from the command line (--api-key, --cors-origins, --slots, --props, --slot-save-path,
    # --metrics, -v, --alias, --embd-normalize); the handlers and the HTTP layer read them.
    api_keys: list[str] = field(default_factory=list)
    cors_origins: list[str] = field(default_factory=list)  # empty: only localhost origins
    cors_methods: list[str] = field(default_factory=list)  # a preflight's allowed methods (empty: the path's)
    cors_headers: list[str] = field(default_factory=list)  # ... and request headers (empty: those asked for)
    cors_credentials: bool = True
    ui_settings: dict = field(default_factory=dict)  # --ui-config: a page's default settings, given by /props
    slots_enabled: bool = True
    props_writable: bool = False
    slot_save_path: Optional[str] = None
    metrics_enabled: bool = False
    verbose: bool = False
    aliases: list[str] = field(default_factory=list)
    embd_normalize: int = 2  # of embeddings whose request gives none
    pooling: str = "none"  # of embeddings: --pooling, else the model's (set when it loads)
    rank_head: Any = None  # a reranker's classification head (models/rank_head.RankHead), or None
    spec_type: str = "none"  # speculative decoding: draft-simple (-md), ngram-simple, ngram-mod or none
    draft_engine: Any = None  # -md: the draft model
    split_chosen: bool = False  # the layer split is the server's own choice (no -ts, -ngl): it may move
    # LoRA adapters (--lora, --lora-scaled): each one's file and its scale for requests that give
    # no 'lora' (POST /lora-adapters changes them), by id
    lora_paths: list[str] = field(default_factory=list)
    lora_scales: list[float] = field(default_factory=list)
    # llama-server's marker of media in a multimodal prompt, random per server; a text model never expands it
    media_marker: str = field(default_factory=lambda: "<__media_" + "".join(
        secrets.choice(string.ascii_letters + string.digits) for _ in range(32)) + "__>")
    _max_token_chars: int = 0

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.router is not None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def max_token_chars(self) -> int:
        """The longest vocabulary text: no token stands for more characters of input than this."""
        if not self._max_token_chars:  # computed once, on the first long prompt
            tok = self.tokenizer
            self._max_token_chars = max(1, max(len(tok.token_text(i)) for i in range(tok.n_vocab)))
        return self._max_token_chars

    def check_prompt_fits(self, n_chars: int, n_ids: int) -> None:
        """A 400 for a prompt of n_chars characters of text plus n_ids token ids that cannot fit a
        slot whatever its tokens, before tokenizing it: tokenizing megabytes costs seconds and
        hundreds of megabytes only to learn that it does not fit."""
        n_ctx = self.n_ctx_slot
        if n_ids + n_chars < n_ctx:
            return
        # Halved once more as a margin for tokenizers that normalize text before matching it.
        at_least = n_ids + n_chars // (2 * self.max_token_chars())
        if at_least >= n_ctx:
            raise _exceeds_context(at_least, n_ctx, at_least=True)


def _prompt_size(prompt: Any) -> tuple[int, int]:
    """(characters of text, token ids) in a prompt of any of llama-server's forms; pieces of other
    types are left for tokenize_prompt to refuse."""
    if isinstance(prompt, str):
        return len(prompt), 0
    if not isinstance(prompt, list):
        return 0, 0
    if len(prompt) == 1 and isinstance(prompt[0], list):
        return _prompt_size(prompt[0])
    n_chars = sum(len(x) for x in prompt if isinstance(x, str))
    n_ids = sum(1 for x in prompt if isinstance(x, int) and not isinstance(x, bool))
    return n_chars, n_ids


# --max-prompts' default: the inputs OpenAI's embeddings endpoint takes in one request
DEFAULT_MAX_PROMPTS = 2048


def _check_fan_out(state: ServerState, n_prompts: int, n_choices: int = 1) -> None:
    """A 400 for a request that carries more completions (prompts times choices) than
    --max-prompts, before any is tokenized: each costs memory and a turn in the queue."""
    limit = getattr(state.args, "max_prompts", DEFAULT_MAX_PROMPTS)
    total = n_prompts * n_choices
    if total > limit:
        what = f"{n_prompts} prompts" if n_choices == 1 else f"{n_prompts} prompts of {n_choices} choices ({total})"
        raise HTTPError(400, f"the request carries {what}; this server takes at most {limit} per request "
                             "(--max-prompts)")


def _require_ready(state: ServerState) -> None:
    if not state.ready:
        raise HTTPError(503, "Loading model", "unavailable_error")


NOT_SUPPORTED = "not_supported_error"


def _not_enabled(what: str, flag: str) -> HTTPError:
    """llama-server's 501 for an endpoint that its command line left off."""
    return HTTPError(501, f"This server does not support {what}. Start it with `{flag}`", NOT_SUPPORTED)


def _refuse_encoder(st: "ServerState") -> None:
    """The 501 of a text-generation request to an encoder, which has no output layer."""
    if st.engine is not None and st.engine.model.hparams.encoder:
        raise HTTPError(501, f"This model ({st.engine.model.hparams.arch}) computes embeddings only: it cannot "
                             "generate text", NOT_SUPPORTED)


def _check_whole_input(st: "ServerState", n_tokens: int, field_name: str) -> None:
    """A 400 for an input that a model whose tokens see their whole sequence cannot take: such a
    sequence is computed in one micro-batch (-ub), within the model's learned positions."""
    hp = st.engine.model.hparams
    if hp.causal:
        return
    n_ubatch = min(st.args.ubatch_size, st.args.batch_size)
    if n_tokens > n_ubatch:
        raise HTTPError(400, f"'{field_name}': input ({n_tokens} tokens) is too large to process. increase the "
                             f"physical batch size (current batch size: {n_ubatch})")
    if n_tokens > hp.n_ctx_train:
        raise HTTPError(400, f"'{field_name}': input ({n_tokens} tokens) is longer than the model's "
                             f"{hp.n_ctx_train} positions")


def _exceeds_context(n_prompt: int, n_ctx: int, at_least: bool = False) -> HTTPError:
    """llama-server's exceed_context_size_error, with its n_prompt_tokens and n_ctx fields."""
    size = f"at least {n_prompt}" if at_least else f"{n_prompt}"
    return HTTPError(400, f"the request exceeds the available context size, try increasing it: the prompt is {size} "
                          f"tokens and a slot holds {n_ctx}", "exceed_context_size_error",
                     n_prompt_tokens=n_prompt, n_ctx=n_ctx)


log = logging.getLogger("pyllama.server")
T = TypeVar("T")



# Characters a slot file name must not hold: path separators, a drive colon, the characters
# Windows reserves, and controls (llama.cpp's fs_validate_filename refuses the same).
_BAD_FILENAME = re.compile(r'[\x00-\x1f\x7f/\\:*?"<>|]')


def valid_slot_filename(name: Any) -> bool:
    """A bare file name that cannot leave --slot-save-path: no separators, no '..', no leading
    dot (hidden files, '.', '..'), no surrounding spaces, at most 255 bytes of valid text."""
    if not isinstance(name, str) or not name or name != name.strip() or name.startswith(".") or ".." in name:
        return False
    if name.endswith(".") or _BAD_FILENAME.search(name):
        return False
    try:
        return len(name.encode("utf-8")) <= 255
    except UnicodeEncodeError:  # lone surrogates
        return False


async def _prepare(req: Request, work: Callable[[], T]) -> T:
    """work() (which reads req's body) on a worker thread, whatever the body's size: tokenizing a
    prompt of megabytes takes seconds, and a short body can hold a chat template that renders for
    long or a grammar whose compiling and first-mask check take up to a second, during which the
    event loop would answer no other connection."""
    return await asyncio.to_thread(work)


def _timings_dict(prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float, cache_n: int) -> dict:
    def per(ms: float, n: int) -> tuple[float, float]:
        return (ms / n if n else 0.0), (1e3 * n / ms if ms > 0 else 0.0)
    p_tok, p_sec = per(prompt_ms, prompt_n)
    g_tok, g_sec = per(predicted_ms, predicted_n)
    return {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": prompt_ms, "prompt_per_token_ms": p_tok,
            "prompt_per_second": p_sec, "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": g_tok, "predicted_per_second": g_sec}


def _timings(final: FinalEvent) -> dict:
    out = _timings_dict(final.n_evaluated, final.prompt_ms, final.n_predicted, final.predicted_ms,
                        final.n_prompt - final.n_evaluated)
    if final.draft_n > 0:  # as llama-server: only for a request that drafted
        out["draft_n"] = final.draft_n
        out["draft_n_accepted"] = final.draft_n_accepted
    return out


def _usage(n_prompt: int, n_gen: int, n_cached: int) -> dict:
    """OpenAI's usage; cached_tokens: the prompt tokens taken from the prompt cache, as llama-server's."""
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen,
            "prompt_tokens_details": {"cached_tokens": n_cached}}


def _cached(final: FinalEvent) -> int:
    return final.n_prompt - final.n_evaluated


def _finish_reason(final: FinalEvent) -> str:
    return "length" if final.stop_type == "limit" else "stop"


def _settings(state: ServerState, p: CompletionParams) -> dict:
    """llama-server's generation settings (the `params` of /props and /slots, a result's
    generation_settings)."""
    s = p.sampling
    # llama-server's form; a banned token's -inf is written as null, as its encoder writes it
    bias = [] if s.logit_bias is None else [{"bias": float(b), "token": int(t)} for t, b in zip(*s.logit_bias)]
    return {"n_ctx": state.n_ctx_slot, "n_predict": p.n_predict, "max_tokens": p.n_predict, "seed": s.seed,
            "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
            "repeat_penalty": s.repeat_penalty, "repeat_last_n": s.repeat_last_n,
            "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
            "n_probs": p.n_probs, "post_sampling_probs": p.post_sampling_probs, "stop": p.stop,
            "ignore_eos": p.ignore_eos, "stream": p.stream, "cache_prompt": p.cache_prompt, "n_keep": p.n_keep,
            "typical_p": s.typical_p, "min_keep": s.min_keep, "top_n_sigma": s.top_n_sigma,
            "xtc_probability": s.xtc_probability, "xtc_threshold": s.xtc_threshold,
            "dry_multiplier": s.dry_multiplier, "dry_base": s.dry_base, "dry_allowed_length": s.dry_allowed_length,
            "dry_penalty_last_n": s.dry_penalty_last_n, "dry_sequence_breakers": list(s.dry_sequence_breakers),
            "mirostat": s.mirostat, "mirostat_tau": s.mirostat_tau, "mirostat_eta": s.mirostat_eta,
            "dynatemp_range": s.dynatemp_range, "dynatemp_exponent": s.dynatemp_exponent,
            "logit_bias": bias, "samplers": list(s.samplers), "timings_per_token": p.timings_per_token,
            "return_tokens": p.return_tokens, "return_progress": p.return_progress, "id_slot": p.id_slot,
            "n_cmpl": p.n, "grammar": p.constraint.text if p.constraint is not None else "",
            # llama-server's fields for what pyllama does not have (the adaptive-p sampler) at their
            # "off" values; 'lora' as the request gave it
            "adaptive_target": -1.0, "adaptive_decay": 0.9,
            "lora": [{"id": i, "scale": v} for i, v in parse_lora(p.lora or [], len(state.lora_paths)).items()],
            "speculative.types": state.spec_type,
            "n_discard": p.n_discard, "n_indent": p.n_indent, "t_max_predict_ms": p.t_max_predict_ms,
            "backend_sampling": any(getattr(g, "backend_sampling", False) for g in state.groups)}


def _request_lora(state: ServerState, p: CompletionParams) -> tuple[float, ...]:
    """Each loaded adapter's scale for a request: its 'lora' (an adapter it does not list at 0, as
    llama-server), else the server's (--lora, POST /lora-adapters)."""
    if not p.lora:
        return tuple(state.lora_scales)
    asked = parse_lora(p.lora, len(state.lora_paths))
    return tuple(asked.get(i, 0.0) for i in range(len(state.lora_paths)))


def _verbose(state: ServerState, p: CompletionParams) -> bool:
    """Whether a result carries __verbose: the request's `verbose`, else the server's -v."""
    return state.verbose if p.verbose is None else p.verbose


def _stream(p: CompletionParams, chunks: AsyncIterator[bytes]) -> StreamResponse:
    """A completion's event stream, pinged while silent at the request's sse_ping_interval (if any)."""
    return StreamResponse(chunks, ping_interval=p.sse_ping_interval)


def nested_fields(paths: list[str], obj: dict) -> dict:
    """llama-server's response_fields: the value at each path ('a/b' looks into a's object), keyed
    by the path; paths that lead nowhere are left out."""
    out = {}
    for path in paths:
        cur: Any = obj
        for key in path.split("/"):
            if isinstance(cur, dict) and key in cur:
                cur = cur[key]
            else:
                break
        else:
            out[path] = cur
    return out


class Choice:
    """What one choice accumulates while its events arrive."""

    def __init__(self, index: int):
        self.index = index
        self.text: list[str] = []
        self.tokens: list[int] = []
        self.probs: list[dict] = []
        self.final: Optional[FinalEvent] = None

    @property
    def content(self) -> str:
        return "".join(self.text)


@dataclass
class ChatOutputSpec:
    """How a chat reply is read: the template's tool-call family (None: no call parsing), the
    request's tools, its reasoning format, whether the template thinks, and whether the prompt
    left a think tag open."""

    family: Optional[str] = None
    tools: ToolSpec = field(default_factory=ToolSpec)
    reasoning_format: str = "auto"
    # the template thinks (ChatTemplate.thinking): only then is a thinking read out of the reply,
    # as llama-server reads one only where the chat format it made of the template supports it
    thinks: bool = True
    # the template's own thinking tags, where its family has none of its own (None: the family's)
    tags: Optional[tuple[str, str]] = None
    # the same with the whitespace the template puts around them (Thinking.full), as the reply is read
    # (llama-server's parser made from its analysis); None: the fixed tags of a family, read trimmed
    full_tags: Optional[tuple[str, str]] = None
    forced_open: bool = False
    opener: str = ""  # how the prompt opened that thinking (its start tag on), see thinking_opener
    prefill: str = ""  # the continued assistant message's content: the reply starts with it (llama-server)


class ChatReply:
    """One chat choice's generated text -> OpenAI message parts: ``reasoning_content`` (the
    model's thinking, reasoning.py), ``content`` and ``tool_calls`` (tool_calls.py).

    Feed it the text as it comes (:meth:`feed` returns the stream's delta dicts), then
    :meth:`finish`; :meth:`message` is the non-streamed message and :attr:`has_calls` decides
    the ``tool_calls`` finish reason. Streamed and whole replies go through the same steps, so
    the deltas add up to the message."""

    def __init__(self, spec: ChatOutputSpec) -> None:
        own = reads_reasoning(spec.family)  # harmony: the calls' reader also reads the thinking
        # a template that does not think leaves a <think> the model writes in the content, as
        # llama-server's content-only formats do
        fmt = spec.reasoning_format if spec.thinks else "none"
        if fmt == "deepseek-legacy":
            # llama-server sets reasoning_in_content for it (server-schema.cpp) but no parser reads
            # that flag: its replies are those of deepseek, whole and streamed
            fmt = "deepseek"
        # a family's own tags may be read with whitespace taken out (TAG_SPACE); a template's own, as is
        space = TAG_SPACE.get(spec.family or "", (False, False)) if spec.full_tags is None else (False, False)
        self.thoughts = ReasoningStream("none" if own else fmt, spec.forced_open and spec.thinks,
                                        thinking_ends(spec.family),
                                        *(spec.full_tags or spec.tags or reasoning_tags(spec.family)),
                                        opener=spec.opener,
                                        # with tools llama-server's parser allows whitespace before
                                        # the thinking (its prefix << parser; chat-auto-parser-generator.cpp)
                                        skip_space=spec.tools.parse_calls,
                                        lstrip_reasoning=space[0], lstrip_content=space[1])
        # some families wrap plain text in markers of their own, taken out even when no call is read
        self.calls = ToolCallStream(spec.family, spec.tools.parallel, spec.tools.tools, fmt,
                                    spec.tools.parse_calls) \
            if spec.family is not None and (spec.tools.parse_calls or own or reads_content(spec.family)) else None
        self._prefill = spec.prefill  # read before the first generated text, and sent with it
        if spec.forced_open and spec.thinks and spec.reasoning_format == "none" and spec.family is not None \
                and not own:
            # a thinking left in the content is shown whole, opened as the prompt opened it, as
            # llama-server shows it (not when the reply is not read at all: --skip-chat-parsing)
            self._prefill = spec.opener + self._prefill

    def feed(self, text: str) -> list[dict]:
        if self._prefill:
            text, self._prefill = self._prefill + text, ""
        return self._deltas(*self.thoughts.feed(text)) if text else []

    def finish(self) -> list[dict]:
        out = self.feed("") + self._deltas(*self.thoughts.finish())
        if self.calls is not None:
            out += self.calls.finish()
        return out

    def _deltas(self, reasoning: str, content: str) -> list[dict]:
        out: list[dict] = [{"reasoning_content": reasoning}] if reasoning else []
        if content:
            out += self.calls.feed(content) if self.calls is not None else [{"content": content}]
        return out

    @property
    def has_calls(self) -> bool:
        return self.calls is not None and bool(self.calls.snapshot.calls)

    def message(self) -> dict:
        msg: dict = {"role": "assistant"}
        if self.calls is not None:
            msg["content"], calls = self.calls.message()
        else:
            msg["content"], calls = self.thoughts.content, []
        reasoning = self.thoughts.reasoning or (self.calls.snapshot.reasoning if self.calls is not None else "")
        if reasoning:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = calls
        return msg


def whole_reply(c: Choice, spec: ChatOutputSpec) -> ChatReply:
    """A finished choice's text read as a chat reply."""
    reply = ChatReply(spec)
    reply.feed(c.content)
    reply.finish()
    return reply


def chat_finish_reason(final: FinalEvent, reply: ChatReply) -> str:
    """"tool_calls" when the reply called tools (and was not cut short), else as for text."""
    reason = _finish_reason(final)
    return "tool_calls" if reason == "stop" and reply.has_calls else reason


class Api:
    def __init__(self, state: ServerState):
        self.state = state
        # the built-in pages (--no-webui: none, and `/` answers 404 as before)
        self.webui: Optional[WebUI] = WebUI() if getattr(state.args, "webui", True) else None
        self._pipeline: Optional[PipelineStats] = None
        # chat replies are read here (reasoning, tool calls: a long call's arguments are scanned as
        # they grow), one thread for every stream so that each reply's pieces keep their order
        self._replies = ThreadPoolExecutor(1, thread_name_prefix="chat-replies")

    async def _read(self, reply: ChatReply, text: str, finish: bool = False) -> list[dict]:
        """The deltas of a chat reply's next text (and of its end), read off the event loop."""
        if not text and not finish:
            return []
        return await asyncio.get_running_loop().run_in_executor(
            self._replies, lambda: reply.feed(text) + (reply.finish() if finish else []))

    async def _whole_reply(self, c: Choice, spec: ChatOutputSpec) -> ChatReply:
        """A finished choice read as a chat reply, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._replies, whole_reply, c, spec)

    def _generates(self, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """`handler`, refused with a 501 for an encoder before anything is read or streamed."""
        async def run(req: Request) -> Response:
            _refuse_encoder(self.state)
            return await handler(req)
        return run

    async def _embed_all(self, prompts: list[list[int]]) -> list[EmbeddingEvent]:
        """Each prompt's pooled hidden state (embeddings, rerank scores), computed as one request."""
        lora = tuple(self.state.lora_scales)
        tasks = [[CompletionTask(prompt=p, params=SamplingParams(), n_predict=0, cache_prompt=False, embedding=True,
                                 index=i, lora=lora)] for i, p in enumerate(prompts)]
        results: list[Optional[EmbeddingEvent]] = [None] * len(prompts)
        async for index, ev in self._events(tasks):
            if isinstance(ev, EmbeddingEvent):
                results[index] = ev
            elif isinstance(ev, ErrorEvent):
                raise HTTPError(ev.status, ev.message, ev.type)
        assert all(ev is not None for ev in results)
        return results  # type: ignore[return-value]

    def routes(self) -> dict:
        gen = self._generates
        r = {
            ("GET", "/health"): self.health, ("GET", "/v1/health"): self.health,
            ("POST", "/completion"): gen(self.completion), ("POST", "/completions"): gen(self.completion),
            ("POST", "/v1/completions"): gen(self.oai_completion),
            ("POST", "/v1/chat/completions"): gen(self.oai_chat), ("POST", "/chat/completions"): gen(self.oai_chat),
            ("POST", "/v1/messages"): gen(self.messages), ("POST", "/v1/messages/count_tokens"): self.count_tokens,
            ("POST", "/v1/responses"): gen(self.responses), ("POST", "/responses"): gen(self.responses),
            ("POST", "/v1/chat/completions/input_tokens"): self.chat_input_tokens,
            ("POST", "/chat/completions/input_tokens"): self.chat_input_tokens,
            ("POST", "/v1/responses/input_tokens"): self.response_input_tokens,
            ("POST", "/responses/input_tokens"): self.response_input_tokens,
            ("GET", "/v1/models"): self.models, ("GET", "/models"): self.models,
            ("POST", "/apply-template"): self.apply_template,
            ("POST", "/tokenize"): self.tokenize, ("POST", "/detokenize"): self.detokenize,
            ("GET", "/props"): self.props, ("POST", "/props"): self.props_change,
            ("GET", "/slots"): self.slots, ("POST", "/slots/*"): self.slot_action,
            ("GET", "/metrics"): self.metrics,
            ("GET", "/lora-adapters"): self.lora_adapters, ("POST", "/lora-adapters"): self.lora_adapters,
            ("POST", "/infill"): gen(self.infill),
            ("POST", "/embedding"): self.embeddings, ("POST", "/embeddings"): self.embeddings,
            ("POST", "/v1/embeddings"): self.oai_embeddings,
            ("POST", "/rerank"): self.rerank, ("POST", "/reranking"): self.rerank,
            ("POST", "/v1/rerank"): self.rerank, ("POST", "/v1/reranking"): self.rerank,
            ("GET", "/pipeline/stats"): self.pipeline_stats,
        }
        if self.webui is not None:
            for path in self.webui.paths():
                r[("GET", path)] = self.page
        return r

    def public_paths(self) -> frozenset[str]:
        """Paths answered without an API key: the probes, the model list (as llama-server: a client
        discovers the model before it authenticates) and the pages with their files."""
        return PUBLIC_PATHS | {"/v1/models", "/models"} | (self.webui.paths() if self.webui is not None
                                                           else frozenset())

    # --- simple endpoints ------------------------------------------------------------------------
    async def health(self, req: Request) -> Response:
        st = self.state
        if st.load_error:
            return error_response(500, st.load_error, "server_error")
        if not st.ready:
            return error_response(503, "Loading model", "unavailable_error")
        lost = st.engine.lost_devices()
        if lost:  # an rpc server went away or stopped answering: reconnecting
            body = {"status": "error", "error": "; ".join(lost.values()), "lost_devices": lost}
            rc = st.reconnector
            if rc is not None:
                body["reconnect_attempts"] = rc.attempts
                if rc.last_error:
                    body["reconnect_error"] = rc.last_error
            return json_response(body, 500)
        faults = [g.fault for g in st.groups if g.fault]
        if faults:
            return json_response({"status": "error", "error": faults[0]}, 500)
        return json_response({"status": "ok"})

    async def models(self, req: Request) -> Response:
        """OpenAI's `data` list and llama-server's (Ollama-style) `models` list, one model each."""
        _require_ready(self.state)
        st = self.state
        hp = st.engine.model.hparams
        meta = {"vocab_type": 2 if st.tokenizer.__class__.__name__.lower().startswith("bpe") else 1,
                "n_vocab": hp.n_vocab, "n_ctx": st.n_ctx_slot, "n_ctx_train": hp.n_ctx_train, "n_embd": hp.n_embd,
                "n_params": st.engine.model.n_params(), "size": st.engine.model.file.data.nbytes,
                "ftype": self._ftype()}
        aliases = list(st.aliases) or [st.model_alias]
        name = st.model_alias or aliases[0]
        tags = _tags(st.args)
        return json_response({
            "models": [{"name": name, "model": name, "modified_at": "", "size": "", "digest": "", "type": "model",
                        "description": "", "tags": tags or [""], "capabilities": ["completion"], "parameters": "",
                        "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                                    "parameter_size": "", "quantization_level": ""}}],
            "object": "list",
            "data": [{"id": name, "aliases": aliases, "tags": tags, "object": "model", "created": st.created,
                      "owned_by": "pyllama", "meta": meta}]})

    def _ftype(self) -> str:
        return file_type_name(self.state.engine.model.file.get("general.file_type"))

    async def tokenize(self, req: Request) -> Response:
        _require_ready(self.state)
        return await _prepare(req, lambda: self._tokenize(req))

    def _tokenize(self, req: Request) -> Response:
        body = req.json()
        if not isinstance(body, dict) or not isinstance(body.get("content"), str):
            raise HTTPError(400, "'content' must be a string")
        flags = {}
        for name, default in (("add_special", False), ("parse_special", True), ("with_pieces", False)):
            flags[name] = body.get(name, default)
            if not isinstance(flags[name], bool):
                raise HTTPError(400, f"'{name}' must be true or false")
        tok = self.state.tokenizer
        ids = tok.encode(body["content"], add_special=flags["add_special"], parse_special=flags["parse_special"])
        if flags["with_pieces"]:
            out: list = []
            for t in ids:
                piece = tok.token_bytes(t)
                try:  # text when the piece is valid UTF-8, else its bytes (as llama-server)
                    out.append({"id": t, "piece": piece.decode("utf-8")})
                except UnicodeDecodeError:
                    out.append({"id": t, "piece": list(piece)})
            return json_response({"tokens": out})
        return json_response({"tokens": ids})

    async def detokenize(self, req: Request) -> Response:
        _require_ready(self.state)
        return await _prepare(req, lambda: self._detokenize(req))

    def _detokenize(self, req: Request) -> Response:
        body = req.json()
        ids = body.get("tokens") if isinstance(body, dict) else None
        tok = self.state.tokenizer
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise HTTPError(400, "'tokens' must be a list of token ids")
        if any(not 0 <= t < tok.n_vocab for t in ids):
            raise HTTPError(400, f"'tokens' holds ids outside the vocabulary of {tok.n_vocab}")
        return json_response({"content": tok.decode(ids)})

    def _defaults(self) -> CompletionParams:
        st = self.state
        return parse_completion({}, st.args.n_predict, st.slots_per_group, default_n_keep=_keep(st.args))

    async def props(self, req: Request) -> Response:
        _require_ready(self.state)
        st = self.state
        snap = st.metrics.snapshot()
        tok = st.tokenizer
        return json_response({
            "default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": st.n_ctx_slot,
                                            "speculative": st.spec_type != "none",
                                            "is_processing": False, "params": _settings(st, self._defaults())},
            "total_slots": sum(len(g.slots) for g in st.groups),
            "model_alias": st.model_alias, "model_path": st.model_path,
            "chat_template": st.chat.source if st.chat else "",
            "chat_template_caps": st.chat.llama_caps() if st.chat else {},
            "bos_token": _token_text(tok, tok.bos_id), "eos_token": _token_text(tok, tok.eos_id),
            "model_ftype": self._ftype(), "is_sleeping": False,
            "modalities": {"vision": False, "video": False, "audio": False},
            "build_info": f"pyllama {__version__}",
            "endpoint_slots": st.slots_enabled, "endpoint_props": st.props_writable,
            "endpoint_metrics": st.metrics_enabled,
            "ui": bool(getattr(st.args, "webui", True)), "ui_settings": st.ui_settings, "cors_proxy_enabled": False,
            "media_marker": st.media_marker,
            "context_shift": bool(getattr(st.args, "context_shift", False)),
            "n_preemptions": snap["n_preemptions_total"], "n_context_shifts": snap["n_context_shifts_total"],
        })

    async def props_change(self, req: Request) -> Response:
        """POST /props: as llama-server, accepted with --props, and no property is writable yet."""
        if not self.state.props_writable:
            raise _not_enabled("changing global properties", "--props")
        body = req.json()
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        return json_response({"success": True})

    async def lora_adapters(self, req: Request) -> Response:
        """llama-server's /lora-adapters: GET lists the adapters with the scale requests get when
        they name none; POST sets those scales, an adapter it does not list to 0 (as llama-server).
        An id that names no adapter is a 400, where llama-server would ignore it."""
        st = self.state
        _require_ready(st)
        if req.method == "GET":
            adapters = st.engine.model.lora.adapters if st.lora_paths else []
            return json_response([{"id": i, "path": st.lora_paths[i], "scale": st.lora_scales[i],
                                   "task_name": ad.task_name, "prompt_prefix": ad.prompt_prefix}
                                  for i, ad in enumerate(adapters)])
        body = req.json()
        if not isinstance(body, list):
            raise HTTPError(400, "Request body must be an array")
        asked = parse_lora(body, len(st.lora_paths))
        st.lora_scales = [asked.get(i, 0.0) for i in range(len(st.lora_paths))]
        return json_response({"success": True})

    async def slots(self, req: Request) -> Response:
        st = self.state
        if not st.slots_enabled:
            raise _not_enabled("slots endpoint", "--slots")
        _require_ready(st)
        # each group's decode thread reads its own slots, between steps
        per_group = await asyncio.gather(*(asyncio.wrap_future(g.call(
            lambda g=g: [(s.snapshot(), self._idle(s)) for s in g.slots])) for g in st.groups))
        found = [pair for group in per_group for pair in group]
        if req.query.get("fail_on_no_slot", "0") not in ("0", "false") and not any(idle for _, idle in found):
            raise HTTPError(503, "no slot available", "unavailable_error")
        out = []
        for snap, _ in found:
            snap.setdefault("speculative", st.spec_type != "none")
            out.append(snap)
        return json_response(out)

    def _idle(self, slot) -> bool:
        return not slot.busy and slot.id not in self.state.router.taken

    async def metrics(self, req: Request) -> Response:
        st = self.state
        if not st.metrics_enabled:
            raise _not_enabled("metrics endpoint", "--metrics")
        _require_ready(st)
        kv_used = sum(g.kv_use.used_cells for g in st.groups)
        kv_total = sum(g.kv_use.n_cells for g in st.groups)
        text = st.metrics.render(
            requests_processing=st.router.n_processing, requests_deferred=st.router.n_deferred,
            kv_cache_usage_ratio=kv_used / kv_total if kv_total else 0.0,
            kv_cache_tokens=sum(g.kv_use.tokens_cached for g in st.groups))
        snap = await asyncio.get_running_loop().run_in_executor(None, self.pipeline().snapshot, DEFAULT_WINDOW_S)
        text += render_families(pipeline_families(snap))
        cache = st.groups[0].prompt_cache if st.groups else None
        text += render_families(cache.families() if cache is not None else cache_families(0, 0))
        return Response(200, text, content_type="text/plain; version=0.0.4; charset=utf-8")

    # --- the pages and the pipeline view ---------------------------------------------------------
    async def page(self, req: Request) -> Response:
        assert self.webui is not None
        resp = self.webui.response(req.path)
        if resp is None:
            raise HTTPError(404, "File Not Found", "not_found_error")
        return resp

    def pipeline(self) -> PipelineStats:
        """The pipeline view's recorder, made on first use (after the model has loaded)."""
        st = self.state
        if self._pipeline is None:
            self._pipeline = PipelineStats(st.engine.backends, st.groups, st.router)
        return self._pipeline

    async def pipeline_stats(self, req: Request) -> Response:
        """GET /pipeline/stats[?window=SECONDS]: the live figures of the split (pipeline_stats)."""
        st = self.state
        _require_ready(st)
        raw = req.query.get("window")
        window = DEFAULT_WINDOW_S
        if raw is not None:
            try:
                window = float(raw)
            except ValueError:
                window = math.nan
            if not 0.1 <= window <= MAX_WINDOW_S:  # (NaN fails too)
                raise HTTPError(400, f"'window' must be a number of seconds from 0.1 to {MAX_WINDOW_S:g}")
        # polling the rpc peers waits for their replies: never on the event loop
        snap = await asyncio.get_running_loop().run_in_executor(None, self.pipeline().snapshot, window)
        return json_response(snap)

    # --- embeddings ---------------------------------------------------------------------------
    async def embeddings(self, req: Request) -> Response:
        """/embedding, /embeddings: llama-server's native form, one item per input."""
        return await self._embeddings(req, oai=False)

    async def oai_embeddings(self, req: Request) -> Response:
        """/v1/embeddings: OpenAI's form (llama-server's native one when the body gives `content`)."""
        return await self._embeddings(req, oai=True)

    async def _embeddings(self, req: Request, oai: bool) -> Response:
        st = self.state
        if not getattr(st.args, "embedding", False):
            raise _not_enabled("embeddings", "--embeddings")
        _require_ready(st)
        body, oai, prompts, norm, use_base64 = await _prepare(req, lambda: self._embedding_input(req, oai))
        results = await self._embed_all(prompts)
        vectors = []
        for ev in results:
            v = embd.pool(ev.hidden, st.pooling)
            if st.pooling == "rank":  # the reranker's scores, as llama-server returns them
                v = st.rank_head.scores(v)
            vectors.append(v if st.pooling == "none" else embd.normalize(v, norm))  # as llama-server
        if oai:
            model = body.get("model") if isinstance(body.get("model"), str) else st.model_alias
            return json_response(embd.oai_response(model, [(v, ev.n_prompt) for v, ev in zip(vectors, results)],
                                                   use_base64))
        return json_response([embd.native_item(i, v) for i, v in enumerate(vectors)])

    def _embedding_input(self, req: Request, oai: bool) -> tuple[dict, bool, list[list[int]], int, bool]:
        """(body, OpenAI form, the inputs as tokens, embd_normalize, base64) of an embeddings request."""
        st = self.state
        body = req.json()
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        if "input" in body:
            given = body["input"]
        elif "content" in body:
            given, oai = body["content"], False  # `content` is llama-server's own field: its own form
        else:
            raise HTTPError(400, '"input" or "content" must be provided')
        if oai and st.pooling == "none":
            raise HTTPError(400, "Pooling type 'none' is not OAI compatible. Please use a different pooling type")
        use_base64 = False
        if "encoding_format" in body:
            fmt = body["encoding_format"]
            if fmt not in ("float", "base64"):
                raise HTTPError(400, "The format to return the embeddings in. Can be either float or base64")
            use_base64 = fmt == "base64"
        norm = body.get("embd_normalize", st.embd_normalize)
        if not isinstance(norm, int) or isinstance(norm, bool) or norm < -1:
            raise HTTPError(400, "'embd_normalize' must be an integer: -1 none, 0 max-abs, 2 Euclidean, p > 0 p-norm")
        prompts = []
        given = split_prompts(given)
        _check_fan_out(st, len(given))
        for prompt in given:
            st.check_prompt_fits(*_prompt_size(prompt))
            tokens = tokenize_prompt(st.tokenizer, prompt, "input") if prompt != [] else []
            if not tokens:
                raise HTTPError(400, "Input content cannot be empty")
            if len(tokens) > st.n_ctx_slot:
                raise _exceeds_context(len(tokens), st.n_ctx_slot)
            _check_whole_input(st, len(tokens), "input")
            prompts.append(tokens)
        return body, oai, prompts, norm, use_base64

    # --- reranking ----------------------------------------------------------------------------
    async def rerank(self, req: Request) -> Response:
        """/rerank, /v1/rerank (and /reranking): each document scored against the query by the
        reranker's head, in llama-server's Jina form (or TEI's for a body with `texts`)."""
        st = self.state
        # as llama-server: the command line's pooling, not the file's, opens the endpoint
        if not getattr(st.args, "embedding", False) or getattr(st.args, "pooling", None) != "rank":
            raise _not_enabled("reranking", "--reranking")
        _require_ready(st)
        body, prompts, documents, top_n = await _prepare(req, lambda: self._rerank_input(req))
        results = await self._embed_all(prompts)
        scores = []
        for ev, tokens in zip(results, prompts):
            scores.append((float(st.rank_head.scores(embd.pool(ev.hidden, "rank"))[0]), len(tokens)))
        model = body.get("model") if isinstance(body.get("model"), str) else st.model_alias
        return json_response(embd.rerank_response(body, model, scores, documents, top_n))

    def _rerank_input(self, req: Request) -> tuple[dict, list[list[int]], list[str], int]:
        """(body, each query-document pair as tokens, the documents, top_n) of a rerank request."""
        st = self.state
        body = req.json()
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        if "query" not in body:
            raise HTTPError(400, '"query" must be provided')
        query = body["query"]
        if not isinstance(query, str):
            raise HTTPError(400, '"query" must be a string')
        field_name = "documents" if "documents" in body else "texts"
        documents = body.get(field_name, [])
        if not isinstance(documents, list) or not documents or not all(isinstance(d, str) for d in documents):
            raise HTTPError(400, f'"{field_name}" must be a non-empty string array')
        top_n = body.get("top_n", len(documents))
        if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
            raise HTTPError(400, '"top_n" must be a non-negative integer')
        if not isinstance(body.get("return_text", False), bool):
            raise HTTPError(400, '"return_text" must be a boolean')
        _check_fan_out(st, len(documents))
        prompts = []
        for doc in documents:
            st.check_prompt_fits(len(query) + len(doc), 0)
            tokens = embd.rerank_tokens(st.tokenizer, st.engine.model.file, query, doc)
            if not tokens:
                raise HTTPError(400, "Input content cannot be empty")
            if len(tokens) > st.n_ctx_slot:
                raise _exceeds_context(len(tokens), st.n_ctx_slot)
            _check_whole_input(st, len(tokens), field_name)
            prompts.append(tokens)
        return body, prompts, documents, top_n

    # --- slot save / restore / erase ----------------------------------------------------------
    async def slot_action(self, req: Request) -> Response:
        """POST /slots/{id}?action=save|restore|erase. A saved slot is the file of its cached
        tokens and their KV rows (slot_file.py); restoring writes the rows back into the slot
        without computing them (the next request that starts with those tokens reuses them)."""
        st = self.state
        if not st.slots_enabled:
            raise _not_enabled("slots endpoint", "--slots")
        _require_ready(st)
        slot_id = req.path.rsplit("/", 1)[1]
        slots = [s for g in st.groups for s in g.slots]
        if not slot_id.isascii() or not slot_id.isdigit() or int(slot_id) >= len(slots):
            raise HTTPError(400, "Invalid slot ID")
        slot = slots[int(slot_id)]
        action = req.query.get("action", "")
        if action == "erase":
            return json_response(await self._slot_erase(slot))
        if action not in ("save", "restore"):
            raise HTTPError(400, "Invalid action")
        if not st.slot_save_path:
            raise _not_enabled("slots action", "--slot-save-path")
        body = req.json() if req.body else {}
        filename = body.get("filename") if isinstance(body, dict) else None
        if not valid_slot_filename(filename):
            raise HTTPError(400, "Invalid filename")
        path = os.path.join(st.slot_save_path, filename)
        if action == "save":
            return json_response(await self._slot_save(slot, path, filename))
        return json_response(await self._slot_restore(slot, path, filename))

    async def _when_idle(self, slot, work: Callable[[], T]) -> T:
        """work() on the slot's decode thread, between steps, once the slot serves nothing (as
        llama-server, the action waits for a busy slot)."""
        group = self.state.groups[slot.group]
        return await asyncio.wrap_future(group.when_idle(slot, work, self._idle))

    async def _slot_erase(self, slot) -> dict:
        ctx = self.state.groups[slot.group].ctx

        def erase() -> int:
            n = len(slot.cache_tokens)
            ctx.seq_rm(slot.seq, 0)
            slot.cache_tokens = []
            return n
        return {"id_slot": slot.id, "n_erased": await self._when_idle(slot, erase)}

    async def _slot_save(self, slot, path: str, filename: str) -> dict:
        st = self.state
        t0 = time.perf_counter()
        group = st.groups[slot.group]
        try:
            tokens, rows = await self._when_idle(slot, lambda: group.read_slot(slot))
        except Exception as exc:  # noqa: BLE001 - a peer lost mid-read: nothing written
            raise HTTPError(500, f"cannot read slot {slot.id}'s KV cache: {exc}", "server_error") from None
        layout = group.ctx.kv_layout()

        try:
            n_written = await asyncio.to_thread(slot_file.save, path, tokens, rows, layout, st.tokenizer.n_vocab,
                                                os.path.basename(st.model_path))
        except OSError as exc:
            raise HTTPError(500, f"cannot write slot file {filename}: {exc.strerror or exc}", "server_error") from None
        return {"id_slot": slot.id, "filename": filename, "n_saved": len(tokens), "n_written": n_written,
                "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}

    async def _slot_restore(self, slot, path: str, filename: str) -> dict:
        """Reads and checks the whole file first (a 400 leaves the slot as it was), then writes its
        KV rows back into the slot once the slot is idle, under its group's lock (group.write_slot:
        other idle slots' caches are dropped for the room as a prompt would drop them); nothing is
        computed. Rows the group cannot find cells for, a write that fails, and a version 1 file
        (tokens only) are computed into the slot like a prompt that samples nothing; a file of no
        tokens empties the slot."""
        st = self.state
        t0 = time.perf_counter()
        try:
            data = await asyncio.to_thread(lambda: open(path, "rb").read())
        except FileNotFoundError:
            raise HTTPError(400, f"slot file {filename} does not exist") from None
        except OSError as exc:
            raise HTTPError(500, f"cannot read slot file {filename}: {exc.strerror or exc}", "server_error") from None
        group = st.groups[slot.group]
        saved = slot_file.read(data, st.tokenizer.n_vocab, group.ctx.kv_layout(), filename)
        tokens = saved.tokens
        if len(tokens) >= st.n_ctx_slot:
            raise _exceeds_context(len(tokens), st.n_ctx_slot)
        written = False
        if saved.rows is not None and tokens:
            try:
                written = await self._when_idle(slot, lambda: group.write_slot(slot, tokens, saved.rows))
            except Exception as exc:  # noqa: BLE001 - the slot is left empty; its rows are computed below
                log.warning("slot %d: writing the KV rows of %s failed (%s): computing them", slot.id, filename, exc)
        if tokens and not written:  # computed into the slot like a prompt that wants no token
            task = CompletionTask(prompt=tokens, params=SamplingParams(), n_predict=0, cache_prompt=True,
                                  id_slot=slot.id, lora=tuple(st.lora_scales))
            await self._gather([[task]])
        elif not tokens:
            await self._slot_erase(slot)
        return {"id_slot": slot.id, "filename": filename, "n_restored": len(tokens), "n_read": len(data),
                "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}

    # --- completions -------------------------------------------------------------------------------
    def _tasks(self, prompts: list[list[int]], p: CompletionParams) -> list[list[CompletionTask]]:
        """One list of tasks per prompt (its n choices, placed together); index = prompt * n + choice."""
        st = self.state
        if p.id_slot >= sum(len(g.slots) for g in st.groups):
            raise HTTPError(400, f"'id_slot' {p.id_slot} does not exist")
        on_device = any(getattr(g, "backend_sampling", False) for g in st.groups)
        if p.backend_sampling is not None and p.backend_sampling != on_device:
            # where a token is sampled is the server's choice (--backend-sampling and what its devices can do)
            raise HTTPError(400, f"'backend_sampling' {str(p.backend_sampling).lower()} is not supported: this "
                                 f"server samples {'on the device' if on_device else 'on the host'} for every request")
        out = []
        lora = _request_lora(st, p)
        settings = _settings(st, p)  # once per request: its results and /slots show them
        for k, prompt in enumerate(prompts):
            if not prompt:
                raise HTTPError(400, "the prompt is empty")
            if len(prompt) >= st.n_ctx_slot:
                raise _exceeds_context(len(prompt), st.n_ctx_slot)
            tasks = []
            for i in range(p.n):
                # each choice follows the grammar from its start: a matcher of its own (a copy of
                # the compiled one, which _check_constraint already built off the event loop)
                matcher = compile_constraint(p.constraint, st.tokenizer) if p.constraint is not None else None
                sampling = p.sampling
                if p.n > 1 and sampling.seed not in (-1, 0xFFFFFFFF):
                    sampling = SamplingParams(**{**sampling.__dict__, "seed": (sampling.seed + i) & 0xFFFFFFFF})
                tasks.append(CompletionTask(
                    prompt=prompt, params=sampling, n_predict=p.n_predict, n_keep=p.n_keep, ignore_eos=p.ignore_eos,
                    stop=p.stop, n_probs=p.n_probs, post_sampling_probs=p.post_sampling_probs,
                    timings_per_token=p.timings_per_token, return_progress=p.return_progress and p.stream,
                    cache_prompt=p.cache_prompt, id_slot=p.id_slot, index=k * p.n + i, matcher=matcher, triggers=p.triggers,
                    thinking_budget=p.thinking_budget, thinking_end=p.thinking_end, thinking_open=p.thinking_open,
                    spec_n_max=p.spec_n_max, spec_n_min=p.spec_n_min, n_indent=p.n_indent,
                    t_max_predict_ms=p.t_max_predict_ms, n_discard=p.n_discard, settings=settings, lora=lora))
            out.append(tasks)
        return out

    async def _events(self, task_lists: list[list[CompletionTask]]) -> AsyncIterator[tuple[int, object]]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        tasks = [t for ts in task_lists for t in ts]
        if not all(t.embedding for t in tasks):
            _refuse_encoder(self.state)
        for t in tasks:
            t.queue, t.loop = q, loop
        self.state.router.submit_request(task_lists)  # one request: its prompts take turns with others'
        remaining = len(tasks)
        try:
            while remaining:
                index, event = await q.get()
                if isinstance(event, (FinalEvent, ErrorEvent, EmbeddingEvent)):
                    remaining -= 1
                yield index, event
        finally:
            for t in tasks:
                t.cancel()

    async def _gather(self, task_lists: list[list[CompletionTask]]) -> list[Choice]:
        choices = [Choice(i) for i in range(sum(len(ts) for ts in task_lists))]
        async for index, ev in self._events(task_lists):
            c = choices[index]
            if isinstance(ev, TokenEvent):
                c.text.append(ev.text)
                c.tokens.append(ev.token)
                if ev.probs is not None:
                    c.probs.append(ev.probs)
            elif isinstance(ev, FinalEvent):
                c.text.append(ev.text_tail)
                c.final = ev
            elif isinstance(ev, ErrorEvent):
                raise HTTPError(ev.status, ev.message, ev.type)
        return choices

    # llama-server /completion
    def _completion_input(self, req: Request, oai: bool) -> tuple[dict, CompletionParams, list[Any], list[list[int]]]:
        """The body, its parameters, its prompts as given and as tokens (off the loop for large bodies)."""
        st = self.state
        body = req.json()
        p = parse_completion(body, st.args.n_predict, st.slots_per_group, oai=oai, n_vocab=st.tokenizer.n_vocab,
                             tokenizer=st.tokenizer, default_n_keep=_keep(st.args))
        check_not_chat(body, "/v1/completions" if oai else "/completion")
        if "prompt" not in body:
            raise HTTPError(400, "'prompt' is required")
        given = split_prompts(body["prompt"])
        _check_fan_out(st, len(given), p.n)
        for prompt in given:
            st.check_prompt_fits(*_prompt_size(prompt))
        _check_constraint(st, p)
        return body, p, given, [tokenize_prompt(st.tokenizer, prompt) for prompt in given]

    async def completion(self, req: Request) -> Response | StreamResponse:
        _require_ready(self.state)
        body, p, given, prompts = await _prepare(req, lambda: self._completion_input(req, oai=False))
        return await self._completion_response(p, given, prompts)

    async def _completion_response(self, p: CompletionParams, given: list[Any],
                                   prompts: list[list[int]]) -> Response | StreamResponse:
        task_lists = self._tasks(prompts, p)
        texts = [g if isinstance(g, str) else self.state.tokenizer.decode(t) for g, t in zip(given, prompts)]
        if p.stream:
            return _stream(p, self._completion_stream(task_lists, p, prompts, texts))
        choices = await self._gather(task_lists)
        settings = task_lists[0][0].settings
        out = [self._completion_json(c, p, prompts[c.index // p.n], texts[c.index // p.n], settings) for c in choices]
        return json_response(out[0] if len(out) == 1 else out)

    def _completion_json(self, c: Choice, p: CompletionParams, prompt: list[int], text_prompt: str,
                         settings: dict, stream: bool = False) -> dict:
        """One choice's final result; `settings`: the request's generation_settings (its tasks')."""
        f = c.final
        assert f is not None
        out = {"index": c.index, "content": c.content, "tokens": c.tokens if p.return_tokens and not stream else [],
               "id_slot": f.id_slot, "stop": True,
               "model": self.state.model_alias, "tokens_predicted": f.n_predicted, "tokens_evaluated": f.n_prompt,
               "generation_settings": settings, "prompt": text_prompt,
               "has_new_line": "\n" in c.content, "truncated": f.truncated, "stop_type": f.stop_type,
               "stopping_word": f.stopping_word, "tokens_cached": f.n_cache,
               "timings": _timings(f)}
        if p.n_probs and not stream:
            out["completion_probabilities"] = c.probs
        full = out
        if p.response_fields:
            out = nested_fields(p.response_fields, out)
        if _verbose(self.state, p):
            out["__verbose"] = dict(full)
        return out

    async def _completion_stream(self, task_lists, p, prompts, texts) -> AsyncIterator[bytes]:
        choices = [Choice(i) for i in range(sum(len(ts) for ts in task_lists))]
        async for index, ev in self._events(task_lists):
            c = choices[index]
            prompt = prompts[index // p.n]
            if isinstance(ev, TokenEvent):
                c.tokens.append(ev.token)
                chunk = {"index": index, "content": ev.text, "tokens": [ev.token], "stop": False, "id_slot": ev.id_slot,
                         "tokens_predicted": len(c.tokens), "tokens_evaluated": len(prompt)}
                if ev.timings is not None:
                    prompt_n, prompt_ms, predicted_n, predicted_ms = ev.timings
                    chunk["timings"] = _timings_dict(prompt_n, prompt_ms, predicted_n, predicted_ms,
                                                     len(prompt) - prompt_n)
                if ev.probs is not None:
                    chunk["completion_probabilities"] = [ev.probs]
                yield sse_event(chunk)
            elif isinstance(ev, ProgressEvent):
                yield sse_event({"index": index, "content": "", "tokens": [], "stop": False, "id_slot": -1,
                                 "tokens_predicted": 0, "tokens_evaluated": len(prompt),
                                 "prompt_progress": {"total": ev.total, "cache": ev.cache, "processed": ev.processed,
                                                     "time_ms": round(ev.time_ms)}})  # whole ms, as llama-server
            elif isinstance(ev, FinalEvent):
                c.final = ev
                c.text = [ev.text_tail]
                yield sse_event(self._completion_json(c, p, prompt, texts[index // p.n], task_lists[0][0].settings,
                                                      stream=True))
            elif isinstance(ev, ErrorEvent):
                yield sse_event({"error": {"code": ev.status, "message": ev.message, "type": ev.type}})

    # llama-server /infill
    async def infill(self, req: Request) -> Response | StreamResponse:
        _require_ready(self.state)
        st = self.state

        def work():
            body = req.json()
            p = parse_completion(body, st.args.n_predict, st.slots_per_group, n_vocab=st.tokenizer.n_vocab,
                                 tokenizer=st.tokenizer, default_n_keep=_keep(st.args))
            check_not_chat(body, "/infill")
            for value in infill_fields(body).values():
                st.check_prompt_fits(*_prompt_size(value))
            _check_constraint(st, p)
            return p, infill_prompt(st.tokenizer, body, spm=bool(getattr(st.args, "spm_infill", False)))
        p, prompt = await _prepare(req, work)
        return await self._completion_response(p, [""], [prompt])

    # OpenAI /v1/completions
    async def oai_completion(self, req: Request) -> Response | StreamResponse:
        _require_ready(self.state)
        _, p, _, prompts = await _prepare(req, lambda: self._completion_input(req, oai=True))
        return await self._oai(self._tasks(prompts, p), p, sum(len(x) for x in prompts), chat=False)

    # OpenAI /v1/chat/completions
    async def oai_chat(self, req: Request) -> Response | StreamResponse:
        _require_ready(self.state)
        p, prompt, spec = await _prepare(req, lambda: self._chat_input(req.json()))
        return await self._oai(self._tasks([prompt], p), p, len(prompt), chat=True, chat_spec=spec)

    # Anthropic /v1/messages
    async def messages(self, req: Request) -> Response | StreamResponse:
        _require_ready(self.state)
        p, prompt, spec = await _prepare(req, lambda: self._chat_input(anthropic.chat_body(req.json())))
        tasks = self._tasks([prompt], p)
        for t in tasks[0]:  # a stream's message_start waits for the cache's share of the prompt (its first progress event)
            t.return_progress = p.stream
        return await self._message_response(tasks, spec, p)

    async def _message_response(self, tasks: list[list[CompletionTask]], spec: ChatOutputSpec,
                                p: CompletionParams) -> Response | StreamResponse:
        rid = "chatcmpl-" + uuid.uuid4().hex[:24]  # llama-server's ids
        if p.stream:
            return _stream(p, self._messages_stream(tasks, rid, spec))
        c = (await self._gather(tasks))[0]
        assert c.final is not None
        reply = await self._whole_reply(c, spec)
        return json_response(anthropic.message(rid, self.state.model_alias, anthropic.content_blocks(reply.message()),
                                               anthropic.final_usage(c.final),
                                               anthropic.ending(chat_finish_reason(c.final, reply), c.final)))

    async def _messages_stream(self, task_lists, rid: str, spec: ChatOutputSpec) -> AsyncIterator[bytes]:
        n_prompt = len(task_lists[0][0].prompt)
        started = False
        reply, blocks = ChatReply(spec), anthropic.BlockStream()
        async for _, ev in self._events(task_lists):
            if not started:
                # as llama-server: sent once the request has a slot, when the cache's share of the
                # prompt is known (a progress event carries it; without one, all of it counts as input)
                started = True
                n_cached = ev.cache if isinstance(ev, ProgressEvent) else 0
                start = anthropic.message(rid, self.state.model_alias, [],
                                          anthropic.usage(n_prompt, n_prompt - n_cached, 0))
                yield anthropic.event("message_start", message=start)
            if isinstance(ev, TokenEvent):
                for chunk in blocks.feed(await self._read(reply, ev.text)):
                    yield chunk
            elif isinstance(ev, FinalEvent):
                for chunk in blocks.feed(await self._read(reply, ev.text_tail, finish=True)) + blocks.close():
                    yield chunk
                yield anthropic.event("message_delta", delta=anthropic.ending(chat_finish_reason(ev, reply), ev),
                                      usage=anthropic.final_usage(ev))
                yield anthropic.event("message_stop")
            elif isinstance(ev, ErrorEvent):
                yield anthropic.event("error", error={"type": ev.type, "message": ev.message})

    # OpenAI /v1/responses
    async def responses(self, req: Request) -> Response | StreamResponse:
        _require_ready(self.state)

        def work() -> tuple[dict, CompletionParams, list[int], ChatOutputSpec]:
            body = req.json()
            return (body, *self._chat_input(resp.chat_body(body)))
        body, p, prompt, spec = await _prepare(req, work)
        return await self._response_response(body, self._tasks([prompt], p), spec, p)

    async def _response_response(self, body: dict, tasks: list[list[CompletionTask]], spec: ChatOutputSpec,
                                 p: CompletionParams) -> Response | StreamResponse:
        rid, created = resp.new_id("resp"), int(time.time())
        if p.stream:
            return _stream(p, self._response_stream(body, tasks, spec, rid, created))
        c = (await self._gather(tasks))[0]
        assert c.final is not None
        reply = await self._whole_reply(c, spec)
        out = resp.response(rid, created, self.state.model_alias, body, resp.output_items(reply.message()), c.final,
                            chat_finish_reason(c.final, reply))
        if _verbose(self.state, p):  # (the request's verbose reaches here through the chat body)
            out["__verbose"] = self._completion_json(c, replace(p, response_fields=[], verbose=False),
                                                     tasks[0][0].prompt, "", tasks[0][0].settings)
        return json_response(out)

    async def _response_stream(self, body: dict, task_lists, spec: ChatOutputSpec, rid: str,
                               created: int) -> AsyncIterator[bytes]:
        seq = 0

        def send(name: str, data: dict) -> bytes:
            nonlocal seq
            seq += 1
            return sse_named_event(name, {"type": name, **data, "sequence_number": seq - 1})

        model = self.state.model_alias
        started = resp.response(rid, created, model, body, [])
        yield send("response.created", {"response": started})
        yield send("response.in_progress", {"response": started})
        reply, items = ChatReply(spec), resp.ItemStream()
        async for _, ev in self._events(task_lists):
            if isinstance(ev, TokenEvent):
                for name, data in items.feed(await self._read(reply, ev.text)):
                    yield send(name, data)
            elif isinstance(ev, FinalEvent):
                for name, data in items.feed(await self._read(reply, ev.text_tail, finish=True)) + items.close():
                    yield send(name, data)
                done = resp.response(rid, created, model, body, items.items, ev, chat_finish_reason(ev, reply))
                yield send("response.completed" if done["status"] == "completed" else "response.incomplete",
                           {"response": done})
            elif isinstance(ev, ErrorEvent):
                yield send("error", {"code": ev.type, "message": ev.message, "param": None})

    async def count_tokens(self, req: Request) -> Response:
        """Anthropic /v1/messages/count_tokens: the rendered conversation's length in tokens."""
        _require_ready(self.state)
        _, prompt, _ = await _prepare(req, lambda: self._chat_input(anthropic.chat_body(req.json(),
                                                                                         count_tokens=True)))
        return json_response({"input_tokens": len(prompt)})

    async def chat_input_tokens(self, req: Request) -> Response:
        """/v1/chat/completions/input_tokens: the prompt tokens the chat request would have."""
        _require_ready(self.state)
        _, prompt, _ = await _prepare(req, lambda: self._chat_input(req.json()))
        return json_response({"object": "response.input_tokens", "input_tokens": len(prompt)})

    async def response_input_tokens(self, req: Request) -> Response:
        """/v1/responses/input_tokens: the prompt tokens the Responses request would have."""
        _require_ready(self.state)
        _, prompt, _ = await _prepare(req, lambda: self._chat_input(resp.chat_body(req.json())))
        return json_response({"object": "response.input_tokens", "input_tokens": len(prompt)})

    def _render_chat(self, body: dict) -> tuple[str, str]:
        """(prompt text, prefill) of a chat body: template, prefill, chat_template_kwargs (chat.py)."""
        try:
            return self.state.chat.render_with_prefill(body)
        except ChatTemplateError as exc:
            raise HTTPError(400, str(exc)) from None

    async def apply_template(self, req: Request) -> Response:
        """llama-server's /apply-template: the prompt a chat body would be, without generating."""
        _require_ready(self.state)

        def work() -> Response:
            body = req.json()
            if not isinstance(body, dict):
                raise HTTPError(400, "the request body must be a JSON object")
            return json_response({"prompt": self._render_chat(body)[0]})
        return await _prepare(req, work)

    def _chat_input(self, body: Any) -> tuple[CompletionParams, list[int], ChatOutputSpec]:
        """A chat body's parameters, its rendered, tokenized conversation and how to read the
        reply (off the loop for large bodies)."""
        st = self.state
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        p = parse_completion(body, st.args.n_predict, st.slots_per_group, oai=True, n_vocab=st.tokenizer.n_vocab,
                             tokenizer=st.tokenizer, default_n_keep=_keep(st.args))
        spec = self._chat_output_spec(body)
        text, spec.prefill = self._render_chat(body)
        # what the generation continues from (a template that does not think opens no thinking)
        opens = spec.thinks and prompt_opens_thinking(text, spec.family, spec.tags)
        # the reply is read from the generation prompt on, the prefill included, as llama-server reads it
        head = text[:len(text) - len(spec.prefill)]
        spec.forced_open = spec.thinks and prompt_opens_thinking(head, spec.family, spec.tags) \
            if spec.prefill else opens
        spec.opener = thinking_opener(head, spec.family, spec.tags) if spec.forced_open else ""
        if spec.tools.required and spec.family is not None:
            # a call is required: generation follows a grammar of the family's call format (after
            # closing the thinking the prompt opened, so that the call is not read as thoughts)
            if any(body.get(k) is not None for k in ("grammar", "json_schema")) or \
                    isinstance(body.get("response_format"), dict) and body["response_format"].get("type") != "text":
                raise HTTPError(400, "'tool_choice' requires a tool call, which cannot be combined with 'grammar', "
                                     "'json_schema' or 'response_format'")
            grammar = call_grammar(spec.family, spec.tools, self._special_token,
                                   close_thinking=opens and spec.reasoning_format != "none")
            p.constraint = ConstraintSpec("lark", grammar, "tools")
        elif spec.tools.parse_calls and CALL_TRIGGERS.get(spec.family or "") and p.constraint is None:
            # "auto": the reply is free until the family's call marker, then follows the call grammar
            # (a lazy grammar, as llama-server's), so that a call the model starts always parses
            trigger = CALL_TRIGGERS[spec.family or ""]
            p.constraint = ConstraintSpec("lark", call_grammar(spec.family or "", spec.tools, self._special_token), "tools")
            tid = self._special_token(trigger)
            p.triggers = (Trigger("token", trigger, tid) if tid is not None else Trigger("word", trigger),)
        st.check_prompt_fits(len(text), 0)
        _check_constraint(st, p)
        self._thinking_budget(body, p, spec.forced_open, spec.thinks)
        tok = st.tokenizer
        bos = _token_text(tok, tok.bos_id)
        return p, tok.encode(text, add_special=not (bos and text.startswith(bos)), parse_special=True), spec

    def _thinking_budget(self, body: dict, p: CompletionParams, opened: bool, thinks: bool = True) -> None:
        """The request's reasoning_budget_tokens (else its thinking_budget_tokens, else --reasoning-budget;
        a request's -1 lifts the server's budget) and what ends a spent budget: its
        reasoning_budget_message (else --reasoning-budget-message) before the end of the thinking.
        Under a template that does not think there is no budget (the fields are still checked), as
        llama-server passes one on only where its chat format has thinking end tags."""
        args = self.state.args
        name = "reasoning_budget_tokens" if body.get("reasoning_budget_tokens") is not None else "thinking_budget_tokens"
        budget = get_int(body, name, getattr(args, "reasoning_budget", -1), lo=-1)
        message = body.get("reasoning_budget_message")
        if message is not None and not isinstance(message, str):
            raise HTTPError(400, "'reasoning_budget_message' must be a string")
        if budget is None or budget < 0 or not thinks:
            return
        end = budget_end_text(getattr(args, "reasoning_budget_message", "") if message is None else message)
        p.thinking_budget, p.thinking_open = budget, opened
        p.thinking_end = self.state.tokenizer.encode(end, add_special=False, parse_special=True)

    def _special_token(self, text: str) -> Optional[int]:
        """The id of the special (control) token whose text is `text`, if the vocabulary has one."""
        tok = self.state.tokenizer
        ids = tok.encode(text, add_special=False, parse_special=True)
        if len(ids) == 1 and tok.token_text(ids[0]) == text and tok.token_type(ids[0]) not in _PLAIN_TOKEN_TYPES:
            return ids[0]
        return None

    def _chat_output_spec(self, body: dict) -> ChatOutputSpec:
        """The request's tools, tool_choice, parallel_tool_calls and reasoning_format, checked."""
        try:
            tools = parse_tool_request(body)
            fmt = check_format(body.get("reasoning_format"), getattr(self.state.args, "reasoning_format", "auto"))
        except (ToolChoiceError, ValueError) as exc:
            raise HTTPError(400, str(exc)) from None
        if getattr(self.state.args, "skip_chat_parsing", False):  # the reply is all content
            return ChatOutputSpec(family=None, tools=tools, reasoning_format="none", thinks=False)
        chat = self.state.chat
        if chat is None:
            return ChatOutputSpec(family=None, tools=tools, reasoning_format=fmt, thinks=False)
        family, thinking = chat.family, chat.thinking
        # a template that thinks in tags of its own (as llama-server's analysis finds them) is read
        # in those, unless its family has tags of its own or reads its thinking itself (gpt-oss)
        tags = (thinking.start, thinking.end) if thinking is not None and thinking.start and thinking.end and \
            (family or "") not in REASONING_TAGS and not reads_reasoning(family) else None
        return ChatOutputSpec(family=family, tools=tools, reasoning_format=fmt, thinks=thinking is not None, tags=tags,
                              full_tags=thinking.full if tags is not None and thinking is not None
                              and thinking.end_full else None)

    async def _oai(self, task_lists, p: CompletionParams, n_prompt: int, chat: bool,
                   chat_spec: Optional[ChatOutputSpec] = None) -> Response | StreamResponse:
        prefix = "chatcmpl-" if chat else "cmpl-"
        rid = prefix + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        model = self.state.model_alias
        if p.stream:
            return _stream(p, self._oai_stream(task_lists, p, n_prompt, chat, rid, created, model,
                                               chat_spec or ChatOutputSpec()))
        choices = await self._gather(task_lists)
        out_choices = []
        for c in choices:
            assert c.final is not None
            entry: dict = {"index": c.index, "finish_reason": _finish_reason(c.final)}
            if chat:
                reply = await self._whole_reply(c, chat_spec or ChatOutputSpec())
                entry["finish_reason"] = chat_finish_reason(c.final, reply)
                entry["message"] = reply.message()
                entry["logprobs"] = {"content": [_oai_logprob(x) for x in c.probs]} if p.n_probs else None
            else:
                entry["text"] = c.content
                entry["logprobs"] = _oai_text_logprobs(c.probs) if p.n_probs else None
            out_choices.append(entry)
        n_gen = sum(c.final.n_predicted for c in choices if c.final)
        # a prompt's choices share it: its first choice says what the cache held
        n_cached = sum(_cached(c.final) for c in choices if c.final and c.index % p.n == 0)
        out = {
            "id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": f"pyllama-{__version__}",
            "choices": out_choices,
            "usage": _usage(n_prompt, n_gen, n_cached),
            "timings": _timings(choices[0].final) if choices[0].final else {},
        }
        if _verbose(self.state, p):
            first = choices[0]
            out["__verbose"] = self._completion_json(first, replace(p, response_fields=[]), task_lists[0][0].prompt,
                                                     "", task_lists[0][0].settings) if first.final else {}
        return json_response(out)

    async def _oai_stream(self, task_lists, p, n_prompt, chat, rid, created, model,
                          chat_spec: Optional[ChatOutputSpec] = None) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        n_gen = n_cached = 0
        replies = {t.index: ChatReply(chat_spec or ChatOutputSpec()) for ts in task_lists for t in ts} if chat else {}
        offsets: dict[int, int] = {}  # per choice: characters of token text so far (text_offset)
        single = sum(len(ts) for ts in task_lists) == 1

        def chunk(index: int, text: Optional[str], finish: Optional[str], first: bool = False, probs=None,
                  delta: Optional[dict] = None, final: Optional[FinalEvent] = None) -> bytes:
            if chat:
                if first:
                    delta = {"role": "assistant", "content": None}
                elif delta is None:
                    delta = {"content": text} if text is not None else {}
                choice: dict = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
                if probs is not None:
                    choice["logprobs"] = {"content": [_oai_logprob(probs)]}
            else:
                choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
                if probs:
                    at = offsets.get(index, 0)
                    choice["logprobs"] = _oai_text_logprobs([probs], at)
                    offsets[index] = at + len(probs["token"])
            out = {"id": rid, "object": obj, "created": created, "model": model,
                   "system_fingerprint": f"pyllama-{__version__}", "choices": [choice]}
            if final is not None:  # as llama-server, the finishing chunk carries the timings (and usage)
                out["timings"] = _timings(final)
                if single:
                    out["usage"] = _usage(n_prompt, n_gen, _cached(final))
            return sse_event(out)

        if chat:
            for ts in task_lists:
                for t in ts:
                    yield chunk(t.index, None, None, first=True)
        async for index, ev in self._events(task_lists):
            if isinstance(ev, TokenEvent):
                n_gen += 1
                if chat:
                    # the reply's reader decides what the text is (content, reasoning, a call) and
                    # may hold it back; the token's logprobs go with the first delta it yields
                    deltas = await self._read(replies[index], ev.text)
                    if not deltas and ev.probs is not None:
                        deltas = [{}]
                    for k, d in enumerate(deltas):
                        yield chunk(index, None, None, probs=ev.probs if k == 0 else None, delta=d)
                elif ev.text or ev.probs is not None:
                    yield chunk(index, ev.text, None, probs=ev.probs)
            elif isinstance(ev, FinalEvent):
                if index % p.n == 0:
                    n_cached += _cached(ev)
                if chat:
                    reply = replies[index]
                    for d in await self._read(reply, ev.text_tail, finish=True):
                        yield chunk(index, None, None, delta=d)
                    yield chunk(index, None, chat_finish_reason(ev, reply), final=ev)
                    continue
                if ev.text_tail:
                    yield chunk(index, ev.text_tail, None)
                yield chunk(index, None, _finish_reason(ev), final=ev)
            elif isinstance(ev, ErrorEvent):
                yield sse_event({"error": {"code": ev.status, "message": ev.message, "type": ev.type}})
        if p.include_usage:
            yield sse_event({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                             "usage": _usage(n_prompt, n_gen, n_cached)})
        yield SSE_DONE


def infill_fields(body: Any) -> dict[str, Any]:
    """/infill's input_prefix and input_suffix (text, or a list mixing text and token ids, as
    llama-server tokenizes them) and prompt (text), each "" when absent; a 400 naming the first
    field of another type. Checked before anything else looks at them."""
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    out = {}
    for name in ("input_prefix", "input_suffix", "prompt"):
        v = body.get(name, "")
        if isinstance(v, str):
            out[name] = v
        elif name != "prompt" and isinstance(v, list) and all(
                isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool)) for x in v):
            out[name] = v
        elif name == "prompt":
            raise HTTPError(400, "'prompt' must be a string")
        else:
            raise HTTPError(400, f"'{name}' must be a string or a list of strings and token ids")
    return out


def infill_prompt(tok, body: Any, spm: bool = False) -> list[int]:
    """llama-server's fill-in-the-middle prompt (prefix-suffix-middle order): [BOS] FIM_PRE prefix
    FIM_SUF suffix FIM_MID prompt, the input_extra chunks first (each after FIM_SEP and its file
    name when the model has that token); spm (--spm-infill): the suffix part before the prefix
    part. A 400 naming a field of the wrong type, or when the model has no FIM tokens."""
    texts = infill_fields(body)
    pre, suf, mid = (getattr(tok, a, None) for a in ("fim_pre_id", "fim_suf_id", "fim_mid_id"))
    if pre is None or suf is None or mid is None:
        raise HTTPError(400, "the model has no fill-in-the-middle tokens (FIM prefix, suffix and middle: "
                             "tokenizer.ggml.fim_pre/suf/mid_token_id or <|fim_prefix|>-like tokens), so /infill "
                             "cannot be served")
    extra = body.get("input_extra", [])
    if not isinstance(extra, list) or not all(
            isinstance(e, dict) and isinstance(e.get("text", ""), str) and isinstance(e.get("filename", ""), str)
            for e in extra):
        raise HTTPError(400, "'input_extra' must be a list of {\"filename\": string, \"text\": string} objects")

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special=False, parse_special=False) if text else []

    def mixed(name: str) -> list[int]:
        v = texts[name]
        if isinstance(v, str):
            return enc(v)
        out: list[int] = []
        for x in v:
            if isinstance(x, str):
                out += enc(x)
            elif not 0 <= x < tok.n_vocab:
                raise HTTPError(400, f"'{name}' holds token id {x} outside the vocabulary of {tok.n_vocab}")
            else:
                out.append(x)
        return out
    out: list[int] = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    sep = getattr(tok, "fim_sep_id", None)
    for e in extra:
        if sep is not None:
            out += [sep] + enc(e.get("filename", "") + "\n")
        out += enc(e.get("text", ""))
    prefix, suffix = [pre] + mixed("input_prefix"), [suf] + mixed("input_suffix")
    out += (suffix + prefix if spm else prefix + suffix) + [mid] + enc(texts["prompt"])
    return out


def _check_constraint(st: ServerState, p: CompletionParams) -> None:
    """Compiles the request's grammar or schema (off the event loop, before any work): an invalid
    one is a 400 naming it; a valid one is cached for the tasks' own matchers."""
    if p.constraint is not None:
        compile_constraint(p.constraint, st.tokenizer)


_PLAIN_TOKEN_TYPES = (TT_NORMAL, TT_USER_DEFINED, TT_BYTE)


def _keep(args: Any) -> int:
    """The server's --keep (the default of a request's n_keep)."""
    return int(getattr(args, "keep", 0))


def _tags(args: Any) -> list[str]:
    """The model's tags (--tags, a comma list), [] when none."""
    v = getattr(args, "tags", None)
    if not v:
        return []
    return [t.strip() for t in v.split(",") if t.strip()] if isinstance(v, str) else list(v)


def _token_text(tok, token_id: Optional[int]) -> str:
    return tok.token_text(token_id) if token_id is not None else ""


def _logprob(entry: dict) -> float:
    """An entry's log-probability, whichever form it carries (post_sampling_probs gives `prob`)."""
    if "logprob" in entry:
        return entry["logprob"]
    p = entry.get("prob", 0.0)
    return math.log(p) if p > 0 else -1e30


def _oai_logprob(entry: dict) -> dict:
    top = entry.get("top_logprobs", entry.get("top_probs", []))
    # llama-server's entries carry the token id beside OpenAI's fields
    return {"id": entry["id"], "token": entry["token"], "logprob": _logprob(entry), "bytes": entry["bytes"],
            "top_logprobs": [{"id": t["id"], "token": t["token"], "logprob": _logprob(t), "bytes": t["bytes"]}
                             for t in top]}


def _oai_text_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """A text completion's logprobs in OpenAI's legacy form (`tokens`, `token_logprobs`,
    `top_logprobs`, `text_offset`: each token's first character in the generated text, from
    `offset`) and in llama-server's (`content`, as chat's), so clients of either read them."""
    starts = []
    for e in entries:
        starts.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [_logprob(e) for e in entries],
            "top_logprobs": [{t["token"]: _logprob(t) for t in e.get("top_logprobs", e.get("top_probs", []))}
                             for e in entries],
            "text_offset": starts, "content": [_oai_logprob(e) for e in entries]}
