"""``nki.language`` of the emulator: buffers, dtypes, tensor creation, loops, tile sizes and the math ops.

The math ops (``nl.exp``, ``nl.add``, ...) are both operator identifiers passed to ISA instructions and the
experimental ``nl.*`` wrappers that return a new SBUF tile (wrappers allow NumPy broadcasting; the engine
each one is counted on is the documented one or, where undocumented, Scalar for transcendentals and
Vector for the rest).
"""

from __future__ import annotations

import builtins
import math
from typing import Any

import numpy as np

from . import isa as _isa
from . import ops as _ops
from .core import (
    PMAX,
    NkiError,
    NkiTensor,
    NkiValidationError,
    _fmt_shape,
    cast,
    current_run,
    ds,
    dtype_name,
    hbm,
    is_float,
    itemsize,
    new_tensor,
    private_hbm,
    psum,
    sbuf,
    shared_hbm,
)

__all__ = [
    "affine_range",
    "bfloat16",
    "bool_",
    "copy",
    "ds",
    "empty_like",
    "float8_e4m3",
    "float8_e4m3fn",
    "float8_e5m2",
    "float16",
    "float32",
    "full",
    "hbm",
    "int8",
    "int16",
    "int32",
    "load",
    "matmul",
    "max",
    "mean",
    "min",
    "ndarray",
    "num_programs",
    "ones",
    "ones_like",
    "private_hbm",
    "program_id",
    "program_ndim",
    "psum",
    "range",
    "sbuf",
    "sequential_range",
    "shared_constant",
    "shared_hbm",
    "shared_identity_matrix",
    "softmax",
    "static_range",
    "store",
    "sum",
    "tfloat32",
    "tile_size",
    "transpose",
    "uint8",
    "uint16",
    "uint32",
    "where",
    "zeros",
    "zeros_like",
]

# dtypes are strings in the current API
float32, bfloat16, float16, tfloat32 = "float32", "bfloat16", "float16", "tfloat32"
float8_e4m3, float8_e5m2, float8_e4m3fn, float8_e8m0fnu = "float8_e4m3", "float8_e5m2", "float8_e4m3fn", \
    "float8_e8m0fnu"
int8, int16, int32, uint8, uint16, uint32, bool_ = "int8", "int16", "int32", "uint8", "uint16", "uint32", "bool_"


class tile_size:
    """Hardware tile limits (``nl.tile_size``)."""

    pmax = PMAX
    psum_fmax = 512
    psum_bank_fmax = 512
    psum_num_banks = 8
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512
    bn_stats_fmax = 512


# ---------------------------------------------------------------------------------------------- creation
def ndarray(shape: Any, dtype: Any, buffer: Any = sbuf, name: str = "", address: Any = None) -> NkiTensor:
    """An uninitialized tensor (new memory holds NaN for floats, 4 for ints, as in the NKI simulator)."""
    if buffer is None:
        buffer = sbuf
    if buffer == "hbm" and current_run() is not None:
        pass  # private HBM is allowed for scratch; kernel outputs must be shared_hbm (checked at return)
    return new_tensor(shape, dtype, buffer, name)


def _filled(shape: Any, dtype: Any, buffer: Any, name: str, value: float) -> NkiTensor:
    t = new_tensor(shape, dtype, buffer or sbuf, name)
    if t.buffer.on_chip:
        _isa.memset(t, value)
    elif not current_run().shape_only:
        t._arr[...] = cast(np.full(t.shape, value, np.float32), t.dtype)
    return t


def zeros(shape: Any, dtype: Any, buffer: Any = sbuf, name: str = "", **_: Any) -> NkiTensor:
    """A tensor filled with 0 (a memset on chip)."""
    return _filled(shape, dtype, buffer, name, 0.0)


def ones(shape: Any, dtype: Any, buffer: Any = sbuf, name: str = "", **_: Any) -> NkiTensor:
    return _filled(shape, dtype, buffer, name, 1.0)


def full(shape: Any, fill_value: float, dtype: Any, buffer: Any = sbuf, name: str = "", **_: Any) -> NkiTensor:
    return _filled(shape, dtype, buffer, name, fill_value)


def zeros_like(a: NkiTensor, dtype: Any = None, buffer: Any = None, name: str = "") -> NkiTensor:
    return zeros(a.shape, dtype or a.dtype, buffer or a.buffer, name)


def ones_like(a: NkiTensor, dtype: Any = None, buffer: Any = None, name: str = "") -> NkiTensor:
    return ones(a.shape, dtype or a.dtype, buffer or a.buffer, name)


def empty_like(a: NkiTensor, dtype: Any = None, buffer: Any = None, name: str = "") -> NkiTensor:
    return ndarray(a.shape, dtype or a.dtype, buffer or a.buffer, name)


def shared_constant(constant: Any, dtype: Any = None) -> NkiTensor:
    """A constant HBM tensor made from a NumPy array at trace time."""
    arr = np.asarray(constant)
    t = new_tensor(arr.shape, dtype or dtype_name(arr.dtype), shared_hbm, "constant")
    if not current_run().shape_only:
        t._arr[...] = cast(arr.astype(np.float32), t.dtype)
    return t


def shared_identity_matrix(n: int, dtype: Any = "uint8") -> NkiTensor:
    return shared_constant(np.eye(n, dtype=np.float32), dtype)


# ---------------------------------------------------------------------------------------------- loops
def range(*args: int) -> Any:
    """Fully unrolled loop in program order (``affine_range``/``sequential_range``/``static_range`` alias it)."""
    return builtins.range(*args)


affine_range = sequential_range = static_range = range


def program_id(axis: int = 0) -> int:
    run = current_run()
    return run.program_id[axis] if axis < len(run.program_id) else 0


def num_programs(axes: int = 0) -> int:
    run = current_run()
    return run.grid[axes] if axes < len(run.grid) else 1


def program_ndim() -> int:
    return len(current_run().grid)


# ---------------------------------------------------------------------------------------------- wrappers
def load(src: NkiTensor, dtype: Any = None, name: str = "") -> NkiTensor:
    """A new SBUF tile holding ``src`` (one DMA)."""
    t = new_tensor(src.shape, dtype or src.dtype, sbuf, name or "load")
    _isa.dma_copy(t, src)
    return t


def store(dst: NkiTensor, value: NkiTensor) -> None:
    """DMA ``value`` (SBUF) into ``dst`` (HBM)."""
    _isa.dma_copy(dst, value)


def matmul(x: NkiTensor, y: NkiTensor, transpose_x: bool = False) -> NkiTensor:
    """A PSUM tile holding ``x @ y`` (or ``x.T @ y`` with ``transpose_x``); x <= 128x128, y <= 128x512."""
    if not transpose_x:
        if x.shape[0] > PMAX or x.shape[1] > PMAX:
            raise NkiValidationError(f"nl.matmul: x {_fmt_shape(x)} exceeds 128x128")
        xt_ps = new_tensor((x.shape[1], x.shape[0]), x.dtype, psum, "xT")
        _isa.nc_transpose(xt_ps, x)
        xt = new_tensor(xt_ps.shape, x.dtype, sbuf, "xT")
        _isa.tensor_copy(xt, xt_ps)
        x = xt
    out = new_tensor((x.shape[1], y.shape[1]), "float32", psum, "matmul")
    _isa.nc_matmul(out, x, y)
    return out


def transpose(x: NkiTensor, dtype: Any = None) -> NkiTensor:
    """A PSUM tile holding ``x.T`` (PE transpose)."""
    out = new_tensor((x.shape[1], x.shape[0]), x.dtype, psum, "transpose")
    _isa.nc_transpose(out, x)
    return out


class MathOp:
    """An ``nl`` math op: an operator identifier for ISA calls and a tile-returning wrapper."""

    def __init__(self, name: str, kind: str, engine: str):
        self.nki_name = self.__name__ = name
        self.kind = kind
        self.engine = engine

    def __repr__(self) -> str:
        return f"nl.{self.nki_name}"

    def __call__(self, *args: Any, dtype: Any = None, **kw: Any) -> NkiTensor:
        if self.kind == "reduce":
            return _reduce_wrapper(self, *args, dtype=dtype, **kw)
        tensors = [a for a in args if isinstance(a, NkiTensor)]
        if not tensors:
            raise NkiError(f"nl.{self.nki_name}: needs at least one tile argument")
        for t in tensors:
            if not t.buffer.on_chip:
                raise NkiValidationError(f"nl.{self.nki_name}: {_fmt_shape(t)} is in {t.buffer}; nl.load it first")
        if self.kind == "unary":
            (x,) = args
            shape = x.shape
        else:
            a, b = args
            shape = np.broadcast_shapes(*(t.shape for t in tensors))
            if self.nki_name in ("logical_and", "logical_or", "logical_xor") and dtype is None:
                dtype = "uint8"
        out_dt = dtype_name(dtype) if dtype is not None else _promote(tensors)
        out = new_tensor(shape, out_dt, sbuf, self.nki_name)
        run = current_run()
        run.count(self.engine, "tensor_tensor" if len(tensors) > 1 else self.nki_name, out.partitions,
                  out.free_size, out.itemsize)
        if run.shape_only:
            return out
        with np.errstate(all="ignore"):
            if self.kind == "unary":
                res = _ops.UNARY[self.nki_name](np.asarray(x._arr, np.float32))
            else:
                av = np.asarray(a._arr, np.float32) if isinstance(a, NkiTensor) else np.float32(a)
                bv = np.asarray(b._arr, np.float32) if isinstance(b, NkiTensor) else np.float32(b)
                res = _ops.BINARY[self.nki_name](av, bv)
        out._arr[...] = cast(np.broadcast_to(res, shape), out.dtype)
        return out


def _promote(ts: list[NkiTensor]) -> str:
    """Legacy NKI promotion: float beats int, the wider float wins, fp16 with bf16 gives fp32."""
    dts = {t.dtype for t in ts}
    if len(dts) == 1:
        return dts.pop()
    floats = {d for d in dts if is_float(d)}
    if not floats:
        return "float32" if {"int32", "uint32"} <= dts else builtins.max(dts, key=itemsize)
    if {"float16", "bfloat16"} <= floats or "float32" in floats or "tfloat32" in floats:
        return "float32"
    return builtins.max(floats, key=itemsize)


def _reduce_wrapper(op: MathOp, x: NkiTensor, axis: Any, dtype: Any = None, keepdims: bool = False,
                    **_: Any) -> NkiTensor:
    axes = tuple(a % x.ndim for a in (axis if isinstance(axis, (tuple, list)) else (axis,)))
    shape = tuple(1 if i in axes else s for i, s in enumerate(x.shape)) if keepdims else \
        tuple(s for i, s in enumerate(x.shape) if i not in axes)
    if len(shape) < 2:
        shape = tuple(shape) + (1,) * (2 - len(shape))
    out = new_tensor(shape, dtype or x.dtype, sbuf, op.nki_name)
    red = {"sum": "add", "max": "maximum", "min": "minimum", "prod": "multiply", "mean": "add"}[op.nki_name]
    _isa.tensor_reduce(out, red, x, axis=axes, keepdims=keepdims)
    if op.nki_name == "mean" and not current_run().shape_only:
        n = math.prod(x.shape[a] for a in axes)
        out._arr[...] = cast(np.asarray(out._arr, np.float32) / n, out.dtype)
    return out


# nl.copy is the "copy" op below: an SBUF copy made on the Vector engine (documented engine)
_UNARY_ENGINE = {"copy": "vector", "rsqrt": "gpsimd", "reciprocal": "vector", "abs": "vector",
                 "negative": "vector", "relu": "vector", "sign": "vector", "floor": "vector", "ceil": "vector",
                 "trunc": "vector", "logical_not": "vector"}
for _n in _ops.UNARY:
    globals()[_n] = MathOp(_n, "unary", _UNARY_ENGINE.get(_n, "scalar"))
for _n in _ops.BINARY:
    globals()[_n] = MathOp(_n, "binary", "gpsimd" if _n == "power" else "vector")
copy = MathOp("copy", "unary", "vector")  # also made by the loop above; spelled out for readers and linters
sum, max, min, prod, mean = (MathOp(n, "reduce", "vector") for n in ("sum", "max", "min", "prod", "mean"))
__all__ += [n for n in list(_ops.UNARY) + list(_ops.BINARY) if n not in __all__]


def softmax(x: NkiTensor, axis: int = -1, dtype: Any = None) -> NkiTensor:
    """Softmax along the last free axis: max, exp(x - max) with a fused sum, reciprocal, scale."""
    if axis % x.ndim != x.ndim - 1:
        raise NkiValidationError(f"nl.softmax: only the last axis is supported, got axis {axis} of {_fmt_shape(x)}")
    mx = new_tensor((x.shape[0], 1), "float32", sbuf, "softmax_max")
    _isa.tensor_reduce(mx, "maximum", x, axis=tuple(range(1, x.ndim)), negate=True, keepdims=True)
    e = new_tensor(x.shape, "float32", sbuf, "softmax_exp")
    s = new_tensor((x.shape[0], 1), "float32", sbuf, "softmax_sum")
    _isa.activation(e, "exp", x, bias=mx, reduce_op="add", reduce_res=s)
    _isa.reciprocal(s, s)
    out = new_tensor(x.shape, dtype or x.dtype, sbuf, "softmax")
    _isa.tensor_scalar(out, e, "multiply", s)
    return out


def where(condition: NkiTensor, x: Any, y: Any, dtype: Any = None) -> NkiTensor:
    """Elementwise ``x if condition else y`` (tiles or scalars, broadcast) on Vector."""
    tensors = [t for t in (condition, x, y) if isinstance(t, NkiTensor)]
    shape = np.broadcast_shapes(*(t.shape for t in tensors))
    out = new_tensor(shape, dtype or _promote([t for t in (x, y) if isinstance(t, NkiTensor)] or [condition]),
                     sbuf, "where")
    run = current_run()
    run.count("vector", "tensor_tensor", out.partitions, out.free_size, out.itemsize)
    if not run.shape_only:
        v = [np.asarray(t._arr, np.float32) if isinstance(t, NkiTensor) else np.float32(t) for t in (condition, x, y)]
        out._arr[...] = cast(np.broadcast_to(np.where(v[0] != 0, v[1], v[2]), shape), out.dtype)
    return out
