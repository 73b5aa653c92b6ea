"""Training-state checkpoints that resume byte for byte, and reference state machines to go with them.

``save_checkpoint`` / ``load_checkpoint`` / ``apply_checkpoint`` write and
restore the model, optimizer, scheduler, data iterator, training RNG (and loss
scaler), each slot any training-state shape (objects, dicts and lists of them,
pytrees), as one atomic directory, restored all or nothing (``strict=False``:
a subset, with a :class:`RestoreReport`); ``CheckpointManager`` keeps a series of them
with retention policies and asynchronous saves. The optimizers, schedulers,
scaler, data iterator and ``TinyLM`` re-exported here are the reference
trainer of :mod:`fastckpt.train.reference`, whose state round-trips exactly.
The directory format is specified in :mod:`fastckpt.train.format`.

>>> from fastckpt.train import CheckpointManager, TinyLM, AdamW
>>> TinyLM(vocab=8, dim=4, hidden=8).tied
True
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# name -> defining module; imported on first use.
_LAZY = {
    "save_checkpoint": "fastckpt.train.checkpoint",
    "load_checkpoint": "fastckpt.train.checkpoint",
    "apply_checkpoint": "fastckpt.train.checkpoint",
    "verify_checkpoint": "fastckpt.train.checkpoint",
    "read_manifest": "fastckpt.train.checkpoint",
    "weights_digest": "fastckpt.train.checkpoint",
    "CheckpointState": "fastckpt.train.checkpoint",
    "RestoreReport": "fastckpt.train.snapshot",
    "CheckpointManager": "fastckpt.train.manager",
    "SaveHandle": "fastckpt.train.asyncsave",
    "AsyncCheckpointer": "fastckpt.train.asyncsave",
    "SGD": "fastckpt.train.reference.optim",
    "Adam": "fastckpt.train.reference.optim",
    "AdamW": "fastckpt.train.reference.optim",
    "StepLR": "fastckpt.train.reference.sched",
    "CosineWarmupLR": "fastckpt.train.reference.sched",
    "ReduceLROnPlateau": "fastckpt.train.reference.sched",
    "GradScaler": "fastckpt.train.reference.scaler",
    "ShuffledTokenBatches": "fastckpt.train.reference.data",
    "Parameter": "fastckpt.train.reference.model",
    "TinyLM": "fastckpt.train.reference.model",
    "train_step": "fastckpt.train.reference.model",
}

if TYPE_CHECKING:  # the lazy names above as type checkers see them (`X as X`: re-exported)
    from fastckpt.train.asyncsave import SaveHandle as SaveHandle, AsyncCheckpointer as AsyncCheckpointer
    from fastckpt.train.checkpoint import (
        save_checkpoint as save_checkpoint,
        load_checkpoint as load_checkpoint,
        apply_checkpoint as apply_checkpoint,
        verify_checkpoint as verify_checkpoint,
        read_manifest as read_manifest,
        weights_digest as weights_digest,
        CheckpointState as CheckpointState,
    )
    from fastckpt.train.manager import CheckpointManager as CheckpointManager
    from fastckpt.train.snapshot import RestoreReport as RestoreReport
    from fastckpt.train.reference.data import ShuffledTokenBatches as ShuffledTokenBatches
    from fastckpt.train.reference.model import Parameter as Parameter, TinyLM as TinyLM, train_step as train_step
    from fastckpt.train.reference.optim import SGD as SGD, Adam as Adam, AdamW as AdamW
    from fastckpt.train.reference.scaler import GradScaler as GradScaler
    from fastckpt.train.reference.sched import (
        StepLR as StepLR,
        CosineWarmupLR as CosineWarmupLR,
        ReduceLROnPlateau as ReduceLROnPlateau,
    )

__all__ = list(_LAZY)


def __getattr__(name: str):
    try:
        module = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'fastckpt.train' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
