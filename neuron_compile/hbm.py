"""Will it fit? A graph's HBM on one NeuronCore, judged in seconds, before neuronx-cc runs for an hour.

neuronx-cc checks a graph's HBM twice, and the public record shows both checks:

- at its start, the I/O tensors alone (NCC_EVRF009, "The combined memory needed for the model's activation
  tensors exceeds the high-bandwidth memory limit",
  https://awsdocs-neuron.readthedocs-hosted.com/en/v2.34.0/compiler/error-codes/EVRF009.html). Its message, as
  published Trn2 runs print it::

      [NCC_EVRF009] Size of total input and output tensors exceeds HBM limit of Trainium2. Needed
      33,771,172,352 bytes (31 GB) vs. available 25,769,803,776 bytes (24 GB).

  25,769,803,776 bytes is 24 GiB: one logical NeuronCore of a Trn2 at LNC 2.
- at its end, the peak: constants, I/O tensors, internal (scratchpad) allocations and SBUF spills (NCC_EOOM001 /
  NCC_EOOM002, https://awsdocs-neuron.readthedocs-hosted.com/en/v2.34.0/compiler/error-codes/EOOM002.html).
  Two published reports give the parts::

      [NCC_EOOM001] Maximum peak HBM usage of 32.00GB exceeds HBM limit of 24.00GB for Trn2. This consists of
      16.00GB I/O tensors, 0B intermediate tensors, and 16.00GB internal (scratchpad) allocations
      [NCC_EOOM002] Maximum peak HBM usage of 28.44GB exceeds HBM limit of 24.00GB for Trn2. This consists of
      1.50MB model constants, 43.00GB I/O tensors, 6.89GB internal (scratchpad) tensors ...

  (the first an 8 GiB buffer in and out, the second a vLLM MoE graph): the scratchpad is not a function of the
  I/O that the record settles (1x the I/O in one, 0.16x in the other), and the second's 43.00GB of I/O passed the
  first check, so the two checks do not count I/O alike (aliased buffers, most likely).

So a graph is refused here only where the compiler is known to refuse it at its start: I/O tensors alone over
the core's HBM, with EVRF009's text. Otherwise the estimate of the peak is advice, a warning with its parts:

- I/O tensors (certain): the bytes of ``main``'s parameters and results (what the NEFF's tensors hold);
- intermediate tensors (estimated): XLA's buffer assignment of the module (``temp_size_in_bytes`` of jax's
  ``memory_analysis()``), or, where XLA CPU cannot compile the module (an ``AwsNeuron*`` custom call), a walk of
  the module in program order that frees each value after its last use;
- internal (scratchpad) allocations (estimated): as large as the I/O, the published EOOM001 case, the larger of
  the two published ratios.

Option ``hbm_limit`` overrides the limit (0: no check). The HBM per core is ``HBM_PER_CORE``, the one table the
device's memory limit and ``neuron-compile doctor`` read too.
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
#: HBM of one logical NeuronCore (bytes) by (generation, LNC): THE table (``hbm_per_core``), read by this check,
#: the ``neuron`` device's memory limit and ``neuron-compile doctor``. A Trn2 chip has 96 GiB of HBM for 8 physical
#: NeuronCores, a Trn3 chip 144 GiB for 8 (the NKI architecture guides of Trainium2 and Trainium3); a logical core
#: of LNC 2 is two physical ones. The runtime reports total_hbm=25769803776 (24 GiB) per logical core of a trn2 at
#: LNC 2, neuronx-cc's NCC_EVRF009 checks I/O against "25,769,803,776 bytes (24 GB)" and NCC_EOOM001 prints its
#: limit there as 24.00GB.
HBM_PER_CORE: dict[tuple[str, int], int] = {
    ("trn2", 1): 12 * GIB,
    ("trn2", 2): 24 * GIB,
    ("trn3", 1): 18 * GIB,
    ("trn3", 2): 36 * GIB,
}
#: The chip's name in NCC_EVRF009's message ("exceeds HBM limit of Trainium2").
CHIP_NAMES = {"trn2": "Trainium2", "trn3": "Trainium3"}
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


def hbm_per_core(generation: str, lnc: int) -> int:
    """HBM bytes of one logical NeuronCore of ``generation`` at logical-core size ``lnc`` (1 or 2)."""
    return HBM_PER_CORE[(generation, lnc)]


#: The name this module's callers know it by.
hbm_limit = hbm_per_core


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
        """Estimated: as large as the I/O (the published NCC_EOOM001 case; NCC_EOOM002's shows 0.16x)."""
        return self.io_bytes

    @property
    def peak_bytes(self) -> int:
        return self.io_bytes + self.intermediate_bytes + self.scratchpad_bytes

    def breakdown(self) -> str:
        """neuronx-cc's own sentence for the parts."""
        return (
            f"This consists of {compiler_size(self.io_bytes)} I/O tensors, {compiler_size(self.intermediate_bytes)} "
            f"intermediate tensors, and {compiler_size(self.scratchpad_bytes)} internal (scratchpad) allocations"
        )

    def parts(self) -> str:
        """The parts, each said certain or estimated."""
        return (
            f"I/O tensors {compiler_size(self.io_bytes)} (certain: the NEFF's inputs and outputs), intermediate "
            f"tensors {compiler_size(self.intermediate_bytes)} (estimated: {self.intermediates_from}), internal "
            f"(scratchpad) allocations {compiler_size(self.scratchpad_bytes)} (estimated: as large as the I/O, the "
            "published NCC_EOOM001 case; NCC_EOOM002's report shows less)"
        )


def configurations() -> list[tuple[str, int, int]]:
    """(generation, lnc, HBM per core) of every NeuronCore configuration, smallest first."""
    return sorted(((g, lnc, size) for (g, lnc), size in HBM_PER_CORE.items()), key=lambda r: (r[2], r[0]))


def fits_everywhere(peak: int) -> list[tuple[str, int, int, bool]]:
    """(generation, lnc, limit, fits) for every NeuronCore configuration, smallest limit first."""
    return [(g, lnc, limit, peak <= limit) for g, lnc, limit in configurations()]


def verdicts(peak: int, io: int | None = None) -> list[tuple[str, int, int, str]]:
    """(generation, lnc, limit, verdict) for every configuration: "fits" (the estimated peak is within the limit),
    "may not fit" (the I/O is, the estimated peak is not: neuronx-cc decides at the end of its compile), "refused"
    (the I/O alone is over: neuronx-cc refuses it at its start, NCC_EVRF009). Without ``io``: "fits" or
    "may not fit" by the peak alone."""
    out = []
    for g, lnc, limit in configurations():
        if io is not None and io > limit:
            verdict = "refused"
        else:
            verdict = "fits" if peak <= limit else "may not fit"
        out.append((g, lnc, limit, verdict))
    return out


def fit_line(peak: int, io: int | None = None) -> str:
    """Where a graph of estimated peak ``peak`` and I/O ``io`` (bytes) fits: "fits on one NeuronCore of ...; may
    not fit on ...; refused on ...", then which figure is certain and which estimated."""

    def say(rows: list[tuple[str, int, int, str]]) -> str:
        per_gen: dict[str, list[str]] = {}
        for g, lnc, limit, _ in rows:
            per_gen.setdefault(g, []).append(f"{lnc} ({compiler_size(limit)})")
        return ", ".join(f"{g} at LNC {' and '.join(v)}" for g, v in per_gen.items())

    rows = verdicts(peak, io)
    parts = []
    for verdict, words in (
        ("fits", "fits on one NeuronCore of"),
        ("may not fit", "may not fit on one NeuronCore of"),
        ("refused", "refused (its I/O alone is over the limit, NCC_EVRF009) on one NeuronCore of"),
    ):
        chosen = [r for r in rows if r[3] == verdict]
        if chosen:
            parts.append(f"{words} {say(chosen)}")
    line = "; ".join(parts)
    if io is not None:
        line += (
            f" (certain: {compiler_size(io)} of I/O tensors; estimated: the intermediates and a scratchpad as large "
            "as the I/O, which neuronx-cc sizes only at the end of its compile)"
        )
    return line


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


def _whose(opts: Options) -> str:
    if opts.hbm_limit is not None:
        return "set by option hbm_limit"
    return f"of one NeuronCore of {opts.generation} at LNC {opts.lnc}"


def _largest(est: HbmEstimate) -> list[str]:
    if est.largest:
        return ["  largest tensors:"] + [f"    {t.describe()}" for t in est.largest]
    if est.intermediates_from == "XLA's buffer assignment":
        return ["  (the largest tensors are listed when the graph is compiled, not served from the cache)"]
    return []


def _what_to_do(fitting: list[str]) -> str:
    return (
        "  What to do: a smaller batch or sequence length, or the model split across NeuronCores (tensor, pipeline "
        "or sequence parallelism); "
        + (f"it would fit on one NeuronCore of {', '.join(fitting)}; " if fitting else "")
        + "option hbm_limit (NEURON_COMPILE_HBM_LIMIT) sets another limit, 0 turns the check off."
    )


def evrf009_text(io: int, limit: int, generation: str) -> str:
    """NCC_EVRF009's message as published Trn2 runs print it (its "GB" are whole GiB, rounded down)."""
    chip = CHIP_NAMES.get(generation, generation)
    return (
        f"[NCC_EVRF009] Size of total input and output tensors exceeds HBM limit of {chip}. Needed {io:,} bytes "
        f"({io // GIB} GB) vs. available {limit:,} bytes ({limit // GIB} GB)."
    )


def refusal(est: HbmEstimate, opts: Options, limit: int) -> str:
    """A graph whose I/O tensors alone exceed the limit: what neuronx-cc says at its start (NCC_EVRF009)."""
    lines = [
        f"neuron backend: graph '{est.graph}' is refused before compiling, as neuronx-cc refuses it at its start: "
        f"its input and output tensors alone need {compiler_size(est.io_bytes)}, over the HBM limit of "
        f"{compiler_size(limit)} {_whose(opts)}.",
        "  neuronx-cc would say: " + evrf009_text(est.io_bytes, limit, opts.generation),
    ]
    lines += _largest(est)
    fitting = [f"{g} at LNC {lnc} ({compiler_size(lim)})" for g, lnc, lim in configurations() if est.io_bytes <= lim]
    lines.append(_what_to_do(fitting))
    return "\n".join(lines)


def warning_text(est: HbmEstimate, opts: Options, limit: int) -> str:
    """A graph whose I/O fits but whose estimated peak does not: compiled, with the estimate and its parts."""
    lines = [
        f"neuron backend: graph '{est.graph}' may not fit: its estimated peak HBM usage of "
        f"{compiler_size(est.peak_bytes)} exceeds the HBM limit of {compiler_size(limit)} {_whose(opts)}; its I/O "
        f"tensors ({compiler_size(est.io_bytes)}) fit, so it is compiled, and neuronx-cc decides at the end of its "
        "compile (NCC_EOOM001 / NCC_EOOM002 if it does not fit).",
        f"  The estimate: {est.parts()}.",
    ]
    lines += _largest(est)
    fitting = [f"{g} at LNC {lnc} ({compiler_size(lim)})" for g, lnc, lim in configurations() if est.peak_bytes <= lim]
    lines.append(_what_to_do(fitting))
    return "\n".join(lines)


#: The name the refusal's text had before the two checks were told apart.
message = refusal


def check(lowered: Any, gm: Any, opts: Options, memory: dict[str, int] | None = None) -> HbmEstimate | None:
    """Estimate a lowered graph's peak HBM and judge it against ``limit_for(opts)`` (``judge``). The estimate, or
    None when it could not be made (logged: the check is advice, never the reason a graph fails to compile)."""
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
    """Against the limit ``opts`` sets: I/O tensors alone over it, NeuronHbmError on the neuron target (neuronx-cc
    refuses it at its start, NCC_EVRF009) and a warning on the CPU target; else an estimated peak over it, a
    warning (the graph is compiled: neuronx-cc decides at the end of its compile)."""
    limit = limit_for(opts)
    if not limit or est.peak_bytes <= limit:
        return
    if est.io_bytes > limit:
        text = refusal(est, opts, limit)
        if opts.target == "neuron":
            raise NeuronHbmError(text, est, limit)
        warnings.warn(
            NeuronHbmWarning(text + "\n  (CPU target: it runs here; the neuron target refuses it)"), stacklevel=4
        )
        return
    warnings.warn(NeuronHbmWarning(warning_text(est, opts, limit)), stacklevel=4)
