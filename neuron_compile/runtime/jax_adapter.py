"""Every private jax/jaxlib call the project makes, in one place, with feature checks.

These APIs move between jaxlib versions (pinned to 0.10.2 in pyproject). Where a public path does the
same job, a missing call falls back to it (slower); the DLPack import has none that reaches this
package's own client, so its absence is a clear ImportError.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import numpy as np
import torch

try:  # private: the low-overhead DLPack import (~4 us; jax.dlpack.from_dlpack takes ~23 us) and export
    from jax._src.lib import _jax as _jaxlib_ext

    _DLPACK_TO_BUFFER = getattr(_jaxlib_ext, "dlpack_managed_tensor_to_buffer", None)
    _BUFFER_TO_DLPACK = getattr(_jaxlib_ext, "buffer_to_dlpack_managed_tensor", None)
    _TRACEBACK_SCOPE = getattr(_jaxlib_ext, "TracebackScope", contextlib.nullcontext)
except ImportError:  # depends on the jaxlib version
    _DLPACK_TO_BUFFER = _BUFFER_TO_DLPACK = None
    _TRACEBACK_SCOPE = contextlib.nullcontext

from jax._src.lib import xla_client
from torch.utils.dlpack import from_dlpack as _torch_from_capsule
from torch.utils.dlpack import to_dlpack as _torch_to_capsule

from ..errors import NeuronForkedProcessError


@functools.lru_cache(maxsize=None)
def cpu_backend() -> Any:
    """This package's own XLA CPU client, separate from jax's, that runs executables on the calling thread.

    jax's client dispatches each execution to a worker thread, which then drops the last reference to
    the input buffers. Those are torch tensors lent through DLPack, and releasing one takes the GIL;
    a worker doing so while the interpreter finalizes kills the process with "terminate called without
    an active exception" (seen at the exit of one training script in five). Run inline, the inputs are
    released by the thread that called, before the call returns. Steady-state speed is unchanged
    (``benchmarks/steady.py``), and jax's own client is left as the user configured it.
    """
    return xla_client.make_cpu_client(asynchronous=False)


#: The parent's pid, in a process forked after the parent made its client (None otherwise).
_forked_from: int | None = None


def _after_fork_in_child() -> None:
    global _forked_from
    if cpu_backend.cache_info().currsize:
        _forked_from = os.getppid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def check_not_forked() -> None:
    """A forked child inherits the client but not its worker threads (XLA's compile and intra-op pools, and
    those of jax's MLIR context): a lowering, a compile or a run that needs them waits forever. Say so
    instead of hanging."""
    if _forked_from is not None:
        raise NeuronForkedProcessError(
            f"neuron backend: process {os.getpid()} was forked from process {_forked_from} after that process "
            "started the CPU target (XLA), whose threads do not survive a fork: compiling or running a graph "
            "here would hang. Run compiled models in the main process, or start worker processes with "
            "'spawn' or 'forkserver' (DataLoader(..., multiprocessing_context='spawn'), "
            "torch.multiprocessing.set_start_method('spawn')), or fork before the first compile."
        )


@functools.lru_cache(maxsize=None)
def _cpu_devices() -> Any:
    return xla_client.DeviceList(tuple(cpu_backend().local_devices()))


#: Float types whose divisions are computed in float64 on XLA CPU (see ``_exact_divisions``).
_NARROW_FLOATS = ("f32", "bf16", "f16")


def traceback_scope() -> Any:
    """A context in which the jax objects made record no Python frame above it.

    jax records the Python stack in every array and executable it makes, holding the code objects of the
    callers' frames. Ours are made inside the call of Dynamo's transformed code (a constant at the first
    call, every output, a backward compiled lazily from a ``loss.backward()`` in a compiled function), and
    Dynamo drops a compiled graph only when that code dies: through such a reference every compiled graph
    lived as long as the process, executables and memory maps included (deleting the model and
    ``torch._dynamo.reset()`` freed none)."""
    return _TRACEBACK_SCOPE()


def compile_stablehlo(module_text: str, host_callbacks: list[Any] | tuple[Any, ...] = ()) -> Any:
    """XLA CPU executable of a StableHLO module (text), its float divisions made exact (``_exact_divisions``).

    A module with host callbacks (``jax.pure_callback``) names them by index into ``host_callbacks``;
    they must be handed over with an MLIR module (running such a module compiled from text alone
    crashes the process).
    """
    check_not_forked()
    with traceback_scope():
        return _compile(module_text, host_callbacks)


def _compile(module_text: str, host_callbacks: list[Any] | tuple[Any, ...]) -> Any:
    if not host_callbacks and "stablehlo.divide" not in module_text:
        return cpu_backend().compile_and_load(module_text, _cpu_devices(), xla_client.CompileOptions())
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    module = ir.Module.parse(module_text, context=mlir.make_ir_context())
    _exact_divisions(module)
    if not host_callbacks:
        return cpu_backend().compile_and_load(module, _cpu_devices(), xla_client.CompileOptions())
    return cpu_backend().compile_and_load(
        module,
        executable_devices=_cpu_devices(),
        compile_options=xla_client.CompileOptions(),
        host_callbacks=list(host_callbacks),
    )


def _exact_divisions(module: Any) -> None:
    """Each float32/bfloat16/float16 ``stablehlo.divide`` of ``module`` computed in float64, rounded once.

    XLA's algebraic simplifier turns ``x / broadcast(y)`` (a scalar or a row of sums: ``x / 127.5``, a mean,
    softmax's normalization) into ``x * broadcast(1 / y)``, which is off by one ulp in about half the
    elements, where StableHLO's divide (and eager) is IEEE division, correctly rounded. Most of that is
    within any tolerance, but a rounding, truncation or comparison after it turns it into a wrong integer
    (``torch.div(x, 0.1, rounding_mode="trunc")``, ``torch.round(x / scale)`` in quantization). In float64
    XLA may still multiply by the reciprocal, but that is within 2**-52 of the quotient, while a quotient of
    two 24-bit floats is at least 2**-50 (relative) from any midpoint of float32: the float32 rounding of
    it is exact. neuronx-cc gets the module as lowered; only XLA CPU sees this.
    """
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import hlo

    f64 = ir.F64Type.get(module.context)
    divides: list[Any] = []

    def visit(op: Any) -> Any:
        if op.operation.name == "stablehlo.divide":
            element = ir.RankedTensorType(op.result.type).element_type
            if str(element) in _NARROW_FLOATS:
                divides.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    for op in divides:
        op = op.operation
        result_type = ir.RankedTensorType(op.result.type)
        with module.context, op.location, ir.InsertionPoint(op):
            wide = ir.RankedTensorType.get(result_type.shape, f64)
            lhs, rhs = (hlo.convert(wide, v) for v in op.operands)
            exact = hlo.convert(result_type, hlo.divide(lhs, rhs))
        op.result.replace_all_uses_with(exact)
        op.erase()


def host_callbacks_of(lowered: Any) -> list[Any]:
    """The host callbacks a ``jax.stages.Lowered`` module calls (empty for most graphs)."""
    lowering = getattr(lowered, "_lowering", None)
    args = getattr(lowering, "compile_args", None) or {}
    return list(args.get("host_callbacks", ()))


def serialize_executable(executable: Any) -> bytes:
    return bytes(executable.serialize())


def deserialize_executable(blob: bytes) -> Any:
    check_not_forked()
    with traceback_scope():
        return cpu_backend().deserialize_executable(blob, _cpu_devices(), xla_client.CompileOptions())


@functools.lru_cache(maxsize=None)
def cpu_device() -> Any:
    return cpu_backend().local_devices()[0]


def torch_to_device(t: torch.Tensor) -> Any:
    """A jax buffer that shares ``t``'s memory (``t`` must be contiguous).

    The capsule comes from ``torch.utils.dlpack.to_dlpack`` (~0.3 us), not ``t.__dlpack__()`` (~2-4 us of
    Python checks, and a refusal of tensors that require grad: the buffer is only read, so that is moot).
    """
    if _DLPACK_TO_BUFFER is None:  # depends on the jaxlib version
        # jax.dlpack's public import would place the buffer on jax's client, not on this package's.
        import jaxlib

        raise ImportError(
            f"jaxlib {jaxlib.__version__} has no dlpack_managed_tensor_to_buffer; neuron_compile needs the "
            "pinned jaxlib (see pyproject.toml)"
        )
    return _DLPACK_TO_BUFFER(_torch_to_capsule(t), cpu_device(), None, None, 1)


def constant_buffer(value: Any) -> Any:
    """A jax buffer owning a copy of ``value`` (a numpy array), for inputs that never change between calls.

    Safe to pass to every call: executables are compiled without input donation, so none writes its inputs.
    """
    with traceback_scope():
        return torch_to_device(torch.from_numpy(np.array(value, copy=True)))


def device_to_torch(array: Any) -> torch.Tensor:
    """A torch tensor that shares the jax buffer's memory (bfloat16 included): ~2.5 us through the
    buffer's capsule, ~6 us through ``torch.from_dlpack(array)`` (jax's ``__dlpack__`` protocol)."""
    if _BUFFER_TO_DLPACK is not None:
        return _torch_from_capsule(_BUFFER_TO_DLPACK(array))
    return torch.from_dlpack(array)


def execute(executable: Any, buffers: list[Any]) -> list[Any]:
    """Run a single-device executable; ``execute`` itself is this plus a per-call keyword shuffle."""
    check_not_forked()
    with traceback_scope():  # results that hold no frame of the caller's (Dynamo's transformed code)
        run = getattr(executable, "execute_sharded", None)
        if run is None:  # depends on the jaxlib version
            return executable.execute(buffers)
        return [r[0] for r in run(buffers).disassemble_into_single_device_arrays()]


def memory_stats(executable: Any) -> dict[str, int] | None:
    """XLA's buffer assignment of a CPU executable: its argument, output, aliased and temporary bytes (None where
    the jaxlib's executable does not report them). ``hbm.py`` estimates a NeuronCore's peak HBM from them."""
    get = getattr(executable, "get_compiled_memory_stats", None)  # depends on the jaxlib version
    if get is None:
        return None
    stats = get()
    return {
        "arguments": int(stats.argument_size_in_bytes),
        "outputs": int(stats.output_size_in_bytes),
        "aliased": int(stats.alias_size_in_bytes),
        "temporaries": int(stats.temp_size_in_bytes),
    }


#: MLIR element types of a module's parameters and results -> torch dtypes (the NEFF's byte layout).
_MLIR_DTYPES = {
    "f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64,
    "i64": torch.int64, "i32": torch.int32, "i16": torch.int16, "i8": torch.int8, "i1": torch.bool,
    "ui8": torch.uint8, "ui16": torch.uint16, "ui32": torch.uint32, "ui64": torch.uint64,
    "f8E4M3FN": torch.float8_e4m3fn, "f8E5M2": torch.float8_e5m2,
}  # fmt: skip


def main_signature(
    module_text: str,
) -> tuple[list[tuple[tuple[int, ...], torch.dtype]], list[tuple[tuple[int, ...], torch.dtype]]]:
    """(shape, dtype) of each parameter and each result of the module's ``main`` function."""
    params, results, _ = module_summary(module_text)
    return params, results


def module_summary(
    module_text: str,
) -> tuple[list[tuple[tuple[int, ...], torch.dtype]], list[tuple[tuple[int, ...], torch.dtype]], frozenset[str]]:
    """``main_signature``'s (parameters, results), and the name of every op in the module (nested regions
    included), from one parse: what a target decides by (a module with collectives loads as one of a group)."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    module = ir.Module.parse(module_text, context=mlir.make_ir_context())
    names: set[str] = set()

    def walk(block: Any) -> None:
        for op in block.operations:
            names.add(op.operation.name)
            for region in op.operation.regions:
                for inner in region.blocks:
                    walk(inner)

    walk(module.body)
    for op in module.body.operations:
        if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
            function_type = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)

            def describe(types: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
                out = []
                for t in types:
                    ranked = ir.RankedTensorType(t)
                    out.append((tuple(ranked.shape), _MLIR_DTYPES[str(ranked.element_type)]))
                return out

            return describe(function_type.inputs), describe(function_type.results), frozenset(names)
    raise ValueError("the module has no main function")


# ------------------------------------------------------------------------------- what neuronx-cc is given
#: Frontend attributes naming a NEFF's tensors, as torch-xla's HLO carries them (read by neuronx-cc): each
#: parameter its ``neff_input_names``, the root tuple its ``neff_output_names`` (comma-joined).
NEFF_INPUT_NAMES = "neff_input_names"
NEFF_OUTPUT_NAMES = "neff_output_names"


def _frontend_attributes(ctx: Any, **values: str) -> Any:
    from jax._src.lib.mlir import ir

    return ir.DictAttr.get({k: ir.StringAttr.get(v, ctx) for k, v in values.items()}, ctx)


def neff_module(module_text: str, input_names: list[str], output_names: list[str]) -> str:
    """The module as neuronx-cc gets it: ``main``'s parameters named ``input_names`` and its results returned as
    one tuple named ``output_names``, through the frontend attributes torch-xla sets on its HLO (``neff_input_names``
    on each parameter, ``neff_output_names`` on the root tuple, which torch-xla makes a tuple for one result too).

    In StableHLO the attributes are ``mhlo.frontend_attributes`` of the arguments and of the ``stablehlo.tuple``;
    jaxlib's converter carries both into the HLO proto (``hlo_module_proto``) as torch-xla writes them."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import func, hlo

    module = ir.Module.parse(module_text, context=mlir.make_ir_context())
    ctx = module.context
    main = next(
        op
        for op in module.body.operations
        if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main"
    )
    ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    if len(input_names) != len(ftype.inputs) or len(output_names) != len(ftype.results):
        raise ValueError(
            f"main has {len(ftype.inputs)} parameters and {len(ftype.results)} results; names were given for "
            f"{len(input_names)} and {len(output_names)}"
        )
    if any("," in name for name in output_names):
        raise ValueError(f"output names are joined by commas, so none may hold one: {output_names}")
    with ctx:
        old = list(ir.ArrayAttr(main.attributes["arg_attrs"])) if "arg_attrs" in main.attributes else []
        arg_attrs = []
        for i, name in enumerate(input_names):
            entries = {a.name: a.attr for a in ir.DictAttr(old[i])} if i < len(old) else {}
            entries["mhlo.frontend_attributes"] = _frontend_attributes(ctx, **{NEFF_INPUT_NAMES: name})
            arg_attrs.append(ir.DictAttr.get(entries))
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(arg_attrs)
        block = main.regions[0].blocks[0]
        ret = list(block.operations)[-1]
        with ir.InsertionPoint(ret), ret.location:
            root = hlo.TupleOp(list(ret.operands))
            root.operation.attributes["mhlo.frontend_attributes"] = _frontend_attributes(
                ctx, **{NEFF_OUTPUT_NAMES: ",".join(output_names)}
            )
            func.ReturnOp([root.result])
        ret.erase()
        main.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(list(ftype.inputs), [root.result.type]))
        if "res_attrs" in main.attributes:
            del main.attributes["res_attrs"]
    return str(module)


def hlo_module_proto(module_text: str) -> bytes:
    """The serialized ``HloModuleProto`` of a StableHLO module (jaxlib's converter; the root stays the module's
    own: ``neff_module``'s tuple keeps its ``neff_output_names``)."""
    from jax._src.lib import _jax

    computation = _jax.mlir.mlir_module_to_xla_computation(module_text, use_tuple_args=False, return_tuple=False)
    return bytes(computation.as_serialized_hlo_module_proto())


_DTYPE_BYTES = {"f64": 8, "i64": 8, "ui64": 8, "f32": 4, "i32": 4, "ui32": 4, "f16": 2, "bf16": 2, "i16": 2,
                "ui16": 2, "i8": 1, "ui8": 1, "i1": 1}  # fmt: skip


def largest_op(module: Any) -> tuple[str, int, str] | None:
    """(op name, result bytes, MLIR location) of the op with the largest result in ``module`` (a module with
    locations, ``Lowered.compiler_ir("stablehlo")``, or a module's text); None for a module without ops."""
    from jax._src.lib.mlir import ir

    if isinstance(module, str):
        from jax._src.interpreters import mlir

        module = ir.Module.parse(module, context=mlir.make_ir_context())

    best: list[tuple[int, str, str]] = []

    def visit(op: Any) -> Any:
        total = 0
        for value in op.operation.results:
            if isinstance(value.type, ir.RankedTensorType):
                t = ir.RankedTensorType(value.type)
                if t.has_static_shape:
                    count = 1
                    for d in t.shape:
                        count *= d
                    total += count * _DTYPE_BYTES.get(str(t.element_type), 1)
        name = op.operation.name
        if total and name not in ("func.func", "func.return", "stablehlo.return"):
            if not best or total > best[0][0]:
                best[:] = [(total, name, str(op.operation.location))]
        return ir.WalkResult.ADVANCE

    with module.context:
        module.operation.walk(visit)
    return (best[0][1], best[0][0], best[0][2]) if best else None
