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
import warnings
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


class NkiUnsupportedError(NkiError):
    """A documented NKI function or argument the emulator does not implement (the message names it)."""


class NkiBudgetError(NkiError):
    """A kernel run took more steps (instructions issued plus iterations of ``nl`` loops) than its budget:
    most likely an endless loop. The message names the kernel, the budget and how to raise it."""


class NkiUndeclaredMutationError(NkiError):
    """An ``nki_op``'s kernel wrote an argument of the op that ``mutates_args`` does not declare."""


#: Environment variable setting the default step budget of a kernel run (0: no limit).
MAX_STEPS_ENV = "NEURON_COMPILE_NKI_MAX_STEPS"
#: The default step budget: about 175 times the longest built-in kernel run of the tests and benchmarks (a
#: shape-only 8192x4096x1000 matmul, 11,392 steps). A loop issuing instructions reaches it after 20-45 s of
#: emulation (10-22 us an instruction), one issuing none after ~0.3 s.
DEFAULT_MAX_STEPS = 2_000_000


def max_steps_default() -> int:
    """The step budget of a kernel run: ``NEURON_COMPILE_NKI_MAX_STEPS`` if set (0 = no limit), else
    :data:`DEFAULT_MAX_STEPS`."""
    env = os.environ.get(MAX_STEPS_ENV, "").strip().replace("_", "")
    if not env:
        return DEFAULT_MAX_STEPS
    try:
        value = int(env)
    except ValueError:
        raise NkiError(f"{MAX_STEPS_ENV}={env!r} is not an integer (a step budget; 0 means no limit)") from None
    if value < 0:
        raise NkiError(f"{MAX_STEPS_ENV}={value} is negative (a step budget; 0 means no limit)")
    return value


#: The NKI releases the emulator knows, oldest first, and the Neuron SDK each shipped in (emulator/versions.py
#: says what changes between them).
VERSIONS: dict[str, str] = {"0.6": "Neuron 2.32", "0.7": "Neuron 2.33", "0.8": "Neuron 2.34"}
DEFAULT_VERSION = "0.8"
#: Environment variable naming the NKI version the emulator enforces (default :data:`DEFAULT_VERSION`).
VERSION_ENV = "NEURON_COMPILE_NKI_VERSION"


def check_version(value: Any, what: str = VERSION_ENV) -> str:
    """``value`` as one of :data:`VERSIONS` (``"0.8"``, ``0.8``, ``"0.8.0"`` are the same); else an error."""
    text = str(value).strip()
    parts = text.split(".")
    key = ".".join(parts[:2]) if len(parts) == 3 and parts[2] == "0" else text
    if key not in VERSIONS:
        raise NkiError(
            f"{what}={value!r} is not an NKI version the emulator enforces; use one of "
            + ", ".join(f"{v} ({sdk})" for v, sdk in VERSIONS.items())
        )
    return key


def version_default() -> str:
    """The version runs enforce unless told: ``NEURON_COMPILE_NKI_VERSION`` if set, else the newest."""
    env = os.environ.get(VERSION_ENV, "").strip()
    return check_version(env) if env else DEFAULT_VERSION


def unsupported(qualname: str, why: str = "") -> Any:
    """A stand-in for a documented NKI API the emulator refuses: calling it raises NkiUnsupportedError."""

    def refused(*_: Any, **__: Any) -> Any:
        raise NkiUnsupportedError(
            f"{qualname} is documented NKI but not implemented by the neuron_compile emulator"
            + (f" ({why})" if why else "")
            + "; see docs/nki.md, 'API coverage'"
        )

    refused.__name__ = qualname.rsplit(".", 1)[-1]
    refused.__qualname__ = qualname
    refused.__nki_unsupported__ = why or "not implemented"
    refused.__doc__ = f"Refused: {qualname} raises NkiUnsupportedError here ({why or 'not implemented'})."
    return refused


# ----------------------------------------------------------------------------------------------- dtypes
def _tf32_round(x: np.ndarray) -> np.ndarray:
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    b = (b + np.uint32(0xFFF) + ((b >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return b.view(np.float32)


_NP_DTYPES: dict[str, Any] = {
    "float32": np.float32,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
    "tfloat32": np.float32,
    "float8_e4m3": ml_dtypes.float8_e4m3,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
    "float8_e8m0fnu": ml_dtypes.float8_e8m0fnu,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "uint8": np.uint8,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "bool_": np.bool_,
}
_NP_TO_NAME = {np.dtype(v): k for k, v in _NP_DTYPES.items() if k != "tfloat32"}
_TORCH_NAMES = {
    "float": "float32",
    "half": "float16",
    "int": "int32",
    "short": "int16",
    "bool": "bool_",
    "float64": "float32",
    "double": "float32",
    "int64": "int32",
    "long": "int32",
}


def dtype_name(dtype: Any) -> str:
    """Canonical NKI dtype string for a string, NumPy/ml_dtypes dtype or torch dtype."""
    if isinstance(dtype, str):
        name = {"bool": "bool_", "float": "float32"}.get(dtype, dtype)
        if name in ("int64", "float8_e5m2_x4", "float8_e4m3fn_x4", "float4_e2m1fn_x4"):
            raise NkiUnsupportedError(
                f"NKI dtype {name} is not emulated for tensors (int64 exists only as an "
                "NkiScalar; the x4-packed MX types belong to nc_matmul_mx)"
            )
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
        default_factory=lambda: {e: EngineStats() for e in ("tensor", "vector", "scalar", "gpsimd", "dma")}
    )
    dma_bytes_hbm_to_sbuf: int = 0
    dma_bytes_sbuf_to_hbm: int = 0
    dma_bytes_other: int = 0
    dma_transfers: int = 0
    matmul_flops: int = 0
    sbuf_peak_bytes_per_partition: int = 0
    psum_peak_bytes_per_partition: int = 0
    shape_only: bool = False
    #: per program of the launch: the schedule's critical path ("makespan", s) and busy seconds per engine
    schedule: list[dict[str, Any]] = field(default_factory=list)
    #: instructions issued plus iterations of ``nl`` loops: what the run's step budget limits
    steps: int = 0
    #: the kernel's HBM arguments it wrote (by parameter name, in the order first written)
    written_args: tuple[str, ...] = ()

    @property
    def dma_bytes(self) -> int:
        """Bytes moved between HBM and SBUF (both directions)."""
        return self.dma_bytes_hbm_to_sbuf + self.dma_bytes_sbuf_to_hbm

    def instructions(self) -> dict[str, int]:
        return {k: v.instructions for k, v in self.engines.items()}

    def summary(self) -> str:
        eng = ", ".join(f"{k}={v.instructions}" for k, v in self.engines.items())
        return (
            f"instructions [{eng}]; HBM->SBUF {self.dma_bytes_hbm_to_sbuf} B, SBUF->HBM "
            f"{self.dma_bytes_sbuf_to_hbm} B in {self.dma_transfers} DMAs; peak SBUF "
            f"{self.sbuf_peak_bytes_per_partition} B/partition, PSUM {self.psum_peak_bytes_per_partition} B"
        )


def _default_generation() -> str:
    env = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "")
    return _cost.generation(env or None).name if env else "trn2"


class Run:
    """One kernel execution: generation, shape-only flag, live on-chip memory, counters, SPMD ids."""

    def __init__(
        self,
        generation: str | None = None,
        shape_only: bool = False,
        kernel: str = "",
        max_steps: int | None = None,
        nki_version: str | None = None,
    ):
        self.gen = _cost.generation(generation or _default_generation())
        #: the NKI release whose API and rules this run enforces (emulator/versions.py)
        self.nki_version = version_default() if nki_version is None else check_version(nki_version, "nki_version")
        self.kernel = kernel
        #: the step budget (None or 0: none; the default run outside ``simulate`` has none)
        self.max_steps = max_steps or None
        self.steps = 0
        self.loop_iterations = 0
        self.written: dict[int, KernelArg] = {}
        self.shape_only = shape_only
        self.stats = RunStats(generation=self.gen.name, shape_only=shape_only)
        # on-chip memory in use, per program: each program of a launch is its own core with its own SBUF/PSUM
        self._memory: dict[tuple[int, ...], tuple[list[int], list[int]]] = {}
        self.program_id: tuple[int, ...] = ()
        self.grid: tuple[int, ...] = ()
        self.grid_ids: list[tuple[int, ...]] = [()]
        self.shared_allocs: list[NkiTensor] = []
        self.shared_next = 0
        self.timelines: dict[tuple[int, ...], Any] = {}
        #: the cooperative scheduler of an LNC-2 launch (emulator/lnc.py), None otherwise
        self.lnc_launch: Any = None
        #: (warning, file, line) already given in this run: one warning per call site and run
        self.warned: set[tuple[str, str, int]] = set()

    def _mem(self, program: tuple[int, ...] | None = None) -> tuple[list[int], list[int]]:
        """([SBUF bytes per partition in use], [bytes used per PSUM bank]) of a program (default: the current)."""
        key = self.program_id if program is None else program
        mem = self._memory.get(key)
        if mem is None:
            mem = self._memory[key] = ([0], [0] * self.gen.psum_banks)
        return mem

    @property
    def sbuf_used(self) -> int:
        return self._mem()[0][0]

    @property
    def psum_banks(self) -> list[int]:
        return self._mem()[1]

    def timeline(self) -> Any:
        """The schedule of the program running now (each program of a launch is its own core)."""
        return self.timeline_of(self.program_id)

    def timeline_of(self, program: tuple[int, ...]) -> Any:
        """The schedule of one program of the launch (made on first use)."""
        tl = self.timelines.get(program)
        if tl is None:
            from .schedule import Timeline

            tl = self.timelines[program] = Timeline(self.gen)
        return tl

    def finish(self) -> None:
        self.stats.schedule = [tl.summary() for tl in self.timelines.values()]
        self.stats.steps = self.steps
        self.stats.written_args = tuple(a.name for a in self.written.values())

    # ---- the step budget: every instruction and every iteration of an nl loop is one step
    def step(self, loop: bool = False) -> None:
        self.steps += 1
        if loop:
            self.loop_iterations += 1
        if self.max_steps is not None and self.steps > self.max_steps:
            self._over_budget()

    def _over_budget(self) -> None:
        instructions = self.steps - self.loop_iterations
        raise NkiBudgetError(
            f"NKI kernel {self.kernel or '(unnamed)'} ran over the emulator's budget of {self.max_steps:,} steps "
            f"({instructions:,} instructions issued and {self.loop_iterations:,} iterations of nl loops so far): "
            "is one of its loops endless? If the kernel really is this long, raise the budget with the "
            f"environment variable {MAX_STEPS_ENV}=<steps> (0: no limit) or nki.simulate(kernel, max_steps=...)"
        )

    # ---- writes into the kernel's arguments (what nki_op checks against its mutates_args)
    def note_write(self, dst: NkiTensor) -> None:
        arg = dst._alloc
        if type(arg) is KernelArg:
            self.written.setdefault(id(arg), arg)

    # ---- capacity
    def allocate(self, buffer: Buffer, per_partition: int, what: str) -> tuple[str, tuple[int, ...], int] | None:
        """Reserve ``per_partition`` bytes of ``buffer`` for the current program; the token frees them."""
        pid = self.program_id
        if buffer == "sbuf":
            cap = self.gen.sbuf_usable_bytes_per_partition
            if self.sbuf_used + per_partition > cap:
                raise NkiCapacityError(
                    f"SBUF capacity exceeded on {self.gen.name}: {what} needs {per_partition} B per partition "
                    f"with {self.sbuf_used} B already live, of {cap} B usable per partition "
                    f"({self.gen.sbuf_bytes_per_partition} minus {self.gen.sbuf_reserved_bytes_per_partition} "
                    "reserved for the compiler). Use smaller tiles or let earlier tiles go out of scope."
                )
            self._mem()[0][0] += per_partition
            self.stats.sbuf_peak_bytes_per_partition = max(self.stats.sbuf_peak_bytes_per_partition, self.sbuf_used)
            return ("sbuf", pid, per_partition)
        if buffer == "psum":
            bank = self.gen.psum_bytes_per_partition // self.gen.psum_banks
            if per_partition > bank:
                raise NkiValidationError(
                    f"PSUM tensor {what} takes {per_partition} B per partition, more than one PSUM bank "
                    f"({bank} B = {bank // 4} fp32 elements, nl.tile_size.psum_fmax); split its free dim"
                )
            for i, used in enumerate(self.psum_banks):
                if used + per_partition <= bank:
                    self.psum_banks[i] += per_partition
                    live = sum(self.psum_banks)
                    self.stats.psum_peak_bytes_per_partition = max(self.stats.psum_peak_bytes_per_partition, live)
                    return ("psum", pid, i * 1_000_000 + per_partition)
            raise NkiCapacityError(
                f"PSUM capacity exceeded on {self.gen.name}: {what} needs {per_partition} B per partition but "
                f"all {self.gen.psum_banks} banks of {bank} B are taken (used per bank: {self.psum_banks}). "
                "Reuse PSUM tiles across loop iterations or let earlier ones go out of scope (del)."
            )
        return None

    def release(self, token: tuple[str, tuple[int, ...], int]) -> None:
        kind, pid, val = token
        sbuf_used, psum_banks = self._mem(pid)
        if kind == "sbuf":
            sbuf_used[0] -= val
        else:
            psum_banks[val // 1_000_000] -= val % 1_000_000

    # ---- counters
    def count(
        self,
        engine: str,
        kind: str,
        partitions: int,
        free: int,
        itemsize_: int = 4,
        reads: tuple = (),
        writes: tuple = (),
    ) -> None:
        """Count one compute instruction and schedule it (``reads``/``writes``: its operand tensors)."""
        self.step()
        e = self.stats.engines[engine]
        e.instructions += 1
        e.elements += partitions * free
        cyc = _cost.instruction_cycles(self.gen, engine, kind, free, partitions, itemsize_)
        e.cycles += cyc
        self.timeline().compute(engine, cyc, reads, writes)

    def count_dma(self, src: NkiTensor, dst: NkiTensor, nbytes: int) -> None:
        """Schedule one DMA transfer of ``nbytes`` (counted by the caller)."""
        on_chip = dst if dst.buffer.on_chip else src
        parts = on_chip.partitions if on_chip.buffer.on_chip else min(PMAX, max(1, dst.shape[0] if dst.ndim else 1))
        self.timeline().dma(nbytes, parts, (src,), (dst,))


_local = threading.local()


def current_run() -> Run:
    """The run a kernel executes in (a default trn2 run outside ``simulate``, e.g. for nl.* at top level)."""
    stack = getattr(_local, "stack", None)
    if not stack:
        if not hasattr(_local, "default"):
            _local.default = Run()
        return _local.default
    return stack[-1]


def run_rng() -> np.random.Generator:
    """The current run's generator for nl.rand / dropout (seeded by nl.random_seed; not the device's stream)."""
    run = current_run()
    if not hasattr(run, "rng"):
        run.rng = np.random.default_rng(0)
    return run.rng


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


class ArgWrite:
    """One argument a finished kernel run wrote: the kernel, its parameter, what the caller passed."""

    __slots__ = ("kernel", "param", "source")

    def __init__(self, kernel: str, param: str, source: Any):
        self.kernel, self.param, self.source = kernel, param, source


class watch_arg_writes:
    """``with watch_arg_writes() as writes:``: ``writes`` collects an :class:`ArgWrite` for every HBM
    argument written by each kernel run finished on this thread inside the block (shape-only runs too)."""

    def __enter__(self) -> list[ArgWrite]:
        self.writes: list[ArgWrite] = []
        if not hasattr(_local, "watchers"):
            _local.watchers = []
        _local.watchers.append(self.writes)
        return self.writes

    def __exit__(self, *exc: Any) -> None:
        _local.watchers.remove(self.writes)


def report_arg_writes(run: Run) -> None:
    """Hand the arguments a finished run wrote to the active :class:`watch_arg_writes` blocks."""
    watchers = getattr(_local, "watchers", None)
    if watchers and run.written:
        writes = [ArgWrite(run.kernel, a.name, a.source) for a in run.written.values()]
        for w in watchers:
            w.extend(writes)


def last_run_stats() -> RunStats | None:
    """Counters of the last kernel run finished on this thread (None before the first one)."""
    return getattr(_local, "last_stats", None)


# ---------------------------------------------------------------------------------------------- tensors
class KernelArg:
    """One HBM argument of a kernel run: the ``_alloc`` of every view of it, so the run knows which of its
    arguments a kernel wrote (``Run.note_write``). ``source`` is what the caller passed (a torch tensor,
    a NumPy array or a fake tensor in shape-only mode)."""

    __slots__ = ("__weakref__", "name", "source")

    def __init__(self, name: str, source: Any):
        self.name = name
        self.source = source


class _Alloc:
    """Owner of one allocation's capacity; freed when the last view of it goes away."""

    __slots__ = ("__weakref__", "bank", "name")

    def __init__(self, run: Run, buffer: Buffer, per_partition: int, name: str):
        self.name = name
        token = run.allocate(buffer, per_partition, name)
        # the PSUM bank: the cost model orders instructions on the physical bank, which tiles reuse
        self.bank = token[2] // 1_000_000 if token is not None and token[0] == "psum" else None
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

    __slots__ = ("_alloc", "_arr", "_root", "_written", "buffer", "dtype", "name", "p0", "pstep")

    def __init__(
        self,
        arr: np.ndarray,
        dtype: str,
        buffer: Buffer,
        alloc: Any = None,
        name: str = "",
        written: np.ndarray | None = None,
        p0: int = 0,
        pstep: int = 1,
        root: tuple[np.ndarray, np.ndarray | None] | None = None,
    ):
        self.p0 = p0  # first partition of this view in its allocation (on chip)
        self.pstep = pstep  # partition stride of this view (compute engines need 1)
        self._arr = arr
        self._written = written
        # the whole allocation (storage and PSUM written-mask): what ``.ap`` patterns index, flattened
        self._root = (arr, written) if root is None else root
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
    def _view(
        self, arr: np.ndarray, written: np.ndarray | None = None, p0: int | None = None, pstep: int | None = None
    ) -> NkiTensor:
        return NkiTensor(
            arr,
            self.dtype,
            self.buffer,
            self._alloc,
            self.name,
            written,
            self.p0 if p0 is None else p0,
            self.pstep if pstep is None else pstep,
            self._root,
        )

    def _normalize_key(self, key: Any) -> tuple:
        key = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis for k in key):
            i = next(i for i, k in enumerate(key) if k is Ellipsis)
            fill = self.ndim - (len(key) - 1)
            key = key[:i] + (slice(None),) * fill + key[i + 1 :]
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
                        f"access out of bound: [{start}:{stop}] on dim {d} (size {n}) of {_fmt_shape(self)}"
                    )
                out.append(slice(start, stop, step))
            elif isinstance(k, (int, np.integer)):
                k = int(k)
                if not -n <= k < n:
                    raise NkiOutOfBoundsError(
                        f"access out of bound: index {k} on dim {d} (size {n}) of {_fmt_shape(self)}"
                    )
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
            "nisa.tensor_copy / nisa.dma_copy (or nl.store for HBM)"
        )

    def reshape(self, shape: Any) -> NkiTensor:
        """A view with another shape and the same element count (storage must be contiguous)."""
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        if math.prod(shape) != self.size:
            raise NkiValidationError(
                f"reshape of {_fmt_shape(self)} to {list(shape)} changes the element count "
                f"({self.size} -> {math.prod(shape)})"
            )
        _check_partitions(shape, self.buffer, "reshape")
        if current_run().shape_only:
            w = None if self._written is None else np.broadcast_to(np.zeros((), bool), shape)
            return self._view(np.broadcast_to(np.zeros((), self._arr.dtype), shape), w)
        arr = self._arr.reshape(shape)
        if not np.shares_memory(arr, self._arr) and self._arr.size:
            raise NkiError(f"reshape of non-contiguous view {_fmt_shape(self)} would copy; reshape the base tensor")
        return self._view(arr, None if self._written is None else self._written.reshape(shape))

    def broadcast(self, dim: int, size: int) -> NkiTensor:
        """A read-only view repeating size-1 dim ``dim`` ``size`` times (not dim 0 on chip)."""
        n = size
        if self.buffer.on_chip and dim == 0:
            raise NkiValidationError(
                f"broadcast along the partition dim of on-chip {_fmt_shape(self)} "
                "is not a view; copy per partition instead"
            )
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
        try:
            root = (self._root[0].view(np_dtype(name)), self._root[1])
        except ValueError:
            root = None
        return NkiTensor(
            self._arr.view(np_dtype(name)),
            name,
            self.buffer,
            self._alloc,
            self.name,
            p0=self.p0,
            pstep=self.pstep,
            root=root,
        )

    reinterpret_cast = view

    # ---- the documented view primitives of NkiTensor (NKI 0.6): metadata only, storage shared
    def _no_partition_dim(self, dim: int, what: str) -> None:
        if self.buffer.on_chip and dim == 0:
            raise NkiValidationError(
                f"NkiTensor.{what}: dim 0 of on-chip {_fmt_shape(self)} is the partition "
                "dim, which this view cannot change"
            )

    def _dim(self, dim: int, what: str, extra: int = 0) -> int:
        n = self.ndim + extra
        if not -n <= int(dim) < n:
            raise NkiError(f"NkiTensor.{what}: dim {dim} out of range for {_fmt_shape(self)}")
        return int(dim) % n

    def _mapped(self, fn: Any) -> NkiTensor:
        return self._view(fn(self._arr), None if self._written is None else fn(self._written))

    def permute(self, dims: tuple[int, ...]) -> NkiTensor:
        """Reorder the dims (a view); on chip ``dims[0]`` must be 0."""
        dims = tuple(self._dim(d, "permute") for d in dims)
        if sorted(dims) != list(range(self.ndim)):
            raise NkiValidationError(
                f"NkiTensor.permute: {tuple(dims)} is not a permutation of range({self.ndim}) for {_fmt_shape(self)}"
            )
        if self.buffer.on_chip and dims[0] != 0:
            raise NkiValidationError(
                f"NkiTensor.permute: on-chip {_fmt_shape(self)} keeps the partition dim "
                f"first; dims[0] must be 0, got {tuple(dims)}"
            )
        return self._mapped(lambda a: a.transpose(dims))

    def expand_dim(self, dim: int) -> NkiTensor:
        """Insert a size-1 dim at ``dim`` (not 0 on chip)."""
        d = self._dim(dim, "expand_dim", extra=1)
        self._no_partition_dim(d, "expand_dim")
        return self._mapped(lambda a: np.expand_dims(a, d))

    def squeeze_dim(self, dim: int) -> NkiTensor:
        """Remove size-1 dim ``dim`` (not 0 on chip)."""
        d = self._dim(dim, "squeeze_dim")
        self._no_partition_dim(d, "squeeze_dim")
        if self.shape[d] != 1:
            raise NkiValidationError(f"NkiTensor.squeeze_dim: dim {d} of {_fmt_shape(self)} is not 1")
        return self._mapped(lambda a: a.squeeze(d))

    def reshape_dim(self, dim: int, shape: tuple[int, ...]) -> NkiTensor:
        """Split dim ``dim`` into ``shape`` (one entry may be -1)."""
        d = self._dim(dim, "reshape_dim")
        shape = [int(s) for s in shape]
        if shape.count(-1) == 1:
            known = math.prod(s for s in shape if s != -1)
            shape[shape.index(-1)] = self.shape[d] // known if known else 0
        if math.prod(shape) != self.shape[d]:
            raise NkiValidationError(
                f"NkiTensor.reshape_dim: {shape} does not multiply to dim {d} ({self.shape[d]}) of {_fmt_shape(self)}"
            )
        if len(shape) > 1:
            self._no_partition_dim(d, "reshape_dim")
        new = (*self.shape[:d], *shape, *self.shape[d + 1 :])
        return self._mapped(
            lambda a: a.reshape(new) if current_run().shape_only else _reshape_view(a, new, self, "reshape_dim")
        )

    def flatten_dims(self, start_dim: int, end_dim: int) -> NkiTensor:
        """Merge dims ``start_dim..end_dim`` (inclusive; contiguous in storage; start > 0 on chip)."""
        a, b = self._dim(start_dim, "flatten_dims"), self._dim(end_dim, "flatten_dims")
        if self.buffer.on_chip and a == 0:
            raise NkiValidationError(f"NkiTensor.flatten_dims: start_dim must be > 0 for on-chip {_fmt_shape(self)}")
        new = (*self.shape[:a], math.prod(self.shape[a : b + 1]), *self.shape[b + 1 :])
        return self._mapped(
            lambda x: x.reshape(new) if current_run().shape_only else _reshape_view(x, new, self, "flatten_dims")
        )

    def slice(self, dim: int, start: int, end: int, step: int = 1) -> NkiTensor:
        """``t[..., start:end:step, ...]`` on dim ``dim``."""
        d = self._dim(dim, "slice")
        return self[(slice(None),) * d + (slice(int(start), int(end), int(step)),)]

    def select(self, dim: int, index: Any) -> NkiTensor:
        """Drop dim ``dim`` at ``index`` (an int, or a 1x1 SBUF tensor / NkiScalar read at run time)."""
        d = self._dim(dim, "select")
        self._no_partition_dim(d, "select")
        i = _runtime_int(index, "NkiTensor.select")
        if not 0 <= i < self.shape[d]:
            raise NkiOutOfBoundsError(
                f"NkiTensor.select: index {i} on dim {d} (size {self.shape[d]}) of {_fmt_shape(self)}"
            )
        key = (slice(None),) * d + (i,)
        return self._view(self._arr[key], None if self._written is None else self._written[key])

    def is_indirect(self) -> bool:
        return False

    @property
    def data(self) -> NkiTensor:
        """The tensor itself (grids and tensors both expose their operand as ``.data`` in NKI 0.7)."""
        return self

    @property
    def strides(self) -> tuple[int, ...]:
        """Element strides of this view in its allocation."""
        return tuple(int(s) // self._arr.itemsize for s in self._arr.strides)

    @property
    def offset(self) -> int:
        """Element offset of this view's first element in its allocation."""
        base = self._root[0]
        if base.size == 0 or self._arr.size == 0:
            return 0
        return (self._arr.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // self._arr.itemsize

    def get_pattern(self) -> list[list[int]]:
        """This view as ``[[stride, count], ...]`` over its allocation (the input of :meth:`ap`)."""
        return [[st, n] for st, n in zip(self.strides, self.shape)]

    def is_contiguous(self) -> bool:
        dims = list(zip(self.shape, self.strides))[1 if self.buffer.on_chip else 0 :]
        expect = 1
        for n, st in reversed(dims):
            if n != 1 and st != expect:
                return False
            expect *= n
        return True

    def ap(
        self,
        pattern: Any,
        offset: int = 0,
        scalar_offset: Any = None,
        vector_offset: Any = None,
        indirect_dim: int = 0,
        dtype: Any = None,
    ) -> NkiTensor:
        """A hardware access pattern: element ``[i0, i1, ...]`` of the result is element
        ``offset + sum(step_k * i_k)`` of this tensor's allocation flattened, counted from this view's first
        element, with ``pattern = [[step_0, count_0], ...]``. On chip the first pair is the partition access
        and its step must be the allocation's free size. ``scalar_offset`` (an int, a 1x1 SBUF tensor or an
        NkiScalar) moves the start by that many steps of dim ``indirect_dim``; ``dtype`` reinterprets the
        storage (pattern and offset then count elements of that dtype)."""
        if vector_offset is not None:
            raise NkiUnsupportedError(
                "NkiTensor.ap(vector_offset=...) (per-partition indirect addressing) is "
                "not implemented by the emulator; use nl.load per index or a static pattern"
            )
        pat = [(int(st), int(n)) for st, n in pattern]
        if not pat or any(n <= 0 for _, n in pat):
            raise NkiValidationError(f"NkiTensor.ap: pattern {pattern} needs [step, count] pairs with count > 0")
        root, root_w = self._root
        name = self.dtype if dtype is None else dtype_name(dtype)
        ratio_num, ratio_den = self.itemsize, itemsize(name)
        start = (self.offset * ratio_num) // ratio_den + int(offset)
        if scalar_offset is not None:
            if not 0 <= int(indirect_dim) < len(pat):
                raise NkiValidationError(f"NkiTensor.ap: indirect_dim {indirect_dim} outside pattern {pattern}")
            start += _runtime_int(scalar_offset, "NkiTensor.ap(scalar_offset=...)") * pat[int(indirect_dim)][0]
        total = root.size * ratio_num // ratio_den
        p0 = 0
        if self.buffer.on_chip:
            free = total // root.shape[0]
            if pat[0][1] > 1 and pat[0][0] != free:
                raise NkiValidationError(
                    f"NkiTensor.ap: on-chip pattern {pattern} must start with the partition access [{free}, P] "
                    f"(step = the allocation's {free} elements per partition; partitions are contiguous)"
                )
            if pat[0][1] > PMAX:
                raise NkiValidationError(
                    f"NkiTensor.ap: Size of partition dimension {pat[0][1]} exceeds maximum {PMAX}"
                )
            p0 = start // free
        lo = start + sum(min(0, (n - 1) * st) for st, n in pat)
        hi = start + sum(max(0, (n - 1) * st) for st, n in pat)
        if lo < 0 or hi >= total:
            raise NkiOutOfBoundsError(
                f"NkiTensor.ap: pattern {pattern} at offset {start} reaches elements "
                f"[{lo}, {hi}] of {_fmt_shape(self)}'s allocation of {total} elements"
            )
        shape = tuple(n for _, n in pat)
        if current_run().shape_only or root.strides == (0,) * root.ndim:
            arr = np.broadcast_to(np.zeros((), np_dtype(name)), shape)
            w = None if root_w is None else np.broadcast_to(np.zeros((), bool), shape)
            return NkiTensor(arr, name, self.buffer, self._alloc, self.name, w, p0, 1, self._root)
        if not root.flags.c_contiguous:
            raise NkiUnsupportedError(
                f"NkiTensor.ap on {_fmt_shape(self)}: its storage is a non-contiguous "
                "array (pass a contiguous tensor to the kernel)"
            )
        flat = root.reshape(-1).view(np_dtype(name)) if name != self.dtype else root.reshape(-1)
        isz = flat.itemsize
        arr = np.lib.stride_tricks.as_strided(flat[start:], shape, tuple(st * isz for st, _ in pat))
        w = None
        if root_w is not None:
            if name != self.dtype:
                raise NkiUnsupportedError("NkiTensor.ap(dtype=...) on a PSUM tensor")
            w = np.lib.stride_tricks.as_strided(root_w.reshape(-1)[start:], shape, tuple(st for st, _ in pat))
        new_root = (root.view(np_dtype(name)) if name != self.dtype else root, root_w)
        return NkiTensor(arr, name, self.buffer, self._alloc, self.name, w, p0, 1, new_root)

    def indirect(self, index: Any, num_elem: Any = None) -> NkiTensor:
        raise NkiUnsupportedError("NkiTensor.indirect (tensor indirection, NC-v4) is not implemented by the emulator")

    indirect.__nki_unsupported__ = "tensor indirection (NC-v4) is not emulated"

    def vector_select(self, dim: int, vector_offset: Any) -> NkiTensor:
        raise NkiUnsupportedError(
            "NkiTensor.vector_select (per-partition indirect addressing) is not implemented by the emulator"
        )

    vector_select.__nki_unsupported__ = "per-partition indirect addressing is not emulated"

    def rearrange(self, src_pattern: tuple, dst_pattern: tuple, fixed_sizes: dict[str, int] | None = None) -> NkiTensor:
        """einops-style split / reorder / merge of dims, as a view (built from reshape_dim/permute/flatten)."""
        fixed = dict(fixed_sizes or {})
        names: list[str] = []
        t = self
        d = 0
        for item in src_pattern:  # split grouped source dims
            group = (item,) if isinstance(item, str) else tuple(item)
            if len(group) > 1:
                unknown = [g for g in group if g not in fixed]
                sizes = tuple(fixed.get(g, -1) for g in group)
                if len(unknown) > 1:
                    raise NkiValidationError(f"NkiTensor.rearrange: sizes of {unknown} are ambiguous; pass fixed_sizes")
                t = t.reshape_dim(d, sizes)
            for j, g in enumerate(group):
                fixed.setdefault(g, t.shape[d + j])
            names += group
            d += len(group)
        flat_dst = [g for item in dst_pattern for g in ((item,) if isinstance(item, str) else tuple(item))]
        if sorted(flat_dst) != sorted(names):
            raise NkiValidationError(f"NkiTensor.rearrange: {dst_pattern} does not name the dims of {src_pattern}")
        t = t.permute(tuple(names.index(g) for g in flat_dst))
        d = 0
        for item in dst_pattern:  # merge grouped destination dims
            n = 1 if isinstance(item, str) else len(item)
            if n > 1:
                t = t.flatten_dims(d, d + n - 1)
            d += 1
        return t

    # ---- host access (only outside kernels / in tests)
    def numpy(self) -> np.ndarray:
        return np.array(self._arr)


def _reshape_view(a: np.ndarray, shape: tuple[int, ...], t: NkiTensor, what: str) -> np.ndarray:
    out = a.reshape(shape)
    if a.size and not np.shares_memory(out, a):
        raise NkiValidationError(
            f"NkiTensor.{what} of {_fmt_shape(t)}: its layout is not contiguous across the "
            "merged/split dims (after a permute or a strided slice), so no view exists"
        )
    return out


def _runtime_int(x: Any, what: str) -> int:
    """The value of an index known only at run time: an int, an NkiScalar, or a 1x1 SBUF/HBM tensor."""
    if isinstance(x, (int, np.integer)):
        return int(x)
    v = getattr(x, "nki_scalar_value", None)
    if v is not None:
        return int(v())
    if isinstance(x, NkiTensor):
        if x.size != 1:
            raise NkiValidationError(f"{what}: a run-time index must be a 1x1 tensor, got {_fmt_shape(x)}")
        return 0 if current_run().shape_only else int(np.asarray(x._arr, np.float64).reshape(-1)[0])
    raise NkiError(f"{what}: index {x!r} must be an int, an NkiScalar or a 1x1 tensor")


def _check_partitions(shape: tuple[int, ...], buffer: Buffer, what: str) -> None:
    if buffer.on_chip:
        if len(shape) < 1:
            raise NkiValidationError(f"{what}: an on-chip tensor needs a partition dim, got shape {list(shape)}")
        if shape[0] > PMAX:
            raise NkiValidationError(
                f"{what}: Size of partition dimension {shape[0]} exceeds maximum {PMAX} "
                f"(nl.tile_size.pmax) for {buffer} tensor of shape {list(shape)}"
            )


def new_tensor(shape: Any, dtype: Any, buffer: Buffer | str = sbuf, name: str = "", fill: Any = None) -> NkiTensor:
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
    alloc = _Alloc(run, buffer, per_part, f"{name or 'tensor'}{list(shape)}:{name_}") if buffer.on_chip else None
    if buffer == "shared_hbm" and len(run.grid_ids) > 1:
        # SPMD/LNC programs share shared_hbm: the k-th such allocation of every program is the same tensor
        k = run.shared_next
        run.shared_next += 1
        if k < len(run.shared_allocs):
            prev = run.shared_allocs[k]
            if prev.shape != shape or prev.dtype != name_:
                raise NkiValidationError(
                    f"nl.ndarray {name!r}: shared_hbm allocation #{k} is {list(prev.shape)}:{prev.dtype} in program 0 "
                    f"but {list(shape)}:{name_} in program {run.program_id}; every program must allocate the same "
                    "shared tensors (control flow must be the same on every core)"
                )
            return prev
    value = fill_value(name_) if fill is None else fill
    if run.shape_only:
        arr = np.broadcast_to(np.zeros((), np_dtype(name_)), shape)
        written = np.broadcast_to(np.zeros((), bool), shape) if buffer == "psum" else None
    else:
        arr = np.full(shape, value, dtype=np_dtype(name_)) if name_ != "tfloat32" else np.full(shape, value, np.float32)
        written = np.zeros(shape, bool) if buffer == "psum" else None
    t = NkiTensor(arr, name_, buffer, alloc, name, written)
    if buffer == "shared_hbm" and len(run.grid_ids) > 1:
        run.shared_allocs.append(t)
    return t


def wrap_hbm(arr: np.ndarray, name: str = "", shape_only: bool = False) -> NkiTensor:
    """An HBM kernel argument viewing ``arr`` (no copy: in-place writes reach the caller)."""
    dt = dtype_name(arr.dtype)
    if np.dtype(arr.dtype) != np_dtype(dt):
        arr = arr.astype(np_dtype(dt))
    return NkiTensor(arr, dt, hbm, None, name)


# ------------------------------------------------------------------------------------- run-time scalars
_I32 = 1 << 32


def _wrap32(v: int) -> int:
    return (v + (1 << 31)) % _I32 - (1 << 31)


class NkiScalar:
    """A run-time integer (NKI 0.7 ``NkiScalar``; also stands in for 0.6's ``VirtualRegister``).

    Arithmetic on it is traced in NKI; here it is evaluated (32-bit values wrap, as documented). It cannot
    steer Python control flow or index with ``[...]``: use ``nl.if_else``/``nl.while_loop`` and
    ``.ap(scalar_offset=...)``/``.select(dim, scalar)``, as on the device.
    """

    __slots__ = ("_v", "dtype")

    def __init__(self, value: int = 0, dtype: str = "int32"):
        self.dtype = dtype
        self._v = _wrap32(int(value)) if dtype != "int64" else int(value)

    def nki_scalar_value(self) -> int:
        return self._v

    def _bin(self, other: Any, fn: Any, reverse: bool = False, allowed64: bool = True) -> NkiScalar:
        o = other._v if isinstance(other, NkiScalar) else int(other)
        if self.dtype == "int64" and not allowed64:
            raise NkiValidationError("int64 NkiScalar supports only +, - and * (NKI 0.7 docs)")
        a, b = (o, self._v) if reverse else (self._v, o)
        dt = "int64" if "int64" in (self.dtype, getattr(other, "dtype", "")) else self.dtype
        return NkiScalar(fn(a, b), dt)

    def __add__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a + b)

    def __radd__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a + b, True)

    def __sub__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a - b)

    def __rsub__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a - b, True)

    def __mul__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a * b)

    def __rmul__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a * b, True)

    def __floordiv__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a // b, allowed64=False)

    def __mod__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a % b, allowed64=False)

    def __and__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a & b, allowed64=False)

    def __or__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a | b, allowed64=False)

    def __xor__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a ^ b, allowed64=False)

    def __lshift__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a << b, allowed64=False)

    def __rshift__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a >> b, allowed64=False)

    def __lt__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: int(a < b))

    def __le__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: int(a <= b))

    def __gt__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: int(a > b))

    def __ge__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: int(a >= b))

    def __eq__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: int(a == b))

    def __ne__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: int(a != b))

    def __neg__(self) -> NkiScalar:
        return NkiScalar(-self._v, self.dtype)

    __hash__ = object.__hash__

    def __bool__(self) -> bool:
        if current_run().nki_version == "0.6":  # 0.6 still ran bare `while reg:` loops (deprecated; gone in 0.7)
            warnings.warn(
                "a bare `while reg:` loop on a register is deprecated in NKI 0.6 (Neuron 2.32) and removed in 0.7; "
                "use nl.while_loop",
                DeprecationWarning,
                stacklevel=2,
            )
            return self._v != 0
        raise NkiError(
            "an NkiScalar is a run-time value: it cannot decide a Python `if`/`while` at trace time; "
            "use nl.if_else / nl.while_loop (bare `while reg:` loops were removed in NKI 0.7)"
        )

    def __index__(self) -> int:
        raise NkiError(
            "an NkiScalar is a run-time value: it cannot index with [...]; use "
            "tensor.ap(..., scalar_offset=s) or tensor.select(dim, s)"
        )

    def __repr__(self) -> str:
        return f"NkiScalar({self._v}, {self.dtype})"
