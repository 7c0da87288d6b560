"""CPU-target speed (issue 14): steady-state step time and first-step time, neuron next to eager and Inductor.

Steady state (default): four models, each as a training step (forward + backward) and as inference
(``torch.no_grad``), run by eager, Inductor and neuron in ONE process. After warm-up the backends are
timed interleaved (round-robin, ``--reps`` rounds of ``--inner`` steps each), so a busy spell on a
shared machine hits all of them alike; the table gives the median per-step time and the ratios.

    python -m benchmarks.steady [--models mlp,decoder,cnn,add] [--modes train,infer] [--reps 30]
                                [--zoo llama,gpt2|all] [--dtype bfloat16] [--json]

First step (``--first-step``): each backend (aot_eager = the Dynamo + AOTAutograd tracing floor, Inductor,
neuron) compiles and runs one training step in a fresh process, twice against the same private caches:
cold (empty caches) and warm (the caches the cold process filled).

    python -m benchmarks.steady --first-step [--models mlp,decoder] [--backends aot_eager,inductor,neuron]

``--zoo`` adds models of tests/model_zoo.py (training step only; ``all``: the whole zoo, Inductor compiles take
tens of seconds each on 2 cores). ``--dtype bfloat16`` runs every model in bfloat16 (parameters, buffers and
float inputs; integer inputs such as token ids stay). Run from the repository root; tests/test_benchmarks.py
runs a one-round smoke of this, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

from benchmarks import ChildFailed, run_child


def _pin_threads(argv: list[str]) -> int | None:
    """``--threads N``: this process (torch's OpenMP pool and XLA's Eigen pool alike) on N cores.

    Done before torch and jax start their thread pools. On a shared machine torch's OpenMP threads suffer
    most from oversubscription (eager's MLP training step measured 13 ms with 1 thread, 36 ms with 2, at
    load 5 on 2 cores), which flatters every compiled backend; pinning makes the comparison fair.
    """
    if "--threads" not in argv:
        return None
    n = int(argv[argv.index("--threads") + 1])
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:n]))
    return n


_THREADS = _pin_threads(sys.argv)
# Before torch reads it: Inductor's caches must be this run's, or "cold" is not cold.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_steady_inductor_")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from neuron_compile.demo import TinyLM  # noqa: E402

if _THREADS:
    torch.set_num_threads(_THREADS)


class GeluMLP(nn.Module):
    def __init__(self, d: int = 512, hidden: int = 2048) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.conv3 = nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(64)
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.relu(self.bn3(self.conv3(x)))
        return self.head(x.mean(dim=(2, 3)))


class Add(nn.Module):
    """One aten.add: what is left is the per-call cost of the backend's runtime."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


class Case:
    """A model, its inputs, and a scalar loss of its output for the training step."""

    def __init__(self, model: nn.Module, inputs: tuple[torch.Tensor, ...], loss: Callable[[Any], torch.Tensor]):
        self.model = model
        self.inputs = inputs
        self.loss = loss


def _mse(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def make_case(name: str) -> Case:
    torch.manual_seed(0)
    if name == "mlp":  # 512 -> 2048 -> 512, GELU, batch 64
        return Case(GeluMLP(), (torch.randn(64, 512),), _mse)
    if name == "decoder":  # 4 layers, 64 wide (the demo's transformer)
        vocab, seq, batch = 256, 64, 8
        model = TinyLM(vocab=vocab, d_model=64, n_heads=4, n_layers=4, seq=seq)
        idx = torch.randint(0, vocab, (batch, seq))
        return Case(model, (idx, torch.roll(idx, -1, 1)), lambda loss: loss)
    if name == "cnn":  # three conv + BatchNorm blocks on 16 x 3 x 32 x 32
        return Case(SmallCNN(), (torch.randn(16, 3, 32, 32),), _mse)
    if name == "add":  # 4 x 4 + 4 x 4
        return Case(Add(), (torch.randn(4, 4, requires_grad=True), torch.randn(4, 4)), _mse)
    raise ValueError(f"unknown model {name!r}; choose from mlp, decoder, cnn, add")


def as_dtype(case: Case, dtype: torch.dtype) -> Case:
    """``case`` with its model's floating parameters and buffers and its float inputs in ``dtype``."""
    if dtype == torch.float32:
        return case
    inputs = tuple(
        t.detach().to(dtype).requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in case.inputs
    )
    return Case(case.model.to(dtype), inputs, case.loss)


def zoo_names(text: str) -> list[str]:
    """``--zoo``'s models: comma-separated names of tests/model_zoo.py, or ``all``."""
    from tests.model_zoo import ZOO

    names = list(ZOO) if text.strip() == "all" else [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        raise SystemExit(f"steady: unknown zoo model(s) {unknown}; choose from {', '.join(ZOO)} or all")
    return names


def zoo_case(name: str) -> Case:
    from tests.model_zoo import ZOO

    case = ZOO[name]()
    keys = list(case.inputs)

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = case.model

        def forward(self, *values: torch.Tensor) -> Any:
            return case.step(self.inner, dict(zip(keys, values)))[0]

    return Case(Wrapped(), tuple(case.inputs[k] for k in keys), lambda loss: loss)


def train_step(case: Case, fn: Callable[..., Any]) -> None:
    for p in case.model.parameters():
        p.grad = None
    for t in case.inputs:
        t.grad = None
    case.loss(fn(*case.inputs)).backward()


def infer_step(case: Case, fn: Callable[..., Any]) -> None:
    with torch.no_grad():
        fn(*case.inputs)


def steady(case: Case, mode: str, backends: list[str], reps: int, inner: int) -> dict[str, float]:
    """Median ms per step of each backend, timed round-robin so that noise hits all alike."""
    step = train_step if mode == "train" else infer_step
    if mode == "infer":
        case.model.eval()
    else:
        case.model.train()
    fns: dict[str, Callable[..., Any]] = {}
    for b in backends:
        fns[b] = case.model if b == "eager" else torch.compile(case.model, backend=b, dynamic=False)
        for _ in range(3):  # compile, then let allocators and thread pools settle
            step(case, fns[b])
    times: dict[str, list[float]] = {b: [] for b in backends}
    for _ in range(reps):
        for b in backends:
            t0 = time.perf_counter()
            for _ in range(inner):
                step(case, fns[b])
            times[b].append((time.perf_counter() - t0) * 1e3 / inner)
    return {b: statistics.median(v) for b, v in times.items()} | {
        f"{b}_iqr": (statistics.quantiles(v, n=4)[2] - statistics.quantiles(v, n=4)[0]) if len(v) > 1 else 0.0
        for b, v in times.items()
    }


def run_steady(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    names = [(n, False) for n in args.models] + [(n, True) for n in args.zoo]
    for name, is_zoo in names:
        for mode in ["train"] if is_zoo else args.modes:
            case = as_dtype(zoo_case(name) if is_zoo else make_case(name), args.dtype)
            inner = args.inner if args.inner else (50 if name == "add" else 3)
            r = steady(case, mode, args.backends, args.reps, inner)
            row: dict[str, Any] = {"model": name, "mode": mode, "dtype": str(args.dtype).removeprefix("torch.")} | r
            for b in args.backends:
                if b != "eager" and "eager" in r:
                    row[f"{b}/eager"] = r[b] / r["eager"]
            if "neuron" in r and "inductor" in r:
                row["neuron/inductor"] = r["neuron"] / r["inductor"]
            rows.append(row)
            torch._dynamo.reset()
            print(f"  {name} {mode}: done", file=sys.stderr, flush=True)
    return rows


def steady_table(rows: list[dict[str, Any]], backends: list[str]) -> str:
    ratios = [f"{b}/eager" for b in backends if b != "eager"] + (
        ["neuron/inductor"] if {"neuron", "inductor"} <= set(backends) else []
    )
    head = (
        f"{'model':10} {'mode':6} "
        + " ".join(f"{b + ' ms':>16}" for b in backends)
        + " "
        + " ".join(f"{r:>16}" for r in ratios)
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [f"{r[b]:8.3f} ±{r[b + '_iqr'] / 2:6.3f}" for b in backends]
        lines.append(
            f"{r['model']:10} {r['mode']:6} "
            + " ".join(f"{c:>16}" for c in cells)
            + " "
            + " ".join(f"{r[k]:16.2f}" for k in ratios)
        )
    lines.append("ms: median per step over the rounds, ± half the interquartile range")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# First step: fresh processes, private caches.


def _child_first_step(name: str, backend: str, dtype: str) -> None:
    """Runs in a fresh process: compile + one training step, wall time printed as JSON."""
    case = as_dtype(zoo_case(name[4:]) if name.startswith("zoo:") else make_case(name), getattr(torch, dtype))
    t0 = time.perf_counter()
    fn = torch.compile(case.model, backend=backend, dynamic=False)
    train_step(case, fn)
    first = time.perf_counter() - t0
    states = []
    if backend == "neuron":  # a "warm" run that missed (the key hashes the package source) is not warm
        from neuron_compile import STATS

        states = [g.cache for g in STATS.graphs]
    print(json.dumps({"first_step_s": first, "cache": states}))


def run_first_step(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    names = list(args.models) + [f"zoo:{n}" for n in args.zoo]
    for name in names:
        row: dict[str, Any] = {"model": name}
        for backend in args.backends:
            if backend == "eager":
                continue
            root = tempfile.mkdtemp(prefix=f"bench_first_{backend}_")
            env = os.environ | {
                "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor"),
                "NEURON_COMPILE_CACHE_DIR": os.path.join(root, "neuron"),
            }
            dtype = str(args.dtype).removeprefix("torch.")
            for state in ("cold", "warm"):
                threads = ["--threads", str(args.threads)] if args.threads else []
                try:
                    result = run_child("steady", ["--child", name, backend, dtype, *threads], env=env)
                except ChildFailed as e:
                    raise RuntimeError(f"{backend} {state} first step of {name} failed:\n{e.stderr[-3000:]}") from None
                row[f"{backend}_{state}_s"] = result["first_step_s"]
                if state == "warm" and "miss" in result["cache"]:
                    row[f"{backend}_warm_missed"] = True
                print(f"  {name} {backend} {state}: {row[f'{backend}_{state}_s']:.2f} s", file=sys.stderr, flush=True)
        floor = row.get("aot_eager_cold_s")
        if floor:
            for backend in args.backends:
                for state in ("cold", "warm"):
                    if f"{backend}_{state}_s" in row and backend != "aot_eager":
                        row[f"{backend}_{state}/floor"] = row[f"{backend}_{state}_s"] / floor
        rows.append(row)
    return rows


def first_step_table(rows: list[dict[str, Any]], backends: list[str]) -> str:
    backends = [b for b in backends if b != "eager"]
    head = f"{'model':12} " + " ".join(f"{b + ' cold s':>16} {'warm s':>16}" for b in backends)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for b in backends:
            for state in ("cold", "warm"):
                v = r.get(f"{b}_{state}_s")
                ratio = r.get(f"{b}_{state}/floor")
                missed = "!" if state == "warm" and r.get(f"{b}_warm_missed") else " "
                cells.append(f"{v:7.2f}{missed}" + (f"({ratio:.2f}x)" if ratio else " " * 7) if v is not None else "-")
        lines.append(f"{r['model']:12} " + " ".join(f"{c:>16}" for c in cells))
    lines.append(
        "s: wall time of torch.compile + the first training step in a fresh process; "
        "(x): against aot_eager's cold first step, the Dynamo + AOTAutograd tracing floor; "
        "!: the warm run missed the neuron cache (the package source changed in between)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _child_first_step(argv[1], argv[2], argv[3])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,decoder,cnn,add")
    parser.add_argument("--modes", default="train,infer")
    parser.add_argument(
        "--backends", default=None, help="default: eager,inductor,neuron (first step: aot_eager,inductor,neuron)"
    )
    parser.add_argument("--zoo", default="", help="models of tests/model_zoo.py to add (training step), or all")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="every model's dtype")
    parser.add_argument("--reps", type=int, default=30, help="timed rounds per backend")
    parser.add_argument("--inner", type=int, default=0, help="steps per round (default 3; 50 for add)")
    parser.add_argument("--first-step", action="store_true", help="cold/warm first step in fresh processes")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="pin the process to this many cores and "
        "torch to as many threads (fair on a loaded machine; default: all, torch's default threads)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    args.models, args.modes, args.zoo = split(args.models), split(args.modes), zoo_names(args.zoo)
    args.dtype = getattr(torch, args.dtype)
    default = "aot_eager,inductor,neuron" if args.first_step else "eager,inductor,neuron"
    args.backends = split(args.backends or default)
    print(
        f"torch {torch.__version__}, {str(args.dtype).removeprefix('torch.')}, {torch.get_num_threads()} torch threads on {len(os.sched_getaffinity(0))} "
        f"cores, load average {os.getloadavg()[0]:.1f}",
        file=sys.stderr,
    )
    if args.first_step:
        rows = run_first_step(args)
        print(json.dumps(rows, indent=2) if args.json else first_step_table(rows, args.backends))
    else:
        rows = run_steady(args)
        print(json.dumps(rows, indent=2) if args.json else steady_table(rows, args.backends))
    return 0


if __name__ == "__main__":
    sys.exit(main())
