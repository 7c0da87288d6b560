"""aten.convolution (1d/2d/3d, strided, padded, dilated, grouped, transposed) and its backward.

Both directions are built on ``lax.conv_general_dilated`` (a transposed convolution is a plain one over
the stride-dilated input with the kernel flipped and its in/out channels swapped per group). The input
gradient of a plain convolution is the transposed convolution with the same weight, and vice versa;
the weight gradient is the exact vjp of the forward. Every convolution emitted stays inside what
neuronx-cc takes: never input dilation together with a stride or a kernel dilation (where a transposed
convolution has both a stride and a dilation, the input is dilated by an explicit interior pad).
On the CPU target only, a forward convolution with very few channels is computed as patches times
weight (``_conv_as_patches``): XLA CPU runs such a convolution in its slow generic kernel.
bfloat16/float16 accumulate in float32 and the bias is added before the one final rounding, as eager
CPU does; float32 runs at full float32 precision.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import torch
from jax import lax

from .device_calls import current_target
from .registry import Unsupported, register_lowering
from .semantics import convert, is_float, opmath_dtype, out_dtype

aten = torch.ops.aten

_SPATIAL = "DHW"


def _dimension_numbers(ndim: int, channels_last: bool = False) -> tuple[str, str, str]:
    spatial = _SPATIAL[-(ndim - 2) :] if ndim > 2 else ""
    data = "N" + spatial + "C" if channels_last else "NC" + spatial
    return (data, "OI" + spatial, data)


def _acc(dtype: Any) -> Any:
    if jnp.dtype(dtype) == jnp.bool_:
        raise Unsupported("convolution of dtype bool (eager has no bool kernel either)")
    # Integers accumulate in their own dtype, wrapping as eager's integer kernels do.
    return opmath_dtype(dtype) if is_float(dtype) else jnp.dtype(dtype)


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
    patches: bool = True,
    channels_last: bool = False,
) -> Any:
    """The convolution without bias, in the accumulation dtype (float32 for 16-bit inputs).

    ``patches=False`` keeps a convolution a convolution on every target (its vjp, the weight gradient,
    is slower through patches). ``channels_last``: ``x`` and the result hold their channels in the last
    dim (lowering/layout.py); the weight is torch's either way.
    """
    if x.ndim != w.ndim or x.ndim < 3:
        raise Unsupported(f"convolution of a {x.ndim}-d input with a {w.ndim}-d weight (batched input expected)")
    n_spatial = x.ndim - 2
    stride, padding, dilation = (_per_dim(v, n_spatial) for v in (stride, padding, dilation))
    acc = _acc(x.dtype)
    precision = lax.Precision.HIGHEST
    if not transposed:
        if patches and _patches_are_faster(x, w, groups):
            if channels_last:
                return jnp.moveaxis(_conv_as_patches(jnp.moveaxis(x, -1, 1), w, stride, padding, dilation, acc), 1, -1)
            return _conv_as_patches(x, w, stride, padding, dilation, acc)
        return lax.conv_general_dilated(
            x,
            w,
            window_strides=stride,
            padding=[(p, p) for p in padding],
            rhs_dilation=dilation,
            dimension_numbers=_dimension_numbers(x.ndim, channels_last),
            feature_group_count=groups,
            precision=precision,
            preferred_element_type=acc,
        )
    output_padding = _per_dim(output_padding, n_spatial)
    k = w.shape[2:]
    pads = [(d * (kk - 1) - p, d * (kk - 1) - p + op) for kk, p, d, op in zip(k, padding, dilation, output_padding)]
    lhs_dilation = stride
    if any(s > 1 for s in stride) and any(d > 1 for d in dilation):
        spatial_pads = [(lo, hi, s - 1) for (lo, hi), s in zip(pads, stride)]
        all_pads = [(0, 0, 0), *spatial_pads, (0, 0, 0)] if channels_last else [(0, 0, 0)] * 2 + spatial_pads
        x = lax.pad(x, jnp.zeros((), x.dtype), all_pads)
        pads, lhs_dilation = [(0, 0)] * n_spatial, (1,) * n_spatial
    return lax.conv_general_dilated(
        x,
        _transposed_kernel(w, groups),
        window_strides=(1,) * n_spatial,
        padding=pads,
        lhs_dilation=lhs_dilation,
        rhs_dilation=dilation,
        dimension_numbers=_dimension_numbers(x.ndim, channels_last),
        feature_group_count=groups,
        precision=precision,
        preferred_element_type=acc,
    )


def _patches_are_faster(x: Any, w: Any, groups: int) -> bool:
    """XLA CPU hands a convolution with at most 16 input and output channels to Eigen's generic kernel
    (its YNNPACK path takes larger ones), which is 3-6x slower than a dot over the patches when each
    patch is small (measured single-threaded: 3 -> 16 channels 3x3 over 16x32x32, 1.8 ms -> 0.4 ms;
    torch 0.34 ms); with 16 input channels (a 144-element patch) the convolution is faster again.
    Trainium's compiler is given the convolution itself.
    """
    c_out, c_in, *kernel = w.shape
    size = math.prod(kernel)
    return current_target() == "cpu" and groups == 1 and size > 1 and max(c_in, c_out) <= 16 and c_in * size <= 64


def _conv_as_patches(x: Any, w: Any, stride, padding, dilation, acc: Any) -> Any:
    """The convolution as one dot: each output position's input patch against the flattened weight. Same
    products and float32 accumulation as the convolution; only the summation order differs.

    The patches are laid out [kernel offset, channel] x [batch, positions], so the dot is a plain
    [c_out, k] x [k, n] product and the concatenated taps need no further transpose.
    """
    n, c_in = x.shape[:2]
    kernel = w.shape[2:]
    out_size = [
        (size + 2 * p - d * (k - 1) - 1) // s + 1
        for size, k, s, p, d in zip(x.shape[2:], kernel, stride, padding, dilation)
    ]
    xp = lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0)] * 2 + [(p, p, 0) for p in padding])
    channels_first = jnp.swapaxes(xp, 0, 1)  # (c_in, n, *padded)
    taps = []
    for offset in itertools.product(*(range(k) for k in kernel)):
        start = [o * d for o, d in zip(offset, dilation)]
        limit = [b + (o - 1) * s + 1 if o > 0 else b for b, o, s in zip(start, out_size, stride)]
        taps.append(lax.slice(channels_first, (0, 0, *start), (c_in, n, *limit), (1, 1, *stride)))
    patches = jnp.reshape(lax.concatenate(taps, 0), (len(taps) * c_in, n * math.prod(out_size)))
    # (c_out, *kernel, c_in): the same (kernel offset, channel) order as the patches' rows
    flat_w = jnp.reshape(jnp.moveaxis(w, 1, -1), (w.shape[0], -1))
    out = lax.dot_general(
        flat_w,
        patches,
        (((1,), (0,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=acc,
    )
    return jnp.swapaxes(jnp.reshape(out, (w.shape[0], n, *out_size)), 0, 1)


def _per_dim(values: Sequence[int], n: int) -> tuple[int, ...]:
    values = tuple(values)
    return values * n if len(values) == 1 else values


def _channel_vector(v: Any, ndim: int, channels_last: bool = False) -> Any:
    if channels_last:
        return jnp.reshape(v, (1,) * (ndim - 1) + (v.shape[0],))
    return jnp.reshape(v, (1, v.shape[0]) + (1,) * (ndim - 2))


@register_lowering(aten.convolution)
def convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups, *, channels_last=False):
    out = conv_core(
        x, weight, stride, padding, dilation, transposed, output_padding, groups, channels_last=channels_last
    )
    if bias is not None:
        bias = convert(bias, out.dtype)
        out = lax.add(out, _channel_vector(bias, out.ndim, channels_last))
    return convert(out, out_dtype())


@register_lowering(aten.convolution_backward)
def convolution_backward(
    grad_out,
    x,
    weight,
    bias_sizes,
    stride,
    padding,
    dilation,
    transposed,
    output_padding,
    groups,
    output_mask,
    *,
    channels_last=False,
):
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        if transposed:
            # The adjoint of a transposed convolution is the plain one with the same parameters. Its output is
            # the input's size when output_padding < stride; torch also allows output_padding < dilation, and
            # then the plain convolution reaches positions past the input's end, which are cut off.
            grad = conv_core(
                grad_out, weight, stride, padding, dilation, False, (0,), groups, channels_last=channels_last
            )
            grad = lax.slice(grad, (0,) * grad.ndim, tuple(min(g, i) for g, i in zip(grad.shape, x.shape)))
        else:
            grad = conv_core(
                grad_out,
                weight,
                stride,
                padding,
                dilation,
                True,
                _output_padding(x, weight, grad_out, stride, padding, dilation, channels_last),
                groups,
                channels_last=channels_last,
            )
        grad_input = convert(grad, out_dtype(0))
    if output_mask[1]:
        params = (stride, padding, dilation, transposed, output_padding, groups)
        _, vjp = jax.vjp(lambda w: conv_core(x, w, *params, patches=False, channels_last=channels_last), weight)
        grad_weight = convert(vjp(convert(grad_out, _acc(x.dtype)))[0], out_dtype(1))
    if output_mask[2]:
        channel = grad_out.ndim - 1 if channels_last else 1
        axes = tuple(d for d in range(grad_out.ndim) if d != channel)
        grad_bias = convert(jnp.sum(convert(grad_out, _acc(x.dtype)), axis=axes), out_dtype(2))
    return grad_input, grad_weight, grad_bias


def _output_padding(x, weight, grad_out, stride, padding, dilation, channels_last=False) -> tuple[int, ...]:
    """The output_padding that makes the transposed convolution of ``grad_out`` as large as ``x``:
    the input positions a strided convolution never reached get a zero gradient."""
    n = x.ndim - 2
    stride, padding, dilation = (_per_dim(v, n) for v in (stride, padding, dilation))
    spatial = slice(1, -1) if channels_last else slice(2, None)
    return tuple(
        xs - ((ys - 1) * s - 2 * p + d * (k - 1) + 1)
        for xs, ys, k, s, p, d in zip(
            x.shape[spatial], grad_out.shape[spatial], weight.shape[2:], stride, padding, dilation
        )
    )
