"""More tool-call formats, each read as llama-server reads it (with its specialised parsers where it
has one, else with the parser it derives from the template).

============== ========================================== =============================================
family         recognised by (in the template source)     what the model writes
============== ========================================== =============================================
magistral      ``[SYSTEM_PROMPT]``, ``[TOOL_CALLS]`` and   ``[THINK]..[/THINK]`` then
               ``[ARGS]`` without ``[CALL_ID]``; or        ``[TOOL_CALLS]NAME[ARGS]{..}`` (or the JSON
               ``[TOOL_CALLS]`` with ``[THINK]``           list of the mistral family)
functionary-   ``>>>all`` and ``>>>${recipient}``          ``all\\ntext`` / ``NAME\\n{..}``, further parts
v3.2                                                      after ``>>>`` (the prompt ends with ``>>>``)
functionary-   ``<function=`` and ``</function>`` with no  ``<function=NAME>{..}</function>``
v3.1           ``<parameter=`` / ``<tool_call>``
command-r7b    ``<|START_ACTION|>`` (no ``<|START_TEXT|>``) ``<|START_THINKING|>..<|END_THINKING|>``,
                                                          ``<|START_ACTION|>[{"tool_call_id": I,
                                                          "tool_name": N, "parameters": A}]<|END_ACTION|>``,
                                                          ``<|START_RESPONSE|>text<|END_RESPONSE|>``
granite        ``<|tool_call|>``                           ``<|tool_call|>[{"name": N, "arguments": A}]``,
                                                          ``<think>..</think><response>..</response>``
                                                          (the response markers stay in the content)
seed-oss       ``<seed:tool_call>``                        ``<seed:think>..</seed:think>``, ``<seed:tool_call>
                                                          <function=N><parameter=P>V</parameter>
                                                          </function></seed:tool_call>``
apertus        ``<|tools_prefix|>``                        ``<|inner_prefix|>..<|inner_suffix|>``, then
                                                          ``<|tools_prefix|>[{NAME: A}]<|tools_suffix|>``
nemotron-v2    ``<SPECIAL_10>``, ``<SPECIAL_11>``,          ``<think>..</think>`` then
               ``<SPECIAL_12>`` and ``<TOOL_RESPONSE>``;    ``<TOOLCALL>[{"name": N, "arguments": A}]</TOOLCALL>``
               or ``<TOOLCALL>``
============== ========================================== =============================================

These are tested before the families of tool_calls.py, whose markers some of these templates also
hold (Llama's ``ipython`` turns, Mistral's ``[TOOL_CALLS]``).
Nemotron v3 (Nano 3) writes Qwen3-Coder's XML calls, as llama-server reads it, and is that family.

Seed-OSS writes parameters as text: a parameter whose schema takes a string gets all of its text,
any other the JSON value its text reads as (without the request's tools: a value that reads as
JSON is taken as that value, any other as a string). Its arguments grow one whole parameter at a time, so the streamed fragments always
add up to the final JSON text.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Optional

from .tool_calls import (BAD, DONE, PARTIAL, Snapshot, ToolCall, ToolSpec, _Family, _find, _held_marker_prefix,
                         _lark_literal, _limit, _loads, _Memo, _Mistral, _params, _Part, _scan_members, _skip_ws,
                         _unfinished, _literal, scan_json)
from ..batching.constraint import JSON_WHITESPACE
from .reasoning import REASONING_TAGS

__all__ = ["FAMILIES", "detect", "reads_content", "call_grammar"]

FAMILIES = (
    "magistral",
    "functionary-v3.2",
    "functionary-v3.1",
    "command-r7b",
    "granite",
    "seed-oss",
    "apertus",
    "nemotron-v2",
)


_FUNCTIONARY_V31 = ('set has_code_interpreter = tools | selectattr("type", "equalto", "code_interpreter") '
                    '| list | length > 0')


def detect(src: str) -> Optional[str]:
    """The family of a template source among this module's, or None."""
    if "[TOOL_CALLS]" in src and ("[THINK]" in src or (
            "[SYSTEM_PROMPT]" in src and "[ARGS]" in src and "[CALL_ID]" not in src)):
        return "magistral"
    if ">>>all" in src and ">>>${recipient}" in src:
        return "functionary-v3.2"
    if _FUNCTIONARY_V31 in src or ("<function=" in src and "</function>" in src and "<parameter=" not in src
                                   and "<tool_call>" not in src):
        return "functionary-v3.1"
    if "<|START_ACTION|>" in src and "<|START_TEXT|>" not in src:
        return "command-r7b"
    if "<|tool_call|>" in src:
        return "granite"
    if "<seed:tool_call>" in src:
        return "seed-oss"
    if "<|tools_prefix|>" in src:
        return "apertus"
    if "<TOOLCALL>" in src or all(t in src for t in ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>",
                                                      "<TOOL_RESPONSE>")):
        return "nemotron-v2"
    return None


def reads_content(family: Optional[str]) -> bool:
    """Whether the family's replies carry markers around plain text (read even without tools)."""
    return family in _READS_CONTENT


_READS_CONTENT = frozenset(("functionary-v3.2", "command-r7b"))


# ---------------------------------------------------------------------------------------------
# Readers


def _keyed_call(s: str, i: int, final: bool, memo: Optional[_Memo], name_key: str, args_key: str,
                id_key: Optional[str] = None) -> _Part:
    """A call written as one JSON object holding its name, arguments (and id) under these keys;
    announced, while it is being written, once the name is known and the arguments have begun."""
    m = _scan_members(s, i, memo)
    if m.status == BAD:
        return _Part(BAD, m.end, [])

    def text(key: str) -> Any:
        span = m.done.get(key)
        return _loads(s[span[0]:span[1]]) if span else None
    name, call_id = text(name_key), text(id_key) if id_key else None
    if (name is not None and not isinstance(name, str)) or \
            (call_id is not None and not isinstance(call_id, (str, int))):
        return _Part(BAD, m.end, [])
    cid = str(call_id) if call_id is not None else ""
    if m.status == PARTIAL:
        if final:
            return _Part(BAD, m.end, [])
        if name and args_key in m.done:
            span = m.done[args_key]
            return _Part(PARTIAL, m.end, [ToolCall(name, s[span[0]:span[1]], cid, done=False)])
        if name and m.open_key == args_key and s.startswith("{", m.open_start):
            return _Part(PARTIAL, m.end, [ToolCall(name, s[m.open_start:], cid, done=False)])
        return _Part(PARTIAL, m.end, [])
    span = m.done.get(args_key)
    if not name or (span is not None and not s.startswith("{", span[0])):
        return _Part(BAD, m.end, [])
    return _Part(DONE, m.end, [ToolCall(name, s[span[0]:span[1]] if span else "{}", cid)])


def _named_object(s: str, i: int, final: bool, memo: Optional[_Memo]) -> _Part:
    """Apertus: a call is an object with one member, the tool's name, whose value is its arguments."""
    m = _scan_members(s, i, memo)
    if m.status == BAD:
        return _Part(BAD, m.end, [])
    if m.status == PARTIAL:
        if final:
            return _Part(BAD, m.end, [])
        if len(m.done) == 1 and m.open_key is None:  # its one member is written, the object not closed
            (name, span), = m.done.items()
            if s.startswith("{", span[0]):
                return _Part(PARTIAL, m.end, [ToolCall(name, s[span[0]:span[1]], done=False)])
        if m.done:  # a second member makes this no call
            return _Part(PARTIAL, m.end, [])
        if m.open_key and s.startswith("{", m.open_start):
            return _Part(PARTIAL, m.end, [ToolCall(m.open_key, s[m.open_start:], done=False)])
        return _Part(PARTIAL, m.end, [])
    if len(m.done) != 1:
        return _Part(BAD, m.end, [])
    (name, span), = m.done.items()
    if not name or not s.startswith("{", span[0]):
        return _Part(BAD, m.end, [])
    return _Part(DONE, m.end, [ToolCall(name, s[span[0]:span[1]])])


def _json_list(s: str, j: int, final: bool, memo: Optional[_Memo], item: Callable[..., _Part]) -> _Part:
    """The JSON list of calls at s[j] == '[' (the last one may be unfinished)."""
    calls: list[ToolCall] = []
    i, n = j + 1, len(s)
    while True:
        i = _skip_ws(s, i)
        if i >= n:
            return _Part(BAD if final else PARTIAL, n, [_unfinished(c) for c in calls])
        if s[i] != "{":
            return _Part(BAD, i, [])  # an empty list calls nothing
        part = item(s, i, final, memo)
        if part.status == BAD:
            return _Part(BAD, part.end, [])
        if part.status == PARTIAL:
            return _Part(PARTIAL, n, calls + part.calls)
        calls += part.calls
        i = _skip_ws(s, part.end)
        if i >= n:
            return _Part(BAD if final else PARTIAL, n, [_unfinished(c) for c in calls])
        if s[i] == "]":
            return _Part(DONE, i + 1, calls)
        if s[i] != ",":
            return _Part(BAD, i, [])
        i += 1


def _closed_by(s: str, part: _Part, end_marker: str, final: bool) -> _Part:
    """A finished part followed by its end marker; a missing marker is forgiven (text after it is
    content again), a marker still being written keeps the calls unfinished."""
    if part.status != DONE or not end_marker:
        return part
    k = _skip_ws(s, part.end)
    st = _literal(s, k, end_marker)
    if st == DONE:
        return _Part(DONE, k + len(end_marker), part.calls)
    if st == PARTIAL and not final:
        return _Part(PARTIAL, len(s), [_unfinished(c) for c in part.calls])
    return _Part(DONE, part.end, part.calls)


class _Marked(_Family):
    """Calls that begin at markers anywhere in the reply, content around them with its own
    wrapping markers (dropped) -- read by :meth:`read` in place of tool_calls.parse's loop."""

    wrappers: tuple[str, ...] = ()

    def read(self, text: str, final: bool, parallel: bool, memo: Optional[_Memo], calls: bool = True) -> Snapshot:
        markers = self.markers if calls else ()
        pieces: list[str] = []
        found: list[ToolCall] = []
        pos = 0
        while True:
            hits = [(k, m) for k, m in ((_find(text, m, pos, memo), m) for m in markers) if k >= 0]
            if not hits:
                tail = text[pos:]
                if not final:
                    held = _held_marker_prefix(tail, markers + self.wrappers)
                    tail = (tail[:len(tail) - held] if held else tail).rstrip()
                pieces.append(tail)
                break
            k, marker = min(hits)
            part = self.at_marker(text, k, marker, final, memo)
            if part.status == BAD:
                pieces.append(text[pos:])
                break
            pieces.append(text[pos:k].rstrip())
            found += part.calls
            if part.status == PARTIAL:
                break
            pos = part.end
        return Snapshot(self.unwrap("".join(pieces), final), _limit(found, parallel))

    def unwrap(self, content: str, final: bool) -> str:
        """The content without the family's response markers; its whitespace is kept as written,
        as llama-server keeps it."""
        for w in self.wrappers:
            content = content.replace(w, "")
        return content


class _JsonList(_Marked):
    """``START [ {call}, ... ] END``: a JSON list of call objects between markers."""

    end_marker = ""

    def item(self, s: str, i: int, final: bool, memo: Optional[_Memo]) -> _Part:
        return _keyed_call(s, i, final, memo, "name", "arguments")

    def at_marker(self, s: str, i: int, marker: str, final: bool, memo: Optional[_Memo] = None) -> _Part:
        j = _skip_ws(s, i + len(marker))
        if j >= len(s):
            return _Part(BAD if final else PARTIAL, len(s), [])
        if s[j] != "[":
            return _Part(BAD, j, [])
        return _closed_by(s, _json_list(s, j, final, memo, self.item), self.end_marker, final)


class _Granite(_JsonList):
    """Granite 3.3's ``<response>`` markers are left in the content, as llama-server leaves them:
    its parser takes Granite's content as wrapped only after a thinking, a reading it does not
    apply, so the markers come through as text."""

    name = "granite"
    markers = ("<|tool_call|>",)


class _Nemotron2(_JsonList):
    name = "nemotron-v2"
    markers = ("<TOOLCALL>",)
    end_marker = "</TOOLCALL>"


class _CommandR7B(_JsonList):
    name = "command-r7b"
    markers = ("<|START_ACTION|>",)
    end_marker = "<|END_ACTION|>"
    wrappers = ("<|START_RESPONSE|>", "<|END_RESPONSE|>")

    def item(self, s: str, i: int, final: bool, memo: Optional[_Memo]) -> _Part:
        return _keyed_call(s, i, final, memo, "tool_name", "parameters", "tool_call_id")


class _Apertus(_JsonList):
    name = "apertus"
    markers = ("<|tools_prefix|>",)
    end_marker = "<|tools_suffix|>"

    def item(self, s: str, i: int, final: bool, memo: Optional[_Memo]) -> _Part:
        return _named_object(s, i, final, memo)


class _Magistral(_Mistral):
    """The mistral family's calls, each after its own ``[TOOL_CALLS]``; its thinking in ``[THINK]``.

    Read as llama-server's Magistral parser reads them: the content is the text before the first
    ``[TOOL_CALLS]``; from there only calls of the request's tools count, each right after the one
    before, and the rest of the reply (text after the calls, or a marker that starts no such call)
    is dropped, as that parser stops there without reading to the end."""

    name = "magistral"

    def __init__(self, names: Optional[frozenset[str]] = None) -> None:
        self.names = names  # None: any name (no request to check against)

    def bind(self, tools: Optional[list[dict]], reasoning_format: str, read_calls: bool) -> "_Magistral":
        if tools is None:
            return self
        return _Magistral(frozenset(t["function"]["name"] for t in tools
                                    if isinstance(t, dict) and isinstance(t.get("function"), dict)))

    def at_marker(self, s: str, i: int, marker: str, final: bool, memo: Optional[_Memo] = None) -> _Part:
        part = super().at_marker(s, i, marker, final, memo)
        if self.names is not None and any(c.name not in self.names for c in part.calls):
            return _Part(BAD, part.end, [])
        return part

    def read(self, text: str, final: bool, parallel: bool, memo: Optional[_Memo], calls: bool = True) -> Snapshot:
        marker = self.markers[0]
        first = _find(text, marker, 0, memo) if calls else -1
        if first < 0:
            if not final and calls:
                held = _held_marker_prefix(text, self.markers)
                text = (text[:len(text) - held] if held else text).rstrip()
            return Snapshot(text, [])
        found: list[ToolCall] = []
        pos = first
        while text.startswith(marker, pos):
            part = self.at_marker(text, pos, marker, final, memo)
            if part.status == BAD:
                break
            found += part.calls
            if part.status == PARTIAL:
                break
            pos = part.end
        return Snapshot(text[:first].rstrip(), _limit(found, parallel))


_FN_NAME = re.compile(r"[^\s<>\"{}]{1,256}")


def _tagged_json(s: str, i: int, final: bool, memo: Optional[_Memo], close: str) -> _Part:
    """NAME '>' {arguments} CLOSE after ``<function=`` (Functionary v3.1)."""
    n = len(s)
    gt = s.find(">", i, i + 258)
    if gt < 0:
        if not final and n - i < 257 and (i == n or _FN_NAME.fullmatch(s, i)):
            return _Part(PARTIAL, n, [])
        return _Part(BAD, i, [])
    name = s[i:gt]
    if not _FN_NAME.fullmatch(name):
        return _Part(BAD, i, [])
    j = _skip_ws(s, gt + 1)
    if j >= n:
        return _Part(BAD if final else PARTIAL, n, [])
    if s[j] != "{":
        return _Part(BAD, j, [])
    st, end = scan_json(s, j, memo)
    if st == BAD or (st == PARTIAL and final):
        return _Part(BAD, end, [])
    if st == PARTIAL:
        return _Part(PARTIAL, n, [ToolCall(name, s[j:end], done=False)])
    return _closed_by(s, _Part(DONE, end, [ToolCall(name, s[j:end])]), close, final)


class _FunctionaryV31(_Marked):
    name = "functionary-v3.1"
    markers = ("<function=",)

    def at_marker(self, s: str, i: int, marker: str, final: bool, memo: Optional[_Memo] = None) -> _Part:
        return _tagged_json(s, i + len(marker), final, memo, "</function>")


class _FunctionaryV32(_Family):
    """Parts of the reply each start with ``>>>`` and a recipient line: ``all`` for text to the
    user, else the name of the tool whose JSON arguments follow. The generation prompt ends with
    the first ``>>>``, so the reply begins with a recipient."""

    name = "functionary-v3.2"
    markers = (">>>",)

    def read(self, text: str, final: bool, parallel: bool, memo: Optional[_Memo], calls: bool = True) -> Snapshot:
        if text.startswith(">>>"):
            s, off = text, 0
        elif not final and ">>>".startswith(text):
            return Snapshot("", [])
        else:
            # read as if the prompt's ">>>" were in the reply; a memo stays valid, since every
            # reading of one stream is shifted alike
            s, off = ">>>" + text, 3

        def raw(a: int) -> str:
            return s[max(a, off):]
        pieces: list[str] = []
        found: list[ToolCall] = []
        pos, n = 0, len(s)
        while pos < n:  # s[pos:] starts with ">>>"
            head = pos + 3
            nl = s.find("\n", head)
            if nl < 0:
                if final or n - head >= 257:
                    pieces.append(raw(pos))
                break  # else the recipient is still being written
            recipient = s[head:nl].strip()
            if recipient == "all":
                nxt = _find(s, ">>>", nl + 1, memo) if calls else -1
                if nxt < 0:
                    tail = s[nl + 1:]
                    if not final:
                        held = _held_marker_prefix(tail, (">>>",)) if calls else 0
                        tail = tail[:len(tail) - held].rstrip()
                    pieces.append(tail)
                    break
                pieces.append(s[nl + 1:nxt].rstrip())
                pos = nxt
                continue
            j = _skip_ws(s, nl + 1)
            if not calls or not _FN_NAME.fullmatch(recipient) or (j < n and s[j] != "{"):
                pieces.append(raw(pos))
                break
            if j >= n:
                if final:
                    pieces.append(raw(pos))
                break
            st, end = scan_json(s, j, memo)
            if st == BAD or (st == PARTIAL and final):
                pieces.append(raw(pos))
                break
            found.append(ToolCall(recipient, s[j:end], done=st == DONE))
            if st == PARTIAL:
                break
            k = _skip_ws(s, end)
            if k >= n:
                break
            if s.startswith(">>>", k):
                pos = k
                continue
            if not final and ">>>".startswith(s[k:]):
                break
            pieces.append(s[k:])  # text after a call that no recipient line opens: content
            break
        return Snapshot("".join(pieces), _limit(found, parallel))


# Seed-OSS: XML-like calls
SEED_OPEN, SEED_CLOSE = "<seed:tool_call>", "</seed:tool_call>"
_PARAM_OPEN = re.compile(r"<parameter=([^>\s]{1,256})>")


def _param_value(raw: str, is_str: Optional[bool] = None) -> str:
    """A parameter's text as JSON: a string for a parameter whose schema takes one (all of its
    text: the format puts no whitespace around a value), else a JSON value as itself and anything
    else as a string (is_str None: no schema to go by)."""
    if is_str:
        return json.dumps(raw, ensure_ascii=False)
    v = raw.strip()
    try:
        return json.dumps(_loads(v), ensure_ascii=False)
    except ValueError:
        return json.dumps(v, ensure_ascii=False)


class _SeedOss(_Marked):
    name = "seed-oss"
    markers = (SEED_OPEN,)

    def __init__(self, tools: Optional[list[dict]] = None) -> None:
        # which parameters take strings, per listed function: their text is the string, even one
        # that reads as a number, as llama-server types values by the tool's schema
        self.strings: Optional[dict[str, dict[str, bool]]] = None
        if tools is not None:
            from .tool_formats.tagged import schema_is_string  # noqa: PLC0415 (it builds on tool_calls)
            self.strings = {}
            for t in tools:
                params = _params(t)
                props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
                defs = params.get("$defs") or params.get("definitions") or {}
                self.strings[t["function"]["name"]] = {
                    k: schema_is_string(v, defs if isinstance(defs, dict) else {}) for k, v in props.items()}

    def bind(self, tools: Optional[list[dict]], reasoning_format: str, read_calls: bool) -> _Family:
        return type(self)(tools)

    def at_marker(self, s: str, i: int, marker: str, final: bool, memo: Optional[_Memo] = None) -> _Part:
        n = len(s)
        k = i + len(marker)
        calls: list[ToolCall] = []
        while True:
            k = _skip_ws(s, k)
            if k >= n:
                if final:
                    return _Part(DONE, n, calls) if calls else _Part(BAD, k, [])
                return _Part(PARTIAL, n, [_unfinished(c) for c in calls])
            if s.startswith(SEED_CLOSE, k):
                return _Part(DONE, k + len(SEED_CLOSE), calls) if calls else _Part(BAD, k, [])
            if not final and (_literal(s, k, "<function=") == PARTIAL or _literal(s, k, SEED_CLOSE) == PARTIAL):
                return _Part(PARTIAL, n, [_unfinished(c) for c in calls])
            if not s.startswith("<function=", k):
                # the block's end missing: what follows its calls is content again
                return _Part(DONE, k, calls) if calls else _Part(BAD, k, [])
            part = self._function(s, k + len("<function="), final)
            if part.status == BAD:
                return _Part(BAD, part.end, [])
            if part.status == PARTIAL:
                return _Part(PARTIAL, n, calls + part.calls)
            calls += part.calls
            k = part.end

    def _function(self, s: str, i: int, final: bool) -> _Part:
        n = len(s)
        gt = s.find(">", i, i + 258)
        if gt < 0:
            return _Part(PARTIAL if not final and n - i < 257 else BAD, n, [])
        name = s[i:gt]
        if not _FN_NAME.fullmatch(name):
            return _Part(BAD, i, [])
        args: list[str] = []
        strings = (self.strings or {}).get(name, {})
        k = gt + 1
        while True:
            k = _skip_ws(s, k)
            so_far = "{" + ", ".join(args)
            rest = s[k:k + 300]
            if k >= n:
                return _Part(BAD, n, []) if final else _Part(PARTIAL, n, [ToolCall(name, so_far, done=False)])
            if s.startswith("</function>", k):
                return _Part(DONE, k + len("</function>"), [ToolCall(name, so_far + "}")])
            m = _PARAM_OPEN.match(s, k)
            if m is None:
                if not final and len(rest) < 300 and ("</function>".startswith(rest) or "<parameter=".startswith(rest)
                                                      or rest.startswith("<parameter=") and ">" not in rest):
                    return _Part(PARTIAL, n, [ToolCall(name, so_far, done=False)])
                return _Part(BAD, k, [])
            end = s.find("</parameter>", m.end())
            if end < 0:
                return _Part(BAD, n, []) if final else _Part(PARTIAL, n, [ToolCall(name, so_far, done=False)])
            args.append(json.dumps(m.group(1), ensure_ascii=False) + ": "
                        + _param_value(s[m.end():end], strings.get(m.group(1))))
            k = end + len("</parameter>")


_MORE: dict[str, _Family] = {f.name: f for f in (
    _Magistral(),
    _FunctionaryV32(),
    _FunctionaryV31(),
    _CommandR7B(),
    _Granite(),
    _SeedOss(),
    _Apertus(),
    _Nemotron2(),
)}


# ---------------------------------------------------------------------------------------------
# Grammars for a required call


def call_grammar(family: str, spec: ToolSpec, special: Callable[[str], Optional[int]] = lambda t: None,
                 close_thinking: bool = False) -> str:
    """llguidance Lark grammar of a required call (or calls) in one of this module's formats;
    as tool_calls.call_grammar, which hands these families here."""
    tools = [t for t in spec.tools if not spec.named or t["function"]["name"] == spec.choice]
    names = [t["function"]["name"] for t in tools]
    lit = lambda text: _lark_literal(text, special)  # noqa: E731
    q = lambda text: json.dumps(text, ensure_ascii=False)  # noqa: E731
    many = spec.parallel
    rules: list[str] = []

    def json_rule(rule: str, schema: dict) -> None:
        schema = {"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}, **schema}
        rules.append(f"{rule}: %json {json.dumps(schema, ensure_ascii=False)}")

    def obj(props: dict) -> dict:
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}

    def per_tool_args() -> list[str]:
        for k, t in enumerate(tools):
            json_rule(f"args{k}", _params(t))
        return [f"args{k}" for k in range(len(tools))]

    def json_list(start: str, end: str, item_of: Callable[[dict, str], dict]) -> None:
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": [item_of(t, nm) for t, nm in zip(tools, names)]},
                                  "minItems": 1}
        if not many:
            schema["maxItems"] = 1
        json_rule("calls", schema)
        rules.insert(0, f"start: {lit(start)} calls" + (f" {lit(end)}" if end else ""))

    # each family's rules, the start rule first
    if family == "nemotron-v2":
        json_list("<TOOLCALL>", "</TOOLCALL>", lambda t, nm: obj({"name": {"const": nm}, "arguments": _params(t)}))
    if family == "granite":
        json_list("<|tool_call|>", "", lambda t, nm: obj({"name": {"const": nm}, "arguments": _params(t)}))
    if family == "command-r7b":
        json_list("<|START_ACTION|>", "<|END_ACTION|>",
                  lambda t, nm: obj({"tool_call_id": {"type": "string", "pattern": "^[0-9]{1,4}$"},
                                     "tool_name": {"const": nm}, "parameters": _params(t)}))
    if family == "apertus":
        json_list("<|tools_prefix|>", "<|tools_suffix|>", lambda t, nm: obj({nm: _params(t)}))
    if family == "magistral":
        args = per_tool_args()
        alts = " | ".join(f'{q(nm)} {lit("[ARGS]")} {a}' for nm, a in zip(names, args))
        rules[:0] = [f'start: call{"+" if many else ""}', f'call: {lit("[TOOL_CALLS]")} ({alts})']
    if family == "functionary-v3.1":
        args = per_tool_args()
        alts = " | ".join(f'{lit("<function=")} {q(nm + ">")} {a} {lit("</function>")}' for nm, a in zip(names, args))
        rules[:0] = ['start: call ("\\n"? call)*' if many else "start: call", f"call: {alts}"]
    if family == "functionary-v3.2":
        # the generation prompt ends with ">>>": the first recipient comes at once
        args = per_tool_args()
        alts = " | ".join(f'{q(nm + chr(10))} {a}' for nm, a in zip(names, args))
        rules[:0] = [f'start: call ("\\n"? {q(">>>")} call)*' if many else "start: call", f"call: {alts}"]
    if family == "seed-oss":
        from .tool_formats.tagged import _string_value, schema_is_string  # noqa: PLC0415
        alts = []
        for k, (t, nm) in enumerate(zip(tools, names)):
            params = _params(t)
            props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
            required = set(params.get("required") or [])
            defs = params.get("$defs") or params.get("definitions") or {}
            parts = []
            for p, (pname, pschema) in enumerate(props.items()):
                pschema = pschema if isinstance(pschema, dict) else {}
                # a value the reader takes as text is written bare, up to its closing tag
                if schema_is_string(pschema, defs if isinstance(defs, dict) else {}):
                    rules.append(f"v{k}_{p}: {_string_value(pschema, '</parameter>')}")
                    value = f"v{k}_{p}"
                else:
                    json_rule(f"v{k}_{p}", pschema)
                    value = f'v{k}_{p} {q("</parameter>")}'
                item = f'{q("<parameter=" + pname + ">")} {value} "\\n"'
                parts.append(item if pname in required else f"({item})?")
            alts.append(" ".join([q("<function=" + nm + ">"), '"\\n"', *parts, q("</function>")]))
        rules[:0] = [f'start: {lit(SEED_OPEN)} "\\n" call ("\\n" call)* "\\n" {lit(SEED_CLOSE)}' if many else
                     f'start: {lit(SEED_OPEN)} "\\n" call "\\n" {lit(SEED_CLOSE)}', "call: " + " | ".join(alts)]
    if not rules:
        raise ValueError(f"unknown tool-call family {family!r}")
    if close_thinking:
        end_tag = REASONING_TAGS.get(family, ("<think>", "</think>"))[1]
        rules[0] = rules[0].replace("start:", "tool_calls:", 1)
        rules.insert(0, f'start: {lit(end_tag)} "\\n\\n" tool_calls')
    return "\n".join(rules) + "\n"


# imported before tool_calls, this module was only partly loaded when tool_calls looked for it
from . import tool_calls as _tool_calls  # noqa: E402

_tool_calls.join_more_families()
