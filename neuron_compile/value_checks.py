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

The cost is one small output per check.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch

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
_CHECKED = "neuron_zero_divisor_checked"


@dataclass(frozen=True)
class LinalgCheck:
    """torch.linalg's ``info`` check of one call (``api_name`` as eager names it)."""

    api_name: str
    is_matrix: bool

    def __call__(self, info: torch.Tensor) -> None:
        _CHECK(info, self.api_name, is_matrix=self.is_matrix)


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


Check = LinalgCheck | ZeroDivisionCheck


class CheckedGraph:
    """A boxed callable (AOTAutograd's compiler convention): runs ``inner``, then each check on its trailing
    extra output, which it strips from the result."""

    def __init__(self, inner: Any, checks: list[Check]) -> None:
        self._boxed_call = True
        self.inner = inner
        self.name = getattr(inner, "name", "")
        #: One per extra output, in order.
        self.checks = checks

    def __call__(self, args: list[Any]) -> list[Any]:
        # AOTAutograd passes None for an effect token at run time; the graph only forwards it.
        args[:] = [_EMPTY_TOKEN if a is None else a for a in args]
        out = list(self.inner(args))
        values = out[len(out) - len(self.checks) :]
        del out[len(out) - len(self.checks) :]
        for check, value in zip(self.checks, values):
            if isinstance(value, torch.Tensor) and not value.is_meta:
                check(value)
        return out


def split_value_checks(gm: torch.fx.GraphModule) -> list[Check]:
    """Rewrite ``gm`` in place so that each check's value is an extra output (see the module docstring).
    Returns the checks in output order; empty when the graph has none."""
    graph = gm.graph
    checks: list[Check] = []
    values: list[torch.fx.Node] = []
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is _CHOLESKY:
            values.append(_split_cholesky(graph, node))
            checks.append(LinalgCheck("cholesky", values[-1].meta["val"].dim() == 0))
            continue
        if node.op == "call_function" and node.target in _INTEGER_DIVISIONS and _CHECKED not in node.meta:
            node.meta[_CHECKED] = True  # the rewritten graph is split again when it is compiled
            flag = _zero_divisor_flag(graph, node)
            if flag is not None:
                values.append(flag)
                checks.append(ZeroDivisionCheck(op_name(node), user_source(node)))
            continue
        if node.op != "call_function" or node.target is not torch.ops.higher_order.with_effects:
            continue
        if len(node.args) < 4 or node.args[1] is not _CHECK:
            continue
        token, _, info, api_name = node.args[:4]
        getters = list(node.users)
        if any(u.target is not operator.getitem or u.args[1] != 0 for u in getters):
            continue  # not the (token,) result shape this rewrite knows
        for u in getters:
            u.replace_all_uses_with(token)
            graph.erase_node(u)
        graph.erase_node(node)
        checks.append(LinalgCheck(str(api_name), bool(node.kwargs.get("is_matrix", True))))
        values.append(info)
    if checks:
        out = next(n for n in graph.nodes if n.op == "output")
        out.args = (tuple(out.args[0]) + tuple(values),)
        graph.lint()
        gm.recompile()
    return checks


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
    with result.fake_mode, graph.inserting_after(node):
        if isinstance(divisor, torch.fx.Node):
            zeros = graph.call_function(_aten.eq.Scalar, (divisor, 0))
            zeros.meta = {**node.meta, "val": _aten.eq.Scalar(divisor.meta["val"], 0)}
            with graph.inserting_after(zeros):
                flag = graph.call_function(_aten.any.default, (zeros,))
            flag.meta = {**node.meta, "val": _aten.any.default(zeros.meta["val"])}
            return flag
        if divisor != 0:
            return None
        flag = graph.call_function(_aten.scalar_tensor.default, (1,), {"dtype": torch.bool})
        flag.meta = {**node.meta, "val": _aten.scalar_tensor.default(1, dtype=torch.bool)}
        return flag


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
