"""The CPU backend: numpy buffers, Cython kernels, BLAS for matrix products of many rows.

Weights stay in the type the model file stores them in (F32, F16, BF16 and ggml's block formats,
`weight_types`), memory-mapped from the file where a weight is one file tensor (`map_host`).
Products against F32 weights of at most `gemm.small_rows_max()` rows (decode batches) run on the
streaming kernel of `_fast/gemm.pyx`, which reads each weight once; larger ones (prompts) go to
BLAS, but for those of 128 rows or more with K up to 1024 (`gemm.packed_fits`), which go to the
packed kernel of the same file, on the kernels' pool. PYLLAMA_CPU_BLAS_ONLY=1 sends every F32 product to BLAS (for A/B runs). Products against
every other type run on `_fast/qmatmul.pyx` with ggml's arithmetic (activations quantized to the
weight type's dot-product type), and embedding rows of those types are dequantized when looked up.

Quantized weights are also repacked in groups of 8 rows, and the products run on that copy: the
CPU's weight layout (layout.py, `CPUBackend.layout`) makes, finds and drops those copies.

A graph is bound once (`_prepare`): each node becomes its kernel with its arrays. Where the kernel
has a C form (the products, norms, GELU, GLUs, attention, ADD, GET_ROWS, MOE_FFN: `bind_*` in `_fast`)
the node becomes a NativeStep, and consecutive ones run as one NativeRun (`_fast/plan.pyx`), which
releases the GIL once for all of them: the thread never waits for the GIL between two kernels,
where it would wait for whoever holds it (the event loop streaming tokens, another group's decode
thread) while the pool's helpers wait for it. The other nodes (SAMPLE, BLAS products) run as
Python callables between the runs. PYLLAMA_CPU_NATIVE=0 binds every node as a Python callable
(for A/B runs).

Every kernel releases the GIL (numpy's BLAS does, and the Cython kernels run `nogil`), so the
decode threads of several contexts overlap for real. Work completes inside graph_compute, so
synchronize and events are trivial here.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import numpy as np

from ...obs import trace
from ...obs.busy import BusyClock
from ..._fast import gemm, moe, qmatmul
from ..._fast import ops as k
from ..._fast import ops_extra as kx
from ..._fast.plan import NativeRun, NativeStep
from ...ir.tensor import KV_CACHE_TYPES, AttentionParams, Graph, MlaParams, MoeParams, Node, Op, check_node
from ..base import NP_DTYPES, Backend, Buffer, DeviceInfo, DType, Tensor
from ..host_sample import bind_sample
from ...util.settings import CpuSettings
from ...util.settings import current as current_settings
from . import memory
from .layout import RepackingLayout
from .mla import mla_attention

_PLAN_CACHE = 256


def set_compute_threads(n_threads: int) -> int:
    """Caps BLAS threads for the whole process (the Cython kernels take the count per call)."""
    n = n_threads if n_threads > 0 else (os.cpu_count() or 1)
    try:
        from threadpoolctl import threadpool_limits  # noqa: PLC0415
        threadpool_limits(limits=n, user_api="blas")
    except Exception as exc:  # pragma: no cover - only where threadpoolctl cannot see the BLAS
        logging.getLogger(__name__).warning("could not limit BLAS threads to %d: %s", n, exc)
    return n


class CPUBuffer(Buffer):
    __slots__ = ("data", "mapped")

    def __init__(self, backend: "CPUBackend", size: int, usage: str, data: Optional[np.ndarray] = None):
        super().__init__(backend, size, usage)
        self.mapped = data is not None
        if data is not None:  # host memory owned elsewhere (a model file's memory map)
            self.data = data
            return
        # 64-byte aligned so BLAS and the vectorized kernels see aligned rows
        raw = np.zeros(size + 64, dtype=np.uint8)
        start = (-raw.ctypes.data) % 64
        self.data = raw[start:start + size]


# the weight types the CPU computes on as stored: F32 on gemm/BLAS, the rest on qmatmul
CPU_WEIGHT_TYPES = frozenset({DType.F32}) | frozenset(DType(t) for t in qmatmul.supported_types())


class CPUBackend(Backend):
    """The host's CPU as a device. Weights keep their file type (module docstring)."""

    weight_types = CPU_WEIGHT_TYPES
    kv_types = KV_CACHE_TYPES  # F32, F16, BF16, Q8_0: the attention kernel reads each in its own type
    alibi_ok = True  # the attention kernel adds ALiBi's slopes

    def __init__(self, n_threads: int = 0, name: str = "CPU", settings: Optional[CpuSettings] = None):
        self.name = name
        self.settings = settings if settings is not None else current_settings().cpu
        self.busy = BusyClock()  # when it computed: the live pipeline view, the rpc server's DEVICE_BUSY
        self.n_threads = n_threads if n_threads > 0 else (os.cpu_count() or 1)
        self._plans: "OrderedDict[int, list[Callable[[], None]]]" = OrderedDict()
        self._plans_lock = threading.Lock()
        self.allocated = 0
        # what counts memory beyond buffers against a cap (an rpc server's --mem: its Device), the
        # graphs' working memory here and the layout's repacked copies: reserve(bytes, what) raises
        # MemoryError past it, release(bytes); None: no cap
        self.budget = None
        self.layout: RepackingLayout = RepackingLayout(self)

    # --- buffers -------------------------------------------------------------------------------
    def alloc_buffer(self, size: int, usage: str = "compute") -> Buffer:
        if size < 0:
            raise ValueError("negative buffer size")
        buf = CPUBuffer(self, size, usage)
        self.allocated += size
        return buf

    def free_buffer(self, buffer: Buffer) -> None:
        self.layout.forget_buffer(buffer)
        if not buffer.mapped:  # type: ignore[attr-defined]
            self.allocated -= buffer.size
        buffer.data = np.zeros(0, dtype=np.uint8)  # type: ignore[attr-defined]

    def clear_buffer(self, buffer: Buffer, value: int = 0) -> None:
        self.layout.forget(buffer, 0, buffer.size)
        buffer.data.fill(value)  # type: ignore[attr-defined]

    def forget_plans(self) -> None:
        """Drops every bound plan (the layout's copies they point at went stale)."""
        with self._plans_lock:
            self._plans.clear()

    # --- data ------------------------------------------------------------------------------------
    @staticmethod
    def bytes_of(t: Tensor) -> np.ndarray:
        assert t.buffer is not None, f"tensor {t.name} is not allocated"
        return t.buffer.data[t.offset:t.offset + t.nbytes]  # type: ignore[attr-defined]

    @classmethod
    def array(cls, t: Tensor) -> np.ndarray:
        """A numpy view of the tensor (element types only)."""
        return cls.bytes_of(t).view(NP_DTYPES[t.dtype]).reshape(t.shape)

    @classmethod
    def view(cls, t: Tensor) -> np.ndarray:
        """What a kernel takes: F32 and I32 tensors as arrays of their shape, every other type (a
        weight in its file type) as its rows of bytes, uint8 [rows, bytes per row]."""
        if t.dtype in (DType.F32, DType.I32):
            return cls.array(t)
        rows = t.shape[0] if len(t.shape) > 1 else 1
        return cls.bytes_of(t).reshape(rows, -1 if rows else 0)

    def set_tensor(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        src = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if offset < 0 or offset + src.size > tensor.nbytes:
            raise ValueError(f"set_tensor: {src.size} bytes at {offset} overflow {tensor.name} ({tensor.nbytes} B)")
        if self.layout.holds_copies():
            self.layout.forget(tensor.buffer, tensor.offset + offset, tensor.offset + offset + src.size)
        self.bytes_of(tensor)[offset:offset + src.size] = src

    def get_tensor(self, tensor: Tensor, out: Optional[np.ndarray] = None) -> np.ndarray:
        data = self.bytes_of(tensor)
        if out is None:
            if tensor.dtype in NP_DTYPES:
                return data.view(NP_DTYPES[tensor.dtype]).reshape(tensor.shape).copy()
            return data.copy()
        dst = out.reshape(-1).view(np.uint8)
        if dst.size != tensor.nbytes:
            raise ValueError(f"get_tensor: {tensor.name} has {tensor.nbytes} B, destination {dst.size} B")
        dst[:] = data
        return out

    host_memory = True
    in_order = True  # graph_compute runs the graph on the calling thread: done when it returns
    small_batches_cheap = True  # the repacked kernels: 762 / 868 tok/s at 16 / 512 rows (q4_k_m)

    def host_array(self, tensor: Tensor) -> Optional[np.ndarray]:
        return self.bytes_of(tensor)

    def can_copy_from(self, src: Backend) -> bool:
        # a CPU-like device whose tensors are not this host's memory (a simulated device behind a
        # link, backend/sim.py) hands its tensors over with its graph instead, paying its link
        return isinstance(src, CPUBackend) and src.host_memory

    def cpy_tensor_async(self, src: Tensor, dst: Tensor) -> bool:
        if not isinstance(src.backend, CPUBackend):
            return False
        if self.layout.holds_copies():
            self.layout.forget(dst.buffer, dst.offset, dst.offset + dst.nbytes)
        self.bytes_of(dst)[:] = self.bytes_of(src)
        return True

    # --- compute ---------------------------------------------------------------------------------
    def graph_compute(self, graph: Graph, reads: Sequence[tuple[Tensor, np.ndarray]] = ()) -> None:
        with self._plans_lock:
            steps = self._plans.get(graph.uid)
            if steps is None:
                steps = self._prepare(graph)
                self._plans[graph.uid] = steps
                if len(self._plans) > _PLAN_CACHE:
                    self._plans.popitem(last=False)
            else:
                self._plans.move_to_end(graph.uid)
        work = getattr(steps, "work", 0)
        if work and self.budget is not None:
            try:
                self.budget.reserve(work, f"kernel working memory of a graph of {len(graph.nodes)} nodes "
                                          "(scratch and intermediate arrays)")
            except MemoryError:
                with self._plans_lock:  # its arrays go with it
                    self._plans.pop(graph.uid, None)
                raise
        t0 = trace.now() if trace.enabled else 0
        self.busy.begin()
        try:
            for step in steps:
                step()
        finally:
            self.busy.end()
            if work and self.budget is not None:
                self.budget.release(work)
        if t0:
            trace.event("dev", f"compute {self.name}", t0, trace.now(), n_nodes=len(graph.nodes))
        for t, out in reads:
            self.get_tensor(t, out)

    def forget_graph(self, uid: int) -> None:
        """Drops the bound plan of a graph (its views would keep freed buffers alive)."""
        with self._plans_lock:
            self._plans.pop(uid, None)

    def _prepare(self, graph: Graph) -> list[Callable[[], None]]:
        """Binds every node to its kernel and its numpy views once per graph; consecutive native
        steps run as one NativeRun (module docstring). The plan's `work`: the memory its kernels use
        while it runs beyond the graph's tensors (the largest scratch one run allocates, the
        arrays bound with the nodes), which a cap (`budget`) must allow before it runs."""
        steps = self._bind_nodes(graph)
        plan = _Plan(_runs(steps))
        plan.work = max((s.scratch for s in steps if isinstance(s, NativeStep)), default=0) + _bound_bytes(graph)
        return plan

    def _bind_nodes(self, graph: Graph) -> list[Callable[[], None]]:
        steps: list[Callable[[], None]] = []
        nt, opts = self.n_threads, self.settings
        empty = np.zeros(0, dtype=np.float32)
        for nd in graph.nodes:
            for t in (nd.out, *nd.srcs):
                if t.buffer is None or t.buffer.backend is not self:
                    raise ValueError(f"graph tensor {t.name} is not on {self.name}")
            op = nd.op
            why = check_node(op, nd.out.dtype, [t.dtype for t in nd.srcs], nd.params, self.weight_types)
            if why is not None:
                raise ValueError(f"{op.name} {nd.out.name}: {why}")
            out = self.array(nd.out)
            s = [self.view(t) for t in nd.srcs]
            if op == Op.GET_ROWS:
                steps.append(_get_rows_step(opts, s[0], nd.srcs[0].dtype, s[1], out, nt))
            elif op == Op.RMS_NORM:
                eps = float(nd.params[0])
                steps.append(_native(opts, k.bind_rms_norm, _bind(k.rms_norm, s[0], s[1], out, eps, nt),
                                     s[0], s[1], out, eps, nt))
            elif op == Op.MUL_MAT:
                bias = s[2] if len(s) == 3 else None
                steps.append(_mul_mat_step(opts, s[0], s[1], nd.srcs[1].dtype, out, bias, nt,
                                           self.layout.packed(nd.srcs[1])))
            elif op == Op.MUL_MAT_CAT:  # x, the weight parts, an optional bias (checked above)
                n_parts = int(nd.params[0])
                parts = nd.srcs[1:1 + n_parts]
                steps.extend(_mul_mat_cat_steps(opts, s[0], s[1:1 + n_parts], [t.dtype for t in parts], out,
                                                s[1 + n_parts] if len(s) > 1 + n_parts else None, nt,
                                                [self.layout.packed(t) for t in parts]))
            elif op == Op.ADD:
                steps.append(_native(opts, kx.bind_add, _bind(np.add, s[0], s[1], out=out), s[0], s[1], out))
            elif op == Op.SWIGLU:
                steps.append(_native(opts, k.bind_glu, _bind(k.swiglu, s[0], out, nt), s[0], out, nt, False))
            elif op == Op.ATTENTION:
                a = AttentionParams.of(nd.params, len(s))
                tail = list(s[7:])  # the optional sources, in their order (src_roles)
                alibi = tail.pop() if a.alibi else None
                sinks = tail.pop() if a.sinks else None
                freqs = tail.pop() if a.rope_freqs else None
                qn, kn = (tail[0], tail[1]) if len(tail) == 2 else (empty, empty)
                if a.n_swa != int(a.n_swa):
                    raise ValueError(f"ATTENTION {nd.out.name}: n_swa {a.n_swa} is not an integer")
                kc, vc = nd.srcs[1], nd.srcs[2]  # the caches as rows of bytes in their cache types
                args = (s[0], _rows(kc), _rows(vc), s[3], s[4], s[5], s[6], qn, kn, out,
                        int(a.n_head), int(a.n_head_kv), int(a.head_dim), int(a.n_rot), int(a.rope_mode),
                        float(a.freq_base), float(a.freq_scale), float(a.norm_eps), float(a.scale), nt,
                        int(kc.dtype), int(vc.dtype), float(a.softcap), int(a.n_swa), float(a.rope_mscale), freqs, sinks,
                        alibi)
                steps.append(_native(opts, k.bind_attention, _bind(k.attention, *args), *args))
            elif op == Op.GEGLU:
                steps.append(_native(opts, k.bind_glu, _bind(k.geglu, s[0], out, nt), s[0], out, nt, True))
            elif op == Op.SCALE:
                steps.append(_bind(kx.scale, s[0], out, float(nd.params[0])))
            elif op == Op.SOFTCAP:
                steps.append(_bind(kx.softcap, s[0], out, float(nd.params[0])))
            elif op == Op.LAYER_NORM:
                eps = float(nd.params[0])
                steps.append(_native(opts, k.bind_layer_norm, _bind(layer_norm, s[0], s[1], s[2], out, eps),
                                     s[0], s[1], s[2], out, eps, nt))
            elif op == Op.GELU:
                steps.append(_native(opts, k.bind_gelu, _bind(gelu, s[0], out), s[0], out, nt))
            elif op == Op.LORA:
                steps.extend(_lora_steps(opts, nd, s, out, nt))
            elif op == Op.SAMPLE:
                steps.append(bind_sample(s[0], s[1], out, int(nd.params[0]), int(nd.params[1]), nt))
            elif op == Op.MOE_FFN:
                steps.extend(_moe_ffn_steps(opts, nd.srcs, s, out, nd.params, nt, self.layout.packed))
            elif op == Op.MLA_ATTENTION:
                kc, kb, vb = nd.srcs[2], nd.srcs[8], nd.srcs[9]
                if len(kb.shape) != 3 or len(vb.shape) != 3:
                    raise ValueError(f"MLA_ATTENTION {nd.out.name}: k_b and v_b must be [heads, rows, cols]")
                steps.append(_bind(mla_attention, s[0], s[1], _rows(kc), int(kc.dtype), s[3], s[4], s[5], s[6], s[7],
                                   self.bytes_of(kb).reshape(kb.shape[0], kb.shape[1], -1), int(kb.dtype),
                                   self.bytes_of(vb).reshape(vb.shape[0], vb.shape[1], -1), int(vb.dtype),
                                   int(kb.shape[2]), int(vb.shape[1]), MlaParams(*nd.params[:11]), out))
            else:
                raise ValueError(f"unknown op {op!r}")
        return steps

    # --- information ---------------------------------------------------------------------------
    def device_info(self) -> DeviceInfo:
        return DeviceInfo(self.name, "cpu", f"CPU ({self.n_threads} threads)", memory.available_memory(),
                          memory.total_memory())


class _Plan(list):
    """A bound graph's steps, with the working memory they need (`work`, bytes)."""

    work = 0


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, out: np.ndarray, eps: float) -> None:
    """out = (x - mean) / sqrt(var + eps) * w + b per row. The mean and variance are summed in
    float64, as ggml_norm sums them, so that a row's statistics follow llama.cpp's."""
    mean = x.mean(axis=1, dtype=np.float64, keepdims=True).astype(np.float32)
    np.subtract(x, mean, out=out)
    var = np.square(out, dtype=np.float64).mean(axis=1, keepdims=True)
    out *= (1.0 / np.sqrt(var + eps)).astype(np.float32)
    out *= w
    out += b


_GELU_C = np.float32(0.7978845608028654)  # sqrt(2 / pi)


def lora_widths(nd: Node) -> np.ndarray:
    """A LORA node's adapter block widths (its parameters, one per column of its scale source;
    negative: the block rounds its activations to F16), checked against its sources' shapes
    (pyllama.ir.tensor, Op.LORA)."""
    y, x, a, b, scale = nd.srcs
    n_ad = scale.shape[1] if len(scale.shape) == 2 else -1
    widths = list(nd.params)
    if not 1 <= n_ad <= len(widths) or any(w != int(w) for w in widths) or any(widths[n_ad:]):
        raise ValueError(f"LORA {nd.out.name}: parameters {widths} do not give {n_ad} adapter widths")
    n, m = y.shape
    r, k = a.shape
    if x.shape != (n, k) or b.shape != (m, r) or scale.shape[0] != n or nd.out.shape != (n, m) \
            or sum(abs(w) for w in widths) != r:
        raise ValueError(f"LORA {nd.out.name}: shapes y {list(y.shape)}, x {list(x.shape)}, a {list(a.shape)}, "
                         f"b {list(b.shape)}, scale {list(scale.shape)} and widths {widths[:n_ad]} disagree")
    return np.asarray(widths[:n_ad], dtype=np.int64)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _lora_steps(opts: CpuSettings, nd: Node, s: Sequence[np.ndarray], out: np.ndarray,
                nt: int) -> list[Callable[[], None]]:
    """LORA: out = y + ((x @ a.T) * s) @ b.T. Both products are MUL_MAT's F32 kernels, so that a
    row's result does not depend on its batch mates (up to their row bound: activations that are
    then quantized would turn an ulp into another value). A block of an F16 adapter takes x and
    its part of x @ a.T rounded to F16, as ggml's products against F16 matrices round them."""
    y, x, a, b, scale = s
    signed = lora_widths(nd)
    widths = np.abs(signed)
    half = np.repeat(signed < 0, widths)  # per column of a.T: its adapter is F16
    t = np.zeros((x.shape[0], int(widths.sum())), dtype=np.float32)
    products = []
    if half.any():  # the F16 blocks' activations rounded: x16 @ a.T for those columns
        x16 = np.zeros_like(x)
        t16 = t if half.all() else np.zeros_like(t)
        products.append(lambda: np.copyto(x16, _f16(x)))
        products.append(_bind_mul_mat(opts, x16, a, DType.F32, t16, None, nt))
    if not half.all():
        products.append(_bind_mul_mat(opts, x, a, DType.F32, t, None, nt))
    second = _bind_mul_mat(opts, t, b, DType.F32, out, None, nt)

    def run() -> None:
        for step in products:
            step()
        if half.any():
            if not half.all():
                t[:, half] = t16[:, half]
            t[:, half] = _f16(t[:, half])
        np.multiply(t, np.repeat(scale, widths, axis=1), out=t)
        second()
        np.add(out, y, out=out)
    return [run]


def gelu(x: np.ndarray, out: np.ndarray) -> None:
    """out = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in float32 (GeGLU's gelu)."""
    t = x * x
    t *= np.float32(0.044715)
    t += np.float32(1.0)
    t *= x
    t *= _GELU_C
    np.tanh(t, out=t)
    t += np.float32(1.0)
    t *= x
    np.multiply(t, np.float32(0.5), out=out)


def _bound_bytes(graph: Graph) -> int:
    """Bytes of the arrays `_bind_nodes` makes for the nodes of `graph` (MOE_FFN's router logits,
    SAMPLE's unpacked inputs and outputs)."""
    total = 0
    for nd in graph.nodes:
        if nd.op == Op.MOE_FFN:
            total += 4 * nd.srcs[0].shape[0] * nd.srcs[1].shape[0]
        elif nd.op == Op.SAMPLE:
            rows, n_probs, window = nd.srcs[0].shape[0], int(nd.params[0]), int(nd.params[1])
            total += 4 * rows * (8 + 4 + window + 2 + 2 * n_probs)
    return total


def _rows(t: Tensor) -> np.ndarray:
    """The bytes of a 2-D tensor (a KV cache of any cache type) as uint8 [rows, bytes per row]."""
    return CPUBackend.bytes_of(t).reshape(t.shape[0], -1 if t.shape[0] else 0)


def _bind(fn: Callable, *args, **kwargs) -> Callable[[], None]:
    return lambda: fn(*args, **kwargs)


def _native(opts: CpuSettings, binder: Callable, python_step: Callable[[], None], *args) -> Callable[[], None]:
    """The node as a NativeStep made by binder(python_step, *args), or python_step where the kernel
    has no C form for these arguments (the binder says None) or PYLLAMA_CPU_NATIVE=0 (`opts.native`)."""
    if not opts.native:
        return python_step
    step = binder(python_step, *args)
    return python_step if step is None else step


def _runs(steps: Sequence[Callable[[], None]]) -> list[Callable[[], None]]:
    """Consecutive NativeSteps gathered into NativeRuns; Python steps stay as they are."""
    out: list[Callable[[], None]] = []
    run: list[NativeStep] = []
    for step in steps:
        if isinstance(step, NativeStep):
            run.append(step)
            continue
        if run:
            out.append(NativeRun(run))
            run = []
        out.append(step)
    if run:
        out.append(NativeRun(run))
    return out


def _get_rows_step(opts: CpuSettings, table: np.ndarray, dtype: DType, ids: np.ndarray, out: np.ndarray, nt: int) -> Callable[[], None]:
    py = _bind_get_rows(table, dtype, ids, out, nt)
    if dtype == DType.F32:
        return _native(opts, kx.bind_get_rows_f32, py, table, ids, out)
    return _native(opts, qmatmul.bind_get_rows_q, py, table, int(dtype), ids, out, nt)


def _mul_mat_step(opts: CpuSettings, x: np.ndarray, w: np.ndarray, dtype: DType, out: np.ndarray, bias: Optional[np.ndarray],
                  nt: int, packed: Optional[np.ndarray] = None) -> Callable[[], None]:
    """_bind_mul_mat's product as a NativeStep where its kernel has one (not BLAS)."""
    py = _bind_mul_mat(opts, x, w, dtype, out, bias, nt, packed)
    if dtype != DType.F32:
        if packed is not None:
            return _native(opts, qmatmul.bind_mul_mat_q_x8_parts, py, x, [packed], [int(dtype)], out, bias, nt)
        return _native(opts, qmatmul.bind_mul_mat_q, py, x, w, int(dtype), out, bias, nt)
    if x.shape[0] <= gemm.small_rows_max() and not opts.blas_only:
        return _native(opts, gemm.bind_mul_mat_t, py, x, w, out, bias, nt)
    if gemm.packed_fits(x.shape[0], x.shape[1]) and not opts.blas_only:  # BLAS's speed without its threads
        return _native(opts, gemm.bind_mul_mat_packed, py, x, w, out, bias, nt)
    return py


def _bind_get_rows(table: np.ndarray, dtype: DType, ids: np.ndarray, out: np.ndarray, nt: int) -> Callable[[], None]:
    if dtype == DType.F32:
        return lambda: np.take(table, ids, axis=0, out=out, mode="raise")
    # a table in its file type (the token embedding): rows are dequantized as they are looked up
    if table.shape[1] != qmatmul.row_bytes(int(dtype), out.shape[1]) or out.shape[0] != ids.shape[0]:
        raise ValueError(f"GET_ROWS: {dtype.name} rows of {table.shape[1]} B, ids {list(ids.shape)} and out "
                         f"{list(out.shape)} disagree")
    return lambda: qmatmul.get_rows_q(table, int(dtype), ids, out, nt)


def _bind_mul_mat(opts: CpuSettings, x: np.ndarray, w: np.ndarray, dtype: DType, out: np.ndarray, bias: Optional[np.ndarray],
                  nt: int, packed: Optional[np.ndarray] = None) -> Callable[[], None]:
    """out = x @ w.T (+ bias). F32 weights: the streaming kernel for decode batches, BLAS above;
    every other type: qmatmul with ggml's arithmetic, on the weight's repacked copy when it has
    one (`packed`)."""
    if dtype != DType.F32:
        n, k = x.shape
        if w.shape[1] != qmatmul.row_bytes(int(dtype), k) or out.shape != (n, w.shape[0]):
            raise ValueError(f"MUL_MAT: x {list(x.shape)}, {dtype.name} weight of {w.shape[0]} rows of "
                             f"{w.shape[1]} B and out {list(out.shape)} disagree")
        if packed is not None:
            return lambda: qmatmul.mul_mat_q_x8(x, packed, int(dtype), out, bias, nt)
        return lambda: qmatmul.mul_mat_q(x, w, int(dtype), out, bias, nt)
    if x.shape[0] <= gemm.small_rows_max() and not opts.blas_only:
        return _bind(gemm.mul_mat_t, x, w, out, bias, nt)
    if bias is not None:
        return _bind_mul_mat_bias(x, w.T, bias, out)
    return _bind(np.matmul, x, w.T, out=out)


def _mul_mat_cat_steps(opts: CpuSettings, x: np.ndarray, parts: Sequence[np.ndarray], dtypes: Sequence[DType], out: np.ndarray,
                       bias: Optional[np.ndarray], nt: int,
                       packed: Sequence[Optional[np.ndarray]]) -> list[Callable[[], None]]:
    """MUL_MAT_CAT: each weight part's product written into its columns of `out`. `packed`: each
    part's repacked copy or None. When every part is repacked, one step (x quantized once for all
    of them); else one step per part."""
    if (parts and all(p is not None for p in packed)
            and len({qmatmul.vec_dot_type(int(d)) for d in dtypes}) == 1):
        py = _bind_mul_mat_cat_x8(x, parts, dtypes, out, bias, nt, packed)  # type: ignore[arg-type]
        return [_native(opts, qmatmul.bind_mul_mat_q_x8_parts, py, x, list(packed), [int(d) for d in dtypes], out, bias,
                        nt)]
    steps, col = [], 0
    for w, dtype, wp in zip(parts, dtypes, packed):
        m = w.shape[0]
        if col + m > out.shape[1]:
            raise ValueError(f"MUL_MAT_CAT: the weight parts have more rows than out has columns ({out.shape[1]})")
        steps.append(_mul_mat_step(opts, x, w, dtype, out[:, col:col + m], None if bias is None else bias[col:col + m], nt,
                                   wp))
        col += m
    if col != out.shape[1]:
        raise ValueError(f"MUL_MAT_CAT: the weight parts have {col} rows, out has {out.shape[1]} columns")
    return steps


def _bind_mul_mat_cat_x8(x: np.ndarray, parts: Sequence[np.ndarray], dtypes: Sequence[DType], out: np.ndarray,
                         bias: Optional[np.ndarray], nt: int, packed: Sequence[np.ndarray]) -> Callable[[], None]:
    """Every part repacked: one product over all of them (x quantized once, one pool run)."""
    n, k = x.shape
    rows = 0
    for w, dtype in zip(parts, dtypes):
        if w.shape[1] != qmatmul.row_bytes(int(dtype), k):
            raise ValueError(f"MUL_MAT_CAT: x {list(x.shape)} and a {dtype.name} part of {w.shape[0]} rows of "
                             f"{w.shape[1]} B disagree")
        rows += w.shape[0]
    if rows != out.shape[1] or out.shape[0] != n:
        raise ValueError(f"MUL_MAT_CAT: the weight parts have {rows} rows, out is {list(out.shape)}")
    wps, qts = list(packed), [int(d) for d in dtypes]
    return lambda: qmatmul.mul_mat_q_x8_parts(x, wps, qts, out, bias, nt)


def _moe_ffn_steps(opts: CpuSettings, srcs: Sequence[Tensor], s: Sequence[np.ndarray], out: np.ndarray, params: Sequence[float],
                   nt: int, packed: Callable[[Tensor], Optional[np.ndarray]]) -> list[Callable[[], None]]:
    """MOE_FFN: the router product (as any MUL_MAT, into a scratch of logits), then the MoE kernel
    (_fast/moe.pyx), which computes only the experts the tokens chose: two steps. Experts whose
    type has repacked kernels (`packed`) are multiplied in groups of 8 rows; gate and up go
    together (they share the gathered activations)."""
    x, router = s[0], s[1]
    gate, up, down = srcs[2], srcs[3], srcs[4]
    mp = MoeParams.of(params)
    n_used, norm, scale = mp.n_used, mp.norm, mp.scale
    if n_used != int(n_used) or norm not in (0, 1):
        raise ValueError(f"MOE_FFN: n_expert_used {n_used} and norm {norm} must be integers (norm 0 or 1)")
    if any(v != int(v) for v in (mp.gating, mp.n_group, mp.n_group_used)):
        raise ValueError(f"MOE_FFN: gating {mp.gating} and expert groups {mp.n_group}, {mp.n_group_used} must be "
                         "integers")
    four, rest, probs_b = mp.sources(s)  # gpt-oss's biases; the shared expert and its gate; the expert bias
    router_b = four[0] if four else None
    biases = tuple(four[1:]) if four else None
    for t in (gate, up, down):
        if len(t.shape) != 3 or t.shape[0] != router.shape[0]:
            raise ValueError(f"MOE_FFN: expert tensor {t.name} {list(t.shape)} is not [{router.shape[0]}, rows, cols]")
    if gate.shape != up.shape or gate.shape[2] != x.shape[1] or down.shape[1:] != (x.shape[1], gate.shape[1]):
        raise ValueError(f"MOE_FFN: expert shapes {list(gate.shape)}, {list(up.shape)}, {list(down.shape)} do not "
                         f"fit x {list(x.shape)}")
    logits = np.zeros((x.shape[0], router.shape[0]), dtype=np.float32)
    route = _mul_mat_step(opts, x, router, srcs[1].dtype, logits, router_b, nt)
    # each expert tensor as one row of bytes per expert, whatever its type (repacked or as in the file)
    g, u, d = (CPUBackend.bytes_of(t).reshape(t.shape[0], -1) for t in (gate, up, down))
    pg, pu, pd = packed(gate), packed(up), packed(down)
    x8_gate_up = pg is not None and pu is not None
    if x8_gate_up:
        g, u = pg, pu
    if pd is not None:
        d = pd
    shexp = rest[0] if rest else None
    shexp_gate = rest[1] if len(rest) > 1 else None
    args = (x, logits, g, int(gate.dtype), u, int(up.dtype), d, int(down.dtype), out, int(n_used), bool(norm),
            float(scale), shexp, shexp_gate, nt, x8_gate_up, pd is not None, int(mp.gating), probs_b,
            int(mp.n_group), int(mp.n_group_used), biases, int(mp.act))

    return [route, _native(opts, moe.bind_moe_ffn, _bind(moe.moe_ffn, *args), *args)]


def _bind_mul_mat_bias(x: np.ndarray, wt: np.ndarray, bias: np.ndarray, out: np.ndarray) -> Callable[[], None]:
    def run() -> None:
        np.matmul(x, wt, out=out)
        np.add(out, bias, out=out)
    return run
