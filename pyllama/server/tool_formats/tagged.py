"""Calls whose arguments are written as tagged name/value pairs, each value bare: Qwen3-Coder's
XML and GLM 4.5's key/value tags.

As llama-server does, a parameter whose schema can be a string (``type`` string or a list holding
it, a string ``enum`` / ``const``, string keywords such as ``pattern``) takes the text as it is;
any other value must be JSON. The arguments are built as compact JSON (``{"p":"v","n":1}``),
growing while a value is written, so that the streamed fragments add up to the final text. A call
to a function the request did not list, with a parameter its schema does not have, without a
required parameter, with a required parameter after an optional one (GLM 4.5: the required ones
in the order of the properties), or with a value that is not JSON where JSON is due, is not a
call (it stays in the content; for Qwen3-Coder, once a call was read, what follows that is not
another call is dropped, as llama-server drops it). Read without the request's tools, any function is taken and a value is JSON when it
reads as JSON.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Optional

from ..tool_calls import (BAD, DONE, PARTIAL, ToolCall, _Family, _find, _held_marker_prefix, _literal, _loads,
                          _Memo, _params, _Part, _skip_ws)

__all__ = ["Glm45", "Qwen3Coder", "schema_is_string"]


def schema_is_string(schema: Any, defs: Optional[dict] = None, seen: Optional[set] = None) -> bool:
    """Whether a parameter's value may be a string, so that the model writes it bare."""
    if not isinstance(schema, dict):
        return False
    seen = set() if seen is None else seen
    ref = schema.get("$ref")
    if isinstance(ref, str):
        if ref in seen or defs is None:
            return False  # a loop, or a reference nothing resolves: not a string, to be safe
        seen.add(ref)
        target = defs.get(ref.rsplit("/", 1)[-1]) if ref.startswith("#/") else None
        return schema_is_string(target, defs, seen)
    t = schema.get("type")
    if t == "string" or (isinstance(t, list) and "string" in t):
        return True
    for key in ("oneOf", "anyOf"):
        if any(schema_is_string(a, defs, seen) for a in schema.get(key) or ()):
            return True
    parts = schema.get("allOf")
    if parts and all(schema_is_string(a, defs, seen) for a in parts):
        return True
    if isinstance(schema.get("const"), str) or any(isinstance(v, str) for v in schema.get("enum") or ()):
        return True
    return any(k in schema for k in ("pattern", "minLength", "maxLength"))


class _Tool:
    """What a call's parsing needs to know of one listed function."""

    def __init__(self, tool: dict) -> None:
        params = _params(tool)
        props = params.get("properties")
        self.props: dict = props if isinstance(props, dict) else {}
        req = params.get("required")
        listed = {r for r in req if isinstance(r, str)} if isinstance(req, list) else set()
        self.required = [p for p in self.props if p in listed]  # in the properties' order
        defs = params.get("$defs") or params.get("definitions") or {}
        self.strings = {k: schema_is_string(v, defs if isinstance(defs, dict) else {}) for k, v in self.props.items()}


def _tool_table(tools: Optional[list[dict]]) -> Optional[dict[str, _Tool]]:
    if tools is None:
        return None
    return {t["function"]["name"]: _Tool(t) for t in tools}


def _esc(text: str) -> str:
    """text inside a JSON string literal (escaping one character at a time, so that the escaped
    start of a value is the start of the escaped value)"""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _key(name: str) -> str:
    return json.dumps(name, ensure_ascii=False) + ":"


def _is_json(text: str) -> bool:
    try:
        _loads(text)
    except ValueError:
        return False
    return True


def _q(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _string_value(schema: dict, end: str) -> str:
    """A bare text value and its end marker, as one Lark regex or a choice of literals (a
    string enum): the text cannot hold ``<``, so the end marker is the first one it meets."""
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else (
        [schema["const"]] if "const" in schema else None)
    if values and all(isinstance(v, str) for v in values):
        return "(" + " | ".join(json.dumps(v + end, ensure_ascii=False) for v in values) + ")"
    tail = "".join("\\n" if c == "\n" else "\\/" if c == "/" else re.escape(c) for c in end)
    return "/[^<]*" + tail + "/"



class Tagged(_Family):
    """A call whose arguments are written as tagged name/value pairs (Qwen3-Coder, GLM 4.5)."""

    arg_open = ""           # before a parameter's name
    name_close = ""         # after it
    value_open = ""         # before its value (after whitespace)
    value_close = ""        # after its value
    value_newlines = False  # one newline after value_open and before value_close belongs to the markup
    # llama-server's grammar for the pairs: the required parameters first (in the properties'
    # order when this is set, else in any order), then optional ones in any order
    required_in_order = False

    def __init__(self, tools: Optional[list[dict]] = None) -> None:
        self.tools = _tool_table(tools)

    def bind(self, tools: Optional[list[dict]], reasoning_format: str, read_calls: bool) -> _Family:
        return type(self)(tools)

    def _name_ok(self, name: str) -> bool:
        return bool(name) and (self.tools is None or name in self.tools)

    def _may_follow(self, tool: _Tool, pname: str, seen: list[str]) -> bool:
        """Whether parameter pname may come after those seen, as llama-server's grammar has it."""
        if pname not in tool.props:
            return False
        if pname not in tool.required:
            return True
        done = [r for r in seen if r in tool.required]
        if pname in done or len(done) < len(seen):  # a repeat, or after an optional one
            return False
        return not self.required_in_order or pname == tool.required[len(done)]

    def _args(self, s: str, p: int, name: str, final: bool, memo: Optional[_Memo] = None) -> tuple[int, int, str]:
        """(status, where the arguments end, the arguments' JSON so far) of the pairs from p on.
        DONE: s[end:] starts with what follows the pairs; PARTIAL: the text ran out inside them.
        With a memo (a stream's), reading resumes after the pairs read before, and the value
        being written is escaped only where it grew: a long value (a file the model writes)
        then costs per piece what the piece costs, not what the value does."""
        n = len(s)
        tool = self.tools.get(name) if self.tools is not None else None
        parts: list[str] = []
        seen: list[str] = []
        start = p
        kept = memo.formats.get(("pairs", start)) if memo is not None else None
        if kept is not None:
            p, parts, seen = kept[0], list(kept[1]), list(kept[2])

        def so_far(extra: str = "") -> str:
            return "{" + ",".join(parts) + ("," if parts and extra else "") + extra

        while True:
            p = _skip_ws(s, p)
            if not s.startswith(self.arg_open, p):
                rest = s[p:]
                if not final and (not rest or self.arg_open.startswith(rest)):
                    return PARTIAL, n, so_far()
                if tool is not None and any(r not in seen for r in tool.required):
                    return BAD, p, ""
                return DONE, p, so_far() + "}"
            q = p + len(self.arg_open)
            e = s.find(self.name_close, q)
            if e < 0:
                if final or n - q > 256:
                    return BAD, q, ""
                return PARTIAL, n, so_far()
            pname = s[q:e].strip()
            if not pname or (tool is not None and not self._may_follow(tool, pname, seen)):
                return BAD, q, ""
            is_str = tool.strings.get(pname, False) if tool is not None else None
            v = e + len(self.name_close)
            if self.value_open:
                v = _skip_ws(s, v)
                st = _literal(s, v, self.value_open)
                if st != DONE:
                    if st == PARTIAL and not final:
                        return PARTIAL, n, so_far()
                    return BAD, v, ""
                v += len(self.value_open)
            if self.value_newlines and s.startswith("\n", v):
                v += 1
            elif self.value_newlines and v >= n and not final:
                return PARTIAL, n, so_far(_key(pname) if is_str is not None else "")
            close = self.value_close
            end = _find(s, close, v, memo)
            raw = s[v:end] if end >= 0 else s[v:]
            if end < 0:
                if final:
                    return BAD, n, ""
                held = _held_marker_prefix(raw, (("\n" if self.value_newlines else "") + close,))
                raw = raw[:len(raw) - held] if held else raw
            elif self.value_newlines and raw.endswith("\n"):
                raw = raw[:-1]
            if is_str is None:  # no schema to go by: JSON when it reads as JSON, else text
                if end < 0:
                    return PARTIAL, n, so_far()  # which it is is known only at its end
                is_str = not _is_json(raw.strip())
            if is_str:
                value = '"' + self._escaped(raw, v, end < 0, memo) + ('"' if end >= 0 else "")
            else:
                value = raw.strip()
                if end >= 0 and not _is_json(value):
                    return BAD, v, ""
            if end < 0:
                return PARTIAL, n, so_far(_key(pname) + value)
            parts.append(_key(pname) + value)
            seen.append(pname)
            p = end + len(close)
            if memo is not None:  # a finished pair stays so whatever follows
                memo.formats[("pairs", start)] = (p, tuple(parts), tuple(seen))

    @staticmethod
    def _escaped(raw: str, at: int, growing: bool, memo: Optional[_Memo]) -> str:
        """_esc(raw) for the value at `at`; a growing value's escape is extended, not redone."""
        if memo is None:
            return _esc(raw)
        done = memo.formats.get(("value", at))
        if done is not None and len(raw) >= done[0]:
            text = done[1] + _esc(raw[done[0]:])
        else:
            text = _esc(raw)
        if growing:
            memo.formats[("value", at)] = (len(raw), text)
        return text

    # the markup of one parameter in a required call's grammar: (before the value, after it)
    def _arg_markup(self, pname: str) -> tuple[str, str]:
        raise NotImplementedError

    def _call_markup(self, name: str, args: str, lit: Callable[[str], str]) -> str:
        raise NotImplementedError

    def grammar_rules(self, tools: list[dict], many: bool, lit: Callable[[str], str],
                      json_rule: Callable[[str, dict], None]) -> list[str]:
        """The head Lark rules of a required call: the required parameters in the schema's order,
        then the optional ones, each value by its schema (a free text value holds no ``<``)."""
        alts = []
        for k, t in enumerate(tools):
            tool = _Tool(t)
            args = []
            order = tool.required + [p for p in tool.props if p not in tool.required]  # as both formats allow
            for a, pname in enumerate(order):
                schema = tool.props.get(pname) if isinstance(tool.props.get(pname), dict) else {}
                head, end = self._arg_markup(pname)
                if tool.strings.get(pname):
                    value = _string_value(schema, end)
                else:
                    json_rule(f"v{k}_{a}", schema)
                    value = f"v{k}_{a} {_q(end)}"
                item = f"{_q(head)} {value}"
                args.append(item if pname in tool.required else f"({item})?")
            alts.append(self._call_markup(t["function"]["name"], " ".join(args), lit))
        return ['start: call ("\\n" call)*' if many else "start: call", "call: " + " | ".join(alts)]


class Qwen3Coder(Tagged):
    name = "qwen3_coder"
    markers = ("<tool_call>", "<function=")
    arg_open, name_close, value_close = "<parameter=", ">", "</parameter>"
    value_newlines = True
    text_after_calls = False  # llama-server reads the calls to the end of the reply and drops the rest
    thinking_ends = ("<tool_call>",)  # Qwen3.5 may call straight from its thinking

    def at_marker(self, s: str, i: int, marker: str, final: bool, memo: Optional[_Memo] = None) -> _Part:
        n = len(s)
        j = i
        if marker == "<tool_call>":
            j = _skip_ws(s, i + len(marker))
            st = _literal(s, j, "<function=") if j < n else PARTIAL
            if st != DONE:
                return _Part(PARTIAL if st == PARTIAL and not final else BAD, n if st == PARTIAL else j, [])
        k = j + len("<function=")
        gt = s.find(">", k)
        if gt < 0:
            if final or n - k > 256 or "\n" in s[k:]:
                return _Part(BAD, k, [])
            return _Part(PARTIAL, n, [])
        name = s[k:gt].strip()
        if not self._name_ok(name):
            return _Part(BAD, k, [])
        st, end, args = self._args(s, gt + 1, name, final, memo)
        if st == BAD:
            return _Part(BAD, end, [])
        if st == PARTIAL:
            return _Part(PARTIAL, n, [ToolCall(name, args, done=False)])
        lit = _literal(s, end, "</function>")
        if lit != DONE:
            return _Part(PARTIAL, n, [ToolCall(name, args, done=False)]) if lit == PARTIAL and not final \
                else _Part(BAD, end, [])
        p = _skip_ws(s, end + len("</function>"))
        lit = _literal(s, p, "</tool_call>")
        if lit == DONE:
            return _Part(DONE, p + len("</tool_call>"), [ToolCall(name, args)])
        if p >= n:  # the reply ended with the function: taken as closed
            return _Part(DONE, p, [ToolCall(name, args)]) if final else \
                _Part(PARTIAL, n, [ToolCall(name, args, done=False)])
        if lit == PARTIAL and not final:
            return _Part(PARTIAL, n, [ToolCall(name, args, done=False)])
        return _Part(BAD, p, [])

    def _arg_markup(self, pname: str) -> tuple[str, str]:
        return f"<parameter={pname}>\n", "\n</parameter>\n"

    def _call_markup(self, name: str, args: str, lit: Callable[[str], str]) -> str:
        return f'{lit("<tool_call>")} {_q(chr(10) + "<function=" + name + ">" + chr(10))} {args} ' \
               f'"</function>\\n" {lit("</tool_call>")}'


class Glm45(Tagged):
    name = "glm45"
    markers = ("<tool_call>",)
    arg_open, name_close, value_open, value_close = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
    required_in_order = True

    _NAME_END = re.compile(r"\n|<arg_key>|</tool_call>")

    def at_marker(self, s: str, i: int, marker: str, final: bool, memo: Optional[_Memo] = None) -> _Part:
        n = len(s)
        k = i + len(marker)
        m = self._NAME_END.search(s, k)
        if m is None:
            if final or n - k > 256:
                return _Part(BAD, k, [])
            return _Part(PARTIAL, n, [])
        name = s[k:m.start()].strip()
        if not self._name_ok(name) or "<" in name or "{" in name:
            return _Part(BAD, k, [])
        st, end, args = self._args(s, m.start(), name, final, memo)
        if st == BAD:
            return _Part(BAD, end, [])
        if st == PARTIAL:
            return _Part(PARTIAL, n, [ToolCall(name, args, done=False)])
        lit = _literal(s, end, "</tool_call>")
        if lit == DONE:
            return _Part(DONE, end + len("</tool_call>"), [ToolCall(name, args)])
        if end >= n:
            return _Part(DONE, end, [ToolCall(name, args)]) if final else \
                _Part(PARTIAL, n, [ToolCall(name, args, done=False)])
        if lit == PARTIAL and not final:
            return _Part(PARTIAL, n, [ToolCall(name, args, done=False)])
        return _Part(BAD, end, [])

    def _arg_markup(self, pname: str) -> tuple[str, str]:
        return f"<arg_key>{pname}</arg_key>\n<arg_value>", "</arg_value>\n"

    def _call_markup(self, name: str, args: str, lit: Callable[[str], str]) -> str:
        return f'{lit("<tool_call>")} {_q(name + chr(10))} {args} {lit("</tool_call>")}'
