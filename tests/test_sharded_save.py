"""A sharded save writes a table's rows in slice order without copying the rank's share first: each writer gathers
its tensor's rows a piece at a time as it writes them (fastckpt.arrays.TakenRows, WriteBlock.payload), and the
files' write-out to the disk starts while the save goes on (GatherWriter's writeback)."""

from __future__ import annotations

import dataclasses
import os
import tracemalloc
from pathlib import Path

import blake3
import numpy as np
import pytest

from _writing import record_staged_writes
from fastckpt._native.gather import GatherWriter
from fastckpt.arrays import TakenRows
from fastckpt.formats.safetensors import save_safetensors
from fastckpt.sharded import HashTable, Loader, Saver, WriteBlock
from fastckpt.sharded.format import SLICE_SIZE, slice_positions

DIM = 8


def table(n: int = 5000, seed: int = 3, dtype=np.float32) -> HashTable:
    """ids over the whole int64 range, inserted in random order (not in slice order), rows and Adam slots."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation(np.unique(rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)))
    values = rng.standard_normal((len(ids), DIM)).astype(dtype)
    t = HashTable(DIM, dtype=dtype, slots=("m", "v"), name="emb")
    t.insert(ids, values, {"m": -values, "v": values * 2})
    return t


def slice_sorted(t: HashTable) -> np.ndarray:
    """The table's ids in the order a version-4 part stores them: stable by slice position."""
    ids = t.rows()[0]
    return ids[np.argsort(slice_positions(ids, SLICE_SIZE), kind="stable")]


def directory_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_filter_func_sees_the_stored_tensors_and_reading_them_changes_no_byte(tmp_path):
    t = table()
    seen = {}

    def look(blocks):
        for b in blocks:
            seen[b.key] = (b.array.copy(), b.shape, b.nbytes, b.dtype)
        return blocks

    Saver(path=str(tmp_path / "read"), parallel=2, hashtables={"emb": t}, tensors={"w": np.eye(3)},
          filter_func=look).save()
    Saver(path=str(tmp_path / "not-read"), parallel=2, hashtables={"emb": t}, tensors={"w": np.eye(3)}).save()
    assert directory_bytes(tmp_path / "read") == directory_bytes(tmp_path / "not-read")

    order = slice_sorted(t)
    ids_array, ids_shape, ids_nbytes, ids_dtype = seen["emb.id/part_0_1"]
    assert ids_array.tolist() == order.tolist()
    assert (ids_shape, ids_nbytes, ids_dtype) == ((len(order),), 8 * len(order), np.dtype(np.int64))
    assert seen["emb.embedding/part_0_1"][0].tobytes() == t.lookup(order).tobytes()
    assert seen["emb.v/part_0_1"][0].tobytes() == t.lookup_slot("v", order).tobytes()
    assert seen["emb.m/part_0_1"][1:3] == ((len(order), DIM), len(order) * DIM * 4)
    assert seen["w/part_0_1"][0].tolist() == np.eye(3).tolist()

    tables = {"emb": HashTable(DIM, slots=("m", "v"))}
    Loader(str(tmp_path / "not-read"), hashtables=tables, tensors={}).load()
    assert tables["emb"].ids().tolist() == np.sort(order).tolist()
    assert tables["emb"].lookup_slot("m", order).tobytes() == t.lookup_slot("m", order).tobytes()


@pytest.mark.parametrize("kind", ["full", "delta"])
def test_a_save_holds_no_copy_of_the_share(tmp_path, kind):
    t = table(200_000)
    share = t.nbytes
    if kind == "delta":
        Saver(path=str(tmp_path / "base"), parallel=2, hashtables={"emb": t}).save()
        changed = t.ids()[::2]
        t.update(changed, np.ones((len(changed), DIM), np.float32))
    saver = Saver(path=str(tmp_path / kind), parallel=2, hashtables={"emb": t}, incremental=kind == "delta")
    tracemalloc.start()
    try:
        saver.save()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert saver.kind == kind
    # the slice order (about 20 bytes an id) and a MiB of rows per writer; a copy of the rows first is the share
    assert peak < share / 2, f"a save of a {share}-byte share peaked at {peak} bytes of new memory"
    tables = {"emb": HashTable(DIM, slots=("m", "v"))}
    Loader(str(tmp_path / kind), hashtables=tables, tensors={}).load()
    assert tables["emb"] == t


@pytest.mark.parametrize("ranks", [1, 3])
def test_a_direct_save_writes_the_bytes_a_cached_one_does(tmp_path, monkeypatch, ranks):
    from concurrent.futures import ThreadPoolExecutor

    from fastckpt.formats import safetensors
    from fastckpt.sharded.engine import ThreadEngine

    asked = []  # each tensor file's writer: direct or not

    def writer(fd, hasher, writeback, direct):
        asked.append(direct)
        return GatherWriter(fd, hasher, writeback, direct)

    monkeypatch.setattr(safetensors, "GatherWriter", writer)

    t = table(30_000)
    ids = t.ids()
    dense = {"w": np.arange(5000 * 7, dtype=np.float32).reshape(5000, 7)}
    def save(rank, engine, direct):
        mine = ids[ids % ranks == rank]
        part = HashTable.from_export(mine, t.lookup(mine), {s: t.lookup_slot(s, mine) for s in ("m", "v")})
        return Saver(shard_index=rank, shard_num=ranks, parallel=2, path=str(tmp_path / str(direct)),
                     hashtables={"emb": part}, tensors=dense, engine=engine, direct=direct).save()

    for direct in (False, True):
        with ThreadPoolExecutor(ranks) as pool:
            list(pool.map(save, range(ranks), ThreadEngine.group(ranks), [direct] * ranks))
        assert asked == [direct] * 2 * ranks
        asked.clear()
    names = sorted(os.listdir(tmp_path / "False"))
    assert names == sorted(os.listdir(tmp_path / "True")) and len(names) == 2 * ranks + 4
    for name in names:
        assert (tmp_path / "True" / name).read_bytes() == (tmp_path / "False" / name).read_bytes(), name
    with pytest.raises(TypeError, match="direct must be True or False, got 'yes'"):
        Saver(path=str(tmp_path / "x"), direct="yes")
    for where in ({"path": "s3://bucket/ckpt"}, {"path": str(tmp_path / "r"), "layout": "recis"}):
        with pytest.raises(ValueError, match="direct=True writes the tensor files of a local save in fastckpt's"):
            Saver(**where, direct=True)


def test_a_table_already_in_slice_order_is_written_from_its_storage(tmp_path):
    t = table()
    Saver(path=str(tmp_path / "a"), parallel=1, hashtables={"emb": t}).save()
    loaded = {"emb": HashTable(DIM, slots=("m", "v"))}
    Loader(str(tmp_path / "a"), hashtables=loaded, tensors={}).load()  # rows adopted in the file's order
    blocks = Saver(path=str(tmp_path / "b"), hashtables=loaded).blocks()
    assert all(b.rows is None and b.payload() is b.source for b in blocks)
    assert blocks[0].array.tolist() == slice_sorted(t).tolist()


def test_write_blocks_cannot_be_changed_and_gather_once():
    source = np.arange(12, dtype=np.float32).reshape(6, 2)
    block = WriteBlock("t.embedding/part_0_1", "t.embedding", "embedding", source, "t", {}, rows=np.array([5, 0, 3]))
    assert isinstance(block.payload(), TakenRows)
    assert block.array.tolist() == [[10, 11], [0, 1], [6, 7]]
    assert block.array is block.array and block.payload() is block.array  # gathered once, then written as it is
    with pytest.raises(dataclasses.FrozenInstanceError):
        block.key = "other"
    plain = WriteBlock("w/part_0_1", "w", "dense", source, None, {})
    assert plain.array is source and plain.payload() is source and plain.nbytes == 48
    assert "3 of 6 rows" in repr(block)


def _written_rows(path, source, rows, piece_bytes, before=b"head"):
    """What ``GatherWriter.write_rows`` writes after ``before``, and the BLAKE3 it was fed."""
    hasher = blake3.blake3()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        with GatherWriter(fd, hasher) as out:
            out.write(before)  # queued: written first, in order
            out.write_rows(source, np.asarray(rows, np.intp) if isinstance(rows, list) else rows, piece_bytes)
    finally:
        os.close(fd)
    return path.read_bytes(), hasher.hexdigest()


def test_taken_rows_pieces_deprecated_in_0_7_is_gone():
    """0.7 deprecated TakenRows.pieces() (working until 0.8): the writer gathers the rows itself."""
    taken = TakenRows(np.arange(30, dtype=np.int16).reshape(10, 3), np.array([4, 1], np.int64))
    assert not hasattr(taken, "pieces") and np.asarray(taken).tolist() == [[12, 13, 14], [3, 4, 5]]


@pytest.mark.parametrize("rows", [[-1], [10], [0, 2**40]])
def test_taken_rows_refuse_rows_outside_the_source(rows):
    with pytest.raises(IndexError, match=r"rows must be in \[0, 10\)"):
        TakenRows(np.zeros((10, 2)), np.array(rows))


@pytest.mark.parametrize("dtype", ["<f4", "bfloat16"])  # gathered by the writer, and converted first
@pytest.mark.parametrize("rows", [[1, 10], [-1]])
def test_a_write_blocks_rows_are_checked_as_they_are_gathered_not_scanned_first(tmp_path, dtype, rows):
    """A block's payload does not scan its rows (the saver made them: a slice order, shared by the table's blocks);
    a row outside the source still fails the write with an IndexError naming it, and no file is left."""
    import ml_dtypes

    from fastckpt.sharded.format import WriteBlock

    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    block = WriteBlock("t.embedding/part_0_1", "t.embedding", "embedding", np.zeros((10, 2), dt), "t", {},
                       rows=np.array(rows, np.intp))
    payload = block.payload()  # no scan of the rows: a bad one is not found here
    with pytest.raises(IndexError, match="10|-1|out of bounds|outside"):
        save_safetensors(tmp_path / "x.safetensors", {block.key: payload})
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("dtype", ["<f4", ">f4", "int8", "bfloat16"])
@pytest.mark.parametrize("progress", [False, True])
@pytest.mark.parametrize("direct", [False, True])
def test_save_safetensors_writes_taken_rows_as_the_gathered_array(tmp_path, monkeypatch, dtype, progress, direct):
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    source = np.arange(4000).reshape(1000, 4).astype(dt)
    rows = np.random.default_rng(0).permutation(1000)[:700]
    monkeypatch.setattr(TakenRows, "PIECE_BYTES", 1000)  # many pieces
    callback = (lambda done, total, item: None) if progress else False
    save_safetensors(tmp_path / "taken.safetensors", {"a": TakenRows(source, rows), "b": source},
                     progress=callback, direct=direct)
    save_safetensors(tmp_path / "array.safetensors", {"a": source[rows], "b": source})
    assert (tmp_path / "taken.safetensors").read_bytes() == (tmp_path / "array.safetensors").read_bytes()


@pytest.mark.parametrize("source", [np.arange(48, dtype=np.float32).reshape(6, 8)[:, ::2],  # rows strided within
                                    np.zeros((0, 3), np.int64), np.arange(6, dtype=np.int64)])
def test_save_safetensors_writes_taken_rows_of_any_source_as_the_gathered_array(tmp_path, source):
    rows = np.array([5, 0, 2, 2]) if len(source) else np.array([], np.int64)
    save_safetensors(tmp_path / "taken.safetensors", {"a": TakenRows(source, rows)})
    save_safetensors(tmp_path / "array.safetensors", {"a": np.ascontiguousarray(source[rows])})
    assert (tmp_path / "taken.safetensors").read_bytes() == (tmp_path / "array.safetensors").read_bytes()


@pytest.mark.parametrize("writeback", [0, 1, 4096, 1 << 20])
def test_gather_writer_writeback_writes_the_same_bytes(tmp_path, writeback):
    chunks = [np.full(5000 + k, k, np.uint8) for k in range(40)]
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        with GatherWriter(fd, None, writeback) as out:
            for c in chunks:
                out.write(c)
                out.flush()
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(c.tobytes() for c in chunks)


def test_gather_writer_writeback_on_a_pipe_is_left_out():
    read, write = os.pipe()
    try:
        with GatherWriter(write, None, 1) as out:  # sync_file_range refuses a pipe (ESPIPE): no error
            out.write(b"abc")
            out.flush()
            out.write(b"de")
        assert os.read(read, 10) == b"abcde"
    finally:
        os.close(read)
        os.close(write)
    with pytest.raises(ValueError, match="writeback must be 0"):
        GatherWriter(1, None, -1)


@pytest.mark.parametrize("shift", [0, 8, 16, 24])
def test_slice_order_skips_the_digits_every_position_shares(shift):
    # positions that differ in one byte only: the radix sort runs the one pass that tells them apart
    from fastckpt.sharded.format import slice_order

    rng = np.random.default_rng(shift)
    ids = (rng.integers(0, 256, 5000, dtype=np.int64) << shift) + (7 << 32) * rng.integers(-3, 3, 5000)
    order, rows = slice_order(ids, 2**32)
    positions = slice_positions(ids, 2**32)
    assert order.tolist() == np.argsort(positions, kind="stable").tolist() and rows[-1] == 5000


@pytest.mark.parametrize("n", [0, 1, 2, 7, 3000])
@pytest.mark.parametrize("size", [1, 3, 256, 257, 1000, SLICE_SIZE, SLICE_SIZE + 1, 2**24 + 3, 2**31 + 11, 2**32])
@pytest.mark.parametrize("arrangement", ["random", "ascending ids", "slice order"])
def test_slice_order_is_the_stable_sort_by_slice_position(n, size, arrangement):
    # a radix sort of positions of one to four bytes: every slice size a save takes (up to 2**32), a power of two
    # or not, with the rows below each slice group's first position (the id description's slices.rows)
    from fastckpt.sharded.format import group_bounds, slice_groups, slice_order

    rng = np.random.default_rng(n + size)
    ids = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)
    ids[: n // 3] = ids[n // 2: n // 2 + n // 3]  # repeated positions keep their rows' order
    if arrangement == "ascending ids":
        ids = np.sort(ids)
    elif arrangement == "slice order":
        ids = ids[np.argsort(slice_positions(ids, size), kind="stable")]
    positions = slice_positions(ids, size)
    order, rows = slice_order(ids, size)
    expected = np.argsort(positions, kind="stable")
    if order is None:
        assert expected.tolist() == list(range(n))
    else:
        assert order.dtype == np.intp and order.tolist() == expected.tolist()
    assert rows == [int((positions < b).sum()) for b in group_bounds(slice_groups(n), size)]
    if arrangement == "slice order":
        assert order is None


@pytest.mark.parametrize("direct", [False, True])
def test_a_ranks_tensor_files_are_written_in_place_in_the_staging_directory(tmp_path, monkeypatch, direct):
    """Each tensor file is opened once under its own name in the staging directory, fsynced, and never renamed:
    no temporary, rename or sweep of stale temporaries per file (the commit publishes the directory whole). The
    bytes are those of a file saved on its own."""
    import fastckpt.formats.safetensors as safetensors_module

    def atomic_write(*args, **kwargs):
        raise AssertionError(f"a tensor file of a sharded save went through atomic_write: {args[0]}")

    monkeypatch.setattr(safetensors_module, "atomic_write", atomic_write)
    seen = record_staged_writes(monkeypatch)
    t = table()
    out = Saver(path=str(tmp_path / "ckpt"), parallel=2, hashtables={"emb": t}, tensors={"w": np.eye(3)},
                direct=direct).save()
    names = ["model-00000-000.safetensors", "model-00000-001.safetensors"]
    assert sorted(n for n in seen.opened if n.startswith("model-")) == names
    assert all(seen.synced.count(n) == 1 for n in names), seen.synced
    assert [Path(dst).name for _src, dst in seen.renamed] == ["ckpt"]  # the staging directory, published whole
    monkeypatch.undo()
    blocks = {b.key: b for b in Saver(path=".", parallel=2, hashtables={"emb": t}, tensors={"w": np.eye(3)}).blocks()}
    import json

    index = json.loads((Path(out) / "index.json").read_text())
    for k, name in enumerate(names):
        keys = sorted(key for key, at in index["block_index"].items() if at == k)
        save_safetensors(tmp_path / name, {key: blocks[key].payload() for key in keys}, {"fastckpt.format":
                                                                                         "fastckpt.sharded"})
        assert (Path(out) / name).read_bytes() == (tmp_path / name).read_bytes()


def test_a_staged_file_is_removed_where_its_writing_fails(tmp_path):
    from fastckpt.store.commit import staged_file

    with pytest.raises(RuntimeError, match="half"):
        with staged_file(tmp_path / "t.bin") as f:
            f.write(b"half")
            raise RuntimeError("half written")
    assert list(tmp_path.iterdir()) == []
    import errno

    with pytest.raises(OSError, match="No space left") as raised:
        with staged_file(tmp_path / "full.bin") as f:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a GatherWriter's write raises it
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(tmp_path / "full.bin")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "there").write_bytes(b"x")
    with pytest.raises(FileExistsError):
        with staged_file(tmp_path / "there"):
            pass
    assert (tmp_path / "there").read_bytes() == b"x"
