"""Every I/O call of every writer fails in turn (tests/faults.py); after each, the checkpoint is as it was.

For each writer (the conformance layouts, and the single-file safetensors and NPZ writers), and both ``overwrite=``
values, a save of version 2 runs with one call made to fail (EMFILE, ENOSPC, EIO, EACCES, or a KeyboardInterrupt
just before it). Then:

- with ``overwrite=True`` the previous commit (version 1) loads exactly; with ``overwrite=False`` (no previous
  commit) nothing loads: no reader sees a part of the failed save;
- the error (an ``OSError``) names the target, never only a temporary;
- the next save succeeds, loads exactly, and leaves no temporary, staging directory or lock.

A fault the save absorbs (a failed clean-up of a temporary after the commit) must leave the new save whole. A
fault after the commit point (:func:`commit_point`: a multi-file save's directory fsync after its last rename, which
is taken back when it fails; a single file's rename, since a file replaced by ``os.replace`` cannot be taken back),
or an interrupt right after that call, may leave the new save, whole.

The default run tries, for each writer, the first and the last call of each kind, the error rotating; ``-m slow``
tries every call with every error.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest

import fastckpt
from faults import ERRORS, Faults
from test_conformance import LAYOUTS, Layout, assert_exactly, expected, leftovers


def _file_layout(name: str, save_file):
    def save(target, version, overwrite, fsync=False):
        save_file(target, expected(version), overwrite=overwrite, fsync=fsync)

    def load(target):
        with fastckpt.open(target) as reader:
            return {key: np.array(reader.host(key)) for key in reader.keys()}

    return Layout(name, save, load, lambda tmp: tmp / f"model.{name}")


FILE_LAYOUTS = [_file_layout("safetensors", lambda p, t, **kw: fastckpt.save_safetensors(p, t, **kw)),
                _file_layout("npz", lambda p, t, **kw: fastckpt.save_npz(p, t, **kw))]
WRITERS = LAYOUTS + FILE_LAYOUTS
SINGLE_FILES = {layout.name for layout in FILE_LAYOUTS}


def _error_name(error) -> str:
    return "KeyboardInterrupt" if error is KeyboardInterrupt else errno.errorcode[error]


def _count(layout: Layout, base: Path, overwrite: bool) -> list[tuple[str, str]]:
    root = base / "count"
    root.mkdir()
    target = layout.target(root)
    if overwrite:
        layout.save(target, 1, False)
    with Faults(root) as faults:
        layout.save(target, 2, overwrite, fsync=True)
    return [(kind, path.replace(os.fspath(root), "{root}", 1)) for kind, path in faults.calls]


def commit_point(layout: Layout, calls: list[tuple[str, str]]) -> int:
    """The index of the call after which the save is committed: the fsync of the directory that follows the last
    rename onto a final name of the target (a fault up to it leaves the previous commit; one after it, in the
    clean-up, may leave the new one when it is an interrupt)."""
    target = os.fspath(layout.target(Path("{root}")))
    renamed = max(i for i, (kind, path) in enumerate(calls) if kind in ("rename", "renameat2")
                  and ".partial" not in path and (path == target or path.startswith((target + os.sep, target + "."))))
    if layout.name in SINGLE_FILES:  # a file's rename is its commit (os.replace cannot be taken back)
        return renamed
    return next(i for i in range(renamed, len(calls))
                if calls[i][0] == "fsync" and calls[i][1] in (target, os.path.dirname(target)))


def _names_target(exc: OSError, target: Path, layout: Layout) -> bool:
    """The error names the target (or, for a manager, a file of its directory: its record and lock are written
    for the save), never only a temporary."""
    name = os.fspath(exc.filename) if exc.filename is not None else ""
    owner = target.parent if layout.name == "manager" else target
    return name.startswith(os.fspath(owner)) and ".partial" not in os.path.basename(name)


def _one(layout: Layout, base: Path, overwrite: bool, fail_at: int, error, committed_after: int) -> str | None:
    """Run one injected fault; returns what went wrong, or None."""
    root = base / f"{fail_at}-{_error_name(error)}"
    root.mkdir()
    target = layout.target(root)
    if overwrite:
        layout.save(target, 1, False)
    raised = None
    with Faults(root, fail_at=fail_at, error=error) as faults:
        try:
            layout.save(target, 2, overwrite, fsync=True)
        except BaseException as exc:  # noqa: BLE001 - what the fault did is checked below
            raised = exc
    where = f"{layout} overwrite={overwrite} call {fail_at} {faults.failed} {_error_name(error)}"
    if faults.failed is None:
        return None  # this run made fewer calls: nothing was injected
    try:
        if raised is None:
            assert_exactly(layout, target, 2)  # absorbed: the save is whole
        else:
            if isinstance(raised, OSError) and not _names_target(raised, target, layout):
                return f"{where}: the error does not name the target: {raised!r}"
            if not isinstance(raised, (OSError, KeyboardInterrupt)):
                return f"{where}: raised {raised!r}"
            if fail_at > committed_after or (fail_at == committed_after and error is KeyboardInterrupt):
                committed = _loads_as(layout, target) == 2  # the commit was made before the fault
            else:
                committed = False
            if overwrite or committed:
                assert_exactly(layout, target, 2 if committed else 1)
            else:
                try:
                    layout.load(target)
                except FileNotFoundError:
                    pass
                else:
                    return f"{where}: the failed save is visible"
        layout.save(target, 3, True)
        assert_exactly(layout, target, 3)
        left = leftovers(root)
        if left:
            return f"{where}: the next save left {left}"
    except Exception as exc:  # noqa: BLE001 - reported with the case
        return f"{where}: {type(exc).__name__}: {exc}"
    return None


def _loads_as(layout: Layout, target: Path) -> int | None:
    try:
        return int(np.asarray(layout.load(target)["a"])[0])
    except Exception:  # noqa: BLE001 - nothing whole there: the checks that follow say what
        return None


def _sample(calls: list[tuple[str, str]]) -> list[int]:
    """The first and the last call of each kind."""
    picked: dict[str, list[int]] = {}
    for index, (kind, _) in enumerate(calls):
        picked.setdefault(kind, []).append(index)
    return sorted({i for indices in picked.values() for i in (indices[0], indices[-1])})


def _report(layout: Layout, overwrite: bool, calls: list, tried: int, problems: list[str]) -> None:
    """Append the counts to $FASTCKPT_FAULT_REPORT (JSON lines), for the release notes' table."""
    path = os.environ.get("FASTCKPT_FAULT_REPORT")
    if path:
        kinds: dict[str, int] = {}
        for kind, _ in calls:
            kinds[kind] = kinds.get(kind, 0) + 1
        with open(path, "a") as f:
            f.write(json.dumps({"writer": layout.name, "overwrite": overwrite, "calls": len(calls), "kinds": kinds,
                                "runs": tried, "failures": problems}) + "\n")


@pytest.mark.parametrize("overwrite", [True, False])
@pytest.mark.parametrize("layout", WRITERS, ids=str)
def test_a_fault_at_each_kind_of_call_leaves_the_previous_commit(layout, overwrite, tmp_path):
    calls = _count(layout, tmp_path, overwrite)
    kinds = {kind for kind, _ in calls}
    assert kinds >= {"open", "fsync"} and kinds & {"rename", "renameat2"}, calls  # the harness sees the save
    problems = []
    picked = _sample(calls)
    after = commit_point(layout, calls)
    for n, index in enumerate(picked):
        problem = _one(layout, tmp_path, overwrite, index, ERRORS[n % len(ERRORS)], after)
        if problem:
            problems.append(problem)
    _report(layout, overwrite, calls, len(picked), problems)
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("error", ERRORS, ids=_error_name)
@pytest.mark.parametrize("overwrite", [True, False])
@pytest.mark.parametrize("layout", WRITERS, ids=str)
def test_a_fault_at_every_call_leaves_the_previous_commit(layout, overwrite, error, tmp_path):
    calls = _count(layout, tmp_path, overwrite)
    after = commit_point(layout, calls)
    problems = [p for p in (_one(layout, tmp_path, overwrite, i, error, after) for i in range(len(calls))) if p]
    _report(layout, overwrite, calls, len(calls), problems)
    assert not problems, "\n".join(problems)


def test_the_harness_fails_the_call_it_is_told_to(tmp_path):
    with Faults(tmp_path, fail_at=1, error=28) as faults:
        with open(tmp_path / "a", "wb") as f:  # call 0: open
            with pytest.raises(OSError) as failure:
                f.write(b"x")  # call 1: write
    assert failure.value.errno == 28 and failure.value.filename == str(tmp_path / "a")
    assert faults.failed == ("write", str(tmp_path / "a"))
    assert [kind for kind, _ in faults.calls] == ["open", "write", "close"]


def test_a_tf_save_whose_second_shard_cannot_be_opened_keeps_the_previous_checkpoint(tmp_path):
    """The failure that lost data: the error path committed shard 0's empty temporary over the old data file."""
    layout = next(entry for entry in LAYOUTS if entry.name == "tf-multishard")
    target = layout.target(tmp_path)
    layout.save(target, 1, False)
    opens = 0

    def second_open_fails(calls):
        return [i for i, (kind, path) in enumerate(calls) if kind == "open" and ".data-" in path][1]

    with Faults(tmp_path) as counting:
        layout.save(target, 2, True, fsync=True)
    layout.save(target, 1, True)
    with Faults(tmp_path, fail_at=second_open_fails(counting.calls), error=24) as faults:
        with pytest.raises(OSError) as failure:
            layout.save(target, 2, True, fsync=True)
    assert faults.failed[0] == "open" and "data-00001-of-00002" in faults.failed[1], faults.failed
    assert failure.value.errno == 24 and os.fspath(failure.value.filename).startswith(os.fspath(target) + ".")
    assert_exactly(layout, target, 1)
    assert leftovers(tmp_path) == [] and opens == 0


@pytest.mark.parametrize("layout", [w for w in WRITERS if w.name != "manager"], ids=str)  # a manager makes its
def test_a_failed_save_into_a_new_directory_leaves_no_directory(layout, tmp_path):        # directory when made
    root = tmp_path / "new" / "deeper"
    target = layout.target(root)
    with Faults(tmp_path) as counting:
        layout.save(target, 1, False, fsync=True)
    first_write = next(i for i, (kind, _) in enumerate(counting.calls) if kind in ("write", "writev"))
    layout.target(tmp_path / "again")  # the same layout, a fresh place
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with Faults(fresh, fail_at=first_write, error=errno.ENOSPC):
        with pytest.raises(OSError):
            layout.save(layout.target(fresh / "new" / "deeper"), 1, False, fsync=True)
    assert os.listdir(fresh) == [], f"{layout}: a failed save left {os.listdir(fresh)}"
