"""The BERT encoders (bert, nomic-bert, jina-bert-v2): the graph against the float64 reference (one device, a
layer split, several sequences in one batch, selected rows), non-causal micro-batching, the LAYER_NORM and GELU ops and ATTENTION's ALiBi, the files
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

# K and V are rounded to F16 here and in the reference alike; where pyllama's float32 value and the
# reference's float64 one round to neighbouring F16 values, that element differs by an F16 ulp,
# which moves the outputs by up to about 1e-4 (elsewhere they agree to about 1e-6)
TOL = dict(rtol=1e-5, atol=1e-4)
TEXT = "Hello world, the cats sat on the mat!"


@pytest.fixture(scope="module")
def bert(model_factory) -> str:
    return model_factory("tiny", arch="bert")


@pytest.fixture(scope="module")
def nomic(model_factory) -> str:
    return model_factory("tiny", arch="nomic-bert")


@pytest.fixture(scope="module")
def jina(model_factory) -> str:
    return model_factory("tiny", arch="jina-bert-v2")


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


def test_make_nomic_bert(nomic, tmp_path):
    gf = GGUFFile(nomic)
    assert gf.get("general.architecture") == "nomic-bert" and gf.get("nomic-bert.rope.freq_base") == 1000.0
    assert "blk.0.attn_qkv.weight" in gf.tensors and "blk.0.ffn_gate.weight" in gf.tensors
    assert "position_embd.weight" not in gf.tensors and "blk.0.attn_q.bias" not in gf.tensors
    hp = Model(nomic).hparams
    assert hp.encoder and not hp.causal and hp.n_rot == hp.head_dim and hp.qkv_fused
    # llama.cpp reads a classification head for bert alone
    assert make_main(["--preset", "tiny", "--arch", "nomic-bert", "--rerank-head", "--out", str(tmp_path / "n")]) == 1


@pytest.mark.parametrize("arch, n_backends", [("bert", 1), ("bert", 2), ("nomic-bert", 1), ("nomic-bert", 2),
                                             ("jina-bert-v2", 1), ("jina-bert-v2", 2)])
def test_hidden_states_match_the_reference(bert, nomic, jina, arch, n_backends):
    path = {"bert": bert, "nomic-bert": nomic, "jina-bert-v2": jina}[arch]
    toks = tokens_of(path)
    ref = reference_hidden(path, toks)
    ctx = make_context(path, n_backends=n_backends, n_ubatch=16)
    out = ctx.decode(Batch.for_sequence(toks, 0, all_logits=True))  # an encoder's rows are hidden states
    assert out.embd.shape == ref.shape
    np.testing.assert_allclose(out.embd, ref, **TOL)
    # only the rows a pooling reads (the first token's) go through the last layer's FFN
    want = np.zeros(len(toks), dtype=bool)
    want[0] = True
    out = ctx.decode(Batch(np.asarray(toks), np.arange(len(toks)), np.zeros(len(toks), dtype=np.int32), want))
    np.testing.assert_allclose(out.embd, ref[:1], **TOL)


def test_make_jina_bert_v2(jina):
    gf = GGUFFile(jina)
    assert gf.tensors["blk.0.ffn_up.weight"].shape == (2 * 192, 64) and "position_embd.weight" not in gf.tensors
    hp = Model(jina).hparams
    assert hp.alibi_max_bias == 8.0 and hp.ffn_gelu and hp.n_rot == 0 and not hp.causal


def test_alibi_is_an_attention_extension_that_only_the_cpu_computes(jina):
    from pyllama.backend.cpu.backend import CPUBackend
    from pyllama.ir.tensor import ATTN_ALIBI, AttentionParams, src_roles
    from pyllama.models.weights import Placement, alibi_slopes, check_placement
    from pyllama.util.errors import UnsupportedOpError

    params = AttentionParams(4, 4, 16, 0, 0, 10000.0, 1.0, 1e-12, 0.25, alibi=True).params()
    assert int(params[4]) & ATTN_ALIBI and AttentionParams.of(params, 8).alibi
    assert [r.name for r in src_roles(Op.ATTENTION, 8, params)][-1] == "alibi"
    both = AttentionParams(4, 4, 16, 0, 0, 10000.0, 1.0, 1e-12, 0.25, sinks=True, alibi=True).params()
    assert [r.name for r in src_roles(Op.ATTENTION, 9, both)][-2:] == ["sinks", "alibi"]
    assert check_node(Op.ATTENTION, DType.F32, [DType.F32] * 3 + [DType.I32] * 4 + [DType.F32], params, ()) is None
    # ggml's slopes: 8 heads of max bias 8 are 1/2, 1/4, ... 1/256; 12 heads go on with odd powers of 2^-0.5
    np.testing.assert_allclose(alibi_slopes(8, 8.0), 2.0 ** -np.arange(1, 9), rtol=1e-6)
    np.testing.assert_allclose(alibi_slopes(12, 8.0)[8:], 2.0 ** (-0.5 * np.array([1, 3, 5, 7])), rtol=1e-6)

    class NoAlibi(CPUBackend):
        alibi_ok = False

    model = Model(jina)
    with pytest.raises(UnsupportedOpError, match="ATTENTION"):
        check_placement(model, Placement([NoAlibi(1, "DEV0")], [0] * model.hparams.n_layer))


@pytest.mark.parametrize("wtype", ["f16", "q8_0"])
def test_stored_types_match_the_reference(model_factory, wtype):
    """Weights as the file stores them (the position table of an F16 / Q8_0 file dequantized at load)."""
    path = model_factory("tiny", arch="bert", wtype=wtype)
    toks = tokens_of(path)
    ref = reference_hidden(path, toks)
    got = make_context(path, n_ubatch=16).decode(Batch.for_sequence(toks, 0, all_logits=True)).embd
    # activations rounded to F16 / Q8_0 (as ggml, and as the reference): one ulp upstream may move one rounding
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-3


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


# --- through a real server --------------------------------------------------------------------
from reference_forward import bert_rank_score  # noqa: E402
from server_util import ServerProcess  # noqa: E402

from pyllama.server.embedding import rerank_tokens  # noqa: E402

SERVER_TOL = dict(rtol=1e-4, atol=2e-5)
DOCS = ["paris is the capital of france", "the cat sat on the mat", "hello world", "where is the river"]
QUERY = "what is the capital of france"


def start(model: str, *args: str) -> ServerProcess:
    return ServerProcess(model, "-np", "2", "-c", "256", "-b", "64", "-ub", "32", *args).wait_ready()


def normalized(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


@pytest.fixture(scope="module")
def embedder(bert):
    srv = start(bert, "--embedding")  # the file's pooling: mean
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def rerank_server(reranker):
    srv = start(reranker, "--rerank")
    yield srv
    assert srv.stop() == 0


def test_embedding_endpoints_pool_as_the_file_says(bert, embedder):
    texts = [TEXT, "what is the capital of france"]
    status, body = embedder.post("/v1/embeddings", {"input": texts})
    assert status == 200 and [d["index"] for d in body["data"]] == [0, 1]
    for d, text in zip(body["data"], texts):
        want = normalized(bert_hidden(bert, tokens_of(bert, text)).mean(axis=0))
        np.testing.assert_allclose(d["embedding"], want, **SERVER_TOL)
    assert body["usage"]["prompt_tokens"] == sum(len(tokens_of(bert, t)) for t in texts)
    status, body = embedder.post("/embedding", {"content": TEXT})
    assert status == 200
    np.testing.assert_allclose(body[0]["embedding"][0], normalized(bert_hidden(bert, tokens_of(bert)).mean(axis=0)),
                               **SERVER_TOL)


@pytest.mark.parametrize("pooling", ["cls", "last", "none"])
def test_other_poolings(bert, pooling):
    srv = start(bert, "--embedding", "--pooling", pooling)
    try:
        status, body = srv.post("/embedding", {"content": TEXT, "embd_normalize": -1})
        assert status == 200
        h = bert_hidden(bert, tokens_of(bert))
        want = {"cls": h[:1], "last": h[-1:], "none": h}[pooling]
        np.testing.assert_allclose(body[0]["embedding"], want, **SERVER_TOL)
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("arch", ["nomic-bert", "jina-bert-v2"])
def test_other_encoders_through_the_server(nomic, jina, arch):
    path = nomic if arch == "nomic-bert" else jina
    srv = start(path, "--embedding")
    try:
        status, body = srv.post("/v1/embeddings", {"input": TEXT})
        assert status == 200
        want = normalized(bert_hidden(path, tokens_of(path)).mean(axis=0))
        np.testing.assert_allclose(body["data"][0]["embedding"], want, **SERVER_TOL)
    finally:
        assert srv.stop() == 0


def test_an_encoder_generates_nothing_and_takes_no_input_over_the_micro_batch(embedder):
    for path, body in (("/completion", {"prompt": "hello", "n_predict": 2}),
                       ("/completion", {"prompt": "hello", "stream": True}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
                       ("/v1/responses", {"input": "hi"}), ("/infill", {"input_prefix": "a", "input_suffix": "b"})):
        status, out = embedder.post(path, body)  # refused before a stream starts
        assert status == 501 and "embeddings only" in out["error"]["message"], (path, out)
    status, body = embedder.post("/v1/embeddings", {"input": "the cat " * 40})
    assert status == 400 and "'input'" in body["error"]["message"] and "too large" in body["error"]["message"]
    status, body = embedder.post("/rerank", {"query": "a", "documents": ["b"]})
    assert status == 501 and "--reranking" in body["error"]["message"]


def test_a_jina_reranker_scores_with_its_one_score_head(model_factory):
    path = model_factory("tiny", arch="jina-bert-v2", opts=FamilyOptions(rerank_head=True))
    assert GGUFFile(path).tensors["cls.weight"].shape == (1, 64) and Model(path).has_rank_head
    from pyllama.models.gguf_file import GGUFFile as G
    tok, gf = load_tokenizer(read_metadata(path)), G(path)
    want = [float(bert_rank_score(path, rerank_tokens(tok, gf, QUERY, d))[0]) for d in DOCS]
    assert all(-1 < v < 1 for v in want)  # tanh(cls x + b) alone
    srv = start(path, "--rerank")
    try:
        status, body = srv.post("/v1/rerank", {"query": QUERY, "documents": DOCS})
        assert status == 200
        got = {r["index"]: r["relevance_score"] for r in body["results"]}
        np.testing.assert_allclose([got[i] for i in range(len(DOCS))], want, rtol=1e-4, atol=1e-5)
    finally:
        assert srv.stop() == 0


def test_rerank_scores_are_the_rank_head_of_each_pair(reranker, rerank_server):
    from pyllama.models.gguf_file import GGUFFile
    tok, gf = load_tokenizer(read_metadata(reranker)), GGUFFile(reranker)
    pairs = [rerank_tokens(tok, gf, QUERY, d) for d in DOCS]
    # [CLS] query [SEP] document: WordPiece adds SEP, and BOS as the file asks; no EOS
    assert pairs[0][0] == tok.bos_id and pairs[0].count(tok.sep_id) == 1 and pairs[0][-1] != tok.sep_id
    want = [float(bert_rank_score(reranker, p)[0]) for p in pairs]
    for path in ("/rerank", "/v1/rerank"):
        status, body = rerank_server.post(path, {"query": QUERY, "documents": DOCS, "model": "m"})
        assert status == 200 and body["object"] == "list" and body["model"] == "m"
        assert body["usage"]["prompt_tokens"] == sum(len(p) for p in pairs)
        got = {r["index"]: r["relevance_score"] for r in body["results"]}
        assert [r["index"] for r in body["results"]] == sorted(range(len(DOCS)), key=lambda i: -want[i])
        np.testing.assert_allclose([got[i] for i in range(len(DOCS))], want, rtol=1e-4, atol=1e-5)
    status, body = rerank_server.post("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2})
    assert status == 200 and len(body["results"]) == 2
    # TEI's form: a list, `score`, the texts on request
    status, body = rerank_server.post("/rerank", {"query": QUERY, "texts": DOCS[:2], "return_text": True})
    assert status == 200 and isinstance(body, list)
    assert {(r["index"], r["text"]) for r in body} == {(0, DOCS[0]), (1, DOCS[1])} and "score" in body[0]


@pytest.mark.parametrize("body, field", [
    ({"documents": ["a"]}, '"query"'), ({"query": 3, "documents": ["a"]}, '"query"'),
    ({"query": "q", "documents": []}, '"documents"'), ({"query": "q", "documents": ["a", 2]}, '"documents"'),
    ({"query": "q", "documents": "a"}, '"documents"'), ({"query": "q", "texts": []}, '"texts"'),
    ({"query": "q", "documents": ["a"], "top_n": "2"}, '"top_n"'),
    ({"query": "q", "documents": ["a"], "top_n": -1}, '"top_n"'),
    ({"query": "q", "documents": ["a"], "return_text": 1}, '"return_text"'),
    ({"query": "q", "documents": ["the cat " * 40]}, "'documents'"),
])
def test_bad_rerank_requests_are_a_400_naming_the_field(rerank_server, body, field):
    status, out = rerank_server.post("/v1/rerank", body)
    assert status == 400 and field in out["error"]["message"], out


def test_rank_pooling_needs_a_head_and_an_encoder_needs_embeddings(bert, tiny_model):
    for model, flags, words in ((bert, ["--rerank"], "rank pooling"), (tiny_model, ["--rerank"], "rank pooling"),
                                (bert, [], "--embedding")):
        srv = ServerProcess(model, "-np", "1", "-c", "64", *flags)
        with pytest.raises(RuntimeError) as info:
            srv.wait_ready()
        srv.stop()
        assert words in str(info.value)
        lines = [ln for ln in srv.stderr_text.splitlines() if "error" in ln.lower()]
        assert lines, srv.stderr_text


def test_a_reranker_file_with_embedding_alone(reranker):
    """As llama-server: the file's rank pooling gives the embedding endpoints the head's scores,
    and /rerank stays closed without --rerank (or --pooling rank)."""
    srv = start(reranker, "--embedding")
    try:
        status, body = srv.post("/embedding", {"content": TEXT, "embd_normalize": -1})
        assert status == 200
        np.testing.assert_allclose(body[0]["embedding"][0], bert_rank_score(reranker, tokens_of(reranker)),
                                   rtol=1e-4, atol=1e-5)
        status, body = srv.post("/v1/rerank", {"query": "q", "documents": ["d"]})
        assert status == 501
    finally:
        assert srv.stop() == 0
