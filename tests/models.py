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
