"""Target compiles in the background, a bounded number at a time: the cold start of a training step in parallel.

A real neuronx-cc compile takes minutes. Compiled one after the other, the first training step pays for each
graph in turn: the forward's at its first call, the backward's at the first ``backward()``. Here a graph is
lowered (and checked: legality, HBM) in the caller's thread as before, and then its compile starts as a job of
this pool; the compiler hands AOTAutograd a ``PendingGraph`` at once, and AOTAutograd goes on to partition
and lower the backward, whose compile starts beside the forward's. A graph's first call waits for its own
compile only, so the first step costs about the longest compile, not the sum.

Jobs: option ``compile_jobs`` (None: ``default_jobs()``, the cores, at most one per ``MEMORY_PER_JOB`` of
available memory: neuronx-cc takes gigabytes of host memory per graph). Each job is a daemon thread waiting
on a neuronx-cc subprocess (which its keeper stops when this process dies), so a job still running at exit
neither holds the interpreter up nor outlives it.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from .executor import CompiledGraph

if TYPE_CHECKING:
    from ..artifact import Artifact
    from .targets import Target

log = logging.getLogger(__name__)

#: Host memory one compile job is assumed to take (neuronx-cc's own need is not published; large graphs take
#: several GiB): with less available per core, fewer jobs run at once.
MEMORY_PER_JOB = 8 * 2**30


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@functools.lru_cache(maxsize=1)
def default_jobs() -> int:
    """Compile jobs at once when the option leaves it open: the usable cores, at most one per
    ``MEMORY_PER_JOB`` of available memory, at least one. Decided once per process."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    memory = _available_memory()
    by_memory = cores if memory is None else memory // MEMORY_PER_JOB
    return max(1, min(cores, by_memory))


def jobs(option: int | None) -> int:
    """The number of compile jobs option ``compile_jobs`` asks for (0: none, compile in the caller's thread)."""
    return default_jobs() if option is None else option


class Lowered(Exception):
    """Raised by the compiler's build of a cache miss once the graph is lowered, to carry the lowered artifact
    (no executable yet) and ``build``, which compiles it, out of the cache lookup: the compile then runs as a
    job, through the cache's own lookup again (``compiler.compile_graph``)."""

    def __init__(self, artifact: Artifact, build: Callable[[], Artifact]) -> None:
        super().__init__(f"{artifact.name} lowered; its compile goes to the background")
        self.artifact = artifact
        self.build = build


_SLOTS: dict[int, threading.BoundedSemaphore] = {}
_SLOTS_LOCK = threading.Lock()


def submit(work: Callable[[], Any], jobs: int, name: str = "compile") -> concurrent.futures.Future:
    """Run ``work()`` in a daemon thread once one of ``jobs`` slots is free; its Future."""
    with _SLOTS_LOCK:
        slots = _SLOTS.setdefault(jobs, threading.BoundedSemaphore(max(1, jobs)))
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        with slots:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(work())
            except BaseException as e:  # raised by the graph's calls, where the user sees it
                future.set_exception(e)

    threading.Thread(target=run, name=f"neuron-compile-{name}", daemon=True).start()
    return future


class PendingGraph(CompiledGraph):
    """A compiled graph whose executable is still being compiled by a job: reading ``executable`` waits for it
    (its first call, then never again), and a compile that failed raises its error at every call."""

    def __init__(
        self,
        name: str,
        target: Target,
        inputs: list[Any],
        outputs: list[Any],
        needs_rng_seed: bool,
        cache_digest: str | None,
        future: concurrent.futures.Future,
    ) -> None:
        self._future: concurrent.futures.Future | None = future
        self._executable: Any = None
        self._wait_lock = threading.Lock()
        super().__init__(name, target, None, inputs, outputs, needs_rng_seed, cache_digest)

    @property
    def executable(self) -> Any:
        if self._future is not None:
            self._wait()
        return self._executable

    @executable.setter
    def executable(self, value: Any) -> None:
        self._executable = value

    @property
    def compiling(self) -> bool:
        """Whether its compile job has not finished yet."""
        return self._future is not None and not self._future.done()

    def _wait(self) -> None:
        with self._wait_lock:
            future = self._future
            if future is None:
                return
            if not future.done():
                log.info("neuron_compile: %s waits for its compile", self.name)
            t0 = time.perf_counter()
            self._executable = future.result()  # the compile's error, raised again at every call
            self._future = None
            log.info("neuron_compile: %s compiled (waited %.3fs)", self.name, time.perf_counter() - t0)
