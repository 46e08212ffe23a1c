"""The thinking of a reply as it is generated: which text is inside ``<think>``...``</think>``
(`ReasoningStream`, which the API layer also uses to split a reply into reasoning and content) and
the budget that ends a thinking after so many tokens (`ThinkingBudget`, applied to each sampled
token). The formats and the reply-level helpers are in `pyllama.server.reasoning`."""
from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"


def _partial_suffix(s: str, tag: str) -> int:
    """How many characters at the end of s are the start of tag."""
    for k in range(min(len(tag) - 1, len(s)), 0, -1):
        if s.endswith(tag[:k]):
            return k
    return 0


class ReasoningStream:
    """Splits a reply, piece by piece, into (reasoning, content) increments.

    :meth:`feed` returns the (reasoning, content) text that can be told apart so far, holding
    back what may be the start of a tag and trailing whitespace of the reasoning; :meth:`finish`
    returns the rest. :attr:`reasoning` and :attr:`content` accumulate what was returned.

    also_ends: markers that end the thinking without closing it, and stay in the content (a
    tool call some models start straight from their thinking, as llama-server reads them);
    start / end: the family's own thinking tags (``[THINK]``, ``<seed:think>``, ...)."""

    def __init__(self, fmt: str = "deepseek", forced_open: bool = False, also_ends: tuple[str, ...] = (),
                 start: str = THINK_START, end: str = THINK_END) -> None:
        self.fmt = fmt
        self._start, self._end = start, end
        self._ends = (end,) + tuple(also_ends)
        self.active = fmt != "none"
        self.legacy = fmt == "deepseek-legacy"
        self._state = "think" if forced_open and self.active else ("start" if self.active else "content")
        self._buf = ""
        self._after_end = False  # just past </think>: leading whitespace of the content is dropped
        self._reasoning_started = False
        self.reasoning = ""
        self.content = ""

    def feed(self, piece: str) -> tuple[str, str]:
        return self._step(piece, final=False)

    def finish(self) -> tuple[str, str]:
        return self._step("", final=True)

    def _step(self, piece: str, final: bool) -> tuple[str, str]:
        r_out, c_out = [], []
        if self.legacy and piece:
            c_out.append(piece)
        self._buf += piece
        while True:
            if self._state == "start":
                lead = self._buf.lstrip()
                if lead.startswith(self._start):
                    self._buf = lead[len(self._start):]
                    self._state = "think"
                    continue
                if not final and self._start.startswith(lead):
                    break  # maybe a tag still being written
                self._state = "content"
                continue
            if self._state == "think":
                if not self._reasoning_started:
                    self._buf = self._buf.lstrip()
                    if not self._buf:
                        break
                    self._reasoning_started = True
                end, tag = self._end_tag()
                if end >= 0:
                    r_out.append(self._buf[:end].rstrip())
                    # the end tag is dropped; another marker that ends the thinking is content
                    self._buf = self._buf[end + len(self._end):] if tag == self._end else self._buf[end:]
                    self._state = "content"
                    self._after_end = True
                    continue
                if final:
                    r_out.append(self._buf.rstrip())
                    self._buf = ""
                    break
                keep = max(_partial_suffix(self._buf, t) for t in self._ends)
                text = self._buf[:len(self._buf) - keep]
                emit = text.rstrip()  # trailing whitespace waits: it may come right before the end tag
                r_out.append(emit)
                self._buf = self._buf[len(emit):]
                break
            # content
            if self._after_end:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._after_end = False
            if not self.legacy:
                c_out.append(self._buf)
            self._buf = ""
            break
        r, c = "".join(r_out), "".join(c_out)
        if not self.active:
            r = ""
        self.reasoning += r
        self.content += c
        return r, c

    def _end_tag(self) -> tuple[int, str]:
        """(where, which) of the first tag in the buffer that ends the thinking; (-1, "") if none."""
        found = [(k, t) for k, t in ((self._buf.find(t), t) for t in self._ends) if k >= 0]
        return min(found) if found else (-1, "")

    @property
    def thinking(self) -> bool:
        """Whether the reply is (still) inside its thinking."""
        return self._state == "think"


class ThinkingBudget:
    """A reply's thinking held to `budget` tokens (llama-server's --reasoning-budget).

    The slot offers each sampled token to :meth:`replace` and then the text it became to
    :meth:`observe`. Once the reply has spent `budget` tokens inside its thinking (opened by the
    prompt, or by the reply's own ``<think>``), the tokens of `end` (budget_end_text, tokenized)
    take the place of the sampled ones, one per step, and the reply goes on after them."""

    def __init__(self, budget: int, end: list[int], forced_open: bool) -> None:
        self.budget = budget
        self.spent = 0
        self._end = list(end)
        self._queue: list[int] = []
        self._forced = False
        self._reader = ReasoningStream("deepseek", forced_open)

    def replace(self, sampled: int) -> int:
        if not self._forced and self._reader.thinking and self.spent >= self.budget and self._end:
            self._forced = True
            self._queue = list(self._end)
        return self._queue.pop(0) if self._queue else sampled

    def observe(self, piece: str) -> None:
        thinking = self._reader.thinking
        self._reader.feed(piece)
        if thinking:
            self.spent += 1

    @property
    def forcing(self) -> bool:
        """Whether the end's tokens are still being put in."""
        return bool(self._queue)
