"""What the simulated NeuronCore computes: ``execute(neff, inputs) -> outputs``, called by libnrt_sim.c.

It reads the simulator's NEFF (header, tensor table, payload), compiles the payload's
``module.sim.mlir`` (the module with its custom calls replaced by their semantics) with the package's CPU
path (``neuron_compile.runtime.jax_adapter``), and runs it: the module's parameters are exactly
``input0 .. inputN-1`` in order, its results ``output0 ..``. Executables are cached per NEFF (sha256).

A module with collectives (``stablehlo.all_reduce`` and friends) runs as devices of one job would run it: cut
at its collectives into single-device stages that XLA CPU runs, with each collective performed between them
by this process with the other ranks through ``torch.distributed`` (``collectives.py``).
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import struct
import tarfile
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

NEFF_MAGIC = b"NRTSIMNEFF\0\0"
NEFF_HEADER_SIZE = 1024
_HEADER = struct.Struct("<12sIIIQQQQ")


@dataclass(frozen=True)
class Neff:
    version: int
    lnc: int
    table: list[dict[str, Any]]  # the ASCII table: usage, name, size, nrt_dtype, shape
    files: dict[str, bytes]  # the payload's files

    def tensors(self, usage: str) -> list[dict[str, Any]]:
        """The payload's tensor records (with MLIR element types) of ``usage`` ("in"/"out"), in order."""
        records = json.loads(self.files["sg00/def.json"])["tensors"]
        return [t for t in records if t["usage"] == usage]


def read_neff(neff: bytes) -> Neff:
    """Parse the simulator's NEFF (ValueError when it is not one)."""
    if len(neff) < NEFF_HEADER_SIZE:
        raise ValueError(f"a NEFF of {len(neff)} bytes is truncated")
    magic, version, lnc, _, t_off, t_size, p_off, p_size = _HEADER.unpack_from(neff)
    if magic != NEFF_MAGIC:
        raise ValueError("not a NEFF of the device simulator (bad magic)")
    if t_off + t_size > len(neff) or p_off + p_size > len(neff):
        raise ValueError("NEFF sections lie outside the file")
    table = []
    for line in neff[t_off : t_off + t_size].decode().splitlines():
        usage, name, size, dtype, ndim, *dims = line.split()
        table.append({"usage": usage, "name": name, "size": int(size), "nrt_dtype": int(dtype),
                      "shape": [int(d) for d in dims][: int(ndim)]})  # fmt: skip
    files = {}
    with tarfile.open(fileobj=io.BytesIO(neff[p_off : p_off + p_size]), mode="r:gz") as tar:
        for member in tar.getmembers():
            f = tar.extractfile(member)
            if f is not None:
                files[member.name] = f.read()
    return Neff(version=version, lnc=lnc, table=table, files=files)


def numpy_dtype(element_type: str) -> np.dtype:
    """The numpy dtype of an MLIR element type (ml_dtypes for bfloat16 and float8)."""
    import ml_dtypes

    return np.dtype({
        "f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "f64": np.float64, "i1": np.bool_,
        "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64, "ui8": np.uint8, "ui16": np.uint16,
        "ui32": np.uint32, "ui64": np.uint64, "f8E4M3": ml_dtypes.float8_e4m3, "f8E4M3FN": ml_dtypes.float8_e4m3fn,
        "f8E5M2": ml_dtypes.float8_e5m2, "f8E3M4": ml_dtypes.float8_e3m4,
    }[element_type])  # fmt: skip


_TORCH_DTYPES = {
    "f32": "float32", "f16": "float16", "bf16": "bfloat16", "f64": "float64", "i1": "bool", "i8": "int8",
    "i16": "int16", "i32": "int32", "i64": "int64", "ui8": "uint8", "ui16": "uint16", "ui32": "uint32",
    "ui64": "uint64", "f8E4M3FN": "float8_e4m3fn", "f8E5M2": "float8_e5m2",
}  # fmt: skip


def _device_buffer(data: bytes, record: dict[str, Any]) -> tuple[Any, Any]:
    """(buffer on the package's XLA CPU client, the host object it borrows) for one input's bytes."""
    import jax
    import torch

    from neuron_compile.runtime import jax_adapter

    shape = tuple(record["shape"])
    host = np.frombuffer(data, dtype=np.uint8).copy()  # owned and writable
    name = _TORCH_DTYPES.get(record["element_type"])
    if name is not None:  # shared with a torch tensor through DLPack, as the package's own executor does
        t = torch.from_numpy(host).view(getattr(torch, name)).reshape(shape)
        return jax_adapter.torch_to_device(t), t
    # float8 kinds torch lacks (e4m3, e3m4): a copy placed on the same client's device.
    array = host.view(numpy_dtype(record["element_type"])).reshape(shape)
    return jax.device_put(array, jax_adapter.cpu_device()), array


@dataclass(frozen=True)
class _Staged:
    """A module with collectives: its stages' executables (None: nothing to run) and the plan (collectives.Plan)."""

    plan: Any
    executables: list[Any]


_EXECUTABLES: collections.OrderedDict[str, tuple[Any, Neff]] = collections.OrderedDict()
_LOCK = threading.Lock()
_CACHE_SIZE = 64


def _executable(neff: bytes) -> tuple[Any, Neff]:
    from neuron_compile.runtime import jax_adapter

    key = hashlib.sha256(neff).hexdigest()
    with _LOCK:
        hit = _EXECUTABLES.get(key)
        if hit is not None:
            _EXECUTABLES.move_to_end(key)
            return hit
    from . import collectives

    parsed = read_neff(neff)
    text = parsed.files["module.sim.mlir"].decode()
    if any(op in text for op in collectives.OPS):
        plan = collectives.split(text)
        executable: Any = _Staged(plan, [
            None if stage.text is None else jax_adapter.compile_stablehlo(stage.text, ()) for stage in plan.stages
        ])  # fmt: skip
    else:
        executable = jax_adapter.compile_stablehlo(text, ())
    with _LOCK:
        _EXECUTABLES[key] = (executable, parsed)
        while len(_EXECUTABLES) > _CACHE_SIZE:
            _EXECUTABLES.popitem(last=False)
    return executable, parsed


def execute(neff: bytes, inputs: dict[str, bytes]) -> dict[str, bytes]:
    """Run the NEFF on ``inputs`` (``{"input0": bytes, ...}``); ``{"output0": bytes, ...}`` in C order."""
    from neuron_compile.runtime import jax_adapter

    executable, parsed = _executable(neff)
    ins, outs = parsed.tensors("in"), parsed.tensors("out")
    missing = [t["name"] for t in ins if t["name"] not in inputs]
    if missing:
        raise KeyError(f"the NEFF's inputs {missing} were not given")
    buffers, keep = [], []
    for record in ins:
        data = inputs[record["name"]]
        if len(data) != record["size"]:
            raise ValueError(f"{record['name']}: {len(data)} bytes, the NEFF's tensor has {record['size']}")
        buffer, host = _device_buffer(data, record)
        buffers.append(buffer)
        keep.append(host)
    if isinstance(executable, _Staged):
        results = _run_staged(executable, buffers)
    else:
        results = jax_adapter.execute(executable, buffers)
    if len(results) != len(outs):
        raise RuntimeError(f"the module gave {len(results)} results, the NEFF has {len(outs)} outputs")
    out = {}
    for record, value in zip(outs, results):
        array = np.ascontiguousarray(np.asarray(value))
        if array.ndim == 1 and array.shape == (1,) and record["shape"] == []:
            array = array.reshape(())  # this client's 0-d results come back as one-element arrays
        if array.dtype != numpy_dtype(record["element_type"]) or list(array.shape) != record["shape"]:
            raise RuntimeError(f"{record['name']}: computed {array.dtype}{list(array.shape)}, the NEFF says "
                               f"{record['element_type']}{record['shape']}")  # fmt: skip
        out[record["name"]] = array.tobytes()
    del keep
    return out


def _host(value: Any, shape: tuple[int, ...], element_type: str) -> np.ndarray:
    """A buffer's values as a numpy array of the module's shape (0-d results come back as (1,) arrays)."""
    return np.asarray(value).reshape(shape).astype(numpy_dtype(element_type), copy=False)


def _run_staged(staged: _Staged, buffers: list[Any]) -> list[Any]:
    """Run the stages in order, each collective between them with the other ranks (``collectives.run``)."""
    import jax

    from neuron_compile.runtime import jax_adapter

    from . import collectives

    plan = staged.plan
    values: dict[Any, Any] = {("arg", i): b for i, b in enumerate(buffers)}
    results: list[Any] = []
    for k, (stage, executable) in enumerate(zip(plan.stages, staged.executables)):
        if executable is not None:
            args = []
            for key in stage.params:
                value, (shape, _) = values[key], plan.types[key]
                if tuple(value.shape) != shape:  # a 0-d result of an earlier stage, as a (1,) array
                    value = jax.device_put(_host(value, *plan.types[key]), jax_adapter.cpu_device())
                args.append(value)
            results = jax_adapter.execute(executable, args)
            values.update(zip(stage.results, results))
        if k < len(plan.collectives):
            c = plan.collectives[k]
            out = collectives.run(c, [_host(values[key], *plan.types[key]) for key in c.operands])
            for key, array in zip(c.results, out):
                values[key] = jax.device_put(array, jax_adapter.cpu_device())
    return results
