"""Cost model: estimated time of one NKI kernel run from the emulator's counters.

Nothing here was measured on hardware. Figures are the published ones gathered in
``shared/NKI_FACTS.md`` section 9 (AWS Neuron architecture guides for Trn1/Trn2/Trn3 and the NKI DMA
bandwidth guide); where the guides disagree the choice is stated.

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

Assumptions (each a simplification; the estimate is a model, not a measurement):

* **TensorE**: ``nc_matmul`` takes ``max(N_moving, 64)`` cycles for 2-byte/1-byte operands and 4x that
  for fp32/tf32 (LoadStationary is assumed hidden behind the previous matmul). A 128x128x512 bf16 tile is
  then 512 cycles = 213 ns, i.e. 78.6 TF, which matches the 79 TF peak. A PE transpose (``nc_transpose``
  on Tensor) costs ``max(P_in, 64)`` cycles (it is a matmul against the identity with N = P_in).
* **VectorE / ScalarE / GpSimdE**: an instruction over N elements per partition costs
  ``max(64, N * k / lane_rate)`` cycles, where ``lane_rate`` = elements per cycle / 128 lanes from the table
  (trn2 VectorE: 2 fp32 or 4 bf16 per lane per cycle; ScalarE 1), ``k`` = 2 for two tensor inputs
  (``tensor_tensor``), 8 for ``reciprocal`` on Vector, and ``iota``/``affine_select`` add 150 cycles.
  The ~100-cycle penalty for chains of dependent instructions is NOT modelled.
* **DMA/HBM**: bytes moved between HBM and SBUF at ``min(HBM per chip / cores, DMA peak per core)``
  (trn2: min(362.5, 368) = 362.5 GB/s), plus a fixed 1.3 us per ``dma_copy`` spread over the 16 DMA queues
  (so 81 ns amortised per transfer). SBUF->SBUF DMA counts against the same bandwidth.
* **Overlap**: engines run concurrently and the kernels are pipelined (double buffering, the Tile
  framework's dependency tracking), so the estimated time is the busiest engine's time, max over
  {Tensor, Vector, Scalar, GpSimd, DMA}. No launch overhead, no cross-engine semaphore latency.
* **Roofline**: ``max(useful_flops / TensorE peak, essential_bytes / HBM bandwidth per core)``, where the
  caller gives the useful flops (e.g. 2MNK, causal attention counts half) and the essential bytes (inputs
  read once + outputs written once). ``% of roofline`` = roofline time / estimated time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "GENERATIONS",
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
    "trn1": Generation("trn1", 2.8, 92.0, 23.0, 1.12, 128, 1.4, 128, 1.4, 128, 0.82, 2, 272.0, 1.3, 16,
                       192 * 1024, 16 * 1024, 16 * 1024, 8, 512),
    "trn2": Generation("trn2", 2.4, 79.0, 20.0, 0.96, 256, 1.2, 128, 1.2, 128, 2.9, 8, 368.0, 1.3, 16,
                       224 * 1024, 16 * 1024, 16 * 1024, 8, 512),
    "trn3": Generation("trn3", 2.4, 79.0, 20.0, 1.2, 256, 1.2, 128, 1.2, 128, 4.9, 8, 528.0, 1.3, 16,
                       256 * 1024, 16 * 1024, 16 * 1024, 8, 4096),
}

_ALIASES = {"trn1": "trn1", "gen2": "trn1", "inf2": "trn1", "trn2": "trn2", "gen3": "trn2",
            "trn3": "trn3", "gen4": "trn3"}


def generation(name: str | Generation | None) -> Generation:
    """The :class:`Generation` for ``'trn1'|'trn2'|'trn3'`` (or ``gen2..gen4``); None gives trn2."""
    if isinstance(name, Generation):
        return name
    key = _ALIASES.get((name or "trn2").lower())
    if key is None:
        raise ValueError(f"unknown Trainium generation {name!r}; use one of 'trn1', 'trn2', 'trn3'")
    return GENERATIONS[key]


def instruction_cycles(gen: Generation, engine: str, kind: str, free: int, partitions: int = 128,
                       itemsize: int = 4) -> float:
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
    cyc = max(64.0, free * k / rate)
    if kind in ("iota", "affine_select"):
        cyc += 150.0
    return cyc


@dataclass
class CostEstimate:
    """Per-engine busy time (seconds) of one kernel run and the resulting estimate."""

    generation: str
    engine_seconds: dict[str, float] = field(default_factory=dict)
    dma_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        """Estimated kernel time: the busiest engine (engines overlap, see the module docstring)."""
        return max([self.dma_seconds, *self.engine_seconds.values()])

    @property
    def bottleneck(self) -> str:
        items = {"dma": self.dma_seconds, **self.engine_seconds}
        return max(items, key=items.get)


def estimate(stats: Any, gen: str | Generation | None = None) -> CostEstimate:
    """Estimate a run's time from an emulator ``RunStats`` (its per-engine cycles and DMA bytes)."""
    g = generation(gen if gen is not None else getattr(stats, "generation", None))
    clocks = {"tensor": g.tensor_ghz, "vector": g.vector_ghz, "scalar": g.scalar_ghz, "gpsimd": g.gpsimd_ghz}
    est = CostEstimate(g.name)
    for name, eng in stats.engines.items():
        if name in clocks:
            est.engine_seconds[name] = eng.cycles / (clocks[name] * 1e9)
    moved = stats.dma_bytes_hbm_to_sbuf + stats.dma_bytes_sbuf_to_hbm + stats.dma_bytes_other
    est.dma_seconds = (moved / g.hbm_bytes_per_s_per_core
                       + stats.dma_transfers * g.dma_fixed_us * 1e-6 / g.dma_queues)
    return est


def roofline_seconds(flops: float, essential_bytes: float, gen: str | Generation | None = None,
                     fp32: bool = False) -> float:
    """Ideal time: TensorE peak for ``flops`` or HBM bandwidth for ``essential_bytes``, whichever is longer."""
    g = generation(gen)
    peak = (g.tensor_tflops_fp32 if fp32 else g.tensor_tflops_bf16) * 1e12
    return max(flops / peak, essential_bytes / g.hbm_bytes_per_s_per_core)
