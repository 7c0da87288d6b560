"""A list schedule of one program's instruction stream over the NeuronCore engines (the cost model's
critical path; the timing rules are in ``kernels/cost.py``).

Each instruction starts at the earliest time its inputs are ready and its engine has room for it: after the
last write of every allocation it reads (RAW) and the last read of every allocation it writes (WAR). An
engine may run an instruction in an idle gap left before later-issued ones (the compiler reorders
independent instructions; NKI's program order binds only dependent ones). The 16 DMA engines are pooled: a
transfer over P partitions uses ceil(P/8) of them, so it occupies that fraction of the pool for its duration;
being a stream of descriptors, it may be split over several idle stretches of the pool (a short transfer issued
between two long ones does not leave the pool idle until a gap as long as the second one opens). Dependencies are tracked per allocation, not per element: a kernel that reuses
one tile across loop iterations serializes the next writer behind this iteration's readers, as the
hardware's semaphores would; a tile allocated inside the loop gets fresh storage and can overlap. Writes
to HBM do not order each other (kernels write disjoint output regions).
"""

from __future__ import annotations

import bisect
import weakref
from typing import Any

from .. import cost as _cost

ENGINES = ("tensor", "vector", "scalar", "gpsimd")


class _Bank:
    """Stands for one physical PSUM bank (tiles placed in it are ordered on it)."""

    __slots__ = ("__weakref__", "index")

    def __init__(self, index: int):
        self.index = index


_BANKS: dict[int, _Bank] = {}
# Order PSUM tiles on their physical bank (True) or per tile (False, the default). The emulator's allocator
# packs small tiles first-fit into shared banks, where the real compiler would spread them over the 8 banks,
# so bank ordering serializes unrelated tiles; per-tile ordering instead lets a kernel run ahead on fresh
# PSUM tiles as far as the 8-bank capacity check lets it allocate them.
BANK_ORDERING = False


def _key(t: Any) -> tuple[int, Any]:
    owner = t._alloc if t._alloc is not None else t._root[0]
    bank = getattr(owner, "bank", None)
    if bank is not None and BANK_ORDERING:
        owner = _BANKS.setdefault(bank, _Bank(bank))
    return id(owner), owner


class Resource:
    """Busy intervals of one engine (merged when they touch); ``place`` finds the earliest fitting gap."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def place(self, ready: float, dur: float) -> float:
        t = ready
        i = bisect.bisect_right(self.ends, t)
        while i < len(self.starts) and t + dur > self.starts[i] + 1e-15:
            t = max(t, self.ends[i])
            i += 1
        # insert [t, t + dur) before interval i, merging with neighbours that touch it
        s, e = t, t + dur
        lo = i
        if lo > 0 and abs(self.ends[lo - 1] - s) <= 1e-15:
            lo -= 1
            s = self.starts[lo]
        hi = i
        if hi < len(self.starts) and abs(self.starts[hi] - e) <= 1e-15:
            e = self.ends[hi]
            hi += 1
        self.starts[lo:hi] = [s]
        self.ends[lo:hi] = [e]
        return t

    def fill(self, ready: float, dur: float) -> tuple[float, float]:
        """Occupy ``dur`` of idle time from ``ready`` on, split over as many gaps as needed (a DMA transfer is a
        stream of descriptors, which the queues interleave with other transfers'): returns (start, end)."""
        t, left, first = ready, dur, None
        while left > 1e-15:
            i = bisect.bisect_right(self.ends, t)
            if i > 0 and self.ends[i - 1] > t:  # t inside a busy interval
                t = self.ends[i - 1]
                continue
            gap_end = self.starts[i] if i < len(self.starts) else float("inf")
            if gap_end <= t + 1e-15:
                t = self.ends[i]
                continue
            piece = min(left, gap_end - t)
            self.place(t, piece)
            first = t if first is None else first
            left -= piece
            t += piece
        start = ready if first is None else first
        return start, t if first is not None else ready


class Timeline:
    """The schedule of one program (one physical core)."""

    def __init__(self, gen: _cost.Generation):
        self.gen = gen
        self.clock = {
            "tensor": gen.tensor_ghz,
            "vector": gen.vector_ghz,
            "scalar": gen.scalar_ghz,
            "gpsimd": gen.gpsimd_ghz,
        }
        self.res = {e: Resource() for e in (*ENGINES, "dma")}
        self.busy = {**dict.fromkeys(ENGINES, 0.0), "dma": 0.0}
        self.written: dict[int, tuple[Any, float, str]] = {}  # alloc -> (ref, end of last write, engine)
        self.read: dict[int, tuple[Any, float]] = {}
        self.end = 0.0
        self.pe_warm_start = 0.0
        self.pe_last_end = -1.0

    def _lookup(self, table: dict, t: Any) -> tuple | None:
        k, owner = _key(t)
        hit = table.get(k)
        if hit is None or hit[0]() is not owner:
            return None
        return hit

    def _ready(self, reads: tuple, writes: tuple, dep_s: float, engine: str) -> float:
        """Earliest start: RAW (+ the dependency latency after a compute producer, except TensorE reading its
        own PSUM accumulation, which the PE pipelines) and WAR on on-chip allocations."""
        ready = 0.0
        for t in reads:
            hit = self._lookup(self.written, t)
            if hit is not None:
                lat = 0.0 if hit[2] == "dma" or (hit[2] == engine == "tensor") else dep_s
                ready = max(ready, hit[1] + lat)
        for t in writes:
            if t.buffer.on_chip:
                hit = self._lookup(self.read, t)
                if hit is not None:
                    ready = max(ready, hit[1])
        return ready

    def _record(self, reads: tuple, writes: tuple, end: float, engine: str) -> None:
        for t in reads:
            k, owner = _key(t)
            prev = self._lookup(self.read, t)
            self.read[k] = (weakref.ref(owner), max(end, prev[1] if prev else 0.0))
        for t in writes:
            k, owner = _key(t)
            prev = self._lookup(self.written, t)
            self.written[k] = (weakref.ref(owner), max(end, prev[1] if prev else 0.0), engine)
        self.end = max(self.end, end)

    def compute_ready(self, engine: str, reads: tuple, writes: tuple) -> float:
        """When an instruction on ``engine`` with these operands could start, as far as its inputs go."""
        return self._ready(reads, writes, _cost.DEP_CYCLES / (self.clock[engine] * 1e9), engine)

    def dma_ready(self, reads: tuple, writes: tuple, latency: bool = True) -> float:
        """When a transfer with these operands could start (its fixed latency included unless ``latency=False``)."""
        return self._ready(reads, writes, 0.0, "dma") + (_cost.DMA_FIXED_LATENCY_S if latency else 0.0)

    def compute(self, engine: str, cycles: float, reads: tuple, writes: tuple, not_before: float = 0.0) -> None:
        """Schedule one compute instruction; ``not_before`` holds it for an event outside this core (a barrier)."""
        clk = self.clock[engine] * 1e9
        ready = max(not_before, self.compute_ready(engine, reads, writes))
        dur = cycles / clk
        if engine == "tensor" and self.gen.name != "trn1":
            # the throttle follows the PE's recent activity: estimated at the earliest start the PE allows
            probe = max(ready, self.res[engine].ends[-1] if self.res[engine].ends else 0.0)
            if probe - self.pe_last_end >= _cost.PE_WARMUP_S:
                self.pe_warm_start = probe  # idle long enough to be throttled again
            warm = min(1.0, max(0.0, probe - self.pe_warm_start) / _cost.PE_WARMUP_S)
            dur /= _cost.PE_COLD_RATE + (1.0 - _cost.PE_COLD_RATE) * warm
        start = self.res[engine].place(ready, dur)
        end = start + dur
        if engine == "tensor":
            self.pe_last_end = max(self.pe_last_end, end)
        self.busy[engine] += dur
        self._record(reads, writes, end, engine)

    def dma(
        self, nbytes: int, partitions: int, reads: tuple, writes: tuple, not_before: float = 0.0, latency: bool = True
    ) -> None:
        """Schedule one transfer; ``not_before`` holds it for the peer core of a send/receive pair."""
        ready = max(not_before, self.dma_ready(reads, writes, latency))
        share = _cost.dma_engines_used(partitions) / _cost.DMA_ENGINES
        busy = _cost.dma_occupancy_seconds(self.gen, nbytes, partitions)  # engines busy at full rate
        start, last = self.res["dma"].fill(ready, busy * share)
        # the data is complete when its last piece is through, and no sooner than the transfer alone takes
        end = max(last, start + _cost.dma_transfer_seconds(self.gen, nbytes, partitions))
        self.busy["dma"] += busy * share
        self._record(reads, writes, end, "dma")

    def summary(self) -> dict[str, Any]:
        return {"makespan": self.end, "busy": dict(self.busy)}
