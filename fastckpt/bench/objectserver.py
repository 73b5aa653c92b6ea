"""A read-only object server on loopback that answers a ranged GET in time proportional to the range: the
``s3`` suite's and the tests' endpoint for large objects.

moto's S3 server (the suite's and the tests' S3 API for writes and small objects) answers a ranged GET in time
proportional to the whole object: 8 threads of 16 MiB ranges of a 512 MiB object took 111 s. This server serves
the files under a local directory with aiohttp's static file handler (``aiohttp.web.FileResponse``: ``Range``
by ``sendfile`` of just those bytes, ``ETag`` and ``If-Match``, as the Hugging Face Hub serves files), at two
kinds of URL:

* ``http://127.0.0.1:PORT/<bucket>/<key>``: a plain HTTP file, read through fsspec's HTTP filesystem;
* ``s3://<bucket>/<key>`` with :meth:`ObjectServer.storage_options`: the read side of the S3 API, path-style
  (``HeadObject``, ``GetObject`` with ``Range`` and ``If-Match``, ``ListObjectsV2``, ``HeadBucket``), enough for
  s3fs, boto3 and the Run:ai streamer's S3 client to read objects and list prefixes. Writes are refused (405):
  objects are put in place by writing files under :attr:`ObjectServer.root`. Request signatures are not checked.

aiohttp is s3fs's own dependency (the ``s3`` extra brings it). Nothing leaves the machine.

>>> import os
>>> with ObjectServer() as server:
...     with open(os.path.join(server.root, "b", "x.bin"), "wb") as f:
...         _ = f.write(b"hello world")
...     import fsspec
...     fsspec.filesystem("http").cat_file(server.http_url("b", "x.bin"), start=6, end=11)
b'world'
"""

from __future__ import annotations

import asyncio
import datetime
import os
import shutil
import tempfile
import threading
from xml.sax.saxutils import escape

__all__ = ["ObjectServer"]

_XMLNS = "http://s3.amazonaws.com/doc/2006-03-01/"


class ObjectServer:
    """The server (see the module docstring) on a free port of 127.0.0.1, serving ``root`` (a new temporary
    directory by default, removed by :meth:`stop`) with ``buckets`` made as its first-level directories.
    A context manager; :meth:`stop` stops it.

    >>> with ObjectServer(buckets=("models",)) as server:
    ...     server.http_url("models", "a/b.safetensors").endswith("/models/a/b.safetensors")
    True
    """

    def __init__(self, root: str | None = None, buckets: tuple[str, ...] = ("b",)):
        self._own_root = root is None
        self.root = root or tempfile.mkdtemp(prefix="fastckpt-objects-")
        for bucket in buckets:
            os.makedirs(os.path.join(self.root, bucket), exist_ok=True)
        self.requests = 0
        # Every request for an object, in order: {"method", "key", "query", "signed" ("header": an Authorization
        # header, as botocore's GetObject sends; "query": a presigned URL; None), "range", "if_match"}.
        self.log: list[dict] = []
        # Tests: ``answer(request)`` (a function or a coroutine function) may return a response to send instead of
        # the object's (None: serve it).
        self.answer = None
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="fastckpt-objectserver", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if not hasattr(self, "port"):
            raise RuntimeError(f"the object server did not start: {getattr(self, '_error', 'timeout')}")
        self.endpoint_url = f"http://127.0.0.1:{self.port}"

    # -- addresses -----------------------------------------------------------------------------
    def http_url(self, bucket: str, key: str) -> str:
        """The plain HTTP URL of ``key`` in ``bucket``."""
        return f"{self.endpoint_url}/{bucket}/{key}"

    @property
    def storage_options(self) -> dict:
        """What s3fs (through fastckpt's ``storage_options=``) needs to reach this server as S3 (dummy keys)."""
        return {"key": "testing", "secret": "testing",
                "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
                "config_kwargs": {"s3": {"addressing_style": "path"}}}

    def path(self, bucket: str, key: str) -> str:
        """The local file that holds ``key`` of ``bucket`` (its directory is made)."""
        p = os.path.join(self.root, bucket, *key.split("/"))
        os.makedirs(os.path.dirname(p), exist_ok=True)
        return p

    # -- lifetime ------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop serving (and remove the root this server made)."""
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(30)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "ObjectServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- serving -------------------------------------------------------------------------------
    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except Exception as e:  # reported by __init__
            self._error = e
            self._ready.set()
        finally:
            self._loop.close()

    async def _main(self) -> None:
        from aiohttp import web

        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_route("*", "/{bucket}", self._bucket)
        app.router.add_route("*", "/{bucket}/", self._bucket)
        app.router.add_route("*", "/{bucket}/{key:.+}", self._object)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()

    def _file(self, bucket: str, key: str) -> str | None:
        base = os.path.realpath(os.path.join(self.root, bucket))
        p = os.path.realpath(os.path.join(base, *key.split("/")))
        return p if p.startswith(base + os.sep) and os.path.isfile(p) else None

    async def _object(self, request):
        from aiohttp import web

        self.requests += 1
        query = dict(request.query)
        self.log.append({"method": request.method, "key": request.match_info["key"], "query": query,
                         "signed": "header" if "Authorization" in request.headers else
                         "query" if {"Signature", "X-Amz-Signature"} & set(query) else None,
                         "range": request.headers.get("Range"), "if_match": request.headers.get("If-Match")})
        if self.answer is not None:
            answer = self.answer(request)
            if asyncio.iscoroutine(answer):
                answer = await answer
            if answer is not None:
                return answer
        if request.method not in ("GET", "HEAD"):
            return web.Response(status=405, text="read-only server")
        p = self._file(request.match_info["bucket"], request.match_info["key"])
        if p is None:
            return _error(404, "NoSuchKey", request.path, head=request.method == "HEAD")
        return web.FileResponse(p, headers={"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"})

    async def _bucket(self, request):
        from aiohttp import web

        self.requests += 1
        bucket = request.match_info["bucket"]
        base = os.path.join(self.root, bucket)
        if not os.path.isdir(base):
            return _error(404, "NoSuchBucket", bucket, head=request.method == "HEAD")
        if request.method == "HEAD":
            return web.Response(status=200)
        if request.method != "GET":
            return web.Response(status=405, text="read-only server")
        prefix = request.query.get("prefix", "")
        delimiter = request.query.get("delimiter", "")
        keys, common = [], set()
        for folder, _dirs, files in os.walk(base):
            for name in files:
                key = os.path.relpath(os.path.join(folder, name), base).replace(os.sep, "/")
                if not key.startswith(prefix):
                    continue
                rest = key[len(prefix):]
                if delimiter and delimiter in rest:
                    common.add(prefix + rest.split(delimiter, 1)[0] + delimiter)
                    continue
                st = os.stat(os.path.join(folder, name))
                keys.append((key, st))
        keys.sort()
        parts = [f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="{_XMLNS}">',
                 f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix>",
                 f"<KeyCount>{len(keys) + len(common)}</KeyCount><MaxKeys>100000</MaxKeys>",
                 "<IsTruncated>false</IsTruncated>"]
        for key, st in keys:
            modified = datetime.datetime.fromtimestamp(st.st_mtime, datetime.timezone.utc)
            parts.append(f"<Contents><Key>{escape(key)}</Key>"
                         f"<LastModified>{modified.strftime('%Y-%m-%dT%H:%M:%S.000Z')}</LastModified>"
                         f"<ETag>&quot;{st.st_mtime_ns:x}-{st.st_size:x}&quot;</ETag><Size>{st.st_size}</Size>"
                         "<StorageClass>STANDARD</StorageClass></Contents>")
        for p in sorted(common):
            parts.append(f"<CommonPrefixes><Prefix>{escape(p)}</Prefix></CommonPrefixes>")
        parts.append("</ListBucketResult>")
        return web.Response(text="".join(parts), content_type="application/xml")


def _error(status: int, code: str, resource: str, head: bool = False):
    from aiohttp import web

    if head:
        return web.Response(status=status)
    body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{code}</Message>'
            f"<Resource>{escape(resource)}</Resource></Error>")
    return web.Response(status=status, text=body, content_type="application/xml")


def _main(argv: list[str]) -> int:
    """``python -m fastckpt.bench.objectserver ROOT``: serve ROOT (its first-level directories are the buckets),
    print the endpoint URL on one line, and serve until standard input closes (a benchmark runs the server in a
    process of its own, so that serving does not share the client's interpreter)."""
    import sys

    server = ObjectServer(argv[0], buckets=())
    print(server.endpoint_url, flush=True)
    try:
        sys.stdin.read()
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(_main(sys.argv[1:]))
