"""The modules of fastckpt.nn import one another one way only: no circle, not even through a deferred import."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import fastckpt.nn

PACKAGE = "fastckpt.nn"
SUBMODULES = sorted(info.name for info in pkgutil.iter_modules(fastckpt.nn.__path__))


def _source(name: str) -> Path:
    return Path(fastckpt.nn.__path__[0]) / ("__init__.py" if name == "__init__" else f"{name}.py")


def _imports(name: str) -> set[str]:
    """The fastckpt.nn modules that ``name`` imports anywhere in its source, functions included.

    ``"__init__"`` stands for the package itself: importing a name from ``fastckpt.nn`` (not a submodule) runs the
    package's ``__init__``, which imports every layer.
    """
    found = set()
    for node in ast.walk(ast.parse(_source(name).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [f"{node.module}.{alias.name}" if node.module == PACKAGE and alias.name in SUBMODULES
                       else node.module for alias in node.names]
        elif isinstance(node, ast.ImportFrom):  # relative: from . import x, from .x import y
            base = node.module.split(".")[0] if node.module else None
            targets = [f"{PACKAGE}.{base}" if base else
                       (f"{PACKAGE}.{a.name}" if a.name in SUBMODULES else PACKAGE) for a in node.names]
        else:
            continue
        for target in targets:
            if target == PACKAGE:
                found.add("__init__")
            elif target.startswith(PACKAGE + "."):
                found.add(target[len(PACKAGE) + 1:].split(".")[0])
    found.discard(name)
    return found


def _cycle() -> list[str] | None:
    """One import circle among the package and its submodules, as a path that ends where it starts; or None."""
    graph = {name: sorted(_imports(name)) for name in ["__init__", *SUBMODULES]}
    done: set[str] = set()

    def visit(path: list[str]) -> list[str] | None:
        for nxt in graph.get(path[-1], ()):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done:
                found = visit(path + [nxt])
                if found:
                    return found
        done.add(path[-1])
        return None

    for start in graph:
        found = None if start in done else visit([start])
        if found:
            return found
    return None


def test_the_submodules_are_found():
    assert {"_common", "factory", "kernels", "layers", "module"} <= set(SUBMODULES)


def test_module_does_not_import_layers():
    assert "layers" not in _imports("module")
    assert _imports("_common") == set(), "_common is the floor: it imports nothing else of fastckpt.nn"
    assert "module" in _imports("layers")


def test_no_import_circle_in_fastckpt_nn():
    cycle = _cycle()
    assert cycle is None, "import circle in fastckpt.nn: " + " -> ".join(cycle)


@pytest.mark.parametrize("name", SUBMODULES)
def test_each_submodule_imports_first_in_a_fresh_process(name):
    code = f"import {PACKAGE}.{name}, {PACKAGE}; assert {PACKAGE}.Sequential is not None"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
