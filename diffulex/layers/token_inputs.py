"""The first decoder layer's inputs, the token embeddings and the rotary angles, gathered together.

On CUDA both are one launch (`diffulex.kernels.token_inputs`): at decode sizes each gather is a launch of its own
at the head of every step. Elsewhere, where a module carries hooks (which must see it run), or where the embedding
is sharded across tensor-parallel ranks, each module runs.
"""

from __future__ import annotations

import torch

from diffulex.layers.dispatch import use_fused_kernels
from diffulex.layers.linear import VocabEmbedding
from diffulex.layers.rotary import Rope, RotaryEmbedding


def embed_with_angles(
    embedding: VocabEmbedding, rotary: RotaryEmbedding, input_ids: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, Rope]:
    """``(embedding(input_ids), rotary(positions))``, bit for bit, in one launch where the kernel applies."""
    hooked = any(m._forward_hooks or m._forward_pre_hooks for m in (embedding, rotary))
    sharded = embedding.tp.size > 1  # a rank's slice of the vocabulary: its lookup masks and all-reduces
    if not hooked and not sharded and input_ids.dim() == 1 and positions.shape == input_ids.shape and use_fused_kernels(
        embedding.weight
    ):
        from diffulex.kernels.token_inputs import gather_token_inputs

        table = rotary.table(positions.device)
        hidden, rows = gather_token_inputs(embedding.weight, input_ids, table, positions)
        return hidden, (rows[:, 0], rows[:, 1])
    return embedding(input_ids), rotary(positions)
