"""Neural-network ops kept whole by the decomposition: softmax/log_softmax (+backward), layer_norm
(+backward), batch_norm (training, eval, no stats), group_norm, embedding (+backward), nll_loss (+backward).

Numerics follow eager CPU: bfloat16/float16 inputs are computed in float32 (statistics, sums,
normalization) and rounded once at the end; every output takes the dtype torch's meta gives it.
Outputs that torch returns as None (a False in ``output_mask``) are None.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from . import device_calls
from .pooling import _scatter_at_indices
from .registry import Unsupported, current, register_lowering
from .semantics import canonical_dim, convert, opmath_dtype, out_dtype, out_shape

aten = torch.ops.aten

_REDUCTION_NONE, _REDUCTION_MEAN, _REDUCTION_SUM = 0, 1, 2


def _up(x: Any) -> Any:
    return None if x is None else convert(x, opmath_dtype(x.dtype))


def _wanted(index: int) -> bool:
    """Whether torch produces output ``index`` of the current node (False where it returns None)."""
    return current().out[index] is not None


def _along(v: Any, ndim: int, axis: int) -> Any:
    """A per-channel vector reshaped to broadcast along ``axis`` of an ``ndim``-d array."""
    shape = [1] * ndim
    shape[axis] = v.shape[0]
    return jnp.reshape(v, shape)


# ---- softmax ---------------------------------------------------------------------------------------
def _softmax_parts(x: Any, dim: int) -> tuple[Any, Any, int]:
    """(x - max, sum(exp(x - max)), axis) in float32 for 16-bit input; NaN and all -inf rows give NaN
    as in eager."""
    xf = _up(x)
    axis = canonical_dim(dim, xf.ndim)
    shifted = lax.sub(xf, jnp.max(xf, axis=axis, keepdims=True))
    return shifted, jnp.sum(jnp.exp(shifted), axis=axis, keepdims=True), axis


def _with_rank(fn):
    """Softmax-family ops accept 0-d tensors (dim 0 or -1) and empty tensors: handle both once."""

    @functools.wraps(fn)
    def lower(x, dim, *args):
        if x.size == 0:
            return jnp.zeros(out_shape(), out_dtype())
        if x.ndim == 0:
            return jnp.reshape(fn(jnp.reshape(x, (1,)), 0, *args), ())
        return fn(x, dim, *args)

    return lower


@register_lowering(aten._softmax)
@_with_rank
def softmax(x, dim, half_to_float=False):
    # AwsNeuronSoftmax on the device (device_calls); this max-shifted formula on the CPU target.
    def reference(v, axis):
        shifted, total, _ = _softmax_parts(v, axis)
        return lax.div(jnp.exp(shifted), total)

    return convert(device_calls.softmax(_up(x), dim, reference), out_dtype())


@register_lowering(aten._log_softmax)
@_with_rank
def log_softmax(x, dim, half_to_float=False):
    shifted, total, _ = _softmax_parts(x, dim)
    return convert(lax.sub(shifted, jnp.log(total)), out_dtype())


def _backward_with_rank(fn):
    @functools.wraps(fn)
    def lower(grad, output, dim, input_dtype):
        if grad.size == 0:
            return jnp.zeros(out_shape(), out_dtype())
        if grad.ndim == 0:
            return jnp.reshape(fn(jnp.reshape(grad, (1,)), jnp.reshape(output, (1,)), 0, input_dtype), ())
        return fn(grad, output, dim, input_dtype)

    return lower


@register_lowering(aten._softmax_backward_data)
@_backward_with_rank
def softmax_backward(grad, output, dim, input_dtype):
    # AwsNeuronSoftmaxBackward on the device (device_calls); this formula on the CPU target.
    def reference(g, y, axis):
        gy = lax.mul(g, y)
        return lax.sub(gy, lax.mul(y, jnp.sum(gy, axis=axis, keepdims=True)))

    return convert(device_calls.softmax_backward(_up(grad), _up(output), dim, reference), out_dtype())


@register_lowering(aten._log_softmax_backward_data)
@_backward_with_rank
def log_softmax_backward(grad, output, dim, input_dtype):
    g, y = _up(grad), _up(output)
    return convert(
        lax.sub(g, lax.mul(jnp.exp(y), jnp.sum(g, axis=canonical_dim(dim, g.ndim), keepdims=True))), out_dtype()
    )


# ---- layer norm ------------------------------------------------------------------------------------
def _normalize(xf: Any, axes: tuple[int, ...], eps: float) -> tuple[Any, Any, Any, Any]:
    """(normalized x, mean, rstd, biased variance) with keepdims statistics, computed in two passes."""
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    centered = lax.sub(xf, mean)
    var = jnp.mean(lax.mul(centered, centered), axis=axes, keepdims=True)
    rstd = lax.rsqrt(lax.add(var, jnp.asarray(eps, var.dtype)))
    return lax.mul(centered, rstd), mean, rstd, var


@register_lowering(aten.native_layer_norm)
def native_layer_norm(x, normalized_shape, weight, bias, eps):
    axis = x.ndim - len(normalized_shape)
    xf = _up(x)
    if x.size == 0:
        return tuple(jnp.zeros(out_shape(i), out_dtype(i)) for i in range(3))
    y, mean, rstd, _ = _normalize(xf, tuple(range(axis, x.ndim)), eps)
    if weight is not None:
        y = lax.mul(y, jnp.broadcast_to(_up(weight), y.shape))
    if bias is not None:
        y = lax.add(y, jnp.broadcast_to(_up(bias), y.shape))
    return convert(y, out_dtype(0)), convert(mean, out_dtype(1)), convert(rstd, out_dtype(2))


@register_lowering(aten.native_layer_norm_backward)
def native_layer_norm_backward(grad_out, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    axis = x.ndim - len(normalized_shape)
    inner = tuple(range(axis, x.ndim))
    outer = tuple(range(axis))
    n = math.prod(x.shape[axis:])
    if x.size == 0:
        return tuple(jnp.zeros(out_shape(i), out_dtype(i)) if _wanted(i) else None for i in range(3))
    g, xf = _up(grad_out), _up(x)
    x_hat = lax.mul(lax.sub(xf, _up(mean)), _up(rstd))
    g_hat = g if weight is None else lax.mul(g, jnp.broadcast_to(_up(weight), g.shape))
    grad_input = grad_weight = grad_bias = None
    if _wanted(0):
        sum_g = jnp.sum(g_hat, axis=inner, keepdims=True)
        sum_gx = jnp.sum(lax.mul(g_hat, x_hat), axis=inner, keepdims=True)
        inner_term = lax.sub(lax.sub(lax.mul(g_hat, jnp.asarray(n, g.dtype)), sum_g), lax.mul(x_hat, sum_gx))
        grad_input = convert(lax.mul(lax.div(_up(rstd), jnp.asarray(n, g.dtype)), inner_term), out_dtype(0))
    if _wanted(1):
        grad_weight = convert(jnp.sum(lax.mul(g, x_hat), axis=outer), out_dtype(1))
    if _wanted(2):
        grad_bias = convert(jnp.sum(g, axis=outer), out_dtype(2))
    return grad_input, grad_weight, grad_bias


# ---- batch norm / group norm -----------------------------------------------------------------------
def _affine(y: Any, weight: Any, bias: Any, axis: int = 1) -> Any:
    """y * weight + bias with per-channel (dim ``axis``) weight and bias, either possibly None."""
    if weight is not None:
        y = lax.mul(y, _along(_up(weight), y.ndim, axis).astype(y.dtype))
    if bias is not None:
        y = lax.add(y, _along(_up(bias), y.ndim, axis).astype(y.dtype))
    return y


def _batch_norm(
    x, weight, bias, running_mean, running_var, training, momentum, eps, channels_last=False
) -> tuple[Any, ...]:
    """(out, save_mean, save_rstd, new_running_mean, new_running_var); the last two are None when no
    running stats are given. Eval mode on CPU returns empty save_mean/save_rstd, as eager does.
    ``channels_last``: ``x`` and ``out`` hold the channels in their last dim (lowering/layout.py)."""
    xf = _up(x)
    channel = x.ndim - 1 if channels_last else 1
    axes = tuple(d for d in range(x.ndim) if d != channel)
    new_mean = new_var = None
    if training:
        y, mean, rstd, biased_var = _normalize(xf, axes, eps)
        save_mean, save_rstd = jnp.reshape(mean, (-1,)), jnp.reshape(rstd, (-1,))
        if running_mean is not None:
            new_mean = lax.add(
                lax.mul(jnp.asarray(momentum, jnp.float32), save_mean),
                lax.mul(jnp.asarray(1 - momentum, jnp.float32), convert(running_mean, jnp.float32)),
            )
        if running_var is not None:
            count = x.size // x.shape[channel]
            unbiased = lax.mul(
                jnp.reshape(biased_var, (-1,)), jnp.asarray(count / (count - 1) if count > 1 else math.inf, jnp.float32)
            )
            new_var = lax.add(
                lax.mul(jnp.asarray(momentum, jnp.float32), unbiased),
                lax.mul(jnp.asarray(1 - momentum, jnp.float32), convert(running_var, jnp.float32)),
            )
    else:
        if running_mean is None or running_var is None:
            raise Unsupported("batch_norm in eval mode without running statistics")
        mean = convert(running_mean, xf.dtype)
        rstd = lax.rsqrt(lax.add(convert(running_var, xf.dtype), jnp.asarray(eps, xf.dtype)))
        y = lax.mul(lax.sub(xf, _along(mean, x.ndim, channel)), _along(rstd, x.ndim, channel))
        save_mean, save_rstd = mean, rstd
        new_mean, new_var = running_mean, running_var
    out = convert(_affine(y, weight, bias, channel), out_dtype(0))
    if out_shape(1) == (0,):
        save_mean = save_rstd = jnp.zeros((0,), out_dtype(1))
    results = [out, convert(save_mean, out_dtype(1)), convert(save_rstd, out_dtype(2))]
    if len(current().out) == 5:
        results += [convert(new_mean, out_dtype(3)), convert(new_var, out_dtype(4))]
    return tuple(results)


@register_lowering(aten._native_batch_norm_legit_functional)
def batch_norm_functional(x, weight, bias, running_mean, running_var, training, momentum, eps, *, channels_last=False):
    return _batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps, channels_last)


@register_lowering(aten._native_batch_norm_legit_no_training)
def batch_norm_no_training(x, weight, bias, running_mean, running_var, momentum, eps, *, channels_last=False):
    return _batch_norm(x, weight, bias, running_mean, running_var, False, momentum, eps, channels_last)


@register_lowering(aten._native_batch_norm_legit.no_stats)
def batch_norm_no_stats(x, weight, bias, training, momentum, eps, *, channels_last=False):
    return _batch_norm(x, weight, bias, None, None, training, momentum, eps, channels_last)


@register_lowering(aten._native_batch_norm_legit.default, aten.native_batch_norm)
def batch_norm_inplace_stats(
    x, weight, bias, running_mean, running_var, training, momentum, eps, *, channels_last=False
):
    if training and (running_mean is not None or running_var is not None):
        # These overloads update the running stats in place; a functionalized graph never holds them,
        # and dropping the update silently would be wrong.
        raise Unsupported("in-place running-stat update of batch_norm outside a functionalized graph")
    return _batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps, channels_last)


@register_lowering(aten.native_group_norm)
def native_group_norm(x, weight, bias, n, c, hxw, group, eps):
    xf = jnp.reshape(_up(x), (n, group, c // group * hxw))  # not -1: n may be 0
    y, mean, rstd, _ = _normalize(xf, (2,), eps)
    y = _affine(jnp.reshape(y, x.shape), weight, bias)
    return (
        convert(y, out_dtype(0)),
        convert(jnp.reshape(mean, (n, group)), out_dtype(1)),
        convert(jnp.reshape(rstd, (n, group)), out_dtype(2)),
    )


# ---- embedding -------------------------------------------------------------------------------------
@register_lowering(aten.embedding)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if sparse:
        raise Unsupported("sparse embedding gradients")
    # Eager raises on an out-of-range index; a compiled graph cannot, so it yields NaN rows (float)
    # rather than another row's values.
    return jnp.take(weight, indices, axis=0, mode="fill")


@register_lowering(aten.embedding_dense_backward)
def embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    g = _up(grad)
    trailing = g.shape[indices.ndim :]
    g = jnp.reshape(g, (-1,) + trailing)
    idx = jnp.reshape(indices, (-1,))
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), g.dtype).at[idx].add(1, mode="drop")
        g = lax.div(g, _along(jnp.take(counts, idx, mode="fill", fill_value=1), g.ndim, 0))
    keep = _along(lax.ne(idx, jnp.asarray(padding_idx, idx.dtype)), g.ndim, 0)
    g = jnp.where(keep, g, jnp.zeros((), g.dtype))
    out = jnp.zeros((num_weights,) + trailing, g.dtype).at[idx].add(g, mode="drop")
    return convert(out, out_dtype())


# ---- nll_loss --------------------------------------------------------------------------------------
def _nll_terms(target: Any, weight: Any, ignore_index: int, dtype: Any) -> tuple[Any, Any, Any]:
    """(target with ignored entries set to class 0, validity mask, per-sample weight (0 where ignored))."""
    valid = lax.ne(target, jnp.asarray(ignore_index, target.dtype))
    safe = jnp.where(valid, target, jnp.zeros((), target.dtype))
    w = jnp.ones(target.shape, dtype) if weight is None else convert(jnp.take(weight, safe, mode="fill"), dtype)
    return safe, valid, jnp.where(valid, w, jnp.zeros((), dtype))


def _check_nll(x: Any, reduction: int) -> None:
    if x.ndim not in (1, 2):
        raise Unsupported(f"nll_loss of a {x.ndim}-d input (expected 1-d or 2-d)")
    if reduction not in (_REDUCTION_NONE, _REDUCTION_MEAN, _REDUCTION_SUM):
        raise Unsupported(f"nll_loss reduction {reduction}")


@register_lowering(aten.nll_loss_forward)
def nll_loss_forward(x, target, weight, reduction, ignore_index):
    _check_nll(x, reduction)
    xf = _up(x)
    if x.ndim == 1:
        xf, target = xf[None], jnp.reshape(target, (1,))
    safe, valid, w = _nll_terms(target, weight, ignore_index, xf.dtype)
    picked = jnp.take_along_axis(xf, safe[:, None], axis=1, mode="fill")[:, 0]
    # where, not multiply: an ignored row's value (even inf/NaN) must not leak into the loss.
    losses = jnp.where(valid, lax.neg(lax.mul(picked, w)), jnp.zeros((), xf.dtype))
    if reduction == _REDUCTION_NONE:
        loss, total = jnp.reshape(losses, out_shape(0)), jnp.zeros((), xf.dtype)
    else:
        total = jnp.sum(w)
        loss = jnp.sum(losses)
        if reduction == _REDUCTION_MEAN:
            loss = lax.div(loss, total)
    return convert(loss, out_dtype(0)), convert(total, out_dtype(1))


@register_lowering(aten.nll_loss_backward)
def nll_loss_backward(grad_out, x, target, weight, reduction, ignore_index, total_weight):
    _check_nll(x, reduction)
    shape = x.shape
    dtype = opmath_dtype(x.dtype)
    if x.ndim == 1:
        target = jnp.reshape(target, (1,))
    num_classes = shape[-1]
    safe, valid, w = _nll_terms(target, weight, ignore_index, dtype)
    g = jnp.reshape(convert(grad_out, dtype), (-1,))  # (N,) for reduction none, (1,) otherwise
    if reduction == _REDUCTION_MEAN:
        g = lax.div(g, convert(total_weight, dtype))
    # where, not multiply: eager leaves an ignored row's gradient 0 even when the mean's total weight is 0
    # (every target ignored: g is inf, and 0 * inf NaN).
    per_sample = jnp.where(valid, lax.neg(lax.mul(w, g)), jnp.zeros((), dtype))
    # A one-hot select instead of a scatter: the same values, and friendlier to the device.
    hot = lax.eq(lax.broadcasted_iota(safe.dtype, (safe.shape[0], num_classes), 1), safe[:, None])
    grad = jnp.where(hot, per_sample[:, None], jnp.zeros((), dtype))
    return convert(jnp.reshape(grad, shape), out_dtype())


# ---- fractional max pooling --------------------------------------------------------------------------
# The random samples are an input of the aten op (F.fractional_max_pool*d draws them, or takes
# ``_random_samples``), so the windows are data but their count and size are static: each window's start is
# computed in the graph, then its pool-size cells are gathered and folded as eager's kernel scans them.
def _fractional_starts(samples: Any, in_size: int, out_size: int, pool: int) -> Any:
    """Eager's ``generate_intervals`` for each plane's sample (planes,) -> window starts (planes, out_size)
    int32: ``int((i + s) * alpha) - int(s * alpha)`` with ``alpha = (in - pool) / (out - 1)``, every step in
    the samples' dtype as eager's ``scalar_t`` arithmetic rounds it (bfloat16 included); the last window
    ends at the input's end."""
    dtype = np.dtype(samples.dtype)  # ml_dtypes' bfloat16 rounds each host operation as c10::BFloat16 does
    last = jnp.full((samples.shape[0], 1), in_size - pool, jnp.int32)
    if out_size == 1:
        return last
    alpha = jnp.asarray(np.asarray(in_size - pool, dtype) / np.asarray(out_size - 1, dtype), dtype)
    i = jnp.asarray(np.arange(out_size - 1).astype(dtype))  # eager converts i to scalar_t before adding
    s = samples[:, None]
    scaled = (i[None, :] + s) * alpha
    offset = s * alpha
    starts = scaled.astype(jnp.int32) - offset.astype(jnp.int32)  # float -> int truncates, as static_cast<int>
    return jnp.concatenate([starts, last], axis=1)


def _fractional_max_pool(x: Any, nd: int, kernel_size: Any, samples: Any) -> tuple[Any, Any]:
    pool = tuple(kernel_size) * nd if len(kernel_size) == 1 else tuple(kernel_size)
    out_spatial = out_shape(0)[-nd:]
    in_spatial = x.shape[-nd:]
    lead = x.shape[:-nd]
    planes = math.prod(lead)
    flat = jnp.reshape(x, (planes, math.prod(in_spatial)))
    # Eager reads the samples' first planes * nd values (a module's samples may hold more batches).
    s = jnp.reshape(jnp.reshape(samples, (-1,))[: planes * nd], (planes, nd))
    # Sample j of a plane drives the j-th spatial dim counted from the last (2-d: W then H; 3-d: T, H, W).
    order = list(reversed(range(nd))) if nd == 2 else list(range(nd))
    starts = [_fractional_starts(s[:, order[d]], in_spatial[d], out_spatial[d], pool[d]) for d in range(nd)]
    place = [math.prod(in_spatial[d + 1 :]) for d in range(nd)]
    # Flat index of each window's first cell, over (planes, *out_spatial).
    base = sum(
        jnp.reshape(starts[d] * place[d], (planes,) + tuple(out_spatial[d] if e == d else 1 for e in range(nd)))
        for d in range(nd)
    )
    base = jnp.broadcast_to(base, (planes,) + tuple(out_spatial)).reshape(planes, -1)
    best = jnp.full(base.shape, -jnp.inf, x.dtype)
    where = base
    for offs in itertools.product(*[range(p) for p in pool]):
        position = base + sum(o * p for o, p in zip(offs, place))
        v = jnp.take_along_axis(flat, position, axis=1, mode="clip")
        take = (v > best) | jnp.isnan(v)  # eager's scan: the first maximum, or the first NaN onwards
        best, where = lax.select(take, v, best), lax.select(take, position, where)
    shape = tuple(lead) + tuple(out_spatial)
    return jnp.reshape(best, shape), convert(jnp.reshape(where, shape), jnp.int64)


@register_lowering(aten.fractional_max_pool2d)
def fractional_max_pool2d(x: Any, kernel_size: Any, output_size: Any, random_samples: Any) -> tuple[Any, Any]:
    return _fractional_max_pool(x, 2, kernel_size, random_samples)


@register_lowering(aten.fractional_max_pool3d)
def fractional_max_pool3d(x: Any, kernel_size: Any, output_size: Any, random_samples: Any) -> tuple[Any, Any]:
    return _fractional_max_pool(x, 3, kernel_size, random_samples)


@register_lowering(aten.fractional_max_pool2d_backward)
def fractional_max_pool2d_backward(grad: Any, x: Any, kernel_size: Any, output_size: Any, indices: Any) -> Any:
    return _scatter_at_indices(grad, indices, x.shape, 2)


@register_lowering(aten.fractional_max_pool3d_backward)
def fractional_max_pool3d_backward(grad: Any, x: Any, kernel_size: Any, output_size: Any, indices: Any) -> Any:
    return _scatter_at_indices(grad, indices, x.shape, 3)
