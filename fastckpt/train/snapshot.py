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
import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from fastckpt.arrays import as_numpy
from fastckpt.state import accessors, check_state, is_stateful
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

__all__ = ["Snapshot", "take_snapshot", "state_of", "RestoreReport", "plan_restore", "apply_restore"]


def state_of(obj: Any, what: str = "state") -> Any:
    """The state of one slot of a checkpoint (None for None): any *training-state shape*.

    A slot holds a stateful object (its state by the lookup order of
    :mod:`fastckpt.state.protocol`: a model, an optimizer, an RNG, ...), or a
    dict, list or tuple of slots (several models, a second optimizer, an EMA
    copy under its own name), or a leaf of a pytree: an array (numpy, torch,
    anything :mod:`fastckpt.arrays` takes), a Python or numpy number, a
    string, bytes or None. Anything else is refused, naming its path.

    >>> import numpy as np
    >>> state_of({"opt": [np.random.default_rng(0)], "ema": {"w": np.zeros(2)}, "step": 3})["opt"][0]["bit_generator"]
    'PCG64'
    >>> state_of({"f": print}, "model")
    Traceback (most recent call last):
    ...
    TypeError: model['f'] (a builtins.builtin_function_or_method) cannot be checkpointed: ...
    """
    if obj is None:
        return None
    if is_stateful(obj):
        return _protocol_state_of(obj)
    if isinstance(obj, Mapping):
        return {key: state_of(value, f"{what}[{key!r}]") for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [state_of(value, f"{what}[{i}]") for i, value in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    if _is_leaf(obj):
        return obj
    raise TypeError(f"{what} (a {type(obj).__module__}.{type(obj).__qualname__}) cannot be checkpointed: it needs "
                    "state_dict()/load_state_dict(state) or get_state()/set_state(state), or to be an array, a "
                    "number, a string or None; several objects go in a dict or a list")


def _is_leaf(value: Any) -> bool:
    """An array or a scalar: what a pytree holds at its leaves (told by its type, without converting it)."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, np.generic, np.ndarray)):
        return True
    if isinstance(value, (Mapping, list, tuple)):
        return False
    if any(hasattr(value, attr) for attr in ("to_host", "__dlpack__", "__array__")):
        return True
    try:
        memoryview(value)
    except TypeError:
        return False
    return True


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, (str, bytes))


# ---------------------------------------------------------------------------------------------
# Restoring: plan (decode and check everything), then apply (all or nothing)
# ---------------------------------------------------------------------------------------------
@dataclass
class RestoreReport:
    """What a restore did: the paths restored, those the objects had and the checkpoint lacked (``missing``),
    and those the checkpoint had and the objects lacked (``unexpected``).

    Paths name a slot and the keys below it: ``model``, ``model['ema']``,
    ``model['head.weight']`` (a key of a model's state), ``optimizer[1]``.
    With ``strict=True`` (the default) a restore with anything missing or
    unexpected is refused, so the report lists only what was restored.

    >>> RestoreReport(["model"], ["model['head.bias']"], []).complete
    False
    """

    restored: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """True when nothing was missing and nothing unexpected."""
        return not self.missing and not self.unexpected


@dataclass
class _Step:
    """One object (or one pytree leaf) to restore, with what it needs."""

    path: str
    apply: Callable[[], None]
    backup: Callable[[], Callable[[], None]] | None  # takes a copy now; returns how to put it back
    weights: bool = False  # a state checked key by key and shape by shape: applied last, without a copy


def plan_restore(slots: list[tuple[str, Any, Any]], strict: bool) -> tuple[list[_Step], RestoreReport]:
    """Decode and check every ``(name, object, state)`` slot; nothing is changed.

    Raises ``ValueError`` / ``TypeError`` naming the path of the first state
    that does not fit. Returns the steps of the restore, in the order to apply
    them, and the report.
    """
    report = RestoreReport()
    steps: list[_Step] = []
    for name, obj, state in slots:
        _plan(obj, state, name, strict, report, steps, parent=None)
    steps.sort(key=lambda step: step.weights)  # stable: the weights last
    return steps, report


def apply_restore(steps: list[_Step]) -> None:
    """Apply planned steps in order; when one fails, undo the ones applied (copies taken just before) and raise.

    Every step but a last one whose state was checked in full (a model's
    weights, key by key and shape by shape) has a copy of what it replaces,
    taken just before it is applied: the restore is all or nothing at the
    price of holding those copies while it runs.
    """
    undo: list[tuple[str, Callable[[], None]]] = []
    for i, step in enumerate(steps):
        backup = None if i == len(steps) - 1 and step.weights else step.backup
        copied = backup is not None
        try:
            if backup is not None:
                undo.append((step.path, backup()))
            step.apply()
        except Exception as exc:
            failed = []
            for path, put_back in reversed(undo):
                try:
                    put_back()
                except Exception as again:  # noqa: BLE001 - reported on the error being raised
                    failed.append(f"{path} ({again!r})")
            if failed:
                exc.add_note(f"while restoring {step.path}; could not undo {', '.join(failed)}")
            elif copied:
                exc.add_note(f"while restoring {step.path}; nothing was changed (it and the {len(undo) - 1} "
                             f"state{'s' if len(undo) != 2 else ''} applied before it put back from copies)")
            else:
                exc.add_note(f"while restoring {step.path} (checked in full, restored without a copy: it may be "
                             f"partly restored); the {len(undo)} states applied before it were put back")
            raise


def _plan(obj: Any, state: Any, path: str, strict: bool, report: RestoreReport, steps: list[_Step],
          parent: tuple[Any, Any] | None) -> None:
    if obj is None and parent is None:
        return  # a slot not asked for
    if state is None and not (parent is not None and _is_leaf(obj)):
        if strict:
            raise ValueError(f"the checkpoint holds no {path} state, but one was given; pass None for it "
                             "(or strict=False to restore the rest)")
        report.missing.append(path)
        return
    if obj is not None and is_stateful(obj):
        steps.append(_object_step(obj, state, path, strict, report))
        report.restored.append(path)
        return
    if isinstance(obj, Mapping):
        if not isinstance(state, Mapping):
            raise TypeError(f"{path}: the checkpoint holds a {type(state).__name__} here, the object a dict")
        for key in state:
            if key not in obj:
                if strict:
                    raise ValueError(f"{path}: the checkpoint holds {key!r}, which the given dict lacks (keys: "
                                     f"{list(obj)[:8]}); strict=False restores the rest")
                report.unexpected.append(f"{path}[{key!r}]")
        for key, value in obj.items():
            if key not in state:
                if strict:
                    raise ValueError(f"{path}: the given dict has {key!r}, which the checkpoint lacks (keys: "
                                     f"{list(state)[:8]}); strict=False restores the rest")
                report.missing.append(f"{path}[{key!r}]")
                continue
            _plan(value, state[key], f"{path}[{key!r}]", strict, report, steps, parent=(obj, key))
        return
    if isinstance(obj, (list, tuple)):
        if not isinstance(state, (list, tuple)):
            raise TypeError(f"{path}: the checkpoint holds a {type(state).__name__} here, the object a "
                            f"{type(obj).__name__}")
        if len(state) != len(obj):
            if strict:
                raise ValueError(f"{path}: the checkpoint holds {len(state)} entries, the given "
                                 f"{type(obj).__name__} {len(obj)}; strict=False restores the first "
                                 f"{min(len(obj), len(state))}")
            report.missing += [f"{path}[{i}]" for i in range(len(state), len(obj))]
            report.unexpected += [f"{path}[{i}]" for i in range(len(obj), len(state))]
        for i, (value, saved) in enumerate(zip(obj, state)):
            _plan(value, saved, f"{path}[{i}]", strict, report, steps, parent=(obj, i))
        return
    if _is_leaf(obj) and parent is not None:
        steps.append(_leaf_step(obj, state, path, parent))
        report.restored.append(path)
        return
    state_of(obj, path)  # raises the TypeError that names what cannot be restored


def _object_step(obj: Any, state: Any, path: str, strict: bool, report: RestoreReport) -> _Step:
    get, put = accessors(obj)
    try:
        check_state(obj, state)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    weights = False
    current = get()
    if isinstance(current, Mapping) and current and all(_is_array(v) for v in current.values()):
        # A model's state: names and shapes are checked here, so that its load cannot fail half-way.
        if not isinstance(state, Mapping):
            raise TypeError(f"{path}: the checkpoint holds a {type(state).__name__}, the object a state dict")
        missing = [k for k in current if k not in state]
        unexpected = [k for k in state if k not in current]
        if strict and (missing or unexpected):
            raise ValueError(f"{path}: the checkpoint lacks {missing[:5]} ({len(missing)}) and has "
                             f"{unexpected[:5]} ({len(unexpected)}) that the object lacks; strict=False "
                             "restores the names both have")
        report.missing += [f"{path}[{k!r}]" for k in missing]
        report.unexpected += [f"{path}[{k!r}]" for k in unexpected]
        if missing or unexpected:
            state = {k: state[k] if k in state else current[k] for k in current}
        weights = True
    _check_shapes(current, state, path)

    def backup() -> Callable[[], None]:
        saved = _copied(get())
        return lambda: put(saved)

    return _Step(path, lambda: put(state), backup, weights)


def _leaf_step(obj: Any, state: Any, path: str, parent: tuple[Any, Any]) -> _Step:
    container, key = parent
    _check_shapes(obj, state, path)
    if _is_array(obj) and _is_array(state) and _writable_in_place(obj) and \
            tuple(obj.shape) == tuple(state.shape):
        def apply() -> None:
            _copy_into(obj, state)

        def backup() -> Callable[[], None]:
            saved = _copied(obj)
            return lambda: _copy_into(obj, saved)

        return _Step(path, apply, backup)
    if isinstance(container, tuple):
        raise TypeError(f"{path}: a {type(obj).__name__} inside a tuple cannot be restored in place; use a list "
                        "or a dict for the pytree (or an array, which is restored into)")

    def apply_entry() -> None:
        container[key] = state

    def backup_entry() -> Callable[[], None]:
        old = container[key]

        def put_back() -> None:
            container[key] = old
        return put_back

    return _Step(path, apply_entry, backup_entry)


def _writable_in_place(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        return bool(value.flags.writeable)
    return hasattr(value, "copy_") and callable(value.copy_)  # a torch tensor


def _copy_into(target: Any, source: Any) -> None:
    if isinstance(target, np.ndarray):
        np.copyto(target, np.asarray(as_numpy(source)), casting="same_kind")
        return
    import torch

    from fastckpt.arrays import to_torch

    with torch.no_grad():
        target.copy_(source if isinstance(source, torch.Tensor) else to_torch(np.asarray(source)))


def _check_shapes(current: Any, saved: Any, path: str) -> None:
    """Where the object and the checkpoint both hold an array at one path, their shapes must be equal."""
    if _is_array(current) and _is_array(saved):
        if tuple(current.shape) != tuple(saved.shape):
            raise ValueError(f"{path}: the checkpoint holds shape {list(saved.shape)}, the object "
                             f"{list(current.shape)} (a model of another size?)")
    elif isinstance(current, Mapping) and isinstance(saved, Mapping):
        for key in current:
            if key in saved:
                _check_shapes(current[key], saved[key], f"{path}[{key!r}]")
    elif isinstance(current, (list, tuple)) and isinstance(saved, (list, tuple)):
        for i, (a, b) in enumerate(zip(current, saved)):
            _check_shapes(a, b, f"{path}[{i}]")


def _copied(value: Any) -> Any:
    """A copy of a state that no later change of the object reaches (arrays and tensors copied)."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if hasattr(value, "clone") and callable(value.clone) and _is_array(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return type(value)((k, _copied(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_copied(v) for v in value]
    if isinstance(value, tuple):
        items = [_copied(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return copy.deepcopy(value)


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
    weights_tree = _dumps(encode_tree(state_of(model, "model"), weights, "model"))
    weights.seal()
    optim = optim_tree = None
    if optimizer is not None:
        optim = ArrayTable(stage)
        optim_tree = _dumps(encode_tree(state_of(optimizer, "optimizer"), optim, "optimizer"))
        optim.seal()
    # Python state is serialized now: later mutation by the trainer cannot reach the checkpoint.
    extra = {
        "format": "fastckpt.train.extra",
        "schema_version": FILE_SCHEMA_VERSION,
        "scheduler": encode_tree(state_of(scheduler, "scheduler"), None, "scheduler"),
        "data_iter": encode_tree(state_of(data_iter, "data_iter"), None, "data_iter"),
        "train_rng": encode_tree(state_of(train_rng, "train_rng"), None, "train_rng"),
        "scaler": encode_tree(state_of(scaler, "scaler"), None, "scaler"),
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
