"""The README's demo command runs and its compiled losses match eager, on the CPU target here and on the
(simulated) neuron target where the Neuron compiler and runtime are found: no option chooses it."""

import os
import subprocess
import sys

import pytest

from . import device_sim


@pytest.mark.slow
@pytest.mark.parametrize("device", ["none", "simulated"])
def test_demo_runs_and_matches_eager(device: str, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NEURON_COMPILE_TARGET"}
    if device == "simulated":
        env.update(device_sim.environment(tmp_path / "sim_state"))
    proc = subprocess.run(
        [sys.executable, "-m", "neuron_compile.demo", "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=device_sim.REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "MATCH" in proc.stdout and "backward" in proc.stdout and "forward" in proc.stdout
    target = "neuron" if device == "simulated" else "cpu"
    assert f", target {target} (" in proc.stdout.splitlines()[0], proc.stdout.splitlines()[0]
    if device == "simulated":
        assert "NeuronCore transfers: 6 executions" in proc.stdout, proc.stdout
