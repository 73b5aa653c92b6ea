"""Every example in the docstrings of the fastckpt package runs and gives what it shows.

The modules are found by walking the package (compiled Cython modules included: their docstrings hold examples
too), so a module that is added, moved or renamed needs no list here. A module with no example at all fails,
unless NO_EXAMPLES names it, so that a new module without examples is noticed.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import importlib.metadata
import importlib.util
import pkgutil
import re
import tempfile
from pathlib import Path

import pytest

import fastckpt

# The modules that legitimately have no example, with the reason. Keep it short: an example is the cheapest test.
# (``__main__`` modules need no entry: they are never imported, see test_docstring_examples.)
NO_EXAMPLES = {
    "fastckpt.cli.demo": "the `fastckpt demo` command: itself a worked example, printed with timings",
    "fastckpt.formats.tf.format": "the byte-level format specification (the docs page): prose, no code",
}


def _modules() -> list[str]:
    # walk_packages imports each sub-package to look inside it; one that fails to import is still listed (its own
    # test case then reports why), so the error is only swallowed here, not lost.
    walked = pkgutil.walk_packages(fastckpt.__path__, "fastckpt.", onerror=lambda name: None)
    return ["fastckpt", *sorted(info.name for info in walked)]


MODULES = _modules()
# The benchmark modules' examples run (small) benchmarks: smoke runs, in the slow set with the suites' own tests.
CASES = [pytest.param(name, marks=pytest.mark.slow) if name.startswith("fastckpt.bench.") else name for name in MODULES]


def _required_imports() -> set[str]:
    """Top-level import names of fastckpt's required dependencies (optional extras left out)."""
    names = set()
    for requirement in importlib.metadata.requires("fastckpt") or ():
        if "extra ==" not in requirement:
            names.add(re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower().replace("-", "_"))
    return names


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        # Skip (with the reason) only where an optional package is missing: tensorflow, torch, ... A missing part of
        # fastckpt or a missing required dependency is a real failure.
        missing = (exc.name or "").partition(".")[0]
        if missing and missing != "fastckpt" and missing.lower() not in _required_imports():
            pytest.skip(f"{name} needs the optional package {exc.name!r}, which is not installed")
        raise


def _examples_in_source(name: str) -> int:
    """Examples in every docstring of a module's source, read without importing it."""
    tree = ast.parse(Path(importlib.util.find_spec(name).origin).read_text(encoding="utf-8"))
    parser = doctest.DocTestParser()
    return sum(len(parser.get_examples(ast.get_docstring(node) or ""))
               for node in ast.walk(tree)
               if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))


@pytest.mark.parametrize("name", CASES)
def test_docstring_examples(name, tmp_path, monkeypatch):
    if name.rpartition(".")[2] == "__main__":
        # Importing a __main__ module runs the command line and exits, so its examples could never run here.
        assert _examples_in_source(name) == 0, f"{name}: examples there cannot run; put them where the code is"
        return
    # The examples' temporary files and relative paths stay inside this test's tmp_path.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    monkeypatch.chdir(tmp_path)
    module = _import(name)
    # Counted apart from testmod, which does not count examples marked +SKIP (device-only ones, for one).
    found = sum(len(test.examples) for test in doctest.DocTestFinder().find(module))
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed (details above)"
    if name in NO_EXAMPLES:
        assert found == 0, f"{name} has examples now: remove it from NO_EXAMPLES in {__file__}"
    else:
        assert found > 0, (f"{name} has no docstring example: add one, or name it with the reason in NO_EXAMPLES "
                           f"in {__file__}")


def test_no_examples_names_only_existing_modules():
    # A module moved or removed must not leave an exemption behind for a name nothing has any more.
    stale = sorted(set(NO_EXAMPLES) - set(MODULES))
    assert not stale, f"NO_EXAMPLES in {__file__} names modules that no longer exist: {stale}"
