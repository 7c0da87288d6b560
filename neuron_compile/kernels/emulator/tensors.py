"""NKI tensors: :class:`NkiTensor` (a NumPy view of its allocation's storage plus dtype and buffer; slicing
and the documented view primitives share storage), :class:`ds`, and the allocation of new tensors
(:func:`new_tensor`) and of HBM kernel arguments (:func:`wrap_hbm`).

Every tensor is a NumPy view of its allocation's storage, so slicing costs nothing and writes through a view
land in the storage. In shape-only mode the storage is a zero-stride broadcast of one element: shapes, dtypes
and every hardware rule are checked exactly as with data, but nothing is computed or allocated.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np

from .dtypes import dtype_name, fill_value, is_float, itemsize, np_dtype
from .errors import NkiError, NkiOutOfBoundsError, NkiUnsupportedError, NkiValidationError
from .memory import PMAX, Buffer, hbm, sbuf
from .run import Run, current_run


class Allocation:
    """The owner of one on-chip allocation's SBUF/PSUM (the ``_alloc`` of every view of it). Its reservation
    is given back when the last view goes away (the tile went out of scope) or when its run ends, whichever
    comes first: never later than the run."""

    __slots__ = ("__weakref__", "bank", "name")

    def __init__(self, run: Run, buffer: Buffer, per_partition: int, name: str):
        self.name = name
        res = run.allocate(buffer, per_partition, name)
        # the PSUM bank: the cost model orders instructions on the physical bank, which tiles reuse
        self.bank = None if res is None else res.bank
        if res is not None:
            run.memory.on_release(res, weakref.finalize(self, run.release, res))


class ds:
    """``nl.ds(start, size)``: a dynamic slice ``start:start+size``."""

    __slots__ = ("size", "start")

    def __init__(self, start: int, size: int):
        self.start, self.size = int(start), int(size)

    def as_slice(self) -> slice:
        return slice(self.start, self.start + self.size)


def fmt_shape(t: NkiTensor) -> str:
    return f"{t.name or 'tensor'}{list(t.shape)}:{t.dtype}@{t.buffer}"


class NkiTensor:
    """An NKI tensor or a view of one: a NumPy view plus dtype and buffer; views share storage."""

    __slots__ = ("_alloc", "_arr", "_root", "_written", "buffer", "dtype", "name", "p0", "pstep")

    def __init__(
        self,
        arr: np.ndarray,
        dtype: str,
        buffer: Buffer,
        alloc: Any = None,
        name: str = "",
        written: np.ndarray | None = None,
        p0: int = 0,
        pstep: int = 1,
        root: tuple[np.ndarray, np.ndarray | None] | None = None,
    ):
        self.p0 = p0  # first partition of this view in its allocation (on chip)
        self.pstep = pstep  # partition stride of this view (compute engines need 1)
        self._arr = arr
        self._written = written
        # the whole allocation (storage and PSUM written-mask): what ``.ap`` patterns index, flattened
        self._root = (arr, written) if root is None else root
        self._alloc = alloc
        self.dtype = dtype
        self.buffer = buffer
        self.name = name

    # ---- metadata
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._arr.shape)

    @property
    def ndim(self) -> int:
        return self._arr.ndim

    @property
    def size(self) -> int:
        return int(self._arr.size)

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def partitions(self) -> int:
        return self.shape[0] if self.ndim else 1

    @property
    def free_size(self) -> int:
        """Elements per partition."""
        return int(math.prod(self.shape[1:])) if self.ndim > 1 else 1

    def __repr__(self) -> str:
        return f"NkiTensor({fmt_shape(self)})"

    # ---- views
    def _view(
        self, arr: np.ndarray, written: np.ndarray | None = None, p0: int | None = None, pstep: int | None = None
    ) -> NkiTensor:
        return NkiTensor(
            arr,
            self.dtype,
            self.buffer,
            self._alloc,
            self.name,
            written,
            self.p0 if p0 is None else p0,
            self.pstep if pstep is None else pstep,
            self._root,
        )

    def _normalize_key(self, key: Any) -> tuple:
        key = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis for k in key):
            i = next(i for i, k in enumerate(key) if k is Ellipsis)
            fill = self.ndim - (len(key) - 1)
            key = key[:i] + (slice(None),) * fill + key[i + 1 :]
        if len(key) > self.ndim:
            raise NkiOutOfBoundsError(f"too many indices ({len(key)}) for {fmt_shape(self)}")
        out = []
        for d, k in enumerate(key):
            n = self.shape[d]
            if isinstance(k, ds):
                k = k.as_slice()
            if isinstance(k, slice):
                step = 1 if k.step is None else int(k.step)
                if step <= 0:
                    raise NkiError(f"slice step must be positive, got {step} on dim {d} of {fmt_shape(self)}")
                start = 0 if k.start is None else int(k.start)
                stop = n if k.stop is None else int(k.stop)
                if start < 0 or stop > n or start > stop:
                    raise NkiOutOfBoundsError(
                        f"access out of bound: [{start}:{stop}] on dim {d} (size {n}) of {fmt_shape(self)}"
                    )
                out.append(slice(start, stop, step))
            elif isinstance(k, (int, np.integer)):
                k = int(k)
                if not -n <= k < n:
                    raise NkiOutOfBoundsError(
                        f"access out of bound: index {k} on dim {d} (size {n}) of {fmt_shape(self)}"
                    )
                out.append(k % n)
            else:
                raise NkiError(f"unsupported index {k!r} on {fmt_shape(self)}: use ints, slices or nl.ds")
        if self.buffer.on_chip and out and isinstance(out[0], int):
            out[0] = slice(out[0], out[0] + 1)  # an integer on the partition dim keeps a size-1 dim
        if self.buffer.on_chip:
            full = out + [slice(None)] * (self.ndim - len(out))
            while sum(not isinstance(k, int) for k in full) < 2:  # on chip, results stay >= 2-D
                j = max(i for i, k in enumerate(full) if isinstance(k, int))
                full[j] = slice(full[j], full[j] + 1)
            out = full
        return tuple(out)

    def __getitem__(self, key: Any) -> NkiTensor:
        k = self._normalize_key(key)
        p0, pstep = self.p0, self.pstep
        if self.buffer.on_chip and k:
            p0, pstep = p0 + k[0].start * pstep, pstep * (k[0].step or 1)
        return self._view(self._arr[k], None if self._written is None else self._written[k], p0, pstep)

    def __setitem__(self, key: Any, value: Any) -> None:
        raise NkiError(
            f"assigning into {fmt_shape(self)} with [...] = is not an NKI operation; write with "
            "nisa.tensor_copy / nisa.dma_copy (or nl.store for HBM)"
        )

    def reshape(self, shape: Any) -> NkiTensor:
        """A view with another shape and the same element count (storage must be contiguous)."""
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        if math.prod(shape) != self.size:
            raise NkiValidationError(
                f"reshape of {fmt_shape(self)} to {list(shape)} changes the element count "
                f"({self.size} -> {math.prod(shape)})"
            )
        _check_partitions(shape, self.buffer, "reshape")
        if current_run().shape_only:
            w = None if self._written is None else np.broadcast_to(np.zeros((), bool), shape)
            return self._view(np.broadcast_to(np.zeros((), self._arr.dtype), shape), w)
        arr = self._arr.reshape(shape)
        if not np.shares_memory(arr, self._arr) and self._arr.size:
            raise NkiError(f"reshape of non-contiguous view {fmt_shape(self)} would copy; reshape the base tensor")
        return self._view(arr, None if self._written is None else self._written.reshape(shape))

    def broadcast(self, dim: int, size: int) -> NkiTensor:
        """A read-only view repeating size-1 dim ``dim`` ``size`` times (not dim 0 on chip)."""
        n = size
        if self.buffer.on_chip and dim == 0:
            raise NkiValidationError(
                f"broadcast along the partition dim of on-chip {fmt_shape(self)} "
                "is not a view; copy per partition instead"
            )
        shape = list(self.shape)
        if shape[dim] != 1:
            raise NkiError(f"broadcast needs dim {dim} of {fmt_shape(self)} to be 1")
        shape[dim] = n
        return self._view(np.broadcast_to(self._arr, shape))

    def broadcast_to(self, shape: Any) -> NkiTensor:
        if self.buffer.on_chip and next(iter(shape)) != self.shape[0]:
            raise NkiValidationError(f"cannot broadcast the partition dim of on-chip {fmt_shape(self)}")
        return self._view(np.broadcast_to(self._arr, tuple(shape)))

    def view(self, dtype: Any) -> NkiTensor:
        name = dtype_name(dtype)
        if itemsize(name) != self.itemsize:
            raise NkiError(f"view of {fmt_shape(self)} as {name} changes the element size")
        try:
            root = (self._root[0].view(np_dtype(name)), self._root[1])
        except ValueError:
            root = None
        return NkiTensor(
            self._arr.view(np_dtype(name)),
            name,
            self.buffer,
            self._alloc,
            self.name,
            p0=self.p0,
            pstep=self.pstep,
            root=root,
        )

    reinterpret_cast = view

    # ---- the documented view primitives of NkiTensor (NKI 0.6): metadata only, storage shared
    def _no_partition_dim(self, dim: int, what: str) -> None:
        if self.buffer.on_chip and dim == 0:
            raise NkiValidationError(
                f"NkiTensor.{what}: dim 0 of on-chip {fmt_shape(self)} is the partition "
                "dim, which this view cannot change"
            )

    def _dim(self, dim: int, what: str, extra: int = 0) -> int:
        n = self.ndim + extra
        if not -n <= int(dim) < n:
            raise NkiError(f"NkiTensor.{what}: dim {dim} out of range for {fmt_shape(self)}")
        return int(dim) % n

    def _mapped(self, fn: Any) -> NkiTensor:
        return self._view(fn(self._arr), None if self._written is None else fn(self._written))

    def permute(self, dims: tuple[int, ...]) -> NkiTensor:
        """Reorder the dims (a view); on chip ``dims[0]`` must be 0."""
        dims = tuple(self._dim(d, "permute") for d in dims)
        if sorted(dims) != list(range(self.ndim)):
            raise NkiValidationError(
                f"NkiTensor.permute: {tuple(dims)} is not a permutation of range({self.ndim}) for {fmt_shape(self)}"
            )
        if self.buffer.on_chip and dims[0] != 0:
            raise NkiValidationError(
                f"NkiTensor.permute: on-chip {fmt_shape(self)} keeps the partition dim "
                f"first; dims[0] must be 0, got {tuple(dims)}"
            )
        return self._mapped(lambda a: a.transpose(dims))

    def expand_dim(self, dim: int) -> NkiTensor:
        """Insert a size-1 dim at ``dim`` (not 0 on chip)."""
        d = self._dim(dim, "expand_dim", extra=1)
        self._no_partition_dim(d, "expand_dim")
        return self._mapped(lambda a: np.expand_dims(a, d))

    def squeeze_dim(self, dim: int) -> NkiTensor:
        """Remove size-1 dim ``dim`` (not 0 on chip)."""
        d = self._dim(dim, "squeeze_dim")
        self._no_partition_dim(d, "squeeze_dim")
        if self.shape[d] != 1:
            raise NkiValidationError(f"NkiTensor.squeeze_dim: dim {d} of {fmt_shape(self)} is not 1")
        return self._mapped(lambda a: a.squeeze(d))

    def reshape_dim(self, dim: int, shape: tuple[int, ...]) -> NkiTensor:
        """Split dim ``dim`` into ``shape`` (one entry may be -1)."""
        d = self._dim(dim, "reshape_dim")
        shape = [int(s) for s in shape]
        if shape.count(-1) == 1:
            known = math.prod(s for s in shape if s != -1)
            shape[shape.index(-1)] = self.shape[d] // known if known else 0
        if math.prod(shape) != self.shape[d]:
            raise NkiValidationError(
                f"NkiTensor.reshape_dim: {shape} does not multiply to dim {d} ({self.shape[d]}) of {fmt_shape(self)}"
            )
        if len(shape) > 1:
            self._no_partition_dim(d, "reshape_dim")
        new = (*self.shape[:d], *shape, *self.shape[d + 1 :])
        return self._mapped(
            lambda a: a.reshape(new) if current_run().shape_only else _reshape_view(a, new, self, "reshape_dim")
        )

    def flatten_dims(self, start_dim: int, end_dim: int) -> NkiTensor:
        """Merge dims ``start_dim..end_dim`` (inclusive; contiguous in storage; start > 0 on chip)."""
        a, b = self._dim(start_dim, "flatten_dims"), self._dim(end_dim, "flatten_dims")
        if self.buffer.on_chip and a == 0:
            raise NkiValidationError(f"NkiTensor.flatten_dims: start_dim must be > 0 for on-chip {fmt_shape(self)}")
        new = (*self.shape[:a], math.prod(self.shape[a : b + 1]), *self.shape[b + 1 :])
        return self._mapped(
            lambda x: x.reshape(new) if current_run().shape_only else _reshape_view(x, new, self, "flatten_dims")
        )

    def slice(self, dim: int, start: int, end: int, step: int = 1) -> NkiTensor:
        """``t[..., start:end:step, ...]`` on dim ``dim``."""
        d = self._dim(dim, "slice")
        return self[(slice(None),) * d + (slice(int(start), int(end), int(step)),)]

    def select(self, dim: int, index: Any) -> NkiTensor:
        """Drop dim ``dim`` at ``index`` (an int, or a 1x1 SBUF tensor / NkiScalar read at run time)."""
        d = self._dim(dim, "select")
        self._no_partition_dim(d, "select")
        i = runtime_int(index, "NkiTensor.select")
        if not 0 <= i < self.shape[d]:
            raise NkiOutOfBoundsError(
                f"NkiTensor.select: index {i} on dim {d} (size {self.shape[d]}) of {fmt_shape(self)}"
            )
        key = (slice(None),) * d + (i,)
        return self._view(self._arr[key], None if self._written is None else self._written[key])

    def is_indirect(self) -> bool:
        return False

    @property
    def data(self) -> NkiTensor:
        """The tensor itself (grids and tensors both expose their operand as ``.data`` in NKI 0.7)."""
        return self

    @property
    def strides(self) -> tuple[int, ...]:
        """Element strides of this view in its allocation."""
        return tuple(int(s) // self._arr.itemsize for s in self._arr.strides)

    @property
    def offset(self) -> int:
        """Element offset of this view's first element in its allocation."""
        base = self._root[0]
        if base.size == 0 or self._arr.size == 0:
            return 0
        return (self._arr.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // self._arr.itemsize

    def get_pattern(self) -> list[list[int]]:
        """This view as ``[[stride, count], ...]`` over its allocation (the input of :meth:`ap`)."""
        return [[st, n] for st, n in zip(self.strides, self.shape)]

    def is_contiguous(self) -> bool:
        dims = list(zip(self.shape, self.strides))[1 if self.buffer.on_chip else 0 :]
        expect = 1
        for n, st in reversed(dims):
            if n != 1 and st != expect:
                return False
            expect *= n
        return True

    def ap(
        self,
        pattern: Any,
        offset: int = 0,
        scalar_offset: Any = None,
        vector_offset: Any = None,
        indirect_dim: int = 0,
        dtype: Any = None,
    ) -> NkiTensor:
        """A hardware access pattern: element ``[i0, i1, ...]`` of the result is element
        ``offset + sum(step_k * i_k)`` of this tensor's allocation flattened, counted from this view's first
        element, with ``pattern = [[step_0, count_0], ...]``. On chip the first pair is the partition access
        and its step must be the allocation's free size. ``scalar_offset`` (an int, a 1x1 SBUF tensor or an
        NkiScalar) moves the start by that many steps of dim ``indirect_dim``; ``dtype`` reinterprets the
        storage (pattern and offset then count elements of that dtype)."""
        if vector_offset is not None:
            raise NkiUnsupportedError(
                "NkiTensor.ap(vector_offset=...) (per-partition indirect addressing) is "
                "not implemented by the emulator; use nl.load per index or a static pattern"
            )
        pat = [(int(st), int(n)) for st, n in pattern]
        if not pat or any(n <= 0 for _, n in pat):
            raise NkiValidationError(f"NkiTensor.ap: pattern {pattern} needs [step, count] pairs with count > 0")
        root, root_w = self._root
        name = self.dtype if dtype is None else dtype_name(dtype)
        ratio_num, ratio_den = self.itemsize, itemsize(name)
        start = (self.offset * ratio_num) // ratio_den + int(offset)
        if scalar_offset is not None:
            if not 0 <= int(indirect_dim) < len(pat):
                raise NkiValidationError(f"NkiTensor.ap: indirect_dim {indirect_dim} outside pattern {pattern}")
            start += runtime_int(scalar_offset, "NkiTensor.ap(scalar_offset=...)") * pat[int(indirect_dim)][0]
        total = root.size * ratio_num // ratio_den
        p0 = 0
        if self.buffer.on_chip:
            free = total // root.shape[0]
            if pat[0][1] > 1 and pat[0][0] != free:
                raise NkiValidationError(
                    f"NkiTensor.ap: on-chip pattern {pattern} must start with the partition access [{free}, P] "
                    f"(step = the allocation's {free} elements per partition; partitions are contiguous)"
                )
            if pat[0][1] > PMAX:
                raise NkiValidationError(
                    f"NkiTensor.ap: Size of partition dimension {pat[0][1]} exceeds maximum {PMAX}"
                )
            p0 = start // free
        lo = start + sum(min(0, (n - 1) * st) for st, n in pat)
        hi = start + sum(max(0, (n - 1) * st) for st, n in pat)
        if lo < 0 or hi >= total:
            raise NkiOutOfBoundsError(
                f"NkiTensor.ap: pattern {pattern} at offset {start} reaches elements "
                f"[{lo}, {hi}] of {fmt_shape(self)}'s allocation of {total} elements"
            )
        shape = tuple(n for _, n in pat)
        if current_run().shape_only or root.strides == (0,) * root.ndim:
            arr = np.broadcast_to(np.zeros((), np_dtype(name)), shape)
            w = None if root_w is None else np.broadcast_to(np.zeros((), bool), shape)
            return NkiTensor(arr, name, self.buffer, self._alloc, self.name, w, p0, 1, self._root)
        if not root.flags.c_contiguous:
            raise NkiUnsupportedError(
                f"NkiTensor.ap on {fmt_shape(self)}: its storage is a non-contiguous "
                "array (pass a contiguous tensor to the kernel)"
            )
        flat = root.reshape(-1).view(np_dtype(name)) if name != self.dtype else root.reshape(-1)
        isz = flat.itemsize
        arr = np.lib.stride_tricks.as_strided(flat[start:], shape, tuple(st * isz for st, _ in pat))
        w = None
        if root_w is not None:
            if name != self.dtype:
                raise NkiUnsupportedError("NkiTensor.ap(dtype=...) on a PSUM tensor")
            w = np.lib.stride_tricks.as_strided(root_w.reshape(-1)[start:], shape, tuple(st for st, _ in pat))
        new_root = (root.view(np_dtype(name)) if name != self.dtype else root, root_w)
        return NkiTensor(arr, name, self.buffer, self._alloc, self.name, w, p0, 1, new_root)

    def indirect(self, index: Any, num_elem: Any = None) -> NkiTensor:
        raise NkiUnsupportedError("NkiTensor.indirect (tensor indirection, NC-v4) is not implemented by the emulator")

    indirect.__nki_unsupported__ = "tensor indirection (NC-v4) is not emulated"

    def vector_select(self, dim: int, vector_offset: Any) -> NkiTensor:
        raise NkiUnsupportedError(
            "NkiTensor.vector_select (per-partition indirect addressing) is not implemented by the emulator"
        )

    vector_select.__nki_unsupported__ = "per-partition indirect addressing is not emulated"

    def rearrange(self, src_pattern: tuple, dst_pattern: tuple, fixed_sizes: dict[str, int] | None = None) -> NkiTensor:
        """einops-style split / reorder / merge of dims, as a view (built from reshape_dim/permute/flatten)."""
        fixed = dict(fixed_sizes or {})
        names: list[str] = []
        t = self
        d = 0
        for item in src_pattern:  # split grouped source dims
            group = (item,) if isinstance(item, str) else tuple(item)
            if len(group) > 1:
                unknown = [g for g in group if g not in fixed]
                sizes = tuple(fixed.get(g, -1) for g in group)
                if len(unknown) > 1:
                    raise NkiValidationError(f"NkiTensor.rearrange: sizes of {unknown} are ambiguous; pass fixed_sizes")
                t = t.reshape_dim(d, sizes)
            for j, g in enumerate(group):
                fixed.setdefault(g, t.shape[d + j])
            names += group
            d += len(group)
        flat_dst = [g for item in dst_pattern for g in ((item,) if isinstance(item, str) else tuple(item))]
        if sorted(flat_dst) != sorted(names):
            raise NkiValidationError(f"NkiTensor.rearrange: {dst_pattern} does not name the dims of {src_pattern}")
        t = t.permute(tuple(names.index(g) for g in flat_dst))
        d = 0
        for item in dst_pattern:  # merge grouped destination dims
            n = 1 if isinstance(item, str) else len(item)
            if n > 1:
                t = t.flatten_dims(d, d + n - 1)
            d += 1
        return t

    # ---- host access (only outside kernels / in tests)
    def numpy(self) -> np.ndarray:
        return np.array(self._arr)


def _reshape_view(a: np.ndarray, shape: tuple[int, ...], t: NkiTensor, what: str) -> np.ndarray:
    out = a.reshape(shape)
    if a.size and not np.shares_memory(out, a):
        raise NkiValidationError(
            f"NkiTensor.{what} of {fmt_shape(t)}: its layout is not contiguous across the "
            "merged/split dims (after a permute or a strided slice), so no view exists"
        )
    return out


def runtime_int(x: Any, what: str) -> int:
    """The value of an index known only at run time: an int, an NkiScalar, or a 1x1 SBUF/HBM tensor."""
    if isinstance(x, (int, np.integer)):
        return int(x)
    v = getattr(x, "nki_scalar_value", None)
    if v is not None:
        return int(v())
    if isinstance(x, NkiTensor):
        if x.size != 1:
            raise NkiValidationError(f"{what}: a run-time index must be a 1x1 tensor, got {fmt_shape(x)}")
        return 0 if current_run().shape_only else int(np.asarray(x._arr, np.float64).reshape(-1)[0])
    raise NkiError(f"{what}: index {x!r} must be an int, an NkiScalar or a 1x1 tensor")


def _check_partitions(shape: tuple[int, ...], buffer: Buffer, what: str) -> None:
    if buffer.on_chip:
        if len(shape) < 1:
            raise NkiValidationError(f"{what}: an on-chip tensor needs a partition dim, got shape {list(shape)}")
        if shape[0] > PMAX:
            raise NkiValidationError(
                f"{what}: Size of partition dimension {shape[0]} exceeds maximum {PMAX} "
                f"(nl.tile_size.pmax) for {buffer} tensor of shape {list(shape)}"
            )


def new_tensor(shape: Any, dtype: Any, buffer: Buffer | str = sbuf, name: str = "", fill: Any = None) -> NkiTensor:
    """Allocate a tensor in the current run (filled with NaN / 4 unless ``fill`` is given)."""
    run = current_run()
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    name_ = dtype_name(dtype)
    buffer = Buffer(buffer)
    if buffer not in ("sbuf", "psum", "hbm", "shared_hbm"):
        raise NkiError(f"unknown buffer {buffer!r}; use nl.sbuf, nl.psum, nl.hbm or nl.shared_hbm")
    if any(s <= 0 for s in shape):
        raise NkiValidationError(f"nl.ndarray {name!r}: every dim must be positive, got shape {list(shape)}")
    _check_partitions(shape, buffer, f"nl.ndarray {name!r}" if name else "nl.ndarray")
    if buffer == "psum" and is_float(name_) is False:
        raise NkiValidationError(f"PSUM tensor {name!r} must have a float dtype, got {name_}")
    per_part = int(math.prod(shape[1:])) * itemsize(name_) if buffer.on_chip else 0
    alloc = Allocation(run, buffer, per_part, f"{name or 'tensor'}{list(shape)}:{name_}") if buffer.on_chip else None
    if buffer == "shared_hbm" and len(run.grid_ids) > 1:
        # SPMD/LNC programs share shared_hbm: the k-th such allocation of every program is the same tensor
        k = run.shared_next
        run.shared_next += 1
        if k < len(run.shared_allocs):
            prev = run.shared_allocs[k]
            if prev.shape != shape or prev.dtype != name_:
                raise NkiValidationError(
                    f"nl.ndarray {name!r}: shared_hbm allocation #{k} is {list(prev.shape)}:{prev.dtype} in program 0 "
                    f"but {list(shape)}:{name_} in program {run.program_id}; every program must allocate the same "
                    "shared tensors (control flow must be the same on every core)"
                )
            return prev
    value = fill_value(name_) if fill is None else fill
    if run.shape_only:
        arr = np.broadcast_to(np.zeros((), np_dtype(name_)), shape)
        written = np.broadcast_to(np.zeros((), bool), shape) if buffer == "psum" else None
    else:
        arr = np.full(shape, value, dtype=np_dtype(name_)) if name_ != "tfloat32" else np.full(shape, value, np.float32)
        written = np.zeros(shape, bool) if buffer == "psum" else None
    t = NkiTensor(arr, name_, buffer, alloc, name, written)
    if buffer == "shared_hbm" and len(run.grid_ids) > 1:
        run.shared_allocs.append(t)
    return t


def wrap_hbm(arr: np.ndarray, name: str = "", shape_only: bool = False) -> NkiTensor:
    """An HBM kernel argument viewing ``arr`` (no copy: in-place writes reach the caller)."""
    dt = dtype_name(arr.dtype)
    if np.dtype(arr.dtype) != np_dtype(dt):
        arr = arr.astype(np_dtype(dt))
    return NkiTensor(arr, dt, hbm, None, name)
