"""How the cache tells the user something went wrong: one ``NeuronCacheWarning`` per problem and
directory per process, mirrored on the ``neuron_compile.cache`` logger."""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings

import torch

log = logging.getLogger("neuron_compile.cache")
with contextlib.suppress(Exception):  # lets torch._logging.set_logs(modules={"neuron_cache": ...}) find us
    torch._logging._internal.register_log("neuron_cache", "neuron_compile.cache")


class NeuronCacheWarning(UserWarning):
    """The cache could not be used as asked (unwritable, untrusted, corrupt entry...). The job still runs."""


def warn(message: str, stacklevel: int = 4) -> None:
    warnings.warn(message, NeuronCacheWarning, stacklevel=stacklevel)
    log.warning("%s", message)


class OnceWarner:
    """Warns once per (where, kind): a thousand graphs hitting an unwritable directory give one warning."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: set[tuple[str, str]] = set()

    def __call__(self, where: str, kind: str, message: str) -> None:
        with self._lock:
            if (where, kind) in self._seen:
                return
            self._seen.add((where, kind))
        warn(message, stacklevel=5)

    def clear(self) -> None:
        with self._lock:
            self._seen.clear()
