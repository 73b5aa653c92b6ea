"""Layers with OpenCL forward passes, the state_dict protocol and the config registry of ``.netcl`` models.

>>> import numpy as np                                         # doctest: +SKIP
>>> from fastckpt.nn import Sequential, Linear, ReLU           # doctest: +SKIP
>>> model = Sequential(Linear(None, 4, 8), ReLU(), Linear(None, 8, 2))   # doctest: +SKIP
>>> model(np.random.rand(3, 4)).to_host().shape               # doctest: +SKIP
(3, 2)
"""

from fastckpt.nn.factory import (
    NETCL_TYPES,
    LayerBlueprint,
    LayerSpec,
    build_layer,
    build_sequential,
    get_layer_spec,
    layer_to_config,
    normalize_config,
    register_layer,
    registered_types,
    unregister_layer,
)
from fastckpt.nn.layers import (
    BatchNorm2d,
    Conv2d,
    Dropout,
    Embedding,
    Flatten,
    LeakyReLU,
    Linear,
    MaxPool2d,
    ReLU,
    Sigmoid,
    Tanh,
)
from fastckpt.nn.module import (
    IncompatibleKeys,
    Module,
    Sequential,
    deferred_init,
    init_rng,
    manual_seed,
    new_parameter,
    seeded,
    shapes_compatible,
)

__all__ = [
    "Module",
    "Sequential",
    "IncompatibleKeys",
    "Linear",
    "Conv2d",
    "BatchNorm2d",
    "ReLU",
    "LeakyReLU",
    "Sigmoid",
    "Tanh",
    "Dropout",
    "MaxPool2d",
    "Flatten",
    "Embedding",
    "LayerSpec",
    "LayerBlueprint",
    "register_layer",
    "unregister_layer",
    "registered_types",
    "get_layer_spec",
    "layer_to_config",
    "normalize_config",
    "build_sequential",
    "build_layer",
    "deferred_init",
    "new_parameter",
    "NETCL_TYPES",
    "manual_seed",
    "init_rng",
    "seeded",
    "shapes_compatible",
]
