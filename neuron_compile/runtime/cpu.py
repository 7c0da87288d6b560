"""The CPU target: XLA CPU runs the very StableHLO module that neuronx-cc would take.

One local rewrite keeps XLA to the module's semantics: float divisions go through float64, since XLA's
simplifier would otherwise multiply by a reciprocal where StableHLO divides (``jax_adapter._exact_divisions``).
XLA CPU's JIT spends memory maps, which Linux caps per process: each load asks ``map_budget`` first, as the
compiler does before each lowering and compile (a refusal is an error; at the cap the process would crash).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from . import jax_adapter, map_budget

if TYPE_CHECKING:
    from .targets import GraphLabel


class CpuTarget:
    name = "cpu"

    def compile(
        self, stablehlo: str, host_callbacks: list[Any] | tuple[Any, ...] = (), graph: GraphLabel | None = None
    ) -> Any:
        # map_budget was asked before the lowering (compiler.build_artifact), which runs jax whatever the target.
        return jax_adapter.compile_stablehlo(stablehlo, host_callbacks)

    def serialize(self, executable: Any) -> bytes:
        return jax_adapter.serialize_executable(executable)

    def deserialize(self, blob: bytes) -> Any:
        map_budget.reserve("loading a compiled graph")
        return jax_adapter.deserialize_executable(blob)

    def for_graph(self, executable: Any, resident_inputs: bool = False) -> Any:
        # XLA CPU's executable is loaded in this process when it is made and holds no per-graph state: every
        # graph runs the artifact itself (inputs are shared through DLPack, so there is nothing to keep resident).
        return executable

    def version(self) -> str:
        import jax
        import jaxlib

        return f"jax-{jax.__version__}/jaxlib-{jaxlib.__version__}/xla-cpu"

    def run(self, executable: Any, buffers: list[Any]) -> list[Any]:
        return jax_adapter.execute(executable, buffers)

    # DLPack both ways: no copies. Looked up at each call, so that tests may observe jax_adapter's calls.
    def to_device(self, t: torch.Tensor) -> Any:
        return jax_adapter.torch_to_device(t)

    def to_torch(self, result: Any) -> torch.Tensor:
        return jax_adapter.device_to_torch(result)

    def constant_buffer(self, value: Any) -> Any:
        return jax_adapter.constant_buffer(value)
