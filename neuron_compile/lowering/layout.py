"""Channels-last values on the CPU target: convolutions and what follows them without a transpose each time.

XLA CPU runs every convolution with the channels in the last dim (it transposes NCHW operands in and the
result out). A BatchNorm + ReLU block written in torch's NCHW then costs a transposing copy around each
convolution, forward and backward (a third of the small CNN's backward in ``benchmarks/xla_profile.py``).
Here a convolution's result stays channels-last, wrapped as ``ChannelsLast``, and the ops that follow
compute on that array directly while they can: elementwise ops, sums and means, batch norm, and the
convolution backward. Any other op, and every graph output, gets the NCHW value (``materialize``), so the
graph's results are those of the plain lowering, summed in another order at most.

The neuron target never sees this: neuronx-cc chooses its own layouts, and is given torch's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
import torch

from .registry import DispatchRecord, LayoutHandler, register_layout_handler
from .semantics import canonical_dim, is_array

aten = torch.ops.aten

#: Ranks of the values kept channels-last: 2-d and 3-d convolutions (N, C, *spatial).
_RANKS = (4, 5)


@dataclass(frozen=True)
class ChannelsLast:
    """An (N, C, *spatial) value held as its (N, *spatial, C) array."""

    array: Any

    @property
    def ndim(self) -> int:
        return self.array.ndim

    @property
    def logical_shape(self) -> tuple[int, ...]:
        shape = tuple(int(d) for d in self.array.shape)
        return (shape[0], shape[-1], *shape[1:-1])

    def logical(self) -> Any:
        return jnp.moveaxis(self.array, -1, 1)


def channels_last_order(ndim: int) -> tuple[int, ...] | None:
    """The memory order (outermost dim first) of a channels-last rank-``ndim`` tensor, if kept so here."""
    return (0, *range(2, ndim), 1) if ndim in _RANKS else None


def materialize(value: Any) -> Any:
    """``value`` (or a tuple/list/dict of values) with every channels-last value in torch's layout;
    ``value`` itself when it holds none."""
    if isinstance(value, ChannelsLast):
        return value.logical()
    if not has_channels_last(value):
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(materialize(v) for v in value)
    if isinstance(value, dict):
        return {k: materialize(v) for k, v in value.items()}
    return value


def has_channels_last(value: Any) -> bool:
    if isinstance(value, ChannelsLast):
        return True
    if isinstance(value, (tuple, list)):
        return any(has_channels_last(v) for v in value)
    if isinstance(value, dict):
        return any(has_channels_last(v) for v in value.values())
    return False


def physical_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The array shape a channels-last value of torch shape ``shape`` has."""
    return (shape[0], *shape[2:], shape[1])


def _to_channels_last(x: Any) -> Any:
    return x.array if isinstance(x, ChannelsLast) else jnp.moveaxis(x, 1, -1)


def _physical_dim(dim: int, ndim: int) -> int:
    """Where torch's dim ``dim`` of a rank-``ndim`` value is in its channels-last array."""
    return ndim - 1 if dim == 1 else (dim if dim == 0 else dim - 1)


# ---- the ops that take channels-last values -----------------------------------------------------------
#: handler(lowering, args, kwargs): the result (channels-last where it can be), or None to decline (the op
#: then gets every argument in torch's layout).
Handler = LayoutHandler


def handler_for(
    record: DispatchRecord | None, lowering: Callable[..., Any], args: tuple, kwargs: dict
) -> Handler | None:
    """The channels-last handler of a node with these arguments, when it has one and it applies: the op's
    own (``record``), or the generic one of an elementwise lowering."""
    if record is not None and record.layout_handler is not None and (record.layout_source or has_channels_last(args)):
        return record.layout_handler
    if getattr(lowering, "elementwise", False) and has_channels_last(args) and not has_channels_last(kwargs):
        return _elementwise
    return None


def _elementwise(lowering: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """An elementwise op with torch's broadcasting: every array argument brought to the channels-last
    array's rank and layout (a [C, 1, 1] weight becomes [1, 1, 1, C])."""
    ranks = {a.ndim for a in args if isinstance(a, ChannelsLast)}
    if len(ranks) != 1 or any(is_array(v) and v.ndim > 0 for v in kwargs.values()):
        return None  # a tensor passed by keyword would keep torch's layout: not handled here
    rank = ranks.pop()
    moved = []
    for a in args:
        if isinstance(a, ChannelsLast):
            moved.append(a.array)
        elif is_array(a) and a.ndim > 0:
            if a.ndim > rank:
                return None
            moved.append(_to_channels_last(jnp.reshape(a, (1,) * (rank - a.ndim) + tuple(a.shape))))
        else:
            moved.append(a)
    result = lowering(*moved, **kwargs)
    return ChannelsLast(result) if is_array(result) and result.ndim == rank else None


@register_layout_handler(aten.alias.default, aten.clone.default, aten.detach.default, aten.detach_copy.default)
def _same(lowering: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    return args[0]  # values are immutable here: a copy or an alias is the value itself


@register_layout_handler(aten.sum.dim_IntList, aten.mean.dim)
def _reduce(lowering: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    x, dims, *rest = args
    if not isinstance(x, ChannelsLast) or dims is None or len(dims) == 0:
        return None
    keepdim = bool(rest[0]) if rest else bool(kwargs.get("keepdim", False))
    logical = sorted({canonical_dim(d, x.ndim) for d in dims})
    physical = [_physical_dim(d, x.ndim) for d in logical]
    result = lowering(x.array, physical, *rest, **kwargs)
    if keepdim:
        return ChannelsLast(result)
    # The kept dims, in the array's order; put back in torch's order.
    order = [d for d in (0, *range(2, x.ndim), 1) if d not in logical]
    return jnp.transpose(result, tuple(int(i) for i in np.argsort(order))) if order != sorted(order) else result


@register_layout_handler(aten.convolution.default, source=True)
def _convolution(lowering: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    x, transposed = args[0], args[6]
    if x.ndim not in _RANKS or transposed or kwargs:
        return None
    # The weight (and bias) in torch's layout, even when it came in channels-last.
    return ChannelsLast(lowering(_to_channels_last(x), *materialize(args[1:]), channels_last=True))


@register_layout_handler(aten.convolution_backward.default)
def _convolution_backward(lowering: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    grad_out, x, *rest = args
    if grad_out.ndim not in _RANKS or kwargs:
        return None
    grad_input, grad_weight, grad_bias = lowering(
        _to_channels_last(grad_out), _to_channels_last(x), *materialize(rest), channels_last=True
    )
    return (None if grad_input is None else ChannelsLast(grad_input)), grad_weight, grad_bias


@register_layout_handler(
    aten._native_batch_norm_legit_functional.default,
    aten._native_batch_norm_legit_no_training.default,
    aten._native_batch_norm_legit.no_stats,
    aten._native_batch_norm_legit.default,
    aten.native_batch_norm.default,
)
def _batch_norm(lowering: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    x, *rest = args
    if not isinstance(x, ChannelsLast) or kwargs or has_channels_last(rest):
        return None
    out, *stats = lowering(x.array, *rest, channels_last=True)
    return (ChannelsLast(out), *stats)
