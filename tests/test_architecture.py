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
    ("base types", {"errors", "info", "progress", "arrays", "words", "threads"}),
    ("native core", {"_native"}),
    ("storage", {"store"}),
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


# Modules that still import each other in a circle, each group one strongly connected component. No new circle may
# form and none of these may grow; remove a group here once its circle is broken (fastckpt.sharded's was).
KNOWN_MODULE_CYCLES: list[set[str]] = []


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_edges() -> dict[str, set[str]]:
    """Module -> the modules of its own package it imports (inside functions too); a package's ``__init__`` (its
    re-exports) is not a node: ``from fastckpt.sharded import remote`` is an import of ``fastckpt.sharded.remote``."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        if path.name == "__init__.py":
            continue
        package = name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            else:
                continue
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target != name and target.rsplit(".", 1)[0] == package and modules[target].name != "__init__.py":
                    found.add(target)
        edges[name] = found
    return edges


def _components(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    out.append(group)
    return out


def test_no_import_cycle_between_modules_inside_a_package():
    new = [sorted(group) for group in _components(_module_edges())
           if not any(group <= known for known in KNOWN_MODULE_CYCLES)]
    assert not new, "modules that import each other in a circle (a module that uses two others sits above them): " \
                    + "; ".join(" <-> ".join(group) for group in new)


def test_the_module_cycle_check_sees_a_cycle():
    assert _components({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert _components({"a": {"b"}, "b": set()}) == []


# The one commit (docs/commit.md): no module but the storage floor renames, links or fsyncs a file. Benchmarks are
# outside: they time other libraries' writers and fsync the baselines' files as those libraries would.
_COMMIT_CALLS = {"rename", "renames", "replace", "link", "fsync", "fdatasync"}


def _commit_calls(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "os" \
                and node.func.attr in _COMMIT_CALLS:
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} os.{node.func.attr}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                alias.name in _COMMIT_CALLS for alias in node.names) and getattr(node, "module", None) == "os":
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} from os import ...")
    return found


def test_only_the_storage_floor_renames_or_fsyncs_files():
    wrong = [call for path in sorted(PACKAGE.rglob("*.py"))
             if path.relative_to(PACKAGE).parts[0] not in ("store", "bench")
             for call in _commit_calls(path)]
    assert not wrong, "rename and fsync through fastckpt.store.commit (docs/commit.md): " + ", ".join(wrong)


def test_the_commit_call_check_sees_a_rename(tmp_path):
    probe = PACKAGE / "store" / "commit.py"
    assert any("os.replace" in call for call in _commit_calls(probe))
