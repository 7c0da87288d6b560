"""The memory of the ``neuron`` device: what a neuron tensor's storage holds, on either target.

A torch storage of the device carries one :class:`DeviceStorage` (an attribute of its Python object, which
torch keeps alive exactly as long as the storage itself, views and C++-made aliases included). It holds one
:class:`DeviceBuffer`: bytes on the device, **never written after they are made**. Every write (an in-place op,
``copy_``, a graph's mutated input) makes a new buffer and swaps it in, so a copy of a whole tensor shares its
source's buffer (copy on write), a graph running on a buffer never sees it change, and no write needs to
know who else reads it.

The bytes live where the target keeps its data: on the neuron target in an nrt tensor on the process's
NeuronCore (``nrt_tensor_allocate``), on the CPU target in host memory that XLA CPU reads and writes in place
of device memory (shared with jax through DLPack, no copies). Everything else (views, graphs, eager ops,
counters, the memory limit) is the same code on both.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import NeuronCompileError
from ..options import human_size
from ..stats import STATS

#: The dispatch keys whose kernels set a tensor's storage and geometry without touching data.
_META = torch._C.DispatchKeySet(torch._C.DispatchKey.Meta)
_NON_FUNCTIONAL = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutogradNonFunctional)
#: Fake device addresses: unique per storage for the life of the process (libraries tell tensors apart by
#: ``data_ptr()``, e.g. transformers' tied-weight check), far from any host mapping, never dereferenced.
_ADDRESS_BASE = 1 << 52
#: Where the addresses of storages torch makes through the device's C++ allocator start (``_native.cpp``).
TORCH_MADE_BASE = 1 << 53
#: ``ALLOCATE[0](nbytes, index)``: a new DeviceBuffer on the device (``context.Device.allocate``, set by context).
ALLOCATE: list[Any] = [None]
_ADDRESS_ALIGN = 512


class NeuronOutOfMemoryError(NeuronCompileError, MemoryError):
    """An allocation past the NeuronCore's memory (``torch.neuron.OutOfMemoryError``; as CUDA's, a RuntimeError)."""


@dataclass
class _Accounting:
    """Bytes of live device buffers on one logical core, and the peak since the last reset."""

    allocated: int = 0
    peak: int = 0


_ACCOUNTS: dict[int, _Accounting] = {}
_ACCOUNT_LOCK = threading.Lock()


def account(index: int) -> _Accounting:
    with _ACCOUNT_LOCK:
        return _ACCOUNTS.setdefault(index, _Accounting())


class DeviceBuffer:
    """``nbytes`` on the device, written once when made; freed when the last storage holding it lets go.
    ``counted``: in ``memory_allocated()`` (every tensor's buffer; not the device's own constants)."""

    __slots__ = ("backend", "payload", "nbytes", "index", "counted", "__weakref__")

    def __init__(self, backend: Any, payload: Any, nbytes: int, index: int, counted: bool = True) -> None:
        self.backend = backend
        self.payload = payload
        self.nbytes = nbytes
        self.index = index
        self.counted = counted

    def __del__(self) -> None:
        try:
            if self.counted:
                acc = account(self.index)
                with _ACCOUNT_LOCK:
                    acc.allocated -= self.nbytes
            self.backend.free(self.payload)
        except Exception:  # at interpreter exit the runtime may be closed already: nothing left to free
            pass


def reserve(index: int, nbytes: int, limit: int) -> None:
    """Count ``nbytes`` more on core ``index``, or raise the out-of-memory error when past ``limit``."""
    acc = account(index)
    with _ACCOUNT_LOCK:
        if acc.allocated + nbytes > limit:
            raise NeuronOutOfMemoryError(
                f"neuron device: out of memory on neuron:{index}: tried to allocate {human_size(nbytes)} "
                f"({nbytes:,} bytes) with {human_size(acc.allocated)} ({acc.allocated:,} bytes) in use and a limit "
                f"of {human_size(limit)} ({limit:,} bytes). Free tensors (del, or move them to CPU), use a smaller "
                "batch, or set the limit (option device_memory_limit / NEURON_COMPILE_DEVICE_MEMORY_LIMIT) if the "
                "core has more memory."
            )
        acc.allocated += nbytes
        acc.peak = max(acc.peak, acc.allocated)


def release(index: int, nbytes: int) -> None:
    """Give back a reservation whose allocation failed."""
    acc = account(index)
    with _ACCOUNT_LOCK:
        acc.allocated -= nbytes


class Pending:
    """A value recorded by the lazy eager mode (``lazy.py``) and not computed yet: value ``number`` of
    ``recording``, the bytes of a whole storage as a flat tensor of ``numel`` elements of ``dtype``."""

    __slots__ = ("recording", "number", "dtype", "numel", "__weakref__")

    def __init__(self, recording: Any, number: int, dtype: torch.dtype, numel: int) -> None:
        self.recording = recording
        self.number = number
        self.dtype = dtype
        self.numel = numel


#: ``lazy.materialize``: computes the pending values (set when the lazy mode is first used).
MATERIALIZE: Any = None


class DeviceStorage:
    """What one torch storage of the device holds: its size and its current buffer.

    In the lazy eager mode the buffer may be a :class:`Pending` value: reading ``buffer`` (every reader of the
    device's bytes does: ``buffer_of``) first runs the recorded ops, so no reader ever sees a value not yet
    computed. ``raw_buffer`` looks without running anything (the recorder's own use)."""

    __slots__ = ("nbytes", "_buffer", "index", "address", "__weakref__")

    def __init__(self, nbytes: int, buffer: DeviceBuffer | Pending | None, index: int, address: int) -> None:
        self.nbytes = nbytes
        self.index = index
        self.address = address
        self._buffer = None
        self.buffer = buffer

    @property
    def buffer(self) -> DeviceBuffer | None:
        return buffer_of(self)

    @buffer.setter
    def buffer(self, value: DeviceBuffer | Pending | None) -> None:
        self._buffer = value
        if isinstance(value, Pending):
            value.recording.hold(self, value)


def buffer_of(st: DeviceStorage) -> DeviceBuffer | None:
    """``st``'s buffer, computed first when it is a pending value of the lazy mode: the ONE place where a
    recorded value becomes bytes on the device."""
    found = st._buffer
    if isinstance(found, Pending):
        MATERIALIZE(st)
        found = st._buffer
        if isinstance(found, Pending):
            raise NeuronCompileError("neuron device: a recorded value of the lazy eager mode was not computed")
    return found


def raw_buffer(st: DeviceStorage) -> DeviceBuffer | Pending | None:
    """``st``'s buffer or pending value, as it is (nothing runs)."""
    return st._buffer


def is_pending(t: torch.Tensor) -> bool:
    found = getattr(t.untyped_storage(), "_neuron", None)
    return found is not None and isinstance(found._buffer, Pending)


_address_lock = threading.Lock()
_address_cursor = [_ADDRESS_BASE]


def _fresh_address(nbytes: int) -> int:
    with _address_lock:
        address = _address_cursor[0]
        _address_cursor[0] += max(nbytes, 1) + (-max(nbytes, 1)) % _ADDRESS_ALIGN
        return address


def make_tensor(
    size: tuple[int, ...] | list[int],
    stride: tuple[int, ...] | list[int],
    offset: int,
    dtype: torch.dtype,
    storage: torch.UntypedStorage,
) -> torch.Tensor:
    """A neuron tensor of this geometry over ``storage`` (a view when the storage is another tensor's)."""
    t = torch._C._acc.create_empty_tensor([0], dtype)
    torch.ops.aten.set_.source_Storage_storage_offset.redispatch(_META, t, storage, 0, [0], [1])
    torch.ops.aten.as_strided_.default.redispatch(_NON_FUNCTIONAL, t, list(size), list(stride), offset)
    return t


def new_storage(nbytes: int, index: int, buffer: DeviceBuffer | None) -> torch.UntypedStorage:
    """A torch storage of the device, holding ``buffer`` (None: not written yet)."""
    address = _fresh_address(nbytes)
    storage = torch._C._construct_storage_from_data_pointer(address, torch.device("neuron", index), nbytes)
    storage._neuron = DeviceStorage(nbytes, buffer, index, address)
    return storage


def device_storage(t: torch.Tensor) -> DeviceStorage:
    """The device memory behind neuron tensor ``t``."""
    storage = t.untyped_storage()
    found = getattr(storage, "_neuron", None)
    if found is None and storage.device.type == "neuron" and storage.data_ptr() >= TORCH_MADE_BASE:
        # a storage torch made itself (copy.deepcopy's UntypedStorage(n, device=...)): its memory, at first use
        found = storage._neuron = DeviceStorage(
            storage.nbytes(),
            ALLOCATE[0](storage.nbytes(), storage.device.index or 0),
            storage.device.index or 0,
            storage.data_ptr(),
        )
    if found is None:
        raise NeuronCompileError(
            f"neuron device: a tensor on {t.device} has no device memory behind it (shape {list(t.shape)}, "
            f"{t.dtype}): it was not made by this backend's device (another library registered the 'neuron' "
            "device?). Report it with `neuron-compile doctor --bundle`."
        )
    return found


def is_whole(t: torch.Tensor) -> bool:
    """Whether ``t`` is exactly its storage's bytes in row-major order (its buffer can be used as it is)."""
    return t.storage_offset() == 0 and t.is_contiguous() and t.numel() * t.element_size() == device_storage(t).nbytes


def contiguous_byte_range(t: torch.Tensor) -> tuple[int, int] | None:
    """(byte offset, byte count) when ``t`` is a row-major run of its storage's bytes, else None."""
    if not t.is_contiguous():
        return None
    return t.storage_offset() * t.element_size(), t.numel() * t.element_size()


def count_host_to_device(nbytes: int) -> None:
    STATS.record_transfer(host_to_device=nbytes)


def count_device_to_host(nbytes: int) -> None:
    STATS.record_transfer(device_to_host=nbytes)
