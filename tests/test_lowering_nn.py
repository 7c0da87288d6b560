"""Neural-network op families (linalg, activations, softmax/norms/embedding/losses, convolution) through
``torch.compile(backend="neuron")``, compared with eager on the same inputs: forward values, gradients of
every differentiable input and parameter, and module buffers (batch-norm running stats).

The harness is tests/lowering_cases.py's (``nn_case`` below spells this file's cases for it). Tolerances: float32
1e-5 for elementwise ops; 1e-4 where a reduction (matmul, norm statistics, convolution) sums in a different order
than eager's kernels; bfloat16 1.6e-2 relative (one bf16 ulp is 7.8e-3, and eager and compiled may each round
once).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from .lowering_cases import BF16, F16, F32, TOL, Case, assert_same, check_compiled, describe_inputs
from .util import tensor_leaves

# Variants of an op already checked in bfloat16 run in float32 only, to keep the file fast.
F32_ONLY = (F32,)

#: This file's tolerance names for the shared table (tests/lowering_cases.py ``TOL``).
_TOL_OF_KIND = {"pointwise": "exact", "reduce": "sum"}


def nn_case(
    name: str,
    make: Callable[[torch.dtype], tuple[Any, list[Any]]],
    dtypes: tuple[torch.dtype, ...] = (F32, BF16),
    *,
    grad: bool = True,
    kind: str = "pointwise",
    grad_kind: str | None = None,
    frozen: tuple[int, ...] = (),
    labels: tuple[str, ...] = (),
    marks: list[Any] | tuple[Any, ...] = (),
) -> Case:
    """A case of this file for the shared harness: ``make(dtype)`` returns (callable or module, inputs), checked
    in one graph (fullgraph); ``kind`` "reduce" where the op sums in another order than eager's kernels (its
    gradients too unless ``grad_kind`` says otherwise, e.g. a backward that sums more terms than its forward);
    ``frozen``: positions of float inputs that must not require grad (nll_loss's class weights); ``labels``:
    names of output i / input i, for a case that checks several ops in one graph."""
    return Case(
        name,
        None,
        [],
        dtypes,
        grad=grad,
        tol=_TOL_OF_KIND[kind],
        grad_tol=_TOL_OF_KIND[grad_kind or kind],
        no_grad=tuple(frozen),
        marks=tuple(marks),
        build=make,
        fullgraph=True,
        labels=tuple(labels),
        grad_output_required=True,
    )


def _randn(*shape: int, dtype: torch.dtype = F32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape) * scale).to(dtype)


def _run(cases: list[Case]) -> list[Any]:
    return [p for c in cases for p in c.params()]


# ---- linalg -----------------------------------------------------------------------------------------
def _ints(*shape: int) -> torch.Tensor:
    return torch.randint(-50, 50, shape)


LINALG = [
    nn_case(
        "mm", lambda d: (torch.mm, [_randn(3, 8, dtype=d), _randn(8, 5, dtype=d)]), (F32, BF16, F16), kind="reduce"
    ),
    nn_case("mm_int64", lambda d: (torch.mm, [_ints(3, 8), _ints(8, 5)]), (torch.int64,), grad=False, kind="reduce"),
    nn_case("bmm", lambda d: (torch.bmm, [_randn(2, 3, 8, dtype=d), _randn(2, 8, 5, dtype=d)]), kind="reduce"),
    nn_case(
        "matmul_broadcast",
        dtypes=F32_ONLY,
        make=lambda d: (torch.matmul, [_randn(2, 1, 3, 8, dtype=d), _randn(3, 8, 5, dtype=d)]),
        kind="reduce",
    ),
    nn_case(
        "mv", dtypes=F32_ONLY, make=lambda d: (torch.mv, [_randn(3, 8, dtype=d), _randn(8, dtype=d)]), kind="reduce"
    ),
    nn_case(
        "dot", dtypes=F32_ONLY, make=lambda d: (torch.dot, [_randn(8, dtype=d), _randn(8, dtype=d)]), kind="reduce"
    ),
    nn_case("linear", lambda d: (nn.Linear(8, 5).to(d), [_randn(2, 3, 8, dtype=d)]), kind="reduce"),
    nn_case(
        "addmm_beta_alpha",
        lambda d: (
            lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
            [_randn(5, dtype=d), _randn(3, 8, dtype=d), _randn(8, 5, dtype=d)],
        ),
        kind="reduce",
    ),
    nn_case(
        # beta=0 ignores the bias entirely, NaN included.
        "addmm_beta0_nan_bias",
        dtypes=F32_ONLY,
        make=lambda d: (
            lambda c, a, b: torch.addmm(c, a, b, beta=0.0),
            [torch.full((3, 5), math.nan, dtype=d), _randn(3, 8, dtype=d), _randn(8, 5, dtype=d)],
        ),
        grad=False,
        kind="reduce",
    ),
    nn_case(
        "addmm_int64",
        lambda d: (lambda c, a, b: torch.addmm(c, a, b, beta=3, alpha=2), [_ints(5), _ints(3, 8), _ints(8, 5)]),
        (torch.int64,),
        grad=False,
    ),
    nn_case(
        "addmv",
        dtypes=F32_ONLY,
        make=lambda d: (
            lambda c, a, b: torch.addmv(c, a, b, beta=0.5, alpha=2.0),
            [_randn(3, dtype=d), _randn(3, 8, dtype=d), _randn(8, dtype=d)],
        ),
        kind="reduce",
    ),
    nn_case(
        "baddbmm",
        dtypes=F32_ONLY,
        make=lambda d: (
            lambda c, a, b: torch.baddbmm(c, a, b, beta=0.5, alpha=2.0),
            [_randn(2, 3, 5, dtype=d), _randn(2, 3, 8, dtype=d), _randn(2, 8, 5, dtype=d)],
        ),
        kind="reduce",
    ),
]


# ---- recurrent layers: Dynamo unrolls the time loop (allow_rnn, set by the backend) ----------------
def _recurrent(cls: type[nn.Module], **kwargs: Any) -> Callable[[torch.dtype], tuple[Any, list[Any]]]:
    return lambda d: (cls(6, 8, **kwargs).to(d), [_randn(3, 4, 6, dtype=d)])


RECURRENT = [
    nn_case("lstm_2_layers", _recurrent(nn.LSTM, num_layers=2, batch_first=True), kind="reduce"),
    nn_case("lstm_bidirectional", _recurrent(nn.LSTM, bidirectional=True), F32_ONLY, kind="reduce"),
    nn_case("lstm_proj", _recurrent(nn.LSTM, proj_size=3, batch_first=True), F32_ONLY, kind="reduce"),
    nn_case("gru_bidirectional_2_layers", _recurrent(nn.GRU, num_layers=2, bidirectional=True), kind="reduce"),
    nn_case("rnn_relu", _recurrent(nn.RNN, nonlinearity="relu", batch_first=True), F32_ONLY, kind="reduce"),
    nn_case("rnn_tanh_no_bias", _recurrent(nn.RNN, bias=False), F32_ONLY, kind="reduce"),
    nn_case(
        "lstm_cell",
        lambda d: (nn.LSTMCell(6, 8).to(d), [_randn(3, 6, dtype=d), (_randn(3, 8, dtype=d), _randn(3, 8, dtype=d))]),
        F32_ONLY,
        kind="reduce",
    ),
    nn_case("gru_cell", lambda d: (nn.GRUCell(6, 8).to(d), [_randn(3, 6, dtype=d)]), F32_ONLY, kind="reduce"),
]


@pytest.mark.parametrize("case,dtype", _run(RECURRENT))
def test_recurrent(case: Case, dtype: torch.dtype) -> None:
    check_compiled(case, dtype)


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_recurrent_inference(grad_mode: str) -> None:
    """Inference traces torch's LSTM decomposition without grad, where it would pick oneDNN's kernel."""
    torch.manual_seed(0)
    model = nn.LSTM(6, 8, num_layers=2, batch_first=True).eval()
    x = _randn(3, 4, 6)
    mode = torch.no_grad if grad_mode == "no_grad" else torch.inference_mode
    with mode():
        expected = model(x)
        actual = torch.compile(model, backend="neuron", dynamic=False, fullgraph=True)(x)
    for a, e in zip(tensor_leaves(actual), tensor_leaves(expected)):
        assert_same(a, e, TOL["sum"][F32], f"lstm {grad_mode}")


# ---- fractional max pooling: windows from the op's random-samples input (lowering/nn.py) ----------
def _fractional(nd: int, shape: tuple[int, ...], **kwargs: Any) -> Callable[[torch.dtype], tuple[Any, list[Any]]]:
    cls = nn.FractionalMaxPool2d if nd == 2 else nn.FractionalMaxPool3d

    def make(d: torch.dtype) -> tuple[Any, list[Any]]:
        planes = (shape[0] if len(shape) == nd + 2 else 1, shape[-nd - 1])
        x = _randn(*shape, dtype=d)
        x.view(-1)[3] = math.nan  # eager's scan takes a NaN as the window's maximum
        return cls(_random_samples=torch.rand(*planes, nd).to(d), **kwargs), [x]

    return make


FRACTIONAL = [
    nn_case(
        "fractional_max_pool2d_ratio_indices",
        _fractional(2, (2, 3, 9, 11), kernel_size=2, output_ratio=0.5, return_indices=True),
    ),
    nn_case("fractional_max_pool2d_size_unbatched", _fractional(2, (3, 7, 6), kernel_size=(2, 3), output_size=(4, 3))),
    nn_case(
        "fractional_max_pool3d_ratio_indices",
        _fractional(3, (2, 2, 5, 6, 7), kernel_size=2, output_ratio=0.5, return_indices=True),
    ),
    nn_case(
        "fractional_max_pool3d_size_unbatched",
        _fractional(3, (2, 6, 5, 7), kernel_size=(1, 2, 3), output_size=(3, 2, 4)),
    ),
]


@pytest.mark.parametrize("case,dtype", _run(FRACTIONAL))
def test_fractional_max_pool(case: Case, dtype: torch.dtype) -> None:
    check_compiled(case, dtype)


@pytest.mark.parametrize("name", ["nn.FractionalMaxPool2d", "nn.FractionalMaxPool3d"])
def test_fractional_max_pool_module_info_samples(name: str) -> None:
    """torch's ModuleInfo samples, in float32 (their float64 ``_random_samples`` converted: eager requires the
    input's dtype): outputs and indices equal eager's, input gradients within float32 rounding."""
    from torch.testing._internal.common_modules import module_db

    info = next(m for m in module_db if m.name == name)
    samples = info.module_inputs_func(info, device="cpu", dtype=F32, requires_grad=True, training=True)
    assert samples, name
    for sample in samples:
        kwargs = dict(sample.constructor_input.kwargs)
        kwargs["_random_samples"] = kwargs["_random_samples"].to(F32)
        module = info.module_cls(*sample.constructor_input.args, **kwargs)
        x = sample.forward_input.args[0]
        what = f"{name} [{sample.desc}: {describe_inputs([x])}]"
        eager_in, comp_in = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
        expected = tensor_leaves(module(eager_in))
        actual = tensor_leaves(
            torch.compile(copy.deepcopy(module), backend="neuron", fullgraph=True, dynamic=False)(comp_in)
        )
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, (0.0, 0.0), f"{what} output {i}")
        cotangent = torch.randn(expected[0].shape)
        expected[0].backward(cotangent)
        actual[0].backward(cotangent)
        assert_same(comp_in.grad, eager_in.grad, TOL["exact"][F32], f"{what} grad of input")


@pytest.mark.parametrize("case,dtype", _run(LINALG))
def test_linalg(case: Case, dtype: torch.dtype) -> None:
    check_compiled(case, dtype)


def test_bf16_matmul_accumulates_in_float32() -> None:
    # 256 products of 1.0 + one 2^-9: a bf16 accumulator would lose the small terms; fp32 keeps them.
    a = torch.ones(1, 512, dtype=BF16)
    b = torch.full((512, 1), 2.0**-8, dtype=BF16)
    b[0] = 1.0
    out = torch.compile(torch.mm, backend="neuron", dynamic=False)(a, b)
    assert out.dtype == BF16
    torch.testing.assert_close(out, torch.mm(a, b), rtol=0, atol=0)


# ---- activations ------------------------------------------------------------------------------------
def _act(name: str, fn: Callable[[torch.Tensor], Any], dtypes=(F32, BF16), scale: float = 3.0) -> Case:
    return nn_case(name, lambda d: (fn, [_randn(4, 16, dtype=d, scale=scale)]), dtypes)


ACTIVATIONS = [
    _act("relu", F.relu),
    _act("gelu", F.gelu),
    _act("gelu_tanh", lambda x: F.gelu(x, approximate="tanh")),
    _act("silu", F.silu),
    _act("hardtanh", lambda x: F.hardtanh(x, -0.5, 2.0)),
    _act("leaky_relu", lambda x: F.leaky_relu(x, 0.2)),
    _act("elu", lambda x: F.elu(x, alpha=1.5)),
    _act("rrelu_eval", lambda x: F.rrelu(x, 0.1, 0.3)),
]

# Activations the core-ATen decomposition turns into pointwise ops: one graph checks them all (op i
# maps input i to output i, so a mismatch still names its op).
DECOMPOSED_ACTIVATIONS = {
    "relu6": F.relu6,
    "selu": F.selu,
    "celu": lambda x: F.celu(x, alpha=0.7),
    "softplus": lambda x: F.softplus(x, beta=2.0, threshold=3.0),
    "hardsigmoid": F.hardsigmoid,
    "hardswish": F.hardswish,
    "mish": F.mish,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "logsigmoid": F.logsigmoid,
    "glu": lambda x: F.glu(x, dim=-1),
    # Kept away from the eps clamp: torch's decomposition clamps at 1-eps in float32, eager bf16 clamps at
    # bf16(1-eps) == 1.0 (inf); that difference is torch's, not the backend's.
    "logit": lambda x: torch.logit(torch.sigmoid(x * 0.25), eps=1e-3),
}


def _all_of(fns: dict[str, Callable[..., Any]]) -> Callable[..., tuple[Any, ...]]:
    ops = list(fns.values())
    return lambda *xs: tuple(op(x) for op, x in zip(ops, xs))


ACTIVATIONS.append(
    nn_case(
        "decomposed_activations",
        lambda d: (_all_of(DECOMPOSED_ACTIVATIONS), [_randn(4, 16, dtype=d, scale=4) for _ in DECOMPOSED_ACTIVATIONS]),
        labels=tuple(DECOMPOSED_ACTIVATIONS),
    )
)


@pytest.mark.parametrize("case,dtype", _run(ACTIVATIONS))
def test_activation(case: Case, dtype: torch.dtype) -> None:
    check_compiled(case, dtype)


SPECIAL_VALUE_ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "hardtanh": F.hardtanh,
    "leaky_relu": F.leaky_relu,
    "elu": F.elu,
}


def test_activation_special_values() -> None:
    # NaN propagates, infinities and huge/tiny magnitudes saturate as in eager. The reference is eager in
    # float64: eager's float32 gelu(+inf) is NaN in its AVX512 vector loop but inf in its scalar tail (and
    # in float64), so the float32 result depends on where the element falls; the limit, inf, is right.
    x = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0, 100.0, -100.0])
    fn = _all_of(SPECIAL_VALUE_ACTIVATIONS)
    xs = [x.clone() for _ in SPECIAL_VALUE_ACTIVATIONS]
    outs = torch.compile(fn, backend="neuron", dynamic=False)(*xs)
    refs = [r.float() for r in fn(*[t.double() for t in xs])]
    for name, out, ref in zip(SPECIAL_VALUE_ACTIVATIONS, outs, refs):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, equal_nan=True, msg=lambda m: f"{name}: {m}")


def test_relu_and_hardtanh_keep_integer_dtype() -> None:
    x = torch.randint(-5, 5, (3, 4))
    for fn in (F.relu, lambda t: F.hardtanh(t, -2.0, 3.0)):
        torch._dynamo.reset()
        out = torch.compile(fn, backend="neuron", dynamic=False)(x)
        assert out.dtype == torch.int64
        assert torch.equal(out, fn(x))


# ---- softmax, norms ---------------------------------------------------------------------------------
def _masked_softmax(x: torch.Tensor) -> torch.Tensor:
    # A row masked with -inf in part, as causal attention does.
    mask = torch.ones(x.shape[-2], x.shape[-1], dtype=torch.bool).tril()
    return x.masked_fill(~mask, -math.inf).softmax(-1)


NORMS = [
    nn_case(
        "softmax_last", lambda d: (lambda x: torch.softmax(x, -1), [_randn(2, 3, 16, dtype=d, scale=4)]), kind="reduce"
    ),
    nn_case(
        "softmax_dim0",
        dtypes=F32_ONLY,
        make=lambda d: (lambda x: torch.softmax(x, 0), [_randn(5, 3, dtype=d, scale=4)]),
        kind="reduce",
    ),
    nn_case(
        "log_softmax_mid", lambda d: (lambda x: F.log_softmax(x, 1), [_randn(2, 7, 3, dtype=d, scale=4)]), kind="reduce"
    ),
    nn_case("softmax_masked", lambda d: (_masked_softmax, [_randn(2, 6, 6, dtype=d)]), kind="reduce"),
    nn_case(
        "softmax_0d",
        dtypes=F32_ONLY,
        make=lambda d: (lambda x: torch.softmax(x, 0) + F.log_softmax(x, -1), [_randn(dtype=d)]),
    ),
    nn_case("layer_norm", lambda d: (nn.LayerNorm(16).to(d), [_randn(2, 3, 16, dtype=d, scale=3)]), kind="reduce"),
    nn_case(
        "layer_norm_2d_shape",
        dtypes=F32_ONLY,
        make=lambda d: (nn.LayerNorm([3, 8], eps=1e-3).to(d), [_randn(2, 3, 8, dtype=d)]),
        kind="reduce",
    ),
    nn_case(
        "layer_norm_no_affine",
        dtypes=F32_ONLY,
        make=lambda d: (nn.LayerNorm(16, elementwise_affine=False).to(d), [_randn(4, 16, dtype=d)]),
        kind="reduce",
    ),
    nn_case(
        "layer_norm_no_bias",
        dtypes=F32_ONLY,
        make=lambda d: (nn.LayerNorm(16, bias=False).to(d), [_randn(4, 16, dtype=d)]),
        kind="reduce",
    ),
    nn_case(
        # weight needs a grad, input does not: output_mask (False, True, True).
        "layer_norm_params_only",
        lambda d: (_ParamsOnly(nn.LayerNorm(16).to(d)), [_randn(4, 16, dtype=d)]),
        kind="reduce",
    ),
    nn_case(
        # output_mask (True, False, False) with a weight present.
        "layer_norm_input_only",
        dtypes=F32_ONLY,
        make=lambda d: (nn.LayerNorm(16).to(d).requires_grad_(False), [_randn(4, 16, dtype=d)]),
        kind="reduce",
    ),
    nn_case(
        # output_mask (False, True, False).
        "layer_norm_weight_only",
        dtypes=F32_ONLY,
        make=lambda d: (_ParamsOnly(_frozen_bias(nn.LayerNorm(16).to(d))), [_randn(4, 16, dtype=d)]),
        kind="reduce",
    ),
    nn_case(
        "rms_norm",
        dtypes=F32_ONLY,
        make=lambda d: (nn.RMSNorm(16, eps=1e-5).to(d), [_randn(2, 3, 16, dtype=d)]),
        kind="reduce",
    ),
    nn_case("batch_norm1d_train", lambda d: (nn.BatchNorm1d(4).to(d), [_randn(8, 4, dtype=d, scale=2)]), kind="reduce"),
    nn_case(
        "batch_norm1d_3d_train",
        dtypes=F32_ONLY,
        make=lambda d: (nn.BatchNorm1d(4, momentum=0.3).to(d), [_randn(3, 4, 5, dtype=d, scale=2)]),
        kind="reduce",
    ),
    nn_case(
        "batch_norm2d_train", lambda d: (nn.BatchNorm2d(4).to(d), [_randn(2, 4, 3, 3, dtype=d, scale=2)]), kind="reduce"
    ),
    nn_case("batch_norm2d_eval", lambda d: (_bn_eval(d), [_randn(2, 4, 3, 3, dtype=d, scale=2)]), kind="reduce"),
    nn_case(
        "batch_norm2d_no_stats",
        dtypes=F32_ONLY,
        make=lambda d: (nn.BatchNorm2d(4, track_running_stats=False).to(d), [_randn(2, 4, 3, 3, dtype=d)]),
        kind="reduce",
    ),
    nn_case(
        "batch_norm3d_no_affine",
        dtypes=F32_ONLY,
        make=lambda d: (nn.BatchNorm3d(3, affine=False).to(d), [_randn(2, 3, 2, 3, 2, dtype=d)]),
        kind="reduce",
    ),
    nn_case("group_norm", lambda d: (nn.GroupNorm(2, 4).to(d), [_randn(2, 4, 3, 3, dtype=d, scale=2)]), kind="reduce"),
    # Weight normalization: its forward decomposes (torch's table), its fused backward through ours.
    nn_case(
        "weight_norm_linear", lambda d: (_weight_norm(nn.Linear(6, 5), 0, d), [_randn(4, 6, dtype=d)]), kind="reduce"
    ),
    nn_case(
        "weight_norm_conv1d_last_dim",
        lambda d: (_weight_norm(nn.Conv1d(3, 4, 3), 2, d), [_randn(2, 3, 7, dtype=d)]),
        kind="reduce",
    ),
    nn_case(
        "spectral_norm_train",
        dtypes=F32_ONLY,
        make=lambda d: (nn.utils.parametrizations.spectral_norm(nn.Linear(6, 5)).to(d), [_randn(4, 6, dtype=d)]),
        kind="reduce",
    ),
    nn_case(
        "group_norm_no_affine_1d",
        dtypes=F32_ONLY,
        make=lambda d: (nn.GroupNorm(3, 6, affine=False).to(d), [_randn(2, 6, 5, dtype=d)]),
        kind="reduce",
    ),
]


def _weight_norm(module: nn.Module, dim: int, dtype: torch.dtype) -> nn.Module:
    return nn.utils.parametrizations.weight_norm(module, dim=dim).to(dtype)


class _ParamsOnly(nn.Module):
    """Runs ``inner`` on a detached input, so only its parameters need gradients."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.detach())


def _frozen_bias(module: nn.Module) -> nn.Module:
    module.bias.requires_grad_(False)
    return module


def _bn_eval(dtype: torch.dtype) -> nn.Module:
    bn = nn.BatchNorm2d(4)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(4))
        bn.running_var.copy_(torch.rand(4) + 0.5)
        bn.weight.copy_(torch.randn(4))
        bn.bias.copy_(torch.randn(4))
    return bn.to(dtype).eval()


@pytest.mark.parametrize("case,dtype", _run(NORMS))
def test_softmax_and_norms(case: Case, dtype: torch.dtype) -> None:
    check_compiled(case, dtype)


# ---- embedding and losses ---------------------------------------------------------------------------
def _emb(padding_idx=None, scale_grad_by_freq=False) -> Callable[[torch.dtype], tuple[Any, list[Any]]]:
    def make(d: torch.dtype) -> tuple[Any, list[Any]]:
        weight = _randn(10, 6, dtype=d)
        # Repeated indices (the gradient accumulates) and the padding index among them.
        idx = torch.tensor([[1, 3, 3, 0], [9, 1, 3, 2]])
        return (lambda w, i: F.embedding(i, w, padding_idx, scale_grad_by_freq=scale_grad_by_freq), [weight, idx])

    return make


def _nll(shape, classes, **kwargs) -> Callable[[torch.dtype], tuple[Any, list[Any]]]:
    def make(d: torch.dtype) -> tuple[Any, list[Any]]:
        kw = dict(kwargs)
        logp = F.log_softmax(_randn(*shape, classes, dtype=F32), -1).to(d)
        target = torch.randint(0, classes, shape)
        if "ignore_index" in kw and target.dim():
            target[0] = kw["ignore_index"]
        args = [logp, target] + ([torch.rand(classes).to(d)] if kw.pop("weight", False) else [])
        return (lambda x, t, *ws: F.nll_loss(x, t, *ws, **kw), args)

    return make


def _ce(**kwargs) -> Callable[[torch.dtype], tuple[Any, list[Any]]]:
    def make(d: torch.dtype) -> tuple[Any, list[Any]]:
        target = torch.tensor([0, 3, 1, 4, 3])
        return (lambda x, t: F.cross_entropy(x, t, **kwargs), [_randn(5, 6, dtype=d, scale=2), target])

    return make


LOSSES = [
    nn_case("embedding", _emb()),
    nn_case("embedding_padding_idx", dtypes=F32_ONLY, make=_emb(padding_idx=3)),
    nn_case("embedding_scale_grad_by_freq", dtypes=F32_ONLY, make=_emb(scale_grad_by_freq=True)),
    nn_case("embedding_padding_scale", _emb(padding_idx=1, scale_grad_by_freq=True)),
    nn_case("nll_mean", _nll((6,), 5), kind="reduce"),
    nn_case(
        "nll_sum_weight", dtypes=F32_ONLY, make=_nll((6,), 5, reduction="sum", weight=True), kind="reduce", frozen=(2,)
    ),
    nn_case(
        "nll_none_weight_ignore",
        dtypes=F32_ONLY,
        make=_nll((6,), 5, reduction="none", weight=True, ignore_index=2),
        frozen=(2,),
    ),
    nn_case(
        "nll_mean_weight_ignore",
        dtypes=F32_ONLY,
        make=_nll((6,), 5, weight=True, ignore_index=-100),
        kind="reduce",
        frozen=(2,),
    ),
    nn_case("nll_1d_input", dtypes=F32_ONLY, make=_nll((), 5), kind="reduce"),
    nn_case("nll_1d_input_none", dtypes=F32_ONLY, make=_nll((), 5, reduction="none")),
    nn_case("cross_entropy", _ce(), kind="reduce"),
    nn_case("cross_entropy_ignore_label_smoothing", _ce(ignore_index=3, label_smoothing=0.1), kind="reduce"),
    nn_case(
        # (N, C, H, W) logits: decomposed to gather/scatter rather than nll_loss2d.
        "cross_entropy_2d",
        dtypes=F32_ONLY,
        make=lambda d: (F.cross_entropy, [_randn(2, 5, 3, 4, dtype=d), torch.randint(0, 5, (2, 3, 4))]),
        kind="reduce",
    ),
    nn_case("cross_entropy_sum", dtypes=F32_ONLY, make=_ce(reduction="sum"), kind="reduce"),
]


@pytest.mark.parametrize("case,dtype", _run(LOSSES))
def test_embedding_and_losses(case: Case, dtype: torch.dtype) -> None:
    check_compiled(case, dtype)


def test_nll_mean_all_ignored_is_nan() -> None:
    x = F.log_softmax(torch.randn(3, 4), -1)
    t = torch.full((3,), -100)
    out = torch.compile(F.nll_loss, backend="neuron", dynamic=False)(x, t)
    assert torch.isnan(out) and torch.isnan(F.nll_loss(x, t))


def test_nll_mean_all_ignored_has_zero_gradient() -> None:
    """The loss is 0/0, but eager's backward leaves every ignored row's gradient 0 (not 0 * inf = NaN)."""
    x = F.log_softmax(torch.randn(3, 4), -1)
    t = torch.full((3,), -100)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    F.nll_loss(xe, t).backward()
    torch.compile(F.nll_loss, backend="neuron", dynamic=False)(xc, t).backward()
    assert torch.equal(xe.grad, torch.zeros(3, 4))
    torch.testing.assert_close(xc.grad, xe.grad, rtol=0, atol=0, equal_nan=True)


# ---- margin losses torch decomposes wrongly (issue 38) --------------------------------------------------
# torch 2.13's decompositions of multilabel_margin_loss and multi_margin_loss (also their Autograd kernels:
# every tracer meets them) count the target slots after a -1, give 1-d inputs a (1,) loss where eager's is
# 0-d, and give a zero margin term (a tie) a gradient; decompositions.AUTOGRAD_KERNEL_FIXES replaces them.
# Eager has no bfloat16 kernel for these losses: bfloat16 is judged against float64 eager on the same
# (bfloat16-valued) inputs, within an ulp per element.
_MARGIN_INPUTS = {
    # name: (op, input, target, kwargs)
    "multilabel 2-d -1 padded": (
        F.multilabel_margin_loss,
        [[0.3, -1.2, 0.8, 0.1], [1.5, 0.2, -0.4, 0.9]],
        [[3, 0, -1, 1], [1, -1, 0, 0]],
        {},
    ),
    "multilabel 2-d unpadded, repeated target": (
        F.multilabel_margin_loss,
        [[0.3, -1.2, 0.8, 0.1, 0.5], [1.5, 0.2, -0.4, 0.9, -2.0], [0.0, 0.25, 0.5, 0.75, 1.0]],
        [[4, 3, 2, 1, 0], [1, 1, 0, 3, 2], [-1, 0, 1, 2, 3]],
        {},
    ),
    "multilabel 1-d -1 padded": (F.multilabel_margin_loss, [0.3, -1.2, 0.8, 0.1, 0.5], [2, 0, -1, 1, 4], {}),
    "multilabel ties (z == 0)": (F.multilabel_margin_loss, [[1.0, 0.0, 5.0, 0.5]], [[0, -1, 1, 1]], {}),
    "multi_margin 2-d": (F.multi_margin_loss, [[0.3, -1.2, 0.8, 0.1], [1.5, 0.2, -0.4, 0.9]], [2, 0], {}),
    "multi_margin 1-d, 0-d target": (F.multi_margin_loss, [0.3, -1.2, 0.8, 0.1, 0.5], 3, {}),
    "multi_margin 1-d, (1,) target": (F.multi_margin_loss, [0.3, -1.2, 0.8, 0.1, 0.5], [3], {}),
    "multi_margin ties p=1 (z == 0)": (F.multi_margin_loss, [[1.0, 0.0, 5.0, 0.5]], [0], {}),
    "multi_margin p=2 weight margin": (
        F.multi_margin_loss,
        [[0.3, -1.2, 0.8, 0.1], [1.5, 0.2, -0.4, 0.9]],
        [2, 0],
        {"p": 2, "margin": 0.7, "weight": [0.5, 2.0, 1.0, 0.25]},
    ),
}
_MARGIN_CASES = [
    (name, reduction, dtype)
    for name in _MARGIN_INPUTS
    for reduction in ("none", "mean", "sum")
    for dtype in (F32, BF16)
]


@pytest.mark.parametrize(
    "name,reduction,dtype",
    _MARGIN_CASES,
    ids=[f"{n}-{r}-{str(d).split('.')[-1]}" for n, r, d in _MARGIN_CASES],
)
def test_margin_loss_matches_eager(name: str, reduction: str, dtype: torch.dtype) -> None:
    op, x, target, kwargs = _MARGIN_INPUTS[name]
    x = torch.tensor(x).to(dtype)
    target = torch.tensor(target)
    weight = torch.tensor(kwargs["weight"]).to(dtype) if "weight" in kwargs else None
    kw = {k: v for k, v in kwargs.items() if k != "weight"}
    what = f"{op.__name__}({name}: {dtype}{list(x.shape)}, target {target.tolist()}, {kw}, reduction={reduction})"

    def loss(inp: torch.Tensor, w: torch.Tensor | None = weight) -> torch.Tensor:
        return op(inp, target, reduction=reduction, **({"weight": w} if w is not None else {}), **kw)

    xc = x.clone().requires_grad_()
    actual = torch.compile(loss, backend="neuron", dynamic=False, fullgraph=True)(xc)
    cotangent = torch.linspace(0.5, 1.5, actual.numel()).reshape(actual.shape).to(dtype)
    actual.backward(cotangent)
    if dtype == F32:
        xe = x.clone().requires_grad_()
        expected = loss(xe)
        expected.backward(cotangent)
        tol = (1e-5, 1e-6)
    else:  # eager has no bfloat16 kernel: float64 on the same values, then one bf16 ulp per element
        xe = x.double().requires_grad_()
        expected = loss(xe, None if weight is None else weight.double())
        expected.backward(cotangent.double())
        tol = (2.0**-8, 1e-6)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != eager {tuple(expected.shape)}"
    rtol, atol = tol
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
    torch.testing.assert_close(
        xc.grad.double(), xe.grad.double(), rtol=rtol, atol=atol, msg=lambda m: f"{what} gradient: {m}"
    )


@pytest.mark.parametrize("reduction", [0, 1, 2], ids=["none", "mean", "sum"])
@pytest.mark.parametrize("shape", ["2-d", "1-d"])
def test_multilabel_margin_aten_pair_matches_eager(reduction: int, shape: str) -> None:
    """The forward aten op (loss and is_target) and eager's backward op, as a graph traced without the Python
    dispatcher holds them (decompositions.OWN_DECOMPOSITIONS)."""
    x = torch.tensor([[0.3, -1.2, 0.8, 0.1], [1.5, 0.2, -0.4, 0.9]])
    t = torch.tensor([[3, 0, -1, 1], [1, -1, 0, 0]])
    if shape == "1-d":
        x, t = x[0], t[0]
    fwd = torch.ops.aten.multilabel_margin_loss_forward
    bwd = torch.ops.aten.multilabel_margin_loss_backward
    loss, is_target = fwd(x, t, reduction)
    grad_out = torch.full_like(loss, 0.75)
    what = f"multilabel_margin_loss {shape} reduction={reduction}"
    actual = torch.compile(lambda a, b: fwd(a, b, reduction), backend="neuron", dynamic=False, fullgraph=True)(x, t)
    for a, e, part in zip(actual, (loss, is_target), ("loss", "is_target")):
        assert a.shape == e.shape, f"{what} {part}: shape {tuple(a.shape)} != eager {tuple(e.shape)}"
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what} {part}: {m}")
    grad = torch.compile(
        lambda g, a, b, i: bwd(g, a, b, reduction, i), backend="neuron", dynamic=False, fullgraph=True
    )(grad_out, x, t, is_target)
    torch.testing.assert_close(grad, bwd(grad_out, x, t, reduction, is_target), rtol=1e-6, atol=1e-6, msg=what)


def test_smooth_l1_negative_beta_is_an_error_as_in_eager() -> None:
    """torch's decomposition lacks eager's check (pytorch/pytorch#194501): compiled returned a value."""
    x, y = torch.randn(4), torch.randn(4)
    with pytest.raises(RuntimeError, match="negative values for beta"):
        F.smooth_l1_loss(x, y, beta=-1.0)
    with pytest.raises(Exception, match="negative values for beta"):
        torch.compile(lambda a, b: F.smooth_l1_loss(a, b, beta=-1.0), backend="neuron", dynamic=False)(x, y)


# ---- convolution ------------------------------------------------------------------------------------
def _conv(fn, x_shape, w_shape, bias: bool = True, **kwargs) -> Callable[[torch.dtype], tuple[Any, list[Any]]]:
    def make(d: torch.dtype) -> tuple[Any, list[Any]]:
        args = [_randn(*x_shape, dtype=d), _randn(*w_shape, dtype=d, scale=0.5)]
        if bias:
            out_channels = w_shape[0] if fn not in _TRANSPOSED else w_shape[1] * kwargs.get("groups", 1)
            args.append(_randn(out_channels, dtype=d))
        return (lambda x, w, *b: fn(x, w, *b, **kwargs), args)

    return make


_TRANSPOSED = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)

CONVS = [
    nn_case("conv1d", dtypes=F32_ONLY, make=_conv(F.conv1d, (2, 4, 9), (6, 4, 3), padding=1), kind="reduce"),
    nn_case(
        "conv1d_stride_dilation",
        dtypes=F32_ONLY,
        make=_conv(F.conv1d, (2, 4, 12), (6, 2, 3), stride=2, dilation=2, groups=2),
        kind="reduce",
    ),
    nn_case("conv2d", _conv(F.conv2d, (2, 3, 6, 6), (4, 3, 3, 3)), kind="reduce"),
    nn_case(
        "conv2d_no_bias_pad",
        dtypes=F32_ONLY,
        make=_conv(F.conv2d, (2, 3, 5, 7), (4, 3, 3, 2), bias=False, padding=(1, 2)),
        kind="reduce",
    ),
    # stride 2 over 8 with a 3-kernel leaves the last input row unused: its gradient must be zero.
    nn_case(
        "conv2d_stride_uncovered",
        dtypes=F32_ONLY,
        make=_conv(F.conv2d, (1, 2, 8, 8), (3, 2, 3, 3), stride=2),
        kind="reduce",
    ),
    nn_case(
        "conv2d_groups_depthwise",
        dtypes=F32_ONLY,
        make=_conv(F.conv2d, (2, 4, 6, 6), (4, 1, 3, 3), padding=1, groups=4),
        kind="reduce",
    ),
    nn_case(
        "conv2d_same",
        dtypes=F32_ONLY,
        make=_conv(F.conv2d, (1, 2, 6, 6), (3, 2, 4, 3), padding="same", dilation=(1, 2)),
        kind="reduce",
        # An even kernel makes 'same' padding asymmetric: torch pads a copy first, and says so.
        marks=[pytest.mark.filterwarnings("ignore:Using padding='same'")],
    ),
    nn_case(
        "conv3d",
        dtypes=F32_ONLY,
        make=_conv(F.conv3d, (1, 2, 4, 5, 4), (3, 2, 2, 3, 2), padding=1, stride=(1, 2, 1)),
        kind="reduce",
    ),
    nn_case(
        "conv_transpose1d",
        dtypes=F32_ONLY,
        make=_conv(F.conv_transpose1d, (2, 4, 5), (4, 3, 3), stride=2),
        kind="reduce",
    ),
    nn_case(
        "conv_transpose2d_full",
        _conv(
            F.conv_transpose2d, (2, 4, 4, 5), (4, 3, 3, 3), stride=2, padding=1, output_padding=1, groups=2, dilation=2
        ),
        kind="reduce",
    ),
    nn_case(
        "conv_transpose3d",
        dtypes=F32_ONLY,
        make=_conv(F.conv_transpose3d, (1, 2, 3, 3, 2), (2, 3, 2, 2, 2), stride=(2, 1, 2)),
        kind="reduce",
    ),
    nn_case(  # output_padding >= stride (torch allows it below the dilation): the input gradient is cut to size
        "conv_transpose2d_output_padding_past_stride",
        dtypes=F32_ONLY,
        make=_conv(
            F.conv_transpose2d,
            (2, 2, 4, 4),
            (2, 2, 4, 5),
            stride=(3, 2),
            padding=(1, 2),
            output_padding=(2, 3),
            groups=2,
            dilation=4,
        ),
        kind="reduce",
    ),
]


@pytest.mark.parametrize("case,dtype", _run(CONVS))
def test_convolution(case: Case, dtype: torch.dtype) -> None:
    check_compiled(case, dtype)


# ---- what follows a convolution: kept channels-last on the CPU target (lowering/layout.py) ------------
class _ConvThen(nn.Module):
    """A convolution (3-d for ``dims == 3``), then ``then`` of its result and the input."""

    def __init__(self, then: Callable[..., Any], dims: int = 2, c_in: int = 4, c_out: int = 6, stride: int = 1):
        super().__init__()
        conv = nn.Conv3d if dims == 3 else nn.Conv2d
        self.conv = conv(c_in, c_out, 3, stride=stride, padding=1)
        self.conv2 = conv(c_out, c_out, 3, padding=1, bias=False)
        self.bn = (nn.BatchNorm3d if dims == 3 else nn.BatchNorm2d)(c_out)
        self.scale = nn.Parameter(torch.randn(c_out, *([1] * dims)))
        self.then = then

    def forward(self, x: torch.Tensor) -> Any:
        return self.then(self, self.conv(x))


def _conv_then(
    then: Callable[..., Any], dims: int = 2, **kwargs: Any
) -> Callable[[torch.dtype], tuple[Any, list[Any]]]:
    def make(d: torch.dtype) -> tuple[Any, list[Any]]:
        shape = (2, kwargs.get("c_in", 4), 6, 5, 4) if dims == 3 else (2, kwargs.get("c_in", 4), 7, 6)
        return _ConvThen(then, dims, **kwargs).to(d), [_randn(*shape, dtype=d)]

    return make


AFTER_CONV = [
    # float32 only: two batch norms over 84 values per channel amplify a bf16 rounding of the first past
    # an elementwise tolerance (with or without layout.py); bf16 training is judged in test_models.
    nn_case("bn_relu_conv_bn", _conv_then(lambda m, y: m.bn(m.conv2(F.relu(m.bn(y))))), F32_ONLY, kind="reduce"),
    nn_case(
        "bn_relu_large", _conv_then(lambda m, y: F.relu(m.bn(y)), c_in=32, c_out=32, stride=2), F32_ONLY, kind="reduce"
    ),
    nn_case("conv3d_bn_relu", _conv_then(lambda m, y: F.relu(m.bn(y)), dims=3), F32_ONLY, kind="reduce"),
    # bfloat16: eager's weight gradient is ISA-dependent (oneDNN vs ATen's per-sample rounding), so it is judged
    # against float64 by tests/test_bf16_numerics.py::test_bf16_conv_then_broadcast_scale_within_bound.
    nn_case("broadcast_param", _conv_then(lambda m, y: y * m.scale + 1), F32_ONLY, kind="reduce"),
    nn_case(
        "broadcast_lower_rank", _conv_then(lambda m, y: y + torch.arange(6.0, dtype=y.dtype)), F32_ONLY, kind="reduce"
    ),
    nn_case("mean_spatial", _conv_then(lambda m, y: y.mean(dim=(2, 3))), kind="reduce"),
    nn_case("sum_channels_keepdim", _conv_then(lambda m, y: y.sum(dim=1, keepdim=True) * y), F32_ONLY, kind="reduce"),
    nn_case("sum_batch_width", _conv_then(lambda m, y: y.sum(dim=(0, -1))), F32_ONLY, kind="reduce"),
    nn_case("where_mask", _conv_then(lambda m, y: torch.where(y > 0, y, 0.1 * y)), F32_ONLY, kind="reduce"),
    nn_case("flatten_view", _conv_then(lambda m, y: F.gelu(y).flatten(1)), F32_ONLY, kind="reduce"),
    nn_case("cat_channels", _conv_then(lambda m, y: torch.cat([y, F.relu(y)], dim=1)), F32_ONLY, kind="reduce"),
    nn_case("softmax_channels", _conv_then(lambda m, y: y.softmax(dim=1)), F32_ONLY, kind="reduce"),
    nn_case("two_outputs", _conv_then(lambda m, y: (F.relu(y), m.bn(y).permute(0, 2, 3, 1))), F32_ONLY, kind="reduce"),
    nn_case(
        "then_transposed_conv",
        _conv_then(lambda m, y: F.conv_transpose2d(F.relu(y), m.conv2.weight, stride=2, padding=1)),
        F32_ONLY,
        kind="reduce",
    ),
    nn_case(
        "channels_last_inputs",
        make=lambda d: (
            lambda mod, x: (
                mod.to(memory_format=torch.channels_last),
                [x[0].contiguous(memory_format=torch.channels_last)],
            )
        )(*_conv_then(lambda m, y: F.relu(m.bn(m.conv2(y))))(d)),
        dtypes=F32_ONLY,
        kind="reduce",
    ),
    nn_case(
        "eval_bn",
        make=lambda d: (lambda mod, x: (mod.eval(), x))(*_conv_then(lambda m, y: F.relu(m.bn(y)))(d)),
        dtypes=F32_ONLY,
        kind="reduce",
    ),
]


@pytest.mark.parametrize("case,dtype", _run(AFTER_CONV))
def test_after_convolution(case: Case, dtype: torch.dtype) -> None:
    """Elementwise ops, reductions, batch norm and the convolution backward on a convolution's result
    (channels-last inside the graph), and the ops that need torch's layout back (views, cat, softmax),
    match eager forward and backward."""
    check_compiled(case, dtype)


def test_convolution_chain_keeps_channels_last() -> None:
    """conv -> batch norm -> relu -> conv: the lowering transposes the input in and the result out, and
    nothing in between (XLA CPU would transpose around each convolution)."""
    import re

    from torch._dynamo.backends.common import aot_autograd

    from neuron_compile.lowering import lower_graph

    model = _ConvThen(lambda m, y: m.conv2(F.relu(m.bn(y))), c_in=32, c_out=32)  # not patches (see above)
    captured: list[Any] = []

    def grab(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        captured.append((gm, example_inputs))
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model.eval(), backend=aot_autograd(fw_compiler=grab))(torch.randn(2, 32, 7, 6))
    gm, inputs = captured[0]
    cpu_text = lower_graph(gm, inputs, "chain", target="cpu").stablehlo()
    neuron_text = lower_graph(gm, inputs, "chain", target="neuron").stablehlo()
    transposes = re.findall(r"stablehlo.transpose .* dims = \[([\d, ]+)\]", cpu_text)
    assert transposes.count("0, 2, 3, 1") == 1 and set(transposes) == {"0, 2, 3, 1", "0, 3, 1, 2"}, cpu_text
    assert "stablehlo.transpose" not in neuron_text


def test_saved_activations_stay_channels_last_into_the_backward() -> None:
    """The forward hands the backward its channels-last activations with channels-last strides (no
    transpose out, none back in); what the user sees keeps eager's strides, and the step matches eager."""
    from neuron_compile.artifact import channels_last_strides
    from neuron_compile.compiler import HOOKS

    torch.manual_seed(0)
    model = _ConvThen(lambda m, y: F.relu(m.bn(m.conv2(F.relu(m.bn(y))))), c_in=32, c_out=32)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 32, 7, 6)
    lowered: list[Any] = []
    HOOKS.on_lowered.append(lowered.append)
    try:
        torch._dynamo.reset()
        out = torch.compile(model, backend="neuron", dynamic=False, options={"cache": False})(x)
        out.sum().backward()
    finally:
        HOOKS.on_lowered.remove(lowered.append)
    expected = reference(x)
    expected.sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4, msg=lambda m: f"grad of {name}: {m}")
    assert out.is_contiguous()
    forward = next(g for g in lowered if g.name.endswith("forward"))
    backward = next(g for g in lowered if g.name.endswith("backward"))
    shape = (2, 32, 7, 6)
    saved = [o for o in forward.outputs if o.stride == channels_last_strides(shape)]
    taken = [i for i in backward.inputs if getattr(i, "perm", None) == (0, 2, 3, 1)]
    assert len(saved) >= 3 and len(taken) >= 3, (forward.outputs, backward.inputs)


@pytest.mark.parametrize(
    "channels,cpu_form",
    [((3, 16), "dot_general"), ((16, 32), "convolution")],
    ids=["3to16_patches_on_cpu", "16to32_convolution"],
)
def test_small_convolution_is_a_dot_on_cpu_only(channels: tuple[int, int], cpu_form: str) -> None:
    """XLA CPU's generic kernel for a convolution with <= 16 channels is slow, so the CPU target computes
    it as patches x weight (test_convolution checks its numerics); neuronx-cc always gets the convolution."""
    from torch._dynamo.backends.common import aot_autograd

    from neuron_compile.lowering import lower_graph

    c_in, c_out = channels
    captured: list[Any] = []

    def grab(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        captured.append((gm, example_inputs))
        return gm

    torch._dynamo.reset()
    conv = lambda x, w: F.conv2d(x, w, padding=1)  # noqa: E731
    torch.compile(conv, backend=aot_autograd(fw_compiler=grab))(
        torch.randn(2, c_in, 8, 8), torch.randn(c_out, c_in, 3, 3)
    )
    gm, inputs = captured[0]
    cpu_text = lower_graph(gm, inputs, "conv", target="cpu").stablehlo()
    neuron_text = lower_graph(gm, inputs, "conv", target="neuron").stablehlo()
    assert "stablehlo.convolution" in neuron_text
    assert f"stablehlo.{cpu_form}" in cpu_text
    if cpu_form == "dot_general":
        assert "stablehlo.convolution" not in cpu_text
