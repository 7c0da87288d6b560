"""The error checks of torch.linalg (``linalg.cholesky`` of a matrix that is not positive-definite,
``linalg.inv``/``linalg.solve``/``linalg.lu_factor`` of a singular one), run after the compiled graph.

Eager's ``torch.linalg.cholesky(A)`` is ``linalg_cholesky_ex(A)`` followed by
``aten._linalg_check_errors(info, "linalg.cholesky", is_matrix=...)``, which raises ``LinAlgError`` when
``info`` is nonzero. AOTAutograd keeps that check in the graph as an effectful node,
``with_effects(token, aten._linalg_check_errors, info, ...)``. A Trainium graph cannot raise on a value
(neuronx-cc has no conditional and no assert), so the check is taken out of the graph: each ``info`` it
tests becomes an extra output, and after the graph has run the very same aten check runs on it in Python.
The user gets eager's exception and message; the cost is one int32 output per check.

``torch.cholesky`` (deprecated) checks inside its own kernel: its node becomes ``linalg_cholesky_ex`` plus
the same check under the name "cholesky", which gives eager's message word for word.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

_CHECK = torch.ops.aten._linalg_check_errors.default
_EMPTY_TOKEN = torch.empty(0)
_CHOLESKY = torch.ops.aten.cholesky.default
_CHOLESKY_EX = torch.ops.aten.linalg_cholesky_ex.default


class CheckedGraph:
    """A boxed callable (AOTAutograd's compiler convention): runs ``inner``, then eager's
    ``_linalg_check_errors`` on the trailing ``info`` outputs, which it strips from the result."""

    def __init__(self, inner: Any, checks: list[tuple[str, bool]]) -> None:
        self._boxed_call = True
        self.inner = inner
        self.name = getattr(inner, "name", "")
        #: (api name, is_matrix) of each check, in the order of the extra outputs.
        self.checks = checks

    def __call__(self, args: list[Any]) -> list[Any]:
        # AOTAutograd passes None for an effect token at run time; the graph only forwards it.
        args[:] = [_EMPTY_TOKEN if a is None else a for a in args]
        out = list(self.inner(args))
        infos = out[len(out) - len(self.checks) :]
        del out[len(out) - len(self.checks) :]
        for (api_name, is_matrix), info in zip(self.checks, infos):
            if isinstance(info, torch.Tensor) and not info.is_meta:
                _CHECK(info, api_name, is_matrix=is_matrix)
        return out


def split_linalg_checks(gm: torch.fx.GraphModule) -> list[tuple[str, bool]]:
    """Rewrite ``gm`` in place: every ``with_effects(token, _linalg_check_errors, info, name, is_matrix=)``
    node is removed (its token passes through) and its ``info`` appended to the graph's outputs.
    Returns the (name, is_matrix) of each check, in output order; empty when the graph has none."""
    graph = gm.graph
    checks: list[tuple[str, bool]] = []
    infos: list[torch.fx.Node] = []
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is _CHOLESKY:
            infos.append(_split_cholesky(graph, node))
            checks.append(("cholesky", infos[-1].meta["val"].dim() == 0))
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
        checks.append((str(api_name), bool(node.kwargs.get("is_matrix", True))))
        infos.append(info)
    if checks:
        out = next(n for n in graph.nodes if n.op == "output")
        out.args = (tuple(out.args[0]) + tuple(infos),)
        graph.lint()
        gm.recompile()
    return checks


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
