"""The op registry tells the truth: every lowered overload names its lowering and where it is defined,
no ``out=``/in-place variant and no always-refused op counts as supported, a second registration is an
error, and every overload that is both lowered and decomposed away is listed with the reason."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from neuron_compile import decompositions
from neuron_compile.errors import NeuronUnsupportedOpError
from neuron_compile.lowering import lower_graph, registry
from neuron_compile.lowering.registry import LOWERINGS, REFUSALS, register_lowering, register_refusal, supported_ops

LOWERING_DIR = Path(registry.__file__).resolve().parent
_ops = {str(op): op for op in LOWERINGS}


def _where(op_name: str) -> str:
    """Why ``op_name``'s registered function does not name a function of its family file, or ''."""
    fn = LOWERINGS[_ops[op_name]]
    real = inspect.unwrap(fn)
    source = Path(inspect.getsourcefile(real) or "").resolve()
    if source.parent != LOWERING_DIR or source.name in ("registry.py", "semantics.py"):
        return f"defined in {source}, not in a family file of {LOWERING_DIR}"
    if "<" in fn.__qualname__:
        return f"registered as {fn.__module__}.{fn.__qualname__}, a nameless function"
    module = sys.modules[fn.__module__]
    if Path(module.__file__).resolve() != source:
        return f"__module__ {fn.__module__} is not the file that defines it ({source.name})"
    named = getattr(module, fn.__qualname__, None)
    if named is None or inspect.unwrap(named) is not real:
        return f"{fn.__module__}.{fn.__qualname__} is not the registered function"
    return ""


def test_every_supported_op_names_its_lowering_in_its_family_file() -> None:
    wrong = {name: why for name in supported_ops() if (why := _where(name))}
    assert not wrong, "\n".join(f"{name}: {why}" for name, why in sorted(wrong.items()))


def test_registrations_can_be_found_by_grepping_the_op_name() -> None:
    """No registration through f-strings, getattr or loops over tables: the op is written out."""
    missing = []
    for name, op in _ops.items():
        path = Path(inspect.getsourcefile(inspect.unwrap(LOWERINGS[op])))
        source = path.read_text()
        namespace, packet = op._schema.name.split("::")
        overload = op._overloadname
        qualified = rf"{re.escape(namespace)}\.{re.escape(packet)}"
        written = re.search(rf"{qualified}(\.{re.escape(overload)})?\b(?!\.)", source)
        written = written or f"{namespace}.{packet}.{overload}" in source
        if not written:
            missing.append(f"{name}: neither {name} nor {namespace}.{packet} appears in {path.name}")
    assert not missing, "\n".join(missing)


def test_no_out_or_inplace_overload_is_lowered() -> None:
    bad = [str(op) for op in LOWERINGS if registry._is_out(op) or registry._is_inplace(op)]
    assert not bad, f"out=/in-place overloads registered as lowerings: {bad}"


def test_lowering_names_do_not_look_in_place() -> None:
    # A trailing underscore means in-place in torch (abs_, sum_); no lowering is.
    bad = sorted({f"{fn.__module__}.{fn.__qualname__}" for fn in LOWERINGS.values() if fn.__name__.endswith("_")})
    assert not bad, f"lowerings named like in-place ops: {bad}"


def test_refused_ops_are_not_supported() -> None:
    refused = {str(op) for op in REFUSALS}
    assert {"aten.nonzero.default", "aten.masked_select.default"} <= refused
    assert not refused & set(supported_ops())
    assert all(reason.strip() for reason in REFUSALS.values())


def test_packet_registration_skips_out_and_inplace_variants() -> None:
    overloads = registry.overloads_of(torch.ops.aten.topk)
    assert [str(o) for o in overloads] == ["aten.topk.default"]
    with pytest.raises(TypeError, match="aten.topk.values"):
        registry.overloads_of(torch.ops.aten.topk.values)
    with pytest.raises(TypeError, match="aten.relu_.default"):
        registry.overloads_of(torch.ops.aten.relu_.default)
    assert registry.overloads_of(torch.ops.aten.__and__.Tensor) == [torch.ops.aten.__and__.Tensor]


@pytest.fixture
def test_op():
    """A fresh custom op per test, so registrations made here never leak into the real registry."""
    name = f"t{test_op.count}"
    test_op.count += 1
    lib = torch.library.Library("registry_test", "FRAGMENT")
    lib.define(f"{name}(Tensor x) -> Tensor")
    lib.impl(name, lambda x: x.clone(), "CompositeExplicitAutograd")
    lib.impl(name, lambda x: torch.empty_like(x), "Meta")
    op = getattr(torch.ops.registry_test, name).default
    yield op
    registry.unregister(op)
    lib._destroy()


test_op.count = 0


def first(x):
    return x


def second(x):
    return x


def test_duplicate_registration_raises_naming_both(test_op) -> None:
    register_lowering(test_op)(first)
    with pytest.raises(ValueError, match=r"registered twice.*test_registry\.first.*test_registry\.second"):
        register_lowering(test_op)(second)
    assert LOWERINGS[test_op] is first
    with pytest.raises(ValueError, match=r"registered twice.*first.*refusal 'no'"):
        register_refusal(test_op, reason="no")


def test_refusal_then_lowering_raises(test_op) -> None:
    register_refusal(test_op, reason="never")
    with pytest.raises(ValueError, match=r"registered twice: as refusal 'never' and as lowering .*second"):
        register_lowering(test_op)(second)


def test_refusal_reason_is_the_unsupported_error(test_op) -> None:
    register_refusal(test_op, reason="refused for a test: use torch.where instead")
    assert str(test_op) not in supported_ops()
    gm = make_fx(lambda x: (test_op(x),), tracing_mode="fake")(torch.ones(3))
    with pytest.raises(NeuronUnsupportedOpError) as info:
        lower_graph(gm, [torch.ones(3)], "refusal_test")
    message = str(info.value)
    assert f"{test_op.name()}" in message.replace("::", ".") or str(test_op) in message, message
    assert "refused for a test: use torch.where instead" in message, message
    assert "no lowering for this op" not in message, message


def test_refusal_reason_beats_the_generic_complex_one() -> None:
    """linalg_eig returns complex values and has no pair lowering; its own reason (not lowered at all, and
    why) is what the user needs, not "no lowering for complex operands"."""
    op = torch.ops.aten.linalg_eig.default
    x = torch.randn(4, 4)
    gm = make_fx(lambda x: op(x))(x)
    with pytest.raises(NeuronUnsupportedOpError, match=re.escape(REFUSALS[op][:60])) as info:
        lower_graph(gm, [x], "eig_test")
    assert "no lowering for complex operands" not in str(info.value)


def test_nonzero_refusal_reason_reaches_the_user() -> None:
    reason = REFUSALS[torch.ops.aten.nonzero.default]
    gm = make_fx(lambda x: (torch.ops.aten.nonzero.default(x),))(torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(NeuronUnsupportedOpError, match=re.escape(reason)):
        lower_graph(gm, [torch.tensor([0.0, 1.0, 2.0])], "nonzero_test")


def test_lowered_in_points_at_the_def_line() -> None:
    for name in ("aten.relu.default", "aten.exp.default", "aten.reflection_pad2d.default", "aten.sum.dim_IntList"):
        where = registry.lowered_in(_ops[name])
        path, line = where.rsplit(":", 1)
        assert path.startswith("lowering/") and path.endswith(".py"), where
        lines = (LOWERING_DIR.parent / path).read_text().splitlines()[int(line) - 1 :]
        fn = inspect.unwrap(LOWERINGS[_ops[name]])
        # The line of the def, or of the first of its decorators (usually the registration).
        decorators = next(i for i, text in enumerate(lines) if text.startswith("def "))
        assert lines[decorators].startswith(f"def {fn.__name__}("), f"{name}: {where} is {lines[0]!r}"
        assert all(text.startswith(("@", " ", ")")) for text in lines[:decorators]), f"{name}: {where}"


def test_record_paths_name_each_part_by_function_not_line() -> None:
    """docs/ops.md lists ``record.paths()``: each names its function (``file::qualified name``, which finds it),
    never a line number, so an edit above an op leaves the doc current."""
    import importlib

    from neuron_compile.lowering.registry import RECORDS

    package = LOWERING_DIR.parent
    wrong = []
    for op, record in RECORDS.items():
        parts = {"complex pair": record.complex_pair, "NKI route": record.kernel_route, "lowering": record.lowering,
                 "channels-last": record.layout_handler}  # fmt: skip
        for what, where in record.paths().items():
            path, sep, qualname = where.partition("::")
            if not sep or not (package / path).is_file():
                wrong.append(f"{op} {what}: {where!r} is not file::function")
                continue
            found: object = importlib.import_module("neuron_compile." + path.removesuffix(".py").replace("/", "."))
            for name in qualname.split("."):
                found = getattr(found, name, None)
            if found is None or inspect.unwrap(found) is not inspect.unwrap(parts[what]):
                wrong.append(f"{op} {what}: {where!r} does not name its function")
    assert len(RECORDS) > 400 and not wrong, "\n".join(wrong[:20])


def test_lowered_and_decomposed_overlap_is_listed_exactly() -> None:
    """An overload in both tables is only reached where our decompositions do not run: say where."""
    table = decompositions.decomposition_table()
    overlap = {str(op) for op in LOWERINGS if op in table}
    listed = {str(op) for op in decompositions.LOWERED_AND_DECOMPOSED}
    assert overlap - listed == set(), f"lowered and decomposed, not explained: {sorted(overlap - listed)}"
    assert listed - overlap == set(), f"listed but no longer in both tables: {sorted(listed - overlap)}"
    assert all(reason.strip() for reason in decompositions.LOWERED_AND_DECOMPOSED.values())


# ---- shared pieces said once ---------------------------------------------------------------------------
@pytest.mark.parametrize("ndim", [0, 1, 3])
def test_canonical_dim_matches_torch(ndim: int) -> None:
    from neuron_compile.lowering.semantics import canonical_dim

    x = torch.zeros((2,) * ndim)
    for dim in range(-max(ndim, 1), max(ndim, 1)):
        # torch's own answer: the size of dim ``dim`` equals the size at the canonical axis
        axis = canonical_dim(dim, ndim)
        assert 0 <= axis < max(ndim, 1), (dim, ndim, axis)
        if ndim:
            assert axis == dim % ndim, (dim, ndim, axis)
        assert torch.sum(x, dim=dim).shape == torch.sum(x, dim=axis).shape
    with pytest.raises(IndexError):
        canonical_dim(max(ndim, 1), ndim)


def test_is_symbolic() -> None:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from neuron_compile.graph_checks import is_symbolic

    sym = ShapeEnv().create_unbacked_symint()
    assert is_symbolic(sym) and not is_symbolic(3) and not is_symbolic(2.0) and not is_symbolic(torch.ones(1))


def test_unsupported_node_from_node_names_op_inputs_and_line() -> None:
    from neuron_compile.errors import UnsupportedNode

    gm = make_fx(lambda x: (torch.ops.aten.relu.default(x),), tracing_mode="fake")(torch.ones(2, 3))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    entry = UnsupportedNode.from_node(node, "because")
    assert entry.op == "aten.relu.default" and "[2, 3]" in entry.inputs and entry.reason == "because", entry
    graph = UnsupportedNode.from_node(None, "because")
    assert graph.op == "graph" and graph.source == "<unknown source line>", graph


# ---- one record per op, whatever its family ------------------------------------------------------------------
@pytest.mark.parametrize(
    "op, family",
    [
        (torch.ops._c10d_functional.all_reduce.default, "collective"),
        (torch.ops.higher_order.flex_attention, "higher-order"),
        ("transformers.grouped_mm_fallback.default", "library"),
        (torch.ops.aten.add.Tensor, "aten"),
    ],
    ids=str,
)
def test_every_family_has_one_record(op, family: str) -> None:
    """Collectives, higher-order ops and other libraries' ops are records too; only aten ops are listed."""
    record = registry.RECORDS[op]
    assert record.family == family and record.lowering is not None
    if not isinstance(op, str):
        assert registry.lowering_for(op) is record.lowering and registry.record_of(op) is record
    assert (str(op) in supported_ops()) == (family == "aten")


def test_a_library_op_defined_later_is_found_by_name() -> None:
    """A library op's record is keyed by its name: the op object, made after the package, finds it."""
    lib = torch.library.Library("registry_late", "FRAGMENT")
    lib.define("late(Tensor x) -> Tensor")
    try:
        register = registry.register_library_op("registry_late.late.default")
        register(first)
        assert registry.lowering_for(torch.ops.registry_late.late.default) is first
        with pytest.raises(ValueError, match="registered twice"):
            register(second)
    finally:
        registry.unregister("registry_late.late.default")
        lib._destroy()


def test_a_collective_registered_twice_raises() -> None:
    op = torch.ops._c10d_functional.all_reduce.default
    with pytest.raises(ValueError, match=r"all_reduce.default is registered twice"):
        registry.register_collective(op)(first)


def test_parts_are_read_only_outside_the_decorators(test_op) -> None:
    """LOWERINGS cannot be written (a write would skip the duplicate check); tests use ``replaced``."""
    with pytest.raises(TypeError):
        LOWERINGS[test_op] = first  # type: ignore[index]
    register_lowering(test_op)(first)
    with registry.replaced(test_op, "lowering", second) as record:
        assert LOWERINGS[test_op] is second and record.lowering is second
    assert LOWERINGS[test_op] is first


@pytest.mark.parametrize(
    "op, expected",
    [
        (torch.ops.aten.mm.default, "kept whole: an NKI kernel takes it"),
        (torch.ops.aten.gelu.default, "kept whole"),
        (torch.ops.aten.zeros.default, "core ATen's decomposition; lowered too: reached only in aten graphs"),
        (torch.ops.aten.add.Tensor, None),
    ],
    ids=str,
)
def test_record_says_how_the_decomposition_table_treats_its_op(op, expected: str | None) -> None:
    decomposition = registry.record_of(op).decomposition
    assert (decomposition is None) if expected is None else decomposition.startswith(expected)
    assert (op in decompositions.decomposition_table()) == (expected is not None and "decomposition" in expected)


def test_record_holds_the_measured_legality_verdict() -> None:
    """The verdict docs/ops.md shows is the record's (a legal op, and one the legality pass refuses on trn2)."""
    add = registry.record_of(torch.ops.aten.add.Tensor).verdicts
    assert add["trn2"]["legal"] and add["source"] == "OpInfo"
    illegal = [str(op) for op, r in registry.RECORDS.items() if r.verdicts and not r.verdicts["trn2"]["legal"]]
    assert illegal and all(registry.record_of(getattr_op(name)).verdicts["trn2"]["reasons"] for name in illegal)


def getattr_op(name: str):
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


def test_planned_decompositions_are_said_once() -> None:
    """Every op the plan names has one treatment; the kept-whole ops are out of the table."""
    table = decompositions.decomposition_table()
    for packet in decompositions.KEEP_WHOLE:
        assert not any(getattr(packet, name) in table for name in packet.overloads()), packet
    with pytest.raises(ValueError, match="planned twice"):
        decompositions._plan(decompositions.OURS, "again", torch.ops.aten.mm)
