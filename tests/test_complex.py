"""Complex values as (real, imag) pairs inside graphs, and FFT as DFT matmuls (issue 12, items 1-2).

Every compiled result is compared with eager PyTorch on the same inputs at float32 tolerances.
"""

from __future__ import annotations

import inspect
import math
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.exc import BackendCompilerFailed

from neuron_compile.compiler import HOOKS
from neuron_compile.errors import NeuronFloat64Warning, NeuronUnsupportedOpError

from .util import root_cause

RTOL, ATOL = 1e-4, 1e-5  # float32; DFT sums of a few dozen terms stay well inside


def _compile(fn):
    return torch.compile(fn, backend="neuron", dynamic=False)


def _fwd_bwd(fn, inputs: list[torch.Tensor], compiled: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs of ``fn`` and the gradients of every floating/complex input that requires grad, under a
    loss that depends on real and imaginary parts differently (so a conjugation error shows)."""
    xs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    out = (_compile(fn) if compiled else fn)(*xs)
    outs = list(out) if isinstance(out, tuple) else [out]
    loss = 0
    for o in outs:
        r = torch.view_as_real(o.resolve_conj()) if o.is_complex() else o
        loss = loss + (r * torch.linspace(-1, 2, r.numel()).reshape(r.shape)).sum() + r.pow(2).sum() * 0.1
    grads = []
    if any(x.requires_grad for x in xs) and loss.requires_grad:  # boolean results have no gradient
        loss.backward()
        grads = [x.grad for x in xs if x.requires_grad]
    return [o.detach() for o in outs], grads


def _check_matches_eager(fn, inputs: list[torch.Tensor], label: str, atol: float = ATOL) -> None:
    want_out, want_grad = _fwd_bwd(fn, inputs, compiled=False)
    got_out, got_grad = _fwd_bwd(fn, inputs, compiled=True)
    for kind, got, want in (("output", got_out, want_out), ("grad", got_grad, want_grad)):
        assert len(got) == len(want), f"{label}: {len(got)} {kind}s, eager has {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            shapes = [f"{t.dtype}{list(t.shape)}" for t in inputs]
            assert g.dtype == w.dtype and g.shape == w.shape, (
                f"{label} inputs {shapes}: {kind} {i} is {g.dtype}{list(g.shape)}, eager {w.dtype}{list(w.shape)}"
            )
            torch.testing.assert_close(
                g, w, rtol=RTOL, atol=atol, msg=lambda m: f"{label} inputs {shapes}: {kind} {i}: {m}"
            )


# -- Llama-style complex rotary embeddings inside an attention block --------------------------------
def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end).float()
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs))


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * freqs).flatten(3).type_as(xq), torch.view_as_real(xk_ * freqs).flatten(3).type_as(
        xk
    )


class Attention(torch.nn.Module):
    """The original Llama attention (no KV cache): rotary embeddings through view_as_complex/polar."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim)
        k = self.wk(x).view(b, s, self.heads, self.head_dim)
        v = self.wv(x).view(b, s, self.heads, self.head_dim)
        q, k = apply_rotary_emb(q, k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(2, 3)) / math.sqrt(self.head_dim)
        mask = torch.full((s, s), float("-inf")).triu(1)
        out = F.softmax(scores + mask, dim=-1) @ v
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def test_llama_complex_rope_attention_forward_and_backward_match_eager() -> None:
    torch.manual_seed(0)
    eager_model = Attention()
    compiled_model = Attention()
    compiled_model.load_state_dict(eager_model.state_dict())
    x = torch.randn(2, 6, 32)
    freqs = precompute_freqs_cis(8, 6)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = eager_model(xe, freqs)
    got = _compile(compiled_model)(xc, freqs)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(xc.grad, xe.grad, rtol=RTOL, atol=ATOL)
    for (name, pc), (_, pe) in zip(compiled_model.named_parameters(), eager_model.named_parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"grad of {name}: {m}")


# -- complex ops on pairs, forward and backward -----------------------------------------------------
def _c(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.complex64, requires_grad=True)


def _r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


COMPLEX_OPS = [
    ("view_as_complex/real", lambda x: torch.view_as_real(torch.view_as_complex(x) * 2), [_r(3, 4, 2)]),
    ("polar", lambda r, t: torch.polar(r, t), [torch.rand(3, 4, requires_grad=True) + 0.5, _r(3, 4)]),
    ("complex", lambda a, b: torch.complex(a, b) * torch.complex(b, a), [_r(3, 4), _r(3, 4)]),
    ("real/imag", lambda z: z.real * 2 - z.imag * z.real, [_c(3, 4)]),
    ("abs", lambda z: z.abs(), [_c(3, 4)]),
    ("angle", lambda z: z.angle(), [_c(3, 4)]),
    ("conj", lambda z, w: z.conj() * w, [_c(3, 4), _c(3, 4)]),
    ("conj_physical", lambda z: torch.conj_physical(z) + 1, [_c(3, 4)]),
    ("add/sub", lambda z, w: z + w * 2 - (1 + 2j) - z.conj(), [_c(3, 4), _c(4)]),
    ("mul", lambda z, w: z * w * 1j, [_c(3, 4), _c(3, 1)]),
    ("mul_real", lambda z, x: z * x, [_c(3, 4), _r(4)]),
    ("div", lambda z, w: z / w, [_c(3, 4), _c(3, 4)]),
    ("div_real", lambda z, x: z / (x.abs() + 1) + 1 / (z + 3), [_c(3, 4), _r(3, 4)]),
    # kept whole (decompositions.KEEP_WHOLE): a complex value, a real tensor operand, broadcasting
    (
        "addcmul",
        lambda z, x, w: torch.addcmul(z, x, w, value=1.5 - 2j) + torch.addcmul(z, w, w),
        [_c(3, 1), _r(4), _c(3, 4)],
    ),
    ("addcdiv", lambda z, x, w: torch.addcdiv(z, x, w, value=0.5) + z.addcdiv(w, w + 3), [_c(3, 1), _r(4), _c(3, 4)]),
    ("exp", lambda z: torch.exp(z), [_c(3, 4)]),
    ("log", lambda z: torch.log(z), [_c(3, 4)]),
    ("square", lambda z: z**2, [_c(3, 4)]),
    ("sgn", lambda z: z.sgn(), [_c(3, 4)]),
    ("matmul", lambda a, b: a @ b, [_c(3, 5), _c(5, 2)]),
    ("bmm", lambda a, b: torch.bmm(a, b), [_c(2, 3, 5), _c(2, 5, 4)]),
    ("einsum", lambda a, b: torch.einsum("bij,bkj->bik", a, b), [_c(2, 3, 5), _c(2, 4, 5)]),
    ("sum/mean", lambda z: z.sum(dim=1) + z.mean(), [_c(3, 4)]),
    (
        "cat/stack",
        lambda z, w: torch.cat([z, w], dim=0) + torch.stack([z, w]).sum(0).repeat(2, 1),
        [_c(3, 4), _c(3, 4)],
    ),
    ("views", lambda z: z.reshape(4, 3).t().unsqueeze(0).permute(2, 0, 1).flatten()[2:9], [_c(3, 4)]),
    ("select/index", lambda z: z[1] + z[:, 2].sum() + z[torch.tensor([0, 2, 2])].sum(0), [_c(3, 4)]),
    ("flip/roll", lambda z: z.flip(0) * z.roll(1, dims=1), [_c(3, 4)]),
    ("where", lambda z, m: torch.where(m, z, 0) + torch.where(m, 1j, z), [_c(3, 4), torch.rand(3, 4) > 0.5]),
    ("to/from real", lambda x: (x.to(torch.complex64) * (1 + 1j)).real, [_r(3, 4)]),
    ("to bool/int", lambda z: (z.to(torch.bool), (z * 3).to(torch.int32)), [torch.tensor([0, 1j, 2.5, -1 - 1j, 0.4j])]),
    ("zeros/full", lambda z: z + torch.full((3, 4), 2 - 1j) + torch.zeros_like(z), [_c(3, 4)]),
    ("pad", lambda z: F.pad(z, (1, 2)), [_c(3, 4)]),
    ("reflect_pad", lambda z: F.pad(z, (2, 1), mode="reflect"), [_c(2, 3, 4)]),
    ("sqrt/rsqrt", lambda z: torch.sqrt(z) + torch.rsqrt(z), [_c(3, 4)]),
    ("sqrt_axes", lambda z: torch.sqrt(z), [torch.tensor([4, -4, 4j, -4j, 0, 1e-3 - 1j, -9 + 1e-3j])]),
    ("sin/cos", lambda z: torch.sin(z) * torch.cos(z), [_c(3, 4)]),
    ("sinh/cosh", lambda z: torch.sinh(z) - torch.cosh(z), [_c(3, 4)]),
    ("tanh", lambda z: torch.tanh(z * 3), [_c(3, 4)]),
    ("sigmoid", lambda z: torch.sigmoid(z), [_c(3, 4)]),
    (
        "logical",
        lambda z, w: torch.logical_and(z, w) | torch.logical_not(z * 0) | torch.any(z, dim=0),
        [_c(3, 4), _c(3, 4)],
    ),
    ("isinf/isfinite", lambda z: torch.isinf(z / 0) & ~torch.isfinite(z / 0), [_c(3, 4)]),
    ("vector_norm", lambda z: torch.linalg.vector_norm(z, dim=1) + torch.linalg.vector_norm(z, ord=1), [_c(3, 4)]),
    ("var/var_mean", lambda z: (torch.var(z, dim=0), *torch.var_mean(z, dim=1, correction=0)), [_c(3, 4)]),
    (
        "scatter_add/take",
        lambda z, w: z.scatter_add(1, torch.tensor([[0, 1], [2, 2], [3, 0]]), w) + z.take(torch.tensor([5])),
        [_c(3, 4), _c(3, 2)],
    ),
]


@pytest.mark.parametrize("label, fn, inputs", COMPLEX_OPS, ids=[c[0] for c in COMPLEX_OPS])
def test_complex_op_forward_and_backward_match_eager(label, fn, inputs) -> None:
    _check_matches_eager(fn, inputs, label)


# -- FFT --------------------------------------------------------------------------------------------
FFTS = [
    ("fft", lambda x, norm: torch.fft.fft(x, norm=norm), False),
    ("ifft", lambda x, norm: torch.fft.ifft(x, norm=norm), True),
    ("fft_n", lambda x, norm: torch.fft.fft(x, n=5, dim=1, norm=norm), True),
    ("rfft", lambda x, norm: torch.fft.rfft(x, norm=norm), False),
    ("irfft", lambda x, norm: torch.fft.irfft(x, norm=norm), True),
    ("irfft_odd_n", lambda x, norm: torch.fft.irfft(x, n=7, norm=norm), True),
    ("fft2", lambda x, norm: torch.fft.fft2(x, norm=norm), True),
    ("ifft2", lambda x, norm: torch.fft.ifft2(x, norm=norm), False),
    ("rfft2", lambda x, norm: torch.fft.rfft2(x, norm=norm), False),
    ("irfft2", lambda x, norm: torch.fft.irfft2(x, s=(4, 6), norm=norm), True),
    ("fftn", lambda x, norm: torch.fft.fftn(x, norm=norm), True),
    ("rfftn", lambda x, norm: torch.fft.rfftn(x, norm=norm), False),
    ("hfft", lambda x, norm: torch.fft.hfft(x, norm=norm), True),
    ("ihfft", lambda x, norm: torch.fft.ihfft(x, norm=norm), False),
]


#: Every norm mode on the transforms the issue names; the variants (n=, hfft/ihfft, rfftn) at the default.
_ALL_NORMS = {"fft", "ifft", "rfft", "irfft", "fft2", "ifft2", "rfft2", "irfft2", "fftn"}
FFT_CASES = [
    pytest.param(label, fn, complex_input, norm, id=f"{label}-{norm}")
    for label, fn, complex_input in FFTS
    for norm in (["backward", "ortho", "forward"] if label in _ALL_NORMS else ["backward"])
]


@pytest.mark.parametrize("label, fn, complex_input, norm", FFT_CASES)
def test_fft_forward_and_backward_match_eager(label, fn, complex_input, norm) -> None:
    x = _c(2, 4, 6) if complex_input else _r(2, 4, 6)
    _check_matches_eager(lambda t: fn(t, norm), [x], f"torch.fft.{label}(norm={norm!r})")


@pytest.mark.parametrize("n", [8, 9])
def test_rfft_irfft_round_trip(n: int) -> None:
    x = torch.randn(3, n)
    got = _compile(lambda t: torch.fft.irfft(torch.fft.rfft(t), n=n))(x)
    torch.testing.assert_close(got, x, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got, torch.fft.irfft(torch.fft.rfft(x), n=n), rtol=RTOL, atol=ATOL)


def fft_conv(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Circular convolution of each row of ``x`` with ``k`` via the convolution theorem."""
    n = x.shape[-1]
    return torch.fft.irfft(torch.fft.rfft(x) * torch.fft.rfft(k, n=n), n=n)


def test_fft_convolution_forward_and_backward_match_eager() -> None:
    x, k = _r(4, 16), _r(5)
    _check_matches_eager(fft_conv, [x, k], "fft_conv")
    # and it is a convolution: the same as a circular conv1d in eager
    xd = x.detach()
    direct = torch.stack([sum(xd[:, (j - i) % 16] * k[i].item() for i in range(5)) for j in range(16)], dim=1)
    torch.testing.assert_close(_compile(fft_conv)(xd, k.detach()), direct, rtol=RTOL, atol=ATOL)


# -- the graph boundary -----------------------------------------------------------------------------
def test_complex_graph_inputs_and_outputs() -> None:
    def fn(z, w):
        y = z * w + 1
        return y, y.t(), y.conj(), (z.abs() + w.real).sum()

    z = torch.randn(3, 4, dtype=torch.complex64)
    w = torch.randn(4, 3, dtype=torch.complex64).t()  # a non-contiguous complex input
    got, want = _compile(fn)(z, w), fn(z, w)
    for i, (g, e) in enumerate(zip(got, want)):
        assert (g.dtype, g.shape, g.stride()) == (e.dtype, e.shape, e.stride()), f"output {i}"
        torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL, msg=lambda m: f"output {i}: {m}")
    assert got[1].data_ptr() == got[0].data_ptr()  # y.t() is a view of y, as in eager


def test_complex128_is_computed_as_complex64_with_the_float64_warning() -> None:
    z = torch.randn(5, dtype=torch.complex128)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = _compile(lambda t: t * (1 - 2j))(z)
    assert got.dtype == torch.complex128
    torch.testing.assert_close(got, z * (1 - 2j), rtol=1e-5, atol=1e-5)
    assert any(isinstance(w.message, NeuronFloat64Warning) for w in record)


def unsupported_complex(x):
    return torch.view_as_complex(x).tan()  # <- offender


def test_unsupported_complex_op_is_a_clear_error() -> None:
    with pytest.raises(BackendCompilerFailed) as info:
        _compile(unsupported_complex)(torch.randn(3, 2))
    err = root_cause(info.value)
    text = str(err)
    assert isinstance(err, NeuronUnsupportedOpError), text
    line = inspect.getsourcelines(unsupported_complex)[1] + 1
    assert "aten.tan" in text and "complex64" in text and "(real, imag) pairs" in text, text
    assert f"{os.path.basename(__file__)}:{line}" in text, text


def test_complex32_input_is_refused_naming_the_dtype() -> None:
    from neuron_compile.graph_checks import unsupported_tensor_kind

    assert "complex32" in unsupported_tensor_kind(torch.zeros(2, dtype=torch.complex32))
    assert unsupported_tensor_kind(torch.zeros(2, dtype=torch.complex64)) is None


@pytest.fixture
def lowered_graphs():
    seen = []
    HOOKS.on_lowered.append(seen.append)
    yield seen
    HOOKS.on_lowered.remove(seen.append)


def test_stablehlo_of_complex_graph_has_no_complex_type(lowered_graphs) -> None:
    opts = {"cache": False}
    x = _r(2, 8)
    fn = torch.compile(lambda t: torch.fft.irfft(torch.fft.rfft(t) * (1 + 1j), n=8).sum() + torch.fft.fft(t).abs().sum(),
                       backend="neuron", dynamic=False, options=opts)  # fmt: skip
    fn(x).backward()
    assert len(lowered_graphs) == 2, "forward and backward"
    for lowered in lowered_graphs:
        text = lowered.stablehlo()
        assert "complex<" not in text and "stablehlo.fft" not in text, lowered.name
        assert "stablehlo.dot_general" in text, lowered.name


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_angle_of_real_input_matches_eager(dtype) -> None:
    x = torch.tensor([-1.5, 0.0, -0.0, 2.0, float("nan"), float("-inf"), float("inf")])
    x = x[:4].to(dtype) if dtype == torch.int64 else x
    torch.testing.assert_close(_compile(torch.angle)(x), torch.angle(x), equal_nan=True)


UNFOLDS = [(0, 3, 1), (1, 4, 3), (-1, 2, 2), (1, 10, 1)]


@pytest.mark.parametrize("dim, size, step", UNFOLDS, ids=[f"dim{d}-size{s}-step{t}" for d, s, t in UNFOLDS])
def test_unfold_forward_and_backward_match_eager(dim, size, step) -> None:
    _check_matches_eager(lambda t: t.unfold(dim, size, step), [_r(5, 10, 4)], f"unfold({dim}, {size}, {step})")


def test_stft_and_istft_match_eager() -> None:
    window = torch.hann_window(16)
    stft = lambda t: torch.stft(t, n_fft=16, hop_length=4, window=window, return_complex=True)  # noqa: E731
    istft = lambda s: torch.istft(s, n_fft=16, hop_length=4, window=window, length=60)  # noqa: E731
    x = _r(2, 60)
    _check_matches_eager(stft, [x], "stft")
    _check_matches_eager(istft, [stft(x.detach()).requires_grad_()], "istft")


LONG = [("fft", lambda t: torch.fft.fft(t, norm="ortho"), True), ("rfft", torch.fft.rfft, False),
        ("irfft", lambda t: torch.fft.irfft(t, n=301), True)]  # fmt: skip


@pytest.mark.parametrize("n", [256, 300])  # split as 16 * 16 and 15 * 20
@pytest.mark.parametrize("label, fn, complex_input", LONG, ids=[f[0] for f in LONG])
def test_long_fft_split_cooley_tukey_matches_eager(label, fn, complex_input, n) -> None:
    x = (_c if complex_input else _r)(2, n)
    want, got = fn(x.detach()), _compile(fn)(x.detach())
    # each output is an n-term float32 sum: its rounding error is up to ~n * eps * max|x| (float64 eager
    # agrees with float32 eager to that order too)
    atol = n * torch.finfo(torch.float32).eps * float(x.detach().abs().max())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)
    if label == "rfft":  # and the backward through the split transform: each gradient element is an n-term
        # sum of the upstream gradient (the loss's weights, up to 2, plus 0.2 * the output)
        upstream = 2 + 0.2 * float(want.abs().max())
        _check_matches_eager(fn, [x], f"torch.fft.{label} n={n}", atol=n * torch.finfo(torch.float32).eps * upstream)


def test_long_fft_constants_stay_linear_in_n(lowered_graphs) -> None:
    n = 4096  # one 4096 x 4096 DFT matrix would be a 256 MB constant
    x = torch.randn(n, dtype=torch.complex64)
    got = torch.compile(torch.fft.fft, backend="neuron", dynamic=False, options={"cache": False})(x)
    torch.testing.assert_close(got, torch.fft.fft(x), rtol=1e-5, atol=n * torch.finfo(torch.float32).eps * 4)
    assert len(lowered_graphs[-1].stablehlo()) < 2_000_000


_CACHE_SCRIPT = """
import torch, neuron_compile
z = torch.linspace(-1, 1, 12).reshape(3, 4) * (1 + 2j)
out = torch.compile(lambda t: torch.fft.fft(t * t.conj(), dim=0), backend="neuron", dynamic=False)(z)
torch.testing.assert_close(out, torch.fft.fft(z * z.conj(), dim=0), rtol=1e-4, atol=1e-5)
print([g.cache for g in neuron_compile.STATS.graphs])
"""


def test_complex_graph_is_served_from_the_disk_cache_in_a_new_process(tmp_path) -> None:
    # The entry's specs say complex64[3, 4] where the executable takes f32[3, 4, 2]: the load-time check of
    # the executable against the entry must accept the pair (a rejection would be a silent miss).
    import subprocess
    import sys

    env = {**os.environ, "NEURON_COMPILE_CACHE_DIR": str(tmp_path)}
    runs = [
        subprocess.run([sys.executable, "-c", _CACHE_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
        for _ in range(2)
    ]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    assert runs[0].stdout.split()[-1] == "['miss']" and runs[1].stdout.split()[-1] == "['hit']", [
        r.stdout for r in runs
    ]
