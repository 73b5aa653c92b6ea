"""Sharded checkpoints: layout, exact round trips, resharding N -> M, filters, failures (ranks as threads)."""

from __future__ import annotations

import json
import os
import re
import threading

import ml_dtypes
import numpy as np
import pytest

import fastckpt
from fastckpt.errors import CheckpointNotFoundError, ChecksumMismatchError, FormatError, TensorNotFoundError
from fastckpt.sharded.format import SLICE_SIZE, slice_of, slice_owner, slice_positions
from fastckpt.sharded import CheckpointReader, HashTable, Loader, Saver, split_sparse_dense_state_dict
from _sharded_edit import reseal
from fastckpt.sharded.engine import BarrierTimeoutError, ThreadEngine
from fastckpt.sharded.format import DESCRIPTION_FILE, INDEX_FILE, MANIFEST_FILE, TENSORKEY_FILE

DIM = 3
SLOTS = ("m", "v")


def dense_state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((10, 4)).astype(np.float32),
        "bias": np.arange(7, dtype=np.int64) - 3,
        "bf": rng.standard_normal((5, 2)).astype(ml_dtypes.bfloat16),
        "scalar": np.array(2.5, np.float64),
        "few": np.arange(2, dtype=np.float32),  # fewer rows than ranks for n >= 3
        "none": np.zeros((0, 3), np.float32),
    }


def table_rows(ids: np.ndarray, seed: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    # Values derived from the ids, so any row that lands on the wrong id shows.
    base = (ids.astype(np.float64) % 1000)[:, None] + np.arange(DIM)[None, :] / 8 + seed
    return base.astype(np.float32), {s: (base * (k + 2)).astype(np.float32) for k, s in enumerate(SLOTS)}


def global_ids(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = np.concatenate([rng.integers(-(2**62), 2**62, 50), np.arange(-5, 6), [np.iinfo(np.int64).max,
                                                                               np.iinfo(np.int64).min + 1]])
    return np.unique(ids.astype(np.int64))


def rank_tables(n: int, seed: int = 0) -> list[dict[str, HashTable]]:
    """The tables of n training ranks: ids split by id mod n (the trainer's own rule)."""
    ids = global_ids(seed)
    out = []
    for r in range(n):
        mine = ids[np.mod(ids, n) == r]
        t = HashTable(DIM, slots=SLOTS)
        values, slots = table_rows(mine, seed)
        t.insert(mine, values, slots)
        out.append({"emb": t})
    return out


def save_ranks(path, n: int, parallel: int = 2, *, seed: int = 0, tensors=None, timeout: float = 30.0,
               filter_funcs=None, ranks=None) -> list:
    """Save from n thread-ranks; returns each rank's result (the path) or the exception it raised."""
    engines = ThreadEngine.group(n)
    tables = rank_tables(n, seed)
    results: list = [None] * n
    tensors = dense_state(seed) if tensors is None else tensors

    def run(r):
        try:
            kwargs = {"filter_func": filter_funcs[r]} if filter_funcs else {}
            results[r] = Saver(shard_index=r, shard_num=n, parallel=parallel, path=str(path), hashtables=tables[r],
                               tensors=tensors, engine=engines[r], timeout=timeout, **kwargs).save()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            results[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in (range(n) if ranks is None else ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def union(tables: list[HashTable]) -> tuple[np.ndarray, np.ndarray, dict]:
    parts = [t.export() for t in tables]
    ids = np.concatenate([p[0] for p in parts])
    order = np.argsort(ids, kind="stable")
    values = np.concatenate([p[1] for p in parts])[order]
    slots = {s: np.concatenate([p[2][s] for p in parts])[order] for s in SLOTS}
    return ids[order], values, slots


# -- layout -------------------------------------------------------------------------------------------
def test_the_directory_holds_the_files_the_format_names(tmp_path):
    out = tmp_path / "ckpt"
    assert save_ranks(out, 2, parallel=3) == [str(out), str(out)]
    names = sorted(os.listdir(out))
    tensor_files = [f"model-{r:05d}-{k:03d}.safetensors" for r in range(2) for k in range(3)]
    assert names == sorted([*tensor_files, INDEX_FILE, TENSORKEY_FILE, DESCRIPTION_FILE, MANIFEST_FILE])
    index = json.loads((out / INDEX_FILE).read_text())
    assert index["file_index"] == {name: i for i, name in enumerate(tensor_files)}
    tensorkey = json.loads((out / TENSORKEY_FILE).read_text())
    assert tensorkey["w/part_1_2"] == "w" and tensorkey["emb.id/part_0_2"] == "emb.id"
    assert tensorkey["scalar/part_0_1"] == "scalar" and "scalar/part_1_2" not in tensorkey
    desc = json.loads((out / DESCRIPTION_FILE).read_text())
    emb = desc["emb.embedding/part_1_2"]
    assert {k: emb[k] for k in ("name", "dense", "dimension", "dtype", "is_hashmap", "hashmap_key",
                                "hashmap_value")} == {
        "name": "emb.embedding/part_1_2", "dense": False, "dimension": DIM, "dtype": "float32", "is_hashmap": True,
        "hashmap_key": "emb.id/part_1_2", "hashmap_value": "emb.embedding/part_1_2"}
    w = desc["w/part_1_2"]
    assert (w["shape"], w["row_start"], w["global_shape"], w["dense"], w["dimension"]) == ([5, 4], 5, [10, 4], True, 4)
    assert desc["bf/part_0_2"]["dtype"] == "bfloat16"
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert (manifest["format"], manifest["format_version"], manifest["world_size"], manifest["parallel"]) == \
        ("fastckpt.sharded", 4, 2, 3)
    assert set(manifest["files"]) == set(names) - {MANIFEST_FILE}
    assert all(manifest["files"][n]["size"] == (out / n).stat().st_size for n in manifest["files"])
    assert manifest["hashtables"]["emb"] == {"dim": DIM, "dtype": "float32", "slots": list(SLOTS),
                                             "ids": len(global_ids()),
                                             "partition": {"rule": "slice", "slice_size": 65536}}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no staging left


def test_a_stored_file_is_safetensors_the_library_reads(tmp_path):
    safetensors = pytest.importorskip("safetensors.numpy")
    save_ranks(tmp_path / "c", 2, parallel=1)
    got = safetensors.load_file(str(tmp_path / "c" / "model-00001-000.safetensors"))
    assert got["w/part_1_2"].tobytes() == dense_state()["w"][5:].tobytes()


# -- reading and loading ------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 3])
def test_reader_returns_whole_tensors_and_parts_exactly(tmp_path, n):
    save_ranks(tmp_path / "c", n)
    dense = dense_state()
    with CheckpointReader(tmp_path / "c", verify=True) as r:
        for name, array in dense.items():
            got = r.read_tensor(name)
            assert (got.dtype, got.shape, got.tobytes()) == (array.dtype, array.shape, array.tobytes()), name
            assert r.tensor_shape(name) == array.shape and r.tensor_dtype(name) == array.dtype
        if n == 3:
            assert r.read_tensor("w/part_1_3").tobytes() == dense["w"][3:6].tobytes()
            assert r.tensor_shape("w/part_2_3") == (4, 4)
        ids, values, slots = union([t["emb"] for t in rank_tables(n)])
        whole_ids = r.read_tensor("emb.id")
        order = np.argsort(whole_ids)
        assert whole_ids[order].tobytes() == ids.tobytes()
        assert r.read_tensor("emb.embedding")[order].tobytes() == values.tobytes()
        assert r.read_tensor("emb.v")[order].tobytes() == slots["v"].tobytes()
        assert set(r.tensor_names()) == {*dense, "emb.id", "emb.embedding", "emb.m", "emb.v"}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_a_checkpoint_of_n_ranks_loads_exactly_on_m(tmp_path, n, m):
    save_ranks(tmp_path / "c", n, parallel=2)
    dense = dense_state()
    loaded_tables, row_parts = [], {name: [] for name in dense}
    for j in range(m):
        tables = {"emb": HashTable(DIM, slots=SLOTS)}
        tensors: dict = {}
        Loader(str(tmp_path / "c"), hashtables=tables, tensors=tensors, shard_index=j, shard_num=m).load()
        begin, end = slice_of(j, m, SLICE_SIZE)  # the default owner rule of format version 4: RecIS's slices
        positions = slice_positions(tables["emb"].ids(), SLICE_SIZE)
        assert np.all((positions >= begin) & (positions < end))
        loaded_tables.append(tables["emb"])
        for name, array in dense.items():
            assert tensors[name].tobytes() == array.tobytes() and tensors[name].dtype == array.dtype
        rows: dict = {}
        Loader(str(tmp_path / "c"), tensors=rows, shard_index=j, shard_num=m, dense="rows").load()
        for name in dense:
            row_parts[name].append(rows[name])
    got, want = union(loaded_tables), union([t["emb"] for t in rank_tables(n)])
    assert got[0].tobytes() == want[0].tobytes() and got[1].tobytes() == want[1].tobytes()
    assert all(got[2][s].tobytes() == want[2][s].tobytes() for s in SLOTS)
    for name, array in dense.items():
        joined = row_parts[name][0] if array.ndim == 0 else np.concatenate(row_parts[name])
        assert joined.tobytes() == array.tobytes(), name


def test_loading_fills_given_arrays_in_place_and_makes_missing_tables(tmp_path):
    save_ranks(tmp_path / "c", 2)
    w = np.zeros((10, 4), np.float32)
    tensors = {"w": w}
    hashtables: dict = {}
    Loader(str(tmp_path / "c"), hashtables=hashtables, tensors=tensors).load()
    assert tensors["w"] is w and w.tobytes() == dense_state()["w"].tobytes()
    assert list(hashtables) == ["emb"] and len(hashtables["emb"]) == len(global_ids())
    assert hashtables["emb"].slots == SLOTS


def test_a_custom_owner_rule_routes_ids(tmp_path):
    save_ranks(tmp_path / "c", 2)
    tables = {"emb": HashTable(DIM, slots=SLOTS)}
    Loader(str(tmp_path / "c"), hashtables=tables, shard_index=0, shard_num=2,
           owner=lambda ids, n: (ids < 0).astype(np.int64)).load()
    assert np.all(tables["emb"].ids() >= 0) and len(tables["emb"]) == int((global_ids() >= 0).sum())


def test_filters_drop_blocks_on_save_and_entries_on_load(tmp_path):
    drop_w = [lambda blocks: [b for b in blocks if b.tensor != "w"]] * 2
    save_ranks(tmp_path / "c", 2, filter_funcs=drop_w)
    with CheckpointReader(tmp_path / "c") as r:
        assert "w" not in r.tensor_names() and "bias" in r.tensor_names()

    def no_tables(info):
        info["hashtables"].clear()
        return info

    tables: dict = {}
    tensors: dict = {}
    Loader(str(tmp_path / "c"), hashtables=tables, tensors=tensors, filter_func=no_tables).load()
    assert tables == {} and "bias" in tensors
    torn = [lambda blocks: [b for b in blocks if b.kind != "slot"]] * 2
    results = save_ranks(tmp_path / "d", 2, filter_funcs=torn)
    assert all(isinstance(e, ValueError) and "keep or drop a table's id, embedding, slot and deleted blocks together"
               in str(e) for e in results)
    assert not (tmp_path / "d").exists()


def test_fastckpt_open_and_load_file_read_whole_tensors(tmp_path, queue):
    save_ranks(tmp_path / "c", 2, parallel=1)
    with fastckpt.open(tmp_path / "c") as r:
        assert isinstance(r, CheckpointReader) and list(r.keys()) == r.tensor_names() and "w" in r
        assert r.info("w").shape == (10, 4) and r["w"].tobytes() == dense_state()["w"].tobytes()
        assert r.info("w/part_0_2").shape == (5, 4) and "w/part_0_2" in r  # the parts, on request
        assert r["w/part_1_2"].tobytes() == dense_state()["w"][5:].tobytes() and list(r.part_infos)[:1]
        with pytest.raises(KeyError, match=r"close matches: \['emb.id'"):
            r["emb.idd"]
        close = None
        try:
            r.host("emb.idd")
        except KeyError as exc:
            close = re.search(r"close matches: \['([^']+)'", str(exc)).group(1)
        assert r[close].shape == (len(global_ids()),)  # the name suggested is one it reads
    with pytest.warns(fastckpt.errors.NotZeroCopyWarning):
        loaded = fastckpt.load_file(CheckpointReader(tmp_path / "c"), queue)
    assert loaded["w"].to_host().tobytes() == dense_state()["w"].tobytes()


def test_split_sparse_dense_state_dict():
    t = HashTable(2)
    sparse, dense = split_sparse_dense_state_dict({"a": t, "b": np.zeros(1), "c": 3})
    assert sparse == {"a": t} and list(dense) == ["b", "c"]


# -- errors and failures ------------------------------------------------------------------------------
def test_unknown_names_name_close_matches(tmp_path):
    save_ranks(tmp_path / "c", 1)
    with CheckpointReader(tmp_path / "c") as r:
        with pytest.raises(TensorNotFoundError, match=r"no tensor 'wx'.*close matches: \['w'"):
            r.read_tensor("wx")
        with pytest.raises(KeyError):
            r.tensor_shape("emb.idd")
    with pytest.raises(KeyError, match=r"no hashtable 'embb'; close matches: \['emb'\]"):
        Loader(str(tmp_path / "c"), hashtables={"embb": HashTable(DIM)}).load()


def test_a_directory_without_manifest_is_not_a_checkpoint(tmp_path):
    save_ranks(tmp_path / "c", 1)
    os.unlink(tmp_path / "c" / MANIFEST_FILE)
    with pytest.raises(CheckpointNotFoundError, match="no manifest.json"):
        CheckpointReader(tmp_path / "c")


def test_corrupted_and_truncated_files_are_named(tmp_path):
    save_ranks(tmp_path / "c", 2, parallel=1)
    path = tmp_path / "c" / "model-00001-000.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with CheckpointReader(tmp_path / "c", verify=False) as r:
        [problem] = r.verify()
        assert problem.startswith(
            f"model-00001-000.safetensors: BLAKE3 {_hash(path)[:16]}..., the manifest says "
            f"{json.loads((tmp_path / 'c' / MANIFEST_FILE).read_text())['files'][path.name]['blake3'][:16]}...: the "
            "file was changed or damaged after the commit; it holds 9 parts ['bf/part_1_2', 'bias/part_1_2', ")
    path.write_bytes(bytes(data[: len(data) // 2]))
    with CheckpointReader(tmp_path / "c") as r:  # the metadata is whole: it opens, and rank 0's parts read
        assert r.read_tensor("bias/part_0_2").tobytes() == r.read_tensor("bias/part_0_2").tobytes()
        for _ in range(2):  # the truncated file, each time it is touched
            with pytest.raises(FormatError, match="model-00001-000.safetensors: .* bytes, the commit record says"):
                r.read_tensor("bias")
        with pytest.raises(FormatError, match="model-00001-000.safetensors"):
            r.verify()
    (tmp_path / "c" / INDEX_FILE).write_text("{")
    with pytest.raises(ChecksumMismatchError, match="index.json: 1 bytes, the manifest says"):
        CheckpointReader(tmp_path / "c")
    reseal(tmp_path / "c")
    with pytest.raises(FormatError, match="index.json: not valid JSON"):
        CheckpointReader(tmp_path / "c")


def _hash(path) -> str:
    import blake3

    return blake3.blake3(path.read_bytes()).hexdigest()


def test_an_existing_checkpoint_is_replaced_only_when_asked(tmp_path):
    save_ranks(tmp_path / "c", 1)
    result = Saver(path=str(tmp_path / "c"), parallel=1, tensors={"x": np.ones(2)})
    with pytest.raises(FileExistsError, match="pass overwrite=True to replace it") as failure:
        result.save()
    assert failure.value.filename == str(tmp_path / "c")  # a FileExistsError naming the target, not a RuntimeError
    Saver(path=str(tmp_path / "c"), parallel=1, tensors={"x": np.ones(2)}, overwrite=True).save()
    assert CheckpointReader(tmp_path / "c").tensor_names() == ["x"]


def test_every_rank_of_a_save_over_an_existing_checkpoint_raises_file_exists_naming_it(tmp_path):
    save_ranks(tmp_path / "c", 3)
    results = save_ranks(tmp_path / "c", 3)
    assert [type(r) for r in results] == [FileExistsError] * 3, results
    assert [r.filename for r in results] == [str(tmp_path / "c")] * 3
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_a_rank_that_fails_leaves_no_checkpoint_and_no_staging(tmp_path):
    def boom(blocks):
        raise OSError("disk full")

    results = save_ranks(tmp_path / "c", 3, filter_funcs=[lambda b: b, boom, lambda b: b])
    assert isinstance(results[1], OSError)
    assert isinstance(results[0], RuntimeError) and "rank 1: OSError: disk full" in str(results[0])
    assert isinstance(results[2], RuntimeError)
    assert sorted(os.listdir(tmp_path)) == []


def test_a_rank_that_never_arrives_is_named_and_the_next_save_works(tmp_path):
    save_ranks(tmp_path / "previous", 3)
    results = save_ranks(tmp_path / "c", 3, timeout=0.5, ranks=[0, 1])  # rank 2 never starts
    assert isinstance(results[0], BarrierTimeoutError) and results[0].missing == (2,)
    assert "2" in str(results[0])
    assert sorted(os.listdir(tmp_path)) == ["previous"]  # the previous checkpoint stays the latest
    assert save_ranks(tmp_path / "c", 3) == [str(tmp_path / "c")] * 3
    assert sorted(os.listdir(tmp_path)) == ["c", "previous"]


def test_docs_carry_the_same_format_spec_as_the_module():
    from pathlib import Path

    import fastckpt.sharded.format as fmt

    docs = (Path(__file__).resolve().parent.parent / "docs" / "formats" / "sharded.md").read_text(encoding="utf-8")
    spec = fmt.__doc__[fmt.__doc__.index("Sharded checkpoint format, versions 1 to"):fmt.__doc__.index("\n>>>")]
    block = docs[docs.index("```text\n") + len("```text\n"):].rsplit("\n```", 1)[0]
    assert block == spec.rstrip("\n")


# -- the command line ---------------------------------------------------------------------------------
def test_cli_inspect_verify_and_reshard(tmp_path, capsys):
    from fastckpt.cli import main

    save_ranks(tmp_path / "c", 4)
    assert main(["inspect", str(tmp_path / "c"), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["format"] == "fastckpt.sharded" and d["world_size"] == 4 and len(d["files"]) == 4 * 2 + 3
    assert d["hashtables"]["emb"]["ids"] == len(global_ids())
    shapes = {t["name"]: t["shape"] for t in d["tensors"]}  # whole tensors, by their names
    assert shapes["emb.id"] == [len(global_ids())] and shapes["w"] == list(dense_state()["w"].shape)
    assert main(["verify", str(tmp_path / "c")]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["reshard", str(tmp_path / "c"), str(tmp_path / "r"), "--shards", "3", "--parallel", "1"]) == 0
    capsys.readouterr()
    with CheckpointReader(tmp_path / "r") as r, CheckpointReader(tmp_path / "c") as c:
        assert r.manifest["world_size"] == 3 and len(os.listdir(tmp_path / "r")) == 3 + 4
        for name in c.tensor_names():
            a, b = c.read_tensor(name), r.read_tensor(name)
            if name.startswith("emb."):  # the same rows, in another order: sort by id
                a, b = a[np.argsort(c.read_tensor("emb.id"))], b[np.argsort(r.read_tensor("emb.id"))]
            assert a.tobytes() == b.tobytes(), name
        positions = slice_positions(r.read_tensor("emb.id/part_1_3"), SLICE_SIZE)  # rank 1 of 3 holds its slices
        assert len(positions) and np.all((positions >= slice_of(1, 3)[0]) & (positions < slice_of(1, 3)[1]))
    (tmp_path / "c" / "model-00002-001.safetensors").write_bytes(b"x")
    assert main(["verify", str(tmp_path / "c")]) == 1
    assert "model-00002-001.safetensors" in capsys.readouterr().out


@pytest.mark.parametrize("name, damage, message", [
    (MANIFEST_FILE, lambda t: t.replace('"fastckpt.sharded"', '"other"'), "'format' is 'other'"),
    (MANIFEST_FILE, lambda t: t[: len(t) // 2], "manifest.json: not valid JSON"),
    (MANIFEST_FILE, lambda t: t.replace('"format_version": 4', '"format_version": 9'), "format version 9 is newer"),
    (TENSORKEY_FILE, lambda t: t.replace('"w"', '"v"', 1), "disagree"),
    (TENSORKEY_FILE, lambda t: "[]", "tensorkey.json: expected a JSON object"),
    (DESCRIPTION_FILE, lambda t: t[:-3], "not valid JSON"),
    (DESCRIPTION_FILE, lambda t: t.replace('"shape": [\n   5,\n   4\n  ]', '"shape": [\n   6,\n   4\n  ]', 1),
     r"entry 'w/part_1_2': rows \[5, 10\) of shape \[5, 4\]: expected rows from 6"),
    (INDEX_FILE, lambda t: t.replace('"model-00001-000.safetensors": 1', '"model-00001-000.safetensors": 7'),
     "file_index"),
])
def test_damaged_metadata_files_are_named(tmp_path, name, damage, message):
    save_ranks(tmp_path / "c", 2, parallel=1)
    path = tmp_path / "c" / name
    path.write_text(damage(path.read_text()))
    if name != MANIFEST_FILE:  # caught by its hash in the manifest, before anything else
        with pytest.raises(ChecksumMismatchError, match=f"{name}: "):
            CheckpointReader(tmp_path / "c")
        reseal(tmp_path / "c")  # rewritten consistently: the cross-checks catch it
    with pytest.raises(FormatError, match=message):
        CheckpointReader(tmp_path / "c")


@pytest.mark.parametrize("load_on", [1, 3, 7])
def test_ranks_loading_as_threads_build_the_tables_insert_builds(tmp_path, load_on):
    """7 ranks save (two of them nothing, one a single id; negative ids and the int64 extremes among the rest); each
    rank of a load, all at once as threads, builds its table (the rows adopted, the index built without the GIL):
    exactly the table that inserting its ids and rows makes."""
    rng = np.random.default_rng(load_on)
    ids = np.unique(np.concatenate([rng.integers(-(2**63), 2**63 - 1, 30_000, dtype=np.int64),
                                    np.arange(-40, 40), [np.iinfo(np.int64).min, np.iinfo(np.int64).max]]))
    saved_by = rng.integers(0, 7, len(ids))
    saved_by[np.isin(saved_by, [2, 5])] = 0  # ranks 2 and 5 save empty tables
    saved_by[ids == 7] = 6
    saved_by[(saved_by == 6) & (ids != 7)] = 1  # rank 6 saves one id
    engines = ThreadEngine.group(7)
    tables = []
    for r in range(7):
        mine = ids[saved_by == r]
        t = HashTable(DIM, slots=SLOTS, name="emb")
        values, slots = table_rows(mine, 0)
        t.insert(mine[::-1].copy(), values[::-1].copy(), {s: a[::-1].copy() for s, a in slots.items()})
        tables.append(t)
    out = str(tmp_path / "c")

    def save(r):
        return Saver(shard_index=r, shard_num=7, parallel=3, path=out, hashtables={"emb": tables[r]},
                     engine=engines[r], timeout=30).save()

    def load(r):
        return Loader(out, shard_index=r, shard_num=load_on, parallel=3).load()[0]["emb"]

    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(7) as pool:
        assert list(pool.map(save, range(7))) == [out] * 7
    with concurrent.futures.ThreadPoolExecutor(load_on) as pool:
        loaded = list(pool.map(load, range(load_on)))
    for r, table in enumerate(loaded):
        mine = ids[slice_owner(ids, load_on) == r]  # format version 4's rule: the rank's key-space slices
        expected = HashTable(DIM, slots=SLOTS)
        values, slots = table_rows(mine, 0)
        expected.insert(mine, values, slots)
        assert table == expected and len(table) == len(mine)
        assert np.array_equal(table.lookup_slot("v", mine), slots["v"])
    assert sum(len(t) for t in loaded) == len(ids)


def test_a_save_fsyncs_each_file_once_and_the_directories_only_at_the_commit(tmp_path):
    """Every file's data is fsynced (the tensor files by their ranks, the metadata by the commit); the names are made
    durable by the commit's one fsync of the staging directory and one of the parent, not by one more directory
    fsync per tensor file."""
    from faults import Faults

    out = tmp_path / "c"
    with Faults(tmp_path) as faults:
        assert save_ranks(out, 2, parallel=2) == [str(out)] * 2
    synced = [path for kind, path in faults.calls if kind == "fsync"]
    names = set(os.listdir(out))
    files = sorted(os.path.basename(path) for path in synced if os.path.basename(path) in names)
    others = [path for path in synced if os.path.basename(path) not in names]  # directories, temporaries
    assert files == sorted(names)
    assert len(others) == 2 and os.path.basename(others[0]).endswith(".partial"), others  # the staging directory
    assert os.path.abspath(others[1]) == str(tmp_path)  # then the parent, after the rename


def test_an_id_saved_by_two_ranks_is_named_on_load(tmp_path):
    engines = ThreadEngine.group(2)
    results = [None, None]

    def run(r):
        t = HashTable(1, name="emb")
        t.insert([4, 10 + r], [[float(r)], [1.0]])
        results[r] = Saver(shard_index=r, shard_num=2, parallel=1, path=str(tmp_path / "c"),
                           hashtables={"emb": t}, engine=engines[r], timeout=30).save()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [str(tmp_path / "c")] * 2
    with pytest.raises(FormatError, match=r"hashtable 'emb': the ids must be distinct \(1 repeated\) across "
                                          r"its id parts \['emb.id/part_0_2', 'emb.id/part_1_2'\] \(each id must be"):
        Loader(str(tmp_path / "c")).load()
