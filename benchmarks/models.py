"""Model benchmark: the tiny zoo of tests/model_zoo.py, one training step (forward + backward) per model.

Per model, in one run: the steady-state step of eager, Inductor and neuron (median ms over ``--steps``
steps after two warm-up steps, with the ratio to eager), and the first step of neuron and Inductor cold
(empty caches: Dynamo + AOTAutograd + lowering/codegen + compile) and warm (the same process after
``torch._dynamo.reset()``: Dynamo and AOTAutograd run again, the on-disk caches, ours and Inductor's FX
graph cache, are hit).

    python benchmarks/models.py [--models llama,gpt2,resnet] [--dtype bfloat16] [--steps 10]
                                [--skip-inductor] [--json]

Inductor compiles are slow on 2 cores (tens of seconds per model): the default is a few small models;
``--models all`` runs the whole zoo. Nothing here runs in the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

# Fresh caches for this run, set before torch reads them: "cold" means cold.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_models_inductor_")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from tests.model_zoo import ZOO, ZooCase, cast_inputs, copy_as

DEFAULT_MODELS = "llama,gpt2,resnet"


def _step(case: ZooCase, fn: Callable[..., Any], model: torch.nn.Module, inputs: dict[str, Any]) -> None:
    for p in model.parameters():
        p.grad = None
    loss, _ = case.step(fn, inputs)
    loss.backward()


def _first_step_s(case: ZooCase, model: torch.nn.Module, inputs: dict[str, Any], backend: str, options: Any) -> float:
    fn = torch.compile(model, backend=backend, dynamic=False, options=options)
    t0 = time.perf_counter()
    _step(case, fn, model, inputs)
    return time.perf_counter() - t0


def _steady_ms(
    case: ZooCase, fn: Callable[..., Any], model: torch.nn.Module, inputs: dict[str, Any], steps: int
) -> float:
    for _ in range(2):
        _step(case, fn, model, inputs)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        _step(case, fn, model, inputs)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench(name: str, dtype: torch.dtype, steps: int, inductor: bool, cache_dir: str) -> dict[str, Any]:
    case = ZOO[name]()
    model = copy_as(case.model, dtype)
    inputs = cast_inputs(case.inputs, dtype)
    row: dict[str, Any] = {"model": name, "dtype": str(dtype).replace("torch.", "")}
    row["eager_ms"] = _steady_ms(case, model, model, inputs, steps)
    backends = [("neuron", {"cache_dir": cache_dir})] + ([("inductor", None)] if inductor else [])
    for backend, options in backends:
        torch._dynamo.reset()
        row[f"{backend}_cold_s"] = _first_step_s(case, model, inputs, backend, options)
        torch._dynamo.reset()
        row[f"{backend}_warm_s"] = _first_step_s(case, model, inputs, backend, options)
        fn = torch.compile(model, backend=backend, dynamic=False, options=options)
        row[f"{backend}_ms"] = _steady_ms(case, fn, model, inputs, steps)
        print(f"  {name} {backend}: done", file=sys.stderr, flush=True)
    torch._dynamo.reset()
    # Eager again, after the compiled runs: on a shared 2-core machine one median can catch a busy spell.
    row["eager_ms"] = min(row["eager_ms"], _steady_ms(case, model, model, inputs, steps))
    for backend, _ in backends:
        row[f"{backend}_vs_eager"] = row[f"{backend}_ms"] / row["eager_ms"]
    return row


def _table(rows: list[dict[str, Any]]) -> str:
    def ms(r: dict[str, Any], b: str) -> str:
        return f"{r[b + '_ms']:8.2f} ({r[b + '_vs_eager']:.2f}x)" if b + "_ms" in r else f"{'-':>16}"

    def s(r: dict[str, Any], key: str) -> str:
        return f"{r[key]:7.1f}" if key in r else f"{'-':>7}"

    head = (
        f"{'model':10} {'dtype':9} {'eager ms':>9} {'inductor ms':>16} {'neuron ms':>16} "
        f"{'neuron cold s':>13} {'warm s':>7} {'inductor cold s':>15} {'warm s':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['model']:10} {r['dtype']:9} {r['eager_ms']:9.2f} {ms(r, 'inductor'):>16} {ms(r, 'neuron'):>16} "
            f"{s(r, 'neuron_cold_s'):>13} {s(r, 'neuron_warm_s'):>7} {s(r, 'inductor_cold_s'):>15} "
            f"{s(r, 'inductor_warm_s'):>7}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"comma-separated, or 'all' ({', '.join(ZOO)})")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=10, help="timed steady-state steps per backend")
    parser.add_argument("--skip-inductor", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args(argv)
    names = list(ZOO) if args.models == "all" else [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(ZOO)}")
    cache_dir = tempfile.mkdtemp(prefix="bench_models_neuron_")
    rows = [bench(n, getattr(torch, args.dtype), args.steps, not args.skip_inductor, cache_dir) for n in names]
    print(json.dumps(rows, indent=2) if args.json else _table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
