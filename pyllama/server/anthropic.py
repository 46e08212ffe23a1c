"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) over the chat path.

A Messages request is turned into the chat completions body llama-server turns it into (system
prompt first, ``tool_use`` blocks as tool calls, ``tool_result`` blocks as tool messages,
``thinking`` blocks as reasoning_content), rendered and generated as any chat request; the reply's
OpenAI parts (:class:`~pyllama.server.api.ChatReply`) become Anthropic content blocks:
``thinking``, ``text`` and ``tool_use``, whole or as the stream's block events."""
from __future__ import annotations

import json
from typing import Any, Optional

from .http import HTTPError, sse_named_event
from ..batching.task import FinalEvent

# Anthropic requires max_tokens; llama-server lets it out and generates at most this many.
DEFAULT_MAX_TOKENS = 4096

_PASSED_THROUGH = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")


def _text_of(blocks: Any, where: str) -> str:
    """The text blocks of `blocks` (a string or a list of blocks) joined."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise HTTPError(400, f"{where} must be a string or a list of content blocks")
    out = []
    for i, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise HTTPError(400, f"{where}[{i}] must be a text block ({{\"type\": \"text\", \"text\": ...}})")
        out.append(b["text"])
    return "".join(out)


def _tool_result(block: dict, where: str) -> dict:
    use_id = block.get("tool_use_id")
    if not isinstance(use_id, str) or not use_id:
        raise HTTPError(400, f"{where}: a tool_result block needs 'tool_use_id'")
    content = block.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list) and any(isinstance(c, dict) and c.get("type") == "image" for c in content):
        pass  # the chat template's check answers that this model reads no images
    else:
        content = _text_of(content, f"{where}.content")
    return {"role": "tool", "tool_call_id": use_id, "content": content}


def _message(msg: Any, i: int) -> list[dict]:
    """One Anthropic message -> its chat messages (a user turn's tool results become tool messages)."""
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise HTTPError(400, f"{where} must be an object")
    role = msg.get("role")
    if role not in ("user", "assistant"):
        raise HTTPError(400, f"{where}.role must be \"user\" or \"assistant\", got {role!r}")
    content = msg.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise HTTPError(400, f"{where}.content must be a string or a list of content blocks")
    parts: list[dict] = []
    calls: list[dict] = []
    results: list[dict] = []
    reasoning = ""
    for k, block in enumerate(content):
        at = f"{where}.content[{k}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise HTTPError(400, f"{at}: a text block needs 'text' (a string)")
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "thinking":
            reasoning += str(block.get("thinking", ""))
        elif kind == "redacted_thinking":
            continue  # opaque to anyone but its author
        elif kind == "image":
            parts.append(block)  # the chat template's check answers that this model reads no images
        elif kind == "tool_use":
            name, args = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not name or not isinstance(args, dict):
                raise HTTPError(400, f"{at}: a tool_use block needs 'name' and 'input' (an object)")
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind == "tool_result":
            results.append(_tool_result(block, at))
        else:
            raise HTTPError(400, f"{at}: unsupported content block type {kind!r}")
    # A user turn's tool results answer the calls just before it, so they come first and the
    # turn's own text after them (llama-server puts the text first, between a call and its result).
    out: list[dict] = results
    if parts or calls or reasoning:
        m: dict = {"role": role, "content": parts if parts else ""}
        if calls:
            m["tool_calls"] = calls
        if reasoning:
            m["reasoning_content"] = reasoning
        out.append(m)
    return out


def _tool(tool: Any, i: int) -> dict:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
        raise HTTPError(400, f"tools[{i}] must be an object with a 'name'")
    schema = tool.get("input_schema", {})
    if not isinstance(schema, dict):
        raise HTTPError(400, f"tools[{i}].input_schema must be an object")
    return {"type": "function", "function": {"name": tool["name"], "description": str(tool.get("description", "")),
                                              "parameters": schema}}


def _tool_choice(choice: Any) -> tuple[Any, Optional[bool]]:
    """(the chat body's tool_choice, parallel_tool_calls or None)."""
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise HTTPError(400, "'tool_choice' must be {\"type\": \"auto\"}, {\"type\": \"any\"}, "
                             "{\"type\": \"tool\", \"name\": ...} or {\"type\": \"none\"}")
    kind = choice["type"]
    parallel = None if "disable_parallel_tool_use" not in choice else not choice["disable_parallel_tool_use"]
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise HTTPError(400, "'tool_choice' of type \"tool\" needs 'name'")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def _output_format(body: dict) -> Optional[dict]:
    """Structured output (``output_config.format``, or the earlier ``output_format``) as the chat
    body's response_format: the reply's text follows the JSON schema."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise HTTPError(400, "'output_config' must be an object")
    where, fmt = ("'output_config.format'", config.get("format")) if config and "format" in config \
        else ("'output_format'", body.get("output_format"))
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise HTTPError(400, f"{where} must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def chat_body(body: Any, count_tokens: bool = False) -> dict:
    """A Messages request as a chat completions body. `count_tokens`: the body of
    /v1/messages/count_tokens, which has no max_tokens."""
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "'messages' is required (a non-empty list)")
    out: list[dict] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text_of(system, "'system'")})
    for i, msg in enumerate(messages):
        out.extend(_message(msg, i))
    chat: dict = {"messages": out}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise HTTPError(400, "'tools' must be a list")
        chat["tools"] = [_tool(t, i) for i, t in enumerate(tools)]
    if body.get("tool_choice") is not None:
        chat["tool_choice"], parallel = _tool_choice(body["tool_choice"])
        if parallel is not None:
            chat["parallel_tool_calls"] = parallel
    if not count_tokens:
        chat["max_tokens"] = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    for key in _PASSED_THROUGH:
        if key in body:
            chat[key] = body[key]
    fmt = _output_format(body)
    if fmt is not None:
        chat["response_format"] = fmt
    thinking = body.get("thinking")
    if thinking is not None:
        # "enabled" / "disabled" switch the template's thinking on or off; budget_tokens holds it to a budget
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise HTTPError(400, "'thinking' must be {\"type\": \"enabled\", ...} or {\"type\": \"disabled\"}")
        kwargs = chat.get("chat_template_kwargs")
        kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
        kwargs.setdefault("enable_thinking", kind != "disabled")
        chat["chat_template_kwargs"] = kwargs
        if kind == "enabled" and thinking.get("budget_tokens") is not None:
            chat["thinking_budget_tokens"] = thinking["budget_tokens"]
    return chat


def ending(finish_reason: str, final: FinalEvent) -> dict:
    """stop_reason and stop_sequence for a chat choice's finish_reason and its final event."""
    if finish_reason == "tool_calls":
        reason = "tool_use"
    elif finish_reason == "length":
        reason = "max_tokens"
    else:
        reason = "stop_sequence" if final.stop_type == "word" else "end_turn"
    return {"stop_reason": reason, "stop_sequence": final.stopping_word if reason == "stop_sequence" else None}


def usage(n_prompt: int, n_evaluated: int, n_predicted: int) -> dict:
    """As llama-server's: the prompt tokens read from the cache apart from those computed."""
    return {"cache_read_input_tokens": n_prompt - n_evaluated, "input_tokens": n_evaluated,
            "output_tokens": n_predicted}


def final_usage(final: FinalEvent) -> dict:
    return usage(final.n_prompt, final.n_evaluated, final.n_predicted)


def message(rid: str, model: str, content: list[dict], usage: dict, end: Optional[dict] = None) -> dict:
    """An Anthropic message; without `end` (see :func:`ending`), the one a stream starts with."""
    end = end or {"stop_reason": None, "stop_sequence": None}
    return {"id": rid, "type": "message", "role": "assistant", "content": content, "model": model, **end,
            "usage": usage}


def _tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        value = None
    # a call whose arguments are not an object (a model's malformed call) is passed on as its text
    return value if isinstance(value, dict) else {"arguments": arguments}


def content_blocks(message: dict) -> list[dict]:
    """An OpenAI assistant message (ChatReply.message) as Anthropic content blocks."""
    blocks: list[dict] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls", []):
        fn = call["function"]
        blocks.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": _tool_input(fn["arguments"])})
    return blocks


def event(name: str, **fields: Any) -> bytes:
    """One stream event: its name is also its data's "type", as Anthropic sends them."""
    return sse_named_event(name, {"type": name, **fields})


class BlockStream:
    """A chat reply's OpenAI deltas -> Anthropic content block events: a block opens when the
    kind of what comes changes (thinking, text, each tool call) and closes before the next."""

    def __init__(self) -> None:
        self.index = -1
        self._open: Optional[str] = None

    def _start(self, kind: str, block: dict) -> list[bytes]:
        out = self.close()
        self.index += 1
        self._open = kind
        return out + [event("content_block_start", index=self.index, content_block=block)]

    def _delta(self, delta: dict) -> bytes:
        return event("content_block_delta", index=self.index, delta=delta)

    def feed(self, deltas: list[dict]) -> list[bytes]:
        out: list[bytes] = []
        for d in deltas:
            if d.get("reasoning_content"):
                if self._open != "thinking":
                    out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": d["reasoning_content"]}))
            if d.get("content"):
                if self._open != "text":
                    out += self._start("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": d["content"]}))
            for call in d.get("tool_calls", []):
                fn = call.get("function", {})
                if "id" in call:
                    out += self._start("tool_use", {"type": "tool_use", "id": call["id"], "name": fn.get("name", ""),
                                                    "input": {}})
                if fn.get("arguments"):
                    out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    def close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [event("content_block_stop", index=self.index)]
