"""Tool calls on /v1/chat/completions: request checks, the call format of a template family, and
the parser that turns a model's text into OpenAI ``tool_calls`` (whole or streamed).

A chat template tells which format its model was trained to call tools in; it is recognised by
the literal markers its Jinja source holds, in the order llama-server tests them:

======== ================================================ =========================================
family   recognised by (in the template source)            what the model writes
======== ================================================ =========================================
deepseek ``<｜tool▁calls▁begin｜>``                         ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>``
                                                           ``function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```...``
                                                           (R1) or ``NAME<｜tool▁sep｜>ARGS`` (V3.1)
hermes   ``<tool_call>`` (Hermes 2/3, Qwen 2.5/3, ...)     ``<tool_call>\\n{"name": N, "arguments": A}</tool_call>``
                                                           (the newline after ``<tool_call>`` is required)
mistral  ``[TOOL_CALLS]``                                  ``[TOOL_CALLS][{"name": N, "arguments": A, "id": I}]``
                                                           or ``[TOOL_CALLS]NAME[ARGS]ARGS``
llama3   ``<|start_header_id|>ipython<|end_header_id|>``   ``{"name": N, "parameters": A}`` at the start of
                                                           the reply, or after text when the calls end
                                                           the reply (``<|python_tag|>`` is text)
generic  anything else                                     one JSON object: ``{"tool_calls": [...]}``,
                                                           ``{"tool_call": {...}}`` or ``{"response": text}``
======== ================================================ =========================================

More formats are in :mod:`.tool_formats` and tool_formats_more.py; their templates are recognised
before all of the above, as llama-server tries its dedicated parsers first (and GLM 4.5's templates
hold ``<tool_call>`` too).

Parsing is done on the whole text so far (:func:`parse`), in a partial mode while tokens still
come: text that may be the start of a call is held back, a call is announced once its name is
known and its arguments have begun, and the arguments then grow as the model writes them.
:class:`ToolCallStream` turns successive snapshots into OpenAI deltas; the final snapshot is the
non-streamed message. Output that is not a well-formed call is left in the content.

The ``arguments`` of a call are the JSON text the model wrote for them (so the streamed fragments
add up to exactly the final string); a model that writes them as a JSON string gets that string.
"""
from __future__ import annotations

import json
import re
import secrets
import string
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..batching.constraint import JSON_WHITESPACE

__all__ = ["CALL_TRIGGERS", "FAMILIES", "ToolCall", "Snapshot", "ToolSpec", "ToolCallStream", "ToolChoiceError",
           "detect_family", "call_grammar", "parse", "parse_tool_request", "new_call_id", "reads_reasoning",
           "thinking_ends"]

FAMILIES = ("hermes", "llama3", "mistral", "deepseek", "generic", "harmony", "kimi_k2", "qwen3_coder", "glm45")
# ... and tool_formats_more.FAMILIES, added at the end of this module

# DeepSeek's markers (full-width bars and "▁" as in its vocabulary).
DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_CALLS_END = "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"


class ToolChoiceError(ValueError):
    """A bad ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` field (HTTP 400)."""


def detect_family(source: Optional[str]) -> str:
    """The tool-call family of a Jinja chat template's source (``generic`` when none matches)."""
    src = source or ""
    from .tool_formats import detect_new_family  # noqa: PLC0415 (it builds on this module)
    found = detect_new_family(src, "special") or _more.detect(src) or detect_new_family(src, "tagged")
    if found:
        return found
    if DS_CALLS_BEGIN in src:
        return "deepseek"
    if "<tool_call>" in src:
        return "hermes"
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "<|start_header_id|>ipython<|end_header_id|>" in src:
        return "llama3"
    return "generic"


_ALNUM = string.ascii_letters + string.digits


def new_call_id(family: str) -> str:
    """A fresh call id: 9 letters and digits for Mistral (its templates refuse any other shape),
    ``call_`` and 24 letters and digits otherwise."""
    if family in ("mistral", "magistral"):
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


# ---------------------------------------------------------------------------------------------
# Request fields


@dataclass
class ToolSpec:
    """What a chat request asks about tools: ``choice`` is "auto", "none", "required" or the name
    of the one function to call."""

    tools: list[dict] = field(default_factory=list)
    choice: str = "auto"
    named: bool = False
    parallel: bool = True

    @property
    def parse_calls(self) -> bool:
        """Whether the model's output is read for calls (tools given and not tool_choice none)."""
        return bool(self.tools) and self.choice != "none"

    @property
    def required(self) -> bool:
        return bool(self.tools) and (self.choice == "required" or self.named)

    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]


def parse_tool_request(body: dict) -> ToolSpec:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body, checked as OpenAI
    defines them. Raises :class:`ToolChoiceError` naming the field."""
    tools = body.get("tools")
    spec = ToolSpec()
    if tools is not None:
        if not isinstance(tools, list):
            raise ToolChoiceError("'tools' must be an array of tools")
        for i, t in enumerate(tools):
            at = f"tools[{i}]"
            if not isinstance(t, dict):
                raise ToolChoiceError(f"'{at}' must be an object")
            if t.get("type", "function") != "function":
                raise ToolChoiceError(f"'{at}.type' must be \"function\" (the only tool type supported)")
            fn = t.get("function")
            if not isinstance(fn, dict):
                raise ToolChoiceError(f"'{at}.function' must be an object")
            name = fn.get("name")
            if not isinstance(name, str) or not name:
                raise ToolChoiceError(f"'{at}.function.name' must be a non-empty string")
            if "description" in fn and fn["description"] is not None and not isinstance(fn["description"], str):
                raise ToolChoiceError(f"'{at}.function.description' must be a string")
            if "parameters" in fn and fn["parameters"] is not None and not isinstance(fn["parameters"], dict):
                raise ToolChoiceError(f"'{at}.function.parameters' must be a JSON schema object")
        spec.tools = tools
    choice = body.get("tool_choice")
    if choice is None:
        spec.choice = "auto"
    elif isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ToolChoiceError(f"'tool_choice' must be \"auto\", \"none\", \"required\" or "
                                  f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}")
        spec.choice = choice
    elif isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ToolChoiceError("'tool_choice' as an object must be {\"type\": \"function\", "
                                  "\"function\": {\"name\": ...}}")
        if name not in spec.names():
            raise ToolChoiceError(f"'tool_choice' names the function {name!r}, which is not in 'tools'")
        spec.choice, spec.named = name, True
    else:
        raise ToolChoiceError("'tool_choice' must be a string or an object")
    if spec.choice == "required" and not spec.tools:
        raise ToolChoiceError("'tool_choice' is \"required\" but no 'tools' were given")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolChoiceError("'parallel_tool_calls' must be true or false")
    spec.parallel = True if parallel is None else parallel
    return spec


# ---------------------------------------------------------------------------------------------
# A JSON scanner that tells a complete value from a valid unfinished one from a wrong one.

DONE, PARTIAL, BAD = 0, 1, 2
_WS = " \t\r\n"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_PREFIX = re.compile(r"-?(?:0|[1-9][0-9]*)?(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?$")
_NUMBER_CHARS = re.compile(r"[-+0-9.eE]*")
_HEX = frozenset("0123456789abcdefABCDEF")


def _skip_ws(s: str, i: int) -> int:
    n = len(s)
    while i < n and s[i] in _WS:
        i += 1
    return i


_PLAIN = re.compile(r'[^"\\]*')


def _string_from(s: str, p: int) -> tuple[int, int, int]:
    """(status, end, resume) of a string literal's body read from p (just after its opening quote
    or a complete escape). PARTIAL: reading may resume at `resume` once more text has come."""
    n = len(s)
    while True:
        p = _PLAIN.match(s, p).end()
        if p >= n:
            return PARTIAL, n, n
        if s[p] == '"':
            return DONE, p + 1, p + 1
        if p + 1 >= n:  # a backslash at the end
            return PARTIAL, n, p
        e = s[p + 1]
        if e == "u":
            hexs = s[p + 2:p + 6]
            if not all(h in _HEX for h in hexs):
                return BAD, p, p
            if len(hexs) < 4:
                return PARTIAL, n, p
            p += 6
            continue
        if e not in '"\\/bfnrt':
            return BAD, p, p
        p += 2


def _scan_string(s: str, i: int) -> tuple[int, int]:
    """(status, end) of the string literal at s[i] == '"'."""
    st, end, _ = _string_from(s, i + 1)
    return st, end


class _Memo:
    """What the scanners learned of one growing text (a stream's reply so far), so that reading it
    again after more text came resumes where they stopped instead of starting over. Every text
    read with a memo must extend the one read before with it. Entries are keyed by where a scan
    started: a finished result (DONE or BAD stays so whatever follows), or where to resume."""

    def __init__(self) -> None:
        self.json: dict[int, tuple] = {}
        self.members: dict[int, Any] = {}
        self.find: dict[tuple[str, int], tuple[int, int]] = {}
        self.fam: Optional[_Family] = None  # the family as bound to the request
        self.formats: dict[Any, Any] = {}  # what the formats of tool_formats keep between readings


def _find(s: str, marker: str, pos: int, memo: Optional[_Memo]) -> int:
    """s.find(marker, pos), searching only the text that came since the last search."""
    if memo is None:
        return s.find(marker, pos)
    hit = memo.find.get((marker, pos))
    start = pos
    if hit is not None:
        if hit[0] >= 0:
            return hit[0]
        start = max(pos, hit[1] - len(marker) + 1)
    k = s.find(marker, start)
    memo.find[(marker, pos)] = (k, len(s))
    return k


def scan_json(s: str, i: int, memo: Optional[_Memo] = None) -> tuple[int, int]:
    """(status, end) of the JSON value starting at s[i] (whitespace before it is skipped).

    DONE: s[i:end] holds one complete value. PARTIAL: s[i:] is a valid start of a value (end is
    len(s)). BAD: it cannot be the start of any value (end is where it went wrong). A number at
    the very end of s is PARTIAL, since more digits may follow. With a memo, a value read
    before resumes where that reading stopped."""
    hit = memo.json.get(i) if memo is not None else None
    if hit is not None and len(hit) == 2:
        return hit
    at = i
    stack, state, j, str_p = ([], "value", i, None) if hit is None else (list(hit[0]), hit[1], hit[2], hit[3])
    status, end, resume = _scan(s, j, stack, state, str_p)
    if memo is not None:
        memo.json[at] = (status, end) if resume is None else resume
    return status, end


def _scan(s: str, i: int, stack: list[str], state: str, str_p: Optional[int]) -> tuple[int, int, Optional[tuple]]:
    """scan_json's reading from a state: (status, end, where to resume when PARTIAL, else None).
    str_p: inside the string literal that starts at s[i], resuming at str_p."""
    n = len(s)

    def partial(at: int, p: Optional[int] = None) -> tuple[int, int, tuple]:
        return PARTIAL, n, (tuple(stack), state, at, p)

    if str_p is not None:
        st, end, p = _string_from(s, str_p)
        if st == PARTIAL:
            return partial(i, p)
        if st == BAD:
            return BAD, end, None
        i = end
        if state == "value":
            state = "after"
            if not stack:
                return DONE, i, None
        else:
            state = "colon"
    while True:
        i = _skip_ws(s, i)
        if i >= n:
            return partial(n)
        c = s[i]
        if state == "value_or_end":
            if c == "]":
                stack.pop()
                i += 1
                state = "after"
            else:
                state = "value"
            if state == "after" and not stack:
                return DONE, i, None
            continue
        if state == "value":
            if c == "{":
                stack.append("{")
                i += 1
                state = "key_or_end"
                continue
            if c == "[":
                stack.append("[")
                i += 1
                state = "value_or_end"
                continue
            if c == '"':
                st, end, p = _string_from(s, i + 1)
                if st == PARTIAL:
                    return partial(i, p)
                if st == BAD:
                    return BAD, end, None
                i = end
            elif c == "-" or c.isdigit():
                if _NUMBER_CHARS.match(s, i).end() == n:  # runs to the end: more may follow ("1.5e" -> "1.5e-3")
                    return partial(i) if _NUMBER_PREFIX.match(s, i) else (BAD, i, None)
                m = _NUMBER.match(s, i)
                if m is None:
                    return BAD, i, None
                i = m.end()
            elif c in "tfn":
                for lit in ("true", "false", "null"):
                    if s.startswith(lit, i):
                        i += len(lit)
                        break
                    if n - i < len(lit) and lit.startswith(s[i:]):
                        return partial(i)
                else:
                    return BAD, i, None
            else:
                return BAD, i, None
            state = "after"
            if not stack:
                return DONE, i, None
            continue
        if state in ("key", "key_or_end"):
            if c == "}" and state == "key_or_end":
                stack.pop()
                i += 1
                state = "after"
                if not stack:
                    return DONE, i, None
                continue
            if c != '"':
                return BAD, i, None
            st, end, p = _string_from(s, i + 1)
            if st == PARTIAL:
                return partial(i, p)
            if st == BAD:
                return BAD, end, None
            i = end
            state = "colon"
            continue
        if state == "colon":
            if c != ":":
                return BAD, i, None
            i += 1
            state = "value"
            continue
        # after a value inside a container
        top = stack[-1]
        if c == ",":
            i += 1
            state = "key" if top == "{" else "value"
        elif (c == "}" and top == "{") or (c == "]" and top == "["):
            stack.pop()
            i += 1
            if not stack:
                return DONE, i, None
        else:
            return BAD, i, None


_DECODER = json.JSONDecoder(strict=False)  # models write raw newlines inside strings


def _loads(text: str) -> Any:
    return _DECODER.decode(text)  # json.loads(text, strict=False), without a new decoder per call


@dataclass
class _Members:
    status: int
    end: int
    done: dict[str, tuple[int, int]]     # complete members: key -> (start, end) of the value
    open_key: Optional[str] = None        # the member whose value is being written
    open_start: int = 0


def _scan_members(s: str, i: int, memo: Optional[_Memo] = None) -> _Members:
    """The members of the object at s[i] == '{', complete or not (with a memo: resumed at the
    member being written when it was read last)."""
    n = len(s)
    at = i
    hit = memo.members.get(at) if memo is not None else None
    if isinstance(hit, _Members):
        return hit
    done: dict[str, tuple[int, int]] = {}
    i += 1
    first = True
    if hit is not None:
        i, first, prior = hit
        done = dict(prior)
    while True:
        if memo is not None:
            memo.members[at] = (i, first, dict(done))  # where this member starts: resumed here
        i = _skip_ws(s, i)
        if i >= n:
            return _Members(PARTIAL, n, done)
        if first and s[i] == "}":
            return _keep(memo, at, _Members(DONE, i + 1, done))
        if s[i] != '"':
            return _keep(memo, at, _Members(BAD, i, done))
        st, k_end = _scan_string(s, i)
        if st != DONE:
            return _Members(st, k_end, done) if st == PARTIAL else _keep(memo, at, _Members(st, k_end, done))
        key = _loads(s[i:k_end])
        i = _skip_ws(s, k_end)
        if i >= n:
            return _Members(PARTIAL, n, done)
        if s[i] != ":":
            return _keep(memo, at, _Members(BAD, i, done))
        i = _skip_ws(s, i + 1)
        if i >= n:
            return _Members(PARTIAL, n, done, key, i)
        st, v_end = scan_json(s, i, memo)
        if st == BAD:
            return _keep(memo, at, _Members(BAD, v_end, done))
        if st == PARTIAL:
            return _Members(PARTIAL, n, done, key, i)
        done[key] = (i, v_end)
        i = _skip_ws(s, v_end)
        if i >= n:
            return _Members(PARTIAL, n, done)
        if s[i] == "}":
            return _keep(memo, at, _Members(DONE, i + 1, done))
        if s[i] != ",":
            return _keep(memo, at, _Members(BAD, i, done))
        i += 1
        first = False


def _keep(memo: Optional[_Memo], at: int, result: _Members) -> _Members:
    """A finished reading of the object at `at` (it stays so whatever text follows)."""
    if memo is not None:
        memo.members[at] = result
    return result


# ---------------------------------------------------------------------------------------------
# Snapshots


@dataclass
class ToolCall:
    name: str
    arguments: str        # JSON text
    id: str = ""          # the model's own id (Mistral), else assigned by the stream
    done: bool = True     # False: still being written (arguments may grow)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Snapshot:
    """Content and calls read from the text so far (final=True: from the whole reply)."""

    content: str
    calls: list[ToolCall]
    reasoning: str = ""  # read by a family whose format holds the thinking (harmony)


@dataclass
class _Part:
    status: int
    end: int
    calls: list[ToolCall]
    content: Optional[str] = None  # generic: the "response" of the object


def _args_text(s: str, span: tuple[int, int]) -> Optional[str]:
    """The arguments member as a string: an object's JSON text, or a string holding JSON."""
    raw = s[span[0]:span[1]]
    if raw.startswith("{"):
        return raw
    if raw.startswith('"'):
        value = _loads(raw)
        try:
            return value if isinstance(_loads(value), dict) else None
        except ValueError:
            return None
    return None


def _object_call(s: str, i: int, final: bool, args_keys: tuple[str, ...] = ("arguments",),
                 stream_args: bool = True, memo: Optional[_Memo] = None) -> _Part:
    """A call written as a JSON object {"name": ..., <args key>: {...}} at s[i] == '{'."""
    m = _scan_members(s, i, memo)
    if m.status == BAD:
        return _Part(BAD, m.end, [])
    name_span = m.done.get("name")
    name = _loads(s[name_span[0]:name_span[1]]) if name_span else None
    if name_span is not None and not isinstance(name, str):
        return _Part(BAD, m.end, [])
    if m.status == PARTIAL:
        if final:
            return _Part(BAD, m.end, [])
        calls = []
        if name and stream_args:
            key = next((k for k in args_keys if k in m.done), None)
            if key is not None:
                args = _args_text(s, m.done[key])
                if args is None:
                    return _Part(BAD, m.end, [])
                calls.append(ToolCall(name, args, done=False))
            elif m.open_key in args_keys and s.startswith("{", m.open_start):
                calls.append(ToolCall(name, s[m.open_start:], done=False))
        return _Part(PARTIAL, m.end, calls)
    if not name:
        return _Part(BAD, m.end, [])
    key = next((k for k in args_keys if k in m.done), None)
    args = "{}" if key is None else _args_text(s, m.done[key])
    if args is None:
        return _Part(BAD, m.end, [])
    call_id = ""
    if "id" in m.done:
        v = _loads(s[m.done["id"][0]:m.done["id"][1]])
        call_id = v if isinstance(v, str) else ""
    return _Part(DONE, m.end, [ToolCall(name, args, call_id)])


def _literal(s: str, i: int, lit: str) -> int:
    """DONE if s[i:] starts with lit, PARTIAL if s[i:] is a start of it, else BAD."""
    if s.startswith(lit, i):
        return DONE
    return PARTIAL if len(s) - i < len(lit) and lit.startswith(s[i:]) else BAD


# ---------------------------------------------------------------------------------------------
# Families


class _Family:
    """One call format: the markers that begin a call anywhere in the reply, and whether a JSON
    object at the very start of the reply may be a call."""

    name = "generic"
    markers: tuple[str, ...] = ()
    json_at_start = False
    text_after_calls = True  # False: what follows the calls is dropped (llama-server's Qwen3-Coder reading)
    reads_reasoning = False  # the format itself tells the thinking apart (no <think> tags)
    thinking_ends: tuple[str, ...] = ()  # markers of a call that also end an unclosed <think>
    # a whole-reply reader (text, final, parallel, memo) -> Snapshot, for formats that are not
    # text with calls in it
    parse_reply: Optional[Callable[..., "Snapshot"]] = None

    def bind(self, tools: Optional[list[dict]], reasoning_format: str, read_calls: bool) -> "_Family":
        """This format for one request (formats that read the tools' schemas or the reasoning)."""
        return self

    def at_marker(self, s: str, i: int, marker: str, final: bool, memo: Optional[_Memo] = None) -> _Part:
        raise NotImplementedError

    def at_start(self, s: str, i: int, final: bool, memo: Optional[_Memo] = None) -> _Part:
        raise NotImplementedError


class _Hermes(_Family):
    """``<tool_call>``, a newline, then the call object: the newline is part of the opening marker,
    as the family's templates write it and llama-server's parser, derived from them, takes it (a
    ``<tool_call>`` without it starts no call)."""

    name = "hermes"
    markers = ("<tool_call>",)

    def at_marker(self, s: str, i: int, marker: str, final: bool, memo: Optional[_Memo] = None) -> _Part:
        k = i + len(marker)
        if k >= len(s):
            return _Part(BAD if final else PARTIAL, len(s), [])
        if s[k] != "\n":
            return _Part(BAD, k, [])
        j = _skip_ws(s, k + 1)
        if j >= len(s):
            return _Part(BAD if final else PARTIAL, len(s), [])
        if s[j] != "{":
            return _Part(BAD, j, [])
        part = _object_call(s, j, final, memo=memo)
        if part.status != DONE:
            return part
        k = _skip_ws(s, part.end)
        st = _literal(s, k, "</tool_call>")
        if st == DONE:
            return _Part(DONE, k + len("</tool_call>"), part.calls)
        if k >= len(s) and final:  # the reply ended right after the object: taken as closed
            return _Part(DONE, k, part.calls)
        if st == PARTIAL:
            return _Part(PARTIAL, len(s), [_unfinished(c) for c in part.calls])
        return _Part(BAD, k, [])


def _unfinished(c: ToolCall) -> ToolCall:
    return ToolCall(c.name, c.arguments, c.id, done=False)


# where a call object may begin after text (llama-server reads the text up to it as content)
_LLAMA3_OBJECTS = ('{"name"', '{"type"')


class _Llama3(_Family):
    """Calls as llama-server reads them with the parser it derives from Llama 3's templates,
    which show a call as a bare object: ``<|python_tag|>`` is text to it (so it stays in the
    content, and what follows it is read as after any text: a built-in tool call or code is no
    call)."""

    name = "llama3"
    markers = _LLAMA3_OBJECTS
    json_at_start = True

    def _objects(self, s: str, i: int, final: bool, memo: Optional[_Memo]) -> _Part:
        """One or more call objects separated by whitespace or ';'."""
        calls: list[ToolCall] = []
        while True:
            part = _object_call(s, i, final, args_keys=("parameters", "arguments"), memo=memo)
            if part.status != DONE:
                if calls and part.status == BAD:  # what follows the calls is not one: stop there
                    return _Part(DONE, end, calls)
                return _Part(part.status, part.end, calls + part.calls)
            calls += part.calls
            end = part.end
            k = _skip_ws(s, end)
            if k < len(s) and s[k] == ";":
                k = _skip_ws(s, k + 1)
            if k >= len(s):
                if final:
                    return _Part(DONE, end, calls)
                return _Part(PARTIAL, len(s), [_unfinished(c) for c in calls])
            if s[k] != "{":
                return _Part(DONE, end, calls)
            i = k

    def at_start(self, s: str, i: int, final: bool, memo: Optional[_Memo] = None) -> _Part:
        return self._objects(s, i, final, memo)

    def at_marker(self, s: str, i: int, marker: str, final: bool, memo: Optional[_Memo] = None) -> _Part:
        # calls after text count only when they end the reply, so a call shown inside prose
        # stays prose; which it is is known at the end, and the call is announced only then
        part = self._objects(s, i, final, memo)
        if part.status == BAD or (part.status == DONE and _skip_ws(s, part.end) < len(s)):
            return _Part(BAD, part.end, [])
        if not final:
            return _Part(PARTIAL, len(s), [])
        return part


_MISTRAL_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]")
_MISTRAL_NAMED_START = re.compile(r"[A-Za-z0-9_.\-]*(?:\[[A-Z_]*\]?[A-Za-z0-9]*)*")


class _Mistral(_Family):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def at_marker(self, s: str, i: int, marker: str, final: bool, memo: Optional[_Memo] = None) -> _Part:
        j = _skip_ws(s, i + len(marker))
        n = len(s)
        if j >= n:
            return _Part(BAD if final else PARTIAL, n, [])
        if s[j] == "[":
            return self._array(s, j, final, memo)
        # NAME[ARGS]{...} or NAME[CALL_ID]ID[ARGS]{...}
        m = _MISTRAL_NAMED.match(s, j)
        if m is None:
            if not final and n - j < 256 and _MISTRAL_NAMED_START.fullmatch(s, j):
                return _Part(PARTIAL, n, [])
            return _Part(BAD, j, [])
        k = _skip_ws(s, m.end())
        if k >= n:
            return _Part(BAD if final else PARTIAL, n, [])
        if s[k] != "{":
            return _Part(BAD, k, [])
        st, end = scan_json(s, k, memo)
        if st == BAD or (st == PARTIAL and final):
            return _Part(BAD, end, [])
        call = ToolCall(m.group(1), s[k:end], m.group(2) or "", done=(st == DONE))
        return _Part(st, end, [call])

    def _array(self, s: str, j: int, final: bool, memo: Optional[_Memo]) -> _Part:
        calls: list[ToolCall] = []
        i = j + 1
        n = len(s)
        while True:
            i = _skip_ws(s, i)
            if i >= n:
                return _Part(BAD if final else PARTIAL, n, calls)
            if s[i] == "]" and not calls:
                return _Part(BAD, i, [])  # an empty list calls nothing
            if s[i] != "{":
                return _Part(BAD, i, [])
            # ids follow the arguments in this form: a call is shown only once complete
            part = _object_call(s, i, final, stream_args=False, memo=memo)
            if part.status != DONE:
                return _Part(part.status, part.end, calls)
            calls += part.calls
            i = _skip_ws(s, part.end)
            if i >= n:
                return _Part(BAD if final else PARTIAL, n, calls)
            if s[i] == "]":
                return _Part(DONE, i + 1, calls)
            if s[i] != ",":
                return _Part(BAD, i, [])
            i += 1


def call_section(s: str, i: int, marker: str, final: bool, memo: Optional[_Memo], begin: str, end: str,
                 call_begin: str, read_call: Callable[[str, int, bool, Optional[_Memo]], _Part]) -> _Part:
    """A section of calls, `begin` (call_begin ... )+ `end`, read from a marker at i that is either
    the section's `begin` or a call's own `call_begin` (models that leave the section marker out);
    read_call reads one call from just after its call_begin. Text after the calls whose section end
    is missing is content again (DeepSeek's and Kimi K2's sections)."""
    n = len(s)
    calls: list[ToolCall] = []
    k = i + len(marker) if marker == begin else i
    while True:
        k = _skip_ws(s, k)
        if k >= n:
            if final:
                return _Part(DONE if calls else BAD, k, calls)
            return _Part(PARTIAL, n, calls)
        if s.startswith(end, k):
            return _Part(DONE if calls else BAD, k + len(end), calls)
        if s.startswith(call_begin, k):
            part = read_call(s, k + len(call_begin), final, memo)
            if part.status == DONE:
                calls += part.calls
                k = part.end
                continue
            if part.status == PARTIAL:
                return _Part(PARTIAL, n, calls + part.calls)
            return _Part(BAD, part.end, [])
        if not final and n - k < max(len(end), len(call_begin)) and (
                end.startswith(s[k:]) or call_begin.startswith(s[k:])):
            return _Part(PARTIAL, n, calls)
        return _Part(DONE, k, calls) if calls else _Part(BAD, k, [])


class _DeepSeek(_Family):
    name = "deepseek"
    markers = (DS_CALLS_BEGIN, DS_CALL_BEGIN)

    def at_marker(self, s: str, i: int, marker: str, final: bool, memo: Optional[_Memo] = None) -> _Part:
        return call_section(s, i, marker, final, memo, DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, self._call)

    def _call(self, s: str, k: int, final: bool, memo: Optional[_Memo]) -> _Part:
        n = len(s)
        sep = s.find(DS_SEP, k)
        if sep < 0:
            if not final and n - k < 256:  # the name (or "function") is still being written
                return _Part(PARTIAL, n, [])
            return _Part(BAD, k, [])
        kind = s[k:sep].strip()
        j = sep + len(DS_SEP)
        if kind == "function":  # R1: NAME \n ```json \n ARGS \n ```
            nl = s.find("\n", j)
            if nl < 0:
                return _Part(BAD if final else PARTIAL, n, [])
            name = s[j:nl].strip()
            j = nl + 1
            st = _literal(s, j, "```json")
            if st != DONE:
                return _Part(BAD if final or st == BAD else PARTIAL, n if st == PARTIAL else j, [])
            j = _skip_ws(s, j + len("```json"))
            fence = True
        else:  # V3.1: NAME<｜tool▁sep｜>ARGS
            name = kind
            j = _skip_ws(s, j)
            fence = False
        if not name or j >= n:
            return _Part(BAD if final or not name else PARTIAL, n, [])
        if s[j] != "{":
            return _Part(BAD, j, [])
        st, end = scan_json(s, j, memo)
        if st == BAD or (st == PARTIAL and final):
            return _Part(BAD, end, [])
        call = ToolCall(name, s[j:end], done=False)
        if st == PARTIAL:
            return _Part(PARTIAL, n, [call])
        k = _skip_ws(s, end)
        if fence:
            st = _literal(s, k, "```")
            if st != DONE:
                return _Part(BAD if final or st == BAD else PARTIAL, n, [call] if st == PARTIAL else [])
            k = _skip_ws(s, k + 3)
        st = _literal(s, k, DS_CALL_END)
        if st == DONE:
            return _Part(DONE, k + len(DS_CALL_END), [ToolCall(name, call.arguments)])
        if final and k >= n:
            return _Part(DONE, k, [ToolCall(name, call.arguments)])
        if st == PARTIAL and not final:
            return _Part(PARTIAL, n, [call])
        return _Part(BAD, k, [])


class _Generic(_Family):
    name = "generic"
    json_at_start = True

    def at_start(self, s: str, i: int, final: bool, memo: Optional[_Memo] = None) -> _Part:
        st, end = scan_json(s, i, memo)
        if st == PARTIAL:
            return _Part(BAD if final else PARTIAL, end, [])
        if st == BAD or _skip_ws(s, end) < len(s):
            return _Part(BAD, end, [])
        value = _loads(s[i:end])
        if not isinstance(value, dict):
            return _Part(BAD, end, [])
        raw = value.get("tool_calls", [value["tool_call"]] if "tool_call" in value else None)
        if raw is not None:
            if not isinstance(raw, list) or not raw:
                return _Part(BAD, end, [])
            calls = []
            for c in raw:
                if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not c["name"]:
                    return _Part(BAD, end, [])
                args = c.get("arguments", {})
                if isinstance(args, str):
                    text = args
                elif isinstance(args, dict):
                    text = json.dumps(args, ensure_ascii=False)
                else:
                    return _Part(BAD, end, [])
                cid = c.get("id")
                calls.append(ToolCall(c["name"], text, cid if isinstance(cid, str) else ""))
            return _Part(DONE, end, calls)
        if "response" in value:
            r = value["response"]
            return _Part(DONE, end, [], r if isinstance(r, str) else json.dumps(r, ensure_ascii=False))
        return _Part(BAD, end, [])


_FAMILIES: dict[str, _Family] = {f.name: f for f in (_Hermes(), _Llama3(), _Mistral(), _DeepSeek(), _Generic())}


def _family(family: str) -> _Family:
    """A registered family (the formats of tool_formats join on first use: they build on this module)."""
    if family not in _FAMILIES and family in FAMILIES:
        from .tool_formats import NEW_FAMILIES  # noqa: PLC0415
        for f in NEW_FAMILIES:
            _FAMILIES.setdefault(f.name, f)
    try:
        return _FAMILIES[family]
    except KeyError:
        raise ValueError(f"unknown tool-call family {family!r}") from None


def reads_reasoning(family: Optional[str]) -> bool:
    """Whether a family's format tells the thinking apart itself (the reply has no think tags)."""
    return family is not None and _family(family).reads_reasoning


def thinking_ends(family: Optional[str]) -> tuple[str, ...]:
    """The markers of a family's calls that end a thinking left open (models that call a tool
    straight from their thinking, as llama-server reads them)."""
    return _family(family).thinking_ends if family is not None else ()


def _held_marker_prefix(s: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of s may be the start of a marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(s)), best, -1):
            if s.endswith(m[:k]):
                best = k
                break
    return best


def parse(family: str, text: str, final: bool = True, parallel: bool = True, memo: Optional[_Memo] = None,
          tools: Optional[list[dict]] = None, reasoning_format: str = "auto", read_calls: bool = True) -> Snapshot:
    """Content and tool calls of a reply in a family's format.

    final=False reads an unfinished reply: the content excludes what may still turn out to be a
    call (a partial marker, trailing whitespace, a call being written), and the last call may be
    unfinished (done False). Whitespace just before a call is not content; text after the calls
    is. Text that starts like a call but is not a well-formed one stays in the content.
    memo: the scanners' state from reading a shorter start of the same text (ToolCallStream's).
    tools: the request's tools, for the formats whose values are typed by their schemas (None:
    any function, values read as they look); reasoning_format: for harmony; read_calls=False: no
    calls are read, only the family's markers around plain text are taken out (and harmony's
    channels told apart)."""
    fam = memo.fam if memo is not None and memo.fam is not None else \
        _family(family).bind(tools, reasoning_format, read_calls)
    if memo is not None:
        memo.fam = fam
    if fam.parse_reply is not None:
        return fam.parse_reply(text, final, parallel, memo)
    own = getattr(fam, "read", None)
    if own is not None:
        return own(text, final, parallel, memo, read_calls)
    pieces: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    n = len(text)
    if fam.json_at_start:
        j = _skip_ws(text, 0)
        if j >= n:
            return Snapshot(text if final else "", [])
        if text[j] == "{":
            part = fam.at_start(text, j, final, memo)
            if part.status == PARTIAL:
                return Snapshot("", _limit(part.calls, parallel))
            if part.status == DONE:
                if part.content is not None and not part.calls:
                    return Snapshot(part.content, [])
                calls += part.calls
                pos = part.end
    while True:
        found = [(_find(text, m, pos, memo), m) for m in fam.markers]
        found = [(k, m) for k, m in found if k >= 0]
        if not found:
            tail = text[pos:] if fam.text_after_calls or not calls else ""
            if not final:
                held = _held_marker_prefix(tail, fam.markers)
                tail = tail[:len(tail) - held] if held else tail
                tail = tail.rstrip()
            pieces.append(tail)
            break
        k, marker = min(found)
        part = fam.at_marker(text, k, marker, final, memo)
        if part.status == BAD:
            pieces.append(text[pos:] if fam.text_after_calls or not calls else "")
            break
        pieces.append(text[pos:k].rstrip())
        calls += part.calls
        if part.status == PARTIAL:
            break
        pos = part.end
    content = "".join(pieces)
    return Snapshot(content, _limit(calls, parallel))


def _limit(calls: list[ToolCall], parallel: bool) -> list[ToolCall]:
    return calls if parallel else calls[:1]


# ---------------------------------------------------------------------------------------------
# Streaming


class ToolCallStream:
    """Text in, OpenAI delta pieces out, for one choice of a chat completion with tools.

    :meth:`feed` takes the next piece of the reply and returns delta dicts (``{"content": ...}``
    or ``{"tool_calls": [...]}``); :meth:`finish` returns the last ones, and :attr:`snapshot` is
    then the complete message. Each piece is read as :func:`parse` reads the whole reply so far,
    with the scanners' state kept between pieces (:class:`_Memo`): marker searches and JSON values
    being written resume where they stopped, and finished values are not read again, so the
    Python work per piece follows the piece's length, not the reply's. What still grows with the
    reply is copying at memory speed: the content and an unfinished call's arguments are sliced
    out of the reply again at each piece and compared with what was sent."""

    def __init__(self, family: str, parallel: bool = True, tools: Optional[list[dict]] = None,
                 reasoning_format: str = "auto", read_calls: bool = True) -> None:
        self.family = family
        self.parallel = parallel
        self._fam = _family(family)
        self._opts = (tools, reasoning_format, read_calls)
        self.text = ""
        self._content = ""          # content sent so far
        self._reasoning = ""        # reasoning sent so far (harmony)
        self._ids: list[str] = []   # per announced call: its id
        self._args: list[str] = []  # per announced call: the arguments sent so far
        self.snapshot = Snapshot("", [])
        self._memo = _Memo()

    def feed(self, piece: str) -> list[dict]:
        if not piece:
            return []
        # the reply's only reference is the local while it grows, so CPython appends in place
        # instead of copying the whole reply for every piece
        text, self.text = self.text, ""
        text += piece
        self.text = text
        return self._update(parse(self.family, self.text, False, self.parallel, self._memo, *self._opts))

    def finish(self) -> list[dict]:
        return self._update(parse(self.family, self.text, True, self.parallel, self._memo, *self._opts), final=True)

    def _update(self, snap: Snapshot, final: bool = False) -> list[dict]:
        out: list[dict] = []
        # A partial reading only ever holds text back, so what was sent is a prefix of what comes.
        if len(snap.reasoning) > len(self._reasoning) and snap.reasoning.startswith(self._reasoning):
            out.append({"reasoning_content": snap.reasoning[len(self._reasoning):]})
            self._reasoning = snap.reasoning
        new = snap.content[len(self._content):] if snap.content.startswith(self._content) else ""
        if new and not (final and snap.calls and not (self._content + new).strip()):
            out.append({"content": new})
            self._content += new
        for idx, call in enumerate(snap.calls):
            if idx >= len(self._ids):
                self._ids.append(call.id or new_call_id(self.family))
                self._args.append("")
                out.append({"tool_calls": [{"index": idx, "id": self._ids[idx], "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            call.id = self._ids[idx]
            sent = self._args[idx]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                out.append({"tool_calls": [{"index": idx, "function": {"arguments": call.arguments[len(sent):]}}]})
                self._args[idx] = call.arguments
        self.snapshot = snap
        return out

    def message(self) -> tuple[Optional[str], list[dict]]:
        """(content, tool_calls) of the finished reply (content None when it is only calls)."""
        snap = self.snapshot
        calls = []
        for idx, c in enumerate(snap.calls):
            if idx < len(self._ids):
                c.id = self._ids[idx]
            elif not c.id:
                c.id = new_call_id(self.family)
            calls.append(c.to_openai())
        content: Optional[str] = snap.content
        if calls and not (content or "").strip():
            content = None
        return content, calls


# ---------------------------------------------------------------------------------------------
# A grammar for a required call (tool_choice "required" or a named function)


def _lark_literal(text: str, special: Callable[[str], Optional[int]]) -> str:
    """A marker in llguidance's Lark: the special token it is in the model's vocabulary (which no
    plain text can produce), else the text itself."""
    tid = special(text)
    return f"<[{tid}]>" if tid is not None else json.dumps(text, ensure_ascii=False)


# The marker that opens a family's calls: under tool_choice "auto" the call grammar applies lazily
# from it on (llama-server's lazy grammar for these formats); families without one stay free.
CALL_TRIGGERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "deepseek": DS_CALLS_BEGIN,
                 "qwen3_coder": "<tool_call>", "glm45": "<tool_call>", "kimi_k2": "<|tool_calls_section_begin|>",
                 "magistral": "[TOOL_CALLS]", "functionary-v3.1": "<function=", "command-r7b": "<|START_ACTION|>",
                 "granite": "<|tool_call|>", "seed-oss": "<seed:tool_call>", "apertus": "<|tools_prefix|>",
                 "nemotron-v2": "<TOOLCALL>"}


def _params(tool: dict) -> dict:
    p = tool["function"].get("parameters")
    return p if isinstance(p, dict) and p else {"type": "object"}


def call_grammar(family: str, spec: ToolSpec, special: Callable[[str], Optional[int]] = lambda t: None,
                 close_thinking: bool = False) -> str:
    """llguidance Lark grammar whose every sentence is a valid call (or, with parallel calls,
    several) in the family's format, to one of the request's tools (the named one only, for a
    named tool_choice); the arguments follow each tool's JSON schema (``%json``).
    close_thinking: the prompt opened a think tag, which the reply closes first."""
    if family in _more.FAMILIES:
        return _more.call_grammar(family, spec, special, close_thinking)
    tools = [t for t in spec.tools if not spec.named or t["function"]["name"] == spec.choice]
    names = [t["function"]["name"] for t in tools]
    rules: list[str] = []
    lit = lambda text: _lark_literal(text, special)  # noqa: E731

    def json_rule(rule: str, schema: dict) -> None:
        # the same bounded whitespace as the server's JSON schemas (constraint.JSON_WHITESPACE)
        schema = {"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}, **schema}
        rules.append(f"{rule}: %json {json.dumps(schema, ensure_ascii=False)}")

    def object_calls(args_key: str, with_id: bool = False) -> list[dict]:
        out = []
        for t, name in zip(tools, names):
            props: dict[str, Any] = {"name": {"const": name}, args_key: _params(t)}
            if with_id:
                props["id"] = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}
            out.append({"type": "object", "properties": props, "required": list(props),
                        "additionalProperties": False})
        return out

    many = spec.parallel
    if family in ("harmony", "kimi_k2", "qwen3_coder", "glm45"):  # the formats of tool_formats
        from .tool_formats import grammar_rules  # noqa: PLC0415
        rules[:0] = grammar_rules(family, tools, many, lit, json_rule)
    elif family == "hermes":
        json_rule("call", {"anyOf": object_calls("arguments")})
        block = f'{lit("<tool_call>")} "\\n" call "\\n" {lit("</tool_call>")}'
        rules.insert(0, 'start: block ("\\n" block)*' if many else "start: block")
        rules.insert(1, f"block: {block}")
    elif family == "llama3":
        json_rule("call", {"anyOf": object_calls("parameters")})
        rules.insert(0, "start: call")
    elif family == "mistral":
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": object_calls("arguments", with_id=True)},
                                  "minItems": 1}
        if not many:
            schema["maxItems"] = 1
        json_rule("calls", schema)
        rules.insert(0, f'start: {lit("[TOOL_CALLS]")} calls')
    elif family == "deepseek":
        alts = []
        for k, (t, name) in enumerate(zip(tools, names)):
            json_rule(f"args{k}", _params(t))
            alts.append(f'{lit(DS_CALL_BEGIN)} "function" {lit(DS_SEP)} {json.dumps(name, ensure_ascii=False)} '
                        f'"\\n```json\\n" args{k} "\\n```" {lit(DS_CALL_END)}')
        rules.insert(0, f'start: {lit(DS_CALLS_BEGIN)} call{"+" if many else ""} {lit(DS_CALLS_END)}')
        rules.insert(1, "call: " + " | ".join(alts))
    else:
        schema = {"type": "array", "items": {"anyOf": object_calls("arguments")}, "minItems": 1}
        if not many:
            schema["maxItems"] = 1
        json_rule("start", {"type": "object", "properties": {"tool_calls": schema}, "required": ["tool_calls"],
                            "additionalProperties": False})
    if close_thinking:
        rules[0] = rules[0].replace("start:", "tool_calls:", 1)
        rules.insert(0, f'start: {lit("</think>")} "\\n\\n" tool_calls')
    return "\n".join(rules) + "\n"


def join_more_families() -> None:
    """Registers the formats of tool_formats_more.py, which builds on this module's readers: called
    here once that module is loaded, or by it when it was imported first (either order of import)."""
    global FAMILIES
    more = sys.modules[__name__.rsplit(".", 1)[0] + ".tool_formats_more"]
    _FAMILIES.update(more._MORE)
    FAMILIES += tuple(f for f in more.FAMILIES if f not in FAMILIES)


from . import tool_formats_more as _more  # noqa: E402

if hasattr(_more, "_MORE"):   # (else it is being imported first, and registers itself at its end)
    join_more_families()
