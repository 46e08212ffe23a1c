"""The diagnostics' numeric variables (PYLLAMA_PIPE_PROF_MS, PYLLAMA_RPC_STATS_MS) are checked as a
program starts: a bad value is one line naming it and exit 1, never a traceback (at import, or in
a printer thread on the first RPC)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("module,env", [
    ("pyllama.server", {"PYLLAMA_PIPE_PROF": "1", "PYLLAMA_PIPE_PROF_MS": "abc"}),
    ("pyllama.server", {"PYLLAMA_RPC_STATS": "1", "PYLLAMA_RPC_STATS_MS": "5s"}),
    ("pyllama.rpc_server", {"PYLLAMA_RPC_STATS": "1", "PYLLAMA_RPC_STATS_MS": "-3"}),
    ("pyllama.generate", {"PYLLAMA_RPC_STATS": "1", "PYLLAMA_RPC_STATS_MS": "x"}),
], ids=["server-pipe-prof", "server-rpc-stats", "rpc-server", "generate"])
def test_a_bad_period_is_one_line(tiny_model, module, env):
    args = {"pyllama.server": ["-m", tiny_model, "--port", "0"], "pyllama.rpc_server": ["--port", "0"],
            "pyllama.generate": ["-m", tiny_model, "-p", "hi", "-n", "1"]}[module]
    r = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **env}, stdin=subprocess.DEVNULL)
    (name,) = [k for k in env if k.endswith("_MS")]
    assert r.returncode == 1, (r.returncode, r.stderr[-500:])
    assert "Traceback" not in r.stderr and name in r.stderr, r.stderr[-500:]
