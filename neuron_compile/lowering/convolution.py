"""aten.convolution (1d/2d/3d, strided, padded, dilated, grouped, transposed) and its backward.

Both directions are built on ``lax.conv_general_dilated`` (a transposed convolution is a plain one over
the stride-dilated input with the kernel flipped and its in/out channels swapped per group). The input
gradient of a plain convolution is the transposed convolution with the same weight, and vice versa;
the weight gradient is the exact vjp of the forward. Every convolution emitted stays inside what
neuronx-cc takes: never input dilation together with a stride or a kernel dilation (where a transposed
convolution has both a stride and a dilation, the input is dilated by an explicit interior pad).
bfloat16/float16 accumulate in float32 and the bias is added before the one final rounding, as eager
CPU does; float32 runs at full float32 precision.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import torch
from jax import lax

from .registry import Unsupported, register_lowering
from .semantics import convert, is_float, opmath_dtype, out_dtype

aten = torch.ops.aten

_SPATIAL = "DHW"


def _dimension_numbers(ndim: int) -> tuple[str, str, str]:
    spatial = _SPATIAL[-(ndim - 2) :] if ndim > 2 else ""
    return ("NC" + spatial, "OI" + spatial, "NC" + spatial)


def _acc(dtype: Any) -> Any:
    if not is_float(dtype):
        raise Unsupported(f"convolution of dtype {jnp.dtype(dtype)} (eager supports floating point only)")
    return opmath_dtype(dtype)


def _transposed_kernel(w: Any, groups: int) -> Any:
    """(Cin, Cout/g, *k) weight of a transposed conv -> the (Cout, Cin/g, *k) flipped kernel of the
    equivalent plain conv."""
    c_in, c_out_g, *k = w.shape
    w = jnp.reshape(w, (groups, c_in // groups, c_out_g, *k))
    w = jnp.swapaxes(w, 1, 2)
    w = jnp.reshape(w, (groups * c_out_g, c_in // groups, *k))
    return lax.rev(w, tuple(range(2, w.ndim)))


def conv_core(
    x: Any,
    w: Any,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
) -> Any:
    """The convolution without bias, in the accumulation dtype (float32 for 16-bit inputs)."""
    if x.ndim != w.ndim or x.ndim < 3:
        raise Unsupported(f"convolution of a {x.ndim}-d input with a {w.ndim}-d weight (batched input expected)")
    n_spatial = x.ndim - 2
    stride, padding, dilation = (_per_dim(v, n_spatial) for v in (stride, padding, dilation))
    acc = _acc(x.dtype)
    precision = lax.Precision.HIGHEST
    if not transposed:
        return lax.conv_general_dilated(
            x,
            w,
            window_strides=stride,
            padding=[(p, p) for p in padding],
            rhs_dilation=dilation,
            dimension_numbers=_dimension_numbers(x.ndim),
            feature_group_count=groups,
            precision=precision,
            preferred_element_type=acc,
        )
    output_padding = _per_dim(output_padding, n_spatial)
    k = w.shape[2:]
    pads = [(d * (kk - 1) - p, d * (kk - 1) - p + op) for kk, p, d, op in zip(k, padding, dilation, output_padding)]
    lhs_dilation = stride
    if any(s > 1 for s in stride) and any(d > 1 for d in dilation):
        x = lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0)] * 2 + [(lo, hi, s - 1) for (lo, hi), s in zip(pads, stride)])
        pads, lhs_dilation = [(0, 0)] * n_spatial, (1,) * n_spatial
    return lax.conv_general_dilated(
        x,
        _transposed_kernel(w, groups),
        window_strides=(1,) * n_spatial,
        padding=pads,
        lhs_dilation=lhs_dilation,
        rhs_dilation=dilation,
        dimension_numbers=_dimension_numbers(x.ndim),
        feature_group_count=groups,
        precision=precision,
        preferred_element_type=acc,
    )


def _per_dim(values: Sequence[int], n: int) -> tuple[int, ...]:
    values = tuple(values)
    return values * n if len(values) == 1 else values


def _channel_vector(v: Any, ndim: int) -> Any:
    return jnp.reshape(v, (1, v.shape[0]) + (1,) * (ndim - 2))


@register_lowering(aten.convolution)
def convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    out = conv_core(x, weight, stride, padding, dilation, transposed, output_padding, groups)
    if bias is not None:
        out = lax.add(out, _channel_vector(convert(bias, out.dtype), out.ndim))
    return convert(out, out_dtype())


@register_lowering(aten.convolution_backward)
def convolution_backward(
    grad_out, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask
):
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        if transposed:
            # The adjoint of a transposed convolution is the plain one with the same parameters; its
            # output size is exactly the input's, since output_padding < stride.
            grad = conv_core(grad_out, weight, stride, padding, dilation, False, (0,), groups)
        else:
            grad = conv_core(
                grad_out,
                weight,
                stride,
                padding,
                dilation,
                True,
                _output_padding(x, weight, grad_out, stride, padding, dilation),
                groups,
            )
        grad_input = convert(grad, out_dtype(0))
    if output_mask[1]:
        params = (stride, padding, dilation, transposed, output_padding, groups)
        _, vjp = jax.vjp(lambda w: conv_core(x, w, *params), weight)
        grad_weight = convert(vjp(convert(grad_out, _acc(x.dtype)))[0], out_dtype(1))
    if output_mask[2]:
        axes = (0,) + tuple(range(2, grad_out.ndim))
        grad_bias = convert(jnp.sum(convert(grad_out, _acc(x.dtype)), axis=axes), out_dtype(2))
    return grad_input, grad_weight, grad_bias


def _output_padding(x, weight, grad_out, stride, padding, dilation) -> tuple[int, ...]:
    """The output_padding that makes the transposed convolution of ``grad_out`` as large as ``x``:
    the input positions a strided convolution never reached get a zero gradient."""
    n = x.ndim - 2
    stride, padding, dilation = (_per_dim(v, n) for v in (stride, padding, dilation))
    return tuple(
        xs - ((ys - 1) * s - 2 * p + d * (k - 1) + 1)
        for xs, ys, k, s, p, d in zip(x.shape[2:], grad_out.shape[2:], weight.shape[2:], stride, padding, dilation)
    )
