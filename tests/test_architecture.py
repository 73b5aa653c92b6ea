"""The floors of the package (docs/architecture.md): every import points down, or sideways within a package.

A floor may import the floors below it and its own package; never a floor above, never a sibling package
on its own floor. Imports inside functions count too (they are dependencies all the same). The top-level
``fastckpt/__init__.py`` and the thin re-export modules kept for documented paths sit above every floor.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fastckpt"

FLOORS = [
    ("base types", {"errors", "info", "progress", "arrays"}),
    ("native core", {"_native"}),
    ("formats and state", {"formats", "state"}),
    ("device", {"device"}),
    ("faces", {"nn", "stateful", "tf"}),
    ("faces built on faces", {"io", "train", "sharded"}),
    ("benchmarks", {"bench"}),
    ("commands", {"cli"}),
]
FLOOR_OF = {package: level for level, (_, packages) in enumerate(FLOORS) for package in packages}
# Thin re-exports of documented import paths, and the package's own entry points: above every floor.
TOP = {"__init__", "__main__", "pool", "load", "tensor", "convert"}


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "fastckpt":
                found += [(node.lineno, f"fastckpt.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name.startswith("fastckpt.")]


def _top(name: str) -> str:
    return name.split(".")[1]


def test_every_package_is_on_a_floor():
    packages = {p.name.removesuffix(".py") for p in PACKAGE.iterdir()
                if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    assert packages - TOP == set(FLOOR_OF), "a new top-level module or package needs a floor here and in the docs"


def test_imports_point_down_or_stay_in_their_package():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if own in TOP:
            continue
        for line, name in _imports(path):
            other = _top(name)
            if other == "__version__" or other == own:
                continue
            if other in TOP:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}: use the module it re-exports")
            elif FLOOR_OF[other] >= FLOOR_OF[own]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name} "
                             f"({FLOORS[FLOOR_OF[other]][0]}) from {FLOORS[FLOOR_OF[own]][0]}")
    assert not wrong, "\n".join(wrong)


def test_the_native_modules_import_only_each_other_and_the_base_types():
    for path in sorted((PACKAGE / "_native").glob("*.p[yx][xd]")):
        for module in re.findall(r"^\s*(?:from|cimport|import)\s+(fastckpt[\w.]*)", path.read_text(), re.M):
            assert module.startswith("fastckpt._native.") or module in ("fastckpt.errors", "fastckpt.info"), f"{path.name} uses {module}"


def test_no_import_cycle_between_packages():
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        own = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if own not in TOP:
            edges.setdefault(own, set()).update(_top(n) for _, n in _imports(path) if _top(n) not in TOP | {own})
    done: set[str] = set()

    def visit(node: str, trail: tuple[str, ...]) -> None:
        assert node not in trail, f"import cycle: {' -> '.join(trail + (node,))}"
        if node not in done:
            for nxt in edges.get(node, ()):
                visit(nxt, trail + (node,))
            done.add(node)

    for package in edges:
        visit(package, ())
