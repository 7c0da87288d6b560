"""Padding and resampling: constant_pad_nd, reflection/replication pads (1d/2d/3d), nearest and linear
upsampling, antialiased bilinear/bicubic resampling, and their backwards.

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
from .semantics import convert, is_float, opmath_dtype, out_dtype, out_shape

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


def _take_static(x: Any, axis: int, source: np.ndarray) -> Any:
    """``x`` indexed along ``axis`` by the constant ``source`` indices, built from static slices: each run of
    indices that step by +1 is a slice, by -1 a reversed slice, by 0 a broadcast element (no gather)."""
    parts, start = [], 0
    while start < len(source):
        step = int(source[start + 1] - source[start]) if start + 1 < len(source) else 1
        step = step if step in (-1, 0, 1) else 1
        stop = start + 1
        while stop < len(source) and source[stop] - source[stop - 1] == step:
            stop += 1
        first, last = int(source[start]), int(source[stop - 1])
        if step == 0:
            shape = list(x.shape)
            shape[axis] = stop - start
            parts.append(jnp.broadcast_to(lax.slice_in_dim(x, first, first + 1, axis=axis), shape))
        elif step == 1:
            parts.append(lax.slice_in_dim(x, first, last + 1, axis=axis))
        else:
            parts.append(lax.rev(lax.slice_in_dim(x, last, first + 1, axis=axis), (axis,)))
        start = stop
    return lax.concatenate(parts, axis) if len(parts) > 1 else parts[0]


def _reflect(x: Any, axis: int, lo: int, hi: int) -> Any:
    # Eager reads output position j from input reflect(j - lo) (mirrored at both ends, edges not repeated);
    # negative pads crop. It refuses pads of the dimension's size or more, so one reflection suffices.
    n = x.shape[axis]
    if lo >= n or hi >= n or n + lo + hi <= 0:
        raise Unsupported(f"reflection pad ({lo}, {hi}) of a dimension of size {n}")
    src = np.abs(np.arange(n + lo + hi) - lo)
    return _take_static(x, axis, np.where(src > n - 1, 2 * (n - 1) - src, src))


def _replicate(x: Any, axis: int, lo: int, hi: int) -> Any:
    # Eager reads output position j from input clamp(j - lo, 0, n - 1), which also covers negative pads
    # (crops), including a crop past the far edge: (-4, 5) of size 4 is five copies of the last element.
    n = x.shape[axis]
    return _take_static(x, axis, np.clip(np.arange(n + lo + hi) - lo, 0, n - 1))


def _pad_with(edge_fn: Callable[[Any, int, int, int], Any], x: Any, padding: Sequence[int]) -> Any:
    for axis, (lo, hi) in enumerate(_pairs(padding, x.ndim)):
        if lo or hi:
            x = edge_fn(x, axis, lo, hi)
    return x


def _transpose_of(forward: Callable[[Any], Any], grad: Any, x: Any) -> Any:
    """The gradient of a linear ``forward`` at ``x``: forward's transpose applied to ``grad``."""
    acc = opmath_dtype(grad.dtype)
    _, transpose = jax.vjp(forward, jnp.zeros(x.shape, acc))
    (out,) = transpose(convert(grad, acc))
    return convert(out, out_dtype())


@register_lowering(aten.reflection_pad1d.default, aten.reflection_pad2d.default, aten.reflection_pad3d.default)
def reflection_pad(x, padding):
    return _pad_with(_reflect, x, padding)


@register_lowering(
    aten.reflection_pad1d_backward.default,
    aten.reflection_pad2d_backward.default,
    aten.reflection_pad3d_backward.default,
)
def reflection_pad_backward(grad, x, padding):
    return _transpose_of(lambda t: _pad_with(_reflect, t, padding), grad, x)


@register_lowering(aten.replication_pad1d.default, aten.replication_pad2d.default, aten.replication_pad3d.default)
def replication_pad(x, padding):
    return _pad_with(_replicate, x, padding)


@register_lowering(
    aten.replication_pad1d_backward.default,
    aten.replication_pad2d_backward.default,
    aten.replication_pad3d_backward.default,
)
def replication_pad_backward(grad, x, padding):
    return _transpose_of(lambda t: _pad_with(_replicate, t, padding), grad, x)


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


def _separable(x: Any, nd: int, along: Callable[[Any, int, int], Any]) -> Any:
    """``x`` resampled one of its ``nd`` trailing (spatial) axes at a time by ``along(y, axis, i)`` (``i``
    the spatial index): innermost axis first, as eager's separable kernels go, in opmath, rounded once."""
    y = convert(x, opmath_dtype(x.dtype))
    for i in reversed(range(nd)):
        y = along(y, y.ndim - nd + i, i)
    return convert(y, x.dtype)


def _linear(x: Any, out_spatial: Sequence[int], scales: Sequence[float | None], align_corners: bool) -> Any:
    def along(y: Any, axis: int, i: int) -> Any:
        i0, i1, w0, w1 = _linear_taps(y.shape[axis], out_spatial[i], scales[i], align_corners)
        shape = [1] * y.ndim
        shape[axis] = out_spatial[i]
        w0, w1 = (jnp.asarray(w.reshape(shape), y.dtype) for w in (w0, w1))
        return _rows(y, axis, i0) * w0 + _rows(y, axis, i1) * w1

    return _separable(x, len(out_spatial), along)


def _split_vec(nd: int, output_size, scale_factors) -> list[float | None]:
    # .vec overloads: output_size given -> no scales; scale_factors given -> eager uses them directly.
    return _spatial_scales(nd, scale_factors if output_size is None else None)


def _vec_rank(output_size, scale_factors) -> int:
    """The number of spatial dims of a ``.vec`` overload's call: one of its two lists is given."""
    return len(output_size) if output_size is not None else len(scale_factors)


def _upsample_nearest(x, output_size, scales, exact: bool) -> Any:
    nd = len(output_size)
    return _nearest(x, out_shape()[-nd:], _spatial_scales(nd, scales or None), exact)


def _upsample_nearest_vec(x, output_size, scale_factors, exact: bool) -> Any:
    nd = _vec_rank(output_size, scale_factors)
    return _nearest(x, out_shape()[-nd:], _split_vec(nd, output_size, scale_factors), exact)


def _upsample_nearest_backward(grad, output_size, input_size, scales, exact: bool) -> Any:
    sc = _spatial_scales(len(output_size), scales or None)
    zeros = jnp.zeros(tuple(input_size), grad.dtype)
    return _transpose_of(lambda t: _nearest(t, output_size, sc, exact), grad, zeros)


@register_lowering(aten.upsample_nearest1d.default, aten.upsample_nearest2d.default, aten.upsample_nearest3d.default)
def upsample_nearest(x, output_size, *scales):
    return _upsample_nearest(x, output_size, scales, exact=False)


@register_lowering(aten.upsample_nearest1d.vec, aten.upsample_nearest2d.vec, aten.upsample_nearest3d.vec)
def upsample_nearest_vec(x, output_size, scale_factors):
    return _upsample_nearest_vec(x, output_size, scale_factors, exact=False)


@register_lowering(
    aten.upsample_nearest1d_backward.default,
    aten.upsample_nearest2d_backward.default,
    aten.upsample_nearest3d_backward.default,
)
def upsample_nearest_backward(grad, output_size, input_size, *scales):
    return _upsample_nearest_backward(grad, output_size, input_size, scales, exact=False)


@register_lowering(
    aten._upsample_nearest_exact1d.default,
    aten._upsample_nearest_exact2d.default,
    aten._upsample_nearest_exact3d.default,
)
def upsample_nearest_exact(x, output_size, *scales):
    return _upsample_nearest(x, output_size, scales, exact=True)


@register_lowering(
    aten._upsample_nearest_exact1d.vec,
    aten._upsample_nearest_exact2d.vec,
    aten._upsample_nearest_exact3d.vec,
)
def upsample_nearest_exact_vec(x, output_size, scale_factors):
    return _upsample_nearest_vec(x, output_size, scale_factors, exact=True)


@register_lowering(
    aten._upsample_nearest_exact1d_backward.default,
    aten._upsample_nearest_exact2d_backward.default,
    aten._upsample_nearest_exact3d_backward.default,
)
def upsample_nearest_exact_backward(grad, output_size, input_size, *scales):
    return _upsample_nearest_backward(grad, output_size, input_size, scales, exact=True)


@register_lowering(aten.upsample_linear1d.default, aten.upsample_bilinear2d.default, aten.upsample_trilinear3d.default)
def upsample_linear(x, output_size, align_corners, *scales):
    nd = len(output_size)
    return _linear(x, out_shape()[-nd:], _spatial_scales(nd, scales or None), align_corners)


@register_lowering(aten.upsample_linear1d.vec, aten.upsample_bilinear2d.vec, aten.upsample_trilinear3d.vec)
def upsample_linear_vec(x, output_size, align_corners, scale_factors):
    nd = _vec_rank(output_size, scale_factors)
    return _linear(x, out_shape()[-nd:], _split_vec(nd, output_size, scale_factors), align_corners)


@register_lowering(
    aten.upsample_linear1d_backward.default,
    aten.upsample_bilinear2d_backward.default,
    aten.upsample_trilinear3d_backward.default,
)
def upsample_linear_backward(grad, output_size, input_size, align_corners, *scales):
    sc = _spatial_scales(len(output_size), scales or None)
    zeros = jnp.zeros(tuple(input_size), grad.dtype)
    return _transpose_of(lambda t: _linear(t, output_size, sc, align_corners), grad, zeros)


# ---- antialiased resampling: interpolate(..., antialias=True) --------------------------------------------
def _triangle(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    return np.where(x < 1, np.float32(1) - x, np.float32(0)).astype(np.float32)


def _keys_cubic(x: np.ndarray) -> np.ndarray:
    a, x = np.float32(-0.5), np.abs(x)
    inner = ((a + 2) * x - (a + 3)) * x * x + 1
    outer = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, inner, np.where(x < 2, outer, np.float32(0))).astype(np.float32)


_AA_FILTERS = {"bilinear": (2, _triangle), "bicubic": (4, _keys_cubic)}


def _aa_weights(n_in: int, n_out: int, scale: float | None, align_corners: bool, mode: str) -> np.ndarray:
    """[n_out, n_in] weights of eager's antialiased resampling (``_compute_indices_min_size_weights_aa`` in
    float32, its float/double promotions term by term): the filter stretched by the downscale factor, centred
    on each output pixel, cut at the edges and renormalized."""
    interp_size, filt = _AA_FILTERS[mode]
    s = _scale(n_in, n_out, scale, align_corners)
    support = np.float32(interp_size * 0.5 * np.float64(s)) if s >= 1 else np.float32(interp_size * 0.5)
    max_interp = int(np.ceil(support)) * 2 + 1
    invscale = np.float32(1.0 / np.float64(s)) if s >= 1 else np.float32(1)
    weights = np.zeros((n_out, n_in), np.float32)
    for i in range(n_out):
        center = np.float32(np.float64(s) * (i + 0.5))
        xmin = max(int(np.float64(center - support) + 0.5), 0)
        size = min(max(min(int(np.float64(center + support) + 0.5), n_in) - xmin, 0), max_interp)
        offsets = (np.arange(size) + xmin).astype(np.float32) - center
        w = filt(np.float32((offsets.astype(np.float64) + 0.5) * np.float64(invscale)))
        total = np.float32(0)
        for v in w:  # eager sums in order, in float32
            total = np.float32(total + v)
        weights[i, xmin : xmin + size] = w / total if total != 0 else w
    return weights


def _antialiased(x: Any, out_spatial: Sequence[int], scales: Sequence[float | None], align_corners: bool, mode: str):
    if not is_float(x.dtype):
        raise Unsupported(
            "antialiased resampling of an integer (uint8) image: eager computes it with a fixed-point kernel "
            "whose rounding is not reproduced here; convert the image to float32 before interpolating"
        )

    def along(y: Any, axis: int, i: int) -> Any:
        w = jnp.asarray(_aa_weights(y.shape[axis], out_spatial[i], scales[i], align_corners, mode), y.dtype)
        return jnp.moveaxis(jnp.tensordot(y, w, axes=[[axis], [1]]), -1, axis)

    return _separable(x, len(out_spatial), along)


def _antialiased_backward(grad, output_size, input_size, align_corners, scales, mode: str) -> Any:
    sc = _spatial_scales(2, scales or None)
    zeros = jnp.zeros(tuple(input_size), grad.dtype)
    return _transpose_of(lambda t: _antialiased(t, output_size, sc, align_corners, mode), grad, zeros)


@register_lowering(aten._upsample_bilinear2d_aa.default)
def upsample_bilinear_antialiased(x, output_size, align_corners, *scales):
    return _antialiased(x, out_shape()[-2:], _spatial_scales(2, scales or None), align_corners, "bilinear")


@register_lowering(aten._upsample_bicubic2d_aa.default)
def upsample_bicubic_antialiased(x, output_size, align_corners, *scales):
    return _antialiased(x, out_shape()[-2:], _spatial_scales(2, scales or None), align_corners, "bicubic")


@register_lowering(aten._upsample_bilinear2d_aa_backward.default)
def upsample_bilinear_antialiased_backward(grad, output_size, input_size, align_corners, *scales):
    return _antialiased_backward(grad, output_size, input_size, align_corners, scales, "bilinear")


@register_lowering(aten._upsample_bicubic2d_aa_backward.default)
def upsample_bicubic_antialiased_backward(grad, output_size, input_size, align_corners, *scales):
    return _antialiased_backward(grad, output_size, input_size, align_corners, scales, "bicubic")
