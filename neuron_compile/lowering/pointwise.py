"""Elementwise arithmetic, comparisons, logic and unary math.

Type promotion, scalars and broadcasting are handled by ``register_pointwise``; each lowering here is
written for same-shape arrays of the computation dtype.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import torch
import torch._inductor.inductor_prims
from jax import lax

from . import device_calls
from .registry import Unsupported, register_lowering
from .semantics import (
    Promotion,
    broadcast,
    convert,
    elementwise,
    is_array,
    is_float,
    pointwise,
    promote_types,
    register_pointwise,
)
from .special import hurwitz_zeta

aten = torch.ops.aten
INT_TO_FLOAT = Promotion.INT_TO_FLOAT
BOOL = Promotion.ALWAYS_BOOL
NO_OPMATH = Promotion.NO_OPMATH


# ---- arithmetic -------------------------------------------------------------------------------------
def _scaled(b, alpha):
    """``alpha * b``; ``alpha`` a number, or a 0-d array (the device feeds an eager op's numbers at run time)."""
    if is_array(alpha):
        if b.dtype == jnp.bool_:
            raise Unsupported("a runtime alpha with bool tensors")
        return lax.mul(b, convert(alpha, b.dtype))
    if alpha == 1:
        return b
    if b.dtype == jnp.bool_:
        return b if alpha else jnp.zeros_like(b)
    return lax.mul(b, convert(alpha, b.dtype))


@register_pointwise(aten.add.Tensor, aten.add.Scalar)
def add(a, b, *, alpha=1):
    b = _scaled(b, alpha)
    return lax.bitwise_or(a, b) if a.dtype == jnp.bool_ else lax.add(a, b)  # bool + bool saturates


@register_pointwise(aten.sub.Tensor, aten.sub.Scalar)
def sub(a, b, *, alpha=1):
    return lax.sub(a, _scaled(b, alpha))


@register_pointwise(aten.rsub.Tensor, aten.rsub.Scalar)
def rsub(a, b, *, alpha=1):
    return sub(b, a, alpha=alpha)


@register_pointwise(aten.mul.Tensor, aten.mul.Scalar)
def mul(a, b):
    return lax.bitwise_and(a, b) if a.dtype == jnp.bool_ else lax.mul(a, b)


@register_pointwise(aten.div.Tensor, aten.div.Scalar, aten.true_divide.Tensor, aten.true_divide.Scalar,
                    promotion=INT_TO_FLOAT)  # fmt: skip
def true_divide(a, b):
    return lax.div(a, b)


@register_pointwise(torch.ops.prims.fma.default)
def fma(a, b, c):
    """a * b + c: Dynamo's form of ``addcmul_(..., value=v)`` and ``add_(x, alpha=tensor)``, in optimizer
    steps. Computed in opmath, so 16-bit inputs round once, as a fused multiply-add would; float32 also
    rounds the product (StableHLO has no fused multiply-add): at most an ulp from eager's."""
    return lax.add(lax.mul(a, b), c)


@register_pointwise(aten.copysign.Tensor, aten.copysign.Scalar, promotion=INT_TO_FLOAT)
def _copysign(a, b):
    return jnp.copysign(a, b)


def _fmod(a, b):
    # lax.rem is C's fmod for floats and truncating % for integers: torch's fmod in both cases.
    return lax.rem(a, b)


def _remainder(a, b):
    # Python's sign rule: a nonzero remainder takes the divisor's sign.
    mod = lax.rem(a, b)
    zero = jnp.zeros_like(mod)
    fix = lax.bitwise_and(lax.ne(mod, zero), lax.ne(lax.lt(b, zero), lax.lt(mod, zero)))
    return lax.select(fix, lax.add(mod, b), mod)


def _floor_divide(a, b):
    """torch's div(rounding_mode="floor"), including its float algorithm (exact for huge quotients)."""
    zero = jnp.zeros_like(a)
    if not is_float(a.dtype):
        q = lax.div(a, b)
        fix = lax.bitwise_and(lax.ne(lax.rem(a, b), zero), lax.ne(lax.lt(a, zero), lax.lt(b, zero)))
        return lax.select(fix, lax.sub(q, jnp.ones_like(q)), q)
    one = jnp.ones_like(a)
    mod = lax.rem(a, b)
    div = lax.div(lax.sub(a, mod), b)
    fix = lax.bitwise_and(lax.ne(mod, zero), lax.ne(lax.lt(b, zero), lax.lt(mod, zero)))
    div = lax.select(fix, lax.sub(div, one), div)
    floordiv = lax.floor(div)
    floordiv = lax.select(lax.gt(lax.sub(div, floordiv), jnp.full_like(a, 0.5)), lax.add(floordiv, one), floordiv)
    quotient = lax.div(a, b)
    floordiv = lax.select(lax.eq(div, zero), _copysign(zero, quotient), floordiv)
    return lax.select(lax.eq(b, zero), quotient, floordiv)


def _rounded_quotient(a, b):
    """a / b rounded once, as eager divides. XLA's simplifier turns ``a / broadcast(b)`` into
    ``a * broadcast(1 / b)``, up to 2 ulp off (5.125 / 5.125 = 0.99999994), which truncation turns
    into an off-by-one; one Newton step on the residual restores the rounded quotient."""
    q = lax.div(a, b)
    correction = lax.div(lax.sub(a, lax.mul(q, b)), b)
    # b = 0 or inf, and overflowing products, leave the residual non-finite: keep the plain quotient there.
    return lax.select(jnp.isfinite(correction), lax.add(q, correction), q)


def _trunc_divide(a, b):
    return jnp.trunc(_rounded_quotient(a, b)) if is_float(a.dtype) else lax.div(a, b)


_DIV_MODES = {
    None: pointwise(true_divide, INT_TO_FLOAT),
    "trunc": pointwise(_trunc_divide),
    "floor": pointwise(_floor_divide),
}


@register_lowering(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_mode(a, b, *, rounding_mode=None):
    # The rounding mode decides the promotion: none is true division (int -> float), the others keep ints.
    return _DIV_MODES[rounding_mode](a, b)


register_pointwise(aten.floor_divide)(_floor_divide)
register_pointwise(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor)(_remainder)
register_pointwise(aten.fmod.Tensor, aten.fmod.Scalar)(_fmod)


@register_pointwise(aten.neg)
def neg(a):
    return lax.neg(a)


@register_pointwise(aten.abs)
def absolute(a):
    return a if a.dtype == jnp.bool_ or jnp.issubdtype(a.dtype, jnp.unsignedinteger) else lax.abs(a)


@register_pointwise(aten.reciprocal, promotion=INT_TO_FLOAT)
def reciprocal(a):
    return lax.div(jnp.ones_like(a), a)


@register_pointwise(aten.maximum, aten.clamp_min.Tensor)
def maximum(a, b):
    # torch propagates NaN from either side; say so explicitly rather than rely on the backend's max.
    return jnp.where(jnp.isnan(a) | jnp.isnan(b), a + b, lax.max(a, b)) if is_float(a.dtype) else lax.max(a, b)


@register_pointwise(aten.minimum, aten.clamp_max.Tensor)
def minimum(a, b):
    return jnp.where(jnp.isnan(a) | jnp.isnan(b), a + b, lax.min(a, b)) if is_float(a.dtype) else lax.min(a, b)


register_pointwise(aten.clamp_min.default)(maximum)
register_pointwise(aten.clamp_max.default)(minimum)


@register_pointwise(aten.clamp.default, aten.clamp.Tensor)
def clamp(a, lo=None, hi=None):
    # min(max(a, lo), hi): NaN anywhere gives NaN, and lo > hi gives hi, as in eager.
    if lo is not None:
        a = maximum(a, lo)
    if hi is not None:
        a = minimum(a, hi)
    return a


@register_pointwise(aten.fmax)
def fmax(a, b):
    return jnp.fmax(a, b) if is_float(a.dtype) else lax.max(a, b)  # NaN only when both are NaN


@register_pointwise(aten.fmin)
def fmin(a, b):
    return jnp.fmin(a, b) if is_float(a.dtype) else lax.min(a, b)


def _int_pow(a, b):
    """Integer power with eager's rules: exact modulo 2**bits, and for negative exponents
    1 for base 1, +-1 for base -1, else 0."""
    one, zero = jnp.ones_like(a), jnp.zeros_like(a)
    acc, base, exp = one, a, b
    for _ in range(jnp.dtype(a.dtype).itemsize * 8):
        acc = lax.select(lax.ne(lax.bitwise_and(exp, one), zero), lax.mul(acc, base), acc)
        base = lax.mul(base, base)
        exp = lax.shift_right_logical(exp, one)
    if jnp.issubdtype(a.dtype, jnp.unsignedinteger):
        return acc
    odd = lax.ne(lax.bitwise_and(b, one), zero)
    negative = lax.select(lax.eq(a, one), one, lax.select(lax.eq(a, -one), lax.select(odd, -one, one), zero))
    return lax.select(lax.lt(b, zero), negative, acc)


def _euclid_steps(dtype) -> int:
    """The most remainder steps Euclid's algorithm takes on values of ``dtype``: consecutive Fibonacci
    numbers are its worst case (Lame's theorem), so count them up to the type's range."""
    previous, current, steps = 1, 1, 0
    while current <= 2 ** jnp.iinfo(dtype).bits:
        previous, current, steps = current, previous + current, steps + 1
    return steps + 1


@register_pointwise(aten.gcd)
def gcd(a, b):
    # eager's calc_gcd on |a|, |b|: while a != 0: a, b = b % a, a (a static trip count: lanes that reached 0 idle)
    zero, one = jnp.zeros_like(a), jnp.ones_like(a)

    def step(_, ab):
        x, y = ab
        live = lax.ne(x, zero)
        return lax.select(live, lax.rem(y, lax.select(live, x, one)), x), lax.select(live, x, y)

    return lax.fori_loop(0, _euclid_steps(a.dtype), step, (absolute(a), absolute(b)))[1]


@register_pointwise(aten.lcm)
def lcm(a, b):
    g = gcd(a, b)
    nonzero = lax.ne(g, jnp.zeros_like(g))
    # eager: |a / g * b| in C's int arithmetic, which widens 8/16-bit types before the product and its abs
    wide = jnp.int32 if jnp.dtype(a.dtype).itemsize < 4 else a.dtype
    a_, b_, g_ = (lax.convert_element_type(x, wide) for x in (a, b, lax.select(nonzero, g, jnp.ones_like(g))))
    product = lax.convert_element_type(absolute(lax.mul(lax.div(a_, g_), b_)), a.dtype)
    return lax.select(nonzero, product, jnp.zeros_like(g))


def _pow_body(a, b):
    return lax.pow(a, b) if is_float(a.dtype) else _int_pow(a, b)


_pow = pointwise(_pow_body)

#: Eager computes these scalar exponents with plain arithmetic, not with std::pow.
_POW_SPECIAL = {
    2: lambda a: lax.mul(a, a),
    3: lambda a: lax.mul(lax.mul(a, a), a),
    0.5: lax.sqrt,
    -0.5: lax.rsqrt,
    -1: lambda a: lax.div(jnp.ones_like(a), a),
    -2: lambda a: lax.div(jnp.ones_like(a), lax.mul(a, a)),
}


@register_lowering(aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar)
def power(a, b):
    if is_array(a) and not is_array(b) and not isinstance(b, bool) and b in _POW_SPECIAL:
        _, result = promote_types([a, b], Promotion.DEFAULT)
        if is_float(result):
            return pointwise(_POW_SPECIAL[b])(convert(a, result))
    return _pow(a, b)


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


# Shifts by a negative amount or by the width or more are defined in torch (not UB as in C): a left shift
# gives 0, a right shift the sign fill (0 for unsigned types).
@register_pointwise(aten.bitwise_left_shift, aten.__lshift__)
def bitwise_left_shift(a, b):
    bits = jnp.iinfo(a.dtype).bits
    out_of_range = lax.bitwise_or(lax.lt(b, jnp.zeros_like(b)), lax.ge(b, jnp.full_like(b, bits)))
    return lax.select(out_of_range, jnp.zeros_like(a), lax.shift_left(a, b))


@register_pointwise(aten.bitwise_right_shift, aten.__rshift__)
def bitwise_right_shift(a, b):
    bits = jnp.iinfo(a.dtype).bits
    if not jnp.issubdtype(a.dtype, jnp.signedinteger):
        return lax.select(lax.ge(b, jnp.full_like(b, bits)), jnp.zeros_like(a), lax.shift_right_logical(a, b))
    sign_fill = jnp.full_like(b, bits - 1)
    amount = lax.select(lax.bitwise_or(lax.lt(b, jnp.zeros_like(b)), lax.gt(b, sign_fill)), sign_fill, b)
    # Arithmetic shift as a logical one of the complement (a >> n == ~(~a >>> n) for a < 0): neuronx-cc's
    # ShiftRightArithmetic takes 32-bit types only, its ShiftRightLogical any.
    negative = lax.lt(a, jnp.zeros_like(a))
    magnitude = lax.select(negative, lax.bitwise_not(a), a)
    shifted = lax.shift_right_logical(magnitude, amount)
    return lax.select(negative, lax.bitwise_not(shifted), shifted)


@register_pointwise(aten.isnan, promotion=BOOL)
def isnan(a):
    return lax.ne(a, a)


@register_pointwise(aten.isinf, promotion=BOOL)
def isinf(a):
    return lax.eq(lax.abs(a), jnp.asarray(jnp.inf, a.dtype)) if is_float(a.dtype) else jnp.zeros(a.shape, bool)


# ---- unary math (integers promote to float) ---------------------------------------------------------
def _digamma(x):
    # Eager: digamma(+-0) = -+inf (the pole's sign), where lax.digamma gives NaN.
    return lax.select(lax.eq(x, jnp.zeros_like(x)), _copysign(jnp.full_like(x, jnp.inf), lax.neg(x)), lax.digamma(x))


def _erfinv(x):
    # lax.erf_inv alone is up to ~50 ulp off near +-1, where erfinv's derivative amplifies it. One Newton
    # step on erf(y) = x brings it to ~2 ulp; in the tails the residual is formed from erfc and the
    # exact 1 -+ x, since erf(y) - x itself cancels to nothing there.
    y = lax.erf_inv(x)
    one = jnp.ones_like(x)
    half = jnp.full_like(x, 0.5)
    residual = lax.select(
        lax.gt(x, half),
        lax.sub(lax.sub(one, x), lax.erfc(y)),
        lax.select(lax.lt(x, -half), lax.sub(lax.erfc(lax.neg(y)), lax.add(one, x)), lax.sub(device_calls.erf(y), x)),
    )
    slope = lax.mul(jnp.full_like(x, 2 / math.sqrt(math.pi)), lax.exp(lax.neg(lax.mul(y, y))))
    return lax.select(jnp.isfinite(y), lax.sub(y, lax.div(residual, slope)), y)


@register_pointwise(aten.exp, promotion=INT_TO_FLOAT)
def exp(a):
    return lax.exp(a)


@register_pointwise(aten.exp2, promotion=INT_TO_FLOAT)
def exp2(a):
    if a.dtype != jnp.float32:
        return lax.exp2(a)
    # XLA computes exp2(x) as exp(x * ln 2), whose rounding error grows with |x| (35 ulps near the end of
    # float32's range; eager is within one). Here 2^x = 2^f * 2^n with n = round(x), |f| <= 1/2: only the
    # small exp is approximate, and 2^n is exact (built from its exponent bits, as two halves so that
    # each stays a normal float).
    # (Ops from neuronx-cc's documented list: floor, not round; a multiply, not a shift left.)
    x = lax.clamp(jnp.float32(-160), a, jnp.float32(130))  # past these, 2^x is 0 or inf in float32
    n = lax.floor(lax.add(x, jnp.float32(0.5)))
    frac = lax.exp(lax.mul(lax.sub(x, n), jnp.float32(math.log(2))))
    k = lax.convert_element_type(n, jnp.int32)
    half = lax.shift_right_arithmetic(k, jnp.int32(1))

    def power_of_two(e):
        return lax.bitcast_convert_type(lax.mul(lax.add(e, jnp.int32(127)), jnp.int32(1 << 23)), jnp.float32)

    return lax.mul(lax.mul(frac, power_of_two(half)), power_of_two(lax.sub(k, half)))


@register_pointwise(aten.expm1, promotion=INT_TO_FLOAT)
def expm1(a):
    return lax.expm1(a)


@register_pointwise(aten.log, promotion=INT_TO_FLOAT)
def log(a):
    return lax.log(a)


@register_pointwise(aten.log2, promotion=INT_TO_FLOAT)
def log2(a):
    # math.log, not jnp.log: a jnp constant would be traced as a float64 op under x64.
    return lax.div(lax.log(a), jnp.asarray(math.log(2.0), a.dtype))


@register_pointwise(aten.log10, promotion=INT_TO_FLOAT)
def log10(a):
    return lax.div(lax.log(a), jnp.asarray(math.log(10.0), a.dtype))


@register_pointwise(aten.log1p, promotion=INT_TO_FLOAT)
def log1p(a):
    return lax.log1p(a)


@register_pointwise(aten.sqrt, promotion=INT_TO_FLOAT)
def sqrt(a):
    return lax.sqrt(a)


@register_pointwise(aten.rsqrt, promotion=INT_TO_FLOAT)
def rsqrt(a):
    return lax.rsqrt(a)


@register_pointwise(aten.sin, promotion=INT_TO_FLOAT)
def sin(a):
    return lax.sin(a)


@register_pointwise(aten.cos, promotion=INT_TO_FLOAT)
def cos(a):
    return lax.cos(a)


@register_pointwise(aten.tan, promotion=INT_TO_FLOAT)
def tan(a):
    return lax.tan(a)


@register_pointwise(aten.asin, promotion=INT_TO_FLOAT)
def asin(a):
    return lax.asin(a)


@register_pointwise(aten.acos, promotion=INT_TO_FLOAT)
def acos(a):
    return lax.acos(a)


@register_pointwise(aten.atan, promotion=INT_TO_FLOAT)
def atan(a):
    return lax.atan(a)


@register_pointwise(aten.sinh, promotion=INT_TO_FLOAT)
def sinh(a):
    return lax.sinh(a)


@register_pointwise(aten.cosh, promotion=INT_TO_FLOAT)
def cosh(a):
    return lax.cosh(a)


@register_pointwise(aten.tanh, promotion=INT_TO_FLOAT)
def tanh(a):
    return lax.tanh(a)


@register_pointwise(aten.asinh, promotion=INT_TO_FLOAT)
def asinh(a):
    return lax.asinh(a)


@register_pointwise(aten.acosh, promotion=INT_TO_FLOAT)
def acosh(a):
    return lax.acosh(a)


@register_pointwise(aten.atanh, promotion=INT_TO_FLOAT)
def atanh(a):
    return lax.atanh(a)


@register_pointwise(aten.sigmoid, promotion=INT_TO_FLOAT)
def sigmoid(a):
    return lax.logistic(a)


@register_pointwise(aten.erf, promotion=INT_TO_FLOAT)
def erf(a):
    # AwsNeuronErf on the device: older neuronx-cc rejected HLO erf.
    return device_calls.erf(a)


@register_pointwise(aten.erfc, promotion=INT_TO_FLOAT)
def erfc(a):
    return lax.erfc(a)


@register_pointwise(aten.erfinv, promotion=INT_TO_FLOAT)
def erfinv(a):
    return _erfinv(a)


@register_pointwise(aten.lgamma, promotion=INT_TO_FLOAT)
def lgamma(a):
    return lax.lgamma(a)


@register_pointwise(aten.digamma, promotion=INT_TO_FLOAT)
def digamma(a):
    return _digamma(a)


@register_lowering(aten.polygamma)
def polygamma(n, x):
    if n < 0:
        raise Unsupported(f"polygamma of negative order {n} (eager raises too)")
    if n in (0, 1):
        return pointwise(_digamma if n == 0 else _trigamma, INT_TO_FLOAT)(x)
    return pointwise(lambda v: _polygamma_by_zeta(n, v), INT_TO_FLOAT)(x)


def _polygamma_by_zeta(n, x):
    # Eager's formula for n >= 2 (lax.polygamma is only right for x > 0): (-1)^(n+1) n! zeta(n + 1, x),
    # with n! as exp(lgamma(n + 1)) and the Hurwitz zeta of lowering/special.py (eager's domain rules).
    scale = (1.0 if n % 2 else -1.0) * math.exp(math.lgamma(n + 1.0))
    return lax.mul(jnp.full_like(x, scale), hurwitz_zeta(jnp.full_like(x, float(n + 1)), x))


def _trigamma(x):
    # Eager's reflection for x < 1/2: trigamma(x) = pi^2 / sin^2(pi x) - trigamma(1 - x).
    one = jnp.ones_like(x)
    reflect = lax.lt(x, jnp.full_like(x, 0.5))
    z = lax.select(reflect, lax.sub(one, x), x)
    series = lax.polygamma(one, z)
    sin_pi_x = lax.sin(lax.mul(jnp.full_like(x, math.pi), x))
    pole = lax.div(jnp.full_like(x, math.pi**2), lax.mul(sin_pi_x, sin_pi_x))
    return lax.select(reflect, lax.sub(pole, series), series)


@register_pointwise(aten.atan2, promotion=INT_TO_FLOAT)
def atan2(a, b):
    return lax.atan2(a, b)


@register_pointwise(aten.sign, aten.sgn)
def sign(a):
    if a.dtype == jnp.bool_:
        return a
    if is_float(a.dtype):  # (0 < a) - (a < 0): NaN gives 0 in eager, not NaN
        zero = jnp.zeros_like(a)
        return lax.sub(
            lax.convert_element_type(lax.lt(zero, a), a.dtype), lax.convert_element_type(lax.lt(a, zero), a.dtype)
        )
    return lax.sign(a)


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
def round_half_even(a):
    # torch rounds half to even, like lax's TO_NEAREST_EVEN.
    return lax.round(a, lax.RoundingMethod.TO_NEAREST_EVEN) if is_float(a.dtype) else a


@register_pointwise(aten.round.decimals)
def round_decimals(a, *, decimals=0):
    if not is_float(a.dtype):
        return a
    # Eager's kernel: nearbyint(a * 10**d) / 10**d, or nearbyint(a / 10**-d) * 10**-d for d < 0.
    scale = jnp.asarray(10.0 ** abs(decimals), a.dtype)
    if decimals < 0:
        return lax.mul(round_half_even(lax.div(a, scale)), scale)
    return lax.div(round_half_even(lax.mul(a, scale)), scale)


@register_lowering(aten.where.self)
@elementwise
def where(cond, a, b):
    # Only the two value operands take part in promotion; the condition stays boolean.
    _, result = promote_types([a, b], Promotion.DEFAULT)
    cond, a, b = broadcast(_as_bool(convert(cond, jnp.bool_)), convert(a, result), convert(b, result))
    return lax.select(cond, a, b)


# ---- addcmul, addcdiv ------------------------------------------------------------------------------
# addcmul/addcdiv are kept whole (decompositions.KEEP_WHOLE) and computed as eager's CPU kernel does: in
# opmath (16-bit floats as float32, rounded once at the end), in its order of operations, with ``value``
# converted to the computation dtype first (``value.to<opmath_t>()``: 2.5 is 2 for integers, -1 wraps for
# uint8). Split into ops of the tensors' dtype, as Dynamo splits them for the other backends, bfloat16
# rounds three times (on OpInfo's own sample 2.2 ulp from the exact value, where eager is 0.2 ulp).
@register_pointwise(aten.addcmul)
def addcmul(a, t1, t2, *, value=1):
    """``self + value * tensor1 * tensor2``, i.e. ``self + ((value * tensor1) * tensor2)``."""
    if a.dtype == jnp.bool_:
        raise Unsupported("addcmul of bool tensors: eager has no kernel for it (addcmul_cpu_out)")
    return lax.add(a, lax.mul(lax.mul(convert(value, a.dtype), t1), t2))


@register_pointwise(aten.addcdiv)
def addcdiv(a, t1, t2, *, value=1):
    """``self + value * tensor1 / tensor2``, i.e. ``self + ((value * tensor1) / tensor2)``."""
    if not is_float(a.dtype):
        raise Unsupported("addcdiv of integer tensors: an error in eager (use true division: addcdiv of floats)")
    return lax.add(a, lax.div(lax.mul(convert(value, a.dtype), t1), t2))
