"""Shared fixtures: tiny test models made once per session with pyllama.models.make."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests import their helpers (reference_forward)

from pyllama.models.make import make_model  # noqa: E402


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """make(preset="tiny", **kw) -> path, cached per argument set for the whole session."""
    made: dict[tuple, str] = {}
    base = tmp_path_factory.mktemp("models")

    def make(preset: str = "tiny", **kw) -> str:
        key = (preset, tuple(sorted(kw.items())))
        if key not in made:
            name = "-".join([preset] + [f"{k}={v}" for k, v in sorted(kw.items())]).replace("/", "_")
            made[key] = make_model(preset, str(base / f"{name}.gguf"), **kw)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(model_factory) -> str:
    return model_factory("tiny")


@pytest.fixture(scope="module")
def rpc_peer():
    """One `python -m pyllama.rpc_server` for the module's tests."""
    from server_util import RPCServerProcess  # noqa: PLC0415
    p = RPCServerProcess()
    yield p
    assert p.stop() == 0
