# Types of the compiled module npz.pyx.
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from fastckpt._native.gather import GatherWriter
from fastckpt._native.mapped import MappedFile
from fastckpt._native.tensorindex import TensorIndex
from fastckpt.info import TensorInfo

__all__ = ["read_npz_index", "read_npz_table", "NpzTensorInfo", "member_name_problem"]

MAX_HEADER_SIZE: int
USUAL_HEADER_NBYTES: int
METHOD_STORED: int
METHOD_DEFLATED: int

@dataclass(frozen=True)
class NpzTensorInfo(TensorInfo):
    crc32: int = 0
    member_nbytes: int = 0
    header_nbytes: int = 0

def member_name_problem(name: str) -> str | None: ...
def read_npz_index(m: MappedFile, *, max_header_size: int = ...) -> list[NpzTensorInfo]: ...
def read_npz_table(m: MappedFile, *, max_header_size: int = ...) -> TensorIndex: ...

class _Inflater:
    def __init__(self, m: MappedFile, start: int, length: int, what: object) -> None: ...
    def prefix(self, want: int) -> bytes: ...

class MemberWriter:
    @property
    def pos(self) -> int: ...
    @property
    def count(self) -> int: ...
    @property
    def crc_patches(self) -> list[tuple[int, int]]: ...
    @property
    def broken(self) -> bool: ...
    def __init__(self, out: GatherWriter, alignment: int, zip64_limit: int, crc32: Callable[[bytes, int], int],
                 npy_header: Callable[[np.dtype, tuple[int, ...], bool], bytes],
                 large_payload: Callable[[GatherWriter, np.ndarray, int], int], large_min: int,
                 small_alignment: int = 0, small_below: int = 0, crc32_address: int = 0) -> None: ...
    def add_items(self, items: Iterable[tuple[str, object]], batch: bool, as_array: Callable[[object, str], np.ndarray],
                  unique_names: Mapping[str, object] | None = None) -> None: ...
    def add(self, name: str, arr: np.ndarray) -> tuple[int, bytes, int, bool, int]: ...
    @property
    def central_directory(self) -> bytes: ...
