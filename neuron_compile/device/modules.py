"""``module.to("neuron")`` keeps its Parameter objects, as ``module.to("cuda")`` does.

torch moves a parameter in place (``param.data = moved``) only between tensor types it deems compatible for a
shallow copy, a list of backends PrivateUse1 is not on; otherwise ``nn.Module._apply`` makes a NEW Parameter.
An optimizer built before the move then updates the old objects (the loss stays flat, no warning) and tied
weights (an ``lm_head`` sharing ``wte``) come apart. So, for a parameter moved to or from the device, the new
Parameter's tensor is swapped into the old Python object (``torch._C._swap_tensor_impl``, the core of
``torch.utils.swap_tensors``, without its ``__dict__`` swap: the user's attributes on the parameter stay).

The patch of ``nn.Module._apply`` (torch 2.13; torch's own ``swap_module_params_on_conversion`` path is a
global switch that would also change CPU-only conversions) runs torch's method unchanged and then puts the
original objects back where torch replaced them across the device boundary; other conversions are untouched.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

_ORIGINAL_APPLY: Callable[..., Any] | None = None


def _crosses_the_device(before: torch.Tensor, after: torch.Tensor) -> bool:
    return (before.device.type == "neuron") != (after.device.type == "neuron")


def _poisoned_accumulator(grad_outputs: Any) -> None:
    raise RuntimeError(
        "neuron device: backward reached a parameter through a graph recorded before the parameter moved "
        "between the host and the neuron device (module.to(...) between forward and backward). Move the module "
        "before its forward, or after its backward."
    )


def _keep_identity(module: torch.nn.Module, key: str, old: torch.nn.Parameter, new: torch.nn.Parameter) -> None:
    """Give ``old`` the tensor of ``new`` (which torch made), and put ``old`` back in ``module``."""
    grad = new.grad
    new.grad = None
    if old.requires_grad and old.is_leaf and not old.is_inference():
        # A graph recorded before the move (its saved tensors keep the values they saw, as they should) would
        # accumulate its gradient into the tensor ``old`` no longer holds: make that an error, as torch's
        # swap_tensors does, rather than a lost gradient.
        with torch.inference_mode(False), torch.enable_grad():
            torch.autograd.graph.get_gradient_edge(old).node.register_prehook(_poisoned_accumulator)
    torch._C._swap_tensor_impl(old, new)
    old.grad = grad
    module._parameters[key] = old


def _apply(self: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
    before = dict(self._parameters)
    assert _ORIGINAL_APPLY is not None
    result = _ORIGINAL_APPLY(self, fn, recurse)
    for key, old in before.items():
        new = self._parameters.get(key)
        if old is None or new is None or new is old or not _crosses_the_device(old, new):
            continue
        _keep_identity(self, key, old, new)
    return result


def install() -> None:
    """Patch ``nn.Module._apply`` (once): called when the device registers."""
    global _ORIGINAL_APPLY
    if _ORIGINAL_APPLY is not None:
        return
    _ORIGINAL_APPLY = torch.nn.Module._apply
    torch.nn.Module._apply = _apply  # type: ignore[method-assign]
