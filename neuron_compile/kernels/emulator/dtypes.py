"""NKI dtypes: canonical names for strings, NumPy/ml_dtypes and torch dtypes, their NumPy storage types, and
the rounding the engines apply when they write a value (:func:`cast`) or leave memory uninitialized
(:func:`fill_value`)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .errors import NkiError, NkiUnsupportedError


def _tf32_round(x: np.ndarray) -> np.ndarray:
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    b = (b + np.uint32(0xFFF) + ((b >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return b.view(np.float32)


_NP_DTYPES: dict[str, Any] = {
    "float32": np.float32,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
    "tfloat32": np.float32,
    "float8_e4m3": ml_dtypes.float8_e4m3,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
    "float8_e8m0fnu": ml_dtypes.float8_e8m0fnu,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "uint8": np.uint8,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "bool_": np.bool_,
}
_NP_TO_NAME = {np.dtype(v): k for k, v in _NP_DTYPES.items() if k != "tfloat32"}
_TORCH_NAMES = {
    "float": "float32",
    "half": "float16",
    "int": "int32",
    "short": "int16",
    "bool": "bool_",
    "float64": "float32",
    "double": "float32",
    "int64": "int32",
    "long": "int32",
}


def dtype_name(dtype: Any) -> str:
    """Canonical NKI dtype string for a string, NumPy/ml_dtypes dtype or torch dtype."""
    if isinstance(dtype, str):
        name = {"bool": "bool_", "float": "float32"}.get(dtype, dtype)
        if name in ("int64", "float8_e5m2_x4", "float8_e4m3fn_x4", "float4_e2m1fn_x4"):
            raise NkiUnsupportedError(
                f"NKI dtype {name} is not emulated for tensors (int64 exists only as an "
                "NkiScalar; the x4-packed MX types belong to nc_matmul_mx)"
            )
        if name in _NP_DTYPES:
            return name
        raise NkiError(f"unknown NKI dtype {dtype!r}; use one of {sorted(_NP_DTYPES)}")
    if type(dtype).__module__ == "torch":  # torch.dtype, without importing torch here
        name = str(dtype).removeprefix("torch.")
        name = _TORCH_NAMES.get(name, name)
        return dtype_name(name)
    try:
        return _NP_TO_NAME[np.dtype(dtype)]
    except (TypeError, KeyError):
        if np.dtype(dtype) == np.float64:
            return "float32"
        if np.dtype(dtype) == np.int64:
            return "int32"
        raise NkiError(f"unsupported dtype {dtype!r} for an NKI tensor") from None


def np_dtype(name: str) -> np.dtype:
    return np.dtype(_NP_DTYPES[name])


def itemsize(name: str) -> int:
    return np_dtype(name).itemsize


def is_float(name: str) -> bool:
    return name.startswith(("float", "bfloat", "tfloat"))


def cast(values: np.ndarray, name: str) -> np.ndarray:
    """Round fp32 values to dtype ``name`` the way the engines write them (RNE; ints saturate)."""
    if name == "tfloat32":
        return _tf32_round(values)
    dt = np_dtype(name)
    if is_float(name):
        return np.asarray(values).astype(dt)
    if name == "bool_":
        return np.asarray(values) != 0
    info = np.iinfo(dt)
    v = np.nan_to_num(np.rint(np.asarray(values, np.float64)), nan=0.0)
    return np.clip(v, info.min, info.max).astype(dt)


def fill_value(name: str) -> Any:
    """What new memory holds: NaN for floats, 4 for ints (as the NKI simulator does)."""
    return np.nan if is_float(name) else (True if name == "bool_" else 4)
