"""Joining q/k/v (and gate/up) into one GEMM changes neither the results nor the parameters anyone can see."""

from __future__ import annotations

import torch
from torch import nn

from diffulex.layers import MergedProjection, merge_projections


def projections(bias: bool) -> tuple[nn.Linear, ...]:
    torch.manual_seed(0)
    return nn.Linear(8, 6, bias=bias), nn.Linear(8, 2, bias=bias), nn.Linear(8, 2, bias=bias)


def test_merged_projection_gives_each_modules_output() -> None:
    for bias in (False, True):
        linears = projections(bias)
        x = torch.randn(5, 8)
        expected = [m(x) for m in linears]
        merged = MergedProjection(*linears)
        assert merged.merge()
        for got, want in zip(merged(x), expected, strict=True):
            torch.testing.assert_close(got, want)


def test_modules_keep_their_parameters_as_views_of_the_joined_matrix() -> None:
    linears = projections(bias=True)
    before = [m.weight.detach().clone() for m in linears]
    merged = MergedProjection(*linears)
    merged.merge()
    for m, w in zip(linears, before, strict=True):
        assert isinstance(m.weight, nn.Parameter)
        assert torch.equal(m.weight, w)
        assert m.weight.untyped_storage().data_ptr() == merged.weight.untyped_storage().data_ptr()
    with torch.no_grad():  # a later in-place load into a module's weight reaches the joined matrix
        linears[1].weight.fill_(3.0)
    assert torch.equal(merged.weight[6:8], torch.full((2, 8), 3.0))


def test_projections_with_forward_hooks_stay_separate() -> None:
    linears = projections(bias=False)
    linears[2].register_forward_hook(lambda module, inputs, output: output * 2)
    merged = MergedProjection(*linears)
    assert not merged.merge()
    x = torch.randn(3, 8)
    torch.testing.assert_close(merged(x)[2], 2 * nn.functional.linear(x, linears[2].weight))


def test_built_models_are_merged_and_still_match_their_checkpoint(sdar_dir) -> None:
    from diffulex.models.loader import build_model

    model = build_model("sdar", sdar_dir, torch.float32, torch.device("cpu"))
    attn = model.model.layers[0].self_attn
    assert attn.qkv.weight is not None and model.model.layers[0].mlp.gate_up.weight is not None
    assert merge_projections(model) == 2 * len(model.model.layers), "merging again is harmless"
    names = {name for name, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.q_proj.weight" in names and not any("qkv" in n for n in names)
