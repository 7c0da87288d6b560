"""Scans along one dimension: cumsum, cumprod, logcumsumexp, cummax/cummin (values and indices).

All scans are one Hillis-Steele scan built from slice + pad + select (ops every Neuron compiler takes),
log2(n) steps of ``y[i] = combine(y[i - k], y[i])``. Eager scans sequentially, so floating-point sums and
products are rounded in a different order (differences of a few ulps of the partial results); max/min
scans are exact. Low-precision floats scan in float32 and round once, as eager's opmath does.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax.numpy as jnp
import torch
from jax import lax

from .registry import register_lowering
from .semantics import canonical_dim, convert, is_float, opmath_dtype, out_dtype

aten = torch.ops.aten

Combine = Callable[[Sequence[Any], Sequence[Any]], Sequence[Any]]


def _shift(x: Any, k: int, axis: int) -> Any:
    """``x`` moved ``k`` places forward along ``axis`` (the first ``k`` places hold zeros)."""
    n = x.shape[axis]
    kept = lax.slice_in_dim(x, 0, n - k, axis=axis)
    config = [(0, 0, 0)] * x.ndim
    config[axis] = (k, 0, 0)
    return lax.pad(kept, jnp.zeros((), x.dtype), config)


def associative_scan(combine: Combine, xs: Sequence[Any], axis: int) -> list[Any]:
    """Inclusive scan of the tuple ``xs`` along ``axis``; ``combine(earlier, later)`` must be associative."""
    xs = list(xs)
    n = xs[0].shape[axis]
    pos = lax.broadcasted_iota(jnp.int32, xs[0].shape, axis)
    k = 1
    while k < n:
        earlier = [_shift(x, k, axis) for x in xs]
        merged = combine(earlier, xs)
        valid = pos >= k
        xs = [lax.select(valid, m, x) for m, x in zip(merged, xs)]
        k *= 2
    return xs


def _scan1(x: Any, dim: int, combine: Callable[[Any, Any], Any], compute: Any) -> Any:
    if x.ndim == 0:
        return convert(x, out_dtype())
    (y,) = associative_scan(lambda a, b: [combine(a[0], b[0])], [convert(x, compute)], canonical_dim(dim, x.ndim))
    return convert(y, out_dtype())


@register_lowering(aten.cumsum)
def cumsum(x, dim, *, dtype=None):
    return _scan1(x, dim, lax.add, opmath_dtype(out_dtype()))


@register_lowering(aten.cumprod)
def cumprod(x, dim, *, dtype=None):
    return _scan1(x, dim, lax.mul, opmath_dtype(out_dtype()))


def _log_add_exp(a: Any, b: Any) -> Any:
    # Mirrors eager's _log_add_exp_helper: NaN propagates, and two equal infinities stay that infinity
    # (log1p(exp(inf - inf)) would be NaN).
    nan_b = jnp.isnan(b)
    lo = jnp.where(nan_b, b, lax.min(a, b))
    hi = jnp.where(nan_b, b, lax.max(a, b))
    finite = (lo != hi) | jnp.isfinite(lo)
    return jnp.where(finite, hi + lax.log1p(lax.exp(lo - hi)), a)


@register_lowering(aten.logcumsumexp)
def logcumsumexp(x, dim):
    return _scan1(x, dim, _log_add_exp, opmath_dtype(out_dtype()))


def _cum_extreme(x: Any, dim: int, later_wins: Callable[[Any, Any], Any]) -> tuple[Any, Any]:
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    axis = canonical_dim(dim, x.ndim)
    idx = lax.broadcasted_iota(jnp.int64, x.shape, axis)

    def combine(a, b):
        take_b = later_wins(a[0], b[0])
        return [lax.select(take_b, b[0], a[0]), lax.select(take_b, b[1], a[1])]

    values, indices = associative_scan(combine, [x, idx], axis)
    return values, indices


def _nan(x: Any) -> Any:
    return jnp.isnan(x) if is_float(x.dtype) else jnp.zeros(x.shape, jnp.bool_)


# Eager updates the running extreme when the new value is NaN or compares >= (<=) to it: ties and NaNs
# move the index to the latest position. That is a max under "NaN is largest, later wins ties", which is
# associative, so it scans in any grouping.
@register_lowering(aten.cummax)
def cummax(x, dim):
    return _cum_extreme(x, dim, lambda a, b: _nan(b) | (~_nan(a) & (b >= a)))


@register_lowering(aten.cummin)
def cummin(x, dim):
    return _cum_extreme(x, dim, lambda a, b: _nan(b) | (~_nan(a) & (b <= a)))
