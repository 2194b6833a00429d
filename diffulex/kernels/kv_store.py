"""Triton KV-cache store: write each new row's K/V into its cache slot, skipping rows whose slot is negative.

Matches `diffulex.attention.torch_paged.store_kv`. The cache is ``[num_pages, page_size, kv_heads, head_dim]``;
slot ``s`` is page ``s // page_size``, offset ``s % page_size``. One program per row copies ``[kv_heads, head_dim]``
of K and of V (cast to the cache dtype); rows with ``slot < 0`` (not committed, or shifted rows that must not be
stored again) return without touching the cache. No host syncs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffulex.kernels.pdl import launch_kwargs, pdl_enabled, release_dependents, wait_for_inputs


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_kc_p,
    stride_kc_s,
    stride_kc_h,
    stride_vc_p,
    stride_vc_s,
    stride_vc_h,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_dependents(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)  # step metadata, copied in before the forward
    wait_for_inputs(USE_PDL)  # also in skipped rows: this launch must not complete before its predecessor
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    in_page = slot % PAGE_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + row * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + row * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
    kc = k_cache_ptr + page * stride_kc_p + in_page * stride_kc_s + offs_h[:, None] * stride_kc_h + offs_d[None, :]
    vc = v_cache_ptr + page * stride_vc_p + in_page * stride_vc_s + offs_h[:, None] * stride_vc_h + offs_d[None, :]
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def kv_store_mismatch(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> str | None:
    """Why ``k``/``v`` cannot be stored into these caches (`triton_store_kv`, `qk_norm_rope_store`), or None when
    they can (callers that have another path check this first)."""
    if v.shape != k.shape:
        return f"v {tuple(v.shape)} must have k's shape {tuple(k.shape)}"
    if slot_mapping.shape != (k.shape[0],):
        return f"slot_mapping has shape {tuple(slot_mapping.shape)}, k has {k.shape[0]} rows"
    if k_cache.shape[2:] != k.shape[1:] or v_cache.shape != k_cache.shape:
        return f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not hold k {tuple(k.shape)}"
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        return "the KV cache must be contiguous in head_dim"
    return None


def triton_store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Drop-in for `store_kv`: k/v ``[T, kv_heads, head_dim]``, caches ``[P, page_size, kv_heads, head_dim]``."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    mismatch = kv_store_mismatch(k, v, k_cache, v_cache, slot_mapping)
    if mismatch is not None:
        raise ValueError(mismatch)
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    use_pdl = pdl_enabled(k.device, num_tokens)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim),
        PAGE_SIZE=k_cache.shape[1],
        USE_PDL=use_pdl,
        num_warps=4,
        **launch_kwargs(use_pdl),
    )
