"""OpenAI's Responses API (``/v1/responses``) over the chat path.

A Responses request (``instructions``, ``input`` as text or a list of items: messages,
``function_call``, ``function_call_output``, ``reasoning``) becomes a chat completions body, as
llama-server converts it, and runs as any chat request; the reply's OpenAI parts
(:class:`~pyllama.server.api.ChatReply`) become output items: ``reasoning``, ``message`` (one
``output_text`` part) and a ``function_call`` per tool call, whole or as the stream's events
(``response.output_item.added``, ``response.output_text.delta``, ...). Nothing is stored: a
request carries its whole conversation."""
from __future__ import annotations

import time
import uuid
from typing import Any, Optional

from .http import HTTPError
from ..batching.task import FinalEvent

# The Responses API's own fields, turned into chat fields here or without a meaning in a chat body;
# every other field passes through as llama-server passes it (temperature, stream, and llama-server's
# own: top_k, seed, grammar, ...), so that the chat path honours it or refuses it by name.
_RESPONSES_ONLY = frozenset(("input", "instructions", "tools", "tool_choice", "max_output_tokens", "text",
                             "reasoning", "previous_response_id", "conversation", "store", "metadata", "include",
                             "truncation", "background", "service_tier", "prompt", "prompt_cache_key",
                             "safety_identifier", "user", "max_tool_calls"))
_TEXT_PARTS = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(content: Any, where: str) -> Any:
    """A message's content: a string, or its parts as chat content parts (text; images are left
    for the chat template's check, which answers that this model reads none)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise HTTPError(400, f"{where} must be a string or a list of content parts")
    parts: list[dict] = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": part.get("image_url", "")}})
        else:
            raise HTTPError(400, f"{where}[{k}]: unsupported content part {kind!r} (text parts and images only)")
    return parts


def _assistant(messages: list[dict]) -> dict:
    """The assistant message calls and reasoning attach to: the last message when it is the
    assistant's, else a new one."""
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    return messages[-1]


def _item(item: Any, i: int, messages: list[dict]) -> None:
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise HTTPError(400, f"{where} must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise HTTPError(400, f"{where}.role must be \"user\", \"assistant\", \"system\" or \"developer\", "
                                 f"got {role!r}")
        if "content" not in item:
            raise HTTPError(400, f"{where} needs 'content'")
        content = _text(item["content"], f"{where}.content")
        if role == "assistant" and messages and messages[-1]["role"] == "assistant" \
                and not messages[-1]["content"] and not messages[-1].get("tool_calls"):
            messages[-1]["content"] = content  # its reasoning came first
        else:
            messages.append({"role": "system" if role == "developer" else role, "content": content})
    elif kind == "function_call":
        name, call_id, args = item.get("name"), item.get("call_id"), item.get("arguments", "{}")
        if not isinstance(name, str) or not name or not isinstance(call_id, str) or not isinstance(args, str):
            raise HTTPError(400, f"{where}: a function_call item needs 'name', 'call_id' and 'arguments' (a string)")
        _assistant(messages).setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
    elif kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or output is None:
            raise HTTPError(400, f"{where}: a function_call_output item needs 'call_id' and 'output'")
        messages.append({"role": "tool", "tool_call_id": call_id, "content": _text(output, f"{where}.output")})
    elif kind == "reasoning":
        texts = [c.get("text", "") for c in item.get("content") or [] if isinstance(c, dict)] or \
            [s.get("text", "") for s in item.get("summary") or [] if isinstance(s, dict)]
        msg = _assistant(messages)
        msg["reasoning_content"] = msg.get("reasoning_content", "") + "".join(texts)
    else:
        raise HTTPError(400, f"{where}: unsupported item type {kind!r}")


def _tools(tools: Any) -> list[dict]:
    """The function tools; the hosted ones (web_search, file_search, custom, ...) are left out, as
    llama-server leaves them: the model could not call them here, and clients send them as a matter
    of course."""
    if not isinstance(tools, list):
        raise HTTPError(400, "'tools' must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise HTTPError(400, f"tools[{i}] must be an object with a 'type'")
        if tool["type"] != "function":
            continue
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise HTTPError(400, f"tools[{i}] needs a 'name'")
        fn = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise HTTPError(400, "'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                         "\"name\": ...}")


def _text_format(text: Any) -> Optional[dict]:
    """``text.format`` as the chat body's response_format."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None or isinstance(fmt, dict) and fmt.get("type") == "text":
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}
    raise HTTPError(400, "'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                         "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}")


def chat_body(body: Any) -> dict:
    """A Responses request as a chat completions body."""
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    if body.get("previous_response_id") is not None or body.get("conversation") is not None:
        raise HTTPError(400, "responses are not stored here: send the whole conversation in 'input' "
                             "('previous_response_id' and 'conversation' are not supported)")
    messages: list[dict] = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise HTTPError(400, "'instructions' must be a string")
        messages.append({"role": "system", "content": body["instructions"]})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        for i, item in enumerate(given):
            _item(item, i, messages)
    else:
        raise HTTPError(400, "'input' is required (a string or a non-empty list of items)")
    chat: dict = {k: v for k, v in body.items() if k not in _RESPONSES_ONLY}
    chat["messages"] = messages
    if body.get("tools"):
        tools = _tools(body["tools"])
        if tools:
            chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    reasoning = body.get("reasoning")
    if reasoning is not None:  # only its effort has a meaning here, as for llama-server
        if not isinstance(reasoning, dict):
            raise HTTPError(400, "'reasoning' must be an object such as {\"effort\": \"low\"}")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    return chat


def usage(final: FinalEvent) -> dict:
    """As llama-server's: cached_tokens are the prompt's tokens taken from the prompt cache. The
    reasoning tokens are not counted apart (0)."""
    return {"input_tokens": final.n_prompt,
            "input_tokens_details": {"cached_tokens": final.n_prompt - final.n_evaluated, "cache_write_tokens": 0},
            "output_tokens": final.n_predicted, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": final.n_prompt + final.n_predicted}


def response(rid: str, created: int, model: str, body: dict, output: list[dict],
             final: Optional[FinalEvent] = None, finish_reason: Optional[str] = None) -> dict:
    """A response object; without `final`, the one in progress that a stream starts with."""
    status = "in_progress" if final is None else "incomplete" if finish_reason == "length" else "completed"
    out = {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
           "output": output, "error": None,
           "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
           "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
           "parallel_tool_calls": body.get("parallel_tool_calls", True),
           "temperature": body.get("temperature"), "top_p": body.get("top_p"),
           "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
           "text": body.get("text") or {"format": {"type": "text"}}, "metadata": body.get("metadata") or {},
           "store": False, "usage": usage(final) if final is not None else None}
    if final is not None:
        out["completed_at"] = int(time.time())
    return out


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [text_part(text)] if status == "completed" else []}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def call_item(item_id: str, call: dict, status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"]}


def output_items(message: dict) -> list[dict]:
    """An OpenAI assistant message (ChatReply.message) as output items."""
    items: list[dict] = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"]))
    for call in message.get("tool_calls", []):
        items.append(call_item(new_id("fc"), call))
    return items


class ItemStream:
    """A chat reply's OpenAI deltas -> the Responses stream's events (as (name, data) pairs, the
    data without its sequence_number): an output item opens when the kind of what comes changes
    (reasoning, the message's text, each function call) and is done before the next opens."""

    def __init__(self) -> None:
        self.items: list[dict] = []   # the finished output items
        self._open: Optional[dict] = None
        self._kind = ""
        self._text = ""

    @property
    def _index(self) -> int:
        return len(self.items)

    def _start(self, kind: str, item: dict) -> list[tuple[str, dict]]:
        out = self.close()
        self._open, self._kind, self._text = item, kind, ""
        out.append(("response.output_item.added", {"output_index": self._index, "item": item}))
        if kind == "message":
            out.append(("response.content_part.added", {"item_id": item["id"], "output_index": self._index,
                                                         "content_index": 0, "part": text_part("")}))
        return out

    def _ids(self) -> dict:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": self._index}

    def feed(self, deltas: list[dict]) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        for d in deltas:
            if d.get("reasoning_content"):
                if self._kind != "reasoning":
                    out += self._start("reasoning", {"id": new_id("rs"), "type": "reasoning", "summary": []})
                self._text += d["reasoning_content"]
                out.append(("response.reasoning_text.delta", {**self._ids(), "content_index": 0,
                                                              "delta": d["reasoning_content"]}))
            if d.get("content"):
                if self._kind != "message":
                    out += self._start("message", message_item(new_id("msg"), "", status="in_progress"))
                self._text += d["content"]
                out.append(("response.output_text.delta", {**self._ids(), "content_index": 0, "delta": d["content"],
                                                           "logprobs": []}))
            for call in d.get("tool_calls", []):
                fn = call.get("function", {})
                if "id" in call:
                    started = {"id": call["id"], "function": {"name": fn.get("name", ""), "arguments": ""}}
                    out += self._start("function_call", call_item(new_id("fc"), started, status="in_progress"))
                if fn.get("arguments"):
                    self._text += fn["arguments"]
                    out.append(("response.function_call_arguments.delta", {**self._ids(), "delta": fn["arguments"]}))
        return out

    def close(self) -> list[tuple[str, dict]]:
        item, kind, text = self._open, self._kind, self._text
        if item is None:
            return []
        ids = self._ids()
        out: list[tuple[str, dict]] = []
        if kind == "reasoning":
            out.append(("response.reasoning_text.done", {**ids, "content_index": 0, "text": text}))
            done = reasoning_item(item["id"], text)
        elif kind == "message":
            out.append(("response.output_text.done", {**ids, "content_index": 0, "text": text, "logprobs": []}))
            out.append(("response.content_part.done", {**ids, "content_index": 0, "part": text_part(text)}))
            done = message_item(item["id"], text)
        else:
            out.append(("response.function_call_arguments.done", {**ids, "name": item["name"], "arguments": text}))
            done = {**item, "status": "completed", "arguments": text}
        out.append(("response.output_item.done", {"output_index": self._index, "item": done}))
        self.items.append(done)
        self._open, self._kind, self._text = None, "", ""
        return out
