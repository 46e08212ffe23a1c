"""The process's settings (`pyllama/util/settings.py`): every PYLLAMA_* variable is read once, at
start-up, into typed records. A bad value is one line naming it and exit 1 from every program,
before anything loads; nothing else in the package reads the environment."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyllama.util import settings as S
from pyllama.util.errors import PyllamaError

PACKAGE = Path(S.__file__).resolve().parents[1]

# a good value of each variable and what it sets, then values it refuses
GOOD = {
    "PYLLAMA_CPU_NATIVE": ("off", ("cpu", "native", False)),
    "PYLLAMA_CPU_REPACK": ("0", ("cpu", "repack", False)),
    "PYLLAMA_CPU_BLAS_ONLY": ("yes", ("cpu", "blas_only", True)),
    "PYLLAMA_RPC_TIMEOUT": ("2.5", ("rpc", "timeout_s", 2.5)),
    "PYLLAMA_RPC_STAGING_BYTES": ("0x1000", ("rpc", "staging_bytes", 4096)),
    "PYLLAMA_RPC_NO_ASYNC_COPY": ("1", ("rpc", "async_copy", False)),
    "PYLLAMA_RPC_NO_BATCHED_GET": ("true", ("rpc", "batched_get", False)),
    "PYLLAMA_RPC_TOKEN": ("0123456789abcdef", ("rpc", "token", b"0123456789abcdef")),
    "PYLLAMA_RPC_SERVER_CAPS": ("0x5", ("rpc", "server_caps", 5)),
    "PYLLAMA_SPLIT_PROBE": ("on", ("split", "probe", True)),
    "PYLLAMA_SPLIT_CHECK_S": ("0", ("split", "check_s", 0.0)),
    "PYLLAMA_TRACE": ("/tmp/t.jsonl", ("obs", "trace", "/tmp/t.jsonl")),
    "PYLLAMA_PIPE_PROF": ("1", ("obs", "pipe_prof", True)),
    "PYLLAMA_PIPE_PROF_MS": ("200", ("obs", "pipe_prof_s", 0.2)),
    "PYLLAMA_RPC_STATS": ("1", ("obs", "rpc_stats", True)),
    "PYLLAMA_RPC_STATS_MS": ("100", ("obs", "rpc_stats_s", 0.1)),
    "PYLLAMA_CUDA_KERNELS": ("/k", ("cuda", "kernels", "/k")),
    "PYLLAMA_CUDA_WEIGHTS": ("BF16", ("cuda", "weights", "bf16")),
    "PYLLAMA_CUBLAS": ("/lib/libcublas.so", ("cuda", "cublas", "/lib/libcublas.so")),
}
BAD = {
    "PYLLAMA_CPU_NATIVE": ["maybe", "2"],
    "PYLLAMA_RPC_TIMEOUT": ["0", "-1", "inf", "soon"],
    "PYLLAMA_RPC_STAGING_BYTES": ["lots", "63"],
    "PYLLAMA_RPC_NO_ASYNC_COPY": ["x"],
    "PYLLAMA_RPC_SERVER_CAPS": ["all", "-1", "0x100000000"],
    "PYLLAMA_SPLIT_PROBE": ["probably"],
    "PYLLAMA_SPLIT_CHECK_S": ["-1", "nan", "soon"],
    "PYLLAMA_PIPE_PROF_MS": ["abc", "1.5", "0"],
    "PYLLAMA_RPC_STATS_MS": ["5s", "-3"],
    "PYLLAMA_CUDA_WEIGHTS": ["f32"],
}


def test_every_variable_is_listed_and_tested():
    listed = {v.name for v in S.VARIABLES if v.part is not None}
    assert listed == set(GOOD)


def test_an_empty_environment_gives_the_defaults():
    got = S.Settings.from_environ({})
    assert got.cpu == S.CpuSettings() and got.rpc == S.RpcSettings() and got.obs == S.ObsSettings()
    assert got.rpc.timeout_s == 120 and got.rpc.staging_bytes == 64 << 20 and got.split.check_s == 60
    # blank is unset
    assert S.Settings.from_environ({"PYLLAMA_CPU_NATIVE": " ", "PYLLAMA_RPC_TIMEOUT": ""}).cpu.native


@pytest.mark.parametrize("name", sorted(GOOD))
def test_each_variable_sets_its_field(name):
    raw, (part, field, value) = GOOD[name]
    got = S.Settings.from_environ({name: raw})
    assert getattr(getattr(got, part), field) == value
    default = S.Settings.from_environ({})
    others = [GOOD[n][1][:2] for n in GOOD if n != name]
    assert all(getattr(getattr(got, p), f) == getattr(getattr(default, p), f) for p, f in others)


@pytest.mark.parametrize("name,raw", [(n, r) for n, rs in sorted(BAD.items()) for r in rs])
def test_a_bad_value_is_one_error_naming_the_variable(name, raw):
    with pytest.raises(PyllamaError) as err:
        S.Settings.from_environ({name: raw})
    assert str(err.value).startswith(f"{name}={raw!r}: expected ")


def test_the_cache_folder():
    assert S.Settings.from_environ({"PYLLAMA_CACHE": "/c"}).cache_dir == "/c"
    assert S.Settings.from_environ({"XDG_CACHE_HOME": "/x"}).cache_dir == os.path.join("/x", "pyllama")
    assert S.Settings.from_environ({"CUDA_HOME": "/a", "CUDA_PATH": "/b"}).cuda.toolkit == ("/a", "/b")


def test_override_changes_fields_for_the_block_only():
    before = S.current()
    with S.override(cpu={"native": not before.cpu.native}, split={"check_s": 7.0}) as s:
        assert S.current() is s and s.cpu.native != before.cpu.native and s.split.check_s == 7.0
        assert s.rpc == before.rpc
    assert S.current() is before


def test_the_description_lists_every_variable_and_masks_the_token():
    text = S.describe(S.Settings.from_environ({"PYLLAMA_RPC_TOKEN": "0123456789abcdef",
                                               "PYLLAMA_RPC_NO_ASYNC_COPY": "1"}))
    assert all(v.name in text for v in S.VARIABLES)
    assert "0123456789abcdef" not in text and "(set)" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("PYLLAMA_RPC_NO_ASYNC_COPY"))
    assert line.split()[1] == "True"  # as the variable says it, not the field it sets


def _environment_reads(path: Path) -> list[int]:
    """Lines of `path` that read os.environ / os.getenv (writing a variable is not a read)."""
    tree = ast.parse(path.read_text(), str(path))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") \
                and isinstance(node.value, ast.Name) and node.value.id in ("os", "_os"):
            parent_is_setdefault = False
            for p in ast.walk(tree):
                if isinstance(p, ast.Attribute) and p.value is node and p.attr == "setdefault":
                    parent_is_setdefault = True
            if not parent_is_setdefault:
                lines.append(node.lineno)
    return sorted(lines)


# the command line's own variables (PYLLAMA_ARG_*, LLAMA_ARG_*) and the llama-server variables it
# refuses are read with the command line; the CUDA build step runs before the package exists
READERS = {"util/settings.py", "util/cli.py", "server/options.py", "backend/cuda/build.py"}


def test_nothing_else_reads_the_environment():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in READERS:
            continue
        lines = _environment_reads(path)
        if lines:
            found[rel] = lines
    assert not found, f"read the environment through pyllama.util.settings: {found}"


def test_the_reader_check_sees_a_read(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import os\nx = os.environ.get('A')\nos.environ.setdefault('B', '1')\ny = os.getenv('C')\n")
    assert _environment_reads(p) == [2, 4]


@pytest.mark.parametrize("module,env", [
    ("pyllama.server", {"PYLLAMA_PIPE_PROF": "1", "PYLLAMA_PIPE_PROF_MS": "abc"}),
    ("pyllama.server", {"PYLLAMA_RPC_STATS": "1", "PYLLAMA_RPC_STATS_MS": "5s"}),
    ("pyllama.server", {"PYLLAMA_CPU_NATIVE": "maybe"}),
    ("pyllama.rpc_server", {"PYLLAMA_RPC_STATS": "1", "PYLLAMA_RPC_STATS_MS": "-3"}),
    ("pyllama.rpc_server", {"PYLLAMA_RPC_SERVER_CAPS": "all"}),
    ("pyllama.generate", {"PYLLAMA_RPC_STATS": "1", "PYLLAMA_RPC_STATS_MS": "x"}),
    ("pyllama.generate", {"PYLLAMA_CUDA_WEIGHTS": "f32"}),
], ids=["server-pipe-prof", "server-rpc-stats", "server-cpu", "rpc-server", "rpc-server-caps", "generate",
        "generate-cuda"])
def test_a_bad_value_stops_each_program_at_start_up(tiny_model, module, env):
    """One line naming the variable and exit 1, never a traceback (at import, or in a printer
    thread on the first RPC)."""
    args = {"pyllama.server": ["-m", tiny_model, "--port", "0"], "pyllama.rpc_server": ["--port", "0"],
            "pyllama.generate": ["-m", tiny_model, "-p", "hi", "-n", "1"]}[module]
    r = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **env}, stdin=subprocess.DEVNULL)
    name = [k for k in env if k.endswith("_MS")] or list(env)
    assert r.returncode == 1, (r.returncode, r.stderr[-500:])
    assert "Traceback" not in r.stderr, r.stderr[-500:]
    assert f"error: {name[0]}={env[name[0]]!r}: expected" in r.stderr, r.stderr[-500:]


def test_the_settings_program_prints_them():
    r = subprocess.run([sys.executable, "-m", "pyllama.util.settings"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYLLAMA_SPLIT_CHECK_S": "9"})
    assert r.returncode == 0 and "PYLLAMA_SPLIT_CHECK_S" in r.stdout
    assert next(ln for ln in r.stdout.splitlines() if ln.startswith("PYLLAMA_SPLIT_CHECK_S")).split()[1] == "9.0"
    r = subprocess.run([sys.executable, "-m", "pyllama.util.settings"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYLLAMA_SPLIT_CHECK_S": "x"})
    assert r.returncode == 1 and r.stderr.startswith("error: PYLLAMA_SPLIT_CHECK_S='x'")
