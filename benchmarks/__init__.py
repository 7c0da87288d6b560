"""Benchmarks, each a module run from the repository root: ``python -m benchmarks.<name> --help``. They measure;
the test suite only smoke-tests them (tests/test_benchmarks.py). Results, with dates and commands, are in
docs/benchmarks.md."""
