"""gpt-oss: attention sinks, every other layer in a sliding window, q/k/v and output biases, the
router's bias, experts with biases behind gpt-oss's clamped SwiGLU, the chosen experts weighted by
their logits' softmax, and MXFP4 experts.

Checked against the float64 reference (tests/reference_forward.py, transformers' modeling_gpt_oss),
locally, over an rpc peer and in two pipeline groups; `bench/ggml_split_check.py --arch gpt-oss
--unsplit --both-args="-ctk f32 -ctv f32 -fa off"` compares it with llama-server.
"""
from __future__ import annotations

import numpy as np
import pytest

from pyllama._fast import moe, ops
from pyllama.ir.tensor import ATTN_SINKS, AttentionParams, MoeParams, Op, src_roles
from pyllama.models.make import GPT_OSS_WINDOW
from pyllama.models.model import Model
from pyllama.runtime.engine import Engine
from reference_forward import reference_logits
from greedy import paper_graph, prompt_logits_f32
from server_util import assert_same_tokens_in_two_groups, generated_tokens

PROMPT = "The little cat sat on the mat and looked at the"


@pytest.fixture(scope="module")
def oss(model_factory) -> str:
    return model_factory("tiny", arch="gpt-oss")


def test_the_file_is_read_as_gpt_oss(oss):
    hp = Model(oss).hparams
    assert hp.attn_sinks and hp.moe_biases and hp.expert_gating == 3 and hp.qkv_bias
    assert hp.n_swa == GPT_OSS_WINDOW and hp.swa_layers == (True, False)
    names = Model(oss).logical_weights()
    assert {"blk.0.attn_sinks", "blk.0.attn_output_bias", "blk.0.ffn_gate_exps_bias"} <= set(names)
    assert names["blk.0.ffn_norm"][0] == ["blk.0.post_attention_norm.weight"]


@pytest.mark.parametrize("wtype", ["f32", "mxfp4_moe"])
def test_logits_match_the_reference(model_factory, wtype):
    path = model_factory("tiny", arch="gpt-oss", wtype=wtype)
    engine = Engine(path, n_threads=2)
    try:
        prompt, _, got = prompt_logits_f32(engine, PROMPT)
    finally:
        engine.close()
    assert len(prompt) > 2 * GPT_OSS_WINDOW  # the window binds
    ref = reference_logits(path, prompt)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


def test_sinks_and_routing_are_in_the_graph(oss):
    fg = paper_graph(oss)
    att = [nd for nd in fg.nodes if nd.op == Op.ATTENTION]
    a = AttentionParams.of(att[0].params, len(att[0].srcs))
    assert a.sinks and int(att[0].params[4]) & ATTN_SINKS and a.rope_mode == 2 and a.n_swa == GPT_OSS_WINDOW
    assert [r.name for r in src_roles(Op.ATTENTION, len(att[0].srcs), att[0].params)][-1] == "sinks"
    moe_nodes = [nd for nd in fg.nodes if nd.op == Op.MOE_FFN]
    mp = MoeParams.of(moe_nodes[0].params)
    assert (mp.gating, mp.biases, mp.act) == (3, 1, 1)
    roles = [r.name for r in src_roles(Op.MOE_FFN, len(moe_nodes[0].srcs), moe_nodes[0].params)]
    assert roles[5:] == ["router_b", "gate_b", "up_b", "down_b"]


def test_a_sink_joins_the_softmax_as_ggml_computes_it():
    """One head, two cells: out = (e^s0 v0 + e^s1 v1) / (e^s0 + e^s1 + e^sink) (maxima aside)."""
    rng = np.random.default_rng(0)
    hd = 16
    qkv = rng.standard_normal((2, 3 * hd)).astype(np.float32)
    kc, vc = np.zeros((4, hd), np.float32), np.zeros((4, hd), np.float32)
    out = np.zeros((2, hd), np.float32)
    sinks = np.array([0.7], np.float32)
    args = (qkv, kc, vc, np.arange(2, dtype=np.int32), np.arange(2, dtype=np.int32), np.array([0, 1], np.int32),
            np.array([[0, 1], [0, 2]], np.int32), np.zeros(0, np.float32), np.zeros(0, np.float32), out,
            1, 1, hd, 0, 2, 1e4, 1.0, 1e-6, 0.25)
    ops.attention(*args, sinks=sinks)
    k, v = qkv[:, hd:2 * hd].astype(np.float64), qkv[:, 2 * hd:].astype(np.float64)
    for t in range(2):
        s = k[:t + 1] @ qkv[t, :hd].astype(np.float64) * 0.25
        m = max(s.max(), 0.7)
        e = np.exp(s - m)
        want = e @ v[:t + 1] / (e.sum() + np.exp(0.7 - m))
        np.testing.assert_allclose(out[t], want, rtol=1e-5, atol=1e-6)
    plain = np.zeros_like(out)
    ops.attention(*args[:9], plain, *args[10:])
    assert np.abs(plain - out).max() > 1e-3  # the sink takes its share
    with pytest.raises(ValueError, match="sinks"):
        ops.attention(*args, sinks=np.zeros(3, np.float32))


def test_routing_weighs_the_chosen_logits_by_their_softmax():
    logits = np.random.default_rng(1).standard_normal((10, 16)).astype(np.float32)
    ids, w = moe.route(logits, 4, False, 1.0, gating=3)
    want = np.argsort(-logits, axis=1, kind="stable")[:, :4]
    np.testing.assert_array_equal(ids, want)
    chosen = np.take_along_axis(logits, want, axis=1).astype(np.float64)
    e = np.exp(chosen - chosen[:, :1])
    np.testing.assert_allclose(w, e / e.sum(1, keepdims=True), rtol=1e-6)


def test_tokens_identical_local_rpc_and_pipeline_groups(oss, rpc_peer):
    local = generated_tokens(oss, PROMPT, 12)
    assert generated_tokens(oss, PROMPT, 12, "--rpc", rpc_peer.endpoint, "--device", "RPC0,CPU") == local
    assert_same_tokens_in_two_groups(oss, PROMPT, 12, local)
