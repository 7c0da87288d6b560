"""grid_sampler_3d and the backward of grid_sampler_2d/3d (nn.functional.grid_sample).

grid_sampler_2d's forward is torch's own decomposition (decompositions.EXTRA_DECOMPOSITIONS); autograd
records its backward, and the 3-d op has no decomposition, so both are written here once for any number
of spatial dims, following eager's CPU kernel (GridSampler.h):

- grid coordinates in [-1, 1] are unnormalized to pixel positions (``align_corners`` picks the corner or
  the edge convention), then padded: ``border`` clips into the image, ``reflection`` reflects about its
  edges and clips, ``zeros`` leaves them (out-of-range taps read 0);
- bilinear/trilinear mixes the 2**d corners with the products of per-dim distances, nearest rounds half to
  even, bicubic (2-d only) mixes 4x4 taps with the cubic convolution (A = -0.75), padding each tap.

All taps of a point are one gather at computed positions, weighted (0 out of bounds) and summed: nothing
data-dependent in shape. The backward is ``jax.vjp`` of that forward: the input's gradient is the
scatter-add of the mixing weights, the grid's the derivative of the weights, with eager's conventions at
the clipping and reflection kinks (clipped coordinates get 0, the reflection's sign at 0 is +1), which
the padding below is written to give.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import torch
from jax import lax

from .registry import Unsupported, current, register_lowering
from .semantics import convert, is_float, opmath_dtype

aten = torch.ops.aten

_BILINEAR, _NEAREST, _BICUBIC = 0, 1, 2
_ZEROS, _BORDER, _REFLECTION = 0, 1, 2


def _unnormalize(coord: Any, size: int, align_corners: bool) -> Any:
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _clip(coord: Any, size: int) -> Any:
    # written with selects so the derivative is 0 where clipped and 1 inside, eager's clip_coordinates_set_grad
    limit = jnp.asarray(size - 1, coord.dtype)
    return jnp.where(coord <= 0, jnp.zeros((), coord.dtype), jnp.where(coord >= limit, limit, coord))


def _reflect(coord: Any, twice_low: int, twice_high: int) -> Any:
    """Eager's reflect_coordinates: ``coord`` reflected into [low, high] (as halves of the twice values)."""
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    low = jnp.asarray(twice_low / 2, coord.dtype)
    span = jnp.asarray((twice_high - twice_low) / 2, coord.dtype)
    x = coord - low
    x = jnp.where(x < 0, -x, x)  # the sign's derivative is +1 at 0, as eager's
    extra = jnp.fmod(x, span)
    flips = jnp.floor(x / span)
    even = jnp.fmod(flips, 2) == 0
    return jnp.where(even, extra + low, span - extra + low)


def _pad(coord: Any, size: int, padding_mode: int, align_corners: bool) -> Any:
    if padding_mode == _BORDER:
        return _clip(coord, size)
    if padding_mode == _REFLECTION:
        if align_corners:
            coord = _reflect(coord, 0, 2 * (size - 1))
        else:
            coord = _reflect(coord, -1, 2 * size - 1)
        return _clip(coord, size)
    return coord


def _taps(channels_last: Any, positions: Sequence[Any], sizes: Sequence[int], weights: Any) -> Any:
    """``sum_t weights[t] * channels_last[n, positions[.][t]]``, a tap reading 0 where out of bounds.

    ``channels_last`` is [N, *spatial, C]; ``positions`` one int32 [T, N, *out] array per spatial dim (in
    spatial order) and ``weights`` [T, N, *out]: all T taps are one gather (and, in the backward, one
    scatter-add), whatever the interpolation. Returns [N, C, *out]."""
    inside = None
    clipped = []
    for p, size in zip(positions, sizes):
        p = lax.stop_gradient(p)
        ok = jnp.logical_and(p >= 0, p < size)
        inside = ok if inside is None else jnp.logical_and(inside, ok)
        clipped.append(jnp.clip(p, 0, size - 1))
    batch = lax.broadcasted_iota(jnp.int32, positions[0].shape, 1)
    values = channels_last[(batch, *clipped)]  # [T, N, *out, C]
    weights = jnp.where(inside, weights, jnp.zeros((), weights.dtype))
    return jnp.moveaxis(jnp.sum(values * weights[..., None], axis=0), -1, 1)


def _cubic_coefficients(t: Any) -> list[Any]:
    a = -0.75

    def near(x: Any) -> Any:  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x: Any) -> Any:  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def _sample(x: Any, grid: Any, mode: int, padding_mode: int, align_corners: bool) -> Any:
    """grid_sample of ``x`` [N, C, *spatial] at ``grid`` [N, *out, d] (last axis x, y[, z]): [N, C, *out]."""
    d = grid.shape[-1]
    sizes = x.shape[2:]
    channels_last = jnp.moveaxis(x, 1, -1)
    # grid's last axis runs over the spatial dims from the last (x = width) to the first
    coords = [grid[..., d - 1 - k] for k in range(d)]
    if mode == _BICUBIC:
        if d != 2:
            raise Unsupported("bicubic grid_sample of a 3-d input (eager supports it for 2-d only)")
        pos = [_unnormalize(c, s, align_corners) for c, s in zip(coords, sizes)]
        base = [jnp.floor(p) for p in pos]
        cubic = [_cubic_coefficients(p - b) for p, b in zip(pos, base)]
        taps: list[list[Any]] = [[], []]
        weights = []
        for i in range(4):  # rows (y), then columns (x); each tap coordinate padded on its own, as eager
            for j in range(4):
                for k, offset in enumerate((i, j)):
                    c = _pad(base[k] - 1 + offset, sizes[k], padding_mode, align_corners)
                    taps[k].append(convert(c, jnp.int32))
                weights.append(cubic[0][i] * cubic[1][j])
        return _taps(channels_last, [jnp.stack(t) for t in taps], sizes, jnp.stack(weights))
    pos = [_pad(_unnormalize(c, s, align_corners), s, padding_mode, align_corners) for c, s in zip(coords, sizes)]
    if mode == _NEAREST:
        taps1 = [convert(jnp.round(p), jnp.int32)[None] for p in pos]
        return _taps(channels_last, taps1, sizes, jnp.ones((1,) + pos[0].shape, pos[0].dtype))
    if mode != _BILINEAR:
        raise Unsupported(f"grid_sample with interpolation_mode={mode} (0 bilinear, 1 nearest, 2 bicubic)")
    low = [jnp.floor(p) for p in pos]
    corners: list[list[Any]] = [[] for _ in range(d)]
    weights = []
    for corner in range(2**d):
        weight = None
        for k in range(d - 1, -1, -1):  # eager multiplies the x weight first, then y, then z
            w = (pos[k] - low[k]) if (corner >> k) & 1 else (low[k] + 1 - pos[k])
            weight = w if weight is None else weight * w
        weights.append(weight)
        for k in range(d):
            corners[k].append(convert(low[k], jnp.int32) + ((corner >> k) & 1))
    return _taps(channels_last, [jnp.stack(c) for c in corners], sizes, jnp.stack(weights))


def _check(x: Any, interpolation_mode: int, padding_mode: int) -> None:
    if not is_float(x.dtype):
        raise Unsupported(f"grid_sample of {jnp.dtype(x.dtype)} (eager supports floating inputs only)")
    if padding_mode not in (_ZEROS, _BORDER, _REFLECTION):
        raise Unsupported(f"grid_sample with padding_mode={padding_mode} (0 zeros, 1 border, 2 reflection)")


@register_lowering(aten.grid_sampler_3d)
def grid_sampler_3d(x, grid, interpolation_mode, padding_mode, align_corners):
    _check(x, interpolation_mode, padding_mode)
    acc = opmath_dtype(x.dtype)
    out = _sample(convert(x, acc), convert(grid, acc), interpolation_mode, padding_mode, align_corners)
    return convert(out, x.dtype)


def _backward(grad, x, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    _check(x, interpolation_mode, padding_mode)
    acc = opmath_dtype(x.dtype)

    def forward(inp: Any, g: Any) -> Any:
        return _sample(inp, g, interpolation_mode, padding_mode, align_corners)

    _, pullback = jax.vjp(forward, convert(x, acc), convert(grid, acc))
    grad_x, grad_grid = pullback(convert(grad, acc))
    wanted = current().out
    if wanted[1] is not None and not output_mask[1]:
        # torch still returns a grid gradient when none was asked for (uninitialized memory): zeros here.
        grad_grid = jnp.zeros_like(grad_grid)
    return (
        convert(grad_x, x.dtype) if output_mask[0] and wanted[0] is not None else None,
        convert(grad_grid, grid.dtype) if wanted[1] is not None else None,
    )


@register_lowering(aten.grid_sampler_2d_backward)
def grid_sampler_2d_backward(grad, x, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    return _backward(grad, x, grid, interpolation_mode, padding_mode, align_corners, output_mask)


@register_lowering(aten.grid_sampler_3d_backward)
def grid_sampler_3d_backward(grad, x, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    return _backward(grad, x, grid, interpolation_mode, padding_mode, align_corners, output_mask)
