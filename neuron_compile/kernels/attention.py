"""Flash attention forward and backward, ``q, k, v: [B, H, S, D]`` (D <= 128), causal or not, any S.

Forward (per batch and head): K^T ``[D, Sk]`` and V ``[Sk(128-tiles), D]`` are loaded once and stay in SBUF
(K transposed on the PE). For each 128-query tile, Q^T is the stationary operand; keys are processed in
blocks of up to 2048 (four 512-wide PSUM banks, reused for every block): ``S = Q K^T`` on TensorE, the
block's row max on Vector, ``m_new``/``alpha`` on GpSimd ((P,1) work off the busy engines),
``P = exp(scale*S - m_new)`` with the row sum fused on Scalar (bf16 P for bf16 inputs), P transposed on
the PE in 128x128 blocks (one PSUM tile per 512 chunk, one copy out) and ``O_blk = P V`` accumulated in
one PSUM tile over the whole block, then ``o = o*alpha + O_blk``. Causal: blocks entirely above the
diagonal are skipped, the ones crossing it are masked with ``affine_select``. Outputs ``o`` (input dtype)
and the row log-sum-exp ``lse`` (fp32, ``[B, H, Sq]``) for the backward.

Backward (per batch and head, 128x128 tiles): Q, K, V, dO stay in SBUF, natural and transposed;
``Di = rowsum(dO * O)``; for each key tile, dK and dV accumulate in PSUM over the query tiles, dQ in
an fp32 SBUF accumulator. P is recomputed from ``lse``.
"""

from __future__ import annotations

import math
from typing import Any

from .nki_api import isa as nisa
from .nki_api import jit
from .nki_api import language as nl
from ._common import P, dtype_of, psum, sbuf, tiles

F32 = "float32"
KV_BLOCK = 2048
CHUNK = 512
NEG = float("-inf")
MAX_SEQ = 16384


def _load_transposed(dst_t: Any, src_hbm: Any, s: int, d: int, dt: str, natural: Any = None) -> None:
    """dst_t[D, S] = src_hbm[S, D].T, 128 rows at a time through the PE; optionally keep natural tiles."""
    tp = psum((P, P), dt, "ld_transpose")
    for t, (s0, ss) in enumerate(tiles(s)):
        if natural is not None:
            tile = natural[:, t, :]
        else:
            tile = sbuf((P, d), dt, "ld_rows")
        nisa.dma_copy(tile[:ss], src_hbm[s0:s0 + ss, :])
        nisa.nc_transpose(tp[:d, :ss], tile[:ss, :d])
        nisa.tensor_copy(dst_t[:d, s0:s0 + ss], tp[:d, :ss], engine=nisa.scalar_engine)


def _causal_mask(dst: Any, src: Any, rows: int, cols: int, q0: int, k0: int) -> None:
    """dst = src where key index <= query index (query on partitions, key on the free dim), else -inf."""
    nisa.affine_select(dst[:rows, :cols], pattern=[[-1, cols]], channel_multiplier=1,
                       on_true_tile=src[:rows, :cols], on_false_value=NEG, cmp_op=nl.greater_equal,
                       offset=q0 - k0)


@jit
def flash_attention_fwd_kernel(q: Any, k: Any, v: Any, causal: bool = False, scale: float | None = None) -> Any:
    """NKI kernel: ``(o, lse)`` of softmax(scale * q k^T [+ causal mask]) v."""
    b_n, h_n, sq, d = q.shape
    sk = k.shape[2]
    dt = q.dtype
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = nl.ndarray((b_n, h_n, sq, d), dt, buffer=nl.shared_hbm, name="o")
    lse = nl.ndarray((b_n, h_n, sq), F32, buffer=nl.shared_hbm, name="lse")
    nkt = -(-sk // P)
    s_banks = [psum((P, CHUNK), F32, f"s{i}") for i in range(KV_BLOCK // CHUNK)]
    for b in range(b_n):
        for h in range(h_n):
            k_t = sbuf((P, sk), dt, "kT")
            _load_transposed(k_t, k[b, h], sk, d, dt)
            v_sb = sbuf((P, nkt, d), dt, "v")
            for t, (k0, ks) in enumerate(tiles(sk)):
                nisa.dma_copy(v_sb[:ks, t, :], v[b, h, k0:k0 + ks, :])
            for q0, qs in tiles(sq):
                q_t = sbuf((P, P), dt, "qT")
                _load_transposed(q_t, q[b, h, q0:q0 + qs, :], qs, d, dt)
                o_acc = sbuf((P, d), F32, "o_acc")
                m = sbuf((P, 1), F32, "m")
                l_sum = sbuf((P, 1), F32, "l")
                nisa.memset(o_acc, 0.0)
                nisa.memset(m, NEG, engine=nisa.gpsimd_engine)
                nisa.memset(l_sum, 0.0, engine=nisa.gpsimd_engine)
                kv_end = min(sk, q0 + qs) if causal else sk
                for blk0 in range(0, kv_end, KV_BLOCK):
                    chunks = list(tiles(min(KV_BLOCK, kv_end - blk0), CHUNK))
                    cmax = sbuf((P, len(chunks)), F32, "chunk_max")
                    srcs = []
                    for c, (c0, cs) in enumerate(chunks):
                        k0 = blk0 + c0
                        s_ps = s_banks[c]
                        nisa.nc_matmul(s_ps[:qs, :cs], q_t[:d, :qs], k_t[:d, k0:k0 + cs], accumulate=False)
                        src = s_ps
                        if causal and k0 + cs - 1 > q0:
                            src = sbuf((P, CHUNK), F32, "s_masked")
                            nisa.tensor_copy(src[:qs, :cs], s_ps[:qs, :cs], engine=nisa.scalar_engine)
                            _causal_mask(src, src, qs, cs, q0, k0)
                        srcs.append(src)
                        nisa.tensor_reduce(cmax[:qs, c:c + 1], nl.maximum, src[:qs, :cs], axis=1, keepdims=True)
                    # running max in scaled units; alpha rescales what was accumulated so far
                    m_new = sbuf((P, 1), F32, "m_new")
                    nisa.tensor_reduce(m_new[:qs], nl.maximum, cmax[:qs], axis=1, keepdims=True)
                    nisa.tensor_scalar(m_new[:qs], m_new[:qs], nl.multiply, scale, op1=nl.maximum,
                                       operand1=m[:qs], engine=nisa.gpsimd_engine)
                    neg_m = sbuf((P, 1), F32, "neg_m")
                    nisa.tensor_scalar(neg_m[:qs], m_new[:qs], nl.multiply, -1.0, engine=nisa.gpsimd_engine)
                    alpha = sbuf((P, 1), F32, "alpha")
                    nisa.activation(alpha[:qs], nl.exp, m[:qs], bias=neg_m[:qs])
                    nisa.tensor_copy(m[:qs], m_new[:qs], engine=nisa.gpsimd_engine)
                    sums = sbuf((P, len(chunks)), F32, "row_sums")
                    pv = psum((P, d), F32, "pv")
                    n_pv = sum(-(-cs // P) for _, cs in chunks)
                    j = 0
                    for c, (c0, cs) in enumerate(chunks):
                        p_sb = sbuf((P, CHUNK), dt, "p")
                        nisa.activation(p_sb[:qs, :cs], nl.exp, srcs[c][:qs, :cs], bias=neg_m[:qs], scale=scale,
                                        reduce_op=nl.add, reduce_res=sums[:qs, c:c + 1])
                        p_tp = psum((P, CHUNK // P, P), dt, "pT_psum")
                        p_t = sbuf((P, CHUNK // P, P), dt, "pT")
                        sub = list(tiles(cs))
                        for i, (j0, js) in enumerate(sub):
                            nisa.nc_transpose(p_tp[:js, i, :qs], p_sb[:qs, j0:j0 + js])
                        if cs % P == 0:
                            nisa.tensor_copy(p_t[:, :len(sub), :qs], p_tp[:, :len(sub), :qs])
                        else:
                            for i, (j0, js) in enumerate(sub):
                                nisa.tensor_copy(p_t[:js, i, :qs], p_tp[:js, i, :qs])
                        for i, (j0, js) in enumerate(sub):
                            kt = (blk0 + c0 + j0) // P
                            nisa.nc_matmul(pv[:qs, :d], p_t[:js, i, :qs], v_sb[:js, kt, :], accumulate=j > 0)
                            j += 1
                    assert j == n_pv
                    blk_sum = sbuf((P, 1), F32, "blk_sum")
                    nisa.tensor_reduce(blk_sum[:qs], nl.add, sums[:qs], axis=1, keepdims=True)
                    nisa.scalar_tensor_tensor(l_sum[:qs], l_sum[:qs], nl.multiply, alpha[:qs], nl.add,
                                              blk_sum[:qs], engine=nisa.gpsimd_engine)
                    nisa.scalar_tensor_tensor(o_acc[:qs], o_acc[:qs], nl.multiply, alpha[:qs], nl.add, pv[:qs, :d])
                inv_l = sbuf((P, 1), F32, "inv_l")
                nisa.reciprocal(inv_l[:qs], l_sum[:qs])
                o_sb = sbuf((P, d), dt, "o")
                nisa.tensor_scalar(o_sb[:qs], o_acc[:qs], nl.multiply, inv_l[:qs])
                nisa.dma_copy(out[b, h, q0:q0 + qs, :], o_sb[:qs])
                lse_sb = sbuf((P, 1), F32, "lse")
                nisa.activation(lse_sb[:qs], nl.log, l_sum[:qs])
                nisa.tensor_tensor(lse_sb[:qs], lse_sb[:qs], m[:qs], nl.add)
                nisa.dma_copy(lse[b, h, q0:q0 + qs].reshape((qs, 1)), lse_sb[:qs])
            del k_t, v_sb  # tiles are scoped to the head: free them before the next head allocates
    return out, lse


@jit
def flash_attention_bwd_kernel(q: Any, k: Any, v: Any, o: Any, do: Any, lse: Any, causal: bool = False,
                               scale: float | None = None) -> Any:
    """NKI kernel: ``(dq, dk, dv)`` of :func:`flash_attention_fwd_kernel` given its ``o`` and ``lse``."""
    b_n, h_n, sq, d = q.shape
    sk = k.shape[2]
    dt = q.dtype
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    dq = nl.ndarray(q.shape, dt, buffer=nl.shared_hbm, name="dq")
    dk = nl.ndarray(k.shape, dt, buffer=nl.shared_hbm, name="dk")
    dv = nl.ndarray(v.shape, dt, buffer=nl.shared_hbm, name="dv")
    nq, nk = -(-sq // P), -(-sk // P)
    s_ps, dp_ps = psum((P, P), F32, "s"), psum((P, P), F32, "dp")
    dq_ps, dk_ps, dv_ps = psum((P, d), F32, "dq"), psum((P, d), F32, "dk"), psum((P, d), F32, "dv")
    for b in range(b_n):
        for h in range(h_n):
            q_sb, do_sb = sbuf((P, nq, d), dt, "q"), sbuf((P, nq, d), dt, "do")
            k_sb, v_sb = sbuf((P, nk, d), dt, "k"), sbuf((P, nk, d), dt, "v")
            q_t, do_t = sbuf((P, sq), dt, "qT"), sbuf((P, sq), dt, "doT")
            k_t, v_t = sbuf((P, sk), dt, "kT"), sbuf((P, sk), dt, "vT")
            _load_transposed(q_t, q[b, h], sq, d, dt, natural=q_sb)
            _load_transposed(do_t, do[b, h], sq, d, dt, natural=do_sb)
            _load_transposed(k_t, k[b, h], sk, d, dt, natural=k_sb)
            _load_transposed(v_t, v[b, h], sk, d, dt, natural=v_sb)
            neg_lse, di = sbuf((P, nq), F32, "neg_lse"), sbuf((P, nq), F32, "Di")
            dq_acc = sbuf((P, nq, d), F32, "dq_acc")
            nisa.memset(dq_acc, 0.0)
            for i, (q0, qs) in enumerate(tiles(sq)):
                nisa.dma_copy(neg_lse[:qs, i:i + 1], lse[b, h, q0:q0 + qs].reshape((qs, 1)))
                o_tile = sbuf((P, d), dt, "o")
                nisa.dma_copy(o_tile[:qs], o[b, h, q0:q0 + qs, :])
                prod = sbuf((P, d), F32, "do_o")
                nisa.tensor_tensor(prod[:qs], do_sb[:qs, i, :], o_tile[:qs], nl.multiply)
                nisa.tensor_reduce(di[:qs, i:i + 1], nl.add, prod[:qs], axis=1, keepdims=True)
            nisa.tensor_scalar(neg_lse, neg_lse, nl.multiply, -1.0)
            for j, (k0, ks) in enumerate(tiles(sk)):
                first = True
                for i, (q0, qs) in enumerate(tiles(sq)):
                    if causal and k0 > q0 + qs - 1:
                        continue
                    nisa.nc_matmul(s_ps[:qs, :ks], q_t[:d, q0:q0 + qs], k_t[:d, k0:k0 + ks], accumulate=False)
                    src = s_ps
                    if causal and k0 + ks - 1 > q0:
                        src = sbuf((P, P), F32, "s_masked")
                        nisa.tensor_copy(src[:qs, :ks], s_ps[:qs, :ks], engine=nisa.scalar_engine)
                        _causal_mask(src, src, qs, ks, q0, k0)
                    p_sb = sbuf((P, P), dt, "p")
                    nisa.activation(p_sb[:qs, :ks], nl.exp, src[:qs, :ks], bias=neg_lse[:qs, i:i + 1], scale=scale)
                    nisa.nc_matmul(dv_ps[:ks, :d], p_sb[:qs, :ks], do_sb[:qs, i, :], accumulate=not first)
                    nisa.nc_matmul(dp_ps[:qs, :ks], do_t[:d, q0:q0 + qs], v_t[:d, k0:k0 + ks], accumulate=False)
                    ds_f = sbuf((P, P), F32, "dp_minus_di")
                    nisa.tensor_scalar(ds_f[:qs, :ks], dp_ps[:qs, :ks], nl.subtract, di[:qs, i:i + 1])
                    ds = sbuf((P, P), dt, "ds")
                    nisa.tensor_tensor(ds[:qs, :ks], ds_f[:qs, :ks], p_sb[:qs, :ks], nl.multiply)
                    nisa.nc_matmul(dk_ps[:ks, :d], ds[:qs, :ks], q_sb[:qs, i, :], accumulate=not first)
                    ds_tp = psum((P, P), dt, "dsT_psum")
                    nisa.nc_transpose(ds_tp[:ks, :qs], ds[:qs, :ks])
                    ds_t = sbuf((P, P), dt, "dsT")
                    nisa.tensor_copy(ds_t[:ks, :qs], ds_tp[:ks, :qs], engine=nisa.scalar_engine)
                    nisa.nc_matmul(dq_ps[:qs, :d], ds_t[:ks, :qs], k_sb[:ks, j, :], accumulate=False)
                    nisa.tensor_tensor(dq_acc[:qs, i, :], dq_acc[:qs, i, :], dq_ps[:qs, :d], nl.add)
                    first = False
                dk_sb, dv_sb = sbuf((P, d), dt, "dk"), sbuf((P, d), dt, "dv")
                if first:  # no query attends to this key tile
                    nisa.memset(dk_sb, 0.0)
                    nisa.memset(dv_sb, 0.0)
                else:
                    nisa.tensor_scalar(dk_sb[:ks], dk_ps[:ks, :d], nl.multiply, scale)
                    nisa.tensor_copy(dv_sb[:ks], dv_ps[:ks, :d])
                nisa.dma_copy(dk[b, h, k0:k0 + ks, :], dk_sb[:ks])
                nisa.dma_copy(dv[b, h, k0:k0 + ks, :], dv_sb[:ks])
            for i, (q0, qs) in enumerate(tiles(sq)):
                dq_sb = sbuf((P, d), dt, "dq")
                nisa.tensor_scalar(dq_sb[:qs], dq_acc[:qs, i, :], nl.multiply, scale)
                nisa.dma_copy(dq[b, h, q0:q0 + qs, :], dq_sb[:qs])
            del q_sb, do_sb, k_sb, v_sb, q_t, do_t, k_t, v_t, dq_acc  # scoped to the head
    return dq, dk, dv


# ------------------------------------------------------------------------------------------- references
def _scores(q: Any, k: Any, causal: bool, scale: float | None) -> Any:
    import jax.numpy as jnp
    from jax import lax

    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    s = lax.dot_general(q, k, (((3,), (3,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32) * scale
    if causal:
        # int32 positions and a float32 -inf: the neuron target without nki compiles this body itself,
        # and under the lowering's x64 mode jnp.arange and a bare Python -inf would be 64-bit
        # (float64 does not exist on Trainium).
        shape = (q.shape[2], k.shape[2])
        keep = lax.broadcasted_iota(jnp.int32, shape, 1) <= lax.broadcasted_iota(jnp.int32, shape, 0)
        s = jnp.where(keep, s, jnp.asarray(-jnp.inf, s.dtype))
    return s, scale


def flash_attention_fwd_reference(q: Any, k: Any, v: Any, causal: bool = False, scale: float | None = None) -> Any:
    """StableHLO reference: ``(o, lse)`` with fp32 scores and softmax, ``o`` in ``q.dtype``."""
    import jax.numpy as jnp
    from jax import lax

    s, _ = _scores(q, k, causal, scale)
    m = jnp.max(s, axis=-1, keepdims=True)
    lse = m + jnp.log(jnp.sum(jnp.exp(s - m), axis=-1, keepdims=True))
    p = jnp.exp(s - lse)
    o = lax.dot_general(p.astype(v.dtype), v, (((3,), (2,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32)
    return o.astype(q.dtype), lse[..., 0]


def flash_attention_bwd_reference(q: Any, k: Any, v: Any, o: Any, do: Any, lse: Any, causal: bool = False,
                                  scale: float | None = None) -> Any:
    """StableHLO reference of the attention backward from ``o`` and ``lse``: ``(dq, dk, dv)``."""
    import jax.numpy as jnp

    s, sc = _scores(q, k, causal, scale)
    p = jnp.exp(s - lse[..., None])
    f = lambda x: x.astype(jnp.float32)
    dv = jnp.einsum("bhqk,bhqd->bhkd", p, f(do))
    dp = jnp.einsum("bhqd,bhkd->bhqk", f(do), f(v))
    di = jnp.sum(f(do) * f(o), axis=-1, keepdims=True)
    ds = p * (dp - di)
    dq = jnp.einsum("bhqk,bhkd->bhqd", ds, f(k)) * sc
    dk = jnp.einsum("bhqk,bhqd->bhkd", ds, f(q)) * sc
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _qkv_ok(q: Any, k: Any, v: Any, causal: bool) -> bool:
    if len(q.shape) != 4 or len(k.shape) != 4 or len(v.shape) != 4:
        return False
    dt = dtype_of(q)
    if dt not in ("float32", "bfloat16", "float16") or dtype_of(k) != dt or dtype_of(v) != dt:
        return False
    b, h, sq, d = q.shape
    if tuple(k.shape[:2]) != (b, h) or k.shape[3] != d or tuple(v.shape) != tuple(k.shape) or not 0 < d <= P:
        return False
    return sq <= MAX_SEQ and k.shape[2] <= MAX_SEQ and (not causal or sq == k.shape[2])


def flash_attention_fwd_supports(q: Any, k: Any, v: Any, causal: bool = False, scale: float | None = None) -> bool:
    """4-D ``[B, H, S, D]`` with D <= 128, equal dtypes, S <= MAX_SEQ; causal needs Sq == Sk."""
    return _qkv_ok(q, k, v, causal)


def flash_attention_bwd_supports(q: Any, k: Any, v: Any, o: Any, do: Any, lse: Any, causal: bool = False,
                                 scale: float | None = None) -> bool:
    return _qkv_ok(q, k, v, causal) and max(q.shape[2], k.shape[2]) <= 8192
