"""The OpInfo sweep: every OpInfo entry x dtype x sample through backend="neuron"; writes the results file.

    python -m tools.opinfo_sweep                      # default: up to 4 samples per entry per dtype
    python -m tools.opinfo_sweep --samples 0          # every sample (the full sweep; hours on 2 cores)
    python -m tools.opinfo_sweep --ops add,cat --out /tmp/r.json --print
    python -m tools.opinfo_sweep --samples 0 --ops linspace,gather --merge   # rerun entries in the file
    python -m tools.opinfo_sweep --samples 0 --dtypes float32,bfloat16,float16,int64:2,bool:2
                                                      # a dtype's own depth after a colon (0 = all)

``--merge`` keeps the other entries of the existing results file and replaces (or adds) the ones run, so
that a fix is re-checked at the file's depth without rerunning everything; the file's configuration
must match (same samples and dtypes). While it runs, the sweep rewrites ``--out`` after every entry
(finished entries plus, with ``--merge``, the old ones), so a stopped sweep leaves a usable file and
``--resume`` continues it, skipping entries already in the file.

The results file (default docs/opinfo_results.json) feeds tools/gen_ops_doc.py (``python -m tools.gen_ops_doc``), which writes docs/ops.md.
Besides the outcomes it records, per aten op, the trn2/trn3 legality verdict (``legality.verdicts_by_op``
on every graph the cases lowered, worst verdict wins) under "legality". A subset run (``--ops``) is checked
with ``python -m tools.gen_ops_doc --results /tmp/r.json --doc /tmp/ops.md``.
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

from tests.support import opinfo_harness as H

ROOT = Path(__file__).resolve().parent.parent

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
    except Exception as e:
        results.append(H.CaseResult(name, "float32", -1, H.FAIL, f"sample generation: {type(e).__name__}: {e}"))
    return H.entry_record(op, results, time.perf_counter() - t0)


def _entry_legality_of(doc: dict[str, Any], entry: str) -> dict[str, dict[str, Any]]:
    """An entry's per-op legality records, rebuilt from a results file's merged "legality" map: the ops
    the entry lowered, each with the file's (worst over all entries) verdict, made legal (reasons
    dropped) for a generation where the file's "illegal_in" does not name the entry."""
    ops = set(doc["entries"][entry].get("ops", ()))
    out: dict[str, dict[str, Any]] = {}
    for op, by_gen in doc.get("legality", {}).items():
        if op not in ops:
            continue
        mine = entry in by_gen.get("illegal_in", ())
        out[op] = {
            gen: rec if rec["legal"] or mine else {**rec, "legal": True, "reasons": []}
            for gen, rec in by_gen.items()
            if gen != "illegal_in"
        }
    return out


def _depth_per_dtype(spec: str, default: int) -> dict[str, int]:
    """``float32,int64:2`` -> {"float32": default, "int64": 2}: samples per entry for each dtype (0 = all)."""
    depth: dict[str, int] = {}
    for item in spec.split(","):
        name, _, n = item.partition(":")
        depth[name] = int(n) if n else default
    return depth


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4, help="samples per entry per dtype (0 = all)")
    parser.add_argument("--ops", default="", help="comma-separated OpInfo entry names (default: all)")
    parser.add_argument(
        "--dtypes", default=",".join(H.DTYPES), help="dtypes to test; DTYPE:N tests N samples of that dtype"
    )
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--print", action="store_true", help="print every non-PASS case")
    parser.add_argument("--merge", action="store_true", help="keep the other entries of --out")
    parser.add_argument("--resume", action="store_true", help="skip entries already in --out")
    args = parser.parse_args(argv)

    depth = _depth_per_dtype(args.dtypes, args.samples)
    per_dtype = {d: None if n == 0 else n for d, n in depth.items()}
    names = [H.entry_name(o) for o in H.load_op_db()]
    if args.ops:
        wanted = set(args.ops.split(","))
        unknown = wanted - set(names)
        if unknown:
            parser.error(f"--ops: no OpInfo entry named {', '.join(sorted(unknown))}")
        names = [n for n in names if n in wanted]
    uniform = len(set(depth.values())) == 1
    config = {"samples_per_dtype": args.samples if uniform else depth, "dtypes": list(per_dtype)}
    order = {n: i for i, n in enumerate(H.entry_name(o) for o in H.load_op_db())}
    kept: dict[str, dict[str, Any]] = {}
    if args.merge or args.resume:
        old = json.loads(Path(args.out).read_text())
        if old["config"] != config:
            parser.error(f"--merge/--resume: {args.out} was made with {old['config']}, this run is {config}")
        kept = {n: {**e, "legality": _entry_legality_of(old, n)} for n, e in old["entries"].items()}
        if args.resume:
            names = [n for n in names if n not in kept]
        else:
            kept = {n: e for n, e in kept.items() if n not in set(names)}
    tasks = [(n, per_dtype) for n in names]
    t0 = time.perf_counter()
    entries: list[dict[str, Any]] = []

    def write() -> dict[str, Any]:
        every = sorted([*kept.values(), *entries], key=lambda e: order.get(e["entry"], len(order)))
        doc = H.results_document(every, config)
        Path(args.out).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        return doc

    # maxtasksperchild: Dynamo/jax caches grow with every compile; fresh workers keep memory bounded.
    with mp.get_context("spawn").Pool(args.jobs, initializer=_worker_init, maxtasksperchild=250) as pool:
        for i, rec in enumerate(pool.imap(_run_entry, tasks)):
            entries.append(rec)
            print(f"[{i + 1}/{len(tasks)}] {rec['entry']}: {rec['status']} ({rec['seconds']:.1f}s)", flush=True)
            if args.print:
                for c in rec["cases"]:
                    if c["outcome"] != H.PASS:
                        print("    ", c["dtype"], c["index"], c["outcome"], c["detail"][:300], flush=True)
            write()
    results = write()
    print(json.dumps(results["summary"], indent=1))
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
