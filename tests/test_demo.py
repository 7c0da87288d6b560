"""The README's demo command runs and its compiled losses match eager."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_runs_and_matches_eager() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "neuron_compile.demo", "--steps", "3"], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "MATCH" in proc.stdout and "backward" in proc.stdout and "forward" in proc.stdout
