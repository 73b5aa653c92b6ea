"""Rewrite a sharded checkpoint for another number of ranks (``fastckpt reshard SRC DST --shards M``), or a chain of
deltas as one full checkpoint (``fastckpt compact SRC DST``).

Loading already reshards (a :class:`~fastckpt.sharded.Loader` on M ranks reads
a checkpoint of N); this writes the M-rank layout to disk, so that later loads
read each part whole. Every new rank's share is loaded and saved in this
process, the M ranks running as threads.

>>> import numpy as np, tempfile, os
>>> from fastckpt.sharded import CheckpointReader, HashTable, Saver
>>> d = tempfile.mkdtemp(); t = HashTable(dim=1); t.insert(np.arange(5), np.zeros((5, 1), np.float32))
>>> _ = Saver(path=os.path.join(d, "a"), parallel=1, hashtables={"emb": t}).save()
>>> _ = reshard(os.path.join(d, "a"), os.path.join(d, "b"), shards=2, parallel=1)
>>> CheckpointReader(os.path.join(d, "b")).manifest["world_size"]
2
"""

from __future__ import annotations

import logging
import os
import threading
import time

from fastckpt.progress import progress_from, requested
from fastckpt.sharded.chain import resolve_chain
from fastckpt.sharded.engine import ThreadEngine
from fastckpt.sharded.format import SLICE_SIZE, SLICE_VERSION, read_metadata, slice_owner
from fastckpt.sharded.loader import Loader
from fastckpt.sharded.reader import CheckpointReader
from fastckpt.sharded.saver import Saver

_log = logging.getLogger(__name__)

__all__ = ["reshard", "compact"]


def reshard(src: str | os.PathLike, dst: str | os.PathLike, shards: int, *, parallel: int | None = None,
            overwrite: bool = False, timeout: float = 600.0, progress=False, layout: str | None = None,
            slice_size: int | None = None) -> str:
    """Write the checkpoint at ``src`` again at ``dst`` as saved by ``shards`` ranks; returns ``dst``.

    ``parallel`` (files per rank) defaults to the source's. Hashtable ids go
    to the rank of their key-space slice (format version 4's rule: RecIS's
    ``gen_slice`` over each table's slice size; a source of versions 1-4 is
    written as a save of its tables writes: version 4, or 5 where a table's
    rows have shapes of their own, or 6 where a name holds '/'); dense
    tensors are split by rows as a ``shards``-rank save splits them. The
    result holds exactly the source's values. ``progress`` (``True`` for a bar, or ``callback(done, total,
    item)``: :mod:`fastckpt.progress`) counts the bytes of tensors written to
    ``dst`` by every rank; it starts once every rank has loaded its share.
    ``layout`` (``"fastckpt"`` or ``"recis"``, default: the source's) converts
    between fastckpt's layout and RecIS's (:mod:`fastckpt.sharded.recis`). In
    either, ids go to the ranks by the slice rule, each table keeping its own
    slice size (a RecIS table's, or a version-4 table's partition; 65536 for
    versions 1-3; ``slice_size`` chooses another for a source in fastckpt's
    layout written in RecIS's). Every slot of every table is written, whatever
    its row shape and dtype, and embeddings keep their row shape (into
    fastckpt's layout as format version 5 where a table has such rows, as
    version 6 where a name holds '/', ``tower/dense/kernel``; version 4
    otherwise); a checkpoint the target layout cannot hold whole (a name it
    cannot store, a dtype RecIS does not read) is an error before anything is
    written.

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.sharded import HashTable, Saver
    >>> d = tempfile.mkdtemp(); t = HashTable(dim=1); t.insert(np.arange(3), np.zeros((3, 1), np.float32))
    >>> _ = Saver(path=os.path.join(d, "a"), parallel=1, hashtables={"emb": t}).save()
    >>> sorted(os.listdir(reshard(os.path.join(d, "a"), os.path.join(d, "r"), 2, layout="recis")))[:2]
    ['index', 'manifest.json']
    """
    started = time.perf_counter()
    if type(shards) is not int or shards < 1:
        raise ValueError(f"shards must be a positive int, got {shards!r}")
    with CheckpointReader(src) as reader:
        source_layout = "recis" if reader.layout == "RecIS" else "fastckpt"
        if parallel is None:
            parallel = reader.manifest["parallel"] if reader.manifest is not None else _recis_parallel(reader)
        partitioned = reader.manifest is not None and reader.manifest.get("format_version", 0) >= SLICE_VERSION
        # each table's own slice size (RecIS's, or a version-4 table's partition), kept in either layout
        sizes = {name: entry["slice_size"] if source_layout == "recis" else entry["partition"]["slice_size"]
                 for name, entry in reader.hashtables().items()} if source_layout == "recis" or partitioned else {}
    layout = source_layout if layout is None else layout
    if layout not in ("fastckpt", "recis"):
        raise ValueError(f"layout must be 'fastckpt' or 'recis', got {layout!r}")
    if slice_size is not None and (layout != "recis" or source_layout == "recis"):
        raise ValueError("slice_size is for a reshard from fastckpt's layout into RecIS's (a RecIS source keeps "
                         "its tables' own)")
    # Each new rank holds the ids of its slices, each table by its own slice size where it has one: a version-4
    # source's Loader applies that rule itself; a RecIS source is read whole, each id going to the rank of its slice
    # (recis.owners); a source of versions 1-3 is placed by slices of 65536.
    owner, keep = {}, {"slice_size": sizes}
    if source_layout == "recis":
        from fastckpt.sharded import recis

        owner = {"owner": recis.slice_owner}
    elif slice_size is not None or not partitioned:
        size = SLICE_SIZE if slice_size is None else slice_size
        owner, keep = {"owner": lambda ids, m: slice_owner(ids, m, size)}, {"slice_size": size}
    engines = ThreadEngine.group(shards)
    errors: list = [None] * shards
    # With progress: every rank tells what it will write, then one report over all of it is made.
    loaded = threading.Barrier(shards) if requested(progress) else None
    sizes = [0] * shards
    report: list = []

    def run(rank: int) -> None:
        try:
            tables, tensors = Loader(os.fspath(src), shard_index=rank, shard_num=shards, **owner).load()
            saver = Saver(shard_index=rank, shard_num=shards, parallel=parallel, path=os.fspath(dst),
                          hashtables=tables, tensors=tensors, engine=engines[rank], timeout=timeout,
                          overwrite=overwrite, layout=layout, **keep)
            if loaded is not None:
                sizes[rank] = sum(block.nbytes for block in saver.blocks())
                if loaded.wait(timeout) == 0:
                    report.append(progress_from(progress, sum(sizes), f"reshard to {shards}"))
                loaded.wait(timeout)
                saver.progress = report[0]
            saver.save()
        except BaseException as exc:  # noqa: BLE001 - reported below, the first one raised
            errors[rank] = exc
            if loaded is not None:
                loaded.abort()  # the other ranks stop waiting for this one

    threads = [threading.Thread(target=run, args=(r,), name=f"fastckpt-reshard-{r}") for r in range(shards)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for bar in report:
        bar.close()
    # A rank that failed made the others' waits fail: raise its error, not theirs.
    for exc in sorted((e for e in errors if e is not None), key=lambda e: isinstance(e, threading.BrokenBarrierError)):
        raise exc
    _log.info("resharded %s into %s: %d shards, %d files per rank, in %.3f s", os.fspath(src), os.fspath(dst), shards,
              parallel, time.perf_counter() - started)
    return os.fspath(dst)


def compact(src: str | os.PathLike, dst: str | os.PathLike, *, shards: int | None = None,
            parallel: int | None = None, overwrite: bool = False, timeout: float = 600.0, progress=False) -> str:
    """Write the state at ``src`` (a full checkpoint or the head of a chain) as one full checkpoint at ``dst``.

    ``shards`` and ``parallel`` default to the head's. Returns ``dst``. The result holds exactly the chain's state
    (tables, slots and dense tensors); it needs no other checkpoint. ``progress`` is :func:`reshard`'s.

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.sharded import Saver
    >>> d = tempfile.mkdtemp()
    >>> _ = Saver(path=os.path.join(d, "a"), parallel=1, tensors={"w": np.arange(4.0)}).save()
    >>> CheckpointReader(compact(os.path.join(d, "a"), os.path.join(d, "b"), shards=2)).read_tensor("w").tolist()
    [0.0, 1.0, 2.0, 3.0]
    """
    head = read_metadata(src)["manifest"]
    resolve_chain(src)  # a broken chain is named before anything is written
    return reshard(src, dst, head["world_size"] if shards is None else shards,
                   parallel=head["parallel"] if parallel is None else parallel, overwrite=overwrite, timeout=timeout,
                   progress=progress)


def _recis_parallel(reader) -> int:
    """The writers per rank of a RecIS directory without a manifest: its files' total over its rank count."""
    import re

    totals = {int(m.group(1)) for name in reader.files
              if (m := re.fullmatch(r"model-[0-9]+-of-([0-9]+)\.safetensors", name))}
    ranks = {int(m.group(1)) for key in reader.part_infos if (m := re.search(r"/part_[0-9]+_([0-9]+)\Z", key))}
    return max(1, (totals.pop() if len(totals) == 1 else 1) // (ranks.pop() if len(ranks) == 1 else 1))
