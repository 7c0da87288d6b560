"""What neuronx-cc's ``AwsNeuron*`` custom calls compute, written in jax for the fake compiler.

XLA CPU cannot run a ``stablehlo.custom_call @AwsNeuronX``; the real compiler implements each target
itself, so the fake compiler does too: every call becomes a ``func.call`` of a private function lowered
from :func:`implementation`. These bodies are this simulator's own, written from each call's documented
meaning, NOT copied from the package's CPU reference bodies (``neuron_compile/lowering/device_calls.py``):
tests hold the two against each other, so a package body that drifts from the meaning shows up.

Operand order, results and ``backend_config`` follow what ``device_calls.py`` emits (AWS does not publish
them; see that module's docstring). Floats narrower than float32 are computed in float32 and rounded once
at the end, as the device's ACT/vector engines compute internally.

:data:`DOCUMENTED_TARGETS` is the target list of neuronx-cc's error NCC_EVRF015 (formerly NCC_EHCA005): the
targets it recognises, exactly what the fake compiler accepts (it refuses any other with that error's text). The
simulator computes :data:`IMPLEMENTED`, a part of it; a listed target it does not compute is a simulator limit
(NCC_SIM001), not a refusal of the real compiler.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

#: neuronx-cc's recognised custom-call targets: the list of error NCC_EVRF015's page (compiler/error-codes/EVRF015.rst).
DOCUMENTED_TARGETS = frozenset({
    "AwsNeuronErf", "AwsNeuronGelu", "AwsNeuronGeluApprxTanh", "AwsNeuronGeluBackward", "AwsNeuronSilu",
    "AwsNeuronSiluBackward", "AwsNeuronRmsNorm", "AwsNeuronSoftmax", "AwsNeuronSoftmaxBackward",
    "AwsNeuronCollectiveMatmul", "AwsNeuronIntMatmult", "AwsNeuronArgMax", "AwsNeuronArgMin", "AwsNeuronTopK",
    "AwsNeuronDropoutMaskV1", "AwsNeuronCustomNativeKernel", "AwsNeuronCustomOp", "AwsNeuronDevicePrint",
    "ResizeNearest", "ResizeBilinear", "ResizeNearestGrad", "AwsNeuronLNCShardingConstraint",
    "AwsNeuronTransferWithStaticRing", "AwsNeuronModuleMarkerStart-Forward", "AwsNeuronModuleMarkerStart-Backward",
    "AwsNeuronModuleMarkerEnd-Forward", "AwsNeuronModuleMarkerEnd-Backward", "NeuronBoundaryMarker-Start",
    "NeuronBoundaryMarker-End",
})  # fmt: skip

Struct = jax.ShapeDtypeStruct


class CustomCallError(Exception):
    """A custom call the simulator cannot take as written (operands, results or backend_config)."""


# ------------------------------------------------------------------------------------------- helpers
def _wide(x: Any) -> Any:
    """x in the dtype the engines compute it in: narrow floats as float32."""
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32:
        return x.astype(jnp.float32)
    return x


def _expect(target: str, operands: Sequence[Struct], results: Sequence[Struct], n_in: int, n_out: int) -> None:
    if len(operands) != n_in or len(results) != n_out:
        raise CustomCallError(
            f"{target} takes {n_in} operand(s) and gives {n_out} result(s); this call has {len(operands)} and "
            f"{len(results)}"
        )
    for s in operands:
        if not jnp.issubdtype(s.dtype, jnp.floating):
            raise CustomCallError(f"{target} takes floating-point operands, not {s.dtype}")


def _same_as_first(target: str, operands: Sequence[Struct], results: Sequence[Struct]) -> None:
    want = (tuple(operands[-1].shape), jnp.dtype(operands[-1].dtype))
    for s in list(operands) + list(results):
        if (tuple(s.shape), jnp.dtype(s.dtype)) != want:
            raise CustomCallError(f"{target}: every operand and result must be {want}, got {s.shape} {s.dtype}")


def _phi(x: Any) -> Any:  # standard normal CDF
    return 0.5 * (1.0 + lax.erf(x * (1.0 / math.sqrt(2.0))))


def _tanh_inner(x: Any) -> Any:
    return math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)


# ------------------------------------------------------------------------------------------- elementwise
def _unary(fn: Callable[[Any], Any]) -> Callable[..., Callable[..., Any]]:
    def build(target: str, config: str, operands: Sequence[Struct], results: Sequence[Struct]) -> Callable[..., Any]:
        _expect(target, operands, results, 1, 1)
        _same_as_first(target, operands, results)
        return lambda x: (fn(_wide(x)).astype(x.dtype),)

    return build


def _with_grad(fn: Callable[[Any, Any], Any]) -> Callable[..., Callable[..., Any]]:
    """Backward calls: operands (grad, x), result grad * f'(x)."""

    def build(target: str, config: str, operands: Sequence[Struct], results: Sequence[Struct]) -> Callable[..., Any]:
        _expect(target, operands, results, 2, 1)
        _same_as_first(target, operands, results)
        return lambda g, x: (fn(_wide(g), _wide(x)).astype(x.dtype),)

    return build


def _gelu(x: Any) -> Any:
    return x * _phi(x)


def _gelu_tanh(x: Any) -> Any:
    return 0.5 * x * (1.0 + jnp.tanh(_tanh_inner(x)))


def _gelu_grad(g: Any, x: Any) -> Any:
    pdf = jnp.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))
    return g * (_phi(x) + x * pdf)


def _silu(x: Any) -> Any:
    return x * jax.nn.sigmoid(x)


def _silu_grad(g: Any, x: Any) -> Any:
    s = jax.nn.sigmoid(x)
    return g * s * (1.0 + x * (1.0 - s))


# ------------------------------------------------------------------------------------------- last axis
def _softmax(target: str, config: str, operands: Sequence[Struct], results: Sequence[Struct]) -> Callable[..., Any]:
    """softmax over the last axis (device_calls moves the axis there)."""
    _expect(target, operands, results, 1, 1)
    _same_as_first(target, operands, results)

    def fn(x: Any) -> Any:
        w = _wide(x)
        e = jnp.exp(w - jnp.max(w, axis=-1, keepdims=True))
        return ((e / jnp.sum(e, axis=-1, keepdims=True)).astype(x.dtype),)

    return fn


def _softmax_grad(
    target: str, config: str, operands: Sequence[Struct], results: Sequence[Struct]
) -> Callable[..., Any]:
    """Operands (grad, softmax output y): y * (grad - sum(grad * y)) over the last axis."""
    _expect(target, operands, results, 2, 1)
    _same_as_first(target, operands, results)

    def fn(g: Any, y: Any) -> Any:
        gw, yw = _wide(g), _wide(y)
        return ((yw * (gw - jnp.sum(gw * yw, axis=-1, keepdims=True))).astype(g.dtype),)

    return fn


def _rms_norm(target: str, config: str, operands: Sequence[Struct], results: Sequence[Struct]) -> Callable[..., Any]:
    """Operands (x, weight over the last axis), epsilon as backend_config: x / sqrt(mean(x^2) + eps) * weight,
    statistics in float32."""
    _expect(target, operands, results, 2, 1)
    x, w = operands
    if tuple(w.shape) != tuple(x.shape[-1:]) or tuple(results[0].shape) != tuple(x.shape):
        raise CustomCallError(f"{target}: weight must be x's last axis {x.shape[-1:]}, got {w.shape}")
    try:
        eps = float(config)
    except ValueError:
        raise CustomCallError(f"{target}: backend_config {config!r} is not an epsilon") from None

    def fn(xv: Any, wv: Any) -> Any:
        xf = xv.astype(jnp.float32)
        rstd = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + jnp.float32(eps))
        return ((xf * rstd * wv.astype(jnp.float32)).astype(results[0].dtype),)

    return fn


def _arg_extreme(largest: bool) -> Callable[..., Callable[..., Any]]:
    def build(target: str, config: str, operands: Sequence[Struct], results: Sequence[Struct]) -> Callable[..., Any]:
        """Index of the first max (min) along the last axis; a NaN is the extreme (the first NaN wins)."""
        if len(operands) != 1 or len(results) != 1:
            raise CustomCallError(f"{target} takes one operand and gives one result")
        (x,), (r,) = operands, results
        if tuple(r.shape) != tuple(x.shape[:-1]) or not jnp.issubdtype(r.dtype, jnp.integer):
            raise CustomCallError(f"{target}: result must be integer indices of shape {x.shape[:-1]}, got {r}")

        def fn(v: Any) -> Any:
            n = v.shape[-1]
            idx = lax.broadcasted_iota(jnp.int32, v.shape, v.ndim - 1)
            first = lambda mask: jnp.min(jnp.where(mask, idx, n), axis=-1)  # noqa: E731
            best = jnp.max(v, axis=-1, keepdims=True) if largest else jnp.min(v, axis=-1, keepdims=True)
            pick = first(v == best)
            if jnp.issubdtype(v.dtype, jnp.floating):
                nan = v != v
                pick = jnp.where(jnp.any(nan, axis=-1), first(nan), pick)
            return (pick.astype(r.dtype),)

        return fn

    return build


def _topk(target: str, config: str, operands: Sequence[Struct], results: Sequence[Struct]) -> Callable[..., Any]:
    """(values, indices) of the k largest along the last axis, k = int(backend_config); sorted from the largest,
    equal values in index order, NaN larger than any number."""
    if len(operands) != 1 or len(results) != 2:
        raise CustomCallError(f"{target} takes one operand and gives (values, indices)")
    try:
        k = int(config)
    except ValueError:
        raise CustomCallError(f"{target}: backend_config {config!r} is not k") from None
    (x,), (values, indices) = operands, results
    n = x.shape[-1] if x.shape else 0
    want = tuple(x.shape[:-1]) + (k,)
    if not 0 < k <= n or tuple(values.shape) != want or tuple(indices.shape) != want:
        raise CustomCallError(f"{target}: k={k} along an axis of {n}; results {values.shape}, {indices.shape}")
    if jnp.dtype(values.dtype) != jnp.dtype(x.dtype) or not jnp.issubdtype(indices.dtype, jnp.integer):
        raise CustomCallError(f"{target}: results must be ({x.dtype} values, integer indices)")

    def fn(v: Any) -> Any:
        idx = lax.broadcasted_iota(jnp.int32, v.shape, v.ndim - 1)
        if jnp.issubdtype(v.dtype, jnp.floating):
            nan = v != v
            not_nan_first = nan.astype(jnp.int32) * -1 + 1  # 0 for NaN (sorts first), 1 otherwise
            descending = jnp.where(nan | (v == 0), jnp.zeros_like(v), -v)  # -0.0 and 0.0 tie
            keys = (not_nan_first, descending, idx)
        else:
            keys = (jnp.zeros_like(idx), -v.astype(jnp.int64), idx)
        _, _, order = lax.sort(keys, dimension=v.ndim - 1, num_keys=3)
        top = lax.slice_in_dim(order, 0, k, axis=v.ndim - 1)
        return jnp.take_along_axis(v, top, axis=-1), top.astype(indices.dtype)

    return fn


_BUILDERS: dict[str, Callable[..., Callable[..., Any]]] = {
    "AwsNeuronErf": _unary(lax.erf),
    "AwsNeuronGelu": _unary(_gelu),
    "AwsNeuronGeluApprxTanh": _unary(_gelu_tanh),
    "AwsNeuronGeluBackward": _with_grad(_gelu_grad),
    "AwsNeuronSilu": _unary(_silu),
    "AwsNeuronSiluBackward": _with_grad(_silu_grad),
    "AwsNeuronSoftmax": _softmax,
    "AwsNeuronSoftmaxBackward": _softmax_grad,
    "AwsNeuronRmsNorm": _rms_norm,
    "AwsNeuronArgMax": _arg_extreme(largest=True),
    "AwsNeuronArgMin": _arg_extreme(largest=False),
    "AwsNeuronTopK": _topk,
}

#: Targets the simulator computes (each one of DOCUMENTED_TARGETS).
IMPLEMENTED = frozenset(_BUILDERS)
assert IMPLEMENTED <= DOCUMENTED_TARGETS, IMPLEMENTED - DOCUMENTED_TARGETS


def implementation(
    target: str, backend_config: str, operands: Sequence[Struct], results: Sequence[Struct]
) -> Callable[..., tuple]:
    """A jax function of the call's operands returning a tuple of its results (exactly their shapes and
    dtypes). Raises KeyError for a target the simulator does not implement, CustomCallError for a call it
    cannot take as written."""
    fn = _BUILDERS[target](target, backend_config, list(operands), list(results))
    with jax.enable_x64(True):
        got = jax.eval_shape(fn, *operands)
    have = [(tuple(s.shape), jnp.dtype(s.dtype)) for s in got]
    want = [(tuple(s.shape), jnp.dtype(s.dtype)) for s in results]
    if have != want:
        raise CustomCallError(f"{target}: the simulator computes {have}, the call declares {want}")
    return fn
