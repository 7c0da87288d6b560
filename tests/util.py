"""Helpers shared by the op-family tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

import neuron_compile


def tensor_leaves(out: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) op result, in order; None and non-tensor outputs are left out."""
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def root_cause(exc: BaseException) -> BaseException:
    """The backend's own exception inside Dynamo's BackendCompilerFailed."""
    while not isinstance(exc, neuron_compile.NeuronCompileError):
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if inner is None:
            return exc
        exc = inner
    return exc
