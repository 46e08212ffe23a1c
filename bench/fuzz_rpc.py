"""Fuzzing `pyllama.rpc_server`: its frame parser and every command handler (docs/rpc-protocol.md).

Hypothesis strategies build client byte streams of three kinds:

- raw streams from the first byte of a connection (HELLO gate, AUTH gate on a server with a token):
  frames of every command with random payloads, lying size fields, garbage, truncation;
- command cases after a valid HELLO (and AUTH): structured payloads per command (tensor
  descriptors with mutated buffer ids, offsets, dtypes, n_dims and shapes near 2^63 / 2^64 - 1,
  GET_TENSORS counts, ALLOC sizes, SET_TENSOR_HASH, COPY_TENSOR, BUFFER_CLEAR, GRAPH_RECOMPUTE
  uids, TRACE_SYNC, AUTH and HELLO again) and raw payloads;
- graph cases: well-formed graphs of every op (SAMPLE included) laid out at offsets inside one
  buffer, often overlapping each other, their inputs filled with valid indices, then mutated op
  codes, source counts and indices, parameters (NaN, inf, out-of-range integers), tensors and heads.

Each stream is sent in chunks of drawn sizes, then the client shuts its sending side, reads every
reply and expects the server to close. A reference model of the framing rules (`FrameModel`)
says how many replies must come and which must be refusals. After every case:

- the server still runs (process alive, or event loop and executor threads alive);
- every reply is a well-formed frame (status 0, 1 or 2; UTF-8 text on errors; a status-0 payload
  of the size its command defines), status 2 only after a one-way command, nothing after the last
  frame, and an early close has a warning in the server's log;
- nothing hangs: the close comes within a timeout and a fresh connection gets HELLO and
  DEVICE_COUNT answered;
- nothing stays allocated once the connection closed (and, in-process, no bound graph plan and no
  connection is left behind); the RSS of the server grows by a bounded amount over a whole run;
- nothing is written outside a buffer: guard buffers of another connection, allocated just before
  and just after the case's own buffers, keep their bytes;
- no handler fails with an unexpected exception (an ERROR line in the server's log).

Buffer ids are only known at run time, so a stream names the case's buffers with 8-byte
placeholders (`ph(SLOT_*)`); the runner sends frames one at a time, binding the placeholders to the
ids of successful ALLOC_BUFFER replies and the AUTH proof to the server's nonce, then sends the
rest in one go. A saved stream therefore replays exactly (tests/data/rpc_fuzz/, replayed by
tests/test_rpc_fuzz.py).

Then pressure cases, each against a child server of its own, sample that server's RSS (before,
peak, after) while a client tries to make it hold memory: a handshake flood (1000 sockets that never
authenticate: silent, HELLO only, half a header; with the default --max-connections and with one
above 1000), and under a small --mem a GET_TENSORS reply of 512 MiB, a MOE_FFN graph with some
600 MiB of kernel scratch over 8.8 MiB of buffers, and ~100 overlapping views of one quantized weight
(each a weight of its own to repack). Each must be refused (or, for the views, computed within the
cap) and the server must serve afterwards.

    python bench/fuzz_rpc.py --minutes N [--seed S] [--target process|thread] [--pressure NAME|all|none]

prints cases per fuzz target, frames sent per command, the status histogram, connections the server
closed early, and the server's RSS before and after, then each pressure case's figures; a failing
input is saved under bench/out/fuzz_rpc/ (the stream as raw bytes, plus a .txt describing it).
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import logging
import math
import os
import random
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import psutil
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import HealthCheck, Phase, Verbosity, given, seed as hseed, settings, strategies as st

from pyllama.backend.cpu import CPUBackend
from pyllama.models.build.ops import Op
from pyllama.rpc import auth
from pyllama.rpc import protocol as P
from pyllama.rpc.protocol import Cmd
from pyllama.rpc_server import ServerThread

from rpc_client import RawClient, StatusError, cmd_name  # noqa: E402
from pyllama.rpc_server import server as server_mod
from pyllama.rpc_server.cache import CACHE_MIN_BYTES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "bench", "out", "fuzz_rpc")
LOGGER = "pyllama.rpc_server"

TOKEN = b"0123456789abcdef0123456789abcdef"
MEM_LIMIT = 64 << 20          # small enough that ALLOC_BUFFER sizes around it are cheap to probe
MAX_FRAME = 4 << 20           # so that sizes around the frame limit are cheap to probe too
RX_SIZE = server_mod._RX_SIZE  # payloads above it take the staged path of the parser
HELLO_MAX = server_mod._HELLO_MAX
CASE_TIMEOUT = 5.0
GUARD_SIZE = 4096
RSS_GROWTH_LIMIT = 256 << 20
MAX_DRAWN_PIECES = 400  # pieces of a stream sent in the drawn chunk sizes (then 4 KiB ones)
MAX_PAUSES = 16         # pauses between the first pieces, when a case asks for them

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
KNOWN = frozenset(int(c) for c in Cmd)
REPLYING = frozenset(int(c) for c in Cmd if c not in P.ONE_WAY)
ONE_WAY = frozenset(int(c) for c in P.ONE_WAY)

# --- placeholders -------------------------------------------------------------------------------------------
# 8-byte values no real buffer id reaches (ids count up from 1); the runner substitutes them
SLOT_TARGET, SLOT_AUX, SLOT_FREED, SLOT_FOREIGN = 1, 2, 3, 4
BIND_ORDER = (SLOT_TARGET, SLOT_AUX, SLOT_FREED)  # successive ALLOC_BUFFER replies bind these
PH_BASE = 0xF0CCFA1100000000


def ph(slot: int) -> int:
    return PH_BASE | slot


PH_BYTES = {slot: struct.pack("<Q", ph(slot)) for slot in (SLOT_TARGET, SLOT_AUX, SLOT_FREED, SLOT_FOREIGN)}
PROOF_PH = b"\xa5fuzz-rpc client proof goes here"
assert len(PROOF_PH) == auth.PROOF

# a cache file the SET_TENSOR_HASH cases can hit
KNOWN_BLOB = bytes(range(64))
KNOWN_DIGEST = hashlib.sha256(KNOWN_BLOB).digest()
GUARD_BYTES = (np.random.default_rng(7).integers(0, 256, GUARD_SIZE, np.uint8).tobytes(),
               np.random.default_rng(8).integers(0, 256, GUARD_SIZE, np.uint8).tobytes())

TENSOR_STRUCT = struct.Struct("<QQII4Q48s")
NODE_STRUCT = struct.Struct("<III10I12d")
assert TENSOR_STRUCT.size == P.TENSOR.itemsize and NODE_STRUCT.size == P.NODE.itemsize


def frame(cmd: int, payload: bytes = b"") -> bytes:
    return P.HEADER.pack(cmd, len(payload)) + payload


def hello_frame() -> bytes:
    return frame(Cmd.HELLO, P.HELLO_REQ.pack(*P.VERSION, 0))


def split_frames(stream: bytes) -> tuple[list[tuple[int, bytes]], bytes]:
    """The complete frames of a stream and what trails them."""
    out, pos = [], 0
    while len(stream) - pos >= P.HEADER.size:
        cmd, size = P.HEADER.unpack_from(stream, pos)
        if len(stream) - pos - P.HEADER.size < size:
            break
        out.append((cmd, stream[pos + P.HEADER.size:pos + P.HEADER.size + size]))
        pos += P.HEADER.size + size
    return out, stream[pos:]


def describe_stream(stream: bytes, limit: int = 40) -> str:
    frames, rest = split_frames(stream)
    lines = [f"{cmd_name(c)} ({len(p)} B): {p[:64].hex()}{'...' if len(p) > 64 else ''}" for c, p in frames[:limit]]
    if len(frames) > limit:
        lines.append(f"... {len(frames) - limit} more frames")
    if rest:
        lines.append(f"trailing {len(rest)} B: {rest[:64].hex()}")
    return "\n".join(lines)


# --- the reference model of the framing rules -----------------------------------------------------------------

@dataclass
class Expect:
    """A reply the server owes, and what the spec says about it."""
    cmd: int
    payload: bytes
    must_fail: bool = False        # only a refusal is right (HELLO or AUTH again, handshake errors)
    status_one: bool = False       # a handshake refusal: status 1 exactly
    earlier_ok: bool = False       # status 2 is allowed: a one-way command came since the last reply
    preceded: tuple = ()           # the one-way commands since the last reply (statistics)


class FrameModel:
    """Which frames of a stream get replies and where the server must close, per the spec's framing,
    HELLO and AUTH rules. Fed incrementally; `closed` names the rule that closed the connection."""

    def __init__(self, token: bool, max_frame: int, proof_ok: Callable[[bytes], bool] = lambda b: False):
        self.hello = False
        self.authed = not token
        self.begun = False
        self.max_frame = max_frame
        self.proof_ok = proof_ok
        self.closed: Optional[str] = None
        self.one_way: list[int] = []
        self.buf = b""
        self.frames: list[int] = []

    def run(self, data: bytes) -> list[Expect]:
        self.buf += data
        buf, pos, out = self.buf, 0, []
        hs = P.HEADER.size
        while self.closed is None and len(buf) - pos >= hs:
            cmd, size = P.HEADER.unpack_from(buf, pos)
            if size > self.max_frame:
                self.closed = "frame limit"
                break
            if not self.hello and (cmd != Cmd.HELLO or size > HELLO_MAX):
                self.closed = "first frame not a HELLO"
                break
            if cmd not in KNOWN:
                self.closed = "unknown command"
                break
            if self.hello and not self.authed and (cmd != Cmd.AUTH or size > HELLO_MAX):
                out.append(Expect(cmd, b"", must_fail=True, status_one=True))
                self.closed = "not authenticated"
                break
            if len(buf) - pos - hs < size:
                break
            payload = buf[pos + hs:pos + hs + size]
            pos += hs + size
            self.frames.append(cmd)
            if not self.hello:
                if len(payload) != P.HELLO_REQ.size or payload[0] != P.VERSION[0]:
                    out.append(Expect(cmd, payload, must_fail=True, status_one=True))
                    self.closed = "bad HELLO"
                    break
                self.hello = True
                out.append(Expect(cmd, payload))
                continue
            if not self.authed:
                step, body = (payload[0] if payload else 0), payload[1:]
                if step == auth.STEP_BEGIN and len(body) == auth.NONCE and not self.begun:
                    self.begun = True
                    out.append(Expect(cmd, payload))
                    continue
                if step == auth.STEP_PROVE and len(body) == auth.PROOF and self.begun and self.proof_ok(body):
                    self.authed = True
                    out.append(Expect(cmd, payload))
                    continue
                out.append(Expect(cmd, payload, must_fail=True, status_one=True))
                self.closed = "authentication refused"
                break
            if cmd in ONE_WAY:
                self.one_way.append(cmd)
                continue
            out.append(Expect(cmd, payload, must_fail=cmd in (Cmd.HELLO, Cmd.AUTH), earlier_ok=bool(self.one_way),
                              preceded=tuple(self.one_way)))
            self.one_way = []
        self.buf = buf[pos:] if self.closed is None else b""
        return out


def ok_size(cmd: int, payload: bytes) -> Optional[int]:
    """The payload size of a status-0 reply to `cmd` with this request payload (None: not known)."""
    fixed = {Cmd.HELLO: P.HELLO_REP.size, Cmd.DEVICE_COUNT: 4, Cmd.GET_DEVICE_INFO: P.DEVICE_INFO.size,
             Cmd.ALLOC_BUFFER: P.ALLOC_REP.size, Cmd.FREE_BUFFER: 0, Cmd.BUFFER_CLEAR: 0,
             Cmd.SET_TENSOR_HASH: 1, Cmd.COPY_TENSOR: 0, Cmd.SYNCHRONIZE: 0, Cmd.TRACE_SYNC: P.TRACE_REP.size,
             Cmd.SESSION_KEY: P.SESSION_KEY_SIZE, Cmd.BIND_SESSION: 0}
    if cmd in fixed:
        return fixed[Cmd(cmd)]
    if cmd == Cmd.GET_TENSOR:
        return P.U64.unpack_from(payload, 112)[0] if len(payload) == 120 else None
    if cmd == Cmd.GET_TENSORS:
        if len(payload) < 4:
            return None
        n = P.U32.unpack_from(payload)[0]
        if len(payload) != 4 + 120 * n:
            return None
        return sum(P.U64.unpack_from(payload, 4 + 120 * i + 112)[0] for i in range(n))
    if cmd == Cmd.AUTH:
        # the client proves first: step 1 gets the server's nonce, step 2 the server's proof
        return auth.NONCE if payload[:1] == bytes([auth.STEP_BEGIN]) else auth.PROOF
    return None


def check_reply(exp: Expect, status: int, payload: bytes) -> Optional[str]:
    """What is wrong with this reply to `exp`, or None."""
    name = cmd_name(exp.cmd)
    if status not in (P.STATUS_OK, P.STATUS_ERROR, P.STATUS_EARLIER_ERROR):
        return f"{name}: reply status {status}"
    if status != P.STATUS_OK:
        try:
            payload.decode("utf-8")
        except UnicodeDecodeError:
            return f"{name}: error message is not UTF-8: {payload[:80]!r}"
        if not payload:
            return f"{name}: error reply without a message"
        if status == P.STATUS_EARLIER_ERROR and not exp.earlier_ok:
            return f"{name}: status 2 without a one-way command before it: {payload[:200]!r}"
        if exp.status_one and status != P.STATUS_ERROR:
            return f"{name}: handshake refusal with status {status}"
        return None
    if exp.must_fail:
        return f"{name}: accepted, the spec says it is refused"
    want = ok_size(exp.cmd, exp.payload)
    if want is not None and len(payload) != want:
        return f"{name}: status 0 with {len(payload)} payload bytes, expected {want}"
    if exp.cmd == Cmd.DEVICE_COUNT and payload != P.U32.pack(1):
        return f"DEVICE_COUNT: {payload!r}"
    if exp.cmd == Cmd.ALLOC_BUFFER:
        bid, size = P.ALLOC_REP.unpack(payload)
        if bid == 0 or size != P.ALLOC_REQ.unpack(exp.payload)[2]:
            return f"ALLOC_BUFFER: reply id {bid} size {size} for {P.ALLOC_REQ.unpack(exp.payload)}"
    if exp.cmd == Cmd.SET_TENSOR_HASH and payload not in (b"\0", b"\1"):
        return f"SET_TENSOR_HASH: found byte {payload!r}"
    if exp.cmd == Cmd.GET_DEVICE_INFO:
        free, total = P.DEVICE_INFO.unpack(payload)[3:]
        if free > total:
            return f"GET_DEVICE_INFO: free {free} > total {total}"
    return None


def parse_replies(data: bytes) -> tuple[list[tuple[int, bytes]], bytes]:
    return split_frames(data)


# --- strategies ----------------------------------------------------------------------------------------------

QS = {int(t): GGML_QUANT_SIZES[GGMLQuantizationType(int(t))] for t in (0, 1, 26, 30, 2, 8, 12, 13, 14)}
DTYPES = sorted(QS)
F32, F16, I32 = 0, 1, 26
BAD_DTYPES = [3, 4, 5, 6, 7, 9, 10, 11, 15, 24, 25, 27, 28, 29, 31, 39, 63, 64, 255, 2**31, U32_MAX]
U64_EDGES = [0, 1, 2, 3, 4, 63, 64, 65, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**53 + 1, 2**62, 2**63 - 1,
             2**63, 2**63 + 1, 2**64 - 8, 2**64 - 2, U64_MAX]
U32_EDGES = [0, 1, 2, 3, 4, 5, 9, 10, 11, 12, 2**16, 2**16 + 1, 2**31 - 1, 2**31, U32_MAX - 1, U32_MAX]
PARAM_EDGES = [math.nan, -math.nan, math.inf, -math.inf, 1e308, -1e308, -0.0, 0.5, -1.0, 1.5, 2.0**31,
               -2.0**31 - 1, 2.0**53 + 1, 4096.0, 4097.0, 2.0**20, 2.0**20 + 1, 65537.0, 1e-300, 5e-324, 3.0]
F32_EDGES = [0.0, -0.0, 1.0, -1.0, 0.5, 0.999, 1.0000001, 2.0, 1e-45, 1e-30, 1e30, 3.4e38, math.inf, -math.inf,
             math.nan]
I32_EDGES = [0, 1, -1, 2, 3, 40, 512, 513, 4096, 2**31 - 1, -2**31]
mut_count = st.sampled_from([0, 0, 0, 0, 1, 1, 2, 3])

u64s = st.one_of(st.sampled_from(U64_EDGES), st.integers(0, U64_MAX))
u32s = st.one_of(st.sampled_from(U32_EDGES), st.integers(0, U32_MAX))
# ids no connection holds: far above any id a server hands out, or the edges of the range
stray_ids = st.one_of(st.sampled_from([0, 2**63, U64_MAX]), st.integers(2**40, U64_MAX))
buffer_refs = st.one_of(st.sampled_from([ph(SLOT_TARGET)] * 5 + [ph(SLOT_AUX), ph(SLOT_FREED), ph(SLOT_FOREIGN)]),
                        stray_ids)


def rare(draw, n: int) -> bool:
    """True about once in n draws. Hypothesis favours the ends of an integer range (0 above all),
    so the event is a value in the middle of it."""
    return draw(st.integers(0, n - 1)) == n // 2 + 1 if n > 2 else draw(st.booleans())


def f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def seeded_bytes(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


@dataclass
class Ctx:
    """What a case's generators know about its setup."""
    target_size: int
    token: bool


@dataclass
class TRec:
    """A wire tensor record, every field free."""
    buf: int
    offset: int
    dtype: int
    n_dims: int
    shape: list
    name: bytes = b"t"

    def pack(self) -> bytes:
        return TENSOR_STRUCT.pack(self.buf, self.offset, self.dtype, self.n_dims, *self.shape, self.name)

    def copy(self) -> "TRec":
        return TRec(self.buf, self.offset, self.dtype, self.n_dims, list(self.shape), self.name)

    @property
    def nbytes(self) -> int:
        block, size = QS.get(self.dtype, (1, 1))
        n = 1
        for d in self.shape[:self.n_dims]:
            n *= d
        return n // block * size


def offset_in(draw, size: int, nbytes: int, grid: int = 4) -> int:
    """An offset at which `nbytes` fit in `size` bytes (0 when they do not)."""
    if nbytes > size:
        return 0
    top = (size - nbytes) // grid
    return grid * draw(st.one_of(st.integers(0, top), st.sampled_from([0, top])))


def draw_shape(draw, dtype: int) -> list:
    block = QS[dtype][0]
    nd = draw(st.integers(1, 4))
    dims = [draw(st.integers(0, 4)) for _ in range(nd - 1)] + [block * draw(st.integers(0, 3 if block == 1 else 1))]
    return dims


def new_rec(draw, ctx: Ctx, dtype: Optional[int] = None, shape: Optional[list] = None, grid: int = 4) -> TRec:
    if dtype is None:
        dtype = draw(st.sampled_from(DTYPES + [F32, F32, I32]))
    if shape is None:
        shape = draw_shape(draw, dtype)
    rec = TRec(ph(SLOT_TARGET), 0, dtype, len(shape), list(shape) + [0] * (4 - len(shape)))
    rec.offset = offset_in(draw, ctx.target_size, rec.nbytes, grid)
    return rec


def mutate_rec(draw, rec: TRec, n: Optional[int] = None) -> TRec:
    """Mutations of a tensor record toward the edges the validation must catch."""
    for _ in range(draw(mut_count) if n is None else n):
        kind = draw(st.sampled_from(["buf", "offset", "offset_edge", "dtype", "n_dims", "shape", "unused", "name"]))
        if kind == "buf":
            rec.buf = draw(buffer_refs)
        elif kind == "offset":
            rec.offset = draw(u64s)
        elif kind == "offset_edge":  # just past the end, or so that offset + size (just) wraps
            n = rec.nbytes
            edges = [rec.offset + 1, rec.offset + 4096, 4097, 2**63]
            if n <= U64_MAX:
                edges += [U64_MAX - n + 1, U64_MAX - n]
            rec.offset = draw(st.sampled_from(edges)) % 2**64
        elif kind == "dtype":
            rec.dtype = draw(st.one_of(st.sampled_from(BAD_DTYPES), st.sampled_from(DTYPES)))
        elif kind == "n_dims":
            rec.n_dims = draw(st.sampled_from([0, 5, 8, U32_MAX, max(1, rec.n_dims - 1), min(4, rec.n_dims + 1)]))
        elif kind == "shape":
            k = draw(st.integers(0, 3))
            rec.shape[k] = draw(st.one_of(u64s, st.integers(0, 70)))
        elif kind == "unused" and rec.n_dims < 4:
            rec.shape[draw(st.integers(rec.n_dims, 3))] = draw(st.sampled_from([1, 2**63, U64_MAX]))
        elif kind == "name":
            rec.name = draw(st.sampled_from([b"\xff" * 48, b"\xe2\x82" + b"a" * 46, b"x" * 48, b"", "é".encode() * 24]))
    return rec


def maybe_bytes_mutation(draw, payload: bytes, keep: int = 6) -> bytes:
    """Occasionally flips bytes, truncates or extends a payload (`keep` in keep + 3 left whole)."""
    kind = draw(st.sampled_from(["none"] * keep + ["flip", "truncate", "extend"]))
    if kind == "none" or (kind in ("flip", "truncate") and not payload):
        return payload
    if kind == "flip":
        b = bytearray(payload)
        for _ in range(draw(st.integers(1, 4))):
            b[draw(st.integers(0, len(b) - 1))] = draw(st.integers(0, 255))
        return bytes(b)
    if kind == "truncate":
        return payload[:draw(st.integers(0, len(payload) - 1))]
    return payload + draw(st.binary(min_size=1, max_size=16))


# per-command builders: each returns frames (whole, header included)

def b_device_count(draw, ctx: Ctx) -> bytes:
    return frame(Cmd.DEVICE_COUNT, draw(st.sampled_from([b"", b"", b"x", b"\0" * 4])))


def b_device_info(draw, ctx: Ctx) -> bytes:
    return frame(Cmd.GET_DEVICE_INFO, maybe_bytes_mutation(draw, P.U32.pack(draw(st.one_of(st.just(0), u32s)))))


def b_alloc(draw, ctx: Ctx) -> bytes:
    size = draw(st.one_of(st.sampled_from([0, 1, 7, 64, 4096, 4097, MEM_LIMIT - 1, MEM_LIMIT, MEM_LIMIT + 1,
                                           2**32, 2**63, U64_MAX]), st.integers(0, 1 << 16), u64s))
    usage = draw(st.one_of(st.sampled_from([0, 1, 2]), u32s))
    device = draw(st.one_of(st.just(0), u32s))
    return frame(Cmd.ALLOC_BUFFER, maybe_bytes_mutation(draw, P.ALLOC_REQ.pack(device, usage, size)))


def b_free(draw, ctx: Ctx) -> bytes:
    return frame(Cmd.FREE_BUFFER, maybe_bytes_mutation(draw, P.U64.pack(draw(buffer_refs))))


def b_clear(draw, ctx: Ctx) -> bytes:
    return frame(Cmd.BUFFER_CLEAR, maybe_bytes_mutation(draw, P.U64.pack(draw(buffer_refs))
                                                        + bytes([draw(st.integers(0, 255))])))


def region(draw, rec: TRec) -> tuple[int, int]:
    n = min(rec.nbytes, U64_MAX)  # a mutated shape may describe more bytes than a u64 holds
    kind = draw(st.sampled_from(["inside", "inside", "whole", "edge", "wild"]))
    if kind == "whole":
        return 0, n
    if kind == "inside":
        off = draw(st.integers(0, n)) if n else 0
        return off, draw(st.integers(0, n - off)) if n - off else 0
    if kind == "edge":
        off, size = draw(st.sampled_from([(n, 0), (n, 1), (0, n + 1), (1, n), (U64_MAX, 1), (1, U64_MAX),
                                          (U64_MAX, U64_MAX), (2**63, 2**63)]))
        return off % 2**64, size % 2**64
    return draw(u64s), draw(u64s)


def b_set_tensor(draw, ctx: Ctx) -> bytes:
    rec = mutate_rec(draw, new_rec(draw, ctx))
    off, size = region(draw, rec)
    if size > 1 << 16:  # the payload carries the bytes: keep them small unless the staged path is wanted
        size = draw(st.sampled_from([0, 1, 64]))
    if rare(draw, 31):  # larger than the receive buffer: the staged path of the parser
        size = draw(st.sampled_from([RX_SIZE - 112 - 9, RX_SIZE, RX_SIZE + 1, 300_000]))
    data = seeded_bytes(draw(st.integers(0, 2**16)), size)
    return frame(Cmd.SET_TENSOR, maybe_bytes_mutation(draw, rec.pack() + P.U64.pack(off) + data))


def b_get_tensor(draw, ctx: Ctx) -> bytes:
    rec = mutate_rec(draw, new_rec(draw, ctx))
    off, size = region(draw, rec)
    return frame(Cmd.GET_TENSOR, maybe_bytes_mutation(draw, rec.pack() + P.REGION.pack(off, size)))


def b_set_tensor_hash(draw, ctx: Ctx) -> bytes:
    rec = mutate_rec(draw, new_rec(draw, ctx, F32, [16]))
    off, size = (0, 64) if draw(st.booleans()) else region(draw, rec)
    digest = draw(st.one_of(st.just(KNOWN_DIGEST), st.binary(min_size=32, max_size=32)))
    return frame(Cmd.SET_TENSOR_HASH, maybe_bytes_mutation(draw, rec.pack() + P.REGION.pack(off, size) + digest))


def b_get_tensors(draw, ctx: Ctx) -> bytes:
    n = draw(st.integers(0, 4))
    entries = []
    for _ in range(n):
        rec = mutate_rec(draw, new_rec(draw, ctx))
        off, size = region(draw, rec)
        entries.append(rec.pack() + P.REGION.pack(off, size))
    count = draw(st.one_of(st.just(n), st.just(n), st.sampled_from([n + 1, max(0, n - 1), 65536, 65537, U32_MAX])))
    return frame(Cmd.GET_TENSORS, maybe_bytes_mutation(draw, P.U32.pack(count) + b"".join(entries)))


def b_copy(draw, ctx: Ctx) -> bytes:
    a = new_rec(draw, ctx)
    b = mutate_rec(draw, new_rec(draw, ctx, a.dtype) if draw(st.booleans()) else new_rec(draw, ctx))
    a = mutate_rec(draw, a)
    if draw(st.booleans()):
        b.buf = ph(SLOT_AUX) if draw(st.booleans()) else b.buf
    return frame(Cmd.COPY_TENSOR, maybe_bytes_mutation(draw, a.pack() + b.pack()))


def b_recompute(draw, ctx: Ctx) -> bytes:
    uid = draw(st.one_of(st.sampled_from([1, 2, 3]), u64s))
    device = draw(st.one_of(st.just(0), u32s))
    return frame(Cmd.GRAPH_RECOMPUTE, maybe_bytes_mutation(draw, P.RECOMPUTE.pack(device, 0, uid)))


def b_sync(draw, ctx: Ctx) -> bytes:
    return frame(Cmd.SYNCHRONIZE, maybe_bytes_mutation(draw, P.U32.pack(draw(st.one_of(st.just(0), u32s)))))


def b_trace_sync(draw, ctx: Ctx) -> bytes:
    return frame(Cmd.TRACE_SYNC, maybe_bytes_mutation(draw, P.U64.pack(draw(u64s))))


def b_session_key(draw, ctx: Ctx) -> bytes:
    return frame(Cmd.SESSION_KEY, draw(st.one_of(st.just(b""), st.binary(max_size=20))))


def b_bind_session(draw, ctx: Ctx) -> bytes:
    """A key no session has (or a payload of the wrong size): refused, the connection stays."""
    return frame(Cmd.BIND_SESSION, draw(st.one_of(st.binary(min_size=P.SESSION_KEY_SIZE, max_size=P.SESSION_KEY_SIZE),
                                                  st.binary(max_size=40))))


def b_auth(draw, ctx: Ctx) -> bytes:
    step = draw(st.sampled_from([0, 1, 2, 3, 255]))
    body = draw(st.one_of(st.binary(min_size=32, max_size=32), st.binary(max_size=40), st.just(PROOF_PH)))
    return frame(Cmd.AUTH, bytes([step]) + body)


def b_hello(draw, ctx: Ctx) -> bytes:
    return frame(Cmd.HELLO, draw(st.one_of(st.just(P.HELLO_REQ.pack(*P.VERSION, 0)), st.binary(max_size=8))))


def b_raw(draw, ctx: Ctx) -> bytes:
    """Any command code (unknown ones close the connection) with a raw payload near its size."""
    code = draw(st.one_of(st.sampled_from(sorted(KNOWN)), st.sampled_from([len(Cmd), len(Cmd) + 1, 99, 128, 255])))
    if code not in KNOWN and draw(st.integers(0, 3)):
        code = draw(st.sampled_from(sorted(KNOWN)))
    size = draw(st.one_of(st.sampled_from([0, 1, 4, 8, 9, 12, 16, 24, 33, 104, 112, 120, 124, 208, 244, 248]),
                          st.integers(0, 400)))
    return frame(code, draw(st.binary(min_size=size, max_size=size)))


def b_graph(draw, ctx: Ctx) -> bytes:
    return graph_frames(draw, ctx)


CACHE_BLOBS = 4  # distinct 1 MiB contents, so a long run leaves at most this many cache files


def b_cache_round_trip(draw, ctx: Ctx) -> bytes:
    """A SET_TENSOR big enough for the weight cache to store, then SET_TENSOR_HASH of its bytes
    (found or not, depending on whether the cache writer has finished), on a region near it."""
    n = min(ctx.target_size, CACHE_MIN_BYTES) // 4
    if n * 4 < CACHE_MIN_BYTES:
        return b_set_tensor_hash(draw, ctx)
    data = seeded_bytes(draw(st.integers(0, CACHE_BLOBS - 1)), 4 * n)
    rec = TRec(ph(SLOT_TARGET), 0, F32, 1, [n, 0, 0, 0], b"weights")
    out = frame(Cmd.SET_TENSOR, rec.pack() + P.U64.pack(0) + data) + frame(Cmd.SYNCHRONIZE, P.U32.pack(0))
    probe = mutate_rec(draw, rec.copy())
    off, size = (0, 4 * n) if draw(st.booleans()) else region(draw, probe)
    return out + frame(Cmd.SET_TENSOR_HASH, probe.pack() + P.REGION.pack(off, size) + hashlib.sha256(data).digest())


BUILDERS: dict[str, Callable] = {
    "DEVICE_COUNT": b_device_count, "GET_DEVICE_INFO": b_device_info, "ALLOC_BUFFER": b_alloc,
    "FREE_BUFFER": b_free, "BUFFER_CLEAR": b_clear, "SET_TENSOR": b_set_tensor, "SET_TENSOR_HASH": b_set_tensor_hash,
    "GET_TENSOR": b_get_tensor, "GET_TENSORS": b_get_tensors, "COPY_TENSOR": b_copy, "GRAPH_COMPUTE": b_graph,
    "GRAPH_RECOMPUTE": b_recompute, "SYNCHRONIZE": b_sync, "TRACE_SYNC": b_trace_sync, "AUTH": b_auth,
    "SESSION_KEY": b_session_key, "BIND_SESSION": b_bind_session,
    "HELLO": b_hello, "RAW": b_raw, "CACHE_ROUND_TRIP": b_cache_round_trip,
}


# --- graphs ----------------------------------------------------------------------------------------------------

@dataclass
class GNode:
    op: int
    out: int
    srcs: list
    params: list
    n_used: int = 0                 # parameters the op uses (the rest must be 0)
    n_src: Optional[int] = None     # when mutated away from len(srcs)
    src_raw: Optional[list] = None  # all 10 entries, when mutated

    def pack(self) -> bytes:
        src = self.src_raw if self.src_raw is not None else self.srcs + [P.NO_SRC] * (P.MAX_SRC - len(self.srcs))
        n = len(self.srcs) if self.n_src is None else self.n_src
        return NODE_STRUCT.pack(self.op, self.out, n, *src, *(list(self.params) + [0.0] * (12 - len(self.params))))


class GraphBuilder:
    """Tensors laid out in the case's target buffer (on a coarse grid, so they often overlap),
    nodes, and the SET_TENSOR frames that fill the inputs: values first, then indices, so that the
    indices are valid when the graph starts even where tensors overlap."""

    def __init__(self, draw, ctx: Ctx):
        self.draw, self.ctx = draw, ctx
        self.recs: list[TRec] = []
        self.nodes: list[GNode] = []
        self.fill_values: list[bytes] = []
        self.fill_indices: list[bytes] = []
        self.outputs: list[int] = []
        self.grid = draw(st.sampled_from([4, 16, 64]))

    def tensor(self, dtype: int, shape: list, fill: Optional[bytes] = None, index: bool = False) -> int:
        rec = new_rec(self.draw, self.ctx, dtype, shape, self.grid)
        self.recs.append(rec)
        if fill is not None and rec.nbytes:
            frame_ = frame(Cmd.SET_TENSOR, rec.pack() + P.U64.pack(0) + fill[:rec.nbytes])
            (self.fill_indices if index else self.fill_values).append(frame_)
        return len(self.recs) - 1

    def values(self, n: int) -> bytes:
        """n float32 values: normal, seeded raw bits, or edge values."""
        draw = self.draw
        kind = draw(st.sampled_from(["normal", "normal", "bits", "edges", "zeros"]))
        if kind == "zeros":
            return b"\0" * 4 * n
        seed = draw(st.integers(0, 2**16))
        if kind == "normal":
            return (np.random.default_rng(seed).standard_normal(n) * 3).astype(np.float32).tobytes()
        if kind == "bits":
            return seeded_bytes(seed, 4 * n)
        rng = random.Random(seed)
        return np.array([rng.choice(F32_EDGES) for _ in range(n)], np.float32).tobytes()

    def ints(self, values: list) -> bytes:
        """Valid indices, sometimes one of them pushed out of range."""
        values = list(values)
        if values and rare(self.draw, 6):
            values[self.draw(st.integers(0, len(values) - 1))] = self.draw(st.sampled_from(I32_EDGES + [-2, 4, 5]))
        return np.array(values, np.int64).astype(np.int32).tobytes()

    def node(self, op: int, out: int, srcs: list, params: list) -> None:
        self.nodes.append(GNode(op, out, srcs, params, len(params)))
        self.outputs.append(out)

    # one well-formed node per op, with shapes the kernels accept
    def get_rows(self) -> None:
        d = self.draw
        rows, dim, m = d(st.integers(1, 4)), d(st.integers(1, 8)), d(st.integers(0, 4))
        table = self.tensor(F32, [rows, dim], self.values(rows * dim))
        ids = self.tensor(I32, [m], self.ints([d(st.integers(0, rows - 1)) for _ in range(m)]), index=True)
        self.node(Op.GET_ROWS, self.tensor(F32, [m, dim]), [table, ids], [])

    def rms_norm(self) -> None:
        d = self.draw
        n, dim = d(st.integers(0, 3)), d(st.integers(1, 16))
        x = self.tensor(F32, [n, dim], self.values(n * dim))
        w = self.tensor(F32, [dim], self.values(dim))
        self.node(Op.RMS_NORM, self.tensor(F32, [n, dim]), [x, w], [d(st.sampled_from([1e-5, 1e-6, 0.0, 1.0]))])

    def mul_mat(self) -> None:
        d = self.draw
        n, k, m = d(st.sampled_from([0, 1, 2, 3, 5, 33])), d(st.integers(1, 8)), d(st.integers(1, 9))
        x = self.tensor(F32, [n, k], self.values(n * k))
        w = self.tensor(F32, [m, k], self.values(m * k))
        srcs = [x, w] + ([self.tensor(F32, [m], self.values(m))] if d(st.booleans()) else [])
        self.node(Op.MUL_MAT, self.tensor(F32, [n, m]), srcs, [])

    def add(self) -> None:
        d = self.draw
        shape = [d(st.integers(0, 4)) for _ in range(d(st.integers(1, 2)))]
        n = math.prod(shape)
        a, b = self.tensor(F32, shape, self.values(n)), self.tensor(F32, shape, self.values(n))
        self.node(Op.ADD, self.tensor(F32, shape), [a, b], [])

    def glu(self) -> None:
        d = self.draw
        n, f = d(st.integers(0, 3)), d(st.integers(1, 8))
        gu = self.tensor(F32, [n, 2 * f], self.values(2 * n * f))
        self.node(d(st.sampled_from([Op.SWIGLU, Op.SWIGLU, Op.GEGLU])), self.tensor(F32, [n, f]), [gu], [])

    def attention(self) -> None:
        d = self.draw
        hkv = d(st.sampled_from([1, 2]))
        h = hkv * d(st.sampled_from([1, 2]))
        hd = d(st.sampled_from([2, 4, 8]))
        n_rot = d(st.sampled_from([0, 2, hd]))
        n, cells, listed = d(st.integers(0, 3)), d(st.integers(1, 4)), d(st.integers(1, 4))
        width = (h + 2 * hkv) * hd
        qkv = self.tensor(F32, [n, width], self.values(n * width))
        kc = self.tensor(F32, [cells, hkv * hd], self.values(cells * hkv * hd))
        vc = self.tensor(F32, [cells, hkv * hd], self.values(cells * hkv * hd))
        pos = self.tensor(I32, [n], self.ints([d(st.integers(0, 100)) for _ in range(n)]), index=True)
        kv_idx = self.tensor(I32, [n], self.ints([d(st.integers(0, cells - 1)) for _ in range(n)]), index=True)
        cell_list = self.tensor(I32, [listed], self.ints([d(st.integers(0, cells - 1)) for _ in range(listed)]),
                                index=True)
        ranges = []
        for _ in range(n):
            r0 = d(st.integers(0, listed - 1))
            ranges += [r0, d(st.integers(1, listed - r0))]
        rng_t = self.tensor(I32, [n, 2], self.ints(ranges), index=True)
        srcs = [qkv, kc, vc, pos, kv_idx, cell_list, rng_t]
        if d(st.booleans()):
            srcs += [self.tensor(F32, [hd], self.values(hd)), self.tensor(F32, [hd], self.values(hd))]
        params = [h, hkv, hd, n_rot, d(st.sampled_from([0, 2])), 10000.0, 1.0, 1e-6, 1.0 / math.sqrt(hd)]
        self.node(Op.ATTENTION, self.tensor(F32, [n, h * hd]), srcs, params)

    def sample(self) -> None:
        d = self.draw
        rows, vocab = d(st.integers(1, 2)), d(st.sampled_from([1, 2, 5, 16, 40]))
        n_probs, window = d(st.integers(0, 3)), d(st.integers(0, 4))
        logits = self.tensor(F32, [rows, vocab], self.values(rows * vocab))
        packed = []
        for _ in range(rows):
            fl = [d(st.sampled_from([0.0, 0.7, 1.0, 1.5, -1.0, 1e-45, 1e30, math.inf, math.nan])),   # temperature
                  d(st.sampled_from([1.0, 0.9, 0.0, 0.5, -1.0, 2.0, math.nan])),                       # top_p
                  d(st.sampled_from([0.0, 0.05, 1.0, 2.0, -1.0, math.nan])),                           # min_p
                  d(st.sampled_from([1.0, 1.1, 0.0, -1.0, math.inf, math.nan])),                       # repeat
                  d(st.sampled_from([0.0, 0.5, -2.0, math.inf, math.nan])),                            # frequency
                  d(st.sampled_from([0.0, 0.5, -2.0, math.inf, math.nan])),                            # presence
                  d(st.sampled_from([0.0, 0.5, 0.999, 1.0, 2.0, -1.0, math.inf, math.nan])),           # draw
                  0.0]
            ints = [d(st.sampled_from([0, 1, 2, 40, vocab, vocab + 1, 512, 513, -1, 2**31 - 1, -2**31])),  # top_k
                    d(st.sampled_from([n_probs + 1, -1, 2**31 - 1])) if rare(d, 8) else d(st.integers(0, n_probs)),
                    d(st.sampled_from([window + 1, -1, 2**31 - 1])) if rare(d, 8) else d(st.integers(0, window)),
                    0]
            pen = [d(st.sampled_from([0, 1, vocab - 1, vocab, -1, 2**31 - 1])) for _ in range(window)]
            packed += [f32_bits(x) for x in fl] + ints + pen
        sampling = self.tensor(I32, [rows, 12 + window], np.array(packed, np.int64).astype(np.int32).tobytes(),
                               index=True)
        out = self.tensor(I32, [rows, 2 + 2 * n_probs])
        self.node(Op.SAMPLE, out, [logits, sampling], [float(n_probs), float(window)])

    def weight(self, m: int, k_blocks: int) -> tuple[int, int]:
        """A weight of m rows in F32 or a quantized type the CPU kernels take (raw seeded blocks:
        any scale, NaN and infinity included), k_blocks of that type's blocks per row (a row of F32
        is k_blocks values); returns (the tensor, its row length). Its rows count is sometimes not a
        multiple of 8, which the repacked kernels need."""
        d = self.draw
        dtype = d(st.sampled_from([F32, F32, 2, 8, 12, 13, 14]))
        block, size = QS.get(dtype, (1, 4))
        k = block * k_blocks
        fill = self.values(m * k) if dtype == F32 else seeded_bytes(d(st.integers(0, 2**16)), m * k_blocks * size)
        return self.tensor(dtype, [m, k], fill), k

    def mul_mat_q(self) -> None:
        d = self.draw
        n, m = d(st.sampled_from([0, 1, 3, 8, 9])), d(st.sampled_from([1, 7, 8, 16]))
        w, k = self.weight(m, d(st.integers(1, 2)))
        x = self.tensor(F32, [n, k], self.values(n * k))
        srcs = [x, w] + ([self.tensor(F32, [m], self.values(m))] if d(st.booleans()) else [])
        self.node(Op.MUL_MAT, self.tensor(F32, [n, m]), srcs, [])

    def mul_mat_cat(self) -> None:
        d = self.draw
        n, p, kb = d(st.sampled_from([0, 1, 2, 9])), d(st.integers(2, 3)), d(st.integers(1, 2))
        parts, total, k = [], 0, 0
        for _ in range(p):
            m = d(st.sampled_from([1, 8, 16]))
            w, k = self.weight(m, kb)
            parts.append(w)
            total += m
        x = self.tensor(F32, [n, k], self.values(n * k))  # the last part's row length: others may differ
        srcs = [x] + parts + ([self.tensor(F32, [total], self.values(total))] if d(st.booleans()) else [])
        self.node(Op.MUL_MAT_CAT, self.tensor(F32, [n, total]), srcs, [float(p)])

    def moe_ffn(self) -> None:
        d = self.draw
        n, e, f = d(st.integers(0, 3)), d(st.sampled_from([4, 8])), d(st.sampled_from([4, 8]))
        n_exp = d(st.integers(1, 4))
        n_used = d(st.sampled_from([1, 2, n_exp, n_exp + 1, 0]))
        x = self.tensor(F32, [n, e], self.values(n * e))
        router = self.tensor(F32, [n_exp, e], self.values(n_exp * e))
        gate = self.tensor(F32, [n_exp, f, e], self.values(n_exp * f * e))
        up = self.tensor(F32, [n_exp, f, e], self.values(n_exp * f * e))
        down = self.tensor(F32, [n_exp, e, f], self.values(n_exp * e * f))
        srcs = [x, router, gate, up, down]
        if d(st.booleans()):
            srcs.append(self.tensor(F32, [n, e], self.values(n * e)))
            if d(st.booleans()):
                srcs.append(self.tensor(F32, [e], self.values(e)))
        params = [float(n_used), float(d(st.sampled_from([0, 1, 1, 2]))),
                  d(st.sampled_from([1.0, 0.5, 2.5, 0.0, -1.0]))]
        self.node(Op.MOE_FFN, self.tensor(F32, [n, e]), srcs, params)

    def scale_or_softcap(self) -> None:
        d = self.draw
        shape = [d(st.integers(0, 3)), d(st.integers(1, 8))]
        x = self.tensor(F32, shape, self.values(math.prod(shape)))
        op = d(st.sampled_from([Op.SCALE, Op.SOFTCAP]))
        self.node(op, self.tensor(F32, shape), [x], [d(st.sampled_from([1.0, 0.125, 30.0, 0.0, -2.0, 1e30]))])

    OPS = ("get_rows", "rms_norm", "mul_mat", "add", "glu", "attention", "sample", "mul_mat_q", "mul_mat_cat",
           "moe_ffn", "scale_or_softcap")

    def mutate(self) -> None:
        """Structural mutations of the tables: what `wire.decode_graph` and the session must refuse."""
        d, nt = self.draw, len(self.recs)
        for _ in range(d(mut_count)):
            kind = d(st.sampled_from(["op", "n_src", "src", "unused_src", "out", "param", "unused_param",
                                      "tensor", "tensor", "swap_src"]))
            if kind == "tensor" and nt:
                mutate_rec(d, self.recs[d(st.integers(0, nt - 1))], 1)
                continue
            if not self.nodes:
                continue
            nd = self.nodes[d(st.integers(0, len(self.nodes) - 1))]
            if kind == "op":
                nd.op = d(st.one_of(st.sampled_from([0, 8, 9, 99, U32_MAX]), st.integers(1, 7)))
            elif kind == "n_src":
                nd.n_src = d(st.sampled_from([0, 1, 2, 3, 7, 8, 9, 10, 11, U32_MAX]))
                if nd.n_src <= P.MAX_SRC:  # keep the unused entries consistent so the count itself is tested
                    full = (nd.srcs + [0] * P.MAX_SRC)[:nd.n_src]
                    nd.src_raw = full + [P.NO_SRC] * (P.MAX_SRC - nd.n_src)
            elif kind == "src" and nd.srcs:
                k = d(st.integers(0, len(nd.srcs) - 1))
                nd.srcs[k] = d(st.one_of(st.integers(0, max(0, nt - 1)), st.sampled_from([nt, nt + 1, U32_MAX])))
            elif kind == "unused_src" and len(nd.srcs) < P.MAX_SRC:
                raw = nd.srcs + [P.NO_SRC] * (P.MAX_SRC - len(nd.srcs))
                raw[d(st.integers(len(nd.srcs), P.MAX_SRC - 1))] = d(st.sampled_from([0, 1, nt, 0xFFFFFFFE]))
                nd.src_raw = raw
            elif kind == "out":
                nd.out = d(st.one_of(st.integers(0, max(0, nt - 1)), st.sampled_from([nt, U32_MAX])))
            elif kind == "param":
                params = list(nd.params) + [0.0] * (12 - len(nd.params))
                params[d(st.integers(0, max(0, nd.n_used - 1)))] = d(st.sampled_from(PARAM_EDGES))
                nd.params = params
            elif kind == "unused_param":
                params = list(nd.params) + [0.0] * (12 - len(nd.params))
                params[d(st.integers(min(nd.n_used, 11), 11))] = d(st.sampled_from(PARAM_EDGES))
                nd.params = params
            elif kind == "swap_src" and len(nd.srcs) >= 2:
                nd.srcs[0], nd.srcs[1] = nd.srcs[1], nd.srcs[0]

    def payload(self, uid: int) -> bytes:
        d = self.draw
        # mutations of the whole payload stop a graph before its structure is looked at: keep them rare
        device = U32_MAX if rare(d, 40) else 0
        n_t, n_n = len(self.recs), len(self.nodes)
        if rare(d, 30):
            n_t = d(st.sampled_from([n_t + 1, max(0, n_t - 1), 65536, 65537, U32_MAX]))
        if rare(d, 30):
            n_n = d(st.sampled_from([n_n + 1, max(0, n_n - 1), 65536, 65537, U32_MAX]))
        body = (P.GRAPH_HEAD.pack(device, 0, uid, n_t, n_n) + b"".join(r.pack() for r in self.recs)
                + b"".join(nd.pack() for nd in self.nodes))
        return maybe_bytes_mutation(d, body, keep=27)


def graph_frames(draw, ctx: Ctx) -> bytes:
    """Input fills, a GRAPH_COMPUTE, maybe GRAPH_RECOMPUTEs, reads of the outputs."""
    gb = GraphBuilder(draw, ctx)
    for _ in range(draw(st.integers(1, 3))):
        getattr(gb, draw(st.sampled_from(GraphBuilder.OPS)))()
    clean_outs = [gb.recs[i].copy() for i in gb.outputs]
    gb.mutate()
    uid = draw(st.one_of(st.sampled_from([1, 2, 3]), u64s))
    out = b"".join(gb.fill_values) + b"".join(gb.fill_indices) + frame(Cmd.GRAPH_COMPUTE, gb.payload(uid))
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
        again = draw(st.one_of(st.just(uid), u64s))
        out += frame(Cmd.GRAPH_RECOMPUTE, P.RECOMPUTE.pack(draw(st.sampled_from([0, 0, 0, 1])), 0, again))
    for rec in clean_outs:
        out += frame(Cmd.GET_TENSOR, rec.pack() + P.REGION.pack(0, rec.nbytes))
    return out


# --- whole cases ---------------------------------------------------------------------------------------------

@dataclass
class Case:
    kind: str
    stream: bytes
    chunks: list = field(default_factory=list)
    pause: bool = False
    commands: tuple = ()


def setup_frames(ctx: Ctx, fill_seed: int) -> bytes:
    """HELLO, AUTH when the server wants it, the case's buffers (target, aux, a freed one), the target
    filled with seeded bytes."""
    s = hello_frame()
    if ctx.token:
        s += frame(Cmd.AUTH, bytes([auth.STEP_BEGIN]) + seeded_bytes(fill_seed, auth.NONCE))
        s += frame(Cmd.AUTH, bytes([auth.STEP_PROVE]) + PROOF_PH)
    s += frame(Cmd.ALLOC_BUFFER, P.ALLOC_REQ.pack(0, 0, ctx.target_size))
    s += frame(Cmd.ALLOC_BUFFER, P.ALLOC_REQ.pack(0, 1, 1024))
    s += frame(Cmd.ALLOC_BUFFER, P.ALLOC_REQ.pack(0, 2, 64))
    s += frame(Cmd.FREE_BUFFER, P.U64.pack(ph(SLOT_FREED)))
    n = ctx.target_size // 4
    if n:
        fill = TRec(ph(SLOT_TARGET), 0, F32, 1, [n, 0, 0, 0], b"fill")
        s += frame(Cmd.SET_TENSOR, fill.pack() + P.U64.pack(0) + seeded_bytes(fill_seed, 4 * n))
    return s


@st.composite
def chunkings(draw) -> tuple[list, bool]:
    sizes = draw(st.lists(st.one_of(st.integers(1, 16), st.integers(1, 200), st.sampled_from([9, 10, 4096, 65536,
                                                                                                 RX_SIZE, 1 << 20])),
                          min_size=1, max_size=8))
    return sizes, draw(st.sampled_from([False, False, False, True]))


@st.composite
def session_cases(draw, token: bool = False, graph_only: bool = False) -> Case:
    size = draw(st.sampled_from([1024, 4096, 4096] if graph_only else [0, 16, 256, 1024, 4096, 4096, 4097]))
    if not graph_only and rare(draw, 25):  # room for the weight cache's smallest stored write
        size = CACHE_MIN_BYTES + 4096
    ctx = Ctx(size, token)
    stream = setup_frames(ctx, draw(st.integers(0, 2**16)))
    if graph_only:
        names = ["GRAPH_COMPUTE"] * draw(st.integers(1, 2))
    else:
        names = draw(st.lists(st.sampled_from(sorted(BUILDERS)), min_size=1, max_size=6))
    for name in names:
        stream += BUILDERS[name](draw, ctx)
    stream += frame(Cmd.SYNCHRONIZE, P.U32.pack(0))
    if size >= 4 and draw(st.booleans()):
        whole = TRec(ph(SLOT_TARGET), 0, F32, 1, [size // 4, 0, 0, 0], b"whole")
        stream += frame(Cmd.GET_TENSOR, whole.pack() + P.REGION.pack(0, 4 * (size // 4)))
    chunks, pause = draw(chunkings())
    return Case("graph" if graph_only else ("token-session" if token else "session"), stream, chunks, pause,
                tuple(names))


@st.composite
def raw_streams(draw, token: bool = False) -> Case:
    """Streams from the first byte of a connection: the HELLO and AUTH gates, then any frames."""
    ctx = Ctx(1024, token)
    start = draw(st.sampled_from(["hello", "hello", "hello", "bad_hello", "none"]))
    s = b""
    if start == "hello":
        s = hello_frame()
    elif start == "bad_hello":
        s = frame(Cmd.HELLO, draw(st.one_of(st.binary(max_size=HELLO_MAX + 2),
                                             st.sampled_from([P.HELLO_REQ.pack(2, 0, 0, 0), P.HELLO_REQ.pack(0, 9, 9, 9)]))))
    if token and start == "hello":
        auth_kind = draw(st.sampled_from(["full", "full", "begin", "wrong_proof", "bad_step", "none"]))
        cn = draw(st.binary(min_size=32, max_size=32))
        if auth_kind in ("full", "begin", "wrong_proof"):
            s += frame(Cmd.AUTH, b"\1" + cn)
        if auth_kind == "full":
            s += frame(Cmd.AUTH, b"\2" + PROOF_PH)
        elif auth_kind == "wrong_proof":
            s += frame(Cmd.AUTH, b"\2" + draw(st.binary(min_size=32, max_size=32)))
        elif auth_kind == "bad_step":
            s += frame(Cmd.AUTH, draw(st.binary(max_size=40)))
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["cmd", "cmd", "raw", "header", "garbage"]))
        if kind == "cmd":
            s += BUILDERS[draw(st.sampled_from(["DEVICE_COUNT", "GET_DEVICE_INFO", "SYNCHRONIZE", "TRACE_SYNC",
                                                "GET_TENSOR", "SET_TENSOR", "HELLO", "AUTH", "ALLOC_BUFFER"]))](draw, ctx)
        elif kind == "raw":
            s += b_raw(draw, ctx)
        elif kind == "header":  # a size field that lies, at the edges of every limit
            code = draw(st.one_of(st.sampled_from(sorted(KNOWN)), st.integers(0, 255)))
            size = draw(st.sampled_from([0, 1, HELLO_MAX, HELLO_MAX + 1, RX_SIZE - 9, RX_SIZE - 8, RX_SIZE,
                                         RX_SIZE + 1, MAX_FRAME, MAX_FRAME + 1, 2**32, 2**63, U64_MAX]))
            s += P.HEADER.pack(code, size) + draw(st.binary(max_size=32))
        else:
            s += draw(st.binary(min_size=1, max_size=40))
    if s and rare(draw, 5):
        s = s[:draw(st.integers(0, len(s)))]
    chunks, pause = draw(chunkings())
    return Case("token-raw" if token else "raw", s, chunks, pause)


# --- servers under test ------------------------------------------------------------------------------------

class _LogTap(logging.Handler):
    """Keeps the server's recent WARNING and ERROR lines (in-process servers)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: deque = deque(maxlen=4000)  # (sequence number, level, text)
        self.seq = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a log line that cannot be formatted is still a line
            text = str(record.msg)
        self.seq += 1
        self.lines.append((self.seq, record.levelno, text))


class Target:
    """A server under test. Subclasses run it in this process or as a child process."""

    token: Optional[bytes]
    port: int
    max_frame = MAX_FRAME
    harness_conns = 0  # connections the runners keep open (guard buffers), not the fuzzed ones
    cache_dir: Optional[str] = None   # the server's weight cache, made for this target alone
    token_file: Optional[str] = None  # the token a child server reads, likewise

    def alive(self, wait: float = 0.0) -> Optional[str]: ...
    def allocated(self) -> int: ...
    def leftovers(self) -> Optional[str]: return None
    def rss(self) -> int: ...
    def log_mark(self) -> int: ...
    def log_since(self, mark: int, needle: Optional[str] = None) -> list[tuple[int, str]]: ...
    def restart(self) -> None: ...
    def stop(self) -> None: ...

    def _remove_files(self) -> None:
        if self.cache_dir:
            shutil.rmtree(self.cache_dir, ignore_errors=True)
        if self.token_file and os.path.exists(self.token_file):
            os.unlink(self.token_file)


def make_cache_dir() -> str:
    d = tempfile.mkdtemp(prefix="fuzz-rpc-cache-")
    with open(os.path.join(d, KNOWN_DIGEST.hex()), "wb") as fh:
        fh.write(KNOWN_BLOB)
    return d


class ThreadTarget(Target):
    """An in-process ServerThread; allocations, connections and bound plans are read directly."""

    def __init__(self, token: Optional[bytes] = None, cache: bool = True, mem_mib: int = MEM_LIMIT >> 20,
                 extra: tuple = ()):
        self.token = token
        self.mem_mib, self.extra = mem_mib, tuple(extra)
        self.cache_dir = make_cache_dir() if cache else None
        self.tap = _LogTap()
        logging.getLogger(LOGGER).addHandler(self.tap)
        self.st = self._start()

    def _start(self) -> ServerThread:
        st = ServerThread(port=0, backend_factory=lambda: CPUBackend(1), mem_limit=MEM_LIMIT, max_frame=MAX_FRAME,
                          cache_dir=self.cache_dir, token=self.token)
        st.start()
        self.port = st.port
        return st

    @property
    def server(self):
        return self.st.server

    def alive(self, wait: float = 0.0) -> Optional[str]:
        if self.st._thread is None or not self.st._thread.is_alive():
            return "the server's event loop thread died"
        for conn in list(self.server._conns):
            ex = conn.executor
            if ex._started and not ex.alive and not conn.closing:
                return f"the executor thread of connection {conn.number} ({conn.peer}) died"
        return None

    def allocated(self) -> int:
        return self.server.allocated()

    def leftovers(self) -> Optional[str]:
        plans = sum(len(getattr(d.backend, "_plans", ())) for d in self.server.devices)
        if plans:
            return f"{plans} bound graph plan(s) outlive their connection"
        return None

    def connections(self) -> int:
        return self.server.connections

    def rss(self) -> int:
        return psutil.Process().memory_info().rss

    def log_mark(self) -> int:
        return self.tap.seq

    def log_since(self, mark: int, needle: Optional[str] = None) -> list[tuple[int, str]]:
        # the server logs on its loop before it closes: the line is there once the close was seen
        return [(level, text) for seq, level, text in list(self.tap.lines) if seq > mark]

    def restart(self) -> None:
        raise RuntimeError("an in-process server cannot be restarted after a crash")

    def stop(self) -> None:
        logging.getLogger(LOGGER).removeHandler(self.tap)
        self.st.stop()
        self._remove_files()


class ProcessTarget(Target):
    """`python -m pyllama.rpc_server` as a child: a crash is seen (and the server restarted), its RSS
    is its own, allocations are read with GET_DEVICE_INFO (free = --mem cap - allocated)."""

    def __init__(self, token: Optional[bytes] = None, cache: bool = True, mem_mib: int = MEM_LIMIT >> 20,
                 extra: tuple = ()):
        self.token = token
        self.mem_mib, self.extra = mem_mib, tuple(extra)
        self.cache_dir = make_cache_dir() if cache else None
        if token:
            fd, self.token_file = tempfile.mkstemp(prefix="fuzz-rpc-token-")
            os.write(fd, token + b"\n")
            os.close(fd)
            os.chmod(self.token_file, 0o600)
        self.lines: deque = deque(maxlen=4000)
        self._seq = itertools.count(1)
        self.exits: list[int] = []
        self._start()

    def _start(self) -> None:
        cmd = [sys.executable, "-m", "pyllama.rpc_server", "--host", "127.0.0.1", "--port", "0", "-t", "1",
               "--mem", str(self.mem_mib), "--max-frame", str(MAX_FRAME), *self.extra]
        if self.cache_dir:
            cmd += ["--cache", self.cache_dir]
        if self.token_file:
            cmd += ["--auth-token-file", self.token_file]
        env = {**os.environ, "PYLLAMA_RPC_TOKEN": "", "PYTHONFAULTHANDLER": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     env=env, text=True, errors="replace")
        deadline = time.monotonic() + 60
        self.port = 0
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"rpc_server exited {self.proc.wait()}")
            if "listening on" in line:
                self.port = int(line.rsplit(":", 1)[1].split()[0])
                break
        if not self.port:
            raise TimeoutError("rpc_server did not start")
        proc = self.proc

        def drain() -> None:
            for line in proc.stderr:
                self.lines.append((next(self._seq), line.rstrip("\n")))
        threading.Thread(target=drain, daemon=True).start()

    def alive(self, wait: float = 0.0) -> Optional[str]:
        """None while the process runs; `wait` gives a dying process (a crash dumping its stacks) time
        to exit, so that the case that killed it is the one blamed."""
        try:
            rc = self.proc.wait(wait) if wait else self.proc.poll()
        except subprocess.TimeoutExpired:
            rc = None
        if rc is not None:
            time.sleep(0.2)  # the rest of the dump still in the pipe
            tail = "\n".join(line for _, line in list(self.lines)[-20:])
            return f"the server process exited with status {rc}\n{tail}"
        return None

    def allocated(self) -> int:
        with Client(self.port, self.token) as c:
            _, _, _, free, total = P.DEVICE_INFO.unpack(c.ok(Cmd.GET_DEVICE_INFO, P.U32.pack(0)))
        # this connection allocates nothing itself
        return total - free

    def rss(self) -> int:
        try:
            return psutil.Process(self.proc.pid).memory_info().rss
        except psutil.Error:
            return 0

    def log_mark(self) -> int:
        return self.lines[-1][0] if self.lines else 0

    def log_since(self, mark: int, needle: Optional[str] = None) -> list[tuple[int, str]]:
        # the drain thread lags behind the server: give a line that must be there a moment to arrive
        deadline = time.monotonic() + (2.0 if needle else 0.02)
        while time.monotonic() < deadline:
            if needle and any(needle in line for seq, line in list(self.lines) if seq > mark):
                break
            time.sleep(0.01)
        out = []
        for seq, line in list(self.lines):
            if seq > mark:
                level = logging.ERROR if " ERROR " in line or "Fatal Python error" in line or "Traceback" in line \
                    else logging.WARNING
                out.append((level, line))
        return out

    def restart(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.exits.append(self.proc.wait())
        self._start()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._remove_files()


# --- a small blocking client ----------------------------------------------------------------------------------

ProtocolError = StatusError


class Client(RawClient):
    def __init__(self, port: int, token: Optional[bytes] = None, timeout: float = CASE_TIMEOUT, hello: bool = True):
        super().__init__(port, hello=hello, timeout=timeout, token=token)


# --- running cases -----------------------------------------------------------------------------------------------

class CaseFailure(AssertionError):
    pass


@dataclass
class Stats:
    cases: Counter = field(default_factory=Counter)        # fuzz target -> cases
    frames: Counter = field(default_factory=Counter)       # command -> complete frames sent
    statuses: Counter = field(default_factory=Counter)     # (command, status) -> replies
    early_closes: Counter = field(default_factory=Counter)  # rule that closed -> connections
    refusals: Counter = field(default_factory=Counter)     # error replies by message (numbers masked)
    graphs_ran: int = 0                                    # GRAPH_COMPUTEs followed by a status-0 reply
    failures: list = field(default_factory=list)

    def note_reply(self, exp: "Expect", status: int, payload: bytes) -> None:
        self.statuses[(cmd_name(exp.cmd), status)] += 1
        if status == P.STATUS_OK:
            self.graphs_ran += exp.preceded.count(Cmd.GRAPH_COMPUTE)
        else:
            text = re.sub(r"\d+", "N", payload[:160].decode("utf-8", "replace"))
            text = re.sub(r"'[^']*'", "'…'", text).split(" (and N later")[0]
            self.refusals[text[:110]] += 1

    def report(self) -> str:
        lines = ["cases per fuzz target:"]
        lines += [f"  {k:<16} {v}" for k, v in sorted(self.cases.items())]
        lines.append("frames sent per command, and their replies by status (0 ok / 1 error / 2 earlier error):")
        for name in sorted(self.frames, key=lambda n: (n.startswith("CMD_"), n)):
            hist = " ".join(f"{s}:{self.statuses[(name, s)]}" for s in (0, 1, 2) if self.statuses[(name, s)])
            lines.append(f"  {name:<16} {self.frames[name]:>7}   {hist}")
        lines.append("connections the server closed early, by rule:")
        lines += [f"  {k:<28} {v}" for k, v in sorted(self.early_closes.items())] or ["  none"]
        lines.append(f"graphs computed to the end: {self.graphs_ran}")
        lines.append(f"most frequent refusals ({len(self.refusals)} distinct messages):")
        lines += [f"  {v:>6}  {k}" for k, v in self.refusals.most_common(30)]
        return "\n".join(lines)


class Keeper:
    """Keeps the last failing case of a runner: hypothesis shrinks by running ever smaller failing
    cases, so the last one seen is the one worth saving."""

    out_dir: str
    stats: Stats
    last_failure: Optional[tuple[Case, str]] = None

    def _write(self, case: Case, name: Optional[str], why: str) -> str:
        os.makedirs(self.out_dir, exist_ok=True)
        digest = hashlib.sha256(case.stream).hexdigest()[:12]
        base = os.path.join(self.out_dir, f"{case.kind}-{name or digest}")
        with open(base + ".bin", "wb") as fh:
            fh.write(case.stream)
        with open(base + ".txt", "w") as fh:
            fh.write(f"{why}\n\nkind {case.kind}, chunks {case.chunks}, pause {case.pause}\n"
                     f"{describe_stream(case.stream)}\n")
        return base + ".bin"

    def save_last_failure(self) -> Optional[str]:
        """Writes the last failing case under the output directory; returns its path."""
        if self.last_failure is None:
            return None
        case, why = self.last_failure
        self.last_failure = None
        path = self._write(case, None, why)
        self.stats.failures.append((case.kind, why.splitlines()[0], path))
        return path


class GuardConn:
    """A second connection that owns the guard buffers: the fuzzed connection cannot name them, so
    any change to their bytes is a write outside every buffer it may touch."""

    def __init__(self, target: Target):
        self.target = target
        self.client: Optional[Client] = None
        self.ids: list[int] = []

    def _c(self) -> Client:
        if self.client is None:
            self.client = Client(self.target.port, self.target.token)
            self.target.harness_conns += 1
        return self.client

    def alloc(self) -> int:
        bid = P.ALLOC_REP.unpack(self._c().ok(Cmd.ALLOC_BUFFER, P.ALLOC_REQ.pack(0, 0, GUARD_SIZE)))[0]
        self.ids.append(bid)
        data = GUARD_BYTES[(len(self.ids) - 1) % 2]
        rec = TRec(bid, 0, F32, 1, [GUARD_SIZE // 4, 0, 0, 0], b"guard")
        self._c().sock.sendall(frame(Cmd.SET_TENSOR, rec.pack() + P.U64.pack(0) + data))
        return bid

    def check_and_free(self) -> Optional[str]:
        problem = None
        c = self._c()
        for i, bid in enumerate(self.ids):
            rec = TRec(bid, 0, F32, 1, [GUARD_SIZE // 4, 0, 0, 0], b"guard")
            got = c.ok(Cmd.GET_TENSOR, rec.pack() + P.REGION.pack(0, GUARD_SIZE))
            if got != GUARD_BYTES[i % 2] and problem is None:
                diff = [j for j in range(GUARD_SIZE) if got[j] != GUARD_BYTES[i % 2][j]]
                problem = f"guard buffer {i} changed at {len(diff)} bytes (first at {diff[0]})"
            c.ok(Cmd.FREE_BUFFER, P.U64.pack(bid))
        self.ids.clear()
        return problem

    def reset(self) -> None:
        if self.client is not None:
            self.client.sock.close()
            self.target.harness_conns -= 1
        self.client = None
        self.ids.clear()


class Runner(Keeper):
    """Runs cases against a target and checks every property after each."""

    def __init__(self, target: Target, stats: Optional[Stats] = None, out_dir: str = OUT_DIR,
                 timeout: float = CASE_TIMEOUT, keep_current: bool = False):
        self.target = target
        self.stats = stats or Stats()
        self.out_dir = out_dir
        self.timeout = timeout
        # write each case before running it: an in-process server that crashes leaves nothing else
        self.keep_current = keep_current
        self.guards = GuardConn(target)
        self.rss0 = 0
        self.last_failure: Optional[tuple[Case, str]] = None

    # the whole check of one case
    def run(self, case: Case) -> None:
        self.stats.cases[case.kind] += 1
        if self.keep_current:
            self._write(case, "current", "being run (a crash of an in-process server leaves it here)")
        try:
            try:
                self._run(case)
            except (OSError, EOFError, ProtocolError) as exc:
                raise CaseFailure(f"{self.target.alive() or 'the harness lost the server'}: {exc!r}") from None
        except CaseFailure as exc:
            dead = self.target.alive(wait=2.0)
            if dead and not str(exc).startswith(dead[:40]):
                exc = CaseFailure(f"{dead}\n(seen as: {exc})")
            # hypothesis shrinks by running smaller failing cases: the last one is the one to keep
            self.last_failure = (case, str(exc))
            if self.target.alive() is not None and isinstance(self.target, ProcessTarget):
                self.target.restart()
            self.guards.reset()
            raise exc from None

    def _fail(self, msg: str) -> None:
        raise CaseFailure(msg)

    def _run(self, case: Case) -> None:
        t = self.target
        why = t.alive()
        if why:
            self._fail(f"the server was down before the case: {why}")
        mark = t.log_mark()
        token = t.token
        try:
            self.guards.alloc()
        except (OSError, EOFError, ProtocolError) as exc:
            self.guards.reset()
            self._fail(f"the guard connection failed before the case: {exc!r}")
        slots = {SLOT_FOREIGN: self.guards.ids[0]}
        # successive ALLOC_BUFFER replies bind the slots in order, whichever of them the stream names
        pending = list(BIND_ORDER)
        named = {s for s in BIND_ORDER if PH_BYTES[s] in case.stream}
        need_proof = token is not None and PROOF_PH in case.stream
        nonces: dict[str, bytes] = {}

        def proof() -> Optional[bytes]:
            if token is None or "sn" not in nonces:
                return None
            return auth.client_proof(token, nonces["cn"], nonces["sn"])

        def resolve(data: bytes) -> bytes:
            for slot, bid in slots.items():
                data = data.replace(PH_BYTES[slot], P.U64.pack(bid))
            p = proof()
            return data.replace(PROOF_PH, p) if p is not None else data

        model = FrameModel(token is not None, t.max_frame, lambda body: body == proof())
        sock = socket.create_connection(("127.0.0.1", t.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = "%s:%d" % sock.getsockname()[:2]
        replies: list[tuple[Expect, int, bytes]] = []
        stream, pos = case.stream, 0
        try:
            # one frame at a time while a placeholder still waits for its value
            hs = P.HEADER.size
            while (named & set(pending) or (need_proof and proof() is None)) and model.closed is None \
                    and len(stream) - pos >= hs:
                cmd, size = P.HEADER.unpack_from(stream, pos)
                if len(stream) - pos - hs < size:
                    break
                raw = resolve(stream[pos:pos + hs + size])
                pos += hs + size
                exps = model.run(raw)
                sock.sendall(raw)
                for exp in exps:
                    status, payload = self._read_one(sock, exp)
                    replies.append((exp, status, payload))
                    if status == P.STATUS_OK and exp.cmd == Cmd.ALLOC_BUFFER and pending:
                        slots[pending.pop(0)] = P.ALLOC_REP.unpack(payload)[0]
                    if status == P.STATUS_OK and exp.cmd == Cmd.AUTH and exp.payload[:1] == b"\1":
                        nonces["cn"], nonces["sn"] = exp.payload[1:], payload[:auth.NONCE]
            self.guards.alloc()
            rest = resolve(stream[pos:]) if model.closed is None else b""  # nothing after a refusal
            exps = model.run(rest)
            got, eof, reset = self._send_and_drain(sock, rest, case)
        except (OSError, EOFError, ProtocolError) as exc:
            why = t.alive()
            self._fail(f"{why or 'connection failed'}: {exc!r}")
        finally:
            sock.close()
        for cmd in model.frames:
            self.stats.frames[cmd_name(cmd)] += 1
        why = t.alive()
        if why:
            self._fail(why)
        if not eof:
            self._fail(f"no close within {self.timeout} s after the client's end of stream (a hang)")
        frames, trailing = parse_replies(got)
        if trailing:
            self._fail(f"{len(trailing)} bytes after the last whole reply frame: {trailing[:40].hex()}")
        early = model.closed is not None
        # every frame before a refused one is owed its reply; only a reset (the kernel's answer to
        # a close with unread input) may lose some of them in flight
        if len(frames) > len(exps) or (not reset and len(frames) != len(exps)):
            self._fail(f"{len(frames)} replies, the framing rules call for {len(exps)} "
                       f"({[cmd_name(e.cmd) for e in exps]}; got statuses {[s for s, _ in frames]})")
        for exp, (status, payload) in zip(exps, frames):
            replies.append((exp, status, payload))
        for exp, status, payload in replies:
            self.stats.note_reply(exp, status, payload)
            problem = check_reply(exp, status, payload)
            if problem:
                self._fail(problem)
        problem = self.guards.check_and_free()
        if problem:
            self._fail(problem)
        self._wait_released()
        lines = t.log_since(mark, peer if early else None)
        errors = [line for level, line in lines if level >= logging.ERROR]
        if errors:
            self._fail("the server logged an unexpected failure:\n" + "\n".join(errors[:10]))
        if early:
            self.stats.early_closes[model.closed] += 1
            if not any(peer in line for _, line in lines):
                self._fail(f"the server closed the connection ({model.closed}) without a log line")
        self._health()

    def _read_one(self, sock: socket.socket, exp: Expect) -> tuple[int, bytes]:
        def exact(n: int) -> bytes:
            buf = bytearray()
            while len(buf) < n:
                try:
                    chunk = sock.recv(n - len(buf))
                except socket.timeout:
                    self._fail(f"no reply to {cmd_name(exp.cmd)} within {self.timeout} s (a hang)")
                if not chunk:
                    self._fail(f"closed instead of replying to {cmd_name(exp.cmd)}")
                buf += chunk
            return bytes(buf)
        status, size = P.HEADER.unpack(exact(P.HEADER.size))
        if size > 64 << 20:
            self._fail(f"{cmd_name(exp.cmd)}: reply claims {size} bytes")
        return status, exact(size)

    def _send_and_drain(self, sock: socket.socket, data: bytes, case: Case) -> tuple[bytes, bool, bool]:
        """Sends `data` in the case's chunk sizes while a thread reads every reply until the close;
        returns what came, whether the close came, and whether it came as a reset."""
        got = bytearray()
        done = threading.Event()
        eof = [False]
        reset = [False]

        def reader() -> None:
            buf = bytearray(1 << 16)
            try:
                while True:
                    n = sock.recv_into(buf)
                    if not n:
                        eof[0] = True
                        return
                    got.extend(buf[:n])
            except socket.timeout:
                pass  # no close in time: a hang, reported by the caller
            except OSError:
                eof[0] = reset[0] = True  # a reset is a close too
            finally:
                done.set()
        th = threading.Thread(target=reader, daemon=True)
        th.start()
        pos, sizes = 0, itertools.cycle(case.chunks or [len(data) or 1])
        try:
            for i in itertools.count():
                if pos >= len(data):
                    break
                # the drawn sizes for the first pieces, then 4 KiB ones: a long stream cut in bytes
                # would cost far more time than it adds coverage
                n = next(sizes) if i < MAX_DRAWN_PIECES else 4096
                sock.sendall(data[pos:pos + n])
                pos += n
                if case.pause and i < MAX_PAUSES:  # so the server's reads more likely end here
                    time.sleep(0.0005)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            reset[0] = True  # the server closed first (a refused frame); what it sent is still read
        done.wait(self.timeout)
        return bytes(got), eof[0], reset[0]

    def _wait_released(self) -> None:
        t = self.target
        deadline = time.monotonic() + self.timeout
        while True:
            held = t.allocated()
            left = t.leftovers() if held == 0 else None
            extra = t.connections() - t.harness_conns if isinstance(t, ThreadTarget) else 0
            if held == 0 and left is None and extra <= 0:
                return
            if time.monotonic() > deadline:
                if held:
                    self._fail(f"{held} bytes still allocated after the connection closed")
                if extra > 0:
                    self._fail(f"{extra} connection(s) still open on the server after the case")
                self._fail(left or "leftovers")
            time.sleep(0.005)

    def _health(self) -> None:
        try:
            with Client(self.target.port, self.target.token) as c:
                if c.ok(Cmd.DEVICE_COUNT) != P.U32.pack(1):
                    self._fail("DEVICE_COUNT of a fresh connection is not 1")
        except (OSError, EOFError, ProtocolError) as exc:
            self._fail(f"a fresh connection is not served after the case: {exc!r}")

    def check_rss(self, limit: int = RSS_GROWTH_LIMIT) -> tuple[int, int]:
        now = self.target.rss()
        if self.rss0 and now - self.rss0 > limit:
            raise CaseFailure(f"server RSS grew from {self.rss0 >> 20} MiB to {now >> 20} MiB")
        return self.rss0, now

    def start_rss(self) -> None:
        self.rss0 = self.target.rss()

    def close(self) -> None:
        self.guards.reset()


# --- the parser with exact split points -------------------------------------------------------------------------

class MockTransport(asyncio.Transport):
    """What `_Connection` sees of a transport; records writes, honours pause and close."""

    def __init__(self, peer: str):
        super().__init__()
        self.out = bytearray()
        self.closed = False
        self.paused = False
        self.peer = peer

    def get_extra_info(self, name, default=None):
        return (self.peer, 0) if name == "peername" else default

    def write(self, data) -> None:
        if self.closed:
            raise AssertionError("write after close")
        self.out += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


def normalized(replies: list[tuple[int, bytes]]) -> list:
    """Replies as comparable across two runs: payload sizes for successes (ids and clocks differ),
    messages with their numbers masked for errors."""
    return [(s, len(p)) if s == P.STATUS_OK else (s, re.sub(rb"\d+", b"N", p)) for s, p in replies]


class SplitRunner(Keeper):
    """Feeds a stream to a `_Connection` on the server's loop through `get_buffer`/`buffer_updated`
    exactly as asyncio does, in chunks of exact sizes, and checks that the replies equal those of
    the same stream fed whole (and obey the framing rules)."""

    _peers = itertools.count(1)

    def __init__(self, target: ThreadTarget, stats: Optional[Stats] = None, out_dir: str = OUT_DIR,
                 timeout: float = CASE_TIMEOUT):
        self.target = target
        self.stats = stats or Stats()
        self.out_dir = out_dir
        self.timeout = timeout

    def feed(self, stream: bytes, chunks: list[int]) -> tuple[bytes, bool, MockTransport]:
        st_ = self.target.st
        tr = MockTransport(f"split-{next(self._peers)}")
        conn = server_mod._Connection(self.target.server)
        st_.call(conn.connection_made, tr)

        def put(piece: bytes) -> None:
            pos = 0
            while pos < len(piece) and not conn.closing:
                buf = conn.get_buffer(-1)
                if len(buf) == 0:
                    raise CaseFailure("get_buffer returned an empty buffer")
                n = min(len(buf), len(piece) - pos)
                buf[:n] = piece[pos:pos + n]
                conn.buffer_updated(n)
                pos += n

        pos, sizes = 0, itertools.cycle(chunks or [1])
        deadline = time.monotonic() + self.timeout
        pieces = 0
        while pos < len(stream) and not tr.closed:
            while tr.paused and time.monotonic() < deadline:
                time.sleep(0.001)
            n = next(sizes) if pieces < MAX_DRAWN_PIECES else 4096
            st_.call(put, stream[pos:pos + n])
            pos += n
            pieces += 1
        if not tr.closed:
            st_.call(conn.eof_received)
        while not tr.closed and time.monotonic() < deadline:
            time.sleep(0.001)
        closed = tr.closed
        st_.call(conn.connection_lost, None)
        # its buffers go back on the executor: the next feed must not find the memory cap lower
        while self.target.allocated() and time.monotonic() < deadline + self.timeout:
            time.sleep(0.002)
        return bytes(tr.out), closed, tr

    def run(self, case: Case) -> None:
        self.stats.cases["split-" + case.kind] += 1
        try:
            self._run(case)
        except CaseFailure as exc:
            self.last_failure = (Case("split-" + case.kind, case.stream, case.chunks), str(exc))
            raise

    def _run(self, case: Case) -> None:
        t = self.target
        mark = t.log_mark()
        whole, closed_w, _ = self.feed(case.stream, [len(case.stream) or 1])
        split, closed_s, tr = self.feed(case.stream, case.chunks)
        if not (closed_w and closed_s):
            raise CaseFailure("the connection did not close after the end of the stream (a hang)")
        why = t.alive()
        if why:
            raise CaseFailure(why)
        rw, tw = parse_replies(whole)
        rs, ts = parse_replies(split)
        if tw or ts:
            raise CaseFailure("bytes after the last whole reply frame")
        model = FrameModel(t.token is not None, t.max_frame)
        exps = model.run(case.stream)
        if len(rw) != len(exps):  # no TCP here: every reply owed must come, refused frame or not
            raise CaseFailure(f"fed whole: {len(rw)} replies, the framing rules call for {len(exps)} "
                              f"({[cmd_name(e.cmd) for e in exps]}; got statuses {[st_ for st_, _ in rw]})")
        if normalized(rw) != normalized(rs):
            raise CaseFailure(f"the replies depend on how the stream was split:\nwhole {normalized(rw)}\n"
                              f"split {normalized(rs)}")
        for cmd in model.frames:
            self.stats.frames[cmd_name(cmd)] += 1
        if len(rs) != len(exps):
            raise CaseFailure(f"split: {len(rs)} replies, the framing rules call for {len(exps)} "
                              f"({[cmd_name(e.cmd) for e in exps]}; got statuses {[st_ for st_, _ in rs]})")
        for exp, (status, payload) in zip(exps, rs):
            self.stats.note_reply(exp, status, payload)
            problem = check_reply(exp, status, payload)
            if problem:
                raise CaseFailure(problem)
        if model.closed:
            self.stats.early_closes[model.closed] += 1
            if not any(tr.peer in line for _, line in t.log_since(mark)):
                raise CaseFailure(f"closed ({model.closed}) without a log line")
        errors = [line for level, line in t.log_since(mark) if level >= logging.ERROR]
        if errors:
            raise CaseFailure("the server logged an unexpected failure:\n" + "\n".join(errors[:10]))
        deadline = time.monotonic() + self.timeout
        while (t.allocated() or t.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.005)
        if t.allocated():
            raise CaseFailure(f"{t.allocated()} bytes still allocated after the connection closed")


# --- regression replays -----------------------------------------------------------------------------------------

def case_from_file(path: str, chunks: Optional[list] = None) -> Case:
    """A kept stream; its name says the server it needs (`token-...` for one with a token)."""
    with open(path, "rb") as fh:
        data = fh.read()
    kind = os.path.basename(path).rsplit(".", 1)[0]
    return Case(kind, data, chunks or [len(data) or 1])


def is_raw_kind(path: str) -> bool:
    """Whether a kept stream starts from a connection's first byte without setup to bind (its
    placeholders, if any, stay unknown ids), so the split runner can feed it too."""
    return os.path.basename(path).startswith(("raw-", "token-raw-", "split-raw-", "split-token-raw-"))


# --- campaigns (also used by the tests) -------------------------------------------------------------------------

FUZZERS: dict[str, tuple[Callable[[], st.SearchStrategy], bool, str]] = {
    # name: (strategy, token server, runner: "socket" or "split")
    "raw": (lambda: raw_streams(False), False, "socket"),
    "token-raw": (lambda: raw_streams(True), True, "socket"),
    "split": (lambda: raw_streams(False), False, "split"),
    "token-split": (lambda: raw_streams(True), True, "split"),
    "session": (lambda: session_cases(False), False, "socket"),
    "token-session": (lambda: session_cases(True), True, "socket"),
    "graph": (lambda: session_cases(False, graph_only=True), False, "socket"),
}


# --- pressure cases: what a client can make the server hold -----------------------------------------------------
# Not drawn by hypothesis: each builds one hostile load against a child server of its own (with the
# flags the case is about), samples the server's RSS while it runs, then checks that the load was
# refused and that the server still serves. A case returns its figures; a failure raises CaseFailure.

class RssSampler:
    """The peak RSS of a process, sampled every few milliseconds while in the `with` block."""

    def __init__(self, pid: int):
        self.proc = psutil.Process(pid)
        self.before = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.after = self.proc.memory_info().rss

    def figures(self) -> str:
        return f"RSS {self.before >> 20} MiB before, {self.peak >> 20} MiB peak, {self.after >> 20} MiB after"


BIG_FRAMES = ("--max-frame", str(1 << 30))  # what is refused is then --mem's doing, not the frame limit's


def _serves(tgt: "ProcessTarget") -> None:
    with Client(tgt.port, tgt.token) as c:
        if c.ok(Cmd.DEVICE_COUNT) != P.U32.pack(1):
            raise CaseFailure("DEVICE_COUNT: wrong reply after the load")


def _rec(bid: int, offset: int, dtype: int, shape: tuple, name: str) -> bytes:
    dims = list(shape) + [0] * (4 - len(shape))
    return TENSOR_STRUCT.pack(bid, offset, dtype, len(shape), *dims, name.encode())


def pressure_handshake_flood(n: int = 1000, timeout_s: float = 2.0, max_connections: Optional[int] = None) -> str:
    """n sockets that never finish the handshake (silent, HELLO only, half a header): the server
    answers those past --max-connections at once and closes the rest at --handshake-timeout; then
    a client is served. With max_connections above n, every one is held until the deadline."""
    extra = ("--handshake-timeout", str(timeout_s))
    if max_connections is not None:
        extra += ("--max-connections", str(max_connections))
    tgt = ProcessTarget(TOKEN, cache=False, extra=extra)
    socks: list[socket.socket] = []
    try:
        with RssSampler(tgt.proc.pid) as rss:
            refused = 0
            for i in range(n):
                s_ = socket.create_connection(("127.0.0.1", tgt.port))
                if i % 3 == 1:
                    s_.sendall(hello_frame())
                elif i % 3 == 2:
                    s_.sendall(hello_frame()[:5])
                socks.append(s_)
            deadline = time.monotonic() + timeout_s + 10
            closed = 0
            for s_ in socks:
                s_.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    data = b""
                    while True:
                        chunk = s_.recv(65536)
                        if not chunk:
                            break
                        data += chunk
                except (socket.timeout, ConnectionResetError):
                    if time.monotonic() >= deadline:
                        raise CaseFailure("an unauthenticated connection stayed open past the handshake deadline")
                closed += 1
                refused += b"--max-connections" in data
        _serves(tgt)
        return (f"{n} connections, {refused} refused at --max-connections, all closed within "
                f"{timeout_s:g} s + slack; {rss.figures()}")
    finally:
        for s_ in socks:
            s_.close()
        tgt.stop()


def pressure_mem_get_tensors(mem_mib: int = 1) -> str:
    """GET_TENSORS listing one 64 KiB region 8192 times (a 512 MiB reply) on two connections."""
    tgt = ProcessTarget(None, cache=False, mem_mib=mem_mib, extra=BIG_FRAMES)
    try:
        bad = None
        with RssSampler(tgt.proc.pid) as rss:
            msgs = []
            for _ in range(2):
                with Client(tgt.port) as c:
                    bid = P.ALLOC_REP.unpack(c.ok(Cmd.ALLOC_BUFFER, P.ALLOC_REQ.pack(0, 0, 64 << 10)))[0]
                    entry = _rec(bid, 0, 0, (16 << 10,), "kv") + P.REGION.pack(0, 64 << 10)
                    status, msg = c.call(Cmd.GET_TENSORS, P.U32.pack(8192) + entry * 8192)
                    if status != P.STATUS_ERROR or b"memory cap" not in msg:
                        bad = f"GET_TENSORS of 512 MiB under --mem {mem_mib}: status {status}"
                    msgs.append(msg[:200].decode(errors="replace"))
        if bad:
            raise CaseFailure(f"{bad}; {rss.figures()}")
        _serves(tgt)
        return f"refused ({msgs[0][:90]}...); {rss.figures()}"
    finally:
        tgt.stop()


def _rpc_backend(tgt: "ProcessTarget"):
    from pyllama.backend.rpc import RPCBackend  # noqa: PLC0415
    from pyllama.rpc.connection import Connection  # noqa: PLC0415
    conn = Connection(f"127.0.0.1:{tgt.port}")
    return conn, RPCBackend(conn)


def pressure_mem_moe_scratch(mem_mib: int = 20) -> str:
    """A MOE_FFN graph over 8.6 MiB of buffers whose kernel scratch is some 600 MiB."""
    from pyllama.rpc.connection import RPCError  # noqa: PLC0415
    from pyllama.ir.tensor import DType, Graph, Tensor, node  # noqa: PLC0415
    n, cols, n_exp, f = 16384, 64, 64, 16
    shapes = dict(x=(n, cols), r=(n_exp, cols), g=(n_exp, f, cols), u=(n_exp, f, cols), d=(n_exp, cols, f),
                  o=(n, cols))
    tgt = ProcessTarget(None, cache=False, mem_mib=mem_mib, extra=BIG_FRAMES)
    conn, rpc = _rpc_backend(tgt)
    try:
        total = sum(4 * int(np.prod(v)) for v in shapes.values())
        bad = None
        with RssSampler(tgt.proc.pid) as rss:
            buf = rpc.alloc_buffer(total)
            ts, off = {}, 0
            for name, shape in shapes.items():
                ts[name] = Tensor(DType.F32, shape, name, buf, off)
                off += 4 * int(np.prod(shape))
            rng = np.random.default_rng(0)
            for name in "xrgud":
                rpc.set_tensor(ts[name], rng.standard_normal(shapes[name]).astype(np.float32))
            rpc.graph_compute(Graph([node(Op.MOE_FFN, ts["o"], ts["x"], ts["r"], ts["g"], ts["u"], ts["d"],
                                          params=(n_exp, 1, 1.0))]))
            why = ""
            try:
                rpc.synchronize()
                bad = f"a MOE_FFN graph with 600 MiB of scratch ran under --mem {mem_mib}"
            except RPCError as exc:
                if "memory cap" not in str(exc):
                    raise CaseFailure(f"MOE_FFN refused for another reason: {exc}") from None
                why = str(exc)
            rpc.free_buffer(buf)
        if bad:
            raise CaseFailure(f"{bad}; {rss.figures()}")
        conn.close()
        _serves(tgt)
        return f"{total / 2**20:.1f} MiB of buffers, refused ({why.split('failed: ', 1)[-1][:90]}...); {rss.figures()}"
    finally:
        conn.close()
        tgt.stop()


def pressure_mem_repack_views(mem_mib: int = 16, views: int = 100) -> str:
    """`views` overlapping Q8_0 views of one weight in one graph: each a weight of its own, so each
    would get a repacked copy; past the cap they run on the file's layout instead."""
    from pyllama.ir.tensor import DType, Graph, Tensor, node  # noqa: PLC0415
    m, k, n = 1024, 4096, 1
    qtype = GGMLQuantizationType.Q8_0
    block, qsize = GGML_QUANT_SIZES[qtype]
    row = k // block * qsize
    rows = 256  # each view: 256 rows, 8 rows after the previous one
    views = min(views, (m - rows) // 8 + 1)
    tgt = ProcessTarget(None, cache=False, mem_mib=mem_mib, extra=BIG_FRAMES)
    conn, rpc = _rpc_backend(tgt)
    try:
        with RssSampler(tgt.proc.pid) as rss:
            wbuf = rpc.alloc_buffer(m * row, usage="weights")
            abuf = rpc.alloc_buffer(4 * n * k + 4 * n * rows * views)
            w = np.random.default_rng(1).integers(0, 256, (m, row), np.uint8)
            w.reshape(m, -1, qsize)[:, :, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # finite scales
            rpc.set_tensor(Tensor(DType.Q8_0, (m, k), "w", wbuf, 0), w)
            xt = Tensor(DType.F32, (n, k), "x", abuf, 0)
            rpc.set_tensor(xt, np.ones((n, k), np.float32))
            nodes = [node(Op.MUL_MAT, Tensor(DType.F32, (n, rows), f"o{i}", abuf, 4 * n * k + 4 * n * rows * i), xt,
                          Tensor(DType.Q8_0, (rows, k), f"w{i}", wbuf, 8 * i * row)) for i in range(views)]
            rpc.graph_compute(Graph(nodes))
            rpc.synchronize()
            rpc.free_buffer(wbuf)
            rpc.free_buffer(abuf)
        conn.close()
        _serves(tgt)
        copy = rows * row
        return (f"{views} views of {copy / 2**20:.1f} MiB each ({views * copy / 2**20:.0f} MiB if each were repacked), "
                f"computed; {rss.figures()}")
    finally:
        conn.close()
        tgt.stop()


PRESSURE: dict[str, Callable[[], str]] = {
    "handshake-flood": pressure_handshake_flood,
    "handshake-flood-held": lambda: pressure_handshake_flood(max_connections=2000),
    "mem-get-tensors": pressure_mem_get_tensors,
    "mem-moe-scratch": pressure_mem_moe_scratch,
    "mem-repack-views": pressure_mem_repack_views,
}


def run_pressure(names: list[str]) -> list[tuple[str, str, None]]:
    """Runs the pressure cases; prints each one's figures; returns the failures."""
    failures = []
    for name in names:
        try:
            print(f"[{name}] {PRESSURE[name]()}", flush=True)
        except Exception as exc:  # noqa: BLE001 - one failure must not end the others
            print(f"[{name}] FAILED: {exc}", flush=True)
            failures.append((name, f"{type(exc).__name__}: {str(exc).splitlines()[0]}", None))
    return failures


def hypothesis_settings(max_examples: int, derandomize: bool, quiet: bool = False) -> settings:
    return settings(max_examples=max_examples, deadline=None, derandomize=derandomize, database=None,
                    suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink],
                    print_blob=False, report_multiple_bugs=False,
                    verbosity=Verbosity.quiet if quiet else Verbosity.normal)


def run_batch(strategy: st.SearchStrategy, runner_fn: Callable[[Case], None], max_examples: int,
              seed: Optional[int] = None, stop_at: Optional[float] = None, quiet: bool = False) -> None:
    """Runs `max_examples` hypothesis examples (derandomized when no seed is given); after `stop_at`
    (a monotonic time) the remaining examples pass without running."""

    @hypothesis_settings(max_examples, derandomize=seed is None, quiet=quiet)
    @given(strategy)
    def prop(case: Case) -> None:
        if stop_at is not None and time.monotonic() > stop_at:
            return
        runner_fn(case)

    if seed is not None:
        prop = hseed(seed)(prop)
    prop()


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=1.0, help="how long to fuzz (all fuzzers in turn)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first batch (batch i uses seed + i)")
    ap.add_argument("--batch", type=int, default=50, help="examples per fuzzer per turn")
    ap.add_argument("--target", choices=["process", "thread"], default="process",
                    help="run the server as a child process (a crash is caught and the server restarted) or "
                         "in this process (also checks connections and bound graph plans); the split fuzzers "
                         "always drive an in-process server")
    ap.add_argument("--only", action="append", choices=sorted(FUZZERS), help="run only these fuzzers")
    ap.add_argument("--out", default=OUT_DIR, help="where failing inputs go")
    ap.add_argument("--pressure", action="append", choices=sorted(PRESSURE) + ["all", "none"],
                    help="pressure cases to run after the fuzzers (default all; each starts its own server)")
    args = ap.parse_args(argv)
    pressure = sorted(PRESSURE) if not args.pressure or "all" in args.pressure else \
        [p for p in args.pressure if p != "none"]
    names = args.only or sorted(FUZZERS)
    stats = Stats()
    targets: dict[tuple[bool, str], Target] = {}
    shared: dict[tuple[int, str], object] = {}
    runners: dict[str, object] = {}
    for name in names:
        _, token, kind = FUZZERS[name]
        where = "thread" if kind == "split" else args.target
        if (token, where) not in targets:
            make = ThreadTarget if where == "thread" else ProcessTarget
            targets[(token, where)] = make(TOKEN if token else None)
        tgt = targets[(token, where)]
        if (id(tgt), kind) not in shared:
            shared[(id(tgt), kind)] = (SplitRunner(tgt, stats, args.out) if kind == "split"
                                       else Runner(tgt, stats, args.out, keep_current=where == "thread"))
        runners[name] = shared[(id(tgt), kind)]
    socket_runners = [r for r in shared.values() if isinstance(r, Runner)]
    for r in socket_runners:
        r.start_rss()
    t0 = time.monotonic()
    stop_at = t0 + args.minutes * 60
    batch = 0
    try:
        while time.monotonic() < stop_at:
            for name in names:
                strat, _, _ = FUZZERS[name]
                runner = runners[name]
                try:
                    run_batch(strat(), runner.run, args.batch, seed=args.seed + batch, stop_at=stop_at, quiet=True)
                except Exception as exc:  # noqa: BLE001 - one failure must not end the campaign
                    path = runner.save_last_failure()
                    if path is None:
                        stats.failures.append((name, f"{type(exc).__name__}: {str(exc).splitlines()[0]}", None))
                    print(f"[{name}] FAILED: {str(exc).splitlines()[0]}" + (f" -> {path}" if path else ""),
                          flush=True)
                if time.monotonic() >= stop_at:
                    break
            batch += 1
        for r in socket_runners:
            try:
                r.check_rss(RSS_GROWTH_LIMIT)
            except CaseFailure as exc:
                stats.failures.append(("rss", str(exc), None))
    finally:
        elapsed = time.monotonic() - t0
        print(f"\nfuzzed for {elapsed:.0f} s, seeds {args.seed}..{args.seed + batch}, server as a {args.target}")
        print(stats.report())
        for r in socket_runners:
            print(f"server RSS ({type(r.target).__name__}, token={r.target.token is not None}): "
                  f"{r.rss0 >> 20} MiB before, {r.target.rss() >> 20} MiB after")
            if isinstance(r.target, ProcessTarget) and r.target.exits:
                print(f"  the server process died {len(r.target.exits)} time(s) (exit statuses {r.target.exits})")
            r.close()
        for t in targets.values():
            t.stop()
        if pressure:
            print("\npressure cases (each against a server of its own):")
            stats.failures.extend(run_pressure(pressure))
        if stats.failures:
            print(f"\n{len(stats.failures)} failing case(s):")
            for kind, msg, path in stats.failures:
                print(f"  [{kind}] {msg}" + (f"  -> {path}" if path else ""))
        else:
            print("\nno failures")
    return 1 if stats.failures else 0


if __name__ == "__main__":
    sys.exit(main())
