"""User NKI kernels through ``neuron_compile.nki_op``: one torch custom op, the same values and gradients
in eager (emulator), compiled (one graph node, host callback into the emulator) and a pure-torch
reference; fake tensors run the kernel in shape-only mode, so hardware-rule violations surface while
torch.compile traces."""

from __future__ import annotations

import re

import pytest
import torch

import neuron_compile
from neuron_compile import nki
from neuron_compile.lowering import lower_graph
from neuron_compile.stats import STATS

nl, nisa = nki.language, nki.isa
P = 128


@nki.jit
def axpy_kernel(x, y, alpha):
    """out = alpha * x + y over [R, C], R tiled by 128 partitions (the last tile ragged)."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    rows, cols = x.shape
    for r0 in range(0, rows, P):
        n = min(P, rows - r0)
        a = nl.ndarray((P, cols), x.dtype, buffer=nl.sbuf)
        b = nl.ndarray((P, cols), y.dtype, buffer=nl.sbuf)
        nisa.dma_copy(a[:n], x[r0 : r0 + n])
        nisa.dma_copy(b[:n], y[r0 : r0 + n])
        nisa.tensor_scalar(a[:n], a[:n], nl.multiply, alpha)
        nisa.tensor_tensor(a[:n], a[:n], b[:n], nl.add)
        nisa.dma_copy(out[r0 : r0 + n], a[:n])
    return out


@nki.jit
def scale_kernel(x, alpha):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    rows, cols = x.shape
    for r0 in range(0, rows, P):
        n = min(P, rows - r0)
        a = nl.ndarray((P, cols), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(a[:n], x[r0 : r0 + n])
        nisa.tensor_scalar(a[:n], a[:n], nl.multiply, alpha)
        nisa.dma_copy(out[r0 : r0 + n], a[:n])
    return out


@nki.jit
def scale_in_place_kernel(x, alpha):
    """Writes alpha * x back into its HBM argument (no output)."""
    rows, cols = x.shape
    for r0 in range(0, rows, P):
        n = min(P, rows - r0)
        a = nl.ndarray((P, cols), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(a[:n], x[r0 : r0 + n])
        nisa.tensor_scalar(a[:n], a[:n], nl.multiply, alpha)
        nisa.dma_copy(x[r0 : r0 + n], a[:n])


@nki.jit
def untiled_copy_kernel(x):
    """Loads all rows onto the partitions at once: illegal beyond 128 rows."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    a = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(a, x)
    nisa.dma_copy(out, a)
    return out


@neuron_compile.nki_op("nc_test::axpy")
def axpy(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    return axpy_kernel(x, y, alpha)


@neuron_compile.nki_op("nc_test::scale")
def scale(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return scale_kernel(x, alpha)


def _axpy_setup(ctx, inputs, output) -> None:
    ctx.alpha = inputs[2]


def _axpy_backward(ctx, grad: torch.Tensor):
    return scale(grad, ctx.alpha), grad, None  # the backward is a user kernel too


axpy.register_autograd(_axpy_backward, setup_context=_axpy_setup)


@neuron_compile.nki_op("nc_test::scale_", mutates_args=("x",))
def scale_(x: torch.Tensor, alpha: float) -> None:
    scale_in_place_kernel(x, alpha)


@neuron_compile.nki_op("nc_test::untiled_copy")
def untiled_copy(x: torch.Tensor) -> torch.Tensor:
    return untiled_copy_kernel(x)


def _model(x: torch.Tensor, y: torch.Tensor, op=None) -> torch.Tensor:
    z = axpy(x, y, 0.5) if op is None else op(x, y)
    return torch.tanh(z).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [6, 130])
def test_user_kernel_matches_torch_in_eager_and_compiled(rows: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x0, y0 = torch.randn(rows, 24).to(dtype), torch.randn(rows, 24).to(dtype)

    def grads(fn):
        x, y = x0.clone().requires_grad_(), y0.clone().requires_grad_()
        out = fn(x, y)
        out.backward()
        return out.detach(), x.grad, y.grad

    reference = grads(lambda x, y: _model(x, y, lambda a, b: 0.5 * a + b))
    eager = grads(_model)
    torch._dynamo.reset()
    before = len(STATS.graphs)
    compiled = grads(torch.compile(_model, backend="neuron"))
    graphs = STATS.graphs[before:]
    assert {g.kind for g in graphs} == {"forward", "backward"}
    assert all(g.nki_kernels == 1 and g.cache == "off" for g in graphs), graphs  # host callbacks: no disk cache
    tol = {"rtol": 2e-5, "atol": 2e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    for name, e, c, r in zip(["out", "dx", "dy"], eager, compiled, reference):
        torch.testing.assert_close(c, e, **tol, msg=lambda m: f"compiled vs eager {name}: {m}")
        torch.testing.assert_close(e, r, **tol, msg=lambda m: f"eager vs torch {name}: {m}")


def test_mutates_args_updates_the_declared_argument() -> None:
    x = torch.randn(5, 8)
    expected = x * 3.0
    eager = x.clone()
    scale_(eager, 3.0)
    torch.testing.assert_close(eager, expected)

    def f(x: torch.Tensor) -> torch.Tensor:
        w = x * 1.0
        scale_(w, 3.0)
        return w + 1

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, backend="neuron")(x), expected + 1)


def test_fake_tensors_run_the_kernel_shape_only() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = axpy(torch.empty(300, 7), torch.empty(300, 7), 2.0)
    assert out.shape == (300, 7) and out.dtype == torch.float32


def test_hardware_rule_violation_surfaces_while_tracing() -> None:
    """200 rows on the partition dim: the emulator's rule fires in the fake implementation, naming 128,
    before anything runs."""
    torch._dynamo.reset()
    with pytest.raises(Exception, match="128") as info:
        torch.compile(lambda x: untiled_copy(x) * 2, backend="neuron")(torch.randn(200, 4))
    assert re.search(r"partition", str(info.value), re.I), info.value
    torch.testing.assert_close(untiled_copy(torch.randn(100, 4)).shape, torch.Size([100, 4]))


def _scale_in_place_model(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    w = x * 1.0
    scale_(w, 3.0)  # an in-place user kernel: auto_functionalized in the graph
    return w + y


#: name -> (function of (x, y), the op it calls): a functional user kernel and one that writes in place.
USER_KERNEL_MODELS = {
    "axpy": (lambda x, y: axpy(x, y, 2.0), "nc_test::axpy"),
    "in_place": (_scale_in_place_model, "nc_test::scale_"),
}


@pytest.mark.parametrize("real_nki", [False, True], ids=["nki_absent", "nki_present"])
@pytest.mark.parametrize("model", sorted(USER_KERNEL_MODELS))
def test_user_kernel_on_the_neuron_target_is_refused_clearly(
    model: str, real_nki: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user kernel has no neuron-target form: without the real nki nothing could compile its kernels, and
    with it the per-kernel-call compile is not written. Either way the graph's ONE unsupported-op error names
    the op, its source line and what to do, and no made-up custom call is emitted. (nki_present only sets
    what nki_api reports: the real nki cannot run here, and this path does not call it.)"""
    from torch._dynamo.backends.common import aot_autograd

    from neuron_compile.kernels import nki_compiled

    fn, op_name = USER_KERNEL_MODELS[model]
    monkeypatch.setattr(nki_compiled, "real_nki_in_use", lambda: real_nki)
    captured = []
    torch._dynamo.reset()
    torch.compile(fn, backend=aot_autograd(fw_compiler=lambda gm, ex: captured.append((gm, ex)) or gm))(
        torch.randn(4, 4), torch.randn(4, 4)
    )
    gm, example_inputs = captured[0]
    with pytest.raises(neuron_compile.NeuronUnsupportedOpError) as info:
        lower_graph(gm, example_inputs, "user", target="neuron")
    message = str(info.value)
    assert f"user NKI kernel {op_name}" in message and "options={'target': 'cpu'}" in message, message
    assert "test_nki_op.py:" in message, message  # the user's source line
    if real_nki:
        assert "not compiled for the neuron target yet" in message, message
    else:
        assert "needs the real `nki` package" in message and "install the Neuron SDK's nki" in message, message


@nki.jit
def double_and_clobber_kernel(buf):
    """Returns 2 * buf, and also writes 2 * buf back into its argument."""
    rows, cols = buf.shape
    a = nl.ndarray((rows, cols), buf.dtype, buffer=nl.sbuf)
    nisa.dma_copy(a, buf)
    nisa.tensor_scalar(a, a, nl.multiply, 2.0)
    nisa.dma_copy(buf, a)  # the write mutates_args=() does not declare
    out = nl.ndarray(buf.shape, buf.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(out, a)
    return out


@neuron_compile.nki_op("nc_test::double_undeclared")
def double_undeclared(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return double_and_clobber_kernel(x[2:]) + y[2:]  # the kernel gets a view of x


@pytest.mark.parametrize("mode", ["eager", "fake_tensors", "compiled"])
def test_undeclared_write_of_an_argument_is_refused(mode: str) -> None:
    """Eager would change the caller's x and a compiled graph would not: refused in every mode, naming the
    op, the kernel, its parameter, the op's argument and the declaration that fixes it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, y = torch.ones(6, 4), torch.ones(6, 4)
    with pytest.raises(Exception) as info:
        if mode == "eager":
            double_undeclared(x, y)
        elif mode == "fake_tensors":
            with FakeTensorMode():
                double_undeclared(torch.empty(6, 4), torch.empty(6, 4))
        else:
            torch._dynamo.reset()
            torch.compile(lambda x, y: double_undeclared(x, y) * 2, backend="neuron")(x, y)
    message = str(info.value)
    assert "nki_op nc_test::double_undeclared: kernel double_and_clobber_kernel wrote its HBM argument 'buf'" in message
    assert "the op's argument 'x'" in message and "mutates_args=('x',)" in message, message
    if mode != "compiled":
        assert isinstance(info.value, nki.NkiUndeclaredMutationError)
