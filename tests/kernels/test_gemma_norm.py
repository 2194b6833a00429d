"""Gemma's fused RMSNorm against its torch code (`diffulex.layers.norm.gemma_rms_norm` on the CPU): the same
roundings in one launch, with the add before the norm and the residual add after it folded in."""

from __future__ import annotations

import pytest
import torch

from diffulex.kernels.gemma_norm import gemma_rms_norm as fused
from diffulex.layers.norm import gemma_rms_norm
from tests.kernels.test_fused_norm import DEVICE, DTYPES, assert_matches


def _rows(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 2.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


def _on_device(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 64), (7, 256), (5, 200), (3, 2816)])
@pytest.mark.parametrize("with_weight", [False, True])
def test_the_norm_rounds_once_after_the_weight_like_gemmas_code(dtype, rows, hidden, with_weight):
    x = _rows((rows, hidden), dtype, rows + hidden)
    weight = _rows((hidden,), dtype, 7, scale=0.5) + 1 if with_weight else None
    expected = gemma_rms_norm(x, weight, 1e-6)  # CPU tensors: the torch code
    actual = fused(x.to(DEVICE), _on_device(weight), 1e-6)
    assert actual.dtype == dtype and actual.shape == x.shape
    # in fp32 nothing rounds the GPU's approximate rsqrt (2 ulps) away: a few ulps of the row's largest value
    assert_matches(actual, expected, scale=8 * float(expected.abs().max()) if dtype == torch.float32 else 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts", ["plus", "then_add", "both"])
def test_the_adds_around_the_norm_round_like_the_torch_adds(dtype, parts):
    """``residual + norm(dense + routed)``: the sum rounded to the model dtype before the norm, the residual added
    after it and rounded, as the model's own adds do."""
    rows, hidden = 6, 320
    x, weight = _rows((rows, hidden), dtype, 1), _rows((hidden,), dtype, 2, scale=0.3) + 1
    plus = _rows((rows, hidden), dtype, 3) if parts in ("plus", "both") else None
    then_add = _rows((rows, hidden), dtype, 4, scale=5.0) if parts in ("then_add", "both") else None
    expected = gemma_rms_norm(x, weight, 1e-6, plus, then_add)
    actual = fused(x.to(DEVICE), weight.to(DEVICE), 1e-6, _on_device(plus), _on_device(then_add))
    # an ulp of the norm is up to an ulp of the larger addend in the sum after it
    assert_matches(actual, expected, scale=float(then_add.abs().max()) if then_add is not None else 0.0)


def test_per_head_norms_read_strided_rows_of_a_projection():
    """q/k norms run over heads of a projection's output viewed ``[B, n, H, D]``, here a slice of a wider row."""
    wide = _rows((2, 3, 4 * 64 + 32), torch.bfloat16, 5)
    heads = wide[..., 32:].unflatten(-1, (4, 64))  # [2, 3, 4, 64], row stride not 64
    weight = _rows((64,), torch.bfloat16, 6, scale=0.2) + 1
    expected = gemma_rms_norm(heads, weight, 1e-6)
    actual = fused(heads.to(DEVICE), weight.to(DEVICE), 1e-6)
    assert actual.shape == heads.shape and actual.is_contiguous()
    assert_matches(actual, expected)


def test_operands_of_another_shape_or_dtype_are_refused_by_name():
    x = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="plus must have x's shape"):
        fused(x, None, 1e-6, plus=torch.zeros(2, 32, device=DEVICE))
    with pytest.raises(ValueError, match="then_add must have x's shape .* and dtype"):
        fused(x, None, 1e-6, then_add=torch.zeros(2, 64, device=DEVICE, dtype=torch.bfloat16))


def _torch_attention_inputs(q, k, v, q_weight, k_weight, cos, sin):
    """The torch code's q/k/v: each head normed (q and k with their weights, v without), q and k then rotated."""
    from diffulex.layers.rotary import apply_rotary

    normed_q, normed_k = gemma_rms_norm(q, q_weight, 1e-6), gemma_rms_norm(k, k_weight, 1e-6)
    values = gemma_rms_norm(k if v is None else v, None, 1e-6)
    return apply_rotary(normed_q, cos, sin), apply_rotary(normed_k, cos, sin), values


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "rotated", "own_values"), [(64, 64, True), (128, 32, False), (48, 48, True)])
def test_attention_inputs_in_one_launch_round_as_the_norms_then_the_rotary(dtype, head_dim, rotated, own_values):
    """`gemma_attention_inputs` over three canvases of 5 tokens, q/k/v slices of one merged projection's rows
    (strided), the angles of one canvas's positions shared by all: the torch code's heads, each within an ulp
    (a rotated output that cancels: within an ulp of its inputs); a global layer's values are its keys' projection
    normed without a weight and not rotated."""
    from diffulex.kernels.gemma_norm import gemma_attention_inputs
    from diffulex.models.diffusion_gemma import RopeSpec, rotary_angles

    canvases, n, hq, hk = 3, 5, 4, 2
    merged = _rows((canvases * n, (hq + 2 * hk) * head_dim), dtype, head_dim)
    q, k, v = (part.unflatten(-1, (-1, head_dim)) for part in merged.split([hq * head_dim, hk * head_dim,
                                                                               hk * head_dim], dim=-1))  # fmt: skip
    v = v if own_values else None
    q_weight, k_weight = (_rows((head_dim,), dtype, seed, scale=0.3) + 1 for seed in (8, 9))
    spec = RopeSpec("proportional", 10_000.0, partial_rotary_factor=rotated / head_dim)
    cos, sin = rotary_angles(spec, head_dim, torch.arange(7, 7 + n))
    wants = _torch_attention_inputs(q, k, v, q_weight, k_weight, cos.repeat(canvases, 1), sin.repeat(canvases, 1))
    gots = gemma_attention_inputs(*(_on_device(t) for t in (q, k, v, q_weight, k_weight)), 1e-6,
                                  cos.to(DEVICE), sin.to(DEVICE))  # fmt: skip
    for got, want in zip(gots, wants, strict=True):
        assert got.is_contiguous()
        scale = 4 * float(want.abs().max()) if dtype == torch.float32 else float(want.abs().max())
        assert_matches(got, want, scale=scale)


def test_attention_inputs_name_what_does_not_fit():
    from diffulex.kernels.gemma_norm import gemma_attention_inputs

    q, k = torch.zeros(3, 4, 16, device=DEVICE), torch.zeros(3, 2, 16, device=DEVICE)
    w, cos = torch.ones(16, device=DEVICE), torch.zeros(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"v has shape \(3, 1, 16\)"):
        gemma_attention_inputs(q, k, torch.zeros(3, 1, 16, device=DEVICE), w, w, 1e-6, cos, cos)
    with pytest.raises(ValueError, match=r"cos \(3, 9\) torch.float32 and sin"):
        wide = torch.zeros(3, 9, device=DEVICE)
        gemma_attention_inputs(q, k, None, w, w, 1e-6, wide, wide)
    with pytest.raises(ValueError, match="must hold each token's heads contiguously"):
        gemma_attention_inputs(q.transpose(0, 1).contiguous().transpose(0, 1), k, None, w, w, 1e-6, cos, cos)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(3, 64), (16, 320)])
def test_a_layers_mlp_inputs_in_one_launch_are_its_three_norms(dtype, rows, hidden):
    """`gemma_mlp_inputs`: the dense MLP's and the experts' pre-norms and the router's input (normed without a
    weight, times its scale, times hidden ** -0.5, each product rounded) of one residual, as the torch code makes
    them one by one."""
    from diffulex.kernels.gemma_norm import gemma_mlp_inputs

    residual = _rows((rows, hidden), dtype, rows)
    dense_w, experts_w, router_scale = (_rows((hidden,), dtype, seed, scale=0.3) + 1 for seed in (11, 12, 13))
    wants = (gemma_rms_norm(residual, dense_w, 1e-6), gemma_rms_norm(residual, experts_w, 1e-6),
             gemma_rms_norm(residual, None, 1e-6) * router_scale * hidden**-0.5)  # fmt: skip
    gots = gemma_mlp_inputs(*(t.to(DEVICE) for t in (residual, dense_w, experts_w, router_scale)), hidden**-0.5, 1e-6)
    for got, want in zip(gots, wants, strict=True):
        assert_matches(got, want, scale=8 * float(want.abs().max()) if dtype == torch.float32 else 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_layers_output_in_one_launch_is_its_post_norms_sum_residual_and_scalar(dtype):
    """`gemma_mlp_outputs`: ``(residual + norm(norm(dense) w1 + norm(routed) w2) w) * scalar``, each step rounded
    as the torch code's, over strided rows of the residual."""
    from diffulex.kernels.gemma_norm import gemma_mlp_outputs

    rows, hidden = 6, 256
    dense, routed = _rows((rows, hidden), dtype, 21), _rows((rows, hidden), dtype, 22, scale=0.5)
    residual = _rows((rows, 2 * hidden), dtype, 23, scale=4.0)[:, :hidden]
    w1, w2, w = (_rows((hidden,), dtype, seed, scale=0.3) + 1 for seed in (24, 25, 26))
    scalar = torch.tensor([0.75]).to(dtype)
    summed = gemma_rms_norm(gemma_rms_norm(dense, w1, 1e-6), w, 1e-6, gemma_rms_norm(routed, w2, 1e-6), residual)
    want = summed * scalar
    got = gemma_mlp_outputs(*(t.to(DEVICE) for t in (dense, routed, residual, w1, w2, w, scalar)), 1e-6)
    assert got.is_contiguous()
    assert_matches(got, want, scale=float(residual.abs().max()))
    with pytest.raises(ValueError, match="routed must have residual's shape"):
        gemma_mlp_outputs(*(t.to(DEVICE) for t in (dense, routed[:2], residual, w1, w2, w, scalar)), 1e-6)
