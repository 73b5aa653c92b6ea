"""Sharded format version 4: table parts in key-space slice order with their groups' row offsets recorded, so that a
rank of any world size reads only the ids and rows of its slices (fastckpt.sharded.format, loader, remote)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from _sharded_edit import reseal, save_threads

from fastckpt.errors import FormatError
from fastckpt.sharded import CheckpointReader, DeltaPolicy, HashTable, Loader
from fastckpt.sharded.reshard import reshard
from fastckpt.sharded.format import (DESCRIPTION_FILE, SLICE_SIZE, group_span, owner_mod, slice_of,
                                     slice_positions)

GOLDEN = Path(__file__).parent / "data" / "golden"
DIM, SLOTS = 3, ("m", "v")
PAIRS = [(4, 3), (4, 2), (2, 3), (1, 4), (3, 4), (4, 4)]


def global_state(n_ids: int = 6000, seed: int = 1) -> tuple[np.ndarray, np.ndarray, dict]:
    """Distinct ids spread over the whole int64 range (negative ones too), their rows and slots."""
    rng = np.random.default_rng(seed)
    ids = np.unique(rng.integers(-(2**63), 2**63 - 1, n_ids, dtype=np.int64))
    values = rng.standard_normal((len(ids), DIM)).astype(np.float32)
    return ids, values, {"m": -values, "v": values * 2}


def rank_tables(n: int, placement: str = "mod", **state) -> list[dict]:
    """The global state split over ``n`` ranks: by ``id mod n`` (how versions 1-3 placed ids) or by the slice rule
    (how a version-4 load places them)."""
    ids, values, slots = global_state(**state)
    if placement == "mod":
        owner = owner_mod(ids, n)
    else:
        owner = np.searchsorted([slice_of(r, n)[1] for r in range(n)], slice_positions(ids, SLICE_SIZE), "right")
    out = []
    for r in range(n):
        mine = owner == r
        table = HashTable(DIM, slots=SLOTS, name="emb")
        table.insert(ids[mine], values[mine], {s: a[mine] for s, a in slots.items()})
        out.append({"emb": table})
    return out


DENSE = {"w": np.arange(44, dtype=np.float32).reshape(11, 4), "step": np.array(7, np.int64)}


def save(path, n: int, placement: str = "mod", parallel: int = 2, **options) -> str:
    return save_threads(path, rank_tables(n, placement), DENSE, parallel, **options)


def owned_mask(ids: np.ndarray, j: int, m: int) -> np.ndarray:
    begin, end = slice_of(j, m)
    positions = slice_positions(ids, SLICE_SIZE)
    return (positions >= begin) & (positions < end)


def check_exact(loaded: list, m: int, dense: str = "replicated", **state) -> None:
    """Every id on exactly the rank the slice rule names, its row and both slots exact, the dense tensors exact."""
    ids, values, slots = global_state(**state)
    row = {int(i): r for r, i in enumerate(ids)}
    seen = []
    for j, (tables, tensors) in enumerate(loaded):
        table = tables["emb"]
        got = table.ids()
        assert owned_mask(got, j, m).all(), f"rank {j} of {m} holds ids of other slices"
        assert len(got) == int(owned_mask(ids, j, m).sum()), f"rank {j} of {m} misses ids of its slices"
        rows = [row[int(i)] for i in got]
        assert table.lookup(got).tobytes() == values[rows].tobytes()
        for s in SLOTS:
            assert table.lookup_slot(s, got).tobytes() == slots[s][rows].tobytes()
        lo, hi = (0, 11) if dense == "replicated" else (j * 11 // m, (j + 1) * 11 // m)
        assert tensors["w"].tobytes() == DENSE["w"][lo:hi].tobytes()
        seen.append(got)
    assert sorted(np.concatenate(seen).tolist()) == ids.tolist()


@pytest.mark.parametrize("placement", ["mod", "slice"])
@pytest.mark.parametrize("n, m", PAIRS)
def test_every_reshard_pair_loads_every_id_on_its_slice_rank_exactly(tmp_path, n, m, placement):
    save(tmp_path / "c", n, placement)
    with CheckpointReader(tmp_path / "c") as r:
        assert r.manifest["format_version"] == 4
        assert r.manifest["hashtables"]["emb"]["partition"] == {"rule": "slice", "slice_size": SLICE_SIZE}
        for i in range(n):  # each part in ascending slice order, its group offsets matching its ids
            key = f"emb.id/part_{i}_{n}"
            positions = slice_positions(r.read_tensor(key), SLICE_SIZE)
            assert np.all(positions[1:] >= positions[:-1])
            rows, groups = r.descriptions[key]["slices"]["rows"], r.descriptions[key]["slices"]["groups"]
            bounds = [g * SLICE_SIZE // groups for g in range(groups + 1)]
            assert rows == np.searchsorted(positions, bounds[:-1]).tolist() + [len(positions)]
    for verify in (False, True):
        check_exact([Loader(str(tmp_path / "c"), shard_index=j, shard_num=m, verify=verify).load()
                     for j in range(m)], m)
    check_exact([Loader(str(tmp_path / "c"), shard_index=j, shard_num=m, dense="rows", verify=False).load()
                 for j in range(m)], m, dense="rows")


def _recorded_reads(monkeypatch) -> list:
    """Every read through a reader's read path (``read_into``: key, first byte, bytes), and every mapped array of a
    table part asked for (which would read it otherwise)."""
    reads: list = []
    real_read, real_array = CheckpointReader.read_into, CheckpointReader.array

    def read_into(self, key, out, start=0):
        reads.append((key, start, memoryview(out).nbytes))
        return real_read(self, key, out, start)

    def array(self, key):
        if key.startswith("emb."):
            reads.append((key, "mapped", self.part_infos[key].nbytes))
        return real_array(self, key)

    monkeypatch.setattr(CheckpointReader, "read_into", read_into)
    monkeypatch.setattr(CheckpointReader, "array", array)
    return reads


@pytest.mark.parametrize("n, m", [(4, 3), (4, 2), (2, 3), (1, 4)])
def test_a_resharding_rank_reads_exactly_the_ranges_of_its_slices(tmp_path, monkeypatch, n, m):
    save(tmp_path / "c", n, parallel=1)
    with CheckpointReader(tmp_path / "c") as r:
        expected = {}
        for j in range(m):
            want = []
            for i in range(n):
                key = f"emb.id/part_{i}_{n}"
                ids, rows = r.read_tensor(key), r.descriptions[key]["slices"]["rows"]
                g0, g1 = group_span(rows, SLICE_SIZE, *slice_of(j, m))
                if rows[g0] < rows[g1]:  # the ids of the groups that meet the rank's slice
                    want.append((key, 8 * rows[g0], 8 * (rows[g1] - rows[g0])))
                mine = np.flatnonzero(owned_mask(ids, j, m))
                assert len(mine) == 0 or mine[-1] - mine[0] + 1 == len(mine)  # one run of rows
                for t in ("embedding", *SLOTS):
                    if len(mine):
                        want.append((f"emb.{t}/part_{i}_{n}", int(mine[0]) * DIM * 4, len(mine) * DIM * 4))
            expected[j] = sorted(want)
        table_bytes = sum(r.part_infos[k].nbytes for k in r.part_infos if k.startswith("emb."))
    for j in range(m):
        reads = _recorded_reads(monkeypatch)
        tables, _ = Loader(str(tmp_path / "c"), tensors={}, shard_index=j, shard_num=m, verify=False).load()
        monkeypatch.undo()
        got = sorted(x for x in reads if x[0].startswith("emb."))
        assert got == expected[j]  # no mapped table part, no other range
        share = int(owned_mask(global_state()[0], j, m).sum()) * (8 + 3 * DIM * 4)
        assert share <= sum(nbytes for *_, nbytes in got) <= share + 8 * sum(
            x[2] // 8 for x in got if ".id/" in x[0])  # its rows, and the ids of the groups at its slice's ends
        assert sum(nbytes for *_, nbytes in got) < (1 / m + 0.1) * table_bytes
        assert owned_mask(tables["emb"].ids(), j, m).all()


def test_an_explicit_owner_still_picks_rows_from_every_part(tmp_path):
    save(tmp_path / "c", 4)
    ids = global_state()[0]
    seen = []
    for j in range(3):
        got = Loader(str(tmp_path / "c"), shard_index=j, shard_num=3, owner=owner_mod).load()[0]["emb"].ids()
        assert np.all(np.mod(got, 3) == j)
        seen.append(got)
    assert sorted(np.concatenate(seen).tolist()) == ids.tolist()


@pytest.mark.parametrize("folder, version", [("sharded-0.2.0", 1), ("sharded", 3)])
def test_reshard_converts_versions_1_to_3_into_version_4(tmp_path, folder, version):
    src = GOLDEN / folder / "full"
    with CheckpointReader(src) as r:
        assert r.manifest["format_version"] == version and "partition" not in r.manifest["hashtables"]["emb"]
        before = {name: r.read_tensor(name) for name in r.tensor_names()}
        order = np.argsort(before["emb.id"])
    reshard(src, tmp_path / "v4", 3, parallel=1)
    with CheckpointReader(tmp_path / "v4") as r:
        assert r.manifest["format_version"] == 4 and r.verify() == []
        after = {name: r.read_tensor(name) for name in r.tensor_names()}
        for j in range(3):  # each new rank holds the ids of its slices
            assert owned_mask(r.read_tensor(f"emb.id/part_{j}_3"), j, 3).all()
    new_order = np.argsort(after["emb.id"])
    for name, value in before.items():
        if name.startswith("emb."):
            assert after[name][new_order].tobytes() == value[order].tobytes(), name
        elif not name.startswith("small."):
            assert after[name].tobytes() == value.tobytes(), name


def _edit_slices(path, key: str, edit) -> None:
    """Rewrite id part ``key``'s ``slices`` with ``edit(slices)`` and reseal the manifest (a consistent forgery)."""
    d = Path(path)
    descriptions = json.loads((d / DESCRIPTION_FILE).read_bytes())
    descriptions[key]["slices"] = edit(descriptions[key]["slices"])
    (d / DESCRIPTION_FILE).write_text(json.dumps(descriptions, indent=1, sort_keys=True) + "\n")
    reseal(d)


@pytest.mark.parametrize("edit, message", [
    (lambda s: {**s, "rows": [0, 300, 200, *s["rows"][3:]]}, r"slices.rows\[2\] \(row offset of slice group 2, "
                                                             r"byte offset 1600 of its ids\) is 200, expected from 300"),
    (lambda s: {**s, "rows": s["rows"][:-1]}, "row offsets for"),
    (lambda s: {**s, "rows": [1, *s["rows"][1:]]}, r"slices.rows\[0\] .* is 1, expected 0"),
    (lambda s: {**s, "rows": [*s["rows"][:-1], s["rows"][-1] + 1]}, "expected 1500, the part's rows"),
    (lambda s: {**s, "groups": 10**9}, "'slices' must be"),
    (lambda s: None, "'slices' must be"),
])
def test_malformed_slice_offsets_are_refused_when_the_checkpoint_opens(tmp_path, edit, message):
    save_threads(tmp_path / "c", [_one_table(3000, 0), _one_table(3000, 1)], {}, 1)
    _edit_slices(tmp_path / "c", "emb.id/part_0_2", edit)
    with pytest.raises(FormatError, match=f"{DESCRIPTION_FILE}: entry 'emb.id/part_0_2': .*{message}"):
        CheckpointReader(tmp_path / "c")
    given = {"emb": HashTable(DIM, slots=SLOTS)}
    given["emb"].insert([1], np.ones((1, DIM), np.float32))
    with pytest.raises(FormatError):
        Loader(str(tmp_path / "c"), hashtables=given, shard_index=1, shard_num=3).load()
    assert given["emb"].ids().tolist() == [1]


def _one_table(n: int, rank: int) -> dict:
    ids = np.arange(n, dtype=np.int64)[rank::2] * 40503
    table = HashTable(DIM, slots=SLOTS, name="emb")
    table.insert(ids, np.ones((len(ids), DIM), np.float32), {s: np.zeros((len(ids), DIM), np.float32) for s in SLOTS})
    return {"emb": table}


def test_forged_slice_offsets_are_refused_before_any_row_is_placed(tmp_path):
    """Offsets well formed but not those of the ids (moved by one row): the rank that reads the group finds an id
    outside it and names the file, the tensor, the row and its byte offset; the caller's table is unchanged."""
    save_threads(tmp_path / "c", [_one_table(3000, 0), _one_table(3000, 1)], {}, 1)
    with CheckpointReader(tmp_path / "c") as r:
        rows = r.descriptions["emb.id/part_0_2"]["slices"]["rows"]
        offset = r.part_infos["emb.id/part_0_2"].offset
        ids = r.read_tensor("emb.id/part_0_2")
    _edit_slices(tmp_path / "c", "emb.id/part_0_2", lambda s: {**s, "rows": [0, rows[1] + 1, *rows[2:]]})
    CheckpointReader(tmp_path / "c").close()  # well formed: it opens
    given = {"emb": HashTable(DIM, slots=SLOTS)}
    given["emb"].insert([1], np.ones((1, DIM), np.float32))
    row = rows[1]  # the first id of group 1, now recorded in group 0
    message = (rf"model-00000-000.safetensors: tensor 'emb.id/part_0_2', row {row} \(byte {offset + 8 * row} of the "
               rf"file\): id {ids[row]} is at slice position {slice_positions(ids[row:row + 1], SLICE_SIZE)[0]}, "
               rf"expected a position in \[0, {SLICE_SIZE // (len(rows) - 1)}\) \(slice group 0")
    with pytest.raises(FormatError, match=message):
        Loader(str(tmp_path / "c"), hashtables=given, shard_index=0, shard_num=2, verify=False).load()
    assert given["emb"].ids().tolist() == [1]


def test_a_one_rank_checkpoint_on_four_ranks_checks_its_ids_in_the_index_build(tmp_path, monkeypatch):
    """1 -> 4: every slice group a rank reads is its own, so its ids are checked as the id index is built (one pass
    over them, no slice_run_check of their own); forged offsets are still named by file, tensor, row and byte, and
    the caller's table stays as it was."""
    from fastckpt.sharded import format as fmt

    save_threads(tmp_path / "c", [{"emb": _whole_table(6000)}], {}, 1)
    calls: list = []
    real = fmt.slice_run_check
    monkeypatch.setattr(fmt, "slice_run_check", lambda *a: calls.append(a) or real(*a))
    loaded = [Loader(str(tmp_path / "c"), shard_index=j, shard_num=4, verify=False).load()[0]["emb"]
              for j in range(4)]
    assert calls == []  # was one call a rank
    ids = np.arange(6000, dtype=np.int64) * 40503
    positions = slice_positions(ids, SLICE_SIZE)
    for j, table in enumerate(loaded):
        begin, end = slice_of(j, 4, SLICE_SIZE)
        assert sorted(table.ids().tolist()) == sorted(ids[(positions >= begin) & (positions < end)].tolist())
    with CheckpointReader(tmp_path / "c") as r:
        rows = r.descriptions["emb.id/part_0_1"]["slices"]["rows"]
        offset = r.part_infos["emb.id/part_0_1"].offset
        stored = r.read_tensor("emb.id/part_0_1")
    _edit_slices(tmp_path / "c", "emb.id/part_0_1", lambda s: {**s, "rows": [0, rows[1] + 1, *rows[2:]]})
    row = rows[1]  # the first id of group 1, now recorded in group 0 (rank 0's)
    given = {"emb": HashTable(DIM, slots=SLOTS)}
    given["emb"].insert([1], np.ones((1, DIM), np.float32))
    with pytest.raises(FormatError, match=rf"tensor 'emb.id/part_0_1', row {row} \(byte {offset + 8 * row} of the "
                                          rf"file\): id {stored[row]} is at slice position"):
        Loader(str(tmp_path / "c"), hashtables=given, shard_index=0, shard_num=4, verify=False).load()
    assert given["emb"].ids().tolist() == [1]


def _whole_table(n: int) -> HashTable:
    ids = np.arange(n, dtype=np.int64) * 40503
    table = HashTable(DIM, slots=SLOTS, name="emb")
    table.insert(ids, np.ones((n, DIM), np.float32), {s: np.zeros((n, DIM), np.float32) for s in SLOTS})
    return table


def test_deltas_and_encoded_tables_load_by_the_slice_rule(tmp_path):
    tables = rank_tables(2)
    save_threads(tmp_path / "full", tables, DENSE, 2)
    ids, values, slots = global_state()
    tables[0]["emb"].update(tables[0]["emb"].ids()[:50], np.full((50, DIM), 9, np.float32))
    save_threads(tmp_path / "delta", tables, DENSE, 2, incremental=DeltaPolicy(max_fraction=1.0))
    with CheckpointReader(tmp_path / "delta") as r:
        assert r.manifest.get("kind") == "delta" and r.manifest["format_version"] == 4
        assert "slices" in r.descriptions["emb.id/part_0_2"] and "slices" not in r.descriptions["emb.deleted/part_0_2"]
    changed = set(tables[0]["emb"].ids()[:50].tolist())
    for m in (1, 3, 4):
        for j in range(m):
            got = Loader(str(tmp_path / "delta"), shard_index=j, shard_num=m).load()[0]["emb"]
            assert owned_mask(got.ids(), j, m).all() and len(got) == int(owned_mask(ids, j, m).sum())
            for i in got.ids()[:200]:
                want = np.full(DIM, 9, np.float32) if int(i) in changed else values[np.searchsorted(ids, i)]
                assert got.lookup([i])[0].tobytes() == want.tobytes()
    save_threads(tmp_path / "zstd", rank_tables(2), DENSE, 2, compression="zstd")
    with CheckpointReader(tmp_path / "zstd") as r:  # sorted by id for the codec: no slices, read whole
        assert "slices" not in r.descriptions["emb.id/part_0_2"]
    check_exact([Loader(str(tmp_path / "zstd"), shard_index=j, shard_num=3).load() for j in range(3)], 3)


def _fuzz(tmp_path, rounds: int, seed: int) -> None:
    base = tmp_path / "base"
    save_threads(base, [_one_table(2000, 0), _one_table(2000, 1)], {}, 1)
    rng = np.random.default_rng(seed)
    values = [0, 1, -1, 3, 250, 999, 1000, 1001, 2**31, 2**63, 1.5, "7", None, True, [], {}]
    for k in range(rounds):
        path = tmp_path / f"f{k}"
        shutil.copytree(base, path)

        def edit(s):
            s = json.loads(json.dumps(s))
            for _ in range(int(rng.integers(1, 4))):
                what = rng.integers(0, 4)
                if what == 0 and s["rows"]:
                    s["rows"][int(rng.integers(0, len(s["rows"])))] = values[int(rng.integers(0, len(values)))]
                elif what == 1:
                    s["groups"] = values[int(rng.integers(0, len(values)))]
                elif what == 2:
                    s["rows"] = sorted(int(x) for x in rng.integers(0, 1001, int(rng.integers(0, 6))))
                else:
                    s[str(rng.integers(0, 3))] = 1
            return s

        _edit_slices(path, "emb.id/part_1_2", edit)
        try:
            for j in range(3):
                Loader(str(path), shard_index=j, shard_num=3, verify=False).load()
        except FormatError:
            pass  # refused, with its message; anything else fails the test
        shutil.rmtree(path)


def test_fuzzed_slice_offsets_are_refused_or_load(tmp_path):
    _fuzz(tmp_path, 25, seed=0)


@pytest.mark.slow
def test_fuzzed_slice_offsets_are_refused_or_load_long(tmp_path):
    _fuzz(tmp_path, 1000, seed=1)


def test_on_s3_a_resharding_rank_fetches_only_its_slices(s3, tmp_path):
    from fastckpt.formats import remote
    from fastckpt.sharded import remote as sharded_remote

    url = s3.url("v4")
    tables = rank_tables(4, "slice", n_ids=80000)
    save_threads(url, tables, DENSE, 2, storage_options=s3.storage_options)
    fs, path = remote.filesystem(url, s3.storage_options)
    total = sum(int(e["size"]) for e in fs.find(path, detail=True).values())
    for m in (3, 2):
        loaded = []
        for j in range(m):
            local = tmp_path / f"{m}-{j}"
            local.mkdir()
            share = sharded_remote.fetch_share(Loader(url, shard_index=j, shard_num=m, verify=False,
                                                      storage_options=s3.storage_options), str(local))
            assert share["layout"] == "fastckpt" and share["bytes"] < (1 / m + 0.06) * total, (share, total)
            loaded.append(Loader(url, shard_index=j, shard_num=m, verify=False,
                                 storage_options=s3.storage_options).load())
        check_exact(loaded, m, n_ids=80000)
        # verified: whole files, but only those whose parts the rank reads (its slices meet 1 or 2 of the 4 ranks')
        verified = []
        for j in range(m):
            local = tmp_path / f"{m}-{j}-verified"
            local.mkdir()
            share = sharded_remote.fetch_share(Loader(url, shard_index=j, shard_num=m,
                                                      storage_options=s3.storage_options), str(local))
            assert share and share["bytes"] < 0.8 * total, (share, total)
            verified.append(Loader(url, shard_index=j, shard_num=m, storage_options=s3.storage_options).load())
        check_exact(verified, m, n_ids=80000)
    # a damaged file that a verified rank reads: named
    damaged = bytearray(fs.cat_file(f"{path}/model-00000-001.safetensors"))
    damaged[-1] ^= 1  # the last byte of its last tensor
    fs.pipe_file(f"{path}/model-00000-001.safetensors", bytes(damaged))
    with pytest.raises(Exception, match="model-00000-001.safetensors"):
        Loader(url, shard_index=0, shard_num=3, storage_options=s3.storage_options).load()


TABLES_ONLY = lambda info: {**info, "tensors": {}}  # noqa: E731 - the tables alone: every rank reads the dense ones


def test_a_verified_rank_hashes_only_the_files_it_reads(tmp_path, monkeypatch):
    """Saved by 4 ranks each holding its slices, a same-shape verified load reads, and so hashes, its own files
    only; a rank of 3 the files whose parts meet its slices."""
    save(tmp_path / "c", 4, "slice", parallel=1)
    hashed: list = []
    real = CheckpointReader.file_problem

    def file_problem(self, name):
        hashed.append(name)
        return real(self, name)

    monkeypatch.setattr(CheckpointReader, "file_problem", file_problem)
    with CheckpointReader(tmp_path / "c") as r:
        rows = [r.descriptions[f"emb.id/part_{i}_4"]["slices"]["rows"] for i in range(4)]

    def meeting(j, m):  # the files whose parts hold rows in the slice groups that meet rank j's slice
        spans = [group_span(rows[i], SLICE_SIZE, *slice_of(j, m)) for i in range(4)]
        return [f"model-{i:05d}-000.safetensors" for i, (a, b) in enumerate(spans) if rows[i][a] < rows[i][b]]

    for j, m in [(0, 4), (1, 4), (2, 4), (3, 4), (1, 3), (0, 2)]:
        hashed.clear()
        Loader(str(tmp_path / "c"), filter_func=TABLES_ONLY, shard_index=j, shard_num=m).load()
        assert sorted(hashed) == meeting(j, m)
        if m == 4:  # its own file, and at most the neighbours' whose end group meets its slice
            assert f"model-{j:05d}-000.safetensors" in hashed and len(hashed) <= 3
    damaged = tmp_path / "c" / "model-00003-000.safetensors"  # a file rank 0 of 4 never reads
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 1
    damaged.write_bytes(bytes(data))
    Loader(str(tmp_path / "c"), filter_func=TABLES_ONLY, shard_index=0, shard_num=4).load()
    with pytest.raises(Exception, match="model-00003-000.safetensors"):
        Loader(str(tmp_path / "c"), filter_func=TABLES_ONLY, shard_index=3, shard_num=4).load()


def test_compact_converts_a_version_2_chain_into_version_4(tmp_path):
    from fastckpt.sharded.reshard import compact

    src = GOLDEN / "sharded-0.2.0" / "delta"  # format version 2, a delta on the version-1 "full"
    with CheckpointReader(src) as r:
        assert r.manifest["format_version"] == 2 and r.manifest["kind"] == "delta"
    want = Loader(str(src)).load()
    compact(src, tmp_path / "v4", shards=3, parallel=1)
    with CheckpointReader(tmp_path / "v4") as r:
        assert r.manifest["format_version"] == 4 and "kind" not in r.manifest and r.verify() == []
    got = Loader(str(tmp_path / "v4")).load()
    for name, table in want[0].items():
        assert got[0][name] == table, name
    for name, value in want[1].items():
        assert got[1][name].tobytes() == value.tobytes() and got[1][name].dtype == value.dtype, name


def test_a_save_of_a_slice_size_above_2_to_the_24_loads_exact(tmp_path):
    # Slice sizes up to 2**32 are accepted; the counting sort of 0.7 refused any above 2**24 once the save had
    # started ("slice_order: size must be from 1 to 16777216").
    ids, values, slots = global_state(3000)
    out = save_threads(tmp_path / "c", [{"emb": HashTable.from_export(ids, values, slots)}], DENSE, 2,
                       slice_size=2**31 + 11)
    with CheckpointReader(out) as reader:
        assert reader.manifest["hashtables"]["emb"]["partition"]["slice_size"] == 2**31 + 11 and reader.verify() == []
        stored = np.concatenate([reader.array(k) for k in reader.part_names("emb.id")])
    positions = slice_positions(stored, 2**31 + 11)
    assert (np.diff(positions.astype(np.float64)) >= 0).all()
    for m in (1, 3):
        loaded = [Loader(out, shard_index=j, shard_num=m).load() for j in range(m)]
        got = np.concatenate([tables["emb"].ids() for tables, _ in loaded])
        assert sorted(got.tolist()) == ids.tolist()
        for tables, _ in loaded:
            table = tables["emb"]
            rows = np.searchsorted(ids, table.ids())
            assert table.lookup(table.ids()).tobytes() == values[rows].tobytes()
            assert table.lookup_slot("v", table.ids()).tobytes() == slots["v"][rows].tobytes()
