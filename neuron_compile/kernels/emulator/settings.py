"""What a kernel run enforces unless told otherwise, read from the environment: its step budget
(``NEURON_COMPILE_NKI_MAX_STEPS``) and the NKI release whose API it checks (``NEURON_COMPILE_NKI_VERSION``;
versions.py says what changes between releases)."""

from __future__ import annotations

import os
from typing import Any

from .errors import NkiError

#: Environment variable setting the default step budget of a kernel run (0: no limit).
MAX_STEPS_ENV = "NEURON_COMPILE_NKI_MAX_STEPS"
#: The default step budget: about 175 times the longest built-in kernel run of the tests and benchmarks (a
#: shape-only 8192x4096x1000 matmul, 11,392 steps). A loop issuing instructions reaches it after 20-45 s of
#: emulation (10-22 us an instruction), one issuing none after ~0.3 s.
DEFAULT_MAX_STEPS = 2_000_000


def max_steps_default() -> int:
    """The step budget of a kernel run: ``NEURON_COMPILE_NKI_MAX_STEPS`` if set (0 = no limit), else
    :data:`DEFAULT_MAX_STEPS`."""
    env = os.environ.get(MAX_STEPS_ENV, "").strip().replace("_", "")
    if not env:
        return DEFAULT_MAX_STEPS
    try:
        value = int(env)
    except ValueError:
        raise NkiError(f"{MAX_STEPS_ENV}={env!r} is not an integer (a step budget; 0 means no limit)") from None
    if value < 0:
        raise NkiError(f"{MAX_STEPS_ENV}={value} is negative (a step budget; 0 means no limit)")
    return value


#: The NKI releases the emulator knows, oldest first, and the Neuron SDK each shipped in (emulator/versions.py
#: says what changes between them).
VERSIONS: dict[str, str] = {"0.6": "Neuron 2.32", "0.7": "Neuron 2.33", "0.8": "Neuron 2.34"}
DEFAULT_VERSION = "0.8"
#: Environment variable naming the NKI version the emulator enforces (default :data:`DEFAULT_VERSION`).
VERSION_ENV = "NEURON_COMPILE_NKI_VERSION"


def check_version(value: Any, what: str = VERSION_ENV) -> str:
    """``value`` as one of :data:`VERSIONS` (``"0.8"``, ``0.8``, ``"0.8.0"`` are the same); else an error."""
    text = str(value).strip()
    parts = text.split(".")
    key = ".".join(parts[:2]) if len(parts) == 3 and parts[2] == "0" else text
    if key not in VERSIONS:
        raise NkiError(
            f"{what}={value!r} is not an NKI version the emulator enforces; use one of "
            + ", ".join(f"{v} ({sdk})" for v, sdk in VERSIONS.items())
        )
    return key


def version_default() -> str:
    """The version runs enforce unless told: ``NEURON_COMPILE_NKI_VERSION`` if set, else the newest."""
    env = os.environ.get(VERSION_ENV, "").strip()
    return check_version(env) if env else DEFAULT_VERSION
