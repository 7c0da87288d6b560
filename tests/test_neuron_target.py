"""The neuron target end to end on the device simulator (``tests/device_sim``): neuronx-cc's command line,
NEFFs run through libnrt (``runtime/libnrt.py``), residency of unchanged inputs, the compile cache across
processes, and the error a user gets for each runtime status.

What this proves and what it cannot: docs/trainium.md ("What the simulator proves").
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from neuron_compile import STATS, NeuronCompileError, NeuronRuntimeError
from neuron_compile.runtime import libnrt

from . import device_sim
from .models import MLP, BatchNormNet
from .test_training import CASES, run_and_compare

NEURON = {"target": "neuron"}
#: This process's simulated machine: its own core locks and compile log (pytest-xdist workers are two
#: processes, which on one real machine would hold different cores).
_STATE_DIR = tempfile.mkdtemp(prefix="neuron_compile_sim_state_")


@pytest.fixture
def simulator(monkeypatch: pytest.MonkeyPatch):
    """The simulator switched on for this process, as ``python -m tests.device_sim`` does for a command."""
    for name, value in {**device_sim.environment(), "NRTSIM_STATE_DIR": _STATE_DIR}.items():
        monkeypatch.setenv(name, value)
    device_sim.reset_counters() if libnrt._RUNTIME is not None else None
    STATS.reset()
    yield device_sim


def _neuron(model: torch.nn.Module, **options) -> torch.nn.Module:
    return torch.compile(model, backend="neuron", dynamic=False, options={**NEURON, **options})


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.name in ("mlp", "batchnorm", "transformer")], ids=lambda c: c.name
)
def test_training_on_the_neuron_target_matches_eager_float32(simulator, case) -> None:
    """Forward and backward NEFFs through libnrt, 3 steps: losses, gradients, parameters and buffers (BatchNorm's
    running statistics, mutated inputs) as eager's, with the CPU target's tolerances. The transformer is the
    demo's model: int64 token indices into embeddings, attention, GELU, layer norm, cross-entropy."""
    run_and_compare(case, "sgd", torch.float32, compile_fn=_neuron)
    assert STATS.device_executions >= 6 and {g.kind for g in STATS.graphs} >= {"forward", "backward"}


@pytest.mark.parametrize("case", [c for c in CASES if c.name in ("mlp", "transformer")], ids=lambda c: c.name)
def test_training_on_the_neuron_target_matches_eager_bfloat16(simulator, case) -> None:
    run_and_compare(case, "sgd", torch.bfloat16, compile_fn=_neuron)


def _write_head_weight_data_copy(model, x):
    model.head.weight.data.copy_(torch.randn_like(model.head.weight))  # an EMA / target-network update


def _write_head_weight_data_slice(model, x):
    model.head.weight.data[:] = 0.25


def _write_head_weight_through_numpy(model, x):
    model.head.weight.detach().numpy()[:] *= -0.5


def _write_fc1_bias_data_copy(model, x):
    model.fc1.bias.data.copy_(torch.linspace(-1, 1, model.fc1.bias.numel()))


def _refill_the_input_buffer_through_numpy(model, x):
    x.numpy()[:] = torch.randn(x.shape).numpy()  # a loader refilling its pinned buffer in place


#: Writes that torch does not count in the tensor's version counter (issue 46's drills): each one ran the
#: compiled model on stale values when unchanged-looking inputs were kept on the core.
UNCOUNTED_WRITES = [
    _write_head_weight_data_copy,
    _write_head_weight_data_slice,
    _write_head_weight_through_numpy,
    _write_fc1_bias_data_copy,
    _refill_the_input_buffer_through_numpy,
]


@pytest.mark.parametrize("write", UNCOUNTED_WRITES, ids=lambda f: f.__name__.lstrip("_"))
def test_a_write_torch_does_not_count_is_seen_by_the_next_call(simulator, write) -> None:
    torch.manual_seed(0)
    model = MLP().eval()
    compiled = _neuron(model)
    x = torch.randn(8, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
        write(model, x)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD", "Adagrad"])
def test_fused_optimizers_train_as_in_eager(simulator, name: str) -> None:
    """``fused=True`` optimizers update parameters on CPU without bumping their version counters."""
    torch.manual_seed(0)
    eager = MLP()
    model = MLP()
    model.load_state_dict(eager.state_dict())
    compiled = _neuron(model)
    kwargs = {"lr": 0.05, "fused": True, **({"momentum": 0.9} if name == "SGD" else {})}
    opt_e = getattr(torch.optim, name)(eager.parameters(), **kwargs)
    opt_c = getattr(torch.optim, name)(model.parameters(), **kwargs)
    for step in range(4):
        x, target = torch.randn(8, 16), torch.randn(8, 4)
        losses = []
        for m, opt in ((eager, opt_e), (compiled, opt_c)):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), target)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5, msg=f"{name} step {step} loss")
    for (n, p_e), p_c in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(p_c, p_e, rtol=1e-4, atol=1e-5, msg=f"{name} parameter {n}")


@pytest.mark.parametrize("residency", ["off", "version_counter"])
def test_inference_mode_runs(simulator, residency: str) -> None:
    torch.manual_seed(0)
    model = MLP().eval()
    compiled = _neuron(model, input_residency=residency)
    x = torch.randn(8, 16)
    with torch.inference_mode():
        for _ in range(2):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
        model.head.weight.mul_(0.5)  # inference tensors count no version: written again anyway
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def test_host_inputs_are_written_at_every_call_by_default(simulator) -> None:
    torch.manual_seed(0)
    model = MLP().eval()
    compiled = _neuron(model)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    batch = torch.randn(8, 16)
    with torch.no_grad():
        for _ in range(3):
            compiled(batch)
    # the random-seed operand (2 x int32) of a graph without random ops is the backend's own constant: once
    assert STATS.device_bytes_written == 3 * (param_bytes + batch.numel() * 4) + 8
    assert STATS.device_bytes_kept_resident == 2 * 8
    assert simulator.counters()["bytes_written"] == STATS.device_bytes_written  # the runtime's own count


def test_unchanged_inputs_stay_resident_under_the_version_counter_contract(simulator) -> None:
    """``input_residency="version_counter"``: parameters are written to the NeuronCore once; the batch at every
    call; after an in-place update (which bumps the version counter) the changed parameter is written again."""
    torch.manual_seed(0)
    model = MLP().eval()
    compiled = _neuron(model, input_residency="version_counter")
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    batches = [torch.randn(8, 16) for _ in range(4)]
    with torch.no_grad():
        for x in batches:
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    batch_bytes = batches[0].numel() * 4
    assert STATS.device_executions == 4
    assert STATS.device_bytes_written == param_bytes + 4 * batch_bytes + 8, "parameters written more than once"
    assert STATS.device_bytes_kept_resident == 3 * (param_bytes + 8)
    assert simulator.counters()["bytes_written"] == STATS.device_bytes_written  # the runtime's own count
    with torch.no_grad():
        model.head.weight.mul_(0.5)
        before = STATS.device_bytes_written
        torch.testing.assert_close(compiled(batches[0]), model(batches[0]), rtol=1e-4, atol=1e-5)
    assert STATS.device_bytes_written - before == model.head.weight.numel() * 4 + batch_bytes


def test_status_names_are_nrt_status_h_names() -> None:
    """Every status of the runtime's header has its own entry, named as the header names it."""
    for name, code in device_sim.STATUS.items():
        assert libnrt.status_name(code) == name, (code, libnrt.status_name(code))
        assert code == 0 or libnrt.STATUS[code][1], f"{name} has no advice"


def test_a_runtime_without_the_logical_core_calls_counts_its_cores(simulator) -> None:
    """Runtimes before the logical-core API have only ``nrt_get_{visible,total}_nc_count``."""
    old = libnrt.library_info(str(device_sim.build_libnrt(old_runtime=True)))
    current = libnrt.library_info(str(device_sim.build_libnrt()))
    assert (old["visible_cores"], old["total_cores"]) == (current["visible_cores"], current["total_cores"])
    assert old["total_cores"] > 0


def test_one_load_per_neff_and_core_and_unload_with_the_last_graph(simulator) -> None:
    import gc

    gc.collect()  # graphs of earlier tests, dropped by their Dynamo reset, unload now
    before = simulator.counters()
    torch.manual_seed(0)
    x = torch.randn(5, 16)  # a batch size no other test uses: a NEFF not loaded yet
    models = [MLP().eval() for _ in range(2)]  # same graph, same NEFF: one load shared by both
    compiled = [_neuron(m) for m in models]
    with torch.no_grad():
        for c, m in zip(compiled, models):
            torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-5)
    during = simulator.counters()
    assert during["loads"] - before["loads"] == 1 and during["live_models"] == before["live_models"] + 1, during
    del compiled, c
    torch._dynamo.reset()
    gc.collect()
    after = simulator.counters()
    assert after["unloads"] - before["unloads"] == 1, after
    assert after["live_models"] == before["live_models"] and after["live_tensors"] == before["live_tensors"], after


_TRAIN_SCRIPT = textwrap.dedent(
    """
    import torch
    from neuron_compile import STATS
    from tests.models import TinyLM
    torch.manual_seed(0)
    model = TinyLM(n_layers=1)
    compiled = torch.compile(model, backend="neuron", dynamic=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    idx = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        opt.zero_grad(); loss = compiled(idx, torch.roll(idx, -1, 1)); loss.backward(); opt.step()
    print("TARGET", sorted({g.cache for g in STATS.graphs}), STATS.device_executions, loss.item())
    """
)


def test_second_process_compiles_nothing_and_auto_picks_the_simulated_device(tmp_path) -> None:
    """No target option: with the Neuron compiler and runtime found, "auto" is the neuron target. A second
    process with the same cache invokes the compiler zero times (the simulator's compile log)."""
    state = tmp_path / "state"
    state.mkdir()
    env = {
        **os.environ,
        **device_sim.environment(),
        "NRTSIM_STATE_DIR": str(state),
        "NEURON_COMPILE_CACHE_DIR": str(tmp_path / "cache"),
        "NEURON_COMPILE_TARGET": "",
    }
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", _TRAIN_SCRIPT],
            env=env,
            cwd=device_sim.REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append((proc.stdout.split("TARGET", 1)[1].split(), device_sim.compiler_invocations(str(state))))
    (first, compiles_first), (second, compiles_second) = runs
    assert compiles_first >= 2 and int(first[-2]) == 4, (first, compiles_first)  # forward + backward NEFFs ran
    assert compiles_second == compiles_first, "the second process invoked neuronx-cc"
    assert first[-1] == second[-1]  # the same losses


def test_auto_target_without_the_neuron_stack_is_cpu() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("NEURON_COMPILE_LIBNRT", "NEURON_COMPILE_TARGET")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if "device_sim" not in p)
    code = "from neuron_compile import Options; print(Options.from_user(None).target)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "cpu", out.stderr


def _status_call(status: int) -> str:
    """The libnrt call a status comes from for a user: loading a NEFF, or executing it."""
    return "nrt_load" if status in (2, 4, 9, 10, 11) else "nrt_execute"


@pytest.mark.parametrize("status", sorted(s for s in libnrt.STATUS if s != 0), ids=libnrt.status_name)
def test_every_runtime_status_gives_a_named_error_with_advice(simulator, status: int) -> None:
    torch.manual_seed(0)
    model = MLP().eval()
    compiled = _neuron(model)  # the compile cache serves every status's graph after the first
    x = torch.randn(8, 16)
    with torch.no_grad():
        compiled(x)  # compiled and loaded
        if _status_call(status) == "nrt_load":
            torch._dynamo.reset()
            import gc

            del compiled
            gc.collect()  # the NEFF unloaded: the next compiled function loads it again
            compiled = _neuron(model)
        simulator.inject(_status_call(status), status, 1)
        with pytest.raises(NeuronRuntimeError) as info:
            compiled(x)
    err = info.value
    name, advice = libnrt.STATUS[status]
    assert err.status == status and err.call == _status_call(status)
    assert name in str(err) and advice.split(":")[0] in str(err), str(err)
    with torch.no_grad():  # nothing is left broken: the next call runs
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_neff_whose_tensors_differ_from_the_module_fails_loudly_with_both_lists(simulator, monkeypatch) -> None:
    """A compiler that names the NEFF's tensors otherwise than the module asks (here: the names handed to it
    changed): the load compares the runtime's list with the module's and says both."""
    from neuron_compile.runtime import jax_adapter

    real = jax_adapter.neff_module
    monkeypatch.setattr(jax_adapter, "neff_module", lambda text, ins, outs: real(text, [f"x{n}" for n in ins], outs))
    compiled = _neuron(MLP().eval(), cache=False)
    with (
        torch.no_grad(),
        pytest.raises(NeuronRuntimeError, match=r"(?s)The runtime reports:.*xinput\d.*The module declares.*input\d"),
    ):
        compiled(torch.randn(3, 16))  # a batch size no other test uses: a NEFF not loaded yet


def test_a_core_held_by_another_process_is_busy(tmp_path) -> None:
    """Two processes on one core: the second gets the runtime's busy status, with NEURON_RT_VISIBLE_CORES
    as the fix (each process its own core)."""
    env = {
        **os.environ,
        **device_sim.environment(),
        "NRTSIM_STATE_DIR": str(tmp_path),
        "NEURON_RT_VISIBLE_CORES": "0",
        "NEURON_COMPILE_CACHE_DIR": str(tmp_path / "cache"),
    }
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import torch, sys; m = torch.compile(torch.nn.Linear(4, 4), backend='neuron', "
            "options={'target': 'neuron'}); m(torch.randn(2, 4)); print('held', flush=True); sys.stdin.read()",
        ],
        env=env,
        cwd=device_sim.REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        code = (
            "import torch\ntry:\n    torch.compile(torch.nn.Linear(4, 4), backend='neuron', options={'target': 'neuron'})"
            "(torch.randn(2, 4))\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=device_sim.REPO_ROOT, capture_output=True, text=True, timeout=300
        )
    finally:
        holder.communicate("", timeout=60)
    assert "NeuronRuntimeError" in out.stdout and "NEURON_RT_VISIBLE_CORES" in out.stdout, (
        out.stdout + out.stderr[-2000:]
    )


def test_a_neff_for_another_logical_core_size_is_refused_by_the_runtime(simulator) -> None:
    """The option lnc reaches neuronx-cc's --lnc; a NEFF whose LNC is not the runtime's
    (NEURON_LOGICAL_NC_CONFIG, 2 here) is refused at load, and the error names both sizes and the fix, not the
    cache (issue 46 item 12)."""
    from neuron_compile.runtime.neuron import COMPILER_RUNS

    COMPILER_RUNS.clear()
    with (
        torch.no_grad(),
        pytest.raises(
            NeuronRuntimeError, match=r"(?s)NRT_INVALID.*compiled for logical-core size LNC 1.*runtime runs with LNC 2"
        ) as info,
    ):
        _neuron(BatchNormNet().eval(), cache=False, lnc=1)(torch.randn(4, 12))
    assert "options={'lnc': 2}" in str(info.value) and "cache clear" not in str(info.value)
    command = COMPILER_RUNS[-1].command
    assert command[command.index("--lnc") + 1] == "1"


def test_compiler_version_is_its_version_line(simulator) -> None:
    """neuronx-cc --version prints its version line first, then the Python and NumPy it runs on: the cache key
    takes the compiler's line."""
    from neuron_compile.runtime.neuron import compiler_version

    assert compiler_version().startswith("NeuronX Compiler version 2.99"), compiler_version()


def test_without_libnrt_the_error_says_what_to_install(monkeypatch, tmp_path) -> None:
    """A NEFF compiled (simulated neuronx-cc) but no runtime library anywhere: the call says what to do."""
    for name, value in device_sim.environment().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(libnrt.LIBRARY_ENV, str(tmp_path / "missing" / "libnrt.so.1"))
    monkeypatch.setattr(libnrt, "_RUNTIME", None)
    with torch.no_grad(), pytest.raises(NeuronCompileError, match="aws-neuronx-runtime-lib"):
        _neuron(MLP().eval(), cache=False)(torch.randn(8, 16))


@pytest.mark.parametrize("where", ["LD_LIBRARY_PATH", "loader cache", "nowhere"])
def test_library_path_finds_what_dlopen_would_without_running_ldconfig(monkeypatch, tmp_path, where) -> None:
    """The loader's search (LD_LIBRARY_PATH, then /etc/ld.so.cache) is read directly, as dlopen reads it:
    ``ctypes.util.find_library`` (``ldconfig -p``, then a C compiler) never runs; NEURON_COMPILE_LIBNRT wins."""
    import ctypes.util

    monkeypatch.setattr(ctypes.util, "find_library", lambda name: pytest.fail("find_library ran"))
    monkeypatch.setattr(libnrt, "DEFAULT_LIBRARY", str(tmp_path / "absent" / "libnrt.so.1"))
    monkeypatch.delenv(libnrt.LIBRARY_ENV, raising=False)
    lib_dir, cache = tmp_path / "lib", tmp_path / "ld.so.cache"
    lib_dir.mkdir()
    cache.write_bytes(b"glibc-ld.so.cache1.1\0libc.so.6\0/lib/libc.so.6\0")
    monkeypatch.setattr(libnrt, "LOADER_CACHE", str(cache))
    monkeypatch.setenv("LD_LIBRARY_PATH", f"/nonexistent:{lib_dir}")
    expected = None
    if where == "LD_LIBRARY_PATH":
        (lib_dir / "libnrt.so.1").write_bytes(b"")
        expected = str(lib_dir / "libnrt.so.1")
    elif where == "loader cache":
        cache.write_bytes(cache.read_bytes() + b"libnrt.so.1\0/opt/x/libnrt.so.1\0")
        expected = "libnrt.so.1"
    assert libnrt.library_path() == expected
    monkeypatch.setenv(libnrt.LIBRARY_ENV, "/explicit/libnrt.so.1")
    assert libnrt.library_path() == "/explicit/libnrt.so.1"


# -- collectives inside a graph, across 2 ranks (each its own process and NeuronCore) ---------------------------
_RANK_SCRIPT = textwrap.dedent(
    """
    import copy, datetime, json, sys
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    from neuron_compile import STATS
    from tests import device_sim

    torch.set_num_threads(1)  # 2 shared cores
    # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from the environment; a rank left waiting fails in 2 minutes
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    NEURON = {"target": "neuron"}


    def all_reduce_in_graph(x):
        return fc.all_reduce(x * 2, "sum", dist.group.WORLD) + 1


    class AllReduce(torch.autograd.Function):  # Megatron's "g": sum in the forward, sum of the gradients back
        @staticmethod
        def forward(ctx, x):
            return fc.all_reduce(x, "sum", dist.group.WORLD)

        @staticmethod
        def backward(ctx, grad):
            return fc.all_reduce(grad, "sum", dist.group.WORLD)


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

        def forward(self, x, y):
            return (self.down(AllReduce.apply(self.up(x)).tanh()) - y).square().mean()


    def sgd_steps(model, loss_of, batches):
        # SGD steps of a compiled copy of the model and of an eager one: losses, and each parameter (its local
        # shard for a DTensor) after the steps
        runs = {}
        for name in ("compiled", "eager"):
            m = copy.deepcopy(model)
            f = torch.compile(m, backend="neuron", options=NEURON) if name == "compiled" else m
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            losses = []
            for batch in batches:
                opt.zero_grad()
                loss = loss_of(f, batch)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            params = [getattr(p, "to_local", p.detach)().detach().flatten().tolist() for p in m.parameters()]
            runs[name] = {"losses": losses, "params": params}
        return runs


    def training():
        torch.manual_seed(0)  # the same weights on every rank, a batch of each rank's own
        model = Net()
        torch.manual_seed(1 + rank)
        batches = [(torch.randn(4, 8), torch.randn(4, 4)) for _ in range(2)]
        return sgd_steps(model, lambda f, batch: f(*batch), batches)


    def dtensor_tp():
        # Megatron's MLP split over the 2 ranks (DTensor parameters, the all_reduce inside the compiled graphs):
        # the compiled graphs take each parameter's local shard, which SGD updates in place between steps
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        base = torch.nn.Sequential()
        base.up, base.act, base.down = torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8)
        model = parallelize_module(base, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        torch.manual_seed(1)  # the same batches on every rank, as tensor parallelism has
        batches = [torch.randn(4, 8) for _ in range(2)]
        return sgd_steps(model, lambda f, x: f(x).square().mean(), batches)


    report = {"rank": rank, "cases": {}}
    for case in sys.argv[1:]:
        STATS.reset()
        torch._dynamo.reset()
        try:
            if case in ("training", "dtensor_tp"):
                value = training() if case == "training" else dtensor_tp()
            else:
                if case == "all_reduce_in_graph":
                    fn = all_reduce_in_graph
                else:
                    from tests.test_distributed import COLLECTIVE_CASES
                    fn = COLLECTIVE_CASES[case]
                torch.manual_seed(rank)  # different data per rank: a collective run as the identity shows
                x = torch.randn(4, 4)
                compiled = torch.compile(fn, backend="neuron", fullgraph=True, options=NEURON)(x)
                value = {"compiled": compiled.tolist(), "eager": fn(x).tolist()}
            value["graphs"] = sorted(g.kind for g in STATS.graphs)
            value["device_executions"] = STATS.device_executions
        except Exception as e:
            value = {"error": f"{type(e).__name__}: {e}"}
        report["cases"][case] = value
    report["counters"] = device_sim.counters()
    print("REPORT " + json.dumps(report), flush=True)
    dist.destroy_process_group()
    """
)


def _run_two_ranks(tmp_path, *cases: str, timeout: float = 300) -> list[dict]:
    """Each of 2 ranks in its own process, on its own simulated NeuronCore (``NEURON_RT_VISIBLE_CORES=<rank>``),
    with a gloo process group as a real multi-process job has, running ``_RANK_SCRIPT`` on ``cases``; their
    reports in rank order."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = tmp_path / "state"
    state.mkdir()
    base = {**os.environ, **device_sim.environment(state), "NRTSIM_STATE_DIR": str(state),
            "NEURON_COMPILE_CACHE_DIR": str(tmp_path / "cache"), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "WORLD_SIZE": "2"}  # fmt: skip
    procs = []
    for rank in range(2):
        env = {**base, "RANK": str(rank), "NEURON_RT_VISIBLE_CORES": str(rank)}
        procs.append(subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT, *cases], cwd=device_sim.REPO_ROOT, env=env,
                                      text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    reports = []
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and "REPORT " in out, (
            f"rank {rank} (exit {p.returncode}):\n{out[-2000:]}\n{err[-6000:]}"
        )
        reports.append(json.loads(out.split("REPORT ", 1)[1]))
    for rank, report in enumerate(reports):
        failed = {case: v["error"] for case, v in report["cases"].items() if "error" in v}
        assert not failed, f"rank {rank}: {failed}\n{outputs[rank][1][-6000:]}"
    return reports


def _assert_trained_as_eager(run: dict, rank: int) -> None:
    """A rank's ``sgd_steps`` report: losses and parameters as eager's, from a forward and a backward graph run
    twice each on the device."""
    torch.testing.assert_close(run["compiled"]["losses"], run["eager"]["losses"], rtol=1e-5, atol=1e-6)
    for i, (a, b) in enumerate(zip(run["compiled"]["params"], run["eager"]["params"])):
        torch.testing.assert_close(
            torch.tensor(a),
            torch.tensor(b),
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m: f"rank {rank}: parameter {i} after 2 steps: {m}",
        )
    assert run["graphs"] == ["backward", "forward"] and run["device_executions"] == 4, run


def test_an_all_reduce_inside_the_graph_runs_on_two_ranks_through_nrt_load_collectives(tmp_path) -> None:
    """Issue acceptance: a 2-rank run with an all_reduce inside the graph goes through nrt_load_collectives and
    matches eager, forward (``all_reduce(x * 2) + 1``) and a training step (an all_reduce in the forward graph
    and one in the backward graph, 2 SGD steps: losses and parameters). The simulated NeuronCores run the
    collectives across the two processes through gloo (tests/device_sim/collectives.py)."""
    reports = _run_two_ranks(tmp_path, "all_reduce_in_graph", "training")
    for rank, report in enumerate(reports):
        case = report["cases"]["all_reduce_in_graph"]
        torch.testing.assert_close(
            torch.tensor(case["compiled"]),
            torch.tensor(case["eager"]),
            rtol=1e-6,
            atol=1e-6,
            msg=lambda m: f"rank {rank}: all_reduce in the graph: {m}",
        )
        assert case["device_executions"] == 1 and case["graphs"] == ["inference"], case
        _assert_trained_as_eager(report["cases"]["training"], rank)
        # the forward NEFF of the first case, the training's forward and backward NEFFs: all with collectives
        assert report["counters"]["collective_loads"] >= 3, report["counters"]
    # the ranks had different data: the all_reduce made their results equal
    assert (
        reports[0]["cases"]["all_reduce_in_graph"]["compiled"] == reports[1]["cases"]["all_reduce_in_graph"]["compiled"]
    )


def test_dtensor_tensor_parallel_training_on_two_ranks_on_the_neuron_target(tmp_path) -> None:
    """An MLP split by DTensor tensor parallelism (column- then row-parallel) trains 2 SGD steps on 2 simulated
    NeuronCores as in eager: the compiled graphs take the parameters' local shards, which the optimizer updates
    in place between steps, so a shard the runtime wrongly kept resident on the device would show in the second
    step's loss and in the parameters."""
    reports = _run_two_ranks(tmp_path, "dtensor_tp")
    for rank, report in enumerate(reports):
        _assert_trained_as_eager(report["cases"]["dtensor_tp"], rank)
        # the forward's all_reduce (row-parallel output); the input needs no gradient, so the backward has none
        assert report["counters"]["collective_loads"] >= 1, report["counters"]
    assert (
        reports[0]["cases"]["dtensor_tp"]["compiled"]["losses"]
        == reports[1]["cases"]["dtensor_tp"]["compiled"]["losses"]
    )


def test_every_functional_collective_runs_on_two_ranks_on_the_neuron_target(tmp_path) -> None:
    """Each functional collective of tests/test_distributed.py (all_reduce sum/avg/max, all_gather,
    reduce_scatter, all_to_all, broadcast, the coalesced forms, a chain with values crossing collectives)
    compiled whole for the neuron target, one NEFF with StableHLO collectives, run across 2 ranks: as eager."""
    from .test_distributed import COLLECTIVE_CASES

    cases = [c for c in COLLECTIVE_CASES if c != "all_reduce_sum"]  # that one is the test above
    reports = _run_two_ranks(tmp_path, *cases)
    for rank, report in enumerate(reports):
        for case in cases:
            value = report["cases"][case]
            torch.testing.assert_close(
                torch.tensor(value["compiled"]),
                torch.tensor(value["eager"]),
                rtol=1e-5,
                atol=1e-5,
                msg=lambda m: f"rank {rank}: {case}: {m}",
            )
            assert value["device_executions"] == 1, (case, value)
        assert report["counters"]["collective_loads"] >= len(cases), report["counters"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_hugging_face_decoder_trains_on_the_neuron_target(simulator, monkeypatch, dtype) -> None:
    """transformers' Llama (hidden size, rotary embeddings, RMSNorm, SiLU MLP) trains on the simulated device,
    judged as the model zoo judges the CPU target: against a reference, within a multiple of eager's error."""
    from .test_models import ZOO, _judge

    monkeypatch.setenv("NEURON_COMPILE_TARGET", "neuron")
    for step, verdict in enumerate(_judge(ZOO["llama"](), dtype)):
        assert verdict.ok, f"llama {dtype} step {step}: " + verdict.describe()
    assert STATS.device_executions > 0 and STATS.count("backward") >= 1
