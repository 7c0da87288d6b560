"""Complex values as (real, imag) pairs of real arrays: Trainium has no complex dtype.

Inside a lowered graph, a complex64 (or complex128, computed as complex64 like float64 as float32) value
is a float32 jax array with one more trailing dim of size 2 holding (real, imag): exactly the layout of
``torch.view_as_real``. So ``view_as_real``/``view_as_complex`` cost nothing, complex graph inputs and
outputs cross the boundary as ``torch.view_as_real`` views (runtime/executor.py), and the StableHLO holds
only real ops, which is all the legality pass and neuronx-cc see.

A node with a complex input or output (from its ``meta["val"]``) is lowered by its record's pair lowering
instead of the real one (``dispatch.resolve``), or refused with the op, its dtypes and the user's line. A pair lowering gets complex operands
wrapped as ``Pair`` (real operands unwrapped) and returns ``Pair`` values (or real arrays for real
results such as ``abs``).

Ops that act on real and imaginary parts independently (views, slicing, indexing, cat, sums, where,
scatters...) are lowered ``by_parts``: the op's own real lowering runs on the real part and on the imaginary
part (seeing a real-dtype copy of the node's output metadata) and the results are paired again. The
arithmetic that mixes the parts (cmul, cdiv, cexp, cabs...) is written once below.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .reductions import norm_of_magnitudes
from .registry import LOWERINGS, RECORDS, NodeContext, Unsupported, current, lowering_context, register_complex_pair
from .semantics import Promotion, is_array, jax_dtype, register_pointwise

aten = torch.ops.aten

#: The dtypes carried as pairs (complex32 is refused: the device's float16 pairs would round differently).
PAIR_DTYPES = (torch.complex64, torch.complex128)
#: The element type of every pair array (complex128 is computed as complex64, as float64 as float32).
PAIR_ELEMENT = jnp.float32

REFUSAL = (
    "no lowering for complex operands: Trainium has no complex dtype, so complex values are computed as "
    "(real, imag) pairs of real arrays and this op has no pair lowering; compute it on "
    "torch.view_as_real(x) (real arithmetic on the pair), or outside the compiled region"
)


def supported_complex_ops() -> list[str]:
    """Names of every aten overload with a pair lowering (complex operands), sorted."""
    return sorted(str(op) for op, record in RECORDS.items() if record.complex_pair is not None)


# -- what the interpreter asks ------------------------------------------------------------------------
def is_pair_dtype(dtype: Any) -> bool:
    return isinstance(dtype, torch.dtype) and dtype.is_complex


def device_struct(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[tuple[int, ...], Any]:
    """(shape, jax dtype) of the array that carries a torch tensor of ``shape`` and ``dtype``."""
    if is_pair_dtype(dtype):
        if dtype not in PAIR_DTYPES:
            raise Unsupported(f"dtype {dtype} is not supported by the Neuron compiler")
        return tuple(shape) + (2,), PAIR_ELEMENT
    return tuple(shape), jax_dtype(dtype)


def _tensors(val: Any) -> list[torch.Tensor]:
    vals = val if isinstance(val, (tuple, list)) else [val]
    return [t for t in vals if isinstance(t, torch.Tensor)]


def _is_complex_node_value(n: Any) -> bool:
    return isinstance(n, torch.fx.Node) and any(t.is_complex() for t in _tensors(n.meta.get("val")))


def is_complex_node(node: torch.fx.Node) -> bool:
    """Whether ``node`` has a complex input or output: it is lowered on pairs, or refused."""
    return _is_complex_node_value(node) or any(_is_complex_node_value(a) for a in node.all_input_nodes)


def on_plain_arrays(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A pair lowering as the interpreter calls it: taking and returning plain jax arrays."""
    return functools.partial(_call_on_pairs, fn)


@dataclasses.dataclass(frozen=True)
class Pair:
    """A complex value: ``v`` is a float array of shape ``shape + (2,)`` holding (real, imag)."""

    v: Any

    @property
    def re(self) -> Any:
        return self.v[..., 0]

    @property
    def im(self) -> Any:
        return self.v[..., 1]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.v.shape[:-1])

    @property
    def ndim(self) -> int:
        return self.v.ndim - 1


def _wrap(fx_arg: Any, value: Any) -> Any:
    if isinstance(fx_arg, torch.fx.Node):
        return Pair(value) if _is_complex_node_value(fx_arg) and is_array(value) else value
    if isinstance(fx_arg, (list, tuple)):
        return type(fx_arg)(_wrap(a, v) for a, v in zip(fx_arg, value))
    return value


def _unwrap(value: Any) -> Any:
    if isinstance(value, Pair):
        return value.v
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v) for v in value)
    return value


def _call_on_pairs(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    node = current().node
    args = _wrap(tuple(node.args), args)
    kwargs = {k: _wrap(node.kwargs.get(k), v) for k, v in kwargs.items()}
    return _unwrap(fn(*args, **kwargs))


# -- the arithmetic, once ---------------------------------------------------------------------------
def pack(re: Any, im: Any) -> Pair:
    re, im = jnp.broadcast_arrays(jnp.asarray(re, PAIR_ELEMENT), jnp.asarray(im, PAIR_ELEMENT))
    return Pair(jnp.stack([re, im], axis=-1))


def as_pair(x: Any) -> Pair:
    """A complex operand as a pair: real arrays and Python numbers get a zero imaginary part."""
    if isinstance(x, Pair):
        return x
    if isinstance(x, complex):
        return pack(x.real, x.imag)
    if isinstance(x, (bool, int, float)):
        return pack(float(x), 0.0)
    x = jnp.asarray(x).astype(PAIR_ELEMENT)
    return pack(x, jnp.zeros_like(x))


def _f(value: float) -> Any:
    # A typed constant: under jax x64 a Python float given to jnp.where becomes a float64 constant.
    return jnp.asarray(value, PAIR_ELEMENT)


def _is_real(x: Any) -> bool:
    return not isinstance(x, (Pair, complex))


def _real_scalar_or_array(x: Any) -> Any:
    return x if isinstance(x, (bool, int, float)) else jnp.asarray(x).astype(PAIR_ELEMENT)


def cadd(a: Any, b: Any, alpha: Any = 1) -> Pair:
    a, b = as_pair(a), as_pair(b)
    if alpha != 1:
        b = cmul(b, alpha)
    return pack(a.re + b.re, a.im + b.im)


def cmul(a: Any, b: Any) -> Pair:
    if _is_real(a):  # a real factor scales both parts: no cross terms to compute
        a, b = b, a
    if _is_real(b):
        a, s = as_pair(a), _real_scalar_or_array(b)
        return pack(a.re * s, a.im * s)
    a, b = as_pair(a), as_pair(b)
    return pack(a.re * b.re - a.im * b.im, a.re * b.im + a.im * b.re)


def cabs2(a: Pair) -> Any:
    return a.re * a.re + a.im * a.im


def cabs(a: Pair) -> Any:
    # hypot's scaling: |z| of parts near the float32 limit must not overflow, as torch's abs does not.
    return jnp.hypot(a.re, a.im)


def conj(a: Pair) -> Pair:
    return pack(a.re, -a.im)


def cdiv(a: Any, b: Any) -> Pair:
    if _is_real(b):
        a, s = as_pair(a), _real_scalar_or_array(b)
        return pack(a.re / s, a.im / s)
    a, b = as_pair(a), as_pair(b)
    # Smith's algorithm (eager's c10::complex division): divide through by the larger part of b, so that
    # |b|^2 is never formed and cannot overflow or underflow. b == 0 gives inf/nan, as in eager.
    big_re = jnp.abs(b.re) >= jnp.abs(b.im)
    num = jnp.where(big_re, b.im, b.re)
    den = jnp.where(big_re, b.re, b.im)
    r = num / jnp.where(den == 0, _f(1.0), den)
    d = den + num * r
    re = jnp.where(big_re, a.re + a.im * r, a.re * r + a.im) / d
    im = jnp.where(big_re, a.im - a.re * r, a.im * r - a.re) / d
    return pack(re, im)


def cexp(a: Pair) -> Pair:
    m = jnp.exp(a.re)
    return pack(m * jnp.cos(a.im), m * jnp.sin(a.im))


def angle(a: Pair) -> Any:
    return jnp.arctan2(a.im, a.re)


def sgn(a: Pair) -> Pair:
    r = cabs(a)
    nonzero = r != 0
    safe = jnp.where(nonzero, r, _f(1.0))
    return pack(jnp.where(nonzero, a.re / safe, _f(0.0)), jnp.where(nonzero, a.im / safe, _f(0.0)))


def cmatmul(a: Pair, b: Pair, dims: Any) -> Pair:
    """``lax.dot_general`` on pairs: four real dots, exact to float32 (Gauss's three-dot trick is not)."""

    def dot(x: Any, y: Any) -> Any:
        return lax.dot_general(x, y, dims, precision=lax.Precision.HIGHEST, preferred_element_type=PAIR_ELEMENT)

    return pack(dot(a.re, b.re) - dot(a.im, b.im), dot(a.re, b.im) + dot(a.im, b.re))


# -- ops lowered on each part with their own real lowering ------------------------------------------
class _RealPartContext(NodeContext):
    """The node's context as its real lowering sees it when run on one part: complex outputs read as
    their real dtype (same shape and strides)."""

    @property
    def out(self) -> Any:
        return _real_meta(self.node.meta.get("val"))


def _real_meta(val: Any) -> Any:
    if isinstance(val, torch.Tensor) and val.is_complex():
        return torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype.to_real(), device="meta")
    if isinstance(val, (tuple, list)):
        return type(val)(_real_meta(v) for v in val)
    return val


def _part(x: Any, k: int) -> Any:
    if isinstance(x, Pair):
        return x.v[..., k]
    if isinstance(x, complex):
        return x.imag if k else x.real
    if isinstance(x, (list, tuple)):
        return type(x)(_part(v, k) for v in x)
    if is_array(x) and jnp.issubdtype(x.dtype, jnp.floating):  # real data promoted to complex
        return jnp.zeros_like(x, PAIR_ELEMENT) if k else x.astype(PAIR_ELEMENT)
    return x  # indices, masks, dims, sizes: the same for both parts


def _repair(re: Any, im: Any) -> Any:
    if isinstance(re, (list, tuple)):
        return type(re)(_repair(r, i) for r, i in zip(re, im))
    if is_array(re):
        return pack(re, im)
    return re


def by_parts(*args: Any, **kwargs: Any) -> Any:
    """Run the node's real lowering on the real part and on the imaginary part, then pair the results."""
    ctx = current()
    real = LOWERINGS.get(ctx.node.target)
    if real is None:
        raise Unsupported(REFUSAL)
    fields = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)}
    with lowering_context(_RealPartContext(**fields)):
        re = real(*_part(args, 0), **_part(kwargs, 0))
        im = real(*_part(args, 1), **_part(kwargs, 1))
    return _repair(re, im)


_BY_PARTS = [
    # views and layout
    aten.view.default, aten._unsafe_view, aten.reshape, aten.view_copy.default, aten.permute, aten.permute_copy,
    aten.t, aten.t_copy, aten.transpose.int, aten.transpose_copy.int, aten.expand, aten.expand_copy,
    aten.unsqueeze, aten.unsqueeze_copy, aten.squeeze, aten.squeeze_copy, aten.slice.Tensor,
    aten.slice_copy.Tensor, aten.select.int, aten.select_copy.int, aten.split.Tensor, aten.split_with_sizes,
    aten.unbind.int, aten.flip, aten.roll, aten.diagonal, aten.as_strided, aten.repeat, aten.alias,
    aten.clone, aten.detach, aten.lift_fresh_copy, aten.contiguous, aten.copy, aten.cat, aten.stack,
    aten.narrow, aten.unfold, aten.tril, aten.triu,
    # indexing and scatters
    aten.index.Tensor, aten.index_select, aten.gather, aten.slice_scatter, aten.select_scatter,
    aten.index_put, aten.diagonal_scatter, aten.where.self,
    # linear reductions
    aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.cumsum,
    # more data movement (a real scalar argument would be applied to both parts: only ops without one)
    aten.scatter.src, aten.scatter_add, aten.take, aten.put, aten.masked_scatter, aten.narrow_copy,
    aten.unbind_copy.int, aten.as_strided_copy, aten.as_strided_scatter, aten.index_add, aten.index_copy,
    aten.reflection_pad1d, aten.reflection_pad2d, aten.reflection_pad3d, aten.replication_pad1d,
    aten.replication_pad2d, aten.replication_pad3d, aten.reflection_pad1d_backward,
    aten.reflection_pad2d_backward, aten.reflection_pad3d_backward, aten.replication_pad1d_backward,
    aten.replication_pad2d_backward, aten.replication_pad3d_backward,
]  # fmt: skip
register_complex_pair(*_BY_PARTS)(by_parts)


# -- between complex and real -----------------------------------------------------------------------
@register_complex_pair(aten.view_as_complex)
def view_as_complex(x: Any) -> Pair:
    return Pair(x.astype(PAIR_ELEMENT))


@register_complex_pair(aten.view_as_real)
def view_as_real(x: Pair) -> Any:
    return x.v


@register_complex_pair(aten.real)
def real(x: Pair) -> Any:
    return x.re


@register_complex_pair(aten.imag)
def imag(x: Pair) -> Any:
    return x.im


@register_complex_pair(aten.complex)
def complex_(re: Any, im: Any) -> Pair:
    return pack(re, im)


@register_complex_pair(aten.polar)
def polar(r: Any, theta: Any) -> Pair:
    return pack(r * jnp.cos(theta), r * jnp.sin(theta))


@register_complex_pair(aten._to_copy)
def to_copy(x: Any, *, dtype: Any = None, **_: Any) -> Any:
    out = current().out
    if out.is_complex():
        return as_pair(x)  # real -> complex: zero imaginary part; complex64 <-> complex128: the same pair
    if out.dtype == torch.bool:  # true where nonzero, the imaginary part included
        return _nonzero(x)
    # complex -> real: torch keeps the real part (and warns that the imaginary part is discarded).
    return x.re.astype(jax_dtype(out.dtype))


# -- arithmetic ---------------------------------------------------------------------------------------
@register_complex_pair(aten.add.Tensor, aten.add.Scalar)
def add(a: Any, b: Any, *, alpha: Any = 1) -> Pair:
    return cadd(a, b, alpha)


@register_complex_pair(aten.sub.Tensor, aten.sub.Scalar)
def sub(a: Any, b: Any, *, alpha: Any = 1) -> Pair:
    return cadd(a, _negate(b), alpha)


@register_complex_pair(aten.rsub.Tensor, aten.rsub.Scalar)
def rsub(a: Any, b: Any, *, alpha: Any = 1) -> Pair:
    return cadd(b, _negate(a), alpha)


def _negate(x: Any) -> Any:
    return Pair(-x.v) if isinstance(x, Pair) else -x


@register_complex_pair(aten.mul.Tensor, aten.mul.Scalar)
def mul(a: Any, b: Any) -> Pair:
    return cmul(a, b)


@register_complex_pair(aten.div.Tensor, aten.div.Scalar)
def div(a: Any, b: Any) -> Pair:
    return cdiv(a, b)


@register_complex_pair(aten.addcmul)
def addcmul(a: Any, t1: Any, t2: Any, *, value: Any = 1) -> Pair:
    """``self + value * tensor1 * tensor2`` in eager's order (kept whole: decompositions.KEEP_WHOLE)."""
    return cadd(a, cmul(cmul(value, t1), t2))


@register_complex_pair(aten.addcdiv)
def addcdiv(a: Any, t1: Any, t2: Any, *, value: Any = 1) -> Pair:
    """``self + value * tensor1 / tensor2`` in eager's order (kept whole: decompositions.KEEP_WHOLE)."""
    return cadd(a, cdiv(cmul(value, t1), t2))


@register_complex_pair(aten.reciprocal)
def reciprocal(a: Pair) -> Pair:
    return cdiv(1.0, a)


@register_complex_pair(aten.neg)
def neg(a: Pair) -> Pair:
    return Pair(-as_pair(a).v)


@register_complex_pair(aten.conj, aten._conj, aten.conj_physical, aten._conj_physical)
def conj_(a: Pair) -> Pair:
    return conj(as_pair(a))  # a Python complex too: AOTAutograd's backward of z * (1+1j) conjugates the scalar


@register_complex_pair(aten.resolve_conj, aten.resolve_neg)
def resolve(a: Pair) -> Pair:
    return as_pair(a)  # _conj/_neg_view are computed, not lazy bits: nothing left to resolve


@register_complex_pair(aten.exp)
def exp(a: Pair) -> Pair:
    return cexp(a)


@register_complex_pair(aten.log)
def log(a: Pair) -> Pair:
    return pack(jnp.log(cabs(a)), angle(a))


@register_complex_pair(aten.pow.Tensor_Scalar)
def pow_scalar(a: Pair, exponent: Any) -> Pair:
    if not (isinstance(exponent, (int, float)) and float(exponent) in (1.0, 2.0, 3.0, 4.0)):
        raise Unsupported(f"complex pow with exponent {exponent!r}: only the integer exponents 1..4 are lowered")
    result = a
    for _ in range(int(exponent) - 1):  # repeated products, as eager computes small integer powers
        result = cmul(result, a)
    return result


@register_complex_pair(aten.abs)
def abs_(a: Pair) -> Any:
    return cabs(a)


@register_complex_pair(aten.angle)
def angle_(a: Pair) -> Any:
    return angle(a)


@register_pointwise(aten.angle, promotion=Promotion.INT_TO_FLOAT)
def angle_of_real(x: Any) -> Any:
    """The angle of a real number (no complex operand, so a lowering of the real table): pi for negative
    values, 0 otherwise (-0.0 too), NaN kept, as eager."""
    pi = jnp.asarray(np.pi, x.dtype)
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, pi, jnp.zeros_like(x)))


@register_complex_pair(aten.sgn)
def sgn_(a: Pair) -> Pair:
    return sgn(a)


@register_complex_pair(aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar)
def equal(a: Any, b: Any) -> Any:
    a, b = as_pair(a), as_pair(b)
    same = (a.re == b.re) & (a.im == b.im)
    return same if current().node.target in (aten.eq.Tensor, aten.eq.Scalar) else ~same


@register_complex_pair(aten.isnan)
def isnan(a: Pair) -> Any:
    return jnp.isnan(a.re) | jnp.isnan(a.im)


# -- matmul -------------------------------------------------------------------------------------------
@register_complex_pair(aten.mm, aten.bmm)
def mm(a: Pair, b: Pair) -> Pair:
    batch = ((0,), (0,)) if a.ndim == 3 else ((), ())
    return cmatmul(as_pair(a), as_pair(b), (((a.ndim - 1,), (b.ndim - 2,)), batch))


@register_complex_pair(aten.addmm)
def addmm(bias: Any, a: Pair, b: Pair, *, beta: Any = 1, alpha: Any = 1) -> Pair:
    return cadd(cmul(bias, beta), cmul(mm(a, b), alpha))


@register_complex_pair(aten.dot)
def dot(a: Pair, b: Pair) -> Pair:
    return cmatmul(as_pair(a), as_pair(b), (((0,), (0,)), ((), ())))


# -- creation and filling (the fill value's imaginary part is not the real one's) ------------------------
def _filled(shape: tuple[int, ...], value: Any) -> Pair:
    v = as_pair(value)
    return Pair(jnp.broadcast_to(v.v, tuple(shape) + (2,)))


@register_complex_pair(aten.full.default, aten.full_like, aten.new_full)
def full(*args: Any, **kwargs: Any) -> Pair:
    fill = args[-1] if current().node.target is not aten.full_like.default else args[1]
    return _filled(tuple(current().out.shape), fill)


@register_complex_pair(aten.scalar_tensor)
def scalar_tensor(value: Any, **_: Any) -> Pair:
    return _filled((), value)


@register_complex_pair(
    aten.zeros.default,
    aten.zeros_like,
    aten.new_zeros,
    aten.empty.memory_format,
    aten.empty_like,
    aten.new_empty,
    aten.empty_strided,
)
def zeros(*_: Any, **__: Any) -> Pair:
    return _filled(tuple(current().out.shape), 0.0)


@register_complex_pair(aten.new_empty_strided, aten.empty_permuted)
def empty_strided(*_: Any, **__: Any) -> Pair:
    return _filled(tuple(current().out.shape), 0.0)  # undefined values in eager: zeros here


@register_complex_pair(aten.ones.default, aten.ones_like, aten.new_ones)
def ones(*_: Any, **__: Any) -> Pair:
    return _filled(tuple(current().out.shape), 1.0)


@register_complex_pair(aten.fill.Scalar)
def fill(x: Pair, value: Any) -> Pair:
    return _filled(x.shape, value)


@register_complex_pair(aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar)
def where_scalar(cond: Any, a: Any, b: Any) -> Pair:
    a, b = as_pair(a), as_pair(b)
    shape = np.broadcast_shapes(tuple(cond.shape), a.shape, b.shape)
    c = jnp.broadcast_to(cond[..., None], tuple(shape) + (2,))
    return Pair(jnp.where(c, jnp.broadcast_to(a.v, c.shape), jnp.broadcast_to(b.v, c.shape)))


@register_complex_pair(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(x: Any, mask: Any, value: Any) -> Pair:
    return where_scalar(mask, value, x)


@register_complex_pair(aten.constant_pad_nd)
def constant_pad_nd(x: Pair, pad: list[int], value: Any = 0) -> Pair:
    v = as_pair(value)
    config = [(0, 0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        config[x.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1], 0)
    re = lax.pad(x.re, v.re.astype(PAIR_ELEMENT), config)
    im = lax.pad(x.im, v.im.astype(PAIR_ELEMENT), config)
    return pack(re, im)


# -- elementary functions ----------------------------------------------------------------------------
def csqrt(a: Pair) -> Pair:
    """The principal square root, without the cancellation of sqrt((|z| - re) / 2) for re >> |im|."""
    r = cabs(a)
    t = jnp.sqrt((r + jnp.abs(a.re)) * 0.5)
    safe_t = jnp.where(t == 0, _f(1.0), t)
    other = jnp.where(t == 0, _f(0.0), jnp.abs(a.im) / (2 * safe_t))  # the smaller part, from im / 2t
    re = jnp.where(a.re >= 0, t, other)
    im = jnp.where(a.re >= 0, jnp.where(t == 0, _f(0.0), a.im / (2 * safe_t)), jnp.where(a.im < 0, -t, t))
    return pack(re, im)


@register_complex_pair(aten.sqrt)
def sqrt(a: Pair) -> Pair:
    return csqrt(a)


@register_complex_pair(aten.rsqrt)
def rsqrt(a: Pair) -> Pair:
    return cdiv(1.0, csqrt(a))


@register_complex_pair(aten.sin)
def sin(a: Pair) -> Pair:
    return pack(jnp.sin(a.re) * jnp.cosh(a.im), jnp.cos(a.re) * jnp.sinh(a.im))


@register_complex_pair(aten.cos)
def cos(a: Pair) -> Pair:
    return pack(jnp.cos(a.re) * jnp.cosh(a.im), -jnp.sin(a.re) * jnp.sinh(a.im))


@register_complex_pair(aten.sinh)
def sinh(a: Pair) -> Pair:
    return pack(jnp.sinh(a.re) * jnp.cos(a.im), jnp.cosh(a.re) * jnp.sin(a.im))


@register_complex_pair(aten.cosh)
def cosh(a: Pair) -> Pair:
    return pack(jnp.cosh(a.re) * jnp.cos(a.im), jnp.sinh(a.re) * jnp.sin(a.im))


@register_complex_pair(aten.tanh)
def tanh(a: Pair) -> Pair:
    # tanh(x + iy) = (sinh 2x + i sin 2y) / (cosh 2x + cos 2y), written with t = tanh x so that large |x|
    # gives +-1 instead of inf / inf: re = t (1 + tan^2 y) / (1 + t^2 tan^2 y), im = tan y (1 - t^2) / (...)
    t, u = jnp.tanh(a.re), jnp.tan(a.im)
    d = 1 + t * t * u * u
    return pack(t * (1 + u * u) / d, u * (1 - t * t) / d)


@register_complex_pair(aten.sigmoid)
def sigmoid(a: Pair) -> Pair:
    return cdiv(1.0, cadd(1.0, cexp(Pair(-a.v))))


def _nonzero(x: Any) -> Any:
    if isinstance(x, Pair):
        return (x.re != 0) | (x.im != 0)
    if isinstance(x, complex):
        return x != 0
    return x


@register_complex_pair(
    aten.logical_not,
    aten.logical_and,
    aten.logical_or,
    aten.logical_xor,
    aten.any.default,
    aten.any.dim,
    aten.any.dims,
    aten.all.default,
    aten.all.dim,
    aten.all.dims,
)
def truthiness(*args: Any, **kwargs: Any) -> Any:
    """Logical ops see a complex value as true where it is nonzero: the real lowering on that mask."""
    return LOWERINGS[current().node.target](*(_nonzero(a) for a in args), **kwargs)


@register_complex_pair(aten.isinf)
def isinf(a: Pair) -> Any:
    return jnp.isinf(a.re) | jnp.isinf(a.im)


@register_complex_pair(aten.isfinite)
def isfinite(a: Pair) -> Any:
    return jnp.isfinite(a.re) & jnp.isfinite(a.im)


@register_complex_pair(aten.linalg_vector_norm)
def linalg_vector_norm(x: Pair, ord: Any = 2, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
    """A norm of complex values is the norm of their magnitudes (a real result)."""
    a = cabs(x)
    axes = (
        tuple(range(a.ndim))
        if dim is None or dim == []
        else tuple(d % a.ndim for d in ([dim] if isinstance(dim, int) else dim))
    )
    out = norm_of_magnitudes(a, ord, axes, keepdim)
    return out.astype(jax_dtype(current().out.dtype))


@register_complex_pair(aten.var.correction)
def var(x: Pair, *args: Any, **kwargs: Any) -> Any:
    """var(z) = E|z - E z|^2 = var(re) + var(im), each with the same correction (a real result)."""
    real = LOWERINGS[aten.var.correction]
    return real(x.re, *args, **kwargs) + real(x.im, *args, **kwargs)


@register_complex_pair(aten.var_mean.correction)
def var_mean(x: Pair, *args: Any, **kwargs: Any) -> tuple[Any, Pair]:
    real = LOWERINGS[aten.var_mean.correction]
    ctx = current()
    fields = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)}
    with lowering_context(_RealPartContext(**fields)):
        (v_re, m_re), (v_im, m_im) = real(x.re, *args, **kwargs), real(x.im, *args, **kwargs)
    return v_re + v_im, pack(m_re, m_im)
