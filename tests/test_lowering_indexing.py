"""Op families, indexing ops (gather/scatter/index_put families, out-of-range indices: eager's error or its clamp/drop), compared with eager.

Each case runs both routes of tests/lowering_cases.py (torch.compile, and aten level) against eager.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from neuron_compile.errors import NeuronUnsupportedOpError

from .lowering_cases import (
    BF16,
    F32,
    I64,
    Case,
    assert_same,
    aten,
    check_compiled,
    const,
    distinct,
    randn,
    run_aten,
)

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
    Case(
        "scatter_reduce_add_legacy",
        lambda x, s: x.scatter(1, IDX, s, reduce="add"),
        [randn(2, 4), randn(2, 3)],
        grad=False,
    ),
    Case(
        "scatter_reduce_mul_legacy",
        lambda x, s: x.scatter(1, IDX, s, reduce="multiply"),
        [randn(2, 4), randn(2, 3)],
        grad=False,
    ),
    Case("scatter_add", lambda x, s: x.scatter_add(1, IDX, s), [randn(2, 4), randn(2, 3)], (F32, BF16)),
    Case("scatter_add_dup", lambda x, s: x.scatter_add(0, ZEROS_52, s), [randn(2, 2), randn(5, 2)], tol="sum"),
    *[
        Case(
            f"scatter_reduce_{r}_self{int(s)}",
            lambda x, v, r=r, s=s: x.scatter_reduce(1, DUP, v, r, include_self=s),
            [distinct(2, 4), distinct(2, 3, scale=0.5)],
            tol="sum",
            grad=r != "prod",
        )
        for r in ("sum", "prod", "mean", "amax", "amin")
        for s in (True, False)
    ],
    Case("index_rows", lambda x: x[I1], [randn(3, 4)], (F32,)),
    Case("index_cols_negative", lambda x: x[:, NEG], [randn(3, 4)]),
    Case("index_broadcast_2d", lambda x: x[I1[:, None], COLS_031], [randn(3, 4)]),
    Case("index_none_ellipsis", lambda x: x[None, I1, ..., None], [randn(3, 4, 2)]),
    Case("index_separated_front", lambda x: x[I1, :, COLS_1011], [randn(3, 2, 2)]),
    Case("index_int64_values", lambda x: x[NEG], [const(torch.arange(12).reshape(3, 4))], (I64,)),
    Case(
        "index_put_accumulate_dup",
        lambda x, v: x.index_put((I1,), v, accumulate=True),
        [randn(3, 4), randn(4, 4)],
        (F32, BF16),
        tol="sum",
    ),
    Case("index_put_set", lambda x, v: x.index_put((ROWS_20,), v), [randn(3, 4), randn(2, 4)]),
    Case("index_put_2d_broadcast", lambda x, v: x.index_put((ROWS_02, COLS_13), v), [randn(3, 4), randn(1)]),
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
    Case(
        "take_along_dim", lambda x: torch.take_along_dim(x, IDX, 1), [randn(2, 4)], requires=("aten.remainder.Scalar",)
    ),
    Case("select_scatter", lambda x, s: torch.select_scatter(x, s, 0, -1), [randn(3, 4), randn(4)]),
    Case("slice_scatter_step", lambda x, s: torch.slice_scatter(x, s, 1, 1, 6, 2), [randn(3, 7), randn(3, 3)]),
    Case("slice_scatter_dim0", lambda x, s: torch.slice_scatter(x, s, 0, 1, 3), [randn(4, 3), randn(2, 3)]),
    Case(
        "diagonal_scatter",
        lambda x, s: torch.diagonal_scatter(x, s, 1),
        [randn(3, 4), randn(3)],
        requires=("aten.diagonal.default",),
    ),
    Case(
        "diagonal_scatter_fw", lambda x, s: torch.diagonal_scatter(x, s, -1, 1, 0), [randn(3, 4), randn(3)], grad=False
    ),
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
    **{
        f"scatter_reduce_{r}_self{int(i)}": (
            lambda x, s, r=r, i=i: aten.scatter_reduce.two(x, 0, DUP_ROWS, s, r, include_self=i)
        )
        for r in ("sum", "prod")
        for i in (True, False)
    },
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
    assert_same(actual, expected, (0, 0), f"{name}(bool[4, 5], bool[5, 5])")


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
    torch.testing.assert_close(
        got.double(),
        exact.to(dtype).double(),
        rtol=ulp,
        atol=0,
        msg=lambda m: f"{name}({dtype}[3, 8], {dtype}[2048, 8]): {m}",
    )


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
