"""The ``formats`` suite: host-side open + views, and saves, against the usual baselines, in one process.

``python -m fastckpt bench --suite formats`` builds its fixtures in a
temporary directory (page cache warm, as in serving) and prints median and
best times and ratios as markdown tables for

* (a) 512 MiB in 64 float32 tensors, (b) 1000 float32 tensors of 4 KiB and
  (c) 10,000 float32 tensors of 1 KiB (``--quick``: 8 MiB in 64 tensors, 100
  tensors of 4 KiB and 1000 of 1 KiB);
* opening a file and producing a host array of every tensor: fastckpt (NPZ and
  safetensors files; ``host`` per tensor, and the bulk ``hosts()``), ``np.load``
  of the NPZ, ``safetensors.safe_open(framework="numpy")``;
* open + every host view, for many tiny tensors (16 bytes each), where the
  index is the cost: (d) 100,000, (e) 10,000 and (f) 1000 tensors
  (``--quick``: 5000, 2000 and 1000), one table per format: safetensors (against
  ``safe_open``), NPZ (against ``np.load``, up to 10,000 tensors: it takes
  ~50 us a member) and a TensorFlow checkpoint (against
  ``tf.train.load_checkpoint`` + ``get_tensor`` when TensorFlow is installed;
  fastckpt with and without its CRC32C check of each tensor). Targets: at
  most 60 ms, 6 ms and 0.8 ms, at least 8x faster than ``safe_open`` for (d);
* saving: fastckpt (NPZ, safetensors; with and without fsync) against a raw
  sequential write of the same bytes (with and without fsync) and
  ``safetensors.numpy.save_file``. Every save writes a new file: the previous
  run's file is deleted, untimed, before each run, so no path pays for
  freeing another's blocks. The raw write is Python's file ``write`` of each
  tensor's bytes in order, through a 256 KiB buffer (the one fastckpt's
  other writers get from ``atomic_write``; faster than Python's default 8 KiB
  for small tensors);
  rows with the default buffer, with the arrays handed to ``os.writev``
  uncopied (as fastckpt's writers do), and with the bytes of the aligned
  NPZ file in one ``write`` (its padding included) are shown too. The NPZ
  saves run with the default ``alignment="auto"`` (4096 for payloads of
  64 KiB or more, 64 below), ``alignment=64`` and ``alignment=4096`` (every
  payload on a page: the layout of earlier releases, which doubles a 4 KiB
  tensor and quadruples a 1 KiB one). Target: (c)'s NPZ save at most 1.3x
  the raw write.

Paths are timed round-robin in shuffled order with ``os.sync()`` before each
run (:func:`fastckpt.bench.timing.round_robin`), ``--repeat`` rounds.
Numbers vary from machine to machine; the ratios are what the targets speak of.

>>> from fastckpt.cli import main
>>> main(["bench", "--suite", "formats", "--quick", "--repeat", "1", "--case", "b"])  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile

import numpy as np

from fastckpt.bench.timing import Timing, add_repeat_option, format_duration, format_ratio, round_robin, table_lines

__all__ = ["configure", "run", "bench_case", "bench_open_case", "markdown_table", "random_tensors", "save_as"]

CASES = {"a": ("512 MiB in 64 tensors", 64, 2**21), "b": ("1000 tensors of 4 KiB", 1000, 1024),
         "c": ("10,000 tensors of 1 KiB", 10_000, 256)}
QUICK = {"a": ("8 MiB in 64 tensors", 64, 2**15), "b": ("100 tensors of 4 KiB", 100, 1024),
         "c": ("1000 tensors of 1 KiB", 1000, 256)}
# Open-only cases (no save table): the index, not the bytes, is what they time. --quick keeps (f) and shrinks the
# two large ones, whose fixtures and baselines (np.load: ~50 us a member) took most of a quick run's time.
OPEN_CASES = {"d": ("100,000 tensors of 16 B", 100_000, 4), "e": ("10,000 tensors of 16 B", 10_000, 4),
              "f": ("1000 tensors of 16 B", 1000, 4)}
QUICK_OPEN = {"d": ("5000 tensors of 16 B", 5000, 4), "e": ("2000 tensors of 16 B", 2000, 4),
              "f": OPEN_CASES["f"]}
REPEAT, QUICK_REPEAT = 7, 3


def markdown_table(title: str, rows: list[tuple[str, Timing | tuple[float, float]]], base: str,
                   durable_base: str | None = None) -> str:
    """Rows of (label, (median, best) seconds) as a markdown table, each time divided by row ``base``'s.

    With ``durable_base``, rows whose label says ``fsync`` (and are not a
    baseline themselves) are divided by that row instead, and a column names
    the row each ratio is taken against: a durable save is compared with a
    durable raw write. Both statistics are shown: on a shared machine, writes
    meet occasional write-back stalls, which the median may catch and the
    best run does not.

    >>> print(markdown_table("t", [("a", (2.0, 1.0)), ("b", (4.0, 3.0))], "a"))
    ### t
    <BLANKLINE>
    Ratios are each path's time divided by that of: a.
    <BLANKLINE>
    | path | median | best | median ratio | best ratio |
    |---|---:|---:|---:|---:|
    | a | 2.000 s | 1.000 s | 1.00x | 1.00x |
    | b | 4.000 s | 3.000 s | 2.00x | 3.00x |
    """
    times = dict(rows)

    def base_of(label: str) -> str:
        if durable_base and "fsync" in label and "no fsync" not in label and label not in (base, durable_base):
            return durable_base
        return base

    def fmt(seconds: float) -> str:
        return format_duration(seconds, ms_digits=3, micro=False)

    body = []
    for label, (median, best) in rows:
        ref = base_of(label)
        ref_median, ref_best = times[ref]
        against = [] if durable_base is None else [ref]
        body.append([label, fmt(median), fmt(best), *against, format_ratio(median / ref_median),
                     format_ratio(best / ref_best)])
    if durable_base is None:
        head = [f"Ratios are each path's time divided by that of: {base}.", "",
                *table_lines(["path", "median", "best", "median ratio", "best ratio"], body, "lrrrr")]
    else:
        head = ["Ratios are each path's time divided by that of the row named in \"against\".", "",
                *table_lines(["path", "median", "best", "against", "median ratio", "best ratio"], body, "lrrlrr")]
    return "\n".join([f"### {title}", "", *head])


def random_tensors(n: int, elems: int, digits: int = 4) -> dict[str, np.ndarray]:
    """``n`` float32 tensors of ``elems`` normal random values (seeded), named ``t0000``.. (``digits`` wide): the
    fixtures of the formats and device suites and of the asv suite.

    >>> t = random_tensors(3, 2); list(t), t["t0001"].dtype
    (['t0000', 't0001', 't0002'], dtype('float32'))
    """
    rng = np.random.default_rng(0)
    return {f"t{i:0{digits}d}": rng.standard_normal(elems, dtype=np.float32) for i in range(n)}


def save_as(path: str, fmt: str, tensors: dict[str, np.ndarray], *, fsync: bool = False) -> None:
    """Save ``tensors`` at ``path`` with fastckpt's writer of ``fmt`` (``"safetensors"`` or ``"npz"``), replacing a
    previous save there (``overwrite=True``: timed rounds save to one path, as the raw writes they are compared
    with do).

    >>> import tempfile; p = os.path.join(tempfile.mkdtemp(), "m.npz"); save_as(p, "npz", random_tensors(1, 2))
    """
    import fastckpt

    (fastckpt.save_safetensors if fmt == "safetensors" else fastckpt.save_npz)(path, tensors, fsync=fsync,
                                                                              overwrite=True)


# The buffer fastckpt.store.commit.atomic_write gives writers that do not gather (_WRITE_BUFFER).
RAW_BUFFER = 256 << 10


def _raw_write(path: str, tensors: dict[str, np.ndarray], fsync: bool, buffering: int = RAW_BUFFER) -> None:
    with open(path, "wb", buffering=buffering) as f:
        for a in tensors.values():
            f.write(memoryview(a).cast("B"))
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def _raw_bytes(path: str, data: bytes) -> None:
    with open(path, "wb", buffering=RAW_BUFFER) as f:
        f.write(data)  # one write: larger than the buffer, it goes straight to the file


def _raw_writev(path: str, tensors: dict[str, np.ndarray]) -> None:
    """The arrays' buffers straight to the file, 1024 (Linux's IOV_MAX) per writev call, short writes resumed."""
    views = [memoryview(a).cast("B") for a in tensors.values()]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        start = 0
        while start < len(views):
            batch = views[start:start + 1024]
            done = os.writev(fd, batch)
            for view in batch:
                if done < len(view):
                    break
                done -= len(view)
                start += 1
            if done:  # a short write ended inside this view: resume after its written part
                views[start] = views[start][done:]
    finally:
        os.close(fd)


def bench_case(label: str, n: int, elems: int, tmp: str, repeat: int) -> str:
    """Time the open and the save paths on ``n`` float32 tensors of ``elems`` elements; returns both tables.

    >>> print(bench_case("8 tensors of 4 KiB", 8, 1024, ".", 1))  # doctest: +SKIP
    """
    import fastckpt

    tensors = random_tensors(n, elems)
    st_path = os.path.join(tmp, "m.safetensors")
    npz_path = os.path.join(tmp, "m.npz")
    fastckpt.save_safetensors(st_path, tensors)
    fastckpt.save_npz(npz_path, tensors)

    def open_npload():
        with np.load(npz_path, allow_pickle=False) as z:
            return [z[k] for k in z.files]

    try:
        from safetensors.numpy import save_file
    except ImportError:  # optional baseline
        save_file = None

    open_paths = {
        "fastckpt.open (safetensors) + host views": _open_fastckpt(st_path),
        "fastckpt.open (safetensors) + hosts()": _open_fastckpt_bulk(st_path),
        "fastckpt.open (npz) + host views": _open_fastckpt(npz_path),
        "np.load(npz) + every member": open_npload,
    }
    if _safe_open_peer(st_path) is not None:
        open_paths["safetensors.safe_open(numpy) + get_tensor"] = _safe_open_peer(st_path)
    rows = list(round_robin(open_paths, repeat, sync=True).items())
    tables = [markdown_table(f"open + host arrays: {label}", rows, "fastckpt.open (safetensors) + host views")]

    with open(npz_path, "rb") as f:  # the bytes the default NPZ of these tensors has: the floor for saving one
        npz_bytes = f.read()
    # (label, how to save to a path): each path saves to a file of its own, removed untimed before each run.
    savers = [
        ("raw sequential write", lambda path: _raw_write(path, tensors, False)),
        ("raw sequential write + fsync", lambda path: _raw_write(path, tensors, True)),
        ("raw sequential write, Python's default buffer", lambda path: _raw_write(path, tensors, False, -1)),
        ("raw gathered write (os.writev, 1024 arrays a call)", lambda path: _raw_writev(path, tensors)),
        ("raw write of the NPZ file's bytes, padding included", lambda path: _raw_bytes(path, npz_bytes)),
        ("fastckpt.save_safetensors, no fsync", lambda path: fastckpt.save_safetensors(path, tensors, fsync=False)),
        ("fastckpt.save_safetensors (atomic, fsync)", lambda path: fastckpt.save_safetensors(path, tensors)),
        ("fastckpt.save_npz, no fsync", lambda path: fastckpt.save_npz(path, tensors, fsync=False)),
        ("fastckpt.save_npz (atomic, fsync)", lambda path: fastckpt.save_npz(path, tensors)),
        ("fastckpt.save_npz(alignment=64), no fsync",
         lambda path: fastckpt.save_npz(path, tensors, alignment=64, fsync=False)),
        ("fastckpt.save_npz(alignment=4096), no fsync",
         lambda path: fastckpt.save_npz(path, tensors, alignment=4096, fsync=False)),
    ]
    if save_file is not None:
        savers.append(("safetensors.numpy.save_file", lambda path: save_file(tensors, path)))
    save_paths, prepare = {}, {}
    for i, (row, save) in enumerate(savers):
        path = os.path.join(tmp, f"save-{i}")
        save_paths[row] = functools.partial(save, path)
        prepare[row] = functools.partial(_remove, path)
    save_rows = list(round_robin(save_paths, repeat, prepare=prepare, sync=True).items())
    tables.append(markdown_table(f"save: {label}", save_rows, "raw sequential write",
                                 durable_base="raw sequential write + fsync"))
    return "\n\n".join(tables)


def _open_fastckpt(path: str):
    def run():
        import fastckpt

        with fastckpt.open(path) as f:
            return [f.host(k) for k in f]
    return run


def _open_fastckpt_bulk(path: str):
    def run():
        import fastckpt

        with fastckpt.open(path) as f:
            return f.hosts()
    return run


def _open_tf_unverified(prefix: str):
    """``CheckpointReader(prefix, verify=False)`` + ``hosts()``: the TensorFlow views without their CRC32C check."""
    def run():
        from fastckpt.tf import CheckpointReader

        with CheckpointReader(prefix, verify=False) as f:
            return f.hosts()
    return run


def _safe_open_peer(path: str):
    """``safe_open(framework="numpy")`` + ``get_tensor`` of every tensor, or None without the safetensors package."""
    try:
        from safetensors import safe_open
    except ImportError:  # optional baseline
        return None

    def run():
        with safe_open(path, framework="numpy") as f:
            return [f.get_tensor(k) for k in f.keys()]
    return run


# np.load of an NPZ takes ~50 us a member: it joins the open cases up to this many tensors.
NP_LOAD_MAX_TENSORS = 10_000


def bench_open_case(label: str, n: int, elems: int, tmp: str, repeat: int) -> list:
    """Time opening a file of ``n`` float32 tensors of ``elems`` elements and viewing every tensor, one table per
    format: safetensors (against ``safe_open``), NPZ (against ``np.load``, up to ``NP_LOAD_MAX_TENSORS``) and a
    TensorFlow checkpoint (against ``tf.train.load_checkpoint``, when TensorFlow is installed).

    >>> print("\\n\\n".join(bench_open_case("8 tensors of 16 B", 8, 4, ".", 1)))  # doctest: +SKIP
    """
    import fastckpt
    from fastckpt.tf import write_checkpoint

    tensors = {f"layers.{i}.weight": np.full(elems, i, np.float32) for i in range(n)}
    st_path = os.path.join(tmp, f"open-{n}.safetensors")
    npz_path = os.path.join(tmp, f"open-{n}.npz")
    tf_prefix = os.path.join(tmp, f"open-{n}-tf", "ckpt")
    fastckpt.save_safetensors(st_path, tensors, fsync=False)
    fastckpt.save_npz(npz_path, tensors, fsync=False)
    write_checkpoint(tf_prefix, tensors)
    del tensors
    base = "fastckpt.open + host views"
    st_paths = {base: _open_fastckpt(st_path),
                "fastckpt.open + hosts() (one native loop)": _open_fastckpt_bulk(st_path),
                "safetensors.safe_open(numpy) + get_tensor": _safe_open_peer(st_path)}
    npz_paths = {base: _open_fastckpt(npz_path),
                 "fastckpt.open + hosts() (one native loop)": _open_fastckpt_bulk(npz_path),
                 "np.load + every member": _np_load_peer(npz_path) if n <= NP_LOAD_MAX_TENSORS else None}
    tf_base = "fastckpt.open + host views (CRC32C checked)"
    tf_paths = {tf_base: _open_fastckpt(tf_prefix),
                "fastckpt.open + hosts() (CRC32C checked)": _open_fastckpt_bulk(tf_prefix),
                "CheckpointReader(verify=False) + hosts()": _open_tf_unverified(tf_prefix),
                "tf.train.load_checkpoint + get_tensor": _tensorflow_peer(tf_prefix)}
    tables = []
    for title, paths, base_row in (("safetensors", st_paths, base), ("NPZ", npz_paths, base),
                                   ("TensorFlow checkpoint", tf_paths, tf_base)):
        paths = {row: run for row, run in paths.items() if run is not None}  # baselines not installed: left out
        rows = list(round_robin(paths, repeat).items())
        tables.append(markdown_table(f"{title}, open + host arrays of many small tensors: {label}", rows, base_row))
    for path in (st_path, npz_path):
        _remove(path)
    import shutil

    shutil.rmtree(os.path.dirname(tf_prefix), ignore_errors=True)
    return tables


def _np_load_peer(path: str):
    """``np.load`` + every member of the NPZ at ``path``: numpy's own reader, the NPZ baseline."""
    def run():
        with np.load(path, allow_pickle=False) as z:
            return [z[k] for k in z.files]
    return run


def _tensorflow_peer(prefix: str):
    """TensorFlow's own reader of every tensor, or None without TensorFlow."""
    try:
        import tensorflow as tf
    except ImportError:  # optional baseline
        return None

    def run():
        reader = tf.train.load_checkpoint(prefix)
        return [reader.get_tensor(k) for k in reader.get_variable_to_shape_map()]
    return run


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def configure(parser) -> None:
    """Add the formats suite's options to ``parser`` (an :class:`argparse.ArgumentParser`).

    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> configure(parser)
    >>> parser.parse_args(["--quick"]).repeat is None     # 3 runs with --quick, else 7
    True
    """
    parser.add_argument("--quick", action="store_true",
                        help=f"small sizes and {QUICK_REPEAT} runs per path (seconds, for smoke tests)")
    add_repeat_option(parser, dest="repeat", default=None,
                      help=f"timed runs per path (median is reported; default {REPEAT}, --quick {QUICK_REPEAT})")
    parser.add_argument("--case", choices=sorted({**CASES, **OPEN_CASES}), action="append",
                        help="run only this case (repeatable)")
    parser.add_argument("--dir", default=None, help="where to write fixtures (default: a temporary directory)")


def run(args) -> int:
    """Run the formats suite with parsed options; prints the markdown tables, returns 0.

    >>> from fastckpt.cli import main
    >>> main(["bench", "--suite", "formats", "--quick", "--repeat", "1"])  # doctest: +SKIP
    """
    repeat = args.repeat if args.repeat is not None else QUICK_REPEAT if args.quick else REPEAT
    if repeat < 1:
        raise SystemExit("--repeat must be at least 1")
    cases, open_cases = (QUICK, QUICK_OPEN) if args.quick else (CASES, OPEN_CASES)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for key in args.case or sorted({**cases, **open_cases}):
            if key in open_cases:
                label, n, elems = open_cases[key]
                for table in bench_open_case(f"({key}) {label}", n, elems, tmp, repeat):
                    print(table, end="\n\n")
                sys.stdout.flush()
                continue
            label, n, elems = cases[key]
            print(bench_case(f"({key}) {label}", n, elems, tmp, repeat), end="\n\n")
            sys.stdout.flush()
    return 0
