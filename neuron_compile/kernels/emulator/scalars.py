"""Run-time scalars: :class:`NkiScalar`, an int32/int64 register value evaluated at once (NKI traces it)."""

from __future__ import annotations

import warnings
from typing import Any

from .errors import NkiError, NkiValidationError
from .run import current_run

_I32 = 1 << 32


def _wrap32(v: int) -> int:
    return (v + (1 << 31)) % _I32 - (1 << 31)


class NkiScalar:
    """A run-time integer (NKI 0.7 ``NkiScalar``; also stands in for 0.6's ``VirtualRegister``).

    Arithmetic on it is traced in NKI; here it is evaluated (32-bit values wrap, as documented). It cannot
    steer Python control flow or index with ``[...]``: use ``nl.if_else``/``nl.while_loop`` and
    ``.ap(scalar_offset=...)``/``.select(dim, scalar)``, as on the device.
    """

    __slots__ = ("_v", "dtype")

    def __init__(self, value: int = 0, dtype: str = "int32"):
        self.dtype = dtype
        self._v = _wrap32(int(value)) if dtype != "int64" else int(value)

    def nki_scalar_value(self) -> int:
        return self._v

    def _bin(self, other: Any, fn: Any, reverse: bool = False, allowed64: bool = True) -> NkiScalar:
        o = other._v if isinstance(other, NkiScalar) else int(other)
        if self.dtype == "int64" and not allowed64:
            raise NkiValidationError("int64 NkiScalar supports only +, - and * (NKI 0.7 docs)")
        a, b = (o, self._v) if reverse else (self._v, o)
        dt = "int64" if "int64" in (self.dtype, getattr(other, "dtype", "")) else self.dtype
        return NkiScalar(fn(a, b), dt)

    def __add__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a + b)

    def __radd__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a + b, True)

    def __sub__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a - b)

    def __rsub__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a - b, True)

    def __mul__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a * b)

    def __rmul__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a * b, True)

    def __floordiv__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a // b, allowed64=False)

    def __mod__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a % b, allowed64=False)

    def __and__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a & b, allowed64=False)

    def __or__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a | b, allowed64=False)

    def __xor__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a ^ b, allowed64=False)

    def __lshift__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a << b, allowed64=False)

    def __rshift__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: a >> b, allowed64=False)

    def __lt__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: int(a < b))

    def __le__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: int(a <= b))

    def __gt__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: int(a > b))

    def __ge__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: int(a >= b))

    def __eq__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: int(a == b))

    def __ne__(self, o: Any) -> NkiScalar:
        return self._bin(o, lambda a, b: int(a != b))

    def __neg__(self) -> NkiScalar:
        return NkiScalar(-self._v, self.dtype)

    __hash__ = object.__hash__

    def __bool__(self) -> bool:
        if current_run().nki_version == "0.6":  # 0.6 still ran bare `while reg:` loops (deprecated; gone in 0.7)
            warnings.warn(
                "a bare `while reg:` loop on a register is deprecated in NKI 0.6 (Neuron 2.32) and removed in 0.7; "
                "use nl.while_loop",
                DeprecationWarning,
                stacklevel=2,
            )
            return self._v != 0
        raise NkiError(
            "an NkiScalar is a run-time value: it cannot decide a Python `if`/`while` at trace time; "
            "use nl.if_else / nl.while_loop (bare `while reg:` loops were removed in NKI 0.7)"
        )

    def __index__(self) -> int:
        raise NkiError(
            "an NkiScalar is a run-time value: it cannot index with [...]; use "
            "tensor.ap(..., scalar_offset=s) or tensor.select(dim, s)"
        )

    def __repr__(self) -> str:
        return f"NkiScalar({self._v}, {self.dtype})"
