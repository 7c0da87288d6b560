"""Compile once for the fleet: ``neuron-compile precompile collect | compile | check`` (docs/precompile.md).

1. **collect** runs the user's script with ``NEURON_COMPILE_PRECOMPILE_MANIFEST=M`` (option
   ``precompile_manifest``): the script runs for real on the CPU target, and every graph looked up in the
   compile cache (``CACHE.observers``: ``cache.collect.Recorder``) is keyed and lowered *as the neuron target
   would* with the same options (``dataclasses.replace(opts, target="neuron")``: generation, lnc, flags, opt
   level, kernels), its StableHLO and entry plan written content-addressed into ``modules/`` beside the
   manifest, and a record (key, key summary, shapes, the user's source line) merged into M under a file lock
   (many ranks may collect into one manifest).
2. **compile** compiles every recorded module that neither the local cache nor the remote one (a listing)
   holds, ``--jobs`` neuronx-cc processes at once, into the local cache and then the remote cache. The key
   is the hash of its summary (``cache.key.key_digest``), so a manifest collected where there is no
   neuronx-cc gets this host's compiler version filled in: the key the run computes on a host with this
   compiler. ``--shard I/N`` takes every N-th key of the sorted keys, from I.
3. **check** reports the coverage per graph, and for a miss the nearest entries and the key parts that
   differ (``cache.compile_cache.explain_miss``); below 100% it exits 1.

Not recorded: graphs the cache does not hold in any run (debug dumps, emulated or user NKI kernels,
uncacheable graphs), and graphs with collectives, which the CPU target splits into pieces around them
where the neuron target compiles them whole.

The manifest and the recorder are ``cache/collect.py`` (the backend installs the recorder; it imports no
command). A manifest that is not one raises ``ManifestError``, one line per problem naming the file and the
field: the commands print them and exit 2.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from .cache.collect import ENV_MANIFEST, OBJECTS_DIR, ManifestError, Recorded, read_manifest, read_object
from .options import from_env


# -------------------------------------------------------------------------------------------- collect
def collect(manifest: str, command: list[str]) -> int:
    """Run ``command`` with collection on (``NEURON_COMPILE_PRECOMPILE_MANIFEST``); its exit status."""
    if not command:
        raise SystemExit("neuron-compile: precompile collect needs a command after --, e.g. -- python train.py")
    manifest = os.path.abspath(manifest)
    before = set(read_manifest(manifest))
    env = {**os.environ, ENV_MANIFEST: manifest}
    try:
        status = subprocess.call(command, env=env)
    except OSError as e:
        raise SystemExit(f"neuron-compile: cannot run {command[0]!r}: {e.strerror or e}") from None
    graphs = read_manifest(manifest)
    failed = [r for r in graphs.values() if r.error]
    print(f"precompile collect: {len(graphs)} graphs in {manifest} ({len(set(graphs) - before)} new)"
          + (f", {len(failed)} could not be lowered for the neuron target" if failed else ""))  # fmt: skip
    for r in failed:
        print(f"  {r.name} at {r.source}: {r.error.splitlines()[0]}")
    if status != 0:
        print(f"precompile collect: the command exited with status {status}", file=sys.stderr)
    return status


# ------------------------------------------------------------------------------------------- resolve
def host_versions(with_nki: bool) -> dict[str, str]:
    """This host's versions that may differ from the collecting host's: neuronx-cc's (when it is here), and
    with ``with_nki`` the real nki's (the run's lowering depends on it; compile must not change it)."""
    from .cache.key import nki_version
    from .runtime.neuron import compiler_version

    found = {"neuronx-cc": compiler_version()} if shutil.which("neuronx-cc") else {}
    if with_nki:
        found["nki"] = nki_version()
    return found


def resolve(record: Recorded, versions: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """(key, summary) of ``record`` with this host's ``versions`` in place of the collecting host's."""
    from .cache.key import key_digest

    if all(record.summary.get("versions", {}).get(k) == v for k, v in versions.items()):
        return record.key, record.summary
    summary = {**record.summary, "versions": {**record.summary.get("versions", {}), **versions}}
    return key_digest(summary), summary


def shard_of(keys: list[str], shard: tuple[int, int] | None) -> list[str]:
    """Shard ``(i, n)`` of ``keys``: every n-th of the sorted keys from the i-th (disjoint, covering)."""
    ordered = sorted(keys)
    return ordered if shard is None else ordered[shard[0] :: shard[1]]


def parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(p) for p in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r}: expected I/N, e.g. 0/4") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard {text!r}: needs 0 <= I < N")
    return i, n


def _stores(cache_dir: str | None, cache_url: str | None) -> tuple[Any, Any]:
    from .cache.paths import resolve_cache_dir
    from .cache.remote import RemoteStore, hmac_key_from_env
    from .cache.store import DiskStore

    store = DiskStore(resolve_cache_dir(cache_dir))
    url = cache_url if cache_url is not None else from_env("cache_url")
    remote = RemoteStore(url, timeout=from_env("cache_url_timeout"), hmac_key=hmac_key_from_env()) if url else None
    return store, remote


def _local_has(store: Any, key: str) -> bool:
    from .cache.entry import CorruptEntry

    try:
        store.meta(key)
        return True
    except (OSError, CorruptEntry):
        return False


def _remote_keys(remote: Any) -> set[str]:
    from .cache.remote import RemoteUnavailable

    if remote is None:
        return set()
    try:
        return {e.key for e in remote.entries()}
    except (RemoteUnavailable, OSError) as e:
        print(f"precompile: the remote cache {remote.url} is not usable ({remote.redact(e)}); local cache only",
              file=sys.stderr)  # fmt: skip
        return set()


# ------------------------------------------------------------------------------------------- compile
@dataclass
class Failure:
    name: str
    key: str
    source: str
    message: str


@dataclass
class CompileResult:
    compiled: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    seconds: float = 0.0


class Progress:
    """One status line: graphs done, running, failed, left and an ETA (redrawn in place on a terminal)."""

    def __init__(self, total: int, jobs: int, out: TextIO) -> None:
        self.total, self.jobs, self.out = total, jobs, out
        self.done = self.running = self.failed = 0
        self.t0 = time.monotonic()
        self.spent: list[float] = []
        self.tty = out.isatty()

    def show(self, final: bool = False) -> None:
        left = self.total - self.done - self.failed
        if self.spent and left:
            waves = -(-left // self.jobs)  # ceil: compilers run `jobs` at a time
            eta = f"ETA {waves * sum(self.spent) / len(self.spent):.0f}s"
        else:
            eta = "ETA ?" if left else f"{time.monotonic() - self.t0:.1f}s"
        width = 20
        filled = width * (self.done + self.failed) // max(self.total, 1)
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} done, {self.running} running, "
                f"{self.failed} failed, {eta}")  # fmt: skip
        if self.tty:
            self.out.write("\r" + line + ("\n" if final else ""))
        else:
            self.out.write(line + "\n")
        self.out.flush()


def _compile_module(
    record: Recorded,
    manifest: str,
    summary: dict[str, Any],
    key: str,
    cache_dir: str | None = None,
    out: TextIO | None = None,
) -> tuple[bytes, bytes, bytes]:
    """Runs neuronx-cc on one recorded module: the entry's (meta, module, executable). The compile is bounded and
    reports progress as the options compile_timeout / compile_progress_seconds (their environment variables) say."""
    from .cache import entry as E
    from .runtime import jax_adapter
    from .runtime.neuron import NeuronTarget
    from .runtime.targets import GraphLabel

    if record.error or not record.module or not record.plan:
        raise RuntimeError(f"not lowered while collecting: {record.error or 'no module recorded'}")
    module = read_object(manifest, record.module, ".mlir")
    payload = E.verify_meta(read_object(manifest, record.plan, ".json"), None)
    artifact = E.decode(payload, module, b"")
    o = summary["options"]
    target = NeuronTarget(
        o["generation"],
        tuple(o["neuron_cc_flags"]),
        int(o["opt_level"]),
        int(o.get("lnc", 2)),
        compiler_input=o.get("compiler_input", "auto"),
        compile_timeout=from_env("compile_timeout"),
        progress_seconds=from_env("compile_progress_seconds"),
        cache_dir=cache_dir,
    )
    if out is not None:
        target.progress = lambda line: print(line, file=out, flush=True)

    def largest_op() -> str:
        found = jax_adapter.largest_op(artifact.stablehlo)
        op = f"{found[0]} ({found[1] / 2**20:.1f} MiB result)" if found else "not known"
        return f"{op}; the graph was traced at {record.source}"

    t0 = time.perf_counter()
    executable = target.compile(artifact.stablehlo, graph=GraphLabel(record.name, largest_op))
    artifact.executable = target.serialize(executable)
    artifact.compile_seconds = time.perf_counter() - t0
    artifact.target_version = target.version()
    return E.encode(artifact, key, summary)


def compile_manifest(
    manifest: str,
    jobs: int | None = None,
    shard: tuple[int, int] | None = None,
    cache_dir: str | None = None,
    cache_url: str | None = None,
    out: TextIO | None = None,
) -> CompileResult:
    """Compile every graph of ``manifest`` (of ``shard``) that the local and remote caches lack, ``jobs``
    compiler processes at once (default: the cores); store each locally, then publish it remotely. One
    failure does not stop the others. Interrupted, it leaves what it finished in the cache: run it again."""
    from .cache.store import DEFAULT_MAX_BYTES, StoreUnavailable

    out = out or sys.stderr
    jobs = jobs or os.cpu_count() or 1
    graphs = read_manifest(manifest)
    if shutil.which("neuronx-cc") is None:
        raise SystemExit("neuron-compile: neuronx-cc is not on PATH: install the Neuron SDK's aws-neuronx-cc "
                         "(it runs on any x86-64 Linux host; no Trainium needed to compile)")  # fmt: skip
    if not graphs:
        raise SystemExit(f"neuron-compile: {manifest} holds no graph (run precompile collect first)")
    store, remote = _stores(cache_dir, cache_url)
    reason = store.untrusted_reason()
    if reason is not None and not from_env("trust_cache_dir"):
        raise SystemExit(
            f"neuron-compile: not writing to {store.root}: {reason} (NEURON_COMPILE_CACHE_TRUST=1 trusts it)"
        )
    versions = host_versions(with_nki=False)
    result = CompileResult()
    t_start = time.monotonic()
    remote_keys = _remote_keys(remote)
    todo: list[tuple[Recorded, str, dict[str, Any]]] = []
    for original in shard_of(list(graphs), shard):
        record = graphs[original]
        key, summary = resolve(record, versions)
        if key in remote_keys or _local_has(store, key):
            result.already.append(key)
        else:
            todo.append((record, key, summary))
    progress = Progress(len(todo), jobs, out)
    print(f"precompile compile: {len(todo)} to compile, {len(result.already)} already cached"
          + (f" (shard {shard[0]}/{shard[1]})" if shard else "") + f", {jobs} at once", file=out)  # fmt: skip
    max_bytes = from_env("cache_max_bytes")
    max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="neuron-precompile")
    started: dict[concurrent.futures.Future, tuple[Recorded, str, float]] = {}

    def submit(record: Recorded, key: str, summary: dict[str, Any]) -> None:
        t0 = time.monotonic()
        future = executor.submit(_compile_module, record, manifest, summary, key, cache_dir, out)
        started[future] = (record, key, t0)

    try:
        for item in todo:
            submit(*item)
        progress.running = min(jobs, len(todo))
        if todo:
            progress.show()
        for future in concurrent.futures.as_completed(started):
            record, key, t0 = started[future]
            try:
                parts = future.result()
            except Exception as e:
                result.failed.append(Failure(record.name, key, record.source, str(e) or type(e).__name__))
                progress.failed += 1
            else:
                try:
                    with store.lock(key):
                        store.write(key, *parts)
                    store.evict(max_bytes, protect=key)
                except (StoreUnavailable, OSError) as e:
                    result.failed.append(Failure(record.name, key, record.source, f"cannot store in {store.root}: {e}"))
                    progress.failed += 1
                else:
                    if remote is not None:
                        remote.publish(key, parts)
                    result.compiled.append(key)
                    progress.done += 1
                    progress.spent.append(time.monotonic() - t0)
            progress.running = min(jobs, len(todo) - progress.done - progress.failed)
            progress.show(final=progress.done + progress.failed == len(todo))
    except KeyboardInterrupt:
        from .runtime import neuronx_cc

        executor.shutdown(wait=False, cancel_futures=True)
        stopped = neuronx_cc.stop_all()  # their keepers end the compilers and remove their directories
        print(
            f"\nprecompile compile: interrupted; {len(result.compiled)} graphs stored, {stopped} running compiles "
            "stopped. Run it again to go on.",
            file=out,
        )
        raise
    executor.shutdown(wait=True)
    result.seconds = time.monotonic() - t_start
    print(f"precompile compile: {len(result.compiled)} compiled, {len(result.already)} already cached, "
          f"{len(result.failed)} failed in {result.seconds:.1f}s", file=out)  # fmt: skip
    for f in result.failed:
        print(
            f"FAILED {f.name} (key {f.key[:12]}) at {f.source}:\n  " + "\n  ".join(f.message.splitlines()[:30]),
            file=out,
        )
    return result


# --------------------------------------------------------------------------------------------- check
@dataclass
class Coverage:
    hits: list[tuple[Recorded, str, str]] = field(default_factory=list)  # (record, key, where)
    misses: list[tuple[Recorded, str, list[str]]] = field(default_factory=list)  # (record, key, why)

    @property
    def percent(self) -> float:
        total = len(self.hits) + len(self.misses)
        return 100.0 * len(self.hits) / total if total else 100.0


def check_manifest(manifest: str, cache_dir: str | None = None, cache_url: str | None = None) -> Coverage:
    """Which graphs of ``manifest`` the caches hold under the key a run on this host computes (this host's
    neuronx-cc and nki versions), and why each other one would miss."""
    from .cache.compile_cache import explain_miss

    graphs = read_manifest(manifest)
    store, remote = _stores(cache_dir, cache_url)
    versions = host_versions(with_nki=True)
    remote_keys = _remote_keys(remote)
    coverage = Coverage()
    for original in sorted(graphs, key=lambda k: (graphs[k].name, k)):
        record = graphs[original]
        key, summary = resolve(record, versions)
        if _local_has(store, key):
            coverage.hits.append((record, key, "local"))
        elif key in remote_keys:
            coverage.hits.append((record, key, "remote"))
        else:
            why = [f"not lowered while collecting: {record.error.splitlines()[0]}"] if record.error else []
            coverage.misses.append((record, key, why + explain_miss(store, summary)))
    return coverage


def print_coverage(coverage: Coverage, out: TextIO) -> None:
    for record, key, where in coverage.hits:
        print(f"hit   {key[:12]}  {record.name:<22} {where:<6}  {record.source}", file=out)
    for record, key, why in coverage.misses:
        shapes = ", ".join(record.inputs[:3]) + (", ..." if len(record.inputs) > 3 else "")
        print(f"MISS  {key[:12]}  {record.name:<22} {record.source}  [{shapes}]", file=out)
        for line in why:
            print(f"        {line}", file=out)
    total = len(coverage.hits) + len(coverage.misses)
    print(f"coverage: {len(coverage.hits)}/{total} graphs ({coverage.percent:.1f}%)", file=out)


def explain_key(prefix: str, cache_dir: str | None, manifest: str | None, out: TextIO) -> int:
    """``neuron-compile cache explain KEY``: the entry (or manifest graph) ``prefix`` names, against the
    nearest other entries of the cache: the key parts that differ."""
    from .cache.compile_cache import explain_miss
    from .cache.entry import CorruptEntry
    from .cache.paths import InvalidKey, check_key_prefix

    store, _ = _stores(cache_dir, None)
    try:
        prefix = check_key_prefix(prefix)
    except InvalidKey as e:
        raise SystemExit(f"neuron-compile: {e}") from None
    found: list[tuple[str, str, dict[str, Any]]] = []
    for key in store.find(prefix):
        try:
            meta = store.meta(key)
        except (OSError, CorruptEntry):
            continue
        found.append((key, str(meta.get("name", "?")), meta.get("key_summary") or {}))
    if manifest:
        for key, record in read_manifest(manifest).items():
            if key.startswith(prefix) and key not in {k for k, _, _ in found}:
                found.append((key, record.name, record.summary))
    if len(found) != 1:
        what = "no entry" if not found else f"{len(found)} entries"
        where = store.root + (f" or {manifest}" if manifest else "")
        raise SystemExit(f"neuron-compile: {what} match key {prefix!r} in {where}")
    key, name, summary = found[0]
    print(f"{key} {name}: inputs {', '.join(summary.get('inputs', [])[:4])}", file=out)
    for line in explain_miss(store, summary, exclude=key):
        print(f"  {line}", file=out)
    return 0


# ------------------------------------------------------------------------------------------ commands
#: The exit status of a command given a manifest it cannot use (as for any usage error).
EXIT_BAD_MANIFEST = 2


def _bad_manifest(e: ManifestError) -> int:
    for line in e.problems:
        print(f"neuron-compile: {line}", file=sys.stderr)
    return EXIT_BAD_MANIFEST


def main_collect(manifest: str, command: list[str]) -> int:
    try:
        return collect(manifest, command)
    except ManifestError as e:
        return _bad_manifest(e)


def main_compile(
    manifest: str, jobs: int | None, shard: str | None, cache_dir: str | None, cache_url: str | None
) -> int:
    try:
        parsed = parse_shard(shard) if shard else None
        result = compile_manifest(manifest, jobs, parsed, cache_dir, cache_url)
    except KeyboardInterrupt:  # compile_manifest said what it left: one line, no traceback
        return 130
    except ManifestError as e:
        return _bad_manifest(e)
    except ValueError as e:
        raise SystemExit(f"neuron-compile: {e}") from None
    return 1 if result.failed else 0


def main_check(manifest: str, cache_dir: str | None, cache_url: str | None, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    try:
        coverage = check_manifest(manifest, cache_dir, cache_url)
    except ManifestError as e:
        return _bad_manifest(e)
    except ValueError as e:
        raise SystemExit(f"neuron-compile: {e}") from None
    print_coverage(coverage, out)
    return 0 if not coverage.misses else 1


def main_explain(prefix: str, cache_dir: str | None, manifest: str | None, out: TextIO) -> int:
    try:
        return explain_key(prefix, cache_dir, manifest, out)
    except ManifestError as e:
        return _bad_manifest(e)


__all__: list[str] = [
    "OBJECTS_DIR", "Recorded", "CompileResult", "Coverage", "Failure", "ManifestError", "check_manifest", "collect",
    "compile_manifest", "explain_key", "read_manifest", "read_object", "resolve", "shard_of",
]  # fmt: skip
