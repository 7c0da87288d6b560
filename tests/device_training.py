"""Training loops on the ``neuron`` device, shared by tests/test_device.py (also in a second process) and
benchmarks/device_bytes.py: the model compiled with ``backend="neuron"``, AdamW eager or compiled, and per step
the bytes that crossed the host boundary (``STATS``) and the time it took."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import neuron_compile
from neuron_compile import STATS

# On the CPU target too (import neuron_compile does it where libnrt is found); tests/test_device.py relies on it.
neuron_compile.device.register()


def decoder_batches(steps: int, vocab: int = 64, batch: int = 4, seq: int = 16) -> list[tuple[torch.Tensor, ...]]:
    """(inputs, targets) token batches of a next-token language model, the same at every call."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        data = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((data[:, :-1], data[:, 1:]))
    return out


def call_loss(model: Any, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The loss of a model whose forward returns it (``tests.models.Decoder``)."""
    return model(*batch)


def hf_loss(model: Any, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The loss of a Hugging Face causal LM on (input_ids,): the ids are their own labels."""
    (ids,) = batch
    return model(input_ids=ids, labels=ids).loss


@dataclass
class Run:
    losses: list[float] = field(default_factory=list)
    #: (bytes to the device, bytes to the host) per step, the loss read included.
    crossing: list[tuple[int, int]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def train(
    model: torch.nn.Module,
    batches: list[tuple[torch.Tensor, ...]],
    optimizer: str,
    clip: bool = False,
    loss_of: Callable[[Any, tuple[torch.Tensor, ...]], torch.Tensor] = call_loss,
    lr: float = 1e-2,
    compile_model: bool = True,
    on_step: Callable[[], None] | None = None,
) -> tuple[Run, torch.optim.Optimizer]:
    """Train ``model`` (on the device or on CPU: its parameters say) one step per batch with AdamW:
    ``optimizer`` "eager" (``opt.step()`` op by op; ``capturable=True``, so the step count stays a device tensor
    and no step compiles a new graph) or "compiled" (``torch.compile(opt.step)``, one graph). ``on_step``: called
    after each step."""
    device = next(model.parameters()).device
    forward = torch.compile(model, backend="neuron", dynamic=False) if compile_model else model
    opt = torch.optim.AdamW(model.parameters(), lr=lr, capturable=device.type == "neuron")
    step = torch.compile(opt.step, backend="neuron", dynamic=False) if optimizer == "compiled" else opt.step
    run = Run()
    for batch in batches:
        h2d, d2h = STATS.host_to_device_bytes, STATS.device_to_host_bytes
        start = time.perf_counter()
        loss = loss_of(forward, tuple(t.to(device) for t in batch))
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        step()
        opt.zero_grad()
        run.losses.append(loss.item())
        run.seconds.append(time.perf_counter() - start)
        run.crossing.append((STATS.host_to_device_bytes - h2d, STATS.device_to_host_bytes - d2h))
        if on_step is not None:
            on_step()
    return run, opt
