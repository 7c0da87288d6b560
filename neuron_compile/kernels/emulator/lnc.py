"""``nki.lnc`` (NKI 0.8): data exchange and synchronization between the two physical cores of a logical
NeuronCore, and the cooperative scheduler that runs the two programs of an LNC-2 launch (``kernel[2](...)``).

The programs of an LNC-2 launch run in two threads that take turns: one runs until it reaches an ``nki.lnc``
call (or returns), then hands over, so execution stays deterministic and the emulator's state is touched by
one program at a time. Calls pair up as on the device: the n-th ``sendrecv`` of one core meets the n-th of
its peer, a ``core_barrier`` meets the peer's ``core_barrier``. A call that can never be met (the peer reaches
a different kind of call, or returns without reaching one) is the deadlock the device would hang in; here it
is a :class:`NkiDeadlockError` naming both programs' call sites.

The documented facts (the ``nki.lnc`` API pages of the Neuron docs, NKI 0.8): ``sendrecv`` and
``sendrecv_compute`` need LNC degree 2 and NeuronCore-v3 or newer, ranks 0 or 1, a DMA ``priority`` 0-3 (acted
on from NeuronCore-v4; rejected with ``dma_engine=gpsimd_dma``) and no ``pipe_id``; ``sendrecv_compute``
reduces with ``nl.add``, ``nl.maximum`` or ``nl.minimum`` and keeps ``src`` and ``dst`` in one memory (both SBUF
or both private HBM); ``core_barrier(data, cores=(0, 1), engine=gpsimd)`` synchronizes on a shared-HBM tensor
at LNC degree 1 or 2. The ``nki.isa`` functions of the same names are the deprecated 0.8 wrappers (isa.py).

Cost model: a barrier is one instruction on its engine of each core, placed at the later of the two cores'
ready times (its latency is not published); each side of a send/receive pair is one DMA on its core, both
starting when both cores are ready (``gpsimd_dma`` without the DMA queue's fixed latency: "low-latency
SB-to-SB swaps").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import cost as _cost
from . import ops as _ops
from .dtypes import cast
from .errors import NkiError, NkiUnsupportedError, NkiValidationError
from .run import Run, current_run, pop_run, push_run
from .tensors import NkiTensor, fmt_shape
from .versions import call_site, require

__all__ = ["NkiDeadlockError", "core_barrier", "sendrecv", "sendrecv_compute"]


class NkiDeadlockError(NkiError):
    """The two programs of an LNC-2 launch wait for each other forever: their ``nki.lnc`` calls do not pair up.
    The message names both programs' call sites."""


class _Aborted(BaseException):
    """Stops a program whose peer failed (an internal signal, never seen by kernels' callers)."""


@dataclass
class _SyncCall:
    kind: str
    site: str
    index: int
    args: dict[str, Any]
    done: bool = field(default=False)


class LncLaunch:
    """Runs the two programs of an LNC-2 launch as turn-taking threads and pairs their ``nki.lnc`` calls."""

    def __init__(self, run: Run, programs: int = 2):
        self.run = run
        self.n = programs
        self.cv = threading.Condition()
        self.turn: int | None = 0
        self.pending: list[_SyncCall | None] = [None] * programs
        self.finished = [False] * programs
        self.calls = [0] * programs
        self.last_site: list[str | None] = [None] * programs
        self.shared_next = [0] * programs
        self.results: list[Any] = [None] * programs
        self.error: BaseException | None = None
        self.kernel_name = run.kernel or "kernel"
        self.kernel_site = ""

    # ---- running the programs
    def run_programs(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        code = getattr(fn, "__code__", None)
        if code is not None:
            self.kernel_site = f" ({code.co_filename}:{code.co_firstlineno})"
        threads = [
            threading.Thread(target=self._program, args=(p, fn, args, kwargs), name=f"nki-lnc-program-{p}", daemon=True)
            for p in range(self.n)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.run.program_id = (self.n - 1,)
        if self.error is not None:
            raise self.error
        return self.results[-1]

    def _program(self, p: int, fn: Any, args: tuple, kwargs: dict) -> None:
        push_run(self.run)
        try:
            with self.cv:
                self._wait_turn(p)
                self._enter(p)
            try:
                result = fn(*args, **kwargs)
            except _Aborted:
                return
            except BaseException as e:
                with self.cv:
                    self._fail(e)
                return
            with self.cv:
                self.results[p] = result
                self.finished[p] = True
                self._leave(p)
                for q in range(self.n):
                    call = self.pending[q]
                    if q != p and call is not None and not call.done:
                        self._fail(self._deadlock_returned(waiting=q, call=call, returned=p))
                        return
                self._pass_turn(p)
        except _Aborted:
            pass
        finally:
            pop_run()

    def _wait_turn(self, p: int) -> None:
        while self.turn != p:
            if self.error is not None:
                raise _Aborted
            self.cv.wait()
        if self.error is not None:
            raise _Aborted

    def _enter(self, p: int) -> None:
        self.run.program_id = (p,)
        self.run.shared_next = self.shared_next[p]

    def _leave(self, p: int) -> None:
        self.shared_next[p] = self.run.shared_next

    def _pass_turn(self, p: int) -> None:
        order = [(p + k) % self.n for k in range(1, self.n + 1)]
        self.turn = next((q for q in order if not self.finished[q]), None)
        self.cv.notify_all()

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.turn = None
        self.cv.notify_all()

    # ---- pairing
    def sync(self, kind: str, args: dict[str, Any]) -> None:
        """Called by the running program at an ``nki.lnc`` call: pair it with the peer's or wait for it."""
        p = self.run.program_id[0]
        q = 1 - p
        site = call_site()
        with self.cv:
            call = _SyncCall(kind, site, self.calls[p], args)
            self.calls[p] += 1
            self.last_site[p] = site
            other = self.pending[q]
            if other is not None:
                self._check_pair(p, call, q, other)
                self.pending[q] = None
                _complete(self.run, p, call, q, other)
                other.done = True
                return
            if self.finished[q]:
                raise self._deadlock_returned(waiting=p, call=call, returned=q)
            self.pending[p] = call
            self._leave(p)
            self.turn = q
            self.cv.notify_all()
            while not (call.done and self.turn == p):
                if self.error is not None:
                    raise _Aborted
                self.cv.wait()
            self._enter(p)

    def _describe(self, p: int, call: _SyncCall) -> str:
        return f"program {p} waits in {_api(call.kind)} (its nki.lnc call #{call.index + 1}) at {call.site}"

    def _check_pair(self, p: int, call: _SyncCall, q: int, other: _SyncCall) -> None:
        if call.kind != other.kind:
            raise NkiDeadlockError(
                f"deadlock in the LNC-2 launch of {self.kernel_name}: {self._describe(q, other)}, while "
                f"{self._describe(p, call)}; the cores' nki.lnc calls pair up in program order (the n-th call of one "
                "core meets the n-th of the other, of the same kind), so neither ever proceeds. Make both programs "
                "issue the same sequence of sendrecv/sendrecv_compute/core_barrier calls (control flow must be the "
                "same on every core)"
            )
        if call.kind == "core_barrier":
            return
        for a, b, pa, pb in ((call, other, p, q), (other, call, q, p)):
            if a.args["send_to_rank"] != pb or b.args["recv_from_rank"] != pa:
                raise NkiValidationError(
                    f"{_api(call.kind)} pair #{call.index + 1} of {self.kernel_name} does not match: program {pa} "
                    f"sends to rank {a.args['send_to_rank']} at {a.site}, program {pb} receives from rank "
                    f"{b.args['recv_from_rank']} at {b.site}; each core sends to and receives from its peer"
                )
            src, dst = a.args["src"], b.args["dst"]
            if src.size != dst.size or src.dtype != dst.dtype:
                raise NkiValidationError(
                    f"{_api(call.kind)} pair #{call.index + 1} of {self.kernel_name}: program {pa} sends "
                    f"{fmt_shape(src)} ({a.site}) into program {pb}'s dst {fmt_shape(dst)} ({b.site}); src and "
                    "dst must have the same dtype and element count"
                )

    def _deadlock_returned(self, waiting: int, call: _SyncCall, returned: int) -> NkiDeadlockError:
        last = self.last_site[returned]
        before = (
            f"after its last nki.lnc call (#{self.calls[returned]}) at {last}" if last else "without any nki.lnc call"
        )
        return NkiDeadlockError(
            f"deadlock in the LNC-2 launch of {self.kernel_name}: {self._describe(waiting, call)}, but program "
            f"{returned} returned from {self.kernel_name}{self.kernel_site} {before}; on the device program {waiting} would wait forever. Both programs "
            "must issue the same sequence of nki.lnc calls (a core_barrier under `if nl.program_id(0) == ...` "
            "is the usual cause)"
        )


def _api(kind: str) -> str:
    return f"nki.lnc.{kind}"


# ------------------------------------------------------------------------------------------- completing
def _complete(run: Run, p: int, call: _SyncCall, q: int, other: _SyncCall) -> None:
    """Carry out a matched pair (both programs' halves) and schedule it on both cores' timelines."""
    tl = {p: run.timeline_of((p,)), q: run.timeline_of((q,))}
    calls = {p: call, q: other}
    if call.kind == "core_barrier":
        engines = {r: calls[r].args["engine"] for r in (p, q)}
        data = {r: calls[r].args["data"] for r in (p, q)}
        start = max(tl[r].compute_ready(engines[r], (data[r],), (data[r],)) for r in (p, q))
        for r in (p, q):
            e = run.stats.engines[engines[r]]
            e.instructions += 1
            e.cycles += _cost.FIXED_CYCLES
            tl[r].compute(engines[r], _cost.FIXED_CYCLES, (data[r],), (data[r],), not_before=start)
        return
    low_latency = {r: calls[r].args["dma_engine"] == "gpsimd_dma" for r in (p, q)}
    start = max(
        tl[r].dma_ready((calls[r].args["src"],), (calls[r].args["dst"],), latency=not low_latency[r]) for r in (p, q)
    )
    for r in (p, q):
        src, dst = calls[r].args["src"], calls[r].args["dst"]
        nbytes = src.size * src.itemsize
        run.stats.dma_transfers += 1
        run.stats.dma_bytes_other += nbytes
        e = run.stats.engines["dma"]
        e.instructions += 1
        e.elements += src.size
        parts = src.partitions if src.buffer.on_chip else min(128, max(1, src.shape[0] if src.ndim else 1))
        tl[r].dma(nbytes, parts, (src,), (dst,), not_before=start, latency=not low_latency[r])
    if run.shape_only:
        return
    values = {r: np.asarray(calls[r].args["src"]._arr, np.float32).copy() for r in (p, q)}
    for r, peer in ((p, q), (q, p)):
        dst = calls[r].args["dst"]
        if not dst._arr.flags.writeable:
            raise NkiError(f"{_api(call.kind)}: dst {fmt_shape(dst)} is a broadcast view and cannot be written")
        got = values[peer].reshape(dst.shape)
        if call.kind == "sendrecv_compute":
            fn = _ops.binary(calls[r].args["reduce_op"], _api(call.kind))
            got = fn(values[r].reshape(dst.shape), got)
        run.note_write(dst)
        dst._arr[...] = cast(got, dst.dtype)
        if dst._written is not None:
            dst._written[...] = True


# ------------------------------------------------------------------------------------------------ the API
def _launch(api: str, need_lnc2: bool) -> LncLaunch | None:
    run = current_run()
    launch = run.lnc_launch
    if launch is None and need_lnc2:
        grid = run.grid or ()
        raise NkiValidationError(
            f"{api} exchanges data between the two cores of a logical NeuronCore and needs an LNC-2 launch "
            f"(kernel[2](...)); this launch's grid is {list(grid) or 'none (LNC 1)'}"
        )
    return launch


def _need_v3(api: str) -> None:
    gen = current_run().gen.name
    if gen == "trn1":
        raise NkiValidationError(f"{api} needs NeuronCore-v3 or newer (trn2/trn3); this run targets {gen}")


def _check_rank(api: str, role: str, rank: Any) -> int:
    if not isinstance(rank, (int, np.integer)) or int(rank) not in (0, 1):
        raise NkiValidationError(f"{api}: {role}={rank!r} must be 0 or 1 (a rank within the LNC-2 logical core)")
    return int(rank)


def _check_priority(api: str, priority: Any, dma_engine: Any = "dma") -> None:
    if priority is None:
        return
    if dma_engine == "gpsimd_dma":
        raise NkiValidationError(f"{api}: priority={priority!r} with dma_engine=gpsimd_dma; it requires priority=None")
    if not isinstance(priority, (int, np.integer)) or not 0 <= int(priority) <= 3:
        raise NkiValidationError(f"{api}: priority={priority!r} must be 0 (highest) to 3 (lowest) or None")


def exchange(
    api: str, kind: str, src: Any, dst: Any, send_to_rank: Any, recv_from_rank: Any, extra: dict[str, Any]
) -> None:
    launch = _launch(api, need_lnc2=True)
    _need_v3(api)
    for t, role in ((src, "src"), (dst, "dst")):
        if not isinstance(t, NkiTensor):
            raise NkiError(f"{api}: {role} must be an NKI tensor, got {type(t).__name__}")
    to, frm = _check_rank(api, "send_to_rank", send_to_rank), _check_rank(api, "recv_from_rank", recv_from_rank)
    me = current_run().program_id[0]
    if me in (to, frm):
        raise NkiUnsupportedError(
            f"{api}: program {me} sends to rank {to} and receives from rank {frm}; an exchange with its own rank is "
            "not emulated (use nisa.dma_copy for a local copy)"
        )
    if kind == "sendrecv":
        for t, role in ((src, "src"), (dst, "dst")):
            if t.buffer != "sbuf":
                raise NkiValidationError(f"{api}: {role} {fmt_shape(t)} is in {t.buffer}; src and dst must be in SBUF")
    else:
        kinds = {src.buffer, dst.buffer}
        if kinds not in ({"sbuf"}, {"hbm"}):
            raise NkiValidationError(
                f"{api}: src {fmt_shape(src)} and dst {fmt_shape(dst)} must be in the same memory, both SBUF or "
                "both private HBM (shared HBM is not supported)"
            )
    run = current_run()
    run.step()
    launch.sync(kind, {"src": src, "dst": dst, "send_to_rank": to, "recv_from_rank": frm, **extra})


def sendrecv(
    src: NkiTensor,
    dst: NkiTensor,
    send_to_rank: int,
    recv_from_rank: int,
    dma_engine: Any = "dma",
    name: str = "",
    priority: Any = None,
) -> None:
    """Send ``src`` to the peer core's ``dst`` while receiving the peer's ``src`` into this core's ``dst``
    (NKI 0.8; LNC-2 launches; the n-th call of each core pair up)."""
    api = "nki.lnc.sendrecv"
    require(api, "0.8")
    _check_priority(api, priority, dma_engine)
    if dma_engine not in ("dma", "gpsimd_dma"):
        raise NkiValidationError(f"{api}: dma_engine={dma_engine!r}; use nki.isa.dma_engine.dma or .gpsimd_dma")
    exchange(api, "sendrecv", src, dst, send_to_rank, recv_from_rank, {"dma_engine": dma_engine})


def sendrecv_compute(
    src: NkiTensor,
    dst: NkiTensor,
    send_to_rank: int,
    recv_from_rank: int,
    reduce_op: Any,
    name: str = "",
    priority: Any = None,
) -> None:
    """``dst = reduce_op(src, peer's src)`` on both cores of an LNC-2 launch (``nl.add``/``maximum``/``minimum``)."""
    api = "nki.lnc.sendrecv_compute"
    require(api, "0.8")
    sendrecv_compute_impl(api, src, dst, send_to_rank, recv_from_rank, reduce_op, priority)


def sendrecv_compute_impl(
    api: str, src: Any, dst: Any, send_to_rank: Any, recv_from_rank: Any, reduce_op: Any, priority: Any
) -> None:
    _check_priority(api, priority)
    op = _ops.op_name(reduce_op)
    if op not in ("add", "maximum", "minimum"):
        raise NkiValidationError(f"{api}: reduce_op {op!r}; supported: nl.add, nl.maximum, nl.minimum")
    exchange(api, "sendrecv_compute", src, dst, send_to_rank, recv_from_rank, {"reduce_op": op, "dma_engine": "dma"})


def core_barrier(data: NkiTensor, cores: Any, engine: Any = "gpsimd", name: str = "") -> None:
    """Wait until both cores of the pair reach their barrier (``cores=(0, 1)``; ``data``: the shared-HBM tensor
    both wrote before it and read after it)."""
    api = "nki.lnc.core_barrier"
    require(api, "0.8")
    core_barrier_impl(api, data, cores, engine)


def core_barrier_impl(api: str, data: Any, cores: Any, engine: Any) -> None:
    _need_v3(api)
    if tuple(cores) != (0, 1):
        raise NkiValidationError(f"{api}: cores={cores!r}; only cores=(0, 1) is supported")
    if not isinstance(data, NkiTensor) or data.buffer != "shared_hbm":
        what = fmt_shape(data) if isinstance(data, NkiTensor) else type(data).__name__
        raise NkiValidationError(f"{api}: data {what} must be a shared-HBM tensor (nl.shared_hbm) both cores access")
    eng = engine or "gpsimd"
    if eng not in ("tensor", "vector", "scalar", "gpsimd", "sync"):
        raise NkiValidationError(f"{api}: engine={engine!r} is not an engine of the NeuronCore")
    launch = _launch(api, need_lnc2=False)
    if launch is None:
        raise NkiUnsupportedError(
            f"{api} in a launch of one program (LNC 1): the barrier waits for the paired physical core, which runs "
            "its own launch; the emulator runs one launch at a time, so it cannot emulate it. Launch the kernel as "
            "kernel[2](...) to synchronize its two programs"
        )
    current_run().step()
    # the model has no queue for the sync engine: its barrier is placed on GpSimd
    launch.sync("core_barrier", {"data": data, "engine": "gpsimd" if eng == "sync" else eng})
