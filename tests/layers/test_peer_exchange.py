"""Which all-reduces go through the peer exchange: a sharded projection holding one hands its partial to the next
norm, which all-reduces it in its own launch on CUDA and by the group's collective elsewhere."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from diffulex.layers import PartialOverRanks, RMSNorm, RowParallelLinear
from diffulex.layers.parallel_state import TensorParallelGroup, using_tensor_parallel_group
from diffulex.layers.peer_exchange import attach_peer_exchange, connect_peer_exchange, exchanges_in_one_process


@dataclass(frozen=True)
class TwinRanks(TensorParallelGroup):
    """Two ranks holding the same partial: the all-reduce doubles it (no process group needed)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2)


def sharded_block() -> nn.Module:
    with using_tensor_parallel_group(TwinRanks(rank=0, size=2)):
        block = nn.Module()
        block.o_proj = RowParallelLinear(16, 8)
        block.norm = RMSNorm(8)
    return block


def test_a_projection_with_an_exchange_leaves_the_all_reduce_to_the_norm() -> None:
    torch.manual_seed(0)
    block = sharded_block()
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    expected_partial = nn.functional.linear(x, block.o_proj.weight)
    assert torch.equal(block.o_proj.forward_unsummed(x), 2 * expected_partial)  # no exchange: all-reduced here

    assert attach_peer_exchange(block, exchanges_in_one_process(2, torch.device("cpu"), 8 * 4)[0]) == 1
    partial = block.o_proj.forward_unsummed(x)
    assert isinstance(partial, PartialOverRanks) and torch.equal(partial.local, expected_partial)
    normed, summed = block.norm(partial, residual)  # on the CPU: the group's all-reduce, then the plain norm
    assert torch.equal(summed, 2 * expected_partial + residual)
    assert torch.equal(normed, block.norm._norm(summed))


def test_a_projection_with_hooks_or_a_bias_still_returns_the_whole_output() -> None:
    with using_tensor_parallel_group(TwinRanks(rank=0, size=2)):
        biased = RowParallelLinear(16, 8, bias=True)
    attach_peer_exchange(biased, exchanges_in_one_process(2, torch.device("cpu"), 8 * 4)[0])
    assert isinstance(biased.forward_unsummed(torch.randn(2, 8)), torch.Tensor)


def test_a_single_rank_opens_no_exchange() -> None:
    model = nn.Sequential(RowParallelLinear(16, 8))
    assert connect_peer_exchange(model, torch.device("cpu"), torch.float32, timeout_s=1.0) == 0
    assert model[0].peer_exchange is None
