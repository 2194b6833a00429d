"""The gated skinny GEMM (activation fused into the down projection) against the two launches it replaces.

The claim is bit-identity with ``skinny_linear(silu_mul(gate, up), W, b)`` under the same config, so every check is
``torch.equal``; the two unfused kernels have their own tests against PyTorch. Under the Triton interpreter (CPU)
shapes stay tiny; the realistic SDAR shape runs on a GPU only.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from diffulex.kernels import skinny_gemm
from diffulex.kernels.activation import silu_mul
from diffulex.kernels.skinny_gemm import (
    SkinnyConfig,
    config_for,
    maybe_skinny_gated_linear,
    skinny_gated_linear,
    skinny_linear,
)
from diffulex.kernels.split_counters import split_counters
from diffulex.layers import linear as linear_mod
from diffulex.layers.linear import gated_linear
from diffulex.models.dense import DenseArch, DenseMLP
from diffulex.models.hf_config import DenseDecoderConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CONFIGS = [
    SkinnyConfig(16, 32, 4, 2, use_dot=False, split_k=1),
    SkinnyConfig(32, 64, 4, 1, use_dot=False, split_k=3),
    SkinnyConfig(16, 32, 4, 2, use_dot=True, split_k=1),
    SkinnyConfig(32, 64, 4, 3, use_dot=True, split_k=2),
]
# (M, N, I): rows from 1 to 16, N not a multiple of BLOCK_N, I not a multiple of BLOCK_K, and even ones.
SHAPES = [(1, 40, 96), (3, 50, 100), (5, 33, 160), (16, 64, 128)]


def operands(m: int, n: int, inter: int, dtype: torch.dtype, merged: bool, bias: bool, seed: int):
    """gate/up as the two halves of one ``[M, 2I]`` output (row stride 2I) or as two separate tensors."""
    gen = torch.Generator().manual_seed(seed)
    if merged:
        gate_up = (3 * torch.randn(m, 2 * inter, generator=gen)).to(DEVICE, dtype)
        gate, up = gate_up.split(inter, dim=-1)
    else:
        gate = (3 * torch.randn(m, inter, generator=gen)).to(DEVICE, dtype)
        up = torch.randn(m, inter, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, inter, generator=gen) * 0.1).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    return gate, up, w, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{'dot' if c.use_dot else 'fma'}-split{c.split_k}")
def test_fused_equals_silu_mul_then_skinny_linear(cfg: SkinnyConfig, dtype: torch.dtype) -> None:
    """Each config meets every shape over the two dtypes, merged halves without bias and separate tensors with."""
    first = 0 if dtype == torch.bfloat16 else 2
    for i, (m, n, inter) in enumerate(SHAPES[first : first + 2]):
        merged = i == 0
        gate, up, w, b = operands(m, n, inter, dtype, merged, bias=not merged, seed=first + i)
        fused = skinny_gated_linear(gate, up, w, b, cfg)
        assert fused.dtype == dtype and fused.shape == (m, n)
        assert torch.equal(fused, skinny_linear(silu_mul(gate, up), w, b, cfg)), (m, n, inter, merged)
    if cfg.split_k > 1:
        assert int(split_counters(gate.device, 1).abs().sum()) == 0, "the last split must reset its counter"


def test_row_counts_up_to_16() -> None:
    """Row counts around each padded tile height (the shape tests above have 1, 3, 5 and 16)."""
    cfg = SkinnyConfig(16, 32, 4, 2, use_dot=True, split_k=2)
    for m in (2, 4, 7, 8, 9, 15):
        gate, up, w, b = operands(m, 16, 64, torch.bfloat16, merged=m % 2 == 0, bias=m % 3 == 0, seed=m)
        assert torch.equal(skinny_gated_linear(gate, up, w, b, cfg), skinny_linear(silu_mul(gate, up), w, b, cfg))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(200) = inf under the interpreter
def test_extreme_gate_values() -> None:
    """silu's tails (exp overflowing to inf, underflowing to 0) and zeros round the same in both paths."""
    cfg = SkinnyConfig(16, 32, 4, 1, use_dot=False, split_k=1)
    gate = torch.tensor([-200.0, -20.0, -1.0, 0.0, 1.0, 20.0, 80.0, 200.0] * 4).view(1, 32).to(DEVICE, torch.bfloat16)
    up = torch.linspace(-2, 2, 32).view(1, 32).to(DEVICE, torch.bfloat16)
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(0)).to(DEVICE, torch.bfloat16)
    assert torch.equal(skinny_gated_linear(gate, up, w, None, cfg), skinny_linear(silu_mul(gate, up), w, None, cfg))


def test_shape_errors() -> None:
    gate = torch.zeros(2, 32, device=DEVICE, dtype=torch.float16)
    w = torch.zeros(16, 32, device=DEVICE, dtype=torch.float16)
    with pytest.raises(ValueError, match="up"):
        skinny_gated_linear(gate, gate[:, :16], w, None, CONFIGS[0])
    with pytest.raises(ValueError, match="weight"):
        skinny_gated_linear(gate, gate, w[:, :16], None, CONFIGS[0])


def test_dispatch_on_the_cpu_is_the_torch_code() -> None:
    gen = torch.Generator().manual_seed(3)
    gate_up = torch.randn(4, 2 * 2048, generator=gen).to(torch.bfloat16)
    gate, up = gate_up.split(2048, dim=-1)
    w = torch.randn(4096, 2048, generator=gen).to(torch.bfloat16)
    b = torch.randn(4096, generator=gen).to(torch.bfloat16)
    assert config_for(4096, 2048, 4) is not None  # a table shape: only the device rules the kernel out
    assert maybe_skinny_gated_linear(gate, up, w, b) is None
    assert torch.equal(gated_linear(gate, up, w, b), F.linear(F.silu(gate) * up, w, b))
    assert torch.equal(gated_linear(gate, up, w), F.linear(F.silu(gate) * up, w))


def tiny_mlp(bias: bool) -> DenseMLP:
    torch.manual_seed(0)
    config = DenseDecoderConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    return DenseMLP(config, DenseArch(qkv_bias=False, o_bias=False, qk_norm=False, mlp_bias=bias))


@pytest.mark.parametrize("merge", [False, True], ids=["separate", "merged"])
def test_dense_mlp_on_the_cpu_is_unchanged(merge: bool) -> None:
    mlp = tiny_mlp(bias=True)
    if merge:
        assert mlp.gate_up.merge()
    x = torch.randn(5, 16)
    gate, up = mlp.gate_up(x)
    assert torch.equal(mlp(x), mlp.down_proj(mlp.act_fn(gate, up)))  # the forward before the fusion
    assert torch.equal(mlp(x), F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias))


@pytest.mark.parametrize("hooked", ["down_proj", "act_fn"])
@pytest.mark.parametrize("kind", ["forward", "pre"])
def test_dense_mlp_with_hooks_runs_the_modules(monkeypatch: pytest.MonkeyPatch, hooked: str, kind: str) -> None:
    """LoRA and activation capture hook ``down_proj``/``act_fn``: the fused path would skip their calls."""
    mlp = tiny_mlp(bias=False)
    fused_calls: list[int] = []
    real = linear_mod.gated_linear
    monkeypatch.setattr(linear_mod, "gated_linear", lambda *a: fused_calls.append(1) or real(*a))
    x = torch.randn(3, 16)
    expected = F.linear(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x), mlp.down_proj.weight)

    assert torch.equal(mlp(x), expected)
    assert fused_calls == [1], "without hooks the MLP takes the fused route"

    seen: list[tuple[torch.Tensor, ...]] = []
    module = getattr(mlp, hooked)
    if kind == "forward":
        handle = module.register_forward_hook(lambda mod, inputs, output: seen.append(inputs))
    else:
        handle = module.register_forward_pre_hook(lambda mod, inputs: seen.append(inputs))
    assert torch.equal(mlp(x), expected)
    assert fused_calls == [1], "a hooked module must run itself"
    assert len(seen) == 1
    if hooked == "down_proj":
        assert torch.equal(seen[0][0], F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    handle.remove()
    mlp(x)
    assert fused_calls == [1, 1]


def test_global_hooks_and_replaced_forwards_keep_the_modules() -> None:
    mlp = tiny_mlp(bias=False)
    x = torch.randn(2, 16)
    calls: list[type] = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, inputs, output: calls.append(type(mod)))
    try:
        mlp(x)
    finally:
        handle.remove()
    assert type(mlp.down_proj) in calls and type(mlp.act_fn) in calls

    class Scaled(type(mlp.down_proj)):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    expected = 2 * mlp(x)
    mlp.down_proj.__class__ = Scaled
    assert torch.equal(mlp(x), expected)


# ----- GPU only: the table config at real shapes ---------------------------------------------------------------


@cuda_only
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("merged", [True, False], ids=["merged", "separate"])
def test_sdar_1_7b_down_projection_is_bitwise_the_unfused_path(rows: int, merged: bool) -> None:
    """SDAR-1.7B down_proj: I = 6144, N = hidden = 2048 (split-K in the table), decode row counts."""
    gate, up, w, _ = operands(rows, 2048, 6144, torch.bfloat16, merged, bias=False, seed=rows)
    cfg = config_for(2048, 6144, rows)
    assert cfg is not None and cfg.split_k > 1
    assert torch.equal(skinny_gated_linear(gate, up, w), skinny_linear(silu_mul(gate, up), w))


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sdar_8b_down_projection_with_bias(dtype: torch.dtype) -> None:
    """SDAR-8B down_proj (I = 12288, N = 4096) with a bias (Llama-style mlp_bias), merged halves."""
    gate, up, w, b = operands(4, 4096, 12288, dtype, merged=True, bias=True, seed=0)
    assert torch.equal(skinny_gated_linear(gate, up, w, b), skinny_linear(silu_mul(gate, up), w, b))


@cuda_only
def test_the_fused_route_on_cuda_matches_the_unfused_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """`gated_linear` launches the gated kernel on its first eager call (the warm-up that compiles it) and returns
    what the activation kernel plus the skinny GEMM give."""
    monkeypatch.setattr(skinny_gemm, "_WARMED", set())  # no earlier test has used up the eager warm-up call
    gate, up, w, _ = operands(4, 2048, 6144, torch.bfloat16, merged=True, bias=False, seed=7)
    with torch.no_grad():
        got = gated_linear(gate, up, w)
    assert torch.equal(got, skinny_linear(silu_mul(gate, up), w))
