"""Which random numbers a model draws, and where: a compiled graph cannot be compared with eager after one.

Compiled random ops draw from the device's generator (``lowering/random.py``), eager ones from torch's
CPU generator: the same seed gives different numbers, so outputs that depend on a draw differ by the
randomness itself, not by a defect. ``evaluate`` runs dropout modules at p=0; any other draw (functional
dropout, stochastic depth, label dropout, noise drawn inside ``forward``) is found here, during one eager
step, by the op's ``nondeterministic_seeded`` tag, and named with its source line.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

T = TypeVar("T")

#: Arguments that, at zero (or False for ``train``), make a seeded op draw nothing: dropout in attention
#: and RNN kernels, ``bernoulli(p=0)``.
_NO_DRAW_WHEN_ZERO = ("dropout_p", "dropout", "p")
#: Frames in these are never the draw's line: torch's own and this package's (the recorder itself).
_OWN_DIRS = tuple(
    os.path.join(os.path.realpath(d), "")
    for d in (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
)


@dataclass(frozen=True)
class RandomDraw:
    """One random op the model called in eager, at the innermost source line outside torch."""

    op: str
    file: str
    line: int | None


def _draws(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    bound = {a.name: a.default_value for a in func._schema.arguments if a.has_default_value()}
    bound.update({a.name: v for a, v in zip(func._schema.arguments, args)}, **kwargs)
    if bound.get("train", True) is False:
        return False
    return not any(isinstance(bound.get(name), (int, float)) and bound[name] == 0 for name in _NO_DRAW_WHEN_ZERO)


def _caller() -> tuple[str, int | None]:
    frames = traceback.extract_stack()
    outside = [f for f in frames if not os.path.realpath(f.filename).startswith(_OWN_DIRS)]
    frame = outside[-1] if outside else frames[-1]
    return frame.filename, frame.lineno


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.draws: dict[tuple[str, str, int | None], RandomDraw] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.OpOverload) and _draws(func, args, kwargs):
            draw = RandomDraw(str(func), *_caller())
            self.draws.setdefault((draw.op, draw.file, draw.line), draw)
        return func(*args, **kwargs)


def random_draws(fn: Callable[[], T]) -> tuple[T, list[RandomDraw]]:
    """``fn()``'s result and the random draws it made (one entry per op and line, first-seen order)."""
    recorder = _Recorder()
    with recorder:
        result = fn()
    return result, list(recorder.draws.values())
