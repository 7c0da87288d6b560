"""The lazy eager mode of the ``neuron`` device (option ``eager_mode="lazy"``, ``neuron_compile/device/lazy.py``):
eager ops recorded and run as ONE graph at the next synchronization, compared with the op mode (each op its own
one-op graph) and with the same computation on CPU tensors. CPU target only; small shapes."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F

from neuron_compile import STATS, NeuronUnsupportedOpError, Options
from neuron_compile.device import context, lazy

from .device_training import decoder_batches
from .models import Decoder

MODES = ["op", "lazy"]


@pytest.fixture(params=MODES)
def mode(request):
    """The device on the CPU target in one eager mode, fresh for the test."""
    context.reset_for_tests(Options.from_user({"target": "cpu", "eager_mode": request.param}))
    STATS.reset()
    yield request.param
    context.reset_for_tests()


def _steps(model, batches, device, compile_model=False):
    """Train one step per batch with the default AdamW (capturable=False); per step the loss and (graphs
    compiled, graphs run on the device)."""
    forward = torch.compile(model, backend="neuron", dynamic=False) if compile_model else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, counts = [], []
    for x, y in batches:
        compiled, runs = STATS.eager_ops_compiled, STATS.device_graph_runs
        loss = forward(x.to(device), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        counts.append((STATS.eager_ops_compiled - compiled, STATS.device_graph_runs - runs))
    return losses, counts


def _trained(mode, compile_model):
    batches = decoder_batches(5)
    torch.manual_seed(0)
    reference = Decoder(layers=1)
    model = copy.deepcopy(reference).to("neuron")
    expected, _ = _steps(reference, batches, "cpu", compile_model=False)
    losses, counts = _steps(model, batches, "neuron", compile_model)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5, msg=f"parameter {name}")
    return counts


def test_an_uncompiled_decoder_trains_as_on_cpu(mode) -> None:
    """Forward, backward and default AdamW all eager: in the lazy mode each step is one recording (a graph and
    its value check), and from the third step on nothing compiles."""
    counts = _trained(mode, compile_model=False)
    print(mode, counts)
    if mode == "lazy":
        assert counts[0][0] <= 3, counts
        assert all(compiled == 0 for compiled, _ in counts[2:]), counts
        assert all(runs <= 3 for _, runs in counts[2:]), counts


def test_the_first_eager_adamw_step_compiles_a_few_graphs(mode) -> None:
    """The model compiled, the default AdamW eager: its first step compiles ~22 one-op graphs in the op mode
    (fewer when an earlier test of the process compiled some), at most 3 in the lazy mode."""
    counts = _trained(mode, compile_model=True)
    print(mode, counts)
    if mode == "lazy":
        assert counts[0][0] <= 3, counts  # the recordings (and the gather below, where not compiled before)
        assert all(compiled == 0 for compiled, _ in counts[2:]), counts
        # forward, its value check, backward, the gather of a strided saved activation it binds (as in the op
        # mode), the recorded seed gradient (ones_like, run when the backward binds it) and the AdamW recording
        assert all(runs <= 6 for _, runs in counts[2:]), counts


def test_an_op_that_cannot_run_raises_at_its_line(mode) -> None:
    # a shape of its own: a refusal is kept per key with the line of its first call (as in the op mode)
    x = torch.randn(3, 7).to("neuron")
    y = x * 2  # recorded (lazy): nothing runs yet
    line = inspect.currentframe().f_lineno + 2
    with pytest.raises(NeuronUnsupportedOpError) as info:
        y[y > 0]
    assert f"test_device_lazy.py:{line}" in str(info.value)
    assert "aten.nonzero" in str(info.value)
    torch.testing.assert_close(y.cpu(), x.cpu() * 2)  # what was recorded before still runs


def test_item_mid_sequence_reads_the_right_value(mode) -> None:
    a = torch.randn(5, 3)
    d = a.to("neuron")
    b = (d * 3).exp()
    s = b.sum()
    if mode == "lazy":
        assert lazy.pending_ops() == 3
    assert s.item() == pytest.approx((a * 3).exp().sum().item(), rel=1e-5)
    assert lazy.pending_ops() == 0
    c = b - s / 2  # after the flush: recorded on the materialized values
    torch.testing.assert_close(c.cpu(), (a * 3).exp() - (a * 3).exp().sum() / 2, rtol=1e-5, atol=1e-5)


def test_writes_through_views_match_cpu(mode) -> None:
    a = torch.randn(6, 8)
    d = a.to("neuron")
    for t in (a, d):
        u = t.clone()
        u[1:4, ::2] = 5.0  # a strided view written
        v = u.t()
        v[2].mul_(3.0)  # an in-place op on a view of a view
        u[0].copy_(u[5] + 1)  # a row from another row
        w = u.view(-1)[10:20]
        w.add_(torch.arange(10, dtype=t.dtype, device=t.device))  # a run of the storage
        t.sub_(u)  # the source written: u was a copy
        t.resize_(48).relu_()
        results = (t.clone(), u)
        if t is a:
            expected = results
    torch.testing.assert_close(d.cpu(), a)
    torch.testing.assert_close(results[1].cpu(), expected[1])


def test_a_compiled_graph_and_synchronize_read_pending_values(mode) -> None:
    a = torch.randn(4, 4)
    d = a.to("neuron")
    h = F.gelu(d) + 1  # pending in the lazy mode

    @torch.compile(backend="neuron", dynamic=False)
    def f(x):
        return x @ x.t()

    out = f(h)
    torch.testing.assert_close(out.cpu(), (F.gelu(a) + 1) @ (F.gelu(a) + 1).t(), rtol=1e-4, atol=1e-4)
    g = h * 2
    torch.neuron.synchronize()
    assert lazy.pending_ops() == 0
    torch.testing.assert_close(g.cpu(), (F.gelu(a) + 1) * 2)
    assert "tensor(" in repr(g)  # print formats on the host, after the recording ran
