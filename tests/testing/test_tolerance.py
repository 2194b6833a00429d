"""The reordering tolerance: wide enough for any summation order, narrow enough to catch a wrong term."""

from __future__ import annotations

import pytest
import torch

from diffulex.testing.tolerance import assert_close_up_to_reordering, reordering_atol


def _sequential_sum(values: torch.Tensor) -> torch.Tensor:
    """Left-to-right float32 summation: the order with the largest rounding error bound."""
    total = torch.zeros((), dtype=values.dtype)
    for v in values:
        total = total + v
    return total


@pytest.mark.parametrize("seed", range(4))
def test_every_summation_order_stays_within_the_bound_without_margin(seed):
    gen = torch.Generator().manual_seed(seed)
    values = (torch.randn(512, generator=gen) * torch.logspace(-3, 3, 512)).float()  # wide range, cancellation
    atol = reordering_atol(len(values), values.abs().sum(), ulps=1.0)
    exact = values.double().sum()
    orders = [values, values.flip(0), values[torch.randperm(512, generator=gen)], values.sort().values]
    sums = [_sequential_sum(v) for v in orders] + [values.sum(), values.view(32, 16).sum(0).sum()]
    for s in sums:
        assert abs(s.double() - exact) <= atol
    for s in sums[1:]:
        assert_close_up_to_reordering(s, sums[0], len(values), magnitude=values.abs().sum(), ulps=1.0)


def test_a_wrong_term_is_not_excused_as_rounding():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 64, generator=gen), torch.randn(64, 16, generator=gen)
    expected = a @ b
    wrong = a.clone()
    wrong[3, 10] *= 1.01  # one input off by one percent
    with pytest.raises(AssertionError):
        assert_close_up_to_reordering(wrong @ b, expected, terms=64)
    assert_close_up_to_reordering((a.T.contiguous().T) @ b, expected, terms=64)


def test_the_tolerance_scales_with_length_magnitude_and_precision():
    base = reordering_atol(10, 1.0)
    assert reordering_atol(20, 1.0) == pytest.approx(2 * base)
    assert reordering_atol(10, -3.0) == pytest.approx(3 * base)
    assert reordering_atol(10, torch.tensor([0.5, -2.0])) == pytest.approx(2 * base)
    assert reordering_atol(10, 1.0, torch.bfloat16) > 1000 * base
    assert reordering_atol(10, 1.0, torch.float64) < 1e-8 * base


def test_a_reduction_without_terms_is_refused():
    with pytest.raises(ValueError, match="terms=0 is invalid: must be an integer > 0"):
        reordering_atol(0, 1.0)
