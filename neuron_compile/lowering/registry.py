"""The op registry: one dispatch record per aten overload, holding everything the backend has for it.

A record holds the overload's lowering (a plain function from jax values, for tensor arguments, and Python
values, for the rest, to jax values) or the reason it is always refused; its lowering on (real, imag) pairs
for complex operands (``complex_pairs.py``); the NKI kernel it may be routed to (``kernel_routing.py``); and
its channels-last handler (``layout.py``). Each part is registered by decorator next to its code, and a part
registered twice for one overload is an error at import. ``dispatch.resolve(node)`` picks from the record
with one fixed precedence; the interpreter makes that one call per node.

Torch semantics shared by many ops (type promotion, broadcasting, the float64 policy) live in
``semantics.py``, not in the lowerings. A lowering is registered under its own name in its family file (so
``LOWERINGS[op].__qualname__`` and ``lowered_in(op)`` say where it is); ``out=`` and in-place variants are
filtered by their schema.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

import torch
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket

LoweringFn = Callable[..., Any]

#: A channels-last handler (``layout.py``): called with the node's lowering, its args and kwargs.
LayoutHandler = Callable[[LoweringFn, tuple, dict], Any]


@dataclass
class DispatchRecord:
    """Everything registered for one aten overload. ``lowering`` and ``refusal`` exclude each other."""

    op: OpOverload
    #: The StableHLO lowering (real dtypes).
    lowering: LoweringFn | None = None
    #: Why the overload is always refused (a data-dependent output shape...): the user's error.
    refusal: str | None = None
    #: The lowering on (real, imag) pairs, used when an operand or the result is complex.
    complex_pair: LoweringFn | None = None
    #: The NKI kernel site tried before the lowering (``kernels`` != "off"); it returns None when the kernel
    #: does not fit the node, and the lowering runs.
    kernel_route: LoweringFn | None = None
    #: The kernels ``kernel_route`` may call (docs/ops.md's column).
    kernels: tuple[str, ...] = ()
    #: The channels-last handler (CPU target).
    layout_handler: LayoutHandler | None = None
    #: The op makes a channels-last value from plain arguments (convolution); others only keep one.
    layout_source: bool = False

    def paths(self) -> dict[str, str]:
        """Each registered part -> its function (``lowering/<file>.py::<qualified name>``), in dispatch order."""
        parts = {"complex pair": self.complex_pair, "NKI route": self.kernel_route, "lowering": self.lowering,
                 "channels-last": self.layout_handler}  # fmt: skip
        return {what: defined_as(fn) for what, fn in parts.items() if fn is not None}


#: aten overload -> its record. Register through the decorators below; read through ``record_of``.
RECORDS: dict[OpOverload, DispatchRecord] = {}

_PARTS = {f.name for f in fields(DispatchRecord)} - {"op", "kernels", "layout_source"}


def record_of(op: Any) -> DispatchRecord | None:
    return RECORDS.get(op) if isinstance(op, OpOverload) else None


class _PartView(MutableMapping):
    """One part of every record as a dict (overload -> part), for code that reads a single table: iteration
    lists the overloads that have the part. Writing sets the part without the duplicate check (tests)."""

    def __init__(self, part: str) -> None:
        self.part = part

    def __getitem__(self, op: Any) -> Any:
        value = getattr(RECORDS[op], self.part) if op in RECORDS else None
        if value is None:
            raise KeyError(op)
        return value

    def __setitem__(self, op: OpOverload, value: Any) -> None:
        setattr(RECORDS.setdefault(op, DispatchRecord(op)), self.part, value)

    def __delitem__(self, op: Any) -> None:
        self[op]  # KeyError when absent, as a dict
        setattr(RECORDS[op], self.part, None)

    def __iter__(self) -> Iterator[OpOverload]:
        return iter([op for op, record in RECORDS.items() if getattr(record, self.part) is not None])

    def __len__(self) -> int:
        return sum(getattr(record, self.part) is not None for record in RECORDS.values())


#: aten overload -> lowering function (a view of the records). Read it through ``supported_ops()``.
LOWERINGS: MutableMapping[OpOverload, LoweringFn] = _PartView("lowering")

#: aten overload -> why it is always refused (a view of the records). Not lowered, not in ``supported_ops()``.
REFUSALS: MutableMapping[OpOverload, str] = _PartView("refusal")


class Unsupported(Exception):
    """Raised by a lowering for an argument combination it cannot express for the target.

    The interpreter turns it into one line of the single ``NeuronUnsupportedOpError`` of the graph.
    """


@dataclass
class NodeContext:
    """What a lowering may ask about the FX node it is lowering (its output metadata above all)."""

    node: torch.fx.Node
    #: "cpu" or "neuron": lowerings with a device-only form (AwsNeuron* custom calls) choose by it.
    target: str = "cpu"

    #: Called by random ops: returns this node's uint32[2] seed, fresh on every call of the graph.
    seed_source: Any = None
    #: NKI kernel sites: "reference" | "emulate" | "off" (see ``kernel_routing.py``).
    kernels: str = "reference"
    #: Called with a kernel's name at each kernel site, so the graph can count them.
    kernel_site_sink: Any = None
    #: Trainium generation of the neuron target: what the real nki compiles a kernel site's kernel for.
    generation: str = "trn2"
    #: ``run_subgraph(gm, args, where)``: a higher-order op's subgraph (flex_attention's score_mod) lowered by
    #: the interpreter on jax values; returns its outputs, or None when some of its ops were refused (they are
    #: in the graph's one error, each said to be ``where``).
    run_subgraph: Any = None

    def note_kernel_site(self, name: str) -> None:
        if self.kernel_site_sink is not None:
            self.kernel_site_sink(name)

    def rng_seed(self) -> Any:
        """A uint32[2] jax value, different per node and per call, derived from torch's default
        generator (so ``torch.manual_seed`` makes compiled random ops reproducible)."""
        if self.seed_source is None:
            raise Unsupported("random ops are not available in this graph")
        return self.seed_source(self.node)

    @property
    def out(self) -> Any:
        """The node's FakeTensor output (or tuple of them), as computed by AOTAutograd."""
        return self.node.meta.get("val")


_CURRENT: contextvars.ContextVar[Any] = contextvars.ContextVar("neuron_node", default=None)


def current() -> NodeContext:
    """The context of the node being lowered (raises outside the graph interpreter)."""
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError("lowering called outside the graph interpreter")
    return ctx


def current_or_none() -> NodeContext | None:
    return _CURRENT.get()


@contextlib.contextmanager
def lowering_context(ctx: Any) -> Iterator[Any]:
    """Lowerings called inside see ``ctx`` as ``current()`` (the interpreter, per node; complex_pairs.py,
    for a real lowering run on one part of a pair)."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def _is_out(overload: OpOverload) -> bool:
    """An ``out=`` variant: it writes into a caller's buffer, which a functional graph never has."""
    return any(arg.is_out for arg in overload._schema.arguments)


def _is_inplace(overload: OpOverload) -> bool:
    # torch's naming rule for in-place variants (add_, relu_, __iand__ but not __and__); functionalization
    # removes them from the graphs we get.
    name = overload._schema.name.split("::")[-1]
    return (name.endswith("_") and not name.endswith("__")) or (name.startswith("__i") and name.endswith("__"))


def overloads_of(op: OpOverload | OpOverloadPacket) -> list[OpOverload]:
    """The overloads ``op`` stands for: itself, or every functional overload of a packet."""
    if isinstance(op, OpOverload):
        if _is_out(op) or _is_inplace(op):
            raise TypeError(f"{op} is an out= or in-place overload: register its functional overload instead")
        return [op]
    overloads = [getattr(op, name) for name in op.overloads()]
    return [o for o in overloads if not _is_out(o) and not _is_inplace(o) and _touches_tensors(o)]


def _touches_tensors(op: OpOverload) -> bool:
    """Whether ``op`` takes or returns a tensor. A packet also holds overloads of Python numbers, lists and
    dicts (``aten.log.int``, ``aten.copy.Dict_str``), which no aten graph of tensors holds: they are not
    claimed as lowered."""
    schema = op._schema
    return any(isinstance(a.type, (torch.TensorType, torch.OptionalType, torch.ListType)) and "Tensor" in str(a.type)
               for a in list(schema.arguments) + list(schema.returns))  # fmt: skip


def _describe(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}"


def _register(overload: OpOverload, part: str, value: Any) -> DispatchRecord:
    """Set one part of ``overload``'s record; a part set twice is an error (the later one would silently
    replace the first), and so is a lowering next to a refusal."""
    record = RECORDS.setdefault(overload, DispatchRecord(overload))
    clashes = ("lowering", "refusal") if part in ("lowering", "refusal") else (part,)
    for other in clashes:
        first = getattr(record, other)
        if first is not None:
            raise ValueError(
                f"{overload} is registered twice: as {other} {_describe(first)} and as {part} {_describe(value)}"
            )
    setattr(record, part, value)
    return record


def register_lowering(*ops: OpOverload | OpOverloadPacket) -> Callable[[LoweringFn], LoweringFn]:
    """Register ``fn`` as the lowering of every given overload (a packet means all its functional
    overloads: ``out=`` and in-place variants are never lowered). Registering an overload twice raises."""

    def decorate(fn: LoweringFn) -> LoweringFn:
        for op in ops:
            for overload in overloads_of(op):
                _register(overload, "lowering", fn)
        return fn

    return decorate


def register_refusal(*ops: OpOverload | OpOverloadPacket, reason: str) -> None:
    """Record that every given overload is always refused, and why (the reason is the user's error).

    A refused op is not lowered: ``supported_ops()`` and docs/ops.md list it as unsupported with ``reason``.
    """
    for op in ops:
        for overload in overloads_of(op):
            _register(overload, "refusal", reason)


def register_complex_pair(*ops: OpOverload | OpOverloadPacket) -> Callable[[LoweringFn], LoweringFn]:
    """Register ``fn`` as the lowering of ``ops`` on (real, imag) pairs (``complex_pairs.py``)."""

    def decorate(fn: LoweringFn) -> LoweringFn:
        for op in ops:
            for overload in overloads_of(op):
                _register(overload, "complex_pair", fn)
        return fn

    return decorate


def register_kernel_route(op: OpOverload, *kernels: str) -> Callable[[LoweringFn], LoweringFn]:
    """Register ``fn`` as the NKI kernel site of ``op`` (``kernel_routing.py``), calling ``kernels``: it takes
    the node's (jax) arguments and returns its result, or None when the kernel does not fit this node (then the
    lowering runs)."""

    def decorate(fn: LoweringFn) -> LoweringFn:
        _register(op, "kernel_route", fn).kernels = kernels
        return fn

    return decorate


def register_layout_handler(*ops: OpOverload, source: bool = False) -> Callable[[LayoutHandler], LayoutHandler]:
    """Register ``fn`` as the channels-last handler of ``ops`` (``layout.py``); ``source``: the op makes a
    channels-last value from plain arguments."""

    def decorate(fn: LayoutHandler) -> LayoutHandler:
        for op in ops:
            _register(op, "layout_handler", fn).layout_source = source
        return fn

    return decorate


#: ``_c10d_functional`` collective -> its lowering (neuron target; lowering/collectives.py). Not aten ops: kept
#: out of the records, ``supported_ops()`` and docs/ops.md, which list the aten op set.
COLLECTIVE_LOWERINGS: dict[OpOverload, LoweringFn] = {}


#: ``"namespace.op.overload"`` -> lowering, for custom ops of other libraries (transformers' MoE ops) that
#: are defined when that library is imported, possibly after this package: looked up by name when a graph
#: meets them. Not aten ops: kept out of ``supported_ops()`` and docs/ops.md.
LIBRARY_LOWERINGS: dict[str, LoweringFn] = {}


#: Higher-order op (``torch.ops.higher_order.*``) -> its lowering, which gets the op's subgraphs as GraphModules
#: and lowers them through ``NodeContext.run_subgraph``. Not aten ops: kept out of the records,
#: ``supported_ops()`` and docs/ops.md. (scan, map_impl and invoke_subgraph are inlined by the interpreter.)
HIGHER_ORDER_LOWERINGS: dict[HigherOrderOperator, LoweringFn] = {}


def register_higher_order(op: HigherOrderOperator) -> Callable[[LoweringFn], LoweringFn]:
    """Register ``fn`` as the lowering of the higher-order op ``op``; registering it twice raises."""

    def decorate(fn: LoweringFn) -> LoweringFn:
        if op in HIGHER_ORDER_LOWERINGS:
            raise ValueError(
                f"{op.name()} is registered twice: {_describe(HIGHER_ORDER_LOWERINGS[op])} and {_describe(fn)}"
            )
        HIGHER_ORDER_LOWERINGS[op] = fn
        return fn

    return decorate


def lowering_for(op: Any) -> LoweringFn | None:
    """The real-dtype lowering of ``op``: its record's, a collective's, a library op's or a higher-order op's."""
    if isinstance(op, HigherOrderOperator):
        return HIGHER_ORDER_LOWERINGS.get(op)
    if not isinstance(op, OpOverload):
        return None
    record = RECORDS.get(op)
    return (record.lowering if record else None) or COLLECTIVE_LOWERINGS.get(op) or LIBRARY_LOWERINGS.get(str(op))


def refusal_for(op: Any) -> str | None:
    """Why ``op`` is always refused, or None if it is not in the table of refusals."""
    record = record_of(op)
    return record.refusal if record else None


def _source_file(fn: Any) -> str:
    """The file defining ``fn``, relative to the package where it is inside it (``lowering/<family>.py``)."""
    path = Path(inspect.getsourcefile(fn) or "?")
    try:
        path = path.resolve().relative_to(Path(__file__).resolve().parent.parent)
    except ValueError:
        pass
    return path.as_posix()


def defined_at(fn: Any) -> str:
    """Where ``fn`` is defined, as ``lowering/<family>.py:<line>`` (relative to the package)."""
    fn = inspect.unwrap(fn)
    return f"{_source_file(fn)}:{inspect.getsourcelines(fn)[1]}"


def defined_as(fn: Any) -> str:
    """Which function ``fn`` is, as ``lowering/<family>.py::<qualified name>``: unlike a line, it stays the same
    when code above it changes (docs/ops.md lists these, and is checked to be current)."""
    fn = inspect.unwrap(fn)
    return f"{_source_file(fn)}::{fn.__qualname__}"


def lowered_in(op: OpOverload) -> str:
    """Where ``op``'s lowering is defined, as ``lowering/<family>.py:<line>`` (relative to the package)."""
    return defined_at(LOWERINGS[op])


def supported_ops() -> list[str]:
    """Names of every aten overload the backend lowers, sorted (e.g. ``'aten.add.Tensor'``).
    Refused ops (``REFUSALS``) are not in it."""
    return sorted(str(op) for op in LOWERINGS)


# ---- linear-algebra decompositions: refused, each with the reason (docs/ops.md shows it) ---------------------
_OUTSIDE = "run it outside the compiled region (torch.compiler.disable on the function that calls it)"
_PIVOTED = (
    "LDL^T with Bunch-Kaufman pivoting: each step picks by the values a 1x1 or a 2x2 pivot block (and a symmetric "
    "swap), so which column the next step starts at depends on the data; with selects only, every step would "
    "carry both alternatives. Not lowered (LU with partial pivoting is: lowering/factorizations.py); "
    f"{_OUTSIDE}"
)
_NONSYMMETRIC = (
    "eigendecomposition of a general (non-symmetric) matrix: LAPACK's Hessenberg QR iteration deflates where "
    "the values say, and the eigenvalues are complex, which the device lacks (symmetric eigh/eigvalsh and svd "
    f"are lowered: lowering/spectral.py); {_OUTSIDE}"
)
_linalg = torch.ops.aten
register_refusal(_linalg.linalg_ldl_factor_ex, _linalg.linalg_ldl_solve, reason=_PIVOTED)
register_refusal(_linalg.linalg_eig, _linalg._linalg_eigvals, _linalg.linalg_eigvals, reason=_NONSYMMETRIC)
