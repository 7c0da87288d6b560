"""Warm start through AOTAutograd's cache (neuron_compile/aot_cache.py): a hit skips AOTAutograd's tracing,
loads the executables from our cache and computes what a compile computes; anything that could make the
stored wrappers wrong for this compile (options, our cache directory, grad mode, inputs) misses."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

import neuron_compile.cache as nc
import neuron_compile.cache.key as key_mod
import neuron_compile.compiler as compiler_mod
from neuron_compile import aot_cache
from neuron_compile.errors import NeuronCompileError
from neuron_compile.options import Options
from neuron_compile.stats import STATS


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x))).log_softmax(-1)


class Attention(torch.nn.Module):
    """SDPA, which the backend rewrites before AOTAutograd (its targets must still be cacheable)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


class BatchNormNet(torch.nn.Module):
    """Buffers mutated in the graph (running statistics): AOTAutograd's wrappers write them back."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
        self.bn = torch.nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x)).relu()


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """Private directories for our cache and PyTorch's (where AOTAutograd's entries live)."""
    monkeypatch.setenv("NEURON_COMPILE_CACHE_DIR", str(tmp_path / "neuron"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    key_mod.source_fingerprint.cache_clear()  # a child process keys the source as it is now
    nc.clear_memory()
    STATS.reset()
    counters.clear()
    yield tmp_path
    nc.clear_memory()


def train_step(model, x, options=None):
    """Loss and gradients of one compiled step, after a Dynamo reset (so AOTAutograd runs again)."""
    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    loss = torch.compile(model, backend="neuron", dynamic=False, options=options)(x).sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def eager_step(model, x):
    model.zero_grad(set_to_none=True)
    loss = model(x).sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def aot(event: str) -> int:
    return counters["aot_autograd"][event]


@pytest.mark.parametrize("make", [Net, Attention, BatchNormNet], ids=["mlp", "sdpa", "batchnorm"])
def test_hit_skips_aot_autograd_and_matches_eager(caches, builds, make):
    torch.manual_seed(0)
    model, x = make(), torch.randn(2, 8, 16)
    reference = copy.deepcopy(model)
    first = train_step(model, x)
    assert aot("autograd_cache_saved") == 1 and len(builds) == 2, (dict(counters["aot_autograd"]), builds)
    nc.clear_memory()  # the executables come from disk, as in a new process
    second = train_step(model, x)
    assert aot("autograd_cache_hit") == 1 and len(builds) == 2, (dict(counters["aot_autograd"]), builds)
    assert [g.cache for g in STATS.graphs][-2:] == ["hit", "hit"]
    for got in (first, second):
        expected = eager_step(reference, x)
        torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
        for g, e in zip(got[1], expected[1]):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    for b, e in zip(model.buffers(), reference.buffers()):  # two steps of running statistics each
        torch.testing.assert_close(b, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_hit_reproduces_the_compile_bit_for_bit(caches, builds, dtype):
    """A hit runs the very executables the compile made, behind the wrappers AOTAutograd stored: the
    loss and every gradient are identical, not just close (eager is the other tests' reference)."""
    torch.manual_seed(0)
    model, x = Net().to(dtype), torch.randn(2, 8, 16, dtype=dtype)
    first = train_step(model, x)
    nc.clear_memory()
    second = train_step(model, x)
    assert aot("autograd_cache_hit") == 1 and len(builds) == 2, (dict(counters["aot_autograd"]), builds)
    for a, b in zip([first[0], *first[1]], [second[0], *second[1]]):
        assert a.dtype == dtype and torch.equal(a, b)


def test_inference_hit(caches, builds):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 16)
    with torch.no_grad():
        for _ in range(2):
            torch._dynamo.reset()
            out = torch.compile(model, backend="neuron", dynamic=False)(x)
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    assert aot("autograd_cache_hit") == 1 and len(builds) == 1 and builds[0].endswith("_inference"), builds


@pytest.mark.parametrize(
    "change",
    ["options", "grad_mode", "dtype", "cache_dir"],
)
def test_what_the_wrappers_depend_on_misses(caches, builds, monkeypatch, change):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 16)
    train_step(model, x)
    options = None
    if change == "options":
        options = {"kernels": "off"}
    elif change == "cache_dir":
        monkeypatch.setenv("NEURON_COMPILE_CACHE_DIR", str(caches / "other"))
    if change == "grad_mode":
        with torch.no_grad():
            torch._dynamo.reset()
            torch.compile(model, backend="neuron", dynamic=False)(x)
    elif change == "dtype":
        train_step(model.to(torch.bfloat16), x.to(torch.bfloat16))
    else:
        train_step(model, x, options)
    assert aot("autograd_cache_hit") == 0 and aot("autograd_cache_miss") == 2, dict(counters["aot_autograd"])


def test_backward_that_fails_to_compile_fails_in_backward(caches, monkeypatch):
    """The cache compiles the backward with the forward; its failure still belongs to backward(), so a
    forward under grad that never calls backward() runs (as with AOTAutograd's lazy backward)."""
    real = compiler_mod.build_artifact

    def refuse_backward(gm, example_inputs, opts, name):
        if name.endswith("_backward"):
            raise NeuronCompileError(f"{name}: refused for this test")
        return real(gm, example_inputs, opts, name)

    monkeypatch.setattr(compiler_mod, "build_artifact", refuse_backward)
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 16)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="neuron", dynamic=False)
    for _ in range(2):
        out = compiled(x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
        with pytest.raises(NeuronCompileError, match="_backward: refused for this test"):
            out.sum().backward()
    assert aot("autograd_cache_saved") == 0, dict(counters["aot_autograd"])


def test_entry_gone_from_our_cache_recompiles(caches, builds):
    """AOTAutograd's entry names ours; when ours is gone (cleared, evicted) the hit becomes a compile."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 16)
    train_step(model, x)
    nc.clear_memory()
    nc.DiskStore(nc.resolve_cache_dir(None)).clear()
    loss, _ = train_step(model, x)
    assert aot("autograd_cache_hit") == 0 and aot("autograd_cache_bypass") == 1, dict(counters["aot_autograd"])
    assert len(builds) == 4
    expected = eager_step(model, x)
    torch.testing.assert_close(loss, expected[0], rtol=1e-5, atol=1e-5)
    # The rebuilt entries have the digests AOTAutograd's entry names: the next start hits again.
    nc.clear_memory()
    train_step(model, x)
    assert aot("autograd_cache_hit") == 1 and len(builds) == 4, dict(counters["aot_autograd"])


def test_untrusted_directory_is_not_used(caches, builds):
    """Entries are pickles: a directory others can write is not read (nor written)."""
    shared = caches / "inductor" / "aotautograd"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    assert "writable by other users" in aot_cache.reason_not_used(Options())
    torch.manual_seed(0)
    train_step(Net(), torch.randn(4, 16))
    assert aot("autograd_cache_saved") == 0 and not os.listdir(shared)


def test_switched_off_with_pytorch_cache_switches(caches):
    # torch's own patch(), never monkeypatch: pytest >= 9.1 undoes a setattr on a config module with a
    # delattr, which hides the option for the rest of the process (tests/conftest.py checks for that)
    with torch._functorch.config.patch(enable_autograd_cache=False):
        assert "disabled" in aot_cache.reason_not_used(Options())
    assert aot_cache.reason_not_used(Options(cache=False)) == "the compile cache is off"


_CHILD = """
import json, torch
from torch._dynamo.utils import counters
from neuron_compile.stats import STATS
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
x = torch.randn(4, 16)
loss = torch.compile(model, backend="neuron", dynamic=False)(x).pow(2).sum()
loss.backward()
print(json.dumps({"aot": dict(counters["aot_autograd"]), "graphs": [g.cache for g in STATS.graphs],
                  "values": [loss.item()] + [p.grad.sum().item() for p in model.parameters()]}))
"""


# A forward with value checks (value_checks.py): the embedding's indices and the loss's targets.
_CHILD_CHECKED = """
import json, torch
from torch._dynamo.utils import counters
from neuron_compile.stats import STATS
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(10, 16), torch.nn.Linear(16, 4))
step = torch.compile(lambda ids, t: torch.nn.functional.cross_entropy(model(ids), t), backend="neuron", dynamic=False)
loss = step(torch.tensor([1, 2, 9]), torch.tensor([0, 3, 1]))
loss.backward()
try:
    step(torch.tensor([1, 2, 10]), torch.tensor([0, 3, 1]))
    raised = ""
except IndexError as e:
    raised = str(e)
print(json.dumps({"aot": dict(counters["aot_autograd"]), "graphs": [g.cache for g in STATS.graphs], "raised": raised,
                  "values": [loss.item()] + [p.grad.sum().item() for p in model.parameters()]}))
"""


@pytest.mark.parametrize("child", [_CHILD, _CHILD_CHECKED], ids=["plain", "value-checks"])
def test_fresh_process_hit(caches, tmp_path, child):
    script = tmp_path / "child.py"
    script.write_text(child)

    def run():
        out = subprocess.run(
            [sys.executable, str(script)], env=dict(os.environ), capture_output=True, text=True, check=False
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    assert cold["aot"].get("autograd_cache_saved") == 1 and cold["graphs"] == ["miss", "miss"], cold
    assert warm["aot"].get("autograd_cache_hit") == 1 and warm["graphs"] == ["hit", "hit"], warm
    assert warm["values"] == cold["values"]
    if child is _CHILD_CHECKED:  # the checks come back with the hit
        assert cold["raised"] == warm["raised"] == "index out of range in self", (cold, warm)
