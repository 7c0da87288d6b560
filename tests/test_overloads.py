"""Every lowered aten overload, exercised alone: the lowering equals eager and has a legality verdict.

Many lowered overloads are reached by no OpInfo sample (backward ops, ``*_copy`` variants, overloads
that decompositions produce), so docs/ops.md takes their trn2/trn3 verdict from
``tests/support/exercise_overloads.py``. Here each overload of ``supported_ops()`` runs on representative
inputs built from its schema (``OVERRIDES`` where the schema's defaults do not make a valid call), in
the first dtype of float32/bfloat16/int64/bool that eager takes; many overloads share one compiled graph
(XLA's compile time per graph dominates). The full tool also runs the other dtypes and records them in
docs/overload_verdicts.json, whose recorded cases must all match eager too.
"""

from __future__ import annotations

import pytest
import torch

from neuron_compile.lowering import registry, supported_ops
from tests.support import exercise_overloads as X
from tools import gen_ops_doc

LOWERED = supported_ops()
ALONE = [name for name in LOWERED if not X.not_isolated(name)]
CHUNKS = [ALONE[i : i + X.BATCH_SIZE] for i in range(0, len(ALONE), X.BATCH_SIZE)]


@pytest.mark.extended  # ~100 s of the suite: CI's extended job (pyproject.toml's markers)
@pytest.mark.parametrize("names", CHUNKS, ids=lambda c: f"{c[0]}..{c[-1]}")
def test_overloads_match_eager_and_have_a_verdict(names: list[str]) -> None:
    cases, no_input = [], []
    for name in names:
        made, note = X.make_cases(name, first_only=True)
        if not made:
            no_input.append(f"{name}: {note}")
        cases += made
    assert not no_input, "no valid representative input; add the overload to OVERRIDES in " \
        "tests/support/exercise_overloads.py:\n" + "\n".join(no_input)  # fmt: skip
    result = X.run_batch(cases, "test_overloads")
    wrong = [f"{c.line()}: {c.problem}" for c in cases if c.problem]
    assert not wrong, "lowered overload refused, crashed or differs from eager:\n" + "\n".join(wrong)
    without = [name for name in names if name not in result.verdicts]
    assert not without, f"lowered but no legality verdict: {without}"


def test_only_tensorless_overloads_are_not_exercised() -> None:
    """An overload may be left out only when no aten graph of tensors can hold it (Python numbers,
    lists, dicts): every op that takes a tensor gets exercised and judged."""
    tensor_types = {"Tensor", "Optional[Tensor]", "List[Tensor]", "List[Optional[Tensor]]"}
    left_out = [name for name in LOWERED if X.not_isolated(name)]
    takes_tensors = [n for n in left_out if any(str(a.type) in tensor_types for a in X.overload(n)._schema.arguments)]
    assert not takes_tensors, f"tensor overloads left out of the exercise: {takes_tensors}"


def test_a_wrong_lowering_is_caught() -> None:
    """The exercise fails a lowering that returns the wrong value, naming the overload and its inputs."""
    (case,), _ = X.make_cases("aten.neg.default", first_only=True)
    with registry.replaced(torch.ops.aten.neg.default, "lowering", lambda x: x):
        X.run_batch([case])
    assert case.lowered and case.problem and "values differ" in case.problem
    assert case.line() == "aten.neg.default(float32[3, 4]) [float32]"


def test_recorded_cases_match_eager() -> None:
    """docs/overload_verdicts.json (every dtype) holds no lowered case whose value differs from eager."""
    doc = X.load()
    wrong = [
        f"{name} [{c['dtype']}]({c['inputs']}): {c.get('problem', '')}"
        for name, rec in doc.get("overloads", {}).items()
        for c in rec.get("cases", [])
        if c["lowered"] and not c["matched"]
    ]
    assert not wrong, "the recorded exercise has wrong values (fix, then rerun the tool):\n" + "\n".join(wrong)


# ---- how docs/ops.md uses the verdicts and counts the OpInfo entries -----------------------------------------
def _verdict(legal: bool, assumed: list[str] = (), reasons: list[str] = ()) -> dict:
    rec = {"legal": legal, "assumed": list(assumed), "reasons": list(reasons)}
    return {"trn2": rec, "trn3": rec}


def test_opinfo_verdict_first_then_the_overload_exercise() -> None:
    results = {"legality": {"aten.a.default": _verdict(True)}}
    overloads = {
        "overloads": {
            "aten.a.default": _verdict(False, reasons=["stablehlo.x: no"]),
            "aten.b.default": _verdict(True, assumed=["stablehlo.or"]),
            "aten.c.float": {"exercised": False, "reason": "Python numbers only"},
        }
    }
    ops = ["aten.a.default", "aten.b.default", "aten.c.float", "aten.d.default"]
    labels = gen_ops_doc.legality_labels(results, ops, overloads)
    sources = gen_ops_doc.verdict_sources(results, ops, overloads)
    assert [labels[o]["trn2"] for o in ops] == ["yes", "yes (assumed: stablehlo.or)", "not exercised", "not exercised"]
    assert [sources[o] for o in ops] == [
        "OpInfo", "exercised alone", "not exercised: Python numbers only", "not exercised"
    ]  # fmt: skip


def test_every_assumed_form_is_listed_once() -> None:
    from neuron_compile.legality import rules

    overloads = {"overloads": {"aten.b.default": _verdict(True, assumed=["stablehlo.or", "stablehlo.new(form)"])}}
    listed = gen_ops_doc.assumed_forms({}, overloads)
    names = [name for name, _, _ in listed]
    assert len(names) == len(set(names))
    expected = {n for n, r in rules.OPS.items() if r.source == "assumed"} | set(gen_ops_doc._ASSUMED_FORMS)
    assert expected | {"stablehlo.new(form)"} == set(names)
    assert dict((n, k) for n, _, k in listed)["stablehlo.or"] == 1


def test_pass_rates_over_every_entry_that_reaches_the_backend() -> None:
    entries = {
        "a": {"category": "core", "float32": "pass", "counts": {"float32": {"PASS": 2}, "bfloat16": {"PASS": 1}}},
        "b": {"category": "non-core", "float32": "unsupported",
              "counts": {"float32": {"UNSUPPORTED": 2}, "bfloat16": {"PASS": 1, "UNSUPPORTED": 1}}},
        "c": {"category": "complex-or-sparse", "float32": "pass", "counts": {"float32": {"PASS": 1}}},
        "d": {"category": "not-captured", "float32": "n/a", "counts": {"float32": {"SKIP:not-captured": 2}}},
        "e": {"category": "no-float32", "float32": "n/a", "counts": {"complex64": {"FAIL": 1}}},
        "f": {"category": "core", "float32": "pass",
              "counts": {"float32": {"PASS": 1}, "bfloat16": {"SKIP:not-captured": 1}}},
    }  # fmt: skip
    rates = gen_ops_doc.reach_rates({"entries": entries})
    assert rates["float32"] == {"entries": 5, "pass": 3, "unsupported": 1, "fail": 1, "not_reached": 0}
    assert rates["bfloat16"] == {"entries": 5, "pass": 1, "unsupported": 1, "fail": 0, "not_reached": 3}
