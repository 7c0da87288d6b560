"""On-chip memory: the buffer kinds (SBUF, PSUM, HBM) and the SBUF/PSUM capacity a kernel run has in use.

Each kernel run keeps an :class:`OnChipMemory`: one ledger of SBUF bytes per partition and PSUM bytes per bank
for every program of its launch (each program is its own core with its own SBUF/PSUM). An allocation takes a
:class:`Reservation` from it and gives it back when the tile goes out of scope (its last view is dropped: a
name rebound, ``del``, a function returning), and whatever is still reserved when the run ends is given
back then (:meth:`OnChipMemory.close`). A run's memory is its own: a tile kept alive after its run (by an
exception's traceback, a global, a cycle waiting for the collector) holds nothing any other run sees, and
its late release is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import NkiCapacityError, NkiValidationError

#: Partitions of SBUF and PSUM (``nl.tile_size.pmax``).
PMAX = 128


class Buffer(str):
    """A memory kind: ``sbuf``, ``psum``, ``hbm`` (private) or ``shared_hbm``."""

    @property
    def on_chip(self) -> bool:
        return self in ("sbuf", "psum")

    @property
    def is_hbm(self) -> bool:
        return self in ("hbm", "shared_hbm", "private_hbm")


sbuf = Buffer("sbuf")
psum = Buffer("psum")
hbm = Buffer("hbm")
private_hbm = Buffer("hbm")
shared_hbm = Buffer("shared_hbm")


@dataclass(frozen=True, eq=False)
class Reservation:
    """The on-chip memory one allocation holds: ``bytes_per_partition`` of ``buffer`` (``"sbuf"`` or
    ``"psum"``) in the memory of ``program``, in PSUM bank ``bank`` (None for SBUF). Compared by identity:
    two allocations of the same size are two reservations."""

    buffer: str
    program: tuple[int, ...]
    bytes_per_partition: int
    bank: int | None = None


class _ProgramMemory:
    """The SBUF bytes per partition and the bytes of each PSUM bank one program (core) has in use."""

    __slots__ = ("psum_banks", "sbuf_used")

    def __init__(self, banks: int):
        self.sbuf_used = 0
        self.psum_banks = [0] * banks


class OnChipMemory:
    """The SBUF/PSUM in use by one kernel run, per program; see the module docstring."""

    def __init__(self, gen: Any):
        self.gen = gen
        self._programs: dict[tuple[int, ...], _ProgramMemory] = {}
        #: reservation -> what gives it back early (a ``weakref.finalize`` on the allocation), or None
        self._live: dict[Reservation, Any] = {}
        self.closed = False

    def _of(self, program: tuple[int, ...]) -> _ProgramMemory:
        mem = self._programs.get(program)
        if mem is None:
            mem = self._programs[program] = _ProgramMemory(self.gen.psum_banks)
        return mem

    def sbuf_used(self, program: tuple[int, ...]) -> int:
        """SBUF bytes per partition ``program`` has in use."""
        return self._of(program).sbuf_used

    def psum_banks(self, program: tuple[int, ...]) -> list[int]:
        """Bytes per partition in use in each PSUM bank of ``program`` (a copy)."""
        return list(self._of(program).psum_banks)

    @property
    def live(self) -> int:
        """Reservations not given back yet."""
        return len(self._live)

    def reserve(self, buffer: str, per_partition: int, what: str, program: tuple[int, ...]) -> Reservation:
        """Take ``per_partition`` bytes of ``buffer`` in ``program``'s memory, or raise the capacity error."""
        mem = self._of(program)
        gen = self.gen
        if buffer == "sbuf":
            cap = gen.sbuf_usable_bytes_per_partition
            if mem.sbuf_used + per_partition > cap:
                raise NkiCapacityError(
                    f"SBUF capacity exceeded on {gen.name}: {what} needs {per_partition} B per partition "
                    f"with {mem.sbuf_used} B already live, of {cap} B usable per partition "
                    f"({gen.sbuf_bytes_per_partition} minus {gen.sbuf_reserved_bytes_per_partition} "
                    "reserved for the compiler). Use smaller tiles or let earlier tiles go out of scope."
                )
            mem.sbuf_used += per_partition
            res = Reservation("sbuf", program, per_partition)
        elif buffer == "psum":
            bank_bytes = gen.psum_bytes_per_partition // gen.psum_banks
            if per_partition > bank_bytes:
                raise NkiValidationError(
                    f"PSUM tensor {what} takes {per_partition} B per partition, more than one PSUM bank "
                    f"({bank_bytes} B = {bank_bytes // 4} fp32 elements, nl.tile_size.psum_fmax); split its free dim"
                )
            bank = next((i for i, used in enumerate(mem.psum_banks) if used + per_partition <= bank_bytes), None)
            if bank is None:
                raise NkiCapacityError(
                    f"PSUM capacity exceeded on {gen.name}: {what} needs {per_partition} B per partition but "
                    f"all {gen.psum_banks} banks of {bank_bytes} B are taken (used per bank: {mem.psum_banks}). "
                    "Reuse PSUM tiles across loop iterations or let earlier ones go out of scope (del)."
                )
            mem.psum_banks[bank] += per_partition
            res = Reservation("psum", program, per_partition, bank)
        else:
            raise ValueError(f"{buffer!r} is not an on-chip buffer")
        if self.closed:  # an allocation after the run ended (never made by a kernel): give it back at once
            self._give_back(res)
        else:
            self._live[res] = None
        return res

    def on_release(self, res: Reservation, releaser: Any) -> None:
        """Remember what would give ``res`` back early (detached when the run ends first)."""
        if res in self._live:
            self._live[res] = releaser

    def release(self, res: Reservation) -> None:
        """Give ``res`` back (the tile went out of scope); a no-op if it already was, or the run has ended."""
        if self._live.pop(res, False) is not False:
            self._give_back(res)

    def close(self) -> None:
        """The run ended: give back everything still reserved, so nothing a kept-alive tile holds outlives it."""
        self.closed = True
        live, self._live = self._live, {}
        for res, releaser in live.items():
            if releaser is not None:
                releaser.detach()
            self._give_back(res)

    def _give_back(self, res: Reservation) -> None:
        mem = self._of(res.program)
        if res.bank is None:
            mem.sbuf_used -= res.bytes_per_partition
        else:
            mem.psum_banks[res.bank] -= res.bytes_per_partition
