"""Compiles one AOTAutograd graph (forward, backward or inference) for the chosen target.

The pipeline of one graph: cache lookup -> lower to StableHLO -> legality check -> target compile ->
cache store -> a boxed callable. Each step lives in its own module; this one only orders them.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any

import torch

from . import debug, legality
from .artifact import Artifact
from .cache import cache_for
from .lowering import lower_graph
from .options import Options
from .runtime.cpu import CpuTarget
from .runtime.executor import CompiledGraph
from .runtime.neuron import NeuronTarget
from .stats import STATS, GraphRecord

log = logging.getLogger("neuron_compile")


def target_for(opts: Options) -> Any:
    if opts.target == "neuron":
        return NeuronTarget(opts.generation, opts.neuron_cc_flags)
    return CpuTarget()


def _warn_float64(name: str) -> None:
    warnings.warn(
        f"neuron backend: graph '{name}' uses float64; Trainium has no float64, so it is computed as "
        "float32 (results are returned as float64). Cast to float32 to silence this.",
        stacklevel=2,
    )


def build_artifact(gm: torch.fx.GraphModule, example_inputs: list[Any], opts: Options, name: str) -> Artifact:
    """Everything a cache miss costs: lowering, the legality pass and the target compile."""
    target = target_for(opts)
    t0 = time.perf_counter()
    lowered = lower_graph(gm, list(example_inputs), name, target=opts.target)
    report = legality.check(lowered, opts)
    stablehlo = lowered.stablehlo()
    t1 = time.perf_counter()
    executable = target.compile(stablehlo)
    t2 = time.perf_counter()
    debug.dump_graph(opts, name, gm, lowered, report, {"lower_s": t1 - t0, "compile_s": t2 - t1})
    return Artifact(
        name=name,
        stablehlo=stablehlo,
        executable=target.serialize(executable),
        inputs=lowered.inputs,
        outputs=lowered.outputs,
        downcast_float64=lowered.downcast_float64,
        needs_rng_seed=lowered.needs_rng_seed,
        num_ops=lowered.num_ops,
        lower_seconds=t1 - t0,
        compile_seconds=t2 - t1,
        target_version=target.version(),
        loaded=executable,
    )


def compile_graph(
    gm: torch.fx.GraphModule, example_inputs: list[Any], *, opts: Options, kind: str, name: str
) -> CompiledGraph:
    """Compile ``gm`` for ``opts.target`` (or fetch it from the cache) as a boxed callable."""
    t0 = time.perf_counter()
    artifact, cache_state = cache_for(opts).get_or_build(
        gm, example_inputs, opts, lambda: build_artifact(gm, example_inputs, opts, name)
    )
    if artifact.downcast_float64:
        _warn_float64(name)
    executable = artifact.loaded
    if executable is None:
        executable = target_for(opts).deserialize(artifact.executable)
    elapsed = time.perf_counter() - t0
    STATS.record(
        GraphRecord(name, kind, artifact.num_ops, artifact.lower_seconds, artifact.compile_seconds, cache_state)
    )
    log.info("neuron: %s %s (%d ops, cache %s) in %.3fs", kind, name, artifact.num_ops, cache_state, elapsed)
    return CompiledGraph(name, executable, artifact.inputs, artifact.outputs, artifact.needs_rng_seed)
