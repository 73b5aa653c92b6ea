"""The package is typed for its users: ``py.typed`` and a ``.pyi`` stub beside each compiled module ship with it, and
mypy sees the public API's real types (tests/typed/usage.py) rather than ``Any``."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import fastckpt

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(fastckpt.__file__).parent
USAGE = Path(__file__).parent / "typed" / "usage.py"

# numpy's own arrays are generic in shape and dtype, written with Any (ndarray[tuple[Any, ...], dtype[Any]]): the
# one Any a signature of ours may show, as every numpy user sees it.
_NUMPY_ARRAY = re.compile(r"ndarray\[tuple\[[^\[\]]*\], dtype\[Any\]\]")


def _mypy(*args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("mypy")
    return subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def _any_leaks(mypy_output: str) -> list[str]:
    leaks = []
    for line in mypy_output.splitlines():
        found = re.search(r'Expression type contains "Any" \(has type "(.*)"\)', line)
        if found and "Any" not in _NUMPY_ARRAY.sub("ndarray", found.group(1)):
            continue
        leaks.append(line)
    return leaks


def test_py_typed_and_a_stub_for_every_compiled_module_ship():
    assert (PACKAGE / "py.typed").is_file()
    compiled = sorted(p.stem for p in (PACKAGE / "_native").glob("*.pyx"))
    stubs = sorted(p.stem for p in (PACKAGE / "_native").glob("*.pyi"))
    assert compiled == stubs
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["fastckpt"] and "*.pyi" in package_data["fastckpt._native"]


@pytest.mark.parametrize("package", ["fastckpt", "fastckpt.train"])
def test_type_checkers_see_every_lazy_name(package):
    # A lazy name (PEP 562 __getattr__) is Any to a type checker unless the TYPE_CHECKING block imports it too.
    module = importlib.import_module(package)
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    seen = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                for alias in imp.names:
                    assert alias.asname == alias.name, f"{package}: `{alias.name} as {alias.name}` re-exports it"
                    seen[alias.name] = imp.module
    assert seen == module._LAZY


def test_mypy_sees_the_public_api_without_any():
    result = _mypy("--strict", "--disallow-any-expr", "--follow-imports=silent", str(USAGE))
    assert result.returncode in (0, 1), result.stderr
    leaks = _any_leaks(result.stdout)
    assert not leaks, "mypy over tests/typed/usage.py:\n" + "\n".join(leaks)


def test_the_check_fails_on_an_untyped_call(tmp_path):
    # The same check over a call whose result is Any: it must report it (the test above can fail).
    bad = tmp_path / "bad.py"
    bad.write_text("import json\nfrom typing import assert_type\nassert_type(json.loads('1'), int)\n")
    result = _mypy("--strict", "--disallow-any-expr", "--follow-imports=silent", str(bad))
    leaks = _any_leaks(result.stdout)
    assert any('Expression is of type "Any", not "int"' in leak for leak in leaks), result.stdout
