"""The "neuron" torch.compile backend: wires the static-shape check, AOTAutograd and our compiler.

Registered through the ``torch_dynamo_backends`` entry point, so ``backend="neuron"`` works without an
import of this package.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Any, Callable, Iterator, Mapping

import torch
from torch._dynamo.backends.common import aot_autograd

from . import trace_fixes
from .graph_checks import (
    DATA_DEPENDENT_ERRORS,
    check_static_shapes,
    check_tensor_kinds,
    data_dependent_error,
    keep_shapes_static,
    refuse_silent_eager_fallback,
    warn_mode,
)
from .heap import old_objects_frozen
from .options import Options
from .recompiles import warn_recompiles

_graph_ids = itertools.count()

# Data-dependent ops (nonzero, x[mask]) must reach the backend so that they are refused with the user's
# line, instead of Dynamo silently running them in eager behind a graph break. Set at import, i.e. when
# torch.compile(backend="neuron") resolves this backend, before any frame is traced.
torch._dynamo.config.capture_dynamic_output_shape_ops = True
# nn.RNN/GRU/LSTM are traced (their time loop unrolled into the graph) instead of running in eager, on the
# host, behind a graph break.
torch._dynamo.config.allow_rnn = True


@contextlib.contextmanager
def _no_mkldnn_decompositions() -> Iterator[None]:
    """Trace with oneDNN off: torch's LSTM decomposition otherwise emits ``aten.mkldnn_rnn_layer``, a CPU
    library kernel, instead of the cell's matmuls and pointwise ops. Nothing runs while tracing. A float32 or
    bfloat16 LSTM decomposes in oneDNN's order of operations instead (decompositions.opmath_recurrent)."""
    from .decompositions import opmath_recurrent

    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        with opmath_recurrent():
            yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


@old_objects_frozen()  # the compile's garbage collections walk only what it allocates (heap.py)
def neuron_backend(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    *,
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> Callable[..., Any]:
    """Compile a Dynamo FX graph for Trainium (or its CPU stand-in), forward and backward."""
    opts = Options.from_user(options)
    if opts.precompile_manifest:  # `neuron-compile precompile collect`: record every graph for the neuron target
        from .cache.collect import start_collecting
        from .compiler import build_artifact

        start_collecting(build_artifact)
    warn_mode(mode)
    refuse_silent_eager_fallback(opts.allow_eager_fallback)
    check_tensor_kinds(gm, example_inputs)
    check_static_shapes(gm, example_inputs)
    warn_recompiles(gm, example_inputs)
    # Imported on first compile: resolving backend="neuron" must not pay for jax and every lowering.
    from . import aot_cache
    from .compiler import compile_graph, compiles_in_background
    from .decompositions import decomposition_table, with_symbolic_scalars
    from .kernels.sdpa import calls_attention, rewrite_sdpa

    if calls_attention(gm):
        rewrite_sdpa(gm, opts.kernels)
    graph_id = next(_graph_ids)

    aot_cache_off = aot_cache.reason_not_used(opts)
    # Compiles in the background (compile_pool): the backward is lowered right after the forward, so that its
    # compile runs beside the forward's, not after the forward's first call (AOTAutograd's cache does so anyway).
    backward_now = aot_cache_off and compiles_in_background(opts)

    def compiler(kind: str) -> Callable[..., Any]:
        name = f"graph{graph_id}_{kind}"
        compile_fn = functools.partial(compile_graph, opts=opts, kind=kind, name=name)
        if backward_now and kind == "backward":
            return aot_cache.deferring_errors(compile_fn)
        return compile_fn if aot_cache_off else aot_cache.serializable(compile_fn, opts, kind, name)

    # Built outside ``storing``: serializable() reads whether the caller itself forces the eager backward.
    compile_with = aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
        decompositions=with_symbolic_scalars(decomposition_table()),
    )
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    from .compiler import SUBCLASS_INPUTS

    subclass_inputs = SUBCLASS_INPUTS.set(any(is_traceable_wrapper_subclass(x) for x in example_inputs))
    try:
        storing = contextlib.nullcontext() if aot_cache_off else aot_cache.storing(gm, opts)
        if backward_now:
            storing = torch._functorch.config.patch(force_non_lazy_backward_lowering=True)
        with storing, _no_mkldnn_decompositions():
            return compile_with(gm, example_inputs)
    except DATA_DEPENDENT_ERRORS as e:
        raise data_dependent_error(gm, e) from e
    finally:
        SUBCLASS_INPUTS.reset(subclass_inputs)


# Before any frame is traced: torch's wrong Autograd kernels replaced, Dynamo's splits of addcdiv & co. undone
# for neuron compiles (trace_fixes.py says why).
trace_fixes.install(neuron_backend)
# Under the default dynamic=None, a new shape compiles a new static graph instead of a symbolic one
# (graph_checks.keep_shapes_static says how).
keep_shapes_static(trace_fixes.compiles_for_neuron)
