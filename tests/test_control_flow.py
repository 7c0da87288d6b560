"""torch's loop higher-order ops: ``scan`` and ``map`` have a static trip count (the length of ``xs``) and are
unrolled; forward and backward (AOTAutograd's backward of a scan is a scan over flipped operands) match eager.
``cond`` and ``while_loop`` stay refused with their reasons (tests/test_legality.py)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch._higher_order_ops.map import map as hop_map
from torch._higher_order_ops.scan import scan

from neuron_compile.evaluate import compare_to_reference


def _rnn(x: torch.Tensor, h0: torch.Tensor, w: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """An RNN as a scan: two carries (state, running sum), stacked states out, weights as extra inputs."""

    def step(carry: tuple[torch.Tensor, torch.Tensor], x_t: torch.Tensor):
        h, total = carry
        h = torch.tanh(h @ w + x_t @ u)
        # Outputs may not alias the carry; and torch 2.13's scan autograd rejects this body with a second
        # stacked output ("scan might be aliasing"), in eager backends too.
        return (h, total + h.sum(-1)), h * 2

    (h, total), hs = scan(step, (h0, torch.zeros(h0.shape[0], dtype=h0.dtype)), x)
    return h, total, hs


def _reversed_along_dim1(x: torch.Tensor, h0: torch.Tensor, w: torch.Tensor, u: torch.Tensor):
    carry, ys = scan(lambda c, x_t: (c * 0.9 + x_t @ u, c.sin()), h0, x.transpose(0, 1), dim=1, reverse=True)
    return carry, ys


def _mapped(x: torch.Tensor, h0: torch.Tensor, w: torch.Tensor, u: torch.Tensor):
    return hop_map(lambda x_t, w, u: torch.sigmoid(x_t @ u) @ w, x, w, u)


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x, h0 = torch.randn(6, 2, 4, generator=g), torch.randn(2, 3, generator=g)
    w, u = torch.randn(3, 3, generator=g) * 0.5, torch.randn(4, 3, generator=g) * 0.5
    return tuple(t.to(dtype) for t in (x, h0, w, u))


LOOPS: dict[str, Callable[..., Any]] = {"scan-rnn": _rnn, "scan-reverse-dim1": _reversed_along_dim1, "map": _mapped}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(LOOPS))
def test_loop_forward_and_backward_match_eager(name: str, dtype: torch.dtype) -> None:
    fn = LOOPS[name]

    def run(dt: torch.dtype, compiled: bool) -> list[torch.Tensor]:
        inputs = [t.requires_grad_() for t in _inputs(dt)]
        f = torch.compile(fn, backend="neuron", dynamic=False, fullgraph=True) if compiled else fn
        outs = f(*inputs)
        loss = sum(o.float().sum() * (i + 1) for i, o in enumerate(outs))
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)  # map and reverse leave an input unused
        return [o.detach() for o in outs] + [g for g in grads if g is not None]

    verdict = compare_to_reference(run(torch.float64, False), run(dtype, False), run(dtype, True))
    assert verdict.ok, (name, verdict.failures())
    if dtype == torch.float32:
        torch.testing.assert_close(
            run(dtype, True), run(dtype, False), rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}"
        )


@pytest.mark.parametrize("loop", ["scan", "map"])
def test_random_ops_in_a_loop_body_draw_fresh_numbers_each_step(loop: str) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        if loop == "scan":
            return scan(lambda c, x_t: (c + 1, torch.rand_like(x_t)), torch.zeros(()), x)[1]
        return hop_map(lambda x_t: torch.rand_like(x_t), x)

    compiled = torch.compile(fn, backend="neuron", dynamic=False, fullgraph=True)
    torch.manual_seed(0)
    first = compiled(torch.zeros(8, 1000))
    torch.manual_seed(0)
    again = compiled(torch.zeros(8, 1000))
    assert torch.equal(first, again), "not reproducible under torch.manual_seed"
    assert len({tuple(row[:4].tolist()) for row in first}) == 8, "steps share random numbers"
    assert 0 <= first.min() and first.max() < 1 and abs(first.mean().item() - 0.5) < 0.02


@pytest.mark.parametrize(
    "body_op,aten_name,tag",
    [
        (lambda x_t: torch.linalg.eigvals(x_t).real, "aten.linalg_eig.default", "# EIGVALS"),  # EIGVALS
        # its meta leaves an empty fake-tensor constant in the body graph
        (lambda x_t: torch.linalg.ldl_factor(x_t + x_t.mT).LD, "aten.linalg_ldl_factor_ex.default", "# LDL"),  # LDL
    ],
    ids=["eigvals", "ldl_factor"],
)
def test_unsupported_op_in_a_loop_body_is_reported_once_with_its_line(body_op, aten_name, tag) -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return scan(lambda c, x_t: (c + 1, body_op(x_t)), torch.zeros(()), x)

    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if text.rstrip().endswith(tag))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(fn, backend="neuron", dynamic=False, fullgraph=True)(torch.rand(10, 3, 3))
    message = str(info.value)
    assert "1 node(s)" in message and message.count(aten_name) == 1, message
    assert f"test_control_flow.py:{line}" in message, message
