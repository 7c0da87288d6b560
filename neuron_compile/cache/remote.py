"""The remote tier: a cache shared by many hosts at a URL (``s3://bucket/prefix`` or any fsspec URL),
behind the local disk cache.

A local miss asks the remote; a verified remote entry is copied into the local cache and loaded. A full
miss compiles, stores locally, then publishes here. The URL is not part of the cache key: an entry is the
same bytes wherever it is stored.

Layout under the URL (one "directory" per cache key)::

    <key>/<32 hex>.entry     the entry, packed as for PyTorch's mega-cache (``entry.pack``), written first
    <key>/manifest.json      small, written last, names the payload and its size and sha256 (and an HMAC)

**Many writers.** An entry is visible only once its manifest exists, and the manifest is written after
its payload is complete, with a create-only write (S3 ``If-None-Match: *``; other filesystems: fsspec's
exists-then-write). Racing writers each upload their own payload; the one whose manifest lands wins, the
others delete their payload. A reader that finds the payload gone (pruned meanwhile) has a plain miss.

**Untrusted input.** Everything read from the URL is untrusted: the key is ours (``paths.check_key``
before any use, and the manifest must name it), the payload name must match ``_PAYLOAD`` (no path can be
smuggled in), sizes are bounded, and the payload goes through the local store's own checks
(``entry.verify_meta``/``entry.decode``: metadata checksum, every file's size and sha256) before a byte of
it reaches the local cache. A damaged entry is a warned miss and is replaced by the next publish. With a
signing key (``NEURON_COMPILE_CACHE_HMAC_KEY``, shared by writers and readers), the manifest carries an
HMAC-SHA256 over its fields (which include the payload's sha256): an unsigned or wrongly signed entry is
ignored with a warning, and not overwritten (a host with a wrong key must not evict the fleet's entries).

**Failures never fail the job.** Every remote call runs with a deadline (``NEURON_COMPILE_CACHE_URL_TIMEOUT``
seconds, default 10, plus transfer time at 4 MiB/s) and one retry; after that the URL is unused for the rest
of the process, with one warning. Access denied on publishing only stops publishing (read-only
credentials are a normal setup for consumers).

fsspec (and s3fs for S3) is imported only when a URL is used: ``import neuron_compile`` stays light.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from ..artifact import Artifact
from ..errors import NeuronOptionsError
from . import entry as E
from .paths import check_key, is_key
from .report import log, warn
from .store import STALE_SECONDS

ENV_HMAC_KEY = "NEURON_COMPILE_CACHE_HMAC_KEY"
ENV_TIMEOUT = "NEURON_COMPILE_CACHE_URL_TIMEOUT"
DEFAULT_TIMEOUT = 10.0
#: One retry: a dead endpoint costs at most two deadlines before the URL is dropped for the process.
ATTEMPTS = 2
#: Deadlines grow with the bytes moved at this rate, so a large NEFF on a slow link is not cut off.
MIN_RATE = 4 * 1024**2
#: A manifest claiming more is refused: its size sets the download's deadline, and it is untrusted.
MAX_ENTRY_BYTES = 16 * 1024**3
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
#: A manifest is a few hundred bytes; anything bigger is not one of ours (and is not read whole).
MAX_MANIFEST_BYTES = 64 * 1024
_PAYLOAD = re.compile(r"[0-9a-f]{32}\.entry")
_SIGNATURE_PREFIX = "hmac-sha256:"

T = TypeVar("T")


class RemoteUnavailable(Exception):
    """The remote could not be reached, refused us, or did not answer in time."""


class RemoteRejected(Exception):
    """An entry is present but must not be loaded: damaged (``damaged``) or not signed with our key."""

    def __init__(self, message: str, damaged: bool) -> None:
        super().__init__(message)
        self.damaged = damaged


@dataclass
class RemoteEntry:
    key: str
    size: int  # all objects under the key (payloads included)
    modified: float  # the manifest's time on the server (seconds since the epoch)
    name: str  # the graph's name, from the manifest ("?" if unreadable)


def timeout_from_env() -> float:
    """NEURON_COMPILE_CACHE_URL_TIMEOUT, parsed as the option ``cache_url_timeout`` (options.py)."""
    from ..options import from_env

    return from_env("cache_url_timeout")


def hmac_key_from_env() -> bytes | None:
    """NEURON_COMPILE_CACHE_HMAC_KEY, parsed as the option ``cache_hmac_key`` (options.py)."""
    from ..options import from_env

    return from_env("cache_hmac_key")


def _sign(manifest: dict[str, Any], secret: bytes) -> str:
    body = json.dumps({k: v for k, v in manifest.items() if k != "signature"}, sort_keys=True).encode()
    return _SIGNATURE_PREFIX + hmac.new(secret, body, hashlib.sha256).hexdigest()


class RemoteStore:
    """One remote cache URL. Holds its own failure state: ``down`` (unused for the rest of the process)
    and ``publishing`` (False once writing was denied)."""

    def __init__(self, url: str, timeout: float | None = None, hmac_key: bytes | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout_from_env() if timeout is None else timeout
        self.hmac_key = hmac_key
        self.down: str | None = None
        self.publishing = True
        self._fs: Any = None
        self._root = ""
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- access
    def _filesystem(self) -> tuple[Any, str]:
        with self._lock:
            if self._fs is None:
                try:
                    import fsspec
                except ImportError:
                    raise RemoteUnavailable(
                        "fsspec is not installed: pip install fsspec "
                        "(and s3fs for s3://: pip install 'neuron_compile[remote]')"
                    ) from None
                protocol = fsspec.utils.get_protocol(self.url)
                options: dict[str, Any] = {"skip_instance_cache": True}
                if protocol in ("s3", "s3a"):
                    # botocore's own timeouts and a single attempt: retries are ours, under one deadline
                    options["config_kwargs"] = {
                        "connect_timeout": self.timeout,
                        "read_timeout": self.timeout,
                        "retries": {"max_attempts": 1},
                    }
                try:
                    fs, root = fsspec.core.url_to_fs(self.url, **options)
                except ImportError as e:
                    raise RemoteUnavailable(f"{e} (for S3: pip install 'neuron_compile[remote]')") from None
                except (ValueError, TypeError) as e:
                    raise RemoteUnavailable(f"not a usable fsspec URL ({e})") from None
                if hasattr(fs, "retries"):
                    fs.retries = 1  # s3fs's internal retry loop would multiply ours
                self._fs, self._root = fs, root.rstrip("/")
            return self._fs, self._root

    def _path(self, key: str, name: str = "") -> str:
        check_key(key)
        base = f"{self._root}/{key}" if self._root else key
        return f"{base}/{name}" if name else base

    def _call(self, what: str, fn: Callable[[], T], nbytes: int = 0) -> T:
        """``fn()`` with a deadline and one retry. Errors that retrying cannot fix (not found, exists,
        denied) pass through at once; time-outs and the rest become ``RemoteUnavailable``."""
        deadline = self.timeout + nbytes / MIN_RATE
        last: BaseException | None = None
        for attempt in range(ATTEMPTS):
            box: dict[str, Any] = {}  # this attempt's own: a late earlier attempt must not answer for it

            def run(box: dict[str, Any]) -> None:
                try:
                    box["value"] = fn()
                except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                    box["error"] = e

            # a daemon thread: a remote that never answers must not keep the process from exiting
            worker = threading.Thread(target=run, args=(box,), name="neuron-cache-remote", daemon=True)
            worker.start()
            worker.join(deadline)
            if worker.is_alive():
                last = TimeoutError(f"no answer within {deadline:.1f}s")
            elif "error" in box:
                err = box["error"]
                if isinstance(err, (FileNotFoundError, FileExistsError, PermissionError, RemoteRejected)):
                    raise err
                last = err
            else:
                return box["value"]
            if attempt + 1 < ATTEMPTS:
                time.sleep(0.2)
        raise RemoteUnavailable(f"{what}: {type(last).__name__}: {last}")

    def _mark_down(self, why: str, depth: int = 0) -> None:
        """Stop using the remote for this process, with one warning; ``depth``: frames between the caller
        the warning should point past and this call, beyond the usual."""
        if self.down is None:
            self.down = why
            warn(
                f"neuron cache: the remote cache {self.url} is not usable ({why}); compiling with the local "
                "cache only for the rest of this process. Check the URL, credentials and network, or unset "
                "NEURON_COMPILE_CACHE_URL / option cache_url.",
                stacklevel=6 + depth,
            )

    # ------------------------------------------------------------------ read
    def _read(self, key: str, name: str, nbytes: int = 0) -> bytes | None:
        """The bytes of ``key``'s object ``name``, or None when it does not exist. A denied or failing
        remote is marked down (one warning) and raises ``RemoteUnavailable``."""
        try:
            fs, _ = self._filesystem()
            return self._call(f"reading {key[:12]}/{name}", lambda: fs.cat_file(self._path(key, name)), nbytes=nbytes)
        except FileNotFoundError:
            return None
        except PermissionError as e:
            self._mark_down(f"access denied: {e}", depth=1)
            raise RemoteUnavailable(str(e)) from None
        except RemoteUnavailable as e:
            self._mark_down(str(e), depth=1)
            raise

    def fetch(self, key: str) -> tuple[tuple[bytes, bytes, bytes], Artifact] | None:
        """The verified entry ``((meta, module, executable), Artifact)`` for ``key``, or None on a miss.

        Raises ``RemoteRejected`` (present but damaged or not signed with our key) and
        ``RemoteUnavailable`` (the remote failed; it is then marked down, with one warning).
        """
        check_key(key)
        if self.down is not None:
            raise RemoteUnavailable(self.down)
        raw = self._read(key, MANIFEST)
        if raw is None:
            return None
        manifest = self._check_manifest(key, raw)
        size = manifest["size"]
        blob = self._read(key, manifest["payload"], nbytes=size)
        if blob is None:
            return None  # pruned or replaced between the two reads: a plain miss
        if len(blob) != size:
            raise RemoteRejected(f"payload is {len(blob)} bytes, its manifest says {size} (truncated?)", damaged=True)
        if E.sha256(blob) != manifest["sha256"]:
            raise RemoteRejected("payload checksum mismatch", damaged=True)
        try:
            meta, module, executable = E.unpack(blob)
            payload = E.verify_meta(meta, key)
            artifact = E.decode(payload, module, executable)
        except E.CorruptEntry as e:
            raise RemoteRejected(str(e), damaged=True) from None
        return (meta, module, executable), artifact

    def _check_manifest(self, key: str, raw: bytes) -> dict[str, Any]:
        if len(raw) > MAX_MANIFEST_BYTES:
            raise RemoteRejected(f"manifest is larger than {MAX_MANIFEST_BYTES} bytes", damaged=True)
        try:
            manifest = json.loads(raw.decode())
        except (ValueError, UnicodeDecodeError):
            manifest = None
        if not (
            isinstance(manifest, dict)
            and manifest.get("format") == MANIFEST_FORMAT
            and isinstance(manifest.get("payload"), str)
            and isinstance(manifest.get("size"), int)
            and isinstance(manifest.get("sha256"), str)
        ):
            raise RemoteRejected("unreadable manifest", damaged=True)
        if _PAYLOAD.fullmatch(manifest["payload"]) is None:
            raise RemoteRejected(
                f"the manifest's payload name {manifest['payload'][:80]!r} is not one of ours", damaged=True
            )
        if not 0 <= manifest["size"] <= MAX_ENTRY_BYTES:
            raise RemoteRejected(f"the manifest claims {manifest['size']} bytes, beyond any entry", damaged=True)
        if manifest.get("key") != key:
            raise RemoteRejected("manifest names another key", damaged=True)
        if self.hmac_key is not None:
            signature = manifest.get("signature")
            if not isinstance(signature, str):
                raise RemoteRejected(f"unsigned, and {ENV_HMAC_KEY} is set", damaged=False)
            if not hmac.compare_digest(signature, _sign(manifest, self.hmac_key)):
                raise RemoteRejected(f"signature does not verify with {ENV_HMAC_KEY}", damaged=False)
        return manifest

    # ----------------------------------------------------------------- write
    def publish(self, key: str, parts: tuple[bytes, bytes, bytes], replace: bool = False) -> str:
        """Upload an entry: payload first, manifest last. Returns "published", "exists" (another writer
        was first), "off" (the remote is down or publishing was denied before) or "error" (it failed now;
        warned). ``replace`` overwrites an existing (damaged) entry instead of yielding to it."""
        check_key(key)
        if self.down is not None or not self.publishing:
            return "off"
        meta, module, executable = parts
        try:
            summary = E.verify_meta(meta, key)
        except E.CorruptEntry as e:  # our own bytes: never expected, and never a reason to fail the job
            log.warning("neuron cache: not publishing %s: %s", key[:12], e)
            return "off"
        blob = E.pack(meta, module, executable)
        name = f"{uuid.uuid4().hex}.entry"
        manifest: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "key": key,
            "payload": name,
            "size": len(blob),
            "sha256": E.sha256(blob),
            "created": time.time(),
            "name": str(summary.get("name", "?")),
        }
        if self.hmac_key is not None:
            manifest["signature"] = _sign(manifest, self.hmac_key)
        body = json.dumps(manifest, sort_keys=True, indent=1).encode()
        try:
            fs, _ = self._filesystem()
            old = self._manifest(key) if replace else None
            if not replace and self._call(f"checking {key[:12]}", lambda: fs.exists(self._path(key, MANIFEST))):
                return "exists"  # published meanwhile by another host
            self._call(f"writing {key[:12]}/{name}", lambda: _pipe(fs, self._path(key, name), blob), nbytes=len(blob))
            try:
                mode = "overwrite" if replace else "create"
                self._call(
                    f"writing {key[:12]}/{MANIFEST}", lambda: _pipe(fs, self._path(key, MANIFEST), body, mode=mode)
                )
            except FileExistsError:
                log.info("neuron cache: %s was published to %s by another writer first", key[:12], self.url)
                with contextlib.suppress(RemoteUnavailable, OSError):
                    self._call(f"removing {key[:12]}/{name}", lambda: fs.rm_file(self._path(key, name)))
                return "exists"
            stale = (old or {}).get("payload")
            if isinstance(stale, str) and _PAYLOAD.fullmatch(stale) and stale != name:
                with contextlib.suppress(RemoteUnavailable, OSError):
                    self._call("removing the replaced payload", lambda: fs.rm_file(self._path(key, stale)))
        except PermissionError as e:
            self.publishing = False
            warn(
                f"neuron cache: not allowed to write to the remote cache {self.url} ({e}); reading it only, "
                "not publishing compiled graphs for the rest of this process.",
                stacklevel=6,
            )
            return "error"
        except (RemoteUnavailable, OSError) as e:
            self._mark_down(str(e))
            return "error"
        log.info("neuron cache: published %s to %s", key[:12], self.url)
        return "published"

    # ----------------------------------------------------- listing and pruning
    def _scan(self) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
        """(key -> {object name: modification time}, key -> bytes) of the objects under the URL whose
        "directory" is a cache key (anything else is not ours and is left alone). Raises
        ``RemoteUnavailable``."""
        fs, root = self._filesystem()
        try:
            found = self._call("listing", lambda: fs.find(root, detail=True))
        except (FileNotFoundError, PermissionError) as e:
            raise RemoteUnavailable(f"listing {self.url}: {e}") from None
        by_key: dict[str, dict[str, float]] = {}
        sizes: dict[str, int] = {}
        for path, info in found.items():
            parts = (path[len(root) :] if root else path).strip("/").split("/")
            if len(parts) != 2 or not is_key(parts[0]):
                continue
            by_key.setdefault(parts[0], {})[parts[1]] = _modified(info)
            sizes[parts[0]] = sizes.get(parts[0], 0) + int(info.get("size") or 0)
        return by_key, sizes

    def _manifest(self, key: str) -> dict[str, Any] | None:
        """The manifest of ``key`` if it reads and parses (for listing and pruning; loading checks more)."""
        fs, _ = self._filesystem()
        with contextlib.suppress(RemoteUnavailable, OSError, ValueError, UnicodeDecodeError):
            raw = self._call("reading a manifest", lambda: fs.cat_file(self._path(key, MANIFEST)))
            doc = json.loads(raw.decode()) if len(raw) <= MAX_MANIFEST_BYTES else None
            if isinstance(doc, dict):
                return doc
        return None

    def entries(self) -> list[RemoteEntry]:
        """Every published entry (a manifest exists) under the URL. Raises ``RemoteUnavailable``."""
        out = []
        by_key, sizes = self._scan()
        for key, objects in sorted(by_key.items()):
            if MANIFEST not in objects:
                continue  # payloads only: an upload in progress, or abandoned
            doc = self._manifest(key) or {}
            out.append(RemoteEntry(key, sizes.get(key, 0), objects[MANIFEST], str(doc.get("name", "?"))[:60]))
        return out

    def usage(self) -> tuple[int, int]:
        """(published entries, bytes under the URL's cache keys) from one listing, no manifest read (for
        ``neuron-compile doctor``: a cheap "is it reachable, what is there"). Raises ``RemoteUnavailable``."""
        by_key, sizes = self._scan()
        return sum(1 for objects in by_key.values() if MANIFEST in objects), sum(sizes.values())

    def prune(self, older_than: float, abandoned_after: float = STALE_SECONDS) -> tuple[list[str], int]:
        """Remove entries published more than ``older_than`` seconds ago (the manifest first, so a reader
        sees a plain miss), and payloads no manifest names that are older than ``abandoned_after``
        (uploads of crashed writers, or replaced ones). Returns (removed keys, objects removed).
        Raises ``RemoteUnavailable``."""
        fs, _ = self._filesystem()
        now = time.time()
        removed: list[str] = []
        count = 0
        for key, objects in self._scan()[0].items():
            payloads = [n for n in objects if _PAYLOAD.fullmatch(n)]
            if MANIFEST in objects and now - objects[MANIFEST] >= older_than:
                doomed = [MANIFEST, *payloads]
                removed.append(key)
            else:
                keep = None
                if MANIFEST in objects:
                    keep = (self._manifest(key) or {}).get("payload")
                    if keep is None:
                        continue  # a young entry whose manifest does not read: a lookup reports it
                doomed = [n for n in payloads if n != keep and now - objects[n] >= abandoned_after]
            for name in doomed:
                self._call(f"removing {key[:12]}/{name}", lambda k=key, n=name: fs.rm_file(self._path(k, n)))
                count += 1
        return removed, count


def _pipe(fs: Any, path: str, data: bytes, mode: str = "overwrite") -> None:
    """``fs.pipe_file``, creating the key's "directory" on filesystems that have real ones (file://, sftp)."""
    try:
        fs.pipe_file(path, data, mode=mode)
    except FileNotFoundError:
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(path, data, mode=mode)


def _modified(info: dict[str, Any]) -> float:
    """An object's modification time from an fsspec ``info`` dict (S3: LastModified, local: mtime)."""
    value = info.get("LastModified", info.get("mtime", info.get("created", 0)))
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0
