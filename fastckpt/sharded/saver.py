"""``Saver``: every rank writes its shard of the state, rank 0 commits the checkpoint.

The directory layout is specified in :mod:`fastckpt.sharded.format`. Each
rank passes the full value of every dense tensor (replicated, as in data
parallel training) and its own hashtables (the ids it owns); rank ``i`` of
``n`` writes rows ``[i*R//n, (i+1)*R//n)`` of each dense tensor and all rows
of its hashtables (in key-space slice order, format version 4), spread over
``parallel`` files written by as many threads (the writer releases the GIL in
``writev``). A table's rows are not copied first: each writer thread gathers
the rows of its tensor into slice order a piece (about a MiB) at a time as it
writes them, so a save holds no second copy of the rank's share; a table
already in that order (loaded from a version-4 checkpoint, say) is written
straight from its storage. Do not change the tables or arrays while
``save()`` runs.

``filter_func`` receives the rank's list of :class:`WriteBlock` (one per
stored tensor, before anything is written) and returns the blocks to write:
it may drop blocks, not add or change them, and must keep or drop a
hashtable's id, embedding, slot (and deleted) blocks together. A block's
``array`` is the tensor as it will be stored; for a table's tensors that is a
copy of its rows in slice order, made when ``filter_func`` first reads it
(``key``, ``kind``, ``shape``, ``nbytes`` and ``description`` cost nothing).

``incremental=True`` (or a :class:`DeltaPolicy`) saves a *delta* where it
can: only the table rows written and the ids deleted since the tables'
:attr:`~fastckpt.sharded.hashtable.HashTable.base` checkpoint, with dense
tensors whole. Rank 0 decides for all ranks, before anything is written: a
delta needs every rank's tables to share one committed base whose manifest
is unchanged, a chain no longer than ``DeltaPolicy.max_chain`` and a size at
most ``DeltaPolicy.max_fraction`` of a full save's; otherwise the save is
full. :attr:`Saver.kind` says which it was. Every committed save (full or
delta) marks its tables clean (``HashTable.mark_clean``); a failed one leaves
their changes tracked.

``compression="zstd"`` or ``"lz4"`` stores the hashtables compactly and
losslessly (ids sorted and delta-coded, bytes shuffled, then the codec);
``quantize="int8"`` or ``"int16"`` stores their values row-wise quantized,
for serving: the manifest records the largest error, loaders refuse it unless
``allow_lossy=True``, and such a save is always full and leaves the tables'
changes tracked (it is never a base). Both are opt-in: see
:mod:`fastckpt.sharded.codec`.

>>> import numpy as np, tempfile, os
>>> from fastckpt.sharded import HashTable, Saver
>>> table = HashTable(dim=2, slots=("m",))
>>> table.insert(np.array([5, -1]), np.ones((2, 2), np.float32))
>>> out = os.path.join(tempfile.mkdtemp(), "ckpt")
>>> os.path.basename(Saver(path=out, parallel=2, hashtables={"emb": table}, tensors={"w": np.eye(2)}).save())
'ckpt'
>>> sorted(os.listdir(out))[:3]
['index.json', 'manifest.json', 'model-00000-000.safetensors']
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from fastckpt.store.commit import _naming_target, abandon_staging, remove_stale_partials_in, staging_directory
from fastckpt.formats.hashing import blake3_hasher
from fastckpt.formats.remote import is_url
from fastckpt.formats.safetensors import save_safetensors
from fastckpt.progress import part_of_a_save, progress_from
from fastckpt.sharded.codec import check_options, encode_ids, encode_values
from fastckpt.sharded.engine import error_info as _error_info
from fastckpt.sharded.engine import raise_from_root as _raise_from_root
from fastckpt.sharded.format import (
    DESCRIPTION_FILE,
    FORMAT,
    INDEX_FILE,
    MAX_GROUPS,
    MAX_SLICE_SIZE,
    NAMES,
    ROWS_VERSION,
    TENSORKEY_FILE,
    WriteBlock,
    commit_directory,
    dumps,
    part_key,
    rows_of,
    slice_order,
    tensor_file_name,
    version_for,
)
from fastckpt.sharded.hashtable import HashTable, _sort_ids
from fastckpt.sharded.workers import Lane
from fastckpt.state import as_numpy

__all__ = ["Saver", "WriteBlock", "DeltaPolicy", "split_sparse_dense_state_dict"]

_log = logging.getLogger(__name__)

# Each tensor file's write-out to the disk starts every this many bytes written (save_safetensors' writeback), so
# that the disk works while the writers gather, hash and copy the next bytes, rather than all at the fsync at the
# end: the save then takes about the longer of its CPU work and the disk's, not their sum.
WRITEBACK_BYTES = 8 << 20


@dataclass(frozen=True)
class DeltaPolicy:
    """When an incremental :class:`Saver` writes a delta, and when a full checkpoint instead.

    ``max_chain``: deltas in a row before a full checkpoint (a restore reads at most this many deltas after
    its full base); ``max_fraction``: a full checkpoint whenever the delta would store more than this fraction
    of a full save's bytes.

    >>> DeltaPolicy()
    DeltaPolicy(max_chain=10, max_fraction=0.5)
    """

    max_chain: int = 10
    max_fraction: float = 0.5

    def __post_init__(self):
        if type(self.max_chain) is not int or self.max_chain < 1:
            raise ValueError(f"max_chain must be a positive int, got {self.max_chain!r}")
        if not 0 < self.max_fraction <= 1:
            raise ValueError(f"max_fraction must be in (0, 1], got {self.max_fraction!r}")


def split_sparse_dense_state_dict(state_dict: Mapping[str, Any]) -> tuple[dict, dict]:
    """``(sparse, dense)``: the :class:`HashTable` values of ``state_dict``, and every other value.

    >>> sparse, dense = split_sparse_dense_state_dict({"emb": HashTable(dim=4), "w": np.zeros(2)})
    >>> list(sparse), list(dense)
    (['emb'], ['w'])
    """
    sparse, dense = {}, {}
    for name, value in state_dict.items():
        (sparse if isinstance(value, HashTable) else dense)[name] = value
    return sparse, dense


def _dense_items(tensors) -> list[tuple[str, Any]]:
    if tensors is None:
        return []
    if isinstance(tensors, Mapping):
        return list(tensors.items())
    items = list(tensors)
    if not all(isinstance(t, tuple) and len(t) == 2 and isinstance(t[0], str) for t in items):
        raise TypeError("tensors must be a dict name -> array, or a list of (name, array) pairs")
    return items


def _dimension(shape: tuple) -> int:
    return int(np.prod(shape[1:], dtype=np.int64)) if len(shape) >= 2 else 1


def _row_entry(table: HashTable) -> dict:
    """A table's rows as its manifest entry records them (format version 5): ``shape`` of the embedding's rows,
    ``slot_specs`` of each slot's (a save of version 4 leaves both out: :func:`version_for`)."""
    return {"shape": list(table.shape), "slot_specs": {slot: {"shape": list(shape), "dtype": dtype.name}
                                                       for slot, (shape, dtype) in table.slot_specs.items()}}


def _row_bytes(table: HashTable) -> int:
    """The bytes one id of ``table`` stores: the id, its embedding row and its row of every slot."""
    return 8 + table.dim * table.dtype.itemsize + sum(int(np.prod(shape)) * dtype.itemsize
                                                      for shape, dtype in table.slot_specs.values())


class Saver:
    """Save this rank's shard of a sharded checkpoint (see the module docs); :meth:`save` does the work.

    ``engine`` (a :class:`fastckpt.sharded.engine.Engine`) coordinates the
    ranks; by default :func:`~fastckpt.sharded.engine.default_engine` picks one
    (none is needed for ``shard_num=1``; MPI when run under ``mpiexec``).
    ``timeout`` bounds every wait for the other ranks. An existing checkpoint
    at ``path`` is an error unless ``overwrite=True``. ``progress`` (``True``
    for a bar, or ``callback(done, total, item)``: :mod:`fastckpt.progress`)
    counts the bytes of this rank's tensors as its writer threads write them.
    ``layout="recis"`` writes RecIS's own files (:mod:`fastckpt.sharded.recis`: dense tensors whole from rank 0,
    each rank's tables holding only the ids of its RecIS slice) with fastckpt's manifest beside; its
    ``slice_size`` (an int, or ``{table: int}``; default 65536, RecIS's) is the key space of RecIS's slices.
    In fastckpt's layout ``slice_size`` (default 65536) is the key space of the tables' slice order (format
    version 4), from 64 to 2**32. Tables whose rows or slots have shapes or dtypes of their own
    (``HashTable((2, 3))``, a step filter's int64 slot) are saved whole in either layout: fastckpt's writes them
    as format version 5 (:func:`~fastckpt.sharded.format.version_for`; version 4 otherwise). Names may hold '/'
    (``tower/dense/kernel``; fastckpt's layout then writes format version 6), not '/part_' or a control character.
    ``direct=True`` writes the tensor files of a local save past the page cache (``O_DIRECT`` where the file
    system takes it; the same bytes): the kernel copies none of them, about a quarter less CPU a save, and a
    checkpoint does not push the training's own data out of the page cache. It pays where the disk takes
    direct writes as fast as the kernel's write-back (local NVMe); on the 2-core VM of the project's benchmarks
    direct writes of 255 MiB got 60-75% of the write-back's throughput, so the default goes through the cache.

    >>> import numpy as np, tempfile, os
    >>> out = os.path.join(tempfile.mkdtemp(), "c")
    >>> Saver(path=out, parallel=1, tensors=[("bias", np.arange(3.0))]).save() == out
    True
    """

    def __init__(self, shard_index: int = 0, shard_num: int = 1, parallel: int = 8, path: str = ".",
                 hashtables: dict | None = None, tensors: list | dict | None = None,
                 filter_func: Callable[[list], list] = lambda blocks: blocks, *, engine=None,
                 timeout: float = 600.0, overwrite: bool = False, incremental: bool | DeltaPolicy = False,
                 compression: str | None = None, quantize: str | None = None, progress=False,
                 storage_options: dict | None = None, layout: str = "fastckpt",
                 slice_size: int | Mapping[str, int] | None = None, direct: bool = False):
        if type(shard_num) is not int or shard_num < 1:
            raise ValueError(f"shard_num must be a positive int, got {shard_num!r}")
        if isinstance(shard_index, (str, os.PathLike)):  # Saver("ckpt/step-1"): the path in the first place
            raise TypeError(f"Saver's first argument is shard_index, got the path {os.fspath(shard_index)!r}; name "
                            f"the checkpoint directory with path=: Saver(path={os.fspath(shard_index)!r}, ...)")
        if type(shard_index) is not int or not 0 <= shard_index < shard_num:
            raise ValueError(f"shard_index must be an int in [0, {shard_num}), got {shard_index!r}")
        if type(parallel) is not int or not 1 <= parallel <= 999:
            raise ValueError(f"parallel must be an int from 1 to 999, got {parallel!r}")
        self.shard_index, self.shard_num, self.parallel = shard_index, shard_num, parallel
        self.path = os.fspath(path)
        self.storage_options = storage_options  # for a URL path (s3://...): fastckpt.sharded.remote
        self.hashtables = dict(hashtables or {})
        for name, table in self.hashtables.items():
            if not isinstance(table, HashTable):
                raise TypeError(f"hashtables[{name!r}] is a {type(table).__name__}, not a fastckpt HashTable")
        self.tensors = _dense_items(tensors)
        clash = {n for n, _ in self.tensors} & {f"{t}.{r}" for t, tab in self.hashtables.items()
                                                for r in ("id", "embedding", *tab.slots)}
        if clash:
            raise ValueError(f"dense tensor names {sorted(clash)} clash with hashtable tensor names")
        self.filter_func = filter_func
        self.engine = engine
        self.timeout = timeout
        self.overwrite = overwrite
        if not isinstance(incremental, (bool, DeltaPolicy)):
            raise TypeError(f"incremental must be a bool or a DeltaPolicy, got {incremental!r}")
        self.policy = DeltaPolicy() if incremental is True else (incremental or None)
        check_options(compression, quantize)
        self.compression, self.quantize = compression, quantize
        self.progress = progress
        if quantize is not None:
            self.policy = None  # a lossy checkpoint is never a base: always full, the tables' changes kept
        self.kind = "full"  # what the last save() wrote (or will write): "full" or "delta"
        if layout not in ("fastckpt", "recis"):
            raise ValueError(f"layout must be 'fastckpt' or 'recis', got {layout!r}")
        if layout == "recis" and (incremental or compression or quantize):
            raise ValueError("layout='recis' writes RecIS's full checkpoints only: no incremental, compression or "
                             "quantize")
        if layout == "recis" and is_url(self.path):
            raise ValueError(f"{self.path}: layout='recis' saves to a local directory (upload it afterwards)")
        self.layout = layout  # "recis": RecIS's own files (fastckpt.sharded.recis) and fastckpt's manifest
        self._check_names()
        self.slice_size = slice_size
        if not isinstance(direct, bool):
            raise TypeError(f"direct must be True or False, got {direct!r}")
        if direct and (layout == "recis" or is_url(self.path)):
            raise ValueError(f"{self.path}: direct=True writes the tensor files of a local save in fastckpt's layout "
                             "past the page cache; a URL (uploaded from the page cache) or layout='recis' is saved "
                             "without it")
        self.direct = direct  # tensor files past the page cache (a local save)
        from fastckpt.sharded.recis import slice_sizes

        self._slice_sizes = slice_sizes(self)  # checked here, before anything is written
        if layout == "fastckpt":
            for name, size in self._slice_sizes.items():
                if not MAX_GROUPS <= size <= MAX_SLICE_SIZE:
                    raise ValueError(f"hashtable {name!r}: slice_size must be from {MAX_GROUPS} to {MAX_SLICE_SIZE} in "
                                     f"fastckpt's layout (format version 4's key space), got {size!r}")
        self._errors: dict[str, float] = {}  # table -> largest absolute error of its quantized rows
        self._changes: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # table -> (changed rows, deleted ids)

    def _check_names(self) -> None:
        """Refuse, before anything is written, a name this layout's reader cannot read back (the one rule:
        :mod:`fastckpt.store.names`, with the separators the layout reserves)."""
        if self.layout == "recis":
            from fastckpt.sharded.recis import NAMES as rule
        else:
            rule = NAMES
        for name, table in self.hashtables.items():
            rule.check(name, "hashtable")
            for slot in table.slots:
                rule.check(slot, f"hashtable {name!r} slot")
        for name, _ in self.tensors:
            rule.check(name, "tensor")

    # -- the blocks this rank writes ------------------------------------------------------------------
    def blocks(self) -> list[WriteBlock]:
        """This rank's write blocks before ``filter_func``: its rows of every dense tensor, its hashtables.

        >>> [b.key for b in Saver(tensors={"w": np.zeros((4, 2))}, shard_index=1, shard_num=2).blocks()]
        ['w/part_1_2']
        """
        if self.layout == "recis":
            from fastckpt.sharded import recis

            return recis.blocks(self)
        i, n = self.shard_index, self.shard_num
        out = []
        for name, value in self.tensors:
            array = as_numpy(value)
            if array is None:
                raise TypeError(f"tensors[{name!r}] is a {type(value).__name__}, not an array")
            if array.dtype.hasobject:
                raise TypeError(f"tensors[{name!r}] is an object array; nothing is pickled")
            if array.ndim == 0:
                if i != 0:
                    continue
                part, (start, pi, pn) = array, (0, 0, 1)
            else:
                start, end = rows_of(i, n, array.shape[0])
                part, pi, pn = array[start:end], i, n
            key = part_key(name, pi, pn)
            out.append(WriteBlock(key, name, "dense", part, None, {
                "name": key, "dense": True, "dimension": _dimension(array.shape), "dtype": array.dtype.name,
                "shape": list(part.shape), "is_hashmap": False, "tensor": name, "part": [pi, pn],
                "row_start": start, "global_shape": list(array.shape)}))
        for table_name, table in self.hashtables.items():
            ids, values, slots = table.rows()  # views of the table's storage
            id_key = part_key(f"{table_name}.id", i, n)
            value_key = part_key(f"{table_name}.embedding", i, n)
            roles = [("id", f"{table_name}.id", ids, None), ("embedding", f"{table_name}.embedding", values, None)]
            roles += [("slot", f"{table_name}.{slot}", slots[slot], slot) for slot in table.slots]
            encoded = self.compression is not None or self.quantize is not None
            # The rows to write, in order: a delta's changed rows; in slice order (format version 4) unless
            # encoded (the codec sorts by id). None: the table's storage as it is. Either way no copy is made
            # here: each writer gathers its tensor's rows a piece at a time as it writes them (WriteBlock).
            rows = self._changes[table_name][0] if self.kind == "delta" else None
            slices = None
            if not encoded:
                size = self._slice_sizes[table_name]
                order, offsets = slice_order(ids if rows is None else ids[rows], size)
                slices = {"groups": len(offsets) - 1, "rows": offsets}
                if order is not None:
                    rows = order if rows is None else rows[order]
            roles = [(role, tensor, array, slot, rows) for role, tensor, array, slot in roles]
            if self.kind == "delta":  # and the ids deleted since the base
                roles.append(("deleted", f"{table_name}.deleted", self._changes[table_name][1], None, None))
            encodings = [None] * len(roles)
            if encoded:
                roles, encodings = self._encoded(table_name, roles)
            for (role, tensor, array, slot, taken), encoding in zip(roles, encodings):
                key = part_key(tensor, i, n)
                shape = [len(array) if taken is None else len(taken), *array.shape[1:]]
                dimension = 1 if role in ("id", "deleted") else table.dim if slot is None else \
                    int(np.prod(table.slot_specs[slot][0]))
                desc = {"name": key, "dense": False, "dimension": dimension,
                        "dtype": array.dtype.name, "shape": shape, "is_hashmap": True,
                        "hashmap_key": id_key, "hashmap_value": value_key, "tensor": tensor, "part": [i, n],
                        "table": table_name, "role": role}
                if slot is not None:
                    desc["slot"] = slot
                if role == "id" and slices is not None:
                    desc["slices"] = slices
                if encoding is not None:
                    desc["encoding"] = encoding
                out.append(WriteBlock(key, tensor, "slot" if slot else role, array, table_name, desc, rows=taken))
        return out

    def _encoded(self, table_name: str, roles: list[tuple]) -> tuple[list[tuple], list[dict]]:
        """The table's tensors encoded (:mod:`fastckpt.sharded.codec`): rows sorted by id, then each tensor
        compressed (and its values quantized), one tensor per thread. ``roles``: ``(role, tensor, array, slot,
        rows)``, the rows to store of each array (None: all, in order)."""
        _, _, ids, _, rows = roles[0]
        ids = np.asarray(ids if rows is None else ids[rows])
        sorted_ids, order = _sort_ids(ids) if len(ids) else (ids, np.empty(0, np.intp))
        if rows is not None:
            order = rows[order]  # one gather of each tensor: its rows straight into id order

        table = self.hashtables[table_name]

        def encode(item):
            role, _, array, slot, _ = item
            if role == "id":
                return (*encode_ids(sorted_ids, self.compression), 0.0)
            if role == "deleted":
                return (*encode_ids(np.asarray(array), self.compression), 0.0)
            # A slot of its own integer or bool dtype (a step filter's counts) is never quantized: stored lossless.
            own = slot is not None and table.slot_specs[slot] != (table.shape, table.dtype)
            quantize = None if own and array.dtype.kind in "biu" else self.quantize
            return encode_values(np.take(array, order, axis=0), self.compression, quantize)

        try:
            with Lane("encode", self.parallel) as pool:  # threads kept between saves (fastckpt.sharded.workers)
                futures = [pool.submit(encode, role) for role in roles]
            results = [future.result() for future in futures]
        except ValueError as exc:
            raise ValueError(f"hashtable {table_name!r}: {exc}") from None
        self._errors[table_name] = max((error for *_, error in results), default=0.0)
        return ([(role, tensor, stored, slot, None) for (role, tensor, _, slot, _), (stored, *_) in zip(roles, results)],
                [encoding for _, encoding, _ in results])

    def _filtered(self) -> list[WriteBlock]:
        blocks = self.blocks()
        kept = self.filter_func(list(blocks))
        known = {id(b) for b in blocks}
        if not isinstance(kept, list) or any(id(b) not in known for b in kept):
            raise TypeError("filter_func must return a list of the WriteBlocks it was given (it may only drop some)")
        kept_ids = {id(b) for b in kept}
        tables = {}
        for b in blocks:
            if b.table is not None:
                tables.setdefault(b.table, []).append(id(b) in kept_ids)
        torn = sorted(t for t, flags in tables.items() if any(flags) and not all(flags))
        if torn:
            raise ValueError(f"filter_func kept some but not all blocks of hashtables {torn}: keep or drop a "
                             "table's id, embedding, slot and deleted blocks together")
        return kept

    # -- writing --------------------------------------------------------------------------------------
    def _write_files(self, staging: Path, blocks: list[WriteBlock]) -> dict:
        """Write this rank's tensor files into ``staging`` (past the page cache with :attr:`direct`); returns this
        rank's report for the commit."""
        files: list[list[WriteBlock]] = [[] for _ in range(self.parallel)]
        loads = [0] * self.parallel
        for block in sorted(blocks, key=lambda b: (-b.nbytes, b.key)):  # largest first onto the lightest file
            k = loads.index(min(loads))
            files[k].append(block)
            loads[k] += block.nbytes
        names = [tensor_file_name(self.shard_index, k) for k in range(self.parallel)]

        def write(k: int) -> tuple[str, dict]:
            path = staging / names[k]
            # fed the bytes a MiB at a time, each step just before it is written (GatherWriter): with writer
            # threads to share the cores, hashing on one thread each costs less CPU than dispatching each piece
            # to a thread pool (9-14% of a save's CPU at parallel 4, measured at 1 and 4 ranks)
            hasher = blake3_hasher(threads=1 if self.parallel > 1 else None)
            with part_of_a_save():  # the rank logs its own line
                # Written under its own name in the staging directory (staged=True: no temporary, rename or
                # sweep of stale temporaries of its own; the commit publishes the directory whole). The file's
                # data is fsynced here, its name by the commit, which fsyncs the directory once before renaming
                # it into place: a file saved on its own also fsyncs its directory, and the 16 files of 4 ranks
                # waited for 16 more journal commits.
                # direct: past the page cache (Saver's direct=), the rows gathered and the bytes hashed in the
                # writer's stage
                save_safetensors(path, {b.key: b.payload() for b in files[k]}, {"fastckpt.format": FORMAT},
                                 hasher=hasher, progress=report, writeback=WRITEBACK_BYTES, direct=self.direct,
                                 staged=True)
            return names[k], {"size": os.path.getsize(path), "blake3": hasher.hexdigest()}

        with progress_from(self.progress, sum(loads), f"save rank {self.shard_index}") as report, \
                Lane("write", self.parallel) as pool:  # threads kept between saves (fastckpt.sharded.workers)
            futures = [pool.submit(write, k) for k in range(self.parallel)]
        written = dict(future.result() for future in futures)
        block_index = {b.key: self.shard_index * self.parallel + k for k in range(self.parallel) for b in files[k]}
        tables = {}
        for name, table in self.hashtables.items():
            if any(b.table == name for b in blocks):
                tables[name] = {"dim": table.dim, "dtype": np.dtype(table.dtype).name, "slots": list(table.slots),
                                "ids": len(table), **_row_entry(table),
                                "partition": {"rule": "slice", "slice_size": self._slice_sizes[name]}}
                if self.kind == "delta":
                    rows, deleted = self._changes[name]
                    tables[name].update(written=len(rows), deleted=len(deleted))
                if self.compression is not None or self.quantize is not None:
                    tables[name]["encoding"] = {"compression": self.compression, "quantize": self.quantize,
                                                "max_abs_error": self._errors.get(name, 0.0)}
        return {"rank": self.shard_index, "shard_num": self.shard_num, "parallel": self.parallel,
                "files": written, "block_index": block_index,
                "tensorkey": {b.key: b.tensor for b in blocks},
                "descriptions": {b.key: b.description for b in blocks}, "tables": tables}

    def save(self) -> str:
        """Write this rank's files; on rank 0 also commit the checkpoint. Returns the checkpoint's path.

        Every rank of the save must call it. A rank that does not report
        within ``timeout`` makes rank 0 raise
        :class:`~fastckpt.sharded.engine.BarrierTimeoutError` naming it; the
        staging directory is then removed and no checkpoint appears. A URL
        path (``s3://...``) is saved by :func:`fastckpt.sharded.remote.save`.
        """
        if is_url(self.path):  # object storage and remote filesystems
            from fastckpt.sharded import remote

            return remote.save(self)
        started = time.perf_counter()
        engine = self._engine()
        final = Path(self.path).absolute()
        root = engine.rank == 0
        start: dict = {}
        start_error = None
        if root:
            try:
                start = {"staging": os.fspath(self._begin(final))}
            except Exception as exc:
                start, start_error = _error_info(exc), exc
        try:
            start = engine.broadcast(start, root=0, timeout=self.timeout)
        except BaseException:
            if root and "staging" in start:  # a rank did not even start: nothing may stay behind
                self._abandon(Path(start["staging"]))
            raise
        if "error" in start:
            if start_error is not None:
                raise start_error  # rank 0's own: FileExistsError stays FileExistsError
            _raise_from_root(start, f"sharded save to {final}: rank 0 could not start it")
        staging = Path(start["staging"])
        self.kind, plan = "full", {"kind": "full"}
        if self.policy is not None:
            try:
                plan = self._agree_on_kind(engine, final)
            except BaseException:
                if root:
                    self._abandon(staging)
                raise
            self.kind = plan["kind"]
        error = None
        write, commit = self._write_files, lambda reports: self._commit(staging, final, reports, plan)
        if self.layout == "recis":
            from fastckpt.sharded import recis

            write = lambda staging_, blocks: recis.write_files(self, staging_, blocks)  # noqa: E731
            commit = lambda reports: recis.commit(self, staging, final, reports)  # noqa: E731
        try:
            report = write(staging, self._filtered())
        except Exception as exc:
            if isinstance(exc, OSError):  # the checkpoint's path, the staging directory only as detail
                exc = _naming_target(exc, os.fspath(final), os.fspath(staging), inside=True)
            report, error = {"error": f"rank {self.shard_index}: {type(exc).__name__}: {exc}"}, exc
        except BaseException:  # an interrupt: this rank stops here; rank 0's staging directory goes
            if root:
                self._abandon(staging)
            raise
        # a rank that did not report, failed, or a failed commit: no checkpoint, nothing left behind
        status, commit_error = self._commit_on_root(engine, report, commit, abandon=lambda: self._abandon(staging))
        self._settle(error, commit_error, status, report, final, os.path.abspath(final))
        _log.info("saved %s (rank %d of %d, %s): %d files, %d bytes in %.3f s", final, self.shard_index,
                  self.shard_num, self.kind, len(report["files"]), sum(f["size"] for f in report["files"].values()),
                  time.perf_counter() - started)
        return str(Path(self.path))

    def _engine(self):
        """The engine of this save (the one given, else the default for ``shard_index`` of ``shard_num``),
        checked to be that rank of that many."""
        from fastckpt.sharded.engine import default_engine

        engine = self.engine if self.engine is not None else default_engine(self.shard_index, self.shard_num)
        if (engine.rank, engine.size) != (self.shard_index, self.shard_num):
            raise ValueError(f"the engine is rank {engine.rank} of {engine.size}, but this Saver is shard "
                             f"{self.shard_index} of {self.shard_num}")
        return engine

    def _commit_on_root(self, engine, report: dict, commit, abandon=None) -> tuple[dict, BaseException | None]:
        """Gather every rank's ``report`` on rank 0, which runs ``commit(reports)`` (it returns the manifest's
        BLAKE3) unless a rank reported an error, and tell every rank how that went. Returns ``(status,
        commit_error)``: rank 0's status as every rank receives it, and on rank 0 the commit's exception, if any.
        ``abandon()`` runs on rank 0 where the save fails there: a rank that never reports (the gather raises),
        a failed rank, a failed commit."""
        root = engine.rank == 0
        try:
            reports = engine.gather(report, root=0, timeout=self.timeout)
        except BaseException:
            if root and abandon is not None:
                abandon()
            raise
        if not root:
            return engine.broadcast(None, root=0, timeout=self.timeout), None
        commit_error = None
        try:
            failed = [r["error"] for r in reports if "error" in r]
            if failed:
                raise RuntimeError("; ".join(failed))
            status = {"ok": True, "manifest_blake3": commit(reports)}
        except BaseException as exc:
            if abandon is not None:
                abandon()
            status, commit_error = {"ok": False, **_error_info(exc)}, exc
        engine.broadcast(status, root=0, timeout=self.timeout)
        return status, commit_error

    # -- full or delta --------------------------------------------------------------------------------
    def _settle(self, error, commit_error, status: dict, report: dict, where, base: str) -> None:
        """After rank 0 broadcast ``status``: raise this rank's own error, rank 0's commit error, or rank 0's failure
        as every rank sees it (in that order); else mark this rank's tables clean against the committed checkpoint
        (``base``: its path or URL, and the manifest's BLAKE3) and forget the changes saved."""
        if error is not None:
            raise error
        if commit_error is not None:
            raise commit_error
        if not status["ok"]:
            _raise_from_root(status, f"sharded save to {where} failed on rank 0")
        for name in report["tables"] if self.quantize is None else ():  # committed: the tables match it now
            self.hashtables[name].mark_clean((base, status["manifest_blake3"]))
        self._changes = {}

    def _agree_on_kind(self, engine, final: Path) -> dict:
        """Every rank proposes (its tables' common base, delta and full bytes); rank 0 decides for all."""
        bases = {table.base for table in self.hashtables.values()}
        base = bases.pop() if len(bases) == 1 else None
        row_bytes = {n: _row_bytes(t) for n, t in self.hashtables.items()}
        dense = sum(as_numpy(v).nbytes for _, v in self.tensors if as_numpy(v) is not None) // self.shard_num
        self._changes = {}
        delta = full = dense
        if base is not None:
            for name, table in self.hashtables.items():
                rows, deleted = table.changed_rows(), table.changes()[1]
                self._changes[name] = (rows, deleted)
                delta += len(rows) * row_bytes[name] + 8 * len(deleted)
                full += len(table) * row_bytes[name]
        proposal = {"base": None if base is None else list(base), "delta_bytes": delta, "full_bytes": full}
        proposals = engine.gather(proposal, root=0, timeout=self.timeout)
        plan = None
        if engine.rank == 0:
            try:
                plan = self._plan(final, proposals)
            except Exception as exc:  # noqa: BLE001 - no usable base: a full save, which needs none
                plan = {"kind": "full", "reason": f"{type(exc).__name__}: {exc}"}
        return engine.broadcast(plan, root=0, timeout=self.timeout)

    def _plan(self, final: Path, proposals: list[dict]) -> dict:
        from fastckpt.sharded.chain import manifest_digest, relative_base, resolve_chain

        bases = {tuple(p["base"]) if p["base"] else None for p in proposals}
        if len(bases) != 1 or None in bases:
            return {"kind": "full", "reason": "the ranks' tables do not all match one committed checkpoint"}
        base_path, digest = bases.pop()
        delta, full = sum(p["delta_bytes"] for p in proposals), sum(p["full_bytes"] for p in proposals)
        if delta > self.policy.max_fraction * full:
            return {"kind": "full", "reason": f"the delta ({delta} bytes) exceeds {self.policy.max_fraction} of a "
                                              f"full save ({full} bytes)"}
        if manifest_digest(base_path) != digest:
            return {"kind": "full", "reason": f"{base_path} changed since the tables were saved or loaded"}
        chain = resolve_chain(base_path)
        if any(Path(path) == final for path, _ in chain):
            return {"kind": "full", "reason": f"{final} is in the chain of its own base"}
        length = chain[-1][1].get("chain_length", 0) + 1
        if length > self.policy.max_chain:
            return {"kind": "full", "reason": f"the chain would hold {length} deltas (max_chain "
                                              f"{self.policy.max_chain})"}
        return {"kind": "delta", "base": {"path": relative_base(final, base_path), "manifest_blake3": digest},
                "chain_length": length}

    def _begin(self, final: Path) -> Path:
        return staging_directory(final, self.overwrite, lambda: _sweep(final.parent))

    @staticmethod
    def _abandon(staging: Path) -> None:
        abandon_staging(staging)  # and the directories made for it; retried by later sweeps if it fails

    def _commit(self, staging: Path, final: Path, reports: list[dict], plan: dict) -> str:
        """Write the metadata and the manifest, rename into place; returns the manifest's BLAKE3."""
        files, block_index, tensorkey, descriptions, tables = {}, {}, {}, {}, {}
        for r in reports:
            if (r["shard_num"], r["parallel"]) != (self.shard_num, self.parallel):
                raise ValueError(f"rank {r['rank']} saved with shard_num {r['shard_num']} and parallel "
                                 f"{r['parallel']}; rank 0 with {self.shard_num} and {self.parallel}")
            files.update(r["files"])
            block_index.update(r["block_index"])
            tensorkey.update(r["tensorkey"])
            descriptions.update(r["descriptions"])
            for name, t in r["tables"].items():
                counts = ("ids", "written", "deleted", "encoding")
                if name in tables and {k: v for k, v in tables[name].items() if k not in counts} != \
                        {k: v for k, v in t.items() if k not in counts}:
                    raise ValueError(f"hashtable {name!r} differs between ranks (dim, dtype, slots, row shapes or "
                                     "slice size)")
                entry = tables.setdefault(name, {**t, **{k: 0 for k in counts[:3] if k in t}})
                for key in counts[:3]:
                    if key in t:
                        entry[key] += t[key]
                if "encoding" in t:  # the largest error of any rank
                    entry["encoding"] = {**t["encoding"], "max_abs_error": max(
                        entry["encoding"]["max_abs_error"], t["encoding"]["max_abs_error"])}
        dense = {}
        for desc in descriptions.values():
            if desc["dense"]:
                dense[desc["tensor"]] = {"dtype": desc["dtype"], "shape": desc["global_shape"]}
        file_index = {tensor_file_name(r, k): r * self.parallel + k
                      for r in range(self.shard_num) for k in range(self.parallel)}
        metadata = [(INDEX_FILE, dumps({"block_index": block_index, "file_index": file_index})),
                    (TENSORKEY_FILE, dumps(tensorkey)), (DESCRIPTION_FILE, dumps(descriptions))]
        version = version_for(tables, dense)
        if version < ROWS_VERSION:  # every row [dim] of the table's dtype: version 4, which older readers read
            for entry in tables.values():
                del entry["shape"], entry["slot_specs"]
        manifest = {"format": FORMAT, "format_version": version, "world_size": self.shard_num,
                    "parallel": self.parallel, "files": files, "tensors": dense, "hashtables": tables}
        if plan["kind"] == "delta":
            manifest.update(kind="delta", base=plan["base"], chain_length=plan["chain_length"])
        if any("encoding" in t for t in tables.values()) and self.quantize is not None:
            manifest["lossy"] = True
        return commit_directory(staging, final, metadata, manifest, overwrite=self.overwrite)


def _sweep(parent: Path) -> None:
    """Remove staging directories of failed saves: this process's, and any whose process is gone."""
    remove_stale_partials_in(parent)
