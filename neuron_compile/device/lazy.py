"""The lazy eager mode of the ``neuron`` device (option ``eager_mode="lazy"``): eager ops recorded, run as ONE graph.

In the default mode (``"op"``) every eager op runs at once as its own one-op graph (``eager.py``): an uncompiled
training step runs dozens of executables, and its first step compiles dozens of graphs. In the lazy mode an
eager op is still traced when it is called (with fake tensors: its result shapes and dtypes are known, and an
op the device refuses raises then, at the user's line), but it only records itself here: its results are
tensors whose storages hold a :class:`storage.Pending` value. The recorded ops run as one graph at the next
synchronization (:func:`flush`): a read of a pending storage's bytes (``storage.buffer_of``: a read to the host,
a compiled graph binding it, ``torch.neuron.synchronize()``), or :data:`MAX_OPS` recorded ops.

The graph is keyed by the recording's structure: per op its one-op key (op, shapes, dtypes, structural
arguments; its numbers by value or as inputs, as ``operands.py`` decided for the op alone), which recorded
value or input feeds which argument and through which view, and which values are still held by a live storage
(the graph's outputs). Its inputs are the device buffers the ops read (each once), and two vectors holding the
recorded numbers. A training step records the same sequence at every step, so from its second or third step
on, a step compiles nothing and runs one executable.

Every recorded value is the whole content of a storage, as a flat tensor (a result's storage is the result;
a write makes a new value for the written storage: the op's new value itself when it writes the whole storage,
else a scatter of it into the storage's value), and every read is a view of such a flat value (its geometry:
the reading tensor's size, stride and offset), so views, writes through views and copy-on-write sharing work
as in the op mode.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from typing import Any

import torch

from ..errors import NeuronCompileError
from ..stats import STATS
from . import context, onegraph
from . import storage as mem

log = logging.getLogger(__name__)

#: A recording runs when it has this many ops (a loop that never reads a value still runs, in bounded graphs).
MAX_OPS = 512

#: Compiled recordings by structure.
GRAPHS: dict[Any, Any] = {}
_LOCAL = threading.local()


def enabled() -> bool:
    return context.device().opts.eager_mode == "lazy"


class _Input:
    __slots__ = ("buffer", "dtype", "numel")

    def __init__(self, buffer: mem.DeviceBuffer, dtype: torch.dtype, numel: int) -> None:
        self.buffer, self.dtype, self.numel = buffer, dtype, numel


class Recording:
    """Ops recorded since the last flush, on device ``index``.

    An expression (how a recorded op reads a tensor) is ``(ref, size, mode)``: ``ref`` a value number (>= 0) or
    an input (``-1 - i``); ``mode`` ``("w",)`` the whole flat value, ``("r", offset)`` a row-major run of it,
    ``("s", stride, offset)`` any other view."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.inputs: list[_Input] = []
        self._input_ids: dict[tuple[int, torch.dtype], int] = {}
        self.values: list[tuple[torch.dtype, int]] = []
        self.pending: list[mem.Pending] = []
        #: runtime form of each step, and its structural form (the key)
        self.steps: list[tuple] = []
        self.structure: list[tuple] = []
        self.wheres: list[str] = []
        self.holders: list[tuple[weakref.ref, mem.Pending]] = []
        self.floats: list[float] = []
        self.ints: list[int] = []
        self.ops = 0
        self.error: BaseException | None = None

    # -- values ----------------------------------------------------------------------------------------------
    def hold(self, st: mem.DeviceStorage, value: mem.Pending) -> None:
        """``st`` now holds ``value`` (``DeviceStorage.buffer``'s setter): an output of the graph while it lives."""
        self.holders.append((weakref.ref(st), value))

    def new_value(self, dtype: torch.dtype, numel: int) -> int:
        self.values.append((dtype, numel))
        self.pending.append(mem.Pending(self, len(self.values) - 1, dtype, numel))
        return len(self.values) - 1

    def input(self, buffer: mem.DeviceBuffer, dtype: torch.dtype, numel: int) -> int:
        key = (id(buffer), dtype)
        i = self._input_ids.get(key)
        if i is None:
            i = self._input_ids[key] = len(self.inputs)
            self.inputs.append(_Input(buffer, dtype, numel))
        return -1 - i

    def numel_of(self, ref: int) -> int:
        return self.values[ref][1] if ref >= 0 else self.inputs[-1 - ref].numel

    def expr_of(self, x: torch.Tensor) -> tuple | None:
        """How a recorded op reads tensor ``x`` (a view of its storage's current value), or None when it cannot
        be recorded as it is (its storage holds a value of another recording or of another dtype: flush first;
        no buffer at all)."""
        st = mem.device_storage(x)
        found = mem.raw_buffer(st)
        itemsize = x.element_size()
        if isinstance(found, mem.Pending):
            if found.recording is not self or found.dtype != x.dtype:
                return None
            ref, numel = found.number, found.numel
        elif found is None or st.nbytes % itemsize:
            return None
        else:
            numel = st.nbytes // itemsize
            ref = self.input(found, x.dtype, numel)
        size = tuple(x.shape)
        offset = x.storage_offset()
        if x.is_contiguous():
            mode = ("w",) if offset == 0 and x.numel() == numel else ("r", offset)
        else:
            mode = ("s", tuple(x.stride()), offset)
        return (ref, size, mode)

    # -- steps -----------------------------------------------------------------------------------------------
    def add_step(self, runtime: tuple, structure: tuple, where: str) -> None:
        self.steps.append(runtime)
        self.structure.append(structure)
        self.wheres.append(where)

    def write(self, dst: torch.Tensor, expr: tuple, where: str) -> None:
        """Record ``dst``'s values replaced by those of ``expr`` (dst's shape and dtype)."""
        st = mem.device_storage(dst)
        ref, _, mode = expr
        if mem.is_whole(dst):
            if mode == ("w",):
                if ref >= 0:
                    st.buffer = self.pending[ref]
                else:
                    st.buffer = self.inputs[-1 - ref].buffer  # buffers are never written: sharing one is a copy
                return
            out = self.new_value(dst.dtype, dst.numel())
            self.add_step(("dense", expr, out), ("dense", expr, out), where)
            st.buffer = self.pending[out]
            return
        base = self.expr_of(dst)
        assert base is not None  # checked by the caller (``ready``)
        geometry = (tuple(dst.shape), tuple(dst.stride()), dst.storage_offset())
        out = self.new_value(dst.dtype, self.numel_of(base[0]))
        self.add_step(("scatter", base[0], expr, geometry, out), ("scatter", base[0], expr, geometry, out), where)
        st.buffer = self.pending[out]


def current(index: int) -> Recording:
    """The recording of device ``index`` (a recording of another device is run first)."""
    rec = _STATE.recording
    if rec is not None and rec.index != index:
        flush()
        rec = None
    if rec is None:
        rec = _STATE.recording = Recording(index)
    return rec


class _State:
    recording: Recording | None = None


_STATE = _State()


def ready(tensors: list[torch.Tensor], index: int) -> Recording | None:
    """The recording that can read every tensor of ``tensors`` (flushing first where one holds a value it
    cannot read as recorded), or None when some cannot be recorded at all (the op then runs in the op mode)."""
    rec = current(index)
    if all(rec.expr_of(t) is not None for t in tensors):
        return rec
    flush()
    rec = current(index)
    if all(rec.expr_of(t) is not None for t in tensors):
        return rec
    return None


# -- what eager.py and context.py call ----------------------------------------------------------------------------
def record_op(
    traced: Any, flat: list[Any], positions: list[int], written: list[int], originals: list[Any], index: int, where: str
) -> list[torch.Tensor] | None:
    """Record one eager op (``traced``: its one-op graph, ``eager.TracedOp``); its results, tensors holding
    pending values, or None when it cannot be recorded (it then runs in the op mode)."""
    outs = traced.outputs
    for k, pos in enumerate(written):
        shape, dtype = outs[traced.num_results + k]
        target = originals[pos]
        if tuple(shape) != tuple(target.shape) or dtype != target.dtype:
            return None  # a write that resizes its target: the op mode's path
    if any(dtype in (torch.float64, torch.complex64, torch.complex128) for _, dtype in outs):
        return None
    readers = [flat[i] for i in positions] + [originals[p] for p in written]
    rec = ready(readers, index)
    if rec is None:
        return None
    exprs = tuple(rec.expr_of(flat[i]) for i in positions)
    numbers = flat
    floats = [float(numbers[s.position]) for s in traced.slots if s.is_float]
    ints = [int(numbers[s.position]) for s in traced.slots if not s.is_float]
    fslice, islice = (len(rec.floats), len(floats)), (len(rec.ints), len(ints))
    rec.floats.extend(floats)
    rec.ints.extend(ints)
    numbers_out = []
    for shape, dtype in outs:
        numel = 1
        for s in shape:
            numel *= s
        numbers_out.append(rec.new_value(dtype, numel))
    numbers_out = tuple(numbers_out)
    rec.add_step(
        ("op", traced, exprs, fslice, islice, numbers_out),
        ("op", traced.uid, exprs, fslice, islice, numbers_out),
        where,
    )
    rec.ops += 1
    results = []
    for (shape, dtype), number in zip(outs[: traced.num_results], numbers_out):
        results.append(_pending_tensor(rec, number, shape, dtype, index))
    for k, pos in enumerate(written):
        target = originals[pos]
        number = numbers_out[traced.num_results + k]
        if target.numel():
            rec.write(target, (number, tuple(target.shape), ("w",)), where)
    if rec.ops >= MAX_OPS:
        flush()
    return results


def _pending_tensor(
    rec: Recording, number: int, shape: tuple[int, ...], dtype: torch.dtype, index: int
) -> torch.Tensor:
    numel = rec.values[number][1]
    if numel == 0:
        return context.empty(list(shape), None, dtype, index)
    storage = mem.new_storage(numel * dtype.itemsize, index, rec.pending[number])
    return mem.make_tensor(shape, torch._prims_common.make_contiguous_strides_for(shape), 0, dtype, storage)


def set_values(dst: torch.Tensor, value: torch.Tensor) -> bool:
    """``context.set_values`` recorded: False when it cannot be (the op mode's path then runs)."""
    if dst.numel() == 0:
        return False
    index = dst.device.index or 0
    rec = ready([value, dst], index)
    if rec is None:
        return False
    from .onegraph import user_line

    rec.write(dst, rec.expr_of(value), user_line())
    return True


def materialize(st: mem.DeviceStorage) -> None:
    """``storage.MATERIALIZE``: ``st`` holds a pending value; run what was recorded."""
    found = mem.raw_buffer(st)
    if isinstance(found, mem.Pending) and found.recording.error is not None:
        raise NeuronCompileError(
            "neuron device: this tensor's value was recorded by ops of the lazy eager mode whose graph failed"
        ) from found.recording.error
    flush()


mem.MATERIALIZE = materialize


def flush() -> None:
    """Run the recorded ops as one graph; every pending value still held by a live storage becomes its buffer."""
    with context.STREAM:
        rec = _STATE.recording
        _STATE.recording = None
        if rec is None or not rec.steps:
            return
        try:
            _run(rec)
        except BaseException as e:
            rec.error = e
            raise


def _run(rec: Recording) -> None:
    live: dict[int, list[mem.DeviceStorage]] = {}
    for ref, value in rec.holders:
        st = ref()
        if st is not None and mem.raw_buffer(st) is value:
            live.setdefault(value.number, []).append(st)
    rec.holders.clear()
    outputs = sorted(live)
    if not outputs:
        return
    dev = context.device()
    key = (
        dev.target.name,
        tuple((i.dtype, i.numel) for i in rec.inputs),
        tuple(rec.structure),
        len(rec.floats),
        len(rec.ints),
        tuple(outputs),
    )
    entry = GRAPHS.get(key)
    if entry is None:
        entry = _compile(rec, outputs, key)
    inputs = []
    for i in rec.inputs:
        storage = mem.new_storage(i.buffer.nbytes, rec.index, i.buffer)
        inputs.append(mem.make_tensor((i.numel,), (1,), 0, i.dtype, storage))
    inputs += _vectors(entry, rec)
    results = list(entry.graph(inputs))
    for number, out in zip(outputs, results):
        if not (mem.is_whole(out) and out.numel() == rec.values[number][1]):
            out = context.gather(out, force=True)
        buffer = mem.raw_buffer(mem.device_storage(out))
        for st in live[number]:
            st.buffer = buffer


def _vectors(entry: onegraph.OpGraph, rec: Recording) -> list[torch.Tensor]:
    """The recorded numbers' vectors on the device (uploaded only when they were not lately)."""
    return context.number_vectors(rec.floats, rec.ints, rec.index)


aten = torch.ops.aten


class _Builder:
    """The recording's graph, built node by node: each op's one-op graph inlined (its nodes copied, their fake
    values computed again in one fake mode), the reads and writes of views between them as functional aten
    ops. (Not traced again through torch: a lifted graph passes its numbers' elements where a schema takes a
    Scalar, which only the lowering accepts.)"""

    def __init__(self) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.graph = torch.fx.Graph()
        self.root = torch.nn.Module()
        self.constants = 0

    def placeholder(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.fx.Node:
        node = self.graph.placeholder(name)
        with self.mode:
            node.meta["val"] = torch.empty(shape, dtype=dtype)
        return node

    def emit(self, target: Any, args: tuple, kwargs: dict | None = None, meta: dict | None = None) -> torch.fx.Node:
        kwargs = kwargs or {}
        node = self.graph.call_function(target, args, kwargs)
        if meta:
            node.meta.update({k: v for k, v in meta.items() if k not in ("val", "tensor_meta")})
        node.meta["val"] = self._fake(target, args, kwargs)
        return node

    def _fake(self, target: Any, args: tuple, kwargs: dict) -> Any:
        def value(x: Any, arg: Any = None) -> Any:
            if isinstance(x, torch.fx.Node):
                v = x.meta["val"]
                if arg is not None and isinstance(v, torch.Tensor) and str(arg.type) in ("Scalar", "number"):
                    return 0.0 if v.dtype.is_floating_point else 0  # a lifted number: its value is not needed
                return v
            if isinstance(x, (list, tuple)):
                return type(x)(value(y) for y in x)
            return x

        schema = getattr(target, "_schema", None)
        if schema is not None:
            by_name = {a.name: a for a in schema.arguments}
            fargs = tuple(
                value(x, schema.arguments[i] if i < len(schema.arguments) else None) for i, x in enumerate(args)
            )
            fkwargs = {k: value(v, by_name.get(k)) for k, v in kwargs.items()}
        else:
            fargs, fkwargs = value(args), {k: value(v) for k, v in kwargs.items()}
        with self.mode:
            return target(*fargs, **fkwargs)

    def constant(self, t: torch.Tensor) -> torch.fx.Node:
        name = f"_lazy_constant{self.constants}"
        self.constants += 1
        setattr(self.root, name, t)
        node = self.graph.get_attr(name)
        node.meta["val"] = self.mode.from_tensor(t)
        return node

    def inline(self, gm: torch.fx.GraphModule, args: list[torch.fx.Node]) -> list[torch.fx.Node]:
        env: dict[torch.fx.Node, Any] = {}
        placeholders = iter(args)
        out: list[torch.fx.Node] = []
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(placeholders)
            elif node.op == "get_attr":
                env[node] = self.constant(getattr(gm, node.target))
            elif node.op == "call_function":
                mapped_args = torch.fx.node.map_arg(node.args, lambda n: env[n])
                mapped_kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
                env[node] = self.emit(node.target, mapped_args, mapped_kwargs, node.meta)
            elif node.op == "output":
                out = [env[n] for n in node.args[0]]
            else:
                raise NeuronCompileError(f"neuron device: a one-op graph has a {node.op} node")
        return out

    def view(self, flat: torch.fx.Node, size: tuple[int, ...], mode: tuple) -> torch.fx.Node:
        if mode[0] == "w":
            return self.emit(aten.view_copy.default, (flat, list(size)))
        n = 1
        for s in size:
            n *= s
        if mode[0] == "r":
            part = self.emit(aten.slice_copy.Tensor, (flat, 0, mode[1], mode[1] + n))
            return self.emit(aten.view_copy.default, (part, list(size)))
        return self.emit(aten.as_strided_copy.default, (flat, list(size), list(mode[1]), mode[2]))

    def flat(self, node: torch.fx.Node) -> torch.fx.Node:
        return self.emit(aten.view_copy.default, (node, [-1]))

    def module(self, outputs: list[torch.fx.Node]) -> torch.fx.GraphModule:
        self.graph.output(tuple(outputs))
        self.graph.lint()
        return torch.fx.GraphModule(self.root, self.graph)


def _build(rec: Recording, outputs: list[int]) -> torch.fx.GraphModule:
    b = _Builder()
    ins = [b.placeholder(f"input_{k}", (i.numel,), i.dtype) for k, i in enumerate(rec.inputs)]
    fvec = b.placeholder("operand_floats", (len(rec.floats),), torch.float32) if rec.floats else None
    ivec = b.placeholder("operand_ints", (len(rec.ints),), torch.int64) if rec.ints else None
    vals: dict[int, torch.fx.Node] = {}

    def get(ref: int) -> torch.fx.Node:
        return vals[ref] if ref >= 0 else ins[-1 - ref]

    def read(expr: tuple) -> torch.fx.Node:
        ref, size, mode = expr
        return b.view(get(ref), size, mode)

    for step in rec.steps:
        kind = step[0]
        if kind == "op":
            _, traced, exprs, (f0, fn), (i0, inn), outs = step
            args = [read(e) for e in exprs]
            if fn:
                args.append(b.emit(aten.slice_copy.Tensor, (fvec, 0, f0, f0 + fn)))
            if inn:
                args.append(b.emit(aten.slice_copy.Tensor, (ivec, 0, i0, i0 + inn)))
            for number, r in zip(outs, b.inline(traced.gm, args)):
                vals[number] = b.flat(r)
        elif kind == "dense":
            _, expr, out = step
            vals[out] = b.flat(read(expr))
        else:  # scatter
            _, base, expr, (size, stride, offset), out = step
            vals[out] = b.emit(
                aten.as_strided_scatter.default, (get(base), read(expr), list(size), list(stride), offset)
            )
    return b.module([vals[j] for j in outputs])


def _compile(rec: Recording, outputs: list[int], key: Any) -> onegraph.OpGraph:
    with onegraph.GRAPHS_LOCK:
        entry = GRAPHS.get(key)
        if entry is not None:
            return entry
        try:
            with onegraph.outside_any_trace():
                gm = _build(rec, outputs)
            graph = onegraph.compile_one(gm, "lazy", context.device().opts)
        except Exception as e:
            e.add_note(
                f"neuron device: while compiling the {rec.ops} eager ops recorded in the lazy mode (option "
                f"eager_mode='lazy'), from {rec.wheres[0]} to {rec.wheres[-1]}; option eager_mode='op' runs each on "
                "its own"
            )
            raise
        entry = GRAPHS.setdefault(key, onegraph.OpGraph(graph, len(outputs)))
        STATS.eager_ops_compiled += 1
        STATS.eager_graphs_lazy += 1
        return entry


def pending_ops() -> int:
    """Ops recorded and not run yet."""
    rec = _STATE.recording
    return 0 if rec is None else rec.ops


context.LAZY = sys.modules[__name__]  # context needs the lazy mode back (flush, set_values): a hook, not an import
