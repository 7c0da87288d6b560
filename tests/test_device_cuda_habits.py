"""Habits of CUDA training code on the ``neuron`` device (issue 56 items 1-3 and 5): Parameters keep their
identity across ``.to("neuron")``, tied weights stay tied, an optimizer built first trains; ops that write their
inputs write them on the device, through the host fallback too; writes from several threads are not lost; and
eager ops CUDA code runs (convolutions, GroupNorm on a strided input, ``x % 3``, ``inference_mode``,
``model.compile()``, ``.item()`` in compiled code) match CPU. Each silent-wrong case failed before the fix.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn as nn

from neuron_compile import NeuronUnsupportedOpError, Options
from neuron_compile.device import context, eager

from .test_device import sim_device  # noqa: F401  (fixture, used by name in usefixtures)


def _tied_lm() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(12, 6), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 12, bias=False))
    model[3].weight = model[0].weight  # as GPT-2's lm_head and wte
    return model


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_parameters_keep_identity_and_ties_and_an_optimizer_built_first_trains(cpu_device, optimizer) -> None:
    model, reference = _tied_lm(), _tied_lm()
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1), "adamw": lambda p: torch.optim.AdamW(p, lr=0.05)}[optimizer]
    opt, ref_opt = make(model.parameters()), make(reference.parameters())  # before the move, as CUDA code does
    before = list(model.parameters())
    model.to("neuron")
    assert [p is q for p, q in zip(model.parameters(), before)] == [True] * len(before)
    assert model[3].weight is model[0].weight and model[0].weight.device.type == "neuron"
    tokens = torch.tensor([[1, 5, 7, 2], [3, 3, 9, 11]])
    for _ in range(3):
        for m, o, t in ((model, opt, tokens.to("neuron")), (reference, ref_opt, tokens)):
            o.zero_grad()
            nn.functional.cross_entropy(m(t).flatten(0, 1), t.flatten()).backward()
            o.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)
    model.cpu()
    assert model[0].weight is before[0] and before[0].device.type == "cpu" and model[3].weight is model[0].weight


def test_a_parameter_moved_with_its_gradient_and_attributes_keeps_them(cpu_device) -> None:
    layer = nn.Linear(3, 2)
    layer.weight.my_tag = "keep me"
    layer(torch.randn(4, 3)).sum().backward()
    grad = layer.weight.grad.clone()
    weight = layer.weight
    layer.to("neuron")
    assert layer.weight is weight and weight.my_tag == "keep me"
    assert weight.grad.device.type == "neuron" and torch.equal(weight.grad.cpu(), grad)


def test_batchnorm_running_statistics_update_on_the_device_and_through_the_host_fallback(cpu_device) -> None:
    x = torch.randn(8, 3, 5)
    expected = nn.BatchNorm1d(3)
    expected(x)
    for fallback in ("off", "cpu"):
        context.reset_for_tests(Options.from_user({"target": "cpu", "eager_fallback": fallback}))
        bn = nn.BatchNorm1d(3).to("neuron")
        bn(x.to("neuron"))
        torch.testing.assert_close(bn.running_mean.cpu(), expected.running_mean)
        torch.testing.assert_close(bn.running_var.cpu(), expected.running_var)
        assert int(bn.num_batches_tracked.cpu()) == 1


#: In-place samplers: their values come from the generator of wherever they run, so only CPU's can be compared.
_SAMPLERS = {"bernoulli", "cauchy", "exponential", "geometric", "log_normal", "normal", "uniform"}


def _inplace_cases() -> list:
    from torch.testing._internal.common_methods_invocations import op_db

    cases = []
    for info in op_db:
        if info.inplace_variant is None or info.variant_test_name or torch.float32 not in info.dtypes:
            continue
        if info.name not in _SAMPLERS:
            cases.append(pytest.param(info, id=info.name))
    return cases


@pytest.mark.extended  # ~130 ops, 80 s: CI's extended job
@pytest.mark.parametrize("info", _inplace_cases())
def test_every_in_place_op_run_by_the_host_fallback_writes_the_device_tensor(cpu_device, info, monkeypatch) -> None:
    """Every op goes to the host (the one-op path refused), so each OpInfo in-place op is written back."""
    context.reset_for_tests(Options.from_user({"target": "cpu", "eager_fallback": "cpu"}))

    def refuse(op, args, kwargs):
        raise NeuronUnsupportedOpError(f"eager {op}", [])

    monkeypatch.setattr(eager, "run", refuse)
    sample = next(iter(info.sample_inputs("cpu", torch.float32, requires_grad=False)), None)
    if sample is None:
        pytest.skip("no float32 sample")
    expected = sample.input.clone()
    try:
        info.inplace_variant(expected, *sample.args, **sample.kwargs)
    except Exception as e:
        pytest.skip(f"CPU refuses the sample: {type(e).__name__}")
    to_dev = lambda v: v.to("neuron") if isinstance(v, torch.Tensor) and v.dtype != torch.float64 else v  # noqa: E731
    if isinstance(sample.input, torch.Tensor) and sample.input.dtype == torch.float64:
        pytest.skip("float64")
    got = to_dev(sample.input.clone())
    args = [to_dev(a) for a in sample.args]
    kwargs = {k: to_dev(v) for k, v in sample.kwargs.items()}
    info.inplace_variant(got, *args, **kwargs)
    torch.testing.assert_close(got.cpu(), expected, equal_nan=True, msg=lambda m: f"{info.name}: {m}")


def test_writes_from_several_threads_to_one_tensor_are_all_kept(cpu_device) -> None:
    rows, threads = 120, 4
    t = torch.zeros(rows, 3, device="neuron")

    def write(start: int) -> None:
        for r in range(start, rows, threads):
            t[r] = float(r)

    workers = [threading.Thread(target=write, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert torch.equal(t.cpu(), torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, 3))


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Conv2d(4, 2, 3, stride=2))


def test_eager_convolution_and_groupnorm_on_a_strided_input_train_as_on_cpu(cpu_device) -> None:
    net, reference = _conv_net(), _conv_net()
    net.to("neuron")
    x = torch.randn(2, 6, 6, 3).permute(0, 3, 1, 2)  # channels-last memory: GroupNorm's input is not contiguous
    xd = x.to("neuron").requires_grad_()
    xc = x.clone().requires_grad_()
    net(xd).square().sum().backward()
    reference(xc).square().sum().backward()
    torch.testing.assert_close(xd.grad.cpu(), xc.grad, rtol=1e-4, atol=1e-5)
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_python_numbers_as_operands(cpu_device, dtype) -> None:
    x = torch.arange(-5, 7, dtype=dtype)
    d = x.to("neuron")
    for f in (lambda t: t % 3, lambda t: 7 - t, lambda t: t * 2 + 1, lambda t: t // 4):
        assert torch.equal(f(d).cpu(), f(x))


def test_inference_mode_eager(cpu_device) -> None:
    layer = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    device_layer = copy.deepcopy(layer).to("neuron")
    with torch.inference_mode():
        got = device_layer(x.to("neuron"))
        assert got.is_inference()
        torch.testing.assert_close(got.cpu(), layer(x))
    device_layer(x.to("neuron")).sum().backward()  # and training after it
    assert device_layer.weight.grad is not None


def test_model_compile_and_item_in_compiled_code_do_not_trace_the_device(cpu_device) -> None:
    layer = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    device_layer = copy.deepcopy(layer).to("neuron")
    device_layer.compile(backend="neuron", dynamic=False)
    torch.testing.assert_close(device_layer(x.to("neuron")).cpu(), layer(x))

    @torch.compile(backend="neuron", dynamic=False)
    def scaled(t: torch.Tensor) -> torch.Tensor:
        return t * t.sum().item()

    torch.testing.assert_close(scaled(x.to("neuron")).cpu(), x * x.sum().item(), rtol=1e-5, atol=1e-5)


def test_deepcopy_of_a_model_with_buffers_and_of_a_tensor_on_the_device(cpu_device) -> None:
    """EMA copies and checkpoints deep-copy device models; a plain tensor's deepcopy goes through a storage torch
    makes with the device's C++ allocator."""
    bn = nn.BatchNorm1d(3).to("neuron")
    bn(torch.randn(6, 3).to("neuron"))
    twin = copy.deepcopy(bn)
    assert twin.running_mean is not bn.running_mean and twin.running_mean.device.type == "neuron"
    assert torch.equal(twin.running_mean.cpu(), bn.running_mean.cpu())
    twin(torch.randn(6, 3).to("neuron"))  # the copy is its own memory
    assert not torch.equal(twin.running_mean.cpu(), bn.running_mean.cpu())
    x = torch.randn(4, device="neuron")
    assert torch.equal(copy.deepcopy(x).cpu(), x.cpu())


@pytest.mark.usefixtures("sim_device")
def test_on_the_simulated_neuroncore_identity_ties_running_stats_and_threads() -> None:
    """Items 1-3 on the neuron target (nrt tensors in the fake libnrt): one case, since each graph is a fake
    neuronx-cc run."""
    model, reference = _tied_lm(), _tied_lm()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    embedding = model[0].weight
    model.to("neuron")
    assert model[0].weight is embedding is model[3].weight
    tokens = torch.tensor([[1, 5, 7, 2]])
    for m, o, t in ((model, opt, tokens.to("neuron")), (reference, ref_opt, tokens)):
        nn.functional.cross_entropy(m(t).flatten(0, 1), t.flatten()).backward()
        o.step()
    torch.testing.assert_close(embedding.detach().cpu(), reference[0].weight.detach(), rtol=1e-5, atol=1e-6)

    bn, expected = nn.BatchNorm1d(3).to("neuron"), nn.BatchNorm1d(3)
    x = torch.randn(8, 3)
    bn(x.to("neuron"))
    expected(x)
    torch.testing.assert_close(bn.running_var.cpu(), expected.running_var)

    t = torch.zeros(16, 2, device="neuron")

    def write(start: int) -> None:
        for r in range(start, 16, 2):
            t[r] = float(r)

    workers = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert torch.equal(t.cpu(), torch.arange(16, dtype=torch.float32)[:, None].expand(16, 2))


def test_a_cuda_training_script_with_only_the_device_string_changed(cpu_device) -> None:
    """The habits together: optimizer built before the move, tied weights, a pinned DataLoader with non_blocking
    copies, a gradient hook, an LR schedule, autocast around the forward: trains as the same script on CPU (float32
    there; bfloat16 autocast checked for its dtype) and compiles nothing from step 3 on."""
    from neuron_compile import STATS

    def script(device: str) -> tuple[nn.Module, list[int], list[int]]:
        model = _tied_lm()
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
        model.to(device)
        seen = []
        model[1].weight.register_hook(lambda g: seen.append(1))
        data = torch.utils.data.TensorDataset(torch.randint(0, 12, (10, 4), generator=torch.Generator().manual_seed(2)))
        loader = torch.utils.data.DataLoader(data, batch_size=2, pin_memory=device == "neuron")
        compiled = []
        for (tokens,) in loader:
            before = STATS.eager_ops_compiled
            tokens = tokens.to(device, non_blocking=True)
            opt.zero_grad()
            nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
            opt.step()
            sched.step()
            compiled.append(STATS.eager_ops_compiled - before)
        return model, compiled, seen

    model, compiled, seen = script("neuron")
    reference, _, _ = script("cpu")
    assert compiled[2:] == [0] * 3 and len(seen) == 5, (compiled, seen)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)
    with torch.autocast("neuron", dtype=torch.bfloat16):
        assert model[1](torch.randn(3, 6, device="neuron")).dtype == torch.bfloat16
