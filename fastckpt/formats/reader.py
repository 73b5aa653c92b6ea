"""One read-only API over tensor files and checkpoints: ``fastckpt.open``.

``fastckpt.open(path)`` opens whatever ``path`` is and returns a reader of the
contract in :mod:`fastckpt.formats.contract` (``keys()``, ``infos``, ``info(name)``,
``host(name)``, ``metadata``, ``close()``):

- a file, by its first bytes (never its name): NPZ or safetensors, a
  :class:`TensorFile`. The file is mapped once, the index is parsed by the
  Cython parsers and ``host(name)`` returns a zero-copy, read-only numpy view
  of a tensor's bytes in the mapping;
- a TensorFlow checkpoint: a prefix (``<path>.index`` exists), its ``.index``
  or a data file, or a directory holding one (a ``checkpoint`` state file, or
  a single ``*.index``): a :class:`fastckpt.tf.CheckpointReader`;
- a training-checkpoint directory written by :mod:`fastckpt.train` (it has a
  ``manifest.json``): a :class:`~fastckpt.train.directory.CheckpointDirectory` over its tensor files,
  tensors named ``"<file stem>/<tensor name>"`` (``"weights/fc1.weight"``);
- a Hugging Face safetensors directory (``model.safetensors.index.json`` and its
  shards, or one ``model.safetensors``): a
  :class:`~fastckpt.formats.hfsharded.HFShardedDirectory`, tensors named as in the index;
- whatever an opener added with :func:`register_opener` accepts (checked
  first: the sharded-checkpoint directory plugs in there).

>>> import fastckpt, numpy as np, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "model.bin")
>>> fastckpt.save_npz(path, {"w": np.ones((2, 2), np.float16)})
>>> with fastckpt.open(path) as f:
...     f.format, f.info("w").shape, f.host("w").dtype
('npz', (2, 2), dtype('float16'))
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import stat
import threading
from typing import Callable, Iterable, Mapping

import numpy as np

from fastckpt.arrays import packed_array
from fastckpt._native.mapped import MappedFile, held_guards
from fastckpt._native.tensorindex import TensorIndex
from fastckpt.errors import CheckpointNotFoundError, FormatError
from fastckpt.formats.contract import ReaderMapping, TensorReader
from fastckpt.formats.filebytes import SNIFF_PADDING, detect_format, sniff_length  # noqa: F401 - reader's names
from fastckpt.formats.readinto import (DIRECT_ALIGN, cached, file_cached, open_direct, read_ahead, read_checked,
                                       same_file)
from fastckpt.info import TensorInfo
from fastckpt.store.names import parse_step
from fastckpt.store.remote import is_url

__all__ = ["open", "open_file", "TensorFile", "detect_format", "register_opener", "unregister_opener",
           "DIRECTORY_READERS", "guard", "guard_mappings", "held_guards", "mappings_of", "copies"]


# The opener of URLs (``fastckpt.formats.remote.open``): that module reads through this one, so it sits above it
# and registers itself here; ``fastckpt/formats/__init__.py`` imports it, so ``fastckpt.open`` always has it.
_url_opener: list = [None]

# A view of a tensor of READ_AHEAD_MIN bytes or more has the kernel read the file READ_AHEAD bytes past it
# (TensorFile._read_ahead): a copy out of a fresh mapping of a cold file otherwise waits at every page fault for the
# kernel's readahead window alone. Measured in docs/reading.md (cold copies of 512 MiB, medians of 12 runs on a
# loaded machine: 0.33 -> 0.53 GB/s).
READ_AHEAD_MIN = 1 << 20
READ_AHEAD = 256 << 20

#: Whether a mapped file's views are read ahead by the reader's own advice: the first window ``MADV_WILLNEED`` at
#: the map, then ``READ_AHEAD`` past each large view (:func:`~fastckpt.formats.readinto.read_ahead`). The advice
#: fills the page cache in 4 KiB pages. False asks the kernel for nothing: the copies' page faults read the file
#: ahead in large folios (up to 2 MiB), as a plain ``mmap`` does (``safetensors.numpy``), in a quarter of the disk
#: requests. Measured both ways (docs/reading.md, "Large folios or 4 KiB pages"): copies into numpy's new arrays,
#: which numpy puts on 2 MiB pages, took up to 2-4x longer from large folios on this project's VM, whose host takes
#: freed 2 MiB blocks back; the cold suite's rows ``..., kernel readahead`` measure the route without the advice.
READ_AHEAD_ADVICE = True


def register_url_opener(opener: Callable) -> None:
    """Make ``opener(url, *, storage_options, names, backend, copy_on_write, max_header_size)`` open URLs for
    :func:`open` (:mod:`fastckpt.formats.remote` registers its ``open``).

    >>> _url_opener[0].__module__
    'fastckpt.formats.remote'
    """
    _url_opener[0] = opener


class TensorFile(ReaderMapping):
    """A mapped NPZ or safetensors file: names, per-tensor info, zero-copy host views, metadata.

    Obtain one with :func:`fastckpt.open`. It implements the reader contract
    (:class:`~fastckpt.formats.contract.TensorReader`) and is a read-only mapping from
    tensor name to a numpy view; views stay valid after :meth:`close`.
    ``infos`` is a read-only mapping name -> :class:`~fastckpt.TensorInfo` in
    file order; ``metadata`` is safetensors' ``__metadata__`` (None for NPZ).

    >>> import fastckpt, numpy as np, tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "m.npz")
    >>> fastckpt.save_npz(p, {"b": np.zeros(2, np.int8), "a": np.ones(3, np.float32)})
    >>> with fastckpt.open(p) as f:
    ...     w = f["a"]
    ...     list(f), f.info("a").aligned(64), f.data_region[0] % 64   # small payloads: 64-byte aligned
    (['b', 'a'], True, 0)
    >>> w.tolist()
    [1.0, 1.0, 1.0]
    """

    def __init__(self, mapped: MappedFile, fmt: str, infos: list[TensorInfo] | TensorIndex, metadata):
        self.mapped = mapped
        self.format = fmt
        self.metadata = metadata
        if not isinstance(infos, TensorIndex):  # the parsers give a columnar index; a list is put in offset order
            infos = TensorIndex.from_infos(mapped, sorted(infos, key=lambda i: i.offset))
        # Columns (fastckpt._native.tensorindex): a TensorInfo is made when asked for, host views without one.
        self.infos: Mapping[str, TensorInfo] = infos
        self._view = infos.view  # bound once: host() is called once per tensor
        # The file is being read ahead up to this byte (host(), see READ_AHEAD); at its end: nothing to ask for.
        self._ahead = 0 if READ_AHEAD_ADVICE else mapped.size
        self._size = mapped.size if mapped.address is not None else 0  # nothing to read ahead in a pread file
        self._pread = mapped.address is None and getattr(mapped, "backend", None) == "pread"

    # -- description ---------------------------------------------------------------------------
    @property
    def path(self) -> str:
        """The path the file was opened from."""
        return self.mapped.path

    @property
    def data_region(self) -> tuple[int, int]:
        """``(start, end)``: the smallest byte range of the file holding every zero-copy payload.

        The device loader copies this range once; tensors are views into it.
        ``(0, 0)`` when the file holds no zero-copy tensor.
        """
        return self.infos.data_region()

    @property
    def nbytes(self) -> int:
        """Total payload bytes of all tensors as stored."""
        return self.infos.total_nbytes()

    # -- data ------------------------------------------------------------------------------------
    def host(self, name: str) -> np.ndarray:
        """The tensor as a numpy array: a zero-copy read-only view of the mapping where the
        layout allows (stored, uncompressed), else a decoded copy (the NPZ parser's
        :class:`~fastckpt.errors.NotZeroCopyWarning` at :func:`open` said so)."""
        if self._pread:  # copies: a large tensor of a cold file is read from 8 threads (_pread_copy)
            copy = self._pread_copy(name)
            if copy is not None:
                return copy
        view = self._view(name)  # straight from the index's columns, where the tensor is viewable in place
        if view is not None:
            if self._ahead < self._size and view.nbytes >= READ_AHEAD_MIN:  # a warm file stops at the first test
                self._read_ahead(view)
            return view
        info = self.info(name)
        if info.packed is not None:  # sub-byte elements: the stored bytes, typed by a PackedArray
            raw = self.mapped.array(info.offset, np.dtype(np.uint8), (info.nbytes,), what=f"tensor {name!r}")
            return packed_array(raw, info.packed, info.shape)
        if info.compression is None:
            order = "F" if info.fortran_order else "C"
            return self.mapped.array(info.offset, info.dtype, info.shape, order=order, what=f"tensor {name!r}")
        from fastckpt.formats import npz

        return npz.read_member(self.mapped, info)

    def _pread_copy(self, name: str) -> np.ndarray | None:
        """``host(name)`` of a ``backend="pread"`` file where the tensor is large and its bytes are not in the page
        cache (:func:`~fastckpt.formats.readinto.file_cached` of three of its pages): read from the file with
        ``O_DIRECT`` where the file system allows, in pieces from several threads (:func:`copies`' route); None
        otherwise (the one ``pread`` of the backend)."""
        info = self.infos.get(name)
        if info is None or info.nbytes < COPY_READ_MIN or info.compression is not None or info.packed is not None \
                or not info.shape:
            return None
        fd = same_file(self.mapped)
        if fd is None:
            return None
        try:
            end = info.offset + info.nbytes
            if file_cached(fd, [info.offset + (end - info.offset) * k // 4 for k in (1, 2, 3)]):
                return None  # warm: the backend's one read copies it from the page cache
            return copies(self, [name], _fd=fd)[name]
        finally:
            os.close(fd)

    def hosts(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """``{name: host(name)}`` for every tensor in file order (``names=None``) or for ``names``, made in one
        native loop over the index: for 100,000 small tensors, in about 60% of the time of calling
        :meth:`host` for each. Unknown names raise as :meth:`host` does.

        >>> import fastckpt, numpy as np, tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "h.safetensors")
        >>> fastckpt.save_safetensors(p, {"a": np.arange(2, dtype=np.int8), "b": np.ones(1, np.float32)})
        >>> with fastckpt.open(p) as f:
        ...     {k: v.tolist() for k, v in f.hosts().items()}, list(f.hosts(["a"]))
        ({'b': [1.0], 'a': [0, 1]}, ['a'])
        """
        views = self.infos.views(names, self.host)
        if names is None and self._ahead < self._size and views:
            # Every tensor's bytes will be read: from the first one to the file's end, all at once.
            start = self._offset_of(next(iter(views.values())))
            if start is not None and self._size - start >= READ_AHEAD_MIN and \
                    (self._ahead or not self._warm(start, self._size)):  # (a window read already: known cold)
                read_ahead(self.mapped, max(start, self._ahead), self._size, check=False)
            self._ahead = self._size
        return views

    def read_ahead_start(self) -> None:
        """Have the kernel read the first ``READ_AHEAD`` bytes of the file's tensor data into the page cache now
        (a cold file's only, as :meth:`host` does past a large view): a reader of several files starts the next file
        while its caller still copies from this one. A no-op once the file is being read ahead, or is warm.

        >>> import fastckpt, numpy as np, tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "r.safetensors"); fastckpt.save_safetensors(p, {"a": np.ones(3)})
        >>> with fastckpt.open(p) as f:
        ...     f.read_ahead_start()
        """
        if self._ahead or not self._size:
            return
        start, end = self.data_region
        if end - start < READ_AHEAD_MIN or self._warm(start, end):
            self._ahead = self._size  # small or warm: nothing to ask the kernel for, now or later
            return
        self._ahead = min(self._size, start + READ_AHEAD)
        read_ahead(self.mapped, start, self._ahead, check=False)

    def advise_first_window(self) -> None:
        """Have the kernel read the file's first window (its readahead window, from the start) into the page cache now,
        as :func:`open_file` does unless told not to (``first_window=False``): a reader of several files (a
        Hugging Face directory) asks for each file's once all their indexes are parsed, so that the copies out of
        every file start on cached bytes. Advice only; a no-op for a ``backend="pread"`` file.

        >>> import fastckpt, numpy as np, tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "w.safetensors"); fastckpt.save_safetensors(p, {"a": np.ones(3)})
        >>> with fastckpt.open(p) as f:
        ...     f.advise_first_window()
        """
        if self._size and READ_AHEAD_ADVICE:
            _advise(self.mapped, "willneed")

    def _offset_of(self, view) -> int | None:
        """The file offset of a view of the mapping (None for a decoded copy, which is no view of it)."""
        offset = view.__array_interface__["data"][0] - self.mapped.address
        return offset if 0 <= offset < self._size else None

    def _warm(self, start: int, end: int) -> bool:
        """Whether bytes ``[start, end)`` of the file look cached: ``COLD_SAMPLES`` pages, each in the middle of one
        of as many equal parts (about 10 us). Not the first page: the open's own advice and its parse of the header
        read the first window of a cold file (4 MiB here), and a test of the first page of the data found every
        cold file warm, so that nothing was read ahead at all."""
        return cached(self.mapped, start, end, COLD_SAMPLES, centred=True)

    def _read_ahead(self, view) -> None:
        """Keep the kernel reading the file ``READ_AHEAD`` bytes past the end of ``view`` (of a large tensor, just
        made), so that a loop copying tensor after tensor finds their bytes read or in
        flight. The window is extended by half of it at a time; a file whose bytes from the first large tensor on are
        in the page cache (:meth:`_warm`, once per open file) is never read ahead."""
        start = self._offset_of(view)
        if start is None:
            return
        end = start + view.nbytes
        if end + READ_AHEAD // 2 > self._ahead:
            if self._ahead == 0 and self._warm(start, self._size):
                self._ahead = self._size  # warm: nothing to ask the kernel for, now or later
                return
            start = max(self._ahead, start)
            self._ahead = min(self._size, end + READ_AHEAD)
            read_ahead(self.mapped, start, self._ahead, check=False)

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the mapping handle (idempotent); views already made stay valid."""
        self.mapped.close()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run (views made before stay valid)."""
        return self.mapped.closed

    def __repr__(self) -> str:
        if self.closed:
            return "<Closed fastckpt.TensorFile>"
        return f"<fastckpt.TensorFile {self.path!r} format={self.format} tensors={len(self)}>"


def open_file(path: str | os.PathLike, *, backend: str = "mmap", copy_on_write: bool = False,
              max_header_size: int | None = None, first_window: bool = True) -> TensorFile:
    """Map the NPZ or safetensors file ``path`` and parse its index; the format is detected from its bytes.

    :func:`open` calls this for a file; options as there. The mapping is advised sequential, and its first window
    ``MADV_WILLNEED`` (the kernel reads it now). ``first_window=False`` leaves that advice until
    :meth:`TensorFile.advise_first_window`, and reads a cold file's index with ``pread`` before the parse: a reader
    of several files (a Hugging Face directory) opens them all, then advises each (the parse of the next file's index
    waited behind the reads the advice queued, 6 ms a cold file).

    >>> import fastckpt, numpy as np, tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "t.bin")
    >>> fastckpt.save_safetensors(p, {"a": np.arange(2, dtype=np.int8)})
    >>> with open_file(p) as f:
    ...     f.format, f["a"].tolist()
    ('safetensors', [0, 1])
    """
    _check_max_header_size(max_header_size)
    first_window = first_window and READ_AHEAD_ADVICE
    if first_window:  # MappedFile's own advice: sequential, and WILLNEED over the first window
        mapped = MappedFile(path, backend=backend, copy_on_write=copy_on_write)
    else:  # sequential only; a cold file's index read first (_read_head), its first window advised later
        mapped = MappedFile(path, backend=backend, copy_on_write=copy_on_write, advise=False)
    try:
        if not first_window:
            if mapped.address is not None and mapped.size and not cached(mapped, 0, 1, 1):
                _read_head(mapped)
            _advise(mapped, "sequential")
        with mapped.guard("its index"):
            return _parse(mapped, max_header_size)
    except BaseException:
        mapped.close()
        raise


def _parse(mapped: MappedFile, max_header_size: int | None) -> TensorFile:
    head = mapped.read(0, min(9, mapped.size), "format magic")
    if sniff_length(head) > 9:
        head = mapped.read(0, min(sniff_length(head), mapped.size), "format magic")
    fmt = detect_format(head)
    if fmt == "npz":
        from fastckpt._native.npz import read_npz_table

        kw = {} if max_header_size is None else {"max_header_size": max_header_size}
        # The parser reads each member's local header, spread over the file: under the mapping's sequential advice
        # each of those page faults on a cold file read the kernel's whole readahead window (8 MiB here), so the
        # open of a 512 MiB .netcl of 16 members read 128 MiB, one window at a time. Random advice for the parse
        # reads only the pages it touches; the advice goes back to sequential for the copies.
        _advise(mapped, "random")
        try:
            infos, metadata = read_npz_table(mapped, **kw), None
        except FormatError:
            _raise_if_foreign(mapped)  # a torch or Keras ZIP: say so, not what the NPZ parser makes of it
            raise
        finally:
            _advise(mapped, "sequential")
    elif fmt == "safetensors":
        from fastckpt._native.safetensors import read_safetensors_table

        infos, metadata, _data_start = read_safetensors_table(mapped)
    else:
        _raise_if_foreign(mapped)  # a pickle, an HDF5 file
        raise FormatError(
            f"{mapped.path}: not an NPZ (ZIP) or safetensors file: first bytes are {head!r} "
            "(expected b'PK\\x03\\x04' for NPZ, or an 8-byte little-endian header length followed by '{' "
            "for safetensors)"
        )
    return TensorFile(mapped, fmt, infos, metadata)


HEAD_READ = 64 << 10  # _read_head: the first bytes of a cold file read with pread before its index is parsed


def _read_head(mapped: MappedFile) -> None:
    """Put the index of a cold file (its first page not in the page cache) in the page cache with ``pread``, before
    the parser faults it in from the mapping: the fault, under the mapping's sequential advice, waited for the
    kernel's whole readahead window (6 ms a file here; a Hugging Face directory's four cold shards took 22-38 ms to
    open, 5-8 ms so). ``HEAD_READ`` bytes, and the rest of a safetensors header longer than that. Advice only: a
    failure changes nothing (the parse reads and checks the bytes from the mapping)."""
    fd = same_file(mapped)
    if fd is None:
        return
    try:
        head = os.pread(fd, HEAD_READ, 0)
        if len(head) >= 8 and head[8:9] == b"{":  # safetensors: an 8-byte length, then its JSON header
            end = min(8 + int.from_bytes(head[:8], "little"), mapped.size, READ_AHEAD)
            while len(head) < end:
                got = os.pread(fd, min(end - len(head), READ_AHEAD_MIN), len(head))
                if not got:
                    break
                head += got
    except OSError:
        pass
    finally:
        os.close(fd)


def _advise(mapped: MappedFile, kind: str) -> None:
    """``madvise`` advice over the whole mapping; advice only, so a failure changes nothing."""
    try:
        mapped.advise(kind)
    except (OSError, ValueError):
        pass


# copies(): a tensor of at least COPY_READ_MIN bytes of a file not in the page cache is read from the file into its
# new array (O_DIRECT where the address allows, every file's tensors at once); smaller ones, and every tensor of a
# warm file, are copied out of the mapping (one memcpy from the page cache beats reading the file again).
COPY_READ_MIN = 1 << 20
COLD_SAMPLES = 7  # pages of a file's data mincore looks at to call it warm (readinto.cached, centred)


def copies(reader, names: Iterable[str] | None = None, *, _fd: int | None = None) -> dict[str, np.ndarray]:
    """``{name: a private, writable copy of the tensor}`` for every tensor of ``reader`` (or ``names``), in that
    order: what :func:`~fastckpt.formats.tree.load_tree` returns its arrays from. Where a mapped file's data is not
    in the page cache, its large tensors are read straight from the file into their arrays
    (:func:`~fastckpt.formats.readinto.read_into`, ``O_DIRECT``: no page cache, no second copy), every file of a
    directory reader at once; a file changed or truncated meanwhile is a :class:`~fastckpt.errors.FormatError`
    naming it. Any other tensor is ``np.array(reader.host(name), copy=True)``.

    >>> import fastckpt, numpy as np, tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "c.safetensors")
    >>> fastckpt.save_safetensors(p, {"a": np.arange(3, dtype=np.int16)})
    >>> with fastckpt.open(p) as f:
    ...     out = copies(f)
    >>> out["a"].tolist(), out["a"].flags.writeable
    ([0, 1, 2], True)
    """
    wanted = list(reader.keys()) if names is None else list(names)
    out: dict[str, np.ndarray] = {}
    parts = reader.parts() if callable(getattr(reader, "parts", None)) else \
        [(reader, tuple(wanted))] if isinstance(reader, TensorFile) else []
    pairs, files = [], []
    chosen = set(wanted)
    try:
        for f, part_names in parts:
            if _fd is None:  # (a pread file's host() passes the descriptor it found the tensor cold with)
                if not isinstance(f, TensorFile) or f.mapped.address is None:
                    continue
                start, end = f.data_region
                if end - start < COPY_READ_MIN or cached(f.mapped, start, end, COLD_SAMPLES, centred=True):
                    continue
            fd = same_file(f.mapped) if _fd is None else os.dup(_fd)
            if fd is None:
                continue  # copied from the mapping below, under its guard
            direct = open_direct(f.mapped.path, f.mapped.identity)
            files.append((fd, direct, f.mapped))
            for name in part_names:
                if name not in chosen:
                    continue
                info = f.infos[name]
                if info.nbytes < COPY_READ_MIN or info.compression is not None or info.packed is not None or \
                        (_fd is None and f._view(name) is None):
                    continue
                block = np.empty(info.nbytes + DIRECT_ALIGN, np.uint8)
                at = (info.offset - block.ctypes.data) % DIRECT_ALIGN  # the address agrees with the file offset
                data = block[at:at + info.nbytes]
                out[name] = array = data.view(info.dtype).reshape(info.shape, order="F" if info.fortran_order else "C")
                if _fd is not None and not f.mapped.copy_on_write:
                    array.flags.writeable = False  # a pread file's host() copies, read-only as its views
                pairs.append((data, info.offset, fd, direct, f.mapped.path))
        if pairs:
            read_checked(pairs, files, reader.path, "reading its tensors")
    finally:
        for fd, direct, _mapped in files:
            os.close(fd)
            if direct is not None:
                os.close(direct)
    if _fd is not None:
        return out
    with guard(reader, "tensors into copies"):
        return {name: out[name] if name in out else np.array(reader.host(name), copy=True, subok=True)  # packed: kept
                for name in wanted}


def mappings_of(reader) -> list:
    """The :class:`~fastckpt._native.mapped.MappedFile` handles a reader copies tensors out of: what its
    ``mappings()`` returns (a TensorFlow checkpoint's data shards), its ``mapped`` file, or those of the readers
    in its ``files`` (a training-checkpoint or Hugging Face directory).

    >>> import fastckpt, numpy as np, tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "m.safetensors"); fastckpt.save_safetensors(p, {"a": np.ones(1)})
    >>> with fastckpt.open(p) as f:
    ...     [m.path == p for m in mappings_of(f)]
    [True]
    """
    mappings = getattr(reader, "mappings", None)  # a TensorFlow checkpoint's data shards
    if callable(mappings):
        return list(mappings())
    mapped = getattr(reader, "mapped", None)
    if callable(getattr(mapped, "guard", None)):
        return [mapped]
    files = getattr(reader, "files", None)
    if isinstance(files, Mapping):  # a sharded reader's TensorFiles open here what they had not opened yet
        return [m for f in files.values() for m in mappings_of(f)]
    return []


def guard(reader, what: str) -> contextlib.ExitStack:
    """:meth:`MappedFile.guard <fastckpt._native.mapped.MappedFile.guard>` over every mapping of ``reader``
    (:func:`mappings_of`): copies made of its tensors inside the block raise
    :class:`~fastckpt.errors.FormatError` where a file was truncated under them, never SIGBUS.

    >>> import fastckpt, numpy as np, tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "m.safetensors"); fastckpt.save_safetensors(p, {"a": np.ones(2)})
    >>> with fastckpt.open(p) as f, guard(f, "a copy"):
    ...     np.array(f.host("a")).tolist()
    [1.0, 1.0]

    The guards cover the calling thread (and the worker threads of native runtimes, BLAKE3's and OpenCL's,
    that copy for it). A Python thread pool that copies for the block runs its tasks under
    :func:`held_guards`, which covers them as the calling thread:

    >>> from concurrent.futures import ThreadPoolExecutor
    >>> with fastckpt.open(p) as f, guard(f, "a copy"), ThreadPoolExecutor(1) as pool:
    ...     scope = held_guards()
    ...     pool.submit(scope.run, np.array, f.host("a")).result().tolist()
    [1.0, 1.0]
    """
    return guard_mappings(mappings_of(reader), what)


def guard_mappings(mappings, what: str) -> contextlib.ExitStack:
    """:func:`guard` over the given :class:`~fastckpt._native.mapped.MappedFile` handles alone (each once, however
    often it is given): a reader whose files open on first use guards those it reads, not every one.

    >>> import fastckpt, numpy as np, tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "m.safetensors"); fastckpt.save_safetensors(p, {"a": np.ones(2)})
    >>> with fastckpt.open(p) as f, guard_mappings([f.mapped, f.mapped], "a copy"):
    ...     np.array(f.host("a")).tolist()
    [1.0, 1.0]
    """
    stack = contextlib.ExitStack()
    with stack:
        for mapped in {id(m): m for m in mappings}.values():
            stack.enter_context(mapped.guard(what))
        return stack.pop_all()


def _raise_if_foreign(mapped: MappedFile) -> None:
    """Raise what :mod:`fastckpt.formats.foreign` says of another tool's file (only once parsing has failed, so
    that a good file never pays for the look)."""
    from fastckpt.formats.foreign import SNIFF_BYTES, foreign_file_error

    foreign = foreign_file_error(mapped.path, mapped.read(0, min(SNIFF_BYTES, mapped.size), "format magic"))
    if foreign is not None:
        raise foreign from None


def _check_max_header_size(max_header_size) -> None:
    if max_header_size is not None and (type(max_header_size) is not int or max_header_size < 1):
        raise ValueError(f"max_header_size must be a positive int or None, got {max_header_size!r}")


# -- what fastckpt.open can open -----------------------------------------------------------------

# (predicate, opener) pairs added by register_opener, the latest first; consulted before the built-in kinds.
_openers: list[tuple[Callable[[str], bool], Callable[..., TensorReader]]] = []
_openers_lock = threading.Lock()


def register_opener(predicate: Callable[[str], bool], opener: Callable[..., TensorReader]) -> Callable:
    """Teach :func:`open` a new kind of path (the sharded-checkpoint directory is the first); returns ``opener``.

    ``predicate(path: str) -> bool`` says whether ``opener`` takes ``path``; it
    is called on every :func:`open` call before the built-in kinds, so it must be
    cheap (a ``stat`` or two, no parsing) and must not raise. The first
    predicate to accept, the most recently registered first, wins; its
    ``opener(path: str, *, backend, copy_on_write, max_header_size)`` (always
    given those keywords, as :func:`open` got them; an option it cannot honour
    is a ``ValueError``) returns an object of the reader contract
    (:class:`~fastckpt.formats.contract.TensorReader`). :func:`unregister_opener`
    removes it again.

    >>> import fastckpt, numpy as np, tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> fastckpt.save_safetensors(os.path.join(d, "only.safetensors"), {"w": np.zeros(2, np.float32)})
    >>> def holds_one_file(path):
    ...     return os.path.isfile(os.path.join(path, "only.safetensors"))
    >>> def open_the_file(path, **options):
    ...     return open_file(os.path.join(path, "only.safetensors"), **options)
    >>> _ = register_opener(holds_one_file, open_the_file)
    >>> with fastckpt.open(d) as r:
    ...     list(r.keys())
    ['w']
    >>> unregister_opener(open_the_file)
    """
    if not callable(predicate) or not callable(opener):
        raise TypeError("register_opener(predicate, opener) needs two callables")
    with _openers_lock:
        _openers.insert(0, (predicate, opener))
    return opener


def unregister_opener(opener: Callable) -> None:
    """Remove every registration of ``opener`` made by :func:`register_opener` (``ValueError`` if none).

    >>> unregister_opener(print)
    Traceback (most recent call last):
    ...
    ValueError: <built-in function print> was not registered with fastckpt.formats.reader.register_opener
    """
    with _openers_lock:
        kept = [entry for entry in _openers if entry[1] is not opener]
        if len(kept) == len(_openers):
            raise ValueError(f"{opener!r} was not registered with fastckpt.formats.reader.register_opener")
        _openers[:] = kept


def open(path: str | os.PathLike, *, backend: str = "mmap", copy_on_write: bool = False,  # noqa: A001
         max_header_size: int | None = None, storage_options: dict | None = None,
         names=None, first_window: bool = True) -> TensorReader:
    """Open whatever ``path`` is as a reader of the contract (:class:`~fastckpt.formats.contract.TensorReader`).

    In this order: a path an opener added with :func:`register_opener`
    accepts; a directory: a :mod:`fastckpt.train` checkpoint (``manifest.json``)
    as a :class:`~fastckpt.train.directory.CheckpointDirectory`, a Hugging Face
    safetensors directory (``model.safetensors.index.json`` or ``model.safetensors``)
    as a :class:`~fastckpt.formats.hfsharded.HFShardedDirectory` (kinds of
    :data:`DIRECTORY_READERS`), a TensorFlow checkpoint (its
    ``checkpoint`` state file, else its only ``*.index``) as a
    :class:`fastckpt.tf.CheckpointReader`; a file: a TensorFlow ``.index`` or
    data file as that checkpoint's reader, any other by its bytes (NPZ or
    safetensors) as a :class:`TensorFile`; a path that does not exist but
    ``path + ".index"`` does: that TensorFlow checkpoint. Anything else is an
    error naming the path and what was expected
    (:class:`~fastckpt.errors.FormatError` for a file of another format,
    :class:`~fastckpt.errors.CheckpointNotFoundError`, a ``FileNotFoundError``,
    otherwise).

    ``backend="pread"`` reads instead of mapping (for filesystems that cannot
    map); ``copy_on_write=True`` makes views writable and private (the files
    never change). ``max_header_size`` raises the cap on each NPZ member's
    ``.npy`` header (default 10000 characters, numpy's cap); only for trusted
    files, whose headers are longer (structured dtypes with many fields).
    safetensors headers have the format's own fixed cap (100 MB). TensorFlow
    checkpoints are opened with checksum verification on (open a
    :class:`~fastckpt.tf.CheckpointReader` with ``verify=False`` to skip it).
    ``first_window=False`` maps an NPZ or safetensors file, or a Hugging Face
    directory's shards, without asking the kernel to read the first window
    of each now (:func:`open_file`): for a caller that reads the bytes itself
    (``load_tree`` and pooled loads read a cold file with ``O_DIRECT``, and
    the window would be read twice).

    A URL (``s3://bucket/model.safetensors``, any fsspec URL; ``storage_options``
    configure its filesystem) names one NPZ or safetensors file: its index is
    read with ranged reads, then only the tensors in ``names`` (default: all)
    are fetched, in parallel (:func:`fastckpt.formats.remote.open`).

    >>> import fastckpt, numpy as np, tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "t.safetensors")
    >>> fastckpt.save_safetensors(p, {"a": np.arange(3, dtype=np.int32)}, metadata={"step": "7"})
    >>> f = fastckpt.open(p)
    >>> list(f), f.metadata, f["a"].tolist()
    (['a'], {'step': '7'}, [0, 1, 2])
    >>> f.close()
    >>> from fastckpt.tf import write_checkpoint
    >>> prefix = os.path.join(tempfile.mkdtemp(), "ckpt-1")
    >>> write_checkpoint(prefix, {"dense/kernel": np.eye(2, dtype=np.float32)})
    >>> with fastckpt.open(prefix) as r:
    ...     r.format, list(r.keys()), r.host("dense/kernel").tolist()
    ('tensorflow', ['dense/kernel'], [[1.0, 0.0], [0.0, 1.0]])
    """
    _check_max_header_size(max_header_size)
    if isinstance(path, (bytes, bytearray, memoryview)):
        raise TypeError(f"fastckpt.open takes a path (str or os.PathLike), not {type(path).__name__} "
                        f"({len(path)} bytes, starting {bytes(path[:12])!r}): for a file's bytes held in memory, "
                        "use fastckpt.load_bytes(data); for a path given as bytes, pass os.fsdecode(path)")
    p = os.fspath(path)
    if "://" in p and is_url(p):  # object storage and remote filesystems: fastckpt.formats.remote
        return _url_opener[0](p, storage_options=storage_options, names=names, backend=backend,
                              copy_on_write=copy_on_write, max_header_size=max_header_size)
    if storage_options is not None or names is not None:
        raise ValueError(f"storage_options= and names= are for URLs (s3://...); the local file {p!r} is mapped, "
                         "and reads only the tensors you ask for")
    options = {"backend": backend, "copy_on_write": copy_on_write, "max_header_size": max_header_size}
    for predicate, opener in tuple(_openers):
        if predicate(p):
            return opener(p, **options)
    try:
        is_dir = stat.S_ISDIR(os.stat(p).st_mode)
    except FileNotFoundError:
        if os.path.isfile(p + ".index"):
            return _open_tf(p, **options)
        raise CheckpointNotFoundError(
            errno.ENOENT, f"{os.strerror(errno.ENOENT)}: expected a tensor file (NPZ, safetensors), a TensorFlow "
                          "checkpoint prefix (with a .index file) or a checkpoint directory", p) from None
    except OSError:
        is_dir = False  # opening the file reports what is wrong (permissions, ...)
    if is_dir:
        reader = _directory_reader(p)
        if reader is not None:
            if not first_window and getattr(reader, "format", None) == "hf-sharded":
                return reader(p, **options, first_window=False)
            return reader(p, **options)
        prefix = _tf_prefix_in(p)
        if prefix is not None:
            return _open_tf(prefix, **options)
        from fastckpt.formats.foreign import foreign_directory_error

        with contextlib.suppress(OSError):
            foreign = foreign_directory_error(p, os.listdir(p))
            if foreign is not None:
                raise foreign
        raise CheckpointNotFoundError(f"{p}: a directory fastckpt.open cannot read: {_what_directory_is(p)}")
    if p.endswith(HF_INDEX_SUFFIX):  # what hf_hub_download returns for a sharded model: its directory's index
        return _named_reader(DIRECTORY_READERS["model.safetensors.index.json"])(p, **options, first_window=first_window)
    if _is_tf_file(p):
        return _open_tf(p, **options)
    return open_file(p, backend=backend, copy_on_write=copy_on_write, max_header_size=max_header_size,
                     first_window=first_window)


# Directory kinds of the floors above, by the file that marks them: marker -> "module:reader class". They are
# named, not imported, so this floor imports nothing above it; a directory of the kind imports its reader when
# first opened. Each reader takes (path, backend=, copy_on_write=, max_header_size=) and implements the contract.
# fastckpt.formats.hfsharded is on this floor but is named here all the same, so that opening a file never imports it.
# A Hugging Face directory with both markers is read from model.safetensors, as transformers does (the reader decides).
DIRECTORY_READERS = {"torch_rank_weights_embs_table_multi_shard.json": "fastckpt.sharded.reader:CheckpointReader",
                     # RecIS's layout needs only its index and tensorkey.json (its description file is optional)
                     "tensorkey.json": "fastckpt.sharded.reader:CheckpointReader",
                     "manifest.json": "fastckpt.train.directory:CheckpointDirectory",
                     "model.safetensors.index.json": "fastckpt.formats.hfsharded:HFShardedDirectory",
                     "model.safetensors": "fastckpt.formats.hfsharded:HFShardedDirectory"}


HF_INDEX_SUFFIX = ".safetensors.index.json"

_OPENABLE = ("fastckpt.open reads a fastckpt.train checkpoint (manifest.json), a Hugging Face safetensors "
             "directory (model.safetensors.index.json or model.safetensors), a TensorFlow checkpoint (a "
             "'checkpoint' state file or one *.index file), a sharded checkpoint, or a directory a "
             "fastckpt.formats.reader.register_opener opener accepts")
_TENSOR_FILE_SUFFIXES = (".safetensors", ".npz", ".netcl")


def _what_directory_is(path: str) -> str:
    """What a directory no reader takes looks like, and the call that opens it (or its parts)."""
    try:
        with os.scandir(path) as entries:
            found = sorted((e.name, e.is_dir()) for e in entries)
    except OSError as e:
        return f"it cannot be listed ({e.strerror}). {_OPENABLE}"
    names = [name for name, _ in found if not name.endswith(".partial")]
    if not names:
        what = ("only the temporary files (*.partial) of an interrupted save" if found
                else "nothing (an empty directory)")
        return f"it holds {what}. {_OPENABLE}"
    steps = sorted((step, n) for n, d in found if d and (step := parse_step(n)) is not None
                   and os.path.isfile(os.path.join(path, n, "manifest.json")))
    if steps:
        latest = os.path.join(path, steps[-1][1])
        return (f"it is a fastckpt.train.CheckpointManager directory of {len(steps)} checkpoint(s) "
                f"({', '.join(n for _, n in steps[:3])}{', ...' if len(steps) > 3 else ''}): open one checkpoint, "
                f"as fastckpt.open({latest!r}) (the latest), or restore with "
                f"CheckpointManager({path!r}).restore_latest(model, ...)")
    if ".fastckpt-manager.json" in names and set(names) <= {".fastckpt-manager.json", ".fastckpt-manager.lock"}:
        # fastckpt.train.manager's record (and the lock of its changes): a manager that kept no checkpoint
        return ("it is a fastckpt.train.CheckpointManager directory that holds no checkpoint yet: save one with "
                f"CheckpointManager({path!r}).save(step, model, ...)")
    inner = [n for n, d in found if d and any(os.path.isfile(os.path.join(path, n, m)) for m in DIRECTORY_READERS)]
    if inner:
        return (f"its subdirectories {', '.join(inner[:3])}{', ...' if len(inner) > 3 else ''} are checkpoints: "
                f"open one, as fastckpt.open({os.path.join(path, inner[0])!r})")
    files = [n for n, d in found if not d and n.endswith(_TENSOR_FILE_SUFFIXES)]
    if files:
        shown = ", ".join(files[:3]) + (", ..." if len(files) > 3 else "")
        hint = (f"; a .netcl model loads with fastckpt.io.load_model({os.path.join(path, files[0])!r})"
                if any(n.endswith(".netcl") for n in files) else "")
        return (f"it holds {len(files)} tensor file(s) ({shown}) but no index or manifest that makes them one "
                f"checkpoint: open each file, as fastckpt.open({os.path.join(path, files[0])!r}){hint}")
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    return f"it holds {shown}, none of them a tensor file or checkpoint marker. {_OPENABLE}"


def _named_reader(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _directory_reader(path: str):
    for marker, target in DIRECTORY_READERS.items():
        if os.path.isfile(os.path.join(path, marker)):
            return _named_reader(target)
    try:  # any other prefix's Hugging Face index (diffusers' diffusion_pytorch_model, save_sharded(prefix=...))
        with os.scandir(path) as entries:
            if any(e.name.endswith(HF_INDEX_SUFFIX) and e.is_file() for e in entries):
                return _named_reader(DIRECTORY_READERS["model.safetensors.index.json"])
    except OSError:
        pass
    return None


def _is_tf_file(path: str) -> bool:
    """True for a TensorFlow ``.index`` or data file (by name, then by the index's magic)."""
    name = os.path.basename(path)
    if not (name.endswith(".index") or ".data-" in name):
        return False
    from fastckpt.formats.tf.describe import is_tf_checkpoint

    return is_tf_checkpoint(path)


def _tf_prefix_in(directory: str) -> str | None:
    """The TensorFlow checkpoint of ``directory``: named by its ``checkpoint`` file, else its only ``*.index``."""
    if os.path.isfile(os.path.join(directory, "checkpoint")):
        return directory  # CheckpointReader resolves it (and says what is wrong with a bad state file)
    try:
        indexes = [e.name for e in os.scandir(directory) if e.name.endswith(".index") and e.is_file()]
    except OSError:
        return None
    if len(indexes) == 1:
        return os.path.join(directory, indexes[0][: -len(".index")])
    if len(indexes) > 1:
        raise CheckpointNotFoundError(
            f"{directory}: {len(indexes)} TensorFlow checkpoints ({', '.join(sorted(indexes)[:5])}) and no "
            "'checkpoint' state file naming the one to read; pass its prefix")
    return None


def _open_tf(path: str, *, backend: str, copy_on_write: bool, max_header_size: int | None) -> TensorReader:
    from fastckpt.formats.tf.reader import CheckpointReader

    return CheckpointReader(path, backend=backend, copy_on_write=copy_on_write)
