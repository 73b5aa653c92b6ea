"""Every Python block in ``docs/`` runs as written, tested the way the README's blocks are (tests/test_readme.py).

For each page, its ```python blocks run in order, in one namespace, in a fresh scratch directory. A block that is
only a fragment (it uses names that only the prose defines) says so on the line just before it, with
``<!-- fragment: why -->``; it is skipped, and the fragments are few (``test_fragments_are_few`` lists them).
Output shown in a comment (``print(seen)   # 50``) is checked below, so that it stays true.

docs/which-call.md maps tasks to calls: every ``fastckpt.…`` name on it must exist and every command must run.
"""

from __future__ import annotations

import importlib
import re
import sys
import types
import warnings
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))

# A python block, with the fragment comment on the line directly before it when there is one.
BLOCK = re.compile(r"(?:^<!--[ \t]*fragment:[ \t]*(?P<why>[^\n]*?)[ \t]*-->\n)?^```python\n(?P<code>.*?)^```",
                   re.S | re.M)

# A page whose blocks use these needs the OpenCL device (pocl in CI): it gets the `device` marker.
USES_DEVICE = re.compile(r"\bfastckpt\.(device|nn)\b|\bload_file\b|\bload_model\b")

MAX_FRAGMENTS = 3

# Lines the blocks print, as their comments show them: each must be a whole line of the page's output.
EXPECTED_OUTPUT = {
    "checkpointable.md": ["['conv1/weight', 'conv1/bias', 'fc/[0]/weight', 'fc/[0]/bias']", "run/ckpt-3",
                          "[6. 9.] 0 0"],
    "device.md": ["2 1"],
    "model-files.md": ["(32, 10)", "ndarray (784, 256) 1000"],
    "remote.md": ["safetensors ['bias'] {'step': '100'}", "[8.0, 9.0, 10.0, 11.0]",
                  "[20, 30] memory://docs/run-b/step-00000030", "[0, 1, 2, 3, 4, 5]", "[30, 50] False"],
    "reading.md": ["safetensors 1 {'step': '100'}", "hf-sharded 2"],
    "stateful.md": ["50", "2", "True"],
    "training-checkpoints.md": ["[500, 800, 900, 1000]", "True"],
    "formats/sharded.md": ["1000 16.0", "delta"],
}

# Lines that differ on a second run in the same directory, as the page's comments say (TensorFlow's save() numbers on).
SECOND_RUN_OUTPUT = {"checkpointable.md": {"run/ckpt-3": "run/ckpt-6"}}


def python_blocks(text: str) -> list[tuple[str, str | None]]:
    """``(code, why)`` for each ```python block, in order; ``why`` is the fragment's reason, or None."""
    return [(m.group("code"), m.group("why")) for m in BLOCK.finditer(text)]


def page_blocks(page: str) -> list[tuple[str, str | None]]:
    return python_blocks((DOCS / page).read_text(encoding="utf-8"))


def test_the_block_pattern_finds_every_block_and_every_fragment_mark():
    for page in PAGES:
        text = (DOCS / page).read_text(encoding="utf-8")
        blocks = python_blocks(text)
        assert len(blocks) == text.count("```python"), page
        marks = len(re.findall(r"<!--\s*fragment:", text))
        assert marks == sum(why is not None for _, why in blocks), f"docs/{page}: a fragment mark not just before a block"
    assert python_blocks("<!-- fragment: uses x -->\n```python\nx\n```\n\n```python\ny = 1\n```\n") == [
        ("x\n", "uses x"), ("y = 1\n", None)]


def test_fragments_are_few():
    found = [f"docs/{page} python block {i}: {why}"
             for page in PAGES for i, (_, why) in enumerate(page_blocks(page)) if why is not None]
    assert len(found) <= MAX_FRAGMENTS, "too many fragments in docs/; make these run instead:\n" + "\n".join(found)


def fresh_process(monkeypatch) -> None:
    """What a new process starts with: fsspec's ``memory://`` empty (docs/remote.md saves there) and the registries
    that pages add to (a layer type, a stateful migration) as the library has them; the pages write into copies."""
    import fastckpt.nn.factory as factory
    import fastckpt.stateful.format as stateful_format

    monkeypatch.setattr(factory, "_registry", dict(_REGISTRIES[0]))
    monkeypatch.setattr(stateful_format, "_MIGRATIONS", dict(_REGISTRIES[1]))
    memory = sys.modules.get("fsspec.implementations.memory")
    if memory is not None:
        memory.MemoryFileSystem.store.clear()
        memory.MemoryFileSystem.pseudo_dirs[:] = [""]


def _library_registries() -> tuple[dict, dict]:
    import fastckpt.nn.factory as factory
    import fastckpt.stateful.format as stateful_format

    return dict(factory._registry), dict(stateful_format._MIGRATIONS)


_REGISTRIES = _library_registries()


def page_param(page: str):
    uses_device = any(USES_DEVICE.search(code) for code, why in page_blocks(page) if why is None)
    return pytest.param(page, marks=[pytest.mark.device] if uses_device else [])


def run_page(page: str, module: types.ModuleType, when: str = "") -> None:
    """Run a page's blocks (fragments left out) in order in ``module``'s namespace; a failure names the block."""
    for i, (code, why) in enumerate(page_blocks(page)):
        if why is not None:
            continue  # a fragment, marked as one in the page
        try:
            exec(compile(code, f"docs/{page} python block {i}", "exec"), module.__dict__)
        except Exception as exc:  # name the page and the block in the failure
            raise AssertionError(f"docs/{page} python block {i} failed{when}: {exc!r}\n{code}") from exc


def page_module(page: str, monkeypatch) -> types.ModuleType:
    # The blocks run as a script would: in a module of their own (dataclasses look their module up).
    module = types.ModuleType(f"docs_{re.sub(r'[^0-9A-Za-z]', '_', page)}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


@pytest.mark.parametrize("page", [page_param(p) for p in PAGES])
def test_docs_page_python_blocks_run(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    fresh_process(monkeypatch)
    run_page(page, page_module(page, monkeypatch))
    lines = capsys.readouterr().out.splitlines()
    for expected in EXPECTED_OUTPUT.get(page, []):
        assert expected in lines, f"docs/{page}: no output line {expected!r}; the blocks printed:\n" + "\n".join(lines)


@pytest.mark.parametrize("page", [page_param(p) for p in PAGES])
def test_docs_page_python_blocks_run_twice_in_one_directory(page, tmp_path, monkeypatch, capsys):
    # A reader who runs a page's examples again, in a new process in the directory the first run filled, gets the
    # same results: no block trips over the files the first run left behind.
    monkeypatch.chdir(tmp_path)
    for run in (1, 2):
        fresh_process(monkeypatch)
        with warnings.catch_warnings():
            # A second run that replaces a file says overwrite=True: the FutureWarning of a replace that was not asked
            # for (fastckpt 0.4 refuses it) must not be what a reader sees when trying an example again.
            warnings.simplefilter("error", FutureWarning)
            run_page(page, page_module(page, monkeypatch), f" on run {run}")
        lines = capsys.readouterr().out.splitlines()
        for expected in EXPECTED_OUTPUT.get(page, []):
            if run == 2:
                expected = SECOND_RUN_OUTPUT.get(page, {}).get(expected, expected)
            assert expected in lines, f"docs/{page}, run {run}: no output line {expected!r}; printed:\n" + "\n".join(lines)


DOCTEST_PAGES = [p for p in PAGES if "\n>>> " in (DOCS / p).read_text(encoding="utf-8")]


def test_some_pages_hold_doctest_examples():
    assert "formats/hf-sharded.md" in DOCTEST_PAGES


@pytest.mark.parametrize("page", DOCTEST_PAGES)
def test_docs_page_doctest_examples_run(page, tmp_path, monkeypatch):
    # `>>>` examples in a page (docs/formats/hf-sharded.md's called save_sharded without importing it) give what they
    # show, run as written: twice, in one directory.
    import doctest

    monkeypatch.chdir(tmp_path)
    # The examples of every fenced block, without the fences (a closing fence would read as expected output).
    text = "\n".join(re.findall(r"^```[a-z]*\n(>>> .*?)^```", (DOCS / page).read_text(encoding="utf-8"), re.S | re.M))
    for run in (1, 2):
        test = doctest.DocTestParser().get_doctest(text, {}, f"docs/{page}", str(DOCS / page), 0)
        assert test.examples, page
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        runner.run(test)
        assert runner.summarize(verbose=False).failed == 0, f"docs/{page}: doctest examples failed on run {run}"


# -- docs/which-call.md ----------------------------------------------------------------------------------------------

def test_which_call_page_is_linked_from_the_index():
    assert "(which-call.md)" in (DOCS / "index.md").read_text(encoding="utf-8")


def resolve(dotted: str):
    """The object a dotted name such as ``fastckpt.io.checkpoint.save_checkpoint`` names (its longest module prefix
    imported, the rest looked up as attributes)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_name_on_the_which_call_page_exists():
    text = (DOCS / "which-call.md").read_text(encoding="utf-8")
    code = " ".join(re.findall(r"`([^`]+)`", text))
    names = re.findall(r"\b(fastckpt(?:\.\w+)+)(\(?)", code)
    assert len(names) >= 40
    for dotted, call in names:
        try:
            obj = resolve(dotted)
        except (ImportError, AttributeError) as exc:
            raise AssertionError(f"docs/which-call.md names {dotted}, which does not exist: {exc!r}") from exc
        if call:  # written as a call: a function or a class, not a module of that name
            assert callable(obj) and not isinstance(obj, types.ModuleType), f"docs/which-call.md calls {dotted}()"


def test_every_command_on_the_which_call_page_exists(capsys):
    from fastckpt.cli import main

    commands = set(re.findall(r"`fastckpt ([a-z]+)", (DOCS / "which-call.md").read_text(encoding="utf-8")))
    assert commands == {"inspect", "convert", "reshard", "compact", "verify", "bench", "demo"}
    for command in sorted(commands):
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0, command
        assert f"usage: fastckpt {command}" in capsys.readouterr().out


def test_help_of_the_package_starts_with_a_short_pointer_to_which_call():
    # help(fastckpt) opened with a 15-line overview and never named the page that answers "which call?".
    import pydoc

    import fastckpt

    doc = fastckpt.__doc__
    assert "docs/which-call.md" in doc.splitlines()[0]
    assert (Path(__file__).resolve().parents[1] / "docs" / "which-call.md").is_file()
    assert len(doc.split(">>>")[0].strip().splitlines()) <= 8  # the prose before the example
    assert "docs/which-call.md" in pydoc.render_doc(fastckpt, renderer=pydoc.plaintext)[:300]  # in its first lines


# Every name `from fastckpt import *` bound in 0.3.0; since then only the entry points are in __all__.
NAMES_OF_0_3_STAR = [
    "FastCkptError", "FormatError", "IntegrityError", "ChecksumMismatchError", "RestoreMismatchError",
    "TensorNotFoundError", "CheckpointNotFoundError", "DestinationError", "CheckpointChangedError",
    "BrokenChainError", "MissingIdsError", "CheckpointKeyError", "BarrierTimeoutError", "EngineError",
    "FastCkptWarning", "NotZeroCopyWarning", "open", "register_opener", "TensorFile", "CheckpointDirectory",
    "TensorReader", "TensorInfo", "MappedFile", "save_npz", "NpzWriter", "save_safetensors", "save_sharded",
    "save_tree", "load_tree", "save_bytes", "load_bytes", "HFShardedDirectory", "load_file", "LoadedTensors",
    "PersistentBufferPool", "Tensor", "CheckpointManager", "to_torch", "load_torch",
]


def test_help_of_the_package_is_short_and_documents_the_entry_points():
    # help(fastckpt) was 2,479 lines (3,048 by 0.3.0's end): every class, exception and their inherited methods.
    import pydoc

    import fastckpt

    text = pydoc.render_doc(fastckpt, renderer=pydoc.plaintext)
    assert len(text.splitlines()) <= 600
    for name in fastckpt.__all__:
        assert f"\n    {name}(" in text or f"class {name}(" in text, name
    for name in ("fastckpt.errors", "fastckpt.formats.reader", "fastckpt.device", "fastckpt.train", "fastckpt.arrays"):
        assert name in fastckpt.__doc__


def test_names_left_out_of_the_star_import_are_still_attributes_of_the_package():
    import fastckpt
    import fastckpt.errors

    star: dict = {}
    exec("from fastckpt import *", star)
    assert sorted(k for k in star if not k.startswith("__")) == sorted(fastckpt.__all__)
    for name in NAMES_OF_0_3_STAR:
        assert getattr(fastckpt, name) is not None, name
    assert set(fastckpt.__all__) <= set(NAMES_OF_0_3_STAR)
    assert {name for name in fastckpt.errors.__all__ if name[0].isupper()} <= set(dir(fastckpt))
    assert "__version__" in dir(fastckpt) and "PersistentBufferPool" not in dir(fastckpt)  # dir() imports nothing
