"""FlexAttention (issue 49 item 2): ``torch.ops.higher_order.flex_attention`` and ``flex_attention_backward``
lowered by lowering/flex_attention.py, with their score_mod and mask_mod graphs.

OpInfo-style: one case per kind of mod (causal, sliding window, document masking with a captured tensor,
ALiBi, a learned relative-position bias, tanh soft-capping with grouped-query attention, a batch-dependent
mask with fully masked queries, the logsumexp as a differentiated output), each compiled once in float32
and once in bfloat16; forward and backward come from that one compile, checked together. Every compile runs
the legality pass in strict mode (the default), so what the lowering emits is accepted for Trainium.

Yardsticks: a float64 reference and eager in the test's dtype, both torch's own math path of
``flex_attention`` (``math_attention`` forward, ``sdpa_dense_backward``), what it runs without a compiler.
torch's public ``flex_attention`` refuses CPU gradients before any math ("FlexAttention does not support
backward on CPU"); the references skip that one check. The compiled results must be as close to the float64
reference as eager's are, within a small factor: the RMS error within 2x eager's and the worst element
within 4x eager's worst (plus one ulp of the values' scale, for outputs eager gets exactly).
"""

from __future__ import annotations

import contextlib
import functools
import re
from dataclasses import dataclass, field
from typing import Any, Callable
from unittest import mock

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

import neuron_compile
from neuron_compile import compiler
from neuron_compile.lowering.flex_attention import MAX_ROW_GROUPS, RowGroup, row_groups

from .util import root_cause

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    """One flex_attention call: shapes, its mods (built from the case's learned tensors) and block size."""

    batch: int = 1
    heads: int = 2
    kv_heads: int = 2
    seq: int = 128
    dim: int = 16
    #: (learned tensors) -> score_mod, or None.
    score_mod: Callable[..., Any] | None = None
    mask_mod: Callable[..., Any] | None = None
    block: int = 32
    #: Shapes of the learned tensors the score_mod captures (their gradients are checked too).
    learned: tuple[tuple[int, ...], ...] = ()
    lse: bool = False
    skips_blocks: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _causal(b, h, q, k):
    return q >= k


def _sliding_window(b, h, q, k):
    return (q >= k) & (q - k < 24)


_DOCUMENTS = torch.tensor([[0] * 20 + [1] * 30 + [2] * 14, [0] * 40 + [1] * 24])


def _same_document(b, h, q, k):
    return (_DOCUMENTS[b, q] == _DOCUMENTS[b, k]) & (q >= k)


def _left_padded(b, h, q, k):  # batch row 1 hides its first 8 keys: its queries 0-7 see nothing
    return (k >= 8 * b) & (q >= k)


_ALIBI_SLOPES = torch.tensor([2.0**-1, 2.0**-4])


def _alibi(*learned):
    return lambda s, b, h, q, k: s + _ALIBI_SLOPES[h] * (k - q)


def _relative_bias(table):
    return lambda s, b, h, q, k: s + table[q - k + 127]


def _softcap(*learned):
    return lambda s, b, h, q, k: torch.tanh(s / 4) * 4


CASES = {
    "causal": Case(mask_mod=_causal, skips_blocks=True),
    "sliding_window": Case(mask_mod=_sliding_window, skips_blocks=True),
    "document": Case(batch=2, seq=64, mask_mod=_same_document, block=16),
    "alibi": Case(dim=32, score_mod=_alibi, mask_mod=_causal, block=64, skips_blocks=True),
    "relative_bias": Case(score_mod=_relative_bias, learned=((255,),)),
    "softcap_gqa": Case(batch=2, kv_heads=1, seq=64, score_mod=_softcap),
    "padded": Case(batch=2, seq=64, mask_mod=_left_padded, block=16, skips_blocks=True),
    "lse": Case(mask_mod=_causal, block=64, lse=True, skips_blocks=True),
}


@functools.lru_cache(maxsize=None)
def _block_mask(name: str) -> Any:
    case = CASES[name]
    if case.mask_mod is None:
        return None
    return create_block_mask(case.mask_mod, case.batch, None, case.seq, case.seq, device="cpu", BLOCK_SIZE=case.block)


def _attention(name: str) -> Callable[..., Any]:
    case = CASES[name]
    block_mask = _block_mask(name)

    def attend(q, k, v, *learned):
        score_mod = case.score_mod(*learned) if case.score_mod else None
        kwargs = {"return_aux": AuxRequest(lse=True)} if case.lse else {}
        out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                             enable_gqa=case.kv_heads != case.heads, **kwargs)  # fmt: skip
        return (out[0], out[1].lse) if case.lse else (out,)

    return attend


def _inputs(name: str, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(q, k, v, learned tensors) in ``dtype`` and the gradients of the outputs."""
    case = CASES[name]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(case.batch, case.heads, case.seq, case.dim, generator=g)
    k, v = (torch.randn(case.batch, case.kv_heads, case.seq, case.dim, generator=g) for _ in range(2))
    learned = [torch.randn(shape, generator=g) for shape in case.learned]
    grads = [torch.randn(case.batch, case.heads, case.seq, case.dim, generator=g).to(dtype)]
    if case.lse:
        grads.append(torch.randn(case.batch, case.heads, case.seq, generator=g))
    return [t.to(dtype) for t in (q, k, v, *learned)], grads


def _forward_backward(fn: Callable[..., Any], inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> list:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    return [o.detach() for o in outs] + list(torch.autograd.grad(outs, leaves, grads))


@contextlib.contextmanager
def _cpu_gradients_allowed():
    """torch's own flex_attention math with its refusal of CPU gradients skipped (the reference path)."""
    with mock.patch.object(flex_module, "_validate_device", lambda query, key, value: None):
        yield


@dataclass
class Run:
    compiled: list[torch.Tensor]
    eager: list[torch.Tensor]
    reference: list[torch.Tensor]
    #: StableHLO of the forward and backward graphs.
    modules: list[str]


@functools.lru_cache(maxsize=None)
def _run(name: str, dtype_name: str) -> Run:
    """One compile of the case (forward and backward graphs) and its references."""
    dtype = DTYPES[dtype_name]
    inputs, grads = _inputs(name, dtype)
    modules: list[str] = []

    def record(lowered: Any) -> None:
        modules.append(lowered.stablehlo())

    compiler.HOOKS.on_lowered.append(record)
    try:
        with torch._functorch.config.patch(enable_autograd_cache=False):  # every graph lowered, seen by the hook
            compiled = torch.compile(_attention(name), backend="neuron", dynamic=False, fullgraph=True)
            got = _forward_backward(compiled, inputs, grads)
    finally:
        compiler.HOOKS.on_lowered.remove(record)
    torch._dynamo.reset()  # the references compile flex_attention with torch's own eager backend, per mod
    with _cpu_gradients_allowed():
        eager = _forward_backward(_attention(name), inputs, grads)
        reference = _forward_backward(_attention(name), [t.double() for t in inputs], [t.double() for t in grads])
    return Run(got, eager, reference, modules)


def _names(name: str) -> list[str]:
    case = CASES[name]
    outputs = ["output", "logsumexp"] if case.lse else ["output"]
    return outputs + ["grad query", "grad key", "grad value"] + [f"grad learned {i}" for i in range(len(case.learned))]


def _assert_within_eagers_error(what: str, got: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor,
                                dtype: torch.dtype) -> None:  # fmt: skip
    got, eager, ref = (t.double() for t in (got, eager, ref))
    assert got.shape == ref.shape, f"{what}: shape {list(got.shape)}, eager's {list(ref.shape)}"
    finite = ref.isfinite()
    assert torch.equal(got.isfinite(), finite), f"{what}: non-finite values where the reference has none, or v.v."
    assert torch.equal(got[~finite], ref[~finite]), f"{what}: a different infinity than the reference"
    err, eager_err = (got - ref)[finite], (eager - ref)[finite]
    ulp = torch.finfo(dtype).eps * float(ref[finite].abs().max())
    rms, eager_rms = float(err.square().mean().sqrt()), float(eager_err.square().mean().sqrt())
    worst, eager_worst = float(err.abs().max()), float(eager_err.abs().max())
    assert rms <= 2 * eager_rms + ulp, f"{what}: RMS error {rms:.3g}, eager's {eager_rms:.3g}"
    assert worst <= 4 * eager_worst + ulp, f"{what}: worst error {worst:.3g}, eager's {eager_worst:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_forward_and_backward_within_eagers_error(name: str, dtype: str) -> None:
    """Output (and logsumexp), and the gradients of query, key, value and learned tensors the score_mod
    captures, against the float64 reference, within a small factor of eager's own error."""
    run = _run(name, dtype)
    for what, got, eager, ref in zip(_names(name), run.compiled, run.eager, run.reference, strict=True):
        _assert_within_eagers_error(f"{what} [{name}, {dtype}]", got, eager, ref, DTYPES[dtype])
    if name == "padded":  # batch row 1's queries 0-7 have every key masked: zeros, as eager's safe softmax
        assert not run.compiled[0][1, :, :8].any()
        assert not run.compiled[2][1, :, :8].any(), "a query that sees no key gets no gradient"


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.skips_blocks])
def test_masked_blocks_are_not_computed(name: str) -> None:
    """Where the mask_mod hides whole (query block, key block) pairs, neither graph holds a full
    [query, key] score matrix: the blocks it masks entirely are left out, forward and backward."""
    case, run = CASES[name], _run(name, "float32")
    assert len(run.modules) == 2, "a forward and a backward graph"
    full = re.compile(rf"tensor<(?:\d+x)*{case.seq}x{case.seq}x(?:f32|bf16|i1)>")
    for module in run.modules:
        assert "stablehlo.dot_general" in module
        assert not full.search(module), f"[{name}] a full {case.seq}x{case.seq} score matrix is computed"


def test_row_groups_of_common_masks() -> None:
    """The compile-time plan: causal keeps the key blocks up to the diagonal; a sliding window a band; a mask
    that keeps every block (or captures a tensor, so is unknown when compiling) is one dense group; many
    groups are merged down to MAX_ROW_GROUPS where merging computes the fewest extra scores."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def graph(mask_mod):
        return make_fx(mask_mod)(*(torch.zeros((), dtype=torch.int32) for _ in range(4)))

    def plan(mask_mod, buffers=(), block=32):
        return row_groups(graph(mask_mod), buffers, 1, 2, 128, 128, block, block)

    assert plan(_causal) == [RowGroup((i * 32, i * 32 + 32), ((0, i * 32 + 32),)) for i in range(4)]
    assert plan(_sliding_window) == [
        RowGroup((0, 32), ((0, 32),)),
        RowGroup((32, 64), ((0, 64),)),
        RowGroup((64, 96), ((32, 96),)),
        RowGroup((96, 128), ((64, 128),)),
    ]
    assert plan(lambda b, h, q, k: q >= 0) == [RowGroup((0, 128), ((0, 128),))]
    assert plan(_causal, buffers=(torch.zeros(1),)) == [RowGroup((0, 128), ((0, 128),))]
    assert plan(_causal, block=128) == [RowGroup((0, 128), ((0, 128),))]
    # A key block masked for every query of a query block, but not the next: runs of kept blocks.
    assert plan(lambda b, h, q, k: (k < 32) | (k >= 96)) == [RowGroup((0, 128), ((0, 32), (96, 128)))]
    # Causal in 16 query blocks of 8 rows: merged into 8 groups of two blocks, each its later block's keys.
    assert plan(_causal, block=8) == [RowGroup((i * 16, i * 16 + 16), ((0, i * 16 + 16),)) for i in range(8)]
    assert MAX_ROW_GROUPS == 8


@torch.library.custom_op("flex_attention_test::wobble", mutates_args=())
def _wobble(x: torch.Tensor) -> torch.Tensor:
    return x * 1.01


@_wobble.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_an_op_the_score_mod_uses_that_cannot_be_lowered_fails_naming_it() -> None:
    """A score_mod op without a lowering fails the compile, named with its source line and said to be in the
    score_mod (the flex_attention node is listed too)."""

    def wobbly(s, b, h, q, k):
        return torch.ops.flex_attention_test.wobble(s)

    q = torch.randn(1, 2, 16, 8)
    compiled = torch.compile(lambda q: flex_attention(q, q, q, score_mod=wobbly), backend="neuron", fullgraph=True)
    with pytest.raises(Exception) as info:
        compiled(q)
    error = root_cause(info.value)
    assert isinstance(error, neuron_compile.NeuronUnsupportedOpError), error
    lines = str(error).splitlines()
    wobble = [line for line in lines if "flex_attention_test.wobble" in line]
    assert wobble, str(error)
    assert "(in score_mod)" in wobble[0] and "test_flex_attention.py" in wobble[0], wobble[0]
    assert any(line.lstrip().startswith("flex_attention(") for line in lines), str(error)


def test_eager_still_refuses_cpu_gradients() -> None:
    """The neuron backend lifts torch's refusal of CPU gradients for its own compiles only: eager (and other
    backends) still make it."""
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex_attention(q, q, q)
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        torch.compile(flex_attention, backend="eager")(q, q, q)


def test_a_gradient_eager_cannot_give_is_refused_with_eagers_reason() -> None:
    """A learned tensor the score_mod uses without indexing it (a temperature) has a gradient per (batch,
    head, query, key) point that eager's vmap cannot return either: the backward is refused, saying so."""
    temperature = torch.tensor(0.7, requires_grad=True)
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    compiled = torch.compile(
        lambda q: flex_attention(q, q, q, score_mod=lambda s, b, h, i, j: s * temperature), backend="neuron"
    )
    out = compiled(q)
    with pytest.raises(Exception) as info:
        out.sum().backward()
    error = root_cause(info.value)
    assert isinstance(error, neuron_compile.NeuronUnsupportedOpError), error
    assert "flex_attention_backward(" in str(error) and "eager's flex_attention refuses it too" in str(error)
