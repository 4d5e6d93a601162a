"""The attention masks a decode loop feeds each step, written into host buffers kept from step to step.

A mask made anew each step ([B, S] int64, and the temporaries that make it) costs the host fresh
pages every step while the device waits for the step's feeds (docs/performance.md, "The loop's own
time between steps").
"""

from __future__ import annotations

import numpy as np


def _grown(n: int) -> int:
    """A capacity for n elements with room to grow (steps widen the mask by one column at a time)."""
    return max(n, 1) * 5 // 4 + 1024


class StepMasks:
    def __init__(self) -> None:
        self._ones = np.ones(0, np.int64)
        self._mask = np.empty(0, np.int64)
        self._columns = np.arange(0, dtype=np.int64)

    def ones(self, b: int, n: int) -> np.ndarray:
        """[b, n] int64 ones, read-only: a view of one buffer shared by every call."""
        if self._ones.size < b * n:
            self._ones = np.ones(_grown(b * n), np.int64)
            self._ones.flags.writeable = False
        return self._ones[:b * n].reshape(b, n)

    def padded(self, lengths: np.ndarray, n: int) -> np.ndarray:
        """[B, n] int64, row i's first lengths[i] entries 1 and the rest 0 (right padding); a view of a
        buffer the next call rewrites, so it must be consumed (bound, copied, run) before then."""
        b = lengths.shape[0]
        if self._mask.size < b * n:
            self._mask = np.empty(_grown(b * n), np.int64)
        if self._columns.size < n:
            self._columns = np.arange(_grown(n), dtype=np.int64)
        out = self._mask[:b * n].reshape(b, n)
        np.less(self._columns[None, :n], lengths[:, None], out=out, casting="unsafe")
        return out
