"""A stand-in for PyCUDA and cuBLAS, so that the CUDA backend's host side (lanes, plans, argument
packing, staging, reads, events, trace anchors, load-time conversion, the rpc server's use of it)
runs in CI without a GPU.

Device memory is host memory at fake addresses; a stream queues its work and runs it when
something waits for it (synchronize, an event, a pageable read), as the asynchronous semantics of
the real driver allow, so work read before it was waited for shows up as wrong results. Kernels
unpack the argument buffer the backend packed and compute with numpy and the CPU backend's
kernels: this checks the host side against the CPU, not the CUDA code (tests marked needs_gpu do).
"""
from __future__ import annotations

import bisect
import struct
import sys
import threading
import types
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES

from pyllama._fast import ops as cpu_ops
from pyllama._fast import sampling as cpu_sampling
from pyllama._fast.quant import dequantize_to_f32
from pyllama.backend.base import DType
from pyllama.util import settings


class Error(Exception):
    pass


class LogicError(Error):
    pass


class MemoryError_(Error):
    pass


class event_flags:  # noqa: N801 - PyCUDA's name
    DEFAULT = 0
    DISABLE_TIMING = 2


class _Memory:
    def __init__(self) -> None:
        self.bases: list[int] = []
        self.arrays: dict[int, np.ndarray] = {}
        self.next = 1 << 20

    def resolve(self, ptr: int, n: int) -> np.ndarray:
        ptr = int(ptr)
        i = bisect.bisect_right(self.bases, ptr) - 1
        if i < 0:
            raise LogicError(f"invalid device pointer {ptr:#x}")
        base = self.bases[i]
        arr = self.arrays[base]
        off = ptr - base
        if off < 0 or off + n > arr.size:
            raise LogicError(f"access of {n} B at {ptr:#x} outside its allocation of {arr.size} B")
        return arr[off:off + n]

    def view(self, ptr: int, dtype, count: int) -> np.ndarray:
        dt = np.dtype(dtype)
        return self.resolve(ptr, count * dt.itemsize).view(dt)


MEM = _Memory()
STREAMS: list["Stream"] = []
PINNED: list[np.ndarray] = []
CLOCK = [0.0]
_TLS = threading.local()
# the device runs one piece of work at a time, in each stream's order, whichever thread waits for it
EXEC = threading.RLock()


def _stack() -> list:
    if not hasattr(_TLS, "stack"):
        _TLS.stack = []
    return _TLS.stack


def _current() -> None:
    if not _stack():
        raise LogicError("no current context on this thread")


class DeviceAllocation:
    def __init__(self, n: int):
        self.base = MEM.next
        MEM.next += -(-n // 4096) * 4096 + 4096
        MEM.arrays[self.base] = np.full(n, 0xAB, np.uint8)  # garbage, like fresh device memory
        bisect.insort(MEM.bases, self.base)

    def __int__(self) -> int:
        return self.base

    __index__ = __int__

    def free(self) -> None:
        if self.base in MEM.arrays:
            del MEM.arrays[self.base]
            MEM.bases.remove(self.base)


class Stream:
    def __init__(self, flags: int = 0):
        self.handle = 0x5000 + len(STREAMS)
        self.q: list = []
        STREAMS.append(self)

    def enqueue(self, fn) -> None:
        _current()
        self.q.append(fn)

    def run_until(self, marker=None) -> None:
        with EXEC:
            while self.q:
                fn = self.q.pop(0)
                CLOCK[0] += 1.0
                fn()
                if fn is marker:
                    return

    def synchronize(self) -> None:
        _current()
        self.run_until()

    def wait_for_event(self, ev: "Event") -> None:
        self.enqueue(lambda: ev.synchronize())


class Event:
    def __init__(self, flags: int = 0):
        self.flags, self.t, self.done, self.stream, self.marker = flags, 0.0, False, None, None

    def record(self, stream: Stream) -> None:
        self.done, self.stream = False, stream

        def mark() -> None:
            self.done, self.t = True, CLOCK[0]
        self.marker = mark
        stream.enqueue(mark)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if not self.done and self.stream is not None:
            self.stream.run_until(self.marker)

    def time_since(self, other: "Event") -> float:
        if self.flags or other.flags or not (self.done and other.done):
            raise LogicError("time_since needs two completed timing events")
        return (self.t - other.t) * 0.01


class Context:
    def push(self) -> None:
        _stack().append(self)

    @staticmethod
    def pop() -> None:
        _stack().pop()

    @staticmethod
    def synchronize() -> None:
        for s in STREAMS:
            s.run_until()

    def detach(self) -> None:
        pass


class Device:
    def __init__(self, index: int):
        self.index = index

    @staticmethod
    def count() -> int:
        return 1

    def name(self) -> str:
        return "fake GPU"

    def compute_capability(self) -> tuple[int, int]:
        return (9, 0)

    def retain_primary_context(self) -> Context:
        return Context()


def init() -> None:
    pass


def mem_alloc(n: int) -> DeviceAllocation:
    return DeviceAllocation(n)


def mem_get_info() -> tuple[int, int]:
    return 64 << 30, 80 << 30


def pagelocked_empty(shape, dtype) -> np.ndarray:
    a = np.empty(shape, dtype)
    PINNED.append(a)
    return a


def _host_bytes(obj) -> np.ndarray:
    return np.frombuffer(memoryview(obj).cast("B"), np.uint8)


def _pinned(obj) -> bool:
    p = _host_bytes(obj).ctypes.data
    return any(a.ctypes.data <= p < a.ctypes.data + a.nbytes for a in PINNED)


def memcpy_htod_async(dst, src, stream: Stream) -> None:
    b = _host_bytes(src)
    if not _pinned(src):
        b = b.copy()  # the driver stages pageable memory before returning
    stream.enqueue(lambda: MEM.resolve(dst, b.size).__setitem__(slice(None), b))


def memcpy_dtoh_async(dst, src, stream: Stream) -> None:
    d = _host_bytes(dst)

    def op() -> None:
        d[:] = MEM.resolve(src, d.size)
    stream.enqueue(op)
    if not _pinned(dst):
        stream.run_until(op)  # pageable: the call returns once the copy is done


def memcpy_dtod_async(dst, src, n: int, stream: Stream) -> None:
    stream.enqueue(lambda: MEM.resolve(dst, n).__setitem__(slice(None), MEM.resolve(src, n).copy()))


def memset_d8_async(ptr, value: int, count: int, stream: Stream) -> None:
    stream.enqueue(lambda: MEM.resolve(ptr, count).__setitem__(slice(None), value))


def memset_d32_async(ptr, value: int, count: int, stream: Stream) -> None:
    stream.enqueue(lambda: MEM.view(ptr, np.uint32, count).__setitem__(slice(None), value))


class Function:
    def __init__(self, name: str):
        self.name = name

    def _launch_kernel(self, grid, block, buf, shared, stream: Stream) -> None:
        from pyllama.backend.cuda.backend import _BLOCK, _FORMATS  # noqa: PLC0415
        assert tuple(block) == (_BLOCK.get(self.name, 256), 1, 1)
        args = struct.unpack("@" + _FORMATS[self.name], buf)
        name = self.name
        stream.enqueue(lambda: _KERNELS[name.split("_")[0] if name.startswith("dequant") else name](
            name, int(grid[0]), args))


class Module:
    def __init__(self, path: str):
        self.path = path

    def get_function(self, name: str) -> Function:
        from pyllama.backend.cuda.backend import _FORMATS  # noqa: PLC0415
        if name not in _FORMATS:
            raise LogicError(f"named symbol not found: {name}")
        return Function(name)


def module_from_file(path: str) -> Module:
    return Module(path)


# --- kernels ----------------------------------------------------------------------------------------
def _bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    b = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def _flag(err: int, bit: int) -> None:
    MEM.view(err, np.uint32, 1)[0] |= bit


def _get_rows(name: str, grid: int, a: tuple) -> None:
    table, ids, out, n_rows, d, err = a
    t = {"get_rows_f32": lambda: MEM.view(table, np.float32, n_rows * d),
         "get_rows_f16": lambda: MEM.view(table, np.float16, n_rows * d).astype(np.float32),
         "get_rows_bf16": lambda: _bf16_to_f32(MEM.view(table, np.uint16, n_rows * d))}[name]().reshape(n_rows, d)
    o = MEM.view(out, np.float32, grid * d).reshape(grid, d)
    for i, r in enumerate(MEM.view(ids, np.int32, grid)):
        if 0 <= r < n_rows:
            o[i] = t[r]
        else:
            o[i] = 0
            _flag(err, 1)


def _rms_norm(name: str, grid: int, a: tuple) -> None:
    x, w, out, d, eps = a
    cpu_ops.rms_norm(MEM.view(x, np.float32, grid * d).reshape(grid, d), MEM.view(w, np.float32, d),
                     MEM.view(out, np.float32, grid * d).reshape(grid, d), eps, 1)


def _swiglu(name: str, grid: int, a: tuple) -> None:
    gu, out, n, f = a
    cpu_ops.swiglu(MEM.view(gu, np.float32, n * 2 * f).reshape(n, 2 * f), MEM.view(out, np.float32, n * f).reshape(n, f), 1)


def _add(name: str, grid: int, a: tuple) -> None:
    x, y, out, n = a
    MEM.view(out, np.float32, n)[:] = MEM.view(x, np.float32, n) + MEM.view(y, np.float32, n)


def _add_bias(name: str, grid: int, a: tuple) -> None:
    out, bias, n, m = a
    MEM.view(out, np.float32, n * m).reshape(n, m)[:] += MEM.view(bias, np.float32, m)


def _convert(name: str, grid: int, a: tuple) -> None:
    x, y, n = a
    if name.endswith("bf16"):
        MEM.view(y, np.uint16, n)[:] = _f32_to_bf16(MEM.view(x, np.float32, n))
    else:
        MEM.view(y, np.float16, n)[:] = MEM.view(x, np.float32, n).astype(np.float16)


_SRC = {"q8_0": DType.Q8_0, "q4_0": DType.Q4_0, "q4_k": DType.Q4_K, "q5_k": DType.Q5_K, "q6_k": DType.Q6_K,
        "bf16": DType.BF16, "f16": DType.F16, "f32": DType.F32}


def _dequant(name: str, grid: int, a: tuple) -> None:
    src, dst, n = a
    s, d = name[len("dequant_"):].rsplit("_", 1)
    qt = _SRC[s]
    block, size = GGML_QUANT_SIZES[qt]
    vals = dequantize_to_f32(MEM.resolve(src, n // block * size).copy(), int(qt), (n,))
    if d == "f16":
        MEM.view(dst, np.float16, n)[:] = vals.astype(np.float16)
    else:
        MEM.view(dst, np.uint16, n)[:] = _f32_to_bf16(vals)


_ATTN_STORE: dict[int, tuple] = {}


def _attn_store(name: str, grid: int, a: tuple) -> None:
    # the CPU kernel does the store and the attention in one call: keep the arguments for attn_attend
    _ATTN_STORE[a[7]] = (grid, a)


def _attn_attend(name: str, grid: int, a: tuple) -> None:
    kc, vc, cells, ranges, out, H, Hkv, hd, scale, n_cells, n_listed, err = a
    n, s = _ATTN_STORE.pop(out)
    qkv, _, _, pos, kv_idx, qn, kn, _, H, Hkv, hd, n_rot, mode, fb, fs, eps, _, _ = s
    empty = np.zeros(0, np.float32)
    cpu_ops.attention(MEM.view(qkv, np.float32, n * (H + 2 * Hkv) * hd).reshape(n, -1),
                      MEM.view(kc, np.float32, n_cells * Hkv * hd).reshape(n_cells, -1),
                      MEM.view(vc, np.float32, n_cells * Hkv * hd).reshape(n_cells, -1),
                      MEM.view(pos, np.int32, n), MEM.view(kv_idx, np.int32, n), MEM.view(cells, np.int32, n_listed),
                      MEM.view(ranges, np.int32, 2 * n).reshape(n, 2),
                      MEM.view(qn, np.float32, hd) if qn else empty, MEM.view(kn, np.float32, hd) if kn else empty,
                      MEM.view(out, np.float32, n * H * hd).reshape(n, -1), H, Hkv, hd, n_rot, mode, fb, fs, eps, scale, 1)


def _sample(name: str, grid: int, a: tuple) -> None:
    logits, inp, out, sbuf, scounts, sgath, V, L, N, err = a
    rows = grid
    assert not MEM.view(scounts, np.int32, rows * V).any(), "penalty counts not zeroed before the launch"
    MEM.view(sbuf, np.float32, rows * V)[:] = 0  # the scratch must lie inside the lane's allocation
    MEM.view(sgath, np.uint64, rows * max(N, 1))[:] = 0
    packed = MEM.view(inp, np.int32, rows * (12 + L)).reshape(rows, 12 + L)
    o = MEM.view(out, np.int32, rows * (2 + 2 * N)).reshape(rows, 2 + 2 * N)
    ids, prob = np.zeros(rows, np.int32), np.zeros(rows, np.float32)
    top_ids, top_probs = np.zeros((rows, N), np.int32), np.zeros((rows, N), np.float32)
    cpu_sampling.sample_rows(MEM.view(logits, np.float32, rows * V).reshape(rows, V),
                             np.ascontiguousarray(packed[:, :8]).view(np.float32), np.ascontiguousarray(packed[:, 8:12]),
                             np.ascontiguousarray(packed[:, 12:]), ids, prob, top_ids, top_probs, 1)
    o[:, 0], o[:, 1] = ids, prob.view(np.int32)
    o[:, 2:2 + N], o[:, 2 + N:] = top_ids, top_probs.view(np.int32)


_KERNELS = {"get_rows_f32": _get_rows, "get_rows_f16": _get_rows, "get_rows_bf16": _get_rows,
            "rms_norm_f32": _rms_norm, "swiglu_f32": _swiglu, "add_f32": _add, "add_bias_f32": _add_bias,
            "convert_f32_f16": _convert, "convert_f32_bf16": _convert, "dequant": _dequant,
            "attn_store": _attn_store, "attn_attend": _attn_attend, "sample_rows": _sample}


class FakeCuBLAS:
    """cublasGemmEx on a fake stream, checking the arguments the backend passes."""

    def __init__(self, lib=None):
        from pyllama.backend.cuda import cublas  # noqa: PLC0415
        self._real = cublas
        self.p_one = self.p_zero = None

    def create(self, stream_handle: int) -> Stream:
        return next(s for s in STREAMS if s.handle == stream_handle)

    def destroy(self, handle) -> None:
        pass

    def gemm_args(self, handle, n, m, k, w, w_type, x, x_type, out) -> tuple:
        return self._real._RealCuBLAS.gemm_args(self, handle, n, m, k, w, w_type, x, x_type, out)

    def gemm(self, args: tuple) -> None:
        args[0].enqueue(lambda: self._gemm(args))

    def _gemm(self, args: tuple) -> None:
        c = self._real
        _, ta, tb, m, n, k, _, A, at, lda, B, bt, ldb, _, C, ct, ldc, comp, _ = args
        assert (ta, tb, lda, ldb, ldc, ct, comp, at) == (c.CUBLAS_OP_T, c.CUBLAS_OP_N, k, k, m, c.CUDA_R_32F,
                                                          c.CUBLAS_COMPUTE_32F, bt)

        def mat(ptr: int, t: int, rows: int) -> np.ndarray:
            if t == c.CUDA_R_32F:
                v = MEM.view(ptr, np.float32, rows * k)
            elif t == c.CUDA_R_16F:
                v = MEM.view(ptr, np.float16, rows * k)
            else:
                v = _bf16_to_f32(MEM.view(ptr, np.uint16, rows * k))
            return v.reshape(rows, k).astype(np.float64)
        MEM.view(C, np.float32, n * m)[:] = (mat(B, bt, n) @ mat(A, at, m).T).astype(np.float32).reshape(-1)


def install(monkeypatch, kernel_dir: Path) -> None:
    """Makes `import pycuda.driver` give this module's fake and cuBLAS the fake GEMM, with
    placeholder fatbins in `kernel_dir`, for the duration of a test."""
    from pyllama.backend.cuda import cublas  # noqa: PLC0415
    from pyllama.backend.cuda import backend as cuda  # noqa: PLC0415
    driver = types.ModuleType("pycuda.driver")
    for name in ("Error", "LogicError", "event_flags", "DeviceAllocation", "Stream", "Event", "Context", "Device",
                 "init", "mem_alloc", "mem_get_info", "pagelocked_empty", "memcpy_htod_async", "memcpy_dtoh_async",
                 "memcpy_dtod_async", "memset_d8_async", "memset_d32_async", "module_from_file"):
        setattr(driver, name, globals()[name])
    driver.MemoryError = MemoryError_
    package = types.ModuleType("pycuda")
    package.driver = driver
    monkeypatch.setitem(sys.modules, "pycuda", package)
    monkeypatch.setitem(sys.modules, "pycuda.driver", driver)
    monkeypatch.setattr(cublas, "_RealCuBLAS", getattr(cublas, "_RealCuBLAS", cublas.CuBLAS), raising=False)
    monkeypatch.setattr(cublas, "CuBLAS", FakeCuBLAS)
    kernel_dir.mkdir(parents=True, exist_ok=True)
    for m in cuda.MODULES:
        (kernel_dir / f"{m}.fatbin").write_bytes(b"fake")
    monkeypatch.setenv("PYLLAMA_CUDA_KERNELS", str(kernel_dir))
    settings.load()  # as a program starting in this environment (tests/conftest.py restores them)
