"""A faithful device simulator: the Neuron runtime library and compiler stand-ins, for tests and CI.

Nothing of the Neuron stack installs here, so the neuron target's device path (neuronx-cc -> NEFF ->
libnrt) runs against two fakes that follow the real interfaces:

- ``libnrt_sim.c`` -> ``libnrt.so.1``: the real ``nrt_*`` symbols, signatures, struct layouts, enum values
  and status codes (its header comment lists what was checked against which AWS header). It computes a
  NEFF by calling ``tests.device_sim.compute`` (XLA CPU) through the Python C API.
- ``neuronx_cc.py``, behind an executable ``neuronx-cc`` shim on PATH: the real command line; it writes a
  NEFF-shaped file whose tensor table the runtime reports (``input{i}`` / ``output{i}``).

Switch it on for a process with :func:`environment` (or ``python -m tests.device_sim -- COMMAND``); in a
test, :func:`activate` with pytest's ``monkeypatch``. :func:`counters`, :func:`inject` and
:func:`compiler_invocations` observe and steer the fakes.

Importing this module is cheap (stdlib only): the C library imports ``tests.device_sim.compute`` inside
every process that executes a NEFF.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: The repository root: on PYTHONPATH of simulated processes, so ``tests.device_sim`` imports.
REPO_ROOT = HERE.parents[1]
C_SOURCE = HERE / "libnrt_sim.c"

#: ``nrtsim_counters``' order (libnrt_sim.c, enum C_*).
COUNTER_NAMES = (
    "bytes_written", "bytes_read", "loads", "unloads", "executes", "tensors_allocated", "tensors_freed",
    "inits", "closes", "live_models", "live_tensors", "collective_loads",
)  # fmt: skip

#: NRT_STATUS values (nrt_status.h), for tests and messages.
STATUS = {
    "NRT_SUCCESS": 0, "NRT_FAILURE": 1, "NRT_INVALID": 2, "NRT_INVALID_HANDLE": 3, "NRT_RESOURCE": 4,
    "NRT_TIMEOUT": 5, "NRT_HW_ERROR": 6, "NRT_QUEUE_FULL": 7, "NRT_LOAD_NOT_ENOUGH_NC": 9,
    "NRT_UNSUPPORTED_NEFF_VERSION": 10, "NRT_FAIL_HOST_MEM_ALLOC": 11, "NRT_UNINITIALIZED": 13,
    "NRT_CLOSED": 14, "NRT_QUEUE_EMPTY": 15, "NRT_EXEC_UNIT_UNRECOVERABLE": 101, "NRT_EXEC_BAD_INPUT": 1002,
    "NRT_EXEC_COMPLETED_WITH_NUM_ERR": 1003, "NRT_EXEC_COMPLETED_WITH_ERR": 1004, "NRT_EXEC_NC_BUSY": 1005,
    "NRT_EXEC_OOB": 1006, "NRT_COLL_PENDING": 1100, "NRT_EXEC_HW_ERR_COLLECTIVES": 1200,
    "NRT_EXEC_HW_ERR_HBM_UE": 1201, "NRT_EXEC_HW_ERR_NC_UE": 1202, "NRT_EXEC_HW_ERR_DMA_ABORT": 1203,
    "NRT_EXEC_SW_NQ_OVERFLOW": 1204, "NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE": 1205, "NRT_NETWORK_PROXY_FAILURE": 1206,
}  # fmt: skip


def _build_root() -> Path:
    """Where built artifacts live: keyed by the C source, the interpreter and the repository, so a change of
    any of them builds anew (the shim embeds the interpreter and the repository path)."""
    key = hashlib.sha256()
    key.update(C_SOURCE.read_bytes())
    key.update(sys.version.encode())
    key.update(sys.executable.encode())
    key.update(str(REPO_ROOT).encode())
    return Path(tempfile.gettempdir()) / "neuron_compile_device_sim" / key.hexdigest()[:16]


def _built_once(target: Path, make: Any) -> Path:
    """``make(tmp_path)`` once per ``target``, under a lock next to it (pytest-xdist workers build at the same
    time), written to a temporary name and renamed into place."""
    if target.exists():
        return target
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not target.exists():
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            try:
                make(tmp)
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
    return target


def build_libnrt(old_runtime: bool = False) -> Path:
    """The simulated ``libnrt.so.1``, compiled from ``libnrt_sim.c`` once. Python's C-API symbols stay
    undefined in it and resolve from the interpreter that loads it. ``old_runtime``: a runtime from before the
    logical-core API (no ``nrt_get_*_vnc_count``, only the ``nc`` twins)."""

    def compile_to(out: Path) -> None:
        include = sysconfig.get_paths()["include"]
        cmd = [
            os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", f"-I{include}",
            *(["-DNRTSIM_OLD_RUNTIME"] if old_runtime else []),
            "-Wl,-soname,libnrt.so.1", str(C_SOURCE), "-o", str(out), "-lpthread",
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building the simulated libnrt failed:\n{' '.join(cmd)}\n{proc.stderr}")

    return _built_once(_build_root() / ("old-runtime" if old_runtime else "") / "libnrt.so.1", compile_to)


def bin_dir() -> Path:
    """A directory holding the executable ``neuronx-cc`` shim that runs ``tests.device_sim.neuronx_cc``."""

    def write_shim(out: Path) -> None:
        root = shlex.quote(str(REPO_ROOT))
        out.write_text(
            "#!/bin/sh\n"
            "# neuronx-cc stand-in: the device simulator's fake compiler (tests/device_sim/neuronx_cc.py).\n"
            f'PYTHONPATH={root}"${{PYTHONPATH:+:$PYTHONPATH}}" '
            f'exec {shlex.quote(sys.executable)} -m tests.device_sim.neuronx_cc "$@"\n'
        )
        out.chmod(0o755)

    return _built_once(_build_root() / "bin" / "neuronx-cc", write_shim).parent


def default_state_dir() -> Path:
    """Per-user directory for the simulated cores' locks and the compile log (shared by every simulated
    process of the user, as the cores of one machine are)."""
    return Path(tempfile.gettempdir()) / f"nrtsim-{os.getuid()}"


def environment(state_dir: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """The environment variables that switch the simulator on for a process (merge into its environment)."""
    state = (
        Path(state_dir) if state_dir is not None else Path(os.environ.get("NRTSIM_STATE_DIR") or default_state_dir())
    )
    state.mkdir(parents=True, exist_ok=True)
    path = os.environ.get("PATH", "")
    pythonpath = os.environ.get("PYTHONPATH", "")
    return {
        # The package's libnrt binding loads this explicit path instead of /opt/aws/neuron/lib/libnrt.so.1.
        "NEURON_COMPILE_LIBNRT": str(build_libnrt()),
        "PATH": str(bin_dir()) + (os.pathsep + path if path else ""),
        # The C library imports tests.device_sim.compute in whatever process loads it.
        "PYTHONPATH": str(REPO_ROOT) + (os.pathsep + pythonpath if pythonpath else ""),
        "NRTSIM_STATE_DIR": str(state),
    }


def activate(monkeypatch: Any = None, state_dir: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """Apply :func:`environment` to this process: through pytest's ``monkeypatch.setenv`` (undone after the
    test) or, without one, to ``os.environ`` for good. Also puts the repository root on ``sys.path``."""
    env = environment(state_dir)
    for name, value in env.items():
        if monkeypatch is not None:
            monkeypatch.setenv(name, value)
        else:
            os.environ[name] = value
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    return env


def _lib() -> ctypes.CDLL:
    """The built library through ctypes: dlopen of the same path returns the handle the binding uses."""
    lib = ctypes.CDLL(str(build_libnrt()))
    lib.nrtsim_counters.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]
    lib.nrtsim_counters.restype = None
    lib.nrtsim_reset_counters.argtypes = []
    lib.nrtsim_reset_counters.restype = None
    lib.nrtsim_clear_injections.argtypes = []
    lib.nrtsim_clear_injections.restype = None
    lib.nrtsim_inject.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    lib.nrtsim_inject.restype = None
    return lib


def counters() -> dict[str, int]:
    """The simulated runtime's counters in this process, by name (:data:`COUNTER_NAMES`)."""
    out = (ctypes.c_uint64 * len(COUNTER_NAMES))()
    _lib().nrtsim_counters(out, len(COUNTER_NAMES))
    return dict(zip(COUNTER_NAMES, (int(v) for v in out)))


def reset_counters() -> None:
    """Zero the event counters (``live_models`` / ``live_tensors`` keep counting what is alive)."""
    _lib().nrtsim_reset_counters()


def inject(function: str, status: int, count: int = 1) -> None:
    """The next ``count`` calls of ``function`` (e.g. ``"nrt_execute"``) return ``status`` and do nothing
    else. For a subprocess, set ``NRTSIM_INJECT="nrt_execute:1005:1,nrt_load:4:1"`` (read at nrt_init)."""
    _lib().nrtsim_inject(function.encode(), int(status), int(count))


def clear_injections() -> None:
    """Forget every injection not yet used up."""
    _lib().nrtsim_clear_injections()


def compiler_invocations(state_dir: str | os.PathLike[str] | None = None) -> int:
    """Successful compiles of the fake ``neuronx-cc``: lines of ``$NRTSIM_STATE_DIR/compiles.log``."""
    state = (
        Path(state_dir) if state_dir is not None else Path(os.environ.get("NRTSIM_STATE_DIR") or default_state_dir())
    )
    try:
        with open(state / "compiles.log", "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0
