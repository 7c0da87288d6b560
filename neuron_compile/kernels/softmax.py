"""Row softmax over the last dim of ``x[R, C]`` and its backward (fp32 or bf16; any R; C in the free dim).

Rows go on partitions (128-row tiles, the last one ragged), the whole row in the free dim: the negated
row max (``tensor_reduce``, Vector), ``exp(x - max)`` with the row sum fused (``activation`` with
``reduce_res``, Scalar), the reciprocal of the sum (Vector) and one ``tensor_scalar`` multiply.
"""

from __future__ import annotations

from typing import Any

from ._common import P, dtype_of, sbuf, tiles
from .nki_api import isa as nisa
from .nki_api import jit
from .nki_api import language as nl

MAX_COLS = 8192  # fp32 row tiles: x, exp and the output stay well inside SBUF


@jit
def softmax_kernel(x: Any) -> Any:
    """NKI kernel: ``softmax(x, axis=-1)`` of a 2-D ``x``; output in ``x.dtype``."""
    rows, cols = x.shape
    out = nl.ndarray((rows, cols), x.dtype, buffer=nl.shared_hbm, name="out")
    for r0, rs in tiles(rows):
        xt = sbuf((P, cols), x.dtype, "x")
        nisa.dma_copy(dst=xt[:rs], src=x[r0 : r0 + rs])
        neg_max = sbuf((P, 1), "float32", "neg_max")
        nisa.tensor_reduce(dst=neg_max[:rs], op=nl.maximum, data=xt[:rs], axis=1, negate=True, keepdims=True)
        ex = sbuf((P, cols), "float32", "exp")
        total = sbuf((P, 1), "float32", "sum")
        nisa.activation(
            dst=ex[:rs], op=nl.exp, data=xt[:rs], bias=neg_max[:rs], reduce_op=nl.add, reduce_res=total[:rs]
        )
        nisa.reciprocal(dst=total[:rs], data=total[:rs])
        yt = sbuf((P, cols), x.dtype, "y")
        nisa.tensor_scalar(dst=yt[:rs], data=ex[:rs], op0=nl.multiply, operand0=total[:rs])
        nisa.dma_copy(dst=out[r0 : r0 + rs], src=yt[:rs])
    return out


@jit
def softmax_bwd_kernel(y: Any, dy: Any) -> Any:
    """NKI kernel: ``dx = y * (dy - sum(dy * y, -1))`` given the softmax output ``y``."""
    rows, cols = y.shape
    dx = nl.ndarray((rows, cols), dy.dtype, buffer=nl.shared_hbm, name="dx")
    for r0, rs in tiles(rows):
        yt = sbuf((P, cols), y.dtype, "y")
        gt = sbuf((P, cols), dy.dtype, "dy")
        nisa.dma_copy(dst=yt[:rs], src=y[r0 : r0 + rs])
        nisa.dma_copy(dst=gt[:rs], src=dy[r0 : r0 + rs])
        prod = sbuf((P, cols), "float32", "y_dy")
        nisa.tensor_tensor(dst=prod[:rs], data1=yt[:rs], data2=gt[:rs], op=nl.multiply)
        dot = sbuf((P, 1), "float32", "dot")
        nisa.tensor_reduce(dst=dot[:rs], op=nl.add, data=prod[:rs], axis=1, keepdims=True)
        diff = sbuf((P, cols), "float32", "dy_minus_dot")
        nisa.tensor_scalar(dst=diff[:rs], data=gt[:rs], op0=nl.subtract, operand0=dot[:rs])
        res = sbuf((P, cols), dy.dtype, "dx")
        nisa.tensor_tensor(dst=res[:rs], data1=diff[:rs], data2=yt[:rs], op=nl.multiply)
        nisa.dma_copy(dst=dx[r0 : r0 + rs], src=res[:rs])
    return dx


def softmax_reference(x: Any) -> Any:
    """StableHLO reference: softmax in fp32, result in ``x.dtype``."""
    import jax.numpy as jnp

    xf = x.astype(jnp.float32)
    e = jnp.exp(xf - jnp.max(xf, axis=-1, keepdims=True))
    return (e / jnp.sum(e, axis=-1, keepdims=True)).astype(x.dtype)


def softmax_bwd_reference(y: Any, dy: Any) -> Any:
    import jax.numpy as jnp

    yf, gf = y.astype(jnp.float32), dy.astype(jnp.float32)
    return (yf * (gf - jnp.sum(yf * gf, axis=-1, keepdims=True))).astype(dy.dtype)


def softmax_supports(x: Any) -> bool:
    """2-D float input with at most MAX_COLS columns."""
    return len(x.shape) == 2 and dtype_of(x) in ("float32", "bfloat16", "float16") and 0 < x.shape[1] <= MAX_COLS


def softmax_bwd_supports(y: Any, dy: Any) -> bool:
    return softmax_supports(y) and tuple(y.shape) == tuple(dy.shape) and dtype_of(y) == dtype_of(dy)
