"""``neuron-compile evaluate FILE.py:FACTORY [--json] [--steps N] [--timeout SECONDS] [--bisect [--bisect-mode M]
[--bisect-multiple X]]``.

``--bisect`` runs ``bisect.bisect`` instead of ``evaluate`` (``--bisect-mode``: ops, every aten op judged alone;
prefix; modules; docs/bisect.md), each phase bounded by ``--timeout``; exit status 0 when nothing is flagged, 1
otherwise.

FACTORY() returns ``(model, example_inputs)`` or ``(model, example_inputs, loss_fn)``. Exit status 0 when
every graph compiles for Trainium and the numerics pass, 1 otherwise (a report says why), 2 for a usage or
loading error (one line on stderr; under ``--json`` a JSON object ``{"ok": false, "error": ...}`` on stdout)
and for a model that returns no tensor (nothing to judge: the report says what it returned).
The command's options and its --help epilog are in ``neuron_compile/cli.py`` (``EVALUATE_EPILOG``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import re
import sys
import traceback
import types
from pathlib import Path
from typing import Any

#: The user's file is imported under this private package, never under its own stem: a factory file named
#: ``copy.py`` or ``statistics.py`` must not replace the standard library's module in ``sys.modules``.
USER_PACKAGE = "neuron_compile_evaluate_user"
_loaded = itertools.count()


class FactoryError(Exception):
    """FILE.py:FACTORY cannot be loaded or does not return what evaluate needs."""


class UsageError(Exception):
    """A command-line value evaluate cannot use."""


def _where(e: BaseException, path: Path) -> str:
    """``file.py:LINE: `` of the innermost frame in the user's file (or of a SyntaxError), else ''."""
    if isinstance(e, SyntaxError) and e.lineno and e.filename and Path(e.filename) == path:
        return f"{path.name}:{e.lineno}: "
    frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == path]
    return f"{path.name}:{frames[-1].lineno}: " if frames else ""


def _one_line(e: BaseException) -> str:
    if isinstance(e, SystemExit):
        return f"SystemExit({e.code!r}) (sys.exit() called)"
    if isinstance(e, SyntaxError):  # str(e) repeats the file's full path
        return f"{type(e).__name__}: {e.msg}" + (f" ({Path(e.filename).name}, line {e.lineno})" if e.filename else "")
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def _module_name(stem: str) -> str:
    if USER_PACKAGE not in sys.modules:  # a parent, so that pickle and dataclasses can find the module
        package = types.ModuleType(USER_PACKAGE, "Factory files loaded by neuron-compile evaluate.")
        package.__path__ = []
        sys.modules[USER_PACKAGE] = package
    safe = re.sub(r"\W", "_", stem)
    name = f"{USER_PACKAGE}.{safe}"
    return name if name not in sys.modules else f"{name}_{next(_loaded)}"


def load_factory(spec: str) -> tuple[Any, Any, Any]:
    """Import FILE.py, call FACTORY() and return (model, example_inputs, loss_fn or None).

    The file is imported under a private name (``neuron_compile_evaluate_user.<stem>``) and its directory
    is put first on ``sys.path``, as ``python FILE.py`` would, so that it can import its neighbours.
    Raises ``FactoryError`` naming the file or the factory and what is wrong."""
    import torch

    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name:
        raise FactoryError(f"expected FILE.py:FACTORY, got {spec!r}")
    path = Path(path_text).resolve()
    if not path.exists():
        raise FactoryError(f"{path_text}: no such file")
    if not path.is_file() or path.suffix != ".py":
        raise FactoryError(f"{path_text}: not a .py file" + (" (a directory)" if path.is_dir() else ""))
    module_spec = importlib.util.spec_from_file_location(_module_name(path.stem), path)
    if module_spec is None or module_spec.loader is None:
        raise FactoryError(f"{path_text}: cannot be imported as a Python module")
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))  # the factory file may import its neighbours
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        sys.modules.pop(module_spec.name, None)
        raise FactoryError(f"{_where(e, path) or path_text + ': '}importing it failed: {_one_line(e)}") from e
    factory = getattr(module, name, None)
    if not callable(factory):
        raise FactoryError(f"{path_text}: no function {name!r}")
    try:
        made = factory()
    except (Exception, SystemExit) as e:
        raise FactoryError(f"{_where(e, path) or path_text + ': '}{name}() raised {_one_line(e)}") from e
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise FactoryError(
            f"{path_text}: {name}() returned {type(made).__name__}; it must return (model, example_inputs) "
            "or (model, example_inputs, loss_fn)"
        )
    model, inputs, loss_fn = (*made, None) if len(made) == 2 else made
    if not isinstance(model, torch.nn.Module):
        raise FactoryError(
            f"{path_text}: {name}() returned a {type(model).__name__} as the model; it must be a torch.nn.Module"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise FactoryError(
            f"{path_text}: {name}() returned a {type(loss_fn).__name__} as loss_fn; it must be callable or None"
        )
    return model, inputs, loss_fn


def _check_usage(args: argparse.Namespace) -> None:
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: need at least 1 timed step")
    timeout = getattr(args, "timeout", None)
    if timeout is not None and not 0 < timeout < float("inf"):
        raise UsageError(f"--timeout {timeout}: need a finite number of seconds > 0")
    multiple = getattr(args, "bisect_multiple", None)
    if multiple is not None and not 1 <= multiple < float("inf"):
        raise UsageError(f"--bisect-multiple {multiple}: need a finite number >= 1")


def _fail(args: argparse.Namespace, message: str) -> int:
    print(f"neuron-compile evaluate: {message}", file=sys.stderr)
    if args.json:
        print(json.dumps({"ok": False, "factory": args.factory, "error": message, "exit_status": 2}, indent=2))
    return 2


def run(args: argparse.Namespace) -> int:
    from ..errors import NeuronOptionsError

    # The model's own prints go to stderr, so that stdout is the report alone (parseable with --json).
    with contextlib.redirect_stdout(sys.stderr):
        try:
            _check_usage(args)
            from ..options import Options

            Options.from_user(None)  # bad backend options in the environment: a usage error, before loading
            model, inputs, loss_fn = load_factory(args.factory)
        except (FactoryError, UsageError, NeuronOptionsError) as e:
            failed: str | None = str(e)
        else:
            failed = None
            if getattr(args, "bisect", False) or getattr(args, "bisect_mode", None):
                from .bisect import bisect

                report: Any = bisect(
                    model, inputs, loss_fn=loss_fn, method=getattr(args, "bisect_mode", None) or "ops",
                    multiple=args.bisect_multiple, phase_timeout=getattr(args, "timeout", None),
                )  # fmt: skip
            else:
                from . import evaluate

                report = evaluate(
                    model, inputs, loss_fn=loss_fn, steps=args.steps, phase_timeout=getattr(args, "timeout", None)
                )
    if failed is not None:
        return _fail(args, failed)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        print(report)
    if getattr(report, "nothing_to_judge", ""):
        print(f"neuron-compile evaluate: {report.nothing_to_judge}", file=sys.stderr)
        return 2
    return 0 if report.ok else 1
