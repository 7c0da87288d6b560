"""neuron_compile.evaluate.bisect and `neuron-compile evaluate --bisect`: every aten op judged alone.

The bisect must point at an op whose lowering is deliberately made imprecise (its result scaled by
1 + 8 eps of its dtype: a relative error 16x one rounding's), at its user source line, and at nothing else
of a model whose other ops are exact-rounded (linear, layer norm, softmax, GELU, their backward).
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

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
