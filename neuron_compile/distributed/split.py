"""Graphs split into compiled pieces, run by a plain FX module that holds what cannot be compiled.

The CPU target's way of running collectives: an XLA CPU executable cannot call into torch.distributed
without host callbacks, and an executable with host callbacks can neither be compiled from the cached
StableHLO text nor served from the disk cache. So the graph is cut (``torch.fx.passes.split_module``)
into compute pieces and collective pieces, in graph order: each compute piece is compiled like any graph
(cached, shared across ranks), each collective piece runs eagerly, i.e. the ``_c10d_functional`` ops on
the real process group, exactly where the graph has them. Nothing is dropped or reordered: pieces run in
the order of their nodes.

The same split serves graphs with opaque inputs (DTensor passes its DeviceMesh into the forward and
backward graphs and returns it unchanged): the outer module passes such values through, and the
compiled pieces see tensors only.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
from torch.fx.passes.split_module import split_module

from .ops import collective_nodes

#: (piece, its example inputs, its index among compiled pieces) -> a boxed callable (list in, list out)
CompilePiece = Callable[[torch.fx.GraphModule, list[Any], int], Callable[[list[Any]], list[Any]]]


class _Compiled(torch.nn.Module):
    """A compiled piece in the split module's place of the piece (split_module calls it unboxed)."""

    def __init__(self, compiled: Callable[[list[Any]], list[Any]]) -> None:
        super().__init__()
        self.compiled = compiled

    def forward(self, *args: Any) -> tuple[Any, ...]:
        return tuple(self.compiled(list(args)))


class SplitGraph:
    """A boxed callable (AOTAutograd's compiler convention) running the pieces of a split graph."""

    def __init__(self, name: str, split: torch.fx.GraphModule, compiled: list[Any], collectives: int) -> None:
        self._boxed_call = True
        self.name = name
        self.split = split
        #: The compiled pieces, in graph order (CompiledGraph objects on the CPU target).
        self.pieces = compiled
        #: How many collectives run eagerly between the pieces.
        self.num_collectives = collectives

    def __call__(self, args: list[Any]) -> list[Any]:
        inputs = list(args)
        args.clear()
        return list(self.split(*inputs))


def split_graph(
    gm: torch.fx.GraphModule,
    compile_piece: CompilePiece,
    name: str,
    *,
    run_collectives: bool,
) -> SplitGraph:
    """Compile ``gm``'s pieces with ``compile_piece``; with ``run_collectives`` its collectives are not
    compiled but run between the pieces, through torch.distributed."""
    comm = set(collective_nodes(gm)) if run_collectives else set()
    part: dict[torch.fx.Node, int] = {}
    index, in_comm = 0, None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        is_comm = node in comm
        if in_comm is not None and is_comm != in_comm:
            index += 1  # a new piece at every switch between compute and collectives keeps graph order
        in_comm = is_comm
        part[node] = index
    comm_parts = {part[n] for n in comm}
    split = split_module(gm, None, lambda node: part[node], keep_original_order=True, tuple_return=True)
    compiled: list[Any] = []
    for call in split.graph.nodes:
        if call.op != "call_module" or int(call.target.rsplit("_", 1)[-1]) in comm_parts:
            continue  # a collective piece runs eagerly: the functional collectives on the real process group
        piece = getattr(split, call.target)
        inputs = [p.meta.get("val") for p in piece.graph.nodes if p.op == "placeholder"]
        done = compile_piece(piece, inputs, len(compiled))
        compiled.append(done)
        setattr(split, call.target, _Compiled(done))
    return SplitGraph(name, split, compiled, sum(1 for n in comm if n.target is not operator.getitem))
