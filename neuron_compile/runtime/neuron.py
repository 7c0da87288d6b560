"""The neuron target: neuronx-cc compiles the StableHLO module to a NEFF, the Neuron runtime runs it.

NOT RUN ON HARDWARE: no Trainium machine or Neuron toolchain was available while this was written. The
command line follows TorchNeuron's (see the docs' "Running on Trainium" page); the NEFF runs through libnrt
(``libnrt.py``, every runtime call of the project). Both are exercised end to end by the device simulator in
``tests/device_sim`` (a fake ``neuronx-cc`` and a fake ``libnrt.so.1`` with the real symbols and structs).
"""

from __future__ import annotations

import collections
import functools
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import NeuronCompileError
from . import libnrt

#: First bytes of a serialized neuron executable: the module's signature (JSON) then the NEFF.
_MAGIC = b"NEURON_COMPILE_NEFF\n"
#: StableHLO ops that make a NEFF one of a group of devices, loaded with ``nrt_load_collectives``.
_COLLECTIVE_OPS = (
    "stablehlo.all_reduce",
    "stablehlo.all_gather",
    "stablehlo.reduce_scatter",
    "stablehlo.all_to_all",
    "stablehlo.collective_permute",
    "stablehlo.collective_broadcast",
)


@dataclass(frozen=True)
class CompilerRun:
    """One neuronx-cc invocation of this process (for ``neuron-compile doctor --bundle`` and bug reports)."""

    command: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    #: its log-neuron-cc.txt (the end of it), when it wrote one
    log: str = ""


#: The last neuronx-cc invocations of this process, newest last.
COMPILER_RUNS: collections.deque[CompilerRun] = collections.deque(maxlen=64)


class NeuronExecutable:
    """A NEFF and the signature of the module it was compiled from; loaded on a NeuronCore at its first run
    (once per NEFF and core, whatever number of graphs share it), unloaded when the last of them is gone."""

    def __init__(
        self,
        neff: bytes,
        params: list[tuple[tuple[int, ...], torch.dtype]],
        results: list[tuple[tuple[int, ...], torch.dtype]],
        collectives: bool,
    ) -> None:
        self.neff = neff
        self.params = params
        self.results = results
        self.collectives = collectives
        self.resident_inputs = False
        self._model: libnrt.LoadedModel | None = None
        self._lock = threading.Lock()

    def to_bytes(self) -> bytes:
        header = json.dumps(
            {
                "params": [[list(s), str(d).removeprefix("torch.")] for s, d in self.params],
                "results": [[list(s), str(d).removeprefix("torch.")] for s, d in self.results],
                "collectives": self.collectives,
            }
        ).encode()
        return _MAGIC + len(header).to_bytes(8, "little") + header + self.neff

    @classmethod
    def from_bytes(cls, blob: bytes) -> NeuronExecutable:
        if not blob.startswith(_MAGIC):
            raise ValueError("not a neuron executable (no header): an entry of another target or version")
        start = len(_MAGIC) + 8
        size = int.from_bytes(blob[len(_MAGIC) : start], "little")
        header = json.loads(blob[start : start + size])
        sig = lambda rows: [(tuple(s), getattr(torch, d)) for s, d in rows]  # noqa: E731
        return cls(blob[start + size :], sig(header["params"]), sig(header["results"]), header["collectives"])

    def model(self, core: int) -> libnrt.LoadedModel:
        with self._lock:
            if self._model is None or self._model.handle is None:
                group = None
                if self.collectives:
                    group = _collective_group()
                expected = libnrt.module_tensors(self.params, self.results)
                self._model = libnrt.acquire_model(self.neff, core, expected, group)
                weakref.finalize(self, libnrt.release_model, self._model)
            return self._model


def _collective_group() -> tuple[int, int]:
    """(global device id, device count) of this process, from torch.distributed."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise NeuronCompileError(
            "neuron target: this graph has collectives, which need the process group to be initialized "
            "(torch.distributed.init_process_group) before its first call"
        )
    return dist.get_rank(), dist.get_world_size()


class NeuronTarget:
    name = "neuron"

    def __init__(
        self,
        generation: str = "trn2",
        flags: tuple[str, ...] = (),
        opt_level: int = 2,
        lnc: int = 2,
        core: int | None = None,
    ) -> None:
        self.generation = generation
        self.flags = flags
        self.opt_level = opt_level
        self.lnc = lnc
        # nrt_load counts cores from the process's own first one (libnrt.runtime() gives each torchrun rank
        # its own core): 0 unless the option says otherwise
        self.core = 0 if core is None else core

    def command(self, module_path: str, neff_path: str) -> list[str]:
        return [
            "neuronx-cc", "compile", module_path,
            "--framework", "XLA",
            "--target", self.generation,
            # must equal the runtime's logical-core setting (NEURON_LOGICAL_NC_CONFIG), or the NEFF is refused
            "--lnc", str(self.lnc),
            f"-O{self.opt_level}",
            "--model-type", "transformer",
            "--auto-cast", "none",
            # torch's int64 (indices, argmax, embeddings) stays 64-bit, as on the CPU target (trn2+).
            "--native-int64",
            *self.flags,
            "--output", neff_path,
        ]  # fmt: skip

    def compile(self, stablehlo: str, host_callbacks: list[Any] | tuple[Any, ...] = ()) -> NeuronExecutable:
        if shutil.which("neuronx-cc") is None:
            raise NeuronCompileError(
                "neuron target: neuronx-cc is not on PATH. Install the Neuron SDK (aws-neuronx-cc) on a "
                "Trn2/Trn3 instance, or use options={'target': 'cpu'}."
            )
        if host_callbacks:
            raise NeuronCompileError(
                "neuron target: this graph calls back into Python (the NKI emulator), which a NEFF cannot do; "
                "use options={'kernels': 'reference'}."
            )
        from . import jax_adapter

        params, results = jax_adapter.main_signature(stablehlo)
        with tempfile.TemporaryDirectory(prefix="neuron_compile_") as tmp:
            module_path = os.path.join(tmp, "module.mlir")
            neff_path = os.path.join(tmp, "module.neff")
            with open(module_path, "w") as f:
                f.write(stablehlo)
            command = self.command(module_path, neff_path)
            t0 = time.perf_counter()
            # in the temporary directory: neuronx-cc writes its log-neuron-cc.txt into its working directory
            proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp)
            log_path = os.path.join(tmp, "log-neuron-cc.txt")
            compiler_log = open(log_path, errors="replace").read()[-200_000:] if os.path.exists(log_path) else ""
            COMPILER_RUNS.append(
                CompilerRun(command, proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - t0, compiler_log)
            )
            if proc.returncode != 0:
                raise NeuronCompileError(
                    f"neuronx-cc failed (exit {proc.returncode}):\n{proc.stderr[-4000:] or proc.stdout[-4000:]}\n"
                    f"command: {' '.join(command)}\nThe module it was given: NEURON_COMPILE_DEBUG_DIR=DIR writes it."
                )
            with open(neff_path, "rb") as f:
                neff = f.read()
        return NeuronExecutable(neff, params, results, any(op in stablehlo for op in _COLLECTIVE_OPS))

    def serialize(self, executable: NeuronExecutable) -> bytes:
        return executable.to_bytes()

    def deserialize(self, blob: bytes) -> NeuronExecutable:
        return NeuronExecutable.from_bytes(blob)

    def for_graph(self, executable: NeuronExecutable, resident_inputs: bool = False) -> NeuronExecutable:
        # Its own handle on the NEFF's load: the load is shared by every graph of that NEFF on a core and
        # ends with the last of them, whatever the compile cache keeps.
        mine = NeuronExecutable(executable.neff, executable.params, executable.results, executable.collectives)
        mine.resident_inputs = resident_inputs
        return mine

    def version(self) -> str:
        return compiler_version()

    def run(self, executable: NeuronExecutable, buffers: list[Any]) -> list[Any]:
        try:
            model = executable.model(self.core)
        except NeuronCompileError as e:
            mismatch = self._lnc_mismatch(e)
            if mismatch is None:
                raise
            raise mismatch from e
        return model.execute(buffers, executable.resident_inputs)

    def _lnc_mismatch(self, error: NeuronCompileError) -> NeuronCompileError | None:
        """The runtime refused the NEFF (NRT_INVALID) while it runs another logical-core size than the NEFF
        was compiled for (``--lnc``, option ``lnc``): an error naming both, instead of advice to clear the cache
        (the LNC is part of the key: the entry is right, the setting is not). None for any other refusal."""
        from ..errors import NeuronRuntimeError

        if (
            not isinstance(error, NeuronRuntimeError)
            or error.status != 2
            or error.call not in ("nrt_load", "nrt_load_collectives")
        ):
            return None
        # the runtime's own variables (the option lnc defaults to them: options.py, which runtime/ may not import)
        runtime_lnc, source = 2, "NEURON_LOGICAL_NC_CONFIG unset: the runtime's default 2"
        for name in ("NEURON_LOGICAL_NC_CONFIG", "NEURON_RT_VIRTUAL_CORE_SIZE"):
            value = os.environ.get(name, "").strip()
            if value:
                if not value.isdigit():
                    return None  # a setting the runtime refuses at its start, not at a load
                runtime_lnc, source = int(value), f"{name}={value}"
                break
        if runtime_lnc == self.lnc:
            return None
        return NeuronRuntimeError(
            f"neuron runtime: {error.call} refused the NEFF (NRT_INVALID = 2): it was compiled for logical-core size "
            f"LNC {self.lnc} (option lnc, neuronx-cc --lnc {self.lnc}) but the runtime runs with LNC {runtime_lnc} "
            f"({source}). Compile for the runtime's: options={{'lnc': {runtime_lnc}}} (or unset the option: it "
            f"follows NEURON_LOGICAL_NC_CONFIG), or run the runtime with NEURON_LOGICAL_NC_CONFIG={self.lnc}; the "
            "compile cache is not at fault",
            error.status,
            error.call,
        )

    # Buffers of this target are CPU tensors: libnrt copies them to the device (when they changed).
    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def to_torch(self, result: torch.Tensor) -> torch.Tensor:
        return result

    def constant_buffer(self, value: Any) -> torch.Tensor:
        return libnrt.owned_constant(torch.from_numpy(np.array(value, copy=True)))


@functools.lru_cache(maxsize=None)
def _compiler_version(path: str | None) -> str:
    if path is None:
        return "neuronx-cc-unavailable"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return "neuronx-cc-unavailable"
    # "NeuronX Compiler version 2.x.y+hash", then a blank line and the Python/NumPy versions it runs on
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    named = [line for line in lines if "compiler version" in line.lower()]
    return (named or lines or ["neuronx-cc-unknown"])[0]


def compiler_version() -> str:
    """neuronx-cc's version line (asked once per compiler path and process)."""
    return _compiler_version(shutil.which("neuronx-cc"))
