"""Training loops under backend="neuron" match eager: losses, gradients and parameters after each step."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from neuron_compile import STATS
from neuron_compile.runtime import jax_adapter

from .models import MLP, BatchNormNet, RecurrentNet, TinyLM

# (rtol, atol) per dtype: float32 differs from eager only by summation order; bf16 by one rounding per op.
TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}


@dataclass
class Case:
    name: str
    model: Callable[[], torch.nn.Module]
    batch: Callable[[int], tuple]
    loss: Callable[[torch.nn.Module, tuple], torch.Tensor]


def _regression_batch(d_in: int, n: int = 8) -> Callable[[int], tuple]:
    def make(step: int) -> tuple:
        g = torch.Generator().manual_seed(100 + step)
        return torch.randn(n, d_in, generator=g), torch.randn(n, generator=g)

    return make


def _lm_batch(step: int) -> tuple:
    g = torch.Generator().manual_seed(200 + step)
    idx = torch.randint(0, 64, (2, 16), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


CASES = [
    Case("mlp", lambda: MLP(), _regression_batch(16), lambda m, b: (m(b[0]).sum(-1) - b[1]).pow(2).mean()),
    Case(
        "batchnorm",
        lambda: BatchNormNet(),
        _regression_batch(12),
        lambda m, b: (m(b[0]).mean(-1) - b[1]).pow(2).mean(),
    ),
    Case("transformer", lambda: TinyLM(n_layers=1), _lm_batch, lambda m, b: m(*b)),
    Case(
        "recurrent",
        lambda: RecurrentNet(),
        lambda step: (torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(300 + step)), torch.zeros(4)),
        lambda m, b: (m(b[0]).sum(-1) - b[1]).pow(2).mean(),
    ),
]

OPTIMIZERS_LR = {"sgd": 0.05, "adamw": 1e-3}
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=OPTIMIZERS_LR["sgd"], momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=OPTIMIZERS_LR["adamw"]),
}


def _cast_batch(batch: tuple, dtype: torch.dtype) -> tuple:
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)


def _assert_close(what: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _rounding_noise(grad: torch.Tensor) -> torch.Tensor:
    """Elements whose true gradient is zero (e.g. the key bias under softmax's shift invariance, a bias
    before BatchNorm): eager and compiled both see only rounding noise there."""
    return grad.abs() <= 1e-6 * max(1.0, grad.abs().max().item()) if grad.dtype == torch.float32 else grad != grad


def _assert_params_close(what, p_c, p_e, noise, opt_name, step, dtype) -> None:
    p_c, p_e = p_c.detach(), p_e.detach()
    if opt_name == "adamw" and noise.any():
        # Adam normalizes a noise-level gradient to a full step of size ~lr, in either direction, so on
        # those elements the two runs may differ by at most 2*lr per step, and must match elsewhere.
        lr = OPTIMIZERS_LR["adamw"]
        assert (p_c[noise] - p_e[noise]).abs().max() <= 2 * lr * (step + 1) * 1.01, what
        p_c, p_e = p_c[~noise], p_e[~noise]
    _assert_close(what, p_c, p_e, dtype)


def run_and_compare(case: Case, opt_name: str, dtype: torch.dtype, steps: int = 3, compile_fn=None) -> None:
    torch.manual_seed(0)
    eager_model = case.model().to(dtype)
    model = copy.deepcopy(eager_model)
    compiled = compile_fn(model) if compile_fn else torch.compile(model, backend="neuron", dynamic=False)
    opt_e, opt_c = OPTIMIZERS[opt_name](eager_model.parameters()), OPTIMIZERS[opt_name](model.parameters())
    for step in range(steps):
        batch = _cast_batch(case.batch(step), dtype)
        losses = []
        for m, opt in ((eager_model, opt_e), (compiled, opt_c)):
            opt.zero_grad()
            loss = case.loss(m, batch)
            loss.backward()
            losses.append(loss.detach())
        _assert_close(f"{case.name} step {step} loss", losses[1], losses[0], dtype)
        for (name, p_e), p_c in zip(eager_model.named_parameters(), model.parameters()):
            _assert_close(f"{case.name} step {step} grad of {name}", p_c.grad, p_e.grad, dtype)
        noise = {name: _rounding_noise(p.grad) for name, p in eager_model.named_parameters()}
        opt_e.step()
        opt_c.step()
        for (name, p_e), p_c in zip(eager_model.named_parameters(), model.parameters()):
            _assert_params_close(f"{case.name} step {step} param {name}", p_c, p_e, noise[name], opt_name, step, dtype)
    for (name, b_e), b_c in zip(eager_model.named_buffers(), model.buffers()):
        _assert_close(f"{case.name} buffer {name}", b_c, b_e, dtype)


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_training_matches_eager_float32(case: Case, opt_name: str) -> None:
    run_and_compare(case, opt_name, torch.float32)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_training_matches_eager_bfloat16(case: Case) -> None:
    run_and_compare(case, "sgd", torch.bfloat16)


def test_backward_runs_through_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step executes one forward and one backward executable of ours, and nothing runs in eager."""
    executions: list[int] = []
    real_execute = jax_adapter.execute
    monkeypatch.setattr(jax_adapter, "execute", lambda exe, bufs: executions.append(1) or real_execute(exe, bufs))
    STATS.reset()
    run_and_compare(CASES[0], "sgd", torch.float32, steps=3)
    assert STATS.count("forward") == 1 and STATS.count("backward") == 1, STATS.graphs
    assert len(executions) == 6  # 3 steps x (forward + backward)


def test_inference_uses_inference_graph() -> None:
    STATS.reset()
    model = MLP()
    x = torch.randn(4, 16)
    with torch.no_grad():
        out = torch.compile(model, backend="neuron", dynamic=False)(x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    assert [g.kind for g in STATS.graphs] == ["inference"]
