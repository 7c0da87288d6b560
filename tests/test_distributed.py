"""Collectives inside compiled graphs (issue 13): real gloo process groups on 127.0.0.1, compared with eager.

The ranks are a pool of spawned processes started once per module (starting a rank costs seconds: torch,
jax, the lowerings), each running the test's function; every function compiles with backend="neuron"
and compares with the same computation in eager on the same rank. The neuron target's StableHLO is
checked as text in this process with torch's fake process group (no ranks needed to lower).
"""

from __future__ import annotations

import copy
import os
import queue
import socket
import tempfile
import traceback
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
TIMEOUT = 180


# -- the rank pool -----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, cache_dir: str, tasks: Any, results: Any) -> None:
    os.environ["NEURON_COMPILE_CACHE_DIR"] = cache_dir
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)  # 2 shared cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    while (task := tasks.get()) is not None:
        fn, args = task
        torch._dynamo.reset()
        try:
            results.put((rank, True, fn(rank, world, *args)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class Ranks:
    """``world`` ranks of one gloo process group; ``run(fn, *args)`` calls ``fn(rank, world, *args)`` on each."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.cache_dir = tempfile.mkdtemp(prefix="neuron_compile_dist_cache_")
        ctx = mp.get_context("spawn")
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [
            ctx.Process(target=_rank_main, args=(r, world, port, self.cache_dir, self.tasks[r], self.results))
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = TIMEOUT) -> list[Any]:
        for q in self.tasks:
            q.put((fn, args))
        out: dict[int, Any] = {}
        errors = []
        for _ in range(self.world):
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                self.close(kill=True)
                raise AssertionError(
                    f"{fn.__name__}: ranks {sorted(set(range(self.world)) - set(out))} "
                    f"did not finish within {timeout}s (a collective out of step?)"
                ) from None
            out[rank] = value
            if not ok:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise AssertionError(f"{fn.__name__} failed\n" + "\n".join(errors))
        return [out[r] for r in range(self.world)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        for q, p in zip(self.tasks, self.procs):
            if not kill and p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if kill else 20)
            if p.is_alive():
                p.kill()
                p.join()


_pools: dict[int, Ranks] = {}


@pytest.fixture(scope="module")
def pools():
    yield _pools
    for pool in _pools.values():
        pool.close()
    _pools.clear()


@pytest.fixture
def ranks(pools) -> Ranks:
    pool = pools.get(WORLD)
    if pool is None or not pool.alive():
        pool = pools[WORLD] = Ranks(WORLD)
    return pool


# -- helpers run on the ranks ----------------------------------------------------------------------------
def _close(what: str, actual: Any, expected: Any, rank: int) -> None:
    torch.testing.assert_close(
        actual, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank}: {what}: compiled != eager\n{m}"
    )


def _graph_names() -> list[str]:
    import neuron_compile

    return [g.name for g in neuron_compile.STATS.graphs]


def _reset_stats() -> None:
    import neuron_compile

    neuron_compile.STATS.graphs.clear()


# -- item 1: functional collectives, executed through torch.distributed on the CPU target ----------------
def _fc():
    import torch.distributed._functional_collectives as fc

    return fc


def _all_reduce_sum(x):
    return _fc().all_reduce(x * 2, "sum", dist.group.WORLD) + 1


def _all_reduce_avg(x):
    return _fc().all_reduce(x.sin(), "avg", dist.group.WORLD).cos()


def _all_reduce_max(x):
    return _fc().all_reduce(x, "max", dist.group.WORLD) - x


def _all_gather(x):
    return _fc().all_gather_single(x.exp(), 0, dist.group.WORLD).sum(0)


def _reduce_scatter(x):
    return _fc().reduce_scatter_single(torch.cat([x, 2 * x]), "sum", 0, dist.group.WORLD) * 3


def _all_to_all(x):
    return _fc().all_to_all_single(x + 1, None, None, dist.group.WORLD).relu()


def _broadcast(x):
    return _fc().broadcast(x * x, 1, dist.group.WORLD) + x


def _coalesced(x):
    a, b = _fc().all_reduce_coalesced([x, x.t() * 2], "sum", dist.group.WORLD)
    c, d = _fc().all_gather_into_tensor_coalesced([a, b], dist.group.WORLD)
    e, f = _fc().reduce_scatter_tensor_coalesced([c, d], "sum", [0, 0], dist.group.WORLD)
    return e.sum() + f.sum()


def _chain(x):
    """Several collectives with compute between and values crossing them: any reordering changes the result
    (or, between collectives of different shapes, fails in gloo)."""
    fc = _fc()
    y = fc.all_reduce(x @ x.t(), "sum", dist.group.WORLD)
    z = fc.all_gather_single(y[:2].tanh(), 0, dist.group.WORLD)
    w = fc.all_reduce(z.sum(0) * x[:, :1].t(), "max", dist.group.WORLD)
    return y.sum(1) + w.sum() + fc.all_reduce(x.mean(), "sum", dist.group.WORLD)


COLLECTIVE_CASES = {
    "all_reduce_sum": _all_reduce_sum,
    "all_reduce_avg": _all_reduce_avg,
    "all_reduce_max": _all_reduce_max,
    "all_gather_into_tensor": _all_gather,
    "reduce_scatter_tensor": _reduce_scatter,
    "all_to_all_single": _all_to_all,
    "broadcast": _broadcast,
    "coalesced": _coalesced,
    "chain_of_collectives": _chain,
}


def _run_collective_case(rank: int, world: int, case: str) -> list[str]:
    fn = COLLECTIVE_CASES[case]
    torch.manual_seed(rank)  # different data per rank, so a dropped collective shows
    x = torch.randn(4, 4)
    expected = fn(x)
    _reset_stats()
    actual = torch.compile(fn, backend="neuron", fullgraph=True)(x)
    _close(f"{case} on input float32[4, 4]", actual, expected, rank)
    return _graph_names()


@pytest.mark.parametrize("case", list(COLLECTIVE_CASES))
def test_functional_collective_in_graph_matches_eager(ranks: Ranks, case: str) -> None:
    names = ranks.run(_run_collective_case, case)
    # Compute around the collectives was compiled (pieces of the one graph), not run in eager.
    assert all(n.startswith("graph") and "_part" in n for n in names[0]) and names[0], names


def _run_split_structure(rank: int, world: int) -> dict[str, Any]:
    """Split the AOTAutograd graph of ``_chain`` ourselves and compare the order of the collectives the
    split module runs eagerly with the graph's."""
    from neuron_compile.distributed import COLLECTIVE_OPS, split_graph

    torch.manual_seed(rank)
    x = torch.randn(4, 4)
    gm, _ = _aot_forward(_chain, x)
    order = [str(n.target) for n in gm.graph.nodes if n.target in COLLECTIVE_OPS]
    compiled_pieces: list[torch.fx.GraphModule] = []

    def compile_piece(piece, inputs, i):
        compiled_pieces.append(copy.deepcopy(piece))
        return lambda args: list(piece(*args))

    split = split_graph(gm, compile_piece, "chain", run_collectives=True)
    eager_order = [
        str(n.target)
        for call in split.split.graph.nodes
        if call.op == "call_module" and isinstance(sub := getattr(split.split, call.target), torch.fx.GraphModule)
        for n in sub.graph.nodes
        if n.target in COLLECTIVE_OPS
    ]
    leaked = [str(n.target) for g in compiled_pieces for n in g.graph.nodes if n.target in COLLECTIVE_OPS]
    _close("split chain", split([x])[0], _chain(x), rank)
    return {
        "order": order,
        "eager_order": eager_order,
        "pieces": len(compiled_pieces),
        "leaked": leaked,
        "collectives": split.num_collectives,
    }


def test_collectives_are_kept_in_graph_order_and_out_of_compiled_pieces(ranks: Ranks) -> None:
    got = ranks.run(_run_split_structure)[0]
    c10d = "_c10d_functional"
    ops = [op for op in got["order"] if op != f"{c10d}.wait_tensor.default"]
    assert (
        ops
        == [f"{c10d}.all_reduce.default", f"{c10d}.all_gather_into_tensor.default"] + [f"{c10d}.all_reduce.default"] * 2
    ), got
    assert got["eager_order"] == got["order"], "the split module runs the collectives in another order"
    assert got["collectives"] == len(got["order"]), got
    assert not got["leaked"], f"collectives inside compiled pieces: {got['leaked']}"
    assert got["pieces"] >= 2, got


# -- item 2: DTensor tensor parallelism ------------------------------------------------------------------
class _MLP(torch.nn.Module):
    def __init__(self, d: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, hidden)
        self.down = torch.nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class _Attention(torch.nn.Module):
    def __init__(self, d: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.hd = d // heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under ColwiseParallel each rank holds heads/world of them.
        q, k, v = (p(x).view(b, t, -1, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


def _tp_case(block: str):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if block == "mlp":
        return _MLP(), {"up": ColwiseParallel(), "down": RowwiseParallel()}, (4, 8)
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
    return _Attention(), plan, (2, 6, 16)


def _run_tensor_parallel(rank: int, world: int, block: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from neuron_compile.compiler import HOOKS
    from neuron_compile.provenance import is_library_file, user_frame

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model, plan, shape = _tp_case(block)
    sources: list[str] = []  # the reported file of every node that has a recorded stack (cache hits too)
    HOOKS.on_graph.append(lambda gm: sources.extend(f[0] for n in gm.graph.nodes if (f := user_frame(n))))
    eager = parallelize_module(copy.deepcopy(model), mesh, plan)
    compiled = torch.compile(parallelize_module(copy.deepcopy(model), mesh, plan), backend="neuron", fullgraph=True)
    torch.manual_seed(1)
    x = torch.randn(*shape)
    for step in range(2):
        expected = eager(x)
        actual = compiled(x)
        _close(f"TP {block} output, step {step}", actual, expected, rank)
        expected.square().sum().backward()
        actual.square().sum().backward()
    HOOKS.on_graph.pop()
    for (name, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        _close(f"TP {block} grad of {name}", q.grad.to_local(), p.grad.to_local(), rank)
    # item 6: nodes DTensor made inside torch name the model's lines (this file), not torch's
    in_torch = sorted({s for s in sources if is_library_file(s)})
    assert sources and not in_torch, f"rank {rank}: nodes attributed to torch's own files: {in_torch}"


@pytest.mark.slow
@pytest.mark.parametrize("block", ["mlp", "attention"])
def test_dtensor_tensor_parallel_matches_eager(ranks: Ranks, block: str) -> None:
    ranks.run(_run_tensor_parallel, block)


# -- item 3: FSDP2, fully_shard per block + root, the root compiled whole ------------------------------------
def _run_fsdp2_whole_model(rank: int, world: int) -> list[tuple[str, str]]:
    from torch.distributed.fsdp import fully_shard

    import neuron_compile

    def shard(model: torch.nn.Module) -> torch.nn.Module:
        for block in model:
            fully_shard(block)
        return fully_shard(model)

    torch.manual_seed(0)
    model = torch.nn.Sequential(_MLP(), _MLP())
    eager, compiled = shard(copy.deepcopy(model)), shard(copy.deepcopy(model))
    run = torch.compile(compiled, backend="neuron")
    torch.manual_seed(1 + rank)  # each rank its own batch: gradients are reduce-scattered across ranks
    x = torch.randn(4, 8)
    _reset_stats()
    for step in range(2):
        expected, actual = eager(x), run(x)
        _close(f"FSDP2 output, step {step}", actual, expected, rank)
        expected.square().sum().backward()
        actual.square().sum().backward()
    for (name, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        _close(f"FSDP2 grad shard of {name}", q.grad.to_local(), p.grad.to_local(), rank)
    return [(g.name, g.kind) for g in neuron_compile.STATS.graphs]


@pytest.mark.slow
def test_fsdp2_whole_model_compile_matches_eager(ranks: Ranks) -> None:
    graphs = ranks.run(_run_fsdp2_whole_model)[0]
    # torch 2.13's Dynamo runs FSDP2's hooks (its all-gathers and reduce-scatters) outside the graphs; the
    # blocks' compute, forward and backward, must still be compiled rather than left to eager.
    kinds = {kind for _, kind in graphs}
    assert {"forward", "backward"} <= kinds, graphs


# -- item 4: pipeline parallelism, each stage compiled -----------------------------------------------------
def _run_pipeline(rank: int, world: int) -> list[str]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    import neuron_compile

    torch.manual_seed(0)
    stages = [_MLP() for _ in range(world)]
    x, target = torch.randn(4, 8), torch.randn(4, 8)

    def step(module: torch.nn.Module) -> tuple[Any, list[torch.Tensor]]:
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, t: (out - t).square().mean())
        losses: list[torch.Tensor] = []
        out = schedule.step(x) if rank == 0 else schedule.step(target=target, losses=losses)
        return out, losses

    eager, compiled = copy.deepcopy(stages[rank]), copy.deepcopy(stages[rank])
    expected, expected_losses = step(eager)
    _reset_stats()
    actual, actual_losses = step(torch.compile(compiled, backend="neuron"))
    if rank == world - 1:
        _close("pipeline output", actual, expected, rank)
        _close("pipeline microbatch losses", actual_losses, expected_losses, rank)
    for (name, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        _close(f"stage {rank} grad of {name}", q.grad, p.grad, rank)
    return [g.kind for g in neuron_compile.STATS.graphs]


@pytest.mark.slow
def test_pipeline_stages_compiled_match_eager(ranks: Ranks) -> None:
    kinds = ranks.run(_run_pipeline)
    assert all({"forward", "backward"} <= set(k) for k in kinds), kinds


# -- item 5: one compile per key across ranks sharing a cache dir ----------------------------------------
def _run_shared_cache(rank: int, world: int, cache_dir: str) -> dict[str, str]:
    import neuron_compile
    from neuron_compile.cache import clear_memory

    clear_memory()
    _reset_stats()
    torch.manual_seed(rank)
    x = torch.randn(4, 4)
    torch.compile(_chain, backend="neuron", fullgraph=True, options={"cache_dir": cache_dir})(x)
    return {g.name: g.cache for g in neuron_compile.STATS.graphs}


def test_ranks_sharing_a_cache_dir_compile_each_graph_once(ranks: Ranks, tmp_path) -> None:
    cache_dir = str(tmp_path / "shared")
    states = ranks.run(_run_shared_cache, cache_dir)
    assert states[0].keys() == states[1].keys() and states[0], states
    for name in states[0]:
        got = sorted(s[name] for s in states)
        assert got == ["hit"] * (len(states) - 1) + ["miss"], f"{name}: compiled by more than one rank: {got}"


# -- item 1, neuron target: StableHLO collectives with replica groups (never run here) --------------------
@pytest.fixture
def fake_world_of_4():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _aot_forward(fn: Callable[..., Any], *inputs: torch.Tensor) -> tuple[torch.fx.GraphModule, list[Any]]:
    from torch._dynamo.backends.common import aot_autograd

    captured = []

    def fw(gm, example_inputs):
        captured.append((gm, example_inputs))
        return gm

    torch.compile(fn, backend=aot_autograd(fw_compiler=fw), fullgraph=True)(*inputs)
    return captured[0]


def test_neuron_target_lowers_collectives_with_mesh_replica_groups(fake_world_of_4) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from neuron_compile import distributed
    from neuron_compile.legality.enforce import check_module
    from neuron_compile.lowering import lower_graph

    fc = _fc()
    mesh = init_device_mesh("cpu", (2, 2))
    rows, cols = mesh.get_group(1), mesh.get_group(0)

    def f(x):
        a = fc.all_reduce(x, "avg", rows)
        b = fc.all_gather_single(a, 0, cols)
        c = fc.reduce_scatter_single(b, "max", 0, dist.group.WORLD)
        d = fc.all_to_all_single(b, None, None, dist.group.WORLD)
        return c, d, fc.broadcast(x, 1, cols)

    gm, inputs = _aot_forward(f, torch.randn(4, 3))
    distributed.annotate_replica_groups(gm)
    lowered = lower_graph(gm, inputs, "collectives", target="neuron")
    text = lowered.stablehlo()
    expected = [
        '"stablehlo.all_reduce"(%arg0) <{replica_groups = dense<[[0, 1], [2, 3]]>',
        '"stablehlo.all_gather"(%2) <{all_gather_dim = 0 : i64, replica_groups = dense<[[0, 2], [1, 3]]>',
        '"stablehlo.reduce_scatter"(%3) <{replica_groups = dense<[[0, 1, 2, 3]]>',
        "stablehlo.maximum",
        '"stablehlo.all_to_all"(%3) <{concat_dimension = 0 : i64, replica_groups = dense<[[0, 1, 2, 3]]> : tensor<1x4xi64>, split_count = 4',
        "stablehlo.divide %0",  # avg = sum / group size
        "stablehlo.slice %7 [1:2",  # broadcast from the group's rank 1
    ]
    missing = [e for e in expected if e not in text]
    assert not missing, f"missing {missing} in\n{text}"
    report = check_module(lowered, generation="trn2", target="neuron", node_table=lowered.node_table)
    assert report.legal, report.violations
    # item 6: each collective's node points at f's line here, not at torch's _functional_collectives.py
    sources = {v["op"]: v["source"] for v in lowered.node_table.values()}
    assert all(s.startswith(__file__) for s in sources.values()), sources


def test_neuron_target_refuses_a_group_without_a_mesh_pattern(fake_world_of_4) -> None:
    from neuron_compile import distributed
    from neuron_compile.errors import NeuronUnsupportedOpError
    from neuron_compile.lowering import lower_graph

    odd = dist.new_group([0, 1, 3])

    def f(x):
        return _fc().all_reduce(x, "sum", odd)

    gm, inputs = _aot_forward(f, torch.randn(4))
    distributed.annotate_replica_groups(gm)
    with pytest.raises(NeuronUnsupportedOpError) as info:
        lower_graph(gm, inputs, "odd_group", target="neuron")
    msg = str(info.value)
    assert "_c10d_functional.all_reduce" in msg and "[0, 1, 3]" in msg and "DeviceMesh" in msg, msg
    assert f"{os.path.basename(__file__)}:" in msg, msg


@pytest.mark.parametrize(
    "ranks_, world, expected",
    [
        ([0, 1], 4, [[0, 1], [2, 3]]),
        ([2, 3], 4, [[0, 1], [2, 3]]),
        ([1, 3], 4, [[0, 2], [1, 3]]),
        ([0, 1, 2, 3], 4, [[0, 1, 2, 3]]),
        ([1, 0], 2, None),  # group order that no translate tiling has: refused, not guessed
        ([0, 1, 3], 4, None),
        ([0, 1, 2], 4, None),
    ],
)
def test_replica_groups_are_the_translates_of_the_callers_group(ranks_, world, expected) -> None:
    from neuron_compile.distributed.groups import _partition

    assert _partition(ranks_, world) == expected


# -- item 6: the user's line for nodes made inside torch ---------------------------------------------------
def test_user_frame_skips_torch_frames() -> None:
    from neuron_compile import provenance

    torch_file = os.path.join(os.path.dirname(torch.__file__), "distributed", "_functional_collectives.py")
    trace = (
        f'  File "{__file__}", line 12, in forward\n    y = all_reduce(x)\n'
        f'  File "{torch_file}", line 179, in all_reduce\n    tensor = torch.ops._c10d_functional.all_reduce(\n'
    )
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    node.meta["stack_trace"] = trace
    assert provenance.user_frame(node) == (__file__, 12)
    node.meta["stack_trace"] = trace.split("  File")[0] + "  File" + trace.split("  File")[2]
    assert provenance.user_frame(node) == (torch_file, 179)  # only library frames: the innermost one
