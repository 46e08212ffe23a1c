"""Lazy grammars (`grammar_lazy`, `grammar_triggers`) and tool_choice "auto" calls constrained from
their marker on.

The random-weight model's greedy output is known once it has run, so the tests take a trigger from
it: the reply must then be that greedy text up to the trigger (free), the trigger, and what the
grammar forces after it; the same grammar applied from the first token (not lazy) gives other text.
"""
from __future__ import annotations

import re
import types

import pytest

from pyllama.batching.lazy_grammar import LazyStart, Trigger
from pyllama.server.http import HTTPError
from pyllama.server.params import parse_completion
from server_util import ServerProcess

FORCED = " the end"


@pytest.fixture(scope="module")
def srv(tiny_model):
    s = ServerProcess(tiny_model, "-np", "2", "-c", "1024").wait_ready()
    yield s
    assert s.stop() == 0


def greedy(srv, n: int = 12) -> tuple[list[int], list[str]]:
    status, doc = srv.post("/completion", {"prompt": "Once upon a time", "n_predict": n, "temperature": 0,
                                           "return_tokens": True, "cache_prompt": False})
    assert status == 200, doc
    ids = doc["tokens"]
    status, pieces = srv.post("/detokenize", {"tokens": ids})
    texts = []
    for t in ids:
        status, d = srv.post("/detokenize", {"tokens": [t]})
        texts.append(d["content"])
    return ids, texts


def lazy(srv, triggers: list[dict], grammar: str, **extra) -> tuple[int, dict]:
    return srv.post("/completion", {"prompt": "Once upon a time", "n_predict": 24, "temperature": 0,
                                    "cache_prompt": False, "grammar": grammar, "grammar_lazy": True,
                                    "grammar_triggers": triggers, **extra})


def _gbnf(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def first_unique(ids: list[int], texts: list[str], at_least: int = 3) -> int:
    """An output position >= at_least whose token and text appear there first (and are not blank)."""
    for k in range(at_least, len(ids)):
        if ids[k] not in ids[:k] and texts[k].strip() and texts[k] not in "".join(texts[:k]):
            return k
    pytest.skip("no usable trigger in the greedy output")


def test_token_trigger_frees_the_text_before_and_constrains_after(srv):
    ids, texts = greedy(srv)
    k = first_unique(ids, texts)
    grammar = f"root ::= {_gbnf(texts[k] + FORCED)}"
    status, doc = lazy(srv, [{"type": 0, "value": texts[k], "token": ids[k]}], grammar)
    assert status == 200, doc
    assert doc["content"] == "".join(texts[:k + 1]) + FORCED
    assert doc["stop_type"] == "eos"  # the grammar is done: nothing but the end may follow
    # the same grammar from the first token on cannot give the greedy start
    status, doc = srv.post("/completion", {"prompt": "Once upon a time", "n_predict": 24, "temperature": 0,
                                           "cache_prompt": False, "grammar": grammar})
    assert status == 200 and doc["content"] == texts[k] + FORCED


def test_word_and_pattern_triggers_start_the_grammar_where_they_match(srv):
    ids, texts = greedy(srv)
    k = first_unique(ids, texts)
    before = "".join(texts[:k])
    word = texts[k]
    if len(word.strip()) < 2:
        pytest.skip("the trigger token's text is too short to be a word trigger")
    # a word of more than one token of text: its start may lie inside a token
    status, doc = lazy(srv, [{"type": 1, "value": word}], f"root ::= {_gbnf(word + FORCED)}")
    if status == 400:  # the word is a single token: llama-server asks for it as a preserved token
        assert "preserved token" in doc["error"]["message"]
        status, doc = lazy(srv, [{"type": 1, "value": word}], f"root ::= {_gbnf(word + FORCED)}",
                           preserved_tokens=[word])
    assert status == 200, doc
    assert doc["content"] == before + word + FORCED
    # a pattern with a capturing group: the grammar starts at the group
    pattern = "(" + re.escape(word) + ")"
    status, doc = lazy(srv, [{"type": 2, "value": pattern}], f"root ::= {_gbnf(word + FORCED)}")
    assert status == 200 and doc["content"] == before + word + FORCED, doc
    # pattern_full: the whole text so far must match; the group marks where the grammar starts
    full = re.escape(before) + "(" + re.escape(word) + ")"
    status, doc = lazy(srv, [{"type": 3, "value": full}], f"root ::= {_gbnf(word + FORCED)}")
    assert status == 200 and doc["content"] == before + word + FORCED, doc


def test_a_trigger_that_never_fires_leaves_the_output_free(srv):
    ids, texts = greedy(srv, 12)
    status, doc = lazy(srv, [{"type": 1, "value": "\u2603\u2603 never"}], 'root ::= "x"', n_predict=12)
    assert status == 200 and doc["content"] == "".join(texts)


def test_a_grammar_refusing_its_trigger_text_ends_with_an_error(srv):
    ids, texts = greedy(srv)
    k = first_unique(ids, texts)
    status, doc = lazy(srv, [{"type": 0, "value": texts[k], "token": ids[k]}], 'root ::= "\u2603"')
    assert status == 500 and "constrained decoding failed" in doc["error"]["message"], doc
    status, slots = srv.request("GET", "/slots")
    assert status == 200 and not any(s["is_processing"] for s in slots)


@pytest.mark.parametrize("body, named", [
    ({"grammar_lazy": True}, "'grammar_lazy'"),
    ({"grammar_lazy": True, "grammar_triggers": "x"}, "'grammar_triggers'"),
    ({"grammar_lazy": True, "grammar_triggers": [{"type": 7, "value": "x"}]}, "'grammar_triggers[0]'"),
    ({"grammar_lazy": True, "grammar_triggers": [{"type": 1}]}, "'grammar_triggers[0]'"),
    ({"grammar_lazy": True, "grammar_triggers": [{"type": 0, "value": "x"}]}, "'grammar_triggers[0].token'"),
    ({"grammar_lazy": True, "grammar_triggers": [{"type": 2, "value": "("}]}, "'grammar_triggers[0].value'"),
    ({"grammar_lazy": True, "grammar_triggers": [{"type": 1, "value": "x"}], "preserved_tokens": "x"},
     "'preserved_tokens'"),
])
def test_bad_triggers_are_a_400_naming_the_field(srv, body, named):
    status, doc = srv.post("/completion", {"prompt": "x", "grammar": 'root ::= "a"', **body})
    assert status == 400, doc
    assert named in doc["error"]["message"], doc


def test_a_one_token_word_must_be_preserved(tokenizer):
    word = tokenizer.decode([300])
    assert len(tokenizer.encode(word, add_special=False, parse_special=True)) == 1
    body = {"prompt": "x", "grammar": 'root ::= "a"', "grammar_lazy": True,
            "grammar_triggers": [{"type": 1, "value": word}]}
    with pytest.raises(HTTPError, match="preserved token"):
        parse_completion(body, -1, 1, tokenizer=tokenizer, n_vocab=tokenizer.n_vocab)
    p = parse_completion({**body, "preserved_tokens": [word]}, -1, 1, tokenizer=tokenizer, n_vocab=tokenizer.n_vocab)
    assert p.triggers == (Trigger("token", word, 300),)
    # not lazy: the triggers are checked as llama-server checks them, and have no use
    assert parse_completion({**body, "grammar_lazy": False, "preserved_tokens": [word]}, -1, 1,
                            tokenizer=tokenizer).triggers == ()


def test_lazy_start_finds_each_kind(tokenizer):
    text_ids = tokenizer.encode("say hello world now", add_special=False)
    for trig, want in ((Trigger("word", "world"), "world now"), (Trigger("pattern", r"h(ell)o"), "ello world now"),
                       (Trigger("pattern_full", r"say (hello) world now"), "hello world now")):
        watch = LazyStart(tokenizer, (trig,))
        got = None
        for t in text_ids:
            got = watch.feed(t)
            if got is not None:
                break
        assert got is not None and tokenizer.decode(got) == want[:len(tokenizer.decode(got))], (trig, got)
        assert tokenizer.decode(got).startswith(want[:3])
    # pattern_full must match all of the text so far, not a part of it
    watch = LazyStart(tokenizer, (Trigger("pattern_full", "hello"),))
    assert all(watch.feed(t) is None for t in text_ids)


def test_auto_tool_choice_is_a_lazy_call_grammar(tokenizer):
    from pyllama.server.api import Api
    from pyllama.server.chat import ChatTemplate
    from tool_templates import FAMILY_TEMPLATES
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    api = Api.__new__(Api)
    api.state = types.SimpleNamespace(
        args=types.SimpleNamespace(n_predict=-1, reasoning_format="auto", reasoning_budget=-1, n_keep=0),
        tokenizer=tokenizer, slots_per_group=1, chat=ChatTemplate(FAMILY_TEMPLATES["hermes"]),
        check_prompt_fits=lambda *a: None)
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [tool]}
    try:
        p, _, _ = api._chat_input(body)
    except Exception as exc:  # the state stub lacks what a real server has: say which
        pytest.fail(f"chat input on a stub state: {exc!r}")
    assert p.constraint is not None and p.constraint.source == "tools"
    assert p.triggers == (Trigger("word", "<tool_call>"),)
    p, _, _ = api._chat_input({**body, "tool_choice": "none"})
    assert p.constraint is None and p.triggers == ()


def test_every_call_trigger_opens_its_familys_call_grammar(tokenizer):
    """The lazy grammar starts at the trigger: each family's call grammar must take the trigger's text
    as its first bytes (else every auto call would end in an error)."""
    from pyllama.batching.constraint import ConstraintSpec, compile_constraint
    from pyllama.server.tool_calls import CALL_TRIGGERS, ToolSpec, call_grammar
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for family, trigger in CALL_TRIGGERS.items():
        matcher = compile_constraint(ConstraintSpec("lark", call_grammar(family, ToolSpec(tools=[tool])), "tools"),
                                     tokenizer)
        assert matcher.consume_tokens(tokenizer.encode(trigger, add_special=False)), (family, matcher.get_error())
        other = compile_constraint(ConstraintSpec("lark", call_grammar(family, ToolSpec(tools=[tool])), "tools"),
                                   tokenizer)
        assert not other.consume_tokens(tokenizer.encode("Hi " + trigger, add_special=False)), family

