"""The errors the NKI emulator raises (every one an :class:`NkiError`, itself a ``NeuronCompileError``), and
:func:`unsupported`, the stand-in for a documented NKI API the emulator refuses."""

from __future__ import annotations

from typing import Any

from ...errors import NeuronCompileError


class NkiError(NeuronCompileError):
    """Base of every error the NKI emulator raises (a kernel broke an API or hardware rule)."""


class NkiValidationError(NkiError):
    """A hardware rule was broken: partition/free-size limits, operand buffers, dtypes, capacity."""


class NkiCapacityError(NkiValidationError):
    """Live SBUF or PSUM allocations exceed the generation's capacity."""


class NkiOutOfBoundsError(NkiValidationError):
    """An index or slice reaches outside the tensor (the hardware would access other memory)."""


class NkiUnsupportedError(NkiError):
    """A documented NKI function or argument the emulator does not implement (the message names it)."""


class NkiBudgetError(NkiError):
    """A kernel run took more steps (instructions issued plus iterations of ``nl`` loops) than its budget:
    most likely an endless loop. The message names the kernel, the budget and how to raise it."""


class NkiUndeclaredMutationError(NkiError):
    """An ``nki_op``'s kernel wrote an argument of the op that ``mutates_args`` does not declare."""


def unsupported(qualname: str, why: str = "") -> Any:
    """A stand-in for a documented NKI API the emulator refuses: calling it raises NkiUnsupportedError."""

    def refused(*_: Any, **__: Any) -> Any:
        raise NkiUnsupportedError(
            f"{qualname} is documented NKI but not implemented by the neuron_compile emulator"
            + (f" ({why})" if why else "")
            + "; see docs/nki.md, 'API coverage'"
        )

    refused.__name__ = qualname.rsplit(".", 1)[-1]
    refused.__qualname__ = qualname
    refused.__nki_unsupported__ = why or "not implemented"
    refused.__doc__ = f"Refused: {qualname} raises NkiUnsupportedError here ({why or 'not implemented'})."
    return refused
