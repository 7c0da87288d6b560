"""Where the CPU target's time goes inside XLA: each compiled graph of a steady.py model, timed alone and
profiled per XLA thunk (dots, YNNPACK fusions, loop fusions, convolutions), next to eager's step.

    python -m benchmarks.xla_profile decoder [--mode train|infer] [--top 25] [--hlo DIR]

XLA CPU names its thunks after the optimized HLO (``ynn_fusion.19``, ``dot.98``, ``convolution``); each row
gives the thunk's time per call and the op kinds inside it. ``--hlo DIR`` writes each graph's optimized
HLO there, to read a thunk's fusion by its name. Pinned to one core, as ``steady.py --threads 1``.
Thunks may overlap in time (XLA runs independent thunks concurrently), so their sum can exceed the
graph's wall time.
"""

from __future__ import annotations

import os
import sys

# Before jax creates its backend: XLA CPU emits per-thunk trace events only with this flag.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()
os.environ["NEURON_COMPILE_CACHE"] = "0"  # a cache hit would skip the compile this tool watches
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

import argparse
import collections
import glob
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import steady
from neuron_compile.runtime.executor import CompiledGraph

torch.set_num_threads(1)


def median_ms(fn: Callable[[], Any], reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def capture_graphs(case: steady.Case, step: Callable[..., None]) -> dict[str, tuple[CompiledGraph, list[Any]]]:
    """Each compiled graph of one step of ``case`` with the arguments it was called with."""
    seen: dict[str, tuple[CompiledGraph, list[Any]]] = {}
    call = CompiledGraph.__call__

    def recording(self: CompiledGraph, args: list[Any]) -> list[Any]:
        seen.setdefault(self.name, (self, list(args)))
        return call(self, args)

    fn = torch.compile(case.model, backend="neuron", dynamic=False)
    step(case, fn)
    CompiledGraph.__call__ = recording
    try:
        step(case, fn)
    finally:
        CompiledGraph.__call__ = call
    return seen


def thunk_times(graph: CompiledGraph, args: list[Any], reps: int = 10) -> dict[str, float]:
    """Milliseconds per call of each XLA thunk of ``graph``, from jax's profiler."""
    import jax
    from jax.profiler import ProfileData

    for _ in range(3):
        graph(list(args))
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(reps):
            graph(list(args))
        jax.profiler.stop_trace()
        data = ProfileData.from_file(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
    totals: dict[str, float] = collections.defaultdict(float)
    # Thunks run on the calling thread (the executor's client runs inline) and on XLA's pool; the calling
    # thread's line also holds Python frames ("$file:line name") and runtime events, left out here.
    runtime = ("$", "end:", "Threadpool", "PythonRefManager", "CommonPjRt", "ThunkExecutor")
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                if not event.name.startswith(runtime) and "PjRt" not in event.name:
                    totals[event.name] += event.duration_ns / 1e6 / reps
    return totals


def describe(hlo: str, thunk: str) -> str:
    """Shape and op kinds of a thunk, read from the optimized HLO."""
    m = re.search(r"%" + re.escape(thunk) + r" = (\S+) ([a-z\-]+)\((.*)", hlo)
    if not m:
        return ""
    text = f"{m.group(1)} {m.group(2)}"
    called = re.search(r"calls=%([\w.\-]+)", m.group(3))
    if called and f"%{called.group(1)} (" in hlo:
        body = hlo[hlo.index(f"%{called.group(1)} (") :]
        ops = re.findall(r"= \S+ ([a-z\-]+)\(", body[: body.index("\n}")])
        text += " [" + ",".join(o for o in ops if o not in ("parameter", "bitcast", "constant")) + "]"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a steady.py model (mlp, decoder, cnn, add) or zoo:NAME (tests/model_zoo.py)")
    parser.add_argument("--mode", default="train", choices=["train", "infer"])
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--hlo", default=None, help="write each graph's optimized HLO into this folder")
    args = parser.parse_args()
    case = steady.zoo_case(args.model[4:]) if args.model.startswith("zoo:") else steady.make_case(args.model)
    step = steady.train_step if args.mode == "train" else steady.infer_step
    if args.mode == "infer":
        case.model.eval()
    graphs = capture_graphs(case, step)
    print(f"{args.model} {args.mode}: eager step {median_ms(lambda: step(case, case.model)):.3f} ms")
    for name, (graph, graph_args) in graphs.items():
        hlo = graph.executable.hlo_modules()[0].to_string()
        if args.hlo:
            Path(args.hlo).mkdir(parents=True, exist_ok=True)
            Path(args.hlo, f"{args.model.replace(':', '_')}_{name}.hlo").write_text(hlo)
        wall = median_ms(lambda g=graph, a=graph_args: g(list(a)))
        totals = thunk_times(graph, graph_args)
        kinds: dict[str, float] = collections.defaultdict(float)
        for thunk, ms in totals.items():
            kinds[re.sub(r"[.\d]+$", "", thunk)] += ms
        print(
            f"\n{name}: {wall:.3f} ms per call, thunks {sum(totals.values()):.3f} ms; by kind: "
            + ", ".join(f"{k} {v:.2f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:6])
        )
        for thunk, ms in sorted(totals.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {ms:8.3f} ms  {thunk:32s} {describe(hlo, thunk)[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
