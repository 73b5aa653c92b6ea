"""State: the one protocol by which checkpoints read objects' state, and the one codec that writes it.

* :mod:`fastckpt.state.protocol` - :class:`Stateful` and the single lookup
  order (``numpy.random.Generator``, then ``state_dict()`` /
  ``load_state_dict()``, then ``get_state()`` / ``set_state()``);
* :mod:`fastckpt.state.codec` - state trees to JSON-safe trees and back, in
  the dialect of each on-disk format;
* :mod:`fastckpt.state.arrays` - arrays from any framework, and their inline
  tagged form.

>>> import numpy as np
>>> from fastckpt.state import STATEFUL_JSON, decode, encode, state_of
>>> tree = encode(state_of(np.random.default_rng(7)), STATEFUL_JSON)
>>> decode(tree, STATEFUL_JSON)["bit_generator"]
'PCG64'
"""

from fastckpt.state.arrays import as_numpy, decode_array, dtype_token, encode_array, parse_dtype
from fastckpt.state.codec import (
    PARAM_SIDECAR,
    STATEFUL_JSON,
    TRAIN_TREE,
    Dialect,
    StateObject,
    decode,
    dumps,
    encode,
)
from fastckpt.state.protocol import (
    LOOKUP_ORDER,
    Stateful,
    accessors,
    as_stateful,
    check_state,
    is_stateful,
    load_state,
    state_of,
)

__all__ = [
    "Stateful", "LOOKUP_ORDER", "accessors", "as_stateful", "is_stateful", "state_of", "load_state", "check_state",
    "Dialect", "TRAIN_TREE", "STATEFUL_JSON", "PARAM_SIDECAR", "encode", "decode", "dumps", "StateObject",
    "as_numpy", "dtype_token", "parse_dtype", "encode_array", "decode_array",
]
