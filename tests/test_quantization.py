"""Quantized compute (neuron_compile/lowering/quantization.py) against eager on the same inputs.

Integer results must be equal; floating results pass the OpInfo harness's verdict (eager's tolerance for the
dtype, else no further from a float64 result than twice eager's own error); float8 results, compiled and eager,
are one of the two float8 values bracketing the float64 result (tests/rounding_bounds.py). Float8 operands run with
``generation="trn3"`` where the legality rules need it: ``float8_e4m3fn`` is a trn3 type (trn2's e4m3 is
the IEEE-style variant torch does not have).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import pytest
import torch

from tests import rounding_bounds as RB
from tests.support import opinfo_harness as H

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _compiled(fn: Callable[..., Any], options: dict[str, Any] | None = None) -> Callable[..., Any]:
    torch._dynamo.reset()
    return torch.compile(fn, backend="neuron", dynamic=False, fullgraph=True, options=options or {})


@pytest.mark.parametrize("a_dtype", [torch.int8, torch.uint8], ids=str)
@pytest.mark.parametrize("k", [64, 1030, 3000], ids=lambda k: f"k{k}")
def test_int_mm_is_exact(k: int, a_dtype: torch.dtype) -> None:
    """[u]int8 x int8 -> int32 through float32-accumulated chunks of 1,024 (int8) or 512 (uint8, torchao's
    dynamic activation quantization) products: exact at any k, including the largest magnitudes. Judged against
    the int64 product, not eager: eager's oneDNN kernel saturates pairs of products to int16 on CPUs without
    AVX-512 VNNI (``ONEDNN_MAX_CPU_ISA=AVX2``: off by up to 1.7e7 at k=1030), exact with it."""
    g = torch.Generator().manual_seed(k)
    info = torch.iinfo(a_dtype)
    a = torch.randint(info.min, info.max + 1, (17, k), generator=g, dtype=a_dtype)
    b = torch.randint(-128, 128, (k, 24), generator=g, dtype=torch.int8)
    a[0] = info.min if a_dtype.is_signed else info.max
    b[:, 0], b[:, 1] = -128, -127  # odd products: sums past 2**24 would round in float32
    got, want = _compiled(torch._int_mm)(a, b), (a.long() @ b.long()).int()
    assert got.dtype == torch.int32
    assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_weight_int8pack_mm_matches_eager(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 64, generator=g).to(dtype)
    q = torch.randint(-128, 128, (32, 64), generator=g, dtype=torch.int8)
    scales = (torch.rand(32, generator=g) * 0.1).to(dtype)
    fn = torch._weight_int8pack_mm
    reference = lambda: (x.double() @ q.double().t()) * scales.double()  # noqa: E731
    problem = H.compare(_compiled(fn)(x, q, scales), fn(x, q, scales), "output", reference=reference)
    assert problem is None, problem


def _eager(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn`` as eager runs it on this CPU. With oneDNN held below the CPU's ISA (``ONEDNN_MAX_CPU_ISA=AVX2`` on
    an AMX CPU: test_bf16_numerics.py's AVX2 re-run), torch still picks oneDNN's float8 matmul after an earlier
    oneDNN call in the process (an ``_int_mm``), and oneDNN has no kernel for it there: eager is then ATen's
    kernel, which a CPU without AMX runs."""
    try:
        return fn(*args)
    except RuntimeError as e:
        if "could not create a primitive descriptor" not in str(e) or "ONEDNN_MAX_CPU_ISA" not in os.environ:
            raise
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "TF32 acceleration on top of oneDNN" (Intel GPUs)
        with torch.backends.mkldnn.flags(enabled=False):
            return fn(*args)


_SCALES = {
    "tensorwise": lambda m, n, g: (torch.tensor(0.7), torch.tensor(1.3)),
    "rowwise": lambda m, n, g: (torch.rand(m, 1, generator=g) + 0.5, torch.rand(1, n, generator=g) + 0.5),
}


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, "float8"], ids=str)
@pytest.mark.parametrize("scales", list(_SCALES))
@pytest.mark.parametrize("f8", [E4M3, E5M2], ids=str)
def test_scaled_mm_matches_eager(f8: torch.dtype, scales: str, out_dtype: Any) -> None:
    """eager's CPU _scaled_mm: scaled float32 operands, one rounding; with a bias, and scale_result (which
    divides a float8 result only). A float8 result is judged against float64, not eager's bits: with tensorwise
    scales on a CPU with AMX (ATen at AVX-512) eager is oneDNN's matmul, which rounds the float32 result to
    float16 first (6.7493 -> 6.75 -> 7.0 where one rounding gives 6.5); with rowwise scales, on CPUs without AMX
    and with ATen held to AVX2, ATen's float32 product rounded once. Both, and the compiled value, are one of the
    two float8 values bracketing the float64 result; the compiled one is also the nearer one (rounded once, as
    the lowering does) wherever float32's error cannot move the result across the midpoint."""
    out_dtype = f8 if out_dtype == "float8" else out_dtype
    g = torch.Generator().manual_seed(2)
    m, k, n = 16, 64, 32
    a = (torch.randn(m, k, generator=g) * 3).to(f8)
    b = (torch.randn(n, k, generator=g) * 3).to(f8).t()  # column-major, as eager's kernels want
    scale_a, scale_b = _SCALES[scales](m, n, g)
    bias = torch.randn(n, generator=g).bfloat16() if out_dtype == torch.bfloat16 else None
    scale_result = torch.tensor(4.0)

    def fn(a, b, scale_a, scale_b):
        return torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, scale_result=scale_result, out_dtype=out_dtype)

    def reference() -> torch.Tensor:
        out = (a.double() * scale_a.double()) @ (b.double() * scale_b.double())
        out = out + bias.double() if bias is not None else out
        return out / 4.0 if out_dtype == f8 else out

    got = _compiled(fn, {"generation": "trn3"})(a, b, scale_a, scale_b)
    want = _eager(fn, a, b, scale_a, scale_b)
    if out_dtype == f8:
        exact = reference()
        assert exact.abs().max() < torch.finfo(f8).max, "the sample reaches float8's overflow"
        # the float32 computation's error: k products and sums, the scaling of both operands and the division
        magnitude = (a.double().abs() * scale_a.double()) @ (b.double().abs() * scale_b.double()) / 4.0
        float32_error = RB.float32_accumulation_error(k + 4, magnitude)
        what = f"_scaled_mm -> {f8} ({scales} scales)"
        assert got.dtype == want.dtype == f8, (got.dtype, want.dtype)
        RB.assert_within_one_rounding(got, exact, f"{what}, compiled", nearest_beyond=float32_error)
        RB.assert_within_one_rounding(want, exact, f"{what}, eager")
        return
    problem = H.compare(got, want, "output", reference=reference)
    assert problem is None, problem


def test_one_rounding_bound_of_a_float8_result() -> None:
    """tests/rounding_bounds.py's bound: the two float8 values around the float64 value (the value alone if it is
    one; past the largest finite value, that value or the format's overflow), and, where asked, the nearer one
    with ties to even; a value two ulps away is rejected, as is the farther one where nearest is."""
    ref = torch.tensor([6.7493, 6.5, 6.75, -6.7493, 1e-4, 450.0, -450.0], dtype=torch.float64)
    lo, hi = RB.bracket(ref, E4M3)
    nan = float("nan")
    want_lo, want_hi = [6.5, 6.5, 6.5, -7.0, 0.0, 448.0, nan], [7.0, 6.5, 7.0, -6.5, 2.0**-9, nan, -448.0]
    torch.testing.assert_close(lo, torch.tensor(want_lo, dtype=torch.float64), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(hi, torch.tensor(want_hi, dtype=torch.float64), rtol=0, atol=0, equal_nan=True)
    lo, hi = RB.bracket(torch.tensor([6e4], dtype=torch.float64), E5M2)  # e5m2 has an inf
    assert (lo.item(), hi.item()) == (57344.0, float("inf"))
    lo, hi = RB.bracket(torch.tensor([6.5001], dtype=torch.float64), E4M3, slack=0.01)  # 6.5 - 0.01 < 6.5
    assert (lo.item(), hi.item()) == (6.0, 7.0)
    nearest = torch.tensor([6.5, 6.5, 7.0, -6.5, 0.0, 448.0, -448.0]).to(E4M3)  # 6.75: a tie, to even (7 = 1.110b*4)
    RB.assert_within_one_rounding(nearest, ref, "nearest", nearest_beyond=1e-6)
    RB.assert_within_one_rounding(torch.tensor(want_hi[:5] + [nan, -448.0]).to(E4M3), ref, "upper")
    with pytest.raises(AssertionError, match="not rounded to nearest"):
        RB.assert_within_one_rounding(torch.tensor([7.0]).to(E4M3), ref[:1], "farther", nearest_beyond=1e-6)
    with pytest.raises(AssertionError, match="outside one rounding"):
        RB.assert_within_one_rounding(torch.tensor([7.5]).to(E4M3), ref[:1], "two ulps")  # 6.5, 7, 7.5
    with pytest.raises(AssertionError, match="outside one rounding"):
        RB.assert_within_one_rounding(torch.tensor([nan]).to(E4M3), ref[:1], "NaN for a finite value in range")


def test_float8_e4m3fn_is_refused_on_trn2() -> None:
    a = torch.randn(16, 32).to(E4M3)
    with pytest.raises(Exception, match="float8_e4m3fn is not available on trn1/trn2"):
        one = torch.tensor(1.0)
        _compiled(lambda a: torch._scaled_mm(a, a.t(), one, one, out_dtype=torch.bfloat16))(a)


_FAKE_QUANT = {
    "per_tensor": lambda x: torch.fake_quantize_per_tensor_affine(x, 0.037, 3, -128, 127),
    "per_tensor_uint8_range": lambda x: torch.fake_quantize_per_tensor_affine(x, 1 / 3, 100, 0, 255),
    "per_channel": lambda x: torch.fake_quantize_per_channel_affine(
        x, torch.linspace(0.02, 0.3, x.shape[1]), torch.arange(x.shape[1], dtype=torch.int32) % 5 - 2, 1, -128, 127
    ),
}


@pytest.mark.parametrize("name", list(_FAKE_QUANT))
def test_fake_quantize_forward_and_backward_match_eager(name: str) -> None:
    """Values beyond the range clamp and get no gradient (the cached mask); ties round half to even."""
    fn = _FAKE_QUANT[name]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 12, generator=g) * 6
    x[0, :4] = torch.tensor([0.5, 1.5, -2.5, 3.5]) * 0.037  # exact ties for the per-tensor scale
    x[1, :3] = torch.tensor([1e3, -1e3, 1e6])  # beyond every range
    cotangent = torch.randn(16, 12, generator=g)
    results = []
    for run in (fn, _compiled(fn)):
        leaf = x.clone().requires_grad_()
        out = run(leaf)
        out.backward(cotangent)
        results.append((out.detach(), leaf.grad))
    (got, got_grad), (want, want_grad) = results[1], results[0]
    assert torch.equal(got, want), (got - want).abs().max()
    assert torch.equal(got_grad, want_grad)
    assert (want_grad == 0).any() and (want_grad != 0).any()  # both sides of the range are exercised


_LEARNABLE = {
    # zero points that eager rounds: half to even in the forward, zero_point + 0.5 truncated in the backward
    "per_tensor": (lambda x, s, z: torch._fake_quantize_learnable_per_tensor_affine(x, s, z, -128, 127, 1.0),
                   [0.07], [[3.0], [-2.5], [-1.7], [2.5]]),
    "per_tensor_grad_factor": (lambda x, s, z: torch._fake_quantize_learnable_per_tensor_affine(x, s, z, 0, 255, 0.3),
                               [0.05], [[100.4], [0.5]]),
    "per_channel": (lambda x, s, z: torch._fake_quantize_learnable_per_channel_affine(x, s, z, 1, 0, 255, 0.5),
                    [0.1, 0.3, 0.05], [[3.0, 10.5, 127.49], [-4.0, 255.6, 11.5]]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(_LEARNABLE))
def test_learnable_fake_quantize_matches_eager(name: str) -> None:
    """LSQ-style QAT (torch.ao's ``_LearnableFakeQuantize``): the value and the gradients of x, the scale and
    the zero point. Values and dx exactly; the scale and zero-point gradients are sums (summation order)."""
    fn, scale, zero_points = _LEARNABLE[name]
    compiled = _compiled(fn)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, 5, 6, generator=g) * 3
    cotangent = torch.randn(4, 3, 5, 6, generator=g)
    for zero_point in zero_points:
        results = []
        for run in (fn, compiled):
            leaves = [t.clone().requires_grad_() for t in (x, torch.tensor(scale), torch.tensor(zero_point))]
            out = run(*leaves)
            out.backward(cotangent)
            results.append([out.detach()] + [leaf.grad for leaf in leaves])
        (want, want_dx, want_ds, want_dz), (got, got_dx, got_ds, got_dz) = results
        assert torch.equal(got, want), f"zero point {zero_point}: {(got - want).abs().max()}"
        assert torch.equal(got_dx, want_dx), f"zero point {zero_point}"
        torch.testing.assert_close(got_ds, want_ds, rtol=1e-5, atol=1e-5, msg=f"d scale, zero point {zero_point}")
        torch.testing.assert_close(got_dz, want_dz, rtol=1e-5, atol=1e-5, msg=f"d zero point, {zero_point}")


def test_fake_quantize_with_float_zero_points_is_refused_clearly() -> None:
    x = torch.randn(4, 3)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.fake_quantize_per_channel_affine(x, torch.full((3,), 0.1), torch.zeros(3), 1, -128, 127)

    fn(x)  # eager takes it
    with pytest.raises(Exception, match="floating-point zero points"):
        _compiled(fn)(x)
