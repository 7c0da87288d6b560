"""What ``evaluate`` found, as data (``to_dict``) and as a table (``str``); root causes and advice."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import UnsupportedNode
from ..hbm import compiler_size, fit_line, verdicts
from .numerics import NumericsVerdict
from .randomness import RandomDraw

_SYMBOL = re.compile(r"\bu\d+\b")
_SOURCE = re.compile(r"^(?P<file>.*):(?P<line>\d+)$")
#: Nodes that only restate a data-dependent size produced by another node (its size, range asserts).
_FOLLOW_UP_OPS = {"aten.sym_size.int", "sym_size", "ge", "le", "lt", "gt", "eq", "_assert_scalar",
                  "aten._assert_scalar.default", "sym_constrain_range_for_size", "aten.sym_constrain_range_for_size.default",
                  "aten.sym_numel.default", "aten.sym_stride.int"}  # fmt: skip

#: (pattern on "op reason", advice). First match wins; the patterns name the user-level construct.
_ADVICE: list[tuple[re.Pattern[str], str]] = [
    (
        re.compile(r"histc|grouped_mm|transformers\.|moe|experts", re.I),
        "MoE routing with data-dependent expert batches: use a static experts implementation that runs every "
        "expert on every token and weights by the router (transformers: config.experts_implementation="
        '"batched_mm")',
    ),
    (
        re.compile(r"_local_scalar_dense|\.item\(\)|Tensor\.item", re.I),
        "`.item()` makes a Python number from device data: keep it a tensor (e.g. torch.where / torch.clamp with "
        "tensor arguments), or move it out of the compiled region",
    ),
    (
        re.compile(r"aten\.index\.Tensor|masked_select|index_put.*bool", re.I),
        "boolean-mask indexing x[mask] has a data-dependent shape: keep the shape static with "
        "torch.where(mask, x, 0) (or x * mask) and reduce over the full tensor",
    ),
    (
        re.compile(r"nonzero|argwhere|unique|repeat_interleave|bincount", re.I),
        "the result's size depends on the data: use a fixed-size form (torch.where(mask, x, 0), a mask "
        "multiply, torch.topk with a static k), or pad to a maximum size",
    ),
    (
        re.compile(r"data-dependent", re.I),
        "a size or value depends on tensor data: pass sizes as Python ints and keep shapes static",
    ),
    (re.compile(r"float64", re.I), "cast to float32: Trainium has no float64"),
    (
        re.compile(r"no lowering|not supported|not an aten op", re.I),
        "rewrite it with supported ops (neuron_compile.supported_ops(), docs/ops.md) or move it out of the "
        "compiled region with torch.compiler.disable",
    ),
]


def advice_for(text: str) -> str:
    """Known-pattern advice for an unsupported op or a graph break ('' when none applies)."""
    for pattern, advice in _ADVICE:
        if pattern.search(text):
            return advice
    return ""


def _where(file: str, line: int | None) -> str:
    """``file:line``, or just ``file`` when it names a place without a line (a module, an unknown source)."""
    return file if line is None else f"{file}:{line}"


def split_source(source: str) -> tuple[str, int | None]:
    m = _SOURCE.match(source)
    return (m.group("file"), int(m.group("line"))) if m else (source, None)


@dataclass
class UnsupportedEntry:
    """One root cause: an op that cannot go to Trainium, where it is in the user's code, and why."""

    op: str
    file: str
    line: int | None
    reason: str
    inputs: str = ""
    graphs: list[str] = field(default_factory=list)
    #: Nodes folded into this entry (the size/range follow-ups of a data-dependent op, other graphs).
    follow_ups: int = 0
    advice: str = ""


def root_causes(per_graph: list[tuple[str, list[UnsupportedNode]]]) -> list[UnsupportedEntry]:
    """One entry per root cause across graphs, in first-seen order.

    A follow-up is a node that depends, through its graph's data flow, on a root cause: the lowering names
    it (``UnsupportedNode.follows``: the ``sym_size``/``ge``/``le`` nodes that only restate the size of
    ``x[mask]``), and it folds into its root's entry. Any other refused node is a root cause of its own,
    even in the same graph as a data-dependent op. Entries without that data flow (no node name, e.g. from
    the legality pass or an older error) fall back to matching the unbacked size symbol (``u0``) their
    reason names. The same op at the same line in another graph (the backward) folds into its first entry.
    """
    entries: list[UnsupportedEntry] = []
    by_key: dict[tuple[str, str, int | None], UnsupportedEntry] = {}
    for graph, nodes in per_graph:
        seen_symbols: dict[str, UnsupportedEntry] = {}
        by_node: dict[str, UnsupportedEntry] = {}  # node name -> the entry it was counted in, this graph
        for n in nodes:
            file, line = split_source(n.source)
            symbols = set(_SYMBOL.findall(n.reason))
            if n.follows and n.follows in by_node:  # depends on a root cause through the data flow
                owner = by_node[n.follows]
                owner.follow_ups += 1
                if n.node:
                    by_node[n.node] = owner
                continue
            if not n.node or n.follows:  # data flow unknown (or its root not listed): the reason's symbols tell
                owner = next((seen_symbols[s] for s in symbols if s in seen_symbols), None)
                if owner is not None and (symbols <= set(seen_symbols) or n.op in _FOLLOW_UP_OPS):
                    owner.follow_ups += 1
                    continue
                if n.op in _FOLLOW_UP_OPS and owner is None:
                    # a follow-up whose producer is not in the list (another graph): fold by line
                    prior = next((e for e in entries if (e.file, e.line) == (file, line)), None)
                    if prior is not None:
                        prior.follow_ups += 1
                        continue
            key = (n.op, file, line)
            entry = by_key.get(key)
            if entry is None:
                entry = UnsupportedEntry(n.op, file, line, n.reason, n.inputs, advice=advice_for(f"{n.op} {n.reason}"))
                by_key[key] = entry
                entries.append(entry)
            else:
                entry.follow_ups += 1
            if graph not in entry.graphs:
                entry.graphs.append(graph)
            if n.node:
                by_node[n.node] = entry
            for s in symbols:
                seen_symbols.setdefault(s, entry)
    return entries


@dataclass
class GraphEntry:
    name: str
    kind: str
    aten_ops: int
    nki_kernels: int
    cache: str
    lower_s: float
    compile_s: float
    #: Estimated peak HBM on one NeuronCore (bytes, ``neuron_compile.hbm``); None where not estimated.
    hbm_peak: int | None = None
    #: Its I/O tensors' bytes (certain where the peak is estimated); None where not estimated.
    hbm_io: int | None = None


@dataclass
class GraphBreak:
    reason: str
    file: str
    line: int | None
    advice: str = ""


@dataclass
class EvaluationReport:
    """The answer to "can this model move to Trainium?".

    ``ok``: every graph compiled for the target and the numerics pass. ``to_dict()`` gives the keys
    ``graphs``, ``graph_breaks``, ``unsupported``, ``numerics``, ``timing``, ``recompiles`` (plus ``ok``,
    ``model``, ``mode``, ``target``, ``float64_downcasts``, ``errors``); ``str(report)`` is a table.
    """

    model: str
    mode: str  # "training" | "inference"
    target: str
    graphs: list[GraphEntry] = field(default_factory=list)
    dynamo_graphs: int = 0
    graph_breaks: list[GraphBreak] = field(default_factory=list)
    unsupported: list[UnsupportedEntry] = field(default_factory=list)
    numerics: NumericsVerdict | None = None
    timing: dict[str, float | None] = field(default_factory=dict)
    recompiles: dict[str, Any] = field(default_factory=dict)
    float64_downcasts: list[str] = field(default_factory=list)
    #: Failures that are not an unsupported op (a crash in a phase), with the phase named.
    errors: list[str] = field(default_factory=list)
    #: Random ops the model drew from in eager (dropout modules aside): numerics are then not compared.
    random_draws: list[RandomDraw] = field(default_factory=list)
    #: Why the model cannot be evaluated at all (it returns no tensor); the CLI then exits 2, as for a
    #: factory that does not load. "" when it can.
    nothing_to_judge: str = ""

    def largest_hbm_peak(self) -> GraphEntry | None:
        """The compiled graph with the largest estimated peak HBM (None: no graph was estimated)."""
        return max((g for g in self.graphs if g.hbm_peak is not None), key=lambda g: g.hbm_peak, default=None)

    @property
    def ok(self) -> bool:
        """Compiled, and numerics passed on at least one tensor: zero tensors compared is not a pass."""
        return (
            not self.unsupported
            and not self.errors
            and not self.nothing_to_judge
            and self.numerics is not None
            and self.numerics.ok
            and bool(self.numerics.tensors)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "model": self.model,
            "mode": self.mode,
            "target": self.target,
            "graphs": {
                "dynamo_graphs": self.dynamo_graphs,
                "compiled": [asdict(g) for g in self.graphs],
                "aten_ops": sum(g.aten_ops for g in self.graphs),
                "nki_kernels": sum(g.nki_kernels for g in self.graphs),
            },
            "hbm": self._hbm_dict(),
            "graph_breaks": [asdict(b) for b in self.graph_breaks],
            "unsupported": [asdict(u) for u in self.unsupported],
            "numerics": self.numerics.to_dict() if self.numerics else None,
            "timing": dict(self.timing),
            "recompiles": dict(self.recompiles),
            "float64_downcasts": list(self.float64_downcasts),
            "errors": list(self.errors),
            "random_draws": [asdict(d) for d in self.random_draws],
            "nothing_to_judge": self.nothing_to_judge,
        }

    def _hbm_dict(self) -> dict[str, Any] | None:
        largest = self.largest_hbm_peak()
        if largest is None:
            return None
        return {
            "largest_peak_bytes": largest.hbm_peak,
            "largest_io_bytes": largest.hbm_io,
            "graph": largest.name,
            # fits: the estimated peak is within the limit; verdict: fits, may not fit (I/O fits, the estimated
            # peak does not) or refused (the I/O alone is over: NCC_EVRF009)
            "fits": [
                {"generation": g, "lnc": lnc, "limit_bytes": limit, "fits": verdict == "fits", "verdict": verdict}
                for g, lnc, limit, verdict in verdicts(largest.hbm_peak, largest.hbm_io)
            ],
        }

    def __str__(self) -> str:
        def fmt(v: float | None, unit: str) -> str:
            return "-" if v is None else f"{v:.3f} {unit}" if unit == "s" else f"{v:.2f} {unit}"

        if self.nothing_to_judge:
            verdict = f"CANNOT JUDGE: {self.nothing_to_judge}"
        elif self.ok:
            verdict = "YES: compiles for Trainium and numerics pass"
        elif self.random_draws and not self.unsupported and not self.errors:
            verdict = "NOT VERIFIED: compiles for Trainium; numerics not compared (random draws, see below)"
        else:
            verdict = "NO: see below"
        out = [f"neuron evaluate: {self.model} ({self.mode}, target {self.target}) -> {verdict}", ""]
        out.append(f"graphs: {self.dynamo_graphs} Dynamo graph(s), {len(self.graph_breaks)} graph break(s), "
                   f"{len(self.graphs)} compiled graph(s)")  # fmt: skip
        if self.graphs:
            out.append(
                f"  {'graph':<24} {'kind':<10} {'aten ops':>8} {'nki':>4} {'cache':>6} {'lower s':>8} {'compile s':>9} "
                f"{'HBM peak':>10}"
            )
            for g in self.graphs:
                peak = compiler_size(g.hbm_peak) if g.hbm_peak is not None else "-"
                out.append(f"  {g.name:<24} {g.kind:<10} {g.aten_ops:>8} {g.nki_kernels:>4} {g.cache:>6} "
                           f"{g.lower_s:>8.3f} {g.compile_s:>9.3f} {peak:>10}")  # fmt: skip
            largest = self.largest_hbm_peak()
            if largest is not None:
                out.append(f"  HBM: {largest.name} needs the most, an estimated {compiler_size(largest.hbm_peak)} at its "
                           f"peak: {fit_line(largest.hbm_peak, largest.hbm_io)}")  # fmt: skip
        for b in self.graph_breaks:
            out.append(f"  break at {_where(b.file, b.line)}: {b.reason}")
            if b.advice:
                out.append(f"    advice: {b.advice}")
        out.append("")
        if self.unsupported:
            out.append(f"unsupported: {len(self.unsupported)} root cause(s)")
            for u in self.unsupported:
                more = f" (+{u.follow_ups} follow-up node(s))" if u.follow_ups else ""
                out.append(f"  {u.op} at {_where(u.file, u.line)} [{', '.join(u.graphs)}]{more}")
                out.append(f"    reason: {u.reason}")
                if u.advice:
                    out.append(f"    advice: {u.advice}")
        else:
            out.append("unsupported: none")
        for e in self.errors:
            out.append(f"error: {e}")
        if self.float64_downcasts:
            out.append(f"float64 computed as float32 in: {', '.join(self.float64_downcasts)}")
        out.append("")
        if self.random_draws:
            out.extend(_describe_draws(self.random_draws))
        else:
            out.append(self.numerics.describe() if self.numerics else "numerics: not measured")
        worst = self.numerics.worst() if self.numerics else None
        if worst is not None and worst.compiled_error is not None:
            how = f", passed by {worst.passed_by}" if worst.passed_by else ""
            out.append(f"  closest: {worst.name}: RMSE to reference compiled {worst.compiled_error:.3g} vs eager "
                       f"{worst.eager_error:.3g} (bound {worst.bound:.3g}{how})")  # fmt: skip
        if self.numerics and self.numerics.note:
            out.append(f"  note: {self.numerics.note}")
        out.append("")
        t = self.timing
        out.append(f"timing: compile cold {fmt(t.get('compile_cold_s'), 's')}, warm (cache hit) "
                   f"{fmt(t.get('compile_warm_s'), 's')}; step {fmt(t.get('step_ms'), 'ms')} vs eager "
                   f"{fmt(t.get('eager_step_ms'), 'ms')} (medians of {t.get('steps', '-')})")  # fmt: skip
        r = self.recompiles
        if r:
            out.append(f"recompiles: input {r.get('input_shapes')}: {r.get('compiled_graphs')} graph(s) compiled on the "
                       f"first step, {r.get('recompiles_in_steps')} recompile(s) in later steps")  # fmt: skip
        return "\n".join(out)


def _describe_draws(draws: list[RandomDraw]) -> list[str]:
    lines = ["numerics: not compared: the model draws random numbers (dropout modules aside, which run at p=0);",
             "  compiled and eager draw from different generators, so their results differ by the draws themselves"]  # fmt: skip
    lines += [f"  {d.op} at {_where(d.file, d.line)}" for d in draws]
    lines.append("  advice: to compare, pass the random tensors in as inputs (draw noise outside the compiled "
                 "model) or turn the draws off for the evaluation (drop_path_rate=0, class_dropout_prob=0, ...)")  # fmt: skip
    return lines
