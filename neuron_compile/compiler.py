"""Compiles one AOTAutograd graph (forward, backward or inference) for the chosen target.

The pipeline of one graph: cache lookup -> lower to StableHLO -> legality check -> target compile ->
cache store -> a boxed callable. Each step lives in its own module; this one only orders them.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import shutil
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch._prims_common import make_contiguous_strides_for

from . import debug, distributed, hbm
from .artifact import SAVED_FOR_BACKWARD_FROM, Artifact, OutputSpec, channels_last_strides
from .cache import cache_for
from .errors import (
    WARNING_CLASSES,
    NeuronFloat64Warning,
    NeuronNkiUnavailableWarning,
    NeuronUnsupportedOpError,
    NeuronWarning,
)
from .heap import old_objects_frozen
from .kernels.user_ops import has_user_kernels
from .options import Options
from .runtime import compile_pool, jax_adapter, map_budget, neuronx_cc
from .runtime.executor import CompiledGraph
from .runtime.targets import GraphLabel, target_for
from .stats import STATS, GraphRecord
from .value_checks import CheckedGraph, split_value_checks

if TYPE_CHECKING:
    from .lowering import LoweredGraph


@dataclass
class CompileHooks:
    """Observers of the pipeline, for tools (the OpInfo harness records which ops reached the backend
    and their legality verdicts). Each is called with the object named, before the step that uses it."""

    #: Every AOTAutograd graph handed to ``compile_graph`` (cache hits included).
    on_graph: list[Callable[[torch.fx.GraphModule], None]] = field(default_factory=list)
    #: Every graph that was lowered (cache misses only), before the legality pass.
    on_lowered: list[Callable[[LoweredGraph], None]] = field(default_factory=list)


HOOKS = CompileHooks()


_FLOAT64_MESSAGE = (
    "neuron backend: graph '{name}' uses float64; Trainium has no float64, so it is computed as float32 "
    "(results are returned as float64). Cast to float32 to silence this."
)


#: Not per graph (no graph name): the compiled artifact repeats it once per process (``_replay``).
NKI_UNAVAILABLE_MESSAGE = (
    "neuron backend: the real `nki` package (AWS Neuron SDK) is not installed (or NEURON_COMPILE_NKI=emulator "
    "keeps it unused), so NKI kernel sites on the neuron target run as their reference StableHLO, compiled by "
    "neuronx-cc like any other op. Install the Neuron SDK's nki to get the kernels."
)


def __getattr__(name: str) -> Any:
    """``lower_graph`` is imported on first use: a cache hit never lowers, and importing every lowering
    family takes ~0.3-0.5 s of a warm start."""
    if name == "lower_graph":
        from .lowering import lower_graph

        globals()[name] = lower_graph
        return lower_graph
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: (category, message) of the ``once_per_process`` warnings this process has shown.
_SHOWN_ONCE: set[tuple[str, str]] = set()


def _replay(artifact: Artifact) -> None:
    for category, message in artifact.warnings:
        cls = WARNING_CLASSES.get(category, NeuronWarning)
        if cls.once_per_process:
            if (category, message) in _SHOWN_ONCE:
                continue
            _SHOWN_ONCE.add((category, message))
        warnings.warn(message, cls, stacklevel=3)


def build_artifact(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    opts: Options,
    name: str,
    compile: bool = True,
    background: bool | None = None,
) -> Artifact:
    """Everything a cache miss costs: lowering, the legality pass, the HBM check and the target compile.
    ``compile=False`` stops before the target compile (an empty executable: ``neuron-compile precompile``
    compiles it later). ``background`` (None: where ``compiles_in_background`` and the graph may be cached):
    once lowered, raise ``compile_pool.Lowered`` with the compile, for a job (``compile_graph`` catches it)."""
    from . import legality

    if background is None:
        background = compiles_in_background(opts) and not _bypasses_cache(gm, opts)

    # Looked up at each call, so that a tool's or test's replacement of compiler.lower_graph is used.
    lower_graph = globals().get("lower_graph") or __getattr__("lower_graph")
    target = target_for(opts)
    map_budget.reserve(f"compiling {name}")  # lowering runs jax (XLA's MLIR, thread pools) whatever the target
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always", NeuronWarning)
        lowered = lower_graph(
            gm, list(example_inputs), name, target=opts.target, kernels=opts.kernels, generation=opts.generation
        )
        for hook in HOOKS.on_lowered:
            hook(lowered)
        try:
            report = legality.check(lowered, opts)
        except NeuronUnsupportedOpError as e:
            refused = getattr(e, "legality_report", None)
            debug.dump_graph(opts, name, gm, lowered, refused, {"lower_s": time.perf_counter() - t0})
            raise
    ours = [(type(w.message).__name__, str(w.message)) for w in raised if isinstance(w.message, NeuronWarning)]
    for w in raised:  # anything not ours goes on as raised
        if not isinstance(w.message, NeuronWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if lowered.downcast_float64:
        ours.append((NeuronFloat64Warning.__name__, _FLOAT64_MESSAGE.format(name=name)))
    if lowered.kernel_sites_as_reference:
        ours.append((NeuronNkiUnavailableWarning.__name__, NKI_UNAVAILABLE_MESSAGE))
    stablehlo = lowered.stablehlo()
    # Will it fit? Refused here, in seconds, rather than by neuronx-cc at the end of its compile (hbm.py).
    estimate = hbm.check(lowered, gm, opts) if compile and opts.target == "neuron" else None
    t1 = time.perf_counter()
    artifact = Artifact(
        name=name,
        stablehlo=stablehlo,
        executable=b"",
        inputs=lowered.inputs,
        outputs=lowered.outputs,
        downcast_float64=lowered.downcast_float64,
        needs_rng_seed=lowered.needs_rng_seed,
        num_ops=lowered.num_ops,
        nki_kernels=sum(lowered.kernel_sites.values()),
        lower_seconds=t1 - t0,
        compile_seconds=0.0,
        target_version=target.version(),
        warnings=ours,
        hbm_peak=estimate.peak_bytes if estimate is not None else None,
        hbm_io=estimate.io_bytes if estimate is not None else None,
    )
    if not compile:
        debug.dump_graph(opts, name, gm, lowered, report, {"lower_s": t1 - t0})
        return artifact
    # Host callbacks (kernels="emulate", user kernels on the CPU target) are live Python objects the executable
    # calls: such a graph is compiled with them and never served from the disk cache.
    label = GraphLabel(name, functools.partial(largest_op_line, lowered))
    callbacks = jax_adapter.host_callbacks_of(lowered.lowered)
    if background and not callbacks:
        raise compile_pool.Lowered(artifact, functools.partial(_with_executable, artifact, target, label))
    artifact = _with_executable(artifact, target, label, callbacks)
    if opts.target == "cpu":  # the executable's own buffer assignment: warned when too large for a NeuronCore
        estimate = hbm.check(lowered, gm, opts, jax_adapter.memory_stats(artifact.loaded))
        artifact.hbm_peak = estimate.peak_bytes if estimate is not None else None
        artifact.hbm_io = estimate.io_bytes if estimate is not None else None
    debug.dump_graph(opts, name, gm, lowered, report, {"lower_s": t1 - t0, "compile_s": artifact.compile_seconds})
    return artifact


def _with_executable(artifact: Artifact, target: Any, label: GraphLabel, callbacks: Any = ()) -> Artifact:
    """``artifact`` (lowered, no executable) compiled by ``target``."""
    t0 = time.perf_counter()
    executable = target.compile(artifact.stablehlo, callbacks, label)
    return dataclasses.replace(
        artifact,
        executable=target.serialize(executable),
        compile_seconds=time.perf_counter() - t0,
        loaded=executable,
    )


def largest_op_line(lowered: Any) -> str:
    """The op with the largest result of a lowered graph, its size and the user's source line (for a message
    about a compile that does not end)."""
    from .legality.locate import scope_of

    found = jax_adapter.largest_op(lowered.lowered.compiler_ir("stablehlo"))
    if found is None:
        return "none (the module has no ops)"
    op, nbytes, location = found
    scope = scope_of(location, lowered.node_table)
    info = lowered.node_table.get(scope or "", {})
    source = info.get("source") or (scope.partition("@")[2] if scope else "") or "<unknown source line>"
    aten = f" of {info['op']}" if info.get("op") else ""
    return f"{op}{aten} ({nbytes / 2**20:.1f} MiB result) at {source}"


@old_objects_frozen()  # a backward compiled lazily, at its first call, runs outside the backend's freeze
def compile_graph(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    *,
    opts: Options,
    kind: str,
    name: str,
    whole: bool = True,
    check_outputs: int = 0,
) -> CompiledGraph | distributed.SplitGraph | CheckedGraph:
    """Compile ``gm`` for ``opts.target`` (or fetch it from the cache) as a boxed callable.

    ``whole``: ``gm`` is AOTAutograd's graph itself (not a piece of it), with the outputs AOTAutograd
    expects followed by ``check_outputs`` outputs of value checks (``value_checks``), so its outputs saved
    for the backward are known.
    """
    jax_adapter.check_not_forked()  # before lowering: jax's MLIR context has threads of its own
    # eager's raise on a value (linalg info, a zero divisor, an index out of range) cannot run in the graph
    checks = split_value_checks(gm, index_bounds=kind != "backward")
    if checks:
        compiled = compile_graph(
            gm, example_inputs, opts=opts, kind=kind, name=name, whole=whole, check_outputs=len(checks)
        )
        return CheckedGraph(compiled, checks)
    for hook in HOOKS.on_graph:
        hook(gm)
    # XLA CPU cannot reach torch.distributed: there, collectives run between compiled pieces of the graph.
    run_collectives = opts.target == "cpu" and distributed.has_collectives(gm)
    if run_collectives or distributed.has_opaque_inputs(example_inputs):
        return distributed.split_graph(
            gm,
            lambda piece, inputs, i: compile_graph(
                piece, inputs, opts=opts, kind=kind, name=f"{name}_part{i}", whole=False
            ),
            name,
            run_collectives=run_collectives,
        )
    if distributed.has_collectives(gm):
        distributed.annotate_replica_groups(gm)  # the ranks, not a process-local group name, in graph and key
    gm.meta.pop(SAVED_FOR_BACKWARD_FROM, None)
    if kind == "forward" and whole:
        gm.meta[SAVED_FOR_BACKWARD_FROM] = _saved_for_backward_from()
    t0 = time.perf_counter()
    cache_opts = dataclasses.replace(opts, cache=False) if _bypasses_cache(gm, opts) else opts
    compiling = None
    try:
        artifact, cache_state, digest = cache_for(cache_opts).get_or_build(
            gm, example_inputs, cache_opts, lambda: build_artifact(gm, example_inputs, opts, name)
        )
    except compile_pool.Lowered as miss:  # lowered and checked here; neuronx-cc runs as a job of compile_pool
        artifact, cache_state, digest = miss.artifact, "miss", _digest_or_none(gm, example_inputs, cache_opts)
        compiling = (gm, example_inputs, cache_opts, miss.build)
    # Collecting for precompile: the backward is traced with torch's strides, as the neuron target's run traces
    # it, so that its key is the run's (the executor makes channels-last inputs contiguous).
    if kind == "forward" and whole and not opts.precompile_manifest:
        user_outputs = artifact.outputs[: len(artifact.outputs) - check_outputs]
        _report_output_strides(user_outputs, gm.meta[SAVED_FOR_BACKWARD_FROM])
    return compiled_graph(artifact, cache_state, digest, opts, kind, name, t0, compiling)


def _bypasses_cache(gm: torch.fx.GraphModule, opts: Options) -> bool:
    """A debug dump must show this run's lowering, and an executable that calls back into Python (kernels in the
    emulator, user kernels) holds live Python objects: both bypass the cache (and compile in the caller's thread).
    So does a graph compiled with torch-neuronx's ``--no_cache`` in NEURON_CC_FLAGS (option ``neuron_cc_flags``)."""
    return bool(
        opts.debug_dir
        or opts.kernels == "emulate"
        or has_user_kernels(gm)
        or neuronx_cc.wrapper_flags(tuple(opts.neuron_cc_flags)).no_cache
    )


def compiles_in_background(opts: Options) -> bool:
    """Whether a cache miss's target compile runs as a job of ``compile_pool`` (neuron target, compile_jobs > 0;
    without neuronx-cc the compile's error is raised at once, as ever)."""
    return opts.target == "neuron" and compile_pool.jobs(opts.compile_jobs) > 0 and bool(shutil.which("neuronx-cc"))


def _digest_or_none(gm: torch.fx.GraphModule, example_inputs: list[Any], opts: Options) -> str | None:
    """The digest of ``gm``'s cache entry as ``get_or_build`` computes it (None: not cached)."""
    from .cache.key import NotCacheable, cache_key

    if not opts.cache:
        return None
    try:
        return cache_key(gm, example_inputs, opts).digest
    except NotCacheable:
        return None


def compiled_graph(
    artifact: Artifact,
    cache_state: str,
    cache_digest: str | None,
    opts: Options,
    kind: str,
    name: str,
    t0: float,
    compiling: tuple[Any, ...] | None = None,
) -> CompiledGraph:
    """The callable of an artifact, its warnings replayed and its use recorded (``neuron_compile.stats``);
    ``cache_digest`` names its cache entry (None: not cached), for AOTAutograd's cache (``aot_cache``).
    ``compiling``: the artifact is only lowered; (gm, example_inputs, cache options, build) compile it in a job,
    and the callable's first call waits for it (``compile_pool.PendingGraph``)."""
    _replay(artifact)
    target = target_for(opts)
    resident = opts.input_residency == "version_counter" and kind != "backward" and not _unwrapped_subclass_inputs()
    record = GraphRecord(
        name,
        kind,
        artifact.num_ops,
        artifact.lower_seconds,
        artifact.compile_seconds,
        cache_state,
        artifact.nki_kernels,
        artifact.hbm_peak,
        artifact.hbm_io,
    )
    if compiling is not None:
        STATS.record(record)  # its compile time and cache state are filled in by the job
        job = functools.partial(_compile_job, compiling, opts, target, resident, record)
        future = compile_pool.submit(job, compile_pool.jobs(opts.compile_jobs), name)
        outputs, needs_seed = artifact.outputs, artifact.needs_rng_seed
        return compile_pool.PendingGraph(name, target, artifact.inputs, outputs, needs_seed, cache_digest, future)
    executable = artifact.loaded
    if executable is None:
        executable = target.deserialize(artifact.executable)
    if record.hbm_peak is None and target.name == "cpu":  # a cache hit: XLA's buffer assignment tells it
        memory = jax_adapter.memory_stats(executable)
        if memory is not None:
            estimate = hbm.estimate_from_memory(name, memory)
            hbm.judge(estimate, opts)
            record.hbm_peak = estimate.peak_bytes
            record.hbm_io = estimate.io_bytes
    executable = target.for_graph(executable, resident_inputs=resident)
    elapsed = time.perf_counter() - t0
    STATS.record(record)
    if cache_state == "hit":  # a miss was summarized by build_artifact, with its legality verdict
        debug.log_summary(f"neuron_compile: {name}: {artifact.num_ops} aten nodes, cache hit, loaded in {elapsed:.3f}s")
    # A cached graph may unload its executable near the memory-map limit and load it again from the cache.
    serialized = None
    if cache_digest is not None:
        serialized = functools.partial(cache_for(opts).executable_blob, cache_digest, opts)
    return CompiledGraph(
        name,
        target,
        executable,
        artifact.inputs,
        artifact.outputs,
        artifact.needs_rng_seed,
        cache_digest,
        serialized,
    )


def _compile_job(compiling: tuple[Any, ...], opts: Options, target: Any, resident: bool, record: GraphRecord) -> Any:
    """One compile job: the cache's lookup again (another process may have compiled the graph meanwhile, or the
    remote cache have it), else ``build``, stored; the executable as the graph's callable runs it."""
    gm, example_inputs, cache_opts, build = compiling
    artifact, state, _ = cache_for(cache_opts).get_or_build(gm, example_inputs, cache_opts, build)
    record.cache, record.compile_seconds = state, artifact.compile_seconds
    executable = artifact.loaded if artifact.loaded is not None else target.deserialize(artifact.executable)
    return target.for_graph(executable, resident_inputs=resident)


#: Set by the backend while AOTAutograd compiles a Dynamo graph whose inputs include tensor subclasses
#: (DTensor parameters): their inner tensors reach our graphs.
SUBCLASS_INPUTS: contextvars.ContextVar[bool] = contextvars.ContextVar("neuron_subclass_inputs", default=False)


def _unwrapped_subclass_inputs() -> bool:
    """Whether this graph's inputs include the inner tensors of tensor subclasses (DTensor): an in-place
    update (an optimizer step) bumps the wrapper's version counter, not the inner tensor's, so an unchanged
    version proves nothing there and such inputs are written every call. The Dynamo graph's inputs say it
    (``SUBCLASS_INPUTS``, set by the backend); AOTAutograd's metadata too, when it unwrapped them itself (a
    backward, compiled maybe lazily without either, gets the same caution: its inputs change anyway)."""
    if SUBCLASS_INPUTS.get():
        return True
    metadata = getattr(torch._guards.TracingContext.try_get(), "fw_metadata", None)
    from torch._functorch._aot_autograd.schemas import SubclassCreationMeta

    return any(isinstance(m, SubclassCreationMeta) for m in getattr(metadata, "subclass_inp_meta", None) or ())


def _saved_for_backward_from() -> int | None:
    """Where a forward graph's outputs saved for the backward start (AOTAutograd puts the user-visible
    outputs, the mutated inputs and its own extras first), or None when AOTAutograd does not say or the
    graph is of tensor subclasses' insides (whose outputs its metadata does not count)."""
    metadata = getattr(torch._guards.TracingContext.try_get(), "fw_metadata", None)
    if metadata is None:
        return None
    from torch._functorch._aot_autograd.schemas import SubclassCreationMeta

    inner = (*getattr(metadata, "subclass_inp_meta", ()), *getattr(metadata, "subclass_fw_graph_out_meta", ()))
    if any(isinstance(m, SubclassCreationMeta) for m in inner):
        return None
    try:
        return int(metadata.tensors_saved_for_backwards_slice.start)
    except (AssertionError, AttributeError, TypeError):
        return None


def _report_output_strides(outputs: list[OutputSpec], saved_from: int | None) -> None:
    """Tell AOTAutograd the strides of a forward's outputs when some saved for the backward are not
    eager's (channels-last, lowering/layout.py): it compiles the backward for the strides it will get,
    as it does for Inductor's layout choices."""
    context = torch._guards.TracingContext.try_get()
    reported = getattr(context, "output_strides", None)
    if saved_from is None or reported is None:
        return
    if not any(
        spec.kind == "tensor"
        and len(spec.spec.shape) in (4, 5)
        and spec.stride == channels_last_strides(spec.spec.shape)
        and spec.stride != make_contiguous_strides_for(spec.spec.shape)
        for spec in outputs[saved_from:]
    ):
        return
    for spec in outputs:
        if spec.kind == "const" or spec.spec is None:
            reported.append(None)
        elif spec.stride is not None:
            reported.append(tuple(spec.stride))
        elif spec.kind == "input":
            reported.append(tuple(spec.input_stride) if spec.input_stride is not None else None)
        else:
            reported.append(make_contiguous_strides_for(spec.spec.shape))
