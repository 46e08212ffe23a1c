"""Smaller server behaviours: n_predict 0, tokens_cached, id_slot in stream events, and a failed
step on a local device that stops reporting on /health once a step succeeds again."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from server_util import ServerProcess


@pytest.fixture(scope="module")
def srv(tiny_model):
    s = ServerProcess(tiny_model, "-c", "256", "-np", "2").wait_ready()
    yield s
    s.stop()


def test_n_predict_zero_returns_no_token(srv):
    status, res = srv.post("/completion", {"prompt": "Once upon a time", "n_predict": 0})
    assert status == 200, res
    assert res["content"] == "" and res["tokens"] == [] and res["tokens_predicted"] == 0
    assert res["stop"] is True and res["stop_type"] == "limit" and res["truncated"] is False
    assert res["timings"]["predicted_n"] == 0 and res["timings"]["prompt_n"] == res["tokens_evaluated"]
    events = srv.stream("/completion", {"prompt": "Once upon a time", "n_predict": 0})
    assert len(events) == 1 and events[0]["stop"] is True and events[0]["content"] == ""
    status, res = srv.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 0})
    assert status == 200 and res["choices"][0]["text"] == "" and res["usage"]["completion_tokens"] == 0
    assert res["choices"][0]["finish_reason"] == "length"


def test_tokens_cached_counts_the_cache(srv):
    status, res = srv.post("/completion", {"prompt": "Once upon a time", "n_predict": 7, "ignore_eos": True})
    assert status == 200
    # the last token is sampled, not stored: as llama-server's prompt + generated - 1
    assert res["tokens_cached"] == res["tokens_evaluated"] + 7 - 1
    status, res = srv.post("/completion", {"prompt": "Once upon a time", "n_predict": 500, "ignore_eos": True})
    assert status == 200 and res["truncated"] and res["tokens_cached"] == 128  # -c 256 over 2 slots


def test_stream_events_carry_the_slot(srv):
    events = srv.stream("/completion", {"prompt": "Hello", "n_predict": 5, "ignore_eos": True, "id_slot": 1})
    assert len(events) == 6
    assert all(e["id_slot"] == 1 for e in events), [e["id_slot"] for e in events]


def _group_failing_once(model: str, monkeypatch, method: str, message: str):
    """A one-slot group in this process whose context's `method` raises `message` on its first call.
    Returns (engine, slots, freed: the slots handed back, group)."""
    from pyllama.runtime.engine import Engine
    from pyllama.batching.group import PipelineGroup
    from pyllama.obs.metrics import Metrics
    from pyllama.batching.slot import Slot

    engine = Engine(model, n_threads=1)
    ctx = engine.new_context(64, 1)
    slots = [Slot(0, 0, 0, ctx.seq_cap, engine.tokenizer)]
    freed: list = []
    group = PipelineGroup(0, ctx, slots, engine.tokenizer, Metrics(), on_free=freed.append)
    real = getattr(ctx, method)
    calls = {"n": 0}

    def flaky(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError(message)
        return real(*args, **kw)

    monkeypatch.setattr(ctx, method, flaky)
    return engine, slots, freed, group


def test_local_fault_clears_on_the_next_good_step(tiny_model, monkeypatch):
    """A step that fails on a local device sets the group's fault (/health 500); the next step that
    succeeds clears it, without a restart."""
    from pyllama.batching.sampling import SamplingParams
    from pyllama.server.api import Api, ServerState
    from pyllama.batching.task import CompletionTask

    engine, slots, freed, group = _group_failing_once(tiny_model, monkeypatch, "decode", "device fault")
    state = ServerState(args=None)
    state.engine, state.groups, state.router = engine, [group], object()
    api = Api(state)

    def health() -> tuple[int, dict]:
        resp = asyncio.run(api.health(None))
        return resp.status, json.loads(resp.body)

    def wait(cond) -> None:
        deadline = time.monotonic() + 60
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.01)

    group.start()
    try:
        prompt = engine.tokenizer.encode("Hello", add_special=True)
        group.submit([(slots[0], CompletionTask(prompt=prompt, params=SamplingParams(), n_predict=2))])
        wait(lambda: len(freed) == 1)
        assert group.fault and "device fault" in group.fault
        status, body = health()
        assert status == 500 and "device fault" in body["error"]
        group.submit([(slots[0], CompletionTask(prompt=prompt, params=SamplingParams(), n_predict=2))])
        wait(lambda: len(freed) == 2)
        assert group.fault is None
        assert health() == (200, {"status": "ok"})
    finally:
        group.stop()


def test_slot_context_is_capped_at_the_training_context(tiny_model):
    """As llama-server: a slot never holds more positions than the model was trained on (the tiny
    model's 512), whatever -c / -np give it."""
    s = ServerProcess(tiny_model, "-c", "2048", "-np", "2").wait_ready()
    try:
        status, props = s.request("GET", "/props")
        assert status == 200 and props["default_generation_settings"]["n_ctx"] == 512
        status, res = s.post("/completion", {"prompt": [1] * 600, "n_predict": 1})
        assert status == 400 and "context" in res["error"]["message"]
        status, res = s.post("/completion", {"prompt": [1] * 400, "n_predict": 1})
        assert status == 200, res
    finally:
        assert s.stop() == 0
    assert "the slot context (1024) exceeds the training context of the model (512)" in s.stderr_text


def test_a_request_that_fails_to_start_is_answered_and_frees_its_slot(tiny_model, monkeypatch):
    """An error while a group places a request (before its slot starts) ends that request with an
    error and gives its slot back; the group goes on serving."""
    from pyllama.batching.sampling import SamplingParams
    from pyllama.batching.task import CompletionTask, ErrorEvent

    engine, slots, freed, group = _group_failing_once(tiny_model, monkeypatch, "seq_rm", "bookkeeping fault")
    events = []
    monkeypatch.setattr(group.sink, "put", lambda task, event: events.append((task, event)))
    group.start()
    try:
        prompt = engine.tokenizer.encode("Hello", add_special=True)
        first = CompletionTask(prompt=prompt, params=SamplingParams(), n_predict=2)
        group.submit([(slots[0], first)])
        deadline = time.monotonic() + 60
        while not freed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert freed == [slots[0]] and not slots[0].busy
        errors = [e for t, e in events if t is first and isinstance(e, ErrorEvent)]
        assert len(errors) == 1 and "bookkeeping fault" in errors[0].message and errors[0].status == 500
        second = CompletionTask(prompt=prompt, params=SamplingParams(), n_predict=2)
        group.submit([(slots[0], second)])
        while len(freed) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(freed) == 2 and not [e for t, e in events if t is second and isinstance(e, ErrorEvent)]
    finally:
        group.stop()
