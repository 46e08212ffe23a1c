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
    """A placement the load's check let through (its guess reads the model's kind) still fails, by
    node and device, when the graph is planned: a gemma2 model on a device without FAMILY_OPS."""
    model = Model(model_factory("tiny", arch="gemma2"))
    dev = _NoFamilyOps(1, name="NOOPS")
    placement = Placement([dev], [0] * model.hparams.n_layer)
    import pyllama.models.weights as wmod

    real = wmod._check_ops
    wmod._check_ops = lambda model, placement: None  # (the load's own check off)
    try:
        weights = load_weights(model, placement, upload=False)
    finally:
        wmod._check_ops = real
    with pytest.raises(UnsupportedOpError, match=r"cannot run on NOOPS"):
        Context(model, weights, placement, 64, allocate=False)
