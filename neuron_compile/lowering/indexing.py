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
- Data-dependent output shapes (``nonzero``, ``masked_select``, indexing with a boolean mask) cannot be
  compiled for static shapes and are refused with the reason.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .registry import Unsupported, register_lowering, register_refusal
from .scan import associative_scan
from .semantics import broadcast, canonical_dim, convert, is_array, is_float, out_dtype, out_shape

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


def _scatter(x, dim, index, src, how: str) -> Any:
    if index.size == 0:  # as in gather, an empty index of any rank writes nothing
        return x
    xs, index = _as_nd(x), _as_nd(index)
    dim = canonical_dim(dim, xs.ndim)
    src = _src_window(src, index.shape, xs.dtype)
    ref = xs.at[_coords(index, dim)]
    out = getattr(ref, _reduction(how, xs.dtype))(src, mode="drop")
    return jnp.reshape(out, x.shape)


_TORCH_SCATTER_REDUCE = {"add": "add", "multiply": "multiply", "sum": "add", "prod": "multiply",
                         "amax": "max", "amin": "min"}


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


def _identity(dtype: Any, reduce: str) -> Any:
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
    d = canonical_dim(dim, xs.ndim)
    coords = _coords(index, d)
    src = _src_window(src, index.shape, xs.dtype)
    base = xs
    if not include_self:
        # Positions that receive an update start from the reduction's identity instead of self.
        hit = jnp.zeros(xs.shape, jnp.bool_).at[coords].set(True, mode="drop")
        base = jnp.where(hit, jnp.asarray(_identity(xs.dtype, reduce), xs.dtype), xs)
    if reduce == "mean":
        total = base.at[coords].add(src, mode="drop")
        count = jnp.zeros(xs.shape, xs.dtype).at[coords].add(jnp.ones_like(src), mode="drop")
        if include_self:
            count = count + 1
        count = jnp.where(count == 0, jnp.ones_like(count), count)
        out = total / count if is_float(xs.dtype) else jnp.floor_divide(total, count)
    else:
        how = {"sum": "add", "prod": "mul", "amax": "max", "amin": "min"}[reduce]
        out = getattr(base.at[coords], _reduction(how, xs.dtype))(src, mode="drop")
    return jnp.reshape(out, x.shape)


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
    if any(i is not None for i in indices[lead + 1:]):
        raise Unsupported("index_put mixing a boolean mask with other index tensors")
    mask = convert(mask, jnp.bool_)
    rest = x.shape[lead + mask.ndim:]
    if values.ndim > len(rest) and not all(s == 1 for s in values.shape[: values.ndim - len(rest)]):
        raise Unsupported(
            "index_put with a boolean mask and one value per selected element: "
            "the number of selected elements is data-dependent; use torch.where instead"
        )
    values = jnp.reshape(values, values.shape[max(values.ndim - len(rest), 0):])
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
    ref = x.at[_index_tuple(indices)]
    if accumulate:
        return getattr(ref, _reduction("add", x.dtype))(values, mode="drop")
    return ref.set(values, mode="drop")


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
    ref = xs.at[_along(dim, xs.ndim, index)]
    return jnp.reshape(getattr(ref, _reduction(how, xs.dtype))(source, mode="drop"), x.shape)


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
    # .at[].get wraps negative indices like torch (jnp.take's "clip" mode would clamp them to 0).
    return jnp.reshape(x, (-1,)).at[index].get(mode="clip")


@register_lowering(aten.put)
def put(x, index, source, accumulate=False):
    flat = jnp.reshape(x, (-1,)).at[jnp.reshape(index, (-1,))]
    source = jnp.reshape(convert(source, x.dtype), (-1,))
    out = getattr(flat, _reduction("add", x.dtype) if accumulate else "set")(source, mode="drop")
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
