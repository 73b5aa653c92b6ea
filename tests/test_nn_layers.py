"""Forward passes of fastckpt.nn layers against float64 numpy references, on the OpenCL device (pocl in CI)."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

pytest.importorskip("pyopencl")

import fastckpt.nn as nn
from fastckpt.device.tensor import Tensor

pytestmark = pytest.mark.device


@pytest.fixture(scope="module")
def has_fp64(queue):
    return "cl_khr_fp64" in queue.device.extensions


@pytest.fixture
def rng(request):
    """A fresh generator per test; the seed is printed on failure (pytest -rA shows user properties)."""
    seed = secrets.randbits(32)
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


def nonzero(rng, shape, scale=1.0):
    """Uniform values in ±[0.1, 1] * scale: never zero, both signs."""
    mag = rng.uniform(0.1, 1.0, size=shape)
    return (np.where(rng.random(shape) < 0.5, -mag, mag) * scale).astype(np.float32)


def assert_close(out: np.ndarray, ref: np.ndarray, has_fp64: bool):
    """Each element within float32 rounding of the float64 reference."""
    assert out.dtype == np.float32 and out.shape == ref.shape
    ref = ref.astype(np.float64)
    if has_fp64:  # accumulated in double, rounded once: relative error ~6e-8
        err = np.abs(out - ref) / np.maximum(np.abs(ref), np.finfo(np.float32).tiny)
        assert err.max() < 5e-7, f"max relative error {err.max():.3g}"
    else:
        err = np.abs(out - ref).max() / np.abs(ref).max()
        assert err < 5e-6, f"max error relative to max |ref| {err:.3g}"


def conv2d_ref(x, w, b, stride, pad, dil, groups):
    x, w = x.astype(np.float64), w.astype(np.float64)
    n, c, h, wd = x.shape
    o, cg, k, _ = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh = (h + 2 * pad - dil * (k - 1) - 1) // stride + 1
    ow = (wd + 2 * pad - dil * (k - 1) - 1) // stride + 1
    out = np.zeros((n, o, oh, ow))
    og = o // groups
    for g in range(groups):
        xs = xp[:, g * cg:(g + 1) * cg]
        ws = w[g * og:(g + 1) * og]
        for ky in range(k):
            for kx in range(k):
                patch = xs[:, :, ky * dil: ky * dil + stride * (oh - 1) + 1: stride,
                           kx * dil: kx * dil + stride * (ow - 1) + 1: stride]
                out[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch, ws[:, :, ky, kx])
    if b is not None:
        out += b.astype(np.float64)[None, :, None, None]
    return out


@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 7), (1, 7)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_float64(queue, rng, has_fp64, shape, bias):
    layer = nn.Linear(queue, 7, 3, bias=bias)
    w, b = nonzero(rng, (7, 3)), nonzero(rng, (3,))
    layer.load_state_dict({"weight": w, **({"bias": b} if bias else {})})
    x = nonzero(rng, shape)
    ref = x.astype(np.float64) @ w.astype(np.float64) + (b.astype(np.float64) if bias else 0.0)
    assert_close(layer(x).to_host(), ref, has_fp64)


def test_linear_long_dot_product_stays_within_rounding(queue, rng, has_fp64):
    layer = nn.Linear(queue, 4096, 5)
    w, b = nonzero(rng, (4096, 5)), nonzero(rng, (5,))
    layer.load_state_dict({"weight": w, "bias": b})
    x = nonzero(rng, (3, 4096), scale=10.0)
    assert_close(layer(x).to_host(), x.astype(np.float64) @ w + b.astype(np.float64), has_fp64)


@pytest.mark.parametrize(
    "cin,cout,k,stride,pad,dil,groups,bias",
    [(3, 4, 3, 1, 1, 1, 1, True), (4, 6, 3, 2, 0, 1, 2, True), (2, 2, 2, 1, 2, 2, 1, False),
     (6, 6, 1, 1, 0, 1, 6, True), (3, 5, 5, 3, 2, 1, 1, True)],
)
def test_conv2d_matches_float64(queue, rng, has_fp64, cin, cout, k, stride, pad, dil, groups, bias):
    layer = nn.Conv2d(queue, cin, cout, k, stride=stride, pad=pad, bias=bias, dilation=dil, groups=groups)
    w = nonzero(rng, (cout, cin // groups, k, k))
    b = nonzero(rng, (cout,)) if bias else None
    layer.load_state_dict({"weight": w, **({"bias": b} if bias else {})})
    x = nonzero(rng, (2, cin, 9, 8))
    assert_close(layer(x).to_host(), conv2d_ref(x, w, b, stride, pad, dil, groups), has_fp64)


@pytest.mark.parametrize("shape", [(3, 4, 5, 6), (7, 4)])
def test_batchnorm_uses_running_statistics(queue, rng, has_fp64, shape):
    layer = nn.BatchNorm2d(queue, 4, eps=1e-3)
    g, be, m = nonzero(rng, (4,)), nonzero(rng, (4,)), nonzero(rng, (4,))
    v = rng.uniform(0.5, 2.0, size=4).astype(np.float32)
    layer.load_state_dict({"gamma": g, "beta": be, "running_mean": m, "running_var": v})
    x = nonzero(rng, shape)
    bshape = (1, 4) + (1,) * (len(shape) - 2)
    f = lambda a: a.astype(np.float64).reshape(bshape)  # noqa: E731
    ref = (x - f(m)) / np.sqrt(f(v) + np.float64(np.float32(1e-3))) * f(g) + f(be)
    assert_close(layer(x).to_host(), ref, has_fp64)


def test_relu_is_exact(queue, rng):
    x = nonzero(rng, (4, 5, 3))
    assert np.array_equal(nn.ReLU()(x).to_host(), np.maximum(x, 0))


def test_leaky_relu_matches_float64(queue, rng, has_fp64):
    x = nonzero(rng, (6, 9))
    ref = np.where(x > 0, x.astype(np.float64), x.astype(np.float64) * np.float64(np.float32(0.2)))
    assert_close(nn.LeakyReLU(0.2)(x).to_host(), ref, has_fp64)


def test_sigmoid_matches_float64(queue, rng, has_fp64):
    x = nonzero(rng, (6, 9), scale=8.0)
    assert_close(nn.Sigmoid()(x).to_host(), 1.0 / (1.0 + np.exp(-x.astype(np.float64))), has_fp64)


def test_tanh_matches_float64(queue, rng, has_fp64):
    x = nonzero(rng, (6, 9), scale=4.0)
    assert_close(nn.Tanh()(x).to_host(), np.tanh(x.astype(np.float64)), has_fp64)


def test_dropout_is_identity_in_eval(queue, rng):
    x = nonzero(rng, (3, 8))
    assert np.array_equal(nn.Dropout(0.5, seed=3)(x).to_host(), x)


@pytest.mark.parametrize("k,stride,hw", [(2, 2, (8, 6)), (3, 1, (5, 7)), (3, 2, (9, 8))])
def test_maxpool_is_exact(queue, rng, k, stride, hw):
    x = nonzero(rng, (2, 3) + hw)
    oh, ow = (hw[0] - k) // stride + 1, (hw[1] - k) // stride + 1
    ref = np.full((2, 3, oh, ow), -np.inf, np.float32)
    for ky in range(k):
        for kx in range(k):
            ref = np.maximum(ref, x[:, :, ky:ky + stride * (oh - 1) + 1:stride, kx:kx + stride * (ow - 1) + 1:stride])
    assert np.array_equal(nn.MaxPool2d(k, stride)(x).to_host(), ref)


def test_flatten_is_a_view(queue, rng):
    x = Tensor.from_host(queue, nonzero(rng, (2, 3, 4)))
    y = nn.Flatten()(x)
    assert y.buffer is x.buffer and y.shape == (2, 12)
    assert np.array_equal(y.to_host(), x.to_host().reshape(2, 12))


@pytest.mark.parametrize("idx_dtype", [np.int32, np.int64])
def test_embedding_gathers_rows_exactly(queue, rng, idx_dtype):
    layer = nn.Embedding(11, 5, queue)
    w = nonzero(rng, (11, 5))
    layer.load_state_dict({"weight": w})
    idx = rng.integers(0, 11, size=(3, 4)).astype(idx_dtype)
    assert np.array_equal(layer(Tensor.from_host(queue, idx)).to_host(), w[idx])
    assert np.array_equal(layer(idx).to_host(), w[idx])


def test_embedding_rejects_out_of_range_index(queue):
    with pytest.raises(IndexError, match=r"outside \[0, 4\)"):
        nn.Embedding(4, 2, queue)(np.array([0, 4]))


def test_kernels_honour_tensor_offsets(queue, rng, has_fp64):
    """Parameters and input living inside one larger buffer at byte offsets (as in a pooled arena)."""
    import pyopencl as cl

    w, b, x = nonzero(rng, (6, 4)), nonzero(rng, (4,)), nonzero(rng, (3, 6))
    arena = np.concatenate([nonzero(rng, (32,)), w.ravel(), b, x.ravel()])
    buf = cl.Buffer(queue.context, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=arena)
    layer = nn.Linear(queue, 6, 4)
    layer.load_state_dict({"weight": Tensor(buf, (6, 4), np.float32, offset=128, queue=queue),
                           "bias": Tensor(buf, (4,), np.float32, offset=128 + 96, queue=queue)})
    xt = Tensor(buf, (3, 6), np.float32, offset=128 + 96 + 16, queue=queue)
    assert_close(layer(xt).to_host(), x.astype(np.float64) @ w + b, has_fp64)
    relu_ref = np.maximum(x, 0)
    assert np.array_equal(nn.ReLU()(xt).to_host(), relu_ref)


def test_sequential_chains_layers(queue, rng, has_fp64):
    model = nn.Sequential(nn.Linear(queue, 5, 4), nn.Tanh(), nn.Linear(queue, 4, 2))
    x = nonzero(rng, (3, 5))
    sd = model.state_dict()
    ref = np.tanh(x.astype(np.float64) @ sd["0:weight"] + sd["0:bias"]) @ sd["2:weight"].astype(np.float64) + sd["2:bias"]
    out = model(x).to_host()
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-6
    assert np.array_equal(model.forward(x).to_host(), out)  # deterministic


def test_float64_input_is_cast_but_wrong_dtype_tensor_is_refused(queue, rng):
    x = nonzero(rng, (2, 3)).astype(np.float64)
    assert np.array_equal(nn.ReLU()(x).to_host(), np.maximum(x, 0).astype(np.float32))
    with pytest.raises(TypeError, match="float32 input, got a float64 Tensor"):
        nn.ReLU()(Tensor.from_host(queue, x))


def test_non_float32_model_raises_with_the_fix(queue, rng):
    layer = nn.Linear(queue, 3, 2)
    layer.load_state_dict({"weight": nonzero(rng, (3, 2)).astype(np.float16), "bias": nonzero(rng, (2,))})
    assert layer.weight.dtype == np.float16
    with pytest.raises(TypeError, match=r"Linear.weight is float16.*model.astype\(np.float32\)"):
        layer(nonzero(rng, (1, 3)))
    layer.astype(np.float32)
    assert layer(nonzero(rng, (1, 3))).shape == (1, 2)


@pytest.mark.parametrize(
    "layer,x_shape,match",
    [(lambda q: nn.Linear(q, 4, 2), (3, 5), r"input \(\.\.\., 4\), got shape \(3, 5\)"),
     (lambda q: nn.Conv2d(q, 3, 2, 3), (1, 2, 5, 5), r"input \(N, 3, H, W\), got shape \(1, 2, 5, 5\)"),
     (lambda q: nn.Conv2d(q, 1, 1, 5), (1, 1, 3, 3), "smaller than the dilated kernel"),
     (lambda q: nn.MaxPool2d(4, 4), (1, 1, 3, 3), "smaller than kernel_size 4"),
     (lambda q: nn.BatchNorm2d(q, 3), (2, 4, 2, 2), r"input \(N, 3, \.\.\.\)")],
)
def test_bad_input_shapes_are_named(queue, rng, layer, x_shape, match):
    with pytest.raises(ValueError, match=match):
        layer(queue)(nonzero(rng, x_shape))


@pytest.mark.parametrize("first", ["Dropout", "Flatten", "ReLU"])
def test_host_input_to_a_parameter_free_first_layer_runs_on_the_models_queue(queue, monkeypatch, first):
    """Host data met first by a layer without parameters is uploaded to the model's queue, never to the default
    device's: NVIDIA's OpenCL refuses a buffer of another context as a kernel argument (INVALID_MEM_OBJECT), as a
    Dropout-first model showed on an H200."""
    import fastckpt.device

    model = nn.Sequential(getattr(nn, first)(), nn.Linear(queue, 4, 3))
    x = np.arange(8, dtype=np.float32).reshape(2, 4) - 3
    w, b = model[1].weight.to_host(), model[1].bias.to_host()

    def no_default(*args, **kwargs):
        raise AssertionError("the default device was asked for")

    monkeypatch.setattr(fastckpt.device, "default", no_default)
    out = model(x)
    assert out.queue is queue
    h = np.maximum(x, 0) if first == "ReLU" else x
    np.testing.assert_allclose(out.to_host(), h @ w + b, rtol=1e-6, atol=1e-6)
