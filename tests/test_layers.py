"""pyllama's packages import only downwards (docs/engine.md, "The map").

Layers, top to bottom: the programs (server, rpc_server, generate), batching, runtime, tokenizer,
models, backend, then the wire (rpc) and the shared vocabulary (ir) at the bottom; obs, util and
the compiled kernels (_fast) may be imported from any layer. A module may import its own package
and anything in a lower layer; the programs never import one another. Imports under
`if TYPE_CHECKING:` are read too: a layer that names an upper one's types depends on it.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyllama")

# top-level package (or module) -> layer; a larger number is higher
LAYERS = {
    "ir": 1, "rpc": 1,
    "backend": 2,
    "models": 3,
    "tokenizer": 4,
    "runtime": 5,
    "batching": 6,
    "server": 7, "rpc_server": 7, "generate": 7,
}
ANYWHERE = {"obs", "util", "_fast", ""}  # "": the package itself (its version)


def _modules(root: str) -> dict[str, str]:
    out = {}
    for dp, _, fns in os.walk(root):
        for f in fns:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dp, f), os.path.dirname(root))[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dp, f)
    return out


def _imports(root: str, module: str, path: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every pyllama import in a file."""
    tree = ast.parse(open(path).read(), path)
    pkg = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = pkg.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                target = ".".join(parts + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "pyllama":  # the package's own names (its version), or `from pyllama import util`
                found += [(node.lineno, f"pyllama.{a.name}" if os.path.exists(os.path.join(root, a.name)) else target)
                          for a in node.names]
            elif target.startswith("pyllama."):
                found.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("pyllama")]
    return found


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(root: str = ROOT) -> list[str]:
    bad = []
    for module, path in sorted(_modules(root).items()):
        own = _top(module)
        for line, target in _imports(root, module, path):
            other = _top(target)
            if other == own or other in ANYWHERE:
                continue
            if own in ANYWHERE:
                bad.append(f"{path}:{line}: {module} ({own}, imported from any layer) imports {target}")
            elif other not in LAYERS or own not in LAYERS:
                bad.append(f"{path}:{line}: {module} imports {target}: a package outside the map (add it to LAYERS)")
            elif LAYERS[other] >= LAYERS[own]:
                bad.append(f"{path}:{line}: {module} ({own}, layer {LAYERS[own]}) imports {target} "
                           f"({other}, layer {LAYERS[other]})")
    return bad


def test_every_import_goes_down():
    bad = upward_imports()
    assert not bad, "imports that do not go down:\n" + "\n".join(bad)


def test_every_package_is_on_the_map():
    tops = {_top(m) for m in _modules(ROOT)}
    assert tops <= set(LAYERS) | ANYWHERE, tops - set(LAYERS) - ANYWHERE


def test_the_check_sees_an_upward_import(tmp_path):
    """The check is not blind: a runtime module importing the server is reported."""
    pkg = tmp_path / "pyllama"
    (pkg / "runtime").mkdir(parents=True)
    (pkg / "server").mkdir()
    for init in (pkg / "__init__.py", pkg / "runtime" / "__init__.py", pkg / "server" / "__init__.py"):
        init.write_text("")
    (pkg / "server" / "http.py").write_text("X = 1\n")
    (pkg / "runtime" / "engine.py").write_text("from ..server.http import X\nfrom ..util import errors\n")
    bad = upward_imports(str(pkg))
    assert len(bad) == 1 and "pyllama.runtime.engine (runtime, layer 5) imports pyllama.server.http" in bad[0], bad
