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

from ..errors import NeuronLegalityWarning
from . import rules
from .enforce import STRICT_HINT, check, check_module, int64_native
from .report import LegalityReport, Violation
from .verdicts import OpVerdict, merge_verdicts, verdict_by_generation, verdicts_by_op

__all__ = [
    "STRICT_HINT",
    "LegalityReport",
    "NeuronLegalityWarning",
    "OpVerdict",
    "Violation",
    "check",
    "check_module",
    "int64_native",
    "merge_verdicts",
    "rules",
    "verdict_by_generation",
    "verdicts_by_op",
]
