"""``nki.isa`` of the emulator: one NumPy-vectorized function per instruction, ``dst`` first.

Each instruction checks the hardware rules of ``shared/NKI_FACTS.md`` sections 3, 5 and 7 (operand
buffers, partition counts, free-size limits, dtypes), computes in fp32, rounds to ``dst.dtype`` on the
write, and counts itself on its engine. In shape-only mode the checks and counts run, the math does not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import lnc as _lnc
from . import ops as _ops
from . import versions as _versions
from .dtypes import cast, is_float
from .errors import NkiError, NkiUnsupportedError, NkiValidationError, unsupported
from .memory import PMAX
from .run import current_run, run_rng
from .scalars import NkiScalar
from .tensors import NkiTensor, fmt_shape, runtime_int

__all__ = [
    "NkiError",
    "NkiValidationError",
    "activation",
    "activation_reduce",
    "affine_select",
    "bn_aggr",
    "bn_stats",
    "dge_mode",
    "dma_copy",
    "gpsimd_engine",
    "iota",
    "memset",
    "nc_matmul",
    "nc_transpose",
    "oob_mode",
    "reciprocal",
    "reduce_cmd",
    "scalar_engine",
    "scalar_tensor_tensor",
    "tensor_copy",
    "tensor_engine",
    "tensor_partition_reduce",
    "tensor_reduce",
    "tensor_scalar",
    "tensor_tensor",
    "unknown_engine",
    "vector_engine",
]


class engine:
    """``nisa.engine``: which engine runs an instruction (``unknown`` lets the instruction pick its default)."""

    unknown = None
    tensor = "tensor"
    scalar = "scalar"
    gpsimd = "gpsimd"
    dma = "dma"
    vector = "vector"
    sync = "sync"


# deprecated aliases of the engine enum (still in the 0.6 reference)
tensor_engine, vector_engine, scalar_engine, gpsimd_engine = engine.tensor, engine.vector, engine.scalar, engine.gpsimd
unknown_engine = engine.unknown


class reduce_cmd:
    idle = "idle"
    reset = "reset"
    reduce = "reduce"
    reset_reduce = "reset_reduce"
    load_reduce = "load_reduce"


class matmul_perf_mode:
    none = None
    double_row = "double_row"


class dma_engine:
    dma = "dma"
    gpsimd_dma = "gpsimd_dma"


class nc_version:
    gen2 = "gen2"
    gen3 = "gen3"
    gen4 = "gen4"


def get_nc_version() -> str:
    """The NeuronCore version of the run's generation: gen2 (trn1), gen3 (trn2), gen4 (trn3)."""
    return {"trn1": nc_version.gen2, "trn2": nc_version.gen3, "trn3": nc_version.gen4}[current_run().gen.name]


def _need_gen(op: str, minimum: str, what: str = "") -> None:
    order = ("trn1", "trn2", "trn3")
    gen = current_run().gen.name
    if order.index(gen) < order.index(minimum):
        raise NkiValidationError(
            f"nisa.{op}{(' ' + what) if what else ''} needs {minimum} or later "
            f"(NeuronCore-v{order.index(minimum) + 2}); this run targets {gen}"
        )


class dge_mode:
    unknown = "unknown"
    none = "none"
    swdge = "swdge"
    hwdge = "hwdge"


class oob_mode:
    error = "error"
    skip = "skip"


_VEC_FREE_MAX = {"sbuf": 64 * 1024, "psum": 4 * 1024}


# -------------------------------------------------------------------------------------------- helpers
def _t(x: Any, op: str, role: str) -> NkiTensor:
    if not isinstance(x, NkiTensor):
        raise NkiError(f"nisa.{op}: {role} must be an NKI tensor, got {type(x).__name__}")
    return x


def _buf(t: NkiTensor, allowed: Sequence[str], op: str, role: str) -> None:
    if t.buffer not in allowed and not (t.buffer == "shared_hbm" and "hbm" in allowed):
        raise NkiValidationError(
            f"nisa.{op}: {role} {fmt_shape(t)} is in {t.buffer}, but {op} takes its {role} from "
            f"{' or '.join(allowed)} (unsupported memory)"
        )


def _same_partitions(op: str, *ts: NkiTensor) -> None:
    ps = {t.partitions for t in ts}
    if len(ps) > 1:
        raise NkiValidationError(
            f"nisa.{op}: partition counts differ: {', '.join(fmt_shape(t) for t in ts)} (num partition mismatch)"
        )


def _same_free(op: str, dst: NkiTensor, *srcs: NkiTensor) -> None:
    for s in srcs:
        if s.free_size != dst.free_size:
            raise NkiValidationError(
                f"nisa.{op}: {fmt_shape(s)} has {s.free_size} elements per partition but dst "
                f"{fmt_shape(dst)} has {dst.free_size}"
            )


def _free_limit(op: str, *ts: NkiTensor) -> None:
    for t in ts:
        lim = _VEC_FREE_MAX.get(t.buffer)
        if lim is not None and t.free_size > lim:
            raise NkiValidationError(
                f"nisa.{op}: {fmt_shape(t)} has {t.free_size} elements per partition, above the "
                f"{lim} limit for {t.buffer} operands of Vector/Scalar/GpSimd instructions"
            )


def _partition_start(op: str, t: NkiTensor) -> None:
    """Compute engines access contiguous partitions starting at an aligned quadrant (A2 guide)."""
    n = t.partitions
    if t.pstep != 1 and n > 1:
        raise NkiValidationError(
            f"nisa.{op}: {fmt_shape(t)} takes every {t.pstep}th partition; compute "
            "engines access contiguous partitions only"
        )
    allowed = (0,) if n > 64 else (0, 64) if n > 32 else (0, 32, 64, 96)
    if t.p0 not in allowed:
        raise NkiValidationError(
            f"nisa.{op}: {fmt_shape(t)} starts at partition {t.p0}; an access of {n} partitions must start "
            f"at partition {' or '.join(map(str, allowed))}"
        )


def _on_chip(op: str, *ts: NkiTensor) -> None:
    for t in ts:
        if t.buffer.on_chip:
            _partition_start(op, t)
        if not t.buffer.on_chip:
            raise NkiValidationError(
                f"nisa.{op}: {fmt_shape(t)} is in {t.buffer}; compute engines read and write SBUF/PSUM "
                "only — move it with nisa.dma_copy first"
            )
        if t.partitions > PMAX:
            raise NkiValidationError(f"nisa.{op}: Size of partition dimension {t.partitions} exceeds maximum {PMAX}")


def _f32(t: NkiTensor) -> np.ndarray:
    return np.asarray(t._arr, dtype=np.float32).reshape(t.partitions, t.free_size)


def _write(dst: NkiTensor, values: np.ndarray, op: str) -> None:
    if not dst._arr.flags.writeable:
        raise NkiError(f"nisa.{op}: dst {fmt_shape(dst)} is a broadcast view and cannot be written")
    current_run().note_write(dst)  # compute engines write on chip only; kept for any HBM dst
    dst._arr[...] = cast(np.asarray(values).reshape(dst.shape), dst.dtype)
    if dst._written is not None:
        dst._written[...] = True


_ENGINES = {"tensor", "vector", "scalar", "gpsimd"}
#: bit-vector operators: integer bit patterns, Vector engine only
BITVEC_OPS = frozenset({"bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift", "invert"})


def _engine(engine: Any, default: str, op: str, *ts: NkiTensor, allowed: tuple[str, ...] | None = None) -> str:
    eng = engine or default
    if eng not in _ENGINES:
        raise NkiValidationError(
            f"nisa.{op}: engine {engine!r} is not a compute engine; use nisa.engine.vector, .scalar, .gpsimd or .tensor"
        )
    if allowed is not None and eng not in allowed:
        raise NkiValidationError(f"nisa.{op} runs on {' or '.join(allowed)}, not on the {eng} engine")
    if eng == "gpsimd" and any(t.buffer == "psum" for t in ts):
        raise NkiValidationError(f"nisa.{op}: the GpSimd engine cannot access PSUM ({', '.join(map(fmt_shape, ts))})")
    return eng


def _tensors(*xs: Any) -> tuple[NkiTensor, ...]:
    return tuple(x for x in xs if isinstance(x, NkiTensor))


def _count(
    engine: str, kind: str, dst: NkiTensor, *srcs: NkiTensor, also_reads: tuple = (), also_writes: tuple = ()
) -> None:
    small = min([t.itemsize for t in (dst, *srcs)])
    big = max([t.itemsize for t in (dst, *srcs)])
    current_run().count(
        engine,
        kind,
        dst.partitions,
        max([dst.free_size, *(s.free_size for s in srcs)]),
        small if big <= 2 else 4,
        reads=srcs + also_reads,
        writes=(dst, *also_writes),
    )


def _operand(x: Any, dst: NkiTensor, op: str, role: str) -> np.ndarray | float:
    """A scalar, or a (P,1) per-partition vector broadcast along the free dims."""
    if isinstance(x, NkiTensor):
        _on_chip(op, x)
        if x.partitions != dst.partitions or x.free_size != 1:
            raise NkiValidationError(
                f"nisa.{op}: {role} {fmt_shape(x)} must be a scalar or a ({dst.partitions}, 1) vector "
                f"to go with dst {fmt_shape(dst)}"
            )
        return None if current_run().shape_only else _f32(x)
    if isinstance(x, (int, float, np.number, bool)):
        return np.float32(x)
    raise NkiError(f"nisa.{op}: {role} must be a Python number or a (P,1) tensor, got {type(x).__name__}")


def _shape_only() -> bool:
    return current_run().shape_only


# ----------------------------------------------------------------------------------------- data motion
def dma_copy(
    dst: NkiTensor,
    src: NkiTensor,
    priority: Any = None,
    oob_mode: Any = None,
    dge_mode: Any = None,
    engine: Any = None,
    name: str = "",
) -> None:
    """Copy ``src`` to ``dst`` (HBM<->SBUF any direction; never from PSUM); dtypes cast through fp32."""
    dst, src = _t(dst, "dma_copy", "dst"), _t(src, "dma_copy", "src")
    if src.buffer == "psum":
        raise NkiValidationError(
            f"nisa.dma_copy: src {fmt_shape(src)} is in PSUM; DMA cannot read PSUM — copy it to SBUF "
            "with nisa.tensor_copy first"
        )
    if dst.buffer == "psum":
        raise NkiValidationError(f"nisa.dma_copy: dst {fmt_shape(dst)} is in PSUM; DMA writes HBM or SBUF")
    if src.size != dst.size:
        raise NkiValidationError(
            f"nisa.dma_copy: element counts differ: dst {fmt_shape(dst)} has {dst.size}, src "
            f"{fmt_shape(src)} has {src.size}"
        )
    if dge_mode == "hwdge" and src.dtype != dst.dtype:
        raise NkiValidationError(f"nisa.dma_copy: hwdge needs equal dtypes, got {src.dtype} -> {dst.dtype}")
    run = current_run()
    run.step()
    run.note_write(dst)
    st = run.stats
    st.dma_transfers += 1
    e = st.engines["dma"]
    e.instructions += 1
    e.elements += src.size
    if src.buffer.is_hbm and dst.buffer == "sbuf":
        nbytes = src.size * src.itemsize
        st.dma_bytes_hbm_to_sbuf += nbytes
    elif src.buffer == "sbuf" and dst.buffer.is_hbm:
        nbytes = dst.size * dst.itemsize
        st.dma_bytes_sbuf_to_hbm += nbytes
    else:
        nbytes = src.size * max(src.itemsize, dst.itemsize)
        st.dma_bytes_other += nbytes
    run.count_dma(src, dst, nbytes)
    if run.shape_only:
        return
    if src.dtype == dst.dtype:
        vals = np.asarray(src._arr).reshape(dst.shape)
        if not dst._arr.flags.writeable:
            raise NkiError(f"nisa.dma_copy: dst {fmt_shape(dst)} is a broadcast view and cannot be written")
        dst._arr[...] = vals
    else:
        _write(dst, np.asarray(src._arr, np.float32).reshape(dst.shape), "dma_copy")


def tensor_copy(dst: NkiTensor, src: NkiTensor, engine: Any = None, name: str = "") -> None:
    """Copy on a compute engine (SBUF/PSUM -> SBUF/PSUM), casting to ``dst.dtype``."""
    dst, src = _t(dst, "tensor_copy", "dst"), _t(src, "tensor_copy", "src")
    _on_chip("tensor_copy", dst, src)
    _same_partitions("tensor_copy", dst, src)
    _same_free("tensor_copy", dst, src)
    _free_limit("tensor_copy", dst, src)
    eng = _engine(engine, "vector", "tensor_copy", dst, src)
    if eng == "scalar" and current_run().gen.name == "trn1":
        raise NkiValidationError(
            "nisa.tensor_copy on the Scalar engine needs trn2 or later (NeuronCore-v2 has no "
            "Scalar-engine copy); use engine=nisa.engine.vector or gpsimd on trn1"
        )
    _count(eng, "copy", dst, src)
    if not _shape_only():
        _write(dst, _f32(src) if src.dtype != dst.dtype else np.asarray(src._arr).reshape(dst.shape), "tensor_copy")


# ---------------------------------------------------------------------------------------------- tensor
_MATMUL_IN = {"float8_e4m3", "float8_e5m2", "float8_e4m3fn", "bfloat16", "float16", "tfloat32", "float32"}


def nc_matmul(
    dst: NkiTensor,
    stationary: NkiTensor,
    moving: NkiTensor,
    is_stationary_onezero: bool = False,
    is_moving_onezero: bool = False,
    is_transpose: bool = False,
    accumulate: bool | None = None,
    tile_position: Any = (),
    tile_size: Any = (),
    perf_mode: Any = None,
    name: str = "",
) -> None:
    """``dst[M,N] (+)= stationary[K,M].T @ moving[K,N]`` on TensorE: SBUF operands, PSUM dst, fp32 accumulation.

    ``accumulate``: False overwrites, True adds, None overwrites where dst was never written and adds elsewhere.
    """
    op = "nc_matmul"
    dst, st, mv = _t(dst, op, "dst"), _t(stationary, op, "stationary"), _t(moving, op, "moving")
    _buf(st, ("sbuf",), op, "stationary")
    _buf(mv, ("sbuf",), op, "moving")
    _buf(dst, ("psum",), op, "dst")
    for t in (st, mv, dst):
        _partition_start(op, t)
    run = current_run()
    for t, role in ((st, "stationary"), (mv, "moving"), (dst, "dst")):
        if t.ndim != 2:
            raise NkiValidationError(f"nisa.{op}: {role} {fmt_shape(t)} must be 2-D [partition, free]")
    k, m = st.shape
    k2, n = mv.shape
    if perf_mode == "double_row":
        _need_gen(op, "trn2", "perf_mode=double_row")
        if not (st.dtype.startswith("float8") and mv.dtype.startswith("float8")):
            raise NkiValidationError(
                f"nisa.{op}: perf_mode=double_row takes fp8 operands, got {st.dtype} and {mv.dtype}"
            )
    if "float8_e4m3fn" in (st.dtype, mv.dtype):
        _need_gen(op, "trn3", "with float8_e4m3fn operands")
    kmax = 256 if perf_mode == "double_row" else PMAX
    if k != k2:
        raise NkiValidationError(
            f"nisa.{op}: contraction dims differ: stationary {fmt_shape(st)} has K={k}, "
            f"moving {fmt_shape(mv)} has K={k2} (K is the partition dim of both)"
        )
    if k > kmax:
        raise NkiValidationError(f"nisa.{op}: Size of partition dimension {k} (K) exceeds maximum {kmax}")
    if m > 128:
        raise NkiValidationError(
            f"nisa.{op}: stationary free size M={m} exceeds maximum 128 (nl.tile_size.gemm_stationary_fmax)"
        )
    nmax = 512 if run.gen.name != "trn3" else (4096 if dst.dtype == "float32" else 8192)
    if n > nmax:
        raise NkiValidationError(
            f"nisa.{op}: moving free size N={n} exceeds maximum {nmax} "
            f"(nl.tile_size.gemm_moving_fmax on {run.gen.name})"
        )
    if dst.shape != (m, n):
        raise NkiValidationError(
            f"nisa.{op}: dst {fmt_shape(dst)} must have shape [M={m}, N={n}] "
            f"for stationary {fmt_shape(st)} and moving {fmt_shape(mv)}"
        )
    for t, role in ((st, "stationary"), (mv, "moving")):
        if t.dtype not in _MATMUL_IN:
            raise NkiValidationError(
                f"nisa.{op}: {role} dtype {t.dtype} is not a matmul input dtype ({sorted(_MATMUL_IN)})"
            )
    fp32ish = {"float32", "tfloat32"}
    if (st.dtype in fp32ish) != (mv.dtype in fp32ish):
        raise NkiValidationError(
            f"nisa.{op}: fp32/tf32 operands must be paired with each other, got "
            f"stationary {st.dtype} and moving {mv.dtype}"
        )
    allowed_dst = {"float32"} if run.gen.name != "trn3" else {"float32", "bfloat16"}
    if dst.dtype not in allowed_dst:
        raise NkiValidationError(
            f"nisa.{op}: dst dtype must be {' or '.join(sorted(allowed_dst))} on {run.gen.name}, got {dst.dtype}"
        )
    run.count(
        "tensor",
        "matmul",
        m,
        n,
        max(st.itemsize, mv.itemsize),
        reads=(st, mv) if accumulate is False else (st, mv, dst),
        writes=(dst,),
    )
    run.stats.matmul_flops += 2 * k * m * n
    if run.shape_only:
        return
    # einsum, not BLAS: OpenBLAS' thread pool thrashes on a loaded machine for tiles this small (30x slower)
    res = np.einsum("km,kn->mn", _f32(st), _f32(mv))
    if accumulate is True:
        res = res + _f32(dst)
    elif accumulate is None:
        res = np.where(dst._written, _f32(dst) + res, res)
    _write(dst, res, op)


def nc_transpose(dst: NkiTensor, data: NkiTensor, engine: Any = None, name: str = "") -> None:
    """``dst = data.T`` (partition <-> free). Tensor engine: <=128x128, SBUF -> PSUM; Vector: <=32x32."""
    op = "nc_transpose"
    dst, data = _t(dst, op, "dst"), _t(data, op, "data")
    eng = engine or "tensor"
    lim = 128 if eng == "tensor" else 32
    if data.ndim != 2 or dst.ndim != 2:
        raise NkiValidationError(f"nisa.{op}: data {fmt_shape(data)} and dst {fmt_shape(dst)} must be 2-D")
    p, f = data.shape
    if p > lim or f > lim:
        raise NkiValidationError(f"nisa.{op}: data {fmt_shape(data)} exceeds {lim}x{lim} on the {eng} engine")
    if dst.shape != (f, p):
        raise NkiValidationError(f"nisa.{op}: dst {fmt_shape(dst)} must have shape [{f}, {p}]")
    if dst.dtype != data.dtype:
        raise NkiValidationError(f"nisa.{op}: dst dtype {dst.dtype} must equal data dtype {data.dtype}")
    if eng == "tensor":
        _buf(data, ("sbuf",), op, "data")
        _buf(dst, ("psum",), op, "dst")
        _partition_start(op, data)
        _partition_start(op, dst)
    else:
        _on_chip(op, dst, data)
    current_run().count(eng, "transpose", p, f, data.itemsize, reads=(data,), writes=(dst,))
    if not _shape_only():
        _write(dst, np.asarray(data._arr).T, op)


# --------------------------------------------------------------------------------------------- scalar
def activation(
    dst: NkiTensor,
    op: Any,
    data: NkiTensor,
    bias: Any = None,
    scale: Any = 1.0,
    reduce_op: Any = None,
    reduce_res: NkiTensor | None = None,
    reduce_cmd: Any = "idle",
    engine: Any = None,
    name: str = "",
) -> None:
    """``dst = op(data * scale + bias)`` on ScalarE; optionally ``reduce_res[P,1] = sum(result, free axes)``.

    ``engine`` (NKI 0.7): Scalar by default; GpSimd on trn3 (NeuronCore-v4) only."""
    where = "activation"
    dst, data = _t(dst, where, "dst"), _t(data, where, "data")
    if engine is not None:
        _versions.require("nki.isa.activation(engine=...)", "0.7")
    act_engine = _engine(engine, "scalar", where, dst, data, allowed=("scalar", "gpsimd"))
    if act_engine == "gpsimd":
        _need_gen(where, "trn3", "on the GpSimd engine")
    fn = _ops.unary(op, f"nisa.{where}")
    _on_chip(where, dst, data)
    _same_partitions(where, dst, data)
    _same_free(where, dst, data)
    _free_limit(where, dst, data)
    sc = _operand(scale, dst, where, "scale")
    if isinstance(bias, (int, float)) and current_run().gen.name == "trn1":
        raise NkiValidationError("nisa.activation: a scalar bias needs trn2 or later; pass a (P,1) tensor")
    bi = None if bias is None else _operand(bias, dst, where, "bias")
    if reduce_res is not None:
        reduce_res = _t(reduce_res, where, "reduce_res")
        _on_chip(where, reduce_res)
        if reduce_res.partitions != dst.partitions or reduce_res.free_size != 1:
            raise NkiValidationError(f"nisa.{where}: reduce_res {fmt_shape(reduce_res)} must be ({dst.partitions}, 1)")
        if reduce_op is not None and _ops.op_name(reduce_op) != "add":
            raise NkiValidationError(f"nisa.{where}: reduce_op must be nl.add, got {_ops.op_name(reduce_op)}")
    _count(act_engine, "activation", dst, data, also_reads=_tensors(bias, scale), also_writes=_tensors(reduce_res))
    if _shape_only():
        return
    x = _f32(data)
    if not (isinstance(sc, np.floating) and sc == 1.0):
        x = x * sc
    if bi is not None:
        x = x + bi
    with np.errstate(all="ignore"):
        y = np.asarray(fn(x), dtype=np.float32)
    _write(dst, y, where)
    if reduce_res is not None:
        _write(reduce_res, y.sum(axis=1, keepdims=True, dtype=np.float32), where)


def activation_reduce(
    dst: NkiTensor,
    op: Any,
    data: NkiTensor,
    reduce_op: Any,
    reduce_res: NkiTensor,
    bias: Any = None,
    scale: Any = 1.0,
    name: str = "",
) -> None:
    """:func:`activation` with its free-axis sum read out to ``reduce_res`` (the reset_reduce form)."""
    activation(
        dst, op, data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res, reduce_cmd="reset_reduce"
    )


# --------------------------------------------------------------------------------------------- vector
def _ensure_not_both_psum(op: str, a: NkiTensor, b: NkiTensor) -> None:
    if a.buffer == "psum" and b.buffer == "psum":
        raise NkiValidationError(
            f"nisa.{op}: both inputs {fmt_shape(a)} and {fmt_shape(b)} are in PSUM; copy one to SBUF first"
        )


def tensor_tensor(
    dst: NkiTensor, data1: NkiTensor, data2: NkiTensor, op: Any, engine: Any = None, name: str = ""
) -> None:
    """``dst = data1 op data2`` elementwise (same partitions and elements per partition; no broadcast)."""
    where = "tensor_tensor"
    dst, a, b = _t(dst, where, "dst"), _t(data1, where, "data1"), _t(data2, where, "data2")
    fn = _ops.binary(op, f"nisa.{where}")
    _on_chip(where, dst, a, b)
    _same_partitions(where, dst, a, b)
    _same_free(where, dst, a, b)
    _free_limit(where, dst, a, b)
    _ensure_not_both_psum(where, a, b)
    name_ = _ops.op_name(op)
    bitvec = name_ in BITVEC_OPS
    # int32 arithmetic defaults to GpSimd (native integer math); bit-vector operators are Vector operators
    default = (
        "gpsimd" if (name_ == "power" or (not bitvec and all(t.dtype == "int32" for t in (dst, a, b)))) else "vector"
    )
    eng = _engine(engine, default, where, dst, a, b)
    if bitvec:
        _versions.bitvec_engine_rule(where, name_, eng, ("vector", "gpsimd"))
    _count(eng, "tensor_tensor", dst, a, b)
    if not _shape_only():
        with np.errstate(all="ignore"):
            _write(dst, fn(_f32(a), _f32(b)), where)


def tensor_scalar(
    dst: NkiTensor,
    data: NkiTensor,
    op0: Any,
    operand0: Any,
    reverse0: bool = False,
    op1: Any = None,
    operand1: Any = None,
    reverse1: bool = False,
    engine: Any = None,
    name: str = "",
) -> None:
    """``dst = (data op0 operand0) op1 operand1``; operands are scalars or (P,1) vectors."""
    where = "tensor_scalar"
    dst, data = _t(dst, where, "dst"), _t(data, where, "data")
    f0 = _ops.binary(op0, f"nisa.{where}")
    f1 = None if op1 is None else _ops.binary(op1, f"nisa.{where}")
    _on_chip(where, dst, data)
    _same_partitions(where, dst, data)
    _same_free(where, dst, data)
    _free_limit(where, dst, data)
    a0 = _operand(operand0, dst, where, "operand0")
    a1 = None if f1 is None else _operand(operand1, dst, where, "operand1")
    eng = _engine(engine, "vector", where, dst, data)
    for op_ in (op0, op1):
        if op_ is not None and _ops.op_name(op_) in BITVEC_OPS:
            _versions.bitvec_engine_rule(where, _ops.op_name(op_), eng, ("vector", "scalar", "gpsimd"))
    _count(eng, "tensor_scalar", dst, data, also_reads=_tensors(operand0, operand1))
    if _shape_only():
        return
    x = _f32(data)
    with np.errstate(all="ignore"):
        x = f0(a0, x) if reverse0 else f0(x, a0)
        if f1 is not None:
            x = f1(a1, x) if reverse1 else f1(x, a1)
    _write(dst, x, where)


def scalar_tensor_tensor(
    dst: NkiTensor,
    data: NkiTensor,
    op0: Any,
    operand0: Any = None,
    op1: Any = None,
    operand1: NkiTensor | None = None,
    reverse0: bool = False,
    reverse1: bool = False,
    name: str = "",
    engine: Any = None,
    **legacy: Any,
) -> None:
    """``dst = (data op0 operand0) op1 operand1``: ``operand0`` is a number or a (P,1) vector, ``operand1`` a tile.

    ``scalar=``/``data1=`` (this emulator's earlier names for operand0/operand1) are still accepted.
    ``engine`` is an emulator extra (Vector by default; GpSimd allowed)."""
    where = "scalar_tensor_tensor"
    unknown = set(legacy) - {"scalar", "data1"}
    if unknown:
        raise NkiError(
            f"nisa.{where}: unexpected keyword(s) {sorted(unknown)}; the documented ones are dst, data, "
            "op0, operand0, op1, operand1, reverse0, reverse1, name"
        )
    operand0 = legacy.get("scalar", operand0)
    operand1 = legacy.get("data1", operand1)
    if operand0 is None or op1 is None or operand1 is None:
        raise NkiError(f"nisa.{where}: op0, operand0, op1 and operand1 are all required")
    dst, a, b = _t(dst, where, "dst"), _t(data, where, "data"), _t(operand1, where, "operand1")
    f0, f1 = _ops.binary(op0, f"nisa.{where}"), _ops.binary(op1, f"nisa.{where}")
    _on_chip(where, dst, a, b)
    _same_partitions(where, dst, a, b)
    _same_free(where, dst, a, b)
    _free_limit(where, dst, a, b)
    _ensure_not_both_psum(where, a, b)
    s = _operand(operand0, dst, where, "operand0")
    eng = _engine(engine, "vector", where, dst, a, b, allowed=("vector", "gpsimd"))
    _count(eng, "tensor_tensor", dst, a, b, also_reads=_tensors(operand0))
    if _shape_only():
        return
    with np.errstate(all="ignore"):
        x = _f32(a)
        x = f0(s, x) if reverse0 else f0(x, s)
        y = _f32(b)
        _write(dst, f1(y, x) if reverse1 else f1(x, y), where)


def tensor_reduce(
    dst: NkiTensor, op: Any, data: NkiTensor, axis: Any, negate: bool = False, keepdims: bool = False, name: str = ""
) -> None:
    """Reduce the trailing contiguous free axes of ``data`` (never axis 0) into ``dst``."""
    where = "tensor_reduce"
    dst, data = _t(dst, where, "dst"), _t(data, where, "data")
    fn = _ops.reduce(op, f"nisa.{where}")
    _on_chip(where, dst, data)
    _free_limit(where, data)
    axes = tuple(sorted(a % data.ndim for a in (axis if isinstance(axis, (tuple, list)) else (axis,))))
    if not axes or 0 in axes or axes != tuple(range(data.ndim - len(axes), data.ndim)):
        raise NkiValidationError(
            f"nisa.{where}: axis {axis} of {fmt_shape(data)} must be trailing contiguous free axes "
            f"(e.g. {data.ndim - 1} or {tuple(range(1, data.ndim))}); the partition axis 0 is never reduced here "
            "(use a transpose or nisa.tensor_partition_reduce)"
        )
    out_shape = (
        tuple(1 if i in axes else s for i, s in enumerate(data.shape))
        if keepdims
        else tuple(s for i, s in enumerate(data.shape) if i not in axes)
    )
    if math.prod(out_shape) != dst.size or dst.partitions != data.partitions:
        raise NkiValidationError(
            f"nisa.{where}: dst {fmt_shape(dst)} must hold the reduced shape "
            f"{list(out_shape)} of {fmt_shape(data)} over axis {axis}"
        )
    kind = "reduce_bf16" if data.itemsize <= 2 else "reduce"
    current_run().count("vector", kind, data.partitions, data.free_size, data.itemsize, reads=(data,), writes=(dst,))
    if _shape_only():
        return
    x = np.asarray(data._arr, np.float32)
    r = fn(x, axis=axes, keepdims=keepdims)
    _write(dst, -r if negate else r, where)


def tensor_partition_reduce(dst: NkiTensor, op: Any, data: NkiTensor, name: str = "") -> None:
    """Reduce along the partition dim on GpSimd: ``dst[1, F] = op over p of data[p, F]``."""
    where = "tensor_partition_reduce"
    dst, data = _t(dst, where, "dst"), _t(data, where, "data")
    fn = _ops.reduce(op, f"nisa.{where}")
    _buf(data, ("sbuf",), where, "data")
    _buf(dst, ("sbuf",), where, "dst")
    _partition_start(where, data)
    _partition_start(where, dst)
    if dst.partitions != 1 or dst.free_size != data.free_size:
        raise NkiValidationError(f"nisa.{where}: dst {fmt_shape(dst)} must be [1, {data.free_size}]")
    current_run().count(
        "gpsimd", "partition_reduce", data.partitions, data.free_size, data.itemsize, reads=(data,), writes=(dst,)
    )
    if not _shape_only():
        _write(dst, fn(_f32(data), axis=0, keepdims=True), where)


def reciprocal(dst: NkiTensor, data: NkiTensor, engine: Any = None, name: str = "") -> None:
    """``dst = 1 / data`` on VectorE."""
    where = "reciprocal"
    dst, data = _t(dst, where, "dst"), _t(data, where, "data")
    _on_chip(where, dst, data)
    _same_partitions(where, dst, data)
    _same_free(where, dst, data)
    eng = _engine(engine, "vector", where, dst, data)
    _count(eng, "reciprocal", dst, data)
    if not _shape_only():
        with np.errstate(all="ignore"):
            _write(dst, 1.0 / _f32(data), where)


def memset(dst: NkiTensor, value: Any, engine: Any = None, name: str = "") -> None:
    """Fill ``dst`` with ``value`` (which must suit dst's dtype: no float into an int tile)."""
    dst = _t(dst, "memset", "dst")
    _on_chip("memset", dst)
    if not is_float(dst.dtype) and isinstance(value, float) and not float(value).is_integer():
        raise NkiValidationError(f"nisa.memset: value {value} does not match dst dtype {dst.dtype}")
    eng = _engine(engine, "vector", "memset", dst)
    _count(eng, "memset", dst)
    if not _shape_only():
        _write(dst, np.full(dst.shape, value, np.float32), "memset")


def _affine(dst: NkiTensor, pattern: Any, offset: int, channel_multiplier: int, op: str) -> np.ndarray | None:
    pat = [tuple(int(v) for v in p) for p in pattern]
    counts = [c for _, c in pat]
    if math.prod(counts) != dst.free_size:
        raise NkiValidationError(
            f"nisa.{op}: pattern {pattern} covers {math.prod(counts)} elements per "
            f"partition but dst {fmt_shape(dst)} has {dst.free_size}"
        )
    if _shape_only():
        return None
    val = np.full((dst.partitions, *counts), float(offset), np.float64)
    val += channel_multiplier * np.arange(dst.partitions).reshape((-1,) + (1,) * len(counts))
    for i, (step, cnt) in enumerate(pat):
        shape = [1] * (len(counts) + 1)
        shape[i + 1] = cnt
        val = val + step * np.arange(cnt).reshape(shape)
    return val.reshape(dst.partitions, dst.free_size)


def iota(dst: NkiTensor, pattern: Any, offset: int = 0, channel_multiplier: int = 0, name: str = "") -> None:
    """``dst[p, i...] = offset + channel_multiplier*p + sum(step_k * i_k)`` (int32 affine values) on GpSimd."""
    dst = _t(dst, "iota", "dst")
    _buf(dst, ("sbuf",), "iota", "dst")
    _partition_start("iota", dst)
    current_run().count("gpsimd", "iota", dst.partitions, dst.free_size, dst.itemsize, writes=(dst,))
    val = _affine(dst, pattern, offset, channel_multiplier, "iota")
    if val is not None:
        _write(dst, val.astype(np.float32), "iota")


def affine_select(
    dst: NkiTensor,
    pattern: Any,
    channel_multiplier: int,
    on_true_tile: NkiTensor,
    on_false_value: Any,
    cmp_op: Any = "equal",
    offset: int = 0,
    name: str = "",
) -> None:
    """``dst = where(cmp_op(affine(p, i), 0), on_true_tile, on_false_value)`` on GpSimd (the causal mask op).

    ``affine(p, i) = offset + channel_multiplier*p + sum(step_k*i_k)`` with ``pattern=[[step, count], ...]``.
    """
    where = "affine_select"
    dst, src = _t(dst, where, "dst"), _t(on_true_tile, where, "on_true_tile")
    _buf(dst, ("sbuf",), where, "dst")
    _buf(src, ("sbuf",), where, "on_true_tile")
    _partition_start(where, dst)
    _partition_start(where, src)
    _same_partitions(where, dst, src)
    _same_free(where, dst, src)
    cmp = _ops.binary(cmp_op, f"nisa.{where}")
    current_run().count(
        "gpsimd", "affine_select", dst.partitions, dst.free_size, dst.itemsize, reads=(src,), writes=(dst,)
    )
    val = _affine(dst, pattern, offset, channel_multiplier, where)
    if val is not None:
        keep = cmp(val, np.zeros((), np.float64)) != 0
        _write(dst, np.where(keep, _f32(src), np.float32(on_false_value)), where)


def bn_stats(dst: NkiTensor, data: NkiTensor, name: str = "") -> None:
    """Per-partition (mean, M2-style) statistics of a <=512-element chunk: dst[P, 6] = count, mean, var * 2.

    The emulator stores ``[count, mean, var, count, mean, var]`` (fp32); :func:`bn_aggr` combines them.
    """
    where = "bn_stats"
    dst, data = _t(dst, where, "dst"), _t(data, where, "data")
    _on_chip(where, dst, data)
    _same_partitions(where, dst, data)
    if data.free_size > 512:
        raise NkiValidationError(
            f"nisa.{where}: data {fmt_shape(data)} has {data.free_size} elements per "
            "partition, above nl.tile_size.bn_stats_fmax = 512"
        )
    if dst.free_size != 6:
        raise NkiValidationError(f"nisa.{where}: dst {fmt_shape(dst)} must have 6 elements per partition")
    _count("vector", "bn_stats", dst, data)
    if _shape_only():
        return
    x = _f32(data)
    n = np.full((x.shape[0], 1), x.shape[1], np.float32)
    s = np.concatenate([n, x.mean(1, keepdims=True), x.var(1, keepdims=True)], axis=1)
    _write(dst, np.concatenate([s, s], axis=1), where)


def bn_aggr(dst: NkiTensor, data: NkiTensor, name: str = "") -> None:
    """Combine :func:`bn_stats` chunks (``data[P, 6*k]``) into ``dst[P, 2] = (mean, var)``."""
    where = "bn_aggr"
    dst, data = _t(dst, where, "dst"), _t(data, where, "data")
    _on_chip(where, dst, data)
    _same_partitions(where, dst, data)
    if data.free_size % 6 or dst.free_size != 2:
        raise NkiValidationError(
            f"nisa.{where}: data {fmt_shape(data)} must hold 6*k stats and dst {fmt_shape(dst)} 2 values per partition"
        )
    _count("vector", "bn_aggr", dst, data)
    if _shape_only():
        return
    s = _f32(data).reshape(data.partitions, -1, 3)
    n, mu, var = s[..., 0], s[..., 1], s[..., 2]
    tot = n.sum(1, keepdims=True)
    mean = (n * mu).sum(1, keepdims=True) / tot
    m2 = (n * (var + (mu - mean) ** 2)).sum(1, keepdims=True) / tot
    _write(dst, np.concatenate([mean, m2], axis=1), where)


# ------------------------------------------------------------------------ 0.6/0.7 additions (issue 40)
def tensor_tensor_scan(
    dst: NkiTensor,
    data0: NkiTensor,
    data1: NkiTensor,
    initial: Any,
    op0: Any,
    op1: Any,
    reverse0: bool = False,
    reverse1: bool = False,
    name: str = "",
) -> None:
    """A scan along the free elements of each partition on VectorE:
    ``r[0] = (data0[0] op0 initial) op1 data1[0]``, ``r[i] = (data0[i] op0 r[i-1]) op1 data1[i]``.

    ``initial`` is an fp32 scalar or a (P,1) tile; ``reverse0``/``reverse1`` swap an op's operands. The
    running value is fp32; results are rounded to ``dst.dtype`` on the write.
    """
    where = "tensor_tensor_scan"
    dst, a, b = _t(dst, where, "dst"), _t(data0, where, "data0"), _t(data1, where, "data1")
    f0, f1 = _ops.binary(op0, f"nisa.{where}"), _ops.binary(op1, f"nisa.{where}")
    _on_chip(where, dst, a, b)
    _same_partitions(where, dst, a, b)
    _same_free(where, dst, a, b)
    _free_limit(where, dst, a, b)
    _ensure_not_both_psum(where, a, b)
    init = _operand(initial, dst, where, "initial")
    _count("vector", "tensor_tensor", dst, a, b, also_reads=_tensors(initial))
    if _shape_only():
        return
    x0, x1 = _f32(a), _f32(b)
    out = np.empty_like(x0)
    prev = np.broadcast_to(np.asarray(init, np.float32).reshape(-1, 1), (x0.shape[0], 1))[:, 0]
    with np.errstate(all="ignore"):
        for i in range(x0.shape[1]):
            t = f0(prev, x0[:, i]) if reverse0 else f0(x0[:, i], prev)
            prev = (f1(x1[:, i], t) if reverse1 else f1(t, x1[:, i])).astype(np.float32)
            out[:, i] = prev
    _write(dst, out, where)


def tensor_scalar_reduce(
    dst: NkiTensor,
    data: NkiTensor,
    op0: Any,
    operand0: Any,
    reduce_op: Any,
    reduce_res: NkiTensor,
    reverse0: bool = False,
    reduce_cmd: Any = "reset_reduce",
    reduce_init: Any = None,
    reduce_res_negate: bool = False,
    name: str = "",
) -> None:
    """``dst = data op0 operand0`` and ``reduce_res[P,1] = reduce_op`` over its free elements (VectorE)."""
    where = "tensor_scalar_reduce"
    tensor_scalar(dst, data, op0, operand0, reverse0=reverse0)
    reduce_res = _t(reduce_res, where, "reduce_res")
    _on_chip(where, reduce_res)
    if reduce_res.partitions != dst.partitions or reduce_res.free_size != 1:
        raise NkiValidationError(f"nisa.{where}: reduce_res {fmt_shape(reduce_res)} must be ({dst.partitions}, 1)")
    fn = _ops.reduce(reduce_op, f"nisa.{where}")
    if _shape_only():
        return
    r = fn(_f32(dst), axis=1, keepdims=True)
    if reduce_init is not None:
        r = _ops.binary(reduce_op if _ops.op_name(reduce_op) != "add" else "add", where)(r, np.float32(reduce_init))
    _write(reduce_res, -r if reduce_res_negate else r, where)


def exponential(
    dst: NkiTensor,
    src: NkiTensor,
    max_value: Any = 0.0,
    reduce_res: NkiTensor | None = None,
    reduce_cmd: Any = "idle",
    reduce_init: Any = 0.0,
    name: str = "",
) -> None:
    """``dst = exp(src - max_value)`` with an optional running sum into ``reduce_res`` (VectorE, trn3 only)."""
    where = "exponential"
    _need_gen(where, "trn3")
    dst, src = _t(dst, where, "dst"), _t(src, where, "src")
    _on_chip(where, dst, src)
    _same_partitions(where, dst, src)
    _same_free(where, dst, src)
    mv = _operand(max_value, dst, where, "max_value")
    _count("vector", "activation", dst, src, also_reads=_tensors(max_value), also_writes=_tensors(reduce_res))
    if _shape_only():
        return
    with np.errstate(all="ignore"):
        y = np.exp(_f32(src) - mv)
    _write(dst, y, where)
    if reduce_res is not None:
        init = np.float32(reduce_init) if reduce_cmd != "reduce" else _f32(reduce_res)
        _write(reduce_res, y.sum(axis=1, keepdims=True) + init, where)


def max8(dst: NkiTensor, src: NkiTensor, name: str = "") -> None:
    """The 8 largest values of each partition's free elements, in descending order (VectorE): dst[P, 8]."""
    where = "max8"
    dst, src = _t(dst, where, "dst"), _t(src, where, "src")
    _on_chip(where, dst, src)
    _same_partitions(where, dst, src)
    if dst.free_size != 8 or src.free_size < 8:
        raise NkiValidationError(
            f"nisa.{where}: dst {fmt_shape(dst)} must hold 8 values per partition and src {fmt_shape(src)} at least 8"
        )
    _count("vector", "reduce", src, src)
    if not _shape_only():
        _write(dst, -np.sort(-_f32(src), axis=1)[:, :8], where)


def nc_find_index8(dst: NkiTensor, data: NkiTensor, vals: NkiTensor, name: str = "") -> None:
    """Per partition, the index of the first element of ``data`` equal to each of the 8 ``vals`` (uint32)."""
    where = "nc_find_index8"
    dst, data, vals = _t(dst, where, "dst"), _t(data, where, "data"), _t(vals, where, "vals")
    _on_chip(where, dst, data, vals)
    _same_partitions(where, dst, data, vals)
    if dst.free_size != 8 or vals.free_size != 8:
        raise NkiValidationError(f"nisa.{where}: dst and vals take 8 values per partition")
    _count("vector", "reduce", data, data)
    if _shape_only():
        return
    x, v = _f32(data), _f32(vals)
    hit = x[:, None, :] == v[:, :, None]
    idx = np.where(hit.any(axis=2), hit.argmax(axis=2), 0xFFFFFFFF)
    _write(dst, idx.astype(np.float64), where)


def nc_match_replace8(
    dst: NkiTensor, data: NkiTensor, vals: NkiTensor, imm: float, dst_idx: NkiTensor | None = None, name: str = ""
) -> None:
    """``dst`` = ``data`` with the first element equal to each of the 8 ``vals`` replaced by ``imm``."""
    where = "nc_match_replace8"
    if dst_idx is not None:
        nc_find_index8(dst_idx, data, vals)
    dst, data, vals = _t(dst, where, "dst"), _t(data, where, "data"), _t(vals, where, "vals")
    _on_chip(where, dst, data, vals)
    _same_free(where, dst, data)
    _count("vector", "tensor_tensor", dst, data)
    if _shape_only():
        return
    x, v = _f32(data).copy(), _f32(vals)
    for p in range(x.shape[0]):
        for val in v[p]:
            hits = np.flatnonzero(x[p] == val)
            if hits.size:
                x[p, hits[0]] = np.float32(imm)
    _write(dst, x, where)


def topk(val_dst: NkiTensor, idx_dst: NkiTensor, src: NkiTensor, n: int, name: str = "") -> None:
    """The ``n`` largest values of each partition (descending) and their uint32 indices (GpSimd)."""
    where = "topk"
    val_dst, idx_dst, src = _t(val_dst, where, "val_dst"), _t(idx_dst, where, "idx_dst"), _t(src, where, "src")
    for t in (val_dst, idx_dst, src):
        _buf(t, ("sbuf",), where, "operand")
    _same_partitions(where, val_dst, idx_dst, src)
    if val_dst.free_size != n or idx_dst.free_size != n or not 0 < n <= src.free_size:
        raise NkiValidationError(
            f"nisa.{where}: val_dst and idx_dst must hold n={n} values per partition and "
            f"src {fmt_shape(src)} at least n"
        )
    current_run().count(
        "gpsimd", "topk", src.partitions, 4 * src.free_size + n, src.itemsize, reads=(src,), writes=(val_dst, idx_dst)
    )
    if _shape_only():
        return
    x = _f32(src)
    order = np.argsort(-x, axis=1, kind="stable")[:, :n]
    _write(val_dst, np.take_along_axis(x, order, axis=1), where)
    _write(idx_dst, order.astype(np.float64), where)


_DMA_T_AXES = {2: ((1, 0),), 3: ((2, 1, 0),), 4: ((3, 1, 2, 0),)}


def dma_transpose(
    dst: NkiTensor,
    src: NkiTensor,
    axes: Any = None,
    priority: Any = None,
    dge_mode: Any = None,
    oob_mode: Any = None,
    name: str = "",
) -> None:
    """Transpose ``src`` into SBUF ``dst`` on the DMA engines (2-byte dtypes; ``src.shape[-1] <= 128``)."""
    where = "dma_transpose"
    dst, src = _t(dst, where, "dst"), _t(src, where, "src")
    _need_gen(where, "trn2")
    _buf(dst, ("sbuf",), where, "dst")
    if src.buffer == "psum":
        raise NkiValidationError(f"nisa.{where}: src {fmt_shape(src)} is in PSUM; DMA cannot read PSUM")
    axes = tuple(axes) if axes is not None else tuple(reversed(range(src.ndim)))
    if axes not in _DMA_T_AXES.get(src.ndim, ()):
        raise NkiValidationError(
            f"nisa.{where}: axes {axes} for a {src.ndim}-D src must be one of {_DMA_T_AXES.get(src.ndim, ())}"
        )
    if src.itemsize != 2 or dst.dtype != src.dtype:
        raise NkiValidationError(f"nisa.{where}: needs equal 2-byte dtypes, got {src.dtype} -> {dst.dtype}")
    if src.shape[-1] > PMAX:
        raise NkiValidationError(f"nisa.{where}: src {fmt_shape(src)} last dim exceeds {PMAX}")
    want = tuple(src.shape[a] for a in axes)
    if dst.shape != want:
        raise NkiValidationError(f"nisa.{where}: dst {fmt_shape(dst)} must have shape {list(want)}")
    run = current_run()
    run.step()
    run.stats.dma_transfers += 1
    run.stats.engines["dma"].instructions += 1
    run.stats.engines["dma"].elements += src.size
    if src.buffer.is_hbm:
        run.stats.dma_bytes_hbm_to_sbuf += src.size * src.itemsize
    else:
        run.stats.dma_bytes_other += src.size * src.itemsize
    # DMA transpose: up to 90% of DMA throughput HBM->SBUF, 50% SBUF->SBUF (trn2 arch guide)
    run.count_dma(src, dst, int(src.size * src.itemsize / (0.9 if src.buffer.is_hbm else 0.5)))
    if not run.shape_only:
        dst._arr[...] = np.transpose(np.asarray(src._arr), axes)


def tensor_copy_predicated(
    dst: NkiTensor, src: NkiTensor, predicate: NkiTensor, reverse_pred: bool = False, name: str = ""
) -> None:
    """``dst = src`` where ``predicate`` is nonzero (zero with ``reverse_pred``); other elements untouched."""
    where = "tensor_copy_predicated"
    dst, src, pred = _t(dst, where, "dst"), _t(src, where, "src"), _t(predicate, where, "predicate")
    _on_chip(where, dst, src, pred)
    _same_partitions(where, dst, src, pred)
    _same_free(where, dst, src, pred)
    _count("vector", "tensor_tensor", dst, src, pred)
    if _shape_only():
        return
    keep = (_f32(pred) != 0) != bool(reverse_pred)
    _write(dst, np.where(keep, _f32(src), _f32(dst)), where)


def dropout(dst: NkiTensor, data: NkiTensor, prob: Any, name: str = "") -> None:
    """Zero each element with probability ``prob`` (a number or (P,1) tile) on VectorE; no rescaling.
    The mask comes from the emulator's generator, not the device's random stream."""
    where = "dropout"
    dst, data = _t(dst, where, "dst"), _t(data, where, "data")
    _on_chip(where, dst, data)
    _same_free(where, dst, data)
    pr = _operand(prob, dst, where, "prob")
    _count("vector", "tensor_tensor", dst, data)
    if not _shape_only():
        x = _f32(data)
        _write(dst, np.where(run_rng().random(x.shape) >= pr, x, 0.0), where)


# ---- registers (0.6; deprecated in 0.8) and scalars (0.7): both are NkiScalar values here
_SCALARS = "nki.isa.scalar_load / nki.isa.scalar_store with nki.isa.NkiScalar"


def __getattr__(name: str) -> Any:
    if name == "VirtualRegister":  # deprecated in 0.8: a module attribute, so every use of the name warns
        _versions.deprecated("nki.isa.VirtualRegister", _SCALARS)
        return NkiScalar
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_alloc(x: Any = None) -> NkiScalar:
    """A new run-time register holding ``x`` (0 if omitted). Deprecated in NKI 0.8 (use scalar_load/store)."""
    _versions.deprecated("nki.isa.register_alloc", _SCALARS)
    return NkiScalar(0 if x is None else runtime_int(x, "nisa.register_alloc"))


def _set(reg: Any, value: int, op: str) -> None:
    if not isinstance(reg, NkiScalar):
        raise NkiError(f"nisa.{op}: dst must be a register from nisa.register_alloc, got {type(reg).__name__}")
    reg._v = NkiScalar(value, reg.dtype)._v


def register_load(dst: Any, src: NkiTensor, name: str = "") -> None:
    """Load a 1x1 SBUF/HBM int tensor into register ``dst``. Deprecated in NKI 0.8 (use scalar_load)."""
    _versions.deprecated("nki.isa.register_load", "nki.isa.scalar_load")
    _set(dst, runtime_int(_t(src, "register_load", "src"), "nisa.register_load"), "register_load")


def register_move(dst: Any, src: Any, name: str = "") -> None:
    """``dst = src`` (a register or an int). Deprecated in NKI 0.8 (NkiScalar arithmetic replaces it)."""
    _versions.deprecated("nki.isa.register_move", _SCALARS)
    _set(dst, runtime_int(src, "nisa.register_move"), "register_move")


def register_store(dst: NkiTensor, src: Any, name: str = "") -> None:
    """Store register ``src`` into the 1x1 tensor ``dst``. Deprecated in NKI 0.8 (use scalar_store)."""
    _versions.deprecated("nki.isa.register_store", "nki.isa.scalar_store")
    _scalar_store("nisa.register_store", dst, src)


def scalar_load(src: NkiTensor, name: str = "") -> NkiScalar:
    """Read a 1x1 int32/int64 tile into an :class:`NkiScalar` (NKI 0.7)."""
    _versions.require("nki.isa.scalar_load", "0.7")
    src = _t(src, "scalar_load", "src")
    if src.size != 1 or src.dtype not in ("int32", "uint32", "int64"):
        raise NkiValidationError(f"nisa.scalar_load: src {fmt_shape(src)} must be a 1x1 int32/int64 tensor")
    return NkiScalar(runtime_int(src, "nisa.scalar_load"), "int64" if src.dtype == "int64" else "int32")


def scalar_store(dst: NkiTensor, value: Any, name: str = "") -> None:
    """Write a run-time scalar into the 1x1 tensor ``dst`` (NKI 0.7)."""
    _versions.require("nki.isa.scalar_store", "0.7")
    _scalar_store("nisa.scalar_store", dst, value)


def _scalar_store(where: str, dst: Any, value: Any) -> None:
    dst = _t(dst, where.removeprefix("nisa."), "dst")
    if dst.size != 1:
        raise NkiValidationError(f"{where}: dst {fmt_shape(dst)} must be 1x1")
    v = runtime_int(value, where)
    current_run().note_write(dst)
    if not _shape_only():
        _write(dst, np.full(dst.shape, v, np.float64), where)


# ---- cross-core communication: the 0.6/0.7 nki.isa entry points, deprecated wrappers of nki.lnc in 0.8
def sendrecv(
    src: NkiTensor,
    dst: NkiTensor,
    send_to_rank: int,
    recv_from_rank: int,
    pipe_id: Any = None,
    dma_engine: Any = "dma",
    name: str = "",
) -> None:
    """Exchange tiles with the peer core of an LNC-2 launch (see nki.lnc.sendrecv); ``pipe_id`` is ignored."""
    _versions.deprecated("nki.isa.sendrecv", "nki.lnc.sendrecv (remove pipe_id, which NKI 0.8 ignores)")
    if dma_engine not in ("dma", "gpsimd_dma"):
        raise NkiValidationError(f"nisa.sendrecv: dma_engine={dma_engine!r}; use nisa.dma_engine.dma or .gpsimd_dma")
    _lnc.exchange("nki.isa.sendrecv", "sendrecv", src, dst, send_to_rank, recv_from_rank, {"dma_engine": dma_engine})


def sendrecv_compute(
    src: NkiTensor, dst: NkiTensor, send_to_rank: int, recv_from_rank: int, reduce_op: Any, name: str = ""
) -> None:
    """``dst = reduce_op(src, peer's src)`` across an LNC-2 launch (see nki.lnc.sendrecv_compute)."""
    _versions.require("nki.isa.sendrecv_compute", "0.7")
    _versions.deprecated("nki.isa.sendrecv_compute", "nki.lnc.sendrecv_compute")
    _lnc.sendrecv_compute_impl("nki.isa.sendrecv_compute", src, dst, send_to_rank, recv_from_rank, reduce_op, None)


def core_barrier(data: NkiTensor, cores: Any, engine: Any = None, name: str = "") -> None:
    """Wait until both cores reach the barrier (see nki.lnc.core_barrier)."""
    _versions.deprecated("nki.isa.core_barrier", "nki.lnc.core_barrier")
    _lnc.core_barrier_impl("nki.isa.core_barrier", data, cores, engine)


# ---- local_gather (GpSimd): 8 cores of 16 partitions, each gathering within its own partitions
_GATHER_ELEMS = (1, 2, 4, 8, 16, 32)


def local_gather(
    dst: NkiTensor,
    src_buffer: NkiTensor,
    index: NkiTensor,
    num_elem_per_idx: int = 1,
    num_valid_indices: int | None = None,
    name: str = "",
) -> None:
    """Gather on GpSimd: each of its 8 cores serves 16 partitions; it flattens its 16-partition slice of
    ``index`` (uint16, partition-major: column by column) into element offsets and gathers, for each of its
    partitions, ``num_elem_per_idx`` contiguous elements of ``src_buffer``'s free dims at each offset:
    ``dst[p] = concat(src_flat[p, i : i + num_elem_per_idx] for i in offsets[:num_valid_indices])``.

    Without ``num_valid_indices`` every index counts (the NKI 0.7 default); NKI 0.8 leaves that result
    undefined and warns (:class:`NkiWarning`)."""
    where = "local_gather"
    dst, src, idx = _t(dst, where, "dst"), _t(src_buffer, where, "src_buffer"), _t(index, where, "index")
    for t, role in ((dst, "dst"), (src, "src_buffer"), (idx, "index")):
        _buf(t, ("sbuf",), where, role)
        _partition_start(where, t)
    if src.partitions != idx.partitions or src.partitions % 16 or dst.partitions != src.partitions:
        raise NkiValidationError(
            f"nisa.{where}: src_buffer {fmt_shape(src)}, index {fmt_shape(idx)} and dst {fmt_shape(dst)} must "
            "have the same partition count, a multiple of 16 (each GpSimd core serves 16 partitions)"
        )
    if idx.dtype != "uint16":
        raise NkiValidationError(f"nisa.{where}: index {fmt_shape(idx)} must be uint16, got {idx.dtype}")
    if dst.dtype != src.dtype:
        raise NkiValidationError(f"nisa.{where}: dst dtype {dst.dtype} must equal src_buffer's {src.dtype} (no cast)")
    if num_elem_per_idx not in _GATHER_ELEMS:
        raise NkiValidationError(f"nisa.{where}: num_elem_per_idx={num_elem_per_idx} must be one of {_GATHER_ELEMS}")
    per_core = 16 * idx.free_size
    if num_valid_indices is None:
        if _versions.at_least("0.8"):
            _versions.warn(
                f"nisa.{where} without num_valid_indices: NKI 0.8 leaves the result undefined (a later release "
                f"makes the default dst_free_size / num_elem_per_idx); pass num_valid_indices explicitly (the "
                f"emulator gathers all {per_core} indices per core, the NKI 0.7 default)"
            )
        valid = per_core
    else:
        valid = int(num_valid_indices)
        if not 0 < valid <= per_core:
            raise NkiValidationError(
                f"nisa.{where}: num_valid_indices={valid} must be in 1..{per_core} (the index elements of one "
                "16-partition slice)"
            )
    if valid > 4096:
        raise NkiValidationError(f"nisa.{where}: {valid} indices per GpSimd core; at most 4096")
    if dst.free_size != valid * num_elem_per_idx:
        raise NkiValidationError(
            f"nisa.{where}: dst {fmt_shape(dst)} must hold num_valid_indices x num_elem_per_idx = "
            f"{valid} x {num_elem_per_idx} elements per partition"
        )
    current_run().count(
        "gpsimd", "gather", dst.partitions, dst.free_size, dst.itemsize, reads=(src, idx), writes=(dst,)
    )
    if _shape_only():
        return
    flat = np.asarray(src._arr).reshape(src.partitions, -1)
    offsets = np.asarray(idx._arr).reshape(idx.partitions, -1).astype(np.int64)
    span = np.arange(num_elem_per_idx)
    out = np.empty((dst.partitions, valid, num_elem_per_idx), flat.dtype)
    for c0 in range(0, src.partitions, 16):
        core = offsets[c0 : c0 + 16].flatten(order="F")[:valid]
        cols = core[:, None] + span[None, :]
        if cols.size and (cols.min() < 0 or cols.max() >= flat.shape[1]):
            raise NkiValidationError(
                f"nisa.{where}: an index of GpSimd core {c0 // 16} reaches element {int(cols.max())} of a "
                f"{flat.shape[1]}-element partition (out-of-bound access is undefined on the device)"
            )
        out[c0 : c0 + 16] = flat[c0 : c0 + 16][:, cols]
    dst._arr[...] = out.reshape(dst.shape)


# ---- documented, refused (each raises NkiUnsupportedError naming itself)
_REFUSED = {
    "nc_matmul_mx": "MX matmul (NC-v4) is not emulated",
    "quantize_mx": "MX quantization (NC-v4) is not emulated",
    "activate2": "activate2 (Trn3) is not emulated",
    "tensor_scalar_cumulative": "not emulated",
    "range_select": "not emulated",
    "select_reduce": "not emulated",
    "sequence_bounds": "not emulated",
    "nc_n_gather": "not emulated",
    "dma_compute": "DMA read-modify-write is not emulated",
    "nc_stream_shuffle": "not emulated",
    "rng": "the device's random stream is not reproduced",
    "rand2": "the device's random stream is not reproduced",
    "rand_set_state": "the device's random stream is not reproduced",
    "rand_get_state": "the device's random stream is not reproduced",
    "set_rng_seed": "the device's random stream is not reproduced",
    "nonzero_with_count": "not emulated",
    "get_nc_sub_version": "stub-only in the SDK; no documented values",
}
for _n, _why in _REFUSED.items():
    globals()[_n] = unsupported(f"nki.isa.{_n}", _why)


class NkiInstruction:
    """Instruction handles (``.depends_on()``) order instructions on the device; not modelled."""

    def __init__(self, *_: Any, **__: Any):
        raise NkiUnsupportedError("nki.isa.NkiInstruction (explicit instruction dependencies) is not emulated")


__all__ += [
    "NkiInstruction",
    "NkiScalar",
    "dma_engine",
    "dma_transpose",
    "dropout",
    "engine",
    "exponential",
    "get_nc_version",
    "matmul_perf_mode",
    "max8",
    "nc_find_index8",
    "nc_match_replace8",
    "nc_version",
    "core_barrier",
    "local_gather",
    "register_alloc",
    "register_load",
    "register_move",
    "register_store",
    "scalar_load",
    "scalar_store",
    "sendrecv",
    "sendrecv_compute",
    "tensor_copy_predicated",
    "tensor_scalar_reduce",
    "tensor_tensor_scan",
    "topk",
    *_REFUSED,
]
