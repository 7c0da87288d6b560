"""Pairwise p-norm distances: _cdist_forward/_cdist_backward (torch.cdist) and _pdist_forward/_pdist_backward
(nn.functional.pdist), each written as eager's CPU kernels compute them.

The forward forms every difference ``x1[i] - x2[j]`` ([..., r1, r2, m]) and reduces it with the p-norm
(p = 0 counts nonzeros, 1 sums magnitudes, 2 is the root of the sum of squares, inf the largest magnitude,
otherwise (sum |d|^p)^(1/p)). torch.cdist's matmul form of p = 2 (``_euclidean_dist``, for more than 25
rows) never reaches here: torch's decomposition of it is used. The backward applies eager's per-element
gradient rules (zero where the distance is 0, sign-only for p = 1, the ties of the maximum for p = inf) and
sums over the other set; pdist's pairs (i < j, row-major) are picked from the full square by constant
indices.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch

from .registry import Unsupported, register_lowering
from .semantics import convert, is_float, out_dtype, out_shape

aten = torch.ops.aten


def _norm(diff: Any, p: float) -> Any:
    """The p-norm over the last axis of ``diff``, as eager's distance kernels (``*dist_calc``) reduce."""
    a = jnp.abs(diff)
    if p == 0:
        return jnp.sum(convert(diff != 0, diff.dtype), axis=-1)
    if p == 1:
        return jnp.sum(a, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(diff * diff, axis=-1))
    if math.isinf(p):
        return jnp.max(a, axis=-1) if diff.shape[-1] else jnp.zeros(diff.shape[:-1], diff.dtype)
    return jnp.sum(a ** jnp.asarray(p, diff.dtype), axis=-1) ** jnp.asarray(1.0 / p, diff.dtype)


def _norm_grad(diff: Any, grad: Any, dist: Any, p: float) -> Any:
    """d dist / d diff times ``grad`` per element (``grad``, ``dist`` broadcast over the last axis)."""
    dt = diff.dtype
    zero = jnp.zeros((), dt)
    sign = convert(diff > 0, dt) - convert(diff < 0, dt)
    grad, dist = grad[..., None], dist[..., None]
    if p == 0:
        return jnp.zeros(diff.shape, dt)
    if p == 1:
        return grad * sign
    if math.isinf(p):
        return grad * sign * convert(jnp.abs(diff) == dist, dt)
    if p == 2:
        return jnp.where(dist == 0, zero, grad * diff / jnp.where(dist == 0, jnp.ones((), dt), dist))
    pm1 = jnp.asarray(p - 1, dt)
    safe = jnp.where(dist == 0, jnp.ones((), dt), dist)
    if p < 2:
        out = sign * jnp.abs(diff) ** pm1 * grad / safe**pm1
        if p < 1:
            out = jnp.where(diff == 0, zero, out)
    else:
        out = diff * jnp.abs(diff) ** jnp.asarray(p - 2, dt) * grad / safe**pm1
    return jnp.where(dist == 0, zero, out)


def _differences(x1: Any, x2: Any) -> Any:
    """[batch..., r1, r2, m]: ``x1[..., i, :] - x2[..., j, :]`` with the batch dims broadcast."""
    batch = np.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    a = jnp.broadcast_to(x1, batch + x1.shape[-2:])[..., :, None, :]
    b = jnp.broadcast_to(x2, batch + x2.shape[-2:])[..., None, :, :]
    return a - b


def _check(x: Any, p: float, what: str) -> None:
    if not is_float(x.dtype):
        raise Unsupported(f"{what} of {jnp.dtype(x.dtype)} (eager supports floating inputs only)")
    if p < 0:
        raise Unsupported(f"{what} with p={p}: p must be non-negative")


@register_lowering(aten._cdist_forward)
def cdist_forward(x1, x2, p, compute_mode=None):
    _check(x1, p, "cdist")
    return convert(jnp.reshape(_norm(_differences(x1, x2), p), out_shape()), out_dtype())


@register_lowering(aten._cdist_backward)
def cdist_backward(grad, x1, x2, p, cdist):
    """The gradient for ``x1`` (autograd calls it again with the operands swapped for ``x2``), in the shape
    torch gives it (the broadcast batch dims, summed where that shape keeps a 1)."""
    diff = _differences(x1, x2)
    grad = jnp.broadcast_to(convert(grad, diff.dtype), diff.shape[:-1])
    dist = jnp.broadcast_to(convert(cdist, diff.dtype), diff.shape[:-1])
    full = jnp.sum(_norm_grad(diff, grad, dist, p), axis=-2)  # [batch..., r1, m]
    return convert(_sum_to(full, out_shape()), out_dtype())


def _sum_to(x: Any, shape: tuple[int, ...]) -> Any:
    """``x`` summed over the dims it was broadcast along from ``shape`` (torch's ``sum_to_size``)."""
    lead = x.ndim - len(shape)
    x = jnp.sum(x, axis=tuple(range(lead))) if lead else x
    dims = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape)) if b == 1 and a != 1)
    return jnp.sum(x, axis=dims, keepdims=True) if dims else x


def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) of pdist's pairs i < j in row-major order."""
    rows, cols = np.triu_indices(n, 1)
    return rows.astype(np.int32), cols.astype(np.int32)


def _square(values: Any, n: int) -> Any:
    """[n, n] with the pair values of ``values`` at (i, j) and (j, i), zero on the diagonal."""
    k = np.full((n, n), 0, np.int32)
    rows, cols = _pairs(n)
    k[rows, cols] = np.arange(rows.size, dtype=np.int32)
    k[cols, rows] = np.arange(rows.size, dtype=np.int32)
    off_diagonal = jnp.asarray(~np.eye(n, dtype=bool))
    if rows.size == 0:
        return jnp.zeros((n, n), values.dtype)
    return jnp.where(off_diagonal, jnp.take(values, jnp.asarray(k), axis=0), jnp.zeros((), values.dtype))


@register_lowering(aten._pdist_forward)
def pdist_forward(x, p=2):
    _check(x, p, "pdist")
    n = x.shape[0]
    rows, cols = _pairs(n)
    if rows.size == 0:
        return jnp.zeros((0,), out_dtype())
    diff = jnp.take(x, jnp.asarray(rows), axis=0) - jnp.take(x, jnp.asarray(cols), axis=0)
    return convert(_norm(diff, p), out_dtype())


@register_lowering(aten._pdist_backward)
def pdist_backward(grad, x, p, pdist):
    """Each pair's gradient goes to its first row with a plus and its second with a minus; written as the
    full square (the rule is odd in the difference) summed over the other row."""
    n = x.shape[0]
    if n < 2:
        return jnp.zeros(x.shape, out_dtype())
    diff = x[:, None, :] - x[None, :, :]
    g, d = _square(convert(grad, x.dtype), n), _square(convert(pdist, x.dtype), n)
    off_diagonal = jnp.asarray(~np.eye(n, dtype=bool))[..., None]
    contribution = jnp.where(off_diagonal, _norm_grad(diff, g, d, p), jnp.zeros((), x.dtype))
    return convert(jnp.sum(contribution, axis=1), out_dtype())
