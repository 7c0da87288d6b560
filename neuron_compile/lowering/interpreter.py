"""Walks an aten FX graph, calls each node's lowering inside ``jax.jit(...).lower``, and yields the
StableHLO module of the whole graph.

Every node that cannot be lowered is collected (a placeholder value of the right shape keeps the trace
going) and, after the walk, all of them are raised in ONE ``NeuronUnsupportedOpError``.
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import torch
from jax import lax
from torch._ops import OpOverload

from .. import provenance
from ..artifact import OutputSpec, TensorSpec
from ..errors import NeuronUnsupportedOpError, UnsupportedNode
from ..graph_checks import check_fx_graph, non_aten_reason, unsupported_inputs, unsupported_tensor_kind
from .registry import _CURRENT, NodeContext, Unsupported, lowering_for
from .semantics import jax_dtype, torch_dtype

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

    def stablehlo(self, debug_info: bool = False) -> str:
        return self.lowered.as_text(debug_info=debug_info)


def _spec_of(value: Any) -> TensorSpec | Any:
    if isinstance(value, torch.Tensor):
        return TensorSpec(tuple(int(s) for s in value.shape), value.dtype)
    return value


def _meta_structs(val: Any) -> Any:
    """Placeholder jax values (zeros) shaped like a node's output, to keep tracing after a failure."""
    if isinstance(val, torch.Tensor):
        try:
            dtype = jax_dtype(val.dtype)
        except Unsupported:
            dtype = jnp.float32
        return jnp.zeros(tuple(int(s) for s in val.shape), dtype)
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
        if r is None or not hasattr(r, "shape"):
            return f"lowering produced {r!r} where torch produces a tensor"
        want_shape = tuple(int(s) for s in v.shape)
        want_dtype = jnp.dtype(jax_dtype(v.dtype))
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
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        t = value.detach().cpu()
        dtype = jax_dtype(t.dtype)
        array = t.float().numpy() if t.dtype in (torch.bfloat16, torch.float64) else t.numpy()
    return jnp.asarray(array, dtype=dtype)


class _GraphTracer:
    def __init__(self, name: str, target: str) -> None:
        self.name = name
        self.target = target
        self.failures: list[UnsupportedNode] = []
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

    def fail(self, node: torch.fx.Node, reason: str) -> None:
        self.failures.append(
            UnsupportedNode(
                op=provenance.op_name(node),
                inputs=provenance.describe_inputs(node),
                source=provenance.user_source(node),
                reason=reason,
            )
        )

    def run(self, gm: torch.fx.GraphModule, args: list[Any]) -> list[Any]:
        env: dict[torch.fx.Node, Any] = {}
        arg_iter = iter(args)
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(arg_iter)
            elif node.op == "get_attr":
                env[node] = _constant(getattr(gm, node.target))
            elif node.op == "call_function":
                env[node] = self.call(gm, node, env)
            elif node.op == "output":
                return list(torch.fx.node.map_arg(node.args[0], lambda n: env[n]))
            else:
                self.fail(node, f"FX node kind '{node.op}' is not supported")
                env[node] = _meta_structs(node.meta.get("val"))
        raise AssertionError("graph without output node")

    def call(self, gm: torch.fx.GraphModule, node: torch.fx.Node, env: dict) -> Any:
        args = torch.fx.node.map_arg(node.args, lambda n: env[n])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
        if node.target is operator.getitem:
            return args[0][args[1]]
        if node.target is torch.ops.higher_order.invoke_subgraph:
            # nested_compile_region: inline the subgraph; its nodes keep their own provenance.
            subgraph, _identifier, *operands = args
            with jax.named_scope(f"invoke_subgraph.{_identifier}"):
                return tuple(self.run(subgraph, list(operands)))
        name = provenance.op_name(node)
        self.op_counts[name] = self.op_counts.get(name, 0) + 1
        bad_kind = self._bad_tensor_kind(node)
        if bad_kind:
            self.fail(node, f"unsupported tensor kind: {bad_kind}")
            return _meta_structs(node.meta.get("val"))
        lowering = lowering_for(node.target)
        if lowering is None:
            is_aten = isinstance(node.target, OpOverload)
            reason = "no lowering for this op" if is_aten else non_aten_reason(node.target)
            self.fail(node, reason)
            return _meta_structs(node.meta.get("val"))
        token = _CURRENT.set(NodeContext(node, self.target, self.seed_for))
        try:
            scope = provenance.scope_name(node)
            self.node_table[scope] = {
                "op": name,
                "node": node.name,
                "inputs": provenance.describe_inputs(node),
                "source": provenance.user_source(node),
            }
            with jax.named_scope(scope):
                result = lowering(*args, **kwargs)
        except Unsupported as e:
            self.fail(node, str(e))
            return _meta_structs(node.meta.get("val"))
        finally:
            _CURRENT.reset(token)
        mismatch = _check_against_meta(node, result)
        if mismatch:
            self.fail(node, mismatch)
            return _meta_structs(node.meta.get("val"))
        return result

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


def lower_graph(
    gm: torch.fx.GraphModule, example_inputs: list[Any], name: str, target: str = "cpu"
) -> LoweredGraph:
    """Lower ``gm`` (an aten graph from AOTAutograd) to one StableHLO module.

    Raises ``NeuronUnsupportedOpError`` listing every node that cannot be lowered.
    """
    check_fx_graph(gm, name)  # data-dependent shapes: nothing below could trace them
    input_specs = [_spec_of(x) for x in example_inputs]
    tensor_positions = [i for i, s in enumerate(input_specs) if isinstance(s, TensorSpec)]
    tracer = _GraphTracer(name, target)
    bad_inputs = unsupported_inputs(gm, example_inputs)
    if bad_inputs:
        raise NeuronUnsupportedOpError(name, bad_inputs)

    output_plan: list[OutputSpec] = []

    def traced(*arrays: Any) -> tuple[Any, ...]:
        *arrays, tracer.seed = arrays
        full_args = list(input_specs)
        for pos, arr in zip(tensor_positions, arrays):
            full_args[pos] = arr
        results = tracer.run(gm, full_args)
        output_plan.clear()
        tensors: list[Any] = []
        seen: dict[int, int] = {}
        for r in results:
            if r is None or isinstance(r, (int, float, bool)):
                output_plan.append(OutputSpec("const", value=r))
                continue
            spec = TensorSpec(tuple(int(s) for s in r.shape), torch_dtype(r.dtype))
            if id(r) in seen:
                output_plan.append(OutputSpec("tensor", seen[id(r)], spec=spec, duplicate_of=seen[id(r)]))
                continue
            seen[id(r)] = len(tensors)
            output_plan.append(OutputSpec("tensor", len(tensors), spec=spec))
            tensors.append(r)
        return tuple(tensors)

    structs = [
        jax.ShapeDtypeStruct(input_specs[i].shape, jax_dtype(input_specs[i].dtype)) for i in tensor_positions
    ]
    structs.append(jax.ShapeDtypeStruct((2,), jnp.int32))  # the per-call RNG seed
    with jax.enable_x64(True), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # jax's own dtype-truncation chatter
        # keep_unused: the runtime passes every input positionally, so none may be pruned.
        lowered = jax.jit(traced, keep_unused=True).lower(*structs)
    if tracer.failures:
        raise NeuronUnsupportedOpError(name, tracer.failures)

    # Output dtypes as torch declares them (float64 stays float64 for the user).
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    metas = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in out_node.args[0]]
    for spec, meta in zip(output_plan, metas):
        if spec.kind == "tensor" and isinstance(meta, torch.Tensor):
            spec.spec = TensorSpec(spec.spec.shape, meta.dtype)
    downcast = any(isinstance(s, TensorSpec) and s.dtype == torch.float64 for s in input_specs) or any(
        isinstance(t, torch.Tensor) and t.dtype == torch.float64
        for n in gm.graph.nodes
        for t in (n.meta.get("val") if isinstance(n.meta.get("val"), (tuple, list)) else [n.meta.get("val")])
    )
    return LoweredGraph(
        name=name,
        lowered=lowered,
        inputs=input_specs,
        outputs=output_plan,
        downcast_float64=downcast,
        needs_rng_seed=tracer.used_rng,
        num_ops=sum(tracer.op_counts.values()),
        op_counts=tracer.op_counts,
        node_table=tracer.node_table,
    )

