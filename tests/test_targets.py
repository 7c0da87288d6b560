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
