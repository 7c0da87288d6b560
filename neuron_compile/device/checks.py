"""Value checks of graphs run on the ``neuron`` device (indices in range, integer divisors not zero,
torch.linalg's ``info``...: ``value_checks.py``), run at the device's next synchronization, as CUDA reports a
device-side assert.

Reading each check's value after its graph would move bytes and wait for the device at every call: a decode
step of a language model checks its token ids and its cache positions, so every token would cross a few
times. Instead the values stay on the device, with the checks, until the host next reads device data
(``.item()``, ``.cpu()``, ``print``...) or calls ``torch.neuron.synchronize()``: then one graph evaluates every
pending check's condition (``check.holds(value)``) on the device into a single flag, the flag (1 byte) is
read, and only when it is false are the values read and the checks run in order, raising the first one's
error (eager's type and message) with a note naming where its op ran and that it is reported late.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from . import context, onegraph

#: Pending checks are evaluated at the latest when this many have gathered (a loop that never reads a value).
MAX_PENDING = 64


@dataclass
class _Pending:
    check: Any
    value: torch.Tensor
    where: str


_PENDING: list[_Pending] = []
_LOCK = threading.RLock()
_RESOLVING = threading.local()


def defer(checks: list[Any], values: list[Any]) -> bool:
    """``value_checks.DEFERRED_CHECKS``: take ``checks`` when their values are on this device."""
    if not values or not all(isinstance(v, torch.Tensor) and v.device.type == "neuron" for v in values):
        return False
    from .onegraph import user_line

    where = user_line()
    with _LOCK:
        _PENDING.extend(_Pending(c, v, where) for c, v in zip(checks, values))
        full = len(_PENDING) >= MAX_PENDING
    if full:
        resolve()
    return True


def pending() -> int:
    return len(_PENDING)


def resolve() -> None:
    """Evaluate the pending checks (see the module docstring); raise the first failing one's error."""
    from . import lazy

    if not getattr(_RESOLVING, "active", False):
        lazy.flush()  # a synchronization: the recorded eager ops run (their graph's checks are resolved too)
    if not _PENDING or getattr(_RESOLVING, "active", False):
        return
    with _LOCK:
        batch = list(_PENDING)
        _PENDING.clear()
    if not batch:
        return
    _RESOLVING.active = True
    try:
        if _all_hold(batch):
            return
        for item in batch:  # the first failing check, in the order the graphs ran
            try:
                item.check(context.download(item.value))
            except Exception as error:
                error.add_note(
                    f"neuron device: this check of a graph that ran at {item.where} is reported at the next "
                    "synchronization (reading a value, or torch.neuron.synchronize()), as CUDA reports a "
                    "device-side assert"
                )
                raise
    finally:
        _RESOLVING.active = False


def _all_hold(batch: list[_Pending]) -> bool:
    """Every check's condition, evaluated on the device by one graph (one per set of checks), read as 1 byte."""
    checks = [item.check for item in batch]
    examples = [onegraph.example(item.value) for item in batch]
    key = (context.device().target.name, "checks", tuple(checks), tuple(examples))
    entry = onegraph.GRAPHS.get(key)
    if entry is None:
        with onegraph.GRAPHS_LOCK:

            def conditions(*values: torch.Tensor) -> tuple[torch.Tensor]:
                flags = [check.holds(v).reshape(1) for check, v in zip(checks, values)]
                return (torch.cat(flags).all(),)

            graph = onegraph.compile_one(onegraph.trace(conditions, examples), "checks", context.device().opts)
            entry = onegraph.GRAPHS.setdefault(key, onegraph.OpGraph(graph, 1))
    (flag,) = entry.graph([item.value for item in batch])
    return bool(context.download(flag).item())
