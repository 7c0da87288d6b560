"""Code written for CUDA runs on the ``neuron`` device with only the device string changed, or says why not
(issue 56 items 5-7): ``torch.neuron``'s torch.cuda functions, autocast with CUDA's policy, GradScaler, and the
one-line errors of DDP, FSDP2 and ``torch.load`` without the device. docs/device.md "CUDA code on the device"."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import neuron_compile
from neuron_compile.device import NeuronModule, amp

neuron_compile.device.register()

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _subprocess(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {
        **os.environ,
        "NEURON_COMPILE_TARGET": "cpu",
        "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])),
        **env,
    }
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=600)


# -- torch.neuron: what torch.cuda users call --------------------------------------------------------------------
def test_memory_functions_mean_what_cudas_mean(cpu_device) -> None:
    N = torch.neuron
    N.reset_peak_memory_stats()
    base = N.memory_allocated()
    x = torch.zeros(1024, device="neuron")
    assert N.memory_allocated() == base + 4096
    assert N.memory_reserved() == N.memory_allocated()  # nothing is cached
    assert N.max_memory_reserved() == N.max_memory_allocated() >= base + 4096
    stats = N.memory_stats()
    for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
                "reserved_bytes.all.peak", "active_bytes.all.current", "num_alloc_retries"):  # fmt: skip
        assert key in stats, key
    assert stats["allocated_bytes.all.current"] == N.memory_allocated()
    free, total = N.mem_get_info()
    assert total == cpu_device.memory_limit and free == total - N.memory_allocated()
    assert "neuron:0" in N.memory_summary() and "Allocated" in N.memory_summary()
    del x
    N.empty_cache()  # nothing to give back: the buffer was freed with the tensor
    assert N.memory_reserved() == base
    N.reset_max_memory_allocated()
    assert N.max_memory_allocated() == base
    N.ipc_collect()
    N.reset_accumulated_memory_stats()


def test_device_name_properties_capability_bf16(cpu_device) -> None:
    N = torch.neuron
    assert N.get_device_name() == "Trainium2 NeuronCore (CPU target)"
    props = N.get_device_properties(0)
    assert props.name == N.get_device_name() and props.total_memory == cpu_device.memory_limit
    assert N.get_device_capability() == (2, 0) == (props.major, props.minor)
    assert N.is_bf16_supported() is True
    assert torch.bfloat16 in N.get_amp_supported_dtype()


def test_out_of_memory_error_is_a_class_attribute(cpu_device) -> None:
    from neuron_compile.device.storage import NeuronOutOfMemoryError

    assert NeuronModule.OutOfMemoryError is torch.neuron.OutOfMemoryError is NeuronOutOfMemoryError
    with pytest.raises(torch.neuron.OutOfMemoryError):
        torch.empty(cpu_device.memory_limit // 4 + 1, device="neuron")
    assert issubclass(torch.neuron.OutOfMemoryError, RuntimeError)


def test_streams_and_events(cpu_device) -> None:
    N = torch.neuron
    s = N.Stream()
    assert isinstance(s, torch.Stream) and s.device == torch.device("neuron", 0)
    assert N.current_stream() == N.default_stream() and s.query()
    x = torch.ones(4, device="neuron")
    with N.stream(s):
        y = x + 1
    N.set_stream(N.default_stream())
    s.wait_stream(N.current_stream())
    start, end = N.Event(enable_timing=True), N.Event(enable_timing=True)
    start.record()
    time.sleep(0.01)
    z = y * 2
    end.record(s)
    end.synchronize()
    assert end.query() and start.elapsed_time(end) >= 10.0
    N.current_stream().wait_event(end)
    end.wait()
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        N.Event().elapsed_time(end)
    z.record_stream(s)  # nothing to do on one stream
    assert z.cpu().tolist() == [4.0] * 4
    assert isinstance(s.record_event(), N.Event)
    N.synchronize()


# -- autocast ----------------------------------------------------------------------------------------------------
class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.lin(x)
        return (h, torch.softmax(h, -1), F.log_softmax(h, -1), self.norm(h), h @ h.T, h.sum(),
                F.mse_loss(h, y), torch.exp(h))  # fmt: skip


def _reference(block: _Block, x: torch.Tensor, y: torch.Tensor, low: torch.dtype) -> list[torch.Tensor]:
    """CUDA's autocast policy written out as casts, on CPU."""
    h = F.linear(x.to(low), block.lin.weight.to(low), block.lin.bias.to(low))
    f = h.float()
    return [h, torch.softmax(f, -1), F.log_softmax(f, -1), F.layer_norm(f, (16,), block.norm.weight, block.norm.bias),
            h @ h.T, h.sum(dtype=torch.float32), F.mse_loss(f, y), torch.exp(f)]  # fmt: skip


_DTYPES = ["lower", "float32", "float32", "float32", "lower", "float32", "float32", "float32"]


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_autocast_applies_cudas_policy_eagerly_and_compiled(cpu_device, low) -> None:
    torch.manual_seed(0)
    block = _Block()
    x, y = torch.randn(4, 8), torch.randn(4, 16)
    dev = copy.deepcopy(block).to("neuron")

    def run(m, a, b):
        with torch.autocast("neuron", dtype=low):
            return m(a, b)

    eager = run(dev, x.to("neuron"), y.to("neuron"))
    compiled = torch.compile(run, backend="neuron", dynamic=False)(dev, x.to("neuron"), y.to("neuron"))
    reference = _reference(block, x, y, low)
    for i, (e, c, r, kind) in enumerate(zip(eager, compiled, reference, _DTYPES)):
        want = low if kind == "lower" else torch.float32
        assert e.dtype == c.dtype == r.dtype == want, (i, e.dtype, c.dtype, want)
        torch.testing.assert_close(e.cpu(), r, msg=f"output {i}")
        torch.testing.assert_close(c.cpu(), r, msg=f"output {i}")


def test_autocast_backward_and_the_banned_op(cpu_device) -> None:
    lin = torch.nn.Linear(8, 4).to("neuron")
    x = torch.randn(2, 8, device="neuron", requires_grad=True)
    with torch.autocast("neuron", dtype=torch.bfloat16):
        out = lin(x)
        assert out.dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(torch.sigmoid(out.float()), torch.ones(2, 4, device="neuron"))
        with torch.autocast("neuron", enabled=False):
            assert lin(x).dtype == torch.float32
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32
    assert lin(x).dtype == torch.float32  # outside the region: as before
    assert len(amp.POLICY) > 100


# -- GradScaler --------------------------------------------------------------------------------------------------
def _amp_loop(device: str, init_scale: float) -> tuple[list[float], list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=init_scale, growth_interval=2)
    gen = torch.Generator().manual_seed(1)
    losses, scales = [], []
    for _ in range(4):
        x, y = torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)
        with torch.autocast(device, dtype=torch.float16):
            loss = F.mse_loss(model(x.to(device)), y.to(device))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return losses, scales, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("init_scale", [2.0**10, 2.0**40])
def test_grad_scaler_loop_matches_cpu(cpu_device, init_scale) -> None:
    """2**10: every step taken, the scale grows every 2 steps; 2**40: the float16 gradients overflow, so steps
    are skipped and the scale backs off, as on CPU."""
    host_losses, host_scales, host_params = _amp_loop("cpu", init_scale)
    losses, scales, params = _amp_loop("neuron", init_scale)
    assert scales == host_scales
    if init_scale == 2.0**10:
        assert scales == [1024.0, 2048.0, 2048.0, 4096.0]
    else:
        assert scales[0] < init_scale  # inf gradients: the step was skipped and the scale halved
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(host_losses))
    for p, q in zip(params, host_params):
        torch.testing.assert_close(p, q)


def test_amp_kernels_on_the_device(cpu_device) -> None:
    grads = [torch.tensor([2.0, 4.0], device="neuron"), torch.tensor([[1.0, float("inf")]], device="neuron")]
    found = torch.zeros((), device="neuron")
    torch._amp_foreach_non_finite_check_and_unscale_(grads[:1], found, torch.full((), 0.5, device="neuron"))
    assert found.item() == 0.0 and grads[0].cpu().tolist() == [1.0, 2.0]
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.full((), 0.5, device="neuron"))
    assert found.item() == 1.0
    scale, tracker = torch.full((), 8.0, device="neuron"), torch.zeros((), dtype=torch.int32, device="neuron")
    torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, 3)
    assert scale.item() == 4.0 and tracker.item() == 0
    torch._amp_update_scale_(scale, tracker, torch.zeros((), device="neuron"), 2.0, 0.5, 1)
    assert scale.item() == 8.0 and tracker.item() == 0


def test_float64_refusal_says_whether_torch_asked(cpu_device) -> None:
    x = torch.ones(3, device="neuron")
    with pytest.raises(TypeError, match=r"Cannot make a float64 copy .*\.cpu\(\)\.double\(\)"):
        x.double()
    torch_file = os.path.join(os.path.dirname(torch.__file__), "nn", "functional.py")
    code = compile("x.double()", torch_file, "exec")  # a frame of torch's own code asking
    with pytest.raises(TypeError, match=r"torch's own code \(torch/nn/functional.py:1, .*not something your code did"):
        exec(code, {"x": x})
    assert x.float().dtype == torch.float32 and x.to("cpu", torch.float64).dtype == torch.float64
    assert "1." in repr(x)  # printing still formats in float64 on the host


# -- not supported yet: one line saying what to do --------------------------------------------------------------
_DISTRIBUTED = """
import socket, sys, torch, neuron_compile
import torch.distributed as dist
neuron_compile.device.register()
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
try:
    for name in ("ddp", "fsdp2", "default_backend"):
        try:
            m = torch.nn.Linear(4, 4).to("neuron")
            if name == "ddp":
                torch.nn.parallel.DistributedDataParallel(m)
            elif name == "fsdp2":
                from torch.distributed.fsdp import fully_shard
                fully_shard(m)
            else:
                assert dist.get_default_backend_for_device("neuron") == "neuron"
                dist.Backend._plugins["NEURON"].creator_fn(None, 0, 1, None)
            print(name, "NO ERROR")
        except RuntimeError as e:
            print(name, type(e).__name__, str(e).replace(chr(10), " | "))
    # CPU collectives of the same group still work
    t = torch.ones(2); dist.all_reduce(t); print("cpu all_reduce", t.tolist())
finally:
    dist.destroy_process_group()
"""


def test_ddp_and_fsdp2_of_a_device_model_say_in_one_line_what_to_do() -> None:
    proc = _subprocess(_DISTRIBUTED, NEURON_COMPILE_DEVICE="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {line.split(" ", 1)[0]: line for line in proc.stdout.splitlines()}
    for name, feature in (("ddp", "DistributedDataParallel (DDP)"), ("fsdp2", "FSDP2 (fully_shard)"),
                          ("default_backend", "a process group backend")):  # fmt: skip
        line = lines[name]
        assert "NeuronDistributedUnsupportedError" in line and " | " not in line, line
        assert feature in line and "not supported yet" in line and "gloo process group" in line, line
        assert "docs/distributed.md" in line, line
    assert 'mesh=init_device_mesh("cpu"' in lines["fsdp2"]
    assert lines["cpu"] == "cpu all_reduce [1.0, 1.0]"


_LOAD = """
import sys, torch, neuron_compile
assert not neuron_compile.device.is_registered()
print(torch.load(sys.argv[1], map_location="cpu")["w"].tolist())
try:
    torch.load(sys.argv[1])
except RuntimeError as e:
    print("error:", str(e).replace(chr(10), " | "))
"""


def test_torch_load_of_a_device_checkpoint_without_the_device(cpu_device, tmp_path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.arange(3.0, device="neuron")}, path)
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD, str(path)],
        env={**os.environ, "NEURON_COMPILE_DEVICE": "0", "PYTHONPATH": REPO_ROOT},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded, error = proc.stdout.strip().splitlines()[-2:]
    assert loaded == "[0.0, 1.0, 2.0]"
    assert error.startswith("error: torch.load: this checkpoint holds tensors saved from the 'neuron:0' device")
    assert 'map_location="cpu"' in error and "neuron_compile.device.register()" in error and " | " not in error
    assert torch.load(path)["w"].device.type == "neuron"  # where the device is registered: on it
