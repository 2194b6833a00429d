"""Rotary position embedding: whole heads (every family but LLaDA2) and the first part of each head (LLaDA2)."""

from __future__ import annotations

import pytest
import torch

from diffulex.layers import RotaryEmbedding, apply_rotary
from diffulex.layers.rotary import fused_rope_args


def test_partial_rotary_rotates_the_first_dims_and_passes_the_rest():
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(5) * 7
    cos, sin = RotaryEmbedding(8, 64, 10_000.0)(positions)
    out = apply_rotary(x, cos, sin)
    torch.testing.assert_close(out[..., :8], apply_rotary(x[..., :8].contiguous(), cos, sin))
    assert torch.equal(out[..., 8:], x[..., 8:])


def test_partial_rotary_keeps_relative_positions():
    """q.k after rotation depends on the positions' difference only, with the unrotated dims as a constant."""
    rotary = RotaryEmbedding(8, 64, 10_000.0)
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)

    def score(pq: int, pk: int) -> torch.Tensor:
        cq, sq = rotary(torch.tensor([pq]))
        ck, sk = rotary(torch.tensor([pk]))
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum()

    torch.testing.assert_close(score(3, 1), score(12, 10))
    torch.testing.assert_close(score(0, 0), (q * k).sum())


def test_angles_for_more_dims_than_a_head_has_are_refused_by_the_kernel():
    from diffulex.kernels.fused_norm import qk_norm_rope

    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    cos, sin = RotaryEmbedding(32, 64, 10_000.0)(torch.arange(2))
    assert fused_rope_args(q, k, cos, sin, None, None) is None
    with pytest.raises(ValueError, match="rotate more than the head_dim=16"):
        qk_norm_rope(q, k, cos, sin, None, None, 0.0)
