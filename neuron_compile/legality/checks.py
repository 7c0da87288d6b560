"""Walks a StableHLO module (as MLIR) and checks each op against ``rules``.

The walk starts at ``main`` and follows ``func.call`` into callees (jax emits private functions for
``jnp`` helpers); an op inside a callee is attributed to the call site in ``main``, whose location carries
the aten node's named scope. A call to a device-call reference body (``AwsNeuronX__cpu_reference``, see
``lowering/device_calls.py``) is checked as the custom call ``AwsNeuronX`` it stands for, without entering
the body: on the neuron target that body does not exist, so it must not decide legality.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from jax.extend.mlir import ir

from ..lowering.device_calls import REFERENCE_SUFFIX
from . import rules

_REFERENCE_CALLEE = re.compile(rf"^@?\"?(\w+?){REFERENCE_SUFFIX}(_\d+)?\"?$")
_INTS = re.compile(r"-?\d+")


@dataclass
class Finding:
    """One illegal op: which rule it breaks and where (the MLIR location of its anchor op)."""

    hlo_op: str
    detail: str
    location: str


@dataclass
class ModuleScan:
    findings: list[Finding] = field(default_factory=list)
    op_counts: Counter = field(default_factory=Counter)
    assumed: Counter = field(default_factory=Counter)  # ops legal only by assumption (rules.OpRule.source)
    #: (assumed op, MLIR location of its anchor op): lets docs attribute "assumed" to an aten node.
    assumed_at: list[tuple[str, str]] = field(default_factory=list)
    device_calls: Counter = field(default_factory=Counter)
    uses_int64: bool = False


def _ranked(t: ir.Type) -> ir.RankedTensorType | None:
    # Newer MLIR bindings hand out the concrete type class; older ones need the cast.
    if isinstance(t, ir.RankedTensorType):
        return t
    isinst = getattr(ir.RankedTensorType, "isinstance", None)
    return ir.RankedTensorType(t) if isinst is not None and isinst(t) else None


def element_type(t: ir.Type) -> str | None:
    r = _ranked(t)
    return str(r.element_type) if r is not None else None


def _op(x: Any) -> ir.Operation:
    return getattr(x, "operation", x)


def _attr(op: ir.Operation, name: str) -> str | None:
    return str(op.attributes[name]) if name in op.attributes else None


def _ints(text: str | None) -> list[int]:
    if not text:
        return []
    return [int(v) for v in _INTS.findall(text.split(":", 1)[1] if text.startswith("array<") else text)]


def _dim_list(dimension_numbers: str, key: str) -> list[int]:
    m = re.search(rf"\b{key} = \[([^\]]*)\]", dimension_numbers)
    return [int(v) for v in _INTS.findall(m.group(1))] if m else []


def _body_ops(op: ir.Operation, region: int = 0) -> list[ir.Operation]:
    return [_op(o) for o in op.regions[region].blocks[0].operations]


def constant_derived(value: ir.Value, depth: int = 8) -> bool:
    """True when ``value`` is a compile-time constant (a constant, maybe broadcast/reshaped/converted)."""
    owner = value.owner
    if isinstance(owner, ir.Block) or depth == 0:
        return False
    owner = _op(owner)
    if owner.name in ("stablehlo.constant", "stablehlo.iota"):
        return True
    if owner.name in ("stablehlo.broadcast_in_dim", "stablehlo.reshape", "stablehlo.convert", "stablehlo.broadcast"):
        return constant_derived(owner.operands[0], depth - 1)
    return False


def dtype_problem(etype: str, generation: str, int64_native: bool) -> str | None:
    """Why ``etype`` (an MLIR element type) cannot be computed on ``generation``; None if it can.

    int64 policy: the graph keeps int64 exact (traced with jax x64). neuronx-cc truncates int64 to int32
    unless it runs with ``--native-int64`` (trn2+, compiler 2.27+), so int64 is legal exactly when that
    flag is in force (``int64_native``).
    """
    if etype in rules.INT64_TYPES:
        if int64_native:
            return None
        return (
            f"{etype} would be truncated to 32 bits by neuronx-cc: pass {rules.NATIVE_INT64_FLAG} "
            "(trn2+, compiler 2.27+) in neuron_cc_flags"
        )
    if etype in rules.DTYPES[generation]:
        return None
    if etype.startswith("complex"):
        return f"{etype}: complex numbers are mostly unsupported by neuronx-cc"
    return rules.DTYPE_REASONS.get(etype, f"{etype} is not a {generation} data type")


class ModuleChecker:
    """Checks one module for one generation. ``run()`` returns a ``ModuleScan``."""

    def __init__(self, module: ir.Module, generation: str, int64_native: bool) -> None:
        self.module = module
        self.generation = generation
        self.int64_native = int64_native
        self.scan = ModuleScan()
        self.funcs: dict[str, ir.Operation] = {}
        for op in module.body.operations:
            op = _op(op)
            if op.name == "func.func":
                self.funcs[str(op.attributes["sym_name"]).strip('"')] = op
        self._stack: list[str] = []
        self._where: ir.Operation | None = None  # anchor of the op being visited

    def assume(self, name: str) -> None:
        """Record an op that is legal only by assumption, where it sits."""
        self.scan.assumed[name] += 1
        self.scan.assumed_at.append((name, str(self._where.location) if self._where is not None else ""))

    def run(self) -> ModuleScan:
        main = self.funcs.get("main")
        if main is None:
            raise ValueError("module has no main function")
        self._walk_region_ops(main, anchor=None)
        return self.scan

    # -- walking --------------------------------------------------------------------------------------
    def _walk_region_ops(self, op: ir.Operation, anchor: ir.Operation | None) -> None:
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    self._visit(_op(inner), anchor)

    def _flag(self, op: ir.Operation, anchor: ir.Operation | None, detail: str) -> None:
        where = anchor if anchor is not None else op
        self.scan.findings.append(Finding(op.name, detail, str(where.location)))

    def _visit(self, op: ir.Operation, anchor: ir.Operation | None) -> None:
        previous, self._where = self._where, anchor if anchor is not None else op
        try:
            self._visit_op(op, anchor)
        finally:
            self._where = previous

    def _visit_op(self, op: ir.Operation, anchor: ir.Operation | None) -> None:
        name = op.name
        self.scan.op_counts[name] += 1
        self._check_types(op, anchor)
        if name == "func.call":
            self._visit_call(op, anchor)
            return
        if name in rules.REFUSED_REASONS:
            self._flag(op, anchor, rules.REFUSED_REASONS[name])
        elif name not in rules.OPS:
            self._flag(op, anchor, f"{name} is not an operator neuronx-cc documents or is known to accept")
        else:
            if rules.OPS[name].source == "assumed":
                self.assume(name)
            check = _CHECKS.get(name)
            if check is not None:
                for detail in check(self, op):
                    self._flag(op, anchor, detail)
        self._walk_region_ops(op, anchor)

    def _visit_call(self, op: ir.Operation, anchor: ir.Operation | None) -> None:
        callee = str(op.attributes["callee"]).lstrip("@").strip('"')
        m = _REFERENCE_CALLEE.match(callee)
        if m:
            target = m.group(1)
            self.scan.device_calls[target] += 1
            for detail in self.custom_call_problems(target, op, backend_config=None):
                self._flag(op, anchor, detail)
            return
        if callee in self._stack or callee not in self.funcs:
            return
        self._stack.append(callee)
        try:
            self._walk_region_ops(self.funcs[callee], anchor if anchor is not None else op)
        finally:
            self._stack.pop()

    def _check_types(self, op: ir.Operation, anchor: ir.Operation | None) -> None:
        seen: set[str] = set()
        values = list(op.operands) + list(op.results)
        for v in values:
            t = v.type
            r = _ranked(t)
            if r is not None and not r.has_static_shape:
                seen.add("dynamic shapes (a tensor with unknown dimension sizes) are not supported by neuronx-cc")
                continue
            et = element_type(t)
            if et is None:
                continue
            if et in rules.INT64_TYPES:
                self.scan.uses_int64 = True
            problem = dtype_problem(et, self.generation, self.int64_native)
            if problem:
                seen.add(problem)
        for detail in sorted(seen):
            self._flag(op, anchor, detail)

    # -- per-op restrictions (each yields the problems it finds) -------------------------------------
    def custom_call_problems(self, target: str, op: ir.Operation, backend_config: str | None) -> Iterator[str]:
        if not rules.custom_call_allowed(target):
            yield f"custom call to '{target}': neuronx-cc only implements AwsNeuron* custom-call targets"
            return
        if target == "AwsNeuronTopK":
            yield from self._topk_problems(op.operands[0], op.results[0])

    def _topk_problems(self, operand: ir.Value, values: ir.Value) -> Iterator[str]:
        et = element_type(operand.type)
        k = _ranked(values.type).shape[-1]
        if et in rules.TOPK_REFUSED_TYPES:
            yield f"TopK on {et} input: neuronx-cc's TopK does not support 32/64-bit integer types"
        if k > rules.TOPK_MAX_K:
            yield f"TopK with k={k}: neuronx-cc supports k <= {rules.TOPK_MAX_K}"


def _check_custom_call(c: ModuleChecker, op: ir.Operation) -> Iterator[str]:
    target = (_attr(op, "call_target_name") or "").strip('"')
    c.scan.device_calls[target] += 1
    yield from c.custom_call_problems(target, op, _attr(op, "backend_config"))


def _check_top_k(c: ModuleChecker, op: ir.Operation) -> Iterator[str]:
    yield from c._topk_problems(op.operands[0], op.results[0])


def _check_reduce(c: ModuleChecker, op: ir.Operation) -> Iterator[str]:
    n = len(op.operands) // 2
    if n > 1:
        yield f"variadic reduce ({n} inputs, e.g. argmax as value+index): neuronx-cc reduces one input at a time"
    body = [o.name for o in _body_ops(op) if o.name != "stablehlo.return"]
    if body in (["stablehlo.or"], ["stablehlo.and"]) and element_type(op.operands[0].type) == "i1":
        # On booleans or/and are max/min; the table does not say whether pred reductions are taken.
        c.assume(f"stablehlo.reduce({body[0].split('.')[1]} on i1)")
    elif len(body) != 1 or body[0] not in rules.REDUCERS:
        yield f"reduce with reducer {body}: neuronx-cc takes only add/multiply/minimum/maximum reducers"
    if not all(constant_derived(v) for v in list(op.operands)[n:]):
        yield "reduce with a non-constant init value: neuronx-cc needs constant init values"


def _check_reduce_window(c: ModuleChecker, op: ir.Operation) -> Iterator[str]:
    if len(op.operands) != 2:
        yield f"reduce_window with {len(op.operands)} operands: neuronx-cc takes exactly one input and one init"
    for key in ("base_dilations", "window_dilations"):
        if any(v != 1 for v in _ints(_attr(op, key))):
            yield f"reduce_window with {key} != 1: not supported by neuronx-cc"


def _check_sort(c: ModuleChecker, op: ir.Operation) -> Iterator[str]:
    for o in _body_ops(op):
        if o.name == "stablehlo.return":
            continue
        if o.name != "stablehlo.compare":
            yield f"sort comparator uses {o.name}: neuronx-cc takes a single plain LT/LE/GT/GE comparison"
            return
        direction = re.search(r"comparison_direction (\w+)", _attr(o, "comparison_direction") or "")
        kind = _attr(o, "compare_type") or ""
        if not direction or direction.group(1) not in rules.SORT_DIRECTIONS or "TOTALORDER" in kind:
            yield (
                f"sort comparator {direction.group(1) if direction else '?'} {kind}: neuronx-cc takes a "
                "plain LT/LE/GT/GE comparison (no TOTALORDER)"
            )
            return


def _check_dot(c: ModuleChecker, op: ir.Operation) -> Iterator[str]:
    types = {element_type(v.type) for v in op.operands}
    if types & rules.INTEGER_TYPES:
        yield (
            f"integer dot ({'/'.join(sorted(t for t in types if t))}): neuronx-cc has no integer matmul datapath "
            "(cast to float, or use AwsNeuronIntMatmult)"
        )


def _check_convolution(c: ModuleChecker, op: ir.Operation) -> Iterator[str]:
    types = {element_type(v.type) for v in op.operands}
    if types & rules.INTEGER_TYPES:  # a convolution runs on the matmul engine, which has no integer datapath
        yield (
            f"integer convolution ({'/'.join(sorted(t for t in types if t))}): neuronx-cc has no integer matmul "
            "datapath (cast to float)"
        )
    lhs = any(v != 1 for v in _ints(_attr(op, "lhs_dilation")))
    rhs = any(v != 1 for v in _ints(_attr(op, "rhs_dilation")))
    stride = any(v != 1 for v in _ints(_attr(op, "window_strides")))
    if lhs and rhs:
        yield "convolution with input dilation and kernel dilation together: not supported by neuronx-cc"
    if lhs and stride:
        yield "convolution with stride and input dilation together: not supported by neuronx-cc"


def _check_dynamic_slice(c: ModuleChecker, op: ir.Operation) -> Iterator[str]:
    first = 2 if op.name == "stablehlo.dynamic_update_slice" else 1
    if not all(constant_derived(v) for v in list(op.operands)[first:]):
        yield f"{op.name} with runtime start indices: neuronx-cc takes constant indices only"


def _check_scatter(c: ModuleChecker, op: ir.Operation) -> Iterator[str]:
    body = [o for o in _body_ops(op) if o.name != "stablehlo.return"]
    et = element_type(op.operands[0].type)
    if body and (et in rules.INTEGER_TYPES or et == "i1"):
        yield f"scatter with a combining update on {et}: neuronx-cc has no integer/bool scatter reduction"


def _check_gather(c: ModuleChecker, op: ir.Operation) -> Iterator[str]:
    dn = _attr(op, "dimension_numbers") or ""
    if _dim_list(dn, "operand_batching_dims"):
        # Newer than the documented gather form; XLA's batched-gather normalizer rewrites it into the
        # classic form (explicit iota indices), which we assume neuronx-cc's front end does too.
        c.assume("stablehlo.gather(batching dims)")
    start = _dim_list(dn, "start_index_map")
    if len(set(start)) != len(start):
        yield f"gather with repeated start_index_map {start}: neuronx-cc needs it disjoint"


def _check_shift_right_arithmetic(c: ModuleChecker, op: ir.Operation) -> Iterator[str]:
    et = element_type(op.operands[0].type)
    if et not in ("i32", "ui32"):
        yield f"shift_right_arithmetic on {et}: neuronx-cc supports 32-bit types only"


def _check_rng_bit_generator(c: ModuleChecker, op: ir.Operation) -> Iterator[str]:
    algo = _attr(op, "rng_algorithm") or ""
    if "DEFAULT" not in algo:
        yield f"rng_bit_generator {algo}: neuronx-cc supports RNG_DEFAULT only"
    # "32-bit seeds" is not checked: jax packs a uint32[4] key into the ui64[2] state XLA's HLO wants,
    # so the state type says nothing about the seed width.


def _check_rng(c: ModuleChecker, op: ir.Operation) -> Iterator[str]:
    if "UNIFORM" not in (_attr(op, "rng_distribution") or ""):
        yield "rng with a non-uniform distribution: neuronx-cc supports RngUniform only"


def _check_while(c: ModuleChecker, op: ir.Operation) -> Iterator[str]:
    # Static trip count: the condition compares a loop-carried counter, initialised with a constant,
    # against a constant.
    cond = _body_ops(op, 0)
    ret = cond[-1]
    pred = ret.operands[0].owner if ret.operands else None
    pred = _op(pred) if pred is not None and not isinstance(pred, ir.Block) else None
    if pred is not None and pred.name == "stablehlo.compare":
        sides = list(pred.operands)
        args = [v for v in sides if isinstance(v.owner, ir.Block)]
        consts = [v for v in sides if constant_derived(v)]
        if len(args) == 1 and len(consts) == 1:
            index = ir.BlockArgument(args[0]).arg_number
            if constant_derived(op.operands[index]):
                return
    yield "while loop without a static trip count: neuronx-cc supports static loops only"


_CHECKS: dict[str, Callable[[ModuleChecker, ir.Operation], Iterator[str]]] = {
    "stablehlo.custom_call": _check_custom_call,
    "chlo.top_k": _check_top_k,
    "stablehlo.reduce": _check_reduce,
    "stablehlo.reduce_window": _check_reduce_window,
    "stablehlo.sort": _check_sort,
    "stablehlo.dot": _check_dot,
    "stablehlo.dot_general": _check_dot,
    "stablehlo.convolution": _check_convolution,
    "stablehlo.dynamic_slice": _check_dynamic_slice,
    "stablehlo.dynamic_update_slice": _check_dynamic_slice,
    "stablehlo.scatter": _check_scatter,
    "stablehlo.gather": _check_gather,
    "stablehlo.shift_right_arithmetic": _check_shift_right_arithmetic,
    "stablehlo.rng_bit_generator": _check_rng_bit_generator,
    "stablehlo.rng": _check_rng,
    "stablehlo.while": _check_while,
}
