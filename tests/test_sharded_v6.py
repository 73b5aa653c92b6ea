"""Sharded format version 6: names holding '/' in fastckpt's own layout (issue 30 item 1).

RecIS names dense tensors ``tower/dense/kernel``; its layout breaks only on '/part_'. fastckpt's readers split a
stored key at its last ``/part_<i>_<n>``, so a dense tensor, a table and a slot may hold '/' too: a save writes
version 6 only where a name needs it (readers of version 5 and older refuse it as newer), '/part_' and control
characters stay refused before anything is written, and reshard carries such names between fastckpt's layout and
RecIS's (byte for byte what RecIS's save path writes, tests/_recis_writer.py) and from N ranks to M."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import _recis_writer as recis_port
import numpy as np
import pytest
from _sharded_edit import reseal, save_threads

import fastckpt
from fastckpt.errors import FormatError
from fastckpt.sharded import CheckpointReader, DeltaPolicy, HashTable, Loader, Saver
from fastckpt.sharded import format as sharded_format
from fastckpt.sharded.format import MANIFEST_FILE, slice_owner
from fastckpt.sharded.reshard import compact, reshard

pytestmark = pytest.mark.filterwarnings("ignore::fastckpt.sharded.recis.RecisWarning")  # the port writes no manifest

TABLE, SLOT = "tower/user", "adam/m"
DENSE = {"tower/dense/kernel": np.arange(24, dtype=np.float32).reshape(6, 4) / 8,
         "tower/dense/bias": np.arange(4, dtype=np.float16), "global/step": np.array(11, np.int64),
         "a//b/": np.arange(3, dtype=np.int32)}


def _rows(n: int, seed: int):
    rng = np.random.default_rng(seed)
    ids = rng.choice(np.arange(-3 * 65536, 5 * 65536), n, replace=False).astype(np.int64)
    return ids, {"embedding": rng.standard_normal((n, 4)).astype(np.float32),
                 SLOT: rng.standard_normal((n, 4)).astype(np.float32),
                 "v": rng.random((n, 4)).astype(np.float32)}


def _table(ids, rows) -> HashTable:
    table = HashTable(4, slots=(SLOT, "v"), name=TABLE)
    table.insert(ids, rows["embedding"], {SLOT: rows[SLOT], "v": rows["v"]})
    return table


def _save(path, ids, rows, ranks=2, parallel=2, **options) -> str:
    """A save by ``ranks`` thread-ranks, rank ``r`` holding every ``ranks``-th id (any rank may hold any id)."""
    tables = [{TABLE: _table(ids[r::ranks], {k: v[r::ranks] for k, v in rows.items()})} for r in range(ranks)]
    return save_threads(path, tables, DENSE, parallel, **options)


def _manifest(path) -> dict:
    return json.loads(Path(path, MANIFEST_FILE).read_text(encoding="utf-8"))


def _check_loaded(path, ids, rows, shard_num: int, **options) -> None:
    """Loaded on ``shard_num`` ranks: every id once, on the rank of its slice, every row of the embedding and of both
    slots exact; the dense tensors exact on every rank."""
    at = {int(i): r for r, i in enumerate(ids)}
    seen = []
    for j in range(shard_num):
        tables, tensors = Loader(str(path), shard_index=j, shard_num=shard_num, **options).load()
        assert list(tables) == [TABLE] and tables[TABLE].slots == (SLOT, "v")
        assert sorted(tensors) == sorted(DENSE)
        for name, value in DENSE.items():
            assert tensors[name].dtype == value.dtype and tensors[name].tobytes() == value.tobytes(), name
        table = tables[TABLE]
        got = table.ids()
        assert (slice_owner(got, shard_num) == j).all()
        where = [at[int(i)] for i in got]
        assert table.lookup(got).tobytes() == rows["embedding"][where].tobytes()
        for slot in (SLOT, "v"):
            assert table.lookup_slot(slot, got).tobytes() == rows[slot][where].tobytes(), slot
        seen += got.tolist()
    assert sorted(seen) == sorted(ids.tolist())


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_names_with_a_slash_save_as_version_6_and_load_exact_on_the_same_ranks(tmp_path, ranks):
    ids, rows = _rows(500, ranks)
    path = _save(tmp_path / "c", ids, rows, ranks=ranks)
    manifest = _manifest(path)
    assert manifest["format_version"] == 6
    assert list(manifest["hashtables"]) == [TABLE] and manifest["hashtables"][TABLE]["slots"] == [SLOT, "v"]
    assert manifest["hashtables"][TABLE]["shape"] == [4]  # version 6 records row shapes, as version 5 does
    with CheckpointReader(path) as reader:
        assert reader.verify() == []
        assert f"{TABLE}.{SLOT}" in reader.tensor_names() and "tower/dense/kernel" in reader.tensor_names()
        assert reader.part_names("tower/dense/kernel") == [f"tower/dense/kernel/part_{i}_{ranks}" for i in range(ranks)]
        assert reader.read_tensor("tower/dense/kernel").tobytes() == DENSE["tower/dense/kernel"].tobytes()
        assert reader.read_tensor("a//b/").tobytes() == DENSE["a//b/"].tobytes()
    _check_loaded(path, ids, rows, ranks)


@pytest.mark.parametrize("saved_by, loaded_by", [(4, 3), (2, 3), (3, 1), (1, 4)])
def test_names_with_a_slash_load_and_reshard_n_to_m_exact(tmp_path, saved_by, loaded_by):
    ids, rows = _rows(700, 10 + saved_by)
    src = _save(tmp_path / "src", ids, rows, ranks=saved_by, parallel=1)
    _check_loaded(src, ids, rows, loaded_by)
    out = reshard(src, str(tmp_path / "out"), loaded_by)
    manifest = _manifest(out)
    assert (manifest["format_version"], manifest["world_size"]) == (6, loaded_by)
    with CheckpointReader(out) as reader:
        assert reader.verify() == []
        for j, key in enumerate(reader.part_names(f"{TABLE}.id")):  # each new rank holds the ids of its slices
            assert key == f"{TABLE}.id/part_{j}_{loaded_by}" and (slice_owner(reader.array(key), loaded_by) == j).all()
    for shard_num in {1, loaded_by, saved_by}:
        _check_loaded(out, ids, rows, shard_num)


def test_other_names_are_still_written_as_the_oldest_version_that_holds_them(tmp_path):
    table = HashTable(4, slots=("m",))
    table.insert([1, 2], np.ones((2, 4)))
    Saver(path=str(tmp_path / "v4"), parallel=1, hashtables={"tower.user": table}, tensors={"a.b": np.ones(2)}).save()
    assert _manifest(tmp_path / "v4")["format_version"] == 4
    shaped = HashTable((2, 2), slots=(("step_filter", 1, np.int64),))
    Saver(path=str(tmp_path / "v5"), parallel=1, hashtables={"t": shaped}).save()
    assert _manifest(tmp_path / "v5")["format_version"] == 5
    for name, kwargs in [("dense", {"tensors": {"w/x": np.ones(2)}}), ("table", {"hashtables": {"t/x": table}}),
                         ("slot", {"hashtables": {"t": HashTable(4, slots=("m/x",))}})]:
        Saver(path=str(tmp_path / name), parallel=1, **kwargs).save()
        assert _manifest(tmp_path / name)["format_version"] == 6, name


@pytest.mark.parametrize("name, what, message", [
    ("w/part_0_1", "tensors", ("tensor name 'w/part_0_1' holds '/part_' at position 1 (the suffix of every stored "
                               "part, '/part_<i>_<n>', which RecIS's layout breaks on): fastckpt's sharded layout "
                               "does not store such a name; rename the tensor")),
    ("tower/part_x", "table", "hashtable name 'tower/part_x' holds '/part_' at position 5"),
    ("adam/part_m", "slot", "hashtable 'tower/user' slot name 'adam/part_m' holds '/part_' at position 4"),
    ("tower/\nkernel", "tensors", r"tensor name 'tower/\nkernel' holds '\n' at position 6, a control character"),
    ("tower/user\x85", "table", r"hashtable name 'tower/user\x85' holds '\x85' at position 10, a control character"),
    ("m\u2028", "slot", r"slot name 'm\u2028' holds '\u2028' at position 1, a control character"),
])
def test_part_suffixes_and_control_characters_are_refused_before_anything_is_written(tmp_path, name, what, message):
    if what == "tensors":
        kwargs = {"tensors": {name: np.ones(2)}}
    else:
        table = HashTable(2, slots=(name,) if what == "slot" else ())
        kwargs = {"hashtables": {TABLE if what == "slot" else name: table}}
    with pytest.raises(ValueError) as caught:
        Saver(path=str(tmp_path / "c"), parallel=1, **kwargs).save()
    assert message in str(caught.value)
    assert os.listdir(tmp_path) == []  # nothing written, not even the staging directory


def test_a_reader_of_version_5_refuses_version_6_as_newer(tmp_path, monkeypatch):
    """What fastckpt 0.6 (which reads up to version 5) runs on a version-6 manifest: its version check, before it
    reads anything else."""
    ids, rows = _rows(50, 3)
    path = _save(tmp_path / "c", ids, rows)
    monkeypatch.setattr(sharded_format, "FORMAT_VERSION", 5)
    sharded_format._checked.clear()  # the manifest was checked by this process's save: check it again
    message = "manifest.json: format version 6 is newer than this fastckpt reads (5); upgrade fastckpt"
    with pytest.raises(FormatError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CheckpointReader(path)
    target = {TABLE: HashTable(4, slots=(SLOT, "v"))}
    with pytest.raises(FormatError, match="is newer than this fastckpt reads"):
        Loader(path, hashtables=target).load()
    assert len(target[TABLE]) == 0


@pytest.mark.parametrize("version", [4, 5])
def test_a_manifest_of_an_older_version_holding_a_name_with_a_slash_is_refused(tmp_path, version):
    """Versions 1-5 promise their readers that no name holds '/': a manifest of one that does is refused, naming
    the name (the metadata edited consistently, every hash resealed)."""
    table = HashTable(4, slots=("m",))
    table.insert([1, 2], np.ones((2, 4)))
    src = tmp_path / "src"
    Saver(path=str(src), parallel=1, hashtables={"t/x": table}).save()
    damaged = tmp_path / "d"
    shutil.copytree(src, damaged)
    manifest = _manifest(damaged)
    manifest["format_version"] = version
    if version < 5:
        for entry in manifest["hashtables"].values():
            del entry["shape"], entry["slot_specs"]
    reseal(damaged, manifest)
    with pytest.raises(FormatError, match=rf"manifest.json: hashtable name 't/x' holds '/' at position 1: names "
                                          rf"holding '/' need format_version 6, got {version}"):
        CheckpointReader(damaged)


def _recis_save(path, n, ids, rows, dense, parallel=2):
    """RecIS's save on ``n`` ranks of a table ``tower/user`` (embedding, step filter, Adam) and ``dense``: each rank's
    HashTable holds the ids of its slice, in slice order."""
    owner = slice_owner(ids, n)
    ranks = []
    for i in range(n):
        mine = np.flatnonzero(owner == i)
        table = recis_port.Table([4], slice_=recis_port.gen_slice(i, n), filter_hook="step_filter", optimizer="adam")
        table.insert(ids[mine], {slot.name: rows[slot.name][mine] for slot in table.slot_group.slots})
        ranks.append(table.write_tables(TABLE))
    return recis_port.write_checkpoint(str(path), ranks, dense, parallel=parallel)


def _same_files(ours, ref, manifest=True):
    """Every file of ``ref``, byte for byte, and no other (but fastckpt's manifest beside RecIS's files)."""
    assert sorted(os.listdir(ours)) == sorted([*os.listdir(ref), *(["manifest.json"] if manifest else [])])
    for name in os.listdir(ref):
        assert Path(ours, name).read_bytes() == Path(ref, name).read_bytes(), name


def test_recis_tower_dense_kernel_through_fastckpt_and_back_is_recis_bytes(tmp_path):
    """A RecIS directory with ``tower/dense/kernel`` and a table ``tower/user`` (step filter, Adam) resharded into
    fastckpt's layout (version 6) on 1, 2 and 3 ranks and back into RecIS's: on the source's ranks the source's own
    bytes, on others what RecIS's save path writes for that state; fastckpt's layout through RecIS's and back is
    fastckpt's own bytes."""
    from test_recis_tables import _table_state

    ids, rows = _table_state(300, (4,), 7)
    order = np.argsort(sharded_format.slice_positions(ids, 65536), kind="stable")  # RecIS's rows in slice order
    ids, rows = ids[order], {k: v[order] for k, v in rows.items()}
    # in name order: fastckpt's layout lists dense tensors by name, so RecIS's save order of them is not kept
    dense = {"bias": np.ones(4, np.float16), "tower/dense/kernel": np.arange(12, dtype=np.float32).reshape(3, 4)}
    src = _recis_save(tmp_path / "src", 2, ids, rows, dense)
    assert recis_port.check_json(src, 2, 2 * 5)
    for fc_ranks in (1, 2, 3):
        fc = reshard(src, str(tmp_path / f"fc{fc_ranks}"), fc_ranks, layout="fastckpt")
        manifest = _manifest(fc)
        assert manifest["format_version"] == 6 and sorted(manifest["tensors"]) == ["bias", "tower/dense/kernel"]
        assert manifest["hashtables"][TABLE]["slot_specs"]["step_filter"] == {"shape": [1], "dtype": "int64"}
        with CheckpointReader(fc) as reader:
            assert reader.read_tensor("tower/dense/kernel").tobytes() == dense["tower/dense/kernel"].tobytes()
        _same_files(reshard(fc, str(tmp_path / f"back{fc_ranks}"), 2, layout="recis"), src)
        for m in (1, 3):
            _same_files(reshard(fc, str(tmp_path / f"back{fc_ranks}-{m}"), m, layout="recis"),
                        _recis_save(tmp_path / f"ref{fc_ranks}-{m}", m, ids, rows, dense))
        # fastckpt's layout -> RecIS's -> fastckpt's on the same ranks: the same files, manifest included
        again = reshard(str(tmp_path / f"back{fc_ranks}"), str(tmp_path / f"again{fc_ranks}"), fc_ranks,
                        layout="fastckpt", parallel=2)
        _same_files(again, fc, manifest=False)
    for m in (1, 3):  # RecIS's loader reads every id of what reshard wrote
        got = {}
        for j in range(m):
            table = recis_port.Table([4], slice_=recis_port.gen_slice(j, m), filter_hook="step_filter",
                                     optimizer="adam")
            got.update(recis_port.load_table(str(tmp_path / f"back3-{m}"), TABLE, table))
        assert sorted(got) == sorted(ids.tolist())
    assert "tower/dense/kernel^ " in recis_port.check_load_bundle(str(tmp_path / "back3-3"))  # RecIS's dense block


def test_a_fastckpt_checkpoint_with_names_with_a_slash_through_recis_and_back_is_exact(tmp_path):
    """fastckpt's layout (a slot named with '/', which RecIS's layout stores too) -> RecIS's on 3 ranks -> fastckpt's
    on 2: every value exact, and on the ranks and files it was saved with, the bytes of a save of that state."""
    ids, rows = _rows(400, 21)
    src = _save(tmp_path / "src", ids, rows, ranks=2, parallel=2)
    recis = reshard(src, str(tmp_path / "recis"), 3, layout="recis")
    with CheckpointReader(recis) as reader:
        assert reader.layout == "RecIS" and reader.read_tensor("a//b/").tobytes() == DENSE["a//b/"].tobytes()
    back = reshard(recis, str(tmp_path / "back"), 2, layout="fastckpt")
    _check_loaded(back, ids, rows, 2)
    _check_loaded(back, ids, rows, 3)
    same = reshard(src, str(tmp_path / "same"), 2)  # the same state by slice, written by fastckpt alone
    _same_files(back, same, manifest=False)


def test_a_delta_chain_and_encoded_tables_with_names_with_a_slash(tmp_path):
    ids, rows = _rows(300, 5)
    tables = [{TABLE: _table(ids[r::2], {k: v[r::2] for k, v in rows.items()})} for r in range(2)]
    save_threads(tmp_path / "full", tables, DENSE, 1, incremental=DeltaPolicy(max_fraction=1.0))
    gone, changed = ids[:10], ids[10:20]
    for t in tables:
        t[TABLE].delete(gone)
        mine = np.isin(changed, t[TABLE].ids())
        t[TABLE].update(changed[mine], np.full((int(mine.sum()), 4), 9.5, np.float32),
                        slots={SLOT: np.full((int(mine.sum()), 4), -4.0, np.float32)})
    save_threads(tmp_path / "delta", tables, DENSE, 1, incremental=DeltaPolicy(max_fraction=1.0))
    manifest = _manifest(tmp_path / "delta")
    assert manifest["kind"] == "delta" and manifest["format_version"] == 6
    keep = np.flatnonzero(~np.isin(ids, gone))
    want = {k: v.copy() for k, v in rows.items()}
    at = np.isin(ids, changed)
    want["embedding"][at], want[SLOT][at] = 9.5, -4.0
    ids_after, want = ids[keep], {k: v[keep] for k, v in want.items()}
    for path in (str(tmp_path / "delta"), compact(str(tmp_path / "delta"), str(tmp_path / "compact"))):
        for shard_num in (1, 3):
            _check_loaded(path, ids_after, want, shard_num)
    zstd = _save(tmp_path / "zstd", ids, rows, compression="zstd")
    assert _manifest(zstd)["format_version"] == 6
    _check_loaded(zstd, ids, rows, 2)


def test_open_inspect_and_verify_show_names_with_a_slash(tmp_path, capsys):
    from fastckpt.cli import main
    from fastckpt.cli.inspect import _format_table, describe

    ids, rows = _rows(60, 8)
    path = _save(tmp_path / "c", ids, rows)
    with fastckpt.open(path) as f:
        assert f["tower/dense/kernel"].tobytes() == DENSE["tower/dense/kernel"].tobytes()
        assert f"{TABLE}.{SLOT}" in list(f.keys())
    text = _format_table(describe(path))
    assert f"hashtable {TABLE}: 60 ids x 4 float32, slots ['{SLOT}', 'v']" in text.splitlines(), text
    assert main(["verify", path]) == 0


@pytest.mark.parametrize("verify", [False, True])
def test_names_with_a_slash_saved_to_and_loaded_from_s3_are_exact(s3, verify):
    ids, rows = _rows(300, 9)
    url = s3.url("c")
    tables = [{TABLE: _table(ids[r::2], {k: v[r::2] for k, v in rows.items()})} for r in range(2)]
    save_threads(url, tables, DENSE, 2, storage_options=s3.storage_options)
    _check_loaded(url, ids, rows, 3, storage_options=s3.storage_options, verify=verify)
