"""Samplers that eager runs as rejection loops, and their reparameterized gradients: ``_standard_gamma``
(Gamma, Chi2, StudentT), ``_sample_dirichlet`` (Dirichlet, Beta, LKJCholesky), ``poisson``, ``binomial``,
with ``_standard_gamma_grad`` and ``_dirichlet_grad`` (the backward of ``Gamma.rsample``/``Beta.rsample``/
``Dirichlet.rsample``).

Eager loops until a candidate is accepted; neuronx-cc takes loops with a static trip count only. So each
element draws a fixed number of candidates at once and keeps the first accepted one: enough of them that
all are rejected less than once in 10**13 draws (the worst acceptance rates, measured, are noted at the
constants below). Then the last candidate is kept, a draw from the proposal distribution, which is close
to the target: the only departure from eager's distribution. Below a mean of 10, Poisson and Binomial counts
are drawn by inversion (eager multiplies uniforms or adds geometric variables: the same distributions).

Gamma is sampled as eager does (Marsaglia and Tsang, with the ``alpha < 1`` boost ``G(alpha + 1) *
U**(1/alpha)``), but in log space: ``log G`` is exact where eager's float64 ``G`` underflows (small
``alpha``), and a Dirichlet is then a softmax of ``log G``, exact where eager normalizes samples clamped to
the smallest double. The gradients are eager's approximations (Jankowiak and Obermeyer, "Pathwise
derivatives beyond the reparameterization trick", 2018: Taylor series, Rice saddle-point expansions and
fitted rational functions), evaluated for all branches and selected per element. Eager evaluates most of
them in float64; here, in float32, the quantities that would cancel (differences of digammas, ``z -
log1p(z)``, distances from the mean) are computed in forms that do not.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .random import box_muller, random_bits, uniform01
from .registry import Unsupported, register_lowering
from .semantics import convert, is_float, out_dtype
from .stable_forms import bd0, log1p_deficit, log1p_remainder, stirling_error

aten = torch.ops.aten
_F32 = jnp.float32

# Candidates per element. Marsaglia-Tsang rejects at most 4.9% (alpha = 1 after the boost): 0.049**10 < 1e-13.
_GAMMA_CANDIDATES = 10
# Hormann's PTRS (Poisson, rate >= 10) rejects 25% at rate 10 (measured), 11% at 1e4: 0.25**24 < 1e-14.
_POISSON_CANDIDATES = 24
# Hormann's BTRS (Binomial, count * p >= 10) rejects 29% at count 20, p 1/2, 13% at 3,000 successes: 0.29**26 < 1e-13.
_BINOMIAL_CANDIDATES = 26
# Below rate 10 (Poisson) or mean 10 (Binomial), counts are drawn by inversion over k = 0 .. 64:
# P(k > 64 | mean < 10) < 1e-25.
_INVERSION_TERMS = 64
_LOG_DBL_MIN = float(np.log(np.finfo(np.float64).tiny))  # eager's float64 gamma samples are clamped there


def _float32(x: Any) -> Any:
    if not is_float(x.dtype):
        raise Unsupported(f"sampling with {x.dtype} parameters: eager takes floating-point ones only")
    return convert(x, _F32)


def _uniforms_open_closed(bits: Any) -> Any:
    """float32 uniforms in (0, 1], as eager's ``1 - U`` (so their log is finite)."""
    return jnp.float32(1) - uniform01(bits, _F32)


def _normals(bits: Any) -> Any:
    """Standard normals, two per pair of bit planes: ``bits[:n]`` and ``bits[n:]`` give 2n planes."""
    half = bits.shape[0] // 2
    return jnp.concatenate(box_muller(bits[:half], bits[half:]))


def _first_accepted(candidates: Any, accepted: Any) -> Any:
    """Per element, the first candidate (along axis 0) that was accepted; the last one if none was."""
    chosen = candidates[-1]
    for i in range(candidates.shape[0] - 2, -1, -1):
        chosen = jnp.where(accepted[i], candidates[i], chosen)
    return chosen


def _log_standard_gamma(alpha: Any, bits: Any) -> Any:
    """``log G`` with ``G ~ Gamma(alpha, 1)`` (float32 ``alpha``); ``bits`` has ``2 * _GAMMA_CANDIDATES + 1``
    planes of ``alpha``'s shape. ``-inf`` where ``alpha <= 0`` or NaN (eager returns 0 there)."""
    n = _GAMMA_CANDIDATES
    boosted = alpha < 1
    a = jnp.where(boosted, alpha + 1, alpha)
    d = a - jnp.float32(1 / 3)
    c = lax.rsqrt(jnp.float32(9) * d)
    x = _normals(bits[:n])
    u = _uniforms_open_closed(bits[n : 2 * n])
    t = c * x
    # Accept when log u < x**2/2 + d (1 - v + log v), v = (1 + t)**3; with d t**2 = x**2/9 that is
    # 3 d (log1p(t) - t + t**2/2 - t**3/3), whose terms cancel to O(t**4): computed as such, not by difference.
    accepted = (t > -1) & (lax.log(u) < jnp.float32(3) * d * log1p_remainder(t))
    log_sample = _first_accepted(lax.log(d) + jnp.float32(3) * lax.log1p(t), accepted)
    boost = lax.log(_uniforms_open_closed(bits[2 * n])) / alpha
    log_sample = log_sample + jnp.where(boosted, boost, jnp.float32(0))
    log_sample = jnp.where(alpha == jnp.inf, jnp.float32(jnp.inf), log_sample)
    return jnp.where(alpha > 0, log_sample, jnp.float32(-jnp.inf))


def _gamma_bits(shape: Sequence[int]) -> Any:
    return random_bits((2 * _GAMMA_CANDIDATES + 1, *shape))


def _clamped_to_tiny(x: Any, dtype: Any) -> Any:
    x = convert(x, dtype)
    return jnp.maximum(x, jnp.asarray(jnp.finfo(dtype).tiny, dtype))


@register_lowering(aten._standard_gamma)
def standard_gamma(alpha, generator=None):
    dtype = out_dtype()
    log_g = _log_standard_gamma(_float32(alpha), _gamma_bits(alpha.shape))
    return _clamped_to_tiny(lax.exp(log_g), dtype)  # eager: at least the smallest normal of the dtype


@register_lowering(aten._sample_dirichlet)
def sample_dirichlet(alpha, generator=None):
    """Normalized Gamma samples, as a softmax of their logs; each in [tiny, 1 - ulp] as in eager."""
    dtype = out_dtype()
    log_g = _log_standard_gamma(_float32(alpha), _gamma_bits(alpha.shape))
    log_g = jnp.maximum(log_g, jnp.float32(_LOG_DBL_MIN))  # eager: a zero concentration gives DBL_MIN
    shifted = lax.exp(log_g - jnp.max(log_g, axis=-1, keepdims=True))
    x = convert(shifted / jnp.sum(shifted, axis=-1, keepdims=True), dtype)
    below_one = jnp.asarray(np.nextafter(np.float32(1), np.float32(0)), _F32)
    return jnp.minimum(_clamped_to_tiny(x, dtype), convert(below_one, dtype))


# ---------------------------------------------------------------------------------------------------------
# Reparameterized gradients: d sample / d concentration, from eager's approximations.


def _gamma_grad_small_x(alpha: Any, x: Any) -> Any:
    """``-(dF/dalpha) / pdf`` from the Taylor series of the lower incomplete gamma (x < 0.8). The series'
    first terms (``1/alpha``, ``1/alpha**2``) are kept apart, with ``digamma(alpha) = digamma(alpha + 1) -
    1/alpha``, because their ``1/alpha**2`` parts cancel (eager sums them in float64); ``x**alpha / pdf`` is
    ``x e**x``, used as such so that neither power underflows."""
    numer, denom = jnp.ones_like(x), alpha
    tail1, tail2 = jnp.zeros_like(x), jnp.zeros_like(x)
    for i in range(1, 6):
        numer = numer * (-x / jnp.float32(i))
        denom = denom + 1
        tail1 = tail1 + numer / denom
        tail2 = tail2 + numer / (denom * denom)
    log_ratio = lax.log(x) - lax.digamma(alpha + 1)
    cdf_alpha = log_ratio / alpha + log_ratio * tail1 + tail1 / alpha - tail2  # / x**alpha
    result = -cdf_alpha * x * lax.exp(x)
    return jnp.where(jnp.isnan(result), jnp.float32(0), result)


def _gamma_grad_large_alpha(alpha: Any, x: Any) -> Any:
    """Rice's saddle-point expansion (alpha > 8); a polynomial within 10% of the mean, where the expansion
    is singular. The polynomial is divided by alpha**4 term by term (its float32 product would overflow);
    ``x - alpha - alpha log(x / alpha)`` is ``alpha`` times the deficit of ``log1p`` at ``(x - alpha) /
    alpha``, computed without cancellation (eager: in float64)."""
    r = x / alpha
    rel = (x - alpha) / alpha
    inv = 1 / alpha
    near = (inv * inv + 24 * inv + 288) * (1440 + 6 * r * (53 * inv - 120 * r) - 65 * r * r * inv
                                           + 107 * inv + 3600 * r) / jnp.float32(1244160)  # fmt: skip
    denom = lax.sqrt(8 * alpha)
    term2 = denom / (alpha - x)
    term3 = jnp.power(alpha * log1p_deficit(rel), -1.5)
    term23 = jnp.where(x < alpha, term2 - term3, term2 + term3)
    term1 = lax.log1p(rel) * term23 - lax.sqrt(2 * inv) * (alpha + x) / ((alpha - x) * (alpha - x))
    stirling = 1 + inv / 12 * (1 + inv / 24)
    far = -stirling * x * term1 / denom
    return jnp.where((0.9 * alpha <= x) & (x <= 1.1 * alpha), near, far)


# exp(p(u, v) / q(u, v)), u = log(x / alpha), v = log(alpha): coefficients of p and q (cubic in v) for the
# powers 1, u, u**2, as fitted by Jankowiak and Obermeyer and used by eager.
_GAMMA_GRAD_P = np.array([[0.16009398, -0.094634809, 0.025146376, -0.0030648343],
                          [0.53487893, 0.1298071, 0.065735949, -0.0015649758],
                          [0.040121004, -0.0065914022, -0.0026286047, -0.0013441777]])  # fmt: skip
_GAMMA_GRAD_Q = np.array([[1, 0.32668115, 0.10406089, 0.0014179084],
                          [0.16639465, 0.020070113, -0.0035938915, -0.00058392623],
                          [0.017050642, -0.0021309326, 0.00085092367, -1.5247877e-07]])  # fmt: skip


def _polynomial(coefficients: Any, x: Any) -> Any:
    """sum_i coefficients[i] * x**i (Horner), for coefficients that are arrays or numbers."""
    result = jnp.zeros_like(x) + coefficients[-1]
    for c in coefficients[-2::-1]:
        result = result * x + c
    return result


def _bivariate(table: np.ndarray, u: Any, v: Any) -> Any:
    """sum_ij table[i, j] u**i v**j."""
    return _polynomial([_polynomial([jnp.float32(c) for c in row], v) for row in table], u)


def _gamma_grad_rational(alpha: Any, x: Any) -> Any:
    u, v = lax.log(x / alpha), lax.log(alpha)
    return lax.exp(_bivariate(_GAMMA_GRAD_P, u, v) / _bivariate(_GAMMA_GRAD_Q, u, v))


@register_lowering(aten._standard_gamma_grad)
def standard_gamma_grad(alpha, x):
    """d x / d alpha for ``x ~ Gamma(alpha, 1)``, holding the sample's CDF value fixed."""
    dtype = out_dtype()
    alpha, x = _float32(alpha), _float32(x)
    alpha, x = jnp.broadcast_arrays(alpha, x)
    larger_x = jnp.where(alpha > 8, _gamma_grad_large_alpha(alpha, x), _gamma_grad_rational(alpha, x))
    grad = jnp.where(x < 0.8, _gamma_grad_small_x(alpha, x), larger_x)
    return convert(grad, dtype)


def _digamma_difference(x: Any, d: Any) -> Any:
    """``digamma(x + d) - digamma(x)`` for x > 0, d >= 0, without the cancellation of a difference of two
    float32 digammas (a few ulps each, against a difference that is small when d is): both shifted by 10
    (``digamma(z) = digamma(z + 10) - sum_{i<10} 1 / (z + i)``), then the asymptotic series' terms
    differenced in closed form (``y + d`` may round to ``y``)."""
    shifted = jnp.zeros_like(x)
    for i in range(10):
        shifted = shifted + d / ((x + i) * (x + d + i))
    y, y_d = x + 10, x + d + 10
    a, b = 1 / (y_d * y_d), 1 / (y * y)
    delta2 = -d * (y + y_d) * a * b  # a - b
    series = delta2 * (jnp.float32(1 / 12) - (a + b) / jnp.float32(120) + (a * a + a * b + b * b) / jnp.float32(252))
    return shifted + lax.log1p(d / y) + d / (2 * y * y_d) - series


def _beta_grad_alpha_small_x(x: Any, alpha: Any, beta: Any) -> Any:
    """d x / d alpha for ``x ~ Beta(alpha, beta)`` near 0 (Taylor series, 11 terms)."""
    factor = -_digamma_difference(alpha, beta) - lax.log(x)
    numer = jnp.ones_like(x)
    series = numer / alpha * (factor + 1 / alpha)
    for i in range(1, 11):
        numer = numer * (jnp.float32(i) - beta) * x / jnp.float32(i)
        denom = alpha + jnp.float32(i)
        series = series + numer / denom * (factor + 1 / denom)
    result = x * lax.pow(1 - x, -beta) * series
    return jnp.where(jnp.isnan(result), jnp.float32(0), result)


def _beta_grad_beta_small_x(x: Any, alpha: Any, beta: Any) -> Any:
    """d x / d beta for ``x ~ Beta(alpha, beta)`` near 0 (Taylor series, 9 terms)."""
    factor = _digamma_difference(beta, alpha)
    numer, betas, dbetas = jnp.ones_like(x), jnp.ones_like(x), jnp.zeros_like(x)
    series = factor / alpha
    for i in range(1, 9):
        numer = numer * (-x / jnp.float32(i))
        dbetas = dbetas * (beta - jnp.float32(i)) + betas
        betas = betas * (beta - jnp.float32(i))
        series = series + numer / (alpha + jnp.float32(i)) * (dbetas + factor * betas)
    result = -lax.pow(1 - x, 1 - beta) * series
    return jnp.where(jnp.isnan(result), jnp.float32(0), result)


def _beta_grad_alpha_mid(x: Any, alpha: Any, beta: Any) -> Any:
    """d x / d alpha for ``x ~ Beta(alpha, beta)`` with both large (Rice saddle point; a polynomial within a
    tenth of a standard deviation of the mean, where the expansion is singular). Its terms nearly cancel
    each other outside that tenth, so each is computed from ``e = x - mean`` without cancellation of its own
    (eager computes them in float64): ``t x - alpha = t e``, ``log(alpha / (t x)) = -log1p(e / mean)``, and
    ``beta log(beta / (t (1 - x))) + alpha log(alpha / (t x))`` as a sum of two non-negative deficits."""
    total = alpha + beta
    mean, mean_complement = alpha / total, beta / total
    e = jnp.where(x <= 0.5, x - mean, mean_complement - (1 - x))  # the smaller side is the more exact
    std = lax.sqrt(alpha * beta / (total + 1)) / total
    b2 = beta * beta
    poly = 47 * x * b2 * b2 + alpha * (
        (43 + 20 * (16 + 27 * beta) * x) * b2 * beta
        + alpha
        * (
            3 * (59 + 180 * beta - 90 * x) * b2
            + alpha * ((453 + 1620 * beta * (1 - x) - 455 * x) * beta + alpha * (8 * (1 - x) * (135 * beta - 11)))
        )
    )
    prefactor_num = (1 + 12 * alpha) * (1 + 12 * beta) / (total * total)
    prefactor_den = 12960 * alpha * alpha * alpha * b2 * (1 + 12 * total)
    near = prefactor_num / (1 - x) * poly / prefactor_den

    prefactor = -x / lax.sqrt(2 * alpha * beta / total)
    stirling = ((1 + 1 / (12 * alpha) + 1 / (288 * alpha * alpha)) * (1 + 1 / (12 * beta) + 1 / (288 * b2))
                / (1 + 1 / (12 * total) + 1 / (288 * total * total)))  # fmt: skip
    axbx = total * e
    term1 = ((2 * alpha * alpha * (x - 1) + alpha * beta * (x - 1) - x * b2)
             / (lax.sqrt(2 * alpha / beta) * jnp.power(total, 1.5) * axbx * axbx))  # fmt: skip
    term2 = -0.5 * lax.log1p(e / mean)
    term3 = lax.sqrt(8 * alpha * beta / total) / axbx
    kl = alpha * log1p_deficit(e / mean) + beta * log1p_deficit(-e / mean_complement)
    term4 = jnp.power(kl, -1.5)
    far = stirling * prefactor * (term1 + term2 * (term3 + jnp.where(x < mean, term4, -term4)))
    return jnp.where((mean - 0.1 * std <= x) & (x <= mean + 0.1 * std), near, far)


# A rational correction p / q to x (digamma(total) - digamma(alpha)) / beta, p and q polynomials in
# u = log x, a = log alpha - u (each up to squared) and b = log total - a (cubic), as fitted by Jankowiak
# and Obermeyer and used by eager: _DIRICHLET_GRAD[0] holds p's coefficients [u power][a power][b power],
# _DIRICHLET_GRAD[1] q's.
_DIRICHLET_GRAD = np.array([
    [[[1.003668233, -0.01061107488, -0.0657888334, 0.01201642863],
      [0.6336835991, -0.3557432599, 0.05486251648, -0.001465281033],
      [-0.03276231906, 0.004474107445, 0.002429354597, -0.0001557569013]],
     [[0.221950385, -0.3187676331, 0.01799915743, 0.01074823814],
      [-0.2951249643, 0.06219954479, 0.01535556598, 0.001550077057],
      [0.02155310298, 0.004170831599, 0.001292462449, 6.976601077e-05]],
     [[-0.05980841433, 0.008441916499, 0.01085618172, 0.002319392565],
      [0.02911413504, 0.01400243777, -0.002721828457, 0.000751041181],
      [0.005900514878, -0.001936558688, -9.495446725e-06, 5.385558597e-05]]],
    [[[1, -0.02924021934, -0.04438342661, 0.007285809825],
      [0.6357567472, -0.3473456711, 0.05454656494, -0.002407477521],
      [-0.03301322327, 0.004845219414, 0.00231480583, -0.0002307248149]],
     [[0.5925320577, -0.1757678135, 0.01505928619, 0.000564515273],
      [0.1014815858, -0.06589186703, 0.01272886114, -0.0007316646956],
      [-0.007258481865, 0.001096195486, 0.0003934994223, -4.12701925e-05]],
     [[0.06469649321, -0.0236701437, 0.002902096474, -5.896963079e-05],
      [0.001925008108, -0.002869809258, 0.0008000589141, -6.063713228e-05],
      [-0.0003477407336, 6.959756487e-05, 1.097287507e-05, -1.650964693e-06]]],
])  # fmt: skip


def _trivariate(table: np.ndarray, u: Any, a: Any, b: Any) -> Any:
    return _polynomial([_bivariate(table_u, a, b) for table_u in table], u)


def _beta_grad_rational(x: Any, alpha: Any, total: Any) -> Any:
    u = lax.log(x)
    a = lax.log(alpha) - u
    b = lax.log(total) - a
    approx = x * _digamma_difference(alpha, total - alpha) / (total - alpha)
    return _trivariate(_DIRICHLET_GRAD[0], u, a, b) / _trivariate(_DIRICHLET_GRAD[1], u, a, b) * approx


@register_lowering(aten._dirichlet_grad)
def dirichlet_grad(x, alpha, total):
    """``-(dF/dalpha) / pdf / (1 - x)`` for ``x ~ Beta(alpha, total - alpha)``: what ``Dirichlet.rsample``'s
    backward scales the incoming gradient by (torch.distributions.dirichlet._Dirichlet_backward)."""
    dtype = out_dtype()
    x, alpha, total = jnp.broadcast_arrays(_float32(x), _float32(alpha), _float32(total))
    beta = total - alpha
    boundary = total * x * (1 - x)
    grad = jnp.where(
        (x <= 0.5) & (boundary < 2.5), _beta_grad_alpha_small_x(x, alpha, beta),
        jnp.where((x >= 0.5) & (boundary < 0.75), -_beta_grad_beta_small_x(1 - x, beta, alpha),
                  jnp.where((alpha > 6) & (beta > 6), _beta_grad_alpha_mid(x, alpha, beta),
                            _beta_grad_rational(x, alpha, total))))  # fmt: skip
    return convert(grad, dtype)


# ---------------------------------------------------------------------------------------------------------
# Poisson: eager's two methods (numpy's): a product of uniforms below rate 10, Hormann's transformed
# rejection (PTRS) from 10 on.


def _count_by_inversion(pmf: list[Any], u: Any) -> Any:
    """``#{k : u < P(X > k)}`` for a count X with ``P(X = k) = pmf[k - 1]`` (k >= 1) and ``u`` uniform in
    (0, 1]: each tail summed from its far end, so that a tail probability below ``u``'s resolution is never
    reached by rounding (a sum of the pmf from 0 would round to 1 - 2**-24 or below and give absurd counts
    about once in 2**24 draws)."""
    tail, count = jnp.zeros_like(u), jnp.zeros_like(u)
    for k in range(len(pmf) - 1, -1, -1):  # tail = P(X > k) = sum of pmf[k + 1 ..]
        tail = tail + pmf[k]
        count = count + (u < tail).astype(_F32)
    return count


def _poisson_by_inversion(rate: Any, u: Any) -> Any:
    pmf, term = [], lax.exp(-rate)
    for k in range(1, _INVERSION_TERMS + 1):
        term = term * rate / jnp.float32(k)
        pmf.append(term)
    return _count_by_inversion(pmf, u)


def _poisson_log_pmf(k: Any, rate: Any) -> Any:
    """``-rate + k log(rate) - log k!`` for rate >= 10, as ``-bd0(k, rate) - log(2 pi k) / 2 -
    stirling_error(k)``: the direct form cancels terms of order ``k log k``."""
    log_pmf = -bd0(k, rate) - jnp.float32(0.5) * lax.log(jnp.float32(2 * np.pi) * k) - stirling_error(k)
    return jnp.where(k == 0, -rate, log_pmf)


def _poisson_by_ptrs(rate: Any, u: Any, v: Any) -> Any:
    """Hormann's PTRS with eager's constants; ``u``, ``v``: ``_POISSON_CANDIDATES`` uniforms each, in [0, 1)."""
    b = jnp.float32(0.931) + jnp.float32(2.53) * lax.sqrt(rate)
    a = jnp.float32(-0.059) + jnp.float32(0.02483) * b
    inv_alpha = jnp.float32(1.1239) + jnp.float32(1.1328) / (b - jnp.float32(3.4))
    v_r = jnp.float32(0.9277) - jnp.float32(3.6224) / (b - 2)
    u = u - jnp.float32(0.5)
    us = jnp.float32(0.5) - jnp.abs(u)
    k = jnp.floor((2 * a / us + b) * u + rate + jnp.float32(0.43))
    fast = (us >= 0.07) & (v <= v_r)
    rejected = (k < 0) | ((us < 0.013) & (v > us))
    bound = lax.log(v) + lax.log(inv_alpha) - lax.log(a / (us * us) + b)
    accepted = fast | (~rejected & (bound <= _poisson_log_pmf(jnp.maximum(k, 0), rate)))
    return _first_accepted(jnp.maximum(k, 0), accepted)


@register_lowering(aten.poisson)
def poisson(rates, generator=None):
    """Counts as floats of the rates' dtype (float32 arithmetic: exact counts up to 2**24). Eager's refusal
    of a negative or NaN rate is raised after the graph (value_checks)."""
    dtype = out_dtype()
    rate = _float32(rates)
    n = _POISSON_CANDIDATES
    bits = random_bits((2 * n + 1, *rates.shape))
    small_rate = jnp.where(rate < 10, rate, jnp.float32(1))  # each branch sees rates it is defined for
    large_rate = jnp.where(rate < 10, jnp.float32(10), rate)
    by_inversion = _poisson_by_inversion(small_rate, _uniforms_open_closed(bits[2 * n]))
    by_ptrs = _poisson_by_ptrs(large_rate, uniform01(bits[:n], _F32), uniform01(bits[n : 2 * n], _F32))
    count = jnp.where(rate < 10, by_inversion, by_ptrs)
    count = jnp.where(rate == 0, jnp.float32(0), count)
    return convert(jnp.where(rate == jnp.inf, rate, count), dtype)


# ---------------------------------------------------------------------------------------------------------
# Binomial: eager's two methods (TensorFlow's): inversion while count * p < 10, Hormann's BTRS from 10 on,
# both on min(p, 1 - p) (a draw for 1 - p is count minus one for p).


def _binomial_by_inversion(count: Any, p: Any, u: Any) -> Any:
    """Inversion with the pmf by its recurrence ``pmf(k) = pmf(k - 1) (count - k + 1) / k * p / (1 - p)``
    (eager adds geometric variables: the same distribution)."""
    odds = p / (1 - p)
    pmf, term = [], lax.exp(count * lax.log1p(-p))
    for k in range(1, _INVERSION_TERMS + 1):
        term = term * jnp.maximum(count - (k - 1), 0) / jnp.float32(k) * odds
        pmf.append(term)
    return _count_by_inversion(pmf, u)


def _binomial_log_pmf(k: Any, count: Any, p: Any) -> Any:
    """``log(C(count, k) p**k (1 - p)**(count - k))`` for 0 <= k <= count, in Loader's saddle-point form
    (stirling errors and ``bd0`` deviances: no cancellation of ``count log count`` sized terms)."""
    q = 1 - p
    rest = count - k
    safe_k, safe_rest = jnp.maximum(k, 1), jnp.maximum(rest, 1)
    log_pmf = (stirling_error(count) - stirling_error(safe_k) - stirling_error(safe_rest)
               - bd0(safe_k, count * p) - bd0(safe_rest, count * q)
               + jnp.float32(0.5) * lax.log(count / (jnp.float32(2 * np.pi) * safe_k * safe_rest)))  # fmt: skip
    return jnp.where(k == 0, count * lax.log1p(-p), jnp.where(rest == 0, count * lax.log(p), log_pmf))


def _binomial_by_btrs(count: Any, p: Any, u: Any, v: Any) -> Any:
    """Hormann's BTRS with eager's constants, for count * p >= 10 and p <= 1/2; ``u``, ``v``:
    ``_BINOMIAL_CANDIDATES`` uniforms each, in [0, 1). Its ratio test compares with ``log(pmf(k) /
    pmf(mode))``, which eager writes with Stirling tails and computes here from ``_binomial_log_pmf``."""
    stddev = lax.sqrt(count * p * (1 - p))
    b = jnp.float32(1.15) + jnp.float32(2.53) * stddev
    a = jnp.float32(-0.0873) + jnp.float32(0.0248) * b + jnp.float32(0.01) * p
    c = count * p + jnp.float32(0.5)
    v_r = jnp.float32(0.92) - jnp.float32(4.2) / b
    alpha = (jnp.float32(2.83) + jnp.float32(5.1) / b) * stddev
    mode = jnp.floor((count + 1) * p)
    u = u - jnp.float32(0.5)
    us = jnp.float32(0.5) - jnp.abs(u)
    k = jnp.floor((2 * a / us + b) * u + c)
    inside = (k >= 0) & (k <= count)
    k_in = jnp.clip(k, 0, count)
    fast = (us >= 0.07) & (v <= v_r)
    ratio = _binomial_log_pmf(k_in, count, p) - _binomial_log_pmf(mode, count, p)
    accepted = inside & (fast | (lax.log(v * alpha / (a / (us * us) + b)) <= ratio))
    return _first_accepted(k_in, accepted)


@register_lowering(aten.binomial)
def binomial(counts, probs, generator=None):
    """Successes as floats of the counts' dtype (float32 arithmetic: exact up to 2**24). As eager: 0 for a
    count <= 0 or p <= 0, the count for p >= 1, NaN for a NaN p."""
    dtype = out_dtype()
    count, prob = jnp.broadcast_arrays(_float32(counts), _float32(probs))
    flipped = prob > 0.5
    p = jnp.where(flipped, 1 - prob, prob)
    p = jnp.where((p > 0) & (count > 0), p, jnp.float32(0.25))  # each branch sees values it is defined for
    n = _BINOMIAL_CANDIDATES
    bits = random_bits((2 * n + 1, *count.shape))
    small = count * p < 10
    by_inversion = _binomial_by_inversion(jnp.where(small, count, 1), p, _uniforms_open_closed(bits[2 * n]))
    by_btrs = _binomial_by_btrs(jnp.where(small, 40 / p, count), p, uniform01(bits[:n], _F32),
                                uniform01(bits[n : 2 * n], _F32))  # fmt: skip
    draws = jnp.where(small, by_inversion, by_btrs)
    draws = jnp.where(flipped, count - draws, draws)
    draws = jnp.where((count <= 0) | (prob <= 0), jnp.float32(0), jnp.where(prob >= 1, count, draws))
    return convert(jnp.where(jnp.isnan(prob), prob, draws), dtype)
