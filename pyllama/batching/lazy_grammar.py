"""Lazy grammars: output runs free until a trigger appears, then follows the grammar from there.

llama-server's `grammar_lazy` with `grammar_triggers` (and its tool calls under `tool_choice: auto`):
a trigger is a token id, a word, a regular expression searched in the text generated so far, or one
that must match the whole of it. Where a pattern has a capturing group that matched, the grammar
starts at the first such group, else at the match. The text from there on is fed to the grammar's
matcher (as the model's tokens would have been) and every later token is constrained.

The text searched is the generation's own rendering with control tokens spelled out (as llama.cpp's
trigger buffer holds them), independent of what the response shows.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ..tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["TRIGGER_KINDS", "Trigger", "LazyStart"]

# llama.cpp's common_grammar_trigger_type values, in order
TRIGGER_KINDS = ("token", "word", "pattern", "pattern_full")


@dataclass(frozen=True)
class Trigger:
    kind: str           # one of TRIGGER_KINDS
    value: str          # the word, the pattern, or the token's text
    token: int = -1     # kind "token": its id

    def regex(self) -> Optional[tuple["re.Pattern[str]", bool]]:
        """(the pattern that finds this trigger in text, whether it must match the whole text);
        None for a token trigger. As llama.cpp: a pattern_full is anchored at both ends, and any
        pattern so anchored must match the whole text; otherwise it is searched for."""
        if self.kind == "token":
            return None
        if self.kind == "word":
            return re.compile(re.escape(self.value)), False
        pattern = self.value
        if self.kind == "pattern_full":
            pattern = ("" if pattern.startswith("^") else "^") + pattern + ("" if pattern.endswith("$") else "$")
        if len(pattern) >= 2 and pattern.startswith("^") and pattern.endswith("$"):
            return re.compile(pattern[1:-1]), True
        return re.compile(pattern), False


def _start_of(match: "re.Match[str]") -> int:
    for i in range(1, (match.re.groups or 0) + 1):
        if match.start(i) >= 0 and match.end(i) > match.start(i):
            return match.start(i)
    return match.start()


class LazyStart:
    """Watches a sequence's tokens for its triggers; `feed` returns the tokens the grammar must take
    once one has fired (the text from the trigger on, the trigger included), else None."""

    def __init__(self, tokenizer: Tokenizer, triggers: tuple[Trigger, ...]) -> None:
        self.tokenizer = tokenizer
        self.tokens = frozenset(t.token for t in triggers if t.kind == "token")
        self.patterns = [r for r in (t.regex() for t in triggers) if r is not None]  # (regex, whole text)
        self.detok = IncrementalDetokenizer(tokenizer, special=True)
        self.text = ""

    def feed(self, token: int) -> Optional[list[int]]:
        if token in self.tokens:
            return [token]
        self.text += self.detok.feed(token)
        found = ((p.fullmatch(self.text) if whole else p.search(self.text)) for p, whole in self.patterns)
        starts = [_start_of(m) for m in found if m is not None]
        if not starts:
            return None
        return self.tokenizer.encode(self.text[min(starts):], add_special=False, parse_special=True)
