"""FFT as real DFT matmuls on (real, imag) pairs: ``_fft_r2c``, ``_fft_c2r``, ``_fft_c2c``.

These three aten ops are what ``torch.fft.fft/ifft/rfft/irfft/fft2/ifft2/rfft2/irfft2/fftn/ifftn/rfftn/
irfftn/hfft/ihfft`` (and their backward) decompose to. StableHLO has an ``fft`` op, but neuronx-cc does
not document it (it is absent from the supported-operator table in ../shared/NEURONX_CC_OPS.md, and
complex element types are "mostly unsupported"), so each transformed dim is one ``dot_general`` of the
pair array with a constant real matrix that holds the DFT's cos/sin terms, the pair dim and the norm
factor: legal, TensorEngine work, exact to float32 rounding. The matrices are built in NumPy in float64
(angles from the exact integer ``j*k mod n``) and rounded once to float32.

Cost: a length-n transform is an n x n matmul (O(n^2), not O(n log n)), and its matrix (16 n^2 bytes for
c2c) is a constant of the module; meant for the lengths of spectral layers and audio frames (up to a few
thousand), not for very long signals.
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .complex import PAIR_ELEMENT, Pair, as_pair, register_complex_lowering
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


def c2c(x: Pair, dim: int, forward: bool, scale: float = 1.0) -> Pair:
    n = x.shape[dim]
    return Pair(_contract(x.v, _c2c_matrix(n, n, n, forward, scale), (dim, x.ndim), dim))


def r2c(x: Any, dim: int, onesided: bool, scale: float = 1.0) -> Pair:
    n = x.shape[dim]
    return Pair(_contract(x.astype(PAIR_ELEMENT), _r2c_matrix(n, n // 2 + 1 if onesided else n, scale), (dim,), dim))


def c2r(x: Pair, dim: int, n: int, scale: float = 1.0) -> Any:
    half = min(x.shape[dim], n // 2 + 1)
    v = lax.slice_in_dim(x.v, 0, half, axis=dim)
    return _contract(v, _c2r_matrix(half, n, scale), (dim, x.ndim), dim)


def _dims(dim: list[int], ndim: int) -> list[int]:
    return [canonical_dim(d, ndim) for d in dim]


@register_complex_lowering(aten._fft_c2c)
def fft_c2c(x: Pair, dim: list[int], normalization: int, forward: bool) -> Pair:
    x = as_pair(x)
    for d in _dims(dim, x.ndim):
        x = c2c(x, d, forward, _NORM[normalization](x.shape[d]))
    return x


@register_complex_lowering(aten._fft_r2c)
def fft_r2c(x: Any, dim: list[int], normalization: int, onesided: bool) -> Pair:
    dims = _dims(dim, x.ndim)
    *rest, last = dims
    out = r2c(x, last, onesided, _NORM[normalization](x.shape[last]))
    for d in rest:
        out = c2c(out, d, True, _NORM[normalization](x.shape[d]))
    return out


@register_complex_lowering(aten._fft_c2r)
def fft_c2r(x: Pair, dim: list[int], normalization: int, last_dim_size: int) -> Any:
    dims = _dims(dim, x.ndim)
    *rest, last = dims
    for d in rest:
        x = c2c(x, d, False, _NORM[normalization](x.shape[d]))
    n = int(last_dim_size)
    return c2r(x, last, n, _NORM[normalization](n))
