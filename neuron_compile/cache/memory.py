"""The in-process layer: live executables by key, least recently used dropped first."""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..artifact import Artifact

#: Entries kept (live executables; the compiled graphs hold them anyway).
MEMORY_ENTRIES = 256


class MemoryLRU:
    def __init__(self, capacity: int = MEMORY_ENTRIES) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._items: OrderedDict[str, Artifact] = OrderedDict()

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
            self._items[key] = artifact
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)
