"""The package is typed for its users: ``py.typed`` and a ``.pyi`` stub beside each compiled module ship with it, and
mypy sees the public API's real types (tests/typed/usage.py) rather than ``Any``."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import shutil
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


# -- the calls of the README and docs/, checked as a user's project would check them -----------------------------------

_BLOCK = re.compile(r"(?:^<!--[ \t]*fragment:[ \t]*(?P<why>[^\n]*?)[ \t]*-->\n)?^```python\n(?P<code>.*?)^```",
                    re.S | re.M)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.fixture(scope="module")
def user_project(tmp_path_factory) -> tuple[Path, dict[str, list[str]]]:
    """A user's project in a directory of its own, type-checked by one mypy run (one cache stays warm): the typed usage
    file, every page's python blocks (README, docs/), and the small files of the tests below. Returns the directory and
    mypy's output lines per file."""
    pytest.importorskip("mypy")
    project = tmp_path_factory.mktemp("user_project")
    files = {"usage.py": USAGE.read_text(encoding="utf-8")}
    for page in _pages():
        blocks = [m.group("code") for m in _BLOCK.finditer(page.read_text(encoding="utf-8")) if m.group("why") is None]
        if blocks:  # a page's blocks run as one script that reuses names (w, state, ...): --allow-redefinition-new
            files["page_" + re.sub(r"\W", "_", page.relative_to(ROOT).with_suffix("").as_posix()) + ".py"] = "\n".join(blocks)
    files.update(SNIPPETS)
    if importlib.util.find_spec("torch") is None:
        del files["torch_use.py"]
    for name, text in files.items():
        (project / name).write_text(text, encoding="utf-8")
    # Every file --strict; the usage file and the untyped-call check also with --disallow-any-expr.
    (project / "mypy.ini").write_text("[mypy]\nstrict = True\nallow_redefinition_new = True\nlocal_partial_types = True\n"
                                      "follow_imports = silent\n[mypy-usage,untyped_call]\ndisallow_any_expr = True\n",
                                      encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}  # the fastckpt under test, as this process imports it
    result = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", "--cache-dir",
                             str(ROOT / ".mypy_cache"), *sorted(files)], cwd=project, capture_output=True, text=True,
                            timeout=900, env=env)
    assert result.returncode in (0, 1), result.stderr
    lines: dict[str, list[str]] = {name: [] for name in files}
    for line in result.stdout.splitlines():
        lines.setdefault(line.split(":", 1)[0], []).append(line)
    return project, lines


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


def test_mypy_sees_the_public_api_without_any(user_project):
    leaks = _any_leaks("\n".join(user_project[1]["usage.py"]))
    assert not leaks, "mypy over tests/typed/usage.py:\n" + "\n".join(leaks)


def test_the_check_fails_on_an_untyped_call(user_project):
    # The same check over a call whose result is Any: it must report it (the test above can fail).
    leaks = _any_leaks("\n".join(user_project[1]["untyped_call.py"]))
    assert any('Expression is of type "Any", not "int"' in leak for leak in leaks), user_project[1]["untyped_call.py"]


SNIPPETS = {
    "untyped_call.py": "import json\nfrom typing import assert_type\nassert_type(json.loads('1'), int)\n",
    # load_file(pool=3) passed mypy (pool was untyped); a reader's missing method must be an error too.
    "wrong.py": "import fastckpt\n"
                "fastckpt.load_file('m.safetensors', pool=3)\n"
                "with fastckpt.open('m.safetensors') as f:\n"
                "    f.hostss()\n",
    "torch_use.py": "from typing import assert_type\n"
                    "import numpy as np\n"
                    "import torch\n"
                    "import fastckpt\n"
                    "assert_type(fastckpt.to_torch(np.zeros(2, np.float32)), torch.Tensor)\n"
                    "assert_type(fastckpt.to_torch({'w': np.zeros(2, np.float32)}), dict[str, torch.Tensor])\n",
}


def test_every_call_in_the_readme_and_docs_type_checks_under_strict_in_a_separate_directory(user_project):
    # Each page's python blocks, in order, are one module of a user's project, checked with --strict. f.hosts(),
    # len(f), load_model(...).load_report and stateful.Checkpoint() failed --strict here, and save_npz(progress=
    # callback) failed pyright.
    pages = {name: lines for name, lines in user_project[1].items() if name.startswith("page_")}
    assert "page_README.py" in pages and len(pages) >= 10
    assert not [line for lines in pages.values() for line in lines], "\n".join(sum(pages.values(), []))


def test_calls_outside_the_types_fail_type_checking(user_project):
    errors = [line for line in user_project[1]["wrong.py"] if ": error:" in line]
    assert [line.split(":")[1] for line in errors] == ["2", "4"], errors
    assert 'Argument "pool" to "load_file" has incompatible type "int"' in errors[0]
    assert 'has no attribute "hostss"' in errors[1]


def test_to_torch_is_typed(user_project):
    pytest.importorskip("torch")
    assert user_project[1]["torch_use.py"] == []


def test_the_editable_install_is_one_type_checkers_follow():
    # setuptools' default editable install adds an import hook, which mypy and pyright never run: after the README's
    # `pip install -e .` neither found fastckpt in a user's project. "compat" writes the checkout's path to a .pth file.
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert config["tool"]["distutils"]["editable_wheel"] == {"mode": "compat"}


@pytest.mark.slow
def test_after_the_readme_install_mypy_and_pyright_resolve_fastckpt_in_a_user_project(tmp_path):
    # The README's `pip install -e .` (its build requirements fetched as pip does; the run-time dependencies seen from
    # the base environment: --system-site-packages, --no-deps), then mypy --strict and pyright, when installed, from
    # another directory.
    pytest.importorskip("mypy")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "-e", str(ROOT)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout + install.stderr
    project = tmp_path / "project"
    project.mkdir()
    (project / "use.py").write_text("import fastckpt\nfrom typing import assert_type\n"
                                    "with fastckpt.open('m.safetensors') as f:\n"
                                    "    assert_type(len(f), int)\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([str(python), "-m", "mypy", "--strict", "--no-error-summary", "use.py"], cwd=project,
                            capture_output=True, text=True, timeout=600, env=env)
    assert (result.returncode, result.stdout) == (0, ""), result.stdout + result.stderr
    pyright = shutil.which("pyright")
    if pyright:
        result = subprocess.run([pyright, "--pythonpath", str(python), "use.py"], cwd=project, capture_output=True,
                                text=True, timeout=600, env=env)
        assert result.returncode == 0 and "0 errors" in result.stdout, result.stdout + result.stderr
