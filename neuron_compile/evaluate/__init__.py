"""Evaluate one model for Trainium: what compiles, where it fails, its numerics and its costs.

``evaluate(model, example_inputs)`` returns an ``EvaluationReport``; ``compare_to_reference`` is the
numerics rule (shared with the model tests); ``bisect(model, example_inputs)`` judges every aten op alone,
compiled vs eager against a float64 reference (docs/bisect.md); ``neuron-compile evaluate FILE.py:FACTORY
[--bisect]`` is the CLI.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from .bisect import BisectReport, OpFinding, bisect
from .numerics import NumericsVerdict, TensorVerdict, compare_to_reference
from .report import EvaluationReport, UnsupportedEntry
from .runner import default_loss, evaluate

__all__ = [
    "BisectReport",
    "EvaluationReport",
    "NumericsVerdict",
    "OpFinding",
    "TensorVerdict",
    "UnsupportedEntry",
    "bisect",
    "compare_to_reference",
    "default_loss",
    "evaluate",
]


class _CallableModule(types.ModuleType):
    """``neuron_compile.evaluate`` is both this package and the function: importing a submodule binds the
    package to the parent's attribute ``evaluate``, which would otherwise shadow the function."""

    def __call__(self, *args: Any, **kwargs: Any) -> EvaluationReport:
        return evaluate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
