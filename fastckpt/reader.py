"""One read-only API over NPZ and safetensors files: ``fastckpt.open``.

The file is mapped once; the format is detected from its first bytes (never
from its name); the index is parsed by the Cython parsers; ``host(name)``
returns a zero-copy, read-only numpy view of a tensor's bytes in the mapping.

>>> import fastckpt, numpy as np, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "model.bin")
>>> fastckpt.save_npz(path, {"w": np.ones((2, 2), np.float16)})
>>> with fastckpt.open(path) as f:
...     f.format, f.info("w").shape, f.host("w").dtype
('npz', (2, 2), dtype('float16'))
"""

from __future__ import annotations

import os
from typing import Iterator, Mapping

import numpy as np

from fastckpt._info import TensorInfo
from fastckpt._mapped import MappedFile
from fastckpt.errors import FormatError, TensorNotFoundError

__all__ = ["open", "TensorFile", "detect_format"]

_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06", b"PK\x06\x06")


def detect_format(head: bytes) -> str | None:
    """Name the format of a file from its first 9 bytes: ``"npz"``, ``"safetensors"`` or None.

    >>> detect_format(b"PK\\x03\\x04")
    'npz'
    >>> detect_format((2).to_bytes(8, "little") + b"{}")
    'safetensors'
    """
    # safetensors first: a header length of 0x04034B50 starts with the ZIP magic, while no ZIP
    # start has "{" at byte 8 (there a local header's compression method, 123, does not exist).
    if len(head) >= 9 and head[8:9] == b"{":
        return "safetensors"
    if head[:4] in _ZIP_MAGICS:
        return "npz"
    return None


class TensorFile(Mapping):
    """A mapped tensor file: names, per-tensor info, zero-copy host views, metadata.

    Obtain one with :func:`fastckpt.open`. It is a read-only mapping from tensor
    name to a numpy view; views stay valid after :meth:`close`.

    >>> import fastckpt, numpy as np, tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "m.npz")
    >>> fastckpt.save_npz(p, {"b": np.zeros(2, np.int8), "a": np.ones(3, np.float32)})
    >>> with fastckpt.open(p) as f:
    ...     w = f["a"]
    ...     list(f), f.info("a").aligned(4096), f.data_region[0] % 4096
    (['b', 'a'], True, 0)
    >>> w.tolist()
    [1.0, 1.0, 1.0]
    """

    def __init__(self, mapped: MappedFile, fmt: str, infos: list[TensorInfo], metadata):
        self.mapped = mapped
        self.format = fmt
        self.metadata = metadata
        self.infos: dict[str, TensorInfo] = {i.name: i for i in sorted(infos, key=lambda i: i.offset)}

    # -- description ---------------------------------------------------------------------------
    @property
    def path(self) -> str:
        """The path the file was opened from."""
        return self.mapped.path

    def info(self, name: str) -> TensorInfo:
        """The :class:`~fastckpt.TensorInfo` of ``name`` (``TensorNotFoundError``, a KeyError, if absent)."""
        try:
            return self.infos[name]
        except KeyError:
            raise TensorNotFoundError(self._missing(name)) from None

    def _missing(self, name: str) -> str:
        names = list(self.infos)
        shown = ", ".join(repr(n) for n in names[:8]) + (", ..." if len(names) > 8 else "")
        return f"{self.path}: no tensor named {name!r} ({len(names)} tensors: {shown})"

    @property
    def data_region(self) -> tuple[int, int]:
        """``(start, end)``: the smallest byte range of the file holding every zero-copy payload.

        The device loader copies this range once; tensors are views into it.
        ``(0, 0)`` when the file holds no zero-copy tensor.
        """
        spans = [(i.offset, i.offset + i.nbytes) for i in self.infos.values() if i.zero_copy]
        if not spans:
            return (0, 0)
        return (min(s for s, _ in spans), max(e for _, e in spans))

    @property
    def nbytes(self) -> int:
        """Total payload bytes of all tensors as stored."""
        return sum(i.nbytes for i in self.infos.values())

    # -- data ------------------------------------------------------------------------------------
    def host(self, name: str) -> np.ndarray:
        """The tensor as a numpy array: a zero-copy read-only view of the mapping where the
        layout allows (stored, uncompressed), else a decoded copy (the NPZ parser's
        :class:`~fastckpt.errors.NotZeroCopyWarning` at :func:`open` said so)."""
        info = self.info(name)
        if info.compression is None:
            order = "F" if info.fortran_order else "C"
            return self.mapped.array(info.offset, info.dtype, info.shape, order=order, what=f"tensor {name!r}")
        from fastckpt import npz

        return npz.read_member(self.mapped, info)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.host(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.infos)

    def __len__(self) -> int:
        return len(self.infos)

    def __contains__(self, name: object) -> bool:
        return name in self.infos

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the mapping handle (idempotent); views already made stay valid."""
        self.mapped.close()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run (views made before stay valid)."""
        return self.mapped.closed

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<Closed fastckpt.TensorFile>"
        return f"<fastckpt.TensorFile {self.path!r} format={self.format} tensors={len(self)}>"


def open(path: str | os.PathLike, *, backend: str = "mmap", copy_on_write: bool = False,  # noqa: A001
         max_header_size: int | None = None) -> TensorFile:
    """Map ``path`` and parse its index; the format (NPZ or safetensors) is detected from its bytes.

    ``backend="pread"`` reads instead of mapping (for filesystems that cannot
    map); ``copy_on_write=True`` makes views writable and private (the file
    never changes). ``max_header_size`` raises the cap on each NPZ member's
    ``.npy`` header (default 10000 characters, numpy's cap); only for trusted
    files, whose headers are longer (structured dtypes with many fields).
    safetensors headers have the format's own fixed cap (100 MB).

    >>> import fastckpt, numpy as np, tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "t.safetensors")
    >>> fastckpt.save_safetensors(p, {"a": np.arange(3, dtype=np.int32)}, metadata={"step": "7"})
    >>> f = fastckpt.open(p)
    >>> list(f), f.metadata, f["a"].tolist()
    (['a'], {'step': '7'}, [0, 1, 2])
    """
    if max_header_size is not None and (type(max_header_size) is not int or max_header_size < 1):
        raise ValueError(f"max_header_size must be a positive int or None, got {max_header_size!r}")
    mapped = MappedFile(path, backend=backend, copy_on_write=copy_on_write)
    try:
        head = mapped.read(0, min(9, mapped.size), "format magic")
        fmt = detect_format(head)
        if fmt == "npz":
            from fastckpt._npz import read_npz_index

            kw = {} if max_header_size is None else {"max_header_size": max_header_size}
            infos, metadata = read_npz_index(mapped, **kw), None
        elif fmt == "safetensors":
            from fastckpt._safetensors import read_safetensors_index

            infos, metadata, _data_start = read_safetensors_index(mapped)
        else:
            raise FormatError(
                f"{mapped.path}: not an NPZ (ZIP) or safetensors file: first bytes are {head!r} "
                "(expected b'PK\\x03\\x04' for NPZ, or an 8-byte little-endian header length followed by '{' "
                "for safetensors; TensorFlow checkpoints open with fastckpt.tf.CheckpointReader)"
            )
    except BaseException:
        mapped.close()
        raise
    return TensorFile(mapped, fmt, infos, metadata)
