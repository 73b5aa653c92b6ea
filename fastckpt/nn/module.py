"""The module protocol: device tensors by name, ``state_dict`` / ``load_state_dict``, ``Sequential``.

A module's *state* is its array-valued tensors (parameters and buffers such as
BatchNorm's running statistics), keyed by attribute name, in a fixed order.
Hyperparameters (``in_features``, ``eps``, ...) are not state: they travel in
the layer's config entry (see :mod:`fastckpt.nn.factory`).

``load_state_dict`` validates the whole state first and writes nothing when
anything is wrong. Values may be host arrays (copied into the existing device
buffers when the dtype matches, else into new buffers of the stored dtype) or
device :class:`~fastckpt.device.tensor.Tensor` objects, which are adopted as they are
(no device copy), so a file loaded into a pooled arena becomes the model's
parameters directly.

>>> import numpy as np                                                # doctest: +SKIP
>>> from fastckpt.nn import Linear, ReLU, Sequential                  # doctest: +SKIP
>>> model = Sequential(Linear(None, 4, 3), ReLU())                    # doctest: +SKIP
>>> sorted(model.state_dict())                                         # doctest: +SKIP
['0:bias', '0:weight']
>>> model.load_state_dict({"0:weight": np.ones((4, 3), np.float32)}, strict=False)  # doctest: +SKIP
IncompatibleKeys(missing_keys=['0:bias'], unexpected_keys=[])
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Iterator, NamedTuple

import numpy as np

from fastckpt.device.tensor import Tensor
from fastckpt.nn._common import as_tensor

__all__ = [
    "IncompatibleKeys",
    "Module",
    "Sequential",
    "manual_seed",
    "seeded",
    "init_rng",
    "shapes_compatible",
    "deferred_init",
    "new_parameter",
    "TensorSpec",
]


class IncompatibleKeys(NamedTuple):
    """Keys a load left alone (``missing_keys``) or could not place (``unexpected_keys``).

    >>> IncompatibleKeys(["0:bias"], [])
    IncompatibleKeys(missing_keys=['0:bias'], unexpected_keys=[])
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


# -- deterministic initialisation ---------------------------------------------------------------
_global_rng = np.random.default_rng(0)
_local = threading.local()


def manual_seed(seed: int) -> None:
    """Reset the generator that layers built outside :func:`seeded` draw their initial values from.

    >>> manual_seed(0)
    """
    global _global_rng
    _global_rng = np.random.default_rng(seed)


def init_rng() -> np.random.Generator:
    """The generator a layer being built now must draw its initial values from.

    Inside :func:`seeded` it is that block's generator; otherwise the process-wide one
    (seeded with 0 at import, reset by :func:`manual_seed`). Custom layers should use it
    so that ``build_sequential`` rebuilds them reproducibly.

    >>> init_rng().uniform() < 1.0
    True
    """
    stack = getattr(_local, "stack", None)
    if not stack:
        return _global_rng
    frame = stack[-1]
    if frame[1] is None:  # made on first use: a deferred build never pays for a generator
        frame[1] = np.random.default_rng(frame[0])
    return frame[1]


@contextlib.contextmanager
def seeded(seed) -> Iterator[None]:
    """Build layers inside this block from ``np.random.default_rng(seed)`` (thread-local).

    >>> with seeded([0, 1]):
    ...     a = init_rng().uniform()
    >>> with seeded([0, 1]):
    ...     a == init_rng().uniform()
    True
    """
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append([seed, None])
    try:
        yield
    finally:
        stack.pop()


@contextlib.contextmanager
def deferred_init() -> Iterator[None]:
    """Build layers inside this block without computing or allocating their initial values.

    Built-in layers then hold placeholder tensors (``buffer is None``: shape and dtype only)
    that a load replaces. A loader uses it so that a 64 MiB model is not first filled with
    random numbers it is about to overwrite; a layer whose values the file lacks is built
    again normally (same seed, same values). Placeholders are never visible outside a load.

    >>> with deferred_init():
    ...     deferred_init_active()
    True
    """
    previous = getattr(_local, "deferred", False)
    _local.deferred = True
    try:
        yield
    finally:
        _local.deferred = previous


def deferred_init_active() -> bool:
    """True inside :func:`deferred_init` (on this thread).

    >>> deferred_init_active()
    False
    """
    return getattr(_local, "deferred", False)


def new_parameter(queue, shape, make) -> Tensor:
    """A device tensor holding ``make()`` (a host array), or a placeholder inside :func:`deferred_init`.

    ``make`` must draw from :func:`init_rng` in the same order whether or not it is called
    later, which holds because a deferred layer is rebuilt whole.

    >>> with deferred_init():
    ...     placeholder = new_parameter(None, (2, 3), lambda: np.ones((2, 3), np.float32))
    >>> placeholder.buffer is None, placeholder.shape
    (True, (2, 3))
    """
    if deferred_init_active():
        return Tensor(None, tuple(shape), np.float32, queue=queue)
    host = make()
    return Tensor.from_host(queue, host)


# -- shape tolerance --------------------------------------------------------------------------
def shapes_compatible(stored: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """True when ``stored`` is ``expected`` up to size-1 dimensions ((1, C) for (C,)), as netcl accepts.

    >>> shapes_compatible((1, 3), (3,)), shapes_compatible((3, 1), (1, 3)), shapes_compatible((2, 3), (3, 2))
    (True, True, False)
    """
    stored, expected = tuple(stored), tuple(expected)
    if stored == expected:
        return True
    return tuple(d for d in stored if d != 1) == tuple(d for d in expected if d != 1)


class TensorSpec(NamedTuple):
    """Shape and dtype of a stored tensor, for validating a load before reading any bytes.

    >>> TensorSpec((1, 3), np.dtype(np.float32)).shape
    (1, 3)
    """

    shape: tuple[int, ...]
    dtype: np.dtype


def _check_value(key: str, value) -> tuple[tuple[int, ...], np.dtype]:
    if isinstance(value, (Tensor, TensorSpec)):
        return value.shape, value.dtype
    if not isinstance(value, np.ndarray):
        raise TypeError(f"state entry {key!r}: expected a numpy array or fastckpt Tensor, got {type(value).__name__}")
    if value.dtype.hasobject or value.dtype.kind in "USMm":
        raise TypeError(f"state entry {key!r}: dtype {value.dtype} cannot be a tensor (numeric dtypes only)")
    return value.shape, value.dtype


class _Plan(NamedTuple):
    """A validated load: what is missing, unexpected, wrong, and what to write where."""

    missing: list[str]
    unexpected: list[str]
    errors: list[str]
    writes: list[tuple["Module", str, Any, str]]  # (module, state key, value, full key)


class Module:
    """Base class of fastckpt layers.

    Subclasses list their array state in ``_state_names`` (attribute names holding a
    :class:`Tensor`, or ``None`` for an absent optional tensor such as a disabled bias),
    the buffers among them (state that is not a parameter, such as running statistics) in
    ``_buffer_names``, and implement :meth:`forward`. Only eval-mode forward passes exist:
    ``training`` is always False, :meth:`eval` and ``train(False)`` return the module as
    netcl's do, and ``train(True)`` raises ``NotImplementedError``.

    >>> class Scale(Module):
    ...     _state_names = ("factor",)
    >>> layer = Scale()
    >>> layer.eval() is layer, layer.training
    (True, False)
    >>> layer.train()
    Traceback (most recent call last):
    ...
    NotImplementedError: Scale is inference-only: fastckpt's layers have no training mode, so train(True) cannot be honoured. Call model.eval() or model.train(False) (they return the model, as netcl's do); to train, build or load the model with netcl, which reads the same .netcl files
    """

    _state_names: tuple[str, ...] = ()
    _buffer_names: tuple[str, ...] = ()
    queue = None

    # -- state ---------------------------------------------------------------------------------
    def named_tensors(self) -> dict[str, Tensor]:
        """The device tensors that make up the state, by key, in state order."""
        out = {}
        for name in self._state_names:
            tensor = getattr(self, name, None)
            if tensor is not None:
                out[name] = tensor
        return out

    def parameters(self) -> list[Tensor]:
        """The parameters, as netcl lists them: every state tensor except the buffers, in state order.

        What ``save_params`` / ``save_checkpoint`` take, in netcl's order, so parameter
        checkpoints written by either library load into the other's model.
        BatchNorm's running statistics are buffers: in :meth:`state_dict`, not here.
        """
        return [t for key, t in self.named_tensors().items() if key not in self._buffer_names]

    def state_dict(self) -> dict[str, np.ndarray]:
        """Host copies of the state tensors, keyed as in the model file.

        >>> Linear(None, 2, 1).state_dict()["weight"].shape   # doctest: +SKIP
        (2, 1)
        """
        return {key: tensor.to_host() for key, tensor in self.named_tensors().items()}

    def _plan_load(self, state: Mapping[str, Any], prefix: str = "") -> _Plan:
        current = self.named_tensors()
        missing = [prefix + k for k in current if k not in state]
        unexpected = [prefix + k for k in state if k not in current]
        errors, writes = [], []
        for key, tensor in current.items():
            if key not in state:
                continue
            value = state[key]
            shape, _dtype = _check_value(prefix + key, value)
            if not shapes_compatible(shape, tensor.shape):
                errors.append(f"{prefix + key!r}: stored shape {tuple(shape)}, model expects {tensor.shape}")
                continue
            writes.append((self, key, value, prefix + key))
        return _Plan(missing, unexpected, errors, writes)

    def _apply(self, key: str, value) -> None:
        current: Tensor = getattr(self, key)
        if isinstance(value, Tensor):
            value.wait()
            if value.shape != current.shape:
                # SAFETY: the view shares value's buffer; owner keeps value (and its arena lease) alive.
                value = Tensor(value.buffer, current.shape, value.dtype, offset=value.offset, queue=value.queue, owner=value)
            setattr(self, key, value)
            return
        host = np.ascontiguousarray(value).reshape(current.shape)
        if host.dtype == current.dtype and current.buffer is not None:
            current.write(host)
        else:  # the stored dtype is kept: a new buffer of that dtype replaces the old one
            setattr(self, key, Tensor.from_host(current.queue, host))

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> IncompatibleKeys:
        """Load ``state`` (key -> ndarray or Tensor); validate all first, write nothing on error.

        A shape mismatch always raises ``ValueError`` naming the key and both shapes
        (size-1 dimensions are tolerated: (1, C) loads into (C,)). With ``strict``, missing
        or unexpected keys raise ``KeyError`` naming them; otherwise they are returned.
        The stored dtype is kept.

        >>> layer.load_state_dict({"weight": w, "bias": b})   # doctest: +SKIP
        IncompatibleKeys(missing_keys=[], unexpected_keys=[])
        """
        return _execute(self._plan_load(state), strict)

    # -- conversion ----------------------------------------------------------------------------
    def astype(self, dtype) -> "Module":
        """Convert every state tensor to ``dtype`` in place (new buffers); returns ``self``.

        The forward kernels are float32: ``model.astype(np.float32)`` makes a model loaded
        from a float16 or float64 file runnable.
        """
        dtype = np.dtype(dtype)
        for key, tensor in self.named_tensors().items():
            if tensor.dtype != dtype:
                setattr(self, key, Tensor.from_host(tensor.queue, tensor.to_host().astype(dtype)))
        return self

    # -- mode (netcl's interface) -----------------------------------------------------------------
    @property
    def training(self) -> bool:
        """Always False: fastckpt's layers run the eval-mode forward pass only.

        Assigning it is ``train(value)``: False is accepted, True raises.
        """
        return False

    @training.setter
    def training(self, mode: bool) -> None:
        self.train(mode)

    def train(self, mode: bool = True) -> "Module":
        """netcl's mode switch: ``train(False)`` returns ``self``; ``train(True)`` raises ``NotImplementedError``.

        fastckpt's layers are inference-only (no dropout, no batch statistics,
        no gradients), so a training mode would be a silent lie.
        """
        if mode:
            raise NotImplementedError(
                f"{self._mode_name()} is inference-only: fastckpt's layers have no training mode, so train(True) "
                "cannot be honoured. Call model.eval() or model.train(False) (they return the model, as netcl's "
                "do); to train, build or load the model with netcl, which reads the same .netcl files")
        return self

    def eval(self) -> "Module":
        """Put the module in eval mode (what it always is) and return it, as netcl's ``eval()`` does.

        >>> Module().eval().training
        False
        """
        return self.train(False)

    def _mode_name(self) -> str:
        return type(self).__name__

    # -- running -------------------------------------------------------------------------------
    def forward(self, x) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no forward pass")

    def __call__(self, x) -> Tensor:
        return self.forward(x)

    def config_args(self) -> dict:
        """The constructor arguments that rebuild this layer (its config entry's ``args``)."""
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config_args().items())
        return f"{type(self).__name__}({args})"


def _execute(plan: _Plan, strict: bool) -> IncompatibleKeys:
    if plan.errors:
        raise ValueError(
            "state_dict shape mismatch (nothing was loaded): " + "; ".join(plan.errors)
        )
    if strict and (plan.missing or plan.unexpected):
        parts = []
        if plan.missing:
            parts.append(f"missing keys {plan.missing}")
        if plan.unexpected:
            parts.append(f"unexpected keys {plan.unexpected}")
        raise KeyError(
            "state_dict does not match the model (nothing was loaded): " + ", ".join(parts)
            + "; pass strict=False to load the keys that match"
        )
    for module, key, value, _full in plan.writes:
        module._apply(key, value)
    return IncompatibleKeys(plan.missing, plan.unexpected)


class Sequential(Module):
    """Layers applied in order; state keys are ``"{layer_index}:{state_key}"`` as in ``.netcl`` files.

    Parameter-free layers (ReLU, Flatten, ...) count in the index, as netcl counts them.

    >>> model = Sequential(Linear(None, 8, 4), ReLU(), Linear(None, 4, 2))   # doctest: +SKIP
    >>> list(model.state_dict())                                              # doctest: +SKIP
    ['0:weight', '0:bias', '2:weight', '2:bias']
    >>> model(np.ones((5, 8), np.float32)).shape                              # doctest: +SKIP
    (5, 2)
    """

    def __init__(self, *layers: Module):
        if len(layers) == 1 and not isinstance(layers[0], Module) and isinstance(layers[0], Iterable):
            layers = tuple(layers[0])
        for i, layer in enumerate(layers):
            if not isinstance(layer, Module):
                raise TypeError(f"Sequential layer {i} is a {type(layer).__name__}, not a fastckpt.nn.Module")
        self.layers: list[Module] = list(layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index):
        return self.layers[index]

    def __iter__(self):
        return iter(self.layers)

    def append(self, layer: Module) -> "Sequential":
        if not isinstance(layer, Module):
            raise TypeError(f"cannot append a {type(layer).__name__}: not a fastckpt.nn.Module")
        self.layers.append(layer)
        return self

    def named_tensors(self) -> dict[str, Tensor]:
        out = {}
        for i, layer in enumerate(self.layers):
            for key, tensor in layer.named_tensors().items():
                out[f"{i}:{key}"] = tensor
        return out

    def _plan_load(self, state: Mapping[str, Any], prefix: str = "") -> _Plan:
        per_layer: list[dict[str, Any]] = [{} for _ in self.layers]
        unexpected = []
        for full_key, value in state.items():
            index, sep, key = str(full_key).partition(":")
            # Only the canonical spelling names a layer: "00:w" or "١:w" (int() takes both) would alias "0:w"/"1:w".
            if sep and index.isascii() and index.isdigit() and str(int(index)) == index and int(index) < len(self.layers):
                per_layer[int(index)][key] = value
            else:
                unexpected.append(prefix + str(full_key))
        missing, errors, writes = [], [], []
        for i, layer in enumerate(self.layers):
            sub = layer._plan_load(per_layer[i], f"{prefix}{i}:")
            missing += sub.missing
            unexpected += sub.unexpected
            errors += sub.errors
            writes += sub.writes
        return _Plan(missing, unexpected, errors, writes)

    def astype(self, dtype) -> "Sequential":
        for layer in self.layers:
            layer.astype(dtype)
        return self

    def parameters(self) -> list[Tensor]:
        """Every layer's parameters, layer by layer (netcl's order; no buffers)."""
        return [tensor for layer in self.layers for tensor in layer.parameters()]

    def train(self, mode: bool = True) -> "Sequential":
        """``train(False)`` puts every layer in eval mode and returns ``self``; ``train(True)`` raises."""
        if mode:
            return super().train(True)
        for layer in self.layers:
            layer.train(False)
        return self

    def _mode_name(self) -> str:
        kinds = ", ".join(dict.fromkeys(type(layer).__name__ for layer in self.layers))
        return f"Sequential({kinds})" if kinds else "Sequential()"

    def forward(self, x) -> Tensor:
        # Host data that meets a parameter-free layer (Dropout, Flatten, ReLU, ...) goes to the model's own queue, the
        # first among its layers, not to the default device's: a buffer of another context is no kernel argument on
        # every platform (NVIDIA's OpenCL refuses it: INVALID_MEM_OBJECT).
        queue = next((layer.queue for layer in self.layers if layer.queue is not None), None)
        for layer in self.layers:
            if layer.queue is None and not isinstance(x, Tensor):
                x = as_tensor(x, queue, None)
            x = layer(x)
        if not isinstance(x, Tensor):  # an empty Sequential still returns a device tensor
            x = as_tensor(x, queue, None)
        return x

    def __repr__(self) -> str:
        inner = "".join(f"\n  ({i}): {layer!r}" for i, layer in enumerate(self.layers))
        return f"Sequential({inner}\n)" if inner else "Sequential()"
