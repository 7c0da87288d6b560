"""Warm start without AOTAutograd's retracing: our compiled graphs in PyTorch's AOTAutograd cache.

A first compile traces the joint graph, partitions it and lowers the forward and backward: that tracing is
most of a warm start once our own cache holds the executables. PyTorch's AOTAutograd cache (the one
Inductor uses) stores, per Dynamo graph, the runtime wrappers AOTAutograd built around the compiled
graphs; here each compiled graph is a ``NeuronOutputCode`` that pickles to the digest of our cache entry,
never to the executable. On a hit AOTAutograd skips its tracing and each ``NeuronOutputCode`` loads its
executable from our cache (integrity, versions and trust checked there, as for any hit); an entry missing
from our cache turns the hit into a plain compile (PyTorch catches the error of ``post_compile``).

What keys a hit: AOTAutograd's part of PyTorch's key (the Dynamo graph's code, the inputs' metadata,
grad/autocast/determinism state, AOTAutograd's config) with torch's version, not Inductor's part
(``_KeyDetails``), plus ``fingerprint(opts)``, carried into it as an attribute of the Dynamo graph: our
options, our cache directory, and the versions of ``cache.key.environment`` (neuron_compile's source
fingerprint among them, so an edited lowering never reuses old wrappers).

Where and when: PyTorch keeps the entries under ``TORCHINDUCTOR_CACHE_DIR`` (``<dir>/aotautograd``); they
are used when our cache is on, PyTorch's own switches allow it (``TORCHINDUCTOR_AUTOGRAD_CACHE``,
``TORCHINDUCTOR_FX_GRAPH_CACHE``, ``torch.compiler.config.force_disable_caches``) and that directory passes
the trust rule of ours (entries are pickles). Storing a training graph's entry needs its backward at
hand, so with this cache on the backward is compiled with the forward, not at the first ``backward()``
(a failure to compile it is still raised by ``backward()``).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import time
import unittest.mock
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._functorch._aot_autograd import autograd_cache
from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
from torch._inductor.output_code import OutputCode

from .options import Options

#: The attribute of the Dynamo graph that carries ``fingerprint`` into AOTAutograd's cache key (which
#: hashes the graph module's ``__dict__``).
FINGERPRINT_ATTR = "_neuron_compile_fingerprint"


def aot_cache_dir() -> str:
    """Where PyTorch keeps AOTAutograd's entries."""
    return autograd_cache.AOTAutogradCache._get_tmp_dir()


def reason_not_used(opts: Options) -> str | None:
    """None if AOTAutograd's cache may hold this compile's graphs, else why not."""
    from .cache.trust import dir_untrusted_reason

    if not opts.cache:
        return "the compile cache is off"
    if opts.debug_dir:
        return "a debug dump must show this run's lowering"
    if opts.kernels == "emulate":
        return "emulated kernels call back into Python"
    if not autograd_cache.should_use_local_autograd_cache() or not torch._inductor.config.fx_graph_cache:
        return "PyTorch's AOTAutograd/FX graph cache is disabled"
    if not opts.trust_cache_dir:
        reason = dir_untrusted_reason(aot_cache_dir())
        if reason is not None:
            return reason
    return None


def fingerprint(opts: Options) -> str:
    """What of ours a hit must match besides the Dynamo graph and inputs (which PyTorch keys)."""
    from .cache.key import environment
    from .cache.paths import resolve_cache_dir

    return json.dumps(
        {"environment": environment(opts), "options": repr(opts), "cache_dir": resolve_cache_dir(opts.cache_dir)},
        sort_keys=True,
    )


class _KeyDetails(autograd_cache.AOTAutogradCacheDetails):
    """What AOTAutograd's own key records (its config, grad/autocast/determinism state, the graph and the
    inputs' metadata), without Inductor's part: its config, passes and source hash say nothing about our
    graphs, and gathering them imports Inductor's code generators (~1 s, more than a hit saves)."""

    def _init_fx_graph_hash_details(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], fx_config: Any
    ) -> None:
        if not all(isinstance(x, (torch.Tensor, int, float, bool, type(None))) for x in example_inputs):
            raise autograd_cache.BypassAOTAutogradCache("neuron_compile: graph input that is not a tensor or number")
        self.gm = gm
        self.example_inputs = list(example_inputs)
        self.torch_version = torch.__version__
        self.default_dtype = torch.get_default_dtype()  # factory calls without a dtype trace to it


def _autograd_cache_key(
    mod: Any, example_inputs: Sequence[Any], config: Any, compiler_config_extra: Any = None
) -> tuple[str, list[str]]:
    """``autograd_cache.autograd_cache_key`` with ``_KeyDetails``."""
    gm = mod.gm if isinstance(mod, torch._dynamo.utils.GmWrapper) else mod
    with autograd_cache.sanitize_gm_for_cache(gm):
        autograd_cache.check_cacheable(gm)
        details = _KeyDetails(gm, example_inputs, config, {})
        digest = autograd_cache.AOTAutogradCachePickler(gm).get_hash(details)
        return autograd_cache.AOTAUTOGRAD_CACHE_PREFIX + digest, []


class NeuronOutputCode(OutputCode):
    """One compiled graph as AOTAutograd's cache holds it: the digest of our entry, not the executable."""

    def __init__(self, graph: Any, opts: Options, kind: str, name: str) -> None:
        self._boxed_call = True
        self.graph = graph
        self.opts = opts
        self.kind = kind
        self.name = name
        self.cache_digest: str | None = getattr(graph, "cache_digest", None)
        #: The value checks run after the graph (``value_checks.CheckedGraph``), restored with it on a hit.
        self.checks: list[Any] | None = getattr(graph, "checks", None)

    def __call__(self, inputs: Sequence[Any]) -> Any:
        return self.graph(inputs)

    def prepare_for_serialization(self) -> None:
        if self.cache_digest is None:  # split, checked or uncacheable graphs: recompiled each time
            raise autograd_cache.BypassAOTAutogradCache(f"neuron_compile: {self.name} is not in the compile cache")
        if _float_specialized_while_tracing():
            raise autograd_cache.BypassAOTAutogradCache(
                f"neuron_compile: {self.name} holds the value of a Python float input (a guard on it)"
            )
        self.graph = None

    def post_compile(self, example_inputs: Sequence[Any], constants: Any, graph_kwargs: Any) -> None:
        if self.graph is not None:
            return
        from . import compiler

        t0 = time.perf_counter()
        artifact = compiler.cache_for(self.opts).load(self.cache_digest, self.opts)
        if artifact is None:
            raise LookupError(f"neuron_compile: {self.name}'s entry {self.cache_digest} is not in the compile cache")
        graph = compiler.compiled_graph(artifact, "hit", self.cache_digest, self.opts, self.kind, self.name, t0)
        self.graph = compiler.CheckedGraph(graph, self.checks) if self.checks else graph

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass


#: The shape environment of the compile ``storing`` wraps and how many guards it held before AOTAutograd ran.
_GUARDS_BEFORE: contextvars.ContextVar[tuple[Any, int] | None] = contextvars.ContextVar(
    "neuron_compile_guards_before", default=None
)


def _shape_env() -> Any:
    context = torch._guards.TracingContext.try_get()
    fake_mode = getattr(context, "fake_mode", None)
    return getattr(fake_mode, "shape_env", None)


def _float_specialized_while_tracing() -> bool:
    """Whether the compile guarded on the value of a Python float that Dynamo passed as an input.

    torch's ``tensorify_python_scalars`` turns the ops that take such a float into tensor ops; where it
    cannot, it bakes the float's value into the graph and adds a guard on it to Dynamo's. AOTAutograd's cache
    keys the Dynamo graph, which is the same for every value, and its entries carry guards on sizes only: a
    hit for the next value would run the old one's graph (wrong values, no error: pytorch#194976, fixed after
    torch 2.13 by a restart; pytorch#197889). Such a graph is not stored.
    """
    before = _GUARDS_BEFORE.get()
    if before is None:
        return False
    shape_env, count = before
    import sympy
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    def on_a_float(guard: Any) -> bool:
        return any(symbol_is_type(s, SymT.FLOAT) for s in guard.expr.free_symbols)

    # Any guard AOTAutograd's tracing added; an equality from Dynamo's own fake propagation too (an op that
    # takes the float as a parameter: the Dynamo graph is the same for every value, pytorch#197889).
    return any(on_a_float(g) for g in shape_env.guards[count:]) or any(
        isinstance(g.expr, sympy.Eq) and on_a_float(g) for g in shape_env.guards[:count]
    )


class _FailedBackward:
    """A backward that ``storing`` compiled ahead of its first use and that failed: its error belongs to
    ``backward()``, as with AOTAutograd's lazy backward, so that a forward-only run under grad still works."""

    def __init__(self, error: Exception) -> None:
        self._boxed_call = True
        self.error = error
        self.traceback = error.__traceback__  # where it failed, not where each backward() re-raised it

    def __call__(self, inputs: list[Any]) -> Any:
        raise self.error.with_traceback(self.traceback)


def deferring_errors(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A backward's ``compile_fn`` that the backend has AOTAutograd call with the forward (not lazily): its error
    belongs to ``backward()`` (``_FailedBackward``) unless the caller forces the backward's compile itself
    (``evaluate``: it wants errors at compile time). Read now, before the backend forces it."""
    if torch._functorch.config.force_non_lazy_backward_lowering:
        return compile_fn

    def compile_or_defer(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        try:
            return compile_fn(gm, example_inputs)
        except Exception as e:
            return _FailedBackward(e)

    return compile_or_defer


def serializable(
    compile_fn: Callable[..., Any], opts: Options, kind: str, name: str
) -> SerializableAOTDispatchCompiler:
    """``compile_fn(gm, example_inputs)`` as a compiler whose results AOTAutograd's cache can store."""
    # Read before ``storing`` forces the backward's compile: a caller that forces it itself (``evaluate``)
    # wants its errors at compile time.
    if kind == "backward":
        compile_fn = deferring_errors(compile_fn)

    def compile_to_output_code(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> NeuronOutputCode:
        return NeuronOutputCode(compile_fn(gm, example_inputs), opts, kind, name)

    return SerializableAOTDispatchCompiler(NeuronOutputCode, compile_to_output_code)


@contextlib.contextmanager
def storing(gm: torch.fx.GraphModule, opts: Options) -> Iterator[None]:
    """Around ``aot_autograd(...)(gm, ...)``: key ``gm`` with our fingerprint and have AOTAutograd store
    bundled entries (our ``NeuronOutputCode`` pickled in them), the backward compiled before it stores."""
    from .cache.key import source_fingerprint
    from .kernels.sdpa import sdpa_flash, sdpa_math

    setattr(gm, FINGERPRINT_ATTR, fingerprint(opts))
    # rewrite_sdpa's targets are ours; PyTorch caches graphs that call only functions it knows to be pure,
    # or ones marked so with a version (here our source's, also in the fingerprint).
    marked = dict(torch._inductor.config.unsafe_marked_cacheable_functions)
    for fn in (sdpa_flash, sdpa_math):
        marked[f"{fn.__module__}.{fn.__name__}"] = source_fingerprint()
    # Process-wide patches, for the length of one backend call: Dynamo compiles one frame at a time
    # (convert_frame's compile lock), so no other AOTAutograd lookup runs meanwhile.
    with (
        torch._functorch.config.patch(bundled_autograd_cache=True, force_non_lazy_backward_lowering=True),
        torch._inductor.config.patch(unsafe_marked_cacheable_functions=marked),
        unittest.mock.patch.object(autograd_cache, "autograd_cache_key", _autograd_cache_key),
    ):
        shape_env = _shape_env()
        token = _GUARDS_BEFORE.set(None if shape_env is None else (shape_env, len(shape_env.guards)))
        try:
            yield
        finally:
            _GUARDS_BEFORE.reset(token)
