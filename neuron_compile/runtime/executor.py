"""Runs a compiled graph on torch tensors: the target's buffers in (CPU: DLPack, no copies), execute, out."""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from typing import Any, Callable

import numpy as np
import torch

from ..artifact import OutputSpec, TensorSpec
from . import map_budget
from .targets import Target

log = logging.getLogger(__name__)

#: Graphs that can unload their executable near the memory-map limit (``map_budget``), weakly held.
_UNLOADABLE: weakref.WeakSet[CompiledGraph] = weakref.WeakSet()
#: Orders calls across graphs: ``CompiledGraph.last_call``.
_CALL_CLOCK = itertools.count(1)
#: How many of the most recently called graphs keep their executable through a relief: a training step's
#: forward and backward, with room for a few graph breaks, run without reloading.
KEEP_LOADED = 8
#: (is_device_call, call_on_device) of the ``neuron`` device (neuron_compile/device, set when it registers):
#: a call whose tensors are on the device runs there, inputs bound where they lie, outputs left on it.
DEVICE_CALL: tuple[Callable[..., bool], Callable[..., list[Any]]] | None = None
#: Held while a graph's executable is dropped or loaded again (reentrant: a reload's JIT may run the reliefs).
_RELOAD_LOCK = threading.RLock()


class CompiledGraph:
    """A boxed callable (``args`` list in, list out) as AOTAutograd expects of a compiler.

    The input positions, float64 casts and output plan are worked out once here; per call what is left is
    one DLPack import per input, the execution and one export per output. Those jaxlib calls are most of
    a one-add graph's ~70 us (measured on a loaded 2-core machine; ``benchmarks/steady.py`` times it).
    """

    def __init__(
        self,
        name: str,
        target: Target,
        executable: Any,
        inputs: list[Any],
        outputs: list[OutputSpec],
        needs_rng_seed: bool,
        cache_digest: str | None = None,
        serialized: Callable[[], bytes | None] | None = None,
    ) -> None:
        """``serialized`` gives the executable's bytes again (from the compile cache; None if it cannot):
        with it, the graph may unload its executable near the memory-map limit, to reload it when called."""
        # An instance attribute, so that functools.wraps (used by Dynamo's disable) carries it over.
        self._boxed_call = True
        self.name = name
        #: Its compile-cache entry (None: not cached), which AOTAutograd's cache names (``aot_cache``).
        self.cache_digest = cache_digest
        self.target = target
        self.executable = executable
        self.inputs = inputs
        self.outputs = outputs
        self.tensor_positions = [i for i, s in enumerate(inputs) if isinstance(s, TensorSpec)]
        self.float64_inputs = {i for i in self.tensor_positions if inputs[i].dtype == torch.float64}
        self._feed = [(i, i in self.float64_inputs, inputs[i].perm) for i in self.tensor_positions]
        self.needs_rng_seed = needs_rng_seed
        self._no_seed: Any = None  # made at first call: compile time runs under FakeTensorMode
        # The common plan, each output one executable result as it comes: hand the results over directly.
        # Confirmed against the results' dtypes at the first call (in __call__); any output that needs
        # more than the result itself (a view, a copy, a cast) takes the general path.
        direct = [s.index for s in outputs if s.kind == "tensor" and s.stride is None and s.duplicate_of is None]
        plain = len(direct) == len(outputs) and len(set(direct)) == len(direct)
        self._direct: list[int] | None = direct if plain else None
        # Outputs that are inputs (or views of them) are taken from the call's arguments.
        self._aliased_inputs = sorted({s.index for s in outputs if s.kind == "input"})
        self._direct_checked = False
        # Nothing to compute when every output is an input, a view of one or a constant (the backward of
        # an add, a graph of views) and no random draw must advance torch's generator: the executable
        # has no results and no effects, so it is not run (eager launches no kernel there either).
        self._runs = needs_rng_seed or any(s.kind == "tensor" for s in outputs)
        self.calls = 0
        self.last_call = 0
        self._serialized = serialized
        self._unloaded_blob: bytes | None = None
        if serialized is not None and self._runs:
            _UNLOADABLE.add(self)

    def unload(self) -> bool:
        """Drop the loaded executable, to be loaded again at the next call, if its bytes can be had; whether
        it was dropped. Frees the memory maps of its JIT-compiled code (``map_budget``)."""
        if self.executable is None or self._serialized is None:
            return False
        if not _RELOAD_LOCK.acquire(blocking=False):  # another thread is loading one: keep this one
            return False
        try:
            blob = self._serialized()
            if blob is None:
                return False
            self._unloaded_blob = blob
            self.executable = None  # a call already past its executable's lookup holds its own reference
            return True
        finally:
            _RELOAD_LOCK.release()

    def _reload(self) -> Any:
        """The executable ``unload`` dropped, loaded again (once, whichever thread calls first)."""
        with _RELOAD_LOCK:
            if self.executable is None:
                self.executable = self.target.deserialize(self._unloaded_blob)
                self._unloaded_blob = None
                log.info("neuron_compile: reloaded the executable of %s", self.name)
            return self.executable

    def _seed(self) -> Any:
        if not self.needs_rng_seed:
            if self._no_seed is None:
                self._no_seed = self.target.constant_buffer(np.zeros(2, dtype=np.int32))
            return self._no_seed
        # Drawn from torch's default generator: torch.manual_seed makes compiled random ops reproducible.
        return self.target.to_device(torch.randint(-(2**31), 2**31 - 1, (2,), dtype=torch.int32))

    def _outputs_without_running(self, args: list[Any]) -> list[Any]:
        """Outputs with the shapes, dtypes and strides torch computed, built without running the executable:
        what eager gives for meta inputs, and all of a graph whose outputs are inputs or constants."""
        out: list[Any] = []
        for spec in self.outputs:
            if spec.kind == "const":
                out.append(spec.value)
            elif spec.kind == "input":
                out.append(_input_alias(args[spec.index], spec))
            elif spec.stride is not None:
                out.append(torch.empty_strided(spec.spec.shape, spec.stride, dtype=spec.spec.dtype, device="meta"))
            else:
                out.append(torch.empty(spec.spec.shape, dtype=spec.spec.dtype, device="meta"))
        return out

    def __call__(self, args: list[Any]) -> list[Any]:
        self.calls += 1
        self.last_call = next(_CALL_CLOCK)
        if not self._runs:
            out = self._outputs_without_running(args)
            args.clear()
            return out
        if DEVICE_CALL is not None and DEVICE_CALL[0](args, self._feed):
            return DEVICE_CALL[1](self, args)
        to_device = self.target.to_device
        buffers = []
        for i, f64, perm in self._feed:
            t = args[i]
            if t.is_meta:
                # Dynamo traced these inputs with fake tensors, so devices are consistent: nothing to run.
                out = self._outputs_without_running(args)
                args.clear()
                return out
            if f64:
                t = t.to(torch.float32)
            elif t.is_complex():  # carried as (real, imag) float32 pairs (lowering/complex_pairs.py)
                t = torch.view_as_real(t.resolve_conj().to(torch.complex64))
            if perm is not None:  # compiled in the input's memory order: this view of it is row-major
                t = t.permute(*perm, *range(len(perm), t.dim()))
            # contiguous() is the tensor itself when it already is: DLPack wraps only dense row-major here.
            buffers.append(to_device(t.contiguous()))
        buffers.append(self._seed())
        executable = self.executable
        if executable is None:  # unloaded near the memory-map limit
            executable = self._reload()
        aliased = {i: args[i] for i in self._aliased_inputs}
        args.clear()  # boxed convention: let the caller's inputs be freed as early as possible
        results = self.target.run(executable, buffers)
        del buffers
        to_torch = self.target.to_torch
        if self._direct is not None:
            if self._direct_checked:
                return [to_torch(results[k]) for k in self._direct]
            self._direct_checked = True
            tensors = [to_torch(r) for r in results]
            if all(tensors[s.index].dtype == s.spec.dtype for s in self.outputs if s.spec is not None):
                return [tensors[k] for k in self._direct]
            self._direct = None
        else:
            tensors = [to_torch(r) for r in results]
        storages: dict[tuple[int, int | None], torch.Tensor] = {}
        out: list[Any] = []
        for spec in self.outputs:
            if spec.kind == "const":
                out.append(spec.value)
                continue
            if spec.kind == "input":
                out.append(_input_alias(aliased[spec.index], spec))
                continue
            key = (spec.index, spec.duplicate_of)
            t = storages.get(key)
            if t is None:
                t = tensors[spec.index]
                if spec.duplicate_of is not None:
                    t = t.clone()  # two storages in eager computed as one value: never hand out one buffer twice
                if spec.spec is not None and spec.spec.dtype.is_complex:
                    t = torch.view_as_complex(t)  # the executable's (real, imag) pair, as torch's complex
                if spec.spec is not None and t.dtype != spec.spec.dtype:
                    t = t.to(spec.spec.dtype)  # float64 computed as float32, returned as float64
                storages[key] = t
            if spec.stride is not None:
                # Views of one buffer share its storage and version counter, as views of one tensor in eager.
                t = t.as_strided(spec.spec.shape, spec.stride, spec.storage_offset)
            out.append(t)
        return out


def _input_alias(t: torch.Tensor, spec: OutputSpec) -> torch.Tensor:
    """Graph input ``t`` as the output ``spec`` names: the input itself, or the view of it eager makes."""
    if spec.stride is None:
        return t
    if spec.input_stride is not None and t.stride() != spec.input_stride:
        # Not the layout the view was compiled against (Dynamo guards strides, so not expected): the
        # view is taken of a copy laid out as compiled. Same values; only the aliasing is lost.
        t = torch.empty_strided(t.shape, spec.input_stride, dtype=t.dtype, device=t.device).copy_(t)
    return t.as_strided(spec.spec.shape, spec.stride, t.storage_offset() + spec.storage_offset)


def _unload_idle_graphs() -> None:
    """Near the memory-map limit: every graph but the ``KEEP_LOADED`` most recently called unloads its
    executable (a reload at its next call costs a cache load)."""
    graphs = sorted(_UNLOADABLE, key=lambda g: g.last_call)
    idle = graphs[: max(len(graphs) - KEEP_LOADED, 0)]
    unloaded = sum(g.unload() for g in idle)
    log.info("neuron_compile: near the memory-map limit, unloaded %d of %d idle graphs", unloaded, len(idle))


map_budget.add_relief(_unload_idle_graphs, rank=1)
