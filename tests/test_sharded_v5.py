"""Sharded format version 5: tables of any row shape in fastckpt's own layout (issue 30 item 1).

A table whose embedding rows have more than one axis (``[n, 2, 3]``) or whose slots have row shapes and dtypes of
their own (RecIS's step filter: int64 ``[n, 1]``) is saved in the default layout as version 5: the manifest records
the rows, the reader checks the descriptions and the tensor files' headers against them, the Loader builds the
table from them, and reshard carries them between fastckpt's layout and RecIS's (byte for byte what RecIS's save
path writes, tests/_recis_writer.py) and from N ranks to M. Tables of ``[dim]`` rows stay version 4."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from _sharded_edit import reseal, save_threads
from fastckpt.errors import FormatError
from fastckpt.sharded import CheckpointReader, DeltaPolicy, HashTable, Loader, Saver
from fastckpt.sharded.format import DESCRIPTION_FILE, FORMAT_VERSION, MANIFEST_FILE, slice_owner, slice_positions
from fastckpt.sharded.reshard import compact, reshard

pytestmark = pytest.mark.filterwarnings("ignore::fastckpt.sharded.recis.RecisWarning")  # the port writes no manifest

SLOTS = (("step_filter", 1, np.int64), "m")
SHAPE = (2, 3)


def _rows(n: int, seed: int, span: int = 65536):
    """``n`` distinct ids over 8 key spaces of ``span`` (negative ones too) and their rows."""
    rng = np.random.default_rng(seed)
    ids = rng.choice(np.arange(-3 * span, 5 * span), n, replace=False).astype(np.int64)
    return ids, {"embedding": rng.standard_normal((n, *SHAPE)).astype(np.float32),
                 "step_filter": rng.integers(0, 1000, (n, 1)).astype(np.int64),
                 "m": rng.standard_normal((n, *SHAPE)).astype(np.float32)}


def _table(ids, rows, name="user") -> HashTable:
    table = HashTable(SHAPE, slots=SLOTS, name=name)
    table.insert(ids, rows["embedding"], {"step_filter": rows["step_filter"], "m": rows["m"]})
    return table


def _save(path, ids, rows, ranks=2, parallel=2, **options) -> str:
    """A save by ``ranks`` thread-ranks, rank ``r`` holding every ``ranks``-th id (any rank may hold any id)."""
    tables = [{"user": _table(ids[r::ranks], {k: v[r::ranks] for k, v in rows.items()})} for r in range(ranks)]
    return save_threads(path, tables, {"w": np.arange(12, dtype=np.float32).reshape(4, 3)}, parallel, **options)


def _check_loaded(tables: list[HashTable], ids, rows, shard_num: int, slice_size: int = 65536) -> None:
    """Every id once over the ranks, on the rank of its slice, each row of the embedding and of every slot exact."""
    at = {int(i): r for r, i in enumerate(ids)}
    seen = []
    for j, table in enumerate(tables):
        assert table.shape == SHAPE and table.slots == ("step_filter", "m")
        assert table.slot_specs == {"step_filter": ((1,), np.dtype(np.int64)), "m": (SHAPE, np.dtype(np.float32))}
        got = table.ids()
        assert (slice_owner(got, shard_num, slice_size) == j).all()
        where = [at[int(i)] for i in got]
        assert table.lookup(got).tobytes() == rows["embedding"][where].tobytes()
        for slot in ("step_filter", "m"):
            assert table.lookup_slot(slot, got).tobytes() == rows[slot][where].tobytes(), slot
        seen += got.tolist()
    assert sorted(seen) == sorted(ids.tolist())


def _load(path, shard_num: int, **options) -> list[HashTable]:
    return [Loader(str(path), shard_index=j, shard_num=shard_num, **options).load()[0]["user"]
            for j in range(shard_num)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    ids, rows = _rows(700, 1)
    return _save(tmp_path_factory.mktemp("v5") / "c", ids, rows), ids, rows


@pytest.mark.parametrize("shard_num", [1, 3])
def test_a_table_of_shaped_rows_and_a_filter_slot_saves_in_the_default_layout_and_loads_exact(saved, shard_num):
    path, ids, rows = saved
    manifest = json.loads(open(os.path.join(path, MANIFEST_FILE), encoding="utf-8").read())
    assert manifest["format_version"] == 5
    entry = manifest["hashtables"]["user"]
    assert (entry["dim"], entry["shape"], entry["dtype"], entry["slots"]) == (6, [2, 3], "float32", ["step_filter", "m"])
    assert entry["slot_specs"] == {"step_filter": {"shape": [1], "dtype": "int64"}, "m": {"shape": [2, 3],
                                                                                          "dtype": "float32"}}
    with CheckpointReader(path) as reader:
        assert reader.tensor_shape("user.embedding") == (700, 2, 3)
        assert reader.tensor_shape("user.step_filter") == (700, 1) and reader.tensor_dtype("user.step_filter") == \
            np.int64
        assert reader.verify() == []
    _check_loaded(_load(path, shard_num), ids, rows, shard_num)


def test_a_given_table_is_filled_with_its_slots_and_one_it_cannot_hold_is_refused(saved):
    path, ids, rows = saved
    mine = {"user": HashTable(SHAPE, slots=(("step_filter", 1, np.int64),))}
    Loader(path, hashtables=mine).load()
    order = np.argsort(ids)
    assert mine["user"].export()[2]["step_filter"].tobytes() == rows["step_filter"][order].tobytes()
    with pytest.raises(ValueError, match=r"slot 'step_filter' holds rows of shape \(1,\) int64 in the checkpoint, "
                                         r"the table given has \(2, 3\) float32: give the table that slot as "
                                         r"\('step_filter', \(1,\), 'int64'\)"):
        Loader(path, hashtables={"user": HashTable(SHAPE, slots=("step_filter",))}).load()
    with pytest.raises(ValueError, match=r"is shape \(2, 3\) float32 in the checkpoint, the table given is dim 6"):
        Loader(path, hashtables={"user": HashTable(6)}).load()


def test_tables_of_plain_rows_are_still_saved_as_version_4(tmp_path):
    table = HashTable(4, slots=("m",))
    table.insert([1, 2], np.ones((2, 4)))
    Saver(path=str(tmp_path / "c"), parallel=1, hashtables={"t": table}).save()
    manifest = json.loads((tmp_path / "c" / MANIFEST_FILE).read_text())
    assert manifest["format_version"] == 4
    assert "shape" not in manifest["hashtables"]["t"] and "slot_specs" not in manifest["hashtables"]["t"]


def test_recis_with_a_filter_slot_slices_of_1000_and_shaped_rows_through_fastckpt_and_back_is_recis_bytes(tmp_path):
    """A RecIS directory (step filter, Adam, slice size 1000, [n, 2, 3] embeddings) resharded into fastckpt's
    layout (version 5) and back into RecIS's: on the source's ranks, the source's own bytes; on others, what RecIS's
    save path writes for that state."""
    from test_recis_tables import _recis_load_all, _recis_save, _same_files, _table_state

    ids, rows = _table_state(300, SHAPE, 5, 1000)
    order = np.argsort(slice_positions(ids, 1000), kind="stable")  # each RecIS rank's rows in slice order
    ids, rows = ids[order], {k: v[order] for k, v in rows.items()}
    # in name order: fastckpt's layout lists dense tensors by name, so RecIS's save order of them is not kept
    dense = {"global_step": np.array(7, np.int64), "w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    src = _recis_save(tmp_path / "src", 2, ids, rows, SHAPE, dense, slice_size=1000)
    for fc_ranks in (1, 3):
        fc = reshard(src, str(tmp_path / f"fc{fc_ranks}"), fc_ranks, layout="fastckpt")
        manifest = json.loads(open(os.path.join(fc, MANIFEST_FILE), encoding="utf-8").read())
        entry = manifest["hashtables"]["user"]
        assert manifest["format_version"] == 5 and entry["partition"]["slice_size"] == 1000
        assert entry["shape"] == [2, 3] and entry["slot_specs"]["step_filter"] == {"shape": [1], "dtype": "int64"}
        assert entry["slots"] == ["step_filter", "sparse_adam_exp_avg", "sparse_adam_exp_avg_sq"]  # RecIS's order
        back = reshard(fc, str(tmp_path / f"back{fc_ranks}"), 2, layout="recis")
        _same_files(back, src)
        for m in (1, 3):
            out = reshard(fc, str(tmp_path / f"back{fc_ranks}-{m}"), m, layout="recis")
            _same_files(out, _recis_save(tmp_path / f"ref{fc_ranks}-{m}", m, ids, rows, SHAPE, dense,
                                         slice_size=1000))
            got, _ = _recis_load_all(out, m, SHAPE, 1000)  # RecIS's loader of that slice size finds every id
            assert sorted(got) == sorted(ids.tolist())


@pytest.mark.parametrize("saved_by, resharded_to", [(2, 3), (3, 1), (1, 4)])
def test_n_to_m_reshard_of_a_version_5_table_is_exact(tmp_path, saved_by, resharded_to):
    ids, rows = _rows(900, 2)
    src = _save(tmp_path / "src", ids, rows, ranks=saved_by, parallel=1)
    out = reshard(src, str(tmp_path / "out"), resharded_to)
    with CheckpointReader(out) as reader:
        assert reader.manifest["format_version"] == 5 and reader.manifest["world_size"] == resharded_to
        assert reader.verify() == []
        for j, key in enumerate(reader.part_names("user.id")):  # each new rank holds the ids of its slices
            assert (slice_owner(reader.array(key), resharded_to) == j).all()
    for shard_num in (1, 2):
        _check_loaded(_load(out, shard_num), ids, rows, shard_num)
    assert Loader(out).load()[1]["w"].tolist() == np.arange(12, dtype=np.float32).reshape(4, 3).tolist()


def test_a_delta_chain_of_version_5_tables_loads_and_compacts_exact(tmp_path):
    ids, rows = _rows(400, 3)
    tables = [{"user": _table(ids[r::2], {k: v[r::2] for k, v in rows.items()})} for r in range(2)]
    save_threads(tmp_path / "full", tables, {}, 1, incremental=DeltaPolicy(max_fraction=1.0))
    gone, changed = ids[:10], ids[10:20]
    for t in tables:
        t["user"].delete(gone)
        mine = np.isin(changed, t["user"].ids())
        t["user"].update(changed[mine], np.full((int(mine.sum()), *SHAPE), 9.5, np.float32),
                         slots={"step_filter": np.full((int(mine.sum()), 1), -4, np.int64)})
    save_threads(tmp_path / "delta", tables, {}, 1, incremental=DeltaPolicy(max_fraction=1.0))
    with CheckpointReader(str(tmp_path / "delta")) as reader:
        assert reader.manifest["kind"] == "delta" and reader.manifest["format_version"] == 5
    keep = np.flatnonzero(~np.isin(ids, gone))
    want = {k: v.copy() for k, v in rows.items()}
    at = np.isin(ids, changed)
    want["embedding"][at], want["step_filter"][at] = 9.5, -4
    ids, want = ids[keep], {k: v[keep] for k, v in want.items()}
    for path in (str(tmp_path / "delta"), compact(str(tmp_path / "delta"), str(tmp_path / "compact"))):
        for shard_num in (1, 3):
            _check_loaded(_load(path, shard_num), ids, want, shard_num)


def test_encoded_version_5_tables_keep_their_shapes_and_integer_slots_exact(tmp_path):
    ids, rows = _rows(300, 4)
    zstd = _save(tmp_path / "zstd", ids, rows, compression="zstd")
    _check_loaded(_load(zstd, 2), ids, rows, 2)
    quantized = _save(tmp_path / "q", ids, rows, quantize="int8")
    with CheckpointReader(quantized) as reader:
        assert reader.descriptions["user.step_filter/part_0_2"]["encoding"]["transform"] is None  # never quantized
        assert reader.descriptions["user.embedding/part_0_2"]["encoding"]["shape"] == [150, 2, 3]
        bound = reader.manifest["hashtables"]["user"]["encoding"]["max_abs_error"]
    table = Loader(quantized, allow_lossy=True).load()[0]["user"]
    order = np.argsort(ids)
    assert table.export()[2]["step_filter"].tobytes() == rows["step_filter"][order].tobytes()
    assert 0 < np.abs(table.export()[1] - rows["embedding"][order]).max() <= bound


def _edit(src, dst, manifest_edit=None, description_edit=None) -> str:
    """A copy of ``src`` with its manifest and description file edited, every hash and the checksum resealed (what
    the loaders' cross-checks catch, apart from what the hashes catch)."""
    import shutil

    shutil.copytree(src, dst)
    if description_edit is not None:
        descriptions = json.loads((dst / DESCRIPTION_FILE).read_text())
        description_edit(descriptions)
        (dst / DESCRIPTION_FILE).write_text(json.dumps(descriptions, indent=1, sort_keys=True) + "\n")
    manifest = json.loads((dst / MANIFEST_FILE).read_text())
    if manifest_edit is not None:
        manifest_edit(manifest)
    reseal(dst, manifest)
    return str(dst)


def _entry(m):
    return m["hashtables"]["user"]


def _retype_slot(descriptions):
    for key, desc in descriptions.items():
        if desc["tensor"] == "user.step_filter":
            desc["dtype"] = "int32"


DAMAGED = {
    "slot dtype": (lambda m: _entry(m)["slot_specs"]["step_filter"].update(dtype="int32"), None,
                   rf"{DESCRIPTION_FILE}: entry 'user.step_filter/part_0_2': int64\[350, 1\], expected int32\[350, "
                   r"1\] \(table 'user', part 0 of 2; manifest.json: hashtables\['user'\].slot_specs\['step_filter'\]\)"),
    "slot shape": (lambda m: _entry(m)["slot_specs"]["step_filter"].update(shape=[2]), None,
                   r"entry 'user.step_filter/part_0_2': int64\[350, 1\], expected int64\[350, 2\]"),
    "row shape": (lambda m: _entry(m).update(shape=[3, 2]), None,
                  r"entry 'user.embedding/part_0_2': float32\[350, 2, 3\], expected float32\[350, 3, 2\] \(table "
                  r"'user', part 0 of 2; manifest.json: hashtables\['user'\].shape\)"),
    "shape not dim": (lambda m: _entry(m).update(shape=[2, 2]), None,
                      r"manifest.json: hashtables\['user'\]: 'shape' \[2, 2\] holds 4 values a row, 'dim' says 6"),
    "slot missing": (lambda m: _entry(m)["slot_specs"].pop("m"), None,
                     r"hashtables\['user'\]: 'slot_specs' must be .* for exactly the slots \['step_filter', 'm'\]"),
    "bad row shape": (lambda m: _entry(m)["slot_specs"]["m"].update(shape=[2, 0, 3]), None,
                      r"slot_specs\['m'\] must be \{'shape': \[int >= 1, ...\], 'dtype': str\}"),
    "unknown dtype": (lambda m: _entry(m)["slot_specs"]["m"].update(dtype="object"), None,
                      r"hashtables\['user'\]: slot_specs\['m'\]: unknown dtype 'object'"),
    "shape in version 4": (lambda m: m.update(format_version=4), None,
                           r"hashtables\['user'\]: 'shape' and 'slot_specs' need format_version 5, got 4"),
    "newer version": (lambda m: m.update(format_version=FORMAT_VERSION + 1), None,
                      f"format version {FORMAT_VERSION + 1} is newer than this fastckpt reads \\({FORMAT_VERSION}\\); "
                      "upgrade fastckpt"),
    # the metadata agree with each other, not with the tensor file: its header is checked before a byte is placed
    "header": (lambda m: _entry(m)["slot_specs"]["step_filter"].update(dtype="int32"), _retype_slot,
               r"model-00000-00[01]\.safetensors: tensor 'user.step_filter/part_0_2' is int64\[350, 1\] in the "
               rf"safetensors header, {DESCRIPTION_FILE} says int32\[350, 1\]"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_damaged_version_5_descriptions_are_refused_naming_the_file_and_the_tensor(saved, tmp_path, case):
    path, *_ = saved
    manifest_edit, description_edit, message = DAMAGED[case]
    damaged = _edit(__import__("pathlib").Path(path), tmp_path / "d", manifest_edit, description_edit)
    with pytest.raises(FormatError, match=message):
        with CheckpointReader(damaged) as r:  # the metadata when it opens, a file's header when the file is used
            r.verify()
    target = {"user": HashTable(SHAPE, slots=SLOTS)}
    with pytest.raises(FormatError, match=message):
        Loader(damaged, hashtables=target).load()
    assert len(target["user"]) == 0  # nothing placed


@pytest.mark.parametrize("verify", [False, True])
def test_a_version_5_checkpoint_saved_to_and_loaded_from_s3_is_exact(s3, verify):
    """Ranged reads of a rank's share (rows of [2, 3] and [1] of their own sizes) and whole-file fetches."""
    ids, rows = _rows(500, 6)
    url = s3.url("c")
    tables = [{"user": _table(ids[r::2], {k: v[r::2] for k, v in rows.items()})} for r in range(2)]
    save_threads(url, tables, {}, 2, storage_options=s3.storage_options)
    for shard_num in (1, 3):
        _check_loaded([Loader(url, shard_index=j, shard_num=shard_num, storage_options=s3.storage_options,
                              verify=verify).load()[0]["user"] for j in range(shard_num)], ids, rows, shard_num)


def test_inspect_shows_the_row_shapes_and_the_slots_of_their_own(saved):
    from fastckpt.cli.inspect import _format_table, describe

    path, *_ = saved
    assert "hashtable user: 700 ids x [2, 3] float32, slots ['step_filter' int64[1], 'm']" in \
        _format_table(describe(path)).splitlines()
