"""Error classes raised by the neuron backend.

All derive from ``RuntimeError`` on purpose: Dynamo turns a few exception kinds (fake-tensor
"unsupported operator") into a silent graph break, and anything else into ``BackendCompilerFailed``.
A user of this backend must see the failure, never a quiet fallback to eager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_OPS_HINT = (
    "See neuron_compile.supported_ops() or docs/ops.md for what is supported. To run the rest of the "
    "model anyway, move the offending code out of the compiled region (e.g. torch.compiler.disable) "
    "or rewrite it with supported ops."
)


class NeuronCompileError(RuntimeError):
    """Base class of every error this backend raises on purpose."""


@dataclass
class UnsupportedNode:
    """One graph node that cannot be compiled for the target, and why.

    ``node`` is the FX node's name in its graph ('' when not from a node: a graph input, an HLO op without
    one). ``follows`` is set on a follow-up: the name of the node in the same error whose refusal it only
    restates, because its inputs come from that node's value (the ``sym_size`` of ``x[mask]``)."""

    op: str
    inputs: str
    source: str
    reason: str = ""
    node: str = ""
    follows: str = ""

    @classmethod
    def from_node(cls, node: Any, reason: str, follows: Any = None) -> UnsupportedNode:
        """The entry for FX ``node``: its op, input shapes/dtypes and the user's source line (from the
        node's provenance); for ``node=None`` (the failing node is unknown), the whole graph.
        ``follows``: the FX node whose refusal this one follows from (data flow), if any."""
        if node is None:
            return cls(op="graph", inputs="", source="<unknown source line>", reason=reason)
        # Imported here: this module is imported by everything and must stay free of torch.fx work.
        from . import provenance

        return cls(
            op=provenance.op_name(node),
            inputs=provenance.describe_inputs(node),
            source=provenance.user_source(node),
            reason=reason,
            node=node.name,
            follows=follows.name if follows is not None else "",
        )

    def describe(self, root: UnsupportedNode | None = None) -> str:
        """One line of the error; ``root``: the entry this follow-up follows from, named at its end."""
        why = f" — {self.reason}" if self.reason else ""
        after = f" (follows from {root.op} at {root.source})" if root is not None else ""
        return f"  {self.op}({self.inputs}) at {self.source}{why}{after}"


@dataclass
class NeuronUnsupportedOpError(NeuronCompileError):
    """Raised once per graph, listing every node that cannot be lowered (or is illegal on Trainium): the
    data-dependent ones and their follow-ups, and every op refused by the lowering, together."""

    graph_name: str
    nodes: list[UnsupportedNode] = field(default_factory=list)
    hint: str = SUPPORTED_OPS_HINT

    def __post_init__(self) -> None:
        super().__init__(str(self))

    def root_causes(self) -> list[UnsupportedNode]:
        """The entries that follow from no other entry of this error."""
        named = {n.node for n in self.nodes if n.node}
        return [n for n in self.nodes if not n.follows or n.follows not in named]

    def __str__(self) -> str:
        lines = [
            f"neuron backend: {len(self.nodes)} node(s) of graph '{self.graph_name}' cannot be compiled for Trainium:"
        ]
        by_name = {n.node: n for n in self.nodes if n.node}
        lines += [n.describe(by_name.get(n.follows) if n.follows else None) for n in self.nodes]
        lines.append(self.hint)
        return "\n".join(lines)


class NeuronDynamicShapeError(NeuronCompileError):
    """Raised when a graph has symbolic shapes: the Neuron compiler needs static shapes."""


class NeuronForkedProcessError(NeuronCompileError):
    """Raised in a process forked after its parent started the CPU target's XLA client (a DataLoader worker,
    a fork-based multiprocessing pool): compiling or running a graph there would hang."""


class NeuronMemoryMapError(NeuronCompileError):
    """Raised instead of a JIT that would take the process to the kernel's limit on memory maps
    (``vm.max_map_count``), where XLA CPU's failure crashes the process (``runtime.map_budget``)."""


class NeuronCompileTimeoutError(NeuronCompileError):
    """neuronx-cc did not finish a graph within option ``compile_timeout``: the message names the graph, the
    source line of its largest op and the end of the compiler's log."""


class NeuronHbmError(NeuronCompileError):
    """A graph's input and output tensors alone exceed one NeuronCore's HBM (``neuron_compile.hbm``), which
    neuronx-cc refuses at its start (NCC_EVRF009): refused on the neuron target before neuronx-cc runs.
    ``estimate`` holds the parts (I/O, intermediates, scratchpad) and the largest tensors; ``limit`` the bytes it
    was checked against."""

    def __init__(self, message: str, estimate: Any = None, limit: int = 0) -> None:
        super().__init__(message)
        self.estimate = estimate
        self.limit = limit


class NeuronRuntimeError(NeuronCompileError):
    """The Neuron runtime (libnrt) refused a call: ``status`` is its ``NRT_STATUS`` (-1: the library itself
    could not be loaded), ``call`` the libnrt function. The message names the status and what to do."""

    def __init__(self, message: str, status: int = -1, call: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.call = call


class NeuronOptionsError(NeuronCompileError, ValueError):
    """Raised for an unknown or malformed backend option."""


class NeuronWarning(UserWarning):
    """Base class of the backend's warnings. Those raised while building a graph are stored with the
    compiled artifact and repeated on every cache hit, so a warm start warns exactly like a cold one."""

    #: True: a stored warning of this class is repeated once per process, not once per graph (it says
    #: something about the installation, the same for every graph).
    once_per_process = False


class NeuronLegalityWarning(NeuronWarning):
    """strict=False: the graph runs on this target, but neuronx-cc would refuse it."""


class NeuronFloat64Warning(NeuronWarning):
    """float64 is computed as float32, as on Trainium."""


class NeuronRecompileWarning(NeuronWarning):
    """A function is compiled again and again, for new input shapes or new Python numbers (each is a
    constant of a static graph: one compile each)."""


class NeuronMemoryMapWarning(NeuronWarning):
    """The process holds a large share (``runtime.map_budget.WARN_FRACTION``) of the memory maps the kernel
    allows it; compiles will be refused near the limit."""


class NeuronHbmWarning(NeuronWarning):
    """A graph's estimated peak HBM exceeds one NeuronCore's (``neuron_compile.hbm``): compiled, neuronx-cc decides
    at the end of its compile; on the CPU target also a graph the neuron target refuses (its I/O alone too large)."""


class NeuronNkiUnavailableWarning(NeuronWarning):
    """Neuron target without the real ``nki`` package: the graph's NKI kernel sites run as their reference
    StableHLO, compiled by neuronx-cc like any other op (``lowering/kernel_routing.py``)."""

    once_per_process = True


WARNING_CLASSES: dict[str, type[NeuronWarning]] = {
    cls.__name__: cls
    for cls in (NeuronWarning, NeuronLegalityWarning, NeuronFloat64Warning, NeuronNkiUnavailableWarning)
}
