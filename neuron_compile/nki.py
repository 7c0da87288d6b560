"""The NKI API: ``from neuron_compile import nki`` gives ``nki.jit``, ``nki.language``, ``nki.isa`` and
``nki.simulate`` — the real ``nki`` package where the AWS Neuron SDK is installed, else the NumPy emulator.
The choice is made in one place, ``kernels/nki_api.py``; this module only re-exports it.
"""

from __future__ import annotations

from .kernels.nki_api import *  # noqa: F403 - the public face of the NKI API
from .kernels.nki_api import __all__ as _api_all

__all__ = list(_api_all)
