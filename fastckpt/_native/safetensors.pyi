# Types of the compiled module safetensors.pyx.
from collections.abc import Callable, Mapping

import numpy as np

from fastckpt._native.gather import GatherWriter
from fastckpt._native.mapped import MappedFile
from fastckpt._native.tensorindex import TensorIndex
from fastckpt.info import TensorInfo

# One tensor as plan_tensors plans it: a tuple private to the writer (fastckpt.formats.safetensors).
_Plan = tuple[object, ...]

MAX_HEADER_SIZE: int
DTYPE_NAMES: tuple[str, ...]
DTYPE_RANK: dict[str, int]
NUMPY_DTYPES: dict[str, np.dtype]
SUB_BYTE_DTYPES: dict[str, int]

def unsupported_dtype_message(name: str) -> str: ...
def read_safetensors_index(m: MappedFile) -> tuple[list[TensorInfo], dict[str, str] | None, int]: ...
def read_safetensors_table(m: MappedFile) -> tuple[TensorIndex, dict[str, str] | None, int]: ...
def plan_tensors(tensors: Mapping[str, object], fast_dtypes: dict[np.dtype, tuple[str, int]],
                 slow_plan: Callable[[object, object, int], _Plan]) -> list[_Plan]: ...
def header_text(plan: list[_Plan], metadata_json: str | None) -> bytes: ...
def write_tensors(out: GatherWriter, plan: list[_Plan], direct_dtypes: frozenset[np.dtype],
                  write_one: Callable[[_Plan], None]) -> None: ...
