"""The BERT encoder: its graph against the float64 reference (one device, a layer split, several
sequences in one batch), non-causal micro-batching, the LAYER_NORM and GELU ops, the files
`models.make --arch bert` writes, and devices without the encoder ops refusing it at load."""
from __future__ import annotations

import numpy as np
import pytest

from reference_forward import bert_hidden, reference_hidden
from test_engine import make_context

from pyllama.backend.cpu.backend import gelu, layer_norm
from pyllama.ir.tensor import OP_TABLE, Op, check_node, DType
from pyllama.models.gguf_file import GGUFFile, read_metadata
from pyllama.models.make import FamilyOptions, main as make_main
from pyllama.models.model import Model
from pyllama.runtime.context import Batch
from pyllama.tokenizer import load_tokenizer

TOL = dict(rtol=1e-5, atol=5e-6)
TEXT = "Hello world, the cats sat on the mat!"


@pytest.fixture(scope="module")
def bert(model_factory) -> str:
    return model_factory("tiny", arch="bert")


@pytest.fixture(scope="module")
def reranker(model_factory) -> str:
    return model_factory("tiny", arch="bert", opts=FamilyOptions(rerank_head=True))


def tokens_of(path: str, text: str = TEXT) -> list[int]:
    return load_tokenizer(read_metadata(path)).encode(text)


def test_layer_norm_and_gelu_kernels():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 48)).astype(np.float32) * 3 + 1
    w, b = rng.standard_normal(48).astype(np.float32), rng.standard_normal(48).astype(np.float32)
    out = np.empty_like(x)
    layer_norm(x, w, b, out, 1e-12)
    x64 = x.astype(np.float64)
    ref = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-12) * w + b
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    gelu(x, out)
    ref = 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3)))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    assert check_node(Op.LAYER_NORM, DType.F32, [DType.F32] * 3, (1e-12,), ()) is None
    assert check_node(Op.GELU, DType.F32, [DType.F32], (), ()) is None
    assert OP_TABLE[Op.LAYER_NORM].n_params == 1


def test_make_writes_llama_cpp_names_and_a_wordpiece_vocabulary(bert, reranker):
    gf = GGUFFile(bert)
    assert gf.get("general.architecture") == "bert"
    assert gf.get("bert.attention.causal") is False and gf.get("bert.pooling_type") == 1
    assert gf.get("tokenizer.ggml.model") == "bert" and gf.get("tokenizer.ggml.token_type_count") == 2
    for name in ("token_embd.weight", "token_types.weight", "position_embd.weight", "token_embd_norm.bias",
                 "blk.1.attn_output_norm.bias", "blk.1.layer_output_norm.weight", "blk.0.ffn_up.bias"):
        assert name in gf.tensors
    assert "cls.output.weight" not in gf.tensors and not Model(bert).has_rank_head
    rr = GGUFFile(reranker)
    assert rr.get("bert.pooling_type") == 4 and rr.tensors["cls.output.weight"].shape == (1, 64)
    assert Model(reranker).has_rank_head
    tok = load_tokenizer(read_metadata(bert))
    ids = tok.encode(TEXT)
    assert [tok.token_text(i) for i in ids[:3]] == ["[CLS]", "\u2581hello", "\u2581world"]
    assert tok.token_text(ids[-1]) == "[SEP]"


def test_make_refuses_what_an_encoder_lacks(tmp_path, capsys):
    assert make_main(["--preset", "tiny", "--arch", "llama", "--rerank-head", "--out", str(tmp_path / "a")]) == 1
    assert "--rerank-head" in capsys.readouterr().err
    assert make_main(["--preset", "tiny", "--arch", "bert", "--rope-freqs", "--out", str(tmp_path / "b")]) == 1


@pytest.mark.parametrize("n_backends", [1, 2])
def test_hidden_states_match_the_reference(bert, n_backends):
    toks = tokens_of(bert)
    ref = reference_hidden(bert, toks)
    ctx = make_context(bert, n_backends=n_backends, n_ubatch=16)
    out = ctx.decode(Batch.for_sequence(toks, 0, all_logits=True))  # an encoder's rows are hidden states
    assert out.embd.shape == ref.shape
    np.testing.assert_allclose(out.embd, ref, **TOL)


def test_sequences_share_a_batch_but_never_attend_across(bert):
    a, b = tokens_of(bert), tokens_of(bert, "what is the capital of france")
    ctx = make_context(bert, n_ubatch=max(len(a), len(b)) + 2)  # two micro-batches, each sequence whole
    batch = Batch.concat([Batch.for_sequence(a, 0, 0, all_logits=True), Batch.for_sequence(b, 0, 1, all_logits=True)])
    out = ctx.decode(batch)
    np.testing.assert_allclose(out.embd[:len(a)], bert_hidden(bert, a), **TOL)
    np.testing.assert_allclose(out.embd[len(a):], bert_hidden(bert, b), **TOL)
    # the same sequence again starts anew (nothing of the first pass is attended)
    out = ctx.decode(Batch.for_sequence(b, 0, 0, all_logits=True))
    np.testing.assert_allclose(out.embd, bert_hidden(bert, b), **TOL)


def test_a_sequence_longer_than_the_micro_batch_is_refused(bert):
    toks = tokens_of(bert)
    ctx = make_context(bert, n_ubatch=4)
    with pytest.raises(ValueError, match="too large to process"):
        ctx.decode(Batch.for_sequence(toks, 0, all_logits=True))
    with pytest.raises(ValueError, match="whole"):
        ctx.decode(Batch.for_sequence(toks[:3], 1, all_logits=True))


def test_devices_without_the_encoder_ops_refuse_it(bert):
    from pyllama.backend.cpu.backend import CPUBackend
    from pyllama.models.weights import Placement, check_placement
    from pyllama.util.errors import UnsupportedOpError

    class NoEncoderOps(CPUBackend):
        def supports(self, op: int) -> bool:
            return op not in (Op.LAYER_NORM, Op.GELU)

    model = Model(bert)
    with pytest.raises(UnsupportedOpError, match="LAYER_NORM"):
        check_placement(model, Placement([NoEncoderOps(1, "DEV0")], [0] * model.hparams.n_layer))
