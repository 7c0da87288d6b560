"""The benchmarks still run: each module of ``benchmarks/`` answers ``python -m benchmarks.<name> --help``, and
steady.py runs one round of a one-add graph (in one process, and its first step in fresh child processes).
Smoke tests only: no figure here is a measurement (docs/benchmarks.md has those)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODULES = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if p.stem != "__init__")


def _run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_every_benchmark_runs_as_a_module_and_answers_help() -> None:
    # One process for all (torch is imported once): each module as `python -m benchmarks.<name> --help` runs it.
    code = (
        "import runpy, sys\n"
        "for name in sys.argv[1:]:\n"
        "    sys.argv = [name, '--help']\n"
        "    try:\n"
        "        runpy.run_module(f'benchmarks.{name}', run_name='__main__', alter_sys=True)\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), (name, e.code)\n"
        "    else:\n"
        "        raise AssertionError(f'{name}: --help did not exit')\n"
        "    print('HELP-OK', name, flush=True)\n"
    )
    assert len(MODULES) >= 7, MODULES
    proc = _run(["-c", code, *MODULES])
    answered = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("HELP-OK ")]
    assert answered == MODULES, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_steady_runs_one_round_in_bfloat16() -> None:
    proc = _run(["-m", "benchmarks.steady", "--models", "add", "--modes", "train", "--reps", "1", "--inner", "1",
                 "--backends", "eager,neuron", "--dtype", "bfloat16", "--json"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(proc.stdout)
    assert row["model"] == "add" and row["mode"] == "train" and row["dtype"] == "bfloat16", row
    assert row["neuron"] > 0 and row["eager"] > 0 and row["neuron/eager"] > 0, row


def test_steady_first_step_runs_its_children_as_modules() -> None:
    proc = _run(["-m", "benchmarks.steady", "--first-step", "--models", "add", "--backends", "neuron", "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(proc.stdout)
    assert row["neuron_cold_s"] > 0 and row["neuron_warm_s"] > 0, row
    assert not row.get("neuron_warm_missed"), f"the warm child missed the cache the cold one filled: {row}"
