"""``torch.load`` of a checkpoint saved from the ``neuron`` device in a process where no library registered the
device: torch's own error ("don't know how to restore data location of torch.storage.UntypedStorage (tagged with
neuron:0)") does not say what to do. ``import neuron_compile`` registers, last in torch's list, a restore
location that only sees the ``neuron`` locations nothing else restored (where the device is registered, ours
or TorchNeuron's restores them first), and says what to do: ``map_location="cpu"`` or register the device."""

from __future__ import annotations

from typing import Any

import torch

_INSTALLED = False


def _no_tag(obj: Any) -> None:
    return None


def _unrestored(obj: Any, location: str) -> None:
    if location == "neuron" or location.startswith("neuron:"):
        raise RuntimeError(
            f"torch.load: this checkpoint holds tensors saved from the '{location}' device, which is not registered "
            'in this process: pass map_location="cpu" to load them on the host, or call '
            "neuron_compile.device.register() before torch.load to load them on the device."
        )
    return None


def install_load_hint() -> None:
    global _INSTALLED
    if not _INSTALLED:
        torch.serialization.register_package(1000, _no_tag, _unrestored)
        _INSTALLED = True
