"""Opening GGUF files: metadata as plain Python values, tensors as memory-mapped byte views.

The header is parsed here (bounds-checked at every read, and ~50x faster than walking it with
`gguf.GGUFReader`, which builds numpy views per field); the `gguf` package supplies the type
tables. Everything that can go wrong with a file (missing, not GGUF, truncated, inconsistent)
becomes one `ModelFileError` naming the file and, where there is one, the key or tensor.
"""
from __future__ import annotations

import argparse
import csv
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..util.errors import ModelFileError

GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
MAX_DIMS = 4


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file. `shape` is row-major (numpy order, the reverse of ggml's ne)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    raw: np.ndarray  # uint8 view of the tensor's bytes in the memory map
    offset: int = 0  # where those bytes start in the file (and in GGUFFile.data)


class _Cursor:
    """Reads little-endian values from a bytes-like object, failing cleanly at its end."""

    def __init__(self, buf: Any, path: str):
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.path = path
        self.what = "header"

    def fail(self, msg: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: truncated or corrupt file: {msg} (at {self.what})")

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise self.fail("data ends before the end of this field")
        self.pos = start + n
        return start

    def scalar(self, fmt: str) -> Any:
        start = self.take(struct.calcsize(fmt))
        return struct.unpack_from(fmt, self.buf, start)[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        start = self.take(n)
        return bytes(self.buf[start:start + n]).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.scalar("<I")
            count = self.scalar("<Q")
            if etype == _STRING:
                if count > (self.size - self.pos) // 8:
                    raise self.fail(f"array of {count} strings cannot fit in the file")
                return [self.string() for _ in range(count)]
            if etype in _NP_SCALARS:
                dt = np.dtype(_NP_SCALARS[etype])
                if count > (self.size - self.pos) // dt.itemsize:
                    raise self.fail("array runs past the end of the file")
                start = self.take(count * dt.itemsize)
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=start)
                return (arr.astype(bool) if etype == 7 else arr).tolist()
            raise self.fail(f"unsupported array element type {etype}")
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        raise self.fail(f"unknown value type {vtype}")


class GGUFFile:
    """A memory-mapped GGUF file: `metadata` (dict of plain values) and `tensors` (by name)."""

    def __init__(self, path: str | os.PathLike[str], kv_overrides: Mapping[str, Any] | None = None):
        """kv_overrides (--override-kv) replace or add metadata values once the header is read."""
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise ModelFileError(f"{self.path}: no such file")
        if os.path.isdir(self.path):
            raise ModelFileError(f"{self.path}: is a directory, not a GGUF file")
        try:
            with open(self.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size < 24:
                    raise ModelFileError(f"{self.path}: not a GGUF file (too short for a header)")
                self._mmap = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except PermissionError:
            raise ModelFileError(f"{self.path}: permission denied") from None
        self.data = np.frombuffer(self._mmap, dtype=np.uint8)
        cur = _Cursor(self._mmap, self.path)
        if self._mmap[:4] != GGUF_MAGIC:
            raise ModelFileError(f"{self.path}: not a GGUF file (bad magic {bytes(self._mmap[:4])!r})")
        cur.take(4)
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            raise ModelFileError(f"{self.path}: unsupported GGUF version {self.version} (expected 2 or 3)")
        n_tensors = cur.scalar("<Q")
        n_kv = cur.scalar("<Q")
        if n_tensors > size // 16 or n_kv > size // 12:
            raise ModelFileError(f"{self.path}: bad header: file is truncated or corrupt ({n_tensors} tensors and {n_kv} keys cannot fit in {size} bytes)")
        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            cur.what = f"metadata entry {i}"
            key = cur.string()
            cur.what = f"metadata key '{key}'"
            self.metadata[key] = cur.value(cur.scalar("<I"))
        if kv_overrides:
            apply_kv_overrides(self.metadata, kv_overrides, self.path)
        infos = []
        for i in range(n_tensors):
            cur.what = f"tensor info {i}"
            name = cur.string()
            cur.what = f"tensor '{name}'"
            n_dims = cur.scalar("<I")
            if n_dims == 0 or n_dims > MAX_DIMS:
                raise cur.fail(f"tensor has {n_dims} dimensions")
            ne = [cur.scalar("<Q") for _ in range(n_dims)]
            qtype_id = cur.scalar("<I")
            offset = cur.scalar("<Q")
            infos.append((name, ne, qtype_id, offset))
        alignment = self.metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ModelFileError(f"{self.path}: metadata key 'general.alignment' must be a power of two")
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, qtype_id, offset in infos:
            try:
                qtype = GGMLQuantizationType(qtype_id)
            except ValueError:
                raise ModelFileError(f"{self.path}: tensor '{name}' has unknown type id {qtype_id}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_el = 1
            for d in ne:
                if d <= 0 or d > 1 << 40:
                    raise ModelFileError(f"{self.path}: tensor '{name}' has bad dimensions {ne}")
                n_el *= d
            if ne[0] % block:
                raise ModelFileError(f"{self.path}: tensor '{name}' row of {ne[0]} is not a whole number of {qtype.name} blocks")
            n_bytes = n_el // block * type_size
            start = data_start + offset
            if offset % alignment or start + n_bytes > size:
                raise ModelFileError(f"{self.path}: tensor '{name}' is truncated (its data ends past the end of the file)")
            if name in self.tensors:
                raise ModelFileError(f"{self.path}: tensor '{name}' appears twice")
            self.tensors[name] = TensorInfo(name, qtype, tuple(reversed(ne)), n_el, self.data[start:start + n_bytes],
                                            start)

    def release_pages(self, info: TensorInfo) -> None:
        """Tells the kernel this process is done with a tensor's bytes (they were copied): the
        pages wholly inside it leave the process's resident set. Reading them again later is
        still correct (they come back from the file), so a neighbour's shared page is kept."""
        page = mmap.PAGESIZE
        start = -(-info.offset // page) * page
        end = (info.offset + info.raw.size) // page * page
        if end > start and hasattr(self._mmap, "madvise"):
            try:
                self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)
            except (OSError, ValueError, AttributeError):  # pragma: no cover - advice only
                pass

    def require(self, key: str) -> Any:
        """A metadata value that must be present."""
        if key not in self.metadata:
            raise ModelFileError(f"{self.path}: missing metadata key '{key}'")
        return self.metadata[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


def read_metadata(path: str | os.PathLike[str], kv_overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Metadata of a GGUF file as plain Python values (lists for arrays)."""
    return GGUFFile(path, kv_overrides).metadata


# ---- --override-kv KEY=TYPE:VALUE (llama.cpp's syntax and limits) ---------------------------------

_KV_TYPES = ("int", "float", "bool", "str")


def parse_kv_override(text: str) -> tuple[str, Any]:
    """One KEY=TYPE:VALUE item as (key, value); ValueError says what is wrong with it."""
    key, eq, rest = text.partition("=")
    key = key.strip()
    if not eq or not key:
        raise ValueError(f"'{text}' is not KEY=TYPE:VALUE")
    if len(key) >= 128:
        raise ValueError(f"'{key[:40]}...': the key is longer than 127 characters")
    kind, colon, value = rest.partition(":")
    if not colon or kind not in _KV_TYPES:
        raise ValueError(f"'{text}': the type must be one of {', '.join(_KV_TYPES)} (KEY=TYPE:VALUE)")
    try:
        if kind == "int":
            return key, int(value, 10)
        if kind == "float":
            return key, float(value)
    except ValueError:
        raise ValueError(f"'{text}': '{value}' is not a{'n' if kind == 'int' else ''} {kind}") from None
    if kind == "bool":
        if value not in ("true", "false"):
            raise ValueError(f"'{text}': a bool is 'true' or 'false', not '{value}'")
        return key, value == "true"
    if len(value) > 127:
        raise ValueError(f"'{key}': a str value is at most 127 characters")
    return key, value


def kv_override_arg(text: str) -> list[tuple[str, Any]]:
    """argparse type of --override-kv: comma-separated KEY=TYPE:VALUE items (quotes as in CSV)."""
    try:
        items = next(csv.reader([text], skipinitialspace=True), [])
        if not items or not any(i.strip() for i in items):
            raise ValueError("expected KEY=TYPE:VALUE[,...]")
        return [parse_kv_override(item) for item in items if item.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _kind(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    return "array"


def apply_kv_overrides(metadata: dict[str, Any], overrides: Mapping[str, Any], source: str) -> None:
    """Sets each overridden key; a key the file has must keep its kind (int, float, bool, str),
    as llama.cpp refuses an override of another type than the value it replaces. A key that begins
    with `{arch}.` names the file's architecture's key (the RoPE options give theirs so)."""
    arch = metadata.get("general.architecture")
    for key, value in overrides.items():
        if key.startswith("{arch}.") and isinstance(arch, str):
            key = arch + key[len("{arch}"):]
        if key in metadata and _kind(metadata[key]) != _kind(value):
            raise ModelFileError(f"{source}: --override-kv {key}: the file's value is a {_kind(metadata[key])}, "
                                 f"not a {_kind(value)}")
        metadata[key] = value


# general.file_type -> llama.cpp's name for it (llama_model_ftype_name), for the types pyllama reads
_FTYPE_NAMES = {0: "all F32", 1: "F16", 32: "BF16", 2: "Q4_0", 3: "Q4_1", 8: "Q5_0", 9: "Q5_1", 7: "Q8_0",
                10: "Q2_K - Medium", 21: "Q2_K - Small", 11: "Q3_K - Small", 12: "Q3_K - Medium",
                13: "Q3_K - Large", 14: "Q4_K - Small", 15: "Q4_K - Medium", 16: "Q5_K - Small",
                17: "Q5_K - Medium", 18: "Q6_K", 25: "IQ4_NL - 4.5 bpw", 30: "IQ4_XS - 4.25 bpw", 38: "MXFP4 MoE",
                19: "IQ2_XXS - 2.0625 bpw", 20: "IQ2_XS - 2.3125 bpw", 28: "IQ2_S - 2.5 bpw", 29: "IQ2_M - 2.7 bpw",
                22: "IQ3_XS - 3.3 bpw", 23: "IQ3_XXS - 3.0625 bpw", 24: "IQ1_S - 1.5625 bpw", 31: "IQ1_M - 1.75 bpw",
                26: "IQ3_S - 3.4375 bpw", 27: "IQ3_S mix - 3.66 bpw",
                36: "TQ1_0 - 1.69 bpw ternary", 37: "TQ2_0 - 2.06 bpw ternary"}


def file_type_name(file_type: Any) -> str:
    """llama.cpp's name of a GGUF's general.file_type ("Q4_K - Medium"), as llama-server reports it."""
    if isinstance(file_type, int) and not isinstance(file_type, bool) and file_type in _FTYPE_NAMES:
        return _FTYPE_NAMES[file_type]
    return "unknown, may not work"
