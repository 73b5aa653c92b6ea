"""A snapshot: every piece of a training run's state, taken at one instant, ready to be written.

States are read out of the objects by the one lookup order of
:mod:`fastckpt.state.protocol` and encoded at once (arrays into the tensor
tables, the rest into JSON), so the trainer may go on changing the objects
while an asynchronous save writes the snapshot.

>>> import numpy as np
>>> from fastckpt.train import TinyLM
>>> snap = take_snapshot(TinyLM(vocab=4, dim=2, hidden=2), None, None, None, np.random.default_rng(0),
...                      step=1, epoch=0, metrics=None)
>>> sorted(snap.weights.tensors)[:2], snap.optim is None
(['embed.weight', 'fc1.bias'], True)
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from fastckpt.state import load_state
from fastckpt.state import state_of as _protocol_state_of
from fastckpt.train.format import (
    CHECKPOINT_FORMAT,
    FILE_SCHEMA_VERSION,
    SCHEMA_VERSION,
    ArrayTable,
    _canonical_hash,
    _dumps,
    encode_tree,
)

__all__ = ["Snapshot", "take_snapshot", "state_of", "restore_into"]


def state_of(obj: Any) -> Any:
    """The state of one state machine (None for None), by the lookup order of :mod:`fastckpt.state.protocol`."""
    return None if obj is None else _protocol_state_of(obj)


def restore_into(obj: Any, state: Any, what: str) -> None:
    """Put ``state`` back into ``obj`` (the inverse of :func:`state_of`); never reseeds an RNG."""
    if obj is None:
        return
    if state is None:
        raise ValueError(f"apply_checkpoint: the checkpoint holds no {what} state, but a {what} was given; pass None for it")
    load_state(obj, state)


@dataclass
class Snapshot:
    """The complete content of one checkpoint, detached from the live objects when staged."""

    weights: ArrayTable
    weights_tree: str
    optim: ArrayTable | None
    optim_tree: str | None
    extra_json: bytes
    manifest: dict[str, Any]


_GIT_COMMIT: list[str | None] = []


def _git_commit() -> str | None:
    if not _GIT_COMMIT:
        commit = os.environ.get("FASTCKPT_GIT_COMMIT")
        if commit is None:
            try:
                out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False)
                commit = out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None
            except (OSError, subprocess.SubprocessError):
                commit = None
        _GIT_COMMIT.append(commit)
    return _GIT_COMMIT[0]


def _versions() -> dict[str, str]:
    from fastckpt import __version__

    out = {"python": platform.python_version(), "numpy": np.__version__, "fastckpt": __version__}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = str(getattr(torch, "__version__", "unknown"))
    return out


def _hardware() -> dict[str, Any]:
    return {"machine": platform.machine(), "system": platform.system(), "processor": platform.processor(),
            "cpu_count": os.cpu_count()}


def _plain_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    # Metrics are for people and retention policies: numpy numbers become plain JSON numbers
    # (float32 -> float is exact).
    out = {}
    for key, value in dict(metrics or {}).items():
        if isinstance(value, np.generic) and value.dtype.kind in "biuf":
            value = value.item()
        out[key] = value
    return out


def take_snapshot(model: Any, optimizer: Any, scheduler: Any, data_iter: Any, train_rng: Any, *,
                  step: int, epoch: int, metrics: Mapping[str, Any] | None, scaler: Any = None,
                  seed: int | None = None, config: Any = None, data_manifest: Any = None,
                  stage: Callable[[np.ndarray], np.ndarray] | None = None) -> Snapshot:
    """Capture every piece of state. With ``stage`` (copy arrays) the snapshot no longer depends on the objects."""
    if model is None:
        raise TypeError("save_checkpoint: a model is required")
    if type(step) is not int and not isinstance(step, np.integer):
        raise TypeError(f"save_checkpoint: step must be an int, got {step!r}")
    weights = ArrayTable(stage)
    weights_tree = _dumps(encode_tree(state_of(model), weights, "model"))
    weights.seal()
    optim = optim_tree = None
    if optimizer is not None:
        optim = ArrayTable(stage)
        optim_tree = _dumps(encode_tree(state_of(optimizer), optim, "optimizer"))
        optim.seal()
    # Python state is serialized now: later mutation by the trainer cannot reach the checkpoint.
    extra = {
        "format": "fastckpt.train.extra",
        "schema_version": FILE_SCHEMA_VERSION,
        "scheduler": encode_tree(state_of(scheduler), None, "scheduler"),
        "data_iter": encode_tree(state_of(data_iter), None, "data_iter"),
        "train_rng": encode_tree(state_of(train_rng), None, "train_rng"),
        "scaler": encode_tree(state_of(scaler), None, "scaler"),
    }
    extra_json = json.dumps(extra, indent=1, ensure_ascii=False, allow_nan=False).encode("utf-8")
    if config is None:
        config_source = "derived"
        config = {
            "model": type(model).__qualname__,
            "weights": {k: [v.dtype.str, list(v.shape)] for k, v in weights.tensors.items()},
            "aliases": dict(weights.aliases),
            **{name: (type(o).__qualname__ if o is not None else None)
               for name, o in (("optimizer", optimizer), ("scheduler", scheduler), ("data_iter", data_iter),
                               ("train_rng", train_rng), ("scaler", scaler))},
        }
    else:
        config_source = "given"
    if data_manifest is None and data_iter is not None and hasattr(data_iter, "data_manifest"):
        data_manifest = data_iter.data_manifest()
    manifest = {
        "format": CHECKPOINT_FORMAT,
        "schema_version": SCHEMA_VERSION,
        "step": int(step),
        "epoch": int(epoch),
        "metrics": encode_tree(_plain_metrics(metrics), None, "metrics"),
        "seed": None if seed is None else int(seed),
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
        "versions": _versions(),
        "config_hash": _canonical_hash(config),
        "config_source": config_source,
        "data_manifest_hash": None if data_manifest is None else _canonical_hash(data_manifest),
        "git_commit": _git_commit(),
        "hardware": _hardware(),
    }
    return Snapshot(weights, weights_tree, optim, optim_tree, extra_json, manifest)
