"""Bytes crossing the host boundary per training step, with host tensors and with the ``neuron`` device.

The workload is issue 47's: a 10 MB decoder (``tests.models.Decoder``: 4 layers, d=256, vocab 512, tied
embeddings, rotary, causal SDPA, SwiGLU; 2.75M parameters), batch 4 x 128, AdamW, the model compiled with
``backend="neuron"``. Configurations:

  (a)  host    today's host tensors: every compiled graph's inputs go to the core and its outputs come back;
               AdamW eager on the host
  (a') host+c  host tensors with the optimizer step compiled too
  (b)  device  the model on ``neuron``, AdamW eager on the device (``capturable=True``, op by op)
  (c)  device+c  the model on ``neuron``, the optimizer step compiled (``torch.compile(opt.step)``)

each in a fresh process with its own caches, on the device simulator (the neuron target: fake neuronx-cc and
libnrt, whose own counters are printed beside ours) and on the CPU target (XLA CPU: host tensors cross
nothing there, so (a)'s bytes are not measured on it, only its time). Reported per steady-state step (the
median over steps 2..N): bytes to the device, bytes to the host, and the step's time.

``--first-step D``: the first eager AdamW step of the device on the simulator with a compile of D seconds
(``NRTSIM_COMPILE_DELAY``), every one-op graph of the step compiled then, against the compiled step (c) and
against a second process that finds them all in the compile cache.

    python -m benchmarks.device_bytes [--steps 5] [--targets neuron,cpu] [--first-step 2] [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from benchmarks import REPO, ChildFailed, run_child

#: (label, model on the device, optimizer step)
MODES = {
    "host": ("(a) host", False, "eager"),
    "host_compiled": ("(a') host+c", False, "compiled"),
    "device": ("(b) device", True, "eager"),
    "device_compiled": ("(c) device+c", True, "compiled"),
}
#: Issue 47's decoder and batch; --small: the tests' decoder (for a smoke test).
SIZES = {
    "issue": {"model": {"vocab": 512, "d": 256, "heads": 4, "layers": 4, "seq": 128}, "batch": 4},
    "small": {"model": {"vocab": 64, "d": 32, "heads": 4, "layers": 2, "seq": 16}, "batch": 4},
}


def measure(mode: str, steps: int, size: str) -> dict:
    """In this process: ``steps`` training steps of ``mode``; bytes per step (ours and, on the simulator, the
    simulated runtime's), seconds per step."""
    import torch

    from neuron_compile.options import Options
    from tests.device_training import decoder_batches, train
    from tests.models import Decoder

    _, on_device, optimizer = MODES[mode]
    config = SIZES[size]
    torch.manual_seed(0)
    model = Decoder(**config["model"])
    if on_device:
        model = model.to("neuron")
    sim = Options.from_user(None).target == "neuron"
    simulated: list[tuple[int, int]] = []

    def runtime_counters() -> None:
        if sim:
            from tests import device_sim

            c = device_sim.counters()
            simulated.append((c["bytes_written"], c["bytes_read"]))

    runtime_counters()
    batches = decoder_batches(steps, vocab=config["model"]["vocab"], batch=config["batch"], seq=config["model"]["seq"])
    run, _ = train(model, batches, optimizer, on_step=runtime_counters)
    steady = slice(1, None)
    out = {
        "mode": mode,
        "target": "neuron" if sim else "cpu",
        "parameters": sum(p.numel() for p in model.parameters()),
        "batch_bytes": sum(t.numel() * t.element_size() for t in batches[0]),
        "to_device": statistics.median(h for h, _ in run.crossing[steady]),
        "to_host": statistics.median(d for _, d in run.crossing[steady]),
        "seconds": statistics.median(run.seconds[steady]),
        "losses": run.losses,
    }
    if sim:
        per_step = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(simulated, simulated[1:])][steady]
        out["runtime_to_device"] = statistics.median(w for w, _ in per_step)
        out["runtime_to_host"] = statistics.median(r for _, r in per_step)
    return out


def first_step(optimizer: str, size: str) -> dict:
    """In this process (the simulator, its compile delay set by the caller): the first optimizer step of the
    device timed on its own, with the one-op graphs and compiles it took."""
    import torch

    from neuron_compile import STATS
    from tests import device_sim
    from tests.device_training import decoder_batches
    from tests.models import Decoder

    config = SIZES[size]
    torch.manual_seed(0)
    model = Decoder(**config["model"]).to("neuron")
    compiled = torch.compile(model, backend="neuron", dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
    step = torch.compile(opt.step, backend="neuron", dynamic=False) if optimizer == "compiled" else opt.step
    (batch,) = decoder_batches(1, vocab=config["model"]["vocab"], batch=config["batch"], seq=config["model"]["seq"])
    loss = compiled(*(t.to("neuron") for t in batch))
    loss.backward()
    torch.neuron.synchronize()
    compiles, graphs = device_sim.compiler_invocations(), STATS.eager_ops_compiled
    start = time.perf_counter()
    step()
    torch.neuron.synchronize()
    seconds = time.perf_counter() - start
    return {
        "optimizer": optimizer,
        "seconds": seconds,
        "compiles": device_sim.compiler_invocations() - compiles,
        "one_op_graphs": STATS.eager_ops_compiled - graphs,
        "eager_ops_run": STATS.eager_ops_run,
        "loss": loss.item(),
    }


def spawn(args: list[str], target: str, work: str, delay: float = 0.0) -> dict:
    """Run this file's ``--worker`` in a fresh process on ``target`` with the caches under ``work``."""
    from tests import device_sim

    env = {
        **os.environ,
        "NEURON_COMPILE_TARGET": target,
        "NEURON_COMPILE_CACHE_DIR": os.path.join(work, "cache"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(work, "inductor"),
        "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
    }
    if target == "neuron":
        env.update(device_sim.environment(os.path.join(work, "sim")), NRTSIM_COMPILE_DELAY=str(delay))
    try:
        return run_child("device_bytes", ["--worker", json.dumps(args)], env=env)
    except ChildFailed as e:
        raise SystemExit(f"worker {args} on {target} failed:\n{e.stderr[-4000:]}") from None


def _mb(n: float) -> str:
    return f"{n / 1e6:8.3f} MB" if n >= 1e5 else f"{n:8.0f} B "


def bytes_table(targets: list[str], steps: int, size: str) -> list[dict]:
    rows = []
    print(f"{'config':<13} {'target':<7} {'to device':>11} {'to host':>11} {'runtime w/r (sim)':>25} {'step':>9}")
    for target in targets:
        for mode in MODES:
            with tempfile.TemporaryDirectory(prefix="neuron_device_bytes_") as work:
                r = spawn(["measure", mode, steps, size], target, work)
            rows.append(r)
            runtime = ""
            if "runtime_to_device" in r:
                runtime = f"{_mb(r['runtime_to_device'])} / {_mb(r['runtime_to_host']).strip()}"
            crossing = f"{_mb(r['to_device'])} {_mb(r['to_host'])}"
            if target == "cpu" and not MODES[mode][1]:  # XLA CPU reads host tensors where they lie: nothing crosses
                crossing = f"{'-':>11} {'-':>11}"
            print(f"{MODES[mode][0]:<13} {target:<7} {crossing} {runtime:>25} {r['seconds'] * 1e3:7.1f} ms", flush=True)
    if rows:
        r = rows[0]
        print(f"parameters {r['parameters']:,} ({r['parameters'] * 4 / 1e6:.1f} MB), batch {r['batch_bytes']:,} bytes")
    return rows


def first_step_table(delay: float, size: str) -> None:
    print(f"\nfirst optimizer step on the device simulator, D = {delay:g} s per compile (NRTSIM_COMPILE_DELAY):")
    print(f"{'optimizer':<24} {'D = 0':>9} {'D':>9} {'one-op graphs':>14} {'compiles':>9}")
    for optimizer in ("eager", "compiled"):
        with (
            tempfile.TemporaryDirectory(prefix="neuron_device_first_") as cold,
            tempfile.TemporaryDirectory(prefix="neuron_device_first_") as work,
        ):
            at_zero = spawn(["first_step", optimizer, size], "neuron", cold, 0.0)
            at_delay = spawn(["first_step", optimizer, size], "neuron", work, delay)
            warm = spawn(["first_step", optimizer, size], "neuron", work, delay)  # a second process, same cache
        print(
            f"{optimizer + ' AdamW':<24} {at_zero['seconds']:8.1f}s {at_delay['seconds']:8.1f}s "
            f"{at_delay['one_op_graphs']:>14} {at_delay['compiles']:>9}"
        )
        print(
            f"{'  its second process':<24} {'':>9} {warm['seconds']:8.1f}s {warm['one_op_graphs']:>14} {warm['compiles']:>9}"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--targets", default="neuron,cpu")
    ap.add_argument("--first-step", type=float, default=None, metavar="D", help="also the first eager step at D s")
    ap.add_argument("--small", action="store_true", help="the tests' small decoder instead of issue 47's")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    size = "small" if args.small else "issue"
    if args.worker:
        kind, *rest = json.loads(args.worker)
        result = measure(rest[0], int(rest[1]), rest[2]) if kind == "measure" else first_step(rest[0], rest[1])
        print(json.dumps(result))
        return
    print(f"bytes per steady-state training step (median of steps 2..{args.steps}), {time.strftime('%Y-%m-%d')}")
    bytes_table([t for t in args.targets.split(",") if t], args.steps, size)
    if args.first_step is not None:
        first_step_table(args.first_step, size)


if __name__ == "__main__":
    main()
