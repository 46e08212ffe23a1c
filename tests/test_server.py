"""The HTTP server through a real socket: llama-server and OpenAI endpoints, streaming, slots,
metrics, continuous batching under concurrency, cancellation, and bad input."""
from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from server_util import ServerProcess

PROMPT = "The little cat sat on the"


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = ServerProcess(tiny_model, "-np", "4", "-c", "4096", "--metrics").wait_ready()
    yield srv
    assert srv.stop() == 0


def wait_idle(server, timeout: float = 10) -> list:
    deadline = time.monotonic() + timeout
    while True:
        status, slots = server.request("GET", "/slots")
        assert status == 200
        if not any(s["is_processing"] for s in slots) or time.monotonic() > deadline:
            return slots
        time.sleep(0.05)


def parse_prometheus(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_health_and_models(server):
    assert server.request("GET", "/health") == (200, {"status": "ok"})
    status, models = server.request("GET", "/v1/models")
    assert status == 200 and models["object"] == "list" and models["data"][0]["id"].endswith(".gguf")


def test_completion_non_streaming(server):
    status, res = server.post("/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "ignore_eos": True,
                                              "return_tokens": True})
    assert status == 200
    assert res["tokens_predicted"] == 8 and len(res["tokens"]) == 8
    assert res["stop"] is True and res["stop_type"] == "limit"
    assert isinstance(res["content"], str) and res["content"]
    assert res["timings"]["predicted_n"] == 8 and res["tokens_evaluated"] > 0


def test_completion_streaming_matches_non_streaming(server):
    body = {"prompt": PROMPT, "n_predict": 10, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
            "return_tokens": True}
    _, whole = server.post("/completion", body)
    events = server.stream("/completion", body)
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert len(events) == 11
    assert "".join(e["content"] for e in events) == whole["content"]
    assert [e["tokens"][0] for e in events[:-1]] == whole["tokens"]
    assert events[-1]["tokens_predicted"] == 10


def test_streams_ask_proxies_not_to_buffer(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("POST", "/completion", body=json.dumps({"prompt": PROMPT, "n_predict": 2, "stream": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200 and resp.getheader("Content-Type", "").startswith("text/event-stream")
        assert resp.getheader("X-Accel-Buffering") == "no"  # nginx passes each event on at once
    finally:
        conn.close()
    status, _ = server.post("/completion", {"prompt": PROMPT, "n_predict": 1})
    assert status == 200


def test_greedy_completion_equals_generate(server, tiny_model):
    proc = subprocess.run([sys.executable, "-m", "pyllama.generate", "-m", tiny_model, "-p", PROMPT, "-n", "16",
                           "--temp", "0", "--ignore-eos", "--tokens", "-t", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    expect = [int(x) for x in proc.stdout.split()]
    _, res = server.post("/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 0, "ignore_eos": True,
                                         "return_tokens": True})
    assert res["tokens"] == expect


def test_token_id_prompt(server):
    _, tok = server.post("/tokenize", {"content": PROMPT, "add_special": True})
    _, a = server.post("/completion", {"prompt": tok["tokens"], "n_predict": 6, "temperature": 0, "ignore_eos": True,
                                       "return_tokens": True})
    _, b = server.post("/completion", {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "ignore_eos": True,
                                       "return_tokens": True})
    assert a["tokens"] == b["tokens"]


def test_tokenize_detokenize_round_trip(server):
    text = "Hello wörld, ünïcode ✓ 你好"
    status, tok = server.post("/tokenize", {"content": text})
    assert status == 200 and all(isinstance(t, int) for t in tok["tokens"])
    status, detok = server.post("/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and detok["content"] == text
    _, pieces = server.post("/tokenize", {"content": "ab", "with_pieces": True})
    assert "".join(p["piece"] for p in pieces["tokens"]) == "ab"


def test_stop_string(server):
    _, base = server.post("/completion", {"prompt": PROMPT, "n_predict": 20, "temperature": 0, "ignore_eos": True})
    text = base["content"]
    stop = text[5:8]
    assert stop.strip(), text
    _, res = server.post("/completion", {"prompt": PROMPT, "n_predict": 20, "temperature": 0, "ignore_eos": True,
                                         "stop": [stop]})
    assert res["stop_type"] == "word" and res["stopping_word"] == stop
    assert res["content"] == text[:text.index(stop)]
    events = server.stream("/completion", {"prompt": PROMPT, "n_predict": 20, "temperature": 0, "ignore_eos": True,
                                           "stop": [stop]})
    assert "".join(e["content"] for e in events) == res["content"]


def test_prompt_cache_reuses_the_prefix(server):
    body = {"prompt": PROMPT + " and then", "n_predict": 4, "temperature": 0, "ignore_eos": True, "id_slot": 2,
            "return_tokens": True}
    _, first = server.post("/completion", body)
    _, second = server.post("/completion", body)
    assert second["tokens"] == first["tokens"]
    assert second["timings"]["prompt_n"] < first["timings"]["prompt_n"]
    assert second["timings"]["prompt_n"] >= 1


def test_n_choices_share_the_prompt(server):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "n": 3, "ignore_eos": True}
    status, res = server.post("/v1/completions", body)
    assert status == 200 and len(res["choices"]) == 3
    texts = {c["text"] for c in res["choices"]}
    _, one = server.post("/v1/completions", {**body, "n": 1})
    assert texts == {one["choices"][0]["text"]}
    assert res["usage"]["completion_tokens"] == 24


def test_text_completion_logprobs_in_both_forms(server):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    status, res = server.post("/v1/completions", body)
    assert status == 200
    lp = res["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["content"]) == 6
    # OpenAI's legacy form: each token's first character in the generated text
    starts = [sum(len(t) for t in lp["tokens"][:i]) for i in range(6)]
    assert lp["text_offset"] == starts
    # llama-server's form, as chat's
    assert [c["token"] for c in lp["content"]] == lp["tokens"]
    assert [c["logprob"] for c in lp["content"]] == lp["token_logprobs"]
    assert all(len(c["top_logprobs"]) == 2 for c in lp["content"])
    assert all(isinstance(c["id"], int) and all(isinstance(t["id"], int) for t in c["top_logprobs"])
               for c in lp["content"])  # llama-server's entries carry the ids
    events = [e for e in server.stream("/v1/completions", body) if e != "[DONE]"]
    streamed = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    assert [x["tokens"][0] for x in streamed] == lp["tokens"]
    assert [x["text_offset"][0] for x in streamed] == starts
    # the finishing chunk carries the usage and the timings, as llama-server's
    last = events[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    assert {k: v for k, v in last["usage"].items() if k != "prompt_tokens_details"} == \
        {"prompt_tokens": res["usage"]["prompt_tokens"], "completion_tokens": 6,
         "total_tokens": res["usage"]["prompt_tokens"] + 6}
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == last["timings"]["cache_n"]
    assert last["timings"]["predicted_n"] == 6


def test_openai_client_chat(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    res = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Say hi"}],
                                         max_tokens=8, temperature=0)
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].finish_reason in ("stop", "length")
    assert res.usage.completion_tokens <= 8
    chunks = list(client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Say hi"}],
                                                 max_tokens=8, temperature=0, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == res.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == res.choices[0].finish_reason


def test_openai_client_completions(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    res = client.completions.create(model="x", prompt=PROMPT, max_tokens=5, temperature=0)
    chunks = list(client.completions.create(model="x", prompt=PROMPT, max_tokens=5, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == res.choices[0].text


def test_slots_and_metrics(server):
    status, slots = server.request("GET", "/slots")
    assert status == 200 and len(slots) == 4 and {s["id"] for s in slots} == {0, 1, 2, 3}
    before = parse_prometheus(server.request("GET", "/metrics")[1])
    server.post("/completion", {"prompt": PROMPT, "n_predict": 7, "temperature": 0, "ignore_eos": True,
                                "cache_prompt": False})
    status, text = server.request("GET", "/metrics")
    assert status == 200
    after = parse_prometheus(text)
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == 7
    assert after["llamacpp:prompt_tokens_total"] > before["llamacpp:prompt_tokens_total"]
    for name in ("llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:n_busy_slots_per_decode",
                 "llamacpp:kv_cache_usage_ratio"):
        assert name in after
    # as llama-server's: the most tokens a slot's context held (the last sampled token is not stored)
    n_prompt = len(server.post("/tokenize", {"content": PROMPT, "add_special": True})[1]["tokens"])
    assert after["llamacpp:n_tokens_max"] >= n_prompt + 7 - 1


def test_slots_show_a_running_requests_settings(server):
    done = threading.Event()

    def run():
        try:
            server.post("/completion", {"prompt": PROMPT, "n_predict": 300, "temperature": 0, "ignore_eos": True,
                                        "top_k": 7, "stop": ["zzz"], "cache_prompt": False})
        finally:
            done.set()
    t = threading.Thread(target=run)
    t.start()
    try:
        busy = []
        deadline = time.monotonic() + 30
        while not busy and not done.is_set() and time.monotonic() < deadline:
            busy = [s for s in server.request("GET", "/slots")[1] if s["is_processing"] and s["n_decoded"] > 0]
        assert busy, "the request was not seen running"
        slot = busy[0]
        # as llama-server's: the request's settings and where its generation stands
        assert slot["params"]["top_k"] == 7 and slot["params"]["stop"] == ["zzz"] and slot["params"]["n_predict"] == 300
        nt = slot["next_token"][0]
        assert nt["has_next_token"] is True and 0 < nt["n_decoded"] <= 300 and nt["n_remain"] == 300 - nt["n_decoded"]
    finally:
        t.join(60)


def test_32_concurrent_streams_get_exact_counts(server):
    results: dict[int, int] = {}
    errors: list[str] = []

    def user(i: int) -> None:
        try:
            events = server.stream("/completion", {"prompt": f"{PROMPT} {i}", "n_predict": 12 + i % 5,
                                                   "ignore_eos": True, "seed": i}, timeout=120)
            results[i] = events[-1]["tokens_predicted"] if events[-1]["stop"] else -1
            assert len(events) - 1 == results[i]
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(f"{i}: {exc!r}")

    threads = [threading.Thread(target=user, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors
    assert results == {i: 12 + i % 5 for i in range(32)}
    slots = wait_idle(server)
    assert not any(s["is_processing"] for s in slots)


def test_client_disconnect_frees_the_slot(server):
    sock = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps({"prompt": PROMPT, "n_predict": -1, "ignore_eos": True, "stream": True}).encode()
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while b"data: " not in got:
        chunk = sock.recv(4096)
        assert chunk, got
        got += chunk
    status, slots = server.request("GET", "/slots")
    assert any(s["is_processing"] for s in slots)
    sock.close()
    slots = wait_idle(server, timeout=5)
    assert not any(s["is_processing"] for s in slots)


@pytest.mark.parametrize("path,body,status", [
    ("/completion", b"{not json", 400),
    ("/completion", b'{"prompt": 5}', 400),
    ("/completion", b'{"prompt": "x", "n_predict": "ten"}', 400),
    ("/completion", b'{"prompt": "x", "temperature": "hot"}', 400),
    ("/completion", b'{"prompt": "x", "n_predict": -2}', 400),
    ("/completion", b'{"prompt": "x", "n": 99}', 400),
    ("/completion", b'{"prompt": [1, 2, 999999]}', 400),
    ("/completion", b'{"n_predict": 3}', 400),
    ("/completion", b'[1, 2]', 400),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400),
    ("/v1/chat/completions", b'{"messages": []}', 400),
    ("/tokenize", b'{"content": 3}', 400),
    ("/detokenize", b'{"tokens": ["a"]}', 400),
    ("/no/such/endpoint", b"{}", 404),
])
def test_bad_input_is_a_json_error(server, path, body, status):
    got, res = server.request("POST", path, raw=body)
    assert got == status, res
    assert set(res["error"]) >= {"code", "message", "type"} and res["error"]["code"] == status
    assert server.request("GET", "/health")[0] == 200


def test_prompt_longer_than_the_context(server):
    status, res = server.post("/completion", {"prompt": [300 + i % 200 for i in range(1100)]})
    assert status == 400 and res["error"]["type"] == "exceed_context_size_error"


def test_oversized_body(server):
    status, res = server.request("POST", "/completion", raw=b'{"prompt": "' + b"a" * (17 << 20) + b'"}')
    assert status == 413
    assert server.request("GET", "/health")[0] == 200


def test_more_requests_than_slots_are_deferred_not_dropped(server):
    out: list = []
    threads = [threading.Thread(target=lambda: out.append(server.post(
        "/completion", {"prompt": PROMPT, "n_predict": 6, "ignore_eos": True, "id_slot": 1}))) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [s for s, _ in out] == [200] * 5
    assert all(r["tokens_predicted"] == 6 for _, r in out)


def test_startup_errors_exit_1(tmp_path, tiny_model):
    for args, needle in ((["-m", str(tmp_path / "missing.gguf")], "no such file"),
                         (["-m", tiny_model, "-np", "0"], "--parallel"),
                         (["-m", tiny_model, "-n", "-5"], "--n-predict")):
        proc = subprocess.run([sys.executable, "-m", "pyllama.server", "--port", "0", *args], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 1, proc.stderr
        assert needle in proc.stderr and "Traceback" not in proc.stderr


def test_sigterm_finishes_in_flight_work(tiny_model):
    srv = ServerProcess(tiny_model, "-np", "2").wait_ready()
    got: list = []
    t = threading.Thread(target=lambda: got.append(srv.post("/completion", {"prompt": PROMPT, "n_predict": 30,
                                                                         "ignore_eos": True})))
    t.start()
    time.sleep(0.3)
    assert srv.stop() == 0
    t.join(30)
    assert got and got[0][0] == 200 and got[0][1]["tokens_predicted"] == 30


def test_default_model_when_none_given(tmp_path):
    """The README's run command: no -m serves the built-in model, written once into the cache."""
    srv = ServerProcess("", env={"PYLLAMA_CACHE": str(tmp_path)})
    try:
        srv.wait_ready(timeout=120)
        status, res = srv.post("/completion", {"prompt": "Once upon a time", "n_predict": 4, "ignore_eos": True})
        assert status == 200 and res["tokens_predicted"] == 4
        assert any(p.name.endswith(".gguf") for p in tmp_path.iterdir())
    finally:
        assert srv.stop() == 0


def test_health_is_503_while_loading():
    import asyncio
    from types import SimpleNamespace

    from pyllama.server.api import Api, ServerState
    from pyllama.server.http import HTTPError, Request

    api = Api(ServerState(SimpleNamespace(n_predict=-1)))
    res = asyncio.run(api.health(Request("GET", "/health")))
    assert res.status == 503 and json.loads(res.body)["error"]["type"] == "unavailable_error"
    with pytest.raises(HTTPError) as err:
        asyncio.run(api.completion(Request("POST", "/completion", body=b'{"prompt": "x"}')))
    assert err.value.status == 503


def test_long_prompt_does_not_stall_running_generation(tiny_model):
    """While one slot generates, another's long prompt is fed one micro-batch per step: the prompt
    chunk fills what the decode rows leave of it, so the step is one micro-batch (in a split, every
    micro-batch is a trip through each stage; a 33rd row would cost a second trip)."""
    from pyllama.runtime.engine import Engine
    from pyllama.batching.sampling import SamplingParams
    from pyllama.batching.group import PipelineGroup
    from pyllama.obs.metrics import Metrics
    from pyllama.batching.slot import Slot, SlotState
    from pyllama.batching.task import CompletionTask

    engine = Engine(tiny_model, n_threads=1)
    ctx = engine.new_context(4096, 2, n_batch=2048, n_ubatch=32)
    slots = [Slot(i, 0, i, ctx.seq_cap, engine.tokenizer) for i in range(2)]
    group = PipelineGroup(0, ctx, slots, engine.tokenizer, Metrics(), on_free=lambda s: None)
    greedy = SamplingParams(temperature=0)
    group.submit([(slots[0], CompletionTask(prompt=engine.tokenizer.encode(PROMPT), params=greedy, n_predict=50))])
    group._iteration()
    assert slots[0].state is SlotState.GENERATING
    long_prompt = [300 + i % 200 for i in range(1000)]
    group.submit([(slots[1], CompletionTask(prompt=long_prompt, params=greedy, n_predict=2))])
    sizes = []
    while slots[1].state is not SlotState.GENERATING:
        group._iteration()
        sizes.append(slots[1].n_past)
    steps = [b - a for a, b in zip([0] + sizes, sizes)]
    assert max(steps) == 31 and len(steps) >= 1000 // 31
    assert slots[0].n_decoded == min(50, len(steps) + 1)  # the generation advanced at every step
    # alone, the prompt goes in one step of up to n_batch
    group._finish(slots[0], None)
    group._finish(slots[1], None)
    group.submit([(slots[1], CompletionTask(prompt=long_prompt[::-1], params=greedy, n_predict=2, cache_prompt=False))])
    group._iteration()
    assert slots[1].state is SlotState.GENERATING


def test_submit_does_not_wait_for_a_running_step(tiny_model):
    """Handing a task to a group must not block behind that group's decode step: the task thread
    places work for every group, and a step over a split can take a long time."""
    from pyllama.runtime.engine import Engine
    from pyllama.batching.sampling import SamplingParams
    from pyllama.batching.group import PipelineGroup
    from pyllama.obs.metrics import Metrics
    from pyllama.batching.slot import Slot
    from pyllama.batching.task import CompletionTask

    engine = Engine(tiny_model, n_threads=1)
    ctx = engine.new_context(512, 2)
    slots = [Slot(i, 0, i, ctx.seq_cap, engine.tokenizer) for i in range(2)]
    group = PipelineGroup(0, ctx, slots, engine.tokenizer, Metrics(), on_free=lambda s: None)
    in_step, release = threading.Event(), threading.Event()
    real_decode = ctx.decode

    def slow_decode(batch):
        in_step.set()
        assert release.wait(30), "the test never released the step"
        return real_decode(batch)

    ctx.decode = slow_decode
    greedy = SamplingParams(temperature=0)
    group.start()
    try:
        group.submit([(slots[0], CompletionTask(prompt=engine.tokenizer.encode(PROMPT), params=greedy, n_predict=3))])
        assert in_step.wait(30), "the group never started its step"
        second = threading.Thread(target=group.submit, args=(
            [(slots[1], CompletionTask(prompt=engine.tokenizer.encode(PROMPT), params=greedy, n_predict=3))],))
        second.start()
        second.join(10)
        blocked = second.is_alive()
        release.set()
        second.join(30)
        assert not blocked, "submit waited for the running decode step"
        deadline = time.monotonic() + 30
        while any(s.busy for s in slots) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(s.busy for s in slots), "the submitted tasks did not finish"
        assert all(s.n_decoded == 3 for s in slots)
    finally:
        release.set()
        group.stop()


def _biased_tokens(server, bias) -> list[int]:
    body = {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
            "return_tokens": True}
    if bias is not None:
        body["logit_bias"] = bias
    status, doc = server.post("/completion", body)
    assert status == 200, doc
    return doc["tokens"]


def test_logit_bias_is_applied(server):
    plain = _biased_tokens(server, None)
    # banning the first greedy token changes the first token, and nothing else in the request changes
    banned = _biased_tokens(server, [[plain[0], False]])
    assert banned[0] != plain[0] and plain[0] not in banned
    # echoed as llama-server does, the ban's -inf as null (strict JSON: the client refuses -Infinity)
    status, doc = server.post("/completion", {"prompt": PROMPT, "n_predict": 1, "logit_bias": [[plain[0], False], [7, 2.5]]})
    assert status == 200
    echoed = sorted(doc["generation_settings"]["logit_bias"], key=lambda e: e["token"])
    assert echoed == sorted([{"bias": None, "token": plain[0]}, {"bias": 2.5, "token": 7}], key=lambda e: e["token"])
    assert _biased_tokens(server, {str(plain[0]): False}) == banned  # OpenAI's form
    forced = _biased_tokens(server, [[7, 1000]])
    assert forced == [7] * 6
    # a string gets the bias on every token of its encoding
    status, doc = server.post("/tokenize", {"content": "zq", "add_special": False})
    assert status == 200
    assert set(_biased_tokens(server, [["zq", 1000]])) <= set(doc["tokens"])
    status, doc = server.post("/completion", {"prompt": PROMPT, "logit_bias": [[100000, 1.0]]})
    assert status == 400 and "outside the vocabulary" in doc["error"]["message"]
