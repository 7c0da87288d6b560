"""The pass itself: check a module for one generation, and enforce the verdict (raise when strict, else
warn) for a lowered graph."""

from __future__ import annotations

import time
import warnings
from typing import Any

from ..errors import SUPPORTED_OPS_HINT, NeuronLegalityWarning, NeuronUnsupportedOpError
from ..options import Options
from . import rules
from .checks import ModuleChecker, ModuleScan
from .locate import violation_from
from .report import LegalityReport

STRICT_HINT = (
    SUPPORTED_OPS_HINT + " To run it on the CPU target anyway (it would still fail on Trainium), pass "
    "options={'strict': False} or set NEURON_COMPILE_STRICT=0."
)


def mlir_module(lowered: Any) -> Any:
    """An MLIR module from a LoweredGraph, a jax Lowered, an MLIR module or StableHLO text."""
    inner = getattr(lowered, "lowered", None)
    if inner is not None and hasattr(inner, "compiler_ir"):
        lowered = inner
    if hasattr(lowered, "compiler_ir"):
        return lowered.compiler_ir("stablehlo")
    if isinstance(lowered, str):
        from jax.extend.mlir import ir
        from jax.interpreters import mlir

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
    mod = mlir_module(module)
    with mod.context:
        scan: ModuleScan = ModuleChecker(mod, generation, int64_native).run()
    table = node_table or {}
    seen: set[tuple[str, str, str]] = set()
    violations = []
    for f in scan.findings:
        v = violation_from(f, table)
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
            f"strict=False, but would fail on Trainium {opts.generation}:\n" + "\n".join(n.describe() for n in nodes)
        ),
        stacklevel=2,
    )
    return report
