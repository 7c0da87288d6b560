"""How one FX node is lowered: ``resolve(node)`` reads the node's dispatch record (registry.py) with one
fixed precedence, the way jax picks a primitive's lowering rule per platform.

1. A node with a complex input or output: the record's lowering on (real, imag) pairs, or refused
   (Trainium has no complex dtype; complex_pairs.py).
2. Otherwise the real-dtype lowering: the record's, a collective's or a library op's (registry.lowering_for),
   a user ``nki_op`` kernel, or a user kernel that writes its arguments (``auto_functionalized``); else
   refused, with the record's reason when it has one.
3. On top of a lowering: the record's NKI kernel route (``kernels`` != "off"), tried first at run time (it
   declines a node its kernel does not fit), and on the CPU target the channels-last handler, which depends
   on the arguments' layouts (``Dispatch.layout_handler``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

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

    def layout_handler(self, target: str, args: tuple, kwargs: dict) -> layout.Handler | None:
        """The channels-last handler for these arguments (CPU target, real dtypes), or None."""
        if target != "cpu" or self.on_pairs or self.lowering is None:
            return None
        return layout.handler_for(self.record, self.lowering, args, kwargs)


def _lower_auto_functionalized(target: Any, op: Any, **kwargs: Any) -> Any:
    return lower_auto_functionalized(target, op, dict(kwargs))


def resolve(node: torch.fx.Node, *, kernels: str = "reference") -> Dispatch:
    """The dispatch of ``node`` (see the module docstring for the precedence)."""
    target = node.target
    record = record_of(target)
    if is_complex_node(node):
        pair = record.complex_pair if record is not None else None
        if pair is None:  # an op refused whatever the dtype says why itself (linalg_eig: not lowered at all)
            refusal = record.refusal if record is not None else None
            return Dispatch(None, refusal or COMPLEX_REFUSAL, record=record)
        return Dispatch(on_plain_arrays(pair), record=record, on_pairs=True)
    lowering = lowering_for(target)
    if lowering is None and isinstance(target, OpOverload):
        lowering = user_kernel_lowering(target)
    if target in AUTO_FUNCTIONALIZED:
        lowering = functools.partial(_lower_auto_functionalized, target)
    if lowering is None:
        if isinstance(target, OpOverload):
            return Dispatch(None, (record.refusal if record else None) or "no lowering for this op", record=record)
        return Dispatch(None, non_aten_reason(target), record=record)
    route = record.kernel_route if record is not None and kernels != "off" else None
    return Dispatch(lowering, route=route, record=record)
