"""``Loader``: this rank's share of a sharded checkpoint, on any number of ranks (resharding N -> M).

A checkpoint saved by N ranks loads on M ranks exactly, for any N, M >= 1:

* hashtables: every id goes to the rank its *owner rule* names, its
  embedding row and slot rows with it. The default is the checkpoint's own
  rule: for format versions 4 and 5 RecIS's slice rule (rank ``j`` of ``M`` owns the
  ids whose ``uint64(id) % slice_size`` lies in ``slice_of(j, M)``; the table
  parts are stored in slice order with their groups' row offsets recorded, so
  a rank reads only the ids and rows of its slices, whatever ``N`` and
  ``M``); for versions 1-3 ``id mod M`` (non-negative for negative ids too).
  ``owner(ids, M) -> ranks`` names another rule: each rank then reads every
  id part and the rows it owns.
* dense tensors: ``dense="replicated"`` (default, as in data parallel
  training) gives every rank the whole tensor; ``dense="rows"`` gives rank
  ``j`` rows ``[j*R//M, (j+1)*R//M)``. Either way only the parts overlapping
  those rows are read.

``filter_func`` receives the load information (a dict ``{"tensors": {name:
{"dtype", "shape", "rows"}}, "hashtables": {name: {"dim", "dtype", "slots",
"ids", ...}}}``, each table's manifest entry, for everything this Loader would
load) and returns it with the entries to skip removed.

A table the Loader makes has the checkpoint's rows: in format version 5 the
embedding's row shape and each slot's own row shape and dtype (a step
filter's int64 ``[1]``), every slot of the checkpoint.

>>> import numpy as np, tempfile, os
>>> from fastckpt.sharded import HashTable, Saver
>>> out = os.path.join(tempfile.mkdtemp(), "c")
>>> t = HashTable(dim=1); t.insert(np.arange(6), np.arange(6, dtype=np.float32)[:, None])
>>> _ = Saver(path=out, parallel=1, hashtables={"emb": t}).save()
>>> mine = {"emb": HashTable(dim=1)}
>>> _ = Loader(out, hashtables=mine, shard_index=1, shard_num=2).load()
>>> mine["emb"].ids().tolist()                    # rank 1 of 2 owns slice positions [32768, 65536)
[]
>>> mine = {"emb": HashTable(dim=1)}
>>> _ = Loader(out, hashtables=mine, shard_index=1, shard_num=2, owner=owner_mod).load()
>>> mine["emb"].ids().tolist()                    # id mod 2, as versions 1-3 load by default
[1, 3, 5]
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import logging
import os
import time
from typing import Any, Callable

import numpy as np

from fastckpt.errors import ChecksumMismatchError, FormatError
from fastckpt.formats.remote import is_url
from fastckpt.progress import progress_from
from fastckpt.formats.reader import guard_mappings, held_guards
from fastckpt.sharded.chain import resolve_chain
from fastckpt.sharded.format import (SliceRowError, group_rows, group_span, owner_mod, part_rows, rows_of, slice_of,
                                     slice_owner, slice_run)
from fastckpt.errors import CheckpointChangedError
from fastckpt.sharded import kept
from fastckpt.sharded.hashtable import HashTable, check_holds, table_for
from fastckpt.sharded.reader import CheckpointReader, shared_reader
from fastckpt.sharded.workers import Lane

__all__ = ["Loader", "owner_mod"]

_log = logging.getLogger(__name__)


def _read_part(reader: CheckpointReader, key: str, out: np.ndarray) -> None:
    """Stored part ``key`` into ``out`` (C-contiguous, its dtype and shape) with ``preadv``, from the file the
    reader opened.

    A load that takes a part whole reads it this way rather than copying from the mapping: the kernel copies
    from the page cache without mapping every page into the process first (several times faster here).
    """
    f = reader.file_of(key)
    info = f.infos[key]
    if info.dtype != out.dtype or info.shape != out.shape or info.nbytes != out.nbytes:
        np.copyto(out, reader.host(key))  # not the plain bytes of out (another byte order, say): convert
        return
    _pread(reader, key, memoryview(out.reshape(-1).view(np.uint8)), 0)


def _pread(reader: CheckpointReader, key: str, view: memoryview, start: int) -> None:
    """Fill ``view`` with the bytes of stored part ``key`` from byte ``start`` of the part on (the reader's
    pinned commit, through its bounded descriptor cache)."""
    reader.read_into(key, view, start)


_IN_PLACE = object()  # a pick whose ids the table's own array holds already (Loader._read_spans)
_GATHER_CHUNK = 8 << 20  # bytes of a part read at once to pick some of its rows from


def _copy_whole(reader: CheckpointReader, key: str, out: np.ndarray) -> None:
    """Stored part ``key`` whole into ``out``: its bytes read into place, or decoded where it is encoded."""
    if "encoding" in reader.descriptions[key]:
        out[...] = reader.array(key)
    else:
        _read_part(reader, key, out)


def _copy_rows(reader: CheckpointReader, key: str, rows: np.ndarray, out: np.ndarray) -> None:
    """Rows ``rows`` (ascending) of stored part ``key`` into ``out``: the part read a chunk at a time with
    ``preadv`` into one buffer and the rows picked from it (a mapping would be faulted in page by page, every
    page, since the rows of a rank are spread over the whole part), or gathered from the decoded part."""
    info = reader.infos[key]
    if "encoding" in reader.descriptions[key] or info.dtype != out.dtype or len(info.shape) < 2 \
            or out.shape[1:] != info.shape[1:]:
        np.take(reader.array(key), rows, axis=0, out=out)
        return
    row_bytes = int(np.prod(info.shape[1:], dtype=np.int64)) * info.dtype.itemsize  # rows of any shape
    if len(rows) and int(rows[-1]) - int(rows[0]) + 1 == len(rows) and out.flags.c_contiguous:
        _copy_run(reader, key, int(rows[0]), out)
        return
    per_chunk = max(1, _GATHER_CHUNK // max(1, row_bytes))
    scratch = kept.empty((min(per_chunk, info.shape[0]), *info.shape[1:]), info.dtype)
    done = 0
    for first in range(0, info.shape[0], per_chunk):
        last = min(first + per_chunk, info.shape[0])
        stop = done + int(np.searchsorted(rows[done:], last))
        if stop == done:
            continue
        chunk = scratch[: last - first]
        _pread(reader, key, memoryview(chunk.reshape(-1).view(np.uint8)), first * row_bytes)
        np.take(chunk, rows[done:stop] - first, axis=0, out=out[done:stop])
        done = stop


def _copy_run(reader: CheckpointReader, key: str, first: int, out: np.ndarray) -> None:
    """Rows ``first`` to ``first + len(out)`` of stored part ``key`` into ``out`` (a rank's slices of a version-4
    part): exactly those bytes, read into place where ``out`` holds them as stored, else taken from the part."""
    info = reader.infos[key]
    if "encoding" in reader.descriptions[key] or info.dtype != out.dtype or len(info.shape) < 1 \
            or out.shape[1:] != info.shape[1:] or not out.flags.c_contiguous:
        out[...] = reader.array(key)[first:first + len(out)]
        return
    row_bytes = info.nbytes // max(1, info.shape[0])
    _pread(reader, key, memoryview(out.reshape(-1).view(np.uint8)), first * row_bytes)


def _checked_run(reader: CheckpointReader, key: str, ids: np.ndarray, first_row: int, rows: list[int], size: int,
                 own: tuple[int, int]) -> tuple[int, int]:
    """:func:`~fastckpt.sharded.format.slice_run` of id part ``key``'s rows ``first_row`` on (``ids``); an id out of
    place is a :class:`~fastckpt.errors.FormatError` naming the file, the tensor, the row and its byte offset."""
    try:
        return slice_run(ids, first_row, rows, size, own)
    except SliceRowError as exc:
        f = reader.file_of(key)
        raise FormatError(f"{f.path}: tensor {key!r}, row {exc.row} (byte {f.infos[key].offset + 8 * exc.row} of "
                          f"the file): {exc}: the slice offsets or the ids are damaged or forged (`fastckpt verify` "
                          "names a damaged file; this checkpoint cannot be loaded by slices)") from None


def _slice_rows(reader: CheckpointReader, key: str, rows: list[int], size: int,
                own: tuple[int, int]) -> tuple[np.ndarray, np.ndarray] | None:
    """The rows of version-4 id part ``key`` whose slice positions lie in ``own`` (``[begin, end)``): ``(ids,
    positions)`` as :meth:`Loader._owned` gives them (one run of rows), or None where it holds none.

    Only the ids of the slice groups that meet ``own`` are read (``rows``: the part's recorded group offsets).
    An id that is not where the offsets place it (:func:`~fastckpt.sharded.format.slice_run`) is a
    :class:`~fastckpt.errors.FormatError` naming the file, the tensor, the row and its byte offset, raised before
    anything is placed.
    """
    first, last = group_span(rows, size, *own)
    r0, r1 = rows[first], rows[last]
    if r0 == r1:
        return None
    ids = kept.empty(reader.part_infos[key].shape[0], np.int64)  # only rows [r0, r1) are read or used
    reader.read_into(key, ids[r0:r1].view(np.uint8), r0 * 8)
    lo, hi = _checked_run(reader, key, ids[r0:r1], r0, rows, size, own)
    return (ids, np.arange(lo, hi)) if lo < hi else None


def _stored_nbytes(readers: list[CheckpointReader], tensor: str) -> int:
    """The bytes ``tensor``'s parts take in the files of ``readers`` (0 where one has no such tensor)."""
    total = 0
    for reader in readers:
        if not reader.has_tensor(tensor):
            continue
        total += sum(reader.part_nbytes(key) for key in reader.part_names(tensor))  # no file opened for it
    return total


def _share_nbytes(job: tuple, info: dict) -> int:
    """About the bytes load job ``job`` (``(name, stored bytes, ...)``) reads: a dense tensor's rows this rank
    takes of the whole (``dense="rows"``), else the stored bytes."""
    entry = info.get("tensors", {}).get(job[0])
    if entry is None or not entry["shape"]:
        return job[1]
    start, end = entry["rows"]
    return job[1] * (end - start) // max(1, entry["shape"][0])


def _reader_for(path: str, manifest: dict):
    """An unverifying reader of the checkpoint at ``path`` as of ``manifest``: the one another load of this process
    holds open now, where there is one of that commit (ranks run as threads, a reshard's, open the files and parse
    their headers once between them), else a new one (:func:`~fastckpt.sharded.reader.shared_reader`)."""
    return shared_reader(os.path.realpath(path), lambda: CheckpointReader(path, verify=False),
                         lambda reader: reader.manifest == manifest)


def _check_one_commit(readers: list[CheckpointReader], chain: list[tuple[str, dict]]) -> None:
    """The readers opened the manifests the chain was resolved on, and each delta's base is the reader before it."""
    for i, (reader, (path, manifest)) in enumerate(zip(readers, chain)):
        if reader.manifest != manifest:
            raise CheckpointChangedError(f"{path}: its manifest.json changed between resolving the chain and opening "
                                         "it (replaced by another save meanwhile): load again")
        if i and reader.manifest["base"]["manifest_blake3"] != readers[i - 1].manifest_blake3:
            raise CheckpointChangedError(f"{path}: its base {readers[i - 1].path} was replaced while the chain was "
                                         "opened (its manifest.json is not the one the delta was saved on): load "
                                         "again")


class Loader:
    """Load this rank's share of a sharded checkpoint into ``hashtables`` and ``tensors`` (see the module docs).

    ``hashtables`` maps names to :class:`HashTable` objects to fill (their
    contents are replaced; dim and dtype must match the checkpoint, their
    slots must be among the checkpoint's); empty or None: every table of the
    checkpoint is loaded into a new ``HashTable`` added to the dict.
    ``tensors`` maps names to arrays: an array of the right shape and dtype is
    filled in place, anything else is replaced; empty or None: every dense
    tensor is loaded. ``shard_index`` / ``shard_num`` say which rank of how
    many this is (default: 0 of 1, the whole checkpoint). ``progress``
    (``True`` for a bar, or ``callback(done, total, item)``:
    :mod:`fastckpt.progress`) counts the stored bytes of each tensor and table
    loaded (over the whole chain, whichever rows this rank keeps), each counted
    when it is filled. ``verify=True`` (the default) checks every tensor file
    the load reads, of every checkpoint of the chain, against its manifest's
    BLAKE3 hash while the load reads it (:meth:`load`); ``verify=False`` skips
    that (the metadata files, sizes and cross-checks are checked either way).
    """

    def __init__(self, checkpoint_path: str, hashtables: dict | None = None, tensors: dict | None = None,
                 parallel: int = 16, filter_func: Callable[[dict], dict] = lambda info: info, *,
                 shard_index: int = 0, shard_num: int = 1,
                 owner: Callable[[np.ndarray, int], np.ndarray] | None = None, dense: str = "replicated",
                 allow_lossy: bool = False, progress=False, storage_options: dict | None = None,
                 verify: bool = True):
        if type(shard_num) is not int or shard_num < 1 or type(shard_index) is not int \
                or not 0 <= shard_index < shard_num:
            raise ValueError(f"shard_index {shard_index!r} of shard_num {shard_num!r}: need 0 <= index < num")
        if dense not in ("replicated", "rows"):
            raise ValueError(f"dense must be 'replicated' or 'rows', got {dense!r}")
        if type(parallel) is not int or parallel < 1:
            raise ValueError(f"parallel must be a positive int, got {parallel!r}")
        self.checkpoint_path = os.fspath(checkpoint_path)
        self.storage_options = storage_options  # for a URL (s3://...): fastckpt.sharded.remote
        self.hashtables = hashtables if hashtables is not None else {}
        self.tensors = tensors if tensors is not None else {}
        self.parallel, self.filter_func = parallel, filter_func
        self.shard_index, self.shard_num, self.owner, self.dense = shard_index, shard_num, owner, dense
        self.allow_lossy = allow_lossy
        self.verify = bool(verify)
        self.progress = progress
        self.error_bounds: dict[str, float] = {}  # table -> largest absolute error of a lossy load

    def _check_lossy(self, chain: list[tuple[str, dict]]) -> None:
        """Quantized links restore approximate values: only with ``allow_lossy=True``, their bounds recorded."""
        bounds: dict[str, float] = {}
        for path, manifest in chain:
            for name, entry in manifest.get("hashtables", {}).items():
                encoding = entry.get("encoding") or {}
                if encoding.get("quantize"):
                    bounds[name] = max(bounds.get(name, 0.0), float(encoding.get("max_abs_error", float("inf"))))
                    if not self.allow_lossy:
                        raise FormatError(
                            f"{path}: hashtable {name!r} is quantized ({encoding['quantize']}, values off by up "
                            f"to {encoding.get('max_abs_error')}): a checkpoint for serving, not for resuming "
                            "training; pass allow_lossy=True to load it anyway")
        self.error_bounds = bounds
        if bounds:
            _log.info("%s: lossy load, largest absolute error per table: %s", self.checkpoint_path, bounds)

    def load_info(self, reader: CheckpointReader) -> dict[str, Any]:
        """What :meth:`load` would load from ``reader``, before ``filter_func``."""
        tables = reader.hashtables()
        wanted_tables = list(self.hashtables) or list(tables)
        dense = reader.manifest.get("tensors", {})
        wanted_dense = list(self.tensors) or list(dense)
        for name in wanted_tables:
            if name not in tables:
                raise KeyError(self._unknown(reader, "hashtable", name, tables))
        for name in wanted_dense:
            if name not in dense:
                raise KeyError(self._unknown(reader, "dense tensor", name, dense))
        info: dict[str, Any] = {"tensors": {}, "hashtables": {}}
        for name in wanted_dense:
            shape = list(dense[name]["shape"])
            if not shape:
                rows = (0, 0)  # a 0-d tensor: every rank gets it whole
            elif self.dense == "replicated":
                rows = (0, shape[0])
            else:
                rows = rows_of(self.shard_index, self.shard_num, shape[0])
            info["tensors"][name] = {"dtype": dense[name]["dtype"], "shape": shape, "rows": list(rows)}
        for name in wanted_tables:
            info["hashtables"][name] = dict(tables[name])
        return info

    @staticmethod
    def _unknown(reader, what: str, name: str, known) -> str:
        close = difflib.get_close_matches(name, list(known), n=3)
        return (f"{reader.path}: the checkpoint has no {what} {name!r}" + (f"; close matches: {close}" if close else
                                                                            f"; it has {sorted(known)[:8]}"))

    def load(self) -> tuple[dict, dict]:
        """Read and fill; returns ``(hashtables, tensors)``, the dicts given (or made).

        The head of a chain of deltas loads as its full base with every delta applied in order (see
        :mod:`fastckpt.sharded.chain`); a broken link raises :class:`~fastckpt.sharded.chain.BrokenChainError`
        before anything is filled. Unless ``verify=False``, every tensor file read is hashed against its
        manifest entry while the rows are read; a mismatch raises
        :class:`~fastckpt.errors.ChecksumMismatchError` naming the checkpoint, the file and its parts. The
        tables and arrays given change only once the load and its checks succeeded: a failed load leaves them
        as they were. Each table loaded is marked clean against this checkpoint, so that an
        incremental save after it stores only what changes from here. A URL
        (``s3://...``) is downloaded first (:func:`fastckpt.sharded.remote.load`).
        """
        if is_url(self.checkpoint_path):  # object storage and remote filesystems
            from fastckpt.sharded import remote

            return remote.load(self)
        from fastckpt.sharded import recis

        if recis.is_recis_directory(self.checkpoint_path):  # RecIS's own layout: its slice rule
            return recis.load(self)
        started = time.perf_counter()
        chain = resolve_chain(self.checkpoint_path, opening=True)  # the head's files: read by its reader below
        self._check_lossy(chain)
        results: dict[str, Any] = {}
        with contextlib.ExitStack() as stack:
            readers = [stack.enter_context(_reader_for(path, manifest)) for path, manifest in chain]
            head = readers[-1]
            info = self.filter_func(self.load_info(head))
            # The files this rank reads, and no others, opened (each checked against the metadata, else its error
            # here, before anything is read) and guarded: a file truncated under the copies is a FormatError
            # naming it, never SIGBUS. Once they are open, a save replacing the directories no longer reaches
            # this load; the readers must still be of the commits the chain was resolved on.
            reads = self._files_read(readers, info)
            stack.enter_context(guard_mappings((reader.files[name].mapped for reader, name in reads),
                                               "its parts to load them"))
            _check_one_commit(readers, chain)
            jobs = [(name, _stored_nbytes([head], name), self._load_dense, head, name, entry)
                    for name, entry in info.get("tensors", {}).items()]
            for name, entry in info.get("hashtables", {}).items():
                given = self.hashtables.get(name)
                parts = ["id", "embedding", "deleted", *getattr(given, "slots", entry["slots"])]
                jobs.append((name, sum(_stored_nbytes(readers, f"{name}.{part}") for part in parts),
                             self._load_table, readers, name, entry))
            nbytes = sum(job[1] for job in jobs)
            report = stack.enter_context(progress_from(self.progress, nbytes, f"load rank {self.shard_index}"))
            # The files are hashed in the background, one at a time on every core (BLAKE3), while the jobs read.
            hashing = stack.enter_context(Lane("verify", 1))
            checks = [(reader, hashing.submit(reader.file_problem, name))
                      for reader, name in (reads if self.verify else ())]

            def run(item: str, stored: int, fill, *args) -> None:
                results[item] = fill(*args)
                report.advance(stored, item)

            error = None
            scope = held_guards()  # the jobs' threads copy under the guards above too
            # Largest first: a table (its rows read by threads of its own while it builds its index) is most of a
            # rank's bytes, and waited behind the dense tensors where they came first and filled the pool.
            order = sorted(jobs, key=lambda job: -job[1])
            # This thread runs the largest job itself (all of them where parallel is 1), the others go to threads
            # kept between loads (fastckpt.sharded.workers), at most `parallel` jobs at once in all: one hand-over
            # to another thread fewer per load, and this thread works rather than waits.
            here = order[:1] if self.parallel > 1 else order
            with Lane("load", max(1, self.parallel - 1)) as pool:
                # a few MiB a job (a rank's share of each dense tensor) go to threads together: fewer hand-offs
                rest = order[len(here):]
                futures = pool.submit_bundled([(scope.run, (run, *job)) for job in rest],
                                              [_share_nbytes(job, info) for job in rest])
                for finish in [functools.partial(run, *job) for job in here] + [f.result for f in futures]:
                    try:
                        finish()
                    except Exception as exc:  # noqa: BLE001 - a damaged file's own error comes first, below
                        error = error or exc
            problems = [(reader, p) for reader, p in ((r, c.result()) for r, c in checks) if p]
            if problems:
                reader, first = problems[0]
                raise ChecksumMismatchError(f"{reader.path}: {first}" + (f" (and {len(problems) - 1} more files)"
                                                                         if len(problems) > 1 else ""))
            if error is not None:
                raise error
        # Every check passed: only now do the caller's arrays and tables change.
        for name in info.get("tensors", {}):
            out, target = results[name], self.tensors.get(name)
            if isinstance(target, np.ndarray) and target.shape == out.shape and target.dtype == out.dtype \
                    and target.flags.writeable:
                target[...] = out
            else:
                self.tensors[name] = out
        token = (chain[-1][0], readers[-1].manifest_blake3)
        for name in info.get("hashtables", {}):
            table, given = results[name], self.hashtables.get(name)
            if given is None:
                self.hashtables[name] = table
            else:
                given._take_contents(table)
            self.hashtables[name].mark_clean(token)
        _log.info("loaded %s (rank %d of %d, %d checkpoints in the chain): %d tensors, %d hashtables, %d stored "
                  "bytes in %.3f s%s", self.checkpoint_path, self.shard_index, self.shard_num, len(chain),
                  len(info.get("tensors", {})), len(info.get("hashtables", {})), nbytes, time.perf_counter() - started,
                  "" if self.verify else ", hashes not checked")
        return self.hashtables, self.tensors

    def _files_read(self, readers: list[CheckpointReader], info: dict) -> list[tuple[CheckpointReader, str]]:
        """``[(reader, tensor file)]``: every file of the chain holding a part this load reads, in reading order."""
        keys: list[tuple[CheckpointReader, str]] = []
        head = readers[-1]
        for name, entry in info.get("tensors", {}).items():
            start, end = entry["rows"]
            for key in head.part_names(name):
                d = head.descriptions[key]
                if part_rows(d["row_start"], d["shape"], start, end) is not None:
                    keys.append((head, key))
        for name, entry in info.get("hashtables", {}).items():
            given = self.hashtables.get(name)
            for reader in readers:
                for part in ("id", "embedding", "deleted", *getattr(given, "slots", entry["slots"])):
                    if reader.has_tensor(f"{name}.{part}"):
                        keys += [(reader, key) for key in reader.part_names(f"{name}.{part}")
                                 if self._reads_part(reader, name, key)]
        out: dict[tuple[int, str], tuple[CheckpointReader, str]] = {}
        for reader, key in keys:
            name = reader.file_name(key)
            out.setdefault((id(reader), name), (reader, name))
        return list(out.values())

    def _load_dense(self, reader: CheckpointReader, name: str, entry: dict) -> None:
        start, end = entry["rows"]
        shape = tuple(entry["shape"])
        dtype = reader.tensor_dtype(name)
        if not shape:
            out = np.array(reader.host(reader.part_names(name)[0]))
        else:
            out = kept.empty((end - start, *shape[1:]), dtype)
            for key in reader.part_names(name):
                d = reader.descriptions[key]
                held = part_rows(d["row_start"], d["shape"], start, end)
                if held is None:
                    continue
                a, b = held
                target = out[d["row_start"] + a - start:d["row_start"] + b - start]
                if held == (0, d["shape"][0]):  # the whole part: read into place
                    _read_part(reader, key, target)
                else:  # some of its rows: those bytes, read into place
                    info = reader.infos[key]
                    if info.dtype == target.dtype and target.flags.c_contiguous:
                        _pread(reader, key, memoryview(target.reshape(-1).view(np.uint8)), a * target[0].nbytes)
                    else:
                        target[...] = reader.host(key)[a:b]
        return out

    def owner_rule(self, entry: dict) -> Callable[[np.ndarray, int], np.ndarray]:
        """The owner rule this load applies to a table of manifest entry ``entry``: the ``owner`` given, else the
        checkpoint's own: for format versions 4 and 5 (``entry["partition"]``) RecIS's slice rule over the table's
        slice size (:func:`~fastckpt.sharded.format.slice_of`), for versions 1-3 ``id mod shard_num``.

        >>> Loader("c").owner_rule({"partition": {"rule": "slice", "slice_size": 10}})(np.array([3, 4, 9]), 3).tolist()
        [0, 1, 2]
        """
        if self.owner is not None:
            return self.owner
        partition = entry.get("partition")
        if partition is None:
            return owner_mod
        return lambda ids, m: slice_owner(ids, m, partition["slice_size"])

    def _reads_part(self, reader: CheckpointReader, table: str, key: str) -> bool:
        """Whether this load reads any byte of table part ``key``: always, but where the slice rule of format
        version 4 applies, only a part whose slice groups that meet this rank's slice hold rows (the others are
        never read, so their files need no hash)."""
        entry = reader.hashtables()[table]
        i, n = reader.descriptions[key]["part"]
        slices = reader.descriptions.get(f"{table}.id/part_{i}_{n}", {}).get("slices")
        if self.owner is not None or "partition" not in entry or slices is None or self.shard_num == 1:
            return True
        first, last = group_rows(slices["rows"], entry["partition"]["slice_size"], self.shard_index, self.shard_num)
        return first < last

    def _owned(self, reader: CheckpointReader, tensor: str) -> list[tuple[np.ndarray, str, np.ndarray]]:
        """``[(ids, part suffix, positions this rank owns)]`` for each non-empty part of ``tensor`` (int64 ids).

        ``ids[positions]`` are the ids owned. Where the checkpoint's slice rule applies to a version-4 part, the
        rank reads only the ids of the slice groups that meet its slice, and owns one run of rows: ``ids`` is then
        an array of the part's length of which only those groups' rows are read (the pages of the rest are never
        touched).
        """
        entry = reader.hashtables()[tensor.rsplit(".", 1)[0]]
        rule = self.owner_rule(entry)
        ranged = self.owner is None and "partition" in entry
        out = []
        for key in reader.part_names(tensor):
            slices = reader.descriptions[key].get("slices")
            if ranged and slices is not None and self.shard_num > 1:
                picked = _slice_rows(reader, key, slices["rows"], entry["partition"]["slice_size"],
                                     slice_of(self.shard_index, self.shard_num, entry["partition"]["slice_size"]))
                if picked is not None:
                    out.append((picked[0], key[len(tensor):], picked[1]))
                continue
            ids = reader.array(key)
            if len(ids) == 0:
                continue
            if self.shard_num == 1 and (self.owner is None or self.owner is owner_mod):  # one rank owns every id
                out.append((ids, key[len(tensor):], np.arange(len(ids))))
                continue
            ranks = np.asarray(rule(ids, self.shard_num))
            if ranks.shape != ids.shape:
                raise ValueError(f"the owner rule returned shape {ranks.shape} for {ids.shape} ids")
            mine = np.flatnonzero(ranks == self.shard_index)
            if len(mine):
                out.append((ids, key[len(tensor):], mine))
        return out

    def _load_table(self, readers: list[CheckpointReader], name: str, entry: dict) -> HashTable:
        """The table as of the chain's head (a new table): its full base, then every delta in order."""
        written = sum(r.hashtables().get(name, {}).get("written", 0) for r in readers[1:])
        table = self._load_full_table(readers[0], name, entry, headroom=written)
        for reader in readers[1:]:
            self._apply_delta(reader, name, table)
        return table

    def _apply_delta(self, reader: CheckpointReader, name: str, table: HashTable) -> None:
        """Remove the ids the delta deleted, then upsert the rows it wrote (those this rank owns)."""
        if name not in reader.hashtables():
            raise FormatError(f"{reader.path}: this delta of the chain holds no hashtable {name!r}, which its head "
                              f"{self.checkpoint_path} does; the chain is inconsistent")
        for ids, _, mine in self._owned(reader, f"{name}.deleted"):
            table.delete(ids[mine])
        for ids, suffix, mine in self._owned(reader, f"{name}.id"):
            if len(mine) == len(ids):  # the whole part: the table copies the rows from the mapped views
                pick = lambda part: reader.array(f"{name}.{part}{suffix}")  # noqa: E731
            else:
                pick = lambda part: np.take(reader.array(f"{name}.{part}{suffix}"), mine, axis=0)  # noqa: E731
            table.insert(ids[mine] if len(mine) < len(ids) else ids, pick("embedding"),
                         {slot: pick(slot) for slot in table.slots})

    def _slice_spans(self, reader: CheckpointReader, entry: dict, id_keys: list[str]) -> list | None:
        """``[(id part, first row, end row)]``: the rows of each id part in the slice groups that meet this rank's
        slice (parts with none left out), where the slice rule (format version 4 on) decides what this load reads;
        None where it does not (one rank, an ``owner`` given, an older version)."""
        partition = entry.get("partition")
        if self.owner is not None or partition is None or self.shard_num == 1:
            return None
        slices = [reader.descriptions[key].get("slices") for key in id_keys]
        if any(s is None for s in slices):
            return None
        size = partition["slice_size"]
        own = slice_of(self.shard_index, self.shard_num, size)
        spans = []
        for key, s in zip(id_keys, slices):
            first, last = group_span(s["rows"], size, *own)
            if s["rows"][first] < s["rows"][last]:
                spans.append((key, s["rows"][first], s["rows"][last]))
        return spans

    def _read_spans(self, reader: CheckpointReader, name: str, entry: dict, spans: list,
                    ids_out: np.ndarray) -> tuple[list[tuple], list[tuple]]:
        """The ids of ``spans`` (:meth:`_slice_spans`) read into ``ids_out`` one after another and checked to lie
        where the part's slice offsets place them (a :class:`~fastckpt.errors.FormatError` naming the row where
        one does not), those outside this rank's slice dropped: ``([(_IN_PLACE, part suffix, rows owned)],
        [(id part, run)])``.

        A span whose slice groups all lie inside this rank's slice (1 -> 4, 2 -> 4 ...) is all the rank's if its
        ids are where the offsets place them: its check is left to the id index's build, which reads the ids anyway
        (``runs``: :meth:`IdIndex.fill <fastckpt._native.idindex.IdIndex.fill>`'s, for ``HashTable.adopt``; one out
        of place is then named by :meth:`_check_runs`)."""
        size = entry["partition"]["slice_size"]
        own = slice_of(self.shard_index, self.shard_num, size)
        picks, runs, at = [], [], 0
        for key, r0, r1 in spans:
            read = ids_out[at:at + r1 - r0]
            reader.read_into(key, read.view(np.uint8), r0 * 8)
            rows = reader.descriptions[key]["slices"]["rows"]
            groups = len(rows) - 1
            first, last = group_span(rows, size, *own)
            if first * size // groups >= own[0] and last * size // groups <= own[1]:  # every group the rank's
                runs.append((key, (at, at + r1 - r0, r0, np.asarray(rows, np.int64), size, *own)))
                picks.append((_IN_PLACE, key[len(name) + 3:], range(r0, r1)))
                at += r1 - r0
                continue
            lo, hi = _checked_run(reader, key, read, r0, rows, size, own)
            if (lo, hi) != (r0, r1):  # groups that reach past this rank's slice: keep the rows within it
                ids_out[at:at + hi - lo] = read[lo - r0:hi - r0].copy()
            if lo < hi:
                picks.append((_IN_PLACE, key[len(name) + 3:], range(lo, hi)))
            at += hi - lo
        return picks, runs

    def _check_runs(self, reader: CheckpointReader, entry: dict, runs: list, ids: np.ndarray) -> None:
        """The :class:`~fastckpt.errors.FormatError` naming the first id of ``runs`` (:meth:`_read_spans`) out of
        place, where the id index's build found one."""
        size = entry["partition"]["slice_size"]
        own = slice_of(self.shard_index, self.shard_num, size)
        for key, (start, stop, r0, rows, *_) in runs:
            if _checked_run(reader, key, ids[start:stop], r0, rows.tolist(), size, own) != (r0, r0 + stop - start):
                raise FormatError(f"{reader.file_of(key).path}: tensor {key!r}, rows {r0}..{r0 + stop - start}: "
                                  f"ids outside slice positions {list(own)}, which the slice offsets give this rank "
                                  "whole: the offsets or the ids are damaged or forged (`fastckpt verify` names a "
                                  "damaged file)")

    def _load_full_table(self, reader: CheckpointReader, name: str, entry: dict, headroom: int = 0) -> None:
        """The table of a full checkpoint: this rank's rows gathered into new arrays that the table adopts.

        ``headroom``: rows the deltas to come may add (all ranks'); this rank's expected share of them is
        left as spare capacity, so that applying the deltas does not copy the whole table to grow it.
        """
        given = self.hashtables.get(name)
        if given is not None:
            check_holds(given, entry, name, reader.path)
        # the rows of the embedding and of each slot as the manifest records them (version 5: shapes and dtypes
        # of their own), the slots of the table given where there is one
        table = table_for(entry, name, None if given is None else given.slots)
        # First the ids of every part and which of them this rank owns; then one gather of those rows from each
        # part's mapped views straight into arrays of the final size (no concatenation), which the table adopts
        # as its storage (no copy).
        id_keys = reader.part_names(f"{name}.id")
        plain = not any("encoding" in reader.descriptions[key] for key in id_keys)
        stored = max(1, reader.hashtables()[name].get("ids", 0))  # every rank's ids in the checkpoint
        spans = self._slice_spans(reader, entry, id_keys) if plain else None
        ids_out, runs = None, []
        if self.shard_num == 1 and self.owner in (None, owner_mod) and plain:
            # One rank owns every id: each id part is read into place below, not mapped, copied and numbered.
            picks = [(None, key[len(name) + 3:], range(reader.part_infos[key].shape[0])) for key in id_keys
                     if reader.part_infos[key].shape[0]]
        elif spans is not None:
            # The slice rule (format version 4 on): the ids of the groups that meet this rank's slice, read into
            # place here and checked (no copy of them, no positions array), their rows read below as runs.
            most = sum(r1 - r0 for _, r0, r1 in spans)
            ids_out = kept.empty(most + (headroom * most // stored + 1024 if headroom else 0), np.int64)
            picks, runs = self._read_spans(reader, name, entry, spans, ids_out)
        else:
            picks = self._owned(reader, f"{name}.id")
        total = sum(len(mine) for *_, mine in picks)
        if ids_out is None:
            ids_out = kept.empty(total + (headroom * total // stored + 1024 if headroom else 0), np.int64)
        capacity = len(ids_out)
        # on memory a dropped load's arrays left where there is some (fastckpt.sharded.kept): no page to zero
        values_out = kept.empty((capacity, *table.shape), table.dtype)
        slots_out = {slot: kept.empty((capacity, *shape), dtype) for slot, (shape, dtype) in table.slot_specs.items()}
        at = 0
        copies: list[tuple] = []  # the rows' copies, run on `parallel` threads while the table builds its index
        id_reads: list[tuple[str, np.ndarray]] = []  # id parts read into place by this thread, before the index
        for ids, suffix, mine in picks:
            end = at + len(mine)
            targets = [(f"{name}.embedding{suffix}", values_out), *((f"{name}.{s}{suffix}", o) for s, o in
                                                                    slots_out.items())]
            if ids is None:  # every id of the part, not read yet: read into place below, while the rows are
                id_reads.append((f"{name}.id{suffix}", ids_out[at:end]))
                copies += [(_copy_whole, reader, key, out[at:end]) for key, out in targets]
            elif ids is _IN_PLACE:  # ids_out[at:end] holds them: their rows, one run of the part
                copies += [(_copy_run, reader, key, mine.start, out[at:end]) for key, out in targets]
            elif len(mine) == len(ids):  # the whole part: read its bytes into place, as a plain read would
                ids_out[at:end] = ids
                copies += [(_copy_whole, reader, key, out[at:end]) for key, out in targets]
            else:
                np.take(ids, mine, out=ids_out[at:end])
                copies += [(_copy_rows, reader, key, mine, out[at:end]) for key, out in targets]
            at = end
        with Lane("rows", self.parallel) as pool:
            scope = held_guards()  # the copies' threads read the mappings under this thread's guards
            # bundled by bytes (fastckpt.sharded.workers.bundles): a resharding rank's runs of a few MiB each go
            # to one thread together rather than waking a thread each
            futures = pool.submit_bundled([(scope.run, copy) for copy in copies], [copy[-1].nbytes for copy in copies])
            error = None
            for key, out in id_reads:
                _read_part(reader, key, out)
            try:
                # reads the ids, not the rows, and checks those of `runs` as it does
                table.adopt(ids_out, values_out, slots_out, rows=total, runs=[run for _, run in runs])
            except ValueError as exc:
                what = str(exc).removeprefix("adopt: ")
                try:
                    self._check_runs(reader, entry, runs, ids_out)
                except FormatError as damaged:
                    error = damaged
                error = error or FormatError(f"{reader.path}: hashtable {name!r}: {what} across its id parts "
                                             f"{reader.part_names(f'{name}.id')} (each id must be saved by one rank "
                                             "only)")
            for future in futures:
                future.result()
        if error is not None:
            raise error
        return table
