"""Views and layout: in a functionalized graph a view is just a value, so each is a pure reshape/
transpose/slice of its input. Aliasing with inputs is restored by AOTAutograd's runtime wrappers."""

from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax

from .registry import Unsupported, register_lowering
from .semantics import convert, jax_dtype, out_dtype, out_shape

aten = torch.ops.aten


def _dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


@register_lowering(aten.alias, aten.clone, aten.detach, aten.lift_fresh_copy, aten.contiguous)
def identity(x, *args, **kwargs):
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
    return lax.transpose(x, tuple(_dim(d, x.ndim) for d in dims))


@register_lowering(aten.t, aten.t_copy)
def t(x):
    return x.T if x.ndim == 2 else x


@register_lowering(aten.transpose.int, aten.transpose_copy.int)
def transpose(x, dim0, dim1):
    perm = list(range(x.ndim))
    if x.ndim:
        a, b = _dim(dim0, x.ndim), _dim(dim1, x.ndim)
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
def slice_(x, dim=0, start=None, end=None, step=1):
    d = _dim(dim, x.ndim)
    size = x.shape[d]
    start, stop, step = slice(start, end, step).indices(size)
    stop = max(stop, start)
    return lax.slice_in_dim(x, start, stop, step, axis=d)


@register_lowering(aten.select.int, aten.select_copy.int)
def select(x, dim, index):
    d = _dim(dim, x.ndim)
    index = index % x.shape[d]
    return lax.index_in_dim(x, index, axis=d, keepdims=False)


@register_lowering(aten.cat)
def cat(tensors, dim=0):
    dtype = out_dtype()
    arrays = [convert(t, dtype) for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not arrays:
        return jnp.zeros(out_shape(), dtype)
    d = _dim(dim, arrays[0].ndim)
    return lax.concatenate(arrays, d)


@register_lowering(aten.split_with_sizes, aten.split_with_sizes_copy)
def split_with_sizes(x, split_sizes, dim=0):
    d = _dim(dim, x.ndim)
    out, start = [], 0
    for s in split_sizes:
        out.append(lax.slice_in_dim(x, start, start + s, axis=d))
        start += s
    return out


@register_lowering(aten.split.Tensor, aten.split_copy.Tensor)
def split(x, split_size, dim=0):
    d = _dim(dim, x.ndim)
    n = x.shape[d]
    sizes = [min(split_size, n - s) for s in range(0, n, split_size)] or [0]
    return split_with_sizes(x, sizes, d)


@register_lowering(aten.unbind.int, aten.unbind_copy.int)
def unbind(x, dim=0):
    d = _dim(dim, x.ndim)
    return [lax.index_in_dim(x, i, axis=d, keepdims=False) for i in range(x.shape[d])]


@register_lowering(aten.flip)
def flip(x, dims):
    return lax.rev(x, tuple(_dim(d, x.ndim) for d in dims))


@register_lowering(aten._to_copy)
def to_copy(x, *args, **kwargs):
    return convert(x, out_dtype())
