"""Small models shared by the tests; the transformer is the demo's own."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from neuron_compile.demo import Block, TinyLM  # noqa: F401


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(x))
        x = torch.tanh(self.fc2(x)) + x
        return self.head(x)


class BatchNormNet(nn.Module):
    def __init__(self, d_in: int = 12, d_hidden: int = 24, d_out: int = 3) -> None:
        super().__init__()
        # No bias before BatchNorm (it would be cancelled by the mean subtraction; its gradient is pure
        # rounding noise, which Adam would then amplify to a full-size step).
        self.fc1 = nn.Linear(d_in, d_hidden, bias=False)
        self.bn = nn.BatchNorm1d(d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.bn(self.fc1(x))))


class RecurrentNet(nn.Module):
    """A stacked LSTM, a bidirectional GRU and a head: each time step is unrolled into the graph."""

    def __init__(self, d_in: int = 6, d_hidden: int = 8, d_out: int = 2) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d_in, d_hidden, num_layers=2, batch_first=True)
        self.gru = nn.GRU(d_hidden, d_hidden, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.lstm(x)[0])[0][:, -1])


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class DecoderBlock(nn.Module):
    """Pre-norm Llama-style block: RMSNorm, rotary causal attention through SDPA, SwiGLU."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(d, 2 * d, bias=False)
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    """A small decoder-only LM (issue 47's shape): tied embeddings, rotary positions, next-token cross-entropy."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(DecoderBlock(d, heads) for _ in range(layers))
        self.norm = RMSNorm(d)
        inv = 1.0 / (10000 ** (torch.arange(0, d // heads, 2).float() / (d // heads)))
        angles = torch.outer(torch.arange(seq).float(), inv)
        self.register_buffer("cos", torch.cat((angles, angles), -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat((angles, angles), -1).sin(), persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        t = idx.shape[1]
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.norm(x) @ self.embed.weight.t()  # tied to the embedding
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
