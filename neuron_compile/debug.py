"""Debug dumps of compiled graphs. (Filled in by issue 4.)"""

from __future__ import annotations

from typing import Any

from .options import Options


def dump_graph(opts: Options, name: str, gm: Any, lowered: Any, report: Any, timings: dict[str, float]) -> None:
    """Write the FX graph, StableHLO, legality report and timings of one graph when debugging is on."""
    return None
