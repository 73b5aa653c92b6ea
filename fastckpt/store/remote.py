"""Object storage and remote filesystems, the write side: uploads and the commit of a prefix.

``s3://``, ``gs://``, ``memory://`` and every other fsspec URL (:func:`is_url`); the filesystem comes from
``fsspec.core.url_to_fs(url, **storage_options)`` (:func:`filesystem`). The local writers build a file's or a
checkpoint's bytes on this machine (through :mod:`fastckpt.store.commit`); this module moves them, and is the
one commit of object storage (docs/commit.md). Reading (downloads, ranged reads of tensor files) is
:mod:`fastckpt.formats.remote`, which re-exports every name here.

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

>>> is_url("s3://bucket/model.safetensors"), is_url("/data/model.safetensors")
(True, False)
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import tempfile
import uuid
from typing import Callable, Iterable

from fastckpt.store.commit import overwrite_flag

__all__ = ["is_url", "filesystem", "join", "put_file", "save_file", "put_directory", "clear", "committed",
           "committed_prefixes", "remove_uncommitted"]

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
# fsspec's chained URLs: "simplecache::s3://bucket/key", "zip://inner::s3://bucket/archive.zip".
_CHAINED = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*(::|://)")
# Stores on which one upload of an object is atomic (the object appears whole when it completes) and a rename
# would be a copy: files go straight to their final key there.
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2", "wasb", "wasbs"})


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

    An ``s3://`` filesystem signs with SigV4 unless ``config_kwargs`` names a ``signature_version``: botocore
    signs S3 requests with SigV4 already, but presigns them with SigV2 where none is named, which buckets made since
    2020 refuse (reads of an object are presigned once and sent as plain GETs, ``formats.stream``).

    >>> fs, path = filesystem("memory://doc/a.bin")
    >>> type(fs).__name__, path
    ('MemoryFileSystem', '/doc/a.bin')
    """
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise ImportError(f"{url}: URLs need fsspec (and s3fs for s3://): pip install 'fastckpt[s3]'") from None
    options = dict(storage_options or {})
    if url.startswith(("s3://", "s3a://")):
        options["config_kwargs"] = {"signature_version": "s3v4", **(options.get("config_kwargs") or {})}
    try:
        return url_to_fs(url, **options)
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
             overwrite: bool = False) -> None:
    """Upload the local file ``local`` to ``url`` so that readers see the old object or the new one whole.

    One upload to the final key on an object store (atomic there), else to ``<key>.tmp-<uuid>`` and a move.
    ``overwrite=False``: an existing object is :class:`FileExistsError` naming ``url`` (on ``s3://`` a
    conditional write, refused by the store in the same step; elsewhere a check just before the last step, so a
    writer racing for the key between the two is replaced); docs/overwrite.md.

    >>> import builtins, os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "a.bin"); _ = builtins.open(p, "wb").write(b"bytes")
    >>> put_file(p, "memory://doc/put/a.bin", overwrite=True)
    >>> filesystem("memory://doc/put/a.bin")[0].cat("memory://doc/put/a.bin")
    b'bytes'
    >>> put_file(p, "memory://doc/put/a.bin", overwrite=False)
    Traceback (most recent call last):
    FileExistsError: [Errno 17] File exists; pass overwrite=True to replace it: 'memory://doc/put/a.bin'
    """
    overwrite = overwrite_flag(overwrite)
    fs, path = filesystem(url, storage_options)
    try:
        _put_whole(fs, os.fspath(local), path, overwrite)
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, f"{os.strerror(errno.EEXIST)}; pass overwrite=True to replace it",
                              url) from None
    except Exception as e:
        raise _upload_failed(url, f"{os.path.getsize(local)} bytes", e,
                             "Readers still see the previous object there, if there was one") from e
    fs.invalidate_cache(path)


def save_file(url: str, write: Callable[[str], None], name: str, storage_options: dict | None = None, *,
              overwrite: bool = False) -> None:
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

    >>> import builtins, os, tempfile
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
