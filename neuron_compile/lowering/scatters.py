"""Writes torch has no decomposition for: as_strided_scatter (static positions) and index_reduce
(scatter_reduce along one dim).

as_strided_scatter's positions are known while tracing (sizes, strides and offset are static), so it is a
gather of ``src`` at constant indices and a select, with no scatter. index_reduce of floats is scatter_reduce
with the index broadcast over the other dims (``indexing.scatter_reduce``), computed in float32 for 16-bit
floats and rounded once (eager rounds after every update, so bfloat16 results can differ by an ulp, towards
the exact value); of integers, a one-hot selection and a reduction (no integer scatter on the device).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .indexing import reduce_identity, scatter_reduce
from .registry import Unsupported, current, register_lowering
from .semantics import canonical_dim, convert, is_float, opmath_dtype, out_shape

aten = torch.ops.aten


def _storage_positions(shape, stride, offset: int) -> np.ndarray:
    """The storage position of each element of a (shape, stride, offset) view, in row-major order."""
    pos = np.full((), offset, np.int64)
    for n, st in zip(shape, stride):
        pos = np.add.outer(pos, np.arange(int(n), dtype=np.int64) * int(st))
    return pos.reshape(-1)


@register_lowering(aten.as_strided_scatter)
def as_strided_scatter(x, src, size, stride, storage_offset=None):
    """Eager clones ``x`` (keeping its strides) and copies ``src`` into ``clone.as_strided(size, stride,
    storage_offset)``; the clone's storage layout is the node's output layout, so each output element whose
    storage position the view covers takes the ``src`` element written there."""
    out = current().out
    out_pos = _storage_positions(out.shape, out.stride(), int(out.storage_offset()))
    if np.unique(out_pos).size != out_pos.size:
        raise Unsupported("as_strided_scatter into a tensor whose elements overlap in storage")
    offset = int(out.storage_offset()) if storage_offset is None else int(storage_offset)
    view_pos = _storage_positions(size, stride, offset)
    logical = {int(p): j for j, p in enumerate(out_pos)}
    if any(int(p) not in logical for p in view_pos):
        raise Unsupported(
            f"as_strided_scatter with size={list(size)}, stride={list(stride)}, storage_offset={offset} writes "
            f"storage outside the {list(out.shape)} elements of its input"
        )
    source = np.full(out_pos.size, -1, np.int64)
    for k, p in enumerate(view_pos):  # a later write to the same position wins, as in eager's copy_
        source[logical[int(p)]] = k
    flat = jnp.reshape(x, (-1,))
    if view_pos.size == 0:
        return jnp.reshape(flat, out_shape())
    values = jnp.reshape(jnp.broadcast_to(convert(src, x.dtype), tuple(size)), (-1,))
    index = jnp.asarray(np.maximum(source, 0).astype(np.int32))
    written = jnp.asarray(source >= 0)
    return jnp.reshape(jnp.where(written, jnp.take(values, index, axis=0), flat), out_shape())


@register_lowering(aten.index_reduce)
def index_reduce(x, dim, index, source, reduce, *, include_self=True):
    """``x.index_reduce(dim, index, source, reduce)``: ``source``'s slice i along ``dim`` is reduced
    ('prod', 'mean', 'amax', 'amin') into ``x``'s slice ``index[i]``."""
    xs = jnp.reshape(x, (1,)) if x.ndim == 0 else x
    src = jnp.reshape(source, (1,)) if source.ndim == 0 else source
    axis = canonical_dim(dim, xs.ndim)
    dims = [1] * src.ndim
    dims[axis] = src.shape[axis]
    full_index = jnp.broadcast_to(jnp.reshape(convert(index, jnp.int64), dims), src.shape)
    if is_float(x.dtype):
        acc = opmath_dtype(x.dtype)
        out = scatter_reduce(convert(xs, acc), axis, full_index, convert(src, acc), reduce, include_self=include_self)
        return jnp.reshape(convert(out, x.dtype), x.shape)
    return jnp.reshape(_index_reduce_one_hot(xs, axis, convert(index, jnp.int32), src, reduce, include_self), x.shape)


_REDUCERS = {"prod": (jnp.prod, lax.mul), "amax": (jnp.max, lax.max), "amin": (jnp.min, lax.min)}


def _index_reduce_one_hot(x, axis, index, src, reduce, include_self):
    """index_reduce of integers without a scatter (neuronx-cc has no integer scatter reduction): a one-hot
    [target, source] compare selects, for every target slice, the source slices reduced into it
    (identity elsewhere), then one reduction over the sources. The intermediate is target x source x the
    other dims: fine for the small tables integer index_reduce meets."""
    x0, s0 = jnp.moveaxis(x, axis, 0), jnp.moveaxis(src, axis, 0)
    t = x0.shape[0]
    index = jnp.where(index < 0, index + t, index)
    hit = index[None, :] == lax.broadcasted_iota(jnp.int32, (t, 1), 0)  # [T, I]
    hit = jnp.reshape(hit, hit.shape + (1,) * (x0.ndim - 1))
    count = jnp.sum(hit, axis=1, dtype=x.dtype)  # [T, 1...]
    if reduce == "mean":
        # jnp sums and multiplies small integers in a wider type; eager wraps in x's: the same mod 2**bits
        total = jnp.sum(jnp.where(hit, s0[None], jnp.zeros((), x.dtype)), axis=1).astype(x.dtype)
        if include_self:
            total, count = total + x0, count + 1
        out = jnp.floor_divide(total, jnp.maximum(count, 1))  # eager's integer mean floors
        out = out if include_self else jnp.where(count > 0, out, x0)
    elif reduce in _REDUCERS:
        reduce_all, combine = _REDUCERS[reduce]
        identity = jnp.asarray(reduce_identity(x.dtype, reduce), x.dtype)
        reduced = reduce_all(jnp.where(hit, s0[None], identity), axis=1).astype(x.dtype)
        out = combine(reduced, x0) if include_self else jnp.where(count > 0, reduced, x0)
    else:
        raise Unsupported(f"index_reduce with reduce='{reduce}' (torch takes prod, mean, amax, amin)")
    return jnp.moveaxis(out, 0, axis)
