"""Demo: train a small transformer language model with backend="neuron" next to eager.

    python -m neuron_compile.demo [--steps N] [--layers N] [--dtype float32|bfloat16] [--device cpu|neuron]

Prints the loss of each step (compiled and eager), each compiled graph with its op count, lowering and
compile time and cache state, and the totals. ``--device neuron`` trains the model on the ``neuron`` device
(docs/device.md): its parameters, gradients and AdamW's state stay there, and each step prints the bytes that
crossed the host boundary.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import device as neuron_device
from .options import Options, human_size, neuron_toolchain
from .stats import STATS


class Block(nn.Module):
    """Pre-norm transformer block: causal multi-head attention via SDPA, GELU MLP."""

    def __init__(self, d_model: int = 32, n_heads: int = 4) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    """Embedding -> N blocks -> layer_norm -> vocab head; returns the next-token cross-entropy."""

    def __init__(self, vocab: int = 64, d_model: int = 32, n_heads: int = 4, n_layers: int = 2, seq: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--device", choices=["cpu", "neuron"], default="cpu", help="where the model's tensors live (default: cpu)"
    )
    args = parser.parse_args(argv)
    on_device = args.device == "neuron"
    if on_device and not neuron_device.register():
        parser.error(f"--device neuron: {neuron_device.NOT_REGISTERED}")
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(0)
    vocab, seq, batch = 64, 16, 4
    eager = TinyLM(vocab=vocab, n_layers=args.layers, seq=seq).to(dtype)
    model = copy.deepcopy(eager).to(args.device)
    compiled = torch.compile(model, backend="neuron", dynamic=False)
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=3e-3)
    # on the device AdamW runs there op by op; capturable: its step count stays a device tensor
    opt_neuron = torch.optim.AdamW(model.parameters(), lr=3e-3, capturable=on_device)
    data = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    idx, targets = data[:, :-1], data[:, 1:]

    target = Options.from_user(None).target  # what backend="neuron" resolves "auto" to here
    found = neuron_toolchain()[1]
    where = (
        f"neuron (neuronx-cc compiles NEFFs, libnrt runs them: {found})"
        if target == "neuron"
        else f"cpu (XLA CPU runs the StableHLO; {found} for the neuron target)"
    )
    print(
        f"neuron_compile demo: TinyLM ({args.layers} blocks, {sum(p.numel() for p in model.parameters())} "
        f"params, {args.dtype}), AdamW, {args.steps} steps, target {where}"
        + (", tensors on the 'neuron' device" if on_device else "")
    )
    crossing = f" {'to device':>10} {'to host':>8}" if on_device else ""
    print(f"{'step':>4} {'loss (neuron)':>14} {'loss (eager)':>13} {'|diff|':>9} {'step s':>8}{crossing}")
    worst = 0.0
    for step in range(args.steps):
        h2d, d2h = STATS.host_to_device_bytes, STATS.device_to_host_bytes
        t0 = time.perf_counter()
        opt_neuron.zero_grad()
        loss = compiled(idx.to(args.device), targets.to(args.device))
        loss.backward()
        opt_neuron.step()
        loss_value = loss.item()
        elapsed = time.perf_counter() - t0
        crossing = (
            f" {STATS.host_to_device_bytes - h2d:>10,} {STATS.device_to_host_bytes - d2h:>8,}" if on_device else ""
        )
        opt_eager.zero_grad()
        ref = eager(idx, targets)
        ref.backward()
        opt_eager.step()
        diff = abs(loss_value - ref.item())
        worst = max(worst, diff)
        print(f"{step:>4} {loss_value:>14.6f} {ref.item():>13.6f} {diff:>9.2e} {elapsed:>8.3f}{crossing}")
    if on_device:
        print(
            f"  bytes crossing per step: the batch ({idx.numel() * idx.element_size() * 2:,} bytes of token ids), the "
            "loss read (4) and 1 for the value checks run on the device; the model crossed once, before step 0"
        )

    print("\ncompiled graphs:")
    print(
        f"  {'graph':<22} {'kind':<10} {'aten ops':>8} {'NKI sites':>9} {'lower s':>8} {'compile s':>9} {'cache':>6} "
        f"{'HBM peak':>10}"
    )
    one_op = [g for g in STATS.graphs if g.name.startswith("eager_")]  # the device's eager ops (docs/device.md)
    graphs = [g for g in STATS.graphs if not g.name.startswith("eager_")]
    for g in graphs:
        peak = human_size(g.hbm_peak) if g.hbm_peak is not None else "-"
        print(
            f"  {g.name:<22} {g.kind:<10} {g.num_ops:>8} {g.nki_kernels:>9} {g.lower_seconds:>8.3f} "
            f"{g.compile_seconds:>9.3f} {g.cache:>6} {peak:>10}"
        )
    if one_op:
        print(
            f"  eager ops on the device: {STATS.eager_ops_run} run as {len(one_op)} one-op graphs (AdamW's step, "
            "the backward's seed, ...), each compiled once"
        )
    peaks = [g.hbm_peak for g in graphs if g.hbm_peak is not None]
    if peaks:
        from .hbm import fit_line

        print(
            f"  HBM peak: estimated on one NeuronCore (I/O + intermediates + scratchpad, as neuronx-cc budgets it); "
            f"the largest, {human_size(max(peaks))}, {fit_line(max(peaks))}"
        )
    total_ops = sum(g.num_ops for g in graphs)
    sites = sum(g.nki_kernels for g in graphs)
    hits = sum(1 for g in graphs if g.cache == "hit")
    print(
        f"  {len(graphs)} graphs, {total_ops} aten ops lowered to StableHLO, {sites} of them NKI kernel sites "
        + (
            "(NKI kernels compiled by nki, or their reference StableHLO where nki is not installed), "
            if target == "neuron"
            else "(their StableHLO reference on the CPU target; options={'kernels': 'emulate'} runs the kernels), "
        )
        + f"cache hits {hits}/{len(graphs)}"
    )
    from .cache import cache_stats

    stats = cache_stats()
    print(
        f"  compile cache ({'on' if stats['hits'] + stats['misses'] else 'off'}): {int(stats['hits'])} hits, "
        f"{int(stats['misses'])} misses, {stats['compile_seconds_saved']:.2f} s of compiling saved "
        "(run the demo again: the second run hits the on-disk cache)"
    )
    if STATS.device_executions:
        print(
            f"  NeuronCore transfers: {STATS.device_executions} executions, {STATS.device_bytes_written:,} bytes "
            f"written (host tensors: every input at every call), {STATS.device_bytes_read:,} bytes read"
        )
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    ok = worst <= tol * max(1.0, abs(ref.item()))
    print(f"max |loss(neuron) - loss(eager)| = {worst:.2e} -> {'MATCH' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
