"""A kernel run: :class:`Run` holds what one execution enforces and counts (its generation, NKI release, step
budget, on-chip memory, per-engine counters and schedule, the arguments it wrote); the thread's stack of runs
(:func:`current_run`); and what a finished run leaves (:func:`last_run_stats`, :class:`watch_arg_writes`).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import cost as _cost
from .errors import NkiBudgetError
from .memory import PMAX, Buffer, OnChipMemory, Reservation
from .settings import MAX_STEPS_ENV, check_version, version_default

if TYPE_CHECKING:
    from .tensors import NkiTensor


class KernelArg:
    """One HBM argument of a kernel run: the ``_alloc`` of every view of it, so the run knows which of its
    arguments a kernel wrote (``Run.note_write``). ``source`` is what the caller passed (a torch tensor,
    a NumPy array or a fake tensor in shape-only mode)."""

    __slots__ = ("__weakref__", "name", "source")

    def __init__(self, name: str, source: Any):
        self.name = name
        self.source = source


@dataclass
class EngineStats:
    """Counters of one engine: instructions issued, elements processed, estimated cycles."""

    instructions: int = 0
    elements: int = 0
    cycles: float = 0.0


@dataclass
class RunStats:
    """Counters of one kernel run, readable after it (``simulate(..., stats=True)``, ``last_run_stats()``)."""

    generation: str = "trn2"
    engines: dict[str, EngineStats] = field(
        default_factory=lambda: {e: EngineStats() for e in ("tensor", "vector", "scalar", "gpsimd", "dma")}
    )
    dma_bytes_hbm_to_sbuf: int = 0
    dma_bytes_sbuf_to_hbm: int = 0
    dma_bytes_other: int = 0
    dma_transfers: int = 0
    matmul_flops: int = 0
    sbuf_peak_bytes_per_partition: int = 0
    psum_peak_bytes_per_partition: int = 0
    shape_only: bool = False
    #: per program of the launch: the schedule's critical path ("makespan", s) and busy seconds per engine
    schedule: list[dict[str, Any]] = field(default_factory=list)
    #: instructions issued plus iterations of ``nl`` loops: what the run's step budget limits
    steps: int = 0
    #: the kernel's HBM arguments it wrote (by parameter name, in the order first written)
    written_args: tuple[str, ...] = ()

    @property
    def dma_bytes(self) -> int:
        """Bytes moved between HBM and SBUF (both directions)."""
        return self.dma_bytes_hbm_to_sbuf + self.dma_bytes_sbuf_to_hbm

    def instructions(self) -> dict[str, int]:
        return {k: v.instructions for k, v in self.engines.items()}

    def summary(self) -> str:
        eng = ", ".join(f"{k}={v.instructions}" for k, v in self.engines.items())
        return (
            f"instructions [{eng}]; HBM->SBUF {self.dma_bytes_hbm_to_sbuf} B, SBUF->HBM "
            f"{self.dma_bytes_sbuf_to_hbm} B in {self.dma_transfers} DMAs; peak SBUF "
            f"{self.sbuf_peak_bytes_per_partition} B/partition, PSUM {self.psum_peak_bytes_per_partition} B"
        )


def _default_generation() -> str:
    env = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "")
    return _cost.generation(env or None).name if env else "trn2"


class Run:
    """One kernel execution: generation, shape-only flag, live on-chip memory, counters, SPMD ids."""

    def __init__(
        self,
        generation: str | None = None,
        shape_only: bool = False,
        kernel: str = "",
        max_steps: int | None = None,
        nki_version: str | None = None,
    ):
        self.gen = _cost.generation(generation or _default_generation())
        #: the NKI release whose API and rules this run enforces (emulator/versions.py)
        self.nki_version = version_default() if nki_version is None else check_version(nki_version, "nki_version")
        self.kernel = kernel
        #: the step budget (None or 0: none; the default run outside ``simulate`` has none)
        self.max_steps = max_steps or None
        self.steps = 0
        self.loop_iterations = 0
        self.written: dict[int, KernelArg] = {}
        self.shape_only = shape_only
        self.stats = RunStats(generation=self.gen.name, shape_only=shape_only)
        #: SBUF/PSUM in use, per program (each program of a launch is its own core); all given back at :meth:`end`
        self.memory = OnChipMemory(self.gen)
        self.program_id: tuple[int, ...] = ()
        self.grid: tuple[int, ...] = ()
        self.grid_ids: list[tuple[int, ...]] = [()]
        self.shared_allocs: list[NkiTensor] = []
        self.shared_next = 0
        self.timelines: dict[tuple[int, ...], Any] = {}
        #: the cooperative scheduler of an LNC-2 launch (emulator/lnc.py), None otherwise
        self.lnc_launch: Any = None
        #: (warning, file, line) already given in this run: one warning per call site and run
        self.warned: set[tuple[str, str, int]] = set()

    @property
    def sbuf_used(self) -> int:
        """SBUF bytes per partition the current program has in use."""
        return self.memory.sbuf_used(self.program_id)

    @property
    def psum_banks(self) -> list[int]:
        """Bytes per partition in use in each PSUM bank of the current program."""
        return self.memory.psum_banks(self.program_id)

    def timeline(self) -> Any:
        """The schedule of the program running now (each program of a launch is its own core)."""
        return self.timeline_of(self.program_id)

    def timeline_of(self, program: tuple[int, ...]) -> Any:
        """The schedule of one program of the launch (made on first use)."""
        tl = self.timelines.get(program)
        if tl is None:
            from .schedule import Timeline

            tl = self.timelines[program] = Timeline(self.gen)
        return tl

    def finish(self) -> None:
        self.stats.schedule = [tl.summary() for tl in self.timelines.values()]
        self.stats.steps = self.steps
        self.stats.written_args = tuple(a.name for a in self.written.values())

    def end(self) -> None:
        """The run is over (returned or raised): its SBUF/PSUM is all given back, whatever still references
        its tiles (an exception's traceback, say), so no later run can see it."""
        self.memory.close()

    # ---- the step budget: every instruction and every iteration of an nl loop is one step
    def step(self, loop: bool = False) -> None:
        self.steps += 1
        if loop:
            self.loop_iterations += 1
        if self.max_steps is not None and self.steps > self.max_steps:
            self._over_budget()

    def _over_budget(self) -> None:
        instructions = self.steps - self.loop_iterations
        raise NkiBudgetError(
            f"NKI kernel {self.kernel or '(unnamed)'} ran over the emulator's budget of {self.max_steps:,} steps "
            f"({instructions:,} instructions issued and {self.loop_iterations:,} iterations of nl loops so far): "
            "is one of its loops endless? If the kernel really is this long, raise the budget with the "
            f"environment variable {MAX_STEPS_ENV}=<steps> (0: no limit) or nki.simulate(kernel, max_steps=...)"
        )

    # ---- writes into the kernel's arguments (what nki_op checks against its mutates_args)
    def note_write(self, dst: NkiTensor) -> None:
        arg = dst._alloc
        if type(arg) is KernelArg:
            self.written.setdefault(id(arg), arg)

    # ---- capacity
    def allocate(self, buffer: Buffer, per_partition: int, what: str) -> Reservation | None:
        """Reserve ``per_partition`` bytes of on-chip ``buffer`` for the current program (None off chip);
        :meth:`release` gives the reservation back, :meth:`end` whatever is left of them."""
        if not buffer.on_chip:
            return None
        res = self.memory.reserve(buffer, per_partition, what, self.program_id)
        if res.bank is None:
            self.stats.sbuf_peak_bytes_per_partition = max(self.stats.sbuf_peak_bytes_per_partition, self.sbuf_used)
        else:
            live = sum(self.psum_banks)
            self.stats.psum_peak_bytes_per_partition = max(self.stats.psum_peak_bytes_per_partition, live)
        return res

    def release(self, res: Reservation) -> None:
        """Give back one reservation (its tile went out of scope); a no-op once the run has ended."""
        self.memory.release(res)

    # ---- counters
    def count(
        self,
        engine: str,
        kind: str,
        partitions: int,
        free: int,
        itemsize_: int = 4,
        reads: tuple = (),
        writes: tuple = (),
    ) -> None:
        """Count one compute instruction and schedule it (``reads``/``writes``: its operand tensors)."""
        self.step()
        e = self.stats.engines[engine]
        e.instructions += 1
        e.elements += partitions * free
        cyc = _cost.instruction_cycles(self.gen, engine, kind, free, partitions, itemsize_)
        e.cycles += cyc
        self.timeline().compute(engine, cyc, reads, writes)

    def count_dma(self, src: NkiTensor, dst: NkiTensor, nbytes: int) -> None:
        """Schedule one DMA transfer of ``nbytes`` (counted by the caller)."""
        on_chip = dst if dst.buffer.on_chip else src
        parts = on_chip.partitions if on_chip.buffer.on_chip else min(PMAX, max(1, dst.shape[0] if dst.ndim else 1))
        self.timeline().dma(nbytes, parts, (src,), (dst,))


_local = threading.local()


def current_run() -> Run:
    """The run a kernel executes in (a default trn2 run outside ``simulate``, e.g. for nl.* at top level)."""
    stack = getattr(_local, "stack", None)
    if not stack:
        if not hasattr(_local, "default"):
            _local.default = Run()
        return _local.default
    return stack[-1]


def run_rng() -> np.random.Generator:
    """The current run's generator for nl.rand / dropout (seeded by nl.random_seed; not the device's stream)."""
    run = current_run()
    if not hasattr(run, "rng"):
        run.rng = np.random.default_rng(0)
    return run.rng


def in_kernel() -> bool:
    """True while a kernel runs on this thread (a nested ``@nki.jit`` call is then inlined)."""
    return bool(getattr(_local, "stack", None))


def push_run(run: Run) -> None:
    if not hasattr(_local, "stack"):
        _local.stack = []
    _local.stack.append(run)


def pop_run() -> Run:
    run = _local.stack.pop()
    _local.last_stats = run.stats
    return run


class ArgWrite:
    """One argument a finished kernel run wrote: the kernel, its parameter, what the caller passed."""

    __slots__ = ("kernel", "param", "source")

    def __init__(self, kernel: str, param: str, source: Any):
        self.kernel, self.param, self.source = kernel, param, source


class watch_arg_writes:
    """``with watch_arg_writes() as writes:``: ``writes`` collects an :class:`ArgWrite` for every HBM
    argument written by each kernel run finished on this thread inside the block (shape-only runs too)."""

    def __enter__(self) -> list[ArgWrite]:
        self.writes: list[ArgWrite] = []
        if not hasattr(_local, "watchers"):
            _local.watchers = []
        _local.watchers.append(self.writes)
        return self.writes

    def __exit__(self, *exc: Any) -> None:
        _local.watchers.remove(self.writes)


def report_arg_writes(run: Run) -> None:
    """Hand the arguments a finished run wrote to the active :class:`watch_arg_writes` blocks."""
    watchers = getattr(_local, "watchers", None)
    if watchers and run.written:
        writes = [ArgWrite(run.kernel, a.name, a.source) for a in run.written.values()]
        for w in watchers:
            w.extend(writes)


def last_run_stats() -> RunStats | None:
    """Counters of the last kernel run finished on this thread (None before the first one)."""
    return getattr(_local, "last_stats", None)
