"""The routing table: which aten nodes, with which shapes and dtypes, become NKI kernel calls.

Everything not routed here keeps its StableHLO lowering from its family file. A route is tried before
the family lowering when ``options["kernels"]`` is not ``"off"``; it returns ``None`` when the node does
not fit the kernel (rank, dims, dtypes, the kernel's own ``supports`` predicate), and the family lowering
runs instead.

A kernel site (``kernel_site``) is one call in the StableHLO module:
- neuron target with the real ``nki`` package: ``custom_call @AwsNeuronCustomNativeKernel``, the call
  neuronx-cc takes for NKI kernels, whose ``backend_config`` is the kernel as nki compiled it for the site's
  shapes, dtypes and constants (``kernels/nki_compiled.py``, written against nki's sources and NEVER RUN:
  nki is not installable here).
- neuron target without it (``LoweredGraph.kernel_sites_as_reference``, which the compiler turns into a
  ``NeuronNkiUnavailableWarning``, shown once per process): a call to a private
  function ``nki_reference_<kernel>`` holding the kernel's jax.lax reference, which neuronx-cc compiles and
  the legality pass checks like any other ops. No custom call: neuronx-cc refuses one whose config does
  not point at a compiled kernel (NCC_EVRF059).
- CPU target, ``kernels="reference"`` (default): a call to a private function holding the kernel's
  jax.lax reference (``kernels/<family>.py``), which the legality pass checks as the custom call.
- CPU target, ``kernels="emulate"``: the same call, whose body is a host callback that runs the NKI
  kernel itself in the emulator, so a model trains through kernel code (slow; such graphs are not kept
  in the disk cache, since a host callback is a live Python object).

A user kernel (``nki_op``) is a host callback into the emulator on the CPU target; the neuron target refuses
it with the node's source line (``user_kernel_on_neuron_reason``), nki or not: see that function.

Attention is routed before AOTAutograd (``kernels/sdpa.py``): a fitting ``scaled_dot_product_attention``
is rewritten into ``neuron::flash_attention``, whose forward and backward nodes are lowered here as kernel
sites.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..errors import NeuronCompileError
from ..kernels import (
    KERNELS,
    nki_compiled,
    torch_ops,  # noqa: F401  (defines torch.ops.neuron.*)
)
from . import device_calls
from .registry import Unsupported, current, register_kernel_route, register_lowering
from .semantics import canonical_dim, convert, is_array, jax_dtype, out_dtype

aten = torch.ops.aten
KERNEL_CALL_TARGET = "AwsNeuronCustomNativeKernel"
#: Name prefix of the private function holding a kernel site's reference on the neuron target without nki.
REFERENCE_ON_NEURON_PREFIX = "nki_reference_"


# ---- kernel sites -----------------------------------------------------------------------------------
def _to_host(x: Any) -> np.ndarray:
    return np.asarray(x)


def neuron_sites_are_references() -> bool:
    """Whether the neuron target lowers kernel sites as their references: the real nki is not in use."""
    return not nki_compiled.real_nki_in_use()


def kernel_site(
    name: str, *arrays: Any, consts: tuple[Any, ...] = (), cpu_reference: Callable[..., Any] | None = None
) -> Any:
    """One NKI kernel call: ``KERNELS[name]`` on ``arrays`` (jax values) and ``consts`` (Python values).

    Returns what the kernel's reference returns (one array or a tuple). ``cpu_reference`` (a module-level
    function with the reference's signature and results) replaces the reference as the CPU target's body.
    """
    spec = KERNELS[name]
    ctx = current()
    reference = spec.reference
    ctx.note_kernel_site(name)
    if ctx.target == "cpu" and ctx.kernels != "emulate":
        # The reference's own trace types the call: no separate eval_shape trace.
        return device_calls.reference_call(KERNEL_CALL_TARGET, cpu_reference or reference, *arrays, consts=consts)
    if ctx.target == "neuron" and neuron_sites_are_references():
        # neuronx-cc takes an NKI kernel only compiled by the real nki (nki_compiled.py): without it the
        # site is the reference's StableHLO, a plain function that neuronx-cc and the legality pass see
        # as any other ops (no REFERENCE_SUFFIX, which would make the legality pass skip the body).
        # LoweredGraph.kernel_sites_as_reference carries the fact to the compiler's warning.
        return device_calls.function_call(f"{REFERENCE_ON_NEURON_PREFIX}{name}", reference, *arrays, consts=consts)
    results = jax.eval_shape(lambda *a: reference(*a, *consts), *arrays)
    single = not isinstance(results, (tuple, list))
    structs = results if single else tuple(results)
    if ctx.target == "neuron":
        compiled = nki_compiled.compiled_kernel_config(spec.kernel, arrays, consts, ctx.generation)
        _check_compiled_kernel(name, compiled, [structs] if single else list(structs))
        config = compiled.backend_config
        return device_calls.device_call(
            KERNEL_CALL_TARGET, reference, *arrays, results=structs, backend_config=config, target="neuron"
        )
    from ..kernels import nki_api as nki  # kernels="emulate": the kernel itself runs, in the emulator

    kernel = spec.kernel

    def host(*host_arrays: Any) -> Any:
        out = nki.simulate(kernel)(*[_to_host(a) for a in host_arrays], *consts)
        return out if single else tuple(out)

    def body(*a: Any) -> Any:
        return jax.pure_callback(host, structs, *a)

    return device_calls.device_call(KERNEL_CALL_TARGET, body, *arrays, results=structs, target="cpu")


def _check_compiled_kernel(name: str, compiled: nki_compiled.CompiledKernelConfig, structs: list[Any]) -> None:
    """The compiled kernel must return what its reference returns (the custom call is typed by the
    reference), write no operand in place and use no collectives: built-in kernels do neither."""
    want = tuple((tuple(s.shape), str(np.dtype(s.dtype))) for s in structs)
    problems = []
    if compiled.outputs != want:
        problems.append(f"it returns {list(compiled.outputs)}, its reference {list(want)}")
    if compiled.operand_output_aliases:
        problems.append(f"it writes operands in place {list(compiled.operand_output_aliases)}")
    if compiled.has_collectives:
        problems.append("it uses collectives")
    if problems:
        reasons = "; ".join(problems)
        raise NeuronCompileError(f"NKI kernel '{name}' as compiled by nki cannot be a kernel site: {reasons}")


def _rows(x: Any) -> Any:
    """``x`` as ``[rows, last dim]``."""
    return jnp.reshape(x, (math.prod(x.shape[:-1]), x.shape[-1]))  # -1 cannot be inferred when empty


def _out_torch_dtype(index: int | None = None) -> Any:
    # The torch dtype, not semantics.out_dtype's jax one: a float64 node (computed as float32) must not
    # pass for a float32 one, so float64 graphs keep their StableHLO lowering.
    out = current().out
    return (out[index] if index is not None else out).dtype


def _same_dtype(x: Any, torch_dtype: torch.dtype) -> bool:
    return str(x.dtype) == str(torch_dtype).removeprefix("torch.")


# ---- the table --------------------------------------------------------------------------------------
@register_kernel_route(aten.mm.default, "matmul")
def mm(a: Any, b: Any) -> Any:
    if not (_same_dtype(a, _out_torch_dtype()) and KERNELS["matmul"].fits(a, b)):
        return None
    cpu_reference = _matmul_lhs_written_out if _is_weight_gradient(a, b) else None
    return kernel_site("matmul", a, b, cpu_reference=cpu_reference)


def _is_weight_gradient(a: Any, b: Any) -> bool:
    """``mm(g.t(), x)`` over more rows (K) than either output dim: a linear layer's weight gradient.

    XLA CPU folds the transpose into the dot, whose LHS then contracts its first dim; such a dot runs in
    Eigen's generic kernel, not YNNPACK's (ynn_support.cc: LHS must be canonical), ~1.5x slower for a
    small transformer's weight gradients (512 tokens, 64..256 features). Written out first, the dot goes
    to YNNPACK: decoder training step -4.6% (benchmarks/steady.py). With K small against the output (an
    MLP at batch 64: K 64, output 2048x512) Eigen's kernel is the faster one, so those are left alone.
    """
    source = current().node.args[0]
    transposed = isinstance(source, torch.fx.Node) and (
        source.target in (aten.t.default, aten.transpose.int)
        or (source.target is aten.permute.default and list(source.args[1]) == [1, 0])
    )
    return transposed and a.shape[1] >= max(a.shape[0], b.shape[1])


def _matmul_lhs_written_out(a: Any, b: Any) -> Any:
    """matmul's reference, with its LHS materialized in row-major order first (CPU target only: the
    barrier keeps XLA from folding the transpose into the dot; see ``_is_weight_gradient``)."""
    return KERNELS["matmul"].reference(jax.lax.optimization_barrier(a), b)


@register_kernel_route(aten.addmm.default, "matmul")
def addmm(bias: Any, a: Any, b: Any, *, beta: Any = 1, alpha: Any = 1) -> Any:
    # float32 only: eager adds the bias to the fp32 accumulator and rounds once, while the kernel rounds
    # its product to bf16/fp16 before the add could happen: routed, a bf16 addmm would round twice.
    if beta != 1 or alpha != 1 or bias.dtype != a.dtype or a.dtype != jnp.float32:
        return None
    if not (_same_dtype(a, _out_torch_dtype()) and KERNELS["matmul"].fits(a, b)):
        return None
    return kernel_site("matmul", a, b) + bias


@register_kernel_route(aten._softmax.default, "softmax")
def softmax(x: Any, dim: int, half_to_float: bool) -> Any:
    last_dim = x.ndim > 0 and canonical_dim(dim, x.ndim) == x.ndim - 1
    if half_to_float or not last_dim or not KERNELS["softmax"].fits(_rows(x)):
        return None
    return jnp.reshape(kernel_site("softmax", _rows(x)), x.shape)


@register_kernel_route(aten._softmax_backward_data.default, "softmax_bwd")
def softmax_backward(grad: Any, output: Any, dim: int, input_dtype: torch.dtype) -> Any:
    if grad.ndim == 0 or canonical_dim(dim, grad.ndim) != grad.ndim - 1 or grad.dtype != output.dtype:
        return None
    if not (_same_dtype(grad, input_dtype) and KERNELS["softmax_bwd"].fits(_rows(output), _rows(grad))):
        return None
    return jnp.reshape(kernel_site("softmax_bwd", _rows(output), _rows(grad)), grad.shape)


@register_kernel_route(aten.native_layer_norm.default, "layer_norm")
def native_layer_norm(x: Any, normalized_shape: list[int], weight: Any, bias: Any, eps: float) -> Any:
    if len(normalized_shape) != 1 or weight is None or bias is None or x.ndim < 2:
        return None
    if not (weight.dtype == bias.dtype == x.dtype and KERNELS["layer_norm"].fits(_rows(x), weight, bias, eps)):
        return None
    out = jnp.reshape(kernel_site("layer_norm", _rows(x), weight, bias, consts=(eps,)), x.shape)
    # The backward graph needs mean and rstd: cheap row statistics in fp32, beside the kernel.
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True) + eps)
    return out, convert(mean, out_dtype(1)), convert(rstd, out_dtype(2))


# ---- attention: the neuron:: custom ops are always kernel sites ------------------------------------
@register_lowering(torch.ops.neuron.flash_attention.default)
def flash_attention(q: Any, k: Any, v: Any, causal: bool, scale: float) -> Any:
    return kernel_site("flash_attention_fwd", q, k, v, consts=(causal, scale))


@register_lowering(torch.ops.neuron.flash_attention_backward.default)
def flash_attention_backward(q: Any, k: Any, v: Any, o: Any, do: Any, lse: Any, causal: bool, scale: float) -> Any:
    return kernel_site("flash_attention_bwd", q, k, v, o, do, lse, consts=(causal, scale))


# ---- user kernels (nki_op) --------------------------------------------------------------------------
def _host_to_torch(a: Any) -> torch.Tensor:
    """A writable torch copy of a host-callback operand: the kernel may write into it (mutates_args)."""
    # Imported here, at run time of a callback: the emulator pulls in scipy (~0.5 s), which a graph
    # without user kernels, and a cache hit, never need.
    from ..kernels.emulator import numpy_to_torch

    return numpy_to_torch(np.array(a))


def _torch_to_host(t: torch.Tensor) -> np.ndarray:
    from ..kernels.emulator import torch_to_numpy

    return torch_to_numpy(t.contiguous())


def _struct_of(meta: torch.Tensor) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(int(s) for s in meta.shape), jax_dtype(meta.dtype))


def _user_kernel_site(op: Any, fn: Callable[..., Any], args: tuple, kwargs: dict, bases: dict[str, int]) -> Any:
    """One call of a user kernel. ``bases``: mutated argument name -> index of its value in the node's
    results after the op's own outputs (auto_functionalized's convention)."""
    from torch.utils import _pytree as pytree

    ctx = current()
    meta = ctx.out
    metas = list(meta) if isinstance(meta, (tuple, list)) else [meta]
    tensor_slots = [i for i, m in enumerate(metas) if isinstance(m, torch.Tensor)]
    structs = tuple(_struct_of(metas[i]) for i in tensor_slots)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    operand_slots = [i for i, leaf in enumerate(leaves) if is_array(leaf)]
    operands = [leaves[i] for i in operand_slots]
    n_outputs = len(metas) - len(bases)
    op_name = op._schema.name  # "namespace::name", as the user registered it
    if ctx.target == "neuron":
        raise Unsupported(user_kernel_on_neuron_reason(op_name))
    ctx.note_kernel_site(op_name)

    def host(*host_arrays: Any) -> tuple[np.ndarray, ...]:
        values = list(leaves)
        for slot, a in zip(operand_slots, host_arrays):
            values[slot] = _host_to_torch(a)
        call_args, call_kwargs = pytree.tree_unflatten(values, spec)
        out = fn(*call_args, **call_kwargs)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        results = outs[:n_outputs] + [call_kwargs[name] for name in bases]
        return tuple(_torch_to_host(results[i]) for i in tensor_slots)

    def body(*a: Any) -> Any:
        return jax.pure_callback(host, structs, *a)

    flat = device_calls.device_call(KERNEL_CALL_TARGET, body, *operands, results=structs, target="cpu")
    flat = list(flat) if isinstance(flat, (tuple, list)) else [flat]
    if not isinstance(meta, (tuple, list)):
        return flat[0]
    result: list[Any] = [None] * len(metas)
    for slot, value in zip(tensor_slots, flat):
        result[slot] = value
    return tuple(result)


def user_kernel_on_neuron_reason(op_name: str) -> str:
    """Why user kernel ``op_name`` ("ns::name") has no neuron-target form, and what to do."""
    if not nki_compiled.real_nki_in_use():
        return (
            f"user NKI kernel {op_name} needs the real `nki` package (AWS Neuron SDK) on the neuron target, "
            "which compiles its kernels into the NEFF, and it is not installed (or NEURON_COMPILE_NKI=emulator "
            "keeps it unused): install the Neuron SDK's nki, or compile with options={'target': 'cpu'}, where "
            "the kernel runs in the NKI emulator"
        )
    # The op's function may call several @nki.jit kernels and torch ops: one custom call per kernel call
    # would need those calls traced one by one, which is not written yet.
    return (
        f"user NKI kernel {op_name}: user kernels are not compiled for the neuron target yet (only the "
        "built-in kernel sites are); compile with options={'target': 'cpu'}, where the kernel runs in the "
        "NKI emulator"
    )


def user_kernel_lowering(op: Any) -> Callable[..., Any] | None:
    """The lowering of a node made by ``nki_op`` (None for any other op)."""
    from ..kernels.user_ops import user_kernel

    fn = user_kernel(op)
    if fn is None:
        return None

    def lower_user_kernel(*args: Any, **kwargs: Any) -> Any:
        return _user_kernel_site(op, fn, args, kwargs, {})

    return lower_user_kernel


def lower_auto_functionalized(target: Any, op: Any, kwargs: dict[str, Any]) -> Any:
    """``auto_functionalized_v2(op, **kwargs)``: a user kernel that writes some arguments in place,
    made functional by AOTAutograd. Returns (op outputs..., new values of the mutated bases...)."""
    from ..kernels.user_ops import user_kernel

    fn = user_kernel(op)
    if fn is None:
        raise Unsupported(f"in-place custom op {op} is not an nki_op kernel; only those are lowered")
    bases = kwargs.pop("_all_bases", None)
    if target is not torch.ops.higher_order.auto_functionalized_v2 or bases is None:
        raise Unsupported("auto_functionalized (v1) graphs are not supported; use torch >= 2.6's v2")
    names: dict[str, int] = {}
    for key in list(kwargs):
        if key.startswith("_") and key.endswith("_base_index"):
            name = key[1 : -len("_base_index")]
            view_keys = [k for k in kwargs if k.startswith(f"_{name}_") and k != key]
            if view_keys:
                raise Unsupported(f"mutated argument '{name}' is a view of another tensor; pass a contiguous tensor")
            index = kwargs.pop(key)
            names[name] = index
            kwargs[name] = bases[index]
    order = {name: i for i, name in enumerate(sorted(names, key=names.__getitem__))}
    return _user_kernel_site(op, fn, (), kwargs, order)
