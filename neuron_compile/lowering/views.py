"""Views and layout: in a functionalized graph a view is just a value, so each is a pure reshape/
transpose/slice of its input. Aliasing with inputs is restored by AOTAutograd's runtime wrappers."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .registry import Unsupported, current, register_lowering
from .semantics import canonical_dim, convert, jax_dtype, out_dtype, out_shape

aten = torch.ops.aten


@register_lowering(aten.alias, aten.clone, aten.detach, aten.detach_copy, aten.lift_fresh_copy, aten.contiguous)
def identity(x, *args, **kwargs):
    if isinstance(x, torch.Tensor):
        # A tensor constant of the graph (get_attr, e.g. a literal index list lifted by lift_fresh_copy).
        return convert(jnp.asarray(x.detach().cpu().numpy()), out_dtype())
    return x


@register_lowering(aten.view.default, aten._unsafe_view, aten.reshape, aten.view_copy.default)
def view(x, size):
    return jnp.reshape(x, out_shape())


@register_lowering(aten.view.dtype)
def view_dtype(x, dtype):
    target = jax_dtype(dtype)
    if jnp.dtype(target).itemsize != jnp.dtype(x.dtype).itemsize:
        raise Unsupported("view(dtype) between dtypes of different sizes")
    return lax.bitcast_convert_type(x, target)


@register_lowering(aten.permute, aten.permute_copy)
def permute(x, dims):
    return lax.transpose(x, tuple(canonical_dim(d, x.ndim) for d in dims))


@register_lowering(aten.t, aten.t_copy)
def t(x):
    return x.T if x.ndim == 2 else x


@register_lowering(aten.transpose.int, aten.transpose_copy.int)
def transpose(x, dim0, dim1):
    perm = list(range(x.ndim))
    if x.ndim:
        a, b = canonical_dim(dim0, x.ndim), canonical_dim(dim1, x.ndim)
        perm[a], perm[b] = perm[b], perm[a]
    return lax.transpose(x, tuple(perm))


@register_lowering(aten.expand, aten.expand_copy)
def expand(x, size, *, implicit=False):
    shape = out_shape()
    dims = tuple(range(len(shape) - x.ndim, len(shape)))
    return lax.broadcast_in_dim(x, shape, dims)


@register_lowering(aten.unsqueeze, aten.unsqueeze_copy)
def unsqueeze(x, dim):
    return jnp.reshape(x, out_shape())


@register_lowering(aten.squeeze, aten.squeeze_copy)
def squeeze(x, dim=None):
    return jnp.reshape(x, out_shape())


@register_lowering(aten.slice.Tensor, aten.slice_copy.Tensor)
def slice_dim(x, dim=0, start=None, end=None, step=1):
    d = canonical_dim(dim, x.ndim)
    size = x.shape[d]
    start, stop, step = slice(start, end, step).indices(size)
    stop = max(stop, start)
    return lax.slice_in_dim(x, start, stop, step, axis=d)


@register_lowering(aten.select.int, aten.select_copy.int)
def select(x, dim, index):
    d = canonical_dim(dim, x.ndim)
    index = index % x.shape[d]
    return lax.index_in_dim(x, index, axis=d, keepdims=False)


@register_lowering(aten.cat)
def cat(tensors, dim=0):
    dtype = out_dtype()
    arrays = [convert(t, dtype) for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not arrays:
        return jnp.zeros(out_shape(), dtype)
    d = canonical_dim(dim, arrays[0].ndim)
    return lax.concatenate(arrays, d)


@register_lowering(aten.split_with_sizes, aten.split_with_sizes_copy)
def split_with_sizes(x, split_sizes, dim=0):
    d = canonical_dim(dim, x.ndim)
    out, start = [], 0
    for s in split_sizes:
        out.append(lax.slice_in_dim(x, start, start + s, axis=d))
        start += s
    return out


@register_lowering(aten.split.Tensor, aten.split_copy.Tensor)
def split(x, split_size, dim=0):
    d = canonical_dim(dim, x.ndim)
    n = x.shape[d]
    sizes = [min(split_size, n - s) for s in range(0, n, split_size)] or [0]
    return split_with_sizes(x, sizes, d)


@register_lowering(aten.unbind.int, aten.unbind_copy.int)
def unbind(x, dim=0):
    d = canonical_dim(dim, x.ndim)
    return [lax.index_in_dim(x, i, axis=d, keepdims=False) for i in range(x.shape[d])]


@register_lowering(aten.flip)
def flip(x, dims):
    return lax.rev(x, tuple(canonical_dim(d, x.ndim) for d in dims))


# prims.convert_element_type: Dynamo's cast of a Python float it turned into a float64 scalar input (an
# optimizer's learning rate that a scheduler changes).
@register_lowering(aten._to_copy, torch.ops.prims.convert_element_type.default)
def to_copy(x, *args, **kwargs):
    return convert(x, out_dtype())


@register_lowering(aten.copy)
def copy(x, src, non_blocking=False):
    # Functional copy_: the result has x's shape and dtype and src's values (broadcast).
    src, shape = convert(src, out_dtype()), out_shape()
    if tuple(src.shape) != shape:
        src = lax.broadcast_in_dim(src, shape, tuple(range(len(shape) - src.ndim, len(shape))))
    return src


@register_lowering(aten.diagonal, aten.diagonal_copy)
def diagonal(x, offset=0, dim1=0, dim2=1):
    # Same layout as torch: dim1 and dim2 removed, the diagonal appended as the last dim. A gather with
    # static indices (jnp.diagonal would emit a conditional, which neuronx-cc refuses).
    d1, d2 = canonical_dim(dim1, x.ndim), canonical_dim(dim2, x.ndim)
    rest = [d for d in range(x.ndim) if d not in (d1, d2)]
    x = lax.transpose(x, (*rest, d1, d2))
    n1, n2 = x.shape[-2], x.shape[-1]
    rows, cols = max(0, -offset), max(0, offset)
    length = max(0, min(n1 - rows, n2 - cols))
    flat = (np.arange(length) + rows) * n2 + np.arange(length) + cols
    x = jnp.reshape(x, (*x.shape[:-2], n1 * n2))
    return jnp.take(x, jnp.asarray(flat.astype(np.int32)), axis=-1)


@register_lowering(aten.repeat)
def repeat(x, repeats):
    # Tile as broadcast + reshape: x (padded to len(repeats) dims) is broadcast into interleaved
    # (r0, s0, r1, s1, ...) and the pairs are merged.
    shape = (1,) * (len(repeats) - x.ndim) + tuple(x.shape)
    x = jnp.reshape(x, shape)
    interleaved = tuple(v for r, s in zip(repeats, shape) for v in (r, s))
    x = lax.broadcast_in_dim(x, interleaved, tuple(range(1, 2 * len(shape), 2)))
    return jnp.reshape(x, out_shape())


@register_lowering(aten.as_strided, aten.as_strided_copy)
def as_strided(x, size, stride, storage_offset=None):
    """as_strided reads x's storage. The runtime holds x in logical (row-major) order, so the storage
    positions are mapped back to logical elements at trace time (shapes and strides are static)."""
    base = current().node.args[0].meta["val"]
    in_offset = int(base.storage_offset())
    in_pos = np.full((), in_offset, np.int64)
    for n, st in zip(base.shape, base.stride()):
        in_pos = np.add.outer(in_pos, np.arange(int(n), dtype=np.int64) * int(st))
    in_pos = in_pos.reshape(-1)
    if np.unique(in_pos).size != in_pos.size:
        raise Unsupported("as_strided of a tensor whose elements overlap in storage")
    logical = np.full(int(in_pos.max(initial=in_offset)) + 1, -1, np.int64)
    logical[in_pos] = np.arange(in_pos.size)
    offset = in_offset if storage_offset is None else int(storage_offset)
    out_pos = np.full((), offset, np.int64)
    for n, st in zip(size, stride):
        out_pos = np.add.outer(out_pos, np.arange(int(n), dtype=np.int64) * int(st))
    out_pos = out_pos.reshape(-1)
    if out_pos.size and (out_pos.max() >= logical.size or (logical[out_pos] < 0).any()):
        raise Unsupported("as_strided reads storage outside the elements of its input")
    index = logical[out_pos].astype(np.int32 if in_pos.size < 2**31 else np.int64)
    return jnp.reshape(jnp.take(jnp.reshape(x, (-1,)), jnp.asarray(index), axis=0), out_shape())
