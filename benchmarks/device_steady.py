"""Graphs compiled and executables run per steady-state step on the ``neuron`` device (issue 57's acceptance).

Workloads, each in a fresh process with its own caches, in each eager mode (``op``: one graph per eager op;
``lazy``: the eager ops between syncs recorded and run as one graph), on the CPU target and on the device
simulator (the neuron target: fake neuronx-cc and libnrt):

  adamw          the tests' decoder compiled, default ``torch.optim.AdamW`` (capturable=False) eager
  sgd_cosine     the decoder compiled, SGD(momentum) + CosineAnnealingLR eager
  adamw_clip     the decoder compiled, AdamW + ``clip_grad_norm_`` eager
  uncompiled     the decoder NOT compiled (every op eager), AdamW
  generate       greedy decoding of the tiny Llama with the default dynamic cache, eager (per new token: its
                 cache grows, so each token's ops have new shapes)
  generate_static  ``generate(cache_implementation="static")`` of the tiny Llama (per new token)

Printed per workload: graphs compiled at each step (first and steady state), and the median executables run
and graphs compiled per steady-state step (steps 3..N). ``python -m benchmarks.device_steady [--steps 10]
[--targets cpu,neuron] [--modes op,lazy] [--workloads adamw,...]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks import REPO, ChildFailed, run_child

WORKLOADS = ("adamw", "sgd_cosine", "adamw_clip", "uncompiled", "generate", "generate_static")


def _optimizer(name: str, params):
    import torch

    if name == "sgd_cosine":
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    return torch.optim.AdamW(params, lr=1e-2), None


def measure(workload: str, steps: int) -> dict:
    """In this process: ``steps`` steps of ``workload``; per step the graphs compiled and executables run."""
    import torch

    import neuron_compile
    from neuron_compile import STATS

    neuron_compile.device.register()
    torch.manual_seed(0)
    compiled_per_step, runs_per_step, seconds = [], [], []

    def counted(fn) -> None:
        c0, r0, b0 = STATS.eager_ops_compiled + len(STATS.graphs), STATS.device_graph_runs, time.perf_counter()
        fn()
        torch.neuron.synchronize()
        compiled_per_step.append(STATS.eager_ops_compiled + len(STATS.graphs) - c0)
        runs_per_step.append(STATS.device_graph_runs - r0)
        seconds.append(time.perf_counter() - b0)

    if workload == "generate_static":
        from transformers import StoppingCriteria

        from tests.model_zoo import llama

        model = llama().model.eval().to("neuron")
        ids = torch.randint(3, 64, (1, 5), generator=torch.Generator().manual_seed(4)).to("neuron")
        marks = []

        class Mark(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                torch.neuron.synchronize()
                marks.append(
                    (STATS.eager_ops_compiled + len(STATS.graphs), STATS.device_graph_runs, time.perf_counter())
                )
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        out = model.generate(ids, max_new_tokens=steps + 1, do_sample=False, cache_implementation="static",
                             stopping_criteria=[Mark()])  # fmt: skip
        for a, b in zip(marks, marks[1:]):
            compiled_per_step.append(b[0] - a[0])
            runs_per_step.append(b[1] - a[1])
            seconds.append(b[2] - a[2])
        result = out.cpu().tolist()
    elif workload == "generate":
        from tests.model_zoo import llama

        model = llama().model.eval().to("neuron")
        ids = torch.randint(3, 64, (1, 5), generator=torch.Generator().manual_seed(4)).to("neuron")
        cache = None
        with torch.no_grad():
            for _ in range(steps):

                def token() -> None:
                    nonlocal ids, cache
                    out = model(input_ids=ids if cache is None else ids[:, -1:], past_key_values=cache, use_cache=True)
                    cache = out.past_key_values
                    ids = torch.cat([ids, out.logits[:, -1:].argmax(-1)], dim=1)

                counted(token)
        result = ids.cpu().tolist()
    else:
        from tests.device_training import decoder_batches
        from tests.models import Decoder

        model = Decoder(vocab=64, d=32, heads=4, layers=2, seq=16).to("neuron")
        forward = model if workload == "uncompiled" else torch.compile(model, backend="neuron", dynamic=False)
        opt, sched = _optimizer(workload, model.parameters())
        losses = []
        for batch in decoder_batches(steps):

            def step(batch=batch) -> None:
                opt.zero_grad()
                loss = forward(*(t.to("neuron") for t in batch))
                loss.backward()
                if workload == "adamw_clip":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                if sched is not None:
                    sched.step()
                losses.append(loss.item())

            counted(step)
        result = losses
    steady = slice(2, None)
    return {
        "workload": workload,
        "compiled": compiled_per_step,
        "runs": runs_per_step,
        "steady_compiled": statistics.median(compiled_per_step[steady]),
        "steady_runs": statistics.median(runs_per_step[steady]),
        "steady_seconds": statistics.median(seconds[steady]),
        "result": result,
    }


def spawn(workload: str, steps: int, target: str, mode: str) -> dict:
    from tests import device_sim

    with tempfile.TemporaryDirectory(prefix="neuron_device_steady_") as work:
        env = {
            **os.environ,
            "NEURON_COMPILE_TARGET": target,
            "NEURON_COMPILE_EAGER_MODE": mode,
            "NEURON_COMPILE_CACHE_DIR": os.path.join(work, "cache"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(work, "inductor"),
            "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
        }
        if target == "neuron":
            env.update(device_sim.environment(os.path.join(work, "sim")))
        try:
            return run_child("device_steady", ["--worker", json.dumps([workload, steps])], env=env)
        except ChildFailed as e:
            raise SystemExit(f"{workload} on {target} ({mode}) failed:\n{e.stderr[-4000:]}") from None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--targets", default="cpu,neuron")
    ap.add_argument("--modes", default="op,lazy")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        workload, steps = json.loads(args.worker)
        print(json.dumps(measure(workload, steps)))
        return
    print(f"{'workload':<11} {'target':<7} {'mode':<5} {'compiled per step':<34} {'steady: compiled':>16} "
          f"{'runs':>5} {'step':>9}")  # fmt: skip
    for workload in args.workloads.split(","):
        for target in args.targets.split(","):
            results = {}
            for mode in args.modes.split(","):
                r = results[mode] = spawn(workload, args.steps, target, mode)
                shown = " ".join(str(c) for c in r["compiled"])
                print(
                    f"{workload:<11} {target:<7} {mode:<5} {shown:<34} {r['steady_compiled']:>16g} "
                    f"{r['steady_runs']:>5g} {r['steady_seconds'] * 1e3:7.1f} ms",
                    flush=True,
                )
            if len({json.dumps(r["result"]) for r in results.values()}) > 1:
                print(
                    f"  note: {workload} on {target}: the modes' results differ (float rounding order)", file=sys.stderr
                )


if __name__ == "__main__":
    main()
