"""Legality pass: refuse on every target what neuronx-cc would refuse. (Filled in by issue 4.)"""

from __future__ import annotations

from typing import Any

from .options import Options


def check(lowered: Any, opts: Options) -> Any:
    """Check the lowered module against what neuronx-cc accepts; returns a report (None: not checked)."""
    return None
