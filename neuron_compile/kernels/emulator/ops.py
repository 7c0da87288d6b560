"""The math behind NKI op identifiers (``nl.exp``, ``nl.add``, ...), on fp32 NumPy arrays.

An ISA instruction takes its operator as an argument (``nisa.activation(dst, op=nl.exp, ...)``); the same
objects are the ``nl.*`` wrappers. Every engine computes in fp32 and rounds when it writes ``dst``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import NkiError

_F = np.float32


def _erf(x: np.ndarray) -> np.ndarray:
    # scipy (~0.5 s to import) on first use: the SDPA rewrite asks the attention kernel's shape predicate
    # on every compile, cache hits included, and that must not pay for it.
    from scipy import special

    return special.erf(x).astype(_F)


def _gelu(x: np.ndarray) -> np.ndarray:
    return (0.5 * x * (1.0 + _erf(x / np.sqrt(2.0)))).astype(_F)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return (0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))).astype(_F)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    from scipy import special

    return special.expit(x).astype(_F)


def _gelu_dx(x: np.ndarray) -> np.ndarray:
    cdf = 0.5 * (1.0 + _erf(x / np.sqrt(2.0)))
    return (cdf + x * np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi)).astype(_F)


def _silu_dx(x: np.ndarray) -> np.ndarray:
    s = _sigmoid(x)
    return (s * (1 + x * (1 - s))).astype(_F)


def _gelu_sig(x: np.ndarray) -> np.ndarray:
    return (x * _sigmoid(1.702 * x)).astype(_F)


def _gelu_sig_dx(x: np.ndarray) -> np.ndarray:
    s = _sigmoid(1.702 * x)
    return (s + 1.702 * x * s * (1 - s)).astype(_F)


def _ibits(fn: Callable[..., Any]) -> Callable[..., np.ndarray]:
    """Bitwise ops act on the integer bits (int32 here), returned as fp32 values like every engine result."""
    return lambda *a: fn(*(np.asarray(v).astype(np.int64).astype(np.int32) for v in a)).astype(_F)


UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "tan": np.tan,
    "gelu_dx": _gelu_dx,
    "silu_dx": _silu_dx,
    "gelu_apprx_sigmoid": _gelu_sig,
    "gelu_apprx_sigmoid_dx": _gelu_sig_dx,
    "erf_dx": lambda x: (2 / np.sqrt(np.pi) * np.exp(-x * x)).astype(_F),
    "invert": _ibits(np.invert),
    "bypass": lambda x: x,
    "copy": lambda x: x,
    "identity": lambda x: x,
    "square": np.square,
    "sigmoid": _sigmoid,
    "relu": lambda x: np.maximum(x, 0),
    "gelu": _gelu,
    "gelu_apprx_tanh": _gelu_tanh,
    "silu": lambda x: x * _sigmoid(x),
    "tanh": np.tanh,
    "softplus": lambda x: np.logaddexp(0, x).astype(_F),
    "erf": _erf,
    "exp": np.exp,
    "log": np.log,
    "sin": np.sin,
    "cos": np.cos,
    "arctan": np.arctan,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x),
    "reciprocal": lambda x: 1 / x,
    "sign": np.sign,
    "abs": np.abs,
    "negative": np.negative,
    "mish": lambda x: x * np.tanh(np.logaddexp(0, x)),
    "floor": np.floor,
    "ceil": np.ceil,
    "trunc": np.trunc,
    "logical_not": lambda x: (x == 0).astype(_F),
}

BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "divide": np.divide,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "power": np.power,
    "mod": np.fmod,
    "equal": lambda a, b: (a == b).astype(_F),
    "not_equal": lambda a, b: (a != b).astype(_F),
    "greater": lambda a, b: (a > b).astype(_F),
    "greater_equal": lambda a, b: (a >= b).astype(_F),
    "less": lambda a, b: (a < b).astype(_F),
    "less_equal": lambda a, b: (a <= b).astype(_F),
    "logical_and": lambda a, b: ((a != 0) & (b != 0)).astype(_F),
    "logical_or": lambda a, b: ((a != 0) | (b != 0)).astype(_F),
    "logical_xor": lambda a, b: ((a != 0) ^ (b != 0)).astype(_F),
    "abs_max": lambda a, b: np.maximum(np.abs(a), np.abs(b)),
    "abs_min": lambda a, b: np.minimum(np.abs(a), np.abs(b)),
    "fmod": np.fmod,
    "bitwise_and": _ibits(np.bitwise_and),
    "bitwise_or": _ibits(np.bitwise_or),
    "bitwise_xor": _ibits(np.bitwise_xor),
    "left_shift": _ibits(np.left_shift),
    "right_shift": _ibits(np.right_shift),
    "bypass": lambda a, b: a,
}

REDUCE: dict[str, Callable[..., np.ndarray]] = {
    "add": np.sum,
    "sum": np.sum,
    "maximum": np.max,
    "max": np.max,
    "minimum": np.min,
    "min": np.min,
    "multiply": np.prod,
    "prod": np.prod,
    "abs_max": lambda x, **k: np.max(np.abs(x), **k),
    "bitwise_and": lambda x, **k: np.bitwise_and.reduce(x.astype(np.int32), **k).astype(_F),
    "bitwise_or": lambda x, **k: np.bitwise_or.reduce(x.astype(np.int32), **k).astype(_F),
}

_NP_NAMES = {"amax": "max", "amin": "min", "true_divide": "divide"}


def op_name(op: Any) -> str:
    """Name of an op identifier: an ``nl`` op object, a NumPy ufunc/function, or a string."""
    if isinstance(op, str):
        return op
    name = getattr(op, "nki_name", None) or getattr(op, "__name__", None)
    if name is None:
        raise NkiError(f"{op!r} is not an NKI operator; pass e.g. nl.add, nl.exp, nl.maximum")
    return _NP_NAMES.get(name, name)


def unary(op: Any, where: str) -> Callable[[np.ndarray], np.ndarray]:
    name = op_name(op)
    if name not in UNARY:
        raise NkiError(f"{where}: {name!r} is not an activation function; use one of {sorted(UNARY)}")
    return UNARY[name]


def binary(op: Any, where: str) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    name = op_name(op)
    if name not in BINARY:
        raise NkiError(f"{where}: {name!r} is not a binary ALU op; use one of {sorted(BINARY)}")
    return BINARY[name]


def reduce(op: Any, where: str) -> Callable[..., np.ndarray]:
    name = op_name(op)
    if name not in REDUCE:
        raise NkiError(f"{where}: {name!r} is not a reduction op; use nl.add, nl.maximum, nl.minimum or nl.multiply")
    return REDUCE[name]
