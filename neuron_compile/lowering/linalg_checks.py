"""The error checks of torch.linalg (``linalg.cholesky`` of a matrix that is not positive-definite,
``linalg.inv``/``linalg.solve``/``linalg.lu_factor`` of a singular one), run after the compiled graph.

Eager's ``torch.linalg.cholesky(A)`` is ``linalg_cholesky_ex(A)`` followed by
``aten._linalg_check_errors(info, "linalg.cholesky", is_matrix=...)``, which raises ``LinAlgError`` when
``info`` is nonzero. AOTAutograd keeps that check in the graph as an effectful node,
``with_effects(token, aten._linalg_check_errors, info, ...)``. A Trainium graph cannot raise on a value
(neuronx-cc has no conditional and no assert), so the check is taken out of the graph: each ``info`` it
tests becomes an extra output, and after the graph has run the very same aten check runs on it in Python.
The user gets eager's exception and message; the cost is one int32 output per check.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

_CHECK = torch.ops.aten._linalg_check_errors.default
_EMPTY_TOKEN = torch.empty(0)


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
