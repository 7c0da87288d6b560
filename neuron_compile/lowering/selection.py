"""Selections with a static output shape: mode, nanmedian, nonzero_static.

mode and nanmedian are a stable sort (``sorting.sort_along``: integer keys, NaN last) plus a run-length
scan or a position computed from the NaN count, then a gather at that position. nonzero_static ranks the
nonzero elements with a prefix sum and picks the row of each rank by a one-hot compare (no data-dependent
shape, no scatter).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .registry import Unsupported, register_lowering
from .scan import associative_scan
from .semantics import canonical_dim, convert, is_float, out_shape
from .sorting import order_statistic, sort_along, take_at

aten = torch.ops.aten


def _as_1d(x: Any) -> Any:
    return jnp.reshape(x, (1,)) if x.ndim == 0 else x


@register_lowering(aten.mode.default)
def mode(x, dim=-1, keepdim=False):
    """The most frequent value along ``dim`` and an index of it, as eager's CPU kernel picks them: the
    values are sorted, runs of equal values counted, and the first run (smallest value) of the largest
    count wins; its index is the run's last element in the sorted order, which for eager's sort of up to
    16 elements (an insertion sort: stable) is the value's last occurrence, as in this stable sort. Each
    NaN is a run of its own (eager compares with ``!=``); eager's own sort of NaNs is not an order, so
    rows holding NaN can differ from eager."""
    xs = _as_1d(x)
    axis = canonical_dim(dim, xs.ndim)
    n = xs.shape[axis]
    values, positions = sort_along(xs, axis)
    iota = lax.broadcasted_iota(jnp.int32, xs.shape, axis)
    # a static roll is a slice and a concatenate
    ends = jnp.logical_or(values != jnp.roll(values, -1, axis), iota == n - 1)
    starts = jnp.logical_or(jnp.roll(ends, 1, axis), iota == 0)
    (first,) = associative_scan(lambda a, b: [lax.max(a[0], b[0])], [jnp.where(starts, iota, 0)], axis)
    count = jnp.where(ends, iota - first + 1, 0)
    best = jnp.max(count, axis=axis, keepdims=True)
    winner = jnp.min(jnp.where(count == best, iota, n), axis=axis, keepdims=True)
    return take_at(values, positions, axis, winner, keepdim, out_shape(0))


def _nanmedian_position(x: Any, axis: int) -> Any:
    """The lower median of the non-NaN elements, which a NaN-last sort puts at ((n - nans) - 1) // 2;
    an all-NaN row gives position 0 (its first NaN), as eager's C++ division truncates -1 // 2 to 0."""
    n = x.shape[axis]
    if not is_float(x.dtype):
        return (n - 1) // 2
    nans = jnp.sum(jnp.isnan(x), axis=axis, keepdims=True, dtype=jnp.int32)
    return lax.div(jnp.maximum(n - nans - 1, 0), jnp.int32(2))


@register_lowering(aten.nanmedian.dim)
def nanmedian_dim(x, dim, keepdim=False):
    return order_statistic(x, _nanmedian_position, dim, keepdim)


@register_lowering(aten.nanmedian.default)
def nanmedian(x):
    return order_statistic(x, _nanmedian_position)


@register_lowering(aten.nonzero_static.default)
def nonzero_static(x, *, size, fill_value=-1):
    """The first ``size`` nonzero positions in row-major order as int64[size, x.ndim], rows past the
    number of nonzeros filled with ``fill_value`` (torch's static-shape ``nonzero``)."""
    if size < 0:
        raise Unsupported(f"nonzero_static with size={size}: size must be non-negative")
    shape = tuple(x.shape)
    total = int(np.prod(shape, dtype=np.int64))
    if size == 0 or total == 0:
        return jnp.full((size, x.ndim), fill_value, jnp.int64)
    flat = jnp.reshape(x, (total,))
    nonzero = flat != 0 if flat.dtype != jnp.bool_ else flat
    (rank,) = associative_scan(lambda a, b: [lax.add(a[0], b[0])], [convert(nonzero, jnp.int32)], 0)
    rank = rank - 1  # the 0-based rank of each nonzero element
    rows = lax.broadcasted_iota(jnp.int32, (size, 1), 0)
    hit = jnp.logical_and(nonzero[None, :], rank[None, :] == rows)  # [size, total], one True per found row
    found = jnp.any(hit, axis=1)
    index = jnp.sum(jnp.where(hit, lax.broadcasted_iota(jnp.int64, (1, total), 1), 0), axis=1)
    coords = []
    for extent, stride in zip(shape, np.cumprod((1,) + shape[::-1])[::-1][1:]):
        coords.append(lax.rem(lax.div(index, jnp.int64(stride)), jnp.int64(extent)))
    out = jnp.stack(coords, axis=1) if coords else jnp.zeros((size, 0), jnp.int64)
    return jnp.where(found[:, None], out, jnp.int64(fill_value))
