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
import os
import sys
import threading
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import NeuronCompileError, NeuronUnsupportedOpError, NeuronWarning, UnsupportedNode
from ..stats import STATS
from . import context
from . import storage as mem

log = logging.getLogger(__name__)

_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


class NeuronEagerFallbackWarning(NeuronWarning):
    """An eager op ran on the host (option ``eager_fallback="cpu"``): its inputs crossed to the host and back."""

    once_per_process = True


@dataclass
class _OpGraph:
    """A compiled one-op graph and how to read its outputs back into the op's results."""

    graph: Callable[[list[Any]], list[Any]]
    #: how many outputs are the op's own (the rest are the new values of the written arguments, in order)
    num_results: int


_GRAPHS: dict[Any, _OpGraph | NeuronUnsupportedOpError] = {}
_GRAPHS_LOCK = threading.Lock()
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


def is_view_op(op: torch._ops.OpOverload) -> bool:
    """Whether ``op`` returns a view of an argument without writing it (``Tensor(a)`` returns)."""
    returns = op._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def run_view(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """A view op: the result's geometry from the op's meta kernel, over the same storage."""
    flat, spec = tree_flatten((args, kwargs))
    metas = []
    storage = None
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor) and x.device.type == "neuron":
            if storage is None:
                storage = x.untyped_storage()
            flat[i] = _meta_twin(x)
            metas.append(flat[i])
    margs, mkwargs = tree_unflatten(flat, spec)
    out = op(*margs, **mkwargs)
    out_flat, out_spec = tree_flatten(out)
    results = [
        mem.make_tensor(o.shape, o.stride(), o.storage_offset(), o.dtype, storage) if isinstance(o, torch.Tensor) else o
        for o in out_flat
    ]
    return tree_unflatten(results, out_spec)


def _meta_twin(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with ``t``'s geometry over a meta storage of the same size."""
    nbytes = mem.device_storage(t).nbytes
    storage = torch.empty(nbytes, dtype=torch.uint8, device="meta").untyped_storage()
    return torch.empty(0, dtype=t.dtype, device="meta").set_(storage, t.storage_offset(), t.shape, t.stride())


def run(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """Run ``op`` on neuron tensors as a one-op graph (compiled at the first call of its key)."""
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    for i in positions:
        x = flat[i]
        if x.device.type != "neuron":
            if x.dim() == 0 and x.device.type == "cpu":
                flat[i] = context.upload(x, _index_of(flat, positions))  # a CPU scalar, as CUDA takes one
            else:
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but found at least two devices, neuron:0 and "
                    f"{x.device}! (when checking argument for {op})"
                )
    written = written_arguments(op, args, kwargs)
    written_ids = {id(t) for t in written}
    written_positions = [i for i in positions if id(tree_flatten((args, kwargs))[0][i]) in written_ids]
    key = (
        op,
        spec,
        tuple(_describe(flat[i]) if i in positions else _describe_scalar(flat[i]) for i in range(len(flat))),
    )
    entry = _GRAPHS.get(key)
    if entry is None:
        entry = _build(key, op, flat, spec, positions, written_positions)
    if isinstance(entry, NeuronUnsupportedOpError):  # refused before: refused again without tracing
        raise entry
    STATS.eager_ops_run += 1
    inputs = [flat[i] for i in positions]
    outputs = list(entry.graph(list(inputs)))
    results, new_values = outputs[: entry.num_results], outputs[entry.num_results :]
    originals = tree_flatten((args, kwargs))[0]
    for pos, value in zip(written_positions, new_values):
        target = originals[pos]
        if tuple(value.shape) != tuple(target.shape):
            _resize(target, value.shape)
        context.set_values(target, value)
    return _results(op, args, kwargs, results)


def _describe_scalar(value: Any) -> Any:
    return _describe(value)


def _index_of(flat: list[Any], positions: list[int]) -> int:
    for i in positions:
        if flat[i].device.type == "neuron":
            return flat[i].device.index or 0
    return 0


def _results(op: torch._ops.OpOverload, args: tuple, kwargs: dict, results: list[Any]) -> Any:
    """The op's return value: the written argument itself for ``Tensor(a!)`` returns, else new tensors."""
    returns = op._schema.returns
    out: list[Any] = []
    fresh = iter(results)
    by_alias = {}
    for i, arg in enumerate(op._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            for alias in arg.alias_info.before_set:
                by_alias[alias] = value
    for r in returns:
        if r.alias_info is not None and r.alias_info.is_write:
            alias = next(iter(r.alias_info.before_set))
            out.append(by_alias[alias])
            next(fresh, None)
        else:
            out.append(next(fresh))
    if len(returns) == 0:
        return None
    if len(returns) == 1:
        return out[0]
    return tuple(out)


def _resize(t: torch.Tensor, shape: torch.Size) -> None:
    torch.ops.aten.resize_.default(t, list(shape))


def _build(
    key: Any,
    op: torch._ops.OpOverload,
    flat: list[Any],
    spec: Any,
    positions: list[int],
    written_positions: list[int],
) -> _OpGraph:
    with _GRAPHS_LOCK:
        entry = _GRAPHS.get(key)
        if entry is not None:
            return entry
        where = user_line()
        num_results = len([r for r in op._schema.returns])

        def one_op(*tensors: torch.Tensor) -> Any:
            fl = list(flat)
            for pos, t in zip(positions, tensors):
                fl[pos] = t.clone() if pos in written_positions else t
            a, k = tree_unflatten(fl, spec)
            out = op(*a, **k)
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            return (*outs, *[fl[p] for p in written_positions])

        examples = [_example(flat[i]) for i in positions]
        try:
            gm = _trace(one_op, examples)
        except Exception as e:  # what cannot be traced with shapes alone (data-dependent output sizes)
            _GRAPHS[key] = refusal = _unsupported(op, flat, positions, where, f"cannot be traced: {e}")
            raise refusal from e
        num_results = _count_results(op)
        try:
            graph = _compile(gm, examples, op)
        except NeuronUnsupportedOpError as e:
            _GRAPHS[key] = refusal = _unsupported(op, flat, positions, where, _reasons(e))
            raise refusal from e
        entry = _OpGraph(graph, num_results)
        _GRAPHS[key] = entry
        STATS.eager_ops_compiled += 1
        return entry


def _count_results(op: torch._ops.OpOverload) -> int:
    n = 0
    for r in op._schema.returns:
        n += 1
    return n


def _example(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """What a one-op graph's input is traced as: its shape and dtype (made into a tensor by ``_trace``)."""
    return tuple(int(s) for s in t.shape), t.dtype


def _outside_any_trace() -> Any:
    """A context free of whatever traces the caller (Dynamo runs an optimizer's ``_init_group`` on real
    tensors under its own fake mode): a one-op graph is traced and compiled on its own, with static shapes."""
    import contextlib

    from torch._guards import tracing
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    stack = contextlib.ExitStack()
    stack.enter_context(tracing(None))
    stack.enter_context(unset_fake_temporarily())
    return stack


def _trace(fn: Callable[..., Any], examples: list[tuple[tuple[int, ...], torch.dtype]]) -> torch.fx.GraphModule:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from ..decompositions import decomposition_table

    with _outside_any_trace():
        mode = FakeTensorMode()  # static shapes: no ShapeEnv
        with mode:
            fakes = [torch.empty(shape, dtype=dtype) for shape, dtype in examples]
            return make_fx(torch.func.functionalize(fn, remove="mutations_and_views"), decomposition_table())(*fakes)


def _compile(gm: torch.fx.GraphModule, examples: list[Any], op: Any) -> Callable[[list[Any]], list[Any]]:
    from ..compiler import compile_graph

    fakes = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    name = f"eager_{str(op).replace('.', '_')}"
    with _outside_any_trace():
        return compile_graph(gm, fakes, opts=context.device().opts, kind="inference", name=name)


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


def user_line() -> str:
    """``file:line`` of the innermost caller outside torch and this package (the user's code)."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path.startswith(_DIR) or path.startswith(_TORCH_DIR) or "<frozen" in path:
            continue
        return f"{frame.filename}:{frame.lineno}"
    return "<unknown source line>"


def run_or_fall_back(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """``run``, or on an op the device cannot compile, the host (option ``eager_fallback="cpu"``)."""
    if printing():
        return _on_host(op, args, kwargs, warn=False)
    try:
        return run(op, args, kwargs)
    except NeuronUnsupportedOpError:
        if context.device().opts.eager_fallback != "cpu":
            raise
    return _on_host(op, args, kwargs)


_TENSOR_STR = os.path.join("torch", "_tensor_str.py")


def printing(depth: int = 16) -> bool:
    """Whether torch is formatting a tensor for print/repr (``torch/_tensor_str.py`` is a caller): the values go
    to the host anyway, and the formatter works in float64 and with data-dependent shapes, which the device
    has not, so its ops run on the host, silently."""
    frame = sys._getframe(2)
    while frame is not None and depth:
        if frame.f_code.co_filename.endswith(_TENSOR_STR):
            return True
        frame = frame.f_back
        depth -= 1
    return False


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


# -- gathers and scatters: views read and written on the device ------------------------------------------------
def _flat_of(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``t`` as a 1-d tensor of ``t``'s dtype (a view)."""
    st = mem.device_storage(t)
    n = st.nbytes // t.element_size()
    return mem.make_tensor((n,), (1,), 0, t.dtype, t.untyped_storage())


def gather(t: torch.Tensor, force: bool = False) -> torch.Tensor:
    """A new dense neuron tensor with ``t``'s values, computed on the device from ``t``'s storage."""
    flat = _flat_of(t)
    size, stride, offset = tuple(t.shape), tuple(t.stride()), t.storage_offset()
    key = ("gather", tuple(flat.shape), t.dtype, size, stride, offset)
    entry = _GRAPHS.get(key)
    if entry is None:
        with _GRAPHS_LOCK:

            def fn(base: torch.Tensor) -> tuple[torch.Tensor]:
                return (torch.as_strided(base, size, stride, offset).clone(),)

            examples = [_example(flat)]
            graph = _compile(_trace(fn, examples), examples, "gather")
            entry = _GRAPHS.setdefault(key, _OpGraph(graph, 1))
            STATS.eager_ops_compiled += 1
    return entry.graph([flat])[0]


def scatter(dst: torch.Tensor, value: torch.Tensor) -> mem.DeviceBuffer:
    """The buffer of ``dst``'s storage with ``dst``'s elements replaced by ``value``'s, made on the device."""
    flat = _flat_of(dst)
    size, stride, offset = tuple(dst.shape), tuple(dst.stride()), dst.storage_offset()
    key = ("scatter", tuple(flat.shape), dst.dtype, size, stride, offset)
    entry = _GRAPHS.get(key)
    if entry is None:
        with _GRAPHS_LOCK:

            def fn(base: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor]:
                return (torch.as_strided_scatter(base, src, size, stride, offset),)

            examples = [_example(flat), (size, dst.dtype)]
            graph = _compile(_trace(fn, examples), examples, "scatter")
            entry = _GRAPHS.setdefault(key, _OpGraph(graph, 1))
            STATS.eager_ops_compiled += 1
    new_flat = entry.graph([flat, value])[0]
    return mem.device_storage(new_flat).buffer
