"""Torch semantics shared by all lowerings, handled once: dtypes, type promotion, broadcasting.

Device policy (as on Trainium): float64 is computed as float32; int64 stays exact (the graph is traced
with jax x64 enabled); complex, quantized and float8 variants the device lacks are refused.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, canonicalize_dim, elementwise_dtypes

from ..dtypes import DEVICE_DTYPES
from .registry import Unsupported, current, register_lowering

Promotion = ELEMENTWISE_TYPE_PROMOTION_KIND

_TORCH_TO_JAX: dict[torch.dtype, Any] = {
    torch.float32: jnp.float32,
    torch.float64: jnp.float32,  # computed as float32, as on the device
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.int8: jnp.int8,
    torch.uint8: jnp.uint8,
    torch.int16: jnp.int16,
    torch.int32: jnp.int32,
    torch.int64: jnp.int64,
    torch.bool: jnp.bool_,
    torch.uint16: jnp.uint16,
    torch.uint32: jnp.uint32,
    torch.float8_e4m3fn: jnp.float8_e4m3fn,
    torch.float8_e5m2: jnp.float8_e5m2,
}
assert set(_TORCH_TO_JAX) == DEVICE_DTYPES, "dtypes.DEVICE_DTYPES and this table must list the same dtypes"
_JAX_TO_TORCH: dict[Any, torch.dtype] = {np.dtype(v): k for k, v in _TORCH_TO_JAX.items() if k is not torch.float64}


def jax_dtype(dtype: torch.dtype) -> Any:
    """The jax dtype that computes torch ``dtype`` on the device (float64 -> float32)."""
    try:
        return _TORCH_TO_JAX[dtype]
    except KeyError:
        raise Unsupported(f"dtype {dtype} is not supported by the Neuron compiler") from None


def torch_dtype(dtype: Any) -> torch.dtype:
    return _JAX_TO_TORCH[np.dtype(dtype)]


def out_dtype(index: int | None = None) -> Any:
    """The jax dtype of the current node's output (or of output ``index`` for multi-output nodes)."""
    out = current().out
    if index is not None:
        out = out[index]
    return jax_dtype(out.dtype)


def out_shape(index: int | None = None) -> tuple[int, ...]:
    out = current().out
    if index is not None:
        out = out[index]
    return tuple(int(s) for s in out.shape)


def is_array(x: Any) -> bool:
    return hasattr(x, "dtype") and hasattr(x, "shape") and not isinstance(x, (np.generic,))


def _torch_like(x: Any) -> Any:
    """A tiny torch tensor with the dtype and rank of ``x`` (promotion depends on both), or the scalar."""
    if is_array(x):
        return torch.empty((1,) * x.ndim, dtype=torch_dtype(x.dtype))
    return x


def promote_types(args: Sequence[Any], kind: Promotion) -> tuple[Any, Any]:
    """(computation dtype, result dtype) of torch's elementwise promotion, as jax dtypes."""
    likes = [_torch_like(a) for a in args if a is not None]
    compute, result = elementwise_dtypes(*likes, type_promotion_kind=kind)
    return jax_dtype(compute), jax_dtype(result)


def convert(x: Any, dtype: Any) -> Any:
    """``x`` (array or Python scalar) as an array of ``dtype``. A Python int wraps into an integer dtype's range
    as torch's casts do (``uint8`` of -1 is 255), where ``jnp.asarray`` raises."""
    if is_array(x):
        return x if x.dtype == dtype else lax.convert_element_type(x, dtype)
    if isinstance(x, int) and not isinstance(x, bool) and jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(np.asarray(x, np.int64).astype(np.dtype(dtype)))
    return jnp.asarray(x, dtype=dtype)


def broadcast(*xs: Any) -> list[Any]:
    """Broadcast arrays to their common shape with torch/numpy rules (scalars stay scalars)."""
    shapes = [x.shape for x in xs if is_array(x)]
    shape = tuple(np.broadcast_shapes(*shapes)) if shapes else ()
    out = []
    for x in xs:
        if is_array(x) and tuple(x.shape) != shape:
            dims = tuple(range(len(shape) - x.ndim, len(shape)))
            x = lax.broadcast_in_dim(x, shape, dims)
        out.append(x)
    return out


def is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def is_integer(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.integer)


def opmath_dtype(dtype: Any) -> Any:
    """The dtype eager computes ``dtype`` in (ATen's ``at::opmath_type``): float32 for bfloat16 and
    float16, ``dtype`` itself otherwise.

    The one opmath rule of every lowering: convert 16-bit float inputs to this dtype, compute, and
    round to the result dtype once at the end (``in_opmath``), as eager's CPU kernels and Inductor's
    ``pw_cast_for_opmath`` do. Rounding an intermediate to bfloat16 instead drifts by an ulp, which a
    truncation or a softmax turns into a visibly wrong value.
    """
    return jnp.float32 if is_float(dtype) and jnp.dtype(dtype).itemsize < 4 else dtype


def in_opmath(fn: Callable[..., Any], *xs: Any, result: Any = None) -> Any:
    """``fn(*xs)`` computed in the opmath dtype of ``result`` (default: the first array's dtype) and
    rounded once to ``result``. Non-array arguments (Python scalars, None) are passed unchanged."""
    if result is None:
        result = next(x.dtype for x in xs if is_array(x))
    compute = opmath_dtype(result)
    return convert(fn(*(convert(x, compute) if is_array(x) else x for x in xs)), result)


def pointwise(
    fn: Callable[..., Any],
    promotion: Promotion = Promotion.DEFAULT,
    compute_in_result: bool = False,
) -> Callable[..., Any]:
    """The lowering of an elementwise op from ``fn``, a body written for same-dtype, same-shape jax arrays.

    Arguments are promoted with torch's rules (``promotion``), converted to the computation dtype
    (float32 for bfloat16/float16 inputs, as eager's opmath does), broadcast, and the result is
    converted to the result dtype. Keyword arguments are passed through unchanged. Use it directly for
    ops whose promotion depends on an argument (``div`` with a rounding mode); else ``register_pointwise``.
    """

    def lower(*args: Any, **kwargs: Any) -> Any:
        compute, result = promote_types(args, promotion)
        if compute_in_result:
            compute = result
        arrays = broadcast(*[convert(a, compute) if a is not None else None for a in args])
        return convert(fn(*arrays, **kwargs), result)

    return elementwise(lower)


def elementwise(lowering: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``lowering`` as elementwise with torch's broadcasting and nothing else shape-dependent: it
    computes the same on its arguments' dims in any order (lowering/layout.py relies on that)."""
    lowering.elementwise = True
    return lowering


def register_pointwise(
    *ops: Any,
    promotion: Promotion = Promotion.DEFAULT,
    compute_in_result: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register an elementwise lowering written for same-dtype, same-shape jax arrays (see ``pointwise``)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        # Registered under fn's own name and module, so the registry says where the lowering is.
        register_lowering(*ops)(functools.wraps(fn)(pointwise(fn, promotion, compute_in_result)))
        return fn

    return decorate


def canonical_dim(dim: int, ndim: int) -> int:
    """``dim`` of a rank-``ndim`` tensor as a non-negative axis, with torch's rules (negative dims count
    from the end; a 0-d tensor takes dim 0 or -1 as axis 0). Raises IndexError when out of range."""
    return canonicalize_dim(ndim, dim)
