"""The default layer split balanced by measured speed (pyllama/runtime/placement/balance.py): the solver against an
exhaustive search, and the engine's probe against devices of known speed (CPU backends that
sleep a fixed time per block and per output layer on top of their real, negligible, work)."""
from __future__ import annotations

import itertools
import logging
import time

import numpy as np
import pytest

from pyllama.backend.cpu import CPUBackend
from pyllama.runtime.placement.balance import StageCost, balance_layers, stage_ms
from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
from pyllama.models import make
from pyllama.models.make import Preset, make_model

N_LAYER = 8


@pytest.fixture(autouse=True)
def probe_on(env_settings):
    """The probe is opt-in (balance.probe_enabled); these tests are about it."""
    env_settings(PYLLAMA_SPLIT_PROBE="1")


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory) -> str:
    """A tiny model with 8 blocks, so that splits have room to differ (the tiny preset has 2)."""
    name = "split-balance-test"
    make.PRESETS[name] = Preset(64, N_LAYER, 4, 2, 192, 512, 512, False)
    try:
        return make_model(name, str(tmp_path_factory.mktemp("balance") / "deep.gguf"))
    finally:
        del make.PRESETS[name]


class Sleepy(CPUBackend):
    """A CPU backend made slower by a known amount: `block_s` per block and `output_s` per output
    layer product in each graph it computes (the real work of the test model is ~0.1 ms)."""

    def __init__(self, name: str, block_s: float, output_s: float = 0.0) -> None:
        super().__init__(1, name=name)
        self.block_s, self.output_s = block_s, output_s
        self.graphs = 0

    def graph_compute(self, graph, reads=()) -> None:
        super().graph_compute(graph, reads)
        self.graphs += 1
        names = [n.out.name for n in graph.nodes]
        blocks = sum(1 for x in names if x.startswith("attn_norm-"))
        output = any(x == "result_output" for x in names)
        time.sleep(self.block_s * blocks + (self.output_s if output else 0.0))


def counts(engine: Engine) -> list[int]:
    lb = engine.placement.layer_backend
    return [lb.count(i) for i in range(len(engine.backends))]


# --- the solver -------------------------------------------------------------------------------

def brute_force(costs: list[StageCost], n: int, caps: list, least: int) -> float | None:
    """The smallest bottleneck over every split of n blocks (contiguous per device), honouring
    caps and, when there are blocks enough for every device, `least` per device."""
    best = None
    least = least if n >= least * len(costs) else 0
    for split in itertools.product(range(n + 1), repeat=len(costs) - 1):
        last = n - sum(split)
        c = list(split) + [last]
        if last < 0 or any(cap is not None and x > cap for x, cap in zip(c, caps)) or min(c) < least:
            continue
        t = max(stage_ms(costs, c))
        best = t if best is None else min(best, t)
    return best


@pytest.mark.parametrize("seed", range(60))
def test_balance_matches_an_exhaustive_search(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(2, 4))
    n = int(rng.integers(1, 13))
    costs = [StageCost(f"D{i}", float(rng.uniform(0, 2)), float(rng.uniform(0.1, 5)),
                       float(rng.uniform(0, 20)) if i == k - 1 else 0.0) for i in range(k)]
    caps = [None if rng.random() < 0.5 else int(rng.integers(0, n + 1)) for _ in range(k)]
    least = int(rng.integers(0, 2))
    got = balance_layers(costs, n, caps, min_blocks=least)
    want = brute_force(costs, n, caps, least)
    if want is None:
        assert got is None
        return
    assert got is not None and sum(got) == n
    assert all(cap is None or x <= cap for x, cap in zip(got, caps))
    assert n < least * k or min(got) >= least
    assert max(stage_ms(costs, got)) == pytest.approx(want)


def test_balance_counts_the_output_layer_on_the_last_device():
    same = [StageCost("A", 0.0, 3.0), StageCost("B", 0.0, 3.0, output_ms=6.0)]
    assert balance_layers(same, 8) == [5, 3]
    assert balance_layers([StageCost("A", 0.0, 3.0), StageCost("B", 0.0, 3.0)], 8) == [4, 4]
    # a device three times slower per block gets a third of the blocks of the other
    assert balance_layers([StageCost("A", 0.0, 6.0), StageCost("B", 0.0, 2.0)], 8) == [2, 6]


def test_balance_respects_memory_caps_and_refuses_what_does_not_fit():
    costs = [StageCost("A", 0.0, 1.0), StageCost("B", 0.0, 3.0)]
    assert balance_layers(costs, 8) == [6, 2]
    assert balance_layers(costs, 8, [5, None]) == [5, 3]
    assert balance_layers(costs, 8, [5, 2]) is None


def test_a_device_may_get_no_block_but_the_last_keeps_the_output():
    costs = [StageCost("A", 0.0, 100.0), StageCost("B", 0.0, 1.0, output_ms=1.0)]
    assert balance_layers(costs, 4) == [0, 4]
    assert stage_ms(costs, [0, 4]) == [0.0, 5.0]
    # what the engine asks: every listed device keeps a block, when there are enough of them
    assert balance_layers(costs, 4, min_blocks=1) == [1, 3]
    assert balance_layers(costs, 1, min_blocks=1) == [0, 1]


# --- the engine's probe -----------------------------------------------------------------------

@pytest.mark.parametrize("slow_first", [True, False])
def test_the_slower_device_gets_fewer_layers(deep_model, slow_first):
    slow, fast = 0.006, 0.002
    devs = [Sleepy("DEV0", slow if slow_first else fast), Sleepy("DEV1", fast if slow_first else slow)]
    engine = Engine(deep_model, n_threads=1, backends=devs, load=False)
    # 3x slower per block: a quarter of the 8 blocks (2 x 6 ms = 6 x 2 ms)
    assert counts(engine) == ([2, 6] if slow_first else [6, 2])
    assert engine.measured_split is not None
    c0, c1 = engine.measured_split.costs
    slow_c, fast_c = (c0, c1) if slow_first else (c1, c0)
    assert slow_c.layer_ms > 1.5 * fast_c.layer_ms  # the sleeps (6 and 2 ms) plus the host's noise


def test_the_output_layer_counts_on_the_last_device(deep_model, caplog):
    devs = [Sleepy("DEV0", 0.003), Sleepy("DEV1", 0.003, output_s=0.006)]
    with caplog.at_level(logging.INFO, logger="pyllama.runtime.placement.balance"):
        engine = Engine(deep_model, n_threads=1, backends=devs, load=False)
    # equal blocks; the output layer (two blocks' worth) on DEV1: 5 x 3 = 3 x 3 + 6 ms
    assert counts(engine) == [5, 3]
    assert engine.measured_split.costs[1].output_ms == pytest.approx(6.0, abs=1.5)
    lines = [r.getMessage() for r in caplog.records if r.name == "pyllama.runtime.placement.balance" and r.levelno == logging.INFO]
    assert len(lines) == 1
    assert "layer split by measured speed" in lines[0]
    assert "DEV0 5 (" in lines[0] and "DEV1 3 (" in lines[0] and "+ output" in lines[0]
    assert "by free memory it would be DEV0 4 (" in lines[0]


def test_an_explicit_tensor_split_wins_and_nothing_is_timed(deep_model, caplog):
    devs = [Sleepy("DEV0", 0.006), Sleepy("DEV1", 0.002)]
    with caplog.at_level(logging.INFO, logger="pyllama.runtime.placement.balance"):
        engine = Engine(deep_model, n_threads=1, backends=devs, tensor_split=[1, 1], load=False)
    assert counts(engine) == [4, 4]
    assert engine.measured_split is None
    assert devs[0].graphs == devs[1].graphs == 0
    assert not [r for r in caplog.records if r.name == "pyllama.runtime.placement.balance"]


@pytest.mark.parametrize("value", ["0", None])
def test_the_probe_is_off_unless_asked_for(deep_model, env_settings, value):
    env_settings(PYLLAMA_SPLIT_PROBE=value)
    devs = [Sleepy("DEV0", 0.006), Sleepy("DEV1", 0.002)]
    engine = Engine(deep_model, n_threads=1, backends=devs, load=False)
    assert engine.measured_split is None
    assert devs[0].graphs == devs[1].graphs == 0
    assert sum(counts(engine)) == N_LAYER  # by free memory: whatever the host reports


def test_one_device_is_not_timed(deep_model):
    dev = Sleepy("DEV0", 0.006)
    engine = Engine(deep_model, n_threads=1, backends=[dev], load=False)
    assert engine.measured_split is None and dev.graphs == 0


def test_a_probe_that_fails_falls_back_to_free_memory(deep_model, caplog):
    class NoRoom(Sleepy):
        def alloc_buffer(self, size, usage="compute"):
            from pyllama.util.errors import PyllamaError
            raise PyllamaError(f"{self.name}: out of memory")

    devs = [Sleepy("DEV0", 0.006), NoRoom("DEV1", 0.002)]
    with caplog.at_level(logging.WARNING, logger="pyllama.runtime.placement.balance"):
        engine = Engine(deep_model, n_threads=1, backends=devs, load=False)
    assert engine.measured_split is None
    assert any("timing DEV1 for the layer split failed" in r.getMessage() for r in caplog.records)


def test_the_measured_split_decodes_as_one_device_does(deep_model):
    """The probe leaves nothing behind: the split model's logits equal the unsplit model's."""
    split = Engine(deep_model, n_threads=1, backends=[Sleepy("DEV0", 0.003), Sleepy("DEV1", 0.001)])
    whole = Engine(deep_model, n_threads=1)
    assert counts(split) == [2, 6] or counts(split) == [3, 5]
    prompt = [5, 17, 300, 42, 7, 99]
    out = []
    for e in (split, whole):
        ctx = e.new_context(64, 1, 64, 64)
        out.append(ctx.decode(Batch.for_sequence(prompt, 0, all_logits=True)).logits.copy())
    np.testing.assert_allclose(out[0], out[1], rtol=1e-5, atol=1e-5)
    split.close()
    whole.close()
