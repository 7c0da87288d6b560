"""Benchmark of the built-in NKI kernels under the emulator's counters and the cost model.

    python benchmarks/nki_kernels.py [--target trn2|trn3] [--emulate-limit N]

For each kernel and shape it prints the instructions per engine, bytes moved between HBM and SBUF, the
estimated time on one NeuronCore (neuron_compile/kernels/cost.py: published Trn2/Trn3 figures, engines
overlapped, nothing measured on hardware) and the fraction of roofline (ideal time: TensorE peak for
the useful flops or HBM bandwidth for the essential bytes, whichever is longer).

Shapes up to ``--emulate-limit`` elements per input are fully emulated (with data; the wall time is
shown); bigger ones run in the emulator's shape-only mode, which issues and counts exactly the same
instructions without computing — the counters and the estimate are identical, only numerics are skipped.
Goals (printed, not tested): matmul >= 80% and flash attention >= 60% of roofline at the largest shapes,
and the emulator runs a 1024^3 bf16 matmul in under 10 s.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from neuron_compile import nki
from neuron_compile.kernels import KERNELS, cost

BF16 = ml_dtypes.bfloat16


def _arr(shape: tuple[int, ...], dtype: Any, data: bool) -> np.ndarray:
    if not data:
        return np.broadcast_to(np.zeros((), dtype), shape)  # shape-only: no memory
    return np.random.default_rng(0).standard_normal(shape, dtype=np.float32).astype(dtype)


def _cases() -> list[tuple[str, str, Callable[[bool], tuple], float, float]]:
    """(kernel, label, args(data) -> args, useful flops, essential HBM bytes)."""
    cases = []
    for n in (512, 1024, 2048, 4096):
        cases.append(("matmul", f"{n}x{n}x{n} bf16",
                      lambda d, n=n: (_arr((n, n), BF16, d), _arr((n, n), BF16, d)),
                      2.0 * n ** 3, 3 * n * n * 2))
    for s in (512, 1024, 2048, 4096):
        for causal in (False, True):
            frac = 0.5 if causal else 1.0
            tag = "causal" if causal else "full"
            cases.append(("flash_attention_fwd", f"S={s} d=128 {tag} bf16",
                          lambda d, s=s, c=causal: (*(_arr((1, 1, s, 128), BF16, d) for _ in range(3)), c),
                          4.0 * s * s * 128 * frac, 4 * s * 128 * 2 + s * 4))
        cases.append(("flash_attention_bwd", f"S={s} d=128 causal bf16",
                      lambda d, s=s: (*(_arr((1, 1, s, 128), BF16, d) for _ in range(5)),
                                      _arr((1, 1, s), np.float32, d), True),
                      10.0 * s * s * 128 * 0.5, 8 * s * 128 * 2 + s * 4))
    r = h = 4096
    cases += [
        ("rms_norm", f"{r}x{h} bf16", lambda d: (_arr((r, h), BF16, d), _arr((h,), BF16, d), 1e-6), 0.0,
         2 * r * h * 2 + h * 2),
        ("rms_norm_bwd", f"{r}x{h} bf16", lambda d: (_arr((r, h), BF16, d), _arr((r, h), BF16, d),
                                                     _arr((h,), BF16, d), 1e-6), 0.0, 3 * r * h * 2 + 2 * h * 2),
        ("layer_norm", f"{r}x{h} bf16", lambda d: (_arr((r, h), BF16, d), _arr((h,), BF16, d),
                                                   _arr((h,), BF16, d), 1e-5), 0.0, 2 * r * h * 2 + 2 * h * 2),
        ("layer_norm_bwd", f"{r}x{h} bf16", lambda d: (_arr((r, h), BF16, d), _arr((r, h), BF16, d),
                                                       _arr((h,), BF16, d), 1e-5), 0.0, 3 * r * h * 2 + 3 * h * 2),
        ("softmax", f"{r}x{h} bf16", lambda d: (_arr((r, h), BF16, d),), 0.0, 2 * r * h * 2),
        ("swiglu", f"{r}x{h} bf16", lambda d: (_arr((r, h), BF16, d), _arr((r, h), BF16, d)), 0.0, 3 * r * h * 2),
    ]
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="trn2", choices=["trn1", "trn2", "trn3"])
    ap.add_argument("--emulate-limit", type=int, default=1024 * 1024,
                    help="fully emulate (with data) when every input has at most this many elements")
    args = ap.parse_args()
    gen = cost.generation(args.target)
    print(f"NKI kernels on {gen.name} (one NeuronCore; estimates from neuron_compile/kernels/cost.py, "
          "never measured on hardware)")
    print(f"TensorE {gen.tensor_tflops_bf16} TF bf16 @ {gen.tensor_ghz} GHz; HBM<->SBUF "
          f"{gen.hbm_bytes_per_s_per_core / 1e9:.0f} GB/s per core\n")
    hdr = (f"{'kernel':<20} {'shape':<26} {'mode':<18} {'Tensor':>7} {'Vector':>7} {'Scalar':>7} {'GpSimd':>7} "
           f"{'DMA':>6} {'HBM MB':>8} {'est us':>9} {'bound':>7} {'% roof':>7}")
    print(hdr)
    print("-" * len(hdr))
    results: dict[tuple[str, str], float] = {}
    for name, label, make, flops, nbytes in _cases():
        kernel = KERNELS[name].kernel
        probe = make(False)
        emulate = all(a.size <= args.emulate_limit for a in probe if isinstance(a, np.ndarray))
        t0 = time.perf_counter()
        if emulate:
            _, st = nki.simulate(kernel, stats=True, target=gen.name)(*make(True))
            mode = f"emulated {time.perf_counter() - t0:5.2f}s"
        else:
            _, st = nki.infer_shapes(kernel, stats=True, target=gen.name)(*probe)
            mode = f"shape-only {time.perf_counter() - t0:4.1f}s"
        est = cost.estimate(st, gen)
        roof = cost.roofline_seconds(flops, nbytes, gen)
        pct = roof / est.seconds
        results[(name, label)] = pct
        n = st.instructions()
        print(f"{name:<20} {label:<26} {mode:<18} {n['tensor']:>7} {n['vector']:>7} {n['scalar']:>7} "
              f"{n['gpsimd']:>7} {n['dma']:>6} {st.dma_bytes / 1e6:>8.1f} {est.seconds * 1e6:>9.1f} "
              f"{est.bottleneck:>7} {pct:>6.0%}")
    print("\nGoals (estimated, largest shapes):")
    for name, label, goal in (("matmul", "4096x4096x4096 bf16", 0.80),
                              ("flash_attention_fwd", "S=4096 d=128 full bf16", 0.60),
                              ("flash_attention_fwd", "S=4096 d=128 causal bf16", 0.60)):
        pct = results[(name, label)]
        print(f"  {name} {label}: {pct:.0%} of roofline (goal >= {goal:.0%}): {'met' if pct >= goal else 'MISSED'}")
    a = _arr((1024, 1024), BF16, True)
    t0 = time.perf_counter()
    nki.simulate(KERNELS["matmul"].kernel)(a, a)
    wall = time.perf_counter() - t0
    print(f"  emulator wall time, 1024^3 bf16 matmul with data: {wall:.2f} s (goal < 10 s): "
          f"{'met' if wall < 10 else 'MISSED'}")


if __name__ == "__main__":
    main()
