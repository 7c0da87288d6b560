"""``bisect(model, example_inputs)``: which op of the compiled model is less precise than eager's?

A model whose compiled numerics drift from eager's (``evaluate``'s verdict, or a training run) has thousands
of aten ops in its graphs; this finds the ones to blame. Method:

1. capture: one step of the model (forward, loss and backward when training) through the neuron backend,
   each AOTAutograd graph (forward, backward, inference) recorded with the values it is called with and run
   in eager: the graphs are exactly those the backend compiles (same decompositions, same SDPA rewrite);
2. reference: every graph is walked node by node in float64 (float32 where an op has no float64 kernel).
   Every node is fed the *reference values of its inputs rounded to the dtype the model computes them in*,
   so each op is judged alone: an error made upstream never reaches it;
3. each node is run three ways on those same inputs: its float64 reference, eager aten at the model's dtype,
   and our lowering, compiled for the CPU target -- all nodes of a graph in ONE compiled module whose inputs
   are the rounded values and whose outputs are every node's result (one compile per graph, not per node);
4. per result, the error is the normwise relative distance to the reference, ``||x - ref|| / ||ref||`` in
   float64 (integer and bool results: the fraction of elements that differ). A node is *flagged* when the
   compiled error exceeds ``multiple * max(eager error, floor)``, with ``floor = floor_eps * eps(dtype)``
   (exact ops must not divide by zero: a result rounded once to its dtype is never flagged).

Not seen: what only happens between ops of the whole compiled graph (XLA fusing two roundings into one,
a layout carried across ops), random ops (``torch.rand``, dropout: their draws differ by design) and view
ops (they move no values). See docs/bisect.md.
"""

from __future__ import annotations

import contextlib
import copy
import math
import operator
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.utils._pytree as pytree

from ..errors import NeuronUnsupportedOpError
from ..provenance import describe_inputs, op_name, user_source

LossFn = Callable[[Any], torch.Tensor]

#: Default multiple: compiled may be this much further from the reference than eager before it is flagged.
DEFAULT_MULTIPLE = 2.0
#: Default floor, in units of the result dtype's machine epsilon (a result rounded once is within eps / 2).
DEFAULT_FLOOR_EPS = 0.5

#: Ops that only write a graph input (AOTAutograd's input mutations at the end of a graph): nothing to judge.
_NOT_JUDGED = {"aten.copy_.default", "aten.set_.source_Tensor", "aten.resize_.default"}


@dataclass
class OpFinding:
    """One aten node of one graph, judged: its figures and where it came from."""

    graph: str
    #: Position of the node among the judged nodes of its graph (0 = first).
    index: int
    node: str
    op: str
    inputs: str
    source: str
    dtype: str
    #: Normwise relative error to the reference of eager / compiled (worst result of the node).
    eager_error: float
    compiled_error: float
    #: compiled_error / max(eager_error, floor).
    ratio: float
    #: Largest elementwise |x - ref| / max|ref| of eager / compiled.
    eager_max_error: float
    compiled_max_error: float
    flagged: bool
    #: Eager itself is further than sqrt(eps) from the reference: at these inputs the result is mostly
    #: cancellation noise (a gradient that is zero in exact arithmetic), whose size neither side controls;
    #: not flagged, whatever the ratio.
    ill_conditioned: bool = False
    #: Which result of the node these figures are of (its position in the node's tuple; 0 for one tensor).
    output: int = 0

    def describe(self) -> str:
        noise = "; ill-conditioned here: not flagged" if self.ill_conditioned else ""
        return (
            f"{self.graph} #{self.index} {self.node} = {self.op}({self.inputs})"
            f"{f' (result {self.output})' if self.output else ''}\n"
            f"    at {self.source}\n"
            f"    {self.dtype}: compiled error {self.compiled_error:.3g} vs eager {self.eager_error:.3g} "
            f"({_ratio(self.ratio)}; elementwise max {self.compiled_max_error:.3g} vs {self.eager_max_error:.3g}{noise})"
        )


@dataclass
class GraphSummary:
    name: str
    kind: str
    nodes: int
    judged: int
    flagged: int
    #: Nodes that could not be judged, with why (an op with no reference kernel, a lowering that refuses).
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class BisectReport:
    """What ``bisect`` found: every judged node (``ops``), the flagged ones in graph order (``findings``)."""

    model: str
    mode: str
    multiple: float
    floor_eps: float
    graphs: list[GraphSummary] = field(default_factory=list)
    ops: list[OpFinding] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: How many findings ``str()`` prints (all are in ``to_dict``).
    limit: int = 10

    @property
    def findings(self) -> list[OpFinding]:
        return [op for op in self.ops if op.flagged]

    @property
    def ok(self) -> bool:
        return not self.findings and not self.errors and bool(self.graphs)

    def worst(self, n: int = 5) -> list[OpFinding]:
        """The n judged nodes with the largest compiled/eager ratio (flagged or not; ill-conditioned ones
        last)."""
        return sorted(self.ops, key=lambda op: (op.ill_conditioned, -op.ratio))[:n]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "model": self.model,
            "mode": self.mode,
            "multiple": self.multiple,
            "floor_eps": self.floor_eps,
            "graphs": [asdict(g) for g in self.graphs],
            "findings": [asdict(op) for op in self.findings],
            "worst": [asdict(op) for op in self.worst()],
            "judged": len(self.ops),
            "errors": self.errors,
        }

    def __str__(self) -> str:
        lines = [
            f"neuron-compile bisect: {self.model} ({self.mode}); an op is flagged when its compiled error exceeds "
            f"{self.multiple:g}x eager's (floor {self.floor_eps:g} eps of its dtype)"
        ]
        for g in self.graphs:
            lines.append(f"  {g.name} ({g.kind}): {g.nodes} nodes, {g.judged} judged, {g.flagged} flagged, "
                         f"{len(g.skipped)} skipped ({g.seconds:.1f} s)")  # fmt: skip
            lines += [f"    skipped {s}" for s in g.skipped[:5]]
            if len(g.skipped) > 5:
                lines.append(f"    ... and {len(g.skipped) - 5} more skipped")
        found = self.findings
        if found:
            lines.append(f"first {min(len(found), self.limit)} of {len(found)} flagged ops, in graph order:")
            lines += ["  " + op.describe().replace("\n", "\n  ") for op in found[: self.limit]]
        elif self.graphs:
            lines.append("no op flagged: every compiled op is within the multiple of eager's error")
        worst = [op for op in self.worst(3) if not op.flagged]
        noisy = sum(op.ill_conditioned for op in self.ops)
        if noisy:
            lines.append(f"{noisy} op(s) ill-conditioned at these inputs (eager error > sqrt(eps)): not judged")
        if worst:
            lines.append("closest calls not flagged:")
            lines += ["  " + op.describe().replace("\n", "\n  ") for op in worst]
        lines += [f"error: {e}" for e in self.errors]
        lines.append("result: " + ("OK" if self.ok else "NOT OK"))
        return "\n".join(lines)


def _ratio(r: float) -> str:
    return "inf x" if math.isinf(r) else f"{r:.2f}x"


# --- 1. capture ----------------------------------------------------------------------------------------


@dataclass
class _Captured:
    name: str
    kind: str
    gm: torch.fx.GraphModule
    inputs: list[Any] | None = None


def _snapshot(x: Any) -> Any:
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


@contextlib.contextmanager
def _recording(called: list[_Captured]) -> Iterator[None]:
    """The backend's per-graph compile replaced by a recorder that runs the graph in eager and keeps its
    first call's inputs; ``called`` lists the graphs in the order of their first call.

    The replacement is of ``compiler.compile_graph``, which the backend looks up at each compile: what is
    recorded is exactly what the backend would compile (its decomposition table, its SDPA rewrite)."""
    from .. import compiler

    real = compiler.compile_graph

    def record(gm: torch.fx.GraphModule, example_inputs: list[Any], *, kind: str, name: str, **_: Any) -> Any:
        entry = _Captured(name, kind, gm)

        def run(args: list[Any]) -> Any:
            if entry.inputs is None:
                entry.inputs = [_snapshot(a) for a in args]
                called.append(entry)
            return gm(*args)

        run._boxed_call = True
        return run

    compiler.compile_graph = record
    try:
        yield
    finally:
        compiler.compile_graph = real


def _capture(
    model: torch.nn.Module, args: tuple, kwargs: dict, step: Any, options: Mapping[str, Any]
) -> list[_Captured]:
    import torch._functorch.config

    from .runner import _disable_dropout

    called: list[_Captured] = []
    copy_ = copy.deepcopy(model)
    _disable_dropout(copy_)
    torch._dynamo.reset()
    try:
        with _recording(called), torch._functorch.config.patch(enable_autograd_cache=False):
            compiled = torch.compile(copy_, backend="neuron", dynamic=False, options={**options, "cache": False})
            step(compiled, copy_, args, kwargs)
    finally:
        torch._dynamo.reset()
    return called


# --- 2./3. reference, eager and compiled values of every node --------------------------------------------


def _leaves(value: Any) -> list[Any]:
    return pytree.tree_leaves(value)


def _is_view(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and any(r.alias_info is not None and not r.alias_info.is_write
                                                   for r in schema.returns))  # fmt: skip


def _random(node: torch.fx.Node) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _wide(dtype: torch.dtype, to: torch.dtype) -> torch.dtype:
    if dtype.is_complex:
        return torch.complex128 if to == torch.float64 else torch.complex64
    return to if dtype.is_floating_point else dtype


def _widen(value: Any, to: torch.dtype) -> Any:
    """Floating tensors and dtype arguments widened to ``to`` (complex ones to its complex type)."""
    if isinstance(value, torch.Tensor):
        return value.to(_wide(value.dtype, to))
    if isinstance(value, torch.dtype):
        return _wide(value, to)
    if isinstance(value, (list, tuple)):
        return type(value)(_widen(v, to) for v in value)
    return value


def _meta_dtype(node: torch.fx.Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


@dataclass
class _Judged:
    node: torch.fx.Node
    #: Positions of the node's tensor results in its tuple (None: the node's value is one tensor).
    positions: list[int] | None
    reference: list[Any]
    eager: list[Any]


class _Walk:
    """The reference walk of one graph: each node's reference value, and its value rounded to the graph's
    dtype (what every consumer is fed)."""

    def __init__(self, entry: _Captured) -> None:
        self.gm = entry.gm
        self.ref: dict[torch.fx.Node, Any] = {}
        self.low: dict[torch.fx.Node, Any] = {}
        self.judged: list[_Judged] = []
        self.skipped: list[str] = []
        self.nodes = 0
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        for node, value in zip(placeholders, entry.inputs or []):
            self.low[node] = value
            self.ref[node] = _widen(value, torch.float64)

    def rounded(self, node: torch.fx.Node) -> Any:
        if node not in self.low:
            value, dtype = self.ref[node], _meta_dtype(node)
            self.low[node] = value.to(dtype) if isinstance(value, torch.Tensor) and dtype is not None else value
        return self.low[node]

    def run(self) -> None:
        for node in self.gm.graph.nodes:
            if node.op == "get_attr":
                value = operator.attrgetter(node.target)(self.gm)
                self.low[node], self.ref[node] = value, _widen(value, torch.float64)
            elif node.op == "call_function":
                self.nodes += 1
                self._node(node)

    def _node(self, node: torch.fx.Node) -> None:
        if node.target is operator.getitem:
            parent, i = node.args
            self.ref[node] = self.ref[parent][i] if self.ref.get(parent) is not None else None
            return
        leaves = [v for v in _leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
        if not leaves:  # asserts, symbolic sizes: nothing to judge, nothing a tensor op consumes
            self.ref[node] = None
            return
        missing = [a.name for a in node.all_input_nodes if self.ref.get(a) is None]
        if missing:
            self._skip(node, f"its input {missing[0]} has no value (skipped itself)")
            return
        low_args, low_kwargs = pytree.tree_map_only(torch.fx.Node, self.rounded, (node.args, node.kwargs))
        try:
            eager = node.target(*low_args, **low_kwargs)
        except Exception as e:
            self._skip(node, f"eager failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
            return
        if _random(node):  # a draw: the reference takes eager's, nothing to judge
            self.ref[node] = _widen(eager, torch.float64)
            return
        reference = None
        for wide in (torch.float64, torch.float32):  # float32 where an op has no float64 kernel
            try:
                reference = node.target(*_widen(low_args, wide), **_widen(low_kwargs, wide))
                break
            except Exception as e:
                why = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        if reference is None:
            self.ref[node] = _widen(eager, torch.float64)
            self._skip(node, f"no reference ({why})")
            return
        self.ref[node] = reference
        if op_name(node) not in _NOT_JUDGED and not _is_view(node):
            # one entry per tensor result, by position: a result not asked for (a backward's output_mask)
            # is None in eager and in the reference, and not an output of the compiled module either
            if isinstance(reference, (tuple, list)):
                positions = [i for i, r in enumerate(reference) if isinstance(r, torch.Tensor)]
                self.judged.append(
                    _Judged(node, positions, [reference[i] for i in positions], [eager[i] for i in positions])
                )
            elif isinstance(reference, torch.Tensor):
                self.judged.append(_Judged(node, None, [reference], [eager]))

    def _skip(self, node: torch.fx.Node, why: str) -> None:
        self.skipped.append(f"{node.name} = {op_name(node)}: {why}")


def _compiled_values(walk: _Walk, name: str, options: Mapping[str, Any]) -> dict[torch.fx.Node, list[Any]]:
    """Every judged node's results from our lowering, all nodes of the graph compiled as one module whose
    inputs are the rounded values of their operands. A node the lowering refuses is dropped (and said)."""
    from ..compiler import compile_graph
    from ..options import Options

    opts = Options.from_user({**options, "cache": False, "target": "cpu"})
    judged = list(walk.judged)
    # The passes before lowering (value checks) compute metadata from the nodes' fake values: the inputs'
    # must come from the same fake mode.
    metas = [v for n in walk.gm.graph.nodes for v in _leaves(n.meta.get("val")) if isinstance(v, torch.Tensor)]
    fake_mode = torch._guards.detect_fake_mode(metas)

    def meta_of(value: Any) -> Any:
        return (
            fake_mode.from_tensor(value, static_shapes=True)
            if fake_mode is not None and isinstance(value, torch.Tensor)
            else value
        )

    for _attempt in range(3):
        graph = torch.fx.Graph()
        producers: dict[torch.fx.Node, torch.fx.Node] = {}
        inputs: list[Any] = []
        for j in judged:
            for arg in j.node.all_input_nodes:
                if arg not in producers:
                    ph = graph.placeholder(f"in_{arg.name}")
                    ph.meta["val"] = meta_of(walk.rounded(arg))
                    producers[arg] = ph
                    inputs.append(walk.rounded(arg))
        outputs: list[torch.fx.Node] = []
        spans: list[tuple[_Judged, int, int]] = []
        for j in judged:
            copied = graph.node_copy(j.node, lambda n: producers[n])
            val = j.node.meta.get("val")
            start = len(outputs)
            if j.positions is not None:
                for i in j.positions:
                    item = graph.call_function(operator.getitem, (copied, i))
                    item.meta["val"] = val[i]
                    outputs.append(item)
            else:
                outputs.append(copied)
            spans.append((j, start, len(outputs)))
        graph.output(tuple(outputs))
        gm = torch.fx.GraphModule(walk.gm, graph)
        try:
            fn = compile_graph(gm, inputs, opts=opts, kind="inference", name=f"bisect_{name}")
        except NeuronUnsupportedOpError as e:
            refused = {n.node for n in e.nodes}
            kept = [j for j in judged if j.node.name not in refused]
            for j in judged:
                if j.node.name in refused:
                    walk._skip(
                        j.node, "the lowering refuses it: " + next(n.reason for n in e.nodes if n.node == j.node.name)
                    )
            if len(kept) == len(judged):
                raise
            judged = kept
            continue
        with torch.no_grad():
            results = list(fn(list(inputs)))
        walk.judged = judged
        return {j.node: results[a:b] for j, a, b in spans}
    raise RuntimeError(f"bisect: the lowering of {name} kept refusing nodes")


# --- 4. errors --------------------------------------------------------------------------------------------


def _errors(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(normwise relative error, largest elementwise error relative to max|ref|) of ``x`` to ``ref``."""
    if x.shape != ref.shape:
        return math.inf, math.inf
    if not (ref.is_floating_point() or ref.is_complex()):
        if x.numel() == 0:
            return 0.0, 0.0
        wrong = (x.to(ref.dtype) != ref).double().mean().item()
        return wrong, wrong
    x64, r64 = x.detach().to(_wide(ref.dtype, torch.float64)), ref.detach().to(_wide(ref.dtype, torch.float64))
    finite = torch.isfinite(r64)
    if not finite.all():  # a NaN or an infinity must be the same NaN or infinity
        same = (x64 == r64) | (torch.isnan(x64) & torch.isnan(r64))
        if not same[~finite].all():
            return math.inf, math.inf
        x64, r64 = x64[finite], r64[finite]
    diff = (x64 - r64).abs()
    if not torch.isfinite(diff).all():
        return math.inf, math.inf
    if diff.numel() == 0:
        return 0.0, 0.0
    tiny = torch.finfo(torch.float64).tiny
    norm = max(torch.linalg.vector_norm(r64).item(), tiny)
    peak = max(r64.abs().max().item(), tiny)
    return torch.linalg.vector_norm(diff).item() / norm, diff.max().item() / peak


def _judge(
    walk: _Walk, compiled: dict[torch.fx.Node, list[Any]], graph: str, multiple: float, floor_eps: float
) -> list[OpFinding]:
    found = []
    for index, j in enumerate(walk.judged):
        worst: OpFinding | None = None
        for position, ref, eager, comp in zip(j.positions or [0], j.reference, j.eager, compiled[j.node]):
            if not isinstance(ref, torch.Tensor):
                continue
            dtype = eager.dtype if isinstance(eager, torch.Tensor) else ref.dtype
            e_norm, e_max = _errors(eager, ref)
            c_norm, c_max = _errors(comp, ref) if isinstance(comp, torch.Tensor) else (math.inf, math.inf)
            eps = torch.finfo(dtype).eps if (dtype.is_floating_point or dtype.is_complex) else 0.0
            base = max(e_norm, floor_eps * eps)
            ratio = c_norm / base if base > 0 else (0.0 if c_norm == 0 else math.inf)
            if math.isnan(ratio):
                ratio = math.inf
            noise = eps > 0 and e_norm > math.sqrt(eps)
            finding = OpFinding(
                graph, index, j.node.name, op_name(j.node), describe_inputs(j.node), user_source(j.node),
                str(dtype).replace("torch.", ""), e_norm, c_norm, ratio, e_max, c_max,
                c_norm > multiple * base and not noise, noise, position,
            )  # fmt: skip
            if worst is None or (finding.flagged, finding.ratio) > (worst.flagged, worst.ratio):
                worst = finding
        if worst is not None:
            found.append(worst)
    return found


# --- the function -----------------------------------------------------------------------------------------


def bisect(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    loss_fn: LossFn | None = None,
    multiple: float = DEFAULT_MULTIPLE,
    floor_eps: float = DEFAULT_FLOOR_EPS,
    options: Mapping[str, Any] | None = None,
    progress: bool = True,
    limit: int = 10,
) -> BisectReport:
    """Judge every aten op of ``model``'s compiled graphs alone: compiled vs eager, each against a float64
    reference of the same inputs (module docstring: the method). Returns a ``BisectReport`` whose
    ``findings`` are the ops whose compiled error exceeds ``multiple`` x eager's, in graph order, each with
    its user source line and figures.

    ``example_inputs``, ``loss_fn``: as ``evaluate``'s (a model in training mode with trainable parameters
    is judged on forward, loss and backward graphs). ``floor_eps``: the floor of eager's error, in units of
    the result dtype's epsilon. ``options``: the backend's (the bisect compiles for the CPU target, without
    the compile cache). ``limit``: findings ``str(report)`` prints. The model is not changed (a deep copy
    runs); Dynamo is reset before and after.
    """
    if not (1.0 <= multiple < math.inf):
        raise ValueError(f"bisect: multiple={multiple}; need a finite number >= 1")
    if not (0.0 <= floor_eps < math.inf):
        raise ValueError(f"bisect: floor_eps={floor_eps}; need a finite number >= 0")
    from .runner import _split_inputs, _Step

    args, kwargs = _split_inputs(example_inputs)
    training = model.training and any(p.requires_grad for p in model.parameters())
    report = BisectReport(type(model).__name__, "training" if training else "inference", multiple, floor_eps,
                          limit=limit)  # fmt: skip

    def say(message: str) -> None:
        if progress:
            print(f"[neuron bisect] {message}", file=sys.stderr, flush=True)

    say("capturing the model's graphs (one step through the neuron backend, graphs run in eager)")
    try:
        captured = _capture(model, args, kwargs, _Step(training, loss_fn), dict(options or {}))
    except Exception as e:
        report.errors.append(
            f"capture: {type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        )
        return report
    for entry in captured:
        t0 = time.perf_counter()
        say(f"{entry.name}: reference, eager and compiled values of every node")
        walk = _Walk(entry)
        try:
            walk.run()
            compiled = _compiled_values(walk, entry.name, dict(options or {}))
        except Exception as e:
            report.errors.append(
                f"{entry.name}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            )
            continue
        ops = _judge(walk, compiled, entry.name, multiple, floor_eps)
        report.ops += ops
        report.graphs.append(GraphSummary(entry.name, entry.kind, walk.nodes, len(ops), sum(o.flagged for o in ops),
                                          walk.skipped, time.perf_counter() - t0))  # fmt: skip
    if not captured:
        report.errors.append("no graph reached the backend (nothing compiled: is the model's forward empty?)")
    return report
