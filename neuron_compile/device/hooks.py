"""What PyTorch asks the ``neuron`` device outside its ops: the PrivateUse1 hooks, the device guard, and the
device allocator's statistics, in C++ (``_native.cpp``, built at the first registration with
``torch.utils.cpp_extension`` and cached by torch as any extension, about a minute once per machine).

Why C++: torch's Python bindings for a Python backend (``torch._C._acc``) let Python answer only
``is_available``/``is_built``/``has_primary_context`` and the guard's ``type_``, and their guard calls Python
from ``noexcept`` stream methods, which abort the process when a backward hook raises (the hook's exception is
still set while the autograd engine's stream guard unwinds, so the call into Python fails inside a ``noexcept``
function). What each answer is, and why:

- guard: one default stream per device and no-op events (every execution is synchronous); the current
  device per thread, as CUDA's; ``synchronizeDevice`` (``torch.accelerator.synchronize``) calls
  ``torch.neuron.synchronize``, which reports a failed deferred value check.
- hooks ``deviceCount``: ``torch.neuron.device_count()``, so ``torch.accelerator`` and the autograd engine's
  device threads see the device; ``hasPrimaryContext``: true, nothing to initialize.
- hooks ``getPinnedMemoryAllocator``/``isPinnedPtr``: host memory is what the device copies from, so a pinned
  tensor is an ordinary CPU tensor whose allocation is remembered (``is_pinned()`` is true for it).
- hooks ``getDefaultGenerator``/``getNewGenerator``: a CPU mt19937 generator labelled with the device, so
  ``torch.Generator("neuron")`` can be made, seeded, saved and restored (see :func:`install` for what ops do
  with it).
- allocator: torch.accelerator's ``memory_allocated``/``max_memory_allocated``/``memory_reserved`` are
  ``storage.account(index)``'s counts (reserved = allocated: nothing is cached), ``empty_cache`` does nothing.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

_NATIVE: ModuleType | None = None
#: Why the native part could not be built (None: it was, or it was not tried yet).
NOT_BUILT: str | None = None


def native() -> ModuleType | None:
    """The built ``_native`` extension, or None (with ``NOT_BUILT`` saying why) where it cannot be built."""
    global _NATIVE, NOT_BUILT
    if _NATIVE is not None or NOT_BUILT is not None:
        return _NATIVE
    from torch.utils import cpp_extension

    source = Path(__file__).with_name("_native.cpp")
    try:
        _NATIVE = cpp_extension.load(
            name="neuron_compile_device_native",
            sources=[str(source)],
            extra_cflags=["-O2"],
            verbose=os.environ.get("NEURON_COMPILE_VERBOSE_BUILD") == "1",
        )
    except Exception as e:  # no compiler, no headers: the device still works, with torch's defaults
        NOT_BUILT = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        log.warning(
            "neuron_compile: the device's native hooks could not be built (%s); an exception in a backward "
            "hook will abort the process, and pinned memory, torch.Generator('neuron') and torch.accelerator's "
            "memory statistics are unavailable",
            NOT_BUILT,
        )
    return _NATIVE


def hooks() -> Any:
    """The hooks object for ``_setup_privateuseone_for_python_backend(hook=...)``, or None (torch's default)."""
    mod = native()
    return mod.NeuronHooks() if mod is not None else None


def guard() -> Any:
    """The device guard for ``_setup_privateuseone_for_python_backend(device_guard=...)``, or None."""
    mod = native()
    return mod.NeuronGuard() if mod is not None else None


def _device_count(module: Any) -> int:
    """The devices the autograd engine and ``torch.accelerator`` see, fixed at registration (torch reads the
    count from ``noexcept`` C++). Without setting up the process's device (on the neuron target that starts the
    runtime, and its options may not be final yet at import): the runtime's visible cores where one is found,
    else 1 (the CPU target)."""
    from . import context

    if context._DEVICE is not None:
        return max(int(module.device_count()), 1)
    from ..runtime import libnrt

    path = libnrt.library_path()
    if not path:
        return 1
    try:
        return max(int(libnrt.library_info(path)["visible_cores"]), 1)
    except Exception as e:  # a runtime that cannot load or start says so at its first use, not at import
        log.debug("neuron device: the runtime's visible cores are unknown (%s): counting 1", e)
        return 1


def install(module: Any) -> None:
    """Give the native side the device count and its Python callbacks (``module`` is ``torch.neuron``), and
    threads in an autograd engine that already ran a backward. An eager random op given a
    ``torch.Generator("neuron")`` draws its seed from it (``graphs.seeds_from``)."""
    mod = native()
    if mod is None:
        return
    from . import storage

    def stats(index: int) -> tuple[int, int]:
        acc = storage.account(index)
        return acc.allocated, acc.peak

    mod.install(
        _device_count(module),
        lambda index: module.synchronize(index),
        stats,
        lambda index: module.reset_peak_memory_stats(index),
    )
    mod.add_engine_threads()
