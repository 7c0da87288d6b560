"""Compiled optimizer steps (``torch.compile(opt.step)``, ``clip_grad_norm_``) match eager.

Dynamo traces optimizer code to ops a model's graph rarely holds: ``_foreach_*`` lists (``foreach=True``,
``clip_grad_norm_``), ``prims.fma`` (its form of ``addcmul_(..., value=)``) and
``prims.convert_element_type`` (a scheduler's changing learning rate). Each ``_foreach_*`` overload
is checked alone against eager, then whole steps of the common optimizers.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import pytest
import torch

from neuron_compile import STATS
from neuron_compile.decompositions import _foreach_decompositions
from neuron_compile.errors import NeuronWarning
from neuron_compile.evaluate import compare_to_reference

FOREACH_OPS = sorted(_foreach_decompositions(), key=str)


def _foreach_args(op: torch._ops.OpOverload, dtype: torch.dtype) -> list[Any]:
    """Arguments for ``op`` by its schema: lists of a 2x2 and a 3x3 tensor in (0.1, 0.9), where every
    unary op of the family is defined (log, acos, lgamma, ...), scalars 0.7 / 1.3."""
    g = torch.Generator().manual_seed(0)

    def tensors() -> list[torch.Tensor]:
        return [(torch.rand(n, n, generator=g) * 0.8 + 0.1).to(dtype) for n in (2, 3)]

    args: list[Any] = []
    for arg in op._schema.arguments:
        if arg.kwarg_only:
            continue
        kind = str(arg.type)
        if kind == "List[Tensor]":
            args.append(tensors())
        elif kind == "List[number]":
            args.append([0.7, 1.3])
        elif kind == "Tensor":
            args.append(torch.tensor(0.6, dtype=dtype))
        elif kind == "number":
            args.append(1.5 if arg.name == "self" else 0.7)  # pow(Scalar self, Tensor[] exponent)
        elif arg.has_default_value():
            break
        else:
            raise AssertionError(f"{op}: no test value for argument {arg}")
    return args


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("op", FOREACH_OPS, ids=[str(op).removeprefix("aten.") for op in FOREACH_OPS])
def test_foreach_overload_matches_eager(op: torch._ops.OpOverload, dtype: torch.dtype) -> None:
    args = _foreach_args(op, dtype)

    def run(*a: Any) -> list[torch.Tensor]:
        return op(*a)

    got = torch.compile(run, backend="neuron", dynamic=False)(*args)
    want = run(*args)
    reference = run(*_foreach_args(op, torch.float64))
    verdict = compare_to_reference(reference, want, got)
    assert verdict.ok, (op, verdict.failures())
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{op}: {m}")


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "adamw-amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_compiled_optimizer_step_with_clipping_matches_eager(name: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)
    twin = copy.deepcopy(model)
    opt, twin_opt = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](twin.parameters())

    def step(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        return norm

    compiled_step = torch.compile(step, backend="neuron", dynamic=False)
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        for p, q in zip(model.parameters(), twin.parameters()):
            p.grad = (torch.randn(p.shape, generator=g) * 2).to(dtype)
            q.grad = p.grad.clone()
        norm = compiled_step(model, opt)
        twin_norm = step(twin, twin_opt)
        tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
        torch.testing.assert_close(norm, twin_norm, **tol, msg=lambda m: f"{name} step {i} grad norm: {m}")
        for (n, p), q in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(p, q, **tol, msg=lambda m: f"{name} step {i} {n}: {m}")


@pytest.mark.parametrize(
    "lr_kind, dynamic", [("float", None), ("tensor", False)], ids=["float-lr-default-dynamic", "tensor-lr-static"]
)
def test_compiled_step_under_an_lr_scheduler(lr_kind: str, dynamic: bool | None) -> None:
    """A scheduler changes ``lr`` every step. Dynamo passes a changing float as a float64 scalar input
    (cast with ``prims.convert_element_type``); a tensor ``lr`` is an input already. Either way one
    graph (two for the float: its first value is a constant), eager's parameters, no float64 warning."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    twin = copy.deepcopy(model)

    def make(params: Any) -> tuple[torch.optim.Optimizer, Any]:
        opt = torch.optim.AdamW(params, lr=0.01 if lr_kind == "float" else torch.tensor(0.01))
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)

    (opt, sched), (twin_opt, twin_sched) = make(model.parameters()), make(twin.parameters())
    STATS.reset()
    step = torch.compile(opt.step, backend="neuron", dynamic=dynamic)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(10):
            g = torch.Generator().manual_seed(i)
            for p, q in zip(model.parameters(), twin.parameters()):
                p.grad = torch.randn(p.shape, generator=g)
                q.grad = p.grad.clone()
            step()
            twin_opt.step()
            sched.step()
            twin_sched.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert STATS.count() <= 2, STATS.graphs
    assert not [w for w in caught if issubclass(w.category, NeuronWarning)], [str(w.message) for w in caught]
