"""Op families, integer ops as eager computes them: uint8 wrap-around, shifts, gcd/lcm, division by zero.

Each case runs both routes of tests/lowering_cases.py (torch.compile, and aten level) against eager.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

# ---- uint8: wrap-around as in eager ------------------------------------------------------------------------------
_U8 = torch.tensor([[0, 1, 7, 200], [255, 128, 3, 9]], dtype=torch.uint8)
UINT8_CASES = {
    "abs": lambda x: x.abs(),  # the identity for unsigned types
    "neg": lambda x: -x,
    "add_alpha_negative": lambda x: torch.add(x, x, alpha=-1),
    "sub_scalar": lambda x: x - 10,
    "mul_wraps": lambda x: x * 3,
    "arange_descending": lambda x: torch.arange(250, 0, -7, dtype=torch.uint8) + x.sum(),
    "arange_float_bounds": lambda x: torch.arange(2.7, -3.3, -1.5, dtype=torch.uint8) + x.sum(),  # truncated first
    "scalar_tensor_negative": lambda x: torch.scalar_tensor(-5, dtype=torch.uint8) + x,
    "full_negative": lambda x: torch.full((2, 4), -1, dtype=torch.uint8) - x,
    "index_reduce_prod": lambda x: x.index_reduce(0, torch.tensor([1, 1]), x * 5, "prod"),
    "index_reduce_mean": lambda x: x.index_reduce(0, torch.tensor([0, 0]), x, "mean"),
    "sum_wraps": lambda x: torch.sum(x, 1, dtype=torch.uint8),
}


@pytest.mark.parametrize("name", list(UINT8_CASES))
def test_uint8_wraps_as_in_eager(name: str) -> None:
    """uint8 (images) wraps modulo 256 in eager; Python ints given to uint8 ops wrap too (uint8 of -1 is 255)."""
    fn = UINT8_CASES[name]
    got = torch.compile(fn, backend="neuron", dynamic=False)(_U8.clone())
    want = fn(_U8.clone())
    assert got.dtype == want.dtype and torch.equal(got, want), f"{name}: {got.tolist()} != eager {want.tolist()}"


# ---- integer ops: shifts (torch defines every amount), gcd/lcm ------------------------------------------------
def _shift_operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Values at both ends of the type and shift amounts from 0 past the width (negative for signed types)."""
    info = torch.iinfo(dtype)
    values = [info.min, -7, -1, 0, 1, 5, 100, info.max] if dtype.is_signed else [0, 1, 5, 100, 128, 200, 254, 255]
    amounts = [0, 1, 3, info.bits - 2, info.bits - 1, info.bits, info.bits + 3, -1 if dtype.is_signed else 2]
    return torch.tensor(values, dtype=dtype), torch.tensor(amounts, dtype=dtype)


SHIFT_CASES = {
    "lshift": lambda a, b: a << b,
    "rshift": lambda a, b: a >> b,
    "lshift_scalar": lambda a, b: a << 3,
    "rshift_scalar": lambda a, b: torch.bitwise_right_shift(a, 2),
    "scalar_lshift": lambda a, b: torch.bitwise_left_shift(5, b),
    "ilshift": lambda a, b: a.clone().__ilshift__(b),
    "rshift_by_int64": lambda a, b: a >> b.long(),
}


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("name", list(SHIFT_CASES))
def test_shifts_match_eager(name: str, dtype: torch.dtype) -> None:
    """Shifts by a negative amount or the width or more: 0 to the left, the sign fill to the right (eager's
    kernel), computed with the shifts neuronx-cc takes at every width (its arithmetic right shift is 32-bit)."""
    a, b = _shift_operands(dtype)
    fn = SHIFT_CASES[name]
    got = torch.compile(fn, backend="neuron", dynamic=False)(a, b)
    want = fn(a, b)
    assert got.dtype == want.dtype and torch.equal(got, want), (
        f"{name} {dtype} of {a.tolist()}, {b.tolist()}: {got.tolist()} != eager {want.tolist()}"
    )


def _gcd_operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every pair for 8-bit types; else random pairs, the range's ends, zeros and the largest consecutive
    Fibonacci numbers of the type (Euclid's longest runs)."""
    info = torch.iinfo(dtype)
    if info.bits == 8:
        values = torch.arange(info.min, info.max + 1)
        return tuple(torch.cartesian_prod(values, values).T.to(dtype))
    fib = [1, 2]
    while fib[-1] + fib[-2] <= info.max:
        fib.append(fib[-1] + fib[-2])
    g = torch.Generator().manual_seed(0)
    a = torch.randint(info.min, info.max, (512,), generator=g, dtype=dtype)
    b = a // torch.randint(1, 1000, (512,), generator=g, dtype=dtype)
    # not (min, max): eager's gcd of it is -1 (|min| wraps to min) and its lcm then traps on min / -1
    edges_a = torch.tensor([fib[-1], fib[-3], info.min, info.max, 0, 0, -12, 7], dtype=dtype)
    edges_b = torch.tensor([fib[-2], fib[-4], 6, 0, 0, 5, 18, info.min], dtype=dtype)
    return torch.cat([a, edges_a]), torch.cat([b, edges_b])


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("op", [torch.gcd, torch.lcm], ids=lambda f: f.__name__)
def test_gcd_lcm_match_eager(op, dtype: torch.dtype) -> None:
    a, b = _gcd_operands(dtype)
    got = torch.compile(op, backend="neuron", dynamic=False)(a, b)
    want = op(a, b)
    wrong = (got != want).nonzero().flatten()[:5].tolist()
    assert got.dtype == want.dtype and not wrong, [(a[i].item(), b[i].item(), got[i].item(), want[i].item())
                                                    for i in wrong]  # fmt: skip


ZERO_DIVISIONS = {
    "floor_divide": lambda a, b: a // b,
    "trunc_div": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "remainder": lambda a, b: a % b,
    "fmod": lambda a, b: torch.fmod(a, b),
    "broadcast_divisor": lambda a, b: a.view(3, 1) // b.view(1, 3),
}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8], ids=str)
@pytest.mark.parametrize("name", list(ZERO_DIVISIONS))
def test_integer_division_by_zero_raises_as_in_eager(name: str, dtype: torch.dtype) -> None:
    """Eager raises ZeroDivisionError; XLA would return a number. The graph reports "a divisor is 0" as an
    extra output and the error is raised after it, with the op and the user's line in a note."""
    fn = ZERO_DIVISIONS[name]
    compiled = torch.compile(fn, backend="neuron", dynamic=False)
    a = torch.tensor([5, 7, 9], dtype=dtype)
    for b in (torch.tensor([2, 4, 3], dtype=dtype), torch.tensor([2, 0, 3], dtype=dtype)):
        try:
            want: Any = fn(a, b)
        except RuntimeError as e:
            want = e
        if isinstance(want, torch.Tensor):
            got = compiled(a, b)
            assert got.dtype == want.dtype and torch.equal(got, want), f"{name}: {got.tolist()} != {want.tolist()}"
            continue
        with pytest.raises(RuntimeError, match="ZeroDivisionError") as info:
            compiled(a, b)
        assert str(info.value) == str(want) == "ZeroDivisionError"  # eager's message, word for word
        [note] = info.value.__notes__
        assert "integer division by zero in aten." in note and __file__ in note, note


def test_integer_division_by_zero_in_a_training_graph() -> None:
    """The check rides along a forward graph with a backward: gradients unchanged, the error raised."""

    def fn(x, b):
        return (x * (torch.arange(3) // b).float()).sum()

    compiled = torch.compile(fn, backend="neuron", dynamic=False)
    x = torch.randn(3, requires_grad=True)
    compiled(x, torch.tensor([1, 2, 2])).backward()
    assert torch.equal(x.grad, (torch.arange(3) // torch.tensor([1, 2, 2])).float())
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        compiled(x, torch.tensor([1, 0, 2]))
