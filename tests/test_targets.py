"""The runtime seam: every target satisfies the Target protocol, the neuron target's missing pieces are
explicit errors, and what changes the neuronx-cc artifact is an option in the cache key."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from neuron_compile import NeuronCompileError, Options
from neuron_compile.runtime.targets import Target, target_for


@pytest.mark.parametrize("target", ["cpu", "neuron"])
def test_targets_satisfy_the_protocol(target: str) -> None:
    t = target_for(Options(target=target))
    assert isinstance(t, Target)
    assert t.name == target


def test_neuron_target_says_that_neff_execution_is_missing() -> None:
    t = target_for(Options(target="neuron"))
    with pytest.raises(NeuronCompileError, match="target': 'cpu'"):
        t.run(b"NEFF", [])


@pytest.mark.parametrize("level", [1, 2, 3])
def test_opt_level_reaches_neuronx_cc_and_the_cache_key(level: int) -> None:
    opts = Options(target="neuron", opt_level=level)
    assert f"-O{level}" in target_for(opts).command("m.mlir", "m.neff")
    assert opts.cache_relevant()["opt_level"] == level
    assert Options(target="neuron", opt_level=1).cache_relevant() != Options(target="neuron", opt_level=3).cache_relevant()


def test_opt_level_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURON_COMPILER_OPT_LEVEL", "3")
    assert Options.from_user(None).opt_level == 3


def test_compiled_graph_on_the_neuron_target_fails_clearly_at_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a (fake) neuronx-cc on PATH the graph compiles to a NEFF; running it is the explicit error,
    never an AttributeError inside the executor."""
    fake = tmp_path / "neuronx-cc"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "neuronx-cc 0.0-fake"; exit 0; fi\n'
        'while [ "$#" -gt 0 ]; do if [ "$1" = "--output" ]; then echo NEFF > "$2"; fi; shift; done\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    torch._dynamo.reset()
    f = torch.compile(lambda x: x * 2 + 1, backend="neuron", options={"target": "neuron", "cache": False})
    with pytest.raises(Exception, match="NEFF compiled, but"):
        f(torch.ones(4))


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
