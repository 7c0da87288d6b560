"""Benchmark of the built-in NKI kernels under the emulator's counters and the cost model.

    python -m benchmarks.nki_kernels [--target trn2|trn3] [--emulate-limit N] [--published]

For each kernel and shape it prints the instructions per engine, bytes moved between HBM and SBUF, the
estimated time (neuron_compile/kernels/cost.py: the critical path of the instruction stream over the engines,
built from published Trn1/Trn2/Trn3 figures; nothing measured on hardware), the number of cores the launch
uses (attention runs as an LNC-2 launch: two physical cores) and the fraction of roofline on those cores
(ideal time: TensorE peak for the useful flops or HBM bandwidth for the essential bytes, whichever is longer).
``--published`` adds the model's estimates next to every figure AWS publishes (docs/nki.md's table).

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
        cases.append(
            (
                "matmul",
                f"{n}x{n}x{n} bf16",
                lambda d, n=n: (_arr((n, n), BF16, d), _arr((n, n), BF16, d)),
                2.0 * n**3,
                3 * n * n * 2,
            )
        )
    for s in (512, 1024, 2048, 4096):
        for causal in (False, True):
            frac = 0.5 if causal else 1.0
            tag = "causal" if causal else "full"
            cases.append(
                (
                    "flash_attention_fwd",
                    f"S={s} d=128 {tag} bf16",
                    lambda d, s=s, c=causal: (*(_arr((1, 1, s, 128), BF16, d) for _ in range(3)), c),
                    4.0 * s * s * 128 * frac,
                    4 * s * 128 * 2 + s * 4,
                )
            )
        cases.append(
            (
                "flash_attention_bwd",
                f"S={s} d=128 causal bf16",
                lambda d, s=s: (
                    *(_arr((1, 1, s, 128), BF16, d) for _ in range(5)),
                    _arr((1, 1, s), np.float32, d),
                    True,
                ),
                10.0 * s * s * 128 * 0.5,
                8 * s * 128 * 2 + s * 4,
            )
        )
    r = h = 4096
    cases += [
        (
            "rms_norm",
            f"{r}x{h} bf16",
            lambda d: (_arr((r, h), BF16, d), _arr((h,), BF16, d), 1e-6),
            0.0,
            2 * r * h * 2 + h * 2,
        ),
        (
            "rms_norm_bwd",
            f"{r}x{h} bf16",
            lambda d: (_arr((r, h), BF16, d), _arr((r, h), BF16, d), _arr((h,), BF16, d), 1e-6),
            0.0,
            3 * r * h * 2 + 2 * h * 2,
        ),
        (
            "layer_norm",
            f"{r}x{h} bf16",
            lambda d: (_arr((r, h), BF16, d), _arr((h,), BF16, d), _arr((h,), BF16, d), 1e-5),
            0.0,
            2 * r * h * 2 + 2 * h * 2,
        ),
        (
            "layer_norm_bwd",
            f"{r}x{h} bf16",
            lambda d: (_arr((r, h), BF16, d), _arr((r, h), BF16, d), _arr((h,), BF16, d), 1e-5),
            0.0,
            3 * r * h * 2 + 3 * h * 2,
        ),
        ("softmax", f"{r}x{h} bf16", lambda d: (_arr((r, h), BF16, d),), 0.0, 2 * r * h * 2),
        ("swiglu", f"{r}x{h} bf16", lambda d: (_arr((r, h), BF16, d), _arr((r, h), BF16, d)), 0.0, 3 * r * h * 2),
    ]
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="trn2", choices=["trn1", "trn2", "trn3"])
    ap.add_argument(
        "--emulate-limit",
        type=int,
        default=1024 * 1024,
        help="fully emulate (with data) when every input has at most this many elements",
    )
    ap.add_argument("--published", action="store_true", help="also compare with AWS's published measurements")
    args = ap.parse_args()
    gen = cost.generation(args.target)
    print(f"NKI kernels on {gen.name} (estimates from neuron_compile/kernels/cost.py, never measured on hardware)")
    print(_assumptions(gen) + "\n")
    hdr = (
        f"{'kernel':<20} {'shape':<26} {'mode':<18} {'Tensor':>7} {'Vector':>7} {'Scalar':>7} {'GpSimd':>7} "
        f"{'DMA':>6} {'HBM MB':>8} {'est us':>9} {'bound':>7} {'cores':>5} {'% roof':>7}"
    )
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
        roof = cost.roofline_seconds(flops, nbytes, gen, cores=est.programs)
        pct = roof / est.seconds
        results[(name, label)] = pct
        n = st.instructions()
        print(
            f"{name:<20} {label:<26} {mode:<18} {n['tensor']:>7} {n['vector']:>7} {n['scalar']:>7} "
            f"{n['gpsimd']:>7} {n['dma']:>6} {st.dma_bytes / 1e6:>8.1f} {est.seconds * 1e6:>9.1f} "
            f"{est.bottleneck:>7} {est.programs:>5} {pct:>6.0%}"
        )
    print("\nGoals (estimated, largest shapes):")
    for name, label, goal in (
        ("matmul", "4096x4096x4096 bf16", 0.80),
        ("flash_attention_fwd", "S=4096 d=128 full bf16", 0.60),
        ("flash_attention_fwd", "S=4096 d=128 causal bf16", 0.50),
        ("flash_attention_bwd", "S=4096 d=128 causal bf16", 0.40),
        ("rms_norm_bwd", "4096x4096 bf16", 0.40),
        ("layer_norm_bwd", "4096x4096 bf16", 0.40),
    ):
        pct = results[(name, label)]
        print(f"  {name} {label}: {pct:.0%} of roofline (goal >= {goal:.0%}): {'met' if pct >= goal else 'MISSED'}")
    a = _arr((1024, 1024), BF16, True)
    t0 = time.perf_counter()
    nki.simulate(KERNELS["matmul"].kernel)(a, a)
    wall = time.perf_counter() - t0
    print(
        f"  emulator wall time, 1024^3 bf16 matmul with data: {wall:.2f} s (goal < 10 s): "
        f"{'met' if wall < 10 else 'MISSED'}"
    )
    if args.published:
        published()


def _assumptions(gen: cost.Generation) -> str:
    return "\n".join(
        [
            "Assumptions (cost.py): critical path over Tensor/Vector/Scalar/GpSimd/DMA with RAW/WAR dependencies per "
            "allocation;",
            f"  TensorE {gen.tensor_tflops_bf16} TF bf16 @ {gen.tensor_ghz} GHz, matmul max(N,64) cycles (x4 fp32), "
            f"warm-up 50%->100% over {cost.PE_WARMUP_S * 1e6:.0f} us"
            + (" (none on trn1)" if gen.name == "trn1" else ""),
            f"  Vector/Scalar/GpSimd: {cost.FIXED_CYCLES:.0f} fixed cycles + N*k/rate per instruction, "
            f"+{cost.DEP_CYCLES:.0f} cycles after a dependency",
            f"  DMA: {gen.hbm_bytes_per_s_per_core / 1e9:.0f} GB/s per core over 16 engines (8 partitions each), "
            f"efficiency by bytes/partition (2 KiB {cost.dma_efficiency(2048):.0%}, 4 KiB {cost.dma_efficiency(4096):.0%}),"
            f" {cost.DMA_FIXED_LATENCY_S * 1e6:.1f} us latency per transfer",
            "  roofline: TensorE peak or HBM bandwidth, x cores of the launch (an LNC-2 attention launch counts 2)",
        ]
    )


# ------------------------------------------------------------------------- published measurements (docs/nki.md)
# Kernels written here from the tutorials' descriptions (not their code), to set the model against AWS's
# published figures: the fused Mamba tutorial's three versions and the matmul tutorial's naive version.
nl, nisa = nki.language, nki.isa
P = 128


@nki.jit
def mamba(delta, u, a, b, c, version, seq_tile=2048):
    """Selective scan (fp32), channels on partitions. v1: everything loaded inside the state loop; v2: delta/u
    and their product hoisted out of it; v3: v2 over sequence tiles of ``seq_tile``, the scan state carried
    from tile to tile through ``initial``."""
    bn, ch, length = delta.shape
    ns = a.shape[1]
    out = nl.ndarray((bn, ch, length), delta.dtype, buffer=nl.shared_hbm)
    tl = length if version < 3 else min(seq_tile, length)
    for bi in range(bn):
        for c0 in range(0, ch, P):
            a_t = nl.load(a[c0 : c0 + P])
            carry = nl.zeros((P, ns), nl.float32, buffer=nl.sbuf) if version == 3 else None
            for l0 in range(0, length, tl):
                sl = slice(l0, l0 + tl)
                y = nl.zeros((P, tl), nl.float32, buffer=nl.sbuf)
                if version >= 2:
                    dl, ut = nl.load(delta[bi, c0 : c0 + P, sl]), nl.load(u[bi, c0 : c0 + P, sl])
                    du = nl.multiply(dl, ut)
                for s in range(ns):
                    if version == 1:
                        dl, ut = nl.load(delta[bi, c0 : c0 + P, sl]), nl.load(u[bi, c0 : c0 + P, sl])
                        du = nl.multiply(dl, ut)
                    decay = nl.ndarray((P, tl), nl.float32, buffer=nl.sbuf)
                    nisa.activation(dst=decay, op=nl.exp, data=dl, scale=a_t[:, s : s + 1])
                    drive = nl.multiply(du, nl.broadcast_to(nl.load(b[bi, s : s + 1, sl]), (P, tl)))
                    h = nl.ndarray((P, tl), nl.float32, buffer=nl.sbuf)
                    init = carry[:, s : s + 1] if version == 3 else 0.0
                    nisa.tensor_tensor_scan(dst=h, data0=decay, data1=drive, initial=init, op0=nl.multiply, op1=nl.add)
                    if version == 3:
                        nisa.tensor_copy(dst=carry[:, s : s + 1], src=h[:, tl - 1 : tl])
                    nisa.tensor_tensor(
                        dst=h, data1=h, data2=nl.broadcast_to(nl.load(c[bi, s : s + 1, sl]), (P, tl)), op=nl.multiply
                    )
                    nisa.tensor_tensor(dst=y, data1=y, data2=h, op=nl.add)
                nl.store(out[bi, c0 : c0 + P, sl], y)
    return out


@nki.jit
def matmul_naive(a_t, b):
    """out = a_t.T @ b, the matmul tutorial's first version: each 128x128 stationary and 128x512 moving tile
    loaded right before its matmul, nothing reused."""
    k, m = a_t.shape
    n = b.shape[1]
    out = nl.ndarray((m, n), a_t.dtype, buffer=nl.shared_hbm)
    for m0 in range(0, m, P):
        for n0 in range(0, n, 512):
            acc = nl.ndarray((P, 512), nl.float32, buffer=nl.psum)
            for k0 in range(0, k, P):
                st = nl.load(a_t[k0 : k0 + P, m0 : m0 + P])
                mv = nl.load(b[k0 : k0 + P, n0 : n0 + 512])
                nisa.nc_matmul(dst=acc, stationary=st, moving=mv, accumulate=k0 > 0)
            nl.store(out[m0 : m0 + P, n0 : n0 + 512], nl.copy(acc, dtype=a_t.dtype))
    return out


def _spec(shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    return np.broadcast_to(np.zeros((), dtype), shape)


def _mamba_est(version: int, ch: int, length: int, target: str = "trn1") -> tuple[float | None, dict]:
    args = (
        _spec((1, ch, length)),
        _spec((1, ch, length)),
        _spec((ch, 16)),
        _spec((1, 16, length)),
        _spec((1, 16, length)),
        version,
    )
    try:
        _, st = nki.infer_shapes(mamba, stats=True, target=target)(*args)
    except nki.NkiCapacityError:
        return None, {}
    est = cost.estimate(st)
    return est.seconds, est.active()


@nki.jit
def add_rows(a, b):
    """a + b, rows dealt to the programs of the launch in 128-row tiles (the published eager add's op)."""
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    n, p = nl.num_programs(axes=0), nl.program_id(axis=0)
    for r0 in range(p * P, a.shape[0], n * P):
        x, y = nl.load(a[r0 : r0 + P]), nl.load(b[r0 : r0 + P])
        nl.store(out[r0 : r0 + P], nl.add(x, y))
    return out


@nki.jit
def row_sums(x):
    """x.sum(-1) in fp32, rows dealt to the programs of the launch (the published reduce_sum's op)."""
    out = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.shared_hbm)
    n, p = nl.num_programs(axes=0), nl.program_id(axis=0)
    for r0 in range(p * P, x.shape[0], n * P):
        t = nl.load(x[r0 : r0 + P])
        s = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=s, op=nl.add, data=t, axis=1, keepdims=True)
        nl.store(out[r0 : r0 + P], s)
    return out


def _lnc2_seconds(kernel: Any, *args: Any, split: int | None = None) -> float:
    """Estimated time on one logical core (LNC=2, two physical cores). ``split``: the kernel is LNC-1, so the
    two cores each run it on half of argument 1's columns (a GEMM split along N) and take the same time."""
    if split is not None:
        a, b = args[:2]
        args = (a, _spec((b.shape[0], b.shape[1] // 2), b.dtype), *args[2:])
        _, st = nki.infer_shapes(kernel, stats=True, target="trn2")(*args)
    else:
        _, st = nki.infer_shapes(kernel[2], stats=True, target="trn2")(*args)
    return cost.estimate(st).seconds


def published_trn2() -> None:
    """The model against the published trn2.3xlarge measurements of one logical core (LNC=2; TorchNeuron's eager
    runtime, torch-neuronx 2.12 / neuronx-cc 2.27: shared/NKI_API_AND_COSTS.md, "Published trn2.3xlarge
    measurements"). Those are end-to-end op latencies; launch-bound ops (add 1024x1024 bf16 in 45 us) show a
    fixed launch cost the kernel model does not contain, so it is estimated from the add and added to every
    end-to-end comparison ("+ launch")."""
    print("\nPublished trn2.3xlarge measurements, one logical core (LNC=2) | model | ratio published/model")
    bf = BF16
    add_est = _lnc2_seconds(add_rows, _spec((1024, 1024), bf), _spec((1024, 1024), bf))
    launch = 45e-6 - add_est
    print(
        f"  launch floor: add 1024x1024 bf16 45 us published, {add_est * 1e6:.1f} us on-device in the model -> "
        f"{launch * 1e6:.1f} us of launch cost added below"
    )
    sm_est = _half_rows_seconds(KERNELS["softmax"].kernel, _spec((1024, 1024), bf))
    _row("softmax 1024x1024 bf16 (launch-bound)", 52e-6, sm_est + launch, f"{sm_est * 1e6:.1f} us + launch")
    flops = 2.0 * 1024 * 4096 * 4096
    for dt, name, meas in ((bf, "bf16", 276.8e-6), (np.float32, "fp32", 990.9e-6)):
        est = _lnc2_seconds(KERNELS["matmul"].kernel, _spec((1024, 4096), dt), _spec((4096, 4096), dt), split=1)
        _row(
            f"GEMM 1024x4096x4096 {name}",
            meas,
            est + launch,
            f"{est * 1e6:.0f} us + launch = {flops / (est + launch) / 1e12:.0f} TFLOPS "
            f"(published {flops / meas / 1e12:.0f})",
        )
    q = _spec((1, 8, 2048, 128), bf)
    est = _lnc2_seconds(KERNELS["flash_attention_fwd"].kernel, q, q, q, True)
    _row(
        "flash attention prefill q2048 x 8 heads d128 bf16 causal (native SDPA)",
        539.3e-6,
        est + launch,
        f"built-in flash_attention_fwd {est * 1e6:.0f} us + launch; AWS's NKI flash_fwd on the XLA runtime: 1658.6 us",
    )
    rows, cols = 8192, 8192
    nbytes = rows * cols * 2
    est = _lnc2_seconds(row_sums, _spec((rows, cols), bf))
    _row("reduce_sum bandwidth (best of the sweep)", nbytes / 639e9, est, f"{nbytes / est / 1e9:.0f} GB/s on-device at "
         f"{rows}x{cols} bf16 (published 639 GB/s; peak ~725)", bandwidth=True)  # fmt: skip
    sm_rows = 8192
    est = _half_rows_seconds(KERNELS["softmax"].kernel, _spec((sm_rows, cols), bf))
    moved = 2 * sm_rows * cols * 2
    _row("softmax bandwidth (best of the sweep)", moved / 496e9, est, f"{moved / est / 1e9:.0f} GB/s on-device "
         f"(read + write) at {sm_rows}x{cols} bf16 (published 496 GB/s)", bandwidth=True)  # fmt: skip
    print(
        "  host<->device 14.0 / 14.3 GB/s per logical core (ws 2): not modelled -- the cost model covers a kernel's "
        "time on the NeuronCore; host transfers go through the runtime and PCIe, for which AWS publishes no figure"
    )


def _half_rows_seconds(kernel: Any, x: np.ndarray) -> float:
    """An LNC-1 row-wise kernel on one logical core: each physical core takes half the rows."""
    _, st = nki.infer_shapes(kernel, stats=True, target="trn2")(_spec((x.shape[0] // 2, *x.shape[1:]), x.dtype))
    return cost.estimate(st).seconds


def _row(what: str, published_s: float, model_s: float, detail: str, bandwidth: bool = False) -> None:
    ratio = published_s / model_s
    flag = "" if 1 / 1.5 <= ratio <= 1.5 else "  <-- off by more than 1.5x (docs/nki.md explains)"
    pub = f"{published_s * 1e6:.1f} us" if not bandwidth else "(as a time for the model's bytes)"
    print(f"  {what}: {pub} | {detail} | {ratio:.2f}{flag}")


def published() -> None:
    """The model next to every measured figure AWS publishes (sources: shared/NKI_API_AND_COSTS.md section 3)."""
    published_trn2()
    print("\nPublished measurements vs the model (published figure | model estimate | where measured)")
    trn2 = cost.generation("trn2")
    t = cost.dma_transfer_seconds(trn2, 4 * 4096 * 2, 4)
    print(
        f"  DMA [4,4096] bf16 HBM->SBUF, one engine: 1416 ns | {t * 1e9:.0f} ns transfer "
        f"(+{cost.DMA_FIXED_LATENCY_S * 1e9:.0f} ns fixed latency) | trn2"
    )
    rows = [
        ("v1", 1, 256, 512, 172.93e-6, "98.71%"),
        ("v1", 1, 4096, 512, 2.34e-3, "92.16%"),
        ("v2", 2, 4096, 512, 1.61e-3, "99.63%"),
        ("v2", 2, 4096, 8192, 53.33e-3, "58.93% (spills)"),
        ("v3", 3, 4096, 8192, 27.8e-3, "94.85%"),
    ]
    for name, ver, ch, length, meas, vec in rows:
        est, act = _mamba_est(ver, ch, length)
        txt = (
            "does not fit SBUF (CapacityError)"
            if est is None
            else f"{est * 1e3:.3f} ms, Vector {act['vector']:.0%} active ({meas / est:.1f}x the estimate measured)"
        )
        print(
            f"  fused Mamba {name} b1 seq{length} ch{ch} st16 fp32: {meas * 1e3:.3f} ms, Vector {vec} | {txt} "
            "| trn1 assumed (published with Neuron 2.20; instance not stated)"
        )
    for length, meas in ((1024, 3.3e-3), (2048, 6.6e-3), (4096, 13.3e-3)):
        est, _ = _mamba_est(3, 4096, length)
        print(f"  fused Mamba v3 ch4096 seq{length}: {meas * 1e3:.1f} ms | {est * 1e3:.2f} ms | trn1 assumed")
    m, k, n = 4096, 8192, 8192
    for label, kern, args, pub in (
        ("naive", matmul_naive, (_spec((k, m)), _spec((k, n))), "PE 87.28%, DMA 99.93%"),
        (
            "optimized (built-in kernel)",
            KERNELS["matmul"].kernel,
            (_spec((m, k)), _spec((k, n))),
            "final: PE 99.50%, DMA 21.54%, Vector 10.55%",
        ),
    ):
        t0 = time.perf_counter()
        _, st = nki.infer_shapes(kern, stats=True, target="trn2")(*args)
        est = cost.estimate(st)
        act = est.active()
        print(
            f"  matmul tutorial {label} fp32 [{m},{k}]x[{k},{n}]: {pub} | PE {act['tensor']:.1%}, DMA "
            f"{act['dma']:.1%}, Vector {act['vector']:.1%}, {est.seconds * 1e3:.1f} ms "
            f"({time.perf_counter() - t0:.0f} s shape-only) | trn2"
        )
    x = _spec((300, 1000))
    w = _spec((1000,))
    _, st = nki.infer_shapes(KERNELS["layer_norm"].kernel, stats=True, target="trn1")(x, w, w, 1e-5)
    print(
        f"  LayerNorm tutorial (300,1000) fp32: v1 p50 2311 us, v2 1969 us | built-in layer_norm "
        f"{cost.estimate(st).seconds * 1e6:.1f} us on-device | trn1 (published p50 includes launch overhead)"
    )
    q = _spec((1, 1, 4096, 128), BF16)
    _, st = nki.infer_shapes(KERNELS["flash_attention_fwd"].kernel, stats=True, target="trn2")(q, q, q, False)
    print(
        f"  nki-samples CI bound, SD attention b1 seq4096 d128 bf16: <= 536 us (an upper bound) | built-in "
        f"flash_attention_fwd {cost.estimate(st).seconds * 1e6:.0f} us | device unstated"
    )


if __name__ == "__main__":
    main()
