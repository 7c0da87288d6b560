"""Random ops: rand/randn(+_like), uniform, normal, bernoulli, exponential, randint, randperm, multinomial,
native_dropout (+backward).

Every random node draws its bits from one RngBitGenerator (RNG_DEFAULT: the only algorithm the Neuron
compiler takes; it is Philox on XLA CPU) keyed by ``registry.current().rng_seed()``, a fresh uint32[2]
per node and per call that the runtime draws from torch's default generator. So ``torch.manual_seed``
makes compiled runs reproducible, and two calls differ. The stream is not eager's (eager uses mt19937 /
Philox with its own offsets), so results match eager in distribution, not bitwise.

Bits become floats as eager does: the top ``mantissa + 1`` bits scaled by 2**-(mantissa + 1), which is
exact in the output dtype and never reaches 1.0 (a float32 uniform rounded to bfloat16 could).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .registry import Unsupported, current, register_lowering
from .semantics import broadcast, convert, in_opmath, is_float, out_dtype, out_shape
from .sorting import sort_along, top_k

aten = torch.ops.aten

# The generator state is 128 bits; the per-call seed fills half of it, a constant the rest.
_STATE_TAIL = (0x6A09E667, 0xBB67AE85)
_ALGORITHM = lax.RandomAlgorithm.RNG_DEFAULT  # the only one neuronx-cc takes (Philox on XLA CPU)


def random_bits(shape: Sequence[int]) -> Any:
    """uint32 random bits of ``shape`` for the current node (fresh per call of the graph).

    On the CPU target they are drawn as uint64 and split: XLA CPU's generator makes 64-bit words about 4x
    faster per bit than 32-bit ones (measured: 0.24 vs 0.91 ms for 344 KB). Neuron gets uint32 words, as
    neuronx-cc truncates 64-bit integers without ``--native-int64``. Same distribution, different streams."""
    ctx = current()
    seed = lax.convert_element_type(ctx.rng_seed(), jnp.uint32)
    state = jnp.concatenate([seed, jnp.asarray(_STATE_TAIL, jnp.uint32)])
    count = math.prod(shape)
    if ctx.target != "cpu" or count < 2:
        return lax.rng_bit_generator(state, tuple(shape), dtype=jnp.uint32, algorithm=_ALGORITHM)[1]
    _, words = lax.rng_bit_generator(state, ((count + 1) // 2,), dtype=jnp.uint64, algorithm=_ALGORITHM)
    return lax.bitcast_convert_type(words, jnp.uint32).reshape(-1)[:count].reshape(tuple(shape))


def _digits(dtype: Any) -> int:
    return min(jnp.finfo(dtype).nmant + 1, 24)  # float64 is computed as float32 on the device


def uniform01(bits: Any, dtype: Any) -> Any:
    """Floats in [0, 1) on the grid 2**-digits of ``dtype``, exact in ``dtype``, computed in float32."""
    digits = _digits(dtype)
    top = lax.shift_right_logical(bits, jnp.uint32(32 - digits))
    return lax.convert_element_type(top, jnp.float32) * jnp.float32(2.0**-digits)


def uniform_open(bits: Any) -> Any:
    """float32 uniforms strictly inside (0, 1), so that ``log(-log(u))`` is finite: the midpoints of a
    2**-23 grid, [2**-24, 1 - 2**-24], each exact in float32 (a 24-bit grid's last midpoint, 1 - 2**-25,
    would round to 1.0, and an infinite Gumbel key against a zero weight's -inf is NaN, which top-k takes
    for the largest: a zero-weight category drawn about once in 16 million keys)."""
    top = lax.shift_right_logical(bits, jnp.uint32(9))
    return (lax.convert_element_type(top, jnp.float32) + jnp.float32(0.5)) * jnp.float32(2.0**-23)


def _float_out() -> Any:
    dtype = out_dtype()
    if not is_float(dtype):
        raise Unsupported(f"random floats of dtype {jnp.dtype(dtype)}")
    return dtype


def _uniform(shape: Sequence[int], dtype: Any) -> Any:
    return uniform01(random_bits(shape), dtype)


def box_muller(radius_bits: Any, angle_bits: Any) -> tuple[Any, Any]:
    """Two independent float32 standard normals per pair of 32-bit words (log, sqrt, cos, sin: ops every
    target has)."""
    u1 = jnp.float32(1) - uniform01(radius_bits, jnp.float32)  # (0, 1]: log is finite
    radius = lax.sqrt(jnp.float32(-2) * lax.log(u1))
    angle = jnp.float32(2 * np.pi) * uniform01(angle_bits, jnp.float32)
    return radius * lax.cos(angle), radius * lax.sin(angle)


def _standard_normal(shape: Sequence[int]) -> Any:
    count = math.prod(shape)
    bits = random_bits((2, (count + 1) // 2))
    return jnp.concatenate(box_muller(bits[0], bits[1]))[:count].reshape(tuple(shape))


@register_lowering(aten.rand.default, aten.rand.generator, aten.rand_like)
def rand(*args, **kwargs):
    dtype = _float_out()
    return convert(_uniform(out_shape(), dtype), dtype)


@register_lowering(aten.uniform)
def uniform(x, low=0.0, high=1.0, *, generator=None):
    dtype = _float_out()
    u = _uniform(out_shape(), dtype)
    return convert(u * jnp.float32(high - low) + jnp.float32(low), dtype)


@register_lowering(aten.randn.default, aten.randn.generator, aten.randn_like)
def randn(*args, **kwargs):
    dtype = _float_out()
    return convert(_standard_normal(out_shape()), dtype)


def _normal(mean: Any, std: Any) -> Any:
    dtype = _float_out()
    z = _standard_normal(out_shape())
    mean, std = (convert(v, jnp.float32) for v in (mean, std))
    z, mean, std = broadcast(z, mean, std)
    return convert(z * std + mean, dtype)


@register_lowering(aten.normal_functional)
def normal_functional(x, mean=0.0, std=1.0, *, generator=None):
    return _normal(mean, std)


@register_lowering(aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor)
def normal(mean, std=1.0, *, generator=None):
    return _normal(mean, std)


@register_lowering(aten.normal.float_float)
def normal_float_float(mean, std, size, **kwargs):
    return _normal(mean, std)


@register_lowering(aten.exponential)
def exponential(x, lambd=1.0, *, generator=None):
    dtype = _float_out()
    u = _uniform(out_shape(), jnp.float32)
    return convert(-lax.log1p(-u) / jnp.float32(lambd), dtype)


def _bernoulli(p: Any) -> Any:
    u = _uniform(out_shape(), jnp.float32)
    u, p = broadcast(u, convert(p, jnp.float32))
    return convert(u < p, out_dtype())


@register_lowering(aten.bernoulli.default, aten.bernoulli.Tensor)
def bernoulli(x, p=None, *, generator=None):
    return _bernoulli(x if p is None else p)


@register_lowering(aten.bernoulli.p)
def bernoulli_p(x, p=0.5, *, generator=None):
    return _bernoulli(p)


def _randint(low: int, high: int) -> Any:
    span = int(high) - int(low)
    if span <= 0:
        raise Unsupported(f"randint with empty range [{low}, {high})")
    shape = out_shape()
    # As eager: 32 random bits modulo the span when it fits, 64 bits otherwise.
    if span <= 2**32:
        r = convert(random_bits(shape), jnp.uint64) % jnp.uint64(span)
    else:
        bits = convert(random_bits((2, *shape)), jnp.uint64)
        r = (lax.shift_left(bits[0], jnp.uint64(32)) | bits[1]) % jnp.uint64(span)
    return convert(convert(r, jnp.int64) + jnp.int64(low), out_dtype())


@register_lowering(aten.randint.default, aten.randint.generator)
def randint(high, size, **kwargs):
    return _randint(0, high)


@register_lowering(aten.randint.low, aten.randint.low_generator)
def randint_low(low, high, size, **kwargs):
    return _randint(low, high)


@register_lowering(aten.randint_like.default, aten.randint_like.generator)
def randint_like(x, high, **kwargs):
    return _randint(0, high)


@register_lowering(aten.randint_like.low_dtype, aten.randint_like.low_generator_dtype)
def randint_like_low(x, low, high, **kwargs):
    return _randint(low, high)


@register_lowering(aten.randperm.default, aten.randperm.generator)
def randperm(n, **kwargs):
    # Positions sorted by random keys: always a permutation; equal keys (rare) keep their order.
    keys = convert(random_bits((n,)), jnp.int64)
    _, perm = sort_along(keys, 0)
    return convert(perm, out_dtype())


@register_lowering(aten.multinomial)
def multinomial(probs, num_samples, replacement=False, *, generator=None):
    """Gumbel-max: ``argmax_k(log w_k + G_k)`` with i.i.d. standard Gumbel ``G`` is category k with probability
    ``w_k / sum(w)``, and the ``n`` largest of one such set of keys are ``n`` draws without replacement, in
    draw order (each next one in proportion to the weights left): eager's own method without replacement
    (``topk(w / Exponential(1))``, the same keys exponentiated). With replacement each sample gets a set of
    keys of its own. Zero weights are drawn only once no other is left (without replacement), as in eager.
    Eager's refusal of negative, non-finite or all-zero weights is raised after the graph (value_checks)."""
    k = probs.shape[-1]
    n = int(num_samples)
    if not replacement and n > k:
        raise Unsupported(f"multinomial of {n} samples without replacement from {k} categories")
    log_w = jnp.log(convert(probs, jnp.float32))
    key_shape = (*probs.shape[:-1], n, k) if replacement else probs.shape
    gumbel = -jnp.log(-jnp.log(uniform_open(random_bits(key_shape))))
    keys = (jnp.expand_dims(log_w, -2) if replacement else log_w) + gumbel
    # a top-k, not an argmax: neuronx-cc takes no variadic (value, index) reduce
    _, drawn = top_k(keys, 1 if replacement else n, keys.ndim - 1)
    return convert(drawn[..., 0] if replacement else drawn, out_dtype())


@register_lowering(aten.native_dropout)
def native_dropout(x, p, train):
    if train is False:
        return x, jnp.ones(x.shape, jnp.bool_)
    keep = 1.0 - float(p)
    scale = 0.0 if keep == 0 else 1.0 / keep
    mask = _uniform(x.shape, jnp.float32) < jnp.float32(keep)
    # As eager: input * mask * scale, rounded once (so inf * dropped = nan, as in eager).
    out = in_opmath(lambda v, m: v * m * jnp.asarray(scale, v.dtype), x, mask)
    return out, mask


@register_lowering(aten.native_dropout_backward)
def native_dropout_backward(grad, mask, scale):
    return in_opmath(lambda g, m: g * m * jnp.asarray(scale, g.dtype), grad, mask)
