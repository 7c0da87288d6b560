"""The neuron target: neuronx-cc compiles the StableHLO module to a NEFF, the Neuron runtime runs it.

NOT RUN ON HARDWARE: no Trainium machine or Neuron toolchain was available while this was written. The
command line follows TorchNeuron's (see the docs' "Running on Trainium" page), with only the flags the
installed compiler's own ``--help`` lists (``neuronx_cc.py``, which also runs the compile: bounded, watched,
ended with its parent); the NEFF runs through libnrt (``libnrt.py``, every runtime call of the project). Both
are exercised end to end by the device simulator in ``tests/device_sim`` (a fake ``neuronx-cc`` and a fake
``libnrt.so.1`` with the real symbols and structs).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import NeuronCompileError
from . import libnrt, neuronx_cc
from .neuronx_cc import compiler_version

if TYPE_CHECKING:
    from .targets import GraphLabel

#: First bytes of a serialized neuron executable: the module's signature (JSON) then the NEFF.
_MAGIC = b"NEURON_COMPILE_NEFF\n"
#: StableHLO ops that make a NEFF one of a group of devices, loaded with ``nrt_load_collectives``.
COLLECTIVE_OPS = frozenset(
    {
        "stablehlo.all_reduce",
        "stablehlo.all_gather",
        "stablehlo.reduce_scatter",
        "stablehlo.all_to_all",
        "stablehlo.collective_permute",
        "stablehlo.collective_broadcast",
    }
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


Signature = list[tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class NeffArtifact:
    """What the compiler made of one module: the NEFF, the signature of the module (the runtime's tensors are
    checked against it at load) and whether it has collectives (it then loads as one of a group). What the
    compile cache stores and shares; it is never loaded itself (``LoadedNeff`` is)."""

    neff: bytes
    params: Signature
    results: Signature
    collectives: bool

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
    def from_bytes(cls, blob: bytes) -> NeffArtifact:
        if not blob.startswith(_MAGIC):
            raise ValueError("not a neuron executable (no header): an entry of another target or version")
        start = len(_MAGIC) + 8
        size = int.from_bytes(blob[len(_MAGIC) : start], "little")
        header = json.loads(blob[start : start + size])
        sig = lambda rows: [(tuple(s), getattr(torch, d)) for s, d in rows]  # noqa: E731
        return cls(blob[start + size :], sig(header["params"]), sig(header["results"]), header["collectives"])


class LoadedNeff:
    """One compiled graph's handle on a NEFF: loaded on a NeuronCore at its first run (the load is shared by
    every handle on that NEFF and core, whatever number of graphs hold one), released when the handle is gone
    and unloaded with the last of them."""

    def __init__(self, artifact: NeffArtifact, resident_inputs: bool = False) -> None:
        self.artifact = artifact
        #: an input may stay on the device while its version counter is unchanged (``Target.for_graph``)
        self.resident_inputs = resident_inputs
        self._model: libnrt.LoadedModel | None = None
        self._lock = threading.Lock()

    @property
    def results(self) -> Signature:
        return self.artifact.results

    def model(self, core: int) -> libnrt.LoadedModel:
        with self._lock:
            if self._model is None or self._model.handle is None:
                art = self.artifact
                group = _collective_group() if art.collectives else None
                expected = libnrt.module_tensors(art.params, art.results)
                self._model = libnrt.acquire_model(art.neff, core, expected, group)
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
        compiler_input: str = "auto",
        compile_timeout: float = 7200.0,
        progress_seconds: float = 60.0,
        cache_dir: str | None = None,
    ) -> None:
        self.generation = generation
        self.flags = flags
        self.opt_level = opt_level
        self.lnc = lnc
        # nrt_load counts cores from the process's own first one (libnrt.runtime() gives each torchrun rank
        # its own core): 0 unless the option says otherwise
        self.core = 0 if core is None else core
        if compiler_input not in ("auto", *neuronx_cc.INPUT_FORMATS):
            raise ValueError(f"compiler_input must be auto, mlir or hlo, not {compiler_input!r}")
        self.compiler_input = compiler_input
        self.compile_timeout = compile_timeout
        self.progress_seconds = progress_seconds
        #: where what the compiler said (its --help, the input it parses) is kept: beside the compile cache
        self.facts_dir = neuronx_cc.facts_dir(cache_dir, tuple(flags))
        #: torch-neuronx's --retry_failed_compilation in the flags: a failed compile is run once more
        self.retry_failed = neuronx_cc.wrapper_flags(tuple(flags)).retry_failed_compilation
        #: where progress lines go (stderr)
        self.progress = neuronx_cc.print_progress

    def compiler_help(self) -> neuronx_cc.CompilerHelp:
        """The installed compiler's ``compile --help`` (the CLI reference's options without a compiler)."""
        return neuronx_cc.compiler_help(self.facts_dir)

    def command(self, module_path: str, neff_path: str) -> list[str]:
        """The neuronx-cc command line for one module: only flags the compiler lists, in the form it lists them;
        a forced flag (option ``neuron_cc_flags``) it does not list is a NeuronCompileError."""
        return neuronx_cc.build_command(
            self.compiler_help(),
            module_path,
            neff_path,
            generation=self.generation,
            lnc=self.lnc,
            opt_level=self.opt_level,
            forced=tuple(self.flags),
        )

    def input_format(self) -> str:
        """The format the compile starts with: the option's, or for "auto" what this compiler version was found
        to parse (StableHLO until it refuses it)."""
        if self.compiler_input != "auto":
            return self.compiler_input
        known = neuronx_cc.compiler_facts(self.facts_dir, compiler_version()).get("input_format")
        return known or "mlir"

    def compile(
        self, stablehlo: str, host_callbacks: list[Any] | tuple[Any, ...] = (), graph: GraphLabel | None = None
    ) -> NeffArtifact:
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

        params, results, op_names = jax_adapter.module_summary(stablehlo)
        tensors = libnrt.module_tensors(params, results)
        # the NEFF's tensor names set in the module itself (torch-xla's frontend attributes), root a tuple
        named = jax_adapter.neff_module(
            stablehlo,
            [t.name for t in tensors if t.usage == libnrt.NRT_TENSOR_USAGE_INPUT],
            [t.name for t in tensors if t.usage == libnrt.NRT_TENSOR_USAGE_OUTPUT],
        )
        first = self.input_format()
        neff = self._compile_as(first, named, graph)
        if neff is None:  # "auto", and the compiler said it could not parse that format: the other one, once
            other = "hlo" if first == "mlir" else "mlir"
            neff = self._compile_as(other, named, graph, last_try=True)
            assert neff is not None
            neuronx_cc.remember(self.facts_dir, compiler_version(), input_format=other)
        elif self.compiler_input == "auto" and first == "mlir":
            if neuronx_cc.compiler_facts(self.facts_dir, compiler_version()).get("input_format") != "mlir":
                neuronx_cc.remember(self.facts_dir, compiler_version(), input_format="mlir")
        return NeffArtifact(neff, params, results, bool(op_names & COLLECTIVE_OPS))

    def _compile_as(
        self, fmt: str, named_module: str, graph: GraphLabel | None, last_try: bool = False
    ) -> bytes | None:
        """The NEFF of ``named_module`` handed over as ``fmt``; None when "auto" may try the other format (the
        compiler said the input did not parse)."""
        from . import jax_adapter

        with tempfile.TemporaryDirectory(prefix="neuron_compile_", ignore_cleanup_errors=True) as tmp:
            module_path = os.path.join(tmp, neuronx_cc.MODULE_FILES[fmt])
            neff_path = os.path.join(tmp, "module.neff")
            with open(module_path, "w" if fmt == "mlir" else "wb") as f:
                f.write(named_module if fmt == "mlir" else jax_adapter.hlo_module_proto(named_module))
            command = self.command(module_path, neff_path)
            name = graph.name if graph is not None else "module"
            # torch-neuronx's --retry_failed_compilation: a failed compile runs once more (a host OOM kill, an
            # interrupted or flaky run); never a timeout, nor an input the compiler could not parse
            for attempt in range(2 if self.retry_failed else 1):
                # in the temporary directory: neuronx-cc writes its log-neuron-cc.txt into its working directory
                result = neuronx_cc.run(
                    command,
                    tmp,
                    graph=name,
                    timeout=self.compile_timeout,
                    progress_every=self.progress_seconds,
                    progress=self.progress,
                    largest_op=graph.largest_op if graph is not None else None,
                )
                COMPILER_RUNS.append(
                    CompilerRun(command, result.returncode, result.stdout, result.stderr, result.seconds, result.log)
                )
                if result.returncode == 0:
                    break
                said = result.stdout + result.stderr
                if self.compiler_input == "auto" and not last_try and neuronx_cc.refused_as_unparsable(said):
                    return None
                if attempt == 0 and self.retry_failed:
                    neuronx_cc.log.warning(
                        "neuron_compile: neuronx-cc failed (exit %d) on graph '%s'; compiling it once more "
                        "(--retry_failed_compilation in NEURON_CC_FLAGS)",
                        result.returncode,
                        name,
                    )
                    continue
                message = neuronx_cc.failure_message(result, command, name)
                if attempt:
                    message += "\n(it failed twice: once more was tried, --retry_failed_compilation)"
                raise NeuronCompileError(message)
            with open(neff_path, "rb") as f:
                return f.read()

    def serialize(self, executable: NeffArtifact) -> bytes:
        return executable.to_bytes()

    def deserialize(self, blob: bytes) -> NeffArtifact:
        return NeffArtifact.from_bytes(blob)

    def for_graph(self, executable: NeffArtifact, resident_inputs: bool = False) -> LoadedNeff:
        # Its own handle on the NEFF's load: the load is shared by every graph of that NEFF on a core and
        # ends with the last of them, whatever the compile cache keeps.
        return LoadedNeff(executable, resident_inputs)

    def version(self) -> str:
        return compiler_version()

    def run(self, executable: LoadedNeff, buffers: list[Any]) -> list[Any]:
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

    # Host buffers of this target are the CPU tensors themselves: ``run`` copies them into the NEFF's input
    # tensors (libnrt.LoadedModel.execute). Device buffers are nrt tensors (device/buffers.py::NeuronBuffers).
    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def to_torch(self, result: torch.Tensor) -> torch.Tensor:
        return result

    def constant_buffer(self, value: Any) -> torch.Tensor:
        return libnrt.owned_constant(torch.from_numpy(np.array(value, copy=True)))
