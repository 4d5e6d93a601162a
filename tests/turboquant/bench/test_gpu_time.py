"""gpu_time: the union of kernel intervals (the GPU time of overlapping launches counts once)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.bench import gpu_time


def test_union_length_cases():
    assert gpu_time.union_length([]) == 0
    assert gpu_time.union_length([(0, 10)]) == 10
    assert gpu_time.union_length([(0, 10), (10, 15)]) == 15  # touching
    assert gpu_time.union_length([(0, 10), (5, 8)]) == 10  # nested
    assert gpu_time.union_length([(5, 12), (0, 10), (20, 25)]) == 17  # unsorted, overlapping, apart
    assert gpu_time.union_length([(3, 3), (4, 2)]) == 0  # empty and reversed intervals add nothing


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), max_size=12))
def test_union_length_matches_the_covered_points(spans):
    covered = {t for a, b in spans for t in range(a, b)}
    assert gpu_time.union_length(spans) == len(covered)


def _torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_torch_cuda(), reason="this machine has a GPU: test_busy_seconds_of_kernels runs instead")
def test_busy_seconds_is_none_without_a_gpu():
    assert gpu_time.busy_seconds(lambda: None) is None


@pytest.mark.skipif(not _torch_cuda(), reason="needs torch with CUDA and a GPU")
def test_busy_seconds_of_kernels():
    import torch

    x = torch.ones(1 << 24, device="cuda")

    def run():
        for _ in range(10):
            x.mul_(1.0001)
        torch.cuda.synchronize()

    run()  # the kernel's first launch loads its module: not part of either measure
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.record()
    run()
    en.record()
    torch.cuda.synchronize()
    busy = gpu_time.busy_seconds(run)
    # ten kernels back to back, each streaming 128 MiB: their GPU time is most of the events' span
    span = st.elapsed_time(en) / 1e3
    assert busy is not None and 0.5 * span <= busy <= 1.5 * span, (busy, span)
