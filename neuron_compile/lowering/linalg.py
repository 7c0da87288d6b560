"""Matrix products: mm, bmm, addmm, addmv (matmul/mv/dot/baddbmm reach us decomposed into these).

Numerics follow eager CPU: bfloat16/float16 products accumulate in float32 and are rounded once at the
end (bias included); float32 is computed at full float32 precision (never silently in bf16 passes);
integer products are exact in their own dtype (wrapping on overflow, as eager).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import torch
from jax import lax

from .registry import Unsupported, register_lowering
from .semantics import convert, is_float, is_integer, opmath_dtype, out_dtype

aten = torch.ops.aten


def _acc_dtype(dtype: Any) -> Any:
    """The dtype products accumulate in: float32 for 16-bit floats, the dtype itself otherwise."""
    if not (is_float(dtype) or is_integer(dtype)):
        raise Unsupported(f"matrix product of dtype {jnp.dtype(dtype)}")
    return opmath_dtype(dtype)


def dot(a: Any, b: Any, contract: tuple[int, int], batch: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())) -> Any:
    """``lax.dot_general`` contracting ``a``'s dim ``contract[0]`` with ``b``'s ``contract[1]``,
    accumulating in the accumulation dtype of ``a`` (the result stays in that dtype)."""
    acc = _acc_dtype(a.dtype)
    if is_integer(a.dtype):
        return _integer_dot(a, b, contract, batch)
    return lax.dot_general(
        a,
        b,
        (((contract[0],), (contract[1],)), batch),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=acc,
    )


def _integer_dot(a: Any, b: Any, contract: tuple[int, int], batch: tuple[tuple[int, ...], ...]) -> Any:
    """Exact integer product as broadcast multiply + sum: neuronx-cc has no integer matmul datapath,
    and a float matmul would round int64 values. Only the (rank <= 3) layouts of mm/bmm/addmv occur."""
    if batch != ((), ()) and batch != ((0,), (0,)):
        raise Unsupported("integer dot_general with this batch layout")
    nb = len(batch[0])
    if a.ndim - nb != 2 or contract != (nb + 1, nb):
        raise Unsupported("integer dot_general with this contraction layout")
    # a: [batch..., m, k] -> [batch..., m, k, 1]; b: [batch..., k, n] (or [k]) -> [batch..., 1, k, n]
    a_e = jnp.expand_dims(a, -1) if b.ndim - nb == 2 else a
    b_e = jnp.expand_dims(b, nb) if b.ndim - nb == 2 else b
    return jnp.sum(lax.mul(*_broadcast_pair(a_e, b_e)), axis=nb + 1, dtype=a.dtype)


def _broadcast_pair(a: Any, b: Any) -> tuple[Any, Any]:
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    return jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)


def _scaled(x: Any, factor: Any) -> Any:
    return x if factor == 1 else lax.mul(x, jnp.asarray(factor, x.dtype))


def _add_scaled(product: Any, bias: Any, beta: Any, alpha: Any) -> Any:
    """``beta * bias + alpha * product`` in the accumulation dtype; beta == 0 ignores ``bias``
    (NaN/inf included), as torch documents."""
    out = _scaled(product, alpha)
    if beta == 0:
        return out
    bias = lax.broadcast_in_dim(convert(bias, out.dtype), out.shape, tuple(range(out.ndim - bias.ndim, out.ndim)))
    return lax.add(_scaled(bias, beta), out)


@register_lowering(aten.mm)
def mm(a, b, out_dtype_arg=None):
    """mm, and mm.dtype (16-bit inputs, float32 output)."""
    return convert(dot(a, b, (1, 0)), out_dtype())


@register_lowering(aten.bmm)
def bmm(a, b, out_dtype_arg=None):
    return convert(dot(a, b, (2, 1), ((0,), (0,))), out_dtype())


@register_lowering(aten.addmm)
def addmm(bias, a, b, *args, beta=1, alpha=1):
    # addmm.dtype takes out_dtype positionally before the keyword-only beta/alpha.
    return convert(_add_scaled(dot(a, b, (1, 0)), bias, beta, alpha), out_dtype())


@register_lowering(aten.addmv)
def addmv(bias, mat, vec, *, beta=1, alpha=1):
    return convert(_add_scaled(dot(mat, vec, (1, 0)), bias, beta, alpha), out_dtype())
