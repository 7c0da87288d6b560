"""``torch.export`` programs under the neuron backend: ``torch.compile(ExportedProgram.module())`` runs inference
and trains as eager does, and the checks export leaves in its graph (``_assert_tensor_metadata`` per ``.to()``,
``_assert_scalar`` and ``sym_constrain_range`` per range) are lowered as Inductor lowers them
(lowering/export_checks.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.exc import TorchRuntimeError

from neuron_compile import STATS

aten = torch.ops.aten


class Tagger(torch.nn.Module):
    """Token tagger whose dtype casts (``.float()``, ``.to()``, ``type_as``) export as ``_assert_tensor_metadata``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.proj = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).float() * scale.to(torch.float32)
        return self.head(torch.relu(self.norm(self.proj(h)))).type_as(h)


def _exported(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` exported with a dynamic batch, as a module (its batch range is checked by the module's
    ``_guards_fn``, which Dynamo traces with the batch it is given)."""
    batch = torch.export.Dim("batch", min=2, max=64)
    args = (torch.randint(0, 16, (4, 5)), torch.rand(4, 5, 1))
    program = torch.export.export(model, args, dynamic_shapes=({0: batch}, {0: batch}))
    module = program.module()
    targets = {node.target for node in module.graph.nodes}
    assert aten._assert_tensor_metadata.default in targets  # what this file tests
    return module


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 16, (n, 5)), torch.rand(n, 5, 1)


def test_exported_program_compiles_for_inference() -> None:
    """Two batch sizes of a program exported with a dynamic batch: each compiles a static graph (dynamic=None)
    and matches eager."""
    torch.manual_seed(0)
    model = Tagger().eval()
    compiled = torch.compile(_exported(model), backend="neuron")
    STATS.reset()
    with torch.no_grad():
        for n in (4, 3):
            ids, scale = _batch(n)
            torch.testing.assert_close(compiled(ids, scale), model(ids, scale))
    assert STATS.count() == 2


def test_exported_program_trains_as_eager() -> None:
    torch.manual_seed(0)
    eager = Tagger()
    module = _exported(copy.deepcopy(eager))
    compiled = torch.compile(module, backend="neuron")
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, module)]
    for _ in range(2):
        ids, scale = _batch(4)
        target = torch.randn(4, 5, 4)
        for model, opt in zip((eager, compiled), opts):
            loss = torch.nn.functional.mse_loss(model(ids, scale), target)
            loss.backward()
            opt.step()
            opt.zero_grad()
    trained = dict(module.named_parameters())
    for name, param in eager.named_parameters():
        torch.testing.assert_close(trained[name], param, msg=name)


def _checks(x: torch.Tensor) -> torch.Tensor:
    aten._assert_tensor_metadata(x, dtype=torch.float32)
    aten._assert_scalar(x.shape[0] > 1, "needs two rows")
    aten.sym_constrain_range(x.shape[0], min=2, max=8)
    aten.sym_constrain_range_for_size(x.shape[0], min=2, max=8)
    return x * 2


def test_export_checks_reach_the_backend_and_lower_as_nothing() -> None:
    """The four checks survive AOTAutograd (they are side-effectful ops) and reach the lowering with Python
    numbers: they compile to nothing, and the graph computes the rest."""
    x = torch.randn(3, 2)
    torch.testing.assert_close(torch.compile(_checks, backend="neuron")(x), x * 2)


@pytest.mark.parametrize("x", [torch.randn(1, 2), torch.randn(3, 2, dtype=torch.float64)], ids=["rows", "dtype"])
def test_a_failing_export_check_raises_while_tracing(x: torch.Tensor) -> None:
    """A check that does not hold stops the compile with torch's own message (its meta kernel runs while
    tracing): nothing is left to check at run time."""
    with pytest.raises(TorchRuntimeError, match="needs two rows|dtype mismatch"):
        torch.compile(_checks, backend="neuron")(x)
