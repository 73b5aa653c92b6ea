"""The timing harness every benchmark suite uses, and the small helpers their markdown tables share.

:func:`round_robin` times several named callables side by side: one run of
each per round, in an order shuffled every round (seeded, so runs repeat),
each run after a garbage collection and, where asked, an ``os.sync()`` and a
short idle; it returns the median and the best of each path's runs
(:class:`Timing`). :func:`summarize` gives the same two figures for samples a
suite has to take itself (a sequence whose runs depend on one another).

The formatting helpers turn seconds, byte counts and ratios into the short
strings the tables show, and :func:`table_lines` writes a markdown table's
header, rule and rows.

>>> timings = round_robin({"sum": lambda: sum(range(1000)), "sorted": lambda: sorted(range(1000))}, repeat=3)
>>> list(timings)
['sum', 'sorted']
>>> timings["sum"].best <= timings["sum"].median
True
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

__all__ = ["add_repeat_option", "run_script", "Timing", "paired_ratio", "round_robin", "summarize", "format_duration", "format_size", "format_ratio",
           "table_lines",
           "PeakMemory"]


class Timing(NamedTuple):
    """The median and the best (shortest) of one path's timed runs, in seconds.

    A plain pair, so ``median, best = timing`` works.

    >>> Timing(median=0.002, best=0.001).median
    0.002
    """

    median: float
    best: float


def summarize(samples: Iterable[float]) -> Timing:
    """The :class:`Timing` (median and best) of seconds a suite measured itself.

    >>> summarize([0.3, 0.1, 0.2])
    Timing(median=0.2, best=0.1)
    """
    samples = list(samples)
    if not samples:
        raise ValueError("no samples to summarize")
    return Timing(statistics.median(samples), min(samples))


def paired_ratio(first: list[float] | None, second: list[float] | None) -> float | None:
    """The median over rounds of ``first[i] / second[i]``, the seconds of two paths timed in the same rounds (each
    round runs every path once): what the load of a shared machine does to both within a round cancels, where it
    moved the medians of each apart. None where no round has both.

    >>> paired_ratio([1.0, 2.0, 4.0], [1.0, 2.5, 4.0]), paired_ratio([1.2, 3.0, 1.1], [1.0, 1.0, 1.0])
    (1.0, 1.2)
    >>> paired_ratio([], []) is None, paired_ratio(None, [1.0]) is None
    (True, True)
    """
    pairs = [a / b for a, b in zip(first or (), second or ()) if b > 0]
    return statistics.median(pairs) if pairs else None


def round_robin(paths: Mapping[str, Callable[[], object]], repeat: int, *, warmup: int = 1,
                prepare: Mapping[str, Callable[[], object]] | None = None,
                max_runs: Mapping[str, int] | None = None, settle: float = 0.0, sync: bool = False,
                time_release: bool = True, seed: int | None = 0) -> dict[str, Timing]:
    """Time every path ``repeat`` times, one run of each per round; returns ``{name: Timing}`` in ``paths``' order.

    On a shared machine the load changes over seconds. Taking the paths in turn
    lets every path meet the same conditions, where timing one path's runs back
    to back would favour whichever ran in a quiet moment; so the ratios between
    paths stay meaningful. The order is shuffled every round (``random.Random(seed)``)
    because some costs land on whatever runs next (the blocks of a large file
    removed by one path are freed while the next path writes); ``seed=None``
    keeps the order of ``paths`` in every round.

    Before the timed rounds every path runs ``warmup`` times untimed (page cache,
    compiled kernels, imports, pools). Before each run, untimed and in this order:

    * ``prepare[name]()``, where given (for instance: remove the file the
      previous run of that path wrote, so that every save writes a new file);
    * ``gc.collect()``, so that no path pays for another's garbage;
    * ``os.sync()`` with ``sync=True``: the kernel writes back every dirty page,
      otherwise a write without fsync leaves hundreds of MiB dirty and whichever
      path runs next pays for their write-back (1.6-2 s stalls of a 0.5 s save);
    * ``settle`` seconds of idle: on pocl a copy issued straight after a
      collection was measured several milliseconds slower (4.7 ms instead of
      0.3 ms for 4 MiB from a mapped file), an effect of the collection, not of
      the path being timed.

    ``max_runs[name] = k`` limits a slow path to the first ``k`` rounds. With
    ``time_release=True`` a run's time includes dropping what the callable
    returned (freeing the buffers or leases it made); with ``False`` the result
    is kept until the clock has stopped.

    >>> t = round_robin({"a": lambda: None, "b": lambda: None}, repeat=5, max_runs={"b": 2})
    >>> sorted(t), all(x.best <= x.median for x in t.values())
    (['a', 'b'], True)
    """
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, not {repeat}")
    prepare = prepare or {}
    max_runs = max_runs or {}
    for _ in range(warmup):
        for name, fn in paths.items():
            prepare.get(name, _nothing)()
            fn()
    times: dict[str, list[float]] = {name: [] for name in paths}
    order = list(paths.items())
    shuffle = random.Random(seed).shuffle if seed is not None else _nothing
    for round_number in range(repeat):
        shuffle(order)
        for name, fn in order:
            if round_number >= max(1, max_runs.get(name, repeat)):
                continue
            prepare.get(name, _nothing)()
            gc.collect()
            if sync:
                os.sync()
            if settle:
                time.sleep(settle)
            if time_release:
                start = time.perf_counter()
                fn()  # the result is dropped before the clock stops
                times[name].append(time.perf_counter() - start)
            else:
                start = time.perf_counter()
                result = fn()
                times[name].append(time.perf_counter() - start)
                del result
    return {name: summarize(samples) for name, samples in times.items()}


def _nothing(*_) -> None:
    pass


def format_duration(seconds: float, *, ms_digits: int = 2, micro: bool = True) -> str:
    """Seconds as the tables show them: µs (with ``micro``) below 1 ms, ms below 1 s, else s.

    >>> format_duration(0.00042), format_duration(0.0123), format_duration(1.5)
    ('420 µs', '12.30 ms', '1.500 s')
    >>> format_duration(0.00042, ms_digits=3, micro=False)
    '0.420 ms'
    """
    if micro and seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    return f"{seconds * 1e3:.{ms_digits}f} ms" if seconds < 1 else f"{seconds:.3f} s"


def format_size(nbytes: int) -> str:
    """A byte count in whole MiB from 1 MiB up, else in whole KiB.

    >>> format_size(512 * 2**20), format_size(4096)
    ('512 MiB', '4 KiB')
    """
    return f"{nbytes / 2**20:.0f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def format_ratio(ratio: float) -> str:
    """A ratio with two decimals, or none from 100 up.

    >>> format_ratio(1.234), format_ratio(861.4)
    ('1.23x', '861x')
    """
    return f"{ratio:.2f}x" if ratio < 100 else f"{ratio:.0f}x"


def table_lines(header: Sequence[str], rows: Iterable[Sequence[object]], align: str) -> list[str]:
    """A markdown table's lines: header, rule (``align``: one ``l`` or ``r`` per column), then one line per row.

    >>> print("\\n".join(table_lines(["path", "median"], [["a", "1.00 ms"]], "lr")))
    | path | median |
    |---|---:|
    | a | 1.00 ms |
    """
    if len(align) != len(header) or set(align) - {"l", "r"}:
        raise ValueError(f"align must hold one 'l' or 'r' per column, not {align!r}")
    rule = "|" + "".join("---:|" if a == "r" else "---|" for a in align)
    return [_row(header), rule, *(_row(row) for row in rows)]


def _row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


# ------------------------------------------------------------------ peak memory

_STATUS = Path("/proc/self/status")


def _status(*fields: str) -> dict[str, int] | None:
    """Fields of ``/proc/self/status`` in bytes, or None where there is none."""
    try:
        text = _STATUS.read_text()
    except OSError:
        return None
    out = {}
    for name in fields:
        found = re.search(rf"^{name}:\s+(\d+) kB", text, re.MULTILINE)
        if found is None:
            return None
        out[name] = int(found.group(1)) * 1024
    return out


def _reset_high_water() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to VmRSS (Linux >= 4.0)
        return True
    except OSError:
        return False


class PeakMemory:
    """The growth of the process's peak RSS (and of its sampled anonymous memory) over a ``with`` block.

    ``growth``: ``VmHWM`` at the end less ``VmRSS`` at the start, the high-water mark reset at the start
    (where it cannot be, less ``VmHWM`` at the start: a lower bound, ``reset`` False); ``anon_growth``: the
    largest ``RssAnon`` sampled every 5 ms less the one at the start. None where ``/proc`` is not there.

    >>> import numpy as np
    >>> with PeakMemory() as peak:
    ...     block = np.ones(2**25, np.uint8)
    >>> peak.growth is None or isinstance(peak.growth, int)  # how much depends on the allocator's reuse
    True
    """

    growth: int | None = None
    anon_growth: int | None = None
    reset = False

    def __enter__(self) -> PeakMemory:
        gc.collect()
        self.reset = _reset_high_water()
        self._start = _status("VmRSS", "VmHWM", "RssAnon")
        self._stop = threading.Event()
        self._anon_peak = self._start["RssAnon"] if self._start else 0
        if self._start:
            self._sampler = threading.Thread(target=self._sample, daemon=True, name="fastckpt-bench-rss")
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            now = _status("RssAnon")
            if now:
                self._anon_peak = max(self._anon_peak, now["RssAnon"])

    def __exit__(self, *exc) -> None:
        end = _status("VmHWM", "RssAnon")
        if self._start is None:
            return
        self._stop.set()
        self._sampler.join()
        if end is None:
            return
        before = self._start["VmRSS"] if self.reset else self._start["VmHWM"]
        self.growth = max(0, end["VmHWM"] - before)
        self.anon_growth = max(0, max(self._anon_peak, end["RssAnon"]) - self._start["RssAnon"])


def add_repeat_option(parser: argparse.ArgumentParser, *, dest: str, default: int | None, help: str) -> None:
    """Add the option of every suite for how many timed runs to make: ``--repeat N``; ``--repeats`` and ``--runs``,
    the spellings some suites had, are accepted too (and not listed), each into ``dest``.

    >>> parser = argparse.ArgumentParser()
    >>> add_repeat_option(parser, dest="runs", default=5, help="timed runs")
    >>> [parser.parse_args(args).runs for args in ([], ["--repeat", "2"], ["--repeats", "3"], ["--runs", "4"])]
    [5, 2, 3, 4]
    """
    parser.add_argument("--repeat", dest=dest, type=int, default=default, metavar="N", help=help)
    parser.add_argument("--repeats", "--runs", dest=dest, type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def run_script(path: str, args: Sequence[str], *, cwd: str, against: str | None = None, timeout: float = 900) -> dict:
    """Run the Python file ``path`` in a new interpreter with ``args`` and return the JSON object on the last line
    of its output, or ``{"failed": the last line of its errors}``.

    The child imports the fastckpt of ``against`` (a folder holding an earlier one, for the "(before)" rows of a
    suite), else the one this process runs, before any other. ``cwd`` must hold no fastckpt: ``python -c`` puts its
    working directory first on ``sys.path``, ahead of ``PYTHONPATH``, and the file is run by path (``runpy``) so
    that its own folder is not put there either.

    >>> import tempfile
    >>> d = tempfile.mkdtemp(); p = os.path.join(d, "w.py")
    >>> _ = open(p, "w").write("import sys, json; print(json.dumps({'args': sys.argv[1:]}))")
    >>> run_script(p, ["a", "b"], cwd=d)
    {'args': ['a', 'b']}
    """
    import fastckpt

    first = against or os.path.dirname(os.path.dirname(os.path.abspath(fastckpt.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (first, env.get("PYTHONPATH")) if p)
    start = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    done = subprocess.run([sys.executable, "-c", start, os.path.abspath(path), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)
    if done.returncode != 0:
        return {"failed": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])

