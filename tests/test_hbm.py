"""Will it fit? (``neuron_compile/hbm.py``): a graph's HBM on one NeuronCore, judged before neuronx-cc runs.

The record has two checks: neuronx-cc refuses at its start a graph whose I/O tensors alone exceed the core's HBM
(NCC_EVRF009: "Needed ... bytes vs. available 25,769,803,776 bytes (24 GB)" on a Trn2 logical core at LNC 2),
and at its end one whose peak does (NCC_EOOM001/002, with a scratchpad the record does not tie to the I/O). So a
graph with 26 GB of I/O is refused in seconds with EVRF009's text, without neuronx-cc ever running; one with 14 GB
of I/O (a 7B model's bf16 weights) warns with its estimate and is compiled. The large tensors are meta tensors or
shapes: nothing of that size is allocated.
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


def test_the_published_example_arithmetic() -> None:
    est = hbm.HbmEstimate("g", io_bytes=16 * GIB, intermediate_bytes=0, intermediates_from="XLA's buffer assignment")
    assert est.peak_bytes == 32 * GIB and est.scratchpad_bytes == 16 * GIB
    assert est.breakdown() == PUBLISHED
    # one table: 24 GiB per logical core of a Trn2 at LNC=2 (the runtime's total_hbm=25769803776, EVRF009's
    # "available 25,769,803,776 bytes (24 GB)"), which the compiler prints as 24.00GB; trn3 has 144 GiB for 8 cores
    assert hbm.hbm_per_core("trn2", 2) == 25769803776 and hbm.compiler_size(hbm.hbm_per_core("trn2", 2)) == "24.00GB"
    assert {k: v // GIB for k, v in hbm.HBM_PER_CORE.items()} == {
        ("trn2", 1): 12, ("trn2", 2): 24, ("trn3", 1): 18, ("trn3", 2): 36
    }  # fmt: skip
    assert hbm.evrf009_text(33_771_172_352, hbm.hbm_per_core("trn2", 2), "trn2") == (
        "[NCC_EVRF009] Size of total input and output tensors exceeds HBM limit of Trainium2. Needed 33,771,172,352 "
        "bytes (31 GB) vs. available 25,769,803,776 bytes (24 GB)."
    )  # a published Trn2 run's message, byte for byte
    assert hbm.fit_line(est.peak_bytes, est.io_bytes) == (
        "fits on one NeuronCore of trn3 at LNC 2 (36.00GB); may not fit on one NeuronCore of trn3 at LNC 1 "
        "(18.00GB), trn2 at LNC 2 (24.00GB); refused (its I/O alone is over the limit, NCC_EVRF009) on one "
        "NeuronCore of trn2 at LNC 1 (12.00GB) (certain: 16.00GB of I/O tensors; estimated: the intermediates and a "
        "scratchpad as large as the I/O, which neuronx-cc sizes only at the end of its compile)"
    )


def test_the_device_uses_the_one_table() -> None:
    from neuron_compile.device import context

    for (generation, lnc), size in hbm.HBM_PER_CORE.items():
        assert context.default_memory_limit(generation, lnc) == size


@pytest.fixture
def simulator(monkeypatch: pytest.MonkeyPatch):
    device_sim.activate(monkeypatch, tempfile.mkdtemp(prefix="neuron_compile_hbm_sim_"))
    yield device_sim


def _io_estimate(io_gib: float) -> hbm.HbmEstimate:
    """The estimate of ``x + 1`` on a bf16 vector of ``io_gib / 2`` GiB, from its shapes alone (jax lowers and XLA
    CPU plans it; nothing is allocated)."""
    import jax
    import jax.numpy as jnp

    n = int(io_gib / 2 * GIB) // 2

    class Lowered:
        name = "weights"
        node_table: dict = {}
        inputs: list = []
        lowered = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((n,), jnp.bfloat16))

    return hbm.estimate(Lowered())


def test_14gb_of_io_on_trn2_lnc2_warns_with_the_estimate_and_is_not_refused() -> None:
    """A 7B model's bf16 weights: 14 GiB of I/O fit the 24 GiB core; the estimated peak (I/O + scratchpad as large)
    does not, which only neuronx-cc can settle: a warning with the parts, no refusal."""
    est = _io_estimate(14)
    assert est.io_bytes == 14 * GIB and est.peak_bytes > 24 * GIB
    opts = Options.from_user({"target": "neuron", "generation": "trn2", "lnc": 2, "cache": False})
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        hbm.judge(est, opts)  # no NeuronHbmError
    found = [str(w.message) for w in raised if issubclass(w.category, NeuronHbmWarning)]
    assert len(found) == 1, found
    assert (
        "graph 'weights' may not fit: its estimated peak HBM usage of 28.00GB exceeds the HBM limit of 24.00GB"
        in (found[0])
    )
    assert "I/O tensors 14.00GB (certain" in found[0] and "scratchpad) allocations 14.00GB (estimated" in found[0]
    assert "so it is compiled" in found[0] and "NCC_EVRF009" not in found[0]


def add_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1  # THE LARGE LINE


def test_a_graph_with_14gb_of_io_is_handed_to_neuronx_cc_with_a_warning(simulator, monkeypatch) -> None:
    """torch.compile of a graph with 7 GiB in and 7 GiB out (meta tensors) on the neuron target: the warning, and
    the graph goes on to neuronx-cc (stopped there: it would run on 14 GiB)."""
    reached = []

    def stop(self, *a, **k):
        reached.append(1)
        raise RuntimeError("neuronx-cc reached")

    monkeypatch.setattr(NeuronTarget, "compile", stop)
    x = torch.empty(7 * 2**30 // 4, device="meta")  # f32: 7 GiB, never allocated
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as raised, pytest.raises(BackendCompilerFailed) as info:
        warnings.simplefilter("always")
        torch.compile(add_one, backend="neuron", options={"target": "neuron", "cache": False, "compile_jobs": 0})(x)
    assert reached and "neuronx-cc reached" in str(info.value.inner_exception), info.value
    found = [str(w.message) for w in raised if issubclass(w.category, NeuronHbmWarning)]
    assert len(found) == 1 and "may not fit" in found[0] and "I/O tensors 14.00GB (certain" in found[0], found


def test_a_graph_with_26gb_of_io_is_refused_in_seconds_with_evrf009s_text(simulator, monkeypatch) -> None:
    """13 GiB in, 13 GiB out: over the 24 GiB of a trn2 logical core at LNC 2 by its I/O alone, which neuronx-cc
    refuses at its start (NCC_EVRF009): refused with that text, the largest tensors with the user's line, and the
    fake neuronx-cc never started (it would take NRTSIM_COMPILE_DELAY)."""
    started = []
    real_compile = NeuronTarget.compile
    monkeypatch.setattr(NeuronTarget, "compile", lambda self, *a, **k: started.append(1) or real_compile(self, *a, **k))
    monkeypatch.setenv("NRTSIM_COMPILE_DELAY", "600")  # a compile would not end within the test's time
    x = torch.empty(13 * 2**30 // 4, device="meta")  # f32: 13 GiB, never allocated
    torch._dynamo.reset()
    t0 = time.perf_counter()
    with pytest.raises(BackendCompilerFailed) as info:
        torch.compile(add_one, backend="neuron", options={"target": "neuron", "cache": False})(x)
    elapsed = time.perf_counter() - t0
    error = info.value.inner_exception
    assert isinstance(error, NeuronHbmError), info.value
    assert not started and simulator.compiler_invocations() == 0
    text = str(error)
    io = 2 * 13 * GIB + 8  # x and x + 1, and the executable's random seed (int32[2])
    assert "refused before compiling, as neuronx-cc refuses it at its start" in text, text
    assert (
        "[NCC_EVRF009] Size of total input and output tensors exceeds HBM limit of Trainium2. Needed "
        f"{io:,} bytes (26 GB) vs. available 25,769,803,776 bytes (24 GB)."
    ) in text, text
    line = next(i for i, t in enumerate(open(__file__).read().splitlines(), 1) if "THE LARGE LINE" in t)
    rows = [r for r in text.splitlines() if "13.00GB" in r]
    assert len(rows) == 2 and all(f"test_hbm.py:{line}" in r for r in rows), text
    assert re.search(r"input 0 +f32\[3489660928\]", text) and re.search(r"output 0 +f32\[3489660928\]", text)
    assert "it would fit on one NeuronCore of trn3 at LNC 2 (36.00GB)" in text
    assert error.estimate.io_bytes == io and error.limit == 24 * GIB
    assert elapsed < 300, f"refused after {elapsed:.0f}s"


def test_cpu_target_warns_and_hbm_limit_sets_the_limit(monkeypatch) -> None:
    """The CPU target runs the graph but says what the neuron target would do; option hbm_limit moves the limit
    (0: no check)."""
    x = torch.empty(2**28, device="meta")  # 1 GiB in, 1 GiB out: a 4 GiB peak
    for limit, warned in (("1G", "refuses"), ("3G", "may not fit"), ("5G", None), ("0", None)):
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as raised:
            warnings.simplefilter("always")
            opts = {"target": "cpu", "cache": False, "hbm_limit": limit}
            torch.compile(add_one, backend="neuron", options=opts)(x)
        found = [w for w in raised if issubclass(w.category, NeuronHbmWarning)]
        assert bool(found) == bool(warned), (limit, [str(w.message) for w in raised])
        if warned == "may not fit":
            text = str(found[0].message)
            assert "estimated peak HBM usage of 4.00GB exceeds the HBM limit of 3.00GB set by option hbm_limit" in text
            assert "I/O tensors 2.00GB (certain" in text and "scratchpad) allocations 2.00GB (estimated" in text
        elif warned:
            text = str(found[0].message)
            assert "need 2.00GB, over the HBM limit of 1.00GB set by option hbm_limit" in text and "NCC_EVRF009" in text
            assert "the neuron target refuses it" in text


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
        GraphEntry("graph0_forward", "forward", 10, 0, "miss", 0.1, 0.2, 30 * GIB, 20 * GIB),
        GraphEntry("graph0_backward", "backward", 10, 0, "miss", 0.1, 0.2, 3 * 2**20, 2**20),
    ]
    text = str(report)
    assert re.search(r"graph0_forward .* 30\.00GB", text) and re.search(r"graph0_backward .* 3\.00MB", text)
    assert (
        "HBM: graph0_forward needs the most, an estimated 30.00GB at its peak: fits on one NeuronCore of trn3 at "
        "LNC 2 (36.00GB); may not fit on one NeuronCore of trn2 at LNC 2 (24.00GB); refused (its I/O alone is over "
        "the limit, NCC_EVRF009) on one NeuronCore of trn2 at LNC 1 (12.00GB), trn3 at LNC 1 (18.00GB) (certain: "
        "20.00GB of I/O tensors; estimated: the intermediates and a scratchpad as large as the I/O"
    ) in text, text
    fits = report.to_dict()["hbm"]["fits"]
    assert [(f["generation"], f["lnc"], f["fits"], f["verdict"]) for f in fits] == [
        ("trn2", 1, False, "refused"),
        ("trn3", 1, False, "refused"),
        ("trn2", 2, False, "may not fit"),
        ("trn3", 2, True, "fits"),
    ]
    assert report.to_dict()["hbm"]["largest_io_bytes"] == 20 * GIB


def test_limit_follows_generation_and_lnc() -> None:
    assert hbm.limit_for(Options.from_user({"target": "cpu", "generation": "trn3", "lnc": 1})) == 18 * GIB
    assert hbm.limit_for(Options.from_user({"target": "cpu", "hbm_limit": "10G"})) == 10 * GIB
