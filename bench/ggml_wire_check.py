"""pyllama's client of ggml's RPC protocol against llama.cpp's own rpc-server (needs --peers).

    python bench/ggml_wire_check.py --peers DIR [--threads 1]

Starts `ggml-rpc-server` from DIR/bin on a free loopback port and drives it with
pyllama.backend.ggml.connection.GGMLConnection: recognition at connect, every replying command,
tensor writes and reads, and graphs of ggml ops (ADD, MUL_MAT against F32 weights and against Q8_0
weights as the file's bytes, RMS_NORM) computed by the peer and compared with numpy (the Q8_0
product with pyllama's own); then GRAPH_RECOMPUTE after new inputs,
COPY_TENSOR, MEMSET_TENSOR, BUFFER_CLEAR, and a request the peer must refuse (it closes the
connection; the client must say so in one line). Prints one line per check; exits 1 when any fails.
"""
from __future__ import annotations

import argparse
import tempfile
import os
import struct
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from peers import Peers  # noqa: E402
from pipeline_cells import GgmlRpcPeer  # noqa: E402
from pyllama._fast.wire import fnv1a64  # noqa: E402
from pyllama._fast import qmatmul  # noqa: E402
from pyllama.backend.ggml import protocol as P  # noqa: E402
from pyllama.backend.ggml.connection import GGMLConnection, identify  # noqa: E402
from pyllama.rpc.connection import RPCError  # noqa: E402

failures: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")
    if not ok:
        failures.append(name)


class Arena:
    """Tensors laid out one after another in one remote buffer."""

    def __init__(self, conn: GGMLConnection, device: int, size: int):
        self.conn = conn
        self.ptr, self.size = conn.alloc_buffer(device, size)
        self.base = conn.buffer_base(self.ptr)
        self.align = conn.alignment(device)
        self.used = 0
        self.next_id = 1

    def tensor(self, ggml_type: int, ne: list[int], name: str, **kw) -> np.void:
        rec = P.tensor_record(self.next_id, ggml_type, ne, buffer=self.ptr, data=self.base + self.used,
                              name=name, **kw)
        self.next_id += 1
        self.used += (P.tensor_nbytes(rec) + self.align - 1) // self.align * self.align
        assert self.used <= self.size
        return rec

    def put(self, rec: np.void, arr: np.ndarray | bytes) -> None:
        data = arr if isinstance(arr, bytes) else np.ascontiguousarray(arr).tobytes()
        self.conn.set_tensor(rec, 0, data)

    def get_f32(self, rec: np.void, shape: tuple[int, ...]) -> np.ndarray:
        raw = self.conn.get_tensor(rec, 0, P.tensor_nbytes(rec))
        return np.frombuffer(raw, dtype=np.float32).reshape(shape)


def op(arena: Arena, code: str, ne: list[int], srcs: list[np.void], name: str, params: bytes = b"") -> np.void:
    # a node without the compute flag is skipped by ggml's backends (ggml_build_forward_expand sets it)
    return arena.tensor(int(T.F32), ne, name, op=int(P.GOp[code]), src=[int(s["id"]) for s in srcs],
                        op_params=params, flags=P.FLAG_COMPUTE)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default=os.environ.get("PYLLAMA_PEERS"), help="llama.cpp's programs (DIR/bin)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    peers = Peers.find(a.peers) if a.peers else None
    if peers is None or not os.path.isfile(peers.path("ggml-rpc-server")):
        raise SystemExit("--peers DIR with bin/ggml-rpc-server is needed")
    peer = GgmlRpcPeer(peers, a.threads)
    try:
        ep = peer.endpoint
        kind, version = identify(ep)
        check("recognised at connect", kind == "ggml" and tuple(version)[:2] == P.VERSION[:2],
              f"{kind} {P.version_text(version)}")
        conn = GGMLConnection(ep)
        n = conn.device_count()
        free, total = conn.device_memory(0)
        check("DEVICE_COUNT, GET_DEVICE_MEMORY", n >= 1 and 0 < free <= total,
              f"{n} device(s), device 0 {free >> 20} MiB free of {total >> 20}")
        check("GET_ALIGNMENT, GET_MAX_SIZE", conn.alignment(0) >= 1 and conn.max_size(0) > 0,
              f"{conn.alignment(0)} B, max {conn.max_size(0)}")
        ar = Arena(conn, 0, 4 << 20)
        check("ALLOC_BUFFER, BUFFER_GET_BASE", ar.ptr != 0 and ar.base != 0, f"{ar.size} B at {ar.base:#x}")
        rng = np.random.default_rng(0)

        # set and get back
        x = rng.standard_normal((3, 64)).astype(np.float32)          # 3 rows of 64: ne = [64, 3]
        tx = ar.tensor(int(T.F32), [64, 3], "x")
        ar.put(tx, x)
        check("SET_TENSOR then GET_TENSOR", np.array_equal(ar.get_f32(tx, (3, 64)), x))

        # a graph: y = x + x2; mm = w @ x (F32 and Q8_0 weights); n = rms_norm(x)
        x2 = rng.standard_normal((3, 64)).astype(np.float32)
        tx2 = ar.tensor(int(T.F32), [64, 3], "x2")
        ar.put(tx2, x2)
        w = rng.standard_normal((16, 64)).astype(np.float32)
        tw = ar.tensor(int(T.F32), [64, 16], "w")
        ar.put(tw, w)
        wq = quantize(w, T.Q8_0)
        twq = ar.tensor(int(T.Q8_0), [64, 16], "wq")
        ar.put(twq, wq.tobytes())
        y = op(ar, "ADD", [64, 3], [tx, tx2], "y")
        mm = op(ar, "MUL_MAT", [16, 3], [tw, tx], "mm")
        mmq = op(ar, "MUL_MAT", [16, 3], [twq, tx], "mmq")
        eps = 1e-5
        nrm = op(ar, "RMS_NORM", [64, 3], [tx], "norm", params=struct.pack("<f", eps))
        recs = np.array([tx, tx2, tw, twq, y, mm, mmq, nrm], dtype=P.RPC_TENSOR)
        conn.graph_compute(0, [int(t["id"]) for t in (y, mm, mmq, nrm)], recs)

        def results() -> tuple[np.ndarray, ...]:
            return (ar.get_f32(y, (3, 64)), ar.get_f32(mm, (3, 16)), ar.get_f32(mmq, (3, 16)),
                    ar.get_f32(nrm, (3, 64)))

        gy, gmm, gmmq, gn = results()
        check("GRAPH_COMPUTE: ADD", np.allclose(gy, x + x2, atol=1e-6))
        ref = x @ w.T
        check("GRAPH_COMPUTE: MUL_MAT F32", np.allclose(gmm, ref, rtol=1e-4, atol=1e-4),
              f"max |diff| {np.abs(gmm - ref).max():.2e}")
        # ggml quantizes the activations to Q8_0 as pyllama's own product does: the two agree far
        # more closely than either does with the float product
        ours = np.zeros((3, 16), np.float32)
        qmatmul.mul_mat_q(x, np.ascontiguousarray(wq).reshape(16, -1), int(T.Q8_0), ours)
        approx = x @ dequantize(wq, T.Q8_0).reshape(16, 64).T
        check("GRAPH_COMPUTE: MUL_MAT Q8_0 (file bytes)", np.allclose(gmmq, ours, rtol=1e-5, atol=1e-5),
              f"max |diff| {np.abs(gmmq - ours).max():.2e} against pyllama's Q8_0 product "
              f"({np.abs(gmmq - approx).max():.2e} against the float product)")
        refn = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + eps)
        check("GRAPH_COMPUTE: RMS_NORM (eps in op_params)", np.allclose(gn, refn, rtol=1e-5, atol=1e-5),
              f"max |diff| {np.abs(gn - refn).max():.2e}")

        # new inputs, the stored graph again
        x_new = rng.standard_normal((3, 64)).astype(np.float32)
        ar.put(tx, x_new)
        conn.graph_recompute(0)
        gy, gmm, _, _ = results()
        check("GRAPH_RECOMPUTE", np.allclose(gy, x_new + x2, atol=1e-6) and
              np.allclose(gmm, x_new @ w.T, rtol=1e-4, atol=1e-4))

        tcopy = ar.tensor(int(T.F32), [64, 3], "copy")
        ok = conn.copy_tensor(tx2, tcopy)
        check("COPY_TENSOR", ok and np.array_equal(ar.get_f32(tcopy, (3, 64)), x2))
        conn.memset_tensor(tcopy, 4 * 64, 4 * 64, 0)
        got = ar.get_f32(tcopy, (3, 64))
        check("MEMSET_TENSOR", np.array_equal(got[1], np.zeros(64, np.float32)) and np.array_equal(got[0], x2[0]))
        conn.buffer_clear(ar.ptr, 0)
        check("BUFFER_CLEAR", not ar.get_f32(tx, (3, 64)).any())

        # a request the peer refuses: it closes the connection, and the client says so once
        try:
            conn.free_buffer(ar.ptr + 8)
            check("a refused request becomes one error", False, "no error")
        except RPCError as exc:
            later = None
            try:
                conn.device_count()
            except RPCError as exc2:
                later = str(exc2)
            check("a refused request becomes one error", "FREE_BUFFER" in str(exc) and later == str(exc), str(exc))
        conn.close()
        conn = GGMLConnection(ep)     # the peer serves the next client; its buffers went with the last
        check("a new connection after the refusal", conn.device_count() == n)
        conn.close()
    finally:
        peer.stop()
    with tempfile.TemporaryDirectory() as cache:   # rpc-server -c keeps long writes under their hash
        peer = GgmlRpcPeer(peers, a.threads, args=["-c"], env={"LLAMA_CACHE": cache})
        try:
            conn = GGMLConnection(peer.endpoint)
            ar = Arena(conn, 0, 24 << 20)
            data = np.random.default_rng(0).standard_normal((11 << 20) // 4).astype(np.float32)
            first = ar.tensor(0, [data.size], "w0")
            second = ar.tensor(0, [data.size], "w1")
            h = fnv1a64(data)
            missed = conn.set_tensor_hash(first, 0, h)
            ar.put(first, data)
            hit = conn.set_tensor_hash(second, 0, h)
            check("SET_TENSOR_HASH: a write the peer kept (rpc-server -c) is not sent again",
                  not missed and hit and np.array_equal(ar.get_f32(second, (data.size,)), data),
                  f"hash {h:016x}: before the write {missed}, after it {hit}; kept {sorted(os.listdir(cache))}")
            conn.close()
        finally:
            peer.stop()
    print(f"{len(failures)} check(s) failed" if failures else "every check passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
