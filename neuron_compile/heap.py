"""The Python heap during a compile: what existed before it is left out of the garbage collector's sweeps.

A process that has imported torch and traced a model holds ~400,000 tracked objects, so each full
(oldest-generation) collection walks all of them: ~0.15 s on the 2-core machines this runs on. A compile
allocates enough (AOTAutograd's traces, jax's tracing and MLIR, the import of jax itself) to set off 2-4
such collections, 0.3-0.6 s of a decoder's ~4 s first step (``benchmarks/steady.py --first-step``), to
find almost no garbage among the old objects. ``gc.freeze()`` moves the existing objects to CPython's
permanent generation for the length of the compile, so those collections walk only what the compile
itself made; ``gc.unfreeze()`` hands them back. Nothing is freed later than it would have been otherwise,
except garbage among the pre-existing objects, which waits until the compile ends. One full walk remains:
CPython counts the unfrozen objects as newly long-lived, so its next full collection comes soon after.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

_freezing = False  # set while a compile (of any thread) holds the freeze


@contextlib.contextmanager
def old_objects_frozen() -> Iterator[None]:
    """Keep the objects that exist now out of the collector's sweeps until the block ends.

    A no-op when something else already froze objects (the user before a fork, or an enclosing compile:
    unfreezing would undo theirs) or when the collector is off.
    """
    global _freezing
    # The flag first: inside our own freeze, get_freeze_count() would walk every frozen object.
    if _freezing or not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    _freezing = True
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        _freezing = False
