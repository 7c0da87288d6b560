"""What neuronx-cc accepts, as data: operators, data types and custom-call targets per Trainium generation.

Built from /work/shared/NEURONX_CC_OPS.md (public Neuron SDK docs; nothing here was verified on hardware).
Every operator carries its provenance, so a verdict can say *why* an op is taken to be legal:

- ``documented``: in the compiler's published "Supported Operators" table (XlaBuilder names, 62 entries).
- ``later``: absent from that table but named by later compiler docs/release notes as handled.
- ``assumed``: absent from every public list, yet an elementwise or structural op that XLA front ends
  emit for ordinary programs (sigmoid is ``logistic``, ``|`` is ``or``); refusing them would refuse
  nearly every model. Verdicts show these as "assumed" so docs/ops.md never claims more than is known.

Anything not in ``OPS`` is illegal. Restrictions (reducers, comparators, dilations, ...) are checked by
``checks.py`` using the constants below.
"""

from __future__ import annotations

from dataclasses import dataclass

GENERATIONS = ("trn2", "trn3")


@dataclass(frozen=True)
class OpRule:
    source: str  # "documented" | "later" | "assumed" | "structural"
    xla_name: str = ""  # the name in the compiler's operator list, when it has one
    note: str = ""


def _doc(xla: str, note: str = "") -> OpRule:
    return OpRule("documented", xla, note)


def _later(xla: str, note: str) -> OpRule:
    return OpRule("later", xla, note)


def _assumed(note: str) -> OpRule:
    return OpRule("assumed", "", note)


_ELEMENTWISE = "elementwise; emitted by XLA front ends for ordinary programs, not in the public table"

#: StableHLO/CHLO op name -> rule. Keys are MLIR operation names as jax 0.10 emits them.
OPS: dict[str, OpRule] = {
    # -- the documented table, mapped from XlaBuilder names to StableHLO ops --------------------------
    "stablehlo.abs": _doc("Abs"),
    "stablehlo.add": _doc("Add"),
    "stablehlo.all_gather": _doc("Allgather"),
    "stablehlo.all_reduce": _doc("Allreduce", "no integer datapath (computed in fp32)"),
    "stablehlo.atan2": _doc("Atan2"),
    "stablehlo.batch_norm_training": _doc("Batchnorm"),
    "stablehlo.batch_norm_grad": _doc("Batchnormgrad"),
    "stablehlo.batch_norm_inference": _doc("Batchnorminference"),
    "stablehlo.bitcast_convert": _doc("BitcastConvertType"),
    "stablehlo.broadcast": _doc("Broadcast"),
    "stablehlo.broadcast_in_dim": _doc("BroadcastInDim"),
    "stablehlo.ceil": _doc("Ceil"),
    "stablehlo.clamp": _doc("Clamp"),
    "stablehlo.compare": _doc("Compare", "also Eq/Ne/Lt/Le/Gt/Ge"),
    "stablehlo.concatenate": _doc("Concatenate"),
    "stablehlo.constant": _doc("Constant"),
    "stablehlo.convert": _doc("ConvertElementType"),
    "stablehlo.cosine": _doc("Cos"),
    "stablehlo.custom_call": _doc("Customcall", "AwsNeuron* targets only"),
    "stablehlo.divide": _doc("Div"),
    "stablehlo.dot": _doc("Dot", "no integer datapath"),
    "stablehlo.dot_general": _doc("DotGeneral", "no integer datapath"),
    "stablehlo.dynamic_update_slice": _doc("DynamicUpdateSlice", "constant indices only"),
    "stablehlo.exponential": _doc("Exp"),
    "stablehlo.floor": _doc("Floor"),
    "stablehlo.gather": _doc("Gather", "classic form: distinct start_index_map, no batching dims"),
    "stablehlo.get_tuple_element": _doc("GetTupleElement"),
    "stablehlo.iota": _doc("Iota"),
    "stablehlo.log": _doc("Log"),
    "stablehlo.and": _doc("LogicalAnd"),
    "stablehlo.not": _doc("LogicalNot"),
    "stablehlo.maximum": _doc("Max"),
    "stablehlo.minimum": _doc("Min"),
    "stablehlo.multiply": _doc("Mul"),
    "stablehlo.negate": _doc("Neg"),
    "stablehlo.pad": _doc("Pad"),
    "stablehlo.power": _doc("Pow"),
    "stablehlo.reduce": _doc("Reduce", "add/mul/min/max reducers, constant init, not variadic"),
    "stablehlo.reshape": _doc("Reshape"),
    "stablehlo.reverse": _doc("Rev"),
    "stablehlo.rng_bit_generator": _doc("RngBitGenerator", "RNG_DEFAULT only"),
    "stablehlo.rng": _doc("RngUniform", "uniform distribution only"),
    "stablehlo.rsqrt": _doc("Rsqrt"),
    "stablehlo.scatter": _doc("Scatter", "no int/bool types with a combining update"),
    "stablehlo.select": _doc("Select"),
    "stablehlo.select_and_scatter": _doc("SelectAndScatter"),
    "stablehlo.shift_right_logical": _doc("ShiftRightLogical"),
    "stablehlo.sign": _doc("Sign"),
    "stablehlo.sine": _doc("Sin"),
    "stablehlo.slice": _doc("Slice"),
    "stablehlo.sqrt": _doc("Sqrt"),
    "stablehlo.subtract": _doc("Sub"),
    "stablehlo.tanh": _doc("Tanh"),
    "stablehlo.transpose": _doc("Transpose"),
    "stablehlo.tuple": _doc("Tuple"),
    # -- handled by later compilers ------------------------------------------------------------------
    "stablehlo.convolution": _later("Convolution", "no input+kernel dilation together, no stride+input dilation"),
    "stablehlo.reduce_window": _later("ReduceWindow", "dilations 1, exactly one input and one init"),
    "stablehlo.sort": _later("Sort", "comparators LT/LE/GT/GE only (fixed around compiler 2.18)"),
    "chlo.top_k": _later("TopK", "k <= 16384, not on int32/int64"),
    "chlo.erf": _later("Erf", "older compilers rejected it (issue #1081); routed via AwsNeuronErf on neuron"),
    "stablehlo.reduce_scatter": _later("ReduceScatter", "no integer datapath"),
    "stablehlo.shift_right_arithmetic": _later("ShiftRightArithmetic", "32-bit types only"),
    "stablehlo.while": _later("While", "static trip count only"),
    # -- assumed: elementwise/structural ops absent from every public list --------------------------
    "stablehlo.or": _assumed(_ELEMENTWISE),
    "stablehlo.xor": _assumed(_ELEMENTWISE),
    "stablehlo.remainder": _assumed(_ELEMENTWISE),
    "stablehlo.exponential_minus_one": _assumed(_ELEMENTWISE),
    "stablehlo.log_plus_one": _assumed(_ELEMENTWISE),
    "stablehlo.logistic": _assumed(_ELEMENTWISE),
    "stablehlo.is_finite": _assumed(_ELEMENTWISE),
    "stablehlo.round_nearest_even": _assumed(_ELEMENTWISE),
    "stablehlo.round_nearest_afz": _assumed(_ELEMENTWISE),
    "stablehlo.cbrt": _assumed(_ELEMENTWISE),
    "stablehlo.tan": _assumed(_ELEMENTWISE),
    "stablehlo.shift_left": _assumed(_ELEMENTWISE),
    "stablehlo.popcnt": _assumed(_ELEMENTWISE),
    "stablehlo.count_leading_zeros": _assumed(_ELEMENTWISE),
    "stablehlo.all_to_all": _assumed(
        "collective; not in the public table, but emitted by torch-xla's all_to_all for Neuron (MoE expert parallel)"
    ),
    "stablehlo.dynamic_slice": _assumed("slice at runtime offsets; held to DynamicUpdateSlice's constant-index rule"),
    # CHLO ops that the StableHLO->HLO conversion expands into the elementwise ops above.
    **{
        f"chlo.{name}": _assumed("expanded into elementwise HLO ops before neuronx-cc sees it")
        for name in (
            "erf_inv",
            "erfc",
            "lgamma",
            "digamma",
            "polygamma",
            "zeta",
            "next_after",
            "sinh",
            "cosh",
            "tan",
            "asin",
            "acos",
            "atan",
            "asinh",
            "acosh",
            "atanh",
            "is_inf",
            "is_pos_inf",
            "is_neg_inf",
            "bessel_i1e",
            "square",
        )
    },  # fmt: skip
    # -- structure of the module itself --------------------------------------------------------------
    "func.func": OpRule("structural"),
    "func.return": OpRule("structural"),
    "func.call": OpRule("structural", note="calls are inlined; the callee is checked at each call site"),
    "stablehlo.return": OpRule("structural"),
}

#: Ops that are refused with a specific reason (clearer than "not in the operator table").
REFUSED_REASONS: dict[str, str] = {
    "stablehlo.case": "conditional (torch.cond / lax.cond) is not supported by neuronx-cc; compute both "
    "branches and pick with torch.where",
    "stablehlo.if": "conditional (torch.cond / lax.cond) is not supported by neuronx-cc; compute both branches "
    "and pick with torch.where",
    "stablehlo.reduce_precision": "reduce_precision is not supported by neuronx-cc",
    "stablehlo.get_dimension_size": "dynamic shapes are not supported by neuronx-cc",
    "stablehlo.set_dimension_size": "dynamic shapes are not supported by neuronx-cc",
    "stablehlo.dynamic_broadcast_in_dim": "dynamic shapes are not supported by neuronx-cc",
    "stablehlo.dynamic_reshape": "dynamic shapes are not supported by neuronx-cc",
    "stablehlo.dynamic_iota": "dynamic shapes are not supported by neuronx-cc",
    "stablehlo.dynamic_pad": "dynamic shapes are not supported by neuronx-cc",
    "stablehlo.dynamic_gather": "dynamic shapes are not supported by neuronx-cc",
    "stablehlo.dynamic_conv": "dynamic shapes are not supported by neuronx-cc",
    "stablehlo.real_dynamic_slice": "dynamic shapes are not supported by neuronx-cc",
    "stablehlo.infeed": "host transfers/callbacks are not supported by neuronx-cc",
    "stablehlo.outfeed": "host transfers/callbacks are not supported by neuronx-cc",
    "stablehlo.send": "host transfers/callbacks are not supported by neuronx-cc",
    "stablehlo.recv": "host transfers/callbacks are not supported by neuronx-cc",
    "stablehlo.complex": "complex numbers are mostly unsupported by neuronx-cc",
    "stablehlo.real": "complex numbers are mostly unsupported by neuronx-cc",
    "stablehlo.imag": "complex numbers are mostly unsupported by neuronx-cc",
    "stablehlo.fft": "FFT is not supported by neuronx-cc",
    "stablehlo.cholesky": "Cholesky is not supported by neuronx-cc",
    "stablehlo.triangular_solve": "triangular_solve is not supported by neuronx-cc",
}

# -- restrictions -------------------------------------------------------------------------------------
REDUCERS = frozenset({"stablehlo.add", "stablehlo.multiply", "stablehlo.minimum", "stablehlo.maximum"})
SORT_DIRECTIONS = frozenset({"LT", "LE", "GT", "GE"})
TOPK_MAX_K = 16384
TOPK_REFUSED_TYPES = frozenset({"i32", "i64", "ui32", "ui64"})
INTEGER_TYPES = frozenset({"i8", "ui8", "i16", "ui16", "i32", "ui32", "i64", "ui64"})
INT64_TYPES = frozenset({"i64", "ui64"})
NATIVE_INT64_FLAG = "--native-int64"

#: MLIR element types NeuronCore-v3 (trn2) and its successor (trn3) compute with. int64 is handled by
#: the int64 policy (see ``checks.dtype_problem``), float64 and complex never are.
DTYPES: dict[str, frozenset[str]] = {
    "trn2": frozenset({"f32", "f16", "bf16", "f8E4M3", "f8E5M2", "i8", "ui8", "i32", "ui32", "i1"}),
    "trn3": frozenset({"f32", "f16", "bf16", "f8E4M3", "f8E5M2", "f8E4M3FN", "i8", "ui8", "i32", "ui32", "i1"}),
}

#: Why an element type is refused, when there is more to say than "not a device type".
DTYPE_REASONS: dict[str, str] = {
    "f64": "float64 does not exist on Trainium (a float64 graph is computed as float32; a float64 value "
    "inside the module is a lowering that leaked it)",
    "f8E4M3FN": "float8_e4m3fn is not available on trn1/trn2 (trn3 has it; trn2 has e4m3 and e5m2)",
    "f8E4M3FNUZ": "FNUZ float8 variants are not supported on Trainium",
    "f8E5M2FNUZ": "FNUZ float8 variants are not supported on Trainium",
    "i16": "int16 is not a NeuronCore data type (int8/uint8/int32/uint32 are)",
    "ui16": "uint16 is not a NeuronCore data type (int8/uint8/int32/uint32 are)",
}


def custom_call_allowed(target: str) -> bool:
    """Whether neuronx-cc recognises custom-call ``target``: error NCC_EVRF015's list, kept in one place beside
    the lowering that emits the calls (``lowering/device_calls.py``: ``COMPILER_TARGETS``)."""
    from ..lowering.device_calls import COMPILER_TARGETS

    return target in COMPILER_TARGETS
