"""Op families, random ops: shape, dtype, range, statistics and reproducibility under torch.manual_seed.

Random streams are the compiled RNG's, not eager's: they are checked in distribution, against eager's ranges and statistics.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from neuron_compile.lowering import lower_graph

from .lowering_cases import (
    BF16,
    F32,
    TOL,
    run_aten,
)


# ---- random ---------------------------------------------------------------------------------------------------------
def _compiled(fn):
    return torch.compile(fn, backend="neuron", dynamic=False)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
def test_rand_randn_statistics(dtype) -> None:
    # Bounds are 5 standard errors of each statistic (plus bf16 rounding), under a fixed seed.
    torch.manual_seed(0)
    x = torch.zeros(256, 64, dtype=dtype)
    u, z, zl = _compiled(
        lambda t: (torch.rand(256, 64, dtype=dtype), torch.randn(256, 64, dtype=dtype), torch.randn_like(t))
    )(x)
    for t in (u, z, zl):
        assert t.dtype == dtype and t.shape == (256, 64)
    assert 0 <= u.min() and u.max() < 1, "rand must lie in [0, 1)"
    u, z, zl = u.float(), z.float(), zl.float()
    n = u.numel()
    assert abs(u.mean() - 0.5) < 5 * (1 / 12 / n) ** 0.5 + 4e-3, f"rand mean {u.mean()}"
    assert abs(u.var() - 1 / 12) < 5 * (1 / 180 / n) ** 0.5 + 1e-3, f"rand var {u.var()}"
    for t in (z, zl):
        assert abs(t.mean()) < 5 / n**0.5 + 4e-3, f"randn mean {t.mean()}"
        assert abs(t.std() - 1) < 5 / (2 * n) ** 0.5 + 4e-3, f"randn std {t.std()}"
        assert abs((t**4).mean() - 3) < 5 * (96 / n) ** 0.5, f"randn kurtosis {(t**4).mean()}"
    assert not torch.equal(z, zl), "two random nodes must draw different streams"


def test_uniform_normal_bernoulli_exponential_randint() -> None:
    torch.manual_seed(0)  # bounds below are >= 4 standard errors of each statistic

    def fn(x):
        return (
            x.detach().clone().uniform_(-2.0, 3.0),
            x.detach().clone().normal_(1.5, 0.5),
            torch.normal(x, 2.0),
            torch.bernoulli(torch.full_like(x, 0.3)),
            x.detach().clone().bernoulli_(0.8),
            x.detach().clone().exponential_(2.0),
            torch.randint(3, 11, (128, 64)),
            torch.randint_like(x, 5),
        )

    x = torch.zeros(128, 64)
    uni, nor, nor_t, ber, ber_p, expo, ri, ril = _compiled(fn)(x)
    assert uni.min() >= -2 and uni.max() < 3 and abs(uni.mean() - 0.5) < 0.05
    assert abs(nor.mean() - 1.5) < 0.02 and abs(nor.std() - 0.5) < 0.01
    assert abs(nor_t.mean()) < 0.06 and abs(nor_t.std() - 2) < 0.04
    assert set(ber.unique().tolist()) <= {0.0, 1.0} and abs(ber.mean() - 0.3) < 0.02
    assert abs(ber_p.mean() - 0.8) < 0.02
    assert expo.min() >= 0 and abs(expo.mean() - 0.5) < 0.02
    assert ri.dtype == torch.int64 and ri.min() == 3 and ri.max() == 10
    assert abs(ri.float().mean() - 6.5) < 0.1
    assert ril.dtype == torch.float32 and set(ril.unique().tolist()) == {0.0, 1.0, 2.0, 3.0, 4.0}


@pytest.mark.parametrize("form", ["cpu", "neuron"])
def test_random_bits_per_target_form(form) -> None:
    """The neuron form draws uint32 generator words (neuronx-cc truncates 64-bit integers), the CPU form
    uint64 words split in two (XLA CPU makes them ~4x faster per bit); both give the same distributions:
    uniform mean and variance, normal moments, dropout's keep rate, each within 5 standard errors."""

    def draws(x):
        return torch.rand_like(x), torch.randn_like(x), torch.native_dropout(x, 0.3, True)[1]

    x = torch.zeros(300, 200)
    words = [line for line in lower_graph(make_fx(draws)(x), [x], "rng", target=form).stablehlo().splitlines()
             if "rng_bit_generator" in line]  # fmt: skip
    assert words and all(("xui32>)" in w) == (form == "neuron") for w in words), words
    torch.manual_seed(0)
    uniform, normal, keep = run_aten(draws, [x], form=form)
    n = x.numel()
    assert abs(float(uniform.mean()) - 0.5) < 5 * (1 / 12 / n) ** 0.5
    assert abs(float(uniform.var()) - 1 / 12) < 5 * (1 / 180 / n) ** 0.5
    assert abs(float(normal.mean())) < 5 / n**0.5 and abs(float(normal.var()) - 1) < 5 * (2 / n) ** 0.5
    assert abs(float(normal.pow(4).mean()) - 3) < 5 * (96 / n) ** 0.5
    assert abs(float(keep.float().mean()) - 0.7) < 5 * (0.21 / n) ** 0.5
    pairs = uniform.flatten().view(-1, 2) - 0.5  # the two halves of one 64-bit word on the CPU form
    assert abs(float((pairs[:, 0] * pairs[:, 1]).mean() * 12)) < 5 / (n / 2) ** 0.5  # correlation


def test_randperm_is_a_permutation() -> None:
    torch.manual_seed(0)
    x = torch.arange(50.0)
    out = _compiled(lambda t: t[torch.randperm(50)])(x)
    assert sorted(out.tolist()) == x.tolist() and not torch.equal(out, x)


MULTINOMIAL_WEIGHTS = torch.tensor([0.1, 0.2, 0.7, 0.0])


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
def test_multinomial_without_replacement_draws_ordered_pairs_in_proportion(dtype) -> None:
    """Two draws without replacement: pair (a, b) comes first-a-then-b with probability w_a * w_b / (1 - w_a);
    the zero-weight category is never drawn. 20,000 rows: each frequency within 4 standard errors."""
    torch.manual_seed(0)
    n = 20000
    draws = _compiled(lambda w: torch.multinomial(w, 2))(MULTINOMIAL_WEIGHTS.to(dtype).expand(n, 4).contiguous())
    assert draws.shape == (n, 2) and draws.dtype == torch.int64
    assert (draws[:, 0] != draws[:, 1]).all() and (draws != 3).all()
    w = MULTINOMIAL_WEIGHTS.double()
    for a in range(3):
        for b in range(3):
            if a != b:
                expected = float(w[a] * w[b] / (1 - w[a]))
                seen = float(((draws[:, 0] == a) & (draws[:, 1] == b)).double().mean())
                assert abs(seen - expected) < 4 * (expected * (1 - expected) / n) ** 0.5, f"pair ({a}, {b})"


def test_multinomial_with_replacement_and_categorical_sample() -> None:
    """With replacement, every sample is an independent draw in proportion to the weights; a policy's
    ``Categorical(logits=...).sample()`` (multinomial of one) compiles and draws the same way."""
    torch.manual_seed(0)
    rows = MULTINOMIAL_WEIGHTS.expand(4000, 4).contiguous()
    draws = _compiled(lambda w: torch.multinomial(w, 5, replacement=True))(rows)
    assert draws.shape == (4000, 5)
    sampled = _compiled(lambda lg: torch.distributions.Categorical(logits=lg).sample())(rows.log())
    for got in (draws.flatten(), sampled):
        freq = torch.bincount(got, minlength=4).double() / got.numel()
        se = (MULTINOMIAL_WEIGHTS.double() * (1 - MULTINOMIAL_WEIGHTS.double()) / got.numel()).sqrt()
        assert ((freq - MULTINOMIAL_WEIGHTS.double()).abs() <= 4 * se + 1e-12).all(), freq


def test_multinomial_uniforms_stay_inside_the_open_interval() -> None:
    """The Gumbel key -log(-log u) of every 32-bit draw is finite: a u of exactly 1.0 (what a 24-bit grid's
    last midpoint rounds to in float32) made an infinite key, NaN against a zero weight's -inf, and top-k
    took the NaN for the largest: a zero-weight category drawn about once per 16 million keys."""
    import jax.numpy as jnp
    import numpy as np

    from neuron_compile.lowering.random import uniform_open

    bits = np.array([0, 1, 511, 512, 2**31, 2**32 - 513, 2**32 - 512, 2**32 - 1], dtype=np.uint32)
    u = np.asarray(uniform_open(jnp.asarray(bits)), dtype=np.float64)
    assert ((u > 0) & (u < 1)).all(), u
    assert np.isfinite(-np.log(-np.log(u.astype(np.float32)))).all()


@pytest.mark.parametrize(
    "weights",
    [[[0.2, float("nan"), 0.5]], [[0.2, -0.1, 0.5]], [[0.2, float("inf"), 0.5]], [[0.2, 0.3, 0.5], [0.0, 0.0, 0.0]]],
    ids=["nan", "negative", "inf", "zero_row"],
)
def test_multinomial_refuses_invalid_weights_as_eager(weights) -> None:
    """Eager raises on such weights; the graph cannot, so the check runs after it (value_checks) with eager's
    message, where the sampler alone would draw arbitrary categories."""
    w = torch.tensor(weights)
    with pytest.raises(RuntimeError) as expected:
        torch.multinomial(w, 1)
    with pytest.raises(RuntimeError) as got:
        _compiled(lambda t: torch.multinomial(t, 1))(w)
    assert str(got.value) == str(expected.value)


def test_random_reproducible_under_manual_seed() -> None:
    fn = _compiled(lambda t: t + torch.rand(4, 5) + F.dropout(torch.ones(4, 5), 0.5) + torch.multinomial(t + 1, 5))
    x = torch.zeros(4, 5)
    torch.manual_seed(123)
    a = fn(x)
    b = fn(x)
    torch.manual_seed(123)
    c = fn(x)
    assert torch.equal(a, c), "torch.manual_seed must make compiled random ops reproducible"
    assert not torch.equal(a, b), "each call must draw fresh random numbers"


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
def test_native_dropout_mask_output_and_grad_agree(dtype) -> None:
    torch.manual_seed(0)
    p = 0.3
    x = (torch.randn(64, 128) + 3).to(dtype).requires_grad_(True)  # never 0: a dropped element is visible
    out = _compiled(lambda t: F.dropout(t, p, training=True))(x)
    kept = out != 0
    frac = kept.float().mean().item()
    assert abs(frac - (1 - p)) < 0.02, f"kept fraction {frac}"
    expected = (x.detach().float() * (1 / (1 - p))).to(dtype)
    torch.testing.assert_close(out[kept], expected[kept], rtol=TOL["exact"][dtype][0], atol=0)
    g = torch.randn(64, 128).to(dtype)
    out.backward(g)
    torch.testing.assert_close(
        x.grad, torch.where(kept, (g.float() / (1 - p)).to(dtype), 0), rtol=TOL["exact"][dtype][0], atol=0
    )


def test_dropout_eval_is_identity() -> None:
    x = torch.randn(8, 8)
    out = _compiled(lambda t: F.dropout(t, 0.5, training=False) * 1.0)(x)
    assert torch.equal(out, x)
