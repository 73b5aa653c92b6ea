"""A simulated discrete device: staged copies that take ``bytes / link rate`` of wall time and no CPU, as DMA does.

The staged load path (:mod:`fastckpt.device.staging`) exists for discrete GPUs, which copy from pinned host memory
over a link (PCIe: ~25 GB/s gen 4 x16, ~55 GB/s gen 5 x16) with a DMA engine while the CPU fills the next staging
buffer. This module lets that pipeline run, be tested and be tuned where there is no GPU:

- :class:`SimulatedQueue` is a real OpenCL queue (pocl here: every other command runs on the real device) whose
  ``link`` carries the staged copies (``Stager._send`` sends through ``queue.link`` where a queue has one);
- :class:`SimulatedLink` is the DMA engine: one copy at a time, in the order sent, each occupying the engine for
  ``latency + nbytes / rate`` seconds of wall time, spent asleep (the GIL released, no CPU used). A copy's event is a
  marker on the queue waiting for a ``UserEvent`` that the engine completes at the end of the copy's window, so the
  queue stays in order (a command queued after a staged copy waits for it) and ``wait_for_events`` works on it;
- ``exact=True`` (tests): at the end of the window the bytes really go to the device buffer (a blocking copy on a
  second queue of the same context), so a load can be read back and compared bit for bit; the copy is made as late
  as a DMA engine could read them, so a fill that overwrote its staging buffer too early shows up as wrong bytes.
  ``exact=False`` (the bench's timed runs): nothing is copied, so the link costs no CPU; the device buffers keep
  what they held;
- in both modes the engine samples the bytes it reads (``min(64 KiB, n / 64)`` apart, and the last byte) when a
  copy starts and again when it ends: :attr:`SimulatedLink.torn` lists copies whose bytes changed while the engine
  read them (a fill into a buffer still being copied), and :meth:`SimulatedLink.check` compares the samples with
  the bytes that belong there.

The engine's thread runs real-time where the process may ask for it (``realtime=True``, the default:
``SCHED_FIFO`` at the lowest priority; :attr:`SimulatedLink.realtime` says whether it was granted). A DMA engine
completes a copy on time whatever the host's cores are doing; an ordinary thread waits for a core to wake up on, and
on this project's shared 2-core VM (load average 6, both cores filling) the copies' events completed 0.64 ms
(median) and 3.5 ms (90th percentile) after the end of their windows, against 0.08 and 0.15 ms real-time
(``bench --suite link``, 256 MiB at 20 GB/s, 10 loads each). The thread sleeps through its windows, so it takes
next to no time from the others.

Timing model: the engine takes copy ``k`` at ``start = max(sent, end of copy k - 1)`` and completes it at
``end = start + latency + nbytes / rate`` or later (a sleep overshoots, never undershoots), so ``n`` bytes sent at
once take at least ``n / rate`` and the engine never runs two copies at once. Only staged copies travel the link;
other commands on the queue (unstaged copies, maps) run on the real device at its own speed.

>>> from fastckpt.device import default                                      # doctest: +SKIP
>>> dev = default("cpu")                                                     # doctest: +SKIP
>>> with SimulatedQueue(dev.context, rate=2e9) as queue:                     # doctest: +SKIP
...     loaded = load_file("model.safetensors", queue, staging=True)         # 2 GB/s link
...     [(c.nbytes, round(c.end - c.start, 4)) for c in queue.link.copies][:1]
[(67108864, 0.0336)]
"""

from __future__ import annotations

import os
import queue as queues
import threading
import time
import weakref
from typing import Callable, NamedTuple

import numpy as np

__all__ = ["SimulatedLink", "SimulatedQueue", "LinkCopy", "samples_of", "SAMPLE_STRIDE"]

# The bytes a copy's samples are taken from: one every SAMPLE_STRIDE bytes at most (64 at least per copy), and the last.
SAMPLE_STRIDE = 64 * 1024


class LinkCopy(NamedTuple):
    """One copy over a :class:`SimulatedLink`: ``perf_counter`` seconds when it was sent, when the engine took it,
    the end of its window and when its event was completed; its destination (``buffer``'s ``int_ptr``, byte ``at``)
    and the address of the host bytes it read."""

    nbytes: int
    sent: float
    start: float
    end: float
    done: float
    buffer: int
    at: int
    host: int


def samples_of(data: np.ndarray) -> np.ndarray:
    """The bytes of flat uint8 ``data`` a :class:`SimulatedLink` samples (a copy; see the module docstring).

    >>> samples_of(np.arange(200, dtype=np.uint8)).tolist()[:4], len(samples_of(np.zeros(1 << 20, np.uint8)))
    ([0, 3, 6, 9], 65)
    """
    n = len(data)
    if n == 0:
        return data[:0].copy()
    stride = max(1, min(SAMPLE_STRIDE, n // 64))
    return np.concatenate([data[::stride], data[-1:]])


class _Job(NamedTuple):
    buffer: object
    host: np.ndarray
    at: int
    user: object
    sent: float
    before: np.ndarray


def _realtime() -> bool:
    """Ask for this thread to run before ordinary ones (``SCHED_FIFO``, the lowest real-time priority); whether it
    was granted (it needs ``CAP_SYS_NICE`` or an ``RLIMIT_RTPRIO``, else the thread keeps its priority)."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(os.sched_get_priority_min(os.SCHED_FIFO)))
    except (AttributeError, OSError):
        return False
    return True


def _engine(jobs: queues.SimpleQueue, link_ref: Callable, copier) -> None:
    """The engine's thread: takes the jobs in order and completes each at the end of its window. Holds the link only
    weakly between jobs, so a dropped link stops it (its finalizer sends ``None``)."""
    import pyopencl as cl

    link = link_ref()
    if link is not None:
        link.realtime = link.realtime and _realtime()
        link._started.set()
        del link
    free_at = 0.0
    while True:
        job = jobs.get()
        if job is None:
            return
        link = link_ref()
        if link is None:
            return
        start = max(job.sent, free_at)
        n = len(job.host)
        end = start + link.latency + (n / link.rate if link.rate else 0.0)
        free_at = end
        status = cl.command_execution_status.COMPLETE
        try:
            wait = end - time.perf_counter()
            if wait > 0:
                time.sleep(wait)  # the DMA engine's time: no CPU
            if link.exact and n:
                cl.enqueue_copy(copier, job.buffer, job.host, dst_offset=job.at, is_blocking=True)
            after = samples_of(job.host)
            with link._lock:
                if not np.array_equal(after, job.before):
                    link.torn.append((job.buffer.int_ptr, job.at, n))
                link._samples.append((job.buffer.int_ptr, job.at, n, job.before, after))
        except Exception as exc:  # the load waiting for this copy fails instead of hanging
            link.errors.append(exc)
            status = -1
        done = time.perf_counter()
        with link._lock:
            link.copies.append(LinkCopy(n, job.sent, start, end, done, job.buffer.int_ptr, job.at,
                                        job.host.ctypes.data))
        del link
        job.user.set_status(status)


class SimulatedLink:
    """A DMA engine between host memory and one device, of ``rate`` bytes per second (``None``: no wait) plus
    ``latency`` seconds per copy (see the module docstring). ``copies`` logs every copy, ``torn`` the copies whose
    bytes changed while they were read, ``errors`` what failed in the engine; ``realtime`` whether the engine's
    thread runs real-time (asked for with ``realtime=True``, granted where the process may). :meth:`close` stops
    its thread.

    >>> from fastckpt.device import default                                              # doctest: +SKIP
    >>> dev = default("cpu"); link = SimulatedLink(dev.context, dev.device, rate=1e9)   # doctest: +SKIP
    >>> buf = cl.Buffer(dev.context, cl.mem_flags.READ_WRITE, 1 << 20)                  # doctest: +SKIP
    >>> link.copy(dev.queue, buf, np.ones(1 << 20, np.uint8), 0).wait()                 # doctest: +SKIP
    >>> link.copies[0].end - link.copies[0].start >= (1 << 20) / 1e9                    # doctest: +SKIP
    True
    """

    def __init__(self, context, device=None, rate: float | None = None, *, exact: bool = True,
                 latency: float = 0.0, realtime: bool = True):
        import pyopencl as cl

        if rate is not None and not rate > 0:
            raise ValueError(f"a simulated link's rate is in bytes per second, above 0 (or None: no wait); "
                             f"got {rate!r}")
        if latency < 0:
            raise ValueError(f"a simulated link's latency is in seconds, 0 or more; got {latency!r}")
        self.context = context
        self.rate = rate
        self.latency = float(latency)
        self.exact = bool(exact)
        self.copies: list[LinkCopy] = []
        self.torn: list = []
        self.errors: list = []
        self._samples: list = []
        self._lock = threading.Lock()
        self.realtime = bool(realtime)  # the engine's thread runs real-time (see the module docstring)
        self._started = threading.Event()
        device = device if device is not None else context.devices[0]
        copier = cl.CommandQueue(context, device)  # the exact copies: never behind the markers of the load's queue
        self._jobs: queues.SimpleQueue = queues.SimpleQueue()
        self._thread = threading.Thread(target=_engine, args=(self._jobs, weakref.ref(self), copier),
                                        name="fastckpt-simulated-link", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._jobs.put, None)
        self._started.wait()  # realtime says what the engine's thread was granted

    def copy(self, queue, buffer, host: np.ndarray, at: int):
        """Send the flat uint8 ``host`` (pinned staging memory) to ``buffer`` at byte ``at``; the copy's event on
        ``queue`` (completes at the end of the copy's window). Like ``enqueue_copy(..., is_blocking=False)``."""
        import pyopencl as cl

        user = cl.UserEvent(self.context)
        # SAFETY: the job keeps ``host`` (and so its staging buffer's mapping) alive until the engine is done with it.
        self._jobs.put(_Job(buffer, host, int(at), user, time.perf_counter(), samples_of(host)))
        return cl.enqueue_marker(queue, wait_for=[user])

    def reset(self) -> None:
        """Forget the logged copies, samples and torn copies (between timed runs)."""
        with self._lock:
            self.copies.clear()
            self._samples.clear()
            self.torn.clear()

    def check(self, expected: Callable[[int, int, int], np.ndarray]) -> int:
        """Compare every copy's samples (taken as it started and as it ended) with ``expected(buffer, at, nbytes)``,
        the flat uint8 bytes that belong at byte ``at`` of the buffer whose ``int_ptr`` is ``buffer``; the number of
        copies checked. ``AssertionError`` names the first copy that brought other bytes.

        >>> link.check(lambda buffer, at, n: data[at:at + n])    # doctest: +SKIP
        12
        """
        with self._lock:
            samples = list(self._samples)
        for buffer, at, n, before, after in samples:
            want = samples_of(np.asarray(expected(buffer, at, n), dtype=np.uint8).reshape(-1))
            for when, got in (("started", before), ("ended", after)):
                if not np.array_equal(got, want):
                    raise AssertionError(f"the simulated link's copy of {n} bytes to byte {at} of buffer "
                                         f"{buffer:#x} read other bytes than the load's when it {when}")
        return len(samples)

    def close(self) -> None:
        """Stop the engine's thread once the copies sent have completed; idempotent."""
        self._finalizer()
        self._thread.join()

    def __repr__(self) -> str:
        rate = "no wait" if self.rate is None else f"{self.rate / 1e9:g} GB/s"
        return f"<SimulatedLink {rate}, {'exact' if self.exact else 'timing only'}, {len(self.copies)} copies>"


def _queue_class():
    import pyopencl as cl

    class SimulatedQueue(cl.CommandQueue):
        """An OpenCL queue on a real device whose staged copies travel a :class:`SimulatedLink` (``link``) of
        ``rate`` bytes per second: a discrete device, simulated, for tests and the bench. A context manager: leaving
        it stops the link's thread.

        >>> from fastckpt.device import default                                         # doctest: +SKIP
        >>> dev = default("cpu")                                                        # doctest: +SKIP
        >>> with SimulatedQueue(dev.context, rate=10e9) as queue:                       # doctest: +SKIP
        ...     loaded = load_file(path, queue, staging=True)
        """

        def __init__(self, context, device=None, *, rate: float | None = None, exact: bool = True,
                     latency: float = 0.0, realtime: bool = True):
            device = device if device is not None else context.devices[0]
            super().__init__(context, device)
            self.link = SimulatedLink(context, device, rate, exact=exact, latency=latency, realtime=realtime)

        def close(self) -> None:
            self.finish()
            self.link.close()

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.close()

    SimulatedQueue.__module__ = __name__
    SimulatedQueue.__qualname__ = "SimulatedQueue"
    return SimulatedQueue


def __getattr__(name: str):
    # pyopencl is imported only when the queue class is first asked for (fastckpt imports no pyopencl eagerly).
    if name == "SimulatedQueue":
        cls = globals()["SimulatedQueue"] = _queue_class()
        return cls
    raise AttributeError(name)
