"""Benchmarks, each a module run from the repository root: ``python -m benchmarks.<name> --help``. They measure;
the test suite only smoke-tests them (tests/test_benchmarks.py). Results, with dates and commands, are in
docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Mapping, Sequence

#: The repository root: the children's working directory, where ``benchmarks`` is importable.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ChildFailed(RuntimeError):
    """A child of :func:`run_child` exited with a non-zero status; ``stderr`` is all it wrote there (each
    benchmark reports the tail it wants)."""

    def __init__(self, module: str, returncode: int, stderr: str) -> None:
        super().__init__(f"python -m benchmarks.{module} exited with status {returncode}:\n{stderr[-3000:]}")
        self.returncode = returncode
        self.stderr = stderr


def run_child(
    module: str, args: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None
) -> dict[str, Any]:
    """Run ``python -m benchmarks.<module> *args`` in a fresh process from the repository root, with ``env`` (the
    parent's when None); the last line of its stdout, parsed as JSON. Raises :class:`ChildFailed` when it
    exits with a non-zero status, ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise ChildFailed(module, proc.returncode, proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])
