"""``CheckpointReader``: the tensors of a sharded checkpoint, whole or by part, without loading the rest.

Two views of one directory (layout: :mod:`fastckpt.sharded.format`):

* RecIS's: :meth:`CheckpointReader.tensor_names` lists the original names
  (``"w"``, ``"emb.id"``, ``"emb.embedding"``, ``"emb.m"``);
  :meth:`~CheckpointReader.read_tensor` returns a whole tensor (the parts
  joined in rank order) or, given a stored key (``"w/part_0_2"``), one part;
  :meth:`~CheckpointReader.tensor_shape` and
  :meth:`~CheckpointReader.tensor_dtype` answer for both without reading data.
* fastckpt's reader contract (:class:`~fastckpt.formats.contract.TensorReader`):
  ``keys()`` and ``infos`` are the whole tensors by their original names,
  ``host(name)`` a whole tensor (a zero-copy view of its mapped file where one
  part holds it all, else its parts joined), so ``fastckpt.open(directory)``
  and ``load_file`` work on it; the parts are there on request: ``infos``,
  ``info`` and ``host`` also take a stored key (``"w/part_0_2"``), and
  :attr:`~CheckpointReader.part_infos` lists them.

Opening reads and checks the metadata files alone. A tensor file is pinned,
mapped, its header parsed and checked against the metadata the first time
one of its parts is used (:class:`TensorFiles`), so a rank maps only the
files it reads; a part's bytes are read only when touched.

>>> import numpy as np, tempfile, os
>>> from fastckpt.sharded import Saver
>>> out = os.path.join(tempfile.mkdtemp(), "c")
>>> _ = Saver(path=out, parallel=2, tensors={"w": np.arange(6.0).reshape(3, 2)}).save()
>>> r = CheckpointReader(out)
>>> r.tensor_names(), r.tensor_shape("w"), r.read_tensor("w/part_0_1")[2].tolist()
(['w'], (3, 2), [4.0, 5.0])
>>> list(r.keys()), r["w"].shape, list(r.part_infos)
(['w'], (3, 2), ['w/part_0_1'])
"""

from __future__ import annotations

import contextlib
import difflib
import os
import threading
import weakref
from types import MappingProxyType
from typing import Callable, Iterator, Mapping

import numpy as np

from fastckpt.errors import CheckpointChangedError, ChecksumMismatchError, FormatError, TensorNotFoundError
from fastckpt.formats.contract import MultiFileReader
from fastckpt.formats.hashing import blake3_mapped
from fastckpt.formats.reader import TensorFile, guard_mappings, open_file
from fastckpt.info import TensorInfo
from fastckpt.progress import progress_from
from fastckpt.sharded.flights import Flights
from fastckpt.sharded.format import DESCRIPTION_FILE, FORMAT, INDEX_FILE, dtype_of, read_metadata
from fastckpt.sharded.format import MANIFEST_FILE as FORMAT_MANIFEST
from fastckpt.store.snapshot import Snapshot

__all__ = ["CheckpointReader", "CheckpointChangedError", "TensorFiles", "hash_ahead", "register_layout",
           "shared_reader"]

_LAYOUTS: list[tuple[Callable[[str | os.PathLike], bool], type]] = []


def register_layout(detect: Callable[[str | os.PathLike], bool], reader_class: type) -> None:
    """Have ``CheckpointReader(path)`` make a ``reader_class`` (a subclass) where ``detect(path)`` is true: a
    directory of another layout read through the same interface. :mod:`fastckpt.sharded.recis` registers
    RecIS's layout when it is imported (``import fastckpt.sharded`` imports it).

    >>> from fastckpt.sharded.recis import RecisCheckpointReader
    >>> any(cls is RecisCheckpointReader for _, cls in _LAYOUTS)
    True
    """
    if not (isinstance(reader_class, type) and issubclass(reader_class, CheckpointReader)):
        raise TypeError(f"reader_class must be a subclass of CheckpointReader, got {reader_class!r}")
    _LAYOUTS.append((detect, reader_class))

# Files hashed in this process, by what fstat said of them when opened (device, inode, size, mtime, ctime), while a
# reader holds them open: the ranks of a load that run as threads of one process (resharding, benchmarks) each read
# every file's ids, and hash each file once between them (a rank that asks while another hashes it waits for that
# result). The key goes when the last reader holding the file closes, so a later open hashes the file again.
_digests = Flights()

# The checkpoints that loads of this process hold open now, by the key each load gives (fastckpt's layout: the real
# path; RecIS's: the real path and whether its reader verifies): one reader between them (shared_reader).
_open_readers = Flights()


@contextlib.contextmanager
def shared_reader(key, open_reader: Callable[[], "CheckpointReader"],
                  current: Callable[["CheckpointReader"], bool]) -> Iterator["CheckpointReader"]:
    """The reader that another load of this process holds open under ``key`` now, where ``current(reader)`` says
    it is of the commit this load reads (ranks run as threads, a reshard's, open the metadata, the files and
    their headers once between them), else a new one, ``open_reader()``; the last load to let go of it closes it.

    A reader of another commit (the directory replaced since it was opened), or a shared open that failed, gives
    this load a reader of its own, which opens what the directory holds now or says why it cannot.

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.sharded import Saver
    >>> out = Saver(path=os.path.join(tempfile.mkdtemp(), "c"), parallel=1, tensors={"w": np.ones(2)}).save()
    >>> opening = lambda: CheckpointReader(out, verify=False)
    >>> with shared_reader(out, opening, lambda r: True) as a, shared_reader(out, opening, lambda r: True) as b:
    ...     a is b
    True
    """
    flight, future, mine = _open_readers.join(key)
    reader = None
    try:
        if mine:
            try:
                reader = open_reader()
            except BaseException as exc:
                _open_readers.fail(flight, future, exc)
                raise
            future.set_result(reader)
        else:
            try:
                reader = future.result()
            except Exception:  # noqa: BLE001 - the opener raised its error; this load opens its own below
                reader = None
        if reader is None or not current(reader):
            with open_reader() as own:
                yield own
        else:
            yield reader
    finally:
        _open_readers.leave(key, flight)
        if flight.holders == 0 and flight.future is not None and flight.future.done() \
                and flight.future.exception() is None:
            flight.future.result().close()  # every holder has let go (closing twice is harmless)


def hash_ahead(path: str, submit: Callable | None = None, holders: int = 1) -> list[Callable[[], None]]:
    """Hash tensor file ``path`` for the readers of this process that open it before the returned function is
    called, or the last of ``holders`` such functions (each reader's :meth:`CheckpointReader.file_problem` takes
    the result instead of hashing it again; one
    asking while it runs waits for it); ``submit(fn)`` runs the hashing elsewhere (a worker's ``submit``, which
    returns a Future), by default here and now. The file is held from this call on, so a reader that comes
    before the worker does hashes it for both. Keyed by the file's identity as opened here: a file changed,
    replaced or linked since (a link changes its ctime) is hashed again by its reader; a failure here is left to
    the readers, which hash it themselves (one already waiting gets the error). The returned function waits for
    the hashing and lets go. A load fetching files whole from a URL (:mod:`fastckpt.sharded.remote`) hashes each
    one as soon as it is in place, beside the other ranks' fetches.

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.sharded import Saver
    >>> out = Saver(path=os.path.join(tempfile.mkdtemp(), "c"), parallel=1, tensors={"w": np.ones(2)}).save()
    >>> [release] = hash_ahead(os.path.join(out, "model-00000-000.safetensors"))
    >>> CheckpointReader(out).file_problem("model-00000-000.safetensors") is None
    True
    >>> release()
    """
    from fastckpt._native.mapped import MappedFile

    mapped = MappedFile(path)
    identity = mapped.identity
    _digests.hold(identity, holders)

    def work() -> None:
        try:
            _digests.once(identity, lambda: blake3_mapped(mapped, drop=True))
        except Exception:  # noqa: BLE001, S110 - the readers hash it themselves and report what is wrong
            pass
        finally:
            mapped.close()

    future = None
    try:
        if submit is None:
            work()
        else:
            future = submit(work)
    except BaseException:
        _digests.release(identity, holders)
        mapped.close()
        raise

    def release() -> None:
        if future is not None:
            future.result()
        _digests.release(identity)

    return [release] * holders


def map_pinned(snapshot: Snapshot, name: str, options: dict) -> TensorFile:
    """File ``name`` of ``snapshot``'s directory mapped and its header parsed (``options``: :func:`~fastckpt.formats.
    reader.open_file`'s), checked to be the file the snapshot pinned: one of another commit (the path now names a
    replacement) raises :class:`CheckpointChangedError`; a missing one what :meth:`Snapshot.missing` says.

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.sharded import Saver
    >>> out = Saver(path=os.path.join(tempfile.mkdtemp(), "c"), parallel=1, tensors={"w": np.ones(2)}).save()
    >>> with Snapshot(out) as snap:
    ...     _ = snap.pin("model-00000-000.safetensors")
    ...     list(map_pinned(snap, "model-00000-000.safetensors", {}).infos)
    ['w/part_0_1']
    """
    try:
        f = open_file(os.path.join(snapshot.path, name), **options)
    except FileNotFoundError:
        raise snapshot.missing(name) from None
    try:
        snapshot.check(name, f.mapped.identity)
    except BaseException:
        f.close()
        raise
    return f


def _release(identities: list[tuple]) -> None:
    for identity in identities:
        _digests.release(identity)


class _Listed(Mapping):
    """A mapping whose keys are those of its dict ``_keys``, in that order: listing them, counting them or asking
    whether one is there touches no value (opens no file)."""

    _keys: dict

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key) -> bool:
        return key in self._keys


class TensorFiles(_Listed):
    """A sharded reader's tensor files by name (every file the index numbers, in file-number order), each opened
    the first time it is asked for: pinned in the reader's snapshot (the size the manifest lists), mapped, and
    its safetensors header checked against the metadata (the keys the index places in it, each key's shape and
    dtype as its description gives them). A rank thus maps and parses only the files it reads, every check made
    before a byte of the file is used. A file that fails a check is not kept: asking again raises the same error.
    Thread-safe; :meth:`opened` lists the files mapped so far.

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.sharded import Saver
    >>> out = Saver(path=os.path.join(tempfile.mkdtemp(), "c"), shard_num=1, parallel=2,
    ...             tensors={"w": np.ones(2)}).save()
    >>> r = CheckpointReader(out)
    >>> list(r.files), list(r.files.opened())
    (['model-00000-000.safetensors', 'model-00000-001.safetensors'], [])
    >>> r.read_tensor("w").tolist(), list(r.files.opened())
    ([1.0, 1.0], ['model-00000-000.safetensors'])
    """

    def __init__(self, reader: "CheckpointReader", names: list[str], keys_of: dict[str, list[str]]):
        # What opening a file takes from the reader, not the reader itself: the mapping outlives no reader
        # it is not handed, and makes no reference cycle with it.
        self.path = reader.path
        self._options = reader._options
        self._snapshot = reader.snapshot
        self._listed = (reader.manifest or {}).get("files", {})  # sizes; a directory without a manifest has none
        self._descriptions = reader.descriptions
        self._keys = dict.fromkeys(names)
        self._keys_of = keys_of
        self._opened: dict[str, TensorFile] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._held: list[tuple] = []
        # Let go of the shared hashes on close(), or when a mapping never closed is collected.
        self._release = weakref.finalize(self, _release, self._held)

    def __getitem__(self, name: str) -> TensorFile:
        f = self._opened.get(name)
        if f is not None:
            return f
        if name not in self._keys:
            raise KeyError(name)
        with self._lock:
            f = self._opened.get(name)
            if f is None:
                if self._closed:
                    raise ValueError(f"{self.path}: the reader is closed")
                f = self._opened[name] = self._open(name)
        return f

    def _open(self, name: str) -> TensorFile:
        self._snapshot.pin(name, size=self._listed[name]["size"] if name in self._listed else None)
        f = map_pinned(self._snapshot, name, self._options)
        try:
            self.check(f, self._keys_of.get(name, ()))
            _digests.hold(f.mapped.identity)
        except BaseException:
            f.close()
            raise
        self._held.append(f.mapped.identity)
        return f

    def check(self, f: TensorFile, expected) -> None:
        """Raise a :class:`~fastckpt.errors.FormatError` naming file ``f`` and the tensor where its header
        disagrees with the metadata: it must hold the keys ``expected`` (those the index places in it), each of
        the shape and dtype its description gives. Run once per opening, before the file is kept; a layout with
        metadata of its own overrides it (:class:`fastckpt.sharded.recis.RecisTensorFiles`).

        >>> import numpy as np, tempfile, os
        >>> from fastckpt.sharded import Saver
        >>> out = Saver(path=os.path.join(tempfile.mkdtemp(), "c"), parallel=1, tensors={"w": np.ones(2)}).save()
        >>> r = CheckpointReader(out); f = r.files["model-00000-000.safetensors"]
        >>> r.files.check(f, ["w/part_0_1"])
        >>> r.files.check(f, [])
        Traceback (most recent call last):
        fastckpt.errors.FormatError: ...: holds tensors ['w/part_0_1'] that index.json does not place there ...
        """
        if set(f.infos) != set(expected):
            raise FormatError(f"{f.path}: holds tensors {sorted(set(f.infos) ^ set(expected))[:4]} that "
                              f"{INDEX_FILE} does not place there (or misses ones it does)")
        for key, info in f.infos.items():
            d = self._descriptions[key]
            if info.shape != tuple(d["shape"]) or info.dtype != dtype_of(d["dtype"], f"{self.path}: {key}"):
                raise FormatError(f"{f.path}: tensor {key!r} is {info.dtype}{list(info.shape)} in the "
                                  f"safetensors header, {DESCRIPTION_FILE} says {d['dtype']}{d['shape']}")

    def opened(self) -> dict[str, TensorFile]:
        """``{name: file}`` of the files mapped so far, in the order they were mapped."""
        return dict(self._opened)

    def close(self) -> None:
        """Close the files mapped so far and let go of their shared hashes; later lookups raise ``ValueError``."""
        with self._lock:
            self._closed = True
            opened = list(self._opened.values())
        for f in opened:
            f.close()
        self._release()


class PartInfos(_Listed):
    """A sharded reader's ``part_infos``: stored key -> its part's :class:`~fastckpt.TensorInfo`, as its file's
    header gives it (looking one up opens that file, :class:`TensorFiles`). Listing the keys or asking whether
    one is there opens nothing.

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.sharded import Saver
    >>> out = Saver(path=os.path.join(tempfile.mkdtemp(), "c"), parallel=1, tensors={"w": np.ones(2)}).save()
    >>> r = CheckpointReader(out)
    >>> list(r.part_infos), "w/part_0_1" in r.part_infos, len(r.files.opened())
    (['w/part_0_1'], True, 0)
    >>> r.part_infos["w/part_0_1"].shape, len(r.files.opened())
    ((2,), 1)
    """

    def __init__(self, files: TensorFiles, file_of_key: dict[str, str]):
        self._files = files
        self._keys = file_of_key

    def __getitem__(self, key: str) -> TensorInfo:
        return self._files[self._keys[key]].infos[key]


class TensorInfos(Mapping):
    """A sharded reader's ``infos``: the whole tensors by their original names (in :meth:`~CheckpointReader.
    tensor_names` order), each a :class:`~fastckpt.TensorInfo` of the whole tensor (its ``offset`` is its first
    part's, in that part's file; ``compression`` the codec of an encoded part, else None). A stored key
    (``"w/part_0_2"``) is looked up too, as its part's info, though the mapping lists whole tensors only.

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.sharded import Saver
    >>> out = Saver(path=os.path.join(tempfile.mkdtemp(), "c"), shard_num=1, parallel=1,
    ...             tensors={"w": np.ones((2, 3))}).save()
    >>> infos = CheckpointReader(out).infos
    >>> list(infos), infos["w"].shape, infos["w/part_0_1"].name
    (['w'], (2, 3), 'w/part_0_1')
    """

    def __init__(self, reader: "CheckpointReader"):
        self._reader = reader
        self._names = reader.tensor_names()
        self._made: dict[str, TensorInfo] = {}

    def __getitem__(self, name: str) -> TensorInfo:
        reader = self._reader
        if name in reader.part_infos:
            return reader.part_infos[name]
        whole = reader._whole_name(name)  # an alias, or an error naming the close matches (a KeyError)
        info = self._made.get(whole)
        if info is None:
            keys = reader.part_names(whole)
            first = reader.part_infos[keys[0]]
            encodings = [reader.descriptions[k]["encoding"] for k in keys
                         if "encoding" in (reader.descriptions.get(k) or {})]
            dtype, shape = reader.tensor_dtype(whole), tuple(reader.tensor_shape(whole))
            info = self._made[whole] = TensorInfo(whole, dtype, shape, first.offset,
                                                  int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
                                                  compression=(encodings[0].get("codec") or "encoded")
                                                  if encodings else None)
        return info

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class CheckpointReader(MultiFileReader):
    """Read a sharded checkpoint directory (see the module docs).

    Opening reads and checks the metadata files; each tensor file is opened
    the first time one of its parts is used (:attr:`files`, a
    :class:`TensorFiles`), from the one directory whose manifest the reader
    read, and checked before any of its bytes is used: a file that is not the
    one the manifest lists (another size, or the directory was replaced by a
    save with ``overwrite=True`` and removed meanwhile) raises
    :class:`CheckpointChangedError`, a header that disagrees with the metadata
    a :class:`~fastckpt.errors.FormatError` naming the file and the tensor,
    every time the file is asked for. ``verify=True`` (the
    default) checks each tensor file's BLAKE3 hash against the manifest the
    first time a part of it is read (once per reader; :meth:`verify` checks
    every file at once); ``verify=False`` skips it. The metadata files are
    always checked.

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.sharded import Saver
    >>> out = os.path.join(tempfile.mkdtemp(), "c")
    >>> _ = Saver(path=out, parallel=1, tensors={"w": np.arange(3.0)}).save()
    >>> with CheckpointReader(out) as r:
    ...     r.read_tensor("w").tolist(), r.verified_files()
    ([0.0, 1.0, 2.0], ['model-00000-000.safetensors'])
    """

    format = FORMAT
    layout = "fastckpt"

    def __new__(cls, path=None, *args, **kwargs):
        # A directory of another layout is read by the subclass registered for it (register_layout): RecIS's
        # own (an ``index`` file) by fastckpt.sharded.recis, which sits above this module.
        if cls is CheckpointReader and path is not None:
            for detect, reader_class in _LAYOUTS:
                if detect(path):
                    return super().__new__(reader_class)
        return super().__new__(cls)

    def __init__(self, path: str | os.PathLike, *, verify: bool = True, backend: str = "mmap",
                 copy_on_write: bool = False, max_header_size: int | None = None):
        self.path = os.fspath(path)
        self.files: dict[str, TensorFile] = {}
        self._closed = False
        # One commit: the manifest and every file read through the pinned directory, each file's identity recorded.
        self.snapshot = Snapshot(self.path, record=FORMAT_MANIFEST, what="sharded checkpoint")
        try:
            self._open(backend, copy_on_write)
        except BaseException:
            self.close()
            raise
        self.metadata = None
        self._verify = bool(verify)
        self._verified: set[str] = set()
        self._verify_lock = threading.Lock()

    def _open(self, backend: str, copy_on_write: bool) -> None:
        """Read and cross-check the metadata through the pinned directory. The tensor files are pinned, mapped and
        their headers checked against it on first use (:class:`TensorFiles`), each before a byte of it is used."""
        meta = read_metadata(self.path, snapshot=self.snapshot)
        self.manifest = meta["manifest"]
        self.manifest_blake3: str = meta["manifest_blake3"]
        self.unchecked: list[str] = meta["unchecked"]
        self.descriptions: Mapping[str, dict] = MappingProxyType(meta["descriptions"])
        self.tensorkey: Mapping[str, str] = MappingProxyType(meta["tensorkey"])
        self._block_index = meta["index"]["block_index"]
        self._file_of_number = meta["index"]["files"]
        self._options = {"backend": backend, "copy_on_write": copy_on_write}
        # Whole tensors: original name -> stored keys in part order (read_metadata checked the parts are 0..n-1).
        parts: dict[str, list[tuple[int, str]]] = {}
        for key, name in self.tensorkey.items():
            parts.setdefault(name, []).append((self.descriptions[key]["part"][0], key))
        self._parts = {name: [k for _, k in sorted(p)] for name, p in sorted(parts.items())}
        for name, keys in self._parts.items():
            n = {self.descriptions[k]["part"][1] for k in keys}
            if len(n) != 1 or len(keys) != next(iter(n)):
                raise FormatError(f"{self.path}: tensor {name!r} has parts {keys}; expected part_0_n .. part_(n-1)_n")
        self._tensor_files(TensorFiles)

    def _tensor_files(self, kind: type[TensorFiles]) -> None:
        """:attr:`files` (a ``kind`` of every file the index numbers, in number order, each opened on first use)
        and :attr:`part_infos` (stored key -> its part's info, opening its file), from the index read
        (``_file_of_number``, ``_block_index``); ``_keys_of``: the stored keys the index places in each file."""
        keys_of: dict[str, list[str]] = {}
        file_of_key: dict[str, str] = {}
        for key, number in sorted(self._block_index.items(), key=lambda item: item[1]):
            name = file_of_key[key] = self._file_of_number[number]
            keys_of.setdefault(name, []).append(key)
        self._keys_of = keys_of
        self.files = kind(self, [self._file_of_number[number] for number in sorted(self._file_of_number)], keys_of)
        self.part_infos: PartInfos = PartInfos(self.files, file_of_key)

    @property
    def infos(self) -> TensorInfos:
        """The whole tensors' infos by name (:class:`TensorInfos`; a stored key gives its part's)."""
        infos = self.__dict__.get("_tensor_infos")
        if infos is None:
            infos = self._tensor_infos = TensorInfos(self)
        return infos

    def close(self) -> None:
        """Close every file mapped (the views handed out stay valid)."""
        files = getattr(self, "files", None)
        if isinstance(files, TensorFiles):
            files.close()
            self._closed = True
        else:  # a subclass's own files, or none (a reader that failed to open)
            super().close()
        snapshot = getattr(self, "snapshot", None)
        if snapshot is not None:
            snapshot.close()

    def read_into(self, key: str, out, start: int = 0) -> None:
        """Fill ``out`` (a writable buffer) with the bytes of stored part ``key`` from byte ``start`` of the part
        on, read (``preadv``) from the file of the commit this reader pinned, never from one that replaced it.
        Descriptors are opened on demand and cached in a small bounded cache
        (:mod:`fastckpt.store.snapshot`), so a reader of thousands of files holds few.

        >>> import numpy as np, tempfile, os
        >>> from fastckpt.sharded import Saver
        >>> out = Saver(path=os.path.join(tempfile.mkdtemp(), "c"), parallel=1, tensors={"w": np.ones(2)}).save()
        >>> with CheckpointReader(out) as r:
        ...     buf = np.zeros(1); r.read_into("w/part_0_1", buf, 8); buf.tolist()
        [1.0]
        """
        f = self.file_of(key)
        info = f.infos[key]
        view = memoryview(out).cast("B")
        if start < 0 or start + len(view) > info.nbytes:
            raise ValueError(f"{f.path}: bytes [{start}, {start + len(view)}) of tensor {key!r}, which has "
                             f"{info.nbytes}")
        try:
            self.snapshot.read_into(self._file_of_number[self._block_index[key]], view, info.offset + start,
                                    f"tensor {key!r}")
        except CheckpointChangedError:
            # Removed since it was opened: a mapping of the pinned file still reads that commit (no descriptor).
            if f.mapped.backend != "mmap" or f.mapped.closed:
                raise
            with f.mapped.guard(f"tensor {key!r}"):
                view[:] = f.mapped.view(info.offset + start, len(view), f"tensor {key!r}")

    # -- RecIS's API ----------------------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        """The original names of every tensor, sorted (a hashtable ``T`` gives ``T.id``, ``T.embedding``, slots)."""
        return list(self._parts)

    def has_tensor(self, name: str) -> bool:
        """Whether ``name`` is the original name of a tensor of the checkpoint (without the error an unknown name
        raises elsewhere, which looks for close matches).

        >>> import numpy as np, tempfile, os
        >>> from fastckpt.sharded import Saver
        >>> out = Saver(path=os.path.join(tempfile.mkdtemp(), "c"), parallel=1, tensors={"w": np.ones(2)}).save()
        >>> CheckpointReader(out).has_tensor("w"), CheckpointReader(out).has_tensor("v")
        (True, False)
        """
        return name in self._parts

    def part_names(self, name: str) -> list[str]:
        """The stored keys of ``name``'s parts, in rank order."""
        return list(self._parts[self._whole_name(name)])

    def _shape(self, key: str) -> list:
        """A stored part's shape as the tensor it holds (an encoded part's decoded shape)."""
        d = self.descriptions[key]
        return d["encoding"]["shape"] if "encoding" in d else d["shape"]

    def tensor_shape(self, name: str) -> tuple:
        """The shape of a whole tensor (parts stacked on their first axis) or of one stored part."""
        if name in self._block_index:
            return tuple(self._shape(name))
        keys = self._parts[self._whole_name(name)]
        first = self.descriptions[keys[0]]
        if first.get("global_shape") is not None:
            return tuple(first["global_shape"])
        rows = sum(self._shape(k)[0] for k in keys)
        return (rows, *self._shape(keys[0])[1:])

    def tensor_dtype(self, name: str) -> np.dtype:
        """The numpy dtype of a whole tensor or of one stored part."""
        key = name if name in self._block_index else self._parts[self._whole_name(name)][0]
        d = self.descriptions[key]  # its file's header holds the same dtype (checked when the file opens)
        return dtype_of(d.get("encoding", d)["dtype"], f"{self.path}: {key}")

    def part_nbytes(self, key: str) -> int:
        """The bytes stored part ``key`` takes in its file, from its description (its file is not opened).

        >>> import numpy as np, tempfile, os
        >>> from fastckpt.sharded import Saver
        >>> out = Saver(path=os.path.join(tempfile.mkdtemp(), "c"), parallel=1, tensors={"w": np.ones(3)}).save()
        >>> CheckpointReader(out).part_nbytes("w/part_0_1")
        24
        """
        d = self.descriptions[key]
        return int(np.prod(d["shape"], dtype=np.int64)) * dtype_of(d["dtype"], f"{self.path}: {key}").itemsize

    def array(self, key: str) -> np.ndarray:
        """Stored part ``key`` as the tensor it holds: the mapped view, or for an encoded part (compressed or
        quantized, :mod:`fastckpt.sharded.codec`) a new array decoded from it."""
        encoding = self.descriptions[key].get("encoding") if key in self._block_index else None
        if encoding is None:
            return self.host(key)
        from fastckpt.sharded.codec import decode

        return decode(self.host(key), encoding, f"{self.file_of(key).path}: tensor {key!r}")

    def read_tensor(self, name: str) -> np.ndarray:
        """A whole tensor (a new array, its parts joined in rank order) or one stored part (a read-only view, or
        a new array where the part is encoded).

        An unknown name raises :class:`~fastckpt.errors.TensorNotFoundError`
        (a ``KeyError``) naming the closest names.
        """
        if name in self._block_index:
            with self._guard([name], f"tensor {name!r}"):  # decoding copies; a plain part is a view
                return self.array(name)
        keys = self._parts[self._whole_name(name)]
        with self._guard(keys, f"tensor {name!r}"):  # the copies below: a truncated file is a FormatError, not SIGBUS
            return self._joined(name, keys)

    def _guard(self, keys: list[str], what: str) -> contextlib.ExitStack:
        """The files of stored keys ``keys`` opened, their mappings under :func:`~fastckpt.formats.reader.
        guard_mappings` (the other files are neither opened nor guarded)."""
        return guard_mappings((self.file_of(key).mapped for key in keys), what)

    def _joined(self, name: str, keys: list[str]) -> np.ndarray:
        if len(keys) == 1 and self.descriptions[keys[0]].get("global_shape") == self.descriptions[keys[0]]["shape"]:
            return np.array(self.host(keys[0]))
        out = np.empty(self.tensor_shape(name), self.tensor_dtype(name))
        start = 0
        for key in keys:
            part = self.array(key)
            stop = start + (part.shape[0] if part.ndim else 1)
            out[start:stop] = part
            start = stop
        return out

    def hashtables(self) -> dict[str, dict]:
        """``{table: {"dim", "dtype", "slots", "ids", ...}}`` from the manifest (version 4 adds ``partition``, version
        5 ``shape`` and ``slot_specs``: :func:`~fastckpt.sharded.format.row_specs` reads the rows of any version)."""
        return dict(self.manifest.get("hashtables", {}))

    def _whole_name(self, name: str) -> str:
        if isinstance(name, str) and name in self._parts:
            return name
        known = [*self._parts, *self._block_index]
        close = difflib.get_close_matches(str(name), known, n=3)
        hint = f"; close matches: {close}" if close else ""
        raise TensorNotFoundError(f"{self.path}: no tensor {name!r} in this sharded checkpoint "
                                  f"({len(self._parts)} tensors, {len(self._block_index)} parts{hint})")

    # -- the reader contract -------------------------------------------------------------------------
    def file_name(self, key: str) -> str:
        """The name of the tensor file holding stored key ``key``, from the index (the file is not opened).

        >>> import numpy as np, tempfile, os
        >>> from fastckpt.sharded import Saver
        >>> out = Saver(path=os.path.join(tempfile.mkdtemp(), "c"), parallel=1, tensors={"w": np.ones(3)}).save()
        >>> CheckpointReader(out).file_name("w/part_0_1")
        'model-00000-000.safetensors'
        """
        return self._file_of_number[self._block_index[key]]

    def file_of(self, key: str) -> TensorFile:
        """The mapped file holding stored key ``key`` (or the one part of a tensor stored whole), opened and
        checked against the metadata the first time (:class:`TensorFiles`)."""
        if key not in self._block_index:
            keys = self.part_names(key)  # an unknown name raises, naming close matches
            if len(keys) != 1:
                raise ValueError(f"{self.path}: tensor {key!r} is stored in {len(keys)} parts {keys[:4]}"
                                 f"{' ...' if len(keys) > 4 else ''}: file_of takes one of them")
            key = keys[0]
        if self._closed:
            raise ValueError(f"{self.path}: the reader is closed")
        return self.files[self._file_of_number[self._block_index[key]]]

    def host(self, key: str) -> np.ndarray:
        """A whole tensor by its name, or stored part ``key``: a zero-copy, read-only view of its mapped file
        where one part holds it (its file's hash checked first, once, unless the reader was opened with
        ``verify=False``), else a new array of its parts joined (:meth:`read_tensor`)."""
        if key not in self._block_index:
            keys = self._parts[self._whole_name(key)]
            if len(keys) == 1 and "encoding" not in (self.descriptions.get(keys[0]) or {}) \
                    and tuple(self._shape(keys[0])) == self.tensor_shape(key):
                return self.host(keys[0])
            return self.read_tensor(key)
        f = self.file_of(key)
        if self._verify:
            self.check_file(self._file_of_number[self._block_index[key]])
        return f.host(key)

    def check_file(self, name: str) -> None:
        """Check tensor file ``name`` against the manifest's BLAKE3 once per reader (an
        :class:`~fastckpt.errors.ChecksumMismatchError` naming the file and the parts it holds); later calls return at
        once. Its bytes are hashed from the file the reader opened, not from the path.

        >>> import numpy as np, tempfile, os
        >>> from fastckpt.sharded import Saver
        >>> out = Saver(path=os.path.join(tempfile.mkdtemp(), "c"), parallel=1, tensors={"w": np.ones(2)}).save()
        >>> with CheckpointReader(out, verify=False) as r:
        ...     r.check_file("model-00000-000.safetensors"); r.verified_files()
        ['model-00000-000.safetensors']
        """
        if name in self._verified:
            return
        with self._verify_lock:
            if name in self._verified:
                return
            problem = self.file_problem(name)
            if problem:
                raise ChecksumMismatchError(f"{self.path}: {problem}")
            self._verified.add(name)

    def verified_files(self) -> list[str]:
        """The tensor files checked against the manifest's hash so far, sorted (see :meth:`check_file`)."""
        return sorted(self._verified)

    def file_problem(self, name: str) -> str | None:
        """What is wrong with open tensor file ``name`` against the manifest (its BLAKE3, computed on every core
        from the open file), or None; the message names the parts the file holds.

        >>> import numpy as np, tempfile, os
        >>> from fastckpt.sharded import Saver
        >>> out = Saver(path=os.path.join(tempfile.mkdtemp(), "c"), parallel=1, tensors={"w": np.ones(2)}).save()
        >>> CheckpointReader(out).file_problem("model-00000-000.safetensors") is None
        True
        """
        f = self.files[name]
        entry = self.manifest["files"][name]

        drop = self._options["backend"] == "mmap" and not self._options["copy_on_write"]
        digest = _digests.once(f.mapped.identity, lambda: blake3_mapped(f.mapped, drop=drop))
        if digest == entry["blake3"]:
            return None
        keys = sorted(f.infos)
        return (f"{name}: BLAKE3 {digest[:16]}..., the manifest says {entry['blake3'][:16]}...: the file was changed "
                f"or damaged after the commit; it holds {len(keys)} parts {keys[:6]}{' ...' if len(keys) > 6 else ''}")

    def verify(self, *, progress=False) -> list[str]:
        """Every problem of the open tensor files against the manifest's BLAKE3 hashes (empty: all good).

        The metadata files and every size were checked when the reader opened; what the checkpoint's format
        version gives no means to check is listed in :attr:`unchecked`.

        ``progress`` (``True`` for a bar, or ``callback(done, total, item)``:
        :mod:`fastckpt.progress`) counts the files' bytes as each file is checked.
        """
        problems = []
        names = sorted(self.files)
        listed = self.manifest["files"]
        with progress_from(progress, sum(entry["size"] for entry in listed.values()), "verify") as report:
            for name in sorted(set(listed) - set(names)):  # the metadata files: checked when the reader opened
                report.advance(listed[name]["size"], name)
            for name in names:
                problem = self.file_problem(name)
                if problem:
                    problems.append(problem)
                else:
                    self._verified.add(name)
                report.advance(self.files[name].mapped.size, name)
        return problems

    def __repr__(self) -> str:
        return (f"<fastckpt.sharded.CheckpointReader {self.path!r} world_size={self.manifest['world_size']} "
                f"tensors={len(self._parts)}{' closed' if self._closed else ''}>")
