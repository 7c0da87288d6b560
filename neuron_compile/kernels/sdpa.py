"""scaled_dot_product_attention, rewritten in the Dynamo graph before AOTAutograd.

On CPU, AOTAutograd decomposes SDPA's forward to math but keeps the CPU-only
``_scaled_dot_product_flash_attention_for_cpu_backward`` in the backward graph. So the Dynamo graph's SDPA
calls are replaced first: by ``neuron::flash_attention`` (one node forward, one backward: the NKI kernel
site) where the kernel supports the call, else by ``sdpa_math``, plain differentiable torch ops whose
forward and backward both lower.

This runs on every compile, cache hits included, so it lives with the kernels, not under ``lowering/``:
importing any lowering module loads every op family (~0.3-0.5 s of a warm start).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import KERNELS

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
    """Reference math of ``F.scaled_dot_product_attention`` (torch's docs), with torch's rule for a query
    whose every key is masked (a left-padded position of a padded batch): its output is zero, not NaN, as
    torch's math and CPU flash kernels give it (``_safe_softmax``).

    bfloat16 and float16 calls compute in float32 and round the output once (so do their gradients, through
    the casts), as eager's CPU flash kernel accumulates the scores, the softmax and p @ v in float32. Rounding
    the scores, the probabilities and their gradients at every step instead left bf16 T5 (whose position bias
    is a float mask, so its attention takes this path) with gradients up to 4x further from float64 than
    eager's (docs/numerics.md)."""
    out_dtype = query.dtype
    if out_dtype in (torch.bfloat16, torch.float16):
        query, key, value = query.float(), key.float(), value.float()
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.float()
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
    weights = torch.ops.aten._safe_softmax(scores, -1)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)
    return torch.matmul(weights, value).to(out_dtype)


def sdpa_flash(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """SDPA as the NKI flash-attention kernel (one node forward, one backward): used where
    ``kernel_routing.sdpa_routes_to_flash`` accepts the call."""
    from .torch_ops import attention_scale, flash_attention

    return flash_attention(query, key, value, bool(is_causal), attention_scale(query.size(-1), scale))[0]


def _example(arg: object) -> object:
    return arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else arg


def calls_attention(gm: torch.fx.GraphModule) -> bool:
    """Does the Dynamo graph (or a nested subgraph) call SDPA, which ``rewrite_sdpa`` must replace?
    (flex_attention stays whole: lowering/flex_attention.py lowers it and its backward.)"""
    return any(
        node.op == "call_function" and node.target in _SDPA_TARGETS
        for module in gm.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
    )


def rewrite_sdpa(gm: torch.fx.GraphModule, kernels: str = "reference") -> None:
    """Point every SDPA call of a Dynamo graph (and its nested subgraphs) at ``sdpa_flash`` where the
    routing table sends it to the NKI kernel (``kernels`` not "off"), else at ``sdpa_math``; in place."""
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        changed = False
        for node in module.graph.nodes:
            if node.op == "call_function" and node.target in _SDPA_TARGETS:
                args = [_example(a) for a in node.args]
                kwargs = {k: _example(v) for k, v in node.kwargs.items()}
                flash = kernels != "off" and sdpa_routes_to_flash(*args, **kwargs)
                node.target = sdpa_flash if flash else sdpa_math
                changed = True
        if changed:
            module.recompile()


def sdpa_routes_to_flash(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: object = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> bool:
    """Whether a ``scaled_dot_product_attention`` call (example tensors) becomes the flash kernel: no mask,
    no dropout, no GQA, ``[B, H, S, D]`` with D <= 128 in one float dtype (the kernel's ``supports``)."""
    if attn_mask is not None or dropout_p != 0.0 or enable_gqa:
        return False
    if not all(isinstance(t, torch.Tensor) for t in (query, key, value)):
        return False
    lse = query[..., 0]  # the backward's (o, do, lse) arguments, by their shapes
    return KERNELS["flash_attention_fwd"].fits(query, key, value, is_causal, scale) and KERNELS[
        "flash_attention_bwd"
    ].fits(query, key, value, query, query, lse, is_causal, scale)
