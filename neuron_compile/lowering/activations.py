"""Activation functions that survive the core-ATen decomposition: relu, gelu (+backward), silu
(+backward), hardtanh, leaky_relu, elu. The other activations (softplus, mish, hardswish, the
*_backward of hardtanh/leaky_relu/elu, ...) reach us as pointwise ops.

``register_pointwise`` computes bfloat16/float16 in float32 and rounds once, as eager's opmath does.
Every select is written so that NaN inputs give NaN, as in eager.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import torch
from jax import lax

from . import device_calls
from .registry import Unsupported, register_lowering
from .semantics import in_opmath, out_dtype, register_pointwise

aten = torch.ops.aten

_SQRT_1_2 = math.sqrt(0.5)
_SQRT_2_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_TANH_C = 0.044715


def _c(value, like):
    return jnp.asarray(value, like.dtype)


def _with_scalar_params(*ops):
    """Register a one-tensor activation whose other arguments are Python scalars that, unlike in
    ``register_pointwise``, take no part in type promotion (hardtanh(int tensor, -1.0, 1.0) stays int)."""

    def decorate(fn):
        @functools.wraps(fn)
        def lower(x, *params):
            return in_opmath(lambda v: fn(v, *params), x, result=out_dtype())

        register_lowering(*ops)(lower)
        return fn

    return decorate


def _check_approximate(approximate: str) -> None:
    if approximate not in ("none", "tanh"):
        raise Unsupported(f"gelu approximate={approximate!r}")


@register_pointwise(aten.relu)
def relu(x):
    # x < 0 is False for NaN, so NaN passes through as in eager.
    return lax.select(lax.lt(x, _c(0, x)), jnp.zeros_like(x), x)


@register_pointwise(aten.gelu)
def gelu(x, *, approximate="none"):
    _check_approximate(approximate)
    # AwsNeuronGelu / AwsNeuronGeluApprxTanh on the device (device_calls); this formula on the CPU target.
    return device_calls.gelu(x, approximate, reference=lambda v: _gelu_formula(v, approximate))


def _gelu_formula(x, approximate):
    half_x = lax.mul(x, _c(0.5, x))
    if approximate == "tanh":
        inner = lax.mul(_c(_SQRT_2_PI, x), lax.add(x, lax.mul(_c(_GELU_TANH_C, x), lax.mul(x, lax.mul(x, x)))))
        return lax.mul(half_x, lax.add(_c(1, x), lax.tanh(inner)))
    return lax.mul(half_x, lax.add(_c(1, x), lax.erf(lax.mul(x, _c(_SQRT_1_2, x)))))


@register_pointwise(aten.gelu_backward)
def gelu_backward(grad, x, *, approximate="none"):
    _check_approximate(approximate)
    # AwsNeuronGeluBackward / AwsNeuronGeluApprxTanhBackward on the device; this formula on the CPU target.
    reference = lambda g, v: _gelu_backward_formula(g, v, approximate)  # noqa: E731
    return device_calls.gelu_backward(grad, x, approximate, reference)


def _gelu_backward_formula(grad, x, approximate):
    if approximate == "tanh":
        x_sq = lax.mul(x, x)
        inner = lax.mul(_c(_SQRT_2_PI, x), lax.add(x, lax.mul(_c(_GELU_TANH_C, x), lax.mul(x_sq, x))))
        t = lax.tanh(inner)
        d_inner = lax.mul(_c(_SQRT_2_PI, x), lax.add(_c(1, x), lax.mul(_c(3 * _GELU_TANH_C, x), x_sq)))
        left = lax.mul(_c(0.5, x), lax.add(_c(1, x), t))
        right = lax.mul(lax.mul(_c(0.5, x), x), lax.mul(lax.sub(_c(1, x), lax.mul(t, t)), d_inner))
        return lax.mul(grad, lax.add(left, right))
    cdf = lax.mul(_c(0.5, x), lax.add(_c(1, x), lax.erf(lax.mul(x, _c(_SQRT_1_2, x)))))
    pdf = lax.mul(_c(_INV_SQRT_2PI, x), lax.exp(lax.mul(_c(-0.5, x), lax.mul(x, x))))
    return lax.mul(grad, lax.add(cdf, lax.mul(x, pdf)))


@register_pointwise(aten.silu)
def silu(x):
    # AwsNeuronSilu on the device (device_calls); x * sigmoid(x) on the CPU target.
    return device_calls.silu(x, reference=lambda v: lax.mul(v, lax.logistic(v)))


@register_pointwise(aten.silu_backward)
def silu_backward(grad, x):
    # AwsNeuronSiluBackward on the device (device_calls); this formula on the CPU target.
    return device_calls.silu_backward(grad, x, _silu_backward_formula)


def _silu_backward_formula(grad, x):
    sig = lax.logistic(x)
    return lax.mul(grad, lax.mul(sig, lax.add(_c(1, x), lax.mul(x, lax.sub(_c(1, x), sig)))))


@_with_scalar_params(aten.hardtanh)
def hardtanh(x, min_val=-1, max_val=1):
    # clamp semantics: NaN stays NaN (x < lo and x > hi are both False for it).
    lo, hi = _c(min_val, x), _c(max_val, x)
    return lax.select(
        lax.lt(x, lo), jnp.broadcast_to(lo, x.shape), lax.select(lax.gt(x, hi), jnp.broadcast_to(hi, x.shape), x)
    )


@_with_scalar_params(aten.leaky_relu)
def leaky_relu(x, negative_slope=0.01):
    return lax.select(lax.gt(x, _c(0, x)), x, lax.mul(x, _c(negative_slope, x)))


@register_lowering(aten.rrelu_with_noise_functional)
def rrelu_with_noise_functional(x, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None):
    # Eval mode is eager's leaky_relu at the mean slope, noise untouched; training draws random slopes.
    if training:
        raise Unsupported(f"rrelu training={training!r} (random slopes per element)")
    slope = (lower + upper) / 2
    return in_opmath(lambda v: leaky_relu(v, slope), x, result=out_dtype(0)), noise


@_with_scalar_params(aten.elu)
def elu(x, alpha=1.0, scale=1.0, input_scale=1.0):
    negative = lax.mul(lax.expm1(lax.mul(x, _c(input_scale, x))), _c(alpha * scale, x))
    return lax.select(lax.gt(x, _c(0, x)), lax.mul(x, _c(scale, x)), negative)
