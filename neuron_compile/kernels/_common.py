"""Helpers shared by the built-in kernels (NKI style: 128-partition tiles, explicit DMA)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .nki_api import language as nl

P = 128  # nl.tile_size.pmax


def tiles(n: int, size: int = P) -> Iterator[tuple[int, int]]:
    """``(start, length)`` of each tile of ``size`` covering ``range(n)``; the last one may be ragged."""
    for start in range(0, n, size):
        yield start, min(size, n - start)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def itemsize(dtype: Any) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(str(dtype).removeprefix("torch."), 4)


def dtype_of(x: Any) -> str:
    """NKI dtype string of an array-like (NumPy, ml_dtypes, torch, jax)."""
    s = str(x.dtype).removeprefix("torch.")
    return {"float": "float32", "half": "float16"}.get(s, s)


def broadcast_row(vec_hbm: Any, rows: int) -> Any:
    """An HBM view of a 1-D ``[H]`` tensor repeated on ``rows`` partitions, for one broadcast DMA."""
    return vec_hbm.reshape((1, vec_hbm.shape[0])).broadcast(0, rows)


def sbuf(shape: Any, dtype: Any, name: str = "") -> Any:
    return nl.ndarray(shape, dtype, buffer=nl.sbuf, name=name)


def psum(shape: Any, dtype: Any = "float32", name: str = "") -> Any:
    return nl.ndarray(shape, dtype, buffer=nl.psum, name=name)
