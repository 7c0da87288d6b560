"""Samplers that eager runs as rejection loops (Gamma, Dirichlet/Beta, Poisson, Binomial) and their reparameterized
gradients (lowering/distributions.py). The compiled stream is not eager's, so samples are compared with
eager's in distribution: a two-sample Kolmogorov-Smirnov distance below its 1e-6 significance bound, under a
fixed seed. Gradients are compared with eager's float64 values, and training through ``rsample`` with the
analytic gradient of an expectation."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import distributions as D

from neuron_compile.lowering import distributions, stable_forms

N = 20000
# Two samples of N: P(distance > 2.69 * sqrt(2 / N)) < 1e-6 when both come from one distribution.
KS_BOUND = 2.69 * (2 / N) ** 0.5


def _compiled(fn):
    return torch.compile(fn, backend="neuron", dynamic=False)


def ks_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest gap between the empirical CDFs of two samples (ties and atoms allowed)."""
    a, b = a.double().flatten().sort().values, b.double().flatten().sort().values
    points = torch.cat([a, b]).unique()
    cdf_a = torch.searchsorted(a, points, right=True).double() / a.numel()
    cdf_b = torch.searchsorted(b, points, right=True).double() / b.numel()
    return float((cdf_a - cdf_b).abs().max())


_standard_gamma = _compiled(lambda alpha: torch._standard_gamma(alpha))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("alpha", [0.01, 0.3, 1.0, 4.5, 1000.0, 1e6])
def test_gamma_samples_match_eager_in_distribution(alpha, dtype) -> None:
    """Below 1 through the boost (and, at 0.01, 42% of the mass clamped to the smallest normal, as in
    eager); 1e6 exercises the acceptance test's cancellation. Eager's CPU kernel has no bfloat16: the
    bfloat16 reference is its float32 sample, rounded."""
    torch.manual_seed(0)
    concentration = torch.full((N,), alpha, dtype=dtype)
    got = _standard_gamma(concentration)
    expected = torch._standard_gamma(concentration.float()).to(dtype)
    assert got.dtype == dtype and got.min() > 0 and got.isfinite().all()
    assert ks_distance(got, expected) < KS_BOUND, f"Gamma({alpha}) {dtype}"


_dirichlet = _compiled(lambda c: D.Dirichlet(c).sample())


@pytest.mark.parametrize("concentration", [[0.01, 0.01, 0.01], [0.5, 1.0, 2.0], [300.0, 20.0, 1.0]])
def test_dirichlet_samples_match_eager_in_distribution(concentration) -> None:
    """Every marginal; rows sum to 1. At 0.01 nearly all mass sits on one component (eager: each other one
    clamped to the smallest normal)."""
    torch.manual_seed(0)
    c = torch.tensor(concentration).expand(N, 3).contiguous()
    got = _dirichlet(c)
    expected = D.Dirichlet(c).sample()
    torch.testing.assert_close(got.double().sum(-1), torch.ones(N, dtype=torch.float64), rtol=0, atol=1e-6)
    for i in range(3):
        assert ks_distance(got[:, i], expected[:, i]) < KS_BOUND, f"Dirichlet({concentration}) marginal {i}"


_poisson = _compiled(lambda rate: torch.poisson(rate))


@pytest.mark.parametrize("rate", [0.001, 0.5, 3.0, 9.99, 10.0, 40.0, 1e4, 1e6])
def test_poisson_samples_match_eager_in_distribution(rate) -> None:
    """Inversion below rate 10, transformed rejection from 10 on (1e6: the log-pmf's cancellation)."""
    torch.manual_seed(0)
    got = _poisson(torch.full((N,), rate))
    expected = torch.poisson(torch.full((N,), rate, dtype=torch.float64))
    assert (got == got.round()).all() and got.min() >= 0
    assert ks_distance(got, expected) < KS_BOUND, f"Poisson({rate})"


_binomial = _compiled(lambda count, p: torch.binomial(count, p))


@pytest.mark.parametrize(
    "count, p", [(10, 0.3), (5, 0.99), (100, 0.1), (20, 0.5), (40, 0.75), (1e4, 0.3), (1e6, 0.001), (1e6, 0.5)]
)
def test_binomial_samples_match_eager_in_distribution(count, p) -> None:
    """Inversion below a mean of 10, BTRS from 10 on (20 x 1/2: its lowest acceptance rate), on min(p, 1 - p)."""
    torch.manual_seed(0)
    got = _binomial(torch.full((N,), float(count)), torch.full((N,), p))
    float64 = {"dtype": torch.float64}
    expected = torch.binomial(torch.full((N,), float(count), **float64), torch.full((N,), p, **float64))
    assert (got == got.round()).all() and got.min() >= 0 and got.max() <= count
    assert ks_distance(got, expected) < KS_BOUND, f"Binomial({count}, {p})"


def test_binomial_edge_cases_as_eager() -> None:
    count = torch.tensor([0.0, -2.0, 10.0, 10.0, 3.0, 7.0])
    p = torch.tensor([0.5, 0.5, 0.0, 1.0, float("nan"), -0.1])
    torch.testing.assert_close(_compiled(torch.binomial)(count, p), torch.binomial(count, p), equal_nan=True)


@pytest.mark.parametrize("rates", [[1.0, -0.5], [float("nan"), 2.0]], ids=["negative", "nan"])
def test_poisson_refuses_invalid_rates_as_eager(rates) -> None:
    with pytest.raises(RuntimeError, match="invalid Poisson rate") as eager:
        torch.poisson(torch.tensor(rates))
    with pytest.raises(RuntimeError) as compiled:
        _compiled(lambda r: torch.poisson(r) + 1)(torch.tensor(rates))
    assert str(compiled.value) == str(eager.value)
    assert "aten.poisson" in "".join(compiled.value.__notes__)


def _gamma_grad_cases() -> tuple[torch.Tensor, ...]:
    """Concentrations from 1e-3 to 1e5 (every branch of eager's approximation), samples from each."""
    torch.manual_seed(0)
    alpha = torch.logspace(-3, 5, 200)[:, None].expand(200, 100).contiguous()
    x = torch._standard_gamma(alpha)  # float32: at least the smallest normal
    return x, alpha


def _dirichlet_grad_cases() -> tuple[torch.Tensor, ...]:
    """Beta(alpha, beta) samples for alpha, beta from 1e-2 to 1e3 (every branch)."""
    torch.manual_seed(0)
    grid = torch.logspace(-2, 3, 40)
    a, b = (t.reshape(-1, 1).expand(-1, 20).contiguous() for t in torch.meshgrid(grid, grid, indexing="ij"))
    x = torch._sample_dirichlet(torch.stack([a, b], -1))[..., 0]
    return x, a, a + b


@pytest.mark.parametrize(
    "op, cases",
    [
        (lambda x, alpha: torch._standard_gamma_grad(alpha, x), _gamma_grad_cases),
        (lambda x, alpha, total: torch._dirichlet_grad(x, alpha, total), _dirichlet_grad_cases),
    ],
    ids=["_standard_gamma_grad", "_dirichlet_grad"],
)
def test_reparameterized_gradients_match_eager(op, cases) -> None:
    """Against eager in float64: within 4x eager float32's own error (its small-x series run in float32)
    plus 1e-4 relative. The 1e-4: eager computes the Rice expansions in float64; in float32 their terms,
    each computed without cancellation, still cancel each other about a hundredfold (measured: <= 4.3e-5)."""
    inputs = cases()
    got = _compiled(op)(*inputs).double()
    reference = op(*(t.double() for t in inputs))
    eager32 = op(*inputs).double()
    allowed = 4 * (eager32 - reference).abs() + 1e-4 * reference.abs()
    bad = (got - reference).abs() > allowed
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.numel()} off, first at inputs "
        f"{[float(t.flatten()[bad.flatten().nonzero()[0]]) for t in inputs]}: "
        f"{float(got[bad][0])} vs eager {float(reference[bad][0])}"
    )


def _beta_second_moment(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * (a + 1) / ((a + b) * (a + b + 1))


def _gamma_second_moment(a: torch.Tensor, rate: torch.Tensor) -> torch.Tensor:
    return a * (a + 1) / rate**2


@pytest.mark.parametrize(
    "name, sample, moment, params",
    [
        pytest.param("Gamma", lambda a, r: D.Gamma(a, r).rsample(), _gamma_second_moment, (2.5, 1.5), id="Gamma"),
        pytest.param("Gamma", lambda a, r: D.Gamma(a, r).rsample(), _gamma_second_moment, (0.4, 1.0),
                     id="Gamma_below_1"),
        pytest.param("Beta", lambda a, b: D.Beta(a, b).rsample(), _beta_second_moment, (2.0, 5.0), id="Beta"),
        pytest.param("Beta", lambda a, b: D.Beta(a, b).rsample(), _beta_second_moment, (40.0, 15.0),
                     id="Beta_large"),
        pytest.param("Dirichlet", lambda a, b: D.Dirichlet(torch.stack([a, b, b], -1)).rsample()[:, 0],
                     lambda a, b: _beta_second_moment(a, 2 * b), (0.7, 1.3), id="Dirichlet"),
    ],
)  # fmt: skip
def test_rsample_gradients_estimate_the_analytic_gradient(name, sample, moment, params) -> None:
    """Training through ``rsample``: per sample, the gradient of x**2 by each parameter (forward and backward
    compiled). Their mean estimates the gradient of E[x**2], known in closed form; within 5 standard errors."""
    torch.manual_seed(0)
    leaves = [torch.full((N,), p, requires_grad=True) for p in params]

    def per_sample_grads(*ps):
        (sample(*ps) ** 2).sum().backward()

    _compiled(per_sample_grads)(*leaves)
    exact = torch.tensor(params, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(moment(*exact.unbind()), exact)[0]
    for p, leaf, want in zip(params, leaves, expected.tolist()):
        g = leaf.grad.double()
        assert g.isfinite().all()
        mean, se = float(g.mean()), float(g.std()) / N**0.5
        assert abs(mean - want) < 5 * se, f"{name}{params}: d E[x^2] / d {p}: {mean} +- {se} vs {want}"


def _float64(fn, *args):
    import jax

    with jax.enable_x64():
        return np.asarray(fn(*(jnp.asarray(a, jnp.float64) for a in args)))


@pytest.mark.parametrize(
    "helper, args",
    [
        ("_poisson_log_pmf", lambda: _around_the_mean([10.0, 1e3, 1e6, 1e7])),
        ("_binomial_log_pmf", lambda: _binomial_around_the_mean([(20, 0.5), (1e4, 0.3), (1e6, 0.001), (1e7, 0.5)])),
        ("log1p_remainder", lambda: (np.concatenate([-np.logspace(-6, -0.05, 50), np.logspace(-6, 1, 50)]),)),
        ("log1p_deficit", lambda: (np.concatenate([-np.logspace(-6, -0.05, 50), np.logspace(-6, 1, 50)]),)),
        ("_digamma_difference", lambda: tuple(np.meshgrid(np.logspace(-3, 4, 30), np.logspace(-6, 3, 30)))),
    ],
)  # fmt: skip
def test_float32_helpers_do_not_cancel(helper, args) -> None:
    """The quantities the samplers and gradients would lose to cancellation in float32, against the same
    code in float64: within 4e-6 relative (~32 float32 ulps; where the forms switch from series to direct,
    the direct ones cancel up to ~50-fold). The plain float32 forms are off by far more (measured):
    ``-rate + k log(rate) - log(k!)`` at rate 1e6 by 0.17 (absolute, in a log-probability the acceptance test
    compares), ``log1p(t) - t + t**2/2 - t**3/3`` at t = 1e-2 by 6%, ``digamma(x + d) - digamma(x)`` from two
    float32 digammas by up to 17 times its value (d = 1e-6)."""
    fn = getattr(distributions, helper, None) or getattr(stable_forms, helper)
    inputs = args()
    got = np.asarray(fn(*(jnp.asarray(a, jnp.float32) for a in inputs)), np.float64)
    reference = _float64(fn, *inputs)
    scale = np.maximum(np.abs(reference), np.finfo(np.float32).tiny)
    worst = np.max(np.abs(got - reference) / scale)
    assert worst < 4e-6, f"{helper}: relative error {worst:.2e}"


def _around_the_mean(rates: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """Counts k within 6 standard deviations of each rate (where PTRS's acceptance test looks), and the rate."""
    k, rate = [], []
    for r in rates:
        ks = np.round(r + np.sqrt(r) * np.linspace(-6, 6, 41))
        k.append(ks[ks >= 0])
        rate.append(np.full(k[-1].shape, r))
    return np.concatenate(k), np.concatenate(rate)


def _binomial_around_the_mean(cases: list[tuple[float, float]]) -> tuple[np.ndarray, ...]:
    k, count, p = [], [], []
    for n, q in cases:
        ks = np.round(n * q + np.sqrt(n * q * (1 - q)) * np.linspace(-6, 6, 41))
        k.append(np.clip(ks, 0, n))
        count.append(np.full(ks.shape, n))
        p.append(np.full(ks.shape, q))
    return np.concatenate(k), np.concatenate(count), np.concatenate(p)
