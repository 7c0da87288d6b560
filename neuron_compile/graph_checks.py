"""Checks on FX graphs before anything is traced: tensor kinds, static shapes, data-dependent shapes,
non-aten nodes, the recompile limit. Pure torch: nothing here imports jax or the lowerings."""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, Callable

import torch
import torch._subclasses.fake_tensor
import torch.fx.experimental.symbolic_shapes

from . import provenance
from .dtypes import DEVICE_DTYPES
from .errors import NeuronDynamicShapeError, NeuronUnsupportedOpError, UnsupportedNode

log = logging.getLogger(__name__)

STATIC_SHAPE_FIX = (
    "The Neuron compiler needs static shapes. Use torch.compile(..., dynamic=False) (and do not mark "
    "dims dynamic with torch._dynamo.mark_dynamic). For inputs whose sizes vary, pad them to a few fixed "
    "sizes (buckets, e.g. sequence lengths rounded up to a multiple of 128, neuron_compile.pad_to_bucket) so "
    "each bucket compiles once; for Hugging Face generate, use a static KV cache "
    '(generate(..., cache_implementation="static")).'
)


def is_symbolic(value: Any) -> bool:
    """Whether ``value`` is a symbolic size or scalar (SymInt/SymFloat/SymBool) rather than a number."""
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def check_tensor_kinds(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> None:
    """Refuse sparse, nested and quantized inputs (and dtypes the device lacks) up front, naming each and
    its first use."""
    bad = unsupported_inputs(gm, example_inputs)
    if bad:
        raise NeuronUnsupportedOpError(gm.__class__.__name__, bad)


def check_static_shapes(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> None:
    """Raise ``NeuronDynamicShapeError`` naming every symbolic input or dimension of the graph."""
    problems: list[str] = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        example = node.meta.get("example_value", value)
        if is_symbolic(value) or is_symbolic(example):
            problems.append(f"  input '{node.name}' is a symbolic size ({example})")
        elif isinstance(example, torch.Tensor):
            dims = [f"dim {i} = {s}" for i, s in enumerate(example.shape) if is_symbolic(s)]
            if dims:
                problems.append(
                    f"  input '{node.name}' of shape {list(example.shape)} has symbolic "
                    f"{', '.join(dims)} (first used at {provenance.user_source(next(iter(node.users), node))})"
                )
    if problems:
        raise NeuronDynamicShapeError(
            "neuron backend: the graph has dynamic shapes:\n" + "\n".join(problems) + "\n" + STATIC_SHAPE_FIX
        )


_STATIC_SHAPES_MARK = "_neuron_compile_static_shapes"


def keep_shapes_static(compiles_for_neuron: Callable[[Any], bool]) -> None:
    """Turn Dynamo's automatic dynamic shapes off for the sizes and ints of neuron frames (idempotent).

    Under ``torch.compile``'s default ``dynamic=None``, Dynamo traces a frame static and, when a guard on a
    size or an int fails (a partial last batch), traces it again with that value symbolic, which the Neuron
    compiler cannot take. Dynamo decides this in one function, ``torch._dynamo.pgo.update_automatic_dynamic``
    (what it has seen of each input, per frame: whether a value changed), which reads
    ``config.automatic_dynamic_shapes``. For a frame whose tracer ``compiles_for_neuron(tx)``, it runs with that
    config False for every input but a Python float: each new size or int is a new static graph, a recompile
    counted against ``recompile_limit``, as under ``dynamic=False``. A Python float runs with that config True,
    under ``dynamic=False`` too (which sets it False for the whole frame): a float that changes becomes a
    float64 scalar input after its second value (a value, not a shape: an LR scheduler's ``lr`` or OneCycleLR's
    ``betas`` in a compiled ``opt.step``), so the frame compiles twice, not once per value (torch's own
    ``dynamic=False`` compiles once per value, and stops at ``recompile_limit``). ``dynamic=True`` and
    ``mark_dynamic`` still give symbolic sizes (refused by ``check_static_shapes``); other backends' frames are
    left as they are.
    """
    from torch._dynamo import config as dynamo_config
    from torch._dynamo import pgo

    update = pgo.update_automatic_dynamic
    if getattr(update, _STATIC_SHAPES_MARK, False):
        return

    def update_automatic_dynamic(tx: Any, name: str, entry: Any, **kwargs: Any) -> Any:
        if not compiles_for_neuron(tx):
            return update(tx, name, entry, **kwargs)
        # A float's value is an input, not a shape: dynamic=False is about shapes.
        with dynamo_config.patch(automatic_dynamic_shapes=isinstance(entry.scalar, float)):
            return update(tx, name, entry, **kwargs)

    functools.update_wrapper(update_automatic_dynamic, update)
    setattr(update_automatic_dynamic, _STATIC_SHAPES_MARK, True)
    pgo.update_automatic_dynamic = update_automatic_dynamic


def refuse_silent_eager_fallback(allow: bool) -> None:
    """Make Dynamo raise at its recompile limit instead of quietly running the frame in eager.

    Process-wide, because Dynamo reads it per frame; ``allow_eager_fallback=True`` keeps torch's default.
    """
    import torch._dynamo.config as dynamo_config

    if allow or dynamo_config.fail_on_recompile_limit_hit:
        return
    dynamo_config.fail_on_recompile_limit_hit = True
    log.info(
        "neuron backend: set torch._dynamo.config.fail_on_recompile_limit_hit=True so that hitting the "
        "recompile limit (%s) raises instead of running in eager",
        dynamo_config.recompile_limit,
    )


_warned_modes: set[str] = set()


def warn_mode(mode: str | None) -> None:
    if mode and mode != "default" and mode not in _warned_modes:
        _warned_modes.add(mode)
        warnings.warn(
            f"neuron backend: mode={mode!r} has no meaning for the Neuron compiler; compiling as mode='default'.",
            stacklevel=3,
        )


DATA_DEPENDENT_ERRORS: tuple[type[BaseException], ...] = (
    torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode,
    torch._subclasses.fake_tensor.DataDependentOutputException,
    torch._subclasses.fake_tensor.DynamicOutputShapeException,
)


def data_dependent_error(gm: torch.fx.GraphModule, error: BaseException) -> NeuronUnsupportedOpError:
    """The clear error for a graph whose tracing needed a value only known at run time (e.g. a size
    given as a tensor): every Dynamo node whose result depends on tensor data, with its user line (a node
    whose data-dependent value comes from another one's is marked as its follow-up)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    reason = f"data-dependent value ({str(error).splitlines()[0][:160]}); neuronx-cc needs static shapes: pass sizes as Python ints"

    def unbacked(node: torch.fx.Node) -> bool:
        calls = ("call_function", "call_method")
        return node.op in calls and bool(free_unbacked_symbols(node.meta.get("example_value")))

    nodes = [
        UnsupportedNode.from_node(node, reason, follows=None if root is node else root)
        for node, root in data_dependent_roots(gm, unbacked).items()
        if unbacked(node)
    ]
    if not nodes:
        nodes = [UnsupportedNode.from_node(_node_being_traced(gm, error), reason)]
    return NeuronUnsupportedOpError(gm.__class__.__name__, nodes)


def _node_being_traced(gm: torch.fx.GraphModule, error: BaseException) -> torch.fx.Node | None:
    """The node of ``gm`` that AOTAutograd's fx.Interpreter was running when ``error`` was raised."""
    nodes = set(gm.graph.nodes)
    found = None
    tb = error.__traceback__
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            if isinstance(value, torch.fx.Node) and value in nodes and value.op == "call_function":
                found = value
        tb = tb.tb_next
    return found


# -- tensor kinds the device cannot take ------------------------------------------------------------
def unsupported_tensor_kind(t: torch.Tensor) -> str | None:
    """Why ``t`` cannot be compiled (sparse, nested, quantized, odd dtype), or None.

    complex64 and complex128 are compiled: the lowering carries them as (real, imag) float32 pairs
    (complex128 computed as complex64, as float64 as float32); complex32 is refused with the other dtypes."""
    if getattr(t, "is_nested", False):
        return "nested tensor"
    if t.is_sparse or t.layout not in (torch.strided,):
        return f"{t.layout} layout"
    if t.is_quantized:
        return "quantized tensor"
    if t.dtype not in DEVICE_DTYPES and t.dtype not in (torch.complex64, torch.complex128):
        return f"dtype {t.dtype} is not supported by the Neuron compiler"
    return None


#: Devices whose tensors the backend takes: CPU tensors run; meta tensors give meta outputs (shapes only);
#: tensors of this package's ``neuron`` device (neuron_compile/device) run where they lie.
INPUT_DEVICES = ("cpu", "meta", "neuron")
#: Set by neuron_compile.device when it registers the ``neuron`` device (not another library's of that name).
NEURON_DEVICE_REGISTERED = False


def unsupported_device(t: torch.Tensor) -> str | None:
    """Why a graph input on ``t.device`` cannot be run, with what to do, or None."""
    if t.device.type in INPUT_DEVICES and (t.device.type != "neuron" or NEURON_DEVICE_REGISTERED):
        return None
    return (
        f"tensor on device '{t.device}': the neuron backend takes CPU tensors (it moves data to the "
        f"NeuronCore itself; the cpu target runs on XLA CPU) or meta tensors (shapes only); move the "
        f"model and inputs to CPU with .cpu() / .to('cpu')"
    )


def unsupported_inputs(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> list[UnsupportedNode]:
    """Every graph input of a kind or on a device the backend cannot take, named with the user line of
    its first use."""
    bad = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if not isinstance(value, torch.Tensor):
            continue
        kind = unsupported_tensor_kind(value)
        problem = f"unsupported tensor kind: {kind}" if kind else unsupported_device(value)
        if problem:
            shape = "" if getattr(value, "is_nested", False) else list(value.shape)
            bad.append(
                UnsupportedNode(
                    op=f"input '{node.name}'",
                    inputs=f"{type(value).__name__} {value.dtype}{shape} on {value.device}",
                    source=provenance.user_source(next(iter(node.users), node)),
                    reason=problem,
                )
            )
    return bad


# -- before lowering: what no target can run --------------------------------------------------------
def symbolic_sizes(val: Any) -> list[str]:
    """The symbolic sizes (or the symbolic value) of an FX node's ``meta["val"]``: empty when static."""
    vals = val if isinstance(val, (tuple, list)) else [val]
    out = []
    for t in vals:
        if isinstance(t, torch.Tensor):
            out += [str(s) for s in t.shape if is_symbolic(s)]
        elif is_symbolic(t):
            out.append(str(t))
    return out


def data_dependent_reason(node: torch.fx.Node) -> str | None:
    """Why ``node`` cannot be compiled because its output shape or value depends on tensor data, or None.

    Such nodes (``nonzero``, boolean-mask indexing, ``.item()`` under Dynamo's
    ``capture_dynamic_output_shape_ops`` / ``capture_scalar_outputs``, and the size/range nodes that use
    their result) cannot be compiled by neuronx-cc, which has no dynamic shapes, nor by XLA CPU;
    ``strict=False`` cannot relax this.
    """
    sizes = symbolic_sizes(node.meta.get("val")) if node.op == "call_function" else []
    if not sizes:
        return None
    return (
        f"data-dependent output shape ({', '.join(sizes)}): neuronx-cc needs static shapes; "
        "keep the shape fixed (e.g. torch.where(mask, x, 0) instead of x[mask])"
    )


_CALLS = ("call_function", "call_method", "call_module")


def data_dependent_roots(
    gm: torch.fx.GraphModule, is_data_dependent: Callable[[torch.fx.Node], bool] | None = None
) -> dict[torch.fx.Node, torch.fx.Node]:
    """Every node of ``gm`` whose value depends on a data-dependent one, mapped to its root cause.

    A root cause is a node that is data-dependent (by default: has a symbolic output, see
    ``data_dependent_reason``) while none of its inputs is; it maps to itself. Every node that uses, through
    the graph's data flow, the value of a root cause (its ``sym_size``/range asserts, a ``sum`` over
    ``x[mask]``) maps to that root (the first one, in graph order, when it uses several)."""
    check = is_data_dependent or (lambda node: data_dependent_reason(node) is not None)
    roots: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op not in _CALLS:
            continue
        upstream = next((roots[a] for a in node.all_input_nodes if a in roots), None)
        if upstream is not None:
            roots[node] = upstream
        elif check(node):
            roots[node] = node
    return roots


_HIGHER_ORDER_REASONS = {
    "cond": "torch.cond (data-dependent control flow): neuronx-cc supports no conditional; compute both "
    "branches and select with torch.where",
    "while_loop": "torch.while_loop: neuronx-cc supports only loops with a static trip count; unroll it or "
    "use a Python loop with a fixed count",
}


def non_aten_reason(target: Any) -> str:
    """The error reason for an FX node whose target is not an aten op (e.g. a higher-order op)."""
    name = getattr(target, "__name__", str(target))
    if name in _HIGHER_ORDER_REASONS:
        return _HIGHER_ORDER_REASONS[name]
    return f"not an aten op ({name} has no lowering)"
