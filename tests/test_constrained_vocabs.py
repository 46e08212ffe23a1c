"""Constrained decoding on every vocabulary of tests/data/vocab (SPM, BPE, WPM and UGM): grammars,
a JSON schema and a required tool call, driven through `compile_constraint` and `Constraint`
as the decode thread drives them. Each sampled token is one the mask allowed; the matcher must
accept it, and the text of the tokens must be what the grammar forces (or parse as the schema
asks). The texts are lowercase, which WPM's uncased vocabularies can spell. One end-to-end case
runs a server on a model with the llama SPM vocabulary.
"""
from __future__ import annotations

import json
import re
import random
from pathlib import Path

import numpy as np
import pytest

from pyllama.models.gguf_file import read_metadata
from pyllama.batching.constraint import Constraint, ConstraintSpec, compile_constraint, json_schema_spec
from pyllama.server.tool_calls import call_grammar, parse_tool_request
from pyllama.tokenizer import load_tokenizer
from server_util import ServerProcess

VOCAB_DIR = Path(__file__).parent / "data" / "vocab"
VOCABS = sorted({p.name.removesuffix(".xz") for p in VOCAB_DIR.iterdir() if p.name.endswith((".gguf", ".gguf.xz"))})
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "s"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "s": {"enum": ["é", "b c"]}}}
TOOLS = {"tools": [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                                          "properties": {"city": {"enum": ["paris", "oslo"]}}}}}],
         "tool_choice": "required", "parallel_tool_calls": False}



def generate(spec: ConstraintSpec, tok, seed: int, max_tokens: int = 120) -> bytes:
    """Samples uniformly among the allowed tokens (those that are not all whitespace when there
    are others, so that JSON ends soon) until the constraint is done; returns the tokens' bytes."""
    rng = random.Random(seed)
    c = Constraint(compile_constraint(spec, tok), tok.n_vocab)
    out: list[int] = []
    while not c.done:
        assert len(out) < max_tokens, b"".join(tok.token_bytes(i) for i in out)
        c.take_mask()
        assert not c.error, c.error[:300]
        bits = np.unpackbits(c.mask.view(np.uint8), bitorder="little")[:tok.n_vocab]
        allowed = [int(i) for i in np.nonzero(bits)[0]]
        assert allowed, "the mask allows nothing"
        dense = [i for i in allowed if tok.token_bytes(i).strip()]
        token = rng.choice(dense or allowed)
        assert c.consume(token), f"token {tok.token_bytes(token)!r} allowed by the mask was refused: {c.error[:300]}"
        out.append(token)
    return b"".join(tok.token_bytes(i) for i in out)


@pytest.mark.parametrize("name", VOCABS)
def test_grammar_schema_and_tool_call_on_every_vocab(name, vocab_path):
    tok = load_tokenizer(read_metadata(vocab_path(name)), name)
    assert generate(ConstraintSpec("gbnf", 'root ::= "a"{5}'), tok, 0) == b"aaaaa"
    # (lowercase: WPM's uncased vocabularies have no capital letters)
    assert generate(ConstraintSpec("gbnf", 'root ::= "hi there" ("!" | "?")'), tok, 1) in (b"hi there!",
                                                                                          b"hi there?")
    doc = json.loads(generate(json_schema_spec(SCHEMA, "json_schema"), tok, 2))
    assert doc["n"] in range(10) and doc["s"] in ("é", "b c") and set(doc) == {"n", "s"}
    tools = parse_tool_request(TOOLS)
    call = json.loads(generate(ConstraintSpec("lark", call_grammar("generic", tools), "tools"), tok, 3))
    assert call["tool_calls"] and all(c["name"] == "get_weather" and c["arguments"]["city"] in ("paris", "oslo")
                                      for c in call["tool_calls"]), call
    if not any(tok.token_bytes(i) == b"\n" for i in range(tok.n_vocab)):
        return  # (WPM: no token spells a newline, which Hermes' format requires)
    text = generate(ConstraintSpec("lark", call_grammar("hermes", tools), "tools"), tok, 4).decode("utf-8")
    assert text.startswith("<tool_call>") and text.rstrip().endswith("</tool_call>"), text
    body = json.loads(text.strip()[len("<tool_call>"):-len("</tool_call>")])
    assert body["name"] == "get_weather" and body["arguments"]["city"] in ("paris", "oslo"), body


def test_grammar_over_http_on_an_spm_model(model_factory):
    """llama-spm's vocabulary adds a space prefix when it encodes text: the grammar's tokens
    must still be the ones that spell the grammar's text."""
    model = model_factory("tiny", vocab=str(VOCAB_DIR / "ggml-vocab-llama-spm.gguf"))
    srv = ServerProcess(model, "-np", "2").wait_ready()
    try:
        status, doc = srv.post("/completion", {"prompt": "x", "n_predict": 8, "grammar": 'root ::= "a"{5}'})
        assert status == 200 and doc["content"] == "aaaaa", doc
        status, doc = srv.post("/completion", {"prompt": "x", "n_predict": 8, "grammar": 'root ::= " b" [0-9] "é"'})
        assert status == 200 and re.fullmatch(" b[0-9]é", doc["content"]), doc
    finally:
        srv.stop()


def test_a_grammar_compiled_for_a_dropped_vocabulary_is_not_reused_for_another(vocab_path, monkeypatch):
    """Compiled grammars are cached per llguidance tokenizer; once a vocabulary's tokenizer is gone,
    another one (of another size) must get its own compile even where Python hands it the freed
    object's id (forced here: every llguidance tokenizer gets the same id)."""
    import builtins

    from pyllama.batching import constraint as cmod

    real_id = builtins.id
    monkeypatch.setattr(cmod, "id", lambda obj: 7 if type(obj).__name__ == "LLTokenizer" else real_id(obj),
                        raising=False)
    spec = ConstraintSpec("gbnf", 'root ::= "a"{3}')
    for name in ("ggml-vocab-llama-spm.gguf", "ggml-vocab-gpt-2.gguf", "ggml-vocab-bert-bge.gguf"):
        tok = load_tokenizer(read_metadata(vocab_path(name)), name)
        assert generate(spec, tok, 0) == b"aaa", name
        del tok
