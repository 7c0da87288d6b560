"""Non-core ops with a static lowering (issue 12, item 3): torch's own decompositions taken into
``neuron_compile/decompositions.py`` (EXTRA_DECOMPOSITIONS) and the lowerings of the ops torch has none for.

Each case is compiled with ``torch.compile(backend="neuron", fullgraph=True)`` (the legality pass runs too)
and compared with eager on the same inputs, in float32 and bfloat16, by the OpInfo harness's verdict
(``tests/support/opinfo_harness.compare``): eager's tolerance for the dtype, or else no further from the float64
result than twice eager's own error plus one ulp. Where the op has a gradient, the float32 gradients of every
floating input are compared too (a fixed random cotangent, so a wrong backward cannot hide in a sum).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from neuron_compile.decompositions import EXTRA_DECOMPOSITIONS, decomposition_table
from tests.support import opinfo_harness as H

F32, BF16 = torch.float32, torch.bfloat16
pytestmark = pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[..., Any]
    #: builds the inputs for a float dtype (called under a fixed seed)
    inputs: Callable[[torch.dtype], tuple[Any, ...]]
    grad: bool = True
    #: positions of the arguments that get a gradient (default: every floating tensor)
    grad_args: tuple[int, ...] | None = None
    dtypes: tuple[torch.dtype, ...] = (F32, BF16)


def _r(*shape: int) -> Callable[[torch.dtype], torch.Tensor]:
    return lambda dt: torch.randn(shape, dtype=dt)


def _with_nans(*shape: int) -> Callable[[torch.dtype], torch.Tensor]:
    def make(dt: torch.dtype) -> torch.Tensor:
        x = torch.randn(*shape, dtype=dt)
        return x.masked_fill(torch.rand(*shape) < 0.3, float("nan"))

    return make


def _ties_and_zeros(*shape: int) -> Callable[[torch.dtype], torch.Tensor]:
    """Small integers (ties for max/min, whose gradient eager shares) with zeros (prod's special case)."""
    return lambda dt: torch.randint(-3, 4, shape).to(dt)


def _grid_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A sampling grid for an input of ``shape``: [N, *out, d] with a small output of its own size."""
    d = len(shape) - 2
    return (shape[0], *[3 + k for k in range(d)], d)


def _bn_with_update(x, w, b, rm, rv):
    # The op nn.BatchNorm's training forward is under torch.export-style tracing; its functional variant
    # and batch_norm_backward are what reach the backend.
    out, mean, rstd, _ = torch.ops.aten._batch_norm_with_update(x, w, b, rm, rv, 0.1, 1e-5)
    return out, mean, rstd, rm + 0, rv + 0  # the running statistics, updated in place


CASES: list[Case] = [
    Case("dist.p2", lambda a, b: torch.dist(a, b), lambda dt: (_r(4, 5)(dt), _r(5)(dt))),
    Case("dist.p3", lambda a, b: torch.dist(a, b, 3), lambda dt: (_r(3, 4)(dt), _r(3, 4)(dt))),
    Case("dist.pinf", lambda a, b: torch.dist(a, b, float("inf")), lambda dt: (_r(6)(dt), _r(6)(dt))),
    Case("narrow_copy", lambda x: torch.narrow_copy(x, 1, 1, 3) * 2, lambda dt: (_r(3, 5)(dt),)),
    Case(
        "_batch_norm_with_update",
        _bn_with_update,
        lambda dt: (
            torch.randn(4, 3, 5, dtype=dt),
            torch.rand(3, dtype=dt) + 0.5,
            torch.randn(3, dtype=dt),
            torch.randn(3, dtype=dt),
            torch.rand(3, dtype=dt) + 0.5,
        ),
        grad_args=(0, 1, 2),
    ),  # fmt: skip
    Case("addbmm", lambda x, a, b: torch.addbmm(x, a, b), lambda dt: (_r(3, 5)(dt), _r(4, 3, 6)(dt), _r(4, 6, 5)(dt))),
    Case(
        "addbmm.beta_alpha",
        lambda x, a, b: torch.addbmm(x, a, b, beta=0.5, alpha=-2),
        lambda dt: (_r(5)(dt), _r(2, 3, 4)(dt), _r(2, 4, 5)(dt)),
    ),
    Case(
        "bilinear",
        lambda x, y, w, b: F.bilinear(x, y, w, b),
        lambda dt: (_r(3, 4)(dt), _r(3, 5)(dt), _r(2, 4, 5)(dt), _r(2)(dt)),
    ),  # fmt: skip
    Case(
        "bilinear.batched",
        lambda x, y, w: F.bilinear(x, y, w),
        lambda dt: (_r(2, 3, 4)(dt), _r(2, 3, 4)(dt), _r(3, 4, 4)(dt)),
    ),  # fmt: skip
    Case(
        "as_strided_scatter",
        lambda x, s: torch.as_strided_scatter(x, s, (2, 2), (1, 2), 1),
        lambda dt: (_r(3, 3)(dt), _r(2, 2)(dt)),
    ),  # fmt: skip
    Case(
        "as_strided_scatter.of_a_transpose",
        lambda x, s: torch.as_strided_scatter(x.t() * 1, s, (3,), (4,)),
        lambda dt: (_r(4, 3)(dt), _r(3)(dt)),
        grad=False,
    ),  # eager: no gradient of a non-contiguous input
    *[
        Case(
            f"index_reduce.{how}.{'self' if include else 'noself'}",
            lambda x, i, s, how=how, include=include: x.index_reduce(1, i, s, how, include_self=include),
            lambda dt: (_r(3, 4)(dt), torch.tensor([0, 2, 0, 3, 0]), _r(3, 5)(dt)),
            dtypes=(F32, BF16) if include else (F32,),
        )
        for how in ("prod", "mean", "amax", "amin")
        for include in (True, False)
    ],  # fmt: skip
    *[
        Case(
            f"index_reduce.int64.{how}",
            lambda x, i, s, how=how: x.index_reduce(0, i, s, how, include_self=False),
            lambda dt: (torch.randint(-9, 9, (4, 2)), torch.tensor([3, 1, 3, 0]), torch.randint(-9, 9, (4, 2))),
            grad=False,
            dtypes=(torch.int64,),
        )
        for how in ("prod", "mean", "amax", "amin")
    ],  # fmt: skip
    *[
        Case(
            f"segment_reduce.{how}.lengths",
            lambda x, n, how=how: torch.segment_reduce(x, how, lengths=n),
            lambda dt: (_ties_and_zeros(7, 3)(dt), torch.tensor([2, 0, 4, 1])),
        )
        for how in ("sum", "mean", "max", "min", "prod")
    ],  # fmt: skip
    *[
        Case(
            f"segment_reduce.{how}.offsets_initial",
            lambda x, o, how=how: torch.segment_reduce(x, how, offsets=o, axis=1, initial=1.5),
            lambda dt: (_ties_and_zeros(2, 6)(dt), torch.tensor([[0, 3, 3, 6], [0, 1, 5, 6]])),
            dtypes=(F32,),
        )
        for how in ("sum", "mean", "max", "prod")
    ],  # fmt: skip
    Case("histogram.bin_ct", lambda x: torch.histogram(x, 6), lambda dt: (_r(30)(dt),), grad=False, dtypes=(F32,)),
    Case(
        "histogram.range_weight_density",
        lambda x, w: torch.histogram(x, 4, range=(-1.0, 1.5), weight=w, density=True),
        lambda dt: (_r(5, 6)(dt), torch.rand(5, 6, dtype=dt)),
        grad=False,
        dtypes=(F32,),
    ),  # fmt: skip
    Case(
        "histogram.bins_tensor",
        lambda x, b: torch.histogram(x, b),
        lambda dt: (_r(40)(dt), torch.tensor([-2.0, -0.5, 0.0, 0.25, 3.0], dtype=dt)),
        grad=False,
        dtypes=(F32,),
    ),
    *[
        Case(
            f"cdist.p{p:g}",
            lambda a, b, p=p: torch.cdist(a, b, p),
            lambda dt: (_r(2, 4, 3)(dt), _r(1, 5, 3)(dt)),
            dtypes=(F32,),
        )
        for p in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, float("inf"))
    ],  # fmt: skip
    # a zero distance (a repeated row): the gradient there is 0, not NaN
    Case(
        "cdist.shared_rows",
        lambda a, b: torch.cdist(a, b),
        lambda dt: (lambda x: (x.repeat(2, 1), x[:2].clone()))(_r(3, 2)(dt)),
        dtypes=(F32,),
    ),  # fmt: skip
    *[
        Case(f"pdist.p{p:g}", lambda x, p=p: F.pdist(x, p), lambda dt: (_r(5, 3)(dt),), dtypes=(F32,))
        for p in (0.0, 1.0, 2.0, 2.5, float("inf"))
    ],
    *[
        Case(
            f"embedding_bag.{mode}",
            lambda w, i, o, mode=mode: F.embedding_bag(i, w, o, mode=mode),
            lambda dt: (_r(9, 4)(dt), torch.tensor([1, 8, 2, 2, 5, 0, 7]), torch.tensor([0, 3, 3, 5])),
        )
        for mode in ("sum", "mean", "max")
    ],  # fmt: skip
    Case(
        "embedding_bag.per_sample_weights_padding",
        lambda w, i, o, p: F.embedding_bag(i, w, o, mode="sum", per_sample_weights=p, padding_idx=2),
        lambda dt: (_r(9, 4)(dt), torch.tensor([1, 8, 2, 2, 5, 0, 7]), torch.tensor([0, 3, 3, 5]), _r(7)(dt)),
    ),
    # repeats of the largest index only: eager's CPU backward divides a row's gradient by the frequency of
    # the index at the row's unique-rank position in the sorted indices (``counts[indices_data[i]]`` in
    # EmbeddingBag.cpp), not by its own as documented (and as done here); the two agree only then
    Case(
        "embedding_bag.2d_scale_grad_by_freq",
        lambda w, i: F.embedding_bag(i, w, mode="mean", scale_grad_by_freq=True, padding_idx=0),
        lambda dt: (_r(6, 3)(dt), torch.tensor([[1, 0, 5], [4, 5, 5]])),
    ),
    Case(
        "embedding_bag.include_last_offset",
        lambda w, i, o: F.embedding_bag(i, w, o, mode="max", include_last_offset=True),
        lambda dt: (_r(6, 3)(dt), torch.tensor([3, 1, 4, 1, 5]), torch.tensor([0, 2, 2, 5])),
    ),
    Case(
        "embedding_bag.max.no_indices",
        lambda w, i, o: F.embedding_bag(i, w, o, mode="max"),
        lambda dt: (_r(5, 3)(dt), torch.zeros(0, dtype=torch.long), torch.tensor([0, 0])),
        dtypes=(F32,),
    ),
    # max_norm renormalizes the used rows of weight in place (embedding_renorm), outside autograd
    Case(
        "embedding_bag.max_norm",
        lambda w, i, o: (F.embedding_bag(i, w, o, max_norm=1.0), w + 0),
        lambda dt: (_r(6, 3)(dt) * 2, torch.tensor([0, 4, 4, 2]), torch.tensor([0, 1])),
        grad=False,
    ),
    # grid_sample: 2-d forward by torch's decomposition, its backward and the 3-d op lowered; grid points
    # reach past the edges so that every padding mode matters
    *[
        Case(
            f"grid_sample.{len(shape) - 2}d.{mode}.{pad}.{'corners' if align else 'edges'}",
            lambda x, g, mode=mode, pad=pad, align=align: F.grid_sample(x, g, mode, pad, align),
            lambda dt, shape=shape: (_r(*shape)(dt), (torch.rand(*_grid_shape(shape)) * 2.6 - 1.3).to(dt)),
            dtypes=dtypes,
        )
        for shape, mode, pad, align, dtypes in [
            ((2, 3, 5, 6), "bilinear", "zeros", False, (F32, BF16)),
            ((2, 3, 5, 6), "bilinear", "border", True, (F32,)),
            ((2, 3, 5, 6), "bilinear", "reflection", False, (F32,)),
            ((2, 3, 5, 6), "bilinear", "reflection", True, (F32,)),
            ((2, 3, 5, 6), "nearest", "zeros", False, (F32,)),
            ((2, 3, 5, 6), "nearest", "reflection", False, (F32,)),
            ((2, 3, 5, 6), "bicubic", "zeros", True, (F32, BF16)),
            ((2, 3, 5, 6), "bicubic", "reflection", False, (F32,)),
            ((1, 2, 3, 4, 5), "bilinear", "zeros", False, (F32, BF16)),
            ((1, 2, 3, 4, 5), "bilinear", "border", True, (F32,)),
            ((1, 2, 3, 4, 5), "bilinear", "reflection", False, (F32,)),
            ((1, 2, 3, 4, 5), "nearest", "border", False, (F32,)),
        ]
    ],  # fmt: skip
    # a fixed grid (warping, augmentation): the backward is asked for the input's gradient only
    *[
        Case(
            f"grid_sample.{len(shape) - 2}d.fixed_grid",
            lambda x, g: F.grid_sample(x, g, align_corners=False),
            lambda dt, shape=shape: (_r(*shape)(dt), (torch.rand(*_grid_shape(shape)) * 2.6 - 1.3).to(dt)),
            grad_args=(0,),
        )
        for shape in [(2, 3, 5, 6), (1, 2, 3, 4, 5)]
    ],
    # ties: the smallest of the most frequent values, at its last occurrence (eager's stable sort up to 16)
    Case("mode.ties", lambda x: torch.mode(x, 1), lambda dt: (torch.randint(0, 4, (3, 12)).to(dt),)),
    Case(
        "mode.dim0_keepdim", lambda x: torch.mode(x, 0, keepdim=True), lambda dt: (torch.randint(0, 3, (7, 4)).to(dt),)
    ),  # fmt: skip
    Case("mode.0d", lambda x: torch.mode(x), lambda dt: (_r()(dt),)),
    Case("nanmedian", lambda x: torch.nanmedian(x), lambda dt: (_with_nans(5, 4)(dt),)),
    Case("nanmedian.dim", lambda x: torch.nanmedian(x, 1), lambda dt: (_with_nans(4, 7)(dt),)),
    Case(
        "nanmedian.all_nan_row",
        lambda x: torch.nanmedian(x, -1, keepdim=True),
        lambda dt: (torch.tensor([[1.0, float("nan"), 3.0], [float("nan")] * 3], dtype=dt),),
    ),  # fmt: skip
    Case(
        "nonzero_static.padded",
        lambda x: torch.nonzero_static(x, size=20, fill_value=-7),
        lambda dt: (_r(3, 4)(dt) * (torch.rand(3, 4) > 0.5),),
        grad=False,
    ),  # fmt: skip
    Case(
        "nonzero_static.truncated",
        lambda x: torch.nonzero_static(x > 0, size=3),
        lambda dt: (_r(2, 3, 4)(dt),),
        grad=False,
    ),  # fmt: skip
    # triangles of every shape: square, wide, tall, offsets past either edge, empty; int64 and int32
    Case(
        "tril_triu_indices",
        lambda x: (
            torch.tril_indices(5, 4, -1),
            torch.triu_indices(4, 6, 2),
            torch.tril_indices(3, 5, 9),
            torch.triu_indices(4, 4, -9),
            torch.triu_indices(0, 3),
            torch.tril_indices(27, 27, dtype=torch.int32),
            x[torch.triu_indices(3, 3, 1).unbind()],
        ),
        lambda dt: (_r(3, 3)(dt),),
        grad=False,
        dtypes=(F32,),
    ),  # fmt: skip
]


def _grad_leaves(args: tuple[Any, ...]) -> list[torch.Tensor]:
    return [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor) and a.requires_grad]


def _clone(args: tuple[Any, ...], dtype: torch.dtype | None = None, grad: tuple[int, ...] = ()) -> tuple[Any, ...]:
    def one(a: Any, wants_grad: bool) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        a = a.detach().clone()
        if a.is_floating_point():
            a = a.to(dtype or a.dtype).requires_grad_(wants_grad)
        return a

    return tuple(pytree.tree_map(lambda a: one(a, i in grad), arg) for i, arg in enumerate(args))


def _describe(args: tuple[Any, ...]) -> str:
    def one(a: Any) -> str:
        return f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)}" if isinstance(a, torch.Tensor) else repr(a)

    return ", ".join(one(a) for a in args)


@pytest.mark.parametrize(
    "case,dtype", [pytest.param(c, d, id=f"{c.name}-{str(d).removeprefix('torch.')}") for c in CASES for d in c.dtypes]
)
def test_matches_eager(case: Case, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    base = case.inputs(dtype)
    grad = case.grad and dtype == F32
    grad_args = (case.grad_args if case.grad_args is not None else tuple(range(len(base)))) if grad else ()
    where = f"{case.name}({_describe(base)})"
    torch._dynamo.reset()
    compiled = torch.compile(case.fn, backend="neuron", dynamic=False, fullgraph=True)
    eager_args, compiled_args = _clone(base, grad=grad_args), _clone(base, grad=grad_args)
    expected = case.fn(*eager_args)
    actual = compiled(*compiled_args)

    def reference() -> Any:
        return case.fn(*_clone(base, torch.float64))

    problem = H.compare(actual, expected, "output", reference=reference)
    assert problem is None, f"{where} [{dtype}]: {problem}"
    if not grad:
        return
    outs = [o for o in pytree.tree_leaves(expected) if isinstance(o, torch.Tensor) and o.requires_grad]
    cotangents = [torch.randn_like(o) for o in outs]
    inputs_e, inputs_c = _grad_leaves(eager_args), _grad_leaves(compiled_args)
    grads_e = torch.autograd.grad(outs, inputs_e, cotangents, allow_unused=True)
    outs_c = [o for o in pytree.tree_leaves(actual) if isinstance(o, torch.Tensor) and o.requires_grad]
    grads_c = torch.autograd.grad(outs_c, inputs_c, cotangents, allow_unused=True)

    def grad_reference() -> list[Any]:
        args64 = _clone(base, torch.float64, grad_args)
        outs64 = [o for o in pytree.tree_leaves(case.fn(*args64)) if isinstance(o, torch.Tensor) and o.requires_grad]
        cotangents64 = [c.double() for c in cotangents]
        return list(torch.autograd.grad(outs64, _grad_leaves(args64), cotangents64, allow_unused=True))

    problem = H.compare(list(grads_c), list(grads_e), "gradient", reference=grad_reference)
    assert problem is None, f"{where} [{dtype}]: {problem}"


def test_extra_decompositions_are_in_the_table() -> None:
    """Each op listed in EXTRA_DECOMPOSITIONS is decomposed by the table AOTAutograd gets."""
    table = decomposition_table()
    for packet in EXTRA_DECOMPOSITIONS:
        functional = [getattr(packet, o) for o in packet.overloads() if "out" not in o]
        assert any(op in table for op in functional), f"{packet}: no overload of it is in decomposition_table()"
