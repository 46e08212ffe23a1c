"""Tokenizers from GGUF metadata: llama.cpp's test vectors, special tokens, detokenization."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pyllama.util.errors import ModelFileError
from pyllama.models.gguf_file import read_metadata
from pyllama.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

VOCAB_DIR = Path(__file__).parent / "data" / "vocab"
SEPARATOR = "\n__ggml_vocab_test__\n"
VOCABS = ["ggml-vocab-llama-spm.gguf", "ggml-vocab-gpt-2.gguf"]

_cache: dict[str, Tokenizer] = {}
_metadata: dict[str, dict] = {}


def metadata(name: str) -> dict:
    if name not in _metadata:
        _metadata[name] = read_metadata(VOCAB_DIR / name)
    return _metadata[name]


def tokenizer(name: str) -> Tokenizer:
    if name not in _cache:
        _cache[name] = load_tokenizer(metadata(name), str(VOCAB_DIR / name))
    return _cache[name]


def vectors(name: str) -> list[tuple[str, list[int]]]:
    """(input, expected ids) pairs of a vocabulary's .inp/.out files."""
    inputs = (VOCAB_DIR / (name + ".inp")).read_text(encoding="utf-8").split(SEPARATOR)
    lines = (VOCAB_DIR / (name + ".out")).read_text(encoding="utf-8").split("\n")
    if inputs and inputs[-1] == "":
        inputs.pop()  # the file ends with a separator
    if lines and lines[-1] == "":
        lines.pop()
    assert len(inputs) == len(lines), f"{name}: {len(inputs)} inputs but {len(lines)} expected lines"
    return [(x, [int(v) for v in line.split()]) for x, line in zip(inputs, lines)]


# ---- llama.cpp's vectors ----------------------------------------------------------------------

@pytest.mark.parametrize("name", VOCABS)
def test_vocab_vectors_exact(name):
    tok = tokenizer(name)
    cases = vectors(name)
    assert len(cases) > 40
    for i, (text, expected) in enumerate(cases):
        got = tok.encode(text, add_special=False, parse_special=False)
        assert got == expected, f"{name} input #{i} {text!r}:\n got      {got}\n expected {expected}"


@pytest.mark.parametrize("name", VOCABS)
def test_decode_round_trips_vectors(name):
    tok = tokenizer(name)
    for i, (text, _) in enumerate(vectors(name)):
        assert tok.decode(tok.encode(text, add_special=False)) == text, f"{name} input #{i} {text!r}"


# The encode and construction timings are a benchmark, not a test: bench/bench_tokenizer.py.


# ---- the same algorithms written naively, on random text ---------------------------------------

def random_texts(n: int, seed: int) -> list[str]:
    import random
    rng = random.Random(seed)
    alphabet = list("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ  0123456789.,!?'-\n\t") + ["é", "ß", "ж", "一", "語", "🦙", "😁", "\u200d"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(n)]


def naive_spm(tok: Tokenizer, text: str) -> list[int]:
    """llama.cpp's SPM merge rule without the queue: best-scoring adjacent pair, leftmost first."""
    scores = metadata("ggml-vocab-llama-spm.gguf")["tokenizer.ggml.scores"]
    syms = list(("\u2581" + text).replace(" ", "\u2581"))
    while True:
        best = None
        for i in range(len(syms) - 1):
            tid = tok.token_to_id(syms[i] + syms[i + 1])
            if tid is not None and (best is None or scores[tid] > best[0]):
                best = (scores[tid], i)
        if best is None:
            break
        i = best[1]
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
    out = []
    for s in syms:
        tid = tok.token_to_id(s)
        out.extend([tid] if tid is not None else [tok.token_to_id(f"<0x{b:02X}>") for b in s.encode()])
    return out


def naive_bpe(tok: Tokenizer, ranks: dict[tuple[str, str], int], text: str) -> list[int]:
    """GPT-2 byte-level BPE: regex words, lowest-rank adjacent pair first, leftmost first."""
    import regex
    pattern = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    out = []
    for word in regex.findall(pattern, text):
        syms = [B2U[b] for b in word.encode()]
        while True:
            cands = [(ranks[p], i) for i, p in enumerate(zip(syms, syms[1:])) if p in ranks]
            if not cands:
                break
            _, i = min(cands)
            syms[i:i + 2] = [syms[i] + syms[i + 1]]
        out.extend(tok.token_to_id(s) for s in syms)
    return out


def test_spm_matches_naive_merging_on_random_text():
    tok = tokenizer("ggml-vocab-llama-spm.gguf")
    for text in random_texts(100, seed=1):
        assert tok.encode(text, add_special=False) == naive_spm(tok, text), repr(text)


def test_bpe_matches_naive_merging_on_random_text():
    tok = tokenizer("ggml-vocab-gpt-2.gguf")
    merges = metadata("ggml-vocab-gpt-2.gguf")["tokenizer.ggml.merges"]
    ranks = {tuple(m.split(" ")): r for r, m in reversed(list(enumerate(merges)))}  # first rank wins
    for text in random_texts(200, seed=2):
        assert tok.encode(text, add_special=False) == naive_bpe(tok, ranks, text), repr(text)


# ---- special tokens ---------------------------------------------------------------------------

def test_spm_special_tokens():
    tok = tokenizer("ggml-vocab-llama-spm.gguf")
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.n_vocab) == (1, 2, 0, 32000)
    assert tok.add_bos and not tok.add_eos and tok.add_space_prefix
    plain = tok.encode("Hello world", add_special=False)
    assert tok.encode("Hello world") == [1] + plain
    assert tok.encode("") == [1] and tok.encode("", add_special=False) == []
    # control text becomes the control id only when asked; the text after it gets the space prefix
    assert tok.encode("<s>Hello world", add_special=False, parse_special=True) == [1] + plain
    assert 1 not in tok.encode("<s>Hello", add_special=False, parse_special=False)
    assert tok.encode("a</s>", add_special=False, parse_special=True)[-1] == 2
    assert tok.is_eog(2) and not tok.is_eog(1) and not tok.is_eog(plain[0])


def test_bpe_special_tokens():
    tok = tokenizer("ggml-vocab-gpt-2.gguf")
    assert (tok.bos_id, tok.eos_id, tok.n_vocab) == (50256, 50256, 50257)
    assert not tok.add_bos and not tok.add_eos
    assert tok.encode("Hello world") == tok.encode("Hello world", add_special=False) == [15496, 995]
    assert tok.encode("a<|endoftext|>b", parse_special=True) == [64, 50256, 65]
    plain = tok.encode("a<|endoftext|>b", parse_special=False)
    assert 50256 not in plain and tok.decode(plain) == "a<|endoftext|>b"
    assert tok.is_eog(50256) and tok.eot_id == 50256  # found by its text, as llama.cpp does
    assert tok.token_bytes(50256) == b""  # control tokens print nothing
    assert tok.token_bytes(50256, special=True) == b"<|endoftext|>"  # llama-server's --special
    assert tok.token_bytes(15496, special=True) == tok.token_bytes(15496) == b"Hello"
    ids = [15496, 50256, 995]
    plain = IncrementalDetokenizer(tok)
    shown = IncrementalDetokenizer(tok, special=True)
    assert "".join(plain.feed(i) for i in ids) == "Hello world"
    assert "".join(shown.feed(i) for i in ids) == "Hello<|endoftext|> world"


def test_add_bos_follows_metadata():
    md = dict(metadata("ggml-vocab-gpt-2.gguf"))
    md["tokenizer.ggml.add_bos_token"] = True
    md["tokenizer.ggml.add_eos_token"] = True
    tok = load_tokenizer(md)
    assert tok.encode("Hello world") == [50256, 15496, 995, 50256]
    assert tok.encode("Hello world", add_special=False) == [15496, 995]

    md = dict(metadata("ggml-vocab-llama-spm.gguf"))
    md["tokenizer.ggml.add_bos_token"] = False
    tok = load_tokenizer(md)
    assert tok.encode("Hello") == tok.encode("Hello", add_special=False)


def test_token_bytes_and_text():
    spm = tokenizer("ggml-vocab-llama-spm.gguf")
    hello = spm.encode("Hello", add_special=False)
    assert len(hello) == 1 and spm.token_text(hello[0]) == "\u2581Hello"
    assert spm.token_bytes(hello[0]) == b" Hello"
    assert spm.token_bytes(spm.token_to_id("<0x0A>")) == b"\n"
    assert spm.token_bytes(1) == b"" and spm.token_bytes(0) == b""  # <s>, <unk>
    gpt = tokenizer("ggml-vocab-gpt-2.gguf")
    assert gpt.token_text(995) == "\u0120world" and gpt.token_bytes(995) == b" world"
    with pytest.raises(ValueError):
        gpt.token_bytes(gpt.n_vocab)


def test_spm_decode_strips_only_the_added_prefix_space():
    tok = tokenizer("ggml-vocab-llama-spm.gguf")
    ids = tok.encode("Hello world", add_special=False)
    assert tok.decode(ids) == "Hello world"
    # after a leading BOS llama.cpp keeps the space (only the very first piece is stripped)
    assert tok.decode([1] + ids) == " Hello world"
    assert tok.decode(tok.encode("  two spaces", add_special=False)) == "  two spaces"


# ---- incremental detokenization ---------------------------------------------------------------

MULTIBYTE = [x for x, _ in vectors("ggml-vocab-gpt-2.gguf") if any(ord(c) > 0x7F for c in x)]


@pytest.mark.parametrize("name", VOCABS)
def test_incremental_detokenizer_matches_decode(name):
    tok = tokenizer(name)
    assert any(ord(c) > 0xFFFF for c in "".join(MULTIBYTE)) and any("\u4e00" <= c <= "\u9fff" for c in "".join(MULTIBYTE))
    n_held = 0
    for text in MULTIBYTE:
        ids = tok.encode(text, add_special=False)
        det = IncrementalDetokenizer(tok, strip_leading_space=True)
        parts = [det.feed(i) for i in ids]
        parts.append(det.flush())
        assert "".join(parts) == tok.decode(ids) == text
        for p in parts:
            assert "\ufffd" not in p, f"{name}: partial character emitted for {text!r}"
        n_held += sum(1 for i, p in zip(ids, parts) if tok.token_bytes(i) and not p)
    assert n_held > 0  # some token really did end inside a character


def test_incremental_detokenizer_keeps_spaces_of_generated_text():
    tok = tokenizer("ggml-vocab-llama-spm.gguf")
    det = IncrementalDetokenizer(tok)  # continuing a prompt: the first piece keeps its space
    out = "".join(det.feed(i) for i in tok.encode("Paris is", add_special=False)) + det.flush()
    assert out == " Paris is"


def test_incremental_detokenizer_invalid_bytes_are_not_held():
    tok = tokenizer("ggml-vocab-llama-spm.gguf")
    byte = [tok.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    a = tok.token_to_id("a")

    det = IncrementalDetokenizer(tok)
    assert det.feed(byte[0xF0]) == "" and det.feed(byte[0x9F]) == ""  # could still become an emoji
    assert det.feed(a) == "\ufffda"  # ... but 'a' ends it: replaced, not held

    det = IncrementalDetokenizer(tok)
    assert det.feed(byte[0xED]) == ""
    assert det.feed(byte[0xA0]) == "\ufffd\ufffd"  # ED A0 is a surrogate: can never complete
    assert det.feed(byte[0xFF]) == "\ufffd"  # never valid in UTF-8
    assert det.feed(byte[0x80]) == "\ufffd"  # stray continuation byte

    det = IncrementalDetokenizer(tok)
    assert det.feed(byte[0xE4]) == "" and det.feed(byte[0xB8]) == ""
    assert det.flush() == "\ufffd"  # end of stream: the unfinished character is replaced
    assert det.feed(byte[0xE4]) == "" and det.feed(byte[0xB8]) == "" and det.feed(byte[0x80]) == "\u4e00"


# ---- synthetic vocabularies (no fixture files) --------------------------------------------------

def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character map, written out here independently of the code under test."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    m = {b: chr(b) for b in printable}
    m.update({b: chr(256 + i) for i, b in enumerate(others)})
    return m


B2U = bytes_to_unicode()


def gpt2_metadata(pre: str | None = "gpt-2", extra_tokens=(), merges=()) -> dict:
    tokens = [B2U[b] for b in range(256)]
    types = [1] * 256
    merge_list = ["h e", "l l", "he ll", "hell o", "\u0120 w", "\u0120w o", "1 2", "3 4", *merges]
    for m in merge_list:
        tokens.append(m.replace(" ", ""))
        types.append(1)
    for text, tt in [("<s>", 3), ("</s>", 3), *extra_tokens]:
        tokens.append(text)
        types.append(tt)
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merge_list,
        "tokenizer.ggml.bos_token_id": tokens.index("<s>"),
        "tokenizer.ggml.eos_token_id": tokens.index("</s>"),
    }
    if pre is not None:
        md["tokenizer.ggml.pre"] = pre
    return md


def test_synthetic_bpe_encode_decode():
    md = gpt2_metadata()
    tok = load_tokenizer(md)
    ids = md["tokenizer.ggml.tokens"].index
    hello, wo, s, eos = ids("hello"), ids("\u0120wo"), ids("<s>"), ids("</s>")
    assert tok.n_vocab == len(md["tokenizer.ggml.tokens"])
    assert tok.encode("hello world", add_special=False) == [hello, wo, ord("r"), ord("l"), ord("d")]
    assert tok.encode("hell", add_special=False) == [ids("hell")]
    assert tok.decode(tok.encode("hello world")) == "hello world"
    # bytes outside ASCII go through the byte-level map
    assert tok.encode("é", add_special=False) == [0xC3, 0xA9]
    assert tok.token_text(0xC3) == B2U[0xC3] and tok.token_bytes(0xC3) == b"\xc3"
    assert tok.decode(tok.encode("é\n\t €", add_special=False)) == "é\n\t €"
    # special tokens
    assert not tok.add_bos
    assert tok.encode("<s>hello</s>", add_special=False, parse_special=True) == [s, hello, eos]
    assert s not in tok.encode("<s>hello", add_special=False)
    assert tok.decode([s, hello, eos]) == "hello"
    assert tok.is_eog(eos) and not tok.is_eog(s)
    md["tokenizer.ggml.add_bos_token"] = True
    assert load_tokenizer(md).encode("hello") == [s, hello]


def test_synthetic_bpe_pre_tokenizers():
    def digits(pre):
        md = gpt2_metadata(pre)
        t = load_tokenizer(md)
        name = md["tokenizer.ggml.tokens"]
        return [name[i] for i in t.encode("1234", add_special=False)]

    assert digits("gpt-2") == ["12", "34"]  # one word
    assert digits("llama-bpe") == ["12", "3", "4"]  # \p{N}{1,3}
    assert digits("qwen2") == ["1", "2", "3", "4"]  # one digit per word


def test_synthetic_bpe_unknown_pre_is_an_error():
    # llama.cpp refuses a pre-tokenizer it does not know (tests/test_tokenizer_pre.py has more)
    with pytest.raises(ModelFileError, match="'no-such-pre'"):
        load_tokenizer(gpt2_metadata("no-such-pre"))


def test_synthetic_bpe_llama3_ignore_merges_and_bos():
    md = gpt2_metadata("llama-bpe", extra_tokens=[("xyz", 1)])
    del md["tokenizer.ggml.pre"]
    assert load_tokenizer(md).encode("xyz", add_special=False) == [ord("x"), ord("y"), ord("z")]
    md["tokenizer.ggml.pre"] = "llama-bpe"
    tok = load_tokenizer(md)
    assert tok.encode("xyz", add_special=False) == [md["tokenizer.ggml.tokens"].index("xyz")]
    assert tok.add_bos and tok.encode("x") == [tok.bos_id, ord("x")]


def test_synthetic_user_defined_and_eog_by_text():
    md = gpt2_metadata(extra_tokens=[("<tool>", 4), ("<|im_end|>", 1)])
    tok = load_tokenizer(md)
    tool, im_end = md["tokenizer.ggml.tokens"].index("<tool>"), md["tokenizer.ggml.tokens"].index("<|im_end|>")
    # llama.cpp splits user-defined tokens out of the text even without parse_special
    assert tok.encode("a<tool>b", add_special=False) == [ord("a"), tool, ord("b")]
    assert tok.token_bytes(tool) == b"<tool>"
    # '<|im_end|>' is end-of-generation by its text, and becomes a control token
    assert tok.is_eog(im_end) and tok.eot_id == im_end and tok.token_bytes(im_end) == b""
    assert im_end not in tok.encode("<|im_end|>", add_special=False)
    assert tok.encode("<|im_end|>", add_special=False, parse_special=True) == [im_end]


def spm_metadata() -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for text, score in [("\u2581", -1.0), ("a", -2.0), ("b", -2.0), ("ab", -1.0), ("ba", -1.0),
                        ("\u2581a", -5.0), ("\u2581b", -3.0), ("\u2581ba", -0.5)]:
        tokens.append(text)
        types.append(1)
        scores.append(score)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
    }


def test_synthetic_spm_merges_ties_and_byte_fallback():
    md = spm_metadata()
    tok = load_tokenizer(md)
    name = md["tokenizer.ggml.tokens"]
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.add_bos) == (1, 2, 0, True)  # llama.cpp's defaults
    # 'ab' and 'ba' score the same: the leftmost pair merges first
    assert [name[i] for i in tok.encode("aba", add_special=False)] == ["\u2581", "ab", "a"]
    # best score first: 'ba' (-1) beats '▁b' (-3), then '▁' + 'ba' merges (-0.5)
    assert [name[i] for i in tok.encode("ba", add_special=False)] == ["\u2581ba"]
    # characters outside the vocabulary become their UTF-8 bytes
    assert [name[i] for i in tok.encode("é", add_special=False)] == ["\u2581", "<0xC3>", "<0xA9>"]
    assert tok.decode(tok.encode("é a", add_special=False)) == "é a"
    assert tok.encode("a") == [1] + tok.encode("a", add_special=False)
    md["tokenizer.ggml.add_space_prefix"] = False
    assert [name[i] for i in load_tokenizer(md).encode("ab", add_special=False)] == ["ab"]


# ---- invalid metadata -------------------------------------------------------------------------

@pytest.mark.parametrize("change, key", [
    (lambda md: md.pop("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens"),
    (lambda md: md.update({"tokenizer.ggml.tokens": []}), "tokenizer.ggml.tokens"),
    (lambda md: md.pop("tokenizer.ggml.model"), "tokenizer.ggml.model"),
    (lambda md: md.update({"tokenizer.ggml.model": "wordpiece"}), "tokenizer.ggml.model"),
    (lambda md: md.pop("tokenizer.ggml.merges"), "tokenizer.ggml.merges"),
    (lambda md: md.update({"tokenizer.ggml.eos_token_id": 10**6}), "tokenizer.ggml.eos_token_id"),
    (lambda md: md.update({"tokenizer.ggml.bos_token_id": -1}), "tokenizer.ggml.bos_token_id"),
    (lambda md: md.update({"tokenizer.ggml.token_type": [1, 1]}), "tokenizer.ggml.token_type"),
    (lambda md: md.update({"tokenizer.ggml.scores": [0.0]}), "tokenizer.ggml.scores"),
    (lambda md: md.update({"tokenizer.ggml.add_bos_token": "yes"}), "tokenizer.ggml.add_bos_token"),
])
def test_invalid_metadata(change, key):
    md = gpt2_metadata()
    change(md)
    with pytest.raises(ModelFileError) as e:
        load_tokenizer(md, "m.gguf")
    msg = str(e.value)
    assert key in msg and msg.startswith("m.gguf: ") and "\n" not in msg


def test_spm_missing_scores_and_types_are_defaults():
    md = spm_metadata()
    del md["tokenizer.ggml.scores"], md["tokenizer.ggml.token_type"]
    tok = load_tokenizer(md)
    assert tok.n_vocab == len(md["tokenizer.ggml.tokens"])
    with pytest.raises(ModelFileError, match="tokenizer.ggml.unknown_token_id"):
        load_tokenizer({**spm_metadata(), "tokenizer.ggml.unknown_token_id": 10**5})
