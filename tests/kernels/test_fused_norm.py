"""Fused RMSNorm and q/k norm + rotary against the torch code of `diffulex.layers` (the CPU path).

The kernels reproduce the torch path's roundings step by step; only the order of the fp32 sum of squares differs,
which may move a bf16 output by one ulp, rarely. So: fp32 within a few fp32 ulps, bf16 within one bf16 ulp and
almost everywhere identical.
"""

from __future__ import annotations

import pytest
import torch

from diffulex.kernels.fused_norm import qk_norm_rope, rms_norm, rms_norm_of_parts
from diffulex.layers import RMSNorm, RotaryEmbedding, UnsummedProduct, apply_rotary
from diffulex.layers.dispatch import use_fused_kernels
from diffulex.layers.rotary import rotate_qk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def ulps(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between same-dtype float tensors (``+0`` and ``-0`` are equal)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    int_type = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[actual.dtype]

    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view(int_type).to(torch.int64)
        magnitude = bits & (torch.iinfo(int_type).max)
        return torch.where(bits < 0, -magnitude, magnitude)

    return (ordered(actual.cpu()) - ordered(expected.cpu())).abs()


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, scale: float = 0.0) -> None:
    """Within one ulp (a few in fp32) of the reference, or of ``scale``: a rotation's outputs may cancel, so an ulp
    of its inputs (about ``scale``) can be many ulps of a small output; bf16 outputs almost all bit-identical."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    actual, expected = actual.cpu(), expected.cpu()
    dist = ulps(actual, expected)
    eps = torch.finfo(actual.dtype).eps
    close = (actual.float() - expected.float()).abs() <= eps * scale
    max_ulps = 4 if actual.dtype == torch.float32 else 1
    assert ((dist <= max_ulps) | close).all(), f"outputs differ by up to {dist.max().item()} ulps"
    if actual.dtype != torch.float32:
        assert (dist > 0).float().mean().item() <= 0.01, "more than 1% of the outputs are not bit-identical"


def make_norm(hidden: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(hidden, generator=torch.Generator().manual_seed(seed)))
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 64), (7, 64), (5, 200), (3, 1024)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_module(dtype, rows, hidden, with_residual):
    gen = torch.Generator().manual_seed(rows * 1000 + hidden)
    norm = make_norm(hidden, dtype, hidden)
    x = (2 * torch.randn(rows, hidden, generator=gen)).to(dtype)
    residual = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype) if with_residual else None
    with torch.no_grad():
        expected = norm(x, residual)  # CPU tensors: the torch code
        device_residual = None if residual is None else residual.to(DEVICE)
        actual = rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), norm.eps, device_residual)
    if with_residual:
        assert torch.equal(actual[1].cpu(), expected[1])  # the add is rounded exactly like torch's
        assert_matches(actual[0], expected[0])
    else:
        assert_matches(actual, expected)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_of_partials_equals_the_norm_of_their_rounded_sum(splits, with_residual):
    """A projection's unsummed K splits go into the norm, which sums them as the projection would have: the same
    bits as summing first and norming the rounded product, in the sum, the residual stream and the output."""
    gen = torch.Generator().manual_seed(splits)
    rows, hidden, dtype = 5, 200, torch.bfloat16
    norm = make_norm(hidden, dtype, 7)
    parts = torch.randn(splits, rows, hidden, generator=gen)
    product = UnsummedProduct(parts, dtype)
    residual = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype) if with_residual else None
    with torch.no_grad():
        expected = rms_norm(
            product.materialize().to(DEVICE),
            norm.weight.to(DEVICE),
            norm.eps,
            None if residual is None else residual.to(DEVICE),
        )
        actual = rms_norm_of_parts(
            parts.to(DEVICE), dtype, norm.weight.to(DEVICE), norm.eps, None if residual is None else residual.to(DEVICE)
        )
        module = norm(product, residual)  # CPU: the module sums first, then runs its torch code
    for got, want in zip(actual if with_residual else [actual], expected if with_residual else [expected], strict=True):
        assert torch.equal(got.cpu(), want.cpu())
    if with_residual:
        assert torch.equal(module[1], expected[1].cpu())
        assert_matches(actual[0], module[0])
    else:
        assert_matches(actual, module)


def test_rms_norm_reads_strided_and_batched_rows_and_promotes_like_torch():
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(5, 96, generator=gen).to(torch.bfloat16)
    x = wide[:, 16:80]  # row stride 96
    residual = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    norm = make_norm(64, torch.float32, 1)  # fp32 weight on bf16 activations: torch promotes the output to fp32
    with torch.no_grad():
        expected = norm(x, residual)
        actual = rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), norm.eps, residual.to(DEVICE))
    assert actual[0].dtype == torch.float32 and actual[1].dtype == torch.bfloat16
    assert torch.equal(actual[1].cpu(), expected[1])
    assert_matches(actual[0], expected[0])

    batched = torch.randn(2, 3, 8, 64, generator=gen)[:, :, 2:5]  # [2, 3, 3, 64], not viewable as rows
    with torch.no_grad():
        assert_matches(rms_norm(batched.to(DEVICE), norm.weight.to(DEVICE), norm.eps), norm(batched))
    assert rms_norm(torch.zeros(0, 64, device=DEVICE), norm.weight.to(DEVICE), norm.eps).shape == (0, 64)


def qkv_views(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """q and k as `DenseAttention` gets them: views of one fused ``[T, (H + 2 Hkv) D]`` projection output."""
    qkv = (2 * torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=torch.Generator().manual_seed(seed)))
    qkv = qkv.to(dtype).to(DEVICE)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    return q, k


def rope(tokens: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.randint(0, 4000, (tokens,), generator=torch.Generator().manual_seed(tokens))
    return RotaryEmbedding(head_dim, 4096, 1_000_000.0)(positions)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim", "rotary_dim"),
    [(5, 6, 2, 128, 128), (3, 4, 2, 64, 64), (1, 2, 1, 96, 96), (4, 4, 2, 64, 32), (3, 2, 2, 32, 8)],
)  # the last two: partial rotary (LLaDA2 rotates half of each head), the rest of the head normed, not rotated
@pytest.mark.parametrize("with_norm", [True, False])
def test_qk_norm_rope_matches_the_torch_path(dtype, tokens, heads, kv_heads, head_dim, rotary_dim, with_norm):
    q, k = qkv_views(tokens, heads, kv_heads, head_dim, dtype, seed=heads * head_dim)
    assert tokens == 1 or q.stride(0) == k.stride(0) == (heads + 2 * kv_heads) * head_dim  # strided views
    cos, sin = rope(tokens, rotary_dim)
    q_norm = make_norm(head_dim, dtype, 1) if with_norm else None
    k_norm = make_norm(head_dim, dtype, 2) if with_norm else None
    with torch.no_grad():
        q_cpu, k_cpu = q.cpu(), k.cpu()
        if with_norm:
            q_cpu, k_cpu = q_norm(q_cpu), k_norm(k_cpu)
        expected_q, expected_k = apply_rotary(q_cpu, cos, sin), apply_rotary(k_cpu, cos, sin)
        actual_q, actual_k = qk_norm_rope(
            q, k, cos.to(DEVICE), sin.to(DEVICE), q_norm and q_norm.weight.to(DEVICE),
            k_norm and k_norm.weight.to(DEVICE), 1e-6,
        )
    assert actual_q.is_contiguous() and actual_k.is_contiguous()
    scale = 4.0 if with_norm else 8.0  # the rotated values' magnitude: normed (weights ~1 +- 0.3) or 2 * randn
    assert_matches(actual_q, expected_q, scale)
    assert_matches(actual_k, expected_k, scale)


def test_rotate_qk_on_the_cpu_is_the_torch_code_exactly():
    q, k = (t.cpu() for t in qkv_views(3, 4, 2, 64, torch.bfloat16, seed=0))
    cos, sin = rope(3, 64)
    q_norm, k_norm = make_norm(64, torch.bfloat16, 1), make_norm(64, torch.bfloat16, 2)
    with torch.no_grad():
        got_q, got_k = rotate_qk(q, k, cos, sin, q_norm, k_norm)
        assert torch.equal(got_q, apply_rotary(q_norm(q), cos, sin))
        assert torch.equal(got_k, apply_rotary(k_norm(k), cos, sin))
        assert torch.equal(rotate_qk(q, k, cos, sin)[0], apply_rotary(q, cos, sin))
    with pytest.raises(ValueError):
        rotate_qk(q, k, cos, sin, q_norm, None)


def test_the_fused_path_is_only_taken_on_cuda_outside_autograd():
    x = torch.randn(2, 8)
    assert not use_fused_kernels(x)  # CPU: the torch code stays the CPU path
    assert not use_fused_kernels(None)
    if torch.cuda.is_available():
        w = torch.nn.Parameter(torch.ones(8, device="cuda"))
        assert not use_fused_kernels(x.cuda(), w)  # autograd records: training keeps the torch ops
        with torch.no_grad():
            assert use_fused_kernels(x.cuda(), w)
