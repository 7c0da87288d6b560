"""Compile-cache benchmark: a small hand-written GPT decoder, one training step (forward + backward).

Every measurement runs in a fresh process (``python -m benchmarks.cache`` spawns them):
  neuron cold   empty cache dir            neuron warm   same dir, new process (disk hits)
  aot_eager     (no persistent cache)      inductor cold/warm  fresh / reused TORCHINDUCTOR_CACHE_DIR
and reports the backend's own compile phase (time inside the cache lookup: lowering + XLA compile on a
miss; key + read + verify + deserialize on a hit), the end-to-end first step, a steady-state step and
the disk size of the entries.

    python -m benchmarks.cache [--layers 4] [--skip-inductor]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

VOCAB, SEQ, BATCH = 256, 32, 4


def build_model(layers: int, width: int = 64, heads: int = 4):
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
            self.register_buffer("causal", torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)))

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(x).split(width, dim=-1)
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // heads))
            att = att.masked_fill(~self.causal[:t, :t], float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).reshape(b, t, c)
            return self.proj(y)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.attn = Attention()
            self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(VOCAB, width), nn.Embedding(SEQ, width)
            self.blocks = nn.ModuleList([Block() for _ in range(layers)])
            self.ln = nn.LayerNorm(width)
            self.head = nn.Linear(width, VOCAB, bias=False)
            self.register_buffer("positions", torch.arange(SEQ))

        def forward(self, idx, target_onehot):
            x = self.tok(idx) + self.pos(self.positions[: idx.shape[1]])
            for block in self.blocks:
                x = block(x)
            logp = self.head(self.ln(x)).log_softmax(dim=-1)
            # cross entropy written with a one-hot target (no gather/nll_loss needed)
            return -(logp * target_onehot).sum(-1).mean()

    return GPT()


def child(backend: str, layers: int) -> dict:
    """One process: build, compile and run the first training step; report timings."""
    t_start = time.perf_counter()
    import torch

    result: dict = {"backend": backend}
    phase = {"seconds": 0.0, "build_seconds": 0.0}
    if backend == "neuron":
        import neuron_compile.compiler as C
        from neuron_compile.stats import STATS

        real_cache_for = C.cache_for

        class Timed:
            def __init__(self, inner):
                self.inner = inner

            def _timed(self, method, *args):
                t0 = time.perf_counter()
                try:
                    return getattr(self.inner, method)(*args)
                finally:
                    phase["seconds"] += time.perf_counter() - t0

            def get_or_build(self, gm, example_inputs, opts, build):
                return self._timed("get_or_build", gm, example_inputs, opts, build)

            def load(self, digest, opts):  # a hit of AOTAutograd's cache names our entry (aot_cache.py)
                return self._timed("load", digest, opts)

        C.cache_for = lambda opts: Timed(real_cache_for(opts))
    torch.manual_seed(0)
    model = build_model(layers)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ))
    target = torch.nn.functional.one_hot(torch.randint(0, VOCAB, (BATCH, SEQ)), VOCAB).float()
    import_seconds = time.perf_counter() - t_start
    cmodel = torch.compile(model, backend=backend, dynamic=False)
    t0 = time.perf_counter()
    loss = cmodel(idx, target)
    loss.backward()
    result["first_step_s"] = time.perf_counter() - t0
    steps = []
    for _ in range(5):
        model.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        cmodel(idx, target).backward()
        steps.append(time.perf_counter() - t1)
    result["step_ms"] = 1000 * statistics.median(steps)
    result["import_s"] = import_seconds
    result["loss"] = float(loss.detach())
    model.zero_grad(set_to_none=True)
    ref = model(idx, target)
    result["loss_err"] = abs(float(ref) - result["loss"])
    if backend == "neuron":
        result["compile_phase_s"] = phase["seconds"]
        result["build_s"] = sum(g.lower_seconds + g.compile_seconds for g in STATS.graphs if g.cache == "miss")
        result["states"] = [g.cache for g in STATS.graphs]
        result["num_ops"] = [g.num_ops for g in STATS.graphs]
    return result


def spawn(backend: str, layers: int, env: dict[str, str]) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.cache", "--child", backend, "--layers", str(layers)]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, cwd=repo)
    if proc.returncode != 0:
        return {"backend": backend, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "?"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--skip-inductor", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers)))
        return

    work = tempfile.mkdtemp(prefix="neuron_cache_bench_")
    ncache, icache = os.path.join(work, "neuron"), os.path.join(work, "inductor")
    runs = {
        "neuron cold": spawn("neuron", args.layers, {"NEURON_COMPILE_CACHE_DIR": ncache}),
        "neuron warm": spawn("neuron", args.layers, {"NEURON_COMPILE_CACHE_DIR": ncache}),
        "aot_eager cold": spawn("aot_eager", args.layers, {}),
        "aot_eager warm": spawn("aot_eager", args.layers, {}),
    }
    if not args.skip_inductor:
        runs["inductor cold"] = spawn("inductor", args.layers, {"TORCHINDUCTOR_CACHE_DIR": icache})
        runs["inductor warm"] = spawn("inductor", args.layers, {"TORCHINDUCTOR_CACHE_DIR": icache})

    print(f"GPT decoder: {args.layers} layers, width 64, 4 heads, vocab {VOCAB}, batch {BATCH}x{SEQ}; "
          "one training step (fw+bw), each row a fresh process\n")  # fmt: skip
    print(f"{'run':<16} {'first step':>11} {'compile phase':>14} {'steady step':>12}  notes")
    for name, r in runs.items():
        if "error" in r:
            print(f"{name:<16} FAILED: {r['error']}")
            continue
        phase = f"{r['compile_phase_s']:.3f}s" if "compile_phase_s" in r else "-"
        notes = f"cache {','.join(r['states'])}" if "states" in r else ""
        if "build_s" in r and r["build_s"]:
            notes += f" (lowering+compile {r['build_s']:.3f}s)"
        notes += f" |loss-eager|={r['loss_err']:.1e}"
        print(f"{name:<16} {r['first_step_s']:>10.3f}s {phase:>14} {r['step_ms']:>10.2f}ms  {notes}")

    from neuron_compile.cache.store import DiskStore
    from neuron_compile.cli import human_size

    entries = list(DiskStore(ncache).entries())
    if entries:
        sizes = ", ".join(human_size(e.size) for e in entries)
        print(f"\nneuron cache entries: {len(entries)} ({sizes}); total {human_size(sum(e.size for e in entries))}")
    cold, warm, aot = runs["neuron cold"], runs["neuron warm"], runs["aot_eager warm"]
    if not any("error" in r for r in (cold, warm, aot)):
        speedup = cold["compile_phase_s"] / max(warm["compile_phase_s"], 1e-9)
        ratio = warm["first_step_s"] / aot["first_step_s"]
        print(
            f"compile phase, hit vs cold: {speedup:.1f}x faster  (target >= 10x: {'met' if speedup >= 10 else 'NOT met'})"
        )
        print(f"warm first step vs aot_eager: {ratio:.2f}x  (target <= 1.2x: {'met' if ratio <= 1.2 else 'NOT met'})")
    print(f"\n(work dir {work})")


if __name__ == "__main__":
    main()
