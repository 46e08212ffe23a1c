"""Tool-call formats whose arguments are not one JSON object the model writes whole, or whose
reply is not text with calls in it. :mod:`..tool_calls` registers them as families, recognised by
the template's source in llama-server's order (the table's): the formats it has dedicated parsers
for come first, then those it finds when it analyses a template, all before the formats of
:mod:`..tool_calls` (GLM 4.5's templates hold Hermes's ``<tool_call>`` too).

=========== ==================================================== =======================================
family      recognised by (in the template source)                what the model writes
=========== ==================================================== =======================================
harmony     ``<|channel|>`` (gpt-oss)                             ``<|channel|>analysis<|message|>...``
                                                                  ``<|end|><|start|>assistant<|channel|>``
                                                                  ``commentary to=functions.NAME``
                                                                  `` <|constrain|>json<|message|>ARGS``
kimi_k2     ``<|tool_calls_section_begin|>`` and                  ``<|tool_calls_section_begin|>``
            ``<|tool_call_begin|>``                               ``<|tool_call_begin|>functions.NAME:0``
                                                                  ``<|tool_call_argument_begin|>ARGS``
                                                                  ``<|tool_call_end|>...``
qwen3_coder ``<tool_call>``, ``<function=`` and ``<parameter=``   ``<tool_call>\\n<function=NAME>\\n``
                                                                  ``<parameter=P>\\nVALUE\\n</parameter>``
                                                                  ``\\n</function>\\n</tool_call>``
glm45       ``<arg_key>`` and ``<arg_value>``                     ``<tool_call>NAME\\n<arg_key>P</arg_key>``
                                                                  ``\\n<arg_value>VALUE</arg_value>...``
                                                                  ``</tool_call>``
=========== ==================================================== =======================================
"""
from __future__ import annotations

from typing import Callable, Optional

from ..tool_calls import _Family
from .harmony import H_CHANNEL, Harmony
from .kimi_k2 import KIMI_CALL_BEGIN, KIMI_SECTION_BEGIN, KimiK2
from .tagged import Glm45, Qwen3Coder

__all__ = ["NEW_FAMILIES", "detect_new_family", "grammar_rules"]

NEW_FAMILIES: tuple[_Family, ...] = (Harmony(), KimiK2(), Qwen3Coder(), Glm45())
_BY_NAME = {f.name: f for f in NEW_FAMILIES}


def detect_new_family(src: str, stage: str) -> Optional[str]:
    """The family of these formats that a template's source names, for one stage of the
    detection: "special" (what llama-server tests before any other format) or "tagged"."""
    if stage == "special":
        if H_CHANNEL in src:
            return "harmony"
        if KIMI_SECTION_BEGIN in src and KIMI_CALL_BEGIN in src:
            return "kimi_k2"
        if "<tool_call>" in src and "<function=" in src and "<parameter=" in src:
            return "qwen3_coder"
    elif "<arg_key>" in src and "<arg_value>" in src:
        return "glm45"
    return None


def grammar_rules(family: str, tools: list[dict], many: bool, lit: Callable[[str], str],
                  json_rule: Callable[[str, dict], None]) -> list[str]:
    """The head Lark rules (``start`` first) of a required call in one of these formats; the
    rules of JSON values are added through json_rule(rule, schema)."""
    fam = _BY_NAME.get(family)
    if fam is None:
        raise ValueError(f"no call grammar for the tool-call family {family!r}")
    return fam.grammar_rules(tools, many, lit, json_rule)
