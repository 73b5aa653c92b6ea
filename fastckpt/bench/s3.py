"""The ``s3`` suite: a safetensors file saved to and loaded from S3 by fastckpt, against s3fs's own transfers.

Run ``python -m fastckpt bench --suite s3`` (``--quick`` for 16 MiB instead of 512 MiB; needs the test extra:
``pip install 'fastckpt[test]'``, for moto's server and s3fs). It starts moto's S3 server on a free port of
127.0.0.1 (nothing leaves the machine), then times, round-robin (:func:`fastckpt.bench.timing.round_robin`):

* ``fastckpt.save_safetensors("s3://...")`` of the tensors (the local writer to a temporary file, then one
  atomic upload) against ``S3FileSystem.put_file`` of a file holding the same bytes;
* ``fastckpt.open("s3://...")`` of every tensor (the index, then parallel 16 MiB ranged reads into a mapped
  temporary file) against ``S3FileSystem.get_file`` of the same object to a local file.

It prints a markdown table with both times and their ratio, and whether each meets the target (fastckpt at
most 1.2x s3fs's time). The server holds the objects in memory; they are removed at the end.

``--sharded`` instead measures a sharded checkpoint of 4 ranks (one hashtable, ``--mib`` of rows in all)
loaded from S3 by each of 4 ranks in turn: the bytes each rank fetches (its share:
:func:`fastckpt.sharded.remote.fetch_share`) and its load time, against a load that downloads the whole
prefix first (what every rank did before), both unverified (``verify=False``: the manifest's hashes cover
whole files, so a verified load fetches whole files).

>>> from fastckpt.bench.timing import Timing
>>> fake = {"nbytes": 2**20, "timings": {"save fastckpt": Timing(1.1, 1.0), "save s3fs": Timing(1.0, 1.0),
...                                      "load fastckpt": Timing(0.5, 0.5), "load s3fs": Timing(1.0, 1.0)}}
>>> print("\\n".join(report(fake)[2:6]))
| operation | fastckpt (median) | s3fs put/get (median) | ratio | <= 1.2x |
|---|---:|---:|---:|---|
| save | 1.100 s | 1.000 s | 1.10x | yes |
| load | 500.00 ms | 1.000 s | 0.50x | yes |
"""

from __future__ import annotations

import logging
import os
import tempfile

import numpy as np

from fastckpt.bench.timing import (add_repeat_option, format_duration, format_ratio, format_size, round_robin,
                                  table_lines)

__all__ = ["configure", "run", "measure", "report", "measure_sharded", "report_sharded", "start_server",
           "storage_options", "make_tensors", "TARGET"]

TARGET = 1.2
DEFAULT_MIB = 512
QUICK_MIB = 16
# Dummy credentials: the server accepts any; boto3 and s3fs need some.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def storage_options(endpoint_url: str) -> dict:
    """The ``storage_options`` that point s3fs (through fastckpt's remote calls) at the server at ``endpoint_url``.

    >>> storage_options("http://127.0.0.1:5000")["client_kwargs"]
    {'endpoint_url': 'http://127.0.0.1:5000', 'region_name': 'us-east-1'}
    """
    return {"key": CREDENTIALS["AWS_ACCESS_KEY_ID"], "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": endpoint_url, "region_name": "us-east-1"}}


def start_server(bucket: str):
    """moto's S3 server on a free loopback port with ``bucket`` made; returns ``(server, endpoint_url)``, the caller
    stops ``server``. (Also the test suite's server: tests/_s3.py.)"""
    import boto3  # moto's own dependency; s3fs's mkdir sends a location constraint moto refuses for us-east-1
    from moto.server import ThreadedMotoServer

    for name, value in CREDENTIALS.items():
        os.environ.setdefault(name, value)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return server, endpoint


def make_tensors(mib: float) -> dict[str, np.ndarray]:
    """Four float32 matrices of 4096 columns, ``mib`` MiB in all (the suite's file, and the asv suite's).

    >>> {name: a.shape for name, a in make_tensors(1).items()}["layer0.weight"]
    (16, 4096)
    """
    rows = max(1, int(mib * 2**20) // (4 * 4096))
    return {f"layer{i}.weight": np.random.default_rng(i).random((max(1, rows // 4), 4096), np.float32)
            for i in range(4)}


def _server():
    """The suite's server; returns ``(server, storage_options)``."""
    try:
        import s3fs  # noqa: F401 - the client under test

        server, endpoint = start_server("bench")
    except ImportError as e:
        raise SystemExit(f"the s3 suite needs moto's server and s3fs ({e}): pip install 'fastckpt[test]'") from None
    return server, storage_options(endpoint)


def measure(*, mib: float = DEFAULT_MIB, repeats: int = 3) -> dict:
    """Time the four paths; returns ``{"nbytes", "timings": {name: Timing}}``."""
    import fastckpt
    from fastckpt.formats import remote
    from fastckpt.formats.safetensors import save_safetensors

    tensors = make_tensors(mib)
    server, options = _server()
    try:
        fs, _ = remote.filesystem("s3://bench", options)
        with tempfile.TemporaryDirectory(prefix="fastckpt-bench-s3-") as tmp:
            local = os.path.join(tmp, "model.safetensors")
            save_safetensors(local, tensors, fsync=False)
            nbytes = os.path.getsize(local)
            ours, theirs = "s3://bench/fastckpt.safetensors", "s3://bench/s3fs.safetensors"
            save_safetensors(ours, tensors, storage_options=options)
            fs.put_file(local, theirs)
            downloaded = os.path.join(tmp, "downloaded.safetensors")

            def load_all():
                with fastckpt.open(ours, storage_options=options) as f:
                    return sum(f.host(name).nbytes for name in f.keys())

            paths = {
                "save fastckpt": lambda: save_safetensors(ours, tensors, storage_options=options),
                "save s3fs": lambda: fs.put_file(local, theirs),
                "load fastckpt": load_all,
                "load s3fs": lambda: fs.get_file(theirs, downloaded),
            }
            timings = round_robin(paths, repeats, prepare={"load s3fs": lambda: _remove(downloaded)})
            fs.rm([ours, theirs])
    finally:
        server.stop()
    return {"nbytes": nbytes, "timings": timings}


def measure_sharded(*, mib: float = DEFAULT_MIB, repeats: int = 3, ranks: int = 4) -> dict:
    """A ``ranks``-rank sharded save to S3, then each rank's load: its share against the whole prefix."""
    from concurrent.futures import ThreadPoolExecutor

    from fastckpt.formats import remote
    from fastckpt.sharded import HashTable, Loader, Saver
    from fastckpt.sharded import remote as sharded_remote
    from fastckpt.sharded.engine import ThreadEngine

    dim = 64
    rows = max(ranks, int(mib * 2**20) // (8 + 2 * 4 * dim))  # ids, embedding and one slot per row
    rng = np.random.default_rng(0)
    ids = rng.choice(2**40, rows, replace=False).astype(np.int64)
    values = rng.random((rows, dim), np.float32)
    server, options = _server()
    try:
        url = "s3://bench/sharded"

        def save(engine):
            mine = np.flatnonzero(ids % ranks == engine.rank)
            table = HashTable(dim, slots=("m",))
            table.insert(ids[mine], values[mine], {"m": values[mine]})
            Saver(engine.rank, ranks, 2, url, hashtables={"emb": table}, engine=engine, storage_options=options,
                  overwrite=True).save()

        with ThreadPoolExecutor(ranks) as pool:
            list(pool.map(save, ThreadEngine.group(ranks)))
        fs, path = remote.filesystem(url, options)
        total = sum(int(e["size"]) for e in fs.find(path, detail=True).values())
        per_rank = []
        for rank in range(ranks):
            with tempfile.TemporaryDirectory(prefix="fastckpt-bench-share-") as tmp:
                share = sharded_remote.fetch_share(Loader(url, shard_index=rank, shard_num=ranks,
                                                          storage_options=options, verify=False), tmp)

            def whole(rank=rank):
                with remote.local_copy(url, "manifest.json", options) as local:
                    return Loader(local, shard_index=rank, shard_num=ranks, verify=False).load()

            timings = round_robin({
                "share": lambda rank=rank: Loader(url, shard_index=rank, shard_num=ranks,
                                                  storage_options=options, verify=False).load(),
                "whole": whole}, repeats)
            per_rank.append({"rank": rank, "bytes": share["bytes"], "requests": share["requests"],
                             "share": timings["share"], "whole": timings["whole"]})
        fs.rm(path, recursive=True)
    finally:
        server.stop()
    return {"nbytes": total, "ranks": ranks, "per_rank": per_rank}


def report_sharded(result: dict) -> list[str]:
    """The markdown lines of :func:`measure_sharded`'s result.

    >>> from fastckpt.bench.timing import Timing
    >>> r = {"nbytes": 4 << 20, "ranks": 4, "per_rank": [{"rank": 0, "bytes": 1 << 20, "requests": 9,
    ...      "share": Timing(0.1, 0.1), "whole": Timing(0.4, 0.4)}]}
    >>> print("\\n".join(report_sharded(r)[2:]))
    | rank | fetched | of the checkpoint | requests | load (its share) | load (whole prefix) | ratio |
    |---:|---:|---:|---:|---:|---:|---:|
    | 0 | 1 MiB | 25.0% | 9 | 100.00 ms | 400.00 ms | 0.25x |
    """
    n = result["nbytes"]
    lines = [f"S3 (moto's server on loopback): a sharded checkpoint of {result['ranks']} ranks, {format_size(n)}, "
             f"loaded by each of {result['ranks']} ranks", ""]
    rows = [[str(r["rank"]), format_size(r["bytes"]), f"{100 * r['bytes'] / n:.1f}%", str(r["requests"]),
             format_duration(r["share"].median), format_duration(r["whole"].median),
             format_ratio(r["share"].median / r["whole"].median)] for r in result["per_rank"]]
    return lines + table_lines(["rank", "fetched", "of the checkpoint", "requests", "load (its share)",
                                "load (whole prefix)", "ratio"], rows, "rrrrrrr")


def _remove(path: str) -> None:
    if os.path.exists(path):
        os.remove(path)


def report(result: dict, *, quick: bool = False) -> list[str]:
    """The suite's markdown lines for ``result`` (from :func:`measure`)."""
    t, nbytes = result["timings"], result["nbytes"]
    lines = [f"S3 (moto's server on loopback, s3fs as the client): one safetensors file of {format_size(nbytes)}", ""]
    rows, verdicts = [], []
    for op, ours, theirs in (("save", "save fastckpt", "save s3fs"), ("load", "load fastckpt", "load s3fs")):
        ratio = t[ours].median / t[theirs].median
        rows.append([op, format_duration(t[ours].median), format_duration(t[theirs].median), format_ratio(ratio),
                     "yes" if ratio <= TARGET else "no"])
        verdicts.append(f"- {'met' if ratio <= TARGET else 'MISSED'}: {op} within {TARGET}x of s3fs "
                        f"({format_ratio(ratio)})")
    lines += table_lines(["operation", "fastckpt (median)", "s3fs put/get (median)", "ratio", f"<= {TARGET}x"],
                         rows, "lrrrl")
    lines += ["", "### targets", *verdicts]
    if quick:
        lines.append("- (--quick sizes: the targets are stated for the full size)")
    return lines


def configure(parser) -> None:
    """Add the s3 suite's options to ``parser`` (an :class:`argparse.ArgumentParser`).

    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> configure(parser)
    >>> args = parser.parse_args(["--quick"]); args.quick, args.mib, args.repeats
    (True, 512.0, 3)
    """
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_MIB} MiB instead of --mib, one round")
    parser.add_argument("--mib", type=float, default=float(DEFAULT_MIB),
                        help=f"size of the safetensors file in MiB (default {DEFAULT_MIB})")
    add_repeat_option(parser, dest="repeats", default=3, help="rounds of each path (default 3; --quick: 1)")
    parser.add_argument("--sharded", action="store_true",
                        help="measure a 4-rank sharded checkpoint's per-rank loads instead")


def run(args) -> int:
    """Run the s3 suite with parsed options; prints the table, returns 0.

    >>> from fastckpt.cli import main
    >>> main(["bench", "--suite", "s3", "--quick"])  # doctest: +ELLIPSIS
    S3 (moto's server on loopback, s3fs as the client): one safetensors file of 16 MiB
    ...
    0
    """
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    mib, repeats = (QUICK_MIB, 1) if args.quick else (args.mib, args.repeats)
    if getattr(args, "sharded", False):
        print("\n".join(report_sharded(measure_sharded(mib=mib, repeats=repeats))))
        return 0
    print("\n".join(report(measure(mib=mib, repeats=repeats), quick=args.quick)))
    return 0
