"""Where the device's bytes live, per target: the only code of the device that differs between them.

Each backend makes buffers (uninitialized, or from host bytes), reads them back to the host, hands a byte
range of one to an executable as its parameter of a shape and dtype, turns an executable's result into a
buffer, runs an executable on such parameters, and frees a buffer. Every byte that crosses the host boundary
is counted here (``STATS.host_to_device_bytes`` / ``device_to_host_bytes``).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from ..errors import NeuronRuntimeError
from ..stats import STATS


class _VncMemoryStats(ctypes.Structure):
    """``nrt_vnc_memory_stats_t`` (nrt.h): fields are only ever added at its end."""

    _fields_ = [("bytes_used", ctypes.c_size_t), ("bytes_limit", ctypes.c_size_t)]


class CpuBuffers:
    """The CPU target: XLA CPU's device memory is host memory, so a buffer is a flat uint8 torch tensor that
    jax reads and writes through DLPack (no copies); copies to and from the "host" are counted as if they
    crossed, so that the CPU target reports what the neuron target would move."""

    name = "cpu"

    def __init__(self, target: Any) -> None:
        self.target = target

    def allocate(self, nbytes: int, index: int) -> Any:
        return torch.empty(nbytes, dtype=torch.uint8)

    def from_host(self, data: torch.Tensor, index: int) -> Any:
        payload = _bytes_of(data).clone()
        STATS.record_transfer(host_to_device=payload.numel())
        return payload

    def to_host(self, payload: Any, offset: int, nbytes: int) -> torch.Tensor:
        STATS.record_transfer(device_to_host=nbytes)
        return payload[offset : offset + nbytes].clone()

    def parameter(self, buffer: Any, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> Any | None:
        """The executable's parameter for these bytes of ``buffer`` (a DeviceBuffer), or None when they cannot be
        handed over as they lie (XLA takes only aligned buffers: the caller gathers them into a new buffer)."""
        from ..runtime import jax_adapter

        payload = buffer.payload
        nbytes = _nbytes(shape, dtype)
        if (payload.data_ptr() + offset) % 64:
            return None
        return jax_adapter.torch_to_device(payload[offset : offset + nbytes].view(dtype).view(shape))

    def result(self, result: Any, k: int, executable: Any) -> tuple[Any, int, tuple[int, ...], torch.dtype]:
        """(payload, nbytes, shape, dtype) of the executable's result number ``k``."""
        t = self.target.to_torch(result)
        flat = _bytes_of(t)
        return flat, flat.numel(), tuple(t.shape), t.dtype

    def run(self, executable: Any, parameters: list[Any]) -> list[Any]:
        return self.target.run(executable, parameters)

    def free(self, payload: Any) -> None:
        pass

    def memory_stats(self, index: int) -> tuple[int, int] | None:
        """No runtime to ask: the device's own count (``storage.py``) is the only one."""
        return None


class NeuronBuffers:
    """The neuron target: a buffer is an nrt tensor on the process's logical NeuronCore."""

    name = "neuron"

    def __init__(self, target: Any) -> None:
        self.target = target

    def allocate(self, nbytes: int, index: int) -> Any:
        return self._allocate(nbytes, index)

    def from_host(self, data: torch.Tensor, index: int) -> Any:
        from ..runtime import libnrt

        flat = _bytes_of(data)
        handle = self._allocate(flat.numel(), index)
        if flat.numel():
            libnrt.tensor_write(handle, flat)
        return handle

    def _allocate(self, nbytes: int, index: int) -> Any:
        from ..runtime import libnrt

        try:
            return libnrt.tensor_allocate(self._vnc(index), max(nbytes, 1))
        except NeuronRuntimeError as e:
            raise self._out_of_memory(e, nbytes, index) from e

    def _out_of_memory(self, error: NeuronRuntimeError, nbytes: int, index: int) -> Exception:
        """The runtime's NRT_RESOURCE as the device's out-of-memory error, with the runtime's own figures."""
        from ..runtime import libnrt
        from .storage import NeuronOutOfMemoryError

        if libnrt.status_name(error.status) != "NRT_RESOURCE":
            return error

        stats = self.memory_stats(index)
        used, limit = stats if stats is not None else (None, None)
        figures = f" with {used:,} bytes in use and a limit of {limit:,} bytes" if stats is not None else ""
        return NeuronOutOfMemoryError(
            f"neuron device: out of memory on neuron:{index}: the Neuron runtime could not allocate {nbytes:,} "
            f"bytes on NeuronCore {self._vnc(index)}{figures} (nrt_get_vnc_memory_stats; the runtime's memory "
            "also holds loaded graphs and their buffers). Free tensors (del, or move them to CPU), use a smaller "
            "batch, or unload other work from the core."
        )

    def memory_stats(self, index: int) -> tuple[int, int] | None:
        """(bytes in use, limit) of the logical core as the runtime reports them (``nrt_get_vnc_memory_stats``,
        nrt.h), or None for a runtime without that call."""
        from ..runtime import libnrt

        fn = getattr(libnrt.runtime().lib, "nrt_get_vnc_memory_stats", None)
        if fn is None:
            return None
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.c_uint32,
            ctypes.POINTER(_VncMemoryStats),
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_size_t),
        ]
        stats, written = _VncMemoryStats(), ctypes.c_size_t()
        libnrt.check(
            fn(self._vnc(index), ctypes.byref(stats), ctypes.sizeof(stats), ctypes.byref(written)),
            "nrt_get_vnc_memory_stats",
        )
        return int(stats.bytes_used), int(stats.bytes_limit)

    def to_host(self, payload: Any, offset: int, nbytes: int) -> torch.Tensor:
        from ..runtime import libnrt

        return libnrt.tensor_read(payload, nbytes, offset) if nbytes else torch.empty(0, dtype=torch.uint8)

    def parameter(self, buffer: Any, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> Any | None:
        # A NEFF's parameter is bound as a whole nrt tensor of its exact size: a byte range of a larger one is
        # gathered into its own buffer first.
        return buffer.payload if offset == 0 and _nbytes(shape, dtype) == buffer.nbytes else None

    def result(self, result: Any, k: int, executable: Any) -> tuple[Any, int, tuple[int, ...], torch.dtype]:
        handle, nbytes = result
        shape, dtype = executable.results[k]
        return handle, nbytes, tuple(shape), dtype

    def run(self, executable: Any, parameters: list[Any]) -> list[Any]:
        from ..runtime import libnrt

        model = executable.model(self.target.core)
        try:
            handles = libnrt.execute_on_device(model, parameters)
        except NeuronRuntimeError as e:  # its outputs did not fit
            raise self._out_of_memory(e, sum(spec.size for spec in model._by_usage[1]), 0) from e
        return list(zip(handles, (spec.size for spec in model._by_usage[1])))

    def free(self, payload: Any) -> None:
        from ..runtime import libnrt

        libnrt.tensor_free(payload)

    def _vnc(self, index: int) -> int:
        return self.target.core + index


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous CPU tensor ``t`` as a flat uint8 tensor sharing its memory."""
    t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(-1).view(torch.uint8)


def buffers_for(target: Any) -> CpuBuffers | NeuronBuffers:
    return NeuronBuffers(target) if target.name == "neuron" else CpuBuffers(target)
