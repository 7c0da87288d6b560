"""Cold start in parallel (``runtime/compile_pool.py``): on the neuron target a forward's and its backward's NEFFs
compile side by side, so the first training step costs about one compile, not the sum.

On the device simulator with its compile delay (``NRTSIM_COMPILE_DELAY``, each fake neuronx-cc run takes that
long): the two compiles overlap, both graphs of the first step run on the simulated NeuronCore (never on the
CPU target meanwhile) and train as eager does. ``benchmarks/cold_start.py`` measures the first step itself.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn.functional as F

from neuron_compile import STATS, NeuronCompileError
from neuron_compile.cache import clear_memory
from neuron_compile.runtime.neuron import NeuronTarget

from . import device_sim
from .models import MLP

#: Seconds each simulated compile takes.
DELAY = 3.0


@pytest.fixture
def simulator(monkeypatch: pytest.MonkeyPatch, tmp_path):
    device_sim.activate(monkeypatch, tmp_path / "sim_state")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # AOTAutograd's cache: empty
    device_sim.reset_counters()
    STATS.reset()
    torch._dynamo.reset()
    clear_memory()  # every compile a miss: none served from another test's compiles in this process
    yield tmp_path


def _compile_spans(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, float]]:
    """(start, end) of every neuronx-cc compile from now on, whichever thread runs it."""
    spans: list[tuple[float, float]] = []
    lock = threading.Lock()
    real = NeuronTarget.compile

    def timed(self, *args, **kwargs):
        t0 = time.monotonic()
        try:
            return real(self, *args, **kwargs)
        finally:
            with lock:
                spans.append((t0, time.monotonic()))

    monkeypatch.setattr(NeuronTarget, "compile", timed)
    return spans


@pytest.mark.parametrize(
    "jobs, cache",
    [(2, True), (2, False), (0, True)],
    ids=["2 jobs, AOTAutograd's cache", "2 jobs, no cache", "0 jobs: one after the other"],
)
def test_forward_and_backward_compile_side_by_side(simulator, monkeypatch, jobs: int, cache: bool) -> None:
    monkeypatch.setenv("NRTSIM_COMPILE_DELAY", str(DELAY))
    spans = _compile_spans(monkeypatch)
    torch.manual_seed(0)
    eager = MLP()
    model = MLP()
    model.load_state_dict(eager.state_dict())
    options = {"target": "neuron", "compile_jobs": jobs, "cache": cache, "cache_dir": str(simulator / "cache")}
    compiled = torch.compile(model, backend="neuron", dynamic=False, options=options)
    x, target = torch.randn(8, 16), torch.randn(8, 4)

    F.mse_loss(compiled(x), target).backward()
    F.mse_loss(eager(x), target).backward()

    assert len(spans) == 2, spans
    overlap = min(end for _, end in spans) - max(start for start, _ in spans)
    if jobs:
        assert overlap >= DELAY / 2, f"the compiles overlapped by {overlap:.2f}s: {spans}"
    else:
        assert overlap <= 0, f"compile_jobs=0 compiles in the caller's thread, one after the other: {spans}"
    # both graphs of the first step ran on the (simulated) NeuronCore, not on the CPU target meanwhile
    assert device_sim.counters()["executes"] == 2
    state = "miss" if cache else "off"
    assert sorted((g.kind, g.cache) for g in STATS.graphs) == [("backward", state), ("forward", state)]
    assert all(g.compile_seconds >= DELAY for g in STATS.graphs), STATS.graphs
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_failed_compile_is_raised_by_the_graphs_call(simulator, monkeypatch) -> None:
    """A compile that fails in the background (here every module is refused: NCC_SIM006) raises its error where
    the graph is called, and again at every call."""
    monkeypatch.setenv("NRTSIM_COMPILE_FAIL", ",".join("0123456789abcdef"))
    compiled = torch.compile(MLP(), backend="neuron", dynamic=False, options={"target": "neuron", "cache": False})
    for _ in range(2):
        with pytest.raises(NeuronCompileError, match="NCC_SIM006"):
            compiled(torch.randn(8, 16))
