"""What compiling one graph produces, and what the cache stores."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch._prims_common import make_contiguous_strides_for

#: ``gm.meta`` key the compiler sets on a forward graph: where its outputs saved for the backward start.
#: The lowering may return those channels-last (lowering/layout.py); it is part of the cache key.
SAVED_FOR_BACKWARD_FROM = "neuron_saved_for_backward_from"


def channels_last_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """torch's strides of an (N, C, *spatial) tensor laid out channels-last (C innermost)."""
    physical = make_contiguous_strides_for((shape[0], *shape[2:], shape[1]))
    return (physical[0], physical[-1], *physical[1:-1])


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one graph input or output, as torch sees it.

    ``perm`` (inputs only) is the input's memory order when it is a dense permutation of row-major (a
    transposed weight, a channels_last activation): the executable takes ``permute(perm)`` of it, which
    is then contiguous, so no copy is made to feed it. None for row-major inputs.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    perm: tuple[int, ...] | None = None

    @property
    def device_shape(self) -> tuple[int, ...]:
        """The shape the executable's parameter has (the dims in memory order)."""
        return self.shape if self.perm is None else tuple(self.shape[d] for d in self.perm)


@dataclass
class OutputSpec:
    """How to produce graph output i at run time: tensor number ``index`` of the executable, graph input
    number ``index`` (an output that is an input, or a view of one), or a constant.

    Outputs that share storage in eager (``y`` and ``y.view(-1)``) name the same ``index`` and are
    ``as_strided`` views of it; ``stride`` None means the executable's tensor (or the input) is the
    output itself.
    """

    kind: str  # "tensor" | "input" | "const"
    index: int = -1
    value: Any = None
    spec: TensorSpec | None = None
    #: Set when executable output ``index`` is also another storage's buffer: use a private copy of it.
    #: The number tells copies apart (outputs with the same index and number share that copy).
    duplicate_of: int | None = None
    #: Strides (in elements) and storage offset of the output within its buffer, as torch computed them.
    stride: tuple[int, ...] | None = None
    #: For kind "input", relative to the input's own storage offset.
    storage_offset: int = 0
    #: For kind "input": the input's strides when compiled (the view's strides are in their terms).
    input_stride: tuple[int, ...] | None = None


@dataclass
class Artifact:
    """A compiled graph: the StableHLO (what neuronx-cc takes), the serialized executable and the
    input/output plan the runtime needs. ``loaded`` is the live executable, never persisted."""

    name: str
    stablehlo: str
    executable: bytes
    inputs: list[Any]
    outputs: list[Any]
    downcast_float64: bool
    needs_rng_seed: bool
    num_ops: int
    #: NKI kernel sites in the module (``lowering/kernel_routing.py``).
    nki_kernels: int
    lower_seconds: float
    compile_seconds: float
    target_version: str
    #: (warning class name, message) raised while building; replayed on every use, hits included.
    warnings: list[tuple[str, str]] = field(default_factory=list)
    loaded: Any = field(default=None, repr=False, compare=False)
    #: Estimated peak HBM on one NeuronCore (bytes, ``hbm.py``) when built in this process; not stored.
    hbm_peak: int | None = field(default=None, compare=False)
    #: Its I/O tensors' bytes (``hbm.py``, certain where ``hbm_peak`` is estimated); not stored.
    hbm_io: int | None = field(default=None, compare=False)
