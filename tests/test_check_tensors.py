"""--check-tensors: a model file whose tensor data holds a value that is not finite (a NaN weight,
an infinite block scale) is refused with one error naming the tensor, by the engine, generate and
the server; without the flag nothing is read ahead."""
from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

from pyllama.runtime.engine import Engine
from pyllama.util.errors import ModelFileError
from pyllama.models.check_tensors import bad_element
from pyllama.models.gguf_file import GGUFFile
from pyllama.models.quantize import quantize
from gguf import GGMLQuantizationType as Q


def corrupted(path: str, tmp_path, tensor: str, at: int, value: bytes) -> str:
    """A copy of `path` with `value` written at byte `at` of `tensor`'s data."""
    out = str(tmp_path / f"bad-{tensor}.gguf")
    shutil.copy(path, out)
    offset = GGUFFile(path).tensors[tensor].offset
    with open(out, "r+b") as f:
        f.seek(offset + at)
        f.write(value)
    return out


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K])
def test_the_first_bad_element_or_block_is_found(qtype):
    from pyllama.models.gguf_file import TensorInfo
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 256)).astype(np.float32)
    raw = {Q.F32: w.view(np.uint8), Q.F16: w.astype(np.float16).view(np.uint8),
           Q.BF16: (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)}.get(qtype)
    if raw is None:
        raw = np.ascontiguousarray(quantize(w, qtype))
    raw = raw.reshape(-1).copy()
    info = TensorInfo("t", qtype, w.shape, w.size, raw)
    assert bad_element(info) is None
    if qtype in (Q.F32, Q.F16, Q.BF16):
        item = {Q.F32: 4, Q.F16: 2, Q.BF16: 2}[qtype]
        raw[5 * item:6 * item] = 0xFF  # every bit set: a NaN in each of these types
        assert bad_element(info) == 5
    else:
        block = raw.size // 4  # 256-element rows: one K block per row, or 8 blocks of 32
        size = block if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K) else block // 8
        scale = {Q.Q6_K: 208, Q.Q2_K: 80, Q.Q3_K: 108}.get(qtype, 0)
        raw[2 * size + scale:2 * size + scale + 2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
        assert bad_element(info) == 2


def test_engine_generate_and_server_refuse_a_bad_model(model_factory, tmp_path):
    good = model_factory("tiny")
    bad = corrupted(good, tmp_path, "blk.1.attn_k.weight", 12, np.float32(np.nan).tobytes())
    with pytest.raises(ModelFileError, match=r"tensor 'blk.1.attn_k.weight' has invalid data: .* element 3 "):
        Engine(bad, n_threads=1, check_tensors=True)
    Engine(bad, n_threads=1).close()  # without the flag the file is not read ahead
    Engine(good, n_threads=1, check_tensors=True).close()
    for cmd in ([sys.executable, "-m", "pyllama.generate", "-m", bad, "-p", "hi", "-n", "1", "--check-tensors"],
                [sys.executable, "-m", "pyllama.server", "-m", bad, "--port", "0", "-c", "128", "--check-tensors"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "tensor 'blk.1.attn_k.weight' has invalid data" in proc.stderr
