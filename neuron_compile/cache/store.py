"""The on-disk store: one directory per key, written atomically, read with integrity checks.

Layout under the cache root (created 0700)::

    entries/<k[:2]>/<key>/{meta.json, module.mlir, executable.bin}
    locks/<key>.lock     one lock per key: N processes missing on a key compile it once
    tmp/                 entries being written (renamed into entries/ when complete)
    trash/               entries being deleted (renamed out of entries/ first, so readers never see half)
    stats.json           hit/miss counters across processes

Entries are immutable once renamed into place; replacing (a corrupt one) or evicting first renames the
old directory away, so a concurrent reader either reads a whole entry or finds none (a plain miss).

Containment: every key is checked (``paths.check_key``) before a path is built from it, no symlink below
the root is followed (internal directories, shards, entries, entry files), and entry files are opened as
regular files only (``O_NOFOLLOW | O_NONBLOCK``, then ``fstat``), so a planted FIFO cannot hang a read.
A process killed mid-write or mid-delete leaves a directory in ``tmp/`` or ``trash/``: those leftovers are
counted against the size cap and swept once stale (``sweep``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

import filelock

from ..artifact import Artifact
from . import entry as E
from . import trust
from .paths import check_key, is_key, is_within, resolve_cache_dir

#: Default size cap of a cache directory (NEURON_COMPILE_CACHE_MAX_BYTES / option cache_max_bytes).
DEFAULT_MAX_BYTES = 10 * 1024**3
#: Eviction goes down to this fraction of the cap, so not every store after the cap evicts again.
LOW_WATER = 0.9
#: A leftover in tmp/ or trash/ older than this (and not locked) belongs to a dead process. Writing one
#: entry takes well under a second; this leaves room for slow disks.
STALE_SECONDS = 600.0
SUBDIRS = ("entries", "locks", "tmp", "trash")
_SHARD = re.compile(r"[0-9a-f]{2}")
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def default_cache_dir() -> str:
    """The directory used when no option names one (NEURON_COMPILE_CACHE_DIR, else the user cache dir)."""
    return resolve_cache_dir(None)


class StoreUnavailable(Exception):
    """The directory cannot be created or written (read-only, full, not a directory, symlinked...)."""


class UnsafePath(Exception):
    """A path below the cache root is a symlink or resolves outside the root."""


@dataclass
class EntryInfo:
    key: str
    path: str
    size: int
    last_used: float


@dataclass
class Leftover:
    """A directory or file in tmp/ or trash/: an interrupted write or delete, or one in progress."""

    kind: str  # "tmp" | "trash"
    path: str
    size: int
    mtime: float


def read_regular_file(path: str, follow_symlinks: bool = False) -> bytes:
    """The bytes of ``path`` if it is a regular file (not a symlink unless ``follow_symlinks``, nor a FIFO,
    device...), opened without blocking; raises ``CorruptEntry`` for anything else and ``OSError`` (e.g.
    ``FileNotFoundError``) when unreadable."""
    name = os.path.basename(path)
    try:
        fd = os.open(path, _OPEN_FLAGS & ~os.O_NOFOLLOW if follow_symlinks else _OPEN_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise E.CorruptEntry(f"{name} is a symbolic link") from None
        raise
    mode = os.fstat(fd).st_mode  # before fdopen, which refuses a directory with an OSError of its own
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise E.CorruptEntry(f"{name} is not a regular file (mode {mode:o})")
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _tree_size(path: str) -> int:
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size
    total = 0
    for dirpath, _dirs, files in os.walk(path):  # never follows symlinks
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _remove_tree(path: str) -> None:
    """Delete ``path`` without following symlinks (a symlink is unlinked, its target left alone)."""
    with contextlib.suppress(FileNotFoundError):
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
        else:
            shutil.rmtree(path, ignore_errors=True)  # fd-based on Linux: never follows links inside


class DiskStore:
    """One cache directory. Reads need only read access; anything else raises ``StoreUnavailable``."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))

    # ----------------------------------------------------------------- paths
    def entry_dir(self, key: str) -> str:
        """Where ``key``'s entry lives (raises ``InvalidKey`` for anything but a cache key)."""
        check_key(key)
        return os.path.join(self.root, "entries", key[:2], key)

    def _sub(self, name: str) -> str:
        return os.path.join(self.root, name)

    def check_contained(self, path: str) -> None:
        """Raise ``UnsafePath`` unless ``path`` is below the root with no symlink between them."""
        rel = os.path.relpath(path, self.root)
        if rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
            raise UnsafePath(f"{path} is outside the cache directory {self.root}")
        current = self.root
        for part in rel.split(os.sep):
            if part in ("", os.curdir):
                continue
            current = os.path.join(current, part)
            try:
                st = os.lstat(current)
            except OSError:
                break  # absent (or not a directory): nothing below it can be reached either
            if stat.S_ISLNK(st.st_mode):
                raise UnsafePath(f"{current} is a symbolic link (not followed inside the cache)")
        if not is_within(path, self.root):  # belt and braces (e.g. a symlink swapped in meanwhile)
            raise UnsafePath(f"{path} resolves outside the cache directory {self.root}")

    # -------------------------------------------------------------- security
    def untrusted_reason(self) -> str | None:
        """Why executables from this directory must not be loaded (None: it is safe)."""
        reason = trust.dir_untrusted_reason(self.root)
        if reason is not None:
            return reason
        for sub in SUBDIRS:  # our own subdirectories: never a symlink to somewhere else
            path = self._sub(sub)
            with contextlib.suppress(OSError):
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    return f"{path} is not a directory (a symlink?)"
        return None

    def entry_untrusted_reason(self, key: str) -> str | None:
        d = self.entry_dir(key)
        files = [os.path.join(d, f) for f in (E.META_FILE, E.MODULE_FILE, E.EXECUTABLE_FILE)]
        return trust.paths_untrusted_reason([os.path.dirname(d), d, *files])

    # ----------------------------------------------------------------- write
    def ensure(self) -> None:
        """Create the directory tree (0700). Raises ``StoreUnavailable``."""
        try:
            if not os.path.isdir(self.root):
                os.makedirs(self.root, mode=0o700, exist_ok=True)
                os.chmod(self.root, 0o700)  # makedirs' mode is filtered by the umask
            for sub in SUBDIRS:
                path = self._sub(sub)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path, 0o700)
                if not stat.S_ISDIR(os.lstat(path).st_mode):  # lstat: a symlink is not our directory
                    raise StoreUnavailable(f"{path} is not a directory (a symlink?); not using {self.root}")
            if not os.access(self._sub("tmp"), os.W_OK):
                raise PermissionError(errno.EACCES, "not writable", self.root)
        except OSError as e:
            raise StoreUnavailable(f"{self.root}: {e.strerror or e}") from None

    def lock(self, key: str) -> filelock.BaseFileLock:
        return self._lock_file(check_key(key))

    def _lock_file(self, name: str) -> filelock.BaseFileLock:
        self.ensure()
        path = os.path.join(self._sub("locks"), name + ".lock")
        if os.path.islink(path):
            os.unlink(path)  # a planted link must not make the lock open (and create) its target
        return filelock.FileLock(path, mode=0o600)

    def write(self, key: str, meta: bytes, module: bytes, executable: bytes) -> None:
        """Write an entry atomically (temp dir + rename), replacing any existing one."""
        check_key(key)
        self.ensure()
        tmp = os.path.join(self._sub("tmp"), f"{key}.{uuid.uuid4().hex}")
        try:
            os.mkdir(tmp, 0o700)
            for name, data in ((E.MODULE_FILE, module), (E.EXECUTABLE_FILE, executable), (E.META_FILE, meta)):
                fd = os.open(os.path.join(tmp, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            final = self.entry_dir(key)
            shard = os.path.dirname(final)
            if os.path.islink(shard):
                os.unlink(shard)  # the link only: its target is not ours
            with contextlib.suppress(FileExistsError):
                os.mkdir(shard, 0o700)
            if os.path.lexists(final):
                self._discard(final)
            self.check_contained(shard)
            os.rename(tmp, final)
        except (OSError, UnsafePath) as e:
            _remove_tree(tmp)
            raise StoreUnavailable(f"{self.root}: {getattr(e, 'strerror', None) or e}") from None

    def _discard(self, path: str) -> None:
        """Remove an entry directory: rename it out of entries/ first, so no reader sees a half entry."""
        self.check_contained(os.path.dirname(path))
        if os.path.islink(path):
            os.unlink(path)
            return
        trash = self._sub("trash")
        self.check_contained(trash)
        gone = os.path.join(trash, f"{os.path.basename(path)}.{uuid.uuid4().hex}")
        try:
            os.rename(path, gone)
        except FileNotFoundError:
            return
        with contextlib.suppress(OSError):
            os.utime(gone)  # its age in trash/ is counted from now (``sweep``)
        _remove_tree(gone)

    def remove(self, key: str) -> None:
        d = self.entry_dir(key)
        shard = os.path.dirname(d)
        with contextlib.suppress(OSError, UnsafePath):
            self.check_contained(os.path.dirname(shard))
            if os.path.islink(shard):
                os.unlink(shard)
                return
            self._discard(d)

    # ------------------------------------------------------------------ read
    def _entry_files(self, key: str, names: tuple[str, ...]) -> list[bytes]:
        d = self.entry_dir(key)
        try:
            self.check_contained(d)
        except UnsafePath as e:
            raise E.CorruptEntry(str(e)) from None
        return [read_regular_file(os.path.join(d, name)) for name in names]

    def read(self, key: str) -> tuple[dict[str, Any], Artifact, tuple[bytes, bytes, bytes]] | None:
        """The verified entry (payload, artifact, raw parts), None when absent; raises ``CorruptEntry``
        when present but damaged."""
        d = self.entry_dir(key)
        try:
            (meta,) = self._entry_files(key, (E.META_FILE,))
        except OSError:
            return None  # absent, or unreadable: a miss either way
        try:
            payload = E.verify_meta(meta, key)
            module, executable = self._entry_files(key, (E.MODULE_FILE, E.EXECUTABLE_FILE))
            artifact = E.decode(payload, module, executable)
        except FileNotFoundError:
            if not os.path.isdir(d):
                return None  # evicted or replaced while we read: a plain miss
            raise E.CorruptEntry("a file of the entry is missing") from None
        except OSError as e:
            raise E.CorruptEntry(f"unreadable ({e.strerror or e})") from None
        except E.CorruptEntry:
            if not os.path.lexists(d):
                return None
            raise
        with contextlib.suppress(OSError):
            os.utime(d, follow_symlinks=False)  # LRU clock; atime is unreliable (noatime/relatime mounts)
        return payload, artifact, (meta, module, executable)

    def read_raw(self, key: str) -> tuple[bytes, bytes, bytes]:
        meta, module, executable = self._entry_files(key, (E.META_FILE, E.MODULE_FILE, E.EXECUTABLE_FILE))
        return meta, module, executable

    def meta(self, key: str) -> dict[str, Any]:
        (meta,) = self._entry_files(key, (E.META_FILE,))
        return E.verify_meta(meta, key)

    # ------------------------------------------------------------- listing
    def entries(self) -> Iterator[EntryInfo]:
        """Every entry directory; names that are not keys, and symlinks, are skipped (never followed)."""
        base = self._sub("entries")
        if os.path.islink(base):
            return
        try:
            shards = sorted(os.scandir(base), key=lambda e: e.name)
        except OSError:
            return
        for shard in shards:
            if not _SHARD.fullmatch(shard.name) or not shard.is_dir(follow_symlinks=False):
                continue
            try:
                items = list(os.scandir(shard.path))
            except OSError:
                continue
            for item in items:
                if not is_key(item.name) or item.name[:2] != shard.name or not item.is_dir(follow_symlinks=False):
                    continue
                try:
                    size = sum(
                        f.stat(follow_symlinks=False).st_size
                        for f in os.scandir(item.path)
                        if f.is_file(follow_symlinks=False)
                    )
                    yield EntryInfo(item.name, item.path, size, item.stat(follow_symlinks=False).st_mtime)
                except OSError:
                    continue  # removed while listing

    def leftovers(self) -> list[Leftover]:
        """What interrupted (or running) writes and deletes left in tmp/ and trash/."""
        found = []
        for kind in ("tmp", "trash"):
            base = self._sub(kind)
            if os.path.islink(base):
                continue
            try:
                items = list(os.scandir(base))
            except OSError:
                continue
            for item in items:
                with contextlib.suppress(OSError):
                    found.append(
                        Leftover(kind, item.path, _tree_size(item.path), item.stat(follow_symlinks=False).st_mtime)
                    )
        return found

    def sweep(self, max_age: float = STALE_SECONDS) -> list[Leftover]:
        """Delete leftovers older than ``max_age`` seconds whose writer is gone (its lock is free).

        Safe while other processes work: a write in progress holds its key's lock (stats: the stats lock);
        trash/ holds only what was already renamed out of entries/, so deleting it twice is harmless.
        """
        now = time.time()
        swept = []
        for lo in self.leftovers():
            if now - lo.mtime < max_age:
                continue
            owner = os.path.basename(lo.path).split(".", 1)[0]
            guard = None
            if lo.kind == "tmp" and (is_key(owner) or owner == "stats"):
                try:
                    guard = self._lock_file(owner)
                    guard.acquire(timeout=0)
                except (filelock.Timeout, OSError, StoreUnavailable):
                    continue  # being written right now
            try:
                _remove_tree(lo.path)
                swept.append(lo)
            finally:
                if guard is not None:
                    guard.release()
        return swept

    def total_bytes(self) -> int:
        """Entries plus leftovers: what the directory costs on disk, and what the size cap bounds."""
        return sum(e.size for e in self.entries()) + sum(lo.size for lo in self.leftovers())

    def find(self, prefix: str) -> list[str]:
        return [e.key for e in self.entries() if e.key.startswith(prefix)]

    # ------------------------------------------------------------ eviction
    def evict(self, max_bytes: int, protect: str | None = None, low_water: float = LOW_WATER) -> list[str]:
        """Drop least-recently-used entries until the directory (leftovers included) is under ``max_bytes``.

        Safe while other processes read (entries are renamed away before deletion). Only one process
        evicts at a time; the others skip.
        """
        try:
            guard = self._lock_file("evict")
            guard.acquire(timeout=0)
        except (filelock.Timeout, OSError, StoreUnavailable):
            return []
        try:
            infos = list(self.entries())
            total = sum(e.size for e in infos) + sum(lo.size for lo in self.leftovers())
            if total <= max_bytes:
                return []
            total -= sum(lo.size for lo in self.sweep())
            goal = int(max_bytes * low_water)
            evicted = []
            for info in sorted(infos, key=lambda e: e.last_used):
                if total <= goal:
                    break
                if info.key == protect:
                    continue
                with contextlib.suppress(OSError, UnsafePath):
                    self._discard(info.path)
                total -= info.size
                evicted.append(info.key)
            return evicted
        finally:
            guard.release()

    def clear(self) -> int:
        """Remove every entry, and every leftover no live process is writing. Returns the entry count."""
        keys = [e.key for e in self.entries()]
        for k in keys:
            self.remove(k)
        self.sweep(max_age=0.0)
        return len(keys)

    # --------------------------------------------------------------- stats
    def stats_path(self) -> str:
        return self._sub("stats.json")

    def read_stats(self) -> dict[str, float]:
        try:
            data = json.loads(read_regular_file(self.stats_path()))
            return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))}
        except (OSError, ValueError, AttributeError, E.CorruptEntry):
            return {}

    def add_stats(self, delta: dict[str, float]) -> None:
        """Add counters into stats.json under a lock (read-modify-write, atomic rename)."""
        if not any(delta.values()):
            return
        try:
            with self._lock_file("stats"):
                data = self.read_stats()
                for k, v in delta.items():
                    data[k] = data.get(k, 0) + v
                data["updated"] = time.time()
                tmp = os.path.join(self._sub("tmp"), f"stats.{uuid.uuid4().hex}")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                os.replace(tmp, self.stats_path())  # replaces a planted symlink itself, never its target
        except OSError as e:
            raise StoreUnavailable(f"{self.root}: {e.strerror or e}") from None

    def reset_stats(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.stats_path())
