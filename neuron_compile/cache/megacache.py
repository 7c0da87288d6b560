"""Our entries travel in PyTorch's mega-cache (``torch.compiler.save_cache_artifacts`` /
``load_cache_artifacts``), like Inductor's and AOTAutograd's.

A fresh process must import ``neuron_compile.cache`` (``import neuron_compile`` does) before
``load_cache_artifacts``: torch only knows the artifact types registered at that moment.

An artifact is untrusted input: its key is checked to be a cache key (``paths.check_key``) before it goes
near a path, and its parts are fully verified before anything lands on disk. A bad artifact is skipped
with one warning; loading never fails because of it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from torch.compiler._cache import CacheArtifact, CacheArtifactFactory, CacheArtifactManager

from . import entry as E
from .paths import InvalidKey, check_key
from .report import warn

log = logging.getLogger("neuron_compile.cache")

ARTIFACT_TYPE = "neuron_compile"

#: Returns the local store loaded artifacts are written to (None: the cache is off). Set by compile_cache,
#: which owns the stores, so that this module does not import it back.
store_for_loading: Callable[[], Any] = lambda: None  # noqa: E731


class NeuronCacheArtifact(CacheArtifact):
    """key = our cache key; content = one packed entry (meta.json + module.mlir + executable.bin)."""

    def populate_cache(self) -> None:
        try:
            key = check_key(self.key)
        except InvalidKey as e:
            warn(f"neuron cache: refused a mega-cache artifact: {e}. Nothing was written.", stacklevel=3)
            return
        try:
            meta, module, executable = E.unpack(self.content)
            payload = E.verify_meta(meta, key)
            E.decode(payload, module, executable)  # full integrity check before anything lands on disk
        except E.CorruptEntry as e:
            warn(f"neuron cache: skipped a damaged mega-cache artifact {key[:12]}: {e}", stacklevel=3)
            return
        store = store_for_loading()
        if store is None:
            return
        try:
            with store.lock(key):  # a write in progress is never swept (store.sweep)
                store.write(key, meta, module, executable)
        except Exception as e:
            warn(f"neuron cache: could not write mega-cache artifact {key[:12]}: {e}", stacklevel=3)
            return
        log.info("neuron cache: loaded %s from mega-cache into %s", key[:12], store.root)

    @staticmethod
    def type() -> str:
        return ARTIFACT_TYPE


if ARTIFACT_TYPE not in CacheArtifactFactory._artifact_types:
    CacheArtifactFactory.register(NeuronCacheArtifact)


def record(key: str, meta: bytes, module: bytes, executable: bytes) -> None:
    """Make this entry part of the next ``torch.compiler.save_cache_artifacts()``."""
    CacheArtifactManager.record_artifact(ARTIFACT_TYPE, key, E.pack(meta, module, executable))
