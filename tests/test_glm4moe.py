"""glm4moe (GLM-4.5 / 4.6): sigmoid routing with the expert bias, an ungated shared expert, leading
dense layers, the FFN norm under GLM's name, q/k/v biases, RoPE on half of each head, and the
NextN layer that is in the file but never computed.

Checked against the float64 reference (tests/reference_forward.py, transformers' Glm4MoeMoE
routing), locally, over an rpc peer and in two pipeline groups; bench/ggml_split_check.py --arch
glm4moe compares it with llama-server over llama.cpp's rpc-server.
"""
from __future__ import annotations

import numpy as np
import pytest

from pyllama._fast import moe
from pyllama.ir.tensor import MoeParams, Op
from pyllama.models.gguf_file import GGUFFile
from pyllama.models.make import GLM4MOE, PRESETS, moe_shape
from pyllama.models.model import Model
from pyllama.runtime.engine import Engine
from pyllama.util.errors import ModelFileError
from reference_forward import reference_logits
from greedy import paper_graph, prompt_logits_f32
from server_util import assert_same_tokens_in_two_groups, generated_tokens

PROMPT = "The little cat sat on the mat and looked at the"


@pytest.fixture(scope="module")
def glm(model_factory) -> str:
    return model_factory("tiny", arch="glm4moe")


def ref_route(logits: np.ndarray, k: int, norm: bool, scale: float, gating: int, bias, n_group: int,
              n_group_used: int) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's build_moe_ffn routing in float64: probabilities, selection scores with the
    bias, the groups whose best two scores sum highest, the k best experts weighted by the
    probabilities alone."""
    x = logits.astype(np.float64)
    if gating == 2:
        p = 1.0 / (1.0 + np.exp(-x))
    else:
        p = np.exp(x - x.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
    sel = p + (0.0 if bias is None else bias.astype(np.float64))
    n, n_exp = x.shape
    if n_group > 1:
        per = n_exp // n_group
        groups = sel.reshape(n, n_group, per)
        score = np.sort(groups, axis=2)[:, :, -2:].sum(2)
        keep = np.argsort(-score, axis=1, kind="stable")[:, :n_group_used]
        mask = np.ones((n, n_group), bool)
        np.put_along_axis(mask, keep, False, axis=1)
        sel = np.where(np.repeat(mask, per, axis=1), -np.inf, sel)
    ids = np.argsort(-sel, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, axis=1)
    if norm:
        w = w / w.sum(1, keepdims=True)
    return ids, w * scale


@pytest.mark.parametrize("gating,with_bias,groups", [(1, False, (1, 1)), (2, False, (1, 1)), (2, True, (1, 1)),
                                                     (2, True, (4, 2)), (1, True, (8, 3))])
def test_routing_picks_and_weighs_experts_as_llama_cpp(gating, with_bias, groups):
    rng = np.random.default_rng(gating * 10 + groups[0])
    logits = rng.standard_normal((40, 32)).astype(np.float32)
    bias = (rng.standard_normal(32) * 0.3).astype(np.float32) if with_bias else None
    ids, w = moe.route(logits, 4, True, 2.5, gating=gating, probs_b=bias, n_group=groups[0], n_group_used=groups[1])
    want_ids, want_w = ref_route(logits, 4, True, 2.5, gating, bias, *groups)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=2e-6)
    if with_bias:  # the bias moves the choice, never the weights
        plain_ids, _ = moe.route(logits, 4, True, 2.5, gating=gating, n_group=groups[0], n_group_used=groups[1])
        assert (plain_ids != ids).any()


@pytest.mark.parametrize("kw,match", [(dict(gating=4), "gating"), (dict(n_group=5), "groups"),
                                      (dict(n_group=4, n_group_used=5), "groups"),
                                      (dict(probs_b=np.zeros(7, np.float32)), "probs_b")])
def test_bad_routing_options_are_one_clear_error(kw, match):
    with pytest.raises(ValueError, match=match):
        moe.route(np.zeros((2, 32), np.float32), 2, **kw)


def test_the_file_is_glm_4_5_shaped_and_read_so(glm):
    gf = GGUFFile(glm)
    p = PRESETS["tiny"]
    n_exp, _, ff_exp, ff_sh = moe_shape(p, "glm4moe")
    assert gf.get("glm4moe.block_count") == p.n_layer + 1 and gf.get("glm4moe.nextn_predict_layers") == 1
    last = f"blk.{p.n_layer}."
    assert {last + "nextn.eh_proj.weight", last + "nextn.enorm.weight", last + "ffn_gate_exps.weight"} <= set(gf.tensors)
    assert "blk.0.ffn_gate.weight" in gf.tensors and "blk.0.ffn_gate_exps.weight" not in gf.tensors
    assert gf.tensors["blk.1.exp_probs_b.bias"].shape == (n_exp,)
    hp = Model(glm).hparams
    assert (hp.n_layer, hp.n_layer_nextn, hp.n_layer_dense_lead) == (p.n_layer, 1, 1)
    assert (hp.expert_gating, hp.expert_weights_norm, hp.expert_weights_scale) == (2, True, GLM4MOE["expert_weights_scale"])
    assert (hp.n_ff_exp, hp.n_ff_shexp, hp.n_rot) == (ff_exp, ff_sh, p.head_dim // 2)
    assert hp.qkv_bias and not hp.qk_norm and not hp.moe_layer(0) and hp.moe_layer(1)
    names = Model(glm).logical_weights()
    assert names["blk.1.ffn_norm"][0] == ["blk.1.post_attention_norm.weight"]
    assert "blk.1.exp_probs_b" in names and "blk.1.ffn_gate_inp_shexp" not in names
    assert not any(n.startswith(last) for n in names)  # the NextN layer is never loaded


def test_greedy_tokens_and_logits_match_the_reference(glm):
    engine = Engine(glm, n_threads=2)
    try:
        prompt, _, got = prompt_logits_f32(engine, PROMPT)
    finally:
        engine.close()
    ref = reference_logits(glm, prompt)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.9


def test_the_moe_node_carries_sigmoid_routing_and_the_expert_bias(glm):
    fg = paper_graph(glm)
    (nd,) = [nd for nd in fg.nodes if nd.op == Op.MOE_FFN]
    mp = MoeParams.of(nd.params)
    assert (mp.gating, mp.probs_b, mp.scale) == (2, 1, GLM4MOE["expert_weights_scale"])
    assert nd.srcs[-1].shape == (6,) and len(nd.srcs) == 7  # x, router, 3 experts, shared expert, bias


def test_tokens_identical_local_rpc_and_pipeline_groups(glm, rpc_peer):
    local = generated_tokens(glm, PROMPT, 12)
    assert generated_tokens(glm, PROMPT, 12, "--rpc", rpc_peer.endpoint, "--device", "RPC0,CPU") == local
    assert_same_tokens_in_two_groups(glm, PROMPT, 12, local)


@pytest.mark.parametrize("key,value", [("glm4moe.leading_dense_block_count", 3),
                                       ("glm4moe.nextn_predict_layers", 3), ("glm4moe.expert_gating_func", 4)])
def test_bad_glm_metadata_is_one_clear_error(glm, key, value):
    with pytest.raises(ModelFileError, match=key.split(".")[1]):
        Model(glm, kv_overrides={key: value})


def test_a_server_without_the_routing_extensions_is_refused_at_load(glm):
    """GLM's routing rides on MOE_FFN's extended parameters, gated by FAMILY_OPS: an rpc server
    that does not advertise it (an older build) is refused in one line naming it."""
    from pyllama.rpc.protocol import Cap
    from server_util import RPCServerProcess, run_generate
    old = RPCServerProcess(env={"PYLLAMA_RPC_SERVER_CAPS": str(0xFFFF & ~int(Cap.FAMILY_OPS))})
    try:
        proc = run_generate(glm, PROMPT, 2, "--rpc", old.endpoint, "--device", "RPC0,CPU", "-ts", "3,1")
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr
        assert old.endpoint in lines[0] and "MOE_FFN" in lines[0], lines[0]
    finally:
        assert old.stop() == 0
