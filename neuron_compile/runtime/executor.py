"""Runs a compiled graph on torch tensors: DLPack in, execute, DLPack out (no copies)."""

from __future__ import annotations

from typing import Any

import torch

from ..artifact import OutputSpec, TensorSpec
from . import jax_adapter
from .targets import Target


class CompiledGraph:
    """A boxed callable (``args`` list in, list out) as AOTAutograd expects of a compiler."""

    def __init__(
        self,
        name: str,
        target: Target,
        executable: Any,
        inputs: list[Any],
        outputs: list[OutputSpec],
        needs_rng_seed: bool,
    ) -> None:
        # An instance attribute, so that functools.wraps (used by Dynamo's disable) carries it over.
        self._boxed_call = True
        self.name = name
        self.target = target
        self.executable = executable
        self.inputs = inputs
        self.outputs = outputs
        self.tensor_positions = [i for i, s in enumerate(inputs) if isinstance(s, TensorSpec)]
        self.float64_inputs = {i for i in self.tensor_positions if inputs[i].dtype == torch.float64}
        self.needs_rng_seed = needs_rng_seed
        self._no_seed: torch.Tensor | None = None  # made at first call: compile time runs under FakeTensorMode
        self.calls = 0

    def _seed(self) -> Any:
        if not self.needs_rng_seed:
            if self._no_seed is None:
                self._no_seed = torch.zeros(2, dtype=torch.int32)
            return jax_adapter.torch_to_device(self._no_seed)
        # Drawn from torch's default generator: torch.manual_seed makes compiled random ops reproducible.
        return jax_adapter.torch_to_device(torch.randint(-(2**31), 2**31 - 1, (2,), dtype=torch.int32))

    def _to_device(self, i: int, t: torch.Tensor) -> Any:
        if i in self.float64_inputs:
            t = t.to(torch.float32)
        # requires_grad tensors refuse __dlpack__; non-contiguous ones cannot be wrapped.
        return jax_adapter.torch_to_device(t.detach().contiguous())

    def _meta_outputs(self) -> list[Any]:
        """What eager gives for meta inputs: outputs with the shapes, dtypes and strides torch computed."""
        out: list[Any] = []
        for spec in self.outputs:
            if spec.kind == "const":
                out.append(spec.value)
            elif spec.stride is not None:
                out.append(torch.empty_strided(spec.spec.shape, spec.stride, dtype=spec.spec.dtype, device="meta"))
            else:
                out.append(torch.empty(spec.spec.shape, dtype=spec.spec.dtype, device="meta"))
        return out

    def __call__(self, args: list[Any]) -> list[Any]:
        self.calls += 1
        if any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
            # Dynamo traced these inputs with fake tensors, so devices are consistent: nothing to run.
            args.clear()
            return self._meta_outputs()
        buffers = [self._to_device(i, args[i]) for i in self.tensor_positions]
        buffers.append(self._seed())
        args.clear()  # boxed convention: let the caller's inputs be freed as early as possible
        results = self.target.run(self.executable, buffers)
        del buffers
        tensors = [jax_adapter.device_to_torch(r) for r in results]
        storages: dict[tuple[int, int | None], torch.Tensor] = {}
        out: list[Any] = []
        for spec in self.outputs:
            if spec.kind == "const":
                out.append(spec.value)
                continue
            key = (spec.index, spec.duplicate_of)
            t = storages.get(key)
            if t is None:
                t = tensors[spec.index]
                if spec.duplicate_of is not None:
                    t = t.clone()  # two storages in eager computed as one value: never hand out one buffer twice
                if spec.spec is not None and t.dtype != spec.spec.dtype:
                    t = t.to(spec.spec.dtype)  # float64 computed as float32, returned as float64
                storages[key] = t
            if spec.stride is not None:
                # Views of one buffer share its storage and version counter, as views of one tensor in eager.
                t = t.as_strided(spec.spec.shape, spec.stride, spec.storage_offset)
            out.append(t)
        return out
