"""The documented ``nki.language`` / ``nki.isa`` / ``nki.lnc`` surface (NKI 0.6 reference plus the 0.7 and 0.8
additions) and the emulator's state for each entry: implemented (with the documented parameter names, in
order), refused (raises :class:`NkiUnsupportedError` naming itself) or missing; and the NKI releases that
have it (:data:`RELEASES`; the emulator enforces them, emulator/versions.py).

The lists restate the public AWS Neuron SDK reference (aws-neuron/aws-neuron-sdk ``nki/api/nki/language``,
``nki/api/nki/isa`` stubs at 81ce03a, Neuron 2.32 = NKI 0.6; the 0.7 pages of the v2.33 docs; the ``nki.lnc``
pages and the NKI 0.8 deprecation announcement of the latest docs), as collected in
``shared/NKI_API_AND_COSTS.md``. ``tools/gen_nki_api_table.py`` renders :func:`api_states` into docs/nki.md.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any

_E = "x, dtype"
_B = "x, y, dtype"
_R = "x, axis, dtype, keepdims"

# name -> documented parameters ("" = no parameters; None = a constant, class or enum: existence only)
LANGUAGE: dict[str, str | None] = {
    # creation
    "ndarray": "shape, dtype, buffer, name, address",
    "zeros": "shape, dtype, buffer, name",
    "ones": "shape, dtype, buffer, name",
    "full": "shape, fill_value, dtype, buffer, name",
    "zeros_like": "x, dtype, buffer, name",
    "empty_like": "x, dtype, buffer, name",
    "shared_constant": "constant",
    "shared_identity_matrix": "n, dtype, dst",
    "rand": "shape, dtype, buffer, name",
    "random_seed": "seed",
    # tensor ops
    "load": "src, dtype",
    "load_transpose2d": "src, dtype",
    "store": "dst, value",
    "copy": _E,
    "matmul": "x, y, transpose_x",
    "transpose": "x, dtype",
    # elementwise
    **{
        n: _E
        for n in (
            "abs",
            "arctan",
            "ceil",
            "cos",
            "exp",
            "floor",
            "log",
            "negative",
            "reciprocal",
            "rsqrt",
            "sign",
            "sin",
            "sqrt",
            "square",
            "tan",
            "tanh",
            "trunc",
            "relu",
            "sigmoid",
            "silu",
            "silu_dx",
            "gelu",
            "gelu_dx",
            "gelu_apprx_sigmoid",
            "gelu_apprx_sigmoid_dx",
            "gelu_apprx_tanh",
            "mish",
            "softplus",
            "erf",
            "erf_dx",
            "logical_not",
            "invert",
        )
    },
    **{
        n: _B
        for n in (
            "abs_max",
            "abs_min",
            "add",
            "maximum",
            "minimum",
            "multiply",
            "power",
            "subtract",
            "divide",
            "fmod",
            "mod",
            "equal",
            "not_equal",
            "less",
            "less_equal",
            "greater",
            "greater_equal",
            "logical_and",
            "logical_or",
            "logical_xor",
            "bitwise_and",
            "bitwise_or",
            "bitwise_xor",
            "left_shift",
            "right_shift",
        )
    },
    "softmax": "x, axis, dtype",
    "dropout": "x, rate, dtype",
    "rms_norm": "x, w, axis, n, epsilon, dtype, compute_dtype",
    # reductions
    **{n: _R for n in ("max", "mean", "min", "prod", "sum", "var")},
    "all": "x, axis, dtype",
    # manipulation / indexing
    "broadcast_to": "x, shape, dtype",
    "ds": "start, size",
    "expand_dims": "x, axis",
    "where": "condition, x, y, dtype",
    "gather_flattened": "data, indices, axis, dtype",
    # loops and control flow
    "affine_range": "start, stop, step",
    "sequential_range": "start, stop, step",
    "static_range": "start, stop, step",
    "dynamic_range": "start, stop, step",
    "fori_loop": "lower, upper, body_fun, step",
    "while_loop": "init, body_fun",
    "if_else": "cond, then_fn, else_fn",
    # memory
    "sbuf": None,
    "psum": None,
    "hbm": None,
    "private_hbm": None,
    "shared_hbm": None,
    "is_psum": None,
    "is_sbuf": None,
    "is_hbm": None,
    "is_on_chip": None,
    # other
    "device_print": "print_prefix, tensor",
    "no_reorder": "",
    "program_id": "axis",
    "num_programs": "axes",
    "program_ndim": "",
    "prelu": None,
    "bypass": None,
    "average": None,
    "tile_size": None,
    # dtypes
    **{
        n: None
        for n in (
            "bool_",
            "int8",
            "int16",
            "int32",
            "uint8",
            "uint16",
            "uint32",
            "float16",
            "float32",
            "bfloat16",
            "tfloat32",
            "float8_e4m3",
            "float8_e5m2",
            "float8_e4m3fn",
            "float8_e8m0fnu",
            "float8_e5m2_x4",
            "float8_e4m3fn_x4",
            "float4_e2m1fn_x4",
        )
    },
    # NKI 0.7 tile/block grids and classes
    "tiles": "source, tile_shape",
    "blocks": "source, tile_shape, block_shape",
    "alloc_tiles": "tile_shape, element_shape, buffer, dtype, address, name",
    "alloc_blocks": "tile_shape, block_shape, element_shape, buffer, dtype, address, name",
    "NkiGrid": None,
    "NkiTileGrid": None,
    "NkiBlockGrid": None,
    "NkiTensor": None,
}

TILE_SIZE = (
    "pmax",
    "psum_bank_fmax",
    "psum_bank_fmax_bytes",
    "psum_num_banks",
    "gemm_stationary_fmax",
    "gemm_moving_fmax",
    "bn_stats_fmax",
    "psum_min_align",
    "sbuf_min_align",
    "sbuf_size_bytes",
    "sbuf_fmax",
    "sbuf_fmax_bytes",
    "psum_fmax",
    "total_available_sbuf_size",
)

TENSOR_METHODS: dict[str, str | None] = {
    "slice": "dim, start, end, step",
    "select": "dim, index",
    "vector_select": "dim, vector_offset",
    "reshape": "shape",
    "reshape_dim": "dim, shape",
    "flatten_dims": "start_dim, end_dim",
    "expand_dim": "dim",
    "squeeze_dim": "dim",
    "permute": "dims",
    "broadcast": "dim, size",
    "rearrange": "src_pattern, dst_pattern, fixed_sizes",
    "view": "dtype",
    "reinterpret_cast": None,
    "indirect": "index, num_elem",
    "ap": "pattern, offset, scalar_offset, vector_offset, indirect_dim, dtype",
    "get_pattern": "",
    "is_contiguous": "",
    "is_indirect": "",
    "shape": None,
    "strides": None,
    "offset": None,
    "dtype": None,
    "buffer": None,
    "ndim": None,
    "size": None,
}

ISA: dict[str, str | None] = {
    "nc_matmul": "dst, stationary, moving, is_stationary_onezero, is_moving_onezero, is_transpose, accumulate, "
    "tile_position, tile_size, perf_mode",
    "nc_matmul_mx": "dst, stationary, moving, stationary_scale, moving_scale, tile_position, tile_size, accumulate",
    "nc_transpose": "dst, data, engine",
    "activation": "dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd",
    "activation_reduce": "dst, op, data, reduce_op, reduce_res, bias, scale",
    "activate2": "dst, op, data, imm0, imm1, op0, op1, relu_param, reverse0, reverse1, reduce_op, reduce_res, "
    "reduce_cmd",
    "tensor_reduce": "dst, op, data, axis, negate, keepdims",
    "tensor_partition_reduce": "dst, op, data",
    "tensor_tensor": "dst, data1, data2, op, engine",
    "tensor_tensor_scan": "dst, data0, data1, initial, op0, op1, reverse0, reverse1",
    "scalar_tensor_tensor": "dst, data, op0, operand0, op1, operand1, reverse0, reverse1",
    "tensor_scalar": "dst, data, op0, operand0, reverse0, op1, operand1, reverse1, engine",
    "tensor_scalar_reduce": "dst, data, op0, operand0, reduce_op, reduce_res, reverse0, reduce_cmd, reduce_init, "
    "reduce_res_negate",
    "tensor_scalar_cumulative": "dst, src, op0, op1, imm0, imm1, reduce_cmd",
    "tensor_copy": "dst, src, engine",
    "tensor_copy_predicated": "dst, src, predicate, reverse_pred",
    "exponential": "dst, src, max_value, reduce_res, reduce_cmd, reduce_init",
    "reciprocal": "dst, data",
    "quantize_mx": "dst, src, dst_scale",
    "iota": "dst, pattern, offset, channel_multiplier",
    "dropout": "dst, data, prob",
    "affine_select": "dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op, offset",
    "range_select": "dst, on_true_tile, comp_op0, comp_op1, bound0, bound1, reduce_cmd, reduce_res, reduce_op, "
    "range_start, on_false_value",
    "select_reduce": "dst, predicate, on_true, on_false, reduce_res, reduce_cmd, reduce_op, reverse_pred",
    "sequence_bounds": "dst, segment_ids",
    "memset": "dst, value, engine",
    "bn_stats": "dst, data",
    "bn_aggr": "dst, data",
    "local_gather": "dst, src_buffer, index, num_elem_per_idx, num_valid_indices",
    "nc_n_gather": "dst, data, indices",
    "dma_copy": "dst, src, priority, oob_mode, dge_mode, engine",
    "dma_transpose": "dst, src, axes, priority, dge_mode, oob_mode",
    "dma_compute": "dst, srcs, reduce_op, scales, unique_indices, oob_mode",
    "max8": "dst, src",
    "nc_find_index8": "dst, data, vals",
    "nc_match_replace8": "dst, data, vals, imm, dst_idx",
    "nc_stream_shuffle": "dst, src, shuffle_mask",
    "register_alloc": "x",
    "register_load": "dst, src",
    "register_move": "dst, src",
    "register_store": "dst, src",
    "core_barrier": "data, cores, engine",
    "sendrecv": "src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine",
    "sendrecv_compute": "src, dst, send_to_rank, recv_from_rank, reduce_op",
    "rng": "dst, engine",
    "rand2": "dst, min, max",
    "rand_set_state": "src_seeds, engine",
    "rand_get_state": "dst, engine",
    "set_rng_seed": "src_seeds",
    "nonzero_with_count": "dst, src, index_offset, padding_val",
    "topk": "val_dst, idx_dst, src, n",
    "scalar_load": "src",
    "scalar_store": "dst, value",
    "get_nc_version": "",
    "get_nc_sub_version": "",
    **{
        n: None
        for n in (
            "engine",
            "reduce_cmd",
            "dge_mode",
            "oob_mode",
            "matmul_perf_mode",
            "dma_engine",
            "nc_version",
            "VirtualRegister",
            "NkiInstruction",
            "NkiScalar",
            "tensor_engine",
            "vector_engine",
            "scalar_engine",
            "gpsimd_engine",
            "unknown_engine",
        )
    },
}

# NKI 0.8: the cross-core module
LNC: dict[str, str | None] = {
    "core_barrier": "data, cores, engine",
    "sendrecv": "src, dst, send_to_rank, recv_from_rank, dma_engine, priority",
    "sendrecv_compute": "src, dst, send_to_rank, recv_from_rank, reduce_op, priority",
}

_ISA_SCALARS = "nki.isa.scalar_load/scalar_store"
# (module, name) -> (the first release that has it, the release that deprecates it, the release that removes it,
# the replacement). Entries not listed are in every release the emulator knows (0.6, 0.7, 0.8). Sources: the
# migration guides (0.6 -> 0.7), the 0.7 release notes, the 0.8 announcement "end of support for NKI
# VirtualRegister APIs and nki.isa LNC functions", the nki.lnc pages; the stub-only and latest-only entries
# are marked so in shared/NKI_API_AND_COSTS.md.
RELEASES: dict[tuple[str, str], tuple[str, str | None, str | None, str | None]] = {
    ("nki.language", "dynamic_range"): ("0.6", "0.6", "0.7", "nl.fori_loop"),
    **{("nki.language", n): ("0.7", None, None, None) for n in ("tiles", "blocks", "alloc_tiles", "alloc_blocks")},
    **{("nki.language", n): ("0.7", None, None, None) for n in ("NkiGrid", "NkiTileGrid", "NkiBlockGrid")},
    ("nki.language", "if_else"): ("0.8", None, None, None),
    **{("nki.isa", n): ("0.7", None, None, None) for n in ("scalar_load", "scalar_store", "NkiScalar")},
    **{("nki.isa", n): ("0.6", "0.8", None, _ISA_SCALARS) for n in ("register_load", "register_store")},
    ("nki.isa", "register_alloc"): ("0.6", "0.8", None, _ISA_SCALARS),
    ("nki.isa", "register_move"): ("0.6", "0.8", None, _ISA_SCALARS),
    ("nki.isa", "VirtualRegister"): ("0.6", "0.8", None, "nki.isa.NkiScalar"),
    ("nki.isa", "sendrecv"): ("0.6", "0.8", None, "nki.lnc.sendrecv"),
    ("nki.isa", "core_barrier"): ("0.6", "0.8", None, "nki.lnc.core_barrier"),
    ("nki.isa", "sendrecv_compute"): ("0.7", "0.8", None, "nki.lnc.sendrecv_compute"),
    **{("nki.lnc", n): ("0.8", None, None, None) for n in LNC},
}


# release-dependent rules of entries every release has
RELEASE_RULES: dict[tuple[str, str], str] = {
    ("nki.isa", "activation"): "`engine=` from 0.7",
    ("nki.isa", "local_gather"): "0.8: warns without `num_valid_indices`",
    ("nki.isa", "tensor_tensor"): "0.8: bit-vector operators on Vector only (enforced)",
    ("nki.isa", "tensor_scalar"): "0.8: bit-vector operators on Vector only (enforced)",
}


def releases(module: str, name: str) -> str:
    """The NKI releases that have an entry, as the API table shows it (e.g. ``0.6 only``, ``0.8+``)."""
    added, deprecated, removed, replacement = RELEASES.get((module, name), ("0.6", None, None, None))
    if removed:
        last = _before(removed)
        text = f"{added} only" if last == added else f"{added}-{last}"
    else:
        text = f"{added}+"
    if deprecated:
        text += f"; deprecated in {deprecated}" + (f": {replacement}" if replacement else "")
    rule = RELEASE_RULES.get((module, name))
    return f"{text}; {rule}" if rule else text


def _before(version: str) -> str:
    major, minor = version.split(".")
    return f"{major}.{int(minor) - 1}"


# What AWS's published tutorials and examples (docs tutorials, aws-neuron-sdk nki/examples, nki-samples'
# current-API tutorials) call: each must be implemented, not refused.
TUTORIAL_NAMES: dict[str, tuple[str, ...]] = {
    "language": (
        "ndarray",
        "zeros",
        "shared_hbm",
        "sbuf",
        "psum",
        "hbm",
        "load",
        "store",
        "copy",
        "matmul",
        "transpose",
        "exp",
        "add",
        "subtract",
        "multiply",
        "maximum",
        "rsqrt",
        "square",
        "sum",
        "max",
        "mean",
        "divide",
        "broadcast_to",
        "expand_dims",
        "ds",
        "tile_size",
        "program_id",
        "num_programs",
        "affine_range",
        "sequential_range",
        "static_range",
        "float32",
        "bfloat16",
        "fori_loop",
        "while_loop",
        "tiles",
        "blocks",
        "alloc_tiles",
        "alloc_blocks",
        "where",
        "softmax",
    ),
    "isa": (
        "nc_matmul",
        "nc_transpose",
        "activation",
        "activation_reduce",
        "tensor_tensor",
        "tensor_tensor_scan",
        "scalar_tensor_tensor",
        "tensor_scalar",
        "tensor_reduce",
        "tensor_copy",
        "dma_copy",
        "dma_transpose",
        "memset",
        "iota",
        "affine_select",
        "bn_stats",
        "bn_aggr",
        "reciprocal",
        "engine",
        "scalar_load",
        "scalar_store",
        "register_alloc",
        "register_load",
    ),
    "tile_size": (
        "pmax",
        "psum_bank_fmax",
        "gemm_stationary_fmax",
        "gemm_moving_fmax",
        "sbuf_fmax_bytes",
        "bn_stats_fmax",
    ),
    "tensor": ("ap", "permute", "reshape", "broadcast", "slice", "select", "expand_dim", "view"),
}


@dataclass(frozen=True)
class ApiState:
    """One documented entry: where it lives, its documented parameters, the emulator's state and a note."""

    module: str
    name: str
    params: str | None
    state: str  # "implemented" | "refused" | "missing"
    note: str = ""

    @property
    def releases(self) -> str:
        """The NKI releases that have it (:func:`releases`)."""
        return releases(self.module, self.name)


def _params_match(obj: Any, params: str) -> str:
    """'' when ``obj`` takes the documented parameters by name, in order (extras may follow), else why not."""
    want = [p.strip() for p in params.split(",") if p.strip()]
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "signature not inspectable"
    have = [p for p in sig.parameters if p not in ("self",)]
    pos = 0
    for w in want:
        if w not in have[pos:]:
            return f"parameter {w!r} missing or out of order (has {', '.join(have)})"
        pos = have.index(w, pos) + 1
    return ""


def _state(module: str, name: str, obj: Any, params: str | None, present: bool) -> ApiState:
    if not present:
        return ApiState(module, name, params, "missing")
    why = getattr(obj, "__nki_unsupported__", None)
    if why is not None:
        return ApiState(module, name, params, "refused", why)
    if params is not None and callable(obj):
        bad = _params_match(obj, params)
        if bad:
            return ApiState(module, name, params, "missing", bad)
    return ApiState(module, name, params, "implemented")


def api_states() -> list[ApiState]:
    """The emulator's state for every documented entry (nl, nl.tile_size, NkiTensor, nisa, nki.lnc)."""
    with warnings.catch_warnings():  # looking up a deprecated name (VirtualRegister) warns; this is no use of it
        warnings.simplefilter("ignore", DeprecationWarning)
        return _api_states()


def _api_states() -> list[ApiState]:
    from . import isa, language, lnc
    from .errors import NkiUnsupportedError
    from .tensors import NkiTensor

    out = []
    for name, params in LANGUAGE.items():
        out.append(_state("nki.language", name, getattr(language, name, None), params, hasattr(language, name)))
    for name in TILE_SIZE:
        try:
            getattr(language.tile_size, name)
            out.append(ApiState("nki.language.tile_size", name, None, "implemented"))
        except NkiUnsupportedError as e:
            out.append(ApiState("nki.language.tile_size", name, None, "refused", str(e).split(": ", 1)[-1]))
        except AttributeError:
            out.append(ApiState("nki.language.tile_size", name, None, "missing"))
    for name, params in TENSOR_METHODS.items():
        attr = inspect.getattr_static(NkiTensor, name, None)
        obj = getattr(NkiTensor, name, None) if attr is not None else None
        st = _state(
            "NkiTensor", name, obj if callable(obj) else None, params if callable(obj) else None, attr is not None
        )
        if name in ("indirect", "vector_select") and st.state == "implemented":
            st = ApiState("NkiTensor", name, params, "refused", "indirect addressing is not emulated")
        out.append(st)
    for name, params in ISA.items():
        out.append(_state("nki.isa", name, getattr(isa, name, None), params, hasattr(isa, name)))
    for name, params in LNC.items():
        out.append(_state("nki.lnc", name, getattr(lnc, name, None), params, hasattr(lnc, name)))
    return out
