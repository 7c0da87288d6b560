"""RMSNorm and LayerNorm over the last dim of ``x[R, H]``, forward and backward (fp32/bf16; any R).

Rows go on partitions (128-row tiles, the last ragged), H in the free dim. The weight (and bias) are
DMA'd once, broadcast to 128 partitions. Work tiles are allocated inside the row loop, so each row tile has
its own and the scheduler may overlap one tile's DMA with the previous tile's compute; they are released at
the end of the iteration (``del``), as NKI scopes tiles to their loop body.
Statistics are fp32: RMSNorm sums squares with the fused ``activation`` reduction; LayerNorm uses
``bn_stats`` per 512-element chunk and ``bn_aggr``. The backward kernels sum ``dw``/``db`` over rows
in an fp32 SBUF accumulator and reduce its partitions at the end with a TensorE matmul against ones.
"""

from __future__ import annotations

from typing import Any

from ._common import P, broadcast_row, dtype_of, psum, sbuf, tiles
from .nki_api import isa as nisa
from .nki_api import jit
from .nki_api import language as nl

MAX_H = 8192
F32 = "float32"
GPSIMD = nisa.engine.gpsimd


def _rstd(rstd: Any, var_or_ss: Any, rs: int, scale: float, eps: float) -> None:
    """rstd = 1/sqrt(var_or_ss * scale + eps) on (P,1) fp32 tiles."""
    nisa.tensor_scalar(dst=rstd[:rs], data=var_or_ss[:rs], op0=nl.multiply, operand0=scale, op1=nl.add, operand1=eps)
    nisa.activation(dst=rstd[:rs], op=nl.rsqrt, data=rstd[:rs])


def _rows_sum_to_hbm(dst_hbm: Any, acc: Any, h: int) -> None:
    """dst_hbm[H] = sum over the 128 partitions of acc[P, H] (fp32), via matmul with a ones column."""
    ones = sbuf((P, 1), F32, "ones")
    nisa.memset(dst=ones, value=1.0)
    row = sbuf((1, h), dst_hbm.dtype, "row_sum")
    for c0, cs in tiles(h, 512):
        ps = psum((1, 512), F32, "row_sum_psum")
        nisa.nc_matmul(dst=ps[:, :cs], stationary=ones, moving=acc[:, c0 : c0 + cs])
        nisa.tensor_copy(dst=row[:, c0 : c0 + cs], src=ps[:, :cs])
    nisa.dma_copy(dst=dst_hbm.reshape((1, h)), src=row)


@jit
def rms_norm_kernel(x: Any, w: Any, eps: float = 1e-6) -> Any:
    """NKI kernel: ``x * rsqrt(mean(x^2, -1) + eps) * w``; output in ``x.dtype``."""
    rows, h = x.shape
    out = nl.ndarray((rows, h), x.dtype, buffer=nl.shared_hbm, name="out")
    wt = sbuf((P, h), w.dtype, "w")
    nisa.dma_copy(dst=wt, src=broadcast_row(w, P))
    for r0, rs in tiles(rows):
        xt, yt = sbuf((P, h), x.dtype, "x"), sbuf((P, h), x.dtype, "y")
        ss, rstd = sbuf((P, 1), F32, "sumsq"), sbuf((P, 1), F32, "rstd")
        nisa.dma_copy(dst=xt[:rs], src=x[r0 : r0 + rs])
        # the squares only feed the fused fp32 row sum: yt takes them and is overwritten by the result below
        nisa.activation(dst=yt[:rs], op=nl.square, data=xt[:rs], reduce_op=nl.add, reduce_res=ss[:rs])
        _rstd(rstd, ss, rs, 1.0 / h, eps)
        nisa.scalar_tensor_tensor(
            dst=yt[:rs], data=xt[:rs], op0=nl.multiply, operand0=rstd[:rs], op1=nl.multiply, operand1=wt[:rs]
        )
        nisa.dma_copy(dst=out[r0 : r0 + rs], src=yt[:rs])
        del xt, yt, ss, rstd
    return out


@jit
def rms_norm_bwd_kernel(dy: Any, x: Any, w: Any, eps: float = 1e-6) -> Any:
    """NKI kernel: ``(dx, dw)`` of :func:`rms_norm_kernel`; dx in ``x.dtype``, dw in ``w.dtype``.

    With ``u = dy*x`` and ``c = sum(w*u)`` per row: ``dx = rstd*w*dy - x*rstd^3*c/H`` (two Vector passes) and
    ``dw = sum over rows of rstd*u``, a matmul with ``rstd`` as the stationary column, accumulated in PSUM over
    every row tile (so neither needs a Vector pass); the products run on GpSimd, the squares on Scalar."""
    rows, h = x.shape
    dx = nl.ndarray((rows, h), x.dtype, buffer=nl.shared_hbm, name="dx")
    dw = nl.ndarray((h,), w.dtype, buffer=nl.shared_hbm, name="dw")
    wt = sbuf((P, h), w.dtype, "w")
    nisa.dma_copy(dst=wt, src=broadcast_row(w, P))
    cols = _ColumnSums(h, 1)
    for r0, rs in tiles(rows):
        xt, gt, out = sbuf((P, h), x.dtype, "x"), sbuf((P, h), dy.dtype, "dy"), sbuf((P, h), x.dtype, "dx")
        sq, u, g = sbuf((P, h), F32, "x_squared"), sbuf((P, h), F32, "dy_x"), sbuf((P, h), F32, "rstd_w_dy")
        ss, rstd, c, k = (sbuf((P, 1), F32, n) for n in ("sumsq", "rstd", "c", "k"))
        nisa.dma_copy(dst=xt[:rs], src=x[r0 : r0 + rs])
        nisa.dma_copy(dst=gt[:rs], src=dy[r0 : r0 + rs])
        nisa.activation(dst=sq[:rs], op=nl.square, data=xt[:rs], reduce_op=nl.add, reduce_res=ss[:rs])
        _rstd(rstd, ss, rs, 1.0 / h, eps)
        nisa.tensor_tensor(dst=u[:rs], data1=gt[:rs], data2=xt[:rs], op=nl.multiply, engine=GPSIMD)
        cols.add(rs, (rstd, u), first=r0 == 0)
        # w*u on GpSimd or Vector, every other row tile: the two engines' loads even out
        engine = GPSIMD if (r0 // P) % 2 == 0 else nisa.engine.vector
        nisa.tensor_tensor(dst=sq[:rs], data1=u[:rs], data2=wt[:rs], op=nl.multiply, engine=engine)
        nisa.tensor_reduce(dst=c[:rs], op=nl.add, data=sq[:rs], axis=1, keepdims=True)
        # k = -rstd^3 * c / H
        nisa.tensor_scalar(
            dst=k[:rs], data=c[:rs], op0=nl.multiply, operand0=rstd[:rs], op1=nl.multiply, operand1=rstd[:rs],
            engine=GPSIMD,
        )  # fmt: skip
        nisa.tensor_scalar(
            dst=k[:rs], data=k[:rs], op0=nl.multiply, operand0=rstd[:rs], op1=nl.multiply, operand1=-1.0 / h,
            engine=GPSIMD,
        )  # fmt: skip
        nisa.scalar_tensor_tensor(
            dst=g[:rs], data=gt[:rs], op0=nl.multiply, operand0=rstd[:rs], op1=nl.multiply, operand1=wt[:rs]
        )
        nisa.scalar_tensor_tensor(
            dst=out[:rs], data=xt[:rs], op0=nl.multiply, operand0=k[:rs], op1=nl.add, operand1=g[:rs]
        )
        nisa.dma_copy(dst=dx[r0 : r0 + rs], src=out[:rs])
        del xt, gt, out, sq, u, g, ss, rstd, c, k
    cols.store(((dw, 0),))
    return dx, dw


class _ColumnSums:
    """Column sums over all rows, ``out[j, col] = sum_r s_j[r] * m[r, col]`` for weight columns ``s_j``.

    Up to 8 x 512 columns (one PSUM bank each) the PE accumulates them: a ``[rows_out, 512]`` fp32 PSUM tile per
    512 columns, every row tile's matmuls adding into it (``s``: a ``[P, rows_out]`` stationary whose dtype
    pairs with ``m``'s). Wider rows accumulate ``s_j * m`` in an fp32 SBUF tile per output on Vector and sum its
    partitions at the end (a matmul with ones)."""

    def __init__(self, h: int, rows_out: int):
        self.h, self.rows_out = h, rows_out
        self.chunks = list(tiles(h, 512))
        self.in_psum = len(self.chunks) <= nl.tile_size.psum_num_banks
        if self.in_psum:
            self.acc = [psum((rows_out, 512), F32, "column_sums") for _ in self.chunks]
        else:
            self.acc = [sbuf((P, h), F32, "column_sums") for _ in range(rows_out)]
            for a in self.acc:
                nisa.memset(dst=a, value=0.0, engine=GPSIMD)

    def add(self, rs: int, *terms: tuple[Any, Any], first: bool) -> None:
        if not self.in_psum:
            for stat, mov in terms:
                for j, a in enumerate(self.acc):
                    nisa.scalar_tensor_tensor(
                        dst=a[:rs], data=mov[:rs], op0=nl.multiply, operand0=stat[:rs, j : j + 1], op1=nl.add,
                        operand1=a[:rs],
                    )  # fmt: skip
            return
        for acc, (c0, cs) in zip(self.acc, self.chunks):
            for n, (stat, mov) in enumerate(terms):
                nisa.nc_matmul(
                    dst=acc[:, :cs],
                    stationary=stat[:rs],
                    moving=mov[:rs, c0 : c0 + cs],
                    accumulate=not (first and n == 0),
                )

    def store(self, outputs: tuple[tuple[Any, int], ...]) -> None:
        """Write row ``j`` of the sums to each ``(hbm vector, j)`` (all in one dtype)."""
        if not self.in_psum:
            for dst_hbm, j in outputs:
                _rows_sum_to_hbm(dst_hbm, self.acc[j], self.h)
            return
        sums = sbuf((self.rows_out, self.h), outputs[0][0].dtype, "column_sums")
        for acc, (c0, cs) in zip(self.acc, self.chunks):  # compute engines read from partition 0: all rows
            nisa.tensor_copy(dst=sums[:, c0 : c0 + cs], src=acc[:, :cs])
        for dst_hbm, j in outputs:  # DMA reaches any partition
            nisa.dma_copy(dst=dst_hbm.reshape((1, self.h)), src=sums[j : j + 1])


@jit
def layer_norm_kernel(x: Any, w: Any, b: Any, eps: float = 1e-5) -> Any:
    """NKI kernel: ``(x - mean) * rsqrt(var + eps) * w + b`` over the last dim; output in ``x.dtype``."""
    rows, h = x.shape
    out = nl.ndarray((rows, h), x.dtype, buffer=nl.shared_hbm, name="out")
    wt, bt = sbuf((P, h), w.dtype, "w"), sbuf((P, h), b.dtype, "b")
    nisa.dma_copy(dst=wt, src=broadcast_row(w, P))
    nisa.dma_copy(dst=bt, src=broadcast_row(b, P))
    nch = -(-h // 512)
    for r0, rs in tiles(rows):
        xt, yt, tmp = sbuf((P, h), x.dtype, "x"), sbuf((P, h), x.dtype, "y"), sbuf((P, h), F32, "xhat_w")
        stats, mv = sbuf((P, nch * 6), F32, "bn_stats"), sbuf((P, 2), F32, "mean_var")
        rstd = sbuf((P, 1), F32, "rstd")
        nisa.dma_copy(dst=xt[:rs], src=x[r0 : r0 + rs])
        for i, (c0, cs) in enumerate(tiles(h, 512)):
            nisa.bn_stats(dst=stats[:rs, i * 6 : (i + 1) * 6], data=xt[:rs, c0 : c0 + cs])
        nisa.bn_aggr(dst=mv[:rs], data=stats[:rs])
        _rstd(rstd, mv[:, 1:2], rs, 1.0, eps)
        nisa.tensor_scalar(
            dst=tmp[:rs], data=xt[:rs], op0=nl.subtract, operand0=mv[:rs, 0:1], op1=nl.multiply, operand1=rstd[:rs]
        )
        nisa.tensor_tensor(dst=tmp[:rs], data1=tmp[:rs], data2=wt[:rs], op=nl.multiply)
        nisa.tensor_tensor(dst=yt[:rs], data1=tmp[:rs], data2=bt[:rs], op=nl.add)
        nisa.dma_copy(dst=out[r0 : r0 + rs], src=yt[:rs])
        del xt, yt, tmp, stats, mv, rstd
    return out


@jit
def layer_norm_bwd_kernel(dy: Any, x: Any, w: Any, eps: float = 1e-5) -> Any:
    """NKI kernel: ``(dx, dw, db)`` of :func:`layer_norm_kernel`.

    Per row: ``xhat`` and the final scaling on Scalar (``activation`` with per-row scale and bias), the
    products ``g*xhat`` and ``dy*xhat`` on GpSimd, ``g = dy*w``, the row sum of ``g*xhat`` and
    ``xhat*k + g`` on Vector. ``db`` and ``dw`` are column sums the PE accumulates in PSUM over every row tile
    (``[1, 0]`` and ``[0, 1]`` stationary columns against ``dy`` and ``dy*xhat``)."""
    rows, h = x.shape
    dx = nl.ndarray((rows, h), x.dtype, buffer=nl.shared_hbm, name="dx")
    dw = nl.ndarray((h,), w.dtype, buffer=nl.shared_hbm, name="dw")
    db = nl.ndarray((h,), w.dtype, buffer=nl.shared_hbm, name="db")
    wt = sbuf((P, h), w.dtype, "w")
    nisa.dma_copy(dst=wt, src=broadcast_row(w, P))
    # selector columns: db = [1, 0]^T dy (in dy's dtype, which the matmul pairs with), dw = [0, 1]^T (dy*xhat)
    sel_db, sel_dw = sbuf((P, 2), dy.dtype, "select_db"), sbuf((P, 2), F32, "select_dw")
    nisa.memset(dst=sel_db[:, 0:1], value=1.0, engine=GPSIMD)
    nisa.memset(dst=sel_db[:, 1:2], value=0.0, engine=GPSIMD)
    nisa.memset(dst=sel_dw[:, 0:1], value=0.0, engine=GPSIMD)
    nisa.memset(dst=sel_dw[:, 1:2], value=1.0, engine=GPSIMD)
    cols = _ColumnSums(h, 2)
    nch = -(-h // 512)
    for r0, rs in tiles(rows):
        xt, gt, out = sbuf((P, h), x.dtype, "x"), sbuf((P, h), dy.dtype, "dy"), sbuf((P, h), x.dtype, "dx")
        xhat, g, prod = sbuf((P, h), F32, "xhat"), sbuf((P, h), F32, "g"), sbuf((P, h), F32, "g_xhat")
        dyx = sbuf((P, h), F32, "dy_xhat")
        stats, mv = sbuf((P, nch * 6), F32, "bn_stats"), sbuf((P, 2), F32, "mean_var")
        rstd, nb, sg, sgx, k, nb2 = (sbuf((P, 1), F32, n) for n in ("rstd", "nbias", "sum_g", "sum_gx", "k", "nb2"))
        nisa.dma_copy(dst=xt[:rs], src=x[r0 : r0 + rs])
        nisa.dma_copy(dst=gt[:rs], src=dy[r0 : r0 + rs])
        for i, (c0, cs) in enumerate(tiles(h, 512)):
            nisa.bn_stats(dst=stats[:rs, i * 6 : (i + 1) * 6], data=xt[:rs, c0 : c0 + cs])
        nisa.bn_aggr(dst=mv[:rs], data=stats[:rs])
        _rstd(rstd, mv[:, 1:2], rs, 1.0, eps)
        # xhat = x*rstd - mean*rstd on Scalar
        nisa.tensor_scalar(
            dst=nb[:rs], data=mv[:rs, 0:1], op0=nl.multiply, operand0=rstd[:rs], op1=nl.multiply, operand1=-1.0,
            engine=GPSIMD,
        )  # fmt: skip
        nisa.activation(dst=xhat[:rs], op=nl.copy, data=xt[:rs], scale=rstd[:rs], bias=nb[:rs])
        nisa.tensor_tensor(dst=g[:rs], data1=gt[:rs], data2=wt[:rs], op=nl.multiply)
        nisa.activation(dst=prod[:rs], op=nl.copy, data=g[:rs], reduce_op=nl.add, reduce_res=sg[:rs])
        nisa.tensor_tensor(dst=prod[:rs], data1=g[:rs], data2=xhat[:rs], op=nl.multiply, engine=GPSIMD)
        nisa.tensor_reduce(dst=sgx[:rs], op=nl.add, data=prod[:rs], axis=1, keepdims=True)
        nisa.tensor_tensor(dst=dyx[:rs], data1=gt[:rs], data2=xhat[:rs], op=nl.multiply, engine=GPSIMD)
        cols.add(rs, (sel_dw, dyx), (sel_db, gt), first=r0 == 0)
        # dx = rstd * (xhat * (-sum_gx/H) + g) - rstd * sum_g/H
        nisa.tensor_scalar(dst=k[:rs], data=sgx[:rs], op0=nl.multiply, operand0=-1.0 / h, engine=GPSIMD)
        nisa.tensor_scalar(
            dst=nb2[:rs], data=sg[:rs], op0=nl.multiply, operand0=rstd[:rs], op1=nl.multiply, operand1=-1.0 / h,
            engine=GPSIMD,
        )  # fmt: skip
        nisa.scalar_tensor_tensor(
            dst=g[:rs], data=xhat[:rs], op0=nl.multiply, operand0=k[:rs], op1=nl.add, operand1=g[:rs]
        )
        nisa.activation(dst=out[:rs], op=nl.copy, data=g[:rs], scale=rstd[:rs], bias=nb2[:rs])
        nisa.dma_copy(dst=dx[r0 : r0 + rs], src=out[:rs])
        del xt, gt, out, xhat, g, prod, dyx, stats, mv, rstd, nb, sg, sgx, k, nb2
    cols.store(((db, 0), (dw, 1)))
    return dx, dw, db


# ------------------------------------------------------------------------------------------- references
def rms_norm_reference(x: Any, w: Any, eps: float = 1e-6) -> Any:
    """StableHLO reference: statistics in fp32, result in ``x.dtype``."""
    import jax.numpy as jnp
    from jax import lax

    xf = x.astype(jnp.float32)
    rstd = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * rstd * w.astype(jnp.float32)).astype(x.dtype)


def rms_norm_bwd_reference(dy: Any, x: Any, w: Any, eps: float = 1e-6) -> Any:
    import jax.numpy as jnp
    from jax import lax

    xf, gf, wf = x.astype(jnp.float32), dy.astype(jnp.float32), w.astype(jnp.float32)
    rstd = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    xhat = xf * rstd
    g = gf * wf
    dx = rstd * (g - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    return dx.astype(x.dtype), jnp.sum(gf * xhat, axis=0).astype(w.dtype)


def layer_norm_reference(x: Any, w: Any, b: Any, eps: float = 1e-5) -> Any:
    import jax.numpy as jnp
    from jax import lax

    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * lax.rsqrt(var + eps) * w.astype(jnp.float32) + b.astype(jnp.float32)
    return y.astype(x.dtype)


def layer_norm_bwd_reference(dy: Any, x: Any, w: Any, eps: float = 1e-5) -> Any:
    import jax.numpy as jnp
    from jax import lax

    xf, gf, wf = x.astype(jnp.float32), dy.astype(jnp.float32), w.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    rstd = lax.rsqrt(jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True) + eps)
    xhat = (xf - mean) * rstd
    g = gf * wf
    dx = rstd * (g - jnp.mean(g, -1, keepdims=True) - xhat * jnp.mean(g * xhat, -1, keepdims=True))
    return dx.astype(x.dtype), jnp.sum(gf * xhat, axis=0).astype(w.dtype), jnp.sum(gf, axis=0).astype(w.dtype)


def _rows_ok(x: Any, *vecs: Any) -> bool:
    return (
        len(x.shape) == 2
        and 0 < x.shape[1] <= MAX_H
        and dtype_of(x) in ("float32", "bfloat16", "float16")
        and all(tuple(v.shape) == (x.shape[1],) for v in vecs)
    )


def _fits(kernel: Any, *args: Any) -> bool:
    """The kernel's tiles fit SBUF for these shapes (one 128-row tile run in the emulator's shape-only mode,
    which raises on capacity; the backward kernels' working set outgrows SBUF below MAX_H in fp32)."""
    from . import nki_api

    if not nki_api.EMULATED:
        return True
    specs = tuple(
        nki_api.TensorSpec((min(a.shape[0], P), *a.shape[1:]) if len(a.shape) == 2 else tuple(a.shape), dtype_of(a))
        if hasattr(a, "shape")
        else a
        for a in args
    )
    try:
        nki_api.infer_shapes(kernel)(*specs)
    except nki_api.NkiCapacityError:
        return False
    return True


def rms_norm_supports(x: Any, w: Any, eps: float = 1e-6) -> bool:
    """2-D float ``x`` with H <= MAX_H and a 1-D weight of length H."""
    return _rows_ok(x, w)


def rms_norm_bwd_supports(dy: Any, x: Any, w: Any, eps: float = 1e-6) -> bool:
    return _rows_ok(x, w) and tuple(dy.shape) == tuple(x.shape) and _fits(rms_norm_bwd_kernel, dy, x, w, eps)


def layer_norm_supports(x: Any, w: Any, b: Any, eps: float = 1e-5) -> bool:
    return _rows_ok(x, w, b)


def layer_norm_bwd_supports(dy: Any, x: Any, w: Any, eps: float = 1e-5) -> bool:
    return _rows_ok(x, w) and tuple(dy.shape) == tuple(x.shape) and _fits(layer_norm_bwd_kernel, dy, x, w, eps)
