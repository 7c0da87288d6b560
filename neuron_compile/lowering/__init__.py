"""FX aten graph -> StableHLO (built with jax.lax). One module per op family registers its lowerings."""

from . import (  # noqa: F401  (importing a family registers its lowerings)  # noqa: F401,E402  (pair lowerings of complex operands)
    activations,
    collectives,
    complex_pairs,
    contractions,
    convolution,
    creation,
    distances,
    distributions,
    export_checks,
    factorizations,
    fft,
    fused_losses,
    grid_sample,
    histograms,
    indexing,
    matmul,
    matrix_functions,
    nn,
    padding,
    pointwise,
    pooling,
    quantization,
    random,
    reductions,
    scan,
    scatters,
    segments,
    selection,
    sorting,
    special,
    spectral,
    views,
)
from .interpreter import LoweredGraph, OutputSpec, TensorSpec, lower_graph
from .registry import LOWERINGS, Unsupported, register_lowering, supported_ops

__all__ = [
    "LOWERINGS",
    "LoweredGraph",
    "OutputSpec",
    "TensorSpec",
    "Unsupported",
    "lower_graph",
    "register_lowering",
    "supported_ops",
]
