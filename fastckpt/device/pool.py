"""Device memory that outlives a load, so loading the same model again allocates nothing.

A :class:`PersistentBufferPool` keeps device buffers after the tensors using
them are gone and hands them to the next request that fits. Two kinds of
request share one store of buffers:

- **arenas** (:meth:`PersistentBufferPool.arena`): one allocation for a file's
  whole tensor-data region (rounded up by at most 1.6 %, :func:`arena_size`);
  the tensors are ``(buffer, offset)`` views into it.
  A later load takes the *best fitting* idle buffer (the smallest one at least
  as large as its region, wasting at most half of it), so reloading the same
  or a same-shaped model is a hit and costs no allocation.
- **single buffers** (:meth:`PersistentBufferPool.allocate`, and calling the
  pool, which is pyopencl's allocator protocol): sizes are rounded up to
  geometric size classes (eight per power of two: at most 12.5 % padding;
  256 bytes at least) so that buffers of nearly equal sizes are shared.

Buffers go back to the pool when the lease holding them is released or
garbage-collected (a ``weakref.finalize`` on the lease; a tensor that is a view
into an arena holds the lease as its owner). Buffers handed out through the
allocator protocol are plain ``pyopencl.Buffer`` objects, which cannot carry
weak references; the pool notices that they were dropped by their reference
count, at its next miss, :meth:`~PersistentBufferPool.collect` or ``stats``.

A buffer is reused only once every tensor viewing it is gone. When a
request misses although a buffer in use would have fit, ``stats.blocked_misses``
counts it and ``stats.last_blocked`` says why; when that buffer is held only by
a few tensors kept from an earlier load (its ``LoadedTensors`` dropped, one
``loaded["w"]`` kept: less than half of the buffer), the pool warns once (:class:`~fastckpt.errors.FastCkptWarning`)
naming the file and the tensors, since the new allocation makes that load
many times slower than a reuse.

Staging buffers: for devices that do not share host memory a load copies
through pinned host buffers (:class:`StagingBuffers`, leased with
:meth:`PersistentBufferPool.staging`); the pool keeps the last sets returned
(``STAGING_KEEP``), mapped, so the next load pins and maps nothing. They are
pinned host memory: ``max_bytes`` does not count them; ``stats.staging_bytes``
does (idle and leased sets), and ``max_staging_bytes`` bounds it: a staged load
through the pool sizes its set to fit (two buffers at least), and idle sets
beyond the bound are let go.

Files: a pool also keeps the last few files loaded through it open
(:class:`OpenFiles`, revalidated with ``os.stat`` on every load), so a reload
neither parses the index nor maps the file again.

Memory bounds: with ``max_bytes`` the pool evicts idle buffers, least recently
used first, to keep what it holds under the bound; a request that cannot fit
even then is still served (memory in use cannot be freed) and its buffer is
freed, not kept, when returned. An allocation that fails for lack of device
memory frees every idle buffer and is retried once; a second failure raises
``MemoryError`` saying how much was asked for and how much is held.

Thread safety: every public method may be called from any thread. Leases are
returned by finalizers, which can run inside any allocation, including one
the pool itself makes while it holds its lock; a finalizer therefore only
queues the return, and whoever holds (or next takes) the lock applies it. A
re-entrant lock would let the finalizer change the pool's lists in the middle
of an update, so the lock is deliberately not re-entrant.

>>> pool = PersistentBufferPool(None, allocator=lambda n: bytearray(n))
>>> with pool.allocate(1000) as lease:
...     lease.size
1024
>>> pool.allocate(1000).hit       # the same size class again: no allocation
True
>>> pool.stats.allocations
1
"""

from __future__ import annotations

import bisect
import os
import sys
import threading
import warnings
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable

from fastckpt.device.hugepages import is_oom

__all__ = ["PersistentBufferPool", "PoolBuffer", "PoolStats", "OpenFiles", "StagingBuffers", "size_class",
           "arena_size", "STAGING_KEEP", "MAX_STAGING_BYTES"]

MIN_CLASS = 256
# An idle buffer serves a single-buffer request up to this factor above its size class (borrowing from
# the next two classes), and an arena request up to twice the region.
_CLASS_SLACK = 1.25
_ARENA_SLACK = 2.0
# Idle sets of staging buffers a pool keeps (the smallest go first): one per thread loading at once is typical.
STAGING_KEEP = 2
# Pinned host memory a pool's staging buffers may hold by default (see max_staging_bytes): a 16-core host fills six
# 64 MiB buffers at once (fastckpt.device.staging.staging_shape), 384 MiB, which this leaves room for twice.
MAX_STAGING_BYTES = 1 << 30

def size_class(nbytes: int) -> int:
    """The size a single-buffer request of ``nbytes`` is rounded up to.

    Eight classes per power of two, so the padding is at most 12.5 % (and
    requests up to 256 bytes share one class).

    >>> [size_class(n) for n in (1, 256, 257, 1000, 4096, 4097, 10**6)]
    [256, 256, 288, 1024, 4096, 4608, 1048576]
    """
    if nbytes <= MIN_CLASS:
        return MIN_CLASS
    step = 1 << max(0, (nbytes - 1).bit_length() - 4)
    return (nbytes + step - 1) & -step


def arena_size(nbytes: int) -> int:
    """The size an arena for ``nbytes`` is allocated with: at most 1/64 (1.6 %) more, in 4 KiB steps.

    Finer than :func:`size_class`: arenas are large, and 12.5 % of a model is too much to waste.

    >>> [arena_size(n) for n in (1, 4096, 4097, 10**6, 512 * 2**20 + 1)]
    [4096, 4096, 8192, 1007616, 545259520]
    """
    step = max(4096, 1 << max(0, (nbytes - 1).bit_length() - 7))
    return (max(nbytes, 1) + step - 1) // step * step


def _refs(obj) -> int:
    return sys.getrefcount(obj)


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of a pool's counters.

    ``hits``/``misses`` count requests served from held memory / by a new
    allocation; ``allocations`` and ``bytes_allocated`` count device
    allocations ever made; ``evictions`` counts idle buffers freed to respect
    ``max_bytes`` or after a failed allocation; ``bytes_held`` is what the pool
    owns now (``bytes_in_use`` + ``bytes_idle``). ``staging_allocations``
    counts pinned staging buffers ever allocated, ``staging_bytes`` the pinned
    host memory the pool's staging buffers hold now (idle or leased), which
    ``max_staging_bytes`` bounds. ``blocked_misses`` counts the misses that an
    in-use buffer would have served (the buffer of an earlier load, still
    held), and ``last_blocked`` says why for the last one: which file's load
    holds it, and which of its tensors are still alive.

    >>> pool = PersistentBufferPool(None, allocator=lambda n: bytearray(n))
    >>> pool.allocate(1000).release(); pool.allocate(1000).hit
    True
    >>> s = pool.stats
    >>> s.hits, s.misses, s.bytes_held, s.bytes_in_use, s.hit_rate
    (1, 1, 1024, 0, 0.5)
    """

    hits: int
    misses: int
    allocations: int
    bytes_allocated: int
    evictions: int
    bytes_held: int
    bytes_in_use: int
    bytes_idle: int
    buffers_held: int
    buffers_in_use: int
    max_bytes: int | None
    staging_allocations: int = 0
    staging_bytes: int = 0
    max_staging_bytes: int | None = None
    blocked_misses: int = 0
    last_blocked: str | None = None

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class _Block:
    """One device allocation owned by the pool."""

    __slots__ = ("raw", "size", "serial", "in_use", "lease")

    def __init__(self, raw, size: int, serial: int):
        self.raw = raw
        self.size = size
        self.serial = serial
        self.in_use = False
        self.lease: weakref.ref | None = None  # the lease holding it while in use


class PoolBuffer:
    """A lease on a pooled buffer: ``buffer`` is yours until :meth:`release` (or garbage collection).

    ``nbytes`` is what was asked for, ``size`` the buffer's real size (never
    less), ``hit`` whether it came from held memory.

    >>> pool = PersistentBufferPool(None, allocator=lambda n: bytearray(n))
    >>> lease = pool.allocate(10)
    >>> lease.nbytes, lease.size, lease.released
    (10, 256, False)
    >>> lease.release(); lease.released
    True
    """

    __slots__ = ("buffer", "nbytes", "size", "hit", "_block", "_finalizer", "_base_refs", "_views", "_result",
                 "__weakref__")

    def __init__(self, pool: "PersistentBufferPool", block: _Block, nbytes: int, hit: bool):
        self.buffer = block.raw
        self.nbytes = nbytes
        self.size = block.size
        self.hit = hit
        self._base_refs = 0
        self._block = block
        self._views: dict[str, weakref.ref] | None = None  # name -> a tensor viewing this buffer
        self._result: tuple[weakref.ref, str] | None = None  # the load result holding it, and its file
        self._finalizer = weakref.finalize(self, pool._give_back, block)
        self._finalizer.atexit = False  # nothing to return to at interpreter exit
        block.lease = weakref.ref(self)

    def held_by(self, result: Any, path: str) -> None:
        """Record the load result (a ``LoadedTensors`` of ``path``) this lease belongs to, and the tensors it
        made already; the pool names them when this buffer, still held by them once the result is gone,
        keeps a later load from reusing it (:attr:`PoolStats.last_blocked`)."""
        self._result = (weakref.ref(result), path)

    def record_view(self, name: str, tensor: Any) -> None:
        """Record that ``tensor`` (named ``name``) is a view into this lease's buffer."""
        if self._views is None:
            self._views = {}
        self._views[name] = weakref.ref(tensor)

    def _leftover(self) -> tuple[str, list[str]] | None:
        """``(file, names of the live views)`` when the load result that held this lease is gone and the tensors
        still viewing its buffer are leftovers: together less than half of it, so that most of the buffer is held
        for nothing. None otherwise (the result is alive, none was recorded, or the tensors are most of the load:
        a model built from it)."""
        if self._result is None or self._result[0]() is not None:
            return None
        live = {name: t for name, ref in (self._views or {}).items() if (t := ref()) is not None}
        if 2 * sum(int(getattr(t, "nbytes", 0)) for t in live.values()) >= max(self.nbytes, 1):
            return None
        return self._result[1], list(live)

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def release(self) -> None:
        """Return the buffer to the pool now. Idempotent. Do not use ``buffer`` afterwards."""
        self._finalizer()

    def __enter__(self) -> "PoolBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else ("hit" if self.hit else "miss")
        return f"<PoolBuffer nbytes={self.nbytes} size={self.size} {state}>"


class PersistentBufferPool:
    """Device buffers kept across loads: arenas for whole files, size classes for single tensors.

    ``context`` is the pyopencl context to allocate in (read-write buffers);
    ``allocator`` replaces that with any callable ``nbytes -> buffer`` (used to
    test the bookkeeping without a device; the pool keeps sizes itself, so the
    buffer can be any object). ``max_bytes`` bounds the device memory held:
    arenas and single buffers, idle and in use, counted at their allocated
    (size-class) size (None: no bound but the device's); it does not count
    pinned host memory. ``max_staging_bytes`` bounds that: the pinned staging
    buffers of staged loads (:class:`StagingBuffers`), idle and leased, counted
    in ``stats.staging_bytes`` (default ``MAX_STAGING_BYTES``, 1 GiB; None: only
    ``STAGING_KEEP`` idle sets). ``max_alloc_size`` is the largest single
    allocation (default: the device's ``max_mem_alloc_size``; None without a
    context); loads split regions larger than it. ``keep_files`` is how many
    files loaded through the pool stay open (mapped, index parsed) for the next
    load of the same unchanged file (see :class:`OpenFiles`; 0 keeps none).

    >>> import numpy as np, pyopencl as cl, pyopencl.array as cla       # doctest: +SKIP
    >>> from fastckpt.device import default                             # doctest: +SKIP
    >>> dev = default()                                                 # doctest: +SKIP
    >>> pool = PersistentBufferPool(dev.context, dev.queue)             # doctest: +SKIP
    >>> a = cla.to_device(dev.queue, np.ones(1000, np.float32), allocator=pool)  # doctest: +SKIP
    >>> del a; pool.stats.bytes_idle                                    # doctest: +SKIP
    4096
    """

    def __init__(self, context, queue=None, *, max_bytes: int | None = None,
                 allocator: Callable[[int], Any] | None = None, max_alloc_size: int | None = None,
                 keep_files: int = 4, max_staging_bytes: int | None = MAX_STAGING_BYTES):
        if context is None and allocator is None:
            raise ValueError("PersistentBufferPool needs a pyopencl context, or an allocator=callable(nbytes)")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes!r}")
        self.context = context
        self.queue = queue
        self.max_bytes = max_bytes
        if max_staging_bytes is not None and max_staging_bytes < 0:
            raise ValueError(f"max_staging_bytes must be >= 0 or None, got {max_staging_bytes!r}")
        self.max_staging_bytes = max_staging_bytes
        devices = list(context.devices) if context is not None else []
        if max_alloc_size is None and devices:
            max_alloc_size = min(int(d.max_mem_alloc_size) for d in devices)
        self.max_alloc_size = max_alloc_size
        # Offsets of sub-buffers must be multiples of this (bytes); arenas are sized in multiples of it.
        self.base_align = max((int(d.mem_base_addr_align) // 8 for d in devices), default=1) or 1
        if allocator is None:  # cl.Buffer; on a CPU device, large ones on huge pages (a new arena fills 4x faster)
            from fastckpt.device.hugepages import buffer_allocator

            allocator = buffer_allocator(context, queue)

        self._allocator = allocator
        self.files = OpenFiles(keep_files)
        self._lock = threading.Lock()  # not re-entrant on purpose: see the module docstring
        self._returned: deque[_Block] = deque()
        self._idle: OrderedDict[int, _Block] = OrderedDict()  # serial -> block, least recently used first
        self._idle_sizes: list[tuple[int, int]] = []  # sorted (size, serial) of idle blocks, for best fit
        self._handed: dict[int, PoolBuffer] = {}  # id(buffer) -> lease, for the allocator protocol
        self._serial = 0
        self._hits = self._misses = self._allocations = self._evictions = 0
        self._bytes_allocated = 0
        self._bytes_held = 0
        self._bytes_in_use = 0
        self._buffers_in_use = 0
        self._staging: list[StagingBuffers] = []  # idle sets, oldest first
        self._staging_allocations = 0
        self._staging_bytes = 0
        self._in_use: dict[int, _Block] = {}  # serial -> block leased now
        self._pending_warning: str | None = None
        self._blocked_misses = 0
        self._last_blocked: str | None = None
        self._warned_blocked = False

    # -- locking and deferred returns ------------------------------------------------------------
    def _acquire(self) -> None:
        self._lock.acquire()
        self._drain()

    def _release_lock(self) -> None:
        # A finalizer may have queued a return after our last drain; apply it unless someone else
        # now holds the lock (they will).
        self._drain()
        self._lock.release()
        while self._returned and self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _give_back(self, block: _Block) -> None:
        """Finalizer of a lease: queue the block and apply the return if the lock is free."""
        self._returned.append(block)
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        returned = self._returned
        while returned:
            try:
                block = returned.popleft()
            except IndexError:  # pragma: no cover - another thread emptied it
                break
            self._make_idle(block)

    def _make_idle(self, block: _Block) -> None:
        if not block.in_use:
            return
        block.in_use = False
        block.lease = None
        self._in_use.pop(block.serial, None)
        self._bytes_in_use -= block.size
        self._buffers_in_use -= 1
        if block.raw is None:
            return
        if self.max_bytes is not None and self._bytes_held > self.max_bytes:
            self._free(block)
            self._evictions += 1
            return
        self._idle[block.serial] = block
        bisect.insort(self._idle_sizes, (block.size, block.serial))

    def _free(self, block: _Block) -> None:
        # Dropping the pool's reference frees the device memory (nothing else holds an idle block).
        block.raw = None
        self._bytes_held -= block.size

    def _take_idle(self, serial: int) -> _Block:
        block = self._idle.pop(serial)
        i = bisect.bisect_left(self._idle_sizes, (block.size, serial))
        del self._idle_sizes[i]
        return block

    def _evict_lru(self, count_as_eviction: bool = True) -> int:
        serial, block = next(iter(self._idle.items()))
        self._take_idle(serial)
        self._free(block)
        if count_as_eviction:
            self._evictions += 1
        return block.size

    # -- requests ------------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> PoolBuffer:
        """A lease on a buffer of at least ``nbytes`` (rounded to its size class).

        >>> pool = PersistentBufferPool(None, allocator=lambda n: bytearray(n))
        >>> pool.allocate(5000).size
        5120
        """
        need = size_class(_check_size(nbytes))
        return self._request(nbytes, need, int(need * _CLASS_SLACK), need)

    def arena(self, nbytes: int) -> PoolBuffer:
        """A lease on one buffer for a whole region of ``nbytes``: the best-fitting idle buffer, else a new one.

        >>> pool = PersistentBufferPool(None, allocator=lambda n: bytearray(n))
        >>> pool.arena(3_000_000).release()
        >>> pool.arena(2_000_000).hit      # the 3 MB arena is idle and at most 2x too large
        True
        """
        nbytes = _check_size(nbytes)
        need = max(nbytes, 1)
        alloc = arena_size(need)
        if self.max_alloc_size is not None and alloc > self.max_alloc_size:
            alloc = max(need, self.max_alloc_size - self.max_alloc_size % self.base_align)
        return self._request(nbytes, need, max(int(need * _ARENA_SLACK), alloc), alloc)

    def __call__(self, nbytes: int):
        """pyopencl's allocator protocol: a buffer of at least ``nbytes``, returned when dropped.

        Usable as ``pyopencl.array.Array(..., allocator=pool)`` and in ``enqueue_copy``.
        """
        lease = self.allocate(nbytes)
        # This local holds the buffer from before it is registered until the caller has it: a sweep in
        # another thread between the lock's release and the return must see it referenced, or it would
        # hand the same buffer to a second caller.
        buffer = lease.buffer
        self._acquire()
        try:
            self._handed[id(buffer)] = lease
            # The count when only the pool holds it (the block and the lease): taken with exactly the
            # expression _sweep uses, so temporaries count the same on every Python version, less the
            # one reference of the local above (a variable always owns one).
            lease._base_refs = _refs(lease.buffer) - 1
        finally:
            self._release_lock()
        return buffer

    def staging(self, queue, chunk: int, count: int = 2) -> "StagingBuffers":
        """A lease on ``count`` pinned staging buffers of at least ``chunk`` bytes: an idle set when one fits
        (the smallest), else a new one (:meth:`StagingBuffers.allocate`, outside the pool's lock: pinning takes
        a while). ``lease.hit`` says which; :meth:`StagingBuffers.release` returns it.

        >>> from fastckpt.device import default                                    # doctest: +SKIP
        >>> dev = default(); pool = PersistentBufferPool(dev.context, dev.queue)  # doctest: +SKIP
        >>> pool.staging(dev.queue, 1 << 20).release()                             # doctest: +SKIP
        >>> pool.staging(dev.queue, 1 << 20).hit, pool.stats.staging_allocations   # doctest: +SKIP
        (True, 2)
        """
        chunk = _check_size(chunk)
        if chunk < 1 or count < 1:
            raise ValueError(f"staging buffers need a chunk and a count above 0, got chunk={chunk}, count={count}")
        self._acquire()
        try:
            # A set of more buffers serves too: a load uses every buffer of its set.
            fits = [i for i, stage in enumerate(self._staging) if stage.count >= count and stage.chunk >= chunk]
            if fits:
                stage = self._staging.pop(min(fits, key=lambda i: self._staging[i].chunk))
                stage.hit, stage._pool = True, self
                return stage
        finally:
            self._release_lock()
        stage = StagingBuffers.allocate(queue, chunk, count)
        self._acquire()
        try:
            self._staging_allocations += count
            self._staging_bytes += stage.nbytes
        finally:
            self._release_lock()
        stage._pool = self
        return stage

    def _return_staging(self, stage: "StagingBuffers") -> None:
        self._acquire()
        try:
            self._staging.append(stage)
            bound = self.max_staging_bytes
            while self._staging and (len(self._staging) > STAGING_KEEP
                                     or (bound is not None and self._staging_bytes > bound)):
                smallest = min(range(len(self._staging)), key=lambda i: self._staging[i].nbytes)
                self._staging_bytes -= self._staging.pop(smallest).nbytes  # freed once its pending copies are done
        finally:
            self._release_lock()

    def _request(self, nbytes: int, need: int, limit: int, alloc: int) -> PoolBuffer:
        if self.max_alloc_size is not None and need > self.max_alloc_size:
            raise ValueError(
                f"cannot allocate {need} bytes in one device buffer: the device's max_mem_alloc_size is "
                f"{self.max_alloc_size} bytes (split the data, as load_file does for large files)"
            )
        self._acquire()
        try:
            block = self._best_fit(need, limit)
            if block is None and self._handed:
                self._sweep()  # buffers dropped by pyopencl arrays may be what we need
                block = self._best_fit(need, limit)
            hit = block is not None
            if hit:
                self._hits += 1
            else:
                self._blocked_by(need, limit)  # counted, and named when tensors of an earlier load hold it
                block = self._new_block(alloc)
                self._misses += 1
            block.in_use = True
            self._in_use[block.serial] = block
            self._bytes_in_use += block.size
            self._buffers_in_use += 1
            try:
                return PoolBuffer(self, block, nbytes, hit)
            except BaseException:
                self._returned.append(block)
                raise
        finally:
            warning, self._pending_warning = self._pending_warning, None
            self._release_lock()
            if warning is not None:
                from fastckpt.errors import FastCkptWarning

                warnings.warn(f"buffer pool: {warning} (warned once per pool; pool.stats.blocked_misses counts "
                              "them)", FastCkptWarning, stacklevel=4)

    def _blocked_by(self, need: int, limit: int) -> str | None:
        """Why a miss could not reuse a buffer this pool holds: one in use would have fit (counted in
        :attr:`PoolStats.blocked_misses`). When an earlier load's result is gone but some of its tensors keep its
        buffer, the first time a :class:`~fastckpt.errors.FastCkptWarning` names them (warned after the lock is
        released)."""
        fits = [b for b in self._in_use.values() if need <= b.size <= limit]
        if not fits:
            return None
        self._blocked_misses += 1
        leftovers = []
        for block in fits:
            lease = block.lease() if block.lease is not None else None
            found = lease._leftover() if lease is not None else None
            if found is not None:
                leftovers.append(found)
        if leftovers:
            path, names = leftovers[0]
            shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            reason = (f"the {_mib(fits[0].size)} buffer of an earlier load of {path} is still held by "
                      + (f"its tensor{'s' if len(names) > 1 else ''} {shown}" if names else "a view of it")
                      + f", so this request for {_mib(need)} allocates a new one; drop (del) those tensors, "
                      "or .copy() what you keep, so that the next load reuses the buffer")
        else:
            reason = (f"{len(fits)} buffer(s) that would fit {_mib(need)} are in use (a load still held, or "
                      "tensors of one), so this request allocates a new one")
        self._last_blocked = reason
        if leftovers and not self._warned_blocked:
            self._warned_blocked = True
            self._pending_warning = reason
        return reason

    def _best_fit(self, need: int, limit: int) -> _Block | None:
        sizes = self._idle_sizes
        i = bisect.bisect_left(sizes, (need, -1))
        if i < len(sizes) and sizes[i][0] <= limit:
            return self._take_idle(sizes[i][1])
        return None

    def _new_block(self, size: int) -> _Block:
        if self.max_bytes is not None:
            while self._idle and self._bytes_held + size > self.max_bytes:
                self._evict_lru()
        try:
            raw = self._allocator(size)
        except Exception as exc:
            if not is_oom(exc):
                raise
            freed = self._free_all_idle(count_as_evictions=True)
            try:
                raw = self._allocator(size)
            except Exception as exc2:
                if not is_oom(exc2):
                    raise
                raise MemoryError(
                    f"device allocation of {size} bytes failed ({exc2}); the buffer pool holds "
                    f"{self._bytes_held} bytes in use by live tensors or leases (it freed {freed} idle bytes "
                    "and retried). Release tensors no longer needed, load fewer (names=...), or pass "
                    "max_bytes= to bound what the pool keeps."
                ) from exc2
        self._serial += 1
        block = _Block(raw, size, self._serial)
        self._allocations += 1
        self._bytes_allocated += size
        self._bytes_held += size
        return block

    # -- returns, trimming, statistics -----------------------------------------------------------
    def _sweep(self) -> int:
        """Return buffers handed out by ``pool(nbytes)`` that no one references any more."""
        dropped = []
        for key, lease in self._handed.items():
            if _refs(lease.buffer) <= lease._base_refs:
                dropped.append(key)
        for key in dropped:
            lease = self._handed.pop(key)
            if lease._finalizer.detach() is not None:
                self._make_idle(lease._block)
        return len(dropped)

    def release(self, obj) -> None:
        """Return a lease, or a buffer handed out by ``pool(nbytes)``, to the pool now.

        Any tensor still viewing that memory must not be used afterwards.
        """
        if isinstance(obj, PoolBuffer):
            obj.release()
            return
        self._acquire()
        try:
            lease = self._handed.pop(id(obj), None)
            if lease is None or lease.buffer is not obj:
                if lease is not None:
                    self._handed[id(obj)] = lease
                raise ValueError(f"{obj!r} was not handed out by this pool (or was already released)")
            if lease._finalizer.detach() is not None:
                self._make_idle(lease._block)
        finally:
            self._release_lock()

    def collect(self) -> int:
        """Take back allocator-protocol buffers that are no longer referenced; returns how many."""
        self._acquire()
        try:
            return self._sweep()
        finally:
            self._release_lock()

    def free_idle(self) -> int:
        """Free every idle buffer (memory in use stays); returns the bytes freed. Counts no evictions."""
        self._acquire()
        try:
            return self._free_all_idle()
        finally:
            self._release_lock()

    def _free_all_idle(self, count_as_evictions: bool = False) -> int:
        freed = 0
        while self._idle:
            freed += self._evict_lru(count_as_evictions)
        return freed

    def clear(self) -> int:
        """Free all idle memory, after taking back dropped ``pool(nbytes)`` buffers; returns bytes freed.

        Leases and protocol buffers still in use keep their memory; they are cached again when
        returned. The files kept open for reloads and the idle staging buffers are let go too (the
        bytes returned count device memory only).

        >>> pool = PersistentBufferPool(None, allocator=lambda n: bytearray(n))
        >>> pool.allocate(1000).release(); pool.clear()
        1024
        """
        self.files.clear()
        self._acquire()
        try:
            for stage in self._staging:
                self._staging_bytes -= stage.nbytes
            self._staging = []
            self._sweep()
            return self._free_all_idle()
        finally:
            self._release_lock()

    @property
    def stats(self) -> PoolStats:
        """Current counters (after taking back dropped allocator-protocol buffers)."""
        self._acquire()
        try:
            if self._handed:
                self._sweep()
            return PoolStats(
                hits=self._hits,
                misses=self._misses,
                allocations=self._allocations,
                bytes_allocated=self._bytes_allocated,
                evictions=self._evictions,
                bytes_held=self._bytes_held,
                bytes_in_use=self._bytes_in_use,
                bytes_idle=self._bytes_held - self._bytes_in_use,
                buffers_held=len(self._idle) + self._buffers_in_use,
                buffers_in_use=self._buffers_in_use,
                max_bytes=self.max_bytes,
                staging_allocations=self._staging_allocations,
                staging_bytes=self._staging_bytes,
                max_staging_bytes=self.max_staging_bytes,
                blocked_misses=self._blocked_misses,
                last_blocked=self._last_blocked,
            )
        finally:
            self._release_lock()

    def __repr__(self) -> str:
        return (f"<PersistentBufferPool held={self._bytes_held} in_use={self._bytes_in_use} "
                f"hits={self._hits} misses={self._misses}>")


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB" if nbytes >= 1 << 20 else f"{nbytes} bytes"


def _check_size(nbytes) -> int:
    n = int(nbytes)
    if n < 0:
        raise ValueError(f"cannot allocate a negative number of bytes ({nbytes!r})")
    return n


class StagingBuffers:
    """Pinned host memory that copies to a device which does not share host memory are staged through.

    ``count`` buffers of ``chunk`` bytes, allocated with ``ALLOC_HOST_PTR`` (memory
    the driver pins, so its DMA engine reads it directly) and each mapped once for
    writing: ``hosts[i]`` is buffer ``i`` as a flat uint8 array. The host fills
    ``hosts[i]`` and passes it, as host memory, to ``enqueue_copy`` into device
    buffers; the buffer objects themselves never reach a device command, so
    keeping them mapped is allowed. ``pending[i]`` holds the events of the copies
    last sent from buffer ``i``: whoever writes into it next waits for them first
    (a previous non-blocking load may still be copying). Leased from a pool
    (:meth:`PersistentBufferPool.staging`) and returned with :meth:`release`;
    made without a pool by :meth:`allocate` and simply dropped (each array holds
    its mapping, and the mapping its buffer, until no pending copy reads it).

    >>> from fastckpt.device import default                             # doctest: +SKIP
    >>> stage = StagingBuffers.allocate(default().queue, 1 << 20)      # doctest: +SKIP
    >>> stage.count, stage.chunk, stage.hosts[0].dtype, stage.nbytes    # doctest: +SKIP
    (2, 1048576, dtype('uint8'), 2097152)
    """

    __slots__ = ("chunk", "buffers", "hosts", "pending", "hit", "_pool")

    def __init__(self, chunk: int, buffers: list, hosts: list):
        self.chunk = chunk
        self.buffers = buffers
        self.hosts = hosts
        self.pending: list = [None] * len(hosts)
        self.hit = False
        self._pool = None

    @property
    def count(self) -> int:
        return len(self.hosts)

    @property
    def nbytes(self) -> int:
        return self.chunk * len(self.hosts)

    @classmethod
    def allocate(cls, queue, chunk: int, count: int = 2) -> "StagingBuffers":
        """``count`` new pinned buffers of ``chunk`` bytes in ``queue``'s context, mapped (through ``queue``) for
        writing. ``MemoryError`` when the driver cannot pin that much."""
        import numpy as np
        import pyopencl as cl

        flags = cl.mem_flags.READ_WRITE | cl.mem_flags.ALLOC_HOST_PTR
        buffers, hosts = [], []
        try:
            for _ in range(count):
                buffer = cl.Buffer(queue.context, flags, chunk)
                host, _event = cl.enqueue_map_buffer(queue, buffer, cl.map_flags.WRITE, 0, (chunk,), np.uint8,
                                                     is_blocking=True)
                buffers.append(buffer)
                hosts.append(host)
        except Exception as exc:
            if not is_oom(exc):
                raise
            raise MemoryError(
                f"could not allocate {count} pinned staging buffers of {chunk} bytes ({exc}); load with smaller "
                "chunks (load_file(..., staging=8 << 20)) or without staging (staging=False)") from exc
        return cls(chunk, buffers, hosts)

    def release(self) -> None:
        """Return the buffers to the pool they were leased from (with their pending events). Idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._return_staging(self)

    def __enter__(self) -> "StagingBuffers":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<StagingBuffers {self.count} x {self.chunk} bytes{' hit' if self.hit else ''}>"


class OpenFiles:
    """The last few tensor files loaded through a pool, kept open for the next load of the same file.

    Reloading a file then skips mapping it again (and faulting its pages into
    a fresh mapping, which on 512 MiB can cost as much as the copy itself) and
    parsing its index. A kept file is used only while ``os.stat`` of its path
    still shows the file as it was when it was opened (``MappedFile.identity``,
    from ``fstat``): same device and inode (fastckpt's writers replace files,
    so a new save is a new inode, and the kept mapping pins the old one, so
    its number cannot be reused), size, modification and change times;
    anything else drops it and opens the path anew. A rewrite in place that
    keeps the size and lands within the file system's timestamp granularity
    cannot be seen by ``stat``; replace files (as fastckpt's writers do)
    rather than rewrite them. Only
    read-only mappings are kept (a copy-on-write mapping may hold a previous
    load's kernel writes). A kept file pins its inode: ``clear()`` (or the
    pool's) lets a replaced file's old data go.

    >>> files = OpenFiles(2)
    >>> files.get("/nonexistent") is None
    True
    """

    def __init__(self, capacity: int = 4):
        self.capacity = max(0, int(capacity))
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[tuple, Any]] = OrderedDict()

    @staticmethod
    def _signature(path: str) -> tuple | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def get(self, path) -> Any:
        """The kept file for ``path`` if it is still the same file on disk, else None."""
        if not self.capacity:
            return None
        key = os.path.abspath(os.fspath(path))
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            return None
        sig = self._signature(key)
        with self._lock:
            if sig is not None and sig == entry[0] and self._entries.get(key) is entry:
                self._entries.move_to_end(key)
                return entry[1]
            if self._entries.get(key) is entry:
                # Dropped, not closed: another thread may be loading from it right now; the mapping
                # goes when the last reference and view do.
                del self._entries[key]
        return None

    def put(self, path, tensor_file) -> bool:
        """Keep ``tensor_file`` (opened from ``path`` just now); returns False when it is not kept.

        It is kept only when ``path`` still names the file it mapped, unchanged since it was
        opened (its ``fstat`` then equals ``os.stat(path)`` now): a file replaced or rewritten
        between the open and this call would otherwise be served, stale, to every later load.
        """
        if not self.capacity or getattr(tensor_file.mapped, "copy_on_write", False):
            return False
        key = os.path.abspath(os.fspath(path))
        sig = self._signature(key)
        if sig is None or sig != getattr(tensor_file.mapped, "identity", None):
            return False
        with self._lock:  # files pushed out are dropped, not closed (see get)
            self._entries.pop(key, None)
            self._entries[key] = (sig, tensor_file)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return True

    def clear(self) -> None:
        """Forget every kept file (each is unmapped once no tensor view or load uses it)."""
        with self._lock:
            self._entries = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)
