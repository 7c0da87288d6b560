"""Conformance suite: kernels written for this suite from the NKI documentation, one per topic of AWS's
tutorials (tensor add under an LNC-2 launch, transpose, average pool with access patterns, matmul variants,
RMSNorm and LayerNorm, softmax, fused attention, a Mamba-style selective scan), run in the emulator and
compared with a float64 NumPy/torch reference in fp32 and bf16.

fp32: rtol 1e-4 / atol 1e-4 x the output's magnitude. bf16 (as torch's accuracy checker judges low precision):
the kernel's max-abs and RMS errors against the float64 reference must be at most 2x those of the same op run
eagerly by torch in bf16, plus one bf16 step (2^-8) of the output's magnitude.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from neuron_compile import nki

nl, nisa = nki.language, nki.isa
P = 128
F32 = nl.float32
NEG_BIG = -30000.0  # a large finite mask value: the hardware treats -inf as invalid input


def _tiles(n, size=P):
    return [(s, min(size, n - s)) for s in range(0, n, size)]


# ------------------------------------------------------------------------------------------------ kernels
@nki.jit
def add_lnc(a, b):
    """a + b; rows split between the programs of the launch (kernel[2]: the two cores of an LNC-2 core)."""
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    share = a.shape[0] // nl.num_programs(axes=0)
    base = nl.program_id(axis=0) * share
    for r0, rs in _tiles(share):
        x = nl.load(a[base + r0 : base + r0 + rs])
        y = nl.load(b[base + r0 : base + r0 + rs])
        nl.store(out[base + r0 : base + r0 + rs], nl.add(x, y))
    return out


@nki.jit
def transpose2d(x):
    """out[C, R] = x[R, C].T, 128 x 128 blocks through the Tensor engine."""
    r, c = x.shape
    out = nl.ndarray((c, r), x.dtype, buffer=nl.shared_hbm)
    for r0, rs in _tiles(r):
        for c0, cs in _tiles(c):
            blk = nl.ndarray((P, P), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=blk[:rs, :cs], src=x[r0 : r0 + rs, c0 : c0 + cs])
            t_ps = nl.ndarray((P, P), x.dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=t_ps[:cs, :rs], data=blk[:rs, :cs])
            t_sb = nl.ndarray((P, P), x.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=t_sb[:cs, :rs], src=t_ps[:cs, :rs])
            nisa.dma_copy(dst=out[c0 : c0 + cs, r0 : r0 + rs], src=t_sb[:cs, :rs])
    return out


@nki.jit
def avgpool2d(x, pool):
    """Average pool of x[C, H, W] (C <= 128 on partitions) over pool x pool windows, read by an access pattern."""
    c, h, w = x.shape
    ho, wo = h // pool, w // pool
    out = nl.ndarray((c, ho, wo), x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray((c, h, w), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    windows = t.ap(pattern=[[h * w, c], [pool * w, ho], [pool, wo], [w, pool], [1, pool]], offset=0)
    s = nl.ndarray((c, ho, wo), F32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=s, op=nl.add, data=windows, axis=(3, 4))
    o = nl.ndarray((c, ho, wo), x.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=o, data=s, op0=nl.multiply, operand0=1.0 / (pool * pool))
    nisa.dma_copy(dst=out, src=o)
    return out


@nki.jit
def matmul_single(lhs_t, rhs):
    """out[M, N] = lhs_t[K, M].T @ rhs[K, N], one Tensor-engine tile (K, M <= 128, N <= 512)."""
    k, m = lhs_t.shape
    n = rhs.shape[1]
    out = nl.ndarray((m, n), lhs_t.dtype, buffer=nl.shared_hbm)
    a = nl.load(lhs_t)
    b = nl.load(rhs)
    ps = nl.ndarray((m, n), F32, buffer=nl.psum)
    nisa.nc_matmul(dst=ps, stationary=a, moving=b)
    o = nl.ndarray((m, n), lhs_t.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=o, src=ps)
    nisa.dma_copy(dst=out, src=o)
    return out


@nki.jit
def matmul_tiled(a, b):
    """out = a[M, K] @ b[K, N], any sizes: A^T blocks made on the PE, K accumulated in one PSUM bank."""
    m, k = a.shape
    n = b.shape[1]
    out = nl.ndarray((m, n), a.dtype, buffer=nl.shared_hbm)
    for m0, ms in _tiles(m):
        a_t = nl.ndarray((P, len(_tiles(k)), P), a.dtype, buffer=nl.sbuf)
        for i, (k0, ks) in enumerate(_tiles(k)):
            rows = nl.ndarray((P, P), a.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=rows[:ms, :ks], src=a[m0 : m0 + ms, k0 : k0 + ks])
            tp = nl.ndarray((P, P), a.dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=tp[:ks, :ms], data=rows[:ms, :ks])
            nisa.tensor_copy(dst=a_t[:ks, i, :ms], src=tp[:ks, :ms])
        for n0, ns in _tiles(n, 512):
            acc = nl.ndarray((P, 512), F32, buffer=nl.psum)
            for i, (k0, ks) in enumerate(_tiles(k)):
                bt = nl.ndarray((P, 512), b.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=bt[:ks, :ns], src=b[k0 : k0 + ks, n0 : n0 + ns])
                nisa.nc_matmul(dst=acc[:ms, :ns], stationary=a_t[:ks, i, :ms], moving=bt[:ks, :ns], accumulate=i > 0)
            o = nl.ndarray((P, 512), a.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=o[:ms, :ns], src=acc[:ms, :ns])
            nisa.dma_copy(dst=out[m0 : m0 + ms, n0 : n0 + ns], src=o[:ms, :ns])
    return out


@nki.jit
def matmul_grid(lhs_t, rhs):
    """out = lhs_t.T @ rhs with NKI 0.7 tile grids and the nl.matmul wrapper (multiples of the tile sizes)."""
    k, m = lhs_t.shape
    n = rhs.shape[1]
    out = nl.ndarray((m, n), lhs_t.dtype, buffer=nl.shared_hbm)
    lt, rt = nl.tiles(lhs_t, tile_shape=(P, P)), nl.tiles(rhs, tile_shape=(P, 256))
    ot = nl.tiles(out, tile_shape=(P, 256))
    for i in range(lt.shape[1]):
        for j in range(rt.shape[1]):
            acc = nl.zeros((P, 256), F32, buffer=nl.sbuf)
            for kk in range(lt.shape[0]):
                ps = nl.matmul(nl.load(lt[kk, i].data), nl.load(rt[kk, j].data), transpose_x=True)
                nisa.tensor_tensor(dst=acc, data1=acc, data2=ps, op=nl.add)
            nl.store(ot[i, j].data, nl.copy(acc, dtype=lhs_t.dtype))
    return out


@nki.jit
def rmsnorm(x, w, eps):
    """x * rsqrt(mean(x^2) + eps) * w over the last dim; w broadcast from one partition to 128."""
    r, h = x.shape
    out = nl.ndarray((r, h), x.dtype, buffer=nl.shared_hbm)
    w_row = nl.ndarray((1, h), w.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=w_row, src=w.reshape((1, h)))
    w_all = nl.broadcast_to(w_row, (P, h))
    for r0, rs in _tiles(r):
        xt = nl.ndarray((P, h), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt[:rs], src=x[r0 : r0 + rs])
        sq = nl.ndarray((P, h), F32, buffer=nl.sbuf)
        ss = nl.ndarray((P, 1), F32, buffer=nl.sbuf)
        nisa.activation(dst=sq[:rs], op=nl.square, data=xt[:rs], reduce_op=nl.add, reduce_res=ss[:rs])
        rstd = nl.ndarray((P, 1), F32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=rstd[:rs], data=ss[:rs], op0=nl.multiply, operand0=1.0 / h, op1=nl.add, operand1=eps)
        nisa.activation(dst=rstd[:rs], op=nl.rsqrt, data=rstd[:rs])
        y = nl.ndarray((P, h), x.dtype, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(
            dst=y[:rs], data=xt[:rs], op0=nl.multiply, operand0=rstd[:rs], op1=nl.multiply, operand1=w_all[:rs]
        )
        nisa.dma_copy(dst=out[r0 : r0 + rs], src=y[:rs])
    return out


@nki.jit
def layernorm(x, w, b, eps):
    """(x - mean) * rstd * w + b with bn_stats per 512-element chunk and bn_aggr."""
    r, h = x.shape
    out = nl.ndarray((r, h), x.dtype, buffer=nl.shared_hbm)
    w_all = nl.broadcast_to(nl.load(w.reshape((1, h))), (P, h))
    b_all = nl.broadcast_to(nl.load(b.reshape((1, h))), (P, h))
    chunks = _tiles(h, nl.tile_size.bn_stats_fmax)
    for r0, rs in _tiles(r):
        xt = nl.ndarray((P, h), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt[:rs], src=x[r0 : r0 + rs])
        stats = nl.ndarray((P, 6 * len(chunks)), F32, buffer=nl.sbuf)
        for i, (c0, cs) in enumerate(chunks):
            nisa.bn_stats(dst=stats[:rs, 6 * i : 6 * i + 6], data=xt[:rs, c0 : c0 + cs])
        mv = nl.ndarray((P, 2), F32, buffer=nl.sbuf)
        nisa.bn_aggr(dst=mv[:rs], data=stats[:rs])
        rstd = nl.ndarray((P, 1), F32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=rstd[:rs], data=mv[:rs, 1:2], op0=nl.add, operand0=eps)
        nisa.activation(dst=rstd[:rs], op=nl.rsqrt, data=rstd[:rs])
        xn = nl.ndarray((P, h), F32, buffer=nl.sbuf)
        nisa.tensor_scalar(
            dst=xn[:rs], data=xt[:rs], op0=nl.subtract, operand0=mv[:rs, 0:1], op1=nl.multiply, operand1=rstd[:rs]
        )
        nisa.tensor_tensor(dst=xn[:rs], data1=xn[:rs], data2=w_all[:rs], op=nl.multiply)
        y = nl.ndarray((P, h), x.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=y[:rs], data1=xn[:rs], data2=b_all[:rs], op=nl.add)
        nisa.dma_copy(dst=out[r0 : r0 + rs], src=y[:rs])
    return out


@nki.jit
def softmax(x):
    """Row softmax: negated row max on Vector, exp(x - max) with its row sum on Scalar, 1/sum, scale."""
    r, c = x.shape
    out = nl.ndarray((r, c), x.dtype, buffer=nl.shared_hbm)
    for r0, rs in _tiles(r):
        xt = nl.ndarray((P, c), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt[:rs], src=x[r0 : r0 + rs])
        neg_max = nl.ndarray((P, 1), F32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=neg_max[:rs], op=nl.maximum, data=xt[:rs], axis=1, negate=True, keepdims=True)
        e = nl.ndarray((P, c), F32, buffer=nl.sbuf)
        s = nl.ndarray((P, 1), F32, buffer=nl.sbuf)
        nisa.activation(dst=e[:rs], op=nl.exp, data=xt[:rs], bias=neg_max[:rs], reduce_op=nl.add, reduce_res=s[:rs])
        nisa.reciprocal(dst=s[:rs], data=s[:rs])
        y = nl.ndarray((P, c), x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y[:rs], data=e[:rs], op0=nl.multiply, operand0=s[:rs])
        nisa.dma_copy(dst=out[r0 : r0 + rs], src=y[:rs])
    return out


@nki.jit
def attention(q, k, v, causal):
    """softmax(q k^T / sqrt(d) [+ causal mask]) v for one head; q, k, v: [S, D], S <= 512, D <= 128."""
    s_len, d = q.shape
    scale = 1.0 / math.sqrt(d)
    out = nl.ndarray((s_len, d), q.dtype, buffer=nl.shared_hbm)
    k_t = nl.ndarray((P, s_len), k.dtype, buffer=nl.sbuf)
    nisa.dma_transpose(dst=k_t[:d, :s_len], src=k, axes=(1, 0)) if k.dtype == nl.bfloat16 else _pe_transpose_rows(
        k_t, k, s_len, d
    )
    v_sb = nl.ndarray((P, len(_tiles(s_len)), d), v.dtype, buffer=nl.sbuf)
    for j, (k0, ks) in enumerate(_tiles(s_len)):
        nisa.dma_copy(dst=v_sb[:ks, j, :], src=v[k0 : k0 + ks])
    for q0, qs in _tiles(s_len):
        q_t = nl.ndarray((P, P), q.dtype, buffer=nl.sbuf)
        _pe_transpose_rows(q_t, q[q0 : q0 + qs], qs, d)
        s_ps = nl.ndarray((P, s_len), F32, buffer=nl.psum)
        nisa.nc_matmul(dst=s_ps[:qs], stationary=q_t[:d, :qs], moving=k_t[:d, :s_len])
        s_sb = nl.ndarray((P, s_len), F32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=s_sb[:qs], src=s_ps[:qs])
        if causal:  # keep key <= query: q0 + p - key >= 0
            nisa.affine_select(
                dst=s_sb[:qs],
                pattern=[[-1, s_len]],
                channel_multiplier=1,
                on_true_tile=s_sb[:qs],
                on_false_value=NEG_BIG,
                cmp_op=nl.greater_equal,
                offset=q0,
            )
        neg_max = nl.ndarray((P, 1), F32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=neg_max[:qs], op=nl.maximum, data=s_sb[:qs], axis=1, negate=True, keepdims=True)
        nisa.tensor_scalar(dst=neg_max[:qs], data=neg_max[:qs], op0=nl.multiply, operand0=scale)
        p = nl.ndarray((P, s_len), q.dtype, buffer=nl.sbuf)
        rsum = nl.ndarray((P, 1), F32, buffer=nl.sbuf)
        nisa.activation(
            dst=p[:qs],
            op=nl.exp,
            data=s_sb[:qs],
            bias=neg_max[:qs],
            scale=scale,
            reduce_op=nl.add,
            reduce_res=rsum[:qs],
        )
        o_ps = nl.ndarray((P, d), F32, buffer=nl.psum)
        for j, (k0, ks) in enumerate(_tiles(s_len)):
            pt_ps = nl.ndarray((P, P), q.dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=pt_ps[:ks, :qs], data=p[:qs, k0 : k0 + ks])
            pt = nl.ndarray((P, P), q.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=pt[:ks, :qs], src=pt_ps[:ks, :qs])
            nisa.nc_matmul(dst=o_ps[:qs], stationary=pt[:ks, :qs], moving=v_sb[:ks, j, :], accumulate=j > 0)
        nisa.reciprocal(dst=rsum[:qs], data=rsum[:qs])
        o = nl.ndarray((P, d), q.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=o[:qs], data=o_ps[:qs], op0=nl.multiply, operand0=rsum[:qs])
        nisa.dma_copy(dst=out[q0 : q0 + qs], src=o[:qs])
    return out


def _pe_transpose_rows(dst_t, src_hbm, rows, d):
    """dst_t[:d, :rows] = src_hbm[rows, d].T through the PE, 128 rows at a time (a helper, inlined)."""
    for r0, rs in _tiles(rows):
        blk = nl.ndarray((P, d), src_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=blk[:rs], src=src_hbm[r0 : r0 + rs])
        tp = nl.ndarray((P, P), src_hbm.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=tp[:d, :rs], data=blk[:rs])
        nisa.tensor_copy(dst=dst_t[:d, r0 : r0 + rs], src=tp[:d, :rs])


@nki.jit
def selective_scan(delta, u, a, b, c):
    """Mamba-style scan, channels on partitions: for each state s, h_t = exp(delta_t a_s) h_{t-1} + delta_t u_t b_{s,t}
    (a tensor_tensor_scan along time), y_t += c_{s,t} h_t. delta, u: [C, L]; a: [C, S]; b, c: [S, L]."""
    ch, length = delta.shape
    n_state = a.shape[1]
    out = nl.ndarray((ch, length), delta.dtype, buffer=nl.shared_hbm)
    dl, ut, at = nl.load(delta, dtype=F32), nl.load(u, dtype=F32), nl.load(a, dtype=F32)
    du = nl.ndarray((ch, length), F32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=du, data1=dl, data2=ut, op=nl.multiply)
    y = nl.zeros((ch, length), F32, buffer=nl.sbuf)
    for s in range(n_state):
        decay = nl.ndarray((ch, length), F32, buffer=nl.sbuf)
        nisa.activation(dst=decay, op=nl.exp, data=dl, scale=at[:, s : s + 1])
        b_all = nl.broadcast_to(nl.load(b[s : s + 1, :], dtype=F32), (ch, length))
        drive = nl.ndarray((ch, length), F32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=drive, data1=du, data2=b_all, op=nl.multiply)
        h = nl.ndarray((ch, length), F32, buffer=nl.sbuf)
        nisa.tensor_tensor_scan(dst=h, data0=decay, data1=drive, initial=0.0, op0=nl.multiply, op1=nl.add)
        c_all = nl.broadcast_to(nl.load(c[s : s + 1, :], dtype=F32), (ch, length))
        nisa.tensor_tensor(dst=h, data1=h, data2=c_all, op=nl.multiply)
        nisa.tensor_tensor(dst=y, data1=y, data2=h, op=nl.add)
    nl.store(out, nl.copy(y, dtype=delta.dtype))
    return out


# ------------------------------------------------------------------------------------ references (torch)
def _attn_ref(q, k, v, causal):
    return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=causal)[0]


def _scan_ref(delta, u, a, b, c):
    h = torch.zeros(delta.shape[0], a.shape[1], dtype=delta.dtype)
    ys = []
    for t in range(delta.shape[1]):
        h = torch.exp(delta[:, t : t + 1] * a) * h + (delta[:, t] * u[:, t])[:, None] * b[:, t][None]
        ys.append((h * c[:, t][None]).sum(1))
    return torch.stack(ys, 1)


def _rms_ref(x, w, eps):
    xf = x.float() if x.dtype == torch.bfloat16 else x
    return (x * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)) * w


# (id, kernel launcher, input builder(gen) -> (tensors, consts), torch reference(*tensors, *consts))
CASES = [
    (
        "add-lnc2",
        lambda *a: add_lnc[2](*a),
        lambda g: ((torch.randn(512, 96, generator=g), torch.randn(512, 96, generator=g)), ()),
        torch.add,
    ),
    ("transpose2d", transpose2d, lambda g: ((torch.randn(200, 150, generator=g),), ()), lambda x: x.T.contiguous()),
    (
        "avgpool2d",
        avgpool2d,
        lambda g: ((torch.randn(16, 12, 20, generator=g),), (2,)),
        lambda x, k: F.avg_pool2d(x[None], k)[0],
    ),
    (
        "matmul-single",
        matmul_single,
        lambda g: ((torch.randn(128, 96, generator=g), torch.randn(128, 384, generator=g)), ()),
        lambda a, b: a.T @ b,
    ),
    (
        "matmul-tiled",
        matmul_tiled,
        lambda g: ((torch.randn(150, 300, generator=g), torch.randn(300, 600, generator=g)), ()),
        torch.matmul,
    ),
    (
        "matmul-grid",
        matmul_grid,
        lambda g: ((torch.randn(256, 128, generator=g), torch.randn(256, 512, generator=g)), ()),
        lambda a, b: a.T @ b,
    ),
    (
        "rmsnorm",
        rmsnorm,
        lambda g: ((torch.randn(200, 160, generator=g), 1 + 0.3 * torch.randn(160, generator=g)), (1e-6,)),
        _rms_ref,
    ),
    (
        "layernorm",
        layernorm,
        lambda g: (
            (
                torch.randn(150, 600, generator=g),
                1 + 0.3 * torch.randn(600, generator=g),
                0.3 * torch.randn(600, generator=g),
            ),
            (1e-5,),
        ),
        lambda x, w, b, eps: F.layer_norm(x, (x.shape[-1],), w, b, eps),
    ),
    ("softmax", softmax, lambda g: ((3 * torch.randn(150, 300, generator=g),), ()), lambda x: torch.softmax(x, -1)),
    (
        "attention-causal",
        attention,
        lambda g: (tuple(torch.randn(200, 64, generator=g) for _ in range(3)), (True,)),
        _attn_ref,
    ),
    (
        "attention-full",
        attention,
        lambda g: (tuple(torch.randn(256, 32, generator=g) for _ in range(3)), (False,)),
        _attn_ref,
    ),
    (
        "selective-scan",
        selective_scan,
        lambda g: (
            (
                0.5 * torch.rand(64, 48, generator=g),
                torch.randn(64, 48, generator=g),
                -torch.rand(64, 4, generator=g) - 0.2,
                torch.randn(4, 48, generator=g),
                torch.randn(4, 48, generator=g),
            ),
            (),
        ),
        _scan_ref,
    ),
]


def _np(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(ml_dtypes.bfloat16)
    return t.numpy().copy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_conformance_kernel_matches_reference(case, dtype) -> None:
    name, launch, build, ref_fn = case
    g = torch.Generator().manual_seed(0)
    tensors, consts = build(g)
    inputs = tuple(t.to(dtype) for t in tensors)
    got = np.asarray(launch(*(_np(t) for t in inputs), *consts), dtype=np.float64)
    ref = ref_fn(*(t.double() for t in inputs), *consts).numpy()
    assert got.shape == ref.shape, f"{name}: shape {got.shape} != {ref.shape}"
    mag = float(np.abs(ref).max())
    err = np.abs(got - ref)
    if dtype == torch.float32:
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * mag, err_msg=f"{name} fp32")
        return
    base = np.abs(ref_fn(*inputs, *consts).double().numpy() - ref)
    step = 2.0**-8 * mag
    assert err.max() <= 2 * base.max() + step, (
        f"{name} bf16: max error {err.max():.3g} vs eager bf16 {base.max():.3g} (+ {step:.3g})"
    )
    rms, base_rms = float(np.sqrt((err**2).mean())), float(np.sqrt((base**2).mean()))
    assert rms <= 2 * base_rms + step, f"{name} bf16: RMS error {rms:.3g} vs eager bf16 {base_rms:.3g}"
