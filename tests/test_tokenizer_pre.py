"""Every llama.cpp pre-tokenizer, WPM and UGM: llama.cpp's vocabulary test vectors, each
pre-tokenizer's regex split against the `tokenizers` library, unknown names, --override-kv."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from pyllama.util.errors import ModelFileError
from pyllama.models.default_vocab import bytes_to_unicode
from pyllama.models.gguf_file import apply_kv_overrides, kv_override_arg, read_metadata
from pyllama.tokenizer import load_tokenizer
from pyllama.tokenizer.pretok import PRE_TOKENIZERS

VOCAB_DIR = Path(__file__).parent / "data" / "vocab"
SEPARATOR = "\n__ggml_vocab_test__\n"
B2U = bytes_to_unicode()

# vector files -> (vocabulary file, metadata overrides)
VECTORS = {
    "ggml-vocab-bert-bge.gguf": ("ggml-vocab-bert-bge.gguf", {}),
    "ggml-vocab-command-r.gguf": ("ggml-vocab-command-r.gguf", {}),
    "ggml-vocab-deepseek-coder.gguf": ("ggml-vocab-deepseek-coder.gguf", {}),
    "ggml-vocab-deepseek-llm.gguf": ("ggml-vocab-deepseek-llm.gguf", {}),
    "ggml-vocab-falcon.gguf": ("ggml-vocab-falcon.gguf", {}),
    "ggml-vocab-gemma-4.gguf": ("ggml-vocab-gemma-4.gguf", {}),
    "ggml-vocab-gpt-2.gguf": ("ggml-vocab-gpt-2.gguf", {}),
    "ggml-vocab-llama-bpe.gguf": ("ggml-vocab-llama-bpe.gguf", {}),
    "ggml-vocab-llama-spm.gguf": ("ggml-vocab-llama-spm.gguf", {}),
    "ggml-vocab-mpt.gguf": ("ggml-vocab-mpt.gguf", {}),
    "ggml-vocab-phi-3.gguf": ("ggml-vocab-phi-3.gguf", {}),
    "ggml-vocab-qwen2.gguf": ("ggml-vocab-qwen2.gguf", {}),
    # llama.cpp's qwen35 vocabulary is the qwen2 one with another pre-tokenizer name
    "ggml-vocab-qwen35.gguf": ("ggml-vocab-qwen2.gguf", {"tokenizer.ggml.pre": "qwen35"}),
    "ggml-vocab-refact.gguf": ("ggml-vocab-refact.gguf", {}),
    "ggml-vocab-starcoder.gguf": ("ggml-vocab-starcoder.gguf", {}),
}



def vectors(name: str) -> list[tuple[str, list[int]]]:
    inputs = (VOCAB_DIR / (name + ".inp")).read_text(encoding="utf-8").split(SEPARATOR)
    lines = (VOCAB_DIR / (name + ".out")).read_text(encoding="utf-8").split("\n")
    if inputs and inputs[-1] == "":
        inputs.pop()
    if lines and lines[-1] == "":
        lines.pop()
    assert len(inputs) == len(lines), name
    return [(x, [int(v) for v in line.split()]) for x, line in zip(inputs, lines)]


@pytest.mark.parametrize("name", sorted(VECTORS))
def test_llamacpp_vocab_vectors(name, vocab_path):
    file, overrides = VECTORS[name]
    tok = load_tokenizer(read_metadata(vocab_path(file), overrides), name)
    cases = vectors(name)
    assert len(cases) >= 40
    for i, (text, expected) in enumerate(cases):
        got = tok.encode(text, add_special=False, parse_special=False)
        assert got == expected, f"{name} input #{i} {text!r}:\n got      {got}\n expected {expected}"


def test_every_vector_file_is_checked():
    names = {p.name[:-4] for p in VOCAB_DIR.glob("*.gguf.inp")}
    assert names == set(VECTORS)


def test_wpm_frames_with_cls_and_sep(vocab_path):
    tok = load_tokenizer(read_metadata(vocab_path("ggml-vocab-bert-bge.gguf")))
    assert tok.model == "bert"
    body = tok.encode("Hello, World!", add_special=False)
    assert tok.encode("Hello, World!") == [101, *body, 102]
    # lowercased, accents stripped, punctuation isolated, CJK one ideograph per word
    assert tok.words("Héllo,WORLD 我想") == ["hello", ",", "world", "我", "想"]
    assert [tok.token_text(i) for i in body] == ["\u2581hello", "\u2581,", "\u2581world", "\u2581!"]


def test_wpm_ascii_words_match_the_character_path(vocab_path):
    """ASCII text takes the str-method path: the same words as the character-by-character one,
    which a trailing CJK ideograph (a word of its own) forces."""
    import random  # noqa: PLC0415
    tok = load_tokenizer(read_metadata(vocab_path("ggml-vocab-bert-bge.gguf")))
    rng = random.Random(0)
    for lowercase in (True, False):
        tok.lowercase = tok.strip_accents = lowercase
        for _ in range(3000):
            text = "".join(chr(rng.randrange(128)) if rng.random() < 0.5 else rng.choice("aB c.") for _ in range(20))
            assert tok.words(text) + ["\u6211"] == tok.words(text + " \u6211"), repr(text)


# ---- each pre-tokenizer's split against the tokenizers library ---------------------------------

TEXT = ("Hello, y'all! I'M here: 1234567 ½ 3.14\n\n  \t tabs   spaces 我想在apple工作1314151天～ "
        "한국어 😁🦙 <sentinel:12> IMGIMGABZ don't WE'LL ÉLAN élan naïve\r\n end  ")


def split_vocab(words: list[str]) -> tuple[list[str], list[str]]:
    """A byte-level vocabulary holding every byte and every prefix of each word, with the merges
    that build them left to right."""
    tokens = [B2U[b] for b in range(256)]
    seen = set(tokens)
    merges = []
    for w in words:
        enc = "".join(B2U[b] for b in w.encode("utf-8"))
        cur = enc[0]
        for ch in enc[1:]:
            if cur + ch not in seen:
                seen.add(cur + ch)
                tokens.append(cur + ch)
                merges.append(f"{cur} {ch}")
            cur += ch
    return tokens, merges


BYTE_LEVEL_PRES = sorted(n for n, r in PRE_TOKENIZERS.items() if r.byte_level)


@pytest.mark.parametrize("pre", BYTE_LEVEL_PRES)
def test_pre_tokenizer_matches_tokenizers_library(pre):
    rules = PRE_TOKENIZERS[pre]
    # the reference: HF's Sequence of isolating Splits, one per regex, then the byte-level map
    split = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in rules.regexes])
    words = [w for w, _ in split.pre_tokenize_str(TEXT)]
    assert "".join(words) == TEXT and len(words) > 10
    tokens, merges = split_vocab(words)
    ref = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                 merges=[tuple(m.split(" ")) for m in merges], ignore_merges=rules.ignore_merges))
    ref.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                 use_regex=False)])
    tok = load_tokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
                          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
                          "tokenizer.ggml.bos_token_id": 0})
    got = tok.encode(TEXT, add_special=False)
    assert got == ref.encode(TEXT, add_special_tokens=False).ids
    assert tok.decode(got) == TEXT


def words_of(pre: str, text: str) -> list[str]:
    """How a pre-tokenizer cuts `text`, seen through a vocabulary that merges nothing: each word's
    bytes come out as single-byte tokens, and the word boundaries are where the split put them."""
    split = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated")
                                     for r in PRE_TOKENIZERS[pre].regexes])
    return [w for w, _ in split.pre_tokenize_str(text)]


@pytest.mark.parametrize("pre, text, expected", [
    # the telling example: DeepSeek keeps the space apart from a digit like '½', GPT-2 does not
    ("deepseek-llm", "4 ½ months", ["4", " ", "½", " months"]),
    ("deepseek-coder", "4 ½ months", ["4", " ", "½", " months"]),
    ("gpt-2", "4 ½ months", ["4", " ½", " months"]),
    ("llama3", "1234567", ["123", "456", "7"]),
    ("qwen2", "123", ["1", "2", "3"]),
    ("starcoder", "x12", ["x", "1", "2"]),
    ("deepseek-v3", "我想在apple 1234", ["我想在", "apple", " ", "123", "4"]),
    # groups of three counted from the right
    ("afmoe", "1234567", ["1", "234", "567"]),
    ("tiny_aya", "12345", ["12", "345"]),
    ("superbpe", "a1234567", ["a", "1", "234", "567"]),
    ("kimi-k2", "Hello我想在apple", ["Hello", "我想在", "apple"]),
    ("bloom", "Hi, there.", ["Hi", ",", " there", "."]),
    ("chameleon", "ab12:  x", ["ab", "1", "2", ":", "  ", "x"]),
    ("tekken", "HelloWorld", ["Hello", "World"]),
    ("gpt-4o", "I'M HELLOworld", ["I'M", " HELLOworld"]),
    ("default", "a+b 123", ["a", "+", "b", " ", "123"]),
])
def test_pre_tokenizer_splits(pre, text, expected):
    assert words_of(pre, text) == expected
    # the same boundaries in pyllama's tokenizer: a vocabulary of bytes plus exactly these words
    tokens, merges = split_vocab(expected)
    tok = load_tokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
                          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
                          "tokenizer.ggml.bos_token_id": 0})
    got = [tok.token_bytes(i).decode("utf-8") for i in tok.encode(text, add_special=False)]
    assert got == expected


def test_spm_style_bpe_gemma4():
    # raw UTF-8 pieces with U+2581 for spaces, <0xXX> byte fallback, newline runs kept whole
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [3, 3, 3, 2] + [6] * 256
    for t in ["a", "b", "ab", "\u2581", "\u2581ab", "\n", "\n\n"]:
        tokens.append(t)
        types.append(1)
    merges = ["a b", "\u2581 ab"]
    md = {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 2}
    tok = load_tokenizer(md)
    name = tokens.__getitem__
    ids = tok.encode("ab ab\n\n\n\né", add_special=False)
    # '\n\n\n\n' is not a token: it is merged from single newlines (no newline merges here)
    assert [name(i) for i in ids] == ["ab", "\u2581ab", "\n", "\n", "\n", "\n", "<0xC3>", "<0xA9>"]
    assert [name(i) for i in tok.encode("ab\n\n", add_special=False)] == ["ab", "\n\n"]
    assert tok.decode(ids) == "ab ab\n\n\n\né"
    # llama.cpp adds BOS for Gemma 4 even when the file says not to
    md["tokenizer.ggml.add_bos_token"] = False
    assert load_tokenizer(md).encode("ab") == [2, tokens.index("ab")]


# ---- unknown names and --override-kv -------------------------------------------------------------

def gpt2_md(pre: str | None) -> dict:
    tokens, merges = split_vocab(["hello"])
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges}
    if pre is not None:
        md["tokenizer.ggml.pre"] = pre
    return md


def test_unknown_pre_tokenizer_is_an_error_naming_it():
    with pytest.raises(ModelFileError) as e:
        load_tokenizer(gpt2_md("my-new-model"), "m.gguf")
    msg = str(e.value)
    assert msg.startswith("m.gguf: ") and "'my-new-model'" in msg and "--override-kv" in msg and "\n" not in msg


def test_missing_pre_uses_llamacpp_default(caplog):
    tok = load_tokenizer(gpt2_md(None))
    assert tok.pre == "default"
    assert "tokenizer.ggml.pre" in caplog.text


def test_unknown_model_is_an_error():
    md = gpt2_md("gpt-2")
    md["tokenizer.ggml.model"] = "rwkv"
    with pytest.raises(ModelFileError, match="'rwkv'"):
        load_tokenizer(md)


def test_override_kv_rescues_an_unknown_pre():
    md = gpt2_md("my-new-model")
    apply_kv_overrides(md, dict(kv_override_arg("tokenizer.ggml.pre=str:qwen2")), "m.gguf")
    assert load_tokenizer(md).pre == "qwen2"


def test_override_kv_parsing():
    assert kv_override_arg("a.b=int:3,c=float:1.5, d=bool:false,e=str:x y") == [
        ("a.b", 3), ("c", 1.5), ("d", False), ("e", "x y")]
    # a comma inside a value needs CSV quotes, as llama.cpp's list parser has it
    assert kv_override_arg('"k=str:a,b",n=int:1') == [("k", "a,b"), ("n", 1)]


@pytest.mark.parametrize("bad, says", [
    ("tokenizer.ggml.pre", "KEY=TYPE:VALUE"),
    ("x=string:a", "the type must be one of int, float, bool, str"),
    ("x=int:1.5", "'1.5' is not an int"),
    ("x=float:abc", "'abc' is not a float"),
    ("x=bool:yes", "'true' or 'false'"),
    ("x=str:" + "a" * 128, "at most 127"),
    ("", "KEY=TYPE:VALUE"),
])
def test_override_kv_bad_values(bad, says):
    with pytest.raises(argparse.ArgumentTypeError) as e:
        kv_override_arg(bad)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_override_kv_type_must_match_the_file():
    md = {"llama.block_count": 2, "tokenizer.ggml.pre": "gpt-2"}
    with pytest.raises(ModelFileError, match="llama.block_count.*int, not a str"):
        apply_kv_overrides(md, {"llama.block_count": "3"}, "m.gguf")
    apply_kv_overrides(md, {"llama.block_count": 3, "new.key": True}, "m.gguf")
    assert md == {"llama.block_count": 3, "tokenizer.ggml.pre": "gpt-2", "new.key": True}


def test_override_kv_flag_on_server_and_generate(tmp_path, vocab_path):
    from pyllama.generate import build_parser as generate_parser  # noqa: PLC0415
    from pyllama.server.options import build_parser as server_parser  # noqa: PLC0415
    for parser in (server_parser(), generate_parser()):
        args = parser.parse_args(["--override-kv", "tokenizer.ggml.pre=str:qwen35",
                                  "--override-kv", "a=int:1,b=bool:true"])
        assert args.override_kv == [("tokenizer.ggml.pre", "qwen35"), ("a", 1), ("b", True)]
        with pytest.raises(SystemExit):
            parser.parse_args(["--override-kv", "a=int:x"])
    # applied when the file is read
    md = read_metadata(vocab_path("ggml-vocab-gpt-2.gguf"), {"tokenizer.ggml.pre": "qwen2"})
    assert md["tokenizer.ggml.pre"] == "qwen2" and load_tokenizer(md).pre == "qwen2"


def test_ugm_matches_tokenizers_unigram(vocab_path):
    """T5/XLM-R style unigram: against the tokenizers library's own pipeline for such a vocabulary
    (precompiled map, spaces merged, U+2581 prefix on every word, Viterbi per word)."""
    from tokenizers import normalizers  # noqa: PLC0415
    md = read_metadata(vocab_path("ggml-vocab-nomic-bert-moe.gguf"))
    tok = load_tokenizer(md)
    assert tok.model == "t5" and tok.add_eos
    pieces = [(t, s) if ty == 1 else (f"\ufdd1{i}", 0.0) for i, (t, s, ty) in
              enumerate(zip(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"], md["tokenizer.ggml.token_type"]))]
    ref = HFTokenizer(models.Unigram(pieces, unk_id=md["tokenizer.ggml.unknown_token_id"]))
    ref.normalizer = normalizers.Sequence([
        normalizers.Precompiled(bytes(b & 0xFF for b in md["tokenizer.ggml.precompiled_charsmap"])),
        normalizers.Replace(Regex(" {2,}"), " "), normalizers.Strip()])
    ref.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    texts = [x for x, _ in vectors("ggml-vocab-llama-bpe.gguf")] + [TEXT]
    for text in texts:
        assert tok.encode(text, add_special=False) == ref.encode(text, add_special_tokens=False).ids, repr(text)
    # this file asks for BOS too (tokenizer.ggml.add_bos_token); UGM's own default is EOS only
    assert tok.encode("Hello") == [tok.bos_id] + tok.encode("Hello", add_special=False) + [tok.eos_id]
