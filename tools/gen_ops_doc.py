"""Writes docs/ops.md: what the neuron backend does with every aten op it can meet, and OpInfo results.

    python -m tools.gen_ops_doc           # rewrite docs/ops.md (from the repository root)
    python -m tools.gen_ops_doc --check   # exit 1 if docs/ops.md is stale

Three sources, all cheap and deterministic to read:
- the op registry (``neuron_compile.supported_ops()``, its refusals, the decomposition table, the NKI
  routing table): which aten ops are lowered to StableHLO (and where), run as NKI kernels, or unsupported
  (and why, for the ops the registry always refuses);
- docs/opinfo_results.json, written by tools/opinfo_sweep.py: OpInfo pass counts per entry, and per aten
  op its trn2/trn3 legality verdict (the legality pass over every graph the sweep lowered, worst wins);
- docs/overload_verdicts.json, written by ``python -m tools.exercise_overloads``: the verdict of every lowered
  overload exercised alone, for the ops no OpInfo sample reaches (the OpInfo verdict comes first).
Regenerate after changing lowerings or rerunning either tool; tests/test_opinfo.py fails when it is stale.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ops.md"
RESULTS = ROOT / "docs" / "opinfo_results.json"
OVERLOADS = ROOT / "docs" / "overload_verdicts.json"

LOWERED, UNSUPPORTED = "lowered", "unsupported"
NOT_EXERCISED = "not exercised"
#: Where a row's legality verdict comes from (column "verdict from").
FROM_OPINFO, FROM_ALONE = "OpInfo", "exercised alone"
#: OpInfo entry categories whose float32 samples reach the backend: the denominator of the all-entries rate.
REACHING = ("core", "non-core", "complex-or-sparse")

#: Why the checks (not the op table) take these forms as legal without documentation: see legality/checks.py.
_ASSUMED_FORMS = {
    "stablehlo.gather(batching dims)": "gather with operand batching dims, newer than the documented gather "
    "form; assumed rewritten to the classic form (explicit iota indices) by the front end, as XLA does",
    "stablehlo.reduce(or on i1)": "reduce with an `or` reducer on booleans (a max); the table does not say "
    "whether boolean reductions are taken",
    "stablehlo.reduce(and on i1)": "reduce with an `and` reducer on booleans (a min); the table does not say "
    "whether boolean reductions are taken",
}


def kernel_ops() -> dict[str, str]:
    """aten overload -> the NKI kernel(s) the routing table (lowering/kernel_routing.py) may send it to."""
    from neuron_compile.lowering.registry import RECORDS

    return {str(op): ", ".join(r.kernels) for op, r in RECORDS.items() if r.kernel_route is not None}


def aten_universe(results: dict[str, Any]) -> dict[str, str]:
    """Every aten overload the backend can meet after decomposition -> why it is listed.

    Core ATen (PyTorch's ``core`` tag; what the decompositions reduce to), the ops kept whole on
    purpose, every op we lower, and every op the OpInfo sweep saw reach the backend.
    """
    import torch

    from neuron_compile.decompositions import KEEP_WHOLE, decomposition_table
    from neuron_compile.lowering import supported_ops

    decomposed = {str(op) for op in decomposition_table()}
    why: dict[str, str] = {}
    # Every registered aten op (dir(torch.ops.aten) would list only the packets loaded so far).
    for qualified in sorted(torch._C._dispatch_get_all_op_names()):
        if not qualified.startswith("aten::"):
            continue
        packet_name, _, overload = qualified[len("aten::") :].partition(".")
        op = getattr(getattr(torch.ops.aten, packet_name), overload or "default")
        # A CompositeImplicitAutograd op decomposes through its implicit kernel above AOTAutograd's trace.
        implicit = torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
        if torch.Tag.core in op.tags and str(op) not in decomposed and not implicit:
            why[str(op)] = "core"
    for packet in KEEP_WHOLE:
        for overload in packet.overloads():
            why.setdefault(str(getattr(packet, overload)), "kept whole")
    for name in supported_ops():
        why.setdefault(name, "lowered")
    for name in refused_ops():
        why.setdefault(name, "refused")
    for entry in results.get("entries", {}).values():
        for name in entry["ops"]:
            why.setdefault(name, "seen in OpInfo")
    return why


def complex_ops() -> list[str]:
    """aten overloads with a (real, imag) pair lowering."""
    from neuron_compile.lowering.complex_pairs import supported_complex_ops

    return sorted(supported_complex_ops())


def refused_ops() -> dict[str, str]:
    """aten overloads the registry always refuses -> the reason the user's error gives."""
    from neuron_compile.lowering.registry import REFUSALS

    return {str(op): reason for op, reason in REFUSALS.items()}


def lowered_in() -> dict[str, str]:
    """aten overload -> every path its dispatch record holds, in dispatch order, as markdown: its lowering's
    ``lowering/<family>.py::<function>`` (no line numbers: an edit above an op must not make this doc stale),
    and where it has them its pair lowering, NKI route and channels-last handler."""
    from neuron_compile.lowering.registry import RECORDS

    paths = {}
    for op, record in RECORDS.items():
        if str(op).startswith("aten.") and record.paths():
            paths[str(op)] = "; ".join(
                f"`{where}`" if what == "lowering" else f"{what} `{where}`" for what, where in record.paths().items()
            )
    return paths


def _opinfo_use(results: dict[str, Any]) -> dict[str, list[str]]:
    use: dict[str, list[str]] = {}
    for name, entry in results.get("entries", {}).items():
        for op in entry["ops"]:
            use.setdefault(op, []).append(name)
    return use


def _count(entry: dict[str, Any], dtype: str) -> str:
    per = entry["counts"].get(dtype)
    if not per:
        return ""
    total = sum(per.values())
    return f"{per.get('PASS', 0)}/{total}"


def legality_labels(
    results: dict[str, Any], ops: list[str], overloads: dict[str, Any] | None = None
) -> dict[str, dict[str, str]]:
    """op -> generation -> "yes" / "yes (assumed: ...)" / "no: ..." / "not exercised".

    The OpInfo sweep's verdict where it has one; else the verdict of the op exercised alone
    (docs/overload_verdicts.json).
    """
    from neuron_compile.legality import OpVerdict, rules

    recorded = results.get("legality", {})
    alone = (overloads or {}).get("overloads", {})
    labels: dict[str, dict[str, str]] = {}
    for op in ops:
        by_gen = recorded.get(op) or alone.get(op, {})
        labels[op] = {}
        for gen in rules.GENERATIONS:
            rec = by_gen.get(gen)
            labels[op][gen] = (
                OpVerdict(rec["legal"], tuple(rec["assumed"]), tuple(rec["reasons"])).label() if rec else NOT_EXERCISED
            )
    return labels


def measured_verdicts(results: dict[str, Any], overloads: dict[str, Any] | None = None) -> dict[str, Any]:
    """op -> {"source": where the verdict comes from, "trn2"/"trn3": {legal, assumed, reasons, label}}, for every
    lowered op with a verdict: what ``DispatchRecord.verdicts`` reads (neuron_compile/lowering/op_verdicts.json,
    written beside docs/ops.md). The OpInfo sweep's verdict first, as in ``legality_labels``."""
    from neuron_compile.legality import rules

    recorded = results.get("legality", {})
    alone = (overloads or {}).get("overloads", {})
    out: dict[str, Any] = {}
    for op in sorted(set(recorded) | set(alone)):
        source, by_gen = (FROM_OPINFO, recorded[op]) if op in recorded else (FROM_ALONE, alone[op])
        if all(gen in by_gen for gen in rules.GENERATIONS):
            out[op] = {"source": source, **{gen: {k: by_gen[gen][k] for k in ("legal", "assumed", "reasons", "label")}
                                            for gen in rules.GENERATIONS}}  # fmt: skip
    return out


def verdicts_text(results: dict[str, Any], overloads: dict[str, Any] | None = None) -> str:
    """The text of neuron_compile/lowering/op_verdicts.json."""
    return json.dumps(measured_verdicts(results, overloads), indent=1, sort_keys=True) + "\n"


def verdict_sources(results: dict[str, Any], ops: list[str], overloads: dict[str, Any] | None = None) -> dict[str, str]:
    """op -> where its verdict comes from: OpInfo, exercised alone, or why it has none."""
    recorded = results.get("legality", {})
    alone = (overloads or {}).get("overloads", {})
    out = {}
    for op in ops:
        if op in recorded:
            out[op] = FROM_OPINFO
        elif "trn2" in alone.get(op, {}):
            out[op] = FROM_ALONE
        elif op in alone:
            out[op] = f"{NOT_EXERCISED}: {alone[op].get('reason', '')}"
        else:
            out[op] = NOT_EXERCISED
    return out


def _kind(label: str) -> str:
    if label.startswith("yes ("):
        return "assumed"
    return {"yes": "legal", NOT_EXERCISED: NOT_EXERCISED}.get(label, "illegal")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def assumed_forms(results: dict[str, Any], overloads: dict[str, Any] | None = None) -> list[tuple[str, str, int]]:
    """Every HLO op or form the legality pass takes as legal by assumption, in ONE list: the ``assumed``
    rules of legality/rules.py, the forms of ``_ASSUMED_FORMS`` (checks.py), and any other name a verdict
    cites. Each as (name, why it is taken as legal, number of aten ops whose verdict cites it)."""
    from neuron_compile.legality import rules

    recorded = results.get("legality", {})
    alone = (overloads or {}).get("overloads", {})
    cited: dict[str, set[str]] = {}
    for op in recorded.keys() | alone.keys():
        by_gen = recorded.get(op) or alone.get(op, {})  # the verdict the table shows (legality_labels)
        for gen in rules.GENERATIONS:
            for name in (by_gen.get(gen) or {}).get("assumed", ()):
                cited.setdefault(name, set()).add(op)
    names = {n for n, rule in rules.OPS.items() if rule.source == "assumed"} | set(_ASSUMED_FORMS) | set(cited)
    out = []
    for name in sorted(names):
        rule = rules.OPS.get(name)
        why = _ASSUMED_FORMS.get(name) or (rule.note if rule else "") or "absent from the public operator list"
        out.append((name, why, len(cited.get(name, ()))))
    return out


def reach_rates(results: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Pass counts over every OpInfo entry whose float32 samples reach the backend (categories
    ``REACHING``), plus complex-only entries whose complex64 samples reach it, per dtype.

    "float32": the entry's float32 status (complex64 for complex-only entries); "bfloat16": the status
    of its bfloat16 cases, over those of the same entries whose bfloat16 cases reached the backend.
    """
    rates: dict[str, dict[str, int]] = {
        d: {"entries": 0, "pass": 0, "unsupported": 0, "fail": 0, "not_reached": 0} for d in ("float32", "bfloat16")
    }
    for e in results.get("entries", {}).values():
        if e["category"] in REACHING:
            f32 = e["float32"]
        elif e["category"] == "no-float32" and _dtype_status(e["counts"].get("complex64", {})) != "skip":
            f32 = _dtype_status(e["counts"]["complex64"])
        else:
            continue
        rates["float32"]["entries"] += 1
        rates["float32"][f32 if f32 in ("pass", "unsupported", "fail") else "not_reached"] += 1
        bf16 = _dtype_status(e["counts"].get("bfloat16", {}))
        rates["bfloat16"]["entries"] += 1
        rates["bfloat16"][bf16 if bf16 != "skip" else "not_reached"] += 1
    return rates


def _dtype_status(counts: dict[str, int]) -> str:
    """One dtype's status from its case counts, by the harness's rule (``tests/support/opinfo_harness._status``):
    fail > unsupported > pass (a PASS or a shape-only case); "skip" when no case was checked."""
    if counts.get("FAIL"):
        return "fail"
    if counts.get("UNSUPPORTED"):
        return "unsupported"
    if counts.get("PASS") or counts.get("SKIP:random") or counts.get("SKIP:undefined-values"):
        return "pass"
    return "skip"


def _depth_text(config: dict[str, Any]) -> str:
    """How deep the sweep went: one depth for every dtype, or each dtype's own (0 = every sample)."""
    depth = config.get("samples_per_dtype")
    dtypes = config.get("dtypes", [])
    if not isinstance(depth, dict):
        return f"{f'up to {depth}' if depth else 'all'} samples per entry and dtype, dtypes {', '.join(dtypes)}"
    groups: dict[int, list[str]] = {}
    for d in dtypes:
        groups.setdefault(depth.get(d, 0), []).append(d)
    return "; ".join(
        f"{f'up to {n}' if n else 'all'} samples per entry for {', '.join(ds)}" for n, ds in sorted(groups.items())
    )


def _pct(n: int, d: int) -> str:
    return f"{100.0 * n / d:.1f}%" if d else "n/a"


def render(results: dict[str, Any], overloads: dict[str, Any] | None = None) -> str:
    """The text of docs/ops.md for the current registry, the given sweep results and the verdicts of the
    overloads exercised alone (docs/overload_verdicts.json when not given)."""
    from neuron_compile.lowering import supported_ops

    if overloads is None:
        overloads = load_overloads()

    from neuron_compile.value_checks import RUN_AFTER_GRAPH

    lowered = set(supported_ops()) | RUN_AFTER_GRAPH
    where = lowered_in() | {op: "`value_checks.py` (run after the graph)" for op in RUN_AFTER_GRAPH}
    refused = refused_ops()
    kernels = kernel_ops()
    universe = aten_universe(results)
    for op in results.get("legality", {}):
        universe.setdefault(op, "seen in OpInfo")
    for op in RUN_AFTER_GRAPH:  # lowered, as checks run after the graph: counted with the others
        universe.setdefault(op, "run after the graph")
    use = _opinfo_use(results)
    from neuron_compile.legality import rules

    gens = list(rules.GENERATIONS)
    labels = legality_labels(results, sorted(universe), overloads)
    sources = verdict_sources(results, sorted(universe), overloads)
    for op in RUN_AFTER_GRAPH:
        sources[op] = (
            f"{NOT_EXERCISED}: taken out of the graph and run after it (value_checks.py): no lowering to judge"
        )
    status = {op: LOWERED if op in lowered else UNSUPPORTED for op in universe}
    n_status = {s: sum(1 for v in status.values() if v == s) for s in (LOWERED, UNSUPPORTED)}
    summary = results.get("summary", {})
    core = summary.get("core_float32", {})
    categories = summary.get("categories", {})
    config = results.get("config", {})

    from tests.support.opinfo_harness import CATEGORIES, SKIP_REASONS

    out: list[str] = []
    w = out.append
    w("# Op coverage of the neuron backend")
    w("")
    w("Generated by `python -m tools.gen_ops_doc` from the op registry and `docs/opinfo_results.json`")
    w("(written by `python -m tools.opinfo_sweep`). Do not edit by hand; `tests/test_opinfo.py` fails when")
    w("this file is stale.")
    w("")
    w("## Totals")
    w("")
    w(f"- aten ops the backend can meet after decomposition: **{len(status)}** — "
      f"lowered: **{n_status[LOWERED]}** (of which **{len(kernels)}** routed to an NKI kernel when the shapes "
      f"fit, column `NKI kernel`), unsupported (clear `NeuronUnsupportedOpError`): **{n_status[UNSUPPORTED]}**.")  # fmt: skip
    for gen in gens:
        kinds = [_kind(labels[op][gen]) for op in labels]
        w(f"- Legal for {gen} (legality pass, worst verdict over every graph that lowered the op): "
          f"**{kinds.count('legal')}** legal, **{kinds.count('assumed')}** legal by assumption, "
          f"**{kinds.count('illegal')}** illegal, {kinds.count(NOT_EXERCISED)} without a verdict.")  # fmt: skip
    from_opinfo = sum(1 for op in lowered if sources.get(op) == FROM_OPINFO)
    from_alone = sum(1 for op in lowered if sources.get(op) == FROM_ALONE)
    missing = sorted(op for op in lowered if sources.get(op) not in (FROM_OPINFO, FROM_ALONE))
    unexplained = [op for op in missing if sources.get(op) == NOT_EXERCISED]
    w(f"- Verdicts of the {len(lowered)} lowered ops: **{from_opinfo}** from the OpInfo sweep, **{from_alone}** from "
      f"exercising the overload alone (`python -m tools.exercise_overloads`, docs/overload_verdicts.json); "
      f"**{len(missing)} lowered ops without a verdict**"
      + (", each with the reason it cannot be exercised alone in its `verdict from` cell" if missing and not unexplained else "")
      + (f"; not yet exercised (rerun the tool): {', '.join(f'`{o}`' for o in unexplained)}" if unexplained else "")
      + ".")  # fmt: skip
    if summary:
        d = core.get("denominator", 0)
        w(f"- OpInfo entries (torch {results.get('torch')} `op_db`): **{summary.get('entries')}**.")
        rates = reach_rates(results)
        f32, bf16 = rates["float32"], rates["bfloat16"]
        n32 = f32["pass"] + f32["unsupported"] + f32["fail"]
        n16 = bf16["pass"] + bf16["unsupported"] + bf16["fail"]
        w(f"- **float32 pass rate over ALL entries whose float32 (or complex64) samples reach the backend "
          f"(categories {', '.join(REACHING)}): {f32['pass']}/{n32} = {_pct(f32['pass'], n32)}**; "
          f"{f32['unsupported']} raise the clear unsupported error, {f32['fail']} fail"
          + (f", {f32['not_reached']} had no checked float32 case" if f32["not_reached"] else "") + ".")  # fmt: skip
        w(f"- **bfloat16 pass rate over the same entries: {bf16['pass']}/{n16} = {_pct(bf16['pass'], n16)}** "
          f"(the {n16} whose bfloat16 cases reached the backend; {bf16['not_reached']} have no bfloat16 variant "
          f"on CPU or none of its bfloat16 cases reached the backend); {bf16['unsupported']} unsupported, "
          f"{bf16['fail']} fail.")  # fmt: skip
        w(f"- float32 pass rate over the core entries only (decompose to core ATen): {core.get('pass', 0)}/{d} = "
          f"{_pct(core.get('pass', 0), d)}; the other {core.get('unsupported', 0)} raise the clear unsupported "
          f"error; {core.get('fail', 0)} fail.")  # fmt: skip
        w(f"- Sweep configuration: {_depth_text(config)}; case outcomes: "
          + ", ".join(f"{k} {v}" for k, v in summary.get("case_outcomes", {}).items()) + ".")  # fmt: skip
        failing = summary.get("entries_failing", [])
        w(f"- Entries with a FAIL case (wrong value/dtype/shape or a crash that is not the clear error): "
          f"{len(failing)}{': ' + ', '.join(f'`{f}`' for f in failing) if failing else ''}.")  # fmt: skip
    w("")
    w("### The denominator")
    w("")
    w("An OpInfo entry counts as *decomposing to core ATen* when its float32 samples reach the backend")
    w("(Dynamo captures them in one graph) and the forward/backward graphs that AOTAutograd produces with")
    w("our decomposition table hold only core-ATen ops (PyTorch's `core` tag) or ops we keep whole on")
    w("purpose (`neuron_compile/decompositions.py` KEEP_WHOLE), on real strided tensors. It **passes** when")
    w("every tested float32 sample matches eager (values, dtype, shape, and gradients when the op supports")
    w("autograd). The all-entries rate counts every entry whose float32 samples reach the backend (core,")
    w("non-core and complex-or-sparse; a complex-only entry by its complex64 samples, when the sweep ran")
    w("them); its bfloat16 rate counts the same entries, over those whose bfloat16 cases reached the backend")
    w("(an entry with a FAIL case fails, else one with an UNSUPPORTED case is unsupported). Entry categories:")
    w("")
    w("| category | entries | meaning |")
    w("| --- | ---: | --- |")
    for cat, meaning in CATEGORIES.items():
        w(f"| {cat} | {categories.get(cat, 0)} | {meaning} |")
    w("")
    w("Case outcomes: PASS; UNSUPPORTED (our clear error); SKIP with one of the reasons below; FAIL.")
    w("")
    for key, meaning in SKIP_REASONS.items():
        w(f"- `SKIP:{key}`: {meaning}")
    w("")
    w("## aten ops")
    w("")
    w("`why listed`: core = PyTorch core ATen; kept whole = not decomposed on purpose; lowered = we lower")
    w("it although it is outside core ATen; refused = the registry always refuses it; seen in OpInfo = it")
    w("reached the backend in the sweep.")
    w("")
    w("`lowering paths`: everything the op's dispatch record (`neuron_compile/lowering/registry.py`) holds, in")
    w("the order `lowering/dispatch.py` applies it, as file::function under `neuron_compile/`: the pair lowering")
    w("for complex operands (`complex pair`), the NKI kernel site tried first (`NKI route`), the lowering, and")
    w("the channels-last handler of the CPU target (`channels-last`); for an op the registry refuses, the")
    w("reason its error gives.")
    w("")
    w(f"{' / '.join(gens)}: whether neuronx-cc would accept what the op lowers to, per generation, from the")
    w("legality pass (`neuron_compile/legality/`, rules from the public Neuron SDK docs, not verified on")
    w("hardware). Each HLO op is attributed to the aten node it came from (MLIR locations); the verdict is")
    w("the worst over every graph in which the op was lowered (all samples and dtypes). int64 counts as")
    w("legal (the neuron target passes `--native-int64`).")
    w("")
    w(f"`verdict from`: `{FROM_OPINFO}` = the graphs of the OpInfo sweep; `{FROM_ALONE}` = no OpInfo sample reaches")
    w("the op, so the verdict comes from `python -m tools.exercise_overloads`, which calls the overload alone on")
    w("representative inputs (float32, and bfloat16/int64/bool where eager takes them), lowers it with the")
    w("backend's lowering, runs it on the CPU target and compares with eager (docs/overload_verdicts.json")
    w("has the inputs and results per dtype); otherwise why the op has no verdict.")
    w("")
    w("- `yes`: every HLO op it lowered to is in the compiler's documented operator list (or named by later")
    w("  compiler docs) and meets its documented restrictions.")
    w("- `yes (assumed: ...)`: legal only by assumption: the listed HLO ops (or forms) are in no public")
    w("  operator list, so the docs do not settle them; they are elementwise/structural ops every XLA front")
    w("  end emits, taken as legal so that ordinary programs are not refused. To be confirmed on hardware.")
    w("- `no: <hlo op>: <reason>`: neuronx-cc would refuse it (on the CPU target the backend raises the clear")
    w("  unsupported error unless `strict=False`).")
    w(f"- `{NOT_EXERCISED}`: no graph lowered this op (unsupported ops: nothing to judge), so there is no verdict.")
    w("")
    w("### Assumed legal")
    w("")
    w("Every HLO op or form the legality pass takes as legal without documentation, in one list: the")
    w("`assumed` rules of `neuron_compile/legality/rules.py` and the forms its checks (`legality/checks.py`)")
    w("assume, with why each is taken as legal and how many aten ops' verdicts above cite it.")
    w("")
    w("| assumed HLO op or form | why taken as legal | aten ops citing it |")
    w("| --- | --- | ---: |")
    for name, why, n in assumed_forms(results, overloads):
        w(f"| `{name}` | {_cell(why)} | {n} |")
    w("")
    w("`NKI kernel`: the built-in NKI kernel(s) the routing table (`neuron_compile/lowering/kernel_routing.py`)")
    w("sends the op to when its shapes and dtypes fit the kernel (otherwise its StableHLO lowering runs).")
    w("Attention (`scaled_dot_product_attention`) reaches the flash-attention kernel as `neuron::flash_attention`.")
    w("")
    w(
        f"| aten op | status | lowering paths | NKI kernel | why listed | OpInfo entries using it | {' | '.join(gens)} "
        f"| verdict from |"
    )
    w(f"| --- | --- | --- | --- | --- | ---: |{' --- |' * len(gens)} --- |")
    for op in sorted(status):
        cells = " | ".join(_cell(labels[op][g]) for g in gens)
        place = where[op] if op in where else _cell(f"refused: {refused[op]}") if op in refused else ""
        kernel = f"`{kernels[op]}`" if op in kernels else ""
        source = _cell(sources[op]) if status[op] == LOWERED or sources[op] != NOT_EXERCISED else ""
        w(
            f"| `{op}` | {status[op]} | {place} | {kernel} | {universe[op]} | {len(use.get(op, []))} | {cells} "
            f"| {source} |"
        )
    w("")
    w("## Complex values")
    w("")
    w("Trainium has no complex dtype: inside a graph a complex value is a pair of real arrays (a trailing dim")
    w("of 2, `torch.view_as_real`'s layout) and these aten ops have a pair lowering")
    w("(`neuron_compile/lowering/complex_pairs.py`, FFT in `lowering/fft.py`); any other op on a complex value is")
    w("refused with the clear unsupported error. The StableHLO holds only real ops and goes through the same")
    w("legality pass as every graph.")
    w("")
    w(", ".join(f"`{op.removeprefix('aten.')}`" for op in complex_ops()))
    w("")
    if results.get("entries"):
        w("## OpInfo entries")
        w("")
        w("Columns per dtype: PASS / cases tested. `float32` is the entry's float32 status.")
        w("")
        w("| entry | category | float32 | f32 | bf16 | i64 | bool | unsupported ops or non-core ops |")
        w("| --- | --- | --- | ---: | ---: | ---: | ---: | --- |")
        for name in sorted(results["entries"]):
            e = results["entries"][name]
            notes = e.get("non_core_ops") or sorted({op for op in e["ops"] if status.get(op) == UNSUPPORTED})
            note = ", ".join(f"`{o.removeprefix('aten.')}`" for o in notes[:6]) + (" ..." if len(notes) > 6 else "")
            w(f"| `{name}` | {e['category']} | {e['float32']} | {_count(e, 'float32')} | {_count(e, 'bfloat16')} "
              f"| {_count(e, 'int64')} | {_count(e, 'bool')} | {note} |")  # fmt: skip
        w("")
    return "\n".join(out)


def load_results(path: Path = RESULTS) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def load_overloads(path: Path = OVERLOADS) -> dict[str, Any]:
    """docs/overload_verdicts.json (``python -m tools.exercise_overloads``), or {} when absent."""
    return json.loads(path.read_text()) if path.exists() else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/ops.md or op_verdicts.json is stale")
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--overloads", default=str(OVERLOADS), help="verdicts of the overloads exercised alone")
    parser.add_argument("--doc", default=str(DOC), help="where to write (e.g. /tmp for a subset sweep)")
    args = parser.parse_args(argv)
    results, overloads = load_results(Path(args.results)), load_overloads(Path(args.overloads))
    from neuron_compile.lowering.registry import VERDICTS_FILE

    outputs = {Path(args.doc): render(results, overloads), VERDICTS_FILE: verdicts_text(results, overloads)}
    if args.check:
        stale = [path for path, text in outputs.items() if not path.exists() or path.read_text() != text]
        for path in stale:
            print(f"{path} is stale: run python -m tools.gen_ops_doc", file=sys.stderr)
        return 1 if stale else 0
    for path, text in outputs.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
