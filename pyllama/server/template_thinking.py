"""Whether a chat template thinks, and between which tags, decided as llama-server decides it.

llama-server reads a reply's thinking into ``reasoning_content`` only when the chat format it
made of the template supports thinking; under any other template (plain ChatML, Llama 3, a
built-in layout without --jinja) ``<think>`` is text like any other and stays in ``content``,
and --reasoning-budget does nothing. Its decision (common/chat.cpp,
common_chat_templates_apply_jinja) is, in order:

- a template of a family it reads with a parser of its own (common_chat_try_specialized_template):
  Ministral 3 / Magistral (``[THINK]``), gpt-oss (the analysis channel), Kimi K2, Cohere2 MoE,
  MiniMax-M3, DeepSeek V3.2, Gemma 4 and MiniCPM5 think; LFM2 and Qwen3-Coder templates think
  when their source has ``<think>``; Functionary v3.2 and GigaChat v3 do not;
- any other template: its "differential analysis" (common/chat-diff-analyzer.cpp,
  analyze_reasoning) renders probe conversations and compares them: an earlier reply with and
  without ``reasoning_content`` (the tags around the reasoning it shows), the generation prompt
  with enable_thinking true and false (a tag the prompt opens, or an empty thinking it closes),
  and for templates that show tool calls, reasoning shown only beside calls; then a few
  template-specific patches (old Qwen / DeepSeek distills that split ``</think>`` out of the
  content, Granite 3.3, Nemotron Nano v2).

:func:`template_thinking` does the same with the template's own renderer.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["Thinking", "template_thinking"]

# the probe texts of llama.cpp's analysis (chat-diff-analyzer.cpp), kept so that templates that
# look at the text (e.g. split it on a tag) see what they see there
_USER_MSG = "U_USER_MSG Hello END_U"
_ASSISTANT_MSG = "A_ASST_MSG I can help END_A"
_THINKING = "REASON_PART I am thinking END_R"
_FUN = "FFF_FIRST_FUN_F"

_MARKER = r"(?:<[^>]*>|\[[^\]]*\])"


@dataclass(frozen=True)
class Thinking:
    """A thinking template's tags: where the thinking starts (may be "" where the template shows
    only its end) and where it ends; start_full / end_full: the same with the whitespace the
    template puts around them (Qwen3: ``<think>\n`` and ``\n</think>\n\n``), which llama-server's
    parser takes out of a reply where the reply has it and nowhere else ("": as start / end)."""

    start: str
    end: str
    start_full: str = ""
    end_full: str = ""

    @property
    def full(self) -> tuple[str, str]:
        """(start, end) with their whitespace, as a reply is read in them."""
        return self.start_full or self.start, self.end_full or self.end


Render = Callable[..., str]


def template_thinking(source: str, render: Render, shows_tool_calls: bool) -> Optional[Thinking]:
    """The thinking tags of a Jinja template's source, or None where llama-server reads its replies
    as content only. ``render(messages, add_generation_prompt, tools=..., enable_thinking=...)``
    renders the template (raising on failure); shows_tool_calls: the template shows an assistant's
    tool calls (its caps)."""
    special = _specialized(source)
    if special is not None:
        return special or None
    start, end = _analyze(render, shows_tool_calls)
    start, end = _patched(source, start, end)
    if end is None:
        return None
    return Thinking(start.strip(), end.strip(), start, end)


def _specialized(src: str) -> Optional[Thinking | bool]:
    """common_chat_try_specialized_template's families (same tests, same order): their thinking
    tags, False for a family without thinking, None for a template none of them takes."""
    def has(*parts: str) -> bool:
        return all(p in src for p in parts)
    think = Thinking("<think>", "</think>")
    if has("[SYSTEM_PROMPT]", "[TOOL_CALLS]", "[ARGS]") and "[CALL_ID]" not in src:
        return Thinking("[THINK]", "[/THINK]")
    if "<|channel|>" in src:
        return Thinking("<|channel|>analysis<|message|>", "<|end|>")
    if has(">>>all", ">>>${recipient}"):
        return False
    if has("<|tool_calls_section_begin|>", "<|tool_call_begin|>"):
        return think
    if has("<|START_TEXT|>", "<|START_ACTION|>"):
        return Thinking("<|START_THINKING|>", "<|END_THINKING|>")
    if has("<|tool_list_start|>", "<|tool_list_end|>") or ("List of tools: [" in src and "<|tool_list_start|>" not in src):
        # LFM2 reads thinking only where the template knows the tag (common_chat_params_init_lfm2)
        return think if "<think>" in src else False
    if has("<|role_sep|>", "<|message_sep|>") and "<|function_call|>" not in src:
        return False
    if has("]<]minimax[>[", "<tool_call>", "<invoke name="):
        return Thinking("<mm:think>", "</mm:think>")
    if has("dsml_token", "DSML") and ("function_calls" in src or "tool_calls" in src):
        return think
    if "'<|tool_call>call:'" in src:
        return Thinking("<|channel>thought", "<channel|>")
    if has("Tool usage guidelines:", '<function name="', '<param name="'):
        return think
    if has("<tool_call>", "<function=", "<parameter="):
        return think if "<think>" in src else False
    return None


def _patched(src: str, start: str, end: Optional[str]) -> tuple[str, Optional[str]]:
    """The analysis's template-specific patches that concern the thinking (chat-diff-analyzer.cpp's
    workarounds)."""
    if "content.split('</think>')" in src and "reasoning_content" not in src and "<SPECIAL_12>" not in src \
            and end is None:
        return "<think>", "</think>"  # old Qwen / DeepSeek distill templates, which drop the thinking
    if "Write your thoughts between <think></think> and write your response between <response></response>" in src:
        return "<think>", "</think>"  # Granite 3.3
    if all(t in src for t in ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<TOOL_RESPONSE>")):
        return "<think>\n", "</think>"  # Nemotron Nano v2
    return start, end


def _analyze(render: Render, shows_tool_calls: bool) -> tuple[str, Optional[str]]:
    """(start, end) as analyze_reasoning finds them; end None: no thinking (mode NONE)."""
    user = {"role": "user", "content": _USER_MSG}

    def out(messages: list[dict], gen: bool, thinking: bool = True, tools: Optional[list] = None) -> Optional[str]:
        try:
            return render(messages, gen, tools=tools, enable_thinking=thinking)
        except Exception:  # noqa: BLE001 (a template that fails a probe: that comparison is skipped, as there)
            return None

    start, end, mode = "", "", False
    # 1. an earlier reply with and without its reasoning
    a = out([user, {"role": "assistant", "content": _ASSISTANT_MSG}], False)
    b = out([user, {"role": "assistant", "content": _ASSISTANT_MSG, "reasoning_content": _THINKING}], False)
    if a is not None and b is not None:
        _, _, right = _diff(a, b)
        if right and _THINKING in right:
            m = re.search(f"({_MARKER}\\s*)" + re.escape(_THINKING) + f"(\\s*{_MARKER}\\s*)", b)
            if m:
                start, end, mode = m.group(1), m.group(2), True
            else:
                m = re.search(re.escape(_THINKING) + f"\\s*({_MARKER}\\s*)?", b)
                if m and m.group(1):
                    end, mode = m.group(1), True
    # 2. the generation prompt with thinking off and on
    off, on = out([user], True, thinking=False), out([user], True, thinking=True)
    if off is not None and on is not None:
        left, _, right = _diff(off, on)
        lt, rt = left.strip(), right.strip()
        if not lt and right:
            if rt and on.endswith(rt) and not start:
                start, mode = right, True
        elif not rt and left:
            if lt and off.endswith(lt) and not end:
                seg = [s for s in _segments(off) if s[1].strip()]
                if len(seg) >= 2 and seg[-1][1] == lt and seg[-2][0]:
                    start = seg[-2][1]
                end, mode = left, True
        elif lt and rt:
            for base, extended in ((on, off), (off, on)):
                anchor = base[-64:]
                pos = extended.rfind(anchor)
                if pos < 0 or pos + len(anchor) >= len(extended):
                    continue
                extra = extended[pos + len(anchor):].strip()
                if not extra:
                    continue
                seg = [s for s in _segments(extra) if s[1].strip()]
                if len(seg) == 2 and seg[0][0] and seg[1][0]:
                    start = start or seg[0][1]
                    end = end or seg[1][1]
                    mode = True
                    break
    if not mode and not start and end:
        mode = True
    # 3. reasoning shown only beside tool calls
    if shows_tool_calls:
        tools = [{"type": "function", "function": {"name": _FUN, "description": "d", "parameters": {
            "type": "object", "properties": {"AA_ARG_FST_AA": {"type": "string"}}}}}]
        call = {"id": "call00001", "type": "function",
                "function": {"name": _FUN, "arguments": {"AA_ARG_FST_AA": "VVVV"}}}
        a = out([user, {"role": "assistant", "content": _ASSISTANT_MSG, "reasoning_content": _THINKING}], False,
                tools=tools)
        b = out([user, {"role": "assistant", "content": None, "reasoning_content": _THINKING, "tool_calls": [call]}],
                False, tools=tools)
        if a is not None and b is not None and _THINKING not in a and _THINKING in b:
            m = re.search(f"({_MARKER}\\s*)" + re.escape(_THINKING) + f"\\s*({_MARKER}\\s*)", b)
            if m:
                start, end, mode = m.group(1), m.group(2), True
            else:
                m = re.search(re.escape(_THINKING) + f"\\s*({_MARKER}\\s*)?", b)
                if m and m.group(1):
                    end, mode = m.group(1), True
                else:
                    mode = False
    # an analysis that found a start but no end still counts as thinking there (mode TAG_BASED);
    # its parser then reads nothing as reasoning, which an end of "" given to the caller would not say
    if not mode:
        return "", None
    return start, end if end else None


def _segments(text: str) -> list[tuple[bool, str]]:
    """segmentize_markers: (is_marker, text) runs, a marker being <...> or [...]."""
    out: list[tuple[bool, str]] = []
    border, opener = 0, ""
    for i, c in enumerate(text):
        if not opener and c in "<[":
            if border < i:
                out.append((False, text[border:i]))
            border, opener = i, c
        elif opener and c == {"<": ">", "[": "]"}[opener]:
            out.append((True, text[border:i + 1]))
            border, opener = i + 1, ""
    if border < len(text):
        out.append((False, text[border:]))
    return out


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _common_suffix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def _diff(left: str, right: str) -> tuple[str, str, str]:
    """calculate_diff_split: (left's own part, their common prefix, right's own part), compared
    marker by marker from both ends, then character by character inside text runs."""
    ls, rs = _segments(left), _segments(right)
    if not ls:
        return "", "", right
    if not rs:
        return left, "", ""
    prefix: list[str] = []
    li, lj, ri, rj = 0, len(ls) - 1, 0, len(rs) - 1
    left_done = right_done = False
    while li != lj and ri != rj:
        advanced = False
        if ls[li] == rs[ri]:
            prefix.append(ls[li][1])
            li, ri, advanced = li + 1, ri + 1, True
        if ls[lj] == rs[rj]:
            if li != lj:
                lj -= 1
            else:
                left_done = True
            if ri != rj:
                rj -= 1
            else:
                right_done = True
            advanced = True
        if not advanced:
            break
    if li == lj and ri != rj:
        if ls[li] == rs[rj]:
            rj -= 1
            left_done = True
        elif ls[li] == rs[ri]:
            prefix.append(rs[ri][1])
            ri += 1
            left_done = True
    elif ri == rj and li != lj:
        if ls[lj] == rs[ri]:
            lj -= 1
            right_done = True
        elif ls[li] == rs[ri]:
            prefix.append(ls[li][1])
            li += 1
            right_done = True
    elif li == lj and ri == rj and ls[li] == rs[ri] and ls[li][0]:
        prefix.append(rs[ri][1])
        left_done = right_done = True
    text_suffix = not ls[lj][0] and not rs[rj][0]
    text_prefix = not rs[ri][0] and not ls[li][0]
    rem_l = "".join(s[1] for s in ls[li:lj if left_done else lj + 1])
    rem_r = "".join(s[1] for s in rs[ri:rj if right_done else rj + 1])
    suffix_len = _common_suffix(rem_l, rem_r) if text_suffix else 0
    prefix_len = _common_prefix(rem_l[:len(rem_l) - suffix_len], rem_r[:len(rem_r) - suffix_len]) if text_prefix else 0
    own_l = rem_l[prefix_len:len(rem_l) - suffix_len]
    own_r = rem_r[prefix_len:len(rem_r) - suffix_len]
    common = "".join(prefix) + rem_l[:prefix_len]
    if not own_l and not own_r:
        return "", left, ""
    if not own_l and own_r and len(left) <= len(right) and right.startswith(left):
        return "", left, right[len(left):]
    return own_l, common, own_r
