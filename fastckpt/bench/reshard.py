"""The ``sharded`` suite's resharding rows: a checkpoint of N ranks loaded on M, against the same checkpoint on N.

For every pair ``N:M`` of ``--reshard`` (default ``4:3,4:2,2:3,1:4``) the suite saves the state as N ranks hold it
(each rank the ids of its key-space slices, the rule of format version 4), then times, round-robin
(:func:`fastckpt.bench.timing.round_robin`), every rank's share loaded by M ranks (threads, ``dense="rows"``, into
new tables) and by N ranks (the *same-shape* load the target compares with: N -> M at most 1.3x N -> N):

* ``v4``: this fastckpt's checkpoint (format version 4), unverified (``verify=False``: each rank reads the ids of
  the slice groups that meet its slice and its one run of rows of every part) and verified (the default: every
  file read is hashed whole against the manifest, as in versions 1-3);
* ``v3`` with ``--baseline PATH`` (a checkout of an earlier fastckpt, e.g. a worktree of tag or commit 0.3.0 built in place): the same state
  saved and loaded by that fastckpt in the suite's worker process (:class:`fastckpt.bench.sharded.Against`), its
  ranks holding the ids of its own default rule (``id mod N``); the worker times each load itself and the times
  are reported as measured there (no pipe in them), interleaved with this process's loads, so that both meet the
  same machine;
* ``--s3``: the same checkpoints served as objects by the range-proportional S3 server on loopback
  (:class:`fastckpt.bench.objectserver.ObjectServer`, in this process) and loaded from there (moto's server, used
  before, answers a ranged GET in time proportional to the whole object: an N -> M load, whose ranks ask for more
  and smaller ranges of the same objects, measured moto's request count, not the bytes it reads), each rank fetching its share with ranged reads
  (:func:`fastckpt.sharded.remote.fetch_share`); verified, whole files (the manifest hashes whole files): v4 only
  those whose parts the rank reads, v3 the whole prefix. A table beside says what each rank of each v4 load fetches
  (untimed): the tensor-file headers, the requests and the bytes.

Each v4 load is checked once before the timed rounds: every id on the rank of its slice, every id once.

>>> pairs = parse_pairs("4:3,4:2")
>>> pairs
[(4, 3), (4, 2)]
>>> parse_pairs("4,3")  # the older form: one pair
[(4, 3)]
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from fastckpt.bench.timing import format_duration, format_ratio, paired_ratio, round_robin, summarize, table_lines

__all__ = ["PAIRS", "parse_pairs", "measure", "report"]

PAIRS = "4:3,4:2,2:3,1:4"
TARGET = 1.3  # N -> M load time / N -> N load time, at most
SETTLE = 0.1

def parse_pairs(text: str) -> list[tuple[int, int]]:
    """``"4:3,2:3"`` -> ``[(4, 3), (2, 3)]`` (saving ranks : loading ranks); ``"4,3"`` is the one pair (4, 3)."""
    try:
        if ":" not in text:
            src, dst = (int(x) for x in text.split(","))
            pairs = [(src, dst)]
        else:
            pairs = [(int(a), int(b)) for a, b in (p.split(":") for p in text.split(",") if p.strip())]
    except ValueError:
        raise SystemExit(f"--reshard takes pairs SAVED:LOADED separated by commas (4:3,2:3), got {text!r}") from None
    if not pairs or any(a < 1 or b < 1 or a == b for a, b in pairs):
        raise SystemExit(f"--reshard pairs need two different positive rank counts, got {text!r}")
    return list(dict.fromkeys(pairs))


def _check(loaded: list, all_ids: np.ndarray, m: int, table: str) -> None:
    """Every id once, each on the rank of its slice (format version 4's rule)."""
    from fastckpt.sharded.format import SLICE_SIZE, slice_of, slice_positions

    got = []
    for j, (tables, _) in enumerate(loaded):
        ids = tables[table].ids()
        begin, end = slice_of(j, m)
        positions = slice_positions(ids, SLICE_SIZE)
        if not bool(np.all((positions >= begin) & (positions < end))):
            raise AssertionError(f"rank {j} of {m} loaded ids of other slices")
        got.append(ids)
    if not np.array_equal(np.sort(np.concatenate(got)), np.sort(all_ids)):
        raise AssertionError(f"the {m} ranks loaded other ids than were saved")


_BUCKET = "fastckpt-reshard-bench"


def measure(root: Path, build: Callable[[int], list], all_ids: np.ndarray, dense: dict, pairs: list[tuple[int, int]],
            *, dim: int, parallel: int, repeat: int, save: Callable, load: Callable, sizes: dict,
            baseline=None, s3: bool = False, log: Callable[[str], None] = lambda line: None,
            table: str = "emb") -> list[dict[str, Any]]:
    """Time every pair (see the module docs); returns one row per (pair, checkpoint, place, verify).

    ``build(n)`` makes the n ranks' states, ``save(path, states, dense, parallel)`` saves them,
    ``load(path, ranks, dim, parallel, verify=..., storage_options=...)`` loads every rank's share; ``sizes``:
    ``{"ids", "dim", "dense_mib"}`` for the baseline to build the same state; ``baseline``: the worker process
    of an earlier fastckpt (:class:`fastckpt.bench.sharded.Against`), which this closes.
    """
    worker = baseline
    server = url = options = None
    if s3:
        from fastckpt.bench.objectserver import ObjectServer

        server = ObjectServer(buckets=(_BUCKET,))
        options = server.storage_options
    rows: list[dict[str, Any]] = []
    try:
        for src in dict.fromkeys(src for src, _ in pairs):
            targets = [src, *[dst for s, dst in pairs if s == src]]
            places: dict[str, tuple[str, dict | None]] = {}
            log(f"resharding: the checkpoint of {src} rank(s)")
            states = build(src)
            v4 = root / f"reshard-{src}-v4"
            save(v4, states, dense, parallel)
            del states
            places["v4"] = (str(v4), None)
            if worker is not None:
                v3 = root / f"reshard-{src}-baseline"
                # the baseline's ranks hold the ids of its own default rule (id mod N), as its loads give them
                worker.call("state", ids=sizes["ids"], dim=dim, dense_mib=sizes["dense_mib"], ranks=src, rule="mod")
                worker.call("save", path=str(v3), parallel=parallel)
                places["v3"] = (str(v3), None)
            if s3:
                for name in list(places):
                    url = f"s3://{_BUCKET}/{name}-{src}"
                    shutil.copytree(places[name][0], server.path(_BUCKET, f"{name}-{src}"))  # served as objects
                    places[f"{name} S3"] = (url, options)
            for m in targets:  # untimed: each v4 load exact
                _check(load(v4, m, dim, parallel, verify=False), all_ids, m, table)
            paths: dict[str, Callable] = {}
            keys: dict[str, dict] = {}
            worker_times: dict[str, list[float]] = {}
            samples: dict[str, list[float]] = {}  # each v4 load's seconds, round by round
            for name, (where, opts) in places.items():
                for verify in (False, True):
                    for m in targets:
                        label = f"{name} {src}->{m}{' verified' if verify else ''}"
                        keys[label] = {"checkpoint": name, "src": src, "dst": m, "verify": verify}
                        if name.startswith("v3"):
                            worker_times[label] = []

                            def run(where=where, m=m, verify=verify, opts=opts, label=label):
                                reply = worker.call("load", path=where, ranks=m, dim=dim, parallel=parallel,
                                                    verify=verify, storage_options=opts)
                                worker_times[label].append(reply["seconds"])
                        else:
                            samples[label] = []

                            def run(where=where, m=m, verify=verify, opts=opts, label=label):
                                start = time.perf_counter()
                                load(where, m, dim, parallel, verify=verify, storage_options=opts)  # dropped here
                                samples[label].append(time.perf_counter() - start)
                        paths[label] = run
            log(f"resharding: {len(paths)} loads of the checkpoint of {src} rank(s), {repeat} round(s)")
            timings = round_robin(paths, repeat, warmup=0, sync=True, settle=SETTLE)
            for label, key in keys.items():
                timing = summarize(worker_times[label]) if label in worker_times else timings[label]
                rows.append({**key, "timing": timing, "rounds": worker_times.get(label) or samples[label]})
            if s3:  # untimed: what each rank fetches from S3 (requests, bytes, tensor-file headers)
                rows += _fetches(places["v4 S3"], v4, src, targets, table)
            for where, _ in places.values():
                if not where.startswith("s3://"):
                    shutil.rmtree(where, ignore_errors=True)
    finally:
        if worker is not None:
            worker.close()
        if server is not None:
            server.stop()
    return rows


def _fetches(place: tuple[str, dict | None], local: Path, src: int, targets: list[int],
             table: str) -> list[dict[str, Any]]:
    """Each rank's fetch of the v4 checkpoint at ``place`` (table ``table``) for every count in ``targets``,
    unverified and verified (:func:`fastckpt.sharded.remote.fetch_share`, into a temporary directory): one row per
    (M, verify) with the ranks' ``{"requests", "bytes", "headers"}`` (None for a rank that downloads the whole
    prefix)."""
    import tempfile

    from fastckpt.sharded import Loader
    from fastckpt.sharded import remote as sharded_remote

    url, options = place
    files = sum(1 for p in local.iterdir() if p.name.endswith(".safetensors"))
    rows = []
    for verify in (False, True):
        for m in targets:
            ranks = []
            for j in range(m):
                with tempfile.TemporaryDirectory(prefix="fastckpt-bench-share-") as tmp:
                    got = sharded_remote.fetch_share(Loader(url, hashtables={table: None}, tensors={}, shard_index=j,
                                                            shard_num=m, dense="rows", verify=verify,
                                                            storage_options=options), tmp)
                ranks.append(None if got is False else {k: got[k] for k in ("requests", "bytes", "headers")})
            rows.append({"checkpoint": "v4 S3", "src": src, "dst": m, "verify": verify, "fetch": ranks,
                         "files": files})
    return rows


def fetch_report(rows: list[dict[str, Any]]) -> list[str]:
    """The table of what each rank of an N -> M load fetches from S3 (rows of :func:`_fetches`); empty without.

    >>> rows = [{"src": 4, "dst": 2, "verify": False, "files": 16, "fetch": [{"requests": 20, "bytes": 1 << 20,
    ...          "headers": 8}, {"requests": 22, "bytes": 3 << 20, "headers": 8}]}]
    >>> fetch_report(rows)[-1]
    '| 4 -> 2 | no | 16 | 8 | 21 | 2 MiB |'
    """
    from fastckpt.bench.timing import format_size

    lines = []
    for row in rows:
        ranks = [r for r in row["fetch"] if r is not None]
        if not ranks:
            lines.append([f"{row['src']} -> {row['dst']}", "yes" if row["verify"] else "no", str(row["files"]),
                          "(the whole prefix)", "", ""])
            continue
        median = lambda key: float(np.median([r[key] for r in ranks]))  # noqa: E731
        lines.append([f"{row['src']} -> {row['dst']}", "yes" if row["verify"] else "no", str(row["files"]),
                      str(max(r["headers"] for r in ranks)), f"{median('requests'):.0f}",
                      format_size(median("bytes"))])
    if not lines:
        return []
    return ["### resharding from S3: what each rank fetches (fastckpt.sharded.remote.fetch_share, untimed)", "",
            *table_lines(["N -> M", "verified", "tensor files", "headers fetched per rank (most)",
                          "requests per rank (median)", "bytes per rank (median)"], lines, "llrrrr")]


def report(rows: list[dict[str, Any]], pairs: list[tuple[int, int]], parallel: int) -> list[str]:
    """The resharding table: each pair's N -> M load beside the same-shape N -> N load of the same checkpoint, read
    the same way; with a baseline, v4's time over v3's too.

    >>> from fastckpt.bench.timing import Timing
    >>> rows = [{"checkpoint": "v4", "src": 4, "dst": d, "verify": False, "timing": Timing(s, s)}
    ...         for d, s in ((4, 1.0), (3, 1.2))]
    >>> text = report(rows, [(4, 3)], 4)
    >>> [line for line in text if line.startswith("| v4 | 4 -> 3")][0]
    '| v4 | 4 -> 3 | no | 1.200 s | 1.000 s | 1.20x | met |  |  |'
    """
    by = {(r["checkpoint"], r["src"], r["dst"], r["verify"]): r["timing"] for r in rows if "timing" in r}
    rounds = {(r["checkpoint"], r["src"], r["dst"], r["verify"]): r.get("rounds") for r in rows if "timing" in r}
    out = []
    lines = []
    for (name, src, dst, verify), timing in by.items():
        if src == dst or (src, dst) not in pairs:
            continue
        same = by[(name, src, src, verify)]
        ratio = timing.median / same.median
        paired = paired_ratio(rounds[(name, src, dst, verify)], rounds[(name, src, src, verify)])
        v3 = by.get((name.replace("v4", "v3"), src, dst, verify)) if name.startswith("v4") else None
        lines.append([name, f"{src} -> {dst}", "yes" if verify else "no", format_duration(timing.median),
                      format_duration(same.median), format_ratio(ratio), "met" if ratio <= TARGET else "MISSED",
                      "" if paired is None else format_ratio(paired),
                      "" if v3 is None else format_ratio(timing.median / v3.median)])
        out.append((name, src, dst, verify, ratio))
    title = (f"### resharding: every rank's share loaded on M ranks vs. on N (saved by N ranks with parallel {parallel}, "
             "loads with the same; dense='rows'; v3: the baseline's own checkpoint and loader; in the same round: "
             "the median over the rounds of N -> M's time over N -> N's in that round, which a load that changes "
             "between rounds moves less than the ratio of the medians)")
    table = table_lines(["checkpoint", "N -> M", "verified", "N -> M (median)", "N -> N (median)", "ratio",
                         f"<= {TARGET}x", "in the same round", "v4 / v3 (N -> M)"], lines, "llrrrrlrl")
    targets = [f"- {'met' if r <= TARGET else 'MISSED'}: {name} {src} -> {dst}{' verified' if v else ''} "
               f"<= {TARGET}x the {src} -> {src} load: {format_ratio(r)}" for name, src, dst, v, r in out]
    return [title, "", *table, "", *targets]
