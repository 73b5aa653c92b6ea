"""Editing a sharded checkpoint's metadata the way a tool that rewrites it consistently would: ``reseal`` records the
edited files' sizes and hashes in the manifest and the manifest's own checksum, so that what the loaders' cross-checks
catch is tested apart from what the hashes catch."""

from __future__ import annotations

import json
from pathlib import Path

import blake3

from fastckpt.sharded.format import DESCRIPTION_FILE, INDEX_FILE, MANIFEST_FILE, TENSORKEY_FILE, dumps, seal

METADATA = (INDEX_FILE, TENSORKEY_FILE, DESCRIPTION_FILE)


def reseal(directory, manifest: dict | None = None) -> None:
    """Record every metadata file's size and BLAKE3 in the manifest (``manifest``, or the one on disk when it is a
    JSON object) and, for a version-3 manifest, its checksum; write it."""
    d = Path(directory)
    if manifest is None:
        manifest = json.loads((d / MANIFEST_FILE).read_bytes())
    if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict):
        for name in METADATA:
            if (d / name).exists() and isinstance(manifest["files"].get(name), dict):
                data = (d / name).read_bytes()
                manifest["files"][name] = {**manifest["files"][name], "size": len(data),
                                           "blake3": blake3.blake3(data).hexdigest()}
    if isinstance(manifest, dict) and "checksum" in manifest:
        manifest = seal(manifest)
    (d / MANIFEST_FILE).write_bytes(dumps(manifest))


def save_threads(path, tables: list[dict], tensors: dict, parallel: int = 2, **options) -> str:
    """Save ``tables[r]`` from ``len(tables)`` thread-ranks (``tensors`` on each) to ``path``; returns the path."""
    import threading

    from fastckpt.sharded import Saver
    from fastckpt.sharded.engine import ThreadEngine

    engines = ThreadEngine.group(len(tables))
    errors: list = []

    def run(rank):
        try:
            Saver(shard_index=rank, shard_num=len(tables), parallel=parallel, path=str(path), hashtables=tables[rank],
                  tensors=tensors, engine=engines[rank], timeout=60, **options).save()
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(tables))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return str(path)


def small_chain(root, **options) -> tuple[str, str]:
    """A full checkpoint of 2 ranks x 2 files (dense tensors, a table with 2 slots, a bfloat16 table) and a delta on
    it: ``(full, delta)`` paths under ``root``; ``options`` go to both saves (``compression="zstd"``, say)."""
    import ml_dtypes
    import numpy as np

    from fastckpt.sharded import DeltaPolicy, HashTable

    root = Path(root)
    tables = []
    for rank in range(2):
        emb = HashTable(3, slots=("m", "v"), name="emb")
        ids = np.arange(-6, 10, dtype=np.int64)[rank::2] * 7919
        emb.insert(ids, (ids[:, None] % 97 + np.arange(3)).astype(np.float32) / 4,
                   slots={"m": np.full((len(ids), 3), rank + 0.5, np.float32),
                          "v": (ids[:, None] % 13 + np.zeros(3)).astype(np.float32)})
        small = HashTable(2, dtype=ml_dtypes.bfloat16, name="small")
        small.insert([rank + 1], [[1.5, -2.0]])
        tables.append({"emb": emb, "small": small})
    tensors = {"w": np.arange(40, dtype=np.float32).reshape(10, 4) / 3, "b": np.arange(5, dtype=np.int64),
               "step": np.array(7, np.int64)}
    full = save_threads(root / "full", tables, tensors, **options)
    tables[0]["emb"].update([0], [[9.0, 9.0, 9.0]], slots={"m": [[1.0, 2.0, 3.0]]})
    tables[1]["emb"].delete([7919])
    tables[1]["emb"].insert([12345], [[4.0, 4.0, 4.0]])
    delta = save_threads(root / "delta", tables, tensors, incremental=DeltaPolicy(max_fraction=1.0), **options)
    return full, delta


def loaded_bytes(path, shard_index: int = 0, shard_num: int = 1, **options) -> dict[str, bytes]:
    """Everything a Loader gives, as bytes (tables sorted by id): what a silent wrong load would change."""
    import numpy as np

    from fastckpt.sharded import Loader

    tables, tensors = Loader(str(path), shard_index=shard_index, shard_num=shard_num, **options).load()
    out = {f"tensor {n}": a.dtype.str.encode() + repr(a.shape).encode() + a.tobytes() for n, a in tensors.items()}
    for name, table in tables.items():
        ids, values, slots = table.export()
        order = np.argsort(ids, kind="stable")
        arrays = (ids, values, *(v for _, v in sorted(slots.items())))
        out[f"table {name}"] = b"".join(x[order].tobytes() for x in arrays)
    return out


def count_maps(monkeypatch) -> list[str]:
    """The names of the tensor files every sharded reader (either layout's) maps from now on, in order (each time
    one is mapped), through ``monkeypatch``: the files a rank opens."""
    import os

    import fastckpt.sharded.reader as reader_module

    names: list[str] = []
    real = reader_module.open_file

    def counting(path, **options):
        names.append(os.path.basename(path))
        return real(path, **options)

    monkeypatch.setattr(reader_module, "open_file", counting)
    return names


def damage_file(target: Path, damage: str, sized: bool = True) -> tuple[type, str]:
    """Damage tensor file ``target`` as ``damage`` says (``"truncated"`` to half, ``"header"``: a header length past
    its end, ``"removed"``); returns the error a reader raises when it uses the file and a regex of its message
    (``sized``: the commit record lists the file's size, so a truncated file is a changed one)."""
    from fastckpt.errors import CheckpointChangedError, FormatError

    bad = Path(target).name
    data = Path(target).read_bytes()
    if damage == "truncated":
        Path(target).write_bytes(data[: len(data) // 2])
        return (CheckpointChangedError, f"{bad}: {len(data) // 2} bytes, the commit record says {len(data)}") \
            if sized else (FormatError, bad)
    if damage == "header":
        Path(target).write_bytes((2**40).to_bytes(8, "little") + data[8:])
        return FormatError, bad
    Path(target).unlink()
    return FormatError, f"{bad}: missing"
