"""Eager ops on the ``neuron`` device: each op runs as a one-op graph, lowered and compiled like any graph.

An op call is keyed by the op and its arguments (tensors by shape and dtype, everything else by value); the
first call with a key traces the op with fake tensors (``make_fx`` over ``functionalize``, our decomposition
table), compiles it through the compiler (so the graph lands in the compile cache: a second process compiles
none), and keeps it in an in-memory table, so a later call costs a dictionary lookup and the execution.
In-place and ``out=`` ops are traced on clones of what they write, so every graph is functional; the
results are then written into the arguments (``context.set_values``: a new buffer for the storage).

View ops (``view``, ``transpose``, slicing, ``as_strided``, ...) run nothing: their result is a tensor over the
same storage, its geometry computed by the op's meta kernel.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..errors import NeuronCompileError, NeuronUnsupportedOpError, NeuronWarning, UnsupportedNode
from ..stats import STATS
from . import context, graphs, lazy, onegraph, operands
from . import storage as mem
from .onegraph import user_line

log = logging.getLogger(__name__)


class NeuronEagerFallbackWarning(NeuronWarning):
    """An eager op ran on the host (option ``eager_fallback="cpu"``): its inputs crossed to the host and back."""

    once_per_process = True


_FALLEN_BACK: set[str] = set()


def _hashable(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, float) and value != value:
        return ("nan",)
    return value


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)
    if isinstance(value, torch.Generator):  # where the seed comes from, not what the graph is
        return ("generator",)
    return (type(value).__name__, _hashable(value))


def written_arguments(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``op`` writes (``Tensor(a!)`` in its schema: ``self`` of in-place ops, ``out=``)."""
    written: list[torch.Tensor] = []
    for i, arg in enumerate(op._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        for leaf in tree_flatten(value)[0]:
            if isinstance(leaf, torch.Tensor):
                written.append(leaf)
    return written


_WRITTEN = object()


def written_positions(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[int]:
    """Where the tensors ``op`` writes are in ``tree_flatten((args, kwargs))``: by argument, not by identity (in
    ``x.add_(x)`` or ``torch._foreach_mul_(xs, xs)`` a written tensor is also read)."""
    args, kwargs = list(args), dict(kwargs)
    for i, arg in enumerate(op._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        if i < len(args) and not arg.kwarg_only:
            args[i] = tree_map(lambda x: _WRITTEN if isinstance(x, torch.Tensor) else x, args[i])
        elif arg.name in kwargs:
            kwargs[arg.name] = tree_map(lambda x: _WRITTEN if isinstance(x, torch.Tensor) else x, kwargs[arg.name])
    return [i for i, x in enumerate(tree_flatten((tuple(args), kwargs))[0]) if x is _WRITTEN]


def is_view_op(op: torch._ops.OpOverload) -> bool:
    """Whether ``op`` returns a view of an argument without writing it (``Tensor(a)`` returns)."""
    returns = op._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def run_view(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """A view op: the result's geometry from the op's meta kernel, over the same storage."""
    flat, spec = tree_flatten((args, kwargs))
    metas = []
    storage = base = None
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor) and x.device.type == "neuron":
            if storage is None:
                storage, base = x.untyped_storage(), x
            flat[i] = _meta_twin(x)
            metas.append(flat[i])
    margs, mkwargs = tree_unflatten(flat, spec)
    out = op(*margs, **mkwargs)
    out_flat, out_spec = tree_flatten(out)
    # A view is an inference tensor exactly when its base is (torch then shares the base's version counter with
    # it, which an inference tensor made under inference_mode() refuses).
    with torch.inference_mode(base.is_inference()):
        results = [
            mem.make_tensor(o.shape, o.stride(), o.storage_offset(), o.dtype, storage)
            if isinstance(o, torch.Tensor)
            else o
            for o in out_flat
        ]
    return tree_unflatten(results, out_spec)


def _meta_twin(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with ``t``'s geometry over a meta storage of the same size."""
    nbytes = mem.device_storage(t).nbytes
    storage = torch.empty(nbytes, dtype=torch.uint8, device="meta").untyped_storage()
    return torch.empty(0, dtype=t.dtype, device="meta").set_(storage, t.storage_offset(), t.shape, t.stride())


#: A one-op graph key whose numbers could not become inputs (``operands.py``): such calls are keyed by value.
_BY_VALUE = "by value"


def _entry(table: dict[Any, Any], key: Any, value_key: Any, make: Any) -> Any:
    """``table``'s entry for ``key`` (its numbers as inputs), made by ``make(key, True)`` at its first use; where
    they cannot be inputs, the entry for ``value_key()`` (the numbers in the key), made by ``make(k, False)``."""
    entry = table.get(key)
    if entry is None:
        entry = make(key, True)
    if entry is _BY_VALUE:
        key = value_key()
        entry = table.get(key)
        if entry is None:
            entry = make(key, False)
    return entry


def run(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """Run ``op`` on neuron tensors as a one-op graph (compiled at the first call of its key; the numbers it is
    given are inputs of the graph where that means the same, ``operands.py``, else part of the key)."""
    op = operands.as_scalar_overload(op, args, kwargs)
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    index = _index_of(flat, positions)
    originals = list(flat)
    for i in positions:
        x = flat[i]
        if x.device.type != "neuron":
            if x.dim() == 0 and x.device.type == "cpu":
                flat[i] = context.upload(x, index)  # a CPU scalar, as CUDA takes one
            else:
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but found at least two devices, neuron:0 and "
                    f"{x.device}! (when checking argument for {op})"
                )
    written = written_positions(op, args, kwargs)
    values = operands.value_positions(op, args, kwargs)
    target_name = context.device().target.name
    key = (
        target_name,
        op,
        spec,
        tuple(operands.key_of(x) if i in values else _describe(x) for i, x in enumerate(flat)),
    )
    generator = next((x for x in flat if isinstance(x, torch.Generator)), None)
    if context.device().opts.eager_mode == "lazy" and generator is None:
        recorded = _record(key, op, flat, spec, positions, written, values, originals, index, target_name)
        if recorded is not None:
            results, layout = recorded
            return _results(op, args, kwargs, results, layout)
    entry = _entry(
        onegraph.GRAPHS,
        key,
        lambda: (target_name, op, spec, tuple(_describe(x) for x in flat)),
        lambda k, lift: _build(k, op, flat, spec, positions, written, values if lift else []),
    )
    if isinstance(entry, NeuronUnsupportedOpError):  # refused before: refused again without tracing
        raise entry
    STATS.eager_ops_run += 1
    inputs = [flat[i] for i in positions]
    if entry.operands is not None:
        inputs += _operand_vectors(entry, flat, index)
    with graphs.seeds_from(generator):
        outputs = list(entry.graph(inputs))
    results, new_values = outputs[: entry.num_results], outputs[entry.num_results :]
    for pos, value in zip(written, new_values):
        target = originals[pos]
        if tuple(value.shape) != tuple(target.shape):
            _resize(target, value.shape)
        context.set_values(target, value)
    return _results(op, args, kwargs, results, entry.layout)


@dataclass
class TracedOp:
    """An eager op traced for the lazy mode (``lazy.py``): its functional one-op graph (its numbers at ``slots``
    as inputs, after the tensors, as in ``OpGraph``), and each output's (shape, dtype): the op's results
    (``num_results``, per ``layout``), then the new values of the arguments it writes."""

    gm: torch.fx.GraphModule
    num_results: int
    layout: list[int]
    slots: list[Any]
    outputs: list[tuple[tuple[int, ...], torch.dtype]]
    #: A small number standing for the op's key in a recording's key.
    uid: int


#: Eager ops traced (and checked to lower) for the lazy mode, by the op mode's key: a TracedOp, a refusal, or
#: ``_BY_VALUE``.
TRACED: dict[Any, Any] = {}


def _record(
    key: Any,
    op: torch._ops.OpOverload,
    flat: list[Any],
    spec: Any,
    positions: list[int],
    written: list[int],
    values: list[int],
    originals: list[Any],
    index: int,
    target_name: str,
) -> tuple[list[torch.Tensor], list[int]] | None:
    """The op recorded in the lazy mode: (its results, their layout), or None when it runs in the op mode."""
    traced = _entry(
        TRACED,
        key,
        lambda: (target_name, op, spec, tuple(_describe(x) for x in flat)),
        lambda k, lift: _trace_for_lazy(k, op, flat, spec, positions, written, values if lift else []),
    )
    if isinstance(traced, NeuronUnsupportedOpError):  # refused before: refused again without tracing
        raise traced
    if not isinstance(traced, TracedOp):
        return None
    results = lazy.record_op(traced, flat, positions, written, originals, index, user_line())
    if results is None:
        return None
    STATS.eager_ops_run += 1
    return results, traced.layout


def _trace_for_lazy(
    key: Any,
    op: torch._ops.OpOverload,
    flat: list[Any],
    spec: Any,
    positions: list[int],
    written: list[int],
    values: list[int],
) -> TracedOp | NeuronUnsupportedOpError | str:
    """Trace the op as ``_build`` does and lower it (no compile: its recording compiles), so that an op the
    device refuses raises now, at the user's line, as in the op mode."""

    def traced(gm: torch.fx.GraphModule, lifted: operands.Lifted | None, layout: list[int]) -> TracedOp:
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        outputs = [(tuple(int(s) for s in v.meta["val"].shape), v.meta["val"].dtype) for v in out_node.args[0]]
        num_results = sum(1 if n < 0 else n for n in layout)
        slots = list(lifted.slots) if lifted is not None else []
        return TracedOp(gm, num_results, list(layout), slots, outputs, len(TRACED))

    def check(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        onegraph.check_lowers(gm, op, context.device().opts)
        return gm

    return _one_op_graph(TRACED, key, op, flat, spec, positions, written, values, check, traced)


def _tracer(
    op: torch._ops.OpOverload, spec: Any, positions: list[int], written_positions: list[int], layout: list[int]
) -> Any:
    """``trace(flat)``: the functional one-op graph of ``op`` on ``flat``'s tensors, its results then the new values
    of what it writes (``layout`` filled: per fresh return, -1 for one tensor or the length of a list)."""
    fresh_returns = len(_fresh_returns(op))

    def trace(flat: list[Any]) -> torch.fx.GraphModule:
        def one_op(*tensors: torch.Tensor) -> Any:
            fl = list(flat)
            for pos, t in zip(positions, tensors):
                fl[pos] = t.clone() if pos in written_positions else t
            a, k = tree_unflatten(fl, spec)
            out = op(*a, **k)
            per_return = [] if not op._schema.returns else list(out) if len(op._schema.returns) > 1 else [out]
            results: list[torch.Tensor] = []
            layout.clear()
            for r, value in zip(op._schema.returns, per_return):
                if r.alias_info is not None and r.alias_info.is_write:
                    continue
                if isinstance(value, (list, tuple)):
                    layout.append(len(value))
                    results.extend(value)
                else:
                    layout.append(-1)
                    results.append(value)
            assert len(layout) == fresh_returns
            return (*results, *[fl[p] for p in written_positions])

        return onegraph.trace(one_op, [onegraph.example(flat[i]) for i in positions])

    return trace


def _operand_vectors(entry: onegraph.OpGraph, flat: list[Any], index: int) -> list[torch.Tensor]:
    """This call's numbers on the device (``context.number_vectors``: uploaded only when new)."""
    floats, ints = entry.operands.numbers(flat)
    return context.number_vectors(floats, ints, index)


def _index_of(flat: list[Any], positions: list[int]) -> int:
    for i in positions:
        if flat[i].device.type == "neuron":
            return flat[i].device.index or 0
    return context.current_index()


def _fresh_returns(op: torch._ops.OpOverload) -> list[Any]:
    """The returns of ``op`` that are new tensors (not the written argument an in-place or out= op returns)."""
    return [r for r in op._schema.returns if r.alias_info is None or not r.alias_info.is_write]


def _results(op: torch._ops.OpOverload, args: tuple, kwargs: dict, results: list[Any], layout: list[int]) -> Any:
    """The op's return value: the written argument itself for ``Tensor(a!)`` returns, else the graph's results
    (``layout``: per fresh return, -1 for one tensor or the length of a list of them)."""
    by_alias = {}
    for i, arg in enumerate(op._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            for alias in arg.alias_info.before_set:
                by_alias[alias] = value
    fresh = iter(layout)
    cursor = 0
    out: list[Any] = []
    for r in op._schema.returns:
        if r.alias_info is not None and r.alias_info.is_write:
            out.append(by_alias[next(iter(r.alias_info.before_set))])
            continue
        n = next(fresh)
        if n < 0:
            out.append(results[cursor])
            cursor += 1
        else:
            out.append(list(results[cursor : cursor + n]))
            cursor += n
    if not out:
        return None
    return out[0] if len(out) == 1 else tuple(out)


def _resize(t: torch.Tensor, shape: torch.Size) -> None:
    torch.ops.aten.resize_.default(t, list(shape))


def _build(
    key: Any,
    op: torch._ops.OpOverload,
    flat: list[Any],
    spec: Any,
    positions: list[int],
    written_positions: list[int],
    values: list[int],
) -> onegraph.OpGraph | NeuronUnsupportedOpError | str:
    """Trace and compile the one-op graph of ``key`` (with the numbers at ``values`` as inputs: ``_BY_VALUE``
    when they cannot be, see ``operands.py``)."""

    def entry(graph: Any, lifted: operands.Lifted | None, layout: list[int]) -> onegraph.OpGraph:
        STATS.eager_ops_compiled += 1
        return onegraph.OpGraph(graph, sum(1 if n < 0 else n for n in layout), list(layout), lifted)

    def compile_it(gm: torch.fx.GraphModule) -> Any:
        return onegraph.compile_one(gm, op, context.device().opts)

    return _one_op_graph(onegraph.GRAPHS, key, op, flat, spec, positions, written_positions, values, compile_it, entry)


def _one_op_graph(
    table: dict[Any, Any],
    key: Any,
    op: torch._ops.OpOverload,
    flat: list[Any],
    spec: Any,
    positions: list[int],
    written: list[int],
    values: list[int],
    finish: Any,
    make: Any,
) -> Any:
    """``table[key]``, made at its first use: the op traced (its numbers at ``values`` lifted to inputs, else
    ``_BY_VALUE``), ``finish(gm)`` (compiled, or checked to lower and returned), and ``make(finished, lifted,
    layout)`` kept; what the device refuses is kept as the refusal, naming the user's line."""
    with onegraph.GRAPHS_LOCK:
        found = table.get(key)
        if found is not None:
            return found
        where = user_line()
        layout: list[int] = []
        trace = _tracer(op, spec, positions, written, layout)
        lifted = None
        if values:
            lifted = operands.lift(trace, flat, values)
            if lifted is None:
                table[key] = _BY_VALUE
                return _BY_VALUE
            gm = lifted.gm
        else:
            try:
                gm = trace(flat)
            except Exception as e:  # what cannot be traced with shapes alone (data-dependent output sizes)
                table[key] = refusal = _unsupported(op, flat, positions, where, f"cannot be traced: {e}")
                raise refusal from e
        try:
            finished = finish(gm)
        except Exception as e:
            if lifted is not None:  # a lowering that needs the number itself: keyed by value instead
                log.debug("eager %s: its numbers stay in the key (%s)", op, e)
                table[key] = _BY_VALUE
                return _BY_VALUE
            if not isinstance(e, NeuronUnsupportedOpError):
                raise
            table[key] = refusal = _unsupported(op, flat, positions, where, _reasons(e))
            raise refusal from e
        table[key] = made = make(finished, lifted, layout)
        return made


def _reasons(e: NeuronUnsupportedOpError) -> str:
    return "; ".join(f"{n.op}: {n.reason}" for n in e.nodes) or str(e)


def _unsupported(op: Any, flat: list[Any], positions: list[int], where: str, reason: str) -> NeuronUnsupportedOpError:
    inputs = ", ".join(f"{str(flat[i].dtype).removeprefix('torch.')}{list(flat[i].shape)}" for i in positions)
    return NeuronUnsupportedOpError(
        f"eager {op}",
        [UnsupportedNode(op=str(op), inputs=inputs, source=where, reason=reason)],
        hint=(
            "This op ran eagerly on a tensor of the neuron device, which runs every op as a compiled graph. "
            "Compile the code around it (torch.compile(..., backend='neuron')), move this computation to CPU "
            "(.cpu()), or set options eager_fallback='cpu' (NEURON_COMPILE_EAGER_FALLBACK=cpu) to run such ops "
            "on the host, with their inputs copied there and back."
        ),
    )


def run_or_fall_back(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """``run``, or on an op the device cannot compile, the host (option ``eager_fallback="cpu"``)."""
    if onegraph.printing():
        return _on_host(op, args, kwargs, warn=False)
    try:
        return run(op, args, kwargs)
    except NeuronUnsupportedOpError:
        if context.device().opts.eager_fallback != "cpu":
            raise
    return _on_host(op, args, kwargs)


def _on_host(op: torch._ops.OpOverload, args: tuple, kwargs: dict, warn: bool = True) -> Any:
    name = str(op)
    if warn and name not in _FALLEN_BACK:
        _FALLEN_BACK.add(name)
        warnings.warn(
            f"neuron device: {name} cannot be compiled for the device, so it runs on the host (eager_fallback="
            f"'cpu'): its inputs are copied to the host and its results back, at every call ({user_line()})",
            NeuronEagerFallbackWarning,
            stacklevel=3,
        )
    STATS.eager_ops_fallback += 1
    flat, spec = tree_flatten((args, kwargs))
    index = 0
    host = list(flat)
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor) and x.device.type == "neuron":
            index = x.device.index or 0
            host[i] = context.download(x).clone()
    hargs, hkwargs = tree_unflatten(host, spec)
    out = op(*hargs, **hkwargs)
    written = written_arguments(op, hargs, hkwargs)
    for original, copy in zip(flat, host):
        if copy is not original and any(copy is w for w in written):
            if tuple(copy.shape) != tuple(original.shape):
                _resize(original, copy.shape)
            context.set_values(original, context.upload(copy, index))
    out_flat, out_spec = tree_flatten(out)
    mapped = [
        _original_of(o, flat, host)
        if any(o is h for h in host)
        else context.upload(o, index)
        if isinstance(o, torch.Tensor)
        else o
        for o in out_flat
    ]
    return tree_unflatten(mapped, out_spec)


def _original_of(copy: torch.Tensor, flat: list[Any], host: list[Any]) -> torch.Tensor:
    for original, h in zip(flat, host):
        if h is copy:
            return original
    raise NeuronCompileError("neuron device: an op's written result is none of its arguments")
