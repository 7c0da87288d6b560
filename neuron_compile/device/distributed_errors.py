"""DDP and FSDP2 of a model on the ``neuron`` device: not supported yet, said in one line with what to do.

The device has no collectives yet (a process group's backends are gloo for CPU tensors; nothing takes neuron
tensors), so without these checks DDP failed inside C++ with "No backend type associated with device type
neuron", and FSDP2 with ``'NeuronModule' has no attribute 'Stream'`` or, further, with torch's
``resizePrivateUse1Bytes`` refusal in backward. Where each is caught, the first place torch reaches that we can
see:

- DDP: its first collective, ``torch.distributed._verify_params_across_processes`` (DDP's and FSDP1's
  parameter-shape check, looked up on ``torch.distributed`` at each call), wrapped to refuse neuron tensors.
- FSDP2: ``fully_shard`` asks the device module of its mesh for the current device
  (``_fsdp_init._get_device_from_mesh``) and, at the first forward, for its streams: ``NeuronModule.current_device``
  and ``torch.neuron.Stream`` call :func:`refuse_fsdp_caller`, which raises when that caller is FSDP's.
- ``init_process_group()`` without a backend on a machine where the device is registered (PyTorch picks the
  accelerator's default backend) and ``torch.distributed.get_default_backend_for_device("neuron")``: a backend
  named ``neuron`` is registered for the device, whose construction raises the same error.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import torch

from ..errors import NeuronCompileError

WHAT_TO_DO = (
    "keep the model on CPU and train on host tensors with a gloo process group, as docs/distributed.md describes "
    "(compiled graphs still run on the NeuronCore), until multi-core device collectives land"
)


class NeuronDistributedUnsupportedError(NeuronCompileError):
    """A distributed feature on tensors of the ``neuron`` device, which has no collectives yet (a RuntimeError)."""


def unsupported(feature: str, how: str = "") -> NeuronDistributedUnsupportedError:
    what_to_do = WHAT_TO_DO.replace("process group,", f"process group{' and ' + how if how else ''},")
    return NeuronDistributedUnsupportedError(
        f"neuron device: {feature} is not supported yet (the device has no collectives): {what_to_do}."
    )


_FSDP_DIR = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "distributed", "fsdp")


def refuse_fsdp_caller(depth: int = 2) -> None:
    """Raise the FSDP error when the function ``depth`` frames up (the caller of our caller) is FSDP's."""
    frame = sys._getframe(depth)
    if os.path.abspath(frame.f_code.co_filename).startswith(_FSDP_DIR):
        raise unsupported(
            "FSDP2 (fully_shard) on a 'neuron' device mesh (the default mesh once the device is registered)",
            'fully_shard(..., mesh=init_device_mesh("cpu", ...))',
        )


def _refusing_neuron_tensors(verify: Any) -> Any:
    @functools.wraps(verify)
    def checked(process_group: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(t, torch.Tensor) and t.device.type == "neuron" for t in tensors):
            raise unsupported("DistributedDataParallel (DDP) of a model on the neuron device")
        return verify(process_group, tensors, *args, **kwargs)

    checked._neuron_checked = True
    return checked


def _backend_refusal(*args: Any, **kwargs: Any) -> Any:
    raise unsupported("a process group backend for the neuron device")


def install() -> None:
    """Once per process, at the device's registration."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    verify = getattr(dist, "_verify_params_across_processes", None)
    if verify is not None and not getattr(verify, "_neuron_checked", False):
        dist._verify_params_across_processes = _refusing_neuron_tensors(verify)
    if "neuron" not in dist.Backend.backend_list:
        dist.Backend.register_backend("neuron", _backend_refusal, devices=["neuron"])
