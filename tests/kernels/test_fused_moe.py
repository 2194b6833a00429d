"""The fused MoE kernels against `SparseMoE.reference`, the token-by-token definition, on the CPU under the Triton
interpreter (small shapes) and natively on a GPU; with SiLU (SwiGLU experts) and with Gemma's GELU-tanh.

float32 must agree to the rounding of a different summation order; bf16 to the rounding of its intermediates
(the kernels round where the reference's separate GEMMs and activation round, so a difference is an
intermediate that lands on the other side of a rounding boundary, a few units in the last place of the output).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from diffulex.kernels import fused_moe as fused_moe_module
from diffulex.kernels.fused_moe import (
    ACTIVATIONS,
    MEASURED_CONFIGS,
    FusedMoEConfig,
    config_for,
    fused_moe,
    fused_wins,
    max_tiles,
)
from diffulex.layers import merge_projections
from diffulex.layers.moe import SoftmaxRouter, SparseMoE
from diffulex.testing.tolerance import assert_close_up_to_reordering

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, INTER, EXPERTS = 64, 32, 8
# bf16 outputs may differ from the reference by this many units in the last place of the largest output
BF16_ULPS = 4


def make_moe(top_k: int, dtype: torch.dtype, seed: int = 0) -> SparseMoE:
    torch.manual_seed(seed)
    moe = SparseMoE(HIDDEN, INTER, SoftmaxRouter(HIDDEN, EXPERTS, top_k, normalize=True))
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, 0.3)
    moe = moe.to(DEVICE, dtype)
    assert merge_projections(moe) == 1
    moe.impl = "fused"
    return moe


def assert_matches_reference(out: torch.Tensor, expected: torch.Tensor, top_k: int) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    if expected.dtype == torch.float32:
        assert_close_up_to_reordering(out, expected, HIDDEN + INTER + top_k)
    else:
        atol = BF16_ULPS * torch.finfo(expected.dtype).eps * expected.float().abs().max().item()
        torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("top_k", [2, 4])
@pytest.mark.parametrize("rows", [1, 4, 33])
def test_equals_the_token_by_token_definition(rows: int, top_k: int, dtype: torch.dtype) -> None:
    moe = make_moe(top_k, dtype, seed=rows)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).to(DEVICE, dtype)
    assert_matches_reference(moe(x), moe.reference(x), top_k)


def test_bf16_rounds_like_the_reference_not_like_float32_math() -> None:
    """The kernels round their intermediates to bf16 where the reference does: the output is nearer the bf16
    reference than the float32 computation of the same weights is."""
    moe = make_moe(2, torch.bfloat16, seed=7)
    x = torch.randn(33, HIDDEN, generator=torch.Generator().manual_seed(7)).to(DEVICE, torch.bfloat16)
    expected = moe.reference(x).float()
    out = moe(x).float()
    exact = make_moe(2, torch.float32, seed=7)
    with torch.no_grad():
        for mine, theirs in zip(exact.parameters(), moe.parameters(), strict=True):
            mine.copy_(theirs.float())
    unrounded = exact.reference(x.float())
    assert (out - expected).abs().max() < (unrounded - expected).abs().max()


def test_a_step_is_deterministic() -> None:
    moe = make_moe(4, torch.bfloat16)
    x = torch.randn(33, HIDDEN, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.bfloat16)
    assert torch.equal(moe(x), moe(x))


def stacked(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.3
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.3
    return gate_up.to(DEVICE, dtype), down.to(DEVICE, dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# What each name of `ACTIVATIONS` computes, in PyTorch.
TORCH_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu_tanh": gelu_tanh}


def definition(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """float32 ``sum_j w[t, j] * down_e(act(gate_e x) * up_e x)`` over the slots whose expert is in range."""
    act_fn = TORCH_ACTIVATIONS[activation]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            if 0 <= e < gate_up.shape[0]:
                h = gate_up[e].float() @ x[t].float()
                act = act_fn(h[:INTER]) * h[INTER:]
                out[t] += weights[t, j] * (down[e].float() @ act)
    return out


def unfused(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """The same sum in ``x``'s dtype as separate PyTorch ops round it (DiffusionGemma's grouped path): each GEMM's
    output, the activation and its product with up rounded to the dtype, the slots summed in float32."""
    act_fn = TORCH_ACTIVATIONS[activation]
    total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(experts.shape[1]):
        for t in range(x.shape[0]):
            e = int(experts[t, j])
            if 0 <= e < gate_up.shape[0]:
                gate, up = F.linear(x[t : t + 1], gate_up[e]).chunk(2, dim=-1)
                y = F.linear(act_fn(gate) * up, down[e])
                total[t] += y[0].float() * weights[t, j]
    return total.to(x.dtype)


def routed(rows: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, HIDDEN, generator=gen)
    experts = torch.stack([torch.randperm(EXPERTS, generator=gen)[:top_k] for _ in range(rows)])
    weights = torch.rand(rows, top_k, generator=gen)
    return x.to(DEVICE), weights.to(DEVICE), experts.to(DEVICE)


def test_pairs_of_experts_not_held_here_are_skipped() -> None:
    """Expert parallelism: a rank holding experts 3..6 gets global indices minus 3; pairs outside [0, 4) are
    another rank's and add nothing, and the rest sum as if only those slots were chosen."""
    gate_up, down = stacked(torch.float32)
    x, weights, experts = routed(33, 4, seed=1)
    local = experts - 3
    held_gate_up, held_down = gate_up[3:7], down[3:7]
    out = fused_moe(x, weights, local, held_gate_up, held_down)
    expected = definition(x, weights, local, held_gate_up, held_down)
    assert_close_up_to_reordering(out, expected, HIDDEN + INTER + 4)
    owned = (local >= 0) & (local < 4)
    assert owned.any() and not owned.all()
    # rows whose every pair is elsewhere come out exactly zero
    elsewhere = ~owned.any(dim=1)
    assert torch.equal(out[elsewhere], torch.zeros_like(out[elsewhere]))


def test_two_ranks_add_up_to_the_whole_layer() -> None:
    gate_up, down = stacked(torch.float32, seed=2)
    x, weights, experts = routed(13, 3, seed=2)
    whole = fused_moe(x, weights, experts, gate_up, down)
    halves = fused_moe(x, weights, experts, gate_up[:4], down[:4])
    halves += fused_moe(x, weights, experts - 4, gate_up[4:], down[4:])
    assert_close_up_to_reordering(halves, whole, HIDDEN + INTER + 3 + 1)


def test_experts_without_pairs_are_left_out() -> None:
    """Only experts 1 and 5 are chosen: the others get no tile, so their weights (NaN here) are never used, and
    the sum is still right."""
    gate_up, down = stacked(torch.float32, seed=3)
    x, weights, _ = routed(9, 2, seed=3)
    experts = torch.tensor([[1, 5]] * 9, device=DEVICE)
    expected = definition(x, weights, experts, gate_up, down)
    unused = [e for e in range(EXPERTS) if e not in (1, 5)]
    gate_up[unused] = float("nan")
    down[unused] = float("nan")
    out = fused_moe(x, weights, experts, gate_up, down)
    assert_close_up_to_reordering(out, expected, HIDDEN + INTER + 2)


def test_every_pair_on_one_expert_spans_several_tiles() -> None:
    """33 rows all sending both slots to expert 6: 66 pairs on one expert, more than one 16-row tile."""
    gate_up, down = stacked(torch.float32, seed=4)
    x, weights, _ = routed(33, 2, seed=4)
    experts = torch.full((33, 2), 6, device=DEVICE)
    cfg = FusedMoEConfig(16, 16, 16, 32, 4, 2)
    out = fused_moe(x, weights, experts, gate_up, down, config=cfg)
    assert_close_up_to_reordering(out, definition(x, weights, experts, gate_up, down), HIDDEN + INTER + 2)


@pytest.mark.parametrize("widest_load", [None, 1024])
def test_more_pairs_than_the_alignments_widest_load_are_all_placed(widest_load, monkeypatch) -> None:
    """A step's pairs are aligned in loads of up to `_ALIGN_MAX_CHUNK` (all of them where they fit, over more warps
    past `_ALIGN_NARROW_CHUNK`); more pairs than that take several, and each expert's pairs still land in its tiles
    in order (1,100 rows of 2 slots: 2,200 pairs, in one load of 4,096 or, with loads of at most 1,024, three)."""
    assert fused_moe_module.align_chunk(80) == fused_moe_module._ALIGN_MIN_CHUNK
    assert fused_moe_module.align_chunk(700) == 1024
    assert fused_moe_module.align_chunk(2200) == 4096 > fused_moe_module._ALIGN_NARROW_CHUNK
    assert fused_moe_module.align_chunk(9000) == fused_moe_module._ALIGN_MAX_CHUNK == 8192
    if widest_load is not None:
        monkeypatch.setattr(fused_moe_module, "_ALIGN_MAX_CHUNK", widest_load)
        assert fused_moe_module.align_chunk(2200) == widest_load
    gate_up, down = stacked(torch.float32, seed=8)
    x, weights, experts = routed(1100, 2, seed=8)
    out = fused_moe(x, weights, experts, gate_up, down)
    assert_close_up_to_reordering(out, definition(x, weights, experts, gate_up, down), HIDDEN + INTER + 2)


@pytest.mark.parametrize("case", ["routed", "one-expert-several-tiles", "another-ranks-pairs"])
def test_pairs_aligned_in_the_gate_up_programs_give_the_alignment_launchs_result(case: str, monkeypatch) -> None:
    """Up to `INLINE_ALIGN_MAX_PAIRS` pairs every gate_up program aligns them itself (no alignment launch): the
    rows, tiles and experts it works out are the alignment kernel's, so the output is the same bit for bit, with an
    expert's pairs over several tiles and with pairs of experts held elsewhere."""
    gate_up, down = stacked(torch.float32, seed=5)
    x, weights, experts = routed(20, 2, seed=5)
    if case == "one-expert-several-tiles":
        experts = torch.full_like(experts, 6)  # 40 pairs on one expert: three 16-row tiles
    elif case == "another-ranks-pairs":
        experts, gate_up, down = experts - 3, gate_up[3:7], down[3:7]
    cfg = FusedMoEConfig(16, 16, 16, 32, 4, 2)
    assert experts.numel() <= fused_moe_module.INLINE_ALIGN_MAX_PAIRS
    inline = fused_moe(x, weights, experts, gate_up, down, config=cfg)
    monkeypatch.setattr(fused_moe_module, "INLINE_ALIGN_MAX_PAIRS", 0)
    launched = fused_moe(x, weights, experts, gate_up, down, config=cfg)
    assert torch.equal(inline, launched)
    assert_close_up_to_reordering(inline, definition(x, weights, experts, gate_up, down), HIDDEN + INTER + 2)


def test_column_blocks_wider_than_the_matrices_are_clamped() -> None:
    gate_up, down = stacked(torch.float32, seed=5)
    x, weights, experts = routed(4, 2, seed=5)
    cfg = FusedMoEConfig(32, 64, 128, 128, 4, 2)
    out = fused_moe(x, weights, experts, gate_up, down, config=cfg)
    assert_close_up_to_reordering(out, definition(x, weights, experts, gate_up, down), HIDDEN + INTER + 2)


@pytest.mark.parametrize("config", [config for _, config in MEASURED_CONFIGS.values()])
def test_each_measured_config_gives_the_unfused_ops_result_in_bf16(config: FusedMoEConfig) -> None:
    """The configs of the measured table (wider programs, more warps; measured in bf16, whose tiles fit shared
    memory where float32's would not) compute what the unfused ops do."""
    gate_up, down = stacked(torch.bfloat16, seed=7)
    x, weights, experts = routed(40, 2, seed=7)
    x = x.bfloat16()
    out = fused_moe(x, weights, experts, gate_up, down, config=config, activation="gelu_tanh")
    assert_matches_reference(out, unfused(x, weights, experts, gate_up, down, "gelu_tanh"), 2)


def test_the_measured_configs_are_for_two_byte_inputs_only() -> None:
    """float32 inputs keep the default config: the measured one's tiles would not fit an H100's shared memory."""
    dg = dict(num_experts=128, hidden=2816, inter=704)
    assert config_for(2048 * 8, **dg, elem_size=4) == config_for(2048 * 8, 128)
    assert config_for(2048 * 8, **dg, elem_size=2) != config_for(2048 * 8, 128)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_no_rows_give_an_empty_output(activation: str) -> None:
    gate_up, down = stacked(torch.float32)
    x = torch.zeros(0, HIDDEN, device=DEVICE)
    experts = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE)
    assert fused_moe(x, experts.float(), experts, gate_up, down, activation=activation).shape == (0, HIDDEN)


@pytest.mark.parametrize("rows", [1, 4, 33])
def test_gelu_experts_equal_the_float32_definition(rows: int) -> None:
    """Gemma's experts, ``down(gelu_tanh(gate x) * up x)``: float32 agrees with the definition to the rounding of
    a different summation order (and so differs from the SiLU experts of the same weights)."""
    gate_up, down = stacked(torch.float32, seed=rows)
    x, weights, experts = routed(rows, 4, seed=rows)
    out = fused_moe(x, weights, experts, gate_up, down, activation="gelu_tanh")
    expected = definition(x, weights, experts, gate_up, down, "gelu_tanh")
    assert_close_up_to_reordering(out, expected, HIDDEN + INTER + 4)
    silu = definition(x, weights, experts, gate_up, down, "silu")
    assert (out - silu).abs().max() > 100 * (out - expected).abs().max()


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("top_k", [2, 4])
def test_bf16_equals_the_unfused_ops_to_their_rounding(top_k: int, activation: str) -> None:
    """bf16: the unfused ops (GEMM, activation, product, GEMM, each rounded; slots summed in float32) up to an
    intermediate landing on the other side of a rounding boundary."""
    gate_up, down = stacked(torch.bfloat16, seed=top_k)
    x, weights, experts = routed(33, top_k, seed=top_k)
    x = x.bfloat16()
    out = fused_moe(x, weights, experts, gate_up, down, activation=activation)
    assert_matches_reference(out, unfused(x, weights, experts, gate_up, down, activation), top_k)


def test_bf16_gelu_rounds_like_the_unfused_ops_not_like_float32_math() -> None:
    """The GELU epilogue rounds the gate and up products, the activation and its product with up to bf16, as the
    unfused ops do: the output is nearer their result than the float32 computation of the same bf16 operands."""
    gate_up, down = stacked(torch.bfloat16, seed=8)
    x, weights, experts = routed(33, 2, seed=8)
    x = x.bfloat16()
    expected = unfused(x, weights, experts, gate_up, down, "gelu_tanh").float()
    out = fused_moe(x, weights, experts, gate_up, down, activation="gelu_tanh").float()
    unrounded = definition(x, weights, experts, gate_up, down, "gelu_tanh")
    assert (out - expected).abs().max() < (unrounded - expected).abs().max()


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_the_epilogue_rounds_the_activation_and_its_product_like_the_unfused_ops(activation: str) -> None:
    """One-hot bf16 rows make each gate and up product one weight, exactly; a down projection that copies its
    input makes the output's first ``inter`` columns the epilogue's values themselves. They are PyTorch's bf16
    ``act(gate) * up`` (the activation rounded, then the product), save where the activation's float32 value,
    whose exp/tanh may differ from PyTorch's by an fp32 unit or two, sits on a bf16 rounding boundary (then by
    one unit in the last place). Rounding only once, after the product, parts from it ten times as often."""
    rows = 2 * HIDDEN
    gen = torch.Generator().manual_seed(11)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 2).to(DEVICE, torch.bfloat16)
    down = torch.zeros(EXPERTS, HIDDEN, INTER, dtype=torch.bfloat16, device=DEVICE)
    down[:, :INTER] = torch.eye(INTER, dtype=torch.bfloat16, device=DEVICE)
    columns = torch.arange(rows, device=DEVICE) % HIDDEN
    x = torch.zeros(rows, HIDDEN, dtype=torch.bfloat16, device=DEVICE)
    x[torch.arange(rows, device=DEVICE), columns] = 1.0
    experts = torch.randint(0, EXPERTS, (rows, 1), generator=gen).to(DEVICE)
    weights = torch.ones(rows, 1, device=DEVICE)
    out = fused_moe(x, weights, experts, gate_up, down, activation=activation)[:, :INTER]
    picked = gate_up[experts[:, 0], :, columns]  # [rows, 2 * inter]: each row's gate and up products
    gate, up = picked[:, :INTER], picked[:, INTER:]
    act_fn = TORCH_ACTIVATIONS[activation]
    expected = act_fn(gate) * up
    rounded_once = (act_fn(gate.float()) * up.float()).bfloat16()
    mismatched = out != expected
    assert mismatched.sum() * 10 < (rounded_once != expected).sum()
    one_ulp = torch.finfo(torch.bfloat16).eps * expected.float().abs()
    # where the activation saturates (GELU's tanh within an fp32 unit of -1), PyTorch's exact 0 and the kernel's
    # 0.5 * gate * (that unit) * up differ by far less than the output's scale
    saturated = torch.finfo(torch.float32).eps * (gate.float() * up.float()).abs()
    difference = (out.float() - expected.float()).abs()
    assert ((difference <= one_ulp) | (difference <= saturated))[mismatched].all()


def test_gelu_pairs_of_experts_not_held_here_are_skipped() -> None:
    """Expert parallelism with GELU experts: a rank holding experts 2..5 adds only its own pairs; rows whose
    every pair is elsewhere come out exactly zero."""
    gate_up, down = stacked(torch.float32, seed=9)
    x, weights, experts = routed(33, 3, seed=9)
    local = experts - 2
    out = fused_moe(x, weights, local, gate_up[2:6], down[2:6], activation="gelu_tanh")
    expected = definition(x, weights, local, gate_up[2:6], down[2:6], "gelu_tanh")
    assert_close_up_to_reordering(out, expected, HIDDEN + INTER + 3)
    owned = (local >= 0) & (local < 4)
    elsewhere = ~owned.any(dim=1)
    assert owned.any() and not owned.all() and elsewhere.any()
    assert torch.equal(out[elsewhere], torch.zeros_like(out[elsewhere]))


def test_mismatched_operands_are_refused_by_name() -> None:
    gate_up, down = stacked(torch.float32)
    x, weights, experts = routed(3, 2, seed=0)
    with pytest.raises(ValueError, match=r"down must be \[8, 64, 32\] to match gate_up, got \(8, 32, 64\)"):
        fused_moe(x, weights, experts, gate_up, down.transpose(1, 2))
    with pytest.raises(ValueError, match="gate_up and down must be torch.float32 like x"):
        fused_moe(x, weights, experts, gate_up.half(), down.half())
    with pytest.raises(ValueError, match=r"route_weights must be \(3, 2\) like experts, got \(3, 1\)"):
        fused_moe(x, weights[:, :1], experts, gate_up, down)
    with pytest.raises(ValueError, match="config block_m must be a power of two >= 16, got 8"):
        fused_moe(x, weights, experts, gate_up, down, config=FusedMoEConfig(8, 16, 16, 32, 4, 2))
    with pytest.raises(ValueError, match="activation must be one of silu, gelu_tanh, got 'gelu'"):
        fused_moe(x, weights, experts, gate_up, down, activation="gelu")


def test_the_tile_bound_covers_the_worst_padding() -> None:
    """Every active expert wastes at most block_m - 1 rows: the bound is reached by one pair per expert."""
    assert max_tiles(32, 128, 16) == 32  # 32 experts with one pair each
    assert max_tiles(66, 8, 16) == (66 + 8 * 15) // 16
    for pairs, experts, block_m in [(1, 8, 16), (100, 3, 32), (8192, 256, 64)]:
        worst = sum(-(-c // block_m) for c in spread(pairs, min(experts, pairs)))
        assert max_tiles(pairs, experts, block_m) >= worst


def spread(pairs: int, experts: int) -> list[int]:
    """Pairs dealt one by one over the experts (every expert's count ends with a partial tile)."""
    return [pairs // experts + (1 if i < pairs % experts else 0) for i in range(experts)]


def test_the_row_tile_grows_with_the_pairs_per_expert() -> None:
    assert config_for(32, 128).block_m == 16  # SDAR-30B-A3B, one request: one tile per expert
    assert config_for(8192, 256).block_m == 64  # LLaDA2-mini, 32 requests of 32 rows
    assert config_for(10**6, 8).block_m == 64  # never beyond the largest tile


def test_the_fused_path_takes_decode_steps_and_leaves_prefill_to_the_grouped_gemm() -> None:
    assert fused_wins(4, 8, 128, 2048, 768)  # SDAR-30B-A3B batch 1
    assert fused_wins(1024, 8, 256, 2048, 512)  # LLaDA2-mini batch 32, block 32
    assert not fused_wins(4096, 8, 128, 2048, 768)  # a prefill chunk


def test_diffusion_gemma_canvases_take_the_fused_path_up_to_the_rows_measured_faster() -> None:
    """DiffusionGemma-26B-A4B's experts (128, top 8, hidden 2816, inter 704), 256 rows per canvas: the fused
    kernels measured faster than the grouped GEMM at 1 to 8 canvases, so they take those; beyond what was measured,
    the grouped GEMM."""
    assert config_for(256 * 8, 128).block_m == 32
    assert config_for(512 * 8, 128).block_m == 64
    assert all(fused_wins(256 * canvases, 8, 128, 2816, 704) for canvases in (1, 2, 4, 8))
    assert not fused_wins(256 * 9, 8, 128, 2816, 704)
    assert not fused_wins(1024, 8, 128, 2048, 768)  # an unmeasured geometry keeps the default


def test_a_geometry_measured_faster_with_wider_programs_takes_them_from_its_measured_rows() -> None:
    """DiffusionGemma-26B-A4B at 8 canvases (2,048 rows) measured faster with 128-column programs in 8 warps; at
    fewer rows, and for the same expert count of another shape, the default config stays."""
    dg = dict(num_experts=128, hidden=2816, inter=704)
    eight = config_for(2048 * 8, **dg)
    assert (eight.block_m, eight.block_n_gate_up, eight.block_n_down, eight.num_warps) == (64, 128, 128, 8)
    assert config_for(1024 * 8, **dg) == config_for(1024 * 8, 128)
    assert config_for(2048 * 8, 128, 2048, 768) == config_for(2048 * 8, 128)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_captured_step_replays_with_new_routing_gpu() -> None:
    """Nothing in the four launches asks the host: a graph captured on one routing computes another's."""
    moe = make_moe(4, torch.bfloat16)
    x = torch.randn(33, HIDDEN, device="cuda", dtype=torch.bfloat16)
    moe(x)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(x)
    x.copy_(torch.randn(33, HIDDEN, device="cuda", dtype=torch.bfloat16) * 3)
    graph.replay()
    assert_matches_reference(out.clone(), moe.reference(x), 4)
