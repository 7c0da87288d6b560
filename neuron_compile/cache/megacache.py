"""Our entries travel in PyTorch's mega-cache (``torch.compiler.save_cache_artifacts`` /
``load_cache_artifacts``), like Inductor's and AOTAutograd's.

A fresh process must import ``neuron_compile.cache`` (``import neuron_compile`` does) before
``load_cache_artifacts``: torch only knows the artifact types registered at that moment.
"""

from __future__ import annotations

import logging
import warnings

from torch.compiler._cache import CacheArtifact, CacheArtifactFactory, CacheArtifactManager

from . import entry as E

log = logging.getLogger("neuron_compile.cache")

ARTIFACT_TYPE = "neuron_compile"


class NeuronCacheArtifact(CacheArtifact):
    """key = our cache key; content = one packed entry (meta.json + module.mlir + executable.bin)."""

    def populate_cache(self) -> None:
        from . import NeuronCacheWarning, store_for_default_dir

        try:
            meta, module, executable = E.unpack(self.content)
            payload = E.verify_meta(meta, self.key)
            E.decode(payload, module, executable)  # full integrity check before anything lands on disk
        except E.CorruptEntry as e:
            warnings.warn(f"neuron cache: skipped a damaged mega-cache artifact {self.key[:12]}: {e}", NeuronCacheWarning)
            return
        store = store_for_default_dir()
        if store is None:
            return
        try:
            store.write(self.key, meta, module, executable)
        except Exception as e:  # noqa: BLE001 - a cache problem must never fail loading
            warnings.warn(f"neuron cache: could not write mega-cache artifact {self.key[:12]}: {e}", NeuronCacheWarning)
            return
        log.info("neuron cache: loaded %s from mega-cache into %s", self.key[:12], store.root)

    @staticmethod
    def type() -> str:
        return ARTIFACT_TYPE


if ARTIFACT_TYPE not in CacheArtifactFactory._artifact_types:
    CacheArtifactFactory.register(NeuronCacheArtifact)


def record(key: str, meta: bytes, module: bytes, executable: bytes) -> None:
    """Make this entry part of the next ``torch.compiler.save_cache_artifacts()``."""
    CacheArtifactManager.record_artifact(ARTIFACT_TYPE, key, E.pack(meta, module, executable))
