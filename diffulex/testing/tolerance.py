"""Tolerances for results that do the same floating-point arithmetic in a different order.

A batched kernel against a row-by-row one, a fused path against its reference, one merged GEMM against two:
each sums the same products, but the order is the BLAS's choice, and that depends on the machine, the thread
count and the shapes. A fixed tolerance such as ``1e-6`` then passes on one machine and fails on the next.

The bound used here is the standard one for recursive summation: a sum of ``n`` terms computed in any order is
within ``(n - 1) * u * sum(|term|)`` of the exact sum (``u`` = half the machine epsilon), so two orders are within
``n * eps * sum(|term|)`` of each other. A chain of reductions (a GEMM, an activation, another GEMM) adds the
lengths of its reductions. ``ulps`` is the margin on top of the bound; it stays small, so a real error (a wrong
row, expert or weight, which moves a value by a sizeable fraction of its magnitude) still fails.
"""

from __future__ import annotations

import torch

# Margin over the first-order bound: the bound ignores second-order terms and the chain's amplification.
DEFAULT_ULPS = 4.0


def reordering_atol(
    terms: int, magnitude: float | torch.Tensor, dtype: torch.dtype = torch.float32, ulps: float = DEFAULT_ULPS
) -> float:
    """The largest difference two summation orders of ``terms`` values can show, in ``dtype``.

    ``magnitude`` bounds the sum of the absolute values added (for a chain, the largest such sum along it); the
    largest absolute value of the result is the usual stand-in when the terms do not cancel much.
    """
    if terms < 1:
        raise ValueError(f"terms={terms!r} is invalid: must be an integer > 0")
    if isinstance(magnitude, torch.Tensor):
        magnitude = magnitude.abs().max().item() if magnitude.numel() else 0.0
    return ulps * terms * torch.finfo(dtype).eps * float(abs(magnitude))


def assert_close_up_to_reordering(
    actual: torch.Tensor,
    expected: torch.Tensor,
    terms: int,
    magnitude: float | torch.Tensor | None = None,
    ulps: float = DEFAULT_ULPS,
) -> None:
    """``actual`` equals ``expected`` up to the rounding of a different summation order of ``terms`` values.

    ``magnitude`` defaults to the largest absolute value of ``expected`` (see `reordering_atol`); the tolerance is
    absolute and the same for every element, as the rounding of a sum does not shrink with the sum's result.
    """
    scale = expected if magnitude is None else magnitude
    dtype = expected.dtype if expected.is_floating_point() else torch.float32
    atol = reordering_atol(terms, scale, dtype, ulps)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0.0)
