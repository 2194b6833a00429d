"""The split kernels' arrival counters: one zeroed buffer per device that never moves (graphs keep its address)."""

from __future__ import annotations

import pytest
import torch

from diffulex.kernels.split_counters import MAX_SPLIT_TILES, split_counters


def test_the_buffer_is_zeroed_and_the_same_for_every_request():
    device = torch.device("cpu")
    first = split_counters(device, 8)
    second = split_counters(device, MAX_SPLIT_TILES)
    assert first.data_ptr() == second.data_ptr()  # never reallocated, whatever size is asked for
    assert first.dtype == torch.int32 and int(first.abs().sum()) == 0


def test_a_launch_larger_than_the_buffer_is_refused():
    with pytest.raises(ValueError, match="exceeds"):
        split_counters(torch.device("cpu"), MAX_SPLIT_TILES + 1)
