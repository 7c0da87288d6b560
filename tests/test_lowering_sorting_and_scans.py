"""Op families, sorting (sort, topk, ties in original order) and scans (cumsum and friends), compared with eager.

Each case runs both routes of tests/lowering_cases.py (torch.compile, and aten level) against eager.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from .lowering_cases import (
    BF16,
    F32,
    I64,
    Case,
    assert_same,
    check_compiled,
    const,
    distinct,
    randn,
    with_nans,
)
from .util import tensor_leaves


# ---- sorting --------------------------------------------------------------------------------------------------
def _nan_ties(dtype):
    # NaNs, -0.0 next to 0.0, ties and infinities: all the cases where sort order is subtle.
    t = torch.tensor(
        [
            [3.0, float("nan"), -0.0, 0.0, 1.0, float("-inf"), 1.0, float("nan"), float("inf"), -2.0],
            [0.5, 0.5, 0.5, -1.0, float("nan"), 2.0, -0.0, 7.0, 0.0, -3.0],
        ]
    )
    return t.to(dtype)


SORTING = [
    Case("sort_asc", lambda x: torch.sort(x, dim=1), [distinct(3, 5)], (F32, BF16)),
    Case("sort_desc_dim0", lambda x: torch.sort(x, dim=0, descending=True), [distinct(4, 3)], (F32,)),
    Case("sort_stable_nan_ties", lambda x: torch.sort(x, dim=1, stable=True), [_nan_ties], (F32, BF16)),
    Case(
        "sort_stable_desc_nan_ties",
        lambda x: torch.sort(x, dim=-1, descending=True, stable=True),
        [_nan_ties],
        (F32, BF16),
    ),
    Case(
        "sort_int64",
        lambda x: torch.sort(x, stable=True, descending=True),
        [const(torch.tensor([[5, -3, 5, 2**40, -(2**40), 0]]))],
        (I64,),
    ),
    Case("argsort", lambda x: torch.argsort(x, dim=1), [distinct(3, 6)]),
    Case("msort", lambda x: torch.msort(x), [distinct(4, 3)]),
    Case("topk_largest", lambda x: torch.topk(x, 3, dim=1), [distinct(3, 7)], (F32,)),
    Case("topk_smallest_dim0", lambda x: torch.topk(x, 2, dim=0, largest=False), [distinct(5, 3)]),
    Case("topk_nan", lambda x: torch.topk(x, 3, dim=1), [_nan_ties]),
    # The device's TopK takes no integers and k <= 16384: these are a sort and a slice instead.
    Case(
        "topk_int",
        lambda x: torch.topk(x, 3, dim=1),
        [const(torch.tensor([[5, -3, 4, 2**40, -(2**40), 0, 7]]))],
        (I64,),
    ),
    Case(
        "topk_int_smallest",
        lambda x: torch.topk(x, 2, dim=0, largest=False),
        [distinct(5, 3, scale=4)],
        (torch.int32, torch.uint8),
    ),
    Case("topk_k_past_device_limit", lambda x: torch.topk(x, 16385), [distinct(16400, scale=1)], (F32,), grad=False),
    Case("kthvalue", lambda x: torch.kthvalue(x, 2, dim=1), [distinct(3, 5)]),
    Case("kthvalue_keepdim", lambda x: torch.kthvalue(x, 3, dim=0, keepdim=True), [distinct(4, 3)]),
    Case("median_dim", lambda x: torch.median(x, dim=1), [distinct(3, 6)]),
    Case("median_dim_nan", lambda x: torch.median(x, dim=1), [with_nans(distinct(3, 5), (1, 2))], grad=False),
    Case("median_all", lambda x: torch.median(x), [distinct(3, 5)]),
]


@pytest.mark.parametrize("case,dtype", [p for c in SORTING for p in c.params()])
def test_sorting(case: Case, dtype: torch.dtype) -> None:
    check_compiled(case, dtype)


def _tied(dtype: torch.dtype) -> torch.Tensor:
    # Many ties in every dtype: bool, small integers, and integers above 256 (which bfloat16 rounds together).
    gen = torch.Generator().manual_seed(5)
    if dtype == torch.bool:
        return torch.rand(6, 40, generator=gen) > 0.5
    if dtype == I64:
        return torch.randint(-3, 4, (6, 40), generator=gen)
    return torch.randint(250, 300, (6, 40), generator=gen).to(dtype)


TIES = {
    # (compiled op, eager reference with a defined tie order: the stable sort)
    "sort": (lambda x: torch.sort(x, dim=1), lambda x: torch.sort(x, dim=1, stable=True)),
    "sort_desc_dim0": (
        lambda x: torch.sort(x, dim=0, descending=True),
        lambda x: torch.sort(x, dim=0, descending=True, stable=True),
    ),
    "argsort": (lambda x: torch.argsort(x, dim=1), lambda x: torch.sort(x, dim=1, stable=True)[1]),
    "topk": (
        lambda x: torch.topk(x, 4, dim=1),
        lambda x: tuple(t[:, :4] for t in torch.sort(x, dim=1, descending=True, stable=True)),
    ),
    "topk_smallest": (
        lambda x: torch.topk(x, 3, dim=0, largest=False),
        lambda x: tuple(t[:3] for t in torch.sort(x, dim=0, stable=True)),
    ),
    "kthvalue": (
        lambda x: torch.kthvalue(x, 7, dim=1),
        lambda x: tuple(t[:, 6] for t in torch.sort(x, dim=1, stable=True)),
    ),
}


def _ties_params() -> list[Any]:
    # Eager has no bool topk/kthvalue.
    dtypes = {F32: "float32", BF16: "bfloat16", I64: "int64", torch.bool: "bool"}
    return [
        pytest.param(n, d, id=f"{n}-{i}")
        for n in TIES
        for d, i in dtypes.items()
        if not (n.startswith(("topk", "kthvalue")) and d == torch.bool)
    ]


@pytest.mark.parametrize("name,dtype", _ties_params())
def test_ties_keep_original_order(name, dtype) -> None:
    # torch leaves the tie order of these ops unspecified (eager's CPU introsort/nth_element order cannot be
    # reproduced); ours is the stable order: exactly eager's stable sort, values and indices.
    op, reference = TIES[name]
    x = _tied(dtype)
    expected = tensor_leaves(reference(x))
    actual = tensor_leaves(torch.compile(op, backend="neuron", dynamic=False)(x))
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_same(a, e, (0, 0), f"{name}[{dtype}](tied {list(x.shape)}) output {i}")


# ---- scans ------------------------------------------------------------------------------------------------------
def _cum_ties(dtype):
    return torch.tensor(
        [[1.0, 3.0, 3.0, 2.0, float("nan"), 5.0, float("nan"), 0.0], [-1.0, -1.0, -4.0, -4.0, 2.0, -5.0, -5.0, 9.0]]
    ).to(dtype)


SCANS = [
    Case("cumsum", lambda x: torch.cumsum(x, 1), [randn(3, 37)], (F32, BF16), tol="sum"),
    Case("cumsum_dim0", lambda x: torch.cumsum(x, 0), [randn(9, 4)], tol="sum"),
    Case(
        "cumsum_int_to_int64",
        lambda x: torch.cumsum(x, -1),
        [const(torch.arange(20, dtype=torch.int32) - 9)],
        (torch.int32,),
    ),
    Case("cumsum_dtype_arg", lambda x: torch.cumsum(x, 0, dtype=torch.float32), [randn(6)], (BF16,), tol="sum"),
    Case("cumprod", lambda x: torch.cumprod(x, 1), [lambda d: (torch.rand(2, 9) + 0.5).to(d)], (F32,), tol="sum"),
    Case("logcumsumexp", lambda x: torch.logcumsumexp(x, 1), [randn(3, 17)], (F32,), tol="sum"),
    Case(
        "logcumsumexp_inf",
        lambda x: torch.logcumsumexp(x, 0),
        [const(torch.tensor([float("-inf"), float("-inf"), 1.0, float("inf"), 2.0]))],
        grad=False,
    ),
    Case("cummax", lambda x: torch.cummax(x, 1), [randn(3, 11)], (F32,)),
    Case("cummin_dim0", lambda x: torch.cummin(x, 0), [randn(7, 3)]),
    Case("cummax_ties_nan", lambda x: torch.cummax(x, 1), [_cum_ties], grad=False),
    Case("cummin_ties_nan", lambda x: torch.cummin(x, 1), [_cum_ties], grad=False),
    Case("cummax_int64", lambda x: torch.cummax(x, 0), [const(torch.tensor([3, 1, 3, 7, 7, -2]))], (I64,)),
]


@pytest.mark.parametrize("case,dtype", [p for c in SCANS for p in c.params()])
def test_scans(case: Case, dtype: torch.dtype) -> None:
    check_compiled(case, dtype)
