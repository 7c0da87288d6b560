"""The op registry: which aten overload is lowered by which function.

A lowering is a plain function from jax values (for tensor arguments) and Python values (for the rest)
to jax values, registered for one or more aten overloads by decorator. Torch semantics shared by many
ops (type promotion, broadcasting, the float64 policy) live in ``semantics.py``, not in the lowerings.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch._ops import OpOverload, OpOverloadPacket

LoweringFn = Callable[..., Any]

#: aten overload -> lowering function. Read it through ``supported_ops()``.
LOWERINGS: dict[OpOverload, LoweringFn] = {}


class Unsupported(Exception):
    """Raised by a lowering for an argument combination it cannot express for the target.

    The interpreter turns it into one line of the single ``NeuronUnsupportedOpError`` of the graph.
    """


@dataclass
class NodeContext:
    """What a lowering may ask about the FX node it is lowering (its output metadata above all)."""

    node: torch.fx.Node
    #: "cpu" or "neuron": lowerings with a device-only form (AwsNeuron* custom calls) choose by it.
    target: str = "cpu"

    #: Called by random ops: returns this node's uint32[2] seed, fresh on every call of the graph.
    seed_source: Any = None

    def rng_seed(self) -> Any:
        """A uint32[2] jax value, different per node and per call, derived from torch's default
        generator (so ``torch.manual_seed`` makes compiled random ops reproducible)."""
        if self.seed_source is None:
            raise Unsupported("random ops are not available in this graph")
        return self.seed_source(self.node)

    @property
    def out(self) -> Any:
        """The node's FakeTensor output (or tuple of them), as computed by AOTAutograd."""
        return self.node.meta.get("val")


_CURRENT: contextvars.ContextVar[NodeContext | None] = contextvars.ContextVar("neuron_node", default=None)


def current() -> NodeContext:
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError("lowering called outside the graph interpreter")
    return ctx


def _overloads(op: OpOverload | OpOverloadPacket) -> Iterable[OpOverload]:
    if isinstance(op, OpOverload):
        return [op]
    # A packet stands for its functional overloads; out= variants write into a buffer we do not own.
    return [
        getattr(op, name)
        for name in op.overloads()
        if not name.startswith("out") and not name.endswith("_out") and "out" not in name.split("_")
    ]


def register_lowering(*ops: OpOverload | OpOverloadPacket) -> Callable[[LoweringFn], LoweringFn]:
    """Register ``fn`` as the lowering of every given overload (a packet means all its overloads)."""

    def decorate(fn: LoweringFn) -> LoweringFn:
        for op in ops:
            for overload in _overloads(op):
                LOWERINGS[overload] = fn
        return fn

    return decorate


def lowering_for(op: Any) -> LoweringFn | None:
    return LOWERINGS.get(op) if isinstance(op, OpOverload) else None


def supported_ops() -> list[str]:
    """Names of every aten overload the backend lowers, sorted (e.g. ``'aten.add.Tensor'``)."""
    return sorted(str(op) for op in LOWERINGS)
