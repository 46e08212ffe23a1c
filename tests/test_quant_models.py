"""Whole models with quantized weights kept in their block layout: greedy tokens against the
float64 reference (which quantizes activations as ggml does), identical tokens over every split,
the upload to a CPU peer in the file's bytes, resident memory after load, and bad files refused
at load with one line."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants

from pyllama.backend.cpu import CPUBackend
from pyllama.backend.rpc import RPCBackend
from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
from pyllama.models.gguf_file import GGUFFile
from pyllama.obs import rpc_stats as stats
from pyllama.rpc.connection import get_connection
from pyllama.rpc.protocol import Cap
from pyllama.rpc_server.server import ServerThread
from pyllama.ir.tensor import DType, Graph, Op, Tensor, node
from reference_forward import reference_logits
from engine_util import greedy, placed
from server_util import assert_same_tokens_in_two_groups, generated_tokens

PROMPT = "The little cat sat on the"
# (preset, --type): the K-quants need rows of 256; the small preset's 288-wide rows fall back to
# other types as llama.cpp's quantizer does (so those files mix types, like the _M mixes)
MODELS = [("tiny", "q8_0"), ("tiny", "q4_0"), ("small", "q4_k"), ("small", "q6_k"), ("small", "q4_k_m"),
          ("small", "q5_k_m"), ("tiny256", "q4_k_m"), ("tiny256", "q5_k_m"), ("tiny256", "q6_k"),
          ("tiny", "iq4_nl"), ("tiny", "mxfp4"), ("tiny256", "iq4_xs"), ("small", "iq4_xs_mix"),
          ("tiny256", "tq1_0"), ("tiny256", "tq2_0")]


@pytest.mark.parametrize("preset,wtype", MODELS)
def test_greedy_tokens_match_the_reference(model_factory, preset, wtype):
    path = model_factory(preset, wtype=wtype)
    engine = Engine(path, n_threads=2)
    try:
        prompt = engine.tokenizer.encode(PROMPT)
        # every weight stays in its file type (no F32 copy), on the CPU device
        files = engine.model.file.tensors
        for name, (fnames, _) in engine.model.logical_weights().items():
            w = engine.weights[name]
            parts = w if isinstance(w, tuple) else (w,)
            assert {t.dtype for t in parts} == {files[f].qtype for f in fnames}, name
        tokens = greedy(engine, prompt, 12)
        # every Q4_0 / Q8_0 / Q4_K / Q6_K matrix (rows in 8s) ran on its copy in groups of 8 rows
        cpu = engine.backends[0]
        x8 = [t for w in engine.weights.tensors.values() for t in (w if isinstance(w, tuple) else (w,))
              if t.dtype in (DType.Q4_0, DType.Q8_0, DType.Q4_K, DType.Q5_K, DType.Q6_K) and len(t.shape) == 2
              and t.shape[0] % 8 == 0]
        if preset in ("tiny", "tiny256") and not wtype.startswith(("iq4", "mxfp4", "tq")):  # those have no x8 copy
            assert x8 and all(cpu.layout.packed(t) is not None for t in x8)
            assert cpu.layout.packed_weights() == len({(id(t.buffer), t.offset) for t in x8})
    finally:
        engine.close()
    ref = reference_logits(path, prompt + tokens)[len(prompt) - 1:-1]  # the logits each token came from
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 1e-2 * np.abs(ref).max()
    assert clear.sum() >= len(tokens) // 2, "too few steps with a clear margin to compare"
    # the reference runs on pyllama's own tokens, so every clear step compares like with like
    for i in np.flatnonzero(clear):
        assert tokens[i] == int(ref[i].argmax()), f"step {i}: {tokens[i]} vs the reference's {int(ref[i].argmax())}"


def test_mixed_types_run_as_one_node_per_product(model_factory):
    """Q4_K_M-style mixes give q|k|v parts of different types: one MUL_MAT_CAT node, each part
    stored as the file has it, with the same result as the product against the rows joined."""
    path = model_factory("small", wtype="q4_k_m")
    engine = Engine(path, n_threads=1)
    try:
        mixed = [name for name, w in engine.weights.tensors.items() if isinstance(w, tuple)]
        assert mixed, "the q4_k_m mix should give some layer parts of different types"
        qkv = engine.weights[mixed[0]]
        assert len({t.dtype for t in qkv}) == len(qkv) > 1
        ctx = engine.new_context(64, 1)
        nodes = ctx._plan(1, 1).splits[0].graph.nodes
        assert sum(nd.op == Op.MUL_MAT_CAT for nd in nodes) == len(mixed)
    finally:
        engine.close()


def test_mul_mat_cat_equals_the_products_joined():
    rng = np.random.default_rng(1)
    b = CPUBackend(1)
    k, rows = 256, (32, 16, 8)
    x = rng.standard_normal((3, k)).astype(np.float32)
    types = (QT.Q8_0, QT.Q4_0, QT.F32)
    raws = [quants.quantize(rng.standard_normal((m, k)).astype(np.float32), t) for m, t in zip(rows, types)]
    bias = rng.standard_normal(sum(rows)).astype(np.float32)

    xt = placed(b, DType.F32, x.shape, x)
    parts = [placed(b, t, (m, k), r) for t, m, r in zip(types, rows, raws)]
    bt = placed(b, DType.F32, bias.shape, bias)
    out = placed(b, DType.F32, (3, sum(rows)))
    b.graph_compute(Graph([node(Op.MUL_MAT_CAT, out, xt, *parts, bt, params=(3,))]))
    got = b.get_tensor(out)
    col = 0
    for p in parts:
        one = placed(b, DType.F32, (3, p.shape[0]))
        b.graph_compute(Graph([node(Op.MUL_MAT, one, xt, p)]))
        np.testing.assert_array_equal(got[:, col:col + p.shape[0]], b.get_tensor(one) + bias[col:col + p.shape[0]])
        col += p.shape[0]
    with pytest.raises(ValueError, match="MUL_MAT_CAT"):  # a part count that does not fit the sources
        b.graph_compute(Graph([node(Op.MUL_MAT_CAT, out, xt, *parts, bt, params=(5,))]))


@pytest.mark.parametrize("preset,wtype", [("tiny", "q8_0"), ("small", "q4_k_m"), ("small", "q5_k_m"),
                                          ("tiny256", "q4_k_m"), ("tiny256", "iq4_xs"), ("tiny", "mxfp4"),
                                          ("tiny256", "tq1_0")])
def test_tokens_identical_over_splits_and_groups(model_factory, rpc_peer, preset, wtype):
    model = model_factory(preset, wtype=wtype)
    local = generated_tokens(model, PROMPT, 16)
    assert generated_tokens(model, PROMPT, 16, "--rpc", rpc_peer.endpoint, "--device", "RPC0,CPU") == local
    assert generated_tokens(model, PROMPT, 16, "--rpc", rpc_peer.endpoint, "--device", "CPU,RPC0") == local
    assert_same_tokens_in_two_groups(model, PROMPT, 16, local)


def test_a_cpu_peer_gets_the_files_bytes(model_factory):
    """Every weight reaches a CPU peer in its file type: the upload is the file's weight bytes
    (within 1%), and the peer computes what the local CPU computes."""
    path = model_factory("small", wtype="q4_k_m")
    gf = GGUFFile(path)
    file_bytes = sum(t.raw.size for t in gf.tensors.values())
    with ServerThread() as st:
        conn = get_connection(f"127.0.0.1:{st.port}")
        assert conn.has(Cap.DEVICE_TYPES)
        backend = RPCBackend(conn, 0, "RPC0")
        assert {QT.Q4_K, QT.Q5_0, QT.Q6_K, QT.Q8_0} <= backend.weight_types
        stats.reset()  # the counts are kept whether or not they are printed
        remote = Engine(path, n_threads=1, backends=[backend], tensor_split=[1])
        counts, _ = stats.snapshot()
        local = Engine(path, n_threads=1)
        try:
            sent = sum(c[1] for name, c in counts.items() if name.startswith("SET_TENSOR"))
            assert file_bytes <= sent <= file_bytes * 1.01, (sent, file_bytes)
            prompt = remote.tokenizer.encode(PROMPT)
            batch = Batch.for_sequence(prompt, 0, 0)
            np.testing.assert_array_equal(remote.new_context(64, 1).decode(batch).logits,
                                          local.new_context(64, 1).decode(batch).logits)
        finally:
            remote.close()
            local.close()
            conn.close()


RSS_SCRIPT = """
import json, sys, psutil
from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
e = Engine(sys.argv[1], n_threads=1)
ctx = e.new_context(512, 1)
ctx.decode(Batch.for_sequence(e.tokenizer.encode("The little cat sat on the mat"), 0, 0))
tensors = sum(t.raw.size for t in e.model.file.tensors.values())
print(json.dumps({"rss": psutil.Process().memory_info().rss, "tensors": tensors,
                  "context": sum(ctx.device_bytes().values())}))
"""


def test_resident_memory_after_loading_a_q4_k_m_model(model_factory):
    path = model_factory("small", wtype="q4_k_m")
    proc = subprocess.run([sys.executable, "-c", RSS_SCRIPT, path], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout)
    # an F32 copy of the weights alone (4.6x the file) would be far above this
    assert m["rss"] <= m["tensors"] + m["context"] + (150 << 20), m


def test_types_converted_on_the_host_for_half_precision_devices():
    """WeightLayout.set_weight, what a GPU device uses for the block types it has no kernel for: the
    values gguf dequantizes, rounded to F16 / BF16."""
    rng = np.random.default_rng(3)
    b = CPUBackend(1)
    for qtype in (QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0):
        raw = quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), qtype)
        want = quants.dequantize(raw, qtype).astype(np.float32)
        for half in (DType.F16, DType.BF16):
            t = Tensor(half, (4, 64), "w")
            t.buffer = b.alloc_buffer(t.nbytes)
            b.layout.set_weight(t, 0, qtype, raw.reshape(-1))
            got = b.bytes_of(t).view(np.uint16).reshape(4, 64)
            if half == DType.F16:
                np.testing.assert_array_equal(got, want.astype(np.float16).view(np.uint16))
            else:
                bits = want.view(np.uint32).astype(np.uint64)
                np.testing.assert_array_equal(got, ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16))


# --- bad files ------------------------------------------------------------------------------------
def _tensor_info_at(data: bytes, name: str) -> int:
    """Offset of a tensor's n_dims field in a GGUF header."""
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key)
    return at + len(key)


def _run_generate(path: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyllama.generate", "-m", path, "-p", "hi", "-n", "1"],
                          capture_output=True, text=True, timeout=60)


def _refused(path: str, *needles: str) -> None:
    proc = _run_generate(path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_an_unsupported_weight_type_is_one_line(model_factory, tmp_path):
    data = bytearray(open(model_factory("tiny256", wtype="q3_k"), "rb").read())
    at = _tensor_info_at(data, "blk.0.attn_q.weight")
    n_dims = struct.unpack_from("<I", data, at)[0]
    type_at = at + 4 + 8 * n_dims
    assert struct.unpack_from("<I", data, type_at)[0] == QT.Q3_K
    struct.pack_into("<I", data, type_at, QT.Q1_0)  # fewer bytes per 256 elements: the data still fits
    bad = tmp_path / "q1_0.gguf"
    bad.write_bytes(data)
    _refused(str(bad), "blk.0.attn_q.weight", "Q1_0")


def test_a_row_that_is_not_whole_blocks_is_one_line(model_factory, tmp_path):
    data = bytearray(open(model_factory("tiny", wtype="q4_0"), "rb").read())
    at = _tensor_info_at(data, "blk.0.attn_q.weight")
    assert struct.unpack_from("<Q", data, at + 4)[0] == 64
    struct.pack_into("<Q", data, at + 4, 48)  # ne[0], the row: 1.5 blocks of 32
    bad = tmp_path / "rows.gguf"
    bad.write_bytes(data)
    _refused(str(bad), "blk.0.attn_q.weight", "Q4_0 blocks")


def test_a_truncated_quantized_tensor_is_one_line(model_factory, tmp_path):
    path = model_factory("tiny", wtype="q4_0")
    gf = GGUFFile(path)
    last = max((t for t in gf.tensors.values() if t.qtype == QT.Q4_0), key=lambda t: t.offset)
    assert all(t.offset < last.offset for t in gf.tensors.values() if t is not last)  # the file ends with it
    data = open(path, "rb").read()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:last.offset + last.raw.size // 2])
    _refused(str(bad), last.name, "truncated")


def test_no_repack_keeps_the_file_layout_and_fuses(model_factory):
    """--no-repack: no copy in groups of 8 rows, and weights one product uses (q|k|v of one type,
    gate|up) fused again as for every other type; with repacking they stay apart, read in place."""
    path = model_factory("tiny256", wtype="q4_k")
    for repack in (False, True):
        engine = Engine(path, n_threads=1, repack=repack)
        try:
            cpu = engine.backends[0]
            assert bool(cpu.layout.packed_weights()) == repack and cpu.layout.repack == repack
            gate_up = [w for name, w in engine.weights.tensors.items() if "ffn_gate_up" in name or "gate_up" in name]
            assert gate_up, sorted(engine.weights.tensors)[:20]
            assert isinstance(gate_up[0], tuple) == repack
            assert len(greedy(engine, engine.tokenizer.encode(PROMPT), 4)) == 4
        finally:
            engine.close()


def test_rpc_server_no_repack_flag():
    """`rpc_server -nr` declines the repacked copies (it says so at start); by default it makes them."""
    from server_util import RPCServerProcess  # noqa: PLC0415
    for args, want in (((), "repacked in groups of 8 rows: yes"), (("-nr",), "repacked in groups of 8 rows: no")):
        p = RPCServerProcess(*args)
        try:
            deadline = time.monotonic() + 10
            while not any(want in line for line in p.log) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert any(want in line for line in p.log), p.log
        finally:
            p.stop()



FILE_RSS_SCRIPT = """
import sys
from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
e = Engine(sys.argv[1], n_threads=1, repack=sys.argv[2] == "1")
e.new_context(64, 1).decode(Batch.for_sequence(e.tokenizer.encode("The little cat sat on the mat"), 0, 0))
rss, cur = 0, None
for line in open("/proc/self/smaps"):
    f = line.split()
    if "-" in f[0] and ":" not in f[0]:
        cur = f[5] if len(f) > 5 else None
    elif line.startswith("Rss:") and cur == sys.argv[1]:
        rss += int(f[1])
print(rss * 1024, e.backends[0].layout.packed_weights())
"""


def test_repacked_weights_leave_their_file_pages(model_factory):
    """A weight read in place from the file and repacked no longer holds its file pages: after a
    decode (repacking read every page of those weights), most of their bytes are not resident.
    Without repacking nothing is repacked."""
    path = model_factory("tiny256", wtype="q4_k_m")
    got = {}
    for repack in ("1", "0"):
        proc = subprocess.run([sys.executable, "-c", FILE_RSS_SCRIPT, path, repack], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        got[repack] = tuple(map(int, proc.stdout.split()))
    assert got["1"][1] > 0 and got["0"][1] == 0
    repacked = sum(t.raw.size for t in GGUFFile(path).tensors.values()
                   if t.qtype in (QT.Q4_K, QT.Q6_K) and len(t.shape) == 2 and t.shape[0] % 8 == 0)
    assert got["1"][0] < 0.5 * repacked, (got, repacked)


@pytest.mark.parametrize("tied", [False, True])
def test_token_embedding_is_repacked_only_when_the_output_multiplies_by_it(model_factory, tied):
    """Rows of the token embedding are looked up in the file's layout: a repacked copy made at
    load would go unused (and the pages it let go would come back) unless the output layer is
    tied to it."""
    path = model_factory("tiny256", wtype="q4_k_m", tied=tied)
    engine = Engine(path, n_threads=1)
    try:
        cpu = engine.backends[0]
        embd = engine.weights.tensors["token_embd"]
        assert embd.dtype in (DType.Q4_K, DType.Q6_K) and embd.buffer.mapped
        entry = cpu.layout._packed.get(id(embd.buffer), (None, {}))[1]
        assert any(key[:2] == (embd.offset, embd.nbytes) for key in entry) == tied  # (offset, size, type, shape)
        assert (engine.weights.tensors["output"] is embd) == tied
        assert cpu.layout.packed_weights() > 0  # the blocks' matrices are repacked either way
        assert greedy(engine, engine.tokenizer.encode(PROMPT), 4)
    finally:
        engine.close()
