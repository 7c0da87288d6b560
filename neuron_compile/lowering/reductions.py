"""Reductions: sum, mean, prod, amax/amin, max/min with indices, argmax/argmin, var/std, any/all.

Accumulation follows eager: low-precision floats accumulate in float32, integer/bool sums in int64.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import torch
from jax import lax

from . import device_calls
from .registry import register_lowering
from .semantics import canonical_dim, convert, is_float, opmath_dtype, out_dtype

aten = torch.ops.aten


def _axes(x, dim) -> tuple[int, ...]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(x.ndim))
    if isinstance(dim, int):
        dim = [dim]
    return tuple(sorted({canonical_dim(d, x.ndim) for d in dim})) if x.ndim else ()


def _acc_dtype(dtype):
    return opmath_dtype(dtype) if is_float(dtype) else jnp.int64


@register_lowering(aten.sum.dim_IntList, aten.sum.default)
def reduce_sum(x, dim=None, keepdim=False, *, dtype=None):
    result = out_dtype()
    acc = _acc_dtype(result)
    return convert(jnp.sum(convert(x, acc), axis=_axes(x, dim), keepdims=keepdim), result)


@register_lowering(aten.mean.dim, aten.mean.default)
def mean(x, dim=None, keepdim=False, *, dtype=None):
    result = out_dtype()
    acc = _acc_dtype(result)
    return convert(jnp.mean(convert(x, acc), axis=_axes(x, dim), keepdims=keepdim), result)


@register_lowering(aten.prod.dim_int, aten.prod.default)
def prod(x, dim=None, keepdim=False, *, dtype=None):
    result = out_dtype()
    return convert(jnp.prod(convert(x, _acc_dtype(result)), axis=_axes(x, dim), keepdims=keepdim), result)


def norm_of_magnitudes(a, ord, axes, keepdim):
    """The vector ``ord``-norm over ``axes`` of ``a >= 0`` (magnitudes), with torch's special orders."""
    if ord == math.inf:
        return jnp.max(a, axis=axes, keepdims=keepdim)
    if ord == -math.inf:
        return jnp.min(a, axis=axes, keepdims=keepdim)
    if ord == 0:
        return jnp.sum(convert(a != 0, a.dtype), axis=axes, keepdims=keepdim)
    if ord == 1:
        return jnp.sum(a, axis=axes, keepdims=keepdim)
    if ord == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=axes, keepdims=keepdim))
    return jnp.sum(a ** float(ord), axis=axes, keepdims=keepdim) ** (1.0 / float(ord))


@register_lowering(aten.linalg_vector_norm)
def linalg_vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    result = out_dtype()
    a = jnp.abs(convert(x, opmath_dtype(result)))
    return convert(norm_of_magnitudes(a, ord, _axes(x, dim), keepdim), result)


@register_lowering(aten.amax)
def amax(x, dim=(), keepdim=False):
    return jnp.max(x, axis=_axes(x, dim), keepdims=keepdim)


@register_lowering(aten.amin)
def amin(x, dim=(), keepdim=False):
    return jnp.min(x, axis=_axes(x, dim), keepdims=keepdim)


def _arg_extreme(x, dim, keepdim, largest):
    # Through AwsNeuronArgMax/ArgMin (device_calls): the HLO form, a variadic (value, index) reduce,
    # is not taken by neuronx-cc. The CPU target runs jnp.argmax/argmin (first index, NaN as extreme).
    if dim is None or x.ndim == 0:
        index = device_calls.arg_extreme(jnp.reshape(x, (-1,)), 0, largest).astype(jnp.int64)
        return jnp.reshape(index, (1,) * x.ndim if keepdim else ())
    axis = canonical_dim(dim, x.ndim)
    index = device_calls.arg_extreme(x, axis, largest).astype(jnp.int64)
    return jnp.expand_dims(index, axis) if keepdim else index


@register_lowering(aten.argmax)
def argmax(x, dim=None, keepdim=False):
    return _arg_extreme(x, dim, keepdim, largest=True)


@register_lowering(aten.argmin)
def argmin(x, dim=None, keepdim=False):
    return _arg_extreme(x, dim, keepdim, largest=False)


@register_lowering(aten.max.dim)
def max_dim(x, dim, keepdim=False):
    return amax(x, [dim], keepdim), argmax(x, dim, keepdim)


@register_lowering(aten.min.dim)
def min_dim(x, dim, keepdim=False):
    return amin(x, [dim], keepdim), argmin(x, dim, keepdim)


@register_lowering(aten.max.default)
def max_all(x):
    return jnp.max(x)


@register_lowering(aten.min.default)
def min_all(x):
    return jnp.min(x)


@register_lowering(aten.var.correction, aten.var.dim)
def var(x, dim=None, *, correction=None, keepdim=False, unbiased=None):
    return _var(x, dim, correction, keepdim, out_dtype())


def _var(x, dim, correction, keepdim, result):
    # Written out (not jnp.var) so that no float64 constant leaks into the module under x64 tracing.
    acc = _acc_dtype(result)
    axes = _axes(x, dim)
    xs = convert(x, acc)
    n = math.prod(x.shape[a] for a in axes)
    centered = lax.sub(xs, lax.div(jnp.sum(xs, axis=axes, keepdims=True), jnp.asarray(n, acc)))
    squares = jnp.sum(lax.mul(centered, centered), axis=axes, keepdims=keepdim)
    ddof = 1 if correction is None else correction
    return convert(lax.div(squares, jnp.asarray(max(n - ddof, 0), acc)), result)


@register_lowering(aten.var_mean.correction)
def var_mean(x, dim=None, *, correction=None, keepdim=False):
    result = out_dtype(1)
    m = convert(jnp.mean(convert(x, _acc_dtype(result)), axis=_axes(x, dim), keepdims=keepdim), result)
    return _var(x, dim, correction, keepdim, out_dtype(0)), m


@register_lowering(aten.any.dim, aten.any.default, aten.any.dims)
def reduce_any(x, dim=None, keepdim=False):
    return jnp.any(x != 0 if x.dtype != jnp.bool_ else x, axis=_axes(x, dim), keepdims=keepdim)


@register_lowering(aten.all.dim, aten.all.default, aten.all.dims)
def reduce_all(x, dim=None, keepdim=False):
    return jnp.all(x != 0 if x.dtype != jnp.bool_ else x, axis=_axes(x, dim), keepdims=keepdim)
