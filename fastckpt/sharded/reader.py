"""``CheckpointReader``: the tensors of a sharded checkpoint, whole or by part, without loading the rest.

Two views of one directory (layout: :mod:`fastckpt.sharded.format`):

* RecIS's: :meth:`CheckpointReader.tensor_names` lists the original names
  (``"w"``, ``"emb.id"``, ``"emb.embedding"``, ``"emb.m"``);
  :meth:`~CheckpointReader.read_tensor` returns a whole tensor (the parts
  joined in rank order) or, given a stored key (``"w/part_0_2"``), one part;
  :meth:`~CheckpointReader.tensor_shape` and
  :meth:`~CheckpointReader.tensor_dtype` answer for both without reading data.
* fastckpt's reader contract (:class:`~fastckpt.formats.contract.TensorReader`):
  ``keys()`` are the stored keys, ``host(key)`` a zero-copy view of that part
  in its mapped file, so ``fastckpt.open(directory)`` and ``load_file`` work on
  it.

Every file is mapped and its header parsed when the reader opens; a part's
bytes are read only when touched.

>>> import numpy as np, tempfile, os
>>> from fastckpt.sharded import Saver
>>> out = os.path.join(tempfile.mkdtemp(), "c")
>>> _ = Saver(path=out, parallel=2, tensors={"w": np.arange(6.0).reshape(3, 2)}).save()
>>> r = CheckpointReader(out)
>>> r.tensor_names(), r.tensor_shape("w"), r.read_tensor("w/part_0_1")[2].tolist()
(['w'], (3, 2), [4.0, 5.0])
"""

from __future__ import annotations

import difflib
import os
from types import MappingProxyType
from typing import Mapping

import numpy as np

from fastckpt.errors import FormatError, IntegrityError, TensorNotFoundError
from fastckpt.formats.contract import MultiFileReader
from fastckpt.formats.hashing import blake3_file
from fastckpt.formats.reader import TensorFile, open_file
from fastckpt.info import TensorInfo
from fastckpt.progress import progress_from
from fastckpt.sharded.format import FORMAT, INDEX_FILE, read_metadata

__all__ = ["CheckpointReader"]


def _dtype(name: str, where: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        ext = getattr(ml_dtypes, name, None)
        if ext is None:
            raise FormatError(f"{where}: unknown dtype {name!r}") from None
        return np.dtype(ext)


class CheckpointReader(MultiFileReader):
    """Read a sharded checkpoint directory (see the module docs).

    ``verify=True`` checks every file's size and BLAKE3 hash against the manifest
    first (:meth:`verify` does it on demand).
    """

    format = FORMAT
    layout = "fastckpt"

    def __new__(cls, path=None, *args, **kwargs):
        # A directory in RecIS's own layout (an ``index`` file) is read by its subclass: fastckpt.sharded.recis.
        if cls is CheckpointReader and path is not None:
            from fastckpt.sharded import recis

            if recis.is_recis_directory(path):
                return super().__new__(recis.RecisCheckpointReader)
        return super().__new__(cls)

    def __init__(self, path: str | os.PathLike, *, verify: bool = False, backend: str = "mmap",
                 copy_on_write: bool = False, max_header_size: int | None = None):
        self.path = os.fspath(path)
        meta = read_metadata(self.path)
        self.manifest = meta["manifest"]
        self.descriptions: Mapping[str, dict] = MappingProxyType(meta["descriptions"])
        self.tensorkey: Mapping[str, str] = MappingProxyType(meta["tensorkey"])
        self._block_index = meta["index"]["block_index"]
        self._file_of_number = meta["index"]["files"]
        self._options = {"backend": backend, "copy_on_write": copy_on_write}
        self.files: dict[str, TensorFile] = {}
        self._closed = False
        # Whole tensors: original name -> stored keys in part order.
        parts: dict[str, list[tuple[int, str]]] = {}
        for key, name in self.tensorkey.items():
            parts.setdefault(name, []).append((self.descriptions[key]["part"][0], key))
        self._parts = {name: [k for _, k in sorted(p)] for name, p in sorted(parts.items())}
        for name, keys in self._parts.items():
            n = {self.descriptions[k]["part"][1] for k in keys}
            if len(n) != 1 or len(keys) != next(iter(n)):
                raise FormatError(f"{self.path}: tensor {name!r} has parts {keys}; expected part_0_n .. part_(n-1)_n")
        infos = {}
        try:
            for number in sorted(self._file_of_number):
                name = self._file_of_number[number]
                f = self.files[name] = open_file(os.path.join(self.path, name), **self._options)
                expected = {k for k, n in self._block_index.items() if n == number}
                if set(f.infos) != expected:
                    raise FormatError(f"{f.path}: holds tensors {sorted(set(f.infos) ^ expected)[:4]} that "
                                      f"{INDEX_FILE} does not place there (or misses ones it does)")
                for key, info in f.infos.items():
                    d = self.descriptions[key]
                    if info.shape != tuple(d["shape"]) or info.dtype != _dtype(d["dtype"], f"{self.path}: {key}"):
                        raise FormatError(f"{f.path}: tensor {key!r} is {info.dtype}{list(info.shape)}, the "
                                          f"description says {d['dtype']}{d['shape']}")
                    infos[key] = info
        except BaseException:
            self.close()
            raise
        self.infos: Mapping[str, TensorInfo] = MappingProxyType(infos)
        self.metadata = None
        if verify:
            problems = self.verify()
            if problems:
                raise IntegrityError(f"{self.path}: {problems[0]}" + (f" (and {len(problems) - 1} more)"
                                                                      if len(problems) > 1 else ""))

    # -- RecIS's API ----------------------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        """The original names of every tensor, sorted (a hashtable ``T`` gives ``T.id``, ``T.embedding``, slots)."""
        return list(self._parts)

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
        encoding = self.descriptions[key].get("encoding")
        return self.infos[key].dtype if encoding is None else _dtype(encoding["dtype"], f"{self.path}: {key}")

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
            return self.array(name)
        keys = self._parts[self._whole_name(name)]
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
        """``{table: {"dim", "dtype", "slots", "ids"}}`` from the manifest."""
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
    def file_of(self, key: str) -> TensorFile:
        """The mapped file holding stored key ``key``."""
        if key not in self._block_index:
            self._whole_name(key)  # raises, naming close matches
        if self._closed:
            raise ValueError(f"{self.path}: the reader is closed")
        return self.files[self._file_of_number[self._block_index[key]]]

    def host(self, key: str) -> np.ndarray:
        """Stored part ``key`` as a zero-copy, read-only view of its mapped file."""
        return self.file_of(key).host(key)

    def verify(self, *, progress=False) -> list[str]:
        """Every problem with the files' sizes and BLAKE3 hashes against the manifest (empty: all good).

        ``progress`` (``True`` for a bar, or ``callback(done, total, item)``:
        :mod:`fastckpt.progress`) counts the files' bytes (the manifest's sizes)
        as each file is checked.
        """
        problems = []
        files = sorted(self.manifest["files"].items())
        with progress_from(progress, sum(entry["size"] for _, entry in files), "verify") as report:
            for name, entry in files:
                problems += self._verify_file(name, entry)
                report.advance(entry["size"], name)
        return problems

    def _verify_file(self, name: str, entry: dict) -> list[str]:
        path = os.path.join(self.path, name)
        try:
            size = os.path.getsize(path)
        except OSError as exc:
            return [f"{name}: {exc.strerror or exc}"]
        if size != entry["size"]:
            return [f"{name}: {size} bytes, the manifest says {entry['size']}"]
        digest, _ = blake3_file(path)
        if digest != entry["blake3"]:
            return [f"{name}: BLAKE3 {digest[:16]}..., the manifest says {entry['blake3'][:16]}..."]
        return []

    def __repr__(self) -> str:
        return (f"<fastckpt.sharded.CheckpointReader {self.path!r} world_size={self.manifest['world_size']} "
                f"tensors={len(self._parts)}{' closed' if self._closed else ''}>")
