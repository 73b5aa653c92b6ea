"""OpenCL kernels for the eval-mode forward passes of :mod:`fastckpt.nn`, built once per context.

Every kernel reads float32 storage and accumulates in ``acc_t``: double where
the device has ``cl_khr_fp64`` (pocl, most GPUs), else float. A dot product of
K float32 terms accumulated in double and rounded once is within one float32
rounding of the exact result, so outputs agree with a float64 numpy reference
to float32 precision regardless of K; with float accumulation the error grows
with K, which the tests would notice.

Tensors may be views into a larger buffer (a pooled arena), so every buffer
argument comes with an element offset (``*_off``); kernels never assume a
tensor starts at byte 0.

>>> from fastckpt.device import default      # doctest: +SKIP
>>> program(default().context).relu           # doctest: +SKIP
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["SOURCE", "program", "launch", "element_offset"]

SOURCE = r"""
#ifdef cl_khr_fp64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
typedef double acc_t;
#else
typedef float acc_t;
#endif

__kernel void linear(__global const float *x, ulong x_off,
                     __global const float *w, ulong w_off,
                     __global const float *b, ulong b_off, int has_bias,
                     __global float *out, int n_rows, int in_f, int out_f)
{
    const int r = get_global_id(0), j = get_global_id(1);
    if (r >= n_rows || j >= out_f) return;
    const __global float *xr = x + x_off + (ulong)r * in_f;
    const __global float *wc = w + w_off + j;          /* weight is (in, out): column j */
    acc_t acc = has_bias ? (acc_t)b[b_off + j] : (acc_t)0;
    for (int i = 0; i < in_f; ++i)
        acc += (acc_t)xr[i] * (acc_t)wc[(ulong)i * out_f];
    out[(ulong)r * out_f + j] = (float)acc;
}

__kernel void conv2d(__global const float *x, ulong x_off,
                     __global const float *w, ulong w_off,
                     __global const float *b, ulong b_off, int has_bias,
                     __global float *out,
                     int C, int H, int W, int O, int OH, int OW,
                     int K, int stride, int pad, int dil, int groups)
{
    const int no = get_global_id(0), oy = get_global_id(1), ox = get_global_id(2);
    if (oy >= OH || ox >= OW) return;
    const int n = no / O, o = no % O;
    const int cg = C / groups, og = O / groups, g = o / og;
    acc_t acc = has_bias ? (acc_t)b[b_off + o] : (acc_t)0;
    for (int c = 0; c < cg; ++c) {
        const ulong xc = x_off + ((ulong)n * C + (ulong)(g * cg + c)) * H * W;
        const ulong wc = w_off + ((ulong)o * cg + c) * K * K;
        for (int ky = 0; ky < K; ++ky) {
            const int iy = oy * stride - pad + ky * dil;
            if (iy < 0 || iy >= H) continue;
            for (int kx = 0; kx < K; ++kx) {
                const int ix = ox * stride - pad + kx * dil;
                if (ix < 0 || ix >= W) continue;
                acc += (acc_t)x[xc + (ulong)iy * W + ix] * (acc_t)w[wc + ky * K + kx];
            }
        }
    }
    out[(((ulong)n * O + o) * OH + oy) * OW + ox] = (float)acc;
}

__kernel void batchnorm(__global const float *x, ulong x_off,
                        __global const float *gamma, ulong g_off,
                        __global const float *beta, ulong b_off,
                        __global const float *mean, ulong m_off,
                        __global const float *var, ulong v_off,
                        __global float *out, ulong total, int C, ulong inner, float eps)
{
    const ulong i = get_global_id(0);
    if (i >= total) return;
    const int c = (int)((i / inner) % C);
    const acc_t inv = (acc_t)1 / sqrt((acc_t)var[v_off + c] + (acc_t)eps);
    out[i] = (float)(((acc_t)x[x_off + i] - (acc_t)mean[m_off + c]) * inv * (acc_t)gamma[g_off + c]
                     + (acc_t)beta[b_off + c]);
}

__kernel void relu(__global const float *x, ulong x_off, __global float *out, ulong n)
{
    const ulong i = get_global_id(0);
    if (i < n) { const float v = x[x_off + i]; out[i] = (v > 0.0f || isnan(v)) ? v : 0.0f; }
}

__kernel void leaky_relu(__global const float *x, ulong x_off, __global float *out, ulong n, float slope)
{
    const ulong i = get_global_id(0);
    if (i < n) { const float v = x[x_off + i]; out[i] = v > 0.0f ? v : (float)((acc_t)v * (acc_t)slope); }
}

__kernel void sigmoid(__global const float *x, ulong x_off, __global float *out, ulong n)
{
    const ulong i = get_global_id(0);
    if (i < n) out[i] = (float)((acc_t)1 / ((acc_t)1 + exp(-(acc_t)x[x_off + i])));
}

__kernel void tanh_(__global const float *x, ulong x_off, __global float *out, ulong n)
{
    const ulong i = get_global_id(0);
    if (i < n) out[i] = (float)tanh((acc_t)x[x_off + i]);
}

__kernel void maxpool2d(__global const float *x, ulong x_off, __global float *out,
                        int H, int W, int OH, int OW, int K, int stride)
{
    const int nc = get_global_id(0), oy = get_global_id(1), ox = get_global_id(2);
    if (oy >= OH || ox >= OW) return;
    const __global float *plane = x + x_off + (ulong)nc * H * W;
    float best = -INFINITY;
    for (int ky = 0; ky < K; ++ky)
        for (int kx = 0; kx < K; ++kx) {
            const float v = plane[(ulong)(oy * stride + ky) * W + ox * stride + kx];
            best = (v > best || isnan(v)) ? v : best;   /* NaN propagates, as in numpy's max */
        }
    out[((ulong)nc * OH + oy) * OW + ox] = best;
}

#define EMBEDDING(NAME, IDX_T)                                                        \
__kernel void NAME(__global const IDX_T *idx, ulong idx_off,                          \
                   __global const float *w, ulong w_off, __global float *out,         \
                   ulong n_idx, int dim, long rows, __global int *bad)                \
{                                                                                     \
    const ulong i = get_global_id(0); const int d = get_global_id(1);                 \
    if (i >= n_idx || d >= dim) return;                                               \
    const long row = (long)idx[idx_off + i];                                          \
    if (row < 0 || row >= rows) { bad[0] = 1; out[i * dim + d] = NAN; return; }       \
    out[i * dim + d] = w[w_off + (ulong)row * dim + d];                               \
}
EMBEDDING(embedding_i32, int)
EMBEDDING(embedding_i64, long)
"""

_lock = threading.Lock()
_programs: dict[int, tuple[object, object, dict]] = {}  # context.int_ptr -> (context, program, kernels)


def _entry(context):
    key = context.int_ptr
    entry = _programs.get(key)
    if entry is None:
        import pyopencl as cl

        # The context is kept in the entry so that its int_ptr cannot be reused by another context.
        entry = (context, cl.Program(context, SOURCE).build(), {})
        _programs[key] = entry
    return entry


def program(context):
    """The built program for ``context`` (compiled on first use, then cached for the process)."""
    with _lock:
        return _entry(context)[1]


def launch(queue, name: str, global_size: tuple[int, ...], *args) -> None:
    """Enqueue kernel ``name`` over ``global_size``; an empty range enqueues nothing."""
    if any(g == 0 for g in global_size):
        return
    import pyopencl as cl

    # A cl.Kernel holds its arguments, so one cached kernel is set and enqueued under the lock.
    with _lock:
        _ctx, prg, cache = _entry(queue.context)
        kernel = cache.get(name)
        if kernel is None:
            kernel = cache[name] = cl.Kernel(prg, name)
        kernel(queue, global_size, None, *args)


def element_offset(tensor) -> np.uint64:
    """The tensor's byte offset in elements, as a kernel argument; refuses misaligned views."""
    itemsize = tensor.dtype.itemsize
    if tensor.offset % itemsize:
        raise ValueError(
            f"tensor view at byte offset {tensor.offset} is not a multiple of its itemsize {itemsize}; "
            "kernels index elements, so the view must be element-aligned"
        )
    return np.uint64(tensor.offset // itemsize)
