"""llama.cpp's RoPE options (--rope-scaling, --rope-scale, --rope-freq-base, --rope-freq-scale,
--yarn-*): a plain model given them computes what the same weights compute from a file that
carries that scaling in its metadata, through the engine and generate's command line; values
that mean "the model's own" change nothing, and bad values are one clear error."""
from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

from pyllama.util.cli import Parser
from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
from pyllama.models.hparams import add_rope_args, model_overrides, rope_overrides
from pyllama.models.make import FamilyOptions
from server_util import ServerProcess, generated_tokens

PROMPT = [1, 5, 9, 13, 2, 7, 30, 41, 11, 3, 17, 8]


def options(line: str) -> argparse.Namespace:
    p = Parser(prog="t")
    add_rope_args(p)
    p.add_argument("--override-kv", dest="override_kv", default=[])
    return p.parse_args(line.split())


def logits(path: str, line: str = "") -> np.ndarray:
    engine = Engine(path, n_threads=1, kv_overrides=model_overrides(options(line)))
    try:
        batch = Batch.for_sequence(PROMPT, 0, 0, all_logits=True)
        return engine.new_context(64, 1).decode(batch).logits.copy()
    finally:
        engine.close()


def test_overrides_name_the_models_keys():
    assert rope_overrides(options("")) == {}
    assert rope_overrides(options("--rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 32768")) == {
        "{arch}.rope.scaling.type": "yarn", "{arch}.rope.scaling.factor": 4.0,
        "{arch}.rope.scaling.original_context_length": 32768}
    assert rope_overrides(options("--rope-freq-scale 0.25 --rope-freq-base 1e6")) == {
        "{arch}.rope.scaling.factor": 4.0, "{arch}.rope.freq_base": 1e6}
    # llama.cpp's "the model's own": 0 for the base, scale and original context, -1 for the yarn values
    assert rope_overrides(options("--rope-freq-base 0 --rope-freq-scale 0 --yarn-orig-ctx 0 --yarn-ext-factor -1 "
                                  "--yarn-attn-factor -1 --yarn-beta-fast -1 --yarn-beta-slow -1")) == {}
    assert rope_overrides(options("--yarn-ext-factor 0"))["{arch}.rope.scaling.yarn_ext_factor"] == 0.0


@pytest.mark.parametrize("kind,line", [
    ("linear", "--rope-scaling linear --rope-scale 4"),
    ("linear", "--rope-scaling linear --rope-freq-scale 0.25"),
    ("yarn", "--rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 128"),
])
def test_options_equal_a_file_with_that_scaling(model_factory, kind, line):
    """The tiny preset's yarn file has original_context_length = n_ctx 512 / factor 4 = 128."""
    plain = model_factory("tiny")
    scaled = model_factory("tiny", opts=FamilyOptions(rope_scaling=kind, rope_factor=4.0))
    want = logits(scaled)
    np.testing.assert_array_equal(logits(plain, line), want)
    assert np.abs(logits(plain) - want).max() > 1e-3  # the scaling matters at these positions


def test_the_files_scaling_can_be_changed_or_turned_off(model_factory):
    plain = model_factory("tiny")
    scaled = model_factory("tiny", opts=FamilyOptions(rope_scaling="yarn", rope_factor=4.0))
    np.testing.assert_array_equal(logits(scaled, "--rope-scaling none"), logits(plain))
    # yarn without extrapolation interpolates every pair, as linear scaling does (cos/sin unscaled)
    np.testing.assert_allclose(logits(scaled, "--yarn-ext-factor 0"), logits(plain, "--rope-scaling linear --rope-scale 4"),
                               rtol=0, atol=1e-4)
    base = logits(plain, "--rope-freq-base 500")
    assert np.abs(base - logits(plain)).max() > 1e-3
    np.testing.assert_array_equal(base, logits(plain, "--rope-freq-base 500 --yarn-beta-fast -1"))


def test_yarn_magnitude_follows_the_attn_and_ext_factors(model_factory):
    from pyllama.models.model import Model  # noqa: PLC0415
    scaled = model_factory("tiny", opts=FamilyOptions(rope_scaling="yarn", rope_factor=4.0))
    args = options("--yarn-attn-factor 0.5")
    assert Model(scaled, model_overrides(args)).hparams.rope_mscale == pytest.approx(0.5 * (1 + 0.1 * math.log(4)))
    assert Model(scaled, model_overrides(options("--yarn-ext-factor 0"))).hparams.rope_mscale == 1.0


@pytest.mark.parametrize("line,msg", [("--rope-scale 0", "must be a positive number"),
                                      ("--rope-scale x", "must be a positive number"),
                                      ("--rope-scaling dynamic", "invalid choice")])
def test_bad_values_are_one_clear_error(line, msg, capsys):
    with pytest.raises(SystemExit):
        options(line)
    assert msg in capsys.readouterr().err


def test_generate_takes_the_options(model_factory):
    plain = model_factory("tiny")
    scaled = model_factory("tiny", opts=FamilyOptions(rope_scaling="yarn", rope_factor=4.0))
    prompt = "The little cat sat on the mat"
    want = generated_tokens(scaled, prompt, 12)
    assert generated_tokens(plain, prompt, 12, "--rope-scaling", "yarn", "--rope-scale", "4",
                            "--yarn-orig-ctx", "128") == want


def test_the_server_takes_the_options(model_factory):
    plain = model_factory("tiny")
    scaled = model_factory("tiny", opts=FamilyOptions(rope_scaling="yarn", rope_factor=4.0))
    prompt = "The little cat sat on the mat"
    want = generated_tokens(scaled, prompt, 12)
    srv = ServerProcess(plain, "-c", "512", "-np", "1", "--rope-scaling", "yarn", "--rope-scale", "4",
                        "--yarn-orig-ctx", "128").wait_ready()
    try:
        status, doc = srv.post("/completion", {"prompt": prompt, "n_predict": 12, "temperature": 0,
                                               "ignore_eos": True, "return_tokens": True})
        assert status == 200, doc
        assert doc["tokens"] == want
    finally:
        assert srv.stop() == 0
