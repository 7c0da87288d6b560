"""NKI kernel sites: the routing table sends aten nodes to built-in kernels, and the result equals eager
whether the site runs its StableHLO reference (kernels="reference") or the NKI kernel itself in the
emulator (kernels="emulate"), forward and backward, float32 and bfloat16, ragged tiles included."""

from __future__ import annotations

import copy
import re
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from neuron_compile import Options
from neuron_compile.lowering import lower_graph
from neuron_compile.lowering.kernel_routing import KERNEL_CALL_TARGET, REFERENCE_ON_NEURON_PREFIX
from neuron_compile.lowering.registry import RECORDS
from neuron_compile.stats import STATS
from tests.models import TinyLM


def _layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), w, b)


def _attention(causal: bool) -> Callable[..., torch.Tensor]:
    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return f


#: name -> (function, input shapes, kernel sites expected in the forward graph). Shapes are ragged against
#: the kernels' 128-partition / 512-column tiles on purpose. A bf16 addmm (linear with bias) is not routed:
#: the kernel rounds its product before the bias add, where eager rounds once (kernel_routing.addmm).
CASES: dict[str, tuple[Callable[..., torch.Tensor], list[tuple[int, ...]], int]] = {
    "mm": (lambda a, b: a @ b, [(130, 36), (36, 40)], 1),
    "linear": (lambda x, w, b: F.linear(x, w, b), [(20, 36), (24, 36), (24,)], 1),
    "linear_bf16": (lambda x, w, b: F.linear(x, w, b), [(20, 36), (24, 36), (24,)], 0),
    "softmax": (lambda x: torch.softmax(x, dim=-1), [(3, 5, 40)], 1),
    "layer_norm": (_layer_norm, [(2, 70, 48), (48,), (48,)], 1),
    "attention": (_attention(False), [(1, 2, 20, 16)] * 3, 1),
    "causal_attention": (_attention(True), [(2, 1, 130, 8)] * 3, 1),
}


def _run(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], backend: str | None, **options: Any):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    f = torch.compile(fn, backend=backend, options=options) if backend else fn
    out = f(*leaves)
    torch.manual_seed(1)
    weight = torch.randn(out.shape, dtype=torch.float32).to(out.dtype)
    (out * weight).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def _err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref.double()).abs().max().item()


#: (case, dtype): "linear" in float32 only, "linear_bf16" in bfloat16 only; every other case in both.
CASE_DTYPES = [
    (case, dtype)
    for case in CASES
    for dtype in (torch.float32, torch.bfloat16)
    if not case.startswith("linear") or (case == "linear") == (dtype == torch.float32)
]


@pytest.mark.parametrize("mode", ["reference", "emulate"])
@pytest.mark.parametrize(("case", "dtype"), CASE_DTYPES, ids=[f"{c}-{d}" for c, d in CASE_DTYPES])
def test_kernel_site_matches_eager(case: str, dtype: torch.dtype, mode: str) -> None:
    fn, shapes, sites = CASES[case]
    torch.manual_seed(0)
    inputs = [torch.randn(s, dtype=torch.float32) for s in shapes]
    torch._dynamo.reset()
    before = len(STATS.graphs)
    compiled = _run(fn, [t.to(dtype) for t in inputs], "neuron", kernels=mode)
    forward = [g for g in STATS.graphs[before:] if g.kind == "forward"]
    assert forward and forward[0].nki_kernels >= sites, f"{case}: {forward} (no kernel site)"
    _assert_matches_eager(fn, inputs, dtype, compiled, f"{case} {mode}")


def _assert_matches_eager(
    fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], dtype: torch.dtype, compiled: list, label: str
) -> None:
    """``compiled`` (output and input gradients of ``_run``) against eager on ``inputs`` cast to ``dtype``."""
    eager = _run(fn, [t.to(dtype) for t in inputs], None)
    if dtype == torch.float32:
        for name, c, e in zip(["out"] + [f"grad{i}" for i in range(len(inputs))], compiled, eager):
            torch.testing.assert_close(c, e, rtol=2e-5, atol=2e-5, msg=lambda m: f"{label} {name}: {m}")
        return
    # bfloat16, judged as torch's accuracy checker does: against a float64 run, the compiled result may
    # be at most 2x further than eager bf16 is (plus one bf16 ulp of the value's scale).
    reference = _run(fn, [t.double() for t in inputs], None)
    for name, c, e, r in zip(["out"] + [f"grad{i}" for i in range(len(inputs))], compiled, eager, reference):
        ulp = 2.0**-8 * r.abs().max().item()
        assert _err(c, r) <= 2.0 * _err(e, r) + ulp, (
            f"{label} bf16 {name}: compiled error {_err(c, r):.3g} vs eager {_err(e, r):.3g} (fp64 reference)"
        )


def test_kernels_off_routes_nothing() -> None:
    torch._dynamo.reset()
    before = len(STATS.graphs)
    _run(CASES["attention"][0], [torch.randn(s) for s in CASES["attention"][1]], "neuron", kernels="off")
    assert [g.nki_kernels for g in STATS.graphs[before:]] == [0, 0]


def test_unfitting_nodes_keep_their_lowering() -> None:
    """A softmax over dim 0 and an attention with a mask are not the kernels' shapes: they keep their
    StableHLO lowering (the masked attention runs as math, whose last-dim softmax is the one site)."""
    x = torch.randn(6, 5)
    q = torch.randn(1, 1, 4, 8)
    mask = torch.rand(4, 4) > 0.3
    mask[:, 0] = True

    def f(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=0).sum() + F.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum()

    torch._dynamo.reset()
    before = len(STATS.graphs)
    out = torch.compile(f, backend="neuron")(x, q)
    torch.testing.assert_close(out, f(x, q))
    assert STATS.graphs[before].nki_kernels == 1


def test_tiny_transformer_trains_through_emulated_kernels() -> None:
    """Three SGD steps of the demo's TinyLM with every kernel site running NKI kernel code. (SGD, not Adam:
    Adam turns the rounding-noise gradient of the attention key bias into full-size steps; see
    test_training.py.)"""
    torch.manual_seed(0)
    eager = TinyLM(vocab=32, d_model=32, n_heads=2, n_layers=1, seq=8)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="neuron", options={"kernels": "emulate"})
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, model)]
    data = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    before = len(STATS.graphs)
    for _ in range(3):
        losses = []
        for m, f, opt in zip((eager, model), (eager, compiled), opts):
            opt.zero_grad()
            loss = f(data[:, :-1], data[:, 1:])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-5)
    kinds = {g.kind: g.nki_kernels for g in STATS.graphs[before:]}
    assert kinds["forward"] > 0 and kinds["backward"] > 0, kinds
    for p, q in zip(eager.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def _aten_graph(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor]) -> tuple[torch.fx.GraphModule, list]:
    from torch._dynamo.backends.common import aot_autograd

    captured: list = []

    def grab(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        captured.append((gm, example_inputs))
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=aot_autograd(fw_compiler=grab))(*inputs)
    return captured[0]


@pytest.fixture
def neuron_module_on_xla_cpu(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Compiles with ``target="neuron"`` lower for the neuron target and pass its legality rules, then run the
    module on XLA CPU (the CPU target object stands in for neuronx-cc and the device: a neuron module without
    custom calls is plain StableHLO). Returns the lowered graphs, in order; the once-per-process warnings
    start unseen."""
    from neuron_compile import compiler
    from neuron_compile.runtime.targets import target_for

    cpu = target_for(Options(target="cpu"))
    monkeypatch.setattr(compiler, "target_for", lambda opts: cpu)
    monkeypatch.setattr(compiler, "_SHOWN_ONCE", set())
    lowered: list[Any] = []
    real = compiler.lower_graph

    def spy(*args: Any, **kwargs: Any) -> Any:
        lowered.append(real(*args, **kwargs))
        return lowered[-1]

    monkeypatch.setattr(compiler, "lower_graph", spy)
    return lowered


@pytest.mark.parametrize(("case", "dtype"), CASE_DTYPES, ids=[f"{c}-{d}" for c, d in CASE_DTYPES])
def test_neuron_target_without_nki_runs_kernel_sites_as_their_references(
    case: str, dtype: torch.dtype, neuron_module_on_xla_cpu: list[Any]
) -> None:
    """Without the real nki (never installed here) a neuron-target kernel site is its reference StableHLO in
    a plain private function, never an AwsNeuronCustomNativeKernel call with a config neuronx-cc would refuse
    (NCC_EVRF059). The legality pass checks the body (strict: a float64 leak would raise), the module
    computes what eager does, and the warning shows once for the forward and backward graphs together."""
    from neuron_compile.errors import NeuronNkiUnavailableWarning

    fn, shapes, _sites = CASES[case]
    torch.manual_seed(0)
    inputs = [torch.randn(s, dtype=torch.float32) for s in shapes]
    torch._dynamo.reset()
    with pytest.warns(NeuronNkiUnavailableWarning) as record:
        compiled = _run(fn, [t.to(dtype) for t in inputs], "neuron", target="neuron", cache=False)
    assert len([w for w in record if w.category is NeuronNkiUnavailableWarning]) == 1
    assert any(g.kernel_sites for g in neuron_module_on_xla_cpu), "no kernel site: the case tests nothing"
    for graph in neuron_module_on_xla_cpu:
        text = graph.stablehlo()
        assert "custom_call" not in text, text
        for kernel in graph.kernel_sites:
            assert f"call @{REFERENCE_ON_NEURON_PREFIX}{kernel}" in text, (kernel, text)
        assert graph.kernel_sites_as_reference == bool(graph.kernel_sites)
    _assert_matches_eager(fn, inputs, dtype, compiled, f"{case} neuron target without nki")


#: case -> (kernel, the site's array shapes, its constants): kernel sites whose compiled config is checked.
COMPILED_SITES = {
    "mm": ("matmul", [(130, 36), (36, 40)], ()),
    "layer_norm": ("layer_norm", [(140, 48), (48,), (48,)], (1e-5,)),
}


@pytest.mark.parametrize("case", sorted(COMPILED_SITES))
def test_neuron_target_with_nki_carries_the_compiled_kernel_config(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where nki_api reports the real nki, a kernel site is ``custom_call @AwsNeuronCustomNativeKernel`` whose
    backend_config is what ``compiled_kernel_config`` returns for the site's kernel, shapes, constants and
    the graph's generation. The real nki cannot run here, so that function is replaced by a recorder with a
    made-up config: this checks the site's wiring, not nki (nki_compiled.py says what it is written against)."""
    from neuron_compile.kernels import KERNELS, nki_compiled

    kernel, shapes, consts = COMPILED_SITES[case]
    calls: list[tuple[Any, ...]] = []

    def recorder(k: Any, arrays: tuple[Any, ...], cs: tuple[Any, ...], generation: str) -> Any:
        calls.append((k, [tuple(a.shape) for a in arrays], cs, generation))
        out = (arrays[0].shape[0], arrays[1].shape[1]) if kernel == "matmul" else arrays[0].shape
        return nki_compiled.CompiledKernelConfig("Y29tcGlsZWQ=", ((tuple(out), "float32"),), (), False)

    monkeypatch.setattr(nki_compiled, "real_nki_in_use", lambda: True)
    monkeypatch.setattr(nki_compiled, "compiled_kernel_config", recorder)
    fn, case_shapes, _ = CASES[case]
    gm, example_inputs = _aten_graph(fn, [torch.randn(s) for s in case_shapes])
    lowered = lower_graph(gm, example_inputs, case, target="neuron", generation="trn3")
    text = lowered.stablehlo()
    assert calls == [(KERNELS[kernel].kernel, shapes, consts, "trn3")]
    configs = re.findall(rf'custom_call @{KERNEL_CALL_TARGET}\(.*backend_config = "([^"]*)"', text)
    assert configs == ["Y29tcGlsZWQ="], text
    assert REFERENCE_ON_NEURON_PREFIX not in text and not lowered.kernel_sites_as_reference


def test_compiled_kernel_that_differs_from_its_reference_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The custom call is typed by the kernel's reference: a compiled kernel returning anything else is an
    error naming the kernel, never a module whose types lie."""
    from neuron_compile import NeuronCompileError
    from neuron_compile.kernels import nki_compiled

    wrong = nki_compiled.CompiledKernelConfig("Y29tcGlsZWQ=", (((140, 47), "float32"),), (), False)
    monkeypatch.setattr(nki_compiled, "real_nki_in_use", lambda: True)
    monkeypatch.setattr(nki_compiled, "compiled_kernel_config", lambda *a: wrong)
    gm, example_inputs = _aten_graph(_layer_norm, [torch.randn(s) for s in CASES["layer_norm"][1]])
    with pytest.raises(NeuronCompileError, match=r"'layer_norm'.*returns \[\(\(140, 47\)"):
        lower_graph(gm, example_inputs, "ln", target="neuron")


def test_kernel_mode_is_in_the_cache_key() -> None:
    assert Options(kernels="reference").cache_relevant() != Options(kernels="off").cache_relevant()


def test_every_route_names_a_known_kernel() -> None:
    from neuron_compile.kernels import KERNELS

    routed = {op: record.kernels for op, record in RECORDS.items() if record.kernel_route is not None}
    assert routed
    for op, kernels in routed.items():
        assert kernels and all(k in KERNELS for k in kernels), op


#: (rows K, output dims of g.t() @ x): a weight gradient over many rows has its transposed operand
#: written out on the CPU target (XLA CPU's YNNPACK dot refuses a transposed LHS); few rows keep the fold.
WEIGHT_GRADIENTS = {"many_rows": (512, 64, 48, True), "few_rows": (16, 96, 80, False)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(WEIGHT_GRADIENTS))
def test_weight_gradient_lhs_is_written_out_on_cpu_only(case: str, dtype: torch.dtype) -> None:
    """``g.t() @ x`` with K >= both output dims: the CPU target's matmul site materializes ``g.t()`` (a
    barrier inside the site's body, which the legality pass does not inspect: it checks the site as the
    kernel's custom call); the neuron target's site has no barrier (its plain reference without the real
    nki, the compiled kernel with it); numerics equal eager."""
    from neuron_compile import legality

    rows, m, n, written_out = WEIGHT_GRADIENTS[case]
    torch.manual_seed(0)
    inputs = [torch.randn(rows, m), torch.randn(rows, n)]
    fn = lambda g, x: g.t() @ x  # noqa: E731
    gm, example_inputs = _aten_graph(fn, [t.to(dtype) for t in inputs])
    cpu = lower_graph(gm, example_inputs, "wgrad", target="cpu")
    neuron = lower_graph(gm, example_inputs, "wgrad", target="neuron")
    assert ("optimization_barrier" in cpu.stablehlo()) == written_out, case
    assert "optimization_barrier" not in neuron.stablehlo()
    assert cpu.kernel_sites == neuron.kernel_sites == {"matmul": 1}
    assert legality.check(cpu, Options()).legal and legality.check(neuron, Options(target="neuron")).legal
    got, eager = _run(fn, [t.to(dtype) for t in inputs], "neuron"), _run(fn, [t.to(dtype) for t in inputs], None)
    names = ["out", "grad g", "grad x"]
    if dtype == torch.float32:
        for name, a, b in zip(names, got, eager):
            torch.testing.assert_close(a, b, rtol=1.3e-6, atol=1e-4, msg=lambda m, name=name: f"{case} {name}: {m}")
        return
    # bfloat16, as torch's accuracy checker judges it: at most 2x eager's error against float64 (+1 ulp).
    reference = _run(fn, [t.double() for t in inputs], None)
    for name, a, e, r in zip(names, got, eager, reference):
        ulp = 2.0**-8 * r.abs().max().item()
        assert _err(a, r) <= 2.0 * _err(e, r) + ulp, f"{case} bf16 {name}: {_err(a, r):.3g} vs eager {_err(e, r):.3g}"
