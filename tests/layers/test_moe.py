"""The sparse mixture-of-experts MLP: routing, its three execution paths, and the stacked expert weights."""

from __future__ import annotations

import os

import pytest
import torch

from diffulex.layers import merge_projections
from diffulex.layers.moe import (
    MOE_IMPLS,
    GatedMLP,
    GroupLimitedRouter,
    ScaledSoftmaxRouter,
    SoftmaxRouter,
    SparseMoE,
    grouped_mm_supported,
    route,
)
from diffulex.testing.tolerance import assert_close_up_to_reordering

HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 6, 2
# An expert's output chains three float32 reductions (gate/up over HIDDEN, down over INTER, the weighted sum over
# TOP_K); the paths differ only in their order.
MOE_TERMS = HIDDEN + INTER + TOP_K
# The fused Triton kernels run CPU tensors only under the Triton interpreter (which tests/kernels/conftest.py turns
# on without a GPU); tests/kernels/test_fused_moe.py checks them through this layer either way.
CPU_IMPLS = [impl for impl in MOE_IMPLS if impl != "fused" or os.environ.get("TRITON_INTERPRET") == "1"]


def skip_without_grouped_mm(impl: str) -> None:
    """The grouped path on the CPU needs a torch with a CPU grouped GEMM (torch 2.13 has one; older may not)."""
    if impl == "grouped" and not grouped_mm_supported(torch.zeros(1)):
        pytest.skip("this torch has no CPU grouped GEMM")


def make_moe(normalize: bool = True, seed: int = 0, dtype: torch.dtype = torch.float32) -> SparseMoE:
    torch.manual_seed(seed)
    moe = SparseMoE(HIDDEN, INTER, SoftmaxRouter(HIDDEN, EXPERTS, TOP_K, normalize))
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, 0.5)
    return moe.to(dtype)


def test_route_keeps_the_top_k_softmax_probabilities():
    logits = torch.randn(7, EXPERTS, generator=torch.Generator().manual_seed(1))
    probs = logits.softmax(-1)
    weights, experts = route(logits, TOP_K, normalize=False)
    assert torch.equal(experts.sort(-1).values, probs.topk(TOP_K).indices.sort(-1).values)
    torch.testing.assert_close(weights, probs.gather(1, experts))
    normalized, same = route(logits, TOP_K, normalize=True)
    assert torch.equal(same, experts)
    torch.testing.assert_close(normalized.sum(-1), torch.ones(7))
    torch.testing.assert_close(normalized, weights / weights.sum(-1, keepdim=True))


def test_route_scores_in_float32_whatever_the_input_dtype():
    logits = torch.randn(3, EXPERTS).to(torch.bfloat16)
    weights, _ = route(logits, TOP_K, normalize=True)
    assert weights.dtype == torch.float32


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_every_path_equals_the_token_by_token_definition(impl, merged, normalize):
    skip_without_grouped_mm(impl)
    moe = make_moe(normalize)
    if merged:
        assert merge_projections(moe) == 1
    moe.impl = impl
    x = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(2))
    assert_close_up_to_reordering(moe(x), moe.reference(x), MOE_TERMS)


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_experts_without_tokens_are_skipped_cleanly(impl):
    """A router that sends every token to the same two experts leaves the others empty (zero-length groups)."""
    skip_without_grouped_mm(impl)
    moe = make_moe()
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[1].fill_(1.0)
        moe.gate.weight[4].fill_(0.5)
    merge_projections(moe)
    moe.impl = impl
    x = torch.rand(5, HIDDEN) + 0.1  # positive, so experts 1 and 4 score highest for every token
    assert_close_up_to_reordering(moe(x), moe.reference(x), MOE_TERMS)


def test_a_single_token_is_routed_like_in_a_batch():
    skip_without_grouped_mm("grouped")
    moe = make_moe()
    merge_projections(moe)
    moe.impl = "grouped"
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(3))
    batch = moe(x)
    for t in range(9):
        assert_close_up_to_reordering(moe(x[t : t + 1])[0], batch[t], MOE_TERMS, magnitude=batch)


def test_merging_stacks_the_experts_as_views_under_their_names():
    moe = make_moe()
    before = {name: t.clone() for name, t in moe.state_dict().items()}
    merge_projections(moe)
    after = moe.state_dict()
    assert set(after) == set(before)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    stack = moe.stack
    assert stack.gate_up is not None and stack.gate_up.shape == (EXPERTS, 2 * INTER, HIDDEN)
    assert stack.down is not None and stack.down.shape == (EXPERTS, HIDDEN, INTER)
    expert = moe.experts[3]
    assert expert.gate_proj.weight.data_ptr() == stack.gate_up[3].data_ptr()
    assert expert.up_proj.weight.data_ptr() == stack.gate_up[3, INTER:].data_ptr()
    assert expert.down_proj.weight.data_ptr() == stack.down[3].data_ptr()


def test_experts_with_a_forward_hook_stay_separate():
    """A hook (LoRA applied per forward) must see each expert's own product, so nothing is stacked."""
    moe = make_moe()
    moe.experts[0].up_proj.register_forward_hook(lambda module, args, out: out)
    assert merge_projections(moe) == 0
    assert moe.stack.gate_up is None


def test_an_unknown_impl_is_refused_by_name():
    moe = make_moe()
    moe.impl = "fast"
    with pytest.raises(ValueError, match="moe impl must be one of fused, grouped, dense, loop, got 'fast'"):
        moe(torch.randn(2, HIDDEN))


def test_top_k_beyond_the_experts_is_refused():
    with pytest.raises(ValueError, match="num_experts_per_tok must be in \\[1, num_experts=4\\], got 5"):
        SoftmaxRouter(HIDDEN, 4, 5, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("impl", ["fused", "grouped", "dense"])
def test_the_static_paths_replay_in_a_cuda_graph_gpu(impl):
    """No static path asks the host anything, so a captured graph replays them with new inputs."""
    dtype = torch.float32 if impl == "dense" else torch.bfloat16
    moe = make_moe(dtype=dtype).cuda()
    merge_projections(moe)
    moe.impl = impl
    x = torch.randn(8, HIDDEN, device="cuda", dtype=dtype)
    moe(x)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(x)
    x.copy_(torch.randn(8, HIDDEN, device="cuda", dtype=dtype))
    graph.replay()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), moe.reference(x).float(), atol=tol, rtol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the path choice on CUDA")
def test_decode_steps_take_the_fused_kernels_and_larger_steps_the_grouped_gemm_gpu():
    """Stacked bf16 experts: the fused kernels while the busiest expert's expected pairs fit one tile
    (`fused_wins`), the grouped GEMM (or every expert, without one) beyond."""
    moe = make_moe(dtype=torch.bfloat16).cuda()
    merge_projections(moe)
    decode = torch.randn(4, HIDDEN, device="cuda", dtype=torch.bfloat16)
    assert moe._impl_for(decode) == "fused"
    prefill = torch.randn(4096, HIDDEN, device="cuda", dtype=torch.bfloat16)
    assert moe._impl_for(prefill) == ("grouped" if grouped_mm_supported(prefill) else "dense")
    assert moe._impl_for(decode.float()) != "fused"  # float32 stays on the torch paths


def test_experts_with_a_hook_run_as_modules_so_the_hook_applies():
    """A per-forward LoRA on one expert changes the output only if that expert runs as its module."""
    moe = make_moe()
    moe.experts[0].down_proj.register_forward_hook(lambda module, args, out: out * 0)
    merge_projections(moe)
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(5))
    assert_close_up_to_reordering(moe(x), moe.reference(x), MOE_TERMS)
    moe.impl = "dense"  # the CUDA path of hooked experts, which a graph can capture
    assert_close_up_to_reordering(moe(x), moe.reference(x), MOE_TERMS)


def group_router(scaling: float = 1.0, **kwargs) -> GroupLimitedRouter:
    """8 experts in 4 groups of 2, 2 per token from the best group; scores are set through `weight` and a one-hot
    input, so each expert's logit is chosen directly."""
    router = GroupLimitedRouter(8, 8, 2, n_group=4, topk_group=1, scaling=scaling, **kwargs)
    with torch.no_grad():
        router.weight.copy_(torch.eye(8))
        if router.expert_bias is not None:
            router.expert_bias.zero_()
    return router


def test_group_limited_routing_picks_only_inside_the_best_group():
    """GatedMLP 0 scores highest alone, but group 3 (experts 6, 7) has the best pair: both come from group 3."""
    x = torch.tensor([[3.0, -3.0, 0.0, 0.0, 0.0, 0.0, 2.0, 2.0]])
    weights, experts = group_router().route(x)
    assert sorted(experts[0].tolist()) == [6, 7]
    torch.testing.assert_close(weights.sum(-1), torch.ones(1))


def test_expert_bias_moves_the_choice_but_not_the_weights():
    x = torch.tensor([[1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    router = group_router(scaling=2.5)
    _, experts = router.route(x)
    assert sorted(experts[0].tolist()) == [0, 1]
    with torch.no_grad():
        router.expert_bias[4] = 5.0  # group 2 now wins, and within it expert 4 first
    weights, experts = router.route(x)
    assert experts[0].tolist()[0] == 4 and sorted(experts[0].tolist()) == [4, 5]
    scores = torch.sigmoid(torch.tensor([0.0, 0.0]))
    torch.testing.assert_close(weights[0], 2.5 * scores / scores.sum())


def test_a_router_without_expert_bias_has_no_such_tensor():
    router = group_router(expert_bias=False)
    assert "expert_bias" not in router.state_dict()
    assert router.route(torch.randn(3, 8))[1].shape == (3, 2)


def test_group_settings_that_cannot_hold_the_experts_are_refused():
    with pytest.raises(ValueError, match="n_group \\(3\\) must divide num_experts \\(8\\)"):
        GroupLimitedRouter(8, 8, 2, n_group=3, topk_group=1, scaling=1.0)
    with pytest.raises(ValueError, match="topk_group must be in \\[1, n_group=4\\].*got 1"):
        GroupLimitedRouter(8, 8, 4, n_group=4, topk_group=1, scaling=1.0)


def test_the_shared_expert_is_added_for_every_token():
    routed = make_moe()
    shared = GatedMLP(HIDDEN, 4)
    with torch.no_grad():
        for param in shared.parameters():
            param.normal_(0.0, 0.5)
    both = SparseMoE(HIDDEN, INTER, routed.gate, shared_experts=shared)
    both.experts = routed.experts
    x = torch.randn(6, HIDDEN)
    # the shared expert's reductions (over HIDDEN and its 4 rows) and one more addition come on top
    assert_close_up_to_reordering(both(x), routed(x) + shared(x), MOE_TERMS + HIDDEN + 4 + 1)



def test_a_merged_shared_expert_computes_gate_and_up_in_one_product_with_the_same_result():
    torch.manual_seed(0)
    shared = GatedMLP(HIDDEN, 4, merge_gate_up=True)
    with torch.no_grad():
        for param in shared.parameters():
            param.normal_(0.0, 0.5)
    x = torch.randn(6, HIDDEN)
    separate = shared(x)
    assert merge_projections(shared) == 1
    assert shared.gate_up.weight.shape == (8, HIDDEN)
    assert shared.up_proj.weight.data_ptr() == shared.gate_up.weight[4:].data_ptr()  # the names stay, as views
    assert_close_up_to_reordering(shared(x), separate, HIDDEN + 4)
    assert "gate_up" not in "".join(shared.state_dict())  # the checkpoint's names only


def test_an_expert_never_merges_its_own_gate_and_up():
    """Its layer's `ExpertStack` joins its weights: a second join would copy them away from the stack."""
    moe = make_moe()
    merge_projections(moe)
    assert all(expert.gate_up is None for expert in moe.experts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the float32 product of two-byte inputs is a CUDA GEMM")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_router_logits_of_two_byte_inputs_are_the_float32_product_gpu(dtype):
    from diffulex.layers.moe import float32_logits

    torch.manual_seed(0)
    x = torch.randn(32, 2048, device="cuda").to(dtype)
    weight = (0.02 * torch.randn(256, 2048, device="cuda")).to(dtype)  # scores away from the sigmoid's saturation
    logits = float32_logits(x, weight)
    assert logits.dtype == torch.float32
    # the products are exact in float32; only the order of the 2,048 sums differs from the float32 GEMM's
    assert_close_up_to_reordering(logits, (x.double() @ weight.double().T).float(), 2048)
    router = GroupLimitedRouter(2048, 256, 8, n_group=8, topk_group=4, scaling=2.5).to("cuda", dtype)
    with torch.no_grad():
        router.weight.copy_(weight)
    _, experts = router.route(x)
    _, float32_experts = router.float().route(x.float())
    assert (experts.sort(-1).values == float32_experts.sort(-1).values).float().mean() > 0.99


def test_scaled_softmax_router_normalizes_scales_then_weights_each_expert():
    """DiffusionGemma's router, against its definition in float64: the input RMS-normalized (no weight), times
    ``scale`` and ``hidden ** -0.5``, projected; softmax, top-k renormalized to 1, then each chosen weight times
    its expert's ``per_expert_scale`` (so the weights no longer sum to 1)."""
    torch.manual_seed(0)
    router = ScaledSoftmaxRouter(hidden_size=16, num_experts=6, top_k=2, eps=1e-6)
    with torch.no_grad():
        router.proj.weight.normal_()
        router.scale.uniform_(0.5, 1.5)
        router.per_expert_scale.uniform_(0.5, 1.5)
    x = torch.randn(5, 16) * 7
    weights, experts = router.route(x)
    x64 = x.double()
    normed = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    probs = (normed * router.scale.double() * 16**-0.5 @ router.proj.weight.double().T).softmax(-1)
    top, chosen = probs.topk(2, dim=-1)
    assert torch.equal(experts, chosen)
    expected = top / top.sum(-1, keepdim=True) * router.per_expert_scale.double()[chosen]
    torch.testing.assert_close(weights.double(), expected, atol=1e-6, rtol=0)
    assert not torch.allclose(weights.sum(-1), torch.ones(5))
