"""The NKI API for this package (public face: ``from neuron_compile import nki``, which re-exports this).

This is the ONE place that decides between the real ``nki`` package (AWS Neuron SDK) and the NumPy
emulator in :mod:`neuron_compile.kernels.emulator`. The real package is used when it is importable and
is the genuine article (it has ``nki.isa`` and ``nki.language``; the public index's placeholder does
not), unless ``NEURON_COMPILE_NKI=emulator`` forces the emulator. Kernels written against it use
``nki.jit``, ``nki.language`` (``nl``), ``nki.isa`` (``nisa``) and ``nki.simulate`` either way.

``EMULATED`` says which one is in use. The emulator adds ``infer_shapes`` (shape-only mode),
``last_run_stats`` and ``simulate(..., stats=True)``; with the real package those are absent.
``cache/key.py`` ``nki_version`` mirrors this decision from package metadata, without importing either,
for the neuron target's cache key.
"""

from __future__ import annotations

import os
from typing import Any


def _real_nki() -> Any | None:
    if os.environ.get("NEURON_COMPILE_NKI", "").lower() == "emulator":
        return None
    try:
        import nki as real  # the AWS package, not this module (absolute import)
        import nki.isa
        import nki.language
    except Exception:
        return None
    return real if hasattr(real, "jit") and hasattr(real, "simulate") else None


_real = _real_nki()

if _real is not None:
    EMULATED = False
    jit = _real.jit
    simulate = _real.simulate
    language = _real.language
    isa = _real.isa
    lnc = getattr(_real, "lnc", None)  # NKI 0.8+
    NkiError = getattr(_real.isa, "NkiValidationError", Exception)
    NkiValidationError = NkiError
else:
    EMULATED = True
    from .emulator import (
        Kernel,
        NkiBudgetError,
        NkiCapacityError,
        NkiDeadlockError,
        NkiError,
        NkiOutOfBoundsError,
        NkiTensor,
        NkiUndeclaredMutationError,
        NkiUnsupportedError,
        NkiValidationError,
        NkiVersionError,
        NkiWarning,
        RunStats,
        TensorSpec,
        infer_shapes,
        isa,
        jit,
        language,
        last_run_stats,
        lnc,
        simulate,
    )

if EMULATED:
    #: what kernels annotate dtypes with (``-> nki.dtype``): dtypes are strings here
    dtype = str

    def install_as_nki() -> None:
        """Make ``import nki`` (``nki.language``, ``nki.isa``, ``nki.isa.constants``, ``nki.lnc``) give the emulator
        in this process, so kernels written for the real package run unmodified (benchmarks/nki_samples.py).
        Refused where the real package is importable: it would shadow it."""
        import sys
        import types

        real = sys.modules.get("nki")
        if real is not None and real is not sys.modules[__name__]:
            raise NkiError("install_as_nki: a module named 'nki' is already imported; it would be shadowed")
        constants = types.ModuleType("nki.isa.constants", "The enums of nki.isa (the NKI library imports them here).")
        for name in ("engine", "reduce_cmd", "dge_mode", "oob_mode", "matmul_perf_mode", "dma_engine", "nc_version"):
            setattr(constants, name, getattr(isa, name))
        sys.modules.update(
            {
                "nki": sys.modules[__name__],
                "nki.language": language,
                "nki.isa": isa,
                "nki.isa.constants": constants,
                "nki.lnc": lnc,
            }
        )
        isa.constants = constants


__all__ = ["EMULATED", "NkiError", "NkiValidationError", "isa", "jit", "language", "lnc", "simulate"]
if EMULATED:  # the emulator's extras: shape-only mode, counters, its error and tensor types
    __all__ += [
        "Kernel", "NkiBudgetError", "NkiCapacityError", "NkiDeadlockError", "NkiOutOfBoundsError", "NkiTensor",
        "NkiUndeclaredMutationError", "NkiUnsupportedError", "NkiVersionError", "NkiWarning", "RunStats",
        "TensorSpec", "dtype", "infer_shapes", "install_as_nki", "last_run_stats",
    ]  # fmt: skip
