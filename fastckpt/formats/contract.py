"""The reader contract: what every tensor-file reader of fastckpt offers, whatever the format.

:func:`fastckpt.open` returns an object of this contract for an NPZ or
safetensors file (:class:`~fastckpt.formats.reader.TensorFile`), a TensorFlow
checkpoint (:class:`~fastckpt.tf.CheckpointReader`), a training-checkpoint
directory (:class:`~fastckpt.train.directory.CheckpointDirectory`) and a
Hugging Face safetensors directory (:class:`~fastckpt.formats.hfsharded.HFShardedDirectory`);
:func:`~fastckpt.device.load.load_file` and :func:`~fastckpt.io.serialization.load_model`
accept any object of it. A reader implements the contract by having these
members (:class:`TensorReader` is a ``runtime_checkable`` Protocol, so
``isinstance(reader, TensorReader)`` checks that they are present):

``keys()``
    The tensor names, each once, in the order of the source: file order for
    NPZ and safetensors (payload offset), index order for TensorFlow (byte
    order of the names), file after file for a directory.
``infos``
    A read-only mapping name -> :class:`~fastckpt.TensorInfo` (or a subclass:
    ``TFTensorInfo`` adds the data shard and checksum), in ``keys()`` order.
    ``dtype`` is the numpy dtype ``host`` returns and ``shape`` its shape;
    ``offset`` / ``nbytes`` locate the payload as stored, in the file the
    reader's format says (the data shard ``info.shard`` for TensorFlow, the
    tensor's own file for a directory).
``info(name)``
    ``infos[name]``; an unknown name raises
    :class:`~fastckpt.errors.TensorNotFoundError` (a ``KeyError``) naming the
    reader's path, how many tensors it holds and the closest names
    (:func:`tensor_not_found` builds that error).
``host(name)``
    The tensor as a numpy array of ``info(name).dtype`` and ``.shape``, to be
    treated as read-only: a zero-copy, read-only view of the mapped file where
    the format allows (stored, little-endian, C- or Fortran-ordered payloads;
    writable only for files opened ``copy_on_write=True``), else a new array
    decoded from the stored bytes (DEFLATE members of an NPZ, big-endian or
    partitioned TensorFlow tensors, TensorFlow strings as ``object`` arrays of
    ``bytes``; every array when read with ``backend="pread"``). Views stay
    valid after ``close()``. Unknown names raise as ``info`` does.
``metadata``
    A ``dict[str, str]`` of the source's free-form metadata (safetensors'
    ``__metadata__``), or None when the source has none (NPZ and TensorFlow
    have no place for it; a safetensors file may leave it out).
``path``, ``format``
    What the reader was opened from (a file, a TensorFlow prefix, a directory)
    and a short name of its format (``"npz"``, ``"safetensors"``,
    ``"tensorflow"``, ...), for messages and load reports.
``close()``, ``with reader:``
    Release the files (idempotent; leaving a ``with`` block closes).

``hosts(names=None)``, ``reader[name]``, ``len(reader)``, ``iter(reader)``, ``name in reader``
    A reader is a read-only :class:`~collections.abc.Mapping` name -> array:
    ``hosts`` gives ``{name: host(name)}`` for every tensor in ``keys()``
    order, or for ``names``; ``reader[name]`` is ``host(name)``. Every
    built-in reader gets these from :class:`ReaderMapping`, which writes them
    once in terms of the members above; a reader of one's own can subclass it
    too. A mapped NPZ or safetensors file makes all its views in one native
    loop from its columnar index (:mod:`fastckpt._native.tensorindex`), which
    for many small tensors costs a fraction of calling ``host`` per tensor.

One member is optional: a reader over several mapped files (the Hugging Face
sharded directory, :class:`~fastckpt.formats.hfsharded.HFShardedDirectory`)
may offer ``parts()``, a sequence of ``(TensorFile, names)`` pairs: each of
its mapped NPZ or safetensors files (:class:`~fastckpt.formats.reader.TensorFile`)
and the reader's names of the tensors stored there, whose ``info(name)``
locates the payload in that file. :func:`~fastckpt.device.load.load_file` then
copies every file's tensor region straight from its mapping (all of them into
one pooled arena) instead of reading each tensor through ``host``.

>>> import fastckpt, numpy as np, tempfile, os
>>> p = os.path.join(tempfile.mkdtemp(), "m.npz")
>>> fastckpt.save_npz(p, {"w": np.ones((2, 2), np.float32)})
>>> with fastckpt.open(p) as reader:
...     isinstance(reader, TensorReader), list(reader.keys()), reader.infos["w"].shape, reader.metadata
(True, ['w'], (2, 2), None)
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from collections.abc import Mapping as MappingABC
from typing import Any, Iterable, Mapping, Protocol, TypeVar, runtime_checkable

import numpy as np

from fastckpt.errors import TensorNotFoundError
from fastckpt.info import TensorInfo
from fastckpt.words import plural

__all__ = ["TensorReader", "ReaderMapping", "MultiFileReader", "tensor_not_found"]

_Reader = TypeVar("_Reader", bound="TensorReader")
_Mapping = TypeVar("_Mapping", bound="ReaderMapping")


@runtime_checkable
class TensorReader(Protocol):
    """An open source of named tensors (see the module docstring for the exact contract).

    >>> import fastckpt, numpy as np, tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "a.safetensors")
    >>> fastckpt.save_safetensors(p, {"a": np.arange(3, dtype=np.int16)}, metadata={"step": "3"})
    >>> with fastckpt.open(p) as r:
    ...     isinstance(r, TensorReader), r.info("a").dtype, r.host("a").tolist(), r.metadata
    (True, dtype('int16'), [0, 1, 2], {'step': '3'})
    """

    path: str
    format: str

    @property
    def infos(self) -> Mapping[str, TensorInfo]:
        """Read-only mapping name -> :class:`~fastckpt.TensorInfo`, in ``keys()`` order."""

    @property
    def metadata(self) -> dict[str, str] | None:
        """The source's string metadata, or None when it has none."""

    def keys(self) -> Iterable[str]:
        """Every tensor name once, in the source's order."""

    def info(self, name: str) -> TensorInfo:
        """The :class:`~fastckpt.TensorInfo` of ``name`` (``TensorNotFoundError``, a KeyError, if absent)."""

    def host(self, name: str) -> np.ndarray:
        """The tensor as a numpy array (treat as read-only; zero-copy where the format allows)."""

    def close(self) -> None:
        """Release the source's files; idempotent."""

    def hosts(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """``{name: host(name)}`` for every tensor in ``keys()`` order, or for ``names``."""

    def __getitem__(self, name: str) -> np.ndarray: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[str]: ...

    def __contains__(self, name: object) -> bool: ...

    def __enter__(self: _Reader) -> _Reader: ...

    def __exit__(self, *exc: object) -> bool | None: ...


def tensor_not_found(where: str, name: object, names: Iterable[str]) -> TensorNotFoundError:
    """The error for an unknown tensor ``name`` of the reader at ``where``: how many there are, the closest names.

    >>> print(tensor_not_found("m.npz", "fc1.wieght", ["fc1.weight", "fc1.bias"]).args[0])
    m.npz: no tensor named 'fc1.wieght' (2 tensors: 'fc1.weight', 'fc1.bias'); did you mean 'fc1.weight'?
    """
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:8]) + (", ..." if len(names) > 8 else "")
    close = difflib.get_close_matches(str(name), names, n=3) if isinstance(name, str) else []
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    return TensorNotFoundError(f"{where}: no tensor named {name!r} ({plural(len(names), 'tensor')}: {shown}){hint}")


class ReaderMapping(MappingABC):
    """The half of the contract every reader writes alike, written once: ``info``, the read-only mapping
    name -> array, ``nbytes`` and the context manager, all in terms of ``infos``, ``host``, ``path`` and
    ``close``, which a subclass supplies.

    >>> class One(ReaderMapping):
    ...     path, infos = "one", {"x": TensorInfo("x", np.dtype("u1"), (1,), 0, 1)}
    ...     def host(self, name): return np.zeros(1, self.info(name).dtype)
    ...     def close(self): pass
    >>> with One() as r:
    ...     list(r), r["x"].tolist(), r.nbytes, "y" in r
    (['x'], [0], 1, False)
    """

    # A file handle: equal only to itself (Mapping's value comparison would compare arrays).
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def info(self, name: str) -> TensorInfo:
        """The :class:`~fastckpt.TensorInfo` of ``name`` (``TensorNotFoundError``, a KeyError, if absent)."""
        try:
            return self.infos[name]
        except (KeyError, TypeError):
            raise tensor_not_found(self.path, name, self.infos) from None

    @property
    def nbytes(self) -> int:
        """Total payload bytes of all tensors as stored."""
        return sum(i.nbytes for i in self.infos.values())

    def hosts(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """``{name: host(name)}`` for every tensor in ``keys()`` order (``names=None``) or for ``names``.

        Unknown names raise as :meth:`host` does; a single ``str`` is a ``TypeError`` (pass a list).

        >>> class Two(ReaderMapping):
        ...     path, infos = "two", {"x": TensorInfo("x", np.dtype("u1"), (1,), 0, 1),
        ...                           "y": TensorInfo("y", np.dtype("u1"), (2,), 1, 2)}
        ...     def host(self, name): return np.zeros(self.info(name).shape, self.info(name).dtype)
        ...     def close(self): pass
        >>> {k: v.tolist() for k, v in Two().hosts().items()}, list(Two().hosts(["y"]))
        ({'x': [0], 'y': [0, 0]}, ['y'])
        """
        if names is None:
            return {name: self.host(name) for name in self.keys()}
        if isinstance(names, (str, bytes)):
            raise TypeError(f"names must be a collection of tensor names, got the single name {names!r}; "
                            f"pass [{names!r}]")
        return {name: self.host(name) for name in names}

    def __getitem__(self, name: str) -> np.ndarray:
        return self.host(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.infos)

    def __len__(self) -> int:
        return len(self.infos)

    def __contains__(self, name: object) -> bool:
        return name in self.infos

    def __enter__(self: _Mapping) -> _Mapping:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MultiFileReader(ReaderMapping):
    """A reader over several open files (``files``: name -> file): closing it closes them all.

    >>> class Two(MultiFileReader):
    ...     path, infos, files, _closed = "two", {}, {}, False
    >>> r = Two(); r.close(); r.closed
    True
    """

    files: Mapping[str, Any]
    _closed: bool

    def close(self) -> None:
        """Close every file (idempotent); views already made stay valid."""
        for f in self.files.values():
            f.close()
        self._closed = True

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._closed
