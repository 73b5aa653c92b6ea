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

__all__ = ["configure", "run", "measure", "report", "measure_sharded", "report_sharded", "measure_streaming",
           "report_streaming", "start_server", "storage_options", "make_tensors", "TARGET"]

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
            save_safetensors(ours, tensors, storage_options=options, overwrite=True)
            fs.put_file(local, theirs)
            downloaded = os.path.join(tmp, "downloaded.safetensors")

            def load_all():
                with fastckpt.open(ours, storage_options=options) as f:
                    return sum(f.host(name).nbytes for name in f.keys())

            paths = {
                "save fastckpt": lambda: save_safetensors(ours, tensors, storage_options=options, overwrite=True),
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


# ------------------------------------------------------------------ streaming (the range server)

STREAM_TENSORS = 16
# The raw rows' shape: fastckpt.formats.stream's defaults (named here too: the "before" rows run an older fastckpt).
RAW_THREADS, RAW_CHUNK = 8, 8 << 20
BEFORE = " (before)"  # the suffix of a row run with the fastckpt of --against
# The row whose warm-up is the same load (untimed): the timed load finds the pool's arena made (a reload).
REUSED = "load_file(s3, pool with its arena)"
VERIFIED = "load_model(s3 .netcl, pool, verify=True)"
# The rows also run with the fastckpt of --against, in the same rounds.
BEFORE_ROWS = ("fastckpt.open(s3) + copies", "fastckpt.open(http) + copies", "load_file(s3, pool)",
               "load_file(http, pool)", REUSED, "load_file(s3 HF prefix, pool)", "load_model(s3 .netcl, pool)",
               VERIFIED)


def _range_server(root: str):
    """The range server (:mod:`fastckpt.bench.objectserver`) serving ``root``, in a process of its own; returns
    ``(process, endpoint_url)``."""
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "fastckpt.bench.objectserver", root], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    endpoint = process.stdout.readline().strip()
    if not endpoint.startswith("http://"):
        process.kill()
        raise SystemExit(f"the range server did not start (it printed {endpoint!r})")
    return process, endpoint


def _stream_fixture(root: str, mib: float, base: str = "") -> dict:
    """The objects of the streaming table under ``root/b``: ``model.safetensors`` (``STREAM_TENSORS`` float32
    tensors of random bits, ``mib`` MiB), the same as a Hugging Face prefix of 4 shards, a ``.netcl`` model of about
    the same size; and the CRC-32C of every tensor and of the whole file."""
    import crc32c

    import fastckpt
    from fastckpt.bench.cold import _netcl

    bucket = os.path.join(root, "b", base)
    os.makedirs(bucket, exist_ok=True)
    per = max(1, int(mib * 2**20) // STREAM_TENSORS // 4)
    rng = np.random.default_rng(0)
    arrays = {f"layer{i:03d}.weight": rng.integers(0, 2**32, per, dtype=np.uint32).view(np.float32)
              for i in range(STREAM_TENSORS)}
    path = os.path.join(bucket, "model.safetensors")
    fastckpt.save_safetensors(path, arrays, fsync=False, overwrite=True)
    fastckpt.save_sharded(os.path.join(bucket, "hf"), arrays, max_shard_size=-(-per * 4 * STREAM_TENSORS // 4) + 1)
    with open(path, "rb") as f:
        file_crc = crc32c.crc32c(f.read())
    netcl, netcl_crc, netcl_nbytes = _netcl(bucket, sum(a.nbytes for a in arrays.values()))
    return {"crc": {k: crc32c.crc32c(a) for k, a in arrays.items()}, "file_crc": file_crc,
            "nbytes": sum(a.nbytes for a in arrays.values()), "file_size": os.path.getsize(path),
            "netcl_crc": netcl_crc, "netcl_nbytes": netcl_nbytes}


def _stream_rows(endpoint: str, fixture: dict, runai: bool, *, describe: bool = False, only: str | None = None,
                 base: str = "") -> dict:
    """``{row: (load, check, bytes, kind)}`` of the streaming table; ``check(result)`` says whether it is exact.
    ``describe``: ``{row: (bytes, kind)}`` only, nothing set up; ``only``: set up what that row needs."""
    if describe:
        return {row: (nbytes, kind) for row, (nbytes, kind) in _STREAM_ROWS(fixture, runai).items()}
    import crc32c
    import fsspec

    import fastckpt
    from fastckpt.device import default
    from fastckpt.device.pool import PersistentBufferPool
    from fastckpt.io import load_model

    options = {**storage_options(endpoint), "config_kwargs": {"s3": {"addressing_style": "path"}}}
    key = f"b/{base}model.safetensors"
    s3, http = f"s3://{key}", f"{endpoint}/{key}"
    size, nbytes = fixture["file_size"], fixture["nbytes"]
    if only is None or _STREAM_ROWS(fixture, runai)[only][1] == "fastckpt":
        dev = default()
        queue, pool = dev.queue, PersistentBufferPool(dev.context, dev.queue)

    def copies_exact(result) -> bool:
        return {k: crc32c.crc32c(np.ascontiguousarray(v)) for k, v in result.items()} == fixture["crc"]

    def whole_exact(blobs) -> bool:
        value = 0
        for blob in blobs:
            value = crc32c.crc32c(blob, value)
        return value == fixture["file_crc"]

    def raw(fs, path):
        from concurrent.futures import ThreadPoolExecutor

        starts = list(range(0, size, RAW_CHUNK))
        with ThreadPoolExecutor(RAW_THREADS) as ex:
            return list(ex.map(lambda s: fs.cat_file(path, start=s, end=min(size, s + RAW_CHUNK)), starts))

    def raw_cat_ranges(fs, path):
        starts = list(range(0, size, RAW_CHUNK))
        return fs.cat_ranges([path] * len(starts), starts, [min(size, s + RAW_CHUNK) for s in starts])

    def opened(url, opts):
        def load():
            with fastckpt.open(url, storage_options=opts) as f:
                return {k: np.array(f.host(k)) for k in f.keys()}
        return load

    def model_exact(model) -> bool:
        return {k: crc32c.crc32c(np.ascontiguousarray(v)) for k, v in model.state_dict().items()} \
            == fixture["netcl_crc"]

    def device(loaded) -> bool:
        return copies_exact({k: loaded[k].to_host() for k in loaded})

    s3fs_fs, _ = fastckpt.formats.remote.filesystem(s3, options)
    http_fs = fsspec.filesystem("http")
    threads, chunk = RAW_THREADS, RAW_CHUNK >> 20
    rows = {
        f"raw s3: {threads} threads x {chunk} MiB ranged GETs into memory": (
            lambda: raw(s3fs_fs, key), whole_exact, size, "bound"),
        f"raw s3: s3fs cat_ranges, {chunk} MiB ranges": (
            lambda: raw_cat_ranges(s3fs_fs, key), whole_exact, size, "bound"),
        f"raw http: {threads} threads x {chunk} MiB ranged GETs into memory": (
            lambda: raw(http_fs, http), whole_exact, size, "bound"),
        "fastckpt.open(s3) + copies": (opened(s3, options), copies_exact, nbytes, "fastckpt"),
        "fastckpt.open(http) + copies": (opened(http, None), copies_exact, nbytes, "fastckpt"),
        "load_file(s3, pool)": (lambda: fastckpt.load_file(s3, queue, pool=pool, storage_options=options), device,
                                nbytes, "fastckpt"),
        "load_file(http, pool)": (lambda: fastckpt.load_file(http, queue, pool=pool), device, nbytes, "fastckpt"),
        REUSED: (lambda: fastckpt.load_file(s3, queue, pool=pool, storage_options=options), device, nbytes,
                 "fastckpt"),
        "load_file(s3 HF prefix, pool)": (
            lambda: fastckpt.load_file(f"s3://b/{base}hf", queue, pool=pool, storage_options=options), device, nbytes,
            "fastckpt"),
        "load_model(s3 .netcl, pool)": (
            lambda: load_model(f"s3://b/{base}model.netcl", queue, pool=pool, storage_options=options),
            model_exact, fixture["netcl_nbytes"], "fastckpt"),
        VERIFIED: (
            lambda: load_model(f"s3://b/{base}model.netcl", queue, pool=pool, storage_options=options, verify=True),
            model_exact, fixture["netcl_nbytes"], "fastckpt"),
    }
    if runai and (only is None or only.startswith("Run:ai")):
        for name, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint, "AWS_EC2_METADATA_DISABLED": "true",
                            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}.items():
            os.environ[name] = value
        from runai_model_streamer import SafetensorsStreamer

        def runai_load():
            with SafetensorsStreamer() as streamer:
                streamer.stream_file(s3)
                return {name: t.clone() for name, t in streamer.get_tensors()}
        rows["Run:ai SafetensorsStreamer (s3)"] = (
            runai_load, lambda result: copies_exact({k: v.numpy() for k, v in result.items()}), nbytes, "peer")
    assert {r: (v[2], v[3]) for r, v in rows.items()} == _STREAM_ROWS(fixture, runai) or only, "rows out of step"
    return rows


def _STREAM_ROWS(fixture: dict, runai: bool) -> dict:
    """``{row: (bytes, kind)}`` of the streaming table (kept in step with :func:`_stream_rows`)."""
    size, nbytes = fixture["file_size"], fixture["nbytes"]
    threads, chunk = RAW_THREADS, RAW_CHUNK >> 20
    rows = {f"raw s3: {threads} threads x {chunk} MiB ranged GETs into memory": (size, "bound"),
            f"raw s3: s3fs cat_ranges, {chunk} MiB ranges": (size, "bound"),
            f"raw http: {threads} threads x {chunk} MiB ranged GETs into memory": (size, "bound"),
            "fastckpt.open(s3) + copies": (nbytes, "fastckpt"),
            "fastckpt.open(http) + copies": (nbytes, "fastckpt"),
            "load_file(s3, pool)": (nbytes, "fastckpt"),
            "load_file(http, pool)": (nbytes, "fastckpt"),
            REUSED: (nbytes, "fastckpt"),
            "load_file(s3 HF prefix, pool)": (nbytes, "fastckpt"),
            "load_model(s3 .netcl, pool)": (fixture["netcl_nbytes"], "fastckpt"),
            VERIFIED: (fixture["netcl_nbytes"], "fastckpt")}
    if runai:
        rows["Run:ai SafetensorsStreamer (s3)"] = (nbytes, "peer")
    return rows


def measure_streaming(*, mib: float = DEFAULT_MIB, repeats: int = 3, against: str | None = None) -> dict:
    """The streaming table's measurements: every row of :func:`_stream_rows` ``repeats`` times, in rounds (each
    round runs every row once, in a shuffled order), each measurement in a fresh process (a cold start: its own
    connections, device and pool, set up before the clock starts), with the growth of its peak RSS over the load
    (:class:`~fastckpt.bench.timing.PeakMemory`) and whether it was exact. The range server runs in a process of
    its own. ``against`` (a checkout of an older fastckpt) adds its :data:`BEFORE_ROWS` as ``(before)`` rows, in the
    same rounds. Returns ``{"samples": {row:
    [(seconds, peak growth, exact)]}, "kinds", "bytes", "load", "runai"}``."""
    import json
    import random

    from fastckpt.bench.timing import run_script  # here, in the parent: an older fastckpt's worker lacks it

    try:
        import runai_model_streamer  # noqa: F401
        import runai_model_streamer_s3  # noqa: F401
        runai = None
    except ImportError as e:
        runai = f"not run: {e} (pip install runai-model-streamer runai-model-streamer-s3)"
    with tempfile.TemporaryDirectory(prefix="fastckpt-bench-stream-") as root:
        fixture = _stream_fixture(root, mib)
        fixture["warm"] = _stream_fixture(root, 1, "warm/")  # what each worker reads untimed first
        process, endpoint = _range_server(root)
        load = [os.getloadavg()[0]]
        setup = os.path.join(root, "setup.json")
        with open(setup, "w") as f:
            json.dump({"endpoint": endpoint, "fixture": fixture, "runai": runai is None}, f)
        try:
            rows = _stream_rows(endpoint, fixture, runai is None, describe=True)
            if against:
                for row in BEFORE_ROWS:
                    rows[row + BEFORE] = (rows[row][0], "before")
            samples: dict[str, list] = {row: [] for row in rows}
            failed: dict[str, str] = {}
            order = list(rows)
            for _ in range(repeats):
                random.shuffle(order)
                for row in order:  # a "(before)" row over the older fastckpt; in root, where no fastckpt is
                    out = run_script(__file__, ["--stream-worker", row.removesuffix(BEFORE), setup], cwd=root,
                                     against=against if row.endswith(BEFORE) else None)
                    if "failed" in out:
                        failed[row] = out["failed"]
                        continue
                    samples[row].append((out["seconds"], out["growth"], out["exact"], out["cpu"]))
                load.append(os.getloadavg()[0])
        finally:
            process.stdin.close()
            process.wait(30)
    return {"samples": samples, "kinds": {r: v[1] for r, v in rows.items()},
            "bytes": {r: v[0] for r, v in rows.items()}, "load": load, "runai": runai, "mib": mib, "failed": failed}


def _stream_worker(row: str, setup_path: str) -> int:
    """One measurement of the streaming table in this (fresh) process; prints ``{"seconds", "growth", "exact"}``."""
    import json
    import time

    from fastckpt.bench.timing import PeakMemory

    with open(setup_path) as f:
        setup = json.load(f)
    # Untimed first: the same path over a 1 MiB copy of the objects (imports, the client, its connections, the
    # device), so that the clock measures the streaming; a new process's peak RSS is not its allocator's reuse.
    fixture = setup["fixture"]
    warm, _check, _n, _k = _stream_rows(setup["endpoint"], fixture["warm"], setup["runai"], only=row, base="warm/")[row]
    warm()
    load, check, _nbytes, _kind = _stream_rows(setup["endpoint"], fixture, setup["runai"], only=row)[row]
    if row == REUSED:  # the same load first, untimed: its arena is made and back in the pool
        import gc

        first = load()
        del first
        gc.collect()
    with PeakMemory() as peak:
        cpu = os.times()
        start = time.perf_counter()
        result = load()
        seconds = time.perf_counter() - start
        after = os.times()
    print(json.dumps({"seconds": seconds, "growth": peak.growth, "exact": bool(check(result)),
                      "cpu": (after.user - cpu.user) + (after.system - cpu.system)}))
    return 0


def report_streaming(result: dict) -> list[str]:
    """The streaming table: median seconds, GB/s, share of the bound (the fastest raw download), the client
    process's median CPU time over the load (user + system, every thread; the server's is not counted), the largest
    peak RSS growth over a load, exact in every run.

    >>> r = {"samples": {"raw s3: x": [(1.0, 2**20, True, 0.5)], "load_file(s3, pool)": [(1.25, 3 * 2**20, True, 0.7)]},
    ...      "kinds": {"raw s3: x": "bound", "load_file(s3, pool)": "fastckpt"},
    ...      "bytes": {"raw s3: x": 10**9, "load_file(s3, pool)": 10**9}, "load": [2.0, 3.0], "runai": None,
    ...      "mib": 512}
    >>> print("\\n".join(report_streaming(r)[2:6]))
    | path | median | GB/s | share of the bound | CPU | peak RSS growth | exact |
    |---|---:|---:|---:|---:|---:|---|
    | raw s3: x | 1.000 s | 1.00 | 1.00 | 500.00 ms | 1 MiB | yes |
    | load_file(s3, pool) | 1.250 s | 0.80 | 0.80 | 700.00 ms | 3 MiB | yes |
    """
    import statistics

    samples = result["samples"]
    rate = {row: result["bytes"][row] / statistics.median(x[0] for x in v) / 1e9 for row, v in samples.items() if v}
    bound = max((rate[r] for r in rate if result["kinds"][r] == "bound"), default=None)
    lines = [f"S3 and HTTP streaming (the range server on loopback, fastckpt.bench.objectserver; "
             f"{result['mib']:g} MiB; a fresh process per measurement; load average "
             f"{min(result['load']):.1f}-{max(result['load']):.1f} on {os.cpu_count()} cores)", ""]
    rows = []
    for row, v in samples.items():
        if not v:
            continue
        peaks = [x[1] for x in v if x[1] is not None]
        rows.append([row, format_duration(statistics.median(x[0] for x in v)), f"{rate[row]:.2f}",
                     f"{rate[row] / bound:.2f}" if bound else "-", format_duration(statistics.median(x[3] for x in v)),
                     format_size(max(peaks)) if peaks else "-", "yes" if all(x[2] for x in v) else "NO"])
    lines += table_lines(["path", "median", "GB/s", "share of the bound", "CPU", "peak RSS growth", "exact"], rows,
                         "lrrrrrl")
    lines += ["", f"- bound: the fastest raw row ({bound:.2f} GB/s); target: every fastckpt row >= 0.8x"
              if bound else "- no bound row ran"]
    if result["runai"]:
        lines.append(f"- Run:ai streamer {result['runai']}")
    for row, why in result.get("failed", {}).items():
        lines.append(f"- {row}: FAILED ({why})")
    for row in samples:  # each row against the same row of --against, in the same rounds
        if row + BEFORE in rate and row in rate:
            cpu = [statistics.median(x[3] for x in samples[r]) for r in (row + BEFORE, row)]
            lines.append(f"- {row}: {rate[row] / rate[row + BEFORE]:.2f}x the speed of --against's "
                         f"(CPU {format_duration(cpu[0])} -> {format_duration(cpu[1])})")
    missed = [r for r in rows if result["kinds"][r[0]] == "fastckpt" and bound and rate[r[0]] / bound < 0.8]
    lines.append(f"- {'met' if not missed else 'MISSED'}: >= 0.8x the bound"
                 + (f" ({', '.join(r[0] for r in missed)} below)" if missed else ""))
    return lines


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
    >>> args = parser.parse_args(["--quick"]); args.quick, args.mib, args.repeats, args.moto
    (True, 512.0, 3, False)
    """
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_MIB} MiB instead of --mib, one round")
    parser.add_argument("--mib", type=float, default=float(DEFAULT_MIB),
                        help=f"size of the safetensors file in MiB (default {DEFAULT_MIB})")
    add_repeat_option(parser, dest="repeats", default=3, help="rounds of each path (default 3; --quick: 1)")
    parser.add_argument("--sharded", action="store_true",
                        help="measure a 4-rank sharded checkpoint's per-rank loads instead")
    parser.add_argument("--against", metavar="DIR", default=None,
                        help="also run the fastckpt checked out in DIR (its open and load_model rows), in the same "
                             "rounds")
    parser.add_argument("--moto", action="store_true",
                        help="measure saves and loads against moto's S3 server and s3fs's put/get instead of the "
                             "streaming table (moto answers a ranged GET in time proportional to the whole object)")


def run(args) -> int:
    """Run the s3 suite with parsed options; prints the table, returns 0.

    >>> from fastckpt.cli import main
    >>> main(["bench", "--suite", "s3", "--quick", "--moto"])  # doctest: +ELLIPSIS
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
    if getattr(args, "moto", False):
        print("\n".join(report(measure(mib=mib, repeats=repeats), quick=args.quick)))
        return 0
    print("\n".join(report_streaming(measure_streaming(mib=mib, repeats=repeats,
                                                       against=getattr(args, "against", None)))))
    if args.quick:
        print("- (--quick sizes: the targets are stated for the full size)")
    return 0


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--stream-worker"]:
        raise SystemExit(_stream_worker(*sys.argv[2:4]))
    raise SystemExit("python -m fastckpt bench --suite s3 runs this suite")
