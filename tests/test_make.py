"""pyllama.models.make (deterministic test models), its default vocabulary, and the float64
reference forward pass of tests/reference_forward.py run on the models it writes."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, GGUFWriter, quants

from pyllama.models.default_vocab import build_default_vocab, bytes_to_unicode
from pyllama.models.gguf_file import GGUFFile
from pyllama.models.make import (ARCHS, MIXES, PRESETS, WTYPES, count_parameters, make_model, tensor_plan,
                                 tensor_types)
from pyllama.models.quantize import K_QUANTS, quantize
from reference_forward import reference_logits

ROOT = Path(__file__).resolve().parent.parent
VOCAB_DIR = Path(__file__).resolve().parent / "data" / "vocab"
SPM_VOCAB = VOCAB_DIR / "ggml-vocab-llama-spm.gguf"
GPT2_VOCAB = VOCAB_DIR / "ggml-vocab-gpt-2.gguf"


def sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def expected_params(preset: str, arch: str = "llama", tied: bool | None = None, n_vocab: int | None = None) -> int:
    """Parameter count straight from the preset table (independent of make.tensor_plan)."""
    p = PRESETS[preset]
    tied = p.tied if tied is None else tied
    e, hd, v = p.n_embd, p.n_embd // p.n_head, n_vocab or p.n_vocab
    nq, nkv = p.n_head * hd, p.n_head_kv * hd
    layer = 2 * e + 2 * e * nq + 2 * e * nkv + 3 * e * p.n_ff  # 2 norms, q+o, k+v, gate+up+down
    if arch == "qwen2":
        layer += nq + 2 * nkv  # biases
    if arch == "qwen3":
        layer += 2 * hd  # q/k norms
    return v * e * (1 if tied else 2) + e + p.n_layer * layer


# ---- determinism ------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [{}, {"wtype": "q4_0", "arch": "qwen3"}, {"wtype": "bf16", "arch": "qwen2", "tied": True}])
def test_same_arguments_same_bytes(tmp_path, kw):
    a = make_model("tiny", str(tmp_path / "a.gguf"), **kw)
    b = make_model("tiny", str(tmp_path / "b.gguf"), **kw)
    assert sha256(a) == sha256(b)
    c = make_model("tiny", str(tmp_path / "c.gguf"), seed=1, **kw)
    assert sha256(c) != sha256(a)
    assert os.path.getsize(c) == os.path.getsize(a)
    assert sorted(os.listdir(tmp_path)) == ["a.gguf", "b.gguf", "c.gguf"]  # no temporary left over


def test_returns_path_and_accepts_any_name(tmp_path):
    out = str(tmp_path / "model.gguf.part")
    assert make_model("tiny", out) == out
    assert GGUFFile(out).get("general.name") == "pyllama-tiny"


# ---- sizes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset,kw", [("tiny", {}), ("tiny", {"arch": "qwen2"}), ("tiny", {"arch": "qwen3", "tied": True}),
                                       ("small", {"wtype": "q4_0"})])
def test_parameter_count_of_written_model(tmp_path, preset, kw):
    path = make_model(preset, str(tmp_path / "m.gguf"), **kw)
    n = sum(t.n_elements for t in GGUFFile(path).tensors.values())
    assert n == expected_params(preset, kw.get("arch", "llama"), kw.get("tied"))
    assert n == count_parameters(preset, kw.get("arch", "llama"), kw.get("tied"))


def test_parameter_counts_from_table():
    assert count_parameters("tiny") == expected_params("tiny") == 164_160
    # small and medium tie their output layer by default: ~15M (llama2.c's stories15M shape) and ~100M
    assert count_parameters("small") == expected_params("small") == 15_191_712
    assert count_parameters("small", tied=False) == expected_params("small", tied=False) == 24_407_712
    assert count_parameters("medium") == expected_params("medium") == 100_092_672
    assert count_parameters("medium", tied=False) == 124_668_672
    for arch in ("qwen2", "qwen3"):
        assert count_parameters("medium", arch) == expected_params("medium", arch)


# ---- file contents ----------------------------------------------------------------------------

# types every tensor of the tiny preset can take (K-quants need rows of a multiple of 256: see below)
TINY_WTYPES = [w for w, (t, _) in WTYPES.items()
               if t not in K_QUANTS and t not in (Q.IQ4_XS, Q.TQ1_0, Q.TQ2_0) and w not in MIXES]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("wtype", TINY_WTYPES)
def test_loads_with_both_readers(model_factory, arch, wtype):
    path = model_factory("tiny", arch=arch, wtype=wtype)
    p = PRESETS["tiny"]
    hd = p.n_embd // p.n_head
    gf = GGUFFile(path)
    md = gf.metadata
    assert md["general.architecture"] == arch
    assert md["general.name"] == "pyllama-tiny"
    assert md["general.file_type"] == int(WTYPES[wtype][1])
    expect = {"context_length": 512, "embedding_length": 64, "block_count": 2, "feed_forward_length": 192,
              "attention.head_count": 4, "attention.head_count_kv": 2, "rope.dimension_count": hd, "vocab_size": 512}
    for key, value in expect.items():
        assert md[f"{arch}.{key}"] == value, key
    assert md[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert md[f"{arch}.rope.freq_base"] == (10000.0 if arch == "llama" else 1e6)
    if arch == "qwen3":
        assert md["qwen3.attention.key_length"] == md["qwen3.attention.value_length"] == hd
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "default"
    assert len(md["tokenizer.ggml.tokens"]) == 512
    assert md["tokenizer.ggml.bos_token_id"] == 256 and md["tokenizer.ggml.eos_token_id"] == 257
    assert md["tokenizer.ggml.add_bos_token"] is True and md["tokenizer.ggml.add_eos_token"] is False

    t = gf.tensors
    wq = WTYPES[wtype][0]
    assert t["token_embd.weight"].shape == (512, 64) and t["token_embd.weight"].qtype == wq
    assert t["output.weight"].shape == (512, 64) and t["output.weight"].qtype == wq
    assert t["output_norm.weight"].shape == (64,) and t["output_norm.weight"].qtype == Q.F32
    assert t["blk.1.attn_q.weight"].shape == (64, 64)
    assert t["blk.1.attn_k.weight"].shape == t["blk.1.attn_v.weight"].shape == (2 * hd, 64)
    assert t["blk.1.attn_output.weight"].shape == (64, 64)
    assert t["blk.1.ffn_gate.weight"].shape == t["blk.1.ffn_up.weight"].shape == (192, 64)
    assert t["blk.1.ffn_down.weight"].shape == (64, 192)
    assert ("blk.0.attn_q.bias" in t) == (arch == "qwen2")
    assert ("blk.0.attn_k_norm.weight" in t) == (arch == "qwen3")
    for info in t.values():
        assert info.qtype == (wq if len(info.shape) == 2 else Q.F32), info.name
    if arch == "qwen2":
        assert t["blk.0.attn_k.bias"].shape == (2 * hd,)
    if arch == "qwen3":
        assert t["blk.0.attn_q_norm.weight"].shape == (hd,)

    reader = GGUFReader(path)
    assert {x.name for x in reader.tensors} == set(t)
    for x in reader.tensors:
        assert tuple(int(d) for d in reversed(x.shape)) == t[x.name].shape
        assert x.tensor_type == t[x.name].qtype
    assert reader.fields["general.architecture"].contents() == arch


def test_qwen2moe_is_never_tied():
    """llama.cpp's qwen2moe loader requires output.weight (it has no fallback to token_embd), so
    every preset writes one and --tied is refused."""
    for preset in ("tiny", "small", "medium"):
        assert tensor_plan(preset, "qwen2moe")[-1].name == "output.weight"
    with pytest.raises(ValueError, match="qwen2moe"):
        tensor_plan("tiny", "qwen2moe", tied=True)
    assert count_parameters("small", "qwen2moe") == count_parameters("small", "qwen2moe", tied=False)


def test_moe_arch_on_a_preset_without_experts():
    """tiny256 has no Mixture-of-Experts shape: one clear error, not a KeyError's traceback."""
    with pytest.raises(ValueError, match="tiny256"):
        tensor_plan("tiny256", "qwen3moe")
    r = subprocess.run([sys.executable, "-m", "pyllama.models.make", "--preset", "tiny256", "--arch", "mixtral",
                        "--out", os.devnull], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "tiny256" in r.stderr, r.stderr


PEERS = os.environ.get("PYLLAMA_PEERS")


@pytest.mark.skipif(not PEERS or not os.path.isfile(os.path.join(PEERS, "bin", "llama-bench")),
                    reason="PYLLAMA_PEERS names no folder with llama.cpp's bin/llama-bench")
@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_loads_every_arch(arch, tmp_path):
    """Each architecture's file, tied and untied where make writes both, loads and runs in
    llama.cpp (PYLLAMA_PEERS=/path/to/peers/llama.cpp python -m pytest tests/test_make.py -k llama_cpp)."""
    from peers import Peers  # noqa: PLC0415 (bench/, on the path through conftest)
    peers = Peers(PEERS)
    made = 0
    try:
        for tied in (True, False):
            path = str(tmp_path / f"{arch}-{tied}.gguf")
            try:
                make_model("tiny", path, arch=arch, tied=tied)
            except ValueError:
                continue  # a tying this architecture does not have (gemma: always tied)
            made += 1
            r = subprocess.run([peers.path("llama-bench"), "-m", path, "-t", "1", "-p", "4", "-n", "1", "-r", "1"],
                               env=peers.env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
            assert r.returncode == 0, f"{arch} tied={tied}: {r.stdout[-500:]}{r.stderr[-1500:]}"
    finally:
        peers.close()
    assert made >= 1


def test_tied_has_no_output_weight(model_factory):
    gf = GGUFFile(model_factory("tiny", tied=True))
    assert "output.weight" not in gf.tensors
    emb = gf.tensors["token_embd.weight"].raw.view(np.float32)
    assert abs(float(emb.std()) - 2.5 / 8) < 0.02  # N(0, 2.5/sqrt(n_embd)) as it is the output matrix too


def test_weight_scales(model_factory):
    gf = GGUFFile(model_factory("tiny"))

    def std(name):
        return float(gf.tensors[name].raw.view(np.float32).std())

    assert std("token_embd.weight") == pytest.approx(1.0, rel=0.02)
    assert std("output.weight") == pytest.approx(2.5 / 8, rel=0.02)
    assert std("blk.0.attn_q.weight") == pytest.approx(1 / 8, rel=0.05)
    assert std("blk.0.ffn_down.weight") == pytest.approx(0.5 / np.sqrt(192), rel=0.05)
    norm = gf.tensors["blk.0.attn_norm.weight"].raw.view(np.float32)
    assert abs(float(norm.mean()) - 1) < 0.05 and 0.05 < float(norm.std()) < 0.15


@pytest.mark.parametrize("vocab", [SPM_VOCAB, GPT2_VOCAB], ids=["llama-spm", "gpt-2"])
def test_vocab_is_copied(tmp_path, vocab):
    path = make_model("tiny", str(tmp_path / "m.gguf"), vocab=str(vocab), wtype="q8_0")
    src, dst = GGUFFile(str(vocab)).metadata, GGUFFile(path).metadata
    src_tok = {k: v for k, v in src.items() if k.startswith("tokenizer.")}
    dst_tok = {k: v for k, v in dst.items() if k.startswith("tokenizer.")}
    assert dst_tok == src_tok
    n_vocab = len(src["tokenizer.ggml.tokens"])
    assert dst["llama.vocab_size"] == n_vocab
    assert GGUFFile(path).tensors["token_embd.weight"].shape == (n_vocab, 64)
    if vocab == SPM_VOCAB:  # value types are kept too
        a, b = GGUFReader(str(vocab)).fields, GGUFReader(path).fields
        for key in src_tok:
            assert a[key].types == b[key].types, key


# ---- quantized types --------------------------------------------------------------------------

# Bounds on the relative RMS error of dequantize(quantize(x)) for N(0, s) weights. ggml's reference
# quantizer (what llama-quantize runs without an importance matrix) gives, on these models' tensors:
# Q2_K 0.297, Q3_K 0.151, Q4_0 0.086, Q4_1 0.078, Q4_K 0.0714, Q5_0 0.043, Q5_1 0.038, Q5_K 0.0361,
# Q6_K 0.0178, Q8_0 0.0054, IQ4_NL 0.0764, IQ4_XS 0.0770, MXFP4 0.1162. The bounds are those figures
# + 6% (small tensors scatter a little).
RMS_BOUND = {Q.Q2_K: 0.315, Q.Q3_K: 0.160, Q.Q4_0: 0.091, Q.Q4_1: 0.083, Q.Q4_K: 0.0757, Q.Q5_0: 0.0456,
             Q.Q5_1: 0.0403, Q.Q5_K: 0.0383, Q.Q6_K: 0.0189, Q.Q8_0: 0.0058, Q.F16: 1e-3, Q.BF16: 8e-3,
             Q.IQ4_NL: 0.081, Q.IQ4_XS: 0.0816, Q.MXFP4: 0.123}
K_WTYPES = [w for w, (t, _) in WTYPES.items() if t in K_QUANTS]
LEGACY_QUANT = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]


def rel_rms(y: np.ndarray, x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(y - x)) / np.mean(np.square(x))))


def use_more_bits_layers(n_layer: int) -> set[int]:
    """llama.cpp's layers with more bits in the _M mixes, listed from its rule for the sizes used here."""
    return {6: {2, 5}, 12: {0, 3, 6, 9, 10, 11}}[n_layer]


def expected_small_types(wtype: str) -> dict[str, Q]:
    """Per-tensor types of the small preset: n_embd 288 is not a multiple of 256, n_ff 768 is, so only
    ffn_down (768-wide rows) keeps a K type and everything else takes llama.cpp's fallback."""
    base, fallback = {"q2_k": (Q.Q2_K, Q.Q4_0), "q3_k": (Q.Q3_K, Q.Q4_0), "q4_k": (Q.Q4_K, Q.Q5_0),
                      "q5_k": (Q.Q5_K, Q.Q5_1), "q6_k": (Q.Q6_K, Q.Q8_0), "q4_k_m": (Q.Q4_K, Q.Q5_0),
                      "q5_k_m": (Q.Q5_K, Q.Q5_1)}[wtype]
    mix = wtype in MIXES
    # tied: token_embd is the output matrix, Q6_K in a mix, but Q8_0 as 288 is not a multiple of 256
    exp = {"token_embd.weight": Q.Q8_0 if mix else fallback, "output_norm.weight": Q.F32}
    for i in range(6):
        more = mix and i in use_more_bits_layers(6)
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            exp[f"blk.{i}.{name}.weight"] = fallback
        exp[f"blk.{i}.attn_v.weight"] = Q.Q8_0 if more else fallback  # Q6_K's fallback
        exp[f"blk.{i}.ffn_down.weight"] = Q.Q6_K if more else base
        exp[f"blk.{i}.attn_norm.weight"] = exp[f"blk.{i}.ffn_norm.weight"] = Q.F32
    return exp


@pytest.fixture(scope="module")
def small_512(model_factory):
    """make(wtype) -> the small preset with the tiny preset's 512-token vocabulary (small's layer
    shapes; a file that GGUFReader reads in milliseconds), and the float32 originals by name."""
    vocab = model_factory("tiny")
    f32 = GGUFFile(model_factory("small", vocab=vocab))
    originals = {name: info.raw.view(np.float32).reshape(info.shape) for name, info in f32.tensors.items()}

    def make(wtype: str) -> str:
        return model_factory("small", wtype=wtype, vocab=vocab)

    return make, originals


def assert_close_to_originals(reader: GGUFReader, originals: dict[str, np.ndarray]) -> set:
    """Every tensor dequantizes to within its type's bound of the float32 original; returns the types seen."""
    seen = set()
    for t in reader.tensors:
        x = originals[t.name]
        y = quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(x.shape)
        if t.tensor_type == Q.F32:
            assert np.array_equal(y, x), t.name
            continue
        seen.add(t.tensor_type)
        err = rel_rms(y, x)
        assert err < RMS_BOUND[t.tensor_type], (t.name, t.tensor_type.name, err)
    return seen


@pytest.mark.parametrize("wtype", K_WTYPES)
def test_k_quant_file_on_small(small_512, wtype):
    """Types tensor by tensor, read back by GGUFReader and by pyllama's reader; weights close to the
    float originals."""
    make, originals = small_512
    path = make(wtype)
    reader = GGUFReader(path)
    assert reader.fields["general.file_type"].contents() == int(WTYPES[wtype][1])
    expected = expected_small_types(wtype)
    assert {t.name: t.tensor_type for t in reader.tensors} == expected
    assert {name: info.qtype for name, info in GGUFFile(path).tensors.items()} == expected
    assert assert_close_to_originals(reader, originals) == {t for t in expected.values() if t != Q.F32}


@pytest.mark.parametrize("wtype", LEGACY_QUANT + ["f16", "bf16"])
def test_legacy_types_close_to_float_originals(model_factory, wtype):
    f32 = GGUFFile(model_factory("tiny"))
    originals = {name: info.raw.view(np.float32).reshape(info.shape) for name, info in f32.tensors.items()}
    reader = GGUFReader(model_factory("tiny", wtype=wtype))
    assert assert_close_to_originals(reader, originals) == {WTYPES[wtype][0]}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("wtype", ["q4_k_m", "q5_k_m"])
def test_mix_rules_on_medium(wtype, tied):
    """medium's rows (768, 2048) all take K-quants: the mix rules apply without fallback."""
    base = Q.Q4_K if wtype == "q4_k_m" else Q.Q5_K
    types = tensor_types(tensor_plan("medium", tied=tied), wtype)
    more = use_more_bits_layers(12)
    assert types.pop("token_embd.weight") == (Q.Q6_K if tied else base)
    if not tied:
        assert types.pop("output.weight") == Q.Q6_K
    for name, qtype in types.items():
        if name.endswith("norm.weight"):
            assert qtype == Q.F32, name
            continue
        layer = int(name.split(".")[1])
        if name.endswith(("attn_v.weight", "ffn_down.weight")) and layer in more:
            assert qtype == Q.Q6_K, name
        else:
            assert qtype == base, name
    assert sum(t == Q.Q6_K for t in types.values()) == 2 * len(more)


@pytest.mark.parametrize("wtype", K_WTYPES)
def test_k_types_on_medium_need_no_fallback(wtype):
    types = tensor_types(tensor_plan("medium", arch="qwen2"), wtype)
    kinds = {t for name, t in types.items() if not name.endswith(("norm.weight", "bias"))}
    expected = {WTYPES[wtype][0]} | ({Q.Q6_K} if wtype in MIXES else set())
    assert kinds == expected


def test_fallback_rules():
    from pyllama.models.make import TensorSpec
    plan = [TensorSpec(f"blk.0.{name}.weight", (4, row), "normal", 1.0)
            for name, row in (("attn_q", 256), ("attn_k", 64), ("attn_v", 48))]
    for wtype, on64 in [("q2_k", Q.Q4_0), ("q3_k", Q.Q4_0), ("q4_k", Q.Q5_0), ("q5_k", Q.Q5_1), ("q6_k", Q.Q8_0)]:
        types = tensor_types(plan, wtype)
        assert types == {"blk.0.attn_q.weight": WTYPES[wtype][0], "blk.0.attn_k.weight": on64,
                         "blk.0.attn_v.weight": Q.F16}, wtype
    with pytest.raises(ValueError, match="blk.0.attn_v.weight: rows of 48"):
        tensor_types(plan, "q4_0")


@pytest.mark.parametrize("wtype", K_WTYPES + ["tq1_0", "tq2_0"])
def test_k_types_refused_where_no_tensor_can_take_them(wtype):
    with pytest.raises(ValueError, match=r"multiple of 256.*blk\.0\.ffn_down\.weight has 192.*--preset medium"):
        tensor_types(tensor_plan("tiny"), wtype)


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                                   Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4])
def test_quantizer_round_trip_and_edge_rows(qtype):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((48, 1024), dtype=np.float32) * np.float32(0.02)
    x[0] = 0                                      # all zeros: decode to exactly zero
    x[1] = np.float32(0.5)                        # constant
    x[2] = -np.abs(x[2])                          # all negative
    x[3, 100] = 40.0                              # one outlier in a block
    x[4] = rng.standard_normal(1024).astype(np.float32) * np.float32(1e-30)  # below float16's range
    x[5, ::2] = 0                                 # half zeros
    q = quantize(x, qtype)
    block, type_size = GGML_QUANT_SIZES[qtype]
    assert q.dtype == np.uint8 and q.shape == (48, 1024 // block * type_size)
    y = quants.dequantize(q, qtype)
    assert np.isfinite(y).all()
    assert not y[0].any()
    assert rel_rms(y[6:], x[6:]) < RMS_BOUND[qtype]
    assert rel_rms(y[1], x[1]) < RMS_BOUND[qtype] and rel_rms(y[2], x[2]) < 2 * RMS_BOUND[qtype]
    # MXFP4's levels next to a block's largest are 4 and 6 times its power-of-two scale: 40 lies
    # halfway between 32 and 48
    assert abs(float(y[3, 100]) - 40.0) < 40.0 * (0.21 if qtype == Q.MXFP4 else RMS_BOUND[qtype])
    assert np.abs(y[4]).max() < 1e-6
    assert rel_rms(y[5], x[5]) < 1.5 * RMS_BOUND[qtype]
    assert np.array_equal(quantize(x, qtype), q)  # deterministic


@pytest.mark.parametrize("wtype", ["tq1_0", "tq2_0"])
def test_ternary_types_fall_back_to_q4_0(wtype):
    """llama-quantize --pure TQ1_0 / TQ2_0: every matrix in that type, Q4_0 where rows are not whole
    super-blocks (the small preset's 288)."""
    qtype = WTYPES[wtype][0]
    assert set(tensor_types(tensor_plan("medium"), wtype).values()) == {Q.F32, qtype}
    small = tensor_types(tensor_plan("small"), wtype)
    assert small["blk.0.ffn_down.weight"] == qtype and small["blk.0.attn_q.weight"] == Q.Q4_0
    assert set(small.values()) == {Q.F32, Q.Q4_0, qtype}


def test_iq4_and_mxfp4_mixes_follow_llama_quantize():
    """llama-quantize's IQ4_NL / IQ4_XS ftypes (no importance matrix): the output matrix Q6_K, attn_v
    Q5_K with 4+ query heads per KV head, ffn_down of the first n_layer/8 layers Q5_K; MXFP4_MOE:
    the experts MXFP4, every other matrix Q8_0."""
    from pyllama.models.make import Preset
    gqa4 = Preset(n_embd=256, n_layer=16, n_head=8, n_head_kv=2, n_ff=512, n_vocab=512, n_ctx=512, tied=False)
    plan = tensor_plan(gqa4, arch="qwen2")                         # 16 layers, 4 query heads per KV head
    for wtype, base in (("iq4_xs_mix", Q.IQ4_XS), ("iq4_nl_mix", Q.IQ4_NL)):
        types = tensor_types(plan, wtype)
        assert types["output.weight"] == Q.Q6_K and types["token_embd.weight"] == base
        assert all(types[f"blk.{i}.attn_v.weight"] == Q.Q5_K for i in range(16))
        assert [types[f"blk.{i}.ffn_down.weight"] for i in range(3)] == [Q.Q5_K, Q.Q5_K, base]
        assert types["blk.5.attn_q.weight"] == types["blk.5.ffn_up.weight"] == base
    assert tensor_types(tensor_plan("medium"), "iq4_xs_mix")["token_embd.weight"] == Q.Q6_K  # tied: the output
    assert tensor_types(tensor_plan("medium"), "iq4_xs_mix")["blk.1.attn_v.weight"] == Q.IQ4_XS  # 3 per KV head
    moe = tensor_types(tensor_plan("small", arch="qwen3moe"), "mxfp4_moe")
    assert {t for n, t in moe.items() if n.endswith("_exps.weight")} == {Q.MXFP4}
    assert {t for n, t in moe.items() if n.endswith(".weight") and "_exps" not in n and "norm" not in n
            and "gate_inp" not in n} == {Q.Q8_0}
    # IQ4_XS falls back to IQ4_NL on rows that are not whole super-blocks (the small preset's 288)
    assert set(tensor_types(tensor_plan("small"), "iq4_xs").values()) == {Q.F32, Q.IQ4_NL, Q.IQ4_XS}


def test_k_quant_file_is_deterministic(small_512, model_factory, tmp_path):
    make, _ = small_512
    for wtype in ("q4_k_m", "q3_k"):
        again = make_model("small", str(tmp_path / f"{wtype}.gguf"), wtype=wtype, vocab=model_factory("tiny"))
        assert sha256(make(wtype)) == sha256(again)


def test_cli_k_quant_errors(tmp_path):
    out = str(tmp_path / "m.gguf")
    line = _one_line_error(run_cli("--preset", "tiny", "--out", out, "--type", "q4_k_m"))
    assert "blk.0.ffn_down.weight" in line and "--preset medium" in line and "256" in line
    assert not os.path.exists(out)


# ---- the default vocabulary -------------------------------------------------------------------

@pytest.mark.parametrize("n_vocab", [258, 512, 32000])
def test_default_vocab_structure(n_vocab):
    tokens, types, merges = build_default_vocab(n_vocab)
    assert len(tokens) == len(types) == n_vocab and len(merges) == n_vocab - 258
    assert len(set(tokens)) == n_vocab
    b2u = bytes_to_unicode()
    assert tokens[:256] == [b2u[b] for b in range(256)] and types[:256] == [1] * 256
    assert tokens[256:258] == ["<s>", "</s>"] and types[256:258] == [3, 3]
    index = {t: i for i, t in enumerate(tokens)}
    for rank, merge in enumerate(merges):
        a, b = merge.split(" ")
        new = 258 + rank
        assert tokens[new] == a + b and types[new] == 1
        assert index[a] < new and index[b] < new and a not in ("<s>", "</s>") and b not in ("<s>", "</s>")
    assert build_default_vocab(n_vocab) == (tokens, types, merges)


def test_default_vocab_rejects_too_small():
    with pytest.raises(ValueError, match="258"):
        build_default_vocab(100)


def _hf_tokenizer(n_vocab):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tokens, _, merges = build_default_vocab(n_vocab)
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


ENGLISH = ("Once upon a time, there was a little girl named Lily. She liked to play in the garden with "
           "her friends. The quick brown fox jumps over the lazy dog; it was the best of times.")
OTHER = ["naïve café — “quotes”, 日本語のテキスト, emoji 🙂👍🏽, Ελληνικά, русский\n\n\ttab  two spaces",
         "x = [1, 2, 3]\nprint(x[-1] ** 2)  # 9\n", "\x00\x01 control \x7f bytes", ""]


@pytest.mark.parametrize("n_vocab", [512, 32000])
def test_default_vocab_round_trips_with_hf_tokenizers(n_vocab):
    tok = _hf_tokenizer(n_vocab)
    for text in [ENGLISH] + OTHER:
        enc = tok.encode(text)
        assert tok.decode(enc.ids) == text
    ids = tok.encode(ENGLISH).ids
    n_bytes = len(ENGLISH.encode())
    # English becomes multi-character tokens: >= 1.5 bytes per token with 512, >= 3 with 32000
    assert n_bytes / len(ids) >= (1.5 if n_vocab == 512 else 3.0)
    if n_vocab == 32000:
        pieces = tok.encode(ENGLISH).tokens
        for word in ("Ġthe", "Ġlittle", "Ġgirl", "Ġplay", "Ġgarden", "Ġfriends", "Ġquick", "Ġbrown"):
            assert word in pieces


# ---- reference forward on the generated models -----------------------------------------------

TOKENS = [256, 84, 104, 101, 300, 400, 32, 50, 511, 260, 1, 2]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("wtype", ["f32", "f16", "q8_0"])
def test_reference_logits_are_realistic(model_factory, arch, wtype):
    logits = reference_logits(model_factory("tiny", arch=arch, wtype=wtype), TOKENS)
    assert logits.shape == (len(TOKENS), 512) and logits.dtype == np.float64
    assert np.isfinite(logits).all()
    std = logits.std(axis=1)
    assert ((std > 1) & (std < 6)).all(), std
    assert not np.allclose(logits, logits[0]), "all rows equal"
    assert len(set(logits.argmax(axis=1).tolist())) > 1


def test_reference_logits_tied_and_quantized_are_close(model_factory):
    tied = reference_logits(model_factory("tiny", tied=True), TOKENS)
    assert np.isfinite(tied).all() and ((tied.std(axis=1) > 1) & (tied.std(axis=1) < 6)).all()
    f32 = reference_logits(model_factory("tiny"), TOKENS)
    q8 = reference_logits(model_factory("tiny", wtype="q8_0"), TOKENS)
    assert np.abs(q8 - f32).max() < 0.25  # same weights; 8-bit rounding of weights and activations only


def test_reference_is_causal(model_factory):
    path = model_factory("tiny", arch="qwen2")
    full = reference_logits(path, TOKENS)
    prefix = reference_logits(path, TOKENS[:5])
    np.testing.assert_allclose(prefix, full[:5], rtol=1e-12, atol=1e-12)


# ---- command line -----------------------------------------------------------------------------

def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "pyllama.models.make", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)


def test_cli_writes_a_model(tmp_path):
    out = tmp_path / "m.gguf"
    r = run_cli("--preset", "tiny", "--out", str(out), "--type", "q4_0", "--arch", "qwen3", "--seed", "3", "--tied")
    assert r.returncode == 0, r.stderr
    assert sha256(str(out)) == sha256(make_model("tiny", str(tmp_path / "api.gguf"), wtype="q4_0", arch="qwen3",
                                                   seed=3, tied=True))


def _one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


def test_cli_errors(tmp_path):
    out = str(tmp_path / "m.gguf")
    assert "preset" in _one_line_error(run_cli("--preset", "huge", "--out", out))
    assert "--out" in _one_line_error(run_cli("--preset", "tiny"))
    assert "seed" in _one_line_error(run_cli("--preset", "tiny", "--out", out, "--seed", "-1"))
    assert "type" in _one_line_error(run_cli("--preset", "tiny", "--out", out, "--type", "iq4_xs"))
    missing = str(tmp_path / "nope.gguf")
    assert missing in _one_line_error(run_cli("--preset", "tiny", "--out", out, "--vocab", missing))
    text = tmp_path / "vocab.txt"
    text.write_text("this is not a GGUF file, just some text that is long enough\n")
    assert str(text) in _one_line_error(run_cli("--preset", "tiny", "--out", out, "--vocab", str(text)))
    no_tokens = tmp_path / "no_tokens.gguf"
    w = GGUFWriter(str(no_tokens), "llama")
    w.add_key_value("general.name", "x", GGUFValueType.STRING)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    line = _one_line_error(run_cli("--preset", "tiny", "--out", out, "--vocab", str(no_tokens)))
    assert str(no_tokens) in line and "tokenizer.ggml.tokens" in line
    bad_dir = str(tmp_path / "no" / "such" / "dir" / "m.gguf")
    assert bad_dir in _one_line_error(run_cli("--preset", "tiny", "--out", bad_dir))
    assert not os.path.exists(out)


def test_api_errors(tmp_path):
    out = str(tmp_path / "m.gguf")
    for kw in ({"preset": "huge"}, {"wtype": "iq4_xs"}, {"wtype": "q4_k"}, {"wtype": "q5_k_m"}, {"arch": "gpt2"},
               {"seed": -1}):
        args = {"preset": "tiny", **kw}
        with pytest.raises(ValueError):
            make_model(args.pop("preset"), out, **args)
    assert not os.path.exists(out)


def test_file_type_names_are_llama_cpps():
    from gguf import LlamaFileType as F

    from pyllama.models.gguf_file import file_type_name
    assert file_type_name(int(F.ALL_F32)) == "all F32" and file_type_name(int(F.MOSTLY_F16)) == "F16"
    assert file_type_name(int(F.MOSTLY_Q4_K_M)) == "Q4_K - Medium" and file_type_name(int(F.MOSTLY_Q6_K)) == "Q6_K"
    assert file_type_name(int(F.MOSTLY_Q2_K_S)) == "Q2_K - Small" and file_type_name(int(F.MOSTLY_BF16)) == "BF16"
    for missing in (None, 999, "15", True):
        assert file_type_name(missing) == "unknown, may not work"
