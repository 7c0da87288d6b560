"""FFT as real DFT matmuls on (real, imag) pairs: ``_fft_r2c``, ``_fft_c2r``, ``_fft_c2c``.

These three aten ops are what ``torch.fft.fft/ifft/rfft/irfft/fft2/ifft2/rfft2/irfft2/fftn/ifftn/rfftn/
irfftn/hfft/ihfft`` (and their backward) decompose to. StableHLO has an ``fft`` op, but neuronx-cc does
not document it (it is absent from the supported-operator table in ../shared/NEURONX_CC_OPS.md, and
complex element types are "mostly unsupported"), so a transformed dim is a ``dot_general`` of the
pair array with a constant real matrix that holds the DFT's cos/sin terms, the pair dim and the norm
factor: legal, TensorEngine work, exact to float32 rounding. The matrices are built in NumPy in float64
(angles from the exact integer ``j*k mod n``) and rounded once to float32.

Cost: up to ``DIRECT_MAX`` points a transform is one n x n matmul (its matrix a constant of the module).
Longer composite lengths take one Cooley-Tukey step n = n1 * n2 (n1 near sqrt(n)) per level: DFTs of n1
and n2 points around an elementwise twiddle multiply, so the work is O(n (n1 + n2)) and the constants
O(n) (a 4096-point fft is 64-point DFT matmuls on both sides of one twiddle multiply, not a 256 MB
matrix). Lengths with no factor >= 4 (primes, 2 * prime) stay one matmul: O(n^2) work and constant, fine
for the lengths of spectral layers and audio frames, costly for long prime lengths (Bluestein's algorithm
would fix that; not done).

``aten.unfold`` (the frames of ``torch.stft``/``istft``; a real op) is lowered here too: with it, stft and
istft decompose into ops that are all lowered.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .complex_pairs import PAIR_ELEMENT, Pair, as_pair, cmul, conj
from .registry import register_complex_pair, register_lowering
from .semantics import canonical_dim

aten = torch.ops.aten

#: torch's fft_norm_mode: 0 none, 1 by 1/sqrt(n), 2 by 1/n (applied to the transform it is given to).
_NORM = {0: lambda n: 1.0, 1: lambda n: 1.0 / np.sqrt(n), 2: lambda n: 1.0 / n}


def _angles(n_in: int, n_out: int, n: int) -> np.ndarray:
    """2*pi*(j*k mod n)/n for j < n_in, k < n_out: the reduction is exact in integers, so the angles
    are as precise for large j*k as for small."""
    jk = np.outer(np.arange(n_in, dtype=np.int64), np.arange(n_out, dtype=np.int64)) % n
    return 2.0 * np.pi * jk / n


def _snap(a: np.ndarray) -> np.ndarray:
    # sin(pi) is 1.2e-16 in float64, not 0: the terms that are exactly zero in the DFT stay zero.
    return np.where(np.abs(a) < 1e-12, 0.0, a)


@functools.lru_cache(maxsize=64)
def _c2c_matrix(n_in: int, n_out: int, n: int, forward: bool, scale: float) -> np.ndarray:
    """M[j, q, k, p]: out[k, p] = sum_{j, q} x[j, q] M[j, q, k, p] (q, p: real 0 / imag 1)."""
    theta = _angles(n_in, n_out, n)
    c, s = _snap(np.cos(theta)) * scale, _snap(np.sin(theta)) * scale * (-1.0 if forward else 1.0)
    m = np.empty((n_in, 2, n_out, 2))
    m[:, 0, :, 0], m[:, 1, :, 0], m[:, 0, :, 1], m[:, 1, :, 1] = c, -s, s, c
    return m.astype(np.float32)


@functools.lru_cache(maxsize=64)
def _r2c_matrix(n: int, n_out: int, scale: float) -> np.ndarray:
    """M[j, k, p] for real input: out[k] = sum_j x[j] exp(-2 pi i j k / n)."""
    theta = _angles(n, n_out, n)
    return np.stack([_snap(np.cos(theta)) * scale, -_snap(np.sin(theta)) * scale], axis=-1).astype(np.float32)


@functools.lru_cache(maxsize=64)
def _c2r_matrix(n_in: int, n: int, scale: float) -> np.ndarray:
    """M[k, q, j]: the real inverse of the onesided spectrum x[k < n_in] of a length-n real signal.

    Each k other than 0 and n/2 stands for itself and its conjugate mirror (weight 2); the imaginary
    parts of bins 0 and n/2 do not contribute (their sine terms are 0), as in eager's c2r.
    """
    theta = _angles(n_in, n, n)
    weight = np.full(n_in, 2.0)
    weight[0] = 1.0
    if n % 2 == 0 and n // 2 < n_in:
        weight[n // 2] = 1.0
    w = (weight * scale)[:, None]
    return np.stack([_snap(np.cos(theta)) * w, -_snap(np.sin(theta)) * w], axis=1).astype(np.float32)


def _contract(x: Any, matrix: np.ndarray, x_dims: tuple[int, ...], axis: int) -> Any:
    """dot_general of ``x`` over ``x_dims`` with the matrix's leading dims; the matrix's first remaining
    dim goes to ``axis`` (a pair's trailing dim, if any, stays last)."""
    m = jnp.asarray(matrix, PAIR_ELEMENT)
    k = len(x_dims)
    out = lax.dot_general(
        x,
        m,
        ((x_dims, tuple(range(k))), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=PAIR_ELEMENT,
    )
    trailing = m.ndim - k  # the transformed dim, and the pair dim for complex results
    return jnp.moveaxis(out, out.ndim - trailing, axis)


#: Longest transform done as one DFT matmul; longer composite lengths are split (``_split``).
DIRECT_MAX = 128


def _split(n: int) -> int:
    """The factor n1 of n = n1 * n2 closest to sqrt(n) from below, or 1 when n should not be split."""
    if n <= DIRECT_MAX:
        return 1
    n1 = max((d for d in range(2, math.isqrt(n) + 1) if n % d == 0), default=1)
    return n1 if n1 >= 4 else 1  # e.g. 2 * prime: two passes would cost about what one does


@functools.lru_cache(maxsize=64)
def _twiddles(n1: int, n2: int, forward: bool) -> np.ndarray:
    theta = 2.0 * np.pi * (np.outer(np.arange(n1), np.arange(n2)) % (n1 * n2)) / (n1 * n2)
    return np.stack([np.cos(theta), np.sin(theta) * (-1.0 if forward else 1.0)], axis=-1).astype(np.float32)


def c2c(x: Pair, dim: int, forward: bool, scale: float = 1.0) -> Pair:
    """The DFT of ``x`` along ``dim``: one matmul up to ``DIRECT_MAX``; longer composite lengths by one
    Cooley-Tukey step n = n1 * n2 (DFTs of n1 and n2 points, twiddles between; recursively), so the
    constants stay O(n) instead of the O(n^2) of a single DFT matrix."""
    n = x.shape[dim]
    n1 = _split(n)
    if n1 == 1:
        return Pair(_contract(x.v, _c2c_matrix(n, n, n, forward, scale), (dim, x.ndim), dim))
    n2 = n // n1
    v = jnp.moveaxis(x.v, dim, -2)  # [..., n, 2], j = j1 * n2 + j2
    lead = v.shape[:-2]
    y = Pair(jnp.reshape(v, (*lead, n1, n2, 2)))
    y = c2c(y, y.ndim - 2, forward, scale)  # over j1: [..., k1, j2]
    t = _twiddles(n1, n2, forward)
    y = cmul(y, Pair(jnp.asarray(t, PAIR_ELEMENT)))
    y = c2c(y, y.ndim - 1, forward)  # over j2: [..., k1, k2]
    v = jnp.swapaxes(y.v, -3, -2)  # k = k1 + n1 * k2: k2 is the outer index
    return Pair(jnp.moveaxis(jnp.reshape(v, (*lead, n, 2)), -2, dim))


def r2c(x: Any, dim: int, onesided: bool, scale: float = 1.0) -> Pair:
    n = x.shape[dim]
    n_out = n // 2 + 1 if onesided else n
    if _split(n) > 1:  # long: the complex transform of (x, 0), cut to the onesided half
        return Pair(lax.slice_in_dim(c2c(as_pair(x), dim, True, scale).v, 0, n_out, axis=dim))
    return Pair(_contract(x.astype(PAIR_ELEMENT), _r2c_matrix(n, n_out, scale), (dim,), dim))


def c2r(x: Pair, dim: int, n: int, scale: float = 1.0) -> Any:
    half = min(x.shape[dim], n // 2 + 1)
    v = lax.slice_in_dim(x.v, 0, half, axis=dim)
    if _split(n) > 1:
        # long: complete the Hermitian spectrum (bin k > n/2 is conj of bin n - k; absent bins are 0)
        # and take the real part of the complex inverse. The imaginary parts of bins 0 and n/2 only
        # reach the imaginary part of the result, which is dropped, as eager's c2r ignores them.
        full = jnp.zeros((*v.shape[:dim], n, *v.shape[dim + 1 :]), PAIR_ELEMENT)
        full = lax.dynamic_update_slice_in_dim(full, v, 0, axis=dim)
        mirror_count = n - (n // 2 + 1)  # bins n//2+1 .. n-1 mirror bins n - k = n//2-ish .. 1
        src = lax.slice_in_dim(full, 1, 1 + mirror_count, axis=dim)
        mirror = conj(Pair(jnp.flip(src, axis=dim))).v
        full = lax.slice_in_dim(full, 0, n - mirror_count, axis=dim)
        full = jnp.concatenate([full, mirror], axis=dim)
        return c2c(Pair(full), dim, False, scale).re
    return _contract(v, _c2r_matrix(half, n, scale), (dim, x.ndim), dim)


def _dims(dim: list[int], ndim: int) -> list[int]:
    return [canonical_dim(d, ndim) for d in dim]


@register_complex_pair(aten._fft_c2c)
def fft_c2c(x: Pair, dim: list[int], normalization: int, forward: bool) -> Pair:
    x = as_pair(x)
    for d in _dims(dim, x.ndim):
        x = c2c(x, d, forward, _NORM[normalization](x.shape[d]))
    return x


@register_complex_pair(aten._fft_r2c)
def fft_r2c(x: Any, dim: list[int], normalization: int, onesided: bool) -> Pair:
    dims = _dims(dim, x.ndim)
    *rest, last = dims
    out = r2c(x, last, onesided, _NORM[normalization](x.shape[last]))
    for d in rest:
        out = c2c(out, d, True, _NORM[normalization](x.shape[d]))
    return out


@register_complex_pair(aten._fft_c2r)
def fft_c2r(x: Pair, dim: list[int], normalization: int, last_dim_size: int) -> Any:
    dims = _dims(dim, x.ndim)
    *rest, last = dims
    for d in rest:
        x = c2c(x, d, False, _NORM[normalization](x.shape[d]))
    n = int(last_dim_size)
    return c2r(x, last, n, _NORM[normalization](n))


@register_lowering(aten.unfold)
def unfold(x: Any, dimension: int, size: int, step: int) -> Any:
    """Sliding windows of ``size`` every ``step`` along ``dimension``, as a new last dim: the frames of
    ``torch.stft``/``istft``. One gather with constant indices (a slice per frame would be one op each)."""
    if x.ndim == 0:
        return jnp.reshape(x, (1,))
    axis = canonical_dim(dimension, x.ndim)
    frames = (x.shape[axis] - size) // step + 1
    index = np.arange(frames)[:, None] * step + np.arange(size)[None, :]
    out = jnp.take(
        x, jnp.asarray(index, jnp.int32), axis=axis, mode="clip"
    )  # in range: no fill masks; dims: ..., frames, size, ...
    return jnp.moveaxis(out, axis + 1, -1)
