"""Writes the "API coverage" table of docs/nki.md: every documented ``nki.language`` / ``nki.isa`` entry
(NKI 0.6 reference plus the 0.7 and 0.8 additions) and the emulator's state for it.

    python -m tools.gen_nki_api_table           # rewrite the table in docs/nki.md (from the repository root)
    python -m tools.gen_nki_api_table --check   # exit 1 if it is stale

The documented surface and the state check live in ``neuron_compile/kernels/emulator/api_surface.py``:
"implemented" means the emulator has it with the documented parameter names in order; "refused" means
calling it raises ``NkiUnsupportedError`` naming it; "missing" would be a gap (tests/test_nki_api_surface.py
fails on one). Only the part of docs/nki.md between the two markers is generated.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "nki.md"
START, END = "<!-- nki-api-table:start (python -m tools.gen_nki_api_table) -->", "<!-- nki-api-table:end -->"


def render_table() -> str:
    from neuron_compile.kernels.emulator.api_surface import TUTORIAL_NAMES, api_states

    states = api_states()
    used = {("nki.language", n) for n in TUTORIAL_NAMES["language"]} | {("nki.isa", n) for n in TUTORIAL_NAMES["isa"]}
    used |= {("nki.language.tile_size", n) for n in TUTORIAL_NAMES["tile_size"]}
    used |= {("NkiTensor", n) for n in TUTORIAL_NAMES["tensor"]}
    counts = Counter(s.state for s in states)
    lines = [
        START,
        "",
        f"{len(states)} documented entries: "
        + ", ".join(f"{counts[k]} {k}" for k in ("implemented", "refused", "missing"))
        + ". "
        "T = used by AWS's published tutorials/examples (all implemented). NKI = the releases that have the "
        "entry (the emulator enforces them: `nki.simulate(kernel, nki_version=...)`, `NEURON_COMPILE_NKI_VERSION`).",
        "",
        "| module | name | documented parameters | NKI | state | note |",
        "|---|---|---|---|---|---|",
    ]
    for s in states:
        params = "—" if s.params is None else f"`({s.params})`"
        tag = " (T)" if (s.module, s.name) in used else ""
        lines.append(f"| {s.module} | `{s.name}`{tag} | {params} | {s.releases} | {s.state} | {s.note} |")
    lines += ["", END]
    return "\n".join(lines)


def render(doc_text: str) -> str:
    """``doc_text`` with its table replaced (appended under an 'API coverage' heading if absent)."""
    table = render_table()
    if START in doc_text and END in doc_text:
        head, rest = doc_text.split(START, 1)
        _, tail = rest.split(END, 1)
        return head + table + tail
    return doc_text.rstrip("\n") + "\n\n## API coverage\n\n" + table + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the table in docs/nki.md is stale")
    args = parser.parse_args(argv)
    current = DOC.read_text()
    new = render(current)
    if args.check:
        if new != current:
            print("docs/nki.md's API table is stale: run `python -m tools.gen_nki_api_table`", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
