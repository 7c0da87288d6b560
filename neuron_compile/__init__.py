"""neuron_compile: a torch.compile backend ("neuron") for AWS Trainium.

``torch.compile(model, backend="neuron", dynamic=False)`` needs no import of this package; import it for
the public API below. Importing it also registers the cache's artifact type with PyTorch's mega-cache,
which ``torch.compiler.load_cache_artifacts()`` needs in a fresh process.
"""

from __future__ import annotations

from .cache import cache_stats  # importing the cache registers its mega-cache artifact type
from .errors import (
    NeuronCompileError,
    NeuronDynamicShapeError,
    NeuronOptionsError,
    NeuronUnsupportedOpError,
    UnsupportedNode,
)
from .options import Options
from .stats import STATS
from .version import __version__

__all__ = [
    "NeuronCompileError",
    "NeuronDynamicShapeError",
    "NeuronOptionsError",
    "NeuronUnsupportedOpError",
    "Options",
    "STATS",
    "UnsupportedNode",
    "__version__",
    "cache_stats",
    "supported_ops",
]


def supported_ops() -> list[str]:
    """Names of every aten overload the backend lowers, sorted (e.g. ``'aten.add.Tensor'``)."""
    from .lowering import supported_ops as registry_ops

    return registry_ops()

