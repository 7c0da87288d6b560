"""SwiGLU activation ``silu(gate) * up`` over ``[R, C]`` (fp32/bf16; any R), the gate of a SwiGLU MLP.

128-row tiles with up to 2048 columns per instruction: ``silu`` on Scalar (fp32 result), the product
on Vector with the cast to the output dtype, one DMA per operand and tile.
"""

from __future__ import annotations

from typing import Any

from ._common import P, dtype_of, sbuf, tiles
from .nki_api import isa as nisa
from .nki_api import jit
from .nki_api import language as nl

COLS = 2048


@jit
def swiglu_kernel(gate: Any, up: Any) -> Any:
    """NKI kernel: ``silu(gate) * up``; output in ``gate.dtype``."""
    rows, cols = gate.shape
    out = nl.ndarray((rows, cols), gate.dtype, buffer=nl.shared_hbm, name="out")
    for r0, rs in tiles(rows):
        for c0, cs in tiles(cols, COLS):
            g = sbuf((P, COLS), gate.dtype, "gate")
            u = sbuf((P, COLS), up.dtype, "up")
            nisa.dma_copy(dst=g[:rs, :cs], src=gate[r0 : r0 + rs, c0 : c0 + cs])
            nisa.dma_copy(dst=u[:rs, :cs], src=up[r0 : r0 + rs, c0 : c0 + cs])
            act = sbuf((P, COLS), "float32", "silu")
            nisa.activation(dst=act[:rs, :cs], op=nl.silu, data=g[:rs, :cs])
            y = sbuf((P, COLS), gate.dtype, "y")
            nisa.tensor_tensor(dst=y[:rs, :cs], data1=act[:rs, :cs], data2=u[:rs, :cs], op=nl.multiply)
            nisa.dma_copy(dst=out[r0 : r0 + rs, c0 : c0 + cs], src=y[:rs, :cs])
    return out


def swiglu_reference(gate: Any, up: Any) -> Any:
    """StableHLO reference: ``silu(gate) * up`` in fp32, result in ``gate.dtype``."""
    import jax
    import jax.numpy as jnp

    g = gate.astype(jnp.float32)
    return (g * jax.nn.sigmoid(g) * up.astype(jnp.float32)).astype(gate.dtype)


def swiglu_supports(gate: Any, up: Any) -> bool:
    """2-D float tensors of equal shape and dtype."""
    return (
        len(gate.shape) == 2
        and tuple(gate.shape) == tuple(up.shape)
        and dtype_of(gate) == dtype_of(up)
        and dtype_of(gate) in ("float32", "bfloat16", "float16")
    )
