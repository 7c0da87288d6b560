"""The process's memory maps (``runtime.map_budget``): XLA CPU's JIT spends ~3 per compiled kernel and Linux
caps them per process (vm.max_map_count); at the cap the process dies (SIGSEGV in the C++ unwinder). Near
it, idle graphs unload their executables (reloaded when called), and a JIT that is still unsafe is refused
with an error, never attempted."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import warnings
import weakref
from typing import Any

import pytest
import torch

import neuron_compile.cache as nc
from neuron_compile import NeuronMemoryMapError, NeuronMemoryMapWarning
from neuron_compile.cache.report import NeuronCacheWarning
from neuron_compile.runtime import executor, map_budget
from neuron_compile.runtime.executor import CompiledGraph

from .util import root_cause


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("NEURON_COMPILE_CACHE_DIR", str(d))
    nc.clear_memory()
    yield d
    nc.clear_memory()


@pytest.fixture
def budget(monkeypatch):
    """The budget sees ``state["count"]`` maps of ``state["limit"]``; ``released`` lists the reliefs run and
    ``reads`` counts the reads. The module's state is restored after the test."""
    state: dict[str, Any] = {"count": 0, "limit": 1000, "released": [], "reads": 0}

    def read() -> int:
        state["reads"] += 1
        return state["count"]

    monkeypatch.setattr(map_budget, "_read_count", read)
    monkeypatch.setattr(map_budget, "map_limit", lambda: state["limit"])
    monkeypatch.setattr(map_budget, "_warned", False)
    monkeypatch.setattr(map_budget, "_reliefs", [])
    monkeypatch.setattr(map_budget, "_last_read", float("-inf"))  # no earlier count vouches for anything
    monkeypatch.setattr(map_budget, "_last_count", 0)
    monkeypatch.setattr(map_budget, "_vouched_since", 0)
    return state


def _relief(state: dict[str, Any], name: str, frees: int):
    def release() -> None:
        state["released"].append(name)
        state["count"] -= frees

    return release


@pytest.mark.parametrize(
    "count, frees, released, outcome",
    [
        (500, (100, 100), [], "nothing"),  # below the warning line
        (895, (100, 100), [], "warned"),  # past it, not yet at the refusal line
        (950, (200, 300), ["memory", "graphs"], "nothing"),  # the cheap relief alone is not enough: both run
        (950, (100, 100), ["memory", "graphs"], "warned"),  # relieved to 750: under refusal, past warning
        (950, (20, 10), ["memory", "graphs"], "refused"),  # still past the refusal line after both
    ],
    ids=["low", "warned", "relieved", "relieved-warned", "refused"],
)
def test_reserve_relieves_cheapest_first_then_refuses(budget, count, frees, released, outcome) -> None:
    budget["count"] = count
    map_budget.add_relief(_relief(budget, "graphs", frees[1]), rank=1)
    map_budget.add_relief(_relief(budget, "memory", frees[0]), rank=0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if outcome == "refused":
            with pytest.raises(NeuronMemoryMapError, match=r"920 memory maps, 92% .*vm.max_map_count = 1,000"):
                map_budget.reserve("g")
        else:
            map_budget.reserve("g")
    assert budget["released"] == released, (count, frees)
    warned = [w for w in seen if issubclass(w.category, NeuronMemoryMapWarning)]
    assert len(warned) == (outcome == "warned"), [str(w.message) for w in seen]


def test_reliefs_stop_once_well_under_the_limit(budget) -> None:
    budget["count"] = 950
    map_budget.add_relief(_relief(budget, "memory", 400), rank=0)
    map_budget.add_relief(_relief(budget, "graphs", 100), rank=1)
    map_budget.reserve("g")
    assert budget["released"] == ["memory"]  # 550 < 60%: the graphs keep their executables


def test_the_warning_is_given_once_per_process(budget) -> None:
    budget["count"] = 700
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            map_budget.reserve("g")
    assert [w.category for w in seen] == [NeuronMemoryMapWarning]
    assert "700 memory maps, 70%" in str(seen[0].message)


def test_a_count_far_from_the_limit_vouches_for_a_few_reserves(budget, monkeypatch) -> None:
    """Reading the count costs ~1 us per map: a low count covers the next reserves, each taken to add up to
    MAPS_PER_JIT maps, for at most RECOUNT_SECONDS."""
    budget.update(count=1000, limit=100_000)  # warning line 60,000: (60,000 - 1,000) // 2,000 = 29 more
    for _ in range(31):
        map_budget.reserve("g")
    assert budget["reads"] == 2
    monkeypatch.setattr(map_budget, "_last_read", map_budget._last_read - map_budget.RECOUNT_SECONDS - 1)
    map_budget.reserve("g")
    assert budget["reads"] == 3
    budget["count"] = 59_000  # near the warning line: every reserve reads
    map_budget.map_count()
    map_budget.reserve("g")
    map_budget.reserve("g")
    assert budget["reads"] == 6


def test_no_count_to_read_is_no_check(budget, monkeypatch) -> None:
    def unreadable() -> int:
        raise PermissionError("/proc/self/maps")

    monkeypatch.setattr(map_budget, "_read_count", unreadable)
    map_budget.reserve("g")  # compiles go on, as where the kernel has no limit to read
    budget["limit"] = None
    map_budget.reserve("g")


def test_counts_are_read_from_the_kernel() -> None:
    limit = map_budget.map_limit()
    assert limit is not None and limit >= 65530 // 2
    assert 0 < map_budget.map_count() < limit


def _make(k: int):
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ x.T + k) * x.sum()

    return f


def _graphs() -> set[CompiledGraph]:
    return {o for o in gc.get_objects() if type(o) is CompiledGraph}


def test_idle_graphs_unload_their_executables_and_reload_when_called(cache_dir, monkeypatch) -> None:
    """Real maps: unloading frees the JIT's maps; the next call loads the executable again, same values."""
    monkeypatch.setattr(executor, "KEEP_LOADED", 1)
    x = torch.randn(6, 6)
    old = _graphs()
    fns = [torch.compile(_make(k), backend="neuron", dynamic=False) for k in range(4)]
    expected = [f(x) for f in fns]
    graphs = _graphs() - old
    assert len(graphs) == 4 and graphs <= set(executor._UNLOADABLE)
    nc.clear_memory()  # so that what the count loses below is the graphs' own
    gc.collect()
    before = map_budget.map_count()
    map_budget.relieve(limit=1)  # as if at the limit: every relief runs
    unloaded = [g for g in graphs if g.executable is None]
    assert len(unloaded) == 3  # the most recently called one stays loaded
    assert map_budget.map_count() < before - 2 * len(unloaded), (before, map_budget.map_count())
    for f, want in zip(fns, expected):
        torch.testing.assert_close(f(x), want, rtol=0, atol=0)
    assert all(g.executable is not None for g in graphs)


def test_graphs_without_a_cache_entry_stay_loaded(monkeypatch) -> None:
    """Nothing to load them again from: never unloaded."""
    monkeypatch.setattr(executor, "KEEP_LOADED", 0)
    old = _graphs()
    f = torch.compile(_make(7), backend="neuron", dynamic=False, options={"cache": False})
    x = torch.randn(6, 6)
    want = f(x)
    (graph,) = _graphs() - old
    map_budget.relieve(limit=1)
    assert graph.executable is not None
    torch.testing.assert_close(f(x), want, rtol=0, atol=0)


def test_a_refused_load_is_an_error_and_keeps_the_cache_entry(cache_dir, monkeypatch) -> None:
    """At the limit a compile, or a load from the disk cache, raises (not a crash); the entry it could not
    load is the process's problem, not the entry's: it is not reported damaged or removed."""
    f = _make(11)
    x = torch.randn(6, 6)
    want = torch.compile(f, backend="neuron", dynamic=False)(x)
    entries = sorted(p.name for p in cache_dir.rglob("*") if p.is_dir())
    nc.clear_memory()
    torch._dynamo.reset()
    with monkeypatch.context() as m, warnings.catch_warnings():
        m.setattr(map_budget, "_reliefs", [])
        m.setattr(map_budget, "map_limit", lambda: int(map_budget.map_count() / 0.95))
        warnings.simplefilter("error", NeuronCacheWarning)  # "entry ... is damaged; recompiling it"
        with pytest.raises(Exception) as raised:
            torch.compile(f, backend="neuron", dynamic=False)(x)
    error = root_cause(raised.value)
    assert isinstance(error, NeuronMemoryMapError), error
    assert "vm.max_map_count" in str(error) and "sysctl" in str(error)
    assert sorted(p.name for p in cache_dir.rglob("*") if p.is_dir()) == entries
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, backend="neuron", dynamic=False)(x), want, rtol=0, atol=0)


_AT_THE_LIMIT = r"""
import mmap, sys
import torch
from neuron_compile.runtime import map_budget

def step(x):
    return torch.nn.functional.gelu(x @ x.T).softmax(-1).sum()

# Lowering once starts jax's client and its threads, as in any process that has compiled before.
torch.compile(lambda x: torch.tanh(x), backend="neuron", dynamic=False)(torch.randn(3))
limit = map_budget.map_limit()
taken = []  # anonymous pages, alternately read-only so that the kernel cannot merge neighbours
while map_budget.map_count() < limit - 30:
    for i in range(min(2000, limit - 30 - map_budget.map_count())):
        taken.append(mmap.mmap(-1, 4096, prot=mmap.PROT_READ if i % 2 else mmap.PROT_READ | mmap.PROT_WRITE))
x = torch.randn(8, 8, requires_grad=True)
try:
    torch.compile(step, backend="neuron", dynamic=False)(x).backward()
    print("compiled at the limit")
except Exception as e:
    print("refused:", str(e).splitlines()[1].split(":")[0:3])
taken.clear()
torch._dynamo.reset()
torch.compile(step, backend="neuron", dynamic=False)(x).backward()
print("compiled after freeing")
"""


@pytest.mark.skipif((map_budget.map_limit() or 10**9) > 200_000, reason="fills the process's map table")
def test_a_compile_at_the_real_limit_is_refused_not_a_crash(tmp_path) -> None:
    """Maps taken up to 30 short of the kernel's limit, for real: without the budget, XLA's JIT fails to
    allocate ("LLVM compilation error: Cannot allocate memory") and the process dies with SIGSEGV; with it,
    the compile raises and the process goes on once maps are freed."""
    env = {**os.environ, "NEURON_COMPILE_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", _AT_THE_LIMIT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "refused: ['NeuronMemoryMapError', ' neuron backend', ' not compiling graph1_forward']",
        "compiled after freeing",
    ], proc.stdout + proc.stderr[-3000:]


def _sin2(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2


def test_compiled_graphs_die_with_their_model(cache_dir) -> None:
    """Once the compiled function and model are deleted and Dynamo reset, their graphs (and executables, and
    memory maps) are freed, outputs kept or not, as with torch's own backends. jax records the Python stack
    in the arrays and executables it makes; made inside the call of Dynamo's transformed code, they held that
    code alive, and Dynamo frees a graph only when that code dies: every graph lived as long as the process."""
    old = _graphs()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    kept = [torch.compile(_sin2, backend="neuron", dynamic=False)(torch.randn(3))]
    compiled = torch.compile(model, backend="neuron", dynamic=False)
    kept.append(compiled(torch.randn(2, 4)))
    kept[-1].sum().backward()
    kept.append(compiled(torch.randn(2, 4)))  # its backward pending
    made = [weakref.ref(g) for g in _graphs() - old]
    assert len(made) == 3  # the function's, the model's forward and backward
    del compiled, model
    torch._dynamo.reset()
    nc.clear_memory()
    gc.collect()
    alive = sorted(r().name.split("_")[-1] for r in made if r() is not None)
    assert alive == ["backward", "forward"], alive  # held by the pending backward's autograd graph only
    kept[-1].sum().backward()
    kept.clear()
    gc.collect()
    alive = [r().name for r in made if r() is not None]
    assert alive == [], alive
