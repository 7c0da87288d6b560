"""``bisect(model, example_inputs)``: where does the compiled model become less precise than eager?

A model whose compiled numerics drift from eager's (``evaluate``'s verdict, or a training run) has thousands
of aten ops in its graphs; this finds where to look. Compiled and eager run at the model's dtype, both are
measured against a float64 reference of the same computation, and a place is *flagged* when the compiled
error exceeds ``multiple * max(eager error, floor)``, ``floor = floor_eps * eps(dtype)`` (a result rounded
once to its dtype is never flagged; exact ops do not divide by zero). The error is the normwise relative
distance to the reference, ``||x - ref|| / ||ref||`` in float64 (integer and bool results: the fraction of
elements that differ). Where eager itself is further than sqrt(eps) from the reference the value is mostly
cancellation noise (a gradient that is zero in exact arithmetic): reported as ill-conditioned, never flagged.

Three methods (``method=``):

``"ops"``: every aten op judged ALONE.
  1. capture: one step of the model (forward, loss and backward when training) through the neuron backend,
     each AOTAutograd graph (forward, backward, inference) recorded with the values it is called with and run
     in eager: the graphs are exactly those the backend compiles (same decompositions, same SDPA rewrite);
  2. reference: every graph is walked node by node in float64 (float32 where an op has no float64 kernel).
     Every node is fed the *reference values of its inputs rounded to the dtype the model computes them in*,
     so each op is judged alone: an error made upstream never reaches it;
  3. each node is run three ways on those same inputs: its float64 reference, eager aten at the model's dtype,
     and our lowering, compiled for the CPU target -- all nodes of a graph in ONE compiled module whose inputs
     are the rounded values and whose outputs are every node's result (one compile per graph, not per node).

``"prefix"``: drift that only a composition of ops shows, inside one graph. Each captured graph is run node by
  node from its recorded inputs twice, in eager at the model's dtype and in float64, each node fed its own
  run's values (errors compose as in the model). The prefix of the graph up to node k is compiled alone (all
  of it in one module, XLA free to fuse), its outputs every value it hands to the rest of the graph, and
  judged against those two runs. The first k whose prefix is flagged is found by bisection over k, as torch's
  accuracy minifier truncates a graph's suffix (``torch._functorch.fx_minifier``'s "Truncate suffix"): the
  whole graph first (one compile when it holds), then about log2(nodes) prefixes. The node found is where the
  composed error first exceeds the multiple: the prefix before it is within it.

``"modules"``: drift across the whole model, by ``nn.Module``. The model runs three times (a float64 copy,
  eager, compiled with the neuron backend) with a forward hook on every submodule; the flagged submodule
  calls in call order (the first is where the forward's drift enters), then each module's own parameters'
  gradients, modules in backward order (last called first). When only gradients drift, the called children
  of the model are compiled ALONE in the eager model, the step's outputs and gradients judged, then the
  children of the worst one that drifts, until none does: the last one brings the drift. This method alone
  compares with the user's eager model, so it alone sees what the captured graphs themselves change (a
  decomposition computing an op in more, lower-precision steps than eager's kernel).

Not seen: random ops (``torch.rand``; dropout is turned off: their draws differ by design), view ops (they
move no values), and user kernels (``nki_op``): their only float64 "reference" is the kernel itself, run
on float64 inputs at its own precision, so they are listed as not judged. The ops method misses what only
happens between ops (XLA fusing two roundings into one, an error that grows through a chain): the prefix
and modules methods are for that. See docs/bisect.md.
"""

from __future__ import annotations

import contextlib
import copy
import math
import operator
import signal
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
#: ``bisect``'s methods: each op alone, prefixes of each graph, the model's submodules.
METHODS = ("ops", "prefix", "modules")

#: Ops that only write a graph input (AOTAutograd's input mutations at the end of a graph): nothing to judge.
_NOT_JUDGED = {"aten.copy_.default", "aten.set_.source_Tensor", "aten.resize_.default"}


@dataclass
class OpFinding:
    """One aten node of one graph, judged: its figures and where it came from.

    The ops method judges the node alone; the prefix method gives the node where a graph's composed error
    first exceeds the multiple, with the figures of the prefix ending there."""

    graph: str
    #: Position of the node among the judged nodes of its graph (0 = first); the prefix method: among the
    #: nodes a prefix may end at.
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
    #: The prefix method: the value whose figures these are when it is not the node's own (another value the
    #: prefix hands on); "" otherwise.
    value: str = ""

    def describe(self) -> str:
        noise = "; ill-conditioned here: not flagged" if self.ill_conditioned else ""
        of = f" (figures of value {self.value})" if self.value else ""
        return (
            f"{self.graph} #{self.index} {self.node} = {self.op}({self.inputs})"
            f"{f' (result {self.output})' if self.output else ''}\n"
            f"    at {self.source}\n"
            f"    {self.dtype}{of}: compiled error {self.compiled_error:.3g} vs eager {self.eager_error:.3g} "
            f"({_ratio(self.ratio)}; elementwise max {self.compiled_max_error:.3g} vs {self.eager_max_error:.3g}{noise})"
        )


@dataclass
class ModuleFinding:
    """One submodule call's output, or one module's parameters' gradients, judged (the modules method)."""

    #: Qualified name in the model ("<root>" for the model itself).
    module: str
    #: Its class name.
    kind: str
    #: "output" (of call ``call``), "grad" (of the module's own parameters, the worst one named by
    #: ``tensor``) or "alone" (the module compiled alone in the eager model: the step's worst output or
    #: gradient, named by ``tensor``).
    what: str
    call: int
    #: Which tensor the figures are of: "output N" (its position among the floating outputs), a parameter,
    #: or (``alone``) "output N" / "gradient of P" of the whole step.
    tensor: str
    dtype: str
    eager_error: float
    compiled_error: float
    ratio: float
    eager_max_error: float
    compiled_max_error: float
    flagged: bool
    ill_conditioned: bool = False

    def describe(self) -> str:
        noise = "; ill-conditioned here: not flagged" if self.ill_conditioned else ""
        where = {
            "output": f"output of call {self.call} ({self.tensor})",
            "grad": f"gradient of {self.tensor}",
            "alone": f"compiled alone in the eager model: the step's {self.tensor}",
        }[self.what]
        return (
            f"{self.module} ({self.kind}): {where}\n"
            f"    {self.dtype}: compiled error {self.compiled_error:.3g} vs eager {self.eager_error:.3g} "
            f"({_ratio(self.ratio)}; elementwise max {self.compiled_max_error:.3g} vs {self.eager_max_error:.3g}{noise})"
        )


@dataclass
class PrefixProbe:
    """One compiled prefix of a graph (the prefix method): up to node ``index``, judged on every value it
    hands to the rest of the graph; the figures are of the worst of them."""

    index: int
    node: str
    #: The value with the worst ratio (flagged ones first), and its figures.
    value: str
    dtype: str
    eager_error: float
    compiled_error: float
    ratio: float
    eager_max_error: float
    compiled_max_error: float
    failed: bool


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
    #: User kernels (nki_op) called in the graph: never judged (no reference but themselves).
    user_kernels: list[str] = field(default_factory=list)
    #: The prefix method: every prefix compiled, the whole graph first.
    probes: list[PrefixProbe] = field(default_factory=list)


@dataclass
class BisectReport:
    """What ``bisect`` found. ``findings``: the ops method's flagged ops in graph order; the prefix method's
    entry node of each graph that drifts; the modules method's flagged module calls (forward, in call order)
    then gradients (in backward order). ``ops`` / ``modules``: everything judged."""

    model: str
    mode: str
    multiple: float
    floor_eps: float
    graphs: list[GraphSummary] = field(default_factory=list)
    ops: list[OpFinding] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: How many findings ``str()`` prints (all are in ``to_dict``).
    limit: int = 10
    method: str = "ops"
    #: The prefix method: per graph that drifts, the node where its composed error first exceeds the multiple.
    entries: list[OpFinding] = field(default_factory=list)
    #: The modules method: every judged module call output and module gradient.
    modules: list[ModuleFinding] = field(default_factory=list)
    #: What the reader must know about the figures (a float32 reference where float64 failed, ...).
    notes: list[str] = field(default_factory=list)
    #: The modules method: where the drift enters, in words ("" when nothing drifts).
    entry: str = ""

    @property
    def findings(self) -> list[Any]:
        if self.method == "prefix":
            return list(self.entries)
        if self.method == "modules":  # forward outputs, then modules compiled alone, then gradients
            flagged = [f for f in self.modules if f.flagged]
            return sorted(flagged, key=lambda f: ("output", "alone", "grad").index(f.what))
        return [f for f in self.ops if f.flagged]

    @property
    def ok(self) -> bool:
        judged = self.modules if self.method == "modules" else self.graphs
        return not self.findings and not self.errors and bool(judged)

    def worst(self, n: int = 5) -> list[Any]:
        """The n judged ops (or module calls) with the largest compiled/eager ratio (flagged or not;
        ill-conditioned ones last)."""
        judged: list[Any] = self.modules if self.method == "modules" else self.ops
        return sorted(judged, key=lambda f: (f.ill_conditioned, -f.ratio))[:n]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "model": self.model,
            "mode": self.mode,
            "method": self.method,
            "multiple": self.multiple,
            "floor_eps": self.floor_eps,
            "graphs": [asdict(g) for g in self.graphs],
            "findings": [asdict(f) for f in self.findings],
            "worst": [asdict(f) for f in self.worst()],
            "judged": len(self.modules if self.method == "modules" else self.ops),
            "entry": self.entry,
            "notes": self.notes,
            "errors": self.errors,
        }

    def __str__(self) -> str:
        what = {"ops": "an op is flagged", "prefix": "a prefix of a graph is flagged",
                "modules": "a module's output or gradient is flagged"}[self.method]  # fmt: skip
        lines = [
            f"neuron-compile bisect: {self.model} ({self.mode}, method {self.method}); {what} when its compiled "
            f"error exceeds {self.multiple:g}x eager's (floor {self.floor_eps:g} eps of its dtype)"
        ]
        for g in self.graphs:
            if self.method == "prefix":
                lines.append(f"  {g.name} ({g.kind}): {g.nodes} nodes, {len(g.probes)} prefix(es) compiled, "
                             f"{len(g.skipped)} skipped ({g.seconds:.1f} s)")  # fmt: skip
                if g.probes:
                    whole = g.probes[0]
                    lines.append(f"    whole graph: worst value {whole.value}, compiled error {whole.compiled_error:.3g} "
                                 f"vs eager {whole.eager_error:.3g} ({_ratio(whole.ratio)})")  # fmt: skip
            else:
                lines.append(f"  {g.name} ({g.kind}): {g.nodes} nodes, {g.judged} judged, {g.flagged} flagged, "
                             f"{len(g.skipped)} skipped ({g.seconds:.1f} s)")  # fmt: skip
            if g.user_kernels:
                lines.append(f"    not judged: {len(g.user_kernels)} user kernel call(s) ({', '.join(sorted(set(g.user_kernels)))}): "
                             "an nki_op's only reference is itself (docs/bisect.md)")  # fmt: skip
            other = [s for s in g.skipped if "user kernel" not in s]
            lines += [f"    skipped {s}" for s in other[:5]]
            if len(other) > 5:
                lines.append(f"    ... and {len(other) - 5} more skipped")
        if self.method == "modules" and self.modules:
            outputs = [m for m in self.modules if m.what == "output"]
            grads = [m for m in self.modules if m.what == "grad"]
            alone = [m for m in self.modules if m.what == "alone"]
            lines.append(f"  forward: {len(outputs)} module call(s) judged, {sum(m.flagged for m in outputs)} flagged; "
                         f"backward: {len(grads)} module(s)' parameter gradients judged, "
                         f"{sum(m.flagged for m in grads)} flagged")  # fmt: skip
            if alone:
                lines.append(f"  compiled alone in the eager model: {len(alone)} module(s), "
                             f"{sum(m.flagged for m in alone)} making the step drift")  # fmt: skip
        found = self.findings
        if found and self.method == "prefix":
            lines.append("drift enters (per graph, the node whose prefix first exceeds the multiple):")
            lines += ["  " + f.describe().replace("\n", "\n  ") for f in found]
        elif found:
            if self.method == "modules":
                lines.append(f"drift enters at: {self.entry}")
                order = ("flagged module results: outputs in call order, modules compiled alone, gradients in "
                         "backward order")  # fmt: skip
            else:
                order = "flagged ops, in graph order"
            lines.append(f"first {min(len(found), self.limit)} of {len(found)} {order}:")
            lines += ["  " + f.describe().replace("\n", "\n  ") for f in found[: self.limit]]
        elif self.graphs or self.modules:
            lines.append({"ops": "no op flagged: every compiled op is within the multiple of eager's error",
                          "prefix": "no prefix flagged: every value of every graph, composed, is within the multiple "
                                    "of eager's error",
                          "modules": "no module flagged: every module output and gradient is within the multiple "
                                     "of eager's error"}[self.method])  # fmt: skip
        worst = [f for f in self.worst(3) if not f.flagged]
        noisy = sum(f.ill_conditioned for f in (self.modules if self.method == "modules" else self.ops))
        if noisy:
            lines.append(f"{noisy} value(s) ill-conditioned at these inputs (eager error > sqrt(eps)): not judged")
        if worst:
            lines.append("closest calls not flagged:")
            lines += ["  " + f.describe().replace("\n", "\n  ") for f in worst]
        lines += [f"note: {n}" for n in self.notes]
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
# --- 2./3. reference, eager and compiled values of every node --------------------------------------------


def _leaves(value: Any) -> list[Any]:
    return pytree.tree_leaves(value)


def _is_view(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and any(r.alias_info is not None and not r.alias_info.is_write
                                                   for r in schema.returns))  # fmt: skip


def _random(node: torch.fx.Node) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _user_kernel(node: torch.fx.Node) -> str | None:
    """The op name of an ``nki_op`` user kernel the node calls (directly or through auto_functionalized)."""
    from ..kernels.user_ops import user_kernel

    for target in (node.target, node.args[0] if node.args else None):
        if isinstance(target, torch._ops.OpOverload) and user_kernel(target) is not None:
            return str(target)
    return None


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


_USER_KERNEL_REASON = (
    "a user kernel (nki_op): not judged. Its only float64 'reference' would be the kernel itself run on float64 "
    "inputs, at the kernel's own precision (a kernel that rounds to bfloat16 would read an error of 0), and "
    "nki_op records no reference of its own: check it against one of yours (docs/bisect.md)"
)


class _Walk:
    """The reference walk of one graph: each node's reference value, and the value eager is fed.

    ``chained=False`` (the ops method): each node is fed its inputs' reference values rounded to the graph's
    dtype, so that it is judged alone. ``chained=True`` (the prefix method): the graph runs twice from its
    recorded inputs, eager at the model's dtype on eager's values (``low``) and the reference on the
    reference's (``ref``), so that errors compose as in the model."""

    def __init__(self, entry: _Captured, *, chained: bool = False) -> None:
        self.gm = entry.gm
        self.chained = chained
        self.ref: dict[torch.fx.Node, Any] = {}
        self.low: dict[torch.fx.Node, Any] = {}
        self.judged: list[_Judged] = []
        self.skipped: list[str] = []
        self.user_kernels: list[str] = []
        #: Nodes whose value is not comparable: user kernels (their reference is themselves), random draws
        #: (compiled draws its own) and, in a chained walk, everything computed from a draw.
        self.unjudgeable: set[torch.fx.Node] = set()
        self._drawn: set[torch.fx.Node] = set()
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

    def _has_value(self, node: torch.fx.Node) -> bool:
        return self.ref.get(node) is not None and (not self.chained or self.low.get(node) is not None)

    def _node(self, node: torch.fx.Node) -> None:
        if self.chained and any(a in self._drawn for a in node.all_input_nodes):
            self._drawn.add(node)
            self.unjudgeable.add(node)
        if node.target is operator.getitem:
            parent, i = node.args
            self.ref[node] = self.ref[parent][i] if self.ref.get(parent) is not None else None
            if self.chained:
                self.low[node] = self.low[parent][i] if self.low.get(parent) is not None else None
            return
        leaves = [v for v in _leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
        if not leaves:  # asserts, symbolic sizes: nothing to judge, nothing a tensor op consumes
            self.ref[node] = None
            return
        missing = [a.name for a in node.all_input_nodes if not self._has_value(a)]
        if missing:
            self._skip(node, f"its input {missing[0]} has no value (skipped itself)")
            return
        low_args, low_kwargs = pytree.tree_map_only(torch.fx.Node, self.rounded, (node.args, node.kwargs))
        ref_args, ref_kwargs = (
            pytree.tree_map_only(torch.fx.Node, self.ref.__getitem__, (node.args, node.kwargs))
            if self.chained
            else (low_args, low_kwargs)
        )
        try:
            eager = node.target(*low_args, **low_kwargs)
        except Exception as e:
            self._skip(node, f"eager failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
            return
        if self.chained:
            self.low[node] = eager
        if _random(node):  # a draw: the reference takes eager's, nothing to judge
            self.ref[node] = _widen(eager, torch.float64)
            self._drawn.add(node)
            self.unjudgeable.add(node)
            return
        reference = None
        for wide in (torch.float64, torch.float32):  # float32 where an op has no float64 kernel
            try:
                reference = node.target(*_widen(ref_args, wide), **_widen(ref_kwargs, wide))
                break
            except Exception as e:
                why = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        if reference is None:
            self.ref[node] = _widen(eager, torch.float64)
            self._skip(node, f"no reference ({why})")
            return
        self.ref[node] = reference
        kernel = _user_kernel(node)
        if kernel is not None:
            self.user_kernels.append(kernel)
            self.unjudgeable.add(node)
            self._skip(node, _USER_KERNEL_REASON)
            return
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


@dataclass
class _Judgement:
    """Compiled and eager against the reference, for one tensor."""

    dtype: torch.dtype
    eager_error: float
    compiled_error: float
    ratio: float
    eager_max_error: float
    compiled_max_error: float
    flagged: bool
    ill_conditioned: bool

    @property
    def key(self) -> tuple[bool, bool, float]:
        """Worse first when sorted descending: flagged, then judged (not noise), then by ratio."""
        return self.flagged, not self.ill_conditioned, self.ratio

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")


def _judgement(eager: Any, ref: torch.Tensor, comp: Any, multiple: float, floor_eps: float) -> _Judgement:
    dtype = eager.dtype if isinstance(eager, torch.Tensor) else ref.dtype
    e_norm, e_max = _errors(eager, ref) if isinstance(eager, torch.Tensor) else (math.inf, math.inf)
    c_norm, c_max = _errors(comp, ref) if isinstance(comp, torch.Tensor) else (math.inf, math.inf)
    eps = torch.finfo(dtype).eps if (dtype.is_floating_point or dtype.is_complex) else 0.0
    base = max(e_norm, floor_eps * eps)
    ratio = c_norm / base if base > 0 else (0.0 if c_norm == 0 else math.inf)
    if math.isnan(ratio):
        ratio = math.inf
    noise = eps > 0 and e_norm > math.sqrt(eps)
    return _Judgement(dtype, e_norm, c_norm, ratio, e_max, c_max, c_norm > multiple * base and not noise, noise)


def _judge(
    walk: _Walk, compiled: dict[torch.fx.Node, list[Any]], graph: str, multiple: float, floor_eps: float
) -> list[OpFinding]:
    found = []
    for index, j in enumerate(walk.judged):
        worst: tuple[int, _Judgement] | None = None
        for position, ref, eager, comp in zip(j.positions or [0], j.reference, j.eager, compiled[j.node]):
            if not isinstance(ref, torch.Tensor):
                continue
            v = _judgement(eager, ref, comp, multiple, floor_eps)
            if worst is None or (v.flagged, v.ratio) > (worst[1].flagged, worst[1].ratio):
                worst = position, v
        if worst is not None:
            position, v = worst
            found.append(
                OpFinding(
                    graph, index, j.node.name, op_name(j.node), describe_inputs(j.node), user_source(j.node),
                    v.dtype_name, v.eager_error, v.compiled_error, v.ratio, v.eager_max_error, v.compiled_max_error,
                    v.flagged, v.ill_conditioned, position,
                )
            )  # fmt: skip
    return found


# --- the prefix method ------------------------------------------------------------------------------------


def _comparable(walk: _Walk, node: torch.fx.Node) -> bool:
    """A floating value both runs of a chained walk have, computed by neither a random op nor a user kernel."""
    low, ref = walk.low.get(node), walk.ref.get(node)
    return (
        node.op == "call_function"
        and node not in walk.unjudgeable
        and isinstance(low, torch.Tensor)
        and isinstance(ref, torch.Tensor)
        and (low.is_floating_point() or low.is_complex())
        and isinstance(node.meta.get("val"), torch.Tensor)
    )


class _Prefixes:
    """Prefixes of one captured graph, compiled for the CPU target and judged against a chained walk."""

    def __init__(self, entry: _Captured, walk: _Walk, options: Mapping[str, Any], multiple: float, floor_eps: float):
        from ..options import Options

        self.entry, self.walk, self.multiple, self.floor_eps = entry, walk, multiple, floor_eps
        self.opts = Options.from_user({**options, "cache": False, "target": "cpu"})
        self.nodes = [n for n in entry.gm.graph.nodes if n.op != "output"]
        # where a prefix may end: a node computing new floating values (not a view, a getitem or a write)
        self.cuts = [n for n in self.nodes if _comparable(walk, n) and n.target is not operator.getitem
                     and not _is_view(n) and op_name(n) not in _NOT_JUDGED]  # fmt: skip
        self.position = {n: i for i, n in enumerate(self.nodes)}

    def _kept(self, cut: torch.fx.Node) -> list[torch.fx.Node]:
        """The nodes of the prefix ending at ``cut``, in graph order: those before it that compute something
        (not input writes, nor what depends on one), with the getitems of any tuple it makes."""
        end = self.position[cut]
        dropped: set[torch.fx.Node] = set()
        kept: list[torch.fx.Node] = []
        for n in self.nodes[: end + 1]:
            if n.op == "call_function" and (op_name(n) in _NOT_JUDGED or any(a in dropped for a in n.all_input_nodes)):
                dropped.add(n)
            else:
                kept.append(n)
        inside = set(kept)
        for n in self.nodes[end + 1 :]:
            if n.target is operator.getitem and n.args[0] in inside:
                kept.append(n)
        return kept

    def probe(self, k: int) -> PrefixProbe:
        from ..compiler import compile_graph

        cut = self.cuts[k]
        kept = self._kept(cut)
        inside = set(kept)
        handed_on = [
            n for n in kept
            if _comparable(self.walk, n) and (n is cut or any(u not in inside for u in n.users))
        ]  # fmt: skip
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for n in kept:
            env[n] = graph.node_copy(n, lambda a: env[a])
        graph.output(tuple(env[n] for n in handed_on))
        gm = torch.fx.GraphModule(self.entry.gm, graph)
        inputs = list(self.entry.inputs or [])
        fn = compile_graph(gm, inputs, opts=self.opts, kind="inference", name=f"bisect_{self.entry.name}_prefix{k}")
        with torch.no_grad():
            results = list(fn([_snapshot(x) for x in inputs]))
        worst: tuple[torch.fx.Node, _Judgement] | None = None
        for n, got in zip(handed_on, results):
            v = _judgement(self.walk.low[n], self.walk.ref[n], got, self.multiple, self.floor_eps)
            if worst is None or v.key > worst[1].key:
                worst = n, v
        assert worst is not None  # the cut itself is always handed on
        n, v = worst
        return PrefixProbe(k, cut.name, n.name, v.dtype_name, v.eager_error, v.compiled_error, v.ratio,
                           v.eager_max_error, v.compiled_max_error, v.flagged)  # fmt: skip

    def entry_finding(self, probe: PrefixProbe) -> OpFinding:
        """The node where the prefix first fails, with the figures of the value flagged (its own, or one
        the prefix hands on)."""
        cut = self.cuts[probe.index]
        return OpFinding(
            self.entry.name, probe.index, cut.name, op_name(cut), describe_inputs(cut), user_source(cut),
            probe.dtype, probe.eager_error, probe.compiled_error, probe.ratio, probe.eager_max_error,
            probe.compiled_max_error, True, False, 0, "" if probe.value == cut.name else probe.value,
        )  # fmt: skip


def _bisect_prefixes(prefixes: _Prefixes, say: Callable[[str], None]) -> tuple[list[PrefixProbe], OpFinding | None]:
    """The first prefix that fails, by bisection over where it ends (the whole graph is probed first: when it
    holds, that is the one compile). Returns every probe and the entry node (None: the graph holds)."""
    last = len(prefixes.cuts) - 1
    if last < 0:
        return [], None
    whole = prefixes.probe(last)
    probes = [whole]
    if not whole.failed:
        return probes, None
    passed, failed = -1, whole  # prefix -1 (nothing run) holds by definition
    while failed.index - passed > 1:
        mid = (passed + failed.index) // 2
        probe = prefixes.probe(mid)
        probes.append(probe)
        say(f"{prefixes.entry.name}: prefix up to #{mid} ({probe.node}) {'fails' if probe.failed else 'holds'}")
        if probe.failed:
            failed = probe
        else:
            passed = mid
    return probes, prefixes.entry_finding(failed)


# --- the modules method -----------------------------------------------------------------------------------


@dataclass
class _ModuleRun:
    #: Every submodule call in order: (qualified name, class name, its floating outputs); empty without hooks.
    calls: list[tuple[str, str, list[torch.Tensor]]]
    #: Parameter name -> its gradient (training).
    grads: dict[str, torch.Tensor]
    #: The step's floating outputs (the model's, and the loss when training).
    outputs: list[torch.Tensor]


def _floating(value: Any) -> list[torch.Tensor]:
    leaves = pytree.tree_leaves(dict(value.items()) if hasattr(value, "to_tuple") else value)
    return [x for x in leaves if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())]


def _module_run(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    step: Any,
    *,
    dtype: torch.dtype | None = None,
    options: Mapping[str, Any] | None = None,
    alone: str | None = None,
) -> _ModuleRun:
    """One step of a copy of ``model``: in eager, in ``dtype`` (parameters and floating inputs cast) when
    given, or compiled with the neuron backend when ``options`` is given -- the whole model with a forward
    hook on every submodule, or (``alone``: a submodule's qualified name) only that submodule, the rest
    in eager."""
    from .runner import _disable_dropout

    run = copy.deepcopy(model)
    _disable_dropout(run)
    if dtype is not None:
        run = run.to(dtype)
        args, kwargs = pytree.tree_map_only(
            torch.Tensor,
            lambda x: x.detach().to(dtype).requires_grad_(x.requires_grad) if x.is_floating_point() else x,
            (args, kwargs),
        )
    calls: list[tuple[str, str, list[torch.Tensor]]] = []

    def hook(name: str) -> Callable[..., None]:
        def record(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            calls.append((name, type(module).__name__, [x.detach().clone() for x in _floating(output)]))

        return record

    handles = [] if alone else [m.register_forward_hook(hook(name or "<root>")) for name, m in run.named_modules()]
    fn: Any = run
    if options is not None:
        torch._dynamo.reset()
        compile_options = {**options, "cache": False}
        if alone:
            parent, _, attr = alone.rpartition(".")
            owner = run.get_submodule(parent)
            owner._modules[attr] = torch.compile(owner._modules[attr], backend="neuron", dynamic=False,
                                                 options=compile_options)  # fmt: skip
        else:
            fn = torch.compile(run, backend="neuron", dynamic=False, options=compile_options)
    try:
        out = step(fn, run, args, kwargs)
    finally:
        for h in handles:
            h.remove()
        if options is not None:
            torch._dynamo.reset()
    # a compiled submodule's parameters are named through its wrapper (torch.compile's OptimizedModule)
    grads = {k.removeprefix("grad:").replace("._orig_mod.", "."): g for k, g in out["grads"].items()}
    return _ModuleRun(calls, grads, _floating(out["outputs"]))


def _worst_of_step(
    ref: _ModuleRun, eager: _ModuleRun, run: _ModuleRun, multiple: float, floor_eps: float
) -> tuple[str, _Judgement]:
    """The model's output or parameter gradient of ``run`` furthest past eager's error (flagged first)."""
    judged = [(f"output {i}", _judgement(e, r, c, multiple, floor_eps))
              for i, (r, e, c) in enumerate(zip(ref.outputs, eager.outputs, run.outputs))]  # fmt: skip
    judged += [(f"gradient of {p}", _judgement(eager.grads.get(p), g, run.grads.get(p), multiple, floor_eps))
               for p, g in ref.grads.items()]  # fmt: skip
    return max(judged, key=lambda tv: tv[1].key)


def _called_children(model: torch.nn.Module, name: str, called: set[str]) -> list[str]:
    """The nearest submodules of ``name`` that are called (a ModuleList or ModuleDict is not: its items
    are), by qualified name."""
    found: list[str] = []
    module = model.get_submodule(name)
    for child, _ in module.named_children():
        qualified = f"{name}.{child}" if name else child
        found += [qualified] if qualified in called else _called_children(model, qualified, called)
    return found


def _judge_modules(
    ref: _ModuleRun, eager: _ModuleRun, comp: _ModuleRun, multiple: float, floor_eps: float
) -> list[ModuleFinding]:
    names = [[c[0] for c in run.calls] for run in (ref, eager, comp)]
    if not names[0] == names[1] == names[2]:
        first = next(
            (i for i, abc in enumerate(zip(*names)) if len(set(abc)) > 1), min(len(n) for n in names)
        )  # fmt: skip
        raise RuntimeError(
            f"the module calls differ between the float64, eager and compiled runs at call {first} "
            f"({[n[first] if first < len(n) else '(none)' for n in names]}): the model's control flow depends on "
            "its values, so its modules cannot be compared call by call; use method='prefix' or 'ops'"
        )
    found: list[ModuleFinding] = []
    count: dict[str, int] = {}
    for (name, kind, r_out), (_, _, e_out), (_, _, c_out) in zip(ref.calls, eager.calls, comp.calls):
        call = count.get(name, 0)
        count[name] = call + 1
        judged = [(i, _judgement(e, r, c, multiple, floor_eps)) for i, (r, e, c) in enumerate(zip(r_out, e_out, c_out))]
        if judged:
            i, v = max(judged, key=lambda iv: iv[1].key)
            found.append(ModuleFinding(name, kind, "output", call, f"output {i}", v.dtype_name, v.eager_error,
                                       v.compiled_error, v.ratio, v.eager_max_error, v.compiled_max_error, v.flagged,
                                       v.ill_conditioned))  # fmt: skip
    # gradients: by owning module, in backward order (the module called last first)
    kinds = {name: kind for name, kind, _ in ref.calls}
    order = list(dict.fromkeys(name for name, _, _ in reversed(ref.calls)))
    owners: dict[str, list[str]] = {}
    for param in ref.grads:
        owner = param.rpartition(".")[0] or "<root>"
        owners.setdefault(owner, []).append(param)
    for owner in sorted(owners, key=lambda o: order.index(o) if o in order else len(order)):
        judged = [(p, _judgement(eager.grads.get(p), ref.grads[p], comp.grads.get(p), multiple, floor_eps))
                  for p in owners[owner]]  # fmt: skip
        p, v = max(judged, key=lambda pv: pv[1].key)
        found.append(ModuleFinding(owner, kinds.get(owner, "?"), "grad", 0, p, v.dtype_name, v.eager_error,
                                   v.compiled_error, v.ratio, v.eager_max_error, v.compiled_max_error, v.flagged,
                                   v.ill_conditioned))  # fmt: skip
    return found


# --- the function -----------------------------------------------------------------------------------------


def _one_line(e: BaseException) -> str:
    from .runner import PhaseTimeout

    seen: BaseException | None = e
    while seen is not None:  # a timeout raised inside Dynamo or a compile arrives wrapped
        if isinstance(seen, PhaseTimeout):
            return str(seen)
        seen = seen.__cause__ or seen.__context__
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def bisect(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    loss_fn: LossFn | None = None,
    method: str = "ops",
    multiple: float = DEFAULT_MULTIPLE,
    floor_eps: float = DEFAULT_FLOOR_EPS,
    options: Mapping[str, Any] | None = None,
    progress: bool = True,
    limit: int = 10,
    phase_timeout: float | None = None,
) -> BisectReport:
    """Find where ``model``'s compiled numerics become less precise than eager's: compiled vs eager, each
    against a float64 reference of the same computation (module docstring: the methods). Returns a
    ``BisectReport`` whose ``findings`` are, by ``method``: ``"ops"``, every aten op whose compiled error,
    judged alone, exceeds ``multiple`` x eager's, in graph order; ``"prefix"``, per graph, the node where
    the graph's composed error first exceeds it; ``"modules"``, the submodule calls (then module gradients)
    that exceed it, the first being where the drift enters. Each with its source and figures.

    ``example_inputs``, ``loss_fn``: as ``evaluate``'s (a model in training mode with trainable parameters
    is judged on forward, loss and backward). ``floor_eps``: the floor of eager's error, in units of the
    result dtype's epsilon. ``options``: the backend's (the bisect compiles for the CPU target, without
    the compile cache). ``limit``: findings ``str(report)`` prints. ``phase_timeout``: seconds each phase
    may take (capture, each graph, each run of the model; main thread only, as ``evaluate``'s: it interrupts
    Python code, not a native call until it returns); a phase past it is an error of the report and the
    next phase goes on. The model is not changed (deep copies run); Dynamo is reset before and after.
    """
    if method not in METHODS:
        raise ValueError(f"bisect: method={method!r}; need one of {', '.join(METHODS)}")
    if not (1.0 <= multiple < math.inf):
        raise ValueError(f"bisect: multiple={multiple}; need a finite number >= 1")
    if not (0.0 <= floor_eps < math.inf):
        raise ValueError(f"bisect: floor_eps={floor_eps}; need a finite number >= 0")
    if phase_timeout is not None and not (0 < phase_timeout < math.inf):
        raise ValueError(f"bisect: phase_timeout={phase_timeout}; need a finite number of seconds > 0")
    from .runner import _PhaseAlarm, _split_inputs, _Step

    args, kwargs = _split_inputs(example_inputs)
    training = model.training and any(p.requires_grad for p in model.parameters())
    report = BisectReport(type(model).__name__, "training" if training else "inference", multiple, floor_eps,
                          limit=limit, method=method)  # fmt: skip
    alarm = _PhaseAlarm(phase_timeout)

    def phase(name: str, message: str) -> None:
        if progress:
            print(f"[neuron bisect] {name}: {message}", file=sys.stderr, flush=True)
        alarm.start(name)

    def failed(name: str, e: Exception) -> None:
        if phase_timeout is not None:  # no second alarm while the report is written; the next phase rearms
            signal.setitimer(signal.ITIMER_REAL, 0)
        report.errors.append(f"{name}: {_one_line(e)}")

    def say(message: str) -> None:
        if progress:
            print(f"[neuron bisect] {message}", file=sys.stderr, flush=True)

    step = _Step(training, loss_fn)
    try:
        if method == "modules":
            _bisect_modules(model, args, kwargs, step, dict(options or {}), report, phase, failed)
            return report
        phase("capture", "the model's graphs (one step through the neuron backend, graphs run in eager)")
        try:
            captured = _capture(model, args, kwargs, step, dict(options or {}))
        except Exception as e:
            failed("capture", e)
            return report
        for entry in captured:
            t0 = time.perf_counter()
            try:
                if method == "prefix":
                    phase(entry.name, "eager and float64 runs node by node, then prefixes compiled, by bisection")
                    walk = _Walk(entry, chained=True)
                    walk.run()
                    probes, found = _bisect_prefixes(_Prefixes(entry, walk, dict(options or {}), multiple,
                                                               floor_eps), say)  # fmt: skip
                    report.entries += [found] if found is not None else []
                    summary = GraphSummary(entry.name, entry.kind, walk.nodes, len(probes), int(found is not None),
                                           walk.skipped, probes=probes)  # fmt: skip
                else:
                    phase(entry.name, "reference, eager and compiled values of every node")
                    walk = _Walk(entry)
                    walk.run()
                    ops = _judge(walk, _compiled_values(walk, entry.name, dict(options or {})), entry.name,
                                 multiple, floor_eps)  # fmt: skip
                    report.ops += ops
                    summary = GraphSummary(entry.name, entry.kind, walk.nodes, len(ops), sum(o.flagged for o in ops),
                                           walk.skipped)  # fmt: skip
            except Exception as e:
                failed(entry.name, e)
                continue
            summary.user_kernels = walk.user_kernels
            summary.seconds = time.perf_counter() - t0
            report.graphs.append(summary)
        if not captured:
            report.errors.append("no graph reached the backend (nothing compiled: is the model's forward empty?)")
    finally:
        alarm.stop()
    return report


def _bisect_modules(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    step: Any,
    options: dict[str, Any],
    report: BisectReport,
    phase: Callable[[str, str], None],
    failed: Callable[[str, Exception], None],
) -> None:
    stage = "float64 run"
    options = {**options, "target": "cpu"}
    try:
        phase(stage, "the model's float64 copy, every submodule's output recorded")
        try:
            reference = _module_run(model, args, kwargs, step, dtype=torch.float64)
        except Exception as e:  # some ops have no float64 kernel on CPU
            report.notes.append(f"the float64 copy failed ({_one_line(e)}); the reference is a float32 copy")
            reference = _module_run(model, args, kwargs, step, dtype=torch.float32)
        stage = "eager run"
        phase(stage, "the model in eager, every submodule's output recorded")
        eager = _module_run(model, args, kwargs, step)
        stage = "compiled run"
        phase(stage, "the model compiled (neuron backend, CPU target), every submodule's output recorded")
        compiled = _module_run(model, args, kwargs, step, options=options)
        stage = "judgement"
        phase(stage, "every module call's output and every module's gradients")
        report.modules = _judge_modules(reference, eager, compiled, report.multiple, report.floor_eps)
    except Exception as e:
        failed(stage, e)
        return
    forward = [m for m in report.modules if m.what == "output" and m.flagged]
    if forward:
        report.entry = forward[0].describe().split("\n")[0]
    elif any(m.flagged for m in report.modules):
        _descend(model, args, kwargs, step, options, reference, eager, report, phase, failed)


def _descend(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    step: Any,
    options: dict[str, Any],
    reference: _ModuleRun,
    eager: _ModuleRun,
    report: BisectReport,
    phase: Callable[[str, str], None],
    failed: Callable[[str, Exception], None],
) -> None:
    """The forward holds but gradients drift: compile each called child of the model alone, the rest in
    eager, and judge the step's outputs and gradients; then the children of the worst flagged one, until
    none is flagged. The last flagged module brings the drift; none of its parts does alone."""
    called = {name for name, _, _ in reference.calls}
    kinds = {name: kind for name, kind, _ in reference.calls}
    parent, path = "", []
    while True:
        flagged = []
        for child in _called_children(model, parent, called):
            stage = f"{child} alone"
            try:
                phase(stage, "compiled alone in the eager model; the step's outputs and gradients judged")
                run = _module_run(model, args, kwargs, step, options=options, alone=child)
            except Exception as e:
                failed(stage, e)
                continue
            tensor, v = _worst_of_step(reference, eager, run, report.multiple, report.floor_eps)
            finding = ModuleFinding(child, kinds.get(child, "?"), "alone", 0, tensor, v.dtype_name, v.eager_error,
                                    v.compiled_error, v.ratio, v.eager_max_error, v.compiled_max_error, v.flagged,
                                    v.ill_conditioned)  # fmt: skip
            report.modules.append(finding)
            flagged += [finding] if finding.flagged else []
        if not flagged:
            break
        worst = max(flagged, key=lambda f: f.ratio)
        path.append(worst)
        parent = worst.module
    if path:
        report.entry = (
            f"{path[-1].module} ({path[-1].kind}): compiled alone in the eager model, the step's {path[-1].tensor} "
            f"drifts ({_ratio(path[-1].ratio)}); none of its submodules alone does (path: "
            f"{' > '.join(f'{p.module} {_ratio(p.ratio)}' for p in path)})"
        )
    else:
        report.entry = (
            "the whole model only: compiled alone, no submodule makes the step drift; the drift is composed "
            "across modules (try method='prefix')"
        )
