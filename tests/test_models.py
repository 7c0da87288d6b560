"""The models people bring: tiny random-init Hugging Face families and a ResNet-style CNN, float32 and
bfloat16, trained under backend="neuron"; Mixtral with transformers' default (grouped_mm) experts; greedy
``generate()`` with a static KV cache.

Numerics are judged as torch's accuracy checker judges them (``neuron_compile.evaluate.numerics``): every
output and parameter gradient of the compiled model, at the model's dtype, may be at most a stated
multiple further from a float64 reference copy of the model than eager at the same dtype is (with cosine
similarity for bfloat16). Comparing compiled bf16 directly with eager bf16 would ask the wrong question:
eager bf16 is itself ~1e-2 away from the true values.

The histogram and grouped-matmul lowerings MoE routers need are tested op by op at the end (not slow).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from neuron_compile import STATS
from neuron_compile.evaluate.numerics import DEFAULT_TOL, NumericsVerdict, compare_to_reference, merge

from .model_zoo import BATCH, ZOO, ZooCase, _tokens, cast_inputs, copy_as

#: The zoo's costliest training cases (10-36 s each), run by CI's extended job (pyproject.toml's markers).
EXTENDED_ZOO = {"sd_unet", "whisper", "bart", "mixtral"}

pytest.importorskip("transformers")

DTYPES = [torch.float32, torch.bfloat16]
STEPS = 2
LR = 0.1


class _Run:
    """One copy of the model (reference, eager or compiled) stepping with its own SGD."""

    def __init__(self, case: ZooCase, model: torch.nn.Module, dtype: torch.dtype, compiled: bool) -> None:
        self.case, self.model = case, model
        self.inputs = cast_inputs(case.inputs, dtype)
        self.fn = torch.compile(model, backend="neuron", dynamic=False) if compiled else model
        self.opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(self) -> tuple[Any, dict[str, torch.Tensor]]:
        self.opt.zero_grad(set_to_none=True)
        loss, outputs = self.case.step(self.fn, self.inputs)
        loss.backward()
        grads = {name: p.grad for name, p in self.model.named_parameters() if p.grad is not None}
        self.opt.step()
        return outputs, grads


def _rms(t: torch.Tensor) -> float:
    return torch.sqrt(torch.mean(t.detach().double() ** 2)).item()


def _split_exact_zeros(
    ref_g: dict[str, torch.Tensor], eager_g: dict[str, torch.Tensor], comp_g: dict[str, torch.Tensor], tol: float
) -> list[str]:
    """Remove (and check) the gradients that are zero in exact arithmetic (attention key biases: softmax
    ignores a per-query constant). Their float64 reference is ~1e-17 noise, so neither an error ratio nor
    a cosine to it means anything; instead the compiled gradient must stay at noise level: within 3x
    eager's magnitude or the judge's floor (tol / 10 of the gradients' scale). Returns their names."""
    scale = max(_rms(g) for g in ref_g.values())
    zeros = [n for n, g in ref_g.items() if _rms(g) <= 1e-9 * scale]
    for n in zeros:
        ref_g.pop(n)
        bound = max(3 * _rms(eager_g.pop(n)), tol / 10 * scale)
        got = _rms(comp_g.pop(n))
        assert got <= bound, (
            f"grad of {n} is zero in exact arithmetic; compiled RMS {got:.3g} > noise bound {bound:.3g}"
        )
    return zeros


def _judge(case: ZooCase, dtype: torch.dtype) -> list[NumericsVerdict]:
    """The verdict of each training step (outputs and gradients, each group with its own scale).

    Every tensor gets the tolerance of the model's dtype, as torch's checker takes it from the run's
    precision: a float32 loss computed from bfloat16 logits is only as exact as they are."""
    tol = DEFAULT_TOL[dtype]
    runs = [
        _Run(case, case.reference(), torch.float64, compiled=False),
        _Run(case, copy_as(case.model, dtype), dtype, compiled=False),
        _Run(case, copy_as(case.model, dtype), dtype, compiled=True),
    ]
    verdicts, graphs_after_first = [], None
    for step in range(STEPS):
        (ref_out, ref_g), (eager_out, eager_g), (comp_out, comp_g) = (r.step() for r in runs)
        assert comp_g.keys() == eager_g.keys() == ref_g.keys(), f"{case.name}: parameters with gradients differ"
        _split_exact_zeros(ref_g, eager_g, comp_g, tol)
        verdicts.append(
            merge(
                [
                    compare_to_reference(ref_out, eager_out, comp_out, prefix=f"step{step}:", tol=tol),
                    compare_to_reference(
                        list(ref_g.values()), list(eager_g.values()), list(comp_g.values()),
                        names=[f"step{step}:grad[{n}]" for n in comp_g], tol=tol,
                    ),
                ]
            )
        )  # fmt: skip
        if step == 0:
            graphs_after_first = STATS.count()
    assert STATS.count() == graphs_after_first, f"{case.name}: later steps compiled again: {STATS.graphs}"
    return verdicts


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.extended) if n in EXTENDED_ZOO else n for n in ZOO])
def test_training_steps_match_reference(name: str, dtype: torch.dtype) -> None:
    STATS.reset()
    for step, verdict in enumerate(_judge(ZOO[name](), dtype)):
        assert verdict.ok, f"{name} {dtype} step {step}: " + verdict.describe()
    assert STATS.count("forward") >= 1 and STATS.count("backward") >= 1, STATS.graphs


@pytest.mark.slow
@pytest.mark.parametrize("padding", ["unpadded", "left-padded"])
@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_greedy_generate_static_cache_two_graphs(name: str, padding: str) -> None:
    """Prefill and decode are the only graphs for any number of new tokens; tokens equal eager's. A
    left-padded batch has queries that see no key at all (the padding), which SDPA answers with zeros."""
    model = ZOO[name]().model.eval()
    ids = ZOO[name]().inputs["input_ids"][:, :6].clone()
    kw: dict[str, Any] = dict(max_new_tokens=5, do_sample=False, cache_implementation="static", pad_token_id=0)
    if padding == "left-padded":
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        ids[mask == 0] = 0
        kw["attention_mask"] = mask
    with torch.no_grad():
        expected = model.generate(ids, **kw)
        STATS.reset()
        model.forward = torch.compile(model.forward, backend="neuron", dynamic=False)
        got = model.generate(ids, **kw)
    assert [g.kind for g in STATS.graphs] == ["inference", "inference"], STATS.graphs
    assert torch.equal(got, expected), f"{name}: compiled generate {got.tolist()} != eager {expected.tolist()}"


# --- the MoE ops, one by one ----------------------------------------------------------------------------


def _compiled(fn: Any, *args: Any) -> Any:
    return torch.compile(fn, backend="neuron", dynamic=False, fullgraph=True)(*args)


HISTC_CASES = {
    # (input, bins, min, max): edges, outside values, NaN, max itself, the data's own range (min == max)
    "router_ids": (torch.tensor([0.0, 1, 1, 3, 3, 3, 2.5, -1, 4, float("nan")]), 4, 0, 3),
    "random_range": (torch.randn(1000, generator=torch.Generator().manual_seed(0)), 7, -1.3, 2.2),
    "data_range": (torch.randn(4, 25, generator=torch.Generator().manual_seed(1)), 5, 0, 0),
    "constant_data": (torch.full((10,), 2.0), 5, 0, 0),
    "bfloat16": (torch.randn(300, generator=torch.Generator().manual_seed(2)).bfloat16(), 6, -2, 2),
}


@pytest.mark.parametrize("case", list(HISTC_CASES))
def test_histc_matches_eager(case: str) -> None:
    x, bins, lo, hi = HISTC_CASES[case]
    got = _compiled(lambda t: torch.histc(t, bins=bins, min=lo, max=hi), x)
    expected = torch.histc(x, bins=bins, min=lo, max=hi)
    assert got.dtype == expected.dtype and torch.equal(got, expected), f"histc {case}: {got} != {expected}"


def test_bincount_with_data_dependent_length_is_refused_with_advice() -> None:
    with pytest.raises(Exception, match="bincount|static"):
        _compiled(lambda t: torch.bincount(t), torch.tensor([0, 2, 2, 5]))


# Uneven groups, an empty group and rows past the last offset (eager leaves them undefined: not compared).
OFFS = torch.tensor([4, 4, 10], dtype=torch.int32)
ALL = slice(None)
LAYOUTS = {
    # name: (mat_a shape, mat_b shape, what eager defines of: the result, mat_a's grad, mat_b's grad)
    "2d_x_3d": ((12, 8), (3, 8, 16), slice(0, 10), slice(0, 10), ALL),
    "3d_x_2d": ((3, 8, 8), (8, 16), (ALL, slice(0, 10)), ALL, (ALL, slice(0, 10))),
    "2d_x_2d": ((16, 16), (16, 16), ALL, (ALL, slice(0, 10)), slice(0, 10)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grouped_mm_forward_and_backward_match_eager(layout: str) -> None:
    a_shape, b_shape, defined, a_defined, b_defined = LAYOUTS[layout]
    g = torch.Generator().manual_seed(3)
    # torch._grouped_mm under Dynamo takes bfloat16 only; its CPU kernel accumulates in float32, as we do.
    a = torch.randn(a_shape, generator=g).bfloat16().requires_grad_()
    b = torch.randn(b_shape, generator=g).bfloat16().requires_grad_()
    seed = torch.randn(torch._grouped_mm(a, b, offs=OFFS).shape, generator=g).bfloat16()
    mask = torch.zeros_like(seed)
    mask[defined] = 1
    cot = seed * mask  # undefined rows get no gradient, so both sides' gradients are defined

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(a, b, offs=OFFS)

    out = _compiled(f, a, b)
    (out * cot).float().sum().backward()
    ga, gb = a.grad, b.grad
    a.grad = b.grad = None
    expected = f(a, b)
    (expected * cot).float().sum().backward()
    torch.testing.assert_close(out[defined], expected[defined], rtol=1.6e-2, atol=1e-2, msg=f"grouped_mm {layout}")
    for what, got, want, part in (("mat_a", ga, a.grad, a_defined), ("mat_b", gb, b.grad, b_defined)):
        torch.testing.assert_close(
            got[part], want[part], rtol=1.6e-2, atol=1e-2, msg=f"grouped_mm {layout} grad of {what}"
        )


def test_transformers_grouped_mm_fallback_forward_and_backward_match_eager() -> None:
    """transformers' float32 path under torch.compile: its custom op and the op's custom backward."""
    from transformers.integrations import moe

    g = torch.Generator().manual_seed(4)
    x = torch.randn(12, 8, generator=g, requires_grad=True)
    w = torch.randn(3, 8, 6, generator=g, requires_grad=True)
    cot = torch.randn(12, 6, generator=g)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.transformers.grouped_mm_fallback(x, w, OFFS)

    assert moe is not None
    out = _compiled(f, x, w)
    (out * cot).sum().backward()
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    expected = f(x, w)
    (expected * cot).sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-5)


#: Token seeds of T5's extra batches: before SDPA's math path computed bf16 in float32, compiled was 2.11x
#: (worst gradient's worst element) and 1.58x (normwise) eager's error on them; the zoo's batch was 1.0x.
T5_BATCH_SEEDS = (4, 5)


def _t5_batches(case: ZooCase) -> dict[str, dict[str, torch.Tensor]]:
    extra = {
        f"tokens {s}": {"input_ids": _tokens(100 + s), "labels": _tokens(200 + s, (BATCH, 8))} for s in T5_BATCH_SEEDS
    }
    return {"zoo": case.inputs, **extra}


def _t5_error_measures(ref: dict[str, torch.Tensor]) -> list[Any]:
    """Distances of a run's gradients to ``ref``'s (the float32 model's), as issue 52 measures them."""
    scale = max(g.abs().max().item() for g in ref.values())

    def each_gradients_worst_element(run: dict[str, torch.Tensor]) -> float:
        return max((run[n] - ref[n]).abs().max().item() / ref[n].abs().max().item() for n in ref)

    def worst_element_over_scale(run: dict[str, torch.Tensor]) -> float:
        return max((run[n] - ref[n]).abs().max().item() for n in ref) / scale

    def normwise(run: dict[str, torch.Tensor]) -> float:
        diff = torch.cat([(run[n] - ref[n]).flatten() for n in ref])
        return (diff.norm() / torch.cat([g.flatten() for g in ref.values()]).norm()).item()

    return [each_gradients_worst_element, worst_element_over_scale, normwise]


def test_t5_bfloat16_one_step_gradients_within_2x_of_eager() -> None:
    """Issues 38.2 and 52.3: bf16 T5's first-step gradients, compiled, at most 2x further from the float32 model's
    than eager bf16's: each gradient's worst element relative to the float32 gradient's largest (the worst
    gradient), the worst element over the gradients' scale, and normwise over all of them; on the zoo's
    batch and two more (``T5_BATCH_SEEDS``). The drift was T5's attention (its position bias is a float mask,
    so SDPA ran as bf16 math: docs/numerics.md), which ``evaluate --bisect --bisect-mode modules`` names
    (docs/bisect.md). One gradient's ratio alone is not asked: at some batches a gradient is so sensitive that
    eager with its SDPA math backend instead of flash moves its error 2.9x."""
    case = ZOO["t5"]()
    models = {"reference": copy_as(case.model, torch.float32), "eager": copy_as(case.model, torch.bfloat16),
              "compiled": copy_as(case.model, torch.bfloat16)}  # fmt: skip
    fns = {**models, "compiled": torch.compile(models["compiled"], backend="neuron", dynamic=False)}
    for batch, inputs in _t5_batches(case).items():
        grads = {}
        for run, fn in fns.items():
            models[run].zero_grad(set_to_none=True)
            case.step(fn, cast_inputs(inputs, next(models[run].parameters()).dtype))[0].backward()
            grads[run] = {n: p.grad.double() for n, p in models[run].named_parameters() if p.grad is not None}
        assert grads["reference"].keys() == grads["eager"].keys() == grads["compiled"].keys()
        for measure in _t5_error_measures(grads["reference"]):
            e, c = measure(grads["eager"]), measure(grads["compiled"])
            assert c <= 2 * e, (
                f"t5 bfloat16 gradients, {batch}, {measure.__name__}: compiled {c:.3g} > 2 x eager {e:.3g}"
            )
