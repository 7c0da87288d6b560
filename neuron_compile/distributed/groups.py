"""Replica groups: which ranks each collective of a graph joins, derived from its process group.

A StableHLO collective names ALL the groups of the program (SPMD: every rank runs the same module), not
only the caller's. torch gives a rank its own group only, so the others are inferred: a DeviceMesh
dimension's groups are translates of one another (``[0, 1]`` of 4 ranks -> ``[[0, 1], [2, 3]]``;
``[0, 2]`` -> ``[[0, 2], [1, 3]]``), and that is the partition we build. A group that no translate
pattern explains is refused rather than guessed.

On the neuron target each collective's group name is replaced in the graph by ``replica_groups_arg``
(the functional collectives type that argument ``Any``), so the graph, its cache key and the lowering
all see the ranks, not a process-local name.
"""

from __future__ import annotations

import torch

from .ops import is_collective

_PREFIX = "replica_groups:"


def replica_groups_arg(groups: list[list[int]]) -> str:
    """The stand-in for a group name: ``'replica_groups:0,1;2,3'``."""
    return _PREFIX + ";".join(",".join(str(r) for r in group) for group in groups)


def parse_replica_groups(arg: object) -> list[list[int]] | None:
    """The groups of a ``replica_groups_arg`` string, or None if ``arg`` is something else."""
    if not isinstance(arg, str) or not arg.startswith(_PREFIX):
        return None
    return [[int(r) for r in group.split(",")] for group in arg[len(_PREFIX) :].split(";")]


def _partition(ranks: list[int], world: int) -> list[list[int]] | None:
    """All translates of ``ranks`` that tile ``range(world)``, in order of their first rank, or None."""
    offsets = [r - ranks[0] for r in ranks]
    covered: set[int] = set()
    groups: list[list[int]] = []
    for start in range(world):
        if start in covered:
            continue
        group = [start + o for o in offsets]
        if any(r < 0 or r >= world or r in covered for r in group):
            return None
        covered.update(group)
        groups.append(group)
    return groups if ranks in groups else None


def replica_groups(group_name: str) -> list[list[int]]:
    """Every replica group of the collective run on process group ``group_name`` (ranks in group order).

    Raises ValueError (naming the group and its ranks) when torch.distributed is not initialized or
    the group is not a translate-tiling of the world, such as a DeviceMesh dimension produces.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    if not dist.is_initialized():
        raise ValueError(
            f"process group {group_name!r}: torch.distributed is not initialized, so its ranks are unknown; "
            "call torch.distributed.init_process_group before compiling"
        )
    ranks = dist.get_process_group_ranks(_resolve_process_group(group_name))
    world = dist.get_world_size()
    groups = _partition(list(ranks), world)
    if groups is None:
        raise ValueError(
            f"process group {group_name!r} has ranks {ranks} of {world}: the other ranks' groups cannot be "
            "inferred (StableHLO collectives list every group); use groups of a DeviceMesh dimension"
        )
    return groups


def _group_position(node: torch.fx.Node) -> int | str | None:
    """Where the group name is among ``node``'s arguments (index, or keyword), or None."""
    schema = node.target._schema
    for i, arg in enumerate(schema.arguments):
        if arg.name == "group_name":
            return i if i < len(node.args) else "group_name"
    return None


def annotate_replica_groups(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Replace (in place) each collective's group name by the replica groups it stands for.

    A group whose replica groups cannot be derived is left as it is: the lowering refuses that node with
    the reason and the user's line.
    """
    for node in gm.graph.nodes:
        if not is_collective(node):
            continue
        where = _group_position(node)
        if where is None:
            continue
        name = node.args[where] if isinstance(where, int) else node.kwargs.get(where)
        if parse_replica_groups(name) is not None:
            continue
        try:
            groups = replica_groups(name)
        except ValueError:
            continue
        if isinstance(where, int):
            node.update_arg(where, replica_groups_arg(groups))
        else:
            node.update_kwarg(where, replica_groups_arg(groups))
    gm.recompile()
    return gm
