"""What a reader knows about one stored tensor, whatever the file format."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

__all__ = ["TensorInfo", "PackedTensorInfo", "from_checked_fields"]

_new = object.__new__
_set = object.__setattr__


def from_checked_fields(cls, fields: dict):
    """An instance of the frozen dataclass ``cls`` (``TensorInfo`` or a subclass) from ``fields``.

    For the parsers, which have already checked every value: it skips the
    generated ``__init__`` (about 1.5 µs of a file's open time per tensor).
    ``fields`` must name every field exactly once.

    >>> import numpy as np
    >>> a = from_checked_fields(TensorInfo, dict(name="w", dtype=np.dtype("<f4"), shape=(2,), offset=64,
    ...                                          nbytes=8, fortran_order=False, compression=None))
    >>> a == TensorInfo("w", np.dtype("<f4"), (2,), 64, 8)
    True
    """
    obj = _new(cls)
    _set(obj, "__dict__", fields)
    return obj


@dataclass(frozen=True)
class TensorInfo:
    """One tensor in a file: its name, type, shape and where its bytes are.

    ``offset`` is the absolute byte offset of the payload in the file and
    ``nbytes`` its stored length (the compressed length for a DEFLATE member).

    >>> import numpy as np
    >>> info = TensorInfo("w", np.dtype("<f4"), (2, 3), offset=4096, nbytes=24)
    >>> info.alignment, info.zero_copy
    (4096, True)
    """

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    fortran_order: bool = False
    compression: str | None = None  # None (stored as is) or "deflate"
    #: The safetensors name of a packed sub-byte type (``"F4"``, ``"F6_E2M3"``, ``"F6_E3M2"``), else None:
    #: see :class:`PackedTensorInfo`.
    packed: ClassVar[str | None] = None

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def zero_copy(self) -> bool:
        """True when the payload can be viewed in place (not compressed, not packed)."""
        return self.compression is None and self.packed is None

    @property
    def alignment(self) -> int:
        """Largest power of two (up to 4096) that divides the payload offset."""
        if self.offset == 0:
            return 4096
        return min(self.offset & -self.offset, 4096)

    def aligned(self, boundary: int) -> bool:
        """True when the payload offset is a multiple of ``boundary``."""
        return self.offset % boundary == 0


@dataclass(frozen=True)
class PackedTensorInfo(TensorInfo):
    """A tensor whose elements are narrower than a byte (safetensors ``F4``, ``F6_E2M3``, ``F6_E3M2``).

    ``dtype`` is the ml_dtypes element type (``float4_e2m1fn``,
    ``float6_e2m3fn``, ``float6_e3m2fn``: one element per byte in memory),
    ``shape`` the logical shape (elements), and ``nbytes`` the stored bytes:
    ``size * bits / 8``, the elements packed back to back across rows. No
    numpy array views such bytes in place; a reader's ``host()`` gives them as
    a :class:`fastckpt.arrays.PackedArray`.

    >>> import ml_dtypes, numpy as np
    >>> info = PackedTensorInfo("q", np.dtype(ml_dtypes.float4_e2m1fn), (2, 3), 64, 3, packed="F4")
    >>> info.bits, info.zero_copy, info.size
    (4, False, 6)
    """

    packed: str = "F4"  # type: ignore[misc]

    @property
    def bits(self) -> int:
        """Bits per element."""
        return 4 if self.packed == "F4" else 6
