"""Parallel ranged reads of one object at a URL, streamed into their destinations: fastckpt's one mechanism for
reading bytes from object storage and remote filesystems.

Every read of a URL's bytes comes here: :func:`fastckpt.open` of an ``s3://`` (``gs://``, ``http(s)://``, any
fsspec URL) file and of a Hugging Face sharded prefix, ``load_file(url, queue, pool=pool)`` and
``load_model(url)`` (:mod:`fastckpt.device.load`), and the downloads of :mod:`fastckpt.formats.remote` (checkpoint
prefixes, a sharded rank's share).

A :class:`RemoteObject` is one object, its size and identity (ETag, version, modification time) taken from one
``info`` request when it is opened. :meth:`RemoteObject.stream` reads byte ranges of it in pieces of ``chunk``
bytes (default :data:`CHUNK`), ``threads`` at a time (default :data:`THREADS`), and hands each piece to a
``deliver(offset, data)`` callback as soon as it arrives, on the thread that fetched it: the callback copies it
into its destination (a host array, a device buffer, a pool arena, a file) and the piece is dropped. So:

* **no temporary file and no whole-object buffer**: the pieces go straight where they belong;
* **bounded memory**: at most ``threads x chunk`` bytes of fetched data are held at any time (8 x 8 MiB =
  64 MiB by default), plus what the HTTP client buffers for each of the ``threads`` requests in flight;
  :attr:`RemoteObject.stats` counts the largest piece and the most bytes held at once;
* **exact**: a piece shorter or longer than asked for is a :class:`~fastckpt.errors.FormatError` naming the URL,
  the offset and both lengths (the object was truncated or replaced); each request is conditional on the object
  being the one opened (``If-Match`` its ETag, for ``s3://`` and ``http(s)://``, and the ETag of each answer is
  checked), and :meth:`RemoteObject.check` compares the identity again at the end, so bytes of two versions are
  never mixed: a changed object is an :class:`ObjectChangedError` naming it, and nothing read is used.

An ``s3://`` object's ``GetObject`` is signed once and its pieces sent as plain ranged GETs (:class:`_S3Reads`:
0.66 ms of CPU a 1 MiB request against botocore's 1.48 ms, docs/remote.md), except where the filesystem sends what
a plain GET cannot carry. Plain ranged GETs (those, and ``http(s)://`` URLs) stream on threads of their own, with
no event loop, each body read straight into a buffer the thread keeps or into its destination
(:meth:`RemoteObject.get_into`).

A :class:`Checksums` set on an object (:attr:`RemoteObject.checksums`) checks the CRC-32 of byte ranges of it (NPZ
members: ``load_model(url, verify=True)``) from the pieces as they pass to their destinations, so a verified load
still reads every byte once, straight where it goes.

Pieces are cut over the merged ranges, not per tensor: one piece may carry the end of one tensor and the start
of the next, and the callback places each byte by its offset.

>>> import fastckpt, numpy as np
>>> fastckpt.save_safetensors("memory://doc/stream.safetensors", {"a": np.arange(1000, dtype=np.int32)})
>>> obj = RemoteObject("memory://doc/stream.safetensors")
>>> out = bytearray(obj.size)
>>> def deliver(offset, data):
...     out[offset:offset + len(data)] = data
>>> obj.stream([(0, obj.size)], deliver, chunk=1000)
8096
>>> obj.check()
>>> bytes(out) == obj.fs.cat_file(obj.path), obj.stats.largest, obj.stats.requests
(True, 1000, 9)
"""

from __future__ import annotations

import http.client as _http_client
import os
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Iterable

from fastckpt.errors import CheckpointChangedError, CheckpointNotFoundError, FormatError
from fastckpt.formats.npz import _crc32, _crc32_combine  # ZIP's CRC-32, and two runs' joined
from fastckpt.store.remote import filesystem

__all__ = ["RemoteObject", "ObjectChangedError", "StreamStats", "Scatter", "Checksums", "stream", "merged", "CHUNK",
           "THREADS"]

CHUNK = 8 << 20
THREADS = 8
_PART = 1 << 20  # the most a streamed body is read at a time (parts=True)
# Ranges closer than this are fetched as one (the bytes between are read and dropped): small tensors, one request.
GAP = 64 << 10

# What the store says of an object that changes when the object is replaced (the first ones it reports).
_IDENTITY_KEYS = ("ETag", "etag", "VersionId", "generation", "LastModified", "mtime", "created", "size")


class ObjectChangedError(CheckpointChangedError, OSError):
    """The object at a URL was replaced or removed while it was read in ranges: what was read is not used.

    It is a :class:`~fastckpt.errors.CheckpointChangedError` (what a local file replaced while it is read
    raises), and an ``OSError`` as fastckpt 0.3's was.

    >>> issubclass(ObjectChangedError, CheckpointChangedError), issubclass(ObjectChangedError, OSError)
    (True, True)
    """


@dataclass
class StreamStats:
    """What :meth:`RemoteObject.stream` did, counted (deterministic, for tests and the bench): ``requests`` and
    ``bytes`` fetched, the ``largest`` piece (or part of one), and ``peak_held``, the most fetched bytes held at
    once (each from its arrival to the end of its delivery); ``held`` is what is held now.

    >>> StreamStats()
    StreamStats(requests=0, bytes=0, largest=0, held=0, peak_held=0)
    """

    requests: int = 0
    bytes: int = 0
    largest: int = 0
    held: int = 0
    peak_held: int = 0


def merged(spans: Iterable[tuple[int, int]], gap: int = GAP) -> list[tuple[int, int]]:
    """Sorted byte ranges with neighbours at most ``gap`` bytes apart joined, so small tensors cost one request.

    >>> merged([(100, 200), (0, 50), (60, 70), (300, 300)], gap=5)
    [(0, 50), (60, 70), (100, 200)]
    """
    out: list[list[int]] = []
    for start, end in sorted(spans):
        if end <= start:
            continue
        if out and start - out[-1][1] <= gap:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


class _Length:
    """Stands for data of a length (what :meth:`RemoteObject._checked` looks at) once the parts are delivered."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def identity(info: dict) -> tuple:
    """What of an ``fs.info`` answer changes when the object is replaced."""
    return tuple((k, str(info[k])) for k in _IDENTITY_KEYS if info.get(k) is not None)



def _http_status(e: BaseException) -> int | None:
    """The HTTP status a failed request answered with, where the client recorded it: aiohttp's ``status``
    (fsspec's HTTP filesystem), botocore's ``response`` (s3fs, which raises it as the cause of its own error).
    Read from the exception, not its text: a URL's port or key may hold any digits."""
    for x in (e, e.__cause__, e.__context__):
        status = getattr(x, "status", None)
        if isinstance(status, int):
            return status
        response = getattr(x, "response", None)
        if isinstance(response, dict):
            code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(code, int):
                return code
    return None

class RemoteObject:
    """One object at ``url`` (``storage_options`` for its filesystem), read in ranges; see the module docstring.

    ``info`` (an ``fs.info`` answer already in hand) saves the request that takes the size and identity.

    >>> import fastckpt, numpy as np
    >>> fastckpt.save_safetensors("memory://doc/ro.safetensors", {"a": np.zeros(2, np.int8)})
    >>> o = RemoteObject("memory://doc/ro.safetensors"); o.size, o.read(8, 10)
    (4098, b'{"')
    """

    def __init__(self, url: str, storage_options: dict | None = None, *, fs=None, path: str | None = None,
                 info: dict | None = None):
        self.url = url
        if fs is None:
            fs, path = filesystem(url, storage_options)
        self.fs, self.path = fs, path
        if info is None:
            fs.invalidate_cache(path)  # another writer may have replaced the object since this filesystem listed it
            try:
                info = fs.info(path)
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"{url}: no such object") from None
        self.info = info
        self.size = int(info.get("size") or 0)
        self.identity = identity(info)
        etag = info.get("ETag") or info.get("etag")
        self.etag = str(etag) if etag else None
        self.stats = StreamStats()
        # Set to a Checksums: every stream of this object checks its members' CRC-32s (load_model(verify=True)).
        self.checksums: Checksums | None = None
        self._lock = threading.Lock()
        self._get = self._getter()

    def __repr__(self) -> str:
        return f"<RemoteObject {self.url!r} size={self.size}>"

    # -- one ranged GET ------------------------------------------------------------------------
    def _getter(self) -> Callable[[int, int], bytes]:
        """The store's ranged GET of ``[start, end)`` (a coroutine function on an async filesystem: s3fs, HTTP,
        ...), conditional on this object's ETag where the store can be (``If-Match``)."""
        fs, path = self.fs, self.path
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.is_async = bool(getattr(fs, "async_impl", False)) and hasattr(fs, "_cat_file")
        # Every read asks for this very object (If-Match its ETag) and checks the ETag it is answered with: bytes
        # of two versions can never meet, whatever order the pieces come in (fastckpt.open may then hand out a
        # tensor before the others have arrived).
        self.conditional = bool(self.etag) and self.is_async and (
            protocol in ("s3", "s3a") or protocol in ("http", "https") and hasattr(fs, "set_session"))
        if self.etag and protocol in ("s3", "s3a"):
            reads = _S3Reads(self)
            self._get_into = reads.into
            return reads.get
        headers = {"headers": {"If-Match": self.etag}} if self.etag and protocol in ("http", "https") else {}
        self._http_direct = None
        if self.is_async and protocol in ("http", "https") and hasattr(fs, "set_session"):
            if not getattr(fs, "kwargs", None) and not getattr(fs, "client_kwargs", None):
                # Nothing of the filesystem's own to send: a plain GET with no event loop may read it (get_into).
                self._http_direct = (str(fs.encode_url(path)), headers.get("headers", {}), None)

            async def http_into(start: int, end: int, sink) -> None:
                await _plain_get(self, fs, fs.encode_url(path), headers.get("headers", {}), start, end, sink)

            self._get_into = http_into
        if self.is_async:
            return lambda start, end: fs._cat_file(path, start=start, end=end, **headers)
        return lambda start, end: fs.cat_file(path, start=start, end=end, **headers)

    def get(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object, in one request; exactly ``end - start`` of them, or an error
        naming the URL and the offset (:class:`ObjectChangedError` when the store says the object changed)."""
        if end <= start:
            return b""
        if self.is_async:
            from fsspec.asyn import sync

            return sync(self.fs.loop, self.aget, start, end)
        try:
            data = self._get(start, end)
        except Exception as e:
            raise self._failure(e, start, end) from e
        return self._checked(start, end, data)

    async def aget(self, start: int, end: int) -> bytes:
        """:meth:`get` as a coroutine, on the filesystem's event loop (an async filesystem only)."""
        if end <= start:
            return b""
        try:
            data = await self._get(start, end)
        except Exception as e:
            raise self._failure(e, start, end) from e
        return self._checked(start, end, data)

    async def aget_into(self, start: int, end: int, sink: Callable[[int, bytes], object]) -> None:
        """:meth:`aget` handing the body to ``sink(offset, data)`` as it arrives, in the parts the HTTP client
        reads (at most 1 MiB each; on the event loop's thread): no piece is ever joined into one buffer. Where the
        store's client has no streamed body, the whole piece is one part."""
        if end <= start:
            return
        into = getattr(self, "_get_into", None)
        if into is None:
            sink(start, await self.aget(start, end))
            return
        try:
            await into(start, end, sink)
        except Exception as e:
            raise self._failure(e, start, end) from e

    def get_into(self, start: int, end: int, sink: Callable[[int, bytes], object], buffer: bytearray,
                 place: Callable[[int, int], object] | None = None) -> None:
        """:meth:`aget_into` on the calling thread, with no event loop: one blocking ranged GET (the standard
        library's ``http.client``, over a keep-alive connection kept for the next GET to that server) whose body is read with ``readinto``
        into ``buffer`` (kept by the caller from piece to piece, so no part is a new object) and handed to
        ``sink(offset, memoryview)`` a buffer at a time; the view is valid only during the call. ``place(offset,
        n)``, when given, may return the writable memory where bytes ``[offset, offset + n)`` belong: they are then
        read straight there (one copy a byte, from the socket) and handed over as ``sink(offset, view, placed=True)``
        (None: into ``buffer``, as without it). For the objects
        :meth:`direct` gives an address for; where the GET fails other than by an answer about the object (a
        refusal, a redirect, an encoded body, a dropped connection), the rest of the piece goes through
        :meth:`aget_into` from the byte where it stopped, which does what it does (``GetObject`` for ``s3://``)."""
        if end <= start:
            return
        at, sink_failed = start, False

        def counted(offset: int, part, placed: bool = False) -> None:
            nonlocal at, sink_failed
            try:
                sink(offset, part, placed=True) if placed else sink(offset, part)
            except BaseException:
                sink_failed = True
                raise
            at = offset + len(part)

        address = self.direct()
        if address is not None:
            reads = self._s3_reads()
            if reads is not None:
                with self._lock:
                    reads.plain += 1
            try:
                _direct_get(self, address, start, end, counted, buffer, place)
                return
            except Exception as e:
                if sink_failed or isinstance(e, (ObjectChangedError, FormatError)) or \
                        not isinstance(e, _TRANSPORT_ERRORS):
                    raise  # the destination's own error, or one about the object
                self._direct_failed()
        from fsspec.asyn import sync

        sync(self.fs.loop, self.aget_into, at, end, sink)

    def direct(self) -> tuple[str, dict, object] | None:
        """Where a plain GET of this object's ranges may go with no event loop (:meth:`get_into`): ``(url, headers,
        ssl context or None)``, or None. ``http(s)://`` URLs of fsspec's HTTP filesystem with no client options
        (no session options, headers or authentication of its own to carry), and ``s3://`` objects read by signed
        plain GETs (:class:`_S3Reads`: the URL is signed here, on the filesystem's loop, once per half hour)."""
        reads = self._s3_reads()
        if reads is not None:
            if not reads.use_plain:
                return None
            import time

            url = reads.url
            if url is None or time.monotonic() - reads.signed_at > reads.EXPIRES / 2:  # sign (again) on the loop
                from fsspec.asyn import sync

                url = sync(self.fs.loop, reads._signed_url)
            if url is None:
                reads.use_plain = False
                return None
            headers = {"If-Match": self.etag}
            return url, headers, _ssl_context(reads._ssl)
        return getattr(self, "_http_direct", None)

    def _direct_failed(self) -> None:
        """A GET of :meth:`get_into` failed other than by an answer about the object: the object's later reads go
        as they went before (``s3://``: ``GetObject``, as :class:`_S3Reads` does after a failed plain GET)."""
        reads = self._s3_reads()
        if reads is not None:
            reads.use_plain = False
        self._http_direct = None

    def _s3_reads(self) -> "_S3Reads | None":
        reads = getattr(getattr(self, "_get_into", None), "__self__", None)
        return reads if isinstance(reads, _S3Reads) else None

    async def _pump(self, read, start: int, end: int, sink) -> None:
        at = start
        while True:
            part = await read(_PART)
            if not part:
                break
            if at + len(part) > end:
                raise FormatError(f"{self.url}: expected {end - start} bytes at offset {start}, got more (the store "
                                  "ignored the range?); nothing read is used")
            sink(at, part)
            at += len(part)
        self._checked(start, end, _Length(at - start))

    def _failure(self, e: Exception, start: int, end: int) -> Exception:
        if isinstance(e, (ObjectChangedError, FormatError)):
            return e
        text = f"{type(e).__name__}: {e}"
        status = _http_status(e)
        if status == 412 or "PreconditionFailed" in text or "Precondition Failed" in text:
            return ObjectChangedError(
                f"{self.url}: the object changed while it was being read in ranges (its ETag is no longer "
                f"{self.etag} at offset {start}); nothing read is used: open it again")
        if isinstance(e, FileNotFoundError):
            return ObjectChangedError(f"{self.url}: the object was removed while it was being read (at offset "
                                      f"{start}); nothing read is used")
        if status == 416 or "InvalidRange" in text or "Range Not Satisfiable" in text:
            return FormatError(f"{self.url}: bytes {start}..{end} asked for, but the object now ends before offset "
                               f"{start} (it is not the {self.size} bytes it was when opened: truncated or replaced "
                               "while being read?); nothing read is used: open it again")
        return OSError(f"{self.url}: reading bytes {start}..{end} failed: {text}")

    def _checked(self, start: int, end: int, data: bytes) -> bytes:
        if len(data) != end - start:
            raise FormatError(f"{self.url}: expected {end - start} bytes at offset {start}, got {len(data)} (the "
                              f"object is not the {self.size} bytes it was when opened: truncated or replaced while "
                              "being read?); nothing read is used: open it again")
        return data

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` clipped to the object, in one request (headers and indexes; payloads stream)."""
        return self.get(max(0, start), min(end, self.size))

    # -- many ranges, streamed -----------------------------------------------------------------------
    def stream(self, spans: Iterable[tuple[int, int]], deliver: Callable[[int, bytes], object], *,
               chunk: int | None = None, threads: int | None = None,
               done: Callable[[int, int], object] | None = None, parts: bool = False) -> int:
        """Fetch the byte ranges ``spans`` (``(start, end)``, as given: merge them first with :func:`merged` when
        bytes between may be read) in pieces of at most ``chunk`` bytes (None: :data:`CHUNK`), ``threads`` requests
        at a time (None: :data:`THREADS`), and call
        ``deliver(offset, data)`` for each piece on the thread that fetched it. ``done(start, end)``, when given,
        is called (one call at a time) once every piece of the range that starts at ``start`` was delivered.
        Returns the bytes fetched. The first error stops the rest and is raised; deliveries made before it have
        happened, so a caller that raises loses only its destination's contents. (:func:`stream` reads ranges of
        several objects in one pool of requests.)

        ``parts=True`` says that ``deliver`` takes any part of a piece, quickly, on any thread, and keeps no
        reference to it after the call: plain ranged GETs (``http(s)://``, signed ``s3://``:
        :meth:`RemoteObject.direct`) are then sent by ``threads`` threads of the stream's own, each reading its bodies
        with ``readinto`` into one buffer of ``_PART`` bytes it keeps (:meth:`get_into`); on other async
        filesystems ``deliver`` is called on the event loop's thread with each part of the body as the HTTP client
        reads it (:meth:`aget_into`). Either way no piece is joined into one buffer first. A ``deliver`` with a
        ``place(offset, n)`` attribute (the writable memory where those bytes belong, or None) and a
        ``placed(offset, data)`` one (told once they are there) has the bytes of a direct GET read straight into
        that memory, one copy less.
        """
        return stream([(self, spans, deliver, done)], chunk=chunk, threads=threads, parts=parts)

    def check(self) -> None:
        """Raise :class:`ObjectChangedError` when the object is no longer the one opened (a store that takes no
        conditional reads: ranges read may mix two objects). Call it after the last :meth:`stream`."""
        self.fs.invalidate_cache(self.path)
        try:
            now = identity(self.fs.info(self.path))
        except FileNotFoundError:
            raise ObjectChangedError(f"{self.url}: the object was removed while it was being read; nothing read is "
                                     "used") from None
        if now != self.identity:
            raise ObjectChangedError(f"{self.url}: the object changed while it was being read in ranges "
                                     f"({dict(self.identity)} at the start, {dict(now)} at the end); nothing read "
                                     "is used: open it again")


def _same_object(obj: RemoteObject, etag: str | None, start: int) -> None:
    """Raise :class:`ObjectChangedError` where an answer names another ETag than the object's (a store that did not
    honour ``If-Match``)."""
    if obj.etag and etag and etag != obj.etag:
        raise ObjectChangedError(f"{obj.url}: the object changed while it was being read in ranges (its ETag is "
                                 f"{etag}, not {obj.etag}, at offset {start}); nothing read is used: open it again")


class _NotPlain(Exception):
    """A plain GET answered what only a ``GetObject`` knows what to do with (a redirect, an encoded body)."""


async def _plain_get(obj: RemoteObject, http, url, headers: dict, start: int, end: int, sink, *,
                     partial: bool = False, **options) -> None:
    """One ranged GET of bytes ``[start, end)`` of ``obj`` at ``url`` with ``headers``, through fsspec's HTTP
    filesystem ``http`` (its aiohttp session and request options), the body handed to ``sink`` in parts as it
    arrives (:meth:`RemoteObject._pump`). ``partial``: only a ``206`` answer of the body's stored bytes is taken;
    anything else raises :class:`_NotPlain`. ``options`` go to aiohttp's request (``ssl``)."""
    kw = {**http.kwargs, **options}
    sent = {**kw.pop("headers", {}), "Range": f"bytes={start}-{end - 1}", **headers}
    session = await http.set_session()
    async with session.get(url, headers=sent, **kw) as r:
        http._raise_not_found_for_status(r, url)
        _same_object(obj, r.headers.get("ETag"), start)
        if partial and (r.status != 206 or r.headers.get("Content-Encoding", "identity") != "identity"):
            raise _NotPlain(f"HTTP {r.status} {r.headers.get('Content-Encoding', '')}")
        await obj._pump(r.content.read, start, end, sink)


# What a direct GET may fail with that is not about the object (it then goes through the event loop's client).
_TRANSPORT_ERRORS = (OSError, _http_client.HTTPException, _NotPlain)


class _Connections:
    """The idle keep-alive connections of :func:`_direct_get`, per scheme, host and TLS context; a forked child
    starts with none (its parent's sockets are not its own)."""

    def __init__(self):
        self.idle: dict[tuple, list] = {}
        self.lock = threading.Lock()

    def take(self, scheme: str, netloc: str, context):
        key = (scheme, netloc, id(context))
        with self.lock:
            idle = self.idle.get(key)
            if idle:
                return key, idle.pop()
        if scheme == "https":
            return key, _http_client.HTTPSConnection(netloc, context=context, timeout=_TIMEOUT)
        return key, _http_client.HTTPConnection(netloc, timeout=_TIMEOUT)

    def give(self, key: tuple, connection) -> None:
        with self.lock:
            idle = self.idle.setdefault(key, [])
            if len(idle) < 4 * THREADS:
                idle.append(connection)
                return
        connection.close()

    def forget(self) -> None:
        self.idle = {}
        self.lock = threading.Lock()


_CONNECTIONS = _Connections()
_TIMEOUT = 300  # seconds a direct GET may wait on its socket (aiohttp's default total for fsspec's HTTP client)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_CONNECTIONS.forget)


_UNVERIFIED = None


def _ssl_context(options: dict):
    """The ``ssl.SSLContext`` of :class:`_S3Reads`' aiohttp ``ssl`` option (``{}``: the system's, checked;
    ``False``: no check; a context: that one); None for plain ``http``."""
    import ssl

    global _UNVERIFIED
    value = options.get("ssl", True)
    if value is False:
        if _UNVERIFIED is None:  # one context: the kept connections are found by it
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            _UNVERIFIED = context
        return _UNVERIFIED
    if isinstance(value, ssl.SSLContext):
        return value
    return None


def _direct_get(obj: "RemoteObject", address: tuple, start: int, end: int, sink, buffer: bytearray,
                place=None) -> None:
    """One ranged GET of bytes ``[start, end)`` of ``obj`` at ``address`` (:meth:`RemoteObject.direct`) on this
    thread: the body read with ``readinto`` into ``buffer`` (or where ``place`` says: :meth:`RemoteObject.get_into`),
    each filled part handed to ``sink(offset, view)``.
    Answers about the object are its errors (412: changed; 404: removed; 416 or a body of another length: cut
    short); an answer a plain GET cannot take (any other status, a redirect, an encoded body) is :class:`_NotPlain`
    before a byte is delivered."""
    from urllib.parse import urlsplit

    url, headers, context = address
    parts = urlsplit(url)
    key, connection = _CONNECTIONS.take(parts.scheme, parts.netloc, context)
    kept = False
    try:
        target = parts.path + ("?" + parts.query if parts.query else "")
        connection.request("GET", target or "/", headers={**headers, "Range": f"bytes={start}-{end - 1}",
                                                           "Accept-Encoding": "identity"})
        r = connection.getresponse()
        if r.status == 404:
            raise FileNotFoundError(url)
        if r.status in (412, 416):
            raise _StatusError(r.status, r.reason)
        if r.status not in (200, 206) or r.getheader("Content-Encoding", "identity") != "identity":
            raise _NotPlain(f"HTTP {r.status} {r.getheader('Content-Encoding', '')}")
        _same_object(obj, r.getheader("ETag"), start)
        if r.length is not None and r.length > end - start:
            raise FormatError(f"{obj.url}: expected {end - start} bytes at offset {start}, got more (the store "
                              "ignored the range?); nothing read is used")
        view, at = memoryview(buffer), start
        while at < end:
            want = min(len(view), end - at)
            target = place(at, want) if place is not None else None
            into = view[:want] if target is None else memoryview(target).cast("B")
            n = r.readinto(into)
            if not n:
                if r.length:  # the connection ended before the body did: not the object's doing
                    raise _http_client.IncompleteRead(b"", r.length)
                break
            if target is None:
                sink(at, into[:n])
            else:
                sink(at, into[:n], placed=True)
            at += n
        obj._checked(start, end, _Length(at - start))
        kept = not r.will_close and r.isclosed()  # the whole body read: the connection serves the next GET
    except Exception as e:
        if isinstance(e, (_StatusError, FileNotFoundError)):
            raise obj._failure(e, start, end) from None
        raise
    finally:
        if kept:
            _CONNECTIONS.give(key, connection)
        else:
            connection.close()


class _StatusError(OSError):
    """A direct GET's answer about the object (its HTTP ``status``: 412, 416), for :meth:`RemoteObject._failure`."""

    def __init__(self, status: int, reason: str):
        super().__init__(f"HTTP {status} {reason}")
        self.status = status


_PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


def plain_gets_allowed(fs) -> bool:
    """Whether the ``s3://`` filesystem ``fs`` may read with presigned plain GETs (:class:`_S3Reads`): not when it
    goes through a proxy (``config_kwargs``' ``proxies``, or the environment's, which botocore uses and fsspec's HTTP
    client does not).

    >>> import types
    >>> plain_gets_allowed(types.SimpleNamespace(config_kwargs={"proxies": {"https": "http://p:3128"}}))
    False
    """
    import os

    config = getattr(fs, "config_kwargs", None) or {}
    if config.get("proxies"):
        return False
    return not any(os.environ.get(name) for name in _PROXY_VARIABLES)


class _S3Reads:
    """The ranged reads of one ``s3://`` object: ``GetObject`` signed once (a presigned URL, signed again once half
    of its :attr:`EXPIRES` has passed) and sent as plain ranged GETs through fsspec's HTTP client, the one
    ``http(s)://`` URLs are read with. botocore's ``GetObject`` spends the event loop's CPU on every request
    (signing, its event hooks, parsing the answer): 1.48 ms a 1 MiB piece, its body's copy included, against
    0.66 ms for a signed plain GET (docs/remote.md).

    A GET carries ``Range`` and ``If-Match`` (the ETag), which a presigned URL leaves unsigned; the credentials,
    endpoint, region and version are the s3fs filesystem's (``storage_options``), used by botocore's own signing.
    Every read of the object is a ``GetObject``, as before, where a plain GET cannot carry what the filesystem
    sends: request parameters (s3fs's ``s3_additional_kwargs``: SSE-C keys; ``requester_pays``) or a proxy
    (:func:`plain_gets_allowed`). Over ``https`` the GETs check certificates as botocore does: ``client_kwargs``'
    ``verify`` (False: no check; a path: that bundle), else the session's ``ca_bundle`` (``AWS_CA_BUNDLE``,
    ``~/.aws/config``), else the system's. A plain GET that fails other than by an answer about the
    object (412: it changed; 416: it is shorter; 404: it is gone; a body of the wrong length) is sent again as a
    ``GetObject`` from the byte where it stopped, and so are the object's later reads: botocore then does what it
    does (region redirects, retries of throttling and dropped connections, its errors). :attr:`signed` and
    :attr:`plain` count URLs signed and plain GETs sent.
    """

    EXPIRES = 3600

    def __init__(self, obj: RemoteObject):
        fs = obj.fs
        self.obj, self.fs = obj, fs
        self.bucket, self.key, version = fs.split_path(obj.path)
        self.extra = {"VersionId": version} if version else {}
        self.use_plain = plain_gets_allowed(fs)
        self.url: str | None = None
        self.signed_at = 0.0
        self.signed = self.plain = 0
        self._lock = None
        self._http = None
        self._ssl: dict = {}

    async def _signed_url(self):
        """The presigned URL (signed now if there is none or it is half way to expiring); None where the
        filesystem adds request parameters to ``GetObject`` that a plain GET cannot carry."""
        import asyncio
        import time

        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # the first reads of a stream wait for one signing
            if self.url is None or time.monotonic() - self.signed_at > self.EXPIRES / 2:
                fs = self.fs
                await fs.set_session()
                s3 = await fs.get_s3(self.bucket)  # the bucket's region's client, where s3fs keeps one per region
                try:
                    params = fs._get_s3_method_kwargs(s3.get_object, Bucket=self.bucket, Key=self.key, **self.extra)
                except AttributeError:  # an s3fs that does not say what it adds: GetObject
                    return None
                if set(params) - {"Bucket", "Key", "VersionId"}:
                    return None  # SSE-C keys, RequestPayer, ...: headers botocore signs and sends itself
                self.url = await s3.generate_presigned_url("get_object", Params=params, ExpiresIn=self.EXPIRES)
                self._ssl = self._certificates() if self.url.startswith("https:") else {}
                self.signed_at = time.monotonic()
                self.signed += 1
            return self.url

    def _certificates(self) -> dict:
        """aiohttp's ``ssl`` option for the certificates botocore would check (see the class docstring)."""
        import ssl

        verify = (getattr(self.fs, "client_kwargs", None) or {}).get("verify")
        if verify is None:
            try:
                verify = self.fs.session.get_config_variable("ca_bundle")
            except Exception:  # no botocore session to ask: the system's certificates
                verify = None
        if verify is False:
            return {"ssl": False}
        if isinstance(verify, str):
            return {"ssl": ssl.create_default_context(cafile=verify)}
        return {}

    def _client(self):
        """fsspec's HTTP filesystem on the s3 filesystem's event loop (the one ``http(s)://`` URLs use, where
        that is fsspec's own loop)."""
        if self._http is None:
            import fsspec
            from fsspec.asyn import get_loop

            loop = self.fs.loop
            self._http = fsspec.filesystem("http", **({} if loop is get_loop() else {"loop": loop}))
        return self._http

    async def into(self, start: int, end: int, sink) -> None:
        """Bytes ``[start, end)`` handed to ``sink(offset, part)`` as they arrive (see the class docstring)."""
        at = start

        def counted(offset: int, part) -> None:
            nonlocal at
            sink(offset, part)
            at = offset + len(part)

        if self.use_plain:
            url = await self._signed_url()
            if url is None:
                self.use_plain = False
            else:
                import yarl

                try:
                    self.plain += 1
                    await _plain_get(self.obj, self._client(), yarl.URL(url, encoded=True),
                                     {"If-Match": self.obj.etag}, start, end, counted, partial=True, **self._ssl)
                    return
                except Exception as e:
                    if isinstance(e, (FormatError, FileNotFoundError)) or _http_status(e) in (412, 416):
                        raise  # about the object: GetObject would say the same
                    self.use_plain = False  # botocore's from here on, from the byte this one stopped at
        response = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self.key,
                                          Range=f"bytes={at}-{end - 1}", IfMatch=self.obj.etag, **self.extra)
        body = response["Body"]
        try:
            _same_object(self.obj, response.get("ETag"), at)
            await self.obj._pump(body.read, at, end, counted)
        finally:
            body.close()

    async def get(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` in one buffer."""
        parts: list = []
        await self.into(start, end, lambda _at, part: parts.append(part))
        return b"".join(parts)


def stream(jobs: Iterable[tuple], *, chunk: int | None = None, threads: int | None = None, parts: bool = False) -> int:
    """:meth:`RemoteObject.stream` for several objects at once, their pieces sharing one pool of ``threads``
    requests: ``jobs`` is ``[(remote object, spans, deliver, done or None), ...]``. Returns the bytes fetched.

    >>> import fsspec
    >>> fs = fsspec.filesystem("memory")
    >>> fs.pipe({"/doc/s1": b"abcdef", "/doc/s2": b"uvwxyz"})
    >>> got = {}
    >>> jobs = [(RemoteObject(f"memory://doc/{n}"), [(1, 5)], lambda at, d, n=n: got.setdefault(n, {}).update({at: d}),
    ...          None) for n in ("s1", "s2")]
    >>> stream(jobs, chunk=2), got
    (8, {'s1': {1: b'bc', 3: b'de'}, 's2': {1: b'vw', 3: b'xy'}})
    """
    chunk = CHUNK if chunk is None else chunk
    threads = THREADS if threads is None else threads
    if chunk < 1 or threads < 1:
        raise ValueError(f"chunk and threads must be positive, got {chunk} and {threads}")
    pieces = []
    left: dict[tuple, list] = {}
    for obj, spans, deliver, done in jobs:
        if obj.checksums is not None:  # each member's CRC-32 taken from its bytes as they pass to their destination
            deliver = obj.checksums.wrap(deliver)
        for start, end in spans:
            if start < 0 or end > obj.size:
                raise FormatError(f"{obj.url}: bytes {start}..{end} asked for, past the end of the {obj.size}-byte "
                                  "object (its index points outside it)")
            if end <= start:
                continue
            key = (id(obj), start)
            n = 0
            for lo in range(start, end, chunk):
                pieces.append((obj, lo, min(end, lo + chunk), deliver, done, key))
                n += 1
            left[key] = [n, start, end]
    done_lock = threading.Lock()

    def one(obj, lo: int, hi: int, deliver, done, key) -> None:
        _deliver(obj, lo, hi, obj.get(lo, hi), deliver, done, key, left, done_lock)

    total = sum(p[2] - p[1] for p in pieces)
    if parts and pieces and _all_direct(pieces):
        # Plain GETs with no event loop (http(s)://, signed s3://): each of `threads` threads sends its pieces' GETs
        # and reads their bodies into a buffer of its own, handing each part to its destination (one receive and
        # one copy a byte, spread over the threads; the event loop's one thread did both for every byte before).
        _stream_threads(pieces, threads, left, done_lock)
        return total
    loops = {id(p[0].fs.loop) if p[0].is_async else None for p in pieces}
    if pieces and len(loops) == 1 and None not in loops:
        # Async filesystems (s3fs, HTTP): the requests run as coroutines on the filesystem's event loop, at most
        # `threads` of them from the request to the end of the delivery, which runs in a pool of as many threads
        # (copies release the GIL) while the loop goes on receiving.
        from fsspec.asyn import sync

        with ThreadPoolExecutor(threads, thread_name_prefix="fastckpt-deliver") as pool:
            sync(pieces[0][0].fs.loop, _stream_async, pieces, threads, pool, left, done_lock, parts)
        return total
    if len(pieces) <= 1 or threads == 1:
        for piece in pieces:
            one(*piece)
        return total
    with ThreadPoolExecutor(min(threads, len(pieces)), thread_name_prefix="fastckpt-get") as pool:
        futures = [pool.submit(one, *piece) for piece in pieces]
        wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f.done() and not f.cancelled() and f.exception() is not None]
        if failed:
            for f in futures:
                f.cancel()
            wait(futures)
            raise failed[0].exception()
    return total


def _all_direct(pieces: list) -> bool:
    """Whether every object of ``pieces`` may be read by direct GETs (:meth:`RemoteObject.direct`)."""
    objects = {id(p[0]): p[0] for p in pieces}
    try:
        return all(getattr(obj, "is_async", False) and obj.direct() is not None for obj in objects.values())
    except Exception:  # the URL could not be signed: the event loop's client says why, naming the object
        return False


class _Halted(Exception):
    """Another thread of :func:`_stream_threads` failed: this one stops at its next part."""


def _stream_threads(pieces: list, threads: int, left: dict, done_lock) -> None:
    """Fetch ``pieces`` with :meth:`RemoteObject.get_into` on ``threads`` threads, in order, each thread reading
    its bodies into one buffer of ``_PART`` bytes that it keeps (so at most ``threads x _PART`` bytes are held
    between the sockets and the destinations). The first error stops every thread at its next part and is
    raised."""
    lock = threading.Lock()
    order = iter(pieces)
    failed: list[BaseException] = []

    def work() -> None:
        buffer = bytearray(_PART)
        try:
            while not failed:
                with lock:
                    piece = next(order, None)
                if piece is None:
                    return
                obj, lo, hi, deliver, done, key = piece

                def sink(at: int, part, obj=obj, deliver=deliver, key=key, placed: bool = False) -> None:
                    if failed:
                        raise _Halted()
                    _deliver(obj, at, at + len(part), part, deliver.placed if placed else deliver, None, key, left,
                             done_lock, request=False)

                obj.get_into(lo, hi, sink, buffer, getattr(deliver, "place", None))
                with obj._lock:
                    obj.stats.requests += 1
                if done is not None:
                    _finish(done, key, left, done_lock)
        except BaseException as e:
            with lock:
                if not isinstance(e, _Halted):
                    failed.append(e)
                elif not failed:
                    failed.append(e)

    count = min(threads, len(pieces))
    if count == 1:
        work()
    else:
        with ThreadPoolExecutor(count, thread_name_prefix="fastckpt-get") as pool:
            for _ in range(count):
                pool.submit(work)
    if failed:
        raise failed[0]


def _deliver(obj, lo: int, hi: int, data, deliver, done, key, left: dict, done_lock, request: bool = True) -> None:
    """Count a piece (or, ``request`` False, a part of one) that arrived (``obj.stats``), hand it to ``deliver``,
    and report its range done once every piece of the range is delivered."""
    stats, lock = obj.stats, obj._lock
    with lock:
        stats.requests += request
        stats.bytes += len(data)
        stats.largest = max(stats.largest, len(data))
        stats.held += len(data)
        stats.peak_held = max(stats.peak_held, stats.held)
    try:
        deliver(lo, data)
    finally:
        del data
        with lock:
            stats.held -= hi - lo
    if done is not None:
        _finish(done, key, left, done_lock)


def _finish(done, key, left: dict, done_lock) -> None:
    with done_lock:
        entry = left[key]
        entry[0] -= 1
        if entry[0] == 0:
            done(entry[1], entry[2])


async def _stream_async(pieces: list, threads: int, pool, left: dict, done_lock, parts: bool) -> None:
    import asyncio

    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(threads)

    async def one(obj, lo: int, hi: int, deliver, done, key) -> None:
        async with slots:  # from the request to the end of the delivery: at most `threads` pieces held
            if parts:
                def sink(at: int, part) -> None:
                    _deliver(obj, at, at + len(part), part, deliver, None, key, left, done_lock, request=False)

                await obj.aget_into(lo, hi, sink)
                with obj._lock:
                    obj.stats.requests += 1
                if done is not None:
                    _finish(done, key, left, done_lock)
                return
            data = await obj.aget(lo, hi)
            await loop.run_in_executor(pool, _deliver, obj, lo, hi, data, deliver, done, key, left, done_lock)

    tasks = [asyncio.ensure_future(one(*piece)) for piece in pieces]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class Scatter:
    """A ``deliver`` for :func:`stream` that places each piece into the destinations it overlaps: ``targets`` is
    ``[(object offset, nbytes, write), ...]`` (not overlapping), ``write(offset in the destination, memoryview)``
    copying the bytes there. A piece may cover the end of one destination, a gap and the start of the next.

    >>> out = {"a": bytearray(3), "b": bytearray(2)}
    >>> def into(name):
    ...     return lambda at, data: out[name].__setitem__(slice(at, at + len(data)), data)
    >>> s = Scatter([(10, 3, into("a")), (14, 2, into("b"))])
    >>> s(9, b"xABC-D"); s(15, b"E")
    >>> out
    {'a': bytearray(b'ABC'), 'b': bytearray(b'DE')}
    """

    def __init__(self, targets: Iterable[tuple[int, int, Callable]]):
        self.targets = sorted(targets, key=lambda t: t[0])
        self.starts = [t[0] for t in self.targets]

    def __call__(self, offset: int, data) -> None:
        from bisect import bisect_right

        view = memoryview(data)
        end = offset + len(view)
        i = max(0, bisect_right(self.starts, offset) - 1)
        while i < len(self.targets) and self.targets[i][0] < end:
            start, nbytes, write = self.targets[i]
            lo, hi = max(start, offset), min(start + nbytes, end)
            if lo < hi:
                write(lo - start, view[lo - offset:hi - offset])
            i += 1

    def spans(self, gap: int = GAP) -> list[tuple[int, int]]:
        """The byte ranges to fetch for these destinations (neighbours ``gap`` apart merged)."""
        return merged(((start, start + nbytes) for start, nbytes, _ in self.targets), gap)


class Checksums:
    """The CRC-32 of byte ranges of one object (``members``: ``[(name, start, end, expected CRC-32, seed)]``, not
    overlapping), taken from the pieces of a stream as they pass to their destination, so that a checked load
    reads every byte once, straight where it goes: :meth:`wrap` a ``deliver``, or set
    :attr:`RemoteObject.checksums` and every :meth:`RemoteObject.stream` does. ``seed`` is the CRC-32 of bytes
    checked with the range that do not stream (an NPZ member's ``.npy`` header, read with the index), 0 for none,
    and ``seeds`` their lengths.

    Pieces come in any order and from any thread, the parts of one request in order: each run of consecutive
    bytes keeps a running CRC-32, and once every byte of a member has arrived the runs are joined in offset
    order (``crc32_combine``) and compared. A mismatch is a :class:`~fastckpt.errors.ChecksumMismatchError`
    (a :class:`~fastckpt.errors.FormatError`) naming the URL, the member, its offset and both values, raised
    from the delivery, so the stream stops and the load that asked for it returns nothing. A member read again
    is checked again. :meth:`unchecked` names the members whose bytes have not all arrived since.

    >>> import zlib
    >>> data = bytes(range(256)) * 40
    >>> c = Checksums("memory://x", [("a", 100, 9000, zlib.crc32(data[100:9000]), 0)])
    >>> sink = c.wrap(lambda at, piece: None)
    >>> sink(5000, data[5000:9100]); sink(0, data[0:2100]); c.unchecked()
    [(100, 9000)]
    >>> sink(2100, data[2100:5000])
    >>> c.unchecked(), c.checked
    ([], 1)
    >>> c = Checksums("memory://x", [("a", 0, 4, 0, 0)])
    >>> c.wrap(lambda at, piece: None)(0, b"abcd")
    Traceback (most recent call last):
    ...
    fastckpt.errors.ChecksumMismatchError: memory://x: member 'a' (data at offset 0): CRC-32 is 0xed82cd11, expected 0x00000000: the object is damaged; nothing read is used: restore it from a copy, or load it with verify=False to take it as stored
    """

    def __init__(self, url: str, members: Iterable[tuple[str, int, int, int, int]], seeds: dict | None = None):
        self.url = url
        self.members = sorted((m for m in members), key=lambda m: m[1])
        self.starts = [m[1] for m in self.members]
        self.seeds = seeds or {}  # name -> bytes checked with the member that do not stream (the seed's length)
        self.runs: list[dict] = [{} for _ in self.members]  # per member: end of a run -> (start of the run, crc)
        self.arrived = [0] * len(self.members)
        self.done = [m[2] <= m[1] for m in self.members]
        self.checked = 0
        self._lock = threading.Lock()
        for i, m in enumerate(self.members):
            if self.done[i]:
                self._compare(i, m[4])

    def wrap(self, deliver: Callable[[int, bytes], object]) -> Callable[[int, bytes], object]:
        """``deliver`` with the bytes it is given checked first."""
        def checked(offset: int, data) -> None:
            self.feed(offset, data)
            deliver(offset, data)

        if hasattr(deliver, "place"):  # bytes read straight into place are checked there
            def placed(offset: int, data) -> None:
                self.feed(offset, data)
                deliver.placed(offset, data)

            checked.place, checked.placed = deliver.place, placed  # type: ignore[attr-defined]
        return checked

    def feed(self, offset: int, data) -> None:
        """Take bytes ``[offset, offset + len(data))`` of the object (those outside every member are not looked at)."""
        from bisect import bisect_right

        view = memoryview(data)
        end = offset + len(view)
        i = max(0, bisect_right(self.starts, offset) - 1)
        while i < len(self.members) and self.members[i][1] < end:
            _name, start, stop, _expected, _seed = self.members[i]
            lo, hi = max(start, offset), min(stop, end)
            if lo < hi:
                self._take(i, lo, view[lo - offset:hi - offset])
            i += 1

    def _take(self, i: int, at: int, part) -> None:
        runs = self.runs[i]
        with self._lock:
            run = runs.pop(at, None)  # the run this part continues (the parts of one request come in order)
        first, crc = run if run is not None else (at, 0)
        crc = _crc32(part, crc)  # outside the lock: other pieces go on meanwhile
        with self._lock:
            runs[at + len(part)] = (first, crc)
            self.arrived[i] += len(part)
            complete = self.arrived[i] >= self.members[i][2] - self.members[i][1]
            if complete:
                pieces = list(runs.items())
                self.runs[i], self.arrived[i] = {}, 0  # read again, checked again
        if complete:
            name, start, _stop, _expected, seed = self.members[i]
            whole, at = seed, start
            for end, (first, value) in sorted(pieces, key=lambda p: p[1][0]):
                if first != at:  # a hole where another part came twice: never compare such a CRC
                    raise FormatError(f"{self.url}: member {name!r}: bytes {at}..{first} did not arrive and others "
                                      "came twice (overlapping pieces): its CRC-32 cannot be checked")
                whole, at = _crc32_combine(whole, value, end - first), end
            self._compare(i, whole)

    def _compare(self, i: int, got: int) -> None:
        name, start, _stop, expected, _seed = self.members[i]
        if got != expected:
            from fastckpt.errors import ChecksumMismatchError

            at = start - self.seeds.get(name, 0)
            raise ChecksumMismatchError(
                f"{self.url}: member {name!r} (data at offset {at}): CRC-32 is 0x{got:08x}, expected "
                f"0x{expected:08x}: the object is damaged; nothing read is used: restore it from a copy, or load "
                "it with verify=False to take it as stored")
        with self._lock:
            self.done[i] = True
            self.checked += 1

    def unchecked(self) -> list[tuple[int, int]]:
        """The byte ranges of the members not checked yet (to stream through the check)."""
        return [(m[1], m[2]) for m, done in zip(self.members, self.done) if not done]
