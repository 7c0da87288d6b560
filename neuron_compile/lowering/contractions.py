"""Sums of products torch has no decomposition for: addbmm (a batch of products summed) and _trilinear
(what ``nn.functional.bilinear`` / ``nn.Bilinear`` call).

Both are dot_generals accumulating in float32 for 16-bit floats and rounded once at the end. Eager rounds
more often (addbmm adds each batch's product into a bfloat16 result; _trilinear rounds the first pair's
product), so a bfloat16 result can differ from eager's by an ulp, towards the exact value. Integer
operands are multiplied and summed exactly (neuronx-cc has no integer matmul datapath).
"""

from __future__ import annotations

import string
from typing import Sequence

import jax.numpy as jnp
import torch
from jax import lax

from .matmul import add_scaled, dot
from .registry import Unsupported, register_lowering
from .semantics import convert, is_float, opmath_dtype, out_dtype, out_shape

aten = torch.ops.aten


@register_lowering(aten.addbmm)
def addbmm(x, batch1, batch2, *, beta=1, alpha=1):
    """``beta * x + alpha * sum_b batch1[b] @ batch2[b]``: one product contracting the batch and inner
    dims together ([n, B*k] x [B*k, m])."""
    b, n, k = batch1.shape
    m = batch2.shape[2]
    a = jnp.reshape(jnp.transpose(batch1, (1, 0, 2)), (n, b * k))
    product = dot(a, jnp.reshape(batch2, (b * k, m)), (1, 0))
    return convert(add_scaled(product, x, beta, alpha), out_dtype())


def _bitset(dims: Sequence[int], total: int) -> list[bool]:
    bits = [False] * total
    for d in dims:
        bits[d % total] = True
    return bits


@register_lowering(aten._trilinear)
def trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """Each input is unsqueezed at its ``expand`` dims to ``total`` dims, the three are multiplied
    (broadcast) and summed over ``sumdim`` (those dims leave the result). ``unroll_dim`` only picks eager's
    loop order, except where no input has that dim."""
    total = i1.ndim + len(expand1)
    if total > len(string.ascii_letters):
        raise Unsupported(f"_trilinear over {total} dims")
    letters = string.ascii_letters[:total]
    summed = _bitset(sumdim, total)

    def spec(expand: Sequence[int]) -> str:
        gone = _bitset(expand, total)
        return "".join(c for c, g in zip(letters, gone) if not g)

    kept = "".join(c for c, s in zip(letters, summed) if not s)
    result = out_dtype()
    unroll = unroll_dim if 0 <= unroll_dim < total else None
    if unroll is not None and all(_bitset(e, total)[unroll] for e in (expand1, expand2, expand3)):
        # eager loops over the unroll dim's size, which it takes from the inputs that have it: none here,
        # so its loop runs zero times and the result is all zeros
        return jnp.zeros(out_shape(), result)
    if is_float(result):
        acc = opmath_dtype(result)
        operands = [convert(t, acc) for t in (i1, i2, i3)]
        out = jnp.einsum(
            f"{spec(expand1)},{spec(expand2)},{spec(expand3)}->{kept}",
            *operands,
            precision=lax.Precision.HIGHEST,
            preferred_element_type=acc,
        )
    else:
        # exact: unsqueeze, broadcast multiply, sum
        full = []
        for t, expand in ((i1, expand1), (i2, expand2), (i3, expand3)):
            full.append(jnp.expand_dims(t, tuple(sorted(d % total for d in expand))) if len(expand) else t)
        product = full[0] * full[1] * full[2]
        out = jnp.sum(product, axis=tuple(i for i, s in enumerate(summed) if s), dtype=result)
    return convert(out, result)
