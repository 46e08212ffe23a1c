"""Shared fixtures: tiny test models made once per session with pyllama.models.make; the tiers.

Every test is in one tier, given by a marker set here: `fuzz` (the randomized fuzzers' modules),
`integration` (a test that starts a process, a server or a socket, by itself, through one of its
fixtures or through a helper of its module: read from their source; and the end-to-end model
modules that mark themselves so: whole forward passes against the reference, every vocabulary),
else `unit`. `pytest -m unit` runs in about a minute.
"""
from __future__ import annotations

import inspect
import lzma
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Optional

import pytest

# tests import their helpers (reference_forward) and bench/'s: the server and rpc helpers
# (server_util, rpc_client) and the benches they drive
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from pyllama.models.make import make_model  # noqa: E402
from pyllama.util import settings as process_settings  # noqa: E402


@pytest.fixture(autouse=True)
def _settings_restored():
    """A test that changes the process's settings (env_settings, settings.load) changes them for
    itself only."""
    before = process_settings._current
    yield
    process_settings._current = before


@pytest.fixture
def env_settings(monkeypatch):
    """env_settings(NAME=value or None, ...): sets (None: unsets) the variables and reads the
    process's settings again, as an entry point does at start-up."""
    def apply(**names: Optional[str]) -> process_settings.Settings:
        for name, value in names.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        return process_settings.load()
    return apply


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


VOCAB_DIR = Path(__file__).parent / "data" / "vocab"


@pytest.fixture(scope="session")
def vocab_path(tmp_path_factory):
    """A vocabulary of tests/data/vocab by name, decompressed into a temporary folder (once per
    session) when it is stored as .xz."""
    tmp = tmp_path_factory.mktemp("vocab")

    def get(name: str) -> Path:
        plain = VOCAB_DIR / name
        if plain.exists():
            return plain
        out = tmp / name
        if not out.exists():
            with lzma.open(VOCAB_DIR / (name + ".xz")) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
        return out
    return get


@pytest.fixture(scope="session")
def tiny_model(model_factory) -> str:
    return model_factory("tiny")


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    """The tiny model's tokenizer."""
    from pyllama.runtime.engine import Engine  # noqa: PLC0415
    engine = Engine(tiny_model, n_threads=1)
    try:
        yield engine.tokenizer
    finally:
        engine.close()


@pytest.fixture(scope="module")
def rpc_peer():
    """One `python -m pyllama.rpc_server` for the module's tests."""
    from server_util import RPCServerProcess  # noqa: PLC0415
    p = RPCServerProcess()
    yield p
    assert p.stop() == 0


@pytest.fixture(scope="module")
def seeded_hermes_server(tiny_model, tmp_path_factory):
    """A server on the tiny model with a Hermes tool template, its sampling seeded (-s 3) for
    clients whose API has no seed: a constrained call then ends within a few hundred tokens."""
    from server_util import LONG_CONTEXT, ServerProcess  # noqa: PLC0415
    from tool_templates import FAMILY_TEMPLATES  # noqa: PLC0415
    path = tmp_path_factory.mktemp("tpl") / "hermes.jinja"
    path.write_text(FAMILY_TEMPLATES["hermes"])
    server = ServerProcess(tiny_model, "--chat-template-file", str(path), "-c", "2048", "-np", "2", "-s", "3",
                           *LONG_CONTEXT)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


# --- tiers -------------------------------------------------------------------------------------
FUZZ_MODULES = {"test_rpc_fuzz"}
# what a test (or a fixture it uses) does when it starts processes, servers or sockets
_INTEGRATION = re.compile(r"ServerProcess|RPCServerProcess|LlamaServer|subprocess|Popen|socket\.|HTTPServer\(|"
                          r"RPCServer\(|ServerThread|start_server\(|LinkShaper|os\.fork\(|serve_forever|rpc_peer|"
                          r"127\.0\.0\.1|fuzz_http\.main|fuzz_rpc\.main")
_source_cache: dict = {}


def _starts_processes(fn) -> bool:
    found = _source_cache.get(fn)
    if found is None:
        try:
            found = bool(_INTEGRATION.search(inspect.getsource(fn)))
        except (OSError, TypeError):
            found = False
        _source_cache[fn] = found
    return found


_helpers_cache: dict = {}


def _process_helpers(module) -> frozenset:
    """Names of the module's own functions (not tests) that start processes, servers or sockets."""
    found = _helpers_cache.get(module)
    if found is None:
        found = frozenset(name for name, obj in vars(module).items()
                          if inspect.isfunction(obj) and not name.startswith("test_")
                          and getattr(obj, "__module__", None) == module.__name__ and _starts_processes(obj))
        _helpers_cache[module] = found
    return found


# End-to-end tests that start nothing but run whole models or every vocabulary (seconds each), and
# modules whose servers run in-process behind helpers the source scan does not follow: module ->
# test names (None: every test of the module)
INTEGRATION_TESTS: dict[str, Optional[frozenset]] = {
    "test_quant_models": frozenset({"test_greedy_tokens_match_the_reference"}),
    "test_moe": frozenset({"test_greedy_tokens_match_the_reference"}),
    "test_dense_families": frozenset({"test_greedy_tokens_and_logits_match_the_reference"}),
    "test_tokenizer_pre": frozenset({"test_llamacpp_vocab_vectors", "test_ugm_matches_tokenizers_unigram"}),
    "test_make": frozenset({"test_vocab_is_copied"}),
    "test_constrained_vocabs": None,
    "test_notebook": None,
    "test_http": None,
    "test_rpc_faults": None,
}


def _tier(item) -> str:
    if item.module.__name__ in FUZZ_MODULES:
        return "fuzz"
    if item.module.__name__ in INTEGRATION_TESTS:
        names = INTEGRATION_TESTS[item.module.__name__]
        if names is None or item.originalname in names:
            return "integration"
    if _starts_processes(item.function):
        return "integration"
    helpers = _process_helpers(item.module)
    if helpers:
        try:
            source = inspect.getsource(item.function)
        except (OSError, TypeError):
            source = ""
        if any(re.search(rf"\b{re.escape(h)}\(", source) for h in helpers):
            return "integration"
    for defs in item._fixtureinfo.name2fixturedefs.values():
        if any(_starts_processes(d.func) for d in defs):
            return "integration"
    return "unit"


@pytest.hookimpl(tryfirst=True)  # before -m selects by them
def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(t) for t in ("unit", "integration", "fuzz")):
            item.add_marker(getattr(pytest.mark, _tier(item)))
