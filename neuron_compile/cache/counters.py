"""Hit/miss counters: this process's totals, and the share of each directory's ``stats.json`` not yet
written there (flushed on misses, at most every ``FLUSH_INTERVAL`` s on disk hits, and at exit)."""

from __future__ import annotations

import atexit
import os
import threading
import time

from .store import DiskStore, StoreUnavailable

COUNTERS = (
    "hits", "memory_hits", "disk_hits", "misses", "stores", "corrupt", "evictions", "uncached", "swept",
    "compile_seconds_saved", "compile_seconds_spent",
    # the remote tier (remote.py): lookups after a local miss, publishes, entries refused, failures
    "remote_hits", "remote_misses", "remote_stores", "remote_rejected", "remote_errors",
)  # fmt: skip
#: Disk hits update stats.json at most this often (misses always do; the rest at exit).
FLUSH_INTERVAL = 2.0


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)
        self._unflushed: dict[str, dict[str, float]] = {}  # root -> counters not yet in its stats.json
        self._last_flush: dict[str, float] = {}
        atexit.register(self.flush_all)

    def count(self, root: str | None, **delta: float) -> None:
        """Add to this process's totals and, when ``root`` is given, to that directory's pending share."""
        with self._lock:
            for k, v in delta.items():
                self._process[k] += v
                if root is not None:
                    self._unflushed.setdefault(root, dict.fromkeys(COUNTERS, 0.0))[k] += v

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._process)

    def reset(self) -> None:
        with self._lock:
            self._process = dict.fromkeys(COUNTERS, 0.0)

    def flush(self, root: str, min_interval: float = 0.0) -> None:
        with self._lock:
            if time.monotonic() - self._last_flush.get(root, -1e9) < min_interval:
                return
            self._last_flush[root] = time.monotonic()
            pending = self._unflushed.pop(root, None)
        if not pending or not os.path.isdir(root):
            return  # a directory removed meanwhile (evaluate's temporary cache) is not made again for its counters
        try:
            DiskStore(root).add_stats(pending)
        except (StoreUnavailable, OSError):
            pass  # the directory problem was already reported once

    def flush_all(self) -> None:
        for root in list(self._unflushed):
            self.flush(root)
