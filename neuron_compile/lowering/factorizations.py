"""Linear-algebra factorizations of matrices with static sizes: triangular solves, Cholesky, LU with partial
pivoting, and what is built on them (solve, inverse, det, slogdet, lu_solve, lu_unpack); Householder QR
(linalg.qr, geqrf, householder_product, ormqr).

Shapes are static, so factoring an n x n matrix is n unrolled steps, each a handful of elementwise ops,
compares, selects and reductions over the whole (batched) matrix: all documented neuronx-cc ops, with no
loop, no conditional and no gather/scatter. Ops act on the trailing two dims; leading dims are a batch that
every step handles at once.

Partial pivoting used to be refused as "data-dependent gather/scatter" (the class neuronx-cc is known to
miscompile, issue #1381). That refusal does not apply to this lowering: only WHICH row becomes the pivot
depends on the values, and no index is ever used to address memory. Per column k the pivot is the first
row of maximal |A[k:, k]| (LAPACK's idamax rule: a max-reduce, then a min-reduce of an iota masked by
``== max``), the swap of rows k and p is a ``select`` with the one-hot masks ``iota == k``/``iota == p``
(row p is read as a masked add-reduction: a sum of one value and exact zeros), and the pivots are int32
values the graph returns. Applying stored pivots (lu_solve, lu_unpack) is the same one-hot row swap.

Special values follow reference BLAS/LAPACK, so singular and non-definite inputs give what eager gives:
Cholesky stops at the first pivot that is not > 0 (NaN included) and reports ``info`` = its 1-based
order, leaving the partly filled factor LAPACK's dpotf2 leaves; LU
reports the first zero pivot and still completes the factorization; a solve with a zero pivot divides by
it, giving the inf and NaN values eager gives.

Everything is computed in float32 (float64 as float32, as everywhere here). Eager CPU has no bfloat16/float16
kernels for these ops and raises, so 16-bit operands are refused with the advice to cast to float32.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import torch

from .matrix_common import check_order, diagonal, float32_operand, iota, mT, op_name
from .registry import Unsupported, register_lowering
from .semantics import convert, out_dtype, out_shape

aten = torch.ops.aten

#: Largest matrix order lowered. Each factorization is n unrolled steps of ~100 HLO ops over the whole
#: (batched) n x n matrix, so the module grows linearly in n and the elementwise work as n^3, on the vector
#: engine rather than the matmul engine. Measured with XLA CPU on the shared 2-core machine: LU of 16 x 16 is
#: 1.6k ops (8 s to compile), of 64 x 64 6.5k ops (43 s), LU plus a solve of 64 x 64 10k ops (74 s). Past 64
#: the compile time (neuronx-cc's too, which grows with the module) outweighs any gain of keeping the op in
#: the graph: such systems belong outside it.
MAX_ORDER = 64


# ---- small helpers ------------------------------------------------------------------------------------
def _check_order(*sizes: int) -> None:
    check_order(max(sizes, default=0), MAX_ORDER, "unrolled loops: the module grows with the order")


def _batch_broadcast(*xs: Any, core: tuple[int, ...]) -> list[Any]:
    """Broadcast the leading (batch) dims of each array; ``core[i]`` trailing dims of ``xs[i]`` are its own."""
    batches = [x.shape[: x.ndim - c] for x, c in zip(xs, core)]
    batch = tuple(np.broadcast_shapes(*batches))
    return [jnp.broadcast_to(x, batch + x.shape[x.ndim - c :]) for x, c in zip(xs, core)]


def _row(a: Any, onehot: Any) -> Any:
    """The row of ``a`` [..., m, n] selected by the bool ``onehot`` [..., m]: a masked sum (one value, exact
    zeros elsewhere, so inf/NaN of other rows do not leak in)."""
    return jnp.sum(jnp.where(onehot[..., :, None], a, jnp.zeros((), a.dtype)), axis=-2)


def _swap_rows(a: Any, k: int, p: Any) -> Any:
    """Rows k (static) and p (int32 [...], per batch element) of ``a`` [..., m, n] exchanged, by select."""
    rows = iota(a.shape[-2])
    e_k = jnp.broadcast_to(rows == k, a.shape[:-1])
    e_p = rows == p[..., None]
    row_k = a[..., k, :]
    row_p = _row(a, e_p)
    swapped = jnp.where(e_p[..., :, None], row_k[..., None, :], a)
    return jnp.where(e_k[..., :, None], row_p[..., None, :], swapped)


def _apply_pivots(b: Any, pivots: Any, reverse: bool = False) -> Any:
    """``b`` [..., m, r] with rows i and pivots[i] - 1 exchanged for i = 0, 1, ... (backwards if
    ``reverse``): LAPACK's laswp, i.e. P^T b for A = P L U (``reverse``: P b)."""
    order = range(pivots.shape[-1])
    for i in reversed(order) if reverse else order:
        b = _swap_rows(b, i, convert(pivots[..., i], jnp.int32) - 1)
    return b


# ---- triangular solve -----------------------------------------------------------------------------------
def _trsm_left(a: Any, b: Any, lower: bool, unit: bool) -> Any:
    """X with tri(a) X = b, a [..., n, n], b [..., n, r] (same batch), column-oriented: x_k = b_k / a_kk,
    then b_i -= a_ik x_k for the rows i after k. Only ``a``'s ``lower``/upper triangle is read, its diagonal
    not at all if ``unit``. No entry is skipped: a zero pivot gives inf and 0 * inf NaN where the optimized
    BLAS behind eager gives them (reference dtrsm skips zero entries; MKL/OpenBLAS kernels do not)."""
    n = a.shape[-1]
    rows = iota(n)
    for k in range(n) if lower else reversed(range(n)):
        x = b[..., k, :]
        if not unit:
            x = x / a[..., k, k, None]
        after = (rows > k if lower else rows < k)[:, None]
        # Rows not after k are left alone by select (a multiply by a 0/1 mask would turn inf into NaN there).
        b = jnp.where(after, b - a[..., :, k, None] * x[..., None, :], b)
        b = jnp.where((rows == k)[:, None], x[..., None, :], b)
    return b


def triangular_solve_f32(a: Any, b: Any, upper: bool, left: bool = True, unit: bool = False,
                         transpose: bool = False) -> Any:  # fmt: skip
    """op(tri(a)) X = b (``left``) or X op(tri(a)) = b, op = transpose if ``transpose``; float32 [..., n, n]
    and [..., n, r] / [..., r, n] with broadcast batch dims."""
    a, b = _batch_broadcast(a, b, core=(2, 2))
    if not left:  # X A = B  <=>  A^T X^T = B^T
        b, transpose = mT(b), not transpose
    lower = not upper
    if transpose:  # the transpose of a lower factor is upper
        a, lower = mT(a), not lower
    x = _trsm_left(a, b, lower, unit) if a.shape[-1] else b
    return x if left else mT(x)


@register_lowering(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(a: Any, b: Any, *, upper: bool, left: bool = True, unitriangular: bool = False) -> Any:
    _check_order(a.shape[-1])
    x = triangular_solve_f32(float32_operand(a), float32_operand(b), upper, left, unitriangular)
    return convert(jnp.broadcast_to(x, out_shape()), out_dtype())


@register_lowering(aten.triangular_solve.default)
def triangular_solve(b: Any, a: Any, upper: bool = True, transpose: bool = False, unitriangular: bool = False) -> Any:
    """``torch.triangular_solve(b, A)``: (the solution of op(A) X = b, a copy of A broadcast to the batch)."""
    _check_order(a.shape[-1])
    x = triangular_solve_f32(float32_operand(a), float32_operand(b), upper, True, unitriangular, transpose)
    return convert(x, out_dtype(0)), convert(jnp.broadcast_to(a, out_shape(1)), out_dtype(1))


# ---- Cholesky -------------------------------------------------------------------------------------------
def cholesky_f32(a: Any, upper: bool = False) -> tuple[Any, Any]:
    """(factor, int32 info) of float32 [..., n, n]: L with L L^T = A from A's lower triangle (``upper``: U
    with U^T U = A from its upper triangle). Right-looking: step j takes sqrt of the pivot, scales the column
    below it and subtracts its outer product from the trailing block (``work``).

    A pivot that is not > 0 stops the batch element at j (info = j + 1). What is left then is what LAPACK's
    left-looking dpotf2 leaves, which eager returns: the columns before j factored, the pivot's updated
    value at (j, j), and A's own values below and to the right of it."""
    if upper:
        a = mT(a)
    n = a.shape[-1]
    rows = iota(n)
    batch = a.shape[:-2]
    zero = jnp.zeros((), a.dtype)
    info = jnp.zeros(batch, jnp.int32)
    failed = jnp.zeros(batch, jnp.bool_)
    work, out = a, a
    trailing_of = [jnp.logical_and((rows > j)[:, None], (rows > j)[None, :]) for j in range(n)]
    for j in range(n):
        d = work[..., j, j]
        bad = jnp.logical_and(jnp.logical_not(d > 0), jnp.logical_not(failed))  # NaN is not > 0
        info = jnp.where(bad, jnp.int32(j + 1), info)
        s = jnp.sqrt(jnp.where(d > 0, d, jnp.ones((), a.dtype)))
        col = jnp.where(rows > j, work[..., :, j] / s[..., None], zero)
        kept = out[..., :, j]
        factored = jnp.where(rows == j, s[..., None], jnp.where(rows > j, col, kept))
        stopped = jnp.where(rows == j, d[..., None], kept)
        new_col = jnp.where(failed[..., None], kept, jnp.where(bad[..., None], stopped, factored))
        out = jnp.where((rows == j)[None, :], new_col[..., :, None], out)
        failed = jnp.where(bad, True, failed)  # a select: "or" is not in the documented op table
        if j + 1 < n:
            update = jnp.where(trailing_of[j], col[..., :, None] * col[..., None, :], zero)
            work = jnp.where(failed[..., None, None], work, work - update)
    factor = jnp.where(rows[:, None] >= rows[None, :], out, zero)
    return (mT(factor) if upper else factor), info


@register_lowering(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(a: Any, *, upper: bool = False, check_errors: bool = False) -> Any:
    if check_errors:
        raise Unsupported(
            "linalg_cholesky_ex with check_errors=True raises on the values, which a Trainium graph cannot do: "
            "call torch.linalg.cholesky_ex(A) and test its info output instead"
        )
    _check_order(a.shape[-1])
    factor, info = cholesky_f32(float32_operand(a), upper)
    return convert(factor, out_dtype(0)), info


@register_lowering(aten.cholesky.default)
def cholesky(a: Any, upper: bool = False) -> Any:
    """``torch.cholesky`` (deprecated). Its error check (eager raises on a non-positive-definite input) runs
    after the graph: compile_graph turns this node into linalg_cholesky_ex plus that check (value_checks.py),
    so this lowering serves graphs lowered without that rewrite."""
    _check_order(a.shape[-1])
    return convert(cholesky_f32(float32_operand(a), upper)[0], out_dtype())


@register_lowering(aten.cholesky_solve.default)
def cholesky_solve(b: Any, factor: Any, upper: bool = False) -> Any:
    """X with A X = b for A = L L^T (``upper``: U^T U), ``factor`` being L (U): two triangular solves."""
    _check_order(factor.shape[-1])
    f, b = _batch_broadcast(float32_operand(factor), float32_operand(b), core=(2, 2))
    if upper:  # U^T (U X) = b
        x = triangular_solve_f32(f, triangular_solve_f32(f, b, upper=True, transpose=True), upper=True)
    else:  # L (L^T X) = b
        x = triangular_solve_f32(f, triangular_solve_f32(f, b, upper=False), upper=False, transpose=True)
    return convert(x, out_dtype())


@register_lowering(aten.cholesky_inverse.default)
def cholesky_inverse(factor: Any, upper: bool = False) -> Any:
    """(L L^T)^-1 (``upper``: (U^T U)^-1) from the factor: cholesky_solve of the identity."""
    n = factor.shape[-1]
    _check_order(n)
    f = float32_operand(factor)
    eye = jnp.broadcast_to(jnp.eye(n, dtype=jnp.float32), f.shape)
    if upper:
        x = triangular_solve_f32(f, triangular_solve_f32(f, eye, upper=True, transpose=True), upper=True)
    else:
        x = triangular_solve_f32(f, triangular_solve_f32(f, eye, upper=False), upper=False, transpose=True)
    return convert(x, out_dtype())


# ---- LU with partial pivoting ----------------------------------------------------------------------------
def _pivot_row(col: Any, k: int) -> Any:
    """int32 [...]: LAPACK's idamax over rows >= k of ``col`` [..., m]: the first row of maximal |value|.
    As reference idamax, NaN never beats a number, and a NaN in row k itself is kept as the pivot."""
    m = col.shape[-1]
    rows = iota(m)
    mag = jnp.abs(col)
    candidate = jnp.logical_and(rows >= k, jnp.logical_not(jnp.isnan(mag)))
    biggest = jnp.max(jnp.where(candidate, mag, jnp.full((), -1.0, mag.dtype)), axis=-1)
    hit = jnp.logical_and(candidate, mag == biggest[..., None])
    first = jnp.min(jnp.where(hit, rows, jnp.int32(m)), axis=-1)
    first = jnp.where(first == m, jnp.int32(k), first)  # no candidate: every entry is NaN
    return jnp.where(jnp.isnan(mag[..., k]), jnp.int32(k), first)


def lu_f32(a: Any) -> tuple[Any, Any, Any]:
    """(LU packed, int32 1-based pivots [..., min(m, n)], int32 info) of float32 [..., m, n], as LAPACK's
    getrf: per column k the pivot row p (first max |A[k:, k]|) is swapped with row k across the whole
    matrix, the column below the pivot is divided by the pivot and its outer product with the pivot row is
    subtracted from the trailing block. A zero pivot sets info (first one, 1-based) and skips the scaling."""
    m, n = a.shape[-2], a.shape[-1]
    rows, cols = iota(m), iota(n)
    zero = jnp.zeros((), a.dtype)
    info = jnp.zeros(a.shape[:-2], jnp.int32)
    pivots = []
    for k in range(min(m, n)):
        p = _pivot_row(a[..., :, k], k)
        pivots.append(p + 1)
        a = _swap_rows(a, k, p)
        piv = a[..., k, k]
        singular = piv == 0
        info = jnp.where(jnp.logical_and(singular, info == 0), jnp.int32(k + 1), info)
        safe = jnp.where(singular, jnp.ones((), a.dtype), piv)[..., None]
        below = a[..., :, k]
        # XLA rewrites a division by a broadcast value into a multiply by its reciprocal, and x * (1/x) can
        # miss 1 by an ulp: a repeated row would no longer cancel to the exact zero pivot eager finds.
        one = jnp.ones((), a.dtype)
        scaled = jnp.where(below == safe, one, jnp.where(below == -safe, -one, below / safe))
        below_mask = rows > k
        col = jnp.where(jnp.logical_and(below_mask, jnp.logical_not(singular)[..., None]), scaled, below)
        col = jnp.where(below_mask, col, zero)  # the multipliers l[k+1:], zeros elsewhere
        if k + 1 < n:
            trailing = jnp.logical_and(below_mask[:, None], (cols > k)[None, :])
            update = col[..., :, None] * a[..., k, None, :]
            a = jnp.where(trailing, a - update, a)
        a = jnp.where(jnp.logical_and(below_mask[:, None], (cols == k)[None, :]), col[..., :, None], a)
    pivots_arr = jnp.stack(pivots, axis=-1) if pivots else jnp.zeros(a.shape[:-2] + (0,), jnp.int32)
    return a, pivots_arr, info


def _unpack(lu: Any) -> tuple[Any, Any]:
    """(L [..., m, k] unit lower, U [..., k, n] upper) of a packed LU [..., m, n], k = min(m, n)."""
    m, n = lu.shape[-2], lu.shape[-1]
    k = min(m, n)
    zero, one = jnp.zeros((), lu.dtype), jnp.ones((), lu.dtype)
    r, c = iota(m)[:, None], iota(k)[None, :]
    lower = jnp.where(r > c, lu[..., :, :k], jnp.where(r == c, one, zero))
    r, c = iota(k)[:, None], iota(n)[None, :]
    upper = jnp.where(r <= c, lu[..., :k, :], zero)
    return lower, upper


def _permutation(pivots: Any, m: int, dtype: Any) -> Any:
    """P [..., m, m] with A = P L U for getrf's ``pivots``: the row swaps applied to the identity give P^T."""
    eye = jnp.broadcast_to(jnp.eye(m, dtype=dtype), pivots.shape[:-1] + (m, m))
    return mT(_apply_pivots(eye, pivots))


def lu_solve_f32(lu: Any, pivots: Any, b: Any, left: bool = True, adjoint: bool = False) -> Any:
    """X with A X = b (``adjoint``: A^T X = b; not ``left``: X A = b / X A^T = b) for A = P L U given as
    getrf's packed ``lu`` [..., n, n] and ``pivots``; b [..., n, r] (left) or [..., r, n]."""
    if not left:  # X op(A) = B  <=>  op(A)^T X^T = B^T
        return mT(lu_solve_f32(lu, pivots, mT(b), True, not adjoint))
    lu, pivots, b = _batch_broadcast(lu, pivots, b, core=(2, 1, 2))
    if lu.shape[-1] == 0:
        return b
    if not adjoint:  # L U X = P^T b
        y = _trsm_left(lu, _apply_pivots(b, pivots), lower=True, unit=True)
        return _trsm_left(lu, y, lower=False, unit=False)
    # U^T L^T P^T X = b
    y = _trsm_left(mT(lu), b, lower=True, unit=False)
    y = _trsm_left(mT(lu), y, lower=False, unit=True)
    return _apply_pivots(y, pivots, reverse=True)


def _square(a: Any) -> int:
    if a.shape[-1] != a.shape[-2]:
        raise Unsupported(f"{op_name()} of a non-square matrix {tuple(a.shape)}")
    _check_order(a.shape[-1])
    return a.shape[-1]


@register_lowering(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(a: Any, *, pivot: bool = True, check_errors: bool = False) -> Any:
    if not pivot:
        raise Unsupported("linalg_lu_factor_ex with pivot=False: eager CPU has no LU without pivoting either")
    if check_errors:
        raise Unsupported(
            "linalg_lu_factor_ex with check_errors=True raises on the values, which a Trainium graph cannot "
            "do: call torch.linalg.lu_factor_ex(A) and test its info output instead"
        )
    _check_order(*a.shape[-2:])
    lu, pivots, info = lu_f32(float32_operand(a))
    return convert(lu, out_dtype(0)), pivots, info


@register_lowering(aten.linalg_lu.default)
def linalg_lu(a: Any, *, pivot: bool = True) -> Any:
    """(P, L, U) with A = P L U."""
    if not pivot:
        raise Unsupported("linalg_lu with pivot=False: eager CPU has no LU without pivoting either")
    _check_order(*a.shape[-2:])
    lu, pivots, _ = lu_f32(float32_operand(a))
    lower, upper = _unpack(lu)
    dt = out_dtype(0)
    return convert(_permutation(pivots, a.shape[-2], jnp.float32), dt), convert(lower, dt), convert(upper, dt)


@register_lowering(aten.lu_unpack.default)
def lu_unpack(lu: Any, pivots: Any, unpack_data: bool = True, unpack_pivots: bool = True) -> Any:
    """(P, L, U) of getrf's packed LU and pivots; an output not asked for is the empty tensor eager gives."""
    _check_order(*lu.shape[-2:])
    dt = out_dtype(1)
    if unpack_data:
        lower, upper = (convert(x, dt) for x in _unpack(float32_operand(lu)))
    else:
        lower, upper = jnp.zeros(out_shape(1), dt), jnp.zeros(out_shape(2), dt)
    if unpack_pivots:
        perm = convert(_permutation(convert(pivots, jnp.int32), lu.shape[-2], jnp.float32), dt)
        perm = jnp.broadcast_to(perm, out_shape(0))
    else:
        perm = jnp.zeros(out_shape(0), dt)
    return perm, lower, upper


@register_lowering(aten.linalg_lu_solve.default)
def linalg_lu_solve(lu: Any, pivots: Any, b: Any, *, left: bool = True, adjoint: bool = False) -> Any:
    _square(lu)
    x = lu_solve_f32(float32_operand(lu), convert(pivots, jnp.int32), float32_operand(b), left, adjoint)
    return convert(jnp.broadcast_to(x, out_shape()), out_dtype())


def _pivot_sign(pivots: Any) -> Any:
    """float32 [...]: the determinant of P, -1 per pivot that moved a row."""
    moved = pivots != iota(pivots.shape[-1]) + 1
    return jnp.prod(jnp.where(moved, jnp.float32(-1), jnp.float32(1)), axis=-1)


@register_lowering(aten._linalg_det.default)
def linalg_det(a: Any) -> Any:
    """(det, LU, pivots): the product of U's diagonal times the sign of the permutation."""
    _square(a)
    lu, pivots, _ = lu_f32(mT(float32_operand(a)))  # eager factors A^T (LAPACK is column-major) and returns it
    det = _pivot_sign(pivots) * jnp.prod(diagonal(lu), axis=-1)
    return convert(det, out_dtype(0)), convert(lu, out_dtype(1)), pivots


@register_lowering(aten._linalg_slogdet.default)
def linalg_slogdet(a: Any) -> Any:
    """(sign, log|det|, LU, pivots); a singular matrix gives sign 0 and -inf, as eager."""
    _square(a)
    lu, pivots, _ = lu_f32(mT(float32_operand(a)))  # eager factors A^T (LAPACK is column-major) and returns it
    diag = diagonal(lu)
    sign = _pivot_sign(pivots) * jnp.prod(jnp.sign(diag), axis=-1)
    logabsdet = jnp.sum(jnp.log(jnp.abs(diag)), axis=-1)
    return convert(sign, out_dtype(0)), convert(logabsdet, out_dtype(1)), convert(lu, out_dtype(2)), pivots


@register_lowering(aten.linalg_inv_ex.default)
def linalg_inv_ex(a: Any, *, check_errors: bool = False) -> Any:
    """(A^-1, info): lu_solve of the identity; a singular A gives info > 0 and eager's inf/NaN pattern."""
    if check_errors:
        raise Unsupported(
            "linalg_inv_ex with check_errors=True raises on the values, which a Trainium graph cannot do: "
            "call torch.linalg.inv_ex(A) and test its info output instead"
        )
    n = _square(a)
    lu, pivots, info = lu_f32(float32_operand(a))
    eye = jnp.broadcast_to(jnp.eye(n, dtype=jnp.float32), lu.shape)
    return convert(lu_solve_f32(lu, pivots, eye), out_dtype(0)), info


@register_lowering(aten._linalg_solve_ex.default)
def linalg_solve_ex(a: Any, b: Any, *, left: bool = True, check_errors: bool = False) -> Any:
    """(X, LU, pivots, info) for A X = B (``left=False``: X A = B). B is a vector, or a batch of vectors,
    when it has one dim less than A and A's shape without the last dim (torch's rule)."""
    if check_errors:
        raise Unsupported(
            "_linalg_solve_ex with check_errors=True raises on the values, which a Trainium graph cannot do: "
            "call torch.linalg.solve_ex(A, B) and test its info output instead"
        )
    _square(a)
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and tuple(b.shape) == tuple(a.shape[:-1]))
    a32, b32 = float32_operand(a), float32_operand(b)
    if vector:
        b32 = b32[..., :, None] if left else b32[..., None, :]
    lu, pivots, info = lu_f32(jnp.broadcast_to(a32, out_shape(1)))
    x = lu_solve_f32(lu, pivots, b32, left=left)
    if vector:
        x = x[..., :, 0] if left else x[..., 0, :]
    x = jnp.broadcast_to(x, out_shape(0))
    return convert(x, out_dtype(0)), convert(lu, out_dtype(1)), pivots, info


# ---- QR (Householder) -----------------------------------------------------------------------------------
def _column_norm(col: Any) -> Any:
    """Euclidean norm over the last dim, scaled by the largest magnitude first (as LAPACK's dnrm2 avoids
    overflow: squares of float32 values past 1.8e19 would be inf)."""
    scale = jnp.max(jnp.abs(col), axis=-1, keepdims=True)
    safe = jnp.where(scale == 0, jnp.ones((), col.dtype), scale)
    scaled = col / safe
    return (safe * jnp.sqrt(jnp.sum(scaled * scaled, axis=-1, keepdims=True)))[..., 0]


def _reflect(c: Any, v: Any, tau: Any) -> Any:
    """``H C = C - tau v (v^T C)`` for one Householder reflector ``v`` [..., m] of ``C`` [..., m, n]."""
    w = jnp.sum(v[..., :, None] * c, axis=-2)
    return c - tau[..., None, None] * v[..., :, None] * w[..., None, :]


def geqrf_f32(a: Any) -> tuple[Any, Any, Any]:
    """(R [..., m, n] with zeros below the diagonal, Householder vectors V [..., m, k] (unit at row j of
    column j, zeros above), tau [..., k]) of float32 [..., m, n], k = min(m, n): LAPACK's dgeqr2 with its
    dlarfg reflectors, so R's signs are eager's. Step j reflects rows j.. of every column:
    beta = -sign(alpha) * ||(alpha, x)||, tau = (beta - alpha) / beta, v = (1, x / (alpha - beta)); a column
    already zero below the diagonal gets tau = 0 (no reflection), as in dlarfg."""
    m, n = a.shape[-2], a.shape[-1]
    rows = iota(m)
    zero = jnp.zeros((), a.dtype)
    vectors, taus = [], []
    for j in range(min(m, n)):
        column = a[..., :, j]
        alpha = column[..., j]
        below = jnp.where(rows > j, column, zero)
        x_norm = _column_norm(below)
        reflect = x_norm != 0
        one = jnp.ones((), a.dtype)
        beta = -jnp.where(alpha < 0, -one, one) * _column_norm(jnp.stack([alpha, x_norm], -1))
        beta = jnp.where(reflect, beta, alpha)
        safe_beta = jnp.where(reflect, beta, jnp.ones((), a.dtype))
        tau = jnp.where(reflect, (beta - alpha) / safe_beta, zero)
        denominator = jnp.where(reflect, alpha - beta, jnp.ones((), a.dtype))
        v = jnp.where(rows == j, jnp.ones((), a.dtype), below / denominator[..., None])
        a = _reflect(a, v, tau)
        # column j is now (R[:j, j], beta, 0, ...): set exactly, as LAPACK stores beta and the vector there
        a = jnp.where((iota(n) == j)[None, :] & (rows >= j)[:, None],
                      jnp.where(rows == j, beta[..., None], zero)[..., :, None], a)  # fmt: skip
        vectors.append(v)
        taus.append(tau)
    v_all = jnp.stack(vectors, axis=-1) if vectors else jnp.zeros(a.shape[:-1] + (0,), a.dtype)
    tau_all = jnp.stack(taus, axis=-1) if taus else jnp.zeros(a.shape[:-2] + (0,), a.dtype)
    return a, v_all, tau_all


def householder_product_f32(v: Any, tau: Any, columns: int) -> Any:
    """``H_0 H_1 ... H_{k-1}`` applied to the first ``columns`` columns of the identity (LAPACK's dorg2r),
    ``H_j = I - tau_j v_j v_j^T``; ``v`` [..., m, k] holds the vectors as columns."""
    m = v.shape[-2]
    q = jnp.broadcast_to(jnp.eye(m, columns, dtype=v.dtype), v.shape[:-2] + (m, columns))
    for j in range(tau.shape[-1] - 1, -1, -1):
        q = _reflect(q, v[..., :, j], tau[..., j])
    return q


def _packed_vectors(a: Any, k: int) -> Any:
    """The Householder vectors of a geqrf-packed [..., m, n]: column j below the diagonal, 1 on it."""
    m = a.shape[-2]
    rows = iota(m)[:, None]
    cols = iota(k)[None, :]
    return jnp.where(rows > cols, a[..., :, :k], jnp.where(rows == cols, jnp.ones((), a.dtype), jnp.zeros((), a.dtype)))


@register_lowering(aten.linalg_qr.default)
def linalg_qr(a: Any, mode: str = "reduced") -> Any:
    """Q, R by Householder reflections (eager's LAPACK geqrf + orgqr, so the same signs): ``mode`` "reduced"
    (Q [m, k]), "complete" (Q [m, m]) or "r" (an empty Q). Unrolled over the k = min(m, n) columns, so k is
    bounded as every factorization here; m (a tall matrix's rows) is not."""
    m, n = a.shape[-2], a.shape[-1]
    k = min(m, n)
    _check_order(k)
    r, v, tau = geqrf_f32(float32_operand(a))
    q_columns = m if mode == "complete" else k
    r = r if mode == "complete" else r[..., :k, :]
    triangle = iota(r.shape[-2])[:, None] <= iota(n)[None, :]
    r = jnp.where(triangle, r, jnp.zeros((), r.dtype))
    if mode == "r":
        return jnp.zeros((0,), out_dtype(0)), convert(r, out_dtype(1))
    return convert(householder_product_f32(v, tau, q_columns), out_dtype(0)), convert(r, out_dtype(1))


@register_lowering(aten.geqrf.default)
def geqrf(a: Any) -> Any:
    """LAPACK's packed form: R on and above the diagonal, the Householder vectors below it; and tau."""
    k = min(a.shape[-2], a.shape[-1])
    _check_order(k)
    r, v, tau = geqrf_f32(float32_operand(a))
    m, n = a.shape[-2], a.shape[-1]
    below = iota(m)[:, None] > iota(n)[None, :]
    v_full = jnp.concatenate([v, jnp.zeros(v.shape[:-1] + (n - k,), v.dtype)], axis=-1) if n > k else v
    packed = jnp.where(below, v_full, r)
    return convert(packed, out_dtype(0)), convert(tau, out_dtype(1))


@register_lowering(aten.linalg_householder_product.default)
def linalg_householder_product(a: Any, tau: Any) -> Any:
    """``H_0 ... H_{k-1}`` times the first n columns of the identity, the vectors read from ``a`` [..., m, n]
    below its diagonal (``torch.geqrf``'s packing; the orthogonal parametrization's "householder" map)."""
    k = tau.shape[-1]
    _check_order(k)
    a32, tau32 = _batch_broadcast(float32_operand(a), float32_operand(tau), core=(2, 1))
    return convert(householder_product_f32(_packed_vectors(a32, k), tau32, a.shape[-1]), out_dtype())


@register_lowering(aten.ormqr.default)
def ormqr(a: Any, tau: Any, other: Any, left: bool = True, transpose: bool = False) -> Any:
    """``Q C``, ``Q^T C``, ``C Q`` or ``C Q^T`` for the Q of ``torch.geqrf``'s packing (LAPACK's dorm2r),
    one reflector at a time: ``H C = C - tau v (v^T C)``, ``C H = C - tau (C v) v^T``."""
    k = tau.shape[-1]
    _check_order(k)
    a32, tau32, c = _batch_broadcast(float32_operand(a), float32_operand(tau), float32_operand(other), core=(2, 1, 2))
    v = _packed_vectors(a32, k)
    order = range(k) if left == transpose else range(k - 1, -1, -1)  # Q = H_0 H_1 ... H_{k-1}
    if not left:
        c = mT(c)  # C H = (H C^T)^T: H is symmetric
    for j in order:
        c = _reflect(c, v[..., :, j], tau32[..., j])
    return convert(c if left else mT(c), out_dtype())
