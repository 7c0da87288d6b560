"""Shape bucketing: pad a dimension up to one of a few fixed sizes, so that each size compiles once.

neuronx-cc compiles static shapes only; a model fed every sequence length would compile one graph per
length. Padding to buckets bounds the number of graphs by the number of buckets, and the mask says
which positions are real (for an attention mask, or to drop the padding from a loss).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


def pad_to_bucket(
    tensor: torch.Tensor, buckets: Sequence[int], dim: int = -1, value: float = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad ``tensor`` along ``dim`` (at the end) to the smallest bucket that fits its size.

    Returns ``(padded, mask)``: ``padded`` filled with ``value`` beyond the original size; ``mask`` a bool
    tensor of ``padded``'s shape, True on the original elements. Raises ``ValueError`` when the size
    exceeds the largest bucket or a bucket is not a positive int.

    >>> ids = torch.tensor([[5, 6, 7]])
    >>> padded, mask = pad_to_bucket(ids, [4, 8])
    >>> padded.tolist(), mask.tolist()
    ([[5, 6, 7, 0]], [[True, True, True, False]])
    """
    if not buckets:
        raise ValueError("pad_to_bucket: buckets is empty; give the fixed sizes to pad to, e.g. [128, 256, 512]")
    bad = [b for b in buckets if isinstance(b, bool) or not isinstance(b, int) or b <= 0]
    if bad:
        raise ValueError(f"pad_to_bucket: buckets must be positive ints, got {bad!r} in {list(buckets)!r}")
    if tensor.dim() == 0:
        raise ValueError("pad_to_bucket: a 0-d tensor has no dimension to pad")
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"pad_to_bucket: dim={dim} is out of range for a tensor of shape {list(tensor.shape)}")
    dim = dim % tensor.dim()
    size = tensor.shape[dim]
    fitting = [b for b in buckets if b >= size]
    if not fitting:
        raise ValueError(
            f"pad_to_bucket: size {size} of dim {dim} (shape {list(tensor.shape)}) exceeds the largest bucket "
            f"{max(buckets)} of {sorted(buckets)}; add a larger bucket or truncate the input"
        )
    target = min(fitting)
    pad = [0, 0] * (tensor.dim() - 1 - dim) + [0, target - size]
    padded = F.pad(tensor, pad, value=value) if target > size else tensor
    mask = torch.zeros(padded.shape, dtype=torch.bool, device=tensor.device)
    mask.narrow(dim, 0, size).fill_(True)
    return padded, mask
