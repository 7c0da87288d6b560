"""Exercises every lowered overload on its own and records its trn2/trn3 legality verdict for docs/ops.md.

    python -m tools.exercise_overloads            # writes docs/overload_verdicts.json
    python -m tools.exercise_overloads --only aten.add.Tensor,aten.sin.default   # prints, writes nothing

The cases, the batches and the comparison with eager are ``tests/support/exercise_overloads.py`` (shared with
tests/test_overloads.py, which runs the first dtype of every overload); this command runs them all.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tests.support.exercise_overloads import RESULTS, document, dumps, exercise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated overloads: print their records, write nothing")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or None
    doc = document(exercise(names))
    bad = [
        f"{name} [{c['dtype']}]({c['inputs']}): {c['problem']}"
        for name, r in doc["overloads"].items()
        for c in r.get("cases", [])
        if c["lowered"] and not c["matched"]
    ]
    for line in bad:
        print("MISMATCH", line)
    for name in doc["summary"]["not_exercised"]:
        print("NO VERDICT", name, doc["overloads"][name].get("reason", ""))
    print(json.dumps(doc["summary"] | {"not_exercised": len(doc["summary"]["not_exercised"])}))
    if names is None:
        Path(args.out).write_text(dumps(doc))
        print(f"wrote {args.out}")
    else:
        print(json.dumps({n: doc["overloads"][n] for n in names}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
