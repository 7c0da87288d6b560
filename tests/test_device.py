"""The ``neuron`` device (neuron_compile/device): tensors that stay on the NeuronCore.

Each case runs on the CPU target (XLA CPU buffers) and, where it says so, on the device simulator's neuron
target (nrt tensors in the fake libnrt); values are compared with the same computation on CPU tensors.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

import neuron_compile
from neuron_compile import STATS, NeuronUnsupportedOpError, Options
from neuron_compile.device import context, eager

from . import device_sim
from .models import BatchNormNet, Decoder
from .test_neuron_target import _STATE_DIR
from .test_training import _rounding_noise


@pytest.fixture
def cpu_device():
    """The device on the CPU target, fresh for the test (its one-op graphs stay in the process's table)."""
    context.reset_for_tests(Options.from_user({"target": "cpu"}))
    STATS.reset()
    yield context.device()
    context.reset_for_tests()


@pytest.fixture
def sim_device(monkeypatch: pytest.MonkeyPatch):
    """The device on the simulated neuron target (fake libnrt and neuronx-cc)."""
    for name, value in {**device_sim.environment(), "NRTSIM_STATE_DIR": _STATE_DIR}.items():
        monkeypatch.setenv(name, value)
    context.reset_for_tests(Options.from_user({"target": "neuron"}))
    STATS.reset()
    yield context.device()
    context.reset_for_tests()


def test_the_device_is_torchs_privateuse1_backend(cpu_device) -> None:
    """Pins the experimental PyTorch API the device is built on (torch.utils.backend_registration)."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend  # noqa: F401

    assert torch._C._get_privateuse1_backend_name() == "neuron" and neuron_compile.device.is_registered()
    x = torch.zeros(2, 3, device="neuron")
    assert x.device == torch.device("neuron", 0) and x.is_neuron and type(x) is torch.Tensor
    assert torch.neuron.device_count() == 1 and torch.neuron.current_device() == 0
    assert x.cpu().equal(torch.zeros(2, 3))


def _fresh(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def _setitem_slice(x):
    x = x.clone()
    x[1:3, 1] = 5.0
    return x


def _inplace_through_a_view(x):
    x = x.clone()
    x.view(6, 4).mul_(3)
    x.t()[0].add_(1)
    return x


def _scatter_add(x):
    index = torch.tensor([[0, 1, 2, 3, 0, 1]], device=x.device).expand(2, 6)
    return torch.zeros(4, 6, device=x.device).scatter_add_(0, index, x[:2])


#: (name, f): f(x) on a (4, 6) float32 tensor; the device result must equal the CPU one.
EAGER_CASES = [
    ("transpose_contiguous", lambda x: x.t().contiguous()),
    ("strided_slice_times_two", lambda x: x[1:3, ::2] * 2),
    ("setitem_slice", _setitem_slice),
    ("inplace_through_a_view", _inplace_through_a_view),
    ("broadcast_add", lambda x: x[:1] + x),
    ("sum_dim", lambda x: x.sum(0)),
    ("max_values_and_argmax", lambda x: torch.stack((x.max(1).values, x.argmax(1).float()))),
    ("softmax", lambda x: torch.softmax(x, -1)),
    ("matmul", lambda x: x @ x.t()),
    ("where_mask", lambda x: torch.where(x > 0, x, torch.zeros_like(x))),
    ("masked_fill_", lambda x: x.clone().masked_fill_(x < 0, -1.0)),
    ("cat_split", lambda x: torch.cat(x.split(2, dim=1)[::-1], dim=1)),
    ("index_select", lambda x: x.index_select(1, torch.tensor([5, 0, 2], device=x.device))),
    ("scatter_add_", _scatter_add),
    ("to_bfloat16_and_back", lambda x: x.to(torch.bfloat16).float()),
    ("cumsum", lambda x: x.cumsum(1)),
    ("python_scalar_ops", lambda x: (x * 0.5 + 3).clamp(min=2.5)),
]


@pytest.mark.parametrize("name,f", EAGER_CASES, ids=[c[0] for c in EAGER_CASES])
def test_eager_ops_on_the_device_match_cpu(cpu_device, name, f) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    expected = f(x.clone())
    got = f(x.to("neuron"))
    assert got.device.type == "neuron", name
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-6, atol=1e-6, msg=name)


def test_views_share_storage_and_writes_reach_every_view(cpu_device) -> None:
    x = torch.arange(12.0).view(3, 4).to("neuron")
    row, col = x[1], x[:, 2]
    assert row.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() != 0
    row.fill_(-1.0)
    expected = torch.arange(12.0).view(3, 4)
    expected[1] = -1.0
    assert x.cpu().equal(expected) and col.cpu().equal(expected[:, 2])
    other = torch.zeros(3, 4, device="neuron")
    assert other.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_transfers_item_tolist_print_save_load(cpu_device, tmp_path) -> None:
    x = torch.tensor([[1.5, -2.0], [3.0, 4.25]])
    d = x.to("neuron")
    before = STATS.host_to_device_bytes
    assert d[1, 1].item() == 4.25 and d.tolist() == x.tolist()
    assert "device='neuron:0'" in repr(d) and "4.2500" in repr(d)
    torch.save({"d": d}, tmp_path / "t.pt")
    loaded = torch.load(tmp_path / "t.pt", map_location="cpu")["d"]
    assert loaded.device.type == "cpu" and loaded.equal(x)
    back = torch.load(tmp_path / "t.pt", map_location="neuron")["d"]
    assert back.device.type == "neuron" and back.cpu().equal(x)
    cpu_copy = torch.empty(2, 2)
    cpu_copy.copy_(d)
    d2 = torch.zeros(2, 2, device="neuron")
    d2.copy_(x.double())  # dtype converted on the host side of the copy
    assert cpu_copy.equal(x) and d2.cpu().equal(x)
    assert STATS.host_to_device_bytes > before and STATS.device_to_host_bytes > 0


def test_module_to_device_state_dict_and_load_state_dict(cpu_device) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    on_device = copy.deepcopy(model).to("neuron")
    assert all(p.device.type == "neuron" for p in on_device.parameters())
    state = on_device.state_dict()
    assert state["weight"].device.type == "neuron" and state["weight"].cpu().equal(model.weight.detach())
    fresh = torch.nn.Linear(3, 2).to("neuron")
    fresh.load_state_dict(model.state_dict())  # CPU tensors copied onto the device
    x = torch.randn(5, 3)
    torch.testing.assert_close(fresh(x.to("neuron")).cpu(), model(x), rtol=1e-6, atol=1e-6)


def test_float64_and_complex_are_refused_with_what_to_do(cpu_device) -> None:
    with pytest.raises(TypeError, match=r"float64.*\.float\(\)"):
        torch.randn(2, dtype=torch.float64).to("neuron")
    with pytest.raises(TypeError, match="complex"):
        torch.randn(2, dtype=torch.complex64).to("neuron")


def test_an_op_the_device_cannot_compile_names_the_op_shapes_and_line(cpu_device) -> None:
    x = torch.randn(4, 6).to("neuron")
    with pytest.raises(NeuronUnsupportedOpError) as info:
        x[x > 0]  # a data-dependent output shape
    message = str(info.value)
    assert "aten.nonzero" in message and "bool[4, 6]" in message and "eager_fallback" in message
    assert f"{os.path.basename(__file__)}:" in message  # the user's line


def test_eager_fallback_cpu_runs_it_on_the_host_counts_and_warns_once(cpu_device) -> None:
    context.reset_for_tests(Options.from_user({"target": "cpu", "eager_fallback": "cpu"}))
    x = torch.randn(4, 6)
    d = x.to("neuron")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = d[d > 0], d[d > 0.5]
    assert first.device.type == "neuron" and first.cpu().equal(x[x > 0]) and second.cpu().equal(x[x > 0.5])
    assert STATS.eager_ops_fallback >= 2
    warned = [str(w.message).split()[2] for w in caught if isinstance(w.message, eager.NeuronEagerFallbackWarning)]
    assert warned and len(warned) == len(set(warned)), warned  # once per op, though each op ran twice


def test_memory_is_counted_freed_and_limited(cpu_device) -> None:
    start = torch.neuron.memory_allocated()
    x = torch.empty(1024, device="neuron")
    assert torch.neuron.memory_allocated() == start + 4096
    y = x * 2
    assert torch.neuron.memory_allocated() >= start + 8192
    del x, y
    assert torch.neuron.memory_allocated() == start
    context.reset_for_tests(Options.from_user({"target": "cpu", "device_memory_limit": start + 10_000}))
    keep = torch.empty(1000, device="neuron")
    with pytest.raises(torch.neuron.OutOfMemoryError, match=r"tried to allocate 8\.0 KiB.*in use.*limit") as info:
        torch.empty(2048, device="neuron")
    assert isinstance(info.value, RuntimeError)
    del keep


def _decoder_batches(steps: int, vocab: int = 64, batch: int = 4, seq: int = 16) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        data = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((data[:, :-1], data[:, 1:]))
    return out


def _train_on_device(model_cls, steps: int, optimizer: str, clip: bool = False, model_kwargs=None, batches=None):
    """(device losses, eager losses, bytes crossing per step, the two models) for ``steps`` AdamW steps of
    ``model_cls`` compiled on the device, next to eager on CPU."""
    torch.manual_seed(0)
    eager_model = model_cls(**(model_kwargs or {}))
    model = copy.deepcopy(eager_model).to("neuron")
    compiled = torch.compile(model, backend="neuron", dynamic=False)
    opt_e = torch.optim.AdamW(eager_model.parameters(), lr=1e-2)
    opt_d = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=optimizer != "eager")
    step_fn = torch.compile(opt_d.step, backend="neuron", dynamic=False) if optimizer == "compiled" else opt_d.step
    losses, ref_losses, crossing = [], [], []
    noise = {name: torch.zeros_like(p, dtype=torch.bool) for name, p in eager_model.named_parameters()}
    for inputs in batches:
        h2d, d2h = STATS.host_to_device_bytes, STATS.device_to_host_bytes
        loss = compiled(*(t.to("neuron") for t in inputs))
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        step_fn()
        opt_d.zero_grad()
        losses.append(loss.item())
        crossing.append((STATS.host_to_device_bytes - h2d, STATS.device_to_host_bytes - d2h))
        ref = eager_model(*inputs)
        ref.backward()
        for name, p in eager_model.named_parameters():
            noise[name] |= _rounding_noise(p.grad)
        if clip:
            torch.nn.utils.clip_grad_norm_(eager_model.parameters(), 1.0)
        opt_e.step()
        opt_e.zero_grad()
        ref_losses.append(ref.item())
    return losses, ref_losses, crossing, model, eager_model, noise


def _assert_trained_as_eager(model, eager_model, noise, steps: int) -> None:
    """Parameters as eager's; where a gradient was only rounding noise, AdamW's normalized step may go either
    way (test_training's rule: at most 2 * lr per step there)."""
    for (name, p_e), p_d in zip(eager_model.named_parameters(), model.parameters()):
        p_d, p_e, n = p_d.detach().cpu(), p_e.detach(), noise[name]
        assert not n.any() or (p_d[n] - p_e[n]).abs().max() <= 2 * 1e-2 * steps * 1.01, name
        torch.testing.assert_close(p_d[~n], p_e[~n], rtol=1e-4, atol=1e-5, msg=f"parameter {name}")


@pytest.mark.parametrize(
    "optimizer,clip",
    [("compiled", False), ("eager", False), ("eager", True)],
    ids=["compiled_step", "eager_adamw", "eager_adamw_clip"],
)
def test_a_decoder_trains_on_the_device_as_in_eager_and_moves_only_its_batch(cpu_device, optimizer, clip) -> None:
    batches = _decoder_batches(3)
    losses, ref_losses, crossing, model, eager_model, noise = _train_on_device(
        Decoder, 3, optimizer, clip, batches=batches
    )
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    _assert_trained_as_eager(model, eager_model, noise, 3)
    batch_bytes = sum(t.numel() * t.element_size() for t in batches[0])
    loss_bytes = 4
    for h2d, d2h in crossing[1:]:  # the steady state: the first step also moves the model
        assert h2d + d2h <= batch_bytes + loss_bytes + 1024, crossing


def test_a_batchnorm_cnn_trains_on_the_device(cpu_device) -> None:
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]

    class Loss(BatchNormNet):
        def forward(self, x, y):
            return F.cross_entropy(super().forward(x), y)

    losses, ref_losses, _, model, eager_model, noise = _train_on_device(Loss, 3, "compiled", batches=batches)
    _assert_trained_as_eager(model, eager_model, noise, 3)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    for (name, b_e), b_d in zip(eager_model.named_buffers(), model.buffers()):
        torch.testing.assert_close(b_d.cpu(), b_e, rtol=1e-4, atol=1e-5, msg=f"buffer {name}")


def test_a_decoder_trains_on_the_simulated_neuroncore(sim_device) -> None:
    batches = _decoder_batches(3)
    losses, ref_losses, crossing, model, eager_model, noise = _train_on_device(Decoder, 3, "compiled", batches=batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    _assert_trained_as_eager(model, eager_model, noise, 3)
    batch_bytes = sum(t.numel() * t.element_size() for t in batches[0])
    for h2d, d2h in crossing[1:]:
        assert h2d + d2h <= batch_bytes + 4 + 1024, crossing
    written = device_sim.counters()["bytes_written"]
    assert written == STATS.host_to_device_bytes, "every byte the runtime received was counted"


def test_a_second_process_compiles_nothing(tmp_path) -> None:
    """Compiled graphs and eager ops of a device training step come from the compile cache in a new process."""
    script = textwrap.dedent(
        """
        import json, sys, torch, neuron_compile
        from tests import device_sim
        from tests.models import Decoder
        torch.manual_seed(0)
        model = Decoder().to("neuron")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
        compiled = torch.compile(model, backend="neuron", dynamic=False)
        idx = torch.randint(0, 64, (4, 17))
        for _ in range(2):
            loss = compiled(idx[:, :-1].to("neuron"), idx[:, 1:].to("neuron"))
            loss.backward()
            opt.step()
            opt.zero_grad()
        print(json.dumps({"loss": loss.item(), "compiles": device_sim.compiler_invocations()}))
        """
    )
    env = {**os.environ, **device_sim.environment(str(tmp_path / "sim")), "NEURON_COMPILE_CACHE_DIR": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(device_sim.REPO_ROOT), env.get("PYTHONPATH", "")]))
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        import json

        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert runs[0]["compiles"] > 0 and runs[1]["compiles"] == runs[0]["compiles"], runs
    assert runs[0]["loss"] == runs[1]["loss"]
