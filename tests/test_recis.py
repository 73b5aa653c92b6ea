"""RecIS's own checkpoint layout: directories as RecIS's serializer writes them (tests/_recis_writer.py, a port of
its C++), read exactly on 1, 2 and 3 ranks, and ``Saver(layout="recis")`` writing the same bytes."""

from __future__ import annotations

import json
import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import _recis_writer as recis_port
import fastckpt
from fastckpt.errors import FormatError, TensorNotFoundError
from fastckpt.sharded import CheckpointReader, HashTable, Loader, Saver
from fastckpt.sharded.engine import ThreadEngine
from fastckpt.sharded.recis import RecisCheckpointReader, RecisWarning, gen_slice, slice_owner, slice_string

DIM = 4


def _state(seed=0, n_ids=600):
    rng = np.random.default_rng(seed)
    ids = rng.choice(np.arange(-5 * 10**5, 10**6), n_ids, replace=False).astype(np.int64)  # negatives too
    emb = rng.standard_normal((n_ids, DIM)).astype(np.float32)
    mom = rng.standard_normal((n_ids, DIM)).astype(np.float32)
    dense = {"one": rng.standard_normal((2, 2)).astype(np.float32), "three": np.arange(100.0).reshape(100, 1),
             "scalar": np.array(7, np.int64), "half": rng.standard_normal((3, 5)).astype(np.float16)}
    return ids, emb, mom, dense


def _recis_ranks(ids, emb, mom, n):
    """Each of ``n`` RecIS ranks holds the ids of its slice (RecIS routes ids so), as the port's input."""
    owner = slice_owner(ids, n)
    out = []
    for i in range(n):
        o = np.flatnonzero(owner == i)
        out.append({"tab": (ids[o], [("embedding", emb[o]), ("adam_m", mom[o])], recis_port.gen_slice(i, n))})
    return out


@pytest.fixture(scope="module")
def recis_dirs(tmp_path_factory):
    """RecIS checkpoints written by 1, 2 and 3 ranks (parallel 3: each writer of each rank gets a block)."""
    ids, emb, mom, dense = _state()
    dirs = {}
    for n in (1, 2, 3):
        path = str(tmp_path_factory.mktemp(f"recis{n}"))
        recis_port.write_checkpoint(path, _recis_ranks(ids, emb, mom, n), dense, parallel=3)
        dirs[n] = path
    return dirs, (ids, emb, mom, dense)


def _quiet_reader(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecisWarning)
        return CheckpointReader(path, **kw)


def _load(path, j, m, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecisWarning)
        return Loader(path, shard_index=j, shard_num=m, **kw).load()


# -- the port itself against RecIS's own checks ---------------------------------------------------------------

def test_port_writes_what_recis_checks_accept(recis_dirs):
    dirs, (ids, *_rest, dense) = recis_dirs
    for n, path in dirs.items():
        assert sorted(os.listdir(path)) == ["index", *[f"model-{k:06d}-of-{3 * n:06d}.safetensors"
                                                       for k in range(3 * n)],
                                            "tensorkey.json", "torch_rank_weights_embs_table_multi_shard.json"]
        assert recis_port.check_json(path, len(dense), 3 * n)  # id, embedding, adam_m per rank
        blocks = recis_port.check_load_bundle(path)
        assert "one^ " in blocks and f"tab@id^{slice_string(*gen_slice(n - 1, n))}" in blocks
    with open(os.path.join(dirs[2], "tensorkey.json"), encoding="utf-8") as f:
        assert json.load(f)["tab.id/part_1_2"] == "tab@id^32768@65536@65536"


def test_fastckpt_layout_fails_recis_checks_and_recis_layout_opens(tmp_path, recis_dirs):
    """The incompatibility this layout fixes: RecIS's checks reject fastckpt's own layout."""
    ids, emb, _, dense = recis_dirs[1]
    table = HashTable(DIM, name="tab")
    table.insert(ids, emb)
    out = str(tmp_path / "fc")
    Saver(path=out, parallel=2, hashtables={"tab": table}, tensors=dense).save()
    assert not recis_port.check_json(out, len(dense), 2)
    with pytest.raises(AssertionError, match=r"index\] not found"):
        recis_port.check_load_bundle(out)
    with _quiet_reader(recis_dirs[0][1]) as reader:
        assert isinstance(reader, RecisCheckpointReader)


# -- reading ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("saved_by", [1, 2, 3])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_load_exact_on_1_2_3_ranks(recis_dirs, saved_by, ranks):
    dirs, (ids, emb, mom, dense) = recis_dirs
    row = {int(i): r for r, i in enumerate(ids)}
    seen = []
    for j in range(ranks):
        tables, tensors = _load(dirs[saved_by], j, ranks)
        table = tables["tab"]
        got = table.ids()
        begin, end, size = gen_slice(j, ranks)
        pos = got.view(np.uint64) % np.uint64(size)
        assert ((pos >= begin) & (pos < end)).all()  # RecIS's slice rule
        rows = [row[int(i)] for i in got]
        assert np.array_equal(table.lookup(got), emb[rows])
        assert np.array_equal(table.lookup_slot("adam_m", got), mom[rows])
        seen.append(got)
        assert sorted(tensors) == sorted(dense)
        for name, value in dense.items():  # dense tensors: whole on every rank, exact dtype
            assert tensors[name].dtype == value.dtype and np.array_equal(tensors[name], value)
    seen = np.concatenate(seen)
    assert len(seen) == len(ids) and set(seen.tolist()) == set(ids.tolist())  # each id once, none lost


def test_load_dense_rows_and_owner_rule(recis_dirs):
    dirs, (ids, _, _, dense) = recis_dirs
    _, tensors = _load(dirs[2], 1, 3, dense="rows")
    assert np.array_equal(tensors["three"], dense["three"][33:66])
    tables, _ = _load(dirs[2], 1, 2, owner=lambda i, m: np.abs(i) % m)
    assert sorted(tables["tab"].ids().tolist()) == sorted(i for i in ids.tolist() if abs(i) % 2 == 1)


def test_slice_rule_follows_recis_for_a_part_outside_its_slice(tmp_path):
    """RecIS keeps only the ids of a part that fall in the loader's slice: an id saved by the wrong rank is
    dropped by the slice rule (as RecIS does), and kept with an explicit owner rule."""
    ids = np.array([0, 1, 40000], np.int64)  # 40000 is in rank 1's slice, saved by rank 0
    values = np.arange(12, dtype=np.float32).reshape(3, DIM)
    ranks = [{"tab": (ids, [("embedding", values)], recis_port.gen_slice(0, 2))},
             {"tab": (np.array([32768], np.int64), [("embedding", values[:1])], recis_port.gen_slice(1, 2))}]
    recis_port.write_checkpoint(str(tmp_path), ranks, {"w": np.ones(2, np.float32)}, parallel=1)
    assert sorted(_load(str(tmp_path), 0, 1)[0]["tab"].ids().tolist()) == [0, 1, 32768, 40000]  # one slice: all
    # two ranks: rank 0 reads part 0 and keeps the ids of [0, 32768); rank 1 reads only part 1 (part 0's slice
    # does not meet its own), so 40000 is nobody's
    assert [_load(str(tmp_path), j, 2)[0]["tab"].ids().tolist() for j in range(2)] == [[0, 1], [32768]]
    owned = [sorted(_load(str(tmp_path), j, 2, owner=lambda i, m: i % m)[0]["tab"].ids().tolist()) for j in range(2)]
    assert owned == [[0, 32768, 40000], [1]]


def test_reader_names_shapes_and_whole_tensors(recis_dirs):
    dirs, (ids, emb, _, dense) = recis_dirs
    with _quiet_reader(dirs[3]) as reader:
        assert reader.layout == "RecIS" and reader.integrity is None
        assert reader.tensor_names() == ["half", "one", "scalar", "tab@adam_m", "tab@embedding", "tab@id", "three"]
        order = np.argsort(slice_owner(ids, 3), kind="stable")  # parts joined in slice order, as RecIS reads
        assert np.array_equal(reader.read_tensor("tab@id"), ids[order])
        assert np.array_equal(reader.read_tensor("tab.embedding"), emb[order])  # fastckpt's name of it
        assert reader.tensor_shape("tab@embedding") == (len(ids), DIM)
        assert reader.tensor_dtype("half") == np.float16
        assert reader.read_tensor("scalar").shape == () and reader.read_tensor("scalar") == 7
        assert np.array_equal(reader.read_tensor("one^ "), dense["one"])  # a stored key
        assert reader.hashtables() == {"tab": {"dim": DIM, "shape": [DIM], "dtype": "float32", "slots": ["adam_m"],
                                               "slot_specs": {"adam_m": {"shape": [DIM], "dtype": "float32"}},
                                               "ids": len(ids), "slice_size": 65536}}
        with pytest.raises(TensorNotFoundError, match="close matches"):
            reader.read_tensor("tab@embeding")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecisWarning)
        with fastckpt.open(dirs[2]) as f:  # whole tensors by their names: no trailing space, no part suffix
            assert list(f.keys()) == ["half", "one", "scalar", "tab@adam_m", "tab@embedding", "tab@id", "three"]
            assert np.array_equal(f["three"], dense["three"]) and f.info("tab.id").shape == (len(ids),)
            assert np.array_equal(f["three^ "], dense["three"]) and "tab.id/part_1_2" in f  # stored keys, on request
            with pytest.raises(KeyError, match=r"did you mean 'three'"):
                f.info("thre")
            assert f.host("one").base is not None  # one part holds it: a view of the mapped file, no copy


def test_no_integrity_record_is_said_once(tmp_path):
    recis_port.write_checkpoint(str(tmp_path), [{}], {"w": np.ones(2, np.float32)}, parallel=1)
    with pytest.warns(RecisWarning, match="RecIS checkpoint: no integrity record"):
        CheckpointReader(str(tmp_path)).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CheckpointReader(str(tmp_path)).close()  # once per directory
        _load(str(tmp_path), 0, 1)


def test_broken_directories_raise_naming_the_file(tmp_path, recis_dirs):
    import shutil

    src = recis_dirs[0][2]
    # a block the index moves to another file: that file misses it, and its own file holds it unplaced
    moved = r"holds no tensors \['tab.id/part_0_2'\]|holds block 'tab.id/part_0_2', which index does not place there"
    for breakage, match in [("tensorkey", r"tensorkey.json: missing"), ("file", r"model-000001-of-000006"
                                                                                  r".safetensors: missing"),
                            ("block", moved), ("index", "not valid JSON")]:
        d = tmp_path / breakage
        shutil.copytree(src, d)
        if breakage == "tensorkey":
            os.remove(d / "tensorkey.json")
        elif breakage == "file":
            os.remove(d / "model-000001-of-000006.safetensors")
        elif breakage == "index":
            (d / "index").write_text("{")
        else:
            index = json.loads((d / "index").read_text())
            index["block_index"]["tab.id/part_0_2"] = 1  # a file that does not hold it
            (d / "index").write_text(json.dumps(index))
        if breakage in ("tensorkey", "index"):  # the metadata: when the reader opens
            with pytest.raises(FormatError, match=match):
                _quiet_reader(str(d))
            continue
        # A tensor file: when it is first used (here where the reader opens if the order of the save needs its
        # header: the moved block breaks the order RecIS writes), and by verify() and a load
        with pytest.raises(FormatError, match=match):
            with _quiet_reader(str(d)) as reader:
                [reader.read_tensor(name) for name in reader.tensor_names()]
        with pytest.raises(FormatError, match=match):
            with _quiet_reader(str(d)) as reader:
                reader.verify()
        with pytest.raises(FormatError, match=match):
            _load(str(d), 0, 1)


@pytest.mark.parametrize("name", ["tab@id", "tab@id^0@2@65536^x", "^tab@id"])
def test_a_block_name_that_is_not_tensor_caret_slice_raises_naming_the_index_and_the_block(tmp_path, recis_dirs,
                                                                                          name):
    # RecIS's TensorNameFromBlockName splits on '^', drops empty tokens and needs exactly two: "^tab@id" has one.
    import shutil

    d = tmp_path / "d"
    shutil.copytree(recis_dirs[0][2], d)
    tensorkey = json.loads((d / "tensorkey.json").read_text())
    key = sorted(k for k in tensorkey if k.startswith("tab.id/"))[0]
    tensorkey[key] = name
    (d / "tensorkey.json").write_text(json.dumps(tensorkey))
    with pytest.raises(FormatError) as raised:
        _quiet_reader(str(d))
    assert str(raised.value) == (f"{d / 'index'} (key {key!r}): block {name!r} is not 'TENSOR^SLICE' (RecIS's block "
                                 "names)")


# -- writing ---------------------------------------------------------------------------------------------------

def _save_recis(out, ids, emb, mom, dense, n, parallel):
    owner = slice_owner(ids, n)
    tables = []
    for i in range(n):
        o = np.flatnonzero(owner == i)
        table = HashTable(DIM, slots=("adam_m",), name="tab")
        table.insert(ids[o], emb[o], {"adam_m": mom[o]})
        tables.append(table)

    def save(engine):
        return Saver(engine.rank, n, parallel, out, hashtables={"tab": tables[engine.rank]}, tensors=dense,
                     engine=engine, layout="recis").save()

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(save, ThreadEngine.group(n)))
    return tables


@pytest.mark.parametrize("n", [1, 2, 3])
def test_layout_recis_writes_recis_bytes(tmp_path, n):
    """Byte for byte what RecIS's code (the port) writes for the same rows, plus fastckpt's manifest."""
    ids, emb, mom, dense = _state(1)
    out = str(tmp_path / "ours")
    tables = _save_recis(out, ids, emb, mom, dense, n, parallel=3)
    ref = str(tmp_path / "ref")
    ranks = []
    for i, table in enumerate(tables):
        t_ids, t_values, t_slots = table.rows()
        ranks.append({"tab": (t_ids, [("embedding", t_values), ("adam_m", t_slots["adam_m"])],
                              recis_port.gen_slice(i, n))})
    recis_port.write_checkpoint(ref, ranks, dense, parallel=3)
    assert sorted(os.listdir(out)) == sorted([*os.listdir(ref), "manifest.json"])
    for name in os.listdir(ref):
        with open(os.path.join(ref, name), "rb") as a, open(os.path.join(out, name), "rb") as b:
            assert a.read() == b.read(), name
    assert recis_port.check_json(out, len(dense), 3 * n)
    recis_port.check_load_bundle(out)
    with CheckpointReader(out, verify=True) as reader:  # a manifest: no warning, hashes checked
        assert reader.integrity == "manifest" and reader.verify() == []
    for m in (1, 2):
        got = np.concatenate([Loader(out, shard_index=j, shard_num=m).load()[0]["tab"].ids() for j in range(m)])
        assert sorted(got.tolist()) == sorted(ids.tolist())


def test_layout_recis_manifest_catches_a_flipped_byte(tmp_path):
    ids, emb, mom, dense = _state(2, 50)
    out = tmp_path / "c"
    _save_recis(str(out), ids, emb, mom, dense, 1, parallel=2)
    path = out / "model-000001-of-000002.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with CheckpointReader(str(out)) as reader:
        assert [p.split(":")[0] for p in reader.verify()] == ["model-000001-of-000002.safetensors"]
        damaged = [k for k in reader.part_infos if reader.file_of(k).path == str(path)]
        with pytest.raises(fastckpt.errors.IntegrityError, match="model-000001-of-000002.safetensors: BLAKE3"):
            reader.host(damaged[0])  # checked by default, the first time a block of the file is read
    with pytest.raises(fastckpt.errors.IntegrityError, match="BLAKE3"):
        Loader(str(out)).load()
    Loader(str(out), verify=False).load()  # the way out, for speed


@pytest.mark.parametrize("name", ["index", "tensorkey.json", "torch_rank_weights_embs_table_multi_shard.json",
                                  "manifest.json"])
def test_layout_recis_metadata_and_manifest_are_checked_against_the_commit(tmp_path, name):
    # The manifest is sealed (its own BLAKE3) and lists the metadata files' hashes, as fastckpt's own layout's.
    ids, emb, mom, dense = _state(3, 40)
    out = tmp_path / "c"
    _save_recis(str(out), ids, emb, mom, dense, 1, parallel=1)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["checksum"]["blake3"] == fastckpt.sharded.format.manifest_checksum(manifest)
    path = out / name
    if name == "manifest.json":
        path.write_text(json.dumps({**manifest, "world_size": 2}, indent=1, sort_keys=True) + "\n")
    else:
        path.write_bytes(path.read_bytes().replace(b"part_0_1", b"part_0_2", 1))  # still valid JSON
    with pytest.raises(fastckpt.errors.ChecksumMismatchError, match=name):
        CheckpointReader(str(out))


def test_layout_recis_writes_only_writers_with_blocks(tmp_path):
    out = str(tmp_path / "c")
    Saver(path=out, parallel=4, tensors={"w": np.ones(3, np.float32)}, layout="recis").save()
    assert sorted(os.listdir(out)) == ["index", "manifest.json", "model-000000-of-000004.safetensors",
                                       "tensorkey.json", "torch_rank_weights_embs_table_multi_shard.json"]
    assert recis_port.check_load_bundle(out) == {"w^ ": ("model-000000-of-000004.safetensors", 72, 84)}
    assert recis_port.check_json(out, 1, 0)


def test_layout_recis_refuses_what_recis_cannot_read(tmp_path):
    table = HashTable(DIM, name="tab")
    table.insert([1, 40000], np.ones((2, DIM), np.float32))  # 40000 lies in rank 1's slice of 2
    engines = ThreadEngine.group(2)
    with pytest.raises(ValueError, match=r"1 of rank 0's 2 ids lie outside its RecIS slice \[0, 32768\).*"
                                         r"slice_owner"):
        Saver(0, 2, 1, str(tmp_path / "a"), hashtables={"tab": table}, engine=engines[0], layout="recis").blocks()
    with pytest.raises(ValueError, match="reserves '@' and '\\^'"):
        Saver(path=str(tmp_path / "b"), tensors={"a@b": np.ones(1)}, layout="recis").save()
    with pytest.raises(TypeError, match="RecIS's reader knows only"):
        Saver(path=str(tmp_path / "c"), tensors={"u": np.ones(1, np.uint16)}, layout="recis").save()
    with pytest.raises(ValueError, match="no incremental"):
        Saver(path=str(tmp_path / "d"), layout="recis", compression="zstd")
    assert not any(p.name in ("b", "c") for p in tmp_path.iterdir())  # nothing committed


def test_cli_verify_and_inspect_name_the_layout(tmp_path, recis_dirs, capsys):
    from fastckpt.cli import inspect as inspect_cli
    from fastckpt.cli import verify as verify_cli

    class Args:
        no_hash = False
        quiet = False

    args = Args()
    args.directory = recis_dirs[0][1]
    assert verify_cli.run(args) == 0
    assert "RecIS layout" in capsys.readouterr().out and True
    out = str(tmp_path / "c")
    Saver(path=out, parallel=1, tensors={"w": np.ones(3, np.float32)}, layout="recis").save()
    args.directory = out
    assert verify_cli.run(args) == 0
    assert "RecIS layout with fastckpt's manifest" in capsys.readouterr().out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecisWarning)
        d = inspect_cli.describe(recis_dirs[0][1])
    assert d["layout"] == "RecIS" and d["integrity"].startswith("none (RecIS checkpoint: no integrity record")


def test_reshard_converts_between_the_layouts(tmp_path, recis_dirs):
    from fastckpt.sharded.reshard import reshard

    dirs, (ids, emb, mom, dense) = recis_dirs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecisWarning)
        ours = reshard(dirs[2], str(tmp_path / "fastckpt"), 3, layout="fastckpt")
    back = reshard(ours, str(tmp_path / "recis"), 2, layout="recis", parallel=3)
    assert recis_port.check_json(back, len(dense), 6)
    recis_port.check_load_bundle(back)
    for path, layout in ((ours, "fastckpt"), (back, "RecIS")):
        with CheckpointReader(path, verify=True) as reader:
            assert reader.layout == layout
            got = reader.read_tensor("tab.id")
            order = np.argsort(got)
            assert np.array_equal(got[order], np.sort(ids))
            assert np.array_equal(reader.read_tensor("tab.adam_m")[order], mom[np.argsort(ids)])
            assert np.array_equal(reader.read_tensor("half"), dense["half"])


def test_golden_bytes_of_a_small_layout_recis_save(tmp_path):
    """The layout is a promise to RecIS's reader: these bytes change only with it (module docs of recis.py)."""
    table = HashTable(1, slots=("m",))
    table.insert(np.array([1, 2]), np.array([[1.0], [2.0]], np.float32), {"m": np.array([[3.0], [4.0]], np.float32)})
    out = tmp_path / "g"
    Saver(path=str(out), parallel=2, hashtables={"t": table}, tensors={"w": np.array([0.5], np.float32)},
          layout="recis").save()
    assert (out / "index").read_bytes() == (
        b'{"block_index":{"t.embedding/part_0_1":1,"t.id/part_0_1":0,"t.m/part_0_1":0,"w^ ":1},"file_index":'
        b'{"model-000000-of-000002.safetensors":0,"model-000001-of-000002.safetensors":1}}')
    assert (out / "model-000000-of-000002.safetensors").read_bytes() == (
        b'\x88\x00\x00\x00\x00\x00\x00\x00{"t.id/part_0_1":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},'
        b'"t.m/part_0_1":{"dtype":"F32","shape":[2,1],"data_offsets":[16,24]}} '
        b'\x01\x00\x00\x00\x00\x00\x00\x00\x02\x00\x00\x00\x00\x00\x00\x00\x00\x00@@\x00\x00\x80@')
    assert (out / "model-000001-of-000002.safetensors").read_bytes() == (
        b'\x88\x00\x00\x00\x00\x00\x00\x00{"t.embedding/part_0_1":{"dtype":"F32","shape":[2,1],"data_offsets":'
        b'[0,8]},"w^ ":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}     '
        b'\x00\x00\x80?\x00\x00\x00@\x00\x00\x00?')
    assert (out / "tensorkey.json").read_bytes() == (
        b'{\n    "t.embedding/part_0_1": "t@embedding^00000@65536@65536",\n    "t.id/part_0_1": '
        b'"t@id^00000@65536@65536",\n    "t.m/part_0_1": "t@m^00000@65536@65536"\n}')
    assert json.loads((out / "torch_rank_weights_embs_table_multi_shard.json").read_bytes()) == {
        "t.embedding/part_0_1": {"dense": False, "dimension": 1, "dtype": "float32", "hashmap_key": "t.id/part_0_1",
                                 "hashmap_key_dtype": "int64", "hashmap_value": "t.embedding/part_0_1",
                                 "is_hashmap": True, "name": "t.embedding/part_0_1", "shape": [2, 1]},
        "t.id/part_0_1": {"data_offsets": [0, 16], "dense": False, "dtype": "I64", "shape": [2]},
        "t.m/part_0_1": {"data_offsets": [16, 24], "dense": False, "dtype": "F32", "shape": [2, 1]},
        "w^ ": {"dense": True, "dimension": 0, "dtype": "float32", "is_hashmap": False, "name": "w^ ", "shape": [1]}}
    assert (out / "torch_rank_weights_embs_table_multi_shard.json").read_text().startswith(
        '{\n    "t.embedding/part_0_1": {\n        "dense": false,\n        "dimension": 1,\n')
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["format"], manifest["format_version"], manifest["layout"]) == ("fastckpt.sharded.recis", 1,
                                                                                     "recis")
    assert sorted(manifest["files"]) == sorted(p.name for p in out.iterdir() if p.name != "manifest.json")


def test_progress_counts_every_byte_of_a_recis_save_and_load(tmp_path, recis_dirs):
    dirs, (ids, emb, mom, dense) = recis_dirs
    seen = []
    _load(dirs[2], 0, 2, progress=lambda done, total, item: seen.append((done, total)))
    with _quiet_reader(dirs[2]) as reader:
        stored = sum(info.nbytes for info in reader.infos.values())
    assert seen[-1] == (stored, stored)  # the stored bytes of every tensor and table loaded, as the Loader counts
    saved = []
    Saver(path=str(tmp_path / "c"), parallel=2, tensors=dense, layout="recis",
          progress=lambda done, total, item: saved.append((done, total, item))).save()
    total = sum(v.nbytes for v in dense.values())
    assert saved[-1][:2] == (total, total) and {s[2] for s in saved} == {f"{n}^ " for n in dense}


def test_loader_options_on_a_recis_directory(recis_dirs):
    dirs, (ids, emb, _, dense) = recis_dirs

    def drop_table(info):
        assert set(info["hashtables"]) == {"tab"} and info["tensors"]["three"]["rows"] == [0, 100]
        del info["hashtables"]["tab"]
        return info

    tables, tensors = _load(dirs[2], 0, 1, filter_func=drop_table)
    assert tables == {} and sorted(tensors) == sorted(dense)
    mine = {"tab": HashTable(DIM)}  # no slots asked for: the checkpoint's adam_m is not loaded
    tables, _ = _load(dirs[2], 0, 1, hashtables=mine, tensors={"one": np.zeros((2, 2), np.float32)})
    assert tables["tab"] is mine["tab"] and len(mine["tab"]) == len(ids) and mine["tab"].slots == ()
    with pytest.raises(ValueError, match="is dim 4 float32 in the checkpoint, the table given is dim 3"):
        _load(dirs[2], 0, 1, hashtables={"tab": HashTable(3)})
    with pytest.raises(ValueError, match=r"has no slots \['v'\] in the checkpoint"):
        _load(dirs[2], 0, 1, hashtables={"tab": HashTable(DIM, slots=("v",))})
    with pytest.raises(KeyError, match="no hashtable 'tabb'; close matches: \\['tab'\\]"):
        _load(dirs[2], 0, 1, hashtables={"tabb": HashTable(DIM)})


def _reworded(raw: bytes, how: str) -> bytes:
    """A manifest's bytes rewritten as ``how`` says (its values kept unless ``how`` is ``"edited"``)."""
    manifest = json.loads(raw)
    if how == "as saved":
        return raw
    if how == "indented by 4":  # the same values, not as a save writes them: the checksum's lines differ
        return (json.dumps(manifest, indent=4, sort_keys=True) + "\n").encode()
    if how == "a space added after the seal":  # the checksum's lines as saved, the rest not
        return raw.replace(b'"files": {', b'"files":  {', 1)
    if how == "edited":  # a value changed, the checksum's lines as saved
        return raw.replace(b'"world_size": 1', b'"world_size": 2', 1)
    raise ValueError(how)


@pytest.mark.parametrize("layout", ["recis", "fastckpt"])
@pytest.mark.parametrize("how, accepted, cut", [("as saved", True, True), ("indented by 4", True, False),
                                                ("a space added after the seal", True, False),
                                                ("edited", False, False)])
def test_a_manifests_seal_is_checked_on_its_bytes_where_they_are_as_saved_with_the_same_verdict(
        tmp_path, monkeypatch, layout, how, accepted, cut):
    """check_seal hashes the bytes read less the checksum's lines where they are as a save writes them, and
    serializes the manifest again only where not: the same manifests accepted and refused either way, and a reader
    opening a manifest as saved serializes nothing."""
    from fastckpt.errors import ChecksumMismatchError
    from fastckpt.sharded import format as format_module

    ids, emb, mom, dense = _state(4, 30)
    out = tmp_path / "c"
    if layout == "recis":
        _save_recis(str(out), ids, emb, mom, dense, 1, parallel=1)
    else:
        Saver(path=str(out), parallel=1, tensors=dense).save()
    raw = _reworded((out / "manifest.json").read_bytes(), how)
    manifest = json.loads(raw)
    serialized = []
    real = format_module.manifest_checksum
    monkeypatch.setattr(format_module, "manifest_checksum", lambda m: serialized.append(1) or real(m))
    for given in (raw, None):  # with the bytes, and without (serialized again): one verdict
        if accepted:
            format_module.check_seal(manifest, "manifest.json", given)
        else:
            with pytest.raises(ChecksumMismatchError, match="manifest.json: its contents hash to BLAKE3"):
                format_module.check_seal(manifest, "manifest.json", given)
        if given is not None:
            assert serialized == ([] if cut else [1])
    (out / "manifest.json").write_bytes(raw)
    serialized.clear()
    if accepted:
        with CheckpointReader(str(out)) as reader:
            assert reader.manifest == manifest
        assert len(serialized) == (0 if cut else 1)
    else:
        with pytest.raises(ChecksumMismatchError, match="manifest.json"):
            CheckpointReader(str(out))
