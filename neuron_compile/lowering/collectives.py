"""Functional collectives (``_c10d_functional``) as StableHLO collectives, for the neuron target.

Each collective becomes one StableHLO op with explicit ``replica_groups`` (every group of the SPMD program;
see ``distributed/groups.py``), in cross-replica mode (no channel handle: a replica is a rank, as
torch-xla emits them for Neuron):

  all_reduce[_coalesced]                  -> stablehlo.all_reduce (avg: sum, then divide by the group size)
  all_gather_into_tensor[_coalesced]      -> stablehlo.all_gather along dim 0
  reduce_scatter_tensor[_coalesced]       -> stablehlo.reduce_scatter along dim 0 (avg as above)
  all_to_all_single (equal splits)        -> stablehlo.all_to_all, split and concat dim 0
  broadcast                               -> stablehlo.all_gather of a new leading dim, then the source's
                                             slice (only documented ops; n times the traffic of a broadcast)
  wait_tensor                             -> nothing: StableHLO collectives complete where they stand

The CPU target never lowers these: the compiler splits its graphs around them and runs them through
torch.distributed. NOT VERIFIED ON HARDWARE: neuronx-cc was never run on these modules.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from jax.extend.core import Primitive
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo
from jax.interpreters import mlir

from ..distributed import parse_replica_groups, replica_groups
from .registry import Unsupported, current, register_collective

_c10d = torch.ops._c10d_functional

#: torch's reduce_op names -> the StableHLO reducer body ("avg" is a sum, divided afterwards).
_REDUCERS: dict[str, Callable[..., Any]] = {
    "sum": hlo.AddOp,
    "avg": hlo.AddOp,
    "product": hlo.MulOp,
    "min": hlo.MinOp,
    "max": hlo.MaxOp,
}


# -- one jax primitive that emits any of the StableHLO collectives ------------------------------------
_collective_p = Primitive("neuron_collective")


def _abstract(x: Any, *, kind: str, groups: tuple[tuple[int, ...], ...], reduce_op: str) -> Any:
    n = len(groups[0])
    shape = list(x.shape)
    if kind == "all_gather":
        shape[0] *= n
    elif kind == "reduce_scatter":
        shape[0] //= n
    return jax.core.ShapedArray(tuple(shape), x.dtype)


def _groups_attr(groups: tuple[tuple[int, ...], ...]) -> ir.DenseElementsAttr:
    return ir.DenseIntElementsAttr.get(np.ascontiguousarray(np.array(groups, dtype=np.int64)))


def _reducer_body(op: Any, scalar: ir.Type, reduce_op: str) -> None:
    block = op.regions[0].blocks.append(scalar, scalar)
    with ir.InsertionPoint(block):
        hlo.return_([_REDUCERS[reduce_op](*block.arguments).result])


def _lower(ctx: Any, x: Any, *, kind: str, groups: tuple[tuple[int, ...], ...], reduce_op: str) -> list[Any]:
    (aval_out,) = ctx.avals_out
    out_type = mlir.aval_to_ir_type(ctx.module_context, aval_out)
    attr = _groups_attr(groups)
    if kind == "all_reduce":
        op = hlo.AllReduceOp([out_type], [x], replica_groups=attr)
    elif kind == "reduce_scatter":
        op = hlo.ReduceScatterOp(out_type, x, scatter_dimension=mlir.i64_attr(0), replica_groups=attr)
    elif kind == "all_gather":
        return hlo.AllGatherOp([out_type], [x], all_gather_dim=mlir.i64_attr(0), replica_groups=attr).results
    elif kind == "all_to_all":
        n = len(groups[0])
        return hlo.AllToAllOp(
            [x],
            split_dimension=mlir.i64_attr(0),
            concat_dimension=mlir.i64_attr(0),
            split_count=mlir.i64_attr(n),
            replica_groups=attr,
        ).results
    else:
        raise AssertionError(kind)
    scalar = mlir.aval_to_ir_type(ctx.module_context, aval_out.update(shape=()))
    _reducer_body(op, scalar, reduce_op)
    return list(op.results)


_collective_p.def_abstract_eval(_abstract)
mlir.register_lowering(_collective_p, _lower)


def _emit(x: Any, kind: str, groups: list[list[int]], reduce_op: str = "sum") -> Any:
    return _collective_p.bind(x, kind=kind, groups=tuple(tuple(g) for g in groups), reduce_op=reduce_op)


# -- the lowerings ----------------------------------------------------------------------------------
def _groups(group_name: Any, op: str) -> list[list[int]]:
    if current().target != "neuron":
        raise Unsupported(
            f"{op} runs through torch.distributed on the CPU target (the compiler splits the graph around it); "
            "reaching its lowering there is a bug of the backend"
        )
    groups = parse_replica_groups(group_name)
    if groups is not None:
        return groups
    try:
        return replica_groups(group_name)
    except ValueError as e:
        raise Unsupported(str(e)) from None


def _check_reduce_op(reduce_op: str) -> None:
    if reduce_op.lower() not in _REDUCERS:
        raise Unsupported(f"reduce_op {reduce_op!r}: StableHLO collectives take {sorted(_REDUCERS)}")


def _average(x: Any, reduce_op: str, n: int) -> Any:
    return lax.div(x, jnp.asarray(n, x.dtype)) if reduce_op.lower() == "avg" else x


def _all_reduce_one(x: Any, reduce_op: str, groups: list[list[int]]) -> Any:
    return _average(_emit(x, "all_reduce", groups, reduce_op.lower()), reduce_op, len(groups[0]))


@register_collective(_c10d.all_reduce.default)
def c10d_all_reduce(x: Any, reduce_op: str, group_name: Any) -> Any:
    """_c10d_functional.all_reduce -> stablehlo.all_reduce."""
    groups = _groups(group_name, "all_reduce")
    _check_reduce_op(reduce_op)
    return _all_reduce_one(x, reduce_op, groups)


@register_collective(_c10d.all_reduce_coalesced.default)
def c10d_all_reduce_coalesced(xs: list[Any], reduce_op: str, group_name: Any) -> list[Any]:
    """_c10d_functional.all_reduce_coalesced -> one stablehlo.all_reduce per tensor."""
    groups = _groups(group_name, "all_reduce_coalesced")
    _check_reduce_op(reduce_op)
    return [_all_reduce_one(x, reduce_op, groups) for x in xs]


def _check_group_size(group_size: int, groups: list[list[int]]) -> None:
    if group_size != len(groups[0]):
        raise Unsupported(f"group_size {group_size} differs from the process group's {len(groups[0])} ranks")


def _all_gather_one(x: Any, groups: list[list[int]]) -> Any:
    if x.ndim == 0:
        return _emit(x.reshape(1), "all_gather", groups)
    return _emit(x, "all_gather", groups)


@register_collective(_c10d.all_gather_into_tensor.default)
def c10d_all_gather_into_tensor(x: Any, group_size: int, group_name: Any) -> Any:
    """_c10d_functional.all_gather_into_tensor -> stablehlo.all_gather along dim 0."""
    groups = _groups(group_name, "all_gather_into_tensor")
    _check_group_size(group_size, groups)
    return _all_gather_one(x, groups)


@register_collective(_c10d.all_gather_into_tensor_coalesced.default)
def c10d_all_gather_into_tensor_coalesced(xs: list[Any], group_size: int, group_name: Any) -> list[Any]:
    """_c10d_functional.all_gather_into_tensor_coalesced -> one stablehlo.all_gather per tensor."""
    groups = _groups(group_name, "all_gather_into_tensor_coalesced")
    _check_group_size(group_size, groups)
    return [_all_gather_one(x, groups) for x in xs]


def _reduce_scatter_one(x: Any, reduce_op: str, groups: list[list[int]]) -> Any:
    n = len(groups[0])
    if x.ndim == 0 or x.shape[0] % n:
        raise Unsupported(f"reduce_scatter of a tensor of shape {list(x.shape)}: dim 0 must divide by {n} ranks")
    return _average(_emit(x, "reduce_scatter", groups, reduce_op.lower()), reduce_op, n)


@register_collective(_c10d.reduce_scatter_tensor.default)
def c10d_reduce_scatter_tensor(x: Any, reduce_op: str, group_size: int, group_name: Any) -> Any:
    """_c10d_functional.reduce_scatter_tensor -> stablehlo.reduce_scatter along dim 0."""
    groups = _groups(group_name, "reduce_scatter_tensor")
    _check_group_size(group_size, groups)
    _check_reduce_op(reduce_op)
    return _reduce_scatter_one(x, reduce_op, groups)


@register_collective(_c10d.reduce_scatter_tensor_coalesced.default)
def c10d_reduce_scatter_tensor_coalesced(xs: list[Any], reduce_op: str, group_size: int, group_name: Any) -> list[Any]:
    """_c10d_functional.reduce_scatter_tensor_coalesced -> one stablehlo.reduce_scatter per tensor."""
    groups = _groups(group_name, "reduce_scatter_tensor_coalesced")
    _check_group_size(group_size, groups)
    _check_reduce_op(reduce_op)
    return [_reduce_scatter_one(x, reduce_op, groups) for x in xs]


@register_collective(_c10d.all_to_all_single.default)
def c10d_all_to_all_single(x: Any, output_split_sizes: list[int], input_split_sizes: list[int], group_name: Any) -> Any:
    """_c10d_functional.all_to_all_single with equal splits -> stablehlo.all_to_all along dim 0."""
    groups = _groups(group_name, "all_to_all_single")
    n = len(groups[0])
    equal = x.ndim > 0 and x.shape[0] % n == 0
    for splits in (output_split_sizes, input_split_sizes):
        equal = equal and (not splits or all(int(s) == x.shape[0] // n for s in splits))
    if not equal:
        raise Unsupported(
            f"all_to_all_single with splits in={list(input_split_sizes)} out={list(output_split_sizes)} of "
            f"shape {list(x.shape)}: only equal splits of dim 0 map to stablehlo.all_to_all; pad to equal splits"
        )
    return _emit(x, "all_to_all", groups)


@register_collective(_c10d.broadcast.default)
def c10d_broadcast(x: Any, src: int, group_name: Any) -> Any:
    """_c10d_functional.broadcast -> stablehlo.all_gather of a new leading dim, then the source's slice.

    ``src`` is the rank within the group, as c10d takes it. StableHLO's collective_broadcast is not in
    neuronx-cc's documented operator set; all_gather is.
    """
    groups = _groups(group_name, "broadcast")
    if not 0 <= src < len(groups[0]):
        raise Unsupported(f"broadcast src {src} is not a rank of a group of {len(groups[0])}")
    gathered = _emit(x.reshape((1,) + tuple(x.shape)), "all_gather", groups)
    return lax.index_in_dim(gathered, src, axis=0, keepdims=False)


@register_collective(_c10d.wait_tensor.default)
def c10d_wait_tensor(x: Any) -> Any:
    """_c10d_functional.wait_tensor: the identity (a StableHLO collective is complete where it stands)."""
    return x


__all__ = [name for name in dir() if name.startswith("c10d_")]
