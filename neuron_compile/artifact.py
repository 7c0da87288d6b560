"""What compiling one graph produces, and what the cache stores."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one graph input or output, as torch sees it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class OutputSpec:
    """How to produce graph output i at run time: tensor number ``index`` of the executable, or a constant.

    Outputs that share storage in eager (``y`` and ``y.view(-1)``) name the same ``index`` and are
    ``as_strided`` views of it; ``stride`` None means the executable's tensor is the output itself.
    """

    kind: str  # "tensor" | "const"
    index: int = -1
    value: Any = None
    spec: TensorSpec | None = None
    #: Set when executable output ``index`` is also another storage's buffer: use a private copy of it.
    #: The number tells copies apart (outputs with the same index and number share that copy).
    duplicate_of: int | None = None
    #: Strides (in elements) and storage offset of the output within its buffer, as torch computed them.
    stride: tuple[int, ...] | None = None
    storage_offset: int = 0


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
