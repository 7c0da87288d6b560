"""Collectives inside compiled graphs (functional collectives from explicit calls, DTensor, compiled FSDP2).

- CPU target: ``split.py`` cuts the graph around its collective nodes; the pieces between them are
  compiled as ordinary graphs (and cached), the collectives run in between, in graph order, through
  torch.distributed with the real process group.
- neuron target: ``groups.py`` replaces each collective's process-group name by the replica groups it
  stands for, so the graph (and its cache key) says which ranks talk; ``lowering/collectives.py`` lowers
  the nodes to StableHLO collectives with those groups.
- Graphs with opaque inputs (DTensor's DeviceMesh) are split on both targets, so that the compiled pieces
  see tensors only and the opaque values pass through the outer module.

This unit is plain torch: importing it loads neither jax nor the lowerings.
"""

from .groups import annotate_replica_groups, parse_replica_groups, replica_groups, replica_groups_arg
from .ops import COLLECTIVE_OPS, collective_nodes, has_collectives, has_opaque_inputs, is_collective, is_opaque
from .split import SplitGraph, split_graph

__all__ = [
    "COLLECTIVE_OPS",
    "SplitGraph",
    "annotate_replica_groups",
    "collective_nodes",
    "has_collectives",
    "has_opaque_inputs",
    "is_collective",
    "is_opaque",
    "parse_replica_groups",
    "replica_groups",
    "replica_groups_arg",
    "split_graph",
]
