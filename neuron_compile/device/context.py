"""The ``neuron`` device of this process: its target, its buffers, and moving values in, out and around.

Every value a kernel of the device reads or writes goes through :func:`parameter` (a tensor's values as an
executable's parameter), :func:`set_values` (a tensor's values replaced by an executable's result) or the host
transfers :func:`upload` / :func:`download`. A tensor that is exactly its storage's bytes is handed over as it
lies; any other view is gathered into a new buffer, and written through a scatter, by one-op graphs on the
device (``eager.py``), never through the host.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from ..errors import NeuronCompileError
from ..options import Options
from ..stats import STATS
from . import onegraph
from . import storage as mem
from .buffers import buffers_for


def default_memory_limit(generation: str, lnc: int) -> int:
    """HBM of one logical NeuronCore: the one table (``hbm.HBM_PER_CORE``)."""
    from ..hbm import hbm_per_core

    return hbm_per_core(generation, lnc)


class Device:
    """What the device needs of the backend: options (read once, from the environment), the target and its
    buffers, and the memory limit."""

    def __init__(self, opts: Options) -> None:
        from ..runtime.targets import target_for

        self.opts = opts
        self.target = target_for(opts)
        self.buffers = buffers_for(self.target)
        self._memory_limit = opts.device_memory_limit

    @property
    def memory_limit(self) -> int:
        """Bytes a logical core may hold: option ``device_memory_limit``, else what the Neuron runtime reports
        for the core (``nrt_get_vnc_memory_stats``; asked at the first allocation, not before: the runtime
        takes the process's cores when it starts), else the target's HBM."""
        if self._memory_limit is None:
            stats = self.buffers.memory_stats(current_index())
            limit = stats[1] if stats is not None and stats[1] else None
            self._memory_limit = limit or default_memory_limit(self.opts.generation, self.opts.lnc)
        return self._memory_limit

    def new_buffer(self, payload: Any, nbytes: int, index: int) -> mem.DeviceBuffer:
        return mem.DeviceBuffer(self.buffers, payload, nbytes, index)

    def allocate(self, nbytes: int, index: int) -> mem.DeviceBuffer:
        mem.reserve(index, nbytes, self.memory_limit)
        try:
            return self.new_buffer(self.buffers.allocate(nbytes, index), nbytes, index)
        except BaseException:
            mem.release(index, nbytes)
            raise


#: The device's one stream: every kernel of the device (an eager op, a copy, a compiled graph's call) holds it
#: from reading its inputs to writing its results, so ops from several threads run one after another, as on a
#: CUDA stream, and two writes to one storage cannot both start from its old buffer (a lost update).
STREAM = threading.RLock()


def serialized(fn: Any) -> Any:
    """``fn`` run while holding the device's stream (:data:`STREAM`), with Dynamo off: a kernel of the device runs
    when torch calls it, also from inside a function Dynamo evaluates (``model.compile()``, a graph break at
    ``.item()``), and Dynamo must never trace the device's own implementation."""

    @functools.wraps(fn)
    def on_the_stream(*args: Any, **kwargs: Any) -> Any:
        with STREAM:
            return fn(*args, **kwargs)

    import torch._dynamo

    return torch._dynamo.disable(on_the_stream, reason="the neuron device's own kernels")


mem.ALLOCATE[0] = lambda nbytes, index: device().allocate(nbytes, index)

#: The lazy eager mode (``lazy.py``, which imports this module, sets itself here when it is imported: eager.py
#: imports it, so it is set whenever the device is registered): flushes and records writes.
LAZY: Any = None


def settle() -> None:
    """Run what the lazy eager mode recorded (a synchronization: memory counts, ``synchronize()``)."""
    if LAZY is not None:
        LAZY.flush()


#: The current device index (``torch.neuron.set_device``), a list so that it is shared by reference.
CURRENT = [0]


def current_index() -> int:
    return CURRENT[0]


def index_of(device: Any) -> int:
    """The device index ``device`` names (None: the current one; an int, a string or a torch.device)."""
    if device is None:
        return current_index()
    if isinstance(device, int):
        return device
    return torch.device(device).index or 0


_DEVICE: Device | None = None
_LOCK = threading.Lock()


def device() -> Device:
    """The device of this process, set up at its first use (options from the environment)."""
    global _DEVICE
    with _LOCK:
        if _DEVICE is None:
            _DEVICE = Device(Options.from_user(None))
        return _DEVICE


def reset_for_tests(opts: Options | None = None) -> None:
    """Forget the device (tests switch targets between cases): tensors made before keep their buffers."""
    global _DEVICE
    try:
        settle()  # what the old device recorded runs on it
    except Exception:  # a failed recording raises where its values are read
        pass
    with _LOCK:
        _DEVICE = None if opts is None else Device(opts)


def empty(size: list[int], stride: list[int] | None, dtype: torch.dtype, index: int) -> torch.Tensor:
    """A new neuron tensor of uninitialized values (as ``torch.empty``)."""
    check_dtype(dtype)
    if stride is None:
        stride = list(torch._prims_common.make_contiguous_strides_for(size))
    numel = _storage_numel(size, stride)
    nbytes = numel * dtype.itemsize
    dev = device()
    storage = mem.new_storage(nbytes, index, dev.allocate(nbytes, index))
    return mem.make_tensor(size, stride, 0, dtype, storage)


def _storage_numel(size: list[int], stride: list[int]) -> int:
    if any(s == 0 for s in size):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(size, stride))


def from_payload(payload: Any, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype, index: int) -> torch.Tensor:
    """A dense neuron tensor holding an executable's result (counted in the device's memory)."""
    dev = device()
    mem.reserve(index, nbytes, dev.memory_limit)
    storage = mem.new_storage(nbytes, index, dev.new_buffer(payload, nbytes, index))
    return mem.make_tensor(shape, torch._prims_common.make_contiguous_strides_for(shape), 0, dtype, storage)


def with_buffer_of(source: torch.Tensor) -> torch.Tensor:
    """A new tensor (own storage) with ``source``'s geometry and buffer: a copy that costs nothing, since
    buffers are never written."""
    st = mem.device_storage(source)
    storage = mem.new_storage(st.nbytes, st.index, mem.raw_buffer(st))  # a pending value is shared as it is
    return mem.make_tensor(source.shape, source.stride(), source.storage_offset(), source.dtype, storage)


def check_dtype(dtype: torch.dtype) -> None:
    """The device has no float64 and no complex dtype (as MPS): refused with what to do."""
    if dtype in (torch.float64, torch.complex64, torch.complex128, torch.complex32):
        if onegraph.printing():
            return
        raise TypeError(
            f"Cannot put a {dtype} tensor on the neuron device: Trainium has no "
            f"{'float64' if dtype == torch.float64 else 'complex'} arithmetic. Convert it first "
            f"({'.float()' if dtype == torch.float64 else 'torch.view_as_real(t) for complex'}), or keep this "
            "tensor on CPU and compile the code that uses it (torch.compile computes float64 as float32 "
            "with a warning)."
        )


def upload(t: torch.Tensor, index: int, counted: bool = True) -> torch.Tensor:
    """A dense neuron tensor with the values of CPU tensor ``t`` (counted as bytes to the device; ``counted``:
    in ``memory_allocated()``, False for the device's own constants)."""
    check_dtype(t.dtype)
    dev = device()
    data = t.detach().contiguous()
    nbytes = data.numel() * data.element_size()
    if counted:
        mem.reserve(index, nbytes, dev.memory_limit)
    try:
        payload = dev.buffers.from_host(data, index)
    except BaseException:
        if counted:
            mem.release(index, nbytes)
        raise
    storage = mem.new_storage(nbytes, index, mem.DeviceBuffer(dev.buffers, payload, nbytes, index, counted))
    return mem.make_tensor(data.shape, data.stride(), 0, data.dtype, storage)


#: Vectors of numbers on the device (the runtime operands of eager graphs), by their exact values: a few, the latest.
_NUMBER_VECTORS: dict[tuple, tuple[Device, list[torch.Tensor]]] = {}
_NUMBER_VECTORS_KEPT = 32


def number_vectors(floats: list[float], ints: list[int], index: int) -> list[torch.Tensor]:
    """A float32 vector of ``floats`` and an int64 vector of ``ints`` (each only if not empty) on the device,
    uploaded only when these exact numbers were not lately (a constant such as ``x + 1`` crosses once; device
    buffers are never written, so sharing them is safe). Keyed by each float's bits: 0.0 is not -0.0."""
    key = (tuple(float(f).hex() for f in floats), tuple(ints), index)
    dev = device()
    with _LOCK:
        known = _NUMBER_VECTORS.get(key)
    if known is not None and known[0] is dev:
        return known[1]
    vectors = []
    if floats:
        vectors.append(upload(torch.tensor(floats, dtype=torch.float32), index, counted=False))
    if ints:
        vectors.append(upload(torch.tensor(ints, dtype=torch.int64), index, counted=False))
    with _LOCK:
        if len(_NUMBER_VECTORS) >= _NUMBER_VECTORS_KEPT:
            _NUMBER_VECTORS.pop(next(iter(_NUMBER_VECTORS)))
        _NUMBER_VECTORS[key] = (dev, vectors)
    return vectors


#: Called before device data is read to the host: the pending value checks run (``checks.resolve``, set when the
#: device is registered).
BEFORE_READ: Any = None


def download(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with the values of neuron tensor ``t`` (contiguous; counted as bytes to the host). A read of
    device data is a synchronization: the pending value checks of earlier graphs run first (``checks.py``)."""
    if mem.is_pending(t):  # what was recorded runs first, so that its graph's value checks are read too
        LAZY.flush()
    if BEFORE_READ is not None:
        BEFORE_READ()
    dense = densify(t)
    st = mem.device_storage(dense)
    nbytes = dense.numel() * dense.element_size()
    raw = device().buffers.to_host(st.buffer.payload, dense.storage_offset() * dense.element_size(), nbytes)
    return raw.view(dense.dtype).view(dense.shape) if dense.dim() else raw.view(dense.dtype).reshape(())


def densify(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it is a row-major run of its storage, else a new dense copy made on the device."""
    if mem.contiguous_byte_range(t) is not None and mem.device_storage(t).buffer is not None:
        return t
    return gather(t)


def parameter(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Any, torch.Tensor]:
    """(executable parameter, the tensor that keeps its buffer alive) for ``t``'s values as a dense array of
    ``shape`` and ``dtype`` (``t`` may be any view: it is gathered first when its bytes are not one run)."""
    if t.dtype != dtype:
        raise NeuronCompileError(f"neuron device: a {t.dtype} tensor given where the graph takes {dtype}")
    dev = device()
    dense = densify(t)
    st = mem.device_storage(dense)
    param = dev.buffers.parameter(st.buffer, dense.storage_offset() * dense.element_size(), shape, dtype)
    if param is None:  # its bytes cannot be handed over where they lie: gather them into a buffer of their own
        dense = gather(dense, force=True)
        st = mem.device_storage(dense)
        param = dev.buffers.parameter(st.buffer, 0, shape, dtype)
    return param, dense


def set_values(dst: torch.Tensor, value: torch.Tensor) -> None:
    """Write the values of neuron tensor ``value`` (dst's shape; its dtype) into neuron tensor ``dst``, which
    may be any view: its storage gets a new buffer (a scatter graph when ``dst`` is not the whole storage)."""
    if value.dtype != dst.dtype:
        raise NeuronCompileError(f"neuron device: cannot write {value.dtype} values into a {dst.dtype} tensor")
    if device().opts.eager_mode == "lazy" and LAZY.set_values(dst, value):
        return
    st = mem.device_storage(dst)
    if mem.is_whole(dst):
        dense = densify(value)
        src = mem.device_storage(dense)
        if mem.is_whole(dense):
            st.buffer = src.buffer  # buffers are never written: sharing one is a copy
            return
        dense = _own_buffer(dense)
        st.buffer = mem.device_storage(dense).buffer
        return
    st.buffer = scatter(dst, value)


def _own_buffer(dense: torch.Tensor) -> torch.Tensor:
    return gather(dense, force=True)


@functools.lru_cache(maxsize=None)
def neuron_device(index: int = 0) -> torch.device:
    return torch.device("neuron", index)


# -- gathers and scatters: views read and written on the device ------------------------------------------------
def _flat_of(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``t`` as a 1-d tensor of ``t``'s dtype (a view)."""
    st = mem.device_storage(t)
    n = st.nbytes // t.element_size()
    return mem.make_tensor((n,), (1,), 0, t.dtype, t.untyped_storage())


def gather(t: torch.Tensor, force: bool = False) -> torch.Tensor:
    """A new dense neuron tensor with ``t``'s values, computed on the device from ``t``'s storage."""
    flat = _flat_of(t)
    size, stride, offset = tuple(t.shape), tuple(t.stride()), t.storage_offset()
    key = (device().target.name, "gather", tuple(flat.shape), t.dtype, size, stride, offset)
    entry = onegraph.GRAPHS.get(key)
    if entry is None:
        with onegraph.GRAPHS_LOCK:

            def fn(base: torch.Tensor) -> tuple[torch.Tensor]:
                return (torch.as_strided(base, size, stride, offset).clone(),)

            examples = [onegraph.example(flat)]
            graph = onegraph.compile_one(onegraph.trace(fn, examples), "gather", device().opts)
            entry = onegraph.GRAPHS.setdefault(key, onegraph.OpGraph(graph, 1))
            STATS.eager_ops_compiled += 1
    return entry.graph([flat])[0]


def scatter(dst: torch.Tensor, value: torch.Tensor) -> mem.DeviceBuffer:
    """The buffer of ``dst``'s storage with ``dst``'s elements replaced by ``value``'s, made on the device."""
    flat = _flat_of(dst)
    size, stride, offset = tuple(dst.shape), tuple(dst.stride()), dst.storage_offset()
    key = (device().target.name, "scatter", tuple(flat.shape), dst.dtype, size, stride, offset)
    entry = onegraph.GRAPHS.get(key)
    if entry is None:
        with onegraph.GRAPHS_LOCK:

            def fn(base: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor]:
                return (torch.as_strided_scatter(base, src, size, stride, offset),)

            examples = [onegraph.example(flat), (size, dst.dtype)]
            graph = onegraph.compile_one(onegraph.trace(fn, examples), "scatter", device().opts)
            entry = onegraph.GRAPHS.setdefault(key, onegraph.OpGraph(graph, 1))
            STATS.eager_ops_compiled += 1
    new_flat = entry.graph([flat, value])[0]
    return mem.device_storage(new_flat).buffer
