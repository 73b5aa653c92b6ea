"""Atomic writes: nothing half-written under the final name, leftovers of dead writers removed."""

import os

import pytest

from fastckpt.store import commit as _atomic
from fastckpt.store.commit import atomic_directory, atomic_write, remove_stale_partials


def test_atomic_write_replaces_only_on_success(tmp_path):
    target = tmp_path / "sub" / "f.bin"
    with atomic_write(target) as f:
        f.write(b"one")
    assert target.read_bytes() == b"one"
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_write(target, overwrite=True) as f:
            f.write(b"two, half written")
            raise RuntimeError("boom")
    assert target.read_bytes() == b"one"
    assert sorted(p.name for p in target.parent.iterdir()) == ["f.bin"]


def test_failed_rename_leaves_previous_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="No space left on device") as failure:
        with atomic_write(target, overwrite=True) as f:
            f.write(b"new")
    monkeypatch.undo()
    assert failure.value.filename == str(target)  # the target, never only the temporary
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_an_open_reader_keeps_the_replaced_file_whole(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    with open(target, "rb") as reader:
        with atomic_write(target, overwrite=True) as f:
            f.write(b"new")
        assert target.read_bytes() == b"new"
        assert reader.read() == b"old"
        assert os.fstat(reader.fileno()).st_nlink == 0  # unlinked, not left under another name
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_a_file_never_replaces_a_directory(tmp_path):
    target = tmp_path / "d"
    target.mkdir()
    (target / "keep").write_bytes(b"k")
    with pytest.raises(IsADirectoryError) as failure:
        with atomic_write(target, overwrite=True) as f:
            f.write(b"new")
    assert failure.value.filename == str(target)
    assert (target / "keep").read_bytes() == b"k"
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_a_symlink_is_replaced_not_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(b"theirs")
    target = tmp_path / "f.bin"
    target.symlink_to(elsewhere)
    with atomic_write(target, overwrite=True) as f:
        f.write(b"new")
    assert not target.is_symlink() and target.read_bytes() == b"new"
    assert elsewhere.read_bytes() == b"theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere.bin", "f.bin"]


def test_stale_partials_of_dead_writers_are_removed_live_ones_kept(tmp_path):
    target = tmp_path / "f.bin"
    me = _atomic._owner()
    dead = tmp_path / f".f.bin.{me}.999999999.00000000.partial"
    live = tmp_path / f".f.bin.{me}.{os.getpid()}.11111111.partial"
    other = tmp_path / f".g.bin.{me}.999999999.00000000.partial"
    for p in (dead, live, other):
        p.write_bytes(b"x")
    assert remove_stale_partials(target) == [dead]
    assert live.exists() and other.exists() and not dead.exists()


def test_atomic_directory_appears_whole(tmp_path):
    target = tmp_path / "ckpt"
    with pytest.raises(RuntimeError, match="interrupted"):
        with atomic_directory(target) as d:
            (d / "a").write_bytes(b"1")
            raise RuntimeError("interrupted")
    assert not target.exists() and list(tmp_path.iterdir()) == []
    with atomic_directory(target) as d:
        (d / "a").write_bytes(b"1")
    assert (target / "a").read_bytes() == b"1"
    with pytest.raises(FileExistsError, match=r"File exists; pass overwrite=True to replace it: '.*ckpt'"):
        with atomic_directory(target):
            pass
    with atomic_directory(target, overwrite=True) as d:
        (d / "b").write_bytes(b"2")
    assert sorted(p.name for p in target.iterdir()) == ["b"]


def test_directory_replacement_is_one_atomic_exchange_where_linux_has_it(tmp_path, monkeypatch):
    if _atomic._renameat2() is None:
        pytest.skip("this C library has no renameat2")
    target = tmp_path / "ckpt"
    with atomic_directory(target) as d:
        (d / "a").write_bytes(b"old")
    moves = []
    monkeypatch.setattr(os, "replace", lambda *a: moves.append(a))  # the exchange needs no rename
    with atomic_directory(target, overwrite=True) as d:
        (d / "b").write_bytes(b"new")
    assert moves == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert [p.name for p in target.iterdir()] == ["b"]


def test_failed_directory_swap_puts_the_old_directory_back(tmp_path, monkeypatch):
    monkeypatch.setattr(_atomic, "_exchange", lambda a, b: False)  # the two-rename fallback
    target = tmp_path / "ckpt"
    with atomic_directory(target) as d:
        (d / "a").write_bytes(b"old")
    real_replace = os.replace
    calls = []

    def replace_failing_second(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # old moved aside; the new one fails to move in
            raise OSError(5, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_failing_second)
    with pytest.raises(OSError, match="Input/output error"):
        with atomic_directory(target, overwrite=True) as d:
            (d / "b").write_bytes(b"new")
    monkeypatch.undo()
    assert (target / "a").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
