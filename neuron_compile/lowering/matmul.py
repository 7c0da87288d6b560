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

from .registry import Unsupported, register_library_op, register_lowering
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


def add_scaled(product: Any, bias: Any, beta: Any, alpha: Any) -> Any:
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
    return convert(add_scaled(dot(a, b, (1, 0)), bias, beta, alpha), out_dtype())


@register_lowering(aten.addmv)
def addmv(bias, mat, vec, *, beta=1, alpha=1):
    return convert(add_scaled(dot(mat, vec, (1, 0)), bias, beta, alpha), out_dtype())


# --- Grouped matrix products (MoE experts) -------------------------------------------------------------
# ``offs`` are cumulative group ends along one dimension (tokens sorted by expert); their values are data,
# the shapes are static. So every group is computed over the whole dimension and each position keeps its
# own group's result (select, then an add-reduction over groups whose other terms are exact zeros): the
# cost of a dense pass over all experts (as transformers' "batched_mm" experts), with no data-dependent
# shape. Positions past the last offset get zeros (eager leaves them undefined; transformers' CPU
# fallback writes zeros).


def _group_mask(offs: Any, length: int) -> Any:
    """bool[G, length]: position p of the grouped dimension belongs to group g (offs[g-1] <= p < offs[g])."""
    pos = lax.broadcasted_iota(jnp.int32, (1, length), 1)
    ends = convert(offs, jnp.int32)[:, None]
    starts = jnp.concatenate([jnp.zeros((1, 1), jnp.int32), ends[:-1]], axis=0)
    return lax.bitwise_and(lax.ge(pos, starts), lax.lt(pos, ends))


def _keep_group(products: Any, mask: Any) -> Any:
    """Sum over axis 0 (groups) of ``products`` where ``mask`` (broadcast to it) holds, zeros elsewhere."""
    mask = jnp.broadcast_to(mask, products.shape)
    return jnp.sum(lax.select(mask, products, jnp.zeros(products.shape, products.dtype)), axis=0)


def grouped_mm_static(a: Any, b: Any, offs: Any = None, bias: Any = None) -> Any:
    """``torch._grouped_mm`` as a static computation, in the accumulation dtype (float32 for 16-bit floats).

    The four layouts of torch: 2d x 3d (``a``'s rows grouped: [M, K] x [G, K, N] -> [M, N]), 3d x 2d
    (``b``'s columns grouped: [G, M, K] x [K, N] -> [M, N]), 2d x 2d (the contraction grouped, as in the
    weight gradient: [M, K] x [K, N] -> [G, M, N]) and 3d x 3d (a batched product, no ``offs``).
    """
    if not is_float(a.dtype):
        raise Unsupported(f"grouped matrix product of {jnp.dtype(a.dtype)} (floating dtypes only)")
    # Widening first is exact and gives the same float32 accumulation; XLA CPU has no bf16 x bf16 -> f32
    # kernel for every dot layout used here.
    acc = _acc_dtype(a.dtype)
    a, b = convert(a, acc), convert(b, acc)
    if a.ndim == 3 and b.ndim == 3:
        if offs is not None:
            raise Unsupported("grouped_mm of 3d x 3d operands with offs")
        out = dot(a, b, (2, 1), ((0,), (0,)))
        return out if bias is None else lax.add(out, convert(bias, out.dtype)[:, None, :])
    if offs is None:
        raise Unsupported(f"grouped_mm of {a.ndim}d x {b.ndim}d operands needs offs")
    if a.ndim == 2 and b.ndim == 3:
        products = jnp.moveaxis(dot(a, b, (1, 1)), 1, 0)  # [M, G, N] -> [G, M, N]
        if bias is not None:
            products = lax.add(products, convert(bias, products.dtype)[:, None, :])
        return _keep_group(products, _group_mask(offs, a.shape[0])[:, :, None])
    if a.ndim == 3 and b.ndim == 2:
        products = dot(a, b, (2, 0))  # [G, M, N]
        if bias is not None:
            products = lax.add(products, convert(bias, products.dtype)[:, None, :])
        return _keep_group(products, _group_mask(offs, b.shape[1])[:, None, :])
    if a.ndim == 2 and b.ndim == 2:
        mask = _group_mask(offs, a.shape[1])[:, None, :]  # [G, 1, K]
        shape = (mask.shape[0],) + a.shape
        masked = lax.select(jnp.broadcast_to(mask, shape), jnp.broadcast_to(a, shape), jnp.zeros(shape, a.dtype))
        out = dot(masked, b, (2, 0))  # [G, M, N]
        return out if bias is None else lax.add(out, convert(bias, out.dtype)[:, None, :])
    raise Unsupported(f"grouped_mm of {a.ndim}d x {b.ndim}d operands")


@register_lowering(aten._grouped_mm.default)
def grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    return convert(grouped_mm_static(mat_a, mat_b, offs, bias), _result_dtype())


def _result_dtype() -> Any:
    # The op's keyword ``out_dtype`` shadows the semantics helper of that name inside ``grouped_mm``.
    return out_dtype()


# By name: transformers defines these ops when its MoE module is imported, which may be after this one.
@register_library_op("transformers.grouped_mm_fallback.default")
def transformers_grouped_mm_fallback(input, weight, offs):
    """``transformers::grouped_mm_fallback`` (transformers' MoE experts, non-bf16 under torch.compile):
    rows of ``input`` grouped by ``offs`` times their expert's ``weight`` [G, K, N]."""
    return convert(grouped_mm_static(input, weight, offs), _result_dtype())


@register_library_op("transformers.grouped_mm_fallback_backward.default")
def transformers_grouped_mm_fallback_backward(input, weight, offs, grad_output):
    """``transformers::grouped_mm_fallback_backward``: (grad_input, grad_weight) of the op above."""
    grad_input = grouped_mm_static(grad_output, jnp.swapaxes(weight, 1, 2), offs)
    grad_weight = grouped_mm_static(jnp.swapaxes(input, 0, 1), grad_output, offs)
    return convert(grad_input, input.dtype), convert(grad_weight, weight.dtype)
