"""Every request field llama-server reads is honoured here or refused with a 400 naming it, never
accepted and ignored; and the token-counting endpoints, the /responses alias and the public model
list.

LLAMA_SERVER_FIELDS is llama-server's list, written out as data: the completion schema of
tools/server/server-schema.cpp (make_llama_cmpl_schema), the OpenAI parsers of
tools/server/server-common.cpp (oaicompat_completion_params_parse, oaicompat_chat_params_parse)
and tools/server/server-chat.cpp's Responses conversion. Each entry is a request that uses the field
and either a check of what the field does (HONOURED) or the 400 it gets (REFUSED). A field that is
accepted but has no effect fails its check; one that llama-server reads but that is missing here
fails test_every_llama_server_field_is_listed.
"""
from __future__ import annotations

import json
from typing import Any, Callable

import pytest

from pyllama.server.chat import ChatTemplate
from pyllama.server.params import CHAT_ONLY_FIELDS, UNHONOURED_FIELDS
from test_llama_server_api import GREEDY, PROMPT, InProcessServer

# llama-server's request fields, by the function that reads them.
LLAMA_SERVER_FIELDS = {
    # server-schema.cpp, make_llama_cmpl_schema (every completion endpoint)
    "make_llama_cmpl_schema": [
        "verbose", "timings_per_token", "stream", "stream_options", "cache_prompt", "return_tokens",
        "return_progress", "sse_ping_interval", "n_predict", "max_completion_tokens", "max_tokens", "n_indent",
        "n_keep", "n_discard", "n_cmpl", "n", "n_cache_reuse", "t_max_predict_ms", "response_fields", "top_k",
        "top_p", "min_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "typical_p", "temperature",
        "dynatemp_range", "dynatemp_exponent", "repeat_last_n", "repeat_penalty", "frequency_penalty",
        "presence_penalty", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "mirostat",
        "mirostat_tau", "mirostat_eta", "adaptive_target", "adaptive_decay", "seed", "n_probs", "logprobs",
        "min_keep", "backend_sampling", "post_sampling_probs", "lora", "dry_sequence_breakers", "json_schema",
        "grammar", "grammar_lazy", "chat_format", "reasoning_format", "generation_prompt", "parse_tool_calls",
        "chat_parser", "continue_final_message", "echo", "preserved_tokens", "grammar_triggers",
        "reasoning_control", "reasoning_budget_tokens", "reasoning_budget_start_tag", "reasoning_budget_end_tags",
        "reasoning_budget_end_tag", "reasoning_budget_message", "logit_bias", "ignore_eos", "stop", "samplers",
        # disabled (#if 0) in that build, read by earlier ones
        "speculative.n_max", "speculative.n_min", "speculative.p_min", "speculative.type",
        "speculative.ngram_size_n", "speculative.ngram_size_m", "speculative.ngram_min_hits",
        # a TODO there, read by earlier builds
        "t_max_prompt_ms",
    ],
    # server-context.cpp, handle_completions_impl
    "handle_completions_impl": ["prompt", "id_slot", "message_delimiters"],
    # server-common.cpp, oaicompat_completion_params_parse (/v1/completions)
    "oaicompat_completion_params_parse": ["best_of", "suffix"],
    # server-common.cpp, oaicompat_chat_params_parse (/v1/chat/completions)
    "oaicompat_chat_params_parse": [
        "messages", "tools", "tool_choice", "response_format", "parallel_tool_calls", "add_generation_prompt",
        "chat_template_kwargs", "reasoning_effort", "thinking_budget_tokens", "top_logprobs", "grammar_type",
    ],
    # server-chat.cpp, server_chat_convert_responses_to_chatcmpl (/v1/responses)
    "server_chat_convert_responses_to_chatcmpl": ["input", "instructions", "max_output_tokens", "reasoning"],
}

MSGS = [{"role": "user", "content": "Hi"}]
CHAT = {"messages": MSGS, "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def _settings_echo(name: str, value: Any) -> Callable:
    """The request's value is what it ran with (its generation_settings)."""
    def check(srv, doc):
        assert doc["generation_settings"][name] == value, (name, doc["generation_settings"].get(name))
    return check


def _ok(srv, doc):
    """Accepted: the effect is checked by the test named beside the entry, or the value asks for
    nothing (the refused values are in REFUSED)."""


# Honoured fields: (endpoint, the body's fields, a check of the result). Each check looks for the
# field's effect where a tiny random model shows one; a sampler's effect is its settings echo.
Check = Callable[[Any, Any], None]
HONOURED: dict[str, tuple[str, dict, Check]] = {}


def honoured(name: str, path: str = "/completion", check: Check = _ok, **fields: Any) -> None:
    HONOURED[name] = (path, fields or {name: None}, check)


def _verbose(srv, doc):
    assert "__verbose" in doc


def _tokens(n: int) -> Check:
    def check(srv, doc):
        assert doc["tokens_predicted"] == n
    return check


honoured("verbose", check=_verbose, verbose=True)
honoured("return_tokens", check=lambda s, d: len(d["tokens"]) == 6 or pytest.fail("no tokens"), return_tokens=True)
honoured("n_predict", check=_tokens(3), n_predict=3)
honoured("max_tokens", check=_tokens(2), max_tokens=2)
honoured("max_completion_tokens", check=_tokens(1), max_completion_tokens=1)
honoured("n_keep", check=_settings_echo("n_keep", 3), n_keep=3)
honoured("n_discard", check=_settings_echo("n_discard", 5), n_discard=5)  # its effect: test_context_shift
honoured("n_cmpl", check=lambda s, d: len(d) == 2 or pytest.fail("not two results"), n_cmpl=2)
honoured("n", check=lambda s, d: len(d) == 2 or pytest.fail("not two results"), n=2)
honoured("response_fields", check=lambda s, d: set(d) == {"content"} or pytest.fail(str(d)),
         response_fields=["content"])
for _name, _value in (("top_k", 5), ("top_p", 0.5), ("min_p", 0.2), ("top_n_sigma", 1.5), ("xtc_probability", 0.3),
                      ("xtc_threshold", 0.2), ("typical_p", 0.7), ("temperature", 0.5), ("dynatemp_range", 0.1),
                      ("dynatemp_exponent", 1.5), ("repeat_last_n", 32), ("repeat_penalty", 1.2),
                      ("frequency_penalty", 0.1), ("presence_penalty", 0.1), ("dry_multiplier", 0.5),
                      ("dry_base", 1.5), ("dry_allowed_length", 3), ("dry_penalty_last_n", 16), ("mirostat", 2),
                      ("mirostat_tau", 4.0), ("mirostat_eta", 0.2), ("seed", 42), ("min_keep", 2),
                      ("dry_sequence_breakers", ["\n", "x"]), ("samplers", ["top_k", "temperature"]),
                      ("ignore_eos", True), ("t_max_predict_ms", 60000), ("n_indent", 4)):
    honoured(_name, check=_settings_echo(_name, _value), **{_name: _value})
honoured("n_probs", check=lambda s, d: len(d["completion_probabilities"][0]["top_logprobs"]) == 3
         or pytest.fail("no probabilities"), n_probs=3)
honoured("post_sampling_probs", check=lambda s, d: "prob" in d["completion_probabilities"][0]
         or pytest.fail("not post-sampling"), n_probs=2, post_sampling_probs=True)
honoured("logprobs", "/v1/completions", check=lambda s, d: d["choices"][0]["logprobs"] is not None
         or pytest.fail("no logprobs"), logprobs=2)
honoured("top_logprobs", "/v1/chat/completions", check=lambda s, d: len(
    d["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 4 or pytest.fail("not 4"),
    logprobs=True, top_logprobs=4)
def _stop(srv, doc):
    word = doc["content"][2:4]  # stops where the unstopped text had it
    _, again = srv.post("/completion", {"prompt": PROMPT, **GREEDY, "stop": [word]})
    assert again["stop_type"] == "word" and again["stopping_word"] == word and again["content"] == doc["content"][:2]


honoured("stop", check=_stop, stop=["\x00never"])
honoured("grammar", check=lambda s, d: d["content"] == "aaa" or pytest.fail(d["content"]),
         grammar='root ::= "aaa"', ignore_eos=False, n_predict=20)
honoured("json_schema", check=lambda s, d: json.loads(d["content"]) in (True, False) or pytest.fail(d["content"]),
         json_schema={"type": "boolean"}, ignore_eos=False, n_predict=20)
honoured("response_format", "/v1/chat/completions",
         check=lambda s, d: json.loads(d["choices"][0]["message"]["content"]) in (True, False),
         response_format={"type": "json_schema", "json_schema": {"schema": {"type": "boolean"}}}, ignore_eos=False,
         max_tokens=20)
honoured("id_slot", check=lambda s, d: d["id_slot"] == 1 or pytest.fail(str(d["id_slot"])), id_slot=1)
honoured("cache_prompt", check=lambda s, d: d["timings"]["cache_n"] == 0 or pytest.fail("cached"),
         cache_prompt=False)
def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ") and line[6:] != "[DONE]"]


honoured("timings_per_token", check=lambda s, d: all("timings" in e for e in _events(d)[:3]),
         stream=True, timings_per_token=True)
honoured("return_progress", check=lambda s, d: any("prompt_progress" in e for e in _events(d)),
         stream=True, return_progress=True)
honoured("stream", check=lambda s, d: _events(d)[-1]["stop"] is True, stream=True)
honoured("stream_options", "/v1/chat/completions",
         check=lambda s, d: _events(d)[-1]["choices"] == [] and _events(d)[-1]["usage"]["completion_tokens"] == 4,
         stream=True, stream_options={"include_usage": True})
honoured("sse_ping_interval", check=_ok, sse_ping_interval=5)     # its effect: test_http's ping tests
honoured("logit_bias", check=lambda s, d: d["generation_settings"]["logit_bias"] == [{"bias": 5.0, "token": 7}],
         logit_bias=[[7, 5.0]])
honoured("backend_sampling", check=_ok, backend_sampling=False)   # what this CPU server does; true: a 400
honoured("lora", check=_ok, lora=[])                              # no adapter: nothing to apply
honoured("echo", "/v1/completions", check=_ok, echo=False)        # true: a 400
# a lazy grammar whose trigger never fires leaves the output free (the same grammar not lazy forces "zz");
# the triggers' kinds and their errors: test_lazy_grammar
LAZY = {"grammar": 'root ::= "zz"', "grammar_lazy": True, "grammar_triggers": [{"type": 1, "value": "\u2603 never"}]}
honoured("grammar_lazy", check=lambda s, d: d["content"] != "zz" or pytest.fail(d["content"]), **LAZY)
honoured("grammar_triggers", check=lambda s, d: d["content"] != "zz" or pytest.fail(d["content"]), **LAZY)
honoured("preserved_tokens", check=_ok, **{**LAZY, "preserved_tokens": ["zz"]})   # one-token words: test_lazy_grammar
honoured("adaptive_target", check=_ok, adaptive_target=-1.0)      # the sampler off; on: a 400
honoured("speculative.n_max", check=_ok, **{"speculative.n_max": 4})  # no draft model: nothing to cap
honoured("speculative.n_min", check=_ok, **{"speculative.n_min": 1})
honoured("prompt", check=lambda s, d: d["prompt"] == PROMPT, prompt=PROMPT)
honoured("messages", "/v1/chat/completions", check=lambda s, d: d["usage"]["prompt_tokens"] > 0, messages=MSGS)
honoured("tools", "/v1/chat/completions", check=_ok, tools=[])    # tool calls: test_tool_calls
honoured("tool_choice", "/v1/chat/completions", check=_ok, tool_choice="none")
honoured("parallel_tool_calls", "/v1/chat/completions", check=_ok, parallel_tool_calls=False)
honoured("add_generation_prompt", "/apply-template",
         check=lambda s, d: not d["prompt"].endswith("assistant\n") or pytest.fail(d["prompt"]),
         add_generation_prompt=False)
honoured("continue_final_message", "/v1/chat/completions",
         check=lambda s, d: d["choices"][0]["message"]["content"].startswith("Once"),
         messages=MSGS + [{"role": "assistant", "content": "Once"}], continue_final_message=True,
         add_generation_prompt=False)
def _with_template(field: str, value: Any, expected: str) -> Check:
    """The field, given to a template that shows the variables it may set, renders `expected`
    (enable_thinking is false there: the template does not think)."""
    def check(srv, doc):
        tpl = ChatTemplate("{{ greeting | default('-') }} {{ reasoning_effort | default('-') }} "
                           "{{ enable_thinking | default('-') }}")
        with srv.settings(chat=tpl):
            status, out = srv.post("/apply-template", {"messages": MSGS, field: value})
        assert status == 200 and out["prompt"] == expected, out
    return check


honoured("chat_template_kwargs", "/v1/chat/completions", check=_with_template(
    "chat_template_kwargs", {"greeting": "hello"}, "hello - False"), chat_template_kwargs={"greeting": "hello"})
honoured("reasoning_format", "/v1/chat/completions", check=_ok, reasoning_format="none")  # test_reasoning
# (and test_chat's test_reasoning_effort_reaches_a_template_that_reads_it)
honoured("reasoning_effort", "/v1/chat/completions", check=_with_template("reasoning_effort", "high", "- high False"),
         reasoning_effort="none")
honoured("thinking_budget_tokens", "/v1/chat/completions", check=_ok, thinking_budget_tokens=5)  # test_thinking_budget
honoured("reasoning_budget_tokens", "/v1/chat/completions", check=_ok, reasoning_budget_tokens=5)
honoured("reasoning_budget_message", "/v1/chat/completions", check=_ok, reasoning_budget_message="enough")
honoured("input", "/v1/responses", check=lambda s, d: d["object"] == "response", input="Hi")
honoured("instructions", "/v1/responses", check=lambda s, d: d["instructions"] == "Be brief", input="Hi",
         instructions="Be brief")
honoured("max_output_tokens", "/v1/responses", check=lambda s, d: d["usage"]["output_tokens"] == 2, input="Hi",
         max_output_tokens=2)
honoured("reasoning", "/v1/responses", check=_ok, input="Hi", reasoning={"effort": "none"})

# Refused fields: the body that uses them (on /completion unless a path is given).
REFUSED: dict[str, tuple[str, dict]] = {
    "t_max_prompt_ms": ("/completion", {"t_max_prompt_ms": 100}),
    "grammar_type": ("/completion", {"grammar_type": "tool_calls"}),
    "chat_format": ("/completion", {"chat_format": 1}),
    "chat_parser": ("/completion", {"chat_parser": "x"}),
    "generation_prompt": ("/completion", {"generation_prompt": "<think>"}),
    "message_delimiters": ("/completion", {"message_delimiters": []}),
    "parse_tool_calls": ("/v1/chat/completions", {"parse_tool_calls": True}),
    "reasoning_budget_start_tag": ("/completion", {"reasoning_budget_start_tag": "<think>"}),
    "reasoning_budget_end_tags": ("/completion", {"reasoning_budget_end_tags": ["</think>"]}),
    "reasoning_budget_end_tag": ("/completion", {"reasoning_budget_end_tag": "</think>"}),
    "reasoning_control": ("/v1/chat/completions", {"reasoning_control": True}),
    "n_cache_reuse": ("/completion", {"n_cache_reuse": 256}),
    "adaptive_target": ("/completion", {"adaptive_target": 0.5}),
    "adaptive_decay": ("/completion", {"adaptive_decay": 0.5}),
    "speculative.p_min": ("/completion", {"speculative.p_min": 0.5}),
    "speculative.type": ("/completion", {"speculative.type": "ngram-simple"}),
    "speculative.ngram_size_n": ("/completion", {"speculative.ngram_size_n": 3}),
    "speculative.ngram_size_m": ("/completion", {"speculative.ngram_size_m": 3}),
    "speculative.ngram_min_hits": ("/completion", {"speculative.ngram_min_hits": 2}),
    "echo": ("/v1/completions", {"echo": True}),
    "best_of": ("/v1/completions", {"best_of": 2}),
    "suffix": ("/v1/completions", {"suffix": "end"}),
    "backend_sampling": ("/completion", {"backend_sampling": True}),
    "top_logprobs": ("/v1/chat/completions", {"top_logprobs": 3}),  # without logprobs, as llama-server
    "reasoning_effort": ("/v1/chat/completions", {"reasoning_effort": "high"}),  # a template without levels
    # chat-only fields on the text endpoints
    "reasoning_format": ("/completion", {"reasoning_format": "none"}),
    "thinking_budget_tokens": ("/completion", {"thinking_budget_tokens": 5}),
    "reasoning_budget_tokens": ("/v1/completions", {"reasoning_budget_tokens": 5}),
    "reasoning_budget_message": ("/infill", {"reasoning_budget_message": "x", "input_prefix": "a",
                                             "input_suffix": "b"}),
    "chat_template_kwargs": ("/completion", {"chat_template_kwargs": {"x": 1}}),
    "tools": ("/completion", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
}


def _body(path: str, fields: dict) -> dict:
    if path == "/v1/responses":
        return {"max_output_tokens": 4, "temperature": 0, **fields}
    if path in ("/v1/chat/completions", "/apply-template"):
        return {**CHAT, **fields}
    if path == "/infill":
        return {**GREEDY, **fields}
    return {"prompt": PROMPT, **GREEDY, **fields}


@pytest.fixture(scope="module")
def srv(tiny_model):
    s = InProcessServer(tiny_model)
    try:
        yield s
    finally:
        s.close()


def test_every_llama_server_field_is_listed():
    fields = {f for group in LLAMA_SERVER_FIELDS.values() for f in group}
    unlisted = sorted(f for f in fields if f not in HONOURED and f not in REFUSED)
    assert not unlisted, f"llama-server fields neither honoured nor refused here: {unlisted}"
    # the server's own tables name only fields that are refused somewhere here
    assert set(UNHONOURED_FIELDS) <= set(REFUSED), sorted(set(UNHONOURED_FIELDS) - set(REFUSED))
    assert set(CHAT_ONLY_FIELDS) <= fields


@pytest.mark.parametrize("name", sorted(HONOURED))
def test_honoured_field_has_its_effect(srv, name):
    path, fields, check = HONOURED[name]
    status, doc = srv.post(path, _body(path, fields))
    assert status == 200, (name, doc)
    assert check(srv, doc) is not False, (name, doc)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_field_is_a_400_naming_it(srv, name):
    path, fields = REFUSED[name]
    status, doc = srv.post(path, _body(path, fields))
    assert status == 400, (name, status, doc)
    assert doc["error"]["type"] == "invalid_request_error" and f"'{name}'" in doc["error"]["message"], doc
    assert set(doc) == {"error"} and doc["error"]["code"] == 400


# --- the fields implemented for this ----------------------------------------------------------------

LINES = 'root ::= "x" ("\\n" "y"){150}'  # newline after newline, longer than the generation


def test_t_max_predict_ms_ends_at_a_newline_once_the_time_is_up(srv):
    body = {"prompt": PROMPT, "grammar": LINES, "n_predict": 200, "temperature": 0, "return_tokens": True}
    _, free = srv.post("/completion", body)
    assert free["tokens_predicted"] == 200 and free["stop_type"] == "limit"
    _, timed = srv.post("/completion", {**body, "t_max_predict_ms": 1})
    assert timed["stop_type"] == "limit" and timed["stop"] is True
    assert timed["tokens_predicted"] < 200 and timed["content"].endswith("\n"), timed["content"]
    assert timed["timings"]["predicted_ms"] > 1 and timed["generation_settings"]["t_max_predict_ms"] == 1
    # streamed: the same end
    events = srv.stream("/completion", {**body, "t_max_predict_ms": 1})
    assert events[-1]["stop_type"] == "limit" and "".join(e["content"] for e in events).endswith("\n")


def test_n_indent_ends_at_a_line_indented_less(srv):
    # the first line continues the prompt's; the next two are indented by 4 and 2
    body = {"prompt": PROMPT, "grammar": 'root ::= "a\\n    b\\n  c\\nd"', "n_predict": 40, "temperature": 0}
    _, free = srv.post("/completion", body)
    assert free["content"] == "a\n    b\n  c\nd"
    _, four = srv.post("/completion", {**body, "n_indent": 4})
    assert four["content"] == "a\n    b\n  " and four["stop_type"] == "limit", four  # the short line's indentation stays
    _, two = srv.post("/completion", {**body, "n_indent": 2})
    assert two["content"] == "a\n    b\n  c\n" and two["stop_type"] == "limit", two
    events = srv.stream("/completion", {**body, "n_indent": 4})
    assert "".join(e["content"] for e in events) == "a\n    b\n  "
    status, doc = srv.post("/completion", {**body, "n_indent": -1})
    assert status == 400 and "'n_indent'" in doc["error"]["message"]


def test_chat_logprobs_without_top_logprobs_gives_llama_servers_20(srv):
    _, doc = srv.post("/v1/chat/completions", {**CHAT, "logprobs": True})
    content = doc["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(t["top_logprobs"]) == 20 for t in content), content[0]
    _, doc = srv.post("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3})
    assert all(len(t["top_logprobs"]) == 3 for t in doc["choices"][0]["logprobs"]["content"])


def test_logprobs_is_n_probs_other_name_on_completion(srv):
    _, doc = srv.post("/completion", {"prompt": PROMPT, **GREEDY, "logprobs": 2})
    assert len(doc["completion_probabilities"]) == 6 and len(doc["completion_probabilities"][0]["top_logprobs"]) == 2
    _, doc = srv.post("/completion", {"prompt": PROMPT, **GREEDY, "logprobs": 2, "n_probs": 3})
    assert len(doc["completion_probabilities"][0]["top_logprobs"]) == 3  # n_probs wins
    status, doc = srv.post("/completion", {"prompt": PROMPT, **GREEDY, "logprobs": True})
    assert status == 400 and "'logprobs' must be an integer" in doc["error"]["message"]


def test_responses_pass_llama_server_fields_to_the_chat_path(srv):
    body = {"input": "Hi", "max_output_tokens": 4, "temperature": 0}
    status, doc = srv.post("/v1/responses", {**body, "lora": [{"id": 0, "scale": 1.0}]})
    assert status == 400 and "invalid adapter id 0" in doc["error"]["message"]  # (no adapter loaded)
    _, forced = srv.post("/v1/responses", {**body, "max_output_tokens": 10, "grammar": 'root ::= "zz"'})
    assert forced["output"][-1]["content"][0]["text"] == "zz", forced["output"]


def test_verbose_per_request(srv):
    _, doc = srv.post("/completion", {"prompt": PROMPT, **GREEDY, "verbose": True})
    assert doc["__verbose"]["tokens_predicted"] == 6
    _, chat = srv.post("/v1/chat/completions", {**CHAT, "verbose": True})
    assert "__verbose" in chat
    _, reply = srv.post("/v1/responses", {"input": "Hi", "max_output_tokens": 3, "verbose": True})
    assert reply["__verbose"]["tokens_predicted"] == 3 and "__verbose" not in reply["__verbose"]
    with srv.settings(verbose=True):
        assert "__verbose" not in srv.post("/completion", {"prompt": PROMPT, **GREEDY, "verbose": False})[1]


# --- endpoints ---------------------------------------------------------------------------------------

def test_chat_input_tokens(srv):
    _, reply = srv.post("/v1/chat/completions", CHAT)
    for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
        status, doc = srv.post(path, {"messages": MSGS})
        assert status == 200 and doc == {"object": "response.input_tokens",
                                         "input_tokens": reply["usage"]["prompt_tokens"]}, doc
    status, doc = srv.post("/v1/chat/completions/input_tokens", {"messages": "nope"})
    assert status == 400


def test_responses_input_tokens_and_alias(srv):
    body = {"input": "Hi", "instructions": "Be brief", "max_output_tokens": 3, "temperature": 0}
    _, reply = srv.post("/v1/responses", body)
    status, alias = srv.post("/responses", body)
    assert status == 200 and alias["object"] == "response"
    text = [[c["text"] for c in item["content"]] for item in reply["output"] if item["type"] == "message"]
    assert [[c["text"] for c in item["content"]] for item in alias["output"] if item["type"] == "message"] == text
    assert [alias["usage"][k] for k in ("input_tokens", "output_tokens")] == \
        [reply["usage"][k] for k in ("input_tokens", "output_tokens")]
    for path in ("/v1/responses/input_tokens", "/responses/input_tokens"):
        status, doc = srv.post(path, {"input": "Hi", "instructions": "Be brief"})
        assert status == 200 and doc == {"object": "response.input_tokens",
                                         "input_tokens": reply["usage"]["input_tokens"]}, doc
    status, doc = srv.post("/v1/responses/input_tokens", {})
    assert status == 400 and "'input'" in doc["error"]["message"]


def test_models_are_public_with_an_api_key(srv):
    with srv.settings(api_keys=["secret"]):
        assert srv.post("/v1/chat/completions/input_tokens", {"messages": MSGS})[0] == 401
        for path in ("/v1/models", "/models"):
            status, doc = srv.get(path)
            assert status == 200 and doc["object"] == "list", path
