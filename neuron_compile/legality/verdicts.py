"""Per-generation and per-aten-op verdicts, for docs/ops.md and the OpInfo sweep."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import rules
from .checks import ModuleChecker
from .enforce import check_module, mlir_module
from .locate import op_of


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


def verdicts_by_op(lowered: Any) -> dict[str, dict[str, OpVerdict]]:
    """For docs/ops.md: per aten op of one lowered graph, whether its HLO ops are legal on trn2 and trn3.

    Every aten op in ``lowered.node_table`` gets a verdict per generation (an op that emits no HLO op is
    "yes"); an op named only by a location scope (no table) is included too. HLO ops outside any aten
    node's scope (graph glue) are attributed to no op. int64 counts as legal, as in
    ``verdict_by_generation``.
    """
    table: dict[str, dict[str, str]] = getattr(lowered, "node_table", None) or {}
    mod = mlir_module(lowered)
    out: dict[str, dict[str, OpVerdict]] = {}
    for gen in rules.GENERATIONS:
        with mod.context:
            scan = ModuleChecker(mod, gen, True).run()
        reasons: dict[str, dict[str, None]] = {info["op"]: {} for info in table.values()}
        assumed: dict[str, set[str]] = {op: set() for op in reasons}
        for f in scan.findings:
            op = op_of(f.location, table)
            if op is not None:
                reasons.setdefault(op, {})[f"{f.hlo_op}: {f.detail}"] = None
        for name, location in scan.assumed_at:
            op = op_of(location, table)
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
