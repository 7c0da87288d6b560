"""Histograms with a static number of bins: histc, bincount (when its length is known while tracing).

Both count with a one-hot comparison against an iota of bin ids reduced by addition (compare, select,
reduce-add: documented neuronx-cc ops; no scatter, whose reductions have no integer datapath). The
[elements x bins] intermediate is small for the place these ops meet models (MoE routers count tokens per
expert: a few thousand elements, a few dozen bins).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import torch
from jax import lax

from .registry import Unsupported, register_lowering
from .semantics import convert, is_float, out_dtype, out_shape

aten = torch.ops.aten


def bin_counts(bin_ids: Any, valid: Any, bins: int, weights: Any, dtype: Any) -> Any:
    """Per-bin count (or sum of ``weights``) of the flat int ``bin_ids`` where ``valid``, in ``dtype``."""
    hit = lax.eq(bin_ids[:, None], lax.broadcasted_iota(bin_ids.dtype, (1, bins), 1))
    hit = lax.bitwise_and(hit, valid[:, None])
    if weights is None:
        # Counts are exact integers: sum them as int32 (no float rounding past 2**24 elements with
        # float32, past 256 with bfloat16) and convert once.
        return convert(jnp.sum(convert(hit, jnp.int32), axis=0), dtype)
    acc = jnp.float32 if is_float(dtype) and jnp.dtype(dtype).itemsize < 4 else dtype
    w = lax.select(hit, jnp.broadcast_to(convert(weights, acc)[:, None], hit.shape), jnp.zeros(hit.shape, acc))
    return convert(jnp.sum(w, axis=0), dtype)


@register_lowering(aten.histc.default)
def histc(x: Any, bins: int = 100, min: float = 0, max: float = 0) -> Any:
    """``torch.histc``: ``bins`` equal-width bins over [min, max] (both ends inclusive, ``max`` in the
    last bin); elements outside, and NaN, are not counted. ``min == max`` takes the data's own range
    (widened by 1 on each side when that is empty too), as eager does.

    The bin of ``x`` is ``trunc((x - min) * bins / (max - min))`` computed in ``x``'s dtype, eager CPU's
    linear-interpolation rule, so elements on a bin edge land where eager puts them.
    """
    if not is_float(x.dtype):
        raise Unsupported(f"histc of {jnp.dtype(x.dtype)} (eager CPU supports floating inputs only)")
    if bins <= 0:
        raise Unsupported(f"histc with bins={bins}: bins must be positive")
    flat = jnp.ravel(x)
    dt = flat.dtype
    lo, hi = jnp.asarray(min, dt), jnp.asarray(max, dt)
    if min == max:
        if flat.size == 0:
            lo, hi = jnp.asarray(min, dt), jnp.asarray(max, dt)
        else:
            lo, hi = jnp.min(flat), jnp.max(flat)
        same = lax.eq(lo, hi)
        lo = lax.select(same, lax.sub(lo, jnp.asarray(1, dt)), lo)
        hi = lax.select(same, lax.add(hi, jnp.asarray(1, dt)), hi)
    elif min > max:
        raise Unsupported(f"histc with min={min} > max={max}")
    # Written as eager's kernel computes it, one rounding per operation in the input dtype.
    pos = lax.div(lax.mul(lax.sub(flat, lo), jnp.asarray(bins, dt)), lax.sub(hi, lo))
    valid = lax.bitwise_and(lax.ge(flat, lo), lax.le(flat, hi))  # NaN compares false: not counted
    # Clamp before the integer conversion: an out-of-range float converted to int is implementation-defined.
    ids = convert(jnp.clip(jnp.where(valid, pos, jnp.zeros_like(pos)), 0, bins), jnp.int32)
    ids = lax.min(ids, jnp.asarray(bins - 1, jnp.int32))  # x == max: the last bin
    return bin_counts(ids, valid, bins, None, out_dtype())


@register_lowering(aten.bincount.default)
def bincount(x: Any, weights: Any = None, minlength: int = 0) -> Any:
    """``torch.bincount`` when the output length is static in the traced graph. Eager's length is
    ``max(x.max() + 1, minlength)``, a data-dependent size, so it usually is not: then the advice is a
    fixed number of bins."""
    (length,) = out_shape()
    if not isinstance(length, int):
        raise Unsupported(
            "bincount's output length max(input.max() + 1, minlength) depends on the data; Trainium needs "
            "static shapes: count into a fixed number of bins instead, e.g. "
            "torch.histc(x.float(), bins=N, min=0, max=N - 1) or F.one_hot(x, N).sum(0)"
        )
    ids = convert(jnp.ravel(x), jnp.int32)
    valid = lax.ge(ids, jnp.asarray(0, jnp.int32))
    return bin_counts(ids, valid, length, None if weights is None else jnp.ravel(weights), out_dtype())
