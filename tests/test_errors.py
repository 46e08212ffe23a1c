"""Bad input gets one clear line and exit status 1: missing, corrupt and truncated files, unknown
architectures and types, prompts longer than the context, bad -n."""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys

import pytest

from pyllama.util.errors import ModelFileError
from pyllama.models.gguf_file import GGUFFile
from pyllama.models.model import Model

HERE = os.path.dirname(__file__)
GPT2_VOCAB = os.path.join(HERE, "data", "vocab", "ggml-vocab-gpt-2.gguf")


def run_generate(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyllama.generate", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 1, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def patched_copy(src: str, dst: str, patch) -> str:
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as fh:
        data = bytearray(fh.read())
        patch(data)
        fh.seek(0)
        fh.truncate()
        fh.write(data)
    return dst


def tensor_type_offset(data: bytearray, name: str) -> int:
    """Byte offset of the type field of tensor `name` in a GGUF header."""
    key = struct.pack("<Q", len(name)) + name.encode()
    i = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, i)[0]
    return i + 4 + 8 * n_dims


@pytest.fixture
def bad_files(tmp_path, tiny_model):
    size = os.path.getsize(tiny_model)

    def set_type(data: bytearray) -> None:
        struct.pack_into("<I", data, tensor_type_offset(data, "blk.0.ffn_up.weight"), 9)  # Q8_1 (an activation type)

    return {
        "missing": (str(tmp_path / "nope.gguf"), "no such file"),
        "magic": (patched_copy(tiny_model, str(tmp_path / "magic.gguf"), lambda d: d.__setitem__(slice(0, 4), b"GGUX")),
                  "not a GGUF file"),
        "counts": (patched_copy(tiny_model, str(tmp_path / "counts.gguf"),
                                lambda d: struct.pack_into("<Q", d, 16, 2**62)), "bad header"),
        "truncated": (patched_copy(tiny_model, str(tmp_path / "trunc.gguf"), lambda d: d.__delitem__(slice(size - 4096, None))),
                      "truncated"),
        "header_cut": (patched_copy(tiny_model, str(tmp_path / "cut.gguf"), lambda d: d.__delitem__(slice(1500, None))),
                       "truncated or corrupt"),
        "arch": (GPT2_VOCAB, "unsupported architecture 'gpt2'"),
        "qtype": (patched_copy(tiny_model, str(tmp_path / "q8_1.gguf"), set_type), "unsupported type Q8_1"),
        "empty": (patched_copy(tiny_model, str(tmp_path / "empty.gguf"), lambda d: d.clear()), "not a GGUF file"),
    }


@pytest.mark.parametrize("case", ["missing", "magic", "counts", "truncated", "header_cut", "arch", "qtype", "empty"])
def test_bad_model_file_is_one_clear_error(bad_files, case):
    path, needle = bad_files[case]
    with pytest.raises(ModelFileError) as err:
        Model(path)
    assert needle in str(err.value)
    assert os.path.basename(path) in str(err.value)


def test_missing_tensor_is_named(tmp_path, tiny_model):
    def rename(data: bytearray) -> None:
        i = data.index(b"blk.1.ffn_down.weight")
        data[i:i + 5] = b"blk.9"
    path = patched_copy(tiny_model, str(tmp_path / "renamed.gguf"), rename)
    with pytest.raises(ModelFileError, match="missing tensor 'blk.1.ffn_down.weight'"):
        Model(path)


def test_gguf_reader_survives_garbage(tmp_path):
    import numpy as np
    rng = np.random.default_rng(1)
    for i in range(50):
        blob = b"GGUF" + struct.pack("<I", 3) + rng.integers(0, 256, int(rng.integers(0, 400)), dtype=np.uint8).tobytes()
        path = tmp_path / f"g{i}.gguf"
        path.write_bytes(blob)
        try:
            GGUFFile(path)
        except ModelFileError:
            pass


@pytest.mark.parametrize("case", ["missing", "magic", "truncated", "arch", "qtype"])
def test_generate_bad_model_exits_1(bad_files, case):
    path, needle = bad_files[case]
    assert_one_line_error(run_generate("-m", path, "-p", "hi", "-n", "2"), needle)


def test_generate_prompt_longer_than_context(tiny_model):
    assert_one_line_error(run_generate("-m", tiny_model, "-c", "16", "-p", "word " * 40, "-n", "2"),
                          "context holds 16")


def test_generate_n_below_minus_one(tiny_model):
    assert_one_line_error(run_generate("-m", tiny_model, "-p", "hi", "-n", "-2"), "-n -2")


def test_generate_bad_sampling_value(tiny_model):
    assert_one_line_error(run_generate("-m", tiny_model, "-p", "hi", "--top-p", "1.5"), "top_p")


def test_generate_unknown_flag(tiny_model):
    proc = run_generate("-m", tiny_model, "--no-such-flag")
    assert proc.returncode == 1 and "unrecognized arguments" in proc.stderr and "Traceback" not in proc.stderr
