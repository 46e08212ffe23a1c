"""Slot files: what POST /slots/{id}?action=save writes and action=restore reads back.

A file holds a slot's cached tokens and, since version 2, their KV cache rows, so that a restore
puts the cache back without computing anything (as llama-server's state files do). Layout:

    PYLLAMA-SLOT-3\\n
    {"n_vocab": V, "model": NAME, "n_tokens": N, "kv": [[K type, K row bytes, V type, V row bytes], ...]}\\n
    N tokens (int32, little-endian)
    per layer: its N K rows, then its N V rows (the cache's own types, position 0 first)
    CRC-32 of every byte before it (uint32, little-endian)

The rows are only meaningful to a context of the same layout (layers, cache types, row sizes),
which a restore checks before it touches the slot; the checksum (since version 3) refuses a file
damaged or cut short after its save, which the layout checks alone would take as valid KV rows.
Version 2 files (no checksum) are still read as they are, and version 1 files (tokens only) too:
their KV is computed again.

A save writes a temporary file of its own in the same folder and renames it over the target, so
saves to one name at once each leave one whole file, the last renamed.
"""
from __future__ import annotations

import os
import secrets
import zlib
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import ujson

from .http import HTTPError

MAGIC_V1 = b"PYLLAMA-SLOT-1\n"
MAGIC_V2 = b"PYLLAMA-SLOT-2\n"
MAGIC = b"PYLLAMA-SLOT-3\n"
CHECKSUM_BYTES = 4

Layout = list[list]  # per layer [K type, K row bytes, V type, V row bytes]
Rows = list[tuple[np.ndarray, np.ndarray]]  # per layer (K rows, V rows), one row per token


@dataclass
class SlotFile:
    tokens: list[int]
    rows: Optional[Rows]  # None: a version 1 file, tokens only


def save(path: str, tokens: Sequence[int], rows: Rows, layout: Layout, n_vocab: int, model: str) -> int:
    """Writes a file at `path` (through a temporary file of this save's own, renamed over it);
    returns the bytes written. An OSError leaves no temporary file behind."""
    n = len(tokens)
    if len(rows) != len(layout):
        raise ValueError(f"{len(rows)} layers of rows for a layout of {len(layout)}")
    head = MAGIC + ujson.dumps({"n_vocab": n_vocab, "model": model, "n_tokens": n, "kv": layout}).encode() + b"\n"
    parts = [memoryview(head), memoryview(np.asarray(tokens, dtype="<i4").tobytes())]
    for k, v in rows:
        parts += [memoryview(np.ascontiguousarray(k[:n])), memoryview(np.ascontiguousarray(v[:n]))]
    crc = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
    parts.append(memoryview(crc.to_bytes(CHECKSUM_BYTES, "little")))
    folder, name = os.path.split(path)
    while True:  # a hidden name no other save uses: O_EXCL fails on a name taken
        tmp = os.path.join(folder, f".{name}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with open(fd, "wb") as f:
            for p in parts:
                f.write(p)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return sum(p.nbytes for p in parts)


def read(data: bytes, n_vocab: int, layout: Layout, filename: str) -> SlotFile:
    """The tokens (and rows) of a slot file; an HTTP 400 naming what is wrong for anything this
    server cannot restore. The rows are views of `data`."""
    bad = HTTPError(400, f"{filename} is not a slot file of this server")
    stop = len(data)
    if data.startswith(MAGIC):
        version, at = 3, len(MAGIC)
        if len(data) < at + CHECKSUM_BYTES or zlib.crc32(memoryview(data)[:-CHECKSUM_BYTES]) != int.from_bytes(
                data[-CHECKSUM_BYTES:], "little"):
            raise HTTPError(400, f"{filename} is not a slot file of this server: its checksum does not match "
                                 f"(damaged or cut short after it was saved)")
        stop = len(data) - CHECKSUM_BYTES
    elif data.startswith(MAGIC_V2):
        version, at = 2, len(MAGIC_V2)
    elif data.startswith(MAGIC_V1):
        version, at = 1, len(MAGIC_V1)
    else:
        raise bad
    end = data.find(b"\n", at, stop)
    if end < 0:
        raise bad
    try:
        header = ujson.loads(data[at:end])
    except ValueError:
        raise bad from None
    if not isinstance(header, dict) or not isinstance(header.get("n_tokens"), int) or header["n_tokens"] < 0:
        raise bad
    if header.get("n_vocab") != n_vocab:
        raise HTTPError(400, f"{filename} was saved with a model of {header.get('n_vocab')} tokens, not this one's "
                             f"{n_vocab}")
    n = header["n_tokens"]
    body = memoryview(data)[end + 1:stop]
    if version >= 2 and header.get("kv") != layout:
        raise HTTPError(400, f"{filename} holds the KV cache of another model or cache type "
                             f"({_describe(header.get('kv'))}; this server's is {_describe(layout)})")
    row_bytes = sum(kb + vb for _, kb, _, vb in layout) if version >= 2 else 0
    if len(body) != n * (4 + row_bytes):
        raise bad
    tokens = np.frombuffer(body, dtype="<i4", count=n)
    if n and (tokens.min() < 0 or tokens.max() >= n_vocab):
        raise bad
    if version == 1:
        return SlotFile(tokens.astype(np.int64).tolist(), None)
    rows: Rows = []
    if n == 0:
        return SlotFile([], [(np.empty((0, kb), np.uint8), np.empty((0, vb), np.uint8)) for _, kb, _, vb in layout])
    at = 4 * n
    for _, kb, _, vb in layout:
        k = np.frombuffer(body, dtype=np.uint8, count=n * kb, offset=at).reshape(n, kb)
        at += n * kb
        v = np.frombuffer(body, dtype=np.uint8, count=n * vb, offset=at).reshape(n, vb)
        at += n * vb
        rows.append((k, v))
    return SlotFile(tokens.astype(np.int64).tolist(), rows)


def _describe(layout) -> str:
    if not isinstance(layout, list) or not layout or not all(isinstance(x, list) and len(x) == 4 for x in layout):
        return "no readable layout"
    kinds = sorted({f"K {x[0]} ({x[1]} B rows), V {x[2]} ({x[3]} B rows)" for x in layout})
    return f"{len(layout)} layers, " + "; ".join(kinds)
