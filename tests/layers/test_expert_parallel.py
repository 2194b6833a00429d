"""Experts split over two ranks (gloo, two processes): the mixture gives the output of one rank holding them all.

Each rank builds the layer twice from one seed: whole (before the expert group exists, as at EP=1) and with only
its own experts (after `init_expert_parallel`), loads the whole layer's tensors into the split one (the experts
through ``expert_weight_loader``, which keeps only this rank's), and compares both on the same random tokens in
float32, for every router kind, with and without a shared expert, on every execution path. A rank computing
another rank's experts, or missing its own, is off by a whole expert's contribution, far beyond the tolerance.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from diffulex.layers import merge_projections
from diffulex.layers.moe import (
    MOE_IMPLS,
    GatedMLP,
    GroupLimitedRouter,
    ScaledSoftmaxRouter,
    SoftmaxRouter,
    SparseMoE,
    grouped_mm_supported,
)
from diffulex.layers.parallel_state import (
    SINGLE_EXPERT_RANK,
    SINGLE_RANK,
    ExpertParallelGroup,
    TensorParallelGroup,
    engine_ranks,
    expert_parallel_group,
    init_expert_parallel,
    init_tensor_parallel,
    reset_expert_parallel,
    reset_tensor_parallel,
    using_expert_parallel_group,
    using_tensor_parallel_group,
)
from diffulex.testing.distributed import RankRun, run_checks, spawn_ranks
from diffulex.testing.tolerance import assert_close_up_to_reordering

WORLD = 2
HIDDEN, INTER, SHARED_INTER, EXPERTS, TOP_K = 16, 8, 4, 8, 2
ROWS = 13
# gate/up over HIDDEN, down over INTER, the weighted sum over TOP_K, and the sum over the ranks
MOE_TERMS = HIDDEN + INTER + TOP_K + WORLD
SHARED_TERMS = HIDDEN + SHARED_INTER + 1
# The ranks run on the CPU: the grouped GEMM where this torch has a CPU kernel, the fused Triton kernels under the
# Triton interpreter only (the ranks inherit TRITON_INTERPRET; tests/kernels/test_fused_moe.py checks their
# skipping of other ranks' pairs either way).
IMPLS = [
    impl
    for impl in MOE_IMPLS
    if (impl != "grouped" or grouped_mm_supported(torch.zeros(1)))
    and (impl != "fused" or os.environ.get("TRITON_INTERPRET") == "1")
]

ROUTERS: dict[str, Callable[[], torch.nn.Module]] = {
    "softmax": lambda: SoftmaxRouter(HIDDEN, EXPERTS, TOP_K, normalize=True),
    "group_limited": lambda: GroupLimitedRouter(HIDDEN, EXPERTS, TOP_K, n_group=4, topk_group=2, scaling=2.5),
    "scaled_softmax": lambda: ScaledSoftmaxRouter(HIDDEN, EXPERTS, TOP_K, eps=1e-6),
}


def make_moe(router: str, shared: bool) -> SparseMoE:
    """The layer under the groups set now, random weights from a fixed seed (the same on every rank)."""
    torch.manual_seed(0)
    moe = SparseMoE(HIDDEN, INTER, ROUTERS[router](), GatedMLP(HIDDEN, SHARED_INTER) if shared else None)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, 0.5)
        for buffer in moe.buffers():
            buffer.normal_(0.0, 0.1)  # LLaDA2's expert_bias
    return moe


def load_from(split: SparseMoE, whole: SparseMoE) -> int:
    """Every tensor of ``whole`` (a full checkpoint) into ``split``; returns how many expert tensors it kept."""
    kept = 0
    for name, tensor in whole.state_dict().items():
        if name.startswith("experts."):
            kept += split.expert_weight_loader(name, tensor)
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = split.get_submodule(owner_name) if owner_name else split
        target = getattr(owner, leaf)
        if hasattr(owner, "weight_loader"):
            owner.weight_loader(target, tensor)
        else:
            target.data.copy_(tensor)
    return kept


def built_twice(router: str, shared: bool) -> tuple[SparseMoE, SparseMoE]:
    group = expert_parallel_group()
    reset_expert_parallel()
    whole = make_moe(router, shared)
    init_expert_parallel(group.process_group)
    split = make_moe(router, shared)
    assert load_from(split, whole) == 3 * EXPERTS // WORLD  # gate, up and down of each of its experts
    return whole, split


def check_every_path(router: str, shared: bool) -> Callable[[], None]:
    def check() -> None:
        whole, split = built_twice(router, shared)
        x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(1))
        expected = whole.reference(x)
        terms = MOE_TERMS + (SHARED_TERMS if shared else 0)
        for merged in (False, True):
            if merged:
                merge_projections(split)
                assert split.stack.gate_up is not None and len(split.stack.gate_up) == EXPERTS // WORLD
            for impl in IMPLS:
                split.impl = impl
                assert_close_up_to_reordering(split(x), expected, terms)

    return check


def check_each_rank_holds_only_its_range() -> None:
    whole, split = built_twice("softmax", shared=False)
    rank = expert_parallel_group().rank
    mine = range(rank * EXPERTS // WORLD, (rank + 1) * EXPERTS // WORLD)
    assert split.experts.owned == mine
    expected = {f"experts.{e}.{p}.weight" for e in mine for p in ("gate_proj", "up_proj", "down_proj")}
    assert {n for n in split.state_dict() if n.startswith("experts.")} == expected
    for e in mine:
        assert torch.equal(split.experts[e].down_proj.weight, whole.experts[e].down_proj.weight)
    foreign = (rank + 1) % WORLD * EXPERTS // WORLD
    assert not split.expert_weight_loader(f"experts.{foreign}.up_proj.weight", torch.zeros(INTER, HIDDEN))
    with pytest.raises(IndexError, match=f"expert {foreign} is not held here"):
        split.experts[foreign]


def check_tensor_parallel_experts() -> None:
    """EP=1 under TP=2: each expert split over the TP ranks; the stacked paths sum the ranks' partial products."""
    reset_expert_parallel()
    whole = make_moe("softmax", shared=True)
    init_tensor_parallel()
    try:
        split = make_moe("softmax", shared=True)
        assert split.experts[0].gate_proj.weight.shape == (INTER // WORLD, HIDDEN)
        assert load_from(split, whole) == 3 * EXPERTS
        x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(2))
        expected = whole.reference(x)
        for merged in (False, True):
            if merged:
                merge_projections(split)
                assert split.stack.gate_up is not None
            for impl in IMPLS:
                split.impl = impl
                assert_close_up_to_reordering(split(x), expected, MOE_TERMS + SHARED_TERMS)
    finally:
        reset_tensor_parallel()
        init_expert_parallel()


def check_expert_and_tensor_parallel_on_the_same_ranks() -> None:
    """EP=2 and TP=2 over the same two ranks: the experts whole on their owner, the shared expert TP-split."""
    reset_expert_parallel()
    whole = make_moe("group_limited", shared=True)
    init_tensor_parallel()
    init_expert_parallel()
    try:
        split = make_moe("group_limited", shared=True)
        first = next(iter(split.experts))
        assert first.gate_proj.weight.shape == (INTER, HIDDEN)
        assert split.shared_experts.gate_proj.weight.shape == (SHARED_INTER // WORLD, HIDDEN)
        assert load_from(split, whole) == 3 * EXPERTS // WORLD
        x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(3))
        expected = whole.reference(x)
        merge_projections(split)
        assert split.stack.gate_up is not None and split.shared_joins_reduce
        for impl in IMPLS:
            split.impl = impl
            with counted_all_reduces() as calls:
                out = split(x)
            assert len(calls) == 1, f"{impl}: the shared expert's slice joins the experts' one all-reduce"
            assert_close_up_to_reordering(out, expected, MOE_TERMS + SHARED_TERMS)
    finally:
        reset_tensor_parallel()


@contextmanager
def counted_all_reduces() -> Iterator[list[int]]:
    """The all-reduces run inside the block, by the size of their tensor."""
    calls: list[int] = []
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = real


CHECKS: dict[str, Callable[[], None]] = {
    f"{router}{'+shared' if shared else ''}": check_every_path(router, shared)
    for router in ROUTERS
    for shared in (False, True)
}
CHECKS["owned_range"] = check_each_rank_holds_only_its_range
CHECKS["tensor_parallel_experts"] = check_tensor_parallel_experts
CHECKS["expert_and_tensor_parallel"] = check_expert_and_tensor_parallel_on_the_same_ranks
# A rank stuck in a collective its peer never joins fails after this instead of hanging the suite.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def run_rank(rank: int, port: int, out_dir: str) -> None:
    """Every check in order on this rank, each one's name appended to the rank's file once it passed."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        init_expert_parallel()
        run_checks(rank, out_dir, CHECKS)
    finally:
        reset_expert_parallel()
        reset_tensor_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> RankRun:
    """One spawn of two gloo ranks running every check (starting processes dominates the cost)."""
    return spawn_ranks(run_rank, WORLD, tmp_path_factory.mktemp("expert_parallel"))


@pytest.mark.parametrize("check", list(CHECKS))
def test_two_expert_ranks_give_the_single_rank_result(two_ranks: RankRun, check: str) -> None:
    assert check in two_ranks.passed, two_ranks.failure or f"{check} did not run"


def test_the_default_expert_group_holds_every_expert_and_its_all_reduce_returns_its_input() -> None:
    assert expert_parallel_group() is SINGLE_EXPERT_RANK
    x = torch.randn(3)
    assert SINGLE_EXPERT_RANK.all_reduce(x) is x
    moe = SparseMoE(HIDDEN, INTER, SoftmaxRouter(HIDDEN, 6, TOP_K, normalize=True))
    assert moe.experts.owned == range(6) and len(moe.experts) == 6


def test_init_without_torch_distributed_is_refused() -> None:
    with pytest.raises(RuntimeError, match="init_expert_parallel needs torch.distributed"):
        init_expert_parallel()


def test_experts_that_do_not_split_evenly_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="num_experts=6 is invalid for expert_parallel_size=4: must be divisible"):
        ExpertParallelGroup(rank=1, size=4).owned_experts(6)
    assert ExpertParallelGroup(rank=1, size=3).owned_experts(6) == range(2, 4)


def test_a_tensor_that_names_no_expert_is_refused() -> None:
    moe = SparseMoE(HIDDEN, INTER, SoftmaxRouter(HIDDEN, 6, TOP_K, normalize=True))
    with pytest.raises(ValueError, match="'gate.weight' is invalid: must be experts"):
        moe.expert_weight_loader("gate.weight", torch.zeros(6, HIDDEN))
    with pytest.raises(ValueError, match="'experts.6.up_proj.weight' is invalid: the layer has 6 experts"):
        moe.expert_weight_loader("experts.6.up_proj.weight", torch.zeros(INTER, HIDDEN))
    with pytest.raises(ValueError, match="must have 8 along dim 0"):
        moe.expert_weight_loader("experts.2.up_proj.weight", torch.zeros(INTER + 1, HIDDEN))


def test_the_engine_ranks_are_the_larger_of_the_tensor_and_expert_groups() -> None:
    """The engine's layouts make one group span all its ranks: that one carries what every rank must agree on."""
    assert engine_ranks() is SINGLE_RANK
    with using_expert_parallel_group(ExpertParallelGroup(rank=1, size=2)):
        assert engine_ranks() == TensorParallelGroup(rank=1, size=2)
        tensor = TensorParallelGroup(rank=1, size=2)
        with using_tensor_parallel_group(tensor):
            assert engine_ranks() is tensor
    with using_tensor_parallel_group(TensorParallelGroup(rank=1, size=4)):
        assert engine_ranks().size == 4
