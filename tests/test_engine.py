"""The forward pass against an independent float64 reference, and the engine's invariants:
batched decode equals decoding alone, a layer split equals one device, micro-batches equal one batch."""
from __future__ import annotations

import numpy as np
import pytest

from pyllama.backend.base import DType
from pyllama.backend.cpu import CPUBackend
from pyllama.runtime.context import PLAN_CACHE, Batch, Context
from pyllama.runtime.engine import Engine
from pyllama.models.model import Model
from pyllama.models.weights import Placement, load_weights, split_layers
from reference_forward import reference_logits

PROMPTS = [
    [256, 10, 20, 30, 40, 50, 60, 70],
    [256, 300, 301, 302],
    [256, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
    [256, 400, 9],
]


def make_context(path: str, n_backends: int = 1, n_ctx: int = 256, n_seq: int = 4, n_ubatch: int = 64,
                 kv_unified: bool = False, kv_type: DType = DType.F32) -> Context:
    """An F32 KV cache unless asked: the float64 reference keeps k and v unrounded."""
    model = Model(path)
    backends = [CPUBackend(1, f"CPU{i}") for i in range(n_backends)]
    placement = Placement(backends, split_layers(model.hparams.n_layer, [1] * n_backends))
    return Context(model, load_weights(model, placement), placement, n_ctx, n_seq, 256, n_ubatch, kv_unified,
                   type_k=kv_type, type_v=kv_type)


def greedy_run(ctx: Context, prompts: list[list[int]], n_gen: int, seqs: list[int]) -> list[list[int]]:
    """Decodes the prompts together in one batch, then n_gen greedy steps for all of them together."""
    batch = Batch.concat([Batch.for_sequence(p, 0, s) for p, s in zip(prompts, seqs)])
    out = ctx.decode(batch)
    pos = [len(p) for p in prompts]
    result: list[list[int]] = [[] for _ in prompts]
    for _ in range(n_gen):
        ids = out.logits.argmax(axis=1)
        for i, t in enumerate(ids.tolist()):
            result[i].append(t)
        out = ctx.decode(Batch(ids, pos, seqs, np.ones(len(ids), bool)))
        pos = [p + 1 for p in pos]
    return result


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("wtype", ["f32", "f16", "q8_0"])
def test_logits_match_float64_reference(model_factory, arch, wtype):
    path = model_factory("tiny", arch=arch, wtype=wtype)
    tokens = PROMPTS[0] + PROMPTS[2]
    ref = reference_logits(path, tokens)
    ctx = make_context(path)
    got = ctx.decode(Batch.for_sequence(tokens, 0, 0, all_logits=True)).logits.astype(np.float64)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    # F16 and Q8_0 weights take their activations rounded to F16 / Q8_0 (as ggml, and as the
    # reference): a float32 difference of one ulp upstream may move one rounding, by up to ~1e-3
    tol = 1e-4 if wtype == "f32" else 1e-3
    assert rel < tol, f"relative error {rel:.2e}"
    assert ref.std(axis=1).min() > 0.5  # the model is not degenerate, so the comparison means something


def test_logits_match_reference_incrementally(tiny_model):
    """The KV cache path: one token at a time gives the same logits as the reference's full pass."""
    tokens = PROMPTS[2]
    ref = reference_logits(tiny_model, tokens)
    ctx = make_context(tiny_model)
    rows = [ctx.decode(Batch.for_sequence([t], i, 1)).logits[0].astype(np.float64) for i, t in enumerate(tokens)]
    rel = np.abs(np.array(rows) - ref).max() / np.abs(ref).max()
    assert rel < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batched_greedy_equals_alone(model_factory, arch):
    path = model_factory("tiny", arch=arch)
    together = greedy_run(make_context(path), PROMPTS, 12, [0, 1, 2, 3])
    for i, prompt in enumerate(PROMPTS):
        alone = greedy_run(make_context(path), [prompt], 12, [i])
        assert alone[0] == together[i], f"sequence {i}"
    assert len({tuple(r) for r in together}) > 1  # different prompts, different continuations


def test_layer_split_equals_one_device(tiny_model):
    one = greedy_run(make_context(tiny_model), PROMPTS, 10, [0, 1, 2, 3])
    two = greedy_run(make_context(tiny_model, n_backends=2), PROMPTS, 10, [0, 1, 2, 3])
    assert one == two
    ctx = make_context(tiny_model, n_backends=2)
    plan = ctx._plan(4, 4)
    assert [s.backend.name for s in plan.splits] == ["CPU0", "CPU1"]
    assert [c.dst.name for c in plan.splits[1].copies] == ["l_out-0"]  # the hidden state crosses once


def test_micro_batches_equal_one_batch(tiny_model):
    tokens = PROMPTS[2] + PROMPTS[0]
    whole = make_context(tiny_model, n_ubatch=64).decode(Batch.for_sequence(tokens, 0, 0, all_logits=True)).logits
    small = make_context(tiny_model, n_ubatch=3).decode(Batch.for_sequence(tokens, 0, 0, all_logits=True)).logits
    np.testing.assert_allclose(small, whole, rtol=0, atol=1e-5)
    assert (small.argmax(1) == whole.argmax(1)).all()


@pytest.mark.parametrize("n_backends", [1, 2])
def test_one_micro_batch_leaves_its_logits_in_place(tiny_model, n_backends):
    """A decode of one micro-batch on host-memory devices returns the output layer's own rows (no
    copy of n_outputs x n_vocab floats), the values the copying path gives, until the next decode."""
    tokens = PROMPTS[2] + PROMPTS[0]
    ctx = make_context(tiny_model, n_backends=n_backends, n_ubatch=64)
    out = ctx.decode(Batch.for_sequence(tokens, 0, 0, all_logits=True))
    last = ctx.sched.buffers[-1].data
    assert np.shares_memory(out.logits, last) and out.logits.flags.c_contiguous
    assert out.logits.shape == (len(tokens), ctx.hparams.n_vocab)
    copied = make_context(tiny_model, n_backends=n_backends, n_ubatch=8).decode(
        Batch.for_sequence(tokens, 0, 0, all_logits=True)).logits
    assert not np.shares_memory(copied, last)
    np.testing.assert_allclose(out.logits, copied, rtol=0, atol=1e-5)
    kept = out.logits.copy()
    again = ctx.decode(Batch([7, 8], [len(tokens), len(tokens) + 1], [0, 0], np.array([False, True])))
    assert again.logits.shape == (1, ctx.hparams.n_vocab) and again.rows.tolist() == [1]
    assert np.shares_memory(again.logits, ctx.sched.buffers[-1].data)
    assert not np.array_equal(again.logits[0], kept[-1])


def test_only_requested_rows_produce_logits(tiny_model):
    ctx = make_context(tiny_model)
    want = np.array([False, True, False, False, True, False, False, True])
    out = ctx.decode(Batch(PROMPTS[0], range(8), [0] * 8, want))
    assert out.logits.shape == (3, ctx.hparams.n_vocab)
    assert out.rows.tolist() == [1, 4, 7]
    full = make_context(tiny_model).decode(Batch.for_sequence(PROMPTS[0], 0, 0, all_logits=True)).logits
    np.testing.assert_allclose(out.logits, full[[1, 4, 7]], atol=1e-5)


def test_sequence_removal_and_reuse(tiny_model):
    ctx = make_context(tiny_model)
    first = ctx.decode(Batch.for_sequence(PROMPTS[0], 0, 0)).logits.copy()
    ctx.seq_rm(0, 3)  # keep the first 3 positions, as a cached prompt prefix
    again = ctx.decode(Batch.for_sequence(PROMPTS[0][3:], 3, 0)).logits
    np.testing.assert_allclose(again, first, atol=1e-5)
    ctx.seq_rm(0)
    assert ctx.kv.seq_len(0) == 0 and ctx.kv.used_cells == 0


def test_engine_loads_and_makes_contexts(tiny_model):
    engine = Engine(tiny_model, n_threads=1)
    ctx = engine.new_context(128, 2)
    assert ctx.seq_cap == 64
    ids = engine.tokenizer.encode("hello world")
    assert ctx.decode(Batch.for_sequence(ids, 0, 1)).logits.shape == (1, engine.model.hparams.n_vocab)
    engine.close()


def test_tied_output_is_stored_once_per_device(model_factory):
    path = model_factory("tiny", tied=True)
    model = Model(path)
    one = Placement([CPUBackend(1)], split_layers(model.hparams.n_layer, [1]))
    w1 = load_weights(model, one)
    assert w1["output"] is w1["token_embd"]
    two = Placement([CPUBackend(1, "CPU0"), CPUBackend(1, "CPU1")], split_layers(model.hparams.n_layer, [1, 1]))
    w2 = load_weights(model, two)  # the output layer sits on the other device: it needs its own copy
    assert w2["output"].backend is not w2["token_embd"].backend
    emb = model.hparams.n_vocab * model.hparams.n_embd * 4
    assert sum(w2.bytes_per_backend.values()) - sum(w1.bytes_per_backend.values()) >= emb
    ref = reference_logits(path, PROMPTS[0])
    for placement in (one, two):
        ctx = Context(model, load_weights(model, placement), placement, 64, 1, type_k=DType.F32, type_v=DType.F32)
        got = ctx.decode(Batch.for_sequence(PROMPTS[0], 0, 0, all_logits=True)).logits
        assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4


def test_attention_refuses_head_counts_that_wrap_32_bits():
    """H * hd computed in 32 bits would wrap to a plausible width and pass the shape checks."""
    from pyllama._fast import ops
    H, Hkv, hd = 65537, 1, 65536  # (H + 2 Hkv) * hd wraps to 3 * 65536 in 32 bits
    f = np.zeros((1, 3 * 65536), np.float32)
    cache = np.zeros((4, 65536), np.float32)
    i1 = np.zeros(1, np.int32)
    with pytest.raises(ValueError, match="shapes"):
        ops.attention(f, cache, cache.copy(), i1, i1, i1, np.array([[0, 1]], np.int32),
                      np.zeros(0, np.float32), np.zeros(0, np.float32), np.zeros((1, 65536), np.float32),
                      H, Hkv, hd, 2, 0, 10000.0, 1.0, 1e-5, 1.0, 1)


def test_plans_stay_bounded_over_many_batch_shapes(tiny_model):
    """Under a mixed load nearly every step has another (tokens, outputs) shape. The context keeps a
    bounded number of plans (each holds a graph, its host staging and the devices' bound kernels),
    tells the devices to forget the graphs it drops, and plans a dropped shape again alike."""
    cap = PLAN_CACHE
    ctx = make_context(tiny_model, n_backends=2, n_ctx=512, n_seq=1, n_ubatch=512)
    forgotten: list[int] = []
    for b in ctx.placement.backends:
        inner = b.forget_graph
        b.forget_graph = lambda uid, inner=inner: (forgotten.append(uid), inner(uid))[1]
    tokens = [int(t) for t in np.random.default_rng(0).integers(300, 500, cap + 40)]
    first = ctx.decode(Batch.for_sequence(tokens[:1], 0, 0)).logits.copy()
    ctx.seq_rm(0)
    for n in range(2, cap + 41):
        ctx.decode(Batch.for_sequence(tokens[:n], 0, 0))
        ctx.seq_rm(0)
    assert len(ctx._plans) <= cap
    assert len(forgotten) >= 2 * 40  # every dropped plan's graphs, on both devices
    again = ctx.decode(Batch.for_sequence(tokens[:1], 0, 0)).logits
    np.testing.assert_array_equal(again, first)


def test_each_context_computes_on_a_stream_of_its_own(tiny_model):
    """Every context (a pipeline group's) asks each device for a stream of its own; the CPU gives
    its default stream (it computes on the calling thread), so the greedy results are those of one
    context. (A GPU's streams of their own: tests/test_cuda.py, on the fake device.)"""
    engine = Engine(tiny_model, n_threads=1)
    try:
        a, b = engine.new_context(64), engine.new_context(64)
        sa, sb = a.sched.streams[0], b.sched.streams[0]
        assert sa is sb is engine.backends[0] and sa.backend is engine.backends[0]
        tokens = engine.tokenizer.encode("Hello there")
        np.testing.assert_array_equal(a.decode(Batch.for_sequence(tokens, 0, 0)).logits,
                                      b.decode(Batch.for_sequence(tokens, 0, 0)).logits)
    finally:
        engine.close()
