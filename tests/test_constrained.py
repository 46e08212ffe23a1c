"""Constrained decoding: `grammar` (GBNF), `json_schema`, `response_format` and the command line's
--grammar / --json-schema, on the random-weight test model. Outputs are checked against
independent references: the literal text a grammar forces, `json.loads`, and `jsonschema`.

A random-weight model samples almost uniformly among the tokens a grammar allows, so a free JSON
string would only close after hundreds of tokens. The schemas here bound every value, and the
JSON-mode requests raise the closing characters with a logit bias (which cannot let a disallowed
token through: the mask makes it -inf first), so that outputs end well within max_tokens.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import pytest

from pyllama.batching.constraint import ConstraintSpec, compile_constraint
from pyllama.server.http import HTTPError
from pyllama.server.params import parse_completion
from server_util import RPCServerProcess, ServerProcess, pid_alive

N_SEEDS = 100
A5 = 'root ::= "a"{5}'
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": -5, "maximum": 99},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tag": {"type": "string", "maxLength": 3},
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "required": ["n", "ok", "color", "tag", "xs"],
    "additionalProperties": False,
}
MAX_TOKENS = 400  # far more than any output of SCHEMA takes (about 60 tokens on average)


def post_all(srv: ServerProcess, path: str, bodies: list[dict]) -> list[dict]:
    """Sends the bodies as concurrent requests; every one must succeed."""
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda b: srv.post(path, b, timeout=300), bodies))
    for status, doc in results:
        assert status == 200, doc
    return [doc for _, doc in results]


def closing_bias(srv: ServerProcess) -> dict:
    """OpenAI logit_bias raising the tokens of '"', '}' and ']' (ids read from the server)."""
    bias = {}
    for ch in '"}]':
        status, doc = srv.post("/tokenize", {"content": ch})
        assert status == 200 and len(doc["tokens"]) == 1, doc
        bias[str(doc["tokens"][0])] = 8
    return bias


def check_grammar_and_schema(srv: ServerProcess) -> None:
    """Three checks of a constrained completion over N_SEEDS seeds, each seed a concurrent request."""
    seeds = range(N_SEEDS)
    for grammar in (A5, 'root ::= "a" "a" "a" "a" "a"'):
        docs = post_all(srv, "/completion", [{"prompt": "Once upon a time", "grammar": grammar, "seed": s,
                                              "n_predict": 20} for s in seeds])
        for doc in docs:
            assert doc["content"] == "aaaaa" and doc["stop_type"] == "eos", doc
            assert doc["tokens_predicted"] == 5
    bias = closing_bias(srv)
    docs = post_all(srv, "/v1/chat/completions", [
        {"messages": [{"role": "user", "content": "Give me JSON"}], "response_format": {"type": "json_object"},
         "seed": s, "max_tokens": MAX_TOKENS, "logit_bias": bias} for s in seeds])
    for doc in docs:
        choice = doc["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert isinstance(json.loads(choice["message"]["content"]), dict), choice
    docs = post_all(srv, "/completion", [{"prompt": "{", "json_schema": SCHEMA, "seed": s, "n_predict": MAX_TOKENS}
                                         for s in seeds])
    outputs = set()
    for doc in docs:
        assert doc["stop_type"] == "eos", doc
        jsonschema.validate(json.loads(doc["content"]), SCHEMA)
        outputs.add(doc["content"])
    assert len(outputs) > N_SEEDS // 2  # the seeds really sampled different outputs


@pytest.fixture(scope="module")
def srv(tiny_model):
    s = ServerProcess(tiny_model, "-np", "16", "-c", "8192").wait_ready()
    yield s
    assert s.stop() == 0


# --- those checks, on one group, two pipeline groups, and with backend sampling over rpc ----
def test_grammar_json_mode_and_schema_for_100_seeds(srv):
    check_grammar_and_schema(srv)


def test_two_pipeline_groups(tiny_model):
    s = ServerProcess(tiny_model, "-np", "16", "-c", "8192", "--pipeline-groups", "2").wait_ready()
    try:
        check_grammar_and_schema(s)
    finally:
        assert s.stop() == 0


def test_backend_sampling_over_rpc(tiny_model, tmp_path):
    """The output layer is on the peer and samples there; a step with a constrained row takes the
    logits back and samples here, and an unconstrained step still samples on the peer."""
    peer = RPCServerProcess()
    trace_path = tmp_path / "trace.jsonl"
    try:
        s = ServerProcess(tiny_model, "-np", "16", "-c", "8192", "--rpc", peer.endpoint, "--device", "CPU,RPC0",
                          "--backend-sampling", "--trace", str(trace_path)).wait_ready()
        try:
            check_grammar_and_schema(s)
            status, doc = s.post("/completion", {"prompt": "Once", "n_predict": 4, "ignore_eos": True})
            assert status == 200, doc
        finally:
            assert s.stop() == 0
    finally:
        peer.stop()
    events = [json.loads(x) for x in trace_path.read_text().splitlines()[1:]]
    reads = [e["subj"] for e in events if e["c"] == "rpc.client" and e["n"].startswith("GET_TENSOR")]
    assert any("result_output" in r for r in reads), "constrained rows did not take the logits back"
    assert any("result_sampled" in r for r in reads), "unconstrained rows no longer sample on the peer"


# --- errors: a 400 naming the field, before any work ------------------------------------------------
@pytest.mark.parametrize("path, body, named", [
    ("/completion", {"prompt": "x", "grammar": "root ::= foo"}, "'grammar'"),
    ("/completion", {"prompt": "x", "grammar": 'root ::= "a'}, "'grammar'"),
    ("/completion", {"prompt": "x", "grammar": 5}, "'grammar'"),
    ("/completion", {"prompt": "x", "json_schema": {"type": "objekt"}}, "'json_schema'"),
    ("/completion", {"prompt": "x", "json_schema": "not a schema"}, "'json_schema'"),
    ("/completion", {"prompt": "x", "json_schema": {"type": "string", "format": "no-such-format"}}, "'json_schema'"),
    ("/completion", {"prompt": "x", "grammar": A5, "json_schema": {}}, "'grammar' and 'json_schema'"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "xml"}}, "'response_format.type'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "'response_format.type'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {}},
     "'response_format.type'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": "json"},
     "'response_format'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"},],
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "t", "schema": {"type": "numbr"}}}},
     "'response_format.json_schema.schema'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "grammar": A5,
                              "response_format": {"type": "json_object"}}, "'grammar' and 'response_format'"),
])
def test_invalid_constraint_is_a_400_naming_it(srv, path, body, named):
    status, doc = srv.post(path, body)
    assert status == 400, doc
    assert doc["error"]["message"].startswith(named) and doc["error"]["type"] == "invalid_request_error", doc
    status, slots = srv.request("GET", "/slots")
    assert status == 200 and not any(s["is_processing"] for s in slots)


def test_compile_errors_name_the_field_given(tiny_model):
    from pyllama.runtime.engine import Engine
    tok = Engine(tiny_model, n_threads=1).tokenizer
    with pytest.raises(HTTPError) as exc:
        compile_constraint(ConstraintSpec("lark", "start: %json {\"type\": \"nope\"}", "tools"), tok)
    assert exc.value.status == 400 and exc.value.message.startswith("'tools': invalid grammar")
    # a Lark grammar embedding a schema compiles, and each call gives a matcher of its own
    spec = ConstraintSpec("lark", 'start: "call " %json {"type": "integer"}')
    a, b = compile_constraint(spec, tok), compile_constraint(spec, tok)
    assert a is not b
    assert a.consume_tokens(tok.encode("call 1", add_special=False)) and b.try_consume_tokens([]) == 0


def test_response_format_forms():
    def spec(body):
        return parse_completion(body, -1, 4, oai=True).constraint
    assert spec({"response_format": {"type": "text"}}) is None
    assert spec({"response_format": {"type": "json_object"}}) == ConstraintSpec("json_object", "", "response_format")
    s = spec({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                          "schema": {"type": "integer"}}}})
    assert s.kind == "json_schema" and json.loads(s.text) == {"type": "integer"}
    s = spec({"response_format": {"type": "json_object", "schema": {"type": "string"}}})  # llama-server's form
    assert s.kind == "json_schema" and json.loads(s.text) == {"type": "string"}
    s = spec({"response_format": {"type": "json_schema", "schema": {"type": "boolean"}}})  # its README's form
    assert json.loads(s.text) == {"type": "boolean"}
    assert spec({"grammar": ""}) is None  # llama-server: an empty grammar is none


# --- the rest: choices, streams, schema on the OpenAI endpoints, the command line -------------------
def test_every_choice_follows_the_grammar(srv):
    status, doc = srv.post("/v1/completions", {"prompt": "x", "n": 3, "grammar": 'root ::= ("x" | "y"){4}',
                                               "max_tokens": 10})
    assert status == 200, doc
    assert len(doc["choices"]) == 3
    for c in doc["choices"]:
        assert re.fullmatch("[xy]{4}", c["text"]) and c["finish_reason"] == "stop", c


def test_stream(srv):
    events = srv.stream("/completion", {"prompt": "Once", "grammar": A5, "n_predict": 20, "seed": 3})
    assert "".join(e["content"] for e in events) == "aaaaa"
    assert events[-1]["stop"] and events[-1]["stop_type"] == "eos"
    events = srv.stream("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": MAX_TOKENS, "seed": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}})
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_schema_on_v1_completions_and_unconstrained_control(srv):
    bias = closing_bias(srv)
    constrained = post_all(srv, "/v1/completions", [
        {"prompt": "{", "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
         "seed": s, "max_tokens": MAX_TOKENS} for s in range(10)])
    for doc in constrained:
        jsonschema.validate(json.loads(doc["choices"][0]["text"]), SCHEMA)
    # the same model without a constraint does not write JSON: the checks above are not vacuous
    free = post_all(srv, "/v1/completions", [{"prompt": "{", "seed": s, "max_tokens": 40, "logit_bias": bias}
                                             for s in range(10)])
    parsed = 0
    for doc in free:
        try:
            json.loads(doc["choices"][0]["text"])
            parsed += 1
        except ValueError:
            pass
    assert parsed <= 1


def test_seeded_constrained_output_is_reproducible(srv):
    body = {"prompt": "{", "json_schema": SCHEMA, "seed": 42, "n_predict": MAX_TOKENS, "cache_prompt": False}
    first = srv.post("/completion", body)[1]["content"]
    assert srv.post("/completion", body)[1]["content"] == first


def test_command_line_default_grammar(tiny_model, tmp_path):
    gfile = tmp_path / "b3.gbnf"
    gfile.write_text('root ::= "b"{3}\n')
    s = ServerProcess(tiny_model, "-np", "2", "--grammar-file", str(gfile)).wait_ready()
    try:
        status, doc = s.post("/completion", {"prompt": "hello", "n_predict": 10})
        assert status == 200 and doc["content"] == "bbb", doc
        status, doc = s.post("/completion", {"prompt": "hello", "n_predict": 10, "grammar": A5})
        assert status == 200 and doc["content"] == "aaaaa", doc  # a request's own grammar wins
        status, props = s.request("GET", "/props")
        assert status == 200 and props["default_generation_settings"]["params"]["grammar"] == 'root ::= "b"{3}\n'
    finally:
        assert s.stop() == 0
    s = ServerProcess(tiny_model, "-np", "2", "-j", json.dumps({"enum": ["yes", "no"]})).wait_ready()
    try:
        status, doc = s.post("/completion", {"prompt": "hello", "n_predict": 10})
        assert status == 200 and json.loads(doc["content"]) in ("yes", "no"), doc
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("flags, message", [
    (["--grammar", "root ::= undefined-rule"], "--grammar: invalid grammar"),
    (["-j", '{"type": "strng"}'], "--json-schema: invalid JSON schema"),
    (["-j", "{"], "--json-schema: not JSON"),
    (["-jf", "/no/such/file.json"], "--json-schema-file /no/such/file.json: cannot read it"),
    (["--grammar", A5, "-j", "{}"], "--grammar and --json-schema cannot be used together"),
])
def test_bad_command_line_grammar_is_one_error_at_start(tiny_model, flags, message):
    proc = subprocess.run([sys.executable, "-m", "pyllama.server", "-m", tiny_model, "--port", "0", *flags],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), proc.stderr


def test_preempted_constrained_requests_keep_their_grammar_state(tiny_model):
    """A full KV pool preempts and recomputes requests: the matcher must see each generated token
    once, so outputs sent together equal those sent one at a time, and follow the grammar."""
    grammar = 'root ::= [a-z ]{150}'
    s = ServerProcess(tiny_model, "--metrics", "-c", "256", "-np", "4", "--kv-unified").wait_ready()
    try:
        bodies = [{"prompt": p, "grammar": grammar, "n_predict": 200, "temperature": 0}
                  for p in ("The little cat sat on the", "Once upon a time", "In a hole in the ground", "1, 2, 3,")]
        alone = [s.post("/completion", b)[1]["content"] for b in bodies]
        together = [d["content"] for d in post_all(s, "/completion", bodies)]
        status, text = s.request("GET", "/metrics")
        m = re.search(r"^llamacpp:n_preemptions_total (\d+)$", text, re.M)
        assert m and int(m.group(1)) > 0, "the pool did not run out: nothing was tested"
    finally:
        assert s.stop() == 0
    assert together == alone
    for t in alone:
        assert re.fullmatch("[a-z ]{150}", t), t


# --- the mask kernel against numpy ------------------------------------------------------------------
@pytest.mark.parametrize("n_vocab", [32000, 1000, 37])
def test_mask_kernel_equals_numpy(n_vocab):
    import numpy as np
    from pyllama._fast.masks import apply_bitmasks
    rng = np.random.default_rng(n_vocab)
    words = (n_vocab + 31) // 32
    masks = rng.integers(0, 2**32, size=(4, words), dtype=np.uint64).astype(np.uint32)
    masks[1] = 0xFFFFFFFF           # all allowed
    masks[2] = 0                    # none allowed...
    masks[2, words // 2] = 1 << 2   # ...but one token
    masks[3, ::3] = 0               # whole words out, the others mixed
    logits = rng.standard_normal((6, n_vocab)).astype(np.float32)
    rows = np.array([4, 0, 5, 2], dtype=np.int32)  # any rows, in any order
    want = logits.copy()
    for k, r in enumerate(rows):
        allowed = np.unpackbits(masks[k].view(np.uint8), count=n_vocab, bitorder="little").astype(bool)
        want[r, ~allowed] = -np.inf
    got = logits.copy()
    apply_bitmasks(got, rows, masks)
    assert np.array_equal(got, want)
    assert np.isfinite(got[5, words // 2 * 32 + 2]) and np.isinf(got[5]).sum() == n_vocab - 1  # masks[2]
    assert np.array_equal(got[[1, 3]], logits[[1, 3]])  # rows without a mask are untouched
    with pytest.raises(ValueError):
        apply_bitmasks(got, np.array([6], dtype=np.int32), masks)


def test_a_mask_that_never_comes_fails_only_its_request(monkeypatch):
    """The decode thread waits for a mask at most MASK_TIMEOUT_S; then the constraint is failed
    (its request ends with an error naming why) and the matcher, which the worker may still
    hold, is not touched again."""
    import threading

    from pyllama.batching import constraint as cmod

    release = threading.Event()

    class StuckMatcher:
        consumed: list[int] = []

        def unsafe_compute_mask_ptr(self, ptr, nbytes):
            release.wait(5.0)

        def consume_token(self, token):
            self.consumed.append(token)
            return True

        def is_error(self):
            return False

        def is_stopped(self):
            return False

    monkeypatch.setattr(cmod, "MASK_TIMEOUT_S", 0.2)
    worker = cmod.MaskWorker("masks-test")
    c = cmod.Constraint(StuckMatcher(), 100)
    worker.request_mask([c])
    waited = c.take_mask()
    assert 0.15 < waited < 3.0
    assert "not ready within" in c.error
    assert c.consume(7) is False and StuckMatcher.consumed == []
    release.set()
    worker.close()


# A 40-byte grammar that compiles at once but forces a string of 4 million bytes: llguidance's
# first token mask walks it for seconds (a quarter as long at 1000, minutes at 5000).
PATHOLOGICAL = 'root ::= a{2000}\na ::= b{2000}\nb ::= "x"'


def test_pathological_grammar_fails_alone_while_json_mode_is_served(srv):
    """The grammar whose first mask would take seconds is a 400 saying so, sent at the same time
    as a JSON-mode request, which succeeds; the server then serves the same grammar's refusal
    again (from its memory of the failure) and an ordinary request."""
    bias = closing_bias(srv)
    innocent = {"messages": [{"role": "user", "content": "Give me JSON"}], "response_format": {"type": "json_object"},
                "seed": 1, "max_tokens": MAX_TOKENS, "logit_bias": bias}
    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(srv.post, "/completion", {"prompt": "x", "n_predict": 4, "grammar": PATHOLOGICAL},
                          timeout=300)
        good = pool.submit(srv.post, "/v1/chat/completions", innocent, timeout=300)
        (bad_status, bad_doc), (good_status, good_doc) = bad.result(), good.result()
    assert good_status == 200, good_doc
    assert isinstance(json.loads(good_doc["choices"][0]["message"]["content"]), dict), good_doc
    assert bad_status == 400, bad_doc
    assert "'grammar'" in bad_doc["error"]["message"] and "too complex" in bad_doc["error"]["message"], bad_doc
    status, doc = srv.post("/completion", {"prompt": "x", "n_predict": 4, "grammar": PATHOLOGICAL})
    assert status == 400 and "too complex" in doc["error"]["message"], doc
    status, doc = srv.post("/completion", {"prompt": "x", "n_predict": 8, "grammar": A5})
    assert status == 200 and doc["content"] == "aaaaa", doc


def test_a_stuck_mask_does_not_hold_up_another_requests_mask(monkeypatch, tiny_model):
    """Each sequence's masks are computed apart from the others': while one matcher is stuck,
    another constraint of the same group gets its mask, and only the stuck one fails."""
    import threading

    from pyllama.models.gguf_file import read_metadata
    from pyllama.batching import constraint as cmod
    from pyllama.tokenizer import load_tokenizer

    release = threading.Event()

    class StuckMatcher:
        def unsafe_compute_mask_ptr(self, ptr, nbytes):
            release.wait(10.0)

        def is_error(self):
            return False

        def is_stopped(self):
            return False

    monkeypatch.setattr(cmod, "MASK_TIMEOUT_S", 1.0)
    tok = load_tokenizer(read_metadata(tiny_model))
    worker = cmod.MaskWorker("masks-test")
    stuck = cmod.Constraint(StuckMatcher(), tok.n_vocab)
    good = cmod.Constraint(compile_constraint(ConstraintSpec("gbnf", A5), tok), tok.n_vocab)
    try:
        worker.request_mask([stuck])
        worker.request_mask([good])
        good.take_mask()
        allowed = np.flatnonzero(np.unpackbits(good.mask.view(np.uint8), bitorder="little")[:tok.n_vocab])
        assert good.error == "" and [tok.token_bytes(int(i)) for i in allowed] == [b"a"]
        assert good.consume(int(allowed[0]))
        stuck.take_mask()
        assert "too complex" in stuck.error
    finally:
        release.set()
        worker.close()


def _tok(tiny_model):
    from pyllama.models.gguf_file import read_metadata
    from pyllama.tokenizer import load_tokenizer
    return load_tokenizer(read_metadata(tiny_model))


def test_a_first_mask_check_too_slow_is_killed_and_leaves_nothing_running(monkeypatch, tiny_model):
    """The check process of a grammar whose first mask is too slow is killed: the grammar is a 400,
    no computation goes on anywhere (no process, no thread), its place is free at once, and the
    next new grammar is checked by a new process."""
    import threading

    from pyllama.batching import constraint as cmod

    tok = _tok(tiny_model)
    compile_constraint(ConstraintSpec("gbnf", 'root ::= "e"{3}'), tok)  # a check process is running
    checker = cmod.first_mask_checker(tok)
    (pid,) = checker.pids()
    killed = checker.killed
    monkeypatch.setattr(cmod, "FIRST_MASK_S", 0.2)
    monkeypatch.setattr(cmod, "_checks", threading.BoundedSemaphore(1))
    with pytest.raises(HTTPError) as err:
        compile_constraint(ConstraintSpec("gbnf", 'root ::= a{700}\na ::= b{700}\nb ::= "y"'), tok)
    assert err.value.status == 400 and "too complex" in str(err.value)
    assert checker.killed == killed + 1 and not pid_alive(pid) and checker.pids() == []
    assert not [t for t in threading.enumerate() if t.name == "grammar-check"]
    assert cmod._checks.acquire(timeout=0)
    cmod._checks.release()
    compile_constraint(ConstraintSpec("gbnf", 'root ::= "f"{3}'), tok)
    (new_pid,) = checker.pids()
    assert new_pid != pid and pid_alive(new_pid)


def test_grammars_refuse_new_ones_with_a_503_while_every_check_place_is_held(monkeypatch, tiny_model):
    """While MAX_CHECKS places are held (by given-up later masks), a grammar not yet compiled is a
    503 and a compiled one is served; once a place is free, new grammars compile again."""
    import threading

    from pyllama.batching import constraint as cmod

    tok = _tok(tiny_model)
    compile_constraint(ConstraintSpec("gbnf", 'root ::= "b"{3}'), tok)  # compiled before
    monkeypatch.setattr(cmod, "FIRST_MASK_S", 0.01)
    monkeypatch.setattr(cmod, "_checks", threading.BoundedSemaphore(1))
    assert cmod._checks.acquire(timeout=0)
    try:
        with pytest.raises(HTTPError) as err:
            compile_constraint(ConstraintSpec("gbnf", 'root ::= "c"{3}'), tok)
        assert err.value.status == 503
        compile_constraint(ConstraintSpec("gbnf", 'root ::= "b"{3}'), tok)
    finally:
        cmod._checks.release()
    monkeypatch.setattr(cmod, "FIRST_MASK_S", 60.0)
    compile_constraint(ConstraintSpec("gbnf", 'root ::= "c"{3}'), tok)


def test_without_check_processes_the_first_mask_is_checked_on_a_thread(monkeypatch, tiny_model):
    """Where no check process can run, the first mask is computed on a thread of the server: a
    slow one is a 400, and the given-up computation holds its place until it ends."""
    import threading

    from pyllama.batching import constraint as cmod
    from pyllama.batching.grammar_check import CheckUnavailable

    def unavailable(self, grammar, limit_s):
        raise CheckUnavailable("no processes here")

    tok = _tok(tiny_model)
    monkeypatch.setattr(cmod.FirstMaskChecker, "check", unavailable)
    monkeypatch.setattr(cmod, "FIRST_MASK_S", 0.01)
    monkeypatch.setattr(cmod, "_checks", threading.BoundedSemaphore(1))
    with pytest.raises(HTTPError) as err:
        compile_constraint(ConstraintSpec("gbnf", 'root ::= a{700}\na ::= b{700}\nb ::= "z"'), tok)
    assert err.value.status == 400 and "too complex" in str(err.value)
    with pytest.raises(HTTPError) as err:
        compile_constraint(ConstraintSpec("gbnf", 'root ::= "g"{3}'), tok)
    assert err.value.status == 503  # the given-up thread holds the one place
    monkeypatch.setattr(cmod, "FIRST_MASK_S", 60.0)  # it runs to its end (a second or so)
    compile_constraint(ConstraintSpec("gbnf", 'root ::= "g"{3}'), tok)
    assert cmod._checks.acquire(timeout=0)
    cmod._checks.release()


def test_a_grammar_whose_later_mask_is_too_slow_is_refused_next_time(monkeypatch, tiny_model):
    """A first mask in microseconds, then a forced string whose mask takes long: the request's
    constraint fails, and the grammar is then refused at once like one whose first mask is slow."""
    from pyllama.models.gguf_file import read_metadata
    from pyllama.batching import constraint as cmod
    from pyllama.tokenizer import load_tokenizer

    tok = load_tokenizer(read_metadata(tiny_model))
    spec = ConstraintSpec("gbnf", 'root ::= ("y" | "z") a{700}\na ::= b{700}\nb ::= "x"')
    worker = cmod.MaskWorker("masks-test")
    c = cmod.Constraint(compile_constraint(spec, tok), tok.n_vocab)
    worker.request_mask([c])
    c.take_mask()
    assert not c.error
    allowed = np.flatnonzero(np.unpackbits(c.mask.view(np.uint8), bitorder="little")[:tok.n_vocab])
    assert sorted(tok.token_bytes(int(i)) for i in allowed) == [b"y", b"z"]
    assert c.consume(int(allowed[0]))
    monkeypatch.setattr(cmod, "MASK_TIMEOUT_S", 0.01)
    worker.request_mask([c])
    c.take_mask()
    assert "too complex" in c.error and not c.consume(int(allowed[0]))
    with pytest.raises(HTTPError) as err:
        compile_constraint(spec, tok)
    assert err.value.status == 400 and "'grammar': grammar too complex: a token mask" in str(err.value)
