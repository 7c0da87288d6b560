"""The README's demo command runs and its compiled losses match eager, on the CPU target here and on the
(simulated) neuron target where the Neuron compiler and runtime are found: no option chooses it."""

import os
import re
import subprocess
import sys

import pytest

from . import device_sim


@pytest.mark.slow
@pytest.mark.parametrize("device", ["none", "simulated"])
def test_demo_runs_and_matches_eager(device: str, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NEURON_COMPILE_TARGET"}
    # caches of its own: every graph compiled (and its HBM peak estimated), none served from another test's
    env.update(NEURON_COMPILE_CACHE_DIR=str(tmp_path / "cache"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "torch"))
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
    # each graph's estimated peak HBM, and the largest fits one NeuronCore anywhere
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\s+graph\d+_(forward|backward) ", line)]
    assert len(rows) == 2 and all(re.search(r" \d+\.\d [KM]iB$", row) for row in rows), proc.stdout
    assert "fits on one NeuronCore of trn2 at LNC 1 (12.00GB)" in proc.stdout, proc.stdout
    target = "neuron" if device == "simulated" else "cpu"
    assert f", target {target} (" in proc.stdout.splitlines()[0], proc.stdout.splitlines()[0]
    if device == "simulated":
        assert "NeuronCore transfers: 6 executions" in proc.stdout, proc.stdout


def test_demo_on_the_neuron_device_moves_only_the_batch_and_the_loss(capsys: pytest.CaptureFixture[str]) -> None:
    """``--device neuron`` (in this process, on its target): the losses match eager's, and after the first step
    each step moves the batch in and the loss (and one byte of value checks) out."""
    from neuron_compile import STATS, demo

    STATS.reset()  # the demo reports this process's counters
    assert demo.main(["--device", "neuron", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "tensors on the 'neuron' device" in out.splitlines()[0] and "MATCH" in out
    steps = [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s+\d+\.\d+\s", line)]
    assert len(steps) == 3 and all(row[-2:] == ["1,024", "5"] for row in steps[1:]), out
