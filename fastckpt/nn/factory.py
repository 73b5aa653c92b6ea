"""The layer registry: config entries <-> layers, and ``build_sequential`` for netcl's three config forms.

A config entry is ``{"type": name, "args": {...}}``. ``build_sequential`` also
accepts entries without ``args`` (``{"type": "ReLU"}``) and the oldest flat form,
where the arguments sit next to ``type`` (``{"type": "Linear", "in_features": 4,
"out_features": 2}``); a whole metadata dict with a ``config`` or ``layers`` list
is accepted too.

The built-in types and the ``args`` they write are netcl 0.4.4's: ``Conv2d``,
``Linear``, ``BatchNorm2d``, ``ReLU``, ``LeakyReLU``, ``Sigmoid``, ``Tanh``,
``Dropout``, ``MaxPool2d``, ``Flatten``. ``Embedding`` is fastckpt's own: files
holding it load in fastckpt, and netcl rejects them (unknown layer type).

As in netcl, Conv2d, Linear, BatchNorm2d and Embedding reject unknown args; the
parameter-free layers ignore them.

>>> import fastckpt.nn as nn                                   # doctest: +SKIP
>>> model = nn.build_sequential(None, [{"type": "Linear", "args": {"in_features": 4, "out_features": 2}},
...                                    {"type": "ReLU"}])      # doctest: +SKIP
>>> nn.layer_to_config(model[0])                               # doctest: +SKIP
{'type': 'Linear', 'args': {'in_features': 4, 'out_features': 2, 'bias': True}}
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable

from fastckpt.device.tensor import Tensor
from fastckpt.nn import layers as L
from fastckpt.nn.module import Module, Sequential, deferred_init, seeded

__all__ = [
    "LayerSpec",
    "register_layer",
    "unregister_layer",
    "get_layer_spec",
    "registered_types",
    "layer_to_config",
    "normalize_config",
    "build_sequential",
    "build_layer",
    "LayerBlueprint",
    "NETCL_TYPES",
]

#: Layer types real netcl 0.4.4 can build from a ``.netcl`` file.
NETCL_TYPES = frozenset({"Conv2d", "Linear", "BatchNorm2d", "ReLU", "LeakyReLU", "Sigmoid", "Tanh", "Dropout",
                         "MaxPool2d", "Flatten"})


@dataclass(frozen=True)
class LayerSpec:
    """How to build (``ctor``) and describe (``to_config``) one layer type.

    >>> get_layer_spec("Linear").required_args
    ('in_features', 'out_features')
    """

    name: str
    ctor: Callable[..., Module]
    to_config: Callable[[Module], dict | None] | None = None
    required_args: tuple[str, ...] = ()
    queue_required: bool = False


_BUILTIN_REQUIRED = {
    "Conv2d": ("in_channels", "out_channels", "kernel_size"),
    "Linear": ("in_features", "out_features"),
    "BatchNorm2d": ("num_features",),
    "Embedding": ("num_embeddings", "embedding_dim"),
}

_lock = threading.RLock()
_registry: dict[str, LayerSpec] = {}
# Bumped by every (un)registration: a LayerBlueprint made under another registry is stale.
_version = 0
# The specs fastckpt itself registered (name -> spec object): layers of these may be copied (LayerBlueprint).
_builtin: dict[str, LayerSpec] = {}


def register_layer(name: str, ctor: Callable[..., Module], *, to_config: Callable[[Module], dict | None] | None = None,
                   required_args=None, queue_required: bool = False) -> None:
    """Register (or replace) layer type ``name``, as ``netcl.nn.factory.register_layer`` does.

    ``ctor(**args)`` builds the layer (``ctor(queue=queue, **args)`` when ``queue_required``);
    ``to_config(layer)`` returns its args dict, or ``None`` when the layer is not of this type
    (types registered later are asked first). Without ``to_config`` the layer's
    ``config_args()`` is used for instances of ``ctor`` when ``ctor`` is a class.
    Build initial values from :func:`fastckpt.nn.init_rng` so rebuilt models are reproducible.

    >>> class Scale(Module): ...                                             # doctest: +SKIP
    >>> register_layer("Scale", Scale, to_config=lambda l: {} if isinstance(l, Scale) else None)  # doctest: +SKIP
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"layer type name must be a non-empty str, got {name!r}")
    if not callable(ctor):
        raise TypeError(f"ctor for layer type {name!r} must be callable, got {type(ctor).__name__}")
    if to_config is None and isinstance(ctor, type):
        cls = ctor

        def to_config(layer, cls=cls):
            return layer.config_args() if type(layer) is cls else None

    if required_args is None:
        required_args = _BUILTIN_REQUIRED.get(name, ())
    global _version
    with _lock:
        _registry.pop(name, None)  # re-registration moves the type to the end: asked first
        _registry[name] = LayerSpec(name, ctor, to_config, tuple(required_args or ()), bool(queue_required))
        _version += 1


def unregister_layer(name: str) -> None:
    """Remove layer type ``name`` (a no-op when it is not registered).

    >>> unregister_layer("NoSuchType")
    >>> "NoSuchType" in registered_types()
    False
    """
    global _version
    with _lock:
        _registry.pop(name, None)
        _version += 1


def registered_types() -> list[str]:
    """Names of the registered layer types, in registration order.

    >>> registered_types()[:3]
    ['Conv2d', 'Linear', 'BatchNorm2d']
    """
    with _lock:
        return list(_registry)


def get_layer_spec(name: str) -> LayerSpec:
    """The spec of layer type ``name``; ``ValueError`` naming the registered types when unknown.

    >>> get_layer_spec("Conv2d").required_args
    ('in_channels', 'out_channels', 'kernel_size')
    >>> get_layer_spec("GELU")
    Traceback (most recent call last):
    ValueError: unknown layer type 'GELU'; registered: Conv2d, ... Register it with fastckpt.nn.register_layer(name, ctor, ...)
    """
    with _lock:
        spec = _registry.get(name)
    if spec is None:
        raise ValueError(
            f"unknown layer type {name!r}; registered: {', '.join(registered_types())}. "
            "Register it with fastckpt.nn.register_layer(name, ctor, ...)"
        )
    return spec


def layer_to_config(layer: Module) -> dict:
    """The config entry ``{"type": ..., "args": {...}}`` of ``layer``; ``ValueError`` if no type claims it.

    >>> layer_to_config(L.MaxPool2d(3, 1))
    {'type': 'MaxPool2d', 'args': {'kernel_size': 3, 'stride': 1}}
    """
    with _lock:
        specs = list(_registry.values())
    for spec in reversed(specs):
        if spec.to_config is None:
            continue
        args = spec.to_config(layer)
        if args is not None:
            return {"type": spec.name, "args": dict(args)}
    raise ValueError(
        f"unsupported layer type {type(layer).__name__} for serialization; "
        "register it with fastckpt.nn.register_layer(name, ctor, to_config=...)"
    )


def normalize_config(config) -> list[dict]:
    """``config`` as a validated list of ``{"type": str, "args": dict}``; ``ValueError`` naming the entry.

    Accepts a list of entries (with ``args``, without, or flat) or a metadata dict
    holding ``config`` or (oldest form) ``layers``. Types must be registered and
    required args present; nothing is built.

    >>> normalize_config([{"type": "ReLU"}, {"type": "Dropout", "p": 0.1}])
    [{'type': 'ReLU', 'args': {}}, {'type': 'Dropout', 'args': {'p': 0.1}}]
    """
    if isinstance(config, Mapping):
        if "config" in config and config["config"] is not None:
            config = config["config"]
        elif "layers" in config:
            config = config["layers"]
        else:
            raise ValueError("model config dict has neither a 'config' nor a 'layers' list")
    if not isinstance(config, list):
        raise ValueError(f"model config must be a list of layer entries, got {type(config).__name__}")
    out = []
    for i, entry in enumerate(config):
        if not isinstance(entry, Mapping):
            raise ValueError(f"config[{i}] must be a dict with a 'type', got {type(entry).__name__}: {entry!r}")
        if "type" not in entry:
            raise ValueError(f"config[{i}] has no 'type': {entry!r}")
        name = entry["type"]
        if not isinstance(name, str):
            raise ValueError(f"config[{i}]: 'type' must be a str, got {name!r}")
        try:
            spec = get_layer_spec(name)
        except ValueError as exc:
            raise ValueError(f"config[{i}]: {exc}") from None
        if "args" in entry:
            args = entry["args"]
            if args is None:
                args = {}
            if not isinstance(args, Mapping):
                raise ValueError(f"config[{i}] ({name}): 'args' must be a dict, got {type(args).__name__}")
        else:  # entry without args, or the oldest flat form
            args = {k: v for k, v in entry.items() if k != "type"}
        missing = [a for a in spec.required_args if a not in args]
        if missing:
            raise ValueError(f"config[{i}] ({name}): missing required args {missing}")
        out.append({"type": name, "args": dict(args)})
    return out


def build_layer(queue, entry: Mapping, *, seed: int = 0, index: int = 0) -> Module:
    """Build one layer from a normalized config entry, drawing from ``default_rng([seed, index])``.

    >>> build_layer(None, {"type": "Linear", "args": {"in_features": 2, "out_features": 1}})  # doctest: +SKIP
    Linear(in_features=2, out_features=1, bias=True)
    """
    spec = get_layer_spec(entry["type"])
    args = entry["args"]
    with seeded([int(seed), int(index)]):
        try:
            layer = spec.ctor(queue=queue, **args) if spec.queue_required else spec.ctor(**args)
        except TypeError as exc:
            raise ValueError(f"config[{index}] ({entry['type']}): bad args {args!r}: {exc}") from exc
        except ValueError as exc:
            raise ValueError(f"config[{index}] ({entry['type']}): {exc}") from exc
    if not isinstance(layer, Module):
        raise TypeError(f"config[{index}]: ctor of {entry['type']!r} returned a {type(layer).__name__}, not a Module")
    return layer


def build_sequential(queue, config, *, seed: int = 0) -> Sequential:
    """Build a :class:`Sequential` from ``config`` (validated whole before any layer is built).

    Layer ``i`` draws its initial values from ``np.random.default_rng([seed, i])``, so the
    same config and seed always give the same parameters.

    >>> m = build_sequential(None, {"layers": [{"type": "Linear", "in_features": 3, "out_features": 1}]})  # doctest: +SKIP
    """
    entries = normalize_config(config)
    return Sequential(*(build_layer(queue, entry, seed=seed, index=i) for i, entry in enumerate(entries)))


class LayerBlueprint:
    """The layers of a normalized config, made again and again for loads that replace every parameter at once.

    ``make()`` returns new layers built as inside :func:`~fastckpt.nn.module.deferred_init`
    (placeholder parameters: shape and dtype only, no values, no device memory), which a
    load must replace (a weight the file lacks is built again with :func:`build_layer`).
    A layer of a type fastckpt registered itself (Linear, Conv2d, ReLU, ...; not one the
    user registered or replaced) is built once per distinct entry, here, and ``make()``
    copies it: a new object holding the same hyperparameters, queue and placeholders, in
    about a twentieth of the time a build takes (0.4 against 8 µs for a Linear). Other types, and built-in layers
    holding a value that a copy would share mutably, are built anew by every ``make()``.
    ``reusable`` says that ``make()`` only copies, so the blueprint (and a load plan
    worked out on one of its models) may be kept and used again while ``current`` is
    true: no layer type was registered or removed since it was made.

    >>> entries = normalize_config([{"type": "ReLU"}, {"type": "Dropout", "p": 0.25}, {"type": "ReLU"}])
    >>> blueprint = LayerBlueprint(None, entries)
    >>> first, second = blueprint.make(), blueprint.make()
    >>> [type(layer).__name__ for layer in first], first[0] is second[0], second[1].p
    (['ReLU', 'Dropout', 'ReLU'], False, 0.25)
    >>> blueprint.reusable, blueprint.current
    (True, True)
    """

    __slots__ = ("queue", "entries", "templates", "version", "reusable")

    def __init__(self, queue, entries: list):
        self.queue = queue
        self.entries = entries
        with _lock:
            self.version = _version
            builtin = {name: spec for name, spec in _registry.items() if _builtin.get(name) is spec}
        built: dict = {}
        templates: list = []
        with deferred_init():
            for index, entry in enumerate(entries):
                if entry["type"] not in builtin:
                    templates.append(None)  # a user type: built anew by every make()
                    continue
                key = _entry_key(entry)
                layer = built.get(key) if key is not None else None
                if layer is None:
                    layer = build_layer(queue, entry, index=index)
                    if not _copyable(layer):
                        templates.append(None)
                        continue
                    if key is not None:
                        built[key] = layer
                templates.append(layer)
        self.templates = templates
        self.reusable = all(t is not None for t in templates)

    @property
    def current(self) -> bool:
        """True while the layer registry is as it was when this blueprint was made."""
        return self.version == _version

    def make(self) -> list[Module]:
        """New layers for the entries: copies of the templates, the rest built as under ``deferred_init``."""
        new = object.__new__
        if self.reusable:
            out = []
            for template in self.templates:
                layer = new(type(template))
                layer.__dict__ = template.__dict__.copy()  # twice as fast as updating the new, empty one
                out.append(layer)
            return out
        out = []
        with deferred_init():
            for index, template in enumerate(self.templates):
                if template is None:
                    out.append(build_layer(self.queue, self.entries[index], index=index))
                else:
                    layer = new(type(template))
                    layer.__dict__ = template.__dict__.copy()
                    out.append(layer)
        return out


def _entry_key(entry: Mapping):
    """A hashable key equal only for entries that build the same layer, or None (an unhashable arg)."""
    items = []
    for k, v in entry["args"].items():
        # The type is part of the key: 16, 16.0 and True are equal in Python but not as layer args.
        items.append((k, type(v), v.hex() if type(v) is float else v))
    key = (entry["type"], tuple(items))
    try:
        hash(key)
    except TypeError:
        return None
    return key


_SHAREABLE = (int, float, str, bool, type(None), Tensor)


def _copyable(layer: Module) -> bool:
    """True when a copy of ``layer`` would share nothing mutable with it (placeholders are replaced by a load)."""
    queue = getattr(layer, "queue", None)
    for value in layer.__dict__.values():
        if value is queue:
            continue
        if not isinstance(value, _SHAREABLE):
            return False
        if isinstance(value, Tensor) and value.buffer is not None:  # a real buffer: copies would share it
            return False
    return True


def _ignoring_extras(cls, *names):
    """A ctor taking only ``names`` from its kwargs: netcl's parameter-free layers ignore unknown args."""

    def ctor(**kwargs):
        return cls(**{k: kwargs[k] for k in names if k in kwargs})

    ctor.__name__ = cls.__name__
    return ctor


def _of(cls):
    return lambda layer: layer.config_args() if type(layer) is cls else None


def _register_defaults() -> None:
    register_layer("Conv2d", L.Conv2d, to_config=_of(L.Conv2d), queue_required=True)
    register_layer("Linear", L.Linear, to_config=_of(L.Linear), queue_required=True)
    register_layer("BatchNorm2d", L.BatchNorm2d, to_config=_of(L.BatchNorm2d), queue_required=True)
    register_layer("ReLU", _ignoring_extras(L.ReLU), to_config=_of(L.ReLU))
    register_layer("LeakyReLU", _ignoring_extras(L.LeakyReLU, "negative_slope"), to_config=_of(L.LeakyReLU))
    register_layer("Sigmoid", _ignoring_extras(L.Sigmoid), to_config=_of(L.Sigmoid))
    register_layer("Tanh", _ignoring_extras(L.Tanh), to_config=_of(L.Tanh))
    register_layer("Dropout", _ignoring_extras(L.Dropout, "p", "seed"), to_config=_of(L.Dropout))
    register_layer("MaxPool2d", _ignoring_extras(L.MaxPool2d, "kernel_size", "stride"), to_config=_of(L.MaxPool2d))
    register_layer("Flatten", _ignoring_extras(L.Flatten), to_config=_of(L.Flatten))
    register_layer("Embedding", L.Embedding, to_config=_of(L.Embedding), queue_required=True)
    with _lock:
        _builtin.update(_registry)


_register_defaults()
