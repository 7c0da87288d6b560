"""The compile cache: a shape-keyed, cross-process, on-disk store of compiled graphs.

``cache_for(opts).get_or_build(gm, example_inputs, opts, build)`` returns ``(Artifact, state)``:

1. key the graph (``key.cache_key``: canonical graph + input metadata + options + versions + tag);
2. in-process layer: a hit returns the already loaded executable (no file is read);
3. disk: a verified entry is deserialized; a damaged one is a miss (warning) that gets rewritten;
4. miss: take the key's lock, look again (another process may have just built it), else ``build()``,
   store atomically, evict down to the size cap.

Any problem with the directory (unwritable, full, untrusted) degrades to compiling without the cache,
with one warning per directory and process. Hits and misses are logged on the ``neuron_compile.cache``
logger (``TORCH_LOGS="+neuron_compile.cache"`` or ``torch._logging.set_logs(modules={"neuron_cache":
logging.DEBUG})``) and counted by ``cache_stats()`` (this process) and ``persistent_stats()`` (the dir).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import warnings
from collections import OrderedDict
from typing import Any, Callable

import filelock
import torch

from ..artifact import Artifact
from ..options import Options
from . import entry as E
from . import megacache
from .key import CacheKey, NotCacheable, cache_key
from .store import DEFAULT_MAX_BYTES, DiskStore, StoreUnavailable, default_cache_dir

__all__ = [
    "CompileCache",
    "NeuronCacheWarning",
    "cache_for",
    "cache_key",
    "cache_stats",
    "clear_memory",
    "persistent_stats",
    "reset_cache_stats",
]

log = logging.getLogger("neuron_compile.cache")
with contextlib.suppress(Exception):  # lets torch._logging.set_logs(modules={"neuron_cache": ...}) find us
    torch._logging._internal.register_log("neuron_cache", "neuron_compile.cache")

#: Entries kept in the in-process layer (live executables; the compiled graphs hold them anyway).
MEMORY_ENTRIES = 256


class NeuronCacheWarning(UserWarning):
    """The cache could not be used as asked (unwritable, untrusted, corrupt entry...). The job still runs."""


COUNTERS = (
    "hits", "memory_hits", "disk_hits", "misses", "stores", "corrupt", "evictions", "uncached",
    "compile_seconds_saved", "compile_seconds_spent",
)  # fmt: skip

_lock = threading.RLock()
_memory: OrderedDict[str, Artifact] = OrderedDict()
_process_stats: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)
_unflushed: dict[str, dict[str, float]] = {}  # root -> counters not yet added to its stats.json
_warned: set[tuple[str, str]] = set()
_last_flush: dict[str, float] = {}
#: Disk hits update stats.json at most this often (misses always do; the rest at exit).
FLUSH_INTERVAL = 2.0
_trusted_roots: set[str] = set()  # roots usable_store() accepted: memory hits count there
_recorded: set[str] = set()  # keys already handed to torch's mega-cache in this process


def cache_stats() -> dict[str, float]:
    """This process's counters: hits (memory_hits + disk_hits), misses, compile seconds saved/spent..."""
    with _lock:
        return dict(_process_stats)


def reset_cache_stats() -> None:
    with _lock:
        for k in _process_stats:
            _process_stats[k] = 0.0


def clear_memory() -> None:
    """Forget the in-process layer (the next lookup of every key goes to disk)."""
    with _lock:
        _memory.clear()


def persistent_stats(cache_dir: str | None = None) -> dict[str, float]:
    """Counters of every process that used ``cache_dir`` (this one's flushed first)."""
    store = DiskStore(cache_dir or resolve_dir(Options.from_user(None)))
    _flush(store.root)
    return store.read_stats()


def resolve_dir(opts: Options) -> str:
    """Option ``cache_dir`` > NEURON_COMPILE_CACHE_DIR (already folded into the option) > user cache dir."""
    return opts.cache_dir or default_cache_dir()


def _count(root: str | None, **delta: float) -> None:
    with _lock:
        for k, v in delta.items():
            _process_stats[k] += v
            if root is not None:
                pending = _unflushed.setdefault(root, dict.fromkeys(COUNTERS, 0.0))
                pending[k] += v


def _flush(root: str, min_interval: float = 0.0) -> None:
    """Add this process's pending counters to ``root``'s stats.json (at most every ``min_interval`` s)."""
    with _lock:
        if time.monotonic() - _last_flush.get(root, -1e9) < min_interval:
            return
        _last_flush[root] = time.monotonic()
        pending = _unflushed.pop(root, None)
    if not pending:
        return
    try:
        DiskStore(root).add_stats(pending)
    except (StoreUnavailable, OSError):
        pass  # the directory problem was already reported once


@atexit.register
def _flush_all() -> None:
    for root in list(_unflushed):
        _flush(root)


def _warn_once(root: str, kind: str, message: str) -> None:
    with _lock:
        if (root, kind) in _warned:
            return
        _warned.add((root, kind))
    warnings.warn(message, NeuronCacheWarning, stacklevel=4)
    log.warning("%s", message)


def store_for_default_dir() -> DiskStore | None:
    """The store ``torch.compile`` would use now, or None when it may not be used (untrusted dir)."""
    opts = Options.from_user(None)
    return CompileCache(opts).usable_store()


def _load(artifact: Artifact, opts: Options) -> Artifact:
    """Deserialize the executable once, here, so a bad blob is a miss rather than a crash later."""
    from ..runtime.targets import target_for

    artifact.loaded = target_for(opts).deserialize(artifact.executable)
    return artifact


class CompileCache:
    """The cache for one set of options (its directory, trust, size cap)."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.store = DiskStore(resolve_dir(opts))
        self.max_bytes = opts.cache_max_bytes if opts.cache_max_bytes is not None else DEFAULT_MAX_BYTES

    def usable_store(self) -> DiskStore | None:
        """The disk store if its location may be trusted (warns once either way), else None."""
        root = self.store.root
        reason = self.store.untrusted_reason()
        if reason is None:
            _trusted_roots.add(root)
            return self.store
        if self.opts.trust_cache_dir:
            _warn_once(
                root, "trusted",
                f"neuron cache: loading compiled executables (native code) from {root} although {reason}, "
                "because it is explicitly trusted (trust_cache_dir / NEURON_COMPILE_CACHE_TRUST=1).",
            )  # fmt: skip
            _trusted_roots.add(root)
            return self.store
        _warn_once(
            root, "untrusted",
            f"neuron cache: not using {root}: {reason}. Cached executables are native code, so such a "
            "directory could run another user's code in your process. Compiling without the disk cache. "
            "Use a private directory (NEURON_COMPILE_CACHE_DIR), or trust this one with "
            "options={'trust_cache_dir': True} / NEURON_COMPILE_CACHE_TRUST=1.",
        )  # fmt: skip
        return None

    # ----------------------------------------------------------------- lookup
    def get_or_build(
        self, gm: Any, example_inputs: list[Any], opts: Options, build: Callable[[], Artifact]
    ) -> tuple[Artifact, str]:
        if not opts.cache:
            return build(), "off"
        t0 = time.perf_counter()
        try:
            key = cache_key(gm, example_inputs, opts)
        except NotCacheable as e:
            log.debug("neuron cache: graph not cacheable (%s); compiling without the cache", e)
            _count(None, uncached=1)
            return build(), "off"

        with _lock:
            hit = _memory.get(key.digest)
            if hit is not None:
                _memory.move_to_end(key.digest)
            counted_root = self.store.root if self.store.root in _trusted_roots else None
        if hit is not None:
            _count(counted_root, hits=1, memory_hits=1, compile_seconds_saved=hit.lower_seconds + hit.compile_seconds)
            log.info("neuron cache: hit (memory) %s %s in %.4fs", key.digest[:12], hit.name, time.perf_counter() - t0)
            if key.digest not in _recorded:
                self._record_megacache(key.digest, E.encode(hit, key.digest, key.summary))
            return hit, "hit"

        store = self.usable_store()
        if store is None:
            return self._build_uncached(key, build)
        found = self._read(store, key)
        if found is not None:
            log.info("neuron cache: hit %s %s in %.4fs", key.digest[:12], found.name, time.perf_counter() - t0)
            return found, "hit"
        try:
            lock = store.lock(key.digest)
            try:
                lock.acquire(timeout=0)
            except filelock.Timeout:
                log.info("neuron cache: waiting for another process compiling %s", key.digest[:12])
                lock.acquire()
        except (StoreUnavailable, OSError) as e:
            self._warn_unwritable(store, e)
            return self._build_uncached(key, build)
        try:
            found = self._read(store, key)  # built by another process while we waited?
            if found is not None:
                log.info("neuron cache: hit %s %s (built by another process)", key.digest[:12], found.name)
                return found, "hit"
            log.info("neuron cache: miss %s; compiling", key.digest[:12])
            artifact = build()
            self._remember(key, artifact)
            _count(store.root, misses=1, compile_seconds_spent=artifact.lower_seconds + artifact.compile_seconds)
            self._store(store, key, artifact)
        finally:
            lock.release()
        _flush(store.root)
        return artifact, "miss"

    def _build_uncached(self, key: CacheKey, build: Callable[[], Artifact]) -> tuple[Artifact, str]:
        log.info("neuron cache: miss %s; compiling (not stored on disk)", key.digest[:12])
        artifact = build()
        self._remember(key, artifact)
        _count(None, misses=1, compile_seconds_spent=artifact.lower_seconds + artifact.compile_seconds)
        with contextlib.suppress(E.NotSerializable):
            self._record_megacache(key.digest, E.encode(artifact, key.digest, key.summary))
        return artifact, "miss"

    def _read(self, store: DiskStore, key: CacheKey) -> Artifact | None:
        """A verified, loaded entry from disk; None when absent or damaged (damaged: warned, removed)."""
        if not self.opts.trust_cache_dir:
            reason = store.entry_untrusted_reason(key.digest)
            if reason is not None:
                _warn_once(key.digest, "untrusted-entry", f"neuron cache: not loading entry {key.digest[:12]}: {reason}.")
                return None
        try:
            found = store.read(key.digest)
            if found is None:
                return None
            payload, artifact, parts = found
            _load(artifact, self.opts)
        except E.CorruptEntry as e:
            self._report_corrupt(store, key, str(e))
            return None
        except Exception as e:  # noqa: BLE001 - e.g. the runtime refuses the executable blob
            self._report_corrupt(store, key, f"executable could not be loaded ({type(e).__name__}: {e})")
            return None
        _count(store.root, hits=1, disk_hits=1, compile_seconds_saved=artifact.lower_seconds + artifact.compile_seconds)
        _flush(store.root, min_interval=FLUSH_INTERVAL)
        self._remember(key, artifact)
        self._record_megacache(key.digest, parts)
        return artifact

    def _report_corrupt(self, store: DiskStore, key: CacheKey, why: str) -> None:
        msg = f"neuron cache: entry {key.digest[:12]} in {store.root} is damaged ({why}); recompiling it."
        warnings.warn(msg, NeuronCacheWarning, stacklevel=4)
        log.warning("%s", msg)
        _count(store.root, corrupt=1)
        store.remove(key.digest)  # so the re-check under the lock is a plain miss, not a second warning

    @staticmethod
    def _warn_unwritable(store: DiskStore, e: Exception) -> None:
        _warn_once(
            store.root, "unwritable",
            f"neuron cache: cannot write to {store.root} ({e}); compiling without storing results.",
        )  # fmt: skip

    def _store(self, store: DiskStore, key: CacheKey, artifact: Artifact) -> None:
        try:
            parts = E.encode(artifact, key.digest, key.summary)
        except E.NotSerializable as e:
            log.debug("neuron cache: not storing %s: %s", key.digest[:12], e)
            return
        self._record_megacache(key.digest, parts)
        try:
            store.write(key.digest, *parts)
        except StoreUnavailable as e:
            self._warn_unwritable(store, e)
            return
        _count(store.root, stores=1)
        evicted = store.evict(self.max_bytes, protect=key.digest)
        if evicted:
            _count(store.root, evictions=len(evicted))
            log.info("neuron cache: evicted %d entries to stay under %d bytes", len(evicted), self.max_bytes)

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _remember(key: CacheKey, artifact: Artifact) -> None:
        if artifact.loaded is None:
            return
        with _lock:
            _memory[key.digest] = artifact
            _memory.move_to_end(key.digest)
            while len(_memory) > MEMORY_ENTRIES:
                _memory.popitem(last=False)

    @staticmethod
    def _record_megacache(digest: str, parts: tuple[bytes, bytes, bytes]) -> None:
        megacache.record(digest, *parts)
        _recorded.add(digest)


def cache_for(opts: Options) -> CompileCache:
    """The cache that ``compile_graph`` uses for ``opts``."""
    return CompileCache(opts)
