"""Fuzz of the RecIS-layout reader: every malformed field is a library error, never a wrong load or another exception.

Two directories are damaged in many ways: one as RecIS's serializer writes it (tests/_recis_writer.py, no
manifest) and one saved by fastckpt with ``layout="recis"`` (a manifest with sizes, BLAKE3 hashes and its own
checksum; half of its damages are *resealed*: the manifest rewritten to match the damaged metadata, as a tool
that edits checkpoints consistently would). Each damaged directory is opened, read whole, verified and loaded by
1 and 2 ranks, and each outcome is counted:

* ``library``: a fastckpt error (FormatError, IntegrityError, CheckpointChangedError, ...) was raised, or
  ``verify()`` reported the damage;
* ``exact``: everything read and loaded is what was saved (the damage did not touch what is read: a
  description's ``dimension``, say);
* ``wrong``: something else was read or loaded, and nothing said so;
* ``other``: any other exception (TypeError, numpy's ValueError, RecursionError, MemoryError...).

``other`` must be 0 for both directories; ``wrong`` must be 0 for the directory with a manifest. A directory
RecIS wrote has no record of its bytes, so a consistent edit of it is a different checkpoint and can only be
counted. The default run samples a few hundred damages; ``-m slow`` several thousand.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import warnings
from collections import Counter

import blake3
import numpy as np
import pytest

import _recis_writer as recis_port
from fastckpt.errors import FastCkptError
from fastckpt.sharded import CheckpointReader, HashTable, Loader, Saver
from fastckpt.sharded.format import dumps, seal
from fastckpt.sharded.recis import slice_owner

DIM = 4
METADATA = ("index", "tensorkey.json", "torch_rank_weights_embs_table_multi_shard.json")
HOSTILE = [None, -1, 0, 1, 2 ** 63, 10 ** 30, 1.5, True, "", "x", "a@b^c", "t@id^00000@99999@65536",
           "00000@32768@65536", [], [1], [-1, 2], {}, {"a": 1}, [[[[[[[[]]]]]]]], "I64", "F32", "float32"]


def _state(n_ids=300, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.choice(np.arange(-10 ** 5, 10 ** 5), n_ids, replace=False).astype(np.int64)
    emb = rng.standard_normal((n_ids, DIM)).astype(np.float32)
    mom = rng.standard_normal((n_ids, DIM)).astype(np.float32)
    dense = {"w": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.arange(5, dtype=np.int64)}
    return ids, emb, mom, dense


def _recis_written(path: str) -> str:
    ids, emb, mom, dense = _state()
    owner = slice_owner(ids, 2)
    ranks = []
    for i in range(2):
        o = np.flatnonzero(owner == i)
        ranks.append({"t": (ids[o], [("embedding", emb[o]), ("m", mom[o])], recis_port.gen_slice(i, 2))})
    recis_port.write_checkpoint(path, ranks, dense, parallel=2)
    return path


def _fastckpt_written(path: str) -> str:
    ids, emb, mom, dense = _state()
    table = HashTable(DIM, slots=["m"], name="t")
    table.insert(ids, emb, slots={"m": mom})
    Saver(path=path, parallel=3, hashtables={"t": table}, tensors=dense, layout="recis").save()
    return path


def _everything(path: str):
    """What a user gets from the directory: every tensor read whole, verify()'s problems, the loads by 1 and 2
    ranks (ids sorted, with their rows)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with CheckpointReader(path, verify=True) as reader:
            tensors = {name: np.array(reader.read_tensor(name)) for name in reader.tensor_names()}
            problems = reader.verify()
        loads = []
        for j, m in ((0, 1), (0, 2), (1, 2)):
            tables, dense = Loader(path, shard_index=j, shard_num=m, verify=True).load()
            got = {name: np.array(v) for name, v in dense.items()}
            for name, table in tables.items():
                ids, values, slots = table.rows()
                order = np.argsort(ids)
                got[f"{name}.ids"] = ids[order]
                got[f"{name}.values"] = values[order]
                got.update({f"{name}.{s}": rows[order] for s, rows in slots.items()})
            loads.append(got)
    return tensors, problems, loads


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def _paths(obj, prefix=()):
    """Every (path, value) of a JSON value, containers included."""
    yield prefix, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _damage_json(obj, rng: random.Random):
    """One random structural damage of a parsed JSON file: a value replaced by a hostile one, a key deleted,
    renamed or copied under another key (an orphan or duplicate block), two values swapped, a deep nesting."""
    obj = copy.deepcopy(obj)
    paths = [p for p, _ in _paths(obj) if p]
    if not paths:
        return rng.choice(HOSTILE)
    path = rng.choice(paths)
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    op = rng.randrange(6)
    if op == 0:
        parent[key] = copy.deepcopy(rng.choice(HOSTILE))
    elif op == 1 and isinstance(parent, dict):
        del parent[key]
    elif op == 2 and isinstance(parent, dict):
        parent[f"{key}x" if isinstance(key, str) else key] = parent.pop(key)
    elif op == 3 and isinstance(parent, dict):
        other = rng.choice(list(parent))
        parent[str(key).replace("part_0", "part_9").replace("^", "^^") + "_dup"] = copy.deepcopy(parent[other])
    elif op == 4:
        others = [p for p in paths if len(p) == len(path) and p != path]
        if others:
            o = rng.choice(others)
            holder = obj
            for k in o[:-1]:
                holder = holder[k]
            parent[key], holder[o[-1]] = holder[o[-1]], parent[key]
    else:  # written as text below: json.dumps itself cannot nest this deep
        parent[key] = f"@DEEP{rng.choice([70, 1000, 100_000])}@"
    return obj


def _reseal(path: str) -> None:
    """Rewrite the manifest (if any, and still an object) to match the metadata files as they are now."""
    m_path = os.path.join(path, "manifest.json")
    if not os.path.exists(m_path):
        return
    try:
        manifest = json.loads(open(m_path, "rb").read())
    except (ValueError, RecursionError):
        return
    if not (isinstance(manifest, dict) and isinstance(manifest.get("files"), dict)):
        return
    for name in METADATA:
        p = os.path.join(path, name)
        if os.path.exists(p) and isinstance(manifest["files"].get(name), dict):
            data = open(p, "rb").read()
            manifest["files"][name] = {**manifest["files"][name], "size": len(data),
                                       "blake3": blake3.blake3(data).hexdigest()}
    open(m_path, "wb").write(dumps(seal(manifest)))


def _damage(path: str, rng: random.Random, has_manifest: bool) -> str:
    """Damage the directory at ``path`` in place; returns a word for what was done."""
    names = [*METADATA, *(["manifest.json"] if has_manifest else [])]
    kind = rng.choice(["json"] * 5 + ["bytes", "header", "relabel", "size"] * has_manifest + ["bytes", "header",
                                                                                               "relabel"])
    if kind == "json":
        name = rng.choice(names)
        p = os.path.join(path, name)
        obj = json.loads(open(p, "rb").read())
        text = json.dumps(_damage_json(obj, rng))
        for depth in (70, 1000, 100_000):
            text = text.replace(f'"@DEEP{depth}@"', "[" * depth + "]" * depth)
        open(p, "w").write(text)
    elif kind == "bytes":
        p = os.path.join(path, rng.choice(names))
        data = bytearray(open(p, "rb").read())
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(data))
            data[i] = rng.randrange(256)
        if rng.random() < 0.3:
            data = data[: rng.randrange(len(data))]
        open(p, "wb").write(bytes(data))
    elif kind == "header":
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        p = os.path.join(path, rng.choice(files))
        data = bytearray(open(p, "rb").read())
        length = int.from_bytes(data[:8], "little")
        i = rng.randrange(8, 8 + length)
        data[i] = rng.choice(b'{}[]":,0123456789 aeIFU')
        open(p, "wb").write(bytes(data))
    elif kind == "relabel":  # a slot block or a dense one named as another table's ids
        p = os.path.join(path, "tensorkey.json")
        tensorkey = json.loads(open(p, "rb").read())
        keys = sorted(tensorkey)
        a, b = rng.sample(keys, 2)
        tensorkey[a], tensorkey[b] = tensorkey[b], tensorkey[a]
        open(p, "w").write(json.dumps(tensorkey))
    else:  # a size in the manifest that no file has
        p = os.path.join(path, "manifest.json")
        manifest = json.loads(open(p, "rb").read())
        name = rng.choice(sorted(manifest["files"]))
        manifest["files"][name]["size"] = rng.choice([10 ** 30, 2 ** 63, 2 ** 40, manifest["files"][name]["size"] + 1])
        open(p, "wb").write(dumps(seal(manifest)))
        return kind
    if has_manifest and rng.random() < 0.5:
        _reseal(path)
        kind += "+resealed"
    return kind


def fuzz(base: str, work: str, count: int, seed: int, has_manifest: bool) -> tuple[Counter, list]:
    want = _everything(base)
    assert want[1] == []
    counts, others = Counter(), []
    rng = random.Random(seed)
    for n in range(count):
        path = os.path.join(work, f"d{n}")
        shutil.copytree(base, path)
        kind = _damage(path, rng, has_manifest)
        kind = f"{kind} (damage {n})"
        try:
            got = _everything(path)
        except FastCkptError:
            counts["library"] += 1
        except Exception as exc:  # noqa: BLE001 - what this counts
            counts["other"] += 1
            others.append(f"{kind}: {type(exc).__name__}: {str(exc)[:300]}")
        else:
            if got[1]:
                counts["library"] += 1  # verify() named the damage
            elif _same(got[0], want[0]) and _same(got[2], want[2]):
                counts["exact"] += 1
            else:
                counts["wrong"] += 1
                others.append(f"{kind}: a wrong load")
        shutil.rmtree(path)
    return counts, others


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("recis-fuzz")
    return {"recis-written": _recis_written(str(root / "recis")),
            "fastckpt-written": _fastckpt_written(str(root / "fastckpt"))}


@pytest.mark.parametrize("which,count", [("recis-written", 150), ("fastckpt-written", 150)] + [
    pytest.param(which, 2000, marks=pytest.mark.slow) for which in ("recis-written", "fastckpt-written")])
def test_fuzzed_recis_directories_raise_only_library_errors(which, count, bases, tmp_path):
    counts, problems = fuzz(bases[which], str(tmp_path), count, seed=28 + count,
                            has_manifest=which == "fastckpt-written")
    print(which, count, dict(counts))
    assert counts["other"] == 0, problems[:5]
    if which == "fastckpt-written":
        assert counts["wrong"] == 0, problems[:5]
