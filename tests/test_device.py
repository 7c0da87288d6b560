"""The ``neuron`` device (neuron_compile/device): tensors that stay on the NeuronCore.

Each case runs on the CPU target (XLA CPU buffers) and, where it says so, on the device simulator's neuron
target (nrt tensors in the fake libnrt); values are compared with the same computation on CPU tensors.
Cheap by construction: small shapes, 3 training steps, one-op graphs shared by the whole process (its table),
the simulator's work (every graph a fake neuronx-cc run) in as few cases as prove it.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import neuron_compile
from neuron_compile import STATS, NeuronUnsupportedOpError, Options
from neuron_compile.device import context, eager

from . import device_sim
from .device_training import Run, call_loss, decoder_batches, hf_loss, train
from .models import BatchNormNet, Decoder
from .test_neuron_target import _STATE_DIR
from .test_training import _rounding_noise


@pytest.fixture
def sim_device(monkeypatch: pytest.MonkeyPatch):
    """The device on the simulated neuron target (fake libnrt and neuronx-cc)."""
    for name, value in {**device_sim.environment(), "NRTSIM_STATE_DIR": _STATE_DIR}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("NEURON_COMPILE_TARGET", "neuron")  # compiled graphs' options as the device's
    context.reset_for_tests(Options.from_user({"target": "neuron"}))
    STATS.reset()
    device_sim.reset_counters()  # the runtime's byte counters start with ours (earlier tests of the process wrote)
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


def _written_and_read(x):
    x = x.clone()
    return x.mul_(x)  # the written tensor is also the argument read


#: (name, f): f(x) on a (4, 6) float32 tensor; the device result must equal the CPU one.
EAGER_CASES = [
    ("transpose_contiguous", lambda x: x.t().contiguous()),
    ("strided_slice_times_two", lambda x: x[1:3, ::2] * 2),
    ("setitem_slice", _setitem_slice),
    ("inplace_through_a_view", _inplace_through_a_view),
    ("written_and_read", _written_and_read),
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


def test_foreach_ops_run_as_one_graph_over_the_whole_list(cpu_device) -> None:
    """An optimizer's ``_foreach_*`` op is one graph and one execution for all its tensors, not one per shape."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(3, generator=g), torch.randn(2, 4, generator=g), torch.randn(5, 1, generator=g)]
    ds = [x.to("neuron") for x in xs]
    before = STATS.eager_ops_run
    torch._foreach_addcmul_(ds, ds, ds, value=0.5)
    norms = torch._foreach_norm(ds)
    assert STATS.eager_ops_run - before == 2
    torch._foreach_addcmul_(xs, xs, xs, value=0.5)
    for got, expected in zip([*ds, *norms], [*xs, *torch._foreach_norm(xs)]):
        assert got.device.type == "neuron"
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-6, atol=1e-6)


def test_value_checks_run_at_the_next_synchronization(cpu_device) -> None:
    """An index out of range raises eager's error where device data is next read (as CUDA's device-side
    assert), naming the op's line; a check that holds costs one byte at that read, not its values."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4)
    on_device = copy.deepcopy(emb).to("neuron")
    out = on_device(torch.tensor([1, 12]).to("neuron"))  # eager raises here
    with pytest.raises(IndexError, match="index out of range in self") as info:
        out.cpu()
    assert any(f"{os.path.basename(__file__)}:" in note for note in info.value.__notes__), info.value.__notes__
    d2h = STATS.device_to_host_bytes
    total = on_device(torch.tensor([1, 2]).to("neuron")).sum().item()
    assert total == pytest.approx(emb(torch.tensor([1, 2])).sum().item(), rel=1e-6)
    assert STATS.device_to_host_bytes - d2h == 4 + 1  # the sum, and one flag for the pending check


def _reference(eager_model, batches, clip: bool = False, loss_of=call_loss, lr: float = 1e-2):
    """Losses of eager AdamW on CPU, and per parameter where its gradient was only rounding noise."""
    opt = torch.optim.AdamW(eager_model.parameters(), lr=lr)
    noise = {name: torch.zeros_like(p, dtype=torch.bool) for name, p in eager_model.named_parameters()}
    losses = []
    for batch in batches:
        loss = loss_of(eager_model, batch)
        loss.backward()
        for name, p in eager_model.named_parameters():
            noise[name] |= _rounding_noise(p.grad)
        if clip:
            torch.nn.utils.clip_grad_norm_(eager_model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, noise


def _assert_trained_as_eager(run: Run, model, eager_model, reference, lr: float = 1e-2) -> None:
    """Losses and parameters as eager's; where a gradient was only rounding noise, AdamW's normalized step may
    go either way (test_training's rule: at most 2 * lr per step there)."""
    losses, noise = reference
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(losses), rtol=1e-4, atol=1e-5)
    for (name, p_e), p_d in zip(eager_model.named_parameters(), model.parameters()):
        p_d, p_e, n = p_d.detach().cpu(), p_e.detach(), noise[name]
        assert not n.any() or (p_d[n] - p_e[n]).abs().max() <= 2 * lr * len(losses) * 1.01, name
        torch.testing.assert_close(p_d[~n], p_e[~n], rtol=1e-4, atol=1e-5, msg=f"parameter {name}")


def _assert_moves_only_its_batch(run: Run, batch: tuple[torch.Tensor, ...]) -> None:
    """Steady state (the first step also moves the model): at most the batch, the loss and 1 KiB cross."""
    batch_bytes = sum(t.numel() * t.element_size() for t in batch)
    for h2d, d2h in run.crossing[1:]:
        assert h2d + d2h <= batch_bytes + 4 + 1024, run.crossing


def _released() -> None:
    """Let go of what still holds device memory once the caller deleted its names: compiled code (it holds the
    parameters it was traced with) and value checks not yet run."""
    torch._dynamo.reset()
    gc.collect()
    torch.neuron.synchronize()


@pytest.mark.parametrize(
    "optimizer,clip", [("compiled", False), ("eager", True)], ids=["compiled_step", "eager_adamw_clip"]
)
def test_a_decoder_trains_on_the_device_as_in_eager_and_moves_only_its_batch(cpu_device, optimizer, clip) -> None:
    """Compiled model with a compiled AdamW step, or eager AdamW with clip_grad_norm_ op by op on the device;
    memory_allocated() back at its start once the model and the optimizer are deleted."""
    _released()  # what earlier tests left for the garbage collector
    start = torch.neuron.memory_allocated()
    batches = decoder_batches(3)
    torch.manual_seed(0)
    eager_model = Decoder()
    model = copy.deepcopy(eager_model).to("neuron")
    run, opt = train(model, batches, optimizer, clip)
    _assert_trained_as_eager(run, model, eager_model, _reference(eager_model, batches, clip))
    _assert_moves_only_its_batch(run, batches[0])
    assert torch.neuron.memory_allocated() > start
    del model, opt
    _released()
    assert torch.neuron.memory_allocated() == start


def test_a_batchnorm_cnn_trains_on_the_device(cpu_device) -> None:
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]

    class Loss(BatchNormNet):
        def forward(self, x, y):
            return F.cross_entropy(super().forward(x), y)

    torch.manual_seed(0)
    eager_model = Loss()
    model = copy.deepcopy(eager_model).to("neuron")
    run, _ = train(model, batches, "eager")
    _assert_trained_as_eager(run, model, eager_model, _reference(eager_model, batches))
    for (name, b_e), b_d in zip(eager_model.named_buffers(), model.buffers()):
        torch.testing.assert_close(b_d.cpu(), b_e, rtol=1e-4, atol=1e-5, msg=f"buffer {name}")


_SECOND_PROCESS = """
import json, os
import neuron_compile.cache.key as K
# Key as the test process did: other work may edit the package's source (hashed into every key) between the
# two processes; what is tested here is what else in a key could differ between processes.
K.source_fingerprint = lambda: os.environ["NC_TEST_SOURCE_FINGERPRINT"]
import torch
from neuron_compile import STATS
from tests import device_sim
from tests.device_training import decoder_batches, train
from tests.models import Decoder
torch.manual_seed(0)
run, _ = train(Decoder().to("neuron"), decoder_batches(3), "compiled", clip=True)
print(json.dumps({"losses": run.losses, "compiles": device_sim.compiler_invocations(),
                  "graphs": [g.cache for g in STATS.graphs], "eager_ops_run": STATS.eager_ops_run}))
"""


def test_a_decoder_trains_on_the_simulated_neuroncore_and_a_second_process_compiles_nothing(
    sim_device, tmp_path
) -> None:
    """On the neuron target (fake neuronx-cc and libnrt): the compiled model, a compiled AdamW step and
    clip_grad_norm_'s eager ops train as eager does, moving only the batch; every byte the runtime received
    was counted. Then a second process with the same compile cache runs the same training without running
    the compiler once, for the compiled graphs and the eager ops alike."""
    _released()  # what earlier tests left for the garbage collector
    start = torch.neuron.memory_allocated()
    runtime_start = sim_device.buffers.memory_stats(0)[0]
    batches = decoder_batches(3)
    torch.manual_seed(0)
    eager_model = Decoder()
    model = copy.deepcopy(eager_model).to("neuron")
    run, opt = train(model, batches, "compiled", clip=True)
    _assert_trained_as_eager(run, model, eager_model, _reference(eager_model, batches, clip=True))
    _assert_moves_only_its_batch(run, batches[0])
    assert device_sim.counters()["bytes_written"] == STATS.host_to_device_bytes, "every byte was counted"
    # device memory: ours back at its start; the runtime's count also holds the buffers of the graphs it
    # loaded (released with the compiled code), so it grew by more and gave back at least as much
    in_use, runtime_in_use = torch.neuron.memory_allocated(), sim_device.buffers.memory_stats(0)[0]
    assert in_use > start and runtime_in_use - runtime_start >= in_use - start
    del model, opt
    _released()
    assert torch.neuron.memory_allocated() == start
    assert sim_device.buffers.memory_stats(0)[0] <= runtime_in_use - (in_use - start)

    env = {
        **os.environ,
        **device_sim.environment(tmp_path / "sim"),  # its own compile log: what the second process compiled
        "NC_TEST_SOURCE_FINGERPRINT": neuron_compile.cache.key.source_fingerprint(),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(device_sim.REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _SECOND_PROCESS], env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    second = json.loads(proc.stdout.strip().splitlines()[-1])
    assert second["compiles"] == 0 and "miss" not in second["graphs"], second
    assert second["eager_ops_run"] > 0 and second["losses"] == run.losses, (second, run.losses)


def test_the_simulated_runtime_and_the_device_agree_on_memory(sim_device, monkeypatch) -> None:
    """The device's limit is the runtime's (nrt_get_vnc_memory_stats), the two count a tensor alike, and an
    allocation past the limit is the device's OutOfMemoryError whether the device or the runtime refuses it."""
    used, default_limit = sim_device.buffers.memory_stats(0)
    assert default_limit == 24 * 2**30  # a logical core of a Trn2 at LNC=2
    limit = used + 2**20
    monkeypatch.setenv("NRTSIM_HBM_BYTES", str(limit))
    context.reset_for_tests(Options.from_user({"target": "neuron"}))
    dev = context.device()
    x = torch.empty(1000, device="neuron")
    assert dev.memory_limit == limit and dev.buffers.memory_stats(0) == (used + 4000, limit)
    with pytest.raises(torch.neuron.OutOfMemoryError, match=f"tried to allocate .* a limit of .* \\({limit:,} bytes"):
        torch.empty(limit // 4 + 1, device="neuron")  # refused by the device's own count
    # the runtime's memory also holds loaded graphs' buffers, which the device does not count: past the
    # runtime's free memory, the runtime refuses (NRT_RESOURCE), reported as the same error
    context.reset_for_tests(Options.from_user({"target": "neuron", "device_memory_limit": 2**40}))
    with pytest.raises(torch.neuron.OutOfMemoryError, match="Neuron runtime could not allocate 1,200,000 bytes"):
        torch.empty(300_000, device="neuron")
    del x
    assert context.device().buffers.memory_stats(0)[0] == used


def test_a_hugging_face_llama_trains_on_the_device_as_in_eager(cpu_device) -> None:
    """A tiny LlamaForCausalLM moved to the device: compiled, with eager AdamW, 3 steps as eager on CPU."""
    from .model_zoo import llama

    case = llama()
    batches = [(case.inputs["input_ids"],)] * 3
    eager_model = case.model
    model = copy.deepcopy(eager_model).to("neuron")
    run, _ = train(model, batches, "eager", loss_of=hf_loss)
    _assert_trained_as_eager(run, model, eager_model, _reference(eager_model, batches, loss_of=hf_loss))
    _assert_moves_only_its_batch(run, (batches[0][0], batches[0][0]))  # input_ids, and the same as labels


def test_greedy_generate_with_a_static_cache_moves_only_what_the_user_reads(cpu_device) -> None:
    """Hugging Face's greedy generate() of the tiny Llama on the device with a static KV cache (its prefill op
    by op, its decode steps compiled by transformers with backend "neuron"): the tokens and logits of eager
    on CPU; per token nothing goes in and 2 bytes come out (transformers' "all sequences finished?" read and
    the flag of the value checks pending); the cache stays on the device; reading the logits moves exactly
    their bytes."""
    from transformers import StoppingCriteria

    from .model_zoo import llama

    model = llama().model.eval()
    ids = torch.randint(3, 64, (1, 5), generator=torch.Generator().manual_seed(4))
    options = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    expected = model.generate(ids, cache_implementation="static", **options)
    marks = []

    class Mark(StoppingCriteria):
        """Called once per new token: the counters there (it reads nothing from the device)."""

        def __call__(self, input_ids, scores, **kwargs):
            marks.append((STATS.host_to_device_bytes, STATS.device_to_host_bytes))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    on_device = copy.deepcopy(model).to("neuron")
    out = on_device.generate(ids.to("neuron"), cache_implementation="static", stopping_criteria=[Mark()], **options)
    per_token = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:])]
    assert len(per_token) == 5 and all(crossing == (0, 2) for crossing in per_token), per_token
    cache = out.past_key_values.layers
    assert all(layer.keys.device.type == layer.values.device.type == "neuron" for layer in cache)
    cache_bytes = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in cache)
    assert marks[-1][1] - marks[0][1] < cache_bytes // 10
    assert out.sequences.cpu().equal(expected.sequences)
    logits = torch.stack(out.logits)
    d2h = STATS.device_to_host_bytes
    torch.testing.assert_close(logits.cpu(), torch.stack(expected.logits), rtol=1e-5, atol=1e-5)
    assert STATS.device_to_host_bytes - d2h == logits.numel() * logits.element_size()


_TAKEN = """
import sys, types
import torch
# what TorchNeuron's torch_neuronx does when it is imported: PrivateUse1 named 'neuron', its module torch.neuron
fake = types.ModuleType("torch_neuronx")
fake.is_available, fake.device_count = (lambda: False), (lambda: 0)
torch.utils.rename_privateuse1_backend("neuron")
torch._register_device_module("neuron", fake)
sys.modules["torch_neuronx"] = fake
import neuron_compile
from neuron_compile import device, doctor
x = torch.randn(3)
out = torch.compile(lambda t: t * 2 + 1, backend="neuron")(x)
assert torch.equal(out, x * 2 + 1) and not device.is_registered()
print(device.NOT_REGISTERED)
print(doctor._neuron_device())
"""


def test_where_another_library_holds_privateuse1_nothing_is_registered_and_the_doctor_says_whose() -> None:
    from neuron_compile import doctor

    assert doctor._neuron_device().startswith("neuron_compile's")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(device_sim.REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    env["NEURON_COMPILE_TARGET"], env["NEURON_COMPILE_DEVICE"] = "cpu", "1"
    proc = subprocess.run([sys.executable, "-c", _TAKEN], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    not_registered, row = proc.stdout.strip().splitlines()[-2:]
    assert "already registered as 'neuron' by another library" in not_registered
    assert "neuron_compile: PrivateUse1 is already registered" in proc.stderr  # said once, on the logger
    assert row.startswith("TorchNeuron's torch_neuronx's: PrivateUse1 is registered as 'neuron'"), row


_EAGER_ONLY = """
import torch, neuron_compile
x = torch.randn(4, 3, device="neuron")
print((x * 2).sum().item())
"""


def test_precompile_collect_records_eager_ops_of_a_script_that_compiles_nothing(tmp_path) -> None:
    """``neuron-compile precompile collect`` of a script whose only graphs are the device's one-op graphs: the
    recorder starts at the first one (not only at a backend compile), so the fleet gets them precompiled."""
    manifest = tmp_path / "manifest.json"
    env = {**os.environ, "NEURON_COMPILE_TARGET": "cpu", "NEURON_COMPILE_DEVICE": "1"}
    env["NEURON_COMPILE_CACHE_DIR"], env["NEURON_COMPILE_PRECOMPILE_MANIFEST"] = str(tmp_path / "cache"), str(manifest)
    proc = subprocess.run([sys.executable, "-c", _EAGER_ONLY], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    graphs = json.loads(manifest.read_text())["graphs"]
    names = sorted(g["name"] for g in (graphs.values() if isinstance(graphs, dict) else graphs))
    assert any(n.startswith("eager_aten_mul") for n in names) and len(names) >= 2, names
