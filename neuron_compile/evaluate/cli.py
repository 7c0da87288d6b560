"""``neuron-compile evaluate FILE.py:FACTORY [--json] [--steps N]``.

FACTORY() returns ``(model, example_inputs)`` or ``(model, example_inputs, loss_fn)``. Exit status 0 when
every graph compiles for Trainium and the numerics pass, 1 otherwise, 2 when the factory cannot be loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any


class FactoryError(Exception):
    """FILE.py:FACTORY cannot be loaded or does not return what evaluate needs."""


def load_factory(spec: str) -> tuple[Any, Any, Any]:
    """Import FILE.py, call FACTORY() and return (model, example_inputs, loss_fn or None)."""
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name:
        raise FactoryError(f"expected FILE.py:FACTORY, got {spec!r}")
    path = Path(path_text).resolve()
    if not path.is_file():
        raise FactoryError(f"{path_text}: no such file")
    sys.path.insert(0, str(path.parent))  # the factory file may import its neighbours
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[path.stem] = module
    module_spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise FactoryError(f"{path}: no function {name!r}")
    made = factory()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise FactoryError(
            f"{name}() returned {type(made).__name__}; it must return (model, example_inputs) or "
            "(model, example_inputs, loss_fn)"
        )
    model, inputs, loss_fn = (*made, None) if len(made) == 2 else made
    return model, inputs, loss_fn


def run(args: argparse.Namespace) -> int:
    # The model's own prints go to stderr, so that stdout is the report alone (parseable with --json).
    with contextlib.redirect_stdout(sys.stderr):
        try:
            model, inputs, loss_fn = load_factory(args.factory)
        except FactoryError as e:
            print(f"neuron-compile evaluate: {e}", file=sys.stderr)
            return 2
        from . import evaluate

        report = evaluate(model, inputs, loss_fn=loss_fn, steps=args.steps)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        print(report)
    return 0 if report.ok else 1
