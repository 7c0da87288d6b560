"""Python numbers given to eager ops on the device are inputs of their graphs, not keys (issue 57 item 1):
default AdamW, SGD with a schedule and Adam with clipping compile nothing after their first steps and train as
on CPU; an op whose number is used in any other way than as a runtime value stays keyed by value and right."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from neuron_compile import STATS
from neuron_compile.device import onegraph

#: (name, f(x, number), whether one graph serves every number): f on a dimensioned float32 or int64 tensor.
NUMBER_CASES = [
    ("mul", lambda x, v: x * v, True),
    ("rsub", lambda x, v: v - x, True),
    ("div", lambda x, v: x / v, True),
    ("remainder", lambda x, v: x % v, True),
    ("add_alpha", lambda x, v: x.add(x, alpha=v), True),
    ("addcdiv_value", lambda x, v: torch.addcdiv(x, x, x.abs() + 1, value=v), True),
    ("lerp_weight", lambda x, v: torch.lerp(x, x * 2, v), True),
    ("foreach_div_scalarlist", lambda x, v: torch._foreach_div([x, x + 1], [v, v + 1])[1], True),
    # the number shapes the computation (an exponent's special cases; a bound): keyed by value, still right
    ("pow", lambda x, v: torch.pow(x, v), False),
    ("pow_general_first", lambda x, v: torch.pow(x.abs() + 1, v + 0.25), False),
    ("clamp_min", lambda x, v: x.clamp(min=v), False),
]
#: Ordinary numbers (0, 1 and -1 are keyed apart: decompositions special-case them).
VALUES = {torch.float32: (0.5, -2.5, 3.25), torch.bfloat16: (0.1, -2.5, 3.3), torch.int64: (2, -3, 5)}


@pytest.mark.parametrize("name,f,one_graph", NUMBER_CASES, ids=[c[0] for c in NUMBER_CASES])
def test_numbers_as_operands_match_cpu_for_every_value(cpu_device, name, f, one_graph) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        if dtype is torch.int64 and name in ("div", "addcdiv_value", "lerp_weight", "foreach_div_scalarlist", "pow"):
            continue
        if dtype is torch.bfloat16 and name == "remainder":
            # eager takes x % 0.1 in float32 with 0.1f, our remainder lowering in bfloat16 (compiled graphs too,
            # before this change and after): an open lowering issue, not the number's route (session note)
            continue
        x = torch.arange(1, 13, dtype=dtype).reshape(3, 4) - 4
        compiled = []
        for v in VALUES[dtype]:
            before = STATS.eager_ops_compiled
            got = f(x.to("neuron"), v).cpu()
            compiled.append(STATS.eager_ops_compiled - before)
            expected = f(x, v)
            assert got.dtype == expected.dtype, (name, dtype, v)
            torch.testing.assert_close(got, expected, equal_nan=True, msg=lambda m: f"{name} {dtype} {v}: {m}")
        if one_graph:
            assert compiled[1:] == [0, 0], (name, dtype, compiled)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


SETUPS = {
    "adamw": lambda p: (torch.optim.AdamW(p, lr=1e-2), None),
    "sgd_cosine": lambda p: (lambda o: (o, torch.optim.lr_scheduler.CosineAnnealingLR(o, 10)))(
        torch.optim.SGD(p, lr=0.1, momentum=0.9)
    ),
    "adam_linear_clip": lambda p: (lambda o: (o, torch.optim.lr_scheduler.LinearLR(o)))(torch.optim.Adam(p, lr=1e-2)),
}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_optimizers_and_schedules_compile_nothing_in_steady_state(cpu_device, setup) -> None:
    model, reference = _mlp(), _mlp()
    model.to("neuron")
    opt, sched = SETUPS[setup](model.parameters())
    ref_opt, ref_sched = SETUPS[setup](reference.parameters())
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    compiled, table = [], []
    for _ in range(6):
        before = STATS.eager_ops_compiled
        for m, o, s, a, b in (
            (model, opt, sched, x.to("neuron"), y.to("neuron")),
            (reference, ref_opt, ref_sched, x, y),
        ):
            o.zero_grad()
            ((m(a) - b) ** 2).mean().backward()
            if setup.endswith("clip"):
                nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
            if s is not None:
                s.step()
        compiled.append(STATS.eager_ops_compiled - before)
        table.append(len(onegraph.GRAPHS))
    assert compiled[2:] == [0] * 4, compiled
    assert table[2:] == [table[2]] * 4, table  # the in-memory table stops growing too
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)


def test_a_constant_number_is_uploaded_once(cpu_device) -> None:
    x = torch.randn(3, 4, device="neuron")
    (x * 0.5).cpu()
    before = STATS.host_to_device_bytes
    for _ in range(3):
        x = x * 0.5
    assert STATS.host_to_device_bytes == before
    before = STATS.host_to_device_bytes
    x = x * 0.25  # a new number: its vector (4 bytes) crosses
    assert STATS.host_to_device_bytes - before == 4
