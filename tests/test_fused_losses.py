"""``F.linear_cross_entropy`` with chunking options (torch_nn custom ops; lowering/fused_losses.py) vs eager.

The chunked ops compute the gradients in their forward pass, so a training step checks the loss and the
input / weight / bias gradients. bfloat16 is judged against a float64 reference copy: eager bf16 chunks and
rounds logits differently, so the compiled result must be no further from the reference than 2x eager's own
error (RMSE) plus one bf16 ulp of the value's scale.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

N, IN, CLASSES = 7, 12, 10
LCEO = torch.nn.LinearCrossEntropyOptions


def _inputs(
    dtype: torch.dtype, bias: bool, class_weight: bool, seed: int, ignore_index: int = -100
) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, CLASSES, (N,), generator=g)
    target[2] = ignore_index if not 0 <= ignore_index < CLASSES else target[2]
    target[4] = ignore_index if 0 <= ignore_index < CLASSES else target[4]
    return {
        "input": torch.randn(N, IN, generator=g).to(dtype),
        "linear_weight": torch.randn(CLASSES, IN, generator=g).to(dtype),
        "target": target,
        "linear_bias": torch.randn(CLASSES, generator=g).to(dtype) if bias else None,
        "weight": torch.rand(CLASSES, generator=g).to(dtype) + 0.5 if class_weight else None,
    }


def _step(fn, tensors: dict, dtype: torch.dtype, reduction: str, ignore_index: int) -> list[torch.Tensor]:
    leaves = {k: v if v is None or not v.is_floating_point() else v.detach().to(dtype).requires_grad_(k != "weight")
              for k, v in tensors.items()}  # fmt: skip
    options = LCEO(batch_chunk_size=3, allow_retain_graph=reduction != "none")
    loss = fn(leaves["input"], leaves["linear_weight"], leaves["target"], leaves["linear_bias"], leaves["weight"],
              reduction, ignore_index, options)  # fmt: skip
    cot = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape).to(dtype)
    wrt = [leaves[k] for k in ("input", "linear_weight", "linear_bias") if leaves[k] is not None]
    return [loss.detach(), *torch.autograd.grad(loss, wrt, cot)]


def _loss(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, options):
    return F.linear_cross_entropy(input, linear_weight, target, linear_bias=linear_bias, weight=weight, reduction=reduction,
                                  ignore_index=ignore_index, options=options)  # fmt: skip


def _rmse(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref).pow(2).mean().sqrt().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "reduction,bias,class_weight,ignore_index",
    [("mean", True, True, 3), ("sum", False, True, 99), ("none", True, False, -100), ("none", False, True, 3)],
)
def test_linear_cross_entropy_chunked_matches_eager(dtype, reduction, bias, class_weight, ignore_index) -> None:
    tensors = _inputs(torch.float32, bias, class_weight, seed=len(reduction) + ignore_index, ignore_index=ignore_index)
    compiled = torch.compile(_loss, backend="neuron", fullgraph=True, dynamic=False)
    got = _step(compiled, tensors, dtype, reduction, ignore_index)
    eager = _step(_loss, tensors, dtype, reduction, ignore_index)
    names = ["loss", "grad input", "grad linear_weight", "grad linear_bias"]
    if dtype == torch.float32:
        for name, g, e in zip(names, got, eager):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} ({reduction}): {m}")
        return
    reference = _step(_loss, tensors, torch.float64, reduction, ignore_index)
    for name, g, e, r in zip(names, got, eager, reference):
        assert g.dtype == e.dtype and g.shape == e.shape, name
        ulp = r.abs().max().item() * 2.0**-8
        assert _rmse(g, r) <= 2 * _rmse(e, r) + ulp, (
            f"{name} ({reduction}, bf16): RMSE to float64 {_rmse(g, r):.3g} vs eager's {_rmse(e, r):.3g}"
        )


def test_linear_cross_entropy_mean_over_all_ignored_is_nan() -> None:
    """Eager divides by the total weight of the kept rows: zero of them is NaN, not 0 or inf."""
    tensors = _inputs(torch.float32, True, False, seed=0)
    tensors["target"] = torch.full((N,), -100)
    compiled = torch.compile(_loss, backend="neuron", fullgraph=True, dynamic=False)
    got = _step(compiled, tensors, torch.float32, "mean", -100)
    eager = _step(_loss, tensors, torch.float32, "mean", -100)
    for g, e in zip(got, eager):
        torch.testing.assert_close(g, e, equal_nan=True)
    assert got[0].isnan()
