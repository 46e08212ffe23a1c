"""Kimi K2's tool calls: a section of calls, each ``functions.NAME:IDX`` (the call's id, kept as
the model wrote it) then its JSON arguments::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}
    <|tool_call_end|>...<|tool_calls_section_end|>

As llama-server reads them, the section markers and a call's end marker may be missing, and a call
to a function the request did not list is not a call.
"""
from __future__ import annotations

import json
import re
from typing import Callable, Optional

from ..tool_calls import (BAD, DONE, PARTIAL, ToolCall, _Family, _literal, _Memo, _params, _Part, _skip_ws,
                          call_section, scan_json)

__all__ = ["KimiK2", "KIMI_ARGS_BEGIN", "KIMI_CALL_BEGIN", "KIMI_CALL_END", "KIMI_SECTION_BEGIN",
           "KIMI_SECTION_END"]

# Kimi K2's markers (special tokens in its vocabulary)
KIMI_SECTION_BEGIN = "<|tool_calls_section_begin|>"
KIMI_SECTION_END = "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN = "<|tool_call_begin|>"
KIMI_ARGS_BEGIN = "<|tool_call_argument_begin|>"
KIMI_CALL_END = "<|tool_call_end|>"

_KIMI_ID = re.compile(r"functions\.([^\s:<]+):([0-9]+)")


class KimiK2(_Family):
    name = "kimi_k2"
    markers = (KIMI_SECTION_BEGIN, KIMI_CALL_BEGIN)
    thinking_ends = markers  # Kimi K2 Thinking may call straight from its thinking

    def __init__(self, tools: Optional[list[dict]] = None) -> None:
        self.names = None if tools is None else {t["function"]["name"] for t in tools}

    def bind(self, tools: Optional[list[dict]], reasoning_format: str, read_calls: bool) -> _Family:
        return KimiK2(tools)

    def at_marker(self, s: str, i: int, marker: str, final: bool, memo: Optional[_Memo] = None) -> _Part:
        return call_section(s, i, marker, final, memo, KIMI_SECTION_BEGIN, KIMI_SECTION_END, KIMI_CALL_BEGIN,
                            self._call)

    def _call(self, s: str, k: int, final: bool, memo: Optional[_Memo]) -> _Part:
        n = len(s)
        k = _skip_ws(s, k)
        a = s.find(KIMI_ARGS_BEGIN, k)
        if a < 0:
            if not final and n - k < 256 and re.fullmatch(r"[^<]*(?:<[^>]*)?", s[k:]):
                return _Part(PARTIAL, n, [])
            return _Part(BAD, k, [])
        m = _KIMI_ID.fullmatch(s, k, a) or _KIMI_ID.fullmatch(s[k:a].strip())
        if m is None:
            return _Part(BAD, k, [])
        name, call_id = m.group(1), f"functions.{m.group(1)}:{m.group(2)}"
        if self.names is not None and name not in self.names:
            return _Part(BAD, k, [])
        j = _skip_ws(s, a + len(KIMI_ARGS_BEGIN))
        if j >= n:
            return _Part(BAD if final else PARTIAL, n, [])
        if s[j] != "{":
            return _Part(BAD, j, [])
        st, end = scan_json(s, j, memo)
        if st == BAD or (st == PARTIAL and final):
            return _Part(BAD, end, [])
        call = ToolCall(name, s[j:end], call_id, done=False)
        if st == PARTIAL:
            return _Part(PARTIAL, n, [call])
        e = _skip_ws(s, end)
        lit = _literal(s, e, KIMI_CALL_END)
        if lit == DONE:
            return _Part(DONE, e + len(KIMI_CALL_END), [ToolCall(name, call.arguments, call_id)])
        if lit == PARTIAL and not final and e < n:
            return _Part(PARTIAL, n, [call])
        # the end marker is optional (llama-server's reading)
        return _Part(DONE, end, [ToolCall(name, call.arguments, call_id)])

    def grammar_rules(self, tools: list[dict], many: bool, lit: Callable[[str], str],
                      json_rule: Callable[[str, dict], None]) -> list[str]:
        """The head Lark rules of a required call (or several, numbered by the model)."""
        alts = []
        for k, t in enumerate(tools):
            json_rule(f"args{k}", _params(t))
            prefix = json.dumps("functions." + t["function"]["name"] + ":", ensure_ascii=False)
            alts.append(f"{lit(KIMI_CALL_BEGIN)} {prefix} /[0-9]/ {lit(KIMI_ARGS_BEGIN)} args{k} {lit(KIMI_CALL_END)}")
        return [f'start: {lit(KIMI_SECTION_BEGIN)} call{"+" if many else ""} {lit(KIMI_SECTION_END)}',
                "call: " + " | ".join(alts)]
