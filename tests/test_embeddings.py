"""/embedding, /embeddings and /v1/embeddings with --embedding and --pooling: the values against
the float64 reference forward pass pooled and normalized in numpy, llama-server's response forms,
the 501s either way, and the same result over a layer split through an rpc server."""
from __future__ import annotations

import base64

import numpy as np
import pytest

from reference_forward import reference_hidden
from server_util import RPCServerProcess, ServerProcess

from pyllama.runtime.context import Batch
from pyllama.server.embedding import normalize
from test_engine import make_context

INPUTS = [
    [256, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100],  # longer than -b 8: computed over two steps
    [256, 300, 301],
    [256, 5, 6, 7, 8],
]
TOL = dict(rtol=1e-4, atol=2e-5)


def reference(model: str, tokens: list[int], pooling: str, embd_normalize: int = 2) -> np.ndarray:
    """The independent computation: float64 hidden states, pooled and normalized here."""
    h = reference_hidden(model, tokens)
    if pooling == "none":
        return h
    v = {"mean": h.mean(axis=0), "cls": h[0], "last": h[-1]}[pooling]
    if embd_normalize == -1:
        return v
    if embd_normalize == 0:
        return v * 32760.0 / np.abs(v).max()
    return v / (np.abs(v) ** embd_normalize).sum() ** (1.0 / embd_normalize)


def start(model: str, *args: str) -> ServerProcess:
    # an F32 KV cache: the float64 reference keeps K and V unrounded
    return ServerProcess(model, "-np", "2", "-c", "256", "-b", "8", "-ub", "4", "-ctk", "f32", "-ctv", "f32",
                         *args).wait_ready()


@pytest.fixture(scope="module", params=["mean", "cls", "last", "none"])
def pooled(request, tiny_model):
    srv = start(tiny_model, "--embedding", "--pooling", request.param)
    yield request.param, srv
    assert srv.stop() == 0


def test_context_returns_the_normed_hidden_states(tiny_model):
    """Context.decode(embeddings=True) over one device and over a split, micro-batched."""
    tokens = INPUTS[0]
    ref = reference_hidden(tiny_model, tokens)
    for n_backends in (1, 2):
        ctx = make_context(tiny_model, n_backends=n_backends, n_ubatch=4)
        out = ctx.decode(Batch.for_sequence(tokens, 0, all_logits=True), embeddings=True)
        assert out.embd.shape == ref.shape and list(out.rows) == list(range(len(tokens)))
        np.testing.assert_allclose(out.embd, ref, **TOL)
        # the logits path is untouched by the embeddings plan of the same shape
        ctx.clear()
        logits = ctx.decode(Batch.for_sequence(tokens, 0, all_logits=True)).logits
        assert logits.shape == (len(tokens), ctx.hparams.n_vocab)


def test_native_form_values(pooled, tiny_model):
    pooling, srv = pooled
    status, res = srv.post("/embedding", {"content": INPUTS})
    assert status == 200, res
    assert [item["index"] for item in res] == [0, 1, 2]
    for item, tokens in zip(res, INPUTS):
        got = np.asarray(item["embedding"])
        want = reference(tiny_model, tokens, pooling)
        if pooling == "none":  # one raw vector per token
            assert got.shape == (len(tokens), 64)
        else:  # llama-server's native form: a list holding the one pooled vector
            assert got.shape == (1, 64)
            got = got[0]
            assert abs(np.linalg.norm(got) - 1.0) < 1e-5
        np.testing.assert_allclose(got, want, **TOL)


def test_v1_embeddings_list_in_order_with_usage(pooled, tiny_model):
    pooling, srv = pooled
    status, res = srv.post("/v1/embeddings", {"input": INPUTS, "model": "m"})
    if pooling == "none":  # as llama-server: pooling none has no OpenAI form
        assert status == 400 and "not OAI compatible" in res["error"]["message"]
        return
    assert status == 200, res
    assert res["object"] == "list" and res["model"] == "m"
    n = sum(len(t) for t in INPUTS)
    assert res["usage"] == {"prompt_tokens": n, "total_tokens": n}
    assert [d["index"] for d in res["data"]] == [0, 1, 2] and all(d["object"] == "embedding" for d in res["data"])
    for d, tokens in zip(res["data"], INPUTS):
        np.testing.assert_allclose(d["embedding"], reference(tiny_model, tokens, pooling), **TOL)
    # base64: the same float32 values as bytes
    status, b64 = srv.post("/v1/embeddings", {"input": INPUTS[1], "encoding_format": "base64"})
    assert status == 200 and len(b64["data"]) == 1 and b64["data"][0]["encoding_format"] == "base64"
    vec = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vec, res["data"][1]["embedding"], rtol=0, atol=0)
    assert b64["usage"]["prompt_tokens"] == len(INPUTS[1])
    status, bad = srv.post("/v1/embeddings", {"input": "x", "encoding_format": "int8"})
    assert status == 400


def test_embd_normalize_variants(pooled, tiny_model):
    pooling, srv = pooled
    tokens = INPUTS[2]
    for norm in (-1, 0, 1, 2, 3):
        status, res = srv.post("/embedding", {"content": tokens, "embd_normalize": norm})
        assert status == 200, res
        got = np.asarray(res[0]["embedding"])
        if pooling == "none":  # as llama-server: no normalization without pooling
            np.testing.assert_allclose(got, reference(tiny_model, tokens, "none"), **TOL)
        else:
            np.testing.assert_allclose(got[0], reference(tiny_model, tokens, pooling, norm), rtol=1e-4, atol=1e-3)


def test_text_input_is_tokenized_with_bos(pooled, tiny_model):
    pooling, srv = pooled
    text = "The little cat"
    _, tok = srv.post("/tokenize", {"content": text, "add_special": True})
    ids = tok["tokens"]
    s1, by_text = srv.post("/embeddings", {"content": text})
    s2, by_ids = srv.post("/embeddings", {"content": ids})
    assert s1 == s2 == 200
    assert by_text == by_ids
    status, res = srv.post("/embedding", {"content": []})
    assert status == 400 and res["error"]["message"] == "Input content cannot be empty"
    status, res = srv.post("/embedding", {"prompt": "x"})
    assert status == 400


def test_normalize_helper_matches_llama_formulas():
    v = np.array([3.0, -4.0, 0.0], dtype=np.float32)
    np.testing.assert_allclose(normalize(v, 2), [0.6, -0.8, 0.0], rtol=1e-6)
    np.testing.assert_allclose(normalize(v, 1), [3 / 7, -4 / 7, 0.0], rtol=1e-6)
    np.testing.assert_allclose(normalize(v, 0), [3 * 32760 / 4, -32760, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(normalize(v, -1), v)
    np.testing.assert_array_equal(normalize(np.zeros(3, np.float32), 2), np.zeros(3))


def test_without_embedding_flag_embeddings_answer_501(tiny_model):
    srv = start(tiny_model)
    try:
        for path in ("/embedding", "/embeddings", "/v1/embeddings"):
            status, res = srv.post(path, {"input": "hello"})
            assert status == 501
            assert res["error"] == {"code": 501, "type": "not_supported_error",
                                    "message": "This server does not support embeddings. Start it with `--embeddings`"}
        status, res = srv.post("/completion", {"prompt": "hello", "n_predict": 2, "ignore_eos": True})
        assert status == 200 and res["tokens_predicted"] == 2
    finally:
        assert srv.stop() == 0


def test_with_embedding_flag_completions_are_served_too(pooled, tiny_model):
    """As llama-server (build 9749): --embeddings adds the embedding endpoints and the completion
    ones keep working, with the same tokens as a server without the flag."""
    _, srv = pooled
    body = {"prompt": "Once upon a time", "n_predict": 6, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    status, res = srv.post("/completion", body)
    assert status == 200 and res["tokens_predicted"] == 6
    plain = start(tiny_model)
    try:
        assert plain.post("/completion", body)[1]["tokens"] == res["tokens"]
    finally:
        assert plain.stop() == 0
    status, res = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 200 and res["usage"]["completion_tokens"] == 2
    status, res = srv.post("/embedding", {"content": "hello"})  # and embeddings after them
    assert status == 200 and len(res[0]["embedding"][0]) == 64


def test_same_over_an_rpc_split(tiny_model):
    local = start(tiny_model, "--embedding", "--pooling", "mean")
    peer = RPCServerProcess()
    try:
        _, want = local.post("/embedding", {"content": INPUTS, "embd_normalize": -1})
        for order in ("RPC0,CPU", "CPU,RPC0"):
            split = start(tiny_model, "--embedding", "--pooling", "mean", "--rpc", peer.endpoint, "--device", order)
            try:
                status, got = split.post("/embedding", {"content": INPUTS, "embd_normalize": -1})
            finally:
                assert split.stop() == 0
            assert status == 200, got
            for a, b in zip(got, want):
                np.testing.assert_allclose(a["embedding"], b["embedding"], rtol=1e-5, atol=1e-5)
    finally:
        assert local.stop() == 0
        assert peer.stop() == 0
