"""The simulated device (pyllama/backend/sim.py) and bench/pipeline_sim.py: a model loads on it, a
decode returns zeros from it, a graph takes at least its modelled time, one device runs one graph
at a time, a link costs at least its delay per transfer, and no command line reaches it.

Times are checked as lower bounds only: this machine may be slower than any bound, never faster."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pyllama.backend.cpu import CPUBackend
from pyllama.backend.sim import SimBackend, graph_cost
from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
from pyllama.util.errors import PyllamaError

ROOT = Path(__file__).resolve().parent.parent


def decode_rows(ctx, n: int, pos: int = 0):
    """One step of n sequences, one token each at `pos`, every row's logits asked for."""
    return ctx.decode(Batch(np.arange(1, n + 1), np.full(n, pos), np.arange(n), np.ones(n, dtype=bool)))


def engine_of(model: str, devices) -> Engine:
    return Engine(model, n_threads=1, backends=devices, tensor_split=[1.0] * len(devices))


@pytest.mark.parametrize("order", ["sim,cpu", "cpu,sim", "sim,sim"])
def test_a_model_loads_and_decodes_over_the_simulated_device(tiny_model, order):
    devices = [SimBackend(f"SIM{i}", fixed_ms=1) if name == "sim" else CPUBackend(1)
               for i, name in enumerate(order.split(","))]
    engine = engine_of(tiny_model, devices)
    try:
        assert engine.counts() == [1, 1]
        ctx = engine.new_context(64, 1, 64, 64)
        out = ctx.decode(Batch.for_sequence([5, 17, 300, 42], 0, all_logits=True))
        assert out.logits.shape == (4, engine.model.hparams.n_vocab)
        assert np.isfinite(out.logits).all()
        if order.endswith("sim"):
            assert not out.logits.any()  # the last stage wrote zeros: greedy picks token 0
        sims = [d for d in devices if isinstance(d, SimBackend)]
        assert all(len(d.spans) == 1 for d in sims)
        ctx.free()
    finally:
        engine.close()


def test_a_graph_takes_at_least_its_modelled_time(tiny_model):
    dev = SimBackend("SIM0", bandwidth_gb_s=0.05)  # the tiny model's ~0.2 MB per block: milliseconds
    engine = engine_of(tiny_model, [dev])
    try:
        hp = engine.model.hparams
        ctx = engine.new_context(64, 4, 64, 64)
        for step in range(3):
            decode_rows(ctx, 4, step)
        # the model: every weight the graph reads, the embedding only in the rows looked up (F32)
        table = hp.n_vocab * hp.n_embd * 4
        assert dev.last_bytes == engine.weights.bytes_per_backend["SIM0"] - table + 4 * hp.n_embd * 4
        modelled = dev.last_bytes / (0.05 * 1e9)
        assert len(dev.spans) == 3
        for t0, t1, s in dev.spans:
            assert s == pytest.approx(modelled)
            assert t1 - t0 >= s * 1e6 - 1  # microseconds, each end rounded down
        # with a FLOP rate, the slower of the two terms
        slow = SimBackend("SIM1", bandwidth_gb_s=1e6, flops=1e6)
        assert slow.modelled_s(1000, 5_000_000) == pytest.approx(5.0)
        assert slow.modelled_s(10**12, 0) == pytest.approx(1e-3)
        ctx.free()
    finally:
        engine.close()


def test_graph_cost_counts_rows_looked_up_and_products(tiny_model):
    dev = SimBackend("SIM0")
    engine = engine_of(tiny_model, [dev])
    try:
        hp = engine.model.hparams
        ctx = engine.new_context(64, 8, 64, 64)
        decode_rows(ctx, 2)
        two = dev.last_bytes
        ctx.clear()
        decode_rows(ctx, 8)
        assert dev.last_bytes - two == 6 * hp.n_embd * 4  # six more embedding rows, the rest the same
        plan = next(iter(ctx._plans.values()))
        nbytes, flops = graph_cost(plan.splits[0].graph)
        assert nbytes > 0 and flops > 0
        ctx.free()
    finally:
        engine.close()


def test_two_contexts_on_one_device_never_compute_at_once(tiny_model):
    devices = [SimBackend("SIM0", fixed_ms=3), SimBackend("SIM1", fixed_ms=3)]
    engine = engine_of(tiny_model, devices)
    errors: list = []

    def run(ctx) -> None:
        try:
            for step in range(6):
                decode_rows(ctx, 2, step)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        contexts = [engine.new_context(64, 2, 64, 64) for _ in range(2)]
        threads = [threading.Thread(target=run, args=(ctx,)) for ctx in contexts]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors and not any(th.is_alive() for th in threads)
        for dev in devices:
            spans = sorted(dev.spans)
            assert len(spans) == 12
            for (_, end, _), (start, _, _) in zip(spans, spans[1:]):
                assert start >= end, f"{dev.name}: two graphs at once"
            # the busy clock agrees: its total is the sum of the graphs' spans, none overlapping
            assert dev.busy.total_us() >= sum(b - a for a, b, _ in spans)
        # and the groups did overlap: one computed on SIM0 while the other was on SIM1
        assert any(a0 < b1 and a1 < b0 for a0, b0, _ in devices[0].spans for a1, b1, _ in devices[1].spans)
        for ctx in contexts:
            ctx.free()
    finally:
        engine.close()


def test_a_link_costs_at_least_its_delay_per_transfer(tiny_model):
    delay = 10.0
    devices = [SimBackend(f"SIM{i}", fixed_ms=0, link_delay_ms=delay) for i in range(2)]
    engine = engine_of(tiny_model, devices)
    try:
        assert not any(d.host_memory for d in devices)  # behind a link: no device reads them in place
        ctx = engine.new_context(64, 2, 64, 64)
        t0 = time.perf_counter()
        decode_rows(ctx, 2)
        took = time.perf_counter() - t0
        # the hidden state SIM0 -> SIM1 over two links, the logits back over SIM1's
        assert took >= 3 * delay / 1e3
        assert devices[0].link_s_total == 0
        assert devices[1].link_s_total == pytest.approx(3 * delay / 1e3)
        ctx.free()
    finally:
        engine.close()


@pytest.mark.parametrize("sim_first", [True, False])
def test_a_link_between_the_simulated_device_and_the_cpu(tiny_model, sim_first):
    delay = 10.0
    sim = SimBackend("SIM0", fixed_ms=0, link_delay_ms=delay, link_gbit_s=1.0)
    devices = [sim, CPUBackend(1)] if sim_first else [CPUBackend(1), sim]
    engine = engine_of(tiny_model, devices)
    try:
        hp = engine.model.hparams
        ctx = engine.new_context(64, 2, 64, 64)
        t0 = time.perf_counter()
        decode_rows(ctx, 2)
        took = time.perf_counter() - t0
        plan = next(iter(ctx._plans.values()))
        copies = [c for s in plan.splits for c in s.copies]
        assert len(copies) == 1
        hidden = 2 * hp.n_embd * 4
        if sim_first:
            # the CPU takes no direct copy from a device behind a link: it is read with SIM0's graph
            assert copies[0].staging is not None
            want = delay / 1e3 + hidden * 8 / 1e9
        else:
            # into SIM0 over its link, and the logits back over it
            assert copies[0].staging is None
            want = 2 * delay / 1e3 + (hidden + 2 * hp.n_vocab * 4) * 8 / 1e9
        assert sim.link_s_total == pytest.approx(want)
        assert took >= want
        ctx.free()
    finally:
        engine.close()


def test_no_command_line_reaches_the_simulated_device():
    from pyllama.generate import build_parser as generate_parser
    from pyllama.rpc_server.__main__ import build_parser as rpc_parser
    from pyllama.rpc_server.__main__ import open_device
    from pyllama.runtime.placement.devices import device_names, list_devices, make_backends
    from pyllama.server.options import build_parser as server_parser
    for name in ("SIM0", "sim0", "SIM"):
        with pytest.raises(PyllamaError, match="unknown device"):
            make_backends(name, None, "layer", 1)
        with pytest.raises(PyllamaError):
            open_device(name, 1)
    assert device_names("SIM0,CPU", None) == ["SIM0", "CPU"]  # names pass; making them is refused above
    listed = list_devices(argparse.Namespace(rpc=None, rpc_token_file=None, rpc_timeout=None))
    assert "SIM" not in listed and "simulated" not in listed
    for parser in (server_parser(), generate_parser(), rpc_parser()):
        text = parser.format_help()
        assert not re.search(r"\bsim\d*\b|simulat", text, re.IGNORECASE)
    # and no module of the package but the device's own names it
    for path in (ROOT / "pyllama").rglob("*.py"):
        if path.name == "sim.py" and path.parent.name == "backend":
            continue
        source = path.read_text()
        assert "SimBackend" not in source and "backend.sim" not in source and "from .sim" not in source, path


def test_pipeline_sim_bench_end_to_end(tiny_model, tmp_path):
    out = tmp_path / "sim.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "pipeline_sim.py"), "--model", tiny_model,
                           "--stages", "2", "--groups", "1,2", "--steps", "5", "--stage-ms", "2",
                           "--link", "none,1", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["config"]["stages"] == [2] and report["config"]["links"] == ["none", "1ms"]
    rows = report["rows"]
    assert [(r["link"], r["groups"]) for r in rows] == [("none", 1), ("none", 2), ("1ms", 1), ("1ms", 2)]
    for r in rows:
        assert len(r["busy"]) == 2
        assert all(0 < b <= 1 for b in r["busy"]) and r["min_busy"] == min(r["busy"])
        assert r["tok_s"] > 0 and r["steps"] >= 5 * r["groups"]
        m = r["model"]
        assert 0 < m["min_busy"] <= 1 and m["tok_s"] > 0 and m["cycle_ms"] > 0
        assert r["stage_ms"] == pytest.approx([2.0, 2.0])
        assert len(r["over_ms"]) == len(r["gap_ms"]) == 2 and all(o > -0.01 for o in r["over_ms"])
    # the model: one group over two 2 ms stages is busy half the time; over 1 ms links (two per
    # hop, one back) the chain is 4 + 2 + 1 ms
    assert rows[0]["model"]["min_busy"] == pytest.approx(0.5)
    assert rows[2]["chain_ms"] == pytest.approx(7.0)
    assert [s["model_groups_90"] for s in report["summary"]] == [2, 4]
    assert "groups for every stage >= 90% busy" in proc.stdout
