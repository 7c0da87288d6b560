"""``torch.neuron.Stream`` and ``torch.neuron.Event``, as ``torch.cuda``'s, for a device that runs every
execution synchronously, in issue order, on one stream (``context.STREAM``).

So: every stream object is the device's one stream under another name (ops issued "on" any of them run in
order, which is what a correct CUDA program waits for anyway); ``wait_event`` / ``wait_stream`` have nothing
to wait for; ``query()`` is True. ``synchronize()`` (of a stream, an event or the device) reports a failed
value check of an earlier graph, as CUDA reports a device-side assert. An Event records the host's clock when
it is recorded (after the work before it, which is done by then), so ``start.elapsed_time(end)`` is the
host-measured time between the two records, in milliseconds, as CUDA's: a real measure of the device work
between them, since the device ran it before ``record`` returned.

Both subclass torch's generic ``torch.Stream`` / ``torch.Event`` (as ``torch.cuda.Stream`` does), so
``torch.accelerator.set_stream`` and FSDP's stream plumbing take them.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import torch


def _device_index(device: Any) -> int:
    from . import context

    return context.index_of(device)


def _synchronize() -> None:
    from . import checks

    checks.resolve()


class Stream(torch.Stream):
    """A stream of the ``neuron`` device (the device's one stream: see the module's docstring)."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> "Stream":
        from .distributed_errors import refuse_fsdp_caller

        refuse_fsdp_caller()  # FSDP2 makes its streams at its first forward: not supported yet
        if kwargs:  # stream_id=, device_index=, device_type=: an existing stream, as torch.cuda.Stream
            return super().__new__(cls, **kwargs)
        return super().__new__(cls, device=torch.device("neuron", _device_index(device)), priority=priority)

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for: the work before ``event`` has run."""

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for: every stream's work runs in issue order."""

    def record_event(self, event: Any = None) -> "Event":
        event = Event() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _synchronize()

    def __repr__(self) -> str:
        return f"<torch.neuron.Stream device=neuron:{self.device_index} stream_id={self.stream_id}>"


class Event(torch.Event):
    """An event of the ``neuron`` device: ``elapsed_time`` is host-measured time between records (see the
    module's docstring)."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> "Event":
        self = super().__new__(
            cls, device="neuron", enable_timing=enable_timing, blocking=blocking, interprocess=interprocess
        )
        self._timing = enable_timing
        self._recorded_at: float | None = None
        return self

    def record(self, stream: Any = None) -> None:
        _synchronize()
        self._recorded_at = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for: the work before the record has run."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _synchronize()

    def elapsed_time(self, end_event: "Event") -> float:
        """Milliseconds between this event's record and ``end_event``'s (both need ``enable_timing=True``)."""
        if not (self._timing and getattr(end_event, "_timing", False)):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._recorded_at is None or getattr(end_event, "_recorded_at", None) is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._recorded_at - self._recorded_at) * 1000.0

    def __repr__(self) -> str:
        return f"<torch.neuron.Event enable_timing={self._timing} recorded={self._recorded_at is not None}>"


def current_stream(device: Any = None) -> Stream:
    index = _device_index(device)
    s = torch._C._accelerator_getStream(index)
    return Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)


def default_stream(device: Any = None) -> Stream:
    index = _device_index(device)
    return Stream(stream_id=0, device_index=index, device_type=torch.Stream(device="neuron").device_type)


def set_stream(stream: Any) -> None:
    if stream is not None:
        torch._C._accelerator_setStream(stream)


@contextlib.contextmanager
def stream(s: Any) -> Iterator[None]:
    """``with torch.neuron.stream(s):`` ``s`` is the current stream inside (None: nothing changes)."""
    if s is None:
        yield
        return
    before = current_stream(s.device_index)
    set_stream(s)
    try:
        yield
    finally:
        set_stream(before)


def record_stream(t: torch.Tensor, s: Any) -> None:
    """``Tensor.record_stream``: nothing to do, every stream is the device's one stream (a tensor freed while
    another stream uses it cannot happen)."""


def register() -> list[Any]:
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("record_stream", record_stream, "PrivateUse1")
    return [lib]
