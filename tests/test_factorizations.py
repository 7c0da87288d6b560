"""Linear-algebra factorizations (lowering/factorizations.py) and torch.linalg's error checks
(neuron_compile/value_checks.py) against eager.

Every op is compiled with ``torch.compile(backend="neuron", fullgraph=True)``, which also runs the legality
pass. Inputs: batched and unbatched, empty, well-conditioned, ill-conditioned (condition number 1e4),
exactly singular (a repeated row) and, for Cholesky, not positive-definite. Integer outputs (pivots, info)
must equal eager's; floating outputs must match eager as the OpInfo harness decides (within float32's
tolerance, or else no further from the float64 result than 2x eager's own error plus one ulp), with inf
and NaN exactly where eager has them (a singular inverse is inf/NaN in eager's pattern).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.utils._pytree as pytree
from torch._dynamo.exc import BackendCompilerFailed

from neuron_compile.errors import NeuronUnsupportedOpError
from neuron_compile.lowering import factorizations as F
from tests.support import opinfo_harness as H
from tests.util import root_cause

#: A lowering family niche on Trainium (no native linalg/FFT units): CI's extended job (pyproject.toml's markers).
pytestmark = pytest.mark.extended

la = torch.linalg


# ---- inputs -----------------------------------------------------------------------------------------------
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def general(batch: tuple[int, ...], n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*batch, n, n, generator=_gen(seed))


def ill(batch: tuple[int, ...], n: int, seed: int = 0) -> torch.Tensor:
    """Condition number 1e4: Q1 diag(logspace(0, -4)) Q2 with random orthogonal Q1, Q2."""
    q1 = la.qr(torch.randn(*batch, n, n, generator=_gen(seed), dtype=torch.float64)).Q
    q2 = la.qr(torch.randn(*batch, n, n, generator=_gen(seed + 1), dtype=torch.float64)).Q
    s = torch.logspace(0, -4, n, dtype=torch.float64)
    return ((q1 * s) @ q2).float()


def singular(batch: tuple[int, ...], n: int, seed: int = 0) -> torch.Tensor:
    """Exactly singular: the last row repeats the first and the last column the first, so elimination of A
    (lu_factor, inv, solve) and of A^T (det, slogdet factor A^T) both meet an exact zero pivot, whatever the
    rounding. (A matrix that is singular only in exact arithmetic gives a tiny pivot instead, in eager by
    luck of its own rounding or not, and so may differ in info, sign and the inf/NaN pattern.)"""
    a = general(batch, n, seed)
    a[..., -1, :] = a[..., 0, :]
    a[..., :, -1] = a[..., :, 0]
    return a


def spd(batch: tuple[int, ...], n: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(*batch, n, n, generator=_gen(seed))
    return x @ x.mT + n * torch.eye(n)


def not_pd(batch: tuple[int, ...], n: int, seed: int = 0) -> torch.Tensor:
    """Symmetric, positive-definite except for a negative diagonal entry in the middle."""
    a = spd(batch, n, seed)
    a[..., n // 2, n // 2] = -1.0
    return a


def triangular_ok(batch: tuple[int, ...], n: int, seed: int = 0) -> torch.Tensor:
    """Both triangles with a dominant diagonal (a random triangular matrix is hopelessly ill-conditioned)."""
    return general(batch, n, seed) + 2 * n * torch.eye(n)


def rhs(batch: tuple[int, ...], n: int, k: int = 3, seed: int = 7) -> torch.Tensor:
    return torch.randn(*batch, n, k, generator=_gen(seed))


# ---- comparison -------------------------------------------------------------------------------------------
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    torch._dynamo.reset()  # one graph per case: no recompile limit across the parametrization
    return torch.compile(lambda *args: fn(*args), backend="neuron", fullgraph=True, dynamic=False)


def _describe(args: tuple[Any, ...]) -> str:
    return ", ".join(f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)}" for a in args)


def assert_matches_eager(name: str, fn: Callable[..., Any], args: tuple[torch.Tensor, ...]) -> None:
    expected = fn(*args)
    actual = _compiled(fn)(*args)
    reference = lambda: fn(*(a.double() if a.is_floating_point() else a for a in args))  # noqa: E731
    bad = H.compare(actual, expected, "output", reference=reference)
    assert bad is None, f"{name}({_describe(args)}): {bad}"


# ---- forward: (name, function, input builder) -------------------------------------------------------------
def _factor(kind: Callable[..., torch.Tensor]) -> Callable[..., tuple[torch.Tensor, ...]]:
    return lambda batch, n: (kind(batch, n),)


def _with_rhs(kind: Callable[..., torch.Tensor]) -> Callable[..., tuple[torch.Tensor, ...]]:
    return lambda batch, n: (kind(batch, n), rhs(batch, n))


def _chol_rhs(upper: bool) -> Callable[..., tuple[torch.Tensor, ...]]:
    return lambda batch, n: (rhs(batch, n), la.cholesky(spd(batch, n), upper=upper))


def _lu_rhs(kind: Callable[..., torch.Tensor], right: bool = False) -> Callable[..., tuple[torch.Tensor, ...]]:
    def build(batch: tuple[int, ...], n: int) -> tuple[torch.Tensor, ...]:
        lu, piv, _ = la.lu_factor_ex(kind(batch, n))
        b = rhs(batch, n)
        return lu, piv, (b.mT if right else b)

    return build


FORWARD: list[tuple[str, Callable[..., Any], Callable[..., tuple[torch.Tensor, ...]]]] = [
    # stage 1: triangular solves and Cholesky
    *[(f"linalg.cholesky_ex(upper={u}) {k.__name__}", lambda a, u=u: la.cholesky_ex(a, upper=u), _factor(k))
      for u in (False, True) for k in (spd, not_pd)],
    *[(f"linalg.cholesky(upper={u})", lambda a, u=u: la.cholesky(a, upper=u), _factor(spd)) for u in (False, True)],
    *[(f"cholesky(upper={u})", lambda a, u=u: torch.cholesky(a, upper=u), _factor(spd)) for u in (False, True)],
    *[(f"cholesky_solve(upper={u})", lambda b, f, u=u: torch.cholesky_solve(b, f, upper=u), _chol_rhs(u))
      for u in (False, True)],
    *[(f"cholesky_inverse(upper={u})", lambda f, u=u: torch.cholesky_inverse(f, upper=u),
       lambda batch, n, u=u: (la.cholesky(spd(batch, n), upper=u),)) for u in (False, True)],
    *[(f"linalg.solve_triangular(upper={u}, left={left}, unitriangular={unit})",
       lambda a, b, u=u, left=left, unit=unit: la.solve_triangular(a, b if left else b.mT, upper=u, left=left,
                                                                      unitriangular=unit),
       _with_rhs(triangular_ok)) for u in (False, True) for left in (True, False) for unit in (False, True)],
    *[(f"triangular_solve(upper={u}, transpose={t})",
       lambda a, b, u=u, t=t: torch.triangular_solve(b, a, upper=u, transpose=t), _with_rhs(triangular_ok))
      for u in (False, True) for t in (False, True)],
    # stage 2: LU with partial pivoting and what is built on it
    *[(f"linalg.lu_factor_ex {k.__name__}", la.lu_factor_ex, _factor(k)) for k in (general, ill, singular)],
    *[(f"linalg.lu {k.__name__}", la.lu, _factor(k)) for k in (general, singular)],
    ("lu_unpack", lambda a: torch.lu_unpack(*la.lu_factor_ex(a)[:2]), _factor(general)),
    *[(f"linalg.lu_solve(left={left}, adjoint={adj})",
       lambda lu, p, b, left=left, adj=adj: la.lu_solve(lu, p, b, left=left, adjoint=adj),
       _lu_rhs(general, right=not left)) for left in (True, False) for adj in (False, True)],
    ("linalg.lu_solve ill", la.lu_solve, _lu_rhs(ill)),
    *[(f"linalg.det {k.__name__}", la.det, _factor(k)) for k in (general, ill, singular)],
    *[(f"linalg.slogdet {k.__name__}", la.slogdet, _factor(k)) for k in (general, singular)],
    ("logdet", torch.logdet, _factor(spd)),
    *[(f"linalg.inv_ex {k.__name__}", la.inv_ex, _factor(k)) for k in (general, ill, singular)],
    ("linalg.inv", la.inv, _factor(general)),
    *[(f"linalg.solve_ex {k.__name__}", la.solve_ex, _with_rhs(k)) for k in (general, ill, singular)],
    ("linalg.solve(left=False)", lambda a, b: la.solve(a, b.mT, left=False), _with_rhs(general)),
    ("linalg.solve vector", lambda a, b: la.solve(a, b[..., 0]), _with_rhs(general)),
    # stage 3: Householder QR (LAPACK's reflectors, so eager's signs); tall, wide, rank-deficient
    *[(f"linalg.qr(mode={mode}) {k.__name__}", lambda a, mode=mode: la.qr(a, mode=mode), _factor(k))
      for mode in ("reduced", "complete", "r") for k in (general, ill, singular)],
    *[(f"linalg.qr(mode={mode}) {shape}", lambda a, mode=mode: la.qr(a, mode=mode),
       lambda batch, n, shape=shape: (torch.randn(*batch, *shape, generator=_gen(3)),))
      for mode in ("reduced", "complete") for shape in ((7, 3), (3, 7), (200, 5))],
    ("linalg.qr zero columns", la.qr,
     lambda batch, n: (torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 3.0]]).expand(*batch, 3, 3),)),
    ("geqrf", torch.geqrf, lambda batch, n: (torch.randn(*batch, 5, 3, generator=_gen(4)),)),
    ("linalg.householder_product", la.householder_product,
     lambda batch, n: torch.geqrf(torch.randn(*batch, 5, 3, generator=_gen(4)))),
    *[(f"ormqr(left={left}, transpose={t})", lambda a, tau, c, left=left, t=t: torch.ormqr(a, tau, c, left, t),
       lambda batch, n, left=left: (*torch.geqrf(torch.randn(*batch, 5, 3, generator=_gen(4))),
                                    torch.randn(*batch, *((5, 2) if left else (2, 5)), generator=_gen(8))))
      for left in (True, False) for t in (False, True)],
]  # fmt: skip


@pytest.mark.parametrize("name,fn,build", FORWARD, ids=[row[0] for row in FORWARD])
def test_forward_matches_eager(name, fn, build) -> None:
    assert_matches_eager(name, fn, build((2,), 3))


#: Shapes beyond a plain batch: unbatched, 1 x 1, empty, and batch dims that broadcast between operands.
SHAPES = [((), 4), ((), 1), ((2,), 0), ((2, 1), 5)]
SHAPE_OPS = [row for row in FORWARD if row[0] in {
    "linalg.cholesky_ex(upper=False) spd", "linalg.solve_triangular(upper=True, left=False, unitriangular=False)",
    "linalg.lu_factor_ex general", "linalg.lu_solve(left=True, adjoint=True)", "linalg.solve_ex general",
    "linalg.det general",
}]  # fmt: skip


@pytest.mark.parametrize("batch,n", SHAPES, ids=[f"{list(b)}x{n}" for b, n in SHAPES])
@pytest.mark.parametrize("name,fn,build", SHAPE_OPS, ids=[row[0] for row in SHAPE_OPS])
def test_shapes_match_eager(name, fn, build, batch, n) -> None:
    assert_matches_eager(name, fn, build(batch, n))


def test_broadcast_batch_dims_match_eager() -> None:
    a, b = general((2, 1), 3), rhs((1, 4), 3)
    assert_matches_eager("linalg.solve", la.solve, (a, b))
    assert_matches_eager("linalg.solve_triangular", lambda x, y: la.solve_triangular(x, y, upper=False), (a, b))


@pytest.mark.parametrize("shape", [(3, 5), (2, 5, 3)], ids=str)
@pytest.mark.parametrize("name,fn", [("linalg.lu_factor_ex", la.lu_factor_ex), ("linalg.lu", la.lu)])
def test_rectangular_lu_matches_eager(name, fn, shape) -> None:
    assert_matches_eager(name, fn, (torch.randn(*shape, generator=_gen(3)),))


def test_pivot_ties_take_the_first_row_as_lapack() -> None:
    """Equal |values| in a column: the first such row is the pivot (idamax), so pivots and L, U equal eager's."""
    a = torch.tensor([[1.0, 2.0, 3.0], [-4.0, 1.0, 0.0], [4.0, 5.0, 1.0]])
    assert_matches_eager("linalg.lu_factor_ex", la.lu_factor_ex, (a,))
    assert_matches_eager("linalg.lu", la.lu, (a,))


# ---- gradients --------------------------------------------------------------------------------------------
GRADS: list[tuple[str, Callable[..., Any], Callable[..., tuple[torch.Tensor, ...]]]] = [
    ("linalg.cholesky", la.cholesky, _factor(spd)),
    ("cholesky_solve", torch.cholesky_solve, _chol_rhs(False)),
    ("cholesky_inverse", torch.cholesky_inverse, lambda batch, n: (la.cholesky(spd(batch, n)),)),
    ("linalg.solve_triangular", lambda a, b: la.solve_triangular(a, b, upper=True), _with_rhs(triangular_ok)),
    ("triangular_solve", lambda a, b: torch.triangular_solve(b, a)[0], _with_rhs(triangular_ok)),
    ("linalg.lu_factor", lambda a: la.lu_factor(a)[0], _factor(general)),
    ("linalg.lu", la.lu, _factor(general)),
    ("linalg.lu_solve", lambda a, b: la.lu_solve(*la.lu_factor(a), b), _with_rhs(general)),
    ("linalg.det", la.det, _factor(general)),
    ("linalg.slogdet", lambda a: la.slogdet(a)[1], _factor(general)),
    ("linalg.inv", la.inv, _factor(general)),
    ("linalg.solve", la.solve, _with_rhs(general)),
    ("linalg.qr", la.qr, _factor(general)),
    ("linalg.qr tall", la.qr, lambda batch, n: (torch.randn(*batch, 7, n, generator=_gen(5)),)),
    (
        "linalg.householder_product",
        la.householder_product,
        lambda batch, n: torch.geqrf(torch.randn(*batch, 6, n, generator=_gen(6))),
    ),
]


@pytest.mark.parametrize("name,fn,build", GRADS, ids=[row[0] for row in GRADS])
def test_gradients_match_eager(name, fn, build) -> None:
    args = build((2,), 4)

    def grads(f: Callable[..., Any], inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        outs = [o for o in pytree.tree_leaves(f(*leaves)) if isinstance(o, torch.Tensor) and o.requires_grad]
        cot = [torch.randn(o.shape, generator=_gen(11)) for o in outs]
        return list(torch.autograd.grad(outs, leaves, cot))

    expected = grads(fn, args)
    actual = grads(_compiled(fn), args)
    reference = lambda: grads(fn, tuple(a.double() for a in args))  # noqa: E731
    bad = H.compare(actual, expected, "grad", reference=reference)
    assert bad is None, f"{name}({_describe(args)}): {bad}"


# ---- torch.linalg's error checks run after the graph -------------------------------------------------------
ERRORS = [
    ("linalg.cholesky", la.cholesky, not_pd((2,), 4)),
    ("cholesky", torch.cholesky, not_pd((2,), 4)),
    ("cholesky(upper=True)", lambda a: torch.cholesky(a, upper=True), not_pd((), 4)),
    ("linalg.inv", la.inv, singular((), 4)),
    ("linalg.solve", lambda a: la.solve(a, torch.ones(4)), singular((), 4)),
    ("linalg.lu_factor", la.lu_factor, singular((), 4)),
]


@pytest.mark.parametrize("name,fn,a", ERRORS, ids=[row[0] for row in ERRORS])
def test_linalg_errors_raise_as_in_eager(name, fn, a) -> None:
    with pytest.raises(RuntimeError) as eager:
        fn(a)
    with pytest.raises(RuntimeError) as compiled:
        _compiled(fn)(a)
    assert type(compiled.value) is type(eager.value), f"{name}: {compiled.value!r}"
    assert str(compiled.value) == str(eager.value)


def test_linalg_checks_pass_on_valid_input() -> None:
    a = spd((2,), 4)
    torch.testing.assert_close(_compiled(la.cholesky)(a), la.cholesky(a))


# ---- refusals ---------------------------------------------------------------------------------------------
def _unsupported(fn: Callable[..., Any], *args: torch.Tensor) -> NeuronUnsupportedOpError:
    with pytest.raises(BackendCompilerFailed) as info:
        _compiled(fn)(*args)
    err = root_cause(info.value)
    assert isinstance(err, NeuronUnsupportedOpError), repr(err)
    return err


def test_order_above_the_bound_is_refused_with_the_size() -> None:
    n = F.MAX_ORDER + 1
    err = _unsupported(la.lu_factor_ex, torch.randn(n, n))
    assert f"order {n}" in str(err) and "linalg_lu_factor_ex" in str(err)


def test_check_errors_in_the_graph_is_refused_with_the_fix() -> None:
    err = _unsupported(lambda a: la.cholesky_ex(a, check_errors=True), spd((), 3))
    assert "check_errors=True" in str(err) and "info" in str(err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_operands_are_refused_as_eager_refuses_them(dtype) -> None:
    a = general((), 3).to(dtype)
    with pytest.raises(RuntimeError, match="not implemented"):
        la.solve(a, a)
    err = _unsupported(la.solve, a, a)
    assert "_linalg_solve_ex" in str(err) and "float32" in str(err)


# ---- the claim the lowering rests on: pivoting without gather/scatter, loops or conditionals -----------------
@pytest.mark.parametrize("name,fn", [("lu", F.lu_f32), ("cholesky", F.cholesky_f32), ("qr", F.geqrf_f32)])
def test_factorization_hlo_has_no_data_dependent_addressing(name, fn) -> None:
    text = jax.jit(lambda a: fn(a)).lower(jax.ShapeDtypeStruct((2, 5, 5), jnp.float32)).as_text()
    for op in ("gather", "scatter", "while", "case", "if", "dynamic_slice", "dynamic_update_slice"):
        assert f"stablehlo.{op}" not in text, f"{name}: stablehlo.{op} in the module"


# ---- the matrix exponential (lowering/matrix_functions.py) -------------------------------------------------
def _matrix_exp_input(scale: float, n: int, kind: str) -> torch.Tensor:
    a = torch.randn(2, n, n, generator=_gen(7), dtype=torch.float64) * scale
    return a - a.mT if kind == "skew" else a  # skew-symmetric: a rotation, large norms without overflow


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    "scale, kind",
    [(0.0, "general"), (1e-3, "general"), (0.5, "general"), (3.0, "general"), (10.0, "general"), (1e3, "skew")],
    ids=["zero", "tiny", "no-squaring", "few-squarings", "more-squarings", "skew-1e3"],
)
@pytest.mark.parametrize("n", [1, 3, 8])
def test_matrix_exp_matches_float64(scale: float, kind: str, n: int, dtype: torch.dtype) -> None:
    """Scaling and squaring with a static squaring count, forward and gradient. float32: no further from
    the float64 exponential than eager's own result (compare_to_reference's rule). bfloat16 is computed in
    float32 and rounded once, so it must be within bfloat16's rounding of the float64 exponential of the
    same (bfloat16) input; eager's own bfloat16 kernel is no reference (NaN on several of these inputs)."""
    from neuron_compile.evaluate import compare_to_reference

    a64 = _matrix_exp_input(scale, n, kind)
    cotangent = torch.randn(a64.shape, generator=_gen(8), dtype=torch.float64)
    if dtype == torch.bfloat16:
        a64, cotangent = a64.bfloat16().double(), cotangent.bfloat16().double()

    def run(fn: Callable, dt: torch.dtype) -> dict[str, torch.Tensor]:
        a = a64.to(dt).requires_grad_()
        out = fn(a)
        (grad,) = torch.autograd.grad(out, a, cotangent.to(dt))
        return {"exp": out.detach(), "grad": grad}

    compiled = torch.compile(la.matrix_exp, backend="neuron", dynamic=False, fullgraph=True)
    reference, got = run(la.matrix_exp, torch.float64), run(compiled, dtype)
    what = f"matrix_exp {kind} x{scale} n={n} {dtype}"
    if dtype == torch.float32:
        verdict = compare_to_reference(reference, run(la.matrix_exp, dtype), got)
        assert verdict.ok, f"{what}: " + verdict.describe()
        return
    for name, ref in reference.items():
        error = (got[name].double() - ref).norm() / max(ref.norm().item(), 1e-30)
        assert error <= 2**-7, f"{what}: {name} relative error {error:.3g} > bfloat16's 2**-7"


def test_matrix_exp_past_the_static_squarings_is_nan_not_a_wrong_number() -> None:
    from neuron_compile.lowering.matrix_functions import MAX_SQUARINGS, THETA_18

    big = THETA_18 * 2.0**MAX_SQUARINGS * 4
    a = torch.tensor([[0.0, big], [-big, 0.0]])
    out = torch.compile(la.matrix_exp, backend="neuron", dynamic=False)(a)
    assert out.isnan().all(), out
    ok = torch.tensor([[0.0, 1e4], [-1e4, 0.0]])  # ~12 squarings: a rotation by 1e4 radians
    torch.testing.assert_close(torch.compile(la.matrix_exp, backend="neuron", dynamic=False)(ok),
                               la.matrix_exp(ok.double()).float(), rtol=0, atol=2e-3)  # fmt: skip


@pytest.mark.parametrize(
    "orthogonal_map, features", [("matrix_exp", (8, 8)), ("householder", (8, 5))], ids=["matrix_exp", "householder"]
)
def test_orthogonal_parametrization_trains_as_eager(orthogonal_map: str, features: tuple[int, int]) -> None:
    """``parametrizations.orthogonal``: its default map, the matrix exponential, and the "householder" map
    (geqrf-packed reflectors through ``householder_product``, a non-square weight), forward and backward."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.utils.parametrizations.orthogonal(torch.nn.Linear(*features), orthogonal_map=orthogonal_map)
    twin = copy.deepcopy(model)
    x = torch.randn(4, 8)
    model(x).pow(2).sum().backward()
    out = torch.compile(twin, backend="neuron", dynamic=False, fullgraph=True)(x)
    out.pow(2).sum().backward()
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"grad of {name}: {m}")
    weight = twin.weight.detach()
    torch.testing.assert_close(weight @ weight.T, torch.eye(features[1]), rtol=0, atol=1e-5)
