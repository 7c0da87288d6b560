"""MLIR locations -> aten nodes: every op traced for a node sits under that node's named scope
(``aten.op#node@file.py:LINE``), which the lowering's node table maps to the op, inputs and user line."""

from __future__ import annotations

import re

from .checks import Finding
from .report import Violation

_QUOTED = re.compile(r'"([^"]*)"')


def scope_of(location: str, node_table: dict[str, dict[str, str]]) -> str | None:
    """The node scope ('aten.op#node@file.py:LINE') named in an MLIR location, innermost first."""
    for text in _QUOTED.findall(location):
        parts = text.split("/")
        for part in reversed(parts):
            if part in node_table:
                return part
        for part in reversed(parts):
            if "#" in part and not part.startswith("jit("):
                return part
    return None


def violation_from(f: Finding, node_table: dict[str, dict[str, str]]) -> Violation:
    scope = scope_of(f.location, node_table)
    info = node_table.get(scope or "", {})
    if not info and scope:
        # No table (a module lowered elsewhere): the scope string itself names op, node and short source.
        op, _, rest = scope.partition("#")
        node, _, src = rest.partition("@")
        info = {"op": op, "node": node, "inputs": "", "source": src or "<unknown source line>"}
    return Violation(
        hlo_op=f.hlo_op,
        detail=f.detail,
        op=info.get("op", f.hlo_op),
        node=info.get("node", ""),
        inputs=info.get("inputs", ""),
        source=info.get("source", "<unknown source line>"),
        location=f.location,
    )


def op_of(location: str, node_table: dict[str, dict[str, str]]) -> str | None:
    """The aten op whose scope ``location`` lies in, or None (graph glue)."""
    scope = scope_of(location, node_table)
    if scope is None:
        return None
    return node_table[scope]["op"] if scope in node_table else scope.partition("#")[0]
