"""Pipeline groups over simulated stages: each stage's busy share per group count and link.

    python bench/pipeline_sim.py [--model PATH] [--stages 2,3,4,8] [--groups 1,2,4,8]
        [--link none,2/1] [--batch 4] [--steps 20] [--warmup 2] [--stage-ms 4] [--json OUT]

A split of N stages needs N devices; this one runs them on any machine: each stage is a
`SimBackend` (pyllama/backend/sim.py), a device whose graph takes a modelled time (a sleep, the
GIL released) and writes zeros, so what is measured is the pipeline's occupancy, not kernels.
The model (without --model: the `deep` preset, 24 blocks of the tiny model's widths, made with
`python -m pyllama.models.make` under bench/out/models/) is split over N simulated devices in
equal blocks (`tensor_split` 1,...,1). Each device's bandwidth is then set so that its graph of
one decode step (B rows) takes --stage-ms: every stage costs the same T.

For each (stages, link, groups): G contexts (`Engine.new_context`, one per pipeline group) each
decode B sequences, one token per sequence per step, in a thread of their own (as the server's
decode threads do). Once every group has made --warmup steps the window opens; it closes when
the groups have made G x --steps steps together (so every group is working throughout: no ramp
and no tail are measured). Per window: tokens/s, each device's busy share (the busy time of its
BusyClock over the window's wall time), the smallest share, and the model's prediction; in the
JSON also per device `over_ms`, how much longer than modelled its graphs held it (the sleep's
wake-up), and `gap_ms`, the mean time between one graph's end and the next one's start (idle
waiting for a group, or the hand-over from one group's thread to the next).

--link DELAY_MS/GBIT_S (`none`: no link; `2/1`: 2 ms and 1 Gbit/s; `2`: 2 ms, no rate cap) puts
every simulated device behind such a link, as rpc peers are behind the network: a hidden state
going from one stage to the next goes through the host, over two links, and the logits come
back over the last stage's one (sim.py states what pays the link).

The model. A group's step is a chain: stage 1 computes (T), the hidden state goes to stage 2
(a hop), ..., stage N computes, the logits come back:

    C = N T + (N - 1) H + R,   H = 2 (d + h / r),   R = d + o / r

with d the link's delay, r its rate, h = B n_embd 4 bytes (the hidden state), o = B n_vocab 4
bytes (the logits); without a link H = R = 0. A stage serves each of the G groups once per
group step, T each, so a group's step (the cycle) takes max(C, G T): the chain when the groups
are too few to keep the stages fed, else the G graphs queued on a stage. Then

    busy share = G T / max(C, G T) = min(1, G T / C)
    tokens/s   = G B / max(C, G T)
    groups for >= 90 % busy: the smallest G with G T >= 0.9 C

The host's own work per step (building the batch, the scheduler, Python between the stages) is
not in C; the table's `step ms` (each group's measured step time) against `model` shows it: at
G = 1 their difference is that host time.

Prints the table, then per (stages, link) the groups the model says keep every stage >= 90 %
busy, the fewest of the groups run that did, and the host time per step (the measured step at
G = 1 less C). --json OUT writes the configuration, every row and that summary.

Keep runs short: a window lasts about --steps x max(C, G T), so --stages 4,8 --groups 1..8 with
both links takes about 30 s at --stage-ms 4.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # a checkout without an install
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from pyllama.backend.sim import SimBackend  # noqa: E402
from pyllama.obs.trace import now as now_us  # noqa: E402
from pyllama.runtime.context import Batch  # noqa: E402
from pyllama.runtime.engine import Engine  # noqa: E402

BUSY_TARGET = 0.9


def parse_ints(text: str) -> list[int]:
    out = [int(x) for x in text.split(",") if x.strip()]
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers, comma-separated")
    return out


def parse_link(text: str) -> Optional[tuple[float, Optional[float]]]:
    """'none' -> None; 'D' -> (D ms, no rate cap); 'D/R' -> (D ms, R Gbit/s; R 'none' or 'inf': no cap)."""
    t = text.strip().lower()
    if t in ("none", ""):
        return None
    delay, _, rate = t.partition("/")
    d = float(delay)
    r = None if rate in ("", "none", "inf") else float(rate)
    if d < 0 or (r is not None and r <= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: a delay >= 0 ms and a rate > 0 Gbit/s")
    return d, r


def link_label(link: Optional[tuple[float, Optional[float]]]) -> str:
    if link is None:
        return "none"
    d, r = link
    return f"{d:g}ms" + (f"/{r:g}Gbit" if r else "")


def parse_links(text: str) -> list[Optional[tuple[float, Optional[float]]]]:
    return [parse_link(x) for x in text.split(",") if x.strip()]


# --- the model -------------------------------------------------------------------------------

def chain_s(stage_s: Sequence[float], link: Optional[tuple[float, Optional[float]]], hidden_bytes: int,
            logits_bytes: int) -> float:
    """C: one group's step through every stage and hop, nothing queued (module docstring)."""
    n = len(stage_s)
    if link is None:
        return float(sum(stage_s))
    d, r = link[0] / 1e3, link[1]
    per = (lambda b: d + b * 8 / (r * 1e9)) if r else (lambda b: d)
    return float(sum(stage_s)) + (n - 1) * 2 * per(hidden_bytes) + per(logits_bytes)


def predict(stage_s: Sequence[float], chain: float, groups: int, batch: int) -> dict:
    cycle = max(chain, groups * max(stage_s))
    return {"cycle_ms": cycle * 1e3, "tok_s": groups * batch / cycle,
            "busy": [groups * t / cycle for t in stage_s], "min_busy": groups * min(stage_s) / cycle}


def groups_for(stage_s: Sequence[float], chain: float, target: float = BUSY_TARGET) -> int:
    """The smallest G with G T >= target C for the slowest-to-fill (least loaded) stage."""
    return max(1, math.ceil(target * chain / min(stage_s) - 1e-9))


# --- the run ---------------------------------------------------------------------------------

def default_model() -> str:
    path = os.path.join(ROOT, "bench", "out", "models", "deep-f32.gguf")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        subprocess.run([sys.executable, "-m", "pyllama.models.make", "--preset", "deep", "--out", path],
                       check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    return path


class Groups:
    """G decode threads over G contexts of one engine; a measured window of their steps."""

    def __init__(self, contexts, batch: int, cap: int):
        self.contexts = contexts
        self.batch = batch
        self.cap = cap  # positions per sequence before a context starts over
        self.cond = threading.Condition()
        self.steps = 0
        self.ready = 0
        self.stop = False
        self.error: Optional[BaseException] = None

    def _run(self, ctx, warmup: int) -> None:
        b = self.batch
        seqs = np.arange(b)
        want = np.ones(b, dtype=bool)
        tokens = np.arange(1, b + 1)
        pos = 0
        done = 0
        try:
            ctx.clear()
            while True:
                if pos >= self.cap:  # start over: every step stays one row per sequence
                    ctx.clear()
                    pos = 0
                out = ctx.decode(Batch(tokens, np.full(b, pos), seqs, want))
                tokens = out.logits.argmax(axis=1)
                pos += 1
                done += 1
                with self.cond:
                    if done == warmup:
                        self.ready += 1
                    self.steps += 1
                    self.cond.notify_all()
                    if self.stop:
                        return
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    def measure(self, devices: Sequence[SimBackend], warmup: int, steps: int) -> dict:
        g = len(self.contexts)
        threads = [threading.Thread(target=self._run, args=(ctx, warmup), name=f"sim-group-{i}", daemon=True)
                   for i, ctx in enumerate(self.contexts)]
        for th in threads:
            th.start()
        try:
            with self.cond:
                self.cond.wait_for(lambda: self.ready == g or self.error is not None)
                self._check()
                t0 = now_us()  # the busy clocks' time base: busy over the window <= the window
                busy0 = [d.busy.total_us(t0) for d in devices]
                s0 = self.steps
                self.cond.wait_for(lambda: self.steps - s0 >= g * steps or self.error is not None)
                self._check()
                t1 = now_us()
                busy1 = [d.busy.total_us(t1) for d in devices]
                s1 = self.steps
                self.stop = True
        finally:
            with self.cond:
                self.stop = True
            for th in threads:
                th.join(60)
        wall = (t1 - t0) / 1e6
        n = s1 - s0
        busy = [(b1 - b0) / 1e6 / wall for b0, b1 in zip(busy0, busy1)]
        over, gaps = [], []
        for d in devices:  # the graphs that ran inside the window
            spans = sorted(sp for sp in list(d.spans) if sp[0] >= t0 and sp[1] <= t1)
            over.append(float(np.mean([(b - a) / 1e3 - m * 1e3 for a, b, m in spans])) if spans else None)
            gaps.append(float(np.mean([(c[0] - p[1]) / 1e3 for p, c in zip(spans, spans[1:])]))
                        if len(spans) > 1 else None)
        return {"wall_s": wall, "steps": n, "tok_s": n * self.batch / wall, "step_ms": wall * g / n * 1e3,
                "busy": busy, "min_busy": min(busy), "over_ms": over, "gap_ms": gaps}

    def _check(self) -> None:
        if self.error is not None:
            self.stop = True
            raise RuntimeError(f"a group's decode failed: {self.error!r}") from self.error


def calibrate(ctx, devices: Sequence[SimBackend], batch: int, stage_ms: float) -> list[float]:
    """Sets each device's bandwidth so its graph of one B-row decode step takes stage_ms; returns
    each stage's modelled seconds."""
    for d in devices:
        d.bandwidth_gb_s = 1e9  # a first step at no cost, to learn each graph's bytes
    ctx.clear()
    ctx.decode(Batch(np.arange(1, batch + 1), np.zeros(batch), np.arange(batch), np.ones(batch, dtype=bool)))
    out = []
    for d in devices:
        if d.last_bytes <= 0:
            raise RuntimeError(f"{d.name} computed no weight bytes: nothing to calibrate")
        d.bandwidth_gb_s = d.last_bytes / (stage_ms / 1e3) / 1e9
        out.append(d.modelled_s(d.last_bytes, 0))
    ctx.clear()
    return out


def run(model: str, stages: Sequence[int], groups: Sequence[int], links, batch: int, steps: int, warmup: int,
        stage_ms: float, log=print) -> dict:
    rows, summary = [], []
    cap = warmup + 4 * steps + 16
    for n in stages:
        for link in links:
            devices = [SimBackend(f"SIM{i}", link_delay_ms=link[0] if link else 0.0,
                                  link_gbit_s=link[1] if link else None) for i in range(n)]
            engine = Engine(model, n_threads=1, backends=devices, tensor_split=[1.0] * n)
            contexts = []
            try:
                hp = engine.model.hparams
                blocks = engine.counts()
                contexts = [engine.new_context(batch * cap, batch, max(batch, 8), max(batch, 8))
                            for _ in range(max(groups))]
                stage_s = calibrate(contexts[0], devices, batch, stage_ms)
                chain = chain_s(stage_s, link, batch * hp.n_embd * 4, batch * hp.n_vocab * 4)
                need = groups_for(stage_s, chain)
                reached = None
                for g in groups:
                    got = Groups(contexts[:g], batch, cap).measure(devices, warmup, steps)
                    model_row = predict(stage_s, chain, g, batch)
                    row = {"stages": n, "link": link_label(link), "groups": g, "blocks": blocks,
                           "stage_ms": [t * 1e3 for t in stage_s], "chain_ms": chain * 1e3,
                           "bandwidth_gb_s": [d.bandwidth_gb_s for d in devices], **got, "model": model_row}
                    rows.append(row)
                    if reached is None and got["min_busy"] >= BUSY_TARGET:
                        reached = g
                    log(format_row(row))
                alone = next((r for r in rows[-len(groups):] if r["groups"] == 1), None)
                summary.append({"stages": n, "link": link_label(link), "chain_ms": chain * 1e3,
                                "host_ms": alone["step_ms"] - chain * 1e3 if alone else None,
                                "model_groups_90": need, "measured_groups_90": reached,
                                "groups_tried": list(groups)})
            finally:
                for ctx in contexts:
                    ctx.free()
                engine.close()
    return {"rows": rows, "summary": summary}


HEADER = (f"{'stages':>6} {'link':>12} {'G':>3} {'tok/s':>8} {'model':>8} {'step ms':>8} {'model':>8} "
          f"{'min busy':>8} {'model':>6}  busy per device")


def format_row(r: dict) -> str:
    m = r["model"]
    busy = " ".join(f"{b:.2f}" for b in r["busy"])
    return (f"{r['stages']:>6} {r['link']:>12} {r['groups']:>3} {r['tok_s']:>8.1f} {m['tok_s']:>8.1f} "
            f"{r['step_ms']:>8.2f} {m['cycle_ms']:>8.2f} {r['min_busy']:>8.2f} {m['min_busy']:>6.2f}  {busy}")


def format_summary(summary: Sequence[dict]) -> list[str]:
    lines = [f"groups for every stage >= {BUSY_TARGET:.0%} busy:"]
    for s in summary:
        tried = s["groups_tried"]
        got = s["measured_groups_90"]
        got_text = str(got) if got is not None else f"none of {','.join(map(str, tried))}"
        host = f", host {s['host_ms']:.2f} ms per step at G=1" if s["host_ms"] is not None else ""
        lines.append(f"  {s['stages']} stages, link {s['link']}: model {s['model_groups_90']} "
                     f"(chain {s['chain_ms']:.2f} ms{host}); measured {got_text}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pipeline_sim.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF model (default: the deep preset, made under bench/out/models)")
    ap.add_argument("--stages", type=parse_ints, default=[2, 3, 4, 8], help="stage counts (default 2,3,4,8)")
    ap.add_argument("--groups", type=parse_ints, default=[1, 2, 4, 8], help="pipeline group counts (default 1,2,4,8)")
    ap.add_argument("--link", type=parse_links, default=[None, (2.0, 1.0)],
                    help="links, comma-separated: none, DELAY_MS or DELAY_MS/GBIT_S (default none,2/1)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per group (rows per step, default 4)")
    ap.add_argument("--steps", type=int, default=20, help="steps per group in the measured window (default 20)")
    ap.add_argument("--warmup", type=int, default=2, help="steps per group before the window (default 2)")
    ap.add_argument("--stage-ms", type=float, default=4.0, help="modelled time of one stage's graph (default 4)")
    ap.add_argument("--json", help="write the configuration, rows and summary here")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.batch < 1 or args.steps < 1 or args.warmup < 1 or args.stage_ms <= 0:
        raise SystemExit("--batch, --steps and --warmup must be >= 1 and --stage-ms > 0")
    model = args.model or default_model()
    print(f"model {model}; batch {args.batch}, {args.steps} steps per group, stage {args.stage_ms:g} ms")
    print(HEADER)
    t0 = time.perf_counter()
    result = run(model, args.stages, args.groups, args.link, args.batch, args.steps, args.warmup, args.stage_ms)
    for line in format_summary(result["summary"]):
        print(line)
    print(f"({time.perf_counter() - t0:.1f} s)")
    if args.json:
        config = {"model": model, "stages": args.stages, "groups": args.groups,
                  "links": [link_label(x) for x in args.link], "batch": args.batch, "steps": args.steps,
                  "warmup": args.warmup, "stage_ms": args.stage_ms, "busy_target": BUSY_TARGET}
        with open(args.json, "w") as f:
            json.dump({"config": config, **result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
