"""The CUDA backend.

Everywhere: every cuda_src/*.cu compiles for sm_90 without warnings (skipped without nvcc), the
op table covers every Op with kernels that exist and take the arguments the backend packs,
`--device CUDA0` on a machine that cannot run it is one clear line, the backend's host side runs
on a fake device (tests/fake_cuda.py), and the kernels' own source runs on the CPU
(tests/cuda_host/, skipped without g++ and the CUDA headers). On a GPU (skipped otherwise, with
the reason): each op against the CPU backend, the load-time dequantization bit for bit, greedy
text of `generate --device CUDA0` and of an `rpc_server --device CUDA0` split against the CPU,
and the GPU trace spans. `bench/gpu_check.sh` runs this file on a GPU machine.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pyllama.backend.cuda import build as cuda_build
from pyllama.backend.base import DType, Tensor
from pyllama.backend.cpu import CPUBackend
from pyllama.util.errors import PyllamaError
from pyllama.models.build.ops import Graph, Op, node, sample_out_cols

ROOT = Path(__file__).resolve().parents[1]
CUDA_SRC = ROOT / "cuda_src"
NVCC = cuda_build.find_nvcc()
F32, F16, BF16, I32 = DType.F32, DType.F16, DType.BF16, DType.I32


def _gpu_unavailable() -> str | None:
    """Why `--device CUDA0` cannot run here (the very message the programs print), or None."""
    try:
        from pyllama.backend.cuda import open_backend  # noqa: PLC0415
        open_backend("CUDA0").close()
    except PyllamaError as exc:
        return str(exc)
    return None


GPU_REASON = _gpu_unavailable()
needs_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=f"needs a CUDA GPU: {GPU_REASON}")
without_gpu = pytest.mark.skipif(GPU_REASON is None, reason="a usable CUDA GPU is present")


# --- (a) compile check -------------------------------------------------------------------------
@pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA toolkit not installed)")
def test_every_kernel_file_compiles_for_sm90_without_warnings(tmp_path):
    files = cuda_build.sources(CUDA_SRC)
    assert files, "cuda_src/ holds no .cu file"
    results = cuda_build.compile_all(CUDA_SRC, tmp_path, strict=True)
    failed = {name: out for name, (rc, out) in results.items() if rc != 0}
    assert not failed, "\n\n".join(f"{name}:\n{out}" for name, out in failed.items())
    noisy = {name: out for name, (rc, out) in results.items() if out}
    assert not noisy, f"nvcc printed diagnostics: {noisy}"
    names = _declared_kernels()
    for src in files:
        data = (tmp_path / f"{src.stem}.fatbin").read_bytes()
        assert data
        # extern "C": every kernel under its plain name (visible unless nvcc compressed the fatbin)
        mine = [n for n, (f, _) in names.items() if f == src.name]
        if any(n.encode() in data for n in mine):
            assert all(n.encode() + b"\0" in data for n in mine), (src.name, mine)
    real_nvcc = Path(NVCC).resolve().parent
    cuobjdump = shutil.which("cuobjdump") or next(
        (str(d / "cuobjdump") for d in (Path(NVCC).parent, real_nvcc) if (d / "cuobjdump").exists()), None)
    if cuobjdump is None:
        return
    # the fatbins carry sm_90 machine code and compute_90 PTX, and export every kernel unmangled
    for src in files:
        fatbin = str(tmp_path / f"{src.stem}.fatbin")
        elf = subprocess.run([cuobjdump, "--list-elf", fatbin], capture_output=True, text=True, check=True).stdout
        ptx = subprocess.run([cuobjdump, "--list-ptx", fatbin], capture_output=True, text=True, check=True).stdout
        assert "sm_90" in elf and "sm_90" in ptx, (src.name, elf, ptx)
        syms = subprocess.run([cuobjdump, "--dump-elf-symbols", fatbin], capture_output=True, text=True,
                              check=True).stdout
        for name, (fname, _) in names.items():
            if fname == src.name:
                assert re.search(rf"\b{name}\b", syms), f"{name} not exported by {src.name}"


# --- (c) static consistency ----------------------------------------------------------------------
_CTYPES = [("long long", "q"), ("double", "d"), ("float", "f"), ("int", "i")]


def _declared_kernels() -> dict[str, tuple[str, str]]:
    """Kernel name -> (file, argument format) of every extern "C" kernel in cuda_src, including
    the ones the dequant macro stamps out."""
    out: dict[str, tuple[str, str]] = {}
    decl = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)',
                      re.S)
    for f in sorted(CUDA_SRC.glob("*.cu")):
        text = f.read_text()
        for name, params in decl.findall(text):
            if "##" in name or "##" in params:
                continue
            fmt = ""
            for param in (p.strip() for p in params.split(",") if p.strip()):
                if "*" in param:
                    fmt += "P"
                else:
                    fmt += next(c for t, c in _CTYPES if re.match(rf"(const\s+)?{t}\b", param))
            out[name] = (f.name, fmt)
        macro = re.search(r"#define\s+PYL_DEQUANT\(SRC, DST, DST_T\)", text)
        if macro:
            for src, dst in re.findall(r"^PYL_DEQUANT\((\w+),\s*(\w+),", text, re.M):
                out[f"dequant_{src}_{dst}"] = (f.name, "PPq")
    return out


def test_every_op_has_cuda_kernels_that_exist_with_the_packed_arguments():
    from pyllama.backend.cuda import backend as cuda  # noqa: PLC0415 - importable without PyCUDA
    # MUL_MAT_CAT arises only on devices that store a fused weight's parts in different types;
    # this one stores every matrix in one half type (and says so through supports())
    # the gemma ops GEGLU, SCALE and SOFTCAP have none: a model needing them is refused at load
    # (weights.check_placement asks supports_node about each node of the model's graph); so is a
    # deepseek2 model, whose MLA_ATTENTION has no CUDA kernel yet, an encoder (LAYER_NORM, GELU) and
    # a layer with LoRA adapters (LORA)
    assert set(cuda.OP_KERNELS) == set(Op) - {Op.MUL_MAT_CAT, Op.GEGLU, Op.SCALE, Op.SOFTCAP, Op.MOE_FFN,
                                              Op.MLA_ATTENTION, Op.LAYER_NORM, Op.GELU, Op.LORA}, \
        "ops without a CUDA implementation"
    declared = _declared_kernels()
    used = {k for names in cuda.OP_KERNELS.values() for k in names} | set(cuda.DEQUANT_KERNELS.values())
    assert used <= set(cuda._FORMATS), sorted(used - set(cuda._FORMATS))
    for name, fmt in cuda._FORMATS.items():
        assert name in declared, f"{name} is not a kernel of cuda_src/"
        assert declared[name][1] == fmt, f"{name}: the backend packs {fmt}, the kernel takes {declared[name][1]}"
    # the weight types converted on the device convert to both half types (the others are converted
    # on the host by WeightLayout.set_weight, tested in test_quant_models.py)
    for qt in (DType.Q8_0, DType.Q4_0, DType.Q4_K, DType.Q5_K, DType.Q6_K, F32, F16, BF16):
        for half in (F16, BF16):
            assert qt == half or (DType(qt), half) in cuda.DEQUANT_KERNELS, (qt, half)
    # every module the backend loads has a source
    assert {f.stem for f in CUDA_SRC.glob("*.cu")} == set(cuda.MODULES)
    # kernels that stride by a compile-time block size are launched with that block size
    sampling = (CUDA_SRC / "sampling.cu").read_text()
    attention = (CUDA_SRC / "attention.cu").read_text()
    assert int(re.search(r"#define ST (\d+)", sampling).group(1)) == cuda._BLOCK["sample_rows"]
    assert int(re.search(r"#define ATT_WARPS (\d+)", attention).group(1)) * 32 == cuda._BLOCK["attn_attend"]
    assert int(re.search(r"#define ATT_MAXD (\d+)", attention).group(1)) * 32 == cuda._MAX_HEAD_DIM


def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")], check=True)


# --- (b) a clear error where CUDA cannot run -------------------------------------------------------
def _run(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _one_clear_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "CUDA0" in lines[0]
    return lines[0]


@without_gpu
def test_make_backends_cuda_without_gpu_raises_the_reason():
    from pyllama.runtime.placement.devices import make_backends  # noqa: PLC0415
    with pytest.raises(PyllamaError) as err:
        make_backends("CUDA0", None, "layer", 1)
    assert str(err.value) == GPU_REASON and GPU_REASON.startswith("--device CUDA0: ")


@without_gpu
def test_generate_device_cuda0_without_gpu_is_one_clear_line(tiny_model):
    line = _one_clear_line(_run("pyllama.generate", "-m", tiny_model, "-p", "hi", "-n", "1", "--device", "CUDA0"))
    assert line == f"error: {GPU_REASON}"


@without_gpu
def test_server_device_cuda0_without_gpu_is_one_clear_error(tiny_model):
    # the server logs its listening and shutting-down lines around it (it binds before loading)
    proc = _run("pyllama.server", "-m", tiny_model, "--port", "0", "--device", "CUDA0")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"error: {GPU_REASON}"], proc.stderr


@without_gpu
def test_rpc_server_device_cuda0_without_gpu_is_one_clear_line():
    line = _one_clear_line(_run("pyllama.rpc_server", "--port", "0", "--device", "CUDA0"))
    assert line == f"error: {GPU_REASON}"


# --- (d) on a GPU --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu():
    from pyllama.backend.cuda import CUDABackend  # noqa: PLC0415
    b = CUDABackend(0)
    yield b
    b.close()


def _bf16_exact(x: np.ndarray) -> np.ndarray:
    """float32 values that bf16 holds exactly (low 16 bits cleared), and their bf16 bytes."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


def _bf16_bytes(x: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _run_node(backend, op: Op, inputs: list[tuple[DType, np.ndarray]], out_dtype: DType,
              out_shape: tuple[int, ...], params: tuple = ()) -> tuple[np.ndarray, list[np.ndarray]]:
    """Runs one node on `backend`; returns its output and every input as it is afterwards (the
    ATTENTION node writes its KV cache). Inputs are (dtype on that device, host data)."""
    tensors = []
    bufs = []
    for i, (dtype, data) in enumerate(inputs):
        t = Tensor(dtype, data.shape, f"in{i}")
        buf = backend.alloc_buffer(max(t.nbytes, 1), usage="compute")
        bufs.append(buf)
        t.buffer, t.offset = buf, 0
        backend.set_tensor(t, data)
        tensors.append(t)
    out = Tensor(out_dtype, out_shape, "out")
    out.buffer = backend.alloc_buffer(max(out.nbytes, 1), usage="compute")
    bufs.append(out.buffer)
    backend.graph_compute(Graph([node(op, out, *tensors, params=params)]))
    backend.synchronize()
    result = backend.get_tensor(out)
    after = [backend.get_tensor(t) for t in tensors]
    for buf in bufs:
        backend.free_buffer(buf)
    return result, after


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@needs_gpu
@pytest.mark.parametrize("table_type", [F32, F16, BF16])
def test_get_rows_matches_cpu(gpu, table_type):
    rng = np.random.default_rng(1)
    table = _bf16_exact(rng.standard_normal((50, 96)).astype(np.float32))
    ids = np.array([3, 0, 49, 3, 17], np.int32)
    dev_table = {F32: table, F16: table.astype(np.float16), BF16: _bf16_bytes(table)}[table_type]
    want, _ = _run_node(CPUBackend(1), Op.GET_ROWS, [(F32, table.astype(np.float16).astype(np.float32)
                                                      if table_type == F16 else table), (I32, ids)], F32, (5, 96))
    got, _ = _run_node(gpu, Op.GET_ROWS, [(table_type, dev_table), (I32, ids)], F32, (5, 96))
    np.testing.assert_array_equal(got, want)


@needs_gpu
def test_rms_norm_add_swiglu_match_cpu(gpu):
    rng = np.random.default_rng(2)
    cpu = CPUBackend(1)
    x = rng.standard_normal((7, 300)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(300)).astype(np.float32)
    args = ([(F32, x), (F32, w)], F32, (7, 300), (1e-5,))
    assert _rel(_run_node(gpu, Op.RMS_NORM, *args)[0], _run_node(cpu, Op.RMS_NORM, *args)[0]) < 1e-5
    y = rng.standard_normal((7, 300)).astype(np.float32)
    args = ([(F32, x), (F32, y)], F32, (7, 300))
    np.testing.assert_array_equal(_run_node(gpu, Op.ADD, *args)[0], _run_node(cpu, Op.ADD, *args)[0])
    gu = (3 * rng.standard_normal((7, 600))).astype(np.float32)
    args = ([(F32, gu)], F32, (7, 300))
    assert _rel(_run_node(gpu, Op.SWIGLU, *args)[0], _run_node(cpu, Op.SWIGLU, *args)[0]) < 1e-5


@needs_gpu
@pytest.mark.parametrize("w_type,tol", [(F16, 1e-3), (BF16, 5e-3), (F32, 1e-5)])
@pytest.mark.parametrize("n", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_mul_mat_matches_cpu(gpu, w_type, tol, n, bias):
    # bf16 keeps 8 significant bits: rounding the activation alone is ~1e-3 relative, hence its bound
    rng = np.random.default_rng(3 + n)
    k, m = 256, 384
    x = rng.standard_normal((n, k)).astype(np.float32)
    w = (rng.standard_normal((m, k)) / 16).astype(np.float32)
    dev_w = {F16: w.astype(np.float16), BF16: _bf16_bytes(w), F32: w}[w_type]
    cpu_w = {F16: w.astype(np.float16).astype(np.float32), BF16: _bf16_exact(w), F32: w}[w_type]
    srcs_cpu, srcs_gpu = [(F32, x), (F32, cpu_w)], [(F32, x), (w_type, dev_w)]
    if bias:
        b = rng.standard_normal(m).astype(np.float32)
        srcs_cpu.append((F32, b))
        srcs_gpu.append((F32, b))
    want, _ = _run_node(CPUBackend(1), Op.MUL_MAT, srcs_cpu, F32, (n, m))
    got, _ = _run_node(gpu, Op.MUL_MAT, srcs_gpu, F32, (n, m))
    assert _rel(got, want) < tol


@needs_gpu
@pytest.mark.parametrize("rope_mode", [0, 2])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("hd", [64, 128])
def test_attention_matches_cpu(gpu, rope_mode, qk_norm, hd):
    rng = np.random.default_rng(4)
    H, Hkv, n, cells = 4, 2, 5, 32
    qkv = rng.standard_normal((n, (H + 2 * Hkv) * hd)).astype(np.float32)
    kc = rng.standard_normal((cells, Hkv * hd)).astype(np.float32)
    vc = rng.standard_normal((cells, Hkv * hd)).astype(np.float32)
    pos = np.array([7, 8, 9, 0, 1], np.int32)
    kv_idx = np.array([10, 11, 12, 20, 21], np.int32)
    # tokens 0-2 (one sequence) see cells 3..9 and themselves causally; tokens 3-4 another sequence
    listed = np.array([3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 20, 21], np.int32)
    ranges = np.array([[0, 8], [0, 9], [0, 10], [10, 1], [10, 2]], np.int32)
    srcs = [(F32, qkv), (F32, kc), (F32, vc), (I32, pos), (I32, kv_idx), (I32, listed), (I32, ranges)]
    if qk_norm:
        srcs += [(F32, (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)),
                 (F32, (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32))]
    params = (H, Hkv, hd, hd if rope_mode == 2 else hd // 2, rope_mode, 10000.0, 1.0, 1e-6, 1.0 / np.sqrt(hd))
    want, want_after = _run_node(CPUBackend(1), Op.ATTENTION, srcs, F32, (n, H * hd), params)
    got, got_after = _run_node(gpu, Op.ATTENTION, srcs, F32, (n, H * hd), params)
    assert _rel(got, want) < 1e-4
    assert _rel(got_after[1], want_after[1]) < 1e-5  # the K cache with the rotated keys written
    np.testing.assert_array_equal(got_after[2], want_after[2])  # the V cache


@needs_gpu
@pytest.mark.parametrize("qtype", [DType.Q8_0, DType.Q4_0, DType.Q4_K, DType.Q5_K, DType.Q6_K, DType.BF16,
                                   DType.F16, DType.F32])
@pytest.mark.parametrize("half", [F16, BF16])
def test_load_time_dequantization_is_exact(gpu, qtype, half):
    """Random blocks (valid f16 scales): the device's half weights equal the CPU's float32
    dequantization rounded to nearest even, bit for bit."""
    from gguf import GGML_QUANT_SIZES  # noqa: PLC0415
    from pyllama._fast.quant import dequantize_to_f32  # noqa: PLC0415
    from pyllama.backend.cuda import DEQUANT_KERNELS  # noqa: PLC0415
    if (qtype, half) not in DEQUANT_KERNELS:
        pytest.skip("stored as is")
    rng = np.random.default_rng(5)
    block, size = GGML_QUANT_SIZES[qtype]
    rows, n_blocks = 8, 1024 // block
    raw = rng.integers(0, 256, (rows * n_blocks, size), dtype=np.uint8)
    scales = {DType.Q8_0: [0], DType.Q4_0: [0], DType.Q4_K: [0, 2], DType.Q5_K: [0, 2], DType.Q6_K: [208]}
    for off in scales.get(qtype, []):
        raw[:, off:off + 2] = (rng.standard_normal(len(raw)) / 64).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qtype in (DType.F16, DType.BF16, DType.F32):
        vals = rng.standard_normal(rows * 1024).astype(np.float32)
        raw = {DType.F16: vals.astype(np.float16).view(np.uint8), DType.BF16: _bf16_bytes(vals).view(np.uint8),
               DType.F32: vals.view(np.uint8)}[qtype]
    raw = np.ascontiguousarray(raw).reshape(-1)
    ref = dequantize_to_f32(raw, int(qtype), (rows, 1024))
    t = Tensor(half, (rows, 1024), "w")
    t.buffer = gpu.alloc_buffer(t.nbytes, usage="weights")
    try:
        gpu.layout.set_weight(t, 0, qtype, raw)
        got = gpu.get_tensor(t).view(np.uint16).reshape(rows, 1024)
    finally:
        gpu.free_buffer(t.buffer)
    if half == F16:
        want = ref.astype(np.float16).view(np.uint16)
    else:  # round to nearest even into the upper 16 bits
        bits = ref.view(np.uint32).astype(np.uint64)
        want = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(got, want)


def _sample_inputs(params_list, V: int, seed: int):
    from pyllama.batching.sampling import BatchSampler, SequenceSampler  # noqa: PLC0415
    rng = np.random.default_rng(seed)
    rows = len(params_list)
    logits = (2 * rng.standard_normal((rows, V))).astype(np.float32)
    logits[0, [5, 9]] = logits[0].max() + 1  # a tie at the max: the lower id wins
    logits[1, ::7] = np.nan
    logits[2, :] = -np.inf
    logits[3, 100] = np.inf
    bs = BatchSampler(V, rows, 8)
    samplers = [SequenceSampler(p, list(rng.integers(0, V, 20))) for p in params_list]
    packed = bs.pack(samplers)
    n_probs, window = bs.device_spec()
    return logits, packed, n_probs, window


@needs_gpu
@pytest.mark.parametrize("V", [512, 32000])
def test_sample_greedy_is_the_exact_argmax(gpu, V):
    from pyllama.batching.sampling import SamplingParams  # noqa: PLC0415
    plist = [SamplingParams(temperature=0, n_probs=5), SamplingParams(temperature=0, n_probs=3),
             SamplingParams(temperature=0, n_probs=2), SamplingParams(temperature=0),
             SamplingParams(temperature=0, repeat_penalty=1.5, presence_penalty=0.3, n_probs=4)] * 3
    logits, packed, n_probs, window = _sample_inputs(plist, V, 6)
    shape = (len(plist), sample_out_cols(n_probs))
    srcs = [(F32, logits), (I32, packed)]
    want, _ = _run_node(CPUBackend(1), Op.SAMPLE, srcs, I32, shape, (n_probs, window))
    got, _ = _run_node(gpu, Op.SAMPLE, srcs, I32, shape, (n_probs, window))
    np.testing.assert_array_equal(got[:, 0], want[:, 0])  # ids
    np.testing.assert_array_equal(got[:, 2:2 + n_probs], want[:, 2:2 + n_probs])  # candidates, in order
    probs = lambda a: np.concatenate([a[:, 1:2], a[:, 2 + n_probs:]], axis=1).view(np.float32)  # noqa: E731
    np.testing.assert_allclose(probs(got), probs(want), rtol=1e-4, atol=1e-7)
    assert want[0, 0] == 5


@needs_gpu
@pytest.mark.parametrize("V", [512, 32000])
def test_sample_chain_matches_cpu(gpu, V):
    from pyllama.batching.sampling import SamplingParams  # noqa: PLC0415
    plist = []
    for seed in range(24):
        plist += [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=seed, n_probs=8),
                  SamplingParams(temperature=1.0, top_k=0, top_p=0.95, min_p=0.0, seed=seed, n_probs=4),
                  SamplingParams(temperature=1.3, top_k=600, top_p=1.0, min_p=0.1, repeat_penalty=1.2,
                                 frequency_penalty=0.1, seed=seed, n_probs=8)]
    logits, packed, n_probs, window = _sample_inputs(plist, V, 7)
    shape = (len(plist), sample_out_cols(n_probs))
    srcs = [(F32, logits), (I32, packed)]
    want, _ = _run_node(CPUBackend(1), Op.SAMPLE, srcs, I32, shape, (n_probs, window))
    got, _ = _run_node(gpu, Op.SAMPLE, srcs, I32, shape, (n_probs, window))
    # the candidate lists (kept set, order) are exact; a draw within rounding of a boundary may
    # pick a neighbour, so the picks must agree on nearly every row and always be candidates
    np.testing.assert_array_equal(got[:, 2:2 + n_probs], want[:, 2:2 + n_probs])
    same = got[:, 0] == want[:, 0]
    assert same.mean() >= 0.95, np.flatnonzero(~same)
    top_probs = lambda a: a[:, 2 + n_probs:].view(np.float32)  # noqa: E731
    np.testing.assert_allclose(top_probs(got), top_probs(want), rtol=1e-4, atol=1e-7)


@needs_gpu
def test_events_and_async_reads(gpu):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    tensors = []
    for name in ("a", "b", "out"):
        t = Tensor(F32, x.shape, name)
        t.buffer = gpu.alloc_buffer(t.nbytes)
        tensors.append(t)
    a, b, out = tensors
    try:
        gpu.set_tensor(a, x)
        gpu.set_tensor(b, 2 * x)
        gpu.graph_compute(Graph([node(Op.ADD, out, a, b)]))
        ev = gpu.event_new()
        gpu.event_record(ev)
        gpu.event_synchronize(ev)
        host = np.empty_like(x)
        gpu.get_tensor_async(out, host)
        gpu.event_wait(ev)
        gpu.synchronize()
        np.testing.assert_array_equal(host, 3 * x)
    finally:
        for t in tensors:
            gpu.free_buffer(t.buffer)


# --- whole runs on a GPU -------------------------------------------------------------------------------
def _greedy_reference(model: str, prompt: str, n: int, gap: float = 0.05) -> list[int]:
    """CPU greedy ids, cut before the first step whose top-2 logit gap is under `gap` (there a
    half-precision device may rightly choose the other token)."""
    from pyllama.runtime.context import Batch  # noqa: PLC0415
    from pyllama.runtime.engine import Engine  # noqa: PLC0415
    engine = Engine(model, n_threads=1)
    ctx = engine.new_context(512)
    ids = engine.tokenizer.encode(prompt)
    out = ctx.decode(Batch.for_sequence(ids, 0, 0))
    got: list[int] = []
    for i in range(n):
        row = np.sort(out.logits[0])
        if row[-1] - row[-2] < gap:
            break
        t = int(out.logits[0].argmax())
        got.append(t)
        out = ctx.decode(Batch.for_sequence([t], len(ids) + i, 0))
    engine.close()
    return got


@pytest.fixture(scope="module")
def f16_model(model_factory):
    return model_factory("tiny", wtype="f16")


PROMPTS = ("The cat sat on", "Once upon a time", "Hello there", "In the beginning", "A B C D")


@pytest.fixture(scope="module")
def clear_prompt(f16_model) -> tuple[str, list[int]]:
    """The prompt whose CPU greedy continuation stays clear (top-2 gap) the longest, and that
    continuation: the tokens a half-precision device must reproduce."""
    best = max(((p, _greedy_reference(f16_model, p, 16)) for p in PROMPTS), key=lambda x: len(x[1]))
    assert len(best[1]) >= 4, "no prompt has a clear greedy continuation on this model"
    return best


@needs_gpu
def test_generate_on_cuda0_gives_the_cpu_greedy_text(f16_model, clear_prompt):
    prompt, want = clear_prompt
    proc = _run("pyllama.generate", "-m", f16_model, "-p", prompt, "-n", "16", "--temp", "0", "--tokens",
                "--ignore-eos", "--device", "CUDA0")
    assert proc.returncode == 0, proc.stderr
    assert [int(x) for x in proc.stdout.split()][:len(want)] == want


@needs_gpu
def test_rpc_server_cuda0_split_gives_the_cpu_greedy_text(f16_model, clear_prompt):
    from server_util import RPCServerProcess  # noqa: PLC0415
    prompt, want = clear_prompt
    peer = RPCServerProcess("--device", "CUDA0")
    try:
        for device in ("RPC0,CPU", "CPU,RPC0"):  # the GPU holds the first layers, then the output layer
            proc = _run("pyllama.generate", "-m", f16_model, "-p", prompt, "-n", "16", "--temp", "0",
                        "--tokens", "--ignore-eos", "--rpc", peer.endpoint, "--device", device, "-t", "1")
            assert proc.returncode == 0, proc.stderr
            assert [int(x) for x in proc.stdout.split()][:len(want)] == want, device
    finally:
        assert peer.stop() == 0, "".join(peer.log)


@needs_gpu
def test_gpu_trace_spans_are_monotonic_and_disjoint_per_stream(f16_model, tmp_path):
    path = tmp_path / "trace.jsonl"
    proc = _run("pyllama.generate", "-m", f16_model, "-p", "Hello there", "-n", "12", "--temp", "0", "--tokens",
                "--ignore-eos", "--device", "CUDA0", "--trace", str(path))
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    spans = [e for e in events if e["c"] == "dev" and e["n"] == "compute CUDA0"]
    assert len(spans) >= 12, "one span per decode step at least"
    decode = [e for e in events if e["c"] == "ctx" and e["n"] == "decode"]
    by_stream: dict[str, list] = {}
    for e in spans:
        by_stream.setdefault(e["tid"], []).append(e)
    for tid, es in by_stream.items():
        assert all(e["t0"] <= e["t1"] for e in es), tid
        for prev, cur in zip(es, es[1:]):  # in file order, each starts after the previous ended
            assert cur["t0"] >= prev["t1"], (tid, prev, cur)
    # the device works inside the decode calls that queued it (a few microseconds of anchor slack)
    lo, hi = min(d["t0"] for d in decode), max(d["t1"] for d in decode)
    assert all(lo - 1000 <= e["t0"] and e["t1"] <= hi + 1000 for e in spans)


# --- the host side on a fake device (everywhere) ---------------------------------------------------------
# tests/fake_cuda.py stands in for PyCUDA and cuBLAS (host memory, deferred streams, kernels computed
# on the CPU): what runs here is the backend's own Python, against the CPU backend.
@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    import fake_cuda  # noqa: PLC0415
    fake_cuda.install(monkeypatch, tmp_path / "kernels")
    return fake_cuda


def _prompt_batch(engine, texts):
    from pyllama.runtime.context import Batch  # noqa: PLC0415
    batches = [Batch.for_sequence(engine.tokenizer.encode(t), 0, s) for s, t in enumerate(texts)]
    return Batch.concat(batches)


@pytest.mark.parametrize("wtype", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("devices", ["CUDA0", "CUDA0,CPU", "CPU,CUDA0"])
def test_fake_device_forward_matches_the_cpu(fake_gpu, model_factory, wtype, devices):
    from pyllama.runtime.placement.devices import make_backends  # noqa: PLC0415
    from pyllama.runtime.engine import Engine  # noqa: PLC0415
    path = model_factory("tiny", wtype=wtype)
    cpu = Engine(path, n_threads=1)
    gpu = Engine(path, n_threads=1, backends=make_backends(devices, None, "layer", 1), tensor_split=None)
    try:
        stored = {t.dtype for w in gpu.weights.tensors.values() for t in (w if isinstance(w, tuple) else (w,))
                  if t.backend.name == "CUDA0" and len(t.shape) == 2}
        assert stored <= {F16}, stored  # every matrix converted at load
        texts = ["The cat sat on the mat", "Hello"]
        want = cpu.new_context(256, 2).decode(_prompt_batch(cpu, texts)).logits.copy()
        got = gpu.new_context(256, 2).decode(_prompt_batch(gpu, texts)).logits.copy()
        # the activations are rounded to F16 before each product; for Q8_0 and Q4_0 weights the CPU
        # quantizes them to Q8_0 as ggml does (the device to F16): then about 1e-2 apart
        assert _rel(got, want) < (2e-3 if wtype == "f16" else 3e-2)
    finally:
        gpu.close()
        cpu.close()


@pytest.mark.parametrize("wtype", ["f16", "q8_0"])
def test_fake_device_behind_an_rpc_server_takes_f16_weights(fake_gpu, model_factory, wtype):
    """A CUDA peer gets every matrix in F16 (converted on the client), as a local CUDA0 stores it;
    its rpc server accepts them where a CPU peer accepts only F32."""
    from pyllama.backend.cuda import open_backend  # noqa: PLC0415
    from pyllama.backend.rpc import RPCBackend  # noqa: PLC0415
    from pyllama.runtime.engine import Engine  # noqa: PLC0415
    from pyllama.rpc.connection import get_connection  # noqa: PLC0415
    from pyllama.rpc_server.server import ServerThread  # noqa: PLC0415
    path = model_factory("tiny", wtype=wtype)
    cpu = Engine(path, n_threads=1)
    with ServerThread(backend_factory=lambda: open_backend("CUDA0")) as st:
        conn = get_connection(f"127.0.0.1:{st.port}")
        remote = Engine(path, n_threads=1, backends=[RPCBackend(conn, 0, "RPC0")], tensor_split=[1])
        try:
            stored = {t.dtype for t in remote.weights.tensors.values() if len(t.shape) == 2}
            assert stored == {F16}, stored
            texts = ["The cat sat on the mat", "Hello"]
            want = cpu.new_context(256, 2).decode(_prompt_batch(cpu, texts)).logits.copy()
            got = remote.new_context(256, 2).decode(_prompt_batch(remote, texts)).logits.copy()
            assert _rel(got, want) < (2e-3 if wtype == "f16" else 3e-2)  # as above
        finally:
            remote.close()
            conn.close()
            cpu.close()


def test_fake_device_behind_an_rpc_server_computes_each_lane_on_a_stream_of_its_own(fake_gpu, f16_model):
    """Two groups' contexts over one rpc server with a CUDA device: each group's lane runs on an
    executor thread of its own there, and the device gives each of those threads a stream (lane)
    of its own, so the groups' graphs queue on different streams."""
    from pyllama.backend.cuda import open_backend  # noqa: PLC0415
    from pyllama.backend.rpc import RPCBackend, RPCLane  # noqa: PLC0415
    from pyllama.runtime.context import Batch  # noqa: PLC0415
    from pyllama.runtime.engine import Engine  # noqa: PLC0415
    from pyllama.rpc.connection import Connection  # noqa: PLC0415
    from pyllama.rpc_server.server import ServerThread  # noqa: PLC0415
    cpu = Engine(f16_model, n_threads=1)
    with ServerThread(backend_factory=lambda: open_backend("CUDA0")) as st:
        conn = Connection(f"127.0.0.1:{st.port}")
        remote = Engine(f16_model, n_threads=1, backends=[RPCBackend(conn, 0, "RPC0")], tensor_split=[1])
        try:
            prompt = remote.tokenizer.encode("Hello world")
            a, b = remote.new_context(128, 1), remote.new_context(128, 1)
            assert all(isinstance(c.sched.streams[0], RPCLane) for c in (a, b))
            la = a.decode(Batch.for_sequence(prompt, 0, 0)).logits.copy()
            lb = b.decode(Batch.for_sequence(prompt, 0, 0)).logits.copy()
            want = cpu.new_context(128, 1).decode(Batch.for_sequence(prompt, 0, 0)).logits
            np.testing.assert_array_equal(la, lb)
            assert _rel(la, want) < 2e-3
            gpu = st.server.devices[0].backend
            computing = [lane for lane in gpu._lanes if lane.plans]
            assert len(computing) == 2  # one stream per group's lane; none for the session's loads
        finally:
            remote.close()
            conn.close()
            cpu.close()
        # each connection's executor thread, as it ends, gives back the stream it had
        deadline = time.monotonic() + 10
        while gpu._lanes and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gpu._lanes == []


def test_an_rpc_server_refuses_weight_types_its_device_does_not_hold(model_factory):
    """A peer says which weight types it holds (GET_DEVICE_TYPES): the client refuses at load,
    naming the type, and a client that sends such a weight anyway has its graph refused."""
    from pyllama.backend.rpc import RPCBackend  # noqa: PLC0415
    from pyllama.runtime.engine import Engine  # noqa: PLC0415
    from pyllama.rpc.connection import RPCError, get_connection  # noqa: PLC0415
    from pyllama.rpc_server.server import ServerThread  # noqa: PLC0415
    path = model_factory("tiny", wtype="f16")
    with ServerThread() as st:
        st.server.devices[0].weight_types = frozenset({F32})  # a device that computes in F32 only
        conn = get_connection(f"127.0.0.1:{st.port}")
        with pytest.raises(RPCError, match="cannot hold F16 weights"):
            Engine(path, n_threads=1, backends=[RPCBackend(conn, 0, "RPC0")], tensor_split=[1])
        backend = RPCBackend(conn, 0, "RPC0")
        backend.layout.weight_dtype = lambda file_dtype: file_dtype  # a client that sends them anyway
        remote = Engine(path, n_threads=1, backends=[backend], tensor_split=[1])
        try:
            with pytest.raises(RPCError, match="is F16, not F32"):
                remote.new_context(64, 1).decode(_prompt_batch(remote, ["Hello"]))
        finally:
            remote.close()
            conn.close()


def test_fake_device_bf16_weights(fake_gpu, model_factory, monkeypatch, env_settings):
    from pyllama.backend.cuda import open_backend  # noqa: PLC0415
    from pyllama.runtime.engine import Engine  # noqa: PLC0415
    env_settings(PYLLAMA_CUDA_WEIGHTS="bf16")
    path = model_factory("tiny", wtype="q8_0")
    cpu, gpu = Engine(path, n_threads=1), Engine(path, n_threads=1, backends=[open_backend("CUDA0")])
    try:
        assert gpu.weights["blk.0.attn_qkv"].dtype == BF16 and gpu.weights["token_embd"].dtype == BF16
        want = cpu.new_context(256, 1).decode(_prompt_batch(cpu, ["Hello there"])).logits
        got = gpu.new_context(256, 1).decode(_prompt_batch(gpu, ["Hello there"])).logits
        assert _rel(got, want) < 2e-2  # bf16 keeps 8 significant bits of weights and activations
    finally:
        gpu.close()
        cpu.close()


def test_fake_device_groups_on_threads_sample_on_the_device_and_trace(fake_gpu, f16_model, tmp_path):
    import threading  # noqa: PLC0415
    from pyllama.obs import trace  # noqa: PLC0415
    from pyllama.backend.cuda import open_backend  # noqa: PLC0415
    from pyllama.runtime.context import Batch  # noqa: PLC0415
    from pyllama.runtime.engine import Engine  # noqa: PLC0415
    from pyllama.batching.sampling import BatchSampler, SamplingParams, SequenceSampler  # noqa: PLC0415
    engine = Engine(f16_model, n_threads=1, backends=[open_backend("CUDA0")])
    prompts = [engine.tokenizer.encode(t) for t in ("Hello world", "The cat", "Once upon", "A B C")]

    def run(prompt: list[int], on_device: bool, out: list) -> None:
        ctx = engine.new_context(256, 1)
        bs = BatchSampler(engine.model.hparams.n_vocab, 1, 4)
        samplers = [SequenceSampler(SamplingParams(temperature=0.7, seed=5, n_probs=3))]
        batch = Batch.for_sequence(prompt, 0, 0)
        for i in range(8):
            if on_device:
                r = bs.unpack(ctx.decode(batch, bs.pack(samplers), bs.device_spec()).sampled)
            else:
                r = bs.sample(ctx.decode(batch).logits, samplers)
            t = int(r.ids[0])
            samplers[0].accept(t)
            out.append((t, float(r.probs[0]), r.top_ids[0].tolist()))
            batch = Batch.for_sequence([t], len(prompt) + i, 0)
        ctx.free()

    path = tmp_path / "trace.jsonl"
    trace.start(str(path), "generate")
    try:
        results = {}
        for on_device in (False, True):
            outs: list[list] = [[] for _ in prompts]
            threads = [threading.Thread(target=run, args=(p, on_device, outs[i])) for i, p in enumerate(prompts)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            results[on_device] = outs
    finally:
        trace.close()
        engine.close()
    assert all(len(o) == 8 for o in results[True])
    assert results[True] == results[False]  # the SAMPLE op gives what host sampling gives
    spans = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    spans = [e for e in spans if e["c"] == "dev" and e["n"] == "compute CUDA0"]
    by_stream: dict[str, list] = {}
    for e in spans:
        by_stream.setdefault(e["tid"], []).append(e)
    assert len(by_stream) >= len(prompts) and len(spans) == 2 * len(prompts) * 8
    for es in by_stream.values():
        assert all(e["t0"] <= e["t1"] for e in es)
        assert all(b["t0"] >= a["t1"] for a, b in zip(es, es[1:]))


def test_fake_device_gives_each_context_a_stream_of_its_own(fake_gpu, f16_model):
    """Two pipeline groups' contexts used from one thread still compute on two streams (lanes) of
    their own, not the thread's default one; freeing a context gives its stream back."""
    from pyllama.backend.cuda import CUDAStream, open_backend  # noqa: PLC0415
    from pyllama.runtime.context import Batch  # noqa: PLC0415
    from pyllama.runtime.engine import Engine  # noqa: PLC0415
    gpu = open_backend("CUDA0")
    engine = Engine(f16_model, n_threads=1, backends=[gpu])
    try:
        prompt = engine.tokenizer.encode("Hello world")
        a, b = engine.new_context(128, 1), engine.new_context(128, 1)
        sa, sb = a.sched.streams[0], b.sched.streams[0]
        assert isinstance(sa, CUDAStream) and sa.lane is None  # nothing held before the first compute
        la = a.decode(Batch.for_sequence(prompt, 0, 0)).logits.copy()
        lb = b.decode(Batch.for_sequence(prompt, 0, 0)).logits.copy()
        np.testing.assert_array_equal(la, lb)
        own = getattr(gpu._tls, "lane", None)  # the thread's lane (the loader's writes), if any
        assert sa.lane is not None and sb.lane is not None and len({id(sa.lane), id(sb.lane), id(own)}) == 3
        assert sa.lane.plans and sb.lane.plans and not (own.plans if own else {})
        a.free()
        assert sa.lane is None and sb.lane in gpu._lanes and len(gpu._lanes) == 1 + (own is not None)
    finally:
        engine.close()


def test_fake_device_reports_bad_indices_at_synchronize(fake_gpu):
    from pyllama.backend.cuda import open_backend  # noqa: PLC0415
    gpu = open_backend("CUDA0")
    try:
        table = np.arange(12, dtype=np.float32).reshape(3, 4)
        with pytest.raises(ValueError, match="row id outside its table"):
            _run_node(gpu, Op.GET_ROWS, [(F32, table), (I32, np.array([1, 7], np.int32))], F32, (2, 4))
        got, _ = _run_node(gpu, Op.GET_ROWS, [(F32, table), (I32, np.array([2, 0], np.int32))], F32, (2, 4))
        np.testing.assert_array_equal(got, table[[2, 0]])  # the error was reported once, then cleared
        with pytest.raises(ValueError, match="MUL_MAT"):
            _run_node(gpu, Op.MUL_MAT, [(F32, table), (F32, np.zeros((3, 5), np.float32))], F32, (3, 3))
    finally:
        gpu.close()


# --- the kernels' own source on the CPU (everywhere with g++ and the CUDA headers) -----------------------
# tests/cuda_host/shim.h runs cuda_src/*.cu as host C++ (a std::thread per CUDA thread, barriers,
# warp shuffles): the kernels' logic against the CPU backend, with the launch shapes the backend uses.
def _cuda_include() -> Path | None:
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    if NVCC:
        roots.append(str(Path(NVCC).resolve().parent.parent))
    return next((Path(r) / "include" for r in roots if r and (Path(r) / "include" / "cuda_fp16.h").exists()), None)


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    import concurrent.futures  # noqa: PLC0415
    import ctypes  # noqa: PLC0415
    gxx, include = shutil.which("g++"), _cuda_include()
    if gxx is None or include is None:
        pytest.skip("needs g++ and the CUDA toolkit's headers")
    out = tmp_path_factory.mktemp("cuda_host")
    probe = out / "probe.cpp"
    probe.write_text("#include <barrier>\nint main() { std::barrier<> b(1); b.arrive_and_wait(); }\n")
    if subprocess.run([gxx, "-std=c++20", "-pthread", str(probe), "-o", str(out / "probe")], capture_output=True).returncode:
        pytest.skip("g++ without C++20 <barrier>")
    host = ROOT / "tests" / "cuda_host"

    def build(part: str) -> subprocess.CompletedProcess:
        return subprocess.run([gxx, "-std=c++20", "-O1", "-fPIC", "-pthread", "-w", f"-D{part}", f"-I{include}",
                               f"-I{CUDA_SRC}", f"-I{host}", "-c", str(host / "launch.cpp"), "-o", str(out / f"{part}.o")],
                              capture_output=True, text=True)
    parts = ["RUNTIME", "ELEMENTWISE", "ATTENTION", "DEQUANT", "SAMPLING"]
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        results = dict(zip(parts, pool.map(build, parts)))
    failed = {p: r.stderr[-3000:] for p, r in results.items() if r.returncode}
    assert not failed, failed
    lib = out / "libkernels.so"
    subprocess.run([gxx, "-shared", "-pthread", "-o", str(lib), *(str(out / f"{p}.o") for p in parts)], check=True)
    return ctypes.CDLL(str(lib))


def _p(a):
    import ctypes  # noqa: PLC0415
    return ctypes.c_void_p(a.ctypes.data if a is not None else 0)


def _cpu_node(op: Op, inputs, out_dtype, out_shape, params=()):
    return _run_node(CPUBackend(1), op, inputs, out_dtype, out_shape, params)


def test_host_run_row_and_element_kernels_match_the_cpu(host_kernels):
    from ctypes import c_float, c_longlong  # noqa: PLC0415
    from pyllama.backend.cuda.backend import _grid  # noqa: PLC0415
    k, rng, err = host_kernels, np.random.default_rng(1), np.zeros(1, np.uint32)
    table = _bf16_exact(rng.standard_normal((50, 96)).astype(np.float32))
    ids = np.array([3, 0, 49, 3, 17], np.int32)
    for name, dev, want in [("f32", table, table), ("f16", table.astype(np.float16), table.astype(np.float16)),
                            ("bf16", _bf16_bytes(table), table)]:
        out = np.zeros((5, 96), np.float32)
        getattr(k, f"launch_get_rows_{name}")(5, 256, _p(dev), _p(ids), _p(out), c_longlong(50), c_longlong(96), _p(err))
        np.testing.assert_array_equal(out, want.astype(np.float32)[ids])
    out, bad = np.ones((2, 96), np.float32), np.array([1, 70], np.int32)
    k.launch_get_rows_f32(2, 256, _p(table), _p(bad), _p(out), c_longlong(50), c_longlong(96), _p(err))
    assert err[0] == 1 and not out[1].any()  # flagged, zeros written
    x = rng.standard_normal((7, 300)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(300)).astype(np.float32)
    out = np.zeros_like(x)
    k.launch_rms_norm_f32(7, 256, _p(x), _p(w), _p(out), c_longlong(300), c_float(1e-5))
    assert _rel(out, _cpu_node(Op.RMS_NORM, [(F32, x), (F32, w)], F32, (7, 300), (1e-5,))[0]) < 1e-6
    gu = (3 * rng.standard_normal((7, 600))).astype(np.float32)
    out = np.zeros((7, 300), np.float32)
    k.launch_swiglu_f32(_grid(2100), 256, _p(gu), _p(out), c_longlong(7), c_longlong(300))
    assert _rel(out, _cpu_node(Op.SWIGLU, [(F32, gu)], F32, (7, 300))[0]) < 1e-6
    y, out = rng.standard_normal((7, 300)).astype(np.float32), np.zeros_like(x)
    k.launch_add_f32(_grid(2100), 256, _p(x), _p(y), _p(out), c_longlong(2100))
    np.testing.assert_array_equal(out, x + y)
    bias, out = rng.standard_normal(300).astype(np.float32), x.copy()
    k.launch_add_bias_f32(_grid(2100), 256, _p(out), _p(bias), c_longlong(7), c_longlong(300))
    np.testing.assert_array_equal(out, x + bias)
    half = np.zeros(2100, np.float16)
    k.launch_convert_f32_f16(_grid(2100), 256, _p(x), _p(half), c_longlong(2100))
    np.testing.assert_array_equal(half, x.reshape(-1).astype(np.float16))


@pytest.mark.parametrize("rope_mode", [0, 2])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("hd", [64, 80])
def test_host_run_attention_kernels_match_the_cpu(host_kernels, rope_mode, qk_norm, hd):
    from ctypes import c_double, c_float, c_longlong  # noqa: PLC0415
    from pyllama.backend.cuda.backend import _BLOCK  # noqa: PLC0415
    rng, err = np.random.default_rng(4), np.zeros(1, np.uint32)
    H, Hkv, n, cells = 4, 2, 5, 32
    qkv = rng.standard_normal((n, (H + 2 * Hkv) * hd)).astype(np.float32)
    kc = rng.standard_normal((cells, Hkv * hd)).astype(np.float32)
    vc = rng.standard_normal((cells, Hkv * hd)).astype(np.float32)
    pos, kv_idx = np.array([7, 8, 9, 0, 1], np.int32), np.array([10, 11, 12, 20, 21], np.int32)
    listed = np.array([3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 20, 21], np.int32)
    ranges = np.array([[0, 8], [0, 9], [0, 10], [10, 1], [10, 2]], np.int32)
    qn = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32) if qk_norm else None
    kn = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32) if qk_norm else None
    n_rot = hd if rope_mode == 2 else hd // 2
    params = (H, Hkv, hd, n_rot, rope_mode, 10000.0, 1.0, 1e-6, 1.0 / np.sqrt(hd))
    srcs = [(F32, qkv), (F32, kc), (F32, vc), (I32, pos), (I32, kv_idx), (I32, listed), (I32, ranges)]
    want, after = _cpu_node(Op.ATTENTION, srcs + ([(F32, qn), (F32, kn)] if qk_norm else []), F32, (n, H * hd), params)
    out = np.zeros((n, H * hd), np.float32)
    host_kernels.launch_attn_store(n, _BLOCK["attn_store"], _p(qkv), _p(kc), _p(vc), _p(pos), _p(kv_idx), _p(qn), _p(kn),
                                   _p(out), H, Hkv, hd, n_rot, rope_mode, c_double(10000.0), c_double(1.0), c_float(1e-6),
                                   c_longlong(cells), _p(err))
    host_kernels.launch_attn_attend(n * H, _BLOCK["attn_attend"], _p(kc), _p(vc), _p(listed), _p(ranges), _p(out), H, Hkv,
                                    hd, c_float(1.0 / np.sqrt(hd)), c_longlong(cells), c_longlong(len(listed)), _p(err))
    assert err[0] == 0
    assert _rel(out, want) < 1e-5 and _rel(kc, after[1]) < 1e-6
    np.testing.assert_array_equal(vc, after[2])


def test_host_run_dequant_kernels_are_exact(host_kernels):
    from ctypes import c_longlong  # noqa: PLC0415
    from gguf import GGML_QUANT_SIZES  # noqa: PLC0415
    from pyllama._fast.quant import dequantize_to_f32  # noqa: PLC0415
    from pyllama.backend.cuda.backend import DEQUANT_KERNELS, _grid  # noqa: PLC0415
    rng = np.random.default_rng(5)
    for (qtype, half), name in DEQUANT_KERNELS.items():
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (4 * 1024 // block, size), dtype=np.uint8)
        for off in {DType.Q8_0: [0], DType.Q4_0: [0], DType.Q4_K: [0, 2], DType.Q5_K: [0, 2], DType.Q6_K: [208]}.get(qtype, []):
            raw[:, off:off + 2] = (rng.standard_normal(len(raw)) / 64).astype(np.float16).view(np.uint8).reshape(-1, 2)
        if qtype in (DType.F16, DType.BF16, DType.F32):
            vals = rng.standard_normal(4096).astype(np.float32)
            raw = {DType.F16: vals.astype(np.float16).view(np.uint8), DType.BF16: _bf16_bytes(vals).view(np.uint8),
                   DType.F32: vals.view(np.uint8)}[qtype]
        raw = np.ascontiguousarray(raw).reshape(-1)
        ref = dequantize_to_f32(raw, int(qtype), (4096,))
        got = np.zeros(4096, np.uint16)
        getattr(host_kernels, f"launch_{name}")(_grid(4096), 256, _p(raw), _p(got), c_longlong(4096))
        bits = ref.view(np.uint32).astype(np.uint64)
        want = (ref.astype(np.float16).view(np.uint16) if half == F16
                else ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16))
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("V", [512, 4096])
def test_host_run_sample_kernel_matches_the_cpu(host_kernels, V):
    from pyllama.backend.cuda.backend import _BLOCK  # noqa: PLC0415
    from pyllama.batching.sampling import SamplingParams  # noqa: PLC0415
    plist = [SamplingParams(temperature=0, n_probs=5), SamplingParams(temperature=0, n_probs=3),
             SamplingParams(temperature=0, n_probs=2), SamplingParams(temperature=0),
             SamplingParams(temperature=0, repeat_penalty=1.5, presence_penalty=0.3, n_probs=4)]
    for seed in range(3):
        plist += [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=seed, n_probs=8),
                  SamplingParams(temperature=1.0, top_k=0, top_p=0.95, min_p=0.0, seed=seed, n_probs=4),
                  SamplingParams(temperature=1.3, top_k=600, top_p=1.0, min_p=0.1, repeat_penalty=1.2,
                                 frequency_penalty=0.1, seed=seed, n_probs=8),
                  SamplingParams(temperature=2.0, top_k=5, top_p=0.5, min_p=1.0, seed=seed, n_probs=8)]
    logits, packed, n_probs, window = _sample_inputs(plist, V, 7)
    logits[5] = np.round(logits[5])  # many equal logits: the walk in id order
    rows, shape = len(plist), (len(plist), sample_out_cols(n_probs))
    want, _ = _cpu_node(Op.SAMPLE, [(F32, logits), (I32, packed)], I32, shape, (n_probs, window))
    out, err = np.zeros(shape, np.int32), np.zeros(1, np.uint32)
    counts, scratch = np.zeros((rows, V), np.int32), np.zeros((rows, V), np.float32)
    gathered = np.zeros((rows, n_probs), np.uint64)  # (kept alive: the kernel writes them)
    host_kernels.launch_sample_rows(rows, _BLOCK["sample_rows"], _p(logits), _p(packed), _p(out), _p(scratch),
                                    _p(counts), _p(gathered), V, window, n_probs, _p(err))
    assert err[0] == 0 and not counts.any()  # the penalty counts are left zeroed
    np.testing.assert_array_equal(out[:, :1], want[:, :1])
    np.testing.assert_array_equal(out[:, 2:2 + n_probs], want[:, 2:2 + n_probs])
    probs = lambda a: np.concatenate([a[:, 1:2], a[:, 2 + n_probs:]], axis=1).view(np.float32)  # noqa: E731
    np.testing.assert_allclose(probs(out), probs(want), rtol=1e-4, atol=1e-7)
