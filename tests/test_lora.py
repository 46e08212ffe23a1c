"""LoRA adapters (models/lora.py, the LORA op): files in llama.cpp's layout, the product against an
independent merged-weight reference, per-sequence scales in one batch, refusals, the server's
--lora flags and /lora-adapters, and an rpc peer."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from gguf import GGUFWriter

from pyllama.ir.tensor import Op
from pyllama.models.gguf_file import GGUFFile
from pyllama.models.lora import MAX_ADAPTERS, LoraError, load_lora_set
from pyllama.models.make_lora import make_lora
from pyllama.models.model import Model
from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
from pyllama.util.errors import PyllamaError
from reference_forward import reference_logits
from server_util import RPCServerProcess, ServerProcess, generated_tokens, run_generate

PROMPT_IDS = [1, 17, 42, 99, 7, 250, 31]


@pytest.fixture(scope="module")
def base(model_factory) -> str:
    return model_factory("tiny", seed=5)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> list[str]:
    """Two adapters: every block matrix at rank 4 (alpha 8), and attention q/v plus the output
    matrix at rank 2 (alpha 0: the user's scale alone). Their products change the logits by a few
    units, not more: a much larger change leaves a random model where float32 rounding grows (its
    logits then stray from the float64 reference whether the adapter is merged or not)."""
    d = tmp_path_factory.mktemp("lora")
    return [make_lora(base, str(d / "all.gguf"), rank=4, alpha=8.0, seed=1, gain=0.25),
            make_lora(base, str(d / "qv-out.gguf"), rank=2, alpha=0.0, targets=["attn_q", "attn_v", "output"], seed=2,
                      gain=0.5)]


def all_logits(engine: Engine, tokens: list[int], scales: tuple = ()) -> np.ndarray:
    ctx = engine.new_context(128, 1)
    if scales:
        ctx.set_lora(0, scales)
    batch = Batch.for_sequence(tokens, 0, 0)
    batch.logits[:] = True
    return ctx.decode(batch).logits[:len(tokens)].copy()


def test_the_file_has_llama_cpps_adapter_layout(base, adapters):
    f = GGUFFile(adapters[0])
    assert f.get("general.type") == "adapter" and f.get("adapter.type") == "lora"
    assert f.get("adapter.lora.alpha") == 8.0
    assert f.get("general.architecture") == GGUFFile(base).get("general.architecture")
    model = GGUFFile(base)
    a, b = f.tensors["blk.0.attn_k.weight.lora_a"], f.tensors["blk.0.attn_k.weight.lora_b"]
    m, k = model.tensors["blk.0.attn_k.weight"].shape
    assert a.shape == (4, k) and b.shape == (m, 4)  # ggml's ne [k, r] and [r, m]
    assert len(f.tensors) == 2 * 7 * GGUFFile(base).get("llama.block_count")


@pytest.mark.parametrize("which,scale", [(0, 1.0), (0, 0.5), (1, 1.0), (1, -2.0)])
def test_logits_match_the_merged_weights_reference(base, adapters, which, scale):
    """The adapters' product equals the base model with W + scale * alpha / r * B @ A merged, by
    an independent float64 forward pass that never sees pyllama's layout."""
    engine = Engine(base, n_threads=2, lora=adapters)
    try:
        scales = tuple(scale if i == which else 0.0 for i in range(2))
        got = all_logits(engine, PROMPT_IDS, scales)
    finally:
        engine.close()
    ref = reference_logits(base, PROMPT_IDS, lora=((adapters[which], scale),))
    plain = reference_logits(base, PROMPT_IDS)
    assert np.abs(got - ref).max() <= 4e-4 * np.abs(ref).max()  # (the base model's own: 1.5e-4)
    assert np.abs(ref - plain).max() > 100 * np.abs(got - ref).max(), "the adapter hardly changes the logits"


def test_scale_zero_is_the_base_model_exactly(base, adapters):
    plain = Engine(base, n_threads=2)
    adapted = Engine(base, n_threads=2, lora=adapters)
    try:
        np.testing.assert_array_equal(all_logits(adapted, PROMPT_IDS, (0.0, 0.0)), all_logits(plain, PROMPT_IDS))
    finally:
        plain.close()
        adapted.close()


def test_sequences_with_other_adapters_share_a_batch(model_factory, tmp_path):
    """Three sequences with three adapter settings (an F16 adapter and an F32 one) decoded in one
    batch, prompts then greedy steps, on a Q8_0 model: each gets, bit for bit, what it gets decoded
    alone with its own scales (its activations are then quantized: an ulp of difference would show)."""
    base = model_factory("tiny", seed=5, wtype="q8_0")
    adapters = [make_lora(base, str(tmp_path / "a16.gguf"), rank=4, alpha=8.0, seed=1, gain=0.25, wtype="f16"),
                make_lora(base, str(tmp_path / "b32.gguf"), rank=2, alpha=0.0, targets=["attn_q", "attn_v", "output"],
                          seed=2, gain=0.5)]
    engine = Engine(base, n_threads=2, lora=adapters)
    settings = [(1.0, 0.0), (0.0, 0.7), (0.3, 1.0)]
    prompts = [PROMPT_IDS, PROMPT_IDS[:5], PROMPT_IDS[2:]]
    steps = 12

    def greedy(ctx, seqs: list[int], first) -> list[list[int]]:
        out, toks = first, [[] for _ in seqs]
        for i in range(steps):
            last = [int(out.logits[k].argmax()) for k in range(len(seqs))]
            for k, t in enumerate(last):
                toks[k].append(t)
            out = ctx.decode(Batch.concat([Batch.for_sequence([t], len(prompts[s]) + i, s)
                                           for s, t in zip(seqs, last)]))
        return toks
    try:
        alone = []
        for seq, (p, s) in enumerate(zip(prompts, settings)):
            ctx = engine.new_context(384, 3)
            ctx.set_lora(seq, s)
            alone.append(greedy(ctx, [seq], ctx.decode(Batch.for_sequence(p, 0, seq)))[0])
        ctx = engine.new_context(384, 3)
        for seq, s in enumerate(settings):
            ctx.set_lora(seq, s)
        first = ctx.decode(Batch.concat([Batch.for_sequence(p, 0, seq) for seq, p in enumerate(prompts)]))
        assert greedy(ctx, [0, 1, 2], first) == alone
        assert len({tuple(t) for t in alone}) == 3
    finally:
        engine.close()


def test_an_f16_adapter_rounds_its_activations_as_ggml(base, tmp_path):
    """A block of an adapter stored as F16 (a negative width) takes x and x @ a.T rounded to F16
    before the products, as ggml's products against F16 matrices round them."""
    from pyllama.backend.cpu.backend import _lora_steps
    from pyllama.backend.base import Tensor
    from pyllama.ir.tensor import DType, Node
    from pyllama.util.settings import current
    rng = np.random.default_rng(0)
    n, k, m, widths = 3, 64, 40, (-4, 2)
    r = sum(abs(w) for w in widths)
    x, y = rng.standard_normal((n, k)).astype(np.float32), rng.standard_normal((n, m)).astype(np.float32)
    a = rng.standard_normal((r, k)).astype(np.float16).astype(np.float32)
    b = rng.standard_normal((m, r)).astype(np.float32)
    scale = np.array([[1.0, 0.5], [0.0, 2.0], [0.25, 0.0]], np.float32)
    out = np.zeros((n, m), np.float32)
    srcs = [Tensor(DType.F32, v.shape, f"s{i}") for i, v in enumerate((y, x, a, b, scale))]
    nd = Node(Op.LORA, Tensor(DType.F32, out.shape, "out"), tuple(srcs), widths)
    for step in _lora_steps(current().cpu, nd, [y, x, a, b, scale], out, 1):
        step()
    f16 = lambda v: v.astype(np.float16).astype(np.float32)  # noqa: E731
    t = np.concatenate([f16(f16(x) @ a[:4].T), x @ a[4:].T], axis=1)
    want = y + (t * np.repeat(scale, [4, 2], axis=1)) @ b.T
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    plain = y + (np.concatenate([x @ a[:4].T, x @ a[4:].T], axis=1) * np.repeat(scale, [4, 2], axis=1)) @ b.T
    assert np.abs(out - plain).max() > 1e-4  # (the rounding shows)


def test_the_graph_adds_one_lora_node_per_adapted_product(base, adapters):
    engine = Engine(base, n_threads=2, lora=adapters[1:])  # q, v and the output matrix
    try:
        hp = engine.model.hparams
        ctx = engine.new_context(64, 1)
        plan = ctx._plan(4, 1)
        nodes = [nd for split in plan.splits for nd in split.graph.nodes if nd.op == Op.LORA]
        assert len(nodes) == hp.n_layer + 1  # each block's q|k|v and the output layer
        # q and v at rank 2 each: one block of 4 in the fused q|k|v; the output's 2
        assert [tuple(nd.params) for nd in nodes] == [(4,)] * hp.n_layer + [(2,)]
    finally:
        engine.close()


def _write_adapter(path: str, arch: str, tensors: dict, **kv) -> str:
    w = GGUFWriter(path, arch)
    w.add_string("general.type", kv.pop("general_type", "adapter"))
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 4.0)
    for name, x in tensors.items():
        w.add_tensor(name, np.asarray(x, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_adapters_are_refused_with_one_clear_error(base, tmp_path, model_factory):
    model = Model(base)
    m, k = model.file.tensors["blk.0.attn_q.weight"].shape
    good = {"blk.0.attn_q.weight.lora_a": np.zeros((2, k)), "blk.0.attn_q.weight.lora_b": np.zeros((m, 2))}
    cases = {
        "not an adapter": (_write_adapter(str(tmp_path / "t.gguf"), "llama", good, general_type="model"),
                           "general.type"),
        "another arch": (_write_adapter(str(tmp_path / "a.gguf"), "qwen2", good), "made for 'qwen2'"),
        "half a pair": (_write_adapter(str(tmp_path / "h.gguf"), "llama",
                                       {"blk.0.attn_q.weight.lora_a": np.zeros((2, k))}), "has only its lora_a"),
        "wrong shape": (_write_adapter(str(tmp_path / "s.gguf"), "llama",
                                       {"blk.0.attn_q.weight.lora_a": np.zeros((2, k + 1)),
                                        "blk.0.attn_q.weight.lora_b": np.zeros((m, 2))}), "expected [r,"),
        "no such tensor": (_write_adapter(str(tmp_path / "n.gguf"), "llama",
                                          {"blk.99.attn_q.weight.lora_a": np.zeros((2, k)),
                                           "blk.99.attn_q.weight.lora_b": np.zeros((m, 2))}), "is not a tensor"),
        "embedding": (_write_adapter(str(tmp_path / "e.gguf"), "llama",
                                     {"token_embd.weight.lora_a": np.zeros((2, k)),
                                      "token_embd.weight.lora_b": np.zeros((model.hparams.n_vocab, 2))}),
                      "adapting 'token_embd.weight' is not supported"),
        "stray tensor": (_write_adapter(str(tmp_path / "x.gguf"), "llama", {**good, "blk.0.extra": np.zeros(3)}),
                         "neither a .lora_a nor a .lora_b"),
    }
    for what, (path, message) in cases.items():
        with pytest.raises(PyllamaError, match=None) as err:
            load_lora_set([path], model)
        assert message in str(err.value), (what, str(err.value))
    ok = _write_adapter(str(tmp_path / "ok.gguf"), "llama", good)
    with pytest.raises(LoraError, match=f"at most {MAX_ADAPTERS}"):
        load_lora_set([ok] * (MAX_ADAPTERS + 1), model)
    encoder = Model(model_factory("tiny", arch="bert"))
    with pytest.raises(LoraError, match="encoder"):
        load_lora_set([ok], encoder)


# --- programs ----------------------------------------------------------------------------------------
def test_generate_takes_the_flags_and_a_peer_runs_the_product(base, adapters):
    """generate's --lora-scaled gives the same tokens on the CPU and with the first layers on a
    local rpc server; a server that does not advertise LORA is refused at load in one line."""
    prompt = "one two three"
    plain = generated_tokens(base, prompt, 10)
    local = generated_tokens(base, prompt, 10, "--lora-scaled", f"{adapters[0]}:0.5")
    assert local != plain
    assert generated_tokens(base, prompt, 10, "--lora-init-without-apply", "--lora", adapters[0]) == plain
    from pyllama.rpc.protocol import Cap
    peer = RPCServerProcess()
    old = RPCServerProcess(env={"PYLLAMA_RPC_SERVER_CAPS": str(0xFFFF & ~int(Cap.LORA))})
    try:
        assert generated_tokens(base, prompt, 10, "--lora-scaled", f"{adapters[0]}:0.5", "--rpc", peer.endpoint,
                                "--device", "RPC0,CPU") == local
        proc = run_generate(base, prompt, 2, "--lora", adapters[0], "--rpc", old.endpoint, "--device", "RPC0,CPU")
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and "LORA" in lines[0] and old.endpoint in lines[0], proc.stderr
        bad = run_generate(base, prompt, 2, "--lora", base)
        assert bad.returncode == 1 and "general.type" in bad.stderr, bad.stderr
    finally:
        assert peer.stop() == 0
        assert old.stop() == 0


@pytest.fixture(scope="module")
def lora_server(base, adapters):
    server = ServerProcess(base, "--lora", adapters[0], "--lora-scaled", f"{adapters[1]}:0.25", "-np", "4", "-c", "1024")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _tokens(server: ServerProcess, lora=None, prompt=PROMPT_IDS, n: int = 10) -> list[int]:
    body = {"prompt": prompt, "n_predict": n, "top_k": 1, "return_tokens": True, "ignore_eos": True}
    if lora is not None:
        body["lora"] = lora
    status, doc = server.post("/completion", body)
    assert status == 200, doc
    return doc["tokens"]


def test_server_lists_and_sets_the_adapters(lora_server, adapters):
    status, doc = lora_server.request("GET", "/lora-adapters")
    assert status == 200
    assert [(a["id"], a["path"], a["scale"]) for a in doc] == [(0, adapters[0], 1.0), (1, adapters[1], 0.25)]
    default = _tokens(lora_server)
    assert default == _tokens(lora_server, [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.25}])
    off = _tokens(lora_server, [{"id": 0, "scale": 0.0}])  # an adapter it does not list is at 0
    try:
        assert lora_server.post("/lora-adapters", [])[0] == 200  # every adapter to 0
        assert _tokens(lora_server) == off != default
        status, doc = lora_server.request("GET", "/lora-adapters")
        assert [a["scale"] for a in doc] == [0.0, 0.0]
    finally:
        assert lora_server.post("/lora-adapters", [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.25}])[0] == 200
    status, doc = lora_server.post("/completion", {"prompt": PROMPT_IDS, "n_predict": 1,
                                                   "lora": [{"id": 0, "scale": 0.5}]})
    assert doc["generation_settings"]["lora"] == [{"id": 0, "scale": 0.5}]
    for bad, message in (([{"id": 2, "scale": 1}], "invalid adapter id 2"), ({"id": 0}, "'lora' must be"),
                         ([{"id": 0, "scale": "x"}], "finite number")):
        status, doc = lora_server.post("/completion", {"prompt": PROMPT_IDS, "n_predict": 1, "lora": bad})
        assert status == 400 and message in doc["error"]["message"], doc
    status, doc = lora_server.post("/lora-adapters", [{"id": 5, "scale": 1.0}])
    assert status == 400 and "invalid adapter id 5" in doc["error"]["message"]


def test_concurrent_requests_with_other_adapters_each_get_their_own(lora_server):
    """Requests with four adapter settings at once (decoded in shared batches) give what each
    gives alone; a slot's cache computed with other adapters is not reused."""
    settings = [None, [{"id": 0, "scale": 0.5}], [{"id": 1, "scale": 1.0}], [{"id": 0, "scale": 0.0}]]
    alone = [_tokens(lora_server, s) for s in settings]
    assert len({tuple(t) for t in alone}) == 4
    got: dict[int, list[int]] = {}

    def run(i: int) -> None:
        got[i] = _tokens(lora_server, settings[i])
    for _ in range(2):
        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [got[i] for i in range(4)] == alone


def test_server_refuses_a_bad_adapter_at_start(base, tmp_path):
    server = ServerProcess(base, "--lora", str(tmp_path / "missing.gguf"))
    try:
        code = server.proc.wait(60)
    finally:
        server.stop()
    assert code != 0 and "missing.gguf: no such file" in server.stderr_text, server.stderr_text
