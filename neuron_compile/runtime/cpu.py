"""The CPU target: XLA CPU runs the very StableHLO module that neuronx-cc would take.

One local rewrite keeps XLA to the module's semantics: float divisions go through float64, since XLA's
simplifier would otherwise multiply by a reciprocal where StableHLO divides (``jax_adapter._exact_divisions``).
XLA CPU's JIT spends memory maps, which Linux caps per process: each load asks ``map_budget`` first, as the
compiler does before each lowering and compile (a refusal is an error; at the cap the process would crash).
"""

from __future__ import annotations

from typing import Any

from . import jax_adapter, map_budget


class CpuTarget:
    name = "cpu"

    def compile(self, stablehlo: str, host_callbacks: list[Any] | tuple[Any, ...] = ()) -> Any:
        # map_budget was asked before the lowering (compiler.build_artifact), which runs jax whatever the target.
        return jax_adapter.compile_stablehlo(stablehlo, host_callbacks)

    def serialize(self, executable: Any) -> bytes:
        return jax_adapter.serialize_executable(executable)

    def deserialize(self, blob: bytes) -> Any:
        map_budget.reserve("loading a compiled graph")
        return jax_adapter.deserialize_executable(blob)

    def version(self) -> str:
        import jax
        import jaxlib

        return f"jax-{jax.__version__}/jaxlib-{jaxlib.__version__}/xla-cpu"

    def run(self, executable: Any, buffers: list[Any]) -> list[Any]:
        return jax_adapter.execute(executable, buffers)
