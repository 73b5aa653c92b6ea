"""Every RecIS table loads and reshards whole (issue 30 item 1): filter slots, any slice size, embeddings of any
rank, dense names with '/', a directory recognised by ``index`` and ``tensorkey.json``. Each directory is built with
RecIS's own save path (tests/_recis_writer.py, a port of its C++ and of its HashTable's slot group), and RecIS's own
loader (the port's ``load_table``) reads what ``reshard`` writes."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import _recis_writer as recis_port
import fastckpt
from fastckpt.sharded import CheckpointReader, HashTable, Loader, Saver
from fastckpt.sharded.recis import slice_owner
from fastckpt.sharded.reshard import reshard

pytestmark = pytest.mark.filterwarnings("ignore::fastckpt.sharded.recis.RecisWarning")  # the port writes no manifest


def _table_state(n_ids, shape, seed, slice_size=65536):
    rng = np.random.default_rng(seed)
    ids = rng.choice(np.arange(-3 * slice_size, 5 * slice_size), n_ids, replace=False).astype(np.int64)
    return ids, {"embedding": rng.standard_normal((n_ids, *shape)).astype(np.float32),
                 "step_filter": rng.integers(0, 1000, (n_ids, 1)).astype(np.int64),
                 "sparse_adam_exp_avg": rng.standard_normal((n_ids, *shape)).astype(np.float32),
                 "sparse_adam_exp_avg_sq": rng.random((n_ids, *shape)).astype(np.float32)}


def _recis_save(path, n, ids, rows, shape, dense, slice_size=65536, parallel=2, filter_hook="step_filter"):
    """RecIS's save on ``n`` ranks: each rank's HashTable (embedding, step filter, Adam) holds the ids of its
    slice, in the order given."""
    owner = slice_owner(ids, n, slice_size)
    ranks = []
    for i in range(n):
        mine = np.flatnonzero(owner == i)
        table = recis_port.Table(list(shape), slice_=recis_port.gen_slice(i, n, slice_size), filter_hook=filter_hook,
                                 optimizer="adam")
        table.insert(ids[mine], {slot.name: rows[slot.name][mine] for slot in table.slot_group.slots})
        ranks.append(table.write_tables("user"))
    return recis_port.write_checkpoint(str(path), ranks, dense, parallel=parallel)


def _recis_load_all(path, m, shape, slice_size=65536):
    """RecIS's loader on ``m`` ranks, each with its HashTable of the same slots: ``{id: {slot: row}}``, and the
    ids each rank accepted."""
    got, per_rank = {}, []
    for j in range(m):
        table = recis_port.Table(list(shape), slice_=recis_port.gen_slice(j, m, slice_size),
                                 filter_hook="step_filter", optimizer="adam")
        loaded = recis_port.load_table(str(path), "user", table)
        assert not set(loaded) & set(got)  # each id on one rank
        got.update(loaded)
        per_rank.append(sorted(loaded))
    return got, per_rank


def _as_port_ranks(path, m, slice_size_of):
    """The state fastckpt loads on ``m`` ranks, each holding the ids of its RecIS slice, as RecIS's save path takes
    it (each table's rows in its row order, slots in the table's order): what RecIS writes for that state."""
    ranks, dense = [], None
    for j in range(m):
        tables, tensors = Loader(str(path), shard_index=j, shard_num=m, owner=slice_owner).load()
        dense = tensors if j == 0 else dense
        port = {}
        for name, table in tables.items():
            t_ids, values, slots = table.rows()
            port[name] = (t_ids, [("embedding", values), *((s, slots[s]) for s in table.slots)],
                          recis_port.gen_slice(j, m, slice_size_of[name]))
        ranks.append(port)
    return ranks, dense


def _load_ids(path, j, m, **kw):
    return sorted(Loader(str(path), shard_index=j, shard_num=m, **kw).load()[0]["tab"].ids().tolist())


def _same_files(ours, ref):
    """Every file RecIS's save path writes, byte for byte (fastckpt adds only its manifest)."""
    assert sorted(os.listdir(ours)) == sorted([*os.listdir(ref), "manifest.json"])
    for name in os.listdir(ref):
        with open(os.path.join(ref, name), "rb") as a, open(os.path.join(ours, name), "rb") as b:
            assert a.read() == b.read(), name


def _check_reshard_is_recis_bytes(src, tmp_path, m, slice_size_of, parallel=2):
    """``reshard`` of ``src`` onto ``m`` ranks in RecIS's layout = RecIS's save of the same state, byte for byte."""
    out = reshard(src, str(tmp_path / f"reshard{m}"), m, layout="recis", parallel=parallel)
    ranks, dense = _as_port_ranks(src, m, slice_size_of)
    ref = recis_port.write_checkpoint(str(tmp_path / f"port{m}"), ranks, dense, parallel=parallel)
    _same_files(out, ref)
    return out


@pytest.fixture(scope="module")
def filtered(tmp_path_factory):
    """RecIS tables with a step filter and Adam on 2 ranks (the issue's case)."""
    ids, rows = _table_state(300, (4,), 1)
    dense = {"tower/dense/kernel": np.arange(12, dtype=np.float32).reshape(3, 4), "bias": np.ones(4, np.float16)}
    path = _recis_save(tmp_path_factory.mktemp("filtered"), 2, ids, rows, (4,), dense)
    return path, ids, rows, dense


def test_step_filter_slot_is_loaded_with_its_shape_and_dtype(filtered):
    path, ids, rows, _ = filtered
    assert recis_port.check_json(path, 2, 2 * 5)  # id, embedding, step_filter, 2 Adam slots per rank
    row = {int(i): r for r, i in enumerate(ids)}
    seen = 0
    for j in range(2):
        table = Loader(path, shard_index=j, shard_num=2).load()[0]["user"]
        assert table.slots == ("step_filter", "sparse_adam_exp_avg", "sparse_adam_exp_avg_sq")  # RecIS's order
        assert table.slot_specs["step_filter"] == ((1,), np.dtype(np.int64))
        got = table.ids()
        at = [row[int(i)] for i in got]
        assert np.array_equal(table.lookup_slot("step_filter", got), rows["step_filter"][at])
        assert np.array_equal(table.lookup_slot("sparse_adam_exp_avg_sq", got), rows["sparse_adam_exp_avg_sq"][at])
        seen += len(got)
    assert seen == len(ids)
    with CheckpointReader(path) as reader:
        assert reader.hashtables()["user"]["slot_specs"]["step_filter"] == {"shape": [1], "dtype": "int64"}


def test_asking_for_the_filter_slot_and_a_slot_the_table_cannot_hold(filtered):
    path, ids, rows, _ = filtered
    mine = {"user": HashTable(4, slots=(("step_filter", 1, np.int64),))}
    Loader(path, hashtables=mine).load()
    assert len(mine["user"]) == len(ids)
    order = np.argsort(ids)
    assert np.array_equal(mine["user"].export()[2]["step_filter"], rows["step_filter"][order])
    with pytest.raises(ValueError, match=r"slot 'step_filter' holds rows of shape \(1,\) int64 in the checkpoint, "
                                         r"the table given has \(4,\) float32"):
        Loader(path, hashtables={"user": HashTable(4, slots=("step_filter",))}).load()


def test_reshard_keeps_the_filter_slot_and_recis_loads_it(filtered, tmp_path):
    path, ids, rows, _ = filtered
    for m in (1, 2, 3):
        out = _check_reshard_is_recis_bytes(path, tmp_path, m, {"user": 65536})
        got, _ = _recis_load_all(out, m, (4,))
        assert sorted(got) == sorted(ids.tolist())  # RecIS's loader finds every id, on the rank of its slice
        for r, i in enumerate(ids.tolist()):
            assert got[i]["step_filter"].tolist() == rows["step_filter"][r].tolist()
            assert got[i]["embedding"].tobytes() == rows["embedding"][r].tobytes()
    # fastckpt's layout holds the filter slot and the dense name with '/' (format version 6), and gives them back
    fc = reshard(path, str(tmp_path / "fc"), 2, layout="fastckpt")
    assert json.loads((tmp_path / "fc" / "manifest.json").read_text())["format_version"] == 6
    (tmp_path / "back").mkdir()
    _check_reshard_is_recis_bytes(fc, tmp_path / "back", 2, {"user": 65536})  # what RecIS writes for that state


def test_reshard_onto_the_same_ranks_writes_the_source_again(filtered, tmp_path):
    path, *_ = filtered
    out = reshard(path, str(tmp_path / "same"), 2, layout="recis")  # parallel: the source's (2)
    _same_files(out, path)


@pytest.mark.parametrize("slice_size", [1000, 999])
def test_slice_size_is_kept_by_reshard(tmp_path, slice_size):
    ids, rows = _table_state(148, (3,), 2, slice_size)
    src = _recis_save(tmp_path / "src", 2, ids, rows, (3,), {"w": np.zeros(2, np.float32)}, slice_size)
    with CheckpointReader(src) as reader:
        assert reader.hashtables()["user"]["slice_size"] == slice_size
    for m in (2, 3, 4):
        out = _check_reshard_is_recis_bytes(src, tmp_path, m, {"user": slice_size})
        with open(os.path.join(out, "tensorkey.json"), encoding="utf-8") as f:
            assert all(v.endswith(f"@{slice_size}") for v in json.load(f).values())
        got, per_rank = _recis_load_all(out, m, (3,), slice_size)
        assert len(got) == 148 and all(per_rank)  # RecIS's loader of that slice size finds every id
        assert json.loads((tmp_path / f"reshard{m}" / "manifest.json").read_text())["slice_size"] == slice_size
    # RecIS's loader of another slice size reads no part at all: the slice size is part of the checkpoint
    assert _recis_load_all(out, 1, (3,), 65536)[0] == {}


def test_slice_size_of_a_recis_save(tmp_path):
    ids, rows = _table_state(60, (2,), 3, 1000)
    owner = slice_owner(ids, 2, 1000)
    tables = []
    for i in range(2):
        mine = np.flatnonzero(owner == i)
        t = HashTable(2, slots=("m",), name="user")
        t.insert(ids[mine], rows["embedding"][mine], {"m": rows["sparse_adam_exp_avg"][mine]})
        tables.append(t)
    from concurrent.futures import ThreadPoolExecutor

    from fastckpt.sharded.engine import ThreadEngine

    def save(engine):
        return Saver(engine.rank, 2, 2, str(tmp_path / "ours"), hashtables={"user": tables[engine.rank]},
                     engine=engine, layout="recis", slice_size=1000).save()

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(save, ThreadEngine.group(2)))
    port = []
    for i, t in enumerate(tables):
        t_ids, values, slots = t.rows()
        port.append({"user": (t_ids, [("embedding", values), ("m", slots["m"])], recis_port.gen_slice(i, 2, 1000))})
    _same_files(str(tmp_path / "ours"), recis_port.write_checkpoint(str(tmp_path / "ref"), port, {}, parallel=2))
    with pytest.raises(ValueError, match=r"outside its RecIS slice \[0, 500\) of 1000"):
        Saver(0, 2, 1, str(tmp_path / "x"), hashtables={"user": tables[1]}, engine=ThreadEngine.group(2)[0],
              layout="recis", slice_size=1000).blocks()
    with pytest.raises(ValueError, match="slice_size must be from 64 to 4294967296 in fastckpt's layout"):
        Saver(path=str(tmp_path / "y"), hashtables={"user": tables[0]}, slice_size=10)
    # from fastckpt's layout into RecIS's with a slice size chosen
    fc = reshard(str(tmp_path / "ours"), str(tmp_path / "fc"), 2, layout="fastckpt")
    from fastckpt.cli import main

    back = str(tmp_path / "back")
    assert main(["reshard", fc, back, "--shards", "3", "--layout", "recis", "--slice-size", "1000"]) == 0
    got = np.concatenate([Loader(back, shard_index=j, shard_num=3).load()[0]["user"].ids() for j in range(3)])
    assert sorted(got.tolist()) == sorted(ids.tolist())
    assert json.loads((tmp_path / "back" / "tensorkey.json").read_text())["user.id/part_0_3"] == "user@id^0000@0334@1000"


def test_embeddings_keep_their_full_shape(tmp_path):
    ids, rows = _table_state(90, (2, 3), 4)
    src = _recis_save(tmp_path / "src", 2, ids, rows, (2, 3), {"w": np.ones((2, 2), np.float32)})
    table = Loader(src).load()[0]["user"]
    assert table.shape == (2, 3) and table.dim == 6
    order = np.argsort(ids)
    assert np.array_equal(table.lookup(ids[order]), rows["embedding"][order])
    assert np.array_equal(table.lookup_slot("sparse_adam_exp_avg", ids[order]), rows["sparse_adam_exp_avg"][order])
    for m in (1, 3):
        out = _check_reshard_is_recis_bytes(src, tmp_path, m, {"user": 65536})
        with CheckpointReader(out) as reader:
            assert reader.tensor_shape("user@embedding") == (90, 2, 3)
        got, _ = _recis_load_all(out, m, (2, 3))  # RecIS's slot reader: "shape not match" on [n, 6]
        assert len(got) == 90
    flat = recis_port.Table([6], filter_hook="step_filter", optimizer="adam")
    with pytest.raises(AssertionError, match="shape not match"):  # what RecIS says of a flattened embedding
        recis_port.load_table(out, "user", flat)
    with pytest.raises(ValueError, match=r"is shape \(2, 3\) float32 in the checkpoint, the table given is dim 6"):
        Loader(src, hashtables={"user": HashTable(6)}).load()
    # fastckpt's layout keeps the shape too (format version 5)
    Saver(path=str(tmp_path / "fc"), hashtables={"user": table}).save()
    again = Loader(str(tmp_path / "fc")).load()[0]["user"]
    assert again.shape == (2, 3) and again == table


def test_dense_names_with_a_slash(filtered, tmp_path):
    path, _, _, dense = filtered
    with CheckpointReader(path) as reader:
        assert np.array_equal(reader.read_tensor("tower/dense/kernel"), dense["tower/dense/kernel"])
    _, tensors = Loader(path).load()
    assert list(tensors) == ["tower/dense/kernel", "bias"]  # in the order of the save
    out = str(tmp_path / "ours")
    Saver(path=out, parallel=2, tensors=dense, layout="recis").save()
    _same_files(out, recis_port.write_checkpoint(str(tmp_path / "ref"), [{}], dense, parallel=2))
    # RecIS breaks on names holding '/part_' (its index names a key its file does not hold): refused
    with pytest.raises(AssertionError):
        recis_port.check_load_bundle(recis_port.write_checkpoint(str(tmp_path / "bad"), [{}],
                                                                 {"a/part_1": np.ones(1, np.float32)}, parallel=1))
    with pytest.raises(ValueError, match="'/part_'"):
        Saver(path=str(tmp_path / "b"), tensors={"a/part_1": np.ones(1, np.float32)}, layout="recis")
    with pytest.raises(ValueError, match="'/part_' at position 1"):  # nor fastckpt's, whose keys end in it
        Saver(path=str(tmp_path / "c"), tensors={"a/part_1": np.ones(1, np.float32)})
    Saver(path=str(tmp_path / "c"), tensors=dense).save()  # any other '/' it stores (format version 6)
    assert Loader(str(tmp_path / "c")).load()[1]["tower/dense/kernel"].tobytes() == \
        dense["tower/dense/kernel"].tobytes()


def test_index_and_tensorkey_are_enough_to_recognise_the_layout(filtered, tmp_path, capsys):
    import shutil

    from fastckpt.cli import inspect as inspect_cli
    from fastckpt.cli import verify as verify_cli

    path, ids, _, dense = filtered
    d = tmp_path / "bare"
    shutil.copytree(path, d)
    os.remove(d / "torch_rank_weights_embs_table_multi_shard.json")  # optional: RecIS's loader never reads it
    with fastckpt.open(d) as f:
        assert f.layout == "RecIS"
        assert np.array_equal(f["tower/dense/kernel"], dense["tower/dense/kernel"])
    assert inspect_cli.describe(str(d))["layout"] == "RecIS"

    class Args:
        no_hash, quiet, directory = False, False, str(d)

    assert verify_cli.run(Args()) == 0 and "RecIS layout" in capsys.readouterr().out
    got = Loader(str(d)).load()[0]["user"]
    assert len(got) == len(ids)


@pytest.mark.parametrize("saved_by", [1, 2, 3])
def test_reshard_of_the_recis_test_directories_is_recis_bytes(tmp_path, saved_by):
    """tests/test_recis.py's RecIS directories (negative ids, four dense tensors of three dtypes, a 0-d one,
    parallel 3) resharded onto 1, 2 and 3 ranks: RecIS's save of the state loaded, byte for byte."""
    from test_recis import _recis_ranks, _state

    ids, emb, mom, dense = _state()
    src = recis_port.write_checkpoint(str(tmp_path / "src"), _recis_ranks(ids, emb, mom, saved_by), dense, parallel=3)
    for m in (1, 2, 3):
        _check_reshard_is_recis_bytes(src, tmp_path, m, {"tab": 65536}, parallel=3)
    _same_files(reshard(src, str(tmp_path / "same"), saved_by, layout="recis"), src)


def test_reshard_of_empty_parts_and_ids_outside_their_slice_is_recis_bytes(tmp_path):
    """A rank whose table is empty, and a part holding an id of another rank's slice: RecIS's loader on two ranks
    would drop it; reshard reads every part and writes it on the rank of its slice, where RecIS finds it."""
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    ranks = [{"tab": (np.array([0, 1, 40000], np.int64), [("embedding", values)], recis_port.gen_slice(0, 2))},
             {"tab": (np.empty(0, np.int64), [("embedding", values[:0])], recis_port.gen_slice(1, 2))}]
    src = recis_port.write_checkpoint(str(tmp_path / "src"), ranks, {"w": np.ones(2, np.float32)}, parallel=1)
    for m in (1, 2, 3):
        out = _check_reshard_is_recis_bytes(src, tmp_path, m, {"tab": 65536}, parallel=1)
        assert recis_port.check_json(out, 1, 2 * m)
    assert [recis_port.load_table(str(tmp_path / "reshard2"), "tab", recis_port.Table(
        [4], slice_=recis_port.gen_slice(j, 2))).keys() for j in range(2)] == [{0, 1}, {40000}]
    assert [_load_ids(src, j, 2) for j in range(2)] == [[0, 1], []]  # RecIS's rule on the source: 40000 is lost
