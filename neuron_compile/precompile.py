"""Compile once for the fleet: ``neuron-compile precompile collect | compile | check`` (docs/precompile.md).

1. **collect** runs the user's script with ``NEURON_COMPILE_PRECOMPILE_MANIFEST=M`` (option
   ``precompile_manifest``): the script runs for real on the CPU target, and every graph looked up in the
   compile cache (``CACHE.observers``) is keyed and lowered *as the neuron target would* with the same
   options (``dataclasses.replace(opts, target="neuron")``: generation, lnc, flags, opt level, kernels), its
   StableHLO and entry plan written content-addressed into ``modules/`` beside the manifest, and a record
   (key, key summary, shapes, the user's source line) merged into M under a file lock (many ranks may
   collect into one manifest).
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

A manifest is input like any file a user hands over: every read is checked against ``MANIFEST_SCHEMA`` (a
JSON Schema, checked with ``jsonschema``) and a bad one raises ``ManifestError``, one line per problem naming
the file and the field (the commands print them and exit 2). Its modules are named by their sha256 only, so
no path can be smuggled in; they are read from ``modules/`` beside it as regular files, opened without
blocking (``cache.store.read_regular_file``), inside the manifest's folder.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import filelock
import torch

from .artifact import Artifact
from .options import GENERATIONS, LNC_SIZES, OPT_LEVELS, Options, from_env
from .provenance import module_path, user_frame

log = logging.getLogger("neuron_compile.precompile")

MANIFEST_FORMAT = 1
ENV_MANIFEST = "NEURON_COMPILE_PRECOMPILE_MANIFEST"
#: The directory beside the manifest holding its content-addressed files.
OBJECTS_DIR = "modules"


# ------------------------------------------------------------------------------------------- manifest
@dataclass
class Recorded:
    """One graph of a manifest: what the neuron target's run will look up, and how to build it."""

    key: str
    summary: dict[str, Any]
    name: str
    source: str
    inputs: list[str]
    #: sha256 of the StableHLO module and of the entry plan (metadata without executable) in modules/
    module: str | None = None
    plan: str | None = None
    num_ops: int = 0
    lower_seconds: float = 0.0
    #: Why the graph could not be lowered for the neuron target while collecting (then no module).
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Recorded:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in names})


def objects_dir(manifest: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(manifest)), OBJECTS_DIR)


_STRINGS = {"type": "array", "items": {"type": "string"}}
_DIGEST = {"type": ["string", "null"], "pattern": "^[0-9a-f]{64}$",
           "description": f"the sha256 (64 lowercase hex digits) of a file in {OBJECTS_DIR}/, or null"}  # fmt: skip
_KEY = {"type": "string", "pattern": "^[0-9a-f]{40}$", "description": "a cache key (40 lowercase hex digits)"}
#: THE shape of a manifest: every field a command reads, with the type it reads it as. Fields of the key
#: summary that only go into its digest (graph, target, tag...) may be anything JSON.
MANIFEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["format", "graphs"],
    "properties": {
        "format": {"const": MANIFEST_FORMAT},
        "graphs": {
            "type": "object",
            "propertyNames": _KEY,
            "additionalProperties": {
                "type": "object",
                "required": ["key", "summary", "name", "source", "inputs"],
                "properties": {
                    "key": _KEY,
                    "summary": {
                        "type": "object",
                        "required": ["options", "versions", "inputs"],
                        "properties": {
                            "inputs": _STRINGS,
                            "versions": {"type": "object", "additionalProperties": {"type": "string"}},
                            "options": {
                                "type": "object",
                                "required": ["generation", "neuron_cc_flags", "opt_level"],
                                "properties": {
                                    "generation": {"enum": list(GENERATIONS)},
                                    "neuron_cc_flags": _STRINGS,
                                    "opt_level": {"enum": list(OPT_LEVELS)},
                                    "lnc": {"enum": list(LNC_SIZES)},
                                },
                            },
                        },
                    },
                    "name": {"type": "string"},
                    "source": {"type": "string"},
                    "inputs": _STRINGS,
                    "module": _DIGEST,
                    "plan": _DIGEST,
                    "num_ops": {"type": "integer", "minimum": 0},
                    "lower_seconds": {"type": "number", "minimum": 0},
                    "error": {"type": ["string", "null"]},
                },
            },
        },
    },
}
#: At most this many problems are listed (then how many more).
MAX_PROBLEMS = 20


class ManifestError(ValueError):
    """A file that is not a usable manifest; ``problems``: one line per problem, each naming the file and,
    where there is one, the field."""

    def __init__(self, path: str, problems: list[str]) -> None:
        shown = problems[:MAX_PROBLEMS]
        if len(problems) > len(shown):
            shown.append(f"... and {len(problems) - len(shown)} more problems")
        self.problems = [f"{path}: {p}" for p in shown]
        super().__init__("\n".join(self.problems))


def _field(path: Any) -> str:
    """``graphs.<key>.summary.inputs[0]`` of a jsonschema error path."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z0-9_-]+", part):
            out += f".{part}" if out else part
        else:
            out += f"[{part[:60]!r}]"
    return out


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "list", str: "str", bool: "bool", int: "int", float: "float"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


_EXPECTED = {"object": "an object", "array": "a list", "string": "a string", "integer": "an integer",
             "number": "a number", "null": "null", "boolean": "a boolean"}  # fmt: skip


def _describe(error: Any) -> str:
    """One line of a jsonschema ``ValidationError``: the field, what was expected, what is there."""
    where, value, schema = _field(error.absolute_path), error.instance, error.schema
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    kind = error.validator
    if kind == "type":
        types = error.validator_value if isinstance(error.validator_value, list) else [error.validator_value]
        why = f"expected {' or '.join(_EXPECTED.get(t, t) for t in types)}, got {_json_type(value)}"
    elif kind == "required":
        missing = re.match(r"'(.*)' is a required property", error.message)
        name = missing.group(1) if missing else "?"
        where = f"{where}.{name}" if where else name
        why = "missing"
    elif kind in ("enum", "const"):
        allowed = error.validator_value if kind == "enum" else [error.validator_value]
        why = f"expected {' or '.join(map(repr, allowed))}, got {shown}"
    elif kind == "propertyNames":
        why = f"{shown} is not {_KEY['description']}"
    elif kind == "pattern":
        why = f"expected {schema.get('description', 'a match of ' + error.validator_value)}, got {shown}"
    elif kind == "minimum":
        why = f"expected a number >= {error.validator_value}, got {shown}"
    else:
        why = error.message
    return f"{where}: {why}" if where else why


def check_manifest_document(doc: Any) -> list[str]:
    """Every problem of the parsed manifest ``doc`` (``MANIFEST_SCHEMA``, and each graph filed under its own
    key), one line each: "field: problem". Empty: a manifest every command can read."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(MANIFEST_SCHEMA)
    problems = sorted(_describe(e) for e in validator.iter_errors(doc))
    if not problems:
        for key, record in doc["graphs"].items():
            if record["key"] != key:
                problems.append(f"{_field(['graphs', key, 'key'])}: {record['key']!r} is not the key it is filed under")
    return problems


def read_manifest(path: str) -> dict[str, Recorded]:
    """The graphs of manifest ``path`` by key ({} when the file does not exist). Raises ``ManifestError``
    for a file that is not a usable manifest, saying why field by field. Reads a regular file only, without
    blocking (a FIFO there is refused, not waited on)."""
    from .cache.entry import CorruptEntry
    from .cache.store import read_regular_file

    try:
        raw = read_regular_file(path, follow_symlinks=True)
    except FileNotFoundError:
        return {}
    except CorruptEntry as e:
        raise ManifestError(path, [f"cannot be read: {e}"]) from None
    except OSError as e:
        raise ManifestError(path, [f"cannot be read: {e.strerror or e}"]) from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ManifestError(
            path, [f"not a manifest: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); a manifest is "
                   "the JSON file `neuron-compile precompile collect` writes"]
        ) from None  # fmt: skip
    except json.JSONDecodeError as e:
        raise ManifestError(path, [f"not a manifest: not JSON (line {e.lineno} column {e.colno}: {e.msg})"]) from None
    except RecursionError:
        raise ManifestError(path, ["not a manifest: JSON nested too deeply to read"]) from None
    problems = check_manifest_document(doc)
    if problems:
        raise ManifestError(path, problems)
    return {k: Recorded.from_json(v) for k, v in doc["graphs"].items()}


def _write_object(manifest: str, data: bytes, suffix: str) -> str:
    digest = hashlib.sha256(data).hexdigest()
    d = objects_dir(manifest)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, digest + suffix)
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    return digest


def read_object(manifest: str, digest: str, suffix: str) -> bytes:
    """A content-addressed file of the manifest, checked against its name: inside the manifest's folder, a
    regular file opened without blocking (a planted FIFO or symlink is refused, never waited on)."""
    from .cache.entry import CorruptEntry
    from .cache.paths import is_within
    from .cache.store import read_regular_file

    name = f"{OBJECTS_DIR}/{digest[:12]}{suffix}"
    if re.fullmatch(r"[0-9a-f]{64}", digest) is None:
        raise ValueError(f"{digest[:80]!r} does not name a file of {OBJECTS_DIR}/ (a sha256 does)")
    path = os.path.join(objects_dir(manifest), digest + suffix)
    if not is_within(path, os.path.dirname(os.path.abspath(manifest))):
        raise ValueError(f"{name} resolves outside the manifest's folder; collect again")
    try:
        data = read_regular_file(path)
    except CorruptEntry as e:
        raise ValueError(f"{name} cannot be used ({e}); collect again") from None
    if hashlib.sha256(data).hexdigest() != digest:
        raise ValueError(f"{OBJECTS_DIR}/{digest[:12]}{suffix} is damaged (checksum mismatch); collect again")
    return data


def add_records(path: str, records: list[Recorded]) -> None:
    """Merge ``records`` into manifest ``path`` (created if absent), under a lock: ranks collect together."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with filelock.FileLock(path + ".lock"):
        graphs = read_manifest(path)
        for r in records:
            graphs[r.key] = r
        doc = {"format": MANIFEST_FORMAT, "graphs": {k: graphs[k].to_json() for k in sorted(graphs)}}
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


# -------------------------------------------------------------------------------------------- collect
def graph_source(gm: torch.fx.GraphModule) -> str:
    """The user's source line of a graph: its first node's frame outside torch and model libraries."""
    fallback = None
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        frame = user_frame(node)
        if frame is not None:
            return f"{frame[0]}:{frame[1]}"
        fallback = fallback or module_path(node)
    return fallback or "<unknown source line>"


class Recorder:
    """The ``CACHE.observers`` entry of a collecting process: records each new graph as the neuron target
    with the run's options would key and lower it."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def __call__(self, gm: Any, example_inputs: list[Any], opts: Options, artifact: Artifact, digest: str) -> None:
        if not opts.precompile_manifest:
            return
        from .cache.key import NotCacheable, cache_key

        neuron = dataclasses.replace(opts, target="neuron", precompile_manifest=None)
        try:
            key = cache_key(gm, example_inputs, neuron)
        except NotCacheable as e:
            log.info("neuron precompile: %s not recorded: not cacheable (%s)", artifact.name, e)
            return
        with self._lock:
            if (opts.precompile_manifest, key.digest) in self._seen:
                return
            self._seen.add((opts.precompile_manifest, key.digest))
        record = Recorded(key.digest, key.summary, artifact.name, graph_source(gm), list(key.summary["inputs"]))
        try:
            record = self._lower(gm, example_inputs, neuron, record, opts.precompile_manifest)
        except Exception as e:
            record.error = f"{type(e).__name__}: {e}"[:4000]
            log.warning("neuron precompile: %s (%s) could not be lowered for the neuron target: %s",
                        record.name, record.source, record.error.splitlines()[0])  # fmt: skip
        add_records(opts.precompile_manifest, [record])
        log.info("neuron precompile: recorded %s %s (%s)", key.digest[:12], record.name, record.source)

    @staticmethod
    def _lower(gm: Any, example_inputs: list[Any], neuron: Options, record: Recorded, manifest: str) -> Recorded:
        from .cache import entry as E
        from .compiler import build_artifact

        pending = build_artifact(gm, example_inputs, neuron, record.name, compile=False)
        meta, module, _ = E.encode(pending, record.key, record.summary)
        record.module = _write_object(manifest, module, ".mlir")
        record.plan = _write_object(manifest, meta, ".json")
        record.num_ops = pending.num_ops
        record.lower_seconds = pending.lower_seconds
        return record


_RECORDER: Recorder | None = None


def start_collecting() -> None:
    """Install the recorder in this process (once), and turn AOTAutograd's cache off: its hits would never
    reach the compiler, so those graphs would go unrecorded."""
    global _RECORDER
    if _RECORDER is not None:
        return
    from .cache import CACHE

    torch._functorch.config.enable_autograd_cache = False
    _RECORDER = Recorder()
    CACHE.observers.append(_RECORDER)


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
    "Recorded", "Recorder", "CompileResult", "Coverage", "Failure", "ManifestError", "MANIFEST_SCHEMA", "add_records",
    "check_manifest", "check_manifest_document", "collect", "compile_manifest", "explain_key", "read_manifest",
    "resolve", "shard_of", "start_collecting",
]  # fmt: skip
