"""torch's fused LM-head loss: ``F.linear_cross_entropy`` with chunking options (torch 2.13 custom ops).

``torch_nn::_linear_cross_entropy_batch_chunked`` (reduction mean/sum) returns the loss together with the
gradients of input, linear weight and bias, computed in the forward pass (its backward only scales them);
``torch_nn::_linear_cross_entropy_batch_chunked_no_reduction`` returns per-sample losses (its backward is
traced as ordinary aten ops). Eager loops over batch chunks to bound memory; the graph here is static and
small enough to be one pass: logits = input @ W.T + b, cross entropy with class weights and ignore_index,
and the analytic gradients ``coef[n] * (softmax(logits)[n] - onehot(target[n]))`` through the same matmuls.

Numerics: everything in float32 (the op's ``acc_dtype``, which eager requires to be float32 for 16-bit
inputs) and rounded once to the output dtypes; matmuls at full float32 precision. The target's row of the
logits and its class weight are selected with a one-hot mask (a compare with an iota), not a gather whose
indices are data. Means over zero total weight are NaN, as eager's ``where(d == 0, nan, -d)``.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax

from .matmul import dot
from .registry import Unsupported, register_library_op
from .semantics import convert, out_dtype, out_shape

_F32 = jnp.float32


def _f32(value: float) -> Any:
    return jnp.asarray(value, _F32)


def _loss_terms(input: Any, linear_weight: Any, target: Any, linear_bias: Any, weight: Any, ignore_index: int):
    """(logits - rowmax, softmax denominators, one-hot target mask, per-row class weight (0 where ignored))."""
    if input.ndim != 2 or linear_weight.ndim != 2:
        raise Unsupported(f"linear_cross_entropy with input {input.shape} and weight {linear_weight.shape} (2-d only)")
    x, w = convert(input, _F32), convert(linear_weight, _F32)
    logits = dot(x, w, (1, 1))
    if linear_bias is not None:
        logits = lax.add(logits, convert(linear_bias, _F32)[None, :])
    shifted = lax.sub(logits, jnp.max(logits, axis=1, keepdims=True))
    denom = jnp.sum(jnp.exp(shifted), axis=1)
    # Class indices fit int32 (the logits have one column per class); an ignore_index outside int32 never
    # equals a target that is a valid class, so it is compared in int64 first.
    ignored = lax.eq(target, jnp.asarray(ignore_index, target.dtype))
    classes = lax.broadcasted_iota(jnp.int32, shifted.shape, 1)
    target32 = convert(jnp.clip(target, -1, shifted.shape[1]), jnp.int32)
    onehot = lax.bitwise_and(lax.eq(classes, target32[:, None]), lax.bitwise_not(ignored)[:, None])
    if weight is None:
        row_weight = convert(lax.bitwise_not(ignored), _F32)
    else:
        per_class = jnp.broadcast_to(convert(weight, _F32)[None, :], shifted.shape)
        row_weight = jnp.sum(jnp.where(onehot, per_class, _f32(0)), axis=1)
    return shifted, denom, onehot, row_weight


def _per_row_loss(shifted: Any, denom: Any, onehot: Any, row_weight: Any) -> Any:
    target_logit = jnp.sum(jnp.where(onehot, shifted, _f32(0)), axis=1)
    return lax.mul(row_weight, lax.sub(jnp.log(denom), target_logit))


def _grads(input: Any, linear_weight: Any, shifted: Any, denom: Any, onehot: Any, coef: Any) -> tuple[Any, Any, Any]:
    """(d input, d linear weight, d bias) for per-row loss coefficients ``coef`` (d loss / d row loss)."""
    softmax = lax.div(jnp.exp(shifted), denom[:, None])
    dlogits = lax.mul(coef[:, None], lax.sub(softmax, convert(onehot, _F32)))
    d_input = dot(dlogits, convert(linear_weight, _F32), (1, 0))
    d_weight = dot(dlogits, convert(input, _F32), (0, 0))
    return d_input, d_weight, jnp.sum(dlogits, axis=0)


def _output(index: int, value: Any, wanted: bool) -> Any:
    """Output ``index`` of the node: ``value`` rounded to its dtype, or the op's empty placeholder."""
    if not wanted:
        return jnp.zeros(out_shape(index), out_dtype(index))
    return convert(value, out_dtype(index))


# By name: torch defines these ops when torch.nn.modules.linear_cross_entropy is first imported.
@register_library_op("torch_nn._linear_cross_entropy_batch_chunked.default")
def linear_cross_entropy_batch_chunked(
    input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing,
    batch_chunk_size, acc_policy, acc_dtype, allow_retain_graph,
    compute_input_grad, compute_linear_weight_grad, compute_linear_bias_grad,
):  # fmt: skip
    """(loss, grad_input, grad_linear_weight, grad_linear_bias) for reduction mean or sum."""
    if label_smoothing != 0.0 or reduction not in ("mean", "sum"):
        raise Unsupported(f"linear_cross_entropy with reduction={reduction!r}, label_smoothing={label_smoothing}")
    shifted, denom, onehot, row_weight = _loss_terms(input, linear_weight, target, linear_bias, weight, ignore_index)
    total = jnp.sum(_per_row_loss(shifted, denom, onehot, row_weight))
    coef = row_weight
    if reduction == "mean":
        # NaN written explicitly where there is no weight: XLA rewrites a product with a converted
        # boolean (the unweighted row weight) as a select, which would turn 0 * NaN into 0.
        d = jnp.sum(row_weight)
        no_weight = lax.eq(d, _f32(0))
        total = jnp.where(no_weight, _f32(jnp.nan), lax.div(total, d))
        coef = jnp.where(no_weight, _f32(jnp.nan), lax.div(row_weight, d))
    d_input, d_weight, d_bias = _grads(input, linear_weight, shifted, denom, onehot, coef)
    return (
        _output(0, total, True),
        _output(1, d_input, compute_input_grad),
        _output(2, d_weight, compute_linear_weight_grad),
        _output(3, d_bias, compute_linear_bias_grad and linear_bias is not None),
    )


@register_library_op("torch_nn._linear_cross_entropy_batch_chunked_no_reduction.default")
def linear_cross_entropy_batch_chunked_no_reduction(
    input, linear_weight, target, linear_bias, weight, ignore_index, batch_chunk_size, acc_policy, acc_dtype,
):  # fmt: skip
    """Per-sample losses (N,) for reduction="none"."""
    terms = _loss_terms(input, linear_weight, target, linear_bias, weight, ignore_index)
    return convert(_per_row_loss(*terms), out_dtype())
