"""The op registry: which aten overload is lowered by which function.

A lowering is a plain function from jax values (for tensor arguments) and Python values (for the rest)
to jax values, registered for one or more aten overloads by decorator. Torch semantics shared by many
ops (type promotion, broadcasting, the float64 policy) live in ``semantics.py``, not in the lowerings.

Every entry is what it says: a lowering is registered under its own name in its family file (so
``LOWERINGS[op].__qualname__`` and ``lowered_in(op)`` say where it is), ``out=`` and in-place variants are
filtered by their schema, ops that are always refused live in ``REFUSALS`` with the reason, and an
overload registered twice is an error at import.
"""

from __future__ import annotations

import contextvars
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch._ops import OpOverload, OpOverloadPacket

LoweringFn = Callable[..., Any]

#: aten overload -> lowering function. Read it through ``supported_ops()``.
LOWERINGS: dict[OpOverload, LoweringFn] = {}

#: aten overload -> why it is always refused (e.g. a data-dependent output shape). Not lowered, not in
#: ``supported_ops()``; the interpreter's unsupported-op error gives the reason.
REFUSALS: dict[OpOverload, str] = {}


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


_CURRENT: contextvars.ContextVar[NodeContext | None] = contextvars.ContextVar("neuron_node", default=None)


def current() -> NodeContext:
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError("lowering called outside the graph interpreter")
    return ctx


def _is_out(overload: OpOverload) -> bool:
    """An ``out=`` variant: it writes into a caller's buffer, which a functional graph never has."""
    return any(arg.is_out for arg in overload._schema.arguments)


def _is_inplace(overload: OpOverload) -> bool:
    # torch's naming rule for in-place variants (add_, relu_, __iand__ but not __and__); functionalization
    # removes them from the graphs we get.
    name = overload._schema.name.split("::")[-1]
    return (name.endswith("_") and not name.endswith("__")) or (name.startswith("__i") and name.endswith("__"))


def _overloads(op: OpOverload | OpOverloadPacket) -> list[OpOverload]:
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


def _claim(overload: OpOverload, what: str) -> None:
    """Refuse a second registration of ``overload``: the later one would silently replace the first."""
    if overload in LOWERINGS:
        first = f"lowering {_describe(LOWERINGS[overload])}"
    elif overload in REFUSALS:
        first = f"refusal {REFUSALS[overload]!r}"
    else:
        return
    raise ValueError(f"{overload} is registered twice: as {first} and as {what}")


def _describe(fn: LoweringFn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def register_lowering(*ops: OpOverload | OpOverloadPacket) -> Callable[[LoweringFn], LoweringFn]:
    """Register ``fn`` as the lowering of every given overload (a packet means all its functional
    overloads: ``out=`` and in-place variants are never lowered). Registering an overload twice raises."""

    def decorate(fn: LoweringFn) -> LoweringFn:
        for op in ops:
            for overload in _overloads(op):
                _claim(overload, f"lowering {_describe(fn)}")
                LOWERINGS[overload] = fn
        return fn

    return decorate


def register_refusal(*ops: OpOverload | OpOverloadPacket, reason: str) -> None:
    """Record that every given overload is always refused, and why (the reason is the user's error).

    A refused op is not lowered: ``supported_ops()`` and docs/ops.md list it as unsupported with ``reason``.
    """
    for op in ops:
        for overload in _overloads(op):
            _claim(overload, f"refusal {reason!r}")
            REFUSALS[overload] = reason


#: ``_c10d_functional`` collective -> its lowering (neuron target; lowering/collectives.py). Not aten ops: kept
#: out of LOWERINGS, ``supported_ops()`` and docs/ops.md, which list the aten op set.
COLLECTIVE_LOWERINGS: dict[OpOverload, LoweringFn] = {}


#: ``"namespace.op.overload"`` -> lowering, for custom ops of other libraries (transformers' MoE ops) that
#: are defined when that library is imported, possibly after this package: looked up by name when a graph
#: meets them. Not aten ops: kept out of ``supported_ops()`` and docs/ops.md.
LIBRARY_LOWERINGS: dict[str, LoweringFn] = {}


def lowering_for(op: Any) -> LoweringFn | None:
    if not isinstance(op, OpOverload):
        return None
    return LOWERINGS.get(op) or COLLECTIVE_LOWERINGS.get(op) or LIBRARY_LOWERINGS.get(str(op))


def refusal_for(op: Any) -> str | None:
    """Why ``op`` is always refused, or None if it is not in the table of refusals."""
    return REFUSALS.get(op) if isinstance(op, OpOverload) else None


def lowered_in(op: OpOverload) -> str:
    """Where ``op``'s lowering is defined, as ``lowering/<family>.py:<line>`` (relative to the package)."""
    fn = inspect.unwrap(LOWERINGS[op])
    path = Path(inspect.getsourcefile(fn) or "?")
    line = inspect.getsourcelines(fn)[1]
    package = Path(__file__).resolve().parent.parent
    try:
        path = path.resolve().relative_to(package)
    except ValueError:
        pass
    return f"{path.as_posix()}:{line}"


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
