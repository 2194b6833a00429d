"""The router's fused softmax and top-k against the torch code of `diffulex.layers.moe.route` (the CPU path)."""

from __future__ import annotations

import pytest
import torch

from diffulex.kernels.moe_routing import softmax_topk
from diffulex.layers.moe import route
from tests.kernels.test_fused_norm import DEVICE


def _logits(rows: int, experts: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Distinct logits in every row (steps of 1/16, exact in bf16): which of two equal probabilities comes first
    is the one thing the kernel and torch's top-k need not agree on (the next test says what the kernel does)."""
    gen = torch.Generator().manual_seed(seed)
    steps = torch.stack([torch.randperm(experts, generator=gen) for _ in range(rows)])
    return (steps.float() / 16 - experts / 32).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "experts", "top_k"), [(1, 128, 8), (7, 128, 8), (33, 64, 4), (5, 100, 2), (3, 8, 1)])
@pytest.mark.parametrize("normalize", [True, False])
def test_the_chosen_experts_and_their_weights_are_the_torch_routes(dtype, rows, experts, top_k, normalize):
    logits = _logits(rows, experts, dtype, rows * 100 + experts)
    want_w, want_e = route(logits, top_k, normalize)  # CPU tensors: the torch code
    got_w, got_e = softmax_topk(logits.to(DEVICE), top_k, normalize)
    assert got_w.dtype == torch.float32 and got_e.dtype == torch.int64
    assert got_w.shape == got_e.shape == (rows, top_k)
    assert torch.equal(got_e.cpu(), want_e), "the same experts, in decreasing probability"
    torch.testing.assert_close(got_w.cpu(), want_w, rtol=4e-6, atol=1e-7)


def test_each_weight_takes_its_experts_scale_in_the_same_launch():
    """DiffusionGemma's ``per_expert_scale``: the kernel's weights times the chosen experts' entries, the product the
    torch code forms after the routing, bit for bit; the torch route with the scale is the same."""
    logits = _logits(9, 64, torch.bfloat16, 5)
    scale = (1 + torch.randn(64, generator=torch.Generator().manual_seed(6))).to(torch.bfloat16)
    plain_w, plain_e = softmax_topk(logits.to(DEVICE), 4, True)
    got_w, got_e = softmax_topk(logits.to(DEVICE), 4, True, expert_scale=scale.to(DEVICE))
    assert torch.equal(got_e, plain_e)
    assert torch.equal(got_w, plain_w * scale.to(DEVICE)[plain_e])
    want_w, want_e = route(logits, 4, True, expert_scale=scale)
    assert torch.equal(got_e.cpu(), want_e)
    torch.testing.assert_close(got_w.cpu(), want_w, rtol=4e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"expert_scale has shape \(63,\)"):
        softmax_topk(logits.to(DEVICE), 4, True, expert_scale=scale[:63].to(DEVICE))


def test_strided_logits_are_read_in_place():
    wide = _logits(6, 160, torch.float32, 3)
    logits = wide[:, 16:144]  # rows 160 apart
    want_w, want_e = route(logits, 8, True)
    got_w, got_e = softmax_topk(logits.to(DEVICE), 8, True)
    assert torch.equal(got_e.cpu(), want_e)
    torch.testing.assert_close(got_w.cpu(), want_w, rtol=4e-6, atol=1e-7)


def test_equal_probabilities_go_to_the_lower_expert_first():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0]], device=DEVICE)
    weights, experts = softmax_topk(logits, 3, normalize=True)
    assert experts.cpu().tolist() == [[1, 3, 4]]
    torch.testing.assert_close(weights.cpu(), torch.full((1, 3), 1 / 3))


def test_nan_logits_still_choose_experts_that_exist():
    """A NaN hidden state must not turn into an expert index past the table (an out-of-bounds access ends the CUDA
    context for every request): NaN counts as the largest score, as in ``torch.topk``."""
    from diffulex.kernels.moe_routing import group_limited_topk

    logits = torch.randn(3, 8)
    logits[0, 5] = float("nan")  # one NaN: the row's softmax is NaN throughout
    logits[1] = float("nan")
    _, experts = softmax_topk(logits.to(DEVICE), 3, normalize=True)
    assert experts.cpu().tolist()[:2] == [[0, 1, 2], [0, 1, 2]] and 0 <= int(experts.min()) <= int(experts.max()) < 8
    _, grouped = group_limited_topk(logits.to(DEVICE), None, 2, 1, 3, 1.0, 1e-20)
    assert 0 <= int(grouped.min()) <= int(grouped.max()) < 8


def test_a_top_k_outside_the_experts_is_refused_by_name():
    with pytest.raises(ValueError, match=r"top_k=9 must be in \[1, 8\]"):
        softmax_topk(torch.zeros(2, 8, device=DEVICE), 9, normalize=True)


@pytest.mark.parametrize(
    ("experts", "n_group", "topk_group", "top_k", "with_bias"),
    [(256, 8, 4, 8, True), (256, 8, 4, 8, False), (64, 4, 2, 1, True), (32, 1, 1, 4, True)],
)
@pytest.mark.parametrize("rows", [1, 9])
def test_the_group_limited_choice_and_weights_are_llada2s_router(experts, n_group, topk_group, top_k, with_bias, rows):
    from diffulex.kernels.moe_routing import group_limited_topk
    from diffulex.layers.moe import _WEIGHT_SUM_FLOOR, GroupLimitedRouter

    hidden = 48
    router = GroupLimitedRouter(hidden, experts, top_k, n_group, topk_group, scaling=2.5, expert_bias=with_bias)
    gen = torch.Generator().manual_seed(experts + rows)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, hidden, generator=gen) / hidden**0.5)
        if with_bias:
            router.expert_bias.copy_(0.3 * torch.randn(experts, generator=gen))
    x = torch.randn(rows, hidden, generator=gen)
    with torch.no_grad():
        want_w, want_e = router.route(x)  # CPU: the torch code
        logits = x.float() @ router.weight.float().T
    bias = router.expert_bias.to(DEVICE) if with_bias else None
    got_w, got_e = group_limited_topk(logits.to(DEVICE), bias, n_group, topk_group, top_k, 2.5, _WEIGHT_SUM_FLOOR)
    assert torch.equal(got_e.cpu(), want_e), "the same experts, in decreasing biased score"
    torch.testing.assert_close(got_w.cpu(), want_w, rtol=4e-6, atol=1e-7)


def test_the_experts_of_a_closed_group_are_never_chosen():
    """Group 1's best expert beats every expert of group 0, but group 0's two best sum higher: with one open group,
    every chosen expert is group 0's."""
    from diffulex.kernels.moe_routing import group_limited_topk

    logits = torch.full((1, 8), -4.0)
    logits[0, :4] = torch.tensor([1.0, 0.9, 0.8, -3.0])  # group 0: two best sum highest
    logits[0, 4:] = torch.tensor([3.0, -3.0, -3.5, -3.9])  # group 1: the single best expert
    _, experts = group_limited_topk(logits.to(DEVICE), None, 2, 1, 3, 1.0, 1e-20)
    assert experts.cpu().tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("rows_per_program", [1, 2, 16])
def test_the_choice_is_the_same_whatever_rows_each_program_takes(rows_per_program):
    """The rows a program selects for change the launch's shape (`bench/moe_routing_bench.py` times them), never
    the experts chosen; the weights only by the rounding of a softmax summed in another order (a one-row program
    reduces its scores in another layout on a GPU)."""
    from diffulex.kernels.moe_routing import group_limited_topk

    logits = _logits(9, 256, torch.float32, 5).to(DEVICE)
    for got, want in (
        (softmax_topk(logits, 8, True, rows_per_program), softmax_topk(logits, 8, True)),
        (group_limited_topk(logits, None, 8, 4, 8, 2.5, 1e-20, rows_per_program),
         group_limited_topk(logits, None, 8, 4, 8, 2.5, 1e-20)),
    ):  # fmt: skip
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)


def test_rows_per_program_other_than_a_power_of_two_is_refused_by_name():
    with pytest.raises(ValueError, match=r"rows_per_program=3 is invalid: must be a power of two >= 1"):
        softmax_topk(torch.zeros(2, 8, device=DEVICE), 2, normalize=True, rows_per_program=3)
