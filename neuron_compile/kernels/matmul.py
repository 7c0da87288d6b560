"""Tiled matmul ``out[M,N] = a[M,K] @ b[K,N]`` (fp32 or bf16; any M, K, N, ragged edges included).

Tiling (for TensorE utilisation, see :mod:`neuron_compile.kernels.cost`):

* M is cut into blocks of up to ``BM`` 128-row tiles. For each block, the rows of ``a`` are loaded with
  one DMA per 128-row tile and transposed on the PE into ``aT[K(partition), kt, M]`` — the stationary
  operand — which stays resident in SBUF for the whole block.
* For each 512-wide column tile of ``b`` (the moving operand, loaded once per block as ``[K, kt, 512]``),
  every 128-row tile of the block accumulates over K in its own fp32 PSUM bank (``accumulate=kt>0``),
  is copied out of PSUM with the cast to the output dtype, and stored.

HBM traffic is ``|a| + |b| * ceil(M / (128*BM)) + |out|``; with BM=4 a 4096^3 bf16 matmul moves ~0.3 GB,
well under its TensorE time, so the kernel is compute bound.
"""

from __future__ import annotations

from typing import Any

from ..nki import isa as nisa
from ..nki import jit
from ..nki import language as nl
from ._common import P, cdiv, dtype_of, itemsize, psum, sbuf, tiles

TN = 512  # nl.tile_size.gemm_moving_fmax
SBUF_BUDGET = 160 * 1024  # bytes per partition this kernel allows itself (of ~208 KiB usable on trn2)


def _block_tiles(k: int, isz: int) -> int:
    """How many 128-row tiles of ``a`` one M block keeps resident (0: K too large for this kernel)."""
    nk = cdiv(k, P)
    fixed = 2 * nk * TN * isz + 2 * k * isz + 2 * TN * isz  # b column tile, a row tile, out tile (x2 buffers)
    for bm in (4, 2, 1):
        if fixed + nk * bm * P * isz <= SBUF_BUDGET:
            return bm
    return 0


@jit
def matmul_kernel(a: Any, b: Any) -> Any:
    """NKI kernel: ``a[M,K] @ b[K,N]`` with fp32 PSUM accumulation, output in ``a.dtype``."""
    m_total, k_total = a.shape
    k2, n_total = b.shape
    assert k_total == k2, f"matmul_kernel: a {a.shape} and b {b.shape} do not contract"
    dt = a.dtype
    out = nl.ndarray((m_total, n_total), dt, buffer=nl.shared_hbm, name="out")
    nk = cdiv(k_total, P)
    bm = _block_tiles(k_total, itemsize(dt))
    assert bm, f"matmul_kernel: K={k_total} needs more SBUF than this kernel's budget"
    for m_blk in range(0, m_total, bm * P):
        blk_rows = min(bm * P, m_total - m_blk)
        a_t = sbuf((P, nk, blk_rows), dt, "aT")  # stationary: K on partitions, resident for the block
        for mo, msz in tiles(blk_rows):
            a_rows = sbuf((P, k_total), dt, "a_rows")
            nisa.dma_copy(a_rows[:msz, :], a[m_blk + mo:m_blk + mo + msz, :])
            for kt, (k0, ksz) in enumerate(tiles(k_total)):
                tp = psum((P, P), dt, "aT_psum")
                nisa.nc_transpose(tp[:ksz, :msz], a_rows[:msz, k0:k0 + ksz])
                nisa.tensor_copy(a_t[:ksz, kt, mo:mo + msz], tp[:ksz, :msz], engine=nisa.scalar_engine)
        for n0, nsz in tiles(n_total, TN):
            b_t = sbuf((P, nk, TN), dt, "b_cols")  # moving: loaded once per block, reused by every row tile
            for kt, (k0, ksz) in enumerate(tiles(k_total)):
                nisa.dma_copy(b_t[:ksz, kt, :nsz], b[k0:k0 + ksz, n0:n0 + nsz])
            for mo, msz in tiles(blk_rows):
                acc = psum((P, TN), "float32", "acc")
                for kt, (k0, ksz) in enumerate(tiles(k_total)):
                    nisa.nc_matmul(acc[:msz, :nsz], a_t[:ksz, kt, mo:mo + msz], b_t[:ksz, kt, :nsz],
                                   accumulate=kt > 0)
                res = sbuf((P, TN), dt, "res")
                nisa.tensor_copy(res[:msz, :nsz], acc[:msz, :nsz], engine=nisa.vector_engine)
                nisa.dma_copy(out[m_blk + mo:m_blk + mo + msz, n0:n0 + nsz], res[:msz, :nsz])
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
    return _block_tiles(int(a.shape[1]), itemsize(dt)) > 0
