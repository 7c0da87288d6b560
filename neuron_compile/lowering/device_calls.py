"""Device calls: an op in the form Trainium takes it (an ``AwsNeuron*`` custom call) on the neuron target,
and an equivalent StableHLO body on the CPU target (XLA CPU cannot run the custom call).

On the neuron target ``device_call`` emits ``stablehlo.custom_call @AwsNeuronX`` (``api_version`` unspecified
and a string ``backend_config``, as Neuron's own HLO emitters write them: torch-xla's HLO and the nki
``FrameworkKernel`` docs show ``api_version=API_VERSION_UNSPECIFIED``), for the targets neuronx-cc recognises
(``COMPILER_TARGETS``); any other target is its reference StableHLO on every target. On the CPU target it emits
a call to a private function named ``AwsNeuronX__cpu_reference`` that holds the reference body. The legality
pass (``legality/checks.py``) treats that call as the custom call it stands for and does not inspect the
body, so both targets get the same verdict for the same graph.

NOT VERIFIED ON HARDWARE: the operand order, result types and backend_config of the AwsNeuron* calls are
not public. TopK follows Neuron's own HLO emitter (nkipy: ``backend_config`` = str(k), results
(values, uint32 indices) along the last dimension); the others take the operands in the order of the
aten op they replace and an empty config. Check them against neuronx-cc before trusting the neuron
target; the CPU target's numerics come from the reference bodies only.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from .registry import current_or_none

ShapeDtype = jax.ShapeDtypeStruct

#: Name suffix of the private function that holds a device call's StableHLO body on the CPU target
#: (the legality pass checks a call to it as the custom call it stands for).
REFERENCE_SUFFIX = "__cpu_reference"
#: Name suffix of the private function that holds the StableHLO of a call neuronx-cc does not recognise (a plain
#: function, on every target: what neuronx-cc compiles, and what the legality pass checks).
STABLEHLO_SUFFIX = "__stablehlo"
#: The custom-call targets neuronx-cc recognises: error NCC_EVRF015's list (compiler/error-codes/EVRF015.rst). A
#: call of any other target (AwsNeuronGeluApprxTanhBackward) is emitted as its reference StableHLO.
COMPILER_TARGETS = frozenset({
    "AwsNeuronErf", "AwsNeuronGelu", "AwsNeuronGeluApprxTanh", "AwsNeuronGeluBackward", "AwsNeuronSilu",
    "AwsNeuronSiluBackward", "AwsNeuronRmsNorm", "AwsNeuronSoftmax", "AwsNeuronSoftmaxBackward",
    "AwsNeuronCollectiveMatmul", "AwsNeuronIntMatmult", "AwsNeuronArgMax", "AwsNeuronArgMin", "AwsNeuronTopK",
    "AwsNeuronDropoutMaskV1", "AwsNeuronCustomNativeKernel", "AwsNeuronCustomOp", "AwsNeuronDevicePrint",
    "ResizeNearest", "ResizeBilinear", "ResizeNearestGrad", "AwsNeuronLNCShardingConstraint",
    "AwsNeuronTransferWithStaticRing", "AwsNeuronModuleMarkerStart-Forward", "AwsNeuronModuleMarkerStart-Backward",
    "AwsNeuronModuleMarkerEnd-Forward", "AwsNeuronModuleMarkerEnd-Backward", "NeuronBoundaryMarker-Start",
    "NeuronBoundaryMarker-End",
})  # fmt: skip


def current_target() -> str:
    """The target of the node being lowered ("cpu" outside the graph interpreter)."""
    ctx = current_or_none()
    return ctx.target if ctx is not None else "cpu"


def _structs(results: ShapeDtype | Sequence[ShapeDtype]) -> list[ShapeDtype]:
    return [results] if isinstance(results, ShapeDtype) else list(results)


def device_call(
    target_name: str,
    reference: Callable[..., Any],
    *operands: Any,
    results: ShapeDtype | Sequence[ShapeDtype],
    backend_config: str = "",
    target: str | None = None,
) -> Any:
    """``target_name``'s custom call on the neuron target, ``reference(*operands)`` on the CPU target.

    ``results`` (one ShapeDtypeStruct or a sequence) is the custom call's signature; the reference must
    produce exactly that, so both targets trace to modules with the same types.
    """
    target = target or current_target()
    structs = _structs(results)
    single = isinstance(results, ShapeDtype)
    recognised = target_name in COMPILER_TARGETS
    if target == "neuron" and recognised:
        call = jax.ffi.ffi_call(
            target_name,
            structs[0] if single else tuple(structs),
            custom_call_api_version=0,  # API_VERSION_UNSPECIFIED, as torch-xla and nki's docs write Neuron's calls
            legacy_backend_config=backend_config,
        )
        return call(*operands)

    symbol = target_name + (REFERENCE_SUFFIX if recognised else STABLEHLO_SUFFIX)
    out = _reference_function(symbol, reference, ())(*operands)
    got = [out] if single else list(out)
    want = [(tuple(s.shape), jnp.dtype(s.dtype)) for s in structs]
    have = [(tuple(o.shape), jnp.dtype(o.dtype)) for o in got]
    if have != want:
        raise RuntimeError(f"{target_name} reference body produced {have}, the custom call declares {want}")
    return out


def reference_call(
    target_name: str, reference: Callable[..., Any], *operands: Any, consts: tuple[Any, ...] = ()
) -> Any:
    """``target_name``'s CPU-target form, ``reference(*operands, *consts)``, typed by the reference itself.

    ``reference`` must be a module-level function of jax values and ``consts`` (Python values): the jitted
    body is kept per (call, reference, consts), so jax traces it once per operand shapes and every site
    alike (the same kernel in each layer of a model) reuses that trace and its private function.
    """
    return function_call(target_name + REFERENCE_SUFFIX, reference, *operands, consts=consts)


def function_call(symbol: str, body: Callable[..., Any], *operands: Any, consts: tuple[Any, ...] = ()) -> Any:
    """``body(*operands, *consts)`` as a call to the private function ``symbol``, traced once per operand
    shapes (as ``reference_call``, which is this with the device-call suffix).

    A ``symbol`` without ``REFERENCE_SUFFIX`` is a plain function to the legality pass, which walks into
    it as into any jax helper: use it for a body that is what neuronx-cc compiles, not a stand-in for a
    custom call.
    """
    try:
        function = _cached_reference_function(symbol, body, consts)
    except TypeError:  # an unhashable constant: traced for this site alone
        function = _reference_function(symbol, body, consts)
    return function(*operands)


def _reference_function(symbol: str, reference: Callable[..., Any], consts: tuple[Any, ...]) -> Any:
    def body(*args: Any) -> Any:
        return reference(*args, *consts)

    # The function name becomes the private function's symbol, which the legality pass recognises.
    body.__name__ = body.__qualname__ = symbol
    return jax.jit(body)


_cached_reference_function = functools.lru_cache(maxsize=1024)(_reference_function)


def _like(x: Any) -> ShapeDtype:
    return ShapeDtype(x.shape, x.dtype)


def _c(value: float, like: Any) -> Any:
    return jnp.asarray(value, like.dtype)


# -- elementwise: erf, gelu, silu (operands already in the computation dtype) ----------------------
def erf(x: Any) -> Any:
    """erf via AwsNeuronErf: older neuronx-cc rejected the HLO erf op (aws-neuron-sdk issue #1081)."""
    return device_call("AwsNeuronErf", lax.erf, x, results=_like(x))


def _gelu_ref(x: Any, approximate: str) -> Any:
    if approximate == "tanh":
        inner = lax.mul(_c(math.sqrt(2.0 / math.pi), x), lax.add(x, lax.mul(_c(0.044715, x), x * x * x)))
        return lax.mul(lax.mul(_c(0.5, x), x), lax.add(_c(1, x), lax.tanh(inner)))
    return lax.mul(lax.mul(_c(0.5, x), x), lax.add(_c(1, x), lax.erf(lax.mul(x, _c(math.sqrt(0.5), x)))))


def gelu(x: Any, approximate: str = "none", reference: Callable[[Any], Any] | None = None) -> Any:
    """GELU as AwsNeuronGelu (exact) / AwsNeuronGeluApprxTanh (tanh): one ACT-engine instruction on
    the device instead of an erf polynomial."""
    name = "AwsNeuronGeluApprxTanh" if approximate == "tanh" else "AwsNeuronGelu"
    ref = reference or (lambda v: _gelu_ref(v, approximate))
    return device_call(name, ref, x, results=_like(x))


def gelu_backward(grad: Any, x: Any, approximate: str, reference: Callable[[Any, Any], Any]) -> Any:
    """d gelu as AwsNeuronGeluBackward / AwsNeuronGeluApprxTanhBackward, operands (grad, x)."""
    name = "AwsNeuronGeluApprxTanhBackward" if approximate == "tanh" else "AwsNeuronGeluBackward"
    return device_call(name, reference, grad, x, results=_like(x))


def silu(x: Any, reference: Callable[[Any], Any] | None = None) -> Any:
    """SiLU as AwsNeuronSilu (x * sigmoid(x) on the ACT engine)."""
    return device_call("AwsNeuronSilu", reference or (lambda v: lax.mul(v, lax.logistic(v))), x, results=_like(x))


def silu_backward(grad: Any, x: Any, reference: Callable[[Any, Any], Any]) -> Any:
    """d silu as AwsNeuronSiluBackward, operands (grad, x)."""
    return device_call("AwsNeuronSiluBackward", reference, grad, x, results=_like(x))


# -- along one axis: softmax, argmax/argmin, topk (the device calls work on the last axis) ---------
def _to_last(x: Any, axis: int) -> Any:
    return x if axis == x.ndim - 1 else jnp.moveaxis(x, axis, -1)


def _from_last(x: Any, axis: int) -> Any:
    return x if axis == x.ndim - 1 else jnp.moveaxis(x, -1, axis)


def softmax(x: Any, axis: int, reference: Callable[[Any, int], Any]) -> Any:
    """softmax along ``axis`` as AwsNeuronSoftmax over the last axis (moved there and back)."""
    axis %= x.ndim
    xl = _to_last(x, axis)
    out = device_call("AwsNeuronSoftmax", lambda v: reference(v, v.ndim - 1), xl, results=_like(xl))
    return _from_last(out, axis)


def softmax_backward(grad: Any, out: Any, axis: int, reference: Callable[[Any, Any, int], Any]) -> Any:
    """softmax backward as AwsNeuronSoftmaxBackward, operands (grad, softmax output)."""
    axis %= grad.ndim
    g, y = _to_last(grad, axis), _to_last(out, axis)
    res = device_call("AwsNeuronSoftmaxBackward", lambda a, b: reference(a, b, a.ndim - 1), g, y, results=_like(g))
    return _from_last(res, axis)


def rms_norm(x: Any, weight: Any, eps: float, reference: Callable[[Any, Any], Any]) -> Any:
    """RMSNorm over the last axis as AwsNeuronRmsNorm, operands (x, weight); eps in backend_config."""
    return device_call("AwsNeuronRmsNorm", reference, x, weight, results=_like(x), backend_config=repr(float(eps)))


def arg_extreme(x: Any, axis: int, largest: bool) -> Any:
    """int32 index of the first max (min) along ``axis`` as AwsNeuronArgMax (ArgMin); NaN counts as
    the extreme, as in torch. The HLO alternative is a variadic (value, index) reduce, which neuronx-cc
    does not take."""
    axis %= x.ndim
    xl = _to_last(x, axis)
    name, fn = ("AwsNeuronArgMax", jnp.argmax) if largest else ("AwsNeuronArgMin", jnp.argmin)
    ref = lambda v: fn(v, axis=-1).astype(jnp.int32)  # noqa: E731
    return device_call(name, ref, xl, results=ShapeDtype(xl.shape[:-1], jnp.int32))


def topk(x: Any, k: int, axis: int, largest: bool, reference: Callable[[Any], tuple[Any, Any]]) -> tuple[Any, Any]:
    """(values, uint32 indices) of the k largest (``largest=False``: smallest) along ``axis`` as
    AwsNeuronTopK over the last axis. ``reference(x_last)`` computes torch's sorted top-k along the last
    axis for the CPU target. The device call has no "smallest" mode: it takes the top k of -x."""
    axis %= x.ndim
    xl = _to_last(x, axis)
    shape = xl.shape[:-1] + (k,)
    results = (ShapeDtype(shape, xl.dtype), ShapeDtype(shape, jnp.uint32))

    def ref(v: Any) -> tuple[Any, Any]:
        values, indices = reference(v)
        return values, indices.astype(jnp.uint32)

    if largest or current_target() != "neuron":
        values, indices = device_call("AwsNeuronTopK", ref, xl, results=results, backend_config=str(k))
    else:
        neg_values, indices = device_call("AwsNeuronTopK", ref, lax.neg(xl), results=results, backend_config=str(k))
        values = lax.neg(neg_values)
    return _from_last(values, axis), _from_last(indices, axis)
