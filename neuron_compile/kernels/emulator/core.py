"""Core of the NKI emulator: errors, dtypes, buffers, tensors (views sharing storage), the run context
with its SBUF/PSUM capacity tracking and per-engine counters.

A kernel runs inside a :class:`Run` (made by ``simulate``). Every tensor is a NumPy view of its
allocation's storage, so slicing costs nothing and writes through a view land in the storage. In
shape-only mode the storage is a zero-stride broadcast of one element: shapes, dtypes and every
hardware rule are checked exactly as with data, but nothing is computed or allocated.
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from ...errors import NeuronCompileError
from .. import cost as _cost

PMAX = 128


# ----------------------------------------------------------------------------------------------- errors
class NkiError(NeuronCompileError):
    """Base of every error the NKI emulator raises (a kernel broke an API or hardware rule)."""


class NkiValidationError(NkiError):
    """A hardware rule was broken: partition/free-size limits, operand buffers, dtypes, capacity."""


class NkiCapacityError(NkiValidationError):
    """Live SBUF or PSUM allocations exceed the generation's capacity."""


class NkiOutOfBoundsError(NkiValidationError):
    """An index or slice reaches outside the tensor (the hardware would access other memory)."""


# ----------------------------------------------------------------------------------------------- dtypes
def _tf32_round(x: np.ndarray) -> np.ndarray:
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    b = (b + np.uint32(0xFFF) + ((b >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return b.view(np.float32)


_NP_DTYPES: dict[str, Any] = {
    "float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "tfloat32": np.float32,
    "float8_e4m3": ml_dtypes.float8_e4m3, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2, "float8_e8m0fnu": ml_dtypes.float8_e8m0fnu,
    "int8": np.int8, "int16": np.int16, "int32": np.int32, "uint8": np.uint8, "uint16": np.uint16,
    "uint32": np.uint32, "bool_": np.bool_,
}
_NP_TO_NAME = {np.dtype(v): k for k, v in _NP_DTYPES.items() if k != "tfloat32"}
_TORCH_NAMES = {"float": "float32", "half": "float16", "int": "int32", "short": "int16", "bool": "bool_",
                "float64": "float32", "double": "float32", "int64": "int32", "long": "int32"}


def dtype_name(dtype: Any) -> str:
    """Canonical NKI dtype string for a string, NumPy/ml_dtypes dtype or torch dtype."""
    if isinstance(dtype, str):
        name = {"bool": "bool_", "float": "float32"}.get(dtype, dtype)
        if name in _NP_DTYPES:
            return name
        raise NkiError(f"unknown NKI dtype {dtype!r}; use one of {sorted(_NP_DTYPES)}")
    if type(dtype).__module__ == "torch":  # torch.dtype, without importing torch here
        name = str(dtype).removeprefix("torch.")
        name = _TORCH_NAMES.get(name, name)
        return dtype_name(name)
    try:
        return _NP_TO_NAME[np.dtype(dtype)]
    except (TypeError, KeyError):
        if np.dtype(dtype) == np.float64:
            return "float32"
        if np.dtype(dtype) == np.int64:
            return "int32"
        raise NkiError(f"unsupported dtype {dtype!r} for an NKI tensor") from None


def np_dtype(name: str) -> np.dtype:
    return np.dtype(_NP_DTYPES[name])


def itemsize(name: str) -> int:
    return np_dtype(name).itemsize


def is_float(name: str) -> bool:
    return name.startswith(("float", "bfloat", "tfloat"))


def cast(values: np.ndarray, name: str) -> np.ndarray:
    """Round fp32 values to dtype ``name`` the way the engines write them (RNE; ints saturate)."""
    if name == "tfloat32":
        return _tf32_round(values)
    dt = np_dtype(name)
    if is_float(name):
        return np.asarray(values).astype(dt)
    if name == "bool_":
        return np.asarray(values) != 0
    info = np.iinfo(dt)
    v = np.nan_to_num(np.rint(np.asarray(values, np.float64)), nan=0.0)
    return np.clip(v, info.min, info.max).astype(dt)


def fill_value(name: str) -> Any:
    """What new memory holds: NaN for floats, 4 for ints (as the NKI simulator does)."""
    return np.nan if is_float(name) else (True if name == "bool_" else 4)


# ---------------------------------------------------------------------------------------------- buffers
class Buffer(str):
    """A memory kind: ``sbuf``, ``psum``, ``hbm`` (private) or ``shared_hbm``."""

    @property
    def on_chip(self) -> bool:
        return self in ("sbuf", "psum")

    @property
    def is_hbm(self) -> bool:
        return self in ("hbm", "shared_hbm", "private_hbm")


sbuf = Buffer("sbuf")
psum = Buffer("psum")
hbm = Buffer("hbm")
private_hbm = Buffer("hbm")
shared_hbm = Buffer("shared_hbm")


# ------------------------------------------------------------------------------------------- run / stats
@dataclass
class EngineStats:
    """Counters of one engine: instructions issued, elements processed, estimated cycles."""

    instructions: int = 0
    elements: int = 0
    cycles: float = 0.0


@dataclass
class RunStats:
    """Counters of one kernel run, readable after it (``simulate(..., stats=True)``, ``last_run_stats()``)."""

    generation: str = "trn2"
    engines: dict[str, EngineStats] = field(
        default_factory=lambda: {e: EngineStats() for e in ("tensor", "vector", "scalar", "gpsimd", "dma")})
    dma_bytes_hbm_to_sbuf: int = 0
    dma_bytes_sbuf_to_hbm: int = 0
    dma_bytes_other: int = 0
    dma_transfers: int = 0
    matmul_flops: int = 0
    sbuf_peak_bytes_per_partition: int = 0
    psum_peak_bytes_per_partition: int = 0
    shape_only: bool = False

    @property
    def dma_bytes(self) -> int:
        """Bytes moved between HBM and SBUF (both directions)."""
        return self.dma_bytes_hbm_to_sbuf + self.dma_bytes_sbuf_to_hbm

    def instructions(self) -> dict[str, int]:
        return {k: v.instructions for k, v in self.engines.items()}

    def summary(self) -> str:
        eng = ", ".join(f"{k}={v.instructions}" for k, v in self.engines.items())
        return (f"instructions [{eng}]; HBM->SBUF {self.dma_bytes_hbm_to_sbuf} B, SBUF->HBM "
                f"{self.dma_bytes_sbuf_to_hbm} B in {self.dma_transfers} DMAs; peak SBUF "
                f"{self.sbuf_peak_bytes_per_partition} B/partition, PSUM {self.psum_peak_bytes_per_partition} B")


def _default_generation() -> str:
    env = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "")
    return _cost.generation(env or None).name if env else "trn2"


class Run:
    """One kernel execution: generation, shape-only flag, live on-chip memory, counters, SPMD ids."""

    def __init__(self, generation: str | None = None, shape_only: bool = False):
        self.gen = _cost.generation(generation or _default_generation())
        self.shape_only = shape_only
        self.stats = RunStats(generation=self.gen.name, shape_only=shape_only)
        self.sbuf_used = 0
        self.psum_banks = [0] * self.gen.psum_banks
        self.program_id: tuple[int, ...] = ()
        self.grid: tuple[int, ...] = ()

    # ---- capacity
    def allocate(self, buffer: Buffer, per_partition: int, what: str) -> tuple[str, int] | None:
        if buffer == "sbuf":
            cap = self.gen.sbuf_usable_bytes_per_partition
            if self.sbuf_used + per_partition > cap:
                raise NkiCapacityError(
                    f"SBUF capacity exceeded on {self.gen.name}: {what} needs {per_partition} B per partition "
                    f"with {self.sbuf_used} B already live, of {cap} B usable per partition "
                    f"({self.gen.sbuf_bytes_per_partition} minus {self.gen.sbuf_reserved_bytes_per_partition} "
                    "reserved for the compiler). Use smaller tiles or let earlier tiles go out of scope.")
            self.sbuf_used += per_partition
            self.stats.sbuf_peak_bytes_per_partition = max(self.stats.sbuf_peak_bytes_per_partition,
                                                           self.sbuf_used)
            return ("sbuf", per_partition)
        if buffer == "psum":
            bank = self.gen.psum_bytes_per_partition // self.gen.psum_banks
            if per_partition > bank:
                raise NkiValidationError(
                    f"PSUM tensor {what} takes {per_partition} B per partition, more than one PSUM bank "
                    f"({bank} B = {bank // 4} fp32 elements, nl.tile_size.psum_fmax); split its free dim")
            for i, used in enumerate(self.psum_banks):
                if used + per_partition <= bank:
                    self.psum_banks[i] += per_partition
                    live = sum(self.psum_banks)
                    self.stats.psum_peak_bytes_per_partition = max(self.stats.psum_peak_bytes_per_partition,
                                                                   live)
                    return ("psum", i * 1_000_000 + per_partition)
            raise NkiCapacityError(
                f"PSUM capacity exceeded on {self.gen.name}: {what} needs {per_partition} B per partition but "
                f"all {self.gen.psum_banks} banks of {bank} B are taken (used per bank: {self.psum_banks}). "
                "Reuse PSUM tiles across loop iterations or let earlier ones go out of scope (del).")
        return None

    def release(self, token: tuple[str, int]) -> None:
        kind, val = token
        if kind == "sbuf":
            self.sbuf_used -= val
        else:
            self.psum_banks[val // 1_000_000] -= val % 1_000_000

    # ---- counters
    def count(self, engine: str, kind: str, partitions: int, free: int, itemsize_: int = 4) -> None:
        e = self.stats.engines[engine]
        e.instructions += 1
        e.elements += partitions * free
        e.cycles += _cost.instruction_cycles(self.gen, engine, kind, free, partitions, itemsize_)


_local = threading.local()


def current_run() -> Run:
    """The run a kernel executes in (a default trn2 run outside ``simulate``, e.g. for nl.* at top level)."""
    stack = getattr(_local, "stack", None)
    if not stack:
        if not hasattr(_local, "default"):
            _local.default = Run()
        return _local.default
    return stack[-1]


def in_kernel() -> bool:
    """True while a kernel runs on this thread (a nested ``@nki.jit`` call is then inlined)."""
    return bool(getattr(_local, "stack", None))


def push_run(run: Run) -> None:
    if not hasattr(_local, "stack"):
        _local.stack = []
    _local.stack.append(run)


def pop_run() -> Run:
    run = _local.stack.pop()
    _local.last_stats = run.stats
    return run


def last_run_stats() -> RunStats | None:
    """Counters of the last kernel run finished on this thread (None before the first one)."""
    return getattr(_local, "last_stats", None)


# ---------------------------------------------------------------------------------------------- tensors
class _Alloc:
    """Owner of one allocation's capacity; freed when the last view of it goes away."""

    __slots__ = ("__weakref__", "name")

    def __init__(self, run: Run, buffer: Buffer, per_partition: int, name: str):
        self.name = name
        token = run.allocate(buffer, per_partition, name)
        if token is not None:
            weakref.finalize(self, run.release, token)


class ds:
    """``nl.ds(start, size)``: a dynamic slice ``start:start+size``."""

    __slots__ = ("size", "start")

    def __init__(self, start: int, size: int):
        self.start, self.size = int(start), int(size)

    def as_slice(self) -> slice:
        return slice(self.start, self.start + self.size)


def _fmt_shape(t: NkiTensor) -> str:
    return f"{t.name or 'tensor'}{list(t.shape)}:{t.dtype}@{t.buffer}"


class NkiTensor:
    """An NKI tensor or a view of one: a NumPy view plus dtype and buffer; views share storage."""

    __slots__ = ("_alloc", "_arr", "_written", "buffer", "dtype", "name", "p0", "pstep")

    def __init__(self, arr: np.ndarray, dtype: str, buffer: Buffer, alloc: Any = None, name: str = "",
                 written: np.ndarray | None = None, p0: int = 0, pstep: int = 1):
        self.p0 = p0  # first partition of this view in its allocation (on chip)
        self.pstep = pstep  # partition stride of this view (compute engines need 1)
        self._arr = arr
        self._written = written
        self._alloc = alloc
        self.dtype = dtype
        self.buffer = buffer
        self.name = name

    # ---- metadata
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._arr.shape)

    @property
    def ndim(self) -> int:
        return self._arr.ndim

    @property
    def size(self) -> int:
        return int(self._arr.size)

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def partitions(self) -> int:
        return self.shape[0] if self.ndim else 1

    @property
    def free_size(self) -> int:
        """Elements per partition."""
        return int(math.prod(self.shape[1:])) if self.ndim > 1 else 1

    def __repr__(self) -> str:
        return f"NkiTensor({_fmt_shape(self)})"

    # ---- views
    def _view(self, arr: np.ndarray, written: np.ndarray | None = None, p0: int | None = None,
              pstep: int | None = None) -> NkiTensor:
        return NkiTensor(arr, self.dtype, self.buffer, self._alloc, self.name, written,
                         self.p0 if p0 is None else p0, self.pstep if pstep is None else pstep)

    def _normalize_key(self, key: Any) -> tuple:
        key = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis for k in key):
            i = next(i for i, k in enumerate(key) if k is Ellipsis)
            fill = self.ndim - (len(key) - 1)
            key = key[:i] + (slice(None),) * fill + key[i + 1:]
        if len(key) > self.ndim:
            raise NkiOutOfBoundsError(f"too many indices ({len(key)}) for {_fmt_shape(self)}")
        out = []
        for d, k in enumerate(key):
            n = self.shape[d]
            if isinstance(k, ds):
                k = k.as_slice()
            if isinstance(k, slice):
                step = 1 if k.step is None else int(k.step)
                if step <= 0:
                    raise NkiError(f"slice step must be positive, got {step} on dim {d} of {_fmt_shape(self)}")
                start = 0 if k.start is None else int(k.start)
                stop = n if k.stop is None else int(k.stop)
                if start < 0 or stop > n or start > stop:
                    raise NkiOutOfBoundsError(
                        f"access out of bound: [{start}:{stop}] on dim {d} (size {n}) of {_fmt_shape(self)}")
                out.append(slice(start, stop, step))
            elif isinstance(k, (int, np.integer)):
                k = int(k)
                if not -n <= k < n:
                    raise NkiOutOfBoundsError(
                        f"access out of bound: index {k} on dim {d} (size {n}) of {_fmt_shape(self)}")
                out.append(k % n)
            else:
                raise NkiError(f"unsupported index {k!r} on {_fmt_shape(self)}: use ints, slices or nl.ds")
        if self.buffer.on_chip and out and isinstance(out[0], int):
            out[0] = slice(out[0], out[0] + 1)  # an integer on the partition dim keeps a size-1 dim
        if self.buffer.on_chip:
            full = out + [slice(None)] * (self.ndim - len(out))
            while sum(not isinstance(k, int) for k in full) < 2:  # on chip, results stay >= 2-D
                j = max(i for i, k in enumerate(full) if isinstance(k, int))
                full[j] = slice(full[j], full[j] + 1)
            out = full
        return tuple(out)

    def __getitem__(self, key: Any) -> NkiTensor:
        k = self._normalize_key(key)
        p0, pstep = self.p0, self.pstep
        if self.buffer.on_chip and k:
            p0, pstep = p0 + k[0].start * pstep, pstep * (k[0].step or 1)
        return self._view(self._arr[k], None if self._written is None else self._written[k], p0, pstep)

    def __setitem__(self, key: Any, value: Any) -> None:
        raise NkiError(
            f"assigning into {_fmt_shape(self)} with [...] = is not an NKI operation; write with "
            "nisa.tensor_copy / nisa.dma_copy (or nl.store for HBM)")

    def reshape(self, shape: Any) -> NkiTensor:
        """A view with another shape and the same element count (storage must be contiguous)."""
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        if math.prod(shape) != self.size:
            raise NkiValidationError(
                f"reshape of {_fmt_shape(self)} to {list(shape)} changes the element count "
                f"({self.size} -> {math.prod(shape)})")
        _check_partitions(shape, self.buffer, "reshape")
        if current_run().shape_only:
            w = None if self._written is None else np.broadcast_to(np.zeros((), bool), shape)
            return self._view(np.broadcast_to(np.zeros((), self._arr.dtype), shape), w)
        arr = self._arr.reshape(shape)
        if not np.shares_memory(arr, self._arr) and self._arr.size:
            raise NkiError(f"reshape of non-contiguous view {_fmt_shape(self)} would copy; reshape the base tensor")
        return self._view(arr, None if self._written is None else self._written.reshape(shape))

    def broadcast(self, dim: int, n: int) -> NkiTensor:
        """A read-only view repeating size-1 dim ``dim`` ``n`` times (not dim 0 on chip)."""
        if self.buffer.on_chip and dim == 0:
            raise NkiValidationError(f"broadcast along the partition dim of on-chip {_fmt_shape(self)} "
                                     "is not a view; copy per partition instead")
        shape = list(self.shape)
        if shape[dim] != 1:
            raise NkiError(f"broadcast needs dim {dim} of {_fmt_shape(self)} to be 1")
        shape[dim] = n
        return self._view(np.broadcast_to(self._arr, shape))

    def broadcast_to(self, shape: Any) -> NkiTensor:
        if self.buffer.on_chip and next(iter(shape)) != self.shape[0]:
            raise NkiValidationError(f"cannot broadcast the partition dim of on-chip {_fmt_shape(self)}")
        return self._view(np.broadcast_to(self._arr, tuple(shape)))

    def view(self, dtype: Any) -> NkiTensor:
        name = dtype_name(dtype)
        if itemsize(name) != self.itemsize:
            raise NkiError(f"view of {_fmt_shape(self)} as {name} changes the element size")
        return NkiTensor(self._arr.view(np_dtype(name)), name, self.buffer, self._alloc, self.name,
                         p0=self.p0, pstep=self.pstep)

    # ---- host access (only outside kernels / in tests)
    def numpy(self) -> np.ndarray:
        return np.array(self._arr)


def _check_partitions(shape: tuple[int, ...], buffer: Buffer, what: str) -> None:
    if buffer.on_chip:
        if len(shape) < 1:
            raise NkiValidationError(f"{what}: an on-chip tensor needs a partition dim, got shape {list(shape)}")
        if shape[0] > PMAX:
            raise NkiValidationError(
                f"{what}: Size of partition dimension {shape[0]} exceeds maximum {PMAX} "
                f"(nl.tile_size.pmax) for {buffer} tensor of shape {list(shape)}")


def new_tensor(shape: Any, dtype: Any, buffer: Buffer | str = sbuf, name: str = "",
               fill: Any = None) -> NkiTensor:
    """Allocate a tensor in the current run (filled with NaN / 4 unless ``fill`` is given)."""
    run = current_run()
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    name_ = dtype_name(dtype)
    buffer = Buffer(buffer)
    if buffer not in ("sbuf", "psum", "hbm", "shared_hbm"):
        raise NkiError(f"unknown buffer {buffer!r}; use nl.sbuf, nl.psum, nl.hbm or nl.shared_hbm")
    if any(s <= 0 for s in shape):
        raise NkiValidationError(f"nl.ndarray {name!r}: every dim must be positive, got shape {list(shape)}")
    _check_partitions(shape, buffer, f"nl.ndarray {name!r}" if name else "nl.ndarray")
    if buffer == "psum" and is_float(name_) is False:
        raise NkiValidationError(f"PSUM tensor {name!r} must have a float dtype, got {name_}")
    per_part = int(math.prod(shape[1:])) * itemsize(name_) if buffer.on_chip else 0
    alloc = _Alloc(run, buffer, per_part, f"{name or 'tensor'}{list(shape)}:{name_}") \
        if buffer.on_chip else None
    value = fill_value(name_) if fill is None else fill
    if run.shape_only:
        arr = np.broadcast_to(np.zeros((), np_dtype(name_)), shape)
        written = np.broadcast_to(np.zeros((), bool), shape) if buffer == "psum" else None
    else:
        arr = np.full(shape, value, dtype=np_dtype(name_)) if name_ != "tfloat32" else \
            np.full(shape, value, np.float32)
        written = np.zeros(shape, bool) if buffer == "psum" else None
    return NkiTensor(arr, name_, buffer, alloc, name, written)


def wrap_hbm(arr: np.ndarray, name: str = "", shape_only: bool = False) -> NkiTensor:
    """An HBM kernel argument viewing ``arr`` (no copy: in-place writes reach the caller)."""
    dt = dtype_name(arr.dtype)
    if np.dtype(arr.dtype) != np_dtype(dt):
        arr = arr.astype(np_dtype(dt))
    return NkiTensor(arr, dt, hbm, None, name)
