"""Neuron fidelity: the legality pass refuses what neuronx-cc would refuse (on the CPU target too), maps
each offender to its aten node and user line, device calls keep both targets' verdicts equal, and the
debug dumps hold what is needed to map HLO back to user code."""

from __future__ import annotations

import inspect
import json
import logging
import re
import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import pytest
import torch
from jax import lax

import neuron_compile.compiler as compiler
from neuron_compile import Options, legality
from neuron_compile.legality import NeuronLegalityWarning
from neuron_compile.lowering import device_calls, lower_graph
from neuron_compile.lowering.registry import register_lowering, unregister
from neuron_compile.runtime.neuron import NeuronTarget

NO_CACHE = {"cache": False}


def _line(fn, marker: str = "# <- offender") -> str:
    """'<this file>:<line>' of the line of ``fn`` carrying ``marker``."""
    lines, start = inspect.getsourcelines(fn)
    for i, text in enumerate(lines):
        if marker in text:
            return f"{__file__}:{start + i}"
    raise AssertionError(f"no marker in {fn.__name__}")


def _compile(fn, **options):
    return torch.compile(fn, backend="neuron", dynamic=False, options={**NO_CACHE, **options})


def _error_text(excinfo) -> str:
    return str(excinfo.value)


@pytest.fixture
def captured(monkeypatch):
    """Every (gm, example_inputs, LoweredGraph) the compiler lowers, in order."""
    graphs: list = []
    real = compiler.lower_graph

    def spy(gm, example_inputs, name, **kwargs):
        lowered = real(gm, example_inputs, name, **kwargs)
        graphs.append((gm, list(example_inputs), lowered))
        return lowered

    monkeypatch.setattr(compiler, "lower_graph", spy)
    return graphs


# -- programs that break one documented restriction --------------------------------------------------
def int16_values(x):
    return x.to(torch.int16) + 1  # <- offender


def conv_int64(x):
    return torch.nn.functional.conv2d(x, x[:, :2, :3, :3].flip(0), padding=1) // 3  # <- offender


def scatter_add_int64(x):
    return torch.zeros(8, dtype=torch.int64).scatter_add(0, x % 8, x)  # <- offender


def f8_e4m3fn(x):
    return x.to(torch.float8_e4m3fn).to(torch.float32) * 2  # <- offender


def host_custom_call(a):
    return torch.ops.fidelity_test.cholesky(a) + 1  # <- offender


@torch.library.custom_op("fidelity_test::cholesky", mutates_args=())
def _test_cholesky(a: torch.Tensor) -> torch.Tensor:
    return torch.linalg.cholesky(a)


@_test_cholesky.register_fake
def _(a):
    return torch.empty_like(a)


def _spd(n: int) -> torch.Tensor:
    b = torch.randn(n, n)
    return b @ b.T + n * torch.eye(n)


RESTRICTED = [
    pytest.param(int16_values, lambda: torch.randint(-1000, 1000, (4, 50)), "int16 is not a NeuronCore data type", {},
                 id="int16"),
    pytest.param(scatter_add_int64, lambda: torch.randint(0, 1000, (50,)), "scatter with a combining update on i64",
                 {}, id="scatter-add-int64"),
    pytest.param(conv_int64, lambda: torch.randint(-100, 100, (2, 2, 5, 5)), "no integer matmul datapath", {},
                 id="conv-int64"),
    pytest.param(f8_e4m3fn, lambda: torch.randn(64), "float8_e4m3fn is not available", {}, id="f8e4m3fn-trn2"),
    pytest.param(host_custom_call, lambda: _spd(6), "only implements AwsNeuron*", {"atol": 1e-5, "rtol": 1e-5},
                 id="non-AwsNeuron-custom-call"),
]  # fmt: skip


@pytest.fixture
def cholesky_lowering():
    """A lowering (as a user extension would register it) that emits XLA CPU's LAPACK custom call."""
    register_lowering(torch.ops.fidelity_test.cholesky.default)(lambda a: jnp.linalg.cholesky(a))
    yield
    unregister(torch.ops.fidelity_test.cholesky.default)  # a second registration would be an error


@pytest.mark.parametrize("fn, make_input, reason, tol", RESTRICTED)
def test_restriction_refused_with_user_line_then_relaxed(fn, make_input, reason, tol, cholesky_lowering):
    torch.manual_seed(0)
    x = make_input()
    with pytest.raises(Exception) as excinfo:
        _compile(fn)(x)
    text = _error_text(excinfo)
    assert "NeuronUnsupportedOpError" in text and reason in text, f"{fn.__name__}: {text}"
    assert _line(fn) in text, f"{fn.__name__}: user line {_line(fn)} not named in:\n{text}"
    assert "strict" in text  # the error says how to relax it

    torch._dynamo.reset()
    with pytest.warns(NeuronLegalityWarning, match=re.escape(reason)) as record:
        got = _compile(fn, strict=False)(x)
    assert any(_line(fn) in str(w.message) for w in record), f"{fn.__name__}: warning lacks the user line"
    want = fn(x)
    if tol:
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{fn.__name__}: {m}")
    else:
        assert torch.equal(got, want), f"{fn.__name__}: relaxed result differs from eager"


def test_f8_e4m3fn_is_legal_on_trn3():
    x = torch.randn(64)
    assert torch.equal(_compile(f8_e4m3fn, generation="trn3")(x), f8_e4m3fn(x))


# -- refused on every target: strict=False cannot make these run ------------------------------------
def with_cond(x):
    return torch.cond(x.sum() > 0, lambda v: v + 1, lambda v: v - 1, (x,))  # <- offender


def masked_select(x):
    return x[x > 0] * 2  # <- offender


def complex_math(x):
    return (torch.view_as_complex(x) * 2).tan()  # <- offender (complex64 runs as pairs; tan has no pair lowering)


UNRUNNABLE = [
    pytest.param(with_cond, lambda: torch.randn(5), "torch.cond", {}, id="torch.cond"),
    pytest.param(masked_select, lambda: torch.randn(8), "data-dependent output shape",
                 {"capture_dynamic_output_shape_ops": True}, id="data-dependent-shape"),
    pytest.param(complex_math, lambda: torch.randn(3, 2), "complex", {}, id="complex"),
]  # fmt: skip


@pytest.mark.parametrize("fn, make_input, reason, dynamo_config", UNRUNNABLE)
@pytest.mark.parametrize("strict", [True, False])
def test_unrunnable_refused_with_user_line(fn, make_input, reason, dynamo_config, strict):
    with torch._dynamo.config.patch(**dynamo_config), pytest.raises(Exception) as excinfo:
        _compile(fn, strict=strict)(make_input())
    text = _error_text(excinfo)
    assert "NeuronUnsupportedOpError" in text and reason in text, f"{fn.__name__}: {text}"
    assert _line(fn) in text, f"{fn.__name__}: user line {_line(fn)} not named in:\n{text}"


# -- float64 ----------------------------------------------------------------------------------------
def test_float64_warns_once_and_matches_eager_in_float32_tolerance():
    def f(x, y):
        return torch.tanh(x @ y) * 3 + x.sum()

    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(16, 4, dtype=torch.float64)
    cf = _compile(f)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = [cf(x, y) for _ in range(3)]
    f64 = [w for w in record if "float64" in str(w.message)]
    assert len(f64) == 1, [str(w.message) for w in f64]
    for g in got:
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, f(x, y), rtol=1e-5, atol=1e-5)


# -- mapping an illegal HLO op back to its aten node and user line ----------------------------------
def exp_then_sum(x):
    y = x * 2
    z = torch.exp(y)  # <- offender
    return z.sum(dim=0)


def test_corrupted_op_maps_back_to_aten_node_and_user_line(captured):
    _compile(exp_then_sum)(torch.randn(4, 5))
    (_, _, lowered) = captured[-1]
    text = lowered.stablehlo(debug_info=True)
    corrupted, n = re.subn(
        r"stablehlo\.exponential (%\w+) : (tensor<[^>]+>)", r"stablehlo.custom_call @host_exp(\1) : (\2) -> \2", text
    )
    assert n == 1, text
    report = legality.check_module(corrupted, node_table=lowered.node_table, graph_name="corrupted")
    assert not report.legal
    [node] = report.unsupported_nodes()
    assert node.op == "aten.exp.default"
    assert node.source == _line(exp_then_sum)
    assert "host_exp" in node.reason
    # The uncorrupted module is legal, so the finding is the corruption and nothing else.
    assert legality.check_module(text, node_table=lowered.node_table).legal


def int16_add(a, b):
    return a + b  # <- offender


def test_unsupported_dtype_maps_back_to_aten_node():
    a, b = torch.arange(6, dtype=torch.int16), torch.ones(6, dtype=torch.int16)
    with pytest.raises(Exception) as excinfo:
        _compile(int16_add)(a, b)
    text = _error_text(excinfo)
    assert "aten.add.Tensor" in text and "int16 is not a NeuronCore data type" in text, text
    assert _line(int16_add) in text


# -- int64 policy -----------------------------------------------------------------------------------
def test_int64_policy(captured):
    def f(i):
        return (i * 3 + 1).cumsum(0)

    i = torch.arange(10)
    assert torch.equal(_compile(f)(i), f(i))  # CPU verdict assumes neuronx-cc --native-int64
    lowered = captured[-1][2]
    cpu = legality.check(lowered, Options(target="cpu"))
    assert cpu.legal and cpu.uses_int64
    # The neuron target always passes --native-int64 to neuronx-cc, so int64 is legal there too.
    assert "--native-int64" in NeuronTarget("trn2").command("m.mlir", "m.neff")
    assert legality.check(lowered, Options(target="neuron")).legal


# -- device calls -----------------------------------------------------------------------------------
def device_friendly(x, y):
    a = torch.nn.functional.gelu(x) + torch.nn.functional.gelu(x, approximate="tanh")
    b = torch.nn.functional.silu(y) + torch.erf(x)
    c = torch.softmax(a * b, dim=0)
    v, i = torch.topk(c, 2, dim=1)
    return c.argmax(dim=1), c.argmin(dim=0), v, i


DEVICE_TARGETS = {
    "AwsNeuronGelu", "AwsNeuronGeluApprxTanh", "AwsNeuronSilu", "AwsNeuronErf", "AwsNeuronSoftmax",
    "AwsNeuronTopK", "AwsNeuronArgMax", "AwsNeuronArgMin",
}  # fmt: skip


def test_device_calls_same_verdict_on_both_targets_and_eager_numerics(captured):
    torch.manual_seed(0)
    x, y = torch.randn(6, 7), torch.randn(6, 7)
    got = _compile(device_friendly)(x, y)
    want = device_friendly(x, y)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    for g, w, what in zip(got, want, ["argmax", "argmin", "topk values", "topk indices"]):
        if not g.is_floating_point():
            assert torch.equal(g, w), what
    gm, inputs, cpu_lowered = captured[-1]
    neuron_lowered = lower_graph(gm, inputs, "neuron_form", target="neuron")
    neuron_text = neuron_lowered.stablehlo()
    cpu_text = cpu_lowered.stablehlo()
    for name in DEVICE_TARGETS:
        assert f"custom_call @{name}(" in neuron_text, f"{name} missing from the neuron form"
        assert f"call @{name}__cpu_reference" in cpu_text, f"{name} missing from the cpu form"
    assert "custom_call" not in cpu_text  # XLA CPU could not run it
    cpu_report = legality.check_module(cpu_lowered)
    neuron_report = legality.check_module(neuron_lowered)
    assert cpu_report.legal and neuron_report.legal
    assert cpu_report.device_calls == neuron_report.device_calls


def _lower(fn, *structs, target="cpu"):
    with mock.patch.object(device_calls, "current_target", lambda: target):
        return jax.jit(fn).lower(*structs)


def test_device_call_reference_must_match_declared_signature():
    with pytest.raises(RuntimeError, match="AwsNeuronErf reference body produced"):
        _lower(
            lambda x: device_calls.device_call(
                "AwsNeuronErf", lambda v: v[:2], x, results=jax.ShapeDtypeStruct(x.shape, x.dtype)
            ),
            jax.ShapeDtypeStruct((4,), jnp.float32),
        )


# -- the pass itself, on hand-written modules (one restriction each) --------------------------------
F32 = jax.ShapeDtypeStruct((4, 6), jnp.float32)
I32 = jax.ShapeDtypeStruct((4, 6), jnp.int32)
S32 = jax.ShapeDtypeStruct((), jnp.int32)
IMG = jax.ShapeDtypeStruct((1, 1, 8, 8), jnp.float32)
KER = jax.ShapeDtypeStruct((1, 1, 3, 3), jnp.float32)

MODULES = [
    ("conditional", lambda x, n: lax.cond(n > 0, lambda v: v + 1, lambda v: v - 1, x), (F32, S32), "conditional"),
    ("variadic-reduce", lambda x, n: jnp.argmax(x, axis=1), (F32, S32), "variadic reduce"),
    ("totalorder-sort", lambda x, n: lax.sort(x, dimension=1), (F32, S32), "sort comparator"),
    ("dynamic-while", lambda x, n: lax.fori_loop(0, n, lambda i, v: v * 2, x), (F32, S32), "static trip count"),
    ("runtime-dus", lambda x, n: lax.dynamic_update_slice(x, x[:1], (n, n * 0)), (F32, S32), "constant indices"),
    ("integer-dot", lambda x, n: x @ x.T, (I32, S32), "integer dot"),
    ("integer-conv", lambda a, k: lax.conv_general_dilated(a.astype(jnp.int32), k.astype(jnp.int32), (1, 1), "SAME"),
     (IMG, KER), "integer convolution"),
    ("sra-on-i8", lambda x, n: lax.shift_right_arithmetic(x.astype(jnp.int8), jnp.int8(1)), (I32, S32), "32-bit"),
    ("conv-dilations", lambda a, k: lax.conv_general_dilated(a, k, (1, 1), ((0, 0), (0, 0)), lhs_dilation=(2, 2),
                                                             rhs_dilation=(2, 2)), (IMG, KER), "dilation"),
    ("reduce-window-dilation", lambda x, n: lax.reduce_window(x, 0.0, lax.add, (2, 2), (1, 1), "VALID",
                                                              window_dilation=(2, 1)), (F32, S32), "dilation"),
    ("topk-int", lambda x, n: lax.top_k(x, 2)[0], (I32, S32), "TopK on i32"),
    ("float64", lambda x, n: x.astype(jnp.float64) * 2, (F32, S32), "float64"),
    ("int16", lambda x, n: x.astype(jnp.int16) + 1, (I32, S32), "int16"),
]  # fmt: skip


@pytest.mark.parametrize("fn, structs, needle", [pytest.param(*m[1:], id=m[0]) for m in MODULES])
def test_module_restriction_flagged(fn, structs, needle):
    with jax.enable_x64(True):
        lowered = jax.jit(fn).lower(*structs)
    report = legality.check_module(lowered)
    details = [v.detail for v in report.violations]
    assert any(needle in d for d in details), details


LEGAL_MODULES = [
    ("static-while", lambda x, n: lax.fori_loop(0, 3, lambda i, v: v * 2, x)),
    ("sum-max", lambda x, n: jnp.sum(x, axis=0) + jnp.max(x)),
    ("const-dus", lambda x, n: lax.dynamic_update_slice(x, x[:1], (2, 0))),
    ("plain-sort", lambda x, n: lax.sort(lax.bitcast_convert_type(x, jnp.int32), dimension=1)),
]


@pytest.mark.parametrize("fn", [pytest.param(m[1], id=m[0]) for m in LEGAL_MODULES])
def test_module_legal(fn):
    report = legality.check_module(jax.jit(fn).lower(F32, S32))
    assert report.legal, report.to_text()


def test_verdict_by_generation_for_docs():
    lowered = jax.jit(lambda x: x.astype(jnp.float8_e4m3fn)).lower(F32)
    verdicts = legality.verdict_by_generation(lowered)
    assert not verdicts["trn2"].legal and "float8_e4m3fn" in verdicts["trn2"].label()
    assert verdicts["trn3"].legal and verdicts["trn3"].label() == "yes"
    sig = legality.verdict_by_generation(jax.jit(lambda x: lax.rem(x, x)).lower(F32))
    assert sig["trn2"].legal and "stablehlo.remainder" in sig["trn2"].label()  # legal by assumption only


# -- debug dumps ------------------------------------------------------------------------------------
class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return torch.nn.functional.gelu(self.fc(x)).sum()  # <- offender


def test_debug_dump_of_a_training_step(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("NEURON_COMPILE_LOGS", "graphs")
    model = Tiny()
    cmodel = torch.compile(model, backend="neuron", dynamic=False, options={**NO_CACHE, "debug_dir": str(tmp_path)})
    with caplog.at_level(logging.INFO, logger="neuron_compile.graphs"):
        cmodel(torch.randn(3, 8)).backward()
    [proc] = list(tmp_path.iterdir())
    assert re.fullmatch(r"neuron_compile_\d{8}-\d{6}_pid\d+", proc.name)
    graphs = {d.name: d for d in proc.iterdir()}
    fw = [d for n, d in graphs.items() if n.endswith("_forward")]
    bw = [d for n, d in graphs.items() if n.endswith("_backward")]
    assert len(fw) == 1 and len(bw) == 1, sorted(graphs)
    user_line = _line(Tiny.forward)
    for d in fw + bw:
        for f in ("fx_graph.py", "stablehlo.mlir", "legality.txt", "legality.json", "timings.json", "nodes.json"):
            assert (d / f).is_file(), f"{d.name}/{f} missing"
        hlo = (d / "stablehlo.mlir").read_text()
        assert "loc(" in hlo and "test_legality.py:" in hlo, f"{d.name}: locations do not name the user file"
        assert "LEGAL" in (d / "legality.txt").read_text()
        assert "lower_s" in json.loads((d / "timings.json").read_text())
    assert "gelu" in (fw[0] / "fx_graph.py").read_text()
    sources = {v["source"] for v in json.loads((fw[0] / "nodes.json").read_text()).values()}
    assert user_line in sources, sources
    summaries = [r.getMessage() for r in caplog.records if r.name == "neuron_compile.graphs"]
    assert any(fw[0].name in s and "legal" in s for s in summaries), summaries


# -- per-op verdicts (docs/ops.md's trn2/trn3 columns) ----------------------------------------------
@pytest.mark.parametrize(
    "fn, make, op, expected",
    [
        (lambda x: x.to(torch.int16), lambda: torch.arange(10), "aten._to_copy.default", "no:"),
        (lambda x: torch.remainder(x, 3.0), lambda: torch.randn(8), "aten.remainder.Scalar", "yes (assumed:"),
        (lambda x: x * 2, lambda: torch.randn(8), "aten.mul.Tensor", "yes"),
    ],
    ids=["int16", "remainder", "mul"],
)
def test_verdicts_by_op(captured, fn, make, op, expected) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _compile(fn, strict=False)(make())
    verdicts = legality.verdicts_by_op(captured[-1][2])
    for generation in ("trn2", "trn3"):
        label = verdicts[op][generation].label()
        assert label.startswith(expected) and (expected != "yes" or label == "yes"), (op, generation, label)
