"""Cases of the op-family tests (tests/test_lowering_<family>.py) and the two routes each is checked by: the one
case harness of the op tests (docs/contributing.md, "add an op").

Two routes, both compared with eager on the same inputs:
- ``torch.compile(backend="neuron")``: the aten ops AOTAutograd actually leaves (forward and gradients of
  every floating input, with a random cotangent so index mix-ups cannot cancel out);
- aten level: an FX graph of explicit aten calls (``make_fx``) lowered and run directly, for ops the
  current decomposition table breaks up before they reach us (upsample, reflection/replication pads) and
  for behaviours Dynamo never hands us (data-dependent shapes, out-of-range indices).

Integer outputs (indices, int64 results) must match exactly. Tolerances: float32 1e-5 where we compute in
eager's order; 1e-4 where a sum is rounded in another order (scans, pooling windows, scatter-add of
duplicates, matmuls, norm statistics); bfloat16 1.6e-2 (one ulp is 7.8e-3; both sides round); float16 2e-3
(one ulp is 9.8e-4). Gradients are judged by ``grad_tol`` ("sum" unless a case says otherwise). A case whose
function is an ``nn.Module`` has its parameters' gradients and its buffers (batch norm's running stats)
compared too. Random ops are checked by shape,
dtype, range, statistics and reproducibility under ``torch.manual_seed``: the compiled stream is not
eager's, so they match in distribution only.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import neuron_compile.lowering as lowering
from neuron_compile.lowering import lower_graph
from neuron_compile.runtime.cpu import CpuTarget
from neuron_compile.runtime.executor import CompiledGraph

from .util import tensor_leaves

aten = torch.ops.aten
F32, BF16, F16, I64 = torch.float32, torch.bfloat16, torch.float16, torch.int64

#: (rtol, atol) per dtype; a dtype not listed (integers) must match exactly.
TOL = {
    "exact": {F32: (1e-5, 1e-5), BF16: (1.6e-2, 1e-2), F16: (2e-3, 2e-3)},
    "sum": {F32: (1e-4, 1e-4), BF16: (1.6e-2, 2e-2), F16: (2e-3, 4e-3)},
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
    #: The function (or ``nn.Module``) checked; None when ``build`` makes it.
    fn: Callable[..., Any] | None
    inputs: list[Any]  # makers (dtype -> tensor) or constants (index tensors, scalars)
    dtypes: tuple[torch.dtype, ...] = (F32,)
    grad: bool = True
    tol: str = "exact"
    #: The tolerance (a key of ``TOL``) of the gradients.
    grad_tol: str = "sum"
    #: aten ops of other families this case's graph needs; the case is skipped (naming them) until lowered.
    requires: tuple[str, ...] = ()
    marks: tuple[Any, ...] = ()
    #: Positions of floating inputs not to differentiate (their gradient is not what the case checks).
    no_grad: tuple[int, ...] = ()
    #: Instead of ``fn`` and ``inputs``: dtype -> (function or module, inputs), for a case whose module or
    #: constants depend on the dtype (tests/test_lowering_nn.py).
    build: Callable[[torch.dtype], tuple[Any, list[Any]]] | None = None
    #: Compile with ``fullgraph=True``: an op Dynamo would run in eager behind a graph break is not checked.
    fullgraph: bool = False
    #: Names of output i / input i, for a case that checks several ops in one graph.
    labels: tuple[str, ...] = ()
    #: With ``grad``: some output must be differentiable (the case is there for its gradients).
    grad_output_required: bool = False

    def params(self) -> list[Any]:
        return [
            pytest.param(self, d, id=f"{self.name}-{str(d).split('.')[-1]}", marks=list(self.marks))
            for d in self.dtypes
        ]


def materialize(case: Case, dtype: torch.dtype) -> tuple[Any, list[Any]]:
    """(function or module, inputs) of ``case`` in ``dtype``, from seed 0."""
    torch.manual_seed(0)
    if case.build is not None:
        return case.build(dtype)
    return case.fn, [m(dtype) if callable(m) else m for m in case.inputs]


def _tol(name: str, dtype: torch.dtype) -> tuple[float, float]:
    return TOL[name].get(dtype, (0.0, 0.0))


def check_compiled(case: Case, dtype: torch.dtype) -> None:
    """``case`` run eagerly and through ``torch.compile(backend="neuron")`` from identical copies: outputs, the
    gradients of every differentiable input (and a module's parameters, with a random cotangent), a module's
    buffers."""
    missing = missing_requirements(case.requires)
    if missing:
        pytest.skip(f"{case.name}: needs {missing} (lowered by another family)")
    fn, inputs = materialize(case, dtype)
    what = f"{case.name}[{dtype}]({describe_inputs(inputs)})"
    tol, grad_tol = _tol(case.tol, dtype), _tol(case.grad_tol, dtype)

    def label(i: int) -> str:
        return case.labels[i] if i < len(case.labels) else str(i)

    def fresh() -> tuple[Any, list[Any]]:
        out = []
        for i, t in enumerate(inputs):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and case.grad and i not in case.no_grad:
                t = t.detach().clone().requires_grad_(True)
            elif isinstance(t, torch.Tensor):
                t = t.clone()
            out.append(t)
        return (copy.deepcopy(fn) if isinstance(fn, nn.Module) else fn), out

    (eager_fn, eager_in), (comp_fn, comp_in) = fresh(), fresh()
    expected = tensor_leaves(eager_fn(*eager_in))
    compiled = torch.compile(comp_fn, backend="neuron", dynamic=False, fullgraph=case.fullgraph)
    actual = tensor_leaves(compiled(*comp_in))
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_same(a.detach(), e.detach(), tol, f"{what} output {label(i)}")
    if isinstance(fn, nn.Module):
        for (name, a), (_, e) in zip(comp_fn.named_buffers(), eager_fn.named_buffers()):
            assert_same(a, e, tol, f"{what} buffer {name}")
    if not case.grad:
        return
    diff = [(a, e) for a, e in zip(actual, expected) if e.requires_grad]
    assert diff or not case.grad_output_required, f"{what}: no differentiable output"
    if not diff:
        return
    # A random cotangent per output (drawn on from the case's seed), so index mix-ups cannot cancel out.
    cotangents = [torch.randn(e.shape).to(e.dtype) for _, e in diff]
    torch.autograd.backward([e for _, e in diff], cotangents)
    torch.autograd.backward([a for a, _ in diff], cotangents)
    leaves = [
        (f"input {label(i)}", a, e)
        for i, (a, e) in enumerate(zip(comp_in, eager_in))
        if isinstance(e, torch.Tensor) and e.requires_grad
    ]
    if isinstance(fn, nn.Module):
        leaves += [(name, a, e) for (name, e), a in zip(eager_fn.named_parameters(), comp_fn.parameters())]
    for name, a, e in leaves:
        assert (a.grad is None) == (e.grad is None), f"{what}: grad of {name} presence"
        if e.grad is not None:
            assert_same(a.grad, e.grad, grad_tol, f"{what} grad of {name}")


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
    fn, inputs = materialize(case, dtype)
    what = f"{case.name}[{dtype}]({describe_inputs(inputs)})"
    expected = tensor_leaves(fn(*inputs))
    actual = run_aten(fn, inputs)
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_same(a, e, TOL[case.tol][dtype], f"{what} output {i}")
