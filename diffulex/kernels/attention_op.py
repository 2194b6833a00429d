"""The Triton KV store + paged attention of one layer: eagerly, fused with rotary, and as a PyTorch custom op
for ``torch.compile``.

Eager code on the Triton backend calls `rope_store_and_attend`: the KV store rides in the q/k norm + rotary
launch (`diffulex.kernels.fused_norm.qk_norm_rope_store`), so attention follows with no store launch of its own.
`store_and_attend` is the same step for q/k that arrive rotated (the layer's fallback when the fused launch does
not apply).

Compiling the model forward must leave attention opaque: its launch shapes come from host integers and it writes
the KV cache in place. Registered as an op with declared mutations (``k_cache``, ``v_cache``) and a fake
implementation, it sits inside one traced graph instead of splitting the graph at every layer; rotary stays in
the graph, for inductor to fuse. Eager code calls the functions directly and skips the dispatcher.
"""

from __future__ import annotations

import torch

from diffulex.attention.metadata import PagedAttentionMetadata
from diffulex.kernels.fused_norm import qk_norm_rope_store
from diffulex.kernels.kv_store import triton_store_kv
from diffulex.kernels.paged_attention import triton_paged_attention


def store_and_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    grouped: bool,
) -> torch.Tensor:
    """Write the step's committed K/V into the cache, then attend (q ``[T, H, D]`` -> ``[T, H, D]``)."""
    if torch.compiler.is_compiling():
        return torch.ops.diffulex.paged_attention_step(
            q, k, v, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.prefix_lens, meta.page_tables,
            meta.slot_mapping, scale, meta.block_size, meta.page_size, meta.prefix_full, meta.max_query_len,
            meta.max_kv_len, grouped, meta.key_lens, meta.num_splits, meta.min_split_keys,
        )
    triton_store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return triton_paged_attention(q, k, v, k_cache, v_cache, meta, scale, grouped=grouped)


def rope_store_and_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    grouped: bool,
) -> torch.Tensor:
    """`store_and_attend` of un-rotated q/k in two launches: norm + rotary + KV store, then attention.

    Eager only (the caller takes the unfused path while ``torch.compile`` traces). Same bits as `rotate_qk`
    followed by `store_and_attend`.
    """
    q, k = qk_norm_rope_store(q, k, v, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, meta.slot_mapping)
    return triton_paged_attention(q, k, v, k_cache, v_cache, meta, scale, grouped=grouped)


@torch.library.custom_op("diffulex::paged_attention_step", mutates_args=("k_cache", "v_cache"))
def _paged_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    page_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float,
    block_size: int,
    page_size: int,
    prefix_full: bool,
    max_query_len: int,
    max_kv_len: int,
    grouped: bool,
    key_lens: torch.Tensor | None = None,
    num_splits: int | None = None,
    min_split_keys: int | None = None,
) -> torch.Tensor:
    meta = PagedAttentionMetadata(
        cu_seqlens_q=cu_seqlens_q,
        context_lens=context_lens,
        prefix_lens=prefix_lens,
        page_tables=page_tables,
        slot_mapping=slot_mapping,
        block_size=block_size,
        page_size=page_size,
        prefix_full=prefix_full,
        query_lens_cpu=[],
        context_lens_cpu=[],
        prefix_lens_cpu=[],
        max_query_len=max_query_len,
        max_kv_len=max_kv_len,
        key_lens=key_lens,
        num_splits=num_splits,
        min_split_keys=min_split_keys,
    )
    triton_store_kv(k, v, k_cache, v_cache, slot_mapping)
    return triton_paged_attention(q, k, v, k_cache, v_cache, meta, scale, grouped=grouped)


@_paged_attention_step.register_fake
def _(q, k, v, k_cache, v_cache, cu_seqlens_q, context_lens, prefix_lens, page_tables, slot_mapping, scale,
      block_size, page_size, prefix_full, max_query_len, max_kv_len, grouped, key_lens=None, num_splits=None,
      min_split_keys=None):
    return torch.empty_like(q)
