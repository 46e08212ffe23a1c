"""gpt-oss's harmony replies. The reply is a sequence of messages, each a header, ``<|message|>``
and a body ended by ``<|end|>`` (the next message starts with ``<|start|>assistant``), ``<|call|>``
or ``<|return|>``; the header names the channel and maybe a recipient, before the channel (after
the role) or after it::

    <|channel|>analysis<|message|>thinking<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}

The reply itself starts inside the first header (the prompt ended with ``<|start|>assistant``).
As llama-server reads it: ``analysis`` is the reasoning (with reasoning_format ``none`` it stays
in the content, markers and all), ``commentary`` addressed ``to=functions.NAME`` is a call,
other ``commentary`` (a preamble) and ``final`` are the content, and a message addressed to
anything else (a built-in tool such as ``browser.search``) is dropped. Text that is not harmony is
content.
"""
from __future__ import annotations

import json
import re
from typing import Callable, Optional

from ..tool_calls import BAD, DONE, Snapshot, ToolCall, _Family, _find, _held_marker_prefix, _Memo, _params, \
    _skip_ws, scan_json

__all__ = ["Harmony"]

# harmony's markers
H_START, H_CHANNEL, H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
H_END, H_CALL, H_RETURN, H_CONSTRAIN = "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"
_H_ENDS = (H_END, H_CALL, H_RETURN)

_H_RECIPIENT = re.compile(r"\s*to=(\S+?)(?=\s|<\||$)")


class Harmony(_Family):
    name = "harmony"
    reads_reasoning = True

    def __init__(self, tools: Optional[list[dict]] = None, reasoning_format: str = "auto",
                 read_calls: bool = True) -> None:
        self.names = None if tools is None else {t["function"]["name"] for t in tools}
        self.keep_analysis = reasoning_format == "none"
        self.read_calls = read_calls

    def bind(self, tools: Optional[list[dict]], reasoning_format: str, read_calls: bool) -> _Family:
        return Harmony(tools, reasoning_format, read_calls)

    def parse_reply(self, s: str, final: bool, parallel: bool, memo: Optional[_Memo]) -> Snapshot:
        n = len(s)
        content: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while pos < n:
            head_end = _find(s, H_MESSAGE, pos, memo)
            if head_end < 0:
                rest = s[pos:]
                if final or len(rest) > 256 or any(m in rest for m in _H_ENDS):
                    content.append(rest)  # not a harmony message: the rest is text
                break
            chan = self._channel(s[pos:head_end])
            if chan is None:
                content.append(s[pos:])
                break
            channel, recipient = chan
            b = head_end + len(H_MESSAGE)
            ends = [(_find(s, m, b, memo), m) for m in _H_ENDS]  # resumed where the last reading stopped
            ends = [(k, m) for k, m in ends if k >= 0]
            k, marker = min(ends) if ends else (-1, "")
            open_ = k < 0
            body = s[b:] if open_ else s[b:k]
            if open_ and not final:
                held = _held_marker_prefix(body, _H_ENDS)
                body = body[:len(body) - held] if held else body
            if recipient is not None:
                if recipient.startswith("functions.") and self.read_calls:
                    call = self._call(s, recipient[len("functions."):], b, n if open_ else k, final or not open_,
                                      memo)
                    if call is None:
                        content.append(s[pos:])
                        break
                    calls.append(call)
                # a message to anything else (a built-in tool) is dropped, as llama-server drops it
            elif channel == "analysis":
                if self.keep_analysis:  # from the channel on: the role before it is the turn's start
                    content.append(s[pos + s[pos:head_end].find(H_CHANNEL):b] + body + marker)
                else:
                    reasoning.append(body)
            else:  # final, or commentary to no one (a preamble)
                content.append(body)
            if open_:
                break
            pos = k + len(marker)
            j = _skip_ws(s, pos)
            if j >= n:
                break
            if s.startswith(H_START, j):  # the next message; its header names the role first
                pos = j + len(H_START)
                continue
            if not final and H_START.startswith(s[j:]):
                break
            content.append(s[pos:])
            break
        return Snapshot("".join(content), calls if parallel else calls[:1], "".join(reasoning))

    def _call(self, s: str, name: str, b: int, e: int, closed: bool, memo: Optional[_Memo]) -> Optional[ToolCall]:
        """The call whose arguments are s[b:e] (closed: nothing more comes), None if it is not one."""
        if self.names is not None and name not in self.names:
            return None
        j = _skip_ws(s, b)
        if j >= e:
            return None if closed else ToolCall(name, "", done=False)
        st, end = scan_json(s[:e], j, None if e < len(s) else memo)
        if st == BAD or (closed and (st != DONE or _skip_ws(s, end) < e)):
            return None
        return ToolCall(name, s[j:end], done=st == DONE and closed)

    @staticmethod
    def _channel(header: str) -> Optional[tuple[str, Optional[str]]]:
        """(channel, recipient or None) of a message header, None when it is not one."""
        c = header.find(H_CHANNEL)
        if c < 0:
            return None
        role_part, rest = header[:c], header[c + len(H_CHANNEL):]
        m = re.match(r"(analysis|commentary|final)\b", rest)
        if m is None:
            return None
        recipient = None
        for part in (role_part, rest[m.end():]):
            r = _H_RECIPIENT.search(part)
            if r is not None:
                recipient = r.group(1)
        return m.group(1), recipient

    def grammar_rules(self, tools: list[dict], many: bool, lit: Callable[[str], str],
                      json_rule: Callable[[str, dict], None]) -> list[str]:
        """The head Lark rules of a required call: one call on the commentary channel (gpt-oss
        ends a call with <|call|>, which ends the turn, so there is one per reply)."""
        alts = []
        for k, t in enumerate(tools):
            json_rule(f"args{k}", _params(t))
            to = json.dumps("commentary to=functions." + t["function"]["name"] + " ", ensure_ascii=False)
            alts.append(f'{lit(H_CHANNEL)} {to} {lit(H_CONSTRAIN)} "json" {lit(H_MESSAGE)} args{k}')
        return ["start: " + " | ".join(alts)]
