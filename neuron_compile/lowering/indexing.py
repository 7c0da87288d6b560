"""Indexing: gather/scatter families, advanced indexing (index.Tensor / index_put), index_* ops,
slice/select/diagonal scatters and masked ops with data-independent shapes.

Index semantics, the same for every op here:
- Negative indices wrap like torch (``i + size``).
- Out-of-range indices: eager raises. A compiled graph cannot raise, so we keep XLA's native semantics:
  reads (gather) clamp the index into range, writes (scatter) drop the update. The result is defined but
  meaningless; the user's program was invalid in eager.
- Duplicate indices in a non-accumulating write: eager keeps one of the values (which one is
  unspecified), so does XLA.
- Integer/bool scatter reductions (scatter_add, index_put(accumulate=True), ...) lower fine, but the
  legality pass refuses them: neuronx-cc has no integer scatter reduction.
- Accumulating writes (add, multiply, mean) of 16-bit floats accumulate in float32 and round once
  (``_accumulating``), as eager's CPU scatter_add/index_add/scatter_reduce kernels do: summing thousands of
  updates into one slot in bfloat16 drifts by hundreds of ulps (an MoE's token combine, the backward of
  gather or index_select). Eager's index_put(accumulate=True) and put(accumulate=True) round after every
  update; here they take the float32 path too, which only brings them closer to the exact sum.
- Data-dependent output shapes (``nonzero``, ``masked_select``, indexing with a boolean mask) cannot be
  compiled for static shapes and are refused with the reason.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .registry import Unsupported, register_lowering, register_refusal
from .scan import associative_scan
from .semantics import (
    broadcast,
    canonical_dim,
    convert,
    in_opmath,
    is_array,
    is_float,
    out_dtype,
    out_shape,
)

aten = torch.ops.aten

_DATA_DEPENDENT = "its output shape depends on tensor values, which a static-shape graph cannot express"


def _coords(index: Any, dim: int) -> tuple[Any, ...]:
    """Full coordinates for gather/scatter along ``dim``: iotas for every other dim, ``index`` for ``dim``."""
    coords = [lax.broadcasted_iota(jnp.int32, index.shape, d) for d in range(index.ndim)]
    coords[dim] = index
    return tuple(coords)


def _as_nd(x: Any) -> Any:
    return jnp.reshape(x, (1,)) if x.ndim == 0 else x


def _src_window(src: Any, shape: Sequence[int], dtype: Any) -> Any:
    """The leading ``shape`` block of ``src`` (torch only reads that much of it), or a broadcast scalar."""
    if not is_array(src):
        return jnp.full(shape, src, dtype)
    src = _as_nd(convert(src, dtype))
    return lax.slice(src, (0,) * src.ndim, tuple(shape))


# ---- gather / scatter along a dimension --------------------------------------------------------------
@register_lowering(aten.gather)
def gather(x, dim, index, *, sparse_grad=False):
    if index.size == 0:
        # torch checks ranks only for a non-empty index: an empty one of any rank gives an empty result.
        return jnp.zeros(out_shape(), x.dtype)
    xs, index = _as_nd(x), _as_nd(index)
    out = xs.at[_coords(index, canonical_dim(dim, xs.ndim))].get(mode="clip")
    return jnp.reshape(out, out_shape())


# Torch accumulates bools as logical or (add) and logical and (multiply); XLA's add/mul reject i1, while its
# max/min on i1 are exactly or/and.
_BOOL_REDUCTION = {"add": "max", "mul": "min", "multiply": "min"}


def _reduction(how: str, dtype: Any) -> str:
    """The ``.at[]`` method that performs reduction ``how`` on elements of ``dtype``."""
    return _BOOL_REDUCTION.get(how, how) if dtype == jnp.bool_ else how


_ACCUMULATING = frozenset({"add", "mul", "multiply", "sum", "prod", "mean"})


def _accumulating(write: Callable[[Any, Any], Any], x: Any, values: Any, how: str) -> Any:
    """``write(x, values)``: with an accumulating reduction ``how``, 16-bit floats computed in float32
    and rounded once (see the module's docstring); other writes as they are."""
    if how in _ACCUMULATING and is_array(values):
        return in_opmath(write, x, values)
    return write(x, values)


def _write(x: Any, where: Any, values: Any, how: str) -> Any:
    """``x`` with ``values`` written at ``where`` (an ``.at[]`` index) by reduction ``how``; updates out of
    range are dropped."""

    def write(base, v):
        return getattr(base.at[where], _reduction(how, base.dtype))(v, mode="drop")

    return _accumulating(write, x, values, how)


def _scatter(x, dim, index, src, how: str) -> Any:
    if index.size == 0:  # as in gather, an empty index of any rank writes nothing
        return x
    xs, index = _as_nd(x), _as_nd(index)
    coords = _coords(index, canonical_dim(dim, xs.ndim))
    return jnp.reshape(_write(xs, coords, _src_window(src, index.shape, xs.dtype), how), x.shape)


_TORCH_SCATTER_REDUCE = {
    "add": "add",
    "multiply": "multiply",
    "sum": "add",
    "prod": "multiply",
    "amax": "max",
    "amin": "min",
}


@register_lowering(aten.scatter.src, aten.scatter.value)
def scatter(x, dim, index, src):
    return _scatter(x, dim, index, src, "set")


@register_lowering(aten.scatter.reduce, aten.scatter.value_reduce)
def scatter_reduce_legacy(x, dim, index, src, *, reduce):
    how = _TORCH_SCATTER_REDUCE[reduce]
    return _scatter(x, dim, index, src, how if how != "multiply" else "mul")


@register_lowering(aten.scatter_add)
def scatter_add(x, dim, index, src):
    return _scatter(x, dim, index, src, "add")


def reduce_identity(dtype: Any, reduce: str) -> Any:
    if reduce in ("sum", "mean"):
        return 0
    if reduce == "prod":
        return 1
    if is_float(dtype):
        return -jnp.inf if reduce == "amax" else jnp.inf
    info = jnp.iinfo(dtype) if dtype != jnp.bool_ else None
    if info is None:
        return reduce == "amin"
    return info.min if reduce == "amax" else info.max


@register_lowering(aten.scatter_reduce.two)
def scatter_reduce(x, dim, index, src, reduce, *, include_self=True):
    if reduce not in ("sum", "prod", "mean", "amax", "amin"):
        raise Unsupported(f"scatter_reduce with reduce='{reduce}'")
    xs, index = _as_nd(x), _as_nd(index)
    coords = _coords(index, canonical_dim(dim, xs.ndim))
    src = _src_window(src, index.shape, xs.dtype)

    def write(base, values):
        if not include_self:
            # Positions that receive an update start from the reduction's identity instead of self.
            hit = jnp.zeros(base.shape, jnp.bool_).at[coords].set(True, mode="drop")
            base = jnp.where(hit, jnp.asarray(reduce_identity(base.dtype, reduce), base.dtype), base)
        if reduce == "mean":
            total = base.at[coords].add(values, mode="drop")
            count = jnp.zeros(base.shape, base.dtype).at[coords].add(jnp.ones_like(values), mode="drop")
            if include_self:
                count = count + 1
            count = jnp.where(count == 0, jnp.ones_like(count), count)
            return total / count if is_float(base.dtype) else jnp.floor_divide(total, count)
        how = {"sum": "add", "prod": "mul", "amax": "max", "amin": "min"}[reduce]
        return getattr(base.at[coords], _reduction(how, base.dtype))(values, mode="drop")

    return jnp.reshape(_accumulating(write, xs, src, reduce), x.shape)


# ---- advanced indexing --------------------------------------------------------------------------------
def _is_bool(i: Any) -> bool:
    return i is not None and i.dtype in (jnp.bool_, jnp.uint8)


def _index_tuple(indices: Sequence[Any | None]) -> tuple[Any, ...]:
    # In aten.index, None means "all of this dimension" (not a new axis).
    return tuple(slice(None) if i is None else i for i in indices)


@register_lowering(aten.index.Tensor)
def index(x, indices):
    if any(_is_bool(i) for i in indices):
        raise Unsupported(f"indexing with a boolean mask: {_DATA_DEPENDENT}; use torch.where instead")
    return x.at[_index_tuple(indices)].get(mode="clip")


def _mask_index_put(x, indices, values, accumulate):
    """``x[mask] = values`` where ``values`` broadcasts to every selected row (the common ``x[m] = c``)."""
    lead = 0
    while indices[lead] is None:
        lead += 1
    mask = indices[lead]
    if any(i is not None for i in indices[lead + 1 :]):
        raise Unsupported("index_put mixing a boolean mask with other index tensors")
    mask = convert(mask, jnp.bool_)
    rest = x.shape[lead + mask.ndim :]
    if values.ndim > len(rest) and not all(s == 1 for s in values.shape[: values.ndim - len(rest)]):
        raise Unsupported(
            "index_put with a boolean mask and one value per selected element: "
            "the number of selected elements is data-dependent; use torch.where instead"
        )
    values = jnp.reshape(values, values.shape[max(values.ndim - len(rest), 0) :])
    mask = jnp.reshape(mask, (1,) * lead + mask.shape + (1,) * len(rest))
    values = convert(values, x.dtype)
    new = x + values if accumulate else values
    mask, new, x = broadcast(mask, new, x)
    return lax.select(mask, new, x)


@register_lowering(aten.index_put)
def index_put(x, indices, values, accumulate=False):
    if any(_is_bool(i) for i in indices):
        return _mask_index_put(x, indices, values, accumulate)
    values = convert(values, x.dtype)
    return _write(x, _index_tuple(indices), values, "add" if accumulate else "set")


def _along(dim: int, ndim: int, index: Any) -> tuple[Any, ...]:
    return (slice(None),) * canonical_dim(dim, ndim) + (index,)


@register_lowering(aten.index_select)
def index_select(x, dim, index):
    xs = _as_nd(x)
    out = jnp.take(xs, jnp.reshape(index, (-1,)), axis=canonical_dim(dim, xs.ndim), mode="clip")
    return jnp.reshape(out, out_shape())


def _index_write(x, dim, index, source, how: str) -> Any:
    xs = _as_nd(x)
    index = jnp.reshape(index, (-1,))
    if is_array(source):
        source = jnp.reshape(convert(source, xs.dtype), _index_write_shape(xs.shape, dim, index.shape[0]))
    return jnp.reshape(_write(xs, _along(dim, xs.ndim, index), source, how), x.shape)


def _index_write_shape(shape, dim, n):
    shape = list(shape)
    shape[canonical_dim(dim, len(shape))] = n
    return tuple(shape)


@register_lowering(aten.index_add)
def index_add(x, dim, index, source, *, alpha=1):
    if alpha != 1:
        source = source * jnp.asarray(alpha, source.dtype)
    return _index_write(x, dim, index, source, "add")


@register_lowering(aten.index_copy)
def index_copy(x, dim, index, source):
    return _index_write(x, dim, index, source, "set")


@register_lowering(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def index_fill(x, dim, index, value):
    # The 0-d fill value spread over the selected slices: _index_write reshapes an array source to them.
    n = jnp.reshape(index, (-1,)).shape[0]
    value = jnp.broadcast_to(jnp.reshape(convert(value, x.dtype), ()), _index_write_shape(_as_nd(x).shape, dim, n))
    return _index_write(x, dim, index, value, "set")


@register_lowering(aten.take)
def take(x, index):
    # .at[].get wraps negative indices like torch (jnp.take's "clip" mode would clamp them to 0). A 0-d index
    # would become a dynamic_slice at a runtime offset, which neuronx-cc refuses: indices are gathered flat.
    flat = jnp.reshape(x, (-1,)).at[jnp.reshape(index, (-1,))].get(mode="clip")
    return jnp.reshape(flat, index.shape)


@register_lowering(aten.put)
def put(x, index, source, accumulate=False):
    source = jnp.reshape(convert(source, x.dtype), (-1,))
    out = _write(jnp.reshape(x, (-1,)), jnp.reshape(index, (-1,)), source, "add" if accumulate else "set")
    return jnp.reshape(out, x.shape)


# ---- scatters of views (exact: pads and selects, no scatter op) --------------------------------------
def _embed(x: Any, src: Any, axis: int, start: int, stop: int, step: int) -> Any:
    """``x`` with ``x[..., start:stop:step, ...] = src`` along ``axis``."""
    n = x.shape[axis]
    count = src.shape[axis]
    if count == 0:
        return x
    last = start + (count - 1) * step
    config = [(0, 0, 0)] * x.ndim
    config[axis] = (start, n - 1 - last, step - 1)
    placed = lax.pad(convert(src, x.dtype), jnp.zeros((), x.dtype), config)
    mask = lax.pad(jnp.ones((count,), jnp.bool_), False, [config[axis]])
    mask = lax.broadcast_in_dim(mask, x.shape, (axis,))
    return lax.select(mask, placed, x)


@register_lowering(aten.slice_scatter)
def slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    axis = canonical_dim(dim, x.ndim)
    start, stop, step = slice(start, end, step).indices(x.shape[axis])
    return _embed(x, src, axis, start, max(stop, start), step)


@register_lowering(aten.select_scatter)
def select_scatter(x, src, dim, index):
    axis = canonical_dim(dim, x.ndim)
    index = index % x.shape[axis]
    return _embed(x, jnp.expand_dims(src, axis), axis, index, index + 1, 1)


@register_lowering(aten.diagonal_scatter)
def diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    d1, d2 = canonical_dim(dim1, x.ndim), canonical_dim(dim2, x.ndim)
    xt = jnp.moveaxis(x, (d1, d2), (-2, -1))
    n = src.shape[-1]
    rows = np.arange(n) + max(-offset, 0)
    cols = np.arange(n) + max(offset, 0)
    out = xt.at[..., rows, cols].set(convert(src, x.dtype), mode="drop", unique_indices=True)
    return jnp.moveaxis(out, (-2, -1), (d1, d2))


# ---- masks --------------------------------------------------------------------------------------------
def _mask_positions(mask_flat: Any) -> Any:
    """For each True of a flat mask, its rank among the Trues (0, 1, ...); -1 where False."""
    (ranks,) = associative_scan(lambda a, b: [a[0] + b[0]], [convert(mask_flat, jnp.int32)], 0)
    return jnp.where(mask_flat, ranks - 1, -1)


@register_lowering(aten.masked_scatter)
def masked_scatter(x, mask, source):
    x, mask = broadcast(x, convert(mask, jnp.bool_))
    flat_mask = jnp.reshape(mask, (-1,))
    pos = jnp.maximum(_mask_positions(flat_mask), 0)
    picked = jnp.take(jnp.reshape(convert(source, x.dtype), (-1,)), pos, mode="clip")
    return jnp.reshape(jnp.where(flat_mask, picked, jnp.reshape(x, (-1,))), x.shape)


@register_lowering(aten.masked_scatter_backward)
def masked_scatter_backward(grad, mask, sizes):
    grad, mask = broadcast(grad, convert(mask, jnp.bool_))
    flat_mask = jnp.reshape(mask, (-1,))
    numel = int(np.prod(out_shape()))
    pos = jnp.where(flat_mask, _mask_positions(flat_mask), numel)  # numel: out of range, dropped
    out = jnp.zeros((numel,), out_dtype()).at[pos].set(jnp.reshape(grad, (-1,)), mode="drop")
    return jnp.reshape(out, out_shape())


register_refusal(aten.nonzero.default, aten.masked_select.default, reason=_DATA_DEPENDENT)
