"""fox-models' imports: every submodule imports on its own in a fresh process, the package's modules import
each other without a circle (imports inside functions included), and the lower packages are reached only
through the names their ``__init__`` exports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import fox_kernel
import fox_layers

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "fox_models"
LOWER = {"fox_kernel": fox_kernel, "fox_layers": fox_layers}


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of fox_models (a package by its ``__init__.py``)."""
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str):
    """(imported module, imported names or None, line) of every import statement of the module, wherever
    it stands (module level, functions, classes), relative imports resolved."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    package = name if _is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            yield base, [a.name for a in node.names], node.lineno


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _edges(name: str) -> set[str]:
    """The fox_models modules that importing ``name`` runs: each imported module (a name imported from a
    package that is one of its submodules counts as that submodule) and the packages above it. The packages
    above ``name`` itself are left out: they are already being imported when ``name`` runs."""
    own = set(_ancestors(name))
    targets = set()
    for module, names, _ in _imports(name):
        if module != PACKAGE and not module.startswith(PACKAGE + "."):
            continue
        hits = [f"{module}.{n}" for n in names or () if f"{module}.{n}" in MODULES]
        targets.update(hits or [module])
    out = set()
    for t in targets:
        out.update(m for m in [*_ancestors(t), t] if m in MODULES and m not in own and m != name)
    return out


def test_module_list():
    assert {"fox_models", "fox_models.base", "fox_models.registry", "fox_models.hub",
            "fox_models.fox.modeling"} <= set(MODULES)


def test_no_import_circle():
    """No fox_models module imports (at module level or inside a function) a module that imports it back,
    directly or through others."""
    graph = {m: _edges(m) for m in MODULES}
    state: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                circles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_circle_detection_sees_function_level_imports():
    """The graph counts an import inside a function (a circle closed that way is still a circle)."""
    assert "fox_models.samba.selective_scan_triton" in _edges("fox_models.samba.selective_scan")
    assert "fox_models.hub" in _edges("fox_models.base")
    assert "fox_models.base" not in _edges("fox_models.hub")


def test_lower_packages_only_through_their_exports():
    """Every name fox_models takes from fox_kernel or fox_layers is in that package's ``__all__``: no import
    of a submodule (``fox_kernel.ops.checks``, ``fox_layers.kernels``...), no private name, no attribute
    reached through the package that it does not export."""
    bad = []
    for name, path in MODULES.items():
        for module, names, line in _imports(name):
            root = module.split(".")[0]
            if root not in LOWER:
                continue
            exported = set(LOWER[root].__all__)
            if module != root:
                bad.append(f"{path.relative_to(SRC)}:{line}: imports the submodule {module}")
            elif names is not None:
                bad += [f"{path.relative_to(SRC)}:{line}: {root}.{n} is not exported" for n in names if n not in exported]
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in LOWER
                    and node.attr not in LOWER[node.value.id].__all__):
                bad.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.value.id}.{node.attr} is not exported")
    assert not bad, "\n".join(bad)


_IMPORT_EACH = r"""
import importlib, json, os, sys, traceback

def fork(run):
    pid = os.fork()
    if pid == 0:
        try:
            run()
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    return pid

# the third-party modules that importing fox_models loads (listed by a child), loaded here, so that each
# child below imports only fox code; no fox package is imported in this process
r, w = os.pipe()
pid = fork(lambda: (importlib.import_module("fox_models"), os.write(w, json.dumps(
    [m for m in list(sys.modules) if not m.startswith(("fox_", "__main__"))]).encode())))
os.close(w)
listed = b""
while chunk := os.read(r, 1 << 16):
    listed += chunk
assert os.waitpid(pid, 0)[1] == 0, "import fox_models failed"
for m in json.loads(listed):
    try:
        importlib.import_module(m)
    except Exception:
        pass
assert not any(m.startswith(("fox_models", "fox_layers", "fox_kernel")) for m in sys.modules)
failed = [name for name in sys.argv[1:] if os.waitpid(fork(lambda: importlib.import_module(name)), 0)[1]]
print("FAILED", *failed)
sys.exit(1 if failed else 0)
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_each_module_imports_alone():
    """Each submodule, imported first in a process where no fox package was imported yet: one fork per
    module of an interpreter that has loaded only the third-party modules fox_models needs (importing
    transformers' models takes most of a fresh interpreter's start)."""
    modules = sorted(MODULES)
    run = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *modules], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
