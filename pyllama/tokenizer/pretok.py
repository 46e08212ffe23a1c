"""BPE pre-tokenizers: every `tokenizer.ggml.pre` value llama.cpp recognises, as the regexes that
cut text into words before merging, plus the per-model rules that come with the name.

Each regex splits every piece the previous one left (matches and the text between them become
separate pieces, HF's `Split(..., behavior="isolated")`), so a list of regexes composes the way
llama.cpp's `unicode_regex_split` and HF's `pre_tokenizers.Sequence` do. The regexes are written
for a full Unicode engine (Oniguruma, inside the `tokenizers` library): where llama.cpp hand-codes
a split its own regex engine cannot express, the regex here is the one from the model's
tokenizer.json that llama.cpp imitates.
"""
from __future__ import annotations

from dataclasses import dataclass

# contraction suffixes, case-insensitive (HF's `(?i:'s|'t|...)`)
_CONTR = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# llama.cpp's GPT-2 regex lacks the final `\s+`; the regex split keeps unmatched text as its own
# piece, so the result is the same
GPT2_LLAMACPP = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (_CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
QWEN2 = _CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (_CONTR + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
JAIS2 = (_CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
         r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}")
# DeepSeek LLM's letter class (the Latin, Greek, Cyrillic... letters of its tokenizer.json)
_DS_LETTERS = ("A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370"
                "-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-"
                "\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-"
                "\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-"
                "\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
                "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a"
                "-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-"
                "\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-"
                "\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-"
                "\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-"
                "\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943")
_CJK_HANGUL = "[一-龥ࠀ-一가-퟿]+"
# DeepSeek V3 and its relatives: ASCII punctuation glued to a following Latin word
_DS3_MAIN = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
             r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_KANA_HAN = "[一-龥぀-ゟ゠-ヿ]+"
_STARCODER = (r"\p{N}", GPT2_LLAMACPP)
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
# o200k-style: a word is optional leading non-letter, upper/title/other letters, then lower ones
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTR}?|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTR}?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's own spelling for granite-embed-multi (no tokenizer.json original given there)
GRANITE_EMB_MULTI = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+" + _CONTR
                     + r"?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*" + _CONTR
                     + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Kimi K2 (tiktoken): Han runs on their own, and kept out of the letter classes (class intersection)
_K2_UP = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_K2_LO = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
KIMI_K2 = (rf"\p{{Han}}+|[^\r\n\p{{L}}\p{{N}}]?{_K2_UP}*{_K2_LO}+{_CONTR}?|[^\r\n\p{{L}}\p{{N}}]?{_K2_UP}+{_K2_LO}*{_CONTR}?"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# digit runs cut into groups of three from the right (llama.cpp hand-codes this for AFMoE and Tiny Aya)
DIGITS_3_FROM_RIGHT = r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"
NEWLINES = r"[^\n]+|[\n]+"


@dataclass(frozen=True)
class PreTokenizer:
    """What a `tokenizer.ggml.pre` name means for a BPE vocabulary."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False      # a whole word found in the vocabulary is one token (llama3 & co.)
    add_bos: bool = False            # default of tokenizer.ggml.add_bos_token
    byte_level: bool = True          # GPT-2 byte-to-character map; False: raw UTF-8, <0xXX> byte tokens
    escape_spaces: bool = False      # ' ' becomes U+2581 before splitting (SPM-style BPE)
    newline_words: bool = False      # a run of newlines that is itself a token stays whole (Gemma 4)
    force_add_bos: bool = False      # BOS even where tokenizer.ggml.add_bos_token says no (Gemma 4)
    lowercase: bool = True           # the 'whitespace' tokenizer model's normalizer lowercases


_P = PreTokenizer
_DEFAULT = _P((r"[\p{P}\$\+<=>\^~\|]+", GPT2_LLAMACPP, r"\p{N}+", r"[0-9][0-9][0-9]"))
_GPT2 = _P((GPT2_LLAMACPP,))
_LLAMA3 = _P((LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2 = _P((QWEN2,))
_DS3 = _P((r"\p{N}{1,3}", _KANA_HAN, _DS3_MAIN))
_STARC = _P(_STARCODER)
_GPT4O = _P((GPT4O,))
_SPM_BPE = _P((NEWLINES,), byte_level=False, escape_spaces=True, newline_words=True)
_GEMMA4 = _P((NEWLINES,), add_bos=True, byte_level=False, escape_spaces=True, newline_words=True, force_add_bos=True)

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    "minicpm5": _P((r"\p{N}{1,3}", _CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
                                           r"|\s*[\r\n]+|\s+(?!\S)|\s+"), ignore_merges=True),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"), _LLAMA3),
    "deepseek-llm": _P((r"[\r\n]", rf"\s?[{_DS_LETTERS}]+", r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$",
                        _CJK_HANGUL, r"\p{N}+")),
    "deepseek-coder": _P((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), _DS3),
    "spark2_5": _P((r"\p{N}{1,3}", _KANA_HAN,
                    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                    r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+", r"\p{N}")),
    "youtu": _P(("[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
                 rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTR}?|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTR}?"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"), ignore_merges=True),
    "falcon": _P((r"[\p{P}\$\+<=>\^~\|`]+", GPT2_LLAMACPP, r"[0-9][0-9][0-9]")),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
                    _STARC),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                     "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais",
                     "trillion", "granite-docling", "exaone4"), _GPT2),
    "jais-2": _P((JAIS2,)),
    **dict.fromkeys(("gemma4", "granite-embed-multi-311m"), _GEMMA4),
    "sarvam-moe": _SPM_BPE,
    "whitespace": _P((r"\S+",), byte_level=False, lowercase=False),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "megrez", "hunyuan", "solar-open",
                     "grok-2"), _QWEN2),
    "qwen35": _P((QWEN35,)),
    "dbrx": _P((LLAMA3,)),
    "smaug-bpe": _P((LLAMA3,)),
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), _P((_BLOOM,))),
    "chatglm-bpe": _P((LLAMA3,)),
    **dict.fromkeys(("glm4", "glm5"), _P((LLAMA3,), ignore_merges=True)),
    "viking": _P((_BLOOM, r"\p{N}")),
    "tekken": _P((TEKKEN,), ignore_merges=True, add_bos=True),
    "exaone-moe": _P((_CONTR + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                      r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",)),
    "chameleon": _P((r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
                     r"[\p{P}!-/:-@\[-`{-~]", GPT2_LLAMACPP), add_bos=True),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
    "granite-embed-multi-97m": _P((GRANITE_EMB_MULTI,), ignore_merges=True),
    **dict.fromkeys(("tiny_aya", "cohere2moe"), _P((DIGITS_3_FROM_RIGHT, GPT4O))),
    "superbpe": _P((r"\p{N}+", r"(?=(\d{3})+(?!\d))")),
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"),
                    _P((r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",))),
    "seed-coder": _P((_CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
                      r"|\s+(?!\S)|\s+",)),
    "kimi-k2": _P((KIMI_K2,)),
    "ufakzeka": _P((r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    "afmoe": _P((DIGITS_3_FROM_RIGHT, "[一-鿿㐀-䶿豈-﫿぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]+", _DS3_MAIN)),
    "laguna": _P((NEWLINES, QWEN2)),
}


def pre_tokenizer(name: str) -> PreTokenizer | None:
    """The pre-tokenizer a `tokenizer.ggml.pre` value names, None if it is not one llama.cpp knows."""
    return PRE_TOKENIZERS.get(name)
