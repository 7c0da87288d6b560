"""Built-in NKI kernels: kernel (in the emulator) == its jax reference == eager torch, over shapes with
ragged tiles, fp32 and bf16; shape-only mode agrees with the reference's shapes; limits raise.

bf16 tolerance: kernel, reference and eager-bf16 outputs are all judged against eager torch run in fp32
on the same (bf16-rounded) inputs. The kernel's and the reference's max error must be at most
``BF16_FACTOR`` x eager-bf16's max error plus one bf16 step (2^-8) of the output's magnitude — the one
rounding every bf16 output carries even when eager computes internally in fp32.
fp32: rtol 1e-4 / atol 1e-4 x output magnitude against eager fp32.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from neuron_compile import nki
from neuron_compile.kernels import KERNELS

BF16_FACTOR = 2.0


def _np(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(ml_dtypes.bfloat16)
    return t.numpy()


def _t(a) -> torch.Tensor:
    a = np.asarray(a)
    return torch.from_numpy(a.astype(np.float32)) if a.dtype == ml_dtypes.bfloat16 else torch.from_numpy(a.copy())


def _grad(fn, inputs, grad_out):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    fn(*leaves).backward(grad_out)
    return tuple(x.grad for x in leaves)


# Each case: (kernel name, id, builder(dtype, gen) -> (tensor args, consts), eager(*tensor args, *consts) -> tuple)
def _attn_fwd_eager(q, k, v, causal, scale=None):
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    s = (q @ k.transpose(-1, -2)).float() * (scale or 1 / math.sqrt(q.shape[-1]))
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return o, torch.logsumexp(s, -1)


def _attn_bwd_inputs(dtype, g, b, h, s, d, causal):
    q, k, v, do = (torch.randn(b, h, s, d, generator=g).to(dtype) for _ in range(4))
    o, lse = _attn_fwd_eager(q.float(), k.float(), v.float(), causal)
    return (q, k, v, o.to(dtype), do, lse), (causal,)


def _attn_bwd_eager(q, k, v, o, do, lse, causal):
    return _grad(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), do)


def _rows(dtype, g, r, c, n=1):
    return tuple(torch.randn(r, c, generator=g).to(dtype) for _ in range(n))


def _vec(dtype, g, c):
    return (1 + 0.5 * torch.randn(c, generator=g)).to(dtype)


CASES = [
    (
        "matmul",
        "130x260x600",
        lambda dt, g: ((torch.randn(130, 260, generator=g).to(dt), torch.randn(260, 600, generator=g).to(dt)), ()),
        lambda a, b: (a @ b,),
    ),
    (
        "matmul",
        "64x128x512",
        lambda dt, g: ((torch.randn(64, 128, generator=g).to(dt), torch.randn(128, 512, generator=g).to(dt)), ()),
        lambda a, b: (a @ b,),
    ),
    (
        "matmul",
        "130x4100x140-large-K",
        lambda dt, g: ((torch.randn(130, 4100, generator=g).to(dt), torch.randn(4100, 140, generator=g).to(dt)), ()),
        lambda a, b: (a @ b,),
    ),
    ("softmax", "130x300", lambda dt, g: (_rows(dt, g, 130, 300), ()), lambda x: (torch.softmax(x, -1),)),
    (
        "softmax_bwd",
        "130x300",
        lambda dt, g: (
            (torch.softmax(torch.randn(130, 300, generator=g), -1).to(dt), torch.randn(130, 300, generator=g).to(dt)),
            (),
        ),
        lambda y, dy: ((y * (dy - (y * dy).sum(-1, keepdim=True))),),
    ),
    (
        "rms_norm",
        "130x200",
        lambda dt, g: (_rows(dt, g, 130, 200) + (_vec(dt, g, 200),), (1e-6,)),
        lambda x, w, eps: (F.rms_norm(x, (x.shape[-1],), w, eps),),
    ),
    (
        "rms_norm_bwd",
        "130x200",
        lambda dt, g: (_rows(dt, g, 130, 200, 2) + (_vec(dt, g, 200),), (1e-6,)),
        lambda dy, x, w, eps: _grad(lambda x, w: F.rms_norm(x, (x.shape[-1],), w, eps), (x, w), dy),
    ),
    (  # more than 8 PSUM banks of columns: dw summed in SBUF instead of PSUM
        "rms_norm_bwd",
        "130x4700",
        lambda dt, g: (_rows(dt, g, 130, 4700, 2) + (_vec(dt, g, 4700),), (1e-6,)),
        lambda dy, x, w, eps: _grad(lambda x, w: F.rms_norm(x, (x.shape[-1],), w, eps), (x, w), dy),
    ),
    (
        "layer_norm",
        "130x700",
        lambda dt, g: (_rows(dt, g, 130, 700) + (_vec(dt, g, 700), _vec(dt, g, 700)), (1e-5,)),
        lambda x, w, b, eps: (F.layer_norm(x, (x.shape[-1],), w, b, eps),),
    ),
    (
        "layer_norm_bwd",
        "130x700",
        lambda dt, g: (_rows(dt, g, 130, 700, 2) + (_vec(dt, g, 700),), (1e-5,)),
        lambda dy, x, w, eps: _grad(
            lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps), (x, w, torch.zeros_like(w)), dy
        ),
    ),
    (
        "layer_norm_bwd",
        "70x4700",
        lambda dt, g: (_rows(dt, g, 70, 4700, 2) + (_vec(dt, g, 4700),), (1e-5,)),
        lambda dy, x, w, eps: _grad(
            lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps), (x, w, torch.zeros_like(w)), dy
        ),
    ),
    ("swiglu", "130x2100", lambda dt, g: (_rows(dt, g, 130, 2100, 2), ()), lambda a, b: (F.silu(a) * b,)),
    (
        "flash_attention_fwd",
        "causal-1x2x200x64",
        lambda dt, g: (tuple(torch.randn(1, 2, 200, 64, generator=g).to(dt) for _ in range(3)), (True,)),
        _attn_fwd_eager,
    ),
    (
        "flash_attention_fwd",
        "full-2x1x130x128",
        lambda dt, g: (tuple(torch.randn(2, 1, 130, 128, generator=g).to(dt) for _ in range(3)), (False,)),
        _attn_fwd_eager,
    ),
    (
        "flash_attention_fwd",
        "full-q100-kv2600x32",
        lambda dt, g: (
            (
                torch.randn(1, 1, 100, 32, generator=g).to(dt),
                torch.randn(1, 1, 2600, 32, generator=g).to(dt),
                torch.randn(1, 1, 2600, 32, generator=g).to(dt),
            ),
            (False,),
        ),
        _attn_fwd_eager,
    ),
    (
        "flash_attention_fwd",
        "causal-1x1x700x16",
        lambda dt, g: (tuple(torch.randn(1, 1, 700, 16, generator=g).to(dt) for _ in range(3)), (True,)),
        _attn_fwd_eager,
    ),
    (
        "flash_attention_bwd",
        "causal-1x2x200x64",
        lambda dt, g: _attn_bwd_inputs(dt, g, 1, 2, 200, 64, True),
        _attn_bwd_eager,
    ),
    (
        "flash_attention_bwd",
        "full-1x1x130x128",
        lambda dt, g: _attn_bwd_inputs(dt, g, 1, 1, 130, 128, False),
        _attn_bwd_eager,
    ),
]


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,shape_id,build,eager", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_kernel_matches_reference_and_eager(name, shape_id, build, eager, dtype):
    spec = KERNELS[name]
    g = torch.Generator().manual_seed(0)
    tensors, consts = build(dtype, g)
    assert spec.supports(*tensors, *consts), f"{name} should support {[tuple(t.shape) for t in tensors]}"
    got = _as_tuple(nki.simulate(spec.kernel)(*tensors, *consts))  # torch in, torch out
    import jax

    # jitted as the compiler would emit it: one XLA compile instead of one per jax op (3x faster here)
    reference = jax.jit(lambda *a: spec.reference(*a, *consts))
    ref = tuple(_t(r) for r in _as_tuple(reference(*(_np(t) for t in tensors))))
    exp = tuple(e.detach() for e in _as_tuple(eager(*tensors, *consts)))
    assert len(got) == len(ref) == len(spec.outputs) == len(exp)
    for out_name, k, r, e in zip(spec.outputs, got, ref, exp):
        what = f"{name}[{shape_id}, {dtype}] output {out_name}"
        assert k.shape == e.shape and k.dtype == e.dtype, f"{what}: {k.shape}/{k.dtype} vs eager {e.shape}/{e.dtype}"
        if dtype == torch.float32:
            scale = max(float(e.abs().max()), 1.0)
            torch.testing.assert_close(k, e, rtol=1e-4, atol=1e-4 * scale, msg=lambda m, w=what: f"{w} kernel: {m}")
            torch.testing.assert_close(r, e, rtol=1e-4, atol=1e-4 * scale, msg=lambda m, w=what: f"{w} reference: {m}")
        else:
            e32 = _as_tuple(eager(*(t.float() for t in tensors), *consts))[spec.outputs.index(out_name)].detach()
            step = 2.0**-8 * float(e32.abs().max())
            eager_err = float((e.float() - e32).abs().max())
            bound = BF16_FACTOR * eager_err + step
            for label, val in (("kernel", k), ("reference", r)):
                err = float((val.float() - e32).abs().max())
                assert err <= bound, (
                    f"{what} {label}: max error {err:.3g} vs fp32 eager exceeds "
                    f"{BF16_FACTOR} x eager-bf16 error {eager_err:.3g} + bf16 step {step:.3g}"
                )


@pytest.mark.parametrize("name,shape_id,build,eager", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_shape_only_matches_reference_shapes(name, shape_id, build, eager):
    import jax

    spec = KERNELS[name]
    tensors, consts = build(torch.bfloat16, torch.Generator().manual_seed(0))
    metas = [t.to("meta") for t in tensors]
    inferred = _as_tuple(nki.infer_shapes(spec.kernel)(*metas, *consts))
    structs = [jax.ShapeDtypeStruct(tuple(t.shape), _np(t[(0,) * t.dim()].reshape(1)).dtype) for t in tensors]
    expected = _as_tuple(jax.eval_shape(lambda *a: spec.reference(*a, *consts), *structs))
    assert [(s.shape, s.dtype) for s in inferred] == [(tuple(e.shape), str(e.dtype)) for e in expected], name


def test_flash_attention_head_dim_over_128_raises():
    spec = KERNELS["flash_attention_fwd"]
    q = np.zeros((1, 1, 128, 256), np.float32)
    assert not spec.supports(q, q, q, False)
    with pytest.raises(nki.NkiValidationError, match=r"access out of bound: \[0:256\] on dim 0 \(size 128\)"):
        nki.infer_shapes(spec.kernel)(q, q, q, False)  # D=256 rows do not fit a 128-partition transpose


def test_norm_too_wide_for_sbuf_raises():
    spec = KERNELS["layer_norm_bwd"]
    x, w = np.zeros((128, 32768), np.float32), np.zeros((32768,), np.float32)
    assert not spec.supports(x, x, w, 1e-5)
    with pytest.raises(nki.NkiValidationError, match="SBUF capacity exceeded"):
        nki.infer_shapes(spec.kernel)(x, x, w, 1e-5)


def test_kernels_package_imports_without_jax():
    import subprocess
    import sys

    code = (
        "import sys, neuron_compile.kernels as k; assert k.KERNELS['matmul'].outputs == ('out',); "
        "assert 'jax' not in sys.modules, 'neuron_compile.kernels imported jax'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
