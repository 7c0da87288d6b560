"""Per-call cost of the CPU target on a one-add graph (issue 14), taken apart next to eager and Inductor.

    python -m benchmarks.per_call [--threads 1] [--calls 5000]

Each row is the median microseconds per call over interleaved rounds, in one process:

- ``eager`` / ``inductor`` / ``neuron``: the whole ``torch.compile``-d call (Dynamo's guards, AOTAutograd's
  runtime wrappers, the compiled graph).
- ``neuron, wrappers only``: the same compiled function with our graph swapped for one that hands back a
  ready result: what Dynamo and AOTAutograd cost around any backend, the floor under the ``neuron`` row.
- ``executor alone``: our compiled graph called in a tight loop (DLPack in, execute, DLPack out), with the
  CPU caches warm; inside a real call the same code runs slower (the wrappers' work evicts it).
- ``execute alone`` / ``DLPack in`` / ``DLPack out``: the jaxlib calls the executor makes, one at a time.

Nothing here runs in the test suite.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any, Callable


def _median_us(fn: Callable[[], Any], calls: int, rounds: int = 7) -> float:
    for _ in range(calls // 10):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="pin to this many cores (default 1)")
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[: args.threads]))

    import torch

    torch.set_num_threads(args.threads)
    from neuron_compile.runtime import jax_adapter
    from neuron_compile.runtime.executor import CompiledGraph

    x, y = torch.randn(4, 4), torch.randn(4, 4)

    def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    rows: dict[str, float] = {}
    with torch.no_grad():
        fns = {b: torch.compile(add, backend=b, dynamic=False) for b in ("eager", "inductor", "neuron")}
        for fn in fns.values():
            fn(x, y)
        for backend, fn in fns.items():
            rows[backend] = _median_us(lambda fn=fn: fn(x, y), args.calls)
        graph = next(o for o in gc.get_objects() if type(o) is CompiledGraph)
        ready = [x + y]
        call = CompiledGraph.__call__
        CompiledGraph.__call__ = lambda self, boxed: (boxed.clear(), list(ready))[1]
        try:
            rows["neuron, wrappers only"] = _median_us(lambda: fns["neuron"](x, y), args.calls)
        finally:
            CompiledGraph.__call__ = call
        rows["executor alone"] = _median_us(lambda: graph([x, y]), args.calls)
        buffers = [jax_adapter.torch_to_device(x), jax_adapter.torch_to_device(y), graph._seed()]
        rows["execute alone"] = _median_us(lambda: graph.target.run(graph.executable, buffers), args.calls)
        rows["DLPack in (one tensor)"] = _median_us(lambda: jax_adapter.torch_to_device(x), args.calls)
        result = graph.target.run(graph.executable, buffers)[0]
        rows["DLPack out (one tensor)"] = _median_us(lambda: jax_adapter.device_to_torch(result), args.calls)

    width = max(map(len, rows))
    print(f"one-add graph (4 x 4 float32), inference, {args.threads} core(s): microseconds per call")
    for name, us in rows.items():
        print(f"  {name:{width}}  {us:7.1f}")
    floor = rows["neuron, wrappers only"]
    print(
        f"neuron/inductor {rows['neuron'] / rows['inductor']:.2f}x; the wrappers alone are "
        f"{floor / rows['inductor']:.2f}x Inductor's whole call, leaving "
        f"{max(rows['inductor'] - floor, 0.0):.1f} us for a graph to match it"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
