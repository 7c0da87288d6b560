"""StableHLO collectives across processes, for the simulated NeuronCores (XLA CPU runs one device only).

A NEFF whose module holds collectives (``stablehlo.all_reduce``, ``all_gather``, ``reduce_scatter``,
``all_to_all``, ``collective_permute``, ``collective_broadcast``) runs as a chain of stages (:func:`split`):
``@main`` is cut at each collective; the pieces between the cuts are single-device modules that XLA CPU runs,
and each collective runs in Python between them (:func:`run`), through ``torch.distributed`` on the default
process group of the process that calls ``nrt_execute`` (on a device, the runtime's collective engine does
it; here gloo). Values cross the cuts as buffers: nothing is computed twice.

Ids: a replica id (cross-replica mode, as the package emits) or a global device id
(``use_global_device_ids``) is a rank of the default process group: the package loads such a NEFF with
``nrt_load_collectives(rank, world size)`` from ``torch.distributed``. Every rank runs the same module
(SPMD), so every rank reaches the same collectives in the same order, and each collective is ONE world-wide
``torch.distributed`` call: an ``all_reduce`` when the op has one group of every rank (what a device's
all-reduce is), otherwise an ``all_gather`` of every rank's operands, from which each rank computes its own
group's result as StableHLO's semantics say (:func:`semantics`; ranks listed in the group's order).

Limits (the fake compiler refuses them, so a module it accepted runs): collectives at the top level of
``@main`` only (not inside a while, a case or a private function); reducers of one elementwise op (add,
multiply, maximum, minimum, and, or, xor) over the block's two arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: The StableHLO ops that talk between devices.
OPS = ("stablehlo.all_reduce", "stablehlo.all_gather", "stablehlo.reduce_scatter", "stablehlo.all_to_all",
       "stablehlo.collective_permute", "stablehlo.collective_broadcast")  # fmt: skip

#: A reducer region's op -> its reduction.
_REDUCERS = {"stablehlo.add": "sum", "stablehlo.multiply": "product", "stablehlo.maximum": "max",
             "stablehlo.minimum": "min", "stablehlo.and": "and", "stablehlo.or": "or", "stablehlo.xor": "xor"}  # fmt: skip

#: A value of @main: ("arg", i) for its i-th parameter, (position, j) for result j of its top-level op at position.
Key = tuple[Any, int]


class UnsupportedCollective(Exception):
    """A collective the simulator cannot run (the fake compiler turns it into a compile error)."""


@dataclass(frozen=True)
class Collective:
    """One collective of ``@main``, as its attributes say."""

    kind: str  # "all_reduce", "all_gather", ... (the op's name without "stablehlo.")
    position: int  # among @main's top-level ops
    #: Replica groups (ids = ranks) with -1 padding dropped; () = one group of every rank.
    groups: tuple[tuple[int, ...], ...]
    reduce: str | None = None  # all_reduce, reduce_scatter: "sum", "product", "max", "min", "and", "or", "xor"
    dim: int | None = None  # all_gather_dim, scatter_dimension
    split_dimension: int | None = None  # all_to_all
    concat_dimension: int | None = None
    split_count: int | None = None
    pairs: tuple[tuple[int, int], ...] = ()  # collective_permute's (source, target)
    operands: tuple[Key, ...] = ()
    results: tuple[Key, ...] = ()

    def describe(self) -> dict[str, Any]:
        """What the fake compiler lists in the NEFF's neff.json."""
        out: dict[str, Any] = {"op": f"stablehlo.{self.kind}", "position": self.position,
                               "replica_groups": [list(g) for g in self.groups]}  # fmt: skip
        for name in ("reduce", "dim", "split_dimension", "concat_dimension", "split_count"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.pairs:
            out["source_target_pairs"] = [list(p) for p in self.pairs]
        return out

    def groups_of(self, world: int) -> list[list[int]]:
        """The groups among ``world`` ranks (every rank in one group when the op lists none)."""
        groups = [list(g) for g in self.groups] or [list(range(world))]
        for g in groups:
            for r in g:
                if r >= world:
                    raise UnsupportedCollective(
                        f"stablehlo.{self.kind} names replica {r}, but the process group has {world} ranks"
                    )
        return groups

    def group_of(self, rank: int, world: int) -> list[int]:
        for g in self.groups_of(world):
            if rank in g:
                return g
        raise UnsupportedCollective(
            f"stablehlo.{self.kind}: rank {rank} is in none of its replica groups {self.groups}"
        )


# ---------------------------------------------------------------------------------------- reading the module
def main_function(module: Any) -> Any:
    from jax._src.lib.mlir import ir

    for op in module.body.operations:
        if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
            return op
    raise UnsupportedCollective("the module has no @main function")


def _int(op: Any, name: str) -> int:
    from jax._src.lib.mlir import ir

    return ir.IntegerAttr(op.attributes[name]).value


def _ids(op: Any, name: str) -> np.ndarray:
    from jax._src.lib.mlir import ir

    if name not in op.attributes:
        return np.zeros((0, 0), np.int64)
    return np.array(ir.DenseIntElementsAttr(op.attributes[name]), dtype=np.int64)


def _reducer(op: Any) -> str:
    from jax._src.lib.mlir import ir

    block = op.regions[0].blocks[0]
    body = [o.operation for o in block.operations]
    kinds = {_REDUCERS.get(o.name) for o in body[:-1]}
    simple = (
        len(body) >= 2 and None not in kinds and len(kinds) == 1
        and body[-1].name in ("stablehlo.return", "func.return")
        and all(isinstance(v, ir.BlockArgument) for o in body[:-1] for v in o.operands)
    )  # fmt: skip
    if not simple:
        raise UnsupportedCollective(
            f"{op.name}: its reducer ({', '.join(o.name for o in body)}) is not one elementwise op of "
            f"{sorted(set(_REDUCERS.values()))} over the block's arguments; the simulator cannot run it"
        )
    return kinds.pop()


def _key(value: Any, index: dict[Any, int]) -> Key:
    from jax._src.lib.mlir import ir

    if isinstance(value, ir.BlockArgument):
        return ("arg", value.arg_number)
    return (index[value.owner.operation], value.result_number)


def find(module: Any) -> list[Collective]:
    """The collectives of ``module``, in ``@main``'s order. Raises :class:`UnsupportedCollective` for one the
    simulator cannot run (nested in a region or another function, an unknown reducer; StableHLO's verifier,
    at parse, has refused malformed groups)."""
    main = main_function(module)
    top = [op.operation for op in main.regions[0].blocks[0].operations]
    index = {op: i for i, op in enumerate(top)}
    nested: list[str] = []

    def visit(op: Any) -> Any:
        from jax._src.lib.mlir import ir

        op = op.operation
        if op.name in OPS and op not in index:
            nested.append(op.name)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    if nested:
        raise UnsupportedCollective(
            f"{nested[0]} is not at the top level of @main (inside a region or another function): the simulator "
            "runs collectives between pieces of @main only"
        )
    found = []
    for position, op in enumerate(top):
        if op.name not in OPS:
            continue
        kind = op.name.removeprefix("stablehlo.")
        raw = _ids(op, "replica_groups")
        groups = tuple(tuple(int(r) for r in row if r >= 0) for row in raw)
        groups = tuple(g for g in groups if g)
        fields: dict[str, Any] = {}
        if kind in ("all_reduce", "reduce_scatter"):
            fields["reduce"] = _reducer(op)
        if kind == "all_gather":
            fields["dim"] = _int(op, "all_gather_dim")
        if kind == "reduce_scatter":
            fields["dim"] = _int(op, "scatter_dimension")
        if kind == "all_to_all":
            fields.update(split_dimension=_int(op, "split_dimension"), concat_dimension=_int(op, "concat_dimension"),
                          split_count=_int(op, "split_count"))  # fmt: skip
            if groups and any(len(g) != fields["split_count"] for g in groups):
                raise UnsupportedCollective(f"{op.name}: split_count {fields['split_count']} is not its groups' size")
        if kind == "collective_permute":
            fields["pairs"] = tuple((int(s), int(t)) for s, t in _ids(op, "source_target_pairs"))
        found.append(Collective(
            kind=kind, position=position, groups=groups,
            operands=tuple(_key(v, index) for v in op.operands),
            results=tuple((position, j) for j in range(len(op.results))), **fields,
        ))  # fmt: skip
    return found


# ---------------------------------------------------------------------------------------- the stages
@dataclass(frozen=True)
class Stage:
    """One piece of ``@main``: a single-device module (None when nothing of it is needed) from ``params`` to
    ``results``."""

    text: str | None
    params: tuple[Key, ...]
    results: tuple[Key, ...]


@dataclass(frozen=True)
class Plan:
    """``stages[k]`` runs, then ``collectives[k]`` (for k < len(collectives)); the last stage's results are
    ``@main``'s."""

    stages: list[Stage]
    collectives: list[Collective]
    #: (shape, MLIR element type) of every value that crosses a cut.
    types: dict[Key, tuple[tuple[int, ...], str]] = field(default_factory=dict)


def split(module_text: str) -> Plan:
    """Cut ``@main`` of ``module_text`` at its collectives (see the module's docstring)."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    module = ir.Module.parse(module_text, context=mlir.make_ir_context())
    collectives = find(module)
    main = main_function(module)
    block = main.regions[0].blocks[0]
    top = [op.operation for op in block.operations]
    index = {op: i for i, op in enumerate(top)}
    cuts = [c.position for c in collectives]
    n = len(cuts)

    def top_position(owner: Any) -> int:
        op = owner.operation
        while op not in index:  # a use inside a region of a top-level op (a reduce's body, a while)
            op = op.parent.operation
        return index[op]

    values: list[tuple[Key, Any, int]] = [(("arg", i), a, -1) for i, a in enumerate(block.arguments)]
    for p, op in enumerate(top):
        values += [((p, j), r, p) for j, r in enumerate(op.results)]
    uses = {key: {top_position(u.owner) for u in v.uses} for key, v, _ in values}
    types: dict[Key, tuple[tuple[int, ...], str]] = {}

    def type_of(key: Key, value: Any) -> tuple[tuple[int, ...], str]:
        t = value.type
        if not isinstance(t, ir.RankedTensorType):
            raise UnsupportedCollective(f"a value of type {t} crosses a collective; the simulator takes tensors")
        types[key] = (tuple(t.shape), str(t.element_type))
        return types[key]

    stages = []
    for k in range(n + 1):
        first = cuts[k - 1] + 1 if k else 0  # the stage's ops: positions first .. end-1
        end = cuts[k] if k < n else len(top)
        params = tuple(key for key, v, p in values if p < first and any(first <= u < end for u in uses[key]))
        results = (
            tuple(key for key, v, p in values if first <= p < end and any(u >= end for u in uses[key]))
            if k < n else ()
        )  # fmt: skip
        crossing = set(params) | set(results)
        for key, v, _ in values:
            if key in crossing:
                type_of(key, v)
        if k < n and not results:
            stages.append(Stage(None, params, results))
            continue
        stages.append(Stage(_stage_text(module_text, params, results, first, end, k == n), params, results))
    by_key = {key: v for key, v, _ in values}
    for c in collectives:
        for key in c.operands + c.results:
            type_of(key, by_key[key])
    return Plan(stages, collectives, types)


def _stage_text(
    module_text: str, params: Sequence[Key], results: Sequence[Key], first: int, end: int, last: bool
) -> str:
    """``@main`` reduced to its ops at positions ``first .. end-1``: ``params`` become its parameters and
    ``results`` its results (the last stage keeps ``@main``'s return)."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import func

    ctx = mlir.make_ir_context()
    module = ir.Module.parse(module_text, context=ctx)
    main = main_function(module)
    block = main.regions[0].blocks[0]
    top = [op.operation for op in block.operations]
    n_args = len(block.arguments)

    def value(key: Key) -> Any:
        return block.arguments[key[1]] if key[0] == "arg" else top[key[0]].results[key[1]]

    with ctx, ir.Location.unknown(ctx):
        for key in params:
            old = value(key)
            old.replace_all_uses_with(block.add_argument(old.type, ir.Location.unknown(ctx)))
        returned = [value(key) for key in results]

        def erase(positions: Any) -> None:
            for p in positions:
                op = top[p]
                if any(True for r in op.results for _ in r.uses):
                    raise AssertionError(f"splitting @main: {op.name} at {p} is still used")  # a bug of split()
                op.erase()

        if not last:
            erase(reversed(range(end, len(top))))
            with ir.InsertionPoint(block):
                func.ReturnOp(returned)
        erase(reversed(range(first)))
        for i in reversed(range(n_args)):
            block.erase_argument(i)
        terminator = list(block.operations)[-1].operation
        main.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(
            [a.type for a in block.arguments], [v.type for v in terminator.operands]))  # fmt: skip
        for name in ("arg_attrs", "res_attrs"):
            if name in main.attributes:
                del main.attributes[name]
    if not module.operation.verify():
        raise AssertionError("a stage of @main does not verify")  # a bug of split()
    return str(module)


# ---------------------------------------------------------------------------------------- semantics
def _fold(reduce: str, arrays: Sequence[np.ndarray]) -> np.ndarray:
    logical = arrays[0].dtype == np.bool_
    fn: Callable[[Any, Any], Any] = {
        "sum": np.add, "product": np.multiply, "max": np.maximum, "min": np.minimum,
        "and": np.logical_and if logical else np.bitwise_and, "or": np.logical_or if logical else np.bitwise_or,
        "xor": np.logical_xor if logical else np.bitwise_xor,
    }[reduce]  # fmt: skip
    out = arrays[0]
    for a in arrays[1:]:
        out = fn(out, a)
    return np.asarray(out, dtype=arrays[0].dtype)


def semantics(c: Collective, rank: int, world: int, inputs: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    """What ``c`` gives ``rank``, from ``inputs[r]`` = rank r's operands (every rank of the world), following
    the StableHLO spec (members of a group in the group's listed order)."""
    i = len(inputs[rank])
    if c.kind == "collective_permute":
        sources = [s for s, t in c.pairs if t == rank]
        return [np.array(inputs[sources[0]][j]) if sources else np.zeros_like(inputs[rank][j]) for j in range(i)]
    group = c.group_of(rank, world)
    me = group.index(rank)
    out = []
    for j in range(i):
        parts = [inputs[m][j] for m in group]
        if c.kind == "all_reduce":
            out.append(_fold(c.reduce, parts))
        elif c.kind == "all_gather":
            out.append(np.concatenate(parts, axis=c.dim))
        elif c.kind == "reduce_scatter":
            out.append(np.split(_fold(c.reduce, parts), len(group), axis=c.dim)[me])
        elif c.kind == "all_to_all":
            chunks = [np.split(p, c.split_count, axis=c.split_dimension)[me] for p in parts]
            out.append(np.concatenate(chunks, axis=c.concat_dimension))
        elif c.kind == "collective_broadcast":
            out.append(np.array(parts[0]))
        else:  # find() knows OPS
            raise AssertionError(c.kind)
    return out


# ---------------------------------------------------------------------------------------- across processes
#: numpy dtypes gloo's all_reduce takes (as torch dtypes' names), for the world-wide all_reduce.
_GLOO_ALL_REDUCE = {"float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"}
_GLOO_OPS = {"sum": "SUM", "product": "PRODUCT", "max": "MAX", "min": "MIN"}


def _process_group() -> tuple[Any, int, int]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "this NEFF has collectives, and the device simulator runs them through torch.distributed: the process "
            "calling nrt_execute must have initialized its process group (torch.distributed.init_process_group), "
            "as every rank of a multi-device job does"
        )
    return dist, dist.get_rank(), dist.get_world_size()


def _torch_dtype(a: np.ndarray) -> Any:
    import torch

    name = str(a.dtype)
    return getattr(torch, name) if name in _GLOO_ALL_REDUCE else None


def run(c: Collective, operands: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Perform ``c`` on this rank's ``operands`` with the other ranks, through torch.distributed."""
    import torch

    dist, rank, world = _process_group()
    groups = c.groups_of(world)
    if (c.kind == "all_reduce" and len(groups) == 1 and sorted(groups[0]) == list(range(world))
            and c.reduce in _GLOO_OPS and all(_torch_dtype(a) is not None for a in operands)):  # fmt: skip
        out = []
        for a in operands:  # a device's all-reduce over every rank: gloo's
            raw = torch.from_numpy(np.array(a, copy=True).reshape(-1).view(np.uint8))
            t = raw.view(_torch_dtype(a))
            dist.all_reduce(t, op=getattr(dist.ReduceOp, _GLOO_OPS[c.reduce]))
            out.append(raw.numpy().view(a.dtype).reshape(a.shape))
        return out
    # any other collective: every rank's operands to every rank (one all_gather of their bytes), then the op's
    # semantics on this rank's group
    flat = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in operands]
    mine = torch.from_numpy(np.concatenate(flat) if flat else np.zeros(0, np.uint8))
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    inputs = []
    for g in gathered:
        raw, start, arrays = g.numpy(), 0, []
        for a, f in zip(operands, flat):
            arrays.append(raw[start : start + f.size].view(a.dtype).reshape(a.shape))
            start += f.size
        inputs.append(arrays)
    return semantics(c, rank, world, inputs)
