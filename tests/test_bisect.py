"""neuron_compile.evaluate.bisect and `neuron-compile evaluate --bisect`.

The ops method must point at an op whose lowering is deliberately made imprecise (its result scaled by
1 + 8 eps of its dtype: a relative error 16x one rounding's), at its user source line, and at nothing else
of a model whose other ops are exact-rounded (linear, layer norm, softmax, GELU, their backward).

The prefix and modules methods must find drift that no single op shows: a chain of twelve elementwise
multiplies whose lowering rounds one or two ulps away from zero (``x * (1 + eps)``): about 2x eager's error
per op, under the multiple of 3 the ops method is given, but growing through the chain to 14x.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import neuron_compile
from neuron_compile import nki
from neuron_compile.evaluate import BisectReport, bisect

EXP_LINE = "torch.exp(h)"


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.up(self.norm(x))).softmax(-1)
        h = torch.exp(h)  # IMPRECISE_LINE
        return self.down(h)


def _block(dtype: torch.dtype) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return _Block().to(dtype), (torch.randn(8, 16).to(dtype),)


def _line_of(marker: str) -> int:
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if marker in line)


@pytest.fixture
def imprecise_exp(monkeypatch) -> None:
    """aten.exp's lowering made imprecise: its result times (1 + 8 eps) of its dtype."""
    import jax.numpy as jnp

    import neuron_compile.lowering  # noqa: F401  (registers every lowering)
    from neuron_compile.lowering.registry import record_of

    record = record_of(torch.ops.aten.exp.default)
    exact = record.lowering

    def imprecise(*args: Any, **kwargs: Any) -> Any:
        out = exact(*args, **kwargs)
        return out * jnp.asarray(1 + 8 * jnp.finfo(out.dtype).eps, out.dtype)

    monkeypatch.setattr(record, "lowering", imprecise)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_bisect_points_at_the_imprecise_op_and_nothing_else(imprecise_exp: None, dtype: torch.dtype) -> None:
    model, inputs = _block(dtype)
    report = bisect(model, inputs, progress=False)
    assert not report.errors, report.errors
    assert [g.kind for g in report.graphs] == ["forward", "backward"], report.graphs
    assert all(not g.skipped for g in report.graphs), [g.skipped for g in report.graphs]
    found = report.findings
    assert [f.op for f in found] == ["aten.exp.default"], "expected exactly the imprecise exp flagged:\n" + str(report)
    exp = found[0]
    assert exp.graph.endswith("_forward") and exp.source == f"{__file__}:{_line_of('IMPRECISE_LINE')}", exp
    assert exp.dtype == str(dtype).replace("torch.", "") and exp.ratio > report.multiple, exp
    # the scale is 8 eps: compiled is ~8 eps from the reference, eager within one rounding (<= eps / 2)
    eps = torch.finfo(dtype).eps
    assert 4 * eps < exp.compiled_error < 12 * eps and exp.eager_error <= eps / 2, exp
    assert not report.ok and "aten.exp.default" in str(report).split("closest calls")[0]
    # every other op was judged, not skipped: the forward and backward ops of the block
    judged = {op.op for op in report.ops}
    assert {"aten.native_layer_norm.default", "aten.gelu.default", "aten._softmax.default",
            "aten.gelu_backward.default", "aten.mm.default"} <= judged, judged  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_bisect_of_exact_lowerings_flags_nothing(dtype: torch.dtype) -> None:
    model, inputs = _block(dtype)
    report = bisect(model.eval(), inputs, progress=False)
    assert report.mode == "inference" and [g.kind for g in report.graphs] == ["inference"], report
    assert report.ok and len(report.ops) == 6, str(report)  # norm, 2 addmm, gelu, softmax, exp
    assert all(op.compiled_error <= report.multiple * max(op.eager_error, 0.5 * torch.finfo(dtype).eps)
               for op in report.ops if op.dtype in ("float32", "bfloat16"))  # fmt: skip


def test_bisect_rejects_a_multiple_below_one() -> None:
    with pytest.raises(ValueError, match="multiple=0.5; need a finite number >= 1"):
        bisect(torch.nn.Linear(2, 2), (torch.randn(1, 2),), multiple=0.5)


FACTORY = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    from tests.test_bisect import _block
    import torch

    def make():
        return _block(torch.float32)
    """
)


def test_cli_bisect_json_names_the_op_and_exits_1(tmp_path: Path, monkeypatch, capsys, imprecise_exp: None) -> None:
    from neuron_compile import cli

    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "f.py").write_text(FACTORY.format(root=str(Path(__file__).parents[1])))
    status = cli.main(["evaluate", f"{tmp_path / 'f.py'}:make", "--bisect", "--json", "--bisect-multiple", "3"])
    out, err = capsys.readouterr()
    assert status == 1, (out, err[-3000:])
    reply = json.loads(out)
    assert reply["ok"] is False and reply["multiple"] == 3.0, reply
    assert [f["op"] for f in reply["findings"]] == ["aten.exp.default"], reply["findings"]
    assert reply["findings"][0]["source"].endswith(f"test_bisect.py:{_line_of('IMPRECISE_LINE')}")
    assert math.isfinite(reply["findings"][0]["ratio"]) and reply["findings"][0]["ratio"] > 3


@pytest.mark.parametrize("value", ["0.5", "inf"])
def test_cli_bisect_multiple_below_one_is_a_usage_error(tmp_path: Path, capsys, value: str) -> None:
    from neuron_compile import cli

    (tmp_path / "f.py").write_text("def make():\n    pass\n")
    status = cli.main(["evaluate", f"{tmp_path / 'f.py'}:make", "--bisect", "--bisect-multiple", value])
    out, err = capsys.readouterr()
    assert status == 2 and f"--bisect-multiple {float(value)}: need a finite number >= 1" in err, err


def test_report_table_lists_the_first_findings_in_graph_order() -> None:
    from neuron_compile.evaluate.bisect import GraphSummary, OpFinding

    def op(index: int, ratio: float) -> OpFinding:
        return OpFinding("graph0_forward", index, f"n{index}", "aten.exp.default", "float32[2]", "m.py:3",
                         "float32", 1e-8, ratio * 1e-8, ratio, 1e-8, ratio * 1e-8, ratio > 2)  # fmt: skip

    report = BisectReport("M", "inference", 2.0, 0.5, [GraphSummary("graph0_forward", "inference", 3, 3, 2)],
                          [op(0, 1.0), op(1, 5.0), op(2, 3.0)], limit=1)  # fmt: skip
    text = str(report)
    assert "first 1 of 2 flagged ops" in text and "#1 n1" in text and "#2 n2 " not in text.split("closest")[0], text
    assert [f.index for f in report.findings] == [1, 2] and not report.ok
    assert report.to_dict()["findings"][1]["ratio"] == 3.0


# --- composed drift: the prefix and modules methods ------------------------------------------------------


class _Scale(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight  # DRIFT_LINE


class _Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.steps = torch.nn.ModuleList(_Scale(16) for _ in range(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for step in self.steps:
            x = step(x)
        return x


def _chain() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return _Chain(), (torch.randn(8, 16),)


@pytest.fixture
def drifting_mul(monkeypatch) -> None:
    """aten.mul.Tensor's lowering rounds away from zero: its result times (1 + eps), one or two ulps."""
    import jax.numpy as jnp

    import neuron_compile.lowering  # noqa: F401  (registers every lowering)
    from neuron_compile.lowering.registry import record_of

    record = record_of(torch.ops.aten.mul.Tensor)
    exact = record.lowering

    def away(*args: Any, **kwargs: Any) -> Any:
        out = exact(*args, **kwargs)
        return out * jnp.asarray(1 + jnp.finfo(out.dtype).eps, out.dtype)

    monkeypatch.setattr(record, "lowering", away)


CHAIN_MULTIPLE = 3.0


def test_ops_method_misses_the_composed_drift(drifting_mul: None) -> None:
    model, inputs = _chain()
    report = bisect(model, inputs, multiple=CHAIN_MULTIPLE, progress=False)
    assert report.ok and not report.findings, str(report)
    muls = [op for op in report.ops if op.op == "aten.mul.Tensor"]
    # each mul alone: worse than eager (the drift is there), within the multiple
    assert len(muls) >= 24 and all(1.2 < op.ratio < CHAIN_MULTIPLE for op in muls if op.graph.endswith("_forward")), [
        op.ratio for op in muls
    ]


def test_prefix_method_names_the_node_where_composed_drift_enters(drifting_mul: None) -> None:
    model, inputs = _chain()
    report = bisect(model, inputs, method="prefix", multiple=CHAIN_MULTIPLE, progress=False)
    assert not report.errors and [g.kind for g in report.graphs] == ["forward", "backward"], str(report)
    assert [e.graph.rsplit("_", 1)[1] for e in report.findings] == ["forward", "backward"], str(report)
    for graph, entry in zip(report.graphs, report.findings):
        whole = graph.probes[0]
        assert whole.failed and whole.ratio > 3 * CHAIN_MULTIPLE, whole  # the graph's end: far past the multiple
        assert entry.op == "aten.mul.Tensor" and entry.source == f"{__file__}:{_line_of('DRIFT_LINE')}", entry
        assert entry.ratio > CHAIN_MULTIPLE and entry.index <= 4, entry  # a few multiplies in
        # the bisection's claim: the prefix ending one node earlier holds
        before = [p for p in graph.probes if p.index == entry.index - 1]
        assert entry.index == 0 or (before and not before[0].failed), graph.probes
        assert len(graph.probes) <= 2 + math.ceil(math.log2(graph.nodes)), graph.probes
    text = str(report)
    assert "drift enters" in text and f"test_bisect.py:{_line_of('DRIFT_LINE')}" in text and "NOT OK" in text, text


def test_modules_method_names_the_first_drifting_submodule(drifting_mul: None) -> None:
    model, inputs = _chain()
    report = bisect(model, inputs, method="modules", multiple=CHAIN_MULTIPLE, progress=False)
    assert not report.errors, report.errors
    outputs = [m for m in report.modules if m.what == "output"]
    assert [m.module for m in outputs] == [f"steps.{i}" for i in range(12)] + ["<root>"], outputs
    first = report.findings[0]
    assert first.what == "output" and first.kind == "_Scale" and first.module in ("steps.1", "steps.2"), first
    assert not outputs[0].flagged and all(m.flagged for m in outputs[outputs.index(first) :]), outputs
    # gradients, in backward order: the last module first, and every one drifts (its input did)
    grads = [m for m in report.modules if m.what == "grad"]
    assert [m.module for m in grads] == [f"steps.{i}" for i in reversed(range(12))], grads
    assert all(m.flagged for m in grads), grads
    assert "drift enters at: steps." in str(report), str(report)


class _Squash(torch.nn.Module):
    """Twelve scalings in one forward, no submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(12, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weight:
            x = x * w  # SQUASH_LINE
        return x


class _Sandwich(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 16)
        self.squash = _Squash()
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.squash(self.inp(x)))


@pytest.fixture
def drifting_mul_in_backward(monkeypatch) -> None:
    """aten.mul.Tensor's lowering rounds away from zero (times 1 + eps) in backward graphs only: the forward
    holds, the gradients drift."""
    import jax.numpy as jnp

    import neuron_compile.lowering  # noqa: F401  (registers every lowering)
    from neuron_compile.lowering.registry import current, record_of

    record = record_of(torch.ops.aten.mul.Tensor)
    exact = record.lowering

    def away_in_backward(*args: Any, **kwargs: Any) -> Any:
        out = exact(*args, **kwargs)
        if current().node.meta.get("partitioner_tag") != "is_backward":
            return out
        return out * jnp.asarray(1 + jnp.finfo(out.dtype).eps, out.dtype)

    monkeypatch.setattr(record, "lowering", away_in_backward)


def test_modules_method_compiles_submodules_alone_when_only_gradients_drift(drifting_mul_in_backward: None) -> None:
    torch.manual_seed(0)
    report = bisect(_Sandwich(), (torch.randn(8, 16),), method="modules", multiple=CHAIN_MULTIPLE, progress=False)
    assert not report.errors, report.errors
    assert not [m for m in report.modules if m.what == "output" and m.flagged], str(report)  # the forward holds
    assert [m.module for m in report.modules if m.what == "grad" and m.flagged], str(report)
    alone = [m for m in report.modules if m.what == "alone"]
    assert [(m.module, m.flagged) for m in alone] == [("inp", False), ("squash", True), ("out", False)], str(report)
    assert report.entry.startswith("squash (_Squash): compiled alone in the eager model"), report.entry
    assert report.findings[0] is alone[1] and f"drift enters at: {report.entry}" in str(report), str(report)


@pytest.mark.parametrize("method", ["prefix", "modules"])
def test_composition_methods_flag_nothing_on_exact_lowerings(method: str) -> None:
    model, inputs = _block(torch.bfloat16)
    report = bisect(model, inputs, method=method, progress=False)
    assert report.ok and not report.findings, str(report)
    if method == "prefix":
        assert [len(g.probes) for g in report.graphs] == [1, 1], report.graphs  # the whole graph holds: one compile
    else:
        assert {m.module for m in report.modules} == {"norm", "up", "down", "<root>"}, report.modules


def test_bisect_rejects_an_unknown_method() -> None:
    with pytest.raises(ValueError, match="method='layers'; need one of ops, prefix, modules"):
        bisect(torch.nn.Linear(2, 2), (torch.randn(1, 2),), method="layers")


# --- timeouts --------------------------------------------------------------------------------------------


def test_bisect_phase_timeout_stops_a_phase_and_goes_on(monkeypatch) -> None:
    import time

    bisect_module = importlib.import_module("neuron_compile.evaluate.bisect")  # the package shadows it

    real = bisect_module._module_run

    def slow_compiled_run(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("options") is not None:
            time.sleep(120)
        return real(*args, **kwargs)

    monkeypatch.setattr(bisect_module, "_module_run", slow_compiled_run)
    model, inputs = _block(torch.float32)
    t0 = time.perf_counter()
    report = bisect(model, inputs, method="modules", progress=False, phase_timeout=5)
    assert time.perf_counter() - t0 < 60
    assert report.errors == ["compiled run: phase 'compiled run' ran past the timeout of 5 s"], report.errors
    assert not report.ok and "error: compiled run: phase 'compiled run' ran past the timeout" in str(report)


def test_cli_bisect_takes_the_timeout(tmp_path: Path, monkeypatch, capsys) -> None:
    import time

    from neuron_compile import cli

    bisect_module = importlib.import_module("neuron_compile.evaluate.bisect")  # the package shadows it

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(bisect_module, "_capture", lambda *a: time.sleep(30))
    (tmp_path / "f.py").write_text(FACTORY.format(root=str(Path(__file__).parents[1])))
    t0 = time.perf_counter()
    status = cli.main(["evaluate", f"{tmp_path / 'f.py'}:make", "--bisect", "--timeout", "1", "--json"])
    out, err = capsys.readouterr()
    assert time.perf_counter() - t0 < 20 and status == 1, (status, err[-2000:])
    assert json.loads(out)["errors"] == ["capture: phase 'capture' ran past the timeout of 1 s"], out


def test_cli_bisect_mode_runs_the_method(tmp_path: Path, monkeypatch, capsys) -> None:
    from neuron_compile import cli

    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "f.py").write_text(FACTORY.format(root=str(Path(__file__).parents[1])))
    status = cli.main(["evaluate", f"{tmp_path / 'f.py'}:make", "--bisect-mode", "modules", "--json"])
    out, err = capsys.readouterr()
    reply = json.loads(out)
    assert status == 0 and reply["method"] == "modules" and reply["ok"] and reply["judged"] == 7, (reply, err[-2000:])


# --- user kernels ----------------------------------------------------------------------------------------

nl, nisa = nki.language, nki.isa


@nki.jit
def _round_to_bfloat16_kernel(x):
    """x through a bfloat16 SBUF tile: every element rounded to bfloat16, returned in x's dtype."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    exact = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    rounded = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(exact, x)
    nisa.tensor_copy(rounded, exact)
    nisa.tensor_copy(exact, rounded)
    nisa.dma_copy(out, exact)
    return out


@neuron_compile.nki_op("nc_bisect::round_to_bfloat16")
def _round_to_bfloat16(x: torch.Tensor) -> torch.Tensor:
    return _round_to_bfloat16_kernel(x)


class _WithUserKernel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(_round_to_bfloat16(self.up(x)))


@pytest.mark.parametrize("method", ["ops", "prefix"])
def test_user_kernel_is_not_judged_against_itself(method: str) -> None:
    """Run on float64 inputs, the kernel rounds to bfloat16 exactly as on float32 ones: a "reference" of it
    would read an error of 0. It is listed as not judged, with why, and judged nowhere."""
    torch.manual_seed(0)
    model = _WithUserKernel().eval().requires_grad_(False)
    report = bisect(model, (torch.randn(8, 16),), method=method, progress=False)
    kernel = "nc_bisect.round_to_bfloat16.default"
    assert not report.errors and [g.user_kernels for g in report.graphs] == [[kernel]], report.graphs
    said = [s for s in report.graphs[0].skipped if "user kernel (nki_op): not judged" in s]
    assert len(said) == 1 and said[0].split(" = ")[1].startswith(kernel), report.graphs[0].skipped
    node = said[0].split(" = ")[0]
    assert kernel not in {op.op for op in report.ops} and node not in {op.node for op in report.ops}, report.ops
    assert all(node not in (p.node, p.value) for p in report.graphs[0].probes), report.graphs[0].probes
    assert f"not judged: 1 user kernel call(s) ({kernel})" in str(report), str(report)
