"""What the legality pass reports: each illegal HLO op with the aten node and user line behind it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import UnsupportedNode
from . import rules


@dataclass
class Violation:
    """One illegal HLO op, with the aten node and user line it came from."""

    hlo_op: str
    detail: str
    op: str  # aten op of the node (or the HLO op when no node could be found)
    node: str
    inputs: str
    source: str
    location: str


@dataclass
class LegalityReport:
    """What the legality pass saw in one module, for one generation."""

    graph_name: str
    target: str
    generation: str
    int64_native: bool
    violations: list[Violation] = field(default_factory=list)
    op_counts: dict[str, int] = field(default_factory=dict)
    assumed_ops: dict[str, int] = field(default_factory=dict)
    device_calls: dict[str, int] = field(default_factory=dict)
    uses_int64: bool = False
    seconds: float = 0.0

    @property
    def legal(self) -> bool:
        return not self.violations

    def unsupported_nodes(self) -> list[UnsupportedNode]:
        """One entry per offending aten node (all its illegal HLO ops folded into the reason)."""
        grouped: dict[tuple[str, str], list[Violation]] = {}
        for v in self.violations:
            grouped.setdefault((v.node or v.location, v.op), []).append(v)
        nodes = []
        for vs in grouped.values():
            details = list(dict.fromkeys(f"{v.hlo_op}: {v.detail}" for v in vs))
            nodes.append(
                UnsupportedNode(
                    op=vs[0].op,
                    inputs=vs[0].inputs,
                    source=vs[0].source,
                    reason=f"illegal for neuronx-cc ({self.generation}): " + "; ".join(details),
                )
            )
        return nodes

    def summary(self) -> str:
        n_hlo = sum(v for k, v in self.op_counts.items() if k not in ("func.func", "func.return"))
        verdict = "legal" if self.legal else f"{len(self.unsupported_nodes())} illegal node(s)"
        extra = f", {sum(self.assumed_ops.values())} assumed-legal op(s)" if self.assumed_ops else ""
        return f"{n_hlo} HLO ops, {self.generation}: {verdict}{extra}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"legal": self.legal}

    def to_text(self) -> str:
        lines = [
            f"graph {self.graph_name}  target={self.target}  generation={self.generation}",
            f"verdict: {'LEGAL' if self.legal else 'ILLEGAL'}  ({self.summary()})",
            f"int64 in module: {self.uses_int64}; native int64 ({rules.NATIVE_INT64_FLAG}): {self.int64_native}",
        ]
        if self.violations:
            lines.append("violations:")
            lines += [n.describe() for n in self.unsupported_nodes()]
        if self.device_calls:
            lines.append("device calls: " + ", ".join(f"{k} x{v}" for k, v in sorted(self.device_calls.items())))
        if self.assumed_ops:
            lines.append(
                "legal only by assumption (absent from the public operator list): "
                + ", ".join(f"{k} x{v}" for k, v in sorted(self.assumed_ops.items()))
            )
        lines.append("HLO op counts:")
        lines += [f"  {k}: {v}" for k, v in sorted(self.op_counts.items())]
        return "\n".join(lines)
