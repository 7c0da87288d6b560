"""PyTorch's OpInfo database through backend="neuron": every case passes or fails loudly.

Each OpInfo entry is one test. It compiles the op on a deterministic choice of CPU samples (float32 with
gradients where the op supports autograd, bfloat16, float16, int64, bool where the op takes them) and
compares with eager; a 16-bit float value that differs from eager passes only as close to the float64
reference as eager's own (``opinfo_harness.accuracy_distances``). A case may end as PASS, as our clear ``NeuronUnsupportedOpError`` (EXPECTED-UNSUPPORTED), or
as one of the explained skips of ``tests/support/opinfo_harness.SKIP_REASONS``; anything else, above all a value
that differs from eager without an error, fails the test. There is no list of known-wrong results.

The default run (``-m 'not extended'``) takes the quarter of the entries whose rotated dtype is bfloat16; CI's
extended job (``-m extended``) the other three quarters. CI runs a bounded sample, rotated over every sample index
by a fixed scheme (``_ci_cases``):

- dtypes: float32 on every entry; bfloat16, float16, int64 and bool each on the quarter of the entries
  whose ``crc32(entry) % 4`` is that dtype's position in ``ROTATED_DTYPES``;
- samples: of the n samples OpInfo makes for (entry, dtype), numbered 0..n-1 (all of them, not a
  leading window), CI takes ``NEURON_OPINFO_SAMPLES`` (default 1) consecutive ones, wrapping around,
  starting at ``(crc32("entry/dtype") + NEURON_OPINFO_ROTATION * NEURON_OPINFO_SAMPLES) % n``. The hash
  spreads the start over every index across the suite; ``NEURON_OPINFO_ROTATION`` (default 0; e.g. the
  CI run number) walks each (entry, dtype) through all its samples in ceil(n / SAMPLES) runs.

The full sweep, which also writes docs/opinfo_results.json for docs/ops.md:

    python tools/opinfo_sweep.py --samples 0 --dtypes float32,bfloat16,float16   # every sample (~1 h)
    python tools/opinfo_sweep.py                      # up to 4 samples per entry and dtype
    NEURON_OPINFO_FULL=1 python -m pytest tests/test_opinfo.py   # the same cases as pytest tests
"""

from __future__ import annotations

import json
import os
import zlib

import pytest
import torch

from tests.support import opinfo_harness as H
from tools import gen_ops_doc

FULL = os.environ.get("NEURON_OPINFO_FULL", "") not in ("", "0")
SAMPLES = int(os.environ.get("NEURON_OPINFO_SAMPLES", "1"))
ROTATION = int(os.environ.get("NEURON_OPINFO_ROTATION", "0"))
#: The dtypes besides float32, each run by CI on a quarter of the entries (see the module docstring).
ROTATED_DTYPES = ("bfloat16", "float16", "int64", "bool")

OP_DB = {H.entry_name(op): op for op in H.load_op_db()}


def _bucket(name: str) -> int:
    return zlib.crc32(name.encode()) % len(ROTATED_DTYPES)


def ci_indices(name: str, dtype: str, n: int, samples: int = SAMPLES, rotation: int = ROTATION) -> list[int]:
    """The sample indices CI runs for (entry ``name``, ``dtype``) out of ``n`` samples."""
    if n == 0:
        return []
    start = (zlib.crc32(f"{name}/{dtype}".encode()) + rotation * samples) % n
    return sorted({(start + j) % n for j in range(min(samples, n))})


def _ci_cases(op) -> list:
    """CI: float32 always, each other dtype on its quarter of the entries, samples rotated (docstring)."""
    name = H.entry_name(op)
    chosen = []
    for dtype in H.tested_dtypes(op):
        if dtype != "float32" and _bucket(name) != ROTATED_DTYPES.index(dtype):
            continue
        with_grad = dtype == "float32" and op.supports_autograd
        every = H.samples(op, dtype, None, with_grad)
        chosen += [(dtype, i, every[i], with_grad) for i in ci_indices(name, dtype, len(every))]
    return chosen


def _cases(op) -> list:
    if FULL:
        return list(H.cases(op, {d: None for d in H.DTYPES}))
    return _ci_cases(op)


def test_ci_rotation_reaches_every_sample() -> None:
    """Successive rotations walk an (entry, dtype) through all its samples, each once per cycle."""
    n, samples = 11, 3
    cycle = -(-n // samples)
    seen = [i for r in range(cycle) for i in ci_indices("add", "float32", n, samples, r)]
    assert sorted(set(seen)) == list(range(n))
    assert ci_indices("add", "float32", n, samples, 0) == ci_indices("add", "float32", n, samples, cycle * n)


@pytest.mark.parametrize(
    "entry",
    [e if _bucket(e) == 0 else pytest.param(e, marks=pytest.mark.extended) for e in sorted(OP_DB)],
)
def test_opinfo(entry: str) -> None:
    op = OP_DB[entry]
    results = H.run_cases(op, _cases(op))
    failures = [r for r in results if r.outcome == H.FAIL]
    assert not failures, "compiled result differs from eager or crashed without the clear error:\n" + "\n".join(
        r.line() for r in failures
    )
    for r in results:
        assert r.outcome in (H.PASS, H.UNSUPPORTED) or r.detail.split(":")[0] in H.SKIP_REASONS, r.line()


def test_results_file_covers_op_db() -> None:
    """docs/opinfo_results.json holds a record for every OpInfo entry, and no silently-wrong case."""
    results = json.loads(gen_ops_doc.RESULTS.read_text())
    assert sorted(results["entries"]) == sorted(OP_DB)
    wrong = [
        f"{name} [{c['dtype']} #{c['index']}]: {c['detail'][:200]}"
        for name, e in results["entries"].items()
        for c in e["cases"]
        if c["outcome"] == H.FAIL and not c["detail"].startswith("crash")
    ]
    assert not wrong, "the recorded sweep has silently-wrong results:\n" + "\n".join(wrong)


def test_ops_doc_is_current() -> None:
    """docs/ops.md matches the op registry, docs/opinfo_results.json and docs/overload_verdicts.json
    (regenerate: python -m tools.gen_ops_doc)."""
    expected = gen_ops_doc.render(gen_ops_doc.load_results())
    actual = gen_ops_doc.DOC.read_text() if gen_ops_doc.DOC.exists() else ""
    assert actual == expected, "docs/ops.md is stale: run `python -m tools.gen_ops_doc`"


def test_record_verdicts_are_current() -> None:
    """The verdicts the op records read (neuron_compile/lowering/op_verdicts.json) are those of docs/ops.md."""
    from neuron_compile.lowering.registry import VERDICTS_FILE

    expected = gen_ops_doc.verdicts_text(gen_ops_doc.load_results(), gen_ops_doc.load_overloads())
    actual = VERDICTS_FILE.read_text() if VERDICTS_FILE.exists() else ""
    assert actual == expected, f"{VERDICTS_FILE} is stale: run `python -m tools.gen_ops_doc`"


# ---- corner cases of torch semantics that random OpInfo samples rarely hit ---------------------------
_I = torch.tensor([7, -7, 7, -7, 0, 5], dtype=torch.int64)
_J = torch.tensor([2, 2, -2, -2, 3, -5], dtype=torch.int64)
_F = torch.tensor([7.5, -7.5, 1.0, -1.0, 0.0, -0.0, 2.0, -2.0, float("nan"), float("inf")])
_G = torch.tensor([2.0, 2.0, 0.0, 0.0, 0.0, -2.0, float("inf"), float("inf"), 1.0, 3.0])

CORNER_CASES = {
    "div_true_int": (lambda a, b: torch.div(a, b, rounding_mode=None), (_I, _J)),
    "div_trunc_int": (lambda a, b: torch.div(a, b, rounding_mode="trunc"), (_I, _J)),
    "div_floor_int": (lambda a, b: torch.div(a, b, rounding_mode="floor"), (_I, _J)),
    "div_floor_float": (lambda a, b: torch.div(a, b, rounding_mode="floor"), (_F, _G)),
    "div_trunc_float": (lambda a, b: torch.div(a, b, rounding_mode="trunc"), (_F, _G)),
    "remainder_int": (torch.remainder, (_I, _J)),
    "remainder_float": (torch.remainder, (_F, _G)),
    "fmod_int": (torch.fmod, (_I, _J)),
    "fmod_float": (torch.fmod, (_F, _G)),
    "remainder_scalar": (lambda a: torch.remainder(a, -3), (_I,)),
    "pow_int_neg_exp": (torch.pow, (torch.tensor([2, -1, 1, -1, 3, 0]), torch.tensor([-1, -3, -2, -4, 2, 0]))),
    "pow_int_big_exp": (torch.pow, (torch.tensor([-1, 1, 2, -2]), torch.tensor([65, 64, 62, 63]))),
    "pow_scalar_base": (lambda b: torch.pow(2, b), (torch.tensor([0, 1, 5, 10]),)),
    "pow_square": (lambda a: a**2, (_F,)),
    "sign_nan": (torch.sign, (_F,)),
    "clamp_nan": (lambda a: torch.clamp(a, -1.0, 1.0), (_F,)),
    "clamp_lo_gt_hi": (lambda a: torch.clamp(a, 3.0, 1.0), (_F,)),
    "clamp_int_float": (lambda a: torch.clamp(a, 0.5, 3.5), (_I,)),
    "clamp_tensor_nan": (lambda a, b: torch.clamp(a, min=b), (_F, _G.flip(0))),
    "add_bool": (torch.add, (torch.tensor([True, False, False]), torch.tensor([True, True, False]))),
    "mul_bool": (torch.mul, (torch.tensor([True, False, True]), torch.tensor([True, True, False]))),
    "round_half_even": (torch.round, (torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5]),)),
    # XLA CPU turns x / 100 into x * 0.01 (1 ulp off eager's division); the rounding itself is exact.
    "round_decimals": (lambda a: torch.round(a, decimals=2), (torch.tensor([1.005, 2.675, -0.125, 1234.5678]),), 1),
    "round_decimals_neg": (lambda a: torch.round(a, decimals=-2), (torch.tensor([1250.0, 1350.0, -149.0]),)),
    "digamma_poles": (torch.digamma, (torch.tensor([0.0, -0.0, -1.0, -2.0]),)),
    "arange_float": (lambda a: a + torch.arange(0.1, 3.3, 0.37), (torch.zeros(9),)),
}


@pytest.mark.parametrize("case", sorted(CORNER_CASES))
def test_corner_case(case: str) -> None:
    """Exactly eager's value and dtype (integer and rounding rules admit no tolerance)."""
    fn, args, *ulps = CORNER_CASES[case]
    expected = fn(*args)
    actual = torch.compile(fn, backend="neuron", fullgraph=True, dynamic=False)(*args)
    assert actual.dtype == expected.dtype, f"{case}: dtype {actual.dtype}, eager {expected.dtype}"
    rtol = ulps[0] * torch.finfo(expected.dtype).eps if ulps else 0.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=0, equal_nan=True, msg=lambda m: f"{case}: {m}")
