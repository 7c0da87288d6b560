"""The seam between the compiler and what runs its output: the ``Target`` protocol and ``target_for``.

A target turns a StableHLO module into an artifact (``compile``), stores and restores it
(``serialize``/``deserialize``, for the cache), gives each compiled graph its own runnable handle on it
(``for_graph``: the cache keeps and shares the artifact), names the exact compiler build (``version``, part of
the cache key) and runs a handle on buffers (``run``).

Three kinds of buffer reach ``run``:

- host buffers, made by ``to_device`` from the CPU tensors of a call (and ``constant_buffer``): on the CPU target
  jax arrays sharing the tensors' memory (DLPack), on the neuron target the CPU tensors themselves, which ``run``
  copies into the NEFF's input tensors (only when they changed, where ``for_graph`` allowed it);
- device buffers of the ``neuron`` device (``device/buffers.py``: byte ranges of XLA CPU buffers, or nrt
  tensors on the NeuronCore), which the device hands to ``run`` (CPU target) or binds itself
  (``NeuronBuffers.run``, neuron target) without a host copy;
- results: what ``run`` returns, turned into torch tensors by ``to_torch`` (host) or kept as device buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from ..options import Options


@dataclass(frozen=True)
class GraphLabel:
    """What a target's messages name a module by: the graph's name and, computed only when a message needs it
    (a compile that does not end), its largest op with the user's source line."""

    name: str
    largest_op: Callable[[], str] | None = None


@runtime_checkable
class Target(Protocol):
    """What the compiler and the executor need of a target."""

    name: str

    def compile(
        self, stablehlo: str, host_callbacks: list[Any] | tuple[Any, ...] = (), graph: GraphLabel | None = None
    ) -> Any:
        """The artifact of the module (StableHLO text), with the Python host callbacks it calls; ``graph``
        names it in messages."""

    def serialize(self, executable: Any) -> bytes:
        """Bytes that ``deserialize`` turns back into an equivalent artifact."""

    def deserialize(self, blob: bytes) -> Any:
        """The artifact of ``serialize``'s bytes; raises on a blob it cannot load."""

    def for_graph(self, executable: Any, resident_inputs: bool = False) -> Any:
        """The handle one compiled graph runs the artifact ``executable`` by (the compile cache keeps and shares
        the artifact; the neuron target's handle holds the graph's share of the NEFF's load).
        ``resident_inputs``: an input may stay on the device while its version counter is unchanged (option
        ``input_residency``, a user contract; never where a change could go unseen even then: tensors unwrapped
        from a subclass, whose wrapper alone counts)."""

    def version(self) -> str:
        """The compiler build that produced the executable (a cache-key component)."""

    def run(self, executable: Any, buffers: list[Any]) -> list[Any]:
        """Execute a ``for_graph`` handle on buffers (see the module docstring); result buffers out."""

    def to_device(self, t: "torch.Tensor") -> Any:
        """A buffer ``run`` takes, of the contiguous CPU tensor ``t`` (sharing its memory where it can)."""

    def to_torch(self, result: Any) -> "torch.Tensor":
        """The torch tensor of one of ``run``'s results."""

    def constant_buffer(self, value: Any) -> Any:
        """A buffer owning a copy of ``value`` (a numpy array), for inputs that never change between calls."""


def target_for(opts: "Options") -> Target:
    """The target ``opts`` asks for ("cpu": XLA CPU; "neuron": neuronx-cc and libnrt)."""
    if opts.target == "neuron":
        from .neuron import NeuronTarget

        return NeuronTarget(
            opts.generation,
            opts.neuron_cc_flags,
            opts.opt_level,
            opts.lnc,
            opts.neuron_core,
            compiler_input=opts.compiler_input,
            compile_timeout=opts.compile_timeout,
            progress_seconds=opts.compile_progress_seconds,
            cache_dir=opts.cache_dir,
        )
    from .cpu import CpuTarget

    return CpuTarget()
