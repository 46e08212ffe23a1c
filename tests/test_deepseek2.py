"""deepseek2 (DeepSeek V2/V3/R1, Kimi K2): multi-head latent attention with llama.cpp's absorbed
weights and a cache of latent + rope values per token, group-limited sigmoid routing with the
expert bias, a shared expert, leading dense layers and the NextN layer skipped.

Checked against the float64 reference (tests/reference_forward.py, transformers' unabsorbed
DeepseekV3Attention), locally, over an rpc peer and in two pipeline groups;
`bench/ggml_split_check.py --arch deepseek2 --unsplit --both-args="-ctk f32 -ctv f32 -fa off"`
compares it with llama-server.
"""
from __future__ import annotations

import numpy as np
import pytest

from pyllama.backend.cpu.mla import mla_attention
from pyllama.ir.tensor import MlaParams, MoeParams, Op
from pyllama.models.gguf_file import GGUFFile
from pyllama.models.make import MLA_PRESETS, PRESETS
from pyllama.models.model import Model
from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
from pyllama.util.errors import ModelFileError
from reference_forward import reference_logits
from greedy import paper_graph, prompt_logits_f32
from server_util import assert_same_tokens_in_two_groups, generated_tokens, run_generate

PROMPT = "The little cat sat on the mat and looked at the"


@pytest.fixture(scope="module")
def ds(model_factory) -> str:
    return model_factory("tiny", arch="deepseek2")


def test_the_file_is_deepseek_v3_shaped_and_read_so(ds):
    q_lora, lora, nope, rope, v, groups, used = MLA_PRESETS["tiny"]
    gf = GGUFFile(ds)
    assert gf.get("deepseek2.attention.key_length") == lora + rope and gf.get("deepseek2.attention.head_count_kv") == 1
    assert gf.tensors["blk.1.attn_k_b.weight"].shape == (PRESETS["tiny"].n_head, lora, nope)
    hp = Model(ds).hparams
    assert (hp.mla_lora_q, hp.mla_lora_kv, hp.mla_nope, hp.mla_v, hp.n_rot) == (q_lora, lora, nope, v, rope)
    assert (hp.n_expert_groups, hp.n_group_used, hp.expert_gating, hp.n_layer_nextn) == (groups, used, 2, 1)
    assert hp.n_embd_kv == lora + rope  # the cache row: the latent and the rope part, one KV head


def test_logits_match_the_reference(ds):
    engine = Engine(ds, n_threads=2)
    try:
        prompt, ctx, got = prompt_logits_f32(engine, PROMPT)
        # a decode step after the prompt (one row attending over the cached latents) agrees too
        nxt = int(got[-1].argmax())
        step = ctx.decode(Batch.for_sequence([nxt], len(prompt), 0)).logits[0].copy()
        # the cache holds lora + rope values per token and layer, in its type (here f32), and no V
        q_lora, lora, nope, rope, v, *_ = MLA_PRESETS["tiny"]
        assert ctx.kv_bytes["CPU"] == engine.model.hparams.n_layer * ctx.kv.n_cells * (lora + rope) * 4
    finally:
        engine.close()
    ref = reference_logits(ds, prompt + [nxt])
    scale = np.abs(ref).max()
    assert np.abs(got - ref[:len(prompt)]).max() <= 1e-5 * scale
    assert np.abs(step - ref[-1]).max() <= 1e-5 * scale


def test_the_graph_holds_latent_attention_and_grouped_routing(ds):
    hp = Model(ds).hparams
    fg = paper_graph(ds)
    mla = [nd for nd in fg.nodes if nd.op == Op.MLA_ATTENTION]
    assert len(mla) == hp.n_layer and not any(nd.op == Op.ATTENTION for nd in fg.nodes)
    p = MlaParams(*mla[0].params)
    assert (p.n_head, p.lora) == (hp.n_head, hp.mla_lora_kv) and p.scale == pytest.approx((hp.mla_nope + hp.n_rot) ** -0.5)
    (moe,) = [nd for nd in fg.nodes if nd.op == Op.MOE_FFN]
    mp = MoeParams.of(moe.params)
    assert (mp.gating, mp.probs_b, mp.n_group, mp.n_group_used) == (2, 1, hp.n_expert_groups, hp.n_group_used)


def test_tokens_identical_local_rpc_and_pipeline_groups(ds, rpc_peer):
    local = generated_tokens(ds, PROMPT, 12)
    assert generated_tokens(ds, PROMPT, 12, "--rpc", rpc_peer.endpoint, "--device", "RPC0,CPU") == local
    assert_same_tokens_in_two_groups(ds, PROMPT, 12, local)


def test_a_quantized_cache_holds_the_latents_and_k_and_v_must_agree(ds):
    """As llama.cpp: an MLA cache of a block type stores its rows as they are (no Hadamard rotation
    on that path), and -ctk and -ctv must name the same type (the values are a view of the keys)."""
    q8 = generated_tokens(ds, PROMPT, 6, "-ctk", "q8_0", "-ctv", "q8_0")
    assert len(q8) == 6
    proc = run_generate(ds, PROMPT, 2, "-ctk", "q8_0", "-ctv", "f16")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and "latent attention" in lines[0], proc.stderr


@pytest.mark.parametrize("key,value", [("deepseek2.attention.key_length", 33), ("deepseek2.attention.head_count_kv", 2),
                                       ("deepseek2.expert_group_count", 4)])
def test_bad_mla_metadata_is_one_clear_error(ds, key, value):
    with pytest.raises(ModelFileError):
        Model(ds, kv_overrides={key: value})


def _op_inputs(n_cells: int = 8):
    rng = np.random.default_rng(0)
    H, lora, nope, rope, v = 2, 32, 8, 4, 8
    q = rng.standard_normal((3, H * (nope + rope))).astype(np.float32)
    kv = rng.standard_normal((3, lora + rope)).astype(np.float32)
    cache = np.zeros((n_cells, (lora + rope) * 4), np.uint8)
    args = dict(q=q, kv=kv, k_cache=cache, k_type=0, pos=np.arange(3, dtype=np.int32),
                kv_idx=np.arange(3, dtype=np.int32), cells=np.array([0, 0, 1, 0, 1, 2], np.int32),
                ranges=np.array([[0, 1], [1, 2], [3, 3]], np.int32), kv_norm=np.ones(lora, np.float32),
                k_b=rng.standard_normal((H, lora, nope)).astype(np.float32).view(np.uint8), k_b_type=0,
                v_b=rng.standard_normal((H, v, lora)).astype(np.float32).view(np.uint8), v_b_type=0, nope=nope, v_dim=v,
                params=MlaParams(H, lora, 10000.0, 1.0, 1e-6, 0.25), out=np.zeros((3, H * v), np.float32))
    return args


def test_the_op_refuses_bad_inputs_before_writing_the_cache():
    args = _op_inputs()
    mla_attention(**args)
    assert args["k_cache"][:3].any() and not args["k_cache"][3:].any()
    for bad in (dict(cells=np.array([0, 0, 1, 0, 1, 99], np.int32)), dict(kv_idx=np.array([0, 1, 8], np.int32)),
                dict(ranges=np.array([[0, 1], [1, 2], [3, 4]], np.int32))):
        fresh = _op_inputs()
        with pytest.raises(ValueError, match="MLA_ATTENTION"):
            mla_attention(**{**fresh, **bad})
        assert not fresh["k_cache"].any()


@pytest.mark.unit
def test_score_scale_is_llama_cpp_float_steps():
    """1 / sqrtf(96) in float is one ulp below double 1 / sqrt(96) rounded: llama.cpp's kq_scale is
    the former, and a scale one ulp off moves every attention score."""
    import types

    from pyllama.models.build.mla import mla_scales
    hp = types.SimpleNamespace(rope_attn_factor=1.0, rope_scaling="none", rope_scale=1.0, yarn_log_mul=0.0,
                               mla_nope=64, n_rot=32)
    attn_factor, scale = mla_scales(hp)
    assert attn_factor == 1.0
    want = np.float32(1) / np.sqrt(np.float32(96))
    assert np.float32(scale).view(np.uint32) == want.view(np.uint32)
    assert np.float32(scale) != np.float32(1 / np.sqrt(96.0))
    # YaRN (DeepSeek V3's factor 40, yarn_log_multiplier 0.1): mscale^2 / sqrt(96), all in float
    hp.rope_scaling, hp.rope_scale, hp.yarn_log_mul = "yarn", 0.025, 0.1
    attn_factor, yarn_scale = mla_scales(hp)
    assert 0.7 < attn_factor < 0.75 and 1.07 * scale < yarn_scale < 1.08 * scale  # mscale^2 = (1 + 0.01 ln 40)^2
