"""A hidden state leaving a CUDA device for an rpc peer goes once an event recorded after its read
completes, never after a synchronize of the producing stream; traced as `sched copy_event`. On the
fake device (tests/fake_cuda.py: streams run their queued work only when something waits)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pyllama.obs import trace


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    import fake_cuda  # noqa: PLC0415
    fake_cuda.install(monkeypatch, tmp_path / "kernels")
    return fake_cuda


@pytest.fixture
def peer():
    from pyllama.rpc.connection import get_connection  # noqa: PLC0415
    from pyllama.rpc_server.server import ServerThread  # noqa: PLC0415
    with ServerThread() as st:
        conn = get_connection(f"127.0.0.1:{st.port}")
        try:
            yield conn
        finally:
            conn.close()


def _count(monkeypatch, cls, name: str) -> list[int]:
    calls = [0]
    original = getattr(cls, name)

    def wrapped(self, *a, **k):
        calls[0] += 1
        return original(self, *a, **k)
    monkeypatch.setattr(cls, name, wrapped)
    return calls


def test_source_side_copy_waits_for_its_event_not_the_stream(fake_gpu, peer, monkeypatch):
    from pyllama.backend.base import DType, Tensor  # noqa: PLC0415
    from pyllama.backend.cpu import CPUBackend  # noqa: PLC0415
    from pyllama.backend.cuda import open_backend  # noqa: PLC0415
    from pyllama.backend.rpc import RPCBackend  # noqa: PLC0415
    gpu, remote, cpu = open_backend("CUDA0"), RPCBackend(peer, 0, "RPC0"), CPUBackend(1)
    try:
        assert gpu.can_copy_to(remote) and not gpu.can_copy_to(cpu) and not remote.can_copy_from(gpu)
        src, dst = Tensor(DType.F32, (4, 8), "l_out-0"), Tensor(DType.F32, (4, 8), "l_out-0")
        sbuf, dbuf = gpu.alloc_buffer(256, usage="compute"), remote.alloc_buffer(256, usage="compute")
        src.buffer, src.offset, dst.buffer, dst.offset = sbuf, 0, dbuf, 0
        data = np.arange(32, dtype=np.float32).reshape(4, 8)
        gpu.set_tensor(src, data)  # a compute buffer: queued on the stream, not yet done
        stream = gpu._lane().stream
        assert stream.q, "the fake stream should still hold the write"
        syncs = _count(monkeypatch, fake_gpu.Stream, "synchronize")
        waits = _count(monkeypatch, fake_gpu.Event, "synchronize")
        assert gpu.cpy_tensor_from_async(src, dst)
        assert syncs[0] == 0 and waits[0] == 1
        np.testing.assert_array_equal(remote.get_tensor(dst).reshape(4, 8), data)
        lane = gpu._lane()
        assert not lane.pinned_used, "the staging went back for reuse"
        # a destination that would read the pinned bytes later (another local device) declines
        other = Tensor(DType.F32, (4, 8), "x")
        other.buffer, other.offset = cpu.alloc_buffer(256), 0
        assert not gpu.cpy_tensor_from_async(src, other)
    finally:
        remote.close()
        gpu.close()


def test_split_cuda_to_peer_needs_no_stream_synchronize(fake_gpu, peer, model_factory, monkeypatch, tmp_path):
    """CUDA0 computes the first layer, the peer the rest and the logits: the decode's logits match
    the CPU's, the scheduler planned the copy as source-side, and no CUDA stream was synchronized
    during a step; traced, the copy is one copy_event span and the device spans still arrive."""
    from pyllama.backend.cuda import open_backend  # noqa: PLC0415
    from pyllama.backend.rpc import RPCBackend  # noqa: PLC0415
    from pyllama.runtime.context import Batch  # noqa: PLC0415
    from pyllama.runtime.engine import Engine  # noqa: PLC0415
    path = model_factory("tiny", wtype="f16")
    cpu = Engine(path, n_threads=1)
    split = Engine(path, n_threads=1, backends=[open_backend("CUDA0"), RPCBackend(peer, 0, "RPC0")],
                   tensor_split=[1, 1])
    out_path = None
    try:
        prompt = cpu.tokenizer.encode("The cat sat on the mat")
        want_ctx, got_ctx = cpu.new_context(128, 1), split.new_context(128, 1)
        want = want_ctx.decode(Batch.for_sequence(prompt, 0, 0)).logits[-1].copy()
        got = got_ctx.decode(Batch.for_sequence(prompt, 0, 0)).logits[-1].copy()
        assert np.abs(got - want).max() / np.abs(want).max() < 2e-3  # F16 activations on the device
        out_path = trace.start(str(tmp_path / "t.jsonl"), "generate")
        syncs = _count(monkeypatch, fake_gpu.Stream, "synchronize")
        waits = _count(monkeypatch, fake_gpu.Event, "synchronize")
        tok = int(want.argmax())
        got = got_ctx.decode(Batch.for_sequence([tok], len(prompt), 0)).logits[-1].copy()
        want = want_ctx.decode(Batch.for_sequence([tok], len(prompt), 0)).logits[-1].copy()
        assert np.abs(got - want).max() / np.abs(want).max() < 2e-3
        assert syncs[0] == 0, "a CUDA stream was synchronized during the step"
        assert waits[0] >= 1
    finally:
        trace.close()
        split.close()
        cpu.close()
    events = [json.loads(x) for x in open(out_path).read().splitlines()[1:]]
    kinds = [(e["c"], e["n"]) for e in events]
    assert kinds.count(("sched", "copy_event")) == 1 and ("sched", "copy_stage") not in kinds
    copy = next(e for e in events if e["n"] == "copy_event")
    assert copy["backend"] == "RPC0" and copy["nbytes"] == 64 * 4 * 1
    assert ("dev", "compute CUDA0") in kinds  # collected when the copy's event completed
