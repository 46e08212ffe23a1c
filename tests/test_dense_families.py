"""The dense families (gemma2, gemma3, phi3, glm4) and RoPE scaling (linear, YaRN, llama3's rope_freqs):
greedy tokens and logits against the float64 reference written from the published model
definitions, each feature shown to matter (a sliding window limits attention, each scaling moves
the logits), identical tokens locally, over RPC0,CPU and in 2 pipeline groups, and a device
without the family's ops refused at load."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from pyllama.backend.cpu import CPUBackend
from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
from pyllama.util.errors import PyllamaError
from pyllama.models.gguf_file import GGUFFile
from pyllama.models.make import FamilyOptions
from pyllama.models.model import Model
from pyllama.ir.tensor import Op
from pyllama.models.weights import Placement, load_weights
from reference_forward import reference_logits
from server_util import RPCServerProcess, assert_same_tokens_in_two_groups, generated_tokens, run_generate

PROMPT = "The little cat sat on the mat and looked at the"
WINDOW = 8  # the tiny models' sliding window: the prompt is longer, so it binds

# name -> (--arch, family options): every architecture, each feature at a size where it matters
# (gemma3 at the small preset: its sixth layer is the first global one, the one that scales RoPE)
PRESET = {"gemma3-linear": "small"}
CASES = {
    "gemma2": ("gemma2", FamilyOptions(sliding_window=WINDOW, attn_softcap=5.0, final_softcap=3.0)),
    "gemma3": ("gemma3", FamilyOptions(sliding_window=WINDOW)),
    "gemma3-linear": ("gemma3", FamilyOptions(sliding_window=WINDOW, rope_scaling="linear", rope_factor=8.0)),
    "phi3": ("phi3", FamilyOptions()),
    "phi3-partial": ("phi3", FamilyOptions(n_rot=12)),
    "llama-linear": ("llama", FamilyOptions(rope_scaling="linear", rope_factor=4.0)),
    "llama-yarn": ("llama", FamilyOptions(rope_scaling="yarn", rope_factor=4.0)),
    "llama-rope-freqs": ("llama", FamilyOptions(rope_freqs=True)),
    "qwen2-yarn": ("qwen2", FamilyOptions(rope_scaling="yarn", rope_factor=8.0)),
    "phi3-longrope": ("phi3", FamilyOptions(longrope=True, output_bias=True)),
    "qwen2-output-bias": ("qwen2", FamilyOptions(output_bias=True)),
    "glm4": ("glm4", FamilyOptions()),
}


@pytest.fixture(scope="module")
def make(model_factory):
    def make(name: str, **kw) -> str:
        arch, opts = CASES[name]
        return model_factory(PRESET.get(name, "tiny"), arch=arch, opts=opts, **kw)
    return make


def run_greedy(path: str, n: int = 12, n_ctx: int = 256) -> tuple[list[int], list[int], np.ndarray]:
    """(prompt, greedy tokens, the logits each came from [n, n_vocab])."""
    engine = Engine(path, n_threads=2)
    try:
        prompt = engine.tokenizer.encode(PROMPT)
        ctx = engine.new_context(n_ctx, 1)
        out = ctx.decode(Batch.for_sequence(prompt, 0, 0))
        tokens, logits = [], []
        for i in range(n):
            logits.append(out.logits[0].copy())
            tokens.append(int(out.logits[0].argmax()))
            out = ctx.decode(Batch.for_sequence([tokens[-1]], len(prompt) + i, 0))
    finally:
        engine.close()
    return prompt, tokens, np.array(logits)


def prompt_logits(path: str) -> np.ndarray:
    """pyllama's logits of every prompt position, in one batch."""
    engine = Engine(path, n_threads=2)
    try:
        prompt = engine.tokenizer.encode(PROMPT)
        ctx = engine.new_context(256, 1)
        batch = Batch.for_sequence(prompt, 0, 0)
        batch.logits[:] = True
        return ctx.decode(batch).logits[:len(prompt)].copy()
    finally:
        engine.close()


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_and_logits_match_the_reference(make, name):
    path = make(name)
    prompt, tokens, logits = run_greedy(path)
    assert len(prompt) > WINDOW
    # the logits each token came from (run_greedy's context: 256 positions)
    ref = reference_logits(path, prompt + tokens, n_ctx_seq=256)[len(prompt) - 1:-1]
    assert np.abs(logits - ref).max() <= 2e-3 * np.abs(ref).max()
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 1e-2 * np.abs(ref).max()
    assert clear.sum() >= len(tokens) // 2, "too few steps with a clear margin to compare"
    for i in np.flatnonzero(clear):
        assert tokens[i] == int(ref[i].argmax()), f"step {i}: {tokens[i]} vs the reference's {int(ref[i].argmax())}"


@pytest.mark.parametrize("n_ctx", [64, 256])
def test_longrope_takes_the_short_or_long_factors_by_the_context_length(make, n_ctx):
    """The tiny phi3's original context is 512 / 4 = 128 positions: a 64-position context takes
    the short factors, a 256-position one the long ones (llama.cpp's rule), each as the
    reference computes it; the two differ."""
    path = make("phi3-longrope")
    prompt, tokens, logits = run_greedy(path, 6, n_ctx)
    ref = reference_logits(path, prompt + tokens, n_ctx_seq=n_ctx)[len(prompt) - 1:-1]
    assert np.abs(logits - ref).max() <= 2e-3 * np.abs(ref).max()
    other = reference_logits(path, prompt + tokens, n_ctx_seq=320 - n_ctx)[len(prompt) - 1:-1]
    assert np.abs(other - ref).max() > 1e-2 * np.abs(ref).max()


def test_the_sliding_window_limits_attention(model_factory):
    """Same weights, windows of 8 and 4096: the first 8 positions see the same cells, every later
    one sees fewer with the small window, and its logits move (both as the reference says)."""
    small = model_factory("tiny", arch="gemma3", opts=FamilyOptions(sliding_window=WINDOW))
    wide = model_factory("tiny", arch="gemma3", opts=FamilyOptions(sliding_window=4096))
    a, b = prompt_logits(small), prompt_logits(wide)
    scale = np.abs(b).max()
    assert np.abs(a[:WINDOW] - b[:WINDOW]).max() <= 1e-5 * scale
    assert np.abs(a[WINDOW:] - b[WINDOW:]).max(axis=1).min() > 1e-3 * scale
    engine = Engine(small, n_threads=1)
    prompt = engine.tokenizer.encode(PROMPT)
    engine.close()
    for path, got in ((small, a), (wide, b)):
        ref = reference_logits(path, prompt)
        assert np.abs(got - ref).max() <= 2e-3 * np.abs(ref).max()


@pytest.mark.parametrize("name", ["llama-linear", "llama-yarn", "llama-rope-freqs", "gemma3-linear"])
def test_each_rope_scaling_moves_the_logits(model_factory, make, name):
    """The scaled model has the same weights as the plain one (the options change metadata, and
    rope_freqs.weight is generated last): its logits differ, so the agreement with the reference
    above checks the scaling itself."""
    arch, opts = CASES[name]
    plain = model_factory(PRESET.get(name, "tiny"), arch=arch, opts=FamilyOptions(sliding_window=opts.sliding_window))
    a, b = prompt_logits(make(name)), prompt_logits(plain)
    assert np.abs(a - b).max() > 1e-2 * np.abs(b).max()
    assert np.abs(a[0] - b[0]).max() <= 1e-5 * np.abs(b).max()  # position 0 rotates by nothing


def test_gemma_and_phi3_tensors_and_metadata(make):
    g2 = GGUFFile(make("gemma2"))
    assert "output.weight" not in g2.tensors  # tied, as llama.cpp loads gemma
    assert {"blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight"} <= set(g2.tensors)
    assert g2.get("gemma2.attention.sliding_window") == WINDOW
    hp = Model(make("gemma2")).hparams
    assert hp.swa_layers == (True, False) and hp.attn_softcap == 5.0 and hp.final_softcap == 3.0
    assert hp.embd_scale == pytest.approx(8.0) and hp.ffn_gelu and hp.post_norms
    hp3 = Model(make("gemma3-linear")).hparams
    assert hp3.swa_layers == (True,) * 5 + (False,) and hp3.rope_base_swa == 10000.0 and hp3.rope_scale == 0.125
    phi = GGUFFile(make("phi3-partial"))
    assert phi.tensors["blk.0.attn_qkv.weight"].shape == (64 + 2 * 32, 64)
    assert phi.tensors["blk.0.ffn_up.weight"].shape == (2 * 192, 64)
    assert Model(make("phi3-partial")).hparams.n_rot == 12
    lr = Model(make("phi3-longrope"))
    assert {"rope_factors_long.weight", "rope_factors_short.weight", "output.bias"} <= set(lr.file.tensors)
    assert lr.output_bias and "output_bias" in lr.logical_weights()
    assert lr.hparams.n_ctx_orig == 128 and lr.hparams.rope_mscale == pytest.approx((1 + np.log(4) / np.log(128)) ** 0.5)
    assert not Model(make("phi3")).output_bias and Model(make("phi3")).hparams.rope_mscale == 1.0


def test_output_bias_and_longrope_options_are_refused_where_llama_cpp_reads_none(tmp_path):
    from pyllama.models.make import make_model
    with pytest.raises(ValueError, match="output.bias"):
        make_model("tiny", str(tmp_path / "a.gguf"), arch="llama", opts=FamilyOptions(output_bias=True))
    with pytest.raises(ValueError, match="longrope"):
        make_model("tiny", str(tmp_path / "b.gguf"), arch="qwen2", opts=FamilyOptions(longrope=True))


def test_make_cli_writes_the_families(tmp_path):
    out = tmp_path / "g.gguf"
    r = subprocess.run([sys.executable, "-m", "pyllama.models.make", "--preset", "tiny", "--out", str(out),
                        "--arch", "gemma2", "--sliding-window", "16", "--rope-scaling", "yarn", "--rope-factor", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    gf = GGUFFile(str(out))
    assert gf.get("gemma2.attention.sliding_window") == 16 and gf.get("gemma2.rope.scaling.type") == "yarn"
    bad = subprocess.run([sys.executable, "-m", "pyllama.models.make", "--preset", "tiny", "--out", str(out),
                          "--arch", "phi3", "--n-rot", "7"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "n_rot must be even" in bad.stderr


class _NoFamilyOps(CPUBackend):
    """A device like the CUDA backend: none of GEGLU, SCALE, SOFTCAP."""

    def supports(self, op: int) -> bool:
        return op not in (Op.GEGLU, Op.SCALE, Op.SOFTCAP) and super().supports(op)


@pytest.mark.parametrize("name", ["gemma2", "llama-yarn"])
def test_a_device_without_the_ops_is_refused_at_load(make, name):
    model = Model(make(name))
    with pytest.raises(PyllamaError, match="cannot run on NOOPS"):
        load_weights(model, Placement([_NoFamilyOps(1, name="NOOPS")], [0, 0]), upload=False)
    # the plain families still load there
    plain = Model(make("phi3"))
    load_weights(plain, Placement([_NoFamilyOps(1, name="NOOPS")], [0, 0]), upload=False)


@pytest.mark.parametrize("name", ["gemma2", "gemma3-linear", "phi3-partial", "llama-yarn", "phi3-longrope", "glm4"])
def test_tokens_identical_local_rpc_and_pipeline_groups(make, rpc_peer, name):
    model = make(name)
    local = generated_tokens(model, PROMPT, 12)
    assert generated_tokens(model, PROMPT, 12, "--rpc", rpc_peer.endpoint, "--device", "RPC0,CPU") == local
    assert_same_tokens_in_two_groups(model, PROMPT, 12, local)


@pytest.mark.parametrize("name", ["gemma2", "llama-yarn"])
def test_a_server_without_family_ops_is_refused_at_load(make, name):
    """An rpc server that does not advertise FAMILY_OPS (an older build) gets none of these
    layers: the load stops with one line naming the server; a plain model still runs on it."""
    from pyllama.rpc.protocol import Cap
    old = RPCServerProcess(env={"PYLLAMA_RPC_SERVER_CAPS": str(0xFFFF & ~int(Cap.FAMILY_OPS))})
    try:
        proc = run_generate(make(name), PROMPT, 2, "--rpc", old.endpoint, "--device", "RPC0,CPU")
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr
        assert old.endpoint in lines[0] and "GEGLU" in lines[0], lines[0]
        assert generated_tokens(make("phi3"), PROMPT, 2, "--rpc", old.endpoint, "--device", "RPC0,CPU")
    finally:
        assert old.stop() == 0
