"""Which aten ops AOTAutograd decomposes before lowering, and which stay whole.

Start from torch's core-ATen decompositions so the set of ops to lower stays small, but keep whole the
ops that NKI kernels take (matmul, softmax, layer_norm, attention) and those with a device-friendly
form (gelu, silu).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions, get_decompositions
from torch._ops import OpOverload

aten = torch.ops.aten

#: How the table treats an op (``Treatment.kind``).
KEPT_WHOLE = "kept whole"
FROM_TORCH = "torch's decomposition (from torch._decomp, not core ATen's)"
OURS = "our decomposition (decompositions.py)"
PER_TENSOR = "one op per tensor of the lists (decompositions.py::_foreach_decomposition)"
CORE = "core ATen's decomposition"


@dataclass(frozen=True)
class Treatment:
    """How ``decomposition_table()`` treats one op, and why (the ``why`` of a CORE entry of ``PLAN``: why
    the op's lowering is kept although the table decomposes it)."""

    kind: str
    why: str = ""
    #: OURS: the decomposition.
    fn: Callable[..., Any] | None = None

    def describe(self) -> str:
        if self.kind == CORE and self.why:
            return f"{self.kind}; lowered too: {self.why}"
        return f"{self.kind}: {self.why}" if self.why else self.kind


#: op (packet or overload) -> its treatment, for every op whose treatment is decided here rather than by torch's
#: core-ATen table: kept whole, torch's non-core decomposition taken, our own decomposition, and the core-ATen
#: decomposed ops that are lowered too (with why). Read per op through ``treatment_of`` (and
#: ``DispatchRecord.decomposition``); tests/test_registry.py checks the lowered-and-decomposed entries are exact.
PLAN: dict[Any, Treatment] = {}


def _plan(kind: str, why: str, *ops: Any, fn: Callable[..., Any] | None = None) -> None:
    for op in ops:
        if op in PLAN:
            raise ValueError(f"{op} is planned twice: {PLAN[op].describe()} and {kind}: {why}")
        PLAN[op] = Treatment(kind, why, fn)


_plan(KEPT_WHOLE, "an NKI kernel takes it (lowering/kernel_routing.py)",
      aten._softmax, aten._log_softmax, aten._softmax_backward_data, aten._log_softmax_backward_data,
      aten.native_layer_norm, aten.native_layer_norm_backward, aten.addmm, aten.mm, aten.bmm)  # fmt: skip
_plan(KEPT_WHOLE, "a device-friendly form, lowered whole",
      aten.gelu, aten.gelu_backward, aten.silu, aten.silu_backward, aten.embedding,
      aten.embedding_dense_backward, aten.nll_loss_forward, aten.nll_loss_backward)  # fmt: skip
_plan(KEPT_WHOLE, "computed in opmath and rounded once, in eager's order of operations (lowering/pointwise.py); "
      "Dynamo's own split of these ops is undone for neuron compiles (trace_fixes.py)",
      aten.addcmul, aten.addcdiv)  # fmt: skip
_plan(
    KEPT_WHOLE, "torch's decomposition indexes with a 0-d index tensor, which guards on its data (.item())", aten.take
)
_plan(KEPT_WHOLE, "core ATen maps it to alias(), a view: in a scan/map body that aliases the body's input, which "
      "torch's autograd of those ops refuses (\"scan might be aliasing\"); lowered as the value it is "
      "(lowering/views.py)", aten.detach)  # fmt: skip
_plan(KEPT_WHOLE, "lowered with constant-index gathers / concatenation (lowering/padding.py); torch's "
      "decompositions compute the indices in the graph (more ops, non-constant gathers, float64 aranges)",
      aten.upsample_nearest1d, aten.upsample_nearest2d, aten.upsample_nearest3d,
      aten._upsample_nearest_exact1d, aten._upsample_nearest_exact2d, aten._upsample_nearest_exact3d,
      aten.upsample_linear1d, aten.upsample_bilinear2d, aten.upsample_trilinear3d,
      aten.upsample_nearest1d_backward, aten.upsample_nearest2d_backward, aten.upsample_nearest3d_backward,
      aten._upsample_nearest_exact1d_backward, aten._upsample_nearest_exact2d_backward,
      aten._upsample_nearest_exact3d_backward, aten.upsample_linear1d_backward,
      aten.upsample_bilinear2d_backward, aten.upsample_trilinear3d_backward,
      aten.reflection_pad1d, aten.reflection_pad2d, aten.reflection_pad3d,
      aten.replication_pad1d, aten.replication_pad2d, aten.replication_pad3d,
      aten.reflection_pad1d_backward, aten.reflection_pad2d_backward, aten.reflection_pad3d_backward,
      aten.replication_pad1d_backward, aten.replication_pad2d_backward, aten.replication_pad3d_backward)  # fmt: skip

# Non-core ops that torch's own decomposition table (torch._decomp, also used by Inductor) reduces to ops
# lowered here with eager's numerics; each is taken from torch rather than lowered by hand.
_plan(FROM_TORCH, "eager's own formula (the difference rounded to the input dtype, then the norm in opmath), so "
      "bfloat16 rounds where eager does", aten.dist)  # fmt: skip
_plan(FROM_TORCH, "narrow + clone: a static slice", aten.narrow_copy)
_plan(FROM_TORCH, "what nn.BatchNorm's training forward becomes under torch.export-style functionalization; "
      "torch's decomposition is native_batch_norm's own helper (var_mean, rsqrt, running-stat update in opmath)",
      aten._batch_norm_with_update_functional)  # fmt: skip
_plan(FROM_TORCH, "the backward autograd records for _batch_norm_with_update: native_batch_norm_backward's "
      "decomposition, which core ATen already uses for the other batch-norm forms", aten.batch_norm_backward)  # fmt: skip
_plan(FROM_TORCH, "bilinear/nearest/bicubic sampling as gathers at computed indices, with pw_cast_for_opmath "
      "(16-bit inputs computed in float32, rounded once); its backward, which autograd records before the table "
      "runs, is lowered (lowering/grid_sample.py)", aten.grid_sampler_2d)  # fmt: skip
_plan(FROM_TORCH, "the backward autograd records for rrelu (lowering/activations.py::rrelu_with_noise_functional): "
      "leaky_relu_backward at the mean slope in eval, grad * noise in training", aten.rrelu_with_noise_backward)  # fmt: skip


def _exact_integral_linspace(reference: Callable[..., Any]) -> Callable[..., Any]:
    """linspace for an integral result dtype, in integers.

    Eager's kernel converts the endpoints to the result dtype (4.3 -> 4), steps from them in double and
    truncates. torch's reference steps from the unconverted endpoints in float, which the backend computes
    in float32 (Trainium has no float64): ``linspace(0, 7, 50, dtype=int64)[28]`` comes out 3, not 4. The
    exact value ``start + (end - start) * i / (steps - 1)`` truncated is one integer division with
    truncation, ``(start * (steps - 1) + (end - start) * i) // (steps - 1)``, which eager's halfway-split
    double arithmetic reproduces."""

    @functools.wraps(reference)
    def decomposition(start: Any, end: Any, steps: Any, *args: Any, dtype: Any = None, **kwargs: Any) -> Any:
        if dtype is None or dtype.is_floating_point or dtype.is_complex or steps < 2 or args or "out" in kwargs:
            return reference(start, end, steps, *args, dtype=dtype, **kwargs)
        first, last = (v.to(torch.int64) if isinstance(v, torch.Tensor) else int(v) for v in (start, end))
        factory = {k: v for k, v in kwargs.items() if k in ("device", "pin_memory", "layout")}
        i = torch.arange(0, steps, dtype=torch.int64, **factory)
        q = steps - 1
        numerator = i * (last - first) + first * q
        return torch.div(numerator, q, rounding_mode="trunc").to(dtype)

    return decomposition


def _smooth_l1_beta_checked(reference: Callable[..., Any], beta_position: int) -> Callable[..., Any]:
    """torch's smooth_l1_loss (or backward) decomposition with eager's check of ``beta``, which it lacks: a
    negative beta is an error in eager and a value under compile (pytorch/pytorch#194501, open)."""

    @functools.wraps(reference)
    def decomposition(*args: Any, **kwargs: Any) -> Any:
        beta = args[beta_position] if len(args) > beta_position else kwargs.get("beta", 1.0)
        torch._check(beta >= 0, lambda: "smooth_l1_loss does not support negative values for beta.")
        return reference(*args, **kwargs)

    return decomposition


#: Where ``beta`` is among the positional arguments of each checked smooth_l1 overload.
_SMOOTH_L1_BETA = {aten.smooth_l1_loss.default: 3, aten.smooth_l1_loss_backward.default: 4}


def _opmath(t: torch.Tensor) -> torch.Tensor:
    """16-bit floats computed in float32, as eager's CPU kernels accumulate."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def _sdpa_flash_for_cpu_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward autograd records for SDPA's CPU flash kernel, as attention math.

    ``rewrite_sdpa`` replaces the SDPA calls Dynamo puts in a graph, but not those inside functions Dynamo
    keeps whole, such as ``F.multi_head_attention_forward`` (``nn.MultiheadAttention`` with
    ``need_weights=False``, hence every ``nn.TransformerEncoderLayer``). The weights are recomputed from
    ``query`` and ``key``: ``logsumexp`` is not used because torch's decomposition of the forward puts the
    attention weights in its place. Computed in float32 for 16-bit inputs, as the CPU kernel accumulates.
    The forward's mask is already additive (SDPA converts a boolean one before choosing this kernel), and
    the kernel takes no dropout. A query whose every key is masked has zero weights, hence zero gradients,
    as in the kernel (whose forward gives it a zero output)."""
    torch._check(dropout_p == 0.0, lambda: f"CPU flash attention takes no dropout, got {dropout_p}")
    q, k, v, do, o = (_opmath(t) for t in (query, key, value, grad_out, out))
    groups = q.size(-3) // k.size(-3)  # grouped-query attention: each key/value head serves `groups` heads
    k, v = (t.repeat_interleave(groups, -3) for t in (k, v))
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if is_causal:
        causal = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores + _opmath(attn_mask)
    weights = torch.ops.aten._safe_softmax(scores, -1)
    grad_v = weights.transpose(-2, -1) @ do
    grad_scores = weights * (do @ v.transpose(-2, -1) - (do * o).sum(-1, keepdim=True))
    grad_q = grad_scores @ k * scale
    grad_k = grad_scores.transpose(-2, -1) @ q * scale
    grad_k, grad_v = (g.unflatten(-3, (-1, groups)).sum(-3) for g in (grad_k, grad_v))
    return grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype)


def _native_multi_head_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    embed_dim: int,
    num_head: int,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    proj_weight: torch.Tensor,
    proj_bias: torch.Tensor,
    mask: torch.Tensor | None = None,
    need_weights: bool = True,
    average_attn_weights: bool = True,
    mask_type: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``nn.MultiheadAttention``'s inference fast path (eval mode, no autograd), as attention math.

    The kernel's mask rule, which is not SDPA's: any nonzero element hides its key, whatever the mask's
    dtype (the module has turned boolean masks into 0/-inf floats by then); ``mask_type`` 1 is a key
    padding mask ``[B, S]``, 0 and 2 broadcast as ``[L, S]`` and ``[B, H, L, S]``. A row with every key
    hidden is NaN, as in eager. The query is scaled before the product, as the kernel does."""
    q_w, k_w, v_w = qkv_weight.chunk(3)
    q_b, k_b, v_b = qkv_bias.chunk(3)

    def heads(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight, bias).unflatten(-1, (num_head, -1)).transpose(1, 2)

    q, k, v = heads(query, q_w, q_b), heads(key, k_w, k_b), heads(value, v_w, v_b)
    scores = (q * (1.0 / math.sqrt(q.size(-1)))) @ k.transpose(-2, -1)
    if mask is not None:
        hidden = mask != 0
        scores = scores.masked_fill(hidden[:, None, None, :] if mask_type == 1 else hidden, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    out = F.linear((weights @ v).transpose(1, 2).flatten(2), proj_weight, proj_bias)
    if not need_weights:
        return out, None
    return out, weights.mean(1) if average_attn_weights else weights


def _transformer_encoder_layer_fwd(
    src: torch.Tensor,
    embed_dim: int,
    num_heads: int,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    proj_weight: torch.Tensor,
    proj_bias: torch.Tensor,
    use_gelu: bool,
    norm_first: bool,
    eps: float,
    norm_weight_1: torch.Tensor,
    norm_bias_1: torch.Tensor,
    norm_weight_2: torch.Tensor,
    norm_bias_2: torch.Tensor,
    ffn_weight_1: torch.Tensor,
    ffn_bias_1: torch.Tensor,
    ffn_weight_2: torch.Tensor,
    ffn_bias_2: torch.Tensor,
    mask: torch.Tensor | None = None,
    mask_type: int | None = None,
) -> torch.Tensor:
    """``nn.TransformerEncoderLayer``'s inference fast path: the layer's own math (attention as
    ``_native_multi_head_attention``, residuals, the two layer norms before or after, a ReLU/GELU MLP)."""

    def norm1(x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (embed_dim,), norm_weight_1, norm_bias_1, eps)

    def norm2(x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (embed_dim,), norm_weight_2, norm_bias_2, eps)

    x = norm1(src) if norm_first else src
    args = (embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, False, True, mask_type)
    x = _native_multi_head_attention(x, x, x, *args)[0] + src
    if not norm_first:
        x = norm1(x)
    hidden = F.linear(norm2(x) if norm_first else x, ffn_weight_1, ffn_bias_1)
    x = F.linear(F.gelu(hidden) if use_gelu else F.relu(hidden), ffn_weight_2, ffn_bias_2) + x
    return x if norm_first else norm2(x)


def _weight_norm_interface_backward(
    grad_w: torch.Tensor, saved_v: torch.Tensor, saved_g: torch.Tensor, saved_norms: torch.Tensor, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward autograd records for weight normalization (``nn.utils.parametrizations.weight_norm``),
    ``w = g * v / ||v||`` with the norm over every dim but ``dim``: ``grad_g = sum(grad_w * v) / ||v||`` and
    ``grad_v = g / ||v|| * (grad_w - v * grad_g / ||v||)``, in float32 for 16-bit inputs."""
    reduced = [i for i in range(saved_v.dim()) if i != dim]
    grad, v, g, norms = (_opmath(t) for t in (grad_w, saved_v, saved_g, saved_norms))
    grad_g = (grad * v).sum(reduced, keepdim=True) / norms
    grad_v = g / norms * (grad - v * (grad_g / norms))
    return grad_v.to(saved_v.dtype), grad_g.to(saved_g.dtype)


def _multilabel_margin_terms(
    input: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What eager's multilabel_margin_loss kernels loop over, as masks over ``[row, slot j, class i]``.

    A row's targets are its target entries before the first negative one (the kernel stops there: slots
    after a -1 do not count, whatever they hold). ``counted[n, j, i]``: slot j is a target, class i is none
    of the row's targets, and ``z = 1 - x[target_j] + x[i] > 0`` (strictly, as the kernel tests: a zero
    term has no gradient either). 16-bit inputs are computed in float32. Returns (input as ``[N, C]`` in
    opmath, the targets gather-safe ``[N, C]``, ``z``, ``counted``, ``is_target [N, C]`` as bool)."""
    x = _opmath(input).reshape(-1, input.shape[-1] if input.dim() else 1)
    t = target.reshape(x.shape)
    classes = torch.arange(x.shape[1], device=x.device)
    end = torch.where(t < 0, classes, x.shape[1]).amin(dim=1, keepdim=True)  # first -1 (C if none)
    in_use = classes < end  # [N, slot]
    safe = torch.where(in_use, t, 0)
    is_target = ((safe.unsqueeze(-1) == classes) & in_use.unsqueeze(-1)).any(dim=1)  # [N, class]
    z = (1 - torch.gather(x, 1, safe)).unsqueeze(-1) + x.unsqueeze(1)  # [N, slot, class]
    counted = in_use.unsqueeze(-1) & ~is_target.unsqueeze(1) & (z > 0)
    return x, safe, z, counted, is_target


def _multilabel_margin_check(input: torch.Tensor, target: torch.Tensor) -> None:
    """Eager's shape rules (``multilabel_margin_loss_shape_check``)."""
    torch._check(
        input.dim() <= 2 and (input.dim() == 0 or input.shape[-1] != 0),
        lambda: f"Expected non-empty vector or matrix with optional 0-dim batch size, but got: {input.shape}",
    )
    same = target.shape == input.shape if input.dim() == 2 else target.dim() <= 1 and target.numel() == input.numel()
    torch._check(same, lambda: f"inconsistent size {target.shape} for argument #2 'target'")


def _multilabel_margin_loss_forward(
    input: torch.Tensor, target: torch.Tensor, reduction: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``multilabel_margin_loss_forward`` as eager computes it: per row, the sum over its targets j (the
    entries before the first -1) and its non-target classes i of ``max(0, 1 - x[j] + x[i])``, over C.

    torch 2.13's decomposition (also its Autograd kernel, which every tracer meets) counts the slots after
    the first -1 too, each as a target of class 0, and gives a 1-d input a ``(1,)`` loss for
    ``reduction="none"``, where eager's is 0-d (pytorch/pytorch#141017, fixed upstream after 2.13). Its
    gradient, derived by autograd, is eager's ``multilabel_margin_loss_backward``: -1/C to a target and
    +1/C to a class per counted term (none at ``z == 0``)."""
    _multilabel_margin_check(input, target)
    x, _, z, counted, is_target = _multilabel_margin_terms(input, target)
    per_row = torch.where(counted, z, 0).sum(dim=(1, 2))
    dim = x.shape[1]
    if reduction == 1:  # mean
        loss = per_row.sum() / dim / x.shape[0]
    elif reduction == 2:  # sum
        loss = per_row.sum() / dim
    else:
        loss = per_row / dim
        loss = loss.reshape(()) if target.dim() <= 1 else loss
    return loss.to(input.dtype), is_target.to(input.dtype).reshape(target.shape)


def _multilabel_margin_loss_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    target: torch.Tensor,
    reduction: int,
    is_target: torch.Tensor,
) -> torch.Tensor:
    """``multilabel_margin_loss_backward`` (what eager's autograd records for the forward; a graph traced
    with torch's Autograd-level decomposition never holds it): per counted term, -1 to its target's
    gradient and +1 to its class's, scaled by ``1/C`` (``1/(N*C)`` for the mean) and the output gradient."""
    _multilabel_margin_check(input, target)
    x, safe, z, counted, _ = _multilabel_margin_terms(input, target)
    n, dim = x.shape
    counts = counted.to(x.dtype)
    grad = counts.sum(dim=1) - torch.zeros_like(x).scatter_add(1, safe, counts.sum(dim=2))
    grad = grad * (1.0 / (n * dim) if reduction == 1 else 1.0 / dim)
    g = _opmath(grad_output)
    grad = grad * (g.reshape(-1, 1) if reduction == 0 and grad_output.dim() > 0 else g.reshape(()))
    return grad.to(input.dtype).reshape(input.shape)


def _multi_margin_loss(
    input: torch.Tensor,
    target: torch.Tensor,
    p: Any = 1,
    margin: Any = 1,
    weight: torch.Tensor | None = None,
    reduction: int = 1,
) -> torch.Tensor:
    """``multi_margin_loss`` as eager computes it: per row, the sum over the classes i other than the
    target y of ``h = w[y] * z**p`` for ``z = margin - x[y] + x[i] > 0`` (strictly: a zero term has no
    gradient, where torch 2.13's decomposition, ``clamp_min(z, 0)``, gives p=1 ties a gradient), over C.
    ``reduction="none"`` with a 0-d target gives a 0-d loss, as eager (torch's gives ``(1,)``)."""
    torch._check(p == 1 or p == 2, lambda: "only p == 1 and p == 2 supported")
    torch._check(
        input.dim() <= 2 and (input.dim() == 0 or input.shape[-1] != 0),
        lambda: f"Expected non-empty vector or matrix with optional 0-dim batch size, but got: {input.shape}",
    )
    x = _opmath(input).reshape(-1, input.shape[-1] if input.dim() else 1)
    nframe, dim = x.shape
    torch._check(
        target.dim() <= 1 and target.numel() == nframe,
        lambda: f"inconsistent target size, expected {nframe} but got {target.shape}",
    )
    t = target.reshape(nframe, 1)
    z = (margin - torch.gather(x, 1, t)) + x  # eager's order: (margin - x[y]) + x[i]
    counted = (torch.arange(dim, device=x.device) != t) & (z > 0)
    h = z if p == 1 else z * z
    if weight is not None:
        torch._check(
            weight.dim() <= 1 and weight.numel() == dim,
            lambda: f"inconsistent weight size, expected {dim} but got {weight.shape}",
        )
        h = h * _opmath(weight).reshape(-1)[t]
    per_row = torch.where(counted, h, 0).sum(dim=1)
    if reduction == 1:  # mean
        loss = per_row.sum() / dim / nframe
    elif reduction == 2:  # sum
        loss = per_row.sum() / dim
    else:
        loss = (per_row / dim).reshape(target.shape)  # (N,), or 0-d for a 0-d target
    return loss.to(input.dtype)


# ---- LSTM as eager's oneDNN kernel computes it -------------------------------------------------------------
# Eager's CPU LSTM (float32 and bfloat16, training and inference) is oneDNN's: the gates of each step are
# x @ W_ih^T + h @ W_hh^T + (b_ih + b_hh) accumulated in float32 (the bias pair summed in the dtype first),
# the gate math in float32, and h and c rounded to the dtype once per step (tanh(c) takes c before rounding);
# its backward takes the gates' gradient in the dtype and sums the parameters' gradients over time in float32.
# A bfloat16 emulation of that order is bit-identical to eager's forward where oneDNN has bfloat16 kernels
# (AVX-512, AVX512-BF16, AMX). On an AVX2-only CPU eager's bfloat16 LSTM is ATen's per-op kernel instead
# (oneDNN refuses bfloat16 there), which rounds every gate op: that is a fallback for missing instructions,
# not another definition, and it is less accurate (about 2x the RMS error against float64), so the lowering
# keeps this order on every host, as it must for a graph that runs on Trainium. Tests judge both eager
# orders and ours against float64 with a derived bound (tests/rounding_bounds.py), never one CPU's eager
# bits. torch's decomposition rounds every gate op to bfloat16 too (compiled output and bias gradients 2-4x
# oneDNN's error against float64) and ignores the dropout between layers (``_rnn_helper`` tests
# ``num_layers < i - 1``).
_OPMATH_RECURRENT: contextvars.ContextVar[bool] = contextvars.ContextVar("neuron_opmath_recurrent", default=False)
#: The dtypes eager's oneDNN LSTM takes on CPU; others (float16, float64) keep torch's decomposition.
_ONEDNN_LSTM_DTYPES = (torch.float32, torch.bfloat16)


@contextlib.contextmanager
def opmath_recurrent() -> Iterator[None]:
    """While tracing a neuron compile: ``aten.lstm.input`` decomposes as eager's oneDNN kernel computes it
    (``_onednn_lstm``). Other backends' traces keep torch's decomposition."""
    token = _OPMATH_RECURRENT.set(True)
    try:
        yield
    finally:
        _OPMATH_RECURRENT.reset(token)


def _round_value(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` (as eager stores h and c between steps), its gradient passed through in
    float32: rounding is not a function to differentiate, and oneDNN's state gradients stay float32."""
    if dtype == x.dtype:
        return x
    rounded = x.to(dtype).to(x.dtype)
    return x + (rounded - x).detach()  # exact: the rounding residual is representable in float32


def _round_gradient(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` unchanged, its gradient rounded to ``dtype``: oneDNN's backward multiplies the gates' gradient
    in the dtype. (bfloat16 has float32's range, so ``x - rounded`` is finite.)"""
    if dtype == x.dtype:
        return x
    rounded = x.to(dtype).to(x.dtype)
    return rounded + (x - rounded).detach()


def _onednn_lstm_layer(
    x: torch.Tensor,
    h0: torch.Tensor,
    c0: torch.Tensor,
    params: Sequence[torch.Tensor],
    has_biases: bool,
    reverse: bool,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One direction of one layer on float32 ``x`` (T, B, I) holding ``dtype`` values: outputs (T, B, H), h, c."""
    w_ih, w_hh = params[0].float(), params[1].float()
    bias = (params[2] + params[3]).float() if has_biases else None
    w_hr = params[-1].float() if len(params) in (3, 5) else None  # proj_size
    gates_x = F.linear(x, w_ih)
    h, c = h0.float(), c0.float()
    steps = range(x.size(0) - 1, -1, -1) if reverse else range(x.size(0))
    outputs: list[torch.Tensor] = [x] * x.size(0)
    for t in steps:
        gates = gates_x[t] + F.linear(h, w_hh)
        if bias is not None:
            gates = gates + bias
        in_gate, forget_gate, cell_gate, out_gate = _round_gradient(gates, dtype).chunk(4, -1)
        c_new = forget_gate.sigmoid() * c + in_gate.sigmoid() * cell_gate.tanh()
        h_new = out_gate.sigmoid() * c_new.tanh()
        if w_hr is not None:
            h_new = F.linear(h_new, w_hr)
        h, c = _round_value(h_new, dtype), _round_value(c_new, dtype)
        outputs[t] = h
    return torch.stack(outputs), h, c


def _onednn_lstm(
    input: torch.Tensor,
    hx: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    batch_first: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten.lstm.input`` in eager's oneDNN order of operations (see above), unrolled over time."""
    dtype = input.dtype
    directions = 2 if bidirectional else 1
    per_direction = 2 + 2 * int(has_biases) + int(hx[0].size(-1) != hx[1].size(-1))
    x = (input.transpose(0, 1) if batch_first else input).float()
    h_n: list[torch.Tensor] = []
    c_n: list[torch.Tensor] = []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            k = layer * directions + direction
            group = params[k * per_direction : (k + 1) * per_direction]
            out, h, c = _onednn_lstm_layer(x, hx[0][k], hx[1][k], group, has_biases, direction == 1, dtype)
            outputs.append(out)
            h_n.append(h)
            c_n.append(c)
        x = torch.cat(outputs, -1) if directions == 2 else outputs[0]
        if dropout and train and layer < num_layers - 1:
            x = torch.dropout(x.to(dtype), dropout, True).float()  # eager drops out the stored layer output
    out = x.transpose(0, 1) if batch_first else x
    return out.to(dtype), torch.stack(h_n).to(dtype), torch.stack(c_n).to(dtype)


def _lstm(
    input: torch.Tensor,
    hx: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    *args: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten.lstm.input``'s Python-dispatcher kernel: oneDNN's order in a neuron trace of a float32 or
    bfloat16 LSTM, torch's decomposition otherwise."""
    from torch._decomp.decompositions import lstm_impl

    dtypes = {t.dtype for t in (input, *hx, *params)}
    if _OPMATH_RECURRENT.get() and len(dtypes) == 1 and input.dtype in _ONEDNN_LSTM_DTYPES:
        return _onednn_lstm(input, hx, params, *args)
    return lstm_impl(input, hx, params, *args)


#: Decompositions of torch's that it also registers as the op's Autograd kernel for the Python dispatcher
#: (``py_impl(DispatchKey.Autograd)``), so that AOTAutograd, Dynamo's fake propagation and export decompose
#: the op above autograd whatever table they are given; where torch's is wrong, ours replaces it there too.
AUTOGRAD_KERNEL_FIXES: dict[Any, Callable[..., Any]] = {
    aten.multilabel_margin_loss_forward.default: _multilabel_margin_loss_forward,
    aten.multi_margin_loss.default: _multi_margin_loss,
    # Also its CompositeImplicitAutograd kernel (inference traces reach that one): _KEYS_ALSO_REPLACED.
    aten.lstm.input: _lstm,
}
#: Ops of ``AUTOGRAD_KERNEL_FIXES`` whose CompositeImplicitAutograd Python kernel is replaced too.
_KEYS_ALSO_REPLACED = (aten.lstm.input,)


def fix_autograd_kernels() -> None:
    """Put ``AUTOGRAD_KERNEL_FIXES`` in place of torch's Autograd kernels (idempotent). Called when the
    backend is imported, before Dynamo traces a frame (its fake propagation runs these kernels too)."""
    from torch._C import DispatchKey

    for op, fixed in AUTOGRAD_KERNEL_FIXES.items():
        keys = [DispatchKey.Autograd] + [DispatchKey.CompositeImplicitAutograd] * (op in _KEYS_ALSO_REPLACED)
        for key in keys:
            if op.py_kernels.get(key) is not fixed:
                op.py_kernels[key] = fixed
                op._dispatch_cache.clear()


#: The per-tensor op of a ``_foreach_*`` overload where its name is not the op's: eager's CPU kernels compute
#: maximum/minimum with a scalar as clamp_min/clamp_max, and norm as linalg_vector_norm.
_FOREACH_BASE = {
    ("maximum", "Scalar"): "clamp_min",
    ("maximum", "ScalarList"): "clamp_min",
    ("minimum", "Scalar"): "clamp_max",
    ("minimum", "ScalarList"): "clamp_max",
    ("norm", "Scalar"): "linalg_vector_norm",
}
#: Positional arguments of a ``_foreach_*`` op that its per-tensor op takes by keyword.
_FOREACH_KEYWORDS = {"addcmul": {3: "value"}, "addcdiv": {3: "value"}, "norm": {2: "dtype"}}


def _foreach_decomposition(schema: torch._C.FunctionSchema) -> Callable[..., Any] | None:
    """``_foreach_X(lists...)`` as ``[X(elements of position i) for i]``: what eager's CPU kernels do (the
    fused multi-tensor kernels exist for GPUs only), so values match eager's. Compiled optimizer steps
    (``torch.compile(opt.step)``, ``foreach=True``) and ``clip_grad_norm_`` trace to these."""
    name = schema.name.removeprefix("aten::_foreach_")
    if name in ("powsum",) or (name in ("addcmul", "addcdiv") and schema.overload_name == "Tensor"):
        return None  # a sum of powers; and a tensor of per-list scalars, which eager turns into numbers (.item())
    base = getattr(aten, _FOREACH_BASE.get((name, schema.overload_name), name))
    listed = [str(a.type) in ("List[Tensor]", "List[number]") for a in schema.arguments if not a.kwarg_only]
    keywords = _FOREACH_KEYWORDS.get(name, {})

    def decomposition(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
        length = len(next(a for a, is_list in zip(args, listed) if is_list))
        results = []
        for i in range(length):
            elements = [a[i] if is_list else a for a, is_list in zip(args, listed)]
            by_name = {keywords[j]: v for j, v in enumerate(elements) if j in keywords}
            results.append(base(*(v for j, v in enumerate(elements) if j not in keywords), **by_name, **kwargs))
        return results

    return decomposition


@functools.lru_cache(maxsize=None)
def _foreach_decompositions() -> dict[Any, Callable[..., Any]]:
    table = {}
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::_foreach_") or schema.name.endswith("_"):
            continue
        if "out" in schema.overload_name:  # the functional overloads only: AOTAutograd functionalizes
            continue
        decomposition = _foreach_decomposition(schema)
        if decomposition is not None:
            packet = getattr(aten, schema.name.removeprefix("aten::"))
            table[getattr(packet, schema.overload_name or "default")] = decomposition
    return table


_NONE_IN_TORCH = "torch has no decomposition for it"
_TORCHS_WRONG = "torch's is wrong (see the function); also its Autograd kernel (AUTOGRAD_KERNEL_FIXES)"
_plan(OURS, _NONE_IN_TORCH, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
      fn=_sdpa_flash_for_cpu_backward)  # fmt: skip
_plan(OURS, _NONE_IN_TORCH, aten._native_multi_head_attention.default, fn=_native_multi_head_attention)
_plan(OURS, _NONE_IN_TORCH, aten._transformer_encoder_layer_fwd.default, fn=_transformer_encoder_layer_fwd)
_plan(OURS, _NONE_IN_TORCH, aten._weight_norm_interface_backward.default, fn=_weight_norm_interface_backward)
_plan(OURS, _TORCHS_WRONG, aten.multilabel_margin_loss_forward.default, fn=_multilabel_margin_loss_forward)
_plan(OURS, "torch's is wrong (see the function)", aten.multilabel_margin_loss_backward.default,
      fn=_multilabel_margin_loss_backward)  # fmt: skip
_plan(OURS, _TORCHS_WRONG, aten.multi_margin_loss.default, fn=_multi_margin_loss)


def _planned(kind: str) -> list[Any]:
    return [op for op, treatment in PLAN.items() if treatment.kind == kind]


#: The ops ``PLAN`` keeps whole (packets); the non-core ops whose torch decomposition is taken; ours.
KEEP_WHOLE = _planned(KEPT_WHOLE)
EXTRA_DECOMPOSITIONS = _planned(FROM_TORCH)
OWN_DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {op: PLAN[op].fn for op in _planned(OURS)}


def _core_aten() -> dict[Any, Callable[..., Any]]:
    """torch's core-ATen decompositions, without the entries ``core_aten_decompositions()`` adds for
    CompositeImplicitAutograd ops: those are for torch.export, whose graphs may hold such ops; AOTAutograd
    traces below autograd, where they have already decomposed through their implicit kernels. Building
    them walks every registered op (~0.15 s of each process's first compile)."""
    post_autograd = getattr(torch._decomp, "_core_aten_decompositions_post_autograd", None)
    return dict(post_autograd() if post_autograd is not None else core_aten_decompositions())


@functools.lru_cache(maxsize=None)
def _table() -> dict[Any, Callable[..., Any]]:
    fix_autograd_kernels()
    table = _core_aten()
    table.update(get_decompositions(EXTRA_DECOMPOSITIONS))
    table.update(OWN_DECOMPOSITIONS)
    table.update(_foreach_decompositions())
    keep = set()
    for packet in KEEP_WHOLE:
        for name in packet.overloads():
            keep.add(getattr(packet, name))
    for name in aten.linspace.overloads():
        op = getattr(aten.linspace, name)
        if op in table:
            table[op] = _exact_integral_linspace(table[op])
    for op, position in _SMOOTH_L1_BETA.items():
        if op in table:
            table[op] = _smooth_l1_beta_checked(table[op], position)
    return {op: fn for op, fn in table.items() if op not in keep}


def decomposition_table() -> dict[Any, Callable[..., Any]]:
    """The decomposition table given to AOTAutograd (a fresh dict; callers may extend it)."""
    return dict(_table())


def treatment_of(op: OpOverload) -> Treatment | None:
    """How ``decomposition_table()`` treats the overload ``op``: kept whole, decomposed (by whose
    decomposition, and for a lowered op why its lowering is kept), or None when the table leaves it alone."""
    planned = PLAN.get(op) or PLAN.get(op.overloadpacket)
    if op not in _table():
        return planned if planned is not None and planned.kind == KEPT_WHOLE else None
    if planned is not None and planned.kind != KEPT_WHOLE:
        return planned
    if op in _foreach_decompositions():
        return Treatment(PER_TENSOR)
    return Treatment(CORE)


# A graph traced by AOTAutograd with ``decomposition_table()`` never holds these: torch decomposes them
# first (the OpInfo sweep saw none of them reach the backend). They stay lowered because
# ``lowering.lower_graph`` takes any aten graph, e.g. one from ``make_fx`` or ``torch.export`` traced
# without our table, where they are the op's direct form.
_WITHOUT_OUR_TABLE = "reached only in aten graphs traced without decomposition_table() (lower_graph on make_fx/export)"
_INDEX_ADD_REASON = (
    "reached in aten graphs traced without decomposition_table(); tests/test_lowering_indexing.py lowers "
    "it directly to check alpha and duplicate indices"
)

# Every overload that is both lowered (lowering/) and decomposed away by core ATen's table, with why its
# lowering is kept (tests/test_registry.py checks that these entries are exact).
_plan(CORE, _WITHOUT_OUR_TABLE,
      aten._unsafe_view.default,
      aten.all.default,
      aten.all.dim,
      aten.all.dims,
      aten.arange.default,
      aten.arange.start,
      aten.bernoulli.default,
      aten.clamp_max.Tensor,
      aten.clamp_max.default,
      aten.clamp_min.Tensor,
      aten.clamp_min.default,
      aten.diagonal_copy.default,
      aten.empty_like.default,
      aten.expand_copy.default,
      aten.floor_divide.Scalar,
      aten.floor_divide.default,
      aten.index_copy.default,
      aten.index_fill.int_Scalar,
      aten.index_fill.int_Tensor,
      aten.native_dropout_backward.default,
      aten.new_empty.default,
      aten.new_full.default,
      aten.new_ones.default,
      aten.new_zeros.default,
      aten.ones.default,
      aten.ones_like.default,
      aten.rsub.Scalar,
      aten.rsub.Tensor,
      aten.select_scatter.default,
      aten.sgn.default,
      aten.split.Tensor,
      aten.split_with_sizes_copy.default,
      aten.squeeze.default,
      aten.squeeze.dim,
      aten.squeeze_copy.default,
      aten.squeeze_copy.dim,
      aten.squeeze_copy.dims,
      aten.sum.default,
      aten.t.default,
      aten.t_copy.default,
      aten.transpose.int,
      aten.transpose_copy.int,
      aten.unbind.int,
      aten.unsqueeze_copy.default,
      aten.zeros.default,
      aten.zeros_like.default,
)  # fmt: skip
_plan(CORE, _INDEX_ADD_REASON, aten.index_add.default)
#: Every overload both lowered and decomposed away -> why its lowering is kept.
LOWERED_AND_DECOMPOSED: dict[Any, str] = {op: PLAN[op].why for op in _planned(CORE)}


# ---- Python floats that Dynamo passes as inputs --------------------------------------------------------------
# A Python float that changes between calls (an LR scheduler's ``lr``, OneCycleLR's ``betas``) reaches
# AOTAutograd as a float64 0-d input whose ``.item()`` is a SymFloat; torch's pass
# ``tensorify_python_scalars`` (torch/fx/passes/_tensorify_python_scalars.py) then turns each op that takes the
# SymFloat into a tensor op, but only for add/sub/mul/div/pow.Tensor_Tensor and comparisons, and only in
# positional arguments. Any other use makes Dynamo specialize the float again and guard on its value: one
# graph per value, with every backend (Inductor's too). Optimizer steps have such uses, rewritten below into
# the forms the pass takes, for SymFloats only (a number keeps the op whole):
# ``param.add_(grad, alpha=-lr)`` (SGD; an alpha is a keyword), ``beta1 ** step`` (Adam's bias correction:
# pow.Scalar), ``exp_avg.lerp_(grad, 1 - beta1)`` (Adam: lerp.Scalar; ``foreach``: Dynamo's full_like of the
# weight), ``addcdiv_(..., value=-lr)`` (RMSprop: Dynamo's prims.fma) and ``full`` of the value.
# ``mul.Tensor(ones, s)`` is the SymFloat as a 0-d tensor (exact), which the pass turns into the input cast
# to the op's computation dtype.


def _as_tensor(value: Any, dtype: torch.dtype) -> torch.Tensor:
    return aten.mul.Tensor(torch.ones((), dtype=dtype), value)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else torch.ops.prims.convert_element_type.default(t, dtype)


def _symbolic_alpha(op: Any) -> Callable[..., Any]:
    """``add/sub.Tensor(a, b, alpha=s)`` as ``a +/- b * s`` in the computation dtype, rounded once to the
    result's (eager's CPU kernel computes ``alpha * b`` in opmath, as the lowering of the whole op does)."""

    def decomposition(a: Any, b: Any, *, alpha: Any = 1) -> Any:
        if not isinstance(alpha, torch.SymFloat) or not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            return NotImplemented
        from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

        compute, result = elementwise_dtypes(a, b, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
        if not (result.is_floating_point or result.is_complex):
            return NotImplemented
        scaled = aten.mul.Tensor(_cast(b, compute), alpha)
        return _cast(op(_cast(a, compute), scaled), result)

    return decomposition


def _pow_symbolic_base(base: Any, exponent: Any) -> Any:
    """``pow.Scalar(s, t)`` as ``pow.Tensor_Tensor`` of ``s`` as a 0-d tensor of the computation dtype."""
    if not isinstance(base, torch.SymFloat) or not isinstance(exponent, torch.Tensor) or exponent.is_complex():
        return NotImplemented
    from torch._prims_common import get_computation_dtype

    result = exponent.dtype if exponent.is_floating_point() else torch.get_default_dtype()
    return _cast(aten.pow.Tensor_Tensor(_as_tensor(base, get_computation_dtype(result)), exponent), result)


def _lerp_symbolic_weight(start: Any, end: Any, weight: Any) -> Any:
    """``lerp.Scalar(a, b, s)`` as ``lerp.Tensor`` with ``s`` as a 0-d tensor of ``a``'s dtype, as torch's
    decomposition of lerp.Scalar makes it (``start.new_full((), weight)``)."""
    if not isinstance(weight, torch.SymFloat) or not isinstance(start, torch.Tensor):
        return NotImplemented
    return aten.lerp.Tensor(start, end, _as_tensor(weight, start.dtype))


def _fma_symbolic_factor(a: Any, b: Any, c: Any) -> Any:
    """``prims.fma(a, s, c)`` (Dynamo's form of ``addcdiv_(t1, t2, value=-lr)``: RMSprop) as ``a * s + c`` in
    the computation dtype, rounded once to the result's, as the lowering of ``prims.fma`` computes it."""
    if not isinstance(b, torch.SymFloat) or not isinstance(a, torch.Tensor) or not isinstance(c, torch.Tensor):
        return NotImplemented
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

    compute, result = elementwise_dtypes(a, c, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
    if not result.is_floating_point:
        return NotImplemented
    return _cast(aten.add.Tensor(aten.mul.Tensor(_cast(a, compute), b), _cast(c, compute)), result)


def _filled(ones: Callable[..., torch.Tensor], value: Any, dtype: torch.dtype | None) -> Any:
    """A tensor of ``ones(dtype)`` times the SymFloat ``value``, in the computation dtype, cast to ``dtype``."""
    from torch._prims_common import get_computation_dtype

    dtype = dtype or torch.get_default_dtype()
    if not dtype.is_floating_point:
        return NotImplemented
    return _cast(aten.mul.Tensor(ones(get_computation_dtype(dtype)), value), dtype)


def _full_symbolic_value(size: Any, fill_value: Any, **kwargs: Any) -> Any:
    """``full(size, s)`` (torch's decompositions make a scalar weight a tensor with it) as ``ones * s``."""
    if not isinstance(fill_value, torch.SymFloat):
        return NotImplemented
    dtype = kwargs.pop("dtype", None)
    return _filled(lambda d: aten.full.default(size, 1, dtype=d, **kwargs), fill_value, dtype)


def _full_like_symbolic_value(self: Any, fill_value: Any, **kwargs: Any) -> Any:
    """``full_like(t, s)`` (Dynamo's ``_foreach_lerp_`` with a scalar weight: Adam's ``foreach``) as
    ``ones_like * s``."""
    if not isinstance(fill_value, torch.SymFloat) or not isinstance(self, torch.Tensor):
        return NotImplemented
    dtype = kwargs.pop("dtype", None) or self.dtype
    return _filled(lambda d: aten.full_like.default(self, 1, dtype=d, **kwargs), fill_value, dtype)


_SYMBOLIC_SCALAR_DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {
    aten.add.Tensor: _symbolic_alpha(aten.add.Tensor),
    aten.sub.Tensor: _symbolic_alpha(aten.sub.Tensor),
    aten.pow.Scalar: _pow_symbolic_base,
    aten.lerp.Scalar: _lerp_symbolic_weight,
    aten.full.default: _full_symbolic_value,
    aten.full_like.default: _full_like_symbolic_value,
}


def _symbolic_scalar_decompositions() -> dict[Any, Callable[..., Any]]:
    import torch._inductor.inductor_prims  # registers prims.fma, as lowering/pointwise.py does

    return {**_SYMBOLIC_SCALAR_DECOMPOSITIONS, torch.ops.prims.fma.default: _fma_symbolic_factor}


def with_symbolic_scalars(table: dict[Any, Callable[..., Any]]) -> dict[Any, Callable[..., Any]]:
    """``table`` with the rewrites above in front of its entries: an op whose float argument is a SymFloat
    (a changing Python float, passed as an input) is rewritten; otherwise ``table``'s entry, or the op whole.
    Given to AOTAutograd by the backend; ``decomposition_table()`` (what the registry reports) is unchanged,
    since an op with numbers is treated as before."""
    out = dict(table)
    for op, rewrite in _symbolic_scalar_decompositions().items():
        out[op] = _chained(rewrite, table.get(op))
    return out


def _chained(rewrite: Callable[..., Any], previous: Callable[..., Any] | None) -> Callable[..., Any]:
    @functools.wraps(rewrite)
    def decomposition(*args: Any, **kwargs: Any) -> Any:
        out = rewrite(*args, **kwargs)
        if out is NotImplemented and previous is not None:
            return previous(*args, **kwargs)
        return out

    return decomposition
