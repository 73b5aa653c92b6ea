"""Loading a tensor file into OpenCL device memory with one copy per file region, or none.

``load_file(path_or_tensorfile, queue, pool=pool)`` copies the file's tensor
data region straight from the memory mapping into one pooled device buffer
(an *arena*) with one ``enqueue_copy`` (regions above ``COPY_CHUNK`` bytes go
in 16 MiB commands, which pocl runs about 3x faster than one huge command);
each tensor is then a view ``(arena, payload offset - region start, shape,
dtype)``. No host copy is made and, when the pool already holds a fitting
arena (the same or a same-shaped model loaded before), no device memory is
allocated either. The command count, not the byte count, is what costs on
small tensors (tens of microseconds per command on pocl), which is why the
region is copied whole rather than tensor by tensor.

Paths a tensor can take (``LoadedTensors.report.paths``):

- ``"arena"``: a view into a pooled arena filled by one copy per region
  (per 16 MiB of it).
  Regions are split where a gap between tensors exceeds ``MERGE_GAP`` bytes
  (copying the gap would cost more than another command) or where one device
  allocation (``max_mem_alloc_size``) cannot hold more. A reader over several
  mapped files that offers ``parts()`` (the Hugging Face sharded directory,
  see :mod:`fastckpt.formats.contract`) gets one arena for all its files: one
  lease of the sum of the files' regions (each starting at a multiple of
  ``PART_ALIGN`` bytes), and one copy per file region (per 16 MiB of it) into
  its slice; a second arena starts only where one allocation cannot hold more.
- ``"zero-copy"`` (``zero_copy=True``, devices sharing host memory, such as
  pocl and integrated GPUs): a ``USE_HOST_PTR`` buffer over a copy-on-write
  mapping of the file. Nothing is copied or allocated; kernel writes stay in
  the private mapping and the file never changes. The buffer starts at the
  region start rounded down to the device's ``mem_base_addr_align`` (so the
  runtime need not copy), which any mapping allows when that alignment
  divides the page size.
- ``"buffer"``: without a pool, a buffer of exactly the tensor's size per
  tensor, one copy each (from its own file's mapping, for a reader with
  ``parts()``).
- ``"decoded"``: compressed (DEFLATE) members and Fortran-ordered arrays are
  decoded on the host and copied one by one; a :class:`NotZeroCopyWarning`
  says which. Every tensor of a reader that is not one mapped file (a
  TensorFlow checkpoint, a training-checkpoint directory, any other object of
  the reader contract :class:`~fastckpt.formats.contract.TensorReader` without
  ``parts()``) takes this path too: its ``host(name)`` array is copied.
- ``"empty"``: a tensor with no bytes (a view of length 0).

**Staging** (``staging=``; by default on devices whose ``host_unified_memory``
is false, discrete GPUs): the ``"arena"`` and ``"buffer"`` copies do not read
the mapping, which is pageable memory a driver must copy again before its DMA
engine can read it; threads fill pinned staging buffers (``ALLOC_HOST_PTR``,
``STAGING_CHUNK`` bytes each, mapped once and kept by the pool between loads,
see :class:`~fastckpt.device.pool.StagingBuffers`) from the mapping, running
ahead of the non-blocking copies that send each full buffer to the device
(:mod:`fastckpt.device.staging`, which also says how many threads and buffers
a load uses). The paths and the bytes are the same;
``report.staging_chunk`` says it happened.

Each path is one function (``_load_zero_copy``, ``_load_arenas`` or, for a
reader with ``parts()``, ``_load_part_arenas``, ``_load_buffers``,
``_load_decoded``, ``_load_empty``) that ``load_file`` calls in that order. Files written by ``np.savez`` can leave arena views starting
mid-element; :func:`realign` moves those into one more pooled arena.

SAFETY (keep-alive): a non-blocking copy reads the mapping after
``enqueue_copy`` returns, so the memoryview it reads is kept by pyopencl's
``NannyEvent`` and by every tensor filled by that copy until it is waited on;
the mapping cannot be unmapped earlier. With ``blocking=True`` every copy has
finished when ``load_file`` returns.

>>> import fastckpt, numpy as np                            # doctest: +SKIP
>>> from fastckpt.device.pool import PersistentBufferPool          # doctest: +SKIP
>>> dev = fastckpt.device.default()                         # doctest: +SKIP
>>> pool = PersistentBufferPool(dev.context, dev.queue)     # doctest: +SKIP
>>> model = load_file("model.safetensors", dev.queue, pool=pool)  # doctest: +SKIP
>>> model["w"].to_host()                                    # doctest: +SKIP
"""

from __future__ import annotations

import bisect
import functools
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Iterable, Iterator, NamedTuple

import numpy as np

from fastckpt._native.tensorindex import FLAG_DEFLATE, FLAG_FORTRAN_ORDER, FLAG_VIEWABLE
from fastckpt.device.context import shares_host_memory
from fastckpt.device.hugepages import host_address, madvise
from fastckpt.device.staging import (
    STAGING_CHUNK,
    STAGING_ROUND,
    Stager,
    batch_chunk,
    lease_staging,
    send_pinned,
    staging_chunk,
    staging_shape,
)
from fastckpt.device.tensor import Tensor, contiguous
from fastckpt.errors import NotZeroCopyWarning, TensorNotFoundError
from fastckpt.formats.contract import TensorReader
from fastckpt.formats.reader import TensorFile, guard
from fastckpt.formats.readinto import DIRECT_ALIGN, cached, open_direct, raise_if_changed, read_checked, same_file
from fastckpt.formats.remote import streamed_source
from fastckpt.store.remote import is_url
from fastckpt.progress import ProgressArg, progress_from, requested

if TYPE_CHECKING:
    import pyopencl as cl

    from fastckpt.device.pool import PersistentBufferPool

_log = logging.getLogger(__name__)

__all__ = ["load_file", "realign", "LoadedTensors", "LoadReport", "plan_regions", "MERGE_GAP",
           "COPY_CHUNK", "PART_ALIGN", "STAGING_CHUNK"]

# Regions are copied in commands of at most this many bytes (into one arena). On pocl a single huge
# copy runs about 3x slower than the same bytes in 4-16 MiB commands (measured: 512 MiB in 210 ms as
# one command, 72 ms in 16 MiB commands); each extra command costs only ~45 us. From a file that is not
# in the page cache, 16 MiB commands defeat the kernel's readahead: 512 MiB loaded cold in 8.1 s, against
# 0.40-0.44 s in 4 MiB commands, as fast as a plain read of the file (warm: 42-46 ms either way).
COPY_CHUNK = 4 * 1024 * 1024

# Largest gap between two payloads copied along with them rather than split into a second command:
# about what the device copies in the time one extra command costs (~45 us at ~12 GB/s on pocl).
MERGE_GAP = 512 * 1024

# Where each file's region starts in the one arena of a reader with parts(): a multiple of this many bytes (the
# alignment of fastckpt's safetensors data sections), so every tensor keeps the alignment it has in its file.
PART_ALIGN = 4096

# A pooled load on a device that shares host memory (pocl, integrated GPUs) reads a file that is not in the page
# cache (``mincore`` of COLD_SAMPLES pages of each region) straight from the file into its arenas, mapped for writing:
# ``O_DIRECT`` ``preadv`` of DIRECT_PIECE bytes from DIRECT_THREADS threads (fastckpt.formats.readinto), each
# region placed in its arena at an address that agrees with its file offset modulo DIRECT_ALIGN, its unaligned head
# and tail read through the page cache; every file of a Hugging Face directory at once. A direct read needs no page
# cache pages and no copy out of them: a third to a half of the CPU of copying from the mapping (docs/reading.md).
# A warm file (in the page cache) is copied from its mapping as before. False: always copied from the mapping.
DIRECT_READS = True
# Pages of a region mincore looks at to call it warm, each in the middle of one of COLD_SAMPLES equal parts: a file's
# first and last pages, and the first page of each NPZ member, are often cached by the open alone (the parser reads
# them), and the members of a model are often of one size, so samples at both ends and evenly spread from there
# found a cold .netcl file warm.
COLD_SAMPLES = 7

@dataclass
class LoadReport:
    """What one :func:`load_file` call did.

    ``mode`` is ``"pool"``, ``"per-tensor"`` or ``"zero-copy"``; ``paths`` maps
    each tensor to its path (see the module docstring); ``skipped`` lists the
    string tensors left out (they have no device form); ``file_reused`` says
    the pool still had the file open (mapped, index parsed); ``staging_chunk``
    is the size of the pinned staging buffers the copies went through (0: none,
    see ``load_file``'s ``staging``), ``staging_buffers`` how many, ``fill_threads``
    how many threads filled them (:mod:`fastckpt.device.staging`) and ``staging_fill`` the seconds during
    which one of them at least was writing; ``reads`` counts the ``preadv`` calls that read a cold file straight
    into the arenas (:data:`DIRECT_READS`) or into the staging buffers (0 where the bytes were copied from the
    mapping); ``timings`` holds
    seconds for ``open``, ``plan``, ``allocate``, ``copy`` and ``total``.

    >>> report = load_file("model.safetensors", pool=pool).report    # doctest: +SKIP
    >>> report.mode, report.copies, report.pool_misses, report.file_reused  # doctest: +SKIP
    ('pool', 1, 0, True)
    """

    path: str
    format: str
    mode: str
    tensors: int = 0
    regions: int = 0
    bytes_copied: int = 0
    copies: int = 0
    pool_hits: int = 0
    pool_misses: int = 0
    bytes_allocated: int = 0
    file_reused: bool = False
    paths: Mapping = field(default_factory=dict)
    skipped: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    staging_chunk: int = 0
    staging_buffers: int = 0
    fill_threads: int = 0
    staging_fill: float = 0.0
    reads: int = 0


class LoadedTensors(Mapping):
    """The tensors of one :func:`load_file` call: a read-only mapping name -> :class:`~fastckpt.device.tensor.Tensor`.

    Iteration follows the file's order. Views into a pooled arena are made on
    first access (about a microsecond each), so the load itself costs the same
    for 10 tensors or 10,000. The device memory stays valid while any of its
    tensors (or this object) is alive; pooled arenas then return to the pool by
    themselves. :meth:`release` returns them at once.

    >>> loaded = load_file("model.safetensors", pool=pool)   # doctest: +SKIP
    >>> loaded.report.copies, loaded.report.pool_misses       # doctest: +SKIP
    (1, 0)
    """

    def __init__(self, tensors: dict, report: LoadReport, leases: list, events: list,
                 names: tuple, index: dict | None = None, regions: list | None = None, queue=None):
        self._tensors = tensors  # materialised views
        self.report = report
        self._leases = leases
        self._events = events
        self._names = names
        # name -> (region number, TensorInfo) through .get (a dict or a _ColumnIndex), for views made on access
        self._index = index or {}
        self._regions = regions or []  # [buffer, region start, lease, pending event, source view]
        self._queue = queue
        for lease in leases:  # the pool names what holds its buffers once this result is gone (pool.stats)
            lease.held_by(self, report.path)
        for name, t in tensors.items():
            if t._owner is not None and hasattr(t._owner, "record_view"):
                t._owner.record_view(name, t)

    @property
    def path(self) -> str:
        return self.report.path

    def __getitem__(self, name: str) -> Tensor:
        t = self._tensors.get(name)
        if t is not None:
            return t
        try:
            entry = self._index.get(name)
        except TypeError:  # an unhashable name
            entry = None
        if entry is None:
            raise TensorNotFoundError(f"{self.report.path}: no tensor named {name!r} was loaded "
                                      f"({len(self._names)} loaded)")
        number, info = entry
        buffer, start, lease, event, keep = self._regions[number]
        t = Tensor._make(buffer, info.shape, info.dtype, info.offset - start, self._queue, lease)
        if event is not None:
            t._event, t._keepalive = event, keep
        t = self._tensors.setdefault(name, t)  # another thread may have made it first
        if lease is not None:
            lease.record_view(name, t)
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors or name in self._index

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data loaded."""
        return sum(self[name].nbytes for name in self._names)

    def wait(self) -> None:
        """Block until every copy of this load has finished (a no-op after a blocking load)."""
        events, self._events = self._events, []
        if events:
            _wait_all(events)
        for region in self._regions:
            region[3] = region[4] = None
        for t in list(self._tensors.values()):
            t.wait()

    def release(self) -> None:
        """Wait for pending copies, then return pooled memory to the pool now.

        Tensors of this load (including ones held elsewhere) must not be used afterwards:
        the next load may overwrite their memory.
        """
        self.wait()
        leases, self._leases = self._leases, []
        for lease in leases:
            lease.release()
        self._tensors, self._index, self._regions, self._names = {}, {}, [], ()

    def __enter__(self) -> "LoadedTensors":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        r = self.report
        return f"<LoadedTensors {r.path!r} tensors={len(self)} mode={r.mode} copies={r.copies}>"


def plan_regions(infos: Iterable, limit: int | None, merge_gap: int = MERGE_GAP) -> list[tuple[int, int, list]]:
    """Group payloads (sorted by offset, none empty) into ``(start, end, infos)`` regions for one copy each.

    A region ends where the next payload starts more than ``merge_gap`` bytes
    after it, or where including it would make the region longer than
    ``limit`` bytes (one device allocation). Splits fall on tensor boundaries.

    >>> from fastckpt.info import TensorInfo
    >>> ts = [TensorInfo(n, np.dtype("u1"), (4,), o, 4) for n, o in (("a", 100), ("b", 104), ("c", 120))]
    >>> [(s, e, [i.name for i in g]) for s, e, g in plan_regions(ts, limit=16)]
    [(100, 108, ['a', 'b']), (120, 124, ['c'])]
    """
    if not isinstance(infos, list):
        infos = list(infos)
    if not infos:
        return []
    # Fast path (the usual file): payloads back to back, the whole span fits in one allocation.
    start = infos[0].offset
    end = start
    for info in infos:
        if info.offset - end > merge_gap:
            break
        hi = info.offset + info.nbytes
        if hi > end:
            end = hi
    else:
        if limit is None or end - start <= limit:
            return [(start, end, infos)]
    regions: list[tuple[int, int, list]] = []
    start = end = -1
    group: list = []
    for info in infos:
        lo, hi = info.offset, info.offset + info.nbytes
        if limit is not None and hi - lo > limit:
            raise ValueError(
                f"tensor {info.name!r} has {info.nbytes} bytes, more than one device allocation may hold "
                f"(max_mem_alloc_size = {limit}); it cannot be loaded on this device"
            )
        if group and lo - end <= merge_gap and (limit is None or max(end, hi) - start <= limit):
            group.append(info)
            end = max(end, hi)
            continue
        if group:
            regions.append((start, end, group))
        start, end, group = lo, hi, [info]
    if group:
        regions.append((start, end, group))
    return regions


def _column_regions(offsets: np.ndarray, nbytes: np.ndarray, limit: int | None, name_of) -> list | None:
    """:func:`plan_regions` over columns: ``[(start, end, slice of the tensors)]`` for payloads sorted by offset
    (``offsets``, ``nbytes``: int64, none empty); ``name_of(k)`` names tensor ``k`` in an error.

    None where payloads overlap (:func:`plan_regions` then decides). Without overlaps a region's end is its last
    payload's end, so the splits are where a gap exceeds ``MERGE_GAP`` and, greedily, where a region would exceed
    ``limit``: the regions ``plan_regions`` makes.

    >>> [(s, e, g) for s, e, g in _column_regions(np.array([100, 104, 120]), np.array([4, 4, 4]), 16, str)]
    [(100, 108, slice(0, 2, None)), (120, 124, slice(2, 3, None))]
    """
    n = len(offsets)
    if n == 0:
        return []
    ends = offsets + nbytes
    if n > 1 and (offsets[1:] < ends[:-1]).any():
        return None
    bounds = [0, *(np.flatnonzero(offsets[1:] - ends[:-1] > MERGE_GAP) + 1).tolist(), n]
    regions = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        start, end = int(offsets[lo]), int(ends[hi - 1])
        if limit is None or end - start <= limit:
            regions.append((start, end, slice(lo, hi)))
            continue
        big = np.flatnonzero(nbytes[lo:hi] > limit)
        if big.size:
            k = lo + int(big[0])
            raise ValueError(
                f"tensor {name_of(k)!r} has {int(nbytes[k])} bytes, more than one device allocation may hold "
                f"(max_mem_alloc_size = {limit}); it cannot be loaded on this device"
            )
        while lo < hi:  # as many payloads as fit in one allocation, then the next region
            start = int(offsets[lo])
            cut = lo + int(np.searchsorted(ends[lo:hi], start + limit, side="right"))
            regions.append((start, int(ends[cut - 1]), slice(lo, cut)))
            lo = cut
    return regions


class _ColumnView(NamedTuple):
    """What a view is made from: the tensor's shape, dtype and payload offset (a ``TensorInfo`` has them too)."""

    shape: tuple
    dtype: np.dtype
    offset: int


class _ColumnIndex:
    """name -> ``(region number, shape/dtype/offset)`` for the arena views of a plan made from the columns, on access.

    Nothing per tensor is built at load time: the name -> position dict is made at the first look-up, the shape and
    dtype come from copies of the index's columns (this holds no reference to the index, so it never keeps the file
    mapped), and a payload's region is the last one starting at or before its offset (regions are disjoint, by
    offset). Tensors that are not in an arena (decoded, empty) are not found here; the load made those already.
    """

    __slots__ = ("names", "order", "offsets", "direct", "columns", "odd", "starts", "positions", "made")

    def __init__(self, names: tuple, order, offsets, direct, columns: dict, odd: dict, starts: list):
        self.names = names  # by offset
        self.order = order  # index position of each name (None: the same)
        self.offsets = offsets  # by offset
        self.direct = direct  # by offset: copied into an arena
        self.columns = columns  # TensorIndex.columns(), in index order (dtype codes and shapes used)
        self.odd = odd  # name -> TensorInfo where the columns hold no shape
        self.starts = starts
        self.positions = None
        self.made: dict = {}  # name -> (region number, _ColumnView), for the tensors viewed so far

    def get(self, name, default=None):
        # An entry made once is kept (this index lives as long as the plan, across the loads of one open file):
        # reading the columns costs ~2 us a tensor in numpy scalar indexing, more than the view itself, so a warm
        # load's views cost a dict look-up each.
        entry = self.made.get(name)
        if entry is not None:
            return entry
        positions = self.positions
        if positions is None:
            positions = self.positions = dict(zip(self.names, range(len(self.names))))
        k = positions.get(name)
        if k is None or not self.direct[k]:
            return default
        view = self.odd.get(name)
        if view is None:
            i = k if self.order is None else int(self.order[k])
            c = self.columns
            at = c["shape_at"]
            view = _ColumnView(tuple(c["dims"][at[i]:at[i + 1]].tolist()), c["dtypes"][c["dtype_codes"][i]],
                               int(self.offsets[k]))
        entry = self.made[name] = (bisect.bisect_right(self.starts, view.offset) - 1, view)
        return entry

    def __contains__(self, name) -> bool:
        return self.get(name) is not None


def _wait_all(events) -> None:
    import pyopencl as cl

    cl.wait_for_events(events)


def _open(source, copy_on_write: bool, pool=None, storage_options: dict | None = None):
    """``(reader, close_after, kept_by_pool)`` for a path, a URL or an open reader of the contract."""
    from fastckpt.formats import reader

    if isinstance(source, str) and "://" in source and is_url(source):
        # Object storage: the index only; the payloads stream into the destinations (_stream_region)
        from fastckpt.formats.remote import open_streamed

        return open_streamed(source, storage_options=storage_options), True, False
    if storage_options is not None:
        raise ValueError(f"storage_options is for URLs (s3://...), not {source!r}")
    if isinstance(source, (str, os.PathLike)):
        if pool is not None and not copy_on_write:
            tf = pool.files.get(source)
            if tf is not None:
                return tf, False, True
            tf = reader.open(source, first_window=False)  # a cold file is read with O_DIRECT, not its window
            # Only mapped files are kept: their identity is the one file a stat can check.
            return tf, not (isinstance(tf, TensorFile) and pool.files.put(source, tf)), False
        return reader.open(source, copy_on_write=copy_on_write), True, False
    # TensorFile first: a runtime Protocol check costs ~15 us, a class check ~0.05 us (a model load makes one).
    if not isinstance(source, TensorFile) and not isinstance(source, TensorReader):
        raise TypeError(f"load_file needs a path or an open fastckpt.TensorFile or other reader of the contract "
                        f"fastckpt.formats.contract.TensorReader, got {type(source).__name__}")
    if copy_on_write and isinstance(source, TensorFile) and not source.mapped.copy_on_write:
        # USE_HOST_PTR lets kernels write into the mapping: it must be private, never the read-only one.
        return reader.open_file(source.path, backend=source.mapped.backend, copy_on_write=True), True, False
    return source, False, False


class _Plan:
    """What to load from one open reader for one ``names`` selection: computed once per reader and reused.

    A mapped file (:class:`~fastckpt.formats.reader.TensorFile`) is planned by payload offset, for region copies:
    a whole file from its index's columns (numpy arrays of offsets and lengths; a ``TensorInfo`` is made only for
    the few tensors that are not copied whole, and for the others when a view is asked for), a selection from its
    infos. A reader with ``parts()`` is planned likewise, file by file (``parts``: ``[(mapped file, infos by
    offset)]``); any other reader of the contract has every tensor decoded through ``host(name)``, in ``keys()``
    order.
    """

    __slots__ = ("mapped", "parts", "selected", "count", "names", "_direct", "decoded", "empty", "skipped", "_arena",
                 "_infos", "_direct_offsets", "_direct_nbytes", "_direct_at", "_payload", "_columns")

    def __init__(self, tf, names):
        self.mapped = isinstance(tf, TensorFile)
        self.parts = None
        self._arena = None
        self._infos = None  # the file's columnar index, for a plan made from its columns
        self._payload = None
        if self.mapped and names is None and hasattr(tf.infos, "columns") and self._from_columns(tf.infos):
            return
        parts = None if self.mapped else _parts_of(tf)
        self.selected, self.skipped = _select(tf, names, self.mapped)
        self.count = len(self.selected)
        self.names = tuple(i.name for i in self.selected)
        self._direct, self.decoded, self.empty = [], [], []
        if parts is not None:
            part_of = {name: number for number, (_file, part_names) in enumerate(parts) for name in part_names}
            by_part: list[list] = [[] for _ in parts]
        for info in self.selected:
            if info.packed is not None:
                _refuse_packed(tf.path, info)
            if not self.mapped:
                if info.size == 0:
                    self.empty.append(info)
                elif parts is not None and info.name in part_of and info.compression is None \
                        and not info.fortran_order:
                    by_part[part_of[info.name]].append(info)
                    self._direct.append(info)
                else:
                    self.decoded.append(info)
            elif info.compression is not None or info.fortran_order:
                self.decoded.append(info)
            elif info.nbytes == 0:
                self.empty.append(info)
            else:
                self._direct.append(info)
        if parts is not None:
            self.parts = [(file.mapped, sorted(infos, key=lambda i: i.offset))
                          for (file, _names), infos in zip(parts, by_part) if infos]

    def _from_columns(self, infos) -> bool:
        """Plan every tensor of a mapped file from the columns of its index (``TensorIndex.columns``).

        The same plan as the general one (tensors by offset, a stable sort; compressed and Fortran-ordered ones
        decoded, empty ones empty, the rest copied), without a ``TensorInfo`` per tensor. False, with nothing set,
        where an offset does not fit the columns (the general plan then decides).
        """
        columns = infos.columns()
        offsets, nbytes, flags = columns["offsets"], columns["nbytes"], columns["flags"]
        all_names = list(infos)
        viewable = (flags & FLAG_VIEWABLE) != 0
        payload = int(nbytes[viewable].sum())  # viewable: the stored length is size * itemsize
        odd = {}  # name -> TensorInfo where the columns are left empty (compressed members, odd shapes)
        for i in np.flatnonzero(~viewable).tolist():
            info = odd[all_names[i]] = infos[all_names[i]]
            if info.packed is not None:
                _refuse_packed(infos.mapped.path, info)
            if not (0 <= info.offset < 1 << 62 and 0 <= info.nbytes < 1 << 62):
                return False
            offsets[i], nbytes[i] = info.offset, info.nbytes
            payload += _payload(info)
        order = None
        if len(offsets) > 1 and (offsets[1:] < offsets[:-1]).any():
            order = np.argsort(offsets, kind="stable")  # regions need file order
            offsets, nbytes, flags = offsets[order], nbytes[order], flags[order]
            all_names = [all_names[i] for i in order.tolist()]
        decoded = (flags & (FLAG_DEFLATE | FLAG_FORTRAN_ORDER)) != 0
        empty = ~decoded & (nbytes == 0)
        direct = ~(decoded | empty)
        self._infos = infos
        self._columns = (order, offsets, direct, columns, odd)
        self.selected, self.skipped = None, []
        self.count = len(all_names)
        self.names = tuple(all_names)
        self.decoded = [infos[all_names[k]] for k in np.flatnonzero(decoded).tolist()]
        self.empty = [infos[all_names[k]] for k in np.flatnonzero(empty).tolist()]
        self._direct = None  # the infos, made when a path needs them (see direct)
        self._direct_at = None if direct.all() else np.flatnonzero(direct)  # positions in names; None: all
        self._direct_offsets = offsets if self._direct_at is None else offsets[self._direct_at]
        self._direct_nbytes = nbytes if self._direct_at is None else nbytes[self._direct_at]
        self._payload = payload
        return True

    @property
    def direct(self) -> list:
        """The infos of the tensors copied from a mapping, by offset (made here for a plan from the columns)."""
        direct = self._direct
        if direct is None:
            at = range(self.count) if self._direct_at is None else self._direct_at.tolist()
            infos, names = self._infos, self.names
            direct = self._direct = [infos[names[k]] for k in at]
        return direct

    @property
    def n_direct(self) -> int:
        return len(self._direct_offsets) if self._infos is not None else len(self._direct)

    def direct_names(self) -> list:
        if self._infos is not None:
            return list(self.names) if self._direct_at is None else [self.names[k] for k in self._direct_at.tolist()]
        return [i.name for i in self._direct]

    def direct_bytes(self) -> int:
        """The stored bytes of the tensors copied from a mapping."""
        if self._infos is not None:
            return int(self._direct_nbytes.sum())
        return sum(i.nbytes for i in self._direct)

    def payload_bytes(self) -> int:
        """Bytes of every selected tensor in device memory (what progress counts)."""
        if self._payload is None:
            self._payload = sum(_payload(i) for i in self.selected)
        return self._payload

    def group(self, group) -> list:
        """A region's infos: the region's own list, or the slice of ``direct`` that a plan from the columns names."""
        return self.direct[group] if isinstance(group, slice) else group

    def arena(self, limit) -> tuple:
        """``(regions, name index, report paths or None)`` for pooled arenas, cached per allocation limit.

        ``regions`` is ``[(start, end, group)]``; ``group`` is the region's infos, or (a plan from the columns) the
        slice of ``direct`` holding them (see :meth:`group`), and the index then a :class:`_ColumnIndex`.
        Replaced as one tuple, so threads loading through pools with different limits never mix parts.
        """
        arena = self._arena
        if arena is None or arena[0] != limit:
            regions = None
            if self._infos is not None:
                regions = _column_regions(self._direct_offsets, self._direct_nbytes, limit,
                                          lambda k: self.direct_names()[k])
            if regions is None:
                regions = plan_regions(self.direct, limit)
                index = {info.name: (number, info) for number, (_, _, group) in enumerate(regions) for info in group}
                names = index
            else:
                index = _ColumnIndex(self.names, *self._columns, [start for start, _end, _group in regions])
                names = self.names
            paths = None if self.decoded or self.empty else MappingProxyType(dict.fromkeys(names, "arena"))
            arena = self._arena = (limit, regions, index, paths)
        return arena[1:]

    def part_arenas(self, limit) -> tuple:
        """``(arenas, name index, report paths or None)`` for a reader with ``parts()``, cached per limit.

        ``arenas`` is ``[(size, [(mapped file, start, end, slice offset), ...]), ...]``: the regions of every file
        (``plan_regions`` of each), packed in file order into as few arenas as one allocation (``limit``) allows,
        each at a multiple of ``PART_ALIGN``; the index numbers the regions in that order, across arenas.
        """
        arena = self._arena
        if arena is None or arena[0] != limit:
            arenas: list[tuple[int, list]] = []
            slices: list = []
            index: dict = {}
            size = number = 0
            for mapped, infos in self.parts:
                for start, end, group in plan_regions(infos, limit):
                    at = -(-size // PART_ALIGN) * PART_ALIGN
                    if slices and limit is not None and at + (end - start) > limit:
                        arenas.append((size, slices))
                        slices, at = [], 0
                    for info in group:
                        index[info.name] = (number, info)
                    slices.append((mapped, start, end, at))
                    size = at + (end - start)
                    number += 1
            if slices:
                arenas.append((size, slices))
            paths = None if self.decoded or self.empty else MappingProxyType(dict.fromkeys(index, "arena"))
            arena = self._arena = (limit, arenas, index, paths)
        return arena[1:]


def _parts_of(reader) -> list | None:
    """The reader's ``parts()`` as ``[(TensorFile, names)]``, or None when it has none (or they are not mapped files)."""
    method = getattr(reader, "parts", None)
    if not callable(method):
        return None
    parts = list(method())
    if not all(isinstance(file, TensorFile) for file, _names in parts):
        return None
    return parts


# Plans of open files, keyed by id(file) and the selection; dropped when the file object goes.
_plans: dict[tuple, tuple] = {}
_plans_lock = threading.Lock()


def _plan_for(tf, names: tuple | None) -> _Plan:
    key = (id(tf), names)
    entry = _plans.get(key)
    if entry is not None and entry[0]() is tf:
        return entry[1]
    plan = _Plan(tf, names)
    try:
        ref = weakref.ref(tf, lambda _r, key=key: _plans.pop(key, None))
    except TypeError:  # a file object that takes no weak references: plan every time
        return plan
    with _plans_lock:
        _plans[key] = (ref, plan)
    return plan


def _refuse_packed(path, info) -> None:
    """A packed sub-byte tensor has no device form here: say which, and the way to the rest of the file."""
    from fastckpt.arrays import PackedTypeError

    raise PackedTypeError(
        f"{path}: tensor {info.name!r} is packed {info.packed} ({info.bits}-bit elements, logical shape "
        f"{list(info.shape)}, {info.nbytes} stored bytes), which the OpenCL pool cannot place (device buffers hold "
        "types of a byte or more); load the other tensors with names=[...], and read this one with "
        "fastckpt.open(path).host(name) (a PackedArray: .unpack() widens F4 to ml_dtypes.float4_e2m1fn)")


def _select(tf, names, by_offset: bool) -> tuple[list, list]:
    """``(infos to load, string tensors left out)``: by payload offset for a mapped file, else in keys() order.

    String tensors (``object`` dtype: TensorFlow's DT_STRING) have no device form: left out of a whole-reader
    load, a ``TypeError`` when named.
    """
    if names is None:
        infos = tf.infos.values()
        if by_offset:
            return sorted(infos, key=lambda i: i.offset), []  # regions need file order
        chosen = [i for i in infos if i.dtype.kind != "O"]
        skipped = [i.name for i in infos if i.dtype.kind == "O"] if len(chosen) < len(tf.infos) else []
        return chosen, skipped
    if isinstance(names, str):
        raise TypeError("names must be a list of tensor names, not a single string")
    seen = set()
    chosen = []
    for name in names:
        if name in seen:
            continue
        seen.add(name)
        info = tf.infos.get(name)
        if info is None:
            info = tf.info(name)  # raises the reader's TensorNotFoundError, naming close matches
        chosen.append(info)
    strings = [i.name for i in chosen if i.dtype.kind == "O"]
    if strings:
        raise TypeError(f"{tf.path}: string tensors cannot be loaded into device memory: "
                        f"{', '.join(map(repr, strings[:8]))}; leave them out of names")
    if by_offset:
        chosen.sort(key=lambda i: i.offset)
    else:
        order = {name: i for i, name in enumerate(tf.infos)}
        chosen.sort(key=lambda i: order[i.name])
    return chosen, []


def load_file(source: str | os.PathLike[str] | TensorReader, queue: cl.CommandQueue | None = None, *,
              pool: PersistentBufferPool | None = None, zero_copy: bool = False, names: Iterable[str] | None = None,
              blocking: bool = True, progress: ProgressArg = False,
              staging: bool | int | None = None, storage_options: dict | None = None) -> LoadedTensors:
    """Load the tensors of a tensor file, or of any reader of the contract, into device memory.

    ``source`` is a path (opened with :func:`fastckpt.open`) or an open reader:
    a :class:`fastckpt.TensorFile` (reusing one skips parsing the index again; a
    pool also keeps the last few files loaded through it open, revalidated
    with ``os.stat`` on each load, see :class:`~fastckpt.device.pool.OpenFiles`) or
    any other object of the reader contract
    (:class:`~fastckpt.formats.contract.TensorReader`: a
    :class:`fastckpt.tf.CheckpointReader`, a
    :class:`fastckpt.train.directory.CheckpointDirectory`, ...). A mapped NPZ or
    safetensors file takes the one-copy paths below, and so does a reader over
    several mapped files that offers ``parts()`` (a Hugging Face sharded
    directory, :class:`~fastckpt.formats.hfsharded.HFShardedDirectory`: with a
    pool, all its files go into one arena, one copy per file region;
    ``zero_copy`` does not apply to it); any other reader's
    tensors are read with its ``host(name)`` and copied one by one (the
    ``"decoded"`` path, with a :class:`~fastckpt.errors.NotZeroCopyWarning`),
    in its ``keys()`` order; its string tensors (TensorFlow's object graph, for
    one) have no device form and are left out (``report.skipped``), or are a
    ``TypeError`` when named. Readers passed in are not closed. ``queue`` defaults to the pool's queue, else
    :func:`fastckpt.device.default`'s. With ``pool`` (a
    :class:`~fastckpt.device.pool.PersistentBufferPool`) the file's data region is
    copied with one command into an arena; without, each tensor gets its own
    exact-size buffer. ``zero_copy=True`` maps the file copy-on-write and uses
    it as device memory where the device shares host memory (else a
    :class:`~fastckpt.errors.NotZeroCopyWarning` and a normal copy).
    ``names`` loads only those tensors. ``blocking=False`` returns while copies
    may still run: each tensor waits for its copy before it is read
    (:meth:`LoadedTensors.wait` waits for all; copies still running after
    ``load_file`` returns read the mapping unguarded, so a file truncated
    then is SIGBUS, as for any mapping: ``blocking=True``, ``staging=True``
    or ``backend="pread"`` files avoid it). ``progress`` (``True`` for a
    bar, or ``callback(done, total, item)``: :mod:`fastckpt.progress`) counts
    the tensors' bytes as their copies complete (as they are queued when
    ``blocking=False``). ``staging`` says whether the copies from a mapping go
    through pinned staging buffers (``ALLOC_HOST_PTR``, of ``STAGING_CHUNK``
    bytes, or of the load's size rounded up to ``STAGING_ROUND`` when smaller;
    kept by the pool for the next load), filled from the file by several
    threads ahead of the copies to the device
    (:mod:`fastckpt.device.staging`): ``None``
    (the default) on devices whose ``host_unified_memory`` is false (discrete
    GPUs), ``True``/``False`` force it either way, an int forces it with
    chunks of that many bytes (``report.staging_chunk`` says what was used).
    Decoded tensors are copied from their host arrays, never staged.
    A URL (``s3://bucket/model.safetensors``, ``https://...``, a Hugging Face
    sharded prefix; any fsspec URL, with ``storage_options``) streams: only the
    index is fetched first, then parallel ranged reads go straight into the
    pooled arena or each tensor's buffer (:mod:`fastckpt.formats.stream`: no
    temporary file, no copy of the whole object, at most ``THREADS x CHUNK``
    bytes held; on a discrete device the pooled pieces land in ``THREADS + 2``
    pinned staging buffers of ``CHUNK`` bytes from the pool, each sent on by
    one non-blocking copy; ``staging`` and ``zero_copy`` do not apply). Each
    load is logged at INFO on ``fastckpt.device.load`` (file, tensors, bytes,
    seconds, the paths taken and why any was slower).

    >>> import fastckpt, numpy as np, tempfile, os                     # doctest: +SKIP
    >>> p = os.path.join(tempfile.mkdtemp(), "m.safetensors")          # doctest: +SKIP
    >>> fastckpt.save_safetensors(p, {"w": np.arange(6, dtype=np.float32)})  # doctest: +SKIP
    >>> load_file(p)["w"].to_host()                                    # doctest: +SKIP
    array([0., 1., 2., 3., 4., 5.], dtype=float32)
    """
    t_start = time.perf_counter()
    queue = _queue_for(queue, pool)
    chunk = staging_chunk(staging, queue.device)
    if isinstance(names, str):
        raise TypeError("names must be a list of tensor names, not a single string")
    if names is not None:
        names = tuple(names)
    tf, opened, file_reused = _open(source, zero_copy, pool, storage_options)
    try:
        streamed = _streamed_objects(tf)
        if streamed:  # the bytes come from the store, through no mapping: nothing to stage or share
            chunk = 0
            if zero_copy:
                warnings.warn(NotZeroCopyWarning(f"{tf.path}: zero_copy=True needs a mapped file; a URL's tensors "
                                                 "stream into device buffers"), stacklevel=2)
                zero_copy = False
        t_open = time.perf_counter()
        plan = _plan_for(tf, names)
        report = LoadReport(path=tf.path, format=tf.format, mode="pool" if pool is not None else "per-tensor",
                            tensors=plan.count, file_reused=file_reused, skipped=list(plan.skipped))
        limit = _allocation_limit(queue.device, pool)
        load = _Load(queue, pool, tf, blocking, report)
        if requested(progress):
            load.progress = progress_from(progress, plan.payload_bytes(),
                                          f"load {os.path.basename(tf.path)}")
        t_plan = load.t_alloc = time.perf_counter()
        # Every copy out of the mappings below (staging fills, the runtime's copies, decoded host arrays) runs
        # under MappedFile.guard: a file truncated under the load is a FormatError, not SIGBUS.
        reading = guard(tf, "it into device memory")
        try:
            direct = plan.n_direct > 0
            if zero_copy and direct and plan.parts is not None:
                load.note(f"{tf.path}: zero_copy=True works on one mapped file, and this {tf.format} reader has "
                          f"{len(plan.parts)}; the tensors are copied instead")
            elif zero_copy and direct and _load_zero_copy(load, plan.direct, limit):
                direct = False
            if direct and chunk:
                load.stager = _stager(load, plan.direct_bytes(), chunk, explicit=not isinstance(staging, bool)
                                      and isinstance(staging, int))
                # A mapping this load made has none of its pages mapped yet: reading the file beats faulting them.
                load.stager.fresh = isinstance(source, (str, os.PathLike)) and not file_reused
            if direct and pool is not None:
                if plan.parts is not None:
                    _load_part_arenas(load, plan, limit)
                else:
                    _load_arenas(load, plan, limit)
            elif direct:
                if plan.parts is not None:
                    for mapped, infos in plan.parts:
                        _load_buffers(load, infos, mapped)
                else:
                    _load_buffers(load, plan.direct)
            if load.stager is not None:
                load.stager.lease()  # before the arenas' prefault threads hold the memory map (_Prefault's steps)
                for prefault in load.prefaults:
                    prefault.begin()
                load.stager.finish()
                report.copies += load.stager.copies
                report.reads += sum(load.stager.reads)
                report.staging_fill = load.stager.fill_seconds
                report.fill_threads = load.stager.threads
                report.staging_buffers = load.stager.stage.count  # leased by finish: a cold load's are more
            if plan.decoded:
                _load_decoded(load, plan.decoded)
            if plan.empty:
                _load_empty(load, plan.empty)
            _report_pending(load)
            for obj in streamed:  # a store without conditional reads: one object throughout?
                obj.check()
            if blocking and load.events:
                _wait_all(load.events)
                load.events = []
            reading.close()  # raises here, where the leases are still released below, if a file was truncated
        except BaseException:
            # Never leave a copy reading memory we are about to drop, nor a lease marked in use.
            if load.events:
                try:
                    _wait_all(load.events)
                except Exception:  # the original error is the one to report
                    pass
            for prefault in load.prefaults:
                prefault.stop()  # before the arenas go back to the pool
            for lease in load.leases:
                lease.release()
            raise
        finally:
            for prefault in load.prefaults:
                prefault.stop()
            if load.stager is not None:
                load.stager.close()  # after the error path waited for the copies reading the staging buffers
            load.progress.close()
            reading.close()
        t_end = time.perf_counter()
    finally:
        if opened:
            tf.close()  # views already taken keep the mapping alive

    report.paths = load.paths
    report.timings = {
        "open": t_open - t_start,
        "plan": t_plan - t_open,
        "allocate": load.t_alloc - t_plan,
        "copy": t_end - load.t_alloc,
        "total": t_end - t_start,
    }
    if _log.isEnabledFor(logging.INFO):
        _log_load(report)
    return LoadedTensors(load.tensors, report, load.leases, load.events, plan.names,
                         load.index if load.regions else None, load.regions, queue)


class _Load:
    """One :func:`load_file` call in progress: where its tensors go, and what each strategy has added so far.

    Every lease and every queued copy is recorded here as soon as it exists, so that the one error path
    in :func:`load_file` can wait for the copies and return the leases, wherever the load stopped.
    """

    __slots__ = ("queue", "pool", "tf", "mapped", "blocking", "report", "tensors", "paths", "leases", "events",
                 "regions", "index", "first_buffer", "t_alloc", "progress", "pending", "stager", "prefaults")

    def __init__(self, queue, pool, tf, blocking: bool, report: LoadReport):
        self.queue = queue
        self.pool = pool
        self.tf = tf
        self.mapped = tf.mapped if isinstance(tf, TensorFile) else None  # None: a reader read through host()
        self.blocking = blocking
        self.report = report
        self.tensors: dict = {}  # name -> Tensor made now (arena views are made on access instead)
        self.paths: Mapping = {}
        self.leases: list = []
        self.events: list = []  # copies not waited for yet
        self.regions: list = []  # arena regions for LoadedTensors: [buffer, start, lease, event, source view]
        self.index: dict | None = None  # name -> (region number, TensorInfo) of the arena regions
        self.first_buffer = None  # what empty tensors point into
        self.t_alloc = 0.0  # when allocating ended and copying began (for report.timings)
        self.progress = _NO_PROGRESS  # load_file's progress=, when asked for
        self.pending = None  # (event, bytes, tensor name): a copy reported once the next one is queued
        self.stager = None  # the Stager that copies from mappings go through, when staged
        self.prefaults: list = []  # threads making a staged load's new arenas present (_prefault_staged_arena)

    def note(self, message: str) -> None:
        """Record and warn that tensors took a slower path than asked for; called by a strategy function."""
        self.report.warnings.append(message)
        # 4: past note, the strategy function and load_file, to load_file's caller.
        warnings.warn(NotZeroCopyWarning(message), stacklevel=4)


_NO_PROGRESS = progress_from(False, None, "")


def _payload(info) -> int:
    """A tensor's bytes in device memory (``info.nbytes`` is the stored, maybe compressed, length)."""
    return info.size * info.dtype.itemsize


def _reported(load: _Load, event, nbytes: int, item: str) -> None:
    """Count ``nbytes`` (``item`` the last tensor in them) once the copy ``event`` has completed.

    A blocking load waits for each copy only after the next is queued, so the device always has one to run;
    ``blocking=False`` counts them as they are queued.
    """
    if not load.blocking or event is None:
        load.progress.advance(nbytes, item)
        return
    pending, load.pending = load.pending, (event, nbytes, item)
    if pending is not None:
        pending[0].wait()
        load.progress.advance(pending[1], pending[2])


def _report_pending(load: _Load) -> None:
    pending, load.pending = load.pending, None
    if pending is not None:
        pending[0].wait()
        load.progress.advance(pending[1], pending[2])


def _log_load(report: LoadReport) -> None:
    paths: dict = {}
    for path in report.paths.values():
        paths[path] = paths.get(path, 0) + 1
    taken = ", ".join(f"{count} {path}" for path, count in paths.items()) or "nothing"
    fallbacks = "".join(f"; fallback: {w}" for w in report.warnings)
    _log.info("loaded %s (%s): %d tensors, %d bytes copied in %.3f s, mode %s, paths: %s%s", report.path,
              report.format, report.tensors, report.bytes_copied, report.timings["total"], report.mode, taken,
              fallbacks)
    _log.debug("load of %s: %d regions, %d copies, pool %d hits / %d misses, %d bytes allocated, file reused: %s, "
               "timings %s, skipped %s", report.path, report.regions, report.copies, report.pool_hits,
               report.pool_misses, report.bytes_allocated, report.file_reused,
               {k: round(v, 6) for k, v in report.timings.items()}, report.skipped)


def _queue_for(queue, pool):
    """The queue to load with: ``queue``, else the pool's, else the default device's; checked against the pool."""
    if queue is None:
        queue = pool.queue if pool is not None and pool.queue is not None else None
    if queue is None:
        from fastckpt.device import default

        queue = default().queue
    if pool is not None and pool.context is not None and queue.context != pool.context:
        raise ValueError("the queue and the pool belong to different OpenCL contexts; make the pool with "
                         "PersistentBufferPool(queue.context, queue)")
    return queue


def _allocation_limit(device, pool) -> int:
    """The most bytes one buffer may hold: the device's ``max_mem_alloc_size``, lowered by the pool's bound."""
    limit = int(device.max_mem_alloc_size)
    if pool is not None and pool.max_alloc_size is not None:
        limit = min(limit, pool.max_alloc_size)
    return limit


def _lease(request, nbytes: int, report: LoadReport | None):
    """A lease from ``request`` (a pool's ``arena`` or ``allocate``), counted in ``report`` as a pool hit or miss."""
    lease = request(nbytes)
    if report is not None:
        if lease.hit:
            report.pool_hits += 1
        else:
            report.pool_misses += 1
            report.bytes_allocated += lease.size
    return lease


def _stager(load: _Load, total: int, chunk: int, explicit: bool = False) -> Stager:
    """The :class:`~fastckpt.device.staging.Stager` for ``total`` bytes of copies from mappings in chunks of ``chunk``
    bytes (a load smaller than one chunk gets buffers of its own size: pinning costs per byte; unless the caller
    named the chunk, :func:`~fastckpt.device.staging.batch_chunk` cuts a smaller load into enough batches for the
    copies to overlap the fill), its shape chosen from the machine
    (:func:`~fastckpt.device.staging.staging_shape`) and written into the report."""
    if explicit:
        chunk = min(chunk, -(-max(total, 1) // STAGING_ROUND) * STAGING_ROUND)
    else:
        chunk = batch_chunk(total, chunk)
    pool = load.pool
    shape = staging_shape(total, chunk, max_bytes=getattr(pool, "max_staging_bytes", None))
    reported = functools.partial(_reported, load) if load.progress.enabled else None
    stager = Stager(load.queue, pool, shape, load.events, load.blocking, reported)
    report = load.report
    report.staging_chunk, report.staging_buffers, report.fill_threads = shape.chunk, shape.buffers, shape.threads
    return stager


def _load_zero_copy(load: _Load, direct: list, limit: int) -> bool:
    """``"zero-copy"``: ``USE_HOST_PTR`` buffers over the copy-on-write mapping, one per region; nothing is copied.

    False (after a :class:`NotZeroCopyWarning`) when the device or the mapping does not allow it.
    """
    import pyopencl as cl

    device, mapped = load.queue.device, load.mapped
    reason = _zero_copy_obstacle(device, mapped)
    if reason is None:
        base_align = _base_align(device)
        address = mapped.address
        starts = [-1]
        if limit is None or base_align < limit:
            # Room for rounding each buffer start down to the alignment.
            regions = plan_regions(direct, limit - base_align + 1 if limit else None)
            starts = [s - ((address + s) % base_align) for s, _, _ in regions]
        if min(starts) < 0:
            reason = (f"the device needs buffers aligned to {base_align} bytes "
                      "(mem_base_addr_align) and the mapping cannot provide that")
    if reason is not None:
        load.note(f"{load.tf.path}: zero_copy=True but {reason}; the tensors are copied instead")
        return False
    load.report.mode = "zero-copy"
    queue, tensors, paths = load.queue, load.tensors, load.paths
    flags = cl.mem_flags.READ_WRITE | cl.mem_flags.USE_HOST_PTR
    for (start, end, group), astart in zip(regions, starts):
        # SAFETY: the buffer keeps the memoryview (and so the private mapping) alive.
        buffer = cl.Buffer(queue.context, flags, hostbuf=mapped.view(astart, end - astart))
        if load.first_buffer is None:
            load.first_buffer = buffer
        for info in group:
            tensors[info.name] = Tensor._make(buffer, info.shape, info.dtype, info.offset - astart, queue, None)
            paths[info.name] = "zero-copy"
        if load.progress.enabled:  # nothing to copy: the region is there as soon as its buffer is
            load.progress.advance(sum(_payload(i) for i in group), group[-1].name)
    load.report.regions = len(regions)
    return True


def _load_arenas(load: _Load, plan: _Plan, limit: int) -> None:
    """``"arena"``: one pooled arena per region, filled by one ``enqueue_copy`` per ``COPY_CHUNK`` of it.

    The tensors are views made on access (:meth:`LoadedTensors.__getitem__`), so this costs the same for
    10 tensors or 10,000.
    """
    regions, load.index, arena_paths = plan.arena(limit)
    report, mapped = load.report, load.mapped
    report.regions = len(regions)
    files = _direct_files(load, [(mapped, start, end) for start, end, _group in regions], limit,
                          max((end - start for start, end, _group in regions), default=0) + DIRECT_ALIGN)
    slack = DIRECT_ALIGN if files is not None else 0
    arenas = []
    for start, end, _group in regions:
        lease = _lease(load.pool.arena, end - start + slack, report)
        load.leases.append(lease)
        arenas.append(lease)
        _prefault_staged_arena(load, lease)
    load.t_alloc = time.perf_counter()
    if files is not None:
        _read_arenas(load, [(lease, [(mapped, start, end, 0)]) for (start, end, _g), lease in zip(regions, arenas)],
                     files, {id(mapped): plan.direct} if load.progress.enabled else None)
    else:
        progress = load.progress.enabled
        for (start, end, group), lease in zip(regions, arenas):
            _copy_region(load, mapped, start, end, lease, 0, plan.group(group) if progress else None)
    if arena_paths is not None:
        load.paths = arena_paths
    else:
        load.paths.update(dict.fromkeys(plan.direct_names(), "arena"))


def _load_part_arenas(load: _Load, plan: _Plan, limit: int) -> None:
    """``"arena"`` for a reader with ``parts()``: one pooled arena for every file's region (more only where one
    allocation cannot hold them all), each region copied into its slice by one ``enqueue_copy`` per ``COPY_CHUNK``.
    """
    arenas, load.index, arena_paths = plan.part_arenas(limit)
    report = load.report
    report.regions = sum(len(slices) for _size, slices in arenas)
    files = _direct_files(load, [(m, start, end) for _size, slices in arenas for m, start, end, _at in slices], limit,
                          max((size + DIRECT_ALIGN * len(slices) for size, slices in arenas), default=0))
    leases = []
    for size, slices in arenas:
        lease = _lease(load.pool.arena, size + (DIRECT_ALIGN * len(slices) if files is not None else 0), report)
        load.leases.append(lease)
        leases.append(lease)
        _prefault_staged_arena(load, lease)
    load.t_alloc = time.perf_counter()
    infos_of = {id(mapped): infos for mapped, infos in plan.parts} if load.progress.enabled else None
    if files is not None:
        _read_arenas(load, list(zip(leases, (slices for _size, slices in arenas))), files, infos_of)
    else:
        for (_size, slices), lease in zip(arenas, leases):
            for mapped, start, end, at in slices:
                group = None if infos_of is None else [i for i in infos_of[id(mapped)] if start <= i.offset < end]
                _copy_region(load, mapped, start, end, lease, at, group)
    if arena_paths is not None:
        load.paths = arena_paths
    else:
        load.paths.update(dict.fromkeys(plan.direct_names(), "arena"))


def _direct_files(load: _Load, ranges: list, limit: int | None, largest: int) -> dict | None:
    """``{id(mapped): (descriptor, O_DIRECT descriptor or None, mapped)}`` for the files of ``ranges`` (``(mapped,
    start, end)``, the load's regions) where the load reads them straight into its arenas (:data:`DIRECT_READS`): a
    pooled, unstaged load on a device that shares host memory, of a region not in the page cache,
    whose arenas with room for the alignment (``largest`` bytes, the largest) fit ``limit``; None otherwise (the
    copies go from the mappings). Each descriptor is the mapped file's path opened again, only where ``fstat`` shows
    that file (:func:`~fastckpt.formats.readinto.same_file`)."""
    if (not DIRECT_READS or load.stager is not None or not ranges
            or (limit is not None and largest > limit) or not shares_host_memory(load.queue.device)
            or any(streamed_source(mapped) is not None for mapped, _start, _end in ranges)):  # a URL's: streamed
        return None
    if all(mapped.address is not None and cached(mapped, start, end, COLD_SAMPLES, centred=True)
           for mapped, start, end in ranges):
        return None  # warm: a copy out of the page cache beats reading it again
    files: dict = {}
    for mapped, _start, _end in ranges:
        if id(mapped) in files:
            continue
        fd = same_file(mapped)
        if fd is None:
            for entry in files.values():
                _close_pair(entry)
            raise_if_changed(mapped, "reading it into device memory")
            return None  # no path to open again (bytes in memory), or not readable: copied from the mapping
        files[id(mapped)] = (fd, open_direct(mapped.path, mapped.identity), mapped)
    return files


def _close_pair(entry) -> None:
    for fd in entry[:2]:
        if fd is not None:
            os.close(fd)


def _read_arenas(load: _Load, arenas: list, files: dict, infos_of: dict | None = None) -> None:
    """Read every region of ``arenas`` (``[(lease, [(mapped, start, end, planned offset), ...])]``) from its file
    into its arena, mapped for writing: the regions packed in order, each where its address agrees with its file
    offset modulo ``DIRECT_ALIGN`` (``O_DIRECT`` reads of its whole blocks; the arena has ``DIRECT_ALIGN`` bytes of
    room per region for it, and every tensor is as aligned in memory as in its file); where that could break a
    tensor's alignment (a region or arena not 16-byte aligned), at the next multiple of ``PART_ALIGN``, read through
    the page cache. All regions of all files are read at once
    (:func:`~fastckpt.formats.readinto.read_into`). A file changed or truncated while read is a
    :class:`~fastckpt.errors.FormatError` naming it. With progress on, ``infos_of`` (``{id(mapped): its tensors}``)
    counts each tensor once every piece holding its bytes has been read (:class:`_Done`, from the reading threads)."""
    import pyopencl as cl

    queue, report = load.queue, load.report
    maps, pairs, placed = [], [], []
    try:
        for lease, slices in arenas:
            host, _event = cl.enqueue_map_buffer(queue, lease.buffer, cl.map_flags.WRITE_INVALIDATE_REGION, 0,
                                                 (lease.size,), np.uint8, is_blocking=True)
            maps.append(host)
            base = host.ctypes.data
            shift_ok = base % 16 == 0
            pos = 0  # the regions are packed in order, each with less than DIRECT_ALIGN bytes before it
            for mapped, start, end, _planned in slices:
                fd, direct, _m = files[id(mapped)]
                if direct is not None and shift_ok and start % 16 == 0:
                    at = pos + (start - base - pos) % DIRECT_ALIGN  # address = file offset mod DIRECT_ALIGN
                else:  # a multiple of PART_ALIGN, as planned: every tensor keeps the alignment it has in its file
                    at, direct = -(-pos // PART_ALIGN) * PART_ALIGN, None
                pos = at + (end - start)
                pairs.append((host[at:pos], start, fd, direct, mapped.path))
                placed.append((lease, start, end, at))
        done = None
        if infos_of is not None:
            counters = {files[key][2].path: _Done(load, infos) for key, infos in infos_of.items() if key in files}
            done = lambda path, offset, length: counters[path](offset, length)  # noqa: E731
        report.reads += read_checked(pairs, list(files.values()), load.tf.path, "reading it into device memory",
                                     done)
    finally:
        for host in maps:
            host.base.release(queue).wait()
        for entry in files.values():
            _close_pair(entry)
    for lease, start, end, at in placed:
        if load.first_buffer is None:
            load.first_buffer = lease.buffer
        report.bytes_copied += end - start
        load.regions.append([lease.buffer, start - at, lease, None, None])


def _copy_region(load: _Load, mapped, start: int, end: int, lease, at: int, group=None) -> None:
    """Copy bytes ``[start, end)`` of ``mapped`` to byte ``at`` of the lease's buffer, one command per ``COPY_CHUNK``,
    and record the region for the views (``LoadedTensors.__getitem__``: a tensor at file offset ``o`` of it is at
    ``o - (start - at)`` in the buffer). With progress on, ``group`` (the region's tensors by offset) is counted
    tensor by tensor as the commands that end them complete."""
    import pyopencl as cl

    queue, report, blocking = load.queue, load.report, load.blocking
    if load.first_buffer is None:
        load.first_buffer = lease.buffer
    remote = streamed_source(mapped)
    if remote is not None:
        _stream_region(load, remote, start, end, lease, at, group)
        return
    source_view = mapped.view(start, end - start, "tensor data region")
    if load.stager is not None:
        _stage_region(load, mapped, start, end, lease, at, group, source_view)
        return
    chunk_events = []
    counted = 0  # group[:counted] are reported
    for lo in range(0, end - start, COPY_CHUNK):
        hi = min(lo + COPY_CHUNK, end - start)
        chunk_events.append(cl.enqueue_copy(queue, lease.buffer, source_view[lo:hi], dst_offset=at + lo,
                                            is_blocking=False))
        load.events.append(chunk_events[-1])  # at once: an error below (a progress callback) still waits for it
        if load.progress.enabled and group:
            first = counted
            while counted < len(group) and group[counted].offset + group[counted].nbytes <= start + hi:
                counted += 1
            if counted > first:
                _reported(load, chunk_events[-1], sum(_payload(i) for i in group[first:counted]),
                          group[counted - 1].name)
    report.copies += len(chunk_events)
    report.bytes_copied += end - start
    event = chunk_events[0]
    if len(chunk_events) > 1 and not blocking:
        # One event for the whole region, also on out-of-order queues.
        event = cl.enqueue_marker(queue, wait_for=chunk_events)
    # Views are made on access (LoadedTensors.__getitem__); a pending copy travels with them.
    # SAFETY: while the copy may run, the region entry keeps source_view (and so the mapping) alive.
    load.regions.append([lease.buffer, start - at, lease, None if blocking else event,
                         None if blocking else source_view])


def _streamed_objects(tf) -> list:
    """The remote objects a reader's payloads stream from (:func:`fastckpt.formats.remote.open_streamed`)."""
    files = [f for f, _names in _parts_of(tf) or ()] or [tf]
    objects = [streamed_source(getattr(f, "mapped", None)) for f in files]
    return [o for o in objects if o is not None]


class _Done:
    """Counts the bytes of each tensor delivered by a stream's pieces (in any order, from any thread) and reports a
    tensor to the load's progress once all of its bytes are in place."""

    def __init__(self, load: _Load, infos):
        self.progress = load.progress if load.progress.enabled else None
        self.infos = sorted(infos, key=lambda i: i.offset) if self.progress is not None else []
        self.starts = [i.offset for i in self.infos]
        self.left = [i.nbytes for i in self.infos]
        self.lock = threading.Lock()

    def __call__(self, offset: int, length: int) -> None:
        if self.progress is None:
            return
        end = offset + length
        finished = []
        with self.lock:
            i = max(0, bisect.bisect_right(self.starts, offset) - 1)
            while i < len(self.infos) and self.starts[i] < end:
                info = self.infos[i]
                overlap = min(end, info.offset + info.nbytes) - max(offset, info.offset)
                if overlap > 0:
                    self.left[i] -= overlap
                    if self.left[i] == 0:
                        finished.append(info)
                i += 1
        for info in finished:
            self.progress.advance(_payload(info), info.name)


_PAGE = 4096
_PREFAULT = True
_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in writable, leaving their contents as they are
_PREFAULT_STEP = 8 << 20


class _Prefault:
    """Makes the pages of the writable array ``target`` (or of the ``nbytes`` of host memory at ``address``) present,
    in ``_PREFAULT_STEP`` steps from its start, on a thread of its own (``madvise(MADV_POPULATE_WRITE)``: no byte changes, so it may run under the writes that fill
    the array); where the kernel has no such advice it does nothing. ``begin=False`` waits for :meth:`begin`.
    :meth:`stop` ends it and waits for it."""

    def __init__(self, target: np.ndarray | None = None, *, address: int = 0, nbytes: int = 0, begin: bool = True):
        self.halt = threading.Event()
        self.steps = 0
        if target is not None:
            address, nbytes = target.ctypes.data, len(target)
        self.start = address + -address % _PAGE
        self.end = max(self.start, (address + nbytes) // _PAGE * _PAGE)
        self.thread = None
        self.madvise = madvise()
        if begin:
            self.begin()

    def begin(self) -> None:
        """Start the thread (once; not after :meth:`stop`, nor where there is nothing to do)."""
        if self.thread is None and not self.halt.is_set() and self.end - self.start >= _PREFAULT_STEP \
                and self.madvise is not None:
            self.thread = threading.Thread(target=self._run, name="fastckpt-prefault", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        fn = self.madvise
        # SAFETY: stop() is called before the array is unmapped, and the advice is only ever given inside it.
        for at in range(self.start, self.end, _PREFAULT_STEP):
            if self.halt.is_set() or fn(at, min(_PREFAULT_STEP, self.end - at) // _PAGE * _PAGE or _PAGE,
                                        _MADV_POPULATE_WRITE) != 0:
                return  # stopped, or advice this kernel does not take (EINVAL): the copies fault pages as before
            self.steps += 1

    def stop(self) -> None:
        self.halt.set()
        if self.thread is not None:
            self.thread.join()


def _prefault_staged_arena(load: _Load, lease) -> None:
    """A staged load on a device that shares host memory (pocl): the runtime's copies out of the pinned staging
    buffers are CPU copies into the arena, and into a new arena each one took a page fault and the kernel's zeroing
    of every fresh page it wrote (``clear_page_erms``). Those pages are made present on a thread of their own
    (:class:`_Prefault`) while the fills wait on the disk; the copies then only copy. Measured on a 512 MiB cold
    load (docs/reading.md). A pooled arena used before (a pool hit) has its pages already; nothing is done. The
    thread begins once the staging buffers are leased (``load_file``): each step holds the process's memory map
    locked while it zeroes 8 MiB, which the lease's allocations and advice wait for (a cold lease of 6 buffers took
    6-23 ms beside it, 0.6-1.6 ms without)."""
    if not _PREFAULT or lease.hit or load.stager is None or not shares_host_memory(load.queue.device):
        return
    address = host_address(load.queue, lease.buffer, lease.size)
    if address is not None:
        # SAFETY: the lease (and so the buffer's memory) is held by the load until after _Prefault.stop().
        load.prefaults.append(_Prefault(address=address, nbytes=lease.size, begin=False))


def _stream_region(load: _Load, remote, start: int, end: int, lease, at: int, group) -> None:
    """:func:`_copy_region` for a URL: bytes ``[start, end)`` of the object stream (parallel ranged reads,
    :meth:`~fastckpt.formats.stream.RemoteObject.stream`) straight into the lease's buffer at ``at``: on a device
    that shares host memory, into the mapped arena, each part of a response as it arrives; on a discrete device,
    into pinned staging buffers, each piece then sent by one non-blocking copy (:class:`_Landing`)."""
    import pyopencl as cl

    queue, buffer = load.queue, lease.buffer
    done = _Done(load, group or ())
    pieces: list = []
    if shares_host_memory(queue.device):
        # The arena is host memory: mapped, each part of the bodies is copied into it as it arrives (one copy).
        mapped, _event = cl.enqueue_map_buffer(queue, buffer, cl.map_flags.WRITE_INVALIDATE_REGION, at,
                                               (end - start,), np.uint8, is_blocking=True)
        # A new arena's pages are not there yet: a thread makes them while the first requests are in flight, so that
        # the loop's copies do not take a page fault each (a first load measured 0.4-0.9 s of faults for 512 MiB).
        prefault = _Prefault(mapped) if _PREFAULT else None
        try:
            def write(offset: int, data) -> None:
                mapped[offset - start:offset - start + len(data)] = np.frombuffer(data, np.uint8)
                done(offset, len(data))

            # A direct GET's body is read straight into the arena (stream.RemoteObject.get_into): one copy, from
            # the socket.
            write.place = lambda offset, n: mapped[offset - start:offset - start + n]  # type: ignore[attr-defined]
            write.placed = lambda offset, data: done(offset, len(data))  # type: ignore[attr-defined]
            remote.stream([(start, end)], write, parts=True)
        finally:
            if prefault is not None:
                prefault.stop()
            mapped.base.release(queue).wait()
            del mapped
        pieces.append(1)
    else:
        # A discrete device: the pieces land in pinned staging buffers (the pool's, as a staged load's) as they
        # arrive, and each full one goes to the device by one non-blocking copy while the next ones fill.
        landing = _Landing(load, [(start, end)], lambda lo, hi: [(buffer, at + lo - start, 0, hi - lo)], done)
        try:
            landing.stream(remote)
        finally:
            landing.close()
        pieces.extend(range(landing.copies))
        if not load.blocking and landing.events:
            event = cl.enqueue_marker(queue, wait_for=landing.events)
            # SAFETY: the region entry keeps the staging buffers (their mappings) alive until its copies are done.
            load.regions.append([buffer, start - at, lease, event, landing.stage_kept])
            load.report.copies += len(pieces)
            load.report.bytes_copied += end - start
            return
    load.report.copies += len(pieces)
    load.report.bytes_copied += end - start
    load.regions.append([buffer, start - at, lease, None, None])


class _Landing:
    """The pinned staging buffers that the pieces of a stream land in on a device that does not share host memory
    (:func:`_stream_region`, :func:`_stream_buffers`): ``stream.THREADS + 2`` buffers of ``stream.CHUNK`` bytes,
    leased from the pool (:meth:`~fastckpt.device.pool.PersistentBufferPool.staging`, the staged path's buffers),
    or made for the load where there is none (:func:`~fastckpt.device.staging.lease_staging`; then no more and no
    larger than the pieces need). Each request's body is written into the buffer its piece was given, part by part
    as it arrives (one copy, into pinned memory), and once the piece is whole it goes on by non-blocking copies
    (``enqueue_copy``, or the simulated link's: :func:`~fastckpt.device.staging.send_pinned`), one for each
    destination it covers (``sends(lo, hi)``: ``[(device buffer, offset there, offset in the piece, bytes)]``); a
    buffer is given to a new piece once the copies last sent from it have completed. At most ``THREADS`` pieces are
    being received at once, so two buffers or more are always free or on their way to the device: the stream fills
    some while the device copies others. Memory: the staging buffers, ``(THREADS + 2) x CHUNK`` bytes at most
    (80 MiB by default), a pool's kept by it for the next load."""

    def __init__(self, load: _Load, spans: list, sends, done):
        from fastckpt.formats import stream

        self.queue, self.sends, self.done = load.queue, sends, done
        self.chunk = stream.CHUNK
        self.pieces = [(lo, min(end, lo + self.chunk)) for start, end in spans for lo in range(start, end, self.chunk)]
        self.starts = [lo for lo, _hi in self.pieces]
        count, chunk = stream.THREADS + 2, self.chunk
        if load.pool is None:  # buffers made for this load alone: only what its pieces can use
            count = max(1, min(count, len(self.pieces)))
            chunk = max(1, max((hi - lo for lo, hi in self.pieces), default=1))
        self.stage = lease_staging(load.queue, load.pool, chunk, count)
        self.stage_kept = self.stage  # what a non-blocking load's region keeps alive
        self.free = list(range(self.stage.count))
        self.slot_of: dict = {}  # piece start -> staging buffer being filled
        self.lock = threading.Lock()
        self.load_events = load.events
        self.events: list = []
        self.copies = 0

    def stream(self, remote) -> None:
        def write(offset: int, data) -> None:
            self.write(offset, data)

        # A direct GET's body is read straight into the piece's staging buffer (stream.RemoteObject.get_into).
        write.place = self.place  # type: ignore[attr-defined]
        write.placed = lambda _offset, _data: None  # type: ignore[attr-defined]  # in its buffer: nothing to do
        remote.stream(self.pieces, write, chunk=self.chunk, done=self.send, parts=True)  # one piece a span

    def place(self, offset: int, n: int):
        """The staging memory where bytes ``[offset, offset + n)`` of the piece holding ``offset`` go."""
        piece = self.starts[bisect.bisect_right(self.starts, offset) - 1]
        return self.stage.hosts[self._slot(piece)][offset - piece:offset - piece + n]

    def _slot(self, piece: int) -> int:
        with self.lock:
            slot = self.slot_of.get(piece)
            if slot is not None:
                return slot
            slot = self.slot_of[piece] = self.free.pop(0)  # never empty: see the class docstring
            pending, self.stage.pending[slot] = self.stage.pending[slot], None
        if pending:
            _wait_all(pending)  # the copies last sent from it (this load's, or a previous one's from the pool)
        return slot

    def write(self, offset: int, data) -> None:
        self.place(offset, len(data))[:] = np.frombuffer(data, np.uint8)

    def send(self, lo: int, hi: int) -> None:
        with self.lock:
            slot = self.slot_of.pop(lo)
        host = self.stage.hosts[slot]
        # SAFETY: no piece is written into this buffer before these copies' events have completed (_slot).
        events = [send_pinned(self.queue, buffer, host[first:first + n], at) for buffer, at, first, n in
                  self.sends(lo, hi)]
        with self.lock:
            self.stage.pending[slot] = events
            self.events += events
            self.load_events += events
            self.copies += len(events)
            self.free.append(slot)
        self.done(lo, hi - lo)

    def close(self) -> None:
        """Return the staging buffers to the pool (with the events of the copies still reading them)."""
        stage, self.stage = self.stage, None
        if stage is not None:
            stage.release()


def _stream_buffers(load: _Load, direct: list, remote) -> None:
    """:func:`_load_buffers` for a URL: a buffer of exactly each tensor's size, all filled by one stream of parallel
    ranged reads over the tensors' merged byte ranges (a piece may end one tensor and start the next:
    :class:`~fastckpt.formats.stream.Scatter` puts each byte in its buffer). On a device that shares host memory each
    piece is copied into the buffers it covers as it arrives; on a discrete device it lands in pinned staging
    buffers and goes on by non-blocking copies (:class:`_Landing`), as a pooled load's pieces do."""
    import pyopencl as cl

    from fastckpt.formats.stream import Scatter

    report, queue = load.report, load.queue
    rw = cl.mem_flags.READ_WRITE
    done = _Done(load, direct)
    targets = []
    copies: list = []
    made = []

    def into(buffer, base: int):
        def write(at: int, data) -> None:
            cl.enqueue_copy(queue, buffer, data, dst_offset=at, is_blocking=True)
            copies.append(len(data))  # list.append is atomic: deliveries come from several threads
            done(base + at, len(data))
        return write

    for info in direct:
        buffer = cl.Buffer(queue.context, rw, max(1, info.nbytes))
        report.bytes_allocated += info.nbytes
        if load.first_buffer is None:
            load.first_buffer = buffer
        t = load.tensors[info.name] = Tensor._make(buffer, info.shape, info.dtype, 0, queue, None)
        load.paths[info.name] = "buffer"
        if info.nbytes:
            targets.append((info.offset, info.nbytes, into(buffer, info.offset)))
            made.append((info.offset, info.nbytes, buffer, t))
    scatter = Scatter(targets)
    if shares_host_memory(queue.device):
        remote.stream(scatter.spans(), scatter)
        report.copies += len(copies)
    else:
        made.sort(key=lambda m: m[0])
        starts = [m[0] for m in made]

        def sends(lo: int, hi: int) -> list:
            out = []
            i = max(0, bisect.bisect_right(starts, lo) - 1)
            while i < len(made) and made[i][0] < hi:
                start, nbytes, buffer, _t = made[i]
                first, last = max(lo, start), min(hi, start + nbytes)
                if first < last:
                    out.append((buffer, first - start, first - lo, last - first))
                i += 1
            return out

        landing = _Landing(load, scatter.spans(), sends, done)
        try:
            landing.stream(remote)
        finally:
            landing.close()
        report.copies += landing.copies
        if not load.blocking and landing.events:
            event = cl.enqueue_marker(queue, wait_for=landing.events)
            for _start, _n, _buffer, t in made:
                # SAFETY: the tensor keeps the staging buffers until its copies are waited for.
                t._event, t._keepalive = event, landing.stage_kept
    report.bytes_copied += sum(i.nbytes for i in direct)
    load.t_alloc = time.perf_counter()


def _read_ahead(mapped, start: int, end: int) -> None:
    """Ask the kernel to read ``[start, end)`` of ``mapped`` now (``madvise(WILLNEED)``: advice, so a failure changes
    nothing), in one call, which the kernel caps at its readahead window: advising all of it in steps
    (:func:`~fastckpt.formats.readinto.read_ahead`) before the copies measured slower for pooled loads
    (docs/reading.md)."""
    try:
        mapped.advise("willneed", start, end - start)
    except (OSError, ValueError, AttributeError):
        pass


def _stage_region(load: _Load, mapped, start: int, end: int, lease, at: int, group, source_view) -> None:
    """:func:`_copy_region` through the load's staging buffers (:mod:`fastckpt.device.staging`, which reads the bytes
    from the file where it can): a cold region's whole blocks with ``O_DIRECT``, any other region with the kernel
    asked to read it ahead of the fill (:func:`_read_ahead`; not a cold one, whose first window it read a second
    time through the page cache: 520 MiB from disk for a 512 MiB file)."""
    marks = () if not group else [(i.offset + i.nbytes - start, _payload(i), i.name) for i in group]
    fd = load.stager.file(mapped)
    # A cold region's whole blocks are read with O_DIRECT into the staging buffers (Stager._batches places them).
    direct = None if fd is None or not DIRECT_READS or mapped.address is None or \
        cached(mapped, start, end, COLD_SAMPLES, centred=True) else load.stager.direct(mapped)
    if direct is None:
        _read_ahead(mapped, start, end)
    load.stager.add(np.frombuffer(source_view, np.uint8), lease.buffer, at, marks,
                    None if fd is None else (fd, start, mapped.path, direct))
    load.report.bytes_copied += end - start
    # The copies read pinned memory, never the mapping: no source view to keep; a non-blocking load gets one event
    # for all of them (Stager.finish).
    region = [lease.buffer, start - at, lease, None, None]
    if not load.blocking:
        load.stager.regions.append(region)
    load.regions.append(region)


def _load_buffers(load: _Load, direct: list, mapped=None) -> None:
    """``"buffer"`` (no pool): a buffer of exactly each tensor's size, filled by one copy each (from ``mapped``,
    by default the loaded file's mapping)."""
    import pyopencl as cl

    report, queue, blocking = load.report, load.queue, load.blocking
    mapped = load.mapped if mapped is None else mapped
    remote = streamed_source(mapped)
    if remote is not None:
        _stream_buffers(load, direct, remote)
        return
    tensors, paths, events = load.tensors, load.paths, load.events
    ctx = queue.context
    rw = cl.mem_flags.READ_WRITE
    stager = load.stager
    for info in direct:
        buffer = cl.Buffer(ctx, rw, info.nbytes)
        report.bytes_allocated += info.nbytes
        source_view = mapped.view(info.offset, info.nbytes, f"tensor {info.name!r}")
        if stager is not None:
            fd = stager.file(mapped)
            stager.add(np.frombuffer(source_view, np.uint8), buffer, 0,
                       ((info.nbytes, info.nbytes, info.name),) if load.progress.enabled else (),
                       None if fd is None else (fd, info.offset, mapped.path))
            report.bytes_copied += info.nbytes
            if load.first_buffer is None:
                load.first_buffer = buffer
            t = tensors[info.name] = Tensor._make(buffer, info.shape, info.dtype, 0, queue, None)
            if not blocking:
                stager.tensors.append(t)  # Stager.finish gives it the event of the staged copies
            paths[info.name] = "buffer"
            continue
        event = cl.enqueue_copy(queue, buffer, source_view, is_blocking=False)
        events.append(event)
        report.copies += 1
        report.bytes_copied += info.nbytes
        if load.progress.enabled:
            _reported(load, event, info.nbytes, info.name)
        if load.first_buffer is None:
            load.first_buffer = buffer
        t = Tensor._make(buffer, info.shape, info.dtype, 0, queue, None)
        if not blocking:
            # SAFETY: the copy reads source_view after enqueue_copy returns; the tensor keeps it until waited on.
            t._event, t._keepalive = event, source_view
        tensors[info.name] = t
        paths[info.name] = "buffer"
    load.t_alloc = time.perf_counter()


def _load_decoded(load: _Load, decoded: list) -> None:
    """``"decoded"``: compressed or Fortran-ordered members, or every tensor of a reader that is not one mapped
    file, read on the host (``host(name)``) and copied one by one (with a warning)."""
    import pyopencl as cl

    tf, pool, report, queue, blocking = load.tf, load.pool, load.report, load.queue, load.blocking
    shown = ", ".join(repr(i.name) for i in decoded[:5]) + (", ..." if len(decoded) > 5 else "")
    if load.mapped is None and not all(i.compression or i.fortran_order for i in decoded):
        load.note(f"{tf.path}: the {len(decoded)} tensor(s) of this {tf.format} reader were read through its host() "
                  f"and copied one by one ({shown}); only a mapped NPZ or safetensors file is loaded with one copy "
                  "(fastckpt convert writes one)")
    else:
        kinds = sorted({"compressed (" + i.compression + ")" if i.compression else "Fortran-ordered"
                        for i in decoded})
        load.note(f"{tf.path}: {len(decoded)} tensor(s) are {' and '.join(kinds)} and were decoded on the host "
                  f"and copied one by one ({shown}); save with fastckpt.save_npz or save_safetensors "
                  "(stored, C order) for the one-copy path")
    for info in decoded:
        host = contiguous(tf.host(info.name))
        nbytes = host.nbytes
        if pool is not None:
            lease = _lease(pool.allocate, nbytes, report)
            load.leases.append(lease)
            buffer, owner = lease.buffer, lease
        else:
            buffer, owner = cl.Buffer(queue.context, cl.mem_flags.READ_WRITE, max(nbytes, 1)), None
            report.bytes_allocated += max(nbytes, 1)
        t = Tensor(buffer, host.shape, host.dtype, queue=queue, owner=owner)
        event = None
        if nbytes:
            event = cl.enqueue_copy(queue, buffer, host.reshape(-1).view(np.uint8), is_blocking=False)
            load.events.append(event)
            report.copies += 1
            report.bytes_copied += nbytes
            if not blocking:
                # SAFETY: the copy reads the decoded host array after enqueue_copy returns; the tensor keeps it.
                t._event, t._keepalive = event, host
        if load.progress.enabled:
            _reported(load, event, nbytes, info.name)
        if load.first_buffer is None:
            load.first_buffer = buffer
        load.tensors[info.name] = t
        load.paths[info.name] = "decoded"


def _load_empty(load: _Load, empty: list) -> None:
    """``"empty"``: tensors with no bytes, length-0 views of a buffer this load already made (or a 1-byte one)."""
    import pyopencl as cl

    if load.first_buffer is None:
        load.first_buffer = cl.Buffer(load.queue.context, cl.mem_flags.READ_WRITE, 1)
    owner = load.leases[0] if load.leases else None
    for info in empty:
        load.tensors[info.name] = Tensor._make(load.first_buffer, info.shape, info.dtype, 0, load.queue, owner)
        load.paths[info.name] = "empty"


def realign(tensors: dict, queue, pool, report: LoadReport | None = None) -> list[str]:
    """Move the tensors whose offset is not a multiple of their itemsize into one aligned pooled arena.

    Files written by ``np.savez`` put payloads at arbitrary offsets (2 or 3 mod 4 are common), so
    their arena views can start mid-element, and kernels, which index elements, cannot use them in
    place. Those tensors are replaced in ``tensors`` by views into one more pooled arena (each at a
    multiple of 256 bytes), filled by one device-side copy per tensor; the pool lease is counted in
    ``report``. Returns their names (none for fastckpt's own files, whose payloads are aligned).
    The copies that filled ``tensors`` must have finished (a blocking :func:`load_file`).
    """
    odd = [k for k, t in tensors.items() if t.nbytes and t.offset % t.dtype.itemsize]
    if not odd:
        return []
    import pyopencl as cl

    offsets, total = {}, 0
    for k in odd:
        offsets[k] = total
        total += -(-tensors[k].nbytes // 256) * 256
    lease = _lease(pool.arena, total, report)
    for k in odd:
        t = tensors[k]
        cl.enqueue_copy(queue, lease.buffer, t.buffer, byte_count=t.nbytes, src_offset=t.offset,
                        dst_offset=offsets[k])
        tensors[k] = Tensor(lease.buffer, t.shape, t.dtype, offset=offsets[k], queue=queue, owner=lease)
    # The copies read the old arena, which returns to the pool (and may be overwritten) once the
    # replaced tensors are dropped: finish them before anyone can drop those.
    queue.finish()
    return odd


def _base_align(device) -> int:
    """The alignment (bytes) the device wants for buffer base addresses (``mem_base_addr_align`` is in bits)."""
    return max(1, int(device.mem_base_addr_align) // 8)


def _zero_copy_obstacle(device, mapped) -> str | None:
    """Why a zero-copy load is impossible here, or None."""
    if not shares_host_memory(device):
        return f"the device {device.name.strip()!r} does not share host memory (host_unified_memory is false)"
    if mapped.address is None:
        return f"the file is not memory-mapped (backend={mapped.backend!r})"
    return None
