"""What the matrix lowerings (``factorizations.py``, ``spectral.py``) share: the op a refusal names, the
float32 working dtype, the order limit, and gather-free index helpers."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax

from .registry import Unsupported, current
from .semantics import convert


def op_name() -> str:
    """The aten op being lowered (for messages), or a generic word outside a lowering."""
    try:
        return str(current().node.target)
    except RuntimeError:
        return "factorization"


def check_order(order: int, limit: int, why: str) -> None:
    """Refuse a matrix of ``order`` above ``limit``; ``why`` says what grows with the order."""
    if order > limit:
        raise Unsupported(
            f"{op_name()} of a matrix of order {order}: lowered for orders up to {limit} ({why}); run it "
            "outside the compiled region (torch.compiler.disable on the function that calls it)"
        )


def float32_operand(x: Any) -> Any:
    """``x`` in float32, the dtype every matrix lowering computes in; 16-bit and non-float operands refused."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise Unsupported(f"{op_name()} of {jnp.dtype(x.dtype)} (floating dtypes only)")
    if jnp.dtype(x.dtype).itemsize < 4:
        # Eager CPU raises here ("lu_cpu" / "cholesky_cpu" not implemented for 'BFloat16'), so there is no
        # eager result to match; float32 is what eager would need too.
        raise Unsupported(
            f"{op_name()} of {jnp.dtype(x.dtype)}: eager PyTorch has no {jnp.dtype(x.dtype)} kernel for it either; "
            "cast the operands to float32 (x.float()) around the call"
        )
    return convert(x, jnp.float32)


def iota(n: int) -> Any:
    return lax.iota(jnp.int32, n)


def mT(x: Any) -> Any:
    """The matrix transpose of the trailing two dims."""
    return jnp.swapaxes(x, -1, -2)


def diagonal(a: Any) -> Any:
    """Main diagonal of [..., m, n] as a masked reduction (no gather)."""
    k = min(a.shape[-2], a.shape[-1])
    a = a[..., :k, :k]
    eye = iota(k)[:, None] == iota(k)[None, :]
    return jnp.sum(jnp.where(eye, a, jnp.zeros((), a.dtype)), axis=-1)
