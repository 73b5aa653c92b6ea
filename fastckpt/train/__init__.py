"""Training-state checkpoints that resume byte for byte, and reference state machines to go with them.

``save_checkpoint`` / ``load_checkpoint`` / ``apply_checkpoint`` write and
restore the model, optimizer, scheduler, data iterator, training RNG (and loss
scaler) as one atomic directory; ``CheckpointManager`` keeps a series of them
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

# name -> defining module; imported on first use.
_LAZY = {
    "save_checkpoint": "fastckpt.train.checkpoint",
    "load_checkpoint": "fastckpt.train.checkpoint",
    "apply_checkpoint": "fastckpt.train.checkpoint",
    "verify_checkpoint": "fastckpt.train.checkpoint",
    "read_manifest": "fastckpt.train.checkpoint",
    "weights_digest": "fastckpt.train.checkpoint",
    "CheckpointState": "fastckpt.train.checkpoint",
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
