"""Op families real models need: indexing, sorting, scans, pooling, padding/upsampling, random ops.

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

import re
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import neuron_compile.lowering as lowering
from neuron_compile.errors import NeuronUnsupportedOpError
from neuron_compile.lowering import lower_graph

from .util import tensor_leaves
from neuron_compile.runtime.cpu import CpuTarget
from neuron_compile.runtime.executor import CompiledGraph

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




def _describe(inputs: list[Any]) -> str:
    return ", ".join(f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else repr(t) for t in inputs)


def _assert_same(actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float], what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != eager {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != eager {tuple(expected.shape)}"
    if not expected.is_floating_point():
        assert torch.equal(actual, expected), f"{what}: integer results differ\n{actual}\n!= eager\n{expected}"
        return
    rtol, atol = tol
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _missing(requires: tuple[str, ...]) -> list[str]:
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
        return [pytest.param(self, d, id=f"{self.name}-{str(d).split('.')[-1]}", marks=list(self.marks))
                for d in self.dtypes]


def _materialize(case: Case, dtype: torch.dtype) -> list[Any]:
    torch.manual_seed(0)
    return [m(dtype) if callable(m) else m for m in case.inputs]


def check_compiled(case: Case, dtype: torch.dtype) -> None:
    missing = _missing(case.requires)
    if missing:
        pytest.skip(f"{case.name}: needs {missing} (lowered by another family)")
    inputs = _materialize(case, dtype)
    what = f"{case.name}[{dtype}]({_describe(inputs)})"
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
        _assert_same(a.detach(), e.detach(), tol, f"{what} output {i}")
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
                _assert_same(a.grad, e.grad, grad_tol, f"{what} grad of input {i}")


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
    inputs = _materialize(case, dtype)
    what = f"{case.name}[{dtype}]({_describe(inputs)})"
    expected = tensor_leaves(case.fn(*inputs))
    actual = run_aten(case.fn, inputs)
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        _assert_same(a, e, TOL[case.tol][dtype], f"{what} output {i}")


# ---- indexing ----------------------------------------------------------------------------------------------
IDX = torch.tensor([[0, 2, 1], [3, 0, 2]])
ROW_PERM = torch.tensor([[1, 3, 0], [2, 0, 3]])  # unique per row: scatter without duplicate writes
I1 = torch.tensor([2, 0, 1, 2])
NEG = torch.tensor([-1, 0, -3])
# Index tensors live at module level: Dynamo lifts them into graph inputs. (A torch.tensor(...) built
# inside the compiled function becomes a graph constant, which the cache key cannot hash yet.)
ROWS_02 = torch.tensor([0, 2])
ROWS_20 = torch.tensor([2, 0])
COLS_13 = torch.tensor([1, 3])
COLS_031 = torch.tensor([0, 3, 1])
COLS_1011 = torch.tensor([1, 0, 1, 1])
DUP = torch.tensor([[0, 0, 2], [3, 3, 3]])
ZEROS_52 = torch.zeros(5, 2, dtype=torch.long)
SMALL = torch.tensor([[0, 2], [2, 0]])
FLAT_NEGATIVE = torch.tensor([[-1, -12], [-5, 3]])  # wraps like Python indices
FLAT = torch.tensor([[0, 11], [5, -1]])

INDEXING = [
    Case("gather_dim1", lambda x: torch.gather(x, 1, IDX), [randn(2, 4)], (F32, BF16)),
    Case("gather_dim0_small_index", lambda x: torch.gather(x, 0, SMALL), [randn(3, 5)]),
    Case("gather_int64", lambda x: torch.gather(x, -1, IDX), [const(torch.arange(8).reshape(2, 4) * 7)], (I64,)),
    Case("scatter_src", lambda x, s: x.scatter(1, ROW_PERM, s), [randn(2, 4), randn(2, 3)], (F32,)),
    # torch's own derivative of scatter breaks when src is larger than index: forward only.
    Case("scatter_src_larger", lambda x, s: x.scatter(1, ROW_PERM, s), [randn(2, 4), randn(3, 5)], grad=False),
    Case("scatter_value", lambda x: x.scatter(1, ROW_PERM, -2.5), [randn(2, 4)]),
    Case("scatter_reduce_add_legacy", lambda x, s: x.scatter(1, IDX, s, reduce="add"), [randn(2, 4), randn(2, 3)],
         grad=False),
    Case("scatter_reduce_mul_legacy", lambda x, s: x.scatter(1, IDX, s, reduce="multiply"),
         [randn(2, 4), randn(2, 3)], grad=False),
    Case("scatter_add", lambda x, s: x.scatter_add(1, IDX, s), [randn(2, 4), randn(2, 3)], (F32, BF16)),
    Case("scatter_add_dup", lambda x, s: x.scatter_add(0, ZEROS_52, s),
         [randn(2, 2), randn(5, 2)], tol="sum"),
    *[
        Case(f"scatter_reduce_{r}_self{int(s)}",
             lambda x, v, r=r, s=s: x.scatter_reduce(1, DUP, v, r, include_self=s),
             [distinct(2, 4), distinct(2, 3, scale=0.5)], tol="sum", grad=r != "prod")
        for r in ("sum", "prod", "mean", "amax", "amin")
        for s in (True, False)
    ],
    Case("index_rows", lambda x: x[I1], [randn(3, 4)], (F32,)),
    Case("index_cols_negative", lambda x: x[:, NEG], [randn(3, 4)]),
    Case("index_broadcast_2d", lambda x: x[I1[:, None], COLS_031], [randn(3, 4)]),
    Case("index_none_ellipsis", lambda x: x[None, I1, ..., None], [randn(3, 4, 2)]),
    Case("index_separated_front", lambda x: x[I1, :, COLS_1011], [randn(3, 2, 2)]),
    Case("index_int64_values", lambda x: x[NEG], [const(torch.arange(12).reshape(3, 4))], (I64,)),
    Case("index_put_accumulate_dup", lambda x, v: x.index_put((I1,), v, accumulate=True), [randn(3, 4), randn(4, 4)],
         (F32, BF16), tol="sum"),
    Case("index_put_set", lambda x, v: x.index_put((ROWS_20,), v), [randn(3, 4), randn(2, 4)]),
    Case("index_put_2d_broadcast", lambda x, v: x.index_put((ROWS_02, COLS_13), v),
         [randn(3, 4), randn(1)]),
    # The gradient w.r.t. v would be grad[mask].sum(): a data-dependent shape in AOTAutograd's graph.
    Case("setitem_bool_mask", lambda x, v: _setitem_mask(x, v), [randn(3, 4), randn()], no_grad=(1,)),
    Case("setitem_bool_mask_rows", lambda x, v: _setitem_mask(x, v), [randn(3, 4), randn(4)], no_grad=(1,)),
    Case("setitem_rows", lambda x, v: _setitem_rows(x, v), [randn(3, 4), randn(4)]),
    Case("index_select", lambda x: x.index_select(1, I1), [randn(3, 4)], (F32,)),
    Case("index_add_alpha", lambda x, s: x.index_add(0, I1, s, alpha=2), [randn(3, 4), randn(4, 4)], tol="sum"),
    Case("index_copy", lambda x, s: x.index_copy(0, ROWS_20, s), [randn(3, 4), randn(2, 4)]),
    Case("index_fill", lambda x: x.index_fill(1, COLS_13, 3.0), [randn(3, 4)]),
    Case("take", lambda x: torch.take(x, FLAT), [randn(3, 4)]),
    Case("take_negative", lambda x: torch.take(x, FLAT_NEGATIVE), [randn(3, 4)]),
    Case("take_0d_index", lambda x: torch.take(x, torch.tensor(-3)), [randn(3, 4)]),  # a gather, not a dynamic_slice
    Case("take_along_dim", lambda x: torch.take_along_dim(x, IDX, 1), [randn(2, 4)],
         requires=("aten.remainder.Scalar",)),
    Case("select_scatter", lambda x, s: torch.select_scatter(x, s, 0, -1), [randn(3, 4), randn(4)]),
    Case("slice_scatter_step", lambda x, s: torch.slice_scatter(x, s, 1, 1, 6, 2), [randn(3, 7), randn(3, 3)]),
    Case("slice_scatter_dim0", lambda x, s: torch.slice_scatter(x, s, 0, 1, 3), [randn(4, 3), randn(2, 3)]),
    Case("diagonal_scatter", lambda x, s: torch.diagonal_scatter(x, s, 1), [randn(3, 4), randn(3)],
         requires=("aten.diagonal.default",)),
    Case("diagonal_scatter_fw", lambda x, s: torch.diagonal_scatter(x, s, -1, 1, 0), [randn(3, 4), randn(3)],
         grad=False),
    Case("masked_scatter", lambda x, s: x.masked_scatter(x > 0, s), [randn(3, 4), randn(13)]),
]


def _setitem_mask(x, v):
    # (A Python-scalar value, y[m] = 0.5, becomes a graph constant: see ROWS_02 above.)
    y = x * 2
    if v.ndim == 0:
        y[y > 0] = v
    else:
        y[y[:, 0] > 0] = v  # one value row broadcast to every selected row
    return y


def _setitem_rows(x, v):
    y = x * 2
    y[ROWS_02] = v
    return y


@pytest.mark.parametrize("case,dtype", [p for c in INDEXING for p in c.params()])
def test_indexing(case: Case, dtype: torch.dtype) -> None:
    check_compiled(case, dtype)


def test_out_of_range_indices_clamp_on_read_and_drop_on_write() -> None:
    # Eager raises for these; a compiled graph cannot, so reads clamp into range and writes are dropped
    # (XLA's gather/scatter semantics). Documented in lowering/indexing.py.
    x = torch.arange(12.0).reshape(3, 4)
    (read,) = run_aten(lambda t, i: aten.index.Tensor(t, [i]), [x, torch.tensor([5, -1])], "fake")
    assert torch.equal(read, x[[2, 2]])
    (written,) = run_aten(lambda t, i: aten.index_put.default(t, [i], torch.ones(4)), [x, torch.tensor([7])], "fake")
    assert torch.equal(written, x)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, s: x.scatter_add(1, IDX, s),
        lambda x, s: x.scatter_reduce(1, IDX, s, "amax"),
        lambda x, s: x.index_put((ROWS_02,), s[:, :1], accumulate=True),
    ],
    ids=["scatter_add", "scatter_reduce_amax", "index_put_accumulate"],
)
def test_integer_scatter_reductions_are_refused(fn) -> None:
    # neuronx-cc has no integer scatter reduction; the legality pass says so on every target.
    x, s = torch.arange(8).reshape(2, 4), torch.arange(6).reshape(2, 3) * 100
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="no integer/bool scatter reduction"):
        torch.compile(fn, backend="neuron", dynamic=False)(x, s)


DUP_ROWS = torch.tensor([[0, 0, 2, 1, 3], [3, 3, 3, 0, 0]])
DUP_FLAT = torch.tensor([0, 0, 7, 11, 7, 3])
BOOL_ACCUMULATE = {
    "scatter_add": lambda x, s: aten.scatter_add.default(x, 0, DUP_ROWS, s),
    "scatter_reduce_add_legacy": lambda x, s: aten.scatter.reduce(x, 0, DUP_ROWS, s, reduce="add"),
    "scatter_reduce_multiply_legacy": lambda x, s: aten.scatter.reduce(x, 0, DUP_ROWS, s, reduce="multiply"),
    **{f"scatter_reduce_{r}_self{int(i)}": (lambda x, s, r=r, i=i: aten.scatter_reduce.two(x, 0, DUP_ROWS, s, r,
                                                                                        include_self=i))
       for r in ("sum", "prod") for i in (True, False)},
    "index_add_alpha_true": lambda x, s: aten.index_add.default(x, 0, DUP_ROWS[0], s, alpha=True),
    "index_add_alpha_false": lambda x, s: aten.index_add.default(x, 0, DUP_ROWS[0], s, alpha=False),
    "index_put_accumulate": lambda x, s: aten.index_put.default(x, [DUP_ROWS[1]], s, True),
    "put_accumulate": lambda x, s: aten.put.default(x, DUP_FLAT, s.flatten()[:6], True),
}


@pytest.mark.parametrize("name", list(BOOL_ACCUMULATE))
def test_bool_accumulation_is_logical_or_and(name) -> None:
    # Eager accumulates bools as logical or (add/sum) and logical and (multiply/prod); XLA has no i1 add/mul.
    # (On the neuron target the legality pass then refuses these; the CPU target runs them.)
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(4, 5, generator=gen) > 0.5
    s = torch.rand(5, 5, generator=gen) > 0.5
    expected = BOOL_ACCUMULATE[name](x, s)
    (actual,) = run_aten(BOOL_ACCUMULATE[name], [x, s])
    _assert_same(actual, expected, (0, 0), f"{name}(bool[4, 5], bool[5, 5])")


MANY_TO_FEW = torch.arange(2048) % 3  # 2048 updates into 3 slots: ~680 each
MANY_TO_FEW_2D = MANY_TO_FEW[:, None].expand(2048, 8)
ACCUMULATING_WRITES = {
    "scatter_add": lambda x, s: x.scatter_add(0, MANY_TO_FEW_2D, s),
    "scatter_reduce_add_legacy": lambda x, s: x.scatter(0, MANY_TO_FEW_2D, s, reduce="add"),
    "scatter_reduce_sum": lambda x, s: x.scatter_reduce(0, MANY_TO_FEW_2D, s, "sum", include_self=False),
    "scatter_reduce_mean": lambda x, s: x.scatter_reduce(0, MANY_TO_FEW_2D, s, "mean"),
    "index_add": lambda x, s: x.index_add(0, MANY_TO_FEW, s),
    "index_put_accumulate": lambda x, s: x.index_put((MANY_TO_FEW,), s, accumulate=True),
    "put_accumulate": lambda x, s: x.put(MANY_TO_FEW * 5, s[:, 0], accumulate=True),
    # The backward of a gather / index_select / x[idx] is a scatter-add of the output gradient.
    "gather_backward": lambda x, s: _grad_of(lambda t: t.gather(0, MANY_TO_FEW_2D), x, s),
    "index_select_backward": lambda x, s: _grad_of(lambda t: t.index_select(0, MANY_TO_FEW), x, s),
    "index_backward": lambda x, s: _grad_of(lambda t: t[MANY_TO_FEW], x, s),
}


def _grad_of(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, cotangent: torch.Tensor) -> torch.Tensor:
    leaf = x.detach().requires_grad_()
    return torch.autograd.grad(fn(leaf), leaf, cotangent)[0]


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(ACCUMULATING_WRITES))
def test_16bit_accumulating_writes_round_once(name: str, dtype: torch.dtype) -> None:
    """Thousands of updates into one slot: eager's CPU scatter_add/index_add accumulate in float32 and round
    once; sequential 16-bit sums drift by ~100 ulps. Compiled, every accumulating write is the exact sum of
    the same 16-bit inputs rounded once (within one rounding), and so never further from it than eager."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=gen).to(dtype)
    s = (torch.randn(2048, 8, generator=gen) + 0.5).to(dtype)
    fn = ACCUMULATING_WRITES[name]
    got = torch.compile(fn, backend="neuron", dynamic=False)(x, s)
    exact = fn(x.double(), s.double())
    assert got.dtype == dtype
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(got.double(), exact.to(dtype).double(), rtol=ulp, atol=0,
                               msg=lambda m: f"{name}({dtype}[3, 8], {dtype}[2048, 8]): {m}")


@pytest.mark.parametrize(
    "fn,reason",
    [
        (lambda t: aten.nonzero.default(t), "depends on tensor values"),
        (lambda t: aten.index.Tensor(t, [t[:, 0] > 0]), "boolean mask"),
        (lambda t: aten.masked_select.default(t, t > 0), "depends on tensor values"),
    ],
    ids=["nonzero", "index_bool_mask", "masked_select"],
)
def test_data_dependent_shapes_are_refused(fn, reason) -> None:
    x = torch.tensor([[1.0, -2.0], [3.0, 0.0]])
    with pytest.raises(NeuronUnsupportedOpError, match=reason):
        run_aten(fn, [x])


# ---- sorting --------------------------------------------------------------------------------------------------
def _nan_ties(dtype):
    # NaNs, -0.0 next to 0.0, ties and infinities: all the cases where sort order is subtle.
    t = torch.tensor([[3.0, float("nan"), -0.0, 0.0, 1.0, float("-inf"), 1.0, float("nan"), float("inf"), -2.0],
                      [0.5, 0.5, 0.5, -1.0, float("nan"), 2.0, -0.0, 7.0, 0.0, -3.0]])
    return t.to(dtype)


SORTING = [
    Case("sort_asc", lambda x: torch.sort(x, dim=1), [distinct(3, 5)], (F32, BF16)),
    Case("sort_desc_dim0", lambda x: torch.sort(x, dim=0, descending=True), [distinct(4, 3)], (F32,)),
    Case("sort_stable_nan_ties", lambda x: torch.sort(x, dim=1, stable=True), [_nan_ties], (F32, BF16)),
    Case("sort_stable_desc_nan_ties", lambda x: torch.sort(x, dim=-1, descending=True, stable=True), [_nan_ties],
         (F32, BF16)),
    Case("sort_int64", lambda x: torch.sort(x, stable=True, descending=True),
         [const(torch.tensor([[5, -3, 5, 2**40, -(2**40), 0]]))], (I64,)),
    Case("argsort", lambda x: torch.argsort(x, dim=1), [distinct(3, 6)]),
    Case("msort", lambda x: torch.msort(x), [distinct(4, 3)]),
    Case("topk_largest", lambda x: torch.topk(x, 3, dim=1), [distinct(3, 7)], (F32,)),
    Case("topk_smallest_dim0", lambda x: torch.topk(x, 2, dim=0, largest=False), [distinct(5, 3)]),
    Case("topk_nan", lambda x: torch.topk(x, 3, dim=1), [_nan_ties]),
    # The device's TopK takes no integers and k <= 16384: these are a sort and a slice instead.
    Case("topk_int", lambda x: torch.topk(x, 3, dim=1), [const(torch.tensor([[5, -3, 4, 2**40, -(2**40), 0, 7]]))],
         (I64,)),
    Case("topk_int_smallest", lambda x: torch.topk(x, 2, dim=0, largest=False), [distinct(5, 3, scale=4)],
         (torch.int32, torch.uint8)),
    Case("topk_k_past_device_limit", lambda x: torch.topk(x, 16385), [distinct(16400, scale=1)], (F32,),
         grad=False),
    Case("kthvalue", lambda x: torch.kthvalue(x, 2, dim=1), [distinct(3, 5)]),
    Case("kthvalue_keepdim", lambda x: torch.kthvalue(x, 3, dim=0, keepdim=True), [distinct(4, 3)]),
    Case("median_dim", lambda x: torch.median(x, dim=1), [distinct(3, 6)]),
    Case("median_dim_nan", lambda x: torch.median(x, dim=1), [with_nans(distinct(3, 5), (1, 2))], grad=False),
    Case("median_all", lambda x: torch.median(x), [distinct(3, 5)]),
]


@pytest.mark.parametrize("case,dtype", [p for c in SORTING for p in c.params()])
def test_sorting(case: Case, dtype: torch.dtype) -> None:
    check_compiled(case, dtype)


def _tied(dtype: torch.dtype) -> torch.Tensor:
    # Many ties in every dtype: bool, small integers, and integers above 256 (which bfloat16 rounds together).
    gen = torch.Generator().manual_seed(5)
    if dtype == torch.bool:
        return torch.rand(6, 40, generator=gen) > 0.5
    if dtype == I64:
        return torch.randint(-3, 4, (6, 40), generator=gen)
    return torch.randint(250, 300, (6, 40), generator=gen).to(dtype)


TIES = {
    # (compiled op, eager reference with a defined tie order: the stable sort)
    "sort": (lambda x: torch.sort(x, dim=1), lambda x: torch.sort(x, dim=1, stable=True)),
    "sort_desc_dim0": (lambda x: torch.sort(x, dim=0, descending=True),
                       lambda x: torch.sort(x, dim=0, descending=True, stable=True)),
    "argsort": (lambda x: torch.argsort(x, dim=1), lambda x: torch.sort(x, dim=1, stable=True)[1]),
    "topk": (lambda x: torch.topk(x, 4, dim=1),
             lambda x: tuple(t[:, :4] for t in torch.sort(x, dim=1, descending=True, stable=True))),
    "topk_smallest": (lambda x: torch.topk(x, 3, dim=0, largest=False),
                      lambda x: tuple(t[:3] for t in torch.sort(x, dim=0, stable=True))),
    "kthvalue": (lambda x: torch.kthvalue(x, 7, dim=1),
                 lambda x: tuple(t[:, 6] for t in torch.sort(x, dim=1, stable=True))),
}


def _ties_params() -> list[Any]:
    # Eager has no bool topk/kthvalue.
    dtypes = {F32: "float32", BF16: "bfloat16", I64: "int64", torch.bool: "bool"}
    return [pytest.param(n, d, id=f"{n}-{i}") for n in TIES for d, i in dtypes.items()
            if not (n.startswith(("topk", "kthvalue")) and d == torch.bool)]


@pytest.mark.parametrize("name,dtype", _ties_params())
def test_ties_keep_original_order(name, dtype) -> None:
    # torch leaves the tie order of these ops unspecified (eager's CPU introsort/nth_element order cannot be
    # reproduced); ours is the stable order: exactly eager's stable sort, values and indices.
    op, reference = TIES[name]
    x = _tied(dtype)
    expected = tensor_leaves(reference(x))
    actual = tensor_leaves(torch.compile(op, backend="neuron", dynamic=False)(x))
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        _assert_same(a, e, (0, 0), f"{name}[{dtype}](tied {list(x.shape)}) output {i}")


# ---- scans ------------------------------------------------------------------------------------------------------
def _cum_ties(dtype):
    return torch.tensor([[1.0, 3.0, 3.0, 2.0, float("nan"), 5.0, float("nan"), 0.0],
                         [-1.0, -1.0, -4.0, -4.0, 2.0, -5.0, -5.0, 9.0]]).to(dtype)


SCANS = [
    Case("cumsum", lambda x: torch.cumsum(x, 1), [randn(3, 37)], (F32, BF16), tol="sum"),
    Case("cumsum_dim0", lambda x: torch.cumsum(x, 0), [randn(9, 4)], tol="sum"),
    Case("cumsum_int_to_int64", lambda x: torch.cumsum(x, -1), [const(torch.arange(20, dtype=torch.int32) - 9)],
         (torch.int32,)),
    Case("cumsum_dtype_arg", lambda x: torch.cumsum(x, 0, dtype=torch.float32), [randn(6)], (BF16,), tol="sum"),
    Case("cumprod", lambda x: torch.cumprod(x, 1), [lambda d: (torch.rand(2, 9) + 0.5).to(d)], (F32,),
         tol="sum"),
    Case("logcumsumexp", lambda x: torch.logcumsumexp(x, 1), [randn(3, 17)], (F32,), tol="sum"),
    Case("logcumsumexp_inf", lambda x: torch.logcumsumexp(x, 0),
         [const(torch.tensor([float("-inf"), float("-inf"), 1.0, float("inf"), 2.0]))], grad=False),
    Case("cummax", lambda x: torch.cummax(x, 1), [randn(3, 11)], (F32,)),
    Case("cummin_dim0", lambda x: torch.cummin(x, 0), [randn(7, 3)]),
    Case("cummax_ties_nan", lambda x: torch.cummax(x, 1), [_cum_ties], grad=False),
    Case("cummin_ties_nan", lambda x: torch.cummin(x, 1), [_cum_ties], grad=False),
    Case("cummax_int64", lambda x: torch.cummax(x, 0), [const(torch.tensor([3, 1, 3, 7, 7, -2]))], (I64,)),
]


@pytest.mark.parametrize("case,dtype", [p for c in SCANS for p in c.params()])
def test_scans(case: Case, dtype: torch.dtype) -> None:
    check_compiled(case, dtype)


# ---- pooling ------------------------------------------------------------------------------------------------------
POOLING = [
    Case("max_pool2d_indices", lambda x: F.max_pool2d(x, 2, return_indices=True), [distinct(2, 2, 6, 6)],
         (F32, BF16)),
    Case("max_pool2d_pad_ceil", lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True, return_indices=True),
         [distinct(1, 2, 7, 6)]),
    Case("max_pool2d_dilation", lambda x: F.max_pool2d(x, (2, 3), (1, 2), (1, 1), dilation=2, return_indices=True),
         [distinct(2, 7, 8)]),
    Case("max_pool2d_overlap_grad", lambda x: F.max_pool2d(x, 3, 1), [distinct(1, 1, 5, 5)], tol="sum"),
    Case("max_pool2d_nan", lambda x: F.max_pool2d(x, 2, return_indices=True),
         [with_nans(distinct(1, 1, 4, 4), (0, 0, slice(0, 2), 1))], grad=False),
    Case("max_pool1d", lambda x: F.max_pool1d(x, 3, 2, 1, return_indices=True), [distinct(2, 3, 9)]),
    Case("max_pool3d", lambda x: F.max_pool3d(x, 2, return_indices=True), [distinct(1, 2, 4, 4, 4)]),
    Case("avg_pool2d", lambda x: F.avg_pool2d(x, 2), [randn(2, 3, 6, 6)], (F32, BF16), tol="sum"),
    Case("avg_pool2d_pad_ceil_exclude", lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
         [randn(1, 2, 7, 6)], tol="sum"),
    Case("avg_pool2d_pad_include", lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True), [randn(1, 2, 7, 6)],
         tol="sum"),
    Case("avg_pool2d_divisor", lambda x: F.avg_pool2d(x, (2, 3), 1, (1, 0), divisor_override=5), [randn(2, 5, 6)],
         tol="sum"),
    Case("avg_pool1d", lambda x: F.avg_pool1d(x, 3, 2, 1, count_include_pad=False), [randn(2, 3, 10)], tol="sum"),
    Case("avg_pool3d", lambda x: F.avg_pool3d(x, 2, 2, 1), [randn(1, 2, 5, 4, 4)], tol="sum"),
    # Integer average pooling truncates the integer window sum toward zero (negative sums included).
    *[
        Case(f"avg_pool{nd}d_int64_{how}", fn, [const(torch.randint(-20, 20, shape, generator=torch.Generator()
                                                                   .manual_seed(2)))], (I64,))
        for nd, shape, how, fn in (
            (1, (2, 3, 10), "pad_exclude", lambda x: F.avg_pool1d(x, 3, 2, 1, count_include_pad=False)),
            (2, (1, 2, 7, 6), "pad_ceil", lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True)),
            (2, (2, 5, 6), "divisor", lambda x: F.avg_pool2d(x, (2, 3), 1, (1, 0), divisor_override=5)),
            (3, (1, 2, 5, 4, 4), "pad", lambda x: F.avg_pool3d(x, 2, 2, 1)),
        )
    ],
    Case("adaptive_avg_pool2d", lambda x: F.adaptive_avg_pool2d(x, (3, 4)), [randn(2, 3, 7, 9)], (F32, BF16),
         tol="sum"),
    Case("adaptive_avg_pool1d", lambda x: F.adaptive_avg_pool1d(x, 4), [randn(2, 3, 10)], tol="sum"),
    Case("adaptive_avg_pool3d", lambda x: F.adaptive_avg_pool3d(x, (2, 3, 2)), [randn(1, 2, 5, 7, 3)], tol="sum"),
    Case("adaptive_max_pool2d", lambda x: F.adaptive_max_pool2d(x, (3, 4), return_indices=True),
         [distinct(2, 2, 7, 9)], (F32,)),
    Case("adaptive_max_pool1d", lambda x: F.adaptive_max_pool1d(x, 4, return_indices=True), [distinct(2, 3, 10)]),
    Case("adaptive_max_pool2d_nan", lambda x: F.adaptive_max_pool2d(x, 3, return_indices=True),
         [with_nans(distinct(1, 1, 5, 5), (0, 0, 1, slice(1, 3)))], grad=False),
]


@pytest.mark.parametrize("case,dtype", [p for c in POOLING for p in c.params()])
def test_pooling(case: Case, dtype: torch.dtype) -> None:
    check_compiled(case, dtype)


# ---- padding and upsampling -------------------------------------------------------------------------------------
PADDING = [
    Case("pad_constant_crop", lambda x: F.pad(x, (1, -1, 2, 0), value=0.5), [randn(1, 2, 5, 5)], (F32,)),
    Case("pad_constant_int", lambda x: F.pad(x, (2, 1)), [const(torch.arange(6).reshape(2, 3))], (I64,)),
    Case("pad_reflect_2d", lambda x: F.pad(x, (1, 2, 2, 1), mode="reflect"), [randn(1, 2, 5, 5)], tol="sum"),
    Case("pad_replicate_2d", lambda x: F.pad(x, (1, 2, 2, 1), mode="replicate"), [randn(1, 2, 5, 5)], tol="sum",
         requires=("aten.clamp.default",)),
    Case("interpolate_nearest", lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), [randn(1, 2, 3, 4)],
         tol="sum"),
    Case("interpolate_bilinear", lambda x: F.interpolate(x, size=(5, 7), mode="bilinear"), [randn(1, 2, 3, 4)],
         tol="sum", requires=("aten.clamp.default",)),
    # antialias=True: eager's CPU kernel has float32/float64 only (bfloat16: test_antialiased_bfloat16_...)
    *[
        Case(f"interpolate_{mode}_antialias_{how}_ac{int(ac)}",
             lambda x, mode=mode, ac=ac, kw=kw: F.interpolate(x, mode=mode, align_corners=ac, antialias=True, **kw),
             [randn(2, 3, 9, 13)], (F32,), tol="sum")
        for mode in ("bilinear", "bicubic")
        for ac in (False, True)
        for how, kw in (("down", {"size": (4, 5)}), ("up", {"size": (12, 20)}), ("mixed", {"size": (3, 17)}),
                        ("scale", {"scale_factor": 0.35}))
    ],
]


@pytest.mark.parametrize(
    "resize",
    [
        lambda x: F.interpolate(x, size=(4, 5), mode="bilinear", antialias=True),
        lambda x: F.interpolate(x, size=(4, 5), mode="bicubic", antialias=True),
    ],
    ids=["bilinear", "bicubic"],
)
def test_integer_images_are_refused_by_antialiased_resampling(resize) -> None:
    """Eager resamples uint8 images with a fixed-point kernel; computed in integer arithmetic here they would
    come out wrong, so they are refused. (Without antialias, uint8 goes through torch's own decomposition,
    as under Inductor: float math, rounded.)"""
    x = torch.randint(0, 256, (1, 3, 9, 13), dtype=torch.uint8)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="antialiased resampling of an integer"):
        torch.compile(resize, backend="neuron", dynamic=False)(x)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_antialiased_bfloat16_is_the_float32_result_rounded_once(mode: str) -> None:
    """Eager's CPU antialias kernel takes no bfloat16: the compiled result is judged against float64 on the
    same (bfloat16) input; computed in float32 and rounded once, it is within one bfloat16 rounding."""
    x = torch.randn(2, 3, 9, 13, generator=torch.Generator().manual_seed(0)).bfloat16()

    def resize(t: torch.Tensor) -> torch.Tensor:
        return F.interpolate(t, size=(4, 17), mode=mode, antialias=True)

    got = torch.compile(resize, backend="neuron", dynamic=False)(x)
    reference = resize(x.double())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), reference, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("case,dtype", [p for c in PADDING for p in c.params()])
def test_padding_compiled(case: Case, dtype: torch.dtype) -> None:
    check_compiled(case, dtype)


def _grad_probe(shape):
    return lambda dtype: torch.randn(shape).to(dtype)


ATEN_PADDING = [
    Case("reflection_pad1d", lambda x: aten.reflection_pad1d(x, [2, 3]), [randn(2, 3, 6)]),
    Case("reflection_pad2d", lambda x: aten.reflection_pad2d(x, [1, 2, 3, 0]), [randn(2, 4, 5)], (F32,)),
    Case("reflection_pad3d", lambda x: aten.reflection_pad3d(x, [1, 1, 0, 2, 2, 1]), [randn(1, 2, 3, 4, 5)]),
    Case("replication_pad1d", lambda x: aten.replication_pad1d(x, [3, 1]), [randn(2, 3, 4)]),
    Case("replication_pad2d", lambda x: aten.replication_pad2d(x, [2, 0, 1, 3]), [randn(1, 2, 3, 4)], (F32, BF16)),
    Case("replication_pad3d", lambda x: aten.replication_pad3d(x, [1, 2, 1, 0, 0, 1]), [randn(1, 1, 2, 3, 4)]),
    # Negative replication pads crop; eager reads output j from input clamp(j - low, 0, n - 1), so a crop
    # past the far edge still replicates the last element (the OpInfo replicate_negative samples).
    *[
        Case(f"replication_pad2d_negative_{i}", lambda x, p=p: aten.replication_pad2d(x, p), [randn(2, 3, 4, 4)],
             (F32, BF16))
        for i, p in enumerate(([-4, 5, 0, 0], [0, 0, 2, -4], [-1, 2, -2, -1], [1, -3, 0, 0]))
    ],
    # Negative reflection pads crop too: output j reads input reflect(j - low) (the OpInfo pad.reflect sample).
    *[
        Case(f"reflection_pad2d_negative_{i}", lambda x, p=p: aten.reflection_pad2d(x, p), [randn(2, 3, 4, 4)],
             (F32, BF16))
        for i, p in enumerate(([-2, 1, 0, 0], [0, 0, 3, -3], [-1, 2, -2, -1], [1, -3, 0, 0]))
    ],
    Case("reflection_pad2d_negative_backward", lambda g, x: aten.reflection_pad2d_backward(g, x, [-2, 1, 3, -1]),
         [_grad_probe((1, 2, 6, 3)), randn(1, 2, 4, 4)], tol="sum"),
    Case("replication_pad1d_negative_backward", lambda g, x: aten.replication_pad1d_backward(g, x, [-4, 5]),
         [_grad_probe((2, 3, 5)), randn(2, 3, 4)], tol="sum"),
    Case("replication_pad2d_negative_backward", lambda g, x: aten.replication_pad2d_backward(g, x, [-1, 2, 2, -4]),
         [_grad_probe((1, 2, 2, 5)), randn(1, 2, 4, 4)], tol="sum"),
    Case("reflection_pad2d_backward", lambda g, x: aten.reflection_pad2d_backward(g, x, [1, 2, 3, 0]),
         [_grad_probe((2, 7, 8)), randn(2, 4, 5)], tol="sum"),
    Case("reflection_pad1d_backward", lambda g, x: aten.reflection_pad1d_backward(g, x, [2, 3]),
         [_grad_probe((2, 3, 11)), randn(2, 3, 6)], tol="sum"),
    Case("replication_pad2d_backward", lambda g, x: aten.replication_pad2d_backward(g, x, [2, 0, 1, 3]),
         [_grad_probe((1, 2, 7, 6)), randn(1, 2, 3, 4)], (F32, BF16), tol="sum"),
    Case("replication_pad3d_backward", lambda g, x: aten.replication_pad3d_backward(g, x, [1, 2, 1, 0, 0, 1]),
         [_grad_probe((1, 1, 3, 4, 7)), randn(1, 1, 2, 3, 4)], tol="sum"),
    Case("upsample_nearest2d_scale", lambda x: aten.upsample_nearest2d.vec(x, None, [2.0, 3.0]), [randn(1, 2, 3, 4)],
         (F32,)),
    Case("upsample_nearest2d_size", lambda x: aten.upsample_nearest2d.vec(x, [5, 7], None), [randn(1, 2, 3, 4)]),
    Case("upsample_nearest2d_down", lambda x: aten.upsample_nearest2d.default(x, [2, 3]), [randn(1, 2, 5, 7)]),
    Case("upsample_nearest1d", lambda x: aten.upsample_nearest1d.vec(x, None, [1.7]), [randn(2, 3, 5)]),
    Case("upsample_nearest_exact2d", lambda x: aten._upsample_nearest_exact2d.vec(x, [5, 7], None),
         [randn(1, 2, 3, 4)]),
    Case("upsample_nearest2d_backward",
         lambda g: aten.upsample_nearest2d_backward.default(g, [5, 7], [1, 2, 3, 4], None, None),
         [_grad_probe((1, 2, 5, 7))], tol="sum"),
    *[
        Case(f"upsample_bilinear2d_{how}_ac{int(ac)}", fn, [randn(1, 2, 4, 5)], (F32, BF16), tol="sum")
        for ac in (False, True)
        for how, fn in (
            ("size", lambda x, ac=ac: aten.upsample_bilinear2d.vec(x, [7, 3], ac, None)),
            ("scale", lambda x, ac=ac: aten.upsample_bilinear2d.vec(x, None, ac, [1.5, 2.0])),
            ("same", lambda x, ac=ac: aten.upsample_bilinear2d.default(x, [4, 9], ac, None, None)),
        )
    ],
    Case("upsample_linear1d", lambda x: aten.upsample_linear1d.vec(x, [9], False, None), [randn(2, 3, 4)], tol="sum"),
    Case("upsample_trilinear3d", lambda x: aten.upsample_trilinear3d.vec(x, [3, 5, 4], True, None),
         [randn(1, 2, 2, 3, 4)], tol="sum"),
    Case("upsample_nearest3d", lambda x: aten.upsample_nearest3d.vec(x, None, [2.0, 1.5, 0.5]), [randn(1, 2, 2, 3, 4)]),
    Case("upsample_nearest1d_backward",
         lambda g: aten.upsample_nearest1d_backward.default(g, [7], [2, 3, 5], None),
         [_grad_probe((2, 3, 7))], tol="sum"),
    *[
        Case(f"upsample_bilinear2d_backward_ac{int(ac)}",
             lambda g, ac=ac: aten.upsample_bilinear2d_backward.default(g, [7, 3], [1, 2, 4, 5], ac, None, None),
             [_grad_probe((1, 2, 7, 3))], tol="sum")
        for ac in (False, True)
    ],
]


@pytest.mark.parametrize("case,dtype", [p for c in ATEN_PADDING for p in c.params()])
def test_padding_aten(case: Case, dtype: torch.dtype) -> None:
    check_aten(case, dtype)


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
        return tuple(torch.cartesian_prod(values, values).T.to(dtype))  # type: ignore[return-value]
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


# ---- indices out of range: eager's error, not a clamped or dropped index -----------------------------------------
_TABLE = torch.arange(12.0).view(4, 3)
INDEX_CASES = {
    "index": lambda x, i: x[i],
    "index_put": lambda x, i: x.clone().index_put_((i,), torch.tensor(7.0)),
    "index_select": lambda x, i: torch.index_select(x, 0, i),
    "embedding": lambda x, i: F.embedding(i, x),
    "gather": lambda x, i: torch.gather(x, 0, i.view(2, 1).expand(2, 3)),
    "scatter": lambda x, i: torch.zeros(4, 3).scatter(0, i.view(2, 1).expand(2, 3), 1.0),
    "scatter_add": lambda x, i: torch.zeros(4, 3).scatter_add(0, i.view(2, 1).expand(2, 3), x[:2]),
    "index_fill": lambda x, i: x.index_fill(0, i, 1.0),
    "take": lambda x, i: torch.take(x, i * 3),
    "cross_entropy": lambda x, i: F.cross_entropy(x[:2], i),
    "cross_entropy_ignored": lambda x, i: F.cross_entropy(x[:2], torch.where(i == 1, -100, i)),
    "embedding_bag": lambda x, i: F.embedding_bag(i.view(1, -1), x),  # names the offender's position too
    # one_hot's decomposition asserts (aten._assert_async.msg): run after the graph, eager's text after "one_hot: "
    "one_hot": lambda x, i: F.one_hot(i, 4),
    # decomposed into index_put before the backend sees them: index_put's error (eager's names the op)
    "index_add": lambda x, i: x.index_add(0, i, torch.ones(2, 3)),
    "index_copy": lambda x, i: x.index_copy(0, i, torch.ones(2, 3)),
}
_DECOMPOSED = {"index_add", "index_copy"}


@pytest.mark.parametrize("indices", [[1, 2], [1, 4], [-1, -5]], ids=["in-range", "too-large", "negative"])
@pytest.mark.parametrize("name", list(INDEX_CASES))
def test_indices_out_of_range_raise_as_in_eager(name: str, indices: list[int]) -> None:
    """The graph returns each index's smallest and largest value; out of eager's range, eager's exception
    type and message (naming the largest or smallest offender, where eager names the first) are raised."""
    fn, i = INDEX_CASES[name], torch.tensor(indices)
    try:
        want: Any = fn(_TABLE, i)
    except (IndexError, RuntimeError) as e:
        want = e
    compiled = torch.compile(fn, backend="neuron", dynamic=False)
    if isinstance(want, torch.Tensor):
        got = compiled(_TABLE, i)
        assert torch.equal(got, want), f"{name}{indices}: {got} != eager {want}"
        return
    with pytest.raises((IndexError, RuntimeError)) as info:
        compiled(_TABLE, i)
    got_error = info.value
    assert "neuron backend" in info.value.__notes__[0] and __file__ in info.value.__notes__[0], got_error
    if name == "one_hot":
        assert type(got_error) is type(want) and str(got_error) == f"one_hot: {want}", (got_error, want)
    elif name not in _DECOMPOSED:
        template = lambda e: re.sub(r"-?\d+", "N", str(e))  # noqa: E731
        assert type(got_error) is type(want) and template(got_error) == template(want), (got_error, want)


def test_backward_graphs_carry_no_index_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backward's indices are its forward's, checked there: gather's backward (a scatter_add over the same
    index) gets no extra output."""
    import neuron_compile.compiler as compiler

    split, counted = compiler.split_value_checks, []

    def counting(gm: torch.fx.GraphModule, index_bounds: bool = True) -> list[Any]:
        checks = split(gm, index_bounds=index_bounds)
        counted.append(len(checks))
        return checks

    monkeypatch.setattr(compiler, "split_value_checks", counting)
    x = torch.randn(4, 3, requires_grad=True)
    compiled = torch.compile(lambda x, i: torch.gather(x, 0, i).sum(), backend="neuron", dynamic=False)
    compiled(x, torch.tensor([[1, 2, 3]])).backward()
    assert counted[0] == 1 and counted[-1] == 0, counted  # forward (then its re-split: 0), backward
    assert torch.equal(x.grad, torch.zeros(4, 3).scatter_add(0, torch.tensor([[1, 2, 3]]), torch.ones(1, 3)))
    with pytest.raises(RuntimeError, match="index 4 is out of bounds for dimension 0 with size 4"):
        compiled(x, torch.tensor([[1, 4, 3]]))


# ---- random ---------------------------------------------------------------------------------------------------------
def _compiled(fn):
    return torch.compile(fn, backend="neuron", dynamic=False)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
def test_rand_randn_statistics(dtype) -> None:
    # Bounds are 5 standard errors of each statistic (plus bf16 rounding), under a fixed seed.
    torch.manual_seed(0)
    x = torch.zeros(256, 64, dtype=dtype)
    u, z, zl = _compiled(lambda t: (torch.rand(256, 64, dtype=dtype), torch.randn(256, 64, dtype=dtype),
                                    torch.randn_like(t)))(x)
    for t in (u, z, zl):
        assert t.dtype == dtype and t.shape == (256, 64)
    assert 0 <= u.min() and u.max() < 1, "rand must lie in [0, 1)"
    u, z, zl = u.float(), z.float(), zl.float()
    n = u.numel()
    assert abs(u.mean() - 0.5) < 5 * (1 / 12 / n) ** 0.5 + 4e-3, f"rand mean {u.mean()}"
    assert abs(u.var() - 1 / 12) < 5 * (1 / 180 / n) ** 0.5 + 1e-3, f"rand var {u.var()}"
    for t in (z, zl):
        assert abs(t.mean()) < 5 / n**0.5 + 4e-3, f"randn mean {t.mean()}"
        assert abs(t.std() - 1) < 5 / (2 * n) ** 0.5 + 4e-3, f"randn std {t.std()}"
        assert abs((t**4).mean() - 3) < 5 * (96 / n) ** 0.5, f"randn kurtosis {(t**4).mean()}"
    assert not torch.equal(z, zl), "two random nodes must draw different streams"


def test_uniform_normal_bernoulli_exponential_randint() -> None:
    torch.manual_seed(0)  # bounds below are >= 4 standard errors of each statistic
    def fn(x):
        return (
            x.detach().clone().uniform_(-2.0, 3.0),
            x.detach().clone().normal_(1.5, 0.5),
            torch.normal(x, 2.0),
            torch.bernoulli(torch.full_like(x, 0.3)),
            x.detach().clone().bernoulli_(0.8),
            x.detach().clone().exponential_(2.0),
            torch.randint(3, 11, (128, 64)),
            torch.randint_like(x, 5),
        )

    x = torch.zeros(128, 64)
    uni, nor, nor_t, ber, ber_p, expo, ri, ril = _compiled(fn)(x)
    assert uni.min() >= -2 and uni.max() < 3 and abs(uni.mean() - 0.5) < 0.05
    assert abs(nor.mean() - 1.5) < 0.02 and abs(nor.std() - 0.5) < 0.01
    assert abs(nor_t.mean()) < 0.06 and abs(nor_t.std() - 2) < 0.04
    assert set(ber.unique().tolist()) <= {0.0, 1.0} and abs(ber.mean() - 0.3) < 0.02
    assert abs(ber_p.mean() - 0.8) < 0.02
    assert expo.min() >= 0 and abs(expo.mean() - 0.5) < 0.02
    assert ri.dtype == torch.int64 and ri.min() == 3 and ri.max() == 10
    assert abs(ri.float().mean() - 6.5) < 0.1
    assert ril.dtype == torch.float32 and set(ril.unique().tolist()) == {0.0, 1.0, 2.0, 3.0, 4.0}


@pytest.mark.parametrize("form", ["cpu", "neuron"])
def test_random_bits_per_target_form(form) -> None:
    """The neuron form draws uint32 generator words (neuronx-cc truncates 64-bit integers), the CPU form
    uint64 words split in two (XLA CPU makes them ~4x faster per bit); both give the same distributions:
    uniform mean and variance, normal moments, dropout's keep rate, each within 5 standard errors."""

    def draws(x):
        return torch.rand_like(x), torch.randn_like(x), torch.native_dropout(x, 0.3, True)[1]

    x = torch.zeros(300, 200)
    words = [line for line in lower_graph(make_fx(draws)(x), [x], "rng", target=form).stablehlo().splitlines()
             if "rng_bit_generator" in line]  # fmt: skip
    assert words and all(("xui32>)" in w) == (form == "neuron") for w in words), words
    torch.manual_seed(0)
    uniform, normal, keep = run_aten(draws, [x], form=form)
    n = x.numel()
    assert abs(float(uniform.mean()) - 0.5) < 5 * (1 / 12 / n) ** 0.5
    assert abs(float(uniform.var()) - 1 / 12) < 5 * (1 / 180 / n) ** 0.5
    assert abs(float(normal.mean())) < 5 / n**0.5 and abs(float(normal.var()) - 1) < 5 * (2 / n) ** 0.5
    assert abs(float(normal.pow(4).mean()) - 3) < 5 * (96 / n) ** 0.5
    assert abs(float(keep.float().mean()) - 0.7) < 5 * (0.21 / n) ** 0.5
    pairs = uniform.flatten().view(-1, 2) - 0.5  # the two halves of one 64-bit word on the CPU form
    assert abs(float((pairs[:, 0] * pairs[:, 1]).mean() * 12)) < 5 / (n / 2) ** 0.5  # correlation


def test_randperm_is_a_permutation() -> None:
    torch.manual_seed(0)
    x = torch.arange(50.0)
    out = _compiled(lambda t: t[torch.randperm(50)])(x)
    assert sorted(out.tolist()) == x.tolist() and not torch.equal(out, x)


MULTINOMIAL_WEIGHTS = torch.tensor([0.1, 0.2, 0.7, 0.0])


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
def test_multinomial_without_replacement_draws_ordered_pairs_in_proportion(dtype) -> None:
    """Two draws without replacement: pair (a, b) comes first-a-then-b with probability w_a * w_b / (1 - w_a);
    the zero-weight category is never drawn. 20,000 rows: each frequency within 4 standard errors."""
    torch.manual_seed(0)
    n = 20000
    draws = _compiled(lambda w: torch.multinomial(w, 2))(MULTINOMIAL_WEIGHTS.to(dtype).expand(n, 4).contiguous())
    assert draws.shape == (n, 2) and draws.dtype == torch.int64
    assert (draws[:, 0] != draws[:, 1]).all() and (draws != 3).all()
    w = MULTINOMIAL_WEIGHTS.double()
    for a in range(3):
        for b in range(3):
            if a != b:
                expected = float(w[a] * w[b] / (1 - w[a]))
                seen = float(((draws[:, 0] == a) & (draws[:, 1] == b)).double().mean())
                assert abs(seen - expected) < 4 * (expected * (1 - expected) / n) ** 0.5, f"pair ({a}, {b})"


def test_multinomial_with_replacement_and_categorical_sample() -> None:
    """With replacement, every sample is an independent draw in proportion to the weights; a policy's
    ``Categorical(logits=...).sample()`` (multinomial of one) compiles and draws the same way."""
    torch.manual_seed(0)
    rows = MULTINOMIAL_WEIGHTS.expand(4000, 4).contiguous()
    draws = _compiled(lambda w: torch.multinomial(w, 5, replacement=True))(rows)
    assert draws.shape == (4000, 5)
    sampled = _compiled(lambda lg: torch.distributions.Categorical(logits=lg).sample())(rows.log())
    for got in (draws.flatten(), sampled):
        freq = torch.bincount(got, minlength=4).double() / got.numel()
        se = (MULTINOMIAL_WEIGHTS.double() * (1 - MULTINOMIAL_WEIGHTS.double()) / got.numel()).sqrt()
        assert ((freq - MULTINOMIAL_WEIGHTS.double()).abs() <= 4 * se + 1e-12).all(), freq


def test_multinomial_uniforms_stay_inside_the_open_interval() -> None:
    """The Gumbel key -log(-log u) of every 32-bit draw is finite: a u of exactly 1.0 (what a 24-bit grid's
    last midpoint rounds to in float32) made an infinite key, NaN against a zero weight's -inf, and top-k
    took the NaN for the largest: a zero-weight category drawn about once per 16 million keys."""
    import jax.numpy as jnp
    import numpy as np

    from neuron_compile.lowering.random import uniform_open

    bits = np.array([0, 1, 511, 512, 2**31, 2**32 - 513, 2**32 - 512, 2**32 - 1], dtype=np.uint32)
    u = np.asarray(uniform_open(jnp.asarray(bits)), dtype=np.float64)
    assert ((u > 0) & (u < 1)).all(), u
    assert np.isfinite(-np.log(-np.log(u.astype(np.float32)))).all()


@pytest.mark.parametrize(
    "weights",
    [[[0.2, float("nan"), 0.5]], [[0.2, -0.1, 0.5]], [[0.2, float("inf"), 0.5]], [[0.2, 0.3, 0.5], [0.0, 0.0, 0.0]]],
    ids=["nan", "negative", "inf", "zero_row"],
)
def test_multinomial_refuses_invalid_weights_as_eager(weights) -> None:
    """Eager raises on such weights; the graph cannot, so the check runs after it (value_checks) with eager's
    message, where the sampler alone would draw arbitrary categories."""
    w = torch.tensor(weights)
    with pytest.raises(RuntimeError) as expected:
        torch.multinomial(w, 1)
    with pytest.raises(RuntimeError) as got:
        _compiled(lambda t: torch.multinomial(t, 1))(w)
    assert str(got.value) == str(expected.value)


def test_random_reproducible_under_manual_seed() -> None:
    fn = _compiled(lambda t: t + torch.rand(4, 5) + F.dropout(torch.ones(4, 5), 0.5) + torch.multinomial(t + 1, 5))
    x = torch.zeros(4, 5)
    torch.manual_seed(123)
    a = fn(x)
    b = fn(x)
    torch.manual_seed(123)
    c = fn(x)
    assert torch.equal(a, c), "torch.manual_seed must make compiled random ops reproducible"
    assert not torch.equal(a, b), "each call must draw fresh random numbers"


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
def test_native_dropout_mask_output_and_grad_agree(dtype) -> None:
    torch.manual_seed(0)
    p = 0.3
    x = (torch.randn(64, 128) + 3).to(dtype).requires_grad_(True)  # never 0: a dropped element is visible
    out = _compiled(lambda t: F.dropout(t, p, training=True))(x)
    kept = out != 0
    frac = kept.float().mean().item()
    assert abs(frac - (1 - p)) < 0.02, f"kept fraction {frac}"
    expected = (x.detach().float() * (1 / (1 - p))).to(dtype)
    torch.testing.assert_close(out[kept], expected[kept], rtol=TOL["exact"][dtype][0], atol=0)
    g = torch.randn(64, 128).to(dtype)
    out.backward(g)
    torch.testing.assert_close(x.grad, torch.where(kept, (g.float() / (1 - p)).to(dtype), 0),
                               rtol=TOL["exact"][dtype][0], atol=0)


def test_dropout_eval_is_identity() -> None:
    x = torch.randn(8, 8)
    out = _compiled(lambda t: F.dropout(t, 0.5, training=False) * 1.0)(x)
    assert torch.equal(out, x)
