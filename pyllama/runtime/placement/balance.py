"""The default layer split over several devices, balanced by measured speed.

A layer split is a pipeline: with pipeline groups every stage works at once, and the tokens/s
follow the slowest stage. Free memory (llama.cpp's default) says nothing about speed, and the
last device also runs the output layer (the `n_vocab x n_embd` product, several blocks' worth of
work for small models) and so should hold fewer blocks. So, without -ts (and without -ngl), with
PYLLAMA_SPLIT_PROBE=1, the engine times each device before loading the model:

- a probe model of the first K blocks (K = min(n_layer, 3)) and the output layer is placed on that
  device alone, a context of `batch` sequences is filled with `prompt` positions each, and decode
  steps of `batch` rows (one token per sequence, the per-group batch of a server) are timed: with K
  blocks and with 1 block, each ending at the output norm, and on the last device also with K
  blocks and the logits. Each figure is the median of several interleaved steps after a warm-up.
- from those: per device a fixed cost per step (dispatch, round trip, embedding rows), a cost per
  block, and on the last device the output layer's cost (its product and the logits read back);
- the split minimises the slowest stage's step time (`balance_layers`), each device holding at
  most the blocks that fit its free memory.

The choice is logged at INFO with the modelled stage times and the free-memory split it replaces.
The probe runs only with `PYLLAMA_SPLIT_PROBE=1` (otherwise the split follows free memory, as
llama.cpp's): see `probe_enabled`. A device whose
probe fails (too little memory for the probe) falls back to the free-memory split, with a warning.

The split is chosen once, at load: moving blocks between devices later would mean reloading
their weights and rebuilding every context's KV cache on the other device.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np

from ...backend.base import Backend
from ...util.errors import PyllamaError, UnsupportedOpError
from ...util.settings import current

log = logging.getLogger("pyllama.runtime.placement.balance")

PROBE_BATCH = 16      # decode rows per probe step: a server group's batch at 32 users over 2 groups
PROBE_PROMPT = 32     # positions each probe sequence holds before the timed steps
PROBE_STEPS = 5       # timed steps per figure (the median is used), after one warm-up step
PROBE_BLOCKS = 3      # blocks of the probe model (at most)
MEMORY_MARGIN = 0.9   # share of a device's free memory its blocks may take (KV and buffers need the rest)


@dataclass(frozen=True)
class StageCost:
    """A device's modelled step time: fixed_ms + layers x layer_ms (+ output_ms on the last device)."""

    name: str
    fixed_ms: float
    layer_ms: float
    output_ms: float = 0.0


def stage_ms(costs: Sequence[StageCost], counts: Sequence[int]) -> list[float]:
    """Each stage's modelled step time for `counts` blocks per device. A device other than the
    last that holds no block is no stage (0); the last one always runs the output layer."""
    out = []
    last = len(costs) - 1
    for i, (c, n) in enumerate(zip(costs, counts)):
        if n == 0 and i != last:
            out.append(0.0)
        else:
            out.append(c.fixed_ms + n * c.layer_ms + (c.output_ms if i == last else 0.0))
    return out


def balance_layers(costs: Sequence[StageCost], n_layer: int, caps: Optional[Sequence[Optional[int]]] = None,
                   min_blocks: int = 0) -> Optional[list[int]]:
    """Blocks per device (contiguous, in device order) that minimise the slowest stage's step time,
    each device holding at least `min_blocks` (when there are enough blocks for every device) and
    at most caps[i] blocks (None: no limit). None when the caps leave no room.

    The smallest bottleneck T is found over every stage time a device can have; each device then
    takes as many blocks as keep it within T, and the surplus is taken from the slowest stages."""
    k = len(costs)
    if k == 0:
        raise ValueError("no devices")
    caps = [n_layer if c is None else max(0, min(int(c), n_layer)) for c in (caps or [None] * k)]
    floor_ = min_blocks if n_layer >= min_blocks * k else 0
    if sum(caps) < n_layer or any(c < floor_ for c in caps):
        return None
    if n_layer == 0:
        return [0] * k
    costs = [dataclasses.replace(c, layer_ms=max(c.layer_ms, 1e-9)) for c in costs]

    def fill(t: float) -> Optional[list[int]]:
        counts = []
        for i, c in enumerate(costs):
            base = c.fixed_ms + (c.output_ms if i == k - 1 else 0.0)
            if t < base:
                if i == k - 1 or floor_:
                    return None  # the output layer (or the least a device holds) alone exceeds T
                counts.append(0)
                continue
            n = min(caps[i], int(math.floor((t - base) / c.layer_ms + 1e-9)))
            if n < floor_:
                return None
            counts.append(n)
        return counts if sum(counts) >= n_layer else None

    candidates = sorted({v for i in range(k) for m in range(floor_, caps[i] + 1)
                         for v in [stage_ms(costs, [m if j == i else 0 for j in range(k)])[i]]})
    lo, hi = 0, len(candidates) - 1
    if fill(candidates[hi]) is None:
        return None
    while lo < hi:  # feasibility grows with T: the first feasible candidate
        mid = (lo + hi) // 2
        if fill(candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    counts = fill(candidates[lo])
    assert counts is not None
    while sum(counts) > n_layer:
        times = stage_ms(costs, counts)
        i = max((j for j in range(k) if counts[j] > floor_), key=lambda j: (times[j], j))
        counts[i] -= 1
    return counts


def probe_enabled() -> bool:
    # Off unless asked for: timed alone, a device's probe leaves out the serving process's own host
    # work (HTTP, batching, sampling, detokenizing), which shares the local device's cores, so the
    # local stage comes out too cheap (medium f32, RPC0,CPU, 2 groups: the probe chose 9,3 where
    # 7,5 served 10-20% more tokens/s, docs/pipeline-groups.md).
    return current().split.probe


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """The probe's model loads would log as if they were the model: keep that logger at WARNING."""
    logger = logging.getLogger(name)
    old = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(old)


def _view(model, n_layer: int):
    """The model seen as its first `n_layer` blocks (the same file, weights and output layer)."""
    v = copy.copy(model)
    v.hparams = dataclasses.replace(model.hparams, n_layer=n_layer)
    return v


def probe_device(model, backend: Backend, last: bool, map_weights: bool = True, batch: int = PROBE_BATCH,
                 prompt: int = PROBE_PROMPT, steps: int = PROBE_STEPS) -> StageCost:
    """Times decode steps of `batch` rows on `backend` alone (see the module docstring)."""
    from ..context import Batch, Context  # noqa: PLC0415 - the engine imports this module
    from ...models.weights import Placement, load_weights  # noqa: PLC0415

    n_layer = model.hparams.n_layer
    big = max(1, min(PROBE_BLOCKS, n_layer))
    views = [_view(model, big)] + ([_view(model, 1)] if big > 1 else [])
    rounds = 1 + steps
    n_steps = rounds * (2 if last else 1)  # decode steps each context takes (positions it needs)
    seq_cap = prompt + n_steps + 1
    rng = np.random.default_rng(0)
    n_vocab = model.hparams.n_vocab
    weights = None
    contexts = []
    with _quiet("pyllama.models.weights"):
        try:
            weights = load_weights(views[0], Placement([backend], [0] * big), map_weights=map_weights)
            for v in views:
                contexts.append(Context(v, weights, Placement([backend], [0] * v.hparams.n_layer),
                                        n_ctx=batch * seq_cap, n_seq_max=batch, n_batch=batch * prompt,
                                        n_ubatch=min(batch * prompt, 256)))
            seqs = np.arange(batch, dtype=np.int32)
            for ctx in contexts:  # every sequence holds `prompt` positions, as a running request would
                toks = rng.integers(0, n_vocab, batch * prompt)
                ctx.decode(Batch(toks, np.tile(np.arange(prompt), batch), np.repeat(seqs, prompt),
                                 np.zeros(batch * prompt, dtype=bool)))
            pos = [prompt] * len(contexts)
            # (context index, logits?) per figure: K blocks, 1 block, and on the last device K + logits
            figures = [(0, False)] + ([(1, False)] if big > 1 else []) + ([(0, True)] if last else [])
            times: dict[tuple[int, bool], list[float]] = {f: [] for f in figures}
            for r in range(rounds):
                for ci, logits in figures:
                    ctx = contexts[ci]
                    b = Batch(rng.integers(0, n_vocab, batch), np.full(batch, pos[ci]), seqs,
                              np.ones(batch, dtype=bool))
                    pos[ci] += 1
                    t0 = time.perf_counter()
                    ctx.decode(b, embeddings=not logits)
                    ctx.synchronize()
                    if r:  # the first round builds and sends the graphs
                        times[(ci, logits)].append((time.perf_counter() - t0) * 1e3)
        finally:
            for ctx in contexts:
                ctx.forget_plans()  # what the device bound for the probe's graphs goes now
                ctx.free()
            if weights is not None:
                weights.free()
    t_big = statistics.median(times[(0, False)])
    if big > 1:
        t_one = statistics.median(times[(1, False)])
        layer = (t_big - t_one) / (big - 1)
        fixed = t_one - layer
        if layer <= 0 or fixed < 0:  # noise larger than a block's cost: no fixed part
            layer, fixed = t_big / big, 0.0
    else:
        layer, fixed = t_big, 0.0
    output = max(0.0, statistics.median(times[(0, True)]) - t_big) if last else 0.0
    return StageCost(backend.name, fixed, layer, output)


def layer_bytes(model, backend: Backend, map_weights: bool = True) -> int:
    """Bytes one block's weights take on `backend` (planned on paper, nothing allocated)."""
    from ...models.weights import Placement, load_weights  # noqa: PLC0415

    n = model.hparams.n_layer
    if n == 0:
        return 0
    big = min(2, n)
    sizes = []
    for k in sorted({1, big}):
        w = load_weights(_view(model, k), Placement([backend], [0] * k), upload=False, map_weights=False)
        sizes.append(w.bytes_per_backend.get(backend.name, 0))
    return sizes[-1] - sizes[0] if big > 1 else sizes[0]


def memory_caps(model, backends: Sequence[Backend]) -> list[Optional[int]]:
    """The most blocks each device's free memory holds (MEMORY_MARGIN of it; None: no limit known)."""
    caps: list[Optional[int]] = []
    for b in backends:
        size = layer_bytes(model, b)
        free = b.device_info().free
        caps.append(None if size <= 0 or free <= 0 else int(free * MEMORY_MARGIN // size))
    return caps


def describe(costs: Sequence[StageCost], counts: Sequence[int]) -> str:
    """e.g. 'RPC0 7 (0.4 + 7 x 3.1 = 22.1 ms), CPU 5 (0.3 + 5 x 3.0 + output 6.2 = 21.5 ms)'."""
    times = stage_ms(costs, counts)
    parts = []
    for i, (c, n, t) in enumerate(zip(costs, counts, times)):
        out = f" + output {c.output_ms:.2f}" if i == len(costs) - 1 else ""
        parts.append(f"{c.name} {n} ({c.fixed_ms:.2f} + {n} x {c.layer_ms:.2f}{out} = {t:.2f} ms)")
    return ", ".join(parts)


def output_blocks(model) -> float:
    """The output layer's weight bytes in blocks' worth (the mean block's bytes in the file): what
    the output product is taken to cost beside a block when nothing timed it (0 without blocks)."""
    tensors = model.file.tensors
    n = model.hparams.n_layer
    out = tensors.get("token_embd.weight" if model.tied_output else "output.weight")
    blocks = sum(t.raw.nbytes for name, t in tensors.items() if name.startswith("blk."))
    return out.raw.nbytes / (blocks / n) if out is not None and n and blocks else 0.0


@dataclass(frozen=True)
class SplitAdvice:
    """What the devices' measured load says of a split: `counts` the blocks per device that would
    even out their stages (the current counts when no move gains enough), `busiest_now` and
    `busiest_then` the modelled busy share of the slowest stage with the current counts and with
    `counts`."""
    counts: list[int]
    busiest_now: float
    busiest_then: float


ADVICE_GAIN = 0.95  # a different split is advised only when its slowest stage is modelled 5% lighter


def advise_split(names: Sequence[str], busy: Sequence[float], counts: Sequence[int], out_blocks: float,
                 gain: float = ADVICE_GAIN, caps: Optional[Sequence[Optional[int]]] = None) -> Optional[SplitAdvice]:
    """The split a loaded interval's busy shares ask for (device order; the last device holds the
    output layer, worth `out_blocks` blocks of its own). Each device's share is spread evenly over
    what it computes, which gives its cost per block; the blocks are then balanced as the probe's
    costs are (`balance_layers`, every device keeping one and at most caps[i] blocks). None when a
    share cannot be spread (a device with nothing on it) or the figures are not finite."""
    k = len(counts)
    if k < 2 or len(busy) != k or len(names) != k or not all(math.isfinite(b) and b >= 0 for b in busy):
        return None
    units = [n + (out_blocks if i == k - 1 else 0.0) for i, n in enumerate(counts)]
    if any(u <= 0 for u in units):
        return None
    per_block = [b / u for b, u in zip(busy, units)]
    costs = [StageCost(name, 0.0, c, out_blocks * c if i == k - 1 else 0.0)
             for i, (name, c) in enumerate(zip(names, per_block))]
    now = max(stage_ms(costs, counts))
    best = balance_layers(costs, sum(counts), caps, min_blocks=1)
    if best is None:
        return None
    then = max(stage_ms(costs, best))
    if then >= gain * now:
        return SplitAdvice(list(counts), now, now)
    return SplitAdvice(best, now, then)


def counts_of(layer_backend: Sequence[int], n_devices: int) -> list[int]:
    return [sum(1 for x in layer_backend if x == i) for i in range(n_devices)]


@dataclass(frozen=True)
class MeasuredSplit:
    counts: list[int]          # blocks per device, in device order
    costs: list[StageCost]     # what the probe measured


def measured_split(model, backends: Sequence[Backend], fallback: Sequence[float], map_weights: bool = True,
                   batch: int = PROBE_BATCH) -> Optional[MeasuredSplit]:
    """Blocks per device balanced by each device's timed step cost, or None (the caller keeps
    `fallback`, the free-memory split) when the probe is off, fails on a device, or the memory
    caps leave no room. Logs the choice at INFO."""
    from ...models.weights import split_layers  # noqa: PLC0415

    if len(backends) < 2 or not probe_enabled():
        return None
    n_layer = model.hparams.n_layer
    t0 = time.perf_counter()
    costs = []
    for i, b in enumerate(backends):
        try:
            costs.append(probe_device(model, b, i == len(backends) - 1, map_weights, batch))
        except UnsupportedOpError:
            return None  # the model's own load refuses this device, naming it: no second message
        except (PyllamaError, MemoryError, OSError) as exc:
            log.warning("timing %s for the layer split failed (%s): splitting by free memory", b.name, exc)
            return None
    # a device listed is there on purpose (memory, a peer to use): each keeps at least one block
    counts = balance_layers(costs, n_layer, memory_caps(model, backends), min_blocks=1)
    if counts is None:
        log.warning("the split by measured speed does not fit the devices' free memory: splitting by free memory")
        return None
    by_memory = counts_of(split_layers(n_layer, fallback), len(backends))
    log.info("layer split by measured speed (%d-row decode steps, probed in %.1f s): %s; by free memory it would "
             "be %s", batch, time.perf_counter() - t0, describe(costs, counts), describe(costs, by_memory))
    return MeasuredSplit(counts, costs)
