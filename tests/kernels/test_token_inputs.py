"""`gather_token_inputs`: one launch gives exactly the token embeddings and the rotary angle rows."""

from __future__ import annotations

import pytest
import torch

from diffulex.kernels.token_inputs import gather_token_inputs
from diffulex.layers.rotary import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [64, 2048 + 40])  # one chunk per row, and rows that take two
def test_rows_equal_the_two_gathers_bit_for_bit(dtype, hidden):
    gen = torch.Generator().manual_seed(3)
    embedding = torch.randn(50, hidden, generator=gen).to(DEVICE, dtype)
    table = RotaryEmbedding(64, 300, 10000.0).table(torch.device(DEVICE))
    ids = torch.tensor([3, 49, 0, 3, 17], device=DEVICE)
    positions = torch.tensor([0, 299, 5, 5, 128], device=DEVICE)
    got_hidden, got_angles = gather_token_inputs(embedding, ids, table, positions)
    assert torch.equal(got_hidden, embedding[ids])
    assert torch.equal(got_angles, table[positions])


def test_an_index_outside_its_table_gives_zeros_and_leaves_the_other_rows_alone():
    embedding = torch.arange(12, dtype=torch.float32, device=DEVICE).view(4, 3) + 1
    table = torch.arange(10, dtype=torch.float32, device=DEVICE).view(5, 2) + 1
    ids = torch.tensor([1, 4, -1], device=DEVICE)
    positions = torch.tensor([7, 0, 4], device=DEVICE)
    hidden, angles = gather_token_inputs(embedding, ids, table, positions)
    assert hidden.cpu().tolist() == [[4.0, 5.0, 6.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert angles.cpu().tolist() == [[0.0, 0.0], [1.0, 2.0], [9.0, 10.0]]


def test_no_tokens_and_mismatched_inputs():
    embedding = torch.zeros(4, 8, device=DEVICE)
    table = torch.zeros(5, 2, 2, device=DEVICE)
    hidden, angles = gather_token_inputs(embedding, torch.zeros(0, dtype=torch.long, device=DEVICE), table,
                                         torch.zeros(0, dtype=torch.long, device=DEVICE))
    assert hidden.shape == (0, 8) and angles.shape == (0, 2, 2)
    with pytest.raises(ValueError, match="one length"):
        gather_token_inputs(embedding, torch.zeros(2, dtype=torch.long, device=DEVICE), table,
                            torch.zeros(3, dtype=torch.long, device=DEVICE))

