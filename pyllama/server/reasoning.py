"""Reasoning ("thinking") text of a chat reply: what the model writes between ``<think>`` and
``</think>`` goes to ``reasoning_content``, the rest to ``content``, as llama-server does with
``--reasoning-format deepseek`` (and ``auto``, its default). The server reads it so only under a
template that thinks (template_thinking.py, as llama-server decides it); under any other the reply
is read with ``none``, and the server reads ``deepseek-legacy`` as ``deepseek``, as llama-server's
parsers do.

A reply is read as thinking when it opens with ``<think>``, or when
the prompt already opened the tag (templates such as DeepSeek R1's and Qwen3's end their generation
prompt with ``<think>``). The thinking ends at ``</think>``; a reply that ends before it is all
reasoning. The whitespace is kept as llama-server keeps it (ReasoningStream): the template's tags
take out only their own whitespace where the reply has it (Qwen3: ``<think>\n``, ``\n</think>\n\n``),
the newline before ``</think>`` stays in the reasoning, a reasoning of whitespace only is dropped,
and whitespace before the opening tag makes the reply all content (unless tools are parsed). Formats:

- ``none``: nothing is separated; the tags stay in the content.
- ``deepseek`` / ``auto``: reasoning in ``reasoning_content``, the tags and thoughts out of the content.
- ``deepseek-legacy``: reasoning in ``reasoning_content`` and the reply left whole in the content.

Some template families think between tags of their own (``[THINK]``..``[/THINK]`` for Magistral,
``<|START_THINKING|>``..``<|END_THINKING|>`` for Command R7B, ``<seed:think>`` for Seed-OSS,
``<|inner_prefix|>``..``<|inner_suffix|>`` for Apertus): :func:`reasoning_tags` names them, and
they are read the same way.
"""
from __future__ import annotations

from typing import Any, Optional

from ..batching.thinking import THINK_END, THINK_START, ReasoningStream

# the thinking tags of the template families that think in tags of their own (tool_formats_more) (the others think in <think>...</think>, if at all)
REASONING_TAGS: dict[str, tuple[str, str]] = {
    "magistral": ("[THINK]", "[/THINK]"),
    "command-r7b": ("<|START_THINKING|>", "<|END_THINKING|>"),
    "seed-oss": ("<seed:think>", "</seed:think>"),
    "apertus": ("<|inner_prefix|>", "<|inner_suffix|>"),
}

# the families whose llama-server parser (common/chat.cpp, one of its own) takes whitespace out:
# (at the reasoning's start, at the content's start after the end tag). Magistral's reads
# ``optional("[THINK]" + reasoning(until("[/THINK]")) + "[/THINK]") << content``, Qwen3-Coder's (with
# <think>) ``optional("<think>" + space() + reasoning(until_one_of(...)) + ...)`` then its content
# after a space(); the other families keep the whitespace, as the parser made from a template's
# analysis does
TAG_SPACE: dict[str, tuple[bool, bool]] = {
    "magistral": (False, True),
    "qwen3_coder": (True, True),
}

__all__ = ["REASONING_FORMATS", "TAG_SPACE", "ReasoningStream", "budget_end_text", "check_format", "prompt_opens_thinking",
           "reasoning_tags", "split_reasoning", "thinking_opener"]

REASONING_FORMATS = ("auto", "none", "deepseek", "deepseek-legacy")


def check_format(value: Any, default: str) -> str:
    """A request's ``reasoning_format`` (None: the server's --reasoning-format); ValueError names it."""
    if value is None:
        return default
    if not isinstance(value, str) or value not in REASONING_FORMATS:
        raise ValueError(f"'reasoning_format' must be one of {', '.join(REASONING_FORMATS)}, got {value!r}")
    return value


def reasoning_tags(family: Optional[str]) -> tuple[str, str]:
    """The (start, end) thinking tags of a template family."""
    return REASONING_TAGS.get(family or "", (THINK_START, THINK_END))


def prompt_opens_thinking(prompt: str, family: Optional[str] = None,
                          tags: Optional[tuple[str, str]] = None) -> bool:
    """Whether a rendered prompt ends inside an opened think tag (the reply starts thinking); tags:
    the template's own (start, end), else the family's."""
    return prompt.rstrip().endswith((tags or reasoning_tags(family))[0])


def thinking_opener(prompt: str, family: Optional[str] = None, tags: Optional[tuple[str, str]] = None) -> str:
    """The text with which a rendered prompt opens the thinking it leaves open (its start tag and
    what follows), or "" when it leaves none open."""
    if not prompt_opens_thinking(prompt, family, tags):
        return ""
    return prompt[prompt.rstrip().rfind((tags or reasoning_tags(family))[0]):]


def split_reasoning(text: str, fmt: str = "deepseek", forced_open: bool = False) -> tuple[Optional[str], str]:
    """(reasoning or None, content) of a whole reply."""
    s = ReasoningStream(fmt, forced_open)
    s.feed(text)
    s.finish()
    return (s.reasoning or None), s.content


def budget_end_text(message: str = "") -> str:
    """What ends a thinking whose budget is spent: the budget message, if any, then the end tag."""
    return f"\n{message}\n{THINK_END}\n\n" if message else f"\n{THINK_END}\n\n"
