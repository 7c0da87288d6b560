"""The ``neuron`` device never aborts the process, and what CUDA-style code asks torch about a device works
(neuron_compile/device/hooks.py): an exception in any backward hook reaches Python as CUDA gives it, the device
registered after a backward still runs backwards, pinned memory, ``torch.accelerator`` and
``torch.Generator("neuron")``.

Each drill runs in a subprocess: the failure these tests guard against is a SIGABRT of the interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_PRELUDE = """
import sys, torch, neuron_compile
neuron_compile.device.register()

class HookError(Exception):
    pass

def boom(*args):
    raise HookError("raised in the hook")
"""

# Drills: a hook that raises, on a small model on the device, eagerly or compiled.
_HOOK_DRILL = """
kind, mode = sys.argv[1], sys.argv[2]

armed = [False]

def hook(*args):
    if armed[0]:
        boom()

class Raising(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        hook()
        return g * 2

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):
        y = self.lin(x)
        return Raising.apply(y) if kind == "function" else y

torch.manual_seed(0)
net = Net().to("neuron")
x = torch.randn(2, 4).to("neuron").requires_grad_()
# Hooks are registered before compiling, as torch.compile sees them (it does not guard on later ones), and
# raise only when armed.
if kind == "tensor":
    x.register_hook(hook)
elif kind == "module_full_backward":
    net.lin.register_full_backward_hook(hook)
elif kind == "module_backward_pre":
    net.lin.register_full_backward_pre_hook(hook)
elif kind == "post_accumulate_grad":
    net.lin.weight.register_post_accumulate_grad_hook(hook)
model = torch.compile(net, backend="neuron", dynamic=False) if mode == "compiled" else net

def step():
    net.zero_grad()
    x.grad = None
    model(x).sum().backward()

step()  # compiled graphs and one-op graphs exist before the hook raises
expected = net.lin.weight.grad.cpu().clone()
armed[0] = True
try:
    step()
except HookError as e:
    print("caught:", type(e).__name__, e)
else:
    print("not raised")
    sys.exit(1)
armed[0] = False
step()  # the device still works
assert torch.allclose(net.lin.weight.grad.cpu(), expected), (net.lin.weight.grad.cpu(), expected)
print("after: ok")
"""

_ENV = {"NEURON_COMPILE_TARGET": "cpu", "NEURON_COMPILE_DEVICE": "0"}  # the drill registers it itself


def _run(script: str, *args: str, cache: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, **_ENV}
    if cache is not None:
        # Caches of the drill's own: a compiled drill run after another one in the same caches (same Linear,
        # other hooks) failed to compile its graph (dynamo traced into the backend), unlike either run alone.
        env["NEURON_COMPILE_CACHE_DIR"], env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "nc"), str(cache / "torch")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_PRELUDE) + textwrap.dedent(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize(
    "kind", ["tensor", "module_full_backward", "module_backward_pre", "post_accumulate_grad", "function"]
)
def test_an_exception_in_a_backward_hook_reaches_python(kind: str, mode: str, tmp_path: Path) -> None:
    """Was a SIGABRT ("terminate called without an active exception") with no traceback: torch's Python
    device guard called Python from a noexcept stream method while the hook's exception was still set."""
    proc = _run(_HOOK_DRILL, kind, mode, cache=tmp_path)
    assert "caught: HookError raised in the hook" in proc.stdout, proc.stdout
    assert "after: ok" in proc.stdout, proc.stdout


def test_registering_after_a_backward_still_runs_backwards() -> None:
    """The autograd engine makes its device threads at the process's first backward, from the devices
    registered then; the device registered later gets its thread when it registers."""
    code = """
import torch, neuron_compile
a = torch.ones(3, requires_grad=True)
(a * 2).sum().backward()  # the autograd engine sizes its device threads at the first backward
neuron_compile.device.register()
b = torch.ones(3, requires_grad=True)
(b * 3).sum().backward()
assert b.grad.tolist() == [3.0, 3.0, 3.0]
x = torch.ones(3).to("neuron").requires_grad_()
(x * 2).sum().backward()
assert x.grad.device.type == "neuron" and x.grad.cpu().tolist() == [2.0, 2.0, 2.0]
print("ok")
"""
    env = {**os.environ, **_ENV}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


_PINNED_AND_ACCELERATOR = """
from torch.utils.data import DataLoader, TensorDataset

t = torch.arange(6.0)
assert not t.is_pinned()
p = t.pin_memory()
assert p.device.type == "cpu" and p.is_pinned() and p.equal(t)
assert p.to("neuron", non_blocking=True).cpu().equal(t)
loader = DataLoader(TensorDataset(torch.arange(8.0).view(4, 2)), batch_size=2, pin_memory=True)
got = []
for (batch,) in loader:
    assert batch.is_pinned()
    got.append(batch.to("neuron", non_blocking=True).cpu())
assert torch.cat(got).equal(torch.arange(8.0).view(4, 2))

acc = torch.accelerator
assert acc.is_available() and acc.device_count() == 1 and acc.current_device_index() == 0
assert acc.current_accelerator() == torch.device("neuron")
acc.synchronize()
acc.empty_cache()
before = acc.memory_allocated()
x = torch.zeros(1024, device="neuron")
assert acc.memory_allocated() == before + 4096 == torch.neuron.memory_allocated()
assert acc.memory_reserved() == acc.memory_allocated()
assert acc.max_memory_allocated() >= acc.memory_allocated()
del x
acc.reset_peak_memory_stats()
assert acc.max_memory_allocated() == acc.memory_allocated() == before
print("ok")
"""


def test_pinned_memory_and_torch_accelerator() -> None:
    proc = _run(_PINNED_AND_ACCELERATOR)
    assert "ok" in proc.stdout


_SYNCHRONIZE_REPORTS = """
import neuron_compile.device as device
calls = []
device.NeuronModule.synchronize = staticmethod(lambda index=None: calls.append(index))
torch.accelerator.synchronize()
assert calls == [0], calls
def failing(index=None):
    raise IndexError("a deferred value check failed")
device.NeuronModule.synchronize = staticmethod(failing)
try:
    torch.accelerator.synchronize()
except IndexError as e:
    print("caught:", e)
"""


def test_torch_accelerator_synchronize_is_torch_neuron_synchronize() -> None:
    """It reports what torch.neuron.synchronize reports (a failed deferred value check), as its exception."""
    proc = _run(_SYNCHRONIZE_REPORTS)
    assert "caught: a deferred value check failed" in proc.stdout, proc.stdout


_GENERATOR = """
g = torch.Generator("neuron")
assert g.device == torch.device("neuron", 0)
assert g.manual_seed(7) is g and g.initial_seed() == 7
state = g.get_state()
g.seed()
g.set_state(state)
assert g.initial_seed() == 7 and g.get_state().equal(state)
assert torch.Generator(device="neuron").device.type == "neuron"
# a random op's seed comes from the generator it is given (as on CUDA), else from torch's default generator
g.manual_seed(3)
a = torch.randn(4, device="neuron", generator=g).cpu()
a2 = torch.randn(4, device="neuron", generator=g).cpu()
g.manual_seed(3)
b = torch.randn(4, device="neuron", generator=g).cpu()
assert a.equal(b) and not a.equal(a2)
torch.manual_seed(3)
c = torch.randn(4, device="neuron").cpu()
torch.manual_seed(3)
assert c.equal(torch.randn(4, device="neuron").cpu())
print("ok")
"""


def test_torch_generator_on_the_device() -> None:
    proc = _run(_GENERATOR)
    assert "ok" in proc.stdout
