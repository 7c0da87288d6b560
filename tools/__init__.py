"""Developer tools (the OpInfo harness and sweep, the docs/ops.md generator), importable as ``tools.*``
from the repository root: run them with ``python -m tools.<name>``; pytest puts the root on the path
(``pythonpath`` in pyproject.toml)."""
