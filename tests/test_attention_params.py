"""ATTENTION's parameters by name (ir.tensor.AttentionParams), decoded in one place for the CPU and
CUDA backends and the rpc server, and devices asked about each node of a graph (supports_node)."""
from __future__ import annotations

import pytest

from pyllama.backend.cpu import CPUBackend
from pyllama.ir.tensor import F32, FAMILY_OPS, AttentionParams, Op, Tensor, family_node, node
from pyllama.models.model import Model
from pyllama.models.weights import Placement, load_weights
from pyllama.runtime.context import Context
from pyllama.util.errors import UnsupportedOpError

BASE = (8, 2, 64, 64, 0, 10000.0, 1.0, 1e-6, 0.125)


def test_round_trip_and_extensions():
    plain = AttentionParams.of(BASE, 9)
    assert plain.n_head == 8 and plain.scale == 0.125 and not plain.extended and plain.params() == BASE
    assert AttentionParams.of(BASE + (0.0, 0.0, 0.0), 9).params() == BASE  # 12 zeros: rope_mscale 0 reads as 1
    swa = AttentionParams.of(BASE + (0.0, 16.0, 1.0), 9)
    assert swa.n_swa == 16 and swa.extended and swa.params() == BASE + (0.0, 16.0, 1.0)
    assert AttentionParams.of(BASE, 8).rope_freqs and AttentionParams.of(BASE, 10).extended  # rope_freqs source
    assert AttentionParams.of(BASE + (30.0, 0.0, 1.0), 9).softcap == 30.0


def _attention_node(params: tuple, n_srcs: int):
    srcs = tuple(Tensor(F32, (1,), f"s{i}") for i in range(n_srcs))
    return node(Op.ATTENTION, Tensor(F32, (1, 1), "out"), *srcs, params=params, layer=0)


class _NoFamilyOps(CPUBackend):
    def supports(self, op: int) -> bool:
        return op not in FAMILY_OPS and super().supports(op)


@pytest.mark.parametrize("params,n_srcs,needs", [(BASE, 7, False), (BASE, 9, False), (BASE, 8, True),
                                                 (BASE + (0.0, 4.0, 1.0), 9, True),
                                                 (BASE + (0.0, 0.0, 1.0), 7, False)])
def test_a_device_is_asked_about_the_node_not_only_its_op(params, n_srcs, needs):
    nd = _attention_node(params, n_srcs)
    assert family_node(nd.op, nd.params, len(nd.srcs)) == needs
    assert CPUBackend(1).supports_node(nd)
    assert _NoFamilyOps(1).supports_node(nd) == (not needs)


def test_the_scheduler_refuses_a_node_its_device_cannot_run(model_factory):
    """A placement the load's check did not see (turned off here) still fails, by node and device,
    when the graph is planned: a gemma2 model on a device without FAMILY_OPS."""
    model = Model(model_factory("tiny", arch="gemma2"))
    dev = _NoFamilyOps(1, name="NOOPS")
    placement = Placement([dev], [0] * model.hparams.n_layer)
    import pyllama.models.weights as wmod

    real = wmod.check_placement
    wmod.check_placement = lambda model, placement: None  # (the load's own check off)
    try:
        weights = load_weights(model, placement, upload=False)
    finally:
        wmod.check_placement = real
    with pytest.raises(UnsupportedOpError, match=r"cannot run on NOOPS"):
        Context(model, weights, placement, 64, allocate=False)


class _Counting(_NoFamilyOps):
    """A device without FAMILY_OPS that counts what is allocated on it."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.allocs = 0

    def alloc_buffer(self, size: int, usage: str = "compute"):
        self.allocs += 1
        return super().alloc_buffer(size, usage)


def test_the_load_asks_the_device_about_each_node_of_the_graph(model_factory):
    """The load builds the model's graph and asks each node's device about it: a plain llama model
    whose attention soft-caps (no architecture of the dense families, no RoPE scaling, no window)
    holds ATTENTION nodes whose parameters need FAMILY_OPS, and a device without them is refused
    before anything is allocated, naming the device, what the nodes do, the ops and the layers."""
    import dataclasses
    model = Model(model_factory("tiny", arch="llama"))
    dev = _Counting(1, name="NOOPS")
    placement = Placement([dev], [0] * model.hparams.n_layer)
    load_weights(model, placement, upload=False)  # as the file says: plain attention, every device runs it
    model.hparams = dataclasses.replace(model.hparams, attn_softcap=30.0)
    assert model.hparams.arch == "llama"
    with pytest.raises(UnsupportedOpError, match=r"attention with soft-capping.*\(ATTENTION\) of layers 0-1 cannot run "
                                                 r"on NOOPS, which lacks GEGLU, SCALE, SOFTCAP"):
        load_weights(model, placement)
    assert dev.allocs == 0


def test_a_device_may_refuse_a_node_by_its_parameters(model_factory):
    """supports_node sees the node's typed parameters: a device whose attention kernel takes heads
    of at most 8 values is refused a model with wider heads, whatever its op table says."""

    class NarrowHeads(CPUBackend):
        def supports_node(self, nd) -> bool:
            if nd.op == Op.ATTENTION and AttentionParams.of(nd.params, len(nd.srcs)).head_dim > 8:
                return False
            return super().supports_node(nd)

    model = Model(model_factory("tiny", arch="llama"))
    assert model.hparams.head_dim > 8
    with pytest.raises(UnsupportedOpError, match=r"\(ATTENTION\) of layers 0-1 cannot run on NARROW, which lacks ATTENTION"):
        load_weights(model, Placement([NarrowHeads(1, name="NARROW")], [0] * model.hparams.n_layer), upload=False)
