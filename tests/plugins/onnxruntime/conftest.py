"""Fixtures of the ORT op tests."""

import pytest

from turboquant.kernel_plan import cuda_device, last_prefill_kernel, last_split_kernel, plan_prefill, plan_split


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


@pytest.fixture
def prefill_kernel_ran():
    """prefill_kernel_ran(want, **call): after a CUDA run of one op call with several query rows,
    asserts that the kernel that attended its new tokens is the planner's for this GPU and, on a
    device of compute capability 9.0 whose library holds sm_90a code (the H200), that it is `want`.
    The call's keywords are turboquant.kernel_plan.plan_prefill's."""

    def check(want: str, **call):
        dev = cuda_device()
        planned = plan_prefill(**call, device=dev)
        ran = last_prefill_kernel()
        assert ran == planned, f"the {ran} prefill kernel ran; the planner chose {planned} for {call} on {dev}"
        if dev.sm90a:
            assert ran == want, f"the {ran} prefill kernel ran on {dev}; expected {want} for {call}"

    return check
