"""Flash attention forward and backward, ``q, k, v: [B, H, S, D]`` (D <= 128), causal or not, any S.

Forward (per batch and head): K^T and V per 2048-key block, each its own SBUF tile, loaded when a query tile
first needs it (K^T by a DMA transpose from HBM for 2-byte dtypes, through the PE for fp32); V carries a
column of ones. For each 128-query tile, Q^T is the stationary operand; per block: ``S = Q K^T`` on TensorE
into four 512-wide PSUM tiles, each chunk's row max on Vector, the block max and the new running max on
GpSimd, ``alpha`` and ``P = exp(scale*S - m_new)`` on Scalar (bf16 P for bf16 inputs), P^T by one DMA
transpose per chunk for 3 of 4 chunks (the PE plus one Vector copy for the 4th, and always for fp32), and
``[O_blk | l_blk] = P [V | 1]`` accumulated in one PSUM tile, then ``acc = acc*alpha + [O_blk | l_blk]``.
Causal: blocks past the diagonal are skipped and the diagonal 128x128 block is masked on the PE
(``identity^T @ mask`` accumulated into the score tile), longest query tiles first. Outputs ``o`` (input
dtype) and the row log-sum-exp ``lse`` (fp32, ``[B, H, Sq]``) for the backward.

Backward (per batch and head, 128x128 tiles): Q, K, V, dO stay in SBUF, natural and transposed;
``Di = rowsum(dO * O)``; key tiles in groups of ``KEY_GROUP`` whose dK and dV accumulate in PSUM over the
query tiles; for each query tile dQ sums over the group in PSUM and is added once to an fp32 SBUF
accumulator; ``dS = P*(dP - Di)`` is one Vector pass; dS^T by DMA transpose (2-byte dtypes). P is recomputed
from ``lse``.
"""

from __future__ import annotations

import math
from typing import Any

from ._common import P, dtype_of, psum, sbuf, tiles
from .nki_api import isa as nisa
from .nki_api import jit
from .nki_api import language as nl

F32 = "float32"
KV_BLOCK = 2048
CHUNK = 512
# Masked scores and the initial running max: a large finite value, never -inf (the hardware treats -inf as
# invalid input, and AWS's attention kernels and tests avoid it). Scaled by any sane softmax scale it is still
# thousands below a real score, so exp() of it is exactly 0 in fp32, as exp(-inf) would be.
NEG = -30000.0
MAX_SEQ = 16384
ROW_GROUP = 16  # 128-row tiles per bulk DMA (16 x 128 bf16 = 4 KiB per partition)
DMA_T_EVERY = 4
GPSIMD = nisa.engine.gpsimd
KEY_GROUP = 4  # backward: key tiles whose dK/dV accumulate in PSUM together (one dQ add per query tile per group)
LNC = 2  # launch degree: the two physical cores of one trn2/trn3 logical NeuronCore (LNC=2)


def _load_rows(dst: Any, src_hbm: Any, s: int) -> None:
    """dst[p, t, :] = src_hbm[t*128 + p, :] for the ``s`` rows of ``src_hbm``: the whole 128-row tiles in one
    DMA per ``ROW_GROUP`` tiles (a [P, tiles, D] access pattern, several KiB per partition, where the published
    DMA efficiency is high; a 128 x D tile alone moves only 2*D bytes per partition), the ragged tile apart."""
    full = s // P
    for t0 in range(0, full, ROW_GROUP):
        g = min(ROW_GROUP, full - t0)
        src = src_hbm[t0 * P : (t0 + g) * P, :].reshape_dim(0, (g, P)).permute((1, 0, 2))
        nisa.dma_copy(dst=dst[:, t0 : t0 + g, :], src=src)
    if s % P:
        nisa.dma_copy(dst=dst[: s % P, full, :], src=src_hbm[full * P : s, :])


def _load_transposed(dst_t: Any, src_hbm: Any, s: int, d: int, dt: str, natural: Any = None) -> None:
    """dst_t[D, S] = src_hbm[S, D].T: for 2-byte dtypes one DMA transpose from HBM (and, with ``natural``
    ([P, tiles, D]), the rows loaded in bulk beside it); fp32 (or trn1): rows loaded in bulk
    (:func:`_load_rows`), then 128 at a time through the PE."""
    if _dma_transpose_ok(dt):
        nisa.dma_transpose(dst=dst_t[:d, :s], src=src_hbm[:s, :d], axes=(1, 0))
        if natural is not None:
            _load_rows(natural, src_hbm, s)
        return
    if natural is None:
        natural = sbuf((P, -(-s // P), d), dt, "ld_rows")
    _load_rows(natural, src_hbm, s)
    for t, (s0, ss) in enumerate(tiles(s)):
        tp = psum((P, P), dt, "ld_transpose")
        nisa.nc_transpose(dst=tp[:d, :ss], data=natural[:ss, t, :d])
        nisa.tensor_copy(dst=dst_t[:d, s0 : s0 + ss], src=tp[:d, :ss], engine=nisa.engine.scalar)


def _mask_tiles(dt: str) -> tuple[Any, Any]:
    """``(identity, mask)`` [P, P] tiles in SBUF for adding the causal mask on the PE: ``mask[q, k]`` is 0 for
    k <= q and NEG above the diagonal, and ``identity^T @ mask`` accumulated into a PSUM score tile masks it
    (exp of score + NEG is exactly 0 in fp32, as exp of NEG is) without copying the scores out of PSUM."""
    ident = sbuf((P, P), dt, "identity")
    nl.shared_identity_matrix(P, dt, dst=ident)
    mask = sbuf((P, P), dt, "causal_mask")
    nisa.memset(dst=mask, value=0.0, engine=nisa.engine.gpsimd)
    _causal_mask(mask, mask, P, P, 0, 0)
    return ident, mask


def _add_causal_mask(s_ps: Any, masks: tuple[Any, Any], qs: int, col0: int) -> None:
    """s_ps[:qs, col0 : col0 + qs] += the causal mask of a diagonal block (query i, key col0 + j: kept iff j <= i)."""
    ident, mask = masks
    nisa.nc_matmul(dst=s_ps[:qs, col0 : col0 + qs], stationary=ident[:qs, :qs], moving=mask[:qs, :qs], accumulate=True)


def _causal_mask(dst: Any, src: Any, rows: int, cols: int, q0: int, k0: int) -> None:
    """dst = src where key index <= query index (query on partitions, key on the free dim), else NEG."""
    nisa.affine_select(
        dst=dst[:rows, :cols],
        pattern=[[-1, cols]],
        channel_multiplier=1,
        on_true_tile=src[:rows, :cols],
        on_false_value=NEG,
        cmp_op=nl.greater_equal,
        offset=q0 - k0,
    )


def _my_work(items: list[Any]) -> list[Any]:
    """This program's share of ``items`` under the launch grid: every n-th item, n = nl.num_programs()
    (interleaved, so causal tiles of growing cost are dealt evenly to the cores)."""
    return items[nl.program_id(axis=0) :: nl.num_programs(axes=0)]


def _attend_block(
    q_t: Any,
    chunks: Any,
    k0_block: int,
    v_sb: Any,
    qs: int,
    q0: int,
    d: int,
    dt: str,
    masks: tuple[Any, Any] | None,
    scale: float,
    state: list[Any],
) -> None:
    """Online-softmax update of one 128-query tile with one key block (up to KV_BLOCK keys; ``chunks``: the
    block's K^T as a grid of CHUNK-wide tiles, ``v_sb``: the block's V rows). ``state = [neg_m, o_acc]``: the negated running max (scaled units) and the
    fp32 accumulator ``[P, d+1]`` whose last column is the row sum ``l`` (V carries a column of ones, so the
    P V matmul sums P's rows too). S = Q K^T on TensorE into one PSUM bank per chunk; the block's row max on
    Vector; the new max on GpSimd; P = exp(scale*S - m_new) on Scalar; P^T through the PE (or, for every
    ``DMA_T_EVERY``-th chunk of 2-byte P, one DMA transpose, which spares the PE and the Vector copy);
    ``O_blk|l_blk = P [V|1]`` in PSUM over the block; ``o_acc = o_acc*alpha + O_blk|l_blk``."""
    neg_m, o_acc = state
    dma_t = _dma_transpose_ok(dt)
    n_chunks = chunks.shape[1]
    cmax = sbuf((P, n_chunks), F32, "chunk_max")
    srcs = []
    for c in range(n_chunks):
        cs = chunks[0, c].element_shape[1]
        k0 = k0_block + c * CHUNK
        s_ps = psum((P, CHUNK), F32, f"s{c}")  # one PSUM bank per chunk, fresh for each block
        nisa.nc_matmul(dst=s_ps[:qs, :cs], stationary=q_t[:d, :qs], moving=chunks[0, c].data[:d], accumulate=False)
        src = s_ps
        if masks is not None and k0 + cs - 1 > q0:  # the chunk ends with the diagonal block (kv_end = q0 + qs)
            _add_causal_mask(s_ps, masks, qs, cs - qs)
        srcs.append((src, cs))
        nisa.tensor_reduce(dst=cmax[:qs, c : c + 1], op=nl.maximum, data=src[:qs, :cs], axis=1, keepdims=True)
    # the new negated running max: min(-scale * blockmax, neg_m); alpha = exp(m_old - m_new)
    # the block max of the chunk maxima, pairwise on GpSimd (idle otherwise; Vector is the busiest engine)
    red, n = cmax, n_chunks
    while n > 1:
        half = n // 2
        pairs = sbuf((P, half), F32, "cmax_pairs")
        nisa.tensor_tensor(
            dst=pairs[:qs], data1=red[:qs, :half], data2=red[:qs, half : 2 * half], op=nl.maximum, engine=GPSIMD
        )
        if n % 2:
            nisa.tensor_tensor(
                dst=pairs[:qs, :1], data1=pairs[:qs, :1], data2=red[:qs, n - 1 : n], op=nl.maximum, engine=GPSIMD
            )
        red, n = pairs, half
    neg_m_new = sbuf((P, 1), F32, "neg_m")
    first = neg_m is None  # the tile's first block: no running max, nothing accumulated yet
    if first:
        nisa.tensor_scalar(dst=neg_m_new[:qs], data=red[:qs, :1], op0=nl.multiply, operand0=-scale, engine=GPSIMD)
    else:
        nisa.tensor_scalar(
            dst=neg_m_new[:qs],
            data=red[:qs, :1],
            op0=nl.multiply,
            operand0=-scale,
            op1=nl.minimum,
            operand1=neg_m[:qs],
            engine=GPSIMD,
        )
        alpha = sbuf((P, 1), F32, "alpha")
        nisa.activation(dst=alpha[:qs], op=nl.exp, data=neg_m[:qs], scale=-1.0, bias=neg_m_new[:qs])
    pv = psum((P, d + 1), F32, "pv")
    j = 0
    for c, (src, cs) in enumerate(srcs):
        p_sb = sbuf((P, CHUNK), dt, "p")
        nisa.activation(dst=p_sb[:qs, :cs], op=nl.exp, data=src[:qs, :cs], bias=neg_m_new[:qs], scale=scale)
        p_t = sbuf((P, CHUNK // P, P), dt, "pT")
        sub = list(tiles(cs))
        if dma_t and cs % P == 0 and (DMA_T_EVERY == 1 or c % DMA_T_EVERY != 0):
            nisa.dma_transpose(
                dst=p_t[:, : len(sub), :qs], src=p_sb[:qs, :cs].reshape_dim(1, (len(sub), P)), axes=(2, 1, 0)
            )
        else:
            p_tp = psum((P, CHUNK // P, P), dt, "pT_psum")
            for i, (j0, js) in enumerate(sub):
                nisa.nc_transpose(dst=p_tp[:js, i, :qs], data=p_sb[:qs, j0 : j0 + js])
            if cs % P == 0:
                nisa.tensor_copy(dst=p_t[:, : len(sub), :qs], src=p_tp[:, : len(sub), :qs])
            else:
                for i, (j0, js) in enumerate(sub):
                    nisa.tensor_copy(dst=p_t[:js, i, :qs], src=p_tp[:js, i, :qs])
        for i, (j0, js) in enumerate(sub):
            kt = (c * CHUNK + j0) // P
            nisa.nc_matmul(dst=pv[:qs], stationary=p_t[:js, i, :qs], moving=v_sb[:js, kt, :], accumulate=j > 0)
            j += 1
    if first:
        nisa.tensor_copy(dst=o_acc[:qs], src=pv[:qs])
    else:
        nisa.scalar_tensor_tensor(
            dst=o_acc[:qs], data=o_acc[:qs], op0=nl.multiply, operand0=alpha[:qs], op1=nl.add, operand1=pv[:qs]
        )
    state[0] = neg_m_new


def _dma_transpose_ok(dt: str) -> bool:
    """DMA transposes take 2-byte dtypes and need NeuronCore-v3 or newer."""
    return dt != F32 and nisa.get_nc_version() != nisa.nc_version.gen2


@jit
def _flash_attention_fwd(q: Any, k: Any, v: Any, causal: bool = False, scale: float | None = None) -> Any:
    """NKI kernel: ``(o, lse)`` of softmax(scale * q k^T [+ causal mask]) v. Launched as ``[LNC]``: the
    (batch, head, 128-query tile) work items are dealt to the programs of the launch; each program loads
    K^T and V once per head it has work in."""
    b_n, h_n, sq, d = q.shape
    sk = k.shape[2]
    dt = q.dtype
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = nl.ndarray((b_n, h_n, sq, d), dt, buffer=nl.shared_hbm, name="o")
    lse = nl.ndarray((b_n, h_n, sq), F32, buffer=nl.shared_hbm, name="lse")
    q_grid = nl.tiles(q, tile_shape=(P, d))  # [B, H, query tiles, 1]
    o_grid = nl.tiles(out, tile_shape=(P, d))
    mine = _my_work([(b, h, t) for b in range(b_n) for h in range(h_n) for t in range(q_grid.shape[2])])
    if causal:  # the longest query tiles first, so the last ones to finish are short
        mine.sort(key=lambda item: -item[2])
    masks = _mask_tiles(dt) if causal and mine else None
    for b, h in dict.fromkeys((b, h) for b, h, _ in mine):
        # K^T and V per key block, each its own tile, loaded when first needed: the first block's work starts
        # after its own loads, not the whole head's
        k_t, v_sb = [], []
        for t in (t for bb, hh, t in mine if (bb, hh) == (b, h)):
            q0 = t * P
            qs = q_grid[b, h, t, 0].element_shape[0]
            q_t = sbuf((P, P), dt, "qT")
            _load_transposed(q_t, q_grid[b, h, t, 0].data, qs, d, dt)
            state = [None, sbuf((P, d + 1), F32, "o_acc")]
            kv_end = min(sk, q0 + qs) if causal else sk
            for j, (k0b, kbs) in enumerate(tiles(kv_end, KV_BLOCK)):
                if j == len(k_t):
                    kbs_all = min(KV_BLOCK, sk - k0b)
                    kt = sbuf((P, KV_BLOCK), dt, "kT")
                    _load_transposed(kt, k[b, h, k0b : k0b + kbs_all], kbs_all, d, dt)
                    vb = sbuf((P, KV_BLOCK // P, d + 1), dt, "v")  # V and a column of ones: P [V|1] sums P's rows
                    nisa.memset(dst=vb[:, :, d : d + 1], value=1.0, engine=nisa.engine.gpsimd)
                    _load_rows(vb[:, :, :d], v[b, h, k0b : k0b + kbs_all], kbs_all)
                    k_t.append(kt)
                    v_sb.append(vb)
                chunks = nl.tiles(k_t[j][:, :kbs], tile_shape=(P, CHUNK))
                _attend_block(q_t, chunks, k0b, v_sb[j], qs, q0, d, dt, masks, scale, state)
            neg_m, o_acc = state
            # the epilogue off Vector: 1/l and log(l) on Scalar, the products on GpSimd (all SBUF)
            inv_l = sbuf((P, 1), F32, "inv_l")
            nisa.activation(dst=inv_l[:qs], op=nl.reciprocal, data=o_acc[:qs, d : d + 1])
            o_sb = sbuf((P, d), dt, "o")
            nisa.tensor_scalar(dst=o_sb[:qs], data=o_acc[:qs, :d], op0=nl.multiply, operand0=inv_l[:qs], engine=GPSIMD)
            nisa.dma_copy(dst=o_grid[b, h, t, 0].data, src=o_sb[:qs])
            lse_sb = sbuf((P, 1), F32, "lse")
            nisa.activation(dst=lse_sb[:qs], op=nl.log, data=o_acc[:qs, d : d + 1])
            nisa.tensor_tensor(dst=lse_sb[:qs], data1=lse_sb[:qs], data2=neg_m[:qs], op=nl.subtract, engine=GPSIMD)
            nisa.dma_copy(dst=lse[b, h, q0 : q0 + qs].reshape((qs, 1)), src=lse_sb[:qs])
        del k_t, v_sb  # tiles are scoped to the head: free them before the next head allocates
    return out, lse


flash_attention_fwd_kernel = _flash_attention_fwd[LNC]


@jit
def _flash_attention_bwd(
    q: Any, k: Any, v: Any, o: Any, do: Any, lse: Any, causal: bool = False, scale: float | None = None
) -> Any:
    """NKI kernel: ``(dq, dk, dv)`` of :func:`flash_attention_fwd_kernel` given its ``o`` and ``lse``.
    Launched as ``[LNC]``: (batch, head) pairs are dealt to the programs (dQ sums over every key tile of a
    head, so a head is never split between cores)."""
    b_n, h_n, sq, d = q.shape
    sk = k.shape[2]
    dt = q.dtype
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    dq = nl.ndarray(q.shape, dt, buffer=nl.shared_hbm, name="dq")
    dk = nl.ndarray(k.shape, dt, buffer=nl.shared_hbm, name="dk")
    dv = nl.ndarray(v.shape, dt, buffer=nl.shared_hbm, name="dv")
    nq, nk = -(-sq // P), -(-sk // P)
    masks = None
    dma_t = _dma_transpose_ok(dt)
    for b, h in _my_work([(b, h) for b in range(b_n) for h in range(h_n)]):
        if causal and masks is None:
            masks = _mask_tiles(dt)
        q_sb, do_sb = sbuf((P, nq, d), dt, "q"), sbuf((P, nq, d), dt, "do")
        k_sb, v_sb = sbuf((P, nk, d), dt, "k"), sbuf((P, nk, d), dt, "v")
        q_t, do_t = sbuf((P, sq), dt, "qT"), sbuf((P, sq), dt, "doT")
        k_t, v_t = sbuf((P, sk), dt, "kT"), sbuf((P, sk), dt, "vT")
        _load_transposed(q_t, q[b, h], sq, d, dt, natural=q_sb)
        _load_transposed(do_t, do[b, h], sq, d, dt, natural=do_sb)
        _load_transposed(k_t, k[b, h], sk, d, dt, natural=k_sb)
        _load_transposed(v_t, v[b, h], sk, d, dt, natural=v_sb)
        neg_lse, di = sbuf((P, nq), F32, "neg_lse"), sbuf((P, nq), F32, "Di")
        for i, (q0, qs) in enumerate(tiles(sq)):
            nisa.dma_copy(dst=neg_lse[:qs, i : i + 1], src=lse[b, h, q0 : q0 + qs].reshape((qs, 1)))
            o_tile = sbuf((P, d), dt, "o")
            nisa.dma_copy(dst=o_tile[:qs], src=o[b, h, q0 : q0 + qs, :])
            prod = sbuf((P, d), F32, "do_o")
            nisa.tensor_tensor(dst=prod[:qs], data1=do_sb[:qs, i, :], data2=o_tile[:qs], op=nl.multiply)
            nisa.tensor_reduce(dst=di[:qs, i : i + 1], op=nl.add, data=prod[:qs], axis=1, keepdims=True)
        nisa.tensor_scalar(dst=neg_lse, data=neg_lse, op0=nl.multiply, operand0=-1.0, engine=GPSIMD)
        dq_acc = sbuf((P, nq, d), F32, "dq_acc")
        dq_started = [False] * nq
        key_tiles = list(tiles(sk))
        for g0 in range(0, nk, KEY_GROUP):
            group = list(range(g0, min(g0 + KEY_GROUP, nk)))
            # dK and dV of the group's key tiles accumulate in PSUM over every query tile
            dk_ps = {j: psum((P, d), F32, "dk") for j in group}
            dv_ps = {j: psum((P, d), F32, "dv") for j in group}
            started = dict.fromkeys(group, False)
            for i, (q0, qs) in enumerate(tiles(sq)):
                live = [j for j in group if not (causal and key_tiles[j][0] > q0 + qs - 1)]
                if not live:
                    continue
                dq_ps = psum((P, d), F32, "dq")  # dQ of this query tile over the group's key tiles
                for n_done, j in enumerate(live):
                    k0, ks = key_tiles[j]
                    s_ps = psum((P, P), F32, "s")
                    nisa.nc_matmul(
                        dst=s_ps[:qs, :ks],
                        stationary=q_t[:d, q0 : q0 + qs],
                        moving=k_t[:d, k0 : k0 + ks],
                        accumulate=False,
                    )
                    if causal and k0 + ks - 1 > q0:  # the diagonal tile (square: sq == sk)
                        _add_causal_mask(s_ps, masks, qs, 0)
                    p_sb = sbuf((P, P), dt, "p")
                    nisa.activation(
                        dst=p_sb[:qs, :ks], op=nl.exp, data=s_ps[:qs, :ks], bias=neg_lse[:qs, i : i + 1], scale=scale
                    )
                    nisa.nc_matmul(
                        dst=dv_ps[j][:ks], stationary=p_sb[:qs, :ks], moving=do_sb[:qs, i, :], accumulate=started[j]
                    )
                    dp_ps = psum((P, P), F32, "dp")
                    nisa.nc_matmul(
                        dst=dp_ps[:qs, :ks],
                        stationary=do_t[:d, q0 : q0 + qs],
                        moving=v_t[:d, k0 : k0 + ks],
                        accumulate=False,
                    )
                    ds = sbuf((P, P), dt, "ds")  # dS = P * (dP - Di), one Vector pass out of PSUM
                    nisa.scalar_tensor_tensor(
                        dst=ds[:qs, :ks],
                        data=dp_ps[:qs, :ks],
                        op0=nl.subtract,
                        operand0=di[:qs, i : i + 1],
                        op1=nl.multiply,
                        operand1=p_sb[:qs, :ks],
                    )
                    nisa.nc_matmul(
                        dst=dk_ps[j][:ks], stationary=ds[:qs, :ks], moving=q_sb[:qs, i, :], accumulate=started[j]
                    )
                    started[j] = True
                    ds_t = sbuf((P, P), dt, "dsT")
                    if dma_t:
                        nisa.dma_transpose(dst=ds_t[:ks, :qs], src=ds[:qs, :ks], axes=(1, 0))
                    else:
                        ds_tp = psum((P, P), dt, "dsT_psum")
                        nisa.nc_transpose(dst=ds_tp[:ks, :qs], data=ds[:qs, :ks])
                        nisa.tensor_copy(dst=ds_t[:ks, :qs], src=ds_tp[:ks, :qs], engine=nisa.engine.scalar)
                    nisa.nc_matmul(
                        dst=dq_ps[:qs], stationary=ds_t[:ks, :qs], moving=k_sb[:ks, j, :], accumulate=n_done > 0
                    )
                if dq_started[i]:
                    nisa.tensor_tensor(dst=dq_acc[:qs, i, :], data1=dq_acc[:qs, i, :], data2=dq_ps[:qs], op=nl.add)
                else:
                    nisa.tensor_copy(dst=dq_acc[:qs, i, :], src=dq_ps[:qs])
                    dq_started[i] = True
            for j in group:
                k0, ks = key_tiles[j]
                dk_sb, dv_sb = sbuf((P, d), dt, "dk"), sbuf((P, d), dt, "dv")
                if not started[j]:  # no query attends to this key tile
                    nisa.memset(dst=dk_sb, value=0.0, engine=GPSIMD)
                    nisa.memset(dst=dv_sb, value=0.0, engine=GPSIMD)
                else:
                    nisa.activation(dst=dk_sb[:ks], op=nl.copy, data=dk_ps[j][:ks], scale=scale)
                    nisa.tensor_copy(dst=dv_sb[:ks], src=dv_ps[j][:ks], engine=nisa.engine.scalar)
                nisa.dma_copy(dst=dk[b, h, k0 : k0 + ks, :], src=dk_sb[:ks])
                nisa.dma_copy(dst=dv[b, h, k0 : k0 + ks, :], src=dv_sb[:ks])
        for i, (q0, qs) in enumerate(tiles(sq)):
            dq_sb = sbuf((P, d), dt, "dq")
            nisa.tensor_scalar(dst=dq_sb[:qs], data=dq_acc[:qs, i, :], op0=nl.multiply, operand0=scale, engine=GPSIMD)
            nisa.dma_copy(dst=dq[b, h, q0 : q0 + qs, :], src=dq_sb[:qs])
        del q_sb, do_sb, k_sb, v_sb, q_t, do_t, k_t, v_t, dq_acc  # scoped to the head
    return dq, dk, dv


flash_attention_bwd_kernel = _flash_attention_bwd[LNC]


# ------------------------------------------------------------------------------------------- references
def _scores(q: Any, k: Any, causal: bool, scale: float | None) -> Any:
    import jax.numpy as jnp
    from jax import lax

    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    s = lax.dot_general(q, k, (((3,), (3,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32) * scale
    if causal:
        # int32 positions and a float32 finite mask: the neuron target without nki compiles this body itself,
        # and under the lowering's x64 mode jnp.arange and a bare Python float would be 64-bit
        # (float64 does not exist on Trainium); -inf is invalid input to the hardware, NEG masks as well.
        shape = (q.shape[2], k.shape[2])
        keep = lax.broadcasted_iota(jnp.int32, shape, 1) <= lax.broadcasted_iota(jnp.int32, shape, 0)
        s = jnp.where(keep, s, jnp.asarray(NEG, s.dtype))
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


def flash_attention_bwd_reference(
    q: Any, k: Any, v: Any, o: Any, do: Any, lse: Any, causal: bool = False, scale: float | None = None
) -> Any:
    """StableHLO reference of the attention backward from ``o`` and ``lse``: ``(dq, dk, dv)``."""
    import jax.numpy as jnp

    s, sc = _scores(q, k, causal, scale)
    p = jnp.exp(s - lse[..., None])

    def f(x):
        return x.astype(jnp.float32)

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


def flash_attention_bwd_supports(
    q: Any, k: Any, v: Any, o: Any, do: Any, lse: Any, causal: bool = False, scale: float | None = None
) -> bool:
    # Q, dO, K, V stay resident natural and transposed, plus an fp32 dQ accumulator: 8192 rows fit SBUF in
    # 2-byte dtypes, 4096 in fp32 (8192 fp32 overflowed it and was routed anyway before)
    limit = 8192 if dtype_of(q) in ("bfloat16", "float16") else 4096
    return _qkv_ok(q, k, v, causal) and max(q.shape[2], k.shape[2]) <= limit
