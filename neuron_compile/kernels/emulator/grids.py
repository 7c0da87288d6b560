"""NKI 0.7 tile and block grids (``nl.tiles``, ``nl.blocks``, ``nl.alloc_tiles``, ``nl.alloc_blocks``).

A grid is a view over a tensor addressed in tile (or block) coordinates: ``grid.shape`` counts tiles,
``grid[i, j]`` selects a region (integer indexing consumes a coordinate and still returns a grid) and
``grid.data`` is the :class:`NkiTensor` view of the selected elements, the operand ISA calls take. Edge
tiles are clamped (``is_remainder``). ``tile_shape`` applies to the trailing dims; leading untiled dims of an
HBM tensor form a prefix indexed one slab at a time. Creating and indexing grids moves no data.

``alloc_tiles``/``alloc_blocks`` allocate one backing tensor. On chip, rows beyond one partition tile
(``element_shape[0] > tile_shape[0]``) are folded into a free dim of the storage
(``[tile_p, row_tiles, *element_shape[1:]]``), so ``.data`` of a selection spanning several row tiles is not
representable as one operand (``is_data_representable`` is False and ``.data`` raises) — the
emulator's reading of the 0.7 docs, which do not give the storage layout.
"""

from __future__ import annotations

from typing import Any

from .errors import NkiError, NkiValidationError
from .memory import Buffer
from .tensors import NkiTensor, new_tensor


class NkiGrid:
    """Base of :class:`NkiTileGrid` and :class:`NkiBlockGrid` (see the module docstring)."""

    def __init__(
        self,
        src: NkiTensor,
        logical: tuple[int, ...],
        tile_shape: tuple[int, ...],
        block_shape: tuple[int, ...] | None,
        region: list[tuple[int, int]],
        dropped: frozenset[int],
        gdims: tuple[int, ...],
        row_split: int | None,
    ):
        self._src, self._logical, self._row_split = src, logical, row_split
        self.tile_shape = tuple(tile_shape)
        self._block = None if block_shape is None else tuple(block_shape)
        self._region, self._dropped, self._gdims = region, dropped, gdims

    # ---- geometry
    def _prefix(self) -> int:
        return len(self._logical) - len(self.tile_shape)

    def _step(self, d: int) -> int:
        p = self._prefix()
        if d < p:
            return 1
        t = self.tile_shape[d - p]
        return t * (self._block[d - p] if self._block is not None else 1)

    @property
    def shape(self) -> tuple[int, ...]:
        """Grid coordinates per remaining dim: tiles (or blocks) for tiled dims, elements for the prefix."""
        return tuple(-(-(self._region[d][1] - self._region[d][0]) // self._step(d)) for d in self._gdims)

    @property
    def element_shape(self) -> tuple[int, ...]:
        """Exact (clamped) element extent of the selection per kept source dim."""
        return tuple(b - a for d, (a, b) in enumerate(self._region) if d not in self._dropped)

    @property
    def index_step_elements(self) -> tuple[int, ...]:
        return tuple(self._step(d) for d in self._gdims)

    @property
    def is_remainder(self) -> bool:
        p = self._prefix()
        return any((b - a) % self.tile_shape[d - p] for d, (a, b) in enumerate(self._region) if d >= p)

    @property
    def dtype(self) -> str:
        return self._src.dtype

    @property
    def buffer(self) -> Buffer:
        return self._src.buffer

    @property
    def is_data_representable(self) -> bool:
        if self._row_split is None:
            return True
        a, b = self._region[0]
        return a // self._row_split == (b - 1) // self._row_split

    @property
    def data(self) -> NkiTensor:
        """The selection as one NkiTensor view (the operand of an ISA instruction)."""
        if not self.is_data_representable:
            raise NkiValidationError(
                f"{type(self).__name__}.data: the selection spans rows {self._region[0]} of on-chip tile storage "
                f"with {self._row_split}-row tiles, which is not one tensor operand; select one row of tiles"
            )
        key: list[Any] = []
        for d, (a, b) in enumerate(self._region):
            if d == 0 and self._row_split is not None:
                r = self._row_split
                key += [slice(a % r, a % r + (b - a)), a // r]
            elif d in self._dropped:
                key.append(a)
            else:
                key.append(slice(a, b))
        view = self._src[tuple(key)]
        want = self.element_shape
        if view.shape != want:  # an on-chip integer index kept a size-1 dim: drop it where the grid did
            view = view.reshape(want) if len(want) >= 1 else view
        return view

    # ---- selection
    def __getitem__(self, key: Any) -> NkiGrid:
        key = key if isinstance(key, tuple) else (key,)
        if len(key) > len(self._gdims):
            raise NkiError(f"too many grid indices {key} for a grid of shape {self.shape}")
        region, dropped, gdims = list(self._region), set(self._dropped), []
        for i, d in enumerate(self._gdims):
            k = key[i] if i < len(key) else slice(None)
            a, b = region[d]
            n, st = -(-(b - a) // self._step(d)), self._step(d)
            if isinstance(k, slice):
                lo, hi, s = k.indices(n)
                if s != 1:
                    raise NkiError(f"grid slices take step 1, got {k}")
                region[d] = (a + lo * st, min(b, a + hi * st))
                gdims.append(d)
            else:
                j = int(k)
                if not -n <= j < n:
                    raise NkiError(f"grid index {j} out of range for {n} entries on grid dim {i} (shape {self.shape})")
                j %= n
                region[d] = (a + j * st, min(b, a + (j + 1) * st))
                if d < self._prefix():
                    dropped.add(d)
        return type(self)(
            self._src,
            self._logical,
            self.tile_shape,
            self._block,
            region,
            frozenset(dropped),
            tuple(gdims),
            self._row_split,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, tile_shape={self.tile_shape}, element_shape={self.element_shape})"


class NkiTileGrid(NkiGrid):
    """A tensor view in tile coordinates (``nl.tiles``)."""


class NkiBlockGrid(NkiGrid):
    """A tensor view in block coordinates: each cell groups ``block_shape`` tiles (``nl.blocks``)."""

    @property
    def block_shape(self) -> tuple[int, ...]:
        return self._block or ()


def _check_shape(shape: Any, what: str, min_rank: int = 1) -> tuple[int, ...]:
    if not isinstance(shape, tuple) or not all(isinstance(s, int) for s in shape):
        raise NkiError(f"{what} must be a tuple of ints, got {shape!r}")
    if len(shape) < min_rank or any(s <= 0 for s in shape):
        raise NkiValidationError(f"{what} must have >= {min_rank} positive entries, got {shape}")
    return shape


def _from(source: Any, tile_shape: Any, block_shape: Any, cls: type) -> NkiGrid:
    if isinstance(source, NkiGrid):
        ts = source.tile_shape if tile_shape is None else _check_shape(tile_shape, "tile_shape", 2)
        if len(ts) != len(source.tile_shape):
            raise NkiValidationError(f"tile_shape {ts} must have the rank of the grid's {source.tile_shape}")
        gd = tuple(d for d in range(len(source._logical)) if d not in source._dropped)
        return cls(
            source._src, source._logical, ts, block_shape, list(source._region), source._dropped, gd, source._row_split
        )
    if not isinstance(source, NkiTensor):
        raise NkiError(f"nl.tiles/nl.blocks take an NkiTensor or a grid, got {type(source).__name__}")
    shape = source.shape
    ts = (min(128, shape[0]), *shape[1:]) if tile_shape is None and source.buffer.on_chip else tile_shape
    if ts is None:
        raise NkiError("nl.tiles/nl.blocks of an HBM tensor need tile_shape=")
    ts = _check_shape(tuple(ts), "tile_shape", 2)
    if len(ts) > len(shape):
        raise NkiValidationError(f"tile_shape {ts} has more dims than the source {list(shape)}")
    if source.buffer.on_chip and len(ts) != len(shape):
        raise NkiValidationError("on chip, tile_shape must cover every dim (the partition dim included)")
    return cls(source, shape, ts, block_shape, [(0, s) for s in shape], frozenset(), tuple(range(len(shape))), None)


def tiles(source: Any, *, tile_shape: tuple[int, ...] | None = None) -> NkiTileGrid:
    """``source`` (a tensor or grid) as a grid of ``tile_shape`` tiles over its trailing dims."""
    return _from(source, tile_shape, None, NkiTileGrid)


def blocks(source: Any, *, tile_shape: tuple[int, ...] | None = None, block_shape: tuple[int, ...]) -> NkiBlockGrid:
    """``source`` as a grid of blocks of ``block_shape`` tiles of ``tile_shape``."""
    g = _from(source, tile_shape, _check_shape(tuple(block_shape), "block_shape"), NkiBlockGrid)
    if len(g._block) != len(g.tile_shape):
        raise NkiValidationError(f"block_shape {block_shape} must have the rank of tile_shape {g.tile_shape}")
    return g


def _alloc(
    tile_shape: Any, element_shape: Any, buffer: Any, dtype: Any, name: str, block_shape: Any, cls: type
) -> NkiGrid:
    ts = _check_shape(tuple(tile_shape), "tile_shape", 2)
    es = _check_shape(tuple(element_shape), "element_shape", len(ts))
    buf = Buffer(buffer)
    row_split = None
    if buf.on_chip and len(ts) != len(es):
        raise NkiValidationError("on chip, tile_shape must cover every dim of element_shape")
    if buf.on_chip and es[0] > ts[0]:
        row_split = ts[0]
        src = new_tensor((ts[0], -(-es[0] // ts[0]), *es[1:]), dtype, buf, name)
    else:
        src = new_tensor(es, dtype, buf, name)
    bs = None if block_shape is None else _check_shape(tuple(block_shape), "block_shape")
    return cls(src, es, ts, bs, [(0, s) for s in es], frozenset(), tuple(range(len(es))), row_split)


def alloc_tiles(
    *,
    tile_shape: tuple[int, ...],
    element_shape: tuple[int, ...],
    buffer: Any,
    dtype: Any,
    address: Any = None,
    name: str = "",
) -> NkiTileGrid:
    """New uninitialized storage of ``element_shape`` organized as ``tile_shape`` tiles."""
    return _alloc(tile_shape, element_shape, buffer, dtype, name, None, NkiTileGrid)


def alloc_blocks(
    *,
    tile_shape: tuple[int, ...],
    block_shape: tuple[int, ...],
    element_shape: tuple[int, ...],
    buffer: Any,
    dtype: Any,
    address: Any = None,
    name: str = "",
) -> NkiBlockGrid:
    """New uninitialized storage organized as blocks of ``block_shape`` tiles."""
    return _alloc(tile_shape, element_shape, buffer, dtype, name, block_shape, NkiBlockGrid)


__all__ = ["NkiBlockGrid", "NkiGrid", "NkiTileGrid", "alloc_blocks", "alloc_tiles", "blocks", "tiles"]
