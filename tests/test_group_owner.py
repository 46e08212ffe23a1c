"""A pipeline group's decode thread is the only one that touches its context and slots: other
threads act on a slot through `when_idle` (run between steps, once the slot is idle) and read the
KV cache's use from the snapshot the thread publishes after each step."""
from __future__ import annotations

import threading
import time

import pytest

from pyllama.batching.sampling import SamplingParams
from pyllama.runtime.engine import Engine
from pyllama.batching.group import PipelineGroup
from pyllama.obs.metrics import Metrics
from pyllama.batching.slot import Slot
from pyllama.batching.task import CompletionTask


@pytest.fixture
def group(tiny_model):
    engine = Engine(tiny_model, n_threads=1)
    ctx = engine.new_context(256, 2)
    slots = [Slot(i, 0, i, ctx.seq_cap, engine.tokenizer) for i in range(2)]
    g = PipelineGroup(0, ctx, slots, engine.tokenizer, Metrics(), on_free=lambda slot: None)
    g.start()
    try:
        yield g
    finally:
        assert g.stop(30)


def _task(prompt: list[int], n_predict: int) -> CompletionTask:
    return CompletionTask(prompt=prompt, params=SamplingParams(temperature=0.0), n_predict=n_predict)


def _wait(pred, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_a_slot_command_runs_on_the_decode_thread_after_the_slot_is_done(group):
    slot = group.slots[0]
    group.submit([(slot, _task([1, 2, 3, 4, 5], 40))])  # (the command comes after its placement)
    ran = []

    def work():
        ran.append((threading.current_thread().name, slot.busy, len(slot.cache_tokens)))
        return "done"

    future = group.when_idle(slot, work, lambda s: not s.busy)
    assert future.result(timeout=60) == "done"
    (name, busy, n_cached), = ran
    assert name == "decode-0" and not busy and n_cached >= 5  # after the request, with its cache


def test_a_command_for_an_idle_slot_runs_at_once_and_its_exception_comes_back(group):
    slot = group.slots[1]

    def fail():
        raise ValueError("no such rows")

    with pytest.raises(ValueError, match="no such rows"):
        group.when_idle(slot, fail, lambda s: True).result(timeout=30)
    assert group.when_idle(slot, lambda: threading.current_thread().name, lambda s: True).result(timeout=30) == "decode-0"


def test_a_command_waits_while_its_slot_is_held_elsewhere(group):
    """idle() false (the router still holds the slot): the command waits, then runs once it holds."""
    slot = group.slots[0]
    held = threading.Event()
    held.set()
    future = group.when_idle(slot, lambda: "ran", lambda s: not held.is_set())
    time.sleep(0.2)
    assert not future.done()
    held.clear()
    assert future.result(timeout=30) == "ran"


def test_kv_use_is_published_after_each_step(group):
    assert group.kv_use.used_cells == 0 and group.kv_use.n_cells > 0
    slot = group.slots[0]
    group.submit([(slot, _task(list(range(1, 21)), 3))])
    _wait(lambda: group.kv_use.used_cells >= 20)
    assert group.kv_use.tokens_cached >= 20
    # erasing the slot's cache through a command shows in the next snapshot
    group.when_idle(slot, lambda: group.ctx.seq_rm(slot.seq, 0), lambda s: not s.busy).result(timeout=30)
    _wait(lambda: group.kv_use.used_cells == 0)


def test_commands_still_waiting_fail_when_the_group_stops(tiny_model):
    engine = Engine(tiny_model, n_threads=1)
    ctx = engine.new_context(256, 1)
    slots = [Slot(0, 0, 0, ctx.seq_cap, engine.tokenizer)]
    g = PipelineGroup(0, ctx, slots, engine.tokenizer, Metrics(), on_free=lambda slot: None)
    g.start()
    future = g.when_idle(slots[0], lambda: "never", lambda s: False)
    assert g.stop(30)
    with pytest.raises(RuntimeError, match="shutting down"):
        future.result(timeout=10)


def test_a_call_reads_the_slots_on_the_decode_thread_between_steps(group):
    slot = group.slots[0]
    group.submit([(slot, _task(list(range(1, 9)), 30))])
    seen = []
    for _ in range(5):
        seen.append(group.call(lambda: (threading.current_thread().name, slot.snapshot()["n_past"])).result(timeout=30))
    assert all(name == "decode-0" for name, _ in seen)
    assert [n for _, n in seen] == sorted(n for _, n in seen)  # each read between two steps: never behind the last


def test_a_call_or_slot_action_on_a_stopped_group_runs_at_once(tiny_model):
    engine = Engine(tiny_model, n_threads=1)
    ctx = engine.new_context(256, 1)
    slots = [Slot(0, 0, 0, ctx.seq_cap, engine.tokenizer)]
    g = PipelineGroup(0, ctx, slots, engine.tokenizer, Metrics(), on_free=lambda slot: None)
    assert g.call(lambda: "before start").result(timeout=1) == "before start"
    g.start()
    assert g.call(lambda: threading.current_thread().name).result(timeout=30) == "decode-0"
    assert g.stop(30)
    assert g.call(lambda: "after stop").result(timeout=1) == "after stop"
    # a slot action too: with no decode thread nobody else touches the slot, so waiting would hang
    assert g.when_idle(slots[0], lambda: "action after stop", lambda s: True).result(timeout=1) == "action after stop"
