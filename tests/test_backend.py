"""The backend's contract: registration, regional compilation, static shapes, hard errors, dtypes,
input mutation and aliasing."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.exc import BackendCompilerFailed

import neuron_compile
from neuron_compile import STATS, NeuronDynamicShapeError, NeuronOptionsError, NeuronUnsupportedOpError
from neuron_compile.decompositions import decomposition_table
from neuron_compile.errors import NeuronRecompileWarning
from neuron_compile.evaluate import compare_to_reference

from .models import TinyLM
from .test_training import CASES, run_and_compare
from .util import root_cause


def _run_fresh(code: str) -> str:
    """Run ``code`` in a fresh interpreter that never imports neuron_compile itself."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, env=os.environ
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_entry_point_registration_in_fresh_process() -> None:
    out = _run_fresh(
        """
        import sys, torch
        assert "neuron" in torch._dynamo.list_backends(), torch._dynamo.list_backends()
        fn = torch.compile(lambda x: torch.sin(x) * 2, backend="neuron", dynamic=False)
        x = torch.randn(5)
        torch.testing.assert_close(fn(x), torch.sin(x) * 2)
        from neuron_compile import STATS
        print("graphs", STATS.count())
        """
    )
    assert "graphs 1" in out


def test_set_default_backend_in_fresh_process() -> None:
    out = _run_fresh(
        """
        import torch
        torch.compiler.set_default_backend("neuron")
        fn = torch.compile(lambda x: x.exp() + 1)
        x = torch.randn(3, 3)
        torch.testing.assert_close(fn(x), x.exp() + 1)
        from neuron_compile import STATS
        print("graphs", STATS.count())
        """
    )
    assert "graphs 1" in out


@pytest.mark.parametrize("style", ["module.compile", "torch.compile(submodule)"])
def test_regional_compilation_of_blocks(style: str) -> None:
    def compile_blocks(model: TinyLM) -> TinyLM:
        for i, block in enumerate(model.blocks):
            if style == "module.compile":
                block.compile(backend="neuron", dynamic=False)
            else:
                model.blocks[i] = torch.compile(block, backend="neuron", dynamic=False)
        return model

    STATS.reset()
    case = next(c for c in CASES if c.name == "transformer")
    two_blocks = type(case)(case.name, lambda: TinyLM(n_layers=2), case.batch, case.loss)
    run_and_compare(two_blocks, "adamw", torch.float32, compile_fn=compile_blocks)
    kinds = {g.kind for g in STATS.graphs}
    assert {"forward", "backward"} <= kinds, STATS.graphs


def test_nested_compile_region() -> None:
    @torch.compiler.nested_compile_region
    def mlp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w) + x

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return mlp(mlp(x, w), w).pow(2).sum()

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    xs, ws = (x.clone().requires_grad_(), w.clone().requires_grad_()), (x.requires_grad_(), w.requires_grad_())
    STATS.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own note about duplicate invoke_subgraph backward graphs
        out = torch.compile(fn, backend="neuron", dynamic=False)(*xs)
        out.backward()
    ref = fn(*ws)
    ref.backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(xs, ws):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)
    assert STATS.count("forward") == 1 and STATS.count("backward") == 1


def test_unsupported_ops_are_all_listed_with_source_lines() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        a = torch.linalg.ldl_factor(x.view(3, 3) + x.view(3, 3).mT)[0]  # LINE_A
        b = torch.linalg.eigvals(x.view(3, 3)).real  # LINE_B
        return a.sum() + b.sum()

    lines = {
        tag: next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if text.rstrip().endswith(tag))
        for tag in ("# LINE_A", "# LINE_B")
    }
    with pytest.raises(BackendCompilerFailed) as info:
        torch.compile(fn, backend="neuron", dynamic=False)(torch.rand(9))
    err = root_cause(info.value)
    assert isinstance(err, NeuronUnsupportedOpError)
    msg = str(err)
    assert "aten.linalg_ldl_factor_ex.default" in msg and "aten.linalg_eig.default" in msg
    assert f"{os.path.basename(__file__)}:{lines['# LINE_A']}" in msg
    assert f"{os.path.basename(__file__)}:{lines['# LINE_B']}" in msg
    assert "float32[3, 3]" in msg and "supported_ops()" in msg
    assert len(err.nodes) == 2


def _eigvals_then_mask(x: torch.Tensor) -> torch.Tensor:
    h = x * 2
    e = torch.linalg.eigvals(h @ h.T).real.sum()  # EIG_THEN_MASK: eig
    m = h[h > 0].sum()  # EIG_THEN_MASK: mask
    return e + m


def _mask_then_eigvals(x: torch.Tensor) -> torch.Tensor:
    h = x * 2
    m = h[h > 0].sum()  # MASK_THEN_EIG: mask
    e = torch.linalg.eigvals(h @ h.T).real.sum()  # MASK_THEN_EIG: eig
    return e + m


def _mask_follow_up_and_eigvals(x: torch.Tensor) -> torch.Tensor:
    h = x * 2
    m = h[h > 0]  # FOLLOW_UP: mask
    d = torch.diag(m).sum(0)  # FOLLOW_UP: follow-up
    e = torch.linalg.eigvals(h).real  # FOLLOW_UP: eig
    return d.sum() + e.sum()


def _marked_line(marker: str) -> str:
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if text.rstrip().endswith(marker))
    return f"{os.path.basename(__file__)}:{line}"


def _refusal(fn, x: torch.Tensor, training: bool) -> NeuronUnsupportedOpError:
    torch._dynamo.reset()
    with pytest.raises(BackendCompilerFailed) as info, torch.set_grad_enabled(training):
        out = torch.compile(fn, backend="neuron", dynamic=False)(x.requires_grad_(training))
        if training:
            out.backward()
    err = root_cause(info.value)
    assert isinstance(err, NeuronUnsupportedOpError), err
    return err


@pytest.mark.parametrize("training", [False, True], ids=["inference", "forward+backward"])
@pytest.mark.parametrize(
    ("fn", "tag", "first"),
    [(_eigvals_then_mask, "EIG_THEN_MASK", "eig"), (_mask_then_eigvals, "MASK_THEN_EIG", "mask")],
    ids=["eigvals-then-mask", "mask-then-eigvals"],
)
def test_data_dependent_shape_and_refused_op_are_listed_in_one_error(fn, tag: str, first: str, training: bool) -> None:
    """A boolean mask (a data-dependent shape) does not hide an op the lowering refuses elsewhere in the
    graph, in either order: ONE error per graph names both lines; the mask's size nodes follow from it."""
    err = _refusal(fn, torch.randn(4, 4), training)
    assert err.graph_name.endswith("_forward" if training else "_inference"), err.graph_name
    msg = str(err)
    eig, mask = _marked_line(f"# {tag}: eig"), _marked_line(f"# {tag}: mask")
    assert eig in msg and mask in msg, msg
    assert "aten.linalg_eig.default" in msg and "aten.index.Tensor" in msg and "data-dependent" in msg
    roots = [(n.op, n.source.rsplit("/", 1)[-1]) for n in err.root_causes()]
    expected = {"eig": ("aten.linalg_eig.default", eig), "mask": ("aten.index.Tensor", mask)}
    order = [first, "mask" if first == "eig" else "eig"]  # graph order: the user's line order
    assert roots == [expected[k] for k in order], msg
    [index] = [n for n in err.nodes if n.op == "aten.index.Tensor"]
    follow_ups = [n for n in err.nodes if n.follows]
    assert follow_ups and all(n.follows == index.node and n.source.endswith(mask) for n in follow_ups), msg
    assert "(follows from aten.index.Tensor at " in msg


def test_follow_ups_of_a_data_dependent_shape_are_its_users_only() -> None:
    """The nodes that use x[mask]'s value (on another line) follow from it; an op refused on its own
    stays a root cause, and a user of the mask with a static shape (a sum) is not listed."""
    err = _refusal(_mask_follow_up_and_eigvals, torch.randn(4, 4), training=False)
    msg = str(err)
    mask, follow, eig = (_marked_line(f"# FOLLOW_UP: {k}") for k in ("mask", "follow-up", "eig"))
    [index] = [n for n in err.nodes if n.op == "aten.index.Tensor"]
    roots = err.root_causes()
    assert [(n.op, n.follows) for n in roots] == [("aten.index.Tensor", ""), ("aten.linalg_eig.default", "")], msg
    assert roots[1].source.endswith(eig)
    on_follow_line = [n for n in err.nodes if n.source.endswith(follow)]
    assert on_follow_line and all(n.follows == index.node for n in on_follow_line), msg
    assert all(n.follows == index.node for n in err.nodes if n.source.endswith(mask) and n is not index)
    assert all("data-dependent" in n.reason for n in err.nodes if n.follows)
    # diag(m).sum(0) has a data-dependent shape of its own and is listed; the total, d.sum(), is static: not
    sums = [n.inputs for n in err.nodes if n.op == "aten.sum.dim_IntList"]
    assert sums == ["float32[u0, u0], [0]"], msg


def _refused_op_on_the_mask(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.eigvals(torch.diag(x[x > 0])).real.sum()  # REFUSED_ON_MASK


def test_an_op_refused_whatever_its_inputs_is_a_root_cause_even_on_a_masked_value() -> None:
    """eigvals of diag(x[mask]) uses the mask's value, but fixing the mask would not make it compile: it is
    listed with its own reason, as a root cause next to the mask."""
    err = _refusal(_refused_op_on_the_mask, torch.randn(4, 4), training=False)
    roots = err.root_causes()
    assert [n.op for n in roots] == ["aten.index.Tensor", "aten.linalg_eig.default"], str(err)
    assert "data-dependent" not in roots[1].reason and roots[1].inputs == "float32[u0, u0]"
    assert all(n.source.endswith(_marked_line("# REFUSED_ON_MASK")) for n in err.nodes)


@pytest.mark.parametrize(
    ("path", "cls", "expected"),
    [
        ("L['self'].layers.0", torch.nn.TransformerEncoderLayer, "module layers.0 (TransformerEncoderLayer)"),
        ("L['fn']", "torch.nn.modules.transformer.TransformerEncoder", "module <root> (TransformerEncoder)"),
    ],
)
def test_source_without_stack_trace_names_the_module(path: str, cls: object, expected: str) -> None:
    """Dynamo records no stack trace for code entirely inside torch (a compiled nn.TransformerEncoder):
    errors name the module the node came from instead."""
    from neuron_compile import provenance

    node = torch.fx.Graph().placeholder("x")
    assert provenance.user_source(node) == "<unknown source line>"
    node.meta["nn_module_stack"] = {"outer": ("L['self']", torch.nn.Module), "inner": (path, cls)}
    assert provenance.user_source(node) == expected


def test_dynamic_true_is_refused_with_the_fix() -> None:
    with pytest.raises(BackendCompilerFailed) as info:
        torch.compile(lambda x: x * 2, backend="neuron", dynamic=True)(torch.randn(3, 4))
    err = root_cause(info.value)
    assert isinstance(err, NeuronDynamicShapeError)
    assert "dynamic=False" in str(err) and "symbolic" in str(err) and "pad" in str(err)


def test_dynamic_none_compiles_a_static_graph_per_shape() -> None:
    """Under the default dynamic=None, Dynamo would trace the 2nd shape (or Python int) symbolic; for a neuron
    compile it traces it static (graph_checks.keep_shapes_static), and a shape seen before reuses its graph.
    (A changing float stays Dynamo's: tests/test_optimizer_steps.py's LR scheduler.)"""
    STATS.reset()
    fn = torch.compile(lambda x, k: x * k, backend="neuron")
    for n, k in ((3, 2), (5, 2), (3, 2), (3, 4)):
        x = torch.randn(n)
        torch.testing.assert_close(fn(x, k), x * k)
    assert STATS.count() == 3


def test_dynamic_none_is_left_to_dynamo_for_other_backends() -> None:
    """Only neuron frames compile static: another backend's 2nd shape still arrives symbolic (Dynamo's
    automatic dynamic shapes), and the process-wide config is unchanged."""
    symbolic = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        symbolic.append(any(isinstance(x, torch.SymInt) for x in example_inputs))
        return gm.forward

    fn = torch.compile(lambda x: x * 2, backend=backend)
    fn(torch.randn(3))
    fn(torch.randn(5))
    assert symbolic == [False, True] and torch._dynamo.config.automatic_dynamic_shapes


def test_mark_dynamic_is_still_refused() -> None:
    fn = torch.compile(lambda x: x * 2, backend="neuron")
    x = torch.randn(3)
    torch._dynamo.mark_dynamic(x, 0)
    with pytest.raises(BackendCompilerFailed) as info:
        fn(x)
    assert isinstance(root_cause(info.value), NeuronDynamicShapeError)


def test_new_shape_compiles_new_static_graph() -> None:
    STATS.reset()
    fn = torch.compile(lambda x: x.relu() * 3, backend="neuron", dynamic=False)
    for n in (3, 5, 7):
        x = torch.randn(n, 2)
        torch.testing.assert_close(fn(x), x.relu() * 3)
    fn(torch.randn(5, 2))  # seen before: no new graph
    assert STATS.count() == 3


def test_recompile_limit_raises_instead_of_silent_eager() -> None:
    fn = torch.compile(lambda x: x + 1, backend="neuron", dynamic=False)
    limit = torch._dynamo.config.recompile_limit
    for n in range(1, limit + 1):
        fn(torch.randn(n))
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        fn(torch.randn(limit + 1))


def test_fifth_input_shape_warns_once_naming_the_inputs_that_vary() -> None:
    def scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    fn = torch.compile(scale, backend="neuron", dynamic=False)
    w = torch.randn(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (1, 2, 3, 4):
            fn(torch.randn(n), w)
        assert not [w for w in caught if issubclass(w.category, NeuronRecompileWarning)]
        fn(torch.randn(5), w)
        fn(torch.randn(6), w)
    (warning,) = [w for w in caught if issubclass(w.category, NeuronRecompileWarning)]
    text = str(warning.message)
    assert "scale" in text and "5th time" in text and "5 different sets of input shapes" in text
    assert "recompile_limit" in text
    assert "L['x']: shapes [1], [2], [3], [4], [5]" in text and "L['w']" not in text
    assert warning.filename == __file__


def test_fifth_compile_for_a_python_number_warns_with_dynamos_reason() -> None:
    def shift(x: torch.Tensor, step: int) -> torch.Tensor:
        return x + step

    fn = torch.compile(shift, backend="neuron", dynamic=False)
    x = torch.randn(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            torch.testing.assert_close(fn(x, step), x + step)
    (warning,) = [w for w in caught if issubclass(w.category, NeuronRecompileWarning)]
    text = str(warning.message)
    assert "shift" in text and "5th time" in text and "shapes" not in text, text
    assert "last recompile: step == 3" in text and "torch.tensor(" in text, text


def test_recompile_warning_names_a_torch_module_that_has_no_stack_trace() -> None:
    gru = torch.compile(torch.nn.GRU(2, 3), backend="neuron", dynamic=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            for length in range(1, 6):
                gru(torch.randn(length, 2))
    (warning,) = [w for w in caught if issubclass(w.category, NeuronRecompileWarning)]
    assert str(warning.message).startswith("neuron backend: GRU.forward (")
    assert "L['args'][0]: shapes [1, 2], [2, 2], [3, 2], [4, 2], [5, 2]" in str(warning.message)


@pytest.mark.parametrize("run", ["cold", "cache hit"])
def test_float64_computed_as_float32_with_one_warning(run: str) -> None:
    x = torch.randn(16, dtype=torch.float64)
    fn = lambda t: torch.sin(t) * t + 1.25  # noqa: E731
    if run == "cache hit":
        torch.compile(fn, backend="neuron", dynamic=False)(x)
        torch._dynamo.reset()
    STATS.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(fn, backend="neuron", dynamic=False)(x)
    ours = [w for w in caught if "float64" in str(w.message)]
    assert len(ours) == 1 and "float32" in str(ours[0].message)
    assert [g.cache for g in STATS.graphs] == (["hit"] if run == "cache hit" else [STATS.graphs[0].cache])
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, fn(x), rtol=1.3e-6, atol=1e-5)


def test_int64_stays_exact() -> None:
    x = torch.tensor([2**40 + 3, -(2**35), 7], dtype=torch.int64)
    out = torch.compile(lambda t: t * 3 + 1, backend="neuron", dynamic=False)(x)
    assert out.dtype == torch.int64 and torch.equal(out, x * 3 + 1)


@pytest.mark.parametrize(
    "make, kind",
    [
        (lambda: torch.zeros(4, dtype=torch.complex32), "complex32"),  # complex64/128 run as pairs
        (
            lambda: torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged),
            "nested",
        ),
    ],
    ids=["complex", "nested"],
)
def test_unsupported_tensor_kinds_fail_loudly(make, kind: str) -> None:
    with pytest.raises(BackendCompilerFailed) as info:
        torch.compile(lambda t: t * 2, backend="neuron", dynamic=False)(make())
    err = root_cause(info.value)
    assert isinstance(err, NeuronUnsupportedOpError) and kind in str(err).lower()
    assert os.path.basename(__file__) in str(err)


def test_sparse_input_never_runs_silently_under_fullgraph() -> None:
    # Dynamo itself never hands sparse tensors to a backend (it runs such frames in eager, see README);
    # fullgraph=True turns that into an error.
    with pytest.raises(Exception, match="(?i)sparse"):
        torch.compile(lambda t: t * 2, backend="neuron", fullgraph=True)(torch.randn(4, 4).to_sparse())


def test_input_mutation_reaches_user_tensor() -> None:
    def fn(buf: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        buf.mul_(0.9).add_(x)
        return buf.sum()

    buf_e, buf_c, x = torch.ones(5), torch.ones(5), torch.randn(5)
    expected = fn(buf_e, x)
    got = torch.compile(fn, backend="neuron", dynamic=False)(buf_c, x)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(buf_c, buf_e)


def test_output_aliasing_matches_eager() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.t(), x * 2

    x = torch.randn(3, 4)
    view, fresh = torch.compile(fn, backend="neuron", dynamic=False)(x)
    assert view._base is x or view.data_ptr() == x.data_ptr()  # a view of the input, as in eager
    assert fresh.data_ptr() != x.data_ptr()
    view[0, 0] = 42.0
    assert x[0, 0] == 42.0


def test_duplicate_outputs_are_distinct_tensors() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x + 1
        return y, y

    a, b = torch.compile(fn, backend="neuron", dynamic=False)(torch.zeros(3))
    a.add_(5)
    torch.testing.assert_close(b, torch.ones(3)) if a.data_ptr() != b.data_ptr() else None
    assert torch.equal(a, torch.full((3,), 6.0))


def test_constant_outputs_are_not_shared_across_calls() -> None:
    fn = torch.compile(lambda x: (x + 1, torch.zeros(3)), backend="neuron", dynamic=False)
    _, z1 = fn(torch.ones(3))
    z1.add_(7)
    _, z2 = fn(torch.ones(3))
    assert torch.equal(z2, torch.zeros(3))


def test_mode_other_than_default_warns_and_compiles() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(lambda x: x.cos(), backend="neuron", mode="max-autotune-no-cudagraphs")(torch.zeros(2))
    assert torch.equal(out, torch.ones(2))
    assert any("mode='max-autotune-no-cudagraphs'" in str(w.message) for w in caught)


def test_unknown_option_is_an_error() -> None:
    with pytest.raises(BackendCompilerFailed) as info:
        torch.compile(lambda x: x + 1, backend="neuron", options={"targt": "cpu"})(torch.zeros(2))
    assert isinstance(root_cause(info.value), NeuronOptionsError)
    assert "targt" in str(info.value)


def test_supported_ops_is_the_registry() -> None:
    ops = neuron_compile.supported_ops()
    assert "aten.add.Tensor" in ops and "aten.mm.default" in ops and ops == sorted(ops)


def test_bfloat16_roundtrip_through_dlpack() -> None:
    x = torch.randn(8, 8, dtype=torch.bfloat16)
    out = torch.compile(lambda t: t * 2 + 1, backend="neuron", dynamic=False)(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, x * 2 + 1)


def _attention_mask(kind: str) -> torch.Tensor:
    """A [5, 5] mask; "padded" hides every key from queries 0 and 1, as a left-padded batch row does."""
    keep = torch.rand(5, 5, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[:, 0] = True
    if kind.startswith("padded"):
        keep[:2] = False
    if kind.endswith("float"):
        return torch.zeros(5, 5).masked_fill(~keep, float("-inf"))
    return keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["bool", "float", "padded-bool", "padded-float"])
def test_sdpa_with_mask_forward_and_backward(kind: str, dtype: torch.dtype) -> None:
    """Eager SDPA gives a query with every key masked a zero output and zero gradients, not NaN."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g).to(dtype).requires_grad_() for _ in range(3))
    mask = _attention_mask(kind)
    mask = mask if mask.dtype == torch.bool else mask.to(dtype)
    grad_out = torch.randn(2, 3, 5, 8, generator=g).to(dtype)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    out = torch.compile(fn, backend="neuron", dynamic=False)(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref = fn(q, k, v)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    for name, got, want in zip(["output", "grad q", "grad k", "grad v"], (out, *grads), (ref, *ref_grads)):
        assert not got.isnan().any(), f"{name} [{kind}, {dtype}] has NaN"
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{name} [{kind}, {dtype}]: {m}")
    if kind.startswith("padded"):
        assert not out[..., :2, :].any(), "a query with every key masked attends to nothing"


def _flex_case(kind: str) -> tuple[dict, int]:
    """Keyword arguments of ``flex_attention`` for one case, and the number of key/value heads."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q, k):
        return q >= k

    def padded(b, h, q, k):  # batch row 1 hides its first 3 keys: queries 0-2 see nothing
        return (k >= 3 * b) & (q >= k)

    if kind == "score_mod":
        return {"score_mod": lambda s, b, h, q, k: s + (q - k) * 0.1}, 4
    if kind == "causal":
        return {"block_mask": create_block_mask(causal, None, None, 6, 6, device="cpu")}, 4
    if kind == "padded":
        return {"block_mask": create_block_mask(padded, 2, None, 6, 6, device="cpu")}, 4
    return {"enable_gqa": True, "score_mod": lambda s, b, h, q, k: torch.tanh(s / 2) * 2}, 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["score_mod", "causal", "padded", "gqa-softcap"])
def test_flex_attention_matches_eager(kind: str, dtype: torch.dtype) -> None:
    """flex_attention (lowering/flex_attention.py) as eager's math: score_mod and mask_mod graphs applied
    elementwise, a fully masked query gives zeros. Forward only here; tests/test_flex_attention.py has the
    backward and the block-sparse cases."""
    from torch.nn.attention.flex_attention import flex_attention

    kwargs, kv_heads = _flex_case(kind)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g).to(dtype)
    k, v = (torch.randn(2, kv_heads, 6, 8, generator=g).to(dtype) for _ in range(2))

    def fn(q, k, v):
        return flex_attention(q, k, v, **kwargs)

    out = torch.compile(fn, backend="neuron", dynamic=False, fullgraph=True)(q, k, v)
    ref = fn(q, k, v)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    assert not out.isnan().any(), f"[{kind}, {dtype}] has NaN"
    torch.testing.assert_close(out, ref, **tol, msg=lambda m: f"flex_attention [{kind}, {dtype}]: {m}")
    if kind == "padded":
        assert not out[1, :, :3].any(), "a query with every key masked attends to nothing"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("causal", "masked"),
    [(False, None), (True, None), (False, "random"), (False, "padded")],
    ids=["plain", "causal", "mask", "padded"],
)
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_cpu_flash_attention_backward_decomposition_matches_the_kernel(kv_heads, causal, masked, dtype) -> None:
    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g)
    k, v = (torch.randn(2, kv_heads, 7, 8, generator=g) for _ in range(2))
    mask = torch.randn(5, 7, generator=g) * 2 if masked else None
    if masked == "padded":  # queries 0 and 1 see no key: the kernel gives them zero gradients
        mask[:2] = float("-inf")
    grad_out = torch.randn(2, 4, 5, 8, generator=g)

    def backward(fn, dt):
        q_, k_, v_, do = (t.to(dt) for t in (q, k, v, grad_out))
        m = None if mask is None else mask.to(dt)
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q_, k_, v_, 0.0, causal, attn_mask=m, scale=0.3)
        return fn(do, q_, k_, v_, out, lse, 0.0, causal, attn_mask=m, scale=0.3)

    kernel = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    ours = decomposition_table()[kernel]
    names = ["grad_query", "grad_key", "grad_value"]
    verdict = compare_to_reference(
        backward(kernel, torch.float64), backward(kernel, dtype), backward(ours, dtype), names=names
    )
    assert verdict.ok, verdict.failures()
    if dtype == torch.float32:
        for name, got, want in zip(names, backward(ours, dtype), backward(kernel, dtype)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


class _Attention(torch.nn.Module):
    """``nn.MultiheadAttention`` or ``nn.TransformerEncoderLayer`` called with a causal and/or a key-padding
    mask; returns a tuple of its outputs (MultiheadAttention's weights too, when asked for)."""

    def __init__(self, module: torch.nn.Module, causal: bool = False, padding: bool = False, **kwargs) -> None:
        super().__init__()
        self.module, self.causal, self.padding, self.kwargs = module, causal, padding, kwargs

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        causal = torch.ones(x.size(1), x.size(1), dtype=torch.bool).triu(1) if self.causal else None
        padding = None
        if self.padding:
            padding = torch.zeros(x.size(0), x.size(1), dtype=torch.bool)
            padding[0, -2:] = True
        if isinstance(self.module, torch.nn.MultiheadAttention):
            out, weights = self.module(x, x, x, attn_mask=causal, key_padding_mask=padding, **self.kwargs)
            return (out,) if weights is None else (out, weights)
        return (self.module(x, src_mask=causal, src_key_padding_mask=padding),)


def _mha(**kwargs) -> torch.nn.MultiheadAttention:
    return torch.nn.MultiheadAttention(32, 4, batch_first=True, **kwargs)


def _encoder_layer(**kwargs) -> torch.nn.TransformerEncoderLayer:
    return torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, **kwargs)


# In training they reach SDPA's CPU flash kernel (need_weights=False) or plain math; in eval mode without
# autograd, the fused fast-path kernels _native_multi_head_attention / _transformer_encoder_layer_fwd.
ATTENTION_MODULES = {
    "encoder-layer": lambda: _Attention(_encoder_layer()),
    "encoder-layer-norm-first-gelu-masks": lambda: _Attention(
        _encoder_layer(norm_first=True, activation="gelu"), causal=True, padding=True
    ),
    "encoder-layer-padding": lambda: _Attention(_encoder_layer(), padding=True),
    "multihead-attention-masks": lambda: _Attention(_mha(), causal=True, padding=True, need_weights=False),
    "multihead-attention-weights-per-head": lambda: _Attention(
        _mha(), causal=True, need_weights=True, average_attn_weights=False
    ),
    "multihead-attention-mean-weights-padding": lambda: _Attention(_mha(), padding=True, need_weights=True),
}


@pytest.mark.parametrize("mode", ["train", "eval-no-grad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(ATTENTION_MODULES))
def test_torch_attention_modules_match_eager(name: str, dtype: torch.dtype, mode: str) -> None:
    """Dynamo keeps ``F.multi_head_attention_forward`` and the fast-path kernels whole, so these reach
    AOTAutograd as ops ``rewrite_sdpa`` never sees; each is lowered through our decompositions."""
    torch.manual_seed(0)
    model = ATTENTION_MODULES[name]().train(mode == "train")
    x = torch.randn(2, 8, 32)

    def step(module: torch.nn.Module, dt: torch.dtype, compiled: bool = False) -> list[torch.Tensor]:
        module = copy.deepcopy(module).to(dt)
        run = torch.compile(module, backend="neuron", dynamic=False) if compiled else module
        if mode != "train":
            with torch.no_grad():
                return list(run(x.to(dt)))
        outs = run(x.to(dt))
        loss = sum(o.float().pow(2).mean() for o in outs)
        return [o.detach() for o in outs] + list(torch.autograd.grad(loss, list(module.parameters())))

    names = [f"output{i}" for i in range(len(model(x)))]
    names += [n for n, _ in model.named_parameters()] if mode == "train" else []
    verdict = compare_to_reference(
        step(model, torch.float64), step(model, dtype), step(model, dtype, True), names=names
    )
    assert verdict.ok, verdict.failures()
    if dtype == torch.float32:
        for n, got, want in zip(names, step(model, dtype, True), step(model, dtype)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {n}: {m}")


def _fast_path_mask(kind: str, g: torch.Generator) -> tuple[torch.Tensor | None, int | None]:
    batch, heads, length = 2, 4, 6
    if kind == "none":
        return None, None
    if kind == "square-bool":
        return torch.rand(length, length, generator=g) > 0.7, 0
    if kind == "square-float":  # not additive: any nonzero value hides its key
        return torch.randn(length, length, generator=g) * (torch.rand(length, length, generator=g) > 0.6), 0
    if kind == "padding-float":
        padding = torch.zeros(batch, length)
        padding[1, -2:] = float("-inf")
        return padding, 1
    return torch.rand(batch, heads, length, length, generator=g) > 0.7, 2  # "per-head-bool"


@pytest.mark.parametrize("weights", ["none", "mean", "per-head"])
@pytest.mark.parametrize("mask_kind", ["none", "square-bool", "square-float", "padding-float", "per-head-bool"])
def test_native_multi_head_attention_matches_the_kernel(mask_kind: str, weights: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 32, generator=g)
    params = [torch.randn(96, 32, generator=g) * 0.2, torch.randn(96, generator=g) * 0.1]
    params += [torch.randn(32, 32, generator=g) * 0.2, torch.randn(32, generator=g) * 0.1]
    mask, mask_type = _fast_path_mask(mask_kind, g)

    def attention(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = torch._native_multi_head_attention(
            x, x, x, 32, 4, *params, mask, weights != "none", weights == "mean", mask_type
        )
        return out if weights != "none" else out[:1]

    got, want = torch.compile(attention, backend="neuron", dynamic=False)(x), attention(x)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, equal_nan=True, msg=lambda m: f"output {i}: {m}")


def test_size_given_as_tensor_is_refused_with_its_line() -> None:
    def fn(x: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.tensor_split(x, n, 1)  # LINE_SPLIT

    line = next(
        i for i, text in enumerate(open(__file__).read().splitlines(), 1) if text.rstrip().endswith("# LINE_SPLIT")
    )
    with pytest.raises(BackendCompilerFailed) as info:
        torch.compile(fn, backend="neuron", dynamic=False)(torch.randn(5, 5), torch.tensor(2))
    err = root_cause(info.value)
    assert isinstance(err, NeuronUnsupportedOpError) and "data-dependent" in str(err)
    assert f"{os.path.basename(__file__)}:{line}" in str(err) and "tensor_split" in str(err)
