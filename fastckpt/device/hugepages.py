"""Large buffers on CPU devices backed by 2 MiB pages, so that filling a new arena costs a copy, not page faults.

On a CPU OpenCL device (pocl) a new buffer is fresh host memory. glibc maps
allocations above 32 MiB straight from the kernel and unmaps them on free, so
every new arena of that size is untouched memory: the first copy into it takes
one page fault per 4 KiB page (16,384 for 64 MiB, about 27 ms on a virtual
machine, where the copy itself takes 5 ms). Smaller buffers escape this
because glibc recycles their memory, which is why a first load into a new pool
cost 6x a load without one (8 MiB buffers per tensor).

:func:`advise_huge_pages` asks the kernel to back a new buffer with
transparent huge pages (``madvise(MADV_HUGEPAGE)``, honoured when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always``)
before anything touches it: the copy then takes one fault per 2 MiB (measured on
pocl: 64 MiB into a new buffer in 7.5 ms instead of 36 ms). The buffer's memory
is found by mapping it (``WRITE_INVALIDATE_REGION``: nothing is copied), which
on a device sharing host memory returns the buffer's own memory. It is a hint:
anything that does not hold (another OS, a GPU, huge pages turned off, a map
returning other memory) leaves the buffer as it was. The memory stays the
OpenCL runtime's: it frees it as it would any buffer.

:func:`buffer_allocator` is the allocator a :class:`~fastckpt.device.pool.PersistentBufferPool`
uses by default: ``cl.Buffer`` of the size asked, advised when it is at least
``HUGE_MIN`` bytes on a CPU device.

>>> from fastckpt.device import default                       # doctest: +SKIP
>>> dev = default()                                           # doctest: +SKIP
>>> allocate = buffer_allocator(dev.context, dev.queue)       # doctest: +SKIP
>>> allocate(64 << 20).size                                   # doctest: +SKIP
67108864
"""

from __future__ import annotations

import sys

__all__ = ["HUGE_MIN", "HUGE_PAGES", "advise_huge_pages", "buffer_allocator", "host_address", "huge_pages_available",
           "is_oom"]

#: Buffers from this size on are advised (a 2 MiB page needs a 2 MiB-aligned stretch inside the buffer).
HUGE_MIN = 4 << 20
#: False leaves every new buffer as the runtime made it (4 KiB pages): the cold suite's row
#: "load_file(pool) on pocl, 4 KiB pages" measures the arena both ways (docs/reading.md, "Huge pages").
HUGE_PAGES = True

_MADV_HUGEPAGE = 14  # Linux <sys/mman.h>
# OpenCL status codes meaning "no memory for this allocation" (possibly only for now).
_OOM_CODES = {-4, -5, -6}  # MEM_OBJECT_ALLOCATION_FAILURE, OUT_OF_RESOURCES, OUT_OF_HOST_MEMORY
_PAGE = 4096
_available: bool | None = None


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` says an allocation found no memory (``MemoryError``, or an OpenCL error with one of
    the out-of-memory codes): the errors after which a pool frees its idle buffers and tries again.

    >>> is_oom(MemoryError()), is_oom(ValueError("no"))
    (True, False)
    """
    if isinstance(exc, MemoryError):
        return True
    code = getattr(exc, "code", None)
    if code is None and exc.args:
        code = getattr(exc.args[0], "code", None)
    try:
        return int(code) in _OOM_CODES
    except (TypeError, ValueError):
        return False


def huge_pages_available() -> bool:
    """True on Linux when transparent huge pages may be asked for (``enabled`` is ``always`` or ``madvise``).

    >>> isinstance(huge_pages_available(), bool)
    True
    """
    global _available
    if _available is None:
        mode = ""
        if sys.platform.startswith("linux"):
            try:
                with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
                    mode = f.read()
            except OSError:
                mode = ""
        _available = "[always]" in mode or "[madvise]" in mode
    return _available


_madvise_fn = None  # libc's madvise through ctypes, made at the first call; False where there is none


def madvise():
    """libc's ``madvise(address, length, advice)`` (ctypes, errno kept), made once; None where the platform has
    none. The one binding for advice on memory fastckpt owns: huge pages here, prefaulting a new arena
    (:mod:`fastckpt.device.load`)."""
    global _madvise_fn
    if _madvise_fn is None:
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            _madvise_fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                           use_errno=True)(("madvise", libc))
        except (OSError, AttributeError):  # pragma: no cover - no libc madvise
            _madvise_fn = False
    return _madvise_fn or None


def advise_huge_pages(queue, buffer, nbytes: int) -> bool:
    """Ask for huge pages under the first ``nbytes`` of a new, untouched ``buffer``; True when the kernel took it.

    Only for a device that shares host memory (a CPU device); False, and nothing
    changed, anywhere else or when any step fails, except for lack of memory (the
    map makes the runtime allocate the buffer): that error is raised, so that the
    pool frees its idle buffers and retries.
    """
    if nbytes < HUGE_MIN or queue is None or not HUGE_PAGES or not huge_pages_available():
        return False
    advised = []

    def advise_mapped(address: int) -> None:
        start = -(-address // _PAGE) * _PAGE
        end = (address + nbytes) // _PAGE * _PAGE
        advise = madvise()
        advised.append(end > start and advise is not None and advise(start, end - start, _MADV_HUGEPAGE) == 0)

    return host_address(queue, buffer, nbytes, advise_mapped) is not None and advised == [True]


def host_address(queue, buffer, nbytes: int, while_mapped=None) -> int | None:
    """The address of the host memory that is ``buffer`` (its first ``nbytes``), on a CPU device that shares host
    memory (pocl: a map returns the buffer's own memory, which stays where it is after the unmap); None anywhere
    else or when a step fails, except for lack of memory (the map makes the runtime allocate the buffer): that error
    is raised, so that a pool frees its idle buffers and retries. ``while_mapped(address)``, where given, is called
    before the unmap. Used to give the kernel advice about a new buffer's pages (huge pages here, prefaulting in
    :mod:`fastckpt.device.load`); no byte of it is read or written.
    """
    import numpy as np
    import pyopencl as cl

    try:
        device = queue.device
        if not (device.type & cl.device_type.CPU) or not device.host_unified_memory:
            return None
        # A queue of its own: a blocking map on the caller's queue would wait behind every command already queued
        # there (a non-blocking load's copies), and the pool calls this holding its lock.
        private = cl.CommandQueue(queue.context, device)
        # WRITE_INVALIDATE_REGION: the runtime need not copy anything in; a CPU device returns the buffer itself.
        view, _event = cl.enqueue_map_buffer(private, buffer, cl.map_flags.WRITE_INVALIDATE_REGION, 0, (nbytes,),
                                             np.uint8, is_blocking=True)
        try:
            address = view.__array_interface__["data"][0]
            if while_mapped is not None:
                while_mapped(address)
            return address
        finally:
            # Waited for: the first copy into the buffer (on the caller's queue) must not overlap the unmap.
            view.base.release(private).wait()
    except Exception as exc:  # a hint only: the buffer works the same without it
        if is_oom(exc):  # the map made the runtime allocate: let the pool free idle buffers and retry
            raise
        return None


def buffer_allocator(context, queue=None):
    """``allocate(nbytes) -> pyopencl.Buffer`` (read-write) for ``context``; large buffers on a CPU device are
    advised to use huge pages (:func:`advise_huge_pages`, with ``queue``; none without one)."""
    import pyopencl as cl

    flags = cl.mem_flags.READ_WRITE
    cpu = queue is not None and bool(queue.device.type & cl.device_type.CPU) and huge_pages_available()

    def allocate(nbytes, _ctx=context, _flags=flags, _Buffer=cl.Buffer):
        buffer = _Buffer(_ctx, _flags, nbytes)
        if cpu and nbytes >= HUGE_MIN:
            advise_huge_pages(queue, buffer, nbytes)
        return buffer

    return allocate
