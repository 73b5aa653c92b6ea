"""A RecIS-layout directory opens each tensor file on first use: a rank maps only the files it reads.

Until 0.8, ``RecisCheckpointReader`` mapped every tensor file and parsed its header when it opened (its checks read
every header), so every rank opened every file, and one damaged file of another rank stopped every rank's load.
The directories here are written by RecIS's own save path (tests/_recis_writer.py, no manifest) and by
``Saver(layout="recis")`` (fastckpt's manifest beside), and the files each rank opens are counted where the
reader maps them, as tests/test_sharded_lazy_open.py counts them for fastckpt's own layout.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import _recis_writer as recis_port
import numpy as np
import pytest
from _sharded_edit import count_maps, damage_file, save_threads

from fastckpt.errors import CheckpointChangedError, FormatError
from fastckpt.sharded import CheckpointReader, HashTable, Loader, Saver
from fastckpt.sharded.format import rows_of
from fastckpt.sharded.recis import DESCRIPTION_FILE, INDEX_FILE, gen_slice, slice_owner

pytestmark = pytest.mark.filterwarnings("ignore::fastckpt.sharded.recis.RecisWarning")  # the port writes no manifest

DIM, ROWS = 3, 16


def _ids() -> np.ndarray:
    rng = np.random.default_rng(11)
    return np.unique(rng.integers(-(2**40), 2**40, 3000)).astype(np.int64)


def _rows(ids: np.ndarray) -> dict[str, np.ndarray]:
    """Each slot's rows for ``ids``, a function of the id alone."""
    emb = (ids % 997).astype(np.float32)[:, None] + np.arange(DIM, dtype=np.float32)
    return {"embedding": emb, "m": -emb, "step_filter": (ids % 5).astype(np.int64)[:, None],
            "small": emb[:, :2] * 2}


DENSE = {"w": np.arange(ROWS * 4, dtype=np.float32).reshape(ROWS, 4)}


def _recis_written(path: Path, n: int, parallel: int = 2) -> str:
    """RecIS's save on ``n`` ranks: table ``emb`` (embedding, m, a step filter) and table ``b`` (embedding only),
    each rank holding the ids of its slice, and one dense tensor."""
    ids = _ids()
    ranks = []
    for i in range(n):
        mine = ids[slice_owner(ids, n) == i]
        rows = _rows(mine)
        ranks.append({"emb": (mine, [(s, rows[s]) for s in ("embedding", "m", "step_filter")], gen_slice(i, n)),
                      "b": (mine, [("embedding", rows["small"])], gen_slice(i, n))})
    return recis_port.write_checkpoint(str(path), ranks, DENSE, parallel=parallel)


def _fastckpt_written(path: Path, n: int, parallel: int = 2) -> str:
    ids = _ids()
    tables = []
    for i in range(n):
        mine = ids[slice_owner(ids, n) == i]
        rows = _rows(mine)
        emb = HashTable(DIM, slots=("m",), name="emb")
        emb.insert(mine, rows["embedding"], {"m": rows["m"]})
        b = HashTable(2, name="b")
        b.insert(mine, rows["small"])
        tables.append({"emb": emb, "b": b})
    return save_threads(path, tables, DENSE, parallel=parallel, layout="recis")


WRITERS = {"recis": _recis_written, "fastckpt": _fastckpt_written}


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """The names of the tensor files every reader of this test maps, in order (each time one is mapped)."""
    return count_maps(monkeypatch)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``{(writer, N): path}``: one directory saved by N ranks, two writers each."""
    root = tmp_path_factory.mktemp("recis-lazy")
    return {(writer, n): make(root / f"{writer}{n}", n) for writer, make in WRITERS.items() for n in (1, 2, 4)}


def _index(path) -> tuple[dict[str, int], dict[int, str]]:
    index = json.loads((Path(path) / INDEX_FILE).read_bytes())
    return index["block_index"], {number: name for name, number in index["file_index"].items()}


def _files_read(path, m: int, j: int) -> set[str]:
    """What loading rank ``j`` of ``m`` must read by RecIS's rule, from the index as JSON: the files of the blocks
    saved by a rank whose key-space slice meets its own, and the dense tensor's file."""
    blocks, names = _index(path)
    begin, end, _ = gen_slice(j, m)
    out = set()
    for key, number in blocks.items():
        if key.endswith("^ "):
            out.add(names[number])
            continue
        i, n = (int(x) for x in key.rsplit("/part_", 1)[1].split("_"))
        b, e, _ = gen_slice(i, n)
        if b < end and begin < e:
            out.add(names[number])
    return out


def _load(path, m: int, j: int, verify: bool, **kw):
    tables, tensors = Loader(str(path), shard_index=j, shard_num=m, dense="rows", verify=verify, **kw).load()
    return tables, tensors


def _check_load(tables, tensors, m: int, j: int) -> None:
    """Exactly rank ``j`` of ``m``'s ids (its slice's), each with its rows, and its dense rows."""
    ids = _ids()
    want = np.sort(ids[slice_owner(ids, m) == j])
    want_rows = _rows(want)
    for name, slots in (("emb", ("embedding", "m")), ("b", ())):
        got_ids, values, got_slots = tables[name].rows()
        order = np.argsort(got_ids)
        assert got_ids[order].tolist() == want.tolist()
        assert values[order].tobytes() == want_rows["embedding" if name == "emb" else "small"].tobytes()
        for slot in slots[1:]:
            assert got_slots[slot][order].tobytes() == want_rows[slot].tobytes()
    r0, r1 = rows_of(j, m, ROWS)
    assert tensors["w"].tobytes() == DENSE["w"][r0:r1].tobytes()


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_opening_reads_the_metadata_alone(saved, opened, writer):
    path = saved[writer, 4]
    with CheckpointReader(path) as r:
        assert opened == [] and r.files.opened() == {} and len(r.files) == 8
        # The order of the save, the shapes and the counts: from the metadata, no file opened
        tables = r.hashtables()
        assert list(tables) == ["emb", "b"] and list(r.dense_tensors()) == ["w"]
        assert tables["emb"]["slots"] == (["m", "step_filter"] if writer == "recis" else ["m"])
        assert tables["emb"]["ids"] == len(_ids()) and tables["b"]["shape"] == [2]
        assert r.tensor_shape("emb@embedding") == (len(_ids()), DIM) and r.tensor_dtype("w") == np.float32
        assert r.part_nbytes("w^ ") == DENSE["w"].nbytes and "w^ " in r.part_infos and opened == []
        assert r.read_tensor("w").tobytes() == DENSE["w"].tobytes()
        assert opened == [r.file_name("w^ ")] == list(r.files.opened())
        r.read_tensor("w^ "), r.part_infos["w^ "]
        assert len(opened) == 1  # kept mapped
        assert r.verify() == [] and sorted(opened) == sorted(r.files) and len(opened) == len(set(opened))
    assert all(f.closed for f in r.files.opened().values())


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("n, m", [(4, 4), (4, 2), (4, 3), (2, 4), (2, 2), (1, 2)])
def test_a_rank_maps_only_the_files_holding_what_it_loads(saved, opened, writer, n, m, verify):
    path = saved[writer, n]
    everything = set(_index(path)[1].values())
    for j in range(m):
        opened.clear()
        _check_load(*_load(path, m, j, verify), m, j)
        assert len(opened) == len(set(opened))  # each once
        assert set(opened) == _files_read(path, m, j)
        if n > 1:
            assert set(opened) < everything


@pytest.mark.parametrize("damage", ["truncated", "header", "removed"])
@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_rank_loads_its_share_while_another_ranks_file_is_damaged(saved, tmp_path, writer, damage, verify):
    path = saved[writer, 2]
    copy = shutil.copytree(path, tmp_path / "c")
    bad = min(_files_read(copy, 2, 1) - _files_read(copy, 2, 0))  # a file of rank 1 alone
    error, said = damage_file(copy / bad, damage, sized=writer == "fastckpt")  # RecIS records no sizes
    _check_load(*_load(copy, 2, 0, verify), 2, 0)  # rank 0 reads none of rank 1's files
    messages = set()
    for _ in range(2):  # rank 1 is told what is wrong with its file, every time, before a row is placed
        slots = ("m", ("step_filter", 1, np.int64)) if writer == "recis" else ("m",)
        target_tables = {"emb": HashTable(DIM, slots=slots),
                         "b": HashTable(2)}
        with pytest.raises(error, match=said) as caught:
            _load(copy, 2, 1, verify, hashtables=target_tables)
        assert len(target_tables["emb"]) == len(target_tables["b"]) == 0  # nothing placed
        messages.add(str(caught.value))
    assert len(messages) == 1
    with CheckpointReader(copy) as r:  # a reader: the tensors of the good files read; the damaged one raises
        assert r.read_tensor("w").tobytes() == DENSE["w"].tobytes()
        assert r.tensor_shape("emb@id") == (len(_ids()),) and r.tensor_dtype("b@embedding") == np.float32
        held = next(k for k in r.part_infos if r.file_name(k) == bad)
        for _ in range(2):
            with pytest.raises(error, match=said):
                r.read_tensor(held)
        with pytest.raises(error, match=said):
            r.verify()


@pytest.mark.parametrize("edit", ["shape", "dtype", "data_offsets"])
def test_a_header_that_disagrees_with_the_descriptions_is_named_when_its_file_is_used(saved, tmp_path, opened, edit):
    """RecIS's description file gives every block's shape and dtype (and the ids' and slots' data_offsets): each
    header is checked against it before a byte of its file is used."""
    copy = shutil.copytree(saved["recis", 2], tmp_path / "c")
    descriptions = json.loads((copy / DESCRIPTION_FILE).read_bytes())
    key = {"shape": "emb.step_filter/part_1_2", "dtype": "b.embedding/part_1_2"}.get(edit, "emb.m/part_1_2")
    entry = descriptions[key]
    if edit == "shape":
        entry["shape"] = entry["shape"][:1]  # as many bytes, as many rows
        said = rf"block '{key}' is int64\[\d+, 1\] in the header, {DESCRIPTION_FILE} says I64\[\d+\]"
    elif edit == "dtype":
        entry["dtype"] = "int32"  # as many bytes
        said = rf"block '{key}' is float32\[\d+, 2\] in the header, {DESCRIPTION_FILE} says int32"
    else:
        entry["data_offsets"] = [o + 4 for o in entry["data_offsets"]]
        said = rf"block '{key}' lies at data_offsets \[\d+, \d+\] in the header, {DESCRIPTION_FILE} says"
    (copy / DESCRIPTION_FILE).write_text(json.dumps(descriptions, indent=4, sort_keys=True))
    bad = next(name for name in _files_read(copy, 2, 1) if key in json.loads(
        (copy / name).read_bytes()[8:8 + int.from_bytes((copy / name).read_bytes()[:8], "little")]))
    _check_load(*_load(copy, 2, 0, False), 2, 0)  # rank 0 reads none of rank 1's files
    opened.clear()
    with pytest.raises(FormatError, match=rf"{bad}: {said}"), CheckpointReader(copy) as r:
        r.read_tensor(key)
    assert opened == [bad]
    with pytest.raises(FormatError, match=rf"{bad}: {said}"):
        _load(copy, 2, 1, False)


def test_a_reader_opened_before_an_overwrite_raises_for_a_file_it_had_not_used(tmp_path):
    """What fastckpt's own layout does since 0.8: a reader reads one commit whole or raises."""
    out = str(tmp_path / "c")
    tensors = {"a": np.ones(4, np.float32), "b": np.full(3, 2.0, np.float32)}
    Saver(path=out, parallel=2, tensors=tensors, layout="recis").save()
    with CheckpointReader(out) as r:
        assert r.read_tensor("a").tolist() == [1.0] * 4 and len(r.files.opened()) == 1
        Saver(path=out, parallel=2, tensors={k: v + 10 for k, v in tensors.items()}, layout="recis",
              overwrite=True).save()
        with pytest.raises(CheckpointChangedError):
            r.read_tensor("b")
        assert r.read_tensor("a").tolist() == [1.0] * 4  # the file it had opened: the commit it read
    with CheckpointReader(out) as r:
        assert r.read_tensor("b").tolist() == [12.0] * 3


def test_an_orphan_block_is_named_by_verify_and_when_its_file_is_used(saved, tmp_path, capsys):
    """A block in a file where the index does not place it: checks that need every header run in verify() (and
    `fastckpt verify`, with or without hashes), the others when the file is used."""
    from fastckpt.cli import main

    copy = shutil.copytree(saved["recis", 2], tmp_path / "c")
    blocks, names = _index(copy)
    moved = "w^ "  # the last block rank 0 wrote
    bad = names[blocks[moved]]
    del blocks[moved]  # now placed nowhere: an orphan block of its file
    index = json.loads((copy / INDEX_FILE).read_bytes())
    index["block_index"] = blocks
    (copy / INDEX_FILE).write_text(json.dumps(index, separators=(",", ":"), sort_keys=True))
    descriptions = json.loads((copy / DESCRIPTION_FILE).read_bytes())
    del descriptions[moved]
    (copy / DESCRIPTION_FILE).write_text(json.dumps(descriptions, indent=4, sort_keys=True))
    said = re.escape(f"{bad}: holds block '{moved}', which index does not place there (an orphan block")
    with CheckpointReader(copy) as r:  # the metadata are consistent, and no file is opened
        assert r.dense_tensors() == {} and list(r.hashtables()) == ["emb", "b"] and r.files.opened() == {}
        good = next(k for k in r.part_infos if r.file_name(k) != bad)
        assert r.read_tensor(good).shape == r.tensor_shape(good)
        with pytest.raises(FormatError, match=said):
            r.verify()
        with pytest.raises(FormatError, match=said):
            r.read_tensor(next(k for k in r.part_infos if r.file_name(k) == bad))
    for args in (["verify"], ["verify", "--no-hash"]):
        capsys.readouterr()
        assert main([*args, str(copy)]) == 1
        assert "an orphan block" in capsys.readouterr().out


def _random_save(path: Path, seed: int) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """A RecIS save of random structure (ranks, writers, tables, slots, empty tables, dense tensors): returns the
    tables with their slots and the dense tensors, in the order saved."""
    rnd = random.Random(seed)
    n, p = rnd.randint(1, 4), rnd.randint(1, 4)
    ids = np.unique(np.random.default_rng(seed).integers(-(2**40), 2**40, rnd.choice([5, 60]))).astype(np.int64)
    tables = [(f"{rnd.choice('tuxaz')}{t}", rnd.sample(["m", "v", "step_filter", "zz", "aa"], rnd.randint(0, 3)),
               rnd.random() < 0.3) for t in range(rnd.randint(1, 4))]
    dense = {f"d{rnd.randint(0, 99)}_{k}": np.arange(float(rnd.choice([0, 1, 3]))) for k in range(rnd.randint(0, 5))}
    ranks = []
    for i in range(n):
        mine = ids[slice_owner(ids, n) == i]
        ranks.append({})
        for name, slots, empty in tables:
            own = mine[:0] if empty else mine
            rows = (own % 97).astype(np.float32)[:, None] * np.ones(2, np.float32)
            ranks[i][name] = (own, [("embedding", rows), *((s, -rows) for s in slots)], gen_slice(i, n))
    recis_port.write_checkpoint(str(path), ranks, dense, parallel=p)
    return [(name, slots) for name, slots, _ in tables], list(dense)


@pytest.mark.parametrize("seed", range(40))
def test_the_order_of_the_save_is_read_from_the_metadata(tmp_path, opened, seed):
    """Tables, slots and dense tensors keep the order of the save (a reshard writes RecIS's bytes back from it).
    It is replayed from the index and the description file; a file's header is read only where they leave the
    order open: several dense tensors in one file, or empty blocks at one offset."""
    try:
        tables, dense = _random_save(tmp_path / "c", seed)
    except RuntimeError:  # a writer given no block: RecIS's save never ends (the port says so)
        pytest.skip("RecIS cannot save this structure")
    with CheckpointReader(tmp_path / "c") as r:
        assert [(name, entry["slots"]) for name, entry in r.hashtables().items()] == tables
        assert list(r.dense_tensors()) == dense
        blocks = [k for k in r.part_infos]
        dense_files = [r.file_name(k) for k in blocks if k.endswith("^ ")]
        crowded = {name for name in dense_files if dense_files.count(name) > 1}
        empty = {r.file_name(k) for k in blocks if r.part_nbytes(k) == 0}
        assert crowded <= set(opened) <= crowded | empty


@pytest.mark.parametrize("n", [2, 4])
def test_each_mpi_rank_maps_only_the_files_it_reads(saved, tmp_path, n):
    """One process a rank, as a training job loads: each maps the files of its slice's blocks and the dense
    tensor's, once each, and no other (on 0.8 each mapped all ``2 n``)."""
    import subprocess
    import sys
    from importlib.util import find_spec

    from test_sharded_mpi import LOAD_SCRIPT, MPIEXEC

    if find_spec("mpi4py") is None or not os.path.exists(MPIEXEC):
        pytest.skip(f"mpi4py and an mpiexec next to {sys.executable} are needed (pip install \"fastckpt[mpi]\")")
    path = saved["recis", n]
    script = tmp_path / "load.py"
    script.write_text(LOAD_SCRIPT)
    job = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(script), path], capture_output=True, text=True,
                         timeout=120)
    assert job.returncode == 0, job.stdout + job.stderr
    ranks = json.loads(job.stdout.strip().splitlines()[-1])
    ids = _ids()
    for j, got in enumerate(ranks):
        assert len(got["mapped"]) == len(set(got["mapped"])) and set(got["mapped"]) == _files_read(path, n, j)
        assert len(got["mapped"]) < 2 * n or n == 1
        assert sorted(got["ids"]) == sorted(ids[slice_owner(ids, n) == j].tolist())
        r0, r1 = rows_of(j, n, ROWS)
        assert got["w"] == DENSE["w"][r0:r1].tolist()


def test_the_order_of_the_save_needs_no_file_of_another_rank(tmp_path, opened):
    """Two tables empty on every rank leave the order of their blocks open (empty blocks at one offset): rank 0's
    header settles it (a tensor comes where the first rank holding it placed it), and no file of another rank is
    opened for it, so a removed one stops only the ranks that read it."""
    ids = _ids()
    ranks = []
    for i in range(2):
        mine = ids[slice_owner(ids, 2) == i]
        rows = _rows(mine)
        ranks.append({"e2": (mine[:0], [("embedding", rows["small"][:0])], gen_slice(i, 2)),
                      "e1": (mine[:0], [("embedding", rows["small"][:0]), ("m", rows["small"][:0])], gen_slice(i, 2)),
                      "emb": (mine, [("embedding", rows["embedding"])], gen_slice(i, 2))})
    path = recis_port.write_checkpoint(str(tmp_path / "c"), ranks, DENSE, parallel=1)
    blocks, names = _index(path)
    (tmp_path / "c" / names[blocks["emb.id/part_1_2"]]).unlink()
    with CheckpointReader(path) as r:
        assert [(name, e["slots"]) for name, e in r.hashtables().items()] == [("e2", []), ("e1", ["m"]), ("emb", [])]
        assert opened == [names[blocks["emb.id/part_0_2"]]]  # rank 0's one file, for its header's order
        with pytest.raises(FormatError, match="missing"):
            r.read_tensor("emb@id")
    tables, tensors = Loader(path, shard_index=0, shard_num=2, dense="rows").load()
    assert sorted(tables["emb"].ids().tolist()) == sorted(ids[slice_owner(ids, 2) == 0].tolist())
    assert len(tables["e1"]) == len(tables["e2"]) == 0


def test_a_description_of_ids_without_an_axis_is_a_format_error(saved, tmp_path):
    """The structure is checked on the description file's shapes when the reader opens: what they say is checked
    as what the headers said."""
    copy = shutil.copytree(saved["recis", 2], tmp_path / "c")
    descriptions = json.loads((copy / DESCRIPTION_FILE).read_bytes())
    descriptions["emb.id/part_0_2"]["shape"] = []
    del descriptions["emb.id/part_0_2"]["data_offsets"]
    (copy / DESCRIPTION_FILE).write_text(json.dumps(descriptions, indent=4, sort_keys=True))
    with pytest.raises(FormatError, match=r"index: hashtable 'emb': block 'emb.embedding/part_0_2' has shape "
                                          r"\[\d+, 3\], its ids 'emb.id/part_0_2' \[\]: a slot holds one row per id"):
        CheckpointReader(copy)


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("n, m", [(4, 4), (4, 2), (4, 3), (2, 4)])
def test_a_rank_loading_from_a_url_fetches_the_headers_of_the_files_it_reads_only(saved, monkeypatch, writer, n, m):
    # Until this reader opened its files on first use, a rank loading a RecIS-layout directory from a URL fetched
    # every tensor file's header (the reader checked them all when it opened). Now RecIS's index names the files
    # holding the blocks the rank reads: only their headers are fetched, and the load is exact.
    import uuid
    import warnings

    from fastckpt.formats import remote as formats_remote
    from fastckpt.sharded.recis import RecisWarning

    path = saved[writer, n]
    url = f"memory://recis-heads-{uuid.uuid4().hex[:8]}/c"
    formats_remote.put_directory(Path(path), url, "index")
    plans: list = []
    real = formats_remote._fetch_into
    monkeypatch.setattr(formats_remote, "_fetch_into", lambda fs, where, plan: (
        plans.extend((os.path.basename(r), spans) for r, _, spans in plan if spans), real(fs, where, plan))[1])
    everything = set(_index(path)[1].values())
    for j in range(m):
        plans.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecisWarning)
            _check_load(*_load(url, m, j, verify=False), m, j)
        headers = {name for name, spans in plans if name in everything and spans[0] == (0, spans[0][1])
                   and spans[0][1] <= 8192}
        assert headers == {name for name, _ in plans if name in everything} == _files_read(path, m, j)
        assert headers < everything


def _count_readers(monkeypatch) -> list:
    """Every RecIS-layout reader opened from here on (the path, as it opens)."""
    from fastckpt.sharded.recis import RecisCheckpointReader

    opened: list = []
    real_open = RecisCheckpointReader._open

    def counted(self, *args, **kwargs):
        opened.append(self.path)
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(RecisCheckpointReader, "_open", counted)
    return opened


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_ranks_loading_at_once_open_the_directory_once_and_map_each_file_once(saved, opened, monkeypatch, writer,
                                                                                verify):
    """Ranks as threads loading one RecIS-layout directory at the same time share one reader: its metadata read
    and checked once, each file mapped (and hashed) once between them, closed by the last to finish; a load after
    that opens it anew. In 0.9.0 each rank opened a reader of its own, and all but rank 0 mapped rank 0's files."""
    import threading

    from _threads import run_in_threads

    import fastckpt.sharded.recis as recis_module

    path = saved[writer, 4]
    readers = _count_readers(monkeypatch)
    at_once = threading.Barrier(4)
    held: list = []
    real_shared = getattr(recis_module, "shared_reader", None)

    @contextlib.contextmanager
    def held_together(key, open_reader, current):
        with real_shared(key, open_reader, current) as reader:
            held.append(reader)
            at_once.wait(30)  # every rank holds its reader before any lets go
            yield reader

    monkeypatch.setattr(recis_module, "shared_reader", held_together, raising=False)
    loaded: dict = {}
    assert run_in_threads(lambda j: loaded.__setitem__(j, _load(path, 4, j, verify)), 4, timeout=60) == []
    for j in range(4):
        _check_load(*loaded[j], 4, j)
    assert readers == [str(path)] and len({id(r) for r in held}) == 1 and held[0].closed
    assert sorted(opened) == sorted(set().union(*(_files_read(path, 4, j) for j in range(4))))  # each once
    if verify and writer == "fastckpt":
        assert held[0].verified_files() == sorted(opened)
    monkeypatch.setattr(recis_module, "shared_reader", real_shared)
    _check_load(*_load(path, 4, 1, verify), 4, 1)
    assert len(readers) == 2  # opened again once the four had let go


def test_a_directory_replaced_while_a_load_holds_its_reader_is_loaded_as_it_is_now(tmp_path):
    """A reader of the old commit, held by a load, is not lent to a load that starts after the directory was
    replaced (a save with overwrite=True): that load opens the new one."""
    import fastckpt.sharded.recis as recis_module

    path = str(_fastckpt_written(tmp_path / "c", 2))
    key = ("recis", os.path.realpath(path), False)
    opening = lambda: recis_module.RecisCheckpointReader(path, verify=False)  # noqa: E731
    with recis_module.shared_reader(key, opening, lambda r: r.snapshot.changed() is None) as old:
        assert old.hashtables()["emb"]["ids"] == len(_ids())
        table = HashTable(DIM, slots=("m",), name="emb")
        table.insert(np.array([5, 6]), np.full((2, DIM), 7, np.float32), {"m": np.zeros((2, DIM), np.float32)})
        Saver(path=path, parallel=1, hashtables={"emb": table}, layout="recis", overwrite=True).save()
        tables, _ = Loader(path, verify=False, shard_index=0, shard_num=1).load()
        assert tables["emb"].ids().tolist() == [5, 6] and (tables["emb"].lookup([5, 6]) == 7).all()
        assert not old.closed and old.hashtables()["emb"]["ids"] == len(_ids())
    assert old.closed


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("n, m", [(4, 4), (2, 2), (1, 1), (4, 3), (2, 4)])
def test_a_rank_reads_the_rows_of_blocks_all_its_own_from_the_files_not_through_their_mappings(
        saved, monkeypatch, writer, n, m, verify):
    """Where every id of a block is the loading rank's (a load on the ranks that saved), its slots' rows and the
    rank's dense rows are read with preadv into the arrays the table adopts, not copied out of the mapped files
    (each page of a mapping copied costs a page fault, and ranks as threads fault one address space); the blocks
    a rank takes some rows of are gathered from the mapping. Exact either way. In 0.9.0 every row was copied
    through the mapping."""
    from fastckpt.sharded.recis import RecisCheckpointReader

    path = saved[writer, n]
    read: list[str] = []
    real = RecisCheckpointReader.read_into

    def counting(self, key, out, start=0):
        read.append(key)
        return real(self, key, out, start)

    monkeypatch.setattr(RecisCheckpointReader, "read_into", counting)
    read_whole = 0
    for j in range(m):
        read.clear()
        _check_load(*_load(path, m, j, verify), m, j)
        blocks, _ = _index(path)
        whole = []  # the slot blocks beside the id blocks that lie inside rank j's slice (every id its own)
        begin, end, _ = gen_slice(j, m)
        for key in blocks:
            if key.endswith("^ ") or ".id/" in key:
                continue
            i, k = (int(x) for x in key.rsplit("/part_", 1)[1].split("_"))
            b, e, _ = gen_slice(i, k)
            if begin <= b and e <= end:
                whole.append(key)
        assert sorted(k for k in read if k != "w^ ") == sorted(whole)
        assert read.count("w^ ") == 1  # its dense rows
        read_whole += len(whole)
    assert bool(read_whole) == (m <= n)  # (2 -> 4: every block is split between two ranks)


def test_a_shared_open_that_fails_fails_every_rank_with_its_own_error(saved, tmp_path):
    """Ranks as threads loading a directory whose metadata is damaged: the shared open fails, and every rank
    raises the reader's error (each opening its own after the failed one), none loads or hangs."""
    from _threads import run_in_threads

    copy = shutil.copytree(saved["fastckpt", 4], tmp_path / "c")
    (copy / "tensorkey.json").write_bytes(b"{")  # no longer the bytes the manifest lists
    errors = run_in_threads(lambda j: _load(copy, 4, j, False), 4, timeout=60)
    assert len(errors) == 4 and len({type(e) for e in errors}) == 1
    assert all("tensorkey.json" in str(e) for e in errors)
