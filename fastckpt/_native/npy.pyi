# Types of the compiled module npy.pyx.
from typing_extensions import Buffer

import numpy as np

MAX_HEADER_SIZE: int
NPY_MAGIC: bytes
MAX_NDIM: int
MAX_LITERAL_DEPTH: int
MAX_INT_DIGITS: int
MAX_INTP: int

def npy_header_length(prefix: Buffer, where: object = "", max_header_size: int = ...) -> int: ...
def parse_npy_header(data: Buffer, where: object = "",
                     max_header_size: int = ...) -> tuple[np.dtype, tuple[int, ...], bool, int]: ...
def _descr_to_dtype(descr: object, where: object, depth: int = 0) -> np.dtype: ...
