"""``import neuronxcc.nki`` where neuronx-cc has no ``nki`` (Neuron 2.34 removed it) or is not installed: the
import fails with the migration message instead of a bare "No module named 'neuronxcc'".

A finder appended to ``sys.meta_path`` (so every real installation is found first) answers only for
``neuronxcc.nki`` and its submodules, and for ``neuronxcc`` itself while a statement importing
``neuronxcc.nki`` (``import neuronxcc.nki.language as nl``, ``from neuronxcc import nki``) is being executed.
Any other lookup of ``neuronxcc`` (``importlib.util.find_spec("neuronxcc")``, ``import neuronxcc``) gets the
usual answer. The message follows the NKI version the emulator enforces (emulator/versions.py).
"""

from __future__ import annotations

import dis
import importlib.abc
import importlib.machinery
import sys
from types import FrameType
from typing import Any

from .versions import VERSIONS, version_default

_LEGACY = "neuronxcc.nki"


def migration_message(fullname: str) -> str:
    """Why ``fullname`` (``neuronxcc`` or a ``neuronxcc.nki`` module) cannot be imported, and what to use."""
    version = version_default()
    use = (
        "import the standalone package instead (`import nki`, `import nki.language as nl`, `import nki.isa as "
        "nisa`; here `from neuron_compile import nki`) and move the kernel to the current API: every nisa call "
        "takes dst first, no masks, nl.arange/nl.mgrid or nl.par_dim, outputs in nl.shared_hbm (the NKI "
        "migration guides; docs/nki.md)"
    )
    if version >= "0.8":
        why = f"the {_LEGACY} namespace was removed from neuronx-cc in Neuron 2.34 (NKI 0.8)"
    else:
        why = (
            f"{_LEGACY} is the legacy NKI namespace: {VERSIONS[version]} (NKI {version}) still ships it inside "
            "neuronx-cc, but using it inside a kernel is a compile error since Neuron 2.28, and the emulator "
            "implements only the current API"
        )
    return f"No module named {fullname!r}: {why}; {use}"


class _Refuse(importlib.abc.Loader):
    def __init__(self, fullname: str):
        self.fullname = fullname

    def create_module(self, spec: Any) -> Any:
        raise ModuleNotFoundError(migration_message(self.fullname), name=self.fullname)

    def exec_module(self, module: Any) -> None:  # never reached: create_module raises
        raise ModuleNotFoundError(migration_message(self.fullname), name=self.fullname)


def _is_legacy(name: Any) -> bool:
    return isinstance(name, str) and (name == _LEGACY or name.startswith(_LEGACY + "."))


def _statement_imports_nki(frame: FrameType) -> bool:
    """True when ``frame`` is executing ``from neuronxcc import nki`` (IMPORT_NAME with 'nki' in its fromlist)."""
    prev = None
    for ins in dis.get_instructions(frame.f_code):
        if ins.offset == frame.f_lasti:
            if ins.opname != "IMPORT_NAME" or ins.argval != "neuronxcc":
                return False
            return prev is not None and prev.opname == "LOAD_CONST" and "nki" in (prev.argval or ())
        prev = ins
    return False


def _importing_legacy_nki() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            if _is_legacy(frame.f_locals.get("name")):
                return True
        elif frame.f_code.co_filename != __file__:
            return _statement_imports_nki(frame)
        frame = frame.f_back
    return False


class LegacyNkiFinder(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: turns a failed ``neuronxcc.nki`` import into the migration error."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if _is_legacy(fullname) or (fullname == "neuronxcc" and _importing_legacy_nki()):
            return importlib.machinery.ModuleSpec(fullname, _Refuse(fullname))
        return None


def install() -> None:
    """Append the finder to ``sys.meta_path`` once per process."""
    if not any(isinstance(f, LegacyNkiFinder) for f in sys.meta_path):
        sys.meta_path.append(LegacyNkiFinder())
