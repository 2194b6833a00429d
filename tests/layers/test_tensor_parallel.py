"""Sharded over two ranks (gloo, two processes), every weight layer computes what the whole layer computes.

Each rank builds the layers twice from one seed: whole (before the group exists, as at TP=1) and sharded (after
`init_tensor_parallel`), loads the whole layers' tensors into the sharded ones through ``weight_loader``, and
compares both on the same random inputs in float32. A rank slicing the wrong rows, the wrong part of a fused
matrix, or summing what it should gather fails by far more than the reordering tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from diffulex.layers import ColumnParallelLinear, LMHead, MergedProjection, RowParallelLinear, VocabEmbedding
from diffulex.layers.parallel_state import (
    SINGLE_RANK,
    TensorParallelGroup,
    init_tensor_parallel,
    reset_tensor_parallel,
    tensor_parallel_group,
)
from diffulex.testing.distributed import RankRun, run_checks, spawn_ranks
from diffulex.testing.tolerance import assert_close_up_to_reordering

WORLD = 2
HIDDEN = 16
ROWS = 5


def load_from(sharded: nn.Module, whole: nn.Module) -> None:
    """Every parameter of ``sharded`` loaded from the same-named tensor of ``whole`` (a full checkpoint)."""
    tensors = dict(whole.named_parameters())
    for name, param in sharded.named_parameters():
        owner = sharded.get_submodule(name.rpartition(".")[0]) if "." in name else sharded
        owner.weight_loader(param, tensors[name].detach())


def built_twice(make: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    """``make()`` whole (single rank) and sharded over the process's group, the sharded one loaded from the whole."""
    group = tensor_parallel_group()
    reset_tensor_parallel()
    torch.manual_seed(0)
    whole = make()
    init_tensor_parallel(group.process_group)
    sharded = make()
    load_from(sharded, whole)
    return whole, sharded


def gathered_parts(outputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [tensor_parallel_group().all_gather(out, dim=-1) for out in outputs]


def check_column_parallel() -> None:
    whole, sharded = built_twice(lambda: ColumnParallelLinear(HIDDEN, 12, bias=True))
    assert sharded.weight.shape == (12 // WORLD, HIDDEN)
    x = torch.randn(ROWS, HIDDEN)
    assert_close_up_to_reordering(tensor_parallel_group().all_gather(sharded(x)), whole(x), terms=HIDDEN)


def check_row_parallel() -> None:
    whole, sharded = built_twice(lambda: RowParallelLinear(12, HIDDEN, bias=True))
    assert sharded.weight.shape == (HIDDEN, 12 // WORLD)
    x = torch.randn(ROWS, 12)
    rank = tensor_parallel_group().rank
    mine = x[:, rank * 6 : (rank + 1) * 6]
    assert_close_up_to_reordering(sharded(mine), whole(x), terms=12)
    assert_close_up_to_reordering(sharded.forward_unsummed(mine), whole(x), terms=12)


def check_fused_qkv_parts() -> None:
    parts = [8, 4, 4]
    whole, sharded = built_twice(lambda: ColumnParallelLinear(HIDDEN, sum(parts), bias=True, output_parts=parts))
    x = torch.randn(ROWS, HIDDEN)
    local = sharded(x).split([p // WORLD for p in parts], dim=-1)
    for got, want in zip(gathered_parts(local), whole(x).split(parts, dim=-1), strict=True):
        assert_close_up_to_reordering(got, want, terms=HIDDEN)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = ColumnParallelLinear(HIDDEN, 8, bias=True)
        self.k_proj = ColumnParallelLinear(HIDDEN, 4, bias=True)
        self.v_proj = ColumnParallelLinear(HIDDEN, 4, bias=True)


class GatedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(HIDDEN, 24)
        self.up_proj = ColumnParallelLinear(HIDDEN, 24)
        self.down_proj = RowParallelLinear(24, HIDDEN)

    def forward(self, x: torch.Tensor, merged: MergedProjection) -> torch.Tensor:
        gate, up = merged(x)
        return self.down_proj(nn.functional.silu(gate) * up)


def check_merged_qkv() -> None:
    whole, sharded = built_twice(Attention)
    merged = MergedProjection(sharded.q_proj, sharded.k_proj, sharded.v_proj)
    assert merged.merge()
    x = torch.randn(ROWS, HIDDEN)
    expected = (whole.q_proj(x), whole.k_proj(x), whole.v_proj(x))
    for got, want in zip(gathered_parts(merged(x)), expected, strict=True):
        assert_close_up_to_reordering(got, want, terms=HIDDEN)


def check_merged_gate_up_mlp() -> None:
    whole, sharded = built_twice(GatedMLP)
    merged = MergedProjection(sharded.gate_proj, sharded.up_proj)
    assert merged.merge()
    x = torch.randn(ROWS, HIDDEN)
    expected = whole(x, MergedProjection(whole.gate_proj, whole.up_proj))
    assert_close_up_to_reordering(sharded(x, merged), expected, terms=HIDDEN + 24)


def check_vocabulary(vocab: int) -> None:
    whole, sharded = built_twice(lambda: VocabEmbedding(vocab, HIDDEN))
    ids = torch.randint(0, vocab, (3, 7))
    ids[0, :2] = torch.tensor([0, vocab - 1])
    assert torch.equal(sharded(ids), whole(ids))

    whole_head, sharded_head = built_twice(lambda: LMHead(vocab, HIDDEN))
    x = torch.randn(ROWS, HIDDEN)
    logits = sharded_head(x)
    assert logits.shape == (ROWS, vocab)
    assert_close_up_to_reordering(logits, whole_head(x), terms=HIDDEN)

    sharded_head.tie_to(sharded)
    assert_close_up_to_reordering(sharded_head(x), x @ whole.weight.T, terms=HIDDEN)


def check_even_vocabulary() -> None:
    check_vocabulary(12)


def check_uneven_vocabulary() -> None:
    check_vocabulary(11)


CHECKS: dict[str, Callable[[], None]] = {
    "column_parallel": check_column_parallel,
    "row_parallel": check_row_parallel,
    "fused_qkv_parts": check_fused_qkv_parts,
    "merged_qkv": check_merged_qkv,
    "merged_gate_up_mlp": check_merged_gate_up_mlp,
    "even_vocabulary": check_even_vocabulary,
    "uneven_vocabulary": check_uneven_vocabulary,
}
# A rank stuck in a collective its peer never joins fails after this instead of hanging the suite.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def run_rank(rank: int, port: int, out_dir: str) -> None:
    """Every check in order on this rank, each one's name appended to the rank's file once it passed; the first
    failure raises (and `mp.spawn` ends the other rank)."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        init_tensor_parallel()
        run_checks(rank, out_dir, CHECKS)
    finally:
        reset_tensor_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> RankRun:
    """One spawn of two gloo ranks running every check (starting processes dominates the cost)."""
    return spawn_ranks(run_rank, WORLD, tmp_path_factory.mktemp("tensor_parallel"))


@pytest.mark.parametrize("check", list(CHECKS))
def test_two_ranks_give_the_single_rank_result(two_ranks: RankRun, check: str) -> None:
    assert check in two_ranks.passed, two_ranks.failure or f"{check} did not run"


def test_the_default_group_is_one_rank_whose_collectives_return_their_input() -> None:
    group = tensor_parallel_group()
    assert group == SINGLE_RANK and (group.rank, group.size) == (0, 1)
    x = torch.randn(3, 4)
    assert group.all_reduce(x) is x and group.all_gather(x) is x
    assert ColumnParallelLinear(HIDDEN, 12).weight.shape == (12, HIDDEN)
    assert VocabEmbedding(11, HIDDEN).weight.shape == (11, HIDDEN)


def test_init_without_torch_distributed_is_refused() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        init_tensor_parallel()


def test_a_size_that_does_not_split_evenly_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"output features=7 is invalid for tensor_parallel_size=2"):
        TensorParallelGroup(rank=1, size=2).shard(7, "output features")
    assert TensorParallelGroup(rank=1, size=2).shard(8, "output features") == (4, 4)


def test_the_vocabulary_splits_into_equal_padded_slices() -> None:
    slices = [TensorParallelGroup(rank=r, size=4).padded_shard(5) for r in range(4)]
    assert slices == [(0, 2, 2), (2, 2, 2), (4, 1, 2), (5, 0, 2)]


def test_output_parts_must_add_up_to_the_output_size() -> None:
    with pytest.raises(ValueError, match=r"output_parts=\[8, 4\] is invalid: must add up to output_size=16"):
        ColumnParallelLinear(HIDDEN, 16, output_parts=[8, 4])


def test_a_checkpoint_tensor_of_another_shape_is_refused() -> None:
    layer = RowParallelLinear(12, HIDDEN)
    with pytest.raises(ValueError, match=r"RowParallelLinear: checkpoint tensor of shape \(16, 10\)"):
        layer.weight_loader(layer.weight, torch.zeros(HIDDEN, 10))
    full = torch.randn(HIDDEN, 12)
    layer.weight_loader(layer.weight, full)
    assert torch.equal(layer.weight, full)
