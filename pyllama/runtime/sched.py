"""Splits a forward graph over backends, inserts the copies at device boundaries, places memory.

Like ggml's backend scheduler it never asks what kind of device it holds: a node runs on the
backend of its layer, consecutive nodes of one backend form a split, a tensor produced on one
backend and read on another is copied once into the consumer's compute buffer, and every
intermediate tensor gets an offset in its backend's compute buffer by liveness (first fit).
A scheduler belongs to one context (one pipeline group) and queues all its work, inputs, copies,
graphs and reads, on a stream of its own on each device (`Backend.new_stream`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..obs import trace
from ..backend.base import Backend, Buffer, Tensor
from ..backend.stream import Stream
from ..models.build.llama import ForwardGraph
from ..models.build.ops import Graph
from ..models.weights import Placement
from ..util.errors import UnsupportedOpError

log = logging.getLogger(__name__)

ALIGN = 64


@dataclass
class Copy:
    src: Tensor
    dst: Tensor
    producer: Stream  # the stream the source is computed on
    staging: Optional[np.ndarray] = None  # host bytes, when the devices cannot copy directly
    source: bool = False  # the producer copies it (cpy_tensor_from_async), gated by its own event


@dataclass
class Split:
    backend_index: int
    backend: Backend
    graph: Graph
    stream: Stream  # this scheduler's stream on `backend`
    copies: list[Copy] = field(default_factory=list)  # inputs from other backends, before compute
    outgoing: list[Copy] = field(default_factory=list)  # later copies read back with this split's graph
    # the graph inputs written just before this split: (name, its copy on this backend), at the
    # backend's first split
    inputs: list[tuple[str, Tensor]] = field(default_factory=list)


@dataclass
class Plan:
    """A forward graph placed on devices, ready to run any number of times."""

    splits: list[Split]
    input_names: frozenset[str]  # the graph inputs some split reads
    output: Optional[Tensor]
    generation: int
    peaks: list[int]


@dataclass
class Job:
    """One micro-batch to run: its plan, its input values by name, and where its output is read
    (None: not read; on a host device it stays in the compute buffer)."""

    plan: Plan
    values: dict[str, np.ndarray]
    output: Optional[np.ndarray] = None


class _FirstFit:
    """Offsets inside one buffer, reusing the space of tensors whose last reader has run."""

    def __init__(self) -> None:
        self.free: list[tuple[int, int]] = []  # (offset, size), sorted by offset
        self.top = 0

    def alloc(self, size: int) -> int:
        size = -(-size // ALIGN) * ALIGN
        for i, (off, sz) in enumerate(self.free):
            if sz >= size:
                if sz == size:
                    del self.free[i]
                else:
                    self.free[i] = (off + size, sz - size)
                return off
        off = self.top
        self.top += size
        return off

    def release(self, off: int, size: int) -> None:
        size = -(-size // ALIGN) * ALIGN
        self.free.append((off, size))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for o, s in self.free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        if merged and merged[-1][0] + merged[-1][1] == self.top:  # give the tail back
            self.top = merged[-1][0]
            merged.pop()
        self.free = merged


class Scheduler:
    """Owns one compute buffer per backend for one context, and turns graphs into plans."""

    def __init__(self, placement: Placement, dry: bool = False):
        """dry=True plans without allocating anything: `peaks` tells the buffer sizes needed."""
        self.placement = placement
        self.backends = placement.backends
        self.buffers: list[Optional[Buffer]] = [None] * len(self.backends)
        self.streams: list[Stream] = [b.new_stream() for b in self.backends]
        self.generation = 0
        self.dry = dry
        self.peaks = [0] * len(self.backends)

    # ------------------------------------------------------------------------------------------
    def plan(self, fg: ForwardGraph) -> Plan:
        nb = len(self.backends)
        node_backend = [self.placement.backend_of_layer(nd.layer) for nd in fg.nodes]
        # each device is asked about each node it gets, once per plan: the load asked about the
        # graph of a small batch (models/weights.py, check_placement), and a plan's graph may
        # hold what that one did not (a SAMPLE node)
        for nd, bi in zip(fg.nodes, node_backend):
            if not self.backends[bi].supports_node(nd):
                raise UnsupportedOpError(
                    f"{nd.op.name} ({nd.out.name}{'' if nd.layer < 0 else f', layer {nd.layer}'}) cannot run on "
                    f"{self.backends[bi].name}: keep that layer on a device that runs it (the CPU)")
        input_names = {id(t): name for name, t in fg.inputs.items()}
        produced: dict[int, int] = {}  # id(tensor) -> backend index that produces it
        for nd, bi in zip(fg.nodes, node_backend):
            produced[id(nd.out)] = bi

        # 1. split into runs of one backend; redirect cross-backend reads to local copies
        splits: list[Split] = []
        local: dict[tuple[int, int], Tensor] = {}  # (id(tensor), backend) -> tensor to read there
        first_split: dict[int, Split] = {}  # backend index -> its first split
        for nd, bi in zip(fg.nodes, node_backend):
            if not splits or splits[-1].backend_index != bi:
                splits.append(Split(bi, self.backends[bi], Graph([]), self.streams[bi]))
                first_split.setdefault(bi, splits[-1])
            split = splits[-1]
            new_srcs = []
            for src in nd.srcs:
                key = (id(src), bi)
                if key in local:
                    new_srcs.append(local[key])
                elif id(src) in input_names:
                    copy = Tensor(src.dtype, src.shape, src.name)
                    first_split[bi].inputs.append((input_names[id(src)], copy))
                    local[key] = copy
                    new_srcs.append(copy)
                elif id(src) in produced and produced[id(src)] != bi:
                    copy = Tensor(src.dtype, src.shape, src.name)
                    split.copies.append(Copy(src, copy, self.streams[produced[id(src)]]))
                    local[key] = copy
                    new_srcs.append(copy)
                else:
                    if src.buffer is not None and src.buffer.backend is not self.backends[bi]:
                        raise RuntimeError(f"{src.name} lives on {src.buffer.backend.name}, read on {self.backends[bi].name}")
                    new_srcs.append(src)
            nd.srcs = tuple(new_srcs)
            split.graph.nodes.append(nd)

        # 2. lifetimes in execution order: a copy is read at its split's start
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        tensors: dict[int, tuple[int, Tensor]] = {}
        step = 0
        for split in splits:
            for c in split.copies:
                last[id(c.src)] = step
                first.setdefault(id(c.dst), step)
                tensors[id(c.dst)] = (split.backend_index, c.dst)
                step += 1
            for nd in split.graph.nodes:
                for src in nd.srcs:
                    last[id(src)] = step
                    if src.buffer is None and id(src) not in tensors:  # an input copy
                        tensors[id(src)] = (split.backend_index, src)
                        first[id(src)] = -1
                first.setdefault(id(nd.out), step)
                tensors[id(nd.out)] = (split.backend_index, nd.out)
                step += 1
        if fg.output is not None:
            last[id(fg.output)] = step + 1  # read back after compute

        # 3. first-fit placement per backend
        allocs = [_FirstFit() for _ in range(nb)]
        peaks = [0] * nb
        events: list[tuple[int, int, int]] = []  # (step, kind 0=alloc 1=free, id)
        for tid in tensors:
            events.append((first[tid], 0, tid))
            events.append((last.get(tid, first[tid]), 1, tid))
        # At one step allocations come before frees, so a node never writes over its own inputs.
        events.sort(key=lambda e: (e[0], e[1]))
        offsets: dict[int, int] = {}
        for _, kind, tid in events:
            bi, t = tensors[tid]
            if kind == 0:
                offsets[tid] = allocs[bi].alloc(t.nbytes)
                peaks[bi] = max(peaks[bi], allocs[bi].top)
            else:
                allocs[bi].release(offsets[tid], t.nbytes)

        # a tensor that leaves a device without a direct copy is staged through the host
        for i, split in enumerate(splits):
            for later in splits[i + 1:]:
                for c in later.copies:
                    if produced[id(c.src)] == split.backend_index and not later.backend.can_copy_from(split.backend):
                        if split.backend.can_copy_to(later.backend):
                            c.source = True  # no read with the graph: the producer sends it when done
                            continue
                        c.staging = np.empty(c.src.nbytes, dtype=np.uint8)
                        split.outgoing.append(c)
        self.peaks = [max(a, b) for a, b in zip(self.peaks, peaks)]
        names = frozenset(name for split in splits for name, _ in split.inputs)
        if self.dry:
            return Plan(splits, names, fg.output, self.generation, peaks)
        self._ensure_buffers(peaks)
        for tid, (bi, t) in tensors.items():
            t.buffer = self.buffers[bi]
            t.offset = offsets[tid]
        return Plan(splits, names, fg.output, self.generation, peaks)

    def _ensure_buffers(self, peaks: list[int]) -> None:
        for bi, peak in enumerate(peaks):
            buf = self.buffers[bi]
            if peak == 0 or (buf is not None and buf.size >= peak):
                continue
            # plans placed in the old buffer are stale from here on, even if the allocation below
            # fails (a lost peer): none may run on a freed buffer
            self.generation += 1
            if buf is not None:
                self.buffers[bi] = None
                self.backends[bi].free_buffer(buf)
            self.buffers[bi] = self.backends[bi].alloc_buffer(peak, usage="compute")
            log.debug("compute buffer on %s: %.1f MiB", self.backends[bi].name, peak / 2**20)

    def compute_buffer_bytes(self) -> dict[str, int]:
        return {b.name: (buf.size if buf else 0) for b, buf in zip(self.backends, self.buffers)}

    # ------------------------------------------------------------------------------------------
    def compute_ubatches(self, jobs: list[Job]) -> None:
        """Runs a step's micro-batches: each split sets its inputs and runs with its copies. A
        tensor that leaves a device is read back as part of its producing graph (so no other
        user's command can come between the graph and the read on a shared connection) and written
        to the consumer before its graph. A job's `output` is read the same way with the last
        split: complete it with the output backend's synchronize().

        Over a split whose devices all run their commands in order (`Backend.in_order`), the
        micro-batches go through the stages as a wavefront: while micro-batch u runs on stage s,
        u + 1 runs on stage s - 1, so a long prompt keeps every device of the split busy instead
        of one at a time (llama.cpp's pipeline parallelism). Round t holds the pairs (u, s) with
        u + s = t; their hand-overs are made first, the latest stage first (each waits only for
        its producer's read), then the stages that compute asynchronously (a peer) are issued,
        then the ones that compute on this thread. A device's next micro-batch is written only
        after its previous one was issued, and in-order devices run it after that one: every
        plan's buffers are used by one micro-batch at a time on each device. Otherwise each
        micro-batch goes through every stage before the next one starts."""
        if len(jobs) > 1 and self._wavefront_ok(jobs):
            n_stages = len(jobs[0].plan.splits)
            order: list[list[tuple[int, int]]] = []
            for t in range(len(jobs) + n_stages - 1):
                order.append([(t - s, s) for s in reversed(range(n_stages)) if 0 <= t - s < len(jobs)])
        else:
            order = [[(u, s)] for u, job in enumerate(jobs) for s in range(len(job.plan.splits))]
        traced = trace.enabled
        regions: dict[tuple[int, int], object] = {}  # (micro-batch, id(copy)) -> its staging region
        started: dict[tuple[int, int], int] = {}  # traced: (micro-batch, split) -> when its inputs began
        try:
            for items in order:
                for u, s in items:
                    if traced:
                        started[(u, s)] = trace.now()
                    split, values = jobs[u].plan.splits[s], jobs[u].values
                    for name, t in split.inputs:
                        split.stream.set_tensor_async(t, values[name])
                    self._hand_over(split, u, regions, traced)
                for u, s in sorted(items, key=lambda it: not jobs[it[0]].plan.splits[it[1]].backend.compute_async):
                    self._run_split(jobs[u], s, u, regions, started.pop((u, s), 0))
        finally:
            for region in regions.values():  # a failed step must not keep arena space
                region.release()  # type: ignore[attr-defined]

    @staticmethod
    def _wavefront_ok(jobs: list[Job]) -> bool:
        """Whether micro-batches may overlap: the same devices in the same order in every plan,
        each device once, all in order, no copy a producer makes on its own (an event-gated
        device copy, not ordered with its stream's next write)."""
        first = [split.backend for split in jobs[0].plan.splits]
        if len(first) < 2 or len({id(b) for b in first}) != len(first) or not all(b.in_order for b in first):
            return False
        for job in jobs:
            if [split.backend for split in job.plan.splits] != first:
                return False
            if any(c.source for split in job.plan.splits for c in split.copies):
                return False
        return True

    def _hand_over(self, split: Split, u: int, regions: dict, traced: bool) -> None:
        """The split's inputs from other devices: direct copies, or the bytes read with the
        producer's graph (waited for here) written to this device."""
        for c in split.copies:
            if c.source:
                self._source_copy(c, split, traced)
            elif c.staging is None:
                split.stream.cpy_tensor_async(c.src, c.dst)
            else:
                self._staged_copy(c, split, regions.pop((u, id(c)), None), traced)

    @staticmethod
    def _run_split(job: Job, i: int, u: int, regions: dict, t_split: int) -> None:
        """Computes split i of micro-batch u, with the reads of what leaves its device (and, on
        the last split, the output) sent along with its graph. t_split: when its inputs began
        (traced; 0 untraced)."""
        plan, output = job.plan, job.output
        split = plan.splits[i]
        traced = t_split != 0
        reads = []
        for c in split.outgoing:
            # the producer's own staging arena when it has one (shared by every group on
            # that connection), else the host bytes this plan set aside
            t_alloc = trace.now() if traced else 0
            region = c.producer.stage_read(c.src)
            if traced:
                trace.event("sched", "copy_alloc", t_alloc, trace.now(), backend=c.src.backend.name,
                            subj=c.src.name, nbytes=c.src.nbytes, arena=region is not None,
                            grp=trace.group())
            if region is not None:
                regions[(u, id(c))] = region
            reads.append((c.src, region.view if region is not None else c.staging))
        if output is not None and i == len(plan.splits) - 1 and plan.output is not None:
            reads.append((plan.output, output))
        split.stream.graph_compute(split.graph, reads)
        if traced:
            trace.event("sched", "split", t_split, trace.now(), backend=split.backend.name,
                        n_inputs=len(split.copies), n_nodes=len(split.graph.nodes), grp=trace.group())

    @staticmethod
    def _source_copy(c: Copy, split: Split, traced: bool) -> None:
        """A copy the producer makes itself: it waits for an event recorded after the bytes left
        its device, never for the producing stream, then writes them to the consumer."""
        t0 = trace.now() if traced else 0
        if not c.producer.cpy_tensor_from_async(c.src, c.dst):
            raise RuntimeError(f"{c.src.backend.name} declined the copy of {c.src.name} to {split.backend.name} it "
                               "said it could make")
        if traced:
            trace.event("sched", "copy_event", t0, trace.now(), backend=split.backend.name, subj=c.dst.name,
                        nbytes=c.dst.nbytes, grp=trace.group())

    @staticmethod
    def _staged_copy(c: Copy, split: Split, region, traced: bool) -> None:
        """Waits for the read sent with the producing graph, writes the bytes to the consumer and
        frees the staging; traced, as its two halves (waiting for the read, the write)."""
        t0 = trace.now() if traced else 0
        try:
            c.producer.synchronize()
            t1 = trace.now() if traced else 0
            split.stream.set_tensor_async(c.dst, region.view if region is not None else c.staging)
        finally:
            if region is not None:
                region.release()  # set_tensor_async of a host-synchronous device has taken the bytes
        if traced:
            t2 = trace.now()
            fields = dict(backend=split.backend.name, subj=c.dst.name, nbytes=c.dst.nbytes, grp=trace.group())
            trace.event("sched", "copy_read", t0, t1, **fields)
            trace.event("sched", "copy_send", t1, t2, **fields)
            trace.event("sched", "copy_stage", t0, t2, **fields)


    def synchronize(self) -> None:
        """Waits for everything queued on this scheduler's streams."""
        for stream in self.streams:
            stream.synchronize()

    def free(self) -> None:
        for bi, buf in enumerate(self.buffers):
            if buf is not None:
                self.backends[bi].free_buffer(buf)
                self.buffers[bi] = None
        for stream in self.streams:
            stream.release()
