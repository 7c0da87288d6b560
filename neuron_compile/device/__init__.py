"""The ``neuron`` device: PyTorch tensors whose data stays on the NeuronCore (or, on the CPU target, in XLA CPU
buffers), so a training step moves only its batch across the host boundary.

``import neuron_compile`` registers it (where a Neuron runtime is found, or ``NEURON_COMPILE_DEVICE=1``;
else ``neuron_compile.device.register()``) on PyTorch's PrivateUse1 dispatch key through the
hooks PyTorch provides for a device written in Python (``torch.utils.backend_registration.
_setup_privateuseone_for_python_backend``, marked experimental: ``tests/test_device.py`` pins what we rely
on). Tensors: ``storage.py`` (memory), ``context.py`` (moving values), ``eager.py`` (every other op as a
one-op graph), ``graphs.py`` (compiled graphs on device tensors), ``checks.py`` (value checks, run at the next
synchronization). ``torch.neuron`` is :class:`NeuronModule`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator

import torch

from . import cuda_api

log = logging.getLogger(__name__)

#: Why the device is not registered in this process (None: it is, or registration was not tried yet).
NOT_REGISTERED: str | None = None
_REGISTERED = False
_LIBRARIES: list[Any] = []


class NeuronModule:
    """``torch.neuron``: the device module PyTorch calls for the ``neuron`` device (as ``torch.cuda``)."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        """The logical NeuronCores this process may use (1 on the CPU target)."""
        from . import context

        dev = context.device()
        if dev.target.name != "neuron":
            return 1
        from ..runtime import libnrt

        path = libnrt.library_path()
        return libnrt.library_info(path)["visible_cores"] if path else 0

    @staticmethod
    def current_device() -> int:
        from . import context, distributed_errors

        distributed_errors.refuse_fsdp_caller()  # FSDP2's fully_shard asks this first: not supported yet
        return context.current_index()

    @staticmethod
    def set_device(device: Any) -> None:
        from . import context

        index = torch.device(device).index if not isinstance(device, int) else device
        context.CURRENT[0] = index or 0

    @staticmethod
    @contextlib.contextmanager
    def device(device: Any) -> Iterator[None]:
        from . import context

        before = context.CURRENT[0]
        NeuronModule.set_device(device)
        try:
            yield
        finally:
            context.CURRENT[0] = before

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """Wait for the device's work (every execution is synchronous here) and report a failed value check of
        an earlier graph (an index out of range...), as CUDA reports a device-side assert."""
        from . import checks

        checks.resolve()

    # memory and device facts, as torch.cuda's (``cuda_api.py``): reserved is allocated, the device caches nothing
    memory_allocated = staticmethod(cuda_api.allocated)
    max_memory_allocated = staticmethod(cuda_api.peak)
    memory_reserved = staticmethod(cuda_api.allocated)
    max_memory_reserved = staticmethod(cuda_api.peak)
    memory_stats = staticmethod(cuda_api.memory_stats)
    memory_summary = staticmethod(cuda_api.memory_summary)
    mem_get_info = staticmethod(cuda_api.mem_get_info)
    get_device_name = staticmethod(cuda_api.device_name)
    get_device_properties = staticmethod(cuda_api.device_properties)
    get_device_capability = staticmethod(cuda_api.capability)

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        from . import context, storage

        acc = storage.account(context.index_of(device))
        acc.peak = acc.allocated

    @staticmethod
    def empty_cache() -> None:
        """Nothing to do: the device caches no memory (a freed tensor's buffer is freed at once), so
        ``memory_reserved()`` is always ``memory_allocated()`` and there is nothing to give back."""

    # -- what torch.cuda users read besides (cuda_api.py, streams.py; docs/device.md "CUDA code on the device")
    # a class attribute, so that `except torch.neuron.OutOfMemoryError:` and `NeuronModule.OutOfMemoryError` work
    from .storage import NeuronOutOfMemoryError as OutOfMemoryError
    from .streams import Event, Stream, current_stream, default_stream, set_stream, stream

    current_stream = staticmethod(current_stream)
    default_stream = staticmethod(default_stream)
    set_stream = staticmethod(set_stream)
    stream = staticmethod(stream)

    @staticmethod
    def reset_max_memory_allocated(device: Any = None) -> None:
        NeuronModule.reset_peak_memory_stats(device)

    @staticmethod
    def reset_accumulated_memory_stats(device: Any = None) -> None:
        """Nothing accumulated is kept (``memory_stats`` has current and peak counts only)."""

    @staticmethod
    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return True

    @staticmethod
    def ipc_collect() -> None:
        """Nothing to collect: device tensors are not shared across processes."""

    @property
    def amp(self) -> Any:
        from .cuda_api import AmpNamespace

        return AmpNamespace

    @staticmethod
    def manual_seed(seed: int) -> None:
        """Random ops on the device draw their seeds from torch's default generator: seed that one."""
        torch.random.default_generator.manual_seed(int(seed))

    manual_seed_all = manual_seed

    @staticmethod
    def seed() -> int:
        return torch.random.default_generator.seed()

    seed_all = seed

    @staticmethod
    def initial_seed() -> int:
        return torch.random.default_generator.initial_seed()

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.random.default_generator.get_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.random.default_generator.set_state(state)

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]


#: ``NEURON_COMPILE_DEVICE``: whether ``import neuron_compile`` registers the device: "1" always, "0" never,
#: unset when a Neuron runtime (libnrt) is found. Registration is not free for others: PyTorch then reports
#: PrivateUse1 as the machine's accelerator (``torch._C._get_accelerator()``), and FSDP2's default mesh and
#: ``torch.accelerator`` users follow it, so a CPU machine without the runtime keeps torch as it was.
DEVICE_ENV = "NEURON_COMPILE_DEVICE"


def wanted_at_import() -> bool:
    """Whether ``import neuron_compile`` registers the device (``NEURON_COMPILE_DEVICE``, else a runtime found)."""
    value = os.environ.get(DEVICE_ENV, "").strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    if value:
        raise ValueError(f"{DEVICE_ENV}={value!r}: use 1 (register the 'neuron' device) or 0 (do not)")
    from ..runtime import libnrt

    return libnrt.library_path() is not None


def register() -> bool:
    """Register the ``neuron`` device on PrivateUse1, once per process; whether it is ours. ``import
    neuron_compile`` calls it where a Neuron runtime is found (:func:`wanted_at_import`); call it to use the
    device on the CPU target. Where another
    library holds PrivateUse1 (TorchNeuron's ``torch_neuronx`` registers its own ``neuron`` device), nothing is
    registered: the host-tensor path works as before, and ``NOT_REGISTERED`` says why."""
    global _REGISTERED, NOT_REGISTERED
    if _REGISTERED:
        return True
    if NOT_REGISTERED is not None:
        return False
    taken = torch._C._get_privateuse1_backend_name()
    if taken != "privateuseone":
        NOT_REGISTERED = (
            f"PrivateUse1 is already registered as '{taken}' by another library (TorchNeuron's torch_neuronx "
            "registers its own 'neuron' device), so neuron_compile's device is not registered; compiled graphs "
            "take CPU tensors"
        )
        log.warning("neuron_compile: %s", NOT_REGISTERED)
        return False
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    from . import hooks

    module = NeuronModule()
    _setup_privateuseone_for_python_backend(
        "neuron", backend_module=module, hook=hooks.hooks(), device_guard=hooks.guard()
    )
    hooks.install(module)
    from . import kernels, modules

    _LIBRARIES.extend(kernels.register())
    modules.install()
    from . import amp, distributed_errors, streams

    _LIBRARIES.extend(amp.register())  # autocast("neuron") with CUDA's policy; GradScaler("neuron")
    _LIBRARIES.extend(streams.register())  # Tensor.record_stream
    distributed_errors.install()  # DDP / FSDP2 of device tensors: a one-line error saying what to do
    from ..runtime import executor
    from .graphs import call_on_device, is_device_call

    executor.DEVICE_CALL = (is_device_call, call_on_device)
    from .. import graph_checks, value_checks
    from . import checks, context

    value_checks.DEFERRED_CHECKS = checks.defer
    context.BEFORE_READ = checks.resolve
    graph_checks.NEURON_DEVICE_REGISTERED = True
    _REGISTERED = True
    return True


def is_registered() -> bool:
    return _REGISTERED
