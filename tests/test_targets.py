"""The runtime seam: every target satisfies the Target protocol, and what changes the neuronx-cc artifact
is an option in the cache key (the neuron target end to end: tests/test_neuron_target.py)."""

from __future__ import annotations

import pytest
import torch

from neuron_compile import Options
from neuron_compile.runtime.targets import Target, target_for


@pytest.mark.parametrize("target", ["cpu", "neuron"])
def test_targets_satisfy_the_protocol(target: str) -> None:
    t = target_for(Options(target=target))
    assert isinstance(t, Target)
    assert t.name == target


@pytest.mark.parametrize("level", [1, 2, 3])
def test_opt_level_reaches_neuronx_cc_and_the_cache_key(level: int) -> None:
    opts = Options(target="neuron", opt_level=level)
    assert f"-O{level}" in target_for(opts).command("m.mlir", "m.neff")
    assert opts.cache_relevant()["opt_level"] == level
    assert (
        Options(target="neuron", opt_level=1).cache_relevant() != Options(target="neuron", opt_level=3).cache_relevant()
    )


@pytest.mark.parametrize("lnc", [1, 2])
def test_lnc_reaches_neuronx_cc_and_the_neuron_cache_key(lnc: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiler's --lnc comes from the runtime's own NEURON_LOGICAL_NC_CONFIG, so the two agree."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", str(lnc))
    opts = Options.from_user({"target": "neuron"})
    command = target_for(opts).command("m.mlir", "m.neff")
    assert command[command.index("--lnc") + 1] == str(lnc) and opts.cache_relevant()["lnc"] == lnc
    assert "lnc" not in Options.from_user({"target": "cpu"}).cache_relevant()  # no meaning on the CPU target


def test_opt_level_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURON_COMPILER_OPT_LEVEL", "3")
    assert Options.from_user(None).opt_level == 3


# XLA's simplifier would multiply by the reciprocal of a broadcast divisor (off by one ulp in about half the
# elements); the CPU target computes divisions in float64 so that they are IEEE's, as eager's are.
_DIVISIONS = {
    "trunc_by_scalar": lambda x: torch.div(x, 0.1, rounding_mode="trunc"),
    "true_by_scalar": lambda x: x / 7.0,
    "bfloat16_by_scalar": lambda x: x.bfloat16() / 7.0,
    "by_row": lambda x: x.view(-1, 100) / (x.view(-1, 100)[:, :1].abs() + 0.5),
    "quantize": lambda x: torch.round(x / (x.abs().amax() / 127.5)),
}


@pytest.mark.parametrize("name", list(_DIVISIONS))
def test_cpu_target_divisions_are_ieee(name: str) -> None:
    x = torch.randint(-1000, 1000, (20000,), generator=torch.Generator().manual_seed(0)).float() / 10
    fn = _DIVISIONS[name]
    torch._dynamo.reset()
    got, want = torch.compile(fn, backend="neuron", dynamic=False)(x), fn(x)
    assert got.dtype == want.dtype
    assert torch.equal(got, want), f"{name}: {(got != want).sum().item()} of {want.numel()} differ from eager"


_WITH_NAME_ONLY = """
module @m {
  func.func public @main(%arg0: tensor<2xf32> loc("stablehlo.all_reduce")) -> tensor<2xf32> {
    %0 = stablehlo.add %arg0, %arg0 : tensor<2xf32> loc("stablehlo.all_reduce")
    return %0 : tensor<2xf32>
  }
}
"""
_WITH_NESTED_ALL_REDUCE = """
module @m {
  func.func private @reduce(%arg0: tensor<2xf32>) -> tensor<2xf32> {
    %0 = "stablehlo.all_reduce"(%arg0) ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %s = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }) {replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>} : (tensor<2xf32>) -> tensor<2xf32>
    return %0 : tensor<2xf32>
  }
  func.func public @main(%arg0: tensor<2xf32>) -> tensor<2xf32> {
    %0 = func.call @reduce(%arg0) : (tensor<2xf32>) -> tensor<2xf32>
    return %0 : tensor<2xf32>
  }
}
"""


@pytest.mark.parametrize("text, collectives", [(_WITH_NAME_ONLY, False), (_WITH_NESTED_ALL_REDUCE, True)],
                         ids=["op-name-in-a-location", "all-reduce-in-a-called-function"])  # fmt: skip
def test_a_neff_has_collectives_by_its_ops_not_its_text(text: str, collectives: bool) -> None:
    """Whether a NEFF loads as one of a group (nrt_load_collectives) is read from the module's ops: a location
    naming a collective is not one, and one in a function main calls is."""
    from neuron_compile.runtime import jax_adapter
    from neuron_compile.runtime.neuron import COLLECTIVE_OPS

    params, results, ops = jax_adapter.module_summary(text)
    assert params == results == [((2,), torch.float32)]
    assert bool(ops & COLLECTIVE_OPS) == collectives


def test_the_cached_artifact_is_not_the_graphs_handle() -> None:
    """The neuron target's artifact (what the cache keeps) and each graph's handle on it are separate: two
    graphs of one NEFF hold two handles, each with its own input residency, on the one artifact."""
    from neuron_compile.runtime.neuron import LoadedNeff, NeffArtifact, NeuronTarget

    artifact = NeffArtifact(b"neff", [((2,), torch.float32)], [((2,), torch.bfloat16)], False)
    target = NeuronTarget()
    assert target.deserialize(target.serialize(artifact)) == artifact
    first, second = target.for_graph(artifact, resident_inputs=True), target.for_graph(artifact)
    assert isinstance(first, LoadedNeff) and first is not second and first.artifact is second.artifact is artifact
    assert (first.resident_inputs, second.resident_inputs) == (True, False)
    assert first.results == [((2,), torch.bfloat16)]
