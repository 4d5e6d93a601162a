"""GPU time of a sequence of calls: how long the device spent running their kernels and copies,
from the activity records of CUPTI (through torch's profiler, which records every library's
launches in the process, ONNX Runtime's included).

Wall time of calls run back to back measures the host instead whenever a call's host work (ONNX
Runtime's Run: some 65-110 us per call on the H200 machine) exceeds its GPU work; GPU time is what
the layers of a real model's step add up to when the host runs ahead. Kernels that overlap (a
programmatic dependent launch starting before the one before it ends) count once: the time is the
length of the union of the intervals.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable


def union_length(intervals: Iterable[tuple[int, int]]) -> int:
    """Length of the union of half-open intervals [start, end)."""
    total, end = 0, None
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if end is None or a >= end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def busy_seconds(run: Callable[[], None]) -> float | None:
    """Seconds of GPU activity (kernels, copies, sets) while `run` runs, which must end by
    synchronising the device or its stream; None without torch, without a GPU, or when nothing
    was recorded."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    with warnings.catch_warnings():  # torch's note that each profiling cycle clears its events
        warnings.simplefilter("ignore", UserWarning)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
    cuda = torch.autograd.DeviceType.CUDA
    spans = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in prof.profiler.kineto_results.events()
             if e.device_type() == cuda]
    return union_length(spans) / 1e9 if spans else None
