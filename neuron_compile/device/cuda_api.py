"""What ``torch.neuron`` answers that ``torch.cuda`` users read: memory statistics, the device's name and
properties (``NeuronModule`` in ``__init__.py`` calls these).

Memory: the device counts the bytes of the live buffers of each logical core (``storage.account``) and caches
nothing (a freed tensor's buffer is freed at once), so "reserved" (what CUDA's caching allocator holds) is
"allocated", and ``empty_cache()`` has nothing to give back. The limit is ``context.device().memory_limit``
(option ``device_memory_limit``, else what the Neuron runtime reports for the core, else the target's HBM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def index(device: Any) -> int:
    from . import context

    return context.index_of(device)


def allocated(device: Any = None) -> int:
    """Bytes held by tensors of the core; the lazy mode's recorded ops run first (they allocate their results)."""
    from . import context, storage

    context.settle()
    return storage.account(index(device)).allocated


def peak(device: Any = None) -> int:
    from . import context, storage

    context.settle()
    return storage.account(index(device)).peak


def limit() -> int:
    from . import context

    return context.device().memory_limit


def memory_stats(device: Any = None) -> dict[str, int]:
    """CUDA's ``memory_stats`` keys that the device can fill truthfully: ``{allocated,reserved,active,requested}
    _bytes.all.{current,peak}`` (all four the same counts: nothing cached, nothing rounded up), and
    ``num_alloc_retries`` (0: there is no cache to flush and retry). Counts CUDA keeps that the device does not
    (cumulative ``.allocated``/``.freed`` bytes, per-pool ``small_pool``/``large_pool``, ``num_ooms``) are absent,
    not made up."""
    current, high = allocated(device), peak(device)
    stats: dict[str, int] = {}
    for kind in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes"):
        stats[f"{kind}.all.current"] = current
        stats[f"{kind}.all.peak"] = high
    stats["num_alloc_retries"] = 0
    return dict(sorted(stats.items()))


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the logical core: the memory limit minus what tensors hold, and the limit."""
    total = limit()
    return max(total - allocated(device), 0), total


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    from ..options import human_size

    i = index(device)
    current, high = allocated(i), peak(i)
    total = limit()
    rows = [
        ("Allocated memory (= reserved: nothing is cached)", current, high),
        ("Memory limit of the core", total, total),
        ("Free", max(total - current, 0), max(total - high, 0)),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [
        f"neuron:{i} memory summary ({device_name(i)})",
        f"{'':{width}}  {'current':>12}  {'peak':>12}",
    ]
    lines += [f"{name:{width}}  {human_size(cur):>12}  {human_size(pk):>12}" for name, cur, pk in rows]
    return "\n".join(lines) + "\n"


_GENERATION_NAMES = {"trn2": "Trainium2", "trn3": "Trainium3"}


def device_name(device: Any = None) -> str:
    """``Trainium2 NeuronCore (LNC=2)``; ``(CPU target)`` when the device's buffers are host memory."""
    from . import context

    dev = context.device()
    generation = _GENERATION_NAMES.get(dev.opts.generation, dev.opts.generation)
    where = "CPU target" if dev.target.name != "neuron" else f"LNC={dev.opts.lnc}"
    return f"{generation} NeuronCore ({where})"


def capability(device: Any = None) -> tuple[int, int]:
    """(generation, 0): (2, 0) on Trn2, (3, 0) on Trn3. Not comparable with CUDA compute capabilities: code
    that gates a feature on ``get_device_capability() >= (8, 0)`` means an NVIDIA GPU."""
    from . import context

    generation = context.device().opts.generation
    digits = "".join(c for c in generation if c.isdigit())
    return (int(digits) if digits else 0, 0)


@dataclass(frozen=True)
class NeuronDeviceProperties:
    """``torch.neuron.get_device_properties()``: what ``torch.cuda``'s has that applies (name, total_memory,
    major/minor: :func:`capability`), and the logical core's size (``lnc``) and the target."""

    name: str
    total_memory: int
    major: int
    minor: int
    lnc: int
    target: str
    type: str = "neuron"

    def __repr__(self) -> str:
        from ..options import human_size

        return (
            f"_NeuronDeviceProperties(name='{self.name}', total_memory={human_size(self.total_memory)}, "
            f"major={self.major}, minor={self.minor}, lnc={self.lnc}, target='{self.target}')"
        )


def device_properties(device: Any = None) -> NeuronDeviceProperties:
    from . import context

    dev = context.device()
    major, minor = capability(device)
    return NeuronDeviceProperties(device_name(device), limit(), major, minor, dev.opts.lnc, dev.target.name)


class AmpNamespace:
    """``torch.neuron.amp``, as ``torch.cuda.amp`` (deprecated there too: prefer ``torch.autocast("neuron")``
    and ``torch.amp.GradScaler("neuron")``)."""

    @staticmethod
    def autocast(enabled: bool = True, dtype: torch.dtype = torch.bfloat16, cache_enabled: bool = True) -> Any:
        return torch.autocast("neuron", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    @staticmethod
    def GradScaler(*args: Any, **kwargs: Any) -> torch.amp.GradScaler:
        return torch.amp.GradScaler("neuron", *args, **kwargs)
