"""The CPU backend: numpy buffers, Cython kernels, BLAS for matrix products of many rows.

Matrix products of at most `gemm.small_rows_max()` rows (decode batches) run on the streaming
kernel of `_fast/gemm.pyx`, which reads each weight once; larger ones (prompts) go to BLAS.
PYLLAMA_CPU_BLAS_ONLY=1 sends every product to BLAS (for A/B runs).

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

from .. import trace
from .._fast import gemm
from .._fast import ops as k
from .._fast import sampling as k_sampling
from ..graph.ops import Graph, Op, sample_in_cols, sample_out_cols
from .base import NP_DTYPES, Backend, Buffer, DeviceInfo, DType, Tensor

_PLAN_CACHE = 256
_BLAS_ONLY = os.environ.get("PYLLAMA_CPU_BLAS_ONLY", "") not in ("", "0")


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
    __slots__ = ("data",)

    def __init__(self, backend: "CPUBackend", size: int, usage: str):
        super().__init__(backend, size, usage)
        # 64-byte aligned so BLAS and the vectorized kernels see aligned rows
        raw = np.zeros(size + 64, dtype=np.uint8)
        start = (-raw.ctypes.data) % 64
        self.data = raw[start:start + size]


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover
        return 0


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover
        pass
    return _total_memory()


class CPUBackend(Backend):
    """The host's CPU as a device. Weights of every file type are stored as F32."""

    def __init__(self, n_threads: int = 0, name: str = "CPU"):
        self.name = name
        self.n_threads = n_threads if n_threads > 0 else (os.cpu_count() or 1)
        self._plans: "OrderedDict[int, list[Callable[[], None]]]" = OrderedDict()
        self._plans_lock = threading.Lock()
        self.allocated = 0

    # --- buffers -------------------------------------------------------------------------------
    def alloc_buffer(self, size: int, usage: str = "compute") -> Buffer:
        if size < 0:
            raise ValueError("negative buffer size")
        buf = CPUBuffer(self, size, usage)
        self.allocated += size
        return buf

    def free_buffer(self, buffer: Buffer) -> None:
        self.allocated -= buffer.size
        buffer.data = np.zeros(0, dtype=np.uint8)  # type: ignore[attr-defined]

    def clear_buffer(self, buffer: Buffer, value: int = 0) -> None:
        buffer.data.fill(value)  # type: ignore[attr-defined]

    # --- data ------------------------------------------------------------------------------------
    @staticmethod
    def bytes_of(t: Tensor) -> np.ndarray:
        assert t.buffer is not None, f"tensor {t.name} is not allocated"
        return t.buffer.data[t.offset:t.offset + t.nbytes]  # type: ignore[attr-defined]

    @classmethod
    def array(cls, t: Tensor) -> np.ndarray:
        """A numpy view of the tensor (element types only)."""
        return cls.bytes_of(t).view(NP_DTYPES[t.dtype]).reshape(t.shape)

    def set_tensor(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        src = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if offset < 0 or offset + src.size > tensor.nbytes:
            raise ValueError(f"set_tensor: {src.size} bytes at {offset} overflow {tensor.name} ({tensor.nbytes} B)")
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

    def host_array(self, tensor: Tensor) -> Optional[np.ndarray]:
        return self.bytes_of(tensor)

    def can_copy_from(self, src: Backend) -> bool:
        return isinstance(src, CPUBackend)

    def cpy_tensor_async(self, src: Tensor, dst: Tensor) -> bool:
        if not isinstance(src.backend, CPUBackend):
            return False
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
        t0 = trace.now() if trace.enabled else 0
        for step in steps:
            step()
        if t0:
            trace.event("dev", f"compute {self.name}", t0, trace.now(), n_nodes=len(graph.nodes))
        for t, out in reads:
            self.get_tensor(t, out)

    def forget_graph(self, uid: int) -> None:
        """Drops the bound plan of a graph (its views would keep freed buffers alive)."""
        with self._plans_lock:
            self._plans.pop(uid, None)

    def _prepare(self, graph: Graph) -> list[Callable[[], None]]:
        """Binds every node to its kernel and its numpy views once per graph."""
        steps: list[Callable[[], None]] = []
        nt = self.n_threads
        empty = np.zeros(0, dtype=np.float32)
        for nd in graph.nodes:
            for t in (nd.out, *nd.srcs):
                if t.buffer is None or t.buffer.backend is not self:
                    raise ValueError(f"graph tensor {t.name} is not on {self.name}")
            out = self.array(nd.out)
            s = [self.array(t) for t in nd.srcs]
            op = nd.op
            if op == Op.GET_ROWS:
                steps.append(_bind_get_rows(s[0], s[1], out))
            elif op == Op.RMS_NORM:
                steps.append(_bind(k.rms_norm, s[0], s[1], out, float(nd.params[0]), nt))
            elif op == Op.MUL_MAT:
                bias = s[2] if len(s) == 3 else None
                if s[0].shape[0] <= gemm.small_rows_max() and not _BLAS_ONLY:
                    steps.append(_bind(gemm.mul_mat_t, s[0], s[1], out, bias, nt))
                elif bias is not None:
                    steps.append(_bind_mul_mat_bias(s[0], s[1].T, bias, out))
                else:
                    steps.append(_bind(np.matmul, s[0], s[1].T, out=out))
            elif op == Op.ADD:
                steps.append(_bind(np.add, s[0], s[1], out=out))
            elif op == Op.SWIGLU:
                steps.append(_bind(k.swiglu, s[0], out, nt))
            elif op == Op.ATTENTION:
                qn, kn = (s[7], s[8]) if len(s) == 9 else (empty, empty)
                p = nd.params
                steps.append(_bind(k.attention, s[0], s[1], s[2], s[3], s[4], s[5], s[6], qn, kn, out,
                                   int(p[0]), int(p[1]), int(p[2]), int(p[3]), int(p[4]), float(p[5]),
                                   float(p[6]), float(p[7]), float(p[8]), nt))
            elif op == Op.SAMPLE:
                steps.append(_bind_sample(s[0], s[1], out, int(nd.params[0]), int(nd.params[1]), nt))
            else:
                raise ValueError(f"unknown op {op!r}")
        return steps

    # --- information ---------------------------------------------------------------------------
    def device_info(self) -> DeviceInfo:
        return DeviceInfo(self.name, "cpu", f"CPU ({self.n_threads} threads)", _available_memory(), _total_memory())

    def weight_dtype(self, file_dtype: DType) -> DType:
        return DType.F32


def _bind(fn: Callable, *args, **kwargs) -> Callable[[], None]:
    return lambda: fn(*args, **kwargs)


def _bind_get_rows(table: np.ndarray, ids: np.ndarray, out: np.ndarray) -> Callable[[], None]:
    return lambda: np.take(table, ids, axis=0, out=out, mode="raise")


def _bind_sample(logits: np.ndarray, inp: np.ndarray, out: np.ndarray, n_probs: int, window: int,
                 nt: int) -> Callable[[], None]:
    """The SAMPLE op: unpacks the rows' sampler inputs, runs the sampling kernel, packs the ids,
    probabilities and candidates (layout in graph/ops.py)."""
    rows = logits.shape[0]
    if not 0 <= n_probs <= 4096 or not 0 <= window <= 1 << 20:
        raise ValueError(f"SAMPLE: n_probs {n_probs} or window {window} out of range")
    if inp.shape != (rows, sample_in_cols(window)) or inp.dtype != np.int32:
        raise ValueError(f"SAMPLE: sampling input {inp.shape} {inp.dtype}, expected int32 ({rows}, {sample_in_cols(window)})")
    if out.shape != (rows, sample_out_cols(n_probs)) or out.dtype != np.int32:
        raise ValueError(f"SAMPLE: output {out.shape} {out.dtype}, expected int32 ({rows}, {sample_out_cols(n_probs)})")
    fparams = np.zeros((rows, 8), np.float32)
    iparams = np.zeros((rows, 4), np.int32)
    pen = np.zeros((rows, window), np.int32)
    ids = np.zeros(rows, np.int32)
    prob = np.zeros(rows, np.float32)
    top_ids = np.zeros((rows, n_probs), np.int32)
    top_probs = np.zeros((rows, n_probs), np.float32)

    def run() -> None:
        fparams.view(np.int32)[:] = inp[:, :8]
        iparams[:] = inp[:, 8:12]
        pen[:] = inp[:, 12:]
        k_sampling.sample_rows(logits, fparams, iparams, pen, ids, prob, top_ids, top_probs, nt)
        out[:, 0] = ids
        out[:, 1] = prob.view(np.int32)
        out[:, 2:2 + n_probs] = top_ids
        out[:, 2 + n_probs:] = top_probs.view(np.int32)
    return run


def _bind_mul_mat_bias(x: np.ndarray, wt: np.ndarray, bias: np.ndarray, out: np.ndarray) -> Callable[[], None]:
    def run() -> None:
        np.matmul(x, wt, out=out)
        np.add(out, bias, out=out)
    return run
