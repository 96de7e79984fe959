"""Arrays kept for reuse from one call to the next, for npattn's own modules.

Fresh memory is not free: the first write to each 4 KiB page of a new large array faults into the
kernel, which zeroes the page and maps it, and numpy's allocator hands large freed arrays back to
the operating system.  On the project's 2-core machine a ``MultiHeadAttention`` training step at
b=4, L=64 spent 15-30 % of its time so, and 10-15 % at b=8, L=256.  A module therefore keeps the
internal arrays of one step (the projections' output, the attention core's blocks and scratch,
the gradients between its layers) in a ``Workspace`` and reuses them the next step.

Only arrays no caller can see pass through a workspace: outputs and gradients returned to the
user are always fresh.  The kernels take an optional ``workspace``; without one they allocate as
usual, so the numbers never depend on it.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

# At most this many distinct (size, dtype) free lists are kept: a module called with ever new
# shapes keeps the arrays of its latest shapes, not of all of them.
_MAX_KEYS = 64


class Workspace:
    """Free lists of flat arrays by ``(size, dtype)``: ``empty`` takes one (or allocates), ``give``
    returns arrays obtained from ``empty`` once nothing uses them any more.  Not thread-safe (a
    module is not either); copying or pickling gives an empty workspace."""

    __slots__ = ("_free",)

    def __init__(self) -> None:
        self._free: dict = {}

    def __reduce__(self):
        return (Workspace, ())

    def empty(self, shape, dtype) -> np.ndarray:
        """A C-contiguous array of ``shape`` and ``dtype``, contents undefined."""
        size = math.prod(shape)
        stack = self._free.get((size, dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)))
        if stack:
            return stack.pop().reshape(shape)
        return np.empty(size, dtype).reshape(shape)

    def give(self, *arrays: Optional[np.ndarray]) -> None:
        """Put back arrays (or views of them) obtained from ``empty``; None entries are skipped.
        The caller guarantees that nothing refers to them any more."""
        free = self._free
        for a in arrays:
            if a is None:
                continue
            base = a if a.base is None else a.base  # numpy points a view at the array owning the memory
            if not isinstance(base, np.ndarray) or base.ndim != 1 or not base.flags.owndata:
                continue  # not one of ours
            key = (base.size, base.dtype)
            stack = free.get(key)
            if stack is None:
                free[key] = [base]  # new keys go last: the oldest are dropped first
                while len(free) > _MAX_KEYS:
                    del free[next(iter(free))]
                continue
            for b in stack:
                if b is base:
                    break
            else:
                stack.append(base)

    def nbytes(self) -> int:
        """Bytes held in the free lists."""
        return sum(b.nbytes for stack in self._free.values() for b in stack)


def empty(workspace: Optional[Workspace], shape, dtype) -> np.ndarray:
    """``workspace.empty(shape, dtype)``, or ``np.empty`` without a workspace."""
    return np.empty(shape, dtype) if workspace is None else workspace.empty(shape, dtype)
