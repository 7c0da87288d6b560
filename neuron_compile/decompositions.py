"""Which aten ops AOTAutograd decomposes before lowering, and which stay whole.

Start from torch's core-ATen decompositions so the set of ops to lower stays small, but keep whole the
ops that NKI kernels take (matmul, softmax, layer_norm, attention) and those with a device-friendly
form (gelu, silu).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch._decomp import core_aten_decompositions

aten = torch.ops.aten

KEEP_WHOLE = [
    aten._softmax,
    aten._log_softmax,
    aten._softmax_backward_data,
    aten._log_softmax_backward_data,
    aten.native_layer_norm,
    aten.native_layer_norm_backward,
    aten.gelu,
    aten.gelu_backward,
    aten.silu,
    aten.silu_backward,
    aten.addmm,
    aten.mm,
    aten.bmm,
    aten.embedding,
    aten.embedding_dense_backward,
    aten.nll_loss_forward,
    aten.nll_loss_backward,
    # torch's decomposition indexes with a 0-d index tensor, which guards on its data (.item()).
    aten.take,
    # Lowered with constant-index gathers / concatenation (lowering/padding.py); torch's decompositions
    # compute the indices in the graph (more ops, non-constant gathers, float64 aranges).
    aten.upsample_nearest1d,
    aten.upsample_nearest2d,
    aten.upsample_nearest3d,
    aten._upsample_nearest_exact1d,
    aten._upsample_nearest_exact2d,
    aten._upsample_nearest_exact3d,
    aten.upsample_linear1d,
    aten.upsample_bilinear2d,
    aten.upsample_trilinear3d,
    aten.upsample_nearest1d_backward,
    aten.upsample_nearest2d_backward,
    aten.upsample_nearest3d_backward,
    aten._upsample_nearest_exact1d_backward,
    aten._upsample_nearest_exact2d_backward,
    aten._upsample_nearest_exact3d_backward,
    aten.upsample_linear1d_backward,
    aten.upsample_bilinear2d_backward,
    aten.upsample_trilinear3d_backward,
    aten.reflection_pad1d,
    aten.reflection_pad2d,
    aten.reflection_pad3d,
    aten.replication_pad1d,
    aten.replication_pad2d,
    aten.replication_pad3d,
    aten.reflection_pad1d_backward,
    aten.reflection_pad2d_backward,
    aten.reflection_pad3d_backward,
    aten.replication_pad1d_backward,
    aten.replication_pad2d_backward,
    aten.replication_pad3d_backward,
]


@functools.lru_cache(maxsize=None)
def _table() -> dict[Any, Callable[..., Any]]:
    table = dict(core_aten_decompositions())
    keep = set()
    for packet in KEEP_WHOLE:
        for name in packet.overloads():
            keep.add(getattr(packet, name))
    return {op: fn for op, fn in table.items() if op not in keep}


def decomposition_table() -> dict[Any, Callable[..., Any]]:
    """The decomposition table given to AOTAutograd (a fresh dict; callers may extend it)."""
    return dict(_table())
