"""Cost model: estimated time of one NKI kernel run from the emulator's counters.

Nothing here was measured on hardware. Figures are the published ones gathered in
``shared/NKI_API_AND_COSTS.md`` (AWS Neuron architecture guides for Trn1/Trn2/Trn3, the NKI DMA overview and
bandwidth guides, the perf guide); where the guides disagree the choice is stated. docs/nki.md compares the
model with every measured figure AWS publishes.

Figures per NeuronCore (one "core" = one NC; LNC=1):

=================  ===========================  ===========================  ===========================
                   trn1 (v2)                    trn2 (v3, default)           trn3 (v4)
=================  ===========================  ===========================  ===========================
TensorE clock      2.8 GHz                      2.4 GHz                      2.4 GHz
TensorE peak       92 TF bf16, 23 TF fp32       79 TF bf16, 20 TF fp32       79 TF bf16, 20 TF fp32
VectorE            1.12 GHz, 128 elem/cycle     0.96 GHz, 256 (512 bf16)     1.2 GHz, 256 (512 bf16)
ScalarE            1.4 GHz, 128 elem/cycle      1.2 GHz, 128                 1.2 GHz, 128 (256 bf16)
GpSimdE            1.4 GHz, 128                 1.2 GHz, 128                 1.2 GHz, 128
HBM per chip       0.82 TB/s, 2 cores           2.9 TB/s, 8 cores            4.9 TB/s, 8 cores
DMA peak per core  272 GB/s                     368 GB/s                     528 GB/s
=================  ===========================  ===========================  ===========================

Every figure and its source is in ``shared/NKI_API_AND_COSTS.md`` (AWS Neuron SDK architecture guides,
the NKI DMA overview and bandwidth guides, the perf guide and the profiler's summary-page docs).

The estimate is the **critical path** of the kernel's instruction stream over the engines (a list schedule,
``emulator/schedule.py``): every instruction starts when its engine is free and its inputs are ready, so
engines overlap exactly as far as the kernel's dependencies let them (a tile reused across loop iterations
serializes the next iteration's writer behind this one's readers; a tile allocated inside the loop does not).
Assumptions (each a simplification; the estimate is a model, not a measurement):

* **TensorE**: ``nc_matmul`` takes ``max(N_moving, 64)`` cycles for 2-byte/1-byte operands and 4x that
  for fp32/tf32 (LoadStationary hidden behind the previous matmul). A 128x128x512 bf16 tile is 512 cycles =
  213 ns, i.e. 78.6 TF. A PE transpose costs ``max(P_in, 64)`` cycles. **Warm-up throttle** (trn2/trn3): the
  PE starts at 50% of peak and ramps linearly to full over 3 us of activity; an idle gap of 3 us or more
  throttles it again (the profiler docs' rule is "utilization below 50% for about 3 us"; an idle gap is the
  simple reading).
* **VectorE / ScalarE / GpSimdE**: ``FIXED_CYCLES`` (100, "about 100 static cycles per instruction") plus
  ``N * k / lane_rate`` cycles for N elements per partition (k = 2 with two tensor inputs, 8 for Vector
  ``reciprocal``; ``iota``/``affine_select`` add 150). An instruction that consumes another compute
  instruction's result starts ``DEP_CYCLES`` (164) after it: with the fixed cost that gives the published
  264-cycle initiation interval of dependent single-element ScalarE instructions.
* **DMA**: 16 DMA engines per core, each serving 8 partitions, each at ``min(DMA peak, HBM share) / 16``.
  A transfer of P partitions uses ``ceil(P/8)`` engines and keeps them busy for its bytes at that full rate
  (:func:`dma_occupancy_seconds`). Its data is complete after the longer time the published single-transfer
  efficiency curve gives (``DMA_EFFICIENCY`` by bytes per partition: 81% at 2 KiB, 97% at 4 KiB, 21% at 512 B,
  digitized from the NKI DMA overview's figure): that shortfall is per-transfer latency, which transfers
  queued behind each other overlap. (Charging it as occupancy, as this model did before, made the matmul
  tutorial's naive kernel 48% PE-active where the tutorial's profile shows 87%: its 512 B and 2 KiB loads
  stream at ~92% of the peak when queued.) A transfer starts no earlier than ``DMA_FIXED_LATENCY_S``
  (1.3 us, the descriptor/semaphore-to-start latency) after its inputs are ready; independent transfers
  issued ahead pipeline that latency away too.
* **LNC**: each program of a ``kernel[2]`` launch runs on its own physical core with its own engines and
  DMA share; the estimate is the slower program.
* Not modelled: DGE descriptor costs, SBUF bank conflicts and the halved bandwidth of strided (>16 B)
  free-dim access, HBM contention between cores, PSUM-bank read/write ports, instruction fetch.
* **Roofline**: ``max(useful_flops / TensorE peak, essential_bytes / HBM bandwidth)`` for the cores the
  kernel runs on; ``% of roofline`` = roofline time / estimated time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEP_CYCLES",
    "DMA_EFFICIENCY",
    "DMA_FIXED_LATENCY_S",
    "FIXED_CYCLES",
    "GENERATIONS",
    "PE_WARMUP_S",
    "dma_efficiency",
    "dma_occupancy_seconds",
    "dma_transfer_seconds",
    "CostEstimate",
    "Generation",
    "estimate",
    "generation",
    "instruction_cycles",
    "roofline_seconds",
]


@dataclass(frozen=True)
class Generation:
    """Published per-core figures of one Trainium generation (see the module docstring)."""

    name: str
    tensor_ghz: float
    tensor_tflops_bf16: float
    tensor_tflops_fp32: float
    vector_ghz: float
    vector_elems_per_cycle: int  # fp32; 2-byte dtypes get 2x when >= 256
    scalar_ghz: float
    scalar_elems_per_cycle: int
    gpsimd_ghz: float
    gpsimd_elems_per_cycle: int
    hbm_tb_s_per_chip: float
    cores_per_chip: int
    dma_gb_s_per_core: float
    dma_fixed_us: float
    dma_queues: int
    sbuf_bytes_per_partition: int  # total, before the compiler's reservation
    sbuf_reserved_bytes_per_partition: int
    psum_bytes_per_partition: int
    psum_banks: int
    matmul_max_moving_fp32: int  # N limit of nc_matmul's moving operand (fp32 dst)

    @property
    def hbm_bytes_per_s_per_core(self) -> float:
        """Usable HBM<->SBUF bandwidth of one core: its share of HBM, capped by its DMA peak."""
        return min(self.hbm_tb_s_per_chip * 1e12 / self.cores_per_chip, self.dma_gb_s_per_core * 1e9)

    @property
    def sbuf_usable_bytes_per_partition(self) -> int:
        return self.sbuf_bytes_per_partition - self.sbuf_reserved_bytes_per_partition


GENERATIONS: dict[str, Generation] = {
    "trn1": Generation(
        "trn1",
        2.8,
        92.0,
        23.0,
        1.12,
        128,
        1.4,
        128,
        1.4,
        128,
        0.82,
        2,
        272.0,
        1.3,
        16,
        192 * 1024,
        16 * 1024,
        16 * 1024,
        8,
        512,
    ),
    "trn2": Generation(
        "trn2",
        2.4,
        79.0,
        20.0,
        0.96,
        256,
        1.2,
        128,
        1.2,
        128,
        2.9,
        8,
        368.0,
        1.3,
        16,
        224 * 1024,
        16 * 1024,
        16 * 1024,
        8,
        512,
    ),
    "trn3": Generation(
        "trn3",
        2.4,
        79.0,
        20.0,
        1.2,
        256,
        1.2,
        128,
        1.2,
        128,
        4.9,
        8,
        528.0,
        1.3,
        16,
        256 * 1024,
        16 * 1024,
        16 * 1024,
        8,
        4096,
    ),
}

_ALIASES = {
    "trn1": "trn1",
    "gen2": "trn1",
    "inf2": "trn1",
    "trn2": "trn2",
    "gen3": "trn2",
    "trn3": "trn3",
    "gen4": "trn3",
}


def generation(name: str | Generation | None) -> Generation:
    """The :class:`Generation` for ``'trn1'|'trn2'|'trn3'`` (or ``gen2..gen4``); None gives trn2."""
    if isinstance(name, Generation):
        return name
    key = _ALIASES.get((name or "trn2").lower())
    if key is None:
        raise ValueError(f"unknown Trainium generation {name!r}; use one of 'trn1', 'trn2', 'trn3'")
    return GENERATIONS[key]


FIXED_CYCLES = 100.0  # static cost of a Vector/Scalar/GpSimd instruction (arch guide: "about 100 cycles")
DEP_CYCLES = 164.0  # start delay after a compute producer: 100 + 164 = the perf guide's 264-cycle II (NC-v2)
DMA_FIXED_LATENCY_S = 1.3e-6  # descriptor/semaphore-to-start latency per transfer (DMA bandwidth guide)
PE_WARMUP_S = 3e-6  # TensorE ramps from 50% to 100% of peak over ~3 us (profiler summary-page docs)
PE_COLD_RATE = 0.5
DMA_ENGINES = 16
PARTITIONS_PER_DMA_ENGINE = 8
# (bytes per partition per transfer, fraction of peak): the NKI DMA overview's throughput figure, digitized
# as a fraction of its 32 KiB point (shared/NKI_API_AND_COSTS.md section 3)
DMA_EFFICIENCY: tuple[tuple[int, float], ...] = (
    (32, 0.018),
    (64, 0.028),
    (128, 0.054),
    (256, 0.10),
    (512, 0.21),
    (1024, 0.425),
    (2048, 0.81),
    (4096, 0.97),
    (8192, 0.98),
    (16384, 0.99),
    (32768, 1.0),
)


def dma_efficiency(bytes_per_partition: float) -> float:
    """Fraction of peak DMA throughput at this transfer size per partition (log-linear interpolation of
    ``DMA_EFFICIENCY``; proportional below 32 B, 1.0 above 32 KiB)."""
    pts = DMA_EFFICIENCY
    b = max(float(bytes_per_partition), 1.0)
    if b <= pts[0][0]:
        return pts[0][1] * b / pts[0][0]
    if b >= pts[-1][0]:
        return 1.0
    for (b0, e0), (b1, e1) in zip(pts, pts[1:]):
        if b <= b1:
            t = math.log2(b / b0) / math.log2(b1 / b0)
            return e0 + t * (e1 - e0)
    return 1.0


def dma_engines_used(partitions: int) -> int:
    """DMA engines one transfer spreads over: each serves 8 partitions, 16 per core."""
    return max(1, min(DMA_ENGINES, -(-int(partitions) // PARTITIONS_PER_DMA_ENGINE)))


def dma_occupancy_seconds(gen: Generation, nbytes: int, partitions: int) -> float:
    """Time one transfer keeps its DMA engines busy: its bytes at the engines' full rate. Transfers queued
    behind each other overlap their per-transfer latency (:func:`dma_transfer_seconds`), so back-to-back
    small transfers still stream at this rate (the matmul tutorial's naive kernel keeps the PE 87% busy with
    512 B- and 2 KiB-per-partition loads, which the single-transfer efficiency would cap at 48%)."""
    engines = dma_engines_used(partitions)
    return nbytes / (gen.hbm_bytes_per_s_per_core / DMA_ENGINES * engines)


def dma_transfer_seconds(gen: Generation, nbytes: int, partitions: int) -> float:
    """Time from start to completion of one transfer on its own (the fixed latency excluded): its bytes at the
    published single-transfer efficiency for its bytes per partition (``DMA_EFFICIENCY``)."""
    return dma_occupancy_seconds(gen, nbytes, partitions) / dma_efficiency(nbytes / max(1, partitions))


def instruction_cycles(
    gen: Generation, engine: str, kind: str, free: int, partitions: int = 128, itemsize: int = 4
) -> float:
    """Estimated cycles of one instruction on ``engine`` (in that engine's clock).

    ``free`` is the number of elements per partition (for ``matmul``: N of the moving operand; for
    ``transpose``: the input's partition count). ``kind`` refines the formula: ``matmul``, ``transpose``,
    ``tensor_tensor`` (two tensor inputs), ``reciprocal``, ``iota``/``affine_select``, or anything else.
    """
    if engine == "tensor":
        if kind == "transpose":
            return float(max(partitions, 64))
        cyc = float(max(free, 64))
        return cyc * 4 if itemsize >= 4 else cyc
    if engine == "vector":
        rate = gen.vector_elems_per_cycle / 128 * (2 if itemsize <= 2 else 1)
    elif engine == "scalar":
        rate = gen.scalar_elems_per_cycle / 128
    else:
        rate = gen.gpsimd_elems_per_cycle / 128
    k = {"tensor_tensor": 2.0, "reciprocal": 8.0}.get(kind, 1.0)
    cyc = FIXED_CYCLES + free * k / rate
    if kind in ("iota", "affine_select"):
        cyc += 150.0
    return cyc


@dataclass
class CostEstimate:
    """Per-engine busy time (seconds) of one kernel run and the resulting estimate."""

    generation: str
    engine_seconds: dict[str, float] = field(default_factory=dict)
    dma_seconds: float = 0.0
    #: the critical path of the instruction schedule (None: no schedule, the busiest engine is used)
    makespan: float | None = None
    #: programs of the launch (cores the kernel ran on)
    programs: int = 1

    @property
    def seconds(self) -> float:
        """Estimated kernel time: the schedule's critical path (or the busiest engine without one)."""
        if self.makespan is not None:
            return self.makespan
        return max([self.dma_seconds, *self.engine_seconds.values()])

    def active(self) -> dict[str, float]:
        """Fraction of the estimated time each engine is busy (the profiler's "engine active %")."""
        t = self.seconds or 1.0
        return {**{k: v / t for k, v in self.engine_seconds.items()}, "dma": self.dma_seconds / t}

    @property
    def bottleneck(self) -> str:
        items = {"dma": self.dma_seconds, **self.engine_seconds}
        return max(items, key=items.get)


def estimate(stats: Any, gen: str | Generation | None = None) -> CostEstimate:
    """Estimate a run's time from an emulator ``RunStats``: the schedule's critical path and per-engine busy
    time of its slowest program when the run was scheduled (always, in the emulator), else each engine's
    total cycles with perfect overlap."""
    g = generation(gen if gen is not None else getattr(stats, "generation", None))
    sched = getattr(stats, "schedule", None)
    if sched and g.name == stats.generation:
        crit = max(sched, key=lambda p: p["makespan"])
        return CostEstimate(
            g.name,
            {k: v for k, v in crit["busy"].items() if k != "dma"},
            crit["busy"]["dma"],
            crit["makespan"],
            len(sched),
        )
    clocks = {"tensor": g.tensor_ghz, "vector": g.vector_ghz, "scalar": g.scalar_ghz, "gpsimd": g.gpsimd_ghz}
    est = CostEstimate(g.name)
    for name, eng in stats.engines.items():
        if name in clocks:
            est.engine_seconds[name] = eng.cycles / (clocks[name] * 1e9)
    moved = stats.dma_bytes_hbm_to_sbuf + stats.dma_bytes_sbuf_to_hbm + stats.dma_bytes_other
    est.dma_seconds = moved / g.hbm_bytes_per_s_per_core + stats.dma_transfers * g.dma_fixed_us * 1e-6 / g.dma_queues
    return est


def roofline_seconds(
    flops: float, essential_bytes: float, gen: str | Generation | None = None, fp32: bool = False, cores: int = 1
) -> float:
    """Ideal time on ``cores`` NeuronCores: TensorE peak for ``flops`` or HBM bandwidth for
    ``essential_bytes``, whichever is longer."""
    g = generation(gen)
    peak = (g.tensor_tflops_fp32 if fp32 else g.tensor_tflops_bf16) * 1e12 * cores
    return max(flops / peak, essential_bytes / (g.hbm_bytes_per_s_per_core * cores))
