"""neuron_compile: a torch.compile backend ("neuron") for AWS Trainium.

``torch.compile(model, backend="neuron", dynamic=False)`` needs no import of this package; import it for
the public API below.
"""

from __future__ import annotations

from .errors import (
    NeuronCompileError,
    NeuronDynamicShapeError,
    NeuronOptionsError,
    NeuronUnsupportedOpError,
    UnsupportedNode,
)
from .lowering import supported_ops
from .options import Options
from .stats import STATS

__version__ = "0.1.0"

__all__ = [
    "NeuronCompileError",
    "NeuronDynamicShapeError",
    "NeuronOptionsError",
    "NeuronUnsupportedOpError",
    "Options",
    "STATS",
    "UnsupportedNode",
    "__version__",
    "supported_ops",
]
