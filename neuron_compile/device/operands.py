"""Python numbers given to eager ops on the device become inputs of their one-op graphs, not part of the key.

Adam's bias corrections (``capturable=False``, the default) and every learning-rate schedule hand the same op a
new float at each step; keyed by value, each step would compile new graphs forever (on Trainium, a
``neuronx-cc`` run each). So a number in a value position of the op's schema (``Scalar``, ``Scalar[]``, or a
``Tensor`` given as a number) is left out of the key and fed to the graph at run time, packed in one float32
and one int64 vector per call.

Which numbers can be fed is decided on the traced graph, never guessed: the op is traced twice, with its
numbers and with probe numbers of the other sign and another magnitude. Where the two graphs differ only in
literals that are exactly the given number in one and its probe in the other, and each such literal sits
where a runtime value means the same as the literal (see :func:`_same_meaning`), those literals become
elements of the vectors. Anything else (a decomposition that computes with the number, branches on it, or
puts it where the lowering needs a constant) keeps the number in the key, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

#: Schema argument types whose Python numbers are values (not dims, sizes or modes).
_VALUE_TYPES = ("number", "Optional[number]", "List[number]", "Tensor", "Optional[Tensor]")
#: Scalar arguments whose lowerings take a runtime value with the same meaning as the number: they convert it
#: to the computation dtype (lowering/pointwise.py ``_scaled``, ``addcmul``, ``addcdiv``; creation.py ``full``).
#: Ops whose number operand may be a runtime 0-d tensor instead (beside dimensioned tensors): arithmetic and
#: comparisons, whose eager kernels compute the same on a wrapped number and a 0-d tensor. Not ``pow`` (eager
#: picks sqrt, square, reciprocal... by the exponent's value) nor any op not listed.
_ELEMENTWISE_ON_NUMBERS = {
    "aten::add", "aten::sub", "aten::rsub", "aten::mul", "aten::div", "aten::remainder", "aten::fmod",
    "aten::eq", "aten::ne", "aten::lt", "aten::le", "aten::gt", "aten::ge", "aten::where",
}  # fmt: skip
_RUNTIME_SCALAR_ARGS = {
    (aten.add.Tensor, "alpha"),
    (aten.sub.Tensor, "alpha"),
    (aten.addcdiv.default, "value"),
    (aten.addcmul.default, "value"),
    (aten.full.default, "fill_value"),
}


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


#: Numbers decompositions and lowerings treat specially (``alpha=1`` adds no product, ``x * 0`` ...): each keeps
#: a key of its own, so that the first value an op sees does not decide for all the others.
_SPECIAL = (0, 1, -1)


def key_of(value: int | float) -> tuple:
    """What a number in a value position contributes to its op's key: its kind, and itself only if special."""
    special = value in _SPECIAL and value == value
    return ("number", type(value).__name__, value if special else None)


def value_positions(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[int]:
    """Where the numbers in value positions of ``op``'s schema are in ``tree_flatten((args, kwargs))``."""
    marked_args, marked_kwargs = list(args), dict(kwargs)
    mark = _Mark()
    for i, arg in enumerate(op._schema.arguments):
        if str(arg.type) not in _VALUE_TYPES:
            continue
        if i < len(args) and not arg.kwarg_only:
            marked_args[i] = _mark_numbers(args[i], mark)
        elif arg.name in kwargs:
            marked_kwargs[arg.name] = _mark_numbers(kwargs[arg.name], mark)
    flat = tree_flatten((tuple(marked_args), marked_kwargs))[0]
    return [i for i, x in enumerate(flat) if isinstance(x, _Mark)]


class _Mark:
    pass


def _mark_numbers(value: Any, mark: _Mark) -> Any:
    if _is_number(value):
        return mark
    if isinstance(value, (list, tuple)):
        return type(value)(mark if _is_number(v) else v for v in value)
    return value


def as_scalar_overload(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> torch._ops.OpOverload:
    """``op``, or its twin taking a ``Scalar`` where ``op`` takes a ``Tensor`` that arrived as a number: torch
    hands a wrapped number (``x % 3`` calls ``remainder.Tensor_out(x, 3)``) to a Python kernel as a number,
    which the ``Tensor`` overload refuses when traced."""
    schema = op._schema.arguments
    numbers = {
        a.name
        for i, a in enumerate(schema)
        if str(a.type) == "Tensor" and _is_number(args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name))
    }
    if not numbers:
        return op
    packet = getattr(aten, op._schema.name.removeprefix("aten::"))
    for name in packet.overloads():
        twin = getattr(packet, name)
        other = twin._schema.arguments
        if len(other) == len(schema) and all(
            a.name == b.name and (str(b.type) == "number" if a.name in numbers else str(a.type) == str(b.type))
            for a, b in zip(schema, other)
        ):
            return twin
    return op


def probe(value: int | float, i: int) -> int | float:
    """A number of the other sign and another magnitude than ``value``, distinct per position ``i``."""
    if isinstance(value, int):
        magnitude = 2 * abs(value) + 3 + i
    else:
        magnitude = 1.25 * abs(value) + 1.375 + 0.0625 * i
    return -magnitude if value >= 0 else magnitude


@dataclass(frozen=True)
class Slot:
    """Where operand ``position`` (an index into the op's flat arguments) goes: element ``index`` of the float32
    vector (``is_float``) or of the int64 one."""

    position: int
    is_float: bool
    index: int


@dataclass
class Lifted:
    """A one-op graph whose numbers are inputs: the graph (its last inputs the vectors) and the slots."""

    gm: torch.fx.GraphModule
    slots: list[Slot]

    @property
    def floats(self) -> int:
        return sum(s.is_float for s in self.slots)

    @property
    def ints(self) -> int:
        return sum(not s.is_float for s in self.slots)

    def numbers(self, flat: list[Any]) -> tuple[list[float], list[int]]:
        """This call's numbers: the float32 vector's and the int64 vector's elements."""
        floats = [float(flat[s.position]) for s in self.slots if s.is_float]
        ints = [int(flat[s.position]) for s in self.slots if not s.is_float]
        return floats, ints


def lift(trace: Callable[[list[Any]], torch.fx.GraphModule], flat: list[Any], positions: list[int]) -> Lifted | None:
    """The graph of ``trace(flat)`` with the numbers at ``positions`` as runtime inputs, or None where that
    would not mean the same for every value (see the module docstring)."""
    if not positions:
        return None
    probed = list(flat)
    by_probe: dict[tuple[type, Any], int] = {}
    for k, pos in enumerate(positions):
        value, bump = probe(flat[pos], k), 0
        while (type(value), value) in by_probe:  # distinct probes, so that a literal names one operand
            bump += 1
            value = probe(flat[pos], k + 101 * bump)
        probed[pos] = value
        by_probe[(type(value), value)] = pos
    try:
        gm, other = trace(flat), trace(probed)
    except Exception:  # a probe value the op refuses (a negative size...): keep the numbers in the key
        return None
    uses = _literal_uses(gm, other, flat, by_probe)
    if uses is None or not uses:
        return None
    return _rewrite(gm, uses, flat)


def _literal_uses(
    gm: torch.fx.GraphModule, other: torch.fx.GraphModule, flat: list[Any], by_probe: dict
) -> list[tuple[torch.fx.Node, str | int, int]] | None:
    """(node, argument index or keyword, operand position) of every literal that is a given number, or None when
    the graphs differ in any other way."""
    nodes, other_nodes = list(gm.graph.nodes), list(other.graph.nodes)
    if len(nodes) != len(other_nodes):
        return None
    uses = []
    for a, b in zip(nodes, other_nodes):
        if a.op != b.op or a.target != b.target or len(a.args) != len(b.args) or a.kwargs.keys() != b.kwargs.keys():
            return None
        pairs = [(i, x, y) for i, (x, y) in enumerate(zip(a.args, b.args))]
        pairs += [(k, a.kwargs[k], b.kwargs[k]) for k in a.kwargs]
        for where, x, y in pairs:
            if _same(x, y):
                continue
            if not (_is_number(x) and _is_number(y) and type(x) is type(y)):
                return None
            pos = by_probe.get((type(y), y))
            if pos is None or type(flat[pos]) is not type(x) or flat[pos] != x or not _same_meaning(a, where):
                return None
            uses.append((a, where, pos))
    return uses


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, torch.fx.Node) or isinstance(y, torch.fx.Node):
        return isinstance(x, torch.fx.Node) and isinstance(y, torch.fx.Node) and x.name == y.name
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    return type(x) is type(y) and (x == y or (x != x and y != y))


def _same_meaning(node: torch.fx.Node, where: str | int) -> bool:
    """Whether a runtime 0-d value at this argument of ``node`` computes what the number did: a ``Tensor``
    argument of a listed elementwise op whose other tensor arguments all have dims (a 0-d tensor then sets the
    result dtype exactly as a number does: the default dtype of its kind, only across kinds), or a listed
    ``Scalar`` argument."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload):
        return False
    schema = op._schema.arguments
    arg = schema[where] if isinstance(where, int) else next((a for a in schema if a.name == where), None)
    if arg is None:
        return False
    if (op, arg.name) in _RUNTIME_SCALAR_ARGS:
        return True
    if op._schema.name not in _ELEMENTWISE_ON_NUMBERS:
        return False
    if str(arg.type) != "Tensor" and tensor_twin(op, arg.name) is None:
        return False
    others = [x for x in (*node.args, *node.kwargs.values()) if isinstance(x, torch.fx.Node)]
    metas = [o.meta.get("val") for o in others]
    return bool(metas) and all(isinstance(m, torch.Tensor) and m.dim() > 0 for m in metas)


def tensor_twin(op: torch._ops.OpOverload, name: str) -> torch._ops.OpOverload | None:
    """The overload of ``op``'s packet taking a ``Tensor`` where ``op`` takes the number ``name``, all else equal
    (``mul.Scalar`` -> ``mul.Tensor``): torch defines the former as the latter on a wrapped number."""
    schema = op._schema.arguments
    packet = getattr(aten, op._schema.name.removeprefix("aten::"))
    for overload in packet.overloads():
        twin = getattr(packet, overload)
        other = twin._schema.arguments
        if (
            twin is not op
            and len(other) == len(schema)
            and all(
                a.name == b.name and (str(b.type) == "Tensor" if a.name == name else str(a.type) == str(b.type))
                for a, b in zip(schema, other)
            )
        ):
            return twin
    return None


def _rewrite(gm: torch.fx.GraphModule, uses: list[tuple[torch.fx.Node, str | int, int]], flat: list[Any]) -> Lifted:
    from torch._guards import detect_fake_mode

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([n.meta["val"] for n in placeholders])
    order = sorted({pos for _, _, pos in uses})
    slots, nf, ni = [], 0, 0
    for pos in order:
        is_float = isinstance(flat[pos], float)
        slots.append(Slot(pos, is_float, nf if is_float else ni))
        nf, ni = nf + is_float, ni + (not is_float)
    by_position = {s.position: s for s in slots}
    graph = gm.graph
    elements: dict[int, torch.fx.Node] = {}
    with graph.inserting_after(placeholders[-1]):
        vectors = {}
        for is_float, n, dtype, name in ((True, nf, torch.float32, "floats"), (False, ni, torch.int64, "ints")):
            if n:
                vec = graph.placeholder(f"operand_{name}")
                with fake_mode:
                    vec.meta["val"] = torch.empty(n, dtype=dtype)
                vectors[is_float] = vec
    last = list(vectors.values())[-1]
    with graph.inserting_after(last):
        for slot in reversed(slots):
            vec = vectors[slot.is_float]
            element = graph.call_function(aten.select.int, (vec, 0, slot.index))
            with fake_mode:
                element.meta["val"] = aten.select.int(vec.meta["val"], 0, slot.index)
            elements[slot.position] = element
    for node, where, pos in uses:
        schema = node.target._schema.arguments
        arg = schema[where] if isinstance(where, int) else next(a for a in schema if a.name == where)
        if str(arg.type) == "number" and (node.target, arg.name) not in _RUNTIME_SCALAR_ARGS:
            node.target = tensor_twin(node.target, arg.name)
        if isinstance(where, int):
            args = list(node.args)
            args[where] = elements[pos]
            node.args = tuple(args)
        else:
            node.kwargs = {**node.kwargs, where: elements[pos]}
    graph.lint()
    gm.recompile()
    return Lifted(gm, [by_position[p] for p in order])
