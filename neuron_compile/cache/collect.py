"""What ``neuron-compile precompile collect`` records: the manifest (its format, schema, reads and merges, its
content-addressed files) and the recorder, a ``CACHE.observers`` entry that keys and lowers each graph a run
looks up as the neuron target would. The command (run a script with collection on, then compile and check
what it recorded) is ``neuron_compile/precompile.py``; the backend installs the recorder
(``start_collecting``) when the option ``precompile_manifest`` is set.

A manifest is input like any file a user hands over: every read is checked against ``MANIFEST_SCHEMA`` (a
JSON Schema, checked with ``jsonschema``) and a bad one raises ``ManifestError``, one line per problem naming
the file and the field. Its modules are named by their sha256 only, so no path can be smuggled in; they are
read from ``modules/`` beside it as regular files, opened without blocking (``store.read_regular_file``),
inside the manifest's folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

import filelock
import torch

from ..artifact import Artifact
from ..options import GENERATIONS, LNC_SIZES, OPT_LEVELS, Options
from ..provenance import module_path, user_frame

log = logging.getLogger("neuron_compile.precompile")

#: ``compiler.build_artifact``: (gm, example_inputs, options, name, compile=False) -> the lowered Artifact.
Lower = Callable[..., Artifact]

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
    from .entry import CorruptEntry
    from .store import read_regular_file

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


def write_object(manifest: str, data: bytes, suffix: str) -> str:
    """Store ``data`` in the manifest's folder under its sha256 (with ``suffix``); the digest."""
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
    from .entry import CorruptEntry
    from .paths import is_within
    from .store import read_regular_file

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

    def __init__(self, lower: Lower) -> None:
        self._lower_graph = lower
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def __call__(self, gm: Any, example_inputs: list[Any], opts: Options, artifact: Artifact, digest: str) -> None:
        if not opts.precompile_manifest:
            return
        from .key import NotCacheable, cache_key

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

    def _lower(self, gm: Any, example_inputs: list[Any], neuron: Options, record: Recorded, manifest: str) -> Recorded:
        from . import entry as E

        pending = self._lower_graph(gm, example_inputs, neuron, record.name, compile=False)
        meta, module, _ = E.encode(pending, record.key, record.summary)
        record.module = write_object(manifest, module, ".mlir")
        record.plan = write_object(manifest, meta, ".json")
        record.num_ops = pending.num_ops
        record.lower_seconds = pending.lower_seconds
        return record


_RECORDER: Recorder | None = None


def start_collecting(lower: Lower) -> None:
    """Install the recorder in this process (once), and turn AOTAutograd's cache off: its hits would never
    reach the compiler, so those graphs would go unrecorded. ``lower``: ``compiler.build_artifact`` (the
    backend passes it: the compiler imports the cache, so the cache does not import the compiler)."""
    global _RECORDER
    if _RECORDER is not None:
        return
    from .compile_cache import CACHE

    torch._functorch.config.enable_autograd_cache = False
    _RECORDER = Recorder(lower)
    CACHE.observers.append(_RECORDER)
