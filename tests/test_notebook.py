"""trace_tools/notebook.ipynb executed with nbclient, from a folder outside the repository, on a
real two-process trace (a server with one rpc server); and its message when no file matches."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from trace_run import traced_split

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "trace_tools" / "notebook.ipynb"

nbformat = pytest.importorskip("nbformat", reason="needs nbformat (pip install -e '.[notebook]')")
nbclient = pytest.importorskip("nbclient", reason="needs nbclient (pip install -e '.[notebook]')")
pytest.importorskip("matplotlib", reason="needs matplotlib (pip install -e '.[notebook]')")


def _kernel_or_skip() -> None:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        pytest.skip("no python3 Jupyter kernel (pip install ipykernel)")


def _run(copy: Path, traces: str) -> "nbformat.NotebookNode":
    """The notebook copied to `copy`, its first code cell pointed at `traces`, executed there."""
    nb = nbformat.read(str(NOTEBOOK), as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert "TRACES = " in first.source
    first.source = f"TRACES = {traces!r}\nSTEPS = None"
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(copy.parent)}})
    client.execute()
    nbformat.write(nb, str(copy))
    return nb


def test_notebook_runs_from_anywhere_on_a_real_trace(tiny_model: str, tmp_path: Path) -> None:
    _kernel_or_skip()
    files = traced_split(tiny_model, str(tmp_path / "run"), "RPC0,CPU", groups=1)
    assert len(files) == 2
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(NOTEBOOK, elsewhere / "notebook.ipynb")
    # the peer's file first in the glob's order: the notebook puts the server's first
    nb = _run(elsewhere / "notebook.ipynb", str(tmp_path / "run" / "*.jsonl"))
    outputs = {i: c.outputs for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    errors = [o for out in outputs.values() for o in out if o.get("output_type") == "error"]
    assert not errors, errors
    text = json.dumps([o for out in outputs.values() for o in out])
    assert "RPC0/CPU" in text and "no device busy" in text  # the summary printed
    assert "bottleneck: " in text  # the picture's title
    images = sum(1 for out in outputs.values() for o in out if "image/png" in o.get("data", {}))
    assert images >= 4  # timeline, step phases, idle split, device split
    paths = next(o for o in outputs[2] if o.get("output_type") == "execute_result")["data"]["text/plain"]
    assert paths.index("trace.jsonl") < paths.index("peer0.jsonl")
    assert not (ROOT / "trace_tools" / "notebook.ipynb").read_text().count('"output_type"')  # stays clean


def test_notebook_says_when_nothing_matches(tmp_path: Path) -> None:
    _kernel_or_skip()
    with pytest.raises(nbclient.exceptions.CellExecutionError) as err:
        _run(tmp_path / "nb.ipynb", str(tmp_path / "missing" / "*.jsonl"))
    assert "no trace file matches" in str(err.value) and "FileNotFoundError" in str(err.value)
    assert "TypeError" not in str(err.value)
    assert os.path.exists(NOTEBOOK)
