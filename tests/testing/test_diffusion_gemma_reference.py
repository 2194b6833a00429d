"""The temperature-0 DiffusionGemma loop's own contract (its equality with transformers' loop is in
tests/models/test_diffusion_gemma.py)."""

from __future__ import annotations

import pytest
import torch

from diffulex.models.diffusion_gemma import load_diffusion_gemma
from diffulex.testing.checkpoints import write_tiny_diffusion_gemma_checkpoint
from diffulex.testing.diffusion_gemma_reference import greedy_generate, one_hot_logits


def test_one_hot_logits_soften_to_exactly_one_hot() -> None:
    """Self-conditioning at temperature 0 is the one-hot argmax; its logits must give exactly that softmax."""
    tokens = torch.tensor([[3, 0, 5]])
    probs = one_hot_logits(tokens, 6).softmax(dim=-1)
    assert torch.equal(probs, torch.nn.functional.one_hot(tokens, 6).float())


def test_too_few_noise_canvases_are_refused(tmp_path) -> None:
    model = load_diffusion_gemma(write_tiny_diffusion_gemma_checkpoint(tmp_path / "dgemma"))
    prompt = torch.tensor([[7, 8, 9]])
    with pytest.raises(ValueError, match="canvas_noise holds 1 canvases; 2 may be needed"):
        greedy_generate(model, prompt, [torch.zeros(1, 16, dtype=torch.long)], 17, 4, 1, (), pad_token_id=0)
