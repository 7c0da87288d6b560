"""Which NKI release the emulator enforces: 0.6 (Neuron 2.32), 0.7 (2.33) or 0.8 (2.34, the default).

A run takes its version from ``nki.simulate(kernel, nki_version=...)`` / ``nki.infer_shapes(...)``, else the
environment variable ``NEURON_COMPILE_NKI_VERSION``, else :data:`DEFAULT_VERSION`, so a kernel can be checked
against the SDK its author runs. What changes between them (the sources are the release notes, the migration
guides and the announcements of each release; docs/nki.md's API table has a version column):

* 0.7 removed ``nl.dynamic_range`` and bare ``while reg:`` loops (deprecated in 0.6) and added ``NkiScalar``
  with ``nisa.scalar_load``/``scalar_store``, the tile/block grids (``nl.tiles``, ``nl.blocks``,
  ``nl.alloc_tiles``, ``nl.alloc_blocks``) and ``activation(engine=)``.
* 0.8 added ``nki.lnc`` (``sendrecv``, ``sendrecv_compute``, ``core_barrier``; no ``pipe_id``; a DMA
  ``priority`` 0-3) and deprecated the ``nki.isa`` versions of those three and the virtual registers
  (``register_alloc/move/load/store``, ``VirtualRegister``) in favour of ``scalar_load``/``scalar_store``:
  each still runs, with a :class:`DeprecationWarning` naming its replacement. ``local_gather`` without
  ``num_valid_indices`` warns (its result is undefined from 0.8). Neuron 2.34 removed the legacy
  ``neuronxcc.nki`` namespace from neuronx-cc.
* Bit-vector operators (``bitwise_and`` ...) run on the Vector engine only: every release documents the rule
  on ``tensor_scalar``; 0.8 announces that a later release rejects ``engine=gpsimd`` for ``tensor_tensor``
  and ``engine=scalar``/``gpsimd`` for ``tensor_scalar``. The emulator enforces the rule from 0.8 on (an
  error naming it) and accepts those engines under 0.6/0.7, as those releases did.
"""

from __future__ import annotations

import os
import sys
import warnings

from .errors import NkiError, NkiValidationError
from .run import current_run
from .settings import DEFAULT_VERSION, VERSION_ENV, VERSIONS, check_version, version_default

__all__ = [
    "DEFAULT_VERSION",
    "VERSIONS",
    "VERSION_ENV",
    "NkiVersionError",
    "NkiWarning",
    "check_version",
    "version_default",
]

_EMULATOR_DIR = os.path.dirname(os.path.abspath(__file__))


class NkiVersionError(NkiError):
    """The kernel uses an API that the NKI version the run enforces does not have (added later or removed);
    the message names the API, the version it appeared in or left, and how to pick another version."""


def _key(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("."))


def enforced() -> str:
    """The NKI version of the run executing now."""
    return current_run().nki_version


def at_least(version: str) -> bool:
    return _key(enforced()) >= _key(version)


def _how_to_switch() -> str:
    return f"pick the version with nki.simulate(kernel, nki_version=...) or {VERSION_ENV}"


def require(api: str, added: str) -> None:
    """Raise :class:`NkiVersionError` when the run enforces a release older than ``added``."""
    if not at_least(added):
        raise NkiVersionError(
            f"{api} is new in NKI {added} ({VERSIONS[added]}); this run enforces NKI {enforced()} "
            f"({VERSIONS[enforced()]}), which does not have it ({_how_to_switch()})"
        )


def removed(api: str, version: str, replacement: str) -> None:
    """Raise :class:`NkiVersionError` when the run enforces ``version`` or later, where ``api`` is gone."""
    if at_least(version):
        raise NkiVersionError(
            f"{api} was removed in NKI {version} ({VERSIONS[version]}); use {replacement} "
            f"(this run enforces NKI {enforced()}; {_how_to_switch()})"
        )


def kernel_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside the emulator (the kernel's line)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _EMULATOR_DIR:
        frame = frame.f_back
        level += 1
    return level


def call_site() -> str:
    """``file:line (function)`` of the kernel code that called into the emulator."""
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _EMULATOR_DIR:
        frame = frame.f_back
    if frame is None:
        return "(unknown)"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def deprecated(api: str, replacement: str, since: str = "0.8") -> None:
    """A :class:`DeprecationWarning` at the kernel's call site when the run enforces ``since`` or later: one per
    call site and kernel run (a loop, or the two programs of an LNC-2 launch, do not repeat it)."""
    if not at_least(since):
        return
    run = current_run()
    level = kernel_stacklevel()
    frame = sys._getframe(level - 1)
    key = (api, frame.f_code.co_filename, frame.f_lineno)
    if key in run.warned:
        return
    run.warned.add(key)
    warnings.warn(
        f"{api} is deprecated in NKI {since} ({VERSIONS[since]}) and will be removed; use {replacement}",
        DeprecationWarning,
        stacklevel=level,
    )


class NkiWarning(UserWarning):
    """A kernel relies on behaviour the NKI release the run enforces leaves undefined or is about to change."""


def warn(message: str) -> None:
    """An :class:`NkiWarning` at the kernel's call site, once per call site and kernel run."""
    run = current_run()
    level = kernel_stacklevel()
    frame = sys._getframe(level - 1)
    key = (message, frame.f_code.co_filename, frame.f_lineno)
    if key not in run.warned:
        run.warned.add(key)
        warnings.warn(message, NkiWarning, stacklevel=level)


def bitvec_engine_rule(op: str, operator: str, engine: str, allowed: tuple[str, ...]) -> None:
    """Refuse a bit-vector ``operator`` on a non-Vector ``engine`` when the run enforces 0.8 or later."""
    if engine != "vector" and engine in allowed and at_least("0.8"):
        raise NkiValidationError(
            f"nisa.{op}: bit-vector operator {operator} on the {engine} engine: bit-vector operators run on the "
            "Vector engine only (the nisa.tensor_scalar rule; NKI 0.8 announces that a later release rejects "
            f"{' and '.join(f'engine={e}' for e in allowed if e != 'vector')} for nisa.{op} with a bitvec "
            "operator). Pass engine=nki.isa.engine.vector or remove the engine argument "
            f"(NKI {enforced()} enforced; NKI 0.7 accepted it)"
        )
