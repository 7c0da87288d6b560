"""The torch dtypes a graph may carry on the device (pure torch, so checks before lowering need no jax).

float64 is accepted and computed as float32, as on Trainium; ``lowering/semantics.py`` maps each of
these to the jax dtype that computes it.
"""

from __future__ import annotations

import torch

DEVICE_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.uint16,
        torch.uint32,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    }
)
