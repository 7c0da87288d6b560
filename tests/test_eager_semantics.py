"""What eager does with tensors, done the same: outputs that alias each other or an input (and writes
through them), eager's output strides, in-range casts, the tensor kinds and devices the backend refuses with
a clear error, meta inputs, a forked child, and debug dumps on a warm cache."""

from __future__ import annotations

import pathlib
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import neuron_compile
from neuron_compile import NeuronUnsupportedOpError

Fn = Callable[..., Any]


def _compile(fn: Fn, **options: Any) -> Fn:
    return torch.compile(fn, backend="neuron", dynamic=False, options=options or None)


# -- item 3: outputs that alias each other ------------------------------------------------------------
def _view(x):
    y = x * 2
    return y, y.view(-1)


def _reshape(x):
    y = x * 2
    return y.reshape(3, 4), y


def _transpose(x):
    y = x + 1
    return y.t(), y


def _slices(x):
    y = x - 1
    return y, y[1:], y[:, ::2]


def _unsqueeze(x):
    y = x.exp()
    return y.unsqueeze(0), y


def _two_views_of_hidden(x):
    y = x * 3
    return y.view(-1), y[0], y.t()


def _with_input_view(x):
    y = x.sin()
    return x.view(-1), y, y[:, 1]


def _split(x):
    y = x * 2
    return y.split(2)


def _select_scalar(x):
    y = x + 2
    return y, y[1, 2]


ALIAS_CASES = [
    _view,
    _reshape,
    _transpose,
    _slices,
    _unsqueeze,
    _two_views_of_hidden,
    _with_input_view,
    _split,
    _select_scalar,
]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _sharing(x: torch.Tensor, outs: tuple[torch.Tensor, ...]) -> list[list[bool]]:
    ts = (x, *outs)
    return [[_storage(a) == _storage(b) for b in ts] for a in ts]


def _write_effects(fn: Fn, make_x: Callable[[], torch.Tensor]) -> list[list[bool]]:
    """For each output i: writing into output i changes which of (input, outputs...)."""
    effects = []
    n = len(fn(make_x()))
    for i in range(n):
        x = make_x()
        outs = fn(x)
        with torch.no_grad():
            before = [t.detach().clone() for t in (x, *outs)]
            target = outs[i]
            target[(0,) * target.dim()] = 1234.5
            effects.append([not torch.equal(b, t.detach()) for b, t in zip(before, (x, *outs))])
    return effects


@pytest.mark.parametrize("requires_grad", [False, True], ids=["forward", "training"])
@pytest.mark.parametrize("fn", ALIAS_CASES, ids=lambda f: f.__name__.strip("_"))
def test_output_aliasing_and_write_through_match_eager(fn: Fn, requires_grad: bool) -> None:
    base = torch.randn(4, 3)

    def make_x() -> torch.Tensor:
        return base.clone().requires_grad_(requires_grad)

    cfn = _compile(fn)
    x_e, x_c = make_x(), make_x()
    eager, compiled = fn(x_e), cfn(x_c)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e)
        assert c.stride() == e.stride() and c.storage_offset() == e.storage_offset(), fn.__name__
    assert _sharing(x_c, compiled) == _sharing(x_e, eager), fn.__name__
    assert _write_effects(cfn, make_x) == _write_effects(fn, make_x), fn.__name__
    if requires_grad:
        sum(o.sum() for o in fn(x_e)).backward()
        sum(o.sum() for o in cfn(x_c)).backward()
        torch.testing.assert_close(x_c.grad, x_e.grad)


def test_aliasing_survives_a_warm_cache(tmp_path: pathlib.Path) -> None:
    x = torch.randn(4, 3)
    for _ in ("cold", "warm"):
        torch._dynamo.reset()
        neuron_compile.STATS.reset()
        a, b = _compile(_view, cache_dir=str(tmp_path))(x)
        assert _storage(a) == _storage(b)
    assert [g.cache for g in neuron_compile.STATS.graphs] == ["hit"]


def _linear_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b)).sum()


def _transposed_weight(x, w, b):
    return (x @ w.t() + b).tanh().sum()


def _scaled_input(x, w, b):
    return (x * w[:, :8].sum(0) * 3).sum() + b.sum()


@pytest.mark.parametrize("fn", [_linear_gelu, _transposed_weight, _scaled_input], ids=lambda f: f.__name__.strip("_"))
def test_inputs_saved_for_backward_are_the_inputs_not_copies(fn: Fn) -> None:
    """What the forward saves for backward that is an input (or a view of one) is that input, as in eager:
    an executable result would be a copy of it (a weight's worth of memory and time per step)."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(4, 8, generator=g), torch.randn(16, 8, generator=g), torch.randn(16, generator=g)

    def saved(f: Fn) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
        packed: list[torch.Tensor] = []
        args = (x, w.clone().requires_grad_(), b.clone().requires_grad_())
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            f(*args).backward()
        return [t for t in packed if any(_is_copy_or_alias_of(t, a) for a in (x, *args[1:]))], args

    cfn = _compile(fn)
    cfn(x, w.clone().requires_grad_(), b.clone().requires_grad_())  # compiled outside the hooks
    from_inputs, args = saved(cfn)
    assert from_inputs, f"{fn.__name__}: nothing saved from the inputs (test does not test)"
    for t in from_inputs:
        assert any(_storage(t) == _storage(a) for a in (x, *args[1:])), (
            f"{fn.__name__}: a {tuple(t.shape)} tensor saved for backward is a copy of an input"
        )


def _is_copy_or_alias_of(t: torch.Tensor, a: torch.Tensor) -> bool:
    """Same elements as ``a`` in any layout (a transposed copy included)."""
    return t.numel() == a.numel() and torch.equal(
        t.detach().flatten().sort().values, a.detach().flatten().sort().values
    )


# -- item 8: layouts and casts ------------------------------------------------------------------------
def _conv_channels_last(x, w):
    return F.conv2d(x, w, padding=1)


def _pointwise_channels_last(x, w):
    return x * 2 + 1, w.abs()


def _transposed_output(x, w):
    return (x + 1).permute(0, 2, 3, 1), (w * 2).transpose(0, 1)


def _contiguous_of_view(x, w):
    return (x + 1).transpose(1, 3).contiguous(), F.relu(x).contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("requires_grad", [False, True], ids=["forward", "training"])
@pytest.mark.parametrize(
    "fn",
    [_conv_channels_last, _pointwise_channels_last, _transposed_output, _contiguous_of_view],
    ids=lambda f: f.__name__.strip("_"),
)
def test_output_strides_match_eager(fn: Fn, requires_grad: bool) -> None:
    x = torch.randn(2, 3, 5, 4).to(memory_format=torch.channels_last).requires_grad_(requires_grad)
    w = torch.randn(4, 3, 3, 3).to(memory_format=torch.channels_last).requires_grad_(requires_grad)
    eager = fn(x, w)
    compiled = _compile(fn)(x, w)
    for e, c in zip(*(o if isinstance(o, tuple) else (o,) for o in (eager, compiled))):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)
        assert c.stride() == e.stride(), f"{fn.__name__}: strides {c.stride()} vs eager {e.stride()}"


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.int64])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16])
def test_in_range_float_to_int_casts_are_exact(src: torch.dtype, dtype: torch.dtype) -> None:
    # Out-of-range casts are undefined in torch (docs/numerics.md); in-range ones truncate toward zero.
    lo = 0 if dtype == torch.uint8 else -100
    x = torch.tensor([lo + 0.0, lo + 0.75, -0.5 if lo else 0.5, 0.0, 1.5, 99.9, 100.0], dtype=src)
    got = _compile(lambda t: t.to(dtype))(x)
    assert got.dtype == dtype and torch.equal(got, x.to(dtype)), (src, dtype, got, x.to(dtype))


# -- item 4: tensor kinds Dynamo keeps to itself, and what the backend does if handed one -------------
def _qint8() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: quantized tensor creation is deprecated
        return torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)


def _strided_nested() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: strided nested tensors are a prototype
        return torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.to_padded_tensor(0.0) if t.is_nested else t


KIND_CASES = [
    pytest.param(_qint8, lambda t: t.dequantize() * 2, "(?i)quantized", id="qint8"),
    pytest.param(_strided_nested, lambda t: t * 2, "(?i)strided NestedTensor", id="strided-nested"),
]


@pytest.mark.parametrize("make, fn, reason", KIND_CASES)
def test_dynamo_never_hands_these_kinds_to_the_backend(make: Callable, fn: Fn, reason: str) -> None:
    # What docs/semantics.md says: Dynamo runs such a frame in eager itself (the backend is never called, so it
    # cannot refuse or warn); fullgraph=True turns that into Dynamo's error naming the kind.
    x = make()
    neuron_compile.STATS.reset()
    out = _compile(fn)(x)
    ref = fn(x)
    assert torch.equal(_dense(out), _dense(ref))
    assert neuron_compile.STATS.count() == 0, (
        "Dynamo handed the frame to the backend: update docs/semantics.md and this test"
    )
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=reason):
        torch.compile(fn, backend="neuron", dynamic=False, fullgraph=True)(x)


def _fx_graph(n_inputs: int) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    xs = [graph.placeholder(f"x{i}") for i in range(n_inputs)]
    graph.output(tuple(xs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize(
    "make, reason",
    [
        (_qint8, "quantized tensor"),
        (_strided_nested, "nested tensor"),
        (lambda: torch.zeros(3, dtype=torch.complex32), "dtype torch.complex32"),  # complex64/128 run as pairs
    ],
    ids=["qint8", "strided-nested", "complex"],
)
def test_backend_refuses_these_kinds_when_handed_them(make: Callable, reason: str) -> None:
    from neuron_compile.backend import neuron_backend

    with pytest.raises(NeuronUnsupportedOpError, match=reason):
        neuron_backend(_fx_graph(1), [make()])


# -- item 5: meta and other devices --------------------------------------------------------------------
def _meta_fn(x, w):
    y = F.conv2d(x, w, padding=1)
    return y, y.sum(dim=(2, 3)), (x * 2).transpose(1, 3)


@pytest.mark.parametrize("requires_grad", [False, True], ids=["forward", "training"])
def test_meta_inputs_give_meta_outputs_like_eager(requires_grad: bool) -> None:
    x = torch.empty(2, 3, 5, 4, device="meta").to(memory_format=torch.channels_last).requires_grad_(requires_grad)
    w = torch.empty(4, 3, 3, 3, device="meta").requires_grad_(requires_grad)
    eager, compiled = _meta_fn(x, w), _compile(_meta_fn)(x, w)
    for e, c in zip(eager, compiled):
        assert c.is_meta and (c.shape, c.dtype, c.stride()) == (e.shape, e.dtype, e.stride())
    if requires_grad:
        sum(o.sum() for o in compiled).backward()
        assert x.grad is not None and x.grad.is_meta and x.grad.shape == x.shape


def test_non_cpu_device_is_a_clear_error() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from neuron_compile.backend import neuron_backend

    with FakeTensorMode():  # a CUDA tensor's metadata, without CUDA
        x = torch.empty(3, 2, device="cuda")
    with pytest.raises(NeuronUnsupportedOpError) as info:
        neuron_backend(_fx_graph(1), [x])
    msg = str(info.value)
    assert "cuda:0" in msg and "float32[3, 2]" in msg and ".cpu()" in msg, msg


_FORK_SCRIPT = """
import os, torch
from neuron_compile import NeuronForkedProcessError
f = torch.compile(lambda t: (t @ t.T).relu(), backend="neuron", dynamic=False)
f(torch.randn(64, 64))
for what, x in [("run", torch.randn(64, 64)), ("compile", torch.randn(32, 64))]:
    pid = os.fork()
    if pid == 0:
        try:
            f(x)
            os._exit(1)
        except Exception as e:  # a compile error reaches the caller wrapped by Dynamo
            while e is not None and not isinstance(e, NeuronForkedProcessError):
                e = e.__cause__ or e.__context__
            os._exit(0 if e is not None and "spawn" in str(e) else 2)
    _, status = os.waitpid(pid, 0)
    print(what, os.waitstatus_to_exitcode(status))
print("parent", f(torch.randn(32, 64)).shape)
"""


def test_a_forked_child_gets_a_clear_error_instead_of_a_hang() -> None:
    """XLA's threads do not survive os.fork (a DataLoader worker, a fork pool): in the child, running or
    compiling a graph used to hang forever; it raises NeuronForkedProcessError, and the parent carries on."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:3] == ["run 0", "compile 0", "parent torch.Size([32, 32])"], proc.stdout


# -- item 9: debug dumps on a warm cache ---------------------------------------------------------------
def test_debug_dump_is_written_on_a_warm_cache(tmp_path: pathlib.Path) -> None:
    fn, x = (lambda t: t.sin() * 2), torch.randn(5)
    cache = tmp_path / "cache"
    _compile(fn, cache_dir=str(cache))(x)  # warms the cache
    torch._dynamo.reset()
    neuron_compile.STATS.reset()
    debug = tmp_path / "debug"
    out = _compile(fn, cache_dir=str(cache), debug_dir=str(debug))(x)
    torch.testing.assert_close(out, fn(x))
    dumps = sorted(p.name for p in debug.rglob("*") if p.is_file())
    assert {"fx_graph.py", "stablehlo.mlir", "timings.json"} <= set(dumps), dumps
