"""scaled_dot_product_attention.

On CPU, AOTAutograd decomposes SDPA's forward to math but keeps the CPU-only
``_scaled_dot_product_flash_attention_for_cpu_backward`` in the backward graph. So before AOTAutograd the
Dynamo graph's SDPA calls are replaced by ``sdpa_math``: plain differentiable torch ops whose forward and
backward both lower (matmul + softmax stay whole for the NKI kernels).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}


def sdpa_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Reference math of ``F.scaled_dot_product_attention`` (same semantics as torch's docs)."""
    L, S = query.size(-2), key.size(-2)
    scale_factor = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    if enable_gqa:
        repeat = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(repeat, -3)
        value = value.repeat_interleave(repeat, -3)
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale_factor
    if is_causal:
        causal = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    weights = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)
    return torch.matmul(weights, value)


def rewrite_sdpa(gm: torch.fx.GraphModule) -> None:
    """Point every SDPA call of a Dynamo graph (and its nested subgraphs) at ``sdpa_math``, in place."""
    changed = False
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op == "call_function" and node.target in _SDPA_TARGETS:
                node.target = sdpa_math
                changed = True
        if changed:
            module.recompile()
