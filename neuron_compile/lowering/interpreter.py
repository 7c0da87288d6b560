"""Walks an aten FX graph, calls each node's lowering inside ``jax.jit(...).lower``, and yields the
StableHLO module of the whole graph.

Every node that cannot be lowered is collected (a placeholder value of the right shape keeps the trace
going) and, after the walk, all of them are raised in ONE ``NeuronUnsupportedOpError``. A node with a
data-dependent shape or value (``x[mask]``, ``nonzero``, ``.item()``) is one of them: the walk goes on past
it, the nodes that use its value are not lowered (they are its follow-ups; those with a data-dependent
result of their own are listed as such), and every other node is lowered as usual, so the error names the
data-dependent ops and the refused ones together.
"""

from __future__ import annotations

import functools
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import torch
from jax import lax
from torch._ops import OpOverload

from .. import provenance
from ..artifact import SAVED_FOR_BACKWARD_FROM, OutputSpec, TensorSpec
from ..errors import NeuronUnsupportedOpError, UnsupportedNode
from ..graph_checks import (
    data_dependent_reason,
    data_dependent_roots,
    is_symbolic,
    unsupported_inputs,
    unsupported_tensor_kind,
)
from . import layout, output_plan
from .complex_pairs import device_struct
from .dispatch import resolve
from .kernel_routing import neuron_sites_are_references
from .registry import NodeContext, Unsupported, lowering_context
from .semantics import jax_dtype


@dataclass
class LoweredGraph:
    """The StableHLO module of one FX graph plus what the runtime needs to call it."""

    name: str
    lowered: Any  # jax.stages.Lowered
    inputs: list[TensorSpec | Any]  # a TensorSpec, or a static Python value baked into the graph
    outputs: list[OutputSpec]
    downcast_float64: bool = False
    #: The executable takes one more input after the graph's tensors: a fresh int32[2] seed per call.
    needs_rng_seed: bool = False
    num_ops: int = 0
    op_counts: dict[str, int] = field(default_factory=dict)
    #: Named scope of each lowered node ('aten.op#node@file.py:LINE', as in the MLIR locations) ->
    #: {"op", "node", "inputs", "source": the user's full file:line}: maps any HLO op back to user code.
    node_table: dict[str, dict[str, str]] = field(default_factory=dict)
    #: NKI kernel sites in the module, by kernel name (routed aten nodes, neuron:: ops, user kernels).
    kernel_sites: dict[str, int] = field(default_factory=dict)
    #: The neuron target lowered the kernel sites as their reference StableHLO: the real nki, which would
    #: compile the kernels, is not in use (``kernel_routing.kernel_site``).
    kernel_sites_as_reference: bool = False

    def stablehlo(self, debug_info: bool = False) -> str:
        return self.lowered.as_text(debug_info=debug_info)


def _spec_of(value: Any) -> TensorSpec | Any:
    """An input's spec; a dense non-row-major input (a transposed weight saved for backward, a
    channels_last activation) keeps its memory order, so the runtime feeds it without a copy."""
    if isinstance(value, torch.Tensor):
        shape = tuple(int(s) for s in value.shape)
        # A non-contiguous dense layout is never the identity order; gaps or overlaps give None (copied).
        permuted = value.layout == torch.strided and not value.is_contiguous()
        perm = output_plan.physical_order(shape, tuple(int(s) for s in value.stride())) if permuted else None
        return TensorSpec(shape, value.dtype, perm)
    return value


def _meta_structs(val: Any) -> Any:
    """Placeholder jax values (zeros) shaped like a node's output, to keep tracing after a failure (a
    data-dependent size, which has no value, is 1: nothing that uses the placeholder is lowered)."""
    if isinstance(val, torch.Tensor):
        shape = tuple(1 if is_symbolic(s) else int(s) for s in val.shape)
        try:
            shape, dtype = device_struct(shape, val.dtype)
        except Unsupported:
            dtype = jnp.float32
        return jnp.zeros(shape, dtype)
    if isinstance(val, (tuple, list)):
        return type(val)(_meta_structs(v) for v in val)
    return val


def _check_against_meta(node: torch.fx.Node, result: Any) -> str | None:
    """A lowering must produce exactly the shape and dtype torch computed; anything else is our bug."""
    val = node.meta.get("val")
    pairs = []
    if isinstance(val, torch.Tensor):
        pairs = [(val, result)]
    elif isinstance(val, (tuple, list)) and isinstance(result, (tuple, list)):
        pairs = [(v, r) for v, r in zip(val, result) if isinstance(v, torch.Tensor)]
    for v, r in pairs:
        want_shape, want_dtype = device_struct(tuple(int(s) for s in v.shape), v.dtype)  # complex: as a pair
        if isinstance(r, layout.ChannelsLast):
            r, want_shape = r.array, layout.physical_shape(want_shape)
        if r is None or not hasattr(r, "shape"):
            return f"lowering produced {r!r} where torch produces a tensor"
        want_dtype = jnp.dtype(want_dtype)
        if tuple(r.shape) != want_shape or jnp.dtype(r.dtype) != want_dtype:
            return (
                f"internal lowering error: produced {jnp.dtype(r.dtype)}{list(r.shape)}, "
                f"torch produces {want_dtype}{list(want_shape)}"
            )
    return None


def _constant(value: Any) -> Any:
    """A tensor constant baked into the graph, as a jax constant of the device dtype."""
    if not isinstance(value, torch.Tensor):
        return value  # e.g. the GraphModule of an invoke_subgraph
    if isinstance(value, torch._subclasses.fake_tensor.FakeTensor):
        # A constant that tracing left without data (seen: an empty tensor inside a scan body). Empty, it has
        # no values to miss; otherwise there is nothing honest to bake in.
        if value.numel() == 0:
            return jnp.zeros(tuple(value.shape), jax_dtype(value.dtype))
        raise Unsupported(
            f"a constant {value.dtype}{list(value.shape)} of the traced graph has no data (a fake tensor left by "
            "tracing); create it from the inputs inside the function, or outside the compiled region"
        )
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        t = value.detach().cpu()
        if t.is_complex():  # carried as a (real, imag) pair (lowering/complex_pairs.py)
            t = torch.view_as_real(t.resolve_conj().to(torch.complex64))
        dtype = jax_dtype(t.dtype)
        array = t.float().numpy() if t.dtype in (torch.bfloat16, torch.float64) else t.numpy()
    return jnp.asarray(array, dtype=dtype)


_LOOPS = (torch.ops.higher_order.scan, torch.ops.higher_order.map_impl)


class _GraphTracer:
    def __init__(self, name: str, target: str, kernels: str = "reference", generation: str = "trn2") -> None:
        self.name = name
        self.target = target
        self.kernels = kernels
        self.generation = generation
        self.kernel_sites: dict[str, int] = {}
        self.failures: list[UnsupportedNode] = []
        #: Every node whose value depends on a data-dependent one -> that root cause (``data_dependent_roots``).
        self.data_dependent: dict[torch.fx.Node, torch.fx.Node] = {}
        self.op_counts: dict[str, int] = {}
        self.node_table: dict[str, dict[str, str]] = {}
        self.seed: Any = None  # the traced seed parameter
        self.used_rng = False
        self._node_index: dict[torch.fx.Node, int] = {}

    def seed_for(self, node: torch.fx.Node) -> Any:
        self.used_rng = True
        index = self._node_index.setdefault(node, len(self._node_index) + 1)
        seed = lax.bitcast_convert_type(self.seed, jnp.uint32)
        # Distinct streams per node: mix the node's ordinal into the second word (xor with a constant
        # vector, not an indexed update, which would emit a scatter).
        mix = jnp.asarray([0, (index * 0x9E3779B9) & 0xFFFFFFFF], jnp.uint32)
        return lax.bitwise_xor(seed, mix)

    def _count_kernel_site(self, kernel: str) -> None:
        self.kernel_sites[kernel] = self.kernel_sites.get(kernel, 0) + 1

    def fail(self, node: torch.fx.Node, reason: str, follows: torch.fx.Node | None = None) -> None:
        self.failures.append(UnsupportedNode.from_node(node, reason, follows))

    def _follow_up(self, node: torch.fx.Node, root: torch.fx.Node) -> Any:
        """A node that uses the value of the data-dependent ``root``: not lowered; listed when its own
        result is data-dependent too (the ``sym_size``/range nodes of ``x[mask]``), as ``root``'s follow-up."""
        reason = data_dependent_reason(node)
        if reason:
            self.fail(node, reason, follows=root)
        return _meta_structs(node.meta.get("val"))

    def run(self, gm: torch.fx.GraphModule, args: list[Any], extra: list[torch.fx.Node] | tuple = ()) -> list[Any]:
        """The graph's outputs (in torch's layout), then the values of the ``extra`` nodes (storage owners
        of outputs; channels-last where they are, see ``lower_graph``)."""
        env: dict[torch.fx.Node, Any] = {}
        arg_iter = iter(args)
        self.data_dependent.update(data_dependent_roots(gm))
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(arg_iter)
            elif node.op == "get_attr":
                try:
                    env[node] = _constant(getattr(gm, node.target))
                except Unsupported as e:
                    self.fail(node, str(e))
                    env[node] = _meta_structs(getattr(gm, node.target))
            elif node.op == "call_function":
                root = self.data_dependent.get(node)
                if root is node:  # the data-dependent value itself (x[mask]): nothing to lower
                    self.fail(node, data_dependent_reason(node) or "data-dependent value")
                    env[node] = _meta_structs(node.meta.get("val"))
                else:
                    env[node] = self.call(gm, node, env, follows=root)
            elif node.op == "output":
                outputs = layout.materialize(list(torch.fx.node.map_arg(node.args[0], lambda n: env[n])))
                return outputs + [env[n] for n in extra]
            else:
                self.fail(node, f"FX node kind '{node.op}' is not supported")
                env[node] = _meta_structs(node.meta.get("val"))
        raise AssertionError("graph without output node")

    def call(
        self, gm: torch.fx.GraphModule, node: torch.fx.Node, env: dict, follows: torch.fx.Node | None = None
    ) -> Any:
        """The lowered value of ``node``. ``follows``: the data-dependent node whose value ``node`` uses (its
        follow-up: not lowered; only an op refused whatever its inputs is reported as its own root cause)."""
        args = torch.fx.node.map_arg(node.args, lambda n: env[n])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
        if follows is not None and not _returns_tensors(node.target):
            return self._follow_up(node, follows)  # getitem, size/range bookkeeping, loops over the value
        if node.target is operator.getitem:
            return args[0][args[1]]
        if node.target is torch.ops.higher_order.invoke_subgraph:
            # nested_compile_region: inline the subgraph; its nodes keep their own provenance.
            subgraph, _identifier, *operands = layout.materialize(args)
            with jax.named_scope(f"invoke_subgraph.{_identifier}"):
                return tuple(self.run(subgraph, list(operands)))
        if node.target in _LOOPS:
            combine, *operands = layout.materialize(args)
            with jax.named_scope(f"{node.target.__name__}.{node.name}"):
                return self._loop(node, combine, *operands)
        name = provenance.op_name(node)
        self.op_counts[name] = self.op_counts.get(name, 0) + 1
        bad_kind = self._bad_tensor_kind(node)
        if bad_kind:
            self.fail(node, f"unsupported tensor kind: {bad_kind}")
            return _meta_structs(node.meta.get("val"))
        lower = resolve(node, kernels=self.kernels, target=self.target)
        if lower.lowering is None:
            self.fail(node, lower.refusal or "no lowering for this op")
            return _meta_structs(node.meta.get("val"))
        if follows is not None:
            return self._follow_up(node, follows)
        value = lower.bind(args, kwargs)  # route, channels-last handler, lowering (dispatch.py)
        context = NodeContext(
            node, self.target, self.seed_for, self.kernels, self._count_kernel_site, self.generation, self.run_subgraph
        )
        scope = provenance.scope_name(node)
        self.node_table[scope] = {
            "op": name,
            "node": node.name,
            "inputs": provenance.describe_inputs(node),
            "source": provenance.user_source(node),
        }
        try:
            with lowering_context(context), jax.named_scope(scope):
                result = value()
        except Unsupported as e:
            self.fail(node, str(e))
            return _meta_structs(node.meta.get("val"))
        mismatch = _check_against_meta(node, result)
        if mismatch:
            self.fail(node, mismatch)
            return _meta_structs(node.meta.get("val"))
        return result

    def run_subgraph(self, gm: torch.fx.GraphModule, args: list[Any], where: str) -> list[Any] | None:
        """A higher-order op's subgraph lowered inline (``NodeContext.run_subgraph``): its outputs, or None
        when some of its ops were refused; those are reported as ops of ``where``."""
        failures = len(self.failures)
        outputs = self.run(gm, args)
        for failure in self.failures[failures:]:
            failure.reason = f"{failure.reason} (in {where})"
        return outputs if len(self.failures) == failures else None

    def _loop(self, node: torch.fx.Node, body: torch.fx.GraphModule, *operands: Any) -> tuple[Any, ...]:
        """torch's ``scan(combine, init, xs, additional)`` (its forward, and the backward's scan over flipped
        operands) and ``map_impl(body, xs, args)``, unrolled over the static length of ``xs``. A loop would
        slice ``xs`` and write the stacked outputs at the loop counter, and neuronx-cc takes constant slice
        indices only. Each step mixes its index into the RNG seed, so random ops in the body draw fresh
        numbers at every step."""
        if node.target is torch.ops.higher_order.scan:
            init, xs, additional = (list(o) for o in operands)
        else:  # map_impl: a scan without a carry
            (xs, additional), init = (list(o) for o in operands), []
        outputs = node.meta["val"]
        length = int(outputs[len(init)].shape[0]) if len(outputs) > len(init) else int(xs[0].shape[0])
        outer_seed, carry, steps, failures = self.seed, init, [], len(self.failures)
        for i in range(length):
            self.seed = lax.bitwise_xor(outer_seed, jnp.asarray([(i * 0x9E3779B1) & 0x7FFFFFFF, 0], jnp.int32))
            try:
                slices = [lax.index_in_dim(x, i, keepdims=False) for x in xs]
                outs = [layout.materialize(o) for o in self.run(body, [*carry, *slices, *additional])]
            finally:
                self.seed = outer_seed
            if len(self.failures) > failures:  # the body's unsupported ops, reported once, not once per step
                return _meta_structs(node.meta.get("val"))
            carry = outs[: len(init)]
            steps.append(outs[len(init) :])
        ys = [
            jnp.stack([step[k] for step in steps]) if steps else jnp.zeros(out.shape, jax_dtype(out.dtype))
            for k, out in enumerate(outputs[len(init) :])
        ]
        return (*carry, *ys)

    @staticmethod
    def _bad_tensor_kind(node: torch.fx.Node) -> str | None:
        vals = [a.meta.get("val") for a in node.all_input_nodes] + [node.meta.get("val")]
        for v in vals:
            for t in v if isinstance(v, (tuple, list)) else [v]:
                if isinstance(t, torch.Tensor):
                    problem = unsupported_tensor_kind(t)
                    if problem:
                        return problem
        return None


def _returns_tensors(target: Any) -> bool:
    """Whether ``target`` is an aten op that returns tensors (not ``sym_size``, ``_assert_scalar``, nor a
    Python operator or higher-order op): an op whose refusal does not depend on its inputs' values."""
    if not isinstance(target, OpOverload):
        return False
    returns = target._schema.returns
    return bool(returns) and all(
        isinstance(r.type, torch.TensorType)
        or (isinstance(r.type, torch.ListType) and isinstance(r.type.getElementType(), torch.TensorType))
        for r in returns
    )


def _lower_with_plan(
    traced: Callable[..., tuple[tuple[Any, ...], list[OutputSpec]]], structs: list[Any]
) -> tuple[Any, list[OutputSpec]]:
    """``jax.jit(traced).lower(*structs)`` of the arrays ``traced`` returns, and the output plan it returns beside
    them: a jitted function's outputs are arrays only, so the plan is taken off on the way out of the trace."""
    plans: list[list[OutputSpec]] = []

    @functools.wraps(traced)  # the module keeps the traced function's name (@jit_traced)
    def arrays_only(*arrays: Any) -> tuple[Any, ...]:
        tensors, plan = traced(*arrays)
        plans.append(plan)
        return tensors

    with jax.enable_x64(True), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # jax's own dtype-truncation chatter
        # keep_unused: the runtime passes every input positionally, so none may be pruned.
        lowered = jax.jit(arrays_only, keep_unused=True).lower(*structs)
    (plan,) = plans  # traced once
    return lowered, plan


def lower_graph(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    name: str,
    target: str = "cpu",
    kernels: str = "reference",
    generation: str = "trn2",
) -> LoweredGraph:
    """Lower ``gm`` (an aten graph from AOTAutograd) to one StableHLO module (``generation``: the Trainium
    generation the neuron target's NKI kernels are compiled for, where the real nki is installed).

    Raises ``NeuronUnsupportedOpError`` listing every node that cannot be lowered.
    """
    input_specs = [_spec_of(x) for x in example_inputs]
    tensor_positions = [i for i, s in enumerate(input_specs) if isinstance(s, TensorSpec)]
    tracer = _GraphTracer(name, target, kernels, generation)
    bad_inputs = unsupported_inputs(gm, example_inputs)
    if bad_inputs:
        raise NeuronUnsupportedOpError(name, bad_inputs)

    out_args = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    saved_from = gm.meta.get(SAVED_FOR_BACKWARD_FROM)
    # A data-dependent node is refused (its output has no static shape to plan): the walk only collects.
    refused_anyway = bool(data_dependent_roots(gm))
    buffers, placement = ([], []) if refused_anyway else output_plan.output_buffers(gm, out_args)

    def traced(*arrays: Any) -> tuple[tuple[Any, ...], list[OutputSpec]]:
        """The module's output arrays and the plan that places them in the graph's outputs."""
        *arrays, tracer.seed = arrays
        full_args = list(input_specs)
        for pos, arr in zip(tensor_positions, arrays):
            perm = input_specs[pos].perm
            if target == "cpu" and perm is not None and perm == layout.channels_last_order(arr.ndim):
                arr = layout.ChannelsLast(arr)  # e.g. a forward's channels-last activation (see below)
            elif perm is not None:  # fed in memory order: back to torch's dim order (a complex pair dim stays last)
                arr = jnp.transpose(
                    arr, tuple(perm.index(d) for d in range(len(perm))) + tuple(range(len(perm), arr.ndim))
                )
            full_args[pos] = arr
        values = tracer.run(gm, full_args, [b.node for b in buffers])
        if tracer.failures:  # refused after the walk (lower_graph): no output plan is needed
            return (), []
        results, roots = values[: len(out_args)], values[len(out_args) :]
        tensors, plan = output_plan.assemble(buffers, placement, results, roots, saved_from)
        return tuple(tensors), plan

    structs = [
        jax.ShapeDtypeStruct(*device_struct(input_specs[i].device_shape, input_specs[i].dtype))
        for i in tensor_positions
    ]
    structs.append(jax.ShapeDtypeStruct((2,), jnp.int32))  # the per-call RNG seed
    lowered, output_specs = _lower_with_plan(traced, structs)
    if tracer.failures:
        raise NeuronUnsupportedOpError(name, tracer.failures)

    # Output dtypes as torch declares them (float64 stays float64 for the user).
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    metas = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in out_node.args[0]]
    for spec, meta in zip(output_specs, metas):
        if spec.kind == "tensor" and isinstance(meta, torch.Tensor):
            spec.spec = TensorSpec(spec.spec.shape, meta.dtype)
    wide = (torch.float64, torch.complex128)  # computed as float32 / complex64 pairs
    # 0-d float64 values that only feed narrower math are left out: a Python float that Dynamo passes as a
    # float64 scalar (a learning rate a scheduler changes) is a float32 operand in eager too, since a 0-d
    # tensor does not set the dtype of an op with a dimensioned one. A float64 output still counts.
    downcast = (
        any(isinstance(s, TensorSpec) and s.dtype in wide and s.shape for s in input_specs)
        or any(isinstance(m, torch.Tensor) and m.dtype in wide for m in metas)
        or any(
            isinstance(t, torch.Tensor) and t.dtype in wide and t.dim() > 0
            for n in gm.graph.nodes
            for t in (n.meta.get("val") if isinstance(n.meta.get("val"), (tuple, list)) else [n.meta.get("val")])
        )
    )
    return LoweredGraph(
        name=name,
        lowered=lowered,
        inputs=input_specs,
        outputs=output_specs,
        downcast_float64=downcast,
        needs_rng_seed=tracer.used_rng,
        num_ops=sum(tracer.op_counts.values()),
        op_counts=tracer.op_counts,
        node_table=tracer.node_table,
        kernel_sites=tracer.kernel_sites,
        kernel_sites_as_reference=target == "neuron" and bool(tracer.kernel_sites) and neuron_sites_are_references(),
    )
