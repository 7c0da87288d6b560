"""Legality pass: refuse, on every target, what neuronx-cc would refuse.

After lowering, ``check`` walks the StableHLO module (``checks.py``) against the declarative table of
what neuronx-cc accepts for the chosen generation (``rules.py``), maps every offending HLO op back to its
aten node and the user's file:line through the op's MLIR location (the named scope each node is traced
under), and raises the same ``NeuronUnsupportedOpError`` as the lowering. ``strict=False``
(``NEURON_COMPILE_STRICT=0``) turns that into a warning naming what would fail on Trainium.

How the CPU target is checked: the module the CPU runs is the module neuronx-cc would get, except at
device calls (``lowering/device_calls.py``). There the neuron target emits ``custom_call @AwsNeuronX``
and the CPU target a call to a private function ``AwsNeuronX__cpu_reference`` holding a StableHLO body.
The pass treats that call exactly as the custom call (same operands, results and restrictions) and never
looks inside the body, so both targets get the same verdict.
"""

from __future__ import annotations

import json
import re
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..errors import SUPPORTED_OPS_HINT, NeuronLegalityWarning, NeuronUnsupportedOpError, UnsupportedNode
from ..options import Options
from . import rules
from .checks import Finding, ModuleChecker, ModuleScan

__all__ = [
    "LegalityReport",
    "NeuronLegalityWarning",
    "OpVerdict",
    "Violation",
    "check",
    "check_module",
    "merge_verdicts",
    "verdict_by_generation",
    "verdicts_by_op",
]

STRICT_HINT = (
    SUPPORTED_OPS_HINT + " To run it on the CPU target anyway (it would still fail on Trainium), pass "
    "options={'strict': False} or set NEURON_COMPILE_STRICT=0."
)


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


# -- locations -> aten nodes ------------------------------------------------------------------------
_QUOTED = re.compile(r'"([^"]*)"')


def _scope_of(location: str, node_table: dict[str, dict[str, str]]) -> str | None:
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


def _violation(f: Finding, node_table: dict[str, dict[str, str]]) -> Violation:
    scope = _scope_of(f.location, node_table)
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


# -- entry points -----------------------------------------------------------------------------------
def _mlir_module(lowered: Any) -> Any:
    """An MLIR module from a LoweredGraph, a jax Lowered, an MLIR module or StableHLO text."""
    inner = getattr(lowered, "lowered", None)
    if inner is not None and hasattr(inner, "compiler_ir"):
        lowered = inner
    if hasattr(lowered, "compiler_ir"):
        return lowered.compiler_ir("stablehlo")
    if isinstance(lowered, str):
        from jax._src.interpreters import mlir
        from jax._src.lib.mlir import ir

        ctx = mlir.make_ir_context()
        return ir.Module.parse(lowered, context=ctx)
    return lowered


def int64_native(opts: Options) -> bool:
    """Whether int64 stays 64-bit on the device (see ``checks.dtype_problem`` for the policy).

    Neuron target: only if the neuronx-cc command line carries ``--native-int64``. CPU target: the
    verdict is for a neuron target run with that flag, which trn2 and trn3 both support.
    """
    if opts.target != "neuron":
        return True
    from ..runtime.neuron import NeuronTarget

    return rules.NATIVE_INT64_FLAG in NeuronTarget(opts.generation, opts.neuron_cc_flags).command("m", "n")


def check_module(
    module: Any,
    *,
    generation: str = "trn2",
    target: str = "cpu",
    graph_name: str = "module",
    node_table: dict[str, dict[str, str]] | None = None,
    int64_native: bool = True,
) -> LegalityReport:
    """Check one StableHLO module (anything ``_mlir_module`` takes) for ``generation``; never raises."""
    if generation not in rules.GENERATIONS:
        raise ValueError(f"generation must be one of {rules.GENERATIONS}, got {generation!r}")
    t0 = time.perf_counter()
    mod = _mlir_module(module)
    with mod.context:
        scan: ModuleScan = ModuleChecker(mod, generation, int64_native).run()
    table = node_table or {}
    seen: set[tuple[str, str, str]] = set()
    violations = []
    for f in scan.findings:
        v = _violation(f, table)
        key = (v.node or v.location, v.hlo_op, v.detail)
        if key not in seen:
            seen.add(key)
            violations.append(v)
    return LegalityReport(
        graph_name=graph_name,
        target=target,
        generation=generation,
        int64_native=int64_native,
        violations=violations,
        op_counts=dict(scan.op_counts),
        assumed_ops=dict(scan.assumed),
        device_calls=dict(scan.device_calls),
        uses_int64=scan.uses_int64,
        seconds=time.perf_counter() - t0,
    )


def check(lowered: Any, opts: Options) -> LegalityReport | None:
    """Check a ``LoweredGraph`` for ``opts.generation``; returns the report.

    Violations raise ``NeuronUnsupportedOpError`` (one entry per aten node, with its user line) when
    ``opts.strict``; otherwise they become one ``NeuronLegalityWarning`` naming what would fail.
    """
    if lowered is None:
        return None
    report = check_module(
        lowered,
        generation=opts.generation,
        target=opts.target,
        graph_name=getattr(lowered, "name", "module"),
        node_table=getattr(lowered, "node_table", None),
        int64_native=int64_native(opts),
    )
    if report.legal:
        return report
    nodes = report.unsupported_nodes()
    if opts.strict:
        error = NeuronUnsupportedOpError(report.graph_name, nodes, hint=STRICT_HINT)
        error.legality_report = report  # the compiler's debug dump shows it
        raise error
    warnings.warn(
        NeuronLegalityWarning(
            f"neuron backend: graph '{report.graph_name}' runs on the {opts.target} target because "
            f"strict=False, but would fail on Trainium {opts.generation}:\n"
            + "\n".join(n.describe() for n in nodes)
        ),
        stacklevel=2,
    )
    return report


@dataclass(frozen=True)
class OpVerdict:
    """Whether a module is legal for one generation, and on what grounds."""

    legal: bool
    assumed: tuple[str, ...] = ()
    reasons: tuple[str, ...] = ()

    def label(self) -> str:
        if not self.legal:
            return "no: " + "; ".join(self.reasons)
        if self.assumed:
            return "yes (assumed: " + ", ".join(self.assumed) + ")"
        return "yes"


def verdict_by_generation(lowered: Any) -> dict[str, OpVerdict]:
    """For docs/ops.md: given an aten op's lowered module, whether it is legal for trn2 and for trn3.

    ``lowered`` may be a ``LoweredGraph``, a jax ``Lowered``, an MLIR module or StableHLO text. int64
    counts as legal (the neuron target runs neuronx-cc with ``--native-int64``). "assumed" lists ops
    that are legal only by assumption (absent from the public operator list).
    """
    out = {}
    for gen in rules.GENERATIONS:
        r = check_module(lowered, generation=gen, node_table=getattr(lowered, "node_table", None))
        reasons = tuple(dict.fromkeys(f"{v.hlo_op}: {v.detail}" for v in r.violations))
        out[gen] = OpVerdict(r.legal, tuple(sorted(r.assumed_ops)), reasons)
    return out


class _LocatingChecker(ModuleChecker):
    """A ``ModuleChecker`` that also records where each assumed-legal op sits, so that "assumed" can be
    attributed to an aten node like a violation is (``ModuleScan.assumed`` only counts by name)."""

    def __init__(self, module: Any, generation: str, int64_native: bool) -> None:
        super().__init__(module, generation, int64_native)
        self._where: Any = None
        self.assumed_at: list[tuple[str, str]] = []  # (assumed op, MLIR location of its anchor)
        checker = self

        class _LocatedCounter(Counter):
            def __setitem__(self, key: str, value: int) -> None:
                checker.assumed_at.append((key, str(checker._where.location)))
                super().__setitem__(key, value)

        self.scan.assumed = _LocatedCounter()

    def _visit(self, op: Any, anchor: Any) -> None:
        previous, self._where = self._where, anchor if anchor is not None else op
        try:
            super()._visit(op, anchor)
        finally:
            self._where = previous


def _op_of(location: str, node_table: dict[str, dict[str, str]]) -> str | None:
    scope = _scope_of(location, node_table)
    if scope is None:
        return None
    return node_table[scope]["op"] if scope in node_table else scope.partition("#")[0]


def verdicts_by_op(lowered: Any) -> dict[str, dict[str, OpVerdict]]:
    """For docs/ops.md: per aten op of one lowered graph, whether its HLO ops are legal on trn2 and trn3.

    Every aten op in ``lowered.node_table`` gets a verdict per generation (an op that emits no HLO op is
    "yes"); an op named only by a location scope (no table) is included too. HLO ops outside any aten
    node's scope (graph glue) are attributed to no op. int64 counts as legal, as in
    ``verdict_by_generation``.
    """
    table: dict[str, dict[str, str]] = getattr(lowered, "node_table", None) or {}
    mod = _mlir_module(lowered)
    out: dict[str, dict[str, OpVerdict]] = {}
    for gen in rules.GENERATIONS:
        with mod.context:
            checker = _LocatingChecker(mod, gen, True)
            scan = checker.run()
        reasons: dict[str, dict[str, None]] = {info["op"]: {} for info in table.values()}
        assumed: dict[str, set[str]] = {op: set() for op in reasons}
        for f in scan.findings:
            op = _op_of(f.location, table)
            if op is not None:
                reasons.setdefault(op, {})[f"{f.hlo_op}: {f.detail}"] = None
        for name, location in checker.assumed_at:
            op = _op_of(location, table)
            if op is not None:
                assumed.setdefault(op, set()).add(name)
        for op in reasons.keys() | assumed.keys():
            why = tuple(reasons.get(op, {}))
            out.setdefault(op, {})[gen] = OpVerdict(not why, tuple(sorted(assumed.get(op, ()))), why)
    return out


def merge_verdicts(a: OpVerdict | None, b: OpVerdict) -> OpVerdict:
    """The worse of two verdicts for the same op (illegal > assumed > legal), their grounds united."""
    if a is None:
        return b
    assumed = tuple(sorted(set(a.assumed) | set(b.assumed)))
    reasons = tuple(sorted(set(a.reasons) | set(b.reasons)))
    return OpVerdict(a.legal and b.legal, assumed, reasons)


def report_json(report: LegalityReport) -> str:
    return json.dumps(report.to_dict(), indent=1, default=str)
