"""Style, as ruff checks it (configured in pyproject.toml): lint, import order and formatting. Run
``python -m ruff format . && python -m ruff check --fix .`` to fix what it reports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"ruff {' '.join(command)} found problems:\n{done.stdout}{done.stderr}"
