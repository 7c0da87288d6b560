"""The compile cache: a shape-keyed, cross-process, on-disk store of compiled graphs.

One process-wide object, ``compile_cache.CACHE``, does the work; this module is its public face.
``cache_for(opts).get_or_build(gm, example_inputs, opts, build)`` is what the compiler calls.

Modules, each with one job:

- ``paths``     the cache directory (``resolve_cache_dir``, the one place it is decided) and key validation
- ``key``       THE cache key of a graph
- ``entry``     how one entry is encoded (JSON metadata with checksums, StableHLO, executable bytes)
- ``store``     the on-disk directory: atomic writes, contained reads, locks, eviction, leftovers sweep
- ``trust``     whether a directory may hand us native code
- ``verify``    whether a loaded executable fits its entry's input/output plan
- ``memory``    the in-process LRU of live executables
- ``counters``  hit/miss counters, this process's and each directory's ``stats.json``
- ``report``    ``NeuronCacheWarning``, one warning per problem
- ``megacache`` our entries in PyTorch's ``save_cache_artifacts``/``load_cache_artifacts``
- ``remote``    the shared tier behind the disk (option ``cache_url``: S3 or any fsspec URL; fsspec loads lazily)
- ``compile_cache`` the lookup itself (memory -> disk -> lock -> remote -> build -> store -> publish)
- ``collect``   ``neuron-compile precompile collect``'s manifest and its recorder (a ``CACHE.observers`` entry)

Hits and misses are logged on the ``neuron_compile.cache`` logger (``TORCH_LOGS="+neuron_compile.cache"``
or ``torch._logging.set_logs(modules={"neuron_cache": logging.DEBUG})``) and counted by ``cache_stats()``
(this process) and ``persistent_stats()`` (the directory, all processes).

This package imports neither jax nor the lowering: ``neuron-compile cache ...`` stays light. Keying a
graph imports jax (its version is part of the key) and loading an executable imports the runtime.
"""

from __future__ import annotations

from ..options import Options
from . import megacache  # noqa: F401  (registers our artifact type with PyTorch's mega-cache)
from .compile_cache import CACHE, CompileCache
from .key import cache_key
from .paths import InvalidKey, resolve_cache_dir
from .report import NeuronCacheWarning
from .store import DiskStore

__all__ = [
    "CACHE",
    "CompileCache",
    "DiskStore",
    "InvalidKey",
    "NeuronCacheWarning",
    "cache_for",
    "cache_key",
    "cache_stats",
    "clear_memory",
    "persistent_stats",
    "reset_cache_stats",
    "resolve_cache_dir",
]


def cache_for(opts: Options) -> CompileCache:
    """The cache ``compile_graph`` uses: the process-wide one (``opts`` is passed to each call)."""
    return CACHE


def cache_stats() -> dict[str, float]:
    """This process's counters: hits (memory_hits + disk_hits + remote_hits), misses, compile seconds
    saved/spent, and the remote tier's remote_misses, remote_stores, remote_rejected, remote_errors..."""
    return CACHE.counters.snapshot()


def reset_cache_stats() -> None:
    CACHE.counters.reset()


def clear_memory() -> None:
    """Forget the in-process layer (the next lookup of every key goes to disk)."""
    CACHE.memory.clear()


def persistent_stats(cache_dir: str | None = None) -> dict[str, float]:
    """Counters of every process that used ``cache_dir`` (default: the resolved cache dir)."""
    return CACHE.persistent_stats(cache_dir)
