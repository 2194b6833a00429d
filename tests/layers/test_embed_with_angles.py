"""`embed_with_angles`: the first layer's inputs are what the embedding and rotary modules give."""

from __future__ import annotations

import torch

from diffulex.layers.linear import VocabEmbedding
from diffulex.layers.rotary import RotaryEmbedding
from diffulex.layers.token_inputs import embed_with_angles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_the_layer_helper_gives_what_the_two_modules_give():
    """On the CPU the modules run; on CUDA the kernel does, with the same result."""
    embedding = VocabEmbedding(40, 32).to(DEVICE)
    rotary = RotaryEmbedding(16, 64, 10000.0)
    ids = torch.tensor([5, 0, 39], device=DEVICE)
    positions = torch.tensor([63, 1, 2], device=DEVICE)
    with torch.inference_mode():
        hidden, (cos, sin) = embed_with_angles(embedding, rotary, ids, positions)
        ref_cos, ref_sin = rotary(positions)
        assert torch.equal(hidden, embedding(ids))
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_a_hooked_embedding_runs_its_module():
    """A forward hook (activation capture) must see the embedding module run, so the helper leaves it to it."""
    embedding = VocabEmbedding(10, 8).to(DEVICE)
    seen = []
    embedding.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with torch.inference_mode():
        hidden, _ = embed_with_angles(embedding, RotaryEmbedding(4, 16, 10000.0), torch.tensor([1, 2], device=DEVICE),
                                      torch.tensor([0, 1], device=DEVICE))
    assert seen == [(2, 8)] and torch.equal(hidden, embedding.weight[[1, 2]].detach())
