"""How one cache entry is encoded: JSON metadata (with checksums) + the StableHLO text + executable bytes.

Nothing here unpickles: metadata is JSON, and the payload checksum and every file's sha256 are checked
before any field of the metadata is used to build an ``Artifact``.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from typing import Any

import torch

from ..artifact import Artifact, OutputSpec, TensorSpec

ENTRY_FORMAT = 1
MODULE_FILE = "module.mlir"
EXECUTABLE_FILE = "executable.bin"
META_FILE = "meta.json"
_BLOB_MAGIC = b"NCCE"


class CorruptEntry(Exception):
    """An entry failed its integrity check (truncated, flipped bytes, wrong key, undecodable)."""


class NotSerializable(Exception):
    """The artifact's input/output plan holds a value JSON cannot carry exactly."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptEntry(f"unknown dtype {name!r}")
    return dtype


def _encode_value(v: Any) -> Any:
    if isinstance(v, TensorSpec):
        layout = [] if v.perm is None else [list(v.perm)]
        return {"tensor": [list(v.shape), str(v.dtype).replace("torch.", ""), *layout]}
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return {"int": v}
    if isinstance(v, float):
        return {"float": v.hex()}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).replace("torch.", "")}
    if isinstance(v, (list, tuple)):
        return {type(v).__name__: [_encode_value(x) for x in v]}
    raise NotSerializable(f"cannot store a {type(v).__name__} in a cache entry")


def _decode_value(v: Any) -> Any:
    if v is None or isinstance(v, (bool, str)):
        return v
    if not isinstance(v, dict) or len(v) != 1:
        raise CorruptEntry(f"bad value {v!r}")
    ((tag, x),) = v.items()
    if tag == "tensor":
        perm = tuple(int(d) for d in x[2]) if len(x) > 2 else None
        return TensorSpec(tuple(int(s) for s in x[0]), _dtype_from_name(x[1]), perm)
    if tag == "int":
        return int(x)
    if tag == "float":
        return float.fromhex(x)
    if tag == "dtype":
        return _dtype_from_name(x)
    if tag in ("list", "tuple"):
        seq = [_decode_value(e) for e in x]
        return seq if tag == "list" else tuple(seq)
    raise CorruptEntry(f"bad value tag {tag!r}")


def _encode_output(o: OutputSpec) -> dict[str, Any]:
    return {
        "kind": o.kind,
        "index": o.index,
        "value": _encode_value(o.value),
        "spec": _encode_value(o.spec),
        "duplicate_of": o.duplicate_of,
        "stride": None if o.stride is None else list(o.stride),
        "storage_offset": o.storage_offset,
        "input_stride": None if o.input_stride is None else list(o.input_stride),
    }


def _decode_output(d: dict[str, Any]) -> OutputSpec:
    return OutputSpec(
        kind=d["kind"],
        index=int(d["index"]),
        value=_decode_value(d["value"]),
        spec=_decode_value(d["spec"]),
        duplicate_of=d["duplicate_of"],
        stride=None if d.get("stride") is None else tuple(int(s) for s in d["stride"]),
        storage_offset=int(d.get("storage_offset", 0)),
        input_stride=None if d.get("input_stride") is None else tuple(int(s) for s in d["input_stride"]),
    )


def encode(artifact: Artifact, key: str, summary: dict[str, Any]) -> tuple[bytes, bytes, bytes]:
    """(meta.json, module.mlir, executable.bin) bytes of an entry."""
    module = artifact.stablehlo.encode()
    executable = bytes(artifact.executable)
    payload = {
        "format": ENTRY_FORMAT,
        "key": key,
        "name": artifact.name,
        "created": time.time(),
        "lower_seconds": artifact.lower_seconds,
        "compile_seconds": artifact.compile_seconds,
        "num_ops": artifact.num_ops,
        "nki_kernels": artifact.nki_kernels,
        "target_version": artifact.target_version,
        "downcast_float64": artifact.downcast_float64,
        "needs_rng_seed": artifact.needs_rng_seed,
        "warnings": [list(w) for w in artifact.warnings],
        "inputs": [_encode_value(v) for v in artifact.inputs],
        "outputs": [_encode_output(o) for o in artifact.outputs],
        "files": {
            MODULE_FILE: {"size": len(module), "sha256": sha256(module)},
            EXECUTABLE_FILE: {"size": len(executable), "sha256": sha256(executable)},
        },
        "key_summary": summary,
    }
    body = json.dumps(payload, sort_keys=True)
    meta = json.dumps({"payload": payload, "sha256": sha256(body.encode())}, sort_keys=True, indent=1)
    return meta.encode(), module, executable


def verify_meta(meta: bytes, key: str | None) -> dict[str, Any]:
    """The checked payload of a meta.json; raises ``CorruptEntry``."""
    try:
        doc = json.loads(meta.decode())
        payload = doc["payload"]
        ok = sha256(json.dumps(payload, sort_keys=True).encode()) == doc["sha256"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CorruptEntry(f"unreadable metadata ({type(e).__name__})") from None
    if not ok:
        raise CorruptEntry("metadata checksum mismatch")
    if payload.get("format") != ENTRY_FORMAT:
        raise CorruptEntry(f"entry format {payload.get('format')} (expected {ENTRY_FORMAT})")
    if key is not None and payload.get("key") != key:
        raise CorruptEntry("entry is stored under the wrong key")
    return payload


def verify_file(payload: dict[str, Any], name: str, data: bytes) -> None:
    want = payload["files"][name]
    if len(data) != want["size"]:
        raise CorruptEntry(f"{name} is {len(data)} bytes, expected {want['size']} (truncated?)")
    if sha256(data) != want["sha256"]:
        raise CorruptEntry(f"{name} checksum mismatch")


def decode(payload: dict[str, Any], module: bytes, executable: bytes) -> Artifact:
    """An ``Artifact`` (without a loaded executable) from verified parts."""
    verify_file(payload, MODULE_FILE, module)
    verify_file(payload, EXECUTABLE_FILE, executable)
    try:
        return Artifact(
            name=str(payload["name"]),
            stablehlo=module.decode(),
            executable=executable,
            inputs=[_decode_value(v) for v in payload["inputs"]],
            outputs=[_decode_output(o) for o in payload["outputs"]],
            downcast_float64=bool(payload["downcast_float64"]),
            needs_rng_seed=bool(payload["needs_rng_seed"]),
            num_ops=int(payload["num_ops"]),
            nki_kernels=int(payload.get("nki_kernels", 0)),
            lower_seconds=float(payload["lower_seconds"]),
            compile_seconds=float(payload["compile_seconds"]),
            target_version=str(payload["target_version"]),
            warnings=[(str(c), str(m)) for c, m in payload["warnings"]],
        )
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CorruptEntry(f"undecodable metadata ({type(e).__name__}: {e})") from None


def pack(meta: bytes, module: bytes, executable: bytes) -> bytes:
    """One blob for PyTorch's mega-cache: magic, three lengths, three parts."""
    return _BLOB_MAGIC + struct.pack("<QQQ", len(meta), len(module), len(executable)) + meta + module + executable


def unpack(blob: bytes) -> tuple[bytes, bytes, bytes]:
    head = len(_BLOB_MAGIC) + 24
    if len(blob) < head or blob[: len(_BLOB_MAGIC)] != _BLOB_MAGIC:
        raise CorruptEntry("not a neuron_compile cache blob")
    a, b, c = struct.unpack("<QQQ", blob[len(_BLOB_MAGIC) : head])
    if head + a + b + c != len(blob):
        raise CorruptEntry("cache blob has the wrong length")
    return blob[head : head + a], blob[head + a : head + a + b], blob[head + a + b :]
