"""Checks eager makes on values, which a Trainium graph cannot raise on: taken out of the graph as extra
outputs and run after it in Python, so the user gets eager's exception.

A Trainium graph cannot raise on a value (neuronx-cc has no conditional and no assert). Two kinds of check:

- torch.linalg's (``linalg.cholesky`` of a matrix that is not positive-definite, ``linalg.inv``/``solve``/
  ``lu_factor`` of a singular one). Eager's ``torch.linalg.cholesky(A)`` is ``linalg_cholesky_ex(A)``
  followed by ``aten._linalg_check_errors(info, "linalg.cholesky", is_matrix=...)``, which raises
  ``LinAlgError`` when ``info`` is nonzero; AOTAutograd keeps that check in the graph as an effectful node,
  ``with_effects(token, aten._linalg_check_errors, info, ...)``. Each ``info`` it tests becomes an extra
  output and the very same aten check runs on it. ``torch.cholesky`` (deprecated) checks inside its own
  kernel: its node becomes ``linalg_cholesky_ex`` plus the same check under the name "cholesky", which gives
  eager's message word for word.
- integer division by zero (``//``, ``%``, ``torch.div(..., rounding_mode=)``, ``fmod`` of integers), which
  eager refuses with ``RuntimeError: ZeroDivisionError`` and XLA would answer with an arbitrary number: each
  such node's "some divisor is 0" flag becomes an extra output.
- indices out of range (advanced indexing, ``index_select``, ``embedding``, ``gather``/``scatter``,
  ``index_add``/``copy``/``fill``/``reduce``/``put``, ``take``, ``nll_loss`` targets), which eager refuses
  with an ``IndexError``/``RuntimeError`` and XLA's gather and scatter would clamp or drop: the smallest and
  largest index of each (ignored ``nll_loss`` targets aside) become an extra output, and eager's error type
  and message are rebuilt from them (naming the largest or smallest offending index, where eager names the
  first). Forward and inference graphs only: a backward graph's indices are the forward's, checked there.
- ``multinomial``'s weights: eager refuses a negative, infinite or NaN weight, and a row whose weights sum to
  0; the sampler would draw arbitrary categories. Two flags ("some weight is invalid", "some row sums to
  <= 0") become an extra output, and eager's message is raised from them.
- ``poisson``'s rates: eager refuses a negative or NaN rate; "all rates are >= 0" becomes an extra output
  (an ``AssertCheck`` with eager's message).
- eigh's, svd's and pinv's convergence: eager's LAPACK raises ``LinAlgError`` when it does not converge (a
  non-finite input included); the Jacobi lowering leaves NaN values there, so "all values (pinv: all
  entries) are finite" becomes an extra output (an ``AssertCheck`` raising ``LinAlgError`` with eager's message; eigh's without LAPACK's
  error code).
- ``aten._assert_async.msg(condition, message)``, which torch's decompositions emit for their own checks
  (``F.one_hot``'s class values): the condition becomes an extra output and a false one raises
  ``RuntimeError(message)``.

The cost is one small output per check. On the ``neuron`` device the checks run at its next synchronization
(``DEFERRED_CHECKS``), their conditions evaluated on the device.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from .provenance import op_name, user_source

_CHECK = torch.ops.aten._linalg_check_errors.default
_EMPTY_TOKEN = torch.empty(0)
_CHOLESKY = torch.ops.aten.cholesky.default
_CHOLESKY_EX = torch.ops.aten.linalg_cholesky_ex.default
_aten = torch.ops.aten
#: Ops that raise ZeroDivisionError on an integer divisor (their second argument) of 0 in eager.
_INTEGER_DIVISIONS = frozenset({
    _aten.div.Tensor_mode, _aten.div.Scalar_mode, _aten.remainder.Tensor, _aten.remainder.Scalar,
    _aten.remainder.Scalar_Tensor, _aten.fmod.Tensor, _aten.fmod.Scalar, _aten.floor_divide.default,
    _aten.floor_divide.Scalar,
})  # fmt: skip
_CHECKED = "neuron_value_checked"


@dataclass(frozen=True)
class _Bounds:
    """Where an op's index is and what eager accepts: ``index`` the argument's position, ``dim`` the
    argument naming the indexed dim (None: dim 0, or all elements with ``flat``), indices in
    [-n, n) with ``negative`` else [0, n); the error eager raises, its message a format of the offending
    value v, its position p, the dim d and its size n."""

    index: int
    dim: int | None
    negative: bool
    error: type[Exception]
    message: str
    flat: bool = False


_OUT_OF_BOUNDS = "index {v} is out of bounds for dimension {d} with size {n}"
_IN_SELF = "index out of range in self"
_BOUNDS = {
    _aten.index_select.default: _Bounds(2, 1, False, IndexError, _IN_SELF),
    _aten.embedding.default: _Bounds(1, None, False, IndexError, _IN_SELF),
    _aten.gather.default: _Bounds(2, 1, False, RuntimeError, _OUT_OF_BOUNDS),
    **{op: _Bounds(2, 1, False, RuntimeError, _OUT_OF_BOUNDS)
       for op in (_aten.scatter.src, _aten.scatter.value, _aten.scatter.reduce, _aten.scatter.value_reduce,
                  _aten.scatter_add.default, _aten.scatter_reduce.two, _aten.index_add.default)},
    _aten.index_copy.default: _Bounds(2, 1, False, IndexError, "index_copy_(): " + _OUT_OF_BOUNDS),
    _aten.index_fill.int_Scalar: _Bounds(2, 1, True, IndexError, _OUT_OF_BOUNDS),
    _aten.index_fill.int_Tensor: _Bounds(2, 1, True, IndexError, _OUT_OF_BOUNDS),
    _aten.index_reduce.default: _Bounds(2, 1, False, IndexError, _IN_SELF),
    _aten.take.default: _Bounds(1, None, True, IndexError,
                                "out of range: tried to access index {v} on a tensor of {n} elements.", flat=True),
    **{op: _Bounds(  # {p}: the offender's position in the flattened index
        1, None, False, RuntimeError, "Index {p} of input takes value {v} which is not in the valid range [0, {n})")
       for op in (_aten._embedding_bag.default, _aten._embedding_bag_forward_only.default)},
}  # fmt: skip
_MULTINOMIAL = _aten.multinomial.default
_MULTINOMIAL_ERRORS = (  # eager's messages, word for word
    "probability tensor contains either `inf`, `nan` or element < 0",
    "invalid multinomial distribution (sum of probabilities <= 0)",
)
_POISSON = _aten.poisson.default
_POISSON_ERROR = "invalid Poisson rate, expected rate to be non-negative"  # eager's message, word for word
_ASSERT = _aten._assert_async.msg
#: Spectral decompositions: eager's LAPACK raises when it does not converge (non-finite input included);
#: ours leaves NaN there (lowering/spectral.py). (op, index of its values output, eager's message.)
_EIGH = (
    "linalg.eigh",
    "The algorithm failed to converge because the input matrix is ill-conditioned or has too "
    "many repeated eigenvalues.",
)
_SVD = ("linalg.svd", "The algorithm failed to converge because the input matrix contained non-finite values.")
#: op -> (index of its values output, None: the result itself; trailing dims of one batch element; message)
_CONVERGENCE = {
    _aten._linalg_eigh.default: (0, 1, _EIGH),
    _aten._linalg_svd.default: (1, 1, _SVD),
    _aten.linalg_pinv.atol_rtol_tensor: (None, 2, _SVD),  # hermitian=True: _EIGH
}
#: aten ops that no lowering sees: taken out of the graph here and run after it (docs/ops.md lists them).
RUN_AFTER_GRAPH = frozenset({str(_ASSERT)})
#: Advanced indexing: a list of optional index tensors, the k-th indexing dim k, negative indices allowed.
_INDEX_LISTS = frozenset({_aten.index.Tensor, _aten.index_put.default})
_NLL_LOSSES = frozenset({_aten.nll_loss_forward.default, _aten.nll_loss2d_forward.default})
_INDEXING = _BOUNDS.keys() | _INDEX_LISTS | _NLL_LOSSES


@dataclass(frozen=True)
class LinalgCheck:
    """torch.linalg's ``info`` check of one call (``api_name`` as eager names it)."""

    api_name: str
    is_matrix: bool

    def __call__(self, info: torch.Tensor) -> None:
        _CHECK(info, self.api_name, is_matrix=self.is_matrix)

    def holds(self, info: torch.Tensor) -> torch.Tensor:
        return (info == 0).all()


@dataclass(frozen=True)
class ZeroDivisionCheck:
    """Eager's refusal of an integer division by zero, for one node (named, with the user's line)."""

    op: str
    source: str

    def __call__(self, some_divisor_is_zero: torch.Tensor) -> None:
        if bool(some_divisor_is_zero):
            error = RuntimeError("ZeroDivisionError")  # eager's message, word for word
            error.add_note(f"neuron backend: integer division by zero in {self.op} at {self.source}")
            raise error

    def holds(self, some_divisor_is_zero: torch.Tensor) -> torch.Tensor:
        return torch.logical_not(some_divisor_is_zero).all()


@dataclass(frozen=True)
class IndexBoundsCheck:
    """Eager's refusal of an index outside [low, high) of one indexed dim, from the index's smallest and
    largest value (and their positions in the flattened index, for a message that names it: {p})."""

    low: int
    high: int
    dim: int
    error: type[Exception]
    message: str
    op: str
    source: str

    def __call__(self, extremes: torch.Tensor) -> None:
        smallest, largest, *positions = extremes.tolist()
        if self.low <= smallest and largest < self.high:
            return
        at_smallest, at_largest = positions or (None, None)
        v, p = (largest, at_largest) if largest >= self.high else (smallest, at_smallest)
        error = self.error(self.message.format(v=v, p=p, d=self.dim, n=self.high))
        error.add_note(f"neuron backend: index out of range in {self.op} at {self.source}")
        raise error

    def holds(self, extremes: torch.Tensor) -> torch.Tensor:
        return (extremes[0] >= self.low) & (extremes[1] < self.high)


@dataclass(frozen=True)
class AssertCheck:
    """An ``_assert_async`` of torch's decompositions: ``RuntimeError(message)`` when the condition is false."""

    message: str
    op: str
    source: str

    def __call__(self, condition: torch.Tensor) -> None:
        if not bool(condition):
            error = RuntimeError(self.message)
            error.add_note(f"neuron backend: a check of {self.op} at {self.source}")
            raise error

    def holds(self, condition: torch.Tensor) -> torch.Tensor:
        return condition.bool().all()


@dataclass(frozen=True)
class ConvergenceCheck:
    """Eager's LinAlgError of a spectral decomposition that did not converge, from one "values are finite" flag
    per batch element (eager's message, naming the first failing element of a batch; LAPACK's error code,
    which eager's eigh message ends with, has no counterpart here)."""

    api: str
    reason: str
    batched: bool
    op: str
    source: str

    def __call__(self, finite: torch.Tensor) -> None:
        failed = (~finite.reshape(-1)).nonzero()
        if failed.numel():
            where = f"(Batch element {int(failed[0])}): " if self.batched else ""
            error = torch.linalg.LinAlgError(f"{self.api}: {where}{self.reason}")
            error.add_note(f"neuron backend: a check of {self.op} at {self.source}")
            raise error

    def holds(self, finite: torch.Tensor) -> torch.Tensor:
        return finite.bool().all()


@dataclass(frozen=True)
class MultinomialCheck:
    """Eager's refusal of invalid multinomial weights, from the flags of ``_MULTINOMIAL_ERRORS``."""

    op: str
    source: str

    def __call__(self, flags: torch.Tensor) -> None:
        for failed, message in zip(flags.tolist(), _MULTINOMIAL_ERRORS):
            if failed:
                error = RuntimeError(message)
                error.add_note(f"neuron backend: invalid weights in {self.op} at {self.source}")
                raise error

    def holds(self, flags: torch.Tensor) -> torch.Tensor:
        return torch.logical_not(flags.bool().any())


Check = LinalgCheck | ZeroDivisionCheck | IndexBoundsCheck | AssertCheck | ConvergenceCheck | MultinomialCheck

#: Set by the ``neuron`` device when it is registered: ``DEFERRED_CHECKS(checks, values)`` takes a graph's checks
#: whose values are tensors of that device (returns True), to run them at its next synchronization, as CUDA
#: reports a device-side assert: reading them after every graph would move bytes and wait for the device at
#: every call. Each check's ``holds(value)`` is its condition as a torch expression, evaluated on the device.
DEFERRED_CHECKS: Any = None


class CheckedGraph:
    """A boxed callable (AOTAutograd's compiler convention): runs ``inner``, then each check on its trailing
    extra output, which it strips from the result."""

    def __init__(self, inner: Any, checks: list[Check]) -> None:
        self._boxed_call = True
        self.inner = inner
        self.name = getattr(inner, "name", "")
        #: One per extra output, in order (picklable: AOTAutograd's cache keeps them with the inner's digest).
        self.checks = checks
        #: The inner graph's compile-cache entry, for AOTAutograd's cache (``aot_cache``); None when it has none
        #: or when torch.linalg's checks are among its checks: their graphs take effect tokens, which a hit of
        #: AOTAutograd's cache does not pass the same way (measured: the graph got too few inputs).
        linalg = any(isinstance(check, LinalgCheck) for check in checks)
        self.cache_digest: str | None = None if linalg else getattr(inner, "cache_digest", None)

    def __call__(self, args: list[Any]) -> list[Any]:
        # AOTAutograd passes None for an effect token at run time; the graph only forwards it.
        args[:] = [_EMPTY_TOKEN if a is None else a for a in args]
        out = list(self.inner(args))
        values = out[len(out) - len(self.checks) :]
        del out[len(out) - len(self.checks) :]
        if DEFERRED_CHECKS is not None and DEFERRED_CHECKS(self.checks, values):
            return out
        for check, value in zip(self.checks, values):
            if isinstance(value, torch.Tensor) and not value.is_meta:
                check(value)
        return out


def split_value_checks(gm: torch.fx.GraphModule, index_bounds: bool = True) -> list[Check]:
    """Rewrite ``gm`` in place so that each check's value is an extra output (see the module docstring);
    ``index_bounds``: check indices too (not in a backward graph). Returns the checks in output order;
    empty when the graph has none."""
    graph = gm.graph
    found: list[tuple[Check, torch.fx.Node]] = []
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _CHOLESKY:
            info = _split_cholesky(graph, node)
            found.append((LinalgCheck("cholesky", info.meta["val"].dim() == 0), info))
        elif node.target is torch.ops.higher_order.with_effects:
            found += _split_linalg_check(graph, node)
        elif node.target is _ASSERT:
            condition, message = node.args[0], str(node.args[1])
            graph.erase_node(node)  # its result (None) has no users
            found.append((AssertCheck(message, op_name(node), user_source(node)), condition))
        elif _CHECKED in node.meta:
            continue  # the graph with the checks' outputs is split again when it is compiled
        elif node.target in _INTEGER_DIVISIONS:
            node.meta[_CHECKED] = True
            flag = _zero_divisor_flag(graph, node)
            if flag is not None:
                found.append((ZeroDivisionCheck(op_name(node), user_source(node)), flag))
        elif node.target is _MULTINOMIAL:
            node.meta[_CHECKED] = True
            found.append((MultinomialCheck(op_name(node), user_source(node)), _multinomial_flags(graph, node)))
        elif node.target in _CONVERGENCE:
            node.meta[_CHECKED] = True
            position, core, (api, reason) = _CONVERGENCE[node.target]
            api, reason = _EIGH if node.kwargs.get("hermitian", False) else (api, reason)
            emit = _Inserter(graph, node)
            values = node if position is None else emit(operator.getitem, node, position)
            ndim = values.meta["val"].dim()
            finite = emit(_aten.eq.Scalar, emit(_aten.sub.Tensor, values, values), 0)  # x - x is NaN for inf/NaN
            finite = emit(_aten.all.dims, finite, list(range(ndim - core, ndim)))
            check = ConvergenceCheck(api, reason, ndim > core, op_name(node), user_source(node))
            found.append((check, finite))
        elif node.target is _POISSON:
            node.meta[_CHECKED] = True
            emit = _Inserter(graph, node)
            valid = emit(_aten.all.default, emit(_aten.ge.Scalar, node.args[0], 0))  # NaN is not >= 0
            found.append((AssertCheck(_POISSON_ERROR, op_name(node), user_source(node)), valid))
        elif index_bounds and node.target in _INDEXING:
            node.meta[_CHECKED] = True
            found += _index_checks(graph, node)
    if found:
        out = next(n for n in graph.nodes if n.op == "output")
        out.args = (tuple(out.args[0]) + tuple(value for _, value in found),)
        graph.lint()
        gm.recompile()
    return [check for check, _ in found]


def _split_linalg_check(graph: torch.fx.Graph, node: torch.fx.Node) -> list[tuple[Check, torch.fx.Node]]:
    """``with_effects(token, _linalg_check_errors, info, name, is_matrix=)`` removed (its token passes
    through): its check on ``info``; none for another effectful op or result shape."""
    if len(node.args) < 4 or node.args[1] is not _CHECK:
        return []
    token, _, info, api_name = node.args[:4]
    getters = list(node.users)
    if any(u.target is not operator.getitem or u.args[1] != 0 for u in getters):
        return []  # not the (token,) result shape this rewrite knows
    for u in getters:
        u.replace_all_uses_with(token)
        graph.erase_node(u)
    graph.erase_node(node)
    return [(LinalgCheck(str(api_name), bool(node.kwargs.get("is_matrix", True))), info)]


class _Inserter:
    """Inserts nodes one after another, from ``after`` on, each with its ``val`` computed on fake tensors and
    marked checked (a check's own ops are not checked again)."""

    def __init__(self, graph: torch.fx.Graph, after: torch.fx.Node) -> None:
        self.graph, self.last, self.meta = graph, after, after.meta
        self.fake_mode = torch._guards.detect_fake_mode(pytree.tree_leaves(after.meta["val"]))

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        with self.graph.inserting_after(self.last):
            node = self.graph.call_function(target, args, kwargs)
        metas = torch.fx.node.map_arg(args, lambda a: a.meta["val"])
        with self.fake_mode:
            node.meta = {**self.meta, "val": target(*metas, **kwargs), _CHECKED: True}
        self.last = node
        return node


def _zero_divisor_flag(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node | None:
    """A bool node "some divisor of this integer division is 0", or None when it cannot be (a float
    division, a nonzero constant divisor, an empty result)."""
    result = node.meta.get("val")
    if not isinstance(result, torch.Tensor) or result.dtype.is_floating_point or result.dtype.is_complex:
        return None
    if node.target in (_aten.div.Tensor_mode, _aten.div.Scalar_mode) and node.kwargs.get("rounding_mode") is None:
        return None  # true division: a float result
    if result.numel() == 0 or result.dtype == torch.bool:
        return None
    divisor = node.args[1]
    emit = _Inserter(graph, node)
    if isinstance(divisor, torch.fx.Node):
        return emit(_aten.any.default, emit(_aten.eq.Scalar, divisor, 0))
    return None if divisor != 0 else emit(_aten.scalar_tensor.default, 1, dtype=torch.bool)


def _index_checks(graph: torch.fx.Graph, node: torch.fx.Node) -> list[tuple[Check, torch.fx.Node]]:
    """(check, extremes node) of each index tensor ``node`` indexes with (none when there is nothing to
    check: an empty index, a boolean mask)."""
    args = node.args
    where = (op_name(node), user_source(node))
    found: list[tuple[Check, torch.fx.Node]] = []

    def add(index: Any, d: int, n: int, negative: bool, error: type[Exception], message: str,
            ignore: Any = None) -> None:  # fmt: skip
        if not isinstance(index, torch.fx.Node):
            return
        val = index.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.numel() == 0 or val.dtype in (torch.bool, torch.uint8):
            return
        extremes = _extremes(_Inserter(graph, node), index, ignore, positions="{p}" in message)
        found.append((IndexBoundsCheck(-n if negative else 0, n, d, error, message, *where), extremes))

    if node.target in _INDEX_LISTS:
        shape = args[0].meta["val"].shape
        for d, index in enumerate(args[1]):
            add(index, d, shape[d], True, IndexError, _OUT_OF_BOUNDS)
    elif node.target in _NLL_LOSSES:
        scores, target, ignore_index = args[0].meta["val"], args[1], args[4]
        classes = scores.shape[1] if scores.dim() > 1 else scores.shape[0]
        add(target, 1, classes, False, IndexError, "Target {v} is out of bounds.", ignore=ignore_index)
    else:
        rule = _BOUNDS[node.target]
        source = args[0].meta["val"]
        if rule.flat:
            d, n = 0, source.numel()
        elif rule.dim is None:
            d, n = 0, source.shape[0]
        else:
            d = args[rule.dim] % max(source.dim(), 1)
            n = source.shape[d] if source.dim() else 1
        add(args[rule.index], d, n, rule.negative, rule.error, rule.message)
    return found


def _multinomial_flags(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    """A bool[2] node: some weight is negative, infinite or NaN; some row of weights sums to <= 0."""
    emit = _Inserter(graph, node)
    weights = node.args[0]
    valid = emit(_aten.logical_and.default, emit(_aten.ge.Scalar, weights, 0), emit(_aten.lt.Scalar, weights, math.inf))
    invalid = emit(_aten.any.default, emit(_aten.logical_not.default, valid))  # NaN is neither >= 0 nor < inf
    empty_row = emit(_aten.any.default, emit(_aten.le.Scalar, emit(_aten.sum.dim_IntList, weights, [-1]), 0))
    return emit(_aten.cat.default, [emit(_aten.unsqueeze.default, flag, 0) for flag in (invalid, empty_row)])


def _extremes(emit: _Inserter, index: torch.fx.Node, ignore: Any, positions: bool) -> torch.fx.Node:
    """An int64 node: the smallest and largest element of ``index``, then, with ``positions``, where they are
    in it, flattened (elements equal to ``ignore`` count as 0, which every check accepts). Positions only
    where the message names one: two more reductions per index, every step."""
    if ignore is not None:
        index = emit(_aten.mul.Tensor, index, emit(_aten.ne.Scalar, index, ignore))
    wide = emit(_aten._to_copy.default, index, dtype=torch.int64)
    reductions = (_aten.amin.default, _aten.amax.default)
    if positions:
        reductions += (_aten.argmin.default, _aten.argmax.default)
    return emit(_aten.cat.default, [emit(_aten.unsqueeze.default, emit(reduce, wide), 0) for reduce in reductions])


def _split_cholesky(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    """Replace ``cholesky(A, upper)`` by ``linalg_cholesky_ex(A, upper=upper)``; return its info node."""
    a = node.args[0]
    upper = node.args[1] if len(node.args) > 1 else node.kwargs.get("upper", False)
    factor = node.meta["val"]
    with factor.fake_mode:
        info = torch.empty(factor.shape[:-2], dtype=torch.int32)
    with graph.inserting_after(node):
        ex = graph.call_function(_CHOLESKY_EX, (a,), {"upper": bool(upper)})
        ex.meta = {**node.meta, "val": (factor, info)}
    with graph.inserting_after(ex):
        new_factor = graph.call_function(operator.getitem, (ex, 0))
        new_factor.meta = {**node.meta, "val": factor}
    with graph.inserting_after(new_factor):
        new_info = graph.call_function(operator.getitem, (ex, 1))
        new_info.meta = {**node.meta, "val": info}
    node.replace_all_uses_with(new_factor)
    graph.erase_node(node)
    return new_info
