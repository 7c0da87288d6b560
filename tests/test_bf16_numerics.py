"""Regression tests for the OpInfo samples a full-depth sweep found wrong (issue 16), and for the
low-precision verdict of the OpInfo harness.

Each failing sample is checked twice: the harness outcome must be PASS (equal to eager, or no further
from the float64 reference than eager's own result, see ``opinfo_harness.accuracy_distances``), and the
compiled value must equal, exactly, what the opmath rule says it is: the op computed in float32 on the
same inputs and rounded once (``semantics.opmath_dtype``). Where eager differs from that, the reason is
eager's own: its vectorized bfloat16 kernels round intermediates (div trunc, linspace), or Dynamo splits
the op before any backend sees it (addcdiv with ``value=``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tools import opinfo_harness as H

_OPS = {H.entry_name(op): op for op in H.load_op_db()}


def _float32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.float() if t.is_floating_point() else t for t in tensors]


def _opmath(
    entry: str,
    call: Callable,
    sample: Any,
    tensors: list[torch.Tensor],
    dtype: torch.dtype,
) -> torch.Tensor:
    """The op on float32 copies of the inputs, rounded once to ``dtype``."""
    return call(*_float32(tensors)).to(dtype)


def _factory_opmath(
    entry: str,
    call: Callable,
    sample: Any,
    tensors: list[torch.Tensor],
    dtype: torch.dtype,
) -> torch.Tensor:
    """A factory op (``dtype=`` argument) made in float32, rounded once to ``dtype``."""
    f32 = H._make_call(_OPS[entry].op, _with_dtype(sample, torch.float32))[1]
    return f32(*tensors).to(dtype)


def _dynamo_addcdiv(
    entry: str,
    call: Callable,
    sample: Any,
    tensors: list[torch.Tensor],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Dynamo rewrites ``addcdiv(a, t1, t2, value=v)`` as ``a + v * (t1 / t2)`` before the backend sees
    it; each of those ops rounds to bfloat16 in eager too."""
    a, t1, t2 = tensors[:3]
    return a + sample.kwargs["value"] * (t1 / t2)


def _eager(
    entry: str,
    call: Callable,
    sample: Any,
    tensors: list[torch.Tensor],
    dtype: torch.dtype,
) -> torch.Tensor:
    return call(*tensors)


def _with_dtype(sample: Any, dtype: torch.dtype) -> Any:
    s = copy.copy(sample)
    s.kwargs = {**s.kwargs, "dtype": dtype}
    return s


#: (entry, dtype, sample indices that failed at full depth, what the compiled value must equal exactly)
FAILED_SAMPLES = [
    (
        "gather",
        "float32",
        [4],
        _eager,
    ),  # a 2-d empty index into a 1-d input crashed the lowering
    ("gather", "bfloat16", [4], _eager),
    ("div.trunc_rounding", "bfloat16", [6, 7], _opmath),
    ("addcdiv", "bfloat16", [5, 11], _dynamo_addcdiv),
    ("linspace", "bfloat16", [8, 11, 14, 32, 47], _factory_opmath),
    ("masked.log_softmax", "bfloat16", [5, 7, 9, 10, 11, 12, 13], _opmath),
    # integral linspace: endpoints truncated first, steps exact (torch's reference steps in float32)
    ("linspace", "int64", [32, 60], _eager),
    ("linspace.tensor_overload", "int64", [96, 105, 114, 132, 180], _eager),
]
_CASES = [(entry, dtype, i, expect) for entry, dtype, indices, expect in FAILED_SAMPLES for i in indices]
#: Crashes the full-depth sweep found on empty inputs (a batch of 0, a last dim of 0): reshapes with -1.
CRASHED_SAMPLES = [
    ("native_group_norm", "float32", 12),
    ("nn.functional.group_norm", "bfloat16", 12),
    ("softmax", "float32", 5),
    ("nn.functional.softmin", "float16", 5),
]
_HARNESS_CASES = [c[:3] for c in _CASES] + CRASHED_SAMPLES


def _sample(entry: str, dtype: str, index: int) -> Any:
    return H.samples(_OPS[entry], dtype, index + 1, with_grad=False)[index]


@pytest.mark.parametrize(
    ("entry", "dtype", "index", "expect"),
    _CASES,
    ids=[f"{e}-{d}-{i}" for e, d, i, _ in _CASES],
)
def test_failed_sample_is_opmath_exact(
    entry: str, dtype: str, index: int, expect: Callable
) -> None:
    sample = _sample(entry, dtype, index)
    tensors, call = H._make_call(_OPS[entry].op, sample)
    actual = torch.compile(call, backend="neuron", fullgraph=True, dynamic=False)(*tensors)
    expected = expect(entry, call, sample, tensors, H.DTYPES[dtype])
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, f"{entry} #{index}"
    torch.testing.assert_close(
        actual, expected, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{entry} [{dtype} #{index}]: {m}"
    )


@pytest.mark.parametrize(("entry", "dtype", "index"), _HARNESS_CASES, ids=[f"{e}-{d}-{i}" for e, d, i in _HARNESS_CASES])
def test_failed_sample_passes_the_harness(entry: str, dtype: str, index: int) -> None:
    result = H.run_case(_OPS[entry], dtype, index, _sample(entry, dtype, index), False)
    assert result.outcome == H.PASS, result.line()
    # A value that differs from eager is about as close to float64 as eager's own.
    for note in result.accuracy:
        assert note["compiled"] <= note["eager"] * H.ACCURACY_MULTIPLE + 1e-3, result.line()


def test_trunc_division_by_a_broadcast_divisor_is_exact() -> None:
    """XLA rewrites a / broadcast(b) as a * (1 / b): 5.125 / 5.125 became 0.99999994, truncated to 0."""
    a = torch.full((3, 1, 4), 5.125)
    b = torch.full((3, 4), 5.125)
    b[0, 0] = 0.0
    b[1, 1] = float("inf")
    fn = torch.compile(
        lambda x, y: torch.div(x, y, rounding_mode="trunc"),
        backend="neuron",
        fullgraph=True,
    )
    torch.testing.assert_close(
        fn(a, b), torch.div(a, b, rounding_mode="trunc"), rtol=0, atol=0, equal_nan=True
    )


# ---- the harness's low-precision verdict ---------------------------------------------------------------
_TOL = H._DEFAULT_TOL[torch.bfloat16]


def test_verdict_accepts_a_value_closer_to_float64_than_eager() -> None:
    reference = torch.tensor([14.0, 1.0, -48.0], dtype=torch.float64)
    eager = torch.tensor([15.0, 1.0, -49.0], dtype=torch.bfloat16)
    compiled = torch.tensor([14.0, 1.0, -48.0], dtype=torch.bfloat16)
    d = H.accuracy_distances(compiled, eager, reference, _TOL)
    assert d["ok"] and d["compiled"] == 0.0 and d["eager"] > 0


def test_verdict_rejects_a_value_further_from_float64_than_eager_allows() -> None:
    reference = torch.tensor([14.0, 1.0, -48.0], dtype=torch.float64)
    eager = torch.tensor([14.0, 1.0, -48.0], dtype=torch.bfloat16)
    compiled = torch.tensor([14.0, 0.0, -48.0], dtype=torch.bfloat16)
    d = H.accuracy_distances(compiled, eager, reference, _TOL)
    assert not d["ok"] and d["compiled"] > d["bound"]


def test_verdict_requires_nonfinite_values_where_the_reference_has_them() -> None:
    reference = torch.tensor([float("inf"), float("nan"), 1.0], dtype=torch.float64)
    eager = torch.tensor([float("inf"), float("nan"), 1.0], dtype=torch.bfloat16)
    compiled = torch.tensor([float("-inf"), float("nan"), 1.0], dtype=torch.bfloat16)
    assert not H.accuracy_distances(compiled, eager, reference, _TOL)["ok"]
    assert H.accuracy_distances(eager, eager, reference, _TOL)["ok"]


def test_verdict_where_eager_is_nan_judges_against_the_rounded_reference() -> None:
    """Eager's own kernel gave NaN (16-bit matrix_exp): compiled must be the reference rounded to the
    dtype, within a couple of ulps; a value past the dtype's range rounds to inf."""
    reference = torch.tensor([14.0, 1.0, 7e4], dtype=torch.float64)
    eager = torch.tensor([float("nan"), 1.0, float("nan")], dtype=torch.float16)
    tol = H._DEFAULT_TOL[torch.float16]
    assert H.accuracy_distances(reference.half(), eager, reference, tol)["ok"]  # 7e4 -> inf in float16
    assert not H.accuracy_distances(torch.tensor([15.0, 1.0, float("inf")]).half(), eager, reference, tol)["ok"]
    assert not H.accuracy_distances(torch.tensor([14.0, 1.0, 6e4]).half(), eager, reference, tol)["ok"]
