"""Developer commands (the OpInfo sweep, the exercise of every overload alone, the docs/ops.md and NKI API
table generators), run from the repository root with ``python -m tools.<name>``; pytest puts the root on the
path (``pythonpath`` in pyproject.toml). What tests import too lives in ``tests/support/``."""
