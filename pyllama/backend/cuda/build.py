"""Ahead-of-time compilation of cuda_src/*.cu into fatbins (sm_90 code plus compute_90 PTX).

Used by setup.py at install time (loaded by path: it imports nothing but the standard library)
and by the tests' compile check. Every .cu file becomes `<name>.fatbin`; the files compile in
parallel, one nvcc process each. A manifest (`sources.sha256`) records the hash of the sources
the fatbins were built from, so the backend can warn when an editable checkout's kernels are
older than its sources.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Optional, Sequence

# sm_90 machine code for Hopper (H100/H200), plus compute_90 PTX that newer GPUs JIT-compile.
GENCODE = ["-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_90,code=compute_90"]
NVCC_FLAGS = ["-O3", "-std=c++17"]
# Every warning is an error in the compile check (tests/test_cuda.py); the install build only warns.
STRICT_FLAGS = ["-Werror", "all-warnings", "-Xcompiler", "-Wall,-Werror"]
MANIFEST = "sources.sha256"


def find_nvcc() -> Optional[str]:
    """nvcc on PATH, else under $CUDA_HOME / $CUDA_PATH or /usr/local/cuda; None when absent."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    return None


def sources(src_dir: Path) -> list[Path]:
    return sorted(src_dir.glob("*.cu"))


def sources_digest(src_dir: Path) -> str:
    """Hash of every .cu and .cuh file of `src_dir` (names and contents)."""
    h = hashlib.sha256()
    for p in sorted(list(src_dir.glob("*.cu")) + list(src_dir.glob("*.cuh"))):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def nvcc_command(nvcc: str, src: Path, out: Path, strict: bool = False) -> list[str]:
    cmd = [nvcc, "-fatbin", *NVCC_FLAGS, *GENCODE, "-I", str(src.parent), "-o", str(out), str(src)]
    if strict:
        cmd[2:2] = STRICT_FLAGS
    return cmd


def compile_all(src_dir: Path, out_dir: Path, nvcc: Optional[str] = None, strict: bool = False,
                jobs: int = 0) -> dict[str, tuple[int, str]]:
    """Compiles every .cu of `src_dir` into `out_dir`/<name>.fatbin in parallel.

    Returns {file name: (exit status, nvcc's output)}. A fatbin is written through a temporary
    name, so a failed or interrupted build never leaves a truncated module behind.
    """
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found")
    out_dir.mkdir(parents=True, exist_ok=True)
    files = sources(src_dir)

    def one(src: Path) -> tuple[str, tuple[int, str]]:
        final = out_dir / (src.stem + ".fatbin")
        tmp = out_dir / f".{src.stem}.{os.getpid()}.fatbin.tmp"
        proc = subprocess.run(nvcc_command(nvcc, src, tmp, strict), capture_output=True, text=True)
        if proc.returncode == 0:
            os.replace(tmp, final)
        elif tmp.exists():
            tmp.unlink()
        return src.name, (proc.returncode, (proc.stdout + proc.stderr).strip())

    workers = jobs or min(len(files), os.cpu_count() or 1) or 1
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        results = dict(pool.map(one, files))
    if all(rc == 0 for rc, _ in results.values()):
        (out_dir / MANIFEST).write_text(sources_digest(src_dir) + "\n")
    return results


def is_current(src_dir: Path, out_dir: Path) -> bool:
    """Whether `out_dir` holds a fatbin of every source, built from these very sources."""
    manifest = out_dir / MANIFEST
    if not manifest.exists() or any(not (out_dir / (p.stem + ".fatbin")).exists() for p in sources(src_dir)):
        return False
    return manifest.read_text().strip() == sources_digest(src_dir)


def build_for_install(src_dir: Path, out_dirs: Sequence[Path], log=print) -> None:
    """The install-time step: skipped without nvcc or with PYLLAMA_NO_CUDA_BUILD=1; a failure is
    reported and the install goes on (the package works without CUDA, and `--device CUDA0` then
    says the kernels are missing)."""
    if os.environ.get("PYLLAMA_NO_CUDA_BUILD") == "1":
        log("pyllama: PYLLAMA_NO_CUDA_BUILD=1, CUDA kernels not built")
        return
    nvcc = find_nvcc()
    if nvcc is None or not sources(src_dir):
        log("pyllama: nvcc not found, CUDA kernels not built (the CUDA backend will be unavailable)")
        return
    t0 = time.monotonic()
    first, *others = out_dirs
    current = is_current(src_dir, first)  # a rebuild of an unchanged checkout compiles nothing
    results = {p.name: (0, "") for p in sources(src_dir)} if current else compile_all(src_dir, first, nvcc)
    failed = {name: out for name, (rc, out) in results.items() if rc != 0}
    for name, out in failed.items():
        log(f"pyllama: nvcc failed on {name}; the CUDA backend will be unavailable:\n{out}")
    if failed:
        return
    for other in others:
        other.mkdir(parents=True, exist_ok=True)
        for p in list(first.glob("*.fatbin")) + [first / MANIFEST]:
            shutil.copyfile(p, other / p.name)
    if current:
        log(f"pyllama: CUDA kernels in {first} are up to date")
    else:
        log(f"pyllama: built {len(results)} CUDA kernel modules with {nvcc} in {time.monotonic() - t0:.1f} s")
