"""Fixtures of the ORT op tests."""

import pytest

from turboquant.kernel_plan import cuda_device, last_split_kernel, plan_split


@pytest.fixture
def split_kernel_ran():
    """split_kernel_ran(want, **call): after a CUDA run of one op call, asserts that the split kernel
    that ran is the one the planner chooses for the call on this GPU, and, on an sm_90 GPU with its
    227 KiB of shared memory per block (the H200 the figures were measured on), that it is `want`.
    The call's keywords are turboquant.kernel_plan.plan_split's."""

    def check(want: str, **call):
        dev = cuda_device()
        planned = plan_split(**call, device=dev).kernel
        ran = last_split_kernel()
        assert ran == planned, f"the {ran} split kernel ran; the planner chose {planned} for {call} on {dev}"
        if dev.cc_major == 9 and dev.smem_optin >= 232448:
            assert ran == want, f"the {ran} split kernel ran on {dev}; expected {want} for {call}"

    return check
