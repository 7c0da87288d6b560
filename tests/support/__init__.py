"""Test infrastructure shared by test modules and the developer commands of ``tools/``: the OpInfo harness
(``opinfo_harness``) and the exercise of every lowered overload alone (``exercise_overloads``). Here, not in
``tools/``, because tests import them; ``tools/`` holds the commands that run them over everything and write
the results files (``python -m tools.opinfo_sweep``, ``python -m tools.exercise_overloads``)."""
