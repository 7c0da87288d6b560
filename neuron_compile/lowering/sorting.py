"""Sorting and selection: sort (stable, descending), topk, kthvalue, median.

The Neuron compiler accepts sort comparators LE/GE/LT/GT only, so a float comparator that orders NaN
(jax's TOTALORDER compare) is not an option. Every sort here therefore sorts on an integer key with a
plain signed LT, carrying values and positions as extra operands (a stable sort):

- floats: the IEEE bits read as a signed integer, with the magnitude bits of negative numbers flipped,
  order exactly like the numbers; -0.0 is first made +0.0 (eager sorts them as equal) and every NaN gets
  the largest key, so NaN sorts last ascending and first descending, as in torch.
- descending: the key's bitwise complement (an exact order reversal, no overflow); stability keeps equal
  elements in their original order, as eager's stable sort does.

topk, kthvalue and median are a sort plus a slice (TopK on the device refuses integers and large k).

Ties: every op here returns equal elements in their original order (stable), which is exactly eager's
``stable=True``. Where torch leaves the tie order unspecified (``sort``/``argsort`` with stable=False,
``topk``, ``kthvalue``), eager's CPU kernels pick it with libstdc++'s introsort / nth_element / partial_sort,
whose order of equal keys depends on the data's history through the algorithm and cannot be reproduced by
a sorting network; the stable order is one of the results torch allows (same values, indices of equal
elements), so those indices can differ from eager's on ties only.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import torch
from jax import lax

from . import device_calls
from .registry import register_lowering
from .semantics import canonical_dim, convert, is_array, is_float, out_dtype, out_shape

aten = torch.ops.aten


def sort_key(x: Any, descending: bool = False) -> Any:
    """An integer array whose signed order is torch's sort order of ``x`` (NaN largest)."""
    if is_float(x.dtype):
        f = convert(x, jnp.float32)  # bf16/f16 are exact in float32; float64 is computed as float32
        f = jnp.where(f == 0, jnp.zeros_like(f), f)
        bits = lax.bitcast_convert_type(f, jnp.int32)
        key = jnp.where(bits < 0, lax.bitwise_xor(bits, jnp.int32(0x7FFFFFFF)), bits)
        key = jnp.where(jnp.isnan(f), jnp.int32(0x7FFFFFFF), key)
    elif x.dtype == jnp.int64:
        key = x
    elif x.dtype == jnp.uint32:
        key = convert(x, jnp.int64)
    else:
        key = convert(x, jnp.int32)
    return lax.bitwise_not(key) if descending else key


def sort_along(x: Any, axis: int, descending: bool = False) -> tuple[Any, Any]:
    """(values, int64 positions) of a stable sort of ``x`` along ``axis``."""
    pos = lax.broadcasted_iota(jnp.int32, x.shape, axis)
    _, values, indices = lax.sort((sort_key(x, descending), x, pos), dimension=axis, num_keys=1, is_stable=True)
    return values, convert(indices, jnp.int64)


def _sorted(x: Any, dim: int, descending: bool) -> tuple[Any, Any, int]:
    xs = jnp.reshape(x, (1,)) if x.ndim == 0 else x
    axis = canonical_dim(dim, xs.ndim)
    values, indices = sort_along(xs, axis, descending)
    return values, indices, axis


@register_lowering(aten.sort.default, aten.sort.stable)
def sort(x, dim=-1, descending=False, *, stable=None):
    # ``stable`` is keyword-only in sort.stable; the positional form (sort.default) has none.
    values, indices, _ = _sorted(x, dim, descending)
    return jnp.reshape(values, x.shape), jnp.reshape(indices, x.shape)


#: The largest k neuronx-cc's TopK takes (NEURONX_CC_OPS.md).
_DEVICE_TOPK_MAX_K = 16384


def top_k(x: Any, k: int, axis: int, largest: bool = True) -> tuple[Any, Any]:
    """(values, int positions) of the ``k`` largest (or smallest) elements along ``axis``, in order, ties in
    their original order. Floats are emitted as AwsNeuronTopK (device_calls), the form the device takes (the
    CPU target runs a sort + slice); integers and k > 16384, which the device's TopK refuses, are a sort +
    slice on both targets."""

    def reference(v):  # ``v``: x with the top-k axis moved last
        values, indices = sort_along(v, v.ndim - 1, largest)
        pick = lambda a: lax.slice_in_dim(a, 0, k, axis=v.ndim - 1)  # noqa: E731
        return pick(values), pick(indices)

    if is_float(x.dtype) and k <= _DEVICE_TOPK_MAX_K:
        return device_calls.topk(x, k, axis, largest, reference)
    # The device's TopK refuses integers and k past its limit; a sort and a slice is what it takes instead.
    values, indices = reference(jnp.moveaxis(x, axis, -1))
    return jnp.moveaxis(values, -1, axis), jnp.moveaxis(indices, -1, axis)


@register_lowering(aten.topk)
def topk(x, k, dim=-1, largest=True, sorted=True):
    # sorted=False lets torch return the k elements in any order; sorted order is one of them.
    xs = jnp.reshape(x, (1,)) if x.ndim == 0 else x
    values, indices = top_k(xs, k, canonical_dim(dim, xs.ndim), largest)
    shape = out_shape(0)
    return jnp.reshape(values, shape), jnp.reshape(convert(indices, jnp.int64), shape)


def take_at(values: Any, indices: Any, axis: int, position: Any, keepdim: bool, shape: Any) -> tuple[Any, Any]:
    if isinstance(position, int):
        v = lax.index_in_dim(values, position, axis, keepdims=True)
        i = lax.index_in_dim(indices, position, axis, keepdims=True)
    else:
        v = jnp.take_along_axis(values, position, axis=axis, mode="clip")
        i = jnp.take_along_axis(indices, position, axis=axis, mode="clip")
    return jnp.reshape(v, shape), jnp.reshape(i, shape)


@register_lowering(aten.kthvalue)
def kthvalue(x, k, dim=-1, keepdim=False):
    values, indices, axis = _sorted(x, dim, False)
    return take_at(values, indices, axis, k - 1, keepdim, out_shape(0))


def _median_position(x: Any, axis: int) -> Any:
    """Eager's median is the lower median, unless the row holds a NaN: then it is the row's first NaN,
    which a NaN-last stable sort puts at position n - (number of NaNs)."""
    n = x.shape[axis]
    middle = (n - 1) // 2
    if not is_float(x.dtype):
        return middle
    nans = jnp.sum(jnp.isnan(x), axis=axis, keepdims=True, dtype=jnp.int32)
    return jnp.where(nans > 0, n - nans, middle)


def order_statistic(x: Any, position_of: Any, dim: int | None = None, keepdim: bool = False) -> Any:
    """The element of ``x`` at sorted position ``position_of(xs, axis)`` along ``dim`` (ascending, NaN last)
    and its index; with ``dim=None``, over the flattened tensor, the value alone (median/nanmedian)."""
    if dim is None:
        flat = jnp.reshape(x, (-1,))
        values, indices = sort_along(flat, 0)
        return take_at(values, indices, 0, position_of(flat, 0), False, ())[0]
    values, indices, axis = _sorted(x, dim, False)
    xs = jnp.reshape(x, (1,)) if x.ndim == 0 else x
    return take_at(values, indices, axis, position_of(xs, axis), keepdim, out_shape(0))


@register_lowering(aten.median.dim)
def median_dim(x, dim, keepdim=False):
    return order_statistic(x, _median_position, dim, keepdim)


@register_lowering(aten.median.default)
def median(x):
    return order_statistic(x, _median_position)


# ---- searching a sorted sequence ----------------------------------------------------------------------
def _search(seq: Any, values: Any, right: bool) -> Any:
    """searchsorted as a count: the position eager's binary search finds is the number of elements for
    which its step predicate holds (``!(s >= v)`` left, ``!(s > v)`` right), so NaN values land at the end
    as in eager. A compare of every value with every boundary: fine for the boundary counts models use."""
    if not is_array(values):
        # a Python number is a wrapped number in torch: it does not widen a float sequence's dtype
        exact = is_float(seq.dtype) or isinstance(values, (bool, int))
        values = jnp.asarray(values, seq.dtype if exact else jnp.float32)
    common = jnp.promote_types(seq.dtype, values.dtype)
    seq, values = convert(seq, common), convert(values, common)
    if seq.ndim == 1:
        bounds = jnp.reshape(seq, (1,) * values.ndim + seq.shape)
    else:
        bounds = seq[..., None, :]
    v = values[..., None]
    holds = jnp.logical_not(bounds > v) if right else jnp.logical_not(bounds >= v)
    # int32 or int64 as ``out_int32`` says, read from the node's result
    return jnp.sum(holds, axis=-1, dtype=out_dtype())


@register_lowering(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def searchsorted(seq, values, *, out_int32=False, right=False, side=None, sorter=None):
    if sorter is not None:
        seq = jnp.take_along_axis(seq, sorter, axis=-1)
    return _search(seq, values, bool(right) or side == "right")


@register_lowering(aten.bucketize.Tensor, aten.bucketize.Scalar)
def bucketize(values, boundaries, *, out_int32=False, right=False):
    return _search(boundaries, values, right)
