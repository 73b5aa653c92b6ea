"""The layers a ``.netcl`` file can describe, plus Embedding, with eval-mode OpenCL forward passes.

Parameters are float32 device tensors drawn from :func:`~fastckpt.nn.module.init_rng`
(deterministic: see :func:`~fastckpt.nn.module.seeded`). Layouts follow netcl:
``Linear.weight`` is (in_features, out_features), so ``y = x @ weight + bias``;
``Conv2d.weight`` is (out, in // groups, k, k) over NCHW input; BatchNorm2d keeps
``gamma``, ``beta``, ``running_mean``, ``running_var``.

Inputs: a :class:`~fastckpt.device.tensor.Tensor` or anything numpy converts. Host
floating-point input is cast to float32 for the float layers (and host integer input
to int64 for Embedding); a device Tensor must already have the right dtype. Forward
kernels exist for float32 parameters only; a model loaded with another dtype raises a
``TypeError`` that names the layer and the fix (``model.astype(np.float32)``).
Dropout is the identity and BatchNorm uses its running statistics (eval mode).

>>> import numpy as np                                             # doctest: +SKIP
>>> layer = Linear(None, 3, 2)                                     # doctest: +SKIP
>>> layer(np.ones((4, 3))).to_host().shape                         # doctest: +SKIP
(4, 2)
"""

from __future__ import annotations

import math

import numpy as np

from fastckpt.device.tensor import Tensor
from fastckpt.nn import kernels
from fastckpt.nn._common import as_tensor, default_queue
from fastckpt.nn.kernels import element_offset
from fastckpt.nn.module import Module, init_rng, new_parameter

__all__ = [
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
    "as_tensor",
]

_F32 = np.dtype(np.float32)


def _empty(queue, shape) -> Tensor:
    import pyopencl as cl

    shape = tuple(int(s) for s in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * _F32.itemsize
    return Tensor(cl.Buffer(queue.context, cl.mem_flags.READ_WRITE, size=max(nbytes, 1)), shape, _F32, queue=queue)


def _float_input(layer: Module, x, min_ndim: int = 1) -> Tensor:
    t = as_tensor(x, layer.queue, _F32)
    if t.dtype != _F32:
        raise TypeError(f"{type(layer).__name__} runs on float32 input, got a {t.dtype} Tensor; convert it first")
    if t.ndim < min_ndim:
        raise ValueError(f"{type(layer).__name__} needs input with at least {min_ndim} dimensions, got shape {t.shape}")
    t.wait()
    return t


def _require_f32(layer: Module) -> None:
    for key, tensor in layer.named_tensors().items():
        if tensor.dtype != _F32:
            raise TypeError(
                f"{type(layer).__name__}.{key} is {tensor.dtype}; the forward kernels are float32 only. "
                "Convert the model with model.astype(np.float32) (the loaded file keeps its dtype)"
            )
        tensor.wait()


def _uniform(shape, bound: float) -> np.ndarray:
    return init_rng().uniform(-bound, bound, size=shape).astype(np.float32)


def _bias_arg(layer):
    """Kernel args for an optional bias; the weight's buffer stands in (never read) when absent."""
    if layer.bias is None:
        return layer.weight.buffer, np.uint64(0), np.int32(0)
    return layer.bias.buffer, element_offset(layer.bias), np.int32(1)


def _positive_int(owner: str, name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{owner}: {name} must be an int >= {minimum}, got {value!r}")
    return int(value)


class Linear(Module):
    """``y = x @ weight + bias`` with ``weight`` of shape (in_features, out_features), as netcl stores it.

    Initialised Xavier-uniform (weight) and uniform(±1/sqrt(in_features)) (bias).

    >>> Linear(None, 784, 10).weight.shape      # doctest: +SKIP
    (784, 10)
    """

    _state_names = ("weight", "bias")

    def __init__(self, queue=None, in_features: int = None, out_features: int = None, bias: bool = True):
        self.in_features = _positive_int("Linear", "in_features", in_features)
        self.out_features = _positive_int("Linear", "out_features", out_features)
        self.queue = default_queue(queue)
        limit = math.sqrt(6.0 / (self.in_features + self.out_features))
        self.weight = new_parameter(self.queue, (self.in_features, self.out_features),
                                    lambda: _uniform((self.in_features, self.out_features), limit))
        self.bias = None
        if bias:
            self.bias = new_parameter(self.queue, (self.out_features,),
                                      lambda: _uniform((self.out_features,), 1.0 / math.sqrt(self.in_features)))

    def config_args(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features, "bias": self.bias is not None}

    def forward(self, x) -> Tensor:
        _require_f32(self)
        t = _float_input(self, x)
        if t.shape[-1] != self.in_features:
            raise ValueError(f"Linear expects input (..., {self.in_features}), got shape {t.shape}")
        rows = t.size // self.in_features
        out = _empty(self.queue, t.shape[:-1] + (self.out_features,))
        kernels.launch(
            self.queue, "linear", (rows, self.out_features),
            t.buffer, element_offset(t), self.weight.buffer, element_offset(self.weight), *_bias_arg(self),
            out.buffer, np.int32(rows), np.int32(self.in_features), np.int32(self.out_features),
        )
        return out


class Conv2d(Module):
    """2-D convolution over NCHW input with square kernels (``kernel_size`` is one int, as in netcl).

    Output size per spatial axis: ``(H + 2*pad - dilation*(kernel_size-1) - 1) // stride + 1``.
    Initialised Kaiming-uniform (bound sqrt(6 / fan_in)).

    >>> Conv2d(None, 3, 8, 3, pad=1).weight.shape     # doctest: +SKIP
    (8, 3, 3, 3)
    """

    _state_names = ("weight", "bias")

    def __init__(self, queue=None, in_channels: int = None, out_channels: int = None, kernel_size: int = None,
                 stride: int = 1, pad: int = 0, bias: bool = True, dilation: int = 1, groups: int = 1):
        self.in_channels = _positive_int("Conv2d", "in_channels", in_channels)
        self.out_channels = _positive_int("Conv2d", "out_channels", out_channels)
        self.kernel_size = _positive_int("Conv2d", "kernel_size", kernel_size)
        self.stride = _positive_int("Conv2d", "stride", stride)
        self.pad = _positive_int("Conv2d", "pad", pad, minimum=0)
        self.dilation = _positive_int("Conv2d", "dilation", dilation)
        self.groups = _positive_int("Conv2d", "groups", groups)
        if self.in_channels % self.groups or self.out_channels % self.groups:
            raise ValueError(
                f"Conv2d: groups={self.groups} must divide in_channels={self.in_channels} "
                f"and out_channels={self.out_channels}"
            )
        self.queue = default_queue(queue)
        k = self.kernel_size
        fan_in = (self.in_channels // self.groups) * k * k
        bound = math.sqrt(6.0 / fan_in)
        wshape = (self.out_channels, self.in_channels // self.groups, k, k)
        self.weight = new_parameter(self.queue, wshape, lambda: _uniform(wshape, bound))
        self.bias = None
        if bias:
            self.bias = new_parameter(self.queue, (self.out_channels,),
                                      lambda: _uniform((self.out_channels,), 1.0 / math.sqrt(fan_in)))

    def config_args(self) -> dict:
        return {
            "in_channels": self.in_channels, "out_channels": self.out_channels, "kernel_size": self.kernel_size,
            "stride": self.stride, "pad": self.pad, "bias": self.bias is not None,
            "dilation": self.dilation, "groups": self.groups,
        }

    def output_size(self, size: int) -> int:
        return (size + 2 * self.pad - self.dilation * (self.kernel_size - 1) - 1) // self.stride + 1

    def forward(self, x) -> Tensor:
        _require_f32(self)
        t = _float_input(self, x)
        if t.ndim != 4 or t.shape[1] != self.in_channels:
            raise ValueError(f"Conv2d expects input (N, {self.in_channels}, H, W), got shape {t.shape}")
        n, c, h, w = t.shape
        oh, ow = self.output_size(h), self.output_size(w)
        if oh < 1 or ow < 1:
            raise ValueError(f"Conv2d: input {h}x{w} is smaller than the dilated kernel (output {oh}x{ow})")
        out = _empty(self.queue, (n, self.out_channels, oh, ow))
        kernels.launch(
            self.queue, "conv2d", (n * self.out_channels, oh, ow),
            t.buffer, element_offset(t), self.weight.buffer, element_offset(self.weight), *_bias_arg(self),
            out.buffer, *(np.int32(v) for v in (c, h, w, self.out_channels, oh, ow, self.kernel_size,
                                                 self.stride, self.pad, self.dilation, self.groups)),
        )
        return out


class BatchNorm2d(Module):
    """Eval-mode batch norm over channel axis 1: ``(x - running_mean) / sqrt(running_var + eps) * gamma + beta``.

    Starts as the identity (gamma 1, beta 0, mean 0, var 1). ``momentum`` is kept for the
    config (training is not part of fastckpt). Accepts (N, C) or (N, C, ...) input.

    >>> BatchNorm2d(None, 16).running_var.shape    # doctest: +SKIP
    (16,)
    """

    _state_names = ("gamma", "beta", "running_mean", "running_var")
    _buffer_names = ("running_mean", "running_var")  # as netcl: state_dict() has them, parameters() not

    def __init__(self, queue=None, num_features: int = None, momentum: float = 0.1, eps: float = 1e-5):
        c = _positive_int("BatchNorm2d", "num_features", num_features)
        self.momentum = float(momentum)
        self.eps = float(eps)
        if not self.eps > 0:
            raise ValueError(f"BatchNorm2d: eps must be > 0, got {eps!r}")
        self.queue = default_queue(queue)
        ones, zeros = (lambda: np.ones(c, np.float32)), (lambda: np.zeros(c, np.float32))
        self.gamma = new_parameter(self.queue, (c,), ones)
        self.beta = new_parameter(self.queue, (c,), zeros)
        self.running_mean = new_parameter(self.queue, (c,), zeros)
        self.running_var = new_parameter(self.queue, (c,), ones)

    @property
    def num_features(self) -> int:
        return self.running_mean.size

    def config_args(self) -> dict:
        return {"num_features": self.num_features, "momentum": self.momentum, "eps": self.eps}

    def forward(self, x) -> Tensor:
        _require_f32(self)
        t = _float_input(self, x, min_ndim=2)
        c = self.num_features
        if t.shape[1] != c:
            raise ValueError(f"BatchNorm2d expects input (N, {c}, ...), got shape {t.shape}")
        inner = int(np.prod(t.shape[2:], dtype=np.int64))
        out = _empty(self.queue, t.shape)
        kernels.launch(
            self.queue, "batchnorm", (t.size,),
            t.buffer, element_offset(t),
            *(a for p in (self.gamma, self.beta, self.running_mean, self.running_var) for a in (p.buffer, element_offset(p))),
            out.buffer, np.uint64(t.size), np.int32(c), np.uint64(inner), np.float32(self.eps),
        )
        return out


class _Elementwise(Module):
    _kernel = ""

    def _extra_args(self) -> tuple:
        return ()

    def forward(self, x) -> Tensor:
        t = _float_input(self, x, min_ndim=0)
        queue = t.queue
        out = _empty(queue, t.shape)
        kernels.launch(queue, self._kernel, (t.size,), t.buffer, element_offset(t), out.buffer, np.uint64(t.size),
                       *self._extra_args())
        return out


class ReLU(_Elementwise):
    """``max(x, 0)`` (NaN stays NaN).

    >>> ReLU()(np.array([-1.0, 2.0])).to_host()          # doctest: +SKIP
    array([0., 2.], dtype=float32)
    """

    _kernel = "relu"


class LeakyReLU(_Elementwise):
    """``x`` where ``x > 0``, else ``negative_slope * x``.

    >>> LeakyReLU(0.5)(np.array([-2.0, 3.0])).to_host()  # doctest: +SKIP
    array([-1.,  3.], dtype=float32)
    """

    _kernel = "leaky_relu"

    def __init__(self, negative_slope: float = 0.01):
        self.negative_slope = float(negative_slope)

    def config_args(self) -> dict:
        return {"negative_slope": self.negative_slope}

    def _extra_args(self) -> tuple:
        return (np.float32(self.negative_slope),)


class Sigmoid(_Elementwise):
    """``1 / (1 + exp(-x))``.

    >>> Sigmoid()(np.zeros(1)).to_host()                  # doctest: +SKIP
    array([0.5], dtype=float32)
    """

    _kernel = "sigmoid"


class Tanh(_Elementwise):
    """``tanh(x)``.

    >>> Tanh()(np.zeros(1)).to_host()                     # doctest: +SKIP
    array([0.], dtype=float32)
    """

    _kernel = "tanh_"


class Dropout(Module):
    """Identity in eval mode (the only mode); ``p`` and ``seed`` are kept for the config.

    >>> Dropout(0.5)(np.ones(2)).to_host()                # doctest: +SKIP
    array([1., 1.])
    """

    def __init__(self, p: float = 0.5, seed: int | None = None):
        p = float(p)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1], got {p!r}")
        self.p = p
        self.seed = seed

    def config_args(self) -> dict:
        return {"p": self.p, "seed": self.seed}

    def forward(self, x) -> Tensor:
        return as_tensor(x, None, None)


class MaxPool2d(Module):
    """Max over ``kernel_size`` squares every ``stride`` pixels of NCHW input, no padding (netcl's defaults: 2, 2).

    >>> MaxPool2d()(np.arange(16.0).reshape(1, 1, 4, 4)).to_host()   # doctest: +SKIP
    array([[[[ 5.,  7.],
             [13., 15.]]]], dtype=float32)
    """

    def __init__(self, kernel_size: int = 2, stride: int = 2):
        self.kernel_size = _positive_int("MaxPool2d", "kernel_size", kernel_size)
        self.stride = _positive_int("MaxPool2d", "stride", stride)

    def config_args(self) -> dict:
        return {"kernel_size": self.kernel_size, "stride": self.stride}

    def forward(self, x) -> Tensor:
        t = _float_input(self, x, min_ndim=4)
        if t.ndim != 4:
            raise ValueError(f"MaxPool2d expects NCHW input, got shape {t.shape}")
        n, c, h, w = t.shape
        oh, ow = (h - self.kernel_size) // self.stride + 1, (w - self.kernel_size) // self.stride + 1
        if h < self.kernel_size or w < self.kernel_size:
            raise ValueError(f"MaxPool2d: input {h}x{w} is smaller than kernel_size {self.kernel_size}")
        out = _empty(t.queue, (n, c, oh, ow))
        kernels.launch(t.queue, "maxpool2d", (n * c, oh, ow), t.buffer, element_offset(t), out.buffer,
                       *(np.int32(v) for v in (h, w, oh, ow, self.kernel_size, self.stride)))
        return out


class Flatten(Module):
    """(N, ...) -> (N, prod(...)): a view sharing the input's buffer, any dtype.

    >>> Flatten()(np.ones((2, 3, 4), np.float32)).shape   # doctest: +SKIP
    (2, 12)
    """

    def forward(self, x) -> Tensor:
        t = as_tensor(x, None, None)
        if t.ndim < 1:
            raise ValueError("Flatten needs at least one (batch) dimension, got a 0-d input")
        rest = int(np.prod(t.shape[1:], dtype=np.int64))
        # SAFETY: the view shares t's buffer; owner keeps t alive for as long as the view lives.
        return Tensor(t.buffer, (t.shape[0], rest), t.dtype, offset=t.offset, queue=t.queue, event=t._event,
                      keepalive=t._keepalive, owner=t)


class Embedding(Module):
    """Rows of ``weight`` (num_embeddings, embedding_dim) picked by integer indices; output ``idx.shape + (dim,)``.

    Initialised N(0, 1). Not a netcl ``.netcl`` type: fastckpt saves it with its own config entry,
    which netcl refuses to load (unknown layer type). An index out of range raises ``IndexError``.

    >>> Embedding(10, 4)(np.array([[1, 2]])).shape     # doctest: +SKIP
    (1, 2, 4)
    """

    _state_names = ("weight",)

    def __init__(self, num_embeddings: int = None, embedding_dim: int = None, queue=None):
        self.num_embeddings = _positive_int("Embedding", "num_embeddings", num_embeddings)
        self.embedding_dim = _positive_int("Embedding", "embedding_dim", embedding_dim)
        self.queue = default_queue(queue)
        shape = (self.num_embeddings, self.embedding_dim)
        self.weight = new_parameter(self.queue, shape, lambda: init_rng().standard_normal(shape).astype(np.float32))

    def config_args(self) -> dict:
        return {"num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim}

    def forward(self, x) -> Tensor:
        import pyopencl as cl

        _require_f32(self)
        if isinstance(x, Tensor):
            idx = x
        else:
            host = np.asarray(x)
            if host.dtype.kind not in "iu":
                raise TypeError(f"Embedding takes integer indices, got {host.dtype}")
            idx = as_tensor(host, self.queue, np.int64)
        if idx.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
            raise TypeError(f"Embedding takes int32 or int64 index Tensors, got {idx.dtype}")
        idx.wait()
        out = _empty(self.queue, idx.shape + (self.embedding_dim,))
        bad = cl.Buffer(self.queue.context, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                        hostbuf=np.zeros(1, np.int32))
        name = "embedding_i32" if idx.dtype == np.int32 else "embedding_i64"
        kernels.launch(self.queue, name, (idx.size, self.embedding_dim), idx.buffer, element_offset(idx),
                       self.weight.buffer, element_offset(self.weight), out.buffer, np.uint64(idx.size),
                       np.int32(self.embedding_dim), np.int64(self.num_embeddings), bad)
        flag = np.zeros(1, np.int32)
        cl.enqueue_copy(self.queue, flag, bad, is_blocking=True)
        if flag[0]:
            raise IndexError(f"Embedding: an index is outside [0, {self.num_embeddings})")
        return out
