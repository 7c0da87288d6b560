"""Cold start on the device simulator: the first training step with a compile delay of D seconds per graph.

Each measurement is a fresh process with an empty compile cache and the simulator switched on
(``tests/device_sim``; its fake neuronx-cc sleeps ``NRTSIM_COMPILE_DELAY`` seconds per compile, standing for a
real compile of minutes). The first step's forward and backward both run on the simulated NeuronCore: the
process asserts that every graph ran through libnrt, and compares the loss with eager.

Workloads:
  demo      the demo's TinyLM (2 blocks, one Dynamo graph: a forward and a backward NEFF), AdamW
  regional  4 distinct blocks, each compiled on its own (regional compilation: 4 Dynamo graphs, 8 NEFFs)

Reported per compile_jobs setting: the fastest first step at D and at D=0 over the rounds, the excess (their
difference) as a multiple of D, and each round's own excess (its D run against its D=0 run): compiled one after
the other the excess is (number of compiles) x D. Every configuration runs in turn in each round, so that the
shared machine's changing load falls on all of them.

    python -m benchmarks.cold_start [--delay 20] [--jobs 0,default] [--workload demo,regional] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from benchmarks import ChildFailed, run_child


def _regional_model():
    from torch import nn

    class Block(nn.Module):
        """Distinct per index (width and activation), so that no two blocks share a compiled graph."""

        def __init__(self, width: int, out: int, act: str) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.fc = nn.Linear(width, out)
            self.act = {"gelu": nn.GELU(), "tanh": nn.Tanh(), "silu": nn.SiLU(), "relu": nn.ReLU()}[act]

        def forward(self, x):
            return self.act(self.fc(self.norm(x)))

    widths = [32, 48, 64, 40, 16]
    acts = ["gelu", "tanh", "silu", "relu"]
    blocks = nn.Sequential(*(Block(widths[i], widths[i + 1], acts[i]) for i in range(4)))
    return blocks


def _simulated_executions() -> int:
    """``nrt_execute`` calls the simulated runtime counted, read from the very library the process loaded (a
    rebuilt one, after an edit of libnrt_sim.c, would count nothing)."""
    from pathlib import Path

    from tests import device_sim

    device_sim.build_libnrt = lambda old_runtime=False: Path(os.environ["NEURON_COMPILE_LIBNRT"])
    return device_sim.counters()["executes"]


def child(workload: str, steps: int) -> dict:
    """One process: the first training step (timed), ``steps`` more, and checks that it all ran on the core."""
    import copy

    import torch
    import torch.nn.functional as F

    from neuron_compile.stats import STATS
    from tests import device_sim

    torch.manual_seed(0)
    if workload == "demo":
        from neuron_compile.demo import TinyLM

        vocab, seq, batch = 64, 16, 4
        eager = TinyLM(vocab=vocab, n_layers=2, seq=seq)
        data = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
        inputs = (data[:, :-1], data[:, 1:])
        model = copy.deepcopy(eager)
        compiled = torch.compile(model, backend="neuron", dynamic=False)

        def loss_of(m, args):
            return m(*args)

    elif workload == "regional":
        eager = _regional_model()
        inputs = (torch.randn(8, 32), torch.randn(8, 16))
        model = copy.deepcopy(eager)
        for block in model:
            block.compile(backend="neuron", dynamic=False)  # regional: each block its own compiled region
        compiled = model

        def loss_of(m, args):
            return F.mse_loss(m(args[0]), args[1])

    else:
        raise SystemExit(f"unknown workload {workload!r}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    times = []
    worst = 0.0
    for step in range(1 + steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_of(compiled, inputs)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        if step == 0:
            # executions through libnrt, by our binding and by the simulated runtime the process loaded
            executions = STATS.device_executions
            simulated = _simulated_executions()
            kinds = sorted({g.kind for g in STATS.graphs})
            graphs = len(STATS.graphs)
        opt_eager.zero_grad()
        ref = loss_of(eager, inputs)
        ref.backward()
        opt_eager.step()
        worst = max(worst, abs(float(loss) - float(ref)))
    return {
        "workload": workload,
        "first_step_s": times[0],
        "later_step_s": min(times[1:]) if steps else None,
        "graphs": graphs,
        "kinds": kinds,
        "executions_in_first_step": executions,
        "simulated_executions_in_first_step": simulated,
        "compiles": device_sim.compiler_invocations(),
        "max_loss_diff": worst,
    }


def spawn(workload: str, delay: float, jobs: int | None, extra_env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="neuron_cold_start_") as work:
        from tests import device_sim

        env = {
            **os.environ,
            **device_sim.environment(os.path.join(work, "state")),
            "NEURON_COMPILE_TARGET": "neuron",
            "NEURON_COMPILE_CACHE_DIR": os.path.join(work, "cache"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(work, "inductor"),
            "NRTSIM_COMPILE_DELAY": str(delay),
            **extra_env,
        }
        if jobs is not None:
            env["NEURON_COMPILE_JOBS"] = str(jobs)
        try:
            return run_child("cold_start", ["--child", workload], env=env)
        except ChildFailed as e:
            return {"workload": workload, "error": e.stderr.strip()[-2000:]}


def _jobs_label(jobs: int | None) -> str:
    return "default" if jobs is None else str(jobs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delay", type=float, default=20.0, help="seconds each simulated compile takes (D)")
    ap.add_argument(
        "--jobs",
        default="default",
        help="option compile_jobs, or several comma-separated (e.g. 0,default: before and after, interleaved)",
    )
    ap.add_argument("--workload", default="demo,regional")
    ap.add_argument("--repeat", type=int, default=1, help="rounds; each runs every configuration once, in turn")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the measured processes")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return
    extra = dict(e.split("=", 1) for e in args.env)
    job_settings = [None if j.strip() == "default" else int(j) for j in args.jobs.split(",")]
    print(f"cold start on the device simulator: D = {args.delay:g} s per compile, compile_jobs "
          f"{', '.join(_jobs_label(j) for j in job_settings)}{', ' + ' '.join(args.env) if args.env else ''}; "
          f"each run a fresh process and an empty cache; {args.repeat} round(s), configurations in turn")  # fmt: skip
    print(f"{'workload':<10} {'jobs':>7} {'graphs':>6} {'first step D=0':>15} {'first step D':>13} "
          f"{'excess / D':>10}  {'per round':<18} checks")  # fmt: skip
    for workload in args.workload.split(","):
        # every configuration in turn, round after round, so that a change of the machine's load falls on all
        runs: dict[tuple[int | None, float], list[dict]] = {(j, d): [] for j in job_settings for d in (0.0, args.delay)}
        failed = False
        for _ in range(args.repeat):
            for (jobs, delay), results in runs.items():
                r = spawn(workload, delay, jobs, extra)
                if "error" in r:
                    print(f"{workload:<10} jobs {_jobs_label(jobs)} D={delay:g}: FAILED\n{r['error']}")
                    failed = True
                    break
                results.append(r)
            if failed:
                break
        if failed:
            continue
        for jobs in job_settings:
            zeros, slows = runs[(jobs, 0.0)], runs[(jobs, args.delay)]
            # per round: the D run against the D=0 run next to it; overall: the fastest of each
            per_round = [(s["first_step_s"] - z["first_step_s"]) / args.delay for z, s in zip(zeros, slows)]
            zero = min(zeros, key=lambda r: r["first_step_s"])
            slow = min(slows, key=lambda r: r["first_step_s"])
            excess = (slow["first_step_s"] - zero["first_step_s"]) / args.delay
            checks = (f"{min(r['executions_in_first_step'] for r in slows)} NEFF executions in step 1 (simulated "
                      f"runtime: {min(r['simulated_executions_in_first_step'] for r in slows)}), "
                      f"{slow['compiles']} compiles, kinds {'/'.join(slow['kinds'])}, "
                      f"|loss - eager| <= {max(r['max_loss_diff'] for r in slows):.1e}")  # fmt: skip
            print(f"{workload:<10} {_jobs_label(jobs):>7} {slow['graphs']:>6} {zero['first_step_s']:>14.2f}s "
                  f"{slow['first_step_s']:>12.2f}s {excess:>10.2f}  {' '.join(f'{x:.2f}' for x in per_round):<18} "
                  f"{checks}")  # fmt: skip


if __name__ == "__main__":
    main()
