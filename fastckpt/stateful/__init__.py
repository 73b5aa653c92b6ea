"""Stateful objects whose state can be checkpointed and resumed exactly.

* :class:`RNG` - a numpy-backed random number generator with
  ``get_state`` / ``set_state`` that continues its stream bit-exactly;
  :class:`GlobalRNG` - Python's, numpy's and torch's global generators as one;
* :class:`ArrayReader`, :class:`FileReader` - sharded, optionally shuffled
  batch readers that resume at the exact next batch, mid-epoch too;
* :class:`Checkpoint` - collects, saves (atomically), loads and restores the
  state of registered objects: these, or anything with ``get_state`` /
  ``set_state`` or ``state_dict`` / ``load_state_dict``; :func:`current`
  returns the one bound to the current context.

>>> from fastckpt.stateful import RNG, Checkpoint
>>> ckpt = Checkpoint()
>>> ckpt.register(RNG(seed=42), "rng")
'rng'

The JSON file format is specified in :mod:`fastckpt.stateful.checkpoint`.
"""

from __future__ import annotations

from fastckpt.state import StateObject
from fastckpt.stateful.checkpoint import (
    FORMAT_VERSION,
    Checkpoint,
    CheckpointKeyError,
    checkpoint_scope,
    current,
    register_migration,
)
from fastckpt.stateful.readers import ArrayReader, FileReader, Reader, ReaderState, epoch_order
from fastckpt.stateful.rng import RNG, GlobalRNG, RNGState

__all__ = [
    "RNG",
    "RNGState",
    "GlobalRNG",
    "Reader",
    "ReaderState",
    "ArrayReader",
    "FileReader",
    "epoch_order",
    "Checkpoint",
    "CheckpointKeyError",
    "current",
    "checkpoint_scope",
    "register_migration",
    "FORMAT_VERSION",
    "StateObject",
]
