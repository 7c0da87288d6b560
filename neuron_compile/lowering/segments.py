"""Reductions over data-defined groups with static shapes: segment_reduce (and its backward), histogram.

The segment (or bin) of each position is data; the number of segments (bins) and every shape are static.
So each is a one-hot mask [segments x positions] built by comparing positions (values) with the segment
bounds (bin edges), a select of the data or of the reduction's identity, and one reduction over positions:
compare, select and reduce, with no scatter and no data-dependent shape. The masks are segments x
positions large, which suits the sizes these ops meet (a few hundred segments or bins).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import torch
from jax import lax

from .histograms import _count
from .registry import Unsupported, register_lowering
from .scan import associative_scan
from .semantics import convert, is_float, opmath_dtype, out_dtype

aten = torch.ops.aten


# ---- segment_reduce ----------------------------------------------------------------------------------------
def _segment_bounds(lengths: Any, offsets: Any) -> tuple[Any, Any]:
    """int32 (start, end) of every segment, shaped like the leading dims plus [segments]."""
    if offsets is not None:
        offsets = convert(offsets, jnp.int32)
        s, last = offsets.shape[-1], offsets.ndim - 1
        return lax.slice_in_dim(offsets, 0, s - 1, axis=last), lax.slice_in_dim(offsets, 1, s, axis=last)
    if lengths is None:
        raise Unsupported("segment_reduce needs lengths or offsets (indices are not supported, as in eager)")
    lengths = convert(lengths, jnp.int32)
    (end,) = associative_scan(lambda a, b: [lax.add(a[0], b[0])], [lengths], lengths.ndim - 1)
    return lax.sub(end, lengths), end


def _segment_mask(lengths: Any, offsets: Any, data: Any, axis: int) -> Any:
    """bool[lead..., S, N, 1...]: position n of ``data``'s ``axis`` lies in segment s."""
    start, end = _segment_bounds(lengths, offsets)
    n = data.shape[axis]
    pos = lax.broadcasted_iota(jnp.int32, (1,) * start.ndim + (n,), start.ndim)
    mask = lax.bitwise_and(lax.ge(pos, start[..., None]), lax.lt(pos, end[..., None]))
    return jnp.reshape(mask, mask.shape + (1,) * (data.ndim - axis - 1))


def _identity(reduce: str, dtype: Any) -> Any:
    if reduce in ("sum", "mean"):
        return jnp.asarray(0, dtype)
    if reduce == "prod":
        return jnp.asarray(1, dtype)
    if reduce in ("max", "min") and is_float(dtype):
        return jnp.asarray(-jnp.inf if reduce == "max" else jnp.inf, dtype)
    if reduce in ("max", "min"):
        return jnp.asarray(jnp.iinfo(dtype).min if reduce == "max" else jnp.iinfo(dtype).max, dtype)
    raise Unsupported(f"segment_reduce with reduce='{reduce}' (torch takes sum, mean, prod, max, min)")


def _segment_axis(data: Any, lengths: Any, offsets: Any, axis: int) -> int:
    bounds = lengths if lengths is not None else offsets
    if bounds is None:
        raise Unsupported("segment_reduce needs lengths or offsets (indices are not supported, as in eager)")
    axis = axis % data.ndim
    if bounds.ndim != axis + 1:
        raise Unsupported(f"segment_reduce with axis={axis} and lengths/offsets of rank {bounds.ndim}")
    return axis


@register_lowering(aten.segment_reduce)
def segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    """Eager's CPU kernel per segment: start from ``initial`` (or the reduction's identity), fold in the
    segment's elements (NaN wins max/min), and for 'mean' divide by the segment length; an empty segment is
    ``initial``, or NaN for 'mean' without it. Computed in float32 for 16-bit floats, rounded once."""
    if indices is not None:
        raise Unsupported("segment_reduce with indices (eager supports lengths and offsets only)")
    axis = _segment_axis(data, lengths, offsets, axis)
    acc = opmath_dtype(data.dtype)
    x = jnp.expand_dims(convert(data, acc), axis)  # [lead..., 1, N, rest...]
    mask = _segment_mask(lengths, offsets, data, axis)  # [lead..., S, N, 1...]
    identity = _identity(reduce, acc)
    picked = jnp.where(mask, x, identity)
    start = identity if initial is None else jnp.asarray(initial, acc)
    if reduce in ("sum", "mean"):
        out = jnp.sum(picked, axis=axis + 1) + start
    elif reduce == "prod":
        out = jnp.prod(picked, axis=axis + 1) * start
    elif reduce == "max":
        out = jnp.maximum(jnp.max(picked, axis=axis + 1), start)
    else:
        out = jnp.minimum(jnp.min(picked, axis=axis + 1), start)
    if reduce == "mean":
        count = jnp.sum(mask, axis=axis + 1, dtype=acc)
        empty = jnp.asarray(jnp.nan if initial is None else initial, acc)
        out = jnp.where(count > 0, out / jnp.maximum(count, 1), empty)
    return convert(out, out_dtype())


@register_lowering(aten._segment_reduce_backward)
def segment_reduce_backward(grad, output, data, reduce, *, lengths=None, offsets=None, axis=0, initial=None):
    """The gradient eager's CPU kernel gives each element of ``data``: sum passes the segment's gradient,
    mean divides it by the length, max/min give it to every element equal to the result (or NaN), divided
    by their count only where it is positive (eager's own rule), and prod gives ``grad * output / x``, or
    ``grad`` times the product of the other elements (and ``initial``) where ``x`` is 0 or NaN."""
    axis = _segment_axis(data, lengths, offsets, axis)
    acc = opmath_dtype(data.dtype)
    x = jnp.expand_dims(convert(data, acc), axis)  # [lead..., 1, N, rest...]
    g = jnp.expand_dims(convert(grad, acc), axis + 1)  # [lead..., S, 1, rest...]
    out = jnp.expand_dims(convert(output, acc), axis + 1)
    mask = _segment_mask(lengths, offsets, data, axis)
    zero = jnp.zeros((), acc)
    count = jnp.sum(mask, axis=axis + 1, keepdims=True, dtype=acc)
    if reduce == "sum":
        contribution = g
    elif reduce == "mean":
        contribution = g / jnp.maximum(count, 1)
    elif reduce in ("max", "min"):
        hit = jnp.logical_and(mask, jnp.logical_or(jnp.isnan(x), x == out))
        ties = jnp.sum(hit, axis=axis + 1, keepdims=True, dtype=acc)
        shared = jnp.where(jnp.logical_and(ties >= 2, g > 0), g / jnp.maximum(ties, 1), g)
        contribution = jnp.where(hit, shared, zero)
    elif reduce == "prod":
        special = jnp.logical_or(jnp.isnan(x), x == 0)
        plain = jnp.logical_and(mask, jnp.logical_not(special))
        regular = jnp.prod(jnp.where(plain, x, jnp.ones((), acc)), axis=axis + 1, keepdims=True)
        if initial is not None:
            regular = regular * jnp.asarray(initial, acc)
        zeros = jnp.sum(jnp.logical_and(mask, x == 0), axis=axis + 1, keepdims=True, dtype=jnp.int32)
        nans = jnp.sum(jnp.logical_and(mask, jnp.isnan(x)), axis=axis + 1, keepdims=True, dtype=jnp.int32)
        # the other elements' zeros and NaNs, each element's own left out
        other_zeros = zeros - convert(x == 0, jnp.int32)
        other_nans = nans - convert(jnp.isnan(x), jnp.int32)
        exclusive = regular * jnp.where(other_zeros > 0, zero, jnp.ones((), acc))
        exclusive = jnp.where(other_nans > 0, jnp.asarray(jnp.nan, acc), exclusive)
        contribution = jnp.where(special, g * exclusive, g * out / x)
    else:
        raise Unsupported(f"segment_reduce backward with reduce='{reduce}'")
    result = jnp.sum(jnp.where(mask, contribution, zero), axis=axis)
    return convert(result, out_dtype())


# ---- histogram --------------------------------------------------------------------------------------------
def _linspace(lo: Any, hi: Any, steps: int, dtype: Any) -> Any:
    """Eager's CPU linspace in ``dtype``: ``lo + step * i`` for the first half, ``hi - step * (steps - 1 - i)``
    for the second, with ``step = (hi - lo) / (steps - 1)``."""
    i = lax.broadcasted_iota(dtype, (steps,), 0)
    step = (hi - lo) / jnp.asarray(steps - 1, dtype)
    rev = jnp.asarray(steps - 1, dtype) - i
    return jnp.where(i < steps // 2, lo + step * i, hi - step * rev)


def _histogram(x: Any, edges: Any, weight: Any, density: bool) -> Any:
    """Counts (or weight sums) of ``x`` per bin of ``edges``, eager's rule: an element is in bin ``b`` when
    ``edges[b] <= x < edges[b + 1]``, the last bin closed on the right; elements outside and NaN are not
    counted. ``density`` divides by the total and by each bin's width."""
    flat = jnp.ravel(x)
    bins = edges.shape[0] - 1
    valid = jnp.logical_and(flat >= edges[0], flat <= edges[-1])
    ids = jnp.sum(edges[None, :] <= flat[:, None], axis=1, dtype=jnp.int32) - 1
    ids = jnp.minimum(ids, bins - 1)
    dtype = out_dtype(0)
    hist = _count(ids, valid, bins, None if weight is None else jnp.ravel(weight), dtype)
    if density:
        hist = hist / jnp.sum(hist)
        hist = hist / (lax.slice_in_dim(edges, 1, bins + 1) - lax.slice_in_dim(edges, 0, bins))
    return convert(hist, dtype)


@register_lowering(aten.histogram.bin_ct)
def histogram(x, bins=100, *, range=None, weight=None, density=False):  # noqa: A002 (torch's names)
    """``torch.histogram(x, bins)``: ``bins`` equal bins over ``range`` (default the data's min and max, or
    [0, 1] for no data; an empty range widened by 0.5 on each side), edges as eager's linspace computes
    them."""
    if not is_float(x.dtype):
        raise Unsupported(f"histogram of {jnp.dtype(x.dtype)} (eager supports floating inputs only)")
    dtype = x.dtype
    if range is not None:
        lo, hi = jnp.asarray(range[0], dtype), jnp.asarray(range[1], dtype)
    elif x.size:
        lo, hi = jnp.min(x), jnp.max(x)
    else:  # eager's default range of an empty input
        lo, hi = jnp.zeros((), dtype), jnp.ones((), dtype)
    same = lo == hi
    lo = jnp.where(same, lo - jnp.asarray(0.5, dtype), lo)
    hi = jnp.where(same, hi + jnp.asarray(0.5, dtype), hi)
    edges = _linspace(lo, hi, bins + 1, dtype)
    return _histogram(x, edges, weight, density), edges


@register_lowering(aten.histogram.bins_tensor)
def histogram_bins_tensor(x, bins, *, weight=None, density=False):
    """``torch.histogram(x, edges)``: the bins between consecutive given edges (eager's binary search,
    written as a count of the edges each element reaches)."""
    edges = convert(bins, x.dtype)
    return _histogram(x, edges, weight, density), edges
