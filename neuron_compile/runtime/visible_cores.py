"""``NEURON_RT_VISIBLE_CORES`` read as the Neuron runtime reads it, so that a value it would refuse is named
(the variable, the value, what is wrong) before ``nrt_init``, instead of the runtime's bare NRT_FAILURE.

The runtime's configuration guide: "a single NeuronCore index or an inclusive range value" (``3``, ``0-3``),
indices counted from 0 to the instance's logical core count - 1 (LNC: ``NEURON_LOGICAL_NC_CONFIG``); its
developer guide: a comma list of those is accepted when the cores are contiguous (``0,1`` or ``0-1,2``, not
``0,2``), in increasing order. The device simulator (tests/device_sim/libnrt_sim.c, ``read_core_config``)
follows the same rules. A value naming more cores than the instance has (``99``) is well formed: only the
runtime's total count can refuse it (``check_total``, where that count is known: ``neuron-compile doctor``).
"""

from __future__ import annotations

import os
import re
from typing import Mapping

from ..errors import NeuronRuntimeError

ENV = "NEURON_RT_VISIBLE_CORES"
_PART = re.compile(r"(\d+)(?:-(\d+))?")
_FORMS = "a NeuronCore index (3), an inclusive range (0-3), or a comma list of contiguous ones (0,1 or 0-1,2)"


class VisibleCoresError(NeuronRuntimeError):
    """``NEURON_RT_VISIBLE_CORES`` holds a value the runtime refuses (its ``nrt_init`` would fail)."""

    def __init__(self, value: str, why: str) -> None:
        super().__init__(
            f"neuron runtime: {ENV}={value!r} {why}. Set it to {_FORMS}, counted from 0 (`neuron-compile doctor` "
            "shows the cores this instance has), or unset it to take every core",
            -1,
            "nrt_init",
        )
        self.value = value


def parse(value: str) -> range:
    """The logical NeuronCores ``value`` names (a range: the runtime takes contiguous cores only). Raises
    ``VisibleCoresError`` for a value the runtime refuses, saying why."""
    text = value.strip()
    if not text:
        raise VisibleCoresError(value, "is empty")
    first = last = None
    parts = text.split(",")
    for part in parts[:-1] if len(parts) > 1 and not parts[-1].strip() else parts:  # "0,1," is taken as "0,1"
        m = _PART.fullmatch(part.strip())
        if m is None:
            raise VisibleCoresError(value, f"has {part.strip()!r}, which is neither a core index nor a range of them")
        lo = int(m.group(1))
        hi = lo if m.group(2) is None else int(m.group(2))
        if hi < lo:
            raise VisibleCoresError(value, f"has the range {lo}-{hi}, which runs backwards (write {hi}-{lo})")
        if last is not None and lo != last + 1:
            raise VisibleCoresError(
                value,
                f"names cores that are not contiguous and increasing ({last} then {lo}): the runtime takes one "
                "contiguous run of cores",
            )
        first = lo if first is None else first
        last = hi
    assert first is not None and last is not None
    return range(first, last + 1)


def from_environment(environ: Mapping[str, str] | None = None) -> range | None:
    """The cores ``NEURON_RT_VISIBLE_CORES`` names (None: unset or empty, every core); raises
    ``VisibleCoresError`` for a value the runtime refuses."""
    value = (os.environ if environ is None else environ).get(ENV, "")
    return parse(value) if value.strip() else None


def check_total(value: str, total: int, lnc: int | str) -> str | None:
    """Why the cores of ``value`` (a well-formed ``NEURON_RT_VISIBLE_CORES``) cannot be taken on an instance
    of ``total`` logical NeuronCores at LNC ``lnc``; None when they can."""
    cores = parse(value)
    if cores.stop <= total:
        return None
    have = f"cores 0-{total - 1}" if total > 1 else ("core 0" if total == 1 else "no core")
    return (
        f"{ENV}={value.strip()} names logical NeuronCore {cores.stop - 1}, but this instance has {total} "
        f"({have} at LNC {lnc}): name cores below {total}, or unset {ENV} to take every core"
    )
