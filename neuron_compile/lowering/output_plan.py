"""The output plan of a lowered graph: which executable buffer each graph output lives in, with the strides,
storage offset and aliasing torch computed, so the runtime returns tensors laid out as eager's.

``output_buffers`` decides it from the FX graph's fake tensors before the trace; ``assemble`` turns the
traced values into the executable's outputs and the ``OutputSpec`` of each graph output.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
import torch
from torch._ops import OpOverload
from torch._prims_common import make_contiguous_strides_for

from ..artifact import OutputSpec, TensorSpec, channels_last_strides
from . import layout
from .semantics import torch_dtype


def physical_order(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...] | None:
    """The dim order that lays a non-overlapping, dense tensor out in memory order (outermost first),
    or None when the strides have gaps or overlaps (no buffer of numel elements holds it)."""
    perm = tuple(sorted(range(len(shape)), key=lambda d: (-stride[d], d)))
    expected = 1
    for d in reversed(perm):
        if shape[d] != 1 and stride[d] != expected:
            return None
        expected *= shape[d]
    return perm


def view_root(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose result ``node`` is a view of (through view ops and getitem of split-like views)."""
    while node.op == "call_function":
        src = node
        if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            src = node.args[0]
        if not (isinstance(src.target, OpOverload) and src.target.is_view and isinstance(src.args[0], torch.fx.Node)):
            break
        node = src.args[0]
    return node


@dataclass
class Buffer:
    """One executable output: the value of ``node`` laid out in memory order (``perm``)."""

    node: torch.fx.Node
    perm: tuple[int, ...]
    users: list[int] = field(default_factory=list)  # graph outputs that live in it


#: Per graph output: (buffer, size, stride, storage_offset), its finished plan when it aliases an input, or None.
Placement = tuple[int, tuple[int, ...], tuple[int, ...] | None, int] | OutputSpec | None


def output_buffers(gm: torch.fx.GraphModule, out_args: list[Any]) -> tuple[list[Buffer], list[Placement]]:
    """Buffers of the executable, and for each graph output (buffer, size, stride, storage_offset), or
    the input it aliases.

    Eager returns outputs with the strides torch computed (channels_last, a transposed view) and outputs
    that view one intermediate share its storage (``y, y.view(-1)``). AOTAutograd regenerates views of
    inputs, and of intermediates only when they require grad; everything else is ours. So each output
    whose storage is owned by a graph intermediate is an ``as_strided`` view of that intermediate's
    buffer, and the buffer holds the intermediate in its own memory order. The fake tensors of
    ``meta["val"]`` tell the strides; the owner is found through the chain of view ops, and must agree
    with the fake storages (which alone are not enough: fake outputs of a higher-order op such as
    invoke_subgraph are shared between its calls).

    An output that is an input, or a view of one, is that input (or the same view of it) at run time,
    as in eager: an executable result would be a copy, and AOTAutograd's forward returns every input
    it saves for backward (a weight, an activation), so the copies were a large part of a training step.
    """
    from torch.multiprocessing.reductions import StorageWeakRef

    def storage(t: torch.Tensor) -> int:
        return StorageWeakRef(t.untyped_storage()).cdata

    position = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    buffers: dict[torch.fx.Node, Buffer] = {}
    placed: list[tuple[torch.fx.Node, torch.Tensor, int] | OutputSpec | None] = []
    for i, arg in enumerate(out_args):
        val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor):
            placed.append(None)
            continue
        root = view_root(arg)
        rval = root.meta.get("val")
        if not isinstance(rval, torch.Tensor) or storage(rval) != storage(val):
            root, rval = arg, val
        if (
            root.op == "placeholder"
            and rval.dtype == val.dtype
            and (val.is_conj(), val.is_neg()) == (rval.is_conj(), rval.is_neg())
            and not rval.is_sparse
        ):
            view = root is not arg
            placed.append(
                OutputSpec(
                    "input", position[root], spec=TensorSpec(tuple(int(s) for s in val.shape), val.dtype),
                    stride=tuple(int(s) for s in val.stride()) if view else None,
                    storage_offset=int(val.storage_offset() - rval.storage_offset()) if view else 0,
                    input_stride=tuple(int(s) for s in rval.stride()),
                )
            )  # fmt: skip
            continue
        perm = physical_order(tuple(rval.shape), rval.stride())
        extent = val.storage_offset() + sum((n - 1) * s for n, s in zip(val.shape, val.stride()))
        shares = (
            root.op != "placeholder"  # views of inputs: AOTAutograd's runtime wrapper rebuilds them
            and root is not arg
            and perm is not None
            and rval.dtype == val.dtype  # a dtype-reinterpreting view cannot be an as_strided
            and (val.is_conj(), val.is_neg()) == (rval.is_conj(), rval.is_neg())  # nor a lazy conj/neg view
            and rval.storage_offset() == 0
            and (val.numel() == 0 or extent < rval.numel())
        )
        if not shares:
            root, rval = arg, val
            perm = physical_order(tuple(val.shape), val.stride())
        if perm is None:  # a strided view of an input with gaps: returned contiguous
            perm = tuple(range(val.dim()))
        buf = buffers.setdefault(root, Buffer(root, perm))
        buf.users.append(i)
        placed.append((root, val, val.storage_offset() if shares else 0))
    order = list(buffers.values())
    number = {b.node: k for k, b in enumerate(order)}
    plan: list[Placement] = []
    for p in placed:
        if p is None or isinstance(p, OutputSpec):
            plan.append(p)
            continue
        root, val, offset = p
        buf = order[number[root]]
        shape = tuple(int(s) for s in val.shape)
        stride = tuple(int(s) for s in val.stride())
        plain = len(buf.users) == 1 and buf.node is out_args[buf.users[0]] and buf.perm == tuple(range(len(shape)))
        # None: the buffer itself (a contiguous output alone in its buffer stays a plain tensor).
        plan.append((number[root], shape, None if plain else stride, offset))
    return order, plan


def channels_last_buffers(
    buffers: list[Buffer], roots: list[Any], placement: list[Placement], saved_from: int | None
) -> set[int]:
    """Buffers returned channels-last: a channels-last value that only the backward reads (outputs from
    ``saved_from`` on), each output the whole buffer. The tensor handed over is torch's shape with
    channels-last strides, and the backward, compiled for those strides, takes it as it is; user-visible
    outputs keep eager's strides."""
    if saved_from is None:
        return set()
    kept = set()
    for k, (buf, value) in enumerate(zip(buffers, roots)):
        if not isinstance(value, layout.ChannelsLast) or buf.perm != tuple(range(len(buf.perm))):
            continue
        whole = [
            place is not None
            and not isinstance(place, OutputSpec)
            and place[0] == k
            and place[1] == value.logical_shape
            and place[3] == 0
            and (place[2] is None or place[2] == make_contiguous_strides_for(place[1]))
            for place in (placement[i] for i in buf.users)
        ]
        if buf.users and all(i >= saved_from for i in buf.users) and all(whole):
            kept.add(k)
    return kept


def assemble(
    buffers: list[Buffer], placement: list[Placement], results: list[Any], roots: list[Any], saved_from: int | None
) -> tuple[list[Any], list[OutputSpec]]:
    """The executable's outputs (one array per distinct buffer, in memory order) and each graph output's
    spec, from the traced graph outputs (``results``) and buffer owners (``roots``)."""
    plan: list[OutputSpec] = []
    tensors: list[Any] = []
    index: list[tuple[int, int | None]] = []  # per buffer: executable output, and its copy number
    seen: dict[int, int] = {}
    kept_channels_last = channels_last_buffers(buffers, roots, placement, saved_from)
    for k, (buf, value) in enumerate(zip(buffers, roots)):
        if k in kept_channels_last:
            value = value.array  # already in the memory order of its channels-last strides
        else:
            value = layout.materialize(value)
            if buf.perm != tuple(range(len(buf.perm))):
                # memory order of torch's strides (a complex value's trailing pair dim stays last)
                value = jnp.transpose(value, buf.perm + tuple(range(len(buf.perm), value.ndim)))
        if id(value) in seen:  # one jax value for two storages (e.g. a clone lowered to itself)
            index.append((seen[id(value)], k))
            continue
        seen[id(value)] = len(tensors)
        index.append((len(tensors), None))
        tensors.append(value)
    for r, place in zip(results, placement):
        if place is None:
            if r is None or isinstance(r, (int, float, bool)):
                plan.append(OutputSpec("const", value=r))
            else:  # a tensor output without fake-tensor metadata: returned as computed
                spec = TensorSpec(tuple(int(d) for d in r.shape), torch_dtype(r.dtype))
                plan.append(OutputSpec("tensor", len(tensors), spec=spec))
                tensors.append(r)
            continue
        if isinstance(place, OutputSpec):  # an input, or a view of one
            plan.append(place)
            continue
        k, shape, stride, offset = place
        if k in kept_channels_last:
            stride = channels_last_strides(shape)
        spec = TensorSpec(shape, torch_dtype(r.dtype))
        i, copy = index[k]
        plan.append(OutputSpec("tensor", i, spec=spec, duplicate_of=copy, stride=stride, storage_offset=offset))
    return tensors, plan
