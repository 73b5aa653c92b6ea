"""The cold suite (``fastckpt bench --suite cold``) and the read-ahead it measures.

The suite's plumbing is checked quickly here (a row measured in this process, the table's shares and verdicts); the
whole suite runs under ``-m slow``. The read-ahead tests check what the loaders ask of the kernel, not how fast it is
(speed claims come from the bench command, never from tests).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import fastckpt
from _cold_files import eight_tensors
from fastckpt.bench import cold
from fastckpt.formats import readinto


def _run(seconds, exact=True, rss=1 << 30):
    return {"seconds": seconds, "exact": exact, "peak_rss": rss}


FIXTURE = {"file_size": 10**9, "nbytes": 10**9, "dir_nbytes": 10**9, "netcl_nbytes": 5 * 10**8}


def test_the_table_takes_the_fastest_bound_and_says_which_rows_were_not_exact_or_left_out():
    samples = {"bound: buffered readinto, 64 MiB": [_run(2.0), _run(1.0), _run(3.0)],
               "bound: O_DIRECT preadv, 4 threads": [_run(4.0)],
               "fastckpt.open + copies": [_run(1.25)],
               "load_model(.netcl, pool) on pocl": [_run(1.0)],
               "load_file(pool) on pocl": [_run(1.0), _run(1.0, exact=False)],
               "Run:ai SafetensorsStreamer": [{"skipped": "ModuleNotFoundError: No module named 'x'"}]}
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in cold.table(samples, FIXTURE)[2:]}
    assert rows["bound: buffered readinto, 64 MiB"][:3] == ["2.000 s", "0.50", "1.00"]  # the median of 3
    assert rows["bound: O_DIRECT preadv, 4 threads"][2] == "0.50"
    assert rows["fastckpt.open + copies"][1:3] == ["0.80", "1.60"] and rows["fastckpt.open + copies"][5] == "yes"
    assert rows["load_model(.netcl, pool) on pocl"][1] == "0.50"  # its own file's size
    assert rows["load_file(pool) on pocl"][5] == "NO"
    assert rows["load_file(pool) on pocl"][3] == "2.00, 1.00"  # against each round's fastest bound: 0.5, 1.0 GB/s
    assert rows["Run:ai SafetensorsStreamer"][5].startswith("left out: ModuleNotFoundError")
    assert rows["fastckpt.open + copies"][6] == "1024 MiB"


def test_a_before_row_is_read_as_its_row():
    samples = {"bound: buffered readinto, 64 MiB": [_run(1.0)],
               "fastckpt.open + copies" + cold.BEFORE: [_run(2.0)]}
    last = cold.table(samples, FIXTURE)[-1]
    assert last.startswith("| fastckpt.open + copies (before) | 2.000 s | 0.50 | 0.50 | 0.50 | 0.00 s | yes")
    assert last.endswith("| 1024 MiB | 0 | 0 MiB | 0 | - |")


def test_the_direct_read_into_huge_pages_is_a_bound():
    """The O_DIRECT read into 2 MiB pages (the disk's large requests) is a plain read like the others: where it is
    the fastest, every share is taken against it."""
    samples = {"bound: O_DIRECT preadv, 4 threads": [_run(2.0)],
               "bound: O_DIRECT preadv, 4 threads, into 2 MiB pages": [_run(1.0)],
               "load_file(pool, staging=True) on pocl": [{**_run(1.6), "disk_requests": 200}]}
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in cold.table(samples, FIXTURE)[2:]}
    assert rows["bound: O_DIRECT preadv, 4 threads, into 2 MiB pages"][2:4] == ["1.00", "1.00"]
    assert rows["bound: O_DIRECT preadv, 4 threads"][2] == "0.50"
    assert rows["load_file(pool, staging=True) on pocl"][2] == "0.62"  # 0.625 GB/s over the bound's 1.0
    assert rows["load_file(pool, staging=True) on pocl"][-1] == "200 |"


@pytest.mark.device
def test_rows_measured_in_this_process_are_exact_and_say_their_peak(tmp_path):
    fixture = cold.prepare(str(tmp_path), 1, 4)
    for row in ("bound: buffered readinto, 64 MiB", "bound: O_DIRECT preadv, 4 threads",
                "bound: O_DIRECT preadv, 4 threads, into 2 MiB pages", "fastckpt.open + copies",
                "fastckpt.open(HF directory) + copies", "load_file(pool) on pocl", "load_model(.netcl, pool) on pocl"):
        got = cold.measure_one(row, fixture)
        assert got["exact"] is True, row
        assert got["seconds"] > 0 and got["peak_rss"] > 1 << 20, row
    # the check looks at the bytes: a changed tensor is not exact
    with fastckpt.open(fixture["file"]) as f:
        first = f.info(next(iter(f.keys())))
    with open(fixture["file"], "r+b") as f:
        f.seek(first.offset)
        f.write(b"\xff\xfe")
    assert cold.measure_one("fastckpt.open + copies", fixture)["exact"] is False


def test_row_picks_rows_by_name_or_by_kind_and_name_and_keeps_every_bound():
    rows = list(cold.ROWS)
    bounds = [r for r in rows if r.startswith("bound: ")]
    assert cold.select(rows, ["peer: safetensors.numpy"]) == bounds + ["safetensors.numpy.load_file"]
    assert cold.select(rows, ["safetensors.numpy"]) == bounds + ["safetensors.numpy.load_file"]
    assert cold.select(rows, ["fastckpt.open +"]) == bounds + [
        "fastckpt.open + copies", "fastckpt.open + copies, kernel readahead",
        "fastckpt.open + copies into 4 KiB pages, kernel readahead"]
    with pytest.raises(SystemExit, match="'peer: safetensors.nmpy' names no cold row; rows: bound: "):
        cold.select(rows, ["fastckpt.open +", "peer: safetensors.nmpy"])  # a typo: no table without the row


def test_the_kernel_readahead_rows_are_exact_and_run_without_the_readers_advice(tmp_path, monkeypatch):
    from numpy._core.multiarray import _set_madvise_hugepage

    from fastckpt.formats import reader

    monkeypatch.setattr(reader, "READ_AHEAD_ADVICE", True)  # the rows set it False: put back after the test
    asked = []
    monkeypatch.setattr(reader, "read_ahead", lambda *a, **k: asked.append(a) or 1)
    fixture = cold.prepare(str(tmp_path), 4, 4)
    huge = _set_madvise_hugepage(True)
    try:
        for row in ("fastckpt.open + copies, kernel readahead", "fastckpt.open(HF directory) + copies, kernel readahead",
                    "fastckpt.open + copies into 4 KiB pages, kernel readahead"):
            got = cold.measure_one(row, fixture)
            assert got["exact"] is True and got["seconds"] > 0, row
            assert reader.READ_AHEAD_ADVICE is False, row
        assert _set_madvise_hugepage(True) is False  # the last row's arrays were left on 4 KiB pages
    finally:
        _set_madvise_hugepage(huge)
    assert asked == []


def test_a_row_whose_imports_fail_is_left_out(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_safetensors(name, *args, **kwargs):
        if name.startswith("safetensors"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_safetensors)
    got = cold.measure_one("safetensors.numpy.load_file", {"file": "", "dir": "", "netcl": "", "file_size": 0})
    assert got == {"skipped": "ImportError: No module named 'safetensors.numpy'"}


@pytest.mark.slow  # a benchmark smoke run: fresh processes, every row
def test_cold_suite_quick_run_is_exact_on_every_row(tmp_path, capsys):
    from fastckpt.bench import main

    assert main(["--suite", "cold", "--quick", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0][2:] for line in out.splitlines() if line.startswith("| ")} - {"path"}
    assert {r for r in cold.ROWS if r not in cold.QUICK_SKIP} <= rows
    assert "NOT EXACT" not in out


# ------------------------------------------------------------------ read-ahead


def _cold_file(path, nbytes):
    fastckpt.save_safetensors(path, {"a": np.arange(nbytes // 8, dtype=np.int64),
                                     "b": np.ones(nbytes // 16, np.float32)}, overwrite=True)
    cold.drop_cache([str(path)])


def test_read_ahead_puts_a_whole_range_in_the_page_cache_where_one_advice_call_does_not(tmp_path):
    from fastckpt._native.mapped import MappedFile

    path = tmp_path / "big.safetensors"
    _cold_file(path, 64 << 20)
    m = MappedFile(str(path))
    size = m.size
    cold.drop_cache([str(path)])
    if readinto.cached(m, 0, size):
        pytest.skip("this filesystem keeps the file cached (posix_fadvise DONTNEED had no effect)")
    calls = readinto.read_ahead(m, 0, size)
    assert calls == -(-size // readinto.READAHEAD_STEP)
    deadline = time.monotonic() + 20
    while not readinto.cached(m, 0, size) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert readinto.cached(m, 0, size)
    assert readinto.read_ahead(m, 0, size) == 0  # warm: no advice at all


def test_a_view_of_a_large_tensor_reads_ahead_once_per_half_window(tmp_path, monkeypatch):
    from fastckpt.formats import reader

    asked = []
    monkeypatch.setattr(reader, "read_ahead", lambda mapped, start, end, check: asked.append((start, end)))
    monkeypatch.setattr(reader, "cached", lambda mapped, start, end, samples, **kw: False)  # as if the file were cold
    monkeypatch.setattr(reader, "READ_AHEAD", 8 << 20)
    path = tmp_path / "m.safetensors"
    tensors = {f"t{i}": np.full(1 << 18, i, np.float32) for i in range(12)}  # 1 MiB each
    fastckpt.save_safetensors(path, tensors)
    with fastckpt.open(path) as f:
        copies = {k: np.array(f.host(k)) for k in f.keys()}
        starts = [f.info(k).offset for k in f.keys()]
        ends = [f.info(k).offset + f.info(k).nbytes for k in f.keys()]
    assert all(copies[k].tolist() == tensors[k].tolist() for k in tensors)
    size = os.path.getsize(path)
    assert asked[0] == (starts[0], ends[0] + (8 << 20))  # the first tensor and the window past it
    assert asked[-1][1] == size  # never past the file's end
    assert 1 < len(asked) < len(tensors)  # extended by half a window at a time, not once per tensor
    assert all(b[0] == a[1] for a, b in zip(asked, asked[1:]))  # each call extends the last, none repeats
    monkeypatch.setattr(reader, "cached", lambda mapped, start, end, samples, **kw: True)  # a warm file: never read ahead
    asked.clear()
    with fastckpt.open(path) as f:
        [np.array(f.host(k)) for k in f.keys()]
    assert asked == []


@pytest.mark.parametrize("source", ["file", "hf"])
def test_without_the_read_ahead_advice_a_cold_file_is_read_by_the_kernels_own_readahead(tmp_path, monkeypatch,
                                                                                      source):
    """``READ_AHEAD_ADVICE = False``: no ``MADV_WILLNEED`` at the map, past a view, for ``hosts()`` or for a Hugging
    Face directory's next shard; the copies' page faults read the file (large folios). The advice, on: asked."""
    from fastckpt.formats import reader

    tensors, path = eight_tensors(tmp_path, source)
    asked, mapped_with = [], []
    monkeypatch.setattr(reader, "read_ahead", lambda mapped, start, end, **k: asked.append((start, end)) or 1)
    monkeypatch.setattr(reader, "cached", lambda *a, **k: False)  # every file cold
    advise = reader._advise
    monkeypatch.setattr(reader, "_advise", lambda mapped, kind: asked.append(kind) if kind == "willneed" else
                        advise(mapped, kind))
    mapped_file = reader.MappedFile
    monkeypatch.setattr(reader, "MappedFile", lambda p, **k: mapped_with.append(k.get("advise", True)) or
                        mapped_file(p, **k))
    expected = {k: a.tolist() for k, a in tensors.items()}
    for advice in (False, True):
        monkeypatch.setattr(reader, "READ_AHEAD_ADVICE", advice)
        asked.clear(), mapped_with.clear()
        with fastckpt.open(path) as r:
            assert {k: np.array(r.host(k)).tolist() for k in r.keys()} == expected
            assert {k: v.tolist() for k, v in r.hosts().items()} == expected if source == "file" else True
        assert len(mapped_with) == (1 if source == "file" else 4)
        if advice:
            assert asked and (source == "hf" or mapped_with == [True])  # a file alone: MappedFile's own advice
        else:
            assert asked == [] and mapped_with == [False] * len(mapped_with)


def test_busy_processes_run_while_the_block_runs_and_are_ended_after():
    with cold._Busy(2) as busy:
        assert len(busy.procs) == 2 and all(p.poll() is None for p in busy.procs)
    assert all(p.poll() is not None for p in busy.procs)  # ended and waited for: no process is left behind
