"""The op registry: one dispatch record per op, holding everything the backend has for it.

A record holds the op's lowering (a plain function from jax values, for tensor arguments, and Python
values, for the rest, to jax values) or the reason it is always refused; its lowering on (real, imag) pairs
for complex operands (``complex_pairs.py``); the NKI kernel it may be routed to (``kernel_routing.py``); its
channels-last handler (``layout.py``); and, read on demand, how ``decompositions.decomposition_table()``
treats it (``DispatchRecord.decomposition``) and its trn2/trn3 legality verdict (``DispatchRecord.verdicts``,
measured by the OpInfo sweep and the overload exercise). Each part is registered by decorator next to its
code, and a part registered twice for one op is an error at import. ``dispatch.resolve(node)`` picks from the
record with one fixed precedence; the interpreter makes that one call per node.

Records are of four families: aten overloads (the op set ``supported_ops()`` and docs/ops.md list), the
``_c10d_functional`` collectives (``collectives.py``), higher-order ops (``flex_attention``), and custom ops of
other libraries (transformers' MoE ops), which may be defined after this package is imported and are therefore
registered and found by name (``"namespace.op.overload"``).

Torch semantics shared by many ops (type promotion, broadcasting, the float64 policy) live in
``semantics.py``, not in the lowerings. A lowering is registered under its own name in its family file (so
``LOWERINGS[op].__qualname__`` and ``lowered_in(op)`` say where it is); ``out=`` and in-place variants are
filtered by their schema.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

import torch
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket

from .. import decompositions

LoweringFn = Callable[..., Any]

#: A channels-last handler (``layout.py``): called with the node's lowering, its args and kwargs.
LayoutHandler = Callable[[LoweringFn, tuple, dict], Any]


#: The families of records (see the module docstring); only "aten" records are the listed op set.
FAMILIES = ("aten", "collective", "higher-order", "library")


@dataclass
class DispatchRecord:
    """Everything registered for one op. ``lowering`` and ``refusal`` exclude each other."""

    #: The overload (or higher-order op); a library op's ``"namespace.op.overload"`` name.
    op: OpOverload | HigherOrderOperator | str
    #: One of ``FAMILIES``.
    family: str = "aten"
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

    @property
    def decomposition(self) -> str | None:
        """How AOTAutograd's table (``decompositions.decomposition_table()``) treats this op, as a sentence,
        or None when it leaves the op alone (``decompositions.treatment_of``)."""
        if not isinstance(self.op, OpOverload):
            return None
        treatment = decompositions.treatment_of(self.op)
        return treatment.describe() if treatment is not None else None

    @property
    def verdicts(self) -> dict[str, Any]:
        """The op's legality verdicts as last measured (op_verdicts.json, written with docs/ops.md by
        ``python -m tools.gen_ops_doc``): ``"trn2"``/``"trn3"`` -> ``{legal, assumed, reasons, label}``, and
        ``"source"``: "OpInfo" (the sweep's graphs) or "exercised alone"; {} for an op never measured."""
        return dict(_measured_verdicts().get(str(self.op), {}))


#: op (or a library op's name) -> its record. Register through the decorators below; read through ``record_of``.
RECORDS: dict[Any, DispatchRecord] = {}

_PARTS = {f.name for f in fields(DispatchRecord)} - {"op", "family", "kernels", "layout_source"}

#: The legality verdicts of docs/ops.md, per op (written with it by tools/gen_ops_doc.py).
VERDICTS_FILE = Path(__file__).with_name("op_verdicts.json")


@functools.lru_cache(maxsize=1)
def _measured_verdicts() -> dict[str, dict[str, dict[str, Any]]]:
    return json.loads(VERDICTS_FILE.read_text()) if VERDICTS_FILE.exists() else {}


def record_of(op: Any) -> DispatchRecord | None:
    """``op``'s record (an aten overload, a collective, a higher-order op, or a library op by its name)."""
    if isinstance(op, HigherOrderOperator):
        return RECORDS.get(op)
    if not isinstance(op, OpOverload):
        return None
    return RECORDS.get(op) or RECORDS.get(str(op))


class _PartView(Mapping):
    """One part of every aten record as a read-only dict (overload -> part), for code that reads a single
    table: iteration lists the overloads that have the part. Register through the decorators; tests replace a
    part with ``replaced``."""

    def __init__(self, part: str) -> None:
        self.part = part

    def _records(self) -> list[DispatchRecord]:
        return [r for r in RECORDS.values() if r.family == "aten" and getattr(r, self.part) is not None]

    def __getitem__(self, op: Any) -> Any:
        record = RECORDS.get(op) if isinstance(op, OpOverload) else None
        value = getattr(record, self.part) if record is not None and record.family == "aten" else None
        if value is None:
            raise KeyError(op)
        return value

    def __iter__(self) -> Iterator[OpOverload]:
        return iter([r.op for r in self._records()])

    def __len__(self) -> int:
        return len(self._records())


#: aten overload -> lowering function (a view of the records). Read it through ``supported_ops()``.
LOWERINGS: Mapping[OpOverload, LoweringFn] = _PartView("lowering")

#: aten overload -> why it is always refused (a view of the records). Not lowered, not in ``supported_ops()``.
REFUSALS: Mapping[OpOverload, str] = _PartView("refusal")


@contextlib.contextmanager
def replaced(op: Any, part: str, value: Any) -> Iterator[DispatchRecord]:
    """Tests: ``op``'s ``part`` is ``value`` inside the block (registering the record if needed) and what it was
    after. Not for the package, whose registrations go through the decorators and their duplicate check."""
    if part not in _PARTS:
        raise ValueError(f"{part!r} is not a part of a record: {sorted(_PARTS)}")
    created = op not in RECORDS
    record = RECORDS.setdefault(op, DispatchRecord(op))
    before = getattr(record, part)
    setattr(record, part, value)
    try:
        yield record
    finally:
        if created:
            del RECORDS[op]
        else:
            setattr(record, part, before)


def unregister(op: Any) -> None:
    """Tests: forget every part registered for ``op`` (a custom op made by the test)."""
    RECORDS.pop(op, None)


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


def _register(overload: Any, part: str, value: Any, family: str = "aten") -> DispatchRecord:
    """Set one part of ``overload``'s record; a part set twice is an error (the later one would silently
    replace the first), and so is a lowering next to a refusal."""
    record = RECORDS.setdefault(overload, DispatchRecord(overload, family))
    if record.family != family:
        raise ValueError(f"{overload} is registered as a {record.family} op and now as a {family} op")
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


def register_collective(*ops: OpOverload) -> Callable[[LoweringFn], LoweringFn]:
    """Register ``fn`` as the lowering of the ``_c10d_functional`` collectives ``ops`` (neuron target;
    ``collectives.py``). Not aten ops: not in ``supported_ops()`` or docs/ops.md."""

    def decorate(fn: LoweringFn) -> LoweringFn:
        for op in ops:
            _register(op, "lowering", fn, family="collective")
        return fn

    return decorate


def register_library_op(*names: str) -> Callable[[LoweringFn], LoweringFn]:
    """Register ``fn`` as the lowering of custom ops of other libraries, by ``"namespace.op.overload"`` name:
    they are defined when that library is imported, possibly after this package, and found by name when a
    graph meets them. Not aten ops: not in ``supported_ops()`` or docs/ops.md."""

    def decorate(fn: LoweringFn) -> LoweringFn:
        for name in names:
            _register(name, "lowering", fn, family="library")
        return fn

    return decorate


def register_higher_order(op: HigherOrderOperator) -> Callable[[LoweringFn], LoweringFn]:
    """Register ``fn`` as the lowering of the higher-order op ``op``, which gets the op's subgraphs as
    GraphModules and lowers them through ``NodeContext.run_subgraph`` (scan, map_impl and invoke_subgraph are
    inlined by the interpreter instead). Not aten ops: not in ``supported_ops()`` or docs/ops.md."""

    def decorate(fn: LoweringFn) -> LoweringFn:
        _register(op, "lowering", fn, family="higher-order")
        return fn

    return decorate


def lowering_for(op: Any) -> LoweringFn | None:
    """The real-dtype lowering of ``op`` (any family), from its record."""
    record = record_of(op)
    return record.lowering if record is not None else None


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
