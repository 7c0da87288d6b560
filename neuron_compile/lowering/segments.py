"""Reductions over data-defined groups with static shapes: segment_reduce (and its backward), histogram,
embedding_bag (and its backwards).

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

from .histograms import bin_counts
from .nn import embedding_dense_backward
from .reductions import norm_of_magnitudes
from .registry import Unsupported, register_lowering
from .scan import associative_scan
from .semantics import convert, is_float, opmath_dtype, out_dtype, out_shape

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
    hist = bin_counts(ids, valid, bins, None if weight is None else jnp.ravel(weight), dtype)
    if density:
        hist = hist / jnp.sum(hist)
        hist = hist / (lax.slice_in_dim(edges, 1, bins + 1) - lax.slice_in_dim(edges, 0, bins))
    return convert(hist, dtype)


@register_lowering(aten.histogram.bin_ct)
def histogram(x, bins=100, *, range=None, weight=None, density=False):
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


# ---- embedding_bag ----------------------------------------------------------------------------------------
_SUM, _MEAN, _MAX = 0, 1, 2


def _bag_of_each_index(offsets: Any, n: int, bags: int) -> Any:
    """int32[n]: the bag of each position of ``indices``, eager's ``offset2bag``: the last of the first
    ``bags`` offsets at or before the position (positions past the last offset join the last bag)."""
    starts = lax.slice_in_dim(convert(offsets, jnp.int32), 0, bags)
    pos = lax.broadcasted_iota(jnp.int32, (n, 1), 0)
    return jnp.maximum(jnp.sum(starts[None, :] <= pos, axis=1, dtype=jnp.int32) - 1, 0)


def _bag_members(bag: Any, indices: Any, bags: int, padding_idx: int) -> Any:
    """bool[bags, n]: index position i is counted in bag b (its bag, and not the padding index)."""
    keep = indices != jnp.asarray(padding_idx, indices.dtype)
    return jnp.logical_and(bag[None, :] == lax.broadcasted_iota(jnp.int32, (bags, 1), 0), keep[None, :])


@register_lowering(aten._embedding_bag, aten._embedding_bag_forward_only)
def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1):  # fmt: skip
    """``nn.functional.embedding_bag``: the rows of ``weight`` picked by ``indices`` reduced per bag (sum,
    optionally weighted per sample; mean; max), padding entries left out, an empty bag giving zeros.

    sum and mean are one matmul of the [bags x indices] membership (or weight) matrix with the picked rows,
    accumulating in float32; max takes the first row holding each column's maximum, as eager's loop does
    (NaN rows are not ordered as eager's ``>`` leaves them). The three other outputs are eager's
    bookkeeping: ``offset2bag`` (each index's bag), ``bag_size`` (zeros for sum) and ``max_indices`` (the row
    chosen per bag and column for max, else a copy of ``bag_size``).
    """
    n = indices.shape[0]
    bags = out_shape(0)[0]
    acc = opmath_dtype(weight.dtype)
    bag = _bag_of_each_index(offsets, n, bags)
    member = _bag_members(bag, indices, bags, padding_idx)
    size = jnp.sum(member, axis=1, dtype=jnp.int32)
    rows = convert(jnp.take(weight, indices, axis=0, mode="fill"), acc)  # [n, dim]
    if mode in (_SUM, _MEAN):
        coef = jnp.ones((n,), acc) if per_sample_weights is None else convert(per_sample_weights, acc)
        matrix = jnp.where(member, coef[None, :], jnp.zeros((), acc))
        out = lax.dot_general(matrix, rows, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST)
        if mode == _MEAN:
            out = out / convert(jnp.maximum(size, 1), acc)[:, None]
        max_indices = jnp.zeros((bags,), jnp.int32) if mode == _SUM else size
    elif mode == _MAX and n == 0:  # no indices: every bag is empty
        out, max_indices = jnp.zeros((bags, weight.shape[1]), acc), jnp.zeros((bags, weight.shape[1]), jnp.int32)
    elif mode == _MAX:
        values = jnp.where(member[:, :, None], rows[None], jnp.asarray(-jnp.inf, acc))  # [bags, n, dim]
        best = jnp.max(values, axis=1)
        position = lax.broadcasted_iota(jnp.int32, (1, n, 1), 1)
        first = jnp.min(jnp.where(jnp.logical_and(member[:, :, None], values == best[:, None, :]), position, n), axis=1)
        nonempty = (size > 0)[:, None]
        chosen = jnp.take(indices, jnp.minimum(first, n - 1), axis=0)
        max_indices = jnp.where(nonempty, chosen, jnp.zeros((), chosen.dtype))
        out = jnp.where(nonempty, best, jnp.zeros((), acc))
    else:
        raise Unsupported(f"embedding_bag with mode={mode} (0 sum, 1 mean, 2 max)")
    # The bookkeeping outputs take the shapes torch's meta function gives them (bag_size and max_indices
    # have one entry per offset, one more than the bags with include_last_offset; offset2bag is empty on
    # eager's fast path), padded with zeros.
    offset2bag = convert(bag, out_dtype(1)) if out_shape(1)[0] == n else jnp.zeros(out_shape(1), out_dtype(1))
    bag_size = _fit(jnp.zeros((bags,), jnp.int32) if mode == _SUM else size, out_shape(2), out_dtype(2))
    max_indices = _fit(max_indices, out_shape(3), out_dtype(3))
    return convert(out, out_dtype(0)), offset2bag, bag_size, max_indices


def _fit(x: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """``x`` cut or zero-padded along dim 0 to ``shape``."""
    x = convert(x, dtype)
    if x.shape[0] >= shape[0]:
        return lax.slice_in_dim(x, 0, shape[0])
    return lax.pad(x, jnp.zeros((), dtype), [(0, shape[0] - x.shape[0], 0)] + [(0, 0, 0)] * (x.ndim - 1))


def _bag_weight_grad(grad, indices, bag, bag_size, max_indices, num_weights, scale_grad_by_freq, mode,
                     per_sample_weights, padding_idx):  # fmt: skip
    """The dense gradient of ``weight``: each counted index position receives its bag's gradient (times its
    sample weight, or over the bag size for mean; to the chosen row per column for max).

    ``scale_grad_by_freq`` divides by each index's own frequency, as documented and as ``embedding`` does.
    Eager's CPU kernel divides by the frequency of the index found at the row's unique-rank position of the
    sorted indices (``counts[indices_data[i]]`` in EmbeddingBag.cpp), which is the same number only when
    no index smaller than the row's repeats; then the gradients differ from eager's CPU ones."""
    acc = opmath_dtype(grad.dtype)
    g = convert(grad, acc)
    if mode == _MAX:
        nonempty = (convert(bag_size, jnp.int32) > 0)[:, None]
        cols = lax.broadcasted_iota(jnp.int32, g.shape, 1)
        updates = jnp.where(nonempty, g, jnp.zeros((), acc))
        out = jnp.zeros((num_weights, g.shape[1]), acc).at[(max_indices, cols)].add(updates, mode="drop")
        return convert(out, out_dtype())
    rows = jnp.take(g, bag, axis=0)  # [n, dim]: each position's bag gradient
    if mode == _MEAN:
        rows = rows / convert(jnp.maximum(jnp.take(convert(bag_size, jnp.int32), bag), 1), acc)[:, None]
    elif per_sample_weights is not None:
        rows = rows * convert(per_sample_weights, acc)[:, None]
    # embedding's own backward: the scatter-add of the rows, padding and scale_grad_by_freq as eager
    return embedding_dense_backward(rows, indices, num_weights, padding_idx, scale_grad_by_freq)


def _bags_from(offset2bag: Any, offsets: Any, n: int, bags: int) -> Any:
    # eager rebuilds offset2bag from the offsets when the forward returned it empty (the plain sum)
    if offset2bag is not None and offset2bag.shape[0] == n and n:
        return convert(offset2bag, jnp.int32)
    return _bag_of_each_index(offsets, n, bags)


@register_lowering(aten._embedding_bag_backward)
def embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                           scale_grad_by_freq, mode, sparse, per_sample_weights, padding_idx=-1):  # fmt: skip
    if sparse:
        raise Unsupported("embedding_bag with sparse=True (a sparse gradient): use sparse=False")
    bag = _bags_from(offset2bag, offsets, indices.shape[0], grad.shape[0])
    return _bag_weight_grad(grad, indices, bag, bag_size, maximum_indices, num_weights, scale_grad_by_freq, mode,
                            per_sample_weights, padding_idx)  # fmt: skip


@register_lowering(aten._embedding_bag_dense_backward)
def embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                 scale_grad_by_freq, mode, per_sample_weights, padding_idx=-1):  # fmt: skip
    bag = convert(offset2bag, jnp.int32)
    return _bag_weight_grad(grad, indices, bag, bag_size, maximum_indices, num_weights, scale_grad_by_freq, mode,
                            per_sample_weights, padding_idx)  # fmt: skip


@register_lowering(aten._embedding_bag_per_sample_weights_backward)
def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    """The gradient of each sample weight (mode sum only): its bag's gradient dotted with its row, 0 for
    padding entries."""
    if mode != _SUM:
        raise Unsupported(f"embedding_bag per_sample_weights with mode={mode} (eager: sum only)")
    n = indices.shape[0]
    acc = opmath_dtype(grad.dtype)
    bag = _bags_from(offset2bag, offsets, n, grad.shape[0])
    rows = convert(jnp.take(weight, indices, axis=0, mode="fill"), acc)
    bag_grad = jnp.take(convert(grad, acc), bag, axis=0)
    dots = jnp.sum(rows * bag_grad, axis=1)
    keep = indices != jnp.asarray(padding_idx, indices.dtype)
    return convert(jnp.where(keep, dots, jnp.zeros((), acc)), out_dtype())


@register_lowering(aten.embedding_renorm)
def embedding_renorm(weight, indices, max_norm, norm_type):
    """The functional form of ``embedding_renorm_`` (``max_norm=`` of embedding/embedding_bag): every row
    that ``indices`` names and whose ``norm_type``-norm exceeds ``max_norm`` is scaled by
    ``max_norm / (norm + 1e-7)``, as eager's loop over the distinct indices does; the rows are found by a
    one-hot compare, not a scatter."""
    acc = opmath_dtype(weight.dtype)
    w = convert(weight, acc)
    flat = jnp.ravel(indices)
    used = jnp.any(flat[None, :] == lax.broadcasted_iota(flat.dtype, (w.shape[0], 1), 0), axis=1)
    norm = norm_of_magnitudes(jnp.abs(w), norm_type, (1,), False)
    scale = jnp.asarray(max_norm, acc) / (norm + jnp.asarray(1e-7, acc))
    scaled = jnp.logical_and(used, norm > jnp.asarray(max_norm, acc))
    return convert(jnp.where(scaled[:, None], w * scale[:, None], w), out_dtype())
