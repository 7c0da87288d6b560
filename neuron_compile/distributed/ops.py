"""Which FX nodes are collectives: the ``_c10d_functional`` ops AOTAutograd leaves in its graphs."""

from __future__ import annotations

import operator

import torch
from torch._ops import OpOverload

_c10d = torch.ops._c10d_functional

#: Every functional collective a compiled graph may hold, ``wait_tensor`` included (it completes one).
COLLECTIVE_OPS: frozenset[OpOverload] = frozenset({
    _c10d.all_reduce.default,
    _c10d.all_reduce_coalesced.default,
    _c10d.all_gather_into_tensor.default,
    _c10d.all_gather_into_tensor_coalesced.default,
    _c10d.reduce_scatter_tensor.default,
    _c10d.reduce_scatter_tensor_coalesced.default,
    _c10d.all_to_all_single.default,
    _c10d.broadcast.default,
    _c10d.wait_tensor.default,
})  # fmt: skip


def is_collective(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in COLLECTIVE_OPS


def collective_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The collective nodes of ``gm`` and the ``getitem`` nodes that unpack a coalesced one's results."""
    found: list[torch.fx.Node] = []
    for node in gm.graph.nodes:
        if is_collective(node):
            found.append(node)
        elif node.op == "call_function" and node.target is operator.getitem and is_collective(node.args[0]):
            found.append(node)
    return found


def has_collectives(gm: torch.fx.GraphModule) -> bool:
    return any(is_collective(node) for node in gm.graph.nodes)


def is_opaque(value: object) -> bool:
    """A graph input that is neither a tensor nor a Python scalar: e.g. the DeviceMesh that DTensor
    passes into its graphs as an opaque script object (and returns unchanged for the backward)."""
    return value is not None and not isinstance(value, (torch.Tensor, int, float, bool, torch.SymInt, torch.SymFloat))


def has_opaque_inputs(example_inputs: list[object]) -> bool:
    return any(is_opaque(x) for x in example_inputs)
