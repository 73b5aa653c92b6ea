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

import errno
import shutil
import tempfile
from pathlib import Path

from fastckpt.formats import remote
from fastckpt.sharded.engine import error_info as _error_info
from fastckpt.sharded.engine import raise_from_root as _raise_from_root
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
    start_error = None
    if root:
        try:
            if not saver.overwrite and remote.committed(url, MANIFEST_FILE, options):
                raise FileExistsError(errno.EEXIST, "already exists; pass overwrite=True to replace it", url)
            remote.clear(url, MANIFEST_FILE, options)  # an old checkpoint, or a save that never committed
            start = {"ok": True}
        except Exception as exc:
            start, start_error = _error_info(exc), exc
    start = engine.broadcast(start, root=0, timeout=saver.timeout)
    if "error" in start:
        if start_error is not None:
            raise start_error  # rank 0's own: FileExistsError stays FileExistsError
        _raise_from_root(start, f"sharded save to {url}: rank 0 could not start it")
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
    """Run :meth:`fastckpt.sharded.Loader.load` for a URL: download the committed prefix, load it from there."""
    url = loader.checkpoint_path
    with remote.local_copy(url, MANIFEST_FILE, loader.storage_options) as local:
        loader.checkpoint_path = local
        try:
            return loader.load()
        finally:
            loader.checkpoint_path = url
