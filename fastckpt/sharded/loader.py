"""``Loader``: this rank's share of a sharded checkpoint, on any number of ranks (resharding N -> M).

A checkpoint saved by N ranks loads on M ranks exactly, for any N, M >= 1:

* hashtables: every id goes to the rank its *owner rule* names (default
  ``id mod M``, non-negative for negative ids too; pass ``owner(ids, M) ->
  ranks`` for another), its embedding row and slot rows with it. Each rank
  reads the id parts, then only the rows it owns (zero-copy views of the
  mapped files: the other rows' pages are never read).
* dense tensors: ``dense="replicated"`` (default, as in data parallel
  training) gives every rank the whole tensor; ``dense="rows"`` gives rank
  ``j`` rows ``[j*R//M, (j+1)*R//M)``. Either way only the parts overlapping
  those rows are read.

``filter_func`` receives the load information (a dict ``{"tensors": {name:
{"dtype", "shape", "rows"}}, "hashtables": {name: {"dim", "dtype", "slots",
"ids"}}}`` for everything this Loader would load) and returns it with the
entries to skip removed.

>>> import numpy as np, tempfile, os
>>> from fastckpt.sharded import HashTable, Saver
>>> out = os.path.join(tempfile.mkdtemp(), "c")
>>> t = HashTable(dim=1); t.insert(np.arange(6), np.arange(6, dtype=np.float32)[:, None])
>>> _ = Saver(path=out, parallel=1, hashtables={"emb": t}).save()
>>> mine = {"emb": HashTable(dim=1)}
>>> _ = Loader(out, hashtables=mine, shard_index=1, shard_num=2).load()
>>> mine["emb"].ids().tolist()                    # rank 1 of 2 owns the odd ids
[1, 3, 5]
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import difflib
import logging
import os
import time
from typing import Any, Callable

import numpy as np

from fastckpt.errors import FormatError
from fastckpt.formats.remote import is_url
from fastckpt.progress import progress_from
from fastckpt.sharded.chain import manifest_digest, resolve_chain
from fastckpt.sharded.format import rows_of
from fastckpt.sharded.hashtable import HashTable
from fastckpt.sharded.reader import CheckpointReader

__all__ = ["Loader", "owner_mod"]

_log = logging.getLogger(__name__)


def _read_part(reader: CheckpointReader, key: str, out: np.ndarray) -> None:
    """Stored part ``key`` into ``out`` (C-contiguous, its dtype and shape) with ``preadv``.

    A load that takes a part whole reads it this way rather than copying from the mapping: the kernel copies
    from the page cache without mapping every page into the process first (several times faster here).
    """
    f = reader.file_of(key)
    info = f.infos[key]
    if info.dtype != out.dtype or info.shape != out.shape or info.nbytes != out.nbytes:
        np.copyto(out, reader.host(key))  # not the plain bytes of out (another byte order, say): convert
        return
    view = memoryview(out.reshape(-1).view(np.uint8))
    fd = os.open(f.path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], info.offset + done)
            if not got:
                raise FormatError(f"{f.path}: ends inside tensor {key!r} (read {done} of its {len(view)} bytes at "
                                  f"offset {info.offset}); the file was truncated after it was opened")
            done += got
    finally:
        os.close(fd)


def _stored_nbytes(readers: list[CheckpointReader], tensor: str) -> int:
    """The bytes ``tensor``'s parts take in the files of ``readers`` (0 where one has no such tensor)."""
    total = 0
    for reader in readers:
        try:
            keys = reader.part_names(tensor)
        except KeyError:
            continue
        total += sum(reader.infos[key].nbytes for key in keys)
    return total


def owner_mod(ids: np.ndarray, shard_num: int) -> np.ndarray:
    """The default owner rule: ``id mod shard_num`` (numpy's ``%``: non-negative for negative ids).

    >>> owner_mod(np.array([-3, 0, 5]), 4).tolist()
    [1, 0, 1]
    """
    return np.mod(ids, shard_num)


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
    when it is filled.
    """

    def __init__(self, checkpoint_path: str, hashtables: dict | None = None, tensors: dict | None = None,
                 parallel: int = 16, filter_func: Callable[[dict], dict] = lambda info: info, *,
                 shard_index: int = 0, shard_num: int = 1,
                 owner: Callable[[np.ndarray, int], np.ndarray] = owner_mod, dense: str = "replicated",
                 allow_lossy: bool = False, progress=False, storage_options: dict | None = None):
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
        before anything is filled. Each table loaded is marked clean against this checkpoint, so that an
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
        chain = resolve_chain(self.checkpoint_path)
        self._check_lossy(chain)
        with contextlib.ExitStack() as stack:
            readers = [stack.enter_context(CheckpointReader(path)) for path, _ in chain]
            head = readers[-1]
            info = self.filter_func(self.load_info(head))
            jobs = [(name, _stored_nbytes([head], name), self._load_dense, head, name, entry)
                    for name, entry in info.get("tensors", {}).items()]
            for name, entry in info.get("hashtables", {}).items():
                given = self.hashtables.get(name)
                parts = ["id", "embedding", "deleted", *getattr(given, "slots", entry["slots"])]
                jobs.append((name, sum(_stored_nbytes(readers, f"{name}.{part}") for part in parts),
                             self._load_table, readers, name, entry))
            nbytes = sum(job[1] for job in jobs)
            report = stack.enter_context(progress_from(self.progress, nbytes, f"load rank {self.shard_index}"))

            def run(item: str, stored: int, fill, *args) -> None:
                fill(*args)
                report.advance(stored, item)

            with concurrent.futures.ThreadPoolExecutor(min(self.parallel, max(1, len(jobs)))) as pool:
                for future in [pool.submit(run, *job) for job in jobs]:
                    future.result()
        token = (chain[-1][0], manifest_digest(chain[-1][0]))
        for name in info.get("hashtables", {}):
            self.hashtables[name].mark_clean(token)
        _log.info("loaded %s (rank %d of %d, %d checkpoints in the chain): %d tensors, %d hashtables, %d stored "
                  "bytes in %.3f s", self.checkpoint_path, self.shard_index, self.shard_num, len(chain),
                  len(info.get("tensors", {})), len(info.get("hashtables", {})), nbytes, time.perf_counter() - started)
        return self.hashtables, self.tensors

    def _load_dense(self, reader: CheckpointReader, name: str, entry: dict) -> None:
        start, end = entry["rows"]
        shape = tuple(entry["shape"])
        dtype = reader.tensor_dtype(name)
        if not shape:
            out = np.array(reader.host(reader.part_names(name)[0]))
        else:
            out = np.empty((end - start, *shape[1:]), dtype)
            for key in reader.part_names(name):
                d = reader.descriptions[key]
                p_start = d["row_start"]
                p_end = p_start + d["shape"][0]
                lo, hi = max(start, p_start), min(end, p_end)
                if (lo, hi) == (p_start, p_end) and hi > lo:  # the whole part: read into place
                    _read_part(reader, key, out[lo - start:hi - start])
                elif lo < hi:
                    out[lo - start:hi - start] = reader.host(key)[lo - p_start:hi - p_start]
        target = self.tensors.get(name)
        if isinstance(target, np.ndarray) and target.shape == out.shape and target.dtype == out.dtype \
                and target.flags.writeable:
            target[...] = out
        else:
            self.tensors[name] = out

    def _owned(self, reader: CheckpointReader, tensor: str) -> list[tuple[np.ndarray, str, np.ndarray]]:
        """``[(ids, part suffix, positions this rank owns)]`` for each non-empty part of ``tensor`` (int64 ids)."""
        out = []
        for key in reader.part_names(tensor):
            ids = reader.array(key)
            if len(ids) == 0:
                continue
            ranks = np.asarray(self.owner(ids, self.shard_num))
            if ranks.shape != ids.shape:
                raise ValueError(f"the owner rule returned shape {ranks.shape} for {ids.shape} ids")
            mine = np.flatnonzero(ranks == self.shard_index)
            if len(mine):
                out.append((ids, key[len(tensor):], mine))
        return out

    def _load_table(self, readers: list[CheckpointReader], name: str, entry: dict) -> None:
        """The table as of the chain's head: its full base, then every delta in order."""
        written = sum(r.hashtables().get(name, {}).get("written", 0) for r in readers[1:])
        self._load_full_table(readers[0], name, entry, headroom=written)
        for reader in readers[1:]:
            self._apply_delta(reader, name)

    def _apply_delta(self, reader: CheckpointReader, name: str) -> None:
        """Remove the ids the delta deleted, then upsert the rows it wrote (those this rank owns)."""
        table = self.hashtables[name]
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

    def _load_full_table(self, reader: CheckpointReader, name: str, entry: dict, headroom: int = 0) -> None:
        """The table of a full checkpoint: this rank's rows gathered into new arrays that the table adopts.

        ``headroom``: rows the deltas to come may add (all ranks'); this rank's expected share of them is
        left as spare capacity, so that applying the deltas does not copy the whole table to grow it.
        """
        slots = list(entry["slots"])
        table = self.hashtables.get(name)
        if table is None:
            table = self.hashtables[name] = HashTable(entry["dim"], dtype=reader.tensor_dtype(f"{name}.embedding"),
                                                      slots=slots, name=name)
        if table.dim != entry["dim"] or np.dtype(table.dtype).name != entry["dtype"]:
            raise ValueError(f"{reader.path}: hashtable {name!r} is dim {entry['dim']} {entry['dtype']} in the "
                             f"checkpoint, the table given is dim {table.dim} {np.dtype(table.dtype).name}")
        missing = sorted(set(table.slots) - set(slots))
        if missing:
            raise ValueError(f"{reader.path}: hashtable {name!r} has no slots {missing} in the checkpoint "
                             f"(it has {slots})")
        # First the ids of every part and which of them this rank owns; then one gather of those rows from each
        # part's mapped views straight into arrays of the final size (no concatenation), which the table adopts
        # as its storage (no copy).
        picks = self._owned(reader, f"{name}.id")
        total = sum(len(mine) for *_, mine in picks)
        stored = max(1, reader.hashtables()[name].get("ids", 0))  # every rank's ids in the checkpoint
        capacity = total + (headroom * total // stored + 1024 if headroom else 0)
        dim, dtype = table.dim, np.dtype(table.dtype)
        ids_out = np.empty(capacity, np.int64)
        values_out = np.empty((capacity, dim), dtype)
        slots_out = {slot: np.empty((capacity, dim), dtype) for slot in table.slots}
        at = 0
        for ids, suffix, mine in picks:
            end = at + len(mine)
            targets = [(f"{name}.embedding{suffix}", values_out), *((f"{name}.{s}{suffix}", o) for s, o in
                                                                    slots_out.items())]
            if len(mine) == len(ids):  # the whole part: read its bytes into place, as a plain read would
                ids_out[at:end] = ids
                for key, out in targets:
                    if "encoding" in reader.descriptions[key]:
                        out[at:end] = reader.array(key)
                    else:
                        _read_part(reader, key, out[at:end])
            else:
                np.take(ids, mine, out=ids_out[at:end])
                for key, out in targets:
                    np.take(reader.array(key), mine, axis=0, out=out[at:end])
            at = end
        try:
            table.adopt(ids_out, values_out, slots_out, rows=total)
        except ValueError as exc:
            what = str(exc).removeprefix("adopt: ")
            raise FormatError(f"{reader.path}: hashtable {name!r}: {what} across its id parts "
                              f"{reader.part_names(f'{name}.id')} (each id must be saved by one rank only)"
                              ) from None
