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
others delete their payload. A writer whose retried manifest write finds a manifest compares it with the
one it wrote: when the first attempt landed and only its reply was lost, the manifest is its own and it
keeps its payload. A reader that finds the payload gone has a plain miss when the manifest changed
meanwhile (pruned or replaced); when it did not, the entry is dangling: a warned miss, recompiled and
republished over it (and the manifest removed first once older than ``DANGLING_SECONDS``).

**Untrusted input.** Everything read from the URL is untrusted: the key is ours (``paths.check_key``
before any use, and the manifest must name it), the payload name must match ``_PAYLOAD`` (no path can be
smuggled in), sizes are bounded and no read takes more bytes than the object may have (a manifest's
limit; the payload's size from its manifest), and the payload goes through the local store's own checks
(``entry.verify_meta``/``entry.decode``: metadata checksum, every file's size and sha256) before a byte of
it reaches the local cache. A damaged entry is a warned miss and is replaced by the next publish. With a
signing key (``NEURON_COMPILE_CACHE_HMAC_KEY``, shared by writers and readers), the manifest carries an
HMAC-SHA256 over its fields (which include the payload's sha256): an unsigned or wrongly signed entry is
ignored with a warning, and not overwritten (a host with a wrong key must not evict the fleet's entries).

**Failures never fail the job.** Every remote call runs with a deadline (``NEURON_COMPILE_CACHE_URL_TIMEOUT``
seconds, default 10, plus transfer time at 4 MiB/s) and one retry; after that the URL is unused for the rest
of the process, with one warning. A timed-out download is cancelled (async filesystems: its request;
others: at the next chunk) before the retry starts. Any failure while setting up the URL's filesystem
(e.g. an FTP server that refuses) also leaves the URL unused for the process. Access denied on publishing
only stops publishing (read-only credentials are a normal setup for consumers).

**Secrets.** ``url`` is the URL with its user-info and secret query values redacted (``redact.redact_url``):
the only form this module prints or logs. Every message it raises or warns with, a library's error text
included, goes through ``redact.redact`` with the real URL, whose password botocore quotes back otherwise
(``Invalid bucket name "u:password@bucket"``).

fsspec (and s3fs for S3) is imported only when a URL is used: ``import neuron_compile`` stays light.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import hmac
import json
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from ..artifact import Artifact
from . import entry as E
from .paths import check_key, is_key
from .redact import redact, redact_url
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
#: Blocking filesystems are read in chunks this big (a download stops within one chunk of its deadline).
_CHUNK = 4 * 1024**2
#: A manifest whose payload is missing is removed by a reader once this old (a reader that compiles the
#: entry republishes over it sooner); younger, it may be a filesystem that shows files late (NFS).
DANGLING_SECONDS = STALE_SECONDS
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
    and ``publishing`` (False once writing was denied). ``url`` is the URL to show (secrets redacted)."""

    def __init__(self, url: str, timeout: float | None = None, hmac_key: bytes | None = None) -> None:
        self._url = url.rstrip("/")  # with its credentials: for fsspec only, never printed
        self.url = redact_url(self._url)
        self.timeout = timeout_from_env() if timeout is None else timeout
        self.hmac_key = hmac_key
        self.down: str | None = None
        self.publishing = True
        self._fs: Any = None
        self._root = ""
        self._setup_error: str | None = None  # setting up the filesystem failed: not tried again
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- access
    def _filesystem(self) -> tuple[Any, str]:
        """(fsspec filesystem, root path) for the URL, set up once. Any failure while setting it up (missing
        package, bad URL, a server that refuses or does not answer, a filesystem that cannot take the URL) is
        ``RemoteUnavailable`` now and on every later call: the process does not try again."""
        with self._lock:
            if self._setup_error is not None:
                raise RemoteUnavailable(self._setup_error)
            if self._fs is None:
                try:
                    self._fs, self._root = self._set_up()
                except RemoteUnavailable as e:
                    self._setup_error = str(e)
                    raise
            return self._fs, self._root

    def _set_up(self) -> tuple[Any, str]:
        try:
            import fsspec
        except ImportError:
            raise RemoteUnavailable(
                "fsspec is not installed: pip install fsspec (and s3fs for s3://: pip install 'neuron_compile[remote]')"
            ) from None
        try:
            protocol = fsspec.utils.get_protocol(self._url)
        except Exception as e:
            raise RemoteUnavailable(self.redact(f"not a usable fsspec URL ({type(e).__name__}: {e})")) from None
        options: dict[str, Any] = {"skip_instance_cache": True}
        if protocol in ("s3", "s3a"):
            # botocore's own timeouts and a single attempt: retries are ours, under one deadline
            options["config_kwargs"] = {
                "connect_timeout": self.timeout,
                "read_timeout": self.timeout,
                "retries": {"max_attempts": 1},
            }
        # Some filesystems connect while being created (ftp, sftp, smb...): under a deadline like any call.
        done, value, error = _run_in_thread(lambda: fsspec.core.url_to_fs(self._url, **options), self.timeout)
        if not done:
            raise RemoteUnavailable(f"setting up the {protocol}:// filesystem: no answer within {self.timeout:.1f}s")
        if isinstance(error, ImportError):
            raise RemoteUnavailable(self.redact(f"{error} (for S3: pip install 'neuron_compile[remote]')"))
        if isinstance(error, (ValueError, TypeError)):
            raise RemoteUnavailable(self.redact(f"not a usable fsspec URL ({error})"))
        if error is not None:  # any other: e.g. ConnectionRefusedError (ftp), IsADirectoryError (zip, tar)
            raise RemoteUnavailable(
                self.redact(f"setting up the {protocol}:// filesystem failed: {type(error).__name__}: {error}")
            )
        fs, root = value
        if hasattr(fs, "retries"):
            fs.retries = 1  # s3fs's internal retry loop would multiply ours
        return fs, root.rstrip("/")

    def redact(self, text: object) -> str:
        """``text`` (an error of a call on this URL) without this URL's secrets or any other URL's."""
        return redact(text, [self._url])

    def _path(self, key: str, name: str = "") -> str:
        check_key(key)
        base = f"{self._root}/{key}" if self._root else key
        return f"{base}/{name}" if name else base

    def _call(
        self,
        what: str,
        fn: Callable[[], T] | None = None,
        nbytes: int = 0,
        *,
        stoppable: Callable[[threading.Event], T] | None = None,
        coro: Callable[[], Any] | None = None,
    ) -> T:
        """One remote call with a deadline and one retry. Errors that retrying cannot fix (not found,
        exists, denied) pass through at once; time-outs and the rest become ``RemoteUnavailable``.

        The call is one of: ``coro``, a coroutine factory run on the (async) filesystem's event loop and
        cancelled at its deadline, which closes its connection; ``stoppable``, a blocking call given an
        event that is set at its deadline (it stops between chunks); ``fn``, a blocking call in a daemon
        thread, abandoned at its deadline (small requests only). A timed-out attempt is stopped before the
        retry starts, where it can be: a large download never runs twice at once."""
        deadline = self.timeout + nbytes / MIN_RATE
        last: BaseException | None = None
        for attempt in range(ATTEMPTS):
            if coro is not None:
                done, value, error = _run_on_loop(self._fs, coro, deadline)
            else:
                stop = threading.Event()
                call = fn if stoppable is None else (lambda stop=stop: stoppable(stop))
                done, value, error = _run_in_thread(call, deadline)
                if not done:
                    stop.set()
            if not done:
                last = TimeoutError(f"no answer within {deadline:.1f}s")
            elif error is not None:
                if isinstance(error, RemoteRejected):
                    raise error
                if isinstance(error, (FileNotFoundError, FileExistsError, PermissionError)):
                    raise type(error)(self.redact(error)) from None  # its text quotes the path, credentials too
                last = error
            else:
                return value
            if attempt + 1 < ATTEMPTS:
                time.sleep(0.2)
        raise RemoteUnavailable(self.redact(f"{what}: {type(last).__name__}: {last}"))

    def _mark_down(self, why: str, depth: int = 0) -> None:
        """Stop using the remote for this process, with one warning; ``depth``: frames between the caller
        the warning should point past and this call, beyond the usual."""
        if self.down is None:
            why = self.redact(why)
            self.down = why
            warn(
                f"neuron cache: the remote cache {self.url} is not usable ({why}); compiling with the local "
                "cache only for the rest of this process. Check the URL, credentials and network, or unset "
                "NEURON_COMPILE_CACHE_URL / option cache_url.",
                stacklevel=6 + depth,
            )

    # ------------------------------------------------------------------ read
    def _get(self, key: str, name: str, limit: int) -> bytes:
        """At most ``limit`` + 1 bytes of ``key``'s object ``name`` (more than ``limit``: not what it should
        be, and never read whole). Raises FileNotFoundError, PermissionError, ``RemoteUnavailable``."""
        fs, _ = self._filesystem()
        path = self._path(key, name)
        what = f"reading {key[:12]}/{name}"
        if getattr(fs, "async_impl", False) and hasattr(fs, "_cat_file"):
            return self._call(what, nbytes=limit, coro=lambda: _cat_at_most(fs, path, limit))
        return self._call(what, nbytes=limit, stoppable=lambda stop: _read_at_most(fs, path, limit, stop))

    def _read(self, key: str, name: str, limit: int) -> bytes | None:
        """At most ``limit`` + 1 bytes of ``key``'s object ``name``, or None when it does not exist. A
        denied or failing remote is marked down (one warning) and raises ``RemoteUnavailable``."""
        try:
            return self._get(key, name, limit)
        except FileNotFoundError:
            return None
        except PermissionError as e:
            self._mark_down(f"access denied: {e}", depth=1)
            raise RemoteUnavailable(self.redact(e)) from None
        except RemoteUnavailable as e:
            self._mark_down(str(e), depth=1)
            raise

    def fetch(self, key: str) -> tuple[tuple[bytes, bytes, bytes], Artifact] | None:
        """The verified entry ``((meta, module, executable), Artifact)`` for ``key``, or None on a miss.

        Raises ``RemoteRejected`` (present but damaged or not signed with our key; a manifest whose
        payload is missing is damaged) and ``RemoteUnavailable`` (the remote failed; it is then marked
        down, with one warning). No read takes more bytes than the object may have: the manifest's limit,
        then the payload's size as the manifest states it.
        """
        check_key(key)
        if self.down is not None:
            raise RemoteUnavailable(self.down)
        raw = self._read(key, MANIFEST, MAX_MANIFEST_BYTES)
        if raw is None:
            return None
        manifest = self._check_manifest(key, raw)
        size = manifest["size"]
        blob = self._read(key, manifest["payload"], size)
        if blob is None:
            self._check_dangling(key, raw, manifest["payload"])
            return None  # pruned or replaced between the two reads: a plain miss
        if len(blob) > size:
            raise RemoteRejected(f"payload is larger than the {size} bytes its manifest says", damaged=True)
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

    def _check_dangling(self, key: str, raw: bytes, payload: str) -> None:
        """The payload the manifest ``raw`` names was not found. Returns when the manifest changed meanwhile
        (pruned or replaced: a plain miss); else the entry is dangling (a writer lost its payload) and every
        host would miss on it forever without repairing it: raises ``RemoteRejected`` (damaged), so the
        caller warns, recompiles and republishes over it. A dangling manifest older than
        ``DANGLING_SECONDS`` is removed first, so the key is free even when this host cannot republish."""
        if self._read(key, MANIFEST, MAX_MANIFEST_BYTES) != raw:
            return
        why = f"its manifest names payload {payload}, which does not exist"
        fs, _ = self._filesystem()
        path = self._path(key, MANIFEST)
        with contextlib.suppress(RemoteUnavailable, OSError):
            info = self._call(f"checking {key[:12]}/{MANIFEST}", lambda: fs.info(path))
            if time.time() - _modified(info) >= DANGLING_SECONDS:
                self._call(f"removing {key[:12]}/{MANIFEST}", lambda: fs.rm_file(path))
                why += "; removed the manifest"
        raise RemoteRejected(why, damaged=True)

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
                # Another writer's manifest, or our own: an earlier attempt landed and its reply was lost
                # (the retry then finds it). Only its bytes tell (our payload name is random); deleting our
                # payload under our own manifest would leave every host a manifest with nothing behind it.
                current = None
                with contextlib.suppress(RemoteUnavailable, OSError):
                    current = self._get(key, MANIFEST, MAX_MANIFEST_BYTES)
                if current != body:
                    log.info("neuron cache: %s was published to %s by another writer first", key[:12], self.url)
                    if current is not None:  # unreadable: keep our payload (prune removes it if not ours)
                        with contextlib.suppress(RemoteUnavailable, OSError):
                            self._call(f"removing {key[:12]}/{name}", lambda: fs.rm_file(self._path(key, name)))
                    return "exists"
                log.info("neuron cache: %s: our first manifest write landed, its reply was lost", key[:12])
            stale = (old or {}).get("payload")
            if isinstance(stale, str) and _PAYLOAD.fullmatch(stale) and stale != name:
                with contextlib.suppress(RemoteUnavailable, OSError):
                    self._call("removing the replaced payload", lambda: fs.rm_file(self._path(key, stale)))
        except PermissionError as e:
            self.publishing = False
            warn(
                f"neuron cache: not allowed to write to the remote cache {self.url} ({self.redact(e)}); reading it only, "
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
            raise RemoteUnavailable(f"listing {self.url}: {self.redact(e)}") from None
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
        with contextlib.suppress(RemoteUnavailable, OSError, ValueError, UnicodeDecodeError):
            raw = self._get(key, MANIFEST, MAX_MANIFEST_BYTES)
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


def _run_in_thread(fn: Callable[[], T], deadline: float) -> tuple[bool, Any, BaseException | None]:
    """(finished in time, value, error) of ``fn()`` run in a daemon thread (a remote that never answers
    must not keep the process from exiting); each call has its own box, so a late call answers nobody."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    worker = threading.Thread(target=run, name="neuron-cache-remote", daemon=True)
    worker.start()
    worker.join(deadline)
    if worker.is_alive():
        return False, None, None
    return True, box.get("value"), box.get("error")


def _run_on_loop(fs: Any, coro: Callable[[], Any], deadline: float) -> tuple[bool, Any, BaseException | None]:
    """(finished in time, value, error) of the coroutine ``coro()`` on the event loop of the async
    filesystem ``fs``; cancelled at the deadline, which closes its connection (no download left running)."""
    try:
        loop = fs.loop  # fsspec's IO thread (raises in a forked child: handed to the caller as a failure)
        future = asyncio.run_coroutine_threadsafe(coro(), loop)
    except Exception as e:
        return True, None, e
    try:
        return True, future.result(timeout=deadline), None
    except concurrent.futures.TimeoutError:
        future.cancel()
        return False, None, None
    except concurrent.futures.CancelledError as e:
        return True, None, e
    except Exception as e:
        return True, None, e


async def _cat_at_most(fs: Any, path: str, limit: int) -> bytes:
    """At most ``limit`` + 1 bytes of ``path`` on an async filesystem, in one ranged request (one byte
    more than allowed tells "too big" without reading the rest)."""
    try:
        return await fs._cat_file(path, start=0, end=limit + 1)
    except (FileNotFoundError, PermissionError):
        raise
    except OSError:
        # S3 answers a range on an empty object with 416 "not satisfiable": empty is a size, not a failure
        if (await fs._info(path)).get("size") == 0:
            return b""
        raise


def _read_at_most(fs: Any, path: str, limit: int, stop: threading.Event) -> bytes:
    """At most ``limit`` + 1 bytes of ``path`` on a blocking filesystem, in chunks; stops at the next chunk
    once ``stop`` is set (the call's deadline passed)."""
    chunks: list[bytes] = []
    got = 0
    with fs.open(path, "rb") as fh:
        while got <= limit:
            if stop.is_set():
                raise TimeoutError("cancelled at the deadline")
            chunk = fh.read(min(_CHUNK, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    return b"".join(chunks)


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
