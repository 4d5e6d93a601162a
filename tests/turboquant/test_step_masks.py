"""turboquant.step_masks.StepMasks: the masks a decode loop feeds, written into buffers kept between
steps, equal to the masks made anew whatever the order and sizes of the calls."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.step_masks import StepMasks

calls = st.lists(st.tuples(st.integers(1, 9), st.integers(1, 3000), st.integers(0, 2**31 - 1)), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(calls)
def test_masks_equal_fresh_ones_over_any_sequence_of_calls(seq):
    masks = StepMasks()
    for b, n, seed in seq:
        ones = masks.ones(b, n)
        assert ones.shape == (b, n) and ones.dtype == np.int64 and ones.flags.c_contiguous
        np.testing.assert_array_equal(ones, np.ones((b, n), np.int64))
        lengths = np.random.default_rng(seed).integers(0, n + 1, b)
        padded = masks.padded(lengths, n)
        assert padded.shape == (b, n) and padded.dtype == np.int64 and padded.flags.c_contiguous
        np.testing.assert_array_equal(padded, (np.arange(n)[None] < lengths[:, None]).astype(np.int64))


def test_ones_cannot_be_written_through():
    ones = StepMasks().ones(2, 5)
    with pytest.raises(ValueError, match="read-only"):
        ones[0, 0] = 0


def test_a_padded_mask_is_rewritten_by_the_next_call():
    masks = StepMasks()
    first = masks.padded(np.array([3, 1]), 4)
    masks.padded(np.array([4, 4]), 4)
    np.testing.assert_array_equal(first, np.ones((2, 4), np.int64))  # the documented reuse of one buffer
