"""Functions of a matrix: the matrix exponential, by scaling and squaring with a static shape.

``linalg.matrix_exp`` (the ``orthogonal`` parametrization's default map, Lie-group layers) is the Taylor
series of degree 18, accurate to float32's unit roundoff for a matrix of 1-norm at most THETA_18 (the bound
published with the degree-18 method of Bader, Blanes and Casas, 2019, which eager's CPU kernel uses too), on
the matrix scaled by ``2**-s``, then squared ``s`` times. ``s = ceil(log2(norm / THETA_18))`` depends on the
values, which neuronx-cc cannot branch or loop on: the graph holds MAX_SQUARINGS squarings and each applies
only while its index is below ``s`` (a select, no conditional). Scaling by a power of two is exact, so the
result is the method eager uses, up to the order of the products.

Eager picks a lower degree for a small norm (fewer products, the same accuracy); degree 18 for every norm
is a few more products and no difference beyond float32 rounding. A norm past ``THETA_18 * 2**MAX_SQUARINGS``
(~1.3e10) gives NaN: eager's float32 result there has overflowed or, for a rotation-like (skew-symmetric)
matrix, holds no correct digit (the angle's own rounding error is ~1e3 radians).

Computed in float32 (16-bit operands in float32 and rounded once; float64 as float32, as everywhere).
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import torch
from jax import lax

from .registry import Unsupported, register_lowering
from .semantics import convert, out_dtype

aten = torch.ops.aten

#: Largest 1-norm for which the degree-18 Taylor sum is within float32's unit roundoff of exp.
THETA_18 = 3.010066362817634
DEGREE = 18
MAX_SQUARINGS = 32
#: Paterson-Stockmeyer block: powers up to A**4 are formed, then a Horner recurrence in A**4.
_BLOCK = 4


def _matmul(a: Any, b: Any) -> Any:
    return jnp.matmul(a, b, precision=lax.Precision.HIGHEST)


def _taylor(x: Any) -> Any:
    """sum_{k <= 18} x**k / k!, by Paterson-Stockmeyer: 3 products for the powers, 4 for the recurrence."""
    eye = jnp.broadcast_to(jnp.eye(x.shape[-1], dtype=x.dtype), x.shape)
    powers = [eye, x]
    for _ in range(_BLOCK - 1):
        powers.append(_matmul(powers[-1], x))
    coeff = [jnp.float32(1.0 / math.factorial(k)) for k in range(DEGREE + 1)]

    def block(j: int) -> Any:  # sum_i coeff[4j + i] x**i
        return sum(coeff[_BLOCK * j + i] * powers[i] for i in range(_BLOCK) if _BLOCK * j + i <= DEGREE)

    top = DEGREE // _BLOCK
    result = block(top)
    for j in range(top - 1, -1, -1):
        result = _matmul(result, powers[_BLOCK]) + block(j)
    return result


def _power_of_two(exponent: Any) -> Any:
    """2.0**exponent for integral float32 exponents in [-126, 127], exactly: the float's exponent bits
    (exp2 may be computed as exp(x * ln 2), a few ulps off a power of two)."""
    bits = lax.shift_left(exponent.astype(jnp.int32) + 127, jnp.int32(23))
    return lax.bitcast_convert_type(bits, jnp.float32)


@register_lowering(aten.linalg_matrix_exp.default)
def linalg_matrix_exp(a: Any) -> Any:
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise Unsupported(f"linalg_matrix_exp of {jnp.dtype(a.dtype)} (floating dtypes only)")
    if a.shape[-1] == 0:
        return a
    x = convert(a, jnp.float32)
    norm = jnp.max(jnp.sum(jnp.abs(x), axis=-2), axis=-1)[..., None, None]
    squarings = jnp.ceil(jnp.log2(norm / jnp.float32(THETA_18)))
    squarings = jnp.where(jnp.isnan(norm) | (squarings < 0), jnp.float32(0), squarings)
    result = _taylor(x * _power_of_two(-jnp.minimum(squarings, jnp.float32(MAX_SQUARINGS + 1))))
    for i in range(MAX_SQUARINGS):
        result = jnp.where(jnp.float32(i) < squarings, _matmul(result, result), result)
    result = jnp.where(squarings > jnp.float32(MAX_SQUARINGS), jnp.float32(jnp.nan), result)
    return convert(result, out_dtype())
