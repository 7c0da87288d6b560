"""How one FX node is lowered: ``resolve(node)`` reads the node's dispatch record (registry.py) with one
fixed precedence, the way jax picks a primitive's lowering rule per platform, and returns ONE callable that
applies it (``Dispatch.__call__``); the interpreter calls it with the node's arguments.

1. A node with a complex input or output: the record's lowering on (real, imag) pairs, or refused
   (Trainium has no complex dtype; complex_pairs.py).
2. Otherwise the real-dtype lowering: the record's, a collective's or a library op's (registry.lowering_for),
   a user ``nki_op`` kernel, or a user kernel that writes its arguments (``auto_functionalized``); else
   refused, with the record's reason when it has one.
3. On top of a lowering: the record's NKI kernel route (``kernels`` != "off"), tried first at run time (it
   declines a node its kernel does not fit, returning None), and on the CPU target the channels-last handler,
   which depends on the arguments' layouts (``Dispatch.layout_handler``) and declines the same way. A node
   with a route gets torch's layout (channels-last arguments materialized) whether or not the route takes it:
   its handler is not tried. Whatever declines leaves the node to its lowering.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._ops import OpOverload

from ..graph_checks import non_aten_reason
from . import layout
from .complex_pairs import REFUSAL as COMPLEX_REFUSAL
from .complex_pairs import is_complex_node, on_plain_arrays
from .kernel_routing import lower_auto_functionalized, user_kernel_lowering
from .registry import DispatchRecord, LoweringFn, lowering_for, record_of

#: Higher-order ops a user kernel that writes its arguments in place becomes under AOTAutograd.
AUTO_FUNCTIONALIZED = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)


@dataclass(frozen=True)
class Dispatch:
    """What lowers one node: ``lowering``, or (when it is None) the ``refusal`` the user's error gives."""

    lowering: LoweringFn | None
    refusal: str | None = None
    #: The NKI kernel site tried before ``lowering``.
    route: LoweringFn | None = None
    record: DispatchRecord | None = None
    #: Lowered on (real, imag) pairs.
    on_pairs: bool = False
    #: The target the module is lowered for ("cpu": channels-last handlers apply).
    target: str = "cpu"

    def layout_handler(self, args: tuple, kwargs: dict) -> layout.Handler | None:
        """The channels-last handler for these arguments (CPU target, real dtypes), or None."""
        if self.target != "cpu" or self.on_pairs or self.lowering is None:
            return None
        return layout.handler_for(self.record, self.lowering, args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The node's value, by the precedence of the module docstring: the NKI route, else the channels-last
        handler, else the lowering. Arguments may be channels-last (``layout.ChannelsLast``); the lowering gets
        them in torch's layout unless the handler takes them."""
        return self.bind(args, kwargs)()

    def bind(self, args: tuple, kwargs: dict) -> Callable[[], Any]:
        """``__call__`` in two parts: the arguments a node with no handler for them needs in torch's layout are
        materialized now (the interpreter does it outside the node's scope: those transposes belong to the value's
        producer), the rest runs when the returned function is called."""
        lowering, route = self.lowering, self.route
        if lowering is None:
            raise AssertionError(f"a refused node has no lowering to call: {self.refusal}")
        handler = self.layout_handler(args, kwargs)
        if handler is None or route is not None:
            args, kwargs, handler = layout.materialize(args), layout.materialize(kwargs), None

        def value() -> Any:
            nonlocal args, kwargs
            result = route(*args, **kwargs) if route is not None else None
            if handler is not None:  # channels-last arguments or result (layout.py)
                result = handler(lowering, args, kwargs)
                if result is None:
                    args, kwargs = layout.materialize(args), layout.materialize(kwargs)
            if result is None:  # not routed to an NKI kernel, or the kernel does not fit this node
                result = lowering(*args, **kwargs)
            return result

        return value


def _lower_auto_functionalized(target: Any, op: Any, **kwargs: Any) -> Any:
    return lower_auto_functionalized(target, op, dict(kwargs))


def resolve(node: torch.fx.Node, *, kernels: str = "reference", target: str = "cpu") -> Dispatch:
    """The dispatch of ``node`` (see the module docstring for the precedence): call it with the node's
    arguments, or, when its ``lowering`` is None, report its ``refusal``."""
    op = node.target
    record = record_of(op)
    if is_complex_node(node):
        pair = record.complex_pair if record is not None else None
        if pair is None:  # an op refused whatever the dtype says why itself (linalg_eig: not lowered at all)
            refusal = record.refusal if record is not None else None
            return Dispatch(None, refusal or COMPLEX_REFUSAL, record=record, target=target)
        return Dispatch(on_plain_arrays(pair), record=record, on_pairs=True, target=target)
    lowering = lowering_for(op)
    if lowering is None and isinstance(op, OpOverload):
        lowering = user_kernel_lowering(op)
    if op in AUTO_FUNCTIONALIZED:
        lowering = functools.partial(_lower_auto_functionalized, op)
    if lowering is None:
        if isinstance(op, OpOverload):
            refusal = (record.refusal if record else None) or "no lowering for this op"
            return Dispatch(None, refusal, record=record, target=target)
        return Dispatch(None, non_aten_reason(op), record=record, target=target)
    route = record.kernel_route if record is not None and kernels != "off" else None
    return Dispatch(lowering, route=route, record=record, target=target)
