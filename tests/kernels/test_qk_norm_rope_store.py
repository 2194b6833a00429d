"""q/k norm + rotary with the KV store in the same launch: bit for bit the two launches it replaces.

The fused kernel must leave q, k and both caches exactly as `qk_norm_rope` followed by `triton_store_kv` of the
rotated k would (the attention layer relies on it to keep every path's results identical), skipped rows
(``slot < 0``) untouched, with and without the q/k norm weights, for GQA and plain multi-head layouts.
"""

from __future__ import annotations

import pytest
import torch

from diffulex.attention.torch_paged import store_kv
from diffulex.kernels.fused_norm import qk_norm_rope, qk_norm_rope_store
from diffulex.kernels.kv_store import triton_store_kv
from tests.kernels.test_fused_norm import make_norm, rope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def qkv_views(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str, seed: int):
    """q, k and v as the attention layer gets them: views of one fused ``[T, (H + 2 Hkv) D]`` projection output."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (2 * torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)).to(dtype).to(device)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    return q, k, v


def slots_and_caches(tokens, kv_heads, head_dim, page_size, cache_dtype, device, seed):
    """Distinct random slots, every third row from the second on skipped; caches of random old contents."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = max(6, -(-tokens // page_size) + 2)  # room for every row's slot, and some never written
    slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens]
    skip = torch.arange(tokens) % 3 == 1
    slot_mapping = torch.where(skip, -1, slots).to(torch.int64).to(device)
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(device)
    return slot_mapping, k_cache, v_cache


def check_fused_equals_separate(
    tokens, heads, kv_heads, head_dim, page_size, dtype, with_norm, seed=0, rotary_dim=None
):
    q, k, v = qkv_views(tokens, heads, kv_heads, head_dim, dtype, DEVICE, seed)
    cos, sin = (t.to(DEVICE) for t in rope(tokens, rotary_dim or head_dim))
    weights = (None, None)
    if with_norm:
        weights = (make_norm(head_dim, dtype, 1).weight.to(DEVICE), make_norm(head_dim, dtype, 2).weight.to(DEVICE))
    slot_mapping, k_cache, v_cache = slots_and_caches(tokens, kv_heads, head_dim, page_size, dtype, DEVICE, seed)
    with torch.no_grad():
        ref_q, ref_k = qk_norm_rope(q, k, cos, sin, *weights, 1e-6)
        ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
        triton_store_kv(ref_k, v, ref_kc, ref_vc, slot_mapping)
        got_kc, got_vc = k_cache.clone(), v_cache.clone()
        got_q, got_k = qk_norm_rope_store(q, k, v, cos, sin, *weights, 1e-6, got_kc, got_vc, slot_mapping)
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)
    assert torch.equal(got_kc, ref_kc) and torch.equal(got_vc, ref_vc)
    stored = slot_mapping >= 0
    assert stored.any() and (tokens == 1 or not stored.all())  # both kinds of row were exercised
    untouched = torch.ones(k_cache.shape[0] * page_size, dtype=torch.bool, device=DEVICE)
    untouched[slot_mapping[stored]] = False
    assert torch.equal(got_kc.flatten(0, 1)[untouched], k_cache.flatten(0, 1)[untouched])
    assert torch.equal(got_vc.flatten(0, 1)[untouched], v_cache.flatten(0, 1)[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim", "page_size"),
    [(7, 6, 2, 64, 4), (5, 4, 1, 32, 8), (4, 2, 2, 16, 16)],  # GQA 3:1, MQA, plain multi-head
)
def test_fused_store_equals_rope_then_store(tokens, heads, kv_heads, head_dim, page_size, dtype, with_norm):
    check_fused_equals_separate(tokens, heads, kv_heads, head_dim, page_size, dtype, with_norm, seed=heads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [True, False])
def test_partial_rotary_stores_the_unrotated_rest_of_k_too(dtype, with_norm):
    check_fused_equals_separate(6, 4, 2, 32, 4, dtype, with_norm, seed=3, rotary_dim=16)


def test_int32_slots_all_skipped_and_empty():
    q, k, v = qkv_views(3, 4, 2, 32, torch.float32, DEVICE, seed=5)
    cos, sin = (t.to(DEVICE) for t in rope(3, 32))
    k_cache, v_cache = (torch.zeros(2, 4, 2, 32, device=DEVICE) for _ in range(2))
    skipped = torch.full((3,), -1, dtype=torch.int32, device=DEVICE)
    got_q, got_k = qk_norm_rope_store(q, k, v, cos, sin, None, None, 0.0, k_cache, v_cache, skipped)
    ref_q, ref_k = qk_norm_rope(q, k, cos, sin, None, None, 0.0)
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)
    assert not k_cache.any() and not v_cache.any()

    slots = torch.tensor([5, -1, 0], dtype=torch.int32, device=DEVICE)
    qk_norm_rope_store(q, k, v, cos, sin, None, None, 0.0, k_cache, v_cache, slots)
    ref_kc, ref_vc = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    store_kv(ref_k, v, ref_kc, ref_vc, slots.long())
    assert torch.equal(k_cache, ref_kc) and torch.equal(v_cache, ref_vc)

    empty = qk_norm_rope_store(
        q[:0], k[:0], v[:0], cos[:0], sin[:0], None, None, 0.0, k_cache, v_cache, slots[:0]
    )
    assert empty[0].shape == (0, 4, 32) and empty[1].shape == (0, 2, 32)


@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_cache_of_another_dtype_gets_what_store_kv_writes(dtype, cache_dtype):
    """The cast to the cache dtype rounds like ``Tensor.to`` (`store_kv`); under the interpreter `triton_store_kv`
    truncates fp32 -> bf16 instead, so the reference here is the torch store."""
    q, k, v = qkv_views(6, 4, 2, 32, dtype, DEVICE, seed=9)
    cos, sin = (t.to(DEVICE) for t in rope(6, 32))
    weights = (make_norm(32, dtype, 1).weight.to(DEVICE), make_norm(32, dtype, 2).weight.to(DEVICE))
    slot_mapping, k_cache, v_cache = slots_and_caches(6, 2, 32, 4, cache_dtype, DEVICE, seed=9)
    with torch.no_grad():
        ref_q, ref_k = qk_norm_rope(q, k, cos, sin, *weights, 1e-6)
        ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
        store_kv(ref_k, v, ref_kc, ref_vc, slot_mapping)
        got_q, got_k = qk_norm_rope_store(q, k, v, cos, sin, *weights, 1e-6, k_cache, v_cache, slot_mapping)
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)
    assert torch.equal(k_cache, ref_kc) and torch.equal(v_cache, ref_vc)


def test_rejects_what_it_cannot_store():
    q, k, v = qkv_views(3, 4, 2, 32, torch.float32, DEVICE, seed=1)
    cos, sin = (t.to(DEVICE) for t in rope(3, 32))
    slots = torch.arange(3, device=DEVICE)
    cache = torch.zeros(2, 4, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        qk_norm_rope_store(q, k, v, cos, sin, None, None, 0.0, cache, cache.clone(), slots[:2])
    with pytest.raises(ValueError, match="v "):
        qk_norm_rope_store(q, k, v[:, :1], cos, sin, None, None, 0.0, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="caches"):
        qk_norm_rope_store(q, k, v, cos, sin, None, None, 0.0, cache[:, :, :1], cache.clone(), slots)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="realistic shapes run natively on a GPU only")
@pytest.mark.parametrize("tokens", [1, 4, 16, 17, 256])  # PDL on up to 16 rows, off above
@pytest.mark.parametrize(("heads", "kv_heads", "with_norm"), [(16, 8, True), (32, 8, True), (32, 32, False)])
def test_realistic_shapes_on_the_gpu(tokens, heads, kv_heads, with_norm):
    """SDAR-1.7B / 4B-like (Qwen3: q/k norm, GQA) and LLaDA-8B-like (no norm, MHA) layers, bf16, page 16."""
    check_fused_equals_separate(tokens, heads, kv_heads, 128, 16, torch.bfloat16, with_norm, seed=tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="realistic shapes run natively on a GPU only")
@pytest.mark.parametrize("tokens", [1, 32, 33])
def test_llada2_shapes_on_the_gpu(tokens):
    """LLaDA2.0-mini's layer: 16 heads, 4 KV heads, q/k norm, rotary on 64 of 128 dims, bf16, page 32."""
    check_fused_equals_separate(tokens, 16, 4, 128, 32, torch.bfloat16, True, seed=tokens, rotary_dim=64)
