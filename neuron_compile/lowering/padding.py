"""Padding and resampling: constant_pad_nd, reflection/replication pads (1d/2d/3d), nearest and linear
upsampling, and their backwards.

Pads are slices, reverses, broadcasts and concatenations (no gather). Upsampling reads input rows at
static positions (a gather with constant indices per spatial dim) computed in NumPy with eager's float32
formulas, so the chosen source pixels and weights are eager's. Every backward here is the transpose of
its (linear) forward, taken with ``jax.vjp`` so forward and backward cannot disagree.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .registry import Unsupported, register_lowering
from .semantics import convert, is_float, out_dtype, out_shape

aten = torch.ops.aten


def _pairs(pad: Sequence[int], ndim: int) -> list[tuple[int, int]]:
    """torch's pad list (last dim first, (low, high) each) as per-dim pairs in dim order."""
    pairs = [(0, 0)] * ndim
    for i in range(len(pad) // 2):
        pairs[ndim - 1 - i] = (int(pad[2 * i]), int(pad[2 * i + 1]))
    return pairs


@register_lowering(aten.constant_pad_nd)
def constant_pad_nd(x, pad, value=0):
    # Negative pads crop, which lax.pad does natively.
    config = [(lo, hi, 0) for lo, hi in _pairs(pad, x.ndim)]
    return lax.pad(x, jnp.asarray(value, x.dtype), config)


def _reflect(x: Any, axis: int, lo: int, hi: int) -> Any:
    n = x.shape[axis]
    if lo >= n or hi >= n or lo < 0 or hi < 0:
        raise Unsupported(f"reflection pad ({lo}, {hi}) of a dimension of size {n}")
    parts = [lax.rev(lax.slice_in_dim(x, 1, lo + 1, axis=axis), (axis,))] if lo else []
    parts.append(x)
    if hi:
        parts.append(lax.rev(lax.slice_in_dim(x, n - 1 - hi, n - 1, axis=axis), (axis,)))
    return lax.concatenate(parts, axis) if len(parts) > 1 else x


def _replicate(x: Any, axis: int, lo: int, hi: int) -> Any:
    # Eager reads output position j from input clamp(j - lo, 0, n - 1), which also covers negative pads
    # (crops), including a crop past the far edge: (-4, 5) of size 4 is five copies of the last element.
    n = x.shape[axis]
    src = np.arange(n + lo + hi) - lo
    before, after = int(np.sum(src < 0)), int(np.sum(src > n - 1))
    inside = src[(src >= 0) & (src <= n - 1)]

    def edge(at: int, count: int) -> Any:
        shape = list(x.shape)
        shape[axis] = count
        return jnp.broadcast_to(lax.slice_in_dim(x, at, at + 1, axis=axis), shape)

    parts = [edge(0, before)] if before else []
    if inside.size:
        parts.append(lax.slice_in_dim(x, int(inside[0]), int(inside[-1]) + 1, axis=axis))
    parts += [edge(n - 1, after)] if after else []
    return lax.concatenate(parts, axis) if len(parts) > 1 else parts[0]


def _pad_with(edge_fn: Callable[[Any, int, int, int], Any], x: Any, padding: Sequence[int]) -> Any:
    for axis, (lo, hi) in enumerate(_pairs(padding, x.ndim)):
        if lo or hi:
            x = edge_fn(x, axis, lo, hi)
    return x


def _transpose_of(forward: Callable[[Any], Any], grad: Any, x: Any) -> Any:
    """The gradient of a linear ``forward`` at ``x``: forward's transpose applied to ``grad``."""
    acc = jnp.float32 if is_float(grad.dtype) and jnp.dtype(grad.dtype).itemsize < 4 else grad.dtype
    _, transpose = jax.vjp(forward, jnp.zeros(x.shape, acc))
    (out,) = transpose(convert(grad, acc))
    return convert(out, out_dtype())


for _n in (1, 2, 3):
    for _name, _edge in (("reflection", _reflect), ("replication", _replicate)):

        def _forward(x, padding, _edge=_edge):
            return _pad_with(_edge, x, padding)

        def _backward(grad, x, padding, _edge=_edge):
            return _transpose_of(lambda t: _pad_with(_edge, t, padding), grad, x)

        register_lowering(getattr(aten, f"{_name}_pad{_n}d"))(_forward)
        register_lowering(getattr(aten, f"{_name}_pad{_n}d_backward"))(_backward)


# ---- upsampling ----------------------------------------------------------------------------------------
def _scale(n_in: int, n_out: int, scale: float | None, align_corners: bool | None) -> np.float32:
    """Eager's area_pixel_compute_scale (nearest modes pass align_corners=None)."""
    if align_corners:
        return np.float32(n_in - 1) / np.float32(n_out - 1) if n_out > 1 else np.float32(0)
    if scale is not None and scale > 0:
        return np.float32(1.0 / scale)
    return np.float32(n_in) / np.float32(n_out)


def _nearest_rows(n_in: int, n_out: int, scale: float | None, exact: bool) -> np.ndarray:
    s = _scale(n_in, n_out, scale, None)
    dst = np.arange(n_out, dtype=np.float32)
    # nearest-exact computes (dst + 0.5) * scale in double and floors it as float (floorf).
    src = np.floor(np.float32((dst.astype(np.float64) + 0.5) * np.float64(s)) if exact else dst * s)
    src = src.astype(np.int64)
    return np.minimum(src, n_in - 1)


def _linear_taps(n_in: int, n_out: int, scale: float | None, align_corners: bool):
    """Source rows (i0, i1) and weights (w0, w1) per output row, as eager's upsample kernels compute them."""
    if n_in == n_out:
        rows = np.arange(n_out)
        return rows, rows, np.ones(n_out, np.float32), np.zeros(n_out, np.float32)
    s = _scale(n_in, n_out, scale, align_corners)
    dst = np.arange(n_out, dtype=np.float32)
    src = s * dst if align_corners else np.maximum(s * (dst + np.float32(0.5)) - np.float32(0.5), np.float32(0))
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    w1 = np.clip(src - i0.astype(np.float32), 0, 1).astype(np.float32)
    i1 = i0 + (i0 < n_in - 1)
    return i0, i1, (np.float32(1) - w1).astype(np.float32), w1


def _rows(x: Any, axis: int, rows: np.ndarray) -> Any:
    return jnp.take(x, jnp.asarray(rows, jnp.int32), axis=axis, mode="clip")


def _spatial_scales(nd: int, scales: Sequence[float | None] | None) -> list[float | None]:
    if scales is None:
        return [None] * nd
    return [None if s is None else float(s) for s in scales]


def _nearest(x: Any, out_spatial: Sequence[int], scales: Sequence[float | None], exact: bool) -> Any:
    nd = len(out_spatial)
    for i in range(nd):
        axis = x.ndim - nd + i
        x = _rows(x, axis, _nearest_rows(x.shape[axis], out_spatial[i], scales[i], exact))
    return x


def _linear(x: Any, out_spatial: Sequence[int], scales: Sequence[float | None], align_corners: bool) -> Any:
    nd = len(out_spatial)
    acc = jnp.float32 if jnp.dtype(x.dtype).itemsize < 4 else x.dtype
    y = convert(x, acc)
    # Innermost dim first, as eager's separable kernels interpolate.
    for i in reversed(range(nd)):
        axis = y.ndim - nd + i
        i0, i1, w0, w1 = _linear_taps(y.shape[axis], out_spatial[i], scales[i], align_corners)
        shape = [1] * y.ndim
        shape[axis] = out_spatial[i]
        w0 = jnp.asarray(w0.reshape(shape), acc)
        w1 = jnp.asarray(w1.reshape(shape), acc)
        y = _rows(y, axis, i0) * w0 + _rows(y, axis, i1) * w1
    return convert(y, x.dtype)


def _split_vec(nd: int, output_size, scale_factors) -> list[float | None]:
    # .vec overloads: output_size given -> no scales; scale_factors given -> eager uses them directly.
    return _spatial_scales(nd, scale_factors if output_size is None else None)


def _register_upsample(nd: int) -> None:
    for name, exact in ((f"upsample_nearest{nd}d", False), (f"_upsample_nearest_exact{nd}d", True)):
        packet = getattr(aten, name)

        def nearest(x, output_size, *scales, exact=exact, nd=nd):
            return _nearest(x, out_shape()[-nd:], _spatial_scales(nd, scales or None), exact)

        def nearest_vec(x, output_size, scale_factors, exact=exact, nd=nd):
            return _nearest(x, out_shape()[-nd:], _split_vec(nd, output_size, scale_factors), exact)

        def nearest_backward(grad, output_size, input_size, *scales, exact=exact, nd=nd):
            sc = _spatial_scales(nd, scales or None)
            zeros = jnp.zeros(tuple(input_size), grad.dtype)
            return _transpose_of(lambda t: _nearest(t, output_size, sc, exact), grad, zeros)

        register_lowering(packet.default)(nearest)
        register_lowering(packet.vec)(nearest_vec)
        register_lowering(getattr(aten, f"{name}_backward").default)(nearest_backward)


for _nd in (1, 2, 3):
    _register_upsample(_nd)

_LINEAR = {1: "upsample_linear1d", 2: "upsample_bilinear2d", 3: "upsample_trilinear3d"}


def _register_linear(nd: int) -> None:
    packet = getattr(aten, _LINEAR[nd])

    def linear(x, output_size, align_corners, *scales, nd=nd):
        return _linear(x, out_shape()[-nd:], _spatial_scales(nd, scales or None), align_corners)

    def linear_vec(x, output_size, align_corners, scale_factors, nd=nd):
        return _linear(x, out_shape()[-nd:], _split_vec(nd, output_size, scale_factors), align_corners)

    def linear_backward(grad, output_size, input_size, align_corners, *scales, nd=nd):
        sc = _spatial_scales(nd, scales or None)
        zeros = jnp.zeros(tuple(input_size), grad.dtype)
        return _transpose_of(lambda t: _linear(t, output_size, sc, align_corners), grad, zeros)

    register_lowering(packet.default)(linear)
    register_lowering(packet.vec)(linear_vec)
    register_lowering(getattr(aten, f"{_LINEAR[nd]}_backward").default)(linear_backward)


for _nd in (1, 2, 3):
    _register_linear(_nd)
