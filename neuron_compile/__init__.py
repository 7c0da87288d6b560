"""neuron_compile: a torch.compile backend ("neuron") for AWS Trainium.

``torch.compile(model, backend="neuron", dynamic=False)`` needs no import of this package; import it for
the public API below. Importing it also registers the cache's artifact type with PyTorch's mega-cache,
which ``torch.compiler.load_cache_artifacts()`` needs in a fresh process.
"""

from __future__ import annotations

from .cache import cache_stats  # importing the cache registers its mega-cache artifact type
from .device import register as _register_device
from .device import wanted_at_import as _device_wanted
from .device.checkpoints import install_load_hint as _install_load_hint
from .errors import (
    NeuronCompileError,
    NeuronCompileTimeoutError,
    NeuronDynamicShapeError,
    NeuronForkedProcessError,
    NeuronHbmError,
    NeuronMemoryMapError,
    NeuronMemoryMapWarning,
    NeuronOptionsError,
    NeuronRuntimeError,
    NeuronUnsupportedOpError,
    UnsupportedNode,
)
from .options import Options
from .stats import STATS
from .version import __version__

# torch.load of a checkpoint saved from the `neuron` device where the device is not registered: an error that
# names map_location="cpu" (neuron_compile/device/checkpoints.py).
_install_load_hint()
# The `neuron` device (PrivateUse1) where a Neuron runtime is found or NEURON_COMPILE_DEVICE=1, unless another
# library holds PrivateUse1: neuron_compile/device.
if _device_wanted():
    _register_device()

__all__ = [
    "EvaluationReport",
    "NeuronCompileError",
    "NeuronCompileTimeoutError",
    "NeuronDynamicShapeError",
    "NeuronForkedProcessError",
    "NeuronHbmError",
    "NeuronMemoryMapError",
    "NeuronMemoryMapWarning",
    "NeuronOptionsError",
    "NeuronRuntimeError",
    "NeuronUnsupportedOpError",
    "Options",
    "STATS",
    "UnsupportedNode",
    "__version__",
    "cache_stats",
    "evaluate",
    "nki_op",
    "pad_to_bucket",
    "supported_ops",
]


def supported_ops() -> list[str]:
    """Names of every aten overload the backend lowers, sorted (e.g. ``'aten.add.Tensor'``)."""
    from .lowering import supported_ops as registry_ops

    return registry_ops()


#: Public names whose modules load on first use: ``import neuron_compile`` must stay light (no jax, no
#: lowerings), and evaluation pulls in the whole backend.
_LAZY = {
    "evaluate": ("neuron_compile.evaluate", "evaluate"),
    "EvaluationReport": ("neuron_compile.evaluate", "EvaluationReport"),
    "pad_to_bucket": ("neuron_compile.bucketing", "pad_to_bucket"),
    "nki_op": ("neuron_compile.kernels.user_ops", "nki_op"),
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'neuron_compile' has no attribute {name!r}")
