"""The CUDA backend: one NVIDIA GPU through PyCUDA, kernels from cuda_src/ compiled ahead of time.

What runs where (docs/cuda.md):
- kernels: cuda_src/*.cu, compiled by nvcc at install time into pyllama/backend/cuda/kernels/
  <name>.fatbin (sm_90 code plus compute_90 PTX) and loaded here with module_from_file;
  matrix products through cuBLAS (cublasGemmEx via ctypes, cublas.py beside this module).
- weights (the device's layout, layout.py): quantized (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K), F16 and
  BF16 file tensors are converted on the device at load into one half-precision type (F16, or
  BF16 with PYLLAMA_CUDA_WEIGHTS=bf16); the other block types (Q4_1, Q5_0, Q5_1, Q2_K, Q3_K) are
  dequantized on the host to that type, so every MUL_MAT is one cuBLAS GEMM with float32
  accumulation; F32 tensors stay F32.
  Activations, the KV cache and every op's output are float32.
- streams: each queue of work has its own CUDA stream, cuBLAS handle and scratch (a "lane"):
  every stream of `new_stream()` (CUDAStream: each pipeline group's context computes on one) and,
  for calls made on the backend itself (its default stream), every thread that makes them (the
  loader, the rpc server's executors). Nothing waits for the GPU unless the interface asks:
  graph_compute and the *_async calls return at once, synchronize() waits for that stream,
  blocking set_tensor / get_tensor complete before returning (a write into a compute buffer only
  needs its bytes taken: the driver stages pageable memory before the call returns). Work of two
  lanes on one buffer is ordered on the GPU by events (`_order`).
- reads queued with a graph (`reads`) or get_tensor_async go to pinned staging on the stream and
  land in the caller's arrays at synchronize(). A hidden state bound for a peer (cpy_tensor_from_async)
  goes to pinned staging too, and is sent once an event recorded after it completes: the producing
  stream is never synchronized for it.
- events: real CUDA events; event_wait makes the waiting stream wait on the GPU, not the host.
- tracing (docs/tracing.md, `dev` spans): CUDA events recorded around each graph compute; their times are put
  on the host's monotonic microsecond scale through an anchor event recorded when the stream
  goes from idle to busy (so the anchor's GPU time is the host time of its recording within a
  few microseconds), and collected when the caller is idle anyway (synchronize, blocking reads,
  trace_poll) as `dev` / `compute CUDA<i>` spans, one row per stream. Nothing waits on the GPU
  to trace it.

Importing this module needs nothing beyond numpy: PyCUDA is imported when a backend is opened,
and every way that can fail (no PyCUDA, no driver, no device, kernels not built) is one
CUDAUnavailable error with what to do about it.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import struct
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES

from ...obs import trace
from ...util.errors import PyllamaError
from ...util.settings import current as current_settings
from ...ir.tensor import AttentionParams, Graph, Op, check_node, sample_in_cols, sample_out_cols
from . import build as cuda_build
from ..base import NP_DTYPES, Backend, Buffer, DeviceInfo, DType, Event, Tensor
from ..stream import Stream
from .layout import DEQUANT_KERNELS, ConvertingLayout

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent / "kernels"
SOURCE_DIR = Path(__file__).resolve().parents[3] / "cuda_src"  # present in a source checkout
MODULES = ("elementwise", "attention", "dequant", "sampling")
MIN_COMPUTE_CAPABILITY = (9, 0)  # the fatbins carry sm_90 code and compute_90 PTX

# The kernels each op launches (MUL_MAT also calls cublasGemmEx). Every Op must be here: the
# static check of tests/test_cuda.py compares this table with graph.ops.Op and cuda_src/.
OP_KERNELS: dict[Op, tuple[str, ...]] = {
    Op.GET_ROWS: ("get_rows_f32", "get_rows_f16", "get_rows_bf16"),
    Op.RMS_NORM: ("rms_norm_f32",),
    Op.MUL_MAT: ("convert_f32_f16", "convert_f32_bf16", "add_bias_f32"),
    Op.ADD: ("add_f32",),
    Op.SWIGLU: ("swiglu_f32",),
    Op.ATTENTION: ("attn_store", "attn_attend"),
    Op.SAMPLE: ("sample_rows",),
}

# Argument layouts (Python struct, native alignment = the kernel parameter layout).
_FORMATS: dict[str, str] = {
    "get_rows_f32": "PPPqqP", "get_rows_f16": "PPPqqP", "get_rows_bf16": "PPPqqP",
    "rms_norm_f32": "PPPqf",
    "swiglu_f32": "PPqq",
    "add_f32": "PPPq",
    "add_bias_f32": "PPqq",
    "convert_f32_f16": "PPq", "convert_f32_bf16": "PPq",
    "attn_store": "PPPPPPPPiiiiiddfqP",
    "attn_attend": "PPPPPiiifqqP",
    "sample_rows": "PPPPPPiiiP",
    **{name: "PPq" for name in DEQUANT_KERNELS.values()},
}
_BLOCK = {"attn_store": 256, "attn_attend": 128, "sample_rows": 512}  # threads per block (default 256)
_ERR_BITS = {1: "a row id outside its table (GET_ROWS)", 2: "a KV cell outside the cache (ATTENTION)",
             4: "a token's cell range outside the cell list (ATTENTION)",
             8: "n_probs or n_penalty_tokens outside the packed widths (SAMPLE)"}
_PLAN_CACHE = 256
_MAX_HEAD_DIM = 256            # attn_attend holds head_dim / 32 values per lane (ATT_MAXD = 8)
_LOAD_CHUNK = 64 << 20         # bytes of file data converted per launch at load
_PINNED_KEEP = 256 << 20       # pinned staging a stream keeps for reuse
_MAX_SPANS = 4096              # trace spans a stream keeps while nobody collects them
_ALIGN = 256

F16, BF16, F32, I32 = DType.F16, DType.BF16, DType.F32, DType.I32


class CUDAUnavailable(PyllamaError):
    """The CUDA backend cannot run here; the message says why and what to do."""


# --- PyCUDA, imported on first use ----------------------------------------------------------------
def _driver() -> Any:
    try:
        import pycuda.driver as drv  # noqa: PLC0415 - optional dependency
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "pycuda":
            raise CUDAUnavailable("PyCUDA is not installed: pip install 'pyllama[cuda]' (it builds PyCUDA from "
                                  "source against the local CUDA toolkit, see docs/cuda.md)") from None
        raise CUDAUnavailable(f"PyCUDA cannot be imported: {exc}") from None
    except ImportError as exc:  # typically libcuda.so.1 missing: no NVIDIA driver
        raise CUDAUnavailable(f"PyCUDA cannot load the CUDA driver ({exc}); is an NVIDIA driver installed?") from None
    try:
        drv.init()
    except Exception as exc:  # noqa: BLE001 - pycuda raises its own error types
        raise CUDAUnavailable(f"the CUDA driver failed to initialize ({exc})") from None
    return drv


def device_count() -> int:
    """CUDA devices visible to this process (CUDAUnavailable when PyCUDA or the driver is missing)."""
    return _driver().Device.count()


def kernel_dir() -> Path:
    """Where the fatbins are loaded from ($PYLLAMA_CUDA_KERNELS overrides)."""
    return Path(current_settings().cuda.kernels or KERNEL_DIR)


def open_backend(name: str) -> "CUDABackend":
    """The backend of a `--device` name CUDA<i>; CUDAUnavailable (one actionable line) otherwise."""
    if not (name.startswith("CUDA") and name[4:].isdigit()):
        raise CUDAUnavailable(f"--device {name}: expected CUDA<index>, e.g. CUDA0")
    try:
        return CUDABackend(int(name[4:]), name)
    except CUDAUnavailable as exc:
        raise CUDAUnavailable(f"--device {name}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a driver error while opening: still one clear line
        raise CUDAUnavailable(f"--device {name}: cannot open the device ({type(exc).__name__}: {exc})") from None


# --- buffers, lanes, plans ------------------------------------------------------------------------
class CUDABuffer(Buffer):
    __slots__ = ("alloc", "ptr", "lane")

    def __init__(self, backend: "CUDABackend", size: int, usage: str, alloc: Any):
        super().__init__(backend, size, usage)
        self.alloc = alloc
        self.ptr = int(alloc)
        self.lane: Optional[_Lane] = None  # the stream that last queued work on it


class _Kernel:
    """A kernel with its argument layout; bind() packs the arguments once per graph."""

    __slots__ = ("fn", "fmt", "block", "name")

    def __init__(self, fn: Any, name: str):
        self.fn = fn
        self.name = name
        self.fmt = "@" + _FORMATS[name]
        self.block = (_BLOCK.get(name, 256), 1, 1)

    def bind(self, grid: int, *args: Any) -> Callable[[Any], None]:
        block, g = self.block, (int(grid), 1, 1)
        launch = getattr(self.fn, "_launch_kernel", None)
        if launch is None:  # a PyCUDA without it: the public call, which packs on every launch
            fn = self.fn
            if getattr(fn, "arg_format", None) is None:
                fn.prepare(self.fmt[1:])
            return lambda stream: fn.prepared_async_call(g[:2], block, stream, *args)
        buf = struct.pack(self.fmt, *args)
        # the call prepared_async_call makes, with the arguments packed once instead of per launch
        return lambda stream: launch(g, block, buf, 0, stream)


def _grid(n: int, block: int = 256, cap: int = 8192) -> int:
    """Blocks of a grid-stride launch over n elements."""
    return max(1, min(cap, -(-n // block)))


class _Plan:
    __slots__ = ("steps", "buffers", "buffer_ids", "n_nodes")

    def __init__(self, steps: list, buffers: list, n_nodes: int):
        self.steps = steps
        self.buffers = buffers  # written or read buffers other than weights (cross-stream order)
        self.buffer_ids = {b.id for b in buffers}
        self.n_nodes = n_nodes


class _Lane:
    """What one queue of work uses of the device (a CUDAStream's, or a thread's on the default
    stream): stream, cuBLAS handle, scratch, error word, reads in flight, pinned staging, bound
    plans and trace state."""

    def __init__(self, backend: "CUDABackend", index: int):
        drv = self._drv = backend._drv
        self.index = index
        self.stream = drv.Stream(flags=1)  # CU_STREAM_NON_BLOCKING: no implicit legacy-stream syncs
        self.blas = backend._blas.create(self.stream.handle)
        self.scratch: Any = None
        self.scratch_size = 0
        self.staging: Any = None  # load-time upload buffer
        self.err_dev = drv.mem_alloc(4)
        drv.memset_d32_async(self.err_dev, 0, 1, self.stream)
        self.err_host = drv.pagelocked_empty(1, np.uint32)
        self.reads: list[tuple[np.ndarray, np.ndarray, int]] = []
        self.pinned_free: list[np.ndarray] = []
        self.pinned_used: list[np.ndarray] = []
        self.plans: "OrderedDict[int, _Plan]" = OrderedDict()
        self.idle = True
        self.anchor: Optional[tuple[Any, int]] = None
        self.spans: list[tuple[Any, Any, tuple[Any, int], int]] = []
        self.last_t1 = 0
        self.copy_done: Any = None  # the event a source-side copy waits for (reused: waited each time)
        self.stream.synchronize()

    def pinned(self, n: int) -> np.ndarray:
        """Page-locked staging of at least n bytes, reused after the next synchronize."""
        best = None
        for i, arr in enumerate(self.pinned_free):
            if arr.size >= n and (best is None or arr.size < self.pinned_free[best].size):
                best = i
        if best is not None:
            arr = self.pinned_free.pop(best)
        else:
            size = max(1 << 16, 1 << max(0, n - 1).bit_length())
            arr = self._drv.pagelocked_empty(size, np.uint8)
        self.pinned_used.append(arr)
        return arr

    def release_pinned(self, arr: np.ndarray) -> None:
        """Gives back staging whose bytes have been consumed before the next synchronize."""
        for i, used in enumerate(self.pinned_used):
            if used is arr:
                del self.pinned_used[i]
                self.pinned_free.append(arr)
                self.pinned_free.sort(key=lambda a: a.size)
                return

    def recycle_pinned(self) -> None:
        self.pinned_free.extend(self.pinned_used)
        self.pinned_used.clear()
        self.pinned_free.sort(key=lambda a: a.size)
        while sum(a.size for a in self.pinned_free) > _PINNED_KEEP:
            self.pinned_free.pop()  # the largest goes first


class CUDABackend(Backend):
    """One CUDA device (see the module docstring)."""

    weight_types = frozenset({F32, F16, BF16})  # whatever this process stores, a client may send any
    kv_types = frozenset({F32})  # the attention kernels read and write F32 caches only

    def __init__(self, index: int = 0, name: Optional[str] = None):
        drv = _driver()
        n = drv.Device.count()
        if not 0 <= index < n:
            raise CUDAUnavailable(f"there is no CUDA device {index} (this machine has {n})")
        self._drv = drv
        self.index = index
        self.name = name or f"CUDA{index}"
        self._dev = drv.Device(index)
        cc = self._dev.compute_capability()
        if tuple(cc) < MIN_COMPUTE_CAPABILITY:
            raise CUDAUnavailable(f"{self._dev.name()} has compute capability {cc[0]}.{cc[1]}; the kernels are built "
                                  f"for {MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]} (sm_90) and newer")
        kdir = kernel_dir()
        missing = [m for m in MODULES if not (kdir / f"{m}.fatbin").exists()]
        if missing:
            raise CUDAUnavailable(f"the CUDA kernels are not built ({kdir} lacks {', '.join(m + '.fatbin' for m in missing)}): "
                                  "reinstall with the CUDA toolkit's nvcc on PATH (pip install -e '.[cuda]')")
        _warn_if_stale(kdir)
        from .cublas import CuBLAS  # noqa: PLC0415
        try:
            self._blas = CuBLAS()
        except OSError as exc:
            raise CUDAUnavailable(str(exc)) from None
        self.layout: ConvertingLayout = ConvertingLayout(self)
        self._ctx = self._dev.retain_primary_context()
        self._tls = threading.local()
        self._lock = threading.RLock()
        self._lanes: list[_Lane] = []
        self._lane_ids = itertools.count()  # a lane's number names its row in a trace
        self._closed = False
        self.allocated = 0
        with self._active():
            self._modules = [drv.module_from_file(str(kdir / f"{m}.fatbin")) for m in MODULES]
            self._kernels: dict[str, _Kernel] = {}
            for kname in _FORMATS:
                self._kernels[kname] = _Kernel(self._function(kname), kname)

    def _function(self, kname: str) -> Any:
        for mod in self._modules:
            try:
                return mod.get_function(kname)
            except self._drv.LogicError:
                continue
        raise CUDAUnavailable(f"kernel {kname} is in none of the modules of {kernel_dir()}: rebuild the kernels")

    # --- context and lanes -----------------------------------------------------------------------
    @contextlib.contextmanager
    def _active(self) -> Iterator[None]:
        """Makes the device's (primary) context current on the calling thread for the block."""
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        self._ctx.push()
        try:
            yield
        finally:
            self._drv.Context.pop()

    def _lane(self, stream: Optional["CUDAStream"] = None) -> _Lane:
        """The lane work goes to: `stream`'s, or on the default stream (None) the calling thread's.
        Made on first use, with the context active (it allocates on the device)."""
        if stream is not None:
            with self._lock:
                if stream.lane is None:
                    stream.lane = self._new_lane()
                return stream.lane
        lane = getattr(self._tls, "lane", None)
        if lane is None:
            with self._lock:
                lane = self._new_lane()
            self._tls.lane = lane
        return lane

    def _new_lane(self) -> _Lane:
        lane = _Lane(self, next(self._lane_ids))
        self._lanes.append(lane)
        return lane

    def end_thread(self) -> None:
        lane = getattr(self._tls, "lane", None)
        if lane is None:
            return
        self._tls.lane = None
        with self._lock:
            if lane not in self._lanes:  # the device closed
                return
            self._lanes.remove(lane)
        with self._active():
            self._free_lane(lane)

    def _free_lane(self, lane: _Lane) -> None:
        """Waits for the lane's work and frees what it holds (called with the context active)."""
        try:
            lane.stream.synchronize()
            self._blas.destroy(lane.blas)
            for a in (lane.scratch, lane.staging, lane.err_dev):
                if a is not None:
                    a.free()
        except Exception as exc:  # noqa: BLE001 - freeing must release what it can
            log.warning("%s: closing stream %d: %s", self.name, lane.index, exc)
        lane.idle = True  # buffers that name it as their last user need not wait for it
        lane.plans.clear()
        lane.spans.clear()

    def new_stream(self) -> "CUDAStream":
        return CUDAStream(self)

    def _begin(self, lane: _Lane) -> None:
        """Called before queueing work: an idle stream gets a fresh trace anchor."""
        if lane.idle:
            lane.idle = False
            if trace.enabled:
                ev = self._drv.Event()
                ev.record(lane.stream)
                lane.anchor = (ev, trace.now())

    def _order(self, lane: _Lane, buffers: Sequence[CUDABuffer]) -> None:
        """Work on `buffers` queued by another thread's stream and not yet waited for comes first:
        this stream waits for it on the GPU (a context used from two threads stays correct)."""
        for b in buffers:
            other = b.lane
            if other is not lane:
                if other is not None and not other.idle:
                    ev = self._drv.Event(self._drv.event_flags.DISABLE_TIMING)
                    ev.record(other.stream)
                    lane.stream.wait_for_event(ev)
                b.lane = lane

    def _finish(self, lane: _Lane) -> None:
        """Waits for the lane's stream, completes its queued reads, collects trace spans and
        reports errors the kernels flagged."""
        self._drv.memcpy_dtoh_async(lane.err_host, lane.err_dev, lane.stream)
        lane.stream.synchronize()
        lane.idle = True
        lane.anchor = None
        for pinned, out, n in lane.reads:
            out.reshape(-1).view(np.uint8)[:] = pinned[:n]
        lane.reads.clear()
        lane.recycle_pinned()
        if lane.spans:
            self._poll(lane)
        err = int(lane.err_host[0])
        if err:
            self._drv.memset_d32_async(lane.err_dev, 0, 1, lane.stream)
            what = "; ".join(msg for bit, msg in _ERR_BITS.items() if err & bit) or f"error bits {err:#x}"
            raise ValueError(f"{self.name}: a graph computed here met {what}")

    def _buf(self, t: Tensor) -> CUDABuffer:
        buf = t.buffer
        if buf is None or buf.backend is not self:
            raise ValueError(f"tensor {t.name} is not on {self.name}")
        if t.offset < 0 or t.offset + t.nbytes > buf.size:
            raise ValueError(f"tensor {t.name} ({t.nbytes} B at {t.offset}) overflows its buffer of {buf.size} B")
        return buf  # type: ignore[return-value]

    def _ptr(self, t: Tensor) -> int:
        return self._buf(t).ptr + t.offset

    # --- buffers -------------------------------------------------------------------------------
    def alloc_buffer(self, size: int, usage: str = "compute") -> Buffer:
        if size < 0:
            raise ValueError("negative buffer size")
        with self._active():
            try:
                alloc = self._drv.mem_alloc(max(size, 1))
            except self._drv.MemoryError as exc:
                raise MemoryError(f"{self.name}: cannot allocate {size} B ({exc})") from None
            lane = self._lane()
            # zeroed like a CPU buffer; the wait keeps other streams from seeing it uninitialized
            self._drv.memset_d8_async(alloc, 0, max(size, 1), lane.stream)
            lane.stream.synchronize()
        self.allocated += size
        return CUDABuffer(self, size, usage, alloc)

    def free_buffer(self, buffer: Buffer) -> None:
        alloc = getattr(buffer, "alloc", None)
        if alloc is None:
            return
        if self._closed:  # the allocation activates its own context to free itself
            with contextlib.suppress(Exception):
                alloc.free()
            buffer.alloc = None  # type: ignore[attr-defined]
            self.allocated -= buffer.size
            return
        with self._active():
            self._drv.Context.synchronize()  # no stream may still use it
            with self._lock:
                for lane in self._lanes:
                    for uid in [u for u, p in lane.plans.items() if buffer.id in p.buffer_ids]:
                        del lane.plans[uid]
            alloc.free()
        buffer.alloc = None  # type: ignore[attr-defined]
        self.allocated -= buffer.size

    def clear_buffer(self, buffer: Buffer, value: int = 0) -> None:
        with self._active():
            lane = self._lane()
            self._begin(lane)
            self._order(lane, (buffer,))  # type: ignore[arg-type]
            self._drv.memset_d8_async(buffer.ptr, value & 0xFF, buffer.size, lane.stream)  # type: ignore[attr-defined]
            self._finish(lane)

    # --- data ----------------------------------------------------------------------------------
    def set_tensor(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        self._write(None, tensor, data, offset)

    def _write(self, stream: Optional["CUDAStream"], tensor: Tensor, data: np.ndarray, offset: int) -> None:
        src = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if offset < 0 or offset + src.size > tensor.nbytes:
            raise ValueError(f"set_tensor: {src.size} bytes at {offset} overflow {tensor.name} ({tensor.nbytes} B)")
        buf = self._buf(tensor)
        if src.size == 0:
            return
        with self._active():
            lane = self._lane(stream)
            self._begin(lane)
            self._order(lane, (buf,))
            # pageable source: the driver has copied it to its own staging when this returns
            self._drv.memcpy_htod_async(buf.ptr + tensor.offset + offset, src, lane.stream)
            if buf.usage != "compute":
                # weights and KV cells are read by every stream: complete the write here
                self._finish(lane)

    def get_tensor(self, tensor: Tensor, out: Optional[np.ndarray] = None) -> np.ndarray:
        buf = self._buf(tensor)
        if out is None:
            out = (np.empty(tensor.shape, NP_DTYPES[tensor.dtype]) if tensor.dtype in NP_DTYPES
                   else np.empty(tensor.nbytes, np.uint8))
        if not out.flags.c_contiguous or out.nbytes != tensor.nbytes:
            raise ValueError(f"get_tensor: {tensor.name} has {tensor.nbytes} B, destination {out.nbytes} B"
                             f"{'' if out.flags.c_contiguous else ' (not contiguous)'}")
        with self._active():
            lane = self._lane()
            self._begin(lane)
            self._order(lane, (buf,))
            if tensor.nbytes:
                pinned = lane.pinned(tensor.nbytes)
                self._drv.memcpy_dtoh_async(pinned[:tensor.nbytes], buf.ptr + tensor.offset, lane.stream)
                lane.reads.append((pinned, out, tensor.nbytes))
            self._finish(lane)
        return out

    def get_tensor_async(self, tensor: Tensor, out: np.ndarray) -> None:
        self._read(None, tensor, out)

    def _read(self, stream: Optional["CUDAStream"], tensor: Tensor, out: np.ndarray) -> None:
        buf = self._buf(tensor)
        with self._active():
            lane = self._lane(stream)
            self._begin(lane)
            self._order(lane, (buf,))
            self._read_async(lane, tensor, out)

    def _read_async(self, lane: _Lane, tensor: Tensor, out: np.ndarray) -> None:
        if not out.flags.c_contiguous or out.nbytes != tensor.nbytes:
            raise ValueError(f"read of {tensor.name}: destination must be contiguous and {tensor.nbytes} B")
        if tensor.nbytes == 0:
            return
        pinned = lane.pinned(tensor.nbytes)
        self._drv.memcpy_dtoh_async(pinned[:tensor.nbytes], self._ptr(tensor), lane.stream)
        lane.reads.append((pinned, out, tensor.nbytes))

    def can_copy_from(self, src: Backend) -> bool:
        return src is self or src.host_memory

    def cpy_tensor_async(self, src: Tensor, dst: Tensor) -> bool:
        return self._copy(None, src, dst)

    def _copy(self, stream: Optional["CUDAStream"], src: Tensor, dst: Tensor) -> bool:
        if src.nbytes != dst.nbytes:
            raise ValueError(f"copy {src.name} -> {dst.name}: {src.nbytes} B into {dst.nbytes} B")
        sb = src.backend
        if sb is self:
            with self._active():
                lane = self._lane(stream)
                self._begin(lane)
                self._order(lane, (self._buf(src), self._buf(dst)))
                if src.nbytes:
                    self._drv.memcpy_dtod_async(self._ptr(dst), self._ptr(src), src.nbytes, lane.stream)
            return True
        host = sb.host_array(src)
        if host is None:
            return False
        # a host-memory producer has finished when its graph_compute returned
        self._write(stream, dst, host, 0)
        return True

    def can_copy_to(self, dst: Backend) -> bool:
        # a remote device's writes take the bytes before returning, so pinned staging can be reused
        # at once; another local device would read them later, from its own stream
        return dst.remote

    def cpy_tensor_from_async(self, src: Tensor, dst: Tensor) -> bool:
        return self._copy_out(None, src, dst)

    def _copy_out(self, stream: Optional["CUDAStream"], src: Tensor, dst: Tensor) -> bool:
        """Source side of a copy to a remote device (a peer, which cannot read this memory): the
        bytes go to pinned staging on the producing stream, the host waits for an event recorded
        right after them, and the peer is sent them. The stream is never synchronized: work queued
        on it later keeps running, and other reads of the lane complete at its synchronize. Errors
        the kernels flagged so far are raised as synchronize raises them."""
        dst_backend = dst.backend
        if src.backend is not self or dst_backend is None or not self.can_copy_to(dst_backend):
            return False
        if src.nbytes != dst.nbytes:
            raise ValueError(f"copy {src.name} -> {dst.name}: {src.nbytes} B into {dst.nbytes} B")
        with self._active():
            lane = self._lane(stream)
            self._begin(lane)
            self._order(lane, (self._buf(src),))
            pinned = lane.pinned(max(src.nbytes, 1))
            if src.nbytes:
                self._drv.memcpy_dtoh_async(pinned[:src.nbytes], self._ptr(src), lane.stream)
            self._drv.memcpy_dtoh_async(lane.err_host, lane.err_dev, lane.stream)
            if lane.copy_done is None:
                lane.copy_done = self._drv.Event(self._drv.event_flags.DISABLE_TIMING)
            lane.copy_done.record(lane.stream)
            lane.copy_done.synchronize()  # this copy, not the stream
            # one thread queues on a lane (its own, or the one of the stream it computes on), and
            # nothing came after the event: the stream is idle now, so the next work gets a fresh
            # trace anchor (reads still land at synchronize)
            lane.idle = True
            lane.anchor = None
            if lane.spans:
                self._poll(lane)  # the graphs before it are complete: their spans are ready
            err = int(lane.err_host[0])
            if err:
                lane.release_pinned(pinned)
                self._drv.memset_d32_async(lane.err_dev, 0, 1, lane.stream)
                what = "; ".join(msg for bit, msg in _ERR_BITS.items() if err & bit) or f"error bits {err:#x}"
                raise ValueError(f"{self.name}: a graph computed here met {what}")
        try:
            dst_backend.set_tensor_async(dst, pinned[:src.nbytes])
        finally:
            lane.release_pinned(pinned)
        return True

    def convert_weight(self, tensor: Tensor, offset: int, file_dtype: DType, raw: np.ndarray, kname: str) -> None:
        """Converts one file tensor on the device into its rows of `tensor` (F16 or BF16) with the
        dequant kernel `kname` (the layout's set_weight): the raw bytes go up in chunks, the kernel
        writes the half-precision values."""
        kernel = self._kernels[kname]
        block, type_size = GGML_QUANT_SIZES[file_dtype]
        src = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        if src.size % type_size:
            raise ValueError(f"{tensor.name}: {src.size} B is not a whole number of {file_dtype.name} blocks")
        n_blocks = src.size // type_size
        out_bytes = n_blocks * block * 2
        if offset < 0 or offset + out_bytes > tensor.nbytes:
            raise ValueError(f"set_weight: {out_bytes} B at {offset} overflow {tensor.name} ({tensor.nbytes} B)")
        buf = self._buf(tensor)
        chunk_blocks = max(1, _LOAD_CHUNK // type_size)
        with self._active():
            lane = self._lane()
            self._begin(lane)
            self._order(lane, (buf,))
            if lane.staging is None:
                lane.staging = self._drv.mem_alloc(chunk_blocks * type_size)
            dst = buf.ptr + tensor.offset + offset
            for b0 in range(0, n_blocks, chunk_blocks):
                nb = min(chunk_blocks, n_blocks - b0)
                self._drv.memcpy_htod_async(lane.staging, src[b0 * type_size:(b0 + nb) * type_size], lane.stream)
                n = nb * block
                kernel.bind(_grid(n), int(lane.staging), dst + b0 * block * 2, n)(lane.stream)
            self._finish(lane)

    # --- compute -------------------------------------------------------------------------------
    def graph_compute(self, graph: Graph, reads: Sequence[tuple[Tensor, np.ndarray]] = ()) -> None:
        self._compute(None, graph, reads)

    def _compute(self, stream: Optional["CUDAStream"], graph: Graph,
                 reads: Sequence[tuple[Tensor, np.ndarray]]) -> None:
        with self._active():
            lane = self._lane(stream)
            with self._lock:
                plan = lane.plans.get(graph.uid)
                if plan is not None:
                    lane.plans.move_to_end(graph.uid)
            if plan is None:
                plan = self._prepare(lane, graph)
                with self._lock:
                    lane.plans[graph.uid] = plan
                    if len(lane.plans) > _PLAN_CACHE:
                        lane.plans.popitem(last=False)
            self._begin(lane)
            self._order(lane, plan.buffers)
            stream = lane.stream
            ev0 = None
            if trace.enabled and lane.anchor is not None:
                ev0 = self._drv.Event()
                ev0.record(stream)
            for step in plan.steps:
                step(stream)
            if ev0 is not None:
                ev1 = self._drv.Event()
                ev1.record(stream)
                with self._lock:
                    lane.spans.append((ev0, ev1, lane.anchor, plan.n_nodes))  # type: ignore[arg-type]
                    if len(lane.spans) > _MAX_SPANS:
                        del lane.spans[0]
            for t, out in reads:
                self._read_async(lane, t, out)

    def synchronize(self) -> None:
        self._sync(getattr(self._tls, "lane", None))

    def _sync(self, lane: Optional[_Lane]) -> None:
        if lane is None:
            return  # nothing was ever queued there
        with self._active():
            self._finish(lane)

    def forget_graph(self, uid: int) -> None:
        with self._lock:
            for lane in self._lanes:
                lane.plans.pop(uid, None)

    def _prepare(self, lane: _Lane, graph: Graph) -> _Plan:
        """Checks every node (a graph may come from the wire) and binds it to its launches."""
        need = 0
        for nd in graph.nodes:
            for t in (nd.out, *nd.srcs):
                self._buf(t)
            need = max(need, _scratch_bytes(nd))
        if need > lane.scratch_size:
            if not lane.idle:
                lane.stream.synchronize()  # the old scratch may still be in use
            if lane.scratch is not None:
                lane.scratch.free()
            lane.scratch = None
            lane.scratch = self._drv.mem_alloc(need)
            lane.scratch_size = need
            with self._lock:
                lane.plans.clear()  # their steps point at the old scratch
        scratch = int(lane.scratch) if lane.scratch is not None else 0
        steps: list[Callable[[Any], None]] = []
        buffers: dict[int, CUDABuffer] = {}
        for nd in graph.nodes:
            for t in (nd.out, *nd.srcs):
                b = self._buf(t)
                if b.usage != "weights":
                    buffers[b.id] = b
            steps.extend(self._bind(nd, lane, scratch))
        return _Plan(steps, list(buffers.values()), len(graph.nodes))

    def _bind(self, nd: Any, lane: _Lane, scratch: int) -> list[Callable[[Any], None]]:
        op, out, s, p = nd.op, nd.out, nd.srcs, nd.params
        if op not in OP_KERNELS:
            raise ValueError(f"{op.name} does not run on {self.name}")
        why = check_node(op, out.dtype, [t.dtype for t in s], p, self.weight_types)  # the op table's types
        if why is not None:
            raise ValueError(f"{op.name} {out.name}: {why}")
        K, P = self._kernels, self._ptr
        err = int(lane.err_dev)
        if op == Op.GET_ROWS:
            table, ids = _want(s, 2, op)
            if table.dtype not in (F32, F16, BF16) or len(table.shape) != 2:
                raise ValueError(f"GET_ROWS: table {table.name} must be a 2-D F32/F16/BF16 tensor")
            _check(ids, I32, (ids.shape[0],), op)
            m, d = ids.shape[0], table.shape[1]
            _check(out, F32, (m, d), op)
            if m == 0:
                return []
            kname = {F32: "get_rows_f32", F16: "get_rows_f16", BF16: "get_rows_bf16"}[table.dtype]
            return [K[kname].bind(m, P(table), P(ids), P(out), table.shape[0], d, err)]
        if op == Op.RMS_NORM:
            x, w = _want(s, 2, op)
            if len(x.shape) != 2:
                raise ValueError("RMS_NORM: x must be 2-D")
            n, d = x.shape
            _check(x, F32, (n, d), op)
            _check(w, F32, (d,), op)
            _check(out, F32, (n, d), op)
            if n == 0:
                return []
            return [K["rms_norm_f32"].bind(n, P(x), P(w), P(out), d, float(p[0]))]
        if op == Op.MUL_MAT:
            if len(s) not in (2, 3):
                raise ValueError("MUL_MAT: expected x, w and an optional bias")
            x, w = s[0], s[1]
            if len(x.shape) != 2 or len(w.shape) != 2:
                raise ValueError("MUL_MAT: x and w must be 2-D")
            n, k = x.shape
            m = w.shape[0]
            _check(x, F32, (n, k), op)
            if w.shape[1] != k:
                raise ValueError(f"MUL_MAT: x {x.shape} and w {w.shape} disagree")
            _check(out, F32, (n, m), op)
            if max(n, m, k) >= 1 << 31:
                raise ValueError("MUL_MAT: dimensions beyond 2**31")
            if n == 0 or m == 0:
                return []
            steps: list[Callable[[Any], None]] = []
            blas = self._blas
            if w.dtype in (F16, BF16):
                from .cublas import CUDA_R_16BF, CUDA_R_16F  # noqa: PLC0415
                ctype = CUDA_R_16F if w.dtype == F16 else CUDA_R_16BF
                conv = "convert_f32_f16" if w.dtype == F16 else "convert_f32_bf16"
                steps.append(K[conv].bind(_grid(n * k), P(x), scratch, n * k))
                args = blas.gemm_args(lane.blas, n, m, k, P(w), ctype, scratch, ctype, P(out))
            elif w.dtype == F32:
                from .cublas import CUDA_R_32F  # noqa: PLC0415
                args = blas.gemm_args(lane.blas, n, m, k, P(w), CUDA_R_32F, P(x), CUDA_R_32F, P(out))
            else:
                raise ValueError(f"MUL_MAT: weight {w.name} of type {w.dtype.name} (this device stores F16, BF16, F32)")
            gemm = blas.gemm
            steps.append(lambda stream: gemm(args))
            if k == 0:  # cuBLAS leaves C alone for k = 0; the product is zero
                steps = [lambda stream: self._drv.memset_d32_async(P(out), 0, n * m, stream)]
            if len(s) == 3:
                _check(s[2], F32, (m,), op)
                steps.append(K["add_bias_f32"].bind(_grid(n * m), P(out), P(s[2]), n, m))
            return steps
        if op == Op.ADD:
            a, b = _want(s, 2, op)
            for t in (a, b, out):
                _check(t, F32, a.shape, op)
            n = int(np.prod(a.shape, dtype=np.int64))
            return [K["add_f32"].bind(_grid(n), P(a), P(b), P(out), n)] if n else []
        if op == Op.SWIGLU:
            (gu,) = _want(s, 1, op)
            if len(out.shape) != 2:
                raise ValueError("SWIGLU: out must be 2-D")
            n, f = out.shape
            _check(gu, F32, (n, 2 * f), op)
            _check(out, F32, (n, f), op)
            return [K["swiglu_f32"].bind(_grid(n * f), P(gu), P(out), n, f)] if n * f else []
        if op == Op.ATTENTION:
            return self._bind_attention(nd, err)
        if op == Op.SAMPLE:
            return self._bind_sample(nd, scratch, err)
        raise ValueError(f"unknown op {op!r}")

    def _bind_attention(self, nd: Any, err: int) -> list[Callable[[Any], None]]:
        s, out, P = nd.srcs, nd.out, self._ptr
        # the extensions (rope_freqs source; softcap, n_swa, rope_mscale) have no CUDA kernel: a
        # model needing them is refused at load; unused they may still arrive from the wire
        a = AttentionParams.of(nd.params, len(s))
        if len(s) not in (7, 9) or len(nd.params) not in (9, 12) or a.extended:
            raise ValueError("ATTENTION: expected 7 or 9 sources and 9 parameters (soft-capping, a sliding "
                             "window and scaled RoPE do not run on CUDA)")
        qkv, kc, vc, pos, kv_idx, cells, ranges = s[:7]
        H, Hkv, hd, n_rot, mode = int(a.n_head), int(a.n_head_kv), int(a.head_dim), int(a.n_rot), int(a.rope_mode)
        freq_base, freq_scale, eps, scale = float(a.freq_base), float(a.freq_scale), float(a.norm_eps), float(a.scale)
        if H <= 0 or Hkv <= 0 or hd <= 0 or H % Hkv or n_rot < 0 or n_rot > hd or n_rot % 2:
            raise ValueError("attention: bad head parameters")
        if mode not in (0, 2):
            raise ValueError(f"attention: unknown rope mode {mode}")
        if hd > _MAX_HEAD_DIM:
            raise ValueError(f"attention: head_dim {hd} is above the {_MAX_HEAD_DIM} the CUDA kernel handles")
        if len(qkv.shape) != 2 or len(kc.shape) != 2:
            raise ValueError("attention: qkv and the caches must be 2-D")
        n, n_cells, n_listed = qkv.shape[0], kc.shape[0], cells.shape[0]
        _check(qkv, F32, (n, (H + 2 * Hkv) * hd), Op.ATTENTION)
        _check(out, F32, (n, H * hd), Op.ATTENTION)
        _check(kc, F32, (n_cells, Hkv * hd), Op.ATTENTION)
        _check(vc, F32, (n_cells, Hkv * hd), Op.ATTENTION)
        _check(pos, I32, (n,), Op.ATTENTION)
        _check(kv_idx, I32, (n,), Op.ATTENTION)
        _check(cells, I32, (n_listed,), Op.ATTENTION)
        _check(ranges, I32, (n, 2), Op.ATTENTION)
        qn = kn = 0
        if len(s) == 9:
            _check(s[7], F32, (hd,), Op.ATTENTION)
            _check(s[8], F32, (hd,), Op.ATTENTION)
            qn, kn = P(s[7]), P(s[8])
        if n == 0:
            return []
        K = self._kernels
        return [
            K["attn_store"].bind(n, P(qkv), P(kc), P(vc), P(pos), P(kv_idx), qn, kn, P(out), H, Hkv, hd, n_rot, mode,
                                 freq_base, freq_scale, eps, n_cells, err),
            K["attn_attend"].bind(n * H, P(kc), P(vc), P(cells), P(ranges), P(out), H, Hkv, hd, scale, n_cells,
                                  n_listed, err),
        ]

    def _bind_sample(self, nd: Any, scratch: int, err: int) -> list[Callable[[Any], None]]:
        s, out, P = nd.srcs, nd.out, self._ptr
        logits, inp = _want(s, 2, Op.SAMPLE)
        n_probs, window = int(nd.params[0]), int(nd.params[1])
        if not 0 <= n_probs <= 4096 or not 0 <= window <= 1 << 20:
            raise ValueError(f"SAMPLE: n_probs {n_probs} or window {window} out of range")
        if len(logits.shape) != 2:
            raise ValueError("SAMPLE: logits must be 2-D")
        rows, V = logits.shape
        _check(logits, F32, (rows, V), Op.SAMPLE)
        _check(inp, I32, (rows, sample_in_cols(window)), Op.SAMPLE)
        _check(out, I32, (rows, sample_out_cols(n_probs)), Op.SAMPLE)
        if not 1 <= V <= 0x7FFFFFFF:
            raise ValueError(f"SAMPLE: {V} logits per row")
        if rows == 0:
            return []
        buf_off, cnt_off, gath_off, _ = _sample_layout(rows, V, n_probs)
        memset, counts, n_counts = self._drv.memset_d32_async, scratch + cnt_off, rows * V
        return [
            lambda stream: memset(counts, 0, n_counts, stream),
            self._kernels["sample_rows"].bind(rows, P(logits), P(inp), P(out), scratch + buf_off, counts,
                                              scratch + gath_off, V, window, n_probs, err),
        ]

    # --- events --------------------------------------------------------------------------------
    def event_record(self, event: Event) -> None:
        self._record(None, event)

    def _record(self, stream: Optional["CUDAStream"], event: Event) -> None:
        with self._active():
            lane = self._lane(stream)
            if event.handle is None:
                event.handle = self._drv.Event(self._drv.event_flags.DISABLE_TIMING)
            event.handle.record(lane.stream)

    def event_wait(self, event: Event) -> None:
        self._wait(None, event)

    def _wait(self, stream: Optional["CUDAStream"], event: Event) -> None:
        if isinstance(event.stream.backend, CUDABackend):
            if event.handle is None:
                return  # never recorded: nothing to wait for
            with self._active():
                lane = self._lane(stream)
                self._begin(lane)
                lane.stream.wait_for_event(event.handle)  # the GPU waits, not the host
            return
        event.stream.event_synchronize(event)

    def event_synchronize(self, event: Event) -> None:
        if event.handle is not None:
            with self._active():
                event.handle.synchronize()

    # --- tracing -------------------------------------------------------------------------------
    def trace_mark(self) -> None:
        self._mark(None)

    def _mark(self, stream: Optional["CUDAStream"]) -> None:
        """Anchors the stream to the host clock now if it is idle (the next work then needs no
        anchor of its own)."""
        if not trace.enabled:
            return
        with self._active():
            self._begin(self._lane(stream))

    def trace_poll(self) -> list[dict[str, Any]]:
        """Emits the spans of completed graph computes of every stream (never waits)."""
        out: list[dict[str, Any]] = []
        with self._active():
            for lane in list(self._lanes):
                out.extend(self._poll(lane))
        return out

    def _poll(self, lane: _Lane) -> list[dict[str, Any]]:
        done: list[dict[str, Any]] = []
        with self._lock:
            while lane.spans:
                ev0, ev1, (anchor, anchor_us), n_nodes = lane.spans[0]
                if not ev1.query():
                    break
                lane.spans.pop(0)
                t0 = anchor_us + int(round(ev0.time_since(anchor) * 1000.0))
                t1 = anchor_us + int(round(ev1.time_since(anchor) * 1000.0))
                # anchors are placed within microseconds: keep spans of one stream in order
                t0 = max(t0, lane.last_t1)
                t1 = max(t1, t0)
                lane.last_t1 = t1
                rec = {"c": "dev", "n": f"compute {self.name}", "t0": t0, "t1": t1,
                       "tid": f"{self.name}.s{lane.index}", "n_nodes": n_nodes, "stream": lane.index}
                done.append(rec)
        if trace.enabled:
            for rec in done:
                trace.event("dev", rec["n"], rec["t0"], rec["t1"], tid=rec["tid"], n_nodes=rec["n_nodes"],
                            stream=rec["stream"])
        return done

    # --- information -----------------------------------------------------------------------------
    def device_info(self) -> DeviceInfo:
        with self._active():
            free, total = self._drv.mem_get_info()
        cc = self._dev.compute_capability()
        return DeviceInfo(self.name, "cuda", f"{self._dev.name()} (compute {cc[0]}.{cc[1]})", int(free), int(total))

    def supports(self, op: int) -> bool:
        return op in OP_KERNELS

    def close(self) -> None:
        if self._closed:
            return
        with self._active():
            with self._lock:
                lanes, self._lanes = self._lanes, []
            for lane in lanes:
                self._free_lane(lane)
            self._modules = []
            self._kernels = {}
        self._closed = True
        self._tls = threading.local()
        if self.allocated == 0:
            # buffers still alive free themselves later and need the context until then
            self._ctx.detach()


class CUDAStream(Stream):
    """A queue of work of its own on the device (`CUDABackend.new_stream`: a pipeline group's
    context computes on one): its lane is made on first use, so a context planned on paper holds
    nothing on the device, and given back by release()."""

    def __init__(self, backend: CUDABackend):
        self._backend = backend
        self.lane: Optional[_Lane] = None

    @property
    def backend(self) -> CUDABackend:
        return self._backend

    def set_tensor_async(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        self._backend._write(self, tensor, data, offset)

    def get_tensor_async(self, tensor: Tensor, out: np.ndarray) -> None:
        self._backend._read(self, tensor, out)

    def cpy_tensor_async(self, src: Tensor, dst: Tensor) -> bool:
        return self._backend._copy(self, src, dst)

    def cpy_tensor_from_async(self, src: Tensor, dst: Tensor) -> bool:
        return self._backend._copy_out(self, src, dst)

    def graph_compute(self, graph: Graph, reads: Sequence[tuple[Tensor, np.ndarray]] = ()) -> None:
        self._backend._compute(self, graph, reads)

    def synchronize(self) -> None:
        self._backend._sync(self.lane)

    def forget_graph(self, uid: int) -> None:
        lane = self.lane
        if lane is not None:
            with self._backend._lock:
                lane.plans.pop(uid, None)

    def event_record(self, event: Event) -> None:
        self._backend._record(self, event)

    def event_wait(self, event: Event) -> None:
        self._backend._wait(self, event)

    def event_synchronize(self, event: Event) -> None:
        self._backend.event_synchronize(event)

    def trace_mark(self) -> None:
        self._backend._mark(self)

    def trace_poll(self) -> list[dict[str, Any]]:
        return self._backend.trace_poll()

    def release(self) -> None:
        backend = self._backend
        with backend._lock:
            lane, self.lane = self.lane, None
            if lane is None or lane not in backend._lanes:  # never used, or the device closed
                return
            backend._lanes.remove(lane)
        with backend._active():
            backend._free_lane(lane)


# --- helpers --------------------------------------------------------------------------------------
def _want(srcs: Sequence[Tensor], n: int, op: Op) -> Sequence[Tensor]:
    if len(srcs) != n:
        raise ValueError(f"{op.name}: expected {n} sources, got {len(srcs)}")
    return srcs


def _check(t: Tensor, dtype: DType, shape: tuple[int, ...], op: Op) -> None:
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op.name}: {t.name} is {t.dtype.name}{list(t.shape)}, expected {dtype.name}{list(shape)}")


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _sample_layout(rows: int, V: int, n_probs: int) -> tuple[int, int, int, int]:
    """Scratch of SAMPLE: sanitized logits, penalty counts, gathered keys; offsets and total."""
    buf = 0
    cnt = _align(rows * V * 4)
    gath = cnt + _align(rows * V * 4)
    total = gath + _align(rows * max(n_probs, 1) * 8)
    return buf, cnt, gath, total


def _scratch_bytes(nd: Any) -> int:
    """Scratch a node needs on its stream (nodes run in order, so the largest is enough)."""
    if nd.op == Op.MUL_MAT and len(nd.srcs) >= 2 and nd.srcs[1].dtype in (F16, BF16) and len(nd.srcs[0].shape) == 2:
        return _align(nd.srcs[0].shape[0] * nd.srcs[0].shape[1] * 2)
    if nd.op == Op.SAMPLE and len(nd.srcs) == 2 and len(nd.srcs[0].shape) == 2 and nd.params:
        return _sample_layout(nd.srcs[0].shape[0], nd.srcs[0].shape[1], max(0, int(nd.params[0])))[3]
    return 0


def _warn_if_stale(kdir: Path) -> None:
    """In a source checkout, says when the fatbins were built from other sources than cuda_src/."""
    if not SOURCE_DIR.is_dir() or current_settings().cuda.kernels:
        return
    manifest = kdir / cuda_build.MANIFEST
    try:
        built = manifest.read_text().strip()
    except OSError:
        built = ""
    if built != cuda_build.sources_digest(SOURCE_DIR):
        log.warning("the CUDA kernels in %s were built from other sources than %s: rebuild them "
                    "(pip install -e '.[cuda]')", kdir, SOURCE_DIR)


__all__ = ["CUDABackend", "CUDABuffer", "CUDAStream", "CUDAUnavailable", "DEQUANT_KERNELS", "MODULES", "OP_KERNELS",
           "device_count", "kernel_dir", "open_backend"]
