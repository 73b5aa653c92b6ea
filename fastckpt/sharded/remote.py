"""Sharded checkpoints at a URL (``s3://bucket/ckpt``, any fsspec URL): every rank uploads its files, rank 0
commits with the manifest, uploaded last.

``Saver(path=url).save()`` and ``Loader(url).load()`` come here. A save: rank 0 clears the prefix (a committed
checkpoint there loses its ``manifest.json`` first; ``overwrite=True`` is needed to replace one) and tells the
ranks to start; each rank writes its tensor files into a local temporary directory, as a local save does, and
uploads them (in parallel, :func:`fastckpt.formats.remote.put_directory`); the engine's gather is the barrier
after every upload; then rank 0 writes ``index.json``, ``tensorkey.json`` and the descriptions, uploads them,
and uploads ``manifest.json`` last: the commit. A failure on any rank leaves the prefix without a manifest:
uncommitted, refused by loaders, replaced by the next save. A load downloads the committed prefix into a
temporary directory (files and 16 MiB ranges in parallel) and loads from there.

Incremental (delta) saves need a local directory: a delta names its base by path.

>>> import numpy as np
>>> from fastckpt.sharded import HashTable, Loader, Saver
>>> t = HashTable(dim=1); t.insert(np.arange(4), np.arange(4, dtype=np.float32)[:, None])
>>> Saver(path="memory://doc/sharded", parallel=2, hashtables={"emb": t}, tensors={"w": np.eye(2)}).save()
'memory://doc/sharded'
>>> tables, tensors = Loader("memory://doc/sharded").load()
>>> tables["emb"].ids().tolist(), tensors["w"].tolist()
([0, 1, 2, 3], [[1.0, 0.0], [0.0, 1.0]])
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from fastckpt.formats import remote
from fastckpt.sharded.format import DESCRIPTION_FILE, INDEX_FILE, MANIFEST_FILE, TENSORKEY_FILE

__all__ = ["save", "load"]


def save(saver) -> str:
    """Run :meth:`fastckpt.sharded.Saver.save` for a URL (see the module docstring); returns the URL."""
    url, options = saver.path.rstrip("/"), saver.storage_options
    if saver.policy is not None:
        raise ValueError(f"{url}: incremental saves need a local directory (a delta names its base by path); "
                         "save full checkpoints to a URL (incremental=False)")
    engine = saver._engine()
    root = engine.rank == 0
    start: dict = {}
    if root:
        try:
            if not saver.overwrite and remote.committed(url, MANIFEST_FILE, options):
                raise FileExistsError(f"{url}: already exists; pass overwrite=True to replace it")
            remote.clear(url, MANIFEST_FILE, options)  # an old checkpoint, or a save that never committed
            start = {"ok": True}
        except Exception as exc:
            start = {"error": f"{type(exc).__name__}: {exc}"}
    start = engine.broadcast(start, root=0, timeout=saver.timeout)
    if "error" in start:
        raise RuntimeError(f"sharded save to {url}: rank 0 could not start it: {start['error']}")
    saver.kind = "full"
    tmp = Path(tempfile.mkdtemp(prefix="fastckpt-shard-"))
    try:
        staging = tmp / "staging"
        staging.mkdir()
        error = None
        try:
            report = saver._write_files(staging, saver._filtered())
            remote.put_directory(staging, url, MANIFEST_FILE, options, files=list(report["files"]), replace=False,
                                 commit=False)
        except Exception as exc:
            report, error = {"error": f"rank {saver.shard_index}: {type(exc).__name__}: {exc}"}, exc

        def commit(reports: list) -> str:  # every rank has uploaded: the metadata, the manifest last
            final = tmp / "final"
            digest = saver._commit(staging, final, reports, {"kind": "full"})
            remote.put_directory(final, url, MANIFEST_FILE, options, replace=False,
                                 files=[INDEX_FILE, TENSORKEY_FILE, DESCRIPTION_FILE, MANIFEST_FILE])
            return digest

        # an uncommitted prefix is left for the next save to remove
        status, commit_error = saver._commit_on_root(engine, report, commit)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    saver._settle(error, commit_error, status, report, url, url)
    return saver.path


def load(loader):
    """Run :meth:`fastckpt.sharded.Loader.load` for a URL, fetching only this rank's share (see :func:`fetch_share`).

    A delta or an encoded checkpoint (whose parts a rank cannot select by rows), and a directory in RecIS's layout
    (with or without fastckpt's manifest; without it, RecIS's ``index`` marks it complete), are downloaded whole
    first.
    """
    url = loader.checkpoint_path
    tmp = tempfile.mkdtemp(prefix="fastckpt-share-")
    try:
        whole = not fetch_share(loader, tmp)
        if whole:
            shutil.rmtree(tmp, ignore_errors=True)
            fs, path = remote.filesystem(url, loader.storage_options)
            # RecIS's own layout has no manifest: its 'index' is written last (rank 0's merge)
            marker = MANIFEST_FILE if fs.exists(f"{path.rstrip('/')}/{MANIFEST_FILE}") \
                or not fs.exists(f"{path.rstrip('/')}/index") else "index"
            with remote.local_copy(url, marker, loader.storage_options) as local:
                if marker == MANIFEST_FILE:
                    return _load_from(loader, local)
                return _load_recis(loader, local, url)
        return _load_from(loader, tmp)
    except Exception as e:
        if e.args and isinstance(e.args[0], str) and tmp in e.args[0]:
            e.args = (e.args[0].replace(tmp, url.rstrip("/")), *e.args[1:])
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_recis(loader, local: str, url: str):
    """A RecIS directory without a manifest, downloaded to ``local``: its warning names the URL (once per URL)."""
    import warnings

    from fastckpt.sharded import recis

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", recis.RecisWarning)
        result = _load_from(loader, local)
    for warning in caught:
        if issubclass(warning.category, recis.RecisWarning):
            recis._warned.discard(local)
            if url not in recis._warned:
                recis._warned.add(url)
                warnings.warn(str(warning.message).replace(local, url), recis.RecisWarning, stacklevel=4)
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return result


def _load_from(loader, local: str):
    url = loader.checkpoint_path
    loader.checkpoint_path = local
    try:
        return loader.load()
    finally:
        loader.checkpoint_path = url


_HEAD = 8 << 10  # the first bytes fetched of every tensor file: its safetensors header, mostly whole


def fetch_share(loader, local: str) -> dict | bool:
    """Fetch into ``local`` the bytes of the checkpoint at ``loader.checkpoint_path`` that ``loader``'s rank loads.

    The metadata files whole; of every tensor file its header, then each dense part this rank takes and every
    hashtable id part; then, for the ids this rank owns (``loader.owner``), only the byte ranges of their rows
    in the embedding and slot parts (runs of rows; ranges less than 64 KiB apart merged), in parallel ranged
    reads. The tensor files are sparse local files of their full size, so the Loader reads them as it reads any
    directory. Returns ``{"bytes": fetched, "requests": ranges}``, or False for a checkpoint that must be
    downloaded whole (a delta, an encoded table; or no manifest, which the whole-prefix path reports).
    """
    import json
    import os

    import numpy as np

    from fastckpt.sharded.format import parse_part_key, rows_of

    url, options = loader.checkpoint_path.rstrip("/"), loader.storage_options
    fs, path = remote.filesystem(url, options)
    path = path.rstrip("/")
    try:
        manifest_bytes = fs.cat_file(f"{path}/{MANIFEST_FILE}")
    except FileNotFoundError:
        return False  # the whole-prefix path says what is there instead
    manifest = json.loads(manifest_bytes)
    if manifest.get("format") != "fastckpt.sharded" or manifest.get("kind", "full") != "full" \
            or any("encoding" in t for t in manifest.get("hashtables", {}).values()):
        return False  # RecIS's layout, a delta, an encoded table
    with open(os.path.join(local, MANIFEST_FILE), "wb") as f:
        f.write(manifest_bytes)
    sizes = {name: entry["size"] for name, entry in manifest["files"].items()}
    for name, size in sizes.items():
        with open(os.path.join(local, name), "wb") as f:
            f.truncate(size)
    fetched = [len(manifest_bytes), 1]

    def fetch(spans: dict[str, list[tuple[int, int]]]) -> None:
        work = [(f"{path}/{name}", os.path.join(local, name), remote._merged(sorted(ranges)))
                for name, ranges in spans.items() if ranges]
        fetched[0] += sum(e - b for *_, ranges in work for b, e in ranges)
        fetched[1] += sum(len(ranges) for *_, ranges in work)
        remote._fetch_into(fs, url, work)

    metadata = [INDEX_FILE, TENSORKEY_FILE, DESCRIPTION_FILE]
    tensor_files = sorted(set(sizes) - set(metadata))
    fetch({**{name: [(0, sizes[name])] for name in metadata},
           **{name: [(0, min(_HEAD, sizes[name]))] for name in tensor_files}})
    offsets: dict[str, tuple[str, int, int]] = {}  # stored key -> (file, start, end)
    for name in tensor_files:
        file_path = os.path.join(local, name)
        with open(file_path, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else 0
        if 8 + length > _HEAD and 8 + length <= sizes[name]:
            fetch({name: [(_HEAD, 8 + length)]})
        with open(file_path, "rb") as f:
            f.seek(8)
            header = json.loads(f.read(length))
        for key, entry in header.items():
            if key != "__metadata__":
                begin, end = entry["data_offsets"]
                offsets[key] = (name, 8 + length + begin, 8 + length + end)
    with open(os.path.join(local, DESCRIPTION_FILE), "rb") as f:
        descriptions = json.loads(f.read())
    dense_wanted = set(loader.tensors) or set(manifest.get("tensors", {}))
    tables_wanted = set(loader.hashtables) or set(manifest.get("hashtables", {}))
    first: dict[str, list[tuple[int, int]]] = {}
    id_parts = []
    for key, desc in descriptions.items():
        where = offsets.get(key)
        if where is None:
            continue  # the Loader names what is missing
        name, begin, end = where
        if desc.get("dense") and desc.get("tensor") in dense_wanted:
            rows = desc["global_shape"][0] if desc.get("global_shape") else 0
            lo, hi = (0, rows) if loader.dense == "replicated" or not rows else \
                rows_of(loader.shard_index, loader.shard_num, rows)
            p_lo = desc.get("row_start", 0)
            p_hi = p_lo + (desc["shape"][0] if desc["shape"] else 1)
            if not desc["shape"] or (max(lo, p_lo) < min(hi, p_hi)):
                first.setdefault(name, []).append((begin, end))
        elif desc.get("role") == "id" and desc.get("table") in tables_wanted:
            first.setdefault(name, []).append((begin, end))
            id_parts.append(key)
    fetch(first)
    rows_plan: dict[str, list[tuple[int, int]]] = {}
    for key in id_parts:
        name, begin, end = offsets[key]
        ids = np.fromfile(os.path.join(local, name), np.int64, (end - begin) // 8, offset=begin)
        if not len(ids):
            continue
        mine = np.flatnonzero(np.asarray(loader.owner(ids, loader.shard_num)) == loader.shard_index)
        if not len(mine):
            continue
        table, i, n = descriptions[key]["table"], *parse_part_key(key)[1:]
        starts = np.flatnonzero(np.diff(mine, prepend=-2) != 1)  # runs of consecutive owned rows
        runs = [(int(mine[a]), int(mine[b - 1]) + 1) for a, b in zip(starts, [*starts[1:], len(mine)])]
        for other, desc in descriptions.items():
            if desc.get("table") == table and desc.get("role") in ("embedding", "slot") \
                    and parse_part_key(other)[1:] == (i, n) and other in offsets:
                o_name, o_begin, o_end = offsets[other]
                row = (o_end - o_begin) // len(ids)
                spans = [(o_begin + a * row, o_begin + b * row) for a, b in runs]
                rows_plan.setdefault(o_name, []).extend(spans)
    fetch(rows_plan)
    return {"bytes": fetched[0], "requests": fetched[1]}
