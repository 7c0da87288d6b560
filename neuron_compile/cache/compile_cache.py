"""``CompileCache``: the one process-wide cache object (``CACHE``) the compiler asks for every graph.

``CACHE.get_or_build(gm, example_inputs, opts, build)`` returns ``(Artifact, state, digest)``:

1. key the graph (``key.cache_key``: canonical graph + input metadata + options + versions + tag);
2. in-process layer (``memory.MemoryLRU``): a hit returns the already loaded executable (no file read);
3. disk (``store.DiskStore`` of ``opts``' directory, if ``trust`` allows it): a verified entry whose
   executable fits its own plan (``verify``) is loaded; a damaged one is a warned miss that is rewritten;
4. miss: take the key's lock, look again (another process may have just built it), then the remote tier
   (``remote.RemoteStore`` of option ``cache_url``, if set: a verified entry is loaded and copied to disk),
   else ``build()``, store atomically, evict down to the size cap, and publish to the remote tier.

Any problem with the directory (unwritable, full, untrusted) degrades to compiling without the disk cache,
with one warning per directory and process (``report.OnceWarner``).

Every miss that compiles says why on the ``neuron_compile.cache`` logger at INFO (when that level is on):
the nearest entries of the directory for the same graph and the key parts that differ (``explain_miss``).
``CACHE.observers`` see every graph looked up (``neuron-compile precompile collect`` records them).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable

import filelock

from ..artifact import Artifact
from ..errors import NeuronMemoryMapError
from ..options import Options
from ..runtime import map_budget
from . import entry as E
from . import megacache
from .counters import FLUSH_INTERVAL, Counters
from .key import CacheKey, NotCacheable, cache_key, key_differences, part_name
from .memory import MemoryLRU
from .paths import resolve_cache_dir
from .remote import RemoteRejected, RemoteStore, RemoteUnavailable, hmac_key_from_env, timeout_from_env
from .report import OnceWarner, log, warn
from .store import DEFAULT_MAX_BYTES, DiskStore, StoreUnavailable
from .verify import check_executable


def _load(artifact: Artifact, opts: Options) -> Artifact:
    """Deserialize the executable once, here, and check it fits the entry's plan, so a bad blob is a miss
    rather than a crash at run time."""
    from ..runtime.targets import target_for

    artifact.loaded = target_for(opts).deserialize(artifact.executable)
    check_executable(artifact)
    return artifact


class CompileCache:
    """Process-wide state of the compile cache: the in-process layer, counters, warnings already given,
    directories already judged trustworthy and swept. Per-call settings (directory, trust, size cap)
    come from the ``Options`` of each call."""

    def __init__(self) -> None:
        self.memory = MemoryLRU()
        self.counters = Counters()
        self.warn_once = OnceWarner()
        self._lock = threading.Lock()
        self._trusted_roots: set[str] = set()  # roots store_for() accepted: memory hits count there
        self._swept_roots: set[str] = set()
        self.recorded: set[str] = set()  # keys already handed to torch's mega-cache in this process
        self._remotes: dict[tuple[str, bytes | None, float], RemoteStore] = {}  # each keeps its failure state
        #: Called as ``fn(gm, example_inputs, opts, artifact, digest)`` after every cached lookup (hit or miss).
        self.observers: list[Callable[[Any, list[Any], Options, Artifact, str], None]] = []
        # Near the memory-map limit the loaded executables this layer alone keeps are the first to go.
        map_budget.add_relief(self.memory.clear, rank=0)

    # ------------------------------------------------------------- directory
    @staticmethod
    def directory(opts: Options) -> str:
        return resolve_cache_dir(opts.cache_dir, opts.neuron_cc_flags)

    def store_for(self, opts: Options) -> DiskStore | None:
        """The disk store ``opts`` names if it may be trusted (warns once either way), else None.
        The first use of a directory in this process sweeps what killed processes left behind."""
        store = DiskStore(self.directory(opts))
        root = store.root
        reason = store.untrusted_reason()
        if reason is not None and not opts.trust_cache_dir:
            self.warn_once(
                root, "untrusted",
                f"neuron cache: not using {root}: {reason}. Cached executables are native code, so such a "
                "directory could run another user's code in your process. Compiling without the disk cache. "
                "Use a private directory (NEURON_COMPILE_CACHE_DIR), or trust this one with "
                "options={'trust_cache_dir': True} / NEURON_COMPILE_CACHE_TRUST=1.",
            )  # fmt: skip
            return None
        if reason is not None:
            self.warn_once(
                root, "trusted",
                f"neuron cache: loading compiled executables (native code) from {root} although {reason}, "
                "because it is explicitly trusted (trust_cache_dir / NEURON_COMPILE_CACHE_TRUST=1).",
            )  # fmt: skip
        with self._lock:
            self._trusted_roots.add(root)
            first = root not in self._swept_roots
            self._swept_roots.add(root)
        if first:
            self._sweep(store)
        return store

    def remote_for(self, opts: Options) -> RemoteStore | None:
        """The remote tier ``opts.cache_url`` names (None: not configured). One object per URL, signing
        key and timeout, so a URL found down stays unused for the rest of the process."""
        if not opts.cache_url:
            return None
        ident = (opts.cache_url, hmac_key_from_env(), timeout_from_env())
        with self._lock:
            remote = self._remotes.get(ident)
            if remote is None:
                remote = self._remotes[ident] = RemoteStore(ident[0], timeout=ident[2], hmac_key=ident[1])
        return remote

    def _sweep(self, store: DiskStore) -> None:
        try:
            swept = store.sweep()
        except OSError:
            return  # read-only or vanished: nothing we may delete anyway
        if swept:
            self.counters.count(store.root, swept=len(swept))
            log.info(
                "neuron cache: removed %d stale leftovers of interrupted processes from %s", len(swept), store.root
            )

    # ----------------------------------------------------------------- lookup
    def get_or_build(
        self, gm: Any, example_inputs: list[Any], opts: Options, build: Callable[[], Artifact]
    ) -> tuple[Artifact, str, str | None]:
        """The graph's artifact, how it was found ("hit", "miss" or "off": not cached) and the digest of
        its entry (None when not cached)."""
        if not opts.cache:
            return build(), "off", None
        t0 = time.perf_counter()  # a hit's logged time includes the key's
        try:
            key = cache_key(gm, example_inputs, opts)
        except NotCacheable as e:
            log.debug("neuron cache: graph not cacheable (%s); compiling without the cache", e)
            self.counters.count(None, uncached=1)
            return build(), "off", None
        artifact, state = self._get_or_build(key, opts, build, t0)
        for observe in self.observers:
            observe(gm, example_inputs, opts, artifact, key.digest)
        return artifact, state, key.digest

    def load(self, digest: str, opts: Options) -> Artifact | None:
        """The entry ``digest`` (memory, then disk), loaded and verified; None when it is not there (or is
        damaged, untrusted). Never builds: for AOTAutograd's cache hits (``aot_cache``), which name ours."""
        hit = self._memory_hit(digest, opts)
        if hit is not None:
            log.info("neuron cache: hit (memory) %s %s, named by AOTAutograd's cache", digest[:12], hit.name)
            return hit
        store = self.store_for(opts)
        found = self._read(store, CacheKey(digest, {}), opts) if store is not None else None
        if found is not None:
            log.info("neuron cache: hit %s %s, named by AOTAutograd's cache", digest[:12], found.name)
        return found

    def executable_blob(self, digest: str, opts: Options) -> bytes | None:
        """The serialized executable of entry ``digest`` (memory, then a verified disk entry), not loaded;
        None when it is not there. For compiled graphs that unload theirs near the memory-map limit."""
        hit = self.memory.get(digest)
        if hit is not None:
            return hit.executable
        store = self.store_for(opts)
        if store is None or (not opts.trust_cache_dir and store.entry_untrusted_reason(digest) is not None):
            return None
        try:
            found = store.read(digest)
        except (E.CorruptEntry, OSError):
            return None
        return None if found is None else found[1].executable

    def _get_or_build(
        self, key: CacheKey, opts: Options, build: Callable[[], Artifact], t0: float
    ) -> tuple[Artifact, str]:
        hit = self._memory_hit(key.digest, opts)
        if hit is not None:
            log.info("neuron cache: hit (memory) %s %s in %.4fs", key.digest[:12], hit.name, time.perf_counter() - t0)
            if key.digest not in self.recorded:
                self._record_megacache(key.digest, E.encode(hit, key.digest, key.summary))
            return hit, "hit"

        store = self.store_for(opts)
        if store is None:
            return self._build_uncached(key, build, opts)
        found = self._read(store, key, opts)
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
            return self._build_uncached(key, build, opts)
        remote = self.remote_for(opts)
        try:
            found = self._read(store, key, opts)  # built by another process while we waited?
            if found is not None:
                log.info("neuron cache: hit %s %s (built by another process)", key.digest[:12], found.name)
                return found, "hit"
            found, damaged = self._fetch_remote(remote, key, opts, store)  # under the lock: one download per host
            if found is not None:
                return found, "hit"
            log.info("neuron cache: miss %s; compiling", key.digest[:12])
            self._explain_miss(store, key)
            artifact = build()
            self.memory.put(key.digest, artifact)
            spent = artifact.lower_seconds + artifact.compile_seconds
            self.counters.count(store.root, misses=1, compile_seconds_spent=spent)
            parts = self._store(store, key, artifact, opts)
        finally:
            lock.release()
        self._publish(remote, key, parts, damaged, store.root)  # after the release: local waiters go on
        self.counters.flush(store.root)
        return artifact, "miss"

    @staticmethod
    def _explain_miss(store: DiskStore, key: CacheKey) -> None:
        if not log.isEnabledFor(logging.INFO):
            return  # reading other entries' metadata is for those who asked to see it
        try:
            lines = explain_miss(store, key.summary, exclude=key.digest)
        except OSError:
            return
        log.info("neuron cache: why %s missed: %s", key.digest[:12], "; ".join(lines))

    def _memory_hit(self, digest: str, opts: Options) -> Artifact | None:
        hit = self.memory.get(digest)
        if hit is not None:
            root = self.directory(opts)
            counted_root = root if root in self._trusted_roots else None
            saved = hit.lower_seconds + hit.compile_seconds
            self.counters.count(counted_root, hits=1, memory_hits=1, compile_seconds_saved=saved)
        return hit

    def _build_uncached(self, key: CacheKey, build: Callable[[], Artifact], opts: Options) -> tuple[Artifact, str]:
        remote = self.remote_for(opts)
        found, damaged = self._fetch_remote(remote, key, opts, None)
        if found is not None:
            return found, "hit"
        log.info("neuron cache: miss %s; compiling (not stored on disk)", key.digest[:12])
        artifact = build()
        self.memory.put(key.digest, artifact)
        self.counters.count(None, misses=1, compile_seconds_spent=artifact.lower_seconds + artifact.compile_seconds)
        parts = None
        with contextlib.suppress(E.NotSerializable):
            parts = E.encode(artifact, key.digest, key.summary)
            self._record_megacache(key.digest, parts)
        self._publish(remote, key, parts, damaged, None)
        return artifact, "miss"

    # ------------------------------------------------------------ remote tier
    def _fetch_remote(
        self, remote: RemoteStore | None, key: CacheKey, opts: Options, store: DiskStore | None
    ) -> tuple[Artifact | None, bool]:
        """(the remote entry, loaded and copied into ``store``, or None; whether a damaged entry is there
        to be replaced). Remote failures are counted and warned once, never raised."""
        if remote is None or remote.down is not None:
            return None, False
        root = store.root if store is not None else None
        t0 = time.perf_counter()
        try:
            found = remote.fetch(key.digest)
        except RemoteUnavailable:
            self.counters.count(root, remote_errors=1)
            return None, False
        except RemoteRejected as e:
            self._report_remote_rejected(remote, key, str(e), e.damaged, root)
            return None, e.damaged
        if found is None:
            self.counters.count(root, remote_misses=1)
            return None, False
        parts, artifact = found
        try:
            _load(artifact, opts)
        except NeuronMemoryMapError:
            raise  # the process's state, not the entry's
        except Exception as e:
            self._report_remote_rejected(
                remote, key, f"executable could not be loaded ({type(e).__name__}: {e})", True, root
            )
            return None, True
        if store is not None:
            try:
                store.write(key.digest, *parts)
            except StoreUnavailable as e:
                self._warn_unwritable(store, e)
        saved = artifact.lower_seconds + artifact.compile_seconds
        self.counters.count(root, hits=1, remote_hits=1, compile_seconds_saved=saved)
        self.memory.put(key.digest, artifact)
        self._record_megacache(key.digest, parts)
        log.info("neuron cache: hit (remote) %s %s in %.4fs", key.digest[:12], artifact.name, time.perf_counter() - t0)
        return artifact, False

    def _report_remote_rejected(
        self, remote: RemoteStore, key: CacheKey, why: str, damaged: bool, root: str | None
    ) -> None:
        if damaged:
            what, then = "is damaged", "recompiling it (the new entry replaces it)."
        else:
            what, then = "is not trusted", "compiling instead. Every host that publishes must sign with the same key."
        warn(f"neuron cache: remote entry {key.digest[:12]} at {remote.url} {what} ({why}); {then}", stacklevel=6)
        self.counters.count(root, remote_rejected=1)

    def _publish(
        self,
        remote: RemoteStore | None,
        key: CacheKey,
        parts: tuple[bytes, bytes, bytes] | None,
        replace: bool,
        root: str | None,
    ) -> None:
        if remote is None or parts is None:
            return
        outcome = remote.publish(key.digest, parts, replace=replace)
        if outcome == "published":
            self.counters.count(root, remote_stores=1)
        elif outcome == "error":
            self.counters.count(root, remote_errors=1)

    def _read(self, store: DiskStore, key: CacheKey, opts: Options) -> Artifact | None:
        """A verified, loaded entry from disk; None when absent or damaged (damaged: warned, removed)."""
        if not opts.trust_cache_dir:
            reason = store.entry_untrusted_reason(key.digest)
            if reason is not None:
                self.warn_once(
                    key.digest, "untrusted-entry", f"neuron cache: not loading entry {key.digest[:12]}: {reason}."
                )
                return None
        try:
            found = store.read(key.digest)
            if found is None:
                return None
            _payload, artifact, parts = found
            _load(artifact, opts)
        except E.CorruptEntry as e:
            self._report_corrupt(store, key, str(e))
            return None
        except NeuronMemoryMapError:
            raise  # the process's state, not the entry's
        except Exception as e:
            self._report_corrupt(store, key, f"executable could not be loaded ({type(e).__name__}: {e})")
            return None
        saved = artifact.lower_seconds + artifact.compile_seconds
        self.counters.count(store.root, hits=1, disk_hits=1, compile_seconds_saved=saved)
        self.counters.flush(store.root, min_interval=FLUSH_INTERVAL)
        self.memory.put(key.digest, artifact)
        self._record_megacache(key.digest, parts)
        return artifact

    def _report_corrupt(self, store: DiskStore, key: CacheKey, why: str) -> None:
        warn(f"neuron cache: entry {key.digest[:12]} in {store.root} is damaged ({why}); recompiling it.", stacklevel=5)
        self.counters.count(store.root, corrupt=1)
        store.remove(key.digest)  # so the re-check under the lock is a plain miss, not a second warning

    def _warn_unwritable(self, store: DiskStore, e: Exception) -> None:
        self.warn_once(
            store.root, "unwritable",
            f"neuron cache: cannot write to {store.root} ({e}); compiling without storing results.",
        )  # fmt: skip

    def _store(
        self, store: DiskStore, key: CacheKey, artifact: Artifact, opts: Options
    ) -> tuple[bytes, bytes, bytes] | None:
        """Write the entry to disk; returns its parts (None: not serializable) for the remote tier."""
        try:
            parts = E.encode(artifact, key.digest, key.summary)
        except E.NotSerializable as e:
            log.debug("neuron cache: not storing %s: %s", key.digest[:12], e)
            return None
        self._record_megacache(key.digest, parts)
        try:
            store.write(key.digest, *parts)
        except StoreUnavailable as e:
            self._warn_unwritable(store, e)
            return parts
        self.counters.count(store.root, stores=1)
        max_bytes = opts.cache_max_bytes if opts.cache_max_bytes is not None else DEFAULT_MAX_BYTES
        evicted = store.evict(max_bytes, protect=key.digest)
        if evicted:
            self.counters.count(store.root, evictions=len(evicted))
            log.info("neuron cache: evicted %d entries to stay under %d bytes", len(evicted), max_bytes)
        return parts

    def _record_megacache(self, digest: str, parts: tuple[bytes, bytes, bytes]) -> None:
        megacache.record(digest, *parts)
        self.recorded.add(digest)

    # ------------------------------------------------------------------ stats
    def persistent_stats(self, cache_dir: str | None = None) -> dict[str, float]:
        """Counters of every process that used ``cache_dir`` (this one's flushed first)."""
        store = DiskStore(resolve_cache_dir(cache_dir))
        self.counters.flush(store.root)
        return store.read_stats()


#: Entries ``explain_miss`` reads at most (the most recently used): a miss must not read a whole big cache.
EXPLAIN_SCAN_LIMIT = 2000


def nearest_entries(
    store: DiskStore, summary: dict[str, Any], limit: int = 3, exclude: str | None = None
) -> tuple[list[tuple[str, dict[str, Any], list[tuple[str, Any, Any]]]], int]:
    """The entries of ``store`` whose key summaries are nearest ``summary``: those of the same graph first,
    then by the number of differing key parts. Returns ([(key, entry payload, differences)], entries read)."""
    infos = sorted(store.entries(), key=lambda e: e.last_used, reverse=True)[:EXPLAIN_SCAN_LIMIT]
    ranked = []
    for info in infos:
        if info.key == exclude:
            continue
        try:
            payload = store.meta(info.key)
        except (OSError, E.CorruptEntry):
            continue
        found = payload.get("key_summary") or {}
        diffs = key_differences(summary, found)
        same_graph = summary.get("graph") is not None and found.get("graph") == summary.get("graph")
        ranked.append((not same_graph, len({part_name(p) for p, _, _ in diffs}), len(diffs), info.key, payload, diffs))
    ranked.sort(key=lambda r: r[:4])
    return [(k, payload, diffs) for *_, k, payload, diffs in ranked[:limit]], len(infos)


def _short(value: Any, width: int = 60) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def describe_differences(diffs: list[tuple[str, Any, Any]], max_shown: int = 4) -> str:
    """``versions: versions.neuronx-cc 'X' here, 'Y' there; options: options.opt_level 3 here, 2 there``."""
    parts: dict[str, list[str]] = {}
    for path, here, there in diffs:
        parts.setdefault(part_name(path), []).append(f"{path} {_short(here)} here, {_short(there)} there")
    shown = []
    for name, items in parts.items():
        more = f" (+{len(items) - max_shown} more)" if len(items) > max_shown else ""
        shown.append(f"{name}: " + ", ".join(items[:max_shown]) + more)
    return "; ".join(shown)


def explain_miss(store: DiskStore, summary: dict[str, Any], limit: int = 3, exclude: str | None = None) -> list[str]:
    """Why a key with this summary is not in ``store``: one line per nearest entry naming the key parts
    that differ (graph, input shapes/dtypes, target, generation, flags, versions, options)."""
    nearest, seen = nearest_entries(store, summary, limit, exclude)
    if not nearest:
        return [f"the cache {store.root} holds no other entry"]
    lines = []
    if summary.get("graph") is not None and nearest[0][1].get("key_summary", {}).get("graph") != summary["graph"]:
        lines.append(f"no entry of the {seen} in {store.root} holds this graph; nearest")
    for key, payload, diffs in nearest:
        what = describe_differences(diffs) or "nothing (same key parts: a key of another format)"
        lines.append(f"entry {key[:12]} {payload.get('name', '?')} differs in {what}")
    return lines


#: THE cache of this process.
CACHE = CompileCache()
# PyTorch's mega-cache loads our artifacts into the store the default options resolve to.
megacache.store_for_loading = lambda: CACHE.store_for(Options.from_user(None))
