"""The thinking of a reply as it is generated: which text is inside ``<think>``...``</think>``
(`ReasoningStream`, which the API layer also uses to split a reply into reasoning and content) and
the budget that ends a thinking after so many tokens (`ThinkingBudget`, applied to each sampled
token). The formats and the reply-level helpers are in `pyllama.server.reasoning`."""
from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"


_SPACE = " \n\r\t"  # what llama-server counts as whitespace in a reasoning it drops (chat-peg-parser.cpp)


def _partial_suffix(s: str, tag: str) -> int:
    """How many characters at the end of s are the start of tag."""
    for k in range(min(len(tag) - 1, len(s)), 0, -1):
        if s.endswith(tag[:k]):
            return k
    return 0


def _edges(tag: str) -> tuple[str, str, str]:
    """(leading whitespace, core, trailing whitespace) of a tag string."""
    core = tag.strip()
    if not core:
        return "", tag, ""
    i = tag.find(core)
    return tag[:i], core, tag[i + len(core):]


class ReasoningStream:
    """Splits a reply, piece by piece, into (reasoning, content) increments, as llama-server's
    parser reads a thinking (common/chat-auto-parser-generator.cpp, analyze_reasoning::build_parser:
    ``optional(optspace(start) + reasoning(until(trim(end))) + optspace(end))``).

    The start and end strings are the template's own, whitespace included (Qwen3: ``<think>\\n`` and
    ``\\n</think>\\n\\n``): the reply's thinking opens with the start's core tag, each whitespace
    character around it in the string matched where the reply has it (optspace); the reasoning is
    the text from there up to the end's core tag, whitespace kept; after that tag only the end
    string's own trailing whitespace characters are taken out, and the content is the rest as is. A
    reasoning of whitespace only is dropped. A reply that does not open with the start tag (text or
    whitespace before it) is all content, unless `skip_space` (the reply may start with whitespace).

    :meth:`feed` returns the (reasoning, content) text that can be told apart so far, holding
    back what may be the start of a tag, a reasoning that is whitespace so far, and the end's
    trailing whitespace not yet known; :meth:`finish` returns the rest. :attr:`reasoning` and
    :attr:`content` accumulate what was returned.

    also_ends: markers that end the thinking without closing it, and stay in the content (a
    tool call some models start straight from their thinking, as llama-server reads them);
    forced_open: the prompt opened the thinking, `opener` being how (its start tag on; "": the
    core tag alone), read as the start of the reply but not returned; lstrip_reasoning /
    lstrip_content: the whitespace at the start of the reasoning / of the content after the end tag
    is taken out, as the parsers of some of llama-server's template families of their own read
    their fixed tags (``"<think>" + space() + reasoning``, ``reasoning << content``)."""

    def __init__(self, fmt: str = "deepseek", forced_open: bool = False, also_ends: tuple[str, ...] = (),
                 start: str = THINK_START, end: str = THINK_END, opener: str = "", skip_space: bool = False,
                 lstrip_reasoning: bool = False, lstrip_content: bool = False) -> None:
        self.fmt = fmt
        self._start_lead, self._start, self._start_trail = _edges(start)
        _, self._end, self._end_trail = _edges(end)
        self._ends = (self._end,) + tuple(also_ends)
        self.active = fmt != "none"
        self.legacy = fmt == "deepseek-legacy"
        self._lstrip_reasoning, self._lstrip_content = lstrip_reasoning, lstrip_content
        self._skip_space = skip_space
        self._state = "start" if self.active else "content"
        self._buf = ""
        if forced_open and self.active:
            # the prompt's own start tag (and what it wrote after it) is read as llama-server reads
            # it: its parse starts at the generation prompt, so the optional whitespace after the
            # tag may be the prompt's or the reply's
            opened = opener if opener.lstrip().startswith(self._start) else self._start
            self._buf = opened.lstrip()
            self._skip_space = True
        self._trail = ""  # the end string's trailing whitespace still to be matched
        self._pending = ""  # reasoning held back while it is whitespace only
        self._reasoning_seen = False  # a non-whitespace reasoning character was returned
        self.reasoning = ""
        self.content = ""
        if self._buf:
            self._step("", final=False)  # the opened tag is read now, so that the reply starts inside it

    def feed(self, piece: str) -> tuple[str, str]:
        return self._step(piece, final=False)

    def finish(self) -> tuple[str, str]:
        return self._step("", final=True)

    def _reason(self, text: str, out: list[str], final: bool) -> None:
        """Returns reasoning text, unless all that came so far is whitespace (dropped at the end)."""
        if self._lstrip_reasoning and not self._reasoning_seen:
            text = text.lstrip()
        if self._reasoning_seen:
            out.append(text)
            return
        self._pending += text
        if self._pending.strip(_SPACE):
            out.append(self._pending)
            self._pending, self._reasoning_seen = "", True
        elif final:
            self._pending = ""

    def _step(self, piece: str, final: bool) -> tuple[str, str]:
        r_out: list[str] = []
        c_out: list[str] = []
        if self.legacy and piece:
            c_out.append(piece)
        self._buf += piece
        while True:
            if self._state == "start":
                buf = self._buf.lstrip() if self._skip_space else self._buf
                i = 0
                for ch in self._start_lead:  # optspace: each leading whitespace character optional
                    if buf[i:i + 1] == ch:
                        i += 1
                if buf[i:].startswith(self._start):
                    self._buf = buf[i + len(self._start):]
                    self._state, self._trail = "start-trail", self._start_trail
                    continue
                if not final and (not buf.strip() and self._skip_space or
                                  len(buf) <= len(self._start_lead) + len(self._start)
                                  and self._may_open(buf)):
                    break  # maybe a tag still being written
                self._state = "content"
                continue
            if self._state in ("start-trail", "end-trail"):
                # optspace: each trailing whitespace character of the tag string is taken where
                # the text has it, in order
                while self._trail and self._buf:
                    if self._buf[0] == self._trail[0]:
                        self._buf = self._buf[1:]
                    self._trail = self._trail[1:]
                if self._trail and not final:
                    break
                self._trail = ""
                self._state = "think" if self._state == "start-trail" else "content"
                continue
            if self._state == "think":
                end, tag = self._end_tag()
                if end >= 0:
                    self._reason(self._buf[:end], r_out, True)
                    if tag == self._end:  # the end tag is dropped; another marker that ends the thinking is content
                        self._buf = self._buf[end + len(tag):]
                        self._state, self._trail = "end-trail", self._end_trail
                        if self._lstrip_content:
                            self._state = "end-space"
                    else:
                        self._buf = self._buf[end:]
                        self._state = "content"
                    continue
                if final:
                    self._reason(self._buf, r_out, True)
                    self._buf = ""
                    break
                keep = max(_partial_suffix(self._buf, t) for t in self._ends)
                self._reason(self._buf[:len(self._buf) - keep], r_out, False)
                self._buf = self._buf[len(self._buf) - keep:]
                break
            if self._state == "end-space":  # lstrip_content: the content's leading whitespace is dropped
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._state = "content"
                continue
            # content
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

    def _may_open(self, buf: str) -> bool:
        """Whether buf may still become the start tag (with its optional leading whitespace)."""
        i = 0
        for ch in self._start_lead:
            if buf[i:i + 1] == ch:
                i += 1
        return self._start.startswith(buf[i:])

    def _end_tag(self) -> tuple[int, str]:
        """(where, which) of the first tag in the buffer that ends the thinking; (-1, "") if none."""
        found = [(k, t) for k, t in ((self._buf.find(t), t) for t in self._ends) if k >= 0]
        return min(found) if found else (-1, "")

    @property
    def thinking(self) -> bool:
        """Whether the reply is (still) inside its thinking."""
        return self._state in ("start-trail", "think")


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
        self._reader = ReasoningStream("deepseek", forced_open, skip_space=True)

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
