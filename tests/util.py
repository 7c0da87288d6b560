"""Helpers shared by the op-family tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree


def tensor_leaves(out: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) op result, in order; None and non-tensor outputs are left out."""
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
