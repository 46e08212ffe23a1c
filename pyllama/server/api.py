"""HTTP endpoints: llama-server's API and the OpenAI-compatible one, over the slots and groups.

A completion handler validates the body, makes one task per choice, hands them to the router and
turns the events that come back into llama-server or OpenAI JSON, streamed as Server-Sent Events
or gathered. If the client goes away the handler is cancelled and its `finally` cancels the tasks,
which frees their slots at the next decode step.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional, TypeVar

from .. import __version__
from ..sampling import SamplingParams
from .chat import ChatTemplate, ChatTemplateError, validate_messages
from .http import (SSE_DONE, HTTPError, Request, Response, StreamResponse, error_response, json_response,
                   sse_event)
from .metrics import Metrics
from .params import CompletionParams, parse_completion, tokenize_prompt
from .task import CompletionTask, ErrorEvent, FinalEvent, TokenEvent


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
    # --metrics, -v, --alias); the handlers and the HTTP layer read them.
    api_keys: list[str] = field(default_factory=list)
    cors_origins: list[str] = field(default_factory=list)  # empty: only localhost origins
    slots_enabled: bool = True
    props_writable: bool = False
    slot_save_path: Optional[str] = None
    metrics_enabled: bool = False
    verbose: bool = False
    aliases: list[str] = field(default_factory=list)
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
            raise HTTPError(400, f"the request exceeds the available context size: the prompt is at least "
                                 f"{at_least} tokens and a slot holds {n_ctx}", "exceed_context_size_error")


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


def _require_ready(state: ServerState) -> None:
    if not state.ready:
        raise HTTPError(503, "Loading model", "unavailable_error")


T = TypeVar("T")

# Bodies up to this size are parsed and tokenized on the event loop (milliseconds at most). Larger
# ones go to a worker thread: tokenizing a prompt of several megabytes takes seconds, during which
# the loop would answer no other connection at all.
_INLINE_BODY = 16 << 10


async def _prepare(req: Request, work: Callable[[], T]) -> T:
    """work() (which reads req's body), off the event loop when the body is large."""
    if len(req.body) <= _INLINE_BODY:
        return work()
    return await asyncio.to_thread(work)


def _timings(final: FinalEvent) -> dict:
    def per(ms: float, n: int) -> tuple[float, float]:
        return (ms / n if n else 0.0), (1e3 * n / ms if ms > 0 else 0.0)
    p_tok, p_sec = per(final.prompt_ms, final.n_evaluated)
    g_tok, g_sec = per(final.predicted_ms, final.n_predicted)
    return {"prompt_n": final.n_evaluated, "prompt_ms": final.prompt_ms, "prompt_per_token_ms": p_tok,
            "prompt_per_second": p_sec, "predicted_n": final.n_predicted, "predicted_ms": final.predicted_ms,
            "predicted_per_token_ms": g_tok, "predicted_per_second": g_sec}


def _finish_reason(final: FinalEvent) -> str:
    return "length" if final.stop_type == "limit" else "stop"


def _settings(state: ServerState, p: CompletionParams) -> dict:
    s = p.sampling
    return {"n_ctx": state.n_ctx_slot, "n_predict": p.n_predict, "temperature": s.temperature, "top_k": s.top_k,
            "top_p": s.top_p, "min_p": s.min_p, "repeat_penalty": s.repeat_penalty, "repeat_last_n": s.repeat_last_n,
            "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty, "seed": s.seed,
            "n_probs": p.n_probs, "stop": p.stop, "ignore_eos": p.ignore_eos, "stream": p.stream,
            "cache_prompt": p.cache_prompt, "n_keep": p.n_keep}


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


class Api:
    def __init__(self, state: ServerState):
        self.state = state

    def routes(self) -> dict:
        r = {
            ("GET", "/health"): self.health, ("GET", "/v1/health"): self.health,
            ("POST", "/completion"): self.completion, ("POST", "/completions"): self.completion,
            ("POST", "/v1/completions"): self.oai_completion,
            ("POST", "/v1/chat/completions"): self.oai_chat, ("POST", "/chat/completions"): self.oai_chat,
            ("GET", "/v1/models"): self.models, ("GET", "/models"): self.models,
            ("POST", "/tokenize"): self.tokenize, ("POST", "/detokenize"): self.detokenize,
            ("GET", "/props"): self.props, ("GET", "/slots"): self.slots, ("GET", "/metrics"): self.metrics,
        }
        return r

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
        _require_ready(self.state)
        st = self.state
        hp = st.engine.model.hparams
        meta = {"n_vocab": hp.n_vocab, "n_ctx_train": hp.n_ctx_train, "n_embd": hp.n_embd,
                "n_params": st.engine.model.n_params(), "size": st.engine.model.file.data.nbytes}
        return json_response({"object": "list", "data": [
            {"id": st.model_alias, "object": "model", "created": st.created, "owned_by": "pyllama", "meta": meta}]})

    async def tokenize(self, req: Request) -> Response:
        _require_ready(self.state)
        return await _prepare(req, lambda: self._tokenize(req))

    def _tokenize(self, req: Request) -> Response:
        body = req.json()
        if not isinstance(body, dict) or not isinstance(body.get("content"), str):
            raise HTTPError(400, "'content' must be a string")
        add_special = body.get("add_special", False)
        with_pieces = body.get("with_pieces", False)
        if not isinstance(add_special, bool) or not isinstance(with_pieces, bool):
            raise HTTPError(400, "'add_special' and 'with_pieces' must be true or false")
        tok = self.state.tokenizer
        ids = tok.encode(body["content"], add_special=add_special, parse_special=True)
        if with_pieces:
            out: list = []
            for t in ids:
                piece = tok.token_bytes(t)
                try:
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

    async def props(self, req: Request) -> Response:
        _require_ready(self.state)
        st = self.state
        defaults = parse_completion({}, st.args.n_predict, st.slots_per_group, default_n_keep=_keep(st.args))
        snap = st.metrics.snapshot()
        return json_response({
            "default_generation_settings": {"n_ctx": st.n_ctx_slot, "params": _settings(st, defaults)},
            "total_slots": sum(len(g.slots) for g in st.groups),
            "model_alias": st.model_alias, "model_path": st.model_path,
            "chat_template": st.chat.source if st.chat else "",
            "bos_token": _token_text(st.tokenizer, st.tokenizer.bos_id),
            "eos_token": _token_text(st.tokenizer, st.tokenizer.eos_id),
            "modalities": {"vision": False, "audio": False},
            "build_info": f"pyllama {__version__}",
            "context_shift": bool(getattr(st.args, "context_shift", False)),
            "n_preemptions": snap["n_preemptions_total"], "n_context_shifts": snap["n_context_shifts_total"],
        })

    async def slots(self, req: Request) -> Response:
        _require_ready(self.state)
        return json_response([s.snapshot() for g in self.state.groups for s in g.slots])

    async def metrics(self, req: Request) -> Response:
        _require_ready(self.state)
        st = self.state
        kv_used = sum(g.ctx.kv.used_cells for g in st.groups)
        kv_total = sum(g.ctx.kv.n_cells for g in st.groups)
        text = st.metrics.render(
            requests_processing=st.router.n_processing, requests_deferred=st.router.n_deferred,
            kv_cache_usage_ratio=kv_used / kv_total if kv_total else 0.0,
            kv_cache_tokens=sum(g.ctx.kv.n_tokens_cached() for g in st.groups))
        return Response(200, text, content_type="text/plain; version=0.0.4; charset=utf-8")

    # --- completions -------------------------------------------------------------------------------
    def _tasks(self, prompt: list[int], p: CompletionParams) -> list[CompletionTask]:
        st = self.state
        if not prompt:
            raise HTTPError(400, "the prompt is empty")
        if len(prompt) >= st.n_ctx_slot:
            raise HTTPError(400, f"the request exceeds the available context size: the prompt is {len(prompt)} "
                                 f"tokens and a slot holds {st.n_ctx_slot}", "exceed_context_size_error")
        if p.id_slot >= sum(len(g.slots) for g in st.groups):
            raise HTTPError(400, f"'id_slot' {p.id_slot} does not exist")
        tasks = []
        for i in range(p.n):
            sampling = p.sampling
            if p.n > 1 and sampling.seed not in (-1, 0xFFFFFFFF):
                sampling = SamplingParams(**{**sampling.__dict__, "seed": (sampling.seed + i) & 0xFFFFFFFF})
            tasks.append(CompletionTask(prompt=prompt, params=sampling, n_predict=p.n_predict, n_keep=p.n_keep,
                                        ignore_eos=p.ignore_eos, stop=p.stop, n_probs=p.n_probs,
                                        cache_prompt=p.cache_prompt, id_slot=p.id_slot, index=i))
        return tasks

    async def _events(self, tasks: list[CompletionTask]) -> AsyncIterator[tuple[int, object]]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        for t in tasks:
            t.queue, t.loop = q, loop
        self.state.router.submit(tasks)
        remaining = len(tasks)
        try:
            while remaining:
                index, event = await q.get()
                if isinstance(event, (FinalEvent, ErrorEvent)):
                    remaining -= 1
                yield index, event
        finally:
            for t in tasks:
                t.cancel()

    async def _gather(self, tasks: list[CompletionTask]) -> list[Choice]:
        choices = [Choice(i) for i in range(len(tasks))]
        async for index, ev in self._events(tasks):
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
    def _completion_input(self, req: Request, oai: bool) -> tuple[dict, CompletionParams, list[int]]:
        """The body, its parameters and its prompt's tokens (runs off the loop for large bodies)."""
        st = self.state
        body = req.json()
        p = parse_completion(body, st.args.n_predict, st.slots_per_group, oai=oai, n_vocab=st.tokenizer.n_vocab,
                             tokenizer=st.tokenizer, default_n_keep=_keep(st.args))
        if "prompt" not in body:
            raise HTTPError(400, "'prompt' is required")
        st.check_prompt_fits(*_prompt_size(body["prompt"]))
        return body, p, tokenize_prompt(st.tokenizer, body["prompt"])

    async def completion(self, req: Request) -> Response | StreamResponse:
        _require_ready(self.state)
        body, p, prompt = await _prepare(req, lambda: self._completion_input(req, oai=False))
        tasks = self._tasks(prompt, p)
        text_prompt = body["prompt"] if isinstance(body["prompt"], str) else ""
        if p.stream:
            return StreamResponse(self._completion_stream(tasks, p, prompt, text_prompt))
        choices = await self._gather(tasks)
        out = [self._completion_json(c, p, prompt, text_prompt) for c in choices]
        return json_response(out[0] if len(out) == 1 else out)

    def _completion_json(self, c: Choice, p: CompletionParams, prompt: list[int], text_prompt: str) -> dict:
        f = c.final
        assert f is not None
        out = {"index": c.index, "content": c.content, "tokens": c.tokens, "id_slot": f.id_slot, "stop": True,
               "model": self.state.model_alias, "tokens_predicted": f.n_predicted, "tokens_evaluated": f.n_prompt,
               "generation_settings": _settings(self.state, p), "prompt": text_prompt,
               "has_new_line": "\n" in c.content, "truncated": f.truncated, "stop_type": f.stop_type,
               "stopping_word": f.stopping_word, "tokens_cached": f.n_cache,
               "timings": _timings(f)}
        if p.n_probs:
            out["completion_probabilities"] = c.probs
        return out

    async def _completion_stream(self, tasks, p, prompt, text_prompt) -> AsyncIterator[bytes]:
        choices = [Choice(i) for i in range(len(tasks))]
        async for index, ev in self._events(tasks):
            c = choices[index]
            if isinstance(ev, TokenEvent):
                c.tokens.append(ev.token)
                chunk = {"index": index, "content": ev.text, "tokens": [ev.token], "stop": False, "id_slot": ev.id_slot,
                         "tokens_predicted": len(c.tokens), "tokens_evaluated": len(prompt)}
                if ev.probs is not None:
                    chunk["completion_probabilities"] = [ev.probs]
                yield sse_event(chunk)
            elif isinstance(ev, FinalEvent):
                c.final = ev
                c.text = [ev.text_tail]
                final = self._completion_json(c, p, prompt, text_prompt)
                final["tokens"] = []
                yield sse_event(final)
            elif isinstance(ev, ErrorEvent):
                yield sse_event({"error": {"code": ev.status, "message": ev.message, "type": ev.type}})

    # OpenAI /v1/completions
    async def oai_completion(self, req: Request) -> Response | StreamResponse:
        _require_ready(self.state)
        _, p, prompt = await _prepare(req, lambda: self._completion_input(req, oai=True))
        return await self._oai(self._tasks(prompt, p), p, len(prompt), chat=False)

    # OpenAI /v1/chat/completions
    async def oai_chat(self, req: Request) -> Response | StreamResponse:
        _require_ready(self.state)
        p, prompt = await _prepare(req, lambda: self._chat_input(req))
        return await self._oai(self._tasks(prompt, p), p, len(prompt), chat=True)

    def _chat_input(self, req: Request) -> tuple[CompletionParams, list[int]]:
        """The parameters and the rendered, tokenized conversation (off the loop for large bodies)."""
        st = self.state
        body = req.json()
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        p = parse_completion(body, st.args.n_predict, st.slots_per_group, oai=True, n_vocab=st.tokenizer.n_vocab,
                             tokenizer=st.tokenizer, default_n_keep=_keep(st.args))
        try:
            messages = validate_messages(body.get("messages"))
            text = st.chat.render(messages, add_generation_prompt=True, tools=body.get("tools"))
        except ChatTemplateError as exc:
            raise HTTPError(400, str(exc)) from None
        st.check_prompt_fits(len(text), 0)
        tok = st.tokenizer
        bos = _token_text(tok, tok.bos_id)
        return p, tok.encode(text, add_special=not (bos and text.startswith(bos)), parse_special=True)

    async def _oai(self, tasks, p: CompletionParams, n_prompt: int, chat: bool) -> Response | StreamResponse:
        prefix = "chatcmpl-" if chat else "cmpl-"
        rid = prefix + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        model = self.state.model_alias
        if p.stream:
            return StreamResponse(self._oai_stream(tasks, p, n_prompt, chat, rid, created, model))
        choices = await self._gather(tasks)
        out_choices = []
        for c in choices:
            assert c.final is not None
            entry: dict = {"index": c.index, "finish_reason": _finish_reason(c.final)}
            if chat:
                entry["message"] = {"role": "assistant", "content": c.content}
                entry["logprobs"] = {"content": [_oai_logprob(x) for x in c.probs]} if p.n_probs else None
            else:
                entry["text"] = c.content
                entry["logprobs"] = _oai_text_logprobs(c.probs) if p.n_probs else None
            out_choices.append(entry)
        n_gen = sum(c.final.n_predicted for c in choices if c.final)
        return json_response({
            "id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": f"pyllama-{__version__}",
            "choices": out_choices,
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen},
            "timings": _timings(choices[0].final) if choices[0].final else {},
        })

    async def _oai_stream(self, tasks, p, n_prompt, chat, rid, created, model) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        n_gen = 0

        def chunk(index: int, text: Optional[str], finish: Optional[str], first: bool = False, probs=None) -> bytes:
            if chat:
                delta: dict = {}
                if first:
                    delta = {"role": "assistant", "content": None}
                elif text is not None:
                    delta = {"content": text}
                choice: dict = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
                if probs is not None:
                    choice["logprobs"] = {"content": [_oai_logprob(probs)]}
            else:
                choice = {"index": index, "text": text or "", "logprobs": _oai_text_logprobs([probs]) if probs else None,
                          "finish_reason": finish}
            return sse_event({"id": rid, "object": obj, "created": created, "model": model,
                              "system_fingerprint": f"pyllama-{__version__}", "choices": [choice]})

        if chat:
            for t in tasks:
                yield chunk(t.index, None, None, first=True)
        async for index, ev in self._events(tasks):
            if isinstance(ev, TokenEvent):
                n_gen += 1
                if ev.text or ev.probs is not None:
                    yield chunk(index, ev.text, None, probs=ev.probs)
            elif isinstance(ev, FinalEvent):
                if ev.text_tail:
                    yield chunk(index, ev.text_tail, None)
                yield chunk(index, None, _finish_reason(ev))
            elif isinstance(ev, ErrorEvent):
                yield sse_event({"error": {"code": ev.status, "message": ev.message, "type": ev.type}})
        if p.include_usage:
            yield sse_event({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                             "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_gen,
                                       "total_tokens": n_prompt + n_gen}})
        yield SSE_DONE


def _keep(args: Any) -> int:
    """The server's --keep (the default of a request's n_keep)."""
    return int(getattr(args, "keep", 0))


def _token_text(tok, token_id: Optional[int]) -> str:
    return tok.token_text(token_id) if token_id is not None else ""


def _oai_logprob(entry: dict) -> dict:
    return {"token": entry["token"], "logprob": entry["logprob"], "bytes": entry["bytes"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]}
                             for t in entry["top_logprobs"]]}


def _oai_text_logprobs(entries: list[dict]) -> dict:
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": []}
