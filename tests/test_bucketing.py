"""pad_to_bucket: pad one dimension to the smallest fitting bucket, with a mask of the real elements."""

from __future__ import annotations

import random

import pytest
import torch

import neuron_compile
from neuron_compile import pad_to_bucket


@pytest.mark.parametrize("shape, dim", [((2, 5), -1), ((2, 5), 1), ((5, 3), 0), ((2, 5, 3), 1), ((7,), 0)])
def test_pads_the_dim_to_the_smallest_fitting_bucket(shape: tuple[int, ...], dim: int) -> None:
    x = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    padded, mask = pad_to_bucket(x, [4, 8, 16], dim=dim, value=-1)
    expected = list(shape)
    expected[dim] = 8
    assert list(padded.shape) == expected and mask.shape == padded.shape and mask.dtype == torch.bool
    size = shape[dim]
    assert torch.equal(padded.narrow(dim, 0, size), x)
    assert (padded.narrow(dim, size, 8 - size) == -1).all()
    assert mask.narrow(dim, 0, size).all() and not mask.narrow(dim, size, 8 - size).any()


def test_a_size_equal_to_a_bucket_is_not_padded() -> None:
    x = torch.ones(3, 4, dtype=torch.int64)
    padded, mask = pad_to_bucket(x, [8, 4])
    assert torch.equal(padded, x) and mask.all()


@pytest.mark.parametrize(
    "shape, buckets, dim, match",
    [
        ((2, 20), [4, 8, 16], -1, "size 20 of dim 1 .* exceeds the largest bucket 16"),
        ((2, 3), [], -1, "buckets is empty"),
        ((2, 3), [4, 0], -1, "positive ints"),
        ((2, 3), [4.5], -1, "positive ints"),
        ((2, 3), [4], 2, "dim=2 is out of range"),
    ],
)
def test_clear_errors(shape, buckets, dim, match) -> None:
    with pytest.raises(ValueError, match=match):
        pad_to_bucket(torch.zeros(shape), buckets, dim=dim)


class _MaskedAttention(torch.nn.Module):
    """Tokens attend to each other: padding changes the real positions' results unless it is masked."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv(self.emb(ids)).chunk(3, dim=-1)
        attn_mask = None if mask is None else mask[:, None, :]  # keys that are padding get no weight
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


def test_random_lengths_compile_at_most_once_per_bucket_and_match_unpadded_eager() -> None:
    torch.manual_seed(0)
    rng = random.Random(0)
    buckets = [4, 8, 16]
    model = _MaskedAttention().eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="neuron", dynamic=False)
    first = len(neuron_compile.STATS.graphs)
    lengths = [rng.randint(1, 16) for _ in range(8)]
    with torch.no_grad():
        for length in lengths:
            ids = torch.randint(0, 50, (2, length))
            padded, mask = pad_to_bucket(ids, buckets)
            out = compiled(padded, mask)
            expected = model(ids)
            real = out[:, :length]
            torch.testing.assert_close(real, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"length {length}: {m}")
    compiles = len(neuron_compile.STATS.graphs) - first
    used = {min(b for b in buckets if b >= n) for n in lengths}
    assert compiles <= len(buckets) and compiles == len(used), (lengths, compiles)
    torch._dynamo.reset()
