"""Exercises every lowered overload on its own and records its trn2/trn3 legality verdict (the command that
runs it over the registry and writes docs/overload_verdicts.json: ``python -m tools.exercise_overloads``).

Many lowered aten overloads are reached by no OpInfo sample (backward ops, ``*_copy`` variants, overloads
that decompositions produce), so the OpInfo sweep gives them no legality verdict. Here each overload of
``neuron_compile.lowering.supported_ops()`` gets representative inputs built from its schema (small
tensors; float32, and bfloat16 / int64 / bool where eager takes them; scalars, dims and sizes from the
defaults), with ``OVERRIDES`` for the ops that need specific arguments (indices in range, pooling
shapes). Each case runs in eager, becomes one node of an aten FX graph that holds many cases (XLA's
compile time per graph dominates, so cases are lowered and compiled in batches), is lowered with the
backend's own ``lower_graph``, judged by the legality pass (``legality.verdicts_by_op``, as the OpInfo
harness does) and run on the CPU target; its outputs are compared with eager's by the OpInfo harness's
rule (``opinfo_harness.compare``: torch's default tolerances, then the float64 reference).

An overload that cannot be exercised alone gets the reason from ``not_isolated`` instead: overloads of
Python numbers, lists or dicts (``aten.sin.complex``, ``aten.copy.Dict_str``) registered along with their
packet, which no aten graph of tensors holds. tests/test_overloads.py runs the first dtype of every
overload; the command runs them all and records them for docs/ops.md (``python -m tools.gen_ops_doc``).
"""

from __future__ import annotations

import json
import logging
import math
import operator
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensorMode

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "overload_verdicts.json"

#: The dtypes each overload is tried in: float32 always, the others where eager takes them.
VARIANTS: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "bool": torch.bool,
}

#: Cases lowered and compiled as one graph (XLA's compile time grows faster than linearly with size).
BATCH_SIZE = 48

#: Overloads returning eigenvectors / singular vectors (positions), which are unique only up to sign (see
#: ``opinfo_harness.SIGN_FREE_OPS``): those outputs are compared as magnitudes.
SIGN_FREE_VECTORS: dict[str, tuple[int, ...]] = {"aten._linalg_eigh.default": (1,), "aten._linalg_svd.default": (0, 2)}

#: Overloads that are never exercised alone, and why (besides the kinds ``not_isolated`` finds by schema).
NOT_ISOLATED: dict[str, str] = {
    **{
        f"aten.log.{o}": "Python-number overload of the two-argument log (log of a in base b), registered with the "
        "aten.log packet: a static-shape aten graph never holds it (Dynamo folds number arithmetic), and the "
        "packet's lowering is the one-argument tensor log, so it could not lower it"
        for o in ("int_int", "float_float", "int_float", "float_int", "Scalar_Scalar")
    },
}


def not_isolated(name: str) -> str | None:
    """Why overload ``name`` is not exercised alone, or None."""
    if name in NOT_ISOLATED:
        return NOT_ISOLATED[name]
    op = overload(name)
    types = [str(a.type) for a in op._schema.arguments]
    if any(t.startswith(("Dict[", "List[t]")) for t in types):
        return (
            f"a list/dict overload of {op._schema.name.replace('::', '.')} (registered with the packet): it takes no "
            "tensors, so no aten graph of tensors holds it"
        )
    if "complex" in types:
        return (
            "Python complex-number overload (registered with the packet): Trainium has no complex dtype, a "
            "static-shape aten graph never holds it (Dynamo folds number arithmetic), and the tensor lowering "
            "of the packet does not take Python complex numbers"
        )
    return None


#: Outputs whose values are undefined (torch.empty and friends): compared by shape and dtype only.
_UNDEFINED = frozenset({"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"})


# ---- inputs ----------------------------------------------------------------------------------------------
class Maker:
    """Builds the tensors of one case, reproducibly (seeded by overload and variant)."""

    def __init__(self, op: str, variant: str) -> None:
        self.dtype = VARIANTS[variant]
        self.gen = torch.Generator().manual_seed(zlib.crc32(f"{op}/{variant}".encode()))

    def __call__(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A tensor of the case's dtype (or ``dtype``): normal floats, integers 1..5, random bools."""
        dtype = dtype or self.dtype
        if dtype == torch.bool:
            return torch.rand(shape, generator=self.gen) > 0.5
        if not dtype.is_floating_point:
            return torch.randint(1, 6, shape, generator=self.gen, dtype=dtype)
        return torch.randn(shape, generator=self.gen).to(dtype)

    def f32(self, *shape: int) -> torch.Tensor:
        return self(*shape, dtype=torch.float32 if not self.dtype.is_floating_point else self.dtype)

    def pos(self, *shape: int) -> torch.Tensor:
        """Positive values of a floating dtype (variances, probabilities' complements)."""
        return self.f32(*shape).abs() + 0.5

    def index(self, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.gen)

    def perm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.gen)

    def mask(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.gen) > 0.5


Args = tuple[tuple, dict]


def _int8(m: Maker, *shape: int) -> torch.Tensor:
    return torch.randint(-128, 128, shape, generator=m.gen, dtype=torch.int8)


#: (upsampling op, spatial dims, whether it takes align_corners)
_UPSAMPLES = (
    ("upsample_nearest1d", 1, False), ("upsample_nearest2d", 2, False), ("upsample_nearest3d", 3, False),
    ("_upsample_nearest_exact1d", 1, False), ("_upsample_nearest_exact2d", 2, False),
    ("_upsample_nearest_exact3d", 3, False), ("upsample_linear1d", 1, True),
    ("upsample_bilinear2d", 2, True), ("upsample_trilinear3d", 3, True),
    ("_upsample_bilinear2d_aa", 2, True), ("_upsample_bicubic2d_aa", 2, True),
)  # fmt: skip
#: overload (or packet, ``aten.name``) -> inputs for one variant. Only where the schema defaults do not give
#: a valid call; a maker of the float32 variant builds float inputs (the others keep its dtype).
OVERRIDES: dict[str, Callable[[Maker], Args]] = {
    # pooling / upsampling / padding: batch x channels x spatial
    "aten._adaptive_avg_pool2d.default": lambda m: ((m(1, 2, 5, 6), [2, 3]), {}),
    "aten._adaptive_avg_pool2d_backward.default": lambda m: ((m(1, 2, 2, 3), m(1, 2, 5, 6)), {}),
    "aten._adaptive_avg_pool3d.default": lambda m: ((m(1, 2, 4, 5, 6), [2, 2, 3]), {}),
    "aten._adaptive_avg_pool3d_backward.default": lambda m: ((m(1, 2, 2, 2, 3), m(1, 2, 4, 5, 6)), {}),
    "aten.adaptive_max_pool2d.default": lambda m: ((m(1, 2, 5, 6), [2, 3]), {}),
    "aten.adaptive_max_pool2d_backward.default": lambda m: _pool_backward(
        m, torch.ops.aten.adaptive_max_pool2d.default, m(1, 2, 5, 6), [2, 3]
    ),
    "aten.adaptive_max_pool3d.default": lambda m: ((m(1, 2, 4, 5, 6), [2, 2, 3]), {}),
    "aten.adaptive_max_pool3d_backward.default": lambda m: _pool_backward(
        m, torch.ops.aten.adaptive_max_pool3d.default, m(1, 2, 4, 5, 6), [2, 2, 3]
    ),
    "aten.avg_pool2d.default": lambda m: ((m(1, 2, 5, 6), [2, 2], [2, 1], [1, 0]), {}),
    "aten.avg_pool2d_backward.default": lambda m: (
        (m(1, 2, 3, 5), m(1, 2, 5, 6), [2, 2], [2, 1], [1, 0], False, True, None), {}),
    "aten.avg_pool3d.default": lambda m: ((m(1, 2, 4, 5, 6), [2, 2, 2], [2, 2, 1], [0, 1, 0]), {}),
    "aten.avg_pool3d_backward.default": lambda m: (
        (m(1, 2, 2, 3, 5), m(1, 2, 4, 5, 6), [2, 2, 2], [2, 2, 1], [0, 1, 0], False, True, None), {}),
    "aten.max_pool2d_with_indices.default": lambda m: ((m(1, 2, 5, 6), [2, 2], [2, 1], [1, 0]), {}),
    "aten.fractional_max_pool2d.default": lambda m: ((m(1, 2, 5, 7), [2, 2], [3, 4], m(1, 2, 2).sigmoid()), {}),
    "aten.fractional_max_pool3d.default": lambda m: ((m(1, 2, 4, 5, 6), [2, 2, 2], [2, 3, 3], m(1, 2, 3).sigmoid()), {}),
    "aten.fractional_max_pool2d_backward.default": lambda m: _fractional_backward(m, m(1, 2, 5, 7), [2, 2], [3, 4]),
    "aten.fractional_max_pool3d_backward.default": lambda m: _fractional_backward(m, m(1, 2, 4, 5, 6), [2, 2, 2], [2, 3, 3]),
    "aten.max_pool2d_with_indices_backward.default": lambda m: _pool_backward(
        m, torch.ops.aten.max_pool2d_with_indices.default, m(1, 2, 5, 6), [2, 2], [2, 1], [1, 0], [1, 1], False
    ),
    "aten.max_pool3d_with_indices.default": lambda m: ((m(1, 2, 4, 5, 6), [2, 2, 2], [2, 2, 1], [0, 1, 0]), {}),
    "aten.max_pool3d_with_indices_backward.default": lambda m: _pool_backward(
        m, torch.ops.aten.max_pool3d_with_indices.default, m(1, 2, 4, 5, 6), [2, 2, 2], [2, 2, 1], [0, 1, 0],
        [1, 1, 1], False,
    ),
    **{
        f"aten.{kind}_pad{d}d.default": (lambda d: lambda m: ((m(1, 2, *[5] * d), [2, 1] * d), {}))(d)
        for kind in ("reflection", "replication")
        for d in (1, 2, 3)
    },
    **{
        f"aten.{kind}_pad{d}d_backward.default": (
            lambda d: lambda m: ((m(1, 2, *[8] * d), m(1, 2, *[5] * d), [2, 1] * d), {})
        )(d)
        for kind in ("reflection", "replication")
        for d in (1, 2, 3)
    },
    **{
        f"aten.{name}.default": (lambda d, lin: lambda m: (
            (m(1, 2, *[3] * d), [5] * d, *([True] if lin else [])), {}))(d, lin)
        for name, d, lin in _UPSAMPLES
    },
    **{
        f"aten.{name}.vec": (lambda d, lin: lambda m: (
            (m(1, 2, *[3] * d), None, *([False] if lin else []), [1.5] * d), {}))(d, lin)
        for name, d, lin in _UPSAMPLES
    },
    **{
        f"aten.{name}_backward.default": (lambda d, lin: lambda m: (
            (m(1, 2, *[5] * d), [5] * d, [1, 2, *[3] * d], *([True] if lin else [])), {}))(d, lin)
        for name, d, lin in _UPSAMPLES
    },
    # matmuls
    "aten.addmm.default": lambda m: ((m(3, 5), m(3, 4), m(4, 5)), {"beta": 2, "alpha": 3}),
    "aten.addmm.dtype": lambda m: ((m(3, 5), m(3, 4), m(4, 5), torch.float32), {}),  # see REFERENCES
    "aten.addmv.default": lambda m: ((m(3), m(3, 4), m(4)), {"beta": 2}),
    "aten.mm.default": lambda m: ((m(3, 4), m(4, 5)), {}),
    "aten.mm.dtype": lambda m: ((m(3, 4), m(4, 5), torch.float32), {}),
    "aten.bmm.default": lambda m: ((m(2, 3, 4), m(2, 4, 5)), {}),
    "aten.bmm.dtype": lambda m: ((m(2, 3, 4), m(2, 4, 5), torch.float32), {}),
    # eager's CPU kernel wants 16-byte strides: 8 columns of a 16-bit type, 4 of float32
    "aten._grouped_mm.default": lambda m: ((m(6, 8), m(3, 8, 8), torch.tensor([2, 3, 6], dtype=torch.int32)), {}),
    # quantized matmuls (lowering/quantization.py): int8 / float8 operands whatever the variant; e5m2 is a
    # trn2 type (e4m3fn is trn3's)
    "aten._int_mm.default": lambda m: ((_int8(m, 17, 40), _int8(m, 40, 8)), {}),
    "aten._weight_int8pack_mm.default": lambda m: ((m.f32(4, 16), _int8(m, 8, 16), m.pos(8) * 0.1), {}),
    "aten._scaled_mm.default": lambda m: (
        (m.f32(16, 32).to(torch.float8_e5m2), m.f32(8, 32).to(torch.float8_e5m2).t(), torch.tensor(0.5),
         torch.tensor(2.0)), {"out_dtype": torch.bfloat16}),
    "aten.fake_quantize_per_channel_affine_cachemask.default": lambda m: (
        (m.f32(4, 3) * 4, m.pos(3) * 0.1, torch.tensor([0, 1, -2], dtype=torch.int32), 1, -8, 7), {}),
    "aten._fake_quantize_learnable_per_tensor_affine.default": lambda m: (
        (m.f32(4, 3) * 4, m.pos(1) * 0.1, torch.tensor([1.4]), -8, 7), {}),
    "aten._fake_quantize_learnable_per_tensor_affine_backward.default": lambda m: (
        (m.f32(4, 3), m.f32(4, 3) * 4, m.pos(1) * 0.1, torch.tensor([1.4]), -8, 7), {}),
    "aten._fake_quantize_learnable_per_channel_affine.default": lambda m: (
        (m.f32(4, 3) * 4, m.pos(3) * 0.1, torch.tensor([0.0, 1.4, -2.5]), 1, -8, 7), {}),
    "aten._fake_quantize_learnable_per_channel_affine_backward.default": lambda m: (
        (m.f32(4, 3), m.f32(4, 3) * 4, m.pos(3) * 0.1, torch.tensor([0.0, 1.4, -2.5]), 1, -8, 7), {}),
    # factorizations (lowering/factorizations.py): square, symmetric positive-definite or triangular operands
    "aten.linalg_cholesky_ex.default": lambda m: ((_spd(m),), {}),
    "aten.cholesky.default": lambda m: ((_spd(m), True), {}),
    "aten.cholesky_solve.default": lambda m: ((m(2, 4, 3), torch.linalg.cholesky(_spd(m))), {}),
    "aten.cholesky_inverse.default": lambda m: ((torch.linalg.cholesky(_spd(m)),), {}),
    "aten.linalg_solve_triangular.default": lambda m: ((_dominant(m), m(2, 4, 3)), {"upper": True}),
    "aten.triangular_solve.default": lambda m: ((m(2, 4, 3), _dominant(m)), {}),
    "aten.linalg_lu_factor_ex.default": lambda m: ((m(2, 4, 4),), {}),
    "aten.linalg_lu.default": lambda m: ((m(2, 3, 5),), {}),
    "aten.lu_unpack.default": lambda m: (torch.linalg.lu_factor(_dominant(m)), {}),
    "aten.linalg_householder_product.default": lambda m: ((m.f32(5, 3), m.f32(3)), {}),
    "aten.ormqr.default": lambda m: ((m.f32(5, 3), m.f32(3), m.f32(5, 2)), {}),
    "aten.linalg_lu_solve.default": lambda m: ((*torch.linalg.lu_factor(_dominant(m)), m(2, 4, 3)), {"adjoint": True}),
    "aten._linalg_det.default": lambda m: ((m(2, 4, 4),), {}),
    "aten._linalg_eigh.default": lambda m: ((m(2, 4, 4),), {}),
    "aten._linalg_slogdet.default": lambda m: ((m(2, 4, 4),), {}),
    "aten.linalg_inv_ex.default": lambda m: ((_dominant(m),), {}),
    "aten._linalg_solve_ex.default": lambda m: ((_dominant(m), m(2, 4, 3)), {}),
    "aten.linalg_matrix_exp.default": lambda m: ((m(2, 4, 4),), {}),
    # convolutions
    "aten.convolution.default": lambda m: (
        (m(1, 4, 6, 7), m(6, 2, 3, 3), m(6), [1, 2], [1, 0], [1, 1], False, [0, 0], 2), {}),
    "aten.convolution_backward.default": lambda m: (
        (m(1, 6, 6, 3), m(1, 4, 6, 7), m(6, 2, 3, 3), [6], [1, 2], [1, 0], [1, 1], False, [0, 0], 2,
         [True, True, True]), {}),
    # normalization
    # training=False: with training=True these update the running stats in place, which only their
    # functionalized form (_native_batch_norm_legit_functional) does in an AOTAutograd graph
    "aten.native_batch_norm.default": lambda m: (
        (m(2, 3, 4), m(3), m(3), m(3), m.pos(3), False, 0.1, 1e-5), {}),
    "aten._native_batch_norm_legit.default": lambda m: (
        (m(2, 3, 4), m(3), m(3), m(3), m.pos(3), False, 0.1, 1e-5), {}),
    "aten._native_batch_norm_legit.no_stats": lambda m: ((m(2, 3, 4), m(3), m(3), True, 0.1, 1e-5), {}),
    "aten._native_batch_norm_legit_functional.default": lambda m: (
        (m(2, 3, 4), m(3), m(3), m(3), m.pos(3), True, 0.1, 1e-5), {}),
    "aten._native_batch_norm_legit_no_training.default": lambda m: (
        (m(2, 3, 4), m(3), m(3), m(3), m.pos(3), 0.1, 1e-5), {}),
    "aten.native_group_norm.default": lambda m: ((m(2, 4, 3), m(4), m(4), 2, 4, 3, 2, 1e-5), {}),
    "aten.native_layer_norm.default": lambda m: ((m(2, 3, 4), [4], m(4), m(4), 1e-5), {}),
    "aten.native_layer_norm_backward.default": lambda m: _layer_norm_backward(m),
    # softmax
    "aten._softmax_backward_data.default": lambda m: (
        (m(3, 4), torch.softmax(m(3, 4).float(), 1).to(m.dtype), 1, m.dtype), {}),
    "aten._log_softmax_backward_data.default": lambda m: (
        (m(3, 4), torch.log_softmax(m(3, 4).float(), 1).to(m.dtype), 1, m.dtype), {}),
    # losses
    "aten.nll_loss_forward.default": lambda m: ((m(3, 4), m.index(4, 3), m.pos(4), 1, -100), {}),
    "aten.nll_loss_backward.default": lambda m: (
        (m(), m(3, 4), m.index(4, 3), m.pos(4), 1, -100, m.pos()), {}),
    # indexing
    "aten.embedding.default": lambda m: ((m(6, 3), m.index(6, 2, 4)), {}),
    "aten.embedding_dense_backward.default": lambda m: ((m(2, 4, 3), m.index(6, 2, 4), 6, -1, False), {}),
    "aten.gather.default": lambda m: ((m(3, 4), 1, m.index(4, 3, 2)), {}),
    "aten.index.Tensor": lambda m: ((m(3, 4), [m.index(3, 5), None]), {}),
    "aten.index_put.default": lambda m: ((m(3, 4), [m.perm(3)[:2]], m(2, 4), True), {}),
    "aten.index_put.hacked_twin": lambda m: ((m(3, 4), [m.perm(3)[:2], m.index(4, 2)], m(2)), {}),
    "aten.index_add.default": lambda m: ((m(3, 4), 1, m.index(4, 5), m(3, 5)), {}),
    "aten.index_copy.default": lambda m: ((m(3, 4), 1, m.perm(4)[:2], m(3, 2)), {}),
    # searching needs sorted boundaries (eager's binary search is undefined on unsorted ones)
    "aten.searchsorted.Tensor": lambda m: ((m(3, 5).sort(-1).values, m(3, 4)), {}),
    "aten.searchsorted.Scalar": lambda m: ((m(5).sort().values, 1), {}),
    "aten.bucketize.Tensor": lambda m: ((m(3, 4), m(5).sort().values), {"right": True}),
    "aten.bucketize.Scalar": lambda m: ((1, m(5).sort().values), {"out_int32": True}),
    "aten.index_fill.int_Scalar": lambda m: ((m(3, 4), 1, m.index(4, 2), 2), {}),
    "aten.index_fill.int_Tensor": lambda m: ((m(3, 4), 1, m.index(4, 2), m()), {}),
    "aten.index_select.default": lambda m: ((m(3, 4), 1, m.index(4, 5)), {}),
    "aten.scatter.src": lambda m: ((m(3, 4), 1, m.perm(4)[:2].expand(3, 2), m(3, 2)), {}),
    "aten.scatter.value": lambda m: ((m(3, 4), 1, m.perm(4)[:2].expand(3, 2), 2), {}),
    "aten.scatter.reduce": lambda m: ((m(3, 4), 1, m.index(4, 3, 2), m(3, 2)), {"reduce": "add"}),
    "aten.scatter.value_reduce": lambda m: ((m(3, 4), 1, m.index(4, 3, 2), 2), {"reduce": "multiply"}),
    "aten.scatter_add.default": lambda m: ((m(3, 4), 1, m.index(4, 3, 5), m(3, 5)), {}),
    "aten.scatter_reduce.two": lambda m: ((m(3, 4), 1, m.index(4, 3, 5), m(3, 5), "amax"), {"include_self": False}),
    "aten.take.default": lambda m: ((m(3, 4), m.index(12, 5)), {}),
    "aten.put.default": lambda m: ((m(3, 4), m.perm(12)[:5], m(5)), {}),
    "aten.masked_scatter.default": lambda m: ((m(3, 4), m.mask(3, 4), m(12)), {}),
    "aten.masked_scatter_backward.default": lambda m: ((m(3, 4), m.mask(3, 4), [12]), {}),
    "aten.select_scatter.default": lambda m: ((m(3, 4), m(4), 0, 1), {}),
    "aten.slice_scatter.default": lambda m: ((m(3, 4), m(3, 2), 1, 1, 4, 2), {}),
    "aten.diagonal_scatter.default": lambda m: ((m(3, 4), m(3), 1), {}),
    "aten.bincount.default": lambda m: ((m.index(5, 8), None, 6), {}),
    "aten.histc.default": lambda m: ((m.f32(3, 4), 5, -1.0, 1.0), {}),
    "aten.where.self": lambda m: ((m.mask(3, 4), m(3, 4), m(3, 4)), {}),
    "aten.clamp.default": lambda m: ((m(3, 4), 2, 4), {}),
    "aten.clamp.Tensor": lambda m: ((m(3, 4), m(3, 4), m(4)), {}),
    # views and shapes
    "aten.as_strided.default": lambda m: ((m(3, 4), [2, 3], [1, 2], 1), {}),
    "aten.as_strided_copy.default": lambda m: ((m(3, 4), [2, 3], [1, 2], 1), {}),
    "aten.view.dtype": lambda m: ((m(3, 4), m.dtype), {}),
    "aten.expand.default": lambda m: ((m(3, 1), [2, 3, 4]), {}),
    "aten.expand_copy.default": lambda m: ((m(3, 1), [2, 3, 4]), {}),
    "aten.split_with_sizes.default": lambda m: ((m(3, 5), [2, 3], 1), {}),
    "aten.split_with_sizes_copy.default": lambda m: ((m(3, 5), [2, 3], 1), {}),
    "aten.squeeze.dim": lambda m: ((m(3, 1, 4), 1), {}),
    "aten.squeeze.dims": lambda m: ((m(3, 1, 4, 1), [1, 3]), {}),
    "aten.squeeze.default": lambda m: ((m(3, 1, 4), ), {}),
    "aten.squeeze_copy.dim": lambda m: ((m(3, 1, 4), 1), {}),
    "aten.squeeze_copy.dims": lambda m: ((m(3, 1, 4, 1), [1, 3]), {}),
    "aten.squeeze_copy.default": lambda m: ((m(3, 1, 4), ), {}),
    "aten.permute.default": lambda m: ((m(2, 3, 4), [2, 0, 1]), {}),
    "aten.permute_copy.default": lambda m: ((m(2, 3, 4), [2, 0, 1]), {}),
    "aten.repeat.default": lambda m: ((m(2, 3), [2, 1, 2]), {}),
    "aten.flip.default": lambda m: ((m(2, 3, 4), [0, 2]), {}),
    "aten.constant_pad_nd.default": lambda m: ((m(2, 3), [1, 2, 0, 1], 1), {}),
    "aten.empty_permuted.default": lambda m: (([2, 3, 4], [2, 0, 1]), {"dtype": m.dtype}),
    "aten.empty_strided.default": lambda m: (([2, 3], [1, 2]), {"dtype": m.dtype}),
    "aten.new_empty_strided.default": lambda m: ((m(2), [2, 3], [1, 2]), {}),
    # reductions and sorting with a k
    "aten.kthvalue.default": lambda m: ((m.perm(12).reshape(3, 4).to(m.dtype), 2, 1), {}),
    "aten.topk.default": lambda m: ((m.perm(12).reshape(3, 4).to(m.dtype), 2, 1), {}),
    # random: sizes and ranges
    "aten.randint.low": lambda m: ((-3, 7, [3, 4]), {}),
    "aten.randint.low_generator": lambda m: ((-3, 7, [3, 4]), {"generator": None}),
    "aten.randint_like.low_dtype": lambda m: ((m(3, 4), -3, 7), {}),
    "aten.randint_like.low_generator_dtype": lambda m: ((m(3, 4), -3, 7), {"generator": None}),
    "aten.multinomial.default": lambda m: ((m.pos(3, 4), 2), {}),
    "aten._standard_gamma.default": lambda m: ((m.pos(3, 4),), {}),
    "aten._sample_dirichlet.default": lambda m: ((m.pos(3, 4),), {}),
    "aten.poisson.default": lambda m: ((m.pos(3, 4) * 8,), {}),
    "aten.binomial.default": lambda m: ((torch.full((3, 4), 30.0).to(m.dtype), m.pos(3, 4) / 4), {}),
    "aten._standard_gamma_grad.default": lambda m: ((m.pos(3, 4), m.pos(3, 4)), {}),
    "aten._dirichlet_grad.default": lambda m: (lambda alpha: (
        (torch.rand(3, 4, generator=m.gen).to(m.dtype) * 0.9 + 0.05, alpha, alpha + m.pos(3, 4)), {}))(m.pos(3, 4)),
    "aten.native_dropout.default": lambda m: ((m(3, 4), 0.5, True), {}),
    "aten.native_dropout_backward.default": lambda m: ((m(3, 4), m.mask(3, 4), 2.0), {}),
    "aten.bernoulli.p": lambda m: ((m(3, 4), 0.3), {}),
    "aten.bernoulli.Tensor": lambda m: ((m(3, 4), m.pos(3, 4) / 3), {}),
    "aten.bernoulli.default": lambda m: ((m.pos(3, 4) / 3,), {}),
    "aten.normal.float_Tensor": lambda m: ((0.5, m.pos(3, 4)), {}),
    "aten.normal.Tensor_Tensor": lambda m: ((m(3, 4), m.pos(3, 4)), {}),
    # special functions and integer arguments
    "aten.polygamma.default": lambda m: ((1, m.pos(3, 4)), {}),
    "aten.round.decimals": lambda m: ((m(3, 4),), {"decimals": 2}),
    "aten.div.Scalar_mode": lambda m: ((m(3, 4), 3), {"rounding_mode": "floor"}),
    "aten.div.Tensor_mode": lambda m: ((m(3, 4), m(3, 4)), {"rounding_mode": "trunc"}),
    "aten.gelu.default": lambda m: ((m(3, 4),), {"approximate": "tanh"}),
    "aten.arange.start_step": lambda m: ((1, 10, 3), {}),
    "neuron.flash_attention.default": lambda m: ((m(1, 2, 4, 8), m(1, 2, 4, 8), m(1, 2, 4, 8), True, 0.35), {}),
    "neuron.flash_attention_backward.default": lambda m: _flash_backward(m),
    # non-core ops with a static lowering (lowering/contractions, scatters, segments, distances, grid_sample)
    "aten.addbmm.default": lambda m: ((m(3, 5), m(2, 3, 4), m(2, 4, 5)), {"beta": 2, "alpha": 3}),
    "aten._trilinear.default": lambda m: ((m(3, 4), m(2, 4, 5), m(3, 5), [1, 3], [0], [1, 2], [2, 3]), {}),  # bilinear
    "aten.as_strided_scatter.default": lambda m: ((m(3, 4), m(2, 3), [2, 3], [1, 2], 1), {}),
    "aten.index_reduce.default": lambda m: ((m(3, 4), 1, m.index(4, 5), m(3, 5), "amax"), {"include_self": False}),
    "aten.segment_reduce.default": lambda m: ((m(6, 2), "max"), {"lengths": torch.tensor([2, 0, 3, 1])}),
    "aten._segment_reduce_backward.default": lambda m: _segment_reduce_backward(m),
    "aten.histogram.bins_tensor": lambda m: ((m.f32(3, 4), m.f32(4).sort().values), {}),
    "aten._embedding_bag.default": lambda m: ((m(6, 3), m.index(6, 7), torch.tensor([0, 2, 2, 5]), False, 1), {}),
    "aten._embedding_bag_forward_only.default": lambda m: (
        (m(6, 3), m.index(6, 7), torch.tensor([0, 2, 2, 5]), False, 2), {}),
    "aten._embedding_bag_backward.default": lambda m: _embedding_bag_backward(m, dense=False),
    "aten._embedding_bag_dense_backward.default": lambda m: _embedding_bag_backward(m, dense=True),
    "aten._embedding_bag_per_sample_weights_backward.default": lambda m: (
        (m(4, 3), m(6, 3), m.index(6, 7), torch.tensor([0, 2, 2, 5]), torch.tensor([0, 0, 2, 2, 2, 3, 3]), 0), {}),
    "aten._cdist_backward.default": lambda m: _distance_backward(m, "cdist"),
    "aten._pdist_backward.default": lambda m: _distance_backward(m, "pdist"),
    "aten.grid_sampler_3d.default": lambda m: ((m(1, 2, 3, 4, 5), m.f32(1, 2, 3, 2, 3), 0, 1, False), {}),
    "aten.grid_sampler_2d_backward.default": lambda m: (
        (m(1, 2, 3, 4), m(1, 2, 5, 6), m(1, 3, 4, 2), 2, 2, False, [True, True]), {}),
    "aten.grid_sampler_3d_backward.default": lambda m: (
        (m(1, 2, 2, 3, 2), m(1, 2, 3, 4, 5), m(1, 2, 3, 2, 3), 0, 2, True, [True, True]), {}),
}  # fmt: skip


#: Eager's result for overloads that CPU eager does not implement, or gets wrong on some CPUs: what the overload
#: means, in torch.
REFERENCES: dict[str, Callable[..., Any]] = {
    # int8 x int8 -> int32, exact: eager's oneDNN kernel saturates pairs of products to int16 on CPUs without
    # AVX-512 VNNI (ONEDNN_MAX_CPU_ISA=AVX2 shows it), so eager is not the reference there (issue 52)
    "aten._int_mm.default": lambda a, b: (a.long() @ b.long()).int(),
    # out_dtype matmuls: the product of the inputs, accumulated and returned in out_dtype
    "aten.mm.dtype": lambda a, b, dt: torch.mm(a.to(dt), b.to(dt)),
    "aten.bmm.dtype": lambda a, b, dt: torch.bmm(a.to(dt), b.to(dt)),
    "aten.addmm.dtype": lambda c, a, b, dt, beta=1, alpha=1: torch.addmm(
        c.to(dt), a.to(dt), b.to(dt), beta=beta, alpha=alpha
    ),
}

#: Variants beyond float32 are tried only for ops that meet them in real graphs: gradient ops see only
#: floating gradients, and the neuron:: kernels (attention) floating activations, so their integer/bool
#: variants (which eager happens to run) are not cases.
FLOAT_ONLY_SUFFIXES = ("_backward", "_backward_data")


def _spd(m: Maker) -> torch.Tensor:
    """A batch of symmetric positive-definite 4 x 4 matrices (Cholesky's domain)."""
    x = m.f32(2, 4, 4)
    return x @ x.mT + 4 * torch.eye(4, dtype=x.dtype)


def _dominant(m: Maker) -> torch.Tensor:
    """A batch of 4 x 4 matrices with a dominant diagonal: well-conditioned, and so are their triangles."""
    return m.f32(2, 4, 4) + 8 * torch.eye(4, dtype=m.f32(1).dtype)


def _pool_backward(m: Maker, forward: OpOverload, x: torch.Tensor, *args: Any) -> Args:
    """(grad, input, the forward's other arguments, indices), from a forward run of the pooling op."""
    out, indices = forward(x, *args)
    adaptive = forward in (torch.ops.aten.adaptive_max_pool2d.default, torch.ops.aten.adaptive_max_pool3d.default)
    return (m(*out.shape), x, *([] if adaptive else args), indices), {}


def _fractional_backward(m: Maker, x: torch.Tensor, kernel: list[int], output_size: list[int]) -> Args:
    """(grad, input, kernel, output size, indices) from a forward run with samples in (0, 1)."""
    forward = torch.ops.aten.fractional_max_pool2d if x.dim() == 4 else torch.ops.aten.fractional_max_pool3d
    out, indices = forward.default(x, kernel, output_size, m(1, x.shape[1], x.dim() - 2).sigmoid())
    return (m(*out.shape), x, kernel, output_size, indices), {}


def _layer_norm_backward(m: Maker) -> Args:
    x, w, b = m(2, 3, 4), m(4), m(4)
    _, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [4], w, b, 1e-5)
    return (m(2, 3, 4), x, [4], mean, rstd, w, b, [True, True, True]), {}


def _flash_backward(m: Maker) -> Args:
    q, k, v = m(1, 2, 4, 8), m(1, 2, 4, 8), m(1, 2, 4, 8)
    o, lse = torch.ops.neuron.flash_attention.default(q, k, v, True, 0.35)
    return (q, k, v, o, m(1, 2, 4, 8), lse, True, 0.35), {}


def _segment_reduce_backward(m: Maker) -> Args:
    data, lengths = m(6, 2), torch.tensor([2, 0, 3, 1])
    output = torch.segment_reduce(data, "max", lengths=lengths)
    return (m(4, 2), output, data, "max"), {"lengths": lengths}


def _embedding_bag_backward(m: Maker, dense: bool) -> Args:
    """The backward of a mean (dense: max) bag of 7 indices into a 6-row table, from the forward's outputs."""
    weight, indices, offsets, mode = m(6, 3), m.index(6, 7), torch.tensor([0, 2, 2, 5]), 2 if dense else 1
    _, offset2bag, bag_size, max_indices = torch.ops.aten._embedding_bag.default(weight, indices, offsets, False, mode)
    if dense:
        return (m(4, 3), indices, offset2bag, bag_size, max_indices, 6, False, mode, None), {}
    return (m(4, 3), indices, offsets, offset2bag, bag_size, max_indices, 6, False, mode, False, None), {}


def _distance_backward(m: Maker, kind: str) -> Args:
    if kind == "cdist":
        x1, x2 = m(3, 4), m(5, 4)
        return (m(3, 5), x1, x2, 2.0, torch.cdist(x1, x2)), {}
    x = m(4, 3)
    return (m(6), x, 1.5, torch.nn.functional.pdist(x, 1.5)), {}


def _from_schema(op: OpOverload, m: Maker) -> Args:
    """Arguments from the schema alone: a [3, 4] tensor per tensor argument, defaults elsewhere."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for a in op._schema.arguments:
        t = str(getattr(a, "real_type", a.type))
        name = a.name
        if a.has_default_value() and t != "Tensor":
            continue  # the schema's default applies
        value: Any
        if t.startswith("Optional["):
            value = None
        elif t == "Tensor":
            value = (
                m.index(3, 3, 4)
                if name in ("index", "indices")
                else m.mask(3, 4)
                if name in ("mask", "condition")
                else m(3, 4)
            )
        elif t == "List[Tensor]":
            value = [m(3, 4), m(3, 4)]
        elif t == "number":
            value = 2
        elif t in ("int", "SymInt"):
            value = {"dim": 1, "dim0": 0, "dim1": 1, "dim2": 0, "k": 2, "n": 5, "high": 5, "end": 5}.get(name, 1)
        elif t.startswith("List[int]") or t.startswith("List[SymInt]"):
            value = [3, 4] if name in ("size", "shape", "sizes") else [1]
        elif t == "float":
            value = 0.5
        elif t == "complex":
            value = complex(0.5, 0.25)
        elif t == "bool":
            value = False
        elif t == "ScalarType":
            value = m.dtype
        elif t == "str":
            value = "none"
        else:
            raise TypeError(f"no generic value for argument {name}: {t}; add {op} to OVERRIDES")
        if a.kwarg_only:
            kwargs[name] = value
        else:
            args.append(value)
    return tuple(args), kwargs


#: The value given to each argument of a Python-number overload (in every domain: acos, atanh, log).
_SCALAR_VALUES = {"int": 2, "float": 0.75, "complex": complex(0.5, 0.25), "number": 0.75}


def _scalar_args(op: OpOverload) -> Args:
    """Python-number overloads (``aten.sin.float``): one number per argument."""
    return tuple(_SCALAR_VALUES[str(a.type)] for a in op._schema.arguments), {}


def is_scalar_overload(op: OpOverload) -> bool:
    """An overload of Python numbers only (``aten.sin.float``, ``aten.log.int_complex``)."""
    return all(str(a.type) in _SCALAR_VALUES for a in op._schema.arguments) and bool(op._schema.arguments)


def _takes_tensors(op: OpOverload) -> bool:
    return any("Tensor" in str(a.type) for a in op._schema.arguments)


def overload(name: str) -> OpOverload:
    """The OpOverload named like ``aten.add.Tensor`` (or ``neuron.flash_attention.default``)."""
    ns, packet, ov = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), packet), ov)


# ---- cases -----------------------------------------------------------------------------------------------
@dataclass
class Case:
    """One call of one overload on concrete inputs, with eager's result."""

    op: str
    variant: str
    args: tuple
    kwargs: dict
    expected: Any
    check: str  # "values" | "random" | "undefined"
    #: Filled by ``run_batch``: None if the lowered result matched eager, else what differs / why it failed.
    problem: str | None = None
    lowered: bool = False
    #: dtypes of the graph's metadata (fake tensors) per output leaf, set by ``build_graph``.
    meta_dtypes: list[Any] = field(default_factory=list)
    note: str = ""

    def describe(self) -> str:
        def show(x: Any) -> str:
            if isinstance(x, torch.Tensor):
                return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
            if isinstance(x, (list, tuple)):
                return "[" + ", ".join(show(v) for v in x) + "]"
            return repr(x)

        parts = [show(a) for a in self.args] + [f"{k}={show(v)}" for k, v in self.kwargs.items()]
        return ", ".join(parts)

    def line(self) -> str:
        return f"{self.op}({self.describe()}) [{self.variant}]"


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)


def make_cases(name: str, first_only: bool = False) -> tuple[list[Case], str]:
    """The cases of overload ``name`` (one per variant eager takes; with ``first_only``, the first of
    ``VARIANTS`` that eager and torch's meta kernel take), and a note when there are none."""
    op = overload(name)
    short = op._schema.name.split("::")[-1]
    check = (
        "random" if torch.Tag.nondeterministic_seeded in op.tags else "undefined" if short in _UNDEFINED else "values"
    )
    cases: list[Case] = []
    errors: list[str] = []
    scalar = is_scalar_overload(op)
    if scalar or not _takes_tensors(op) and name not in OVERRIDES:
        variants = ["float32"]
    elif op._schema.name.endswith(FLOAT_ONLY_SUFFIXES) or op._schema.name.startswith("neuron::"):
        variants = ["float32", "bfloat16"]
    else:
        variants = list(VARIANTS)
    for variant in variants:
        m = Maker(name, variant)
        try:
            if scalar:
                args, kwargs = _scalar_args(op)
            elif name in OVERRIDES:
                args, kwargs = OVERRIDES[name](m)
            else:
                args, kwargs = _from_schema(op, m)
            torch.manual_seed(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                expected = REFERENCES.get(name, op)(*_clone(args), **_clone(kwargs))
        except Exception as e:
            errors.append(f"{variant}: {type(e).__name__}: {_first_line(e)}")
            continue
        if variant != "float32" and not _has_dtype(args, kwargs, VARIANTS[variant]):
            continue  # the op's inputs are not of this dtype (an override with fixed dtypes): same as float32
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fakes = pytree.tree_map(lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
        try:
            fake_result(op, *fakes, mode, expected)
        except MetaRefuses as e:
            errors.append(f"{variant}: torch's meta kernel refuses it ({e})")
            continue
        cases.append(Case(name, variant, args, kwargs, expected, check))
        if first_only:
            break
    note = "" if cases else "eager or torch's meta kernel refused every generated input: " + "; ".join(errors)
    return cases, note


def _has_dtype(args: Any, kwargs: Any, dtype: torch.dtype) -> bool:
    leaves = pytree.tree_leaves((args, kwargs))
    return any(isinstance(x, torch.Tensor) and x.dtype == dtype for x in leaves) or dtype in leaves


def _clone(tree: Any) -> Any:
    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else "")[:200]


# ---- one graph of many cases --------------------------------------------------------------------------------
@dataclass
class _Built:
    gm: torch.fx.GraphModule
    inputs: list[torch.Tensor]
    outputs: list[tuple[int, Any]]  # (case number, path) per graph output; path None: the whole result


class MetaRefuses(Exception):
    """torch's meta kernel refuses inputs that eager takes: no AOTAutograd graph holds such a call."""


def fake_result(op: OpOverload, fake_args: Any, fake_kwargs: Any, mode: FakeTensorMode, expected: Any) -> Any:
    """The node's metadata: ``op`` run on fake tensors, as AOTAutograd records it. An op whose output
    shape depends on the data (bincount) gets eager's result as fake tensors, the shapes a static
    graph fixes; any other refusal of the meta kernel raises ``MetaRefuses``."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # it logs every refusal of a meta kernel as an error with a traceback
    try:
        with mode, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return op(*fake_args, **fake_kwargs)
    except (DynamicOutputShapeException, DataDependentOutputException):
        return pytree.tree_map(lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, expected)
    except Exception as e:
        raise MetaRefuses(f"{type(e).__name__}: {_first_line(e)}") from e
    finally:
        quiet.setLevel(level)


def build_graph(cases: list[Case]) -> _Built:
    """One aten graph holding a node per case; its outputs are every case's results, in order."""
    graph = torch.fx.Graph()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs: list[torch.Tensor] = []
    outputs: list[Any] = []
    out_owner: list[tuple[int, Any]] = []

    def placeholder(t: torch.Tensor) -> torch.fx.Node:
        node = graph.placeholder(f"arg{len(inputs)}")
        node.meta["val"] = mode.from_tensor(t)
        inputs.append(t)
        return node

    for k, case in enumerate(cases):
        args, kwargs = pytree.tree_map(
            lambda x: placeholder(x) if isinstance(x, torch.Tensor) else x, (case.args, case.kwargs)
        )
        fake_args, fake_kwargs = pytree.tree_map(
            lambda x: x.meta["val"] if isinstance(x, torch.fx.Node) else x, (args, kwargs)
        )
        node = graph.call_function(overload(case.op), args, kwargs)
        node.meta["stack_trace"] = f'  File "overload_case", line {k}'
        val = fake_result(overload(case.op), fake_args, fake_kwargs, mode, case.expected)
        node.meta["val"] = val
        case.meta_dtypes = [v.dtype if isinstance(v, torch.Tensor) else None for v in pytree.tree_leaves(val)]
        if isinstance(val, (tuple, list)):
            for i, v in enumerate(val):
                item = graph.call_function(operator.getitem, (node, i))
                item.meta["val"] = v
                outputs.append(item)
                out_owner.append((k, i))
        else:
            outputs.append(node)
            out_owner.append((k, None))
    graph.output(tuple(outputs))
    return _Built(torch.fx.GraphModule(torch.nn.Module(), graph), inputs, out_owner)


@dataclass
class BatchResult:
    #: aten op -> generation -> OpVerdict (legality pass), over the cases that lowered.
    verdicts: dict[str, dict[str, Any]] = field(default_factory=dict)


def run_batch(cases: list[Case], name: str = "overloads") -> BatchResult:
    """Lower, judge and run ``cases`` as one graph; set each case's ``problem`` and ``lowered``.

    Cases whose node the lowering refuses are dropped and the rest lowered again; if compiling or
    running the graph fails, every case is run alone so each gets its own outcome.
    """
    from neuron_compile import legality
    from neuron_compile.errors import NeuronUnsupportedOpError
    from neuron_compile.lowering import lower_graph

    result = BatchResult()
    live = list(cases)
    while live:
        built = build_graph(live)
        try:
            lowered = lower_graph(built.gm, built.inputs, name)
        except NeuronUnsupportedOpError as e:
            refused = {}
            for n in e.nodes:
                k = int(n.source.rsplit(":", 1)[1]) if n.source.startswith("overload_case:") else None
                if k is None:  # not attributable to one case: run each alone
                    refused = None
                    break
                refused[k] = f"lowering refused: {n.reason}"
            if refused is None:
                return _one_left_or_each_alone(result, live, name, f"lowering failed: {_first_line(e)}")
            for k, why in refused.items():
                live[k].problem = why
            live = [c for k, c in enumerate(live) if k not in refused]
            continue
        except Exception as e:
            return _one_left_or_each_alone(
                result, live, name, f"lowering crashed: {type(e).__name__}: {_first_line(e)}"
            )
        break
    if not live:
        return result
    per_op = legality.verdicts_by_op(lowered)
    try:
        actual = _execute(lowered, built.inputs)
    except Exception as e:
        return _one_left_or_each_alone(
            result, live, name, f"compile/run failed: {type(e).__name__}: {_first_line(e)}", per_op=per_op
        )
    _merge_verdicts(result, per_op)
    by_case: dict[int, list[tuple[Any, Any]]] = {}
    for (k, path), value in zip(built.outputs, actual):
        by_case.setdefault(k, []).append((path, value))
    for k, case in enumerate(live):
        case.lowered = True
        got = [v for _, v in by_case.get(k, [])]
        if by_case.get(k) and by_case[k][0][0] is None:
            got = got[0]
        case.problem = compare(case, got)
    return result


def _one_left_or_each_alone(
    result: BatchResult,
    live: list[Case],
    name: str,
    problem: str,
    per_op: dict[str, dict[str, Any]] | None = None,
) -> BatchResult:
    """The batch ``live`` failed as one graph: one case left gets ``problem`` (and, where the graph lowered,
    ``per_op``'s verdicts and ``lowered``); several are each run alone so each gets its own outcome."""
    if len(live) == 1:
        if per_op is not None:
            _merge_verdicts(result, per_op)
            live[0].lowered = True
        live[0].problem = problem
        return result
    for c in live:
        _merge(result, run_batch([c], name))
    return result


def _merge_verdicts(result: BatchResult, per_op: dict[str, dict[str, Any]]) -> None:
    from neuron_compile.legality import merge_verdicts

    for op, by_gen in per_op.items():
        mine = result.verdicts.setdefault(op, {})
        for gen, v in by_gen.items():
            mine[gen] = merge_verdicts(mine.get(gen), v)


def _merge(result: BatchResult, other: BatchResult) -> None:
    _merge_verdicts(result, other.verdicts)


def _execute(lowered: Any, inputs: list[torch.Tensor]) -> list[Any]:
    """Compile the lowered graph for the CPU target and run it as the backend does."""
    from neuron_compile.runtime.cpu import CpuTarget
    from neuron_compile.runtime.executor import CompiledGraph
    from neuron_compile.runtime.jax_adapter import host_callbacks_of

    target = CpuTarget()
    executable = target.compile(lowered.stablehlo(), host_callbacks_of(lowered.lowered))
    graph = CompiledGraph(lowered.name, target, executable, lowered.inputs, lowered.outputs, lowered.needs_rng_seed)
    return graph([t.clone() for t in inputs])


def _as_eager_type(actual: Any, expected: Any) -> Any:
    """A Python-number result comes back from the executable as a 0-d tensor: compare it as a number."""
    if isinstance(expected, (bool, int, float, complex)) and isinstance(actual, torch.Tensor):
        return type(expected)(actual.item())
    return actual


def compare(case: Case, actual: Any) -> str | None:
    """None if the lowered result stands for eager's, else what differs (the OpInfo harness's rule)."""
    from tests.support import opinfo_harness as H

    expected = _as_meta_dtypes(case)
    if isinstance(expected, (tuple, list)):
        actual = type(expected)(_as_eager_type(a, e) for a, e in zip(actual, expected))
    else:
        actual = _as_eager_type(actual, expected)
    if isinstance(expected, complex) or isinstance(actual, complex):
        ok = isinstance(actual, complex) and cmath_close(actual, expected)
        return None if ok else f"output: {actual!r}, eager {expected!r}"
    if case.check == "random":
        return H.random_check(actual, expected)
    if case.check == "undefined":
        return H.compare(actual, expected, "output", values=False)
    vectors = SIGN_FREE_VECTORS.get(case.op)
    if vectors:  # unique up to sign: shapes as they are, values as magnitudes
        bad = H.compare(actual, expected, "output", values=False)
        sign_free = lambda out: [t.abs() if i in vectors else t for i, t in enumerate(out)]  # noqa: E731
        return bad or H.compare(sign_free(actual), sign_free(expected), "output (|vectors|)",
                                 reference=lambda: sign_free(_float64_reference(case)))  # fmt: skip
    return H.compare(actual, expected, "output", reference=lambda: _float64_reference(case))


def _as_meta_dtypes(case: Case) -> Any:
    """Eager's result in the dtypes of the graph's metadata. Where torch's meta kernel disagrees with its
    CPU kernel (batch norm's bf16 running stats are float32 in meta, bf16 in eager), the backend must
    produce what the graph says; AOTAutograd's own copy back into the user's buffer casts."""
    leaves, spec = pytree.tree_flatten(case.expected)
    if len(case.meta_dtypes) != len(leaves):
        return case.expected
    fixed = []
    for e, dt in zip(leaves, case.meta_dtypes):
        if isinstance(e, torch.Tensor) and dt is not None and e.dtype != dt:
            case.note = f"eager returns {e.dtype}, torch's meta kernel {dt}: compared in {dt}"
            e = e.to(dt)
        fixed.append(e)
    return pytree.tree_unflatten(fixed, spec)


def cmath_close(a: complex, b: complex) -> bool:
    return all(
        x == y or (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=1.3e-6, abs_tol=1e-5)
        for x, y in ((a.real, b.real), (a.imag, b.imag))
    )


def _float64_reference(case: Case) -> Any:
    """Eager on float64 copies of the floating inputs, cast back to eager's dtypes (None if no kernel)."""
    try:
        out = overload(case.op)(
            *_cast_floats(_clone(case.args), torch.float64), **_cast_floats(case.kwargs, torch.float64)
        )
    except Exception:
        return None
    return out


# ---- the whole registry ------------------------------------------------------------------------------------
def exercise(names: list[str] | None = None, batch_size: int = BATCH_SIZE) -> dict[str, Any]:
    """op -> record, for every lowered overload (or ``names``). See ``document`` for the record."""
    from neuron_compile.lowering import supported_ops

    names = sorted(names if names is not None else supported_ops())
    records: dict[str, dict[str, Any]] = {}
    cases: list[Case] = []
    for name in names:
        why = not_isolated(name)
        if why:
            records[name] = {"exercised": False, "reason": why}
            continue
        made, note = make_cases(name)
        if not made:
            records[name] = {"exercised": False, "reason": note}
        cases.extend(made)
    verdicts: dict[str, dict[str, Any]] = {}
    for start in range(0, len(cases), batch_size):
        batch = run_batch(cases[start : start + batch_size], f"overloads_{start // batch_size}")
        _merge_into(verdicts, batch.verdicts)
    for case in cases:
        rec = records.setdefault(case.op, {"exercised": True, "cases": []})
        rec["cases"].append(
            {"dtype": case.variant, "inputs": case.describe(), "check": case.check, "lowered": case.lowered,
             "matched": case.problem is None, **({"problem": case.problem[:400]} if case.problem else {}),
             **({"note": case.note} if case.note else {})}
        )  # fmt: skip
    from tests.support.opinfo_harness import verdict_record

    for name, rec in records.items():
        if name in verdicts:
            rec.update({gen: verdict_record(v) for gen, v in sorted(verdicts[name].items())})
        elif rec.get("exercised"):
            rec["exercised"] = False
            rec["reason"] = (
                "no case lowered: " + "; ".join(sorted({c["problem"] for c in rec["cases"] if c.get("problem")}))[:400]
            )
    return dict(sorted(records.items()))


def _merge_into(verdicts: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]]) -> None:
    from neuron_compile.legality import merge_verdicts

    for op, by_gen in new.items():
        mine = verdicts.setdefault(op, {})
        for gen, v in by_gen.items():
            mine[gen] = merge_verdicts(mine.get(gen), v)


def document(records: dict[str, Any]) -> dict[str, Any]:
    """The JSON file: per overload {"exercised", trn2/trn3 verdict records, "cases": [{dtype, inputs,
    check, lowered, matched, problem?}]} or {"exercised": false, "reason"}, and a summary."""
    cases = [c for r in records.values() for c in r.get("cases", [])]
    return {
        "torch": torch.__version__,
        "summary": {
            "overloads": len(records),
            "with_verdict": sum(1 for r in records.values() if "trn2" in r),
            "not_exercised": sorted(n for n, r in records.items() if "trn2" not in r),
            "cases": len(cases),
            "cases_mismatched": sum(1 for c in cases if c["lowered"] and not c["matched"]),
        },
        "overloads": records,
    }


def dumps(doc: dict[str, Any]) -> str:
    """The file's text: one line per overload, so a regenerated file diffs by overload."""
    rows = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in doc["overloads"].items())
    head = {k: v for k, v in doc.items() if k != "overloads"}
    return json.dumps(head, indent=1, sort_keys=True)[:-2] + ',\n "overloads": {\n' + rows + "\n }\n}\n"


def load(path: Path = RESULTS) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}
