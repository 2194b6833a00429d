"""The fused gated activations against the torch code, ``F.silu(gate) * up`` and Gemma's ``gelu_tanh(gate) * up``,
for the merged gate_up halves and separate tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from diffulex.kernels.activation import gelu_tanh_mul, silu_mul
from diffulex.layers import SiluAndMul
from diffulex.layers.activation import gated, gelu_tanh

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """The roundings are PyTorch's; only ``exp`` may differ in its last fp32 bit (the CPU's vectorized ``exp``
    against numpy's under the interpreter), which a bf16 output shows rarely, by one ulp."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape and actual.is_contiguous()
    actual = actual.cpu()
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=4e-7, atol=1e-30)
    else:
        ulp = torch.finfo(actual.dtype).eps * expected.float().abs().clamp_min(torch.finfo(actual.dtype).tiny)
        assert ((actual.float() - expected.float()).abs() <= ulp).all()
        assert (actual != expected).float().mean().item() <= 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "inter"), [(1, 64), (5, 300), (3, 1100)])
def test_merged_halves_match_the_torch_code(dtype, tokens, inter):
    gate_up = (4 * torch.randn(tokens, 2 * inter, generator=torch.Generator().manual_seed(inter))).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    device_gate_up = gate_up.to(DEVICE)
    assert_matches(silu_mul(*device_gate_up.split(inter, dim=-1)), expected)  # views, row stride 2 * inter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_separate_tensors_and_leading_dims(dtype):
    gen = torch.Generator().manual_seed(7)
    gate = (4 * torch.randn(2, 3, 130, generator=gen)).to(dtype)
    up = torch.randn(2, 3, 130, generator=gen).to(dtype)
    assert_matches(silu_mul(gate.to(DEVICE), up.to(DEVICE)), F.silu(gate) * up)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(200) = inf under the interpreter
def test_extremes_and_empty():
    gate = torch.tensor([[-200.0, -20.0, -1.0, 0.0, 1.0, 20.0, 200.0, float("inf")]])
    up = torch.tensor([[3.0, 2.0, 1.0, 5.0, -1.0, 0.5, 2.0, 1.0]])
    assert_matches(silu_mul(gate.to(DEVICE), up.to(DEVICE)), F.silu(gate) * up)
    assert silu_mul(torch.zeros(0, 8, device=DEVICE), torch.zeros(0, 8, device=DEVICE)).shape == (0, 8)


def test_the_module_on_the_cpu_is_the_torch_code_exactly():
    gate_up = torch.randn(3, 40, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    act = SiluAndMul()
    assert torch.equal(act(gate, up), F.silu(gate) * up)
    assert torch.equal(act.split(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "inter"), [(1, 64), (5, 300), (16, 1100)])
def test_gemmas_gated_gelu_matches_the_torch_code(dtype, tokens, inter):
    gate_up = (3 * torch.randn(tokens, 2 * inter, generator=torch.Generator().manual_seed(inter))).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = gelu_tanh(gate) * up
    actual = gelu_tanh_mul(*gate_up.to(DEVICE).split(inter, dim=-1)).cpu()
    assert actual.dtype == dtype and actual.shape == expected.shape and actual.is_contiguous()
    # the interpreter's tanh (from exp) loses digits where 1 + tanh cancels (gate far below 0): absolutely tiny
    torch.testing.assert_close(actual.float(), expected.float(), rtol=torch.finfo(dtype).eps, atol=1e-5)
    if dtype != torch.float32:  # an fp32 output shows the tanh's last bits
        assert (actual != expected).float().mean().item() <= 0.01


def test_the_gated_dispatch_on_the_cpu_is_the_torch_code_exactly():
    """`gated` (the MLPs' and the grouped experts' ``act(gate) * up``) is the activation then the product on the CPU,
    for the fused activations and any other."""
    gate, up = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).unbind(0)
    for activation in (F.silu, gelu_tanh, torch.relu):
        assert torch.equal(gated(activation, gate, up), activation(gate) * up)
