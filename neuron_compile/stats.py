"""Counters of what the backend did in this process (graphs compiled, ops lowered, compile time)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class GraphRecord:
    name: str
    kind: str  # "forward" | "backward" | "inference"
    num_ops: int
    lower_seconds: float
    compile_seconds: float
    cache: str  # "miss" | "hit" | "off"
    #: NKI kernel sites in the graph (routed aten nodes, attention, user kernels).
    nki_kernels: int = 0
    #: Estimated peak HBM on one NeuronCore (bytes, ``neuron_compile.hbm``); None where not estimated (a cache hit
    #: of the neuron target).
    hbm_peak: int | None = None
    #: Its I/O tensors' bytes (certain, where ``hbm_peak`` is estimated); None where not estimated.
    hbm_io: int | None = None


@dataclass
class Stats:
    graphs: list[GraphRecord] = field(default_factory=list)
    #: Neuron target: bytes written to and read from NeuronCores, and executions (``runtime/libnrt.py``).
    #: ``device_bytes_kept_resident``: input bytes not written because they were already on the core (a graph's
    #: own constants; host inputs under option ``input_residency="version_counter"``).
    device_bytes_written: int = 0
    device_bytes_read: int = 0
    device_executions: int = 0
    device_bytes_kept_resident: int = 0
    #: Every byte that crosses between host and device, whatever caused it (a graph's host-tensor inputs and
    #: outputs, ``.to("neuron")``, ``.cpu()``, ``.item()``, an eager op's fallback), and how many transfers.
    host_to_device_bytes: int = 0
    device_to_host_bytes: int = 0
    host_to_device_calls: int = 0
    device_to_host_calls: int = 0
    #: Eager ops on the ``neuron`` device: run (each a one-op graph), compiled (first use of a graph in this
    #: process: from the compile cache or the compiler), and run on the host instead (``eager_fallback="cpu"``).
    eager_ops_run: int = 0
    eager_ops_compiled: int = 0
    eager_ops_fallback: int = 0
    #: Graphs compiled from recorded eager ops (option ``eager_mode="lazy"``; also in ``eager_ops_compiled``).
    eager_graphs_lazy: int = 0
    #: Compiled graphs run on tensors of the ``neuron`` device (eager ops' one-op graphs, lazy recordings,
    #: gathers and scatters, compiled graphs called with device tensors): executions, on either target.
    device_graph_runs: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, rec: GraphRecord) -> None:
        with self._lock:
            self.graphs.append(rec)

    def record_execution(self, written: int, read: int, kept_resident: int = 0) -> None:
        with self._lock:
            self.device_bytes_written += written
            self.device_bytes_read += read
            self.device_bytes_kept_resident += kept_resident
            self.device_executions += 1
        self.record_transfer(written, read)

    def record_transfer(self, host_to_device: int = 0, device_to_host: int = 0) -> None:
        with self._lock:
            if host_to_device:
                self.host_to_device_bytes += host_to_device
                self.host_to_device_calls += 1
            if device_to_host:
                self.device_to_host_bytes += device_to_host
                self.device_to_host_calls += 1

    def count(self, kind: str | None = None) -> int:
        return sum(1 for g in self.graphs if kind is None or g.kind == kind)

    def reset(self) -> None:
        with self._lock:
            self.graphs.clear()
            self.device_bytes_written = self.device_bytes_read = self.device_executions = 0
            self.device_bytes_kept_resident = 0
            self.host_to_device_bytes = self.device_to_host_bytes = 0
            self.host_to_device_calls = self.device_to_host_calls = 0
            self.eager_ops_run = self.eager_ops_compiled = self.eager_ops_fallback = 0
            self.eager_graphs_lazy = self.device_graph_runs = 0


#: Process-wide record of compiled graphs. ``neuron_compile.stats.STATS.count("backward")`` etc.
STATS = Stats()
