"""Object storage and remote filesystems: ``s3://``, ``gs://``, ``memory://`` and every other fsspec URL.

Every save and load of fastckpt that takes a path also takes a URL (``scheme://...`` with a scheme other than
``file``); :func:`is_url` tells which. The file's or checkpoint's bytes are exactly those of a local save: the
local writers build them (in a temporary file or directory on this machine) and this module moves them. The
filesystem comes from ``fsspec.core.url_to_fs(url, **storage_options)`` (:func:`filesystem`); ``s3://`` needs
``pip install 'fastckpt[s3]'`` (fsspec and s3fs), other schemes their fsspec implementation.

Commit protocol
---------------
Uploads and the commit of a prefix (the manifest last) are :mod:`fastckpt.store.remote`'s; this module
re-exports its names (``put_file``, ``put_directory``, ``committed``, ...) and reads.

Loads
-----
:func:`open` (``fastckpt.open(url)``) reads a tensor file's index with ranged reads (safetensors: bytes ``0..8``
and the header; NPZ: the ZIP end records, the central directory and each member's local and ``.npy``
headers), then fetches only the payloads of the tensors asked for (``names=``), 16 MiB ranges in parallel
(``fs.cat_ranges``), into a sparse temporary file that is mapped and unlinked at once: the reader is the
same :class:`~fastckpt.formats.reader.TensorFile` as for a local file, its views zero-copy in that mapping.
Local paths never come here: they keep the mapped zero-copy path of :func:`fastckpt.open`.

>>> import fastckpt, numpy as np
>>> fastckpt.save_safetensors("memory://doc/remote.safetensors", {"a": np.arange(3, dtype=np.int32),
...                                                             "b": np.ones(2, np.float32)})
>>> with fastckpt.open("memory://doc/remote.safetensors", names=["a"]) as f:
...     f.format, list(f.keys()), f.host("a").tolist()
('safetensors', ['a'], [0, 1, 2])
"""

from __future__ import annotations

import builtins
import contextlib
import os
import shutil
import struct
import tempfile
from typing import Iterable, Iterator

from fastckpt._native.safetensors import MAX_HEADER_SIZE
from fastckpt.errors import CheckpointNotFoundError, FormatError
from fastckpt.formats.contract import tensor_not_found
from fastckpt.formats.reader import TensorFile, detect_format, open_file, register_url_opener, sniff_length
from fastckpt.store.remote import (  # noqa: F401 - the write side, re-exported: one module names both
    clear,
    committed,
    committed_prefixes,
    filesystem,
    is_url,
    join,
    put_directory,
    put_file,
    remove_uncommitted,
    save_file,
)
from fastckpt.store.names import RELATIVE_PATH

__all__ = ["is_url", "filesystem", "join", "put_file", "put_directory", "clear", "get_directory", "committed",
           "committed_prefixes", "remove_uncommitted", "save_file", "local_copy", "open", "RemoteTensorFile"]

# Reads are split into ranges of this size and fetched in parallel; at most _BATCH bytes are held at once.
_RANGE = 16 << 20
_BATCH = 256 << 20
_HEAD = 64 << 10


def get_directory(url: str, local: str | os.PathLike, marker: str = "manifest.json",
                  storage_options: dict | None = None) -> list[str]:
    """Download the committed checkpoint prefix ``url`` into the local directory ``local``; returns its files.

    Files come in parallel, large ones in parallel ranges. An uncommitted prefix (no ``marker``) is a
    :class:`~fastckpt.errors.CheckpointNotFoundError`.

    >>> import tempfile
    >>> fs, _ = filesystem("memory://doc/got")
    >>> fs.pipe({"/doc/got/manifest.json": b"{}", "/doc/got/sub/a.bin": b"abc"})
    >>> d = tempfile.mkdtemp()
    >>> get_directory("memory://doc/got", d), builtins.open(d + "/sub/a.bin", "rb").read()
    (['manifest.json', 'sub/a.bin'], b'abc')
    """
    fs, path = filesystem(url, storage_options)
    path = path.rstrip("/")
    fs.invalidate_cache(path)
    try:
        listing = fs.find(path, withdirs=False, detail=True)
    except FileNotFoundError:
        listing = {}
    base = path.strip("/") + "/"
    sizes = {}
    for key, entry in listing.items():
        rel = key.strip("/")[len(base):]
        RELATIVE_PATH.check(rel, "object key", where=url, error=FormatError)  # never a file outside the copy
        sizes[rel] = int(entry.get("size") or 0)
    if marker not in sizes:
        what = "nothing there" if not sizes else f"{len(sizes)} files but no {marker!r}: a save that did not commit"
        raise CheckpointNotFoundError(f"{url}: no committed checkpoint ({what}); expected {join(url, marker)}")
    local = os.fspath(local)
    ranges = []
    for rel, size in sorted(sizes.items()):
        target = os.path.join(local, *rel.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with builtins.open(target, "wb") as f:
            f.truncate(size)
        ranges.append((f"{path}/{rel}", target, [(0, size)]))
    _fetch_into(fs, url, ranges)
    return sorted(sizes)


def _fetch_into(fs, url: str, plan: list[tuple[str, str, list[tuple[int, int]]]]) -> None:
    """Fetch byte ranges of remote files into local files at the same offsets, in parallel ranges of _RANGE bytes.

    ``plan``: (remote path, local file, [(start, end), ...]); the local files exist and are large enough.
    """
    pieces = []
    for remote, target, spans in plan:
        for start, end in spans:
            for s in range(start, end, _RANGE):
                pieces.append((remote, target, s, min(end, s + _RANGE)))
    fds: dict[str, int] = {}
    try:
        for _, target, _, _ in pieces:
            if target not in fds:
                fds[target] = os.open(target, os.O_WRONLY)
        batch: list = []
        held = 0
        for piece in pieces + [None]:
            if piece is not None and (held + piece[3] - piece[2] <= _BATCH or not batch):
                batch.append(piece)
                held += piece[3] - piece[2]
                continue
            if batch:
                blobs = fs.cat_ranges([p[0] for p in batch], [p[2] for p in batch], [p[3] for p in batch])
                for (remote, target, start, end), blob in zip(batch, blobs):
                    if isinstance(blob, Exception):
                        raise OSError(f"{url}: reading bytes {start}..{end} of {remote} failed: {blob}") from blob
                    if len(blob) != end - start:
                        raise FormatError(f"{url}: {remote}: expected {end - start} bytes at offset {start}, got "
                                          f"{len(blob)} (the object is shorter than its listing said: changed "
                                          "while being read?)")
                    _pwrite_all(fds[target], blob, start)
            batch, held = ([piece], piece[3] - piece[2]) if piece is not None else ([], 0)
    finally:
        for fd in fds.values():
            os.close(fd)


def _pwrite_all(fd: int, data: bytes, position: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, position)
        view, position = view[written:], position + written


@contextlib.contextmanager
def local_copy(url: str, marker: str = "manifest.json", storage_options: dict | None = None) -> Iterator[str]:
    """A temporary local directory holding the committed checkpoint prefix ``url``; removed on leaving.

    An error raised inside names ``url`` where it named the temporary directory (which is gone by then).

    >>> fs, _ = filesystem("memory://doc/lc")
    >>> fs.pipe({"/doc/lc/manifest.json": b"{}"})
    >>> with local_copy("memory://doc/lc") as d:
    ...     sorted(os.listdir(d))
    ['manifest.json']
    """
    tmp = tempfile.mkdtemp(prefix="fastckpt-down-")
    try:
        with naming_url(tmp, url):
            get_directory(url, tmp, marker, storage_options)
            yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def naming_url(local: str, url: str) -> Iterator[None]:
    """An error raised inside names ``url`` where its message named ``local``, the local copy of ``url``
    (which is gone by the time the caller reads it).

    >>> with naming_url("/tmp/x", "s3://b/ckpt/"):
    ...     raise ValueError("/tmp/x/manifest.json: bad")
    Traceback (most recent call last):
    ...
    ValueError: s3://b/ckpt/manifest.json: bad
    """
    try:
        yield
    except Exception as e:
        if e.args and isinstance(e.args[0], str) and local in e.args[0]:
            e.args = (e.args[0].replace(local, url.rstrip("/")), *e.args[1:])
        raise


# -- tensor files ----------------------------------------------------------------------------------

def open(url: str, *, storage_options: dict | None = None, names: Iterable[str] | None = None,  # noqa: A001
         backend: str = "mmap", copy_on_write: bool = False, max_header_size: int | None = None) -> "RemoteTensorFile":
    """Open the NPZ or safetensors file at ``url``, fetching its index and the tensors ``names`` (None: all).

    ``fastckpt.open(url, ...)`` comes here for a URL. Only the index and the payloads of ``names`` leave the
    store (ranged reads, in parallel); the reader holds those tensors only (``keys()`` are ``names``, in file
    order). A name the file does not hold is a :class:`~fastckpt.errors.TensorNotFoundError`. ``backend``,
    ``copy_on_write`` and ``max_header_size`` apply to the local copy as :func:`fastckpt.open` applies them
    to a file.

    >>> import fastckpt, numpy as np
    >>> fastckpt.save_npz("memory://doc/open.npz", {"x": np.arange(4, dtype=np.int16), "y": np.zeros(3)})
    >>> with open("memory://doc/open.npz", names=["y"]) as f:
    ...     f.path, list(f), f["y"].tolist()
    ('memory://doc/open.npz', ['y'], [0.0, 0.0, 0.0])
    """
    fs, path = filesystem(url, storage_options)
    fs.invalidate_cache(path)  # another writer may have replaced the object since this filesystem listed it
    try:
        info = fs.info(path)  # one request: the size, and whether this is a prefix
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{url}: no such object (expected an NPZ or safetensors file)") from None
    size = int(info.get("size") or 0)
    identity = _identity(info)
    if info.get("type") == "directory":
        raise CheckpointNotFoundError(f"{url}: a prefix, not one tensor file; fastckpt.open reads one NPZ or "
                                      "safetensors file from a URL (checkpoints: fastckpt.train.load_checkpoint(url), "
                                      "fastckpt.sharded.Loader)")
    fd, local = tempfile.mkstemp(prefix="fastckpt-open-", suffix=".part")
    try:
        os.ftruncate(fd, size)  # sparse: only the ranges fetched below take space
        os.close(fd)
        fd = -1
        if names is None:  # every tensor: the whole object in one streamed download, as the client's own get
            try:
                fs.get_file(path, local)
            except Exception as e:
                raise OSError(f"{url}: download of {size} bytes failed: {type(e).__name__}: {e}") from e
            try:
                whole = open_file(local, backend=backend, copy_on_write=copy_on_write,
                                  max_header_size=max_header_size)
            except FormatError as e:  # name the URL, not the local copy
                raise FormatError(str(e).replace(local, url)) from None
            return RemoteTensorFile(whole, url, list(whole.keys()))
        head_end = min(size, _HEAD)
        _fetch_into(fs, url, [(path, local, [(0, head_end)])])
        with builtins.open(local, "rb") as f:
            head = f.read(head_end)
        fmt = detect_format(head[:sniff_length(head[:9])])
        if fmt == "safetensors":
            # At most one byte past the format's cap on the header: the parser then names the bad length.
            header_end = min(size, 8 + min(int.from_bytes(head[:8], "little"), MAX_HEADER_SIZE + 1))
            if header_end > head_end:
                _fetch_into(fs, url, [(path, local, [(head_end, header_end)])])
            have = [(0, max(head_end, header_end))]
        elif fmt == "npz":
            have = _fetch_npz_index(fs, url, path, local, size, head_end)
        else:
            raise FormatError(f"{url}: not an NPZ (ZIP) or safetensors file: first bytes are {head[:9]!r} "
                              "(expected b'PK\\x03\\x04' for NPZ, or an 8-byte little-endian header length followed "
                              "by '{' for safetensors)")
        try:
            with open_file(local, max_header_size=max_header_size) as index:  # what to fetch
                wanted = _select(index, url, names)
            spans = sorted((i.offset, i.offset + i.nbytes) for i in wanted)
            _fetch_into(fs, url, [(path, local, _missing(_merged(spans), have))])
            _check_unchanged(fs, path, url, identity)  # the ranges came from several requests: one object?
            # Mapped once every byte it serves is in place.
            whole = open_file(local, backend=backend, copy_on_write=copy_on_write, max_header_size=max_header_size)
        except FormatError as e:  # name the URL, not the local copy
            raise FormatError(str(e).replace(local, url)) from None
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(local)  # the mapping keeps the bytes until the reader is closed and its views are gone
    return RemoteTensorFile(whole, url, [i.name for i in wanted])


def _select(whole, url: str, names):
    if names is None:
        return list(whole.infos.values())
    if isinstance(names, str):
        raise TypeError(f"names must be a list of tensor names, got the string {names!r}; use names=[{names!r}]")
    names = list(dict.fromkeys(names))
    for n in names:
        if n not in whole.infos:
            raise tensor_not_found(url, n, whole.infos)
    chosen = set(names)
    return [i for i in whole.infos.values() if i.name in chosen]


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted byte ranges with neighbours closer than 64 KiB joined, so small tensors cost one request."""
    out: list[list[int]] = []
    for start, end in spans:
        if out and start - out[-1][1] <= _HEAD:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out if e > s]


def _missing(spans: list[tuple[int, int]], have: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``spans`` not inside any range of ``have`` (bytes already fetched are not fetched again).

    >>> _missing([(0, 100), (200, 300)], [(50, 250)])
    [(0, 50), (250, 300)]
    """
    out = []
    for start, end in spans:
        for h_start, h_end in sorted(have):
            if h_end <= start or h_start >= end:
                continue
            if h_start > start:
                out.append((start, h_start))
            start = max(start, h_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


_EOCD = b"PK\x05\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"


def _fetch_npz_index(fs, url: str, path: str, local: str, size: int, head_end: int) -> list[tuple[int, int]]:
    """Fetch what the NPZ parser reads besides payloads: the end records, the central directory, each member's
    local header and ``.npy`` header (the first 64 KiB of each member, or all of a smaller one); bytes
    ``0..head_end`` are there already. Returns the byte ranges now fetched."""
    tail_start = max(0, size - _HEAD - 22)
    _fetch_into(fs, url, [(path, local, [(max(head_end, tail_start), size)])])
    with builtins.open(local, "rb") as f:
        f.seek(tail_start)
        tail = f.read()
    at = tail.rfind(_EOCD)
    if at < 0 or len(tail) - at < 22:
        raise FormatError(f"{url}: no ZIP end-of-central-directory record in the last {len(tail)} bytes "
                          "(file truncated?)")
    cd_size, cd_offset = struct.unpack_from("<II", tail, at + 12)
    if cd_offset == 0xFFFFFFFF or cd_size == 0xFFFFFFFF:
        loc = at - 20
        if loc < 0 or tail[loc:loc + 4] != _ZIP64_LOCATOR:
            raise FormatError(f"{url}: ZIP64 sizes without a ZIP64 locator before the end record at offset "
                              f"{tail_start + at}")
        (record,) = struct.unpack_from("<Q", tail, loc + 8)
        if record < tail_start:
            _fetch_into(fs, url, [(path, local, [(record, min(size, record + 56))])])
        with builtins.open(local, "rb") as f:
            f.seek(record)
            z64 = f.read(56)
        cd_size, cd_offset = struct.unpack_from("<QQ", z64, 40)
    if cd_offset + cd_size > size:
        raise FormatError(f"{url}: central directory at offset {cd_offset} ({cd_size} bytes) runs past the end of "
                          f"the {size}-byte file (truncated?)")
    have = [(0, head_end), (tail_start, size)]
    if cd_offset < tail_start:
        _fetch_into(fs, url, [(path, local, _missing([(cd_offset, tail_start)], have))])
        have.append((cd_offset, tail_start))
    import zipfile

    try:
        with zipfile.ZipFile(local) as z:
            starts = sorted(i.header_offset for i in z.infolist())
    except zipfile.BadZipFile as e:
        raise FormatError(f"{url}: bad ZIP central directory at offset {cd_offset}: {e}") from e
    ends = starts[1:] + [cd_offset]
    prefixes = _merged([(s, min(e, s + _HEAD)) for s, e in zip(starts, ends)])
    _fetch_into(fs, url, [(path, local, _missing(prefixes, have))])
    return have + prefixes


# What the store says of an object that changes when the object is replaced (the first ones it reports).
_IDENTITY_KEYS = ("ETag", "etag", "VersionId", "generation", "LastModified", "mtime", "created", "size")


def _identity(info: dict) -> tuple:
    return tuple((k, str(info[k])) for k in _IDENTITY_KEYS if info.get(k) is not None)


def _check_unchanged(fs, path: str, url: str, identity: tuple) -> None:
    """Raise when the object at ``path`` is not the one ``identity`` describes (it was replaced while its ranges
    were being read, so the bytes read may mix two objects)."""
    fs.invalidate_cache(path)
    now = _identity(fs.info(path))
    if now != identity:
        raise OSError(f"{url}: the object changed while it was being read in ranges ({dict(identity)} at the "
                      f"start, {dict(now)} at the end); nothing read is used: open it again")


class RemoteTensorFile(TensorFile):
    """The reader of a tensor file opened from a URL: a :class:`~fastckpt.formats.reader.TensorFile` over a
    private local copy of the index and the tensors fetched, holding only those tensors.

    It implements the reader contract (:class:`~fastckpt.formats.contract.TensorReader`); ``path`` is the URL.

    >>> import fastckpt, numpy as np
    >>> fastckpt.save_safetensors("memory://doc/rtf.safetensors", {"w": np.eye(2, dtype=np.float32)})
    >>> f = fastckpt.open("memory://doc/rtf.safetensors")
    >>> f, f.info("w").shape
    (<fastckpt.RemoteTensorFile 'memory://doc/rtf.safetensors' format=safetensors tensors=1>, (2, 2))
    >>> f.close(); f
    <Closed fastckpt.RemoteTensorFile>
    """

    def __init__(self, whole: TensorFile, url: str, names: list[str]):
        chosen = set(names)
        super().__init__(whole.mapped, whole.format, [i for i in whole.infos.values() if i.name in chosen],
                         whole.metadata)
        self.url = url

    @property
    def path(self) -> str:
        """The URL the file was opened from."""
        return self.url

    def __repr__(self) -> str:
        if self.closed:
            return "<Closed fastckpt.RemoteTensorFile>"
        return f"<fastckpt.RemoteTensorFile {self.url!r} format={self.format} tensors={len(self)}>"


register_url_opener(open)  # fastckpt.open(url) comes here
