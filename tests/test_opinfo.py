"""PyTorch's OpInfo database through backend="neuron": every case passes or fails loudly.

Each OpInfo entry is one test. It compiles the op on a deterministic choice of CPU samples (float32 with
gradients where the op supports autograd, bfloat16, int64, bool where the op takes them) and compares
with eager. A case may end as PASS, as our clear ``NeuronUnsupportedOpError`` (EXPECTED-UNSUPPORTED), or
as one of the explained skips of ``tools/opinfo_harness.SKIP_REASONS``; anything else, above all a value
that differs from eager without an error, fails the test. There is no list of known-wrong results.

CI runs a bounded sample (``NEURON_OPINFO_SAMPLES`` samples per entry and dtype, default 1, picked
deterministically among the first 4; bf16/int64/bool on a fixed third of the entries each). The full
sweep, which also writes docs/opinfo_results.json for docs/ops.md:

    python tools/opinfo_sweep.py --samples 0          # every sample of every dtype (hours)
    python tools/opinfo_sweep.py                      # up to 4 samples per entry and dtype
    NEURON_OPINFO_FULL=1 python -m pytest tests/test_opinfo.py   # the same cases as pytest tests
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools import gen_ops_doc  # noqa: E402
from tools import opinfo_harness as H  # noqa: E402

FULL = os.environ.get("NEURON_OPINFO_FULL", "") not in ("", "0")
SAMPLES = int(os.environ.get("NEURON_OPINFO_SAMPLES", "1"))
#: The CI choice among the first few samples, so that ops are not all tested on their first (often 0-d) one.
CHOICE_WINDOW = 4

OP_DB = {H.entry_name(op): op for op in H.load_op_db()}


def _bucket(name: str) -> int:
    return zlib.crc32(name.encode()) % 3


def _ci_cases(op) -> list:
    """CI: float32 always; each other dtype on the third of the entries whose bucket it owns."""
    name = H.entry_name(op)
    chosen = []
    for k, dtype in enumerate(H.tested_dtypes(op)):
        if dtype != "float32" and _bucket(name) != ("bfloat16", "int64", "bool").index(dtype):
            continue
        with_grad = dtype == "float32" and op.supports_autograd
        window = H.samples(op, dtype, max(CHOICE_WINDOW, SAMPLES), with_grad)
        if not window:
            continue
        start = zlib.crc32(f"{name}/{dtype}".encode()) % len(window)
        for j in range(min(SAMPLES, len(window))):
            index = (start + j) % len(window)
            chosen.append((dtype, index, window[index], with_grad))
    return chosen


def _cases(op) -> list:
    if FULL:
        return list(H.cases(op, {d: None for d in H.DTYPES}))
    return _ci_cases(op)


@pytest.mark.parametrize("entry", sorted(OP_DB))
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
    """docs/ops.md matches the op registry and docs/opinfo_results.json (regenerate: tools/gen_ops_doc.py)."""
    expected = gen_ops_doc.render(gen_ops_doc.load_results())
    actual = gen_ops_doc.DOC.read_text() if gen_ops_doc.DOC.exists() else ""
    assert actual == expected, "docs/ops.md is stale: run `python tools/gen_ops_doc.py`"
