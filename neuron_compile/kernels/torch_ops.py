"""Torch custom ops for the kernels that must stay whole through AOTAutograd.

Attention is the case: AOTAutograd would decompose ``scaled_dot_product_attention`` into matmuls and a
softmax, and its CPU backward into an op nothing lowers. ``neuron::flash_attention`` (and its backward,
``neuron::flash_attention_backward``) keep it as one node in the forward and in the backward graph, which
the routing table (``lowering/kernel_routing.py``) lowers as one NKI kernel site. Their eager bodies are
plain torch math (used only where torch runs them outside our compiler, e.g. ``aot_eager``); the fake
implementations give AOTAutograd shapes and dtypes.
"""

from __future__ import annotations

import math

import torch


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


@torch.library.custom_op("neuron::flash_attention", mutates_args=())
def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over ``[B, H, S, D]``: ``(o, lse)``; softmax statistics in float32 as the kernel keeps them."""
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    o = torch.matmul(torch.exp(s - lse[..., None]).to(v.dtype), v)
    return o.to(q.dtype), lse


@flash_attention.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("neuron::flash_attention_backward", mutates_args=())
def flash_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of ``flash_attention`` from its outputs, as the kernel computes them."""
    p = torch.exp(_scores(q, k, causal, scale) - lse[..., None])
    dof = do.float()
    dv = torch.matmul(p.transpose(-2, -1), dof)
    dp = torch.matmul(dof, v.float().transpose(-2, -1))
    ds = p * (dp - (dof * o.float()).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k.float()) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q.float()) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@flash_attention_backward.register_fake
def _(q, k, v, o, do, lse, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, causal, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, do: torch.Tensor, _dlse: torch.Tensor):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = flash_attention_backward(q, k, v, o, do.contiguous(), lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


flash_attention.register_autograd(_backward, setup_context=_setup_context)


def attention_scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
