"""Op families, pooling windows, padding and upsampling (antialiased resampling included), compared with eager.

Each case runs both routes of tests/lowering_cases.py (torch.compile, and aten level) against eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .lowering_cases import (
    BF16,
    F32,
    I64,
    Case,
    aten,
    check_aten,
    check_compiled,
    const,
    distinct,
    randn,
    with_nans,
)

# ---- pooling ------------------------------------------------------------------------------------------------------
POOLING = [
    Case("max_pool2d_indices", lambda x: F.max_pool2d(x, 2, return_indices=True), [distinct(2, 2, 6, 6)], (F32, BF16)),
    Case(
        "max_pool2d_pad_ceil",
        lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True, return_indices=True),
        [distinct(1, 2, 7, 6)],
    ),
    Case(
        "max_pool2d_dilation",
        lambda x: F.max_pool2d(x, (2, 3), (1, 2), (1, 1), dilation=2, return_indices=True),
        [distinct(2, 7, 8)],
    ),
    Case("max_pool2d_overlap_grad", lambda x: F.max_pool2d(x, 3, 1), [distinct(1, 1, 5, 5)], tol="sum"),
    Case(
        "max_pool2d_nan",
        lambda x: F.max_pool2d(x, 2, return_indices=True),
        [with_nans(distinct(1, 1, 4, 4), (0, 0, slice(0, 2), 1))],
        grad=False,
    ),
    Case("max_pool1d", lambda x: F.max_pool1d(x, 3, 2, 1, return_indices=True), [distinct(2, 3, 9)]),
    Case("max_pool3d", lambda x: F.max_pool3d(x, 2, return_indices=True), [distinct(1, 2, 4, 4, 4)]),
    Case("avg_pool2d", lambda x: F.avg_pool2d(x, 2), [randn(2, 3, 6, 6)], (F32, BF16), tol="sum"),
    Case(
        "avg_pool2d_pad_ceil_exclude",
        lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
        [randn(1, 2, 7, 6)],
        tol="sum",
    ),
    Case("avg_pool2d_pad_include", lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True), [randn(1, 2, 7, 6)], tol="sum"),
    Case(
        "avg_pool2d_divisor",
        lambda x: F.avg_pool2d(x, (2, 3), 1, (1, 0), divisor_override=5),
        [randn(2, 5, 6)],
        tol="sum",
    ),
    Case("avg_pool1d", lambda x: F.avg_pool1d(x, 3, 2, 1, count_include_pad=False), [randn(2, 3, 10)], tol="sum"),
    Case("avg_pool3d", lambda x: F.avg_pool3d(x, 2, 2, 1), [randn(1, 2, 5, 4, 4)], tol="sum"),
    # Integer average pooling truncates the integer window sum toward zero (negative sums included).
    *[
        Case(
            f"avg_pool{nd}d_int64_{how}",
            fn,
            [const(torch.randint(-20, 20, shape, generator=torch.Generator().manual_seed(2)))],
            (I64,),
        )
        for nd, shape, how, fn in (
            (1, (2, 3, 10), "pad_exclude", lambda x: F.avg_pool1d(x, 3, 2, 1, count_include_pad=False)),
            (2, (1, 2, 7, 6), "pad_ceil", lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True)),
            (2, (2, 5, 6), "divisor", lambda x: F.avg_pool2d(x, (2, 3), 1, (1, 0), divisor_override=5)),
            (3, (1, 2, 5, 4, 4), "pad", lambda x: F.avg_pool3d(x, 2, 2, 1)),
        )
    ],
    Case(
        "adaptive_avg_pool2d", lambda x: F.adaptive_avg_pool2d(x, (3, 4)), [randn(2, 3, 7, 9)], (F32, BF16), tol="sum"
    ),
    Case("adaptive_avg_pool1d", lambda x: F.adaptive_avg_pool1d(x, 4), [randn(2, 3, 10)], tol="sum"),
    Case("adaptive_avg_pool3d", lambda x: F.adaptive_avg_pool3d(x, (2, 3, 2)), [randn(1, 2, 5, 7, 3)], tol="sum"),
    Case(
        "adaptive_max_pool2d",
        lambda x: F.adaptive_max_pool2d(x, (3, 4), return_indices=True),
        [distinct(2, 2, 7, 9)],
        (F32,),
    ),
    Case("adaptive_max_pool1d", lambda x: F.adaptive_max_pool1d(x, 4, return_indices=True), [distinct(2, 3, 10)]),
    Case(
        "adaptive_max_pool2d_nan",
        lambda x: F.adaptive_max_pool2d(x, 3, return_indices=True),
        [with_nans(distinct(1, 1, 5, 5), (0, 0, 1, slice(1, 3)))],
        grad=False,
    ),
]


@pytest.mark.parametrize("case,dtype", [p for c in POOLING for p in c.params()])
def test_pooling(case: Case, dtype: torch.dtype) -> None:
    check_compiled(case, dtype)


# ---- padding and upsampling -------------------------------------------------------------------------------------
PADDING = [
    Case("pad_constant_crop", lambda x: F.pad(x, (1, -1, 2, 0), value=0.5), [randn(1, 2, 5, 5)], (F32,)),
    Case("pad_constant_int", lambda x: F.pad(x, (2, 1)), [const(torch.arange(6).reshape(2, 3))], (I64,)),
    Case("pad_reflect_2d", lambda x: F.pad(x, (1, 2, 2, 1), mode="reflect"), [randn(1, 2, 5, 5)], tol="sum"),
    Case(
        "pad_replicate_2d",
        lambda x: F.pad(x, (1, 2, 2, 1), mode="replicate"),
        [randn(1, 2, 5, 5)],
        tol="sum",
        requires=("aten.clamp.default",),
    ),
    Case(
        "interpolate_nearest",
        lambda x: F.interpolate(x, scale_factor=2, mode="nearest"),
        [randn(1, 2, 3, 4)],
        tol="sum",
    ),
    Case(
        "interpolate_bilinear",
        lambda x: F.interpolate(x, size=(5, 7), mode="bilinear"),
        [randn(1, 2, 3, 4)],
        tol="sum",
        requires=("aten.clamp.default",),
    ),
    # antialias=True: eager's CPU kernel has float32/float64 only (bfloat16: test_antialiased_bfloat16_...)
    *[
        Case(
            f"interpolate_{mode}_antialias_{how}_ac{int(ac)}",
            lambda x, mode=mode, ac=ac, kw=kw: F.interpolate(x, mode=mode, align_corners=ac, antialias=True, **kw),
            [randn(2, 3, 9, 13)],
            (F32,),
            tol="sum",
        )
        for mode in ("bilinear", "bicubic")
        for ac in (False, True)
        for how, kw in (
            ("down", {"size": (4, 5)}),
            ("up", {"size": (12, 20)}),
            ("mixed", {"size": (3, 17)}),
            ("scale", {"scale_factor": 0.35}),
        )
    ],
]


@pytest.mark.parametrize(
    "resize",
    [
        lambda x: F.interpolate(x, size=(4, 5), mode="bilinear", antialias=True),
        lambda x: F.interpolate(x, size=(4, 5), mode="bicubic", antialias=True),
    ],
    ids=["bilinear", "bicubic"],
)
def test_integer_images_are_refused_by_antialiased_resampling(resize) -> None:
    """Eager resamples uint8 images with a fixed-point kernel; computed in integer arithmetic here they would
    come out wrong, so they are refused. (Without antialias, uint8 goes through torch's own decomposition,
    as under Inductor: float math, rounded.)"""
    x = torch.randint(0, 256, (1, 3, 9, 13), dtype=torch.uint8)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="antialiased resampling of an integer"):
        torch.compile(resize, backend="neuron", dynamic=False)(x)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_antialiased_bfloat16_is_the_float32_result_rounded_once(mode: str) -> None:
    """Eager's CPU antialias kernel takes no bfloat16: the compiled result is judged against float64 on the
    same (bfloat16) input; computed in float32 and rounded once, it is within one bfloat16 rounding."""
    x = torch.randn(2, 3, 9, 13, generator=torch.Generator().manual_seed(0)).bfloat16()

    def resize(t: torch.Tensor) -> torch.Tensor:
        return F.interpolate(t, size=(4, 17), mode=mode, antialias=True)

    got = torch.compile(resize, backend="neuron", dynamic=False)(x)
    reference = resize(x.double())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), reference, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("case,dtype", [p for c in PADDING for p in c.params()])
def test_padding_compiled(case: Case, dtype: torch.dtype) -> None:
    check_compiled(case, dtype)


def _grad_probe(shape):
    return lambda dtype: torch.randn(shape).to(dtype)


ATEN_PADDING = [
    Case("reflection_pad1d", lambda x: aten.reflection_pad1d(x, [2, 3]), [randn(2, 3, 6)]),
    Case("reflection_pad2d", lambda x: aten.reflection_pad2d(x, [1, 2, 3, 0]), [randn(2, 4, 5)], (F32,)),
    Case("reflection_pad3d", lambda x: aten.reflection_pad3d(x, [1, 1, 0, 2, 2, 1]), [randn(1, 2, 3, 4, 5)]),
    Case("replication_pad1d", lambda x: aten.replication_pad1d(x, [3, 1]), [randn(2, 3, 4)]),
    Case("replication_pad2d", lambda x: aten.replication_pad2d(x, [2, 0, 1, 3]), [randn(1, 2, 3, 4)], (F32, BF16)),
    Case("replication_pad3d", lambda x: aten.replication_pad3d(x, [1, 2, 1, 0, 0, 1]), [randn(1, 1, 2, 3, 4)]),
    # Negative replication pads crop; eager reads output j from input clamp(j - low, 0, n - 1), so a crop
    # past the far edge still replicates the last element (the OpInfo replicate_negative samples).
    *[
        Case(
            f"replication_pad2d_negative_{i}",
            lambda x, p=p: aten.replication_pad2d(x, p),
            [randn(2, 3, 4, 4)],
            (F32, BF16),
        )
        for i, p in enumerate(([-4, 5, 0, 0], [0, 0, 2, -4], [-1, 2, -2, -1], [1, -3, 0, 0]))
    ],
    # Negative reflection pads crop too: output j reads input reflect(j - low) (the OpInfo pad.reflect sample).
    *[
        Case(
            f"reflection_pad2d_negative_{i}",
            lambda x, p=p: aten.reflection_pad2d(x, p),
            [randn(2, 3, 4, 4)],
            (F32, BF16),
        )
        for i, p in enumerate(([-2, 1, 0, 0], [0, 0, 3, -3], [-1, 2, -2, -1], [1, -3, 0, 0]))
    ],
    Case(
        "reflection_pad2d_negative_backward",
        lambda g, x: aten.reflection_pad2d_backward(g, x, [-2, 1, 3, -1]),
        [_grad_probe((1, 2, 6, 3)), randn(1, 2, 4, 4)],
        tol="sum",
    ),
    Case(
        "replication_pad1d_negative_backward",
        lambda g, x: aten.replication_pad1d_backward(g, x, [-4, 5]),
        [_grad_probe((2, 3, 5)), randn(2, 3, 4)],
        tol="sum",
    ),
    Case(
        "replication_pad2d_negative_backward",
        lambda g, x: aten.replication_pad2d_backward(g, x, [-1, 2, 2, -4]),
        [_grad_probe((1, 2, 2, 5)), randn(1, 2, 4, 4)],
        tol="sum",
    ),
    Case(
        "reflection_pad2d_backward",
        lambda g, x: aten.reflection_pad2d_backward(g, x, [1, 2, 3, 0]),
        [_grad_probe((2, 7, 8)), randn(2, 4, 5)],
        tol="sum",
    ),
    Case(
        "reflection_pad1d_backward",
        lambda g, x: aten.reflection_pad1d_backward(g, x, [2, 3]),
        [_grad_probe((2, 3, 11)), randn(2, 3, 6)],
        tol="sum",
    ),
    Case(
        "replication_pad2d_backward",
        lambda g, x: aten.replication_pad2d_backward(g, x, [2, 0, 1, 3]),
        [_grad_probe((1, 2, 7, 6)), randn(1, 2, 3, 4)],
        (F32, BF16),
        tol="sum",
    ),
    Case(
        "replication_pad3d_backward",
        lambda g, x: aten.replication_pad3d_backward(g, x, [1, 2, 1, 0, 0, 1]),
        [_grad_probe((1, 1, 3, 4, 7)), randn(1, 1, 2, 3, 4)],
        tol="sum",
    ),
    Case(
        "upsample_nearest2d_scale",
        lambda x: aten.upsample_nearest2d.vec(x, None, [2.0, 3.0]),
        [randn(1, 2, 3, 4)],
        (F32,),
    ),
    Case("upsample_nearest2d_size", lambda x: aten.upsample_nearest2d.vec(x, [5, 7], None), [randn(1, 2, 3, 4)]),
    Case("upsample_nearest2d_down", lambda x: aten.upsample_nearest2d.default(x, [2, 3]), [randn(1, 2, 5, 7)]),
    Case("upsample_nearest1d", lambda x: aten.upsample_nearest1d.vec(x, None, [1.7]), [randn(2, 3, 5)]),
    Case(
        "upsample_nearest_exact2d", lambda x: aten._upsample_nearest_exact2d.vec(x, [5, 7], None), [randn(1, 2, 3, 4)]
    ),
    Case(
        "upsample_nearest2d_backward",
        lambda g: aten.upsample_nearest2d_backward.default(g, [5, 7], [1, 2, 3, 4], None, None),
        [_grad_probe((1, 2, 5, 7))],
        tol="sum",
    ),
    *[
        Case(f"upsample_bilinear2d_{how}_ac{int(ac)}", fn, [randn(1, 2, 4, 5)], (F32, BF16), tol="sum")
        for ac in (False, True)
        for how, fn in (
            ("size", lambda x, ac=ac: aten.upsample_bilinear2d.vec(x, [7, 3], ac, None)),
            ("scale", lambda x, ac=ac: aten.upsample_bilinear2d.vec(x, None, ac, [1.5, 2.0])),
            ("same", lambda x, ac=ac: aten.upsample_bilinear2d.default(x, [4, 9], ac, None, None)),
        )
    ],
    Case("upsample_linear1d", lambda x: aten.upsample_linear1d.vec(x, [9], False, None), [randn(2, 3, 4)], tol="sum"),
    Case(
        "upsample_trilinear3d",
        lambda x: aten.upsample_trilinear3d.vec(x, [3, 5, 4], True, None),
        [randn(1, 2, 2, 3, 4)],
        tol="sum",
    ),
    Case("upsample_nearest3d", lambda x: aten.upsample_nearest3d.vec(x, None, [2.0, 1.5, 0.5]), [randn(1, 2, 2, 3, 4)]),
    Case(
        "upsample_nearest1d_backward",
        lambda g: aten.upsample_nearest1d_backward.default(g, [7], [2, 3, 5], None),
        [_grad_probe((2, 3, 7))],
        tol="sum",
    ),
    *[
        Case(
            f"upsample_bilinear2d_backward_ac{int(ac)}",
            lambda g, ac=ac: aten.upsample_bilinear2d_backward.default(g, [7, 3], [1, 2, 4, 5], ac, None, None),
            [_grad_probe((1, 2, 7, 3))],
            tol="sum",
        )
        for ac in (False, True)
    ],
]


@pytest.mark.parametrize("case,dtype", [p for c in ATEN_PADDING for p in c.params()])
def test_padding_aten(case: Case, dtype: torch.dtype) -> None:
    check_aten(case, dtype)
