"""Compiled graphs called with tensors of the ``neuron`` device: inputs bound where they lie, outputs new
device tensors, nothing read back to the host.

``runtime/executor.py`` hands a call here when its first tensor argument is on the device (the hook
``executor.DEVICE_CALL``, set when the device is registered): the same compiled graph serves host tensors and
device tensors, since its executable does not depend on where its arguments come from.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import numpy as np
import torch

from ..errors import NeuronCompileError
from ..stats import STATS
from . import context
from . import storage as mem

#: The all-zero random seed of graphs without random ops, per (target, device index) (never written: uploaded once).
_NO_SEED: dict[tuple[str, int], torch.Tensor] = {}


@context.serialized
def call_on_device(graph: Any, args: list[Any]) -> list[Any]:
    """Run CompiledGraph ``graph`` on ``args`` whose tensors are on the neuron device."""
    dev = context.device()
    if graph.target.name != dev.target.name:
        raise NeuronCompileError(
            f"neuron device: graph {graph.name} was compiled for the {graph.target.name} target, but tensors of "
            f"the neuron device in this process live on the {dev.target.name} target (options target=... or "
            "NEURON_COMPILE_TARGET must be the same for both)"
        )
    index = _device_index(args)
    params, keep = [], []
    for i, _, perm in graph._feed:
        t = args[i]
        if t.device.type != "neuron":
            t = context.upload(t, index)  # a CPU scalar among device tensors, as CUDA takes one
        if perm is not None:
            t = t.permute(*perm, *range(len(perm), t.dim()))
        spec = graph.inputs[i]
        param, held = context.parameter(t, spec.device_shape, spec.dtype)
        params.append(param)
        keep.append(held)
    seed = _seed(graph, index)
    param, held = context.parameter(seed, (2,), torch.int32)
    params.append(param)
    keep.append(held)
    executable = graph.executable if graph.executable is not None else graph._reload()
    aliased = {i: args[i] for i in graph._aliased_inputs}
    args.clear()
    raw = dev.buffers.run(executable, params)
    STATS.device_graph_runs += 1
    del params
    results = [_wrap(dev, r, k, executable, index) for k, r in enumerate(raw)]
    del keep
    return _outputs(graph, results, aliased, index)


def _device_index(args: list[Any]) -> int:
    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type == "neuron":
            return a.device.index or 0
    return 0


#: The generator an eager random op was given (``generator=``), while its graph runs; None: torch's default one.
_GENERATOR: contextvars.ContextVar[torch.Generator | None] = contextvars.ContextVar("neuron_generator", default=None)


@contextlib.contextmanager
def seeds_from(generator: torch.Generator | None) -> Iterator[None]:
    """Graphs called inside draw their random seed from ``generator`` (None: torch's default generator)."""
    token = _GENERATOR.set(generator)
    try:
        yield
    finally:
        _GENERATOR.reset(token)


def _draw_seed() -> torch.Tensor:
    """Two int32 words from the op's generator, else torch's default one (``torch.manual_seed`` makes random ops
    reproducible). A ``torch.Generator("neuron")`` is a CPU Mersenne Twister labelled with the device
    (``_native.cpp``): it is drawn through a CPU generator holding its state, which it then takes back."""
    generator = _GENERATOR.get()
    if generator is None or generator.device.type == "cpu":
        return torch.randint(-(2**31), 2**31 - 1, (2,), dtype=torch.int32, generator=generator)
    host = torch.Generator()
    host.set_state(generator.get_state())
    seed = torch.randint(-(2**31), 2**31 - 1, (2,), dtype=torch.int32, generator=host)
    generator.set_state(host.get_state())
    return seed


def _seed(graph: Any, index: int) -> torch.Tensor:
    if graph.needs_rng_seed:
        return context.upload(_draw_seed(), index)
    key = (context.device().target.name, index)
    seed = _NO_SEED.get(key)
    if seed is None:
        # the device's own constant, like CUDA's context not in memory_allocated()
        seed = _NO_SEED[key] = context.upload(torch.from_numpy(np.zeros(2, dtype=np.int32)), index, counted=False)
    return seed


def _wrap(dev: context.Device, raw: Any, k: int, executable: Any, index: int) -> torch.Tensor:
    payload, nbytes, shape, dtype = dev.buffers.result(raw, k, executable)
    return context.from_payload(payload, nbytes, shape, dtype, index)


def _outputs(graph: Any, results: list[torch.Tensor], aliased: dict[int, Any], index: int) -> list[Any]:
    from ..runtime.executor import _input_alias

    storages: dict[tuple[int, int | None], torch.Tensor] = {}
    out: list[Any] = []
    for spec in graph.outputs:
        if spec.kind == "const":
            value = spec.value
            out.append(context.upload(value, index) if isinstance(value, torch.Tensor) else value)
            continue
        if spec.kind == "input":
            out.append(_input_alias(aliased[spec.index], spec))
            continue
        key = (spec.index, spec.duplicate_of)
        t = storages.get(key)
        if t is None:
            t = results[spec.index]
            if spec.duplicate_of is not None:
                t = context.with_buffer_of(t)  # its own storage: eager gave two storages
            if spec.spec is not None and t.dtype != spec.spec.dtype:
                raise NeuronCompileError(
                    f"neuron device: graph {graph.name} gives {t.dtype} where torch expects {spec.spec.dtype}"
                )
            storages[key] = t
        if spec.stride is not None:
            t = t.as_strided(spec.spec.shape, spec.stride, spec.storage_offset)
        out.append(t)
    return out


def is_device_call(args: list[Any], feed: list[Any]) -> bool:
    """Whether a graph is called with tensors of the neuron device (its first tensor argument says it)."""
    for i, _, _ in feed:
        a = args[i]
        return isinstance(a, torch.Tensor) and a.device.type == "neuron"
    return any(isinstance(a, torch.Tensor) and a.device.type == "neuron" for a in args)


__all__ = ["call_on_device", "is_device_call", "mem"]
