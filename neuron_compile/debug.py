"""Debug dumps of compiled graphs, and a one-line-per-graph summary log.

``options={"debug_dir": D}`` or ``NEURON_COMPILE_DEBUG_DIR=D`` writes, for each graph compiled (a cache
miss), into one folder per process ``D/neuron_compile_<YYYYmmdd-HHMMSS>_pid<PID>/<graph name>/``:

- ``fx_graph.py``      the aten FX graph (forward or backward) with the user's source lines as comments
- ``stablehlo.mlir``   the StableHLO module with MLIR locations (each op's named scope is
                       ``aten.op#node@file.py:LINE``; the rest of the location is the Python call stack)
- ``nodes.json``       named scope -> aten op, inputs, node name and the user's full file:line
- ``legality.txt``     the legality report (and ``legality.json``)
- ``timings.json``     lowering / legality / target-compile seconds

A graph refused by the legality pass is dumped too, with the report that refused it.
``NEURON_COMPILE_LOGS=graphs`` (or ``1``) prints one summary line per compiled graph to stderr; the
lines always go to the ``neuron_compile.graphs`` logger at INFO level.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from .options import Options

log = logging.getLogger("neuron_compile.graphs")

_lock = threading.Lock()
_process_dirs: dict[str, Path] = {}
_handler: logging.Handler | None = None


def summary_enabled() -> bool:
    return os.environ.get("NEURON_COMPILE_LOGS", "").strip().lower() in ("1", "graphs", "all", "true", "on")


def _ensure_summary_handler() -> None:
    global _handler
    if _handler is None and summary_enabled():
        _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(_handler)
        log.setLevel(logging.INFO)


def process_dir(root: str) -> Path:
    """This process's dump folder under ``root`` (created on first use, stable for the process)."""
    with _lock:
        d = _process_dirs.get(root)
        if d is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            d = Path(root) / f"neuron_compile_{stamp}_pid{os.getpid()}"
            d.mkdir(parents=True, exist_ok=True)
            _process_dirs[root] = d
        return d


def _graph_dir(root: str, name: str) -> Path:
    base = process_dir(root)
    with _lock:
        d, i = base / name, 1
        while d.exists():  # the same graph name compiled again (e.g. after torch._dynamo.reset())
            d, i = base / f"{name}.{i}", i + 1
        d.mkdir(parents=True)
        return d


def log_summary(line: str) -> None:
    """One line per compiled graph on the ``neuron_compile.graphs`` logger (stderr with NEURON_COMPILE_LOGS)."""
    _ensure_summary_handler()
    log.info(line)


def summary_line(name: str, lowered: Any, report: Any, timings: dict[str, float]) -> str:
    n_nodes = getattr(lowered, "num_ops", 0)
    times = " ".join(f"{k.removesuffix('_s')} {v:.3f}s" for k, v in timings.items())
    legality = report.summary() if report is not None else "legality not checked"
    return f"neuron_compile: {name}: {n_nodes} aten nodes -> {legality}; {times}"


def _fx_text(gm: Any) -> str:
    try:
        return gm.print_readable(print_output=False, include_stride=False, include_device=False)
    except TypeError:
        return gm.print_readable(print_output=False)


def dump_graph(opts: Options, name: str, gm: Any, lowered: Any, report: Any, timings: dict[str, float]) -> None:
    """Write the FX graph, StableHLO, legality report and timings of one graph when debugging is on."""
    timings = dict(timings)
    if report is not None and "legality_s" not in timings:
        timings["legality_s"] = getattr(report, "seconds", 0.0)
    log_summary(summary_line(name, lowered, report, timings))
    if not opts.debug_dir:
        return
    try:
        d = _graph_dir(opts.debug_dir, name)
        if gm is not None:
            (d / "fx_graph.py").write_text(_fx_text(gm))
        if lowered is not None:
            (d / "stablehlo.mlir").write_text(lowered.stablehlo(debug_info=True))
            (d / "nodes.json").write_text(json.dumps(getattr(lowered, "node_table", {}), indent=1))
        if report is not None:
            (d / "legality.txt").write_text(report.to_text() + "\n")
            (d / "legality.json").write_text(json.dumps(report.to_dict(), indent=1, default=str))
        (d / "timings.json").write_text(json.dumps(timings, indent=1))
    except OSError as e:  # a debugging aid must never break compilation
        warnings.warn(f"neuron backend: could not write debug dump for {name} to {opts.debug_dir}: {e}")
