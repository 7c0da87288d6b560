"""The fake ``neuronx-cc``: ``python -m tests.device_sim.neuronx_cc compile MODULE ... --output x.neff``.

The command line follows neuronx-cc's CLI reference (compiler/neuronx-cc/api-reference-guide, Neuron 2.32): the
``compile`` command with ``--framework XLA --target <family> [--model-type] [--auto-cast] [--auto-cast-type]
[--native-int64 <mode>] [--implicit-integer-downcast <mode>] [--distribution-strategy] [--logical-nc-config N |
--lnc N | -lnc N] [--optlevel N | -O N] [--enable-mixed-precision-accumulation |
--disable-mixed-precision-accumulation] [--enable-saturate-infinity] [--enable-fast-context-switch]
[--enable-fast-loading-neuron-binaries] [--logfile F] [--output F | -o F] [--verbose L]``; ``compile --help``
prints them as argparse lays them out (the real help text is not public; its layout is an assumption), and
``neuronx-cc --version`` (``-V``) prints the real tool's layout. A few internal flags (``HIDDEN_FLAGS``) are
taken but not listed, as the real compiler hides its internal flags from ``--help``. Anything else (an unknown
flag, a bad value, a flag that takes a value given none: ``--native-int64`` bare, a missing input) exits with
status 1 and an argparse-style message on stderr. Its log's first line is its command line.

The input it parses is one format, as a compiler build parses one (``NRTSIM_COMPILER_INPUT``): ``mlir`` (the
default) a StableHLO module, text or bytecode (TorchNeuron's native path); ``hlo`` a serialized HloModuleProto
(the CLI reference's ``hlo.pb``). The other is refused with the parser's own words (MLIR's "unexpected
character", protobuf's "Error parsing message"): the real compiler's text for it is not public.
``NRTSIM_NATIVE_INT64``: how its help lists ``--native-int64``: ``mode`` (the default; SDK 2.32's
``--native-int64 <mode>``), ``switch`` (a bare flag) or ``absent`` (compilers before 2.27). Each setting is a
compiler build of its own, with its own ``--version`` (what drivers key their memory of a compiler by).

What it does with the module: takes ``@main``'s parameters and results as the NEFF's tensors, named by the
module's ``neff_input_names`` / ``neff_output_names`` frontend attributes (torch-xla's; on the parameters and on
the root tuple) and, without them, ``input{i}`` / ``output{i}`` (TorchNeuron's names); a tuple root is the
NEFF's outputs, element by element. It refuses what the real compiler refuses that it knows of (custom-call
targets not in error NCC_EVRF015's list, with that page's text; NKI kernels, whose compiled artifact it cannot
make, NCC_EVRF059; float8 kinds the target lacks, NCC_EVRF051 / NCC_EVRF005; an LNC the target has not,
NCC_EARG001), replaces every ``AwsNeuron*`` custom call with a call of its jax semantics (``custom_calls.py``),
lists the module's StableHLO collectives in the NEFF's ``neff.json`` (refusing, NCC_SIM005, one the simulator
could not run across processes: ``collectives.py``), and writes the simulator's NEFF (layout in
``libnrt_sim.c``'s header comment; :func:`make_neff`). Run as a command it logs its passes to
``log-neuron-cc.txt`` in its working directory (``--logfile``), one line per pass with its pid, as the real
log's lines carry the process id. One line per successful compile goes to ``$NRTSIM_STATE_DIR/compiles.log``.

For tests of what drives the compiler: ``NRTSIM_COMPILE_DELAY=SECONDS`` makes every compile take that long
(the real one takes minutes; logged as a pass), and ``NRTSIM_COMPILE_FAIL=PREFIX[,PREFIX...]`` refuses
(NCC_SIM006) every module whose :func:`module_digest` starts with one of the prefixes.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import io
import json
import os
import re
import struct
import sys
import tarfile
import time
from pathlib import Path
from typing import Any, Sequence

#: What ``--version`` reports (the real tool prints "NeuronX Compiler version 2.27.5334.0+f702b353", a blank
#: line, then Python/HWM/NumPy versions); a simulated build other than the default adds its settings.
VERSION = "2.99.0.0+nrtsim"
#: Which input the simulated build parses (``NRTSIM_COMPILER_INPUT``) and how it lists --native-int64.
INPUT_FORMATS = ("mlir", "hlo")
NATIVE_INT64_FORMS = ("mode", "switch", "absent")
#: Error NCC_EVRF015's message (compiler/error-codes/EVRF015.rst).
EVRF015 = "The compiler encountered a custom call instruction with a target name that is not recognized."
LOG_FILE = "log-neuron-cc.txt"


def input_format() -> str:
    value = (os.environ.get("NRTSIM_COMPILER_INPUT") or "mlir").strip().lower()
    if value not in INPUT_FORMATS:
        raise SystemExit(f"neuronx-cc (simulator): NRTSIM_COMPILER_INPUT={value!r}: expected one of {INPUT_FORMATS}")
    return value


def native_int64_form() -> str:
    value = (os.environ.get("NRTSIM_NATIVE_INT64") or "mode").strip().lower()
    if value not in NATIVE_INT64_FORMS:
        raise SystemExit(f"neuronx-cc (simulator): NRTSIM_NATIVE_INT64={value!r}: expected one of {NATIVE_INT64_FORMS}")
    return value


def version() -> str:
    """This simulated build's version: ``VERSION`` for the defaults, with the settings it differs in otherwise."""
    tags = [
        t for t, default in ((input_format(), "mlir"), (f"int64{native_int64_form()}", "int64mode")) if t != default
    ]
    return VERSION + "".join(f".{t}" for t in tags)


NEFF_MAGIC = b"NRTSIMNEFF\0\0"
NEFF_HEADER_SIZE = 1024
NEFF_FORMAT_VERSION = 1
_HEADER = struct.Struct("<12sIIIQQQQ")  # magic, version, lnc, reserved, table off/size, payload off/size

#: MLIR element type -> (bytes per element, nrt_dtype_t code from nrt.h). i1 (pred) is one byte, and
#: nrt_dtype_t has no boolean: it is reported as UINT8.
ELEMENT_TYPES: dict[str, tuple[int, int]] = {
    "f32": (4, 0xA), "f16": (2, 0x7), "bf16": (2, 0x6),
    "i8": (1, 0x2), "ui8": (1, 0x3), "i16": (2, 0x4), "ui16": (2, 0x5), "i32": (4, 0x8), "ui32": (4, 0x9),
    "i64": (8, 0xC), "ui64": (8, 0x1), "i1": (1, 0x3),
    "f8E4M3": (1, 0xE), "f8E4M3FN": (1, 0xE), "f8E5M2": (1, 0xF), "f8E3M4": (1, 0xD),
}  # fmt: skip

#: Instance families --target takes (CLI reference), and which the simulator models.
TARGETS = ("inf2", "trn1", "trn1n", "trn2", "trn2n", "trn3")
SIMULATED_TARGETS = ("trn2", "trn3")
MODEL_TYPES = ("generic", "transformer", "transformer-inference", "cnn-training", "unet-inference",
               "vae-inference", "operator-fusion")  # fmt: skip


class CompileError(Exception):
    """A compile the real tool would refuse: ``code`` is its NCC_* error code where it has one."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"[ERROR] [{self.code}] {self.message}" if self.code else f"[ERROR] {self.message}"


class _Parser(argparse.ArgumentParser):
    """argparse's messages, neuronx-cc's exit status (1, where argparse uses 2)."""

    def error(self, message: str) -> Any:
        self.print_usage(sys.stderr)
        self.exit(1, f"{self.prog}: error: {message}\n")


class _Version(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(
            option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="Print version information and exit"
        )

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        import numpy

        print(f"NeuronX Compiler version {version()}\n")
        print(f"Python version {sys.version.split()[0]}")
        print(f"HWM version {version()}")
        print(f"NumPy version {numpy.__version__}")
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="neuronx-cc", allow_abbrev=False)
    parser.add_argument("--version", "-V", action=_Version)
    commands = parser.add_subparsers(dest="command", metavar="<command>", parser_class=_Parser)
    commands.required = True
    c = commands.add_parser("compile", help="Compile a model for use on the AWS Machine Learning Accelerator.",
                            description="Compile a model for use on the AWS Machine Learning Accelerator.",
                            allow_abbrev=False)  # fmt: skip
    c.add_argument("model_files", metavar="<model_files>", help="Input containing model specification.")
    c.add_argument(
        "--framework",
        required=True,
        choices=("XLA",),
        metavar="<framework_name>",
        help="Framework used to generate training model. Valid values: XLA",
    )
    c.add_argument(
        "--target",
        required=True,
        choices=TARGETS,
        metavar="<instance_family>",
        help="Name of the Neuron instance family on which the compiled model will be run.",
    )
    c.add_argument(
        "--model-type",
        choices=MODEL_TYPES,
        default="generic",
        metavar="<model>",
        help="Permit the compiler to attempt model-specific optimizations. (Default: generic)",
    )
    c.add_argument(
        "--auto-cast",
        choices=("none", "matmult", "all"),
        default="none",
        metavar="<cast_mode>",
        help="Controls how the compiler makes tradeoffs between performance and accuracy for FP32 "
        "operations. (Default: none)",
    )
    c.add_argument(
        "--auto-cast-type",
        choices=("bf16", "fp16", "tf32", "fp8_e4m3"),
        default="bf16",
        metavar="<data_type>",
        help="The lower-precision data type of auto-cast. (Default: bf16)",
    )
    form = native_int64_form()
    if form == "mode":  # SDK 2.32: a mode, which must be given
        c.add_argument(
            "--native-int64",
            choices=("default", "enabled", "disabled"),
            default="default",
            metavar="<mode>",
            help="Whether int64 operations run natively or are downcast to int32. "
            "Valid values: default, enabled, disabled. (Only on trn2 and later; Default: default)",
        )
    elif form == "switch":
        c.add_argument(
            "--native-int64",
            action="store_const",
            const="enabled",
            default="default",
            help="Execute int64 operations natively (trn2 and later).",
        )
    c.add_argument(
        "--implicit-integer-downcast",
        default="default",
        metavar="<mode>",
        help="Which ops without an integer datapath may be downcast. (Default: default)",
    )
    c.add_argument(
        "--distribution-strategy",
        choices=("llm-training", "fsdp", "nemo", "NEMO"),
        metavar="<distribution_type>",
        help="Distribution-specific optimizations.",
    )
    c.add_argument(
        "--logical-nc-config",
        "--lnc",
        "-lnc",
        dest="lnc",
        type=int,
        choices=(1, 2),
        metavar="<shard_degree>",
        help="Shard the graph across physical NeuronCores. (Default: 2 on trn2)",
    )
    c.add_argument(
        "--optlevel",
        "-O",
        dest="optlevel",
        choices=("1", "2", "3"),
        default="2",
        metavar="<opt_level>",
        help="The level of optimization. (Default: 2)",
    )
    mixed = c.add_mutually_exclusive_group()
    mixed.add_argument(
        "--enable-mixed-precision-accumulation", action="store_true", help="Accumulate in FP32 (enabled by default)."
    )
    mixed.add_argument(
        "--disable-mixed-precision-accumulation", action="store_true", help="Disable mixed precision accumulation."
    )
    c.add_argument("--enable-saturate-infinity", action="store_true", help="Convert +/- infinity to MAX/MIN_FLOAT.")
    c.add_argument("--enable-fast-context-switch", action="store_true", help="Optimize for fast model switching.")
    c.add_argument("--enable-fast-loading-neuron-binaries", action="store_true", help="Save the output uncompressed.")
    c.add_argument("--logfile", metavar="<filename>", help=f"Where the compiler writes its log. (Default: {LOG_FILE})")
    c.add_argument(
        "--output",
        "-o",
        default="file.neff",
        metavar="<filename>",
        help="Where the NEFF is written. (Default: file.neff)",
    )
    c.add_argument(
        "--verbose",
        choices=("debug", "info", "warning", "error", "critical", "user"),
        default="warning",
        metavar="<level>",
        help="The level of output. (Default: warning)",
    )
    # Internal flags: taken, but hidden from --help, as the real compiler hides its own (drivers pass them, e.g.
    # optimum-neuron's cached compile_flags.json: "--tensorizer-options=...", "--internal-enable-dge-levels
    # vector_dynamic_offsets", "--internal-hlo2tensorizer-options=--verify-hlo=true"). Any other flag is refused.
    for hidden in HIDDEN_FLAGS:
        c.add_argument(hidden, help=argparse.SUPPRESS)
    return parser


#: The internal flags the fake takes without listing them in ``compile --help``.
HIDDEN_FLAGS = (
    "--tensorizer-options",
    "--internal-hlo2tensorizer-options",
    "--internal-enable-dge-levels",
    "--internal-compiler-debug-mode",
)


# ------------------------------------------------------------------------------------------- the module
def _context() -> Any:
    from jax._src.interpreters import mlir

    return mlir.make_ir_context()


def parse_module(source: bytes, filename: str, ctx: Any) -> Any:
    """The module, or CompileError naming the line of the first parse error."""
    from jax._src.lib.mlir import ir

    try:
        return ir.Module.parse(source, context=ctx)
    except Exception as e:  # MLIRError
        diagnostics = getattr(e, "error_diagnostics", None) or []
        if diagnostics:
            where = str(diagnostics[0].location)
            m = re.search(r'"[^"]*":(\d+):(\d+)', where)
            at = f"{filename}:{m.group(1)}:{m.group(2)}" if m else f"{filename} ({where})"
            raise CompileError("", f"{at}: cannot parse the StableHLO module: {diagnostics[0].message}") from None
        raise CompileError("", f"{filename}: cannot parse the StableHLO module: {e}") from None


def _ranked(t: Any, what: str) -> tuple[list[int], str]:
    from jax._src.lib.mlir import ir

    if not isinstance(t, ir.RankedTensorType):
        raise CompileError("", f"{what} has type {t}; the compiler takes ranked tensors only")
    rt = ir.RankedTensorType(t)
    if not rt.has_static_shape:
        raise CompileError("", f"{what} has a dynamic shape ({t}); neuronx-cc compiles static shapes only")
    return list(rt.shape), str(rt.element_type)


def _main_function(module: Any) -> Any:
    from jax._src.lib.mlir import ir

    for op in module.body.operations:
        if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
            return op
    raise CompileError("", "the module has no @main function")


def _frontend_attribute(attrs: Any, key: str) -> str | None:
    """``key`` of an ``mhlo.frontend_attributes`` dictionary among ``attrs`` (an op's or an argument's)."""
    from jax._src.lib.mlir import ir

    if attrs is None or "mhlo.frontend_attributes" not in attrs:
        return None
    found = ir.DictAttr(attrs["mhlo.frontend_attributes"])
    return ir.StringAttr(found[key]).value if key in found else None


def input_names(module: Any) -> list[str | None]:
    """Each ``@main`` parameter's ``neff_input_names`` frontend attribute (None where it has none)."""
    from jax._src.lib.mlir import ir

    main = _main_function(module)
    count = len(ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value).inputs)
    if "arg_attrs" not in main.attributes:
        return [None] * count
    return [_frontend_attribute(ir.DictAttr(a), "neff_input_names") for a in ir.ArrayAttr(main.attributes["arg_attrs"])]


def flatten_tuple_root(module: Any) -> str | None:
    """A ``@main`` returning one ``stablehlo.tuple`` returns its elements instead (the NEFF's outputs are the
    root tuple's elements); the tuple's ``neff_output_names`` frontend attribute, if it has one."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import func

    main = _main_function(module)
    ret = list(main.regions[0].blocks[0].operations)[-1]
    operands = list(ret.operands)
    if len(operands) != 1 or not isinstance(operands[0].type, ir.TupleType):
        return None
    root = operands[0].owner
    if root.name != "stablehlo.tuple":
        raise CompileError("", "@main returns a tuple that is not made by a stablehlo.tuple at its root")
    names = _frontend_attribute(root.attributes, "neff_output_names")
    elements = list(root.operands)
    with module.context, ir.InsertionPoint(ret), ret.location:
        func.ReturnOp(elements)
    ret.erase()
    if not list(root.result.uses):
        root.erase()
    ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    with module.context:
        main.attributes["function_type"] = ir.TypeAttr.get(
            ir.FunctionType.get(list(ftype.inputs), [v.type for v in elements])
        )
        if "res_attrs" in main.attributes:
            del main.attributes["res_attrs"]
    return names


def _names(given: list[str | None], count: int, prefix: str, what: str) -> list[str]:
    if all(n is None for n in given):
        return [f"{prefix}{i}" for i in range(count)]
    if len(given) != count or any(not n for n in given):
        raise CompileError("", f"{what}: {given} does not name each of the {count} tensors")
    if len(set(given)) != count:
        raise CompileError("", f"{what}: {given} names a tensor twice")
    return [str(n) for n in given]


def tensor_table(
    module: Any, in_names: list[str | None] | None = None, out_names: list[str | None] | None = None
) -> list[dict[str, Any]]:
    """``@main``'s parameters and results with their names (``input{i}`` / ``output{i}`` when the module names
    none), byte size, dtype and shape."""
    from jax._src.lib.mlir import ir

    main = _main_function(module)
    ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    names = {
        "in": _names(in_names or [None] * len(ftype.inputs), len(ftype.inputs), "input", "neff_input_names"),
        "out": _names(out_names or [None] * len(ftype.results), len(ftype.results), "output", "neff_output_names"),
    }
    table = []
    for usage, types in (("in", ftype.inputs), ("out", ftype.results)):
        for i, t in enumerate(types):
            name = names[usage][i]
            shape, element = _ranked(t, f"@main's {name}")
            if element not in ELEMENT_TYPES:
                raise CompileError("", f"@main's {name} is {t}: element type {element} is not a NeuronCore data type")
            width, code = ELEMENT_TYPES[element]
            count = 1
            for d in shape:
                count *= d
            table.append({"usage": usage, "name": name, "size": count * width, "nrt_dtype": code,
                          "element_type": element, "shape": shape})  # fmt: skip
    return table


def check_types(module: Any, target: str) -> None:
    """The float8 kinds neuronx-cc refuses per target (its error pages NCC_EVRF051, NCC_EVRF005)."""
    from jax._src.lib.mlir import ir

    found: set[str] = set()

    def visit(op: Any) -> Any:
        for value in list(op.operation.results) + [
            a for r in op.operation.regions for b in r.blocks for a in b.arguments
        ]:
            if isinstance(value.type, ir.ShapedType):
                found.add(str(ir.ShapedType(value.type).element_type))
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    fnuz = sorted(e for e in found if e.endswith("FNUZ"))
    if fnuz:
        raise CompileError(
            "NCC_EVRF005", f"The compiler found usage of {', '.join(fnuz)} data type which is not supported."
        )
    if "f8E4M3FN" in found and target in ("trn1", "trn1n", "trn2", "trn2n", "inf2"):
        raise CompileError(
            "NCC_EVRF051",
            "Data type F8E4M3FN is not supported on TRN1/TRN2. Target TRN3 or later hardware, or use the "
            "--experimental-unsafe-fp8e4m3fn-as-fp8e4m3 flag to cast F8E4M3FN to F8E4M3.",
        )


def _struct(t: Any, what: str) -> Any:
    import jax
    import jax.numpy as jnp

    shape, element = _ranked(t, what)
    dtypes = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16, "f64": jnp.float64, "i1": jnp.bool_,
              "i8": jnp.int8, "i16": jnp.int16, "i32": jnp.int32, "i64": jnp.int64, "ui8": jnp.uint8,
              "ui16": jnp.uint16, "ui32": jnp.uint32, "ui64": jnp.uint64, "f8E4M3": jnp.float8_e4m3,
              "f8E4M3FN": jnp.float8_e4m3fn, "f8E5M2": jnp.float8_e5m2, "f8E3M4": jnp.float8_e3m4}  # fmt: skip
    if element not in dtypes:
        raise CompileError("", f"{what}: element type {element} is not supported")
    return jax.ShapeDtypeStruct(tuple(shape), dtypes[element])


def _nki_kernel_path(backend_config: str) -> str:
    """The compiled-kernel file an AwsNeuronCustomNativeKernel's config names (base64 JSON), if it names one."""
    try:
        config = json.loads(base64.b64decode(backend_config, validate=True))
    except Exception:
        return "<unreadable backend_config>"
    if isinstance(config, dict):
        for key, value in config.items():
            if isinstance(value, str) and ("path" in key.lower() or "file" in key.lower() or value.startswith("/")):
                return value
    return "<no kernel file in backend_config>"


def replace_custom_calls(module: Any) -> dict[str, int]:
    """Each ``stablehlo.custom_call`` becomes a ``func.call`` of a private function lowered from its jax
    semantics (one function per distinct target, config and types). Returns the count per target."""
    import jax
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import func, hlo

    from . import custom_calls

    calls: list[Any] = []

    def visit(op: Any) -> Any:
        if op.operation.name == "stablehlo.custom_call":
            calls.append(op.operation)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    made: dict[tuple, str] = {}
    counts: dict[str, int] = {}
    for op in calls:
        target = ir.StringAttr(op.attributes["call_target_name"]).value
        config = ""
        if "backend_config" in op.attributes:
            attr = op.attributes["backend_config"]
            config = attr.value if isinstance(attr, ir.StringAttr) else str(attr)
        if target == "AwsNeuronCustomNativeKernel":
            raise CompileError(
                "NCC_EVRF059",
                f"Kernel file '{_nki_kernel_path(config)}' referenced by AwsNeuronCustomNativeKernel instruction "
                "does not exist on the host. (The device simulator cannot compile NKI kernels: only a compiled "
                "kernel artifact from the real nki toolchain could stand here.)",
            )
        if target not in custom_calls.DOCUMENTED_TARGETS:
            raise CompileError("NCC_EVRF015", f"{EVRF015} ({target})")
        if target not in custom_calls.IMPLEMENTED:
            raise CompileError("NCC_SIM001", f"custom call target {target} is one neuronx-cc implements, but the "
                               "device simulator does not")  # fmt: skip
        operands = [_struct(v.type, f"{target} operand {i}") for i, v in enumerate(op.operands)]
        # HLO's form of several results is one tuple (a custom call of an HLO proto comes back as one)
        as_tuple = len(op.results) == 1 and isinstance(op.results[0].type, ir.TupleType)
        result_types = (
            [ir.TupleType(op.results[0].type).get_type(i) for i in range(ir.TupleType(op.results[0].type).num_types)]
            if as_tuple
            else [r.type for r in op.results]
        )
        results = [_struct(t, f"{target} result {i}") for i, t in enumerate(result_types)]
        key = (target, config, tuple(str(v.type) for v in op.operands), tuple(str(t) for t in result_types))
        name = made.get(key)
        if name is None:
            try:
                fn = custom_calls.implementation(target, config, operands, results)
            except custom_calls.CustomCallError as e:
                raise CompileError("NCC_SIM002", str(e)) from None
            name = f"{target}__nrtsim{len(made)}"
            with jax.enable_x64(True):
                text = jax.jit(fn).lower(*operands).as_text()
            _splice(module, ir.Module.parse(text, context=module.context), name)
            made[key] = name
        with ir.InsertionPoint(op), op.location:
            call = func.CallOp(result_types, ir.FlatSymbolRefAttr.get(name), list(op.operands))
            new_results = [hlo.TupleOp(list(call.results)).result] if as_tuple else list(call.results)
        for old, new in zip(op.results, new_results):
            old.replace_all_uses_with(new)
        op.erase()
        counts[target] = counts.get(target, 0) + 1
    return counts


def find_collectives(module: Any) -> list[Any]:
    """The module's StableHLO collectives (``collectives.Collective``), listed in the NEFF; CompileError for one
    the simulator could not run across processes (nested in a region or function, an unknown reducer)."""
    from . import collectives

    try:
        return collectives.find(module)
    except collectives.UnsupportedCollective as e:
        raise CompileError("NCC_SIM005", f"{e} (a limit of the device simulator, not of neuronx-cc)") from None


def _splice(module: Any, sub: Any, name: str) -> None:
    """Move ``sub``'s functions into ``module`` as private ones: its ``main`` as ``name``, the others as
    ``name__<their name>`` (unique, so functions of different calls never collide)."""
    from jax._src.lib.mlir import ir

    functions = [op for op in sub.body.operations if op.operation.name == "func.func"]
    old_names = [ir.StringAttr(f.attributes["sym_name"]).value for f in functions]
    new_names = [name if old == "main" else f"{name}__{old}" for old in old_names]
    for old, new in zip(old_names, new_names):
        ir.SymbolTable.replace_all_symbol_uses(old, new, sub.operation)
    for f, new in zip(functions, new_names):
        ir.SymbolTable.set_symbol_name(f.operation, new)
        ir.SymbolTable.set_visibility(f.operation, "private")
        f.operation.detach_from_parent()
        module.body.append(f.operation)


# ------------------------------------------------------------------------------------------- the NEFF
def make_neff(
    *, lnc: int, table: list[dict[str, Any]], files: dict[str, bytes], version: int = NEFF_FORMAT_VERSION
) -> bytes:
    """The simulator's NEFF: a 1,024-byte header, the ASCII tensor table, a gzip tar of ``files``."""
    lines = "".join(
        f"{t['usage']} {t['name']} {t['size']} {t['nrt_dtype']} {len(t['shape'])}"
        + "".join(f" {d}" for d in t["shape"])
        + "\n"
        for t in table
    ).encode()
    raw = io.BytesIO()
    with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for path, data in files.items():
            info = tarfile.TarInfo(path)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    payload = raw.getvalue()
    table_offset = NEFF_HEADER_SIZE
    payload_offset = table_offset + len(lines)
    header = _HEADER.pack(NEFF_MAGIC, version, lnc, 0, table_offset, len(lines), payload_offset, len(payload))
    return header.ljust(NEFF_HEADER_SIZE, b"\0") + lines + payload


def _state_dir() -> Path:
    from . import default_state_dir

    return Path(os.environ.get("NRTSIM_STATE_DIR") or default_state_dir())


# ------------------------------------------------------------------------------------------- reading the input
def _hlo_text(proto: bytes) -> str:
    from jax._src.lib import xla_client

    return xla_client.XlaComputation(proto).as_hlo_text()


def _root_output_names(hlo_text: str) -> str | None:
    """The entry computation's ROOT ``neff_output_names`` frontend attribute."""
    in_entry = False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY "):
            in_entry = True
        elif in_entry and line.strip().startswith("ROOT "):
            m = re.search(r'frontend_attributes=\{[^}]*neff_output_names="([^"]*)"', line)
            return m.group(1) if m else None
    return None


def read_module(source: bytes, filename: str, ctx: Any) -> tuple[Any, list[str | None], list[str | None]]:
    """(module with a flat @main, input names, output names) of the input in this build's format."""
    from jax._src.lib import _jax
    from jax._src.lib.mlir import ir

    if input_format() == "hlo":
        try:
            stablehlo = _jax.mlir.hlo_to_stablehlo(source)
            hlo_text = _hlo_text(source)
        except Exception:
            raise CompileError(
                "",
                f"Failed to parse {filename} as an HloModuleProto: Error parsing message (this build of the "
                "device simulator takes an HLO proto: NRTSIM_COMPILER_INPUT=hlo)",
            ) from None
        module = ir.Module.parse(stablehlo, context=ctx)  # the root tuple is already flat here
        names = _root_output_names(hlo_text)
    else:
        module = parse_module(source, filename, ctx)
        names = flatten_tuple_root(module)
    outs: list[str | None] = names.split(",") if names is not None else []
    return module, input_names(module), outs


def _strip_names(text: str) -> str:
    return re.sub(r' \{mhlo\.frontend_attributes = \{neff_input_names = "[^"]*"\}\}', "", text)


def module_digest(module: str | bytes) -> str:
    """The sha256 ``NRTSIM_COMPILE_FAIL`` matches: of the module as HLO sees it, without its tensor names, so
    that a StableHLO module as the package recorded it, the same module as neuronx-cc is given it (names, a
    tuple root) and its HLO proto have one digest."""
    from jax._src.lib import _jax

    data = module.encode() if isinstance(module, str) else module
    try:
        canonical = _jax.mlir.hlo_to_stablehlo(data)
    except Exception:
        try:
            proto = _jax.mlir.mlir_module_to_xla_computation(
                data.decode(), use_tuple_args=False, return_tuple=False
            ).as_serialized_hlo_module_proto()
            canonical = _jax.mlir.hlo_to_stablehlo(proto)
        except Exception:
            return hashlib.sha256(data).hexdigest()
    from jax._src.lib.mlir import ir

    text = str(ir.Module.parse(canonical, context=_context()))
    return hashlib.sha256(_strip_names(text).encode()).hexdigest()


# ------------------------------------------------------------------------------------------- the compile
class _Log:
    """The compile's log: lines as the real log writes them (time, level, pid, component), each written at
    once, so that a driver watching the file sees the pass running now."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.lines: list[str] = []

    def __call__(self, message: str, level: str = "INFO") -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        line = f"{stamp} {level} {os.getpid()} [neuronx-cc]: {message}"
        self.lines.append(line)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")


def compile_file(args: argparse.Namespace, log: _Log) -> dict[str, Any]:
    source_path = Path(args.model_files)
    log(f"Running pass: read input ({input_format()}) {source_path.name}")
    try:
        source = source_path.read_bytes()
    except OSError as e:
        raise CompileError("", f"cannot read the input {args.model_files}: {e.strerror}") from None
    if args.target not in SIMULATED_TARGETS:
        raise CompileError("NCC_SIM003", f"--target {args.target}: the device simulator models trn2 and trn3 only")
    lnc = args.lnc if args.lnc is not None else 2  # "On Trn2, the default is 2."
    ctx = _context()
    module, in_names, out_names = read_module(source, str(source_path), ctx)
    refused = [p.strip().lower() for p in (os.environ.get("NRTSIM_COMPILE_FAIL") or "").split(",") if p.strip()]
    digest = module_digest(source) if refused else hashlib.sha256(source).hexdigest()
    if any(digest.startswith(p) for p in refused):
        raise CompileError("NCC_SIM006", f"module {digest[:16]} is refused as NRTSIM_COMPILE_FAIL asks")
    table = tensor_table(module, in_names, out_names)
    log("Running pass: verify data types")
    check_types(module, args.target)
    log("Running pass: lower custom calls")
    counts = replace_custom_calls(module)
    if not module.operation.verify():
        raise CompileError("NCC_SIM004", "the module with its custom calls replaced does not verify")
    found = find_collectives(module)
    delay = float(os.environ.get("NRTSIM_COMPILE_DELAY") or 0)
    if delay > 0:
        log(f"Running pass: tensorizer (the simulator waits NRTSIM_COMPILE_DELAY={delay:g} s)")
        time.sleep(delay)
    log("Running pass: write NEFF")
    sim_text = str(module)
    options = {k: v for k, v in vars(args).items() if k not in ("model_files", "output", "logfile", "command")}
    neff_json = {
        "format": "nrtsim-neff", "format_version": NEFF_FORMAT_VERSION, "compiler": f"neuronx-cc {version()}",
        "target": args.target, "lnc": lnc, "options": options, "custom_calls": counts, "input_format": input_format(),
        "module_sha256": hashlib.sha256(source).hexdigest(),
        # the runtime must load such a NEFF with nrt_load_collectives; the simulator runs them across processes
        "collectives": [c.describe() for c in found],
    }  # fmt: skip
    files = {
        "neff.json": json.dumps(neff_json, indent=1, sort_keys=True).encode(),
        "sg00/def.json": json.dumps({"tensors": table}, indent=1).encode(),
        MODULE_FILES[input_format()]: source,
        "module.sim.mlir": sim_text.encode(),
    }
    neff = make_neff(lnc=lnc, table=table, files=files)
    out = Path(args.output)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(neff)
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CompileError("", f"cannot write the output {args.output}: {e.strerror}") from None
    state = _state_dir()
    state.mkdir(parents=True, exist_ok=True)
    line = (f"{time.time():.3f} pid={os.getpid()} target={args.target} lnc={lnc} O{args.optlevel} "
            f"module_sha256={neff_json['module_sha256'][:16]} neff_bytes={len(neff)} output={out}\n")  # fmt: skip
    fd = os.open(state / "compiles.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    return neff_json


#: The module's file name in the NEFF's payload, per input format.
MODULE_FILES = {"mlir": "module.mlir", "hlo": "module.hlo.pb"}


def main(argv: Sequence[str] | None = None, default_log: str | None = None) -> int:
    """The command line; returns the exit status (argparse's errors exit 1 as neuronx-cc does). The log goes to
    ``--logfile``, else to ``default_log`` (the command writes ``log-neuron-cc.txt`` in its working directory;
    a test calling this function leaves its own directory alone)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --version, --help and argparse errors
        return int(e.code or 0)
    log = _Log(args.logfile or default_log)
    log("Command line: neuronx-cc " + " ".join(sys.argv[1:] if argv is None else argv))
    try:
        compile_file(args, log)
    except CompileError as e:
        log(str(e), "ERROR")
        print(str(e), file=sys.stderr)
        status = 1
    else:
        print("Compiler status PASS")
        status = 0
    log(f"Compiler status {'PASS' if status == 0 else 'ERROR'}")
    return status


if __name__ == "__main__":
    sys.exit(main(default_log=LOG_FILE))
