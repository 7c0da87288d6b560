"""Tensor creation: full/zeros/ones/empty/scalar_tensor/arange/iota. Shapes and dtypes come from the
node's output metadata, which torch has already computed (default dtypes included)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .registry import register_lowering
from .semantics import convert, out_dtype, out_shape

aten = torch.ops.aten


@register_lowering(aten.full.default, aten.new_full)
def full(*args, **kwargs):
    fill = args[-1]
    return jnp.full(out_shape(), fill, out_dtype())


@register_lowering(aten.scalar_tensor)
def scalar_tensor(value, **kwargs):
    return convert(value, out_dtype())


@register_lowering(aten.zeros.default, aten.new_zeros, aten.zeros_like, aten._efficientzerotensor)
def zeros(*args, **kwargs):
    return jnp.zeros(out_shape(), out_dtype())


@register_lowering(aten.ones.default, aten.new_ones, aten.ones_like)
def ones(*args, **kwargs):
    return jnp.ones(out_shape(), out_dtype())


@register_lowering(
    aten.empty.memory_format,
    aten.new_empty,
    aten.empty_like,
    aten.empty_strided,
    aten.new_empty_strided,
    aten.empty_permuted,
)
def empty(*args, **kwargs):
    # Uninitialized memory has no defined value; zeros is one valid choice and keeps runs deterministic.
    return jnp.zeros(out_shape(), out_dtype())


@register_lowering(aten.full_like)
def full_like(x, fill_value, **kwargs):
    return jnp.full(out_shape(), fill_value, out_dtype())


@register_lowering(aten.arange.start_step, aten.arange.default, aten.arange.start)
def arange(*args, **kwargs):
    if len(args) == 1:
        start, step = 0, 1
    else:
        start, step = args[0], args[2] if len(args) > 2 else kwargs.get("step", 1)
    (n,) = out_shape()
    dtype = out_dtype()
    if jnp.issubdtype(dtype, jnp.integer):
        # eager truncates float bounds and step to integers first (arange(2.7, -3.3, -1.5) is 2, 1, 0, -1)
        return lax.iota(dtype, n) * convert(int(step), dtype) + convert(int(start), dtype)
    # Eager computes start + i * step in double precision, then rounds. Start, step and n are static,
    # so do exactly that at trace time: the device gets a constant and never sees a float64 op.
    values = np.float64(start) + np.arange(n, dtype=np.float64) * np.float64(step)
    return jnp.asarray(values.astype(np.dtype(dtype)))


def _triangle(indices, row, col, offset):
    """The (row, col) pairs of a triangle. They depend only on the static sizes, so they are computed
    exactly on the host and embedded (torch's decomposition derives them with float64 square roots, which
    a float32 device would round). Small in practice: DLRM-style pairwise interactions of tens of features."""
    pairs = np.stack(indices(row, offset, col)) if row and col else np.zeros((2, 0), np.int64)
    return jnp.asarray(pairs.astype(np.dtype(out_dtype())))


@register_lowering(aten.tril_indices)
def tril_indices(row, col, offset=0, **kwargs):
    return _triangle(np.tril_indices, row, col, offset)


@register_lowering(aten.triu_indices)
def triu_indices(row, col, offset=0, **kwargs):
    return _triangle(np.triu_indices, row, col, offset)
