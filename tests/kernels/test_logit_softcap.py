"""DiffusionGemma's soft-capped float32 logits in one pass against its torch code (the CPU path): within a few ulps
of the cap, on the GPU (libdevice's tanh is not bit for bit the one PyTorch's CUDA kernel runs) and under the
interpreter (tanh from an exponential there)."""

from __future__ import annotations

import pytest
import torch

from diffulex.kernels.logit_softcap import softcapped_logits
from tests.kernels.test_fused_norm import DEVICE, assert_matches


def _torch_softcap(product: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(product.float() / cap) * cap


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 1000), (2, 5, 4096), (1, 1)])
def test_the_capped_logits_are_the_torch_codes(dtype, shape):
    product = (40 * torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape)))).to(dtype)
    got = softcapped_logits(product.to(DEVICE), 30.0)
    want = _torch_softcap(product.to(DEVICE), 30.0)
    assert got.dtype == torch.float32 and got.shape == product.shape and got.is_contiguous()
    assert_matches(got, want, scale=4 * 30.0)
    assert got.abs().max() <= 30.0, "every logit within the cap"


def test_a_strided_product_and_a_bad_cap():
    wide = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = softcapped_logits(wide[:, ::2], 5.0)
    assert_matches(got.cpu(), _torch_softcap(wide[:, ::2].cpu(), 5.0), scale=4 * 5.0)
    with pytest.raises(ValueError, match="final_logit_softcapping=0.0 must be > 0"):
        softcapped_logits(wide, 0.0)
