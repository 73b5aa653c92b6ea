"""Each rank opens only the tensor files it reads: a file is pinned, mapped and its header checked on first use.

Until 0.7, ``CheckpointReader`` mapped every tensor file and parsed its header when it opened, so every rank (every
MPI process) opened every file, and one damaged file of another rank stopped every rank's load.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from fastckpt.errors import FormatError
from fastckpt.sharded import CheckpointReader, HashTable, Loader
from fastckpt.sharded.format import (DESCRIPTION_FILE, INDEX_FILE, SLICE_SIZE, group_rows, parse_part_key, rows_of,
                                     slice_owner)

from _sharded_edit import count_maps, damage_file, save_threads

DIM, ROWS = 3, 16


def _state(ranks: int, seed: int = 7) -> tuple[list[dict], dict]:
    """Each rank's table holds the ids of its own key-space slice (as RecIS's training places them), with a slot."""
    rng = np.random.default_rng(seed)
    ids = np.unique(rng.integers(-(2**40), 2**40, 3000)).astype(np.int64)
    tables = []
    for r in range(ranks):
        mine = ids[slice_owner(ids, ranks) == r]
        t = HashTable(DIM, slots=("m",))
        values = (mine % 997).astype(np.float32)[:, None] + np.arange(DIM, dtype=np.float32)
        t.insert(mine, values, {"m": -values})
        tables.append({"emb": t})
    return tables, {"w": np.arange(ROWS * 4, dtype=np.float32).reshape(ROWS, 4)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``{N: (path, tables, dense)}``: one checkpoint saved by N thread-ranks, two writers each."""
    root = tmp_path_factory.mktemp("lazy")
    out = {}
    for n in (1, 2, 4):
        tables, dense = _state(n)
        out[n] = (save_threads(root / f"c{n}", tables, dense, parallel=2), tables, dense)
    return out


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """The names of the tensor files every reader of this test maps, in order (each time one is mapped)."""
    return count_maps(monkeypatch)


def _files_of_ranks(path: str, ranks: set[int]) -> set[str]:
    """The tensor files holding a part saved by one of ``ranks`` (from the index, read here as JSON)."""
    index = json.loads((Path(path) / INDEX_FILE).read_bytes())
    names = {number: name for name, number in index["file_index"].items()}
    return {names[number] for key, number in index["block_index"].items() if parse_part_key(key)[1] in ranks}


def _owners(path: str, n: int, m: int, j: int) -> set[int]:
    """The saving ranks (of ``n``) whose dense rows meet loading rank ``j`` of ``m``'s, or whose id part has rows in
    a slice group that meets its slice (the groups its part's description records: what the rank reads)."""
    descriptions = json.loads((Path(path) / DESCRIPTION_FILE).read_bytes())
    r0, r1 = rows_of(j, m, ROWS)
    dense = {i for i in range(n) if rows_of(i, n, ROWS)[0] < r1 and r0 < rows_of(i, n, ROWS)[1]}
    if m == 1:
        return set(range(n))
    return dense | {i for i in range(n) if
                    len(set(group_rows(descriptions[f"emb.id/part_{i}_{n}"]["slices"]["rows"], SLICE_SIZE, j, m))) == 2}


def _expected(tables: list[dict], dense: dict, m: int, j: int):
    ids = np.concatenate([t["emb"].export()[0] for t in tables])
    values = np.concatenate([t["emb"].export()[1] for t in tables])
    mine = slice_owner(ids, m) == j
    order = np.argsort(ids[mine])
    r0, r1 = rows_of(j, m, ROWS)
    return ids[mine][order], values[mine][order], dense["w"][r0:r1]


def _load(path: str, m: int, j: int, verify: bool):
    tables, tensors = Loader(path, shard_index=j, shard_num=m, dense="rows", verify=verify).load()
    ids, values, slots = tables["emb"].export()
    order = np.argsort(ids)
    return ids[order], values[order], slots["m"][order], tensors["w"]


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("n, m", [(4, 4), (4, 2), (4, 3), (2, 4), (2, 2)])
def test_a_rank_maps_only_the_files_holding_what_it_loads(saved, opened, n, m, verify):
    path, tables, dense = saved[n]
    for j in range(m):
        opened.clear()
        ids, values, m_slot, w = _load(path, m, j, verify)
        want_ids, want_values, want_w = _expected(tables, dense, m, j)
        assert ids.tolist() == want_ids.tolist() and values.tobytes() == want_values.tobytes()
        assert m_slot.tobytes() == (-want_values).tobytes() and w.tobytes() == want_w.tobytes()
        assert len(opened) == len(set(opened))  # each once
        assert set(opened) == _files_of_ranks(path, _owners(path, n, m, j)) < set(CheckpointReader(path).files)


@pytest.mark.parametrize("damage", ["truncated", "header", "removed"])
@pytest.mark.parametrize("verify", [False, True])
def test_a_rank_loads_its_share_while_another_ranks_file_is_damaged(saved, tmp_path, damage, verify):
    path, tables, dense = saved[2]
    copy = shutil.copytree(path, tmp_path / "c")
    [bad] = sorted(_files_of_ranks(copy, {1}) - _files_of_ranks(copy, {0}))[:1]
    error, said = damage_file(copy / bad, damage)
    ids, values, _, w = _load(str(copy), 2, 0, verify)  # rank 0 reads none of rank 1's files
    want_ids, want_values, want_w = _expected(tables, dense, 2, 0)
    assert ids.tolist() == want_ids.tolist() and values.tobytes() == want_values.tobytes()
    assert w.tobytes() == want_w.tobytes()
    messages = set()
    for _ in range(2):  # rank 1 is told what is wrong with its file, every time
        target_table = {"emb": HashTable(DIM, slots=("m",))}
        with pytest.raises(error, match=said) as caught:
            Loader(str(copy), hashtables=target_table, shard_index=1, shard_num=2, dense="rows", verify=verify).load()
        assert len(target_table["emb"]) == 0  # nothing placed
        messages.add(str(caught.value))
    assert len(messages) == 1
    with CheckpointReader(copy) as r:  # a reader: the tensors of the good file read; the damaged one raises
        assert r.read_tensor("w/part_0_2").tobytes() == dense["w"][: ROWS // 2].tobytes()
        assert r.tensor_shape("w") == (ROWS, 4) and r.tensor_dtype("emb.embedding") == np.float32
        held = r.tensorkey[next(k for k in r.part_infos if r.file_name(k) == bad)]  # a tensor with a part there
        for _ in range(2):
            with pytest.raises(error, match=said):
                r.read_tensor(held)
        with pytest.raises(error, match=said):
            r.verify()


def test_a_reader_maps_a_file_the_first_time_one_of_its_parts_is_used(saved, opened):
    path, _, dense = saved[4]
    with CheckpointReader(path, verify=False) as r:
        assert opened == [] and r.files.opened() == {}
        assert r.tensor_names() == ["emb.embedding", "emb.id", "emb.m", "w"]
        assert r.tensor_shape("w") == (ROWS, 4) and r.part_nbytes("w/part_2_4") == 4 * 4 * 4
        assert r.hashtables()["emb"]["ids"] == sum(r.descriptions[k]["shape"][0] for k in r.part_names("emb.id"))
        assert len(r.part_infos) == len(r.descriptions) and "w/part_2_4" in r.part_infos and opened == []
        assert r.read_tensor("w/part_2_4").tobytes() == dense["w"][8:12].tobytes()
        assert opened == [r.file_name("w/part_2_4")] == list(r.files.opened())
        r.read_tensor("w/part_2_4"), r.part_infos["w/part_2_4"]
        assert len(opened) == 1  # kept mapped
        assert r.read_tensor("w").tobytes() == dense["w"].tobytes()
        assert sorted(opened) == sorted({r.file_name(k) for k in r.part_names("w")})
        assert r.verify() == [] and sorted(opened) == sorted(r.files) and len(opened) == len(set(opened))
    assert all(f.closed for f in r.files.opened().values())
    r = CheckpointReader(path)
    r.close()
    with pytest.raises(ValueError, match="the reader is closed"):  # a file not opened before: not opened now
        r.files[next(iter(r.files))]


def test_a_header_that_disagrees_with_the_descriptions_is_named_when_its_file_is_used(saved, tmp_path):
    """The header's keys, shapes and dtypes are checked against the metadata before a byte of the file is used."""
    path, tables, dense = saved[2]
    copy = shutil.copytree(path, tmp_path / "c")
    with CheckpointReader(copy) as r:
        bad = r.file_name("w/part_1_2")
    data = bytearray((copy / bad).read_bytes())
    length = int.from_bytes(data[:8], "little")
    header = bytes(data[8:8 + length])
    assert b'"F32"' in header
    (copy / bad).write_bytes(bytes(data[:8]) + header.replace(b'"F32"', b'"I32"', 1) + bytes(data[8 + length:]))
    with CheckpointReader(copy, verify=False) as r:
        assert r.read_tensor("w/part_0_2").tobytes() == dense["w"][:8].tobytes()
        with pytest.raises(FormatError, match=rf"{bad}: tensor '.*' is int32.* in the safetensors header, .* says float32"):
            r.read_tensor("w")


def test_verify_without_hashes_still_opens_and_checks_every_file(saved, tmp_path, capsys):
    """`fastckpt verify --no-hash` checks sizes and headers: the reader no longer opens the files itself."""
    from fastckpt.cli import main

    path, *_ = saved[2]
    copy = shutil.copytree(path, tmp_path / "c")
    assert main(["verify", "--no-hash", str(copy)]) == 0
    bad = sorted(_files_of_ranks(copy, {1}))[0]
    data = (copy / bad).read_bytes()
    (copy / bad).write_bytes(data[: len(data) // 2])
    capsys.readouterr()
    assert main(["verify", "--no-hash", str(copy)]) == 1
    assert f"{bad}: {len(data) // 2} bytes, the commit record says {len(data)}" in capsys.readouterr().out


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("n, m", [(4, 4), (4, 2), (4, 3), (2, 4)])
def test_a_rank_loading_from_s3_fetches_only_the_files_it_reads_and_their_headers(saved, s3, monkeypatch, n, m,
                                                                                  verify):
    # Until 0.8, a rank loading from a URL fetched the header of every tensor file of the checkpoint (with the
    # metadata, in the round after the manifest), whichever files it read; a verified rank fetched them before the
    # whole files it reads. Now index.json, fetched with the manifest, names the files holding the parts it reads:
    # only those files' headers are fetched (none where the files are fetched whole, verified), in as few rounds:
    # since 0.10 in the round of the ranges, which the metadata places (until 0.9, a round before them).
    from fastckpt.formats import remote as formats_remote

    path, tables, dense = saved[n]
    url = s3.url("lazy")
    s3.filesystem().put(f"{path}/", f"{url}/", recursive=True)
    sizes = {p.name: p.stat().st_size for p in Path(path).iterdir()}
    plans: list[list] = []  # each round of ranged reads: [(file, [(begin, end), ...])]
    real = formats_remote._fetch_into

    def fetch_into(fs, where, plan):
        plans.append([(os.path.basename(remote), spans) for remote, _, spans in plan if spans])
        return real(fs, where, plan)

    monkeypatch.setattr(formats_remote, "_fetch_into", fetch_into)
    for j in range(m):
        plans.clear()
        tables_j, tensors = Loader(url, shard_index=j, shard_num=m, dense="rows", verify=verify,
                                   storage_options=s3.storage_options).load()
        ids, values, slots = tables_j["emb"].export()
        order = np.argsort(ids)
        want_ids, want_values, want_w = _expected(tables, dense, m, j)
        assert ids[order].tolist() == want_ids.tolist() and values[order].tobytes() == want_values.tobytes()
        assert slots["m"][order].tobytes() == (-want_values).tobytes() and tensors["w"].tobytes() == want_w.tobytes()
        rounds = [plan for plan in plans if plan]
        reads = _files_of_ranks(path, _owners(path, n, m, j))
        touched = {name for plan in rounds for name, _ in plan if name.endswith(".safetensors")}
        assert touched == reads < {name for name in sizes if name.endswith(".safetensors")}
        if verify:  # the files it reads, whole, each once, in one round after the manifest's
            assert len(rounds) == 1 and sorted(rounds[0]) == sorted((name, [(0, sizes[name])]) for name in reads)
        else:  # in one round, the headers of those files and its ranges of them (until 0.9, two: headers first)
            [data] = rounds
            assert sorted(name for name, _ in data) == sorted(reads)
            for name, spans in data:
                with open(Path(path) / name, "rb") as f:
                    header_end = 8 + int.from_bytes(f.read(8), "little")  # where the file's first part starts
                # the header exactly, alone or joined to a range of parts that starts within 64 KiB of its end (one
                # request for both); alone only where the next range starts further on
                assert spans[0][0] == 0 and spans[0][1] >= header_end, (name, spans)
                if spans[0][1] == header_end:
                    assert len(spans) == 1 or spans[1][0] - header_end > 64 << 10, (name, spans)
                assert all(b < e <= sizes[name] for b, e in spans) and spans == sorted(spans)
