"""The ``cold`` suite: loads from files that are not in the page cache, each in a fresh process, against the bound.

What an inference service pays at start-up is a new process reading a model
file that is not in the page cache. ``python -m fastckpt bench --suite cold``
writes a safetensors file of ``--tensors`` float32 tensors (``--mib`` MiB in
all), the same tensors as a Hugging Face sharded directory (4 shards) and a
``.netcl`` model of about the same size, then measures every row below
``--runs`` times, in rounds (every row once per round, in a shuffled order, so
that a change of the shared machine's load hits every row alike). Each
measurement is a fresh Python process (:func:`measure_one`, run as
``python -m fastckpt.bench.cold --worker ROW ...``) that imports what the row
needs, sets up its device and pool, then drops the row's files from the page
cache (``posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)``; a mapping still
holding the pages would keep them, and none exists yet), and only then starts
the clock; the clock stops when every byte is in its destination (host arrays,
or device memory with the copies waited for). The CPU time the process spent
meanwhile (user + system, all its threads) is kept too: on a machine whose
cores are shared it says what a path costs when the wall clock cannot. After the clock, every row is
checked exact (CRC-32C of every tensor against those of the arrays written, or
of the whole file for the bounds) and its peak RSS is read (``VmHWM``, the
whole process: interpreter, numpy, pocl and the loaded bytes).

Rows (``ROWS``):

* bounds: a plain buffered sequential ``readinto`` of the file into one array,
  64 MiB at a time; ``preadv`` of 16 MiB pieces from 2 and 4 threads
  (buffered); ``O_DIRECT`` ``preadv`` into page-aligned memory from 1, 4 and 16
  threads, and from 4 threads into memory on 2 MiB pages. The fastest is the
  bound (this machine's disk is a virtual one that its host caches, so a
  buffered read can beat a direct one). A direct read into scattered 4 KiB
  pages goes to the disk in requests of at most ``max_segments`` pages (about
  550 KiB here), one into 2 MiB pages in requests of ``max_sectors_kb`` (4
  MiB): the loads that read into huge pages (a pooled arena, the staging
  buffers on pocl) would pass a bound of small requests only, so the plain
  read into huge pages is one of the bounds;
* fastckpt, host: ``fastckpt.open`` + a copy of every tensor, the same with
  ``backend="pread"`` (whose ``host()`` arrays are copies already),
  ``load_tree`` (private writable arrays), ``fastckpt.open`` of the HF directory
  + copies; the two ``fastckpt.open`` rows once more without the reader's
  read-ahead advice (``, kernel readahead``:
  :data:`fastckpt.formats.reader.READ_AHEAD_ADVICE` False, the page cache filled
  in large folios by the copies' faults, as ``safetensors.numpy``'s plain
  ``mmap`` is), and the file's once more copied into arrays numpy leaves on 4
  KiB pages (``into 4 KiB pages``: no ``MADV_HUGEPAGE``, as
  ``safetensors.numpy``'s ``bytearray`` copies are);
* fastckpt, device (pocl: the device shares host memory): ``load_file(path,
  queue, pool=pool)``, the same with ``staging=True`` (the discrete-GPU route),
  ``load_file`` of the HF directory, ``load_model`` of the ``.netcl`` file into
  a pool; the pooled load once more with the arena left on 4 KiB pages (no
  ``MADV_HUGEPAGE``, :data:`fastckpt.device.hugepages.HUGE_PAGES`);
* peers, where they import: ``safetensors.numpy.load_file``,
  ``safetensors.torch.load_file`` (every tensor touched), fastsafetensors
  (CPU, ``nogds``), Run:ai Model Streamer (``SafetensorsStreamer``, tensors
  cloned). A row whose imports fail says so once and is left out.

Share of the bound is the row's GB/s over the fastest bound's (the ``.netcl``
and HF rows read files of their own, of nearly the same size). ``--quick``: 32 MiB,
one run, no 16-thread direct read: a smoke test of seconds.

>>> [row for row in ROWS if ROWS[row][0] == "bound"][:2]
['bound: buffered readinto, 64 MiB', 'bound: buffered preadv, 2 threads']
>>> from fastckpt.bench import main
>>> main(["--suite", "cold", "--quick"])  # doctest: +SKIP
"""

from __future__ import annotations

import json
import mmap
import os
import random
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

from fastckpt.bench.timing import format_duration, table_lines

__all__ = ["configure", "run", "measure_one", "ROWS", "drop_cache", "prepare", "select", "table"]

# row -> (kind: "bound" | "fastckpt" | "peer", what it reads: "file" | "dir" | "netcl", needs a device)
ROWS = {
    "bound: buffered readinto, 64 MiB": ("bound", "file", False),
    "bound: buffered preadv, 2 threads": ("bound", "file", False),
    "bound: buffered preadv, 4 threads": ("bound", "file", False),
    "bound: O_DIRECT preadv, 1 thread": ("bound", "file", False),
    "bound: O_DIRECT preadv, 4 threads": ("bound", "file", False),
    "bound: O_DIRECT preadv, 16 threads": ("bound", "file", False),
    "bound: O_DIRECT preadv, 4 threads, into 2 MiB pages": ("bound", "file", False),
    "fastckpt.open + copies": ("fastckpt", "file", False),
    "fastckpt.open(backend='pread') + host()": ("fastckpt", "file", False),
    "fastckpt.load_tree": ("fastckpt", "file", False),
    "fastckpt.open(HF directory) + copies": ("fastckpt", "dir", False),
    "fastckpt.open + copies, kernel readahead": ("fastckpt", "file", False),
    "fastckpt.open(HF directory) + copies, kernel readahead": ("fastckpt", "dir", False),
    "fastckpt.open + copies into 4 KiB pages, kernel readahead": ("fastckpt", "file", False),
    "load_file(pool) on pocl": ("fastckpt", "file", True),
    "load_file(pool) on pocl, 4 KiB pages": ("fastckpt", "file", True),
    "load_file(pool, staging=True) on pocl": ("fastckpt", "file", True),
    "load_file(HF directory, pool) on pocl": ("fastckpt", "dir", True),
    "load_model(.netcl, pool) on pocl": ("fastckpt", "netcl", True),
    "safetensors.numpy.load_file": ("peer", "file", False),
    "safetensors.torch.load_file": ("peer", "file", False),
    "fastsafetensors (CPU, nogds)": ("peer", "file", False),
    "Run:ai SafetensorsStreamer": ("peer", "file", False),
}
QUICK_SKIP = ("bound: O_DIRECT preadv, 16 threads", "bound: buffered preadv, 2 threads",
              "load_file(pool) on pocl, 4 KiB pages", "fastckpt.open(HF directory) + copies, kernel readahead",
              "fastckpt.open + copies into 4 KiB pages, kernel readahead")
KERNEL_READAHEAD = ", kernel readahead"  # rows run with fastckpt.formats.reader.READ_AHEAD_ADVICE = False
_MiB = 1 << 20
PIECE = 16 * _MiB  # the bounds' parallel reads: one piece per preadv
_HUGE = 2 * _MiB


def drop_cache(paths) -> None:
    """Drop every file of ``paths`` (files, or directories whose files are dropped) from the page cache.

    ``posix_fadvise(POSIX_FADV_DONTNEED)`` writes nothing back and drops only clean pages that no mapping holds.

    >>> import tempfile; p = tempfile.mkstemp()[1]; drop_cache([p])
    """
    for path in paths:
        files = [os.path.join(path, n) for n in sorted(os.listdir(path))] if os.path.isdir(path) else [path]
        for name in files:
            fd = os.open(name, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ------------------------------------------------------------------ fixtures (the parent process)

def prepare(directory: str, mib: float, tensors: int, seed: int = 0) -> dict:
    """Write the suite's files into ``directory``; returns the paths and each tensor's expected CRC-32C.

    >>> import tempfile
    >>> fixture = prepare(tempfile.mkdtemp(), 1, 4)
    >>> sorted(fixture), fixture["nbytes"]
    (['crc', 'dir', 'dir_nbytes', 'file', 'file_crc', 'file_size', 'nbytes', 'netcl', 'netcl_crc', 'netcl_nbytes'], 1048576)
    """
    import crc32c

    import fastckpt

    per = max(1, int(mib * _MiB) // tensors // 4)
    rng = np.random.default_rng(seed)
    arrays = {f"layer{i:03d}.weight": rng.integers(0, 2**32, per, dtype=np.uint32).view(np.float32)
              for i in range(tensors)}
    path = os.path.join(directory, "model.safetensors")
    fastckpt.save_safetensors(path, arrays, overwrite=True)
    hf = os.path.join(directory, "hf")
    fastckpt.save_sharded(hf, arrays, max_shard_size=-(-per * 4 * tensors // 4) + 1)
    crc = {name: crc32c.crc32c(a) for name, a in arrays.items()}
    with open(path, "rb") as f:
        file_crc = crc32c.crc32c(f.read())
    nbytes = sum(a.nbytes for a in arrays.values())
    netcl, netcl_crc, netcl_nbytes = _netcl(directory, nbytes)
    dir_nbytes = sum(os.path.getsize(os.path.join(hf, n)) for n in os.listdir(hf))
    return {"file": path, "dir": hf, "netcl": netcl, "crc": crc, "file_crc": file_crc, "netcl_crc": netcl_crc,
            "nbytes": nbytes, "file_size": os.path.getsize(path), "dir_nbytes": dir_nbytes,
            "netcl_nbytes": netcl_nbytes}


def _netcl(directory: str, nbytes: int):
    """A ``.netcl`` model of 8 square ``Linear`` layers of about ``nbytes`` in all, and its tensors' CRC-32C
    (read with ``np.load``, not with fastckpt)."""
    import crc32c

    from fastckpt.device import default
    from fastckpt.io import save_model
    from fastckpt.nn import build_sequential

    width = max(2, int((nbytes / 8 / 4) ** 0.5))
    config = [{"type": "Linear", "args": {"in_features": width, "out_features": width, "bias": True}}] * 8
    path = os.path.join(directory, "model.netcl")
    save_model(build_sequential(default().queue, config), path, overwrite=True)
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files if k != "__netcl_meta__"}
    return path, {k: crc32c.crc32c(np.ascontiguousarray(a)) for k, a in arrays.items()}, \
        sum(a.nbytes for a in arrays.values())


# ------------------------------------------------------------------ one measurement (a fresh process)

def _bound_buffered(path: str, size: int):
    out = np.empty(size, np.uint8)
    view = memoryview(out)
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < size:
            got = f.readinto(view[done:done + 64 * _MiB])
            if not got:
                raise OSError(f"{path}: short read at byte {done}")
            done += got
    return out


def _bound_preadv(path: str, size: int, threads: int, direct: bool, huge: bool = False):
    # O_DIRECT needs page-aligned memory and whole pages: an anonymous mapping rounded up to a page; ``huge``: one
    # starting on 2 MiB, advised MADV_HUGEPAGE (the disk then gets requests of max_sectors_kb, not of as many
    # scattered 4 KiB pages as a request holds segments).
    padded = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    length = max(padded, mmap.PAGESIZE)
    # (private for huge pages: mmap's default anonymous mapping is shared, shmem, whose huge pages are a separate
    # setting, off on many machines)
    block = None if not direct else mmap.mmap(-1, length + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) \
        if huge else mmap.mmap(-1, length)
    out = np.frombuffer(block, np.uint8) if direct else np.empty(size, np.uint8)
    if huge:
        skip = -out.ctypes.data % _HUGE
        block.madvise(getattr(mmap, "MADV_HUGEPAGE", 14))
        out = out[skip:skip + length]
    view = memoryview(out)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    pieces = list(range(0, size, PIECE))
    errors = []

    def worker(k: int) -> None:
        try:
            for lo in pieces[k::threads]:
                hi = min(lo + PIECE, padded if direct else size)
                done = lo
                while done < hi:
                    got = os.preadv(fd, [view[done:hi]], done)
                    if got <= 0:
                        if done >= size:
                            break
                        raise OSError(f"{path}: short read at byte {done}")
                    done += got
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)

    try:
        workers = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        os.close(fd)
    if errors:
        raise errors[0]
    return out[:size]


def _device():
    from fastckpt.device import default
    from fastckpt.device.pool import PersistentBufferPool

    dev = default()
    return dev.queue, PersistentBufferPool(dev.context, dev.queue)


def _setup(row: str, fixture: dict):
    """``(load, check)`` for ``row``: ``load()`` is timed, ``check(result)`` returns ``{name: CRC-32C}``."""
    import crc32c

    file, directory, netcl = fixture["file"], fixture["dir"], fixture["netcl"]
    size = fixture["file_size"]
    copies = lambda result: {k: crc32c.crc32c(np.ascontiguousarray(v)) for k, v in result.items()}  # noqa: E731
    whole = lambda result: {"<file>": crc32c.crc32c(result)}  # noqa: E731
    if row.startswith("bound: buffered readinto"):
        return (lambda: _bound_buffered(file, size)), whole
    if row.startswith("bound:"):
        threads = int(row.split(", ")[1].split()[0])
        direct = "O_DIRECT" in row
        return (lambda: _bound_preadv(file, size, threads, direct, huge="2 MiB pages" in row)), whole
    if row.startswith(("fastckpt.open + copies", "fastckpt.open(HF directory) + copies")):
        import fastckpt

        source = file if "HF" not in row else directory
        if row.endswith(KERNEL_READAHEAD):
            from fastckpt.formats import reader

            if not hasattr(reader, "READ_AHEAD_ADVICE"):  # an older fastckpt: it has only the advice
                raise ImportError("this fastckpt has no fastckpt.formats.reader.READ_AHEAD_ADVICE")
            reader.READ_AHEAD_ADVICE = False
        if "into 4 KiB pages" in row:  # the copies' new arrays without numpy's MADV_HUGEPAGE, as bytearrays are
            from numpy._core.multiarray import _set_madvise_hugepage

            _set_madvise_hugepage(False)

        def load():
            with fastckpt.open(source) as f:
                return {k: np.array(f.host(k)) for k in f.keys()}
        return load, copies
    if row == "fastckpt.open(backend='pread') + host()":
        import fastckpt

        def load():
            with fastckpt.open(file, backend="pread") as f:
                return {k: f.host(k) for k in f.keys()}
        return load, copies
    if row == "fastckpt.load_tree":
        import fastckpt

        def flat(tree, prefix=""):
            out = {}
            for k, v in tree.items():
                out.update(flat(v, prefix + k + "/") if isinstance(v, dict) else {prefix + k: v})
            return out
        return (lambda: fastckpt.load_tree(file)), (lambda tree: copies(flat(tree)))
    if row.startswith("load_file("):
        import fastckpt

        if row.endswith("4 KiB pages"):  # the arena without MADV_HUGEPAGE (an older fastckpt has no switch)
            from fastckpt.device import hugepages

            hugepages.HUGE_PAGES = False
            hugepages._available = False
        queue, pool = _device()
        source = directory if "HF" in row else file
        staging = True if "staging" in row else None
        return (lambda: fastckpt.load_file(source, queue, pool=pool, staging=staging)), \
            (lambda loaded: copies({k: loaded[k].to_host() for k in loaded}))
    if row.startswith("load_model("):
        from fastckpt.io import load_model

        queue, pool = _device()

        return (lambda: load_model(netcl, queue, pool=pool)), (lambda model: copies(model.state_dict()))
    if row == "safetensors.numpy.load_file":
        from safetensors.numpy import load_file

        return (lambda: load_file(file)), copies
    if row == "safetensors.torch.load_file":
        import torch  # noqa: F401 - its import failing leaves the row out
        from safetensors.torch import load_file as torch_load

        def load():
            tensors = torch_load(file)
            for t in tensors.values():  # torch maps the file lazily on some versions: touch every byte
                t.sum()
            return tensors
        return load, (lambda result: copies({k: v.numpy() for k, v in result.items()}))
    if row == "fastsafetensors (CPU, nogds)":
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        def load():
            loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
            loader.add_filenames({0: [file]})
            buffers = loader.copy_files_to_device()
            out = {k: buffers.get_tensor(k).clone() for k in buffers.key_to_rank_lidx}
            buffers.close()
            loader.close()
            return out
        return load, (lambda result: copies({k: v.numpy() for k, v in result.items()}))
    if row == "Run:ai SafetensorsStreamer":
        from runai_model_streamer import SafetensorsStreamer

        def load():
            with SafetensorsStreamer() as streamer:
                streamer.stream_file(file)
                return {name: t.clone() for name, t in streamer.get_tensors()}
        return load, (lambda result: copies({k: v.numpy() for k, v in result.items()}))
    raise ValueError(f"no cold row named {row!r}; rows: {', '.join(ROWS)}")


def _import_readers(device: bool) -> None:
    """Import what a fastckpt row's first call would import (the readers; the device loader), before the clock:
    which modules a package imports lazily, and when, is no part of reading a file, and moved between versions (a
    row timed with them inside its clock measured 60-80 more read calls, the ``.pyc`` files, and up to 50 ms)."""
    import importlib

    for name in ("fastckpt.formats", "fastckpt.formats.reader", "fastckpt.formats.readinto",
                 "fastckpt.formats.hfsharded") + (("fastckpt.device.load",) if device else ()):
        try:
            importlib.import_module(name)
        except ImportError:  # an older fastckpt without one of them: its first call imports what it has
            pass


def measure_one(row: str, fixture: dict) -> dict:
    """Measure ``row`` once in this process: set up, drop the row's files from the page cache, time the load, then
    check it; returns ``{"seconds", "cpu", "exact", "peak_rss"}`` (seconds; bytes), or ``{"skipped": why}`` where the row's
    imports fail.

    >>> measure_one("no such row", {"file": "", "dir": "", "netcl": "", "file_size": 0})
    Traceback (most recent call last):
    ...
    ValueError: no cold row named 'no such row'; rows: ...
    """
    try:
        load, check = _setup(row, fixture)
        if ROWS[row][0] == "fastckpt":
            _import_readers(ROWS[row][2])
    except (ImportError, OSError) as e:
        if isinstance(e, OSError) and not isinstance(e, (FileNotFoundError,)) and "lib" not in str(e):
            raise
        return {"skipped": f"{type(e).__name__}: {e}"}
    reads = ROWS[row][1]
    drop_cache([fixture[reads]])
    device = _device_stat_path(fixture[reads])
    io, faults, disk = _io(), _faults(), _disk_reads(device)
    cpu = os.times()
    start = time.perf_counter()
    result = load()
    wait = getattr(result, "wait", None)
    if callable(wait):
        wait()
    seconds = time.perf_counter() - start
    cpu_after = os.times()
    io_after, faults_after, disk_after = _io(), _faults(), _disk_reads(device)
    cpu_seconds = (cpu_after.user - cpu.user) + (cpu_after.system - cpu.system)
    got = check(result)
    if reads == "netcl":
        expected = fixture["netcl_crc"]
    elif ROWS[row][0] == "bound":
        expected = {"<file>": fixture["file_crc"]}
    else:
        expected = fixture["crc"]
    return {"seconds": seconds, "cpu": cpu_seconds, "exact": got == expected, "peak_rss": _peak_rss(),
            "read_calls": io_after.get("syscr", 0) - io.get("syscr", 0),
            "disk_bytes": io_after.get("read_bytes", 0) - io.get("read_bytes", 0),
            "faults": faults_after - faults,
            "disk_requests": disk_after - disk if disk is not None and disk_after is not None else None}


def _device_stat_path(path: str) -> str | None:
    """``/sys/dev/block/MAJOR:MINOR/stat`` of the block device holding ``path`` (a disk or a partition); None where
    there is none (tmpfs, overlay)."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    stat = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat"
    return stat if os.path.exists(stat) else None


def _disk_reads(stat: str | None) -> int | None:
    """Read requests the block device has completed (the first field of its ``stat``): the whole machine's, not
    this process's alone, so a count taken while nothing else reads from that disk (the bench lock). Bytes read over
    requests is the requests' size: an ``O_DIRECT`` read into scattered 4 KiB pages goes out in requests of at most
    ``max_segments`` pages, one into 2 MiB pages in requests of ``max_sectors_kb``."""
    if stat is None:
        return None
    try:
        with open(stat) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _io() -> dict:
    """This process's ``/proc/self/io`` counters (``syscr``: read system calls, ``read_bytes``: bytes the process
    had fetched from storage, page cache misses that it waited for or asked for), every thread's; {} where absent."""
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f)}
    except (OSError, ValueError):
        return {}


def _faults() -> int:
    """Page faults (minor + major) of this process so far: a copy out of a fresh mapping takes one per fault-around
    block (16 pages), a read into fresh memory one per page of it."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def _peak_rss() -> int:
    """This process's peak RSS (``VmHWM``; ``ru_maxrss`` would be no use: Linux keeps it across ``execve``, so a
    child started by a large parent reports the parent's peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _worker(argv: list[str]) -> int:
    row, fixture_path = argv
    with open(fixture_path) as f:
        fixture = json.load(f)
    result = measure_one(row, fixture)
    if "fastckpt" in sys.modules:
        result["fastckpt"] = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["fastckpt"].__file__)))
    print(json.dumps(result))
    return 0


# ------------------------------------------------------------------ the suite (the parent process)

BEFORE = " (before)"  # the suffix of a row run with the fastckpt of --against


def _base(row: str) -> str:
    return row[: -len(BEFORE)] if row.endswith(BEFORE) else row


def _spawn(row: str, fixture_path: str, against: str | None = None) -> dict:
    """Measure ``row`` in a new process (:func:`~fastckpt.bench.timing.run_script`, in the fixture's directory,
    where no fastckpt is); a ``(before)`` row imports fastckpt from ``against``. Imported here, in the parent: a
    worker of an older fastckpt imports this file's top with its own ``fastckpt.bench.timing``."""
    from fastckpt.bench.timing import run_script

    return run_script(__file__, ["--worker", _base(row), fixture_path], cwd=os.path.dirname(os.path.abspath(fixture_path)),
                      against=against if row.endswith(BEFORE) else None)


def table(samples: dict, fixture: dict) -> list[str]:
    """The markdown table of ``samples`` (``{row: [measurement dicts]}``): median time, GB/s, share of the fastest
    bound, the median CPU time of the process over the load (user + system, every thread), exact, peak RSS, and the
    medians of what the load cost that no load on the machine changes: read system calls, bytes read from the disk
    (``/proc/self/io``) and page faults; and the read requests the disk completed meanwhile (the device's count,
    :func:`_disk_reads`: the read from disk over it is the requests' size).

    >>> fixture = {"file_size": 10**9, "nbytes": 10**9, "dir_nbytes": 10**9, "netcl_nbytes": 10**9}
    >>> print("\\n".join(table({"bound: buffered readinto, 64 MiB": [{"seconds": 1.0, "exact": True,
    ...                                                                "peak_rss": 2**30}]}, fixture)))
    | path | median | GB/s | share of the bound | share of each round's bound | CPU | exact | peak RSS | read calls | read from disk | page faults | disk requests |
    |---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|
    | bound: buffered readinto, 64 MiB | 1.000 s | 1.00 | 1.00 | 1.00 | 0.00 s | yes | 1024 MiB | 0 | 0 MiB | 0 | - |
    """
    nbytes = {"file": fixture["file_size"], "dir": fixture["dir_nbytes"], "netcl": fixture["netcl_nbytes"]}
    rates = {}
    for row, runs in samples.items():
        timed = [r["seconds"] for r in runs if "seconds" in r]
        if timed:
            rates[row] = nbytes[ROWS[_base(row)][1]] / statistics.median(timed) / 1e9
    bound = max((rate for row, rate in rates.items() if ROWS[_base(row)][0] == "bound"), default=None)
    # Each round's own bound (its fastest bound row): every row ran once per round, so a share taken against the
    # bound of the same round is the least touched by the machine's load moving between rounds.
    per_round: dict = {}
    for row, runs in samples.items():
        if ROWS[_base(row)][0] == "bound":
            for k, r in enumerate(runs):
                if "seconds" in r:
                    per_round[k] = max(per_round.get(k, 0.0), nbytes[ROWS[_base(row)][1]] / r["seconds"] / 1e9)
    rows = []
    for row, runs in samples.items():
        if row not in rates:
            why = next((r.get("skipped") or r.get("failed") for r in runs), "")
            rows.append([row, "-", "-", "-", "-", "-", f"left out: {why}"[:120], "-", "-", "-", "-", "-"])
            continue
        timed = [r for r in runs if "seconds" in r]
        median = statistics.median(r["seconds"] for r in timed)
        share = f"{rates[row] / bound:.2f}" if bound else "-"
        exact = "yes" if all(r["exact"] for r in timed) else "NO"
        rss = max(r["peak_rss"] for r in timed)
        cpu = statistics.median(r.get("cpu", 0.0) for r in timed)
        counts = [statistics.median(r.get(k, 0) for r in timed) for k in ("read_calls", "disk_bytes", "faults")]
        requests = [r["disk_requests"] for r in timed if r.get("disk_requests") is not None]
        rounds = ", ".join(f"{nbytes[ROWS[_base(row)][1]] / r['seconds'] / 1e9 / per_round[k]:.2f}"
                           for k, r in enumerate(runs) if "seconds" in r and per_round.get(k))
        rows.append([row, format_duration(median), f"{rates[row]:.2f}", share, rounds or "-", f"{cpu:.2f} s", exact,
                     f"{rss / _MiB:.0f} MiB", f"{counts[0]:.0f}", f"{counts[1] / _MiB:.0f} MiB", f"{counts[2]:.0f}",
                     f"{statistics.median(requests):.0f}" if requests else "-"])
    return table_lines(["path", "median", "GB/s", "share of the bound", "share of each round's bound", "CPU", "exact",
                        "peak RSS", "read calls", "read from disk", "page faults", "disk requests"], rows,
                       "lrrrrrlrrrrr")


class _Busy:
    """``n`` busy processes for as long as the ``with`` block runs (``--busy``): each allocates, touches and frees
    64 MiB and does pure-Python work in a loop, as the tests and builds of other work on a shared machine do. They
    are ended (by their process, one by one) when the block ends.

    >>> with _Busy(0) as b:
    ...     b.procs
    []
    """

    CODE = ("import numpy as np\nwhile True:\n    a = np.ones(1 << 24, np.float32)\n    a.sum()\n    del a\n"
            "    sum(range(200000))\n")

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        import subprocess

        self.procs = [subprocess.Popen([sys.executable, "-c", self.CODE], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL) for _ in range(self.n)]
        return self

    def __exit__(self, *exc):
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait()


def configure(parser) -> None:
    """Add the cold suite's options to ``parser``.

    >>> import argparse
    >>> parser = argparse.ArgumentParser(); configure(parser)
    >>> args = parser.parse_args(["--quick"]); args.runs, args.mib
    (5, 512.0)
    """
    parser.add_argument("--quick", action="store_true", help="32 MiB, one run per row (seconds; a smoke test)")
    parser.add_argument("--mib", type=float, default=512.0, help="size of the safetensors file (default 512)")
    parser.add_argument("--tensors", type=int, default=16, help="float32 tensors in it (default 16)")
    parser.add_argument("--runs", type=int, default=5, help="fresh-process runs per row; the median is reported")
    parser.add_argument("--row", action="append",
                        help="run only this row and the bounds (repeatable; a prefix of the row's name, or of "
                             "'peer: NAME' for a peer, matches)")
    parser.add_argument("--dir", default=None, help="where to write the files (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="also write every measurement to this JSON file")
    parser.add_argument("--seed", type=int, default=0, help="shuffles the rows' order in each round")
    parser.add_argument("--busy", type=int, default=0,
                        help="run this many busy processes meanwhile (each a loop of 64 MiB allocated, touched and "
                             "freed, and pure-Python work): a machine shared with other work, made on purpose")
    parser.add_argument("--against", default=None,
                        help="a folder holding another fastckpt (a checkout of an earlier commit, built): every "
                             "fastckpt row runs with it too, marked (before), in the same rounds")


def select(rows: list[str], prefixes: list[str]) -> list[str]:
    """The rows of ``rows`` that ``--row`` asks for: a row whose name, or ``kind: name`` (``peer:
    safetensors.numpy.load_file``), starts with one of ``prefixes``, and every bound row, which the shares are taken
    against. A prefix that names no row is an error, not a table without it.

    >>> select(list(ROWS), ["peer: safetensors.numpy"])[-1]
    'safetensors.numpy.load_file'
    >>> select(list(ROWS), ["fastckpt.opn"])
    Traceback (most recent call last):
    ...
    SystemExit: --row 'fastckpt.opn' names no cold row; rows: ...
    """
    names = {r: (r, f"{ROWS[r][0]}: {r}") for r in rows}
    for prefix in prefixes:
        if not any(n.startswith(prefix) for r in rows for n in names[r]):
            raise SystemExit(f"--row {prefix!r} names no cold row; rows: {', '.join(rows)}")
    return [r for r in rows if ROWS[r][0] == "bound" or any(n.startswith(p) for n in names[r] for p in prefixes)]


def run(args) -> int:
    """Run the cold suite; prints the table, returns 0 (1 where a row was not exact).

    >>> from fastckpt.bench import main
    >>> main(["--suite", "cold", "--quick"])  # doctest: +SKIP
    """
    mib, runs = (32.0, 1) if args.quick else (args.mib, args.runs)
    if runs < 1:
        raise SystemExit(f"--runs must be at least 1, not {runs}")
    rows = [r for r in ROWS if not (args.quick and r in QUICK_SKIP)]
    if args.row:
        rows = select(rows, args.row)
    if args.against:
        rows += [r + BEFORE for r in rows if ROWS[r][0] == "fastckpt"]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="fastckpt-cold-") as tmp, _Busy(args.busy):
        fixture = prepare(tmp, mib, args.tensors)
        fixture_path = os.path.join(tmp, "fixture.json")
        with open(fixture_path, "w") as f:
            json.dump(fixture, f)
        samples: dict = {row: [] for row in rows}
        order = list(rows)
        shuffle = random.Random(args.seed).shuffle
        for _ in range(runs):
            shuffle(order)
            for row in order:
                if samples[row] and ("skipped" in samples[row][0] or "failed" in samples[row][0]):
                    continue
                samples[row].append(_spawn(row, fixture_path, args.against))
        print(f"## cold loads: {fixture['nbytes'] / _MiB:.0f} MiB in {args.tensors} float32 tensors "
              f"(HF directory: {fixture['dir_nbytes'] / _MiB:.0f} MiB in 4 shards; .netcl: "
              f"{fixture['netcl_nbytes'] / _MiB:.0f} MiB), page cache dropped before each run, a fresh process per "
              f"run, median of {runs}, {os.cpu_count()} CPUs"
              f"{f', {args.busy} busy processes meanwhile' if args.busy else ''}, load average "
              f"{os.getloadavg()[0]:.1f} at the end\n")
        print("\n".join(table(samples, fixture)))
        imported = {}
        for row, runs_ in samples.items():
            for r in runs_:
                if "fastckpt" in r:
                    imported.setdefault("(before) rows" if row.endswith(BEFORE) else "rows", set()).add(r["fastckpt"])
        if imported:
            print("\n" + "; ".join(f"{which} ran fastckpt from {', '.join(sorted(where))}"
                                  for which, where in sorted(imported.items())))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"fixture": {k: v for k, v in fixture.items() if "crc" not in k}, "samples": samples},
                          f, indent=1)
    bad = [row for row, runs_ in samples.items() if any(r.get("exact") is False for r in runs_)]
    if bad:
        print(f"\nNOT EXACT: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(_worker(sys.argv[2:]))
    from fastckpt.bench import main

    sys.exit(main(["--suite", "cold", *sys.argv[1:]]))
