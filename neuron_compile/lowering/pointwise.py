"""Elementwise arithmetic, comparisons, logic and unary math.

Type promotion, scalars and broadcasting are handled by ``register_pointwise``; each lowering here is
written for same-shape arrays of the computation dtype.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax

from .registry import register_lowering
from .semantics import Promotion, broadcast, convert, is_float, promote_types, register_pointwise

aten = torch.ops.aten
INT_TO_FLOAT = Promotion.INT_TO_FLOAT
BOOL = Promotion.ALWAYS_BOOL
NO_OPMATH = Promotion.NO_OPMATH


# ---- arithmetic -------------------------------------------------------------------------------------
@register_pointwise(aten.add.Tensor, aten.add.Scalar)
def add(a, b, *, alpha=1):
    return lax.add(a, b if alpha == 1 else lax.mul(b, jnp.asarray(alpha, b.dtype)))


@register_pointwise(aten.sub.Tensor, aten.sub.Scalar)
def sub(a, b, *, alpha=1):
    return lax.sub(a, b if alpha == 1 else lax.mul(b, jnp.asarray(alpha, b.dtype)))


@register_pointwise(aten.rsub.Tensor, aten.rsub.Scalar)
def rsub(a, b, *, alpha=1):
    return sub(b, a, alpha=alpha)


@register_pointwise(aten.mul.Tensor, aten.mul.Scalar)
def mul(a, b):
    return lax.bitwise_and(a, b) if a.dtype == jnp.bool_ else lax.mul(a, b)


@register_pointwise(aten.div.Tensor, aten.div.Scalar, promotion=INT_TO_FLOAT)
def true_divide(a, b):
    return lax.div(a, b)


def _floor_divide(a, b):
    if is_float(a.dtype):
        return jnp.floor_divide(a, b)  # torch: floor(a / b) with python's sign rules
    return jnp.floor_divide(a, b)


@register_pointwise(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_mode(a, b, *, rounding_mode=None):
    if rounding_mode is None:
        return lax.div(a, b) if is_float(a.dtype) else lax.div(a.astype(jnp.float32), b.astype(jnp.float32))
    if rounding_mode == "trunc":
        return lax.div(a, b) if not is_float(a.dtype) else jnp.trunc(lax.div(a, b))
    return _floor_divide(a, b)


@register_pointwise(aten.neg)
def neg(a):
    return lax.neg(a)


@register_pointwise(aten.abs)
def abs_(a):
    return lax.abs(a) if a.dtype != jnp.bool_ else a


@register_pointwise(aten.reciprocal, promotion=INT_TO_FLOAT)
def reciprocal(a):
    return lax.div(jnp.ones_like(a), a)


@register_pointwise(aten.maximum, aten.clamp_min.Tensor)
def maximum(a, b):
    # torch propagates NaN; lax.max on CPU does too, but be explicit for the device.
    return jnp.where(jnp.isnan(a) | jnp.isnan(b), a + b, lax.max(a, b)) if is_float(a.dtype) else lax.max(a, b)


@register_pointwise(aten.minimum, aten.clamp_max.Tensor)
def minimum(a, b):
    return jnp.where(jnp.isnan(a) | jnp.isnan(b), a + b, lax.min(a, b)) if is_float(a.dtype) else lax.min(a, b)


@register_pointwise(aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar)
def pow_(a, b):
    if is_float(a.dtype):
        return lax.pow(a, b)
    return jnp.power(a, b)  # integer power: repeated squaring, exact


# ---- comparisons and logic --------------------------------------------------------------------------
@register_pointwise(aten.eq.Tensor, aten.eq.Scalar, promotion=BOOL)
def eq(a, b):
    return lax.eq(a, b)


@register_pointwise(aten.ne.Tensor, aten.ne.Scalar, promotion=BOOL)
def ne(a, b):
    return lax.ne(a, b)


@register_pointwise(aten.lt.Tensor, aten.lt.Scalar, promotion=BOOL)
def lt(a, b):
    return lax.lt(a, b)


@register_pointwise(aten.le.Tensor, aten.le.Scalar, promotion=BOOL)
def le(a, b):
    return lax.le(a, b)


@register_pointwise(aten.gt.Tensor, aten.gt.Scalar, promotion=BOOL)
def gt(a, b):
    return lax.gt(a, b)


@register_pointwise(aten.ge.Tensor, aten.ge.Scalar, promotion=BOOL)
def ge(a, b):
    return lax.ge(a, b)


def _as_bool(x):
    return x if x.dtype == jnp.bool_ else lax.ne(x, jnp.zeros_like(x))


@register_pointwise(aten.logical_not, promotion=BOOL)
def logical_not(a):
    return lax.bitwise_not(_as_bool(a))


@register_pointwise(aten.logical_and, promotion=BOOL)
def logical_and(a, b):
    return lax.bitwise_and(_as_bool(a), _as_bool(b))


@register_pointwise(aten.logical_or, promotion=BOOL)
def logical_or(a, b):
    return lax.bitwise_or(_as_bool(a), _as_bool(b))


@register_pointwise(aten.logical_xor, promotion=BOOL)
def logical_xor(a, b):
    return lax.bitwise_xor(_as_bool(a), _as_bool(b))


@register_pointwise(aten.bitwise_not)
def bitwise_not(a):
    return lax.bitwise_not(a)


@register_pointwise(aten.bitwise_and.Tensor, aten.bitwise_and.Scalar)
def bitwise_and(a, b):
    return lax.bitwise_and(a, b)


@register_pointwise(aten.bitwise_or.Tensor, aten.bitwise_or.Scalar)
def bitwise_or(a, b):
    return lax.bitwise_or(a, b)


@register_pointwise(aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar)
def bitwise_xor(a, b):
    return lax.bitwise_xor(a, b)


@register_pointwise(aten.isnan, promotion=BOOL)
def isnan(a):
    return lax.ne(a, a)


@register_pointwise(aten.isinf, promotion=BOOL)
def isinf(a):
    return lax.eq(lax.abs(a), jnp.asarray(jnp.inf, a.dtype)) if is_float(a.dtype) else jnp.zeros(a.shape, bool)


# ---- unary math (integers promote to float) ---------------------------------------------------------
def _unary(op, fn):
    register_pointwise(op, promotion=INT_TO_FLOAT)(fn)


for _op, _fn in [
    (aten.exp, lax.exp),
    (aten.exp2, lambda a: lax.exp2(a)),
    (aten.expm1, lax.expm1),
    (aten.log, lax.log),
    (aten.log2, lambda a: lax.div(lax.log(a), jnp.asarray(jnp.log(2.0), a.dtype))),
    (aten.log10, lambda a: lax.div(lax.log(a), jnp.asarray(jnp.log(10.0), a.dtype))),
    (aten.log1p, lax.log1p),
    (aten.sqrt, lax.sqrt),
    (aten.rsqrt, lax.rsqrt),
    (aten.sin, lax.sin),
    (aten.cos, lax.cos),
    (aten.tan, lax.tan),
    (aten.asin, lax.asin),
    (aten.acos, lax.acos),
    (aten.atan, lax.atan),
    (aten.sinh, lax.sinh),
    (aten.cosh, lax.cosh),
    (aten.tanh, lax.tanh),
    (aten.asinh, lax.asinh),
    (aten.acosh, lax.acosh),
    (aten.atanh, lax.atanh),
    (aten.sigmoid, lax.logistic),
    (aten.erf, lax.erf),
    (aten.erfc, lax.erfc),
    (aten.erfinv, lax.erf_inv),
    (aten.lgamma, lax.lgamma),
    (aten.digamma, lax.digamma),
]:
    _unary(_op, _fn)


@register_pointwise(aten.atan2, promotion=INT_TO_FLOAT)
def atan2(a, b):
    return lax.atan2(a, b)


@register_pointwise(aten.sign)
def sign(a):
    return lax.sign(a) if a.dtype != jnp.bool_ else a


@register_pointwise(aten.floor)
def floor(a):
    return lax.floor(a) if is_float(a.dtype) else a


@register_pointwise(aten.ceil)
def ceil(a):
    return lax.ceil(a) if is_float(a.dtype) else a


@register_pointwise(aten.trunc)
def trunc(a):
    return jnp.trunc(a) if is_float(a.dtype) else a


@register_pointwise(aten.round.default)
def round_(a):
    # torch rounds half to even, like lax's TO_NEAREST_EVEN.
    return lax.round(a, lax.RoundingMethod.TO_NEAREST_EVEN) if is_float(a.dtype) else a


@register_lowering(aten.where.self)
def where(cond, a, b):
    # Only the two value operands take part in promotion; the condition stays boolean.
    _, result = promote_types([a, b], Promotion.DEFAULT)
    cond, a, b = broadcast(_as_bool(convert(cond, jnp.bool_)), convert(a, result), convert(b, result))
    return lax.select(cond, a, b)
