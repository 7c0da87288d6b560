"""Pooling: max pooling with indices, average pooling, adaptive average/max pooling, and their backwards.

Window geometry (padding, stride, dilation, ceil_mode, divisors) is static, so it is computed here in
NumPy and enters the graph as constants; only the data flows through jax ops:

- max pooling folds over the kernel offsets, one strided slice per offset, with eager's exact update rule
  (``v > best or isnan(v)``, in row-major offset order), so values *and* indices match eager, ties and
  NaNs included. Slices work for any dilation (the device's reduce-window does not take dilation).
- average pooling is a reduce-window sum divided by a constant divisor array (eager's formula for
  count_include_pad/ceil_mode/divisor_override); its backward is the transpose of that sum (pads).
- adaptive average pooling is separable: one constant averaging matrix per spatial dim (dots).
- max-pool backwards scatter-add the gradient at the saved indices, as eager does.
Low-precision floats accumulate in float32 and round once.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .registry import Unsupported, register_lowering
from .semantics import convert, is_float, opmath_dtype, out_dtype, out_shape

aten = torch.ops.aten


def _params(value: Any, nd: int, default: Sequence[int] | None = None) -> tuple[int, ...]:
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        assert default is not None
        return tuple(default)
    if isinstance(value, int):
        return (value,) * nd
    value = tuple(int(v) for v in value)
    return value * nd if len(value) == 1 else value


def _lowest(dtype: Any) -> Any:
    return -jnp.inf if is_float(dtype) else jnp.iinfo(dtype).min


def _outer(per_dim: Sequence[np.ndarray], combine: Any) -> np.ndarray:
    """``combine`` of 1-d arrays, one per spatial dim, broadcast to the grid of all of them."""
    nd = len(per_dim)
    out = np.asarray(per_dim[0]).reshape((-1,) + (1,) * (nd - 1))
    for i in range(1, nd):
        out = combine(out, np.asarray(per_dim[i]).reshape((1,) * i + (-1,) + (1,) * (nd - 1 - i)))
    return out


def _const(a: np.ndarray, dtype: Any, shape: Sequence[int]) -> Any:
    """A static array over the trailing (spatial) dims, broadcast over the leading ones."""
    return lax.broadcast_in_dim(jnp.asarray(a, dtype), tuple(shape), tuple(range(len(shape) - a.ndim, len(shape))))


def _fold_max(best: Any, where: Any, v: Any, inside: Any, position: Any) -> tuple[Any, Any]:
    """One step of eager's max-pool scan: take ``v`` where in the window and ``v > best or isnan(v)``."""
    better = v > best
    if is_float(v.dtype):
        better = better | jnp.isnan(v)
    take = inside & better
    return lax.select(take, v, best), lax.select(take, position, where)


# ---- max pooling ---------------------------------------------------------------------------------------
def _max_pool(x, nd, kernel_size, stride, padding, dilation, out_spatial):
    kernel = _params(kernel_size, nd)
    stride = _params(stride, nd, kernel)
    padding = _params(padding, nd)
    dilation = _params(dilation, nd)
    lead, in_spatial = x.shape[:-nd], x.shape[-nd:]
    # Coordinates each (output position, kernel offset) reads, per dim: o * s - p + k * d.
    coords = [
        np.arange(out_spatial[i])[:, None] * stride[i] - padding[i] + np.arange(kernel[i])[None, :] * dilation[i]
        for i in range(nd)
    ]
    valid = [(c >= 0) & (c < in_spatial[i]) for i, c in enumerate(coords)]
    place = [int(np.prod(in_spatial[i + 1 :])) for i in range(nd)]
    # Eager starts from the first in-bounds position of each window.
    first = [np.take_along_axis(c, np.argmax(v, axis=1)[:, None], 1)[:, 0] for c, v in zip(coords, valid)]

    out_full = tuple(lead) + tuple(out_spatial)
    pad_cfg = [(0, 0, 0)] * len(lead)
    for i in range(nd):
        need = (out_spatial[i] - 1) * stride[i] + (kernel[i] - 1) * dilation[i] + 1
        pad_cfg.append((padding[i], max(need - in_spatial[i] - padding[i], 0), 0))
    xp = lax.pad(x, jnp.zeros((), x.dtype), pad_cfg)

    best = jnp.full(out_full, _lowest(x.dtype), x.dtype)
    where = _const(_outer([f * p for f, p in zip(first, place)], np.add), jnp.int32, out_full)
    for offs in itertools.product(*[range(k) for k in kernel]):
        start = (0,) * len(lead) + tuple(o * d for o, d in zip(offs, dilation))
        limit = tuple(lead) + tuple(st + (n - 1) * s + 1 for st, n, s in zip(start[len(lead) :], out_spatial, stride))
        v = lax.slice(xp, start, limit, (1,) * len(lead) + stride)
        inside = _const(_outer([valid[i][:, offs[i]] for i in range(nd)], np.logical_and), jnp.bool_, out_full)
        flat = _outer([coords[i][:, offs[i]] * place[i] for i in range(nd)], np.add)
        best, where = _fold_max(best, where, v, inside, _const(flat, jnp.int32, out_full))
    return best, convert(where, jnp.int64)


@register_lowering(aten.max_pool2d_with_indices)
def max_pool2d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(x, 2, kernel_size, stride, padding, dilation, out_shape(0)[-2:])


@register_lowering(aten.max_pool3d_with_indices)
def max_pool3d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(x, 3, kernel_size, stride, padding, dilation, out_shape(0)[-3:])


def _scatter_at_indices(grad: Any, indices: Any, input_shape: Sequence[int], nd: int) -> Any:
    """grad_input[..., indices[..., o]] += grad[..., o] over each plane of the last ``nd`` dims."""
    lead = tuple(input_shape[:-nd])
    planes = int(np.prod(lead))
    size = int(np.prod(input_shape[-nd:]))
    g = jnp.reshape(convert(grad, opmath_dtype(grad.dtype)), (planes, -1))
    idx = jnp.reshape(indices, (planes, -1))
    rows = lax.broadcasted_iota(jnp.int32, idx.shape, 0)
    out = jnp.zeros((planes, size), g.dtype).at[rows, idx].add(g, mode="drop")
    return convert(jnp.reshape(out, tuple(input_shape)), out_dtype())


@register_lowering(aten.max_pool2d_with_indices_backward)
def max_pool2d_with_indices_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _scatter_at_indices(grad, indices, x.shape, 2)


@register_lowering(aten.max_pool3d_with_indices_backward)
def max_pool3d_with_indices_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _scatter_at_indices(grad, indices, x.shape, 3)


# ---- average pooling ------------------------------------------------------------------------------------
def _avg_geometry(in_spatial, out_spatial, kernel, stride, padding, count_include_pad, divisor_override):
    """(reduce-window padding config, divisor array over the output positions), by eager's formulas."""
    pads, divisors = [], []
    for n, o, k, s, p in zip(in_spatial, out_spatial, kernel, stride, padding):
        start = np.arange(o) * s - p
        end = np.minimum(start + k, n + p)
        size = end - start
        clipped = np.minimum(end, n) - np.maximum(start, 0)
        divisors.append(size if count_include_pad else clipped)
        pads.append((p, max((o - 1) * s + k - n - p, 0)))
    div = divisors[0].astype(np.float64)
    for d in divisors[1:]:
        div = np.multiply.outer(div, d)
    if divisor_override:
        div = np.full_like(div, float(divisor_override))
    return pads, div


def _window_sum(x, nd, kernel, stride, pads):
    lead = x.ndim - nd
    # A concrete zero init (not a traced one) makes this jax's differentiable window-sum primitive.
    return lax.reduce_window(
        x,
        np.zeros((), x.dtype),
        lax.add,
        (1,) * lead + kernel,
        (1,) * lead + stride,
        [(0, 0)] * lead + list(pads),
    )


def _avg_setup(x, nd, kernel_size, stride, padding, count_include_pad, divisor_override, out_spatial):
    kernel = _params(kernel_size, nd)
    stride = _params(stride, nd, kernel)
    padding = _params(padding, nd)
    pads, div = _avg_geometry(x.shape[-nd:], out_spatial, kernel, stride, padding, count_include_pad, divisor_override)
    return kernel, stride, pads, div


def _avg_pool(x, nd, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    out_spatial = out_shape()[-nd:]
    kernel, stride, pads, div = _avg_setup(
        x, nd, kernel_size, stride, padding, count_include_pad, divisor_override, out_spatial
    )
    acc = opmath_dtype(x.dtype)
    total = _window_sum(convert(x, acc), nd, kernel, stride, pads)
    if not is_float(acc):
        # Eager divides the integer window sum by the integer divisor in C++: truncation toward zero,
        # which is lax.div on integers (a true division would go through float64, absent on Trainium).
        return lax.div(total, _const(div.astype(np.int64), acc, total.shape))
    return convert(total / jnp.asarray(div, acc), out_dtype())


def _avg_pool_backward(grad, x, nd, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    out_spatial = grad.shape[-nd:]
    kernel, stride, pads, div = _avg_setup(
        x, nd, kernel_size, stride, padding, count_include_pad, divisor_override, out_spatial
    )
    acc = opmath_dtype(x.dtype)
    g = convert(grad, acc) / jnp.asarray(div, acc)
    zeros = jnp.zeros(x.shape, acc)
    _, transpose = jax.vjp(lambda t: _window_sum(t, nd, kernel, stride, pads), zeros)
    (out,) = transpose(g)
    return convert(out, out_dtype())


@register_lowering(aten.avg_pool2d)
def avg_pool2d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    return _avg_pool(x, 2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@register_lowering(aten.avg_pool3d)
def avg_pool3d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    return _avg_pool(x, 3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@register_lowering(aten.avg_pool2d_backward)
def avg_pool2d_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return _avg_pool_backward(grad, x, 2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@register_lowering(aten.avg_pool3d_backward)
def avg_pool3d_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return _avg_pool_backward(grad, x, 3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


# ---- adaptive pooling ------------------------------------------------------------------------------------
def _adaptive_windows(n: int, o: int) -> tuple[np.ndarray, np.ndarray]:
    i = np.arange(o)
    return (i * n) // o, -((-(i + 1) * n) // o)  # floor(i*n/o), ceil((i+1)*n/o)


def _averaging_matrix(n: int, o: int) -> np.ndarray:
    start, end = _adaptive_windows(n, o)
    cols = np.arange(n)[None, :]
    inside = (cols >= start[:, None]) & (cols < end[:, None])
    return (inside / (end - start)[:, None]).astype(np.float32)


def _apply_per_dim(x: Any, matrices: Sequence[np.ndarray], transpose: bool) -> Any:
    nd = len(matrices)
    for i, m in enumerate(matrices):
        axis = x.ndim - nd + i
        m = jnp.asarray(m if transpose else m.T, x.dtype)
        y = jnp.tensordot(x, m, axes=([axis], [0]), precision=lax.Precision.HIGHEST)
        x = jnp.moveaxis(y, -1, axis)
    return x


def _adaptive_avg(x, nd):
    if not is_float(x.dtype):
        raise Unsupported(f"adaptive_avg_pool on {x.dtype}")
    out_spatial = out_shape()[-nd:]
    acc = opmath_dtype(x.dtype)
    mats = [_averaging_matrix(n, o) for n, o in zip(x.shape[-nd:], out_spatial)]
    return convert(_apply_per_dim(convert(x, acc), mats, False), out_dtype())


def _adaptive_avg_backward(grad, x, nd):
    acc = opmath_dtype(x.dtype)
    mats = [_averaging_matrix(n, o) for n, o in zip(x.shape[-nd:], grad.shape[-nd:])]
    return convert(_apply_per_dim(convert(grad, acc), mats, True), out_dtype())


@register_lowering(aten._adaptive_avg_pool2d)
def adaptive_avg_pool2d(x, output_size):
    return _adaptive_avg(x, 2)


@register_lowering(aten._adaptive_avg_pool3d)
def adaptive_avg_pool3d(x, output_size):
    return _adaptive_avg(x, 3)


@register_lowering(aten._adaptive_avg_pool2d_backward)
def adaptive_avg_pool2d_backward(grad, x):
    return _adaptive_avg_backward(grad, x, 2)


@register_lowering(aten._adaptive_avg_pool3d_backward)
def adaptive_avg_pool3d_backward(grad, x):
    return _adaptive_avg_backward(grad, x, 3)


def _adaptive_max(x, nd):
    out_spatial = out_shape(0)[-nd:]
    lead = x.shape[:-nd]
    in_spatial = x.shape[-nd:]
    windows = [_adaptive_windows(n, o) for n, o in zip(in_spatial, out_spatial)]
    longest = [int((e - s).max()) for s, e in windows]
    place = [int(np.prod(in_spatial[i + 1 :])) for i in range(nd)]
    out_full = tuple(lead) + tuple(out_spatial)
    best = jnp.full(out_full, _lowest(x.dtype), x.dtype)
    where = _const(_outer([s * p for (s, _), p in zip(windows, place)], np.add), jnp.int32, out_full)
    for offs in itertools.product(*[range(k) for k in longest]):
        rows = [np.minimum(s + k, e - 1) for (s, e), k in zip(windows, offs)]
        v = x
        for i, r in enumerate(rows):
            v = jnp.take(v, jnp.asarray(r, jnp.int32), axis=len(lead) + i, mode="clip")
        # Windows shorter than the longest would revisit their last element: skip those offsets.
        inside = _outer([s + k < e for (s, e), k in zip(windows, offs)], np.logical_and)
        position = _outer([r * p for r, p in zip(rows, place)], np.add)
        best, where = _fold_max(
            best, where, v, _const(inside, jnp.bool_, out_full), _const(position, jnp.int32, out_full)
        )
    return best, convert(where, jnp.int64)


@register_lowering(aten.adaptive_max_pool2d)
def adaptive_max_pool2d(x, output_size):
    return _adaptive_max(x, 2)


@register_lowering(aten.adaptive_max_pool3d)
def adaptive_max_pool3d(x, output_size):
    return _adaptive_max(x, 3)


@register_lowering(aten.adaptive_max_pool2d_backward)
def adaptive_max_pool2d_backward(grad, x, indices):
    return _scatter_at_indices(grad, indices, x.shape, 2)


@register_lowering(aten.adaptive_max_pool3d_backward)
def adaptive_max_pool3d_backward(grad, x, indices):
    return _scatter_at_indices(grad, indices, x.shape, 3)
