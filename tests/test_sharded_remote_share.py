"""A sharded load from a URL fetches only the loading rank's share (fastckpt.sharded.remote.fetch_share)."""

from __future__ import annotations

import os
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from fastckpt.formats import remote
from fastckpt.sharded import HashTable, Loader, Saver
from fastckpt.sharded import remote as sharded_remote
from fastckpt.sharded.engine import ThreadEngine
from fastckpt.sharded.format import SLICE_SIZE, owner_mod, slice_of, slice_positions

ROWS, DIM = 8000, 64


def _save(url, n, options=None, **kw):
    rng = np.random.default_rng(3)
    ids = rng.choice(10**9, ROWS, replace=False).astype(np.int64)
    values = rng.standard_normal((ROWS, DIM)).astype(np.float32)

    def save(engine):
        mine = np.flatnonzero(ids % n == engine.rank)
        table = HashTable(DIM, slots=("m",))
        table.insert(ids[mine], values[mine], {"m": -values[mine]})
        Saver(engine.rank, n, 2, url, hashtables={"emb": table}, tensors={"w": np.arange(12.0).reshape(6, 2)},
              engine=engine, storage_options=options, **kw).save()

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(save, ThreadEngine.group(n)))
    return ids, values


def _check(url, ids, values, m, options=None, dense="replicated", verify=True):
    row = {int(i): r for r, i in enumerate(ids)}
    seen = []
    for j in range(m):
        tables, tensors = Loader(url, shard_index=j, shard_num=m, storage_options=options, dense=dense,
                                 verify=verify).load()
        got = tables["emb"].ids()
        begin, end = slice_of(j, m)  # format version 4's rule: the rank's key-space slices
        assert ((slice_positions(got, SLICE_SIZE) >= begin) & (slice_positions(got, SLICE_SIZE) < end)).all()
        rows = [row[int(i)] for i in got]
        assert np.array_equal(tables["emb"].lookup(got), values[rows])
        assert np.array_equal(tables["emb"].lookup_slot("m", got), -values[rows])
        lo, hi = (0, 6) if dense == "replicated" else (j * 6 // m, (j + 1) * 6 // m)
        assert np.array_equal(tensors["w"], np.arange(12.0).reshape(6, 2)[lo:hi])
        seen.append(got)
    assert sorted(np.concatenate(seen).tolist()) == sorted(ids.tolist())


def _total(url, options=None) -> int:
    fs, path = remote.filesystem(url, options)
    return sum(int(e["size"]) for e in fs.find(path, detail=True).values())


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_every_rank_loads_exactly_from_its_share(m):
    url = f"memory://share-{uuid.uuid4().hex[:8]}/ckpt"
    ids, values = _save(url, 4)
    _check(url, ids, values, m)  # verified: whole files, each checked against the manifest
    _check(url, ids, values, m, verify=False)  # this rank's share alone
    _check(url, ids, values, m, dense="rows", verify=False)


def test_a_verified_load_fetches_whole_files_which_the_manifest_hashes(tmp_path):
    url = f"memory://share-{uuid.uuid4().hex[:8]}/ckpt"
    _save(url, 2)
    # another owner rule reads every part: the whole prefix
    assert sharded_remote.fetch_share(Loader(url, shard_index=0, shard_num=2, owner=owner_mod), str(tmp_path)) is False
    # format version 4 by its slice rule: the files whose parts the rank reads, whole (here every rank's: the ranks
    # saved by id mod 2, so every part holds ids of every slice)
    got = sharded_remote.fetch_share(Loader(url, shard_index=0, shard_num=2), str(tmp_path))
    # and nothing else: index.json names the files, so no header is fetched before the files themselves
    assert got["bytes"] == _total(url)
    got = sharded_remote.fetch_share(Loader(url, shard_index=0, shard_num=2, verify=False), str(tmp_path))
    assert got["layout"] == "fastckpt" and got["manifest"]


def test_a_rank_of_4_fetches_about_a_quarter(tmp_path):
    url = f"memory://share-{uuid.uuid4().hex[:8]}/ckpt"
    _save(url, 4)
    total = _total(url)
    for j in range(4):
        local = tmp_path / str(j)
        local.mkdir()
        got = sharded_remote.fetch_share(Loader(url, shard_index=j, shard_num=4, verify=False), str(local))
        # its quarter of the rows (its slices), a few more ids (of the groups at its slice's ends), the metadata
        assert 0.2 * total < got["bytes"] < 0.3 * total, (got, total)
        assert sum(os.path.getsize(p) for p in local.iterdir()) == total  # sparse files of the full size


def test_encoded_checkpoints_are_fetched_whole(tmp_path):
    url = f"memory://share-{uuid.uuid4().hex[:8]}/ckpt"
    ids, values = _save(url, 2, compression="zstd")
    assert sharded_remote.fetch_share(Loader(url, shard_index=0, shard_num=2), str(tmp_path)) is False
    _check(url, ids, values, 3)


def test_on_s3_a_rank_of_4_fetches_its_share(s3, tmp_path):
    url = s3.url("sharded")
    ids, values = _save(url, 4, s3.storage_options)
    _check(url, ids, values, 4, s3.storage_options)
    _check(url, ids, values, 4, s3.storage_options, verify=False)
    got = sharded_remote.fetch_share(Loader(url, shard_index=1, shard_num=4, storage_options=s3.storage_options,
                                            verify=False), str(tmp_path))
    assert got["bytes"] < 0.33 * _total(url, s3.storage_options)


def test_recis_layouts_at_a_url_load_and_say_once_that_nothing_is_checked(tmp_path):
    import _recis_writer as recis_port

    url = f"memory://share-{uuid.uuid4().hex[:8]}/recis"
    local = tmp_path / "recis"
    ids = np.arange(50, dtype=np.int64)
    recis_port.write_checkpoint(str(local), [{"t": (ids, [("embedding", np.ones((50, 2), np.float32))],
                                                    recis_port.gen_slice(0, 1))}], {"w": np.ones(3)}, 2)
    remote.put_directory(local, url, "index")
    with pytest.warns(Warning) as said:
        loaded = [Loader(url, shard_index=j, shard_num=2).load() for j in range(2)]
    assert [str(w.message) for w in said] == [f"{url}: RecIS checkpoint: no integrity record (no manifest.json: "
                                              "loaded without checking its bytes)"]  # once, naming the URL
    # ids 0..49 lie in rank 0's slice [0, 32768) of 65536: RecIS's rule gives rank 1 none
    assert [sorted(t["t"].ids().tolist()) for t, _ in loaded] == [list(range(50)), []]
    assert all(np.array_equal(d["w"], np.ones(3)) for _, d in loaded)
    ours = f"memory://share-{uuid.uuid4().hex[:8]}/ours"
    saved = tmp_path / "ours"
    table = HashTable(2)
    table.insert(ids, np.ones((50, 2), np.float32))
    Saver(path=str(saved), parallel=1, hashtables={"t": table}, layout="recis").save()
    remote.put_directory(saved, ours)
    assert sorted(Loader(ours).load()[0]["t"].ids().tolist()) == list(range(50))


@pytest.mark.parametrize("m", [2, 4])
def test_a_recis_checkpoint_at_a_url_is_fetched_by_the_slice_rule(tmp_path, m):
    import warnings

    import _recis_writer as recis_port
    from fastckpt.sharded.recis import RecisWarning, gen_slice, slice_owner

    rng = np.random.default_rng(5)
    ids = rng.choice(10**9, ROWS, replace=False).astype(np.int64)
    values = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    owner = slice_owner(ids, 4)
    ranks = [{"t": (ids[owner == i], [("embedding", values[owner == i]), ("m", -values[owner == i])],
                    recis_port.gen_slice(i, 4))} for i in range(4)]
    local = tmp_path / "recis"
    recis_port.write_checkpoint(str(local), ranks, {"w": np.arange(6.0).reshape(3, 2)}, 2)
    url = f"memory://share-{uuid.uuid4().hex[:8]}/recis"
    remote.put_directory(local, url, "index")
    total, row = _total(url), {int(i): r for r, i in enumerate(ids)}
    seen = []
    for j in range(m):
        where = tmp_path / f"share-{j}"
        where.mkdir()
        share = sharded_remote.fetch_share(Loader(url, shard_index=j, shard_num=m), str(where))
        assert share["layout"] == "recis" and not share["manifest"]
        assert share["bytes"] < (1 / m + 0.05) * total, (share, total)  # parts of other slices are never read
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecisWarning)
            tables, tensors = Loader(url, shard_index=j, shard_num=m).load()
        got = tables["t"].ids()
        begin, end, size = gen_slice(j, m)
        pos = got.view(np.uint64) % np.uint64(size)
        assert ((pos >= begin) & (pos < end)).all()
        assert np.array_equal(tables["t"].lookup_slot("m", got), -values[[row[int(i)] for i in got]])
        assert np.array_equal(tensors["w"], np.arange(6.0).reshape(3, 2))
        seen.append(got)
    assert sorted(np.concatenate(seen).tolist()) == sorted(ids.tolist())


def test_a_hostile_json_file_of_a_share_is_a_format_error_naming_it(tmp_path):
    # The share's JSON (the manifest, the descriptions, each part's safetensors header) was read with a plain
    # json.loads: a 100,000-deep one raised RecursionError. It is read through fastckpt.store.manifest now.
    from fastckpt.errors import FormatError
    from fastckpt.sharded.format import DESCRIPTION_FILE, MANIFEST_FILE

    url = f"memory://share-{uuid.uuid4().hex[:8]}/ckpt"
    _save(url, 2)
    fs, path = remote.filesystem(url)
    deep = b"[" * 100_000 + b"]" * 100_000
    part = sorted(p.rsplit("/", 1)[1] for p in fs.find(path) if p.endswith(".safetensors"))[0]
    original = fs.cat_file(f"{path}/{part}")
    half = (len(original) - 8) // 2  # a header as long as the file was: the size the manifest lists
    deep_header = (2 * half).to_bytes(8, "little") + b"[" * half + b"]" * half + b" " * (len(original) - 8 - 2 * half)
    for name, data, match in [
        (MANIFEST_FILE, deep, "nested deeper than 64 levels"),
        (DESCRIPTION_FILE, deep, "nested deeper than 64 levels"),
        (part, deep_header, "its safetensors header is not JSON|nested deeper"),
        (part, (2**40).to_bytes(8, "little") + original[8:], "larger than the safetensors limit"),
    ]:
        before = fs.cat_file(f"{path}/{name}")
        fs.pipe_file(f"{path}/{name}", data)
        local = tmp_path / uuid.uuid4().hex[:8]
        local.mkdir()
        with pytest.raises(FormatError, match=match) as err:
            sharded_remote.fetch_share(Loader(url, shard_index=0, shard_num=2, verify=False), str(local))
        assert f"{url}/{name}" in str(err.value)
        fs.pipe_file(f"{path}/{name}", before)


@pytest.mark.parametrize("n,m", [(1, 4), (2, 3), (4, 3)])
def test_a_rank_taking_dense_rows_fetches_those_rows_only(n, m, monkeypatch):
    # dense="rows": a rank of M takes rows_of(j, M) of each dense tensor; the Loader reads only those rows of the
    # parts that hold them, and the fetch asked for every such part whole (1 -> 4: each rank fetched the whole
    # tensor). Now the bytes fetched of a dense part are its rows the rank takes, and the load is exact.
    import json

    from fastckpt.sharded.format import DESCRIPTION_FILE, rows_of

    url = f"memory://share-{uuid.uuid4().hex[:8]}/ckpt"
    rng = np.random.default_rng(11)
    ids = rng.choice(10**9, ROWS, replace=False).astype(np.int64)
    values = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    big = rng.standard_normal((4001, 64))  # rows of 512 bytes, not a multiple of any rank count

    def save(engine):
        mine = np.flatnonzero(slice_positions(ids, SLICE_SIZE) * n // SLICE_SIZE == engine.rank)
        table = HashTable(DIM, slots=("m",))
        table.insert(ids[mine], values[mine], {"m": -values[mine]})
        Saver(engine.rank, n, 2, url, hashtables={"emb": table}, tensors={"big": big}, engine=engine).save()

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(save, ThreadEngine.group(n)))
    fs, path = remote.filesystem(url)
    parts = {}  # file -> (begin, end, first row) of each part of "big"
    descriptions = json.loads(fs.cat_file(f"{path}/{DESCRIPTION_FILE}"))
    for name in fs.ls(path, detail=False):
        if name.endswith(".safetensors"):
            head = fs.cat_file(name, start=0, end=8)
            length = int.from_bytes(head, "little")
            header = json.loads(fs.cat_file(name, start=8, end=8 + length))
            for key, entry in header.items():
                if key != "__metadata__" and descriptions[key].get("tensor") == "big":
                    begin, end = entry["data_offsets"]
                    parts.setdefault(name.rsplit("/", 1)[1], []).append(
                        (8 + length + begin, 8 + length + end, descriptions[key]["row_start"], entry["shape"][0]))
    assert sum(p[3] for ps in parts.values() for p in ps) == 4001
    fetched: list = []
    real = remote._fetch_into
    monkeypatch.setattr(remote, "_fetch_into", lambda fs, url, plan: (fetched.extend(plan), real(fs, url, plan)))
    row = {int(i): r for r, i in enumerate(ids)}
    seen = []
    for j in range(m):
        fetched.clear()
        tables, tensors = Loader(url, shard_index=j, shard_num=m, dense="rows", verify=False).load()
        lo, hi = rows_of(j, m, 4001)
        assert np.array_equal(tensors["big"], big[lo:hi])
        got = tables["emb"].ids()
        assert np.array_equal(tables["emb"].lookup_slot("m", got), -values[[row[int(i)] for i in got]])
        seen.append(got)
        for name, ps in parts.items():
            spans = [s for remote_path, _, ranges in fetched if remote_path.endswith("/" + name) for s in ranges]
            for begin, end, first, rows in ps:
                want = (max(lo, first), min(hi, first + rows))
                head = sharded_remote._HEAD  # every file's first bytes are fetched for its header
                have = sum(max(0, min(e, end) - max(s, begin, head)) for s, e in spans)
                if want[0] >= want[1]:
                    assert have <= max(0, head - begin), (j, name, have)
                    continue
                a, b = begin + (want[0] - first) * 512, begin + (want[1] - first) * 512
                assert any(s <= a and b <= e for s, e in spans), (j, name, spans, (a, b))  # its rows, fetched
                assert have == b - max(a, head), (j, name, have, b - a)  # and nothing else of the part
    assert sorted(np.concatenate(seen).tolist()) == sorted(ids.tolist())


def test_a_file_hashed_ahead_serves_the_readers_that_open_it_while_held(tmp_path, monkeypatch):
    from fastckpt.sharded import reader as sharded_reader

    path = tmp_path / "c"
    Saver(path=str(path), parallel=1, tensors={"w": np.arange(8.0)}).save()
    name = "model-00000-000.safetensors"
    hashed: list = []
    real = sharded_reader.blake3_mapped
    monkeypatch.setattr(sharded_reader, "blake3_mapped",
                        lambda mapped, drop: hashed.append(1) or real(mapped, drop=drop))
    releases = sharded_reader.hash_ahead(str(path / name), holders=2)
    assert len(hashed) == 1 and len(releases) == 2
    for _ in range(2):
        with sharded_reader.CheckpointReader(str(path)) as r:
            assert r.file_problem(name) is None  # the hash made ahead, not made again
    assert len(hashed) == 1
    releases[0]()
    with sharded_reader.CheckpointReader(str(path)) as r:
        assert r.file_problem(name) is None
    assert len(hashed) == 1  # one holder left
    releases[1]()
    assert not sharded_reader._digests  # let go: a later reader hashes the file again
    with sharded_reader.CheckpointReader(str(path)) as r:
        assert r.file_problem(name) is None
    assert len(hashed) == 2
    # a file changed after it was hashed ahead is hashed again by its reader, and found changed
    [release] = sharded_reader.hash_ahead(str(path / name))
    data = bytearray((path / name).read_bytes())
    data[-1] ^= 1
    (path / name).write_bytes(bytes(data))
    with sharded_reader.CheckpointReader(str(path)) as r:
        assert r.file_problem(name) is not None and name in r.file_problem(name)
    release()


@pytest.mark.parametrize("n,m", [(4, 3), (4, 2), (2, 3), (1, 4)])
def test_verified_ranks_from_a_url_hash_each_file_once_as_its_fetching_rank_has_it(n, m, monkeypatch):
    # A verified N -> M load from a URL: every file a rank reads is fetched whole once between the ranks (threads)
    # and hashed by the rank that fetched it, as soon as it is in place, for every rank's reader (they hashed it
    # in their loads, whichever reader came first, one file after another: 4 -> 3 had two ranks hash 15 of 16
    # files). Each file once, every hold let go, and every pair exact.

    from fastckpt.sharded import reader as sharded_reader

    url, ids, values = _sliced_checkpoint(n, 7, slots=("m",))
    fetched: list = []
    real_fetch = sharded_remote._Share.fetch

    def fetch(self, spans):
        whole = _whole_files(self, spans)
        fetched.extend(whole)
        _until_every_reader_holds(self, whole, n, m)
        return real_fetch(self, spans)

    monkeypatch.setattr(sharded_remote._Share, "fetch", fetch)
    ahead: list = []
    real_ahead = sharded_reader.hash_ahead
    monkeypatch.setattr(sharded_reader, "hash_ahead",
                        lambda path, *a: ahead.append(os.path.basename(path)) or real_ahead(path, *a))
    hashed: list = []
    real_digest = sharded_reader.blake3_mapped
    monkeypatch.setattr(sharded_reader, "blake3_mapped",
                        lambda mapped, drop: hashed.append(mapped.identity) or real_digest(mapped, drop=drop))
    with ThreadPoolExecutor(m) as pool:
        loaded = list(pool.map(lambda j: Loader(url, shard_index=j, shard_num=m).load(), range(m)))
    assert fetched and sorted(fetched) == sorted(set(fetched))  # each file fetched whole once
    assert sorted(ahead) == sorted(fetched)  # hashed ahead by the load that fetched it
    # and by no reader again (every rank that reads a file joined before it was fetched: the wait above)
    assert len(hashed) == len(fetched) and len({h[:2] for h in hashed}) == len(fetched)
    assert not sharded_reader._digests and not sharded_remote._wholes and not sharded_remote._leaving  # let go
    row = {int(i): r for r, i in enumerate(ids)}
    seen = []
    for j, (tables, _) in enumerate(loaded):
        got = tables["emb"].ids()
        begin, end = slice_of(j, m)
        assert ((slice_positions(got, SLICE_SIZE) >= begin) & (slice_positions(got, SLICE_SIZE) < end)).all()
        rows = [row[int(i)] for i in got]
        assert np.array_equal(tables["emb"].lookup(got), values[rows])
        assert np.array_equal(tables["emb"].lookup_slot("m", got), -values[rows])
        seen.append(got)
    assert sorted(np.concatenate(seen).tolist()) == sorted(ids.tolist())


def _sliced_checkpoint(n: int, seed: int, slots: tuple = ()) -> tuple[str, np.ndarray, np.ndarray]:
    """``(url, ids, values)``: ROWS random ids x DIM float32 (each slot holding ``-values``) saved at a new
    ``memory://`` URL by ``n`` ranks (threads), each the ids of its own slices; no dense tensor, so each file is read
    by the ranks whose slices meet its rank's (:func:`_readers`), every one."""
    url = f"memory://share-{uuid.uuid4().hex[:8]}/ckpt"
    rng = np.random.default_rng(seed)
    ids = rng.choice(10**9, ROWS, replace=False).astype(np.int64)
    values = rng.standard_normal((ROWS, DIM)).astype(np.float32)

    def save(engine):
        mine = np.flatnonzero(slice_positions(ids, SLICE_SIZE) * n // SLICE_SIZE == engine.rank)
        table = HashTable(DIM, slots=slots)
        table.insert(ids[mine], values[mine], {slot: -values[mine] for slot in slots})
        Saver(engine.rank, n, 2, url, hashtables={"emb": table}, tensors={}, engine=engine).save()

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(save, ThreadEngine.group(n)))
    return url, ids, values


def _whole_files(share, spans: dict) -> list:
    """The tensor files a ``_Share.fetch`` of ``spans`` fetches whole."""
    return [k for k, ranges in spans.items() if ranges == [(0, share.sizes[k])] and k.endswith(".safetensors")]


def _until_every_reader_holds(share, whole: list, n: int, m: int, stop=lambda: False) -> None:
    """Wait (20 s at most, or until ``stop()``) until every load of an N -> M load that reads one of the files
    ``whole`` holds it, so that the loads overlap for certain."""
    import time

    deadline = time.monotonic() + 20
    while whole and not stop() and time.monotonic() < deadline and any(
            sharded_remote._wholes.holders((share.url, share.manifest_hash, k)) < _readers(k, n, m) for k in whole):
        time.sleep(0.005)


def _readers(name: str, n: int, m: int) -> int:
    """How many of M ranks read tensor file ``name`` of a checkpoint saved by N ranks by the slice rule (its
    rank's slice, ``model-RRRRR-WWW``, meets theirs)."""
    rank = int(name.split("-")[1])
    begin, end = slice_of(rank, n)
    return sum(1 for j in range(m) if max(begin, slice_of(j, m)[0]) < min(end, slice_of(j, m)[1]))


def test_a_rank_whose_own_fetch_fails_lets_go_of_what_others_hold_for_it(monkeypatch):
    # A verified 4 -> 3 load from a URL where one rank's own whole-file fetch fails while other ranks fetch files for
    # it too: those ranks hash the files they link for it and hold each hash for it; the failing rank waits for
    # their fetches and lets go of those holds, so nothing stays held for files that are gone.
    import threading
    import time

    from fastckpt.sharded import reader as sharded_reader

    n, m = 4, 3
    url, _ids, _values = _sliced_checkpoint(n, 11)
    real_fetch = sharded_remote._Share.fetch
    real_fetch_whole = sharded_remote._Share.fetch_whole
    failed: list = []
    lock = threading.Lock()
    waiters: list = []  # the loads waiting on another load's fetch, as seen before any whole file was fetched
    wholes = threading.local()  # set while this thread's load fetches its whole files

    def fetch_whole(self, names):
        wholes.on = True
        try:
            return real_fetch_whole(self, names)
        finally:
            wholes.on = False

    def fetch(self, spans):
        whole = _whole_files(self, spans)
        _until_every_reader_holds(self, whole, n, m, stop=lambda: failed)  # (after the failure: fewer hold it)
        deadline = time.monotonic() + 20
        # A load with no whole file of its own to fetch waits for another's first whole fetch (which lists it as a
        # waiter); only in its whole-file round: in an earlier round with nothing to fetch (a verified load fetches
        # no header) every load would wait here for the others, until the deadline.
        while (not spans and getattr(wholes, "on", False) and not waiters and not failed
               and time.monotonic() < deadline):
            time.sleep(0.005)
        with lock:
            if whole and not waiters:  # the first whole fetch: nothing fetched yet, every waiter still listed
                flights = list(sharded_remote._wholes._flights.values())
                waiters.extend({os.path.dirname(path) for f in flights for path in (f.waiting or [])})
            if (whole or not spans) and not failed and self.local in waiters:
                failed.append(self.local)
                raise OSError("the store dropped the connection")
        return real_fetch(self, spans)

    monkeypatch.setattr(sharded_remote._Share, "fetch", fetch)
    monkeypatch.setattr(sharded_remote._Share, "fetch_whole", fetch_whole)

    def load(j):
        try:
            return Loader(url, shard_index=j, shard_num=m).load()
        except OSError as e:
            return e

    with ThreadPoolExecutor(m) as pool:
        results = list(pool.map(load, range(m)))
    assert failed and sum(isinstance(r, OSError) for r in results) == 1
    assert not sharded_reader._digests and not sharded_remote._wholes and not sharded_remote._leaving  # let go


def test_metadata_of_another_commit_in_the_first_round_is_fetched_again(monkeypatch):
    # The first round asks for the manifest and the metadata at once: a save committing between those requests can
    # hand a load metadata that is not the one its manifest lists. Only metadata of the manifest's size and BLAKE3
    # is taken; the rest is fetched again after it, and the load is exact.
    from fastckpt.sharded.format import DESCRIPTION_FILE, INDEX_FILE

    url = f"memory://share-{uuid.uuid4().hex[:8]}/ckpt"
    ids, values = _save(url, 2)
    real = sharded_remote._bounded
    stale = {INDEX_FILE: b'{"block_index": {}, "file_index": {}}\n', DESCRIPTION_FILE: None}

    def bounded(fs, where, path, names):
        got = real(fs, where, path, names)
        return {name: stale.get(name, data) for name, data in got.items()}

    monkeypatch.setattr(sharded_remote, "_bounded", bounded)
    fetched = []
    real_fetch = sharded_remote._Share.fetch
    monkeypatch.setattr(sharded_remote._Share, "fetch",
                        lambda self, spans: (fetched.append(sorted(spans)), real_fetch(self, spans))[1])
    _check(url, ids, values, 2, verify=False)
    assert fetched[0] == sorted(stale)  # those two fetched again, first; tensorkey.json taken from the first round


def _lay_out_otherwise(fs, path: str, name: str) -> list[str]:
    """Rewrite tensor file ``name`` of the checkpoint at ``path`` (a filesystem's path) with its parts in the
    reverse of the writer's order, its header as long as before (padded), its size unchanged: a valid safetensors
    file that fastckpt's writer would not make. Returns its keys in the new order."""
    import json

    data = fs.cat_file(f"{path}/{name}")
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    keys = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])[::-1]
    body, new, at = b"", {k: v for k, v in header.items() if k == "__metadata__"}, 0
    for key in keys:
        begin, end = header[key]["data_offsets"]
        body += data[8 + length + begin:8 + length + end]
        new[key] = {**header[key], "data_offsets": [at, at + end - begin]}
        at += end - begin
    text = json.dumps(new).encode()
    assert len(text) <= length
    fs.pipe_file(f"{path}/{name}", data[:8] + text + b" " * (length - len(text)) + body)
    return keys


@pytest.mark.parametrize("m", [2, 3])
def test_a_file_laid_out_otherwise_than_the_metadata_says_still_loads_exactly(monkeypatch, m):
    # A URL load places the parts of the files it reads from the metadata alone (fastckpt's writer lays them out
    # in the reference order, after the header) and fetches its ranges with the headers, in one round. The headers
    # decide: where one says otherwise, the ranges it places are fetched in one more round.
    from fastckpt.formats.stream import merged

    url = f"memory://share-{uuid.uuid4().hex[:8]}/ckpt"
    ids, values = _save(url, 2)
    fs, path = remote.filesystem(url)
    index = fs.cat_file(f"{path}/index.json")
    import json

    index = json.loads(index)
    by_file: dict = {}
    for key, number in index["block_index"].items():
        by_file.setdefault(number, []).append(key)
    names = {number: name for name, number in index["file_index"].items()}
    moved = {names[n]: _lay_out_otherwise(fs, path, names[n]) for n, keys in by_file.items() if len(keys) > 1}
    assert moved  # (the ids and the dense tensor share a file)
    rounds: list = []
    real = sharded_remote._Share.fetch

    def fetch(self, spans):
        if spans:
            rounds.append({name: merged(ranges) for name, ranges in spans.items() if ranges})
        return real(self, spans)

    monkeypatch.setattr(sharded_remote._Share, "fetch", fetch)
    _check(url, ids, values, m, verify=False)
    _check(url, ids, values, m, dense="rows", verify=False)
    tensor_rounds = [r for r in rounds if any(name.endswith(".safetensors") for name in r)]
    assert len(tensor_rounds) == 4 * m  # per load: the round of headers and ranges, then the ranges again
    for second in tensor_rounds[1::2]:
        assert set(second) <= set(moved)  # only the files laid out otherwise
