"""Cases of the op-family tests (tests/test_lowering_<family>.py) and the two routes each is checked by.

Two routes, both compared with eager on the same inputs:
- ``torch.compile(backend="neuron")``: the aten ops AOTAutograd actually leaves (forward and gradients of
  every floating input, with a random cotangent so index mix-ups cannot cancel out);
- aten level: an FX graph of explicit aten calls (``make_fx``) lowered and run directly, for ops the
  current decomposition table breaks up before they reach us (upsample, reflection/replication pads) and
  for behaviours Dynamo never hands us (data-dependent shapes, out-of-range indices).

Integer outputs (indices, int64 results) must match exactly. Tolerances: float32 1e-5 where we compute in
eager's order; 1e-4 where a sum is rounded in another order (scans, pooling windows, scatter-add of
duplicates); bfloat16 1.6e-2 (one ulp is 7.8e-3; both sides round). Random ops are checked by shape,
dtype, range, statistics and reproducibility under ``torch.manual_seed``: the compiled stream is not
eager's, so they match in distribution only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import neuron_compile.lowering as lowering
from neuron_compile.lowering import lower_graph
from neuron_compile.runtime.cpu import CpuTarget
from neuron_compile.runtime.executor import CompiledGraph

from .util import tensor_leaves

aten = torch.ops.aten
F32, BF16, I64 = torch.float32, torch.bfloat16, torch.int64

TOL = {
    "exact": {F32: (1e-5, 1e-5), BF16: (1.6e-2, 1e-2)},
    "sum": {F32: (1e-4, 1e-4), BF16: (1.6e-2, 2e-2)},
}


# ---- helpers ---------------------------------------------------------------------------------------------
def randn(*shape: int) -> Callable[[torch.dtype], torch.Tensor]:
    return lambda dtype: torch.randn(shape).to(dtype)


def distinct(*shape: int, scale: float = 0.25) -> Callable[[torch.dtype], torch.Tensor]:
    """Values without ties (exact in bfloat16 for up to 512 elements), so sort/max indices are defined."""
    n = 1
    for s in shape:
        n *= s
    return lambda dtype: ((torch.randperm(n) - n // 2).float() * scale).reshape(shape).to(dtype)


def const(t: torch.Tensor) -> Callable[[torch.dtype], torch.Tensor]:
    return lambda dtype: t.clone()


def with_nans(make: Callable[[torch.dtype], torch.Tensor], where: tuple) -> Callable[[torch.dtype], torch.Tensor]:
    def build(dtype):
        t = make(dtype)
        t[where] = float("nan")
        return t

    return build


def describe_inputs(inputs: list[Any]) -> str:
    return ", ".join(f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else repr(t) for t in inputs)


def assert_same(actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float], what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != eager {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != eager {tuple(expected.shape)}"
    if not expected.is_floating_point():
        assert torch.equal(actual, expected), f"{what}: integer results differ\n{actual}\n!= eager\n{expected}"
        return
    rtol, atol = tol
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}")


def missing_requirements(requires: tuple[str, ...]) -> list[str]:
    have = set(lowering.supported_ops())
    return [op for op in requires if op not in have]


@dataclass
class Case:
    name: str
    fn: Callable[..., Any]
    inputs: list[Any]  # makers (dtype -> tensor) or constants (index tensors, scalars)
    dtypes: tuple[torch.dtype, ...] = (F32,)
    grad: bool = True
    tol: str = "exact"
    #: aten ops of other families this case's graph needs; the case is skipped (naming them) until lowered.
    requires: tuple[str, ...] = ()
    marks: tuple[Any, ...] = ()
    #: Positions of floating inputs not to differentiate (their gradient is not what the case checks).
    no_grad: tuple[int, ...] = ()

    def params(self) -> list[Any]:
        return [
            pytest.param(self, d, id=f"{self.name}-{str(d).split('.')[-1]}", marks=list(self.marks))
            for d in self.dtypes
        ]


def materialize(case: Case, dtype: torch.dtype) -> list[Any]:
    torch.manual_seed(0)
    return [m(dtype) if callable(m) else m for m in case.inputs]


def check_compiled(case: Case, dtype: torch.dtype) -> None:
    missing = missing_requirements(case.requires)
    if missing:
        pytest.skip(f"{case.name}: needs {missing} (lowered by another family)")
    inputs = materialize(case, dtype)
    what = f"{case.name}[{dtype}]({describe_inputs(inputs)})"
    tol = TOL[case.tol][dtype] if dtype in TOL[case.tol] else (0, 0)

    def leaves():
        out = []
        for i, t in enumerate(inputs):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and case.grad and i not in case.no_grad:
                t = t.detach().clone().requires_grad_(True)
            elif isinstance(t, torch.Tensor):
                t = t.clone()
            out.append(t)
        return out

    eager_in, comp_in = leaves(), leaves()
    expected = tensor_leaves(case.fn(*eager_in))
    compiled = torch.compile(case.fn, backend="neuron", dynamic=False)
    actual = tensor_leaves(compiled(*comp_in))
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_same(a.detach(), e.detach(), tol, f"{what} output {i}")
    if not case.grad:
        return
    diff = [(a, e) for a, e in zip(actual, expected) if e.requires_grad]
    if not diff:
        return
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(e.shape, generator=gen).to(e.dtype) for _, e in diff]
    sum((e * w).float().sum() for (_, e), w in zip(diff, weights)).backward()
    sum((a * w).float().sum() for (a, _), w in zip(diff, weights)).backward()
    for i, (a, e) in enumerate(zip(comp_in, eager_in)):
        if isinstance(e, torch.Tensor) and e.requires_grad:
            assert (a.grad is None) == (e.grad is None), f"{what}: grad of input {i} presence"
            if e.grad is not None:
                grad_tol = TOL["sum"][dtype]
                assert_same(a.grad, e.grad, grad_tol, f"{what} grad of input {i}")


def run_aten(
    fn: Callable[..., Any], inputs: list[Any], tracing_mode: str = "real", form: str = "cpu"
) -> list[torch.Tensor]:
    """Lower the aten graph of ``fn`` (no decompositions) and run it on the CPU target; ``form="neuron"``
    runs the module lowered for the neuron target (valid HLO for XLA CPU when it holds no device call)."""

    def as_tuple(*args):
        return tuple(tensor_leaves(fn(*args)))

    gm = make_fx(as_tuple, tracing_mode=tracing_mode)(*inputs)
    lowered = lower_graph(gm, list(inputs), "families", target=form)
    target = CpuTarget()
    executable = target.compile(lowered.stablehlo())
    graph = CompiledGraph("families", target, executable, lowered.inputs, lowered.outputs, lowered.needs_rng_seed)
    return graph(list(inputs))


def check_aten(case: Case, dtype: torch.dtype) -> None:
    inputs = materialize(case, dtype)
    what = f"{case.name}[{dtype}]({describe_inputs(inputs)})"
    expected = tensor_leaves(case.fn(*inputs))
    actual = run_aten(case.fn, inputs)
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_same(a, e, TOL[case.tol][dtype], f"{what} output {i}")
