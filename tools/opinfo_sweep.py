"""The OpInfo sweep: every OpInfo entry x dtype x sample through backend="neuron"; writes the results file.

    python tools/opinfo_sweep.py                      # default: up to 4 samples per entry per dtype
    python tools/opinfo_sweep.py --samples 0          # every sample (the full sweep; hours on 2 cores)
    python tools/opinfo_sweep.py --ops add,cat --out /tmp/r.json --print

The results file (default docs/opinfo_results.json) feeds tools/gen_ops_doc.py, which writes docs/ops.md.
Besides the outcomes it records, per aten op, the trn2/trn3 legality verdict (``legality.verdicts_by_op``
on every graph the cases lowered, worst verdict wins) under "legality". A subset run (``--ops``) is checked
with ``python tools/gen_ops_doc.py --results /tmp/r.json --doc /tmp/ops.md``.
Cases run in worker processes (``--jobs``), each entry in one worker, results merged in op_db order.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools import opinfo_harness as H  # noqa: E402

DEFAULT_OUT = ROOT / "docs" / "opinfo_results.json"

_DB: dict[str, Any] = {}


def _worker_init() -> None:
    # Off even if the caller's environment turns it on: a cache hit skips the legality pass, whose
    # per-op verdicts the results file records.
    os.environ["NEURON_COMPILE_CACHE"] = "0"
    _DB.update({H.entry_name(o): o for o in H.load_op_db()})


def _run_entry(task: tuple[str, dict[str, int | None]]) -> dict[str, Any]:
    name, per_dtype = task
    op = _DB[name]
    t0 = time.perf_counter()
    results = []
    try:
        results = H.run_cases(op, list(H.cases(op, per_dtype)))
    except Exception as e:  # noqa: BLE001 - sample generation itself failed
        results.append(H.CaseResult(name, "float32", -1, H.FAIL, f"sample generation: {type(e).__name__}: {e}"))
    return H.entry_record(op, results, time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4, help="samples per entry per dtype (0 = all)")
    parser.add_argument("--ops", default="", help="comma-separated OpInfo entry names (default: all)")
    parser.add_argument("--dtypes", default=",".join(H.DTYPES), help="dtypes to test")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--print", action="store_true", help="print every non-PASS case")
    args = parser.parse_args(argv)

    limit = None if args.samples == 0 else args.samples
    per_dtype = {d: limit for d in args.dtypes.split(",")}
    names = [H.entry_name(o) for o in H.load_op_db()]
    if args.ops:
        wanted = set(args.ops.split(","))
        names = [n for n in names if n in wanted]
    tasks = [(n, per_dtype) for n in names]
    t0 = time.perf_counter()
    entries: list[dict[str, Any]] = []
    # maxtasksperchild: Dynamo/jax caches grow with every compile; fresh workers keep memory bounded.
    with mp.get_context("spawn").Pool(args.jobs, initializer=_worker_init, maxtasksperchild=250) as pool:
        for i, rec in enumerate(pool.imap(_run_entry, tasks)):
            entries.append(rec)
            print(f"[{i + 1}/{len(tasks)}] {rec['entry']}: {rec['status']} ({rec['seconds']:.1f}s)", flush=True)
            if args.print:
                for c in rec["cases"]:
                    if c["outcome"] != H.PASS:
                        print("    ", c["dtype"], c["index"], c["outcome"], c["detail"][:300], flush=True)
    results = H.results_document(entries, {"samples_per_dtype": args.samples, "dtypes": list(per_dtype)})
    Path(args.out).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(json.dumps(results["summary"], indent=1))
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
