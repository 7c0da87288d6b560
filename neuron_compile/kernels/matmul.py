"""Tiled matmul ``out[M,N] = a[M,K] @ b[K,N]`` (fp32 or bf16; any M, K, N, ragged edges included).

Tiling (for TensorE utilisation, see :mod:`neuron_compile.kernels.cost`):

* M is cut into blocks of up to ``bm`` (4) 128-row tiles. For each block, the rows of ``a`` are loaded
  1024 columns per DMA and transposed on the PE into ``aT[K(partition), kt, M]`` — the stationary
  operand — which stays resident in SBUF for the whole block.
* For each ``tn``-wide (512; narrower for large K or fp32) column tile of ``b`` (the moving operand, loaded
  once per block as ``[K, kt, tn]``),
  every 128-row tile of the block accumulates over K in its own fp32 PSUM bank (``accumulate=kt>0``),
  is copied out of PSUM with the cast to the output dtype, and stored.

HBM traffic is ``|a| + |b| * ceil(M / (128*bm)) + |out|``; with bm=4 a 4096^3 bf16 matmul moves ~0.3 GB,
well under its TensorE time, so the kernel is compute bound.
"""

from __future__ import annotations

from typing import Any

from ._common import P, cdiv, dtype_of, itemsize, psum, sbuf, tiles
from .nki_api import isa as nisa
from .nki_api import jit
from .nki_api import language as nl

KC = 1024  # columns of a row tile of ``a`` loaded per DMA (2 KiB per partition in bf16)
KG = 4  # 128-row tiles of ``b`` per DMA: 4 x 512 bf16 columns = 4 KiB per partition, where the published
#         DMA efficiency curve saturates (97%; 1 KiB transfers run at ~42%)
SBUF_BUDGET = 160 * 1024  # bytes per partition this kernel allows itself (of ~208 KiB usable on trn2)


def _plan(k: int, isz: int) -> tuple[int, int]:
    """``(tn, bm)``: moving-tile width and 128-row tiles per M block that fit the SBUF budget; (0, 0) if none.

    Wide moving tiles and tall blocks first (fewer instructions, fewer reloads of ``b``); large K (or fp32)
    falls back to narrower/shorter ones. K itself is not blocked: a K whose resident operands do not fit
    even at (128, 1) is not supported.
    """
    nk = cdiv(k, P)
    for tn in (512, 256, 128):
        fixed = 2 * nk * tn * isz + 2 * min(k, KC) * isz + 2 * tn * isz  # b columns, a rows, out (x2 buffers)
        for bm in (4, 2, 1):
            if fixed + nk * bm * P * isz <= SBUF_BUDGET:
                return tn, bm
    return 0, 0


@jit
def matmul_kernel(a: Any, b: Any) -> Any:
    """NKI kernel: ``a[M,K] @ b[K,N]`` with fp32 PSUM accumulation, output in ``a.dtype``."""
    m_total, k_total = a.shape
    k2, n_total = b.shape
    assert k_total == k2, f"matmul_kernel: a {a.shape} and b {b.shape} do not contract"
    dt = a.dtype
    out = nl.ndarray((m_total, n_total), dt, buffer=nl.shared_hbm, name="out")
    nk = cdiv(k_total, P)
    tn, bm = _plan(k_total, itemsize(dt))
    assert bm, f"matmul_kernel: K={k_total} needs more SBUF than this kernel's budget"
    for m_blk in range(0, m_total, bm * P):
        blk_rows = min(bm * P, m_total - m_blk)
        a_t = sbuf((P, nk, blk_rows), dt, "aT")  # stationary: K on partitions, resident for the block
        for mo, msz in tiles(blk_rows):
            for c0, cs in tiles(k_total, KC):
                a_rows = sbuf((P, KC), dt, "a_rows")
                nisa.dma_copy(dst=a_rows[:msz, :cs], src=a[m_blk + mo : m_blk + mo + msz, c0 : c0 + cs])
                for k0, ksz in tiles(cs):
                    kt = (c0 + k0) // P
                    tp = psum((P, P), dt, "aT_psum")  # a PSUM tile per transpose: they pipeline with the copies
                    nisa.nc_transpose(dst=tp[:ksz, :msz], data=a_rows[:msz, k0 : k0 + ksz])
                    nisa.tensor_copy(dst=a_t[:ksz, kt, mo : mo + msz], src=tp[:ksz, :msz], engine=nisa.engine.scalar)
        for n0, nsz in tiles(n_total, tn):
            b_t = sbuf((P, nk, tn), dt, "b_cols")  # moving: loaded once per block, reused by every row tile
            full = k_total // P
            for kt in range(0, full, KG):  # KG k-tiles per DMA: >= 2 KiB per partition per transfer
                g = min(KG, full - kt)
                src = b[kt * P : (kt + g) * P, n0 : n0 + nsz].reshape_dim(0, (g, P)).permute((1, 0, 2))
                nisa.dma_copy(dst=b_t[:, kt : kt + g, :nsz], src=src)
            if k_total % P:
                k0, ksz = full * P, k_total % P
                nisa.dma_copy(dst=b_t[:ksz, full, :nsz], src=b[k0 : k0 + ksz, n0 : n0 + nsz])
            for mo, msz in tiles(blk_rows):
                acc = psum((P, tn), "float32", "acc")
                for kt, (k0, ksz) in enumerate(tiles(k_total)):
                    nisa.nc_matmul(
                        dst=acc[:msz, :nsz],
                        stationary=a_t[:ksz, kt, mo : mo + msz],
                        moving=b_t[:ksz, kt, :nsz],
                        accumulate=kt > 0,
                    )
                res = sbuf((P, tn), dt, "res")
                nisa.tensor_copy(dst=res[:msz, :nsz], src=acc[:msz, :nsz], engine=nisa.engine.vector)
                nisa.dma_copy(dst=out[m_blk + mo : m_blk + mo + msz, n0 : n0 + nsz], src=res[:msz, :nsz])
    return out


def matmul_reference(a: Any, b: Any) -> Any:
    """StableHLO reference (jax.lax): fp32-accumulated dot, result in ``a.dtype``."""
    import jax.numpy as jnp
    from jax import lax

    acc = lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return acc.astype(a.dtype)


def matmul_supports(a: Any, b: Any) -> bool:
    """2-D, same dtype (fp32/bf16/fp16), contracting, and K small enough for the resident tiles."""
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != b.shape[0]:
        return False
    dt = dtype_of(a)
    if dt != dtype_of(b) or dt not in ("float32", "bfloat16", "float16"):
        return False
    return _plan(int(a.shape[1]), itemsize(dt))[1] > 0
