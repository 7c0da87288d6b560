"""flex_attention and its backward, the higher-order ops ``torch.ops.higher_order.flex_attention`` and
``flex_attention_backward``, as AOTAutograd hands them over: query, key and value; the ``score_mod`` graph
(for the backward also the joint graph AOTAutograd made of it); the block mask as a tuple whose last entry is
the ``mask_mod`` graph; and the tensors each mod captures.

The math is eager's, what ``flex_attention`` runs without a compiler (torch's ``math_attention`` and
``sdpa_dense_backward``): scores in float32, ``score_mod`` and ``mask_mod`` applied at every (batch, head,
query, key) by ``jax.vmap`` (eager vmaps them the same way), a safe softmax (a query whose every key is masked
gets zeros and a logsumexp of -inf), the probabilities rounded to the input dtype before they meet ``value``.
The mods' graphs were traced for the input dtype; they are re-traced with a float32 score and gradient,
because eager runs them on the float32 scores. An op in a mod that cannot be lowered is reported with its
own line, said to be in the mod.

Block sparsity: when the ``mask_mod`` captures no tensors, it is evaluated at compile time (by torch, on the
index grid) and every (query block, key block) pair it masks entirely is left out: each run of query blocks
that keep the same key blocks is one attention over those keys only, forward and backward. The BlockMask's
block tables are graph inputs (values, unknown when compiling) and, as in eager's math, not consulted: the
``mask_mod`` decides. A ``mask_mod`` that captures tensors (document ids) is applied densely.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import torch
from jax import lax

from .registry import Unsupported, current, register_higher_order, register_library_op
from .semantics import convert, jax_dtype, out_dtype

_LN2 = math.log(2.0)
_F32 = jnp.float32


def _f32(value: float) -> Any:
    """A float32 scalar (a bare Python float would be float64 under the interpreter's x64 mode)."""
    return jnp.asarray(value, _F32)


_NEG_INF = -math.inf
#: The mask_mod is evaluated at compile time (to skip masked blocks) up to this many elements; a larger
#: (batch x head x query x key) grid is masked densely. Batch and head count only when the mask_mod uses them.
MASK_EVALUATION_LIMIT = 1 << 27
#: At most this many groups of query rows (each its own code: compile time grows with their number).
MAX_ROW_GROUPS = 8


# ---- the mods: re-traced in float32, applied over the (b, h, q, k) grid --------------------------------------
def _in_float32(gm: torch.fx.GraphModule, float_inputs: tuple[int, ...]) -> torch.fx.GraphModule:
    """``gm`` re-traced with its placeholders at ``float_inputs`` (the score, the score's gradient) in float32
    where they were 16-bit, returning a tuple; the nodes keep their source lines."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    examples = []
    with unset_fake_temporarily():
        for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                examples.append(val)
                continue
            low = val.dtype in (torch.bfloat16, torch.float16)
            examples.append(
                torch.zeros(tuple(val.shape), dtype=torch.float32 if i in float_inputs and low else val.dtype)
            )

        def as_tuple(*args: Any) -> tuple:
            out = torch.fx.Interpreter(gm).run(*args)
            return tuple(out) if isinstance(out, (tuple, list)) else (out,)

        with fx_traceback.preserve_node_meta():
            return make_fx(as_tuple, tracing_mode="fake")(*examples)


class _Refused(Exception):
    """A mod's graph has ops that cannot be lowered (already in the graph's error)."""


#: How an argument of a mod varies over the (b, h, q, k) grid: with all four (an array [B, H, Q, K]), with one
#: (an index vector), or not at all (a captured tensor).
_GRID = "bhqk"


def _over_grid(graph: torch.fx.GraphModule, where: str, args: Sequence[Any], varies: Sequence[str],
               outputs: Sequence[int], batched: Sequence[bool]) -> list[Any]:  # fmt: skip
    """``graph``'s outputs ``outputs`` at every point of the (b, h, q, k) grid, as eager's ``_vmap_for_bhqkv``:
    ``varies[i]`` is "bhqk", one of "b", "h", "q", "k", or "" for argument ``i``. An output not ``batched`` is
    one value for the whole grid (a captured tensor's gradient, which zeros_and_scatter sums)."""
    run = current().run_subgraph

    def at_point(*point_args: Any) -> tuple:
        values = run(graph, list(point_args), where)
        if values is None:
            raise _Refused
        return tuple(values[j] for j in outputs)

    fn = at_point
    out_axes = tuple(0 if b else None for b in batched)
    for axis in reversed(_GRID):  # the innermost vmap is over k, the outermost over b
        in_axes = [0 if v == _GRID or v == axis else None for v in varies]
        fn = jax.vmap(fn, in_axes=in_axes, out_axes=out_axes)
    try:
        return list(fn(*args))
    except _Refused:
        raise Unsupported(f"its {where} has ops that cannot be lowered (listed with '(in {where})')") from None
    except ValueError as e:
        if "out_axes" not in str(e) and "mapped output" not in str(e):
            raise
        raise Unsupported(
            f"the gradient of a tensor its {where} captures varies over (batch, head, query, key); eager's "
            "flex_attention refuses it too: only a captured tensor the score_mod indexes (bias[h], table[q - k]) "
            "gets a gradient"
        ) from None


@dataclass
class _Mods:
    """The score_mod, its joint graph (backward) and the mask_mod of one flex_attention node, with what they
    capture."""

    score: torch.fx.GraphModule
    joint: torch.fx.GraphModule | None
    mask: torch.fx.GraphModule
    score_buffers: tuple
    mask_buffers: tuple
    batch: int
    heads: int

    def grid(self, rows: Any, keys: Any) -> list[Any]:
        return [jnp.arange(self.batch, dtype=jnp.int32), jnp.arange(self.heads, dtype=jnp.int32), rows, keys]

    def scores(self, scores: Any, rows: Any, keys: Any, keep: Any) -> Any:
        """``score_mod`` applied to ``scores`` [B, H, rows, keys], -inf where ``keep`` (the mask) is False."""
        n = len(self.score_buffers)
        (modded,) = _over_grid(self.score, "score_mod", [scores, *self.grid(rows, keys), *self.score_buffers],
                               [_GRID, *_GRID, *[""] * n], [0], [True])  # fmt: skip
        return jnp.where(keep, convert(modded, _F32), _f32(_NEG_INF))

    def keep(self, rows: Any, keys: Any) -> Any:
        """``mask_mod`` at every point: [B, H, rows, keys] booleans."""
        n = len(self.mask_buffers)
        (keep,) = _over_grid(self.mask, "mask_mod", [*self.grid(rows, keys), *self.mask_buffers],
                             [*_GRID, *[""] * n], [0], [True])  # fmt: skip
        shape = (self.batch, self.heads, rows.shape[0], keys.shape[0])
        return jnp.broadcast_to(convert(keep, jnp.bool_), shape)

    def score_grads(self, scores: Any, grad: Any, rows: Any, keys: Any, wanted: Sequence[bool]) -> tuple[Any, list]:
        """The joint graph at every point: the gradient of the scores, and the summed gradients of the captured
        tensors ``wanted`` (the others are None)."""
        n = len(self.score_buffers)
        picks = [5 + i for i, w in enumerate(wanted) if w]
        grads = _over_grid(self.joint, "score_mod", [scores, *self.grid(rows, keys), grad, *self.score_buffers],
                           [_GRID, *_GRID, _GRID, *[""] * n], [0, *picks], [True, *[False] * len(picks)])  # fmt: skip
        it = iter(grads[1:])
        return convert(grads[0], _F32), [convert(next(it), _F32) if w else None for w in wanted]


# ---- block sparsity: which key positions each run of query rows attends to -----------------------------------
@dataclass(frozen=True)
class RowGroup:
    """Query rows ``rows`` [start, stop) attend to the key positions in ``keys`` (runs [start, stop));
    no runs: every key is masked for these rows."""

    rows: tuple[int, int]
    keys: tuple[tuple[int, int], ...]


def _kept_blocks(mask: torch.fx.GraphModule, batch: int, heads: int, q_len: int, kv_len: int,
                 q_block: int, kv_block: int) -> list[list[bool]] | None:  # fmt: skip
    """[query blocks, key blocks]: whether ``mask`` keeps any element of the pair, for any batch and head
    (torch evaluates it, as eager does), or None when the grid is too large to evaluate or evaluation fails."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.nn.attention.flex_attention import _vmap_for_bhqkv

    b_node, h_node = [n for n in mask.graph.nodes if n.op == "placeholder"][:2]
    sizes = (batch if b_node.users else 1, heads if h_node.users else 1, q_len, kv_len)
    if math.prod(sizes) > MASK_EVALUATION_LIMIT:
        return None
    q_blocks, kv_blocks = -(-q_len // q_block), -(-kv_len // kv_block)
    with unset_fake_temporarily(), torch.no_grad():  # the compile runs inside AOTAutograd's fake mode
        try:
            with TransformGetItemToIndex():
                keep = _vmap_for_bhqkv(mask, prefix=())(*(torch.arange(s, dtype=torch.int32) for s in sizes))
        except Exception:  # a mod that needs the real graph inputs: masked densely instead
            return None
        padded = torch.zeros(q_blocks * q_block, kv_blocks * kv_block, dtype=torch.bool)
        padded[:q_len, :kv_len] = torch.broadcast_to(keep.bool(), sizes).any(0).any(0)
        return padded.view(q_blocks, q_block, kv_blocks, kv_block).any(3).any(1).tolist()


def row_groups(mask: torch.fx.GraphModule, mask_buffers: tuple, batch: int, heads: int, q_len: int, kv_len: int,
               q_block: Any, kv_block: Any) -> list[RowGroup]:  # fmt: skip
    """The plan of one flex_attention: groups of query rows and the keys each attends to (every key for all
    rows, unless the mask_mod can be evaluated at compile time and masks whole blocks). At most
    ``MAX_ROW_GROUPS`` groups: each is its own code, so neighbours that waste the least are merged."""
    dense = [RowGroup((0, q_len), ((0, kv_len),))]
    if mask_buffers or not isinstance(q_block, int) or not isinstance(kv_block, int):
        return dense
    if q_block >= q_len and kv_block >= kv_len:
        return dense
    kept = _kept_blocks(mask, batch, heads, q_len, kv_len, q_block, kv_block)
    if kept is None or all(all(row) for row in kept):
        return dense
    widths = [min((j + 1) * kv_block, kv_len) - j * kv_block for j in range(len(kept[0]))]

    def cost(rows: tuple[int, int], blocks: tuple[bool, ...]) -> int:  # scores computed
        return (rows[1] - rows[0]) * sum(w for w, keep in zip(widths, blocks) if keep)

    groups: list[tuple[tuple[int, int], tuple[bool, ...]]] = []
    for i, row in enumerate(kept):
        rows = (i * q_block, min((i + 1) * q_block, q_len))
        if groups and groups[-1][1] == tuple(row):
            groups[-1] = ((groups[-1][0][0], rows[1]), groups[-1][1])
        else:
            groups.append((rows, tuple(row)))
    while len(groups) > MAX_ROW_GROUPS:
        merged = [((a[0][0], b[0][1]), tuple(x or y for x, y in zip(a[1], b[1]))) for a, b in zip(groups, groups[1:])]
        waste = [cost(*m) - cost(*a) - cost(*b) for m, a, b in zip(merged, groups, groups[1:])]
        i = waste.index(min(waste))
        groups[i : i + 2] = [merged[i]]
    return [RowGroup(rows, _runs(blocks, kv_block, kv_len)) for rows, blocks in groups]


def _runs(blocks: Sequence[bool], kv_block: int, kv_len: int) -> tuple[tuple[int, int], ...]:
    """The key positions of the kept ``blocks``, as runs [start, stop)."""
    runs: list[tuple[int, int]] = []
    for j, keep in enumerate(blocks):
        stop = min((j + 1) * kv_block, kv_len)
        if keep and runs and runs[-1][1] == j * kv_block:
            runs[-1] = (runs[-1][0], stop)
        elif keep:
            runs.append((j * kv_block, stop))
    return tuple(runs)


def _take(x: Any, runs: Sequence[tuple[int, int]], axis: int) -> Any:
    """The positions ``runs`` of ``x`` along ``axis``, concatenated (static slices)."""
    if len(runs) == 1 and runs[0] == (0, x.shape[axis]):
        return x
    return jnp.concatenate([lax.slice_in_dim(x, a, b, axis=axis) for a, b in runs], axis=axis)


def _positions(runs: Sequence[tuple[int, int]]) -> Any:
    return jnp.concatenate([jnp.arange(a, b, dtype=jnp.int32) for a, b in runs])


def _put(piece: Any, runs: Sequence[tuple[int, int]], length: int, axis: int) -> Any:
    """``piece`` (the positions ``runs`` along ``axis``) placed in zeros of ``length`` there (pads, no scatter)."""
    parts, at = [], 0
    for a, b in runs:
        chunk = lax.slice_in_dim(piece, at, at + b - a, axis=axis)
        config = [(0, 0, 0)] * piece.ndim
        config[axis] = (a, length - b, 0)
        parts.append(lax.pad(chunk, jnp.zeros((), piece.dtype), config))
        at += b - a
    return sum(parts[1:], parts[0])


# ---- the attention itself -------------------------------------------------------------------------------------
# Every product is a [batch x kv head] batch of plain matrix products (a query head h uses kv head h // G, as
# eager's repeat_interleave of key and value): query rows of the G heads of one kv head are stacked.
def _bmm(a: Any, b: Any, contract: tuple[int, int]) -> Any:
    """``a . b`` for [N, *, *] operands, contracting dim ``contract[0]`` of ``a`` with ``contract[1]`` of ``b``,
    accumulated in float32."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((0,), (0,))), precision=lax.Precision.HIGHEST,
                           preferred_element_type=_F32)  # fmt: skip


def _stacked(x: Any, kv_heads: int) -> Any:
    """[B, Hq, rows, d] -> [B * Hkv, G * rows, d]."""
    b, h, rows, d = x.shape
    return jnp.reshape(x, (b * kv_heads, h // kv_heads * rows, d))


def _unstacked(x: Any, batch: int, heads: int) -> Any:
    """[B * Hkv, G * rows, d] -> [B, Hq, rows, d]."""
    return jnp.reshape(x, (batch, heads, x.shape[1] * x.shape[0] // (batch * heads), x.shape[2]))


def _kv(x: Any, runs: Sequence[tuple[int, int]]) -> Any:
    """The key positions ``runs`` of key/value [B, Hkv, kv, d] as [B * Hkv, keys, d]."""
    x = _take(x, runs, 2)
    return jnp.reshape(x, (x.shape[0] * x.shape[1], *x.shape[2:]))


def _rows(x: Any, rows: tuple[int, int]) -> Any:
    return lax.slice_in_dim(x, rows[0], rows[1], axis=2)


def _concat_rows(parts: list[Any]) -> Any:
    return jnp.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]


def _broadcast_batch(x: Any, batch: int) -> Any:
    return x if x.shape[0] == batch else jnp.broadcast_to(x, (batch, *x.shape[1:]))


def _setup(query: Any, key: Any, score_mod: Any, joint: Any, block_mask: tuple, score_buffers: tuple,
           mask_buffers: tuple) -> tuple[_Mods, list[RowGroup]]:  # fmt: skip
    batch, heads, q_len = query.shape[:3]
    kv_len = key.shape[2]
    if key.shape[0] not in (1, batch) or heads % key.shape[1]:
        raise Unsupported(f"flex_attention with query {list(query.shape)} and key {list(key.shape)}")
    q_block, kv_block, mask = block_mask[-3], block_mask[-2], block_mask[-1]
    mods = _Mods(
        _in_float32(score_mod, (0,)), None if joint is None else _in_float32(joint, (0, 5)), _in_float32(mask, ()),
        tuple(score_buffers), tuple(mask_buffers), batch, heads,
    )  # fmt: skip
    return mods, row_groups(mask, tuple(mask_buffers), batch, heads, q_len, kv_len, q_block, kv_block)


@register_higher_order(torch.ops.higher_order.flex_attention)
def flex_attention(query, key, value, score_mod, block_mask, scale, kernel_options,
                   score_mod_other_buffers=(), mask_mod_other_buffers=()):  # fmt: skip
    """(output, logsumexp / ln 2, row max / ln 2): the HOP's results in its own log2 units (torch's public
    function multiplies them by ln 2)."""
    mods, groups = _setup(query, key, score_mod, None, block_mask, score_mod_other_buffers, mask_mod_other_buffers)
    batch, heads = query.shape[:2]
    kv_heads = key.shape[1]
    q = convert(query, _F32)
    k = _broadcast_batch(convert(key, _F32), batch)
    v = _broadcast_batch(convert(value, query.dtype), batch)
    outs, lses, maxes = [], [], []
    for group in groups:
        count = group.rows[1] - group.rows[0]
        if not group.keys:  # every key masked for these rows: eager's safe softmax gives zeros, -inf statistics
            outs.append(jnp.zeros((batch, heads, count, value.shape[-1]), _F32))
            lses.append(jnp.full((batch, heads, count), _NEG_INF, _F32))
            maxes.append(lses[-1])
            continue
        rows, keys = jnp.arange(*group.rows, dtype=jnp.int32), _positions(group.keys)
        scores = _bmm(_stacked(_rows(q, group.rows), kv_heads), _kv(k, group.keys), (2, 2))
        scores = _unstacked(scores, batch, heads) * _f32(scale)
        post = mods.scores(scores, rows, keys, mods.keep(rows, keys))
        row_max = jnp.max(post, axis=-1)
        masked_row = row_max == _f32(_NEG_INF)
        shift = jnp.where(masked_row, _f32(0), row_max)
        exps = jnp.exp(post - shift[..., None])
        total = jnp.sum(exps, axis=-1)
        probs = jnp.where(masked_row[..., None], _f32(0), exps / jnp.where(masked_row, _f32(1), total)[..., None])
        probs = _stacked(convert(probs, query.dtype), kv_heads)
        outs.append(_unstacked(_bmm(probs, _kv(v, group.keys), (2, 1)), batch, heads))
        lses.append(jnp.where(masked_row, _f32(_NEG_INF), shift + jnp.log(total)))
        maxes.append(row_max)
    out, lse, row_max = _concat_rows(outs), _concat_rows(lses), _concat_rows(maxes)
    return convert(out, out_dtype(0)), lse / _f32(_LN2), row_max / _f32(_LN2)


@register_higher_order(torch.ops.higher_order.flex_attention_backward)
def flex_attention_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph, joint_graph,
                            block_mask, scale, kernel_options, score_mod_other_buffers=(),
                            mask_mod_other_buffers=()):  # fmt: skip
    """(grad query, grad key, grad value, grads of the score_mod's captured tensors), as eager's
    ``sdpa_dense_backward``; ``logsumexp`` in the forward's log2 units."""
    node_out = current().out
    # The captured tensors the joint graph gives a gradient (those that require one).
    joint_out = next(n for n in joint_graph.graph.nodes if n.op == "output").args[0]
    wanted = [isinstance(g, torch.fx.Node) for g in joint_out[5:]]
    mods, groups = _setup(
        query, key, fw_graph, joint_graph, block_mask, score_mod_other_buffers, mask_mod_other_buffers
    )
    batch, heads = query.shape[:2]
    kv_batch, kv_heads, kv_len = key.shape[:3]
    q = convert(query, _F32)
    k = _broadcast_batch(convert(key, _F32), batch)
    k_in = _broadcast_batch(convert(key, query.dtype), batch)
    v = _broadcast_batch(convert(value, _F32), batch)
    d_out = jnp.zeros(out.shape, query.dtype) if grad_out is None else convert(grad_out, query.dtype)
    lse = convert(logsumexp, _F32) * _f32(_LN2)
    d_lse = None if grad_logsumexp is None else convert(grad_logsumexp, _F32) / _f32(_LN2)
    # Eager's "delta": the rowwise sum of out * grad_out, in float32.
    delta = jnp.sum(convert(out, _F32) * convert(d_out, _F32), axis=-1)
    dq_rows = []
    dk = jnp.zeros((batch, kv_heads, kv_len, key.shape[-1]), _F32)
    dv = jnp.zeros((batch, kv_heads, kv_len, value.shape[-1]), _F32)
    d_buffers: list[Any] = [None] * len(wanted)
    for group in groups:
        if not group.keys:
            dq_rows.append(jnp.zeros((batch, heads, group.rows[1] - group.rows[0], query.shape[-1]), _F32))
            continue
        rows, keys = jnp.arange(*group.rows, dtype=jnp.int32), _positions(group.keys)
        d_out_rows = _stacked(_rows(d_out, group.rows), kv_heads)
        lse_rows = _rows(lse, group.rows)
        scores = _bmm(_stacked(_rows(q, group.rows), kv_heads), _kv(k, group.keys), (2, 2))
        scores = _unstacked(scores, batch, heads) * _f32(scale)
        keep = mods.keep(rows, keys)
        post = mods.scores(scores, rows, keys, keep)
        probs = jnp.exp(post - lse_rows[..., None])
        probs = jnp.where((lse_rows == _f32(_NEG_INF))[..., None], _f32(0), probs)
        d_v = _bmm(_stacked(convert(probs, query.dtype), kv_heads), d_out_rows, (1, 1))
        d_probs = _unstacked(_bmm(convert(d_out_rows, _F32), _kv(v, group.keys), (2, 2)), batch, heads)
        d_post = d_probs - _rows(delta, group.rows)[..., None]
        if d_lse is not None:
            d_post = d_post + _rows(d_lse, group.rows)[..., None]
        d_scores, d_captured = mods.score_grads(scores, probs * d_post, rows, keys, wanted)
        d_scores = convert(d_scores * _f32(scale), query.dtype)
        d_scores = _stacked(jnp.where(keep, d_scores, jnp.zeros((), query.dtype)), kv_heads)
        dq_rows.append(_unstacked(_bmm(d_scores, _kv(k_in, group.keys), (2, 1)), batch, heads))
        q_in_rows = _stacked(_rows(query, group.rows), kv_heads)
        kv_shape = (batch, kv_heads, -1, key.shape[-1])
        dk = dk + _put(jnp.reshape(_bmm(d_scores, q_in_rows, (1, 1)), kv_shape), group.keys, kv_len, 2)
        dv = dv + _put(jnp.reshape(d_v, (batch, kv_heads, -1, value.shape[-1])), group.keys, kv_len, 2)
        d_buffers = [a if b is None else b if a is None else a + b for a, b in zip(d_buffers, d_captured)]
    dq = _concat_rows(dq_rows)
    if kv_batch != batch:  # key/value broadcast over the batch: their gradients are summed over it
        dk, dv = jnp.sum(dk, axis=0, keepdims=True), jnp.sum(dv, axis=0, keepdims=True)
    captured = []
    for grad, meta in zip(d_buffers, node_out[3]):
        if not isinstance(meta, torch.Tensor):
            captured.append(None)
        elif grad is None:  # not differentiated (AOTAutograd uses no gradient of it), or no kept score reaches it
            captured.append(jnp.zeros(tuple(meta.shape), jax_dtype(meta.dtype)))
        else:
            captured.append(convert(grad, jax_dtype(meta.dtype)))
    return convert(dq, out_dtype(0)), convert(dk, out_dtype(1)), convert(dv, out_dtype(2)), tuple(captured)


# ---- the joint graph's gradient of ``buffer[index]`` ---------------------------------------------------------
@register_library_op("flex_lib.zeros_and_scatter.default")
def zeros_and_scatter(shape, indices, vals):
    """``flex_lib::zeros_and_scatter``, the gradient of ``buffer[index]`` in a score_mod's joint graph: zeros of
    ``shape`` with ``vals`` added at ``indices``. Vmapped over the (b, h, q, k) grid its result is one tensor,
    every point's value added in (torch's batching rule for the op), not one tensor per point."""
    dtype = out_dtype()
    shape = tuple(int(s) for s in shape)

    @jax.custom_batching.custom_vmap
    def scatter(values: Any, index: list[Any]) -> Any:
        return jnp.zeros(shape, dtype).at[tuple(index)].add(convert(values, dtype), mode="drop")

    @scatter.def_vmap
    def scatter_batched(axis_size: int, in_batched: Any, values: Any, index: list[Any]) -> tuple[Any, bool]:
        values_batched, index_batched = in_batched
        if not values_batched:
            values = jnp.broadcast_to(values, (axis_size, *values.shape))
        index = [i if b else jnp.broadcast_to(i, (axis_size, *i.shape)) for i, b in zip(index, index_batched)]
        return scatter(values, [jnp.broadcast_to(i, values.shape) for i in index]), False

    return scatter(vals, list(indices))
