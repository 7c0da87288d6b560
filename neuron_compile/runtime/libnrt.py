"""The Neuron runtime, ``libnrt.so.1``, through ctypes: every libnrt call of the project is in this module.

NOT RUN ON HARDWARE. Written against the runtime's public headers (``nrt/nrt.h``, ``nrt_experimental.h``,
``nrt_status.h`` in aws-neuron/aws-neuron-sdk; the facts are summarized in the docs' "Running on Trainium"
page) and tested against the device simulator in ``tests/device_sim`` (a C library with the same symbols,
structs and status codes). The call order is the runtime guide's: ``nrt_init`` once per process, ``nrt_load``
each NEFF once per core, ``nrt_get_model_tensor_info``, one tensor per name in an input and an output set,
``nrt_tensor_write`` the inputs, ``nrt_execute``, ``nrt_tensor_read`` the outputs; at the end ``nrt_unload``
and ``nrt_close``.

Residency: host tensors are written to the NeuronCore at every call, because no cheap check proves that a
host tensor is unchanged (torch does not count ``p.data.copy_``, writes through ``.numpy()`` or the fused
optimizers' updates in the version counter). ``input_residency="version_counter"`` (a user contract, off by
default) skips an input that is the tensor written last time, at the same memory, with the same version
counter. Buffers this backend made itself and never hands out (``owned_constant``) are written once.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import logging
import math
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..errors import NeuronRuntimeError
from ..stats import STATS

log = logging.getLogger(__name__)

#: The explicit path of libnrt.so.1 (the device simulator sets it; so may a non-standard install).
LIBRARY_ENV = "NEURON_COMPILE_LIBNRT"
#: Where the Neuron runtime package (aws-neuronx-runtime-lib) installs the library.
DEFAULT_LIBRARY = "/opt/aws/neuron/lib/libnrt.so.1"

# nrt.h enums
NRT_FRAMEWORK_TYPE_PYTORCH = 3
NRT_TENSOR_PLACEMENT_DEVICE = 0
NRT_TENSOR_USAGE_INPUT = 0
NRT_TENSOR_USAGE_OUTPUT = 1

#: nrt_status.h: status -> (name, what a user can do about it).
STATUS: dict[int, tuple[str, str]] = {
    0: ("NRT_SUCCESS", ""),
    1: ("NRT_FAILURE", "the runtime failed; its log (NEURON_RT_LOG_LEVEL=INFO) says why"),
    2: (
        "NRT_INVALID",
        "the NEFF or a tensor given to the runtime was refused (a name or byte size that does not "
        "match the NEFF, a read or write out of a tensor's bounds, a NEFF compiled for another logical-core "
        "setting: the compiler's --lnc must equal NEURON_LOGICAL_NC_CONFIG); clear the compile cache entry "
        "(neuron-compile cache clear) and report it with `neuron-compile doctor --bundle`",
    ),
    3: ("NRT_INVALID_HANDLE", "a model or tensor handle was used after it was freed: report it as a bug"),
    4: (
        "NRT_RESOURCE",
        "the NeuronCore is out of a resource (device memory or DMA rings): a smaller batch, "
        "fewer models loaded on this core, or another core (option neuron_core)",
    ),
    5: (
        "NRT_TIMEOUT",
        "the execution timed out (NEURON_RT_EXEC_TIMEOUT); a hung core may need `neuron-top`/a reboot of the instance",
    ),
    6: ("NRT_HW_ERROR", "the hardware reported an error: check `neuron-ls` and the instance's health"),
    7: ("NRT_QUEUE_FULL", "the core's execution queue is full: retry, or call from fewer threads"),
    9: (
        "NRT_LOAD_NOT_ENOUGH_NC",
        "not enough NeuronCores are visible to this process: check "
        "NEURON_RT_VISIBLE_CORES / NEURON_RT_NUM_CORES and the option neuron_core (under torchrun, LOCAL_RANK)",
    ),
    10: (
        "NRT_UNSUPPORTED_NEFF_VERSION",
        "the NEFF was made by a neuronx-cc newer than this runtime accepts: "
        "install matching Neuron SDK versions of aws-neuronx-cc and aws-neuronx-runtime-lib",
    ),
    11: ("NRT_FAIL_HOST_MEM_ALLOC", "the host is out of memory for the runtime's buffers"),
    13: ("NRT_UNINITIALIZED", "the runtime was not initialized (a call before nrt_init): report it as a bug"),
    14: ("NRT_CLOSED", "the runtime was already closed (a call at interpreter exit): report it as a bug"),
    1002: (
        "NRT_EXEC_BAD_INPUT",
        "the runtime refused an input of the execution; check the graph's inputs for out-of-range indices",
    ),
    1003: (
        "NRT_EXEC_COMPLETED_WITH_NUM_ERR",
        "the execution produced NaN or Inf (a numerical error): run the "
        "graph with options={'target': 'cpu'} to see where",
    ),
    1004: ("NRT_EXEC_COMPLETED_WITH_ERR", "the execution completed with an error: its log says which"),
    1005: (
        "NRT_EXEC_NC_BUSY",
        "the NeuronCore is in use by another process: give each process its own cores "
        "with NEURON_RT_VISIBLE_CORES (torchrun: one per LOCAL_RANK), or stop the other process (neuron-top "
        "shows it)",
    ),
    1006: (
        "NRT_EXEC_OOB",
        "an indirect load or store (a gather, scatter or embedding index) was out of "
        "bounds: check the indices (options={'target': 'cpu'} raises eager's index error)",
    ),
}
STATUS.update(
    {
        15: ("NRT_QUEUE_EMPTY", "a dequeue found no pending data: report it as a bug (this backend dequeues nothing)"),
        101: (
            "NRT_EXEC_UNIT_UNRECOVERABLE",
            "the NeuronCore's execution unit is in a terminal state after an unrecoverable error (a timeout or a "
            "hardware fault): nothing more runs on it in this process; restart the process (if it persists, reload "
            "the Neuron driver or reboot the instance)",
        ),
        1100: (
            "NRT_COLL_PENDING",
            "a collective operation is still pending: another rank has not reached it; check that every rank runs "
            "the same graphs in the same order",
        ),
        1200: (
            "NRT_EXEC_HW_ERR_COLLECTIVES",
            "a collective hung (notifications missing): a rank died or diverged, or the fabric failed; check every "
            "rank's log and `neuron-ls`",
        ),
        1201: (
            "NRT_EXEC_HW_ERR_HBM_UE",
            "an uncorrectable HBM memory error: the instance needs attention (check its health, move the job)",
        ),
        1202: (
            "NRT_EXEC_HW_ERR_NC_UE",
            "an uncorrectable NeuronCore memory error: retry on another core and check the instance's health",
        ),
        1203: ("NRT_EXEC_HW_ERR_DMA_ABORT", "a DMA engine aborted: retry; if it repeats, check `neuron-ls`"),
        1204: (
            "NRT_EXEC_SW_NQ_OVERFLOW",
            "the runtime's notification queue overflowed (software, not the hardware): retry; too many executions "
            "in flight or a very long graph; report it if it repeats",
        ),
        1205: (
            "NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE",
            "a repairable HBM memory error: restart the process; the runtime repairs the row at the next start",
        ),
        1206: (
            "NRT_NETWORK_PROXY_FAILURE",
            "the network proxy (EFA, collectives across instances) failed: check the network and every rank",
        ),
    }
)


def status_name(status: int) -> str:
    return STATUS.get(status, (f"NRT status {status}", ""))[0]


def check(status: int, call: str, context: str = "") -> None:
    """Raise ``NeuronRuntimeError`` for a non-zero libnrt status, naming it and what to do."""
    if status == 0:
        return
    name, advice = STATUS.get(status, (f"NRT status {status}", "an unknown status: see nrt_status.h"))
    where = f" ({context})" if context else ""
    raise NeuronRuntimeError(f"neuron runtime: {call}{where} returned {name} = {status}: {advice}", status, call)


class _Version(ctypes.Structure):
    """``nrt_version_t`` (nrt_version.h)."""

    _fields_ = [
        ("rt_major", ctypes.c_uint64), ("rt_minor", ctypes.c_uint64), ("rt_patch", ctypes.c_uint64),
        ("rt_maintenance", ctypes.c_uint64), ("rt_detail", ctypes.c_char * 128), ("git_hash", ctypes.c_char * 64),
    ]  # fmt: skip


class _TensorInfo(ctypes.Structure):
    """``nrt_tensor_info_t`` (nrt_experimental.h): 296 bytes on x86-64."""

    _fields_ = [
        ("name", ctypes.c_char * 256),
        ("usage", ctypes.c_int),
        ("size", ctypes.c_size_t),
        ("dtype", ctypes.c_int),
        ("shape", ctypes.POINTER(ctypes.c_uint32)),
        ("ndim", ctypes.c_uint32),
    ]


class _TensorInfoArray(ctypes.Structure):
    """``nrt_tensor_info_array_t``: a count, then that many ``nrt_tensor_info_t`` (a flexible array member)."""

    _fields_ = [("tensor_count", ctypes.c_uint64), ("tensor_array", _TensorInfo * 0)]


_P = ctypes.c_void_p
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "nrt_init": (ctypes.c_int, [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p]),
    "nrt_close": (None, []),
    "nrt_load": (ctypes.c_int, [_P, ctypes.c_size_t, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(_P)]),
    "nrt_load_collectives": (
        ctypes.c_int,
        [_P, ctypes.c_size_t, ctypes.c_int32, ctypes.c_int32, ctypes.c_uint32, ctypes.c_uint32, ctypes.POINTER(_P)],
    ),
    "nrt_unload": (ctypes.c_int, [_P]),
    "nrt_get_model_tensor_info": (ctypes.c_int, [_P, ctypes.POINTER(ctypes.POINTER(_TensorInfoArray))]),
    "nrt_free_model_tensor_info": (ctypes.c_int, [ctypes.POINTER(_TensorInfoArray)]),
    "nrt_allocate_tensor_set": (ctypes.c_int, [ctypes.POINTER(_P)]),
    "nrt_destroy_tensor_set": (None, [ctypes.POINTER(_P)]),
    "nrt_add_tensor_to_tensor_set": (ctypes.c_int, [_P, ctypes.c_char_p, _P]),
    "nrt_tensor_allocate": (
        ctypes.c_int,
        [ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_char_p, ctypes.POINTER(_P)],
    ),
    "nrt_tensor_free": (None, [ctypes.POINTER(_P)]),
    "nrt_tensor_write": (ctypes.c_int, [_P, _P, ctypes.c_size_t, ctypes.c_size_t]),
    "nrt_tensor_read": (ctypes.c_int, [_P, _P, ctypes.c_size_t, ctypes.c_size_t]),
    "nrt_execute": (ctypes.c_int, [_P, _P, _P]),
    "nrt_get_visible_vnc_count": (ctypes.c_int, [ctypes.POINTER(ctypes.c_uint32)]),
    "nrt_get_total_vnc_count": (ctypes.c_int, [ctypes.POINTER(ctypes.c_uint32)]),
    "nrt_get_visible_nc_count": (ctypes.c_int, [ctypes.POINTER(ctypes.c_uint32)]),
    "nrt_get_total_nc_count": (ctypes.c_int, [ctypes.POINTER(ctypes.c_uint32)]),
    "nrt_get_version": (ctypes.c_int, [ctypes.POINTER(_Version), ctypes.c_size_t]),
}


def _bind_library(path: str) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise NeuronRuntimeError(
            f"neuron runtime: cannot load {path}: {e}. Install the Neuron runtime (aws-neuronx-runtime-lib) "
            f"or point {LIBRARY_ENV} at libnrt.so.1",
            -1,
            "dlopen",
        ) from e
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is None:
            if name in _OPTIONAL_SYMBOLS:
                continue
            raise NeuronRuntimeError(
                f"neuron runtime: {path} has no {name}: a runtime older than this backend supports "
                "(aws-neuronx-runtime-lib 2.x with nrt_get_model_tensor_info); upgrade the Neuron runtime",
                -1,
                "dlsym",
            )
        fn.restype, fn.argtypes = restype, argtypes
    return lib


#: Symbols only recent runtimes have: the logical-core counts (older headers count physical ``nc`` cores).
_OPTIONAL_SYMBOLS = frozenset(
    {"nrt_get_visible_vnc_count", "nrt_get_total_vnc_count", "nrt_get_visible_nc_count", "nrt_get_total_nc_count"}
)


def core_counts(lib: ctypes.CDLL) -> tuple[int, int]:
    """(visible, total) NeuronCores as the runtime counts them: ``nrt_get_visible_vnc_count`` and
    ``nrt_get_total_vnc_count`` (logical cores) where the runtime has them, else the older ``nc`` calls."""
    counts = []
    for which in ("visible", "total"):
        for name in (f"nrt_get_{which}_vnc_count", f"nrt_get_{which}_nc_count"):
            fn = getattr(lib, name, None)
            if fn is not None:
                value = ctypes.c_uint32()
                check(fn(ctypes.byref(value)), name)
                counts.append(value.value)
                break
        else:
            raise NeuronRuntimeError(
                f"neuron runtime: the library has neither nrt_get_{which}_vnc_count nor nrt_get_{which}_nc_count",
                -1,
                "dlsym",
            )
    return counts[0], counts[1]


def library_info(path: str) -> dict[str, Any]:
    """The runtime's version and its visible and total logical NeuronCores, read without ``nrt_init`` (which
    would take the cores): for ``neuron-compile doctor``."""
    lib = _bind_library(path)
    version = _Version()
    check(lib.nrt_get_version(ctypes.byref(version), ctypes.sizeof(version)), "nrt_get_version")
    visible, total = core_counts(lib)
    detail = version.rt_detail.decode(errors="replace")
    number = f"{version.rt_major}.{version.rt_minor}.{version.rt_patch}.{version.rt_maintenance}"
    return {"version": f"{number} {detail}".strip(), "visible_cores": visible, "total_cores": total}


def library_path() -> str | None:
    """Where libnrt.so.1 is: ``NEURON_COMPILE_LIBNRT``, the Neuron runtime's install path, or the loader's
    search path; None when it is nowhere."""
    explicit = os.environ.get(LIBRARY_ENV, "").strip()
    if explicit:
        return explicit
    if os.path.exists(DEFAULT_LIBRARY):
        return DEFAULT_LIBRARY
    return loader_library()


#: The library's soname (what dlopen is given when the loader's cache has it).
SONAME = "libnrt.so.1"
#: The dynamic loader's cache of the system's libraries (``ldconfig`` writes it, dlopen reads it).
LOADER_CACHE = "/etc/ld.so.cache"


def loader_library() -> str | None:
    """Where dlopen would find libnrt.so.1: a directory of ``LD_LIBRARY_PATH``, else the loader's cache
    (``SONAME``, as ``ctypes.util.find_library`` answers); None when it would not. Read directly rather than by
    ``find_library``, which runs ``ldconfig -p`` (~30 ms at every ``import neuron_compile`` on a machine
    without the runtime) and then a C compiler when that finds nothing."""
    for directory in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        candidate = os.path.join(directory, SONAME)
        if directory and os.path.exists(candidate):
            return candidate
    try:
        with open(LOADER_CACHE, "rb") as f:
            return SONAME if SONAME.encode() + b"\0" in f.read() else None
    except OSError:
        return None


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a loaded NEFF as the runtime reports it."""

    name: str
    usage: int
    size: int
    dtype: int
    shape: tuple[int, ...]

    def describe(self) -> str:
        kind = "input" if self.usage == NRT_TENSOR_USAGE_INPUT else "output"
        return f"{kind} {self.name} {self.size} bytes {list(self.shape)}"


@dataclass(frozen=True)
class ModuleTensor:
    """One parameter or result of the compiled module: what the graph feeds or expects by position."""

    name: str
    usage: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def size(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def describe(self) -> str:
        kind = "input" if self.usage == NRT_TENSOR_USAGE_INPUT else "output"
        return f"{kind} {self.name} {self.size} bytes {list(self.shape)} {self.dtype}"


def module_tensors(
    params: Sequence[tuple[tuple[int, ...], torch.dtype]], results: Sequence[tuple[tuple[int, ...], torch.dtype]]
) -> list[ModuleTensor]:
    """The tensors a NEFF compiled from the module should have, named as TorchNeuron's NEFFs name them:
    ``input{i}`` per parameter and ``output{i}`` per result, by position."""
    return [ModuleTensor(f"input{i}", NRT_TENSOR_USAGE_INPUT, tuple(s), d) for i, (s, d) in enumerate(params)] + [
        ModuleTensor(f"output{i}", NRT_TENSOR_USAGE_OUTPUT, tuple(s), d) for i, (s, d) in enumerate(results)
    ]


class Runtime:
    """libnrt in this process: initialized once (``runtime()``), closed at exit."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lib = _bind_library(path)
        self.lock = threading.Lock()
        self.closed = False
        status = self.lib.nrt_init(NRT_FRAMEWORK_TYPE_PYTORCH, torch.__version__.encode(), b"")
        if status == 1:  # the runtime takes every visible core at nrt_init; another process holding one fails it
            raise NeuronRuntimeError(
                "neuron runtime: nrt_init returned NRT_FAILURE = 1: most often the NeuronCores visible to this "
                "process are in use by another process (the runtime reserves them all at start: its log says "
                "'NeuronCore(s) not available'). Give each process its own cores with NEURON_RT_VISIBLE_CORES "
                "(e.g. NEURON_RT_VISIBLE_CORES=1; torchrun: one per LOCAL_RANK), or stop the other process "
                "(neuron-top shows it); otherwise the runtime's log (NEURON_RT_LOG_LEVEL=INFO) says why",
                status,
                "nrt_init",
            )
        check(status, "nrt_init")
        atexit.register(self.close)

    def close(self) -> None:
        """Unload every model still loaded, then ``nrt_close`` (at exit; the runtime cannot be used after)."""
        with self.lock:
            if self.closed:
                return
            for model in list(_MODELS.values()):
                model.unload()
            _MODELS.clear()
            self.closed = True
            self.lib.nrt_close()

    def vnc_counts(self) -> tuple[int, int]:
        """(visible, total) logical NeuronCores."""
        return core_counts(self.lib)


_RUNTIME: Runtime | None = None
_RUNTIME_LOCK = threading.Lock()


def runtime() -> Runtime:
    """The process's runtime, initialized at the first call (raises where libnrt is not found)."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None or _RUNTIME.closed:
            path = library_path()
            if path is None:
                raise NeuronRuntimeError(
                    "neuron runtime: libnrt.so.1 was not found (looked at $"
                    + LIBRARY_ENV
                    + ", "
                    + DEFAULT_LIBRARY
                    + " and the loader's path). Install the Neuron runtime (aws-neuronx-runtime-lib) on a Trn2/Trn3 "
                    "instance, or use options={'target': 'cpu'}; `neuron-compile doctor` checks the setup.",
                    -1,
                    "dlopen",
                )
            _own_core_under_torchrun()
            set_root_comm_id()
            from . import visible_cores

            visible_cores.from_environment()  # a value nrt_init would refuse with a bare NRT_FAILURE, named now
            _RUNTIME = Runtime(path)
        return _RUNTIME


def _own_core_under_torchrun() -> None:
    """Under torchrun (LOCAL_RANK set) without NEURON_RT_VISIBLE_CORES, this rank takes core LOCAL_RANK only
    (one logical core per process): the runtime otherwise reserves every core at nrt_init, and the second
    rank's nrt_init fails."""
    local_rank = os.environ.get("LOCAL_RANK", "").strip()
    if local_rank.isdigit() and not os.environ.get("NEURON_RT_VISIBLE_CORES", "").strip():
        os.environ["NEURON_RT_VISIBLE_CORES"] = local_rank
        log.info("neuron_compile: LOCAL_RANK=%s, so NEURON_RT_VISIBLE_CORES=%s", local_rank, local_rank)


#: The runtime's collectives bootstrap address ("host:port" of rank 0), mandatory for collective operators.
ROOT_COMM_ID = "NEURON_RT_ROOT_COMM_ID"
_ROOT_PORT_KEY = "neuron_compile/NEURON_RT_ROOT_COMM_ID_port"


def set_root_comm_id() -> None:
    """Set ``NEURON_RT_ROOT_COMM_ID`` when it is unset and torch.distributed is initialized: ``MASTER_ADDR``
    (else localhost) and a free port that rank 0 picks and shares through the process group's store, as
    torch-neuronx sets it up. Without it the runtime cannot bootstrap collectives."""
    if os.environ.get(ROOT_COMM_ID, "").strip():
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            port = str(s.getsockname()[1])
        store.set(_ROOT_PORT_KEY, port)
    else:
        port = store.get(_ROOT_PORT_KEY).decode()
    os.environ[ROOT_COMM_ID] = f"{os.environ.get('MASTER_ADDR', '').strip() or 'localhost'}:{port}"
    log.info(
        "neuron_compile: %s=%s (set from MASTER_ADDR and a port of rank 0's)", ROOT_COMM_ID, os.environ[ROOT_COMM_ID]
    )


@dataclass
class _Resident:
    """What was last written into one input tensor on the device."""

    source: weakref.ReferenceType | None = None
    data_ptr: int = 0
    geometry: tuple = ()
    version: int = -1


@dataclass
class LoadedModel:
    """One NEFF loaded on one NeuronCore, with its tensors allocated once, shared by every graph using it."""

    key: tuple[str, int, tuple[int, int] | None]
    handle: Any
    vnc: int
    tensors: list[ModuleTensor]
    device_tensors: dict[str, Any]
    input_set: Any
    output_set: Any
    users: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    resident: dict[str, _Resident] = field(default_factory=dict)
    bytes_written: int = 0
    bytes_read: int = 0

    def __post_init__(self) -> None:
        # per call, the inputs in parameter order and the outputs in result order
        self._by_usage = tuple(
            [t for t in self.tensors if t.usage == usage] for usage in (NRT_TENSOR_USAGE_INPUT, NRT_TENSOR_USAGE_OUTPUT)
        )

    def execute(self, inputs: Sequence[torch.Tensor], resident: bool = False) -> list[torch.Tensor]:
        """Run on ``inputs`` (contiguous CPU tensors, one per module parameter); the results as new tensors.
        ``resident``: the user's contract that every write to an input bumps its version counter (option
        ``input_residency``), so an input with the same tensor, memory and version is not written again."""
        lib = runtime().lib
        ins, outs = self._by_usage
        with self.lock:
            written = read = kept = 0
            for spec, t in zip(ins, inputs):
                if (resident or _is_owned_constant(t)) and self._is_resident(spec.name, t):
                    kept += spec.size
                    continue
                check(
                    lib.nrt_tensor_write(self.device_tensors[spec.name], t.data_ptr(), 0, spec.size),
                    "nrt_tensor_write",
                    spec.name,
                )
                self._remember(spec.name, t)
                written += spec.size
            check(
                lib.nrt_execute(self.handle, self.input_set, self.output_set),
                "nrt_execute",
                f"NEFF {self.key[0][:12]} on NeuronCore {self.vnc}",
            )
            results = []
            for spec in outs:
                out = torch.empty(spec.shape, dtype=spec.dtype)
                check(
                    lib.nrt_tensor_read(self.device_tensors[spec.name], out.data_ptr(), 0, spec.size),
                    "nrt_tensor_read",
                    spec.name,
                )
                read += spec.size
                results.append(out)
            self.bytes_written += written
            self.bytes_read += read
        STATS.record_execution(written, read, kept)
        return results

    def _is_resident(self, name: str, t: torch.Tensor) -> bool:
        """Whether the device copy of input ``name`` already holds ``t``'s values: ``t`` (or the tensor it is a
        view of) is the one written last time, alive, at the same memory, unchanged since (its version counter,
        shared by all its views, counts every in-place write, optimizer steps included)."""
        last = self.resident.get(name)
        if last is None or last.source is None or t.is_inference():
            return False
        root = t._base if t._base is not None else t
        return (
            last.source() is root
            and last.data_ptr == t.data_ptr()
            and last.geometry == (t.shape, t.stride(), t.dtype)
            and last.version == t._version
        )

    def _remember(self, name: str, t: torch.Tensor) -> None:
        if t.is_inference():  # inference tensors have no version counter: nothing proves them unchanged
            self.resident.pop(name, None)
            return
        root = t._base if t._base is not None else t
        try:
            source = weakref.ref(root)
        except TypeError:
            source = None
        self.resident[name] = _Resident(source, t.data_ptr(), (t.shape, t.stride(), t.dtype), t._version)

    def unload(self) -> None:
        rt = _RUNTIME
        if rt is None or rt.closed or self.handle is None:
            return
        lib = rt.lib
        for ptr in self.device_tensors.values():
            lib.nrt_tensor_free(ctypes.byref(ptr))
        for tensor_set in (self.input_set, self.output_set):
            lib.nrt_destroy_tensor_set(ctypes.byref(tensor_set))
        lib.nrt_unload(self.handle)
        self.handle = None
        log.info("neuron_compile: unloaded NEFF %s from NeuronCore %d", self.key[0][:12], self.vnc)


def owned_constant(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t``, a host buffer the backend made and keeps to itself (a graph's constant operand), as never
    written after: it stays resident on the core."""
    t._neuron_owned_constant = True
    return t


def _is_owned_constant(t: torch.Tensor) -> bool:
    return getattr(t, "_neuron_owned_constant", False)


#: Loaded NEFFs by (NEFF digest, requested core, collective rank/count).
_MODELS: dict[tuple[str, int, tuple[int, int] | None], LoadedModel] = {}
_MODELS_LOCK = threading.Lock()


def acquire_model(
    neff: bytes, vnc: int, expected: list[ModuleTensor], collectives: tuple[int, int] | None = None
) -> LoadedModel:
    """The NEFF loaded on logical NeuronCore ``vnc`` (of those visible to the process), loading it at the first use and
    sharing it after; ``release_model`` gives it back. ``collectives`` = (global device id, device count)
    loads it with ``nrt_load_collectives``. Raises when the NEFF's tensors are not ``expected``."""
    digest = hashlib.sha256(neff).hexdigest()
    key = (digest, vnc, collectives)
    with _MODELS_LOCK:
        model = _MODELS.get(key)
        if model is None or model.handle is None:
            model = _load(neff, digest, vnc, expected, collectives)
            _MODELS[key] = model
        model.users += 1
        return model


def release_model(model: LoadedModel) -> None:
    """One user fewer; the last one unloads the NEFF (its graphs are gone)."""
    with _MODELS_LOCK:
        model.users -= 1
        if model.users > 0:
            return
        _MODELS.pop(model.key, None)
        model.unload()


def _load(
    neff: bytes, digest: str, vnc: int, expected: list[ModuleTensor], collectives: tuple[int, int] | None
) -> LoadedModel:
    rt = runtime()
    lib = rt.lib
    handle = ctypes.c_void_p()
    buf = ctypes.create_string_buffer(neff, len(neff))
    if collectives is None:
        check(
            lib.nrt_load(buf, len(neff), vnc, -1, ctypes.byref(handle)),
            "nrt_load",
            f"NEFF {digest[:12]}, {len(neff)} bytes, NeuronCore {vnc}",
        )
    else:
        rank, count = collectives
        set_root_comm_id()
        if not os.environ.get(ROOT_COMM_ID, "").strip():
            raise NeuronRuntimeError(
                f"neuron runtime: a NEFF with collectives needs {ROOT_COMM_ID} (host:port of rank 0's collectives "
                "bootstrap), which is unset and cannot be derived without an initialized torch.distributed process "
                f"group: call torch.distributed.init_process_group first, or set {ROOT_COMM_ID}=<MASTER_ADDR>:<free port>",
                2,
                "nrt_load_collectives",
            )
        check(
            lib.nrt_load_collectives(buf, len(neff), vnc, -1, rank, count, ctypes.byref(handle)),
            "nrt_load_collectives",
            f"NEFF {digest[:12]}, NeuronCore {vnc}, device {rank} of {count}",
        )
    try:
        reported = _tensor_info(lib, handle)
        _check_tensors(reported, expected, digest)
        return _bind(lib, handle, digest, vnc, expected, collectives)
    except BaseException:
        lib.nrt_unload(handle)
        raise


def _tensor_info(lib: Any, handle: Any) -> list[TensorInfo]:
    array = ctypes.POINTER(_TensorInfoArray)()
    check(lib.nrt_get_model_tensor_info(handle, ctypes.byref(array)), "nrt_get_model_tensor_info")
    try:
        count = array.contents.tensor_count
        infos = ctypes.cast(ctypes.addressof(array.contents.tensor_array), ctypes.POINTER(_TensorInfo * count)).contents
        return [
            TensorInfo(i.name.decode(), i.usage, i.size, i.dtype, tuple(i.shape[d] for d in range(i.ndim)))
            for i in infos
        ]
    finally:
        lib.nrt_free_model_tensor_info(array)


def tensor_listing(neff: bytes, vnc: int = 0) -> list[TensorInfo]:
    """A NEFF's tensors as the runtime reports them (loaded on ``vnc``, listed, unloaded): what a bug report
    needs to see of how the compiler named and sized them (``neuron-compile doctor --bundle``)."""
    lib = runtime().lib
    handle = ctypes.c_void_p()
    buf = ctypes.create_string_buffer(neff, len(neff))
    check(lib.nrt_load(buf, len(neff), vnc, -1, ctypes.byref(handle)), "nrt_load", f"a NEFF of {len(neff)} bytes")
    try:
        return _tensor_info(lib, handle)
    finally:
        lib.nrt_unload(handle)


def _check_tensors(reported: list[TensorInfo], expected: list[ModuleTensor], digest: str) -> None:
    """The NEFF's tensors must be the module's, by name, direction and byte size (dtype codes are advisory:
    their values changed between runtime releases). What a real NEFF names them has not been seen: this is
    where a surprise shows, with both lists."""
    have = {(t.name, t.usage, t.size) for t in reported}
    want = {(t.name, t.usage, t.size) for t in expected}
    if have == want:
        return
    raise NeuronRuntimeError(
        f"neuron runtime: the NEFF {digest[:12]} does not have the tensors its module declares, so its inputs "
        "cannot be bound. The runtime reports:\n  "
        + "\n  ".join(t.describe() for t in reported)
        + "\nThe module declares:\n  "
        + "\n  ".join(t.describe() for t in expected)
        + "\nReport this with `neuron-compile doctor --bundle report.tar.gz` (it is how neuronx-cc names "
        "tensors that is not known here).",
        2,
        "nrt_get_model_tensor_info",
    )


def _bind(
    lib: Any, handle: Any, digest: str, vnc: int, expected: list[ModuleTensor], collectives: tuple[int, int] | None
) -> LoadedModel:
    sets = {}
    for usage in (NRT_TENSOR_USAGE_INPUT, NRT_TENSOR_USAGE_OUTPUT):
        tensor_set = ctypes.c_void_p()
        check(lib.nrt_allocate_tensor_set(ctypes.byref(tensor_set)), "nrt_allocate_tensor_set")
        sets[usage] = tensor_set
    device_tensors: dict[str, Any] = {}
    try:
        for t in expected:
            ptr = ctypes.c_void_p()
            name = t.name.encode()
            check(
                lib.nrt_tensor_allocate(NRT_TENSOR_PLACEMENT_DEVICE, vnc, t.size, name, ctypes.byref(ptr)),
                "nrt_tensor_allocate",
                t.describe(),
            )
            device_tensors[t.name] = ptr
            check(lib.nrt_add_tensor_to_tensor_set(sets[t.usage], name, ptr), "nrt_add_tensor_to_tensor_set", t.name)
    except BaseException:
        for ptr in device_tensors.values():
            lib.nrt_tensor_free(ctypes.byref(ptr))
        for tensor_set in sets.values():
            lib.nrt_destroy_tensor_set(ctypes.byref(tensor_set))
        raise
    return LoadedModel(
        (digest, vnc, collectives),
        handle,
        vnc,
        expected,
        device_tensors,
        sets[NRT_TENSOR_USAGE_INPUT],
        sets[NRT_TENSOR_USAGE_OUTPUT],
    )


# -- device tensors of the ``neuron`` device (neuron_compile/device): allocated, written, read, freed here --
def tensor_allocate(vnc: int, nbytes: int, name: str = "neuron_compile") -> Any:
    """A device tensor of ``nbytes`` on logical core ``vnc`` (``nrt_tensor_allocate``)."""
    lib = runtime().lib
    handle = ctypes.c_void_p()
    check(
        lib.nrt_tensor_allocate(NRT_TENSOR_PLACEMENT_DEVICE, vnc, nbytes, name.encode(), ctypes.byref(handle)),
        "nrt_tensor_allocate",
        f"{nbytes} bytes on NeuronCore {vnc}",
    )
    return handle


def tensor_free(handle: Any) -> None:
    rt = _RUNTIME
    if rt is None or rt.closed or not handle:
        return
    rt.lib.nrt_tensor_free(ctypes.byref(handle))


def tensor_write(handle: Any, data: torch.Tensor, offset: int = 0) -> None:
    """Write the bytes of contiguous CPU tensor ``data`` at byte ``offset`` of device tensor ``handle``."""
    nbytes = data.numel() * data.element_size()
    check(runtime().lib.nrt_tensor_write(handle, data.data_ptr(), offset, nbytes), "nrt_tensor_write")
    STATS.record_transfer(host_to_device=nbytes)


def tensor_read(handle: Any, nbytes: int, offset: int = 0) -> torch.Tensor:
    """``nbytes`` of device tensor ``handle`` from byte ``offset``, as a new uint8 CPU tensor."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    check(runtime().lib.nrt_tensor_read(handle, out.data_ptr(), offset, nbytes), "nrt_tensor_read")
    STATS.record_transfer(device_to_host=nbytes)
    return out


def execute_on_device(model: LoadedModel, inputs: Sequence[Any]) -> list[Any]:
    """Run ``model`` on device tensors ``inputs`` (one per module parameter, of its byte size); its results in
    new device tensors, which the caller owns. Nothing crosses the host boundary."""
    lib = runtime().lib
    ins, outs = model._by_usage
    outputs = [tensor_allocate(model.vnc, spec.size, spec.name) for spec in outs]
    sets = []
    try:
        for specs, tensors in ((ins, inputs), (outs, outputs)):
            tensor_set = ctypes.c_void_p()
            check(lib.nrt_allocate_tensor_set(ctypes.byref(tensor_set)), "nrt_allocate_tensor_set")
            sets.append(tensor_set)
            for spec, handle in zip(specs, tensors):
                check(
                    lib.nrt_add_tensor_to_tensor_set(tensor_set, spec.name.encode(), handle),
                    "nrt_add_tensor_to_tensor_set",
                    spec.name,
                )
        with model.lock:
            check(
                lib.nrt_execute(model.handle, sets[0], sets[1]),
                "nrt_execute",
                f"NEFF {model.key[0][:12]} on NeuronCore {model.vnc}",
            )
    except BaseException:
        for handle in outputs:
            tensor_free(handle)
        raise
    finally:
        for tensor_set in sets:
            lib.nrt_destroy_tensor_set(ctypes.byref(tensor_set))
    STATS.record_execution(0, 0)
    return outputs
