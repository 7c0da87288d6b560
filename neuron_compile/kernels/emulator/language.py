"""``nki.language`` of the emulator: buffers, dtypes, tensor creation, loops, tile sizes and the math ops.

The math ops (``nl.exp``, ``nl.add``, ...) are both operator identifiers passed to ISA instructions and the
experimental ``nl.*`` wrappers that return a new SBUF tile (wrappers allow NumPy broadcasting; the engine
each one is counted on is the documented one or, where undocumented, Scalar for transcendentals and
Vector for the rest).
"""

from __future__ import annotations

import builtins
import functools
import math
from typing import Any

import numpy as np

from . import grids as _grids
from . import isa as _isa
from . import ops as _ops
from . import versions as _versions
from .dtypes import cast, dtype_name, is_float, itemsize
from .errors import NkiError, NkiUnsupportedError, NkiValidationError, unsupported
from .memory import PMAX, hbm, private_hbm, psum, sbuf, shared_hbm
from .run import current_run, run_rng
from .scalars import NkiScalar
from .tensors import NkiTensor, ds, fmt_shape, new_tensor, runtime_int

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
float8_e4m3, float8_e5m2, float8_e4m3fn, float8_e8m0fnu = (
    "float8_e4m3",
    "float8_e5m2",
    "float8_e4m3fn",
    "float8_e8m0fnu",
)
int8, int16, int32, uint8, uint16, uint32, bool_ = "int8", "int16", "int32", "uint8", "uint16", "uint32", "bool_"
int64 = "int64"  # only as an NkiScalar dtype (0.7); tensors of it are refused
# MX packed types of nc_matmul_mx (NC-v4): named so kernels import, refused when a tensor is made of them
float8_e5m2_x4, float8_e4m3fn_x4, float4_e2m1fn_x4 = "float8_e5m2_x4", "float8_e4m3fn_x4", "float4_e2m1fn_x4"


class _TileSize:
    """Hardware tile limits (``nl.tile_size``); SBUF figures follow the run's generation."""

    pmax = PMAX
    psum_fmax = 512  # deprecated alias of psum_bank_fmax
    psum_bank_fmax = 512
    psum_bank_fmax_bytes = 2048
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512
    bn_stats_fmax = 512

    @property
    def psum_num_banks(self) -> int:
        import os

        return 7 if os.environ.get("NKI_DMA_TRANSPOSE_AS_PE_TRANSPOSE", "").lower() == "true" else 8

    @property
    def sbuf_size_bytes(self) -> int:
        """Total SBUF bytes of one NeuronCore (128 partitions)."""
        return PMAX * current_run().gen.sbuf_bytes_per_partition

    @property
    def sbuf_fmax_bytes(self) -> int:
        """Bytes per partition a kernel may allocate (the compiler's reservation taken off)."""
        return current_run().gen.sbuf_usable_bytes_per_partition

    @property
    def sbuf_fmax(self) -> int:
        """fp32 elements per partition a kernel may allocate."""
        return self.sbuf_fmax_bytes // 4

    total_available_sbuf_size = sbuf_fmax_bytes  # deprecated since 0.4

    @property
    def psum_min_align(self) -> int:
        raise NkiUnsupportedError("nl.tile_size.psum_min_align: the NKI docs give no value, so the emulator has none")

    @property
    def sbuf_min_align(self) -> int:
        raise NkiUnsupportedError("nl.tile_size.sbuf_min_align: the NKI docs give no value, so the emulator has none")


tile_size = _TileSize()


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


def zeros_like(x: NkiTensor, dtype: Any = None, buffer: Any = None, name: str = "") -> NkiTensor:
    return zeros(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def ones_like(x: NkiTensor, dtype: Any = None, buffer: Any = None, name: str = "") -> NkiTensor:
    return ones(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def empty_like(x: NkiTensor, dtype: Any = None, buffer: Any = None, name: str = "") -> NkiTensor:
    return ndarray(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def shared_constant(constant: Any, dtype: Any = None) -> NkiTensor:
    """A constant HBM tensor made from a NumPy array at trace time."""
    arr = np.asarray(constant)
    t = new_tensor(arr.shape, dtype or dtype_name(arr.dtype), shared_hbm, "constant")
    if not current_run().shape_only:
        t._arr[...] = cast(arr.astype(np.float32), t.dtype)
    return t


def shared_identity_matrix(n: int, dtype: Any = "uint8", dst: NkiTensor | None = None) -> NkiTensor:
    """An n x n identity in HBM; with ``dst`` (an on-chip tensor) it is also DMA'd there and ``dst`` returned."""
    ident = shared_constant(np.eye(n, dtype=np.float32), dtype)
    if dst is None:
        return ident
    _isa.dma_copy(dst, ident)
    return dst


# ---------------------------------------------------------------------------------------------- loops
class _LoopRange:
    """An ``nl`` loop: a Python ``range`` whose every iteration is a step of the run's budget, so a kernel
    looping (nearly) forever over one raises :class:`NkiBudgetError` instead of hanging."""

    __slots__ = ("_range",)

    def __init__(self, r: builtins.range):
        self._range = r

    def __iter__(self) -> Any:
        run = current_run()
        for i in self._range:
            run.step(loop=True)
            yield i

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, key: Any) -> Any:
        return self._range[key]

    def __repr__(self) -> str:
        return f"nl.{self._range!r}"


def range(*args: int) -> Any:
    """Fully unrolled loop in program order (``affine_range``/``sequential_range``/``static_range`` alias it)."""
    return _LoopRange(builtins.range(*args))


def affine_range(start: int, stop: int | None = None, step: int = 1) -> Any:
    """Deprecated alias of Python ``range`` (fully unrolled, program order), as in NKI 0.7."""
    return _LoopRange(builtins.range(start, stop, step) if stop is not None else builtins.range(start))


sequential_range = static_range = affine_range


def dynamic_range(start: Any, stop: Any = None, step: int = 1) -> Any:
    """NKI 0.6's run-time loop (``for i in nl.dynamic_range(reg):``, ``i`` an NkiScalar): deprecated in 0.6,
    removed in 0.7 (use ``nl.fori_loop``)."""
    _versions.removed("nki.language.dynamic_range", "0.7", "nl.fori_loop(lower, upper, body_fun)")
    _versions.deprecated("nki.language.dynamic_range", "nl.fori_loop", since="0.6")
    lo, hi = (0, start) if stop is None else (start, stop)
    r = builtins.range(runtime_int(lo, "nl.dynamic_range"), runtime_int(hi, "nl.dynamic_range"), int(step))
    return (NkiScalar(i) for i in _LoopRange(r))


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
            raise NkiValidationError(f"nl.matmul: x {fmt_shape(x)} exceeds 128x128")
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
        import inspect

        self.nki_name = self.__name__ = name
        self.kind = kind
        self.engine = engine
        P = inspect.Parameter
        names = {"unary": ("x",), "binary": ("x", "y"), "reduce": ("x", "axis")}[kind]
        params = [P(n, P.POSITIONAL_OR_KEYWORD) for n in names] + [P("dtype", P.POSITIONAL_OR_KEYWORD, default=None)]
        if kind == "reduce":
            params.append(P("keepdims", P.POSITIONAL_OR_KEYWORD, default=False))
        self.__signature__ = inspect.Signature(params)

    def __repr__(self) -> str:
        return f"nl.{self.nki_name}"

    def __call__(self, *args: Any, dtype: Any = None, **kw: Any) -> NkiTensor:
        for key in ("x", "y"):  # the documented keyword names
            if key in kw:
                args = (*args, kw.pop(key))
        if self.kind == "reduce":
            return _reduce_wrapper(self, *args, dtype=dtype, **kw)
        tensors = [a for a in args if isinstance(a, NkiTensor)]
        if not tensors:
            raise NkiError(f"nl.{self.nki_name}: needs at least one tile argument")
        for t in tensors:
            if not t.buffer.on_chip:
                raise NkiValidationError(f"nl.{self.nki_name}: {fmt_shape(t)} is in {t.buffer}; nl.load it first")
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
        run.count(
            self.engine,
            "tensor_tensor" if len(tensors) > 1 else self.nki_name,
            out.partitions,
            out.free_size,
            out.itemsize,
            reads=tuple(tensors),
            writes=(out,),
        )
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


def _reduced_shape(x: NkiTensor, axis: Any, keepdims: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The axes a reduction of ``x`` over ``axis`` removes, and its result's shape (at least 2-d: a tile)."""
    axes = tuple(a % x.ndim for a in (axis if isinstance(axis, (tuple, list)) else (axis,)))
    shape = (
        tuple(1 if i in axes else s for i, s in enumerate(x.shape))
        if keepdims
        else tuple(s for i, s in enumerate(x.shape) if i not in axes)
    )
    return axes, shape + (1,) * (2 - len(shape))


def _reduce_wrapper(
    op: MathOp, x: NkiTensor, axis: Any, dtype: Any = None, keepdims: bool = False, **_: Any
) -> NkiTensor:
    axes, shape = _reduced_shape(x, axis, keepdims)
    out = new_tensor(shape, dtype or x.dtype, sbuf, op.nki_name)
    red = {"sum": "add", "max": "maximum", "min": "minimum", "prod": "multiply", "mean": "add"}[op.nki_name]
    _isa.tensor_reduce(out, red, x, axis=axes, keepdims=keepdims)
    if op.nki_name == "mean" and not current_run().shape_only:
        n = math.prod(x.shape[a] for a in axes)
        out._arr[...] = cast(np.asarray(out._arr, np.float32) / n, out.dtype)
    return out


# nl.copy is the "copy" op below: an SBUF copy made on the Vector engine (documented engine)
_UNARY_ENGINE = {
    "copy": "vector",
    "rsqrt": "gpsimd",
    "reciprocal": "vector",
    "abs": "vector",
    "negative": "vector",
    "relu": "vector",
    "sign": "vector",
    "floor": "vector",
    "ceil": "vector",
    "trunc": "vector",
    "logical_not": "vector",
}
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
        raise NkiValidationError(f"nl.softmax: only the last axis is supported, got axis {axis} of {fmt_shape(x)}")
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
    out = new_tensor(
        shape, dtype or _promote([t for t in (x, y) if isinstance(t, NkiTensor)] or [condition]), sbuf, "where"
    )
    run = current_run()
    run.count(
        "vector", "tensor_tensor", out.partitions, out.free_size, out.itemsize, reads=tuple(tensors), writes=(out,)
    )
    if not run.shape_only:
        v = [np.asarray(t._arr, np.float32) if isinstance(t, NkiTensor) else np.float32(t) for t in (condition, x, y)]
        out._arr[...] = cast(np.broadcast_to(np.where(v[0] != 0, v[1], v[2]), shape), out.dtype)
    return out


# --------------------------------------------------------------------------- 0.6/0.7 additions (issue 40)
NkiTensor = NkiTensor
NkiScalar = NkiScalar
NkiGrid, NkiTileGrid, NkiBlockGrid = _grids.NkiGrid, _grids.NkiTileGrid, _grids.NkiBlockGrid


def _since(version: str, fn: Any) -> Any:
    """``fn`` refusing to run under NKI releases older than ``version`` (same signature, for the API table)."""

    @functools.wraps(fn)
    def gated(*args: Any, **kwargs: Any) -> Any:
        _versions.require(f"nki.language.{fn.__name__}", version)
        return fn(*args, **kwargs)

    return gated


# NKI 0.7's tile/block grids
tiles, blocks = _since("0.7", _grids.tiles), _since("0.7", _grids.blocks)
alloc_tiles, alloc_blocks = _since("0.7", _grids.alloc_tiles), _since("0.7", _grids.alloc_blocks)


class NKIObject:
    """Base class of the trace-time configuration objects in AWS's NKI library (``@dataclass class
    Config(nl.NKIObject)``; not in the API reference). Those classes also declare fields as bare class
    attributes (``section_idx = None``) and construct them by keyword, so a subclass's public, non-callable
    class attributes without an annotation are annotated here, which makes ``@dataclass`` take them as fields."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        annotations = dict(cls.__dict__.get("__annotations__", {}))
        for name, value in list(cls.__dict__.items()):
            if name.startswith("_") or name in annotations or callable(value):
                continue
            if isinstance(value, (classmethod, staticmethod, property)):
                continue
            annotations[name] = Any
        cls.__annotations__ = annotations


# operator identifiers that are not functions
bypass = MathOp("bypass", "unary", "scalar")
prelu = unsupported("nki.language.prelu", "parametric ReLU (activate2's relu_param) is not emulated")
average = MathOp("mean", "reduce", "vector")


def _on_chip_src(x: Any, what: str) -> NkiTensor:
    if not isinstance(x, NkiTensor):
        raise NkiError(f"nl.{what}: expected an NKI tensor, got {type(x).__name__}")
    return x


def broadcast_to(x: NkiTensor, shape: Any, dtype: Any = None) -> NkiTensor:
    """A new SBUF tile of ``shape`` holding ``x`` broadcast by NumPy rules (same rank).

    A size-1 partition dim may be broadcast (1 -> up to 128 partitions): on chip that is a partition
    broadcast, counted on GpSimd; free-dim broadcasts are a Vector copy; an HBM source is one broadcast DMA.
    """
    x = _on_chip_src(x, "broadcast_to")
    shape = tuple(int(s) for s in shape)
    if len(shape) != x.ndim:
        raise NkiValidationError(f"nl.broadcast_to: shape {list(shape)} must have the rank of {fmt_shape(x)}")
    try:
        np.broadcast_shapes(x.shape, shape)
    except ValueError:
        raise NkiValidationError(f"nl.broadcast_to: {fmt_shape(x)} cannot broadcast to {list(shape)}") from None
    if tuple(np.broadcast_shapes(x.shape, shape)) != shape:
        raise NkiValidationError(f"nl.broadcast_to: {fmt_shape(x)} cannot broadcast to {list(shape)}")
    out = new_tensor(shape, dtype or x.dtype, sbuf, "broadcast_to")
    run = current_run()
    if x.buffer.is_hbm:
        _isa.dma_copy(out, NkiTensor(np.broadcast_to(x._arr, shape), x.dtype, x.buffer, x._alloc, x.name))
        return out
    engine = "gpsimd" if x.shape[0] != shape[0] else "vector"
    run.count(engine, "copy", out.partitions, out.free_size, out.itemsize, reads=(x,), writes=(out,))
    if not run.shape_only:
        out._arr[...] = cast(np.broadcast_to(np.asarray(x._arr, np.float32), shape), out.dtype)
    return out


def expand_dims(x: NkiTensor, axis: int) -> NkiTensor:
    """``x`` with a size-1 dim inserted at ``axis`` (a view; not before the partition dim on chip)."""
    return _on_chip_src(x, "expand_dims").expand_dim(axis)


def load_transpose2d(src: NkiTensor, dtype: Any = None) -> NkiTensor:
    """A new SBUF tile holding the 2-D HBM tensor ``src`` transposed (a DMA transpose)."""
    if src.ndim != 2:
        raise NkiValidationError(f"nl.load_transpose2d: {fmt_shape(src)} must be 2-D")
    out = new_tensor((src.shape[1], src.shape[0]), dtype or src.dtype, sbuf, "load_transpose2d")
    _isa.dma_transpose(out, src, axes=(1, 0))
    return out


def var(x: NkiTensor, axis: Any, dtype: Any = None, keepdims: bool = False) -> NkiTensor:
    """Population variance over free axes ``axis`` (bn_stats/bn_aggr on Vector)."""
    m = mean(x, axis, dtype="float32", keepdims=True)
    axes, out_shape = _reduced_shape(x, axis, keepdims)
    out = new_tensor(out_shape, dtype or x.dtype, sbuf, "var")
    run = current_run()
    run.count("vector", "tensor_tensor", x.partitions, x.free_size, x.itemsize, reads=(x, m), writes=(out,))
    if not run.shape_only:
        d = np.asarray(x._arr, np.float32) - np.asarray(m._arr, np.float32).reshape(
            tuple(1 if i in axes else s for i, s in enumerate(x.shape))
        )
        out._arr[...] = cast(np.mean(d * d, axis=axes, keepdims=keepdims).reshape(out_shape), out.dtype)
    return out


def all(x: NkiTensor, axis: Any, dtype: Any = None) -> NkiTensor:
    """1 where every element along ``axis`` is nonzero (a Vector reduction)."""
    axes = tuple(a % x.ndim for a in (axis if isinstance(axis, (tuple, list)) else (axis,)))
    shape = tuple(s for i, s in enumerate(x.shape) if i not in axes)
    shape = shape + (1,) * (2 - len(shape)) if len(shape) < 2 else shape
    out = new_tensor(shape, dtype or "uint8", sbuf, "all")
    run = current_run()
    run.count("vector", "reduce", x.partitions, x.free_size, x.itemsize, reads=(x,), writes=(out,))
    if not run.shape_only:
        out._arr[...] = cast(
            np.all(np.asarray(x._arr, np.float32) != 0, axis=axes).reshape(shape).astype(np.float32), out.dtype
        )
    return out


def _rng() -> np.random.Generator:
    return run_rng()


def random_seed(seed: Any) -> None:
    """Seed the emulator's generator for ``nl.rand``/``nl.dropout`` (the device's stream is not reproduced)."""
    current_run().rng = np.random.default_rng(runtime_int(seed, "nl.random_seed"))


def rand(shape: Any, dtype: Any = "float32", buffer: Any = sbuf, name: str = "") -> NkiTensor:
    """Uniform [0, 1) values (GpSimd); not the device's random stream."""
    out = new_tensor(shape, dtype, buffer or sbuf, name or "rand")
    run = current_run()
    run.count("gpsimd", "rng", out.partitions, out.free_size, out.itemsize, writes=(out,))
    if not run.shape_only:
        out._arr[...] = cast(_rng().random(out.shape, dtype=np.float32), out.dtype)
    return out


def dropout(x: NkiTensor, rate: float, dtype: Any = None) -> NkiTensor:
    """Zero each element with probability ``rate`` (no rescaling, as the ISA op); not the device's stream."""
    out = new_tensor(x.shape, dtype or x.dtype, sbuf, "dropout")
    run = current_run()
    run.count("gpsimd", "dropout", out.partitions, out.free_size, out.itemsize, reads=(x,), writes=(out,))
    if not run.shape_only:
        keep = _rng().random(x.shape) >= float(rate)
        out._arr[...] = cast(np.where(keep, np.asarray(x._arr, np.float32), 0.0), out.dtype)
    return out


def rms_norm(
    x: NkiTensor,
    w: NkiTensor,
    axis: int,
    n: int | None = None,
    epsilon: float = 1e-6,
    dtype: Any = None,
    compute_dtype: Any = None,
) -> NkiTensor:
    """``x * rsqrt(sum(x^2, axis) / n + epsilon) * w`` (``n`` defaults to the axis length)."""
    ax = axis % x.ndim
    if ax == 0 and x.buffer.on_chip:
        raise NkiValidationError(f"nl.rms_norm: axis 0 of on-chip {fmt_shape(x)} is the partition dim")
    out = new_tensor(x.shape, dtype or x.dtype, sbuf, "rms_norm")
    run = current_run()
    run.count("scalar", "activation", x.partitions, x.free_size, x.itemsize, reads=(x,), writes=(out,))
    run.count("vector", "tensor_tensor", x.partitions, x.free_size, x.itemsize, reads=(out, w), writes=(out,))
    if not run.shape_only:
        xv = np.asarray(x._arr, np.float32)
        cnt = x.shape[ax] if n is None else int(n)
        r = 1.0 / np.sqrt(np.sum(xv * xv, axis=ax, keepdims=True) / cnt + np.float32(epsilon))
        out._arr[...] = cast(xv * r * np.broadcast_to(np.asarray(w._arr, np.float32), x.shape), out.dtype)
    return out


def gather_flattened(data: NkiTensor, indices: NkiTensor, axis: int = 0, dtype: Any = None) -> NkiTensor:
    """Per partition, ``out[p, i...] = data[p].flatten()[indices[p, i...]]`` (GpSimd)."""
    if data.partitions != indices.partitions:
        raise NkiValidationError(
            f"nl.gather_flattened: {fmt_shape(data)} and indices {fmt_shape(indices)} must have the same partitions"
        )
    out = new_tensor(indices.shape, dtype or data.dtype, sbuf, "gather_flattened")
    run = current_run()
    run.count("gpsimd", "gather", out.partitions, out.free_size, out.itemsize, reads=(data, indices), writes=(out,))
    if not run.shape_only:
        flat = np.asarray(data._arr).reshape(data.partitions, -1)
        idx = np.asarray(indices._arr).reshape(indices.partitions, -1).astype(np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= flat.shape[1]):
            raise NkiValidationError(f"nl.gather_flattened: an index is outside [0, {flat.shape[1]})")
        out._arr[...] = cast(np.take_along_axis(flat, idx, axis=1).astype(np.float32).reshape(out.shape), out.dtype)
    return out


# ---- memory predicates
def is_psum(buffer: Any) -> bool:
    return str(buffer) == "psum"


def is_sbuf(buffer: Any) -> bool:
    return str(buffer) == "sbuf"


def is_hbm(buffer: Any) -> bool:
    return str(buffer) in ("hbm", "shared_hbm", "private_hbm")


def is_on_chip(buffer: Any) -> bool:
    return str(buffer) in ("sbuf", "psum")


# ---- run-time control flow (NKI 0.6/0.7): run here as Python loops over NkiScalar values
_MAX_WHILE = 1 << 22


def _scalar_arg(x: Any, what: str) -> int:
    return runtime_int(x, what)


def fori_loop(lower: Any, upper: Any, body_fun: Any, step: int = 1, unroll: bool = False) -> None:
    """``for i in range(lower, upper, step): body_fun(i)`` with ``i`` an :class:`NkiScalar` (bounds may be
    run-time scalars; ``step`` a positive int). Carry state through SBUF/HBM, as on the device."""
    if not isinstance(step, int) or step <= 0:
        raise NkiValidationError(f"nl.fori_loop: step must be a compile-time positive int, got {step!r}")
    for what, b in (("lower", lower), ("upper", upper)):
        if getattr(b, "dtype", None) == "int64":
            raise NkiValidationError(f"nl.fori_loop: {what} bound is an int64 scalar; loop bounds must be 32-bit")
    lo, hi = _scalar_arg(lower, "nl.fori_loop(lower)"), _scalar_arg(upper, "nl.fori_loop(upper)")
    for i in _LoopRange(builtins.range(lo, hi, step)):
        body_fun(NkiScalar(i))


def while_loop(init: Any, body_fun: Any) -> None:
    """``r = init; while r != 0: r = body_fun(r)`` with ``r`` a run-time scalar (checked before each pass)."""
    r = init
    for _ in _LoopRange(builtins.range(_MAX_WHILE)):
        if _scalar_arg(r, "nl.while_loop(condition)") == 0:
            return
        r = body_fun(r if isinstance(r, NkiScalar) else NkiScalar(_scalar_arg(r, "nl.while_loop")))
    raise NkiError(f"nl.while_loop ran {_MAX_WHILE} iterations without its condition reaching 0")


def if_else(cond: Any, then_fn: Any, else_fn: Any = None) -> None:
    """Run ``then_fn()`` if the run-time scalar ``cond`` is nonzero, else ``else_fn()`` (documented from the
    NKI 0.8 pages on)."""
    _versions.require("nki.language.if_else", "0.8")
    if _scalar_arg(cond, "nl.if_else(cond)") != 0:
        then_fn()
    elif else_fn is not None:
        else_fn()


class no_reorder:
    """``with nl.no_reorder():`` pins program order; the emulator always runs in program order."""

    def __enter__(self) -> no_reorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def device_print(print_prefix: str, tensor: Any) -> None:
    """Print ``tensor`` (the emulator prints at once; the device prints when the instruction runs)."""
    if not current_run().shape_only:
        val = tensor.numpy() if isinstance(tensor, NkiTensor) else tensor
        print(print_prefix, val)


def nc(n: int) -> int:
    """Legacy ``kernel[nl.nc(2)]``: spread an SPMD grid over ``n`` NeuronCores (= an LNC launch)."""
    return int(n)


__all__ += [
    "NKIObject",
    "NkiBlockGrid",
    "NkiGrid",
    "NkiScalar",
    "NkiTensor",
    "NkiTileGrid",
    "all",
    "alloc_blocks",
    "alloc_tiles",
    "average",
    "blocks",
    "broadcast_to",
    "bypass",
    "device_print",
    "dropout",
    "expand_dims",
    "float4_e2m1fn_x4",
    "float8_e4m3fn_x4",
    "float8_e5m2_x4",
    "float8_e8m0fnu",
    "fori_loop",
    "gather_flattened",
    "if_else",
    "int64",
    "is_hbm",
    "is_on_chip",
    "is_psum",
    "is_sbuf",
    "load_transpose2d",
    "nc",
    "no_reorder",
    "prelu",
    "rand",
    "random_seed",
    "rms_norm",
    "tiles",
    "var",
    "while_loop",
]
