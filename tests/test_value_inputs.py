"""A Python float that changes between calls is a value, not a shape: it becomes a graph input, under
``dynamic=False`` too, so a compiled optimizer step under an LR scheduler compiles twice (the first value
a constant, then an input), not once per step.

- graph_checks.keep_shapes_static: Dynamo's automatic dynamic runs for floats of neuron frames even under
  ``dynamic=False`` (torch's ``dynamic=False`` recompiles at every new lr and stops at the recompile limit).
- decompositions.with_symbolic_scalars: the optimizer ops that torch's ``tensorify_python_scalars`` cannot
  turn into tensor ops (``add_(alpha=-lr)``, ``beta1 ** step``, ``lerp_(w)``, ``full_like``, ``prims.fma``)
  are rewritten into ones it can, or the float is specialized again at every value (with every backend).
- aot_cache: a graph in which the float's value was baked in (an op that takes it as a parameter) is not
  stored in AOTAutograd's cache, whose hit for the next value would run the old value's graph.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch._dynamo.utils import counters

optim = torch.optim
SETUPS: dict[str, Callable[[Any], tuple[torch.optim.Optimizer, Any]]] = {
    "adamw-cosine": lambda p: _with(
        optim.AdamW(p, lr=1e-3), lambda o: optim.lr_scheduler.CosineAnnealingLR(o, T_max=10)
    ),
    "sgd-momentum-linear": lambda p: _with(
        optim.SGD(p, lr=0.05, momentum=0.9), lambda o: optim.lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=8)
    ),
    # cycle_momentum (the default) changes Adam's betas[0] at every step as well as lr.
    "adam-onecycle": lambda p: _with(
        optim.Adam(p, lr=1e-3), lambda o: optim.lr_scheduler.OneCycleLR(o, 1e-2, total_steps=10)
    ),
    "adam-foreach-onecycle": lambda p: _with(
        optim.Adam(p, lr=1e-3, foreach=True), lambda o: optim.lr_scheduler.OneCycleLR(o, 1e-2, total_steps=10)
    ),
    "rmsprop-cosine": lambda p: _with(
        optim.RMSprop(p, lr=1e-2), lambda o: optim.lr_scheduler.CosineAnnealingLR(o, T_max=10)
    ),
}


def _with(opt: torch.optim.Optimizer, sched: Callable[[Any], Any]) -> tuple[torch.optim.Optimizer, Any]:
    return opt, sched(opt)


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("dynamic", [False, None], ids=["static", "default"])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_compiled_step_under_a_scheduler_compiles_twice(setup: str, dynamic: bool | None) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    (opt, sched), (twin_opt, twin_sched) = SETUPS[setup](model.parameters()), SETUPS[setup](twin.parameters())
    step = torch.compile(opt.step, backend="neuron", dynamic=dynamic)
    x = torch.randn(4, 8)
    compiles = []
    for i in range(10):
        for m, o in ((model, opt), (twin, twin_opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
        if i == 5:  # the user sets lr themselves: the compiled step reads the new value
            for o in (opt, twin_opt):
                o.param_groups[0]["lr"] = o.param_groups[0]["lr"] * 0.5
        before = _graphs()
        step()
        twin_opt.step()
        compiles.append(_graphs() - before)
        sched.step()
        twin_sched.step()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {i} {name}: {m}")
    assert compiles[:2] == [1, 1] and sum(compiles[2:]) == 0, compiles
    assert opt.param_groups[0]["lr"] == twin_opt.param_groups[0]["lr"]
    assert isinstance(opt.param_groups[0]["lr"], float)  # the user's param_groups are left as they are
    assert opt.state_dict()["param_groups"] == twin_opt.state_dict()["param_groups"]


@pytest.mark.parametrize("dynamic", [False, None], ids=["static", "default"])
def test_function_of_a_changing_float_compiles_twice(dynamic: bool | None) -> None:
    def f(x: torch.Tensor, scale: float) -> torch.Tensor:
        return x * scale + (x - scale) ** 2

    compiled = torch.compile(f, backend="neuron", dynamic=dynamic)
    x = torch.randn(16)
    compiles = []
    for i in range(10):
        scale = 0.1 + 0.07 * i
        before = _graphs()
        out = compiled(x, scale)
        compiles.append(_graphs() - before)
        torch.testing.assert_close(out, f(x, scale), rtol=1e-6, atol=1e-6, msg=lambda m: f"scale {scale}: {m}")
    assert compiles[:2] == [1, 1] and sum(compiles[2:]) == 0, compiles


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, s: x * s + x.clamp(max=s),  # the float both tensorified (mul) and a parameter (clamp)
        lambda x, s: torch.nn.functional.rms_norm(x * s, (4,), eps=s + 1e-3),  # pytorch#197889
    ],
    ids=["clamp", "rms-norm-eps"],
)
def test_a_float_baked_into_the_graph_is_never_stale(fn: Callable[..., torch.Tensor]) -> None:
    """Where the float is a parameter of an op, its value is in the graph and each value compiles (up to the
    recompile limit); a hit of AOTAutograd's cache, keyed by the Dynamo graph that is the same for every
    value, must not run an earlier value's graph (it did, silently, with Inductor too)."""
    compiled = torch.compile(fn, backend="neuron")
    x = torch.randn(4, 4)
    for i in range(6):
        s = 0.1 + 0.05 * i
        torch.testing.assert_close(compiled(x, s), fn(x, s), rtol=1e-5, atol=1e-6, msg=lambda m: f"s={s}: {m}")
