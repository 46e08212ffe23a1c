"""A simulated device, for benches and tests: a pipeline stage whose compute takes a modelled time.

It is never made from a command line (the programs' `--device` names CPU, CUDA<i> and RPC<i>
only, `runtime/placement/devices.py`): a bench or a test builds it and hands it to `Engine(...,
backends=[...])`. With it a split of 4 or 8 stages runs on a machine of two cores, and each
stage's busy share per pipeline-group count and link can be measured (`bench/pipeline_sim.py`).

What it is: the CPU backend's buffers (host memory), so a model's weights load (read in place
from the file's memory map, never repacked) and every tensor exists; but `graph_compute` runs no
kernel. It

- computes the graph's modelled time (below), cached per graph;
- holds the device's lock for that long (a real device runs one graph at a time: the graphs of
  two contexts, two pipeline groups, on one device run one after the other), sleeping what the
  work did not take (`time.sleep` releases the GIL, so several simulated devices overlap as real
  ones do);
- writes zeros into every node's output (the logits of a split whose last stage is simulated are
  zeros, and a greedy pick is token 0: enough for a throughput simulator);
- brackets that with the device's `BusyClock`, as the CPU does, and records each graph's span
  (`spans`: start and end, microseconds of `obs.trace.now`, and the modelled seconds).

The time model of one graph:

    bytes = the bytes of every weight its nodes read (sources in a buffer of usage "weights"):
            whole tensors, but for GET_ROWS's table the rows looked up (rows x row bytes) and for
            MOE_FFN's expert tensors the share min(1, rows x experts used / experts)
    flops = 2 x rows x weight elements of each product (MUL_MAT, MUL_MAT_CAT, MOE_FFN, experts
            counted as above), rows the activation rows
    time  = max(bytes / bandwidth, flops / flops_per_s)   (the second term only with `flops`)

Activations, the KV cache, norms' arithmetic and attention's are not counted: a decode step of a
real model is bound by reading its weights. A time set directly (`fixed_ms`, for tests) replaces
the model.

The link (`link_delay_ms`, `link_gbit_s`): a device behind a link, like an rpc peer, whose every
transfer of a split's tensor takes `delay + bytes / rate` (a sleep outside the device's lock: a
transfer does not stop the device computing another group's graph). Such a device's tensors do
not count as host memory (`host_memory` False), so the scheduler plans each of its split copies
through a path that pays the link once per linked end:

- into this device (`cpy_tensor_async`, asked of the destination): the link of this device, plus
  that of the source when the source is a linked simulated device too (the bytes go through the
  host, as between two rpc peers): 2 (delay + bytes / rate) between two linked devices;
- out of this device to any other device (the CPU, CUDA and rpc devices copy directly only from a
  device whose tensors are in host memory, so the copy is read back with the producing graph,
  `reads`): this device's link, once per read; the logits a context reads from the last stage
  pay it too.

The graph inputs each split gets from the host (token ids, positions, KV cells) pay nothing: a
real peer takes them without a reply to wait for. Without a link the device is host memory as
the CPU is, and copies are free.

`new_stream()` is the base's (the device itself): a graph completes on the calling thread, as on
the CPU, and the device's lock keeps every caller's graphs apart.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from typing import Optional, Sequence

import numpy as np

from ..obs import trace
from ..ir.tensor import Graph, Op
from .base import Backend, DeviceInfo, Tensor
from .cpu.backend import CPUBackend
from .cpu import memory

__all__ = ["SimBackend", "graph_cost"]

_COST_CACHE = 256
MAX_SPANS = 16384


def _is_weight(t: Tensor) -> bool:
    return t.buffer is not None and t.buffer.usage == "weights"


def _elements(t: Tensor) -> int:
    n = 1
    for d in t.shape:
        n *= d
    return n


def graph_cost(graph: Graph) -> tuple[int, int]:
    """(bytes of weights read, flops of the products) of one graph, as the module docstring
    states the model."""
    nbytes = flops = 0
    for nd in graph.nodes:
        srcs = nd.srcs
        if nd.op == Op.GET_ROWS:
            table, ids = srcs[0], srcs[1]
            if _is_weight(table):
                rows = table.shape[0] if len(table.shape) > 1 else 1
                nbytes += table.nbytes // max(rows, 1) * min(_elements(ids), rows)
            continue
        if nd.op == Op.MOE_FFN:
            x = srcs[0]
            n_expert = srcs[1].shape[0]
            share = min(1.0, x.shape[0] * float(nd.params[0]) / max(n_expert, 1))
            for i, t in enumerate(srcs[1:], start=1):
                if not _is_weight(t):
                    continue
                part = share if i in (2, 3, 4) else 1.0  # gate, up, down: the experts used
                nbytes += int(t.nbytes * part)
                if i <= 4:
                    flops += int(2 * x.shape[0] * _elements(t) * part)
            continue
        for i, t in enumerate(srcs):
            if not _is_weight(t):
                continue
            nbytes += t.nbytes
            if nd.op in (Op.MUL_MAT, Op.MUL_MAT_CAT) and i >= 1 and len(t.shape) == 2:
                flops += 2 * srcs[0].shape[0] * _elements(t)  # a bias (1-D) is no product
    return nbytes, flops


class SimBackend(CPUBackend):
    """A simulated device for benches and tests (module docstring): host buffers, a modelled
    compute time, zeros for results, an optional link."""

    def __init__(self, name: str, bandwidth_gb_s: float = 100.0, flops: Optional[float] = None,
                 link_delay_ms: float = 0.0, link_gbit_s: Optional[float] = None,
                 fixed_ms: Optional[float] = None):
        """bandwidth_gb_s: weight bytes read per second, in 1e9 B/s; flops: products' FLOP/s (None:
        not modelled); link_delay_ms / link_gbit_s: the link (neither: none; a delay alone: no
        rate limit); fixed_ms: every graph takes this long instead of the model (tests)."""
        super().__init__(1, name=name)
        if bandwidth_gb_s <= 0 or (flops is not None and flops <= 0):
            raise ValueError("bandwidth and flops must be positive")
        if link_delay_ms < 0 or (link_gbit_s is not None and link_gbit_s <= 0):
            raise ValueError("a link's delay must be >= 0 and its rate positive")
        self.bandwidth_gb_s = float(bandwidth_gb_s)
        self.flops = flops
        self.fixed_ms = fixed_ms
        self.link_delay_ms = float(link_delay_ms)
        self.link_gbit_s = link_gbit_s
        self.linked = link_delay_ms > 0 or link_gbit_s is not None
        # behind a link the tensors are not this host's memory: no device reads them in place
        self.host_memory = not self.linked
        self.layout.repack = False  # nothing computes on a repacked copy here
        self._device = threading.Lock()  # one graph at a time
        self._costs: "OrderedDict[int, tuple[int, int]]" = OrderedDict()
        self._costs_lock = threading.Lock()
        # each graph's (start us, end us, modelled s), oldest first
        self.spans: deque[tuple[int, int, float]] = deque(maxlen=MAX_SPANS)
        self.link_s_total = 0.0  # seconds spent in link transfers (sleeps), every thread's
        self.last_bytes = 0  # the modelled bytes of the last graph computed

    # --- the model -----------------------------------------------------------------------------
    def modelled_s(self, nbytes: int, flops: int) -> float:
        """Seconds a graph of `nbytes` weight bytes and `flops` product FLOPs takes here."""
        if self.fixed_ms is not None:
            return self.fixed_ms / 1000.0
        t = nbytes / (self.bandwidth_gb_s * 1e9)
        if self.flops:
            t = max(t, flops / self.flops)
        return t

    def link_s(self, nbytes: int) -> float:
        """Seconds `nbytes` take over this device's link (0 without one)."""
        if not self.linked:
            return 0.0
        return self.link_delay_ms / 1000.0 + (nbytes * 8 / (self.link_gbit_s * 1e9) if self.link_gbit_s else 0.0)

    def _cost(self, graph: Graph) -> tuple[int, int]:
        with self._costs_lock:
            cost = self._costs.get(graph.uid)
            if cost is not None:
                self._costs.move_to_end(graph.uid)
                return cost
        for nd in graph.nodes:
            for t in (nd.out, *nd.srcs):
                if t.buffer is None or t.buffer.backend is not self:
                    raise ValueError(f"graph tensor {t.name} is not on {self.name}")
        cost = graph_cost(graph)
        with self._costs_lock:
            self._costs[graph.uid] = cost
            if len(self._costs) > _COST_CACHE:
                self._costs.popitem(last=False)
        return cost

    @staticmethod
    def _sleep(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while seconds > 0:
            time.sleep(seconds)
            seconds = end - time.perf_counter()

    def _pay_link(self, seconds: float) -> None:
        if seconds > 0:
            self._sleep(seconds)
            with self._costs_lock:
                self.link_s_total += seconds

    # --- compute -------------------------------------------------------------------------------
    def graph_compute(self, graph: Graph, reads: Sequence[tuple[Tensor, np.ndarray]] = ()) -> None:
        nbytes, flops = self._cost(graph)
        modelled = self.modelled_s(nbytes, flops)
        with self._device:
            t0 = self.busy.begin()
            start = time.perf_counter()
            try:
                for nd in graph.nodes:
                    self.bytes_of(nd.out).fill(0)
                self._sleep(modelled - (time.perf_counter() - start))
            finally:
                t1 = trace.now()
                self.busy.end(t0)
            self.spans.append((t0, t1, modelled))
            self.last_bytes = nbytes
        if trace.enabled:
            trace.event("dev", f"compute {self.name}", t0, t1, n_nodes=len(graph.nodes), sim=True)
        for t, out in reads:
            self._pay_link(self.link_s(t.nbytes))
            self.get_tensor(t, out)

    def forget_graph(self, uid: int) -> None:
        with self._costs_lock:
            self._costs.pop(uid, None)
        super().forget_graph(uid)

    # --- copies --------------------------------------------------------------------------------
    def host_array(self, tensor: Tensor) -> Optional[np.ndarray]:
        return self.bytes_of(tensor) if self.host_memory else None

    def can_copy_from(self, src: Backend) -> bool:
        # any host-memory device, linked simulated ones included (their link is paid here)
        return isinstance(src, CPUBackend)

    def cpy_tensor_async(self, src: Tensor, dst: Tensor) -> bool:
        sb = src.backend
        if not isinstance(sb, CPUBackend):
            return False
        hop = self.link_s(dst.nbytes) + (sb.link_s(src.nbytes) if isinstance(sb, SimBackend) else 0.0)
        self._pay_link(hop)
        return super().cpy_tensor_async(src, dst)

    # --- information ---------------------------------------------------------------------------
    def device_info(self) -> DeviceInfo:
        link = (f", link {self.link_delay_ms:g} ms" + (f" / {self.link_gbit_s:g} Gbit/s" if self.link_gbit_s else "")
                if self.linked else "")
        return DeviceInfo(self.name, "sim", f"simulated device ({self.bandwidth_gb_s:g} GB/s{link})",
                          memory.available_memory(), memory.total_memory())
