"""The in-process layer: live executables by key, least recently used dropped first."""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..artifact import Artifact

#: Entries kept: loaded executables, for a graph compiled again in this process (after torch._dynamo.reset(),
#: by another model with the same blocks). Those of graphs still alive cost nothing more; those of graphs
#: gone are held only here, hence also a bound on their size (serialized bytes, about their JIT code's).
MEMORY_ENTRIES = 256
MEMORY_BYTES = 512 * 2**20


class MemoryLRU:
    def __init__(self, capacity: int = MEMORY_ENTRIES, max_bytes: int = MEMORY_BYTES) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._items: OrderedDict[str, Artifact] = OrderedDict()
        self._bytes = 0

    def get(self, key: str) -> Artifact | None:
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
            return hit

    def put(self, key: str, artifact: Artifact) -> None:
        if artifact.loaded is None:
            return  # nothing live to share
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= len(old.executable)
            self._items[key] = artifact
            self._bytes += len(artifact.executable)
            # The newest entry stays, however large: its graph is being used.
            while len(self._items) > 1 and (len(self._items) > self.capacity or self._bytes > self.max_bytes):
                _, gone = self._items.popitem(last=False)
                self._bytes -= len(gone.executable)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)
