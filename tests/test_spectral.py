"""Symmetric eigendecomposition, SVD and pseudoinverse by Jacobi sweeps (lowering/spectral.py) against eager.

Values (eigenvalues, singular values, and everything sign-invariant built from vectors: reconstructions,
projectors, pinv, whitening, norms) are compared with eager's float32 result and, where they differ by more
than float32's tolerance, judged against the float64 result: no further from it than ``ACCURACY`` times
eager's own error plus a few ulps of the matrix's norm. Vectors themselves are unique only up to sign (and
a basis of a repeated value's space), so they are checked by what defines them: A V = V diag(w) with V
orthonormal, A = U diag(S) Vh with U and V orthonormal (the completed columns of ``full_matrices`` too),
and, where the values are well separated, |V| against eager's |V|.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

from neuron_compile.errors import NeuronUnsupportedOpError
from neuron_compile.lowering import spectral
from tests.util import root_cause

#: A lowering family niche on Trainium (no native linalg/FFT units): CI's extended job (pyproject.toml's markers).
pytestmark = pytest.mark.extended

la = torch.linalg
EPS = torch.finfo(torch.float32).eps
#: How much further from the float64 result than eager's float32 result ours may be.
ACCURACY = 4.0


def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    torch._dynamo.reset()  # one graph per case: no recompile limit across the parametrization
    return torch.compile(lambda *args: fn(*args), backend="neuron", fullgraph=True, dynamic=False)


# ---- inputs ----------------------------------------------------------------------------------------------
def _orthogonal(n: int, seed: int) -> torch.Tensor:
    return la.qr(torch.randn(2, n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)).Q


def _with_values(values: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A batch of two symmetric matrices Q diag(values) Q^T (float32)."""
    q = _orthogonal(values.shape[-1], seed)
    return ((q * values.double()) @ q.mT).float()


def _symmetric(kind: str, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    if kind == "random":
        return torch.randn(2, n, n, generator=g)  # only one triangle is read
    if kind == "clustered":  # a third at -3, the rest within 1e-6 of 1
        values = 1 + 1e-6 * torch.randn(n, generator=g, dtype=torch.float64)
        values[: n // 3] = -3
        return _with_values(values)
    if kind == "graded":
        return _with_values(torch.logspace(-7, 3, n, dtype=torch.float64))
    if kind == "low_rank":
        b = torch.randn(2, n, min(3, n), generator=g)
        return b @ b.mT
    if kind == "repeated":
        return 2 * torch.eye(n).expand(2, n, n).clone()
    if kind == "zero":
        return torch.zeros(2, n, n)
    raise ValueError(kind)


def _general(kind: str, m: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(m * 100 + n)
    if kind == "random":
        return torch.randn(2, m, n, generator=g)
    if kind == "graded":  # columns scaled from 1 down to 1e-6: singular values over six decades
        return torch.randn(2, m, n, generator=g) * torch.logspace(0, -6, n)
    if kind == "rank_deficient":  # two exact zero columns and a repeated one: exact zero singular values
        a = torch.randn(2, m, n, generator=g)
        a[..., :, 0] = 0
        a[..., :, -1] = a[..., :, 1]
        if n > 3:
            a[..., :, 2] = 0
        return a
    if kind == "zero":
        return torch.zeros(2, m, n)
    raise ValueError(kind)


def _value_bound(eager: torch.Tensor, reference: torch.Tensor, scale: torch.Tensor, n: int) -> float:
    return ACCURACY * float((eager.double() - reference).abs().max()) + 8 * n * EPS * float(scale.max())


# ---- eigh ------------------------------------------------------------------------------------------------
EIGH_CASES = [
    (kind, n, uplo)
    for kind in ("random", "clustered", "graded", "low_rank", "repeated", "zero")
    for n in (1, 4, 7, 32)
    for uplo in ("L", "U")
    if uplo == "L" or kind == "random"
] + [("random", 65, "L"), ("graded", 128, "L")]


@pytest.mark.parametrize("kind,n,uplo", EIGH_CASES, ids=[f"{k}-{n}-{u}" for k, n, u in EIGH_CASES])
def test_eigh_matches_eager(kind: str, n: int, uplo: str) -> None:
    a = _symmetric(kind, n)
    w, v = _compiled(lambda x: la.eigh(x, UPLO=uplo))(a)
    w_eager, v_eager = la.eigh(a, UPLO=uplo)
    w_ref, _ = la.eigh(a.double(), UPLO=uplo)
    symmetric = (a.tril() + a.tril(-1).mT) if uplo == "L" else (a.triu() + a.triu(1).mT)
    scale = la.matrix_norm(symmetric.double(), ord=2)
    where = f"eigh({kind} float32[2, {n}, {n}], UPLO={uplo})"
    error = float((w.double() - w_ref).abs().max())
    assert error <= _value_bound(w_eager, w_ref, scale, n), f"{where}: eigenvalues {error:.3g} from float64"
    residual = (symmetric.double() @ v.double() - v.double() * w.double()[..., None, :]).abs().max()
    assert residual <= 16 * n * EPS * float(scale.max()) + 1e-30, f"{where}: |A V - V diag(w)| = {residual:.3g}"
    orthogonality = (v.double().mT @ v.double() - torch.eye(n, dtype=torch.float64)).abs().max()
    assert orthogonality <= 16 * n * EPS, f"{where}: |V^T V - I| = {orthogonality:.3g}"
    if kind == "random":  # distinct, well-separated eigenvalues: each vector is unique up to sign
        torch.testing.assert_close(v.abs(), v_eager.abs(), atol=2e-4 * n, rtol=0, msg=f"{where}: |V| vs eager")


# ---- svd -------------------------------------------------------------------------------------------------
SVD_CASES = [
    (kind, m, n, full)
    for kind, m, n in [
        ("random", 1, 1), ("random", 4, 4), ("random", 7, 3), ("random", 3, 7), ("random", 33, 6),
        ("graded", 9, 9), ("rank_deficient", 6, 6), ("rank_deficient", 8, 5), ("rank_deficient", 4, 7),
        ("zero", 3, 5),
    ]
    for full in (False, True)
]  # fmt: skip


@pytest.mark.parametrize("kind,m,n,full", SVD_CASES, ids=[f"{k}-{m}x{n}-full={f}" for k, m, n, f in SVD_CASES])
def test_svd_matches_eager(kind: str, m: int, n: int, full: bool) -> None:
    a = _general(kind, m, n)
    u, s, vh = _compiled(lambda x: la.svd(x, full_matrices=full))(a)
    u_eager, s_eager, vh_eager = la.svd(a, full_matrices=full)
    s_ref = la.svdvals(a.double())
    k = min(m, n)
    where = f"svd({kind} float32[2, {m}, {n}], full_matrices={full})"
    assert (u.shape, s.shape, vh.shape) == (u_eager.shape, s_eager.shape, vh_eager.shape), where
    scale = s_ref[..., :1]
    error = float((s.double() - s_ref).abs().max())
    assert error <= _value_bound(s_eager, s_ref, scale, max(m, n)), f"{where}: singular values {error:.3g} off"
    assert bool((s[..., :-1] >= s[..., 1:]).all()), f"{where}: singular values not descending"
    rebuilt = (u[..., :, :k].double() * s.double()[..., None, :]) @ vh[..., :k, :].double()
    residual = (rebuilt - a.double()).abs().max()
    assert residual <= 16 * max(m, n) * EPS * float(scale.max()) + 1e-30, f"{where}: |U S Vh - A| = {residual:.3g}"
    for name, q in (("U^T U", u.double().mT @ u.double()), ("Vh Vh^T", vh.double() @ vh.double().mT)):
        gap = (q - torch.eye(q.shape[-1], dtype=torch.float64)).abs().max()
        assert gap <= 16 * max(m, n) * EPS, f"{where}: |{name} - I| = {gap:.3g}"
    if kind == "zero":  # no direction is determined: eager's identity, as OpInfo's subgradients at zero expect
        assert torch.equal(u, u_eager) and torch.equal(vh, vh_eager), f"{where}: U, Vh of a zero matrix"
    if kind == "random":
        torch.testing.assert_close(u[..., :k].abs(), u_eager[..., :k].abs(), atol=2e-4 * m, rtol=0, msg=where)
        torch.testing.assert_close(vh[..., :k, :].abs(), vh_eager[..., :k, :].abs(), atol=2e-4 * n, rtol=0, msg=where)


def test_small_singular_values_keep_their_relative_accuracy() -> None:
    """One-sided Jacobi works on the columns themselves, so singular values of a column-graded matrix keep
    their relative accuracy down to 1e-6 of the largest (eager's bidiagonal LAPACK, float32: only relative
    to the largest)."""
    a = _general("graded", 12, 8)
    s = _compiled(la.svdvals)(a)
    relative = ((s.double() - la.svdvals(a.double())) / la.svdvals(a.double())).abs().max()
    assert relative <= 64 * EPS, f"svdvals(column-graded float32[2, 12, 8]): relative error {relative:.3g}"


# ---- what users build on them, forward and backward -------------------------------------------------------
def _whiten(x: torch.Tensor) -> torch.Tensor:
    """ZCA whitening of features (x: samples x features), as in self-supervised losses."""
    centered = x - x.mean(0)
    w, v = la.eigh(centered.mT @ centered / x.shape[0] + 1e-3 * torch.eye(x.shape[1]))
    return centered @ (v * w.rsqrt()) @ v.mT


def _low_rank(x: torch.Tensor) -> torch.Tensor:
    u, s, vh = la.svd(x, full_matrices=False)
    return (u[:, :2] * s[:2]) @ vh[:2]


def _spectral_weights(x: torch.Tensor) -> torch.Tensor:
    w, v = la.eigh(x + x.mT)
    return (v**2 * torch.arange(1.0, x.shape[-1] + 1)).sum(-1) + w  # sign-invariant in v


USES: list[tuple[str, Callable[..., torch.Tensor], tuple[int, ...]]] = [
    ("eigvalsh", lambda x: la.eigvalsh(x + x.mT), (5, 5)),
    ("eigh squared vectors", _spectral_weights, (5, 5)),
    ("svdvals", la.svdvals, (6, 4)),
    ("matrix_norm(2)", lambda x: la.matrix_norm(x, ord=2), (4, 6)),
    ("matrix_norm(nuc)", lambda x: la.matrix_norm(x, ord="nuc"), (5, 5)),
    ("cond", la.cond, (5, 5)),
    ("pinv", la.pinv, (6, 4)),
    ("pinv(hermitian)", lambda x: la.pinv(x @ x.mT + torch.eye(x.shape[0]), hermitian=True), (4, 4)),
    ("pinv(rtol=0.3)", lambda x: la.pinv(x, rtol=0.3), (5, 3)),
    ("pinv of a rank-3 matrix", lambda x: la.pinv(x * torch.tensor([1.0, 0, 1, 0, 1])), (4, 5)),
    ("least squares by pinv", lambda x: la.pinv(x) @ torch.arange(6.0)[:, None], (6, 3)),
    ("ZCA whitening", _whiten, (16, 4)),
    ("rank-2 approximation", _low_rank, (6, 5)),
    ("spectral norm at zero (subgradient)", lambda x: la.matrix_norm(0 * x, ord=2), (4, 3)),
    ("nuclear norm at zero (subgradient)", lambda x: la.matrix_norm(0 * x, ord="nuc"), (3, 4)),
]


@pytest.mark.parametrize("name,fn,shape", USES, ids=[u[0] for u in USES])
def test_uses_match_eager_forward_and_backward(
    name: str, fn: Callable[..., torch.Tensor], shape: tuple[int, ...]
) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(len(name)))
    x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = fn(x_eager)
    actual = _compiled(fn)(x_compiled)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4, msg=f"{name}(float32{list(shape)})")
    cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    expected.backward(cotangent)
    actual.backward(cotangent)
    torch.testing.assert_close(x_compiled.grad, x_eager.grad, rtol=1e-3, atol=1e-3, msg=f"grad of {name}")


def test_matrix_rank_counts_as_eager() -> None:
    a = _general("rank_deficient", 8, 6)  # rank 3 in both batch elements
    assert torch.equal(_compiled(la.matrix_rank)(a), la.matrix_rank(a))
    hermitian_rank = lambda x: la.matrix_rank(x @ x.mT, hermitian=True)  # noqa: E731
    assert torch.equal(_compiled(hermitian_rank)(a), hermitian_rank(a))


# ---- what is refused, and the convergence guard -----------------------------------------------------------
@pytest.mark.parametrize(
    "fn,shape,message",
    [
        (la.eigh, (129, 129), "orders up to 128"),
        (la.svdvals, (200, 129), "orders up to 128"),
        (la.svd, (200, 3), "orders up to 128"),  # full_matrices: U is 200 x 200
        (la.eigvalsh, (4, 4), "cast the operands to float32"),
    ],
    ids=["eigh-129", "svdvals-129", "svd-full-200", "eigvalsh-bfloat16"],
)
def test_refused_with_the_reason(fn: Callable[..., Any], shape: tuple[int, ...], message: str) -> None:
    x = torch.randn(*shape, dtype=torch.bfloat16 if "bfloat16" in message or "cast" in message else torch.float32)
    with pytest.raises(BackendCompilerFailed) as info:
        _compiled(fn)(x)
    error = root_cause(info.value)
    assert isinstance(error, NeuronUnsupportedOpError) and message in str(error), str(error)


def test_reduced_svd_of_a_tall_matrix_is_not_limited_by_its_rows() -> None:
    a = torch.randn(200, 3, generator=torch.Generator().manual_seed(3))
    u, s, vh = _compiled(lambda x: la.svd(x, full_matrices=False))(a)
    torch.testing.assert_close((u * s) @ vh, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sweeps", [0, 1])
def test_a_lane_that_has_not_converged_is_nan(monkeypatch: pytest.MonkeyPatch, sweeps: int) -> None:
    """Too few sweeps for a random 32 x 32 matrix: NaN in that batch element only, never a wrong number."""
    monkeypatch.setattr(spectral, "_sweeps", lambda n: sweeps)
    a = np.stack([np.random.default_rng(0).standard_normal((32, 32)), np.diag(np.arange(32.0))]).astype(np.float32)
    w, v = spectral.eigh_f32(jnp.asarray(a))
    _, s, _ = spectral.svd_f32(jnp.asarray(a), compute_uv=True, full_matrices=False)
    for name, out in (("eigenvalues", w), ("eigenvectors", v), ("singular values", s)):
        assert bool(jnp.isnan(out[0]).all()), f"{name} of an unconverged lane after {sweeps} sweeps"
        assert not bool(jnp.isnan(out[1]).any()), f"{name} of an already diagonal lane"


NON_FINITE = [
    ("eigvalsh", la.eigvalsh, "linalg.eigh: "),
    ("eigh", la.eigh, "linalg.eigh: "),
    ("svdvals", la.svdvals, "linalg.svd: "),
    ("svd", la.svd, "linalg.svd: "),
    ("pinv", la.pinv, "linalg.svd: "),
    ("pinv(hermitian)", lambda x: la.pinv(x, hermitian=True), "linalg.eigh: "),
]


@pytest.mark.parametrize("name,fn,message", NON_FINITE, ids=[n for n, _, _ in NON_FINITE])
def test_non_finite_input_raises_eagers_error(name: str, fn: Callable[..., Any], message: str) -> None:
    """Eager's LAPACK does not converge on NaN and raises LinAlgError; so does the compiled call (a value check
    on its NaN result), naming the op. Finite inputs in the same graph are unaffected."""
    a = torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(0))
    a[1, 1, 2] = a[1, 2, 1] = a[2, 0, 0] = float("nan")  # eager names the first failing batch element
    with pytest.raises(torch.linalg.LinAlgError) as eager:
        fn(a)
    compiled = _compiled(fn)
    with pytest.raises(torch.linalg.LinAlgError, match=message) as ours:
        compiled(a)
    # word for word, but for LAPACK's error code at the end of eager's eigh message
    assert str(ours.value) == re.sub(r" \(error code: \d+\)", "", str(eager.value)), name
    assert "neuron backend: a check of aten." in "".join(getattr(ours.value, "__notes__", [])), name
    a[1, 1, 2] = a[1, 2, 1] = a[2, 0, 0] = 0.0
    if name in ("eigvalsh", "svdvals", "pinv"):  # finite again: no error, eager's values
        torch.testing.assert_close(compiled(a), fn(a), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hermitian", [False, True])
def test_pinv_drops_singular_values_at_rounding_level(hermitian: bool) -> None:
    """A rank-2 product of float32 matrices has its other singular values at rounding level: eager's default
    rtol (eps * max(m, n)) drops them, so pinv stays bounded, as compiled."""
    g = torch.Generator().manual_seed(5)
    b = torch.randn(6, 2, generator=g)
    a = b @ (b.mT if hermitian else torch.randn(2, 5, generator=g))
    expected = la.pinv(a, hermitian=hermitian)
    actual = _compiled(lambda x: la.pinv(x, hermitian=hermitian))(a)
    assert float(expected.abs().max()) < 10, "the example must exercise the default tolerance"
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4, msg=f"pinv(rank-2, hermitian={hermitian})")
