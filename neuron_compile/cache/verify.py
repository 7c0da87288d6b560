"""Does a deserialized executable fit the entry's own input/output plan?

Checksums prove that an entry's files are the ones written together, not that the executable belongs to
the metadata: an executable swapped in from another entry (checksums recomputed) would load fine and then
fail at run time (``RuntimeProgramInputMismatch``) or return wrong shapes. So at load, the executable's
parameter and result shapes/dtypes are compared with what the runtime will feed it (the entry's tensor
inputs plus the int32[2] RNG seed) and what the plan reads back; a mismatch is a corrupt entry (a warned
miss that recompiles).

The signature is read from XLA's ``entry_computation_layout`` where the executable exposes its HLO module
(the CPU target); a target that does not (neuronx-cc NEFFs) is not checked here.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..artifact import Artifact, TensorSpec
from .entry import CorruptEntry

_LAYOUT = re.compile(r"entry_computation_layout=\{\((.*)\)->(.*)\}")
_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HLO_DTYPE = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int8: "s8", torch.int16: "s16", torch.int32: "s32", torch.int64: "s64",
    torch.uint8: "u8", torch.uint16: "u16", torch.uint32: "u32", torch.uint64: "u64",
    torch.bool: "pred", torch.complex64: "c64", torch.complex128: "c128",
    torch.float8_e4m3fn: "f8e4m3fn", torch.float8_e5m2: "f8e5m2",
}  # fmt: skip
#: The runtime computes float64 as float32 (``downcast_float64``) and casts back on the way out.
_NARROWED = {"f64": "f32", "c128": "c64", "s64": "s32", "u64": "u32"}

Shape = tuple[str, tuple[int, ...]]


def executable_signature(loaded: Any) -> tuple[list[Shape], list[Shape]] | None:
    """(parameters, results) as (HLO dtype, dims), or None when the executable does not say."""
    try:
        header = loaded.hlo_modules()[0].to_string().split("\n", 1)[0]
    except Exception:
        return None
    m = _LAYOUT.search(header)
    if m is None:
        return None

    def shapes(text: str) -> list[Shape]:
        return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _SHAPE.findall(text)]

    return shapes(m.group(1)), shapes(m.group(2))


def _fits(spec: TensorSpec, shape: Shape) -> bool:
    dtype, dims = shape
    if spec.dtype.is_complex:  # carried as (real, imag) float32 pairs (lowering/complex_pairs.py)
        return dtype == "f32" and dims == tuple(spec.shape) + (2,)
    want = _HLO_DTYPE.get(spec.dtype)
    dtype_ok = want is None or dtype in (want, _NARROWED.get(want))
    return dtype_ok and dims == tuple(spec.shape)


def _describe(spec: TensorSpec) -> str:
    return f"{str(spec.dtype).replace('torch.', '')}{list(spec.shape)}"


def check_executable(artifact: Artifact) -> None:
    """Raise ``CorruptEntry`` when ``artifact.loaded`` cannot run ``artifact``'s plan."""
    signature = executable_signature(artifact.loaded)
    if signature is None:
        return
    params, results = signature
    tensor_inputs = [s for s in artifact.inputs if isinstance(s, TensorSpec)]
    if len(params) != len(tensor_inputs) + 1:
        raise CorruptEntry(
            f"the executable takes {len(params)} parameters, the entry feeds {len(tensor_inputs)} tensors + a seed"
        )
    for i, (spec, shape) in enumerate(zip(tensor_inputs, params)):
        if not _fits(TensorSpec(spec.device_shape, spec.dtype), shape):
            raise CorruptEntry(
                f"executable parameter {i} is {shape[0]}{list(shape[1])}, the entry feeds {_describe(spec)}"
            )
    if params[-1] != ("s32", (2,)):
        raise CorruptEntry(f"the executable's last parameter is {params[-1]}, not the int32[2] RNG seed")
    for out in artifact.outputs:
        kind = getattr(out, "kind", None)
        if kind == "input":
            given = artifact.inputs[out.index] if 0 <= out.index < len(artifact.inputs) else None
            if not isinstance(given, TensorSpec) or given.dtype != out.spec.dtype:
                raise CorruptEntry(f"an output aliases graph input {out.index}, which is {given!r}")
            continue
        if kind != "tensor":
            continue
        if not 0 <= out.index < len(results):
            raise CorruptEntry(f"the entry reads result {out.index}; the executable has {len(results)} results")
        spec, got = out.spec, results[out.index]
        if not isinstance(spec, TensorSpec):
            continue
        stride = getattr(out, "stride", None)
        if stride is None:
            ok = _fits(spec, got)
        else:  # a view into the result buffer (aliasing outputs): the buffer must hold the whole view
            dims = got[1][:-1] if spec.dtype.is_complex else got[1]  # a complex buffer: pairs, (real, imag) last
            ok = _fits(TensorSpec(dims, spec.dtype), got) and _numel(dims) >= _extent(spec.shape, stride, out)
        if not ok:
            raise CorruptEntry(
                f"executable result {out.index} is {got[0]}{list(got[1])}, the entry expects {_describe(spec)}"
            )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _extent(shape: tuple[int, ...], stride: tuple[int, ...], out: Any) -> int:
    """Elements a strided view needs in its buffer (0 for an empty view)."""
    if any(d == 0 for d in shape):
        return 0
    return int(getattr(out, "storage_offset", 0)) + sum((d - 1) * s for d, s in zip(shape, stride)) + 1
