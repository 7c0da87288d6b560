"""Will it fit? (``neuron_compile/hbm.py``): a graph's peak HBM on one NeuronCore, estimated before neuronx-cc runs.

The published refusal (NCC_EOOM001: 32.00GB of peak HBM for an 8 GiB buffer in and out, against 24.00GB on a
Trn2 logical core at LNC=2) is the yardstick: the estimate must reproduce its arithmetic, and a graph built to
need as much must be refused on the neuron target without neuronx-cc ever running. The 8 GiB tensors are meta
tensors: nothing of that size is allocated.
"""

from __future__ import annotations

import re
import tempfile
import time
import warnings

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

from neuron_compile import hbm
from neuron_compile.errors import NeuronHbmError, NeuronHbmWarning
from neuron_compile.evaluate.report import EvaluationReport, GraphEntry
from neuron_compile.options import Options
from neuron_compile.runtime.neuron import NeuronTarget

from . import device_sim

GIB = 2**30
#: neuronx-cc's published sentence for the 8 GiB buffer.
PUBLISHED = (
    "This consists of 16.00GB I/O tensors, 0B intermediate tensors, and 16.00GB internal (scratchpad) allocations"
)


def add_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1  # THE 8 GiB LINE


def test_the_published_example_arithmetic() -> None:
    est = hbm.HbmEstimate("g", io_bytes=16 * GIB, intermediate_bytes=0, intermediates_from="XLA's buffer assignment")
    assert est.peak_bytes == 32 * GIB and est.scratchpad_bytes == 16 * GIB
    assert est.breakdown() == PUBLISHED
    # 24 GiB per logical core of a Trn2 at LNC=2 (the runtime's total_hbm=25769803776), which the compiler prints
    # as 24.00GB; trn3 has 144 GiB in 4 stacks
    assert hbm.hbm_limit("trn2", 2) == 25769803776 and hbm.compiler_size(hbm.hbm_limit("trn2", 2)) == "24.00GB"
    assert [hbm.hbm_limit(g, n) // GIB for g, n in (("trn2", 1), ("trn3", 1), ("trn3", 2))] == [12, 18, 36]
    assert hbm.fit_line(est.peak_bytes) == (
        "fits on one NeuronCore of trn3 at LNC 2 (36.00GB); does not fit on one NeuronCore of trn2 at LNC 1 "
        "(12.00GB) and 2 (24.00GB), trn3 at LNC 1 (18.00GB)"
    )


@pytest.fixture
def simulator(monkeypatch: pytest.MonkeyPatch):
    device_sim.activate(monkeypatch, tempfile.mkdtemp(prefix="neuron_compile_hbm_sim_"))
    yield device_sim


def test_a_graph_needing_32gb_is_refused_before_neuronx_cc_runs(simulator, monkeypatch) -> None:
    """16 GiB of I/O (8 GiB in, 8 GiB out) as in the published message: refused with its breakdown, the largest
    tensors with the user's line, and the fake neuronx-cc never started (it would take NRTSIM_COMPILE_DELAY)."""
    started = []
    real_compile = NeuronTarget.compile
    monkeypatch.setattr(NeuronTarget, "compile", lambda self, *a, **k: started.append(1) or real_compile(self, *a, **k))
    monkeypatch.setenv("NRTSIM_COMPILE_DELAY", "600")  # a compile would not end within the test's time
    x = torch.empty(2**31, device="meta")  # f32: 8 GiB, never allocated
    torch._dynamo.reset()
    t0 = time.perf_counter()
    with pytest.raises(BackendCompilerFailed) as info:
        torch.compile(add_one, backend="neuron", options={"target": "neuron", "cache": False})(x)
    elapsed = time.perf_counter() - t0
    error = info.value.inner_exception
    assert isinstance(error, NeuronHbmError), info.value
    assert not started and simulator.compiler_invocations() == 0
    text = str(error)
    assert (
        "estimated peak HBM usage of 32.00GB exceeds the HBM limit of 24.00GB of one NeuronCore of trn2 at LNC 2"
        in text
    )
    assert PUBLISHED in text and "NCC_EOOM001" in text, text
    line = next(i for i, t in enumerate(open(__file__).read().splitlines(), 1) if "THE 8 GiB LINE" in t)
    rows = [r for r in text.splitlines() if "8.00GB" in r]
    assert len(rows) == 2 and all(f"test_hbm.py:{line}" in r for r in rows), text
    assert re.search(r"input 0 +f32\[2147483648\]", text) and re.search(r"output 0 +f32\[2147483648\]", text)
    io = 2 * 8 * GIB + 8  # x and x + 1, and the executable's random seed (int32[2])
    assert error.estimate.io_bytes == io and error.estimate.peak_bytes == 2 * io and error.limit == 24 * GIB
    assert elapsed < 300, f"refused after {elapsed:.0f}s"


def test_cpu_target_warns_and_hbm_limit_sets_the_limit(monkeypatch) -> None:
    """The CPU target runs the graph but says the neuron target would refuse it; option hbm_limit moves the
    limit (0: no check)."""
    x = torch.empty(2**28, device="meta")  # 1 GiB in, 1 GiB out: a 4 GiB peak
    for limit, warned in (("3G", True), ("5G", False), ("0", False)):
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as raised:
            warnings.simplefilter("always")
            opts = {"target": "cpu", "cache": False, "hbm_limit": limit}
            torch.compile(add_one, backend="neuron", options=opts)(x)
        found = [w for w in raised if issubclass(w.category, NeuronHbmWarning)]
        assert bool(found) == warned, (limit, [str(w.message) for w in raised])
        if found:
            text = str(found[0].message)
            assert "estimated peak HBM usage of 4.00GB exceeds the HBM limit of 3.00GB set by option hbm_limit" in text
            assert "2.00GB I/O tensors, 0B intermediate tensors, and 2.00GB internal" in text


def test_intermediates_come_from_xla_and_from_a_liveness_walk_where_xla_cannot_compile() -> None:
    """XLA's buffer assignment gives the intermediates; a module XLA CPU cannot compile (a custom call) is walked
    in program order instead, each value freed after its last use."""
    import jax
    import jax.numpy as jnp

    n = 1024  # f32: 4 KiB per vector

    def two_live(x):
        a = jnp.sin(x)
        b = jnp.cos(x)
        return (a * b).sum()  # a and b live together: 8 KiB

    class Lowered:
        name = "two_live"
        node_table: dict = {}
        inputs: list = []

        def __init__(self, fn):
            self.lowered = jax.jit(fn).lower(jax.ShapeDtypeStruct((n,), jnp.float32))

    est = hbm.estimate(Lowered(two_live))
    assert est.intermediates_from == "XLA's buffer assignment"
    assert est.io_bytes == 4 * n + 4  # the vector in, a scalar out

    def with_custom_call(x):
        y = jax.ffi.ffi_call("NoSuchTarget", jax.ShapeDtypeStruct((n,), jnp.float32))(x)  # XLA CPU has none
        z = jnp.cos(x) + 1
        return (y * z).sum()

    walked = hbm.estimate(Lowered(with_custom_call))
    assert walked.intermediates_from.startswith("a liveness walk of the module")
    assert walked.intermediate_bytes == 3 * 4 * n  # y, cos(x) and z live at once before the product's input dies


def test_evaluate_prints_the_fit_line() -> None:
    report = EvaluationReport(model="M", mode="training", target="cpu")
    report.graphs = [
        GraphEntry("graph0_forward", "forward", 10, 0, "miss", 0.1, 0.2, 20 * GIB),
        GraphEntry("graph0_backward", "backward", 10, 0, "miss", 0.1, 0.2, 3 * 2**20),
    ]
    text = str(report)
    assert re.search(r"graph0_forward .* 20\.00GB", text) and re.search(r"graph0_backward .* 3\.00MB", text)
    assert (
        "HBM: graph0_forward needs the most, an estimated 20.00GB at its peak: fits on one NeuronCore of trn2 at "
        "LNC 2 (24.00GB), trn3 at LNC 2 (36.00GB); does not fit on one NeuronCore of trn2 at LNC 1 (12.00GB), trn3 "
        "at LNC 1 (18.00GB)"
    ) in text, text
    fits = report.to_dict()["hbm"]["fits"]
    assert [(f["generation"], f["lnc"], f["fits"]) for f in fits] == [
        ("trn2", 1, False),
        ("trn3", 1, False),
        ("trn2", 2, True),
        ("trn3", 2, True),
    ]


def test_limit_follows_generation_and_lnc() -> None:
    assert hbm.limit_for(Options.from_user({"target": "cpu", "generation": "trn3", "lnc": 1})) == 18 * GIB
    assert hbm.limit_for(Options.from_user({"target": "cpu", "hbm_limit": "10G"})) == 10 * GIB
