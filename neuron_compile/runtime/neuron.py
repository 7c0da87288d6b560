"""The neuron target: neuronx-cc compiles the StableHLO module to a NEFF for Trn2/Trn3.

NOT RUN ON HARDWARE: no Trainium machine or Neuron toolchain was available while this was written.
The command line follows TorchNeuron's (see shared/TOOLCHAIN.md); executing a NEFF needs the Neuron
runtime, which is loaded from ``libneuronxla`` when installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from typing import Any

from ..errors import NeuronCompileError


class NeuronTarget:
    name = "neuron"

    def __init__(self, generation: str = "trn2", flags: tuple[str, ...] = (), opt_level: int = 2) -> None:
        self.generation = generation
        self.flags = flags
        self.opt_level = opt_level

    def command(self, module_path: str, neff_path: str) -> list[str]:
        return [
            "neuronx-cc", "compile", module_path,
            "--framework", "XLA",
            "--target", self.generation,
            "--lnc", "2",
            f"-O{self.opt_level}",
            "--model-type", "transformer",
            "--auto-cast", "none",
            # torch's int64 (indices, argmax, embeddings) stays 64-bit, as on the CPU target (trn2+).
            "--native-int64",
            *self.flags,
            "--output", neff_path,
        ]  # fmt: skip

    def compile(self, stablehlo: str, host_callbacks: list[Any] | tuple[Any, ...] = ()) -> bytes:
        if shutil.which("neuronx-cc") is None:
            raise NeuronCompileError(
                "neuron target: neuronx-cc is not on PATH. Install the Neuron SDK (aws-neuronx-cc) on a "
                "Trn2/Trn3 instance, or use options={'target': 'cpu'}."
            )
        if host_callbacks:
            raise NeuronCompileError(
                "neuron target: this graph calls back into Python (the NKI emulator), which a NEFF cannot do; "
                "use options={'kernels': 'reference'} (built-in kernels become NKI custom calls)."
            )
        with tempfile.TemporaryDirectory(prefix="neuron_compile_") as tmp:
            module_path = os.path.join(tmp, "module.mlir")
            neff_path = os.path.join(tmp, "module.neff")
            with open(module_path, "w") as f:
                f.write(stablehlo)
            proc = subprocess.run(self.command(module_path, neff_path), capture_output=True, text=True)
            if proc.returncode != 0:
                raise NeuronCompileError(f"neuronx-cc failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
            with open(neff_path, "rb") as f:
                return f.read()

    def serialize(self, executable: bytes) -> bytes:
        return executable

    def deserialize(self, blob: bytes) -> bytes:
        return blob

    def version(self) -> str:
        try:
            out = subprocess.run(["neuronx-cc", "--version"], capture_output=True, text=True).stdout
        except OSError:
            return "neuronx-cc-unavailable"
        return out.strip().splitlines()[-1] if out.strip() else "neuronx-cc-unknown"

    def run(self, executable: bytes, buffers: list[Any]) -> list[Any]:
        """Executing a NEFF needs the Neuron runtime, which this project has not bound yet."""
        try:
            import libneuronxla  # noqa: F401  # the Neuron runtime binding shipped with torch-neuronx
        except ImportError as e:
            raise NeuronCompileError(
                "neuron target: the NEFF compiled, but the Neuron runtime (libneuronxla from torch-neuronx) is "
                "not installed, so it cannot be executed here. Use options={'target': 'cpu'} to run the same "
                "StableHLO with XLA CPU."
            ) from e
        raise NeuronCompileError(
            "neuron target: the NEFF compiled, but executing it is not implemented yet (see README, 'targets'). "
            "Use options={'target': 'cpu'} to run the same StableHLO with XLA CPU."
        )
