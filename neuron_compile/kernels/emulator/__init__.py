"""An emulator of the current NKI API (``import nki``; ``nki.language as nl``; ``nki.isa as nisa``) on NumPy.

``from neuron_compile import nki`` is the public face (it re-exports the real ``nki`` where that is
installed). Entry points:

* ``@nki.jit`` makes a :class:`Kernel`; calling it with NumPy arrays or torch tensors runs it here.
* ``nki.simulate(kernel, stats=False, target=None)(*arrays)`` runs it and returns the outputs in the
  inputs' format (torch in, torch out); ``stats=True`` returns ``(outputs, RunStats)``.
* ``nki.infer_shapes(kernel, target=None)(*specs)`` runs it on shapes/dtypes alone (anything with
  ``.shape`` and ``.dtype``: torch fake/meta tensors, NumPy arrays, :class:`TensorSpec`) and returns
  :class:`TensorSpec` outputs; every hardware rule is checked, nothing is computed.
* ``nki.last_run_stats()`` gives the counters of the last run on this thread.
* ``kernel[2](...)`` runs the two programs of an LNC-2 launch as turn-taking threads whose ``nki.lnc`` calls
  pair up (:mod:`.lnc`); ``nki_version=`` / ``NEURON_COMPILE_NKI_VERSION`` picks the NKI release the run
  enforces (:mod:`.versions`).

See docs/nki.md for what is checked and what is not.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import isa, language, lnc
from .dtypes import dtype_name, np_dtype
from .errors import (
    NkiBudgetError,
    NkiCapacityError,
    NkiError,
    NkiOutOfBoundsError,
    NkiUndeclaredMutationError,
    NkiUnsupportedError,
    NkiValidationError,
)
from .legacy_namespace import install as _install_legacy_namespace_finder
from .lnc import LncLaunch, NkiDeadlockError
from .run import (
    KernelArg,
    Run,
    RunStats,
    in_kernel,
    last_run_stats,
    pop_run,
    push_run,
    report_arg_writes,
    watch_arg_writes,
)
from .settings import DEFAULT_MAX_STEPS, MAX_STEPS_ENV, max_steps_default
from .tensors import NkiTensor, wrap_hbm
from .versions import DEFAULT_VERSION, VERSION_ENV, VERSIONS, NkiVersionError, NkiWarning

_install_legacy_namespace_finder()  # `import neuronxcc.nki` fails with the migration message (Neuron 2.34)

__all__ = [
    "DEFAULT_MAX_STEPS",
    "MAX_STEPS_ENV",
    "Kernel",
    "DEFAULT_VERSION",
    "VERSIONS",
    "VERSION_ENV",
    "NkiBudgetError",
    "NkiCapacityError",
    "NkiDeadlockError",
    "NkiError",
    "NkiOutOfBoundsError",
    "NkiTensor",
    "NkiUndeclaredMutationError",
    "NkiUnsupportedError",
    "NkiValidationError",
    "NkiVersionError",
    "NkiWarning",
    "RunStats",
    "TensorSpec",
    "infer_shapes",
    "isa",
    "jit",
    "language",
    "last_run_stats",
    "lnc",
    "simulate",
    "watch_arg_writes",
]


@dataclass(frozen=True)
class TensorSpec:
    """Shape and NKI dtype string of a tensor (the result of shape-only mode)."""

    shape: tuple[int, ...]
    dtype: str

    def torch_dtype(self) -> Any:
        import torch

        return {
            "bfloat16": torch.bfloat16,
            "float32": torch.float32,
            "float16": torch.float16,
            "int32": torch.int32,
            "int8": torch.int8,
            "int16": torch.int16,
            "uint8": torch.uint8,
            "bool_": torch.bool,
            "tfloat32": torch.float32,
        }[self.dtype]


class Kernel:
    """A function decorated with ``@nki.jit``; ``kernel[n]`` sets an SPMD grid (run serially here)."""

    def __init__(self, fn: Callable[..., Any], grid: tuple[int, ...] = (), **options: Any):
        self.fn = fn
        self.grid = grid
        self.options = options
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid: Any) -> Kernel:
        """``kernel[lnc]`` launches on a logical NeuronCore of ``lnc`` physical cores (1 or 2; NKI 0.6+):
        ``nl.num_programs()`` is ``lnc`` and ``nl.program_id()`` tells the cores apart. Any other grid
        (``kernel[4]``, ``kernel[2, 3]``) is the legacy SPMD launch, still accepted. Programs run here one
        after another, sharing ``shared_hbm`` tensors; counters are kept per program for the cost model."""
        grid = grid if isinstance(grid, tuple) else (grid,)
        return Kernel(self.fn, tuple(int(g) for g in grid), **self.options)

    @property
    def lnc(self) -> int:
        """The logical-core degree of the launch (what the real nki's compile reads): ``n`` for ``kernel[n]``
        with n in (1, 2), else 1."""
        return self.grid[0] if len(self.grid) == 1 and self.grid[0] in (1, 2) else 1

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if in_kernel():  # a sub-kernel called from a kernel is inlined, as NKI does
            return self.fn(*args, **kwargs)
        if any(_is_data_free(a) for a in (*args, *kwargs.values())):
            return _data_free_outputs(self, args, kwargs)
        return simulate(self)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"nki.jit({getattr(self.fn, '__qualname__', self.fn)})"


def jit(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Decorate an NKI kernel (``@nki.jit`` or ``@nki.jit(...)``); ``mode=`` is accepted and ignored."""
    if "platform_target" in options:
        raise NkiError(
            "nki.jit(platform_target=...) is an error in current NKI; set "
            "NEURON_PLATFORM_TARGET_OVERRIDE or pass target= to nki.simulate"
        )
    if fn is None:
        return lambda f: Kernel(f, **options)
    if isinstance(fn, Kernel):
        return fn
    return Kernel(fn, **options)


# ------------------------------------------------------------------------------------------- conversions
def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "dtype") and hasattr(x, "shape")


def _is_data_free(x: Any) -> bool:
    """A torch fake or meta tensor: what torch.compile traces with (``nki_op``'s fake implementation)."""
    if not _is_torch(x):
        return False
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(x) or x.device.type == "meta"


def _data_free_outputs(kernel: Kernel, args: tuple, kwargs: dict) -> Any:
    """A kernel called on fake/meta tensors: shape-only mode, outputs as empty tensors of the ambient
    (fake) mode with the inferred shapes and dtypes; every hardware rule is still checked."""
    like = next(a for a in (*args, *kwargs.values()) if _is_data_free(a))
    specs = infer_shapes(kernel)(*args, **kwargs)

    def make(spec: Any) -> Any:
        if isinstance(spec, tuple):
            return tuple(make(s) for s in spec)
        if isinstance(spec, TensorSpec):
            return like.new_empty(spec.shape, dtype=spec.torch_dtype())
        return spec

    return make(specs)


def torch_to_numpy(t: Any) -> np.ndarray:
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)  # shares memory, so in-place works
    return t.numpy()


def numpy_to_torch(a: np.ndarray) -> Any:
    import ml_dtypes
    import torch

    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _to_arg(x: Any, name: str, shape_only: bool) -> Any:
    if shape_only and hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, (int, float)):
        dt = dtype_name(x.dtype)
        shape = tuple(int(s) for s in x.shape)
        arr = np.broadcast_to(np.zeros((), np_dtype(dt)), shape)
        return NkiTensor(arr, dt, language.hbm, KernelArg(name, x), name)
    if isinstance(x, NkiTensor):
        return x
    if _is_torch(x):
        return _arg(wrap_hbm(torch_to_numpy(x), name), x)
    if isinstance(x, np.ndarray):
        return _arg(wrap_hbm(x, name), x)
    if hasattr(x, "__array__") and hasattr(x, "shape") and hasattr(x, "dtype"):  # jax.Array and the like
        return _arg(wrap_hbm(np.asarray(x), name), x)
    if isinstance(x, tuple):
        return tuple(_to_arg(v, f"{name}[{i}]", shape_only) for i, v in enumerate(x))
    if isinstance(x, list):
        raise NkiError(f"kernel argument {name!r} is a list; NKI kernels take tuples, not lists")
    return x


def _arg(t: NkiTensor, source: Any) -> NkiTensor:
    """Mark ``t`` (and so every view of it) as the kernel argument ``source``, so writes to it are known."""
    t._alloc = KernelArg(t.name, source)
    return t


def _from_out(x: Any, as_torch: bool, shape_only: bool, inputs: dict[int, Any]) -> Any:
    if isinstance(x, tuple):
        return tuple(_from_out(v, as_torch, shape_only, inputs) for v in x)
    if isinstance(x, NkiTensor):
        if x.buffer.on_chip or x.buffer == "hbm" and id(x) not in inputs:
            raise NkiValidationError(
                f"kernel output {x!r} is in {x.buffer}; outputs must be allocated with "
                "nl.ndarray(..., buffer=nl.shared_hbm), filled by DMA and returned"
            )
        if shape_only:
            return TensorSpec(x.shape, x.dtype)
        if id(x) in inputs:
            return inputs[id(x)]
        arr = np.asarray(x._arr)
        return numpy_to_torch(arr) if as_torch else arr
    return x


def _run(
    kernel: Any,
    args: tuple,
    kwargs: dict,
    *,
    shape_only: bool,
    target: str | None,
    max_steps: int | None = None,
    nki_version: str | None = None,
) -> tuple[Any, RunStats]:
    kern = kernel if isinstance(kernel, Kernel) else Kernel(kernel)
    as_torch = any(_is_torch(a) for a in (*args, *kwargs.values())) and not shape_only
    try:
        params = list(inspect.signature(kern.fn).parameters)
    except (TypeError, ValueError):
        params = []
    name = getattr(kern.fn, "__qualname__", None) or repr(kern.fn)
    budget = max_steps_default() if max_steps is None else max_steps
    if budget < 0:
        raise NkiError(f"max_steps={budget} for kernel {name} is negative (a step budget; 0 means no limit)")
    run = Run(target, shape_only=shape_only, kernel=name, max_steps=budget, nki_version=nki_version)
    push_run(run)
    try:
        nargs = tuple(_to_arg(a, params[i] if i < len(params) else f"arg{i}", shape_only) for i, a in enumerate(args))
        nkw = {k: _to_arg(v, k, shape_only) for k, v in kwargs.items()}
        inputs = {
            id(n): o for n, o in zip((*nargs, *nkw.values()), (*args, *kwargs.values())) if isinstance(n, NkiTensor)
        }
        grid = kern.grid or ()
        ids = list(np.ndindex(*grid)) if grid else [()]
        run.grid = grid
        run.grid_ids = ids
        out = None
        if grid == (2,):  # LNC 2: the two programs run concurrently, pairing their nki.lnc calls
            run.lnc_launch = LncLaunch(run, 2)
            out = run.lnc_launch.run_programs(kern.fn, nargs, nkw)
        else:  # LNC 1, or a legacy grid (its programs ran one after another on one core)
            for pid in ids:
                run.program_id = tuple(int(i) for i in pid)
                run.shared_next = 0
                out = kern.fn(*nargs, **nkw)
        result = _from_out(out, as_torch, shape_only, inputs)
        run.finish()
    finally:
        run.end()  # its SBUF/PSUM is given back even if a traceback keeps its tiles alive
        pop_run()
    report_arg_writes(run)
    return result, run.stats


def simulate(
    kernel: Any,
    *,
    stats: bool = False,
    target: str | None = None,
    max_steps: int | None = None,
    nki_version: str | None = None,
) -> Callable[..., Any]:
    """``simulate(kernel)(*arrays)`` runs ``kernel`` in the emulator on NumPy arrays or torch tensors.

    Outputs come back as NumPy arrays (bf16 as ``ml_dtypes.bfloat16``), or torch tensors when any input
    is a torch tensor. HBM inputs are wrapped without a copy, so in-place writes reach the caller.
    ``target``: ``'trn2'`` (default, or ``NEURON_PLATFORM_TARGET_OVERRIDE``), ``'trn3'`` or ``'trn1'``.
    ``stats=True`` returns ``(outputs, RunStats)``. ``max_steps``: the run's budget of instructions plus
    ``nl`` loop iterations, past which it raises :class:`NkiBudgetError` (default
    ``NEURON_COMPILE_NKI_MAX_STEPS`` or :data:`DEFAULT_MAX_STEPS`; 0: no limit). ``nki_version``: the NKI
    release whose API the run enforces, ``"0.6"``, ``"0.7"`` or ``"0.8"`` (default ``NEURON_COMPILE_NKI_VERSION``
    or 0.8; emulator/versions.py).
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        out, st = _run(
            kernel, args, kwargs, shape_only=False, target=target, max_steps=max_steps, nki_version=nki_version
        )
        return (out, st) if stats else out

    return call


def infer_shapes(
    kernel: Any,
    *,
    stats: bool = False,
    target: str | None = None,
    max_steps: int | None = None,
    nki_version: str | None = None,
) -> Callable[..., Any]:
    """Shape-only mode: ``infer_shapes(kernel)(*specs)`` -> :class:`TensorSpec` outputs (and stats).

    Runs the kernel's Python with data-free tensors: every shape, dtype, buffer and capacity rule is
    checked and every instruction counted, but nothing is computed, so it is cheap at any size.
    Non-tensor arguments (ints, floats, flags) are passed through unchanged. ``max_steps`` and
    ``nki_version`` as for :func:`simulate`.
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        out, st = _run(
            kernel, args, kwargs, shape_only=True, target=target, max_steps=max_steps, nki_version=nki_version
        )
        return (out, st) if stats else out

    return call
