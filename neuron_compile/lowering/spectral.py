"""Symmetric eigendecomposition and singular value decomposition by Jacobi rotations, with a fixed number of
sweeps: ``linalg.eigh``/``eigvalsh`` (``_linalg_eigh``), ``linalg.svd``/``svdvals``/``matrix_norm(ord=2,
'nuc')``/``matrix_rank``/``cond`` (``_linalg_svd``) and ``linalg.pinv`` (``linalg_pinv``).

LAPACK iterates until the off-diagonal part is negligible, a trip count that depends on the values, and
neuronx-cc runs only loops with a static trip count. Cyclic Jacobi converges quadratically once the
off-diagonal part is small, and the number of sweeps it needs grows like log2(n): ``_sweeps`` takes
log2(n) + 4, measured to reach eager's float32 accuracy with sweeps to spare on random, clustered, graded
(eigenvalues 1e-7..1e3) and low-rank matrices of orders 2 to 128. A lane whose off-diagonal part is still
above sqrt(eps) of its norm after the last sweep is NaN rather than a wrong number (never seen).

Each sweep is n - 1 rounds of the round-robin ("chess tournament") ordering: the pairs of a round, (i, h + i)
for i < h = n/2, are disjoint, so all h rotations of a round are applied at once as elementwise ops on the top
and bottom halves; between rounds a fixed permutation (static slices) brings the next pairs into place. A
``fori_loop`` runs the rounds, so the module does not grow with n. Odd orders get one padding index whose
rotations are all the identity (its off-diagonal entries are exact zeros); the loop runs whole sweeps, and a
sweep's n - 1 moves bring every index back to its place, so the padding is at index n at the end.

- eigh: two-sided Jacobi on the triangle eager reads (``UPLO``), each rotation zeroing its pair and setting the
  two diagonal entries exactly (Rutishauser's update); eigenvalues ascending as eager's.
- svd: one-sided (Hestenes) Jacobi on the columns (of A^T when A is wide), i.e. two-sided Jacobi on A^T A
  without forming it, so small singular values keep their relative accuracy; singular values descending as
  eager's. U's columns are A V / sigma; where sigma is 0 (and for the extra columns of ``full_matrices``) they
  are fixed vectors made orthogonal to the others (projected, then Jacobi-orthogonalized among themselves).

Eigenvectors and singular vectors are not unique (each can flip sign; repeated values admit any basis of their
space): these are Jacobi's, not LAPACK's, a difference torch's documentation warns of across devices. Values,
reconstructions and sign-invariant uses (projectors, whitening, pinv) match eager to float32 accuracy.
Computed in float32; eager CPU has no 16-bit kernels and raises, so 16-bit operands are refused as in
``factorizations.py``.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .matrix_common import check_order, diagonal, float32_operand, iota, mT
from .registry import current, register_lowering
from .semantics import convert, out_dtype, out_shape
from .sorting import sort_key

aten = torch.ops.aten

#: Largest order a Jacobi solve runs on (n of eigh; min(m, n) of svd, max(m, n) when ``full_matrices`` asks for
#: the square U or V). Measured on XLA CPU: eigh of 64 x 64 ~3 ms, of 128 x 128 ~50 ms (eager: 0.3 / 1.5 ms);
#: the work grows as n^3 log n, so larger matrices belong outside the compiled region.
MAX_ORDER = 128


def _check_order(n: int) -> None:
    check_order(n, MAX_ORDER, "Jacobi sweeps: the work grows as n^3 log n")


def _sweeps(n: int) -> int:
    return max(1, math.ceil(math.log2(max(n, 2)))) + 4


# ---- the round-robin ordering -----------------------------------------------------------------------------
def _next_pairs(x: Any, axis: int) -> Any:
    """The round-robin move along ``axis`` (length 2h, pairs (i, h + i)): index 0 stays, the others move one
    place around the circle top[1:] -> bottom -> top. Static slices only."""
    h = x.shape[axis] // 2
    if h == 1:
        return x
    top = lax.slice_in_dim(x, 0, h, axis=axis)
    bottom = lax.slice_in_dim(x, h, 2 * h, axis=axis)
    pieces = [(top, 0, 1), (bottom, 0, 1), (top, 1, h - 1), (bottom, 1, h), (top, h - 1, h)]
    return jnp.concatenate([lax.slice_in_dim(p, lo, hi, axis=axis) for p, lo, hi in pieces], axis=axis)


def _rotation(app: Any, aqq: Any, apq: Any) -> tuple[Any, Any, Any]:
    """(c, s, t = s / c) of the Jacobi rotation that zeroes ``apq`` of the symmetric 2x2 [[app, apq], [apq,
    aqq]]: the smaller angle (|t| <= 1), by Rutishauser's formula; the identity where ``apq`` is 0."""
    zero = apq == 0
    theta = (aqq - app) / jnp.where(zero, jnp.ones((), apq.dtype), 2 * apq)
    t = jnp.sign(theta) / (jnp.abs(theta) + jnp.sqrt(theta * theta + 1))  # theta^2 = inf: t = 0, not 1/(2 theta)
    t = jnp.where(theta == 0, jnp.ones((), t.dtype), t)
    t = jnp.where(zero, jnp.zeros((), t.dtype), t)
    c = lax.rsqrt(t * t + 1)
    return c, t * c, t


def _rotate(x: Any, c: Any, s: Any, axis: int) -> Any:
    """Rotate index i with index h + i along ``axis`` by (c[i], s[i]): x_i <- c x_i - s x_{h+i},
    x_{h+i} <- s x_i + c x_{h+i} (x J for J = [[c, s], [-s, c]] when ``axis`` is the last)."""
    h = x.shape[axis] // 2
    top = lax.slice_in_dim(x, 0, h, axis=axis)
    bottom = lax.slice_in_dim(x, h, 2 * h, axis=axis)
    if axis == x.ndim - 2:
        c, s = c[..., :, None], s[..., :, None]
    else:
        c, s = c[..., None, :], s[..., None, :]
    return jnp.concatenate([c * top - s * bottom, s * top + c * bottom], axis=axis)


def _pad_even(x: Any, axes: tuple[int, ...]) -> Any:
    pad = [(0, 0, 0)] * x.ndim
    for axis in axes:
        pad[axis] = (0, x.shape[axis] % 2, 0)
    return lax.pad(x, jnp.zeros((), x.dtype), pad)


def _sort_last_axis(values: Any, padding: int | None, *arrays: Any, descending: bool = False) -> list[Any]:
    """``arrays`` (trailing dim n) with their last axis in the (stable) order of ``values`` [..., n]; the index
    ``padding`` (if any) goes last."""
    keys = sort_key(values, descending)
    if padding is not None:
        keys = jnp.where(iota(keys.shape[-1]) == padding, jnp.iinfo(keys.dtype).max, keys)
    out = []
    for array in arrays:
        shaped = jnp.broadcast_to(keys[..., None, :], array.shape) if array.ndim > keys.ndim else keys
        out.append(lax.sort((shaped, array), dimension=array.ndim - 1, num_keys=1, is_stable=True)[1])
    return out


def _nan_unless(converged: Any, *arrays: Any) -> list[Any]:
    nan = jnp.array(np.nan, jnp.float32)
    return [jnp.where(converged.reshape(converged.shape + (1,) * (a.ndim - converged.ndim)), a, nan) for a in arrays]


def _scale(a: Any) -> Any:
    """The largest magnitude of each matrix [..., 1, 1] (1 for a zero or non-finite one): dividing by it keeps
    squares and sums of squares from overflowing or underflowing."""
    scale = jnp.max(jnp.abs(a), axis=(-2, -1), keepdims=True)
    return jnp.where((scale == 0) | ~jnp.isfinite(scale), jnp.ones((), a.dtype), scale)


_TOLERANCE = np.float32(np.sqrt(np.finfo(np.float32).eps))


# ---- symmetric eigendecomposition -------------------------------------------------------------------------
def eigh_f32(a: Any, lower: bool = True) -> tuple[Any, Any]:
    """(eigenvalues ascending [..., n], eigenvectors as columns [..., n, n]) of the symmetric matrix whose
    ``lower`` (else upper) triangle ``a`` [..., n, n] holds, by two-sided cyclic Jacobi."""
    n = a.shape[-1]
    triangle = a.ndim - 2, a.ndim - 1
    part = jnp.tril(a) if lower else jnp.triu(a)
    a = part + mT(jnp.tril(part, -1) if lower else jnp.triu(part, 1))
    scale = _scale(a)
    a = _pad_even(a / scale, triangle)
    order = a.shape[-1]
    h = order // 2
    rows, cols = iota(order)[:, None], iota(order)[None, :]
    on_diagonal = rows == cols
    partners = (rows % h == cols % h) & ~on_diagonal if h else on_diagonal

    def one_round(_: Any, state: tuple[Any, Any]) -> tuple[Any, Any]:
        a, v = state
        d = diagonal(a)
        app, aqq, apq = d[..., :h], d[..., h:], diagonal(a[..., :h, h:])
        c, s, t = _rotation(app, aqq, apq)
        a = _rotate(_rotate(a, c, s, a.ndim - 2), c, s, a.ndim - 1)
        # the rotated pairs' own entries exactly (zero off-diagonal, Rutishauser's diagonal update)
        d = jnp.concatenate([app - t * apq, aqq + t * apq], axis=-1)
        a = jnp.where(on_diagonal, d[..., :, None], jnp.where(partners, jnp.zeros((), a.dtype), a))
        v = _rotate(v, c, s, v.ndim - 1)
        return _next_pairs(_next_pairs(a, a.ndim - 2), a.ndim - 1), _next_pairs(v, v.ndim - 1)

    rounds = _sweeps(n) * (order - 1)
    v = jnp.broadcast_to(jnp.eye(order, dtype=a.dtype), a.shape)
    norm = jnp.sqrt(jnp.sum(a * a, axis=triangle))
    a, v = lax.fori_loop(0, rounds, one_round, (a, v)) if order > 1 else (a, v)
    off = jnp.sqrt(jnp.sum(jnp.where(on_diagonal, jnp.zeros((), a.dtype), a * a), axis=triangle))
    w = diagonal(a)
    w, v = _sort_last_axis(w, n if order != n else None, w, v[..., :n, :])
    w, v = _nan_unless(off <= _TOLERANCE * norm, w[..., :n] * scale[..., 0], v[..., :n])
    return w, v


@register_lowering(aten._linalg_eigh.default)
def linalg_eigh(a: Any, UPLO: str = "L", compute_v: bool = True) -> Any:
    """Eigenvalues ascending and (``compute_v``) eigenvectors as columns; only the ``UPLO`` triangle is read."""
    _check_order(a.shape[-1])
    if a.shape[-1] == 0:
        return jnp.zeros(out_shape(0), out_dtype(0)), jnp.zeros(out_shape(1), out_dtype(1))
    w, v = eigh_f32(float32_operand(a), lower=UPLO.upper() == "L")
    vectors = convert(v, out_dtype(1)) if compute_v else jnp.zeros(out_shape(1), out_dtype(1))
    return convert(w, out_dtype(0)), vectors


# ---- singular value decomposition --------------------------------------------------------------------------
def _orthogonalize_columns(x: Any, v: Any | None, rounds: int, frozen: Any | None = None) -> tuple[Any, Any]:
    """One-sided Jacobi: rotate pairs of columns of ``x`` [..., m, 2h] until they are orthogonal, applying the
    same rotations to the columns of ``v`` (if given). Pairs with a ``frozen`` [..., 2h] column keep still."""

    def one_round(_: Any, state: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
        x, v, frozen = state
        h = x.shape[-1] // 2
        top, bottom = x[..., :h], x[..., h:]
        alpha = jnp.sum(top * top, axis=-2)
        beta = jnp.sum(bottom * bottom, axis=-2)
        gamma = jnp.sum(top * bottom, axis=-2)
        if frozen is not None:
            gamma = jnp.where(frozen[..., :h] | frozen[..., h:], jnp.zeros((), gamma.dtype), gamma)
        c, s, _ = _rotation(alpha, beta, gamma)
        last = x.ndim - 1
        x = _next_pairs(_rotate(x, c, s, last), last)
        if v is not None:
            v = _next_pairs(_rotate(v, c, s, v.ndim - 1), v.ndim - 1)
        if frozen is not None:
            frozen = _next_pairs(frozen, frozen.ndim - 1)
        return x, v, frozen

    if x.shape[-1] < 2:
        return x, v
    x, v, _ = lax.fori_loop(0, rounds, one_round, (x, v, frozen))
    return x, v


def _fixed_vectors(m: int, k: int, dtype: Any) -> Any:
    """k fixed, generic unit vectors of length m (a constant of the graph): candidates for the columns of U
    that the data does not determine. Generic, so never inside a span of fewer than m data vectors."""
    w = np.random.default_rng(0x5EED).standard_normal((m, k))
    return jnp.asarray(w / np.linalg.norm(w, axis=0), dtype)


def _complete(u: Any, known: Any, columns: int) -> Any:
    """``columns`` orthonormal columns whose first u.shape[-1] are ``u``'s where ``known`` [..., n]; the others
    span the rest: fixed vectors with the known columns projected out (twice, for orthogonality to rounding),
    then orthogonalized among themselves by Jacobi rotations and normalized. Orthonormal candidates
    (the identity's, where nothing is known) come through unrotated."""
    m, n = u.shape[-2], u.shape[-1]
    known = jnp.concatenate([known, jnp.zeros(known.shape[:-1] + (columns - n,), bool)], axis=-1)
    u = jnp.concatenate([u, jnp.zeros(u.shape[:-1] + (columns - n,), u.dtype)], axis=-1)
    kept = jnp.where(known[..., None, :], u, jnp.zeros((), u.dtype))
    # Nothing known (a zero matrix): the identity's columns, as eager's U there.
    nothing_known = ~jnp.any(known, axis=-1)[..., None, None]
    w = jnp.where(nothing_known, jnp.eye(m, columns, dtype=u.dtype), _fixed_vectors(m, columns, u.dtype))
    for _ in range(2):
        w = w - kept @ (mT(kept) @ w)
    x = jnp.where(known[..., None, :], u, w)
    x, known = _pad_even(x, (x.ndim - 1,)), _pad_even(known, (known.ndim - 1,))
    x, _ = _orthogonalize_columns(x, None, _sweeps(columns) * (x.shape[-1] - 1), frozen=known)
    x = x[..., :columns]  # whole sweeps: every column is back in its place
    norms = jnp.sqrt(jnp.sum(x * x, axis=-2, keepdims=True))
    return x / jnp.where(norms == 0, jnp.ones((), x.dtype), norms)


def svd_f32(a: Any, compute_uv: bool, full_matrices: bool) -> tuple[Any, Any, Any]:
    """(U [..., m, k or m], S descending [..., k], Vh [..., k or n, n]) of float32 ``a`` [..., m, n],
    k = min(m, n), by one-sided Jacobi on the columns of ``a`` (of a^T when a is wide)."""
    m, n = a.shape[-2], a.shape[-1]
    if m < n:
        u, s, vh = svd_f32(mT(a), compute_uv, full_matrices)
        return (mT(vh), s, mT(u)) if compute_uv else (u, s, vh)
    scale = _scale(a)
    x = _pad_even(a / scale, (a.ndim - 1,))
    order = x.shape[-1]
    rounds = _sweeps(n) * (order - 1)
    v = jnp.broadcast_to(jnp.eye(order, dtype=a.dtype), x.shape[:-2] + (order, order)) if compute_uv else None
    x, v = _orthogonalize_columns(x, v, rounds)
    gram = mT(x) @ x
    sigma = jnp.sqrt(diagonal(gram))
    off = jnp.sqrt(jnp.sum(jnp.where(jnp.eye(order, dtype=bool), jnp.zeros((), a.dtype), gram * gram), axis=(-2, -1)))
    converged = off <= _TOLERANCE * jnp.sqrt(jnp.sum(gram * gram, axis=(-2, -1)))
    padding = n if order != n else None
    if not compute_uv:
        (s,) = _sort_last_axis(sigma, padding, sigma, descending=True)
        (s,) = _nan_unless(converged, s[..., :n] * scale[..., 0])
        return jnp.zeros((0,), a.dtype), s, jnp.zeros((0,), a.dtype)
    s, x, v = _sort_last_axis(sigma, padding, sigma, x, v, descending=True)
    s, x, v = s[..., :n], x[..., :n], v[..., :n, :n]
    known = s > 0
    u = _complete(x / jnp.where(known, s, jnp.ones((), s.dtype))[..., None, :], known, m if full_matrices else n)
    s, u, v = _nan_unless(converged, s * scale[..., 0], u, v)
    return u, s, mT(v)


@register_lowering(aten._linalg_svd.default)
def linalg_svd(a: Any, full_matrices: bool = False, compute_uv: bool = True, driver: str | None = None) -> Any:
    """U, S (descending), Vh; ``full_matrices`` gives the square U and Vh. ``driver`` (a CUDA option) is
    ignored."""
    m, n = a.shape[-2], a.shape[-1]
    _check_order(max(m, n) if compute_uv and full_matrices else min(m, n))
    if min(m, n) == 0:  # eager: the identity where a square U or Vh is asked for
        u, vh = (jnp.broadcast_to(jnp.eye(*out_shape(i)[-2:], dtype=out_dtype(i)), out_shape(i)) for i in (0, 2))
        return u, jnp.zeros(out_shape(1), out_dtype(1)), vh
    u, s, vh = svd_f32(float32_operand(a), compute_uv, full_matrices)
    if not compute_uv:
        return jnp.zeros(out_shape(0), out_dtype(0)), convert(s, out_dtype(1)), jnp.zeros(out_shape(2), out_dtype(2))
    return convert(u, out_dtype(0)), convert(s, out_dtype(1)), convert(vh, out_dtype(2))


@register_lowering(aten.linalg_pinv.atol_rtol_tensor)
def linalg_pinv(a: Any, *, atol: Any = None, rtol: Any = None, hermitian: bool = False) -> Any:
    """Moore-Penrose pseudoinverse as eager forms it: V diag(1/s) U^T over the singular values s above
    max(atol, rtol * s_max) (``hermitian``: U diag(1/w) U^T over the eigenvalues with |w| above it). rtol
    defaults to eps * max(m, n) of the input's dtype, or to 0 where a positive atol is given."""
    m, n = a.shape[-2], a.shape[-1]
    _check_order(min(m, n))
    if min(m, n) == 0:
        return jnp.zeros(out_shape(), out_dtype())
    a32 = float32_operand(a)
    default_rtol = jnp.float32(torch.finfo(current().node.args[0].meta["val"].dtype).eps * max(m, n))
    zero = jnp.zeros((), jnp.float32)
    atol32 = zero if atol is None else convert(atol, jnp.float32)
    if rtol is not None:
        rtol32 = convert(rtol, jnp.float32)
    else:
        rtol32 = default_rtol if atol is None else jnp.where(atol32 > 0, zero, default_rtol)
    if hermitian:
        w, u = eigh_f32(a32)
        magnitude = jnp.abs(w)
        largest, vh = jnp.max(magnitude, axis=-1, keepdims=True), mT(u)
    else:
        u, magnitude, vh = svd_f32(a32, compute_uv=True, full_matrices=False)
        w, largest = magnitude, magnitude[..., :1]
    tolerance = jnp.maximum(atol32[..., None], rtol32[..., None] * largest)
    inverse = jnp.where(magnitude > tolerance, 1 / jnp.where(w == 0, jnp.ones((), w.dtype), w), zero)
    return convert((mT(vh) * inverse[..., None, :]) @ mT(u), out_dtype())
