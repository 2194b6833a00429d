"""Triton KV-cache store against `store_kv`: same cache contents, skipped rows leave the cache untouched."""

from __future__ import annotations

import pytest
import torch

from diffulex.attention.torch_paged import store_kv
from diffulex.kernels.kv_store import triton_store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "page_size"), [(1, 16, 4), (2, 32, 8), (3, 16, 16), (8, 128, 16)])
def test_matches_reference(num_kv_heads, head_dim, page_size, cache_dtype):
    gen = torch.Generator().manual_seed(num_kv_heads * 100 + page_size)
    num_pages, num_tokens = 12, 21
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(cache_dtype).to(DEVICE)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(cache_dtype).to(DEVICE)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens]
    skip = torch.rand(num_tokens, generator=gen) < 0.3
    skip[0] = True
    slot_mapping = torch.where(skip, -1, slots).to(torch.int64).to(DEVICE)
    base_k = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype).to(DEVICE)
    base_v = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype).to(DEVICE)

    ref_k, ref_v = base_k.clone(), base_v.clone()
    store_kv(k, v, ref_k, ref_v, slot_mapping)
    got_k, got_v = base_k.clone(), base_v.clone()
    triton_store_kv(k, v, got_k, got_v, slot_mapping)
    assert torch.equal(got_k, ref_k)
    assert torch.equal(got_v, ref_v)
    assert not torch.equal(got_k, base_k)


def test_casts_to_cache_dtype():
    """fp32 rows into a bf16 cache: equal up to the rounding of the cast (the interpreter may round differently)."""
    k = torch.randn(6, 2, 16, device=DEVICE)
    slot_mapping = torch.tensor([1, 2, -1, 4, 9, 0], dtype=torch.int64, device=DEVICE)
    ref_k, ref_v = (torch.zeros(3, 4, 2, 16, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    store_kv(k, -k, ref_k, ref_v, slot_mapping)
    got_k, got_v = torch.zeros_like(ref_k), torch.zeros_like(ref_v)
    triton_store_kv(k, -k, got_k, got_v, slot_mapping)
    torch.testing.assert_close(got_k.float(), ref_k.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got_v.float(), ref_v.float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(got_k == 0, ref_k == 0)


def test_all_skipped_and_empty():
    k = torch.randn(3, 2, 16, device=DEVICE)
    cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    v_cache = torch.zeros_like(cache)
    triton_store_kv(k, k, cache, v_cache, torch.full((3,), -1, dtype=torch.int64, device=DEVICE))
    assert not cache.any() and not v_cache.any()
    triton_store_kv(k[:0], k[:0], cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert not cache.any()


def test_int32_slots_and_strided_inputs():
    kv = torch.randn(5, 2 * 2, 16, device=DEVICE)  # fused k|v heads: k and v are strided views
    k, v = kv[:, :2], kv[:, 2:]
    slot_mapping = torch.tensor([3, -1, 0, 7, 5], dtype=torch.int32, device=DEVICE)
    ref_k, ref_v = torch.zeros(2, 4, 2, 16, device=DEVICE), torch.zeros(2, 4, 2, 16, device=DEVICE)
    store_kv(k, v, ref_k, ref_v, slot_mapping.long())
    got_k, got_v = torch.zeros_like(ref_k), torch.zeros_like(ref_v)
    triton_store_kv(k, v, got_k, got_v, slot_mapping)
    assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
