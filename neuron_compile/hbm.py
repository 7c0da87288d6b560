"""Will it fit? A graph's peak HBM on one NeuronCore, estimated in seconds, before neuronx-cc runs for an hour.

neuronx-cc refuses a graph whose peak HBM exceeds the core's only at the end of its compile (error
NCC_EOOM001). Its published message gives the rule it budgets by::

    [NCC_EOOM001] Maximum peak HBM usage of 32.00GB exceeds HBM limit of 24.00GB for Trn2. This consists of
    16.00GB I/O tensors, 0B intermediate tensors, and 16.00GB internal (scratchpad) allocations

(an 8 GiB buffer in, 8 GiB out: I/O plus an equal scratchpad). The estimate here takes the same three parts of
the same module:

- I/O tensors: the bytes of ``main``'s parameters and results (what the NEFF's input and output tensors hold);
- intermediate tensors: XLA's buffer assignment of the module (the peak of its temporaries, packed by liveness:
  ``temp_size_in_bytes`` of jax's ``memory_analysis()``), or, where XLA CPU cannot compile the module (an
  ``AwsNeuron*`` custom call), a walk of the module in program order that frees each value after its last use;
- internal (scratchpad) allocations: equal to the I/O tensors, the one rule the published message shows.

What it cannot know: how neuronx-cc tiles and fuses (its intermediates are its own, not XLA CPU's), and how its
scratchpad grows past the published case (with intermediates? SBUF spills: the message template has a part "of
which ... is anticipated spills from SBUF"). It reproduces the published example exactly and is an estimate
otherwise, neither bound; option ``hbm_limit`` overrides the limit (0: no check).
"""

from __future__ import annotations

import heapq
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

from .errors import NeuronHbmError, NeuronHbmWarning
from .options import Options
from .provenance import op_name, user_source

log = logging.getLogger(__name__)

GIB = 2**30
#: HBM of one stack, per generation: Trn2 96 GiB in 4 stacks, Trn3 144 GiB in 4 stacks (the NKI architecture
#: guides of Trainium2 and Trainium3). A logical NeuronCore has one stack at LNC=2 and half of one at LNC=1
#: (vLLM Neuron's memory design: one logical core per stack at LNC 2, two at LNC 1); the runtime reports
#: total_hbm=25769803776 (24 GiB) per logical core of a trn2 at LNC=2, and neuronx-cc's limit there is 24.00GB.
HBM_PER_STACK = {"trn2": 24 * GIB, "trn3": 36 * GIB}
#: How many of the largest tensors an error or warning lists.
LARGEST = 6
#: Ops whose results a fusing compiler does not write to memory (XLA CPU fuses them into their users, and so
#: does neuronx-cc): the liveness walk does not count them, and they are not listed among the largest tensors.
NOT_MATERIALIZED = {
    "stablehlo.broadcast_in_dim",
    "stablehlo.broadcast",
    "stablehlo.constant",
    "stablehlo.iota",
    "stablehlo.reshape",
}


def hbm_limit(generation: str, lnc: int) -> int:
    """HBM bytes of one logical NeuronCore of ``generation`` at logical-core size ``lnc`` (1 or 2)."""
    return HBM_PER_STACK[generation] * lnc // 2


def limit_for(opts: Options) -> int:
    """The limit a graph is checked against: option ``hbm_limit`` when set, else the core's (0: no check)."""
    return opts.hbm_limit if opts.hbm_limit is not None else hbm_limit(opts.generation, opts.lnc)


def compiler_size(n: int) -> str:
    """Bytes as neuronx-cc writes them in NCC_EOOM001: ``16.00GB``, ``0B`` (its "GB" are GiB: 24.00GB is the
    24 GiB the runtime reports)."""
    if n == 0:
        return "0B"
    for unit, scale in (("GB", GIB), ("MB", 2**20), ("KB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n}B"


@dataclass(frozen=True)
class TensorUse:
    """One of a graph's largest tensors: what it is, its type and the user's line."""

    what: str  # "input 0", "output 1", "intermediate"
    type: str  # "f32[2147483648]"
    nbytes: int
    source: str  # "aten.add.Tensor at model.py:12" or "primals_1, first used by aten.mm.default at model.py:9"

    def describe(self) -> str:
        return f"{self.what:<12} {self.type:<28} {compiler_size(self.nbytes):>10}  {self.source}"


@dataclass(frozen=True)
class HbmEstimate:
    """The three parts of a graph's peak HBM as neuronx-cc counts them (bytes)."""

    graph: str
    io_bytes: int
    intermediate_bytes: int
    #: how the intermediates were found: "XLA's buffer assignment" or the liveness walk and why
    intermediates_from: str
    largest: tuple[TensorUse, ...] = field(default=(), compare=False)

    @property
    def scratchpad_bytes(self) -> int:
        return self.io_bytes  # the published message's rule: an internal allocation as large as the I/O

    @property
    def peak_bytes(self) -> int:
        return self.io_bytes + self.intermediate_bytes + self.scratchpad_bytes

    def breakdown(self) -> str:
        """neuronx-cc's own sentence for the parts."""
        return (
            f"This consists of {compiler_size(self.io_bytes)} I/O tensors, {compiler_size(self.intermediate_bytes)} "
            f"intermediate tensors, and {compiler_size(self.scratchpad_bytes)} internal (scratchpad) allocations"
        )


def fits_everywhere(peak: int) -> list[tuple[str, int, int, bool]]:
    """(generation, lnc, limit, fits) for every NeuronCore configuration, smallest limit first."""
    rows = [(g, lnc, hbm_limit(g, lnc)) for g in HBM_PER_STACK for lnc in (1, 2)]
    return [(g, lnc, limit, peak <= limit) for g, lnc, limit in sorted(rows, key=lambda r: r[2])]


def fit_line(peak: int) -> str:
    """ "fits / does not fit on one NeuronCore of trn2/trn3 at LNC 1/2" for a peak of ``peak`` bytes."""

    def say(rows: list[tuple[str, int, int, bool]]) -> str:
        per_gen: dict[str, list[str]] = {}
        for g, lnc, limit, _ in rows:
            per_gen.setdefault(g, []).append(f"{lnc} ({compiler_size(limit)})")
        return ", ".join(f"{g} at LNC {' and '.join(v)}" for g, v in per_gen.items())

    rows = fits_everywhere(peak)
    fit = [r for r in rows if r[3]]
    misfit = [r for r in rows if not r[3]]
    parts = []
    if fit:
        parts.append(f"fits on one NeuronCore of {say(fit)}")
    if misfit:
        parts.append(f"does not fit on one NeuronCore of {say(misfit)}")
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------- estimating
def _type_bytes(t: Any) -> tuple[int, str] | None:
    """(bytes, "f32[4, 8]") of a ranked static tensor type, else None."""
    from jax.extend.mlir import ir

    if not isinstance(t, ir.RankedTensorType) or not t.has_static_shape:
        return None
    bits = getattr(t.element_type, "width", 32)  # every element type a lowering makes has a width
    count = 1
    for d in t.shape:
        count *= d
    return count * max(int(bits), 8) // 8, f"{t.element_type}{list(t.shape)}"  # i1 (bool) takes a byte


def _main(module: Any) -> Any:
    for op in module.body.operations:
        if op.operation.name == "func.func" and str(op.attributes["sym_name"]).strip('"') == "main":
            return op
    raise ValueError("the module has no main function")


def _walk(module: Any) -> tuple[int, int, list[tuple[int, str, str, Any]]]:
    """(I/O bytes, peak of live intermediates in program order, [(bytes, what, type, location or arg index)]).

    ``main``'s top-level ops in order: a result is live from its op to its last use (an operand of a later op or
    of an op nested in one); results ``main`` returns are outputs, its arguments inputs (I/O, not intermediates)."""
    main = _main(module)
    block = main.regions[0].blocks[0]
    ops = list(block.operations)
    returned = list(ops[-1].operation.operands) if ops else []
    values: list[tuple[int, str, str, Any]] = []
    io = 0
    for i, arg in enumerate(block.arguments):
        size = _type_bytes(arg.type)
        if size:
            io += size[0]
            values.append((size[0], f"input {i}", size[1], i))
    outputs = set()
    for k, value in enumerate(returned):
        size = _type_bytes(value.type)
        if size:
            io += size[0]
            outputs.add(value)
            where = value.owner.location if hasattr(value.owner, "location") else None
            values.append((size[0], f"output {k}", size[1], str(where) if where is not None else k))
    last_use: dict[Any, int] = {}

    def operands_of(op: Any) -> list[Any]:
        found = list(op.operands)
        for region in op.regions:
            for inner_block in region.blocks:
                for inner in inner_block.operations:
                    found.extend(operands_of(inner.operation))
        return found

    for i, op in enumerate(ops):
        for v in operands_of(op.operation):
            last_use[v] = i
    live = peak = 0
    dying: dict[int, int] = {}
    for i, op in enumerate(ops):
        if op.operation.name in NOT_MATERIALIZED:
            live -= dying.pop(i, 0)
            continue
        for r in op.operation.results:
            size = _type_bytes(r.type)
            if not size or r in outputs or r not in last_use:
                continue
            live += size[0]
            dying[last_use[r]] = dying.get(last_use[r], 0) + size[0]
            values.append((size[0], "intermediate", size[1], str(op.operation.location)))
        peak = max(peak, live)
        live -= dying.pop(i, 0)
    return io, peak, values


def _input_sources(gm: Any, lowered: Any) -> list[str]:
    """Per parameter of the module: the graph input it is and where the user's code first uses it."""
    from .artifact import TensorSpec

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"] if gm is not None else []
    specs = list(getattr(lowered, "inputs", []))
    out = []
    for node, spec in zip(placeholders, specs):
        if not isinstance(spec, TensorSpec):
            continue  # a static Python value baked into the graph: no parameter
        users = [u for u in node.users if u.op == "call_function"]
        first = f", first used by {op_name(users[0])} at {user_source(users[0])}" if users else ""
        out.append(f"graph input {node.name}{first}")
    return out


def _describe(values: list[tuple[int, str, str, Any]], node_table: dict, inputs: list[str]) -> tuple[TensorUse, ...]:
    from .legality.locate import scope_of

    largest = heapq.nlargest(LARGEST, values, key=lambda v: v[0])
    out = []
    for nbytes, what, type_, where in largest:
        if isinstance(where, int) and what.startswith("input"):
            source = inputs[where] if where < len(inputs) else "the random seed"
        elif isinstance(where, int):
            source = "a graph input, returned as it is"
        else:
            scope = scope_of(where, node_table)
            info = node_table.get(scope or "", {})
            if info:
                source = f"{info.get('op', '?')} at {info.get('source', '<unknown source line>')}"
            elif scope:
                op, _, rest = scope.partition("#")
                source = f"{op} at {rest.partition('@')[2] or '<unknown source line>'}"
            else:
                source = "graph glue (no aten node)"
        out.append(TensorUse(what, type_, nbytes, source))
    return tuple(out)


def xla_memory(lowered: Any) -> dict[str, int]:
    """XLA's buffer assignment of a LoweredGraph's module, compiled (not run) by XLA CPU through jax's public
    ``Lowered.compile().memory_analysis()``: argument, output and temporary bytes."""
    stats = lowered.lowered.compile().memory_analysis()
    return {
        "arguments": int(stats.argument_size_in_bytes),
        "outputs": int(stats.output_size_in_bytes),
        "aliased": int(stats.alias_size_in_bytes),
        "temporaries": int(stats.temp_size_in_bytes),
    }


def _xla_memory_or_why_not(lowered: Any) -> tuple[dict[str, int] | None, str]:
    """(``xla_memory``, "") or (None, why XLA CPU could not compile the module: an AwsNeuron* custom call)."""
    try:
        return xla_memory(lowered), ""
    except Exception as e:
        return None, (str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__)


def estimate(lowered: Any, gm: Any = None, memory: dict[str, int] | None = None, why_not: str = "") -> HbmEstimate:
    """The peak HBM of a LoweredGraph's module on one NeuronCore. ``memory``: XLA's buffer assignment of it when
    already at hand (the CPU target's executable, ``jax_adapter.memory_stats``); else it is compiled for it, unless
    ``why_not`` says it cannot be."""
    module = lowered.lowered.compiler_ir("stablehlo")
    with module.context:
        io, walked_peak, values = _walk(module)
    if memory is None and not why_not:
        memory, why_not = _xla_memory_or_why_not(lowered)
    how = "XLA's buffer assignment"
    if memory is None:
        how = f"a liveness walk of the module (XLA CPU could not compile it: {why_not})"
    intermediates = memory["temporaries"] if memory is not None else walked_peak
    largest = _describe(values, getattr(lowered, "node_table", {}) or {}, _input_sources(gm, lowered))
    return HbmEstimate(getattr(lowered, "name", "module"), io, intermediates, how, largest)


def estimate_from_memory(name: str, memory: dict[str, int]) -> HbmEstimate:
    """The estimate from XLA's buffer assignment alone, no walk of the module (a graph that fits, or a cached
    CPU executable: no module at hand). Its I/O counts XLA's table of the results too (a few bytes)."""
    io = memory["arguments"] + memory["outputs"] - memory["aliased"]
    return HbmEstimate(name, io, memory["temporaries"], "XLA's buffer assignment")


def message(est: HbmEstimate, opts: Options, limit: int) -> str:
    """What a refusal or a warning says: neuronx-cc's figures, the largest tensors and what to do."""
    whose = (
        "set by option hbm_limit"
        if opts.hbm_limit is not None
        else f"of one NeuronCore of {opts.generation} at LNC {opts.lnc}"
    )
    lines = [
        f"neuron backend: graph '{est.graph}' will not fit: estimated peak HBM usage of {compiler_size(est.peak_bytes)} "
        f"exceeds the HBM limit of {compiler_size(limit)} {whose}, which neuronx-cc would report only after "
        f"compiling (error NCC_EOOM001). {est.breakdown()}.",
        f"  (estimate: intermediates from {est.intermediates_from}; scratchpad as large as the I/O, as neuronx-cc "
        "budgets it)",
    ]
    if est.largest:
        lines.append("  largest tensors:")
        lines += [f"    {t.describe()}" for t in est.largest]
    elif est.intermediates_from == "XLA's buffer assignment":
        lines.append("  (the largest tensors are listed when the graph is compiled, not served from the cache)")
    fitting = [
        f"{g} at LNC {lnc} ({compiler_size(lim)})" for g, lnc, lim, fits in fits_everywhere(est.peak_bytes) if fits
    ]
    lines.append(
        "  What to do: a smaller batch or sequence length, or the model split across NeuronCores (tensor, pipeline "
        "or sequence parallelism); "
        + (f"it would fit on one NeuronCore of {', '.join(fitting)}; " if fitting else "")
        + "option hbm_limit (NEURON_COMPILE_HBM_LIMIT) sets another limit, 0 turns the check off."
    )
    return "\n".join(lines)


def check(lowered: Any, gm: Any, opts: Options, memory: dict[str, int] | None = None) -> HbmEstimate | None:
    """Estimate a lowered graph's peak HBM and judge it against ``limit_for(opts)``: over it, NeuronHbmError on the
    neuron target (before neuronx-cc runs), NeuronHbmWarning on the CPU target. The estimate, or None when it
    could not be made (logged: the check is advice, never the reason a graph fails to compile)."""
    name = getattr(lowered, "name", "module")
    try:
        why_not = ""
        if memory is None:
            memory, why_not = _xla_memory_or_why_not(lowered)
        limit = limit_for(opts)
        # XLA's figures alone when the graph fits (cheap); the module walked for the parts and the largest
        # tensors when it may not (the walk's I/O is exact, XLA's output figure counts its result tuple too)
        est = estimate_from_memory(name, memory) if memory is not None else None
        if est is None or (limit and est.peak_bytes > limit):
            est = estimate(lowered, gm, memory, why_not)
    except Exception as e:
        log.info("neuron_compile: no HBM estimate for %s: %s: %s", name, type(e).__name__, e)
        return None
    judge(est, opts)
    return est


def judge(est: HbmEstimate, opts: Options) -> None:
    """Raise (neuron target) or warn (CPU target) when ``est`` exceeds the limit ``opts`` sets."""
    limit = limit_for(opts)
    if not limit or est.peak_bytes <= limit:
        return
    text = message(est, opts, limit)
    if opts.target == "neuron":
        raise NeuronHbmError(text, est, limit)
    warnings.warn(NeuronHbmWarning(text + "\n  (CPU target: it runs here; the neuron target refuses it)"), stacklevel=4)
