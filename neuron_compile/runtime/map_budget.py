"""The process's memory maps, which XLA CPU's JIT spends and Linux caps (``vm.max_map_count``).

XLA CPU JIT-compiles every kernel of an executable into an object of its own, with ~3 memory maps and an
``.eh_frame`` registered with the C++ unwinder; a training graph of a small decoder has a few hundred
kernels. At the kernel's limit (65,530 maps per process by default) a JIT allocation fails, XLA reports
an error, and the C++ exception raised for it walks unwinder frames whose memory is already unmapped: the
process dies with SIGSEGV, losing the run. A process gets there by holding a few hundred compiled graphs:
many input shapes, many graph breaks, models compiled again and again without freeing the old ones (Dynamo
frees a graph at ``torch._dynamo.reset()`` once its model or function is deleted; some it keeps longer,
e.g. those of a compiled function whose ``loss.backward()`` breaks the graph).

So before every JIT (a compile, or the load of a cached executable) the count is read (~1 us per map):
past ``WARN_FRACTION`` of the limit, one warning; past ``REFUSE_FRACTION``, the registered reliefs run, the
cheapest first, until the count is back under ``WARN_FRACTION`` (the compile cache lets go of executables
only it holds; then graphs not called lately unload theirs, to be reloaded at their next call); if it is
still past ``REFUSE_FRACTION``, the JIT is refused with ``NeuronMemoryMapError`` while the process is still
whole, so that the user can save their work.
"""

from __future__ import annotations

import functools
import gc
import logging
import threading
import time
import warnings
from typing import Callable

from ..errors import NeuronMemoryMapError, NeuronMemoryMapWarning

#: Above this share of the limit a JIT is refused (after the reliefs). The headroom left, ~6,500 maps at the
#: default limit, is several times what one JIT takes (the recurrent test model's forward and backward,
#: ~260 kernels, took ~1,000 maps between them, the serialization's re-JIT included).
REFUSE_FRACTION = 0.9
#: Above this share, one warning per process.
WARN_FRACTION = 0.6
#: A count read far below the warning line vouches for the next reserves, each taken to add at most this many
#: maps (the recurrent model's two JITs and a serialization added ~1,000), for at most ``RECOUNT_SECONDS``:
#: reading the count costs ~1 us per map, a few percent of a small compile or cache load.
MAPS_PER_JIT = 2000
RECOUNT_SECONDS = 1.0

log = logging.getLogger(__name__)

_MAPS = "/proc/self/maps"
_LIMIT = "/proc/sys/vm/max_map_count"

_reliefs: list[tuple[int, Callable[[], object]]] = []
_warned = False
_lock = threading.RLock()
_last_count = 0
_last_read = float("-inf")  # time.monotonic() of the last count
_vouched_since = 0  # reserves let through on that count


@functools.lru_cache(maxsize=None)
def map_limit() -> int | None:
    """The kernel's limit on this process's memory maps; None where there is none to read (not Linux)."""
    try:
        with open(_LIMIT, "rb") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def map_count() -> int:
    """How many memory maps the process holds now (lines of ``/proc/self/maps``)."""
    global _last_count, _last_read, _vouched_since
    count = _read_count()
    _last_count, _last_read, _vouched_since = count, time.monotonic(), 0
    return count


def _read_count() -> int:
    with open(_MAPS, "rb") as f:
        return f.read().count(b"\n")


def _vouched_for(limit: int) -> bool:
    """Whether the last count read still vouches for one more reserve (see ``MAPS_PER_JIT``)."""
    global _vouched_since
    if time.monotonic() - _last_read > RECOUNT_SECONDS:
        return False
    if (_vouched_since + 1) * MAPS_PER_JIT > WARN_FRACTION * limit - _last_count:
        return False
    _vouched_since += 1
    return True


def add_relief(release: Callable[[], object], rank: int) -> None:
    """Have ``release`` called, near the limit, to drop executables the process can get back; reliefs of a
    lower ``rank`` (cheaper to undo) run first."""
    _reliefs.append((rank, release))
    _reliefs.sort(key=lambda r: r[0])


def relieve(limit: int) -> int:
    """Run the reliefs, cheapest first, until the count is under ``WARN_FRACTION`` of ``limit``; the count."""
    with _lock:
        count = before = map_count()
        for _rank, release in _reliefs:
            if count < WARN_FRACTION * limit:
                break
            release()
            gc.collect()  # executables in reference cycles with their graphs
            count = map_count()
        log.info("neuron_compile: memory maps %d -> %d of the limit %d after the reliefs", before, count, limit)
        return count


def reserve(what: str) -> None:
    """Called before ``what`` (e.g. "compiling graph0_forward") makes XLA JIT-compile code: raises
    ``NeuronMemoryMapError`` when the process is too close to its map limit for the JIT to be safe even after
    the reliefs, warns once when it is getting there. Where the count cannot be read, does nothing."""
    global _warned
    limit = map_limit()
    if limit is None:
        return
    with _lock:
        if _vouched_for(limit):
            return
        try:
            count = map_count()
        except OSError:  # no /proc/self/maps (a sandbox): as where there is no limit to read
            return
        if count >= REFUSE_FRACTION * limit:
            count = relieve(limit)
        if count >= REFUSE_FRACTION * limit:
            raise NeuronMemoryMapError(
                f"neuron backend: not {what}: this process holds {count:,} memory maps, "
                f"{count / limit:.0%} of the kernel's limit (vm.max_map_count = {limit:,}). XLA CPU keeps ~3 maps "
                "per compiled kernel of every live graph, and a JIT at the limit crashes the process. Free "
                "compiled models and functions you no longer use (del them, then torch._dynamo.reset()), "
                "compile fewer distinct graphs (fewer input shapes: neuron_compile.pad_to_bucket; fewer graph "
                "breaks), or raise the limit: sudo sysctl -w vm.max_map_count=262144."
            )
        if count >= WARN_FRACTION * limit and not _warned:
            _warned = True
            warnings.warn(
                f"neuron backend: this process holds {count:,} memory maps, {count / limit:.0%} of the kernel's "
                f"limit (vm.max_map_count = {limit:,}); XLA CPU keeps ~3 per compiled kernel of every live "
                f"graph. Near {REFUSE_FRACTION:.0%}, graphs not called lately are unloaded (reloaded at their "
                "next call) and compiles refused if that is not enough. Free compiled models you no longer use "
                "(del them, then torch._dynamo.reset()), compile fewer distinct graphs (many input shapes?), or "
                "raise the limit (sudo sysctl -w vm.max_map_count=262144).",
                NeuronMemoryMapWarning,
                stacklevel=2,
            )
