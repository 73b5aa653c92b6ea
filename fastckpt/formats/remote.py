"""Object storage and remote filesystems: ``s3://``, ``gs://``, ``memory://`` and every other fsspec URL.

Every save and load of fastckpt that takes a path also takes a URL (``scheme://...`` with a scheme other than
``file``); :func:`is_url` tells which. The file's or checkpoint's bytes are exactly those of a local save: the
local writers build them (in a temporary file or directory on this machine) and this module moves them. The
filesystem comes from ``fsspec.core.url_to_fs(url, **storage_options)`` (:func:`filesystem`); ``s3://`` needs
``pip install 'fastckpt[s3]'`` (fsspec and s3fs), other schemes their fsspec implementation.

Commit protocol
---------------
Object stores have no rename, so a reader must never be able to see a half-written object or checkpoint:

1. **One file** (a tensor file, a model file) goes to its final key in one upload (:func:`put_file`). On an
   object store (``s3``, ``gs``, ``az``, ...) that is one ``PutObject``, or for a file of 100 MiB and more one
   multipart upload whose parts go in parallel: S3 makes the object visible only when the upload completes
   (``CompleteMultipartUpload``), so a reader sees the previous object or the new one whole; a failed upload
   is aborted. On a filesystem that can rename (``memory``, ``sftp``, ...) the bytes go to
   ``<key>.tmp-<uuid>`` first and are then moved onto ``<key>``.

   ``overwrite=False`` on ``s3://`` is a conditional write (``If-None-Match: *`` on the ``PutObject`` or the
   ``CompleteMultipartUpload``): the store refuses an existing key in the same step, so of two writers racing
   for one key exactly one commits and the other gets :class:`FileExistsError` naming the URL. Stores without
   conditional writes here (``gs``, ``az`` through fsspec, and filesystems that rename) check that the key is
   absent just before the upload's last step: a writer that commits the key between that check and that step
   is replaced, which the message of :func:`put_file`'s docstring and docs/commit.md say.
2. **A checkpoint directory** (training and sharded checkpoints: a prefix with a manifest) is uploaded by
   :func:`put_directory`: every file except the manifest, in parallel, under the final prefix
   ``<target>/``; then the manifest alone, last. The manifest's key is the commit marker: a prefix without one
   is *uncommitted*. Readers (:func:`get_directory`) refuse an uncommitted prefix; ``CheckpointManager``'s
   ``latest()`` and ``all_steps()`` do not see one, and its next save removes it
   (:func:`remove_uncommitted`). Overwriting a committed prefix first deletes its manifest (so it is
   uncommitted from then on), then its files, then uploads. The data are never copied a second time on the
   server (a copy from a staging prefix would move every byte twice).

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
import errno
import os
import re
import shutil
import struct
import tempfile
import uuid
from typing import Callable, Iterable, Iterator

from fastckpt._native.safetensors import MAX_HEADER_SIZE
from fastckpt.errors import CheckpointNotFoundError, FormatError
from fastckpt.formats.contract import tensor_not_found
from fastckpt.formats.reader import TensorFile, detect_format, open_file
from fastckpt.store.commit import resolve_overwrite

__all__ = ["is_url", "filesystem", "join", "put_file", "put_directory", "clear", "get_directory", "committed",
           "committed_prefixes", "remove_uncommitted", "save_file", "local_copy", "open", "RemoteTensorFile"]

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
# fsspec's chained URLs: "simplecache::s3://bucket/key", "zip://inner::s3://bucket/archive.zip".
_CHAINED = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*(::|://)")
# Stores on which one upload of an object is atomic (the object appears whole when it completes) and a rename
# would be a copy: files go straight to their final key there.
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2", "wasb", "wasbs"})
# Reads are split into ranges of this size and fetched in parallel; at most _BATCH bytes are held at once.
_RANGE = 16 << 20
_BATCH = 256 << 20
_HEAD = 64 << 10


def is_url(path) -> bool:
    """True when ``path`` is a URL for fsspec (``scheme://...``, any scheme but ``file``), not a local path.

    fsspec's chained URLs (``simplecache::s3://bucket/key``) are URLs too.

    >>> is_url("s3://bucket/model.safetensors"), is_url("memory://x"), is_url("file:///tmp/x"), is_url("/tmp/x")
    (True, True, False, False)
    >>> is_url("simplecache::memory://x"), is_url("./a::b")
    (True, False)
    """
    if not isinstance(path, str):
        return False
    if "::" in path and _CHAINED.match(path) and "://" in path:
        return True
    m = _URL.match(path)
    return m is not None and m.group(1).lower() != "file"


def filesystem(url: str, storage_options: dict | None = None):
    """``(fs, path)`` for ``url``: its fsspec filesystem (made with ``storage_options``) and the path in it.

    >>> fs, path = filesystem("memory://doc/a.bin")
    >>> type(fs).__name__, path
    ('MemoryFileSystem', '/doc/a.bin')
    """
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise ImportError(f"{url}: URLs need fsspec (and s3fs for s3://): pip install 'fastckpt[s3]'") from None
    try:
        return url_to_fs(url, **(storage_options or {}))
    except ImportError as e:
        raise ImportError(f"{url}: no fsspec filesystem for this scheme is installed ({e}); for s3:// "
                          "pip install 'fastckpt[s3]'") from e
    except ValueError as e:
        if "Protocol not known" not in str(e):
            raise
        raise ValueError(f"{url}: no fsspec filesystem for this scheme ({e}); fsspec knows s3://, gs://, "
                         "memory:// and many more, each with its package installed (for s3://: pip install "
                         "'fastckpt[s3]')") from e


def join(url: str, *parts: str) -> str:
    """``url`` with ``parts`` appended, ``/``-separated.

    >>> join("s3://bucket/run/", "step-10", "manifest.json")
    's3://bucket/run/step-10/manifest.json'
    """
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts)])


def _is_object_store(fs) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in _OBJECT_STORES for p in protocols)


def _upload_failed(url: str, what: str, exc: BaseException, left: str) -> OSError:
    return OSError(f"{url}: upload of {what} failed: {type(exc).__name__}: {exc}. {left}; save again")


# -- writes ----------------------------------------------------------------------------------------

def _conditional(fs) -> bool:
    """True where an upload can refuse an existing key in the same step (s3fs: ``If-None-Match: *``)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in ("s3", "s3a") for p in protocols)


def _put_whole(fs, local: str, path: str, overwrite: bool = True) -> None:
    """Upload ``local`` to ``path`` so that it appears whole: one upload on an object store, else a temporary key
    and a move (a store that renames would otherwise show a half-written object). Without ``overwrite`` an
    existing key is ``FileExistsError``: refused by the store itself where it can (:func:`_conditional`), else
    checked just before the last step."""
    if _is_object_store(fs):
        if overwrite:
            fs.put_file(local, path)
        elif _conditional(fs):
            fs.put_file(local, path, mode="create")
        else:
            if fs.exists(path):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
            fs.put_file(local, path)
        return
    staged = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        fs.put_file(local, staged)
        if not overwrite and fs.exists(path):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
        fs.mv(staged, path)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm(staged)
        raise


def _checkpoint_file(rel: str) -> bool:
    """True for a key (relative to a checkpoint's prefix) that a fastckpt checkpoint writes: a ``.safetensors`` or
    ``.json`` file at its top level. Replacing or cleaning a prefix removes these and nothing else."""
    return "/" not in rel and rel.endswith((".safetensors", ".json"))


def put_file(local: str | os.PathLike, url: str, storage_options: dict | None = None, *,
             overwrite: bool | None = True) -> None:
    """Upload the local file ``local`` to ``url`` so that readers see the old object or the new one whole.

    One upload to the final key on an object store (atomic there), else to ``<key>.tmp-<uuid>`` and a move.
    ``overwrite=False``: an existing object is :class:`FileExistsError` naming ``url`` (on ``s3://`` a
    conditional write, refused by the store in the same step; elsewhere a check just before the last step, so a
    writer racing for the key between the two is replaced). ``overwrite=None`` (0.2's default): as False, and an
    existing object is then replaced with a ``FutureWarning`` (docs/overwrite.md).

    >>> import os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "a.bin"); _ = builtins.open(p, "wb").write(b"bytes")
    >>> put_file(p, "memory://doc/put/a.bin")
    >>> filesystem("memory://doc/put/a.bin")[0].cat("memory://doc/put/a.bin")
    b'bytes'
    >>> put_file(p, "memory://doc/put/a.bin", overwrite=False)
    Traceback (most recent call last):
    FileExistsError: [Errno 17] File exists; pass overwrite=True to replace it: 'memory://doc/put/a.bin'
    """
    fs, path = filesystem(url, storage_options)
    try:
        try:
            _put_whole(fs, os.fspath(local), path, overwrite is True)
        except FileExistsError:
            if overwrite is not None:
                raise
            resolve_overwrite(None, url, True, stacklevel=5)  # the FutureWarning; 0.2 replaced it
            _put_whole(fs, os.fspath(local), path, True)
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, f"{os.strerror(errno.EEXIST)}; pass overwrite=True to replace it",
                              url) from None
    except Exception as e:
        raise _upload_failed(url, f"{os.path.getsize(local)} bytes", e,
                             "Readers still see the previous object there, if there was one") from e
    fs.invalidate_cache(path)


def save_file(url: str, write: Callable[[str], None], name: str, storage_options: dict | None = None, *,
              overwrite: bool | None = True) -> None:
    """Have ``write(local_path)`` write a file with one of the local writers, then :func:`put_file` it to ``url``
    (``overwrite`` as there).

    ``name`` is the local file's name (some writers look at the suffix). The local copy is removed after.

    >>> import numpy as np
    >>> from fastckpt.formats.npz import save_npz
    >>> save_file("memory://doc/s.npz", lambda p: save_npz(p, {"x": np.zeros(1)}, fsync=False), "s.npz")
    >>> filesystem("memory://doc/s.npz")[0].cat("memory://doc/s.npz")[:4]
    b'PK\\x03\\x04'
    """
    with tempfile.TemporaryDirectory(prefix="fastckpt-up-") as tmp:
        local = os.path.join(tmp, name)
        write(local)
        put_file(local, url, storage_options, overwrite=overwrite)


def _files_under(directory: str) -> list[str]:
    """Every file below ``directory``, as ``/``-separated paths relative to it, sorted."""
    found = []
    for root, _, files in os.walk(directory):
        for f in files:
            found.append(os.path.relpath(os.path.join(root, f), directory).replace(os.sep, "/"))
    return sorted(found)


def committed(url: str, marker: str = "manifest.json", storage_options: dict | None = None) -> bool:
    """True when the checkpoint prefix ``url`` holds its commit marker (its manifest).

    >>> committed("memory://doc/nothing-here")
    False
    """
    fs, path = filesystem(url, storage_options)
    fs.invalidate_cache(path)
    return fs.isfile(f"{path.rstrip('/')}/{marker}")


def put_directory(local: str | os.PathLike, url: str, marker: str = "manifest.json",
                  storage_options: dict | None = None, *, files: Iterable[str] | None = None,
                  replace: bool = True, commit: bool = True) -> None:
    """Upload the checkpoint directory ``local`` to the prefix ``url``: its files in parallel, ``marker`` last.

    With ``replace`` (the default) whatever is at ``url`` goes first (:func:`clear`: a committed checkpoint
    is uncommitted, its marker deleted, then emptied). ``files`` (relative paths) limits the upload to those
    (a rank of a sharded save uploads its own, with ``replace=False``); ``commit=False`` leaves ``marker`` out
    (another rank commits). Any failure raises an ``OSError`` naming ``url``, and leaves the prefix
    uncommitted.

    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> for name in ("data.bin", "manifest.json"):
    ...     _ = builtins.open(os.path.join(d, name), "wb").write(name.encode())
    >>> put_directory(d, "memory://doc/ckpt")
    >>> committed("memory://doc/ckpt"), sorted(filesystem("memory://doc/ckpt")[0].ls("/doc/ckpt", detail=False))
    (True, ['/doc/ckpt/data.bin', '/doc/ckpt/manifest.json'])
    """
    fs, path = filesystem(url, storage_options)
    path = path.rstrip("/")
    local = os.fspath(local)
    names = _files_under(local) if files is None else sorted(files)
    data = [n for n in names if n != marker]
    if replace:
        _uncommit(fs, path, marker, url)  # FileExistsError for a prefix that holds something else
    try:
        if data:
            fs.put([os.path.join(local, n) for n in data], [f"{path}/{n}" for n in data])
        if commit:
            fs.invalidate_cache(path)
            present = {k.strip("/")[len(path.strip("/")) + 1:] for k in fs.find(path, withdirs=False)}
            lost = sorted(set(data) - present)
            if lost:  # another writer removed them meanwhile: never commit a checkpoint without its files
                raise FileNotFoundError(f"{len(lost)} uploaded files are gone from the prefix: {lost[:4]}")
            _put_whole(fs, os.path.join(local, marker), f"{path}/{marker}")
    except Exception as e:
        total = sum(os.path.getsize(os.path.join(local, n)) for n in names)
        raise _upload_failed(url, f"{len(names)} files ({total} bytes)", e,
                             f"The prefix holds no {marker}: uncommitted, so no reader takes it (a manager's "
                             "latest() is still its previous checkpoint; a checkpoint that was at this URL itself "
                             "was removed by this overwrite) and the next save removes it") from e
    finally:
        fs.invalidate_cache(path)


def clear(url: str, marker: str = "manifest.json", storage_options: dict | None = None) -> None:
    """Remove the checkpoint at the prefix ``url``: its ``marker`` first (so no reader takes a half-deleted
    checkpoint), then its files (``.safetensors`` and ``.json`` at the top level), nothing else. A prefix that
    holds other objects and no ``marker`` is not a checkpoint: ``FileExistsError``, and nothing is removed.

    >>> fs, _ = filesystem("memory://doc/old")
    >>> fs.pipe({"/doc/old/manifest.json": b"{}", "/doc/old/a.safetensors": b"a", "/doc/old/notes.txt": b"n"})
    >>> clear("memory://doc/old"); fs.exists("/doc/old/a.safetensors"), fs.exists("/doc/old/notes.txt")
    (False, True)
    >>> clear("memory://doc/old")
    Traceback (most recent call last):
    ...
    FileExistsError: memory://doc/old: holds 1 objects but no manifest.json (not a fastckpt checkpoint, e.g. ['notes.txt']); refusing to replace it: save to a prefix of its own
    """
    fs, path = filesystem(url, storage_options)
    _uncommit(fs, path.rstrip("/"), marker, url)


def _keys_under(fs, path: str) -> list[str]:
    """The keys below ``path``, relative to it."""
    fs.invalidate_cache(path)
    try:
        keys = fs.find(path, withdirs=False)
    except FileNotFoundError:
        return []
    base = path.strip("/") + "/"
    return sorted(k.strip("/")[len(base):] for k in keys if k.strip("/").startswith(base))


def _uncommit(fs, path: str, marker: str, url: str) -> None:
    """Make ``path`` ready for a new checkpoint: its marker removed first (no reader takes the old one from then
    on), then the checkpoint files under it (:func:`_checkpoint_file`), nothing else.

    A prefix that holds objects but no ``marker`` is refused unless they are all checkpoint files (a save that
    did not commit): a URL given by mistake (a run's root, a dataset) must never be emptied."""
    keys = _keys_under(fs, path)
    if marker not in keys and any(not _checkpoint_file(k) for k in keys):
        others = [k for k in keys if not _checkpoint_file(k)]
        raise FileExistsError(f"{url}: holds {len(keys)} objects but no {marker} (not a fastckpt checkpoint, e.g. "
                              f"{others[:3]}); refusing to replace it: save to a prefix of its own")
    if marker in keys:
        fs.rm_file(f"{path}/{marker}")  # from here on no reader takes the old checkpoint
    doomed = [f"{path}/{k}" for k in keys if k != marker and _checkpoint_file(k)]
    if doomed:
        fs.rm(doomed)
    fs.invalidate_cache(path)


def remove_uncommitted(url: str, marker: str = "manifest.json", storage_options: dict | None = None, *,
                       select: Callable[[str], bool] = lambda name: True) -> list[str]:
    """Remove every prefix directly under ``url`` that has checkpoint files but no ``marker``: saves that never
    committed. A prefix holding anything else is left alone.

    Returns the URLs removed; only prefixes whose name ``select`` accepts are considered (the manager passes
    its ``step-<N>`` names, so nothing else under the URL is touched). Only one writer may save under ``url``
    at a time (another writer's save in progress is uncommitted too).

    >>> fs, _ = filesystem("memory://doc/run")
    >>> fs.pipe({"/doc/run/step-1/manifest.json": b"{}", "/doc/run/step-2/weights.safetensors": b"half",
    ...          "/doc/run/step-3/notes.txt": b"mine"})
    >>> remove_uncommitted("memory://doc/run")
    ['memory://doc/run/step-2']
    """
    fs, path = filesystem(url, storage_options)
    path = path.rstrip("/")
    removed = []
    for name, is_committed in _prefixes(fs, path, marker).items():
        if not is_committed and select(name):
            keys = _keys_under(fs, f"{path}/{name}")
            if keys and all(_checkpoint_file(k) for k in keys):  # a save that did not commit; nothing else
                fs.rm([f"{path}/{name}/{k}" for k in keys])
                removed.append(join(url, name))
    fs.invalidate_cache(path)
    return removed


def _prefixes(fs, path: str, marker: str) -> dict[str, bool]:
    """name -> committed, for every prefix directly under ``path`` (one recursive listing)."""
    fs.invalidate_cache(path)
    try:
        keys = fs.find(path, withdirs=False)
    except FileNotFoundError:
        return {}
    found: dict[str, bool] = {}
    base = path.strip("/") + "/"
    for key in keys:
        rel = key.strip("/")[len(base):]
        if "/" not in rel:
            continue  # a file directly under the root is no checkpoint
        name, _, rest = rel.partition("/")
        found[name] = found.get(name, False) or rest == marker
    return found


def committed_prefixes(url: str, marker: str = "manifest.json", storage_options: dict | None = None) -> list[str]:
    """The names of the committed prefixes directly under ``url`` (those holding ``marker``), sorted.

    >>> fs, _ = filesystem("memory://doc/run2")
    >>> fs.pipe({"/doc/run2/step-1/manifest.json": b"{}", "/doc/run2/step-2/data.bin": b"half"})
    >>> committed_prefixes("memory://doc/run2")
    ['step-1']
    """
    fs, path = filesystem(url, storage_options)
    return sorted(name for name, ok in _prefixes(fs, path.rstrip("/"), marker).items() if ok)


# -- reads -----------------------------------------------------------------------------------------

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
        if any(part in ("", ".", "..") for part in rel.split("/")):
            raise FormatError(f"{url}: the object key {key!r} is not a plain relative name (an empty, '.' or '..' "
                              "part): refusing to download it outside the local copy")
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
        fmt = detect_format(head[:9])
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
