"""Quantized compute: int8 and float8 matmuls with their scales, and fake quantization (QAT).

The matmuls run on the floating-point datapath, as neuronx-cc has no integer one: an int8 or uint8 value is
exact in bfloat16 and a product of two is exact in float32, so a float32-accumulated dot of 8-bit operands
is exact while its partial sums stay below 2**24 in magnitude, which 1,024 products of int8 values always
do (512 with a uint8 operand); ``_int_mm`` sums such chunks of its inner dim in int32. ``_scaled_mm`` and
``_weight_int8pack_mm`` compute as eager's CPU kernels do: scaled float32 operands (the float8 values are
exact in float32), one rounding to the output dtype. Fake quantization follows eager's kernels (multiply
by the float32 reciprocal of the scale, round half to even, clamp; the mask marks values inside the range,
which is all the backward needs).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import torch
from jax import lax

from .registry import Unsupported, register_lowering
from .semantics import convert, is_float, opmath_dtype
from .semantics import out_dtype as node_dtype  # `out_dtype` is also _scaled_mm's argument

aten = torch.ops.aten
_F32 = jnp.float32


def exact_terms(a_dtype: Any, b_dtype: Any) -> int:
    """How many products of two 8-bit integers of these types a float32 sum holds exactly: the largest power
    of two n with n * max|a| * max|b| <= 2**24 (1,024 for int8 x int8: 1,024 * 128 * 128 = 2**24)."""
    largest = [max(-int(jnp.iinfo(d).min), int(jnp.iinfo(d).max)) for d in (a_dtype, b_dtype)]
    return 1 << ((2**24 // (largest[0] * largest[1])).bit_length() - 1)


_Batch = tuple[tuple[int, ...], tuple[int, ...]]


def _dot_f32(a: Any, b: Any, contract: tuple[int, int], batch: _Batch = ((), ())) -> Any:
    return lax.dot_general(
        a, b, (((contract[0],), (contract[1],)), batch), precision=lax.Precision.HIGHEST, preferred_element_type=_F32
    )


@register_lowering(aten._int_mm)
def int_mm(a, b):
    """[u]int8 [m, k] @ int8 [k, n] -> int32, exact: bfloat16 dots over chunks of k, chunks summed in int32."""
    (m, k), n = a.shape, b.shape[1]
    terms = exact_terms(a.dtype, b.dtype)
    chunks = -(-k // terms)
    a16, b16 = convert(a, jnp.bfloat16), convert(b, jnp.bfloat16)
    if chunks == 1:
        return convert(_dot_f32(a16, b16, (1, 0)), jnp.int32)
    pad = chunks * terms - k
    a16 = jnp.pad(a16, ((0, 0), (0, pad))).reshape(m, chunks, terms).transpose(1, 0, 2)
    b16 = jnp.pad(b16, ((0, pad), (0, 0))).reshape(chunks, terms, n)
    partial = _dot_f32(a16, b16, (2, 1), ((0,), (0,)))  # [chunks, m, n], each exact
    return jnp.sum(convert(partial, jnp.int32), axis=0, dtype=jnp.int32)


@register_lowering(aten._weight_int8pack_mm)
def weight_int8pack_mm(x, q, scales):
    """``x @ q.T * scales`` (int8 weights [n, k], one scale per output channel), accumulated in float32."""
    operand = x.dtype if jnp.dtype(x.dtype).itemsize == 2 else _F32  # int8 is exact in bf16/f16
    product = _dot_f32(convert(x, operand), convert(q, operand), (1, 1))
    return convert(product * convert(scales, _F32)[None, :], x.dtype)


_FLOAT8 = frozenset({"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"})


@register_lowering(aten._scaled_mm)
def scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """eager's CPU ``_scaled_mm``: ``(a * scale_a) @ (b * scale_b) + bias`` in float32 (per-tensor or
    row/column-wise scales), divided by ``scale_result`` only for a float8 output, rounded once."""
    result = node_dtype()
    out = _dot_f32(convert(a, _F32) * convert(scale_a, _F32), convert(b, _F32) * convert(scale_b, _F32), (1, 0))
    if bias is not None:
        out = out + convert(bias, _F32)
    if scale_result is not None and jnp.dtype(result).name in _FLOAT8:
        out = out * (jnp.asarray(1.0, _F32) / convert(scale_result, _F32))
    return convert(out, result)


def _fake_quantize(x: Any, scale: Any, zero_point: Any, quant_min: int, quant_max: int) -> tuple[Any, Any]:
    if not is_float(x.dtype):
        raise Unsupported(f"fake quantization of {x.dtype}: eager takes floating-point inputs only")
    acc = opmath_dtype(x.dtype)
    scale = convert(scale, _F32)
    inv_scale = jnp.asarray(1.0, _F32) / scale
    q = convert(zero_point, _F32) + jnp.round(convert(x, _F32) * inv_scale)  # round half to even: nearbyint
    lo, hi = jnp.asarray(quant_min, _F32), jnp.asarray(quant_max, _F32)
    mask = lax.bitwise_and(lax.ge(q, lo), lax.le(q, hi))
    out = (jnp.clip(q, lo, hi) - convert(zero_point, _F32)) * scale
    return convert(convert(out, acc), x.dtype), mask


@register_lowering(aten.fake_quantize_per_tensor_affine_cachemask)
def fake_quantize_per_tensor_cachemask(x, scale, zero_point, quant_min, quant_max):
    return _fake_quantize(x, jnp.asarray(scale, _F32), jnp.asarray(zero_point, _F32), quant_min, quant_max)


@register_lowering(aten.fake_quantize_per_channel_affine_cachemask)
def fake_quantize_per_channel_cachemask(x, scale, zero_point, axis, quant_min, quant_max):
    if is_float(zero_point.dtype):
        raise Unsupported("per-channel fake quantization with floating-point zero points (eager's learnable-"
                          "quantization path, rounded differently): use integer zero points")  # fmt: skip
    shape = _channel_shape(x, axis)
    return _fake_quantize(x, scale.reshape(shape), zero_point.reshape(shape), quant_min, quant_max)


# Learnable fake quantization (LSQ: torch.ao's _LearnableFakeQuantize): the scale and zero point are float
# tensors with gradients. Eager rounds the zero point half to even for the forward (and per channel for the
# backward too), but truncates ``zero_point + 0.5`` for the per-tensor backward: each as eager.


def _rounded_zero_point(zero_point: Any, quant_min: int, quant_max: int) -> Any:
    return jnp.clip(jnp.round(convert(zero_point, _F32)), quant_min, quant_max)


@register_lowering(aten._fake_quantize_learnable_per_tensor_affine)
def fake_quantize_learnable_per_tensor(x, scale, zero_point, quant_min, quant_max, grad_factor=1.0):
    zp = _rounded_zero_point(zero_point.reshape(()), quant_min, quant_max)
    return _fake_quantize(x, convert(scale.reshape(()), _F32), zp, quant_min, quant_max)[0]


@register_lowering(aten._fake_quantize_learnable_per_channel_affine)
def fake_quantize_learnable_per_channel(x, scale, zero_point, axis, quant_min, quant_max, grad_factor=1.0):
    shape = _channel_shape(x, axis)
    zp = _rounded_zero_point(zero_point.reshape(shape), quant_min, quant_max)
    return _fake_quantize(x, convert(scale.reshape(shape), _F32), zp, quant_min, quant_max)[0]


def _channel_shape(x: Any, axis: int) -> list[int]:
    shape = [1] * x.ndim
    shape[axis % x.ndim] = x.shape[axis % x.ndim]
    return shape


def _learnable_grads(grad: Any, x: Any, scale: Any, zp: Any, quant_min: int, quant_max: int,
                     grad_factor: float) -> tuple[Any, Any, Any]:  # fmt: skip
    """Per element: d/dx (the straight-through mask), d/dscale and d/dzero_point of the fake-quantized
    value times ``grad`` (eager's kernel: ``q = round(zp + x / scale)``; outside [quant_min, quant_max] the
    clamped bound's derivatives, inside ``(x_fq - x) / scale`` for the scale and 0 for the zero point)."""
    g, xf = convert(grad, _F32), convert(x, _F32)
    inv_scale = jnp.asarray(1.0, _F32) / scale
    q = jnp.round(zp + xf * inv_scale)
    inside = (q >= quant_min) & (q <= quant_max)
    factor = jnp.asarray(grad_factor, _F32)
    fake_quantized = (jnp.clip(q, quant_min, quant_max) - zp) * scale
    bound = jnp.where(q < quant_min, jnp.asarray(quant_min, _F32), jnp.asarray(quant_max, _F32))
    d_scale = jnp.where(inside, g * (fake_quantized - xf) * inv_scale, g * (bound - zp)) * factor
    d_zero_point = jnp.where(inside, jnp.zeros_like(g), -g * scale * factor)
    return jnp.where(inside, g, jnp.zeros_like(g)), d_scale, d_zero_point


@register_lowering(aten._fake_quantize_learnable_per_tensor_affine_backward)
def fake_quantize_learnable_per_tensor_backward(grad, x, scale, zero_point, quant_min, quant_max, grad_factor=1.0):
    zp = jnp.trunc(jnp.clip(convert(zero_point.reshape(()), _F32) + 0.5, quant_min, quant_max))
    dx, d_scale, d_zero_point = _learnable_grads(grad, x, convert(scale.reshape(()), _F32), zp, quant_min,
                                                 quant_max, grad_factor)  # fmt: skip
    return (convert(dx, node_dtype(0)), convert(jnp.sum(d_scale).reshape(1), node_dtype(1)),
            convert(jnp.sum(d_zero_point).reshape(1), node_dtype(2)))  # fmt: skip


@register_lowering(aten._fake_quantize_learnable_per_channel_affine_backward)
def fake_quantize_learnable_per_channel_backward(grad, x, scale, zero_point, axis, quant_min, quant_max,
                                                 grad_factor=1.0):  # fmt: skip
    shape = _channel_shape(x, axis)
    zp = _rounded_zero_point(zero_point.reshape(shape), quant_min, quant_max)
    dx, d_scale, d_zero_point = _learnable_grads(grad, x, convert(scale.reshape(shape), _F32), zp, quant_min,
                                                 quant_max, grad_factor)  # fmt: skip
    others = tuple(d for d in range(x.ndim) if d != axis % x.ndim)
    return (convert(dx, node_dtype(0)), convert(jnp.sum(d_scale, axis=others), node_dtype(1)),
            convert(jnp.sum(d_zero_point, axis=others), node_dtype(2)))  # fmt: skip
