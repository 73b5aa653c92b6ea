"""The load path's shortcuts keep every check: metadata read again in one process, the slice-order check of a
version-4 part, and one rank reading every id part into place."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

from fastckpt.errors import ChecksumMismatchError
from fastckpt.sharded import HashTable, Loader, Saver
from fastckpt.sharded.format import DESCRIPTION_FILE, SliceRowError, group_bounds, read_metadata, slice_run

from _threads import run_in_threads


def _state(n_ids: int = 3000):
    rng = np.random.default_rng(3)
    ids = rng.choice(np.arange(-10**6, 10**6), n_ids, replace=False)
    return ids, rng.random((n_ids, 4), dtype=np.float32), rng.random((n_ids, 4), dtype=np.float32)


def _save(tmp_path) -> str:
    ids, values, m = _state()
    table = HashTable(4, slots=("m",))
    table.insert(ids, values, {"m": m})
    out = str(tmp_path / "c")
    Saver(path=out, parallel=2, hashtables={"emb": table}, tensors={"w": np.arange(12.0).reshape(4, 3)}).save()
    return out


def _flip_a_bit(path: str) -> None:
    """One bit of the file's middle byte flipped in place (its size unchanged)."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[len(data) // 2] ^= 0x01
    with open(path, "wb") as f:
        f.write(bytes(data))

def test_metadata_read_again_is_equal_and_new_and_a_damaged_file_is_still_refused(tmp_path):
    out = _save(tmp_path)
    first = read_metadata(out)
    second = read_metadata(out)  # the same bytes: parsed anew, the checks skipped
    assert second == first
    assert second["descriptions"] is not first["descriptions"]
    second["descriptions"].clear()  # the caller's own objects: a later reading is not changed by it
    assert read_metadata(out) == first
    _flip_a_bit(f"{out}/{DESCRIPTION_FILE}")
    with pytest.raises(ChecksumMismatchError, match=DESCRIPTION_FILE):
        read_metadata(out)



def test_a_load_resolving_a_checked_head_reads_its_manifest_alone_and_its_reader_still_refuses_damage(tmp_path,
                                                                                                      monkeypatch):
    """Each rank resolves the chain and then opens the head: where this process checked the manifest's bytes, the
    chain reads manifest.json alone and the reader reads and checks the four files, so a metadata file damaged
    since is refused by the load all the same, naming it."""
    from fastckpt.sharded.chain import resolve_chain
    from fastckpt.store.snapshot import Snapshot

    out = _save(tmp_path)
    read_metadata(out)  # checked once in this process
    reads: list[str] = []
    real_read = Snapshot.read

    def counted(self, name, *args, **kwargs):
        reads.append(name)
        return real_read(self, name, *args, **kwargs)

    monkeypatch.setattr(Snapshot, "read", counted)
    assert resolve_chain(out, opening=True) == resolve_chain(out)
    assert reads == ["manifest.json"] + ["manifest.json", "index.json", "tensorkey.json", DESCRIPTION_FILE]
    _flip_a_bit(f"{out}/{DESCRIPTION_FILE}")
    assert resolve_chain(out, opening=True)[0][0] == out  # the manifest alone: unchanged
    with pytest.raises(ChecksumMismatchError, match=DESCRIPTION_FILE):
        Loader(out, hashtables={"emb": HashTable(4, slots=("m",))}, verify=False).load()


def test_a_checked_head_replaced_while_its_manifest_alone_is_read_is_changed(tmp_path, monkeypatch):
    """The manifest alone read of a head this process checked still says the directory was replaced under it (a
    save with overwrite=True), as the read of the next metadata file did, whatever the replacement holds."""
    import os
    import shutil

    from fastckpt.errors import CheckpointChangedError
    from fastckpt.sharded.chain import resolve_chain
    from fastckpt.store.snapshot import Snapshot

    out = _save(tmp_path)
    read_metadata(out)  # checked once in this process
    real_read = Snapshot.read

    def read_then_replace(self, name, *args, **kwargs):
        data = real_read(self, name, *args, **kwargs)
        shutil.copytree(out, out + ".new")  # once the manifest is read, a save with overwrite=True swaps it
        os.rename(out, out + ".old")
        os.rename(out + ".new", out)
        monkeypatch.setattr(Snapshot, "read", real_read)
        return data

    monkeypatch.setattr(Snapshot, "read", read_then_replace)
    with pytest.raises(CheckpointChangedError, match="manifest.json: .* is another directory now; the checkpoint "
                                                     "changed while it was opened"):
        resolve_chain(out, opening=True)
    assert resolve_chain(out, opening=True)[0][0] == out  # the directory as it is now


def test_an_adopted_table_whose_ids_stop_ascending_past_the_first_stretch_lists_them_sorted():
    """Whether a table's ids ascend is decided a stretch at a time: ids out of order only far in are still seen."""
    for where in (1, 4095, 4096, 4097, 20480, 20481, 29999):
        ids = np.arange(30000, dtype=np.int64) * 2
        ids[where], ids[where - 1] = ids[where - 1], ids[where]
        table = HashTable(1)
        table.adopt(ids, np.arange(30000, dtype=np.float32)[:, None])
        assert np.array_equal(table.ids(), np.sort(ids)), where
        assert np.array_equal(table.export()[0], np.sort(ids)), where
    table = HashTable(1)
    table.adopt(np.arange(30000, dtype=np.int64), np.zeros((30000, 1), np.float32))
    assert np.array_equal(table.ids(), np.arange(30000))


@pytest.mark.parametrize("parallel", [1, 2, 16])
def test_a_load_runs_its_largest_job_on_the_calling_thread_and_is_exact_on_any_parallel(tmp_path, parallel):
    """The rank's own thread loads the table (parallel 1: every job), the kept threads the rest; the result is
    the same, and an error of the job run here is the load's error."""
    out = _save(tmp_path)
    ids, values, m = _state()
    table = HashTable(4, slots=("m",))
    tensors: dict = {}
    Loader(out, hashtables={"emb": table}, tensors=tensors, parallel=parallel).load()
    order = np.argsort(ids)
    assert np.array_equal(table.ids(), ids[order])
    assert np.array_equal(table.lookup(ids), values) and np.array_equal(table.lookup_slot("m", ids), m)
    assert np.array_equal(tensors["w"], np.arange(12.0).reshape(4, 3))
    given = HashTable(3, slots=("m",))  # not the checkpoint's dim: the table's job raises
    given.insert([1], [[9.0] * 3], {"m": [[9.0] * 3]})
    with pytest.raises(ValueError, match="hashtable 'emb' is dim 4 float32 in the checkpoint, the table given is "
                                         "dim 3 float32"):
        Loader(out, hashtables={"emb": given}, tensors={}, parallel=parallel).load()
    assert given.ids().tolist() == [1]  # a failed load leaves the table as it was

def _slow_run(ids, first_row, rows, size, own):
    """slice_run row by row, as it ran before its one-pass check."""
    from fastckpt.sharded.format import slice_positions

    positions = slice_positions(ids, size)
    bounds = np.array(group_bounds(len(rows) - 1, size), np.uint64)
    where = np.arange(first_row, first_row + len(ids))
    recorded = np.searchsorted(np.asarray(rows), where, side="right") - 1
    actual = np.searchsorted(bounds, positions, side="right") - 1
    bad = np.flatnonzero((recorded != actual) | np.concatenate([[False], positions[1:] < positions[:-1]]))
    if len(bad):
        return ("bad", first_row + int(bad[0]))
    return (first_row + int(np.searchsorted(positions, np.uint64(own[0]))),
            first_row + int(np.searchsorted(positions, np.uint64(own[1]))))


def test_slice_run_names_the_same_first_row_out_of_place_as_a_row_by_row_check():
    rng = np.random.default_rng(5)
    size = 64
    for _ in range(3000):
        groups = int(rng.integers(1, 6))
        n = int(rng.integers(0, 40))
        ids = np.sort(rng.integers(0, size, n)).astype(np.int64)
        bounds = group_bounds(groups, size)
        rows = [int(np.searchsorted(ids, b)) for b in bounds[:-1]] + [n]
        kind = rng.integers(0, 4)
        if kind == 1 and n:  # an id moved
            ids[rng.integers(0, n)] = rng.integers(0, size)
        elif kind == 2 and groups > 1:  # an offset moved
            g = int(rng.integers(1, groups))
            rows[g] = int(np.clip(rows[g] + rng.integers(-3, 4), rows[g - 1], rows[g + 1]))
        elif kind == 3 and n > 1:  # two rows swapped
            a, b = rng.integers(0, n, 2)
            ids[[a, b]] = ids[[b, a]]
        first = int(rng.integers(0, groups))
        last = int(rng.integers(first + 1, groups + 1))
        r0, r1 = rows[first], rows[last]
        own = tuple(sorted(int(x) for x in rng.integers(0, size + 1, 2)))
        want = _slow_run(ids[r0:r1], r0, rows, size, own)
        try:
            got = slice_run(ids[r0:r1], r0, rows, size, own)
        except SliceRowError as exc:
            got = ("bad", exc.row)
        assert got == want, (ids.tolist(), rows, first, last, own)


@pytest.mark.parametrize("shards", [1, 2])
def test_one_rank_reads_every_id_part_into_place_exactly(tmp_path, shards):
    out = _save(tmp_path)
    ids, values, m = _state()
    order = np.argsort(ids)
    got = []
    for j in range(shards):
        table = Loader(out, verify=False, shard_index=j, shard_num=shards).load()[0]["emb"]
        mine = table.ids()
        at = order[np.searchsorted(ids[order], mine)]
        assert np.array_equal(ids[at], mine)
        assert np.array_equal(table.lookup(mine), values[at])
        assert np.array_equal(table.lookup_slot("m", mine), m[at])
        got.append(mine)
    assert np.array_equal(np.sort(np.concatenate(got)), np.sort(ids))


def _url_checkpoint(n_ids: int = 3000, **tensors) -> str:
    """The state of :func:`_state` saved to a new in-memory URL (parallel 2)."""
    import uuid

    url = f"memory://fastckpt-tests/{uuid.uuid4().hex}/c"
    ids, values, m_slot = _state(n_ids)
    table = HashTable(4, slots=("m",))
    table.insert(ids, values, {"m": m_slot})
    Saver(path=url, parallel=2, hashtables={"emb": table}, tensors=tensors).save()
    return url


def _check_exact(tables: list, n_ids: int = 3000) -> None:
    """The ranks' tables hold every id of :func:`_state` once, each with its rows."""
    ids, values, m_slot = _state(n_ids)
    order = np.argsort(ids)
    assert np.array_equal(np.sort(np.concatenate([t.ids() for t in tables])), np.sort(ids))
    for t in tables:
        at = order[np.searchsorted(ids[order], t.ids())]
        assert np.array_equal(t.lookup(t.ids()), values[at])
        assert np.array_equal(t.lookup_slot("m", t.ids()), m_slot[at])


def _ranks_as_threads(url: str, m: int, **options) -> list:
    from concurrent.futures import ThreadPoolExecutor

    def load(j: int):
        return Loader(url, shard_index=j, shard_num=m, verify=False, **options).load()[0]["emb"]

    with ThreadPoolExecutor(m) as pool:
        return list(pool.map(load, range(m)))


def _hold_until_every_rank_asked(monkeypatch, m: int, fail_first: bool = False) -> tuple[list, list]:
    """Patch a load's first round (the manifest and the metadata, :func:`fastckpt.sharded.remote._first_round`) and
    its fetches of tensor-file headers (ranges from byte 0, alone or joined to a part's range): the load that
    fetches the metadata, and each that fetches headers, waits until ``m`` loads hold them (so that they overlap for
    certain); returns the names each first round asked for and, for each fetch of headers, ``[(file, end of the
    range from byte 0)]`` (the first metadata fetch failing, if asked)."""
    import time

    from fastckpt.formats.stream import merged
    from fastckpt.sharded import remote as sharded_remote

    real_bounded, real_fetch = sharded_remote._bounded, sharded_remote._Share.fetch
    rounds: list = []
    heads: list = []
    held: set = set()

    def wait(held) -> None:
        deadline = time.monotonic() + 20
        while not held() and time.monotonic() < deadline:
            time.sleep(0.005)

    def bounded(fs, url, path, names):
        rounds.append(sorted(names))
        if len(names) > 1:  # the metadata, for every load of the URL asking meanwhile
            wait(lambda: sharded_remote._metadata.holders(url) >= m)
            if fail_first and sum(len(r) > 1 for r in rounds) == 1:
                raise OSError("the first fetch fails")
        return real_bounded(fs, url, path, names)

    def fetch(self, spans):
        names = sorted(name for name, ranges in spans.items() if name.endswith(".safetensors")
                       and any(b == 0 < e for b, e in ranges))
        if names:
            heads.append([(name, merged(spans[name])[0][1]) for name in names])
            if not fail_first:  # (where the metadata fetch fails, that load asks for no header)
                wait(lambda: all(n in held or sharded_remote._heads.holders((self.url, self.manifest_hash, n)) >= m
                                 for n in names))
                held.update(names)  # every load held them: a load fetching one later need not wait
        return real_fetch(self, spans)

    monkeypatch.setattr(sharded_remote, "_bounded", bounded)
    monkeypatch.setattr(sharded_remote._Share, "fetch", fetch)
    return rounds, heads


@pytest.mark.parametrize("n_ids", [3000, 60000])
def test_ranks_loading_from_a_url_at_once_fetch_its_metadata_and_headers_once(monkeypatch, n_ids):
    import fsspec

    url = _url_checkpoint(n_ids, w=np.ones((4, 3)))
    rounds, heads = _hold_until_every_rank_asked(monkeypatch, 3)
    tables = _ranks_as_threads(url, 3)
    # one fetch of the metadata for the three ranks, in the round of its own manifest; each rank its own manifest
    assert sorted(rounds) == [sorted([DESCRIPTION_FILE, "index.json", "manifest.json", "tensorkey.json"]),
                              ["manifest.json"], ["manifest.json"]]
    # Every rank reads both tensor files (one rank saved them), in one round with their headers. A rank whose
    # first range of a file starts within 64 KiB of the header's end has the header with that range (no request
    # more); of the others, one fetches it alone and the rest take its bytes: a header is fetched alone once
    # between the three at most.
    fs = fsspec.filesystem("memory")
    first = {}
    for name in ("model-00000-000.safetensors", "model-00000-001.safetensors"):
        data = fs.cat_file(f"{url.removeprefix('memory://')}/{name}")
        first[name] = 8 + int.from_bytes(data[:8], "little")
    assert len(heads) <= 3 and all(end >= first[name] for fetch in heads for name, end in fetch), heads
    alone = [name for fetch in heads for name, end in fetch if end == first[name]]
    fetches = {name: sum(n == name for fetch in heads for n, _ in fetch) for name in first}
    assert all(alone.count(name) <= 1 and fetches[name] >= 1 for name in first), heads
    if n_ids == 3000:  # every rank's first range of each file starts near the header: each has it with that range
        assert alone == [] and set(fetches.values()) == {3}, heads
    else:  # some rank's first range of file 0 starts far past the header: it takes another's bytes
        assert fetches["model-00000-000.safetensors"] < 3, heads
    _check_exact(tables, n_ids)
    # the shared fetches are gone once the loads are done: a later load fetches for itself
    from fastckpt.sharded import remote as sharded_remote

    assert not sharded_remote._heads and not sharded_remote._metadata


def test_when_the_shared_fetch_fails_that_load_raises_and_the_others_fetch_again(monkeypatch):
    url = _url_checkpoint()
    rounds, _ = _hold_until_every_rank_asked(monkeypatch, 2, fail_first=True)
    with pytest.raises(OSError, match="the first fetch fails"):
        _ranks_as_threads(url, 2)
    assert len(rounds) == 2  # the other rank fetched the metadata on its own, and loaded
    assert [len(t.ids()) for t in _ranks_as_threads(url, 2)] != []


def test_verified_ranks_loading_from_a_url_at_once_fetch_each_whole_file_once(monkeypatch):
    import time
    from fastckpt.sharded import remote as sharded_remote

    url = _url_checkpoint()
    fetched: list = []
    real_fetch = sharded_remote._Share.fetch

    def fetch(self, spans):
        whole = [name for name, ranges in spans.items() if ranges == [(0, self.sizes[name])]
                 and name.endswith(".safetensors")]
        fetched.extend(whole)
        deadline = time.monotonic() + 20  # a whole-file fetch waits until the three loads hold the files: they
        while whole and time.monotonic() < deadline and any(  # overlap for certain
                sharded_remote._wholes.holders((self.url, self.manifest_hash, name)) < 3 for name in whole):
            time.sleep(0.005)
        return real_fetch(self, spans)

    monkeypatch.setattr(sharded_remote._Share, "fetch", fetch)
    from fastckpt.sharded import reader as sharded_reader

    hashed: list = []
    real_digest = sharded_reader._digests.once

    def shared_digest(identity, compute):
        def counted():
            hashed.append(identity[:2])  # (device, inode): one file, by whichever of its links it is read
            return compute()
        return real_digest(identity, counted)

    monkeypatch.setattr(sharded_reader._digests, "once", shared_digest)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:
        tables = list(pool.map(lambda j: Loader(url, shard_index=j, shard_num=3).load()[0]["emb"], range(3)))
    assert sorted(fetched) == sorted(set(fetched)) and fetched  # each tensor file fetched whole once
    # ... and hashed once between the three loads: the links were made before any of them opened the file (a link
    # changes the file's ctime, part of the identity its hash is shared by)
    assert sorted(hashed) == sorted(set(hashed)) and len(hashed) == len(fetched)
    _check_exact(tables)
    assert not sharded_remote._wholes


@pytest.mark.parametrize("saved", [2, 4])
def test_ranks_read_their_slice_groups_ids_into_place_exactly_on_any_count(tmp_path, saved):
    """Ranks loading by the slice rule read the ids of their slice groups into the table's own array, check them and
    keep those of their slice: exact on 1, 3 and 4 ranks, where 3 ranks' slices end inside groups (the ids of a
    group's other end dropped), into a given table, rows of a shape and a slot of its own dtype read as runs."""
    from _sharded_edit import save_threads

    from fastckpt.sharded.format import slice_of

    ids, values, m = _state(20_000)
    values = values.reshape(-1, 2, 2)  # rows of a shape, and a slot of its own shape and dtype (version 5)
    steps = (ids % 1000).astype(np.int64)[:, None]
    slots = ("m", ("step", 1, np.int64))
    tables = []
    for r in range(saved):
        mine = np.flatnonzero(np.arange(len(ids)) % saved == r)
        t = HashTable((2, 2), slots=slots, name="emb")
        t.insert(ids[mine], values[mine], {"m": m[mine].reshape(-1, 2, 2), "step": steps[mine]})
        tables.append({"emb": t})
    out = save_threads(tmp_path / "c", tables, {}, 2)
    from fastckpt.sharded.reader import CheckpointReader

    with CheckpointReader(out) as r:
        groups = {len(r.descriptions[k]["slices"]["rows"]) - 1 for k in r.part_names("emb.id")}
    assert all(b not in group_bounds(g, 65536) for g in groups for b in slice_of(1, 3, 65536))  # 3 ranks cut groups
    for shards in (1, 3, 4):
        got = []
        for j in range(shards):
            given = {"emb": HashTable((2, 2), slots=slots)}
            given["emb"].insert([123456789], np.ones((1, 2, 2), np.float32))  # replaced by the load
            table = Loader(out, hashtables=given, verify=False, shard_index=j, shard_num=shards).load()[0]["emb"]
            assert table is given["emb"]
            mine = table.ids()
            order = np.argsort(ids)
            at = order[np.searchsorted(ids[order], mine)]
            assert np.array_equal(ids[at], mine)
            assert np.array_equal(table.lookup(mine), values[at])
            assert np.array_equal(table.lookup_slot("m", mine), m[at].reshape(-1, 2, 2))
            assert np.array_equal(table.lookup_slot("step", mine), steps[at])
            got.append(mine)
        assert np.array_equal(np.sort(np.concatenate(got)), np.sort(ids))


def _count_opens(monkeypatch) -> list:
    """Every CheckpointReader opened from here on (the paths, as they open)."""
    from fastckpt.sharded import reader as reader_module

    opened: list = []
    real_open = reader_module.CheckpointReader._open

    def counted(self, *args, **kwargs):
        opened.append(self.path)
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(reader_module.CheckpointReader, "_open", counted)
    return opened


def test_ranks_loading_at_once_open_the_checkpoint_once_and_the_last_closes_it(tmp_path, monkeypatch):
    """Ranks as threads that load one checkpoint at the same time share one reader (its files opened and their
    headers parsed once); the last to finish closes it; a load after that opens it anew; exact on every rank."""
    from fastckpt.sharded import loader as loader_module

    out = _save(tmp_path)
    opened = _count_opens(monkeypatch)
    at_once = threading.Barrier(4)
    readers: list = []
    real_reader_for = loader_module._reader_for

    @contextlib.contextmanager
    def held_together(path, manifest):
        with real_reader_for(path, manifest) as reader:
            readers.append(reader)
            at_once.wait(30)  # every rank holds its reader before any lets go
            yield reader

    monkeypatch.setattr(loader_module, "_reader_for", held_together)
    tables = _ranks_as_threads(out, 4)
    _check_exact(tables)
    assert len(opened) == 1 and len({id(r) for r in readers}) == 1
    assert readers[0].closed
    monkeypatch.setattr(loader_module, "_reader_for", real_reader_for)
    _check_exact(_ranks_as_threads(out, 2))
    assert len(opened) >= 2  # opened again once the first four had let go


def test_a_checkpoint_replaced_while_another_load_holds_it_open_is_read_as_it_is_now(tmp_path):
    """A load holding a reader of the old commit does not lend it to a load of the new one (another manifest)."""
    from fastckpt.sharded import loader as loader_module
    from fastckpt.sharded.chain import resolve_chain

    out = _save(tmp_path)
    ((_, old_manifest),) = resolve_chain(out)
    with loader_module._reader_for(out, old_manifest) as old_reader:
        table = HashTable(4, slots=("m",))
        table.insert([5, 6], np.full((2, 4), 7, np.float32), {"m": np.zeros((2, 4), np.float32)})
        Saver(path=out, parallel=1, hashtables={"emb": table}, overwrite=True).save()
        got = Loader(out, verify=True).load()[0]["emb"]
        assert got.ids().tolist() == [5, 6] and (got.lookup([5, 6]) == 7).all()
        assert not old_reader.closed and old_reader.manifest == old_manifest
    assert old_reader.closed


def test_a_shared_open_that_fails_fails_every_load_with_its_own_error(tmp_path, monkeypatch):
    import os

    out = _save(tmp_path)
    name = min(n for n in os.listdir(out) if n.endswith(".safetensors"))
    with open(os.path.join(out, name), "r+b") as f:
        f.truncate(100)  # the size the manifest lists no more
    with pytest.raises(Exception) as first:
        Loader(out, verify=False).load()
    errors = run_in_threads(lambda j: Loader(out, verify=False, shard_index=j, shard_num=3).load(), 3, timeout=60)
    assert len(errors) == 3 and all(type(e) is type(first.value) and name in str(e) for e in errors)
