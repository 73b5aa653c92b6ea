"""Staged copies: host bytes to device buffers through pinned staging buffers, the fill running ahead of the copies.

A device that does not share host memory (a discrete GPU: ``host_unified_memory``
is false) copies from pageable memory, such as a file mapping, at a fraction of
its link's speed: the driver copies the bytes again into pinned memory of its
own before its DMA engine can read them. A staged load fills pinned buffers
(``ALLOC_HOST_PTR``, mapped once and kept by the pool between loads, see
:class:`~fastckpt.device.pool.StagingBuffers`) itself and sends each full one
with non-blocking ``enqueue_copy`` commands.

The bytes to stage are one stream: the pieces :meth:`Stager.add` was given,
back to back, cut into *batches* of one staging chunk. Each batch is filled
into the staging buffer freed first (by the batch sent before it: batch ``k`` of
a cold load whose buffers differ in alignment goes to buffer ``k mod buffers``,
the one its pieces were placed for). :meth:`Stager.finish` runs the pipeline:

- the fill threads take the stream's parts in order,
  each batch in parts of at least ``FILL_SPLIT`` bytes (numpy and ``preadv``
  release the GIL while they copy), so several batches fill at once, up to
  ``buffers`` of them;
- a part waits only for the copies last sent from *its own* staging buffer
  (their events; a previous load's too, for buffers from a pool), never for the
  batch before it;
- the thread that fills the last part of a batch sends it at once, whether the
  batches before it have gone or not (each copy has its own destination), and
  frees its buffer for the next batch, with no thread to wake for it: a fill
  thread that stalls holds back no other batch; the caller's thread reports
  progress in the stream's order (tensor by tensor, once every copy carrying a
  byte of it has completed, see ``load_file``'s ``progress``).

How many threads and buffers (:func:`staging_shape`): threads from the cores
this process may run on and the load's size (a part of ``FILL_SPLIT`` bytes at
least each, ``MAX_FILL_THREADS`` at most); buffers enough to hold what the
threads fill at once plus the two being copied (and ``SPARE_BUFFERS`` more for
a load in chunks under ``STAGING_CHUNK``), never more than the load needs
nor more than the pool's ``max_staging_bytes`` allow.

Where the load mapped the file itself (a path, not kept open by the pool), its
bytes are read into the staging buffers with ``preadv`` on a descriptor of the
same file (:meth:`Stager.file`: the path opened again, used only when ``fstat``
shows the file the mapping was made of), not copied out of the new mapping,
whose pages would each be faulted in; a mapping that was open before (a file
the pool kept, a reader the caller passed) is copied from, its pages mapped by
earlier loads. Measured on pocl with staging forced (256 MiB, 2 fill threads, a
shared 2-core host, medians of 5-7 runs): from a cold page cache
(``posix_fadvise(DONTNEED)`` before each run, a fresh mapping) ``preadv`` 169-288
ms against 333-613 ms copying from the mapping in 4 MiB chunks and 7.9 s in 64
MiB ones (pieces that large defeat the kernel's readahead); warm, fresh
mapping, 86-107 ms against 99-134 ms; warm through a pool that keeps the file
mapped, ``preadv`` 92-94 ms against 49-63 ms copying (on a quiet host; on a
16-core H100 host, too, copies from a mapping beat ``preadv`` warm, 52 GB/s
against 38 on 12 threads, ``../shared/reference/gpu-notes.md``). Choosing per
part by asking the page cache (``mincore``) measured no better and was
dropped. ``READ`` = ``"preadv"`` or ``"mmap"`` takes one route for every load.
A short read (a file truncated under the load) is an ``OSError`` naming the
file and offset.

A cold file (a region whose sampled pages are not cached) is read with
``O_DIRECT`` straight into the staging buffers (:meth:`Stager.direct`): each
piece is placed where its address agrees with its file offset modulo
``DIRECT_ALIGN``, batches and fill parts are cut at blocks of the file (only a
region's unaligned ends go through the page cache), and the fills run on
``DIRECT_THREADS`` threads whatever the cores, since a direct read waits on the
disk without using a core: the disk's queue is as deep as an unstaged load's.
Such a load leases the buffers that many threads fill at once
(:func:`staging_shape` for ``DIRECT_THREADS`` cores; :meth:`Stager.finish`
leases them once it knows), and new staging buffers on a device that shares
host memory are advised huge pages (:func:`lease_staging`), so that each
direct read reaches the disk as a few large requests: 0.7.0's 3 buffers on 4
KiB pages kept 3-4 reads of 540 KiB requests in flight (docs/reading.md, "The
cold staged load").

The bytes are the same as an unstaged copy's; only the route differs.

>>> staging_shape(4 << 30, STAGING_CHUNK, cpus=16)        # 4 GiB on 16 cores
Shape(chunk=16777216, buffers=6, threads=8)
>>> staging_shape(3 << 20, 3 << 20, cpus=16)              # a small load: one buffer, the caller's thread
Shape(chunk=3145728, buffers=1, threads=1)
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
import time
from typing import Callable, NamedTuple

import numpy as np

from fastckpt._native.mapped import held_guards
from fastckpt.device.context import shares_host_memory
from fastckpt.device.hugepages import HUGE_MIN, advise_huge_pages
from fastckpt.device.pool import StagingBuffers
from fastckpt.threads import kept_pool
from fastckpt.formats.readinto import DIRECT_ALIGN, DIRECT_THREADS, open_direct, read_into, same_file

__all__ = ["Stager", "Shape", "batch_chunk", "batch_sizes", "staging_chunk", "staging_shape", "lease_staging",
           "send_pinned", "STAGING_CHUNK",
           "STAGING_ROUND", "MIN_BATCHES", "FILL_SPLIT", "MAX_FILL_THREADS", "READ", "RAMP", "RAMP_MIN",
           "SPARE_BUFFERS", "STAGING_HUGE_PAGES"]

# The size of one pinned staging buffer. A load smaller than one chunk gets buffers of its own size, rounded up to
# STAGING_ROUND bytes (pinning costs per byte).
STAGING_CHUNK = 16 * 1024 * 1024
STAGING_ROUND = 1024 * 1024
# A load of up to MIN_BATCHES chunks goes in MIN_BATCHES smaller ones (STAGING_ROUND bytes at least): a pipeline of B
# batches loses about one batch of its slower stage to the start (the first fill, which no copy overlaps) and to
# the end (the last copy), up to 1 / (B + 1) of the load where fill and link run at the same rate. Over a simulated link
# (bench --suite link, 256 MiB, 2 fill threads on this project's shared 2-core VM, links at 0.6-1.25x the fill rate,
# medians of 5 rounds, each shape against the default in the same round) 4 batches of 64 MiB ran at 0.80-0.86x the
# rate of 16 batches of 16 MiB; 8 and 4 MiB chunks, or 6 buffers instead of 3, were no better beyond the noise (0.75-
# 1.24x). With the smaller first and last batches (RAMP), 32 batches of 8 MiB reached 0.86-0.97 of min(fill, link) at
# 25-50 GB/s against 0.85-0.95 for 16 MiB without them (medians of 5 paired rounds; docs/reading.md). Loads of 512
# MiB or more keep STAGING_CHUNK. On an H200 (PCIe 5, 55 GB/s pinned bound, 16 cores; tools/gpu-sweep.py, 4 GiB from
# the page cache, docs/reading.md) 6 x 16 MiB on 8 fill threads reached 42.7 GB/s by preadv and 49.1 by copies from
# the mapping, where 0.5.0's 6 x 64 MiB on 16 threads reached 34.5 and 43.6; four times less pinned memory also makes
# a new pool's or a cold load's first pinning four times cheaper.
MIN_BATCHES = 32

# The first and the last batches of a load are smaller: RAMP of them at each end, halving from a chunk down to
# chunk / 2**RAMP (RAMP_MIN bytes at least). The first copy waits for the first fill, which no copy overlaps, and the
# last fill's batch waits for its copy, which no fill overlaps: with whole chunks, each costs one chunk at the slower
# stage's rate. Over the simulated link (bench --suite link, 256 MiB in 16 MiB chunks) the first copy started 5-10
# ms into a 45 ms load at 50 GB/s; smaller ends cut that to the fill of RAMP_MIN bytes (docs/reading.md).
RAMP = 3
RAMP_MIN = 1024 * 1024

# Staging buffers beyond what the fill threads fill at once and the two in flight, for loads in chunks under
# STAGING_CHUNK: over the simulated link (bench --suite link, 256 MiB in 8 MiB chunks, 2 fill threads, a machine at
# load average 12-15 whose fill rate moved 0.7-3.7 GB/s within seconds), 6 buffers ran at 1.05-1.18x the rate of 4
# at 40-50 GB/s (0.92-0.97 of min(fill, link) against 0.78-0.91): two spare buffers absorb the fill's stalls.
SPARE_BUFFERS = 2

# One fill task copies at least this many bytes (a smaller one costs more in hand-over than the copy gains), and a
# staging chunk is filled in parts of PART_OF_CHUNK of it, so that several threads share one buffer.
FILL_SPLIT = 8 * 1024 * 1024
PART_OF_CHUNK = 4
# Host fill rates into pinned memory on a 16-core host (4 GiB from the page cache, fills alone): 9.9 GB/s on one
# thread, 27 on 4, 40 on 8, 52 on 12 (gpu-notes). With the copies running beside them, more threads did not help: on an
# H200 with 16 MiB chunks, 8 fill threads ran at 0.94-1.19x the rate of 16 (tools/gpu-sweep.py, docs/reading.md).
MAX_FILL_THREADS = 8
# New staging buffers on a device that shares host memory are advised to use huge pages (lease_staging); False leaves
# them on the runtime's 4 KiB pages (to measure both ways: docs/reading.md).
STAGING_HUGE_PAGES = True
# How the bytes of a mapped file reach the staging buffers: "auto" (read from the file where the load made the
# mapping, Stager.fresh; copied out of a mapping that was open before, a pool's kept file or a caller's), "preadv"
# (always read) or "mmap" (always copied). See the module docstring for the measurements.
READ = "auto"


class Shape(NamedTuple):
    """How one staged load runs: ``buffers`` pinned buffers of ``chunk`` bytes, filled by ``threads`` threads."""

    chunk: int
    buffers: int
    threads: int


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def staging_shape(total: int, chunk: int, cpus: int | None = None, max_bytes: int | None = None) -> Shape:
    """The :class:`Shape` of a staged load of ``total`` bytes with chunks of ``chunk`` bytes on ``cpus`` cores
    (default: those this process may run on), using at most ``max_bytes`` of pinned memory (two buffers at least).

    >>> staging_shape(256 << 20, 64 << 20, cpus=2)
    Shape(chunk=67108864, buffers=3, threads=2)
    >>> staging_shape(4 << 30, 64 << 20, cpus=16, max_bytes=128 << 20)
    Shape(chunk=67108864, buffers=2, threads=8)
    """
    cpus = _cpus() if cpus is None else max(1, int(cpus))
    batches = max(1, -(-total // chunk))
    part = max(FILL_SPLIT, chunk // PART_OF_CHUNK)
    threads = max(1, min(cpus, MAX_FILL_THREADS, total // FILL_SPLIT))
    # What the threads fill at once (whole buffers), plus one being copied and one ready to go; a load cut into
    # smaller batches (under 2 GiB: batch_chunk) gets SPARE_BUFFERS more, which cost little at that size.
    buffers = -(-threads * min(part, chunk) // chunk) + 2
    if 2 * RAMP_MIN <= chunk < STAGING_CHUNK:
        buffers += SPARE_BUFFERS
    if max_bytes is not None:
        buffers = min(buffers, max(2, max_bytes // chunk))
    return Shape(chunk, max(1, min(buffers, batches)), threads)


def batch_chunk(total: int, chunk: int) -> int:
    """The chunk of a staged load of ``total`` bytes whose caller did not name one: ``chunk`` (``STAGING_CHUNK``) for a
    load of ``MIN_BATCHES`` chunks or more; a smaller one is cut into ``MIN_BATCHES`` batches of a whole number of
    ``STAGING_ROUND`` bytes (one at least), so that the fill and the copies overlap; a load under two
    ``STAGING_ROUND`` goes in one buffer of its size, rounded up to ``STAGING_ROUND`` (pinning costs per byte).

    >>> [batch_chunk(n, STAGING_CHUNK) >> 20 for n in (4 << 30, 256 << 20, 6 << 20, 1000)]
    [16, 8, 1, 1]
    """
    if total < 2 * STAGING_ROUND:
        return min(chunk, -(-max(total, 1) // STAGING_ROUND) * STAGING_ROUND)
    return min(chunk, max(STAGING_ROUND, total // (MIN_BATCHES * STAGING_ROUND) * STAGING_ROUND))


def batch_sizes(total: int, chunk: int, ramp: int = RAMP) -> list[int]:
    """The sizes of the batches a staged stream of ``total`` bytes is cut into: whole ``chunk`` s, the first and the
    last ``ramp`` of them smaller (``chunk / 8, / 4, / 2`` going in, the reverse going out, ``RAMP_MIN`` bytes at
    least), so that the first copy starts early and the last one ends soon after the last fill. A stream of one
    chunk or less is one batch; a chunk under ``2 * RAMP_MIN`` bytes, or ``ramp=0`` (a load with one staging
    buffer, which overlaps nothing), keeps every batch a whole chunk (the last one what is left).

    >>> [n >> 20 for n in batch_sizes(64 << 20, 16 << 20)]
    [2, 4, 8, 16, 16, 4, 8, 4, 2]
    >>> [n >> 20 for n in batch_sizes(24 << 20, 16 << 20)], batch_sizes(10000, 4096), batch_sizes(10, 4096)
    ([2, 4, 8, 8, 2], [4096, 4096, 1808], [10])
    """
    if total <= 0:
        return []
    if total <= chunk:  # one buffer holds it: nothing to overlap
        return [total]
    head = sorted({max(RAMP_MIN, chunk >> s) for s in range(1, ramp + 1)} - {chunk}) if chunk >= 2 * RAMP_MIN else []
    if not head:
        return [chunk] * (total // chunk) + ([total % chunk] if total % chunk else [])
    tail = head[::-1]
    middle = total - 2 * sum(head)
    if middle < 0:  # too short for both ends: the ramp up, then down, until the bytes run out
        sizes, rest = [], total
        for size in head + tail:
            if rest <= 0:
                break
            sizes.append(min(size, rest))
            rest -= sizes[-1]
        if rest > 0:
            sizes.append(rest)
        return sizes
    full, left = divmod(middle, chunk)
    return head + [chunk] * full + ([left] if left else []) + tail


def staging_chunk(staging, device) -> int:
    """The staging chunk in bytes that ``load_file``'s ``staging`` asks for on ``device``; 0 for none.

    >>> from types import SimpleNamespace
    >>> staging_chunk(None, SimpleNamespace(host_unified_memory=False)) == STAGING_CHUNK
    True
    >>> staging_chunk(None, SimpleNamespace(host_unified_memory=True)), staging_chunk(5000, None)
    (0, 5000)
    """
    if staging is None:
        return 0 if shares_host_memory(device) else STAGING_CHUNK
    if isinstance(staging, bool):
        return STAGING_CHUNK if staging else 0
    if isinstance(staging, int) and staging > 0:
        return staging
    raise ValueError(f"staging must be None (stage where the device does not share host memory), True, False or a "
                     f"chunk size in bytes above 0, got {staging!r}")


def _fillers(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's ``threads`` fill threads (one kept pool per count, :func:`fastckpt.threads.kept_pool`)."""
    return kept_pool("stage-fill", threads)


def _wait_events(events) -> None:
    """Wait for ``events``; at once where each has completed. ``wait_for_events`` releases the GIL, and a thread
    that gives it up waits for it again behind the others: on a 2-core host filling on both cores, 74 waits for
    copies already complete cost a 256 MiB load 0.6-5.4 ms (bench --suite link)."""
    import pyopencl as cl

    complete = cl.command_execution_status.COMPLETE
    if all(event.command_execution_status == complete for event in events):
        return
    cl.wait_for_events(events)  # releases the GIL while it waits; raises where a copy failed


def lease_staging(queue, pool, chunk: int, count: int) -> StagingBuffers:
    """``count`` pinned staging buffers of ``chunk`` bytes: leased from ``pool`` (kept there for the next load), or
    made for this load where there is no pool. Returned with :meth:`~fastckpt.device.pool.StagingBuffers.release`.

    New buffers on a device that shares host memory (pocl) are advised to use huge pages before anything touches
    them (:func:`~fastckpt.device.hugepages.advise_huge_pages`, unless ``STAGING_HUGE_PAGES`` is False): an
    ``O_DIRECT`` read into 4 KiB pages is cut into requests of at most the disk's segment count of pages (254 x 4
    KiB here), into 2 MiB pages into requests of ``max_sectors_kb`` (docs/reading.md: a cold 512 MiB staged load
    made 1,000 disk requests of 540 KiB on 4 KiB pages, 200 of 2.6 MiB with the advice). A discrete GPU's pinned
    memory is its driver's, present once allocated: it is left as it is."""
    if pool is not None:
        stage = pool.staging(queue, chunk, count)
    else:
        stage = StagingBuffers.allocate(queue, chunk, count)
    if not stage.hit and STAGING_HUGE_PAGES and chunk >= HUGE_MIN and shares_host_memory(queue.device):
        for buffer in stage.buffers:
            advise_huge_pages(queue, buffer, chunk)
    return stage


def send_pinned(queue, buffer, host, at: int):
    """One non-blocking copy of the pinned bytes ``host`` to ``buffer`` at ``at``: over the simulated link where the
    queue has one (a simulated discrete device, :mod:`fastckpt.device.simlink`), else ``enqueue_copy``. Returns its
    event. SAFETY: the copy reads ``host`` after this returns; the event keeps the array alive, and the caller
    writes there again only once that event has completed."""
    import pyopencl as cl

    link = getattr(queue, "link", None)
    if link is not None:
        return link.copy(queue, buffer, host, at)
    return cl.enqueue_copy(queue, buffer, host, dst_offset=at, is_blocking=False)


def fill(pending, pairs) -> int:
    """Wait for ``pending`` (the copies last sent from the staging buffer about to be overwritten), then fill each
    ``(destination, source, file)`` of flat uint8 arrays: read from ``file`` (``(descriptor, offset, path)``) where
    there is one, else copied from ``source``. One fill task; runs on a fill thread or the caller's. Returns the
    read calls it made (0 where it copied)."""
    if pending:
        _wait_events(pending)
    reads = 0
    for dst, src, file in pairs:
        if file is None:
            np.copyto(dst, src)
        else:
            fd, offset, path, direct = file if len(file) == 4 else (*file, None)
            # this fill is one of the fill threads' parts; O_DIRECT for the blocks whose address agrees
            reads += read_into(fd, [(dst, offset)], path, threads=1, direct_fd=direct)
    return reads


class _Pipeline:
    """The fills and copies of one staged load, run by the fill threads themselves.

    Each fill thread runs :meth:`work`: it takes the next part of the stream (cutting the next batch into parts when
    it gets there, into the staging buffer freed first), waits for the copies last sent from that buffer (``fill``'s
    ``pending``), fills its part, and, where that completed a batch, sends it at once and frees its buffer for the
    next batch. When the caller's thread cut, queued and sent every batch, the fill threads could not begin before it
    had queued every part (it held the GIL: 0.4 ms a load), and each copy waited for the caller's thread to be woken,
    1-2 ms a batch on a 2-core host with both cores filling (bench --suite link, docs/reading.md).

    Batches go out in the order they are filled, not the stream's: each copy has its own destination, so their order
    on the link changes no byte. Sent in the stream's order, a batch whose thread was preempted held back every batch
    filled after it, and batch ``k + buffers`` waited until it was sent: with 2 fill threads on a 2-core host beside
    two busy processes, the other thread stood idle 1.6 ms of a 46 ms load (at 50 GB/s) waiting for that, and 1.7 ms
    more for the burst of copies sent at once afterwards (docs/reading.md). Progress is reported in the stream's
    order, each tensor once every batch up to the one holding its last byte has been sent, with a marker that
    completes after them (and whatever else was sent before it).

    Where a cold load places its pieces by the buffers' addresses (``O_DIRECT``, :meth:`Stager._batches`) and those
    differ modulo ``DIRECT_ALIGN``, batch ``k`` takes buffer ``k mod buffers``, the one it was placed for.

    No deadlock: parts are taken in stream order, and a batch is cut (and takes a buffer) only once every part of the
    batches before it has been taken, so each buffer waited for is held by a batch whose parts are all running and
    will be sent. A failed part (or the caller's :meth:`fail`) stops the others before their next part."""

    __slots__ = ("stager", "batches", "left", "slot", "free", "fixed", "last", "sent", "failed", "cond", "taken",
                 "parts", "reported", "mark", "reported_to")

    def __init__(self, stager: "Stager", batches: list, fixed: bool = False):
        self.stager = stager
        self.batches = batches
        self.left = [-1] * len(batches)  # parts of each batch not yet filled (-1: not yet cut into parts)
        self.slot = [-1] * len(batches)  # the staging buffer each batch was cut into
        self.free = collections.deque(range(stager.stage.count))  # buffers no batch holds, the first freed first
        self.fixed = fixed  # batch k takes buffer k mod count (its pieces were placed by that buffer's address)
        self.last: list = [None] * len(batches)  # the event progress waits for, per batch sent
        self.sent = 0  # batches 0.. sent-1 have all been sent (a leading run: later ones may have gone too)
        self.reported = 0  # batches whose tensors were reported (progress)
        self.mark = 0  # the stager's marks reported so far
        self.reported_to = 0  # stream bytes in the batches reported so far
        self.failed: BaseException | None = None
        self.cond = threading.Condition()
        self.taken = -1  # the batch whose parts are being taken
        self.parts: list = []  # its parts not yet taken

    def _buffer(self, k: int):
        """A free staging buffer for batch ``k`` (taken from :attr:`free`), or None while every one is held."""
        free = self.free
        if not self.fixed:
            return free.popleft() if free else None
        want = k % self.stager.stage.count
        if want not in free:
            return None
        free.remove(want)
        return want

    def _next(self):
        """The next part to fill, ``(batch, task)``; None when there is none left (or the load failed). Under the
        lock; waits for a free buffer where the next batch needs one."""
        while not self.parts:
            if self.failed is not None or self.taken + 1 >= len(self.batches):
                return None
            k = self.taken + 1
            slot = self._buffer(k)
            if slot is None:
                self.cond.wait()  # until a batch is sent and frees its buffer (or another thread cut batch k)
                continue
            self.taken = k
            self.slot[k] = slot
            self.parts = self.stager._parts(self.batches[k], self.stager.stage.hosts[slot])
            self.parts.reverse()
            self.left[k] = len(self.parts)
        return self.taken, self.parts.pop()

    def work(self, caller: bool = False) -> None:
        """Fill and send parts until none is left. ``caller``: this is the caller's thread (the only fill
        thread), which also reports progress as batches are sent."""
        stager = self.stager
        cond = self.cond
        try:
            while True:
                with cond:
                    taken = self._next()
                    if taken is None:
                        return
                    k, task = taken
                    pending = stager.stage.pending[self.slot[k]]  # the copies last sent from this buffer
                stager._fill(pending, task)
                with cond:
                    self.left[k] -= 1
                    if self.left[k] == 0 and self.failed is None:
                        self._send(k)
                        cond.notify_all()  # only a send lets a waiting part (or the caller's progress) go on
                if caller:
                    self.report()
        except BaseException as exc:
            self.fail(exc)
            raise

    def _send(self, k: int) -> None:
        """Send batch ``k`` (filled) and free its buffer; move :attr:`sent` past the batches now all sent. Under the
        lock."""
        stager = self.stager
        slot = self.slot[k]
        stager._send(slot, self.batches[k])
        self.free.append(slot)
        first = self.sent
        while self.sent < len(self.batches) and self.left[self.sent] == 0:
            self.sent += 1
        if stager.marks and self.sent > first:
            import pyopencl as cl

            # Completes after every copy queued so far, so after every batch before self.sent, in whatever order
            # they went out (also on an out-of-order queue).
            marker = cl.enqueue_marker(stager.queue)
            for n in range(first, self.sent):
                self.last[n] = marker

    def fail(self, exc: BaseException) -> None:
        """Stop: no part is taken any more, and the caller stops waiting."""
        with self.cond:
            if self.failed is None:
                self.failed = exc
            self.cond.notify_all()

    def report(self, wait: bool = False) -> None:
        """Report progress for the tensors whose last byte the batches sent carry, in order, on the caller's thread;
        ``wait``: until every batch has been reported (or the load failed)."""
        stager = self.stager
        marks = stager.marks
        if not marks:
            return
        while self.reported < len(self.batches):
            k = self.reported
            with self.cond:
                while wait and self.sent <= k and self.failed is None:
                    self.cond.wait()
                if self.sent <= k:
                    return
            end = self.reported_to = self.reported_to + sum(len(p[0]) for p in self.batches[k])
            while self.mark < len(marks) and marks[self.mark][0] <= end:
                _end, nbytes, name = marks[self.mark]
                stager.reported(self.last[k], nbytes, name)
                self.mark += 1
            self.reported = k + 1


class Stager:
    """The staged copies of one load (see the module docstring).

    ``add`` only records what goes where; ``finish`` leases the staging buffers (more for a cold load, whose fills
    read with ``O_DIRECT`` on ``DIRECT_THREADS`` threads), fills and sends everything; ``close`` returns the staging
    buffers (with the events of copies that may still read them) to the pool, or drops buffers made for this load.
    ``reported(event, nbytes, name)`` is called, on the caller's thread and in order, for each tensor named in
    ``add``'s ``marks``, with an event that completes once every copy carrying a byte of it has (batches go out in
    the order they are filled, see :class:`_Pipeline`).
    """

    __slots__ = ("queue", "pool", "shape", "stage", "events", "blocking", "reported", "pieces", "ramp",
                 "stream", "marks", "copies", "regions", "tensors", "files", "fresh", "filled", "threads", "reads")

    def __init__(self, queue, pool, shape: Shape, events: list, blocking: bool,
                 reported: Callable | None = None):
        self.queue = queue
        self.pool = pool
        self.shape = shape
        self.stage = None  # leased by finish(), once the shape is known (a cold load's is deeper)
        self.events = events  # the load's list: every copy is recorded there at once
        self.blocking = blocking
        self.reported = reported
        self.pieces: list = []  # (source, device buffer, its offset, (descriptor, offset, path) or None), as added
        self.ramp = RAMP  # the first and last batches are smaller (batch_sizes); 0: every batch a whole chunk
        self.stream = 0  # bytes added so far
        self.marks: list = []  # (stream position of a tensor's last byte + 1, bytes, name), for progress
        self.copies = 0
        self.regions: list = []  # arena regions of a non-blocking load, given the final event by finish()
        self.tensors: list = []  # tensors of a non-blocking load, likewise
        self.files: dict = {}  # id(mapping) -> (descriptor or None, the mapping), see file()
        self.fresh = False  # the load made its mappings (see READ)
        self.filled: list = []  # (start, end) of each fill task's writing (its wait for copies left out)
        self.reads: list = []  # the read calls of each fill task that read from a file
        self.threads = shape.threads  # the fill threads finish() used: more where the fills read with O_DIRECT

    @property
    def chunk(self) -> int:
        return self.shape.chunk

    def file(self, mapped):
        """A descriptor of the file ``mapped`` (a :class:`~fastckpt._native.mapped.MappedFile`) maps, to read its
        bytes with ``preadv``: its path opened again, kept for this load; None where that is not the same file
        (``fstat`` differs from the mapping's ``identity``), cannot be opened, or ``READ`` says to copy from the
        mapping."""
        if READ == "mmap" or (READ == "auto" and not self.fresh):
            return None
        entry = self.files.get(id(mapped))
        if entry is None:
            entry = self.files[id(mapped)] = [same_file(mapped), mapped, None]  # the mapping kept: its id its own
        return entry[0]

    def direct(self, mapped):
        """A descriptor of the file ``mapped`` maps opened ``O_DIRECT`` (the fill reads whole blocks of a cold file
        straight into the staging buffers), kept for this load; None where :meth:`file` has none or the file system
        has no such reads."""
        fd = self.file(mapped)
        if fd is None:
            return None
        entry = self.files[id(mapped)]
        if entry[2] is None:
            entry[2] = open_direct(mapped.path, mapped.identity) or -1
        return entry[2] if entry[2] >= 0 else None

    def add(self, source: np.ndarray, buffer, at: int, marks=(), file=None) -> None:
        """Stage the bytes ``source`` (flat uint8) for ``buffer`` at byte ``at``. ``marks`` are ``(end, bytes,
        name)`` for progress: the tensor ``name`` (``bytes`` in device memory) ends at ``source[end - 1]``.
        ``file`` is ``(descriptor, offset, path)`` where the same bytes are in a file (see :meth:`file`): they
        are read from there; ``(descriptor, offset, path, O_DIRECT descriptor)`` (:meth:`direct`) reads their
        whole blocks with ``O_DIRECT``. The stream is cut into batches by :meth:`finish` (:func:`batch_sizes`)."""
        base = self.stream
        if file is not None and len(file) < 4:
            file = (*file, None)
        self.pieces.append((source, buffer, at, file))
        self.stream += len(source)
        if self.reported is not None:
            self.marks.extend((base + end, nbytes, name) for end, nbytes, name in marks)

    def _batches(self) -> tuple[list, bool]:
        """The pieces added, cut into batches of :func:`batch_sizes`: lists of ``(source, device buffer, its
        offset, offset in the staging chunk, (descriptor, offset, path, O_DIRECT descriptor or None) or None)``; and
        whether pieces were placed by the address of batch ``k``'s buffer, ``k mod buffers`` (below).

        A piece read with ``O_DIRECT`` (a cold file, :meth:`direct`) is placed in its staging buffer where the
        address agrees with its file offset modulo ``DIRECT_ALIGN`` (a gap of less than that before it), so that
        the fill reads its whole blocks straight from the disk; batches then hold up to a chunk less
        ``DIRECT_ALIGN`` bytes of stream, and a batch that has no room left for a gap ends early."""
        chunk = self.shape.chunk
        aligning = chunk >= 16 * DIRECT_ALIGN and any(p[3] is not None and p[3][3] is not None for p in self.pieces)
        room = chunk - DIRECT_ALIGN if aligning else chunk
        sizes = batch_sizes(self.stream, room, self.ramp if self.shape.buffers > 1 else 0)
        hosts = self.stage.hosts
        batches: list = []
        current: list = []
        k, used, logical = 0, 0, 0  # batch number, bytes of its buffer taken (gaps too), bytes of stream in it
        for source, buffer, at, file in self.pieces:
            n, pos = len(source), 0
            while pos < n:
                size = sizes[k] if k < len(sizes) else room
                if logical >= size or used >= chunk:
                    batches.append(current)
                    current, used, logical, k = [], 0, 0, k + 1
                    continue
                if aligning and file is not None and file[3] is not None:
                    gap = (file[1] + pos - hosts[k % len(hosts)].ctypes.data - used) % DIRECT_ALIGN
                    if used + gap >= chunk:
                        used = chunk  # no room for the gap: the batch ends here
                        continue
                    used += gap
                take = min(size - logical, chunk - used, n - pos)
                if aligning and take < n - pos and file is not None and file[3] is not None:
                    # a batch ends on a block of the file: the next one starts its piece on a block too (a gap of
                    # 0), and no batch boundary costs a read through the page cache for a head and a tail
                    cut = take - (file[1] + pos + take) % DIRECT_ALIGN
                    if cut <= 0:
                        used = chunk  # less than a block of room left: the batch ends here
                        continue
                    take = cut
                where = None if file is None else (file[0], file[1] + pos, file[2], file[3])
                current.append((source[pos:pos + take], buffer, at + pos, used, where))
                used += take
                logical += take
                pos += take
        if current:
            batches.append(current)
        self.pieces = []
        return batches, aligning

    def _parts(self, batch: list, host: np.ndarray) -> list:
        """The batch's copies into ``host`` as fill tasks: lists of ``(destination, source, file)`` (see :func:`fill`)
        of about one part each."""
        part = max(FILL_SPLIT, self.shape.chunk // PART_OF_CHUNK)
        tasks, task, size = [], [], 0
        for source, _buffer, _at, offset, file in batch:
            n, lo = len(source), 0
            while lo < n:
                take = min(part - size, n - lo)
                if take < n - lo and file is not None and file[3] is not None:
                    # a part ends on a block of the file (so on a block of the buffer: the batch placed it so), so
                    # that its O_DIRECT read and the next part's need no head or tail through the page cache
                    cut = take - (file[1] + lo + take) % DIRECT_ALIGN
                    if cut <= 0:
                        tasks.append(task)
                        task, size = [], 0
                        continue
                    take = cut
                task.append((host[offset + lo:offset + lo + take], source[lo:lo + take],
                             None if file is None else (file[0], file[1] + lo, file[2], file[3])))
                size += take
                lo += take
                if size == part:
                    tasks.append(task)
                    task, size = [], 0
        if task:
            tasks.append(task)
        return tasks

    def lease(self) -> int:
        """Lease the staging buffers (once; :meth:`finish` does where the caller did not), of the shape for the
        pieces added: returns how many of their bytes the fills read with ``O_DIRECT``."""
        direct = sum(len(p[0]) for p in self.pieces if p[3] is not None and p[3][3] is not None)
        if self.stage is not None:
            return direct
        # A fill that reads with O_DIRECT waits on the disk and uses next to no CPU: as many fill threads as the
        # direct reads' queue depth (DIRECT_THREADS), however few the cores, keep the disk as busy as a pooled
        # load's reads into its arena (docs/reading.md: 2 fill threads read a cold file at about half its rate),
        # with the buffers that many threads fill at once (staging_shape's rule, as on a host of that many cores):
        # with the buffers of 2 threads, 3-4 reads were in the disk's queue and the fills waited for the copies.
        self.threads = self.shape.threads
        if 2 * direct > self.stream:
            cold = staging_shape(self.stream, self.shape.chunk, cpus=DIRECT_THREADS,
                                 max_bytes=getattr(self.pool, "max_staging_bytes", None))
            self.shape = self.shape._replace(buffers=max(self.shape.buffers, cold.buffers))
            self.threads = max(self.shape.threads, DIRECT_THREADS)
        self.stage = lease_staging(self.queue, self.pool, self.shape.chunk, self.shape.buffers)
        return direct

    def finish(self) -> None:
        """Fill and send every batch (see the module docstring); a non-blocking load's staged tensors and regions
        then get one event covering all their copies (a marker: it completes when every command queued before it
        has)."""
        self.lease()
        batches, placed = self._batches()
        stage = self.stage
        # Pieces placed by their buffer's address (a cold load's, _batches): where the buffers' addresses differ
        # modulo DIRECT_ALIGN, each batch must go to the buffer it was placed for.
        fixed = placed and len({host.ctypes.data % DIRECT_ALIGN for host in stage.hosts}) > 1
        pool = None
        if self.threads > 1 and self.stream >= 2 * FILL_SPLIT:
            pool = _fillers(self.threads)
            scope = held_guards()  # the fill threads copy out of the mappings under the caller's guards
        order = _Pipeline(self, batches, fixed)
        futures: list = []
        try:
            if pool is None:
                order.work(caller=True)
            else:
                futures = [pool.submit(scope.run, order.work) for _ in range(self.threads)]
                order.report(wait=True)
                concurrent.futures.wait(futures)
                for future in futures:
                    future.result()
        except BaseException as exc:
            order.fail(exc)
            raise
        finally:
            # Never return while a fill thread still writes into a staging buffer (a failed load's stop early).
            concurrent.futures.wait(futures)
        if not self.blocking and (self.regions or self.tensors):
            import pyopencl as cl

            event = cl.enqueue_marker(self.queue)
            for region in self.regions:
                region[3], region[4] = event, stage
            for t in self.tensors:
                t._event, t._keepalive = event, stage

    @property
    def fill_seconds(self) -> float:
        """Seconds during which at least one fill task was writing into the staging buffers (their waits for copies
        left out): ``bytes / fill_seconds`` is the rate the fill ran at during this load."""
        total, reach = 0.0, float("-inf")
        for began, ended in sorted(self.filled):
            if ended > reach:
                total += ended - max(began, reach)
                reach = ended
        return total

    def _fill(self, pending, task) -> None:
        """:func:`fill`, timed: the wait for ``pending`` first (fill then finds those copies complete), so that the
        time counted is the writing alone."""
        if pending:
            _wait_events(pending)
        began = time.perf_counter()
        reads = fill(pending, task)
        self.filled.append((began, time.perf_counter()))  # list.append: safe from several fill threads
        if reads:
            self.reads.append(reads)

    def _send(self, slot: int, batch: list) -> None:
        """Copy a filled batch from staging buffer ``slot`` to its device buffers (non-blocking); its copies' events
        become the buffer's ``pending``."""
        host = self.stage.hosts[slot]
        events = []
        for source, buffer, at, offset, _file in batch:
            # SAFETY: no fill writes into this staging buffer before it has waited for this event (fill's pending).
            event = send_pinned(self.queue, buffer, host[offset:offset + len(source)], at)
            events.append(event)
            self.events.append(event)
        self.stage.pending[slot] = events
        self.copies += len(events)

    def close(self) -> None:
        """Return the staging buffers to the pool (their pending events go with them); idempotent."""
        stage, self.stage = self.stage, None
        self.reported = None  # the load's bound method: no cycle through the load once it is done
        files, self.files = self.files, {}
        for fd, _mapped, direct in files.values():
            for f in (fd, direct):
                if f is not None and f >= 0:
                    os.close(f)  # every fill has finished: finish() waits for them, also on an error
        if stage is not None:
            stage.release()
