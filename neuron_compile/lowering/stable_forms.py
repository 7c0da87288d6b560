"""float32 forms of quantities whose direct evaluation cancels: the remainders of log1p's series, Loader's
deviance ``bd0`` and the Stirling error. Eager evaluates what uses them (Gamma/Poisson/Binomial samplers
and gradients, the incomplete gamma function) in float64; these keep float32 within a few ulps."""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
from jax import lax


def log1p_series(t: Any, terms: int) -> Any:
    """``(log1p(t) - t + t**2/2 - t**3/3) / t**4`` by its series, to ``t**terms``."""
    series = jnp.zeros_like(t)
    for k in range(terms, 3, -1):
        series = series * t + jnp.float32((-1) ** (k + 1) / k)
    return series


def log1p_remainder(t: Any) -> Any:
    """``log1p(t) - t + t**2/2 - t**3/3``, O(t**4): by its series below |t| = 1/2 (to t**28: the next term
    is below 1e-7 relative), where the direct sum cancels more than ~50-fold."""
    direct = lax.log1p(t) - t + t * t * (jnp.float32(0.5) - t / jnp.float32(3))
    return jnp.where(jnp.abs(t) < 0.5, log1p_series(t, 28) * (t * t) * (t * t), direct)


def log1p_deficit(z: Any) -> Any:
    """``z - log1p(z)`` (>= 0, O(z**2)): by its series below |z| = 1/4 (to z**14: the next term is below
    1e-8 relative), where the direct difference cancels more than ~10-fold."""
    series = z * z * (jnp.float32(0.5) - z / jnp.float32(3) - log1p_series(z, 14) * (z * z))
    return jnp.where(jnp.abs(z) < 0.25, series, z - lax.log1p(z))


# log k! - (k log k - k + log(2 pi k) / 2) for k = 1 .. 9; from 10 on its asymptotic series is exact to float32.
_STIRLING_ERRORS = [math.lgamma(k + 1.0) - (k * math.log(k) - k + 0.5 * math.log(2 * math.pi * k))
                    for k in range(1, 10)]  # fmt: skip


def stirling_error(k: Any) -> Any:
    """``log k! - (k log k - k + log(2 pi k) / 2)`` for k >= 1 (below 10: of ``floor(k)``, from a table, as
    eager's Stirling tails)."""
    inv2 = 1 / (k * k)
    result = (jnp.float32(1 / 12) - inv2 * (jnp.float32(1 / 360) - inv2 / jnp.float32(1260))) / k
    for j, value in enumerate(_STIRLING_ERRORS, start=1):
        result = jnp.where((k >= j) & (k < j + 1), jnp.float32(value), result)
    return result


def bd0(x: Any, mean: Any) -> Any:
    """``x log(x / mean) + mean - x`` (Loader's "bd0", >= 0) for x > 0. Near the mean (|z| < 1, ``z = x / mean
    - 1``) as ``mean (z**2 - (1 + z) (z - log1p(z)))``, without the cancellation of the direct terms (each of
    order ``x log x``); farther away directly, where that form would cancel instead (its z**2 terms)."""
    z = (x - mean) / mean
    near = mean * (z * z - (1 + z) * log1p_deficit(z))
    return jnp.where(jnp.abs(z) < 1, near, x * lax.log(x / mean) + mean - x)
