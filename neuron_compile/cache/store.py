"""The on-disk store: one directory per key, written atomically, read with integrity checks.

Layout under the cache root (created 0700)::

    entries/<k[:2]>/<key>/{meta.json, module.mlir, executable.bin}
    locks/<key>.lock     one lock per key: N processes missing on a key compile it once
    tmp/                 entries being written (renamed into entries/ when complete)
    trash/               entries being deleted (renamed out of entries/ first, so readers never see half)
    stats.json           hit/miss counters across processes

Entries are immutable once renamed into place; replacing (a corrupt one) or evicting first renames the
old directory away, so a concurrent reader either reads a whole entry or finds none (a plain miss).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

import filelock

from ..artifact import Artifact
from . import entry as E

#: Default size cap of a cache directory (NEURON_COMPILE_CACHE_MAX_BYTES / option cache_max_bytes).
DEFAULT_MAX_BYTES = 10 * 1024**3
#: Eviction goes down to this fraction of the cap, so not every store after the cap evicts again.
LOW_WATER = 0.9


def default_cache_dir() -> str:
    import platformdirs

    return platformdirs.user_cache_dir("neuron_compile")


class StoreUnavailable(Exception):
    """The directory cannot be created or written (read-only, full, not a directory...)."""


@dataclass
class EntryInfo:
    key: str
    path: str
    size: int
    last_used: float


def _untrusted_reason(path: str, st: os.stat_result) -> str | None:
    if st.st_uid != os.getuid():
        return f"{path} is owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


class DiskStore:
    """One cache directory. Reads need only read access; anything else raises ``StoreUnavailable``."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))

    # ----------------------------------------------------------------- paths
    def entry_dir(self, key: str) -> str:
        return os.path.join(self.root, "entries", key[:2], key)

    def _sub(self, name: str) -> str:
        return os.path.join(self.root, name)

    # -------------------------------------------------------------- security
    def untrusted_reason(self) -> str | None:
        """Why executables from this directory must not be loaded (None: it is safe).

        A cached executable is native code: a directory another user owns or can write could hand us
        theirs. An ancestor that others can write without the sticky bit could swap our directory.
        """
        try:
            st = os.stat(self.root)
        except OSError:
            st = None
        if st is not None:
            reason = _untrusted_reason(self.root, st)
            if reason:
                return reason
        parent = os.path.dirname(self.root)
        while True:
            try:
                pst = os.stat(parent)
                if pst.st_mode & stat.S_IWOTH and not pst.st_mode & stat.S_ISVTX:
                    return f"its parent {parent} is writable by everyone without the sticky bit"
            except OSError:
                pass
            up = os.path.dirname(parent)
            if up == parent:
                return None
            parent = up

    def entry_untrusted_reason(self, key: str) -> str | None:
        d = self.entry_dir(key)
        for path in (os.path.dirname(d), d, *(os.path.join(d, f) for f in (E.META_FILE, E.MODULE_FILE, E.EXECUTABLE_FILE))):
            try:
                reason = _untrusted_reason(path, os.stat(path))
            except OSError:
                continue
            if reason:
                return reason
        return None

    # ----------------------------------------------------------------- write
    def ensure(self) -> None:
        """Create the directory tree (0700). Raises ``StoreUnavailable``."""
        try:
            if not os.path.isdir(self.root):
                os.makedirs(self.root, mode=0o700, exist_ok=True)
                os.chmod(self.root, 0o700)  # makedirs' mode is filtered by the umask
            for sub in ("entries", "locks", "tmp", "trash"):
                os.makedirs(self._sub(sub), mode=0o700, exist_ok=True)
            if not os.access(self._sub("tmp"), os.W_OK):
                raise PermissionError(errno.EACCES, "not writable", self.root)
        except OSError as e:
            raise StoreUnavailable(f"{self.root}: {e.strerror or e}") from None

    def lock(self, key: str) -> filelock.BaseFileLock:
        self.ensure()
        return filelock.FileLock(os.path.join(self._sub("locks"), key + ".lock"), mode=0o600)

    def write(self, key: str, meta: bytes, module: bytes, executable: bytes) -> None:
        """Write an entry atomically (temp dir + rename), replacing any existing one."""
        self.ensure()
        tmp = os.path.join(self._sub("tmp"), f"{key}.{uuid.uuid4().hex}")
        try:
            os.mkdir(tmp, 0o700)
            for name, data in ((E.MODULE_FILE, module), (E.EXECUTABLE_FILE, executable), (E.META_FILE, meta)):
                fd = os.open(os.path.join(tmp, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            final = self.entry_dir(key)
            os.makedirs(os.path.dirname(final), mode=0o700, exist_ok=True)
            if os.path.exists(final):
                self._discard(final)
            os.rename(tmp, final)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise StoreUnavailable(f"{self.root}: {e.strerror or e}") from None

    def _discard(self, path: str) -> None:
        """Remove an entry directory: rename it out of entries/ first, so no reader sees a half entry."""
        gone = os.path.join(self._sub("trash"), f"{os.path.basename(path)}.{uuid.uuid4().hex}")
        try:
            os.rename(path, gone)
        except FileNotFoundError:
            return
        shutil.rmtree(gone, ignore_errors=True)

    def remove(self, key: str) -> None:
        with contextlib.suppress(OSError):
            self._discard(self.entry_dir(key))

    # ------------------------------------------------------------------ read
    def read(self, key: str) -> tuple[dict[str, Any], Artifact, tuple[bytes, bytes, bytes]] | None:
        """The verified entry (payload, artifact, raw parts), None when absent; raises ``CorruptEntry``
        when present but damaged."""
        d = self.entry_dir(key)
        try:
            with open(os.path.join(d, E.META_FILE), "rb") as f:
                meta = f.read()
        except OSError:
            return None  # absent, or unreadable: a miss either way
        try:
            payload = E.verify_meta(meta, key)
            with open(os.path.join(d, E.MODULE_FILE), "rb") as f:
                module = f.read()
            with open(os.path.join(d, E.EXECUTABLE_FILE), "rb") as f:
                executable = f.read()
        except FileNotFoundError:
            if not os.path.isdir(d):
                return None  # evicted or replaced while we read: a plain miss
            raise E.CorruptEntry("a file of the entry is missing") from None
        except E.CorruptEntry:
            if not os.path.isdir(d):
                return None
            raise
        try:
            artifact = E.decode(payload, module, executable)
        except E.CorruptEntry:
            if not os.path.isdir(d):
                return None
            raise
        with contextlib.suppress(OSError):
            os.utime(d)  # LRU clock; atime is unreliable (noatime/relatime mounts)
        return payload, artifact, (meta, module, executable)

    def read_raw(self, key: str) -> tuple[bytes, bytes, bytes]:
        d = self.entry_dir(key)
        parts = []
        for name in (E.META_FILE, E.MODULE_FILE, E.EXECUTABLE_FILE):
            with open(os.path.join(d, name), "rb") as f:
                parts.append(f.read())
        return parts[0], parts[1], parts[2]

    def meta(self, key: str) -> dict[str, Any]:
        with open(os.path.join(self.entry_dir(key), E.META_FILE), "rb") as f:
            return E.verify_meta(f.read(), key)

    # ------------------------------------------------------------- listing
    def entries(self) -> Iterator[EntryInfo]:
        base = self._sub("entries")
        try:
            shards = sorted(os.scandir(base), key=lambda e: e.name)
        except OSError:
            return
        for shard in shards:
            if not shard.is_dir():
                continue
            try:
                items = list(os.scandir(shard.path))
            except OSError:
                continue
            for item in items:
                try:
                    size = sum(f.stat().st_size for f in os.scandir(item.path) if f.is_file())
                    yield EntryInfo(item.name, item.path, size, item.stat().st_mtime)
                except OSError:
                    continue  # removed while listing

    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries())

    def find(self, prefix: str) -> list[str]:
        return [e.key for e in self.entries() if e.key.startswith(prefix)]

    # ------------------------------------------------------------ eviction
    def evict(self, max_bytes: int, protect: str | None = None, low_water: float = LOW_WATER) -> list[str]:
        """Drop least-recently-used entries until the directory is under ``max_bytes``.

        Safe while other processes read (entries are renamed away before deletion). Only one process
        evicts at a time; the others skip.
        """
        try:
            guard = filelock.FileLock(os.path.join(self._sub("locks"), "evict.lock"), mode=0o600)
            guard.acquire(timeout=0)
        except (filelock.Timeout, OSError):
            return []
        try:
            infos = list(self.entries())
            total = sum(e.size for e in infos)
            if total <= max_bytes:
                return []
            goal = int(max_bytes * low_water)
            evicted = []
            for info in sorted(infos, key=lambda e: e.last_used):
                if total <= goal:
                    break
                if info.key == protect:
                    continue
                self._discard(info.path)
                total -= info.size
                evicted.append(info.key)
            return evicted
        finally:
            guard.release()

    def clear(self) -> int:
        keys = [e.key for e in self.entries()]
        for k in keys:
            self.remove(k)
        return len(keys)

    # --------------------------------------------------------------- stats
    def stats_path(self) -> str:
        return self._sub("stats.json")

    def read_stats(self) -> dict[str, float]:
        try:
            with open(self.stats_path()) as f:
                data = json.load(f)
            return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))}
        except (OSError, ValueError):
            return {}

    def add_stats(self, delta: dict[str, float]) -> None:
        """Add counters into stats.json under a lock (read-modify-write, atomic rename)."""
        if not any(delta.values()):
            return
        self.ensure()
        try:
            with filelock.FileLock(os.path.join(self._sub("locks"), "stats.lock"), mode=0o600):
                data = self.read_stats()
                for k, v in delta.items():
                    data[k] = data.get(k, 0) + v
                data["updated"] = time.time()
                tmp = os.path.join(self._sub("tmp"), f"stats.{uuid.uuid4().hex}")
                with open(tmp, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                os.replace(tmp, self.stats_path())
        except OSError as e:
            raise StoreUnavailable(f"{self.root}: {e.strerror or e}") from None

    def reset_stats(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.stats_path())
